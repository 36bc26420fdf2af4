"""The routing head's lexical part (routing.lexical): its TF-IDF is scikit-learn's, it reads
telling words, keeps only its largest weights, and travels in the head archive."""

from __future__ import annotations

import io

import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer

from routing.lexical import LexicalHead, fit_lexical_head, tfidf, tokenize
from routing.router import LinearHead

TEXTS = [
    "What is the weather in Paris tomorrow?",
    "Will it rain in the city on Sunday",
    "Show me the latest mortgage rates",
    "mortgage calculator for a house loan",
    "Play some jazz music, please",
    "play the new album by my favourite band",
]
LABELS = [0, 0, 1, 1, 2, 2]


def test_the_features_are_scikit_learns_tfidf():
    reference = TfidfVectorizer(token_pattern=r"[a-z0-9]+", sublinear_tf=True).fit(TEXTS)
    head = fit_lexical_head(TEXTS, LABELS, n_tools=3)
    assert head.terms == reference.get_feature_names_out().tolist()
    assert np.allclose(head.idf, reference.idf_)
    queries = ["rain rain in PARIS", "xylophone zebra", "mortgage"]
    ours = tfidf(queries, {t: i for i, t in enumerate(head.terms)}, head.idf).toarray()
    assert np.allclose(ours, reference.transform(queries).toarray(), atol=1e-6)
    assert not ours[1].any()  # words outside the vocabulary are left out


def test_it_reads_telling_words_and_falls_back_to_its_bias():
    head = fit_lexical_head(TEXTS, LABELS, n_tools=3)
    log_proba = head.log_proba(["any good mortgage offers?", "jazz", "zzz qqq"])
    assert log_proba.shape == (3, 3)
    assert np.allclose(np.exp(log_proba).sum(axis=1), 1.0, atol=1e-5)
    assert log_proba[0].argmax() == 1 and log_proba[1].argmax() == 2
    prior = head.bias - np.log(np.exp(head.bias).sum())
    assert np.allclose(log_proba[2], prior, atol=1e-6)  # no known word: the bias alone


def test_only_the_largest_weights_of_each_tool_are_kept():
    full = fit_lexical_head(TEXTS, LABELS, n_tools=3, keep=10_000)
    kept = fit_lexical_head(TEXTS, LABELS, n_tools=3, keep=4)
    assert np.all(np.diff(kept.weights.indptr) <= 4)
    dense, pruned = full.weights.toarray(), kept.weights.toarray()
    for tool in range(3):
        largest = np.argsort(-np.abs(dense[tool]), kind="stable")[:4]
        assert set(np.flatnonzero(pruned[tool])) == set(largest)
        assert np.allclose(pruned[tool, largest], dense[tool, largest])


def test_two_tools_get_two_rows():
    head = fit_lexical_head(TEXTS[:4], LABELS[:4], n_tools=2)
    assert head.weights.shape[0] == 2
    assert head.log_proba(["mortgage rates"])[0].argmax() == 1


def test_no_words_no_head():
    assert fit_lexical_head(["?", "!!"], [0, 1], n_tools=2) is None
    assert tokenize("Où est l'ETF #42?") == ["o", "est", "l", "etf", "42"]


def test_it_travels_in_the_head_archive_and_older_archives_still_load():
    lexical = fit_lexical_head(TEXTS, LABELS, n_tools=3)
    dense = LinearHead(["a", "b", "c"], np.eye(3, 4, dtype=np.float32), np.zeros(3, np.float32))
    with_lexical = LinearHead(dense.tools, dense.weights, dense.bias, lexical)
    again = LinearHead.from_bytes(with_lexical.to_bytes())
    queries = ["rain in Paris", "mortgage", "band"]
    assert np.allclose(again.lexical.log_proba(queries), lexical.log_proba(queries))
    assert isinstance(again.lexical, LexicalHead)
    older = io.BytesIO()  # a head published before the lexical part: arrays tools, weights, bias
    np.savez_compressed(older, tools=np.array(dense.tools), weights=dense.weights, bias=dense.bias)
    assert LinearHead.from_bytes(older.getvalue()).lexical is None


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_counts_per_tool(keep):
    head = fit_lexical_head(TEXTS, LABELS, n_tools=3, keep=keep)
    assert (np.diff(head.weights.indptr) <= keep).all()


def test_a_broken_lexical_part_is_refused_with_a_reason():
    lexical = fit_lexical_head(TEXTS, LABELS, n_tools=3)
    arrays = lexical.arrays()
    arrays["lexical_rows"] = arrays["lexical_rows"] + 3  # rows past the tools
    with pytest.raises(ValueError, match="do not fit 3 tools"):
        LexicalHead.from_arrays(arrays, 3)
