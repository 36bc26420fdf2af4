"""Reading tool registries and labelled queries.

Two registry formats:
- the routing-benchmark format (`tools.jsonl`, one tool a line: tool_id, name, description,
  category; see ../shared/data/README.md), alone or in a dataset folder beside `queries.jsonl`;
- an MCP `tools/list` result (`{"tools": [{"name", "description", "inputSchema"}]}`, or the whole
  JSON-RPC response around it, or a bare list of such tools).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from compendium.schema import ToolSpec
from compendium.usage_log import json_type
from compendium.validation import (
    TWIN_IDS,
    DuplicateKey,
    is_blank,
    no_duplicate_keys,
    shown_id,
    tool_id_key,
    tool_id_problem,
    unpublishable_tools,
)

# What the database stores of a tool (compendium.models.Tool) and of a probe query
# (federation.models.ProbeQuery): longer values are refused when a registry or dataset is read,
# not when a run or an import stores them.
TOOL_ID_MAX_LENGTH = 128
TOOL_NAME_MAX_LENGTH = 200
CATEGORY_MAX_LENGTH = 200
QID_MAX_LENGTH = 200
DATASET_NAME_MAX_LENGTH = 100


class RegistryFormatError(ValueError):
    """A registry or query file that cannot be read, with where and why."""


def _cannot_read(path: Path, exc: OSError) -> RegistryFormatError:
    return RegistryFormatError(f"{path}: cannot be read ({exc.strerror or exc})")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:  # a folder, unreadable, ...
        raise _cannot_read(path, exc) from None


def _read_lines(path: Path) -> Iterator[bytes]:
    """The lines of `path`, without their ends, read one at a time (a file of any size is read
    in the memory of one line). A line ends where bytes.splitlines ends it (LF, CRLF or a lone
    CR), so line numbers are those an editor shows: each LF-ended piece split again."""
    try:
        file = path.open("rb")
    except OSError as exc:  # a folder, unreadable, ...
        raise _cannot_read(path, exc) from None
    with file:
        try:
            for piece in file:
                yield from piece.splitlines()
        except OSError as exc:
            raise _cannot_read(path, exc) from None


def _read_text(path: Path) -> str:
    """A whole UTF-8 file (a byte-order mark first dropped), or a RegistryFormatError naming
    it."""
    try:
        return _read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RegistryFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's json reads them, JSON has no such numbers, and no
    database column (jsonb, a float) stores them."""


