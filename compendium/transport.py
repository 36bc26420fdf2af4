"""Dictionary-compressed submissions: RFC 9842's `dcz` content coding, with the compendium the
client pulled as the dictionary.

A client's round mostly repeats what the federation already published: the same tools, the same
JSON shape, masked requests worded like the scenarios other clients sent. Zstandard with the
canonical bytes of the pulled global compendium as a raw-content dictionary codes those repeats as
references into text the server already holds, so only what is new costs bytes (MetaTool, 5 orgs
x 4 clients: about 30% fewer bytes on the wire than gzip, see README "Results"). Before any global
is published the schema in force (the public tool registry) serves as the dictionary, after the
requests of the public probe set when the client has fetched it: a client's first requests are
worded like those public ones (MetaTool: a fifth fewer bytes in round 1 than the schema alone).

The format is RFC 9842's "Dictionary-Compressed Zstandard": a 40-byte zstd skippable frame whose
payload is the SHA-256 of the dictionary, then one zstd frame compressed with that dictionary.
The hash names the dictionary, so the server needs no other header to find it; a client whose
dictionary the server does not hold is told so and sends gzip instead.

Pure: no Django.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import zstandard

from compendium.canonical import canonical_bytes, encode_document
from compendium.schema import Compendium, Schema

CONTENT_ENCODING = "dcz"
# A skippable frame (magic 0x184D2A5E, little-endian) of 32 bytes: the dictionary's SHA-256.
HEADER_MAGIC = b"\x5e\x2a\x4d\x18\x20\x00\x00\x00"
HEADER_SIZE = len(HEADER_MAGIC) + 32
LEVEL = 19
# RFC 9842 section 4.2: a dcz stream's window is at most 8 MB (or 1.25 x the dictionary, up to
# 128 MB); the decoder refuses larger windows, so a frame cannot make it reserve more.
MAX_WINDOW = 1 << 27


class DczError(ValueError):
    """The body is not a dcz stream this server can read; the message says why."""


class DczTooLarge(DczError):
    """The stream declares, or inflates to, more than the limit."""


def schema_dictionary(schema: Schema) -> bytes:
    """The dictionary before any global is published: the schema's canonical JSON (sorted keys,
    compact; the tools in tool-id order and the numeric fields in name order, as the server
    serves them), which client and server derive alike from the same schema, however a client's
    copy orders its tools (the simulation's clients, whose schema listed the tools in the
    dataset's order, held another dictionary, which the server refused as unknown)."""
    document = schema.model_dump(mode="json")
    document["tools"] = sorted(document["tools"], key=lambda tool: tool["tool_id"])
    document["numeric_fields"] = sorted(document["numeric_fields"], key=lambda f: f["name"])
    return encode_document(document)


def probe_dictionary(schema: Schema, probe_texts: Sequence[str]) -> bytes:
    """The dictionary before any global is published, for a client holding the public probe set
    (`GET /api/v1/compendium/probe/`): its requests, in the server's order, as the canonical JSON
    of `{"probe": [...]}`, then the schema's dictionary (the end of a zstd dictionary is the
    cheapest to refer to). Without probe requests it is the schema's dictionary."""
    if not probe_texts:
        return schema_dictionary(schema)
    return probe_bytes(probe_texts) + schema_dictionary(schema)


def probe_bytes(probe_texts: Sequence[str]) -> bytes:
    """The probe requests as that dictionary holds them; their SHA-256 names the probe set."""
    return encode_document({"probe": list(probe_texts)})


def probe_texts_of(document: object) -> list[str]:
    """The requests of a probe-set document as the probe endpoint serves it (`{"count", "sha256",
    "texts"}`), checked against its `sha256`; ValueError naming what is wrong."""
    texts = document.get("texts") if isinstance(document, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError("a probe set is an object whose 'texts' is a list of strings")
    if document.get("sha256") != dictionary_hash(probe_bytes(texts)):
        raise ValueError("its 'sha256' does not match its texts")
    return texts


def probe_labelled_of(document: object) -> list[tuple[str, str]] | None:
    """The (request, tool id) pairs of a probe-set document (`probe_texts_of` checks the
    requests) to route with: from its `labels` (a tool id, or null for a request the server
    gives no tool: its tool is deactivated or not in the registry, and such a request is no
    pair), else from its `tools` (a server before `labels`), or None when it has neither;
    ValueError naming what is wrong."""
    texts = probe_texts_of(document)
    labels = document.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or not all(
            label is None or (isinstance(label, str) and label) for label in labels
        ):
            raise ValueError("its 'labels' is not a list of tool ids and nulls")
        if len(labels) != len(texts):
            raise ValueError(f"it has {len(labels)} label(s) for {len(texts)} request(s)")
        return [(text, label) for text, label in zip(texts, labels, strict=True)
                if label is not None]
    tools = document.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
        raise ValueError("its 'tools' is not a list of tool ids")
    if len(tools) != len(texts):
        raise ValueError(f"it has {len(tools)} tool id(s) for {len(texts)} request(s)")
    return list(zip(texts, tools, strict=True))


def global_dictionary(compendium: Compendium) -> bytes:
    """A published global's dictionary: its canonical bytes, whose SHA-256 is the global's
    published `sha256` (and its ETag)."""
    return canonical_bytes(compendium)


def dictionary_hash(dictionary: bytes) -> str:
    return hashlib.sha256(dictionary).hexdigest()


def _zstd_dictionary(dictionary: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def compress(data: bytes, dictionary: bytes, level: int = LEVEL) -> bytes:
    """`data` as a dcz body against `dictionary` (at least 8 bytes, zstd's minimum), at zstd
    `level` (any level's body decodes alike)."""
    if len(dictionary) < 8:
        raise ValueError("a zstd dictionary needs at least 8 bytes")
    compressor = zstandard.ZstdCompressor(level=level, dict_data=_zstd_dictionary(dictionary))
    return HEADER_MAGIC + hashlib.sha256(dictionary).digest() + compressor.compress(data)


def body_dictionary_hash(body: bytes) -> str:
    """The hex SHA-256 of the dictionary a dcz body was compressed with."""
    if len(body) < HEADER_SIZE or not body.startswith(HEADER_MAGIC):
        raise DczError(
            "the body is not a dcz stream: it must start with the 40-byte skippable frame that "
            "holds the dictionary's SHA-256 (RFC 9842)"
        )
    return body[len(HEADER_MAGIC) : HEADER_SIZE].hex()


def decompress(body: bytes, dictionary: bytes, limit: int) -> bytes:
    """The data of a dcz `body` compressed against `dictionary`, never more than `limit` bytes:
    the frame must declare its size (the compressor writes it), a size over the limit is refused
    before anything is inflated, and the inflated data is held to the declared size."""
    if body_dictionary_hash(body) != dictionary_hash(dictionary):
        raise DczError("the body was compressed against another dictionary")
    frame = body[HEADER_SIZE:]
    try:
        parameters = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise DczError(f"the body's zstd frame is not readable ({exc})") from None
    size = parameters.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise DczError("the body's zstd frame must declare its content size")
    if size > limit:
        raise DczTooLarge(f"the decompressed body would be {size} bytes; the limit is {limit}")
    decompressor = zstandard.ZstdDecompressor(
        dict_data=_zstd_dictionary(dictionary), max_window_size=MAX_WINDOW
    )
    try:
        return decompressor.decompress(frame, max_output_size=limit, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise DczError(f"the body's zstd frame does not decompress ({exc})") from None
