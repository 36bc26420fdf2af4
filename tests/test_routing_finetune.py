"""Fine-tuning the routing encoder (`routing.finetune`): the saved model tells the labels apart
better than the frozen one, loads as an engine, and bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest

from routing.embeddings import get_engine
from routing.finetune import fine_tune_encoder

# Two tools whose requests the frozen MiniLM confuses (both about "files" and "sending"), and a third.
TEXTS = {
    "mail": ["send the report file to my boss", "email this attachment to the team",
             "forward the invoice file to accounting", "mail the slides to Anna"],
    "upload": ["send the report file to the shared drive", "put this attachment in cloud storage",
               "push the invoice file to the bucket", "store the slides online"],
    "weather": ["will it rain tomorrow", "how warm is it in Paris", "forecast for the weekend",
                "is it snowing in Oslo"],
}


def separation(engine, texts: list[str], labels: list[str]) -> float:
    """Mean cosine to texts of the same label minus mean cosine to texts of other labels."""
    vectors = engine.embed(texts)
    similarity = vectors @ vectors.T
    same = np.equal.outer(np.array(labels), np.array(labels))
    np.fill_diagonal(same, False)
    other = ~np.equal.outer(np.array(labels), np.array(labels))
    return float(similarity[same].mean() - similarity[other].mean())


def test_the_fine_tuned_encoder_separates_the_tools_better_and_loads_as_an_engine(tmp_path):
    texts = [t for tool in TEXTS for t in TEXTS[tool]]
    labels = [tool for tool in TEXTS for _ in TEXTS[tool]]
    path = fine_tune_encoder(texts, labels, tmp_path / "tuned", epochs=8, batch_size=4, encoder_lr=1e-4)
    tuned = get_engine(str(path))
    assert tuned.dimension == 384
    assert separation(tuned, texts, labels) > separation(get_engine("bundled:all-MiniLM-L6-v2"), texts, labels) + 0.05


@pytest.mark.parametrize(
    "texts, labels, epochs, message",
    [
        (["a", "b"], ["x"], 1, "2 texts for 1 labels"),
        (["a", "b"], ["x", "x"], 1, "at least two labels"),
        (["a", "b"], ["x", "y"], 0, "epochs must be at least 1"),
    ],
)
def test_bad_input_is_refused_before_any_training(tmp_path, texts, labels, epochs, message):
    with pytest.raises(ValueError, match=message):
        fine_tune_encoder(texts, labels, tmp_path / "tuned", epochs=epochs)
    assert not (tmp_path / "tuned").exists()


def test_tune_device_bench_tunes_a_saved_global_and_the_folder_routes_as_saved(tmp_path):
    """bench/tune_device.py tune (what ran on the GPU machine): tune_router on a saved global, top-1
    for the frozen and the tuned router, and the saved folder reloaded routes the same."""
    import importlib.util
    import json
    import sys

    from compendium.canonical import canonical_bytes
    from compendium.schema import Compendium, Scenario, ToolMetadata
    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))  # the script imports its neighbour _routing_common
    try:
        spec = importlib.util.spec_from_file_location("tune_device", ROOT / "bench" / "tune_device.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    compendium = Compendium(
        scenarios=[Scenario(tool_id=tool, text=text) for tool in TEXTS for text in TEXTS[tool][:2]],
        metadata=[ToolMetadata(tool_id=tool, description=f"{tool} tool") for tool in TEXTS],
    )
    for name in ("synapse", "centralized"):
        (tmp_path / f"{name}.json").write_bytes(canonical_bytes(compendium))
    rows = [{"query": text, "tool_id": tool, "category": ""} for tool in TEXTS for text in TEXTS[tool]]
    for name in ("probe", "test"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "export.json").write_text(json.dumps({"seed": 0}))
    out = tmp_path / "out.json"
    assert bench.main(["tune", "--dir", str(tmp_path), "--device", "cpu", "--globals", "synapse",
                       "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    (row,) = document["rows"]
    assert document["environment"]["device"] == "cpu" and document["test"] == len(rows)
    assert row["global"] == "synapse" and row["rows_tuned_on"] > len(compendium.scenarios)
    assert 0 < row["fine_tune_seconds"] <= row["tune_seconds"]
    assert 0 <= row["frozen_accuracy"] <= 1 and 0 <= row["tuned_accuracy"] <= 1
    assert row["reloaded_accuracy"] == row["tuned_accuracy"] and row["reloaded_same_choices"] == 1.0
    assert row["peak_gpu_mib"] is None


def test_a_tuned_routers_engine_embeds_a_query_alike_alone_and_in_a_list(tmp_path):
    """The tuned router's engine (fp32 torch) embedded a list of queries in batches of 64, padded
    to the longest: a query's vector differed in the last bits alone and in a list, so with a
    tuned router POST /api/v1/route/ and /api/v1/route/batch/ scored the same query otherwise,
    and the engine's cache kept whichever vector a query got first."""
    import shutil

    from routing.embeddings import _bundled_path
    from routing.finetune import ROUTER_PARAMS, ROUTER_STATE, load_tuned_router
    from routing.router import RoutingParams

    folder = tmp_path / "router"
    shutil.copytree(_bundled_path(), folder)  # a sentence-transformers model, as tuning saves one
    np.savez(folder / ROUTER_STATE, scenarios=np.zeros((0, 384), np.float32),
             precautions=np.zeros((0, 384), np.float32))
    (folder / ROUTER_PARAMS).write_text(RoutingParams().to_json())
    queries = [t for tool in TEXTS for t in TEXTS[tool]] + ["a much longer request " * 6, "hi"]
    listed = load_tuned_router(folder).engine.embed(queries)
    engine = load_tuned_router(folder).engine
    alone = np.array([engine.embed([q])[0] for q in queries])
    assert (listed == alone).all()