def _not_json(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    """A JSON number as a float: one past a double's range (1e400) Python reads as infinity,
    which jsonb refuses as it refuses Infinity."""
    value = float(literal)
    if not math.isfinite(value):
        raise _NotJson(f"{literal} is beyond what a double holds")
    return value


def _parse_json(text: str, where: str) -> Any:
    """`text` as JSON, or a RegistryFormatError naming `where` (a file, or a file and line)."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite,
                          object_pairs_hook=no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise RegistryFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    except (_NotJson, DuplicateKey) as exc:
        raise RegistryFormatError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise RegistryFormatError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError:  # an integer of more digits than Python reads (4,300)
        raise RegistryFormatError(f"{where}: holds a number of more than 4,300 digits") from None


def _text_problem(value: str) -> str | None:
    """What PostgreSQL cannot store in `value` (text or jsonb): a NUL character, or a lone
    surrogate (JSON can escape half a character: "\\ud800"), which is not text."""
    if "\x00" in value:
        return "holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate at character {exc.start}"
    return None


def _storable(where: str, what: str, value: Any) -> None:
    """Refuse, naming `where` and `what`, a string in `value` (or in the lists and objects it
    holds, keys included) that the database cannot store."""
    stack = [value]
    while stack:  # not recursive: the JSON may nest as deeply as json reads
        item = stack.pop()
        if isinstance(item, str):
            problem = _text_problem(item)
            if problem:
                raise RegistryFormatError(
                    f"{where}: {what} {problem}, which the database cannot store"
                )
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, raw in enumerate(_read_lines(path), start=1):
        try:
            # line 1: without the UTF-8 byte-order mark Windows tools write first (Notepad,
            # PowerShell 5's Out-File), which was "not valid JSON (Unexpected UTF-8 BOM ...)"
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise RegistryFormatError(f"{path}:{number}: not UTF-8 text ({exc.reason})") from None
        if not line.strip():
            continue
        item = _parse_json(line, f"{path}:{number}")
        if not isinstance(item, dict):
            raise RegistryFormatError(f"{path}:{number}: expected a JSON object per line")
        yield number, item


def _too_long(where: str, what: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise RegistryFormatError(
            f"{where}: {what} is {len(value)} characters long; at most {limit} can be stored"
        )


def _optional_text(item: dict[str, Any], key: str, where: str, what: str | None = None) -> str:
    """`item[key]` when it is a string, "" when absent or null; anything else refused naming it
    (str() of a list or an object stored Python's repr of it as the tool's name or category)."""
    value = item.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RegistryFormatError(f"{where}: {what or key} must be a string, not {json_type(value)}")
    return value


def _tool(item: dict[str, Any], where: str) -> ToolSpec:
    known = {"tool_id", "name", "description", "category"}
    missing = [k for k in ("tool_id", "description") if not isinstance(item.get(k), str)]
    if missing:
        raise RegistryFormatError(f"{where}: missing or non-string {', '.join(missing)}")
    tool_id = item["tool_id"].strip()
    if not tool_id:
        raise RegistryFormatError(f"{where}: blank tool_id")
    if not item["description"].strip():  # required: what the tool does
        raise RegistryFormatError(f"{where}: blank description")
    # read as the tool id and description are, without surrounding spaces: a blank name is
    # none given (the tool id), a blank category none (not a category of its own)
    name = (_optional_text(item, "name", where).strip()
            or _optional_text(item, "display_name", where).strip() or tool_id)
    category = _optional_text(item, "category", where).strip()
    for what, value in (("tool_id", tool_id), ("name", name), ("description", item["description"]),
                        ("category", category)):
        _storable(where, what, value)
    if problem := tool_id_problem(tool_id):
        raise RegistryFormatError(
            f"{where}: tool_id {shown_id(tool_id)} holds {problem}; a tool id must read as it "
            "is stored (see the README's \"Tool registries\")"
        )
    _too_long(where, "tool_id", tool_id, TOOL_ID_MAX_LENGTH)
    _too_long(where, "name", name, TOOL_NAME_MAX_LENGTH)
    _too_long(where, "category", category, CATEGORY_MAX_LENGTH)
    extra = {k: v for k, v in item.items() if k not in known}
    for key, value in extra.items():
        _storable(where, "a key", key)
        _storable(where, repr(key), value)
    try:
        return ToolSpec(
            tool_id=tool_id,
            name=name,
            description=item["description"].strip(),
            category=category,
            spec=extra,
        )
    except ValidationError as exc:
        raise RegistryFormatError(f"{where}: {exc.errors()[0]['msg']}") from None


def load_tools_jsonl(path: Path) -> list[ToolSpec]:
    wheres, tools = [], []
    for n, item in _read_jsonl(path):
        wheres.append(f"{path}:{n}")
        tools.append(_tool(item, wheres[-1]))
    return _unique(tools, str(path), wheres)


def _mcp_tools(doc: Any, source: str) -> list[dict[str, Any]]:
    if isinstance(doc, dict) and "result" in doc and isinstance(doc["result"], dict):
        doc = doc["result"]
    if isinstance(doc, dict) and isinstance(doc.get("tools"), list):
        return doc["tools"]
    if isinstance(doc, list):
        return doc
    raise RegistryFormatError(
        f"{source}: not an MCP tools/list result: expected {{\"tools\": [...]}} or a JSON-RPC "
        "response with result.tools"
    )


def tools_from_mcp(doc: Any, source: str = "MCP result") -> list[ToolSpec]:
    tools, wheres = [], []
    for index, item in enumerate(_mcp_tools(doc, source)):
        where = f"{source}: tools[{index}]"
        wheres.append(where)
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RegistryFormatError(f"{where}: a tool needs a string 'name'")
        schema = item.get("inputSchema")
        if schema is not None and not isinstance(schema, dict):  # MCP: a JSON Schema object
            raise RegistryFormatError(
                f"{where}: inputSchema must be a JSON Schema object, not {json_type(schema)}"
            )
        annotations = item.get("annotations")
        if annotations is not None and not isinstance(annotations, dict):  # MCP: an object
            raise RegistryFormatError(
                f"{where}: annotations must be an object, not {json_type(annotations)}"
            )
        spec = {"inputSchema": schema or {"type": "object"}}
        if annotations:
            spec["annotations"] = annotations
        annotations = annotations or {}
        title = _optional_text(item, "title", where)
        tools.append(
            _tool(
                {
                    "tool_id": item["name"],
                    "name": title or item["name"],
                    "description": item.get("description") or title or item["name"],
                    "category": _optional_text(annotations, "category", where,
                                               "annotations.category"),
                    **spec,
                },
                where,
            )
        )
    return _unique(tools, source, wheres)


def _unique(tools: list[ToolSpec], source: str, wheres: list[str]) -> list[ToolSpec]:
    """`tools`, read from `source` (the tool at index i from `wheres[i]`), once each, and such
    that every global compendium can publish them (`unpublishable_tools`)."""
    seen: dict[str, int] = {}  # tool_id_key -> the index of the tool that had it first
    for index, tool in enumerate(tools):
        first = seen.setdefault(tool_id_key(tool.tool_id), index)
        if first == index:
            continue
        other = tools[first].tool_id
        if other == tool.tool_id:
            raise RegistryFormatError(f"{source}: duplicate tool id {tool.tool_id!r}")
        raise RegistryFormatError(
            f"{wheres[index]}: tool id {shown_id(tool.tool_id)} reads as the tool id "
            f"{shown_id(other)} of {wheres[first]} (the two {TWIN_IDS}); give each tool an id "
            "no other reads as"
        )
    if not tools:
        raise RegistryFormatError(f"{source}: no tools found")
    problems = unpublishable_tools(tools)
    if problems:
        index, problem = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        where = source if index is None else wheres[index]
        raise RegistryFormatError(
            f"{where}: {problem}{more} (every global compendium publishes each tool's "
            "description and spec, and the schema refuses it there)"
        )
    return tools


def _given(path: str | Path) -> Path:
    """`path` as a Path; an empty one refused: Path("") is the current folder, so
    `import_tools "$DATASET"` with DATASET unset imported whatever tools.jsonl was there."""
    if isinstance(path, str) and not path:
        raise RegistryFormatError("the path is empty: name a file or folder")
    return Path(path)


def load_registry(path: str | Path) -> list[ToolSpec]:
    """Tools from a dataset folder, a tools.jsonl file, or an MCP tools/list JSON file."""
    path = _given(path)
    if path.is_dir():
        candidate = path / "tools.jsonl"
        if not candidate.exists():
            raise RegistryFormatError(f"{path}: no tools.jsonl in this folder")
        return load_tools_jsonl(candidate)
    if not path.exists():
        raise RegistryFormatError(f"{path}: no such file or folder")
    if path.suffix.lower() == ".jsonl":  # TOOLS.JSONL too, as file systems that ignore case
        return load_tools_jsonl(path)
    return tools_from_mcp(_parse_json(_read_text(path), str(path)), str(path))


@dataclass(frozen=True)
class LabelledQuery:
    query: str
    tool_id: str
    category: str = ""
    qid: str = ""
    label_conflict: tuple[str, ...] = ()


@dataclass
class RoutingDataset:
    """A dataset in the routing-benchmark format: tools and labelled queries."""

    name: str
    tools: list[ToolSpec]
    queries: list[LabelledQuery] = field(default_factory=list)

    @property
    def tool_ids(self) -> set[str]:
        return {t.tool_id for t in self.tools}


@dataclass
class Split:
    train: list[LabelledQuery]
    probe: list[LabelledQuery]
    test: list[LabelledQuery]


def stratified_split(
    queries: Iterable[LabelledQuery],
    *,
    seed: int,
    probe_fraction: float = 0.1,
    test_fraction: float = 0.4,
) -> Split:
    """A seeded split stratified by gold tool: every tool keeps the same shares in train, probe
    and test (a tool with fewer than 3 distinct queries stays in train). The simulation, the
    benchmarks and the tests all split with this one function.

    Each tool's queries are dealt on their own, by distinct text: the copies of one text
    labelled with one tool go to the same split, counted once, so a held-out query's (text,
    tool) pair is never in train or probe. What does not hold: a held-out query's text is never
    in train or probe. The same text labelled with another tool is dealt with that tool's
    queries, so it can sit in train (a client's log holds it word for word) or in the probe set
    under the other tool while it is held out under this one. On MetaTool that is a few of the
    8,230 test queries a seed (3 to 7 over seeds 0-4, default fractions), each a request the
    dataset labels with two tools.

    In a federation the probe split is the public probe set the edges use (never client data);
    the test split's (text, tool) pairs are in no client's log and not in the probe set."""
    if not 0 < test_fraction < 1 or not 0 <= probe_fraction < 1 - test_fraction:
        raise ValueError("fractions must leave a non-empty train split")
    rng = random.Random(seed)
    by_tool: dict[str, dict[str, list[LabelledQuery]]] = defaultdict(dict)
    for query in queries:
        by_tool[query.tool_id].setdefault(query.query, []).append(query)
    split = Split([], [], [])
    for tool in sorted(by_tool):
        items = list(by_tool[tool].values())  # each text's copies, in the order they came
        rng.shuffle(items)
        n = len(items)
        n_test = max(1, round(n * test_fraction)) if n >= 3 else 0
        n_probe = max(1, round(n * probe_fraction)) if n >= 3 and probe_fraction > 0 else 0
        for part, copies in ((split.test, items[:n_test]),
                             (split.probe, items[n_test : n_test + n_probe]),
                             (split.train, items[n_test + n_probe :])):
            part.extend(query for group in copies for query in group)
    return split


def _qid(item: dict[str, Any], where: str) -> str:
    """A query's qid: a string, or a whole number as its digits (an id a dataset numbered); ""
    when absent or null. Anything else is refused naming it, as a tool's name is
    (`_optional_text`): str() stored a list or true as Python wrote it, and a qid of false or 0
    was replaced by the line's default id without a word."""
    value = item.get("qid")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _optional_text(item, "qid", where)


def load_queries(path: Path, tool_ids: Iterable[str] | None = None) -> list[LabelledQuery]:
    """The labelled queries of a queries.jsonl; with `tool_ids`, every label (and every tool of a
    `label_conflict`) must be one of them. Refuses, naming the line, what the simulation and the
    probe set could not use or store: a blank query, a qid seen before or too long to store."""
    known = set(tool_ids) if tool_ids is not None else None
    queries = []
    line_of: dict[str, int] = {}  # qid -> the line that had it first
    for number, item in _read_jsonl(path):
        where = f"{path}:{number}"
        if not isinstance(item.get("query"), str) or not isinstance(item.get("tool_id"), str):
            raise RegistryFormatError(f"{where}: 'query' and 'tool_id' must be strings")
        if is_blank(item["query"]):  # whitespace, or zero-width characters: nothing to route
            raise RegistryFormatError(f"{where}: blank query")
        for key in ("query", "tool_id", "qid", "category"):
            _storable(where, key, item.get(key))
        tool_id = item["tool_id"].strip()  # as tools.jsonl's ids are read (`_tool`)
        if known is not None and tool_id not in known:
            raise RegistryFormatError(f"{where}: tool_id {item['tool_id']!r} is not in tools.jsonl")
        conflict = item.get("label_conflict") or []
        if not isinstance(conflict, list) or not all(isinstance(t, str) for t in conflict):
            raise RegistryFormatError(f"{where}: 'label_conflict' must be a list of tool ids")
        conflict = [t.strip() for t in conflict]
        unknown = sorted(set(conflict) - known) if known is not None else []
        if unknown:
            raise RegistryFormatError(
                f"{where}: label_conflict names {', '.join(map(repr, unknown))}, not in tools.jsonl"
            )
        qid = _qid(item, where) or f"{Path(os.path.abspath(path)).parent.name}-{number}"
        _too_long(where, "qid", qid, QID_MAX_LENGTH)
        if qid in line_of:
            raise RegistryFormatError(f"{where}: qid {qid!r} is already on line {line_of[qid]}")
        line_of[qid] = number
        queries.append(
            LabelledQuery(
                query=item["query"],
                tool_id=tool_id,
                category=_optional_text(item, "category", where),
                qid=qid,
                label_conflict=tuple(conflict),
            )
        )
    return queries


def load_dataset(folder: str | Path) -> RoutingDataset:
    """The dataset in `folder`, named after the folder (what "." or ".." name, not "" or "..")."""
    folder = _given(folder)
    name = Path(os.path.abspath(folder)).name
    if folder.exists() and not folder.is_dir():  # load_registry reads a file as a registry
        raise RegistryFormatError(
            f"{folder}: a file, not a dataset folder (one holding tools.jsonl and queries.jsonl)"
        )
    _too_long(str(folder), "the dataset's name (its folder's)", name, DATASET_NAME_MAX_LENGTH)
    # a folder named in bytes that are not UTF-8 reads as lone surrogates: the name and each
    # default qid made of it are stored (the probe set, a simulation run)
    _storable(str(folder), "the dataset's name (its folder's)", name)
    tools = load_registry(folder)
    queries_path = folder / "queries.jsonl"
    if not queries_path.exists():
        raise RegistryFormatError(f"{folder}: no queries.jsonl in this folder")
    queries = load_queries(queries_path, {t.tool_id for t in tools})
    if not queries:
        raise RegistryFormatError(f"{queries_path}: no queries")
    return RoutingDataset(name=name, tools=tools, queries=queries)
