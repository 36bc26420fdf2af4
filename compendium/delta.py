"""What changed since the compendium a client pulled: the part of a local compendium worth sending.

A server that carries the previous global compendium forward (`federation.merge.server_merge`
with `previous=`) already holds what the client pulled, so the client need only send:

- scenarios (and precautions) the pulled global does not already cover: an entry is covered when
  the pulled compendium has an entry of the same tool whose embedding has cosine >= τ with it
  (τ is the merge's clustering threshold, so a covered entry would have joined that cluster);
- and, given the pulled global's router (`route`), a scenario is also covered when that router
  already sends its text to its tool with calibrated confidence >= `confidence`: the global knows
  this case, so sending it teaches the federation nothing. What is left is what the global gets
  wrong or is unsure about: the scenarios that move it (uncertainty sampling, as in active
  learning). Precautions keep the cosine rule only: they say what a tool is *not* for, which a
  router's top choice does not test;
- prompt templates that differ from the pulled one for the same (tool, signature);
- annex triples the pulled compendium does not have;
- the numeric statistics, always: they are this round's per-user averages, released with fresh
  noise by the edge each round, and they are a few bytes per tool.

Pure: no Django. The embedding engine is passed in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from compendium.builder import DEFAULT_TAU, Embedder
from compendium.schema import Compendium

# An entry the pulled global's router already sends to its tool with at least this calibrated
# confidence is left out. On MetaTool (seed 0, README "Results") 0.8 kept the final accuracy of
# sending everything with 15% fewer bytes; 0.5 and 0.3 saved a little more but cost accuracy.
DEFAULT_SINCE_CONFIDENCE = 0.8

# The pulled global's router as `delta_since` needs it: texts -> (chosen tool or None, calibrated
# confidence) per text.
RouteFn = Callable[[list[str]], list[tuple[str | None, float]]]


def routed_by(router) -> RouteFn:
    """`delta_since`'s `route` from a `routing.router.Router` (anything with `route_batch`)."""

    def route(texts: list[str]) -> list[tuple[str | None, float]]:
        return [(d.tool, d.confidence) for d in router.route_batch(texts)]

    return route


@dataclass(frozen=True)
class DeltaReport:
    scenarios_kept: int
    scenarios_covered: int
    scenarios_routed: int  # of the covered: left out because the router already gets them right
    precautions_kept: int
    precautions_covered: int
    templates_covered: int
    annex_covered: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _uncovered(
    entries: Sequence[tuple[str, str]],
    known: Sequence[tuple[str, str]],
    embed,
    tau: float,
) -> list[bool]:
    """For each (tool, text) of `entries`: True when no `known` entry of the same tool has cosine
    >= tau with it."""
    if not entries:
        return []
    if not known:
        return [True] * len(entries)
    vectors = embed([text for _, text in entries])
    known_vectors = embed([text for _, text in known])
    rows_of: dict[str, list[int]] = defaultdict(list)
    for row, (tool, _) in enumerate(known):
        rows_of[tool].append(row)
    out = []
    for row, (tool, _) in enumerate(entries):
        rows = rows_of.get(tool)
        if not rows:
            out.append(True)
            continue
        best = float(np.max(known_vectors[rows] @ vectors[row]))
        out.append(best < tau)
    return out


def delta_since(
    local: Compendium,
    pulled: Compendium,
    embedder: Embedder,
    tau: float = DEFAULT_TAU,
    route: RouteFn | None = None,
    confidence: float = DEFAULT_SINCE_CONFIDENCE,
) -> tuple[Compendium, DeltaReport]:
    """`local` without what `pulled` already covers (see the module docstring). `route` is the
    pulled global's router (None: the cosine rule alone); `confidence` above 1 turns the routing
    rule off."""
    embed = embedder.embed
    scenario_keep = _uncovered(
        [(s.tool_id, s.text) for s in local.scenarios],
        [(s.tool_id, s.text) for s in pulled.scenarios],
        embed,
        tau,
    )
    routed = 0
    if route is not None and confidence <= 1.0 and pulled.scenarios:
        rows = [i for i, keep in enumerate(scenario_keep) if keep]
        decisions = route([local.scenarios[i].text for i in rows]) if rows else []
        if len(decisions) != len(rows):
            raise ValueError(f"the router answered {len(decisions)} decisions for {len(rows)} texts")
        for i, (tool, conf) in zip(rows, decisions, strict=True):
            if tool == local.scenarios[i].tool_id and conf >= confidence:
                scenario_keep[i] = False
                routed += 1
    precaution_keep = _uncovered(
        [(p.tool_id, p.text) for p in local.precautions],
        [(p.tool_id, p.text) for p in pulled.precautions],
        embed,
        tau,
    )
    pulled_templates = {(t.tool_id, t.signature): t.template for t in pulled.templates}
    templates = [
        t for t in local.templates if pulled_templates.get((t.tool_id, t.signature)) != t.template
    ]
    pulled_annex = {(a.subject, a.relation, a.object) for a in pulled.annex}
    annex = [a for a in local.annex if (a.subject, a.relation, a.object) not in pulled_annex]
    scenarios = [s for s, keep in zip(local.scenarios, scenario_keep, strict=True) if keep]
    precautions = [p for p, keep in zip(local.precautions, precaution_keep, strict=True) if keep]
    delta = local.model_copy(
        update={
            "scenarios": scenarios,
            "precautions": precautions,
            "templates": templates,
            "annex": annex,
        }
    )
    report = DeltaReport(
        scenarios_kept=len(scenarios),
        scenarios_covered=len(local.scenarios) - len(scenarios),
        scenarios_routed=routed,
        precautions_kept=len(precautions),
        precautions_covered=len(local.precautions) - len(precautions),
        templates_covered=len(local.templates) - len(templates),
        annex_covered=len(local.annex) - len(annex),
    )
    return delta, report
