"""Accuracy figures and the empirical privacy attacks of the paper's evaluation. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import mannwhitneyu

from routing.router import tokenize


def tokens(text: str) -> set[str]:
    """The words of `text` as the router's lexical feature reads them (any script)."""
    return set(tokenize(text))


@dataclass(frozen=True)
class AccuracyReport:
    accuracy: float
    macro_accuracy: float
    per_category: dict[str, dict[str, float]]
    n: int


def accuracy_report(predicted: Sequence[str], gold: Sequence[str], categories: Sequence[str]) -> AccuracyReport:
    """Top-1 accuracy, macro accuracy (mean over categories) and the per-category table."""
    if not (len(predicted) == len(gold) == len(categories)):
        raise ValueError("predicted, gold and categories must have the same length")
    if not gold:
        return AccuracyReport(0.0, 0.0, {}, 0)
    hits: dict[str, list[int]] = defaultdict(list)
    for p, g, c in zip(predicted, gold, categories, strict=True):
        hits[c or "uncategorized"].append(int(p == g))
    per_category = {
        c: {"accuracy": float(np.mean(v)), "n": len(v)} for c, v in sorted(hits.items())
    }
    overall = float(np.mean([p == g for p, g in zip(predicted, gold, strict=True)]))
    macro = float(np.mean([row["accuracy"] for row in per_category.values()]))
    return AccuracyReport(overall, macro, per_category, len(gold))


def auroc(member_scores: Sequence[float], nonmember_scores: Sequence[float]) -> float:
    """Area under the ROC curve of a membership score (0.5 = chance), ties counted half."""
    if not member_scores or not nonmember_scores:
        raise ValueError("need member and non-member scores")
    result = mannwhitneyu(member_scores, nonmember_scores, alternative="two-sided")
    return float(result.statistic) / (len(member_scores) * len(nonmember_scores))


def membership_scores(candidates: np.ndarray, released: np.ndarray) -> np.ndarray:
    """The adversary's score for each candidate query: its highest cosine similarity to any text
    the client released (rows are normalized embeddings). No released text: score 0."""
    if released.size == 0:
        return np.zeros(len(candidates), dtype=np.float32)
    return (candidates @ released.T).max(axis=1)


def token_overlap(original: str, released: Sequence[str]) -> float:
    """Share of the original's tokens that the best-matching released text reveals."""
    original_tokens = tokens(original)
    if not original_tokens:
        return 0.0
    best = 0.0
    for text in released:
        best = max(best, len(original_tokens & tokens(text)) / len(original_tokens))
        if best == 1.0:
            break
    return best
