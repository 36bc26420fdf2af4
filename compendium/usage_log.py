"""The client's usage log: one routed request a line, read with every bad line reported.

Pure (standard library; user ids normalized as compendium.masking reads text, flag names
checked as compendium.scrub reads them, a key twice in one object refused as
compendium.validation reads JSON). The format, one JSON object per line:

    {"query": "...", "tool": "weather", "outcome": "success", "latency_ms": 320, "user": "u17",
     "corrected_to": null, "preconditions": {"has_city": true},
     "template": {"signature": "forecast(city)", "template": "Forecast for {city}"}}

- `query` (string, required): what the user asked; raw text, never sent as is.
- `tool` (string, required): the tool the client's router chose.
- `outcome` (required): "success", "failure", or "corrected" (the chosen tool was wrong and the
  user or an operator switched to `corrected_to`).
- `corrected_to` (string): required when, and only when, `outcome` is "corrected".
- `latency_ms` (number >= 0, required): how long the tool call took.
- `user` (string or integer, required): a stable pseudonymous id of the end user, used only to
  bound each user's contribution to the numeric statistics; it never leaves the client.
- `preconditions` (object of boolean flags, optional), `template` (object with string
  `signature` and `template`, optional): carried into the scenario and the template store.
  Flag names are identifiers sent as written (neither masked nor scrubbed): one that holds what
  the server's scrub takes for personal data (`compendium.scrub.flag_name_holds`: a phone, card
  or long number, an e-mail address spelled "at" and "dot") is an error of its line.
Other keys (timestamps, request ids) are ignored; a key given twice in one object is an error of
its line. Blank lines are skipped.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compendium.masking import normalized
from compendium.scrub import flag_name_holds
from compendium.validation import DuplicateKey, is_blank, no_duplicate_keys

OUTCOMES = ("success", "failure", "corrected")
_FLAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}\Z")  # \Z: `$` takes "has_city\n"
MAX_LINE_BYTES = 1_000_000


@dataclass(frozen=True)
class Template:
    signature: str
    template: str


@dataclass(frozen=True)
class UsageRecord:
    line: int
    query: str
    tool: str
    outcome: str
    latency_ms: float
    user: str
    corrected_to: str | None = None
    preconditions: tuple[tuple[str, bool], ...] = ()
    template: Template | None = None

    @property
    def flags(self) -> dict[str, bool]:
        return dict(self.preconditions)


@dataclass(frozen=True)
class LogLineError:
    line: int
    message: str

    def format(self, source: str) -> str:
        return f"{source}:{self.line}: {self.message}"


@dataclass
class UsageLog:
    source: str
    records: list[UsageRecord] = field(default_factory=list)
    errors: list[LogLineError] = field(default_factory=list)
    lines_read: int = 0

    @property
    def users(self) -> set[str]:
        return {r.user for r in self.records}

    def error_lines(self) -> list[str]:
        return [e.format(self.source) for e in self.errors]


class UsageLogError(ValueError):
    """The log has bad lines and the caller did not ask to skip them; carries every error."""

    def __init__(self, log: UsageLog):
        self.log = log
        first = log.error_lines()[:3]
        more = f" (and {len(log.errors) - 3} more)" if len(log.errors) > 3 else ""
        super().__init__(
            f"{len(log.errors)} malformed line(s) in {log.source}: " + "; ".join(first) + more
        )


class NotUtf8Log(ValueError):
    """The log is not UTF-8 text at all (UTF-16, as Windows PowerShell 5.1 writes with `>` or
    Out-File; a gzip-compressed log; another binary file): one error for the file, not one per
    line. `problem` is what it is instead (`_not_utf8`)."""

    def __init__(self, source: str, problem: str = "utf-16"):
        super().__init__(
            f"{source} is gzip-compressed, not UTF-8 text; decompress it (gunzip) and build again"
            if problem == "gzip" else
            f"{source} is not a text file (it holds NUL bytes): a usage log is UTF-8 text, one "
            "JSON object a line" if problem == "binary" else
            f"{source} is UTF-16, not UTF-8; save it as UTF-8 (e.g. Out-File -Encoding utf8) and "
            "build again"
        )


class OverlongLine(int):
    """What `log_lines` yields in place of a line longer than MAX_LINE_BYTES: its length in
    bytes (the line itself is never held in memory)."""


_CHUNK = 1 << 16


def log_lines(handle) -> Iterable[bytes | OverlongLine]:
    """The lines of a binary file, each read with at most MAX_LINE_BYTES + 1 bytes in memory: a
    longer line is skipped to its newline a chunk at a time and yielded as its `OverlongLine`
    length, which `parse_lines` reports."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        length = len(line)
        del line  # only its length is kept
        while True:
            chunk = handle.readline(_CHUNK)
            length += len(chunk)
            if not chunk or chunk.endswith(b"\n"):
                break
        yield OverlongLine(length)


