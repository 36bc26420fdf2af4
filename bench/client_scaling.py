"""How the client's masking and near-duplicate collapse scale with their input.

- `mask`: `TextMasker.mask` at λ = 1 on one text of N tokens (registry-free masker, a fixed mix
  of common, rare, capitalized and letters+digits words). Ties are broken by a hash of the text
  computed once per text; before, the whole text was hashed again for each candidate token
  (20,000 tokens: 4.8 s; a 5-line log of 900 KB lines: 6 minutes).
- `collapse`: `compendium.builder.collapse_near_duplicates` on N distinct requests of one tool
  (random unit vectors of dimension 384, so nearly every one is kept: the worst case), with the
  vectors precomputed (the embedding model is not timed). Before, the kept vectors were copied
  for every entry (8,000 requests: 53 s).

Prints one line per size and writes the figures as JSON (an --out it could not write is refused
in one line before anything runs).

Usage: python bench/client_scaling.py [--out bench/results/client_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _routing_common import check_out  # noqa: E402

from compendium.builder import collapse_near_duplicates  # noqa: E402
from compendium.masking import TextMasker  # noqa: E402

WORDS = ["alpha", "Bravo", "charlie", "delta123", "echo", "foxtrot", "golf", "Hotel"]


class Precomputed:
    def __init__(self, dim: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.dim = dim

    def embed(self, texts):
        v = self.rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "client_scaling.json"))
    args = parser.parse_args(argv)
    check_out(args.out, "client_scaling")
    rng = random.Random(0)
    masker = TextMasker(strength=1.0)
    masker.mask(" ".join(WORDS))  # load the reference vocabulary outside the timing
    out = {"mask": [], "collapse": []}
    for n in (5_000, 10_000, 20_000, 100_000):
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        start = time.perf_counter()
        masker.mask(text)
        seconds = time.perf_counter() - start
        out["mask"].append({"tokens": n, "seconds": round(seconds, 3)})
        print(f"mask      {n:>7} tokens   {seconds:7.2f} s")
    for n in (2_000, 4_000, 8_000):
        items = [(("tool", ()), f"request {i}", 1, frozenset({"u"})) for i in range(n)]
        start = time.perf_counter()
        kept = collapse_near_duplicates(items, Precomputed(384, 0), 0.85)
        seconds = time.perf_counter() - start
        out["collapse"].append({"requests": n, "kept": len(kept), "seconds": round(seconds, 3)})
        print(f"collapse  {n:>7} requests {seconds:7.2f} s ({len(kept)} kept)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
