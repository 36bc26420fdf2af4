"""Which words of a request to send: a quick offline proxy for `--max-words` and its alternatives.

No federation: a seeded sample of a routing benchmark's queries, split into "sent" requests, a
dictionary (other requests, standing in for the global a client pulled) and test queries. For each
way of cutting a request it prints, and writes as JSON:
- `nn_accuracy`: top-1 of a 1-nearest-neighbour router over the cut requests (the same engine
  embeds them and the whole test queries), how much of what the router learns from survives;
- `dcz_bytes_per_170`: zstd (level 19, the dictionary as raw content, as `compendium.transport`
  compresses) of 170 cut requests, one per line, about what a client's round brings; the mean
  over 10 batches;
- `chars`: mean length of a cut request.

The cuts: whole; function words dropped (compendium.masking.FUNCTION_WORDS, the words masking
always keeps); the first N words; function words dropped, then the first N words.

    python bench/word_cuts_offline.py --dataset ../shared/data/metatool \\
        --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 --out FILE
"""

from __future__ import annotations

import argparse
import random
import re
import time

import numpy as np
import zstandard

# _routing_common also puts the repository on sys.path.
from _routing_common import (
    cached_embed,
    check_out,
    load_engine,
    print_table,
    read_dataset,
    write_json,
)

from compendium.masking import FUNCTION_WORDS, folded
from compendium.transport import LEVEL

BATCH = 170
BATCHES = 10
_EDGES = re.compile(r"^[^\w'’]+|[^\w'’]+$")


def without_function_words(text: str) -> str:
    kept = [w for w in text.split() if folded(_EDGES.sub("", w)) not in FUNCTION_WORDS]
    return " ".join(kept) if kept else text


def first_words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


CUTS = {
    "whole": lambda t: t,
    "function words dropped": without_function_words,
    "first 15": lambda t: first_words(t, 15),
    "first 10": lambda t: first_words(t, 10),
    "function words dropped, first 10": lambda t: first_words(without_function_words(t), 10),
    "function words dropped, first 8": lambda t: first_words(without_function_words(t), 8),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--embedding-model", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sent", type=int, default=8000, help="requests the router learns from")
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--dictionary", type=int, default=3000, help="requests in the dictionary")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    check_out(args.out, "word_cuts_offline")
    if args.test < 1:  # an accuracy over no query is nan, and NaN is not JSON
        parser.error(f"--test must be at least 1, not {args.test}")

    # The queries.jsonl lines in order, as the registry reads them (one line for what it refuses).
    rows = [{"query": q.query, "tool_id": q.tool_id}
            for q in read_dataset(args.dataset, "word_cuts_offline").queries]
    random.Random(args.seed).shuffle(rows)
    sent = rows[: args.sent]
    test = rows[args.sent : args.sent + args.test]
    dictionary_rows = rows[args.sent + args.test : args.sent + args.test + args.dictionary]
    if len(dictionary_rows) < args.dictionary or len(sent) < BATCH * BATCHES:
        parser.error(f"{args.dataset} has {len(rows)} queries; fewer than --sent + --test + --dictionary")
    dictionary = zstandard.ZstdCompressionDict(
        "\n".join(r["query"] for r in dictionary_rows).encode(), dict_type=zstandard.DICT_TYPE_RAWCONTENT
    )
    compressor = zstandard.ZstdCompressor(level=LEVEL, dict_data=dictionary)

    engine = load_engine(args.embedding_model or None, "word_cuts_offline")
    started = time.perf_counter()
    queries = cached_embed(engine, [r["query"] for r in test])
    truth = np.array([r["tool_id"] for r in test])
    labels = np.array([r["tool_id"] for r in sent])
    results = []
    for name, cut in CUTS.items():
        texts = [cut(r["query"]) for r in sent]
        vectors = cached_embed(engine, texts)
        accuracy = float((labels[(queries @ vectors.T).argmax(1)] == truth).mean())
        sizes = [
            len(compressor.compress("\n".join(texts[i : i + BATCH]).encode()))
            for i in range(0, BATCH * BATCHES, BATCH)
        ]
        results.append({
            "cut": name, "nn_accuracy": round(accuracy, 4),
            "dcz_bytes_per_170": round(float(np.mean(sizes)), 1),
            "chars": round(float(np.mean([len(t) for t in texts])), 1),
        })
    print_table(results, ["cut", "nn_accuracy", "dcz_bytes_per_170", "chars"])
    write_json(args.out, {
        "command": "python bench/word_cuts_offline.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, "") and k != "out"
        ),
        "engine": engine.model_name, "seconds": round(time.perf_counter() - started, 1), "results": results,
    })


if __name__ == "__main__":
    main()
