"""The paper's analytical diagnostics, measured on a dataset (section "Analytical statements" and
the appendix's cross-distribution table). They say whether the conditional results' premises hold
for this embedding model, reranker and data; they prove nothing.

- Embedding Lipschitz ratio: ||e(u) - e(u')||_2 / d_text(u, u') over text pairs, where d_text is
  the token-level Levenshtein distance after lowercasing and whitespace normalization divided by
  the longer text's token count (in [0, 1]). Measured on (private text, its masked form) at each
  masking strength λ (the privacy transformation's distortion, Theorem "retrieval distortion"),
  and on random pairs of the published scenarios (the paper's in-distribution pairs). Reported:
  the 99th percentile L_e, and the mean text and embedding distances.
- Reranker contraction ratio: the reranker as a map from a query embedding to its probability
  distribution over tools (the softmax of the fused per-tool scores, the conditional logit the
  fusion weights are fitted as). For each held-out query, the embedding is perturbed by Gaussian
  noise (σ = 0.05 per coordinate, renormalized) and the ratio ||p(e) - p(e')||_2 / ||e - e'||_2
  is taken; L_R is its 99th percentile (the routing-stability premise asks L_R < 1). The
  distributions are over every tool, a tool outside the reranker's candidates having probability 0
  (the router's actual output: it cannot pick one), so a perturbation that changes the candidate
  set moves probability mass across that boundary; the map is not continuous there. Reported
  apart: the share of queries whose candidates the perturbation changed, and L_R over the queries
  whose candidates it left the same (where the map is the smooth softmax). Also reported: the
  share of decisions the perturbation leaves unchanged.
- Margin Δ: top-1 minus top-2 probability of the reranker over held-out queries; its 5th
  percentile is the buffer that keeps the selection stable under noise.

Pure: no Django.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import numpy as np
from rapidfuzz.distance import Levenshtein

from compendium.masking import TextMasker
from compendium.schema import ToolSpec
from routing.router import Router

_WORD = re.compile(r"\S+")


def text_distance(a: str, b: str) -> float:
    """Token-level Levenshtein distance / the longer text's token count (0: same tokens)."""
    ta, tb = _WORD.findall(a.lower()), _WORD.findall(b.lower())
    longest = max(len(ta), len(tb))
    return Levenshtein.distance(ta, tb) / longest if longest else 0.0


