"""The server's router tuning (`routing.finetune.tune_router`, what the GPU worker runs after each
publish) on the device you name: how long it takes and what top-1 it gives on held-out queries.

Two steps, so that the one on the accelerator needs neither Django nor a database:

- `export`: the federation of `manage.py simulate` for one seed (`Simulation.prepare`, `.play`),
  then saved in DIR: its final SYNAPSE global and the Centralized global (canonical JSON), the
  public probe split and a sample of the test split (JSON lines).
- `tune`: for each saved global, `tune_router(..., device=D)` (fine-tune on the global and the
  probe's learn half, re-embed, refit the router on the other half, save it with its manifest and
  weight deltas), then top-1 on the saved test sample for the tuned router and for the frozen one
  (`fit_router` on the base model), and a check that the saved folder loads back
  (`load_tuned_router`: the engine serves on the CPU) and routes as the router it was saved from.

    python bench/tune_device.py export --dataset ../shared/data/metatool --seed 0 \\
        --test-limit 3000 --dir DIR
    python bench/tune_device.py tune --dir DIR --device cuda [--base-model PATH] [--epochs 1] \\
        [--out FILE]

`--base-model`: a sentence-transformers folder to start from (default: the bundled MiniLM in fp32).

Checked before anything long runs, each in one line: `export`'s --dir (a folder it can write) and
dataset, `tune`'s --out, --dir (every file `export` wrote there, read), --device and --base-model
(loaded, as `load_engine` loads an embedding model; not an inference build of MiniLM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# _routing_common also puts the repository on sys.path.
from _routing_common import check_out, federation_simulation, load_engine, print_table, write_json

GLOBALS = ("synapse", "centralized")
DIR_HINT = "give the folder `tune_device.py export --dir` wrote"
BASE_MODELS = (
    "a sentence-transformers folder or name (default: the bundled MiniLM in fp32, "
    "bundled:all-MiniLM-L6-v2)"
)


def export(args) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    import django

    django.setup()
    from compendium.canonical import canonical_bytes

    # Before the federation plays: the folder is written at its end.
    check_out(str(Path(args.dir) / "export.json"), "tune_device", "--dir")
    dataset, simulation = federation_simulation(args, "tune_device", test_limit=args.test_limit)
    setup = simulation.prepare(args.seed)
    outcomes = simulation.play(setup, args.seed)
    central = simulation.centralized_global(setup.shares, setup.logs, setup.split, args.seed)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "synapse.json").write_bytes(canonical_bytes(outcomes[-1].global_compendium))
    (out / "centralized.json").write_bytes(canonical_bytes(central))
    for name, rows in (("probe", setup.split.probe), ("test", setup.test)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for q in rows:
                handle.write(json.dumps({"query": q.query, "tool_id": q.tool_id, "category": q.category}) + "\n")
    (out / "export.json").write_text(json.dumps({
        "command": "python bench/tune_device.py " + " ".join(sys.argv[1:]),
        "dataset": dataset.name, "seed": args.seed, "rounds": len(outcomes),
        "probe": len(setup.split.probe), "test": len(setup.test),
    }, indent=1))
    print(f"wrote {out}: {len(setup.split.probe)} probe and {len(setup.test)} test requests")
    return 0


def _read(folder: str, name: str) -> str:
    try:
        return (Path(folder) / name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise SystemExit(f"tune_device: --dir {folder}: cannot read {name} ({why})") from None


def _requests(folder: str, name: str) -> list[dict]:
    """The requests of the export's `name` (JSON lines of query, tool_id), or the script stopped
    with one line naming the line that is not one."""
    rows = []
    for number, line in enumerate(_read(folder, name).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SystemExit(
                f"tune_device: --dir {folder}: {name} line {number} is not JSON "
                f"({exc.msg} at column {exc.colno})"
            ) from None
        if not (isinstance(row, dict) and isinstance(row.get("query"), str)
                and isinstance(row.get("tool_id"), str)):
            raise SystemExit(
                f"tune_device: --dir {folder}: {name} line {number} is not a request with a "
                "query and a tool_id"
            )
        rows.append(row)
    return rows


def read_export(folder: str, globals_: list[str]):
    """(probe, test, {global: compendium}, export.json) of the folder `export` wrote, every file
    read, or the script stopped with one line saying what is missing or wrong."""
    from pydantic import ValidationError

    from compendium.schema import Compendium

    if not Path(folder).exists():
        raise SystemExit(f"tune_device: --dir {folder}: no such folder; {DIR_HINT}")
    if not Path(folder).is_dir():
        raise SystemExit(f"tune_device: --dir {folder} is not a folder; {DIR_HINT}")
    names = ["probe.jsonl", "test.jsonl", *(f"{which}.json" for which in globals_), "export.json"]
    missing = [name for name in names if not (Path(folder) / name).is_file()]
    if missing:
        raise SystemExit(f"tune_device: --dir {folder} has no {', '.join(missing)}; {DIR_HINT}")
    probe = [(row["query"], row["tool_id"]) for row in _requests(folder, "probe.jsonl")]
    test = _requests(folder, "test.jsonl")
    if not test:
        raise SystemExit(f"tune_device: --dir {folder}: test.jsonl holds no request")
    compendiums = {}
    for which in globals_:
        try:
            compendiums[which] = Compendium.model_validate_json(_read(folder, f"{which}.json"))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise SystemExit(
                f"tune_device: --dir {folder}: {which}.json is not a compendium "
                f"({where + ': ' if where else ''}{error['msg']})"
            ) from None
    try:
        exported = json.loads(_read(folder, "export.json"))
    except ValueError as exc:
        raise SystemExit(f"tune_device: --dir {folder}: export.json is not JSON ({exc})") from None
    return probe, test, compendiums, exported


def top1(router, test: list[dict]) -> tuple[float, list[str]]:
    decisions = router.route_batch([row["query"] for row in test])
    chosen = [d.tool or "" for d in decisions]
    hits = sum(c == row["tool_id"] for c, row in zip(chosen, test, strict=True))
    return hits / len(test), chosen


def tune(args) -> int:
    check_out(args.out, "tune_device")
    probe, test, compendiums, exported = read_export(args.dir, args.globals.split(","))
    import torch

    from routing.embeddings import BF16_PREFIX, DEFAULT_MODEL, MINILM_BUILDS, EmbeddingEngine
    from routing.finetune import load_tuned_router, tune_router
    from routing.router import Router, fit_router

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"tune_device: --device {device}, but this torch ({torch.__version__}) sees no CUDA "
            "device (a CPU-only build, or no GPU on this machine); run `tune` where one is, or "
            "give --device cpu"
        )
    base_model = args.base_model or DEFAULT_MODEL
    if base_model.startswith(BF16_PREFIX) or base_model in MINILM_BUILDS - {"", DEFAULT_MODEL}:
        raise SystemExit(
            f"tune_device: --base-model {base_model!r} is a build of MiniLM to embed with, which "
            f"fine-tuning cannot start from; --base-model takes {BASE_MODELS}"
        )
    load_engine(base_model, "tune_device", "--base-model", takes=BASE_MODELS)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    environment = {
        "device": device, "device_name": name, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
    }
    print(f"tune_device: {environment}", file=sys.stderr, flush=True)
    rows = []
    for which, compendium in compendiums.items():
        # A fresh engine (no vector cached from the previous global): the fit is timed.
        frozen_engine = EmbeddingEngine(base_model)
        started = time.perf_counter()
        frozen = fit_router(compendium, frozen_engine, probe, fit_limit=1000, fitted_on="probe split")
        frozen_seconds = time.perf_counter() - started
        frozen_accuracy, _ = top1(frozen, test)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory(prefix="synapse-tune-device-") as path:
            tuned = tune_router(
                compendium, probe, path, epochs=args.epochs, seed=args.seed,
                base_model=args.base_model, device=device,
            )
            tuned_accuracy, chosen = top1(tuned.router, test)
            # What the routing service builds from the folder (federation.tuning's reader).
            loaded = load_tuned_router(path)
            reloaded = Router(
                compendium, loaded.engine, "fusion", head=loaded.head, params=loaded.params,
                scenario_embeddings=loaded.scenario_embeddings,
                precaution_embeddings=loaded.precaution_embeddings,
            )
            reloaded_accuracy, rechosen = top1(reloaded, test)
        rows.append({
            "global": which, "device": device, "scenarios": len(compendium.scenarios),
            "rows_tuned_on": tuned.rows, "epochs": args.epochs,
            "tune_seconds": round(tuned.seconds, 1),
            "fine_tune_seconds": round(tuned.fine_tune_seconds, 1), "frozen_fit_seconds": round(frozen_seconds, 1),
            "frozen_accuracy": round(frozen_accuracy, 4), "tuned_accuracy": round(tuned_accuracy, 4),
            "gain_points": round(100 * (tuned_accuracy - frozen_accuracy), 1),
            "peak_gpu_mib": (
                round(torch.cuda.max_memory_allocated() / 2**20) if device.startswith("cuda") else None
            ),
            "reloaded_accuracy": round(reloaded_accuracy, 4),
            "reloaded_same_choices": sum(a == b for a, b in zip(chosen, rechosen, strict=True)) / len(test),
        })
        print_table(rows[-1:], list(rows[-1]))
    print_table(rows, ["global", "device", "fine_tune_seconds", "tune_seconds", "frozen_accuracy", "tuned_accuracy",
                       "gain_points", "reloaded_same_choices"])
    write_json(args.out, {
        "command": "python bench/tune_device.py " + " ".join(sys.argv[1:]),
        "export": exported, "environment": environment, "test": len(test), "rows": rows,
    })
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    ex = steps.add_parser("export", help="run the federation and save its globals, probe and test")
    ex.add_argument("--dataset", default="../shared/data/metatool")
    ex.add_argument("--orgs", type=int, default=5)
    ex.add_argument("--clients-per-org", type=int, default=4)
    ex.add_argument("--partition", choices=["iid", "category", "random"], default="category")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--test-limit", type=int, default=3000)
    ex.add_argument("--embedding-model", default=None)
    ex.add_argument("--dir", required=True)
    tu = steps.add_parser("tune", help="tune the router on each saved global on --device")
    tu.add_argument("--dir", required=True)
    tu.add_argument("--device", default="cuda", help="a torch device: cuda, cuda:1, cpu")
    tu.add_argument("--base-model", default=None, help=BASE_MODELS)
    tu.add_argument("--epochs", type=int, default=1)
    tu.add_argument("--seed", type=int, default=0)
    tu.add_argument("--globals", default=",".join(GLOBALS))
    tu.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return export(args) if args.step == "export" else tune(args)


if __name__ == "__main__":
    sys.exit(main())
