"""The typed compendium C = (M, U, P, T, A) and its schema S (paper, Definition 1).

Pure: pydantic + the standard library, no Django. The client toolkit, the merge operator, the
router and the server all use these very types.
"""

from __future__ import annotations

import re
from enum import StrEnum
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = "1.0"

# \Z, not $: `$` also matches before a final newline ("has_city\n" passed as an identifier)
IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}\Z")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)


class NumericKind(StrEnum):
    """What a numeric field measures; decides how a client computes and clips it."""

    COUNT = "count"  # calls of a tool per user per round
    RATE = "rate"  # a proportion in [0, 1], e.g. success rate
    FREQUENCY = "frequency"  # share of a user's calls that go to the tool (normalized vector)
    LATENCY = "latency"  # milliseconds
    OTHER = "other"


# The kinds a client derives from its usage log (`compendium.clipping`): the only fields a client
# computes and sends, and the only ones an edge releases. A field of another kind (OTHER) may be
# declared, but no edge counts it in the split of ε, noises it, charges it or publishes it.
DERIVABLE_KINDS = frozenset(
    {NumericKind.COUNT, NumericKind.RATE, NumericKind.FREQUENCY, NumericKind.LATENCY}
)


class NumericFieldSpec(_Strict):
    """A numeric subfield of m_t with its declared range and per-user sensitivity Δ_m."""

    name: str
    kind: NumericKind
    # Finite (the paper: "declares finite ranges per numeric field, bounding Δ_m by
    # construction"): an infinite bound or Δ made the Laplace scale infinite, and the release
    # only its window's edge.
    min: float = Field(allow_inf_nan=False)
    max: float = Field(allow_inf_nan=False)
    sensitivity: float = Field(gt=0, allow_inf_nan=False)
    unit: str = ""
    description: str = ""

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, v: str) -> str:
        if not IDENTIFIER.match(v):
            raise ValueError("field name must be an identifier (letters, digits, _ . : -)")
        return v

    @model_validator(mode="after")
    def _range_is_ordered(self) -> NumericFieldSpec:
        if not self.min < self.max:
            raise ValueError(f"min ({self.min}) must be below max ({self.max})")
        if self.max - self.min == float("inf"):  # both finite, but their distance overflows
            raise ValueError(f"the range from min ({self.min}) to max ({self.max}) is too wide "
                             "to be a number: declare a finite width")
        return self


DEFAULT_NUMERIC_FIELDS: tuple[NumericFieldSpec, ...] = (
    NumericFieldSpec(
        name="calls",
        kind=NumericKind.COUNT,
        min=0,
        max=1000,
        sensitivity=50,
        unit="calls/round",
        description="calls of the tool per user and round, clipped per user at N_max = Δ",
    ),
    NumericFieldSpec(
        name="success_rate",
        kind=NumericKind.RATE,
        min=0,
        max=1,
        sensitivity=1,
        description="share of the tool's calls that succeeded",
    ),
    NumericFieldSpec(
        name="frequency",
        kind=NumericKind.FREQUENCY,
        min=0,
        max=1,
        sensitivity=2,
        description="share of a user's calls that went to the tool (Δ = 2 for normalized vectors)",
    ),
    NumericFieldSpec(
        name="latency_ms",
        kind=NumericKind.LATENCY,
        min=0,
        max=10000,
        sensitivity=10000,
        unit="ms",
        description="mean latency of the tool's calls, clipped per user at Δ",
    ),
)


class StringLimits(_Strict):
    """Declared length limits (characters) for every string field: validity rule (d)."""

    tool_id: int = 128
    name: int = 200
    description: int = 4000
    category: int = 200
    scenario: int = 1000
    precaution: int = 1000
    signature: int = 200
    template: int = 4000
    flag: int = 64
    annex_term: int = 300
    other: int = 4000


class CollectionLimits(_Strict):
    """Bounds that keep a hostile document from exhausting the server."""

    scenarios: int = 20000
    precautions: int = 20000
    templates: int = 5000
    annex: int = 20000
    metadata: int = 20000
    preconditions: int = 32
    depth: int = 24  # nesting depth of the whole JSON document
    nodes: int = 500_000  # total JSON values in the document
    bytes: int = 8 * 1024 * 1024
    # The largest count a compendium may state: an entry's support, its num_users. A merge adds
    # its inputs' counts up and publishes at most this.
    counts: int = 1_000_000


class ToolSpec(_Strict):
    """A tool registry entry: the canonical (id, description, spec) of M, server-controlled."""

    tool_id: str
    name: str = ""
    description: str
    category: str = ""
    spec: dict[str, Any] = Field(default_factory=dict)


