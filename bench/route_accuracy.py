"""Top-1 / top-5 routing accuracy per reranker on a routing-benchmark dataset.

A seeded split of the labelled queries: train queries (deduplicated) are the scenarios of the
global compendium, the probe split fits the fusion weights and the calibration, the test split is
held out and scored. Prints one row per reranker; `--out FILE` writes them as JSON.

    python bench/route_accuracy.py --dataset ../shared/data/metatool [--seed 0] [--out FILE]
        [--save-params routing/default_params.json] [--llm-url http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
from _routing_common import (
    cached_embed,
    check_out,
    check_testable,
    print_table,
    read_dataset,
    write_json,
)

from compendium.registry import stratified_split
from routing.datasets import compendium_from_queries
from routing.embeddings import get_engine, get_query_engine
from routing.llm import get_llm
from routing.router import Router, RoutingParams, evaluate_calibration, fit_params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", type=float, default=0.1, help="share of queries for fitting")
    parser.add_argument("--test", type=float, default=0.2, help="share of queries held out")
    parser.add_argument("--max-per-tool", type=int, default=None, help="cap scenarios per tool")
    parser.add_argument("--max-test", type=int, default=None, help="score a seeded sample of N test queries (as simulate's --test-limit)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--llm-url", default=None, help="OpenAI-compatible endpoint for `llm`")
    parser.add_argument("--llm-model", default=None)
    parser.add_argument("--save-params", default=None, help="write the fitted parameters here")
    parser.add_argument(
        "--no-linear-head", action="store_true", help="route without the linear head (ablation)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    check_out(args.out, "route_accuracy")
    if args.max_test is not None and args.max_test < 1:
        raise SystemExit(f"route_accuracy: --max-test must be at least 1, not {args.max_test}")

    dataset = read_dataset(args.dataset, "route_accuracy")
    check_testable(dataset, [args.seed], "route_accuracy", probe_fraction=args.probe,
                   test_fraction=args.test)
    split = stratified_split(
        dataset.queries, seed=args.seed, probe_fraction=args.probe, test_fraction=args.test
    )
    # As a published global: with the registry's description of every tool it covers.
    compendium = compendium_from_queries(
        dataset.tools, split.train, args.max_per_tool, with_descriptions=True
    )
    engine = get_query_engine()
    started = time.perf_counter()
    # As in the product: scenarios embedded by the merge's engine, queries by the query engine.
    scenario_vectors = cached_embed(get_engine(), [s.text for s in compendium.scenarios])
    probe = [(q.query, q.tool_id) for q in split.probe]
    # A sample, never the split's first N: it holds the held-out queries tool by tool.
    held_out = split.test
    if args.max_test and len(held_out) > args.max_test:
        held_out = random.Random(args.seed).sample(held_out, args.max_test)
    test = [(q.query, q.tool_id) for q in held_out]
    # Pre-fill the engine's cache from disk: queries are embedded once per run.
    texts = [q for q, _ in probe + test]
    for text, vector in zip(texts, cached_embed(engine, texts), strict=True):
        engine._cache[engine._key(text)] = vector
    print(
        f"{dataset.name}: {len(dataset.tools)} tools, {len(compendium.scenarios)} scenarios "
        f"from {len(split.train)} train queries, {len(probe)} probe, {len(test)} test "
        f"(seed {args.seed}); embedded in {time.perf_counter() - started:.0f} s"
    )
    base = Router(
        compendium, engine, "fusion", params=RoutingParams(), scenario_embeddings=scenario_vectors
    )
    if not args.no_linear_head:  # as the server does at publication: the merge engine's vectors
        base = base.with_linear_head(get_engine().embed)
    params = fit_params(base, probe, args.top_k, fitted_on=f"{dataset.name} probe split seed {args.seed}")
    if args.save_params:
        params.save(args.save_params)
        print(f"fitted parameters written to {args.save_params}")
    rerankers = ["none", "fusion"]
    llm = None
    if args.llm_url:
        llm = get_llm(args.llm_url, args.llm_model or "")
        rerankers.append("llm")
    truth = [t for _, t in test]
    rows = []
    for name in rerankers:
        router = base.with_reranker(name, params=params, llm=llm)
        started = time.perf_counter()
        decisions = router.route_batch([q for q, _ in test], args.top_k)
        elapsed = time.perf_counter() - started
        top1 = float(np.mean([d.tool == t for d, t in zip(decisions, truth, strict=True)]))
        topk = float(
            np.mean(
                [t in {c["tool"] for c in d.candidates} for d, t in zip(decisions, truth, strict=True)]
            )
        )
        calibration = evaluate_calibration(router, test, "fusion" if name == "llm" else name)
        rows.append(
            {
                "dataset": dataset.name,
                "reranker": name,
                "seed": args.seed,
                "tools": len(dataset.tools),
                "scenarios": len(compendium.scenarios),
                "linear_head": base.head is not None,
                "test_queries": len(test),
                "top1_accuracy": round(top1, 4),
                f"top{args.top_k}_accuracy": round(topk, 4),
                "escalated_share": round(float(np.mean([d.escalate for d in decisions])), 4),
                "ece_raw": round(calibration["ece_raw"], 4),
                "ece_calibrated": round(calibration["ece_calibrated"], 4),
                "llm_fallbacks": sum(d.fallback_reason is not None for d in decisions),
                "queries_per_s_embeddings_cached": round(len(test) / elapsed, 1),
            }
        )
    print_table(
        rows,
        [
            "reranker", "top1_accuracy", f"top{args.top_k}_accuracy", "ece_raw", "ece_calibrated",
            "escalated_share", "llm_fallbacks", "queries_per_s_embeddings_cached",
        ],
    )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
