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
  learning). A precaution of tool X ("Do not use X for requests like: ...") is covered when
  that router already sends its request to another tool with calibrated confidence >=
  `confidence`: the global already does not use X there. Before any global is published, what
  every client holds is the public probe set: its router (`routing.cli.probe_router`, the probe
  alone) plays the pulled router's part against an empty compendium, since the server's router
  learns from the probe too;
- and (`without_sent`, what `participate` records) the scenarios and precautions the client
  sent word for word in a round the pulled global merged;
- prompt templates that differ from the pulled one for the same (tool, signature);
- annex triples the pulled compendium does not have;
- the numeric statistics, always: they are this round's per-user averages, released with fresh
  noise by the edge each round, and they are a few bytes per tool.

A byte budget (`fit_budget`) then keeps, of what is left, as much as fits in a size the operator
sets: the numeric statistics, templates and annex always; then scenarios, taken in turns over the
tools so that every tool the client saw is represented before any tool gets a second entry, the
most supported first; then precautions, the most supported first. What does not fit stays on the
client: its log still has it, so the next round's build offers it again, against the global that
round pulls. Which scenarios go first matters little; how many go matters a lot. On MetaTool
(seed 0, a 12,000-byte budget, bench/results/EXPERIMENTS.md) this order reached 0.692; sending first what the
pulled global (before round 2: the registry descriptions) gets wrong, 0.685; what it gets right
most surely, 0.708; with no budget, 0.805 (measured before a support of 1 left the canonical form,
which lets about 8% more fit: this order then reached 0.694).

Pure: no Django. The embedding engine is passed in.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from compendium.builder import DEFAULT_TAU, Embedder
from compendium.canonical import canonical_bytes, entry_size
from compendium.schema import Compendium

# An entry the pulled global's router already sends to its tool with at least this calibrated
# confidence is left out. On MetaTool (seed 0, bench/results/EXPERIMENTS.md) 0.8 kept the final accuracy of
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
    precautions_routed: int  # of the covered: the router already sends their request elsewhere
    templates_covered: int
    annex_covered: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _uncovered(
    entries: Sequence[tuple[Hashable, str]],
    known: Sequence[tuple[Hashable, str]],
    embed,
    tau: float,
) -> list[bool]:
    """For each (group, text) of `entries`: True when no `known` entry of the same group (a tool;
    for scenarios a tool and its preconditions) has cosine >= tau with it."""
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


def precaution_request(precaution) -> str | None:
    """The request a client's precaution is about (`builder.precaution_text`: "Do not use X for
    requests like: <request> (use Y instead)"), or None for other wording."""
    prefix = f"Do not use {precaution.tool_id} for requests like: "
    if not precaution.text.startswith(prefix):
        return None
    request = _USE_INSTEAD.sub("", precaution.text[len(prefix):])
    return request or None


_USE_INSTEAD = re.compile(r" \(use [^ ()]+ instead\)$")


def _routed(route: RouteFn, texts: list[str]) -> list[tuple[str | None, float]]:
    """`route(texts)`, checked: one decision per text (never a silent drop)."""
    decisions = route(texts) if texts else []
    if len(decisions) != len(texts):
        raise ValueError(f"the router answered {len(decisions)} decisions for {len(texts)} texts")
    return decisions


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
    # A scenario under other preconditions is another case (its disagreement is the edge's to
    # see), however alike the wording.
    scenario_keep = _uncovered(
        [(_case(s), s.text) for s in local.scenarios],
        [(_case(s), s.text) for s in pulled.scenarios],
        embed,
        tau,
    )
    routed = 0
    if route is not None and confidence <= 1.0:
        rows = [i for i, keep in enumerate(scenario_keep) if keep]
        decisions = _routed(route, [local.scenarios[i].text for i in rows])
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
    precautions_routed = 0
    if route is not None and confidence <= 1.0:
        rows = [
            (i, request)
            for i, keep in enumerate(precaution_keep)
            if keep and (request := precaution_request(local.precautions[i])) is not None
        ]
        decisions = _routed(route, [request for _, request in rows])
        for (i, _), (tool, conf) in zip(rows, decisions, strict=True):
            if tool is not None and tool != local.precautions[i].tool_id and conf >= confidence:
                precaution_keep[i] = False
                precautions_routed += 1
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
        precautions_routed=precautions_routed,
        templates_covered=len(local.templates) - len(templates),
        annex_covered=len(local.annex) - len(annex),
    )
    return delta, report


def sent_keys(compendium: Compendium) -> set[str]:
    """What identifies each scenario and precaution of `compendium` in a client's record of
    what it sent (`without_sent`): a digest of its kind, tool and text."""
    return {_sent_key("s", s) for s in compendium.scenarios} | {
        _sent_key("p", p) for p in compendium.precautions
    }


def _case(scenario) -> tuple[str, tuple[tuple[str, bool], ...]]:
    return scenario.tool_id, tuple(sorted(scenario.preconditions.items()))


def _sent_key(kind: str, entry) -> str:
    flags = getattr(entry, "preconditions", None)
    # the preconditions only when there are some: records written before them still match
    case = "".join(f"\0{k}={v}" for k, v in sorted(flags.items())) if flags else ""
    return hashlib.sha256(f"{kind}\0{entry.tool_id}\0{entry.text}{case}".encode()).hexdigest()[:32]


