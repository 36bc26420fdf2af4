"""The bundled embedding model loads offline and its cache never recomputes an unchanged text."""

from __future__ import annotations

import numpy as np
import pytest

from routing.embeddings import DEFAULT_MODEL, EmbeddingModelUnavailable, get_engine

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


def test_the_model_reads_masked_text_without_its_placeholders():
    """A masked scenario is embedded as the words it kept: "[NAME]" is not read as a word that
    every masked text shares. The masked text lands nearer its unmasked request than when the
    placeholders are read, and further from another masked text with the same placeholders.
    The fp32 model: where the CPU has bfloat16 the default engine computes in it, and its rounding
    depends on the padding of the batch, which the exact comparisons below would read as a
    difference of text."""
    engine = get_engine(DEFAULT_MODEL)

    def as_written(texts):  # what the model makes of the texts with their placeholders
        return engine._model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)

    masked = "Book a flight from [NAME] to [NAME] on [NUMBER] [MASK]"
    same, kept = engine.embed([masked, "Book a flight from to on"])
    assert np.array_equal(same, kept)
    request, read, other = as_written(
        ["Book a flight from Lisbon to Denver on 12 March", masked,
         "What is the weather in [NAME] on [NUMBER] [MASK]"]
    )
    query, unread, other_unread = engine.embed(
        ["Book a flight from Lisbon to Denver on 12 March", masked,
         "What is the weather in [NAME] on [NUMBER] [MASK]"]
    )
    assert np.allclose(query, request, atol=1e-6)  # no placeholder: the text as it is
    assert query @ unread > request @ read
    assert unread @ other_unread < read @ other
    # A text made only of placeholders is read as it is (there is nothing else).
    assert np.allclose(engine.embed(["[NAME] [MASK]"])[0], as_written(["[NAME] [MASK]"])[0],
                       atol=1e-6)


def test_unknown_model_is_one_clear_error(tmp_path):
    with pytest.raises(EmbeddingModelUnavailable, match="cannot load embedding model") as caught:
        get_engine(str(tmp_path / "no-such-model"))
    assert "\n" not in str(caught.value)


def test_a_loader_error_over_several_lines_is_one_line(monkeypatch, tmp_path):
    """Hugging Face's loader errors run over several lines of advice: the message was those
    lines whole, not the one line every command prints for a model it cannot load."""
    import sentence_transformers

    def refuse(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection or\n"
                      "see https://huggingface.co/docs/offline-mode")

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", refuse)
    with pytest.raises(EmbeddingModelUnavailable) as caught:
        get_engine(str(tmp_path / "yet-another-model"))
    message = str(caught.value)
    assert "\n" not in message and "couldn't connect" in message and "SYNAPSE_EMBEDDING_MODEL" in message
