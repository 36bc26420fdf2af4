"""What a client downloads for the server's tuned router: each safetensors file of a tuned router
folder whole, through zstd alone, and as the lossless delta against the bundled MiniLM that
`synapse-client pull --router` rebuilds (routing/weights_delta.py), with the time to make and to
apply the delta and the peak memory of applying it (measured in a child process). The rebuilt file
is checked byte for byte.

    python bench/router_delta.py [--router DIR] [--out FILE]

DIR defaults to the newest folder under SYNAPSE_DATA_DIR/routers (e.g. after `make demo`, or
`manage.py tune_router`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import zstandard
from _routing_common import ROOT, check_out, print_table, write_json

sys.path.insert(0, str(ROOT))

APPLY = """
import resource, sys, time
from routing.weights_delta import apply_delta
delta = open(sys.argv[1], "rb").read()
started = time.perf_counter()
out = apply_delta(delta, sys.argv[2])
seconds = time.perf_counter() - started
open(sys.argv[3], "wb").write(out)
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _newest_router() -> Path:
    root = Path(os.environ.get("SYNAPSE_DATA_DIR") or ROOT / ".data") / "routers"
    folders = [p for p in root.glob("round-*") if p.is_dir() and not p.name.endswith(".partial")]
    if not folders:
        raise SystemExit(f"no tuned router under {root}: run make demo or manage.py tune_router")
    return max(folders, key=lambda p: p.stat().st_mtime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", type=Path, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_out(args.out, "router_delta")
    folder = args.router or _newest_router()

    from routing.embeddings import _bundled_path
    from routing.weights_delta import make_delta

    base_dir = Path(_bundled_path())
    rows = []
    for target in sorted(folder.glob("*.safetensors")):
        base = base_dir / target.name
        data = target.read_bytes()
        started = time.perf_counter()
        delta = make_delta(target, base)
        make_seconds = time.perf_counter() - started
        zstd_alone = len(zstandard.ZstdCompressor(level=3).compress(data))
        scratch = ROOT / "bench" / "out" / "router-delta"
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "delta").write_bytes(delta)
        child = subprocess.run(
            [sys.executable, "-c", APPLY, str(scratch / "delta"), str(base), str(scratch / "rebuilt")],
            check=True, capture_output=True, text=True, cwd=ROOT,
        )
        apply_seconds, peak_kb = child.stdout.split()
        rebuilt = (scratch / "rebuilt").read_bytes()
        rows.append({
            "file": target.name,
            "bytes": len(data),
            "zstd_bytes": zstd_alone,
            "delta_bytes": len(delta),
            "delta_share": round(len(delta) / len(data), 4),
            "make_seconds": round(make_seconds, 2),
            "apply_seconds": round(float(apply_seconds), 2),
            "apply_peak_mb": round(int(peak_kb) / 1024),
            "identical": hashlib.sha256(rebuilt).digest() == hashlib.sha256(data).digest(),
        })
    manifest = json.loads((folder / "synapse-router-manifest.json").read_text()) if (
        folder / "synapse-router-manifest.json"
    ).is_file() else {}
    print(f"router: {folder} (round {manifest.get('round')}, {manifest.get('scenarios')} scenarios)")
    print_table(rows, list(rows[0]) if rows else ["file"])
    write_json(args.out, {"router": folder.name, "round": manifest.get("round"), "files": rows})


if __name__ == "__main__":
    main()
