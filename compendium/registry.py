"""Reading tool registries and labelled queries.

Two registry formats:
- the routing-benchmark format (`tools.jsonl`, one tool a line: tool_id, name, description,
  category; see ../shared/data/README.md), alone or in a dataset folder beside `queries.jsonl`;
- an MCP `tools/list` result (`{"tools": [{"name", "description", "inputSchema"}]}`, or the whole
  JSON-RPC response around it, or a bare list of such tools).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from compendium.schema import ToolSpec


class RegistryFormatError(ValueError):
    """A registry or query file that cannot be read, with where and why."""


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("r", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RegistryFormatError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise RegistryFormatError(f"{path}:{number}: expected a JSON object per line")
            yield number, item


def _tool(item: dict[str, Any], where: str) -> ToolSpec:
    known = {"tool_id", "name", "description", "category"}
    missing = [k for k in ("tool_id", "description") if not isinstance(item.get(k), str)]
    if missing:
        raise RegistryFormatError(f"{where}: missing or non-string {', '.join(missing)}")
    extra = {k: v for k, v in item.items() if k not in known}
    try:
        return ToolSpec(
            tool_id=item["tool_id"].strip(),
            name=str(item.get("name") or item.get("display_name") or item["tool_id"]),
            description=item["description"].strip(),
            category=str(item.get("category") or ""),
            spec=extra,
        )
    except ValidationError as exc:
        raise RegistryFormatError(f"{where}: {exc.errors()[0]['msg']}") from None


def load_tools_jsonl(path: Path) -> list[ToolSpec]:
    tools = [_tool(item, f"{path}:{n}") for n, item in _read_jsonl(path)]
    return _unique(tools, str(path))


def _mcp_tools(doc: Any) -> list[dict[str, Any]]:
    if isinstance(doc, dict) and "result" in doc and isinstance(doc["result"], dict):
        doc = doc["result"]
    if isinstance(doc, dict) and isinstance(doc.get("tools"), list):
        return doc["tools"]
    if isinstance(doc, list):
        return doc
    raise RegistryFormatError(
        "not an MCP tools/list result: expected {\"tools\": [...]} or a JSON-RPC response with "
        "result.tools"
    )


def tools_from_mcp(doc: Any, source: str = "MCP result") -> list[ToolSpec]:
    tools = []
    for index, item in enumerate(_mcp_tools(doc)):
        where = f"{source}: tools[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RegistryFormatError(f"{where}: a tool needs a string 'name'")
        spec = {"inputSchema": item.get("inputSchema") or {"type": "object"}}
        if item.get("annotations"):
            spec["annotations"] = item["annotations"]
        tools.append(
            _tool(
                {
                    "tool_id": item["name"],
                    "name": item.get("title") or item["name"],
                    "description": item.get("description") or item.get("title") or item["name"],
                    "category": (item.get("annotations") or {}).get("category", "")
                    if isinstance(item.get("annotations"), dict)
                    else "",
                    **spec,
                },
                where,
            )
        )
    return _unique(tools, source)


def _unique(tools: list[ToolSpec], source: str) -> list[ToolSpec]:
    seen: set[str] = set()
    for tool in tools:
        if tool.tool_id in seen:
            raise RegistryFormatError(f"{source}: duplicate tool id {tool.tool_id!r}")
        seen.add(tool.tool_id)
    if not tools:
        raise RegistryFormatError(f"{source}: no tools found")
    return tools


def load_registry(path: str | Path) -> list[ToolSpec]:
    """Tools from a dataset folder, a tools.jsonl file, or an MCP tools/list JSON file."""
    path = Path(path)
    if path.is_dir():
        candidate = path / "tools.jsonl"
        if not candidate.exists():
            raise RegistryFormatError(f"{path}: no tools.jsonl in this folder")
        return load_tools_jsonl(candidate)
    if not path.exists():
        raise RegistryFormatError(f"{path}: no such file or folder")
    if path.suffix == ".jsonl":
        return load_tools_jsonl(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RegistryFormatError(f"{path}: not valid JSON ({exc.msg})") from None
    return tools_from_mcp(doc, str(path))


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
    and test (a tool with fewer than 3 queries stays in train). The simulation, the benchmarks
    and the tests all split with this one function.

    In a federation the probe split is the public probe set the edges use (never client data);
    the test split is held out from everything."""
    if not 0 < test_fraction < 1 or not 0 <= probe_fraction < 1 - test_fraction:
        raise ValueError("fractions must leave a non-empty train split")
    rng = random.Random(seed)
    by_tool: dict[str, list[LabelledQuery]] = defaultdict(list)
    for query in queries:
        by_tool[query.tool_id].append(query)
    split = Split([], [], [])
    for tool in sorted(by_tool):
        items = list(by_tool[tool])
        rng.shuffle(items)
        n = len(items)
        n_test = max(1, round(n * test_fraction)) if n >= 3 else 0
        n_probe = max(1, round(n * probe_fraction)) if n >= 3 and probe_fraction > 0 else 0
        split.test.extend(items[:n_test])
        split.probe.extend(items[n_test : n_test + n_probe])
        split.train.extend(items[n_test + n_probe :])
    return split


def load_queries(path: Path, tool_ids: Iterable[str] | None = None) -> list[LabelledQuery]:
    known = set(tool_ids) if tool_ids is not None else None
    queries = []
    for number, item in _read_jsonl(path):
        if not isinstance(item.get("query"), str) or not isinstance(item.get("tool_id"), str):
            raise RegistryFormatError(f"{path}:{number}: 'query' and 'tool_id' must be strings")
        if known is not None and item["tool_id"] not in known:
            raise RegistryFormatError(
                f"{path}:{number}: tool_id {item['tool_id']!r} is not in tools.jsonl"
            )
        conflict = item.get("label_conflict") or ()
        queries.append(
            LabelledQuery(
                query=item["query"],
                tool_id=item["tool_id"],
                category=str(item.get("category") or ""),
                qid=str(item.get("qid") or f"{path.parent.name}-{number}"),
                label_conflict=tuple(str(t) for t in conflict),
            )
        )
    return queries


def load_dataset(folder: str | Path) -> RoutingDataset:
    folder = Path(folder)
    tools = load_registry(folder)
    queries_path = folder / "queries.jsonl"
    if not queries_path.exists():
        raise RegistryFormatError(f"{folder}: no queries.jsonl in this folder")
    return RoutingDataset(
        name=folder.name, tools=tools, queries=load_queries(queries_path, {t.tool_id for t in tools})
    )
