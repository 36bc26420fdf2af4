"""Compendiums from a routing-benchmark dataset (pure; used by benchmarks and tests).

The train split of `compendium.registry.stratified_split` becomes the scenarios of a global
compendium (deduplicated); the probe split fits fusion weights and calibration; the test split is
held out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from compendium.registry import LabelledQuery
from compendium.schema import Compendium, PromptTemplate, Scenario, ToolMetadata, ToolSpec


def normalize(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def compendium_from_queries(
    tools: Sequence[ToolSpec],
    train: Sequence[LabelledQuery],
    max_per_tool: int | None = None,
    with_templates: bool = True,
    with_descriptions: bool = False,
) -> Compendium:
    """Scenarios = train queries, deduplicated per tool by normalized text; one template per tool;
    with `with_descriptions`, each tool's registry description in its metadata, as a published
    global compendium carries it."""
    seen: set[tuple[str, str]] = set()
    per_tool: dict[str, int] = {}
    scenarios = []
    for q in train:
        key = (q.tool_id, normalize(q.query))
        if not key[1] or key in seen:
            continue
        if max_per_tool is not None and per_tool.get(q.tool_id, 0) >= max_per_tool:
            continue
        seen.add(key)
        per_tool[q.tool_id] = per_tool.get(q.tool_id, 0) + 1
        scenarios.append(Scenario(tool_id=q.tool_id, text=q.query.strip()[:1000]))
    used = sorted(per_tool)
    by_id = {t.tool_id: t for t in tools}
    templates = (
        [
            PromptTemplate(
                tool_id=t,
                signature="call(request)",
                template=f"Call {by_id[t].name or t} ({by_id[t].description[:300]}) for: {{request}}",
            )
            for t in used
            if t in by_id
        ]
        if with_templates
        else []
    )
    metadata = [
        ToolMetadata(
            tool_id=t,
            description=(by_id[t].description or None) if with_descriptions and t in by_id else None,
        )
        for t in used
    ]
    return Compendium(metadata=metadata, scenarios=scenarios, templates=templates)
