"""The server's check of a client's masking (`TextMasker.residue`) against the client's masking.

On the queries of a routing-benchmark dataset (default: MetaTool), every `--plant-every`-th with
a synthetic name, e-mail, phone and ticket number appended (as `bench/mask_leakage.py` plants
them), plus variants a client could send (500 in capitals, 500 broken across lines, 500 with a
sentence of personal data added), each text is masked at every λ of `--lambdas`, once with no
shared words and once with every word of the corpus shared (the most a client's log could
release), and the output is checked at the same λ. Prints and writes (`--out`):

- `refused`: masked outputs the check would refuse (the server would turn the toolkit's own work
  away: must be 0);
- `planted_caught` / `raw_caught`: unmasked texts it refuses at λ = 1, of those with planted data
  and of the plain queries;
- `pooled_refused`: pooled releases (`pool_text` of 4 masked queries of a tool from 4 users, 30
  draws per tool) the check would refuse at λ = 1 (must be 0);
- `check_us_per_text`: the check's mean time per masked text at λ = 1 (`residue` with its
  shortcut), and `tokenized_share`, the share of those texts it had to tokenize.

    .venv/bin/python bench/masking_residue.py --out bench/results/masking_residue_metatool.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _routing_common import check_out, read_dataset  # noqa: E402
from mask_leakage import plant  # noqa: E402

from compendium.builder import pool_text  # noqa: E402
from compendium.masking import TextMasker, tokenize  # noqa: E402


def variants(queries: list[str], plant_every: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    planted = list(range(0, len(queries), plant_every))
    texts = list(queries)
    for index in planted:
        texts[index] = plant(texts[index], rng)[0]
    texts += [q.upper() for q in queries[:500]]
    texts += [q.replace(" ", "\n", 3) for q in queries[500:1000]]
    texts += [q + " Call 555-1234 or Ms. O'Brien-Smith at A1b2." for q in queries[1000:1500]]
    return texts, planted


def run(dataset: Path, lambdas: list[float], plant_every: int, seed: int) -> dict:
    data = read_dataset(dataset, "masking_residue")
    queries = [q.query for q in data.queries]
    texts, planted = variants(queries, plant_every, seed)
    every_word = {t.text.lower() for text in texts for t in tokenize(text) if t.kind == "word"}
    base = TextMasker.for_registry(data.tools)
    rows = []
    for strength in lambdas:
        for shared in (frozenset(), every_word):
            masker = TextMasker(strength, seed=seed, protected=base.protected).sharing(shared)
            refused = sum(bool(masker.residue(masker.mask(t).text)) for t in texts)
            rows.append({"lambda": strength, "shared_words": len(shared), "texts": len(texts),
                         "refused": refused})
            print(f"λ={strength:g} shared words={len(shared):>6}: {refused} of {len(texts)} "
                  "masked outputs refused")
    at_one = TextMasker(1.0, seed=seed, protected=base.protected)
    masked = [at_one.mask(t).text for t in texts]
    start = time.perf_counter()
    for text in masked:
        at_one.residue(text)
    per_text = (time.perf_counter() - start) / len(masked) * 1e6
    by_tool: dict[str, list[str]] = {}
    for q in data.queries:
        by_tool.setdefault(q.tool_id, []).append(at_one.mask(q.query).text)
    rng = random.Random(seed)
    pools = []
    for texts_of_tool in by_tool.values():
        for _ in range(30):
            group = rng.sample(texts_of_tool, min(4, len(texts_of_tool)))
            pooled = pool_text([(t, frozenset({f"u{i}"})) for i, t in enumerate(group)])
            if pooled:
                pools.append(pooled)
    result = {
        "dataset": str(dataset),
        "pooled_texts": len(pools),
        "pooled_refused": sum(bool(at_one.residue(p)) for p in pools),
        "rows": rows,
        "planted_texts": len(planted),
        "planted_caught": sum(bool(at_one.residue(texts[i])) for i in planted),
        "raw_queries": len(queries),
        "raw_caught": sum(bool(at_one.residue(q)) for q in queries),
        "check_us_per_text": per_text,
        "tokenized_share": sum(not at_one._clear(t) for t in masked) / len(masked),
    }
    print(f"pooled releases at λ=1: {result['pooled_refused']} of {len(pools)} refused")
    print(f"unmasked at λ=1: {result['planted_caught']} of {len(planted)} planted texts refused, "
          f"{result['raw_caught']} of {len(queries)} plain queries; check {per_text:.1f} µs a "
          f"masked text, {result['tokenized_share']:.1%} of them tokenized")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "metatool"))
    parser.add_argument("--lambdas", default="0.05,0.3,0.5,1,2,3")
    parser.add_argument("--plant-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    check_out(args.out, "masking_residue")
    lambdas = [float(x) for x in args.lambdas.split(",")]
    result = run(Path(args.dataset), lambdas, max(1, args.plant_every), args.seed)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
