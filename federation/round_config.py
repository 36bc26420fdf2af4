"""The configuration a round runs with, recorded on the round so that any round can be replayed.

Pure (pydantic; the default λ is the client toolkit's, `compendium.masking`): the server, the
workers and the simulation read the same object.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from compendium.masking import DEFAULT_MASK_STRENGTH

Summarizer = Literal["textgrad", "llm-single-shot", "probe-extractive", "centroid", "none"]
RobustRule = Literal["none", "krum", "trimmed-mean"]

# The smallest per-round ε a round may be opened with.
MIN_EPSILON = 1e-6


class RoundConfig(BaseModel):
    # Infinity and NaN are refused: the configuration is stored as JSON (jsonb has neither).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tau: float = Field(0.85, gt=0, le=1, description="cosine threshold for clustering and dedup")
    epsilon: float = Field(
        1.0,
        ge=MIN_EPSILON,
        description="per-round privacy budget ε for numeric fields (at least 1e-6: a smaller ε "
        "makes the Laplace noise scale overflow)",
    )
    # At most the ledger's integer column (PrivacyLedgerEntry.field_cap): a larger cap would be
    # accepted here and fail the round at its first edge release.
    field_cap: int | None = Field(
        None, ge=1, le=2**31 - 1,
        description="F*: tools one user may feed per round, each with all its numeric fields "
        "(None: no cap); ε is split over the 2·F* tools' fields one replaced user can move"
    )
    mask_strength: float = Field(
        DEFAULT_MASK_STRENGTH, ge=0,
        description="λ the clients are expected to mask with (a configuration without it: "
        "compendium.masking.expected_mask_strength)",
    )
    summarizer: Summarizer = "probe-extractive"
    textgrad_steps: int = Field(3, ge=1, le=10)
    robust_rule: RobustRule = Field(
        "none",
        description="Byzantine-robust rule across an edge's sources per tool and within clusters; "
        "Krum's guarantee needs n ≥ 2f + 3 inputs (4 clients per edge at a share of 0.25: f = 1, "
        "n = 4, below it), the trimmed mean's only n > 2f. Krum is applied below its premise all "
        "the same, and the merge counts such groups (MergeStats.krum_below_premise)",
    )
    trim_fraction: float = Field(
        0.1, ge=0, lt=0.5,
        description="f share: the robust rule assumes f = floor(share · n) of a group's n inputs "
        "adversarial (the trimmed mean drops f at each end)",
    )
    conflict_log: bool = Field(
        True,
        description="IsConsistent and the conflict log: clusters whose precondition flags (or the "
        "LLM probe) disagree keep their majority, near-duplicate scenarios claimed for different "
        "tools keep the better supported one, and the dissenters are logged and become "
        "precautions next round; False: everything merges as it comes (the ablation)",
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seed of the round's noise (non-negative)")
    global_metadata: Literal["full", "stats"] = Field(
        "full",
        description="global compendium M: canonical description/spec plus stats, or stats only "
        "(clients resolve canonical fields from the schema they pull)",
    )
    carry_forward: bool = Field(
        True,
        description="the global compendium keeps what the previous published global held "
        "(merged with this round's edges), so clients need only send what changed",
    )
    max_scenarios_per_tool: int | None = Field(
        None, ge=1, description="global compendium: keep the k best-supported scenarios per tool"
    )

    @field_validator("trim_fraction")
    @classmethod
    def _a_rule_assumes_someone(cls, share: float, info: ValidationInfo) -> float:
        """A robust rule at a share of 0 assumes f = 0 adversarial inputs in every group: it keeps
        every input, and the merge reads as judged, nothing dropped."""
        rule = info.data.get("robust_rule")
        if share == 0 and rule not in (None, "none"):
            raise ValueError(f"a share of 0 makes the robust rule {rule} keep every input "
                             "(f = 0); give a share above 0, or the rule none")
        return share

    @classmethod
    def from_stored(cls, data: dict | None) -> RoundConfig:
        """The configuration recorded on a round, for reading (accounting, pages). One recorded
        before a bound was added (a negative seed, an ε below MIN_EPSILON) is read as recorded
        rather than refused, so that it does not break every page that reads it; the merge
        pipeline validates it (`RoundConfig(**data)`) and fails such a round with the reason."""
        try:
            return cls(**(data or {}))
        except ValidationError:
            return cls.model_construct(**(data or {}))

    def per_field_epsilon(self, declared_fields: int, fields_per_tool: int = 1) -> float:
        """ε_j = ε / K_f over the K_f = T·F (tool, field) statistics an edge can release (F the
        declared fields of a kind a client derives from its usage log, `Schema.releasable_fields`:
        a field of kind `other` is never released and takes no share), or with a field cap
        ε / (2·F*·fields_per_tool): the client caps a user at F* *tools*, and a user who feeds a
        tool moves every one of its `fields_per_tool` numeric fields (sequential composition).
        The factor 2 is the adjacency: neighbouring datasets replace one user's record by
        another (K and every client's U stay fixed), and the replaced user's F* tools and the
        replacement's F* tools can be different tools, so up to 2·F* tools move
        (`moved_tools`)."""
        from federation.merge.privacy import moved_tools  # the merge package imports this one

        divisor = declared_fields
        if self.field_cap is not None:
            divisor = min(moved_tools(self.field_cap) * max(1, fields_per_tool), declared_fields)
        return self.epsilon / max(1, divisor)


def config_problems(values: dict, names: dict[str, str] | None = None) -> str:
    """"" when RoundConfig accepts `values`; otherwise every problem as "field: message", joined
    by "; ", a field named as the caller's user knows it through `names` (a flag, a form field)."""
    try:
        RoundConfig(**values)
    except ValidationError as error:
        names = names or {}
        return "; ".join(
            f"{names.get('.'.join(map(str, e['loc'])), '.'.join(map(str, e['loc'])))}: {e['msg']}"
            for e in error.errors()
        )
    return ""
