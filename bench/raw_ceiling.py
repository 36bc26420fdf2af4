"""What MiniLM reaches with every raw training query pooled: the ceiling a federation is held to.

On the simulation's own split of a seed (`federation.simulation`: the same train / probe / test
queries and the same test sample as `manage.py simulate --seed S --test-limit N`), route the test
queries with nothing federated, masked or merged: a 1-nearest-neighbour over the embeddings of all
train queries, and the linear head the router uses (`routing.router.fit_linear_head`, the same
logistic regression) fitted on them. Prints one row per method and seed; `--out` writes JSON.

    python bench/raw_ceiling.py [--dataset ../shared/data/metatool] [--seeds 1] [--test-limit 1000]
        [--embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _routing_common import (
    METATOOL,
    check_out,
    check_testable,
    load_engine,
    print_table,
    read_dataset,
    write_json,
)

from compendium.schema import Compendium, Scenario, Schema
from federation.simulation.runner import Simulation, SimulationConfig
from routing.router import fit_linear_head


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(METATOOL))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--test-limit", type=int, default=1000)
    parser.add_argument("--embedding-model", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    check_out(args.out, "raw_ceiling")
    for flag, value in (("--seeds", args.seeds), ("--test-limit", args.test_limit)):
        if value < 1:  # as simulate refuses them
            raise SystemExit(f"raw_ceiling: {flag} must be at least 1, not {value}")

    dataset = read_dataset(args.dataset, "raw_ceiling")
    config = SimulationConfig(test_limit=args.test_limit)
    check_testable(dataset, range(args.seed, args.seed + args.seeds), "raw_ceiling",
                   probe_fraction=config.probe_fraction, test_fraction=config.test_fraction)
    engine = load_engine(args.embedding_model, "raw_ceiling")
    simulation = Simulation(dataset, Schema(tools=dataset.tools), engine, config)
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        started = time.perf_counter()
        setup = simulation.prepare(seed)
        train = setup.split.train
        vectors = engine.embed([q.query for q in train])
        labels = np.array([q.tool_id for q in train])
        queries = engine.embed([q.query for q in setup.test])
        truth = np.array([q.tool_id for q in setup.test])
        nearest = labels[(queries @ vectors.T).argmax(axis=1)]
        pooled = Compendium(scenarios=[Scenario(tool_id=q.tool_id, text=q.query) for q in train])
        head = fit_linear_head(pooled, vectors, engine.embed)
        read_out = np.array(head.tools)[head.log_proba(queries).argmax(axis=1)]
        for method, predicted in (("raw_1nn", nearest), ("raw_linear_head", read_out)):
            rows.append(
                {
                    "dataset": dataset.name,
                    "method": method,
                    "seed": seed,
                    "train_queries": len(train),
                    "test_queries": len(truth),
                    "accuracy": round(float(np.mean(predicted == truth)), 4),
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
    print_table(rows, ["method", "seed", "train_queries", "test_queries", "accuracy"])
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
