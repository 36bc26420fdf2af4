"""Canonical bytes of a compendium: the same compendium always gives the same bytes.

Keys are sorted, separators fixed, text kept as UTF-8, absent values and empty preconditions left
out (they are the defaults), and the entries of each component sorted,
since M, U, P, T and A are sets: two clients that send the same entries in another order send the
same compendium. The byte size of this form is what "bytes per client per round" measures.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from compendium.schema import Compendium

try:  # a faster encoder, used only where it writes exactly the bytes json.dumps writes
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json.dumps suffices
    orjson = None

_SORT_KEYS = {
    "metadata": lambda e: (e["tool_id"],),
    "scenarios": lambda e: (e["tool_id"], e["text"], json.dumps(e.get("preconditions", {}), sort_keys=True)),
    "precautions": lambda e: (e["tool_id"], e["text"]),
    "templates": lambda e: (e["tool_id"], e["signature"], e["template"]),
    "annex": lambda e: (e["subject"], e["relation"], e["object"]),
}


def _order(name: str, entries: list[dict]) -> list[int]:
    """The positions of `entries` (one component's, as dumped) in canonical order: a stable sort by
    `_SORT_KEYS[name]`, so that equal entries keep their relative order. For scenarios the key's
    third part (the preconditions as JSON) only decides between scenarios of the same tool and
    text, so when no two share both, sorting by the first two gives the same order without a
    json.dumps per scenario."""
    if name == "scenarios":
        pairs = [(s["tool_id"], s["text"]) for s in entries]
        if len(set(pairs)) == len(pairs):
            return sorted(range(len(entries)), key=pairs.__getitem__)
    key = _SORT_KEYS[name]
    keys = [key(e) for e in entries]
    return sorted(range(len(entries)), key=keys.__getitem__)


def _canonical_entry(section: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Fields at their defaults are left out: no preconditions (18 bytes a scenario) and a
    support of 1 (12 bytes a scenario or precaution, most of what a client sends)."""
    if section == "scenarios" and not entry.get("preconditions"):
        entry.pop("preconditions", None)
    if section in ("scenarios", "precautions") and entry.get("support") == 1:
        entry.pop("support")
    return entry


def canonical_dict(compendium: Compendium) -> dict[str, Any]:
    doc = compendium.model_dump(mode="json", exclude_none=True)
    for section in ("scenarios", "precautions"):
        for entry in doc.get(section, []):
            _canonical_entry(section, entry)
    for name in _SORT_KEYS:
        entries = doc.get(name, [])
        doc[name] = [entries[i] for i in _order(name, entries)]
    return doc


def canonical_positions(compendium: Compendium) -> dict[str, list[int]]:
    """Where each entry of the canonical form comes from: for each component ("metadata",
    "scenarios", ...), the position in `compendium`'s own list of its canonical entry 0, 1, ....
    A JSON path the server computes on the canonical bytes (`$.scenarios[12]`) names entry
    `canonical_positions(c)["scenarios"][12]` of the compendium as it was loaded from its file."""
    doc = compendium.model_dump(mode="json", exclude_none=True)
    return {name: _order(name, doc.get(name, [])) for name in _SORT_KEYS}


def canonical_bytes(compendium: Compendium) -> bytes:
    return encode_document(canonical_dict(compendium))


# Digits as "0" and E as e, to look for number shapes with bytes.find.
_NUMBER_SHAPES = bytes.maketrans(b"123456789E", b"000000000e")


def _orjson_agrees(data: bytes) -> bool:
    """Whether orjson's compact, key-sorted output is what json.dumps writes with the options of
    `encode_document`. They differ only on numbers json.dumps writes with an exponent (below 1e-4 or from
    1e16: 1e-05, 1e+16), which orjson writes as 1e-5, 0.00001 or 10000000000000000.0, so any digit
    followed by an exponent, 17 digits in a row, or 0.0000 (in a string too) sends the document
    the standard way; and on NaN and infinities, which orjson writes as null where json.dumps
    refuses them (the canonical form has no null)."""
    if b"null" in data or b"0.0000" in data:
        return False
    shapes = data.translate(_NUMBER_SHAPES)
    return b"0e" not in shapes and b"0" * 17 not in shapes


def encode_document(doc: dict[str, Any]) -> bytes:
    """Canonical JSON of any document: keys sorted, compact separators, UTF-8, no NaN."""
    if orjson is not None:
        try:
            data = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:  # integers past 64 bits, lone surrogates, NaN
            data = None
        if data is not None and _orjson_agrees(data):
            return data
    return json.dumps(
        doc,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def entry_size(section: str, entry: Any) -> int:
    """Bytes one entry (a pydantic model of `section`: "scenarios", "precautions", ...) adds to a
    canonical document: its canonical JSON and the comma that separates it from the next."""
    return len(encode_document(_canonical_entry(section, entry.model_dump(mode="json", exclude_none=True)))) + 1


def gzip_bytes(data: bytes) -> bytes:
    # mtime=0 keeps the compressed form deterministic as well.
    return gzip.compress(data, compresslevel=9, mtime=0)


@dataclass(frozen=True)
class CanonicalForm:
    data: bytes
    sha256: str
    size_bytes: int
    gzip_bytes: int
    # The canonical dict the bytes encode (what a stored version's `content` holds).
    document: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def canonical_form(compendium: Compendium) -> CanonicalForm:
    document = canonical_dict(compendium)
    data = encode_document(document)
    return CanonicalForm(
        document=document,
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        gzip_bytes=len(gzip_bytes(data)),
    )
