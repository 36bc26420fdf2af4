"""The configuration a round runs with, recorded on the round so that any round can be replayed.

Pure (pydantic only): the server, the workers and the simulation read the same object.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Summarizer = Literal["textgrad", "llm-single-shot", "probe-extractive", "centroid", "none"]
RobustRule = Literal["none", "krum", "trimmed-mean"]


class RoundConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tau: float = Field(0.85, gt=0, le=1, description="cosine threshold for clustering and dedup")
    epsilon: float = Field(1.0, gt=0, description="per-round privacy budget ε for numeric fields")
    field_cap: int | None = Field(
        None, ge=1, description="F*: numeric fields one user may touch per round (None: K_f)"
    )
    mask_strength: float = Field(1.0, ge=0, description="λ the clients are expected to mask with")
    summarizer: Summarizer = "probe-extractive"
    textgrad_steps: int = Field(3, ge=1, le=10)
    robust_rule: RobustRule = "none"
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="share trimmed at each end")
    seed: int = 0
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

    def per_field_epsilon(self, declared_fields: int) -> float:
        """ε_j = ε / F* with a field cap, ε / K_f otherwise (sequential composition)."""
        divisor = self.field_cap if self.field_cap is not None else declared_fields
        return self.epsilon / max(1, min(divisor, declared_fields))
