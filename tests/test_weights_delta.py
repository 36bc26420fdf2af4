"""Lossless weight deltas (routing.weights_delta): the tuned file comes back byte for byte from the
delta and the base, tensors the base lacks or shapes it does not share travel whole, and a damaged
delta or another base is caught."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from routing.weights_delta import DeltaError, apply_delta, make_delta


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(0)
    base = {
        "encoder.weight": rng.normal(size=(64, 48)).astype(np.float32),
        "encoder.bias": rng.normal(size=(48,)).astype(np.float32),
        "pooler.weight": rng.normal(size=(8, 8)).astype(np.float32),
        "only.in.base": rng.normal(size=(5,)).astype(np.float32),
    }
    tuned = {
        "encoder.weight": base["encoder.weight"] * (1 + 1e-3 * rng.normal(size=(64, 48))).astype(np.float32),
        "encoder.bias": base["encoder.bias"] + np.float32(1e-4),
        "pooler.weight": rng.normal(size=(8, 9)).astype(np.float32),  # another shape: sent whole
        "only.in.tuned": np.arange(7, dtype=np.int64),  # 56 bytes: not a multiple of 4 words apart
        "odd": np.arange(3, dtype=np.int8),  # the data section's length is not a multiple of 4
    }
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors", metadata={"format": "pt"})
    return tmp_path / "tuned.safetensors", tmp_path / "base.safetensors"


def test_the_tuned_file_comes_back_byte_for_byte(pair):
    tuned, base = pair
    delta = make_delta(tuned, base)
    assert apply_delta(delta, base) == tuned.read_bytes()
    # Small moves of shared tensors cost far less than the tensors themselves.
    assert len(delta) < 0.75 * tuned.stat().st_size


def test_a_damaged_delta_or_another_base_is_caught(pair, tmp_path):
    tuned, base = pair
    delta = make_delta(tuned, base)
    with pytest.raises(DeltaError, match="zstd"):
        apply_delta(delta[: len(delta) // 2], base)
    with pytest.raises(DeltaError):
        apply_delta(b"not a delta", base)
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": np.zeros((64, 48), np.float32)}, other)
    rebuilt = apply_delta(delta, other)  # readable, but not the file: the sha256 check catches it
    assert hashlib.sha256(rebuilt).digest() != hashlib.sha256(tuned.read_bytes()).digest()
