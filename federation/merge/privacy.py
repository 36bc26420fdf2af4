"""The numeric privacy mechanism and its accounting (Theorem 1). Pure: numpy and the standard
library only.

A release is the average of K clipped client values plus Laplace noise of scale Δ/(K·ε_j); the
result is clamped back into the clipping window [min, min(max, min + Δ)] the values were clipped
to (the true mean lies in it), which is post-processing and costs no budget.

The noise is drawn exactly, not in floating point: a Laplace draw computed as a float (numpy's
b·log(U)) leaves gaps and uneven steps in its low-order bits that depend on the value it is added
to, and a released float can then tell neighbouring inputs apart outright (Mironov, "On
significance of the least significant bits for differential privacy", CCS 2012). The mean is
rounded to a grid of GRID_STEPS steps per Δ/K and the noise is an exact discrete Laplace draw on
that grid (Canonne, Kamath & Steinke, "The discrete Gaussian for differential privacy", NeurIPS
2020, Algorithm 2, in integer and rational arithmetic), calibrated to the grid sensitivity
GRID_STEPS + 1 (the rounding may add one step): ε_j-differentially private as computed, with
noise wider than Δ/(K·ε_j) by one part in 2^20.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

# Steps of the release grid per Δ/K (the sensitivity of a mean of K values): the grid's
# sensitivity is GRID_STEPS + 1 steps, so the noise is wider than Δ/(K·ε) by 1/GRID_STEPS.
GRID_STEPS = 2**20


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
    """(released value, noise scale) for the mean of `values` clipped to [lower, upper]: the mean
    rounded to the grid of step Δ/(K·GRID_STEPS), plus exact discrete Laplace noise on that grid
    of scale (GRID_STEPS + 1)/ε_j steps (about b = Δ/(K·ε_j), the scale returned), clamped to
    [lower, upper]. The draw is a function of `rng`'s state alone (a replayed release draws it
    again)."""
    clipped = np.clip(np.asarray(values, dtype=np.float64), lower, upper)
    k = contributors if contributors is not None else len(clipped)
    scale = laplace_scale(sensitivity, k, epsilon)
    step = sensitivity / k / GRID_STEPS
    on_grid = round(float(clipped.mean()) / step)
    steps = discrete_laplace(Fraction(GRID_STEPS + 1) / Fraction(epsilon),
                             random.Random(int.from_bytes(rng.bytes(32), "big")))
    noised = (on_grid + steps) * step
    return float(min(upper, max(lower, noised))), scale


def _bernoulli(p: Fraction, rng: random.Random) -> bool:
    """True with probability p (0 ≤ p ≤ 1), exactly."""
    return rng.randrange(p.denominator) < p.numerator


def _bernoulli_exp(gamma: Fraction, rng: random.Random) -> bool:
    """True with probability exp(−γ) (γ ≥ 0), exactly (CKS 2020, Algorithm 1)."""
    while gamma > 1:  # exp(−γ) = exp(−1)^⌊γ⌋ · exp(−(γ − ⌊γ⌋))
        if not _bernoulli_exp(Fraction(1), rng):
            return False
        gamma -= 1
    k = 1
    while _bernoulli(gamma / k, rng):
        k += 1
    return k % 2 == 1


def _geometric_exp(x: Fraction, rng: random.Random) -> int:
    """A draw of P(n) ∝ exp(−x·n), n = 0, 1, ... (x > 0), exactly (CKS 2020, Algorithm 2's
    geometric step: a uniform remainder below x's denominator, then whole units)."""
    s, t = x.numerator, x.denominator
    while True:
        u = rng.randrange(t)
        if _bernoulli_exp(Fraction(u, t), rng):
            break
    v = 0
    while _bernoulli_exp(Fraction(1), rng):
        v += 1
    return (v * t + u) // s


def discrete_laplace(scale: Fraction, rng: random.Random) -> int:
    """An integer z with P(z) ∝ exp(−|z|/scale), exactly (CKS 2020, Algorithm 2): for an
    integer-valued statistic of sensitivity S, scale = S/ε is ε-differentially private."""
    if scale <= 0:
        raise ValueError("the discrete Laplace scale must be positive")
    while True:
        negative = _bernoulli(Fraction(1, 2), rng)
        magnitude = _geometric_exp(1 / scale, rng)
        if not (negative and magnitude == 0):  # 0 drawn once, not twice
            return -magnitude if negative else magnitude


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


def compose_prefixes(round_epsilons: Sequence[float], delta_prime: float = 1e-5) -> list[Composition]:
    """`compose` of every prefix of `round_epsilons` (the ε′ after each round), in one pass: a
    curve over R rounds composed prefix by prefix took R²/2 steps (the Privacy page draws one
    per organization)."""
    out, total, count, largest = [], 0.0, 0, 0.0
    for e in round_epsilons:
        e = float(e)
        if e > 0:
            total, count, largest = total + e, count + 1, max(largest, e)
        advanced = advanced_composition(largest, count, delta_prime) if count else 0.0
        out.append(Composition(count, total, advanced, delta_prime))
    return out


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
