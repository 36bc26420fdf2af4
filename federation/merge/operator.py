"""The typed merge operator (Algorithm 1 and its full form in the paper's appendix "Edge Merge
Operator"). Pure: no Django. The server pipeline and the simulation call the very same functions.

`edge_merge` merges client submissions into an edge compendium, drawing Laplace noise for the
numeric statistics; `server_merge` applies the same operator one level up to edge results, where
the numeric statistics are already released and are only averaged (post-processing, no budget).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from compendium.builder import precaution_text
from compendium.clipping import clip_bound
from compendium.schema import (
    AnnexTriple,
    Compendium,
    NumericFieldSpec,
    Precaution,
    PromptTemplate,
    Scenario,
    Schema,
    ToolMetadata,
)
from compendium.validation import validate_compendium
from federation.merge.clustering import (
    ClusterDecision,
    ConsistencyProbe,
    Item,
    calibrated_margin,
    central_order,
    centroid_id,
    confusion_verdicts,
    decide_cluster,
    greedy_cluster,
    implausible_sources,
    incoherent_batches,
    item_order_key,
    merged_flags,
    tool_profiles,
    trusted_profiles,
)
from federation.merge.llm import LLMUnavailable, OpenAICompatibleLLM, consistency_probe
from federation.merge.privacy import BudgetExceeded, laplace_release, laplace_scale, round_spend
from federation.merge.robust import byzantine_count, most_kept, robust_batches, robust_keep
from federation.merge.summarize import (
    SUMMARY_SCHEMA,
    Cluster,
    ProbeSet,
    RoutingContext,
    Summarizer,
    SummaryUnparseable,
    _parse_summary,
    fallback_kind,
)
from federation.merge.types import (
    ConflictEntry,
    FlaggedEntry,
    LedgerEntry,
    MergeInput,
    MergeResult,
    MergeStats,
    Rejection,
)
from federation.round_config import RoundConfig

Embed = Callable[[Sequence[str]], np.ndarray]

# Tool-confusion check: an entry is dropped when another tool's profile is closer than its own by
# more than this cosine margin (its own tool not among the nearest CONFUSION_RANK profiles).
CONFUSION_MARGIN = 0.2
CONFUSION_RANK = 1
# With a probe set, the margin is raised where needed so that at most this share of the public
# labelled probe requests (honest by construction) would be flagged against profiles made of the
# registry's descriptions and the probe itself (`clustering.honest_gaps`: nothing submitted enters,
# so an adversary cannot raise the margin by flooding the profiles).
CONFUSION_HONEST_RATE = 0.10
# Incoherent batches (`clustering.incoherent_batches`): one source's scenarios for one tool, at
# least COHERENCE_MIN of them, less alike than COHERENCE_FACTOR times the tool's probe requests.
COHERENCE_FACTOR = 0.5
COHERENCE_MIN = 5
# Implausible sources (`clustering.implausible_sources`): a source of at least SOURCE_MIN
# scenarios whose texts sit, on average, farther from their own tool among the trusted profiles
# (registry descriptions and probe requests) than SOURCE_LIMIT of the other tools: halfway
# between labels that always match (0) and labels drawn at random (0.5). All its scenarios and
# precautions are dropped.
SOURCE_LIMIT = 0.25
SOURCE_MIN = 5

# The source name of the carried-forward global compendium in a server merge.
PREVIOUS_GLOBAL = "previous-global"
# A precondition flag name is published only when at least this many distinct sources (clients at
# an edge, edges at the server) carried it for the same tool (`_released_flags`): flag names are
# sent as written, so one client's `has_mary_account` would otherwise reach every organization.
# The same k = 2 as the words a client releases (shared words, pooled release). There is no public
# flag vocabulary (neither the schema's registry nor the probe set names flags) to admit more.
FLAG_MIN_SOURCES = 2


def edge_merge(
    submissions: Sequence[MergeInput],
    schema: Schema,
    config: RoundConfig,
    previous_conflicts: Sequence[ConflictEntry] = (),
    *,
    embed: Embed,
    probe_set: ProbeSet | None = None,
    llm: OpenAICompatibleLLM | None = None,
    seed: int | np.random.SeedSequence | None = None,
    epsilon_remaining: float | None = None,
    confusion_margin: float = CONFUSION_MARGIN,
    confusion_rank: int = CONFUSION_RANK,
    source_limit: float = SOURCE_LIMIT,
    release_numeric: bool = True,
    drowned: frozenset[str] = frozenset(),
    conflicts_flags_released: bool = True,
) -> MergeResult:
    """Merge client compendiums into one edge compendium (Algorithm 1). `source_limit` above 1
    turns the implausible-source check off (percentiles are at most 1). `release_numeric=False`
    releases no numeric statistics at all (no noise, no ledger rows); `drowned` names numeric
    fields not to release (`drowned_fields`: no release of the round can make them useful).

    A precondition flag name is published only when FLAG_MIN_SOURCES clients carried it for the
    tool (`_released_flags`). `conflicts_flags_released=False` says `previous_conflicts` was
    written before that rule (it may hold one client's flag name): the flags its precautions and
    winners publish are then held to this merge's sources too."""
    return _merge(
        submissions,
        schema,
        config,
        previous_conflicts,
        embed=embed,
        probe_set=probe_set,
        llm=llm,
        # No seed: fresh entropy. The round's seed is public (the rounds API shows it): noise
        # drawn from it alone could be drawn again by anyone and subtracted.
        seed=np.random.SeedSequence() if seed is None else seed,
        epsilon_remaining=epsilon_remaining,
        noise=True,
        confusion_margin=confusion_margin,
        confusion_rank=confusion_rank,
        source_limit=source_limit,
        release_numeric=release_numeric,
        drowned=drowned,
        conflicts_flags_released=conflicts_flags_released,
    )


def server_merge(
    edge_results: Sequence[MergeInput],
    schema: Schema,
    config: RoundConfig,
    *,
    embed: Embed,
    probe_set: ProbeSet | None = None,
    llm: OpenAICompatibleLLM | None = None,
    confusion_margin: float = CONFUSION_MARGIN,
    confusion_rank: int = CONFUSION_RANK,
    previous: Compendium | None = None,
    previous_conflicts: Sequence[ConflictEntry] = (),
    source_limit: float = SOURCE_LIMIT,
    noise_scales: Mapping[str, Mapping[tuple[str, str], float]] | None = None,
    previous_flags_released: bool = True,
    conflicts_flags_released: bool = True,
) -> MergeResult:
    """The same operator one level up: edge compendiums in, the global compendium out. Numeric
    statistics were noised at the edges; here they are averaged, weighted by each edge's
    contributor count (post-processing: no new budget, no ledger entries). `noise_scales`, per
    edge (its MergeInput source) and (tool, field), is the scale of the Laplace noise that edge
    added (its ledger row): the average is then published without the digits below its own
    noise, as each edge's release is (`_published_number`); without it, to 6 significant digits.

    `previous` is the last published global compendium, carried forward: its scenarios,
    precautions, templates and annex enter the merge as one more input (clustered with the new
    ones, so a known scenario is not duplicated and its support adds up), and its statistics stay
    for tools that no edge reported this round (this round's releases replace the others). This is
    what lets a client send only what changed since the compendium it pulled. Entries of tools no
    longer in the schema are dropped.

    `previous_conflicts` is the server's own conflict log of the last round, L(r−1) one level up
    (with the operator's decisions): the conflicts between edges become precautions (or, where
    the operator picked one, winning scenarios) here, as an edge's own do in its next merge.

    An edge given as a Compendium is read as the schema in force reads it (`within_schema`), as
    the carried-forward global is: it was merged under the schema of its time (an erasure merges
    a published round's global again long after), and every edge holds statistics for every
    registry tool, so a tool dropped since would otherwise have every edge rejected whole.

    A precondition flag name is published only when FLAG_MIN_SOURCES edges carried it for the
    tool (`_released_flags`). The carried global's names passed that rule when it was published,
    so they stay without an edge sending them again (a client leaves out what the global covers,
    flags included); `previous_flags_released=False` says it was merged before the rule (it may
    hold one client's name): its names then count for no source, and stay only where this round's
    edges carry them. `conflicts_flags_released` as in `edge_merge`."""
    edge_results = [
        MergeInput(e.source, within_schema(e.document, schema))
        if isinstance(e.document, Compendium) else e
        for e in edge_results
    ]
    return _merge(
        edge_results,
        schema,
        config,
        previous_conflicts,
        embed=embed,
        probe_set=probe_set,
        llm=llm,
        seed=config.seed,
        epsilon_remaining=None,
        noise=False,
        confusion_margin=confusion_margin,
        confusion_rank=confusion_rank,
        previous=None if previous is None else within_schema(previous, schema),
        source_limit=source_limit,
        noise_scales=noise_scales,
        previous_flags_released=previous_flags_released,
        conflicts_flags_released=conflicts_flags_released,
    )


def conflicts_to_precautions(
    conflicts: Sequence[ConflictEntry], schema: Schema, limit: int | None = None
) -> list[Precaution]:
    """ConflictsToPrecautions(L(r−1)): "Use X for Y; do not use X when Z" per conflict entry."""
    limit = limit or schema.strings.precaution
    out = []
    for entry in sorted(conflicts, key=lambda c: (c.tool_id, c.centroid_id)):
        tool = schema.tools_by_id.get(entry.tool_id)
        if tool is None or (entry.resolution == "scenario" and _picked(entry) is not None):
            continue  # a picked scenario no longer among the candidates: as if undecided
        losing = losing_tool(entry)  # across tools, the precaution is the losing tool's
        if entry.resolution == "precaution":
            text = " ".join(entry.resolution_text.split())
            if text and (losing or entry.tool_id) in schema.tools_by_id:
                text = text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
                out.append(Precaution(tool_id=losing or entry.tool_id, text=text,
                                      support=1 + len(entry.dissenters)))
            continue
        name = tool.name or tool.tool_id
        if losing is not None:  # the same requests claimed for another tool: "do not use it"
            other = schema.tools_by_id.get(losing)
            if other is None:
                continue
            # worded as a client words the precaution of a request it had to correct
            requests = list(dict.fromkeys(" ".join(d["text"].split()) for d in entry.dissenters))
            text = precaution_text(other.name or other.tool_id, " or ".join(requests), name, limit)
            out.append(Precaution(tool_id=losing, text=text,
                                  support=sum(int(d.get("support") or 1) for d in entry.dissenters)))
            continue
        affirmative = _clause(entry.centroid["text"])
        exceptions = []
        centroid_flags = entry.centroid.get("preconditions") or {}
        for dissenter in entry.dissenters:
            clause = _clause(dissenter["text"])
            differing = {
                k: v
                for k, v in sorted((dissenter.get("preconditions") or {}).items())
                if centroid_flags.get(k) is not None and centroid_flags[k] != v
            }
            if not differing and clause == affirmative:
                # The same request, contradicting not the centroid's flags but those of a
                # member merged into it (the centroid states none): its own flags are the
                # exception.
                differing = {k: v for k, v in sorted((dissenter.get("preconditions") or {}).items())
                             if k not in centroid_flags}
            if differing:
                flags = ", ".join(f"{k} is {str(v).lower()}" for k, v in differing.items())
                clause = f"{clause} and {flags}"
            if clause and clause not in exceptions and clause != affirmative:
                exceptions.append(clause)
        if not exceptions:
            continue
        text = f"Use {name} for {affirmative}; do not use {name} when {' or when '.join(exceptions)}"
        if len(text) > limit:
            text = text[: limit - 1].rstrip() + "…"
        support = 1 + len(entry.dissenters)
        out.append(Precaution(tool_id=entry.tool_id, text=text, support=support))
    return out


def _picked(entry: ConflictEntry) -> dict | None:
    """The candidate (the centroid or a dissenter) whose text a reviewer picked as the winning
    scenario, or None: no text picked, or one that is no longer among the conflict's candidates
    (an erasure re-merged the log without the client that wrote it). Across tools the centroid
    and a dissenter may hold the same text: the one of the tool picked (`resolution_tool`)."""
    text = " ".join(entry.resolution_text.split())
    for candidate in [entry.centroid, *entry.dissenters] if text else []:
        if (" ".join(str(candidate.get("text", "")).split()) == text
                and entry.resolution_tool in ("", candidate.get("tool_id") or entry.tool_id)):
            return candidate
    return None


def conflict_winners(conflicts: Sequence[ConflictEntry], schema: Schema) -> list[Scenario]:
    """The scenarios a reviewer picked as winners of last round's conflicts (resolution
    "scenario"): each enters the merge's scenarios with the conflict's support. Only a text that
    is still one of the conflict's candidates wins; any other text is ignored (and the conflict
    is composed into a precaution as if undecided, `conflicts_to_precautions`)."""
    out = []
    for entry in sorted(conflicts, key=lambda c: (c.tool_id, c.centroid_id)):
        picked = _picked(entry) if entry.resolution == "scenario" else None
        if picked is None or entry.tool_id not in schema.tools_by_id:
            continue
        text = " ".join(entry.resolution_text.split())
        preconditions = dict(picked.get("preconditions") or {})
        tool_id = picked.get("tool_id") or entry.tool_id  # across tools: its own tool
        if tool_id not in schema.tools_by_id:
            continue
        out.append(
            Scenario(
                tool_id=tool_id,
                text=text[: schema.strings.scenario],
                preconditions=preconditions,
                support=1 + len(entry.dissenters),
            )
        )
    return out


def conflict_losers(conflicts: Sequence[ConflictEntry]) -> set[tuple[str, str]]:
    """The (tool, text) claims a reviewer's pick beat across tools: of a conflict whose picked
    scenario (`_picked`) wins for one tool, every candidate claimed for another tool. Within one
    tool nothing: the candidates differ in their flags, not in the tool."""
    out = set()
    for entry in conflicts:
        picked = _picked(entry) if entry.resolution == "scenario" else None
        if picked is None:
            continue
        winner = picked.get("tool_id") or entry.tool_id
        for candidate in [entry.centroid, *entry.dissenters]:
            tool_id = candidate.get("tool_id") or entry.tool_id
            if tool_id != winner:
                out.add((tool_id, " ".join(str(candidate.get("text", "")).split())))
    return out


def _clause(text: str) -> str:
    """A request as a clause inside a sentence: its first letter in lower case when that only
    undoes sentence case ("Forecast for a city" -> "forecast for a city"). A first word that is
    "I" ("I'm looking for ..."), an acronym ("PDF to Word") or not a plain capitalized word
    ("iPhone", a placeholder) is kept as written."""
    text = " ".join(text.split()).rstrip(" .;!?")
    first = re.split(r"[\s'’]", text, maxsplit=1)[0] if text else ""
    if len(first) > 1 and first[0].isupper() and first[1:].islower() and first[1:].isalpha():
        return text[:1].lower() + text[1:]
    return text


# --- the operator -------------------------------------------------------------------------------


class _Clock:
    def __init__(self, stats: MergeStats):
        self.stats = stats
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats.timings_ms[name] = round((now - self.last) * 1000.0, 3)
        self.last = now


def _validated(inputs: Sequence[MergeInput], schema: Schema, stats: MergeStats):
    accepted: list[tuple[str, Compendium]] = []
    rejected: list[Rejection] = []
    for item in sorted(inputs, key=lambda i: i.source):
        document = item.document
        if isinstance(document, Compendium):
            document = document.model_dump(mode="json", exclude_none=True)
        result = validate_compendium(document, schema)
        if result.ok:
            accepted.append((item.source, result.compendium))
        else:
            rejected.append(Rejection(item.source, [str(v) for v in result.violations]))
    stats.inputs = len(inputs)
    stats.accepted = len(accepted)
    stats.rejected = len(rejected)
    return accepted, rejected


def _merge(
    inputs: Sequence[MergeInput],
    schema: Schema,
    config: RoundConfig,
    previous_conflicts: Sequence[ConflictEntry],
    *,
    embed: Embed,
    probe_set: ProbeSet | None,
    llm: OpenAICompatibleLLM | None,
    seed,
    epsilon_remaining: float | None,
    noise: bool,
    confusion_margin: float,
    confusion_rank: int,
    source_limit: float,
    previous: Compendium | None = None,
    release_numeric: bool = True,
    noise_scales: Mapping[str, Mapping[tuple[str, str], float]] | None = None,
    drowned: frozenset[str] = frozenset(),
    previous_flags_released: bool = True,
    conflicts_flags_released: bool = True,
) -> MergeResult:
    stats = MergeStats(summarizer=config.summarizer)
    clock = _Clock(stats)
    carry = [MergeInput(PREVIOUS_GLOBAL, previous)] if previous is not None else []
    accepted, rejected = _validated(list(inputs) + carry, schema, stats)
    clock.lap("validate")

    # M first: the budget check must refuse before any noise is drawn or any text work is done.
    fresh = [(s, comp) for s, comp in accepted if not (carry and s == PREVIOUS_GLOBAL)]
    metadata, ledger, withheld = _merge_metadata(
        fresh, schema, config, seed, epsilon_remaining, noise, release_numeric, noise_scales,
        drowned,
    )
    if noise and release_numeric:
        stats.fields_not_released = sorted(drowned & set(schema.fields_by_name))
    reported = {m.tool_id for m in metadata}  # a tool whose figures were withheld counts too
    releasable = {f.name for f in schema.releasable_fields}
    for source, comp in accepted:
        if carry and source == PREVIOUS_GLOBAL:  # its statistics stay for tools not reported
            # (but for a field no edge releases, kind `other`, which a global published before
            # that rule may hold)
            kept = [_tool_metadata(schema, m.tool_id,
                                   {k: v for k, v in m.stats.items() if k in releasable})
                    for m in comp.metadata if m.tool_id not in reported]
            metadata = sorted(metadata + kept, key=lambda m: m.tool_id)
    if not noise and config.global_metadata == "stats":
        # Without description and spec, an entry without statistics says nothing.
        metadata = [m.model_copy(update={"description": None, "spec": None})
                    for m in metadata if m.stats]
    stats.numeric_releases = len(ledger)
    stats.stats_withheld = withheld
    stats.epsilon_spent = round_spend(
        [e.epsilon for e in ledger], config.field_cap, [e.tool_id for e in ledger]
    )
    clock.lap("metadata")

    scenario_items = [
        Item(source, s.tool_id, s.text, dict(s.preconditions), s.support, None)
        for source, comp in accepted
        for s in comp.scenarios
    ]
    precaution_items = [
        Item(source, p.tool_id, p.text, {}, p.support, None)
        for source, comp in accepted
        for p in comp.precautions
    ]
    # Before anything compares flags (the clustering's contradictions, the conflict log, the
    # centroid ids, the exact dedup): names too few sources carried are left off.
    released, held = _released_flags(
        scenario_items, carried=bool(carry), carried_released=previous_flags_released
    )
    for item in scenario_items:
        item.preconditions = _within(item.preconditions, item.tool_id, released)
    if not conflicts_flags_released:
        previous_conflicts, more = _conflicts_within(previous_conflicts, released)
        held |= more
    stats.flags_held_back = len(held)
    stats.scenarios_in = len(scenario_items)
    stats.precautions_in = len(precaution_items)
    tool_ids = [t.tool_id for t in schema.tools]
    texts = sorted(
        {i.text for i in scenario_items}
        | {i.text for i in precaution_items}
        | {t.description for t in schema.tools}
    )
    vectors = embed(texts) if texts else np.zeros((0, 1), dtype=np.float32)
    by_text = {t: vectors[i] for i, t in enumerate(texts)}
    for item in scenario_items + precaution_items:
        item.vector = by_text[item.text]
    clock.lap("embed")

    flagged: list[FlaggedEntry] = []
    profiles = None
    short: Counter = Counter()  # groups Krum judged below its premise, by (n, f)
    if scenario_items and tool_ids:
        descriptions = np.stack([by_text[t.description] for t in schema.tools])
        profiles = (probe_set.profiles(tool_ids, descriptions) if probe_set
                    else trusted_profiles(tool_ids, descriptions))
        scenario_items, precaution_items, flagged = _screen_sources(
            scenario_items, precaution_items, tool_ids, profiles, source_limit, stats
        )
        scenario_items, more = _cross_check(
            scenario_items, tool_ids, descriptions, probe_set, confusion_margin, confusion_rank,
            stats, config.tau,
        )
        flagged += more
        scenario_items, more = _robust_sources(scenario_items, config, stats, short)
        flagged += more
    clock.lap("cross_validate")

    probe = consistency_probe(llm) if llm is not None else None
    slots, conflicts, more = _cluster_scenarios(scenario_items, config, probe, stats, short)
    flagged += more
    if probe is not None:
        stats.consistency_asked, stats.consistency_unanswered = probe.asked, probe.unanswered
    stats.krum_below_premise = sum(short.values())
    stats.krum_below_premise_sizes = [{"n": n, "f": f, "groups": count}
                                      for (n, f), count in sorted(short.items())]
    if config.conflict_log and profiles is not None:
        # An edge's sources are clients, whose stated support is their own word; the server's
        # are edges, whose support counts the clients that agreed there.
        slots, crossed = _cross_tool_conflicts(slots, tool_ids, profiles, config.tau,
                                               support_first=not noise)
        conflicts += crossed
        stats.cross_tool_dropped = sum(len(c.dissenters) for c in crossed)
    clock.lap("cluster")

    summarizer = Summarizer(
        method=config.summarizer,
        embed=embed,
        llm=llm,
        textgrad_steps=config.textgrad_steps,
        text_limit=schema.strings.scenario,
    )
    if probe_set is not None and len(probe_set):
        summarizer.context = RoutingContext(
            probe_set,
            [s["tool_id"] for s in slots],
            np.stack([s["vector"] for s in slots]) if slots else np.zeros((0, vectors.shape[1])),
        )
    clusters = {
        index: Cluster("scenario", slot["tool_id"], slot["texts"], slot["vectors"], slot=index)
        for index, slot in enumerate(slots)
        if slot["summarize"]
    }
    summarizer.prepare(list(clusters.values()))
    scenarios = []
    for index, slot in enumerate(slots):
        if slot["summarize"]:
            text = summarizer.summarize(clusters[index]).text
        else:
            text = slot["texts"][0]
        scenarios.append(
            Scenario(
                tool_id=slot["tool_id"],
                text=text,
                preconditions=slot["preconditions"],
                support=slot["support"],
            )
        )
    # A scenario picked across tools wins: the same requests claimed for the tools it beat (a
    # carried-forward global still holds the merge's own pick, a source may send them again)
    # are left out, as this merge's cross-tool check leaves out the claims that lose.
    beaten = conflict_losers(previous_conflicts)
    scenarios = [s for s in scenarios if (s.tool_id, " ".join(s.text.split())) not in beaten]
    scenarios = _dedupe_exact_scenarios(scenarios + conflict_winners(previous_conflicts, schema))
    if not noise and config.max_scenarios_per_tool is not None:
        scenarios = _top_supported(scenarios, config.max_scenarios_per_tool)
    stats.scenarios_out = len(scenarios)
    clock.lap("summarize_scenarios")

    summarizer.text_limit = schema.strings.precaution
    precautions = _merge_precautions(precaution_items, config, summarizer)
    from_conflicts = conflicts_to_precautions(previous_conflicts, schema)
    precautions = _dedupe_precautions(precautions + from_conflicts)
    stats.precautions_from_conflicts = len(from_conflicts)
    stats.precautions_out = len(precautions)
    clock.lap("precautions")

    templates = _merge_templates(accepted, config, llm, summarizer, schema, stats)
    annex = _merge_annex(accepted, config, embed, stats)
    clock.lap("templates_annex")

    contributors = [c.num_users or 1 for _, c in fresh] if not noise else None
    num_users = (
        (sum(contributors) if contributors else None) if not noise else (len(accepted) or None)
    )
    cap = schema.limits.counts  # the counts add up over the inputs; published at most the limit
    compendium = Compendium(
        metadata=metadata,
        scenarios=_counts_capped(scenarios, cap),
        precautions=_counts_capped(precautions, cap),
        templates=templates,
        annex=annex,
        num_users=None if num_users is None else min(num_users, cap),
    )
    check = validate_compendium(compendium.model_dump(mode="json", exclude_none=True), schema)
    if not check.ok:  # the operator only emits valid compendiums; this is a bug if it fires
        raise RuntimeError(f"merge produced an invalid compendium: {check.violations[:3]}")
    scenario_vectors = embed([s.text for s in scenarios]) if scenarios else None
    precaution_vectors = embed([p.text for p in precautions]) if precautions else None
    stats.summarizer_fallbacks = summarizer.fallbacks
    stats.summaries = dict(summarizer.counts)
    stats.clusters = len(slots)
    stats.conflicts = len(conflicts)
    clock.lap("finalize")
    stats.timings_ms["total"] = round(sum(stats.timings_ms.values()), 3)
    return MergeResult(
        compendium=compendium,
        conflicts=conflicts,
        ledger=ledger,
        stats=stats,
        rejected=rejected,
        flagged=flagged,
        accepted_sources=[source for source, _ in accepted],
        scenario_embeddings=scenario_vectors,
        precaution_embeddings=precaution_vectors,
    )


def within_schema(compendium: Compendium, schema: Schema) -> Compendium:
    """`compendium` as the schema in force reads it: the entries of the tools it still has, the
    statistics of the fields it still declares, each within the field's range as declared now
    (post-processing of a released figure). A carried-forward global must not be rejected
    whole, and every entry it carried lost, because the registry dropped a tool or the operator
    removed a numeric field or narrowed its range."""
    known, fields = schema.tool_ids, schema.fields_by_name

    def within(stats: dict[str, float]) -> dict[str, float]:
        return {name: min(fields[name].max, max(fields[name].min, value))
                for name, value in stats.items() if name in fields}

    return compendium.model_copy(
        update={
            "metadata": [m.model_copy(update={"stats": within(m.stats)})
                         for m in compendium.metadata if m.tool_id in known],
            "scenarios": [s for s in compendium.scenarios if s.tool_id in known],
            "precautions": [p for p in compendium.precautions if p.tool_id in known],
            "templates": [t for t in compendium.templates if t.tool_id in known],
        }
    )


def _published_number(value: float, noise_scale: float | None = None, low: float = -math.inf,
                      high: float = math.inf) -> float:
    """A released statistic without digits that carry nothing: a noised value is kept to a
    hundredth of its noise scale's order of magnitude (post-processing: no privacy cost), any
    other to 6 significant digits. A 17-digit float per field was a sixth of a global compendium.
    Kept within [low, high], the field's clipping window, after rounding (a step wider than the
    window would round a value out of it; out of the declared range, the compendium would be
    refused)."""
    if noise_scale is not None and noise_scale > 0:
        step = 10.0 ** (math.floor(math.log10(noise_scale)) - 2)
        # At a huge ε the scale nears the smallest floats and value/step overflows: such a step
        # drops no digit that 6 significant ones keep, so it is skipped.
        if math.isfinite(value / step):
            value = round(value / step) * step
    # + 0.0: no -0.0, which jsonb stores as 0 (the stored global would no longer hash to its
    # sha256, and clients' dcz bodies against it would be refused)
    return float(min(high, max(low, float(f"{value:.6g}")))) + 0.0


def _average_noise_scale(scales: Sequence[float | None], weights: np.ndarray) -> float | None:
    """The scale of the noise in Σ w_i·x_i / Σ w_i when x_i carries Laplace noise of scale b_i,
    as the scale of one Laplace variable of the same variance (Var = 2·Σ (w_i·b_i)² / W²):
    what `_published_number` trims the average's digits to. None when an input's scale is not
    known (then no digit is dropped for noise)."""
    if not scales or any(b is None or not b > 0 for b in scales):
        return None
    w = weights / weights.sum()
    return float(math.sqrt(float(np.sum((w * np.asarray(scales, dtype=float)) ** 2))))


def _released_flags(
    items: Sequence[Item], *, carried: bool, carried_released: bool
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """The (tool, flag name) pairs a merge may publish, and those it holds back. A name is
    published for a tool when at least FLAG_MIN_SOURCES distinct sources (its inputs: clients at
    an edge, edges at the server) carried it on a scenario of that tool, whatever the value. The
    carried global (`carried`: the PREVIOUS_GLOBAL input) is not a source: its names are published
    again when it was merged under this rule (`carried_released`), and otherwise only as this
    round's sources earn them."""
    sources: dict[tuple[str, str], set[str]] = defaultdict(set)
    previous: set[tuple[str, str]] = set()
    for item in items:
        for name in item.preconditions:
            if carried and item.source == PREVIOUS_GLOBAL:
                previous.add((item.tool_id, name))
            else:
                sources[(item.tool_id, name)].add(item.source)
    released = {key for key, names in sources.items() if len(names) >= FLAG_MIN_SOURCES}
    if carried_released:
        released |= previous
    return released, (set(sources) | previous) - released


def _within(flags: Mapping[str, bool], tool_id: str, released: set[tuple[str, str]]) -> dict:
    """`flags` without the names not released for `tool_id`."""
    return {name: value for name, value in flags.items() if (tool_id, name) in released}


def _conflicts_within(
    conflicts: Sequence[ConflictEntry], released: set[tuple[str, str]]
) -> tuple[list[ConflictEntry], set[tuple[str, str]]]:
    """A conflict log written before the flag rule, its candidates' flags held to `released`
    (each to its own tool's: across tools a dissenter is another tool's), and the (tool, name)
    pairs that left off. The entries' ids stay: reviewers' decisions are keyed by them."""
    held: set[tuple[str, str]] = set()

    def within(candidate: dict, tool_id: str) -> dict:
        tool_id = candidate.get("tool_id") or tool_id
        flags = candidate.get("preconditions") or {}
        held.update((tool_id, name) for name in flags if (tool_id, name) not in released)
        return {**candidate, "preconditions": _within(flags, tool_id, released)}

    out = [
        ConflictEntry(e.tool_id, e.centroid_id, within(e.centroid, e.tool_id),
                      [within(d, e.tool_id) for d in e.dissenters], e.reason, e.resolution,
                      e.resolution_text, e.resolution_tool)
        for e in conflicts
    ]
    return out, held


def conflict_within_own_sources(entry: ConflictEntry) -> ConflictEntry:
    """A conflict entry of a log written before the flag rule, its candidates' flag names held
    to those FLAG_MIN_SOURCES distinct sources among its own candidates carried for the tool
    (`_released_flags`: the carried global counts for none, as a candidate without a source
    does), as `_conflicts_within` holds them. What a reviewer may be shown (and accept) before a
    merge reads the log: the merge that reads it holds the names to its own sources instead
    (`conflicts_flags_released=False`), which a review cannot know, and an entry's own sources
    are the most a review can tell apart (a name two of them carried is not one client's)."""
    items = [
        Item(source, candidate.get("tool_id") or entry.tool_id, "",
             dict(candidate.get("preconditions") or {}), 1, None)
        for candidate in [entry.centroid, *entry.dissenters]
        if (source := str(candidate.get("source") or ""))
    ]
    released, _ = _released_flags(items, carried=True, carried_released=False)
    [within], _ = _conflicts_within([entry], released)
    return within


def _merge_metadata(accepted, schema, config, seed, epsilon_remaining, noise, release_numeric=True,
                    noise_scales=None, drowned=frozenset()):
    if noise:
        return (*_release_metadata(accepted, schema, config, seed, epsilon_remaining,
                                   release_numeric, drowned), 0)
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    weights: dict[tuple[str, str], list[float]] = defaultdict(list)
    scales: dict[tuple[str, str], list[float | None]] = defaultdict(list)
    tools: set[str] = set()
    for source, comp in accepted:
        edge_scales = (noise_scales or {}).get(source, {})
        for meta in comp.metadata:
            tools.add(meta.tool_id)
            for name, value in meta.stats.items():
                values[(meta.tool_id, name)].append(float(value))
                weights[(meta.tool_id, name)].append(float(comp.num_users or 1))
                scales[(meta.tool_id, name)].append(edge_scales.get((meta.tool_id, name)))
    released: dict[tuple[str, str], float] = {}
    withheld = 0
    releasable = {f.name for f in schema.releasable_fields}
    for key in sorted(values):
        if key[1] not in releasable:  # a field no edge releases (kind `other`): never published
            continue
        spec = schema.fields_by_name[key[1]]
        w = np.asarray(weights[key])
        value = float(np.dot(np.asarray(values[key]), w) / w.sum())
        scale = _average_noise_scale(scales[key], w)
        if noise_dominated(scale, spec):
            withheld += 1
            continue
        # Each edge's figure lies in the field's clipping window, so their average does too
        # (an edge released before that clamp may not: clamping here is post-processing).
        bound = clip_bound(spec)
        released[key] = _published_number(value, scale, bound.lo, bound.hi)
    metadata = [
        _tool_metadata(
            schema, tool_id, {name: v for (t, name), v in released.items() if t == tool_id}
        )
        for tool_id in sorted(tools)
    ]
    return metadata, [], withheld


def noise_to_window(scale: float | None, spec: NumericFieldSpec) -> float | None:
    """Laplace noise of `scale` as a multiple of the field's clipping window
    [min, min(max, min + Δ)] (`clip_bound`), the interval every client's value is clipped to and
    every released figure clamped to, whose width the noise is calibrated to (b = w/(K·ε_j)).
    None when the scale is not known. The scale falls as 1/ε and 1/K, so a ratio r ≥ 1 says
    roughly r times the ε per round, or r times the clients per edge, would bring it under the
    window."""
    if scale is None:
        return None
    return scale / clip_bound(spec).width


def noise_dominated(scale: float | None, spec: NumericFieldSpec) -> bool:
    """Whether Laplace noise of `scale` is at least as wide as the field's clipping window (not
    its declared range: `calls` declares [0, 1000] but every figure lies in [0, Δ = 50]). The
    released value, clamped into the window, then says nothing about the tool: it lands near
    either end whatever the clients reported. The global compendium leaves such a figure out
    (dropping a released value is post-processing: the ε stays spent, the ledger keeps it); the
    edges' own releases keep theirs, since the server's average over edges can narrow them."""
    return scale is not None and scale >= clip_bound(spec).width


def _narrowest_published_scales(
    schema: Schema, config: RoundConfig, most_contributors: int, edges: int
) -> list[tuple[NumericFieldSpec, float]]:
    """(field, scale) of the narrowest noise a round's published figure of each declared field
    can carry: from an edge of `most_contributors` (an upper bound on any edge's K; under a
    robust rule the most values any edge's trimmed mean keeps, `robust.most_kept`) averaged over
    `edges` edges with equal weights (Σ w_i² ≥ 1/E: the narrowest the server's average gets).
    ε_j is the one each released statistic gets whatever is skipped (over the registry's T·F
    statistics, or 2·F*·F under a field cap, F the fields an edge can release). Empty when no
    release is possible."""
    fields = schema.releasable_fields
    if not fields or not schema.tools or most_contributors < 1 or edges < 1:
        return []
    eps_j = config.per_field_epsilon(len(schema.tools) * len(fields), fields_per_tool=len(fields))
    # Under a robust rule an edge averages the K − 2f values its trimmed mean keeps.
    kept = (most_contributors if config.robust_rule == "none"
            else most_kept(most_contributors, config.trim_fraction))
    return [(spec, laplace_scale(clip_bound(spec).width, kept, eps_j) / math.sqrt(edges))
            for spec in fields]


def published_noise_to_window(
    schema: Schema, config: RoundConfig, most_contributors: int, edges: int
) -> float | None:
    """The narrowest noise a round's published figures can carry (`_narrowest_published_scales`)
    as a multiple of their clipping window (`noise_to_window`), the largest over the declared
    fields. The noise is calibrated to each field's window, so it is 1/(K·ε_j·√E) for every
    field. None when no release is possible (no field, tool or client)."""
    ratios = [noise_to_window(scale, spec)
              for spec, scale in _narrowest_published_scales(schema, config, most_contributors,
                                                             edges)]
    return max(ratios, default=None)


def drowned_fields(
    schema: Schema, config: RoundConfig, most_contributors: int, edges: int
) -> frozenset[str]:
    """The numeric fields that no release of a round can make useful: even from the edge with the
    most contributors and averaged over `edges` edges at best (`_narrowest_published_scales`),
    the published figure's noise is at least as wide as the field's clipping window
    (`noise_dominated`), so the global compendium would leave it out. Edges do not release these
    (no noise drawn, no ε spent, no ledger row): the decision depends on counts and the
    configuration only, never on a value. Skipping a field does not change ε_j, so it does not
    change any other figure. The noise is calibrated to the window, so its ratio to the window,
    1/(K·ε_j·√E), is the same for every field: a round drowns all of them or none."""
    return frozenset(
        spec.name
        for spec, scale in _narrowest_published_scales(schema, config, most_contributors, edges)
        if noise_dominated(scale, spec)
    )


def _release_metadata(accepted, schema, config, seed, epsilon_remaining, release_numeric,
                      drowned=frozenset()):
    """The edge's Laplace release (paper, App. "Edge Merge Operator", stage 2).

    What is released must not depend on the private data except through the noised values: every
    (tool, field) of the registry and the declared numeric fields is released, each the mean over
    all K accepted submissions, a submission that did not report it counting the field's neutral
    value (as a client counts a user who did not use a tool). Releasing only the pairs some
    client reported, or averaging over the clients that reported a pair, would publish exactly
    which tools were used (a deterministic function of one user's data: no ε bounds it) and
    calibrate the noise to a private count.

    The declared fields are those an edge can release (`Schema.releasable_fields`): a field of
    kind `other` no client derives from a usage log takes no share of ε (F counts it not), no
    noise and no ledger row, and a value a client sent for it (the server refuses one on
    arrival; a submission stored before) is left out."""
    ledger: list[LedgerEntry] = []
    k = len(accepted)
    fields = schema.releasable_fields
    if not release_numeric or k == 0 or not fields or not schema.tools:
        return [], ledger
    reported: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _, comp in accepted:
        for meta in comp.metadata:
            for name, value in meta.stats.items():
                reported[(meta.tool_id, name)].append(float(value))
    keys = sorted((t.tool_id, f.name) for t in schema.tools for f in fields)
    eps_j = config.per_field_epsilon(len(keys), fields_per_tool=len(fields))
    tools = sorted({t for t, _ in keys})
    keys = [key for key in keys if key[1] not in drowned]
    spend = round_spend([eps_j] * len(keys), config.field_cap, [t for t, _ in keys])
    # A relative tolerance, as the accountant's (federation.accounting.RELATIVE_TOLERANCE): the
    # reservation checked at open and this sum of T·F shares differ in their last bits.
    if epsilon_remaining is not None and spend > epsilon_remaining + 1e-9 * max(1.0, spend):
        raise BudgetExceeded(
            f"privacy budget exceeded: this release needs ε = {spend:.6g} but only "
            f"{max(0.0, epsilon_remaining):.6g} of the federation's epsilon budget is left"
        )
    base = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    released: dict[tuple[str, str], float] = {}
    for key in keys:
        rng = _statistic_rng(base, *key)
        spec = schema.fields_by_name[key[1]]
        bound = clip_bound(spec)
        data = reported.get(key, [])
        data = data + [bound.neutral] * (k - len(data))
        # Clip into a window of width min(Δ, max − min) inside the declared range so the
        # average's sensitivity really is that width over K, whatever a client sent; the noise
        # is calibrated to that width (a frequency declares Δ = 2, the ℓ1 bound of a whole
        # normalized vector, but each tool's share lies in [0, 1] and is released on its own).
        data = np.clip(np.asarray(data), bound.lo, bound.hi)
        if config.robust_rule != "none":
            f = byzantine_count(k, config.trim_fraction)
            data = np.sort(data)[f : k - f] if k - 2 * f >= 1 else data
        # The true mean lies in the window, so the noised one is clamped to it, not merely to the
        # declared range: post-processing (no ε), and a figure no further from the truth.
        value, scale = laplace_release(
            data,
            lower=bound.lo,
            upper=bound.hi,
            sensitivity=bound.width,
            epsilon=eps_j,
            rng=rng,
        )
        released[key] = _published_number(value, scale, bound.lo, bound.hi)
        ledger.append(
            LedgerEntry(
                tool_id=key[0],
                field=key[1],
                sensitivity=bound.width,
                contributors=len(data),
                epsilon=eps_j,
                noise_scale=scale,
                mechanism="laplace" if config.robust_rule == "none" else "laplace-trimmed-mean",
                field_cap=config.field_cap,
            )
        )
    by_tool: dict[str, dict[str, float]] = {tool_id: {} for tool_id in tools}
    for (tool_id, name), value in released.items():
        by_tool[tool_id][name] = value
    metadata = [_tool_metadata(schema, tool_id, by_tool[tool_id]) for tool_id in tools]
    return metadata, ledger


def _statistic_rng(base: np.random.SeedSequence, tool_id: str, field: str) -> np.random.Generator:
    """The noise of one statistic, drawn from the release's seed and the statistic's name alone:
    which other statistics a release leaves out (drowned fields, a schema change) cannot shift
    one statistic's draw onto another's value, as one stream drawn in key order would."""
    name = hashlib.sha256(f"{tool_id}\x00{field}".encode()).digest()
    return np.random.default_rng([*base.generate_state(8), *np.frombuffer(name, dtype=np.uint32)])


def _tool_metadata(schema: Schema, tool_id: str, stats: dict[str, float]) -> ToolMetadata:
    """A tool's published M: the registry's canonical description and spec, and `stats`."""
    spec = schema.tools_by_id[tool_id]
    return ToolMetadata(
        tool_id=tool_id,
        description=spec.description,
        spec=spec.spec or None,
        stats=dict(sorted(stats.items())),
    )


def _screen_sources(
    scenarios: list[Item],
    precautions: list[Item],
    tool_ids: list[str],
    profiles: np.ndarray,
    limit: float,
    stats: MergeStats,
) -> tuple[list[Item], list[Item], list[FlaggedEntry]]:
    """The scenarios and precautions of the sources that pass `implausible_sources`, and a flagged
    entry for each scenario of those that do not (`own_similarity`: the source's mean own-tool
    percentile; `closest_similarity`: the limit)."""
    dropped = implausible_sources(
        scenarios, tool_ids, profiles, limit=limit, minimum=SOURCE_MIN,
        exempt=frozenset({PREVIOUS_GLOBAL}),
    )
    stats.dropped_sources = sorted(dropped)
    if not dropped:
        return scenarios, precautions, []
    flagged = [
        FlaggedEntry(item.source, item.tool_id, item.text, "", round(dropped[item.source][0], 6),
                     limit, reason="implausible source")
        for item in scenarios
        if item.source in dropped
    ]
    stats.flagged_sources = len(flagged)
    return (
        [item for item in scenarios if item.source not in dropped],
        [item for item in precautions if item.source not in dropped],
        flagged,
    )


def _cross_check(
    items: list[Item],
    tool_ids: list[str],
    descriptions: np.ndarray,
    probe_set: ProbeSet | None,
    confusion_margin: float,
    confusion_rank: int,
    stats: MergeStats,
    near: float,
) -> tuple[list[Item], list[FlaggedEntry]]:
    """The scenarios that pass the cross-checks, and those dropped: tool-confusion entries (margin
    calibrated on the probe when there is one; an entry is judged by profiles without its near
    duplicates of its own tool, cosine >= `near`), then, with a probe, incoherent batches."""
    profiles = tool_profiles(tool_ids, descriptions, items)
    margin = confusion_margin
    if probe_set:
        gaps = probe_set.honest_gaps(tool_ids, descriptions, near)
        margin = calibrated_margin(gaps, confusion_margin, CONFUSION_HONEST_RATE)
    stats.confusion_margin = round(margin, 6)
    verdicts = confusion_verdicts(items, tool_ids, profiles, margin=margin, rank=confusion_rank,
                                  near=near)
    flagged = [
        FlaggedEntry(item.source, item.tool_id, item.text, v.closest_tool,
                     round(v.own_similarity, 6), round(v.closest_similarity, 6))
        for item, v in zip(items, verdicts, strict=True)
        if v.flagged
    ]
    items = [item for item, v in zip(items, verdicts, strict=True) if not v.flagged]
    stats.flagged_confusion = len(flagged)
    if not probe_set:
        return items, flagged
    batches = incoherent_batches(
        items, probe_set.coherence(), factor=COHERENCE_FACTOR, minimum=COHERENCE_MIN,
        exempt=frozenset({PREVIOUS_GLOBAL}),
    )
    incoherent = [
        FlaggedEntry(item.source, item.tool_id, item.text, "", round(coherence, 6),
                     round(reference, 6), reason="incoherent batch")
        for item in items
        if (found := batches.get((item.source, item.tool_id))) is not None
        for coherence, reference in [found]
    ]
    stats.flagged_incoherent = len(incoherent)
    kept = [item for item in items if (item.source, item.tool_id) not in batches]
    return kept, flagged + incoherent


def _robust_sources(
    items: list[Item], config: RoundConfig, stats: MergeStats, short: Counter | None = None
) -> tuple[list[Item], list[FlaggedEntry]]:
    """The scenarios the robust rule keeps across sources (`robust.robust_batches`, f from
    `trim_fraction`), and a flagged entry for each it drops (`own_similarity`: the cosine of the
    scenario to its batch's mean direction, `closest_similarity`: that of the batch's mean to the
    mean of the tool's kept batches). The carried-forward global takes no part. `short` counts
    the tools Krum judged below its premise (`robust.robust_keep`)."""
    if config.robust_rule == "none":
        return items, []
    batches: dict[tuple[str, str], list[np.ndarray]] = defaultdict(list)
    for item in items:
        if item.source != PREVIOUS_GLOBAL:
            batches[(item.source, item.tool_id)].append(item.vector)
    stacked = {key: np.stack(vectors) for key, vectors in batches.items()}
    dropped = robust_batches(stacked, config.robust_rule, config.trim_fraction, short)
    if not dropped:
        return items, []

    def direction(vectors: np.ndarray) -> np.ndarray:
        mean = np.asarray(vectors, dtype=np.float64).mean(axis=0)
        return mean / max(float(np.linalg.norm(mean)), 1e-12)

    kept_direction = {
        tool: direction(np.vstack([v for (s, t), v in stacked.items()
                                   if t == tool and (s, t) not in dropped]))
        for tool in {t for _, t in dropped}
    }
    batch_direction = {key: direction(stacked[key]) for key in dropped}
    flagged = [
        FlaggedEntry(
            item.source, item.tool_id, item.text, "",
            round(float(item.vector @ batch_direction[key]), 6),
            round(float(batch_direction[key] @ kept_direction[item.tool_id]), 6),
            reason=f"robust rule ({config.robust_rule})",
        )
        for item in items
        if (key := (item.source, item.tool_id)) in dropped
    ]
    stats.robust_dropped += len(flagged)
    for entry in flagged:
        stats.robust_sources[entry.source] = stats.robust_sources.get(entry.source, 0) + 1
    return [item for item in items if (item.source, item.tool_id) not in dropped], flagged


def _cluster_scenarios(items: list[Item], config: RoundConfig, probe: ConsistencyProbe | None,
                       stats: MergeStats, short: Counter | None = None):
    """The cluster slots, the conflict log, and a flagged entry for each member the robust rule
    drops inside a cluster (reason "robust rule (<rule>) within a cluster"; `own_similarity`: its
    cosine to the mean direction of the members kept, `closest_similarity`: the least cosine of a
    kept member to it), so that `result.flagged` lists every scenario the rule took out. `short`
    counts the clusters Krum judged below its premise (`robust.robust_keep`)."""
    by_tool: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        by_tool[item.tool_id].append(item)
    slots: list[dict] = []
    conflicts: list[ConflictEntry] = []
    flagged: list[FlaggedEntry] = []
    for tool_id in sorted(by_tool):
        group = sorted(by_tool[tool_id], key=item_order_key)
        matrix = np.stack([i.vector for i in group])
        for cluster in greedy_cluster(matrix, config.tau):
            members = [group[i] for i in cluster]
            # The rule judges this round's sources; the carried-forward global (the last published
            # compendium) stays a member with its support, as it takes no part across sources.
            judged = [i for i, m in enumerate(members) if m.source != PREVIOUS_GLOBAL]
            keep = (robust_keep(np.stack([members[i].vector for i in judged]),
                                config.robust_rule, config.trim_fraction, short)
                    if judged else [])
            stats.robust_dropped += len(judged) - len(keep)
            kept = {judged[i] for i in keep}
            if len(kept) < len(judged):
                flagged += _dropped_in_cluster(members, kept, config.robust_rule)
            members = [m for i, m in enumerate(members)
                       if i in kept or m.source == PREVIOUS_GLOBAL]
            decision = (decide_cluster(members, probe) if config.conflict_log
                        else ClusterDecision(True, 0, list(range(len(members))), [], "consistent"))
            agreeing = [members[i] for i in decision.agreeing]
            support = sum(m.support for m in agreeing)
            if decision.consistent:
                ordered = sorted(members, key=item_order_key)
                vectors = np.stack([m.vector for m in ordered])
                slots.append(
                    {
                        "tool_id": tool_id,
                        "texts": [m.text for m in ordered],
                        "vectors": vectors,
                        "vector": vectors[next(central_order(vectors))],
                        "preconditions": merged_flags([m.preconditions for m in members]),
                        "support": support,
                        "summarize": True,
                        "sources": sorted({m.source for m in members}),
                    }
                )
                continue
            anchor = members[decision.anchor]
            slots.append(
                {
                    "tool_id": tool_id,
                    "texts": [anchor.text],
                    "vectors": anchor.vector[None, :],
                    "vector": anchor.vector,
                    "preconditions": dict(sorted(anchor.preconditions.items())),
                    "support": support,
                    "summarize": False,
                    "sources": sorted({members[i].source for i in decision.agreeing}),
                }
            )
            conflicts.append(
                ConflictEntry(
                    tool_id=tool_id,
                    centroid_id=centroid_id(tool_id, anchor.text, anchor.preconditions),
                    centroid=anchor.as_dict(),
                    dissenters=[members[i].as_dict() for i in decision.dissenters],
                    reason=decision.reason,
                )
            )
    return slots, conflicts, flagged


def _dropped_in_cluster(members: list[Item], kept: set[int], rule: str) -> list[FlaggedEntry]:
    """A flagged entry for each member of a cluster the robust rule did not keep (`kept`:
    the indices of the members it kept)."""
    vectors = np.stack([members[i].vector for i in sorted(kept)]).astype(np.float64)
    mean = vectors.mean(axis=0)
    mean /= max(float(np.linalg.norm(mean)), 1e-12)
    least = round(float(np.min(vectors @ mean)), 6)
    return [
        FlaggedEntry(m.source, m.tool_id, m.text, "", round(float(m.vector @ mean), 6), least,
                     reason=f"robust rule ({rule}) within a cluster")
        for i, m in enumerate(members)
        if i not in kept and m.source != PREVIOUS_GLOBAL
    ]


CROSS_TOOL_REASON = "parent tools differ"


def _cross_tool_conflicts(slots: list[dict], tool_ids: Sequence[str], profiles: np.ndarray,
                          tau: float, support_first: bool = False,
                          ) -> tuple[list[dict], list[ConflictEntry]]:
    """IsConsistent across tools: scenarios that say the same thing (cosine >= τ) for different
    tools contradict each other. Taken from the strongest down, a scenario with a stronger
    near-duplicate already kept for another tool is dropped and logged as a dissenter of the
    strongest such one; next round its tool gets the precaution "do not use it for that"
    (`conflicts_to_precautions`). Strongest: the most sources (one vote each, as within a tool
    in `decide_cluster`), then nearest its own tool's public profile (description and probe
    requests), then the most support. Support comes after the profile at an edge, where it is
    the submitter's word: one client stating a huge support for a confusable tool must not beat
    an honest claim it cannot outvote in sources. At the server (`support_first`), where the
    sources are edges and an edge's support counts the clients that agreed on it there, support
    comes before the profile."""
    if len({s["tool_id"] for s in slots}) < 2:
        return slots, []
    index = {t: i for i, t in enumerate(tool_ids)}
    vectors = np.stack([s["vector"] for s in slots]).astype(np.float32)
    codes = np.array([index[s["tool_id"]] for s in slots])
    typical = np.einsum("ij,ij->i", vectors, profiles[codes].astype(np.float32))

    def strength(i: int) -> tuple:
        sources, support, near = -len(slots[i]["sources"]), -slots[i]["support"], -float(typical[i])
        return (sources, support, near, i) if support_first else (sources, near, support, i)

    order = sorted(range(len(slots)), key=strength)
    rank = np.empty(len(slots), dtype=np.int64)
    rank[order] = np.arange(len(slots))
    rivals: list[list[int]] = [[] for _ in slots]
    for start in range(0, len(slots), 1024):
        rows, cols = np.nonzero(vectors[start:start + 1024] @ vectors.T >= tau)
        for row, col in zip(rows.tolist(), cols.tolist(), strict=True):
            if codes[start + row] != codes[col]:
                rivals[start + row].append(col)
    kept = np.zeros(len(slots), dtype=bool)
    beaten: dict[int, list[int]] = defaultdict(list)
    for i in order:
        stronger = [j for j in rivals[i] if kept[j]]
        if stronger:
            beaten[min(stronger, key=lambda j: rank[j])].append(i)
        else:
            kept[i] = True

    def entry(slot: dict) -> dict:
        text = slot["texts"][int(np.argmax(slot["vectors"] @ slot["vector"]))]
        return {"source": ", ".join(slot.get("sources", ())), "tool_id": slot["tool_id"],
                "text": text, "preconditions": dict(slot["preconditions"]),
                "support": slot["support"]}

    conflicts = []
    for winner, losers in sorted(beaten.items()):
        centroid = entry(slots[winner])
        by_tool: dict[str, list[int]] = defaultdict(list)  # one entry per tool that lost
        for i in sorted(losers, key=lambda i: rank[i]):
            by_tool[slots[i]["tool_id"]].append(i)
        for tool, members in sorted(by_tool.items()):
            conflicts.append(ConflictEntry(
                tool_id=centroid["tool_id"],
                centroid_id=centroid_id(centroid["tool_id"], f"across tools|{tool}|{centroid['text']}",
                                        centroid["preconditions"]),
                centroid=centroid,
                dissenters=[entry(slots[i]) for i in members],
                reason=CROSS_TOOL_REASON,
            ))
    return [slot for i, slot in enumerate(slots) if kept[i]], conflicts


def losing_tool(entry: ConflictEntry) -> str | None:
    """The tool whose claims lost a conflict across tools (its dissenters'), None for a conflict
    within one tool."""
    tools = {d.get("tool_id", entry.tool_id) for d in entry.dissenters} - {entry.tool_id}
    return next(iter(tools)) if len(tools) == 1 else None


def _dedupe_exact_scenarios(scenarios: list[Scenario]) -> list[Scenario]:
    merged: dict[tuple, Scenario] = {}
    for s in scenarios:
        key = (s.tool_id, s.text, tuple(sorted(s.preconditions.items())))
        if key in merged:
            merged[key] = merged[key].model_copy(update={"support": merged[key].support + s.support})
        else:
            merged[key] = s
    return list(merged.values())


def _counts_capped(entries: list, cap: int) -> list:
    """Scenarios or precautions with their support at most `cap` (a merged entry's support is
    the sum of its members')."""
    return [e if e.support <= cap else e.model_copy(update={"support": cap}) for e in entries]


def _top_supported(scenarios: list[Scenario], k: int) -> list[Scenario]:
    """The k scenarios of each tool with the most support (ties: canonical text order)."""
    by_tool: dict[str, list[Scenario]] = defaultdict(list)
    for s in scenarios:
        by_tool[s.tool_id].append(s)
    out = []
    for tool_id in sorted(by_tool):
        out += sorted(by_tool[tool_id], key=lambda s: (-s.support, s.text))[:k]
    return out


def _merge_precautions(items: list[Item], config: RoundConfig, summarizer: Summarizer):
    by_tool: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        by_tool[item.tool_id].append(item)
    groups = []
    for tool_id in sorted(by_tool):
        group = sorted(by_tool[tool_id], key=item_order_key)
        matrix = np.stack([i.vector for i in group])
        for cluster in greedy_cluster(matrix, config.tau):
            members = [group[i] for i in cluster]
            groups.append((members, Cluster("precaution", tool_id, [m.text for m in members],
                                            np.stack([m.vector for m in members]))))
    summarizer.prepare([c for _, c in groups])
    return [
        Precaution(tool_id=c.tool_id, text=summarizer.summarize(c).text,
                   support=sum(m.support for m in members))
        for members, c in groups
    ]


def _dedupe_precautions(precautions: list[Precaution]) -> list[Precaution]:
    merged: dict[tuple, Precaution] = {}
    for p in precautions:
        key = (p.tool_id, p.text)
        if key in merged:
            merged[key] = merged[key].model_copy(update={"support": merged[key].support + p.support})
        else:
            merged[key] = p
    return list(merged.values())


def _majority(texts: list[str]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for text in texts:
        counts[text] += 1
    return min(counts, key=lambda t: (-counts[t], len(t), t))


def _merge_templates(accepted, config, llm, summarizer, schema, stats):
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for _, comp in accepted:
        for t in comp.templates:
            groups[(t.tool_id, t.signature)].append(t.template)
    stats.templates_in = sum(len(v) for v in groups.values())
    out = []
    for (tool_id, signature), texts in sorted(groups.items()):
        text = _majority(texts)
        if len(set(texts)) > 1 and config.summarizer in ("textgrad", "llm-single-shot"):
            if config.summarizer == "textgrad":
                summarizer.fallbacks.append(
                    {"summarizer": "textgrad", "tool_id": tool_id,
                     "reason": "templates need a task-success signal; no executor is configured",
                     "kind": "no template executor"}
                )
            if llm is None:  # the majority stays, recorded as a scenario cluster's fallback is
                summarizer.fallbacks.append(
                    {"summarizer": "llm-single-shot", "tool_id": tool_id,
                     "reason": "no LLM endpoint is configured", "kind": "no LLM endpoint"}
                )
            else:
                try:
                    answer = llm.complete(
                        f"Merge these prompt templates for tool '{tool_id}' and signature "
                        f"'{signature}' into one, keeping every placeholder. Answer only with "
                        'JSON {"summary": "..."}.\n' + "\n".join(f"- {t}" for t in texts[:20]),
                        json_schema=SUMMARY_SCHEMA,
                    )
                    text = _parse_summary(answer, schema.strings.template)
                # Unparseable or unreachable: the majority stays. Only these: a task's soft time
                # limit raised inside the call must stop the merge, not be taken for a bad answer.
                except (SummaryUnparseable, LLMUnavailable) as exc:
                    summarizer.fallbacks.append(
                        {"summarizer": "llm-single-shot", "tool_id": tool_id,
                         "reason": str(exc)[:300], "kind": fallback_kind(exc)}
                    )
        out.append(PromptTemplate(tool_id=tool_id, signature=signature, template=text))
    stats.templates_out = len(out)
    return out


def _merge_annex(accepted, config, embed, stats):
    triples = sorted(
        {(a.subject, a.relation, a.object) for _, comp in accepted for a in comp.annex}
    )
    stats.annex_in = sum(len(comp.annex) for _, comp in accepted)
    if not triples:
        stats.annex_out = 0
        return []
    vectors = embed([f"{s} {r} {o}" for s, r, o in triples])
    kept = [triples[c[0]] for c in greedy_cluster(vectors, config.tau)]
    stats.annex_out = len(kept)
    return [AnnexTriple(subject=s, relation=r, object=o) for s, r, o in kept]


__all__ = [
    "BudgetExceeded",
    "SummaryUnparseable",
    "conflict_winners",
    "conflicts_to_precautions",
    "edge_merge",
    "server_merge",
]
