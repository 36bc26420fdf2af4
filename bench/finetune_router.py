"""SYNAPSE's final global routed with a MiniLM fine-tuned on it: does a routing encoder that learns
from the published compendium lift top-1 past what the frozen model reaches?

For each seed: the same split, shares, usage logs and federation as `manage.py simulate`
(`Simulation.prepare`, `Simulation.federate`), then the final global compendium routed three ways,
each with the simulation's router (fusion, linear head, weights cross-fitted on the probe split):

- `simulation engine`: the engine the federation ran with (simulate's round-3 `synapse` row);
- `minilm fp32`: the bundled all-MiniLM-L6-v2 in fp32, unchanged (the control for the next row);
- `minilm fine-tuned`: the same model fine-tuned on what the server holds after publishing: the
  global's scenarios (as the engine reads them, without masking placeholders) and the tool
  descriptions it publishes, labelled with their tools, plus, with `--probe-rows learn-half`,
  the half of the public probe split that the router's head learns from (never the half its
  fusion weights are fitted on, never test data), by `routing.finetune.fine_tune_encoder`,
  `--epochs`. The fine-tuned model then embeds the
  scenarios, the probe and the queries, as any other model would (`--embedding-model PATH`).

Nothing here changes what clients send: only the server's routing model differs.

    python bench/finetune_router.py --dataset ../shared/data/metatool --seed 0 --seeds 1 \\
        --test-limit 3000 --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 \\
        [--epochs 1] [--probe-rows none|learn-half] [--threads 1] --out FILE
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

# _routing_common also puts the repository on sys.path.
from _routing_common import federation_parser, federation_simulation, print_table, write_json

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def score(simulation, final, setup, seed: int, name: str, engine, **extra) -> dict:
    """One row: `final` routed by the simulation's router with `engine`, on the seed's test."""
    simulation.progress(f"seed {seed}: routing with {name}")
    report = simulation.evaluate(simulation.router(final, setup.split.probe, engine=engine), setup.test)
    return {"seed": seed, "model": name, "accuracy": round(report.accuracy, 4),
            "macro_accuracy": round(report.macro_accuracy, 4), **extra}


def main(argv: list[str] | None = None) -> int:
    parser = federation_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--test-limit", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--probe-rows", choices=["none", "learn-half"], default="none")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)

    import django
    import torch

    django.setup()
    if args.threads:
        torch.set_num_threads(args.threads)
    from routing.embeddings import DEFAULT_MODEL, get_engine
    from routing.finetune import fine_tune_encoder, tuning_rows
    from routing.router import probe_halves

    dataset, simulation = federation_simulation(args, "finetune_router", test_limit=args.test_limit)
    rows = []
    started = time.perf_counter()
    for seed in range(args.seed, args.seed + max(1, args.seeds)):
        setup = simulation.prepare(seed)
        outcomes = simulation.play(setup, seed)
        final = outcomes[-1].global_compendium
        probe = setup.split.probe

        rows.append(score(simulation, final, setup, seed, "simulation engine", simulation.engine))
        rows.append(score(simulation, final, setup, seed, "minilm fp32", get_engine(DEFAULT_MODEL)))
        examples = []
        if args.probe_rows == "learn-half":
            learn, _ = probe_halves(len(probe))  # the half the router's head learns from
            examples = [(probe[i].query, probe[i].tool_id) for i in learn]
        texts, labels = tuning_rows(final, examples)
        simulation.progress(f"seed {seed}: fine-tuning on {len(texts)} rows, {args.epochs} epoch(s)")
        tuned_at = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="synapse-finetuned-") as path:
            fine_tune_encoder(texts, labels, path, epochs=args.epochs, seed=seed)
            seconds = round(time.perf_counter() - tuned_at, 1)
            rows.append(score(
                simulation, final, setup, seed, "minilm fine-tuned", get_engine(path),
                rows_tuned_on=len(texts), epochs=args.epochs, probe_rows=args.probe_rows,
                fine_tune_seconds=seconds,
            ))
        # Written after every seed, so that a long run stopped early keeps the seeds it finished.
        write_json(args.out, {
            "command": "python bench/finetune_router.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "dataset": dataset.name, "rows": rows, "seconds": round(time.perf_counter() - started, 1),
        })
    print_table(rows, ["seed", "model", "accuracy", "macro_accuracy", "rows_tuned_on", "fine_tune_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
