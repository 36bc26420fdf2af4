"""Byzantine-robust aggregation at the edge (paper appendix "Byzantine-Robust Aggregation").

Krum (Blanchard et al. 2017) scores every vector by the summed squared distance to its n − f − 2
nearest neighbours and keeps the n − f most central (multi-Krum); trimmed mean (Yin et al. 2018)
drops the f lowest and f highest values per coordinate. They act at two levels:

- across sources, per tool (`robust_batches`): each source's scenarios for a tool are summed up by
  their mean direction, and the rule keeps the sources whose batches are central among the tool's
  sources (Krum: n − f of them; trimmed mean: the n − 2f closest to the coordinate-wise trimmed
  mean). This is the federated-learning use of both rules, a client's batch standing for its
  update; it is where relabelled or poisoned batches differ from honest ones;
- within a scenario cluster (the paper's Algorithm 1): they decide which members survive before
  the majority decision.

On scalar numeric fields the trimmed mean is used because its sensitivity is provably
Δ/(K − 2f), which keeps the Laplace calibration exact.

Krum's guarantee needs n ≥ 2f + 3; f is at most (n − 1) // 2 here, so the trimmed mean's premise
(n > 2f) always holds but Krum's does not (4 sources at a share of 0.25: f = 1, 4 < 5). The rule
is applied all the same, and `robust_keep` / `robust_batches` count, in the `short` Counter a
caller passes, each group Krum judged so, by (n, f): the merge reports them to the operator.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def byzantine_count(n: int, fraction: float) -> int:
    """f: how many of n inputs are assumed adversarial (floor(fraction · n)). The product is
    nudged up by far less than 1/n before the floor: 0.29 · 100 is 28.999999999999996 in floating
    point, and the share as written means 29."""
    return max(0, min(int(math.floor(fraction * n + 1e-9)), (n - 1) // 2))


def most_kept(n: int, fraction: float) -> int:
    """The most values a trimmed mean over at most n inputs keeps: max over k ≤ n of k − 2f(k).
    Not n − 2f(n): k − 2⌊fraction·k⌋ falls by one wherever f steps up (at a share of 0.2, 9
    inputs keep 7 and 10 keep 6)."""
    return max((k - 2 * byzantine_count(k, fraction) for k in range(1, n + 1)), default=0)


def krum_premise_met(n: int, f: int) -> bool:
    """Krum's premise (Blanchard et al. 2017): n ≥ 2f + 3 inputs. With f = 0 there is nothing
    to guard against (and the rule keeps everything)."""
    return f <= 0 or n >= 2 * f + 3


# krum_premise_from looks at no more sizes than this (a share within about 2e-5 of 0.5).
PREMISE_SEARCH_LIMIT = 100_000


def krum_premise_from(fraction: float) -> int | None:
    """The least N from which every group of N or more inputs meets Krum's premise at this share
    (f = byzantine_count(n, fraction)); 1 where every group does. Beyond 3 / (1 − 2·share) every n
    does (n − 2f ≥ n·(1 − 2·share) ≥ 3), so only the sizes below are looked at; None for a share
    so close to 0.5 that they are more than PREMISE_SEARCH_LIMIT."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"the share must be in [0, 0.5), not {fraction!r}")
    bound = math.ceil((3 + 1e-6) / (1 - 2 * fraction)) + 1
    if bound > PREMISE_SEARCH_LIMIT:
        return None
    for n in range(bound, 0, -1):
        if not krum_premise_met(n, byzantine_count(n, fraction)):
            return n + 1
    return 1


def krum_scores(vectors: np.ndarray, f: int) -> np.ndarray:
    n = len(vectors)
    if n <= 2:
        return np.zeros(n)
    sq = np.sum(vectors * vectors, axis=1)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * vectors @ vectors.T, 0.0)
    np.fill_diagonal(dist, np.inf)
    neighbours = max(1, n - f - 2)
    nearest = np.sort(dist, axis=1)[:, :neighbours]
    return nearest.sum(axis=1)


def krum_keep(vectors: np.ndarray, f: int) -> np.ndarray:
    """Indices (ascending) of the n − f vectors with the lowest Krum scores (multi-Krum)."""
    n = len(vectors)
    if f <= 0 or n <= 2:
        return np.arange(n)
    scores = krum_scores(vectors, f)
    order = np.lexsort((np.arange(n), scores))  # ties broken by position: deterministic
    return np.sort(order[: n - f])


def trimmed_mean(values: np.ndarray, f: int) -> np.ndarray:
    """Coordinate-wise mean after dropping the f lowest and f highest values."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        values = values[:, None]
        squeeze = True
    else:
        squeeze = False
    n = len(values)
    if f <= 0 or n - 2 * f < 1:
        out = values.mean(axis=0)
    else:
        out = np.sort(values, axis=0)[f : n - f].mean(axis=0)
    return out[0] if squeeze else out


def trimmed_keep(vectors: np.ndarray, f: int) -> np.ndarray:
    """Indices (ascending) of the n − 2f members closest to the coordinate-wise trimmed mean:
    the 2f farthest from that robust center are dropped."""
    n = len(vectors)
    if f <= 0 or n - 2 * f < 1:
        return np.arange(n)
    center = trimmed_mean(vectors, f)
    dist = np.linalg.norm(vectors - center, axis=1)
    order = np.lexsort((np.arange(n), dist))
    return np.sort(order[: n - 2 * f])


def robust_keep(vectors: np.ndarray, rule: str, fraction: float,
                short: Counter | None = None) -> np.ndarray:
    """Indices (ascending) of the vectors `rule` keeps, f = byzantine_count(n, fraction). A group
    Krum judges with f ≥ 1 and n < 2f + 3 (`krum_premise_met`) is counted in `short` under
    (n, f); what is kept does not depend on it."""
    if rule == "none" or len(vectors) < 3:
        return np.arange(len(vectors))
    f = byzantine_count(len(vectors), fraction)
    if rule == "krum":
        if short is not None and not krum_premise_met(len(vectors), f):
            short[(len(vectors), f)] += 1
        return krum_keep(vectors, f)
    if rule == "trimmed-mean":
        return trimmed_keep(vectors, f)
    raise ValueError(f"unknown robust rule {rule!r}")


def robust_batches(
    batches: dict[tuple[str, str], np.ndarray], rule: str, fraction: float,
    short: Counter | None = None,
) -> set[tuple[str, str]]:
    """The (source, tool) batches `rule` drops. `batches` maps (source, tool) to the embeddings
    (unit rows) of that source's scenarios for that tool. Per tool with n >= 3 sources, each
    batch is represented by its normalized mean and `robust_keep` (f = ⌊fraction·n⌋) chooses the
    batches kept; a tool with fewer sources keeps them all (nothing to compare). `short`: as in
    `robust_keep`, one count per tool Krum judged below its premise."""
    if rule == "none":
        return set()
    by_tool: dict[str, list[str]] = {}
    for source, tool in sorted(batches):
        by_tool.setdefault(tool, []).append(source)
    dropped: set[tuple[str, str]] = set()
    for tool, sources in by_tool.items():
        if len(sources) < 3:
            continue
        means = np.stack([np.asarray(batches[(s, tool)], dtype=np.float64).mean(axis=0)
                          for s in sources])
        means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
        keep = set(robust_keep(means, rule, fraction, short).tolist())
        dropped.update((s, tool) for i, s in enumerate(sources) if i not in keep)
    return dropped
