"""The ONNX int8 query engine is faithful to the fp32 all-MiniLM-L6-v2 and shares the engine API."""

from __future__ import annotations

import json

import numpy as np
import pytest

from routing.embeddings import ONNX_INT8_MODEL, get_engine, get_query_engine
from tests.routing_data import METATOOL

pytestmark = pytest.mark.slow


def _metatool_queries(n: int) -> list[str]:
    with (METATOOL / "queries.jsonl").open(encoding="utf-8") as handle:
        queries = [json.loads(line)["query"] for line in handle if line.strip()]
    return queries[:: max(1, len(queries) // n)][:n]


def test_onnx_int8_matches_fp32_model_on_metatool_queries():
    texts = _metatool_queries(300)
    fp32 = get_engine("").embed(texts)
    int8 = get_engine(ONNX_INT8_MODEL).embed(texts)
    assert int8.shape == fp32.shape == (len(texts), 384)
    assert np.allclose(np.linalg.norm(int8, axis=1), 1.0, atol=1e-5)
    cosine = (fp32 * int8).sum(axis=1)
    assert cosine.min() >= 0.998, cosine.min()
    assert cosine.mean() >= 0.999, cosine.mean()
    # One query alone (no padding) embeds like the same query inside a padded batch.
    single = get_engine(ONNX_INT8_MODEL)._model.encode([texts[7]])[0]
    assert float(single @ int8[7]) > 0.9999


def test_query_engine_defaults_to_onnx_and_caches():
    engine = get_query_engine()
    assert engine.model_name == ONNX_INT8_MODEL
    before = engine.computed
    engine.embed_one("route this query please")
    engine.embed_one("route this query please")
    assert engine.computed == before + 1
    assert engine.dimension == 384
