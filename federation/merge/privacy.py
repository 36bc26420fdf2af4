"""The numeric privacy mechanism and its accounting (Theorem 1). Pure: numpy only.

A release is the average of K clipped client values plus Laplace noise of scale Δ/(K·ε_j); the
result is clamped back into the clipping window [min, min(max, min + Δ)] the values were clipped
to (the true mean lies in it), which is post-processing and costs no budget.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


class BudgetExceeded(RuntimeError):
    """A release would exceed the federation's privacy budget; raised before any noise is drawn."""


def laplace_scale(sensitivity: float, contributors: int, epsilon: float) -> float:
    """b = Δ / (K · ε_j): the scale calibrated to the sensitivity Δ/K of an average of K values."""
    if contributors < 1:
        raise ValueError("a release needs at least one contributor")
    if epsilon <= 0 or sensitivity <= 0:
        raise ValueError("sensitivity and ε must be positive")
    return sensitivity / (contributors * epsilon)


def laplace_release(
    values: Sequence[float],
    *,
    lower: float,
    upper: float,
    sensitivity: float,
    epsilon: float,
    rng: np.random.Generator,
    contributors: int | None = None,
) -> tuple[float, float]:
    """(released value, noise scale) for the mean of `values` clipped to [lower, upper]."""
    clipped = np.clip(np.asarray(values, dtype=np.float64), lower, upper)
    k = contributors if contributors is not None else len(clipped)
    scale = laplace_scale(sensitivity, k, epsilon)
    noised = float(clipped.mean()) + float(rng.laplace(0.0, scale))
    return float(min(upper, max(lower, noised))), scale


def basic_composition(epsilons: Iterable[float]) -> float:
    """Sequential composition: ε' = Σ ε_r (R·ε for equal rounds)."""
    return float(sum(epsilons))


def advanced_composition(epsilon: float, rounds: int, delta_prime: float) -> float:
    """ε' = sqrt(2R ln(1/δ')) ε + R ε (e^ε − 1) (Dwork & Roth, Thm 3.20), for R releases of ε."""
    if rounds <= 0:
        return 0.0
    if not 0 < delta_prime < 1:
        raise ValueError("δ' must lie in (0, 1)")
    try:
        growth = math.exp(epsilon) - 1
    except OverflowError:  # ε > ~709: the bound is vacuous (basic composition is the tighter)
        return math.inf
    # −ln δ′, not ln(1/δ′): 1/δ′ overflows to infinity for a subnormal δ′ (below ~5.6e-309),
    # which the settings accept, and the bound came out infinite.
    return math.sqrt(-2 * rounds * math.log(delta_prime)) * epsilon + rounds * epsilon * growth


@dataclass(frozen=True)
class Composition:
    rounds: int
    basic_epsilon: float
    advanced_epsilon: float
    delta_prime: float

    @property
    def tighter(self) -> str:
        return "basic" if self.basic_epsilon <= self.advanced_epsilon else "advanced"

    @property
    def epsilon(self) -> float:
        return min(self.basic_epsilon, self.advanced_epsilon)

    @property
    def delta(self) -> float:
        """δ of the reported bound: 0 when basic (pure DP) is the tighter."""
        return 0.0 if self.tighter == "basic" else self.delta_prime

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "basic_epsilon": self.basic_epsilon,
            # null where it overflows (a round's ε past ~709): JSON has no Infinity
            "advanced_epsilon": (self.advanced_epsilon if math.isfinite(self.advanced_epsilon)
                                 else None),
            "delta_prime": self.delta_prime,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "tighter": self.tighter,
        }


def compose(round_epsilons: Sequence[float], delta_prime: float = 1e-5) -> Composition:
    """Both bounds over per-round spends; advanced uses max ε_r (valid for unequal rounds)."""
    eps = [float(e) for e in round_epsilons if e > 0]
    rounds = len(eps)
    basic = basic_composition(eps)
    advanced = advanced_composition(max(eps), rounds, delta_prime) if eps else 0.0
    return Composition(rounds, basic, advanced, delta_prime)


def moved_tools(field_cap: int) -> int:
    """How many tools' statistics one user can move under a field cap F*: 2·F*.

    The adjacency is user-level replace-one (paper, Theorem 1 and App. L: "replacing one user's
    contribution"; K and every client's user count U stay fixed, which is what makes the
    average's sensitivity Δ/K). The replaced user fed at most F* tools and so does the
    replacement, but they need not be the same tools: the old ones fall back to the neutral
    value and the new ones rise from it, so up to 2·F* tools move (compendium.clipping; the
    paper's Δ = 2 for a frequency vector is the same argument for one field)."""
    return 2 * field_cap


def round_spend(
    per_field_epsilons: Sequence[float],
    field_cap: int | None,
    tools: Sequence[str] | None = None,
) -> float:
    """ε one user can lose in one round of one edge: Σ ε_j, or under a field cap the 2·F*
    largest per-tool sums Σ_{fields of t} ε_j. The cap is enforced per *tool* at the client (a
    user feeds at most F* tools, and every numeric field of each), so each tool a user feeds
    costs all of its fields' ε_j, and replacing that user can move 2·F* tools (`moved_tools`).
    `tools[i]` is the tool of `per_field_epsilons[i]` (None: each its own tool)."""
    if not per_field_epsilons:
        return 0.0
    if field_cap is None:
        return float(sum(per_field_epsilons))
    per_tool: dict = defaultdict(float)
    for i, eps in enumerate(per_field_epsilons):
        per_tool[tools[i] if tools is not None else i] += float(eps)
    return float(sum(sorted(per_tool.values(), reverse=True)[: moved_tools(field_cap)]))
