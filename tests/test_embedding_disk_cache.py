"""The on-disk embedding cache of `synapse-client route` (one file per pulled global and engine)
grew by a file per round without end: it keeps the most recently used files within a size."""

import os

import numpy as np
import pytest

from routing.embeddings import embed_cached


class _Engine:
    model_name = "test-engine"
    dimension = 4

    def __init__(self):
        self.calls = 0

    def embed(self, texts):
        self.calls += 1
        return np.ones((len(texts), self.dimension), np.float32)


def _files(folder):
    return sorted(p.name for p in folder.glob("embeddings-*.npy"))


def _age_every_file(folder):
    """Every cache file as used long ago, each at its own time in the order it was last used, so
    that a read or write now is the most recent one without waiting for the clock."""
    files = sorted(folder.glob("embeddings-*.npy"), key=lambda p: p.stat().st_mtime_ns)
    for age, path in enumerate(files):
        os.utime(path, ns=(10**9 * (1000 + age),) * 2)


def test_the_cache_keeps_the_most_recently_used_files_within_its_size(tmp_path, monkeypatch):
    engine = _Engine()
    rounds = [[f"round {r} text {i}" for i in range(10)] for r in range(4)]
    embed_cached(engine, rounds[0], tmp_path)
    one_file = next(tmp_path.glob("embeddings-*.npy")).stat().st_size  # each holds 10x4 floats
    monkeypatch.setenv("SYNAPSE_EMBEDDING_DISK_CACHE_MB", str(3.5 * one_file / 1e6))
    for texts in rounds[1:3]:
        _age_every_file(tmp_path)
        embed_cached(engine, texts, tmp_path)
    assert len(_files(tmp_path)) == 3
    _age_every_file(tmp_path)
    embed_cached(engine, rounds[0], tmp_path)  # read: the oldest becomes the most recent
    assert engine.calls == 3
    _age_every_file(tmp_path)
    embed_cached(engine, rounds[3], tmp_path)  # a fourth file: the least recently used goes
    assert len(_files(tmp_path)) == 3
    calls = engine.calls
    embed_cached(engine, rounds[0], tmp_path)
    assert engine.calls == calls  # kept: it had been read
    embed_cached(engine, rounds[1], tmp_path)
    assert engine.calls == calls + 1  # removed: round 1's was the least recently used


def test_files_that_are_not_the_caches_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNAPSE_EMBEDDING_DISK_CACHE_MB", "0")
    (tmp_path / "notes.txt").write_text("mine")
    engine = _Engine()
    embed_cached(engine, ["a"], tmp_path)
    embed_cached(engine, ["b"], tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert len(_files(tmp_path)) == 1  # 0 MB: only the file just written stays


@pytest.mark.parametrize("raw", ["lots", "-1", "nan"])
def test_a_bad_size_is_named_and_the_default_kept(tmp_path, monkeypatch, capsys, raw):
    monkeypatch.setenv("SYNAPSE_EMBEDDING_DISK_CACHE_MB", raw)
    engine = _Engine()
    embed_cached(engine, ["a"], tmp_path)
    embed_cached(engine, ["b"], tmp_path)
    assert len(_files(tmp_path)) == 2
    assert "SYNAPSE_EMBEDDING_DISK_CACHE_MB" in capsys.readouterr().err


def test_the_heads_folder_is_pruned_alike(tmp_path, monkeypatch):
    """`synapse-client route` without the server's head fits one per global and keeps it in
    routing-heads/, which grew by a file a global too."""
    from compendium.schema import Compendium, Scenario
    from routing.cli import _cached_head
    from routing.embeddings import get_engine
    from routing.router import Router

    engine = get_engine()
    monkeypatch.setenv("SYNAPSE_EMBEDDING_DISK_CACHE_MB", "0")
    folder = tmp_path / "routing-heads"
    for round_ in range(3):
        compendium = Compendium(scenarios=[
            Scenario(tool_id=tool, text=f"{tool} request {round_} {i}", support=1)
            for tool in ("alpha", "beta") for i in range(3)
        ])
        router = Router(compendium, engine, "none")
        assert _cached_head(router, engine, folder) is not None
        assert len(list(folder.glob("*.npz"))) == 1
