"""What the merge operator takes and returns. Pure dataclasses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from compendium.schema import Compendium


@dataclass(frozen=True)
class MergeInput:
    """One input of a merge: a client's submission (edge) or an edge result (server).

    `source` names it (a client or organization id); `document` is the compendium as a dict (it is
    validated) or an already typed Compendium (validated again)."""

    source: str
    document: dict | Compendium


@dataclass(frozen=True)
class Rejection:
    source: str
    reasons: list[str]


@dataclass(frozen=True)
class FlaggedEntry:
    """A scenario dropped by a cross-check: with its whole source, when that source's texts agree
    with their labels no better than halfway to chance (reason "implausible source";
    `own_similarity` is then the source's mean own-tool percentile and `closest_similarity` the
    limit), by the tool-confusion check (its text sits closer to another tool), or as part of an
    incoherent batch (one source's scenarios for one tool that are far less alike than the tool's
    public probe requests; `own_similarity` is then the batch's mean pairwise cosine and
    `closest_similarity` what the probe expects), or by a robust rule (across sources, or
    "within a cluster": `operator._robust_sources`, `operator._dropped_in_cluster`)."""

    source: str
    tool_id: str
    text: str
    closest_tool: str
    own_similarity: float
    closest_similarity: float
    reason: str = "tool confusion"


@dataclass(frozen=True)
class ConflictEntry:
    """One entry of the conflict log, keyed by (tool, centroid id)."""

    tool_id: str
    centroid_id: str
    centroid: dict
    dissenters: list[dict]
    reason: str
    # A reviewer's decision applied by the next round's merge: "" (none: the composed precaution),
    # "precaution" (resolution_text replaces the composed precaution) or "scenario"
    # (resolution_text, the centroid's or a dissenter's text, wins; no precaution is composed;
    # a text no longer among them is ignored, and the precaution composed as if undecided).
    resolution: str = ""
    resolution_text: str = ""
    # Of a picked scenario, the tool it wins for: across tools the centroid and a dissenter may
    # hold the same text, each claimed for its own tool, and the text alone cannot say which
    # won. "" (a decision from before it was recorded): the first candidate with the text.
    resolution_tool: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LedgerEntry:
    """One numeric release: what the privacy accountant records."""

    tool_id: str
    field: str
    sensitivity: float
    contributors: int
    epsilon: float
    noise_scale: float
    mechanism: str = "laplace"
    field_cap: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class MergeStats:
    inputs: int = 0
    accepted: int = 0
    rejected: int = 0
    scenarios_in: int = 0
    scenarios_out: int = 0
    clusters: int = 0
    conflicts: int = 0
    cross_tool_dropped: int = 0  # scenarios dropped as near-duplicates claimed for another tool
    flagged_confusion: int = 0
    confusion_margin: float | None = None  # the margin the check used (calibrated on the probe)
    flagged_incoherent: int = 0  # scenarios dropped in incoherent batches
    flagged_sources: int = 0  # scenarios dropped with their whole source (implausible sources)
    dropped_sources: list[str] = field(default_factory=list)  # those sources
    robust_dropped: int = 0
    robust_sources: dict[str, int] = field(default_factory=dict)  # scenarios dropped per source
    # Groups (a tool's batches across sources, a scenario cluster's members) Krum judged with
    # fewer than 2f + 3 inputs (f ≥ 1), where its guarantee does not hold (`robust.robust_keep`;
    # what it kept is the same), and how many at each size: [{"n": 4, "f": 1, "groups": 12}].
    krum_below_premise: int = 0
    krum_below_premise_sizes: list[dict] = field(default_factory=list)
    # (tool, precondition flag name) pairs left off the published scenarios: fewer than
    # operator.FLAG_MIN_SOURCES sources carried them (a count only: the names are never reported)
    flags_held_back: int = 0
    # The LLM's consistency questions (pairs of a cluster's scenarios) and those it gave no
    # usable answer to (unreachable, or no verdict in its answer): judged by their flags alone
    consistency_asked: int = 0
    consistency_unanswered: int = 0
    precautions_in: int = 0
    precautions_out: int = 0
    precautions_from_conflicts: int = 0
    templates_in: int = 0
    templates_out: int = 0
    annex_in: int = 0
    annex_out: int = 0
    numeric_releases: int = 0
    # statistics the server merge left out of the global: noise wider than the field's range
    stats_withheld: int = 0
    # numeric fields the edge did not release: no release of the round could make them useful
    # (operator.drowned_fields; no noise drawn, no ε spent)
    fields_not_released: list[str] = field(default_factory=list)
    epsilon_spent: float = 0.0
    summarizer: str = ""
    summarizer_fallbacks: list[dict] = field(default_factory=list)
    summaries: dict[str, int] = field(default_factory=dict)  # multi-text clusters, by method kept
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def dedup_rate(self) -> float:
        if not self.scenarios_in:
            return 0.0
        return 1.0 - self.scenarios_out / self.scenarios_in

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dedup_rate"] = self.dedup_rate
        return out


@dataclass
class MergeResult:
    compendium: Compendium
    conflicts: list[ConflictEntry]
    ledger: list[LedgerEntry]
    stats: MergeStats
    rejected: list[Rejection] = field(default_factory=list)
    flagged: list[FlaggedEntry] = field(default_factory=list)
    accepted_sources: list[str] = field(default_factory=list)
    scenario_embeddings: Any = None  # np.ndarray row-aligned with compendium.scenarios
    precaution_embeddings: Any = None

    @property
    def noise_scales(self) -> dict[tuple[str, str], float]:
        """(tool, field) -> the scale of the Laplace noise this (edge) release added: what the
        server merge takes per edge (`server_merge(noise_scales=...)`)."""
        return {(e.tool_id, e.field): e.noise_scale for e in self.ledger}