def lipschitz_ratios(
    first: Sequence[str], second: Sequence[str], embed
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ratios, text distances, embedding distances) over pairs whose texts differ."""
    pairs = [(a, b) for a, b in zip(first, second, strict=True) if text_distance(a, b) > 0]
    if not pairs:
        empty = np.zeros(0)
        return empty, empty, empty
    va = embed([a for a, _ in pairs])
    vb = embed([b for _, b in pairs])
    dist_e = np.linalg.norm(np.asarray(va, np.float64) - np.asarray(vb, np.float64), axis=1)
    dist_t = np.array([text_distance(a, b) for a, b in pairs])
    return dist_e / dist_t, dist_t, dist_e


def _summary(prefix: str, ratios, dist_t, dist_e, total: int) -> dict[str, float]:
    if not len(ratios):
        return {f"{prefix}_pairs": 0.0}
    return {
        f"{prefix}_p99": float(np.percentile(ratios, 99)),
        f"{prefix}_p50": float(np.percentile(ratios, 50)),
        f"{prefix}_mean_text_distance": float(np.mean(dist_t)),
        f"{prefix}_mean_embedding_distance": float(np.mean(dist_e)),
        f"{prefix}_pairs": float(len(ratios)),
        f"{prefix}_share_changed": float(len(ratios) / total) if total else 0.0,
    }


def masking_lipschitz(
    texts: Sequence[str], tools: Sequence[ToolSpec], strengths: Sequence[float], embed, seed: int,
    shared: Sequence[frozenset[str]] | None = None,
) -> dict[str, float]:
    """L_e of the masking transformation at each λ: pairs (text, masked text). `shared`: per
    text, the words its client releases (those enough of its users wrote,
    `compendium.builder.shared_words`), so that each text is masked as its client masks it."""
    out: dict[str, float] = {}
    releases = shared if shared is not None else [frozenset()] * len(texts)
    for strength in strengths:
        base = TextMasker.for_registry(tools, strength=strength, seed=seed)
        maskers = {id(words): base.sharing(words) if words else base for words in releases}
        masked = [maskers[id(words)].mask(t).text for t, words in zip(texts, releases, strict=True)]
        ratios, dist_t, dist_e = lipschitz_ratios(texts, masked, embed)
        out.update(_summary(f"masking_lipschitz_lambda_{strength:g}", ratios, dist_t, dist_e, len(texts)))
    return out


def scenario_pair_lipschitz(texts: Sequence[str], embed, pairs: int, seed: int) -> dict[str, float]:
    """L_e over random pairs of distinct published scenarios."""
    if len(texts) < 2:
        return {"scenario_lipschitz_pairs": 0.0}
    rng = random.Random(f"pairs|{seed}")
    picks = [tuple(rng.sample(range(len(texts)), 2)) for _ in range(pairs)]
    ratios, dist_t, dist_e = lipschitz_ratios(
        [texts[i] for i, _ in picks], [texts[j] for _, j in picks], embed
    )
    return _summary("scenario_lipschitz", ratios, dist_t, dist_e, len(picks))


def _distribution(router: Router, query: str, vector: np.ndarray, top_k: int) -> dict[int, float]:
    tools, fused = router.tool_scores(query, vector, top_k)
    if not len(tools):
        return {}
    z = fused - fused.max()
    p = np.exp(z)
    p /= p.sum()
    return {int(t): float(v) for t, v in zip(tools, p, strict=True)}


def reranker_contraction(
    router: Router,
    queries: Sequence[str],
    *,
    sigma: float = 0.05,
    seed: int = 0,
    top_k: int = 5,
) -> dict[str, float]:
    """L_R (99th percentile of the contraction ratio), the 5th-percentile margin Δ and the share of
    decisions a perturbation of the query embedding leaves unchanged."""
    if not queries:
        return {}
    rng = np.random.default_rng(seed)
    vectors = np.asarray(router.engine.embed(list(queries)), dtype=np.float64)
    ratios, margins, unchanged, same_candidates = [], [], [], []
    for query, vector in zip(queries, vectors, strict=True):
        noisy = vector + rng.normal(0.0, sigma, size=vector.shape)
        noisy /= np.linalg.norm(noisy)
        p = _distribution(router, query, vector.astype(np.float32), top_k)
        q = _distribution(router, query, noisy.astype(np.float32), top_k)
        if not p or not q:
            continue
        same_candidates.append(set(p) == set(q))
        tools = sorted(set(p) | set(q))  # every other tool has probability 0 in both
        a = np.array([p.get(t, 0.0) for t in tools])
        b = np.array([q.get(t, 0.0) for t in tools])
        ratios.append(float(np.linalg.norm(a - b) / np.linalg.norm(vector - noisy)))
        top = np.sort(np.array(list(p.values())))[::-1]
        if len(top) > 1:  # a lone candidate has no runner-up to keep a margin from
            margins.append(float(top[0] - top[1]))
        unchanged.append(max(p, key=p.get) == max(q, key=q.get))
    if not ratios:
        return {}
    same = np.array(same_candidates)
    smooth = np.array(ratios)[same]
    return {
        "reranker_contraction_p99": float(np.percentile(ratios, 99)),
        "reranker_contraction_p50": float(np.percentile(ratios, 50)),
        "candidates_changed_under_noise": float(1.0 - same.mean()),
        "reranker_contraction_p99_same_candidates": (
            float(np.percentile(smooth, 99)) if len(smooth) else None
        ),
        "share_contracting": float(np.mean(np.array(ratios) < 1.0)),
        "margin_p5": float(np.percentile(margins, 5)) if margins else None,
        "margin_p50": float(np.percentile(margins, 50)) if margins else None,
        "decisions_unchanged_under_noise": float(np.mean(unchanged)),
        "noise_sigma": sigma,
        "queries": float(len(ratios)),
    }
