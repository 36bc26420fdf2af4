"""Shared by the routing benchmarks: repo on sys.path, a disk cache of embeddings, tables, JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CACHE_DIR = ROOT / "bench" / "out" / "embedding-cache"
# The MetaTool data in ../shared beside the checkout (or beside the folder of a git worktree).
METATOOL = next(
    (p for p in (base / "shared" / "data" / "metatool" for base in (ROOT.parent, ROOT.parent.parent))
     if p.exists()),
    ROOT.parent / "shared" / "data" / "metatool",
)


def federation_parser(description: str) -> argparse.ArgumentParser:
    """The federation options the simulation benchmarks share with `manage.py simulate`, and
    --out; each script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dataset", default=str(METATOOL))
    parser.add_argument("--orgs", type=int, default=5)
    parser.add_argument("--clients-per-org", type=int, default=4)
    parser.add_argument("--partition", default="category", choices=["iid", "category", "random"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--embedding-model", default=None)
    parser.add_argument("--out", default=None)
    return parser


def refuse_counts_below(parser: argparse.ArgumentParser, *checks: tuple[str, int, int]) -> None:
    """Each (flag, value, least): a value below its least is refused as argparse refuses a bad
    value (usage, one line naming the flag, status 2), before anything runs."""
    for flag, value, least in checks:
        if value < least:
            parser.error(f"{flag} must be at least {least}, not {value}")


def check_out(path: str | None, name: str, flag: str = "--out") -> None:
    """Stop the script `name`, before anything runs, with one line for an --out it could not
    write at its end (a folder, a parent that is a file, a folder it cannot write to...), as
    `manage.py simulate` refuses it (`out_file_problem`); creates a missing parent folder, as
    simulate does."""
    from compendium.client_api import out_file_problem

    problem = out_file_problem(path, flag) if path else None
    if problem:
        raise SystemExit(f"{name}: {problem}")


def read_dataset(folder, name: str):
    """`compendium.registry.load_dataset(folder)`, or, for a dataset it cannot read (no folder, a
    line that is not JSON, a query of a tool the registry lacks...), the script `name` stopped
    with one line saying why, as `manage.py simulate` reports it."""
    from compendium.registry import RegistryFormatError, load_dataset

    try:
        return load_dataset(folder)
    except RegistryFormatError as exc:
        raise SystemExit(f"{name}: {exc}") from None


def check_testable(dataset, seeds, name: str, *, probe_fraction: float, test_fraction: float) -> None:
    """Stop the script `name` with one line where the fractions leave no train split, or where
    a seed's split holds no held-out query (every tool has fewer than `TESTED_FROM` distinct
    queries, the words of simulate's refusal): an accuracy over no query is nan, and NaN is not
    JSON. For the scripts that split the dataset but play no federation."""
    from compendium.registry import stratified_split
    from federation.simulation.data import TESTED_FROM

    for seed in seeds:
        try:
            split = stratified_split(dataset.queries, seed=seed, probe_fraction=probe_fraction,
                                     test_fraction=test_fraction)
        except ValueError as exc:
            raise SystemExit(f"{name}: {exc} (probe {probe_fraction:g}, test {test_fraction:g})") from None
        if not split.test:
            raise SystemExit(f"{name}: the dataset {dataset.name} has no tool with {TESTED_FROM} "
                             "or more distinct queries: nothing to test on")


def load_engine(model: str | None, name: str, flag: str = "--embedding-model",
                takes: str | None = None):
    """`routing.embeddings.get_engine(model)`, or, for a model that cannot be loaded, the script
    `name` stopped with one line naming the model and what `flag` takes (`takes`; default, as
    `manage.py simulate` reports it, every model name the engine loads), as simulate reports it
    (without `model`, the setting's model: the line says what to set)."""
    from federation.simulation.runner import MODEL_NAMES, unavailable_model
    from routing.embeddings import EmbeddingModelUnavailable, get_engine

    try:
        return get_engine(model)
    except EmbeddingModelUnavailable as exc:
        if not model:
            raise SystemExit(f"{name}: {exc}") from None
        raise SystemExit(
            f"{name}: {unavailable_model(model, exc, f'{flag} takes {takes or MODEL_NAMES}')}"
        ) from None


def federation_simulation(args, name: str, **config):
    """(dataset, `federation.simulation.runner.Simulation`) for the options `federation_parser`
    reads (dataset, orgs, clients per org, partition, seeds, embedding model), with `config`'s
    `SimulationConfig` fields on top, reporting progress on stderr as `name`. A dataset that
    cannot be read, or that `simulate` refuses for this federation
    (`federation.simulation.data.federation_problem`, on every seed the script plays), stops
    the script with one line, before the model loads; so does a model that cannot be loaded, and,
    first, an `--out` it could not write (`check_out`). Needs Django set up."""
    from compendium.schema import Schema
    from federation.simulation.data import federation_problem
    from federation.simulation.runner import Simulation, SimulationConfig

    check_out(getattr(args, "out", None), name)
    dataset = read_dataset(args.dataset, name)
    settings = SimulationConfig(
        orgs=args.orgs, clients_per_org=args.clients_per_org, partition=args.partition, **config
    )
    seeds = range(args.seed, args.seed + max(1, getattr(args, "seeds", 1)))
    try:
        problem = federation_problem(
            dataset, seeds, orgs=settings.orgs, clients_per_org=settings.clients_per_org,
            partition=settings.partition, probe_fraction=settings.probe_fraction,
            test_fraction=settings.test_fraction, drift_every=settings.drift_every,
        )
    except ValueError as exc:  # no organization or client (partition_train)
        problem = str(exc)
    if problem:
        raise SystemExit(f"{name}: {problem}")
    simulation = Simulation(
        dataset, Schema(tools=dataset.tools), load_engine(args.embedding_model, name), settings,
        lambda message: print(f"{name}: {message}", file=sys.stderr, flush=True),
    )
    return dataset, simulation


def played_rounds(simulation, first_seed: int, seeds: int):
    """Each round of the federation `manage.py simulate` plays for each seed, as
    (seed, outcome, probe, base): `outcome` the round's `federate` result (the clients'
    submissions, the global it published), `probe` the public probe set's requests and `base` the
    schema (round 1) or the global the clients pulled (later rounds), both as dcz dictionaries.
    What a client ships against: probe + base in round 1, base later. Needs Django set up."""
    from compendium import transport
    from federation.simulation.runner import probe_requests

    for seed in range(first_seed, first_seed + max(1, seeds)):
        setup = simulation.prepare(seed)
        outcomes = simulation.federate(setup.shares, setup.logs, setup.split.probe, seed)
        probe = transport.probe_bytes(probe_requests(setup.split.probe))
        pulled = None
        for outcome in outcomes:
            base = (
                transport.schema_dictionary(simulation.schema) if pulled is None
                else transport.global_dictionary(pulled)
            )
            yield seed, outcome, probe, base
            pulled = outcome.global_compendium


def sent_compendiums(outcome) -> list:
    """The compendiums a round's clients put on the wire: a client with nothing to submit sends
    nothing (`synapse-client participate`), and `manage.py simulate` measures no body for it."""
    from compendium.client_api import nothing_to_submit

    return [c for c in outcome.submissions.values() if not nothing_to_submit(c)]


def body_mean(rows: list[dict], column: str) -> float:
    """`column`'s mean over the rows that have it, each row weighted by its bodies
    (`clients`): per client per round over all rounds, as simulate's bytes figures."""
    pairs = [(row[column], row["clients"]) for row in rows if column in row]
    return round(float(np.average([v for v, _ in pairs], weights=[w for _, w in pairs])), 1)


def cached_embed(engine, texts: list[str]) -> np.ndarray:
    """Embeddings of many texts, kept on disk per model so that reruns skip the model."""
    from routing.embeddings import embed_cached

    return embed_cached(engine, texts, CACHE_DIR)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.1f}"
    return "-" if value is None else str(value)


def write_json(path: str | None, document: list[dict] | dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")


def record_wrapper(out: str | None, script: str, argv: list[str], **extra) -> None:
    """Mark the `simulate --out` document written under a bench wrapper: the wrapper's own
    command line replaces simulate's, and `extra` says what the wrapper changed."""
    if not out:
        return
    path = Path(out)
    document = json.loads(path.read_text())
    document["command"] = f"python bench/{script} " + " ".join(argv)
    document.update(extra)
    path.write_text(json.dumps(document, indent=2) + "\n")