class Schema(_Strict):
    """The schema S: the tool registry T, declared numeric fields, and string/collection limits."""

    version: str = SCHEMA_VERSION
    tools: list[ToolSpec] = Field(default_factory=list)
    numeric_fields: list[NumericFieldSpec] = Field(
        default_factory=lambda: list(DEFAULT_NUMERIC_FIELDS)
    )
    strings: StringLimits = Field(default_factory=StringLimits)
    limits: CollectionLimits = Field(default_factory=CollectionLimits)

    model_config = ConfigDict(extra="forbid", strict=True, ignored_types=(cached_property,))

    @cached_property
    def tool_ids(self) -> frozenset[str]:
        return frozenset(t.tool_id for t in self.tools)

    @cached_property
    def tools_by_id(self) -> dict[str, ToolSpec]:
        return {t.tool_id: t for t in self.tools}

    @cached_property
    def fields_by_name(self) -> dict[str, NumericFieldSpec]:
        return {f.name: f for f in self.numeric_fields}

    @cached_property
    def releasable_fields(self) -> list[NumericFieldSpec]:
        """The declared numeric fields an edge can release, in declared order: those of a kind a
        client derives from its usage log (DERIVABLE_KINDS). F, over which a round splits its
        ε, is their number; a field of kind `other` is never sent by the toolkit, refused from
        any other client, and never released."""
        return [f for f in self.numeric_fields if f.kind in DERIVABLE_KINDS]


# --- the compendium -------------------------------------------------------------------------------


class ToolMetadata(_Strict):
    """One entry of M. Description and spec are canonical (from the registry); clients send only
    their clipped numeric statistics, keyed by declared field name."""

    tool_id: str
    description: str | None = None
    spec: dict[str, Any] | None = None
    stats: dict[str, float] = Field(default_factory=dict)


class Scenario(_Strict):
    """One entry of U: when a tool applies. `support` counts the scenarios merged into it."""

    tool_id: str
    text: str
    preconditions: dict[str, bool] = Field(default_factory=dict)
    support: int = Field(default=1, ge=1)


class Precaution(_Strict):
    """One entry of P: when not to use a tool."""

    tool_id: str
    text: str
    support: int = Field(default=1, ge=1)


class PromptTemplate(_Strict):
    """One entry of T, keyed by (tool, signature)."""

    tool_id: str
    signature: str
    template: str


class AnnexTriple(_Strict):
    """One entry of A: a typed (subject, relation, object) triple."""

    subject: str
    relation: str
    object: str


# What a database stores of a masking seed (bigint) and of a field cap F* (the ledger's integer).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
FIELD_CAP_MAX = 2**31 - 1


class MaskingInfo(_Strict):
    """What the client's text masking did before the compendium left it."""

    strength: float = Field(ge=0)  # λ
    masked_fraction: float = Field(ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)


class Compendium(_Strict):
    """C = (M, U, P, T, A), typed by a schema version."""

    schema_version: str = SCHEMA_VERSION
    metadata: list[ToolMetadata] = Field(default_factory=list)
    scenarios: list[Scenario] = Field(default_factory=list)
    precautions: list[Precaution] = Field(default_factory=list)
    templates: list[PromptTemplate] = Field(default_factory=list)
    annex: list[AnnexTriple] = Field(default_factory=list)
    masking: MaskingInfo | None = None
    num_users: int | None = Field(default=None, ge=1)
    # F*: the most tools whose numeric statistics one user fed when the client built it (step 3
    # of the numbers, `clipping.capped_tools`); None: built with no cap, or by tooling that does
    # not record it. A round with a field cap takes statistics only from a compendium that records
    # one no larger than its own (`exceeds_field_cap`). At most the ledger's integer column.
    field_cap: int | None = Field(default=None, ge=1, le=FIELD_CAP_MAX)

    def tools_referenced(self) -> set[str]:
        refs = {m.tool_id for m in self.metadata}
        for group in (self.scenarios, self.precautions, self.templates):
            refs.update(item.tool_id for item in group)
        return refs

    def entry_counts(self) -> dict[str, int]:
        return {
            "metadata": len(self.metadata),
            "scenarios": len(self.scenarios),
            "precautions": len(self.precautions),
            "templates": len(self.templates),
            "annex": len(self.annex),
        }


def exceeds_field_cap(compendium: Compendium, round_cap: int | None) -> bool:
    """Whether `compendium` may feed more tools' numeric statistics per user than a round capped
    at F* = `round_cap` is charged for: it carries statistics and records no field cap, or a
    larger one. A round without a cap, or a compendium without statistics, never does. What it
    records is what the client says it built with: whether it clipped so, no server can see."""
    if round_cap is None or not any(entry.stats for entry in compendium.metadata):
        return False
    return compendium.field_cap is None or compendium.field_cap > round_cap


def field_cap_words(cap: int | None) -> str:
    """A recorded field cap as a person reads it."""
    return "no field cap" if cap is None else f"field cap F* = {cap}"
