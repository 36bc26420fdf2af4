"""Validity of a compendium under a schema: rules (a)-(d) of Definition 1, plus the structural
checks that keep hostile input harmless.

`validate_compendium` never raises on bad input: it returns every violation it finds, each with
the JSON path of the offending value and a reason a person can act on.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from compendium.schema import IDENTIFIER, SCHEMA_VERSION, Compendium, Schema, ToolSpec

try:  # a faster parser, used only where it gives exactly what the standard one gives
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; the standard parser suffices
    orjson = None

# Control characters other than tab/newline/carriage return, C1 controls, bidirectional
# overrides (a classic way to make text read differently than it is stored) and lone surrogates
# (which cannot be encoded as UTF-8).
_FORBIDDEN_CHARS = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)

# Which declared string limit applies to a string, by the name of the field holding it.
_LIMIT_BY_FIELD = {
    ("metadata", "tool_id"): "tool_id",
    ("metadata", "description"): "description",
    ("scenarios", "tool_id"): "tool_id",
    ("scenarios", "text"): "scenario",
    ("precautions", "tool_id"): "tool_id",
    ("precautions", "text"): "precaution",
    ("templates", "tool_id"): "tool_id",
    ("templates", "signature"): "signature",
    ("templates", "template"): "template",
    ("annex", "subject"): "annex_term",
    ("annex", "relation"): "annex_term",
    ("annex", "object"): "annex_term",
}

_COLLECTIONS = ("metadata", "scenarios", "precautions", "templates", "annex")
_TOOL_REFERENCING = ("scenarios", "precautions", "templates")


@dataclass(frozen=True)
class Violation:
    path: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class ValidationResult:
    compendium: Compendium | None
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class CompendiumInvalid(ValueError):
    """Raised by `load_valid_compendium` with every violation attached."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:5])
        more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"{len(violations)} violation(s): {head}{more}")


def format_path(parts: tuple[Any, ...] | list[Any]) -> str:
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            out += f".{part}"
        else:
            out += "[" + json.dumps(str(part), ensure_ascii=True) + "]"
    return out


def validation_summary(exc: ValidationError, shown: int = 3) -> str:
    """pydantic's errors as `$.path: reason; ...` (the first `shown`, then how many more), without
    its echo of the input (which may be a whole usage-log line) and its documentation link."""
    errors = exc.errors()
    text = "; ".join(f"{format_path(e['loc'])}: {e['msg']}" for e in errors[:shown])
    return text + (f" (and {len(errors) - shown} more)" if len(errors) > shown else "")


# A path to one entry of a component, as `format_path` writes it: `$.scenarios[12]`.
_ENTRY_PATH = re.compile(r"\$\.(metadata|scenarios|precautions|templates|annex)\[(\d+)\]")


def reindex_paths(text: str, positions: dict[str, list[int]]) -> str:
    """`text` (a violation's path or reason) with each entry index `$.scenarios[i]` replaced by
    `positions["scenarios"][i]` (`canonical.canonical_positions`): a path the server computed on
    the canonical bytes a client sent, made to name the entry in the client's own file. An index
    that `positions` does not cover is left as it is."""

    def swap(match: re.Match) -> str:
        order = positions.get(match.group(1), [])
        index = int(match.group(2))
        return f"$.{match.group(1)}[{order[index]}]" if index < len(order) else match.group(0)

    return _ENTRY_PATH.sub(swap, text)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