def _not_utf8(first: bytes) -> str | None:
    """What line 1 shows the file is instead of UTF-8 text ("utf-16", "gzip", "binary"), or None.
    UTF-16: its byte order mark, or (without one) NUL bytes in a line that reads as a JSON object
    in UTF-16 (ASCII characters bring one along each; a line of mostly Chinese has few). Any
    other NUL byte, which no UTF-8 JSON line holds: a compressed or binary file (not to be told
    to save it as UTF-8)."""
    if first.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    if first.startswith(b"\x1f\x8b"):
        return "gzip"
    if b"\x00" not in first:
        return None
    # readline splits UTF-16-LE's newline (0A 00) after its first byte: an odd line
    even = first[: len(first) // 2 * 2]
    for codec in ("utf-16-le", "utf-16-be"):
        if even.decode(codec, errors="replace").lstrip()[:1] == "{":
            return "utf-16"
    return "binary"


def _unicode(key: str, value: str) -> str:
    """`value`, unless it holds a lone surrogate (JSON can escape half an emoji: "\\ud83d"),
    which is not text: nothing could encode or store it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"'{key}' holds a lone surrogate at character {exc.start} (half of an escaped "
            "character), which is not text"
        ) from None
    return value


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (not Python's "NoneType", "list", "int")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _string(item: dict, key: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        kind = "missing" if key not in item else f"{json_type(value)}, not a string"
        raise ValueError(f"'{key}' is {kind}")
    if is_blank(value):  # zero-width characters too: masking drops them, leaving nothing
        raise ValueError(f"'{key}' is empty")
    return _unicode(key, value)


SHOWN_CHARS = 40


def _shown(value: Any) -> str:
    """`value` as an error line quotes it: its repr, a long string as its first SHOWN_CHARS
    characters and its length (a line of up to 1 MB would otherwise be echoed whole)."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}… ({len(value)} characters)"
    shown = repr(value)
    return shown if len(shown) <= 2 * SHOWN_CHARS else shown[: 2 * SHOWN_CHARS] + "…"


def _suggestion(name: str, known_tools: frozenset[str]) -> str:
    """' (did you mean ...?)' naming the registry's ids closest to `name` (case first), or ''."""
    same_case = sorted(t for t in known_tools if t.lower() == name.lower())
    close = same_case or difflib.get_close_matches(name, sorted(known_tools), n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def parse_record(
    item: Any, line: int, known_tools: frozenset[str] | None = None, max_flags: int | None = None
) -> UsageRecord:
    """One decoded JSON value to a record, or ValueError saying what is wrong with it.
    `known_tools` and `max_flags` (the schema's registry and its limit on preconditions) make a
    line the schema could never carry an error of that line, not of the built compendium."""
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {json_type(item)}")
    query = _string(item, "query")
    tool = _string(item, "tool").strip()
    outcome = item.get("outcome")
    if outcome not in OUTCOMES:
        raise ValueError(f"'outcome' must be one of {', '.join(OUTCOMES)}; got {_shown(outcome)}")
    corrected_to = _string(item, "corrected_to", required=outcome == "corrected")
    if outcome != "corrected" and corrected_to is not None:
        raise ValueError("'corrected_to' is only allowed when 'outcome' is \"corrected\"")
    if corrected_to is not None:
        corrected_to = corrected_to.strip()
        if corrected_to == tool:
            raise ValueError("'corrected_to' names the same tool as 'tool'")
    for name, value in (("tool", tool), ("corrected_to", corrected_to)):
        if value is not None and known_tools is not None and value not in known_tools:
            raise ValueError(
                f"'{name}' {_shown(value)} is not a tool of the schema's registry{_suggestion(value, known_tools)}"
            )

    latency = item.get("latency_ms")
    if latency is None:
        raise ValueError("'latency_ms' is missing")
    if isinstance(latency, bool) or not isinstance(latency, int | float):
        raise ValueError("'latency_ms' must be a number")
    try:
        finite = math.isfinite(latency)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite or latency < 0:
        shown = str(latency)
        if len(shown) > 40:
            shown = f"{shown[:20]}… ({len(shown)} digits)"
        raise ValueError(f"'latency_ms' must be a finite number >= 0; got {shown}")

    user = item.get("user")
    if user is None:
        raise ValueError("'user' is missing (a stable pseudonymous id of the end user)")
    if isinstance(user, bool) or not isinstance(user, str | int):
        raise ValueError("'user' must be a string or an integer")
    # One person, one id: "Alice", "alice ", "ＡＬＩＣＥ", "ali<U+200B>ce" are the same user (two
    # ids would give that person twice the clipping's Δ and F*, and pass a k-users threshold
    # alone): NFKC, without the characters no reader sees (masking.normalized), case-folded.
    user = " ".join(normalized(_unicode("user", str(user))).casefold().split())
    if not user:
        raise ValueError("'user' is empty")

    flags = item.get("preconditions")
    preconditions: tuple[tuple[str, bool], ...] = ()
    if flags is not None:
        if not isinstance(flags, dict):
            raise ValueError("'preconditions' must be an object of boolean flags")
        if max_flags is not None and len(flags) > max_flags:
            raise ValueError(
                f"'preconditions' has {len(flags)} flags; the schema allows at most {max_flags}"
            )
        for key, value in flags.items():
            if not _FLAG.match(key):
                raise ValueError(f"precondition flag {_shown(key)} is not an identifier")
            if found := flag_name_holds(key):
                # sent as written, never masked or scrubbed: refused here, not silently dropped
                # (the line's other flags would then describe another condition)
                raise ValueError(
                    f"precondition flag {_shown(key)} holds {found}: a flag names a condition "
                    "(has_city), never a person, an account or a contact; rename it"
                )
            if not isinstance(value, bool):
                raise ValueError(f"precondition flag {_shown(key)} must be true or false")
        preconditions = tuple(sorted(flags.items()))

    template = None
    raw_template = item.get("template")
    if raw_template is not None:
        if not isinstance(raw_template, dict):
            raise ValueError("'template' must be an object with 'signature' and 'template'")
        template = Template(
            signature=_string(raw_template, "signature").strip(),
            template=_string(raw_template, "template"),
        )

    return UsageRecord(
        line=line,
        query=query,
        tool=tool,
        outcome=outcome,
        latency_ms=float(latency),
        user=user,
        corrected_to=corrected_to,
        preconditions=preconditions,
        template=template,
    )


def parse_lines(
    lines: Iterable[bytes | str],
    source: str = "usage log",
    known_tools: Iterable[str] | None = None,
    max_flags: int | None = None,
) -> UsageLog:
    """Every line parsed; every bad line kept as an error with its line number (none dropped).
    Bytes lines are UTF-8; a log whose first line is UTF-16, compressed or binary raises
    NotUtf8Log. `lines` may hold
    `OverlongLine`s (`log_lines`), reported as too long."""
    known = frozenset(known_tools) if known_tools is not None else None
    log = UsageLog(source=source)
    for number, raw in enumerate(lines, start=1):
        log.lines_read = number
        if isinstance(raw, OverlongLine):
            log.errors.append(
                LogLineError(number, f"line is {int(raw)} bytes; the limit is {MAX_LINE_BYTES}")
            )
            continue
        if isinstance(raw, bytes):
            if number == 1 and (problem := _not_utf8(raw)):
                raise NotUtf8Log(source, problem)
            if len(raw) > MAX_LINE_BYTES:
                log.errors.append(
                    LogLineError(number, f"line is {len(raw)} bytes; the limit is {MAX_LINE_BYTES}")
                )
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                log.errors.append(LogLineError(number, f"not valid UTF-8 at byte {exc.start}"))
                continue
        else:
            text = raw
        if number == 1:
            # a UTF-8 byte order mark, as Windows tools (PowerShell 5's Out-File, Notepad) write
            # one: "Unexpected UTF-8 BOM" on line 1 told the user nothing they could act on
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            # a key twice in one object (Python keeps the last, other readers the first) is an
            # error of its line: the label, the outcome or the user would be what the reader picks
            item = json.loads(text, object_pairs_hook=no_duplicate_keys)
        except json.JSONDecodeError as exc:
            log.errors.append(LogLineError(number, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        except DuplicateKey as exc:
            log.errors.append(LogLineError(number, f"not valid JSON: {exc}"))
            continue
        except RecursionError:
            log.errors.append(LogLineError(number, "not valid JSON: nested too deeply"))
            continue
        except ValueError:  # an integer of more digits than Python reads (4,300)
            log.errors.append(LogLineError(number, "not readable: it holds a number of more than 4,300 digits"))
            continue
        try:
            log.records.append(parse_record(item, number, known, max_flags))
        except ValueError as exc:
            log.errors.append(LogLineError(number, str(exc)))
    return log


def read_usage_log(
    path: str | Path, known_tools: Iterable[str] | None = None, max_flags: int | None = None
) -> UsageLog:
    """Read a usage log file. Raises OSError when it cannot be opened, NotUtf8Log when it is
    UTF-16, compressed or binary."""
    path = Path(path)
    with path.open("rb") as handle:
        return parse_lines(
            log_lines(handle), source=str(path), known_tools=known_tools, max_flags=max_flags
        )
