"""Centralized-SYNAPSE's compendium routed with another embedding model: the reference row that
`simulate --transfer-models` has for SYNAPSE's final global, without running the federation.

For each seed: the same split, client shares and usage logs as `manage.py simulate`
(`Simulation.prepare`), the Centralized compendium as simulate's baseline builds it
(`Simulation.centralized_global`), scored with the simulation engine's router (simulate's
`centralized` row, to the digit) and then under each transfer variant (`Simulation.transfer`),
and, with `--tune-router EPOCHS`, with the server's tuned router (`Simulation.tuned_router`:
simulate --tune-router's `centralized` row, without playing the federation again).

    python bench/transfer_centralized.py --dataset ../shared/data/metatool --seed 0 --seeds 3 \\
        --test-limit 3000 --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 \\
        [--transfer-models ~/.cache/synapse/all-mpnet-base-v2] [--tune-router 1] --out FILE
"""

from __future__ import annotations

import os
import sys
import time

# _routing_common also puts the repository on sys.path.
from _routing_common import federation_parser, federation_simulation, print_table, write_json

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def main(argv: list[str] | None = None) -> int:
    parser = federation_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--test-limit", type=int, default=None)
    parser.add_argument("--transfer-models", default="", help="comma-separated models or paths")
    parser.add_argument("--tune-router", type=int, default=0, metavar="EPOCHS")
    parser.add_argument("--transfer-rerankers", default="none,fusion")
    args = parser.parse_args(argv)

    import django

    django.setup()
    dataset, simulation = federation_simulation(
        args, "transfer_centralized", test_limit=args.test_limit,
        transfer_models=tuple(m for m in args.transfer_models.split(",") if m),
        transfer_rerankers=tuple(r for r in args.transfer_rerankers.split(",") if r),
        tune_router_epochs=args.tune_router,
    )
    from routing.embeddings import EmbeddingModelUnavailable
    from routing.llm import LLMUnavailable

    try:  # an unknown reranker, a model that cannot load: one line, as simulate says it
        variants = simulation.transfer_variants() if simulation.config.transfer_models else []
    except (ValueError, EmbeddingModelUnavailable, LLMUnavailable) as exc:
        raise SystemExit(f"transfer_centralized: {exc}") from None
    if not variants and not args.tune_router:
        parser.error("nothing to score: give --transfer-models and/or --tune-router")
    from federation.simulation.report import code_revision, host

    # Where it ran and on which code, read before the seeds run: simulate's documents say the same.
    facts = host(simulation.engine, code_revision())
    rows = []
    started = time.perf_counter()
    for seed in range(args.seed, args.seed + max(1, args.seeds)):
        setup = simulation.prepare(seed)
        simulation.progress(f"seed {seed}: the centralized compendium")
        central = simulation.centralized_global(setup.shares, setup.logs, setup.split, seed)
        report = simulation.evaluate(simulation.router(central, setup.split.probe), setup.test)
        rows.append({"seed": seed, "model": "simulation engine", "reranker": simulation.config.reranker,
                     "accuracy": round(report.accuracy, 4),
                     "macro_accuracy": round(report.macro_accuracy, 4)})
        if args.tune_router:
            tuned = simulation.tuned_router(central, setup.split.probe, seed, "centralized")
            report = simulation.evaluate(tuned, setup.test)
            rows.append({"seed": seed, "model": f"tuned router, {args.tune_router} epoch(s)",
                         "reranker": simulation.config.reranker, "accuracy": round(report.accuracy, 4),
                         "macro_accuracy": round(report.macro_accuracy, 4)})
        if variants:
            simulation.progress(f"seed {seed}: transfer to {len(variants)} variants")
            rows += [{"seed": seed, **row} for row in
                     simulation.transfer(central, setup.split.probe, setup.test, variants)]
        # Written after every seed, so that a long run stopped early keeps the seeds it finished.
        write_json(args.out, {
            "command": "python bench/transfer_centralized.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "compendium": "centralized", "rows": rows,
            "seconds": round(time.perf_counter() - started, 1), "host": facts,
        })
    print_table(rows, ["seed", "model", "reranker", "accuracy", "macro_accuracy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