class DuplicateKey(ValueError):
    """A key twice in one JSON object: Python's json keeps the last, other readers the first, so
    the text means what its reader picks."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's `object_pairs_hook` refusing a key given twice in one object (DuplicateKey)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate key {json.dumps(key[:40])} in one object")
        out[key] = value
    return out


def duplicate_key(data: bytes | str) -> str | None:
    """Why `data`, a JSON document, holds a key twice in one object ("duplicate key "k" in one
    object"), or None when it does not (or is no JSON at all: its reader says why). For the
    files a reader parses with another parser (pydantic's keeps the last key): one reader's "a"
    is another's "b"."""
    if isinstance(data, bytes) and _orjson_parse(data) is not _UNPARSED:
        return None  # orjson parsed it and lost no key
    try:
        json.loads(data, object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        return str(exc)
    except (ValueError, RecursionError):
        return None
    return None


# Every digit as "0", to find runs of digits with bytes.find (a regular expression is slower).
DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")


def _orjson_parse(data: bytes) -> Any:
    """The JSON value of `data` as the standard parser (with `no_duplicate_keys` and
    `_reject_constant`) would give it, or `_UNPARSED` when orjson cannot tell: invalid JSON, NaN or
    infinities, lone surrogates, very deep nesting, long integers, or duplicate keys (orjson keeps
    the last). Then the standard parser decides, with its own messages.

    Duplicate keys: every key is followed by a colon, and orjson writes no colon escaped, so with
    no escaped colon in the input the document lost a key exactly when it has more colons than its
    own serialization (a dropped value can only take more colons with it)."""
    # Integers past 64 bits (orjson makes them floats; 19 digits in a row, in a string or not,
    # send the document the standard way) and escaped colons (they would blind the count below).
    if orjson is None or b"\\u003" in data or b"0" * 19 in data.translate(DIGITS_AS_ZERO):
        return _UNPARSED
    try:
        doc = orjson.loads(data)
        if data.count(b":") != orjson.dumps(doc).count(b":"):
            return _UNPARSED
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return _UNPARSED
    return doc


_UNPARSED = object()


def parse_document(
    data: bytes | str, max_bytes: int, *, fast: bool = False
) -> tuple[Any, list[Violation]]:
    """Bytes or text to a JSON value, or the reason it is not one. `fast`: try orjson first on
    bytes (the same value, or it falls back)."""
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > max_bytes:
        return None, [Violation("$", f"document is {size} bytes; the limit is {max_bytes} bytes")]
    if fast and isinstance(data, bytes):
        doc = _orjson_parse(data)
        if doc is not _UNPARSED:
            return doc, []
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            # without the byte order mark Windows tools write first (Notepad, PowerShell 5's
            # Out-File): RFC 8259 lets a parser ignore it, as `synapse-client` does its files
            data = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            return None, [Violation("$", f"not valid UTF-8 at byte {exc.start}: {exc.reason}")]
    elif data.startswith("\ufeff"):
        data = data[1:]
    try:
        return (
            json.loads(
                data, parse_constant=_reject_constant, object_pairs_hook=no_duplicate_keys
            ),
            [],
        )
    except RecursionError:
        return None, [Violation("$", "document nests too deeply to be a compendium")]
    except json.JSONDecodeError as exc:
        return None, [
            Violation("$", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
        ]
    except ValueError as exc:
        return None, [Violation("$", f"not valid JSON: {exc}")]


def _string_limit(path: tuple, schema: Schema, is_key: bool = False) -> tuple[str, int]:
    """The declared limit that applies to a string at `path` (top collection, field name), or to
    the key that ends `path`: a precondition's flag name, or any other key (field names)."""
    if len(path) >= 3 and isinstance(path[0], str) and isinstance(path[1], int):
        if is_key:
            if len(path) == 4 and path[0] == "scenarios" and path[2] == "preconditions":
                return "flag", schema.strings.flag
        else:
            key = _LIMIT_BY_FIELD.get((path[0], path[2]))
            if key:
                return key, getattr(schema.strings, key)
    return "other", schema.strings.other


def forbidden_character(text: str) -> str | None:
    """The first character of `text` that no stored text may hold (_FORBIDDEN_CHARS), in words
    ("a control character U+0007 at position 3"); None when there is none. Compendium strings
    and the names people give organizations and clients are held to it alike."""
    bad = _FORBIDDEN_CHARS.search(text)
    if bad is None:
        return None
    char = bad.group()
    what = "a lone surrogate (not encodable as UTF-8)" if "\ud800" <= char <= "\udfff" else (
        "a bidirectional override" if "\u202a" <= char <= "\u2069" else "a control character"
    )
    return f"{what} U+{ord(char):04X} at position {bad.start()}"


# Characters that render as nothing beside the format (Cf) characters: the combining grapheme
# joiner and the Hangul fillers (a "blank" letter).
_BLANK_NON_FORMAT = frozenset("\u034f\u115f\u1160\u3164\uffa0")


def is_invisible(char: str) -> bool:
    """Whether `char` is drawn as nothing: a format character (Unicode category Cf: zero-width
    space and joiners, word joiner, soft hyphen, byte-order mark, bidirectional marks, ...) or a
    blank filler (_BLANK_NON_FORMAT)."""
    return unicodedata.category(char) == "Cf" or char in _BLANK_NON_FORMAT


def is_blank(text: str) -> bool:
    """Whether `text` shows nothing: only whitespace and invisible characters (is_invisible), as
    a text of zero-width spaces or a lone byte-order mark is (the routing API refuses such a
    query as empty: routing.router.query_problem)."""
    return all(char.isspace() or is_invisible(char) for char in text)


def invisible_character(text: str) -> str | None:
    """The first character of `text` that is drawn as nothing (is_invisible), in words ("an
    invisible character U+200B (ZERO WIDTH SPACE) at position 4"); None when there is none.
    For the names people give organizations and clients, which must not have an invisible twin
    (not for compendium text, where a zero-width joiner belongs to an emoji)."""
    for position, char in enumerate(text):
        if is_invisible(char):
            name = unicodedata.name(char, "")
            named = f" ({name})" if name else ""
            return f"an invisible character U+{ord(char):04X}{named} at position {position}"
    return None


def name_key(name: str) -> str:
    """The form in which two names of organizations (or two clients of one organization) are
    compared: without invisible characters, NFKC (a no-break space is a space, a full-width "Ａ"
    an "A"), whitespace runs as one space, casefolded. Two names with one key read as one name
    on the dashboard and in the audit log."""
    visible = "".join(char for char in name if not is_invisible(char))
    spaced = " ".join(unicodedata.normalize("NFKC", visible).split())
    return unicodedata.normalize("NFKC", spaced.casefold())


# Greek and Cyrillic letters drawn as a Latin letter in common fonts, each with that letter: the
# single-letter prototypes of Unicode's confusables (UTS #39) among these scripts' basic letters,
# a conservative subset (no digits, no letters drawn only roughly alike). A tool id of Greek or
# Cyrillic letters alone (a mixed one is refused: tool_id_problem) is compared through it.
_LATIN_LOOKALIKES = str.maketrans({
    # Cyrillic capitals and small letters
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H",
    "О": "O", "Р": "P", "С": "C", "Т": "T", "Х": "X", "Ѕ": "S",
    "І": "I", "Ј": "J", "Ү": "Y", "Ԛ": "Q", "Ԝ": "W", "Ӏ": "I",
    "а": "a", "е": "e", "о": "o", "р": "p", "с": "c", "у": "y",
    "х": "x", "ѕ": "s", "і": "i", "ј": "j", "һ": "h", "ԁ": "d",
    "ԛ": "q", "ԝ": "w", "ӏ": "l", "ү": "y", "ѵ": "v",
    # Greek capitals and small letters
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I",
    "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T",
    "Υ": "Y", "Χ": "X", "ο": "o", "ν": "v", "α": "a", "ι": "i",
    "ρ": "p", "υ": "u", "γ": "y", "ϲ": "c", "ϳ": "j",
})

# Scripts with letters drawn alike: an id with letters of two of them is a look-alike.
_LOOKALIKE_SCRIPTS = {"LATIN": "Latin", "GREEK": "Greek", "CYRILLIC": "Cyrillic"}


def _described(char: str) -> str:
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" ({name})" if name else "")


def _unreadable_character(text: str) -> str | None:
    """The first character of `text` that reads otherwise than it is stored beyond
    forbidden_character and invisible_character: any other control character (tab, line feed,
    carriage return), a line or paragraph separator, a space other than U+0020."""
    for position, char in enumerate(text):
        category = unicodedata.category(char)
        if category == "Cc":
            return f"a control character U+{ord(char):04X} at position {position}"
        if category in ("Zl", "Zp"):
            what = "a line separator" if category == "Zl" else "a paragraph separator"
            return f"{what} U+{ord(char):04X} at position {position}"
        if category == "Zs" and char != " ":
            return f"a space other than U+0020: {_described(char)} at position {position}"
    return None


def _mixed_scripts(text: str) -> str | None:
    """Letters of two of _LOOKALIKE_SCRIPTS in `text` (each character read as NFKC makes it: a
    full-width Latin letter is Latin), in words naming the first letter of the script with
    fewer; None when its letters are of one of them at most."""
    first: dict[str, tuple[int, str]] = {}
    count: dict[str, int] = {}
    for position, char in enumerate(text):
        for letter in unicodedata.normalize("NFKC", char):
            if not unicodedata.category(letter).startswith("L"):
                continue
            script = _LOOKALIKE_SCRIPTS.get(unicodedata.name(letter, "").split(" ", 1)[0])
            if script:
                first.setdefault(script, (position, char))
                count[script] = count.get(script, 0) + 1
    if len(first) < 2:
        return None
    scripts = sorted(first, key=lambda s: (-count[s], first[s][0]))
    position, char = first[scripts[-1]]
    return (f"letters of two scripts, {scripts[0]} and {scripts[-1]}: {_described(char)} at "
            f"position {position}")


def tool_id_problem(tool_id: str) -> str | None:
    """What makes `tool_id` read otherwise than it is stored, in words (None when nothing): a
    control character (tab and line ends too), a format or other invisible character
    (zero-width space, bidi mark or override, ...), a line or paragraph separator, a space
    other than U+0020, or letters of two of Latin, Greek and Cyrillic ("ѕearch" with a Cyrillic
    dze), the look-alike of an id of one script. Spaces (U+0020) and letters of any one script
    are allowed."""
    return (forbidden_character(tool_id) or invisible_character(tool_id)
            or _unreadable_character(tool_id) or _mixed_scripts(tool_id))


def tool_id_key(tool_id: str) -> str:
    """The form in which two tool ids are compared: two ids with one key read as one tool to a
    person. name_key's (no invisible characters, NFKC, whitespace runs as one space, casefolded)
    with the Greek and Cyrillic letters drawn as a Latin letter read as that letter
    (_LATIN_LOOKALIKES, on the decomposed id: Cyrillic "ё" is Latin "ë")."""
    decomposed = unicodedata.normalize("NFKD", tool_id).translate(_LATIN_LOOKALIKES)
    return name_key(decomposed)


def shown_id(tool_id: str) -> str:
    """`tool_id` quoted, followed when it is not ASCII by its code points escaped ('ѕearch'
    ('\\u0455earch')): two ids that read alike are told apart in a message."""
    return repr(tool_id) if tool_id.isascii() else f"{tool_id!r} ({ascii(tool_id)})"


TWIN_IDS = ("differ only in letter case, character width, composition, spacing or letters of "
            "another script drawn alike")


def _check_string(text: str, path: tuple, schema: Schema, is_key: bool) -> Iterator[Violation]:
    bad = forbidden_character(text)
    if bad:
        where = format_path(path)  # formatted only for a violation: this runs for every string
        yield Violation(where, f"{'key' if is_key else 'string'} contains {bad}; remove it")
    limit_name, limit = _string_limit(path, schema, is_key)
    if len(text) > limit:
        yield Violation(
            format_path(path),
            f"{'key' if is_key else 'string'} is {len(text)} characters; "
            f"the declared limit for {limit_name} is {limit}",
        )


def _structural_checks(doc: Any, schema: Schema) -> tuple[list[Violation], bool]:
    """Strings, numbers, depth and size of the whole tree. Also says whether the tree is too
    deep or too large to be handed to the model validator at all.

    Every value is visited depth first without recursion (a value counts towards the node limit
    when visited; a dict's keys are checked when the dict is). This runs for every string of
    every submission, so a string is looked at closely only when it might break a rule: one that
    is no longer than the shortest declared limit and has no forbidden character cannot."""
    violations: list[Violation] = []
    hostile = False
    limits = schema.limits
    max_depth, max_nodes = limits.depth, limits.nodes
    strings = schema.strings
    shortest = min(
        [strings.other, strings.flag]
        + [getattr(strings, name) for name in set(_LIMIT_BY_FIELD.values())]
    )
    forbidden = _FORBIDDEN_CHARS.search
    stack: list[tuple[tuple, Any, int]] = [((), doc, 0)]
    nodes = 0
    while stack:
        path, value, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            hostile = True
            violations.append(Violation("$", f"document has more than {max_nodes} JSON values"))
            break
        if depth > max_depth:
            hostile = True
            violations.append(
                Violation(format_path(path), f"nested deeper than the limit of {max_depth} levels")
            )
            continue
        if isinstance(value, str):
            if len(value) > shortest or forbidden(value):
                violations.extend(_check_string(value, path, schema, is_key=False))
        elif isinstance(value, dict):
            for key in reversed(list(value)):
                child = path + (key,)
                if len(key) > shortest or forbidden(key):
                    violations.extend(_check_string(key, child, schema, is_key=True))
                stack.append((child, value[key], depth + 1))
        elif isinstance(value, list):
            for index in range(len(value) - 1, -1, -1):
                stack.append((path + (index,), value[index], depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            violations.append(Violation(format_path(path), "number is not finite"))
    return violations, hostile


_PYDANTIC_REASONS = {
    "missing": "required field is missing",
    "extra_forbidden": "unknown field: not part of the compendium schema",
    "string_type": "wrong type: expected a string",
    "float_type": "wrong type: expected a number",
    "int_type": "wrong type: expected an integer",
    "bool_type": "wrong type: expected true or false",
    "list_type": "wrong type: expected a list",
    "dict_type": "wrong type: expected an object",
    "model_type": "wrong type: expected an object",
    "model_attributes_type": "wrong type: expected an object",
}


def _pydantic_violations(exc: ValidationError) -> list[Violation]:
    out = []
    for err in exc.errors(include_url=False):
        reason = _PYDANTIC_REASONS.get(err["type"])
        if reason is None:
            reason = err["msg"][0].lower() + err["msg"][1:]
        out.append(Violation(format_path(err["loc"]), reason))
    return out


def _finite_number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else, including an integer too large
    for a float (the model validator reports those as not a valid number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _semantic_checks(doc: dict, schema: Schema) -> list[Violation]:
    """Rules (a)-(c), uniqueness and the counts' limit, on the raw document so that every item
    is checked even when another item has a structural error. Its collections are within their
    limits (`_oversized_collections`)."""
    out: list[Violation] = []
    registry = schema.tool_ids
    limits = schema.limits

    version = doc.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, str) and version != schema.version:
        out.append(
            Violation(
                "$.schema_version",
                f"schema version {version!r} is not supported; this federation uses {schema.version!r}",
            )
        )

    def items(name: str) -> Iterator[tuple[int, dict]]:
        seq = doc.get(name)
        if not isinstance(seq, list):
            return
        for index, item in enumerate(seq):  # within its limit: `_oversized_collections`
            if isinstance(item, dict):
                yield index, item

    def too_large(count: Any, path: str, what: str) -> None:
        if isinstance(count, int) and not isinstance(count, bool) and count > limits.counts:
            shown = count if count < 10**12 else f"a number of {len(str(count))} digits"
            out.append(Violation(path, f"{what} {shown} exceeds the limit of {limits.counts}"))

    too_large(doc.get("num_users"), "$.num_users", "num_users")

    def unknown_tool(name: str, index: int, tool: Any, rule: str) -> None:
        if isinstance(tool, str) and tool not in registry:
            out.append(
                Violation(
                    f"$.{name}[{index}].tool_id",
                    f"{rule} {tool!r}: not in the tool registry ({len(registry)} tools); "
                    "register it or drop the entry",
                )
            )

    seen_tools: dict[str, int] = {}
    for index, item in items("metadata"):
        tool = item.get("tool_id")
        unknown_tool("metadata", index, tool, "unknown tool id")
        if isinstance(tool, str):
            if tool in seen_tools:
                out.append(
                    Violation(
                        f"$.metadata[{index}].tool_id",
                        f"duplicate tool id {tool!r}: already at $.metadata[{seen_tools[tool]}]",
                    )
                )
            else:
                seen_tools[tool] = index
        stats = item.get("stats")
        if isinstance(stats, dict):
            for name, value in stats.items():
                spec = schema.fields_by_name.get(name)
                number = _finite_number(value)
                if spec is None or number is None or not spec.min <= number <= spec.max:
                    where = format_path(("metadata", index, "stats", name))
                if spec is None:
                    declared = ", ".join(sorted(schema.fields_by_name)) or "none"
                    out.append(
                        Violation(where, f"unknown numeric field {name!r}; declared fields: {declared}")
                    )
                elif number is not None and not spec.min <= number <= spec.max:
                    out.append(
                        Violation(
                            where,
                            f"value {value} is outside the declared range "
                            f"[{spec.min:g}, {spec.max:g}] of field {name!r}",
                        )
                    )

    for name in _TOOL_REFERENCING:
        seen: dict[tuple, int] = {}
        for index, item in items(name):
            unknown_tool(name, index, item.get("tool_id"), "references unregistered tool")
            if name == "templates":
                key = (item.get("tool_id"), item.get("signature"))
                label = "duplicate template key (tool, signature)"
                for part in ("signature", "template"):  # as the usage log reads them
                    value = item.get(part)
                    if isinstance(value, str) and is_blank(value):
                        out.append(Violation(f"$.templates[{index}].{part}", f"{part} is empty"))
            else:
                flags = item.get("preconditions")
                key = (
                    item.get("tool_id"),
                    item.get("text"),
                    tuple(sorted(flags.items())) if isinstance(flags, dict) else None,
                )
                label = f"duplicate {name[:-1]}"
                text = item.get("text")
                if isinstance(text, str) and is_blank(text):
                    out.append(Violation(f"$.{name}[{index}].text", "text is empty"))
                too_large(item.get("support"), f"$.{name}[{index}].support", "support")
            if all(isinstance(k, str | tuple | type(None)) for k in key):
                try:
                    if key in seen:
                        out.append(
                            Violation(f"$.{name}[{index}]", f"{label}: same as $.{name}[{seen[key]}]")
                        )
                    else:
                        seen[key] = index
                except TypeError:  # unhashable values are reported by the type checks
                    pass
            flags = item.get("preconditions")
            if isinstance(flags, dict):
                if len(flags) > limits.preconditions:
                    out.append(
                        Violation(
                            f"$.{name}[{index}].preconditions",
                            f"{len(flags)} flags; the limit is {limits.preconditions}",
                        )
                    )
                for flag in flags:
                    if not IDENTIFIER.match(flag):
                        out.append(
                            Violation(
                                format_path((name, index, "preconditions", flag)),
                                "flag name must be an identifier (letters, digits, _ . : -)",
                            )
                        )

    for index, item in items("annex"):
        for part in ("subject", "relation", "object"):
            value = item.get(part)
            if isinstance(value, str) and is_blank(value):
                out.append(Violation(f"$.annex[{index}].{part}", f"{part} is empty"))
    return out


def validate_compendium(data: bytes | str | dict | Compendium, schema: Schema) -> ValidationResult:
    """Check a compendium (raw bytes, text, parsed JSON or a model) against a schema."""
    if isinstance(data, Compendium):
        doc: Any = data.model_dump(mode="json")
    elif isinstance(data, bytes | bytearray | memoryview | str):
        doc, violations = parse_document(data, schema.limits.bytes, fast=True)
        if violations:
            return ValidationResult(None, violations)
    else:
        doc = data

    violations, hostile = _structural_checks(doc, schema)
    if hostile:
        if isinstance(data, bytes):
            # Too deep or too large: the standard parser's verdict (it stops at less depth than
            # orjson, with a message of its own).
            doc, parse_violations = parse_document(data, schema.limits.bytes)
            if parse_violations:
                return ValidationResult(None, parse_violations)
            violations, _ = _structural_checks(doc, schema)
        return ValidationResult(None, violations)
    if not isinstance(doc, dict):
        return ValidationResult(None, [Violation("$", "a compendium must be a JSON object")])

    oversized = _oversized_collections(doc, schema)
    if oversized:  # refused whole: the model validator would look at every entry first
        return ValidationResult(None, _reported(violations + oversized))
    model: Compendium | None = None
    try:
        model = Compendium.model_validate(doc, strict=True)
    except ValidationError as exc:
        violations.extend(_pydantic_violations(exc))
    violations.extend(_semantic_checks(doc, schema))

    unique = _reported(violations)
    return ValidationResult(model if not unique else None, unique)


_TOOL_ENTRY = re.compile(r"^\$\.metadata\[(\d+)\]\.?")


def unpublishable_tools(
    tools: Sequence[ToolSpec], schema: Schema | None = None
) -> list[tuple[int | None, str]]:
    """What the schema would refuse in a compendium that publishes every one of `tools`, as each
    merge's global does (the registry's description and spec of every tool: the merge's
    `_tool_metadata`), and the merge checks its own output: a registry that fails here fails
    every round. Each problem comes with the index of its tool and its path in the tool's entry
    ("description: string contains ..."), or None for the registry as a whole. `schema`: whose
    string and collection limits (default: the schema in force's, which are the defaults)."""
    base = schema or Schema()
    if len(tools) > base.limits.metadata:
        return [(None, f"{len(tools)} tools; the limit is {base.limits.metadata} per compendium")]
    check = Schema(tools=list(tools), strings=base.strings, limits=base.limits)
    doc = {"metadata": [
        {"tool_id": t.tool_id, "description": t.description, **({"spec": t.spec} if t.spec else {})}
        for t in tools
    ]}
    out: list[tuple[int | None, str]] = []
    for violation in validate_compendium(doc, check).violations:
        entry = _TOOL_ENTRY.match(violation.path)
        if entry is None:
            out.append((None, f"published together, {violation.reason}"))
        else:
            where = violation.path[entry.end():] or "the entry"
            out.append((int(entry.group(1)), f"{where}: {violation.reason}"))
    return out


def metadata_free_text(compendium: Compendium) -> list[Violation]:
    """A client's metadata entry carries its statistics only: a description or spec there is
    free text that no masking check or scrub reads (the registry's are canonical, and the merge
    drops a client's). The server refuses it on arrival; the client toolkit refuses it before
    anything is sent (`validate`, `submit`), so that such text never leaves the client."""
    return [
        Violation(f"$.metadata[{i}].{name}", "a client sends only its statistics here; the "
                  "tool's description and spec are the registry's")
        for i, entry in enumerate(compendium.metadata)
        for name in ("description", "spec")
        if getattr(entry, name) is not None
    ]


# At most this many violations are listed; one more says how many were left out.
MAX_REPORTED_VIOLATIONS = 200


def _reported(violations: list[Violation]) -> list[Violation]:
    """One violation per (path, reason), in document order of discovery, at most
    MAX_REPORTED_VIOLATIONS of them and then one that counts the rest (a document of a million
    bad entries gets an answer of a few kilobytes, not one line per entry)."""
    unique = list(dict.fromkeys(violations))
    if len(unique) <= MAX_REPORTED_VIOLATIONS:
        return unique
    left = len(unique) - MAX_REPORTED_VIOLATIONS
    return unique[:MAX_REPORTED_VIOLATIONS] + [
        Violation("$", f"{left} more violation(s) not listed; fix those above and validate again")
    ]


def _oversized_collections(doc: dict, schema: Schema) -> list[Violation]:
    """A violation for each of the compendium's collections that holds more entries than its
    limit (`CollectionLimits`)."""
    out = []
    for name in _COLLECTIONS:
        seq = doc.get(name)
        cap = getattr(schema.limits, name)
        if isinstance(seq, list) and len(seq) > cap:
            out.append(Violation(f"$.{name}", f"{len(seq)} entries; the limit is {cap} per compendium"))
    return out


def load_valid_compendium(data: bytes | str | dict | Compendium, schema: Schema) -> Compendium:
    result = validate_compendium(data, schema)
    if not result.ok:
        raise CompendiumInvalid(result.violations)
    assert result.compendium is not None
    return result.compendium
