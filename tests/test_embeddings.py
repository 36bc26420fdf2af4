"""The bundled embedding model loads offline and its cache never recomputes an unchanged text."""

from __future__ import annotations

import numpy as np
import pytest

from routing.embeddings import EmbeddingModelUnavailable, get_engine

pytestmark = pytest.mark.slow


def test_bundled_model_embeds_normalized_and_semantically():
    engine = get_engine("")
    vectors = engine.embed(
        ["What will the weather be tomorrow?", "Is it going to rain tomorrow?", "Book a flight to Rome"]
    )
    assert vectors.shape == (3, engine.dimension) == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]


def test_unchanged_texts_are_not_recomputed():
    engine = get_engine("")
    before = engine.computed
    first = engine.embed(["a text seen once", "another text", "a text seen once"])
    assert engine.computed == before + 2
    again = engine.embed(["another text", "a text seen once"])
    assert engine.computed == before + 2
    assert np.array_equal(again[1], first[0])


def test_unknown_model_is_one_clear_error(tmp_path):
    with pytest.raises(EmbeddingModelUnavailable, match="cannot load embedding model"):
        get_engine(str(tmp_path / "no-such-model"))