def without_sent(local: Compendium, sent: set[str]) -> tuple[Compendium, int]:
    """`local` without the scenarios and precautions this client already sent in an earlier round
    of the same federation (`sent`, from `sent_keys`): a server that carries its global forward
    has them, merged; the same text again tells it nothing new. How many were left out."""
    scenarios = [s for s in local.scenarios if _sent_key("s", s) not in sent]
    precautions = [p for p in local.precautions if _sent_key("p", p) not in sent]
    dropped = len(local.scenarios) - len(scenarios) + len(local.precautions) - len(precautions)
    return local.model_copy(update={"scenarios": scenarios, "precautions": precautions}), dropped


@dataclass(frozen=True)
class BudgetReport:
    max_bytes: int
    bytes_before: int
    bytes_after: int
    scenarios_deferred: int  # left on the client for a later round
    precautions_deferred: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _in_turns(order: list[int], tool_of: Sequence[str]) -> list[int]:
    """`order` (best first) re-dealt in turns over the tools: every tool's best entry, in the order
    of those entries, then every tool's second best, and so on."""
    rank: dict[str, int] = defaultdict(int)
    keyed = []
    for position, i in enumerate(order):
        turn = rank[tool_of[i]]
        rank[tool_of[i]] += 1
        keyed.append((turn, position, i))
    return [i for _, _, i in sorted(keyed)]


def _spread(text: str) -> bytes:
    """A deterministic order among equally supported entries that is unrelated to their wording."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def _pack(section: str, entries: Sequence, order: Sequence[int], room: int) -> tuple[set[int], int]:
    """The entries of `section` taken in `order` while they fit in `room` bytes (one that does not
    fit is skipped and a smaller later one may still fit); their indices and the room left."""
    kept = set()
    for i in order:
        size = entry_size(section, entries[i])
        if size <= room:
            kept.add(i)
            room -= size
    return kept, room


def fit_counts(
    compendium: Compendium, max_scenarios: int, max_precautions: int
) -> tuple[Compendium, int, int]:
    """`compendium` with at most `max_scenarios` scenarios and `max_precautions` precautions
    (the schema's per-compendium limits), chosen as `fit_budget` chooses: scenarios in turns over
    the tools, most supported first; precautions most supported first. Also how many of each
    were left out."""
    scenarios, precautions = compendium.scenarios, compendium.precautions
    if len(scenarios) <= max_scenarios and len(precautions) <= max_precautions:
        return compendium, 0, 0
    by_support = sorted(
        range(len(scenarios)),
        key=lambda i: (-scenarios[i].support, _spread(scenarios[i].tool_id + "\n" + scenarios[i].text)),
    )
    kept_scenarios = set(_in_turns(by_support, [s.tool_id for s in scenarios])[:max_scenarios])
    kept_precautions = set(
        sorted(
            range(len(precautions)),
            key=lambda i: (-precautions[i].support, _spread(precautions[i].text)),
        )[:max_precautions]
    )
    cut = compendium.model_copy(
        update={
            "scenarios": [s for i, s in enumerate(scenarios) if i in kept_scenarios],
            "precautions": [p for i, p in enumerate(precautions) if i in kept_precautions],
        }
    )
    return (
        cut,
        len(scenarios) - len(kept_scenarios),
        len(precautions) - len(kept_precautions),
    )


def fit_budget(compendium: Compendium, max_bytes: int) -> tuple[Compendium, BudgetReport]:
    """`compendium` cut to at most `max_bytes` canonical bytes (see the module docstring). The
    statistics, templates and annex are never cut: when they alone exceed the budget the result
    is over it, and the report says by how much."""
    before = len(canonical_bytes(compendium))
    if before <= max_bytes:
        return compendium, BudgetReport(max_bytes, before, before, 0, 0)
    scenarios, precautions = compendium.scenarios, compendium.precautions
    fixed = len(canonical_bytes(compendium.model_copy(update={"scenarios": [], "precautions": []})))
    by_support = sorted(
        range(len(scenarios)),
        key=lambda i: (-scenarios[i].support, _spread(scenarios[i].tool_id + "\n" + scenarios[i].text)),
    )
    kept_scenarios, room = _pack(
        "scenarios", scenarios, _in_turns(by_support, [s.tool_id for s in scenarios]),
        max_bytes - fixed,
    )
    kept_precautions, _ = _pack(
        "precautions",
        precautions,
        sorted(range(len(precautions)), key=lambda i: (-precautions[i].support, _spread(precautions[i].text))),
        room,
    )
    cut = compendium.model_copy(
        update={
            "scenarios": [s for i, s in enumerate(scenarios) if i in kept_scenarios],
            "precautions": [p for i, p in enumerate(precautions) if i in kept_precautions],
        }
    )
    report = BudgetReport(
        max_bytes=max_bytes,
        bytes_before=before,
        bytes_after=len(canonical_bytes(cut)),
        scenarios_deferred=len(scenarios) - len(kept_scenarios),
        precautions_deferred=len(precautions) - len(kept_precautions),
    )
    return cut, report
