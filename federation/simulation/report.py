"""Running a simulation over several seeds and summarizing it: the JSON document the `simulate`
command writes and the dashboard draws, and the table it prints. Pure."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import platform
import subprocess
import time
import types
import typing
from collections import Counter, defaultdict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from federation.merge.summarize import LLM_SUMMARIZERS, fallback_kinds, summary_counts
from federation.simulation.runner import (
    METHODS,
    SCREENING_KEYS,
    TARGETING_KEYS,
    SeedResult,
    Simulation,
    SimulationConfig,
    adversary_count,
)


class PlayedRuns:
    """The federations a `simulate` command has played, by configuration: a sweep variant that is
    the main run's configuration (or an earlier sweep's) reuses its seeds instead of playing the
    same deterministic federation again."""

    def __init__(self) -> None:
        self._played: list[tuple[SimulationConfig, dict[int, SeedResult]]] = []

    def results(self, simulation: Simulation, seeds: list[int]) -> list[SeedResult]:
        played_as = _federation(simulation.config)
        by_seed = next((seen for config, seen in self._played if config == played_as), None)
        if by_seed is None:
            by_seed = {}
            self._played.append((played_as, by_seed))
        simulation.seeds = list(seeds)
        for seed in seeds:
            if seed not in by_seed:
                try:
                    by_seed[seed] = simulation.run_seed(seed)
                except ValueError as exc:  # which seed (and round) it was, not only what
                    at = f": round {simulation.at_round}" if simulation.at_round else ""
                    raise ValueError(f"{simulation.seed_name(seed)}{at}: {exc}") from exc
        return [by_seed[seed] for seed in seeds]


def _federation(config: SimulationConfig) -> SimulationConfig:
    """The configuration as far as it decides the federation played: with no adversarial client
    (the adversarial sweep's fraction 0, under every mode), what an adversary would send decides
    nothing."""
    if _adversaries(config):
        return dataclasses.replace(config)
    default = SimulationConfig()
    return dataclasses.replace(config, adversarial_mode=default.adversarial_mode,
                               camouflage_share=default.camouflage_share)


def run(simulation: Simulation, seeds: list[int], played: PlayedRuns | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    revision = code_revision()  # the code this run imported: a commit may land while it runs
    per_seed = (played or PlayedRuns()).results(simulation, seeds)
    rows = [row for result in per_seed for row in result.rows]
    return {
        "dataset": simulation.dataset.name,
        "config": dataclasses.asdict(simulation.config),
        "seeds": seeds,
        "adversarial_clients": _adversaries(simulation.config),
        "results": rows,
        "summary": summarize(rows),
        "per_category": pooled_per_category([r.per_category for r in per_seed]),
        "communication": _mean_dicts([r.communication for r in per_seed]),
        "privacy": _mean_dicts([r.privacy for r in per_seed]),
        "diagnostics": _mean_dicts([r.diagnostics for r in per_seed]),
        "rounds": [r.rounds for r in per_seed],
        "transfer": [row for result in per_seed for row in result.transfer],
        "screening": _sums([r.screening for r in per_seed], SCREENING_KEYS),
        "targeting": _targeting_sums([r.targeting for r in per_seed]),
        "seconds": round(time.perf_counter() - started, 1),
        "host": host(simulation.engine, revision),
    }


# CPU features that change what the int8 embedding kernels compute (onnxruntime picks its MatMul
# kernels by them) or what the bf16 engine runs on.
_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


# Embedded once per run: two runs whose engines give this text bit-identical vectors compute the
# same embeddings; a different fingerprint on the same code explains figures that moved.
FINGERPRINT_TEXT = "Find me a cheap flight to Lisbon next Friday and book a hotel near the beach"


def host(engine=None, revision: str | None = None) -> dict[str, Any]:
    """What a run's figures depend on besides the code and the seeds: the same code and packages
    give slightly different int8 MiniLM embeddings on other hosts (see the README, "Reproducing
    the figures on another host"), so a document says where it ran and, given the run's
    embedding `engine`, a fingerprint of what that engine computes there, and the git commit
    `revision` it ran (`code_revision()`, read when the run started)."""
    cpu, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not cpu:
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux
        cpu = platform.processor()
    versions = {}
    for package in ("onnxruntime", "torch", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    facts = {
        "cpu": cpu or platform.machine(),
        "isa": [flag for flag in _ISA_FLAGS if flag in flags],
        "python": platform.python_version(),
        **versions,
    }
    if revision:
        facts["code"] = revision
    if engine is not None:
        vector = np.ascontiguousarray(engine.embed([FINGERPRINT_TEXT])[0], dtype=np.float32)
        facts["embedding_model"] = engine.model_name
        facts["embedding_fingerprint"] = hashlib.sha256(vector.tobytes()).hexdigest()[:16]
    return facts


def code_revision() -> str | None:
    """The git commit the running code is checked out at, with "+" when tracked files differ
    from it (a run of uncommitted code): runs joined by `--combine`, or compared across days,
    say whether they ran the same code. None outside a git checkout (an installed package)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+" if changed else "")) if head else None


def code_revisions(doc: dict[str, Any]) -> list[str]:
    """The code revisions a document's runs name, each once, in order (documents written before
    runs recorded theirs name none)."""
    return list(dict.fromkeys(h["code"] for h in _hosts(doc) if isinstance(h, dict) and h.get("code")))


def _targeting_sums(items: list[dict]) -> dict[str, int]:
    """The targeting counts added up, where every item has them (a run written before they were
    counted has none: a sum over some of the seeds would read as all of them)."""
    if not items or not all(k in item for item in items for k in TARGETING_KEYS):
        return {}
    return _sums(items, TARGETING_KEYS)


def _sums(items: list[dict[str, int]], keys: tuple[str, ...]) -> dict[str, int]:
    """The counts of `keys` added up over `items` (the keys none of them has left out)."""
    return {k: int(sum(item.get(k, 0) for item in items)) for k in keys
            if any(k in item for item in items)}


# Each sweep section and the settings its rows vary (every row names its variant by them).
SWEEP_VARIANTS = {
    "privacy_sweep": ("epsilon", "mask_strength"),
    "release_sweep": ("min_users",),
    "adversarial": ("adversarial_mode", "adversarial_fraction", "robust_rule"),
    "tau_sweep": ("tau",),
    "summarizer_sweep": ("summarizer",),
    "cadence": ("aggregate_every",),
    "contradictions": ("contradiction_fraction", "conflict_log"),
}
SWEEP_SECTIONS = tuple(SWEEP_VARIANTS)


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A document's configuration with every option it does not name at that option's default: a
    file written before an option existed ran as its default runs (an option is added so that its
    default keeps the behaviour there was), so it compares equal to a newer run at the default."""
    defaults = dataclasses.asdict(SimulationConfig())
    return {**{k: v for k, v in defaults.items() if k not in config}, **config}


def combine(documents: list[dict[str, Any]], sources: list[str] | None = None) -> dict[str, Any]:
    """One document from runs of the same dataset and configuration on disjoint seeds (e.g. the
    seeds of a long run split over processes or machines), as if one run had played them all:
    rows concatenated and summarized again, per-seed figures averaged with each run weighted by
    its seeds, and sweeps (the same variants in every document) joined per variant. Raises
    ValueError naming the document (by its `sources` name, e.g. its file) and what does not
    match: a document of another shape, dataset, configuration, embedding model or sweeps."""
    if not documents:
        raise ValueError("nothing to combine")
    names = list(sources) if sources else [f"document {n}" for n in range(1, len(documents) + 1)]
    for name, doc in zip(names, documents, strict=True):
        problem = _shape_problem(doc)
        if problem:
            raise ValueError(f"{name} is not a simulate --out file: {problem}")
    models = sorted({h["embedding_model"] for doc in documents for h in _hosts(doc)
                     if isinstance(h, dict) and h.get("embedding_model")})
    if len(models) > 1:
        raise ValueError(f"the runs embedded with different models ({', '.join(models)}); "
                         "combine runs of one embedding model only")
    documents = [{**doc, "config": with_defaults(doc["config"])} for doc in documents]
    first = documents[0]
    # What the runs played on (`dataset_fingerprint`; absent from documents written before it).
    fingerprinted, fingerprint = next(
        ((name, doc["dataset_fingerprint"]) for name, doc in zip(names, documents, strict=True)
         if doc.get("dataset_fingerprint")), (None, None))
    seen: dict[int, str] = {}  # each seed's document
    for name, doc in zip(names, documents, strict=True):
        if doc["dataset"] != first["dataset"]:
            raise ValueError(f"{name} is of dataset {doc['dataset']!r}, not {first['dataset']!r}")
        if fingerprint and doc.get("dataset_fingerprint") not in (None, fingerprint):
            raise ValueError(
                f"{name} is of another version of dataset {doc['dataset']!r} than {fingerprinted}: "
                "its tools or queries differ"
            )
        if doc["config"] != first["config"]:
            differ = sorted(
                k for k in set(doc["config"]) | set(first["config"])
                if doc["config"].get(k) != first["config"].get(k)
            )
            raise ValueError(f"{name} has another configuration ({', '.join(differ)})")
        swept = {k for k in SWEEP_SECTIONS if doc.get(k)}
        first_swept = {k for k in SWEEP_SECTIONS if first.get(k)}
        if swept != first_swept:
            raise ValueError(
                f"{name} has sweeps ({', '.join(sorted(swept)) or 'none'}) that "
                f"{names[0]} has not ({', '.join(sorted(first_swept)) or 'none'})"
            )
        overlap = set(seen) & set(doc["seeds"])
        if overlap:
            raise ValueError(f"{name}: seed {min(overlap)} is in {seen[min(overlap)]} too")
        seen.update(dict.fromkeys(doc["seeds"], name))
    weights = [len(doc["seeds"]) for doc in documents]

    def weighted(key: str) -> dict[str, float]:
        return _weighted_means([doc.get(key, {}) for doc in documents], weights)

    rows = [row for doc in documents for row in doc["results"]]
    sweeps = {
        name: _combine_sweep(name, [doc[name] for doc in documents], names)
        for name in SWEEP_SECTIONS
        if first.get(name)
    }
    return {
        "dataset": first["dataset"],
        **({"dataset_fingerprint": fingerprint} if fingerprint else {}),
        "config": first["config"],
        "seeds": [seed for doc in documents for seed in doc["seeds"]],
        "results": rows,
        "summary": summarize(rows),
        "per_category": pooled_per_category([doc.get("per_category") or {} for doc in documents]),
        "communication": weighted("communication"),
        "privacy": weighted("privacy"),
        "diagnostics": weighted("diagnostics"),
        "rounds": [r for doc in documents for r in doc.get("rounds", [])],
        "transfer": [row for doc in documents for row in doc.get("transfer", [])],
        "screening": _sums([doc.get("screening", {}) for doc in documents], SCREENING_KEYS),
        "targeting": _targeting_sums([doc.get("targeting") or {} for doc in documents]),
        "seconds": round(sum(float(doc.get("seconds", 0.0)) for doc in documents), 1),
        **({"adversarial_clients": first["adversarial_clients"]}
           if "adversarial_clients" in first else {}),
        "combined_from": [doc.get("command", "") for doc in documents],
        # Each run's host, in order (None: written before documents said where they ran); a
        # document that is itself combined brings its runs' hosts.
        "hosts": [h for doc in documents for h in _hosts(doc)],
        **sweeps,
    }


def _adversaries(config: SimulationConfig) -> int:
    """How many of the federation's clients played adversarial (the fraction, rounded)."""
    return adversary_count(config.orgs * config.clients_per_org, config.adversarial_fraction)


def _hosts(doc: dict[str, Any]) -> list:
    """Where a document's runs ran: a combined document's hosts, or its own."""
    return doc["hosts"] if doc.get("hosts") is not None else [doc.get("host")]


def _shape_problem(doc: Any) -> str | None:
    """What keeps `doc` from being combined as a simulate document (None: nothing)."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    kinds = {"dataset": (str, "string"), "config": (dict, "object"), "seeds": (list, "list"),
             "results": (list, "list")}
    for key, (kind, named) in kinds.items():
        if key not in doc:
            return f"no {key!r}"
        if not isinstance(doc[key], kind):
            return f"{key!r} is not a JSON {named}"
    if not isinstance(doc.get("dataset_fingerprint", ""), str):
        return "'dataset_fingerprint' is not a JSON string"
    if not all(_whole(seed) for seed in doc["seeds"]):
        return "'seeds' holds something other than whole numbers"
    if not doc["seeds"]:
        return "'seeds' is empty"
    if len(set(doc["seeds"])) < len(doc["seeds"]):
        return "'seeds' names a seed twice"
    for number, row in enumerate(doc["results"], start=1):
        if not isinstance(row, dict) or not isinstance(row.get("method"), str):
            return f"result {number} has no 'method'"
        figures = [row.get(k, "absent") for k in ("accuracy", "macro_accuracy")]
        if not (all(map(_number, figures)) or figures == [None, None]):  # null: not measured
            return f"result {number} has no 'accuracy' and 'macro_accuracy' figures"
        if "round" not in row:  # summarized per (method, round); null: a method of no rounds
            return f"result {number} has no 'round'"
        if not (row["round"] is None or _whole(row["round"])):
            return f"result {number} has a 'round' that is not a whole number"
        if "seed" not in row:  # a row of no seed: the combined results could not say whose
            return f"result {number} has no 'seed'"
        if row["seed"] not in doc["seeds"]:
            return f"result {number} is of seed {row['seed']!r}, not one of its 'seeds'"
    for key in ("communication", "privacy", "diagnostics", "per_category", "screening", "targeting",
                "host"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            return f"{key!r} is not a JSON object"
    for key in ("communication", "privacy", "diagnostics"):  # averaged: numbers (None: none)
        for name, value in (doc.get(key) or {}).items():
            if value is not None and not _number(value):
                return f"{key!r} has {name!r} that is not a number"
    for name in doc.get("communication") or {}:  # the table orders them by their round
        if name.startswith("bytes_round_") and not name.removeprefix("bytes_round_").isdecimal():
            return f"'communication' has {name!r}, not a round's figure"
    missing = [name for name in COMMUNICATION_FIGURES if name not in (doc.get("communication") or {})]
    if missing:  # every run writes them (null: no client sent anything); the table prints them
        return f"'communication' has no {' and '.join(map(repr, missing))}"
    for key, first, then in _PRINTED_TOGETHER:  # the printed table reads them together
        section = doc.get(key) or {}
        missing = [name for name in then if section.get(name) is None]
        # (None together: not measured, e.g. no client's membership could be scored)
        measured = (len(missing) < len(then) if first is None
                    else section.get(first) is not None)
        if measured and missing:
            return f"{key!r} has no {' and '.join(map(repr, missing))}"
    for category, row in (doc.get("per_category") or {}).items():
        if not (isinstance(row, dict) and _number(row.get("accuracy")) and _whole(row.get("n"))):
            return f"'per_category' has {category!r} without an 'accuracy' and a whole 'n'"
    if "seconds" in doc and not _number(doc["seconds"]):  # added up
        return "'seconds' is not a number"
    for name, value in doc["config"].items():  # what the dashboard reads of the stored run
        hint = _CONFIG_TYPES.get(name)
        if hint is not None and not _fits(value, hint):
            return f"'config' has {name!r} that is not {_kind(hint)}"
    if not all(h is None or isinstance(h, dict) for h in doc.get("hosts") or []):
        return "'hosts' holds something other than objects"
    for key in ("screening", "targeting"):  # counts: added up
        for name, value in (doc.get(key) or {}).items():
            if not _whole(value):
                return f"{key!r} has {name!r} that is not a whole number"
    for key in ("rounds", "transfer", "hosts", *SWEEP_SECTIONS):
        if doc.get(key) is not None and not isinstance(doc[key], list):
            return f"{key!r} is not a JSON list"
    for number, row in enumerate(doc.get("transfer") or [], start=1):  # summarize_transfer's
        if not (isinstance(row, dict) and isinstance(row.get("model"), str)
                and isinstance(row.get("reranker"), str)
                and all(_number(row.get(k)) for k in ("accuracy", "macro_accuracy"))):
            return (f"transfer row {number} has no 'model' and 'reranker' or no 'accuracy' and "
                    "'macro_accuracy' figures")
    for key in SWEEP_SECTIONS:  # _combine_sweep's
        for number, row in enumerate(doc.get(key) or [], start=1):
            if not isinstance(row, dict):
                return f"{key!r} row {number} is not a JSON object"
            if not (_whole(row.get("seeds")) and _number(row.get("accuracy"))):
                return f"{key!r} row {number} has no whole 'seeds' and 'accuracy' figure"
            missing = [name for name in SWEEP_VARIANTS[key] if name not in row]
            if missing:  # the printed table and the dashboard read the variant by them
                return f"{key!r} row {number} has no {' and '.join(map(repr, missing))}"
            pairs = row.get("accuracy_by_seed", [])
            if not (isinstance(pairs, list) and all(
                    isinstance(p, list) and len(p) == 2 and _whole(p[0]) and _number(p[1])
                    for p in pairs)):
                return (f"{key!r} row {number} has 'accuracy_by_seed' that is not a list of "
                        "[seed, accuracy] pairs")
    return None


# The bytes a client sent per round, raw and gzipped: every run since the first writes them (the
# dcz figure came later), and `table` prints them.
COMMUNICATION_FIGURES = ("bytes_per_client_round", "gzip_bytes_per_client_round")

# The configuration's settings and their types, as a document's 'config' must hold them.
_CONFIG_TYPES = typing.get_type_hints(SimulationConfig)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON `value` is of the type `hint` of a SimulationConfig field."""
    if isinstance(hint, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:  # a list in JSON
        return isinstance(value, list | tuple) and all(
            _fits(v, typing.get_args(hint)[0]) for v in value)
    return {type(None): value is None, bool: isinstance(value, bool), int: _whole(value),
            float: _number(value), str: isinstance(value, str)}.get(hint, True)


def _kind(hint: Any) -> str:
    """A SimulationConfig field's type in words."""
    if isinstance(hint, types.UnionType):
        return " or ".join(_kind(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_kind(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return {type(None): "null", bool: "true or false", int: "a whole number", float: "a number",
            str: "a string"}.get(hint, str(hint))


# (section, a figure or None for any, the figures `table` prints where it is): a run writes
# them together.
_PRINTED_TOGETHER = (
    ("privacy", None, ("membership_auroc", "token_overlap", "share_clients_overlap_below_0_10")),
    ("privacy", "token_overlap_excess",
     ("token_overlap_nonmember", "share_clients_excess_below_0_10")),
    ("diagnostics", "reranker_contraction_p99", ("decisions_unchanged_under_noise",)),
)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pooled_per_category(tables: list[dict[str, dict]]) -> dict[str, dict]:
    """The final round's per-category accuracy over every seed's test queries: each seed's
    table weighted by its queries in the category (`n`, summed), so that the table belongs to
    all the seeds the figures beside it are mean ± sd over, not to the last one."""
    hits: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for per_category in tables:
        for category, row in per_category.items():
            hits[category] += row["accuracy"] * row["n"]
            counts[category] += row["n"]
    return {c: {"accuracy": round(hits[c] / counts[c], 4) if counts[c] else 0.0, "n": counts[c]}
            for c in sorted(counts)}


def _final_synapse_accuracy(result: SeedResult) -> float:
    """A seed's SYNAPSE accuracy at its final round (not whichever row came last: through the
    services that is synapse_served, with --tune-router in memory synapse_untuned)."""
    return max((row for row in result.rows if row["method"] == "synapse"),
               key=lambda row: row["round"])["accuracy"]


def _weighted_means(items: list[dict[str, float]], weights: list[int]) -> dict[str, float]:
    """Per key, the mean over the dicts that have it, each weighted (by its seeds)."""
    out = {}
    for k in sorted({k for item in items for k in item}):
        pairs = [(item[k], w) for item, w in zip(items, weights, strict=True)
                 if item.get(k) is not None]
        out[k] = (
            round(float(np.average([v for v, _ in pairs], weights=[w for _, w in pairs])), 4)
            if pairs else None
        )
    return out


def _mean_dicts(items: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per key, the mean over the dicts that have a figure for it (None: none has)."""
    keys = sorted({k for item in items for k in item})
    out = {}
    for k in keys:
        values = [item[k] for item in items if item.get(k) is not None]
        out[k] = round(float(np.mean(values)), 4) if values else None
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds, per (method, round). A row not measured (null
    figures: under drift, a round whose categories in use have no held-out query) is left out
    of the mean; `seeds` counts the seeds measured, and where none was the figures are None."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["method"], row["round"])].append(row)
    out = []
    for (method, round_), group in groups.items():
        measured = [r for r in group if r["accuracy"] is not None]
        acc = [r["accuracy"] for r in measured]
        macro = [r["macro_accuracy"] for r in measured]
        out.append(
            {
                "method": method,
                "round": round_,
                "seeds": len(measured),
                "accuracy_mean": round(float(np.mean(acc)), 4) if acc else None,
                "accuracy_sd": (round(float(np.std(acc, ddof=1)) if len(acc) > 1 else 0.0, 4)
                                if acc else None),
                "macro_accuracy_mean": round(float(np.mean(macro)), 4) if macro else None,
            }
        )
    order = {m: i for i, m in enumerate(METHODS)}
    out.sort(key=lambda r: (order.get(r["method"], 99), r["round"] or 0))
    return out


def summarize_transfer(rows: list[dict]) -> list[dict]:
    """Mean over seeds per (model, reranker, llm) of the transfer rows, in their first order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["model"], row["reranker"], row.get("llm"))].append(row)
    out = []
    for (model, reranker, llm), group in groups.items():
        acc = [r["accuracy"] for r in group]
        out.append(
            {
                "model": model,
                "reranker": reranker,
                "llm": llm,
                "seeds": len(group),
                "accuracy_mean": round(float(np.mean(acc)), 4),
                "accuracy_sd": round(float(np.std(acc, ddof=1)) if len(acc) > 1 else 0.0, 4),
                "macro_accuracy_mean": round(float(np.mean([r["macro_accuracy"] for r in group])), 4),
                "fallbacks": int(sum(r.get("fallbacks", 0) for r in group)),
                "queries": int(sum(r.get("queries", 0) for r in group)),
            }
        )
    return out


def sweep(
    make: Callable[[SimulationConfig], Simulation],
    base: SimulationConfig,
    variants: list[dict[str, Any]],
    seeds: list[int],
    played: PlayedRuns | None = None,
    name: str = "",
) -> list[dict[str, Any]]:
    """Run SYNAPSE alone (no baselines) under each variant of the configuration; one row per
    variant with final-round accuracy (mean over seeds) and the privacy figures. No transfer
    evaluation inside a sweep. With `played`, a variant already played (the main run without
    baselines, diagnostics or transfer, or another sweep's row) is not played again. With
    `name`, each variant's progress lines say which sweep and variant they belong to."""
    played = played or PlayedRuns()
    rows = []
    for number, changes in enumerate(variants, 1):
        config = dataclasses.replace(
            base, baselines=False, diagnostics=False, transfer_models=(), transfer_rerankers=(),
            **changes,
        )
        simulation = make(config)
        if name:
            described = ", ".join(f"{key}={value}" for key, value in changes.items())
            simulation.progress = functools.partial(
                _prefixed, simulation.progress, f"{name} {number}/{len(variants)} ({described})"
            )
        try:
            results = played.results(simulation, seeds)
        except ValueError as exc:
            raise ValueError(f"{name or 'sweep'} {number}/{len(variants)}: {exc}") from exc
        last = [_final_synapse_accuracy(r) for r in results]
        privacy = _mean_dicts([r.privacy for r in results])
        communication = _mean_dicts([r.communication for r in results])
        rows.append(
            {
                **changes,
                "seeds": len(seeds),
                "adversarial_clients": _adversaries(config),
                "accuracy": round(float(np.mean(last)), 4),
                "accuracy_sd": round(float(np.std(last, ddof=1)) if len(last) > 1 else 0.0, 4),
                **privacy,
                "bytes_per_client_round": communication.get("bytes_per_client_round", 0.0),
                **_mean_dicts([_merge_figures(r) for r in results]),
                "accuracy_by_seed": [[seed, acc] for seed, acc in zip(seeds, last, strict=True)],
                **_sums([r.screening for r in results], SCREENING_KEYS),
                **_targeting_sums([r.targeting for r in results]),
                "summarizer_fallback_kinds": _fallback_kinds(results),
            }
        )
    return rows


def _prefixed(progress, prefix: str, message: str) -> None:
    progress(f"{prefix}: {message}")


def _fallback_kinds(results) -> dict[str, float]:
    """How many times a summarizer fell back, by summarizer and cause, over every edge and
    server merge of a seed, mean over the seeds (as `summarizer_fallbacks`, their total;
    `federation.merge.summarize.fallback_kinds`)."""
    total: Counter = Counter()
    for result in results:
        for round_ in result.rounds:
            for stats in (round_.get("merge") or {}).values():
                total.update(fallback_kinds(stats))
    return {kind: round(n / len(results), 4) for kind, n in sorted(total.items())} if results else {}


def _merge_figures(result) -> dict[str, float]:
    """A seed's SYNAPSE accuracy per round (`accuracy_round_<r>`) and what the merges made of
    the submissions: the final global's scenarios and canonical size, the share of submitted
    scenarios merged away (`dedup_rate`), and the seconds the edge and server merges took per
    aggregating round; of the clusters of more than one text that the merges summarized
    (`summaries`, summed over every edge and server merge of the run), how many kept an LLM's text
    (`llm_summaries`) and how many times a summarizer fell back to the next one
    (`summarizer_fallbacks`)."""
    out = {
        f"accuracy_round_{row['round']}": row["accuracy"]
        for row in result.rows
        if row["method"] == "synapse"
    }
    if not result.rounds:
        return out
    final = result.rounds[-1]
    submitted = sum(r.get("scenarios_submitted", 0) for r in result.rounds)
    merged = [r for r in result.rounds if r.get("merge")]
    out["global_scenarios"] = final["global_scenarios"]
    out["global_size_bytes"] = final["global_size_bytes"]
    out["dedup_rate"] = 1.0 - final["global_scenarios"] / submitted if submitted else 0.0
    out["merge_seconds_per_round"] = (
        float(np.mean([sum(stats.get("timings_ms", {}).get("total", 0.0)
                           for stats in r["merge"].values()) / 1000 for r in merged]))
        if merged else 0.0
    )
    counts = [summary_counts(stats) for r in merged for stats in r["merge"].values()]
    for key in ("summaries", "llm_summaries", "summarizer_fallbacks"):
        out[key] = sum(c[key] or 0 for c in counts)
    return out


# What a sweep row measured; every other key of the row names its variant.
_SWEEP_FIGURES = {
    "seeds", "adversarial_clients", "accuracy", "accuracy_sd", "accuracy_by_seed",
    "membership_auroc", "token_overlap",
    "share_clients_overlap_below_0_10", "token_overlap_nonmember", "token_overlap_excess",
    "share_clients_excess_below_0_10", "bytes_per_client_round", *SCREENING_KEYS,
    *TARGETING_KEYS,
}


_MERGE_FIGURES = {
    "global_scenarios", "global_size_bytes", "dedup_rate", "merge_seconds_per_round", "summaries",
    "llm_summaries", "summarizer_fallbacks", "summarizer_fallback_kinds",
}


def _is_figure(key: str) -> bool:
    return key in _SWEEP_FIGURES or key in _MERGE_FIGURES or key.startswith("accuracy_round_")


def _variant(row: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in row.items() if not _is_figure(k)))


def _combine_sweep(name: str, sections: list[list[dict]], sources: list[str]) -> list[dict]:
    """One sweep section from the same sweep run on disjoint seeds: per variant, accuracy over
    all the seeds' final-round figures, the other figures weighted by seeds. A row of one
    document only that has no per-seed accuracies (written before they were kept) is kept as it
    was: there is nothing to pool it with, and the document stores for the dashboard."""
    variants = [[_variant(row) for row in section] for section in sections]
    if any(v != variants[0] for v in variants):
        raise ValueError(f"the {name} sweeps differ in their variants; combine the same sweep only")
    out = []
    for position, variant in enumerate(variants[0]):
        rows = [section[position] for section in sections]
        if len(rows) == 1 and "accuracy_by_seed" not in rows[0]:
            out.append(dict(rows[0]))
            continue
        old = next((source for source, row in zip(sources, rows, strict=True)
                    if "accuracy_by_seed" not in row), None)
        if old is not None:
            raise ValueError(
                f"{old}: its {name} sweep has no per-seed accuracies (written before they were "
                "kept), so it cannot be pooled with other runs; run it again to combine it, or "
                "store it alone"
            )
        pairs = [pair for row in rows for pair in row["accuracy_by_seed"]]
        accuracies = [acc for _, acc in pairs]
        weights = [row["seeds"] for row in rows]
        combined = dict(variant)
        combined["seeds"] = len(pairs)
        combined["accuracy"] = round(float(np.mean(accuracies)), 4)
        combined["accuracy_sd"] = (
            round(float(np.std(accuracies, ddof=1)), 4) if len(accuracies) > 1 else 0.0
        )
        counted = {"seeds", "accuracy", "accuracy_sd", "accuracy_by_seed",
                   "summarizer_fallback_kinds", *SCREENING_KEYS, *TARGETING_KEYS}
        combined.update(
            _weighted_means(
                [{k: v for k, v in row.items() if _is_figure(k) and k not in counted} for row in rows],
                weights,
            )
        )
        combined.update(_sums(rows, SCREENING_KEYS))  # counts add up over the seeds
        combined.update(_targeting_sums(rows))
        if any("summarizer_fallback_kinds" in row for row in rows):  # mean over all the seeds
            kinds: Counter = Counter()
            for row in rows:
                for kind, n in (row.get("summarizer_fallback_kinds") or {}).items():
                    kinds[kind] += n * row["seeds"]
            combined["summarizer_fallback_kinds"] = {
                kind: round(n / sum(weights), 4) for kind, n in sorted(kinds.items())
            }
        combined["accuracy_by_seed"] = pairs
        out.append(combined)
    return out


def final_accuracy(summary: list[dict], method: str) -> float | None:
    """The method's accuracy at its last round (or its only figure)."""
    rows = [r for r in summary if r["method"] == method]
    if not rows:
        return None
    return max(rows, key=lambda r: r["round"] or 0)["accuracy_mean"]


def _figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _spread(mean: float, sd: float, one_seed: bool) -> str:
    """A figure as mean ± sd over the seeds; with one seed there is no spread to state (0.000
    would read as none measured), so the figure alone."""
    return f"{mean:.3f}" if one_seed else f"{mean:.3f} ± {sd:.3f}"


def table(document: dict[str, Any]) -> str:
    width = max([18] + [len(row["method"]) for row in document["summary"]])
    run_seeds = len(document.get("seeds") or [])
    one_seed = run_seeds == 1
    lines = [
        f"{'method':<{width}} {'round':>5} {'accuracy':>16} {'macro':>7}",
        "-" * (width + 32),
    ]
    unmeasured = False
    for row in document["summary"]:
        if row["accuracy_mean"] is None:  # no seed had a query to score it on
            unmeasured = True
            spread, macro = "n/a", "n/a"
        else:  # over the seeds that measured it (`summarize`), as the dashboard shows it
            measured = row.get("seeds", run_seeds)
            spread = _spread(row["accuracy_mean"], row["accuracy_sd"], measured == 1)
            macro = f"{row['macro_accuracy_mean']:.3f}"
            if measured < run_seeds:  # a seed left out of the mean is said, never silent
                macro += f"  ({measured} of {run_seeds} seeds)"
        lines.append(
            f"{row['method']:<{width}} {row['round'] if row['round'] is not None else '-':>5} "
            f"{spread:>16} {macro:>7}"
        )
    if unmeasured:
        lines.append("n/a: not measured, no held-out query of the categories in use in that round")
    if document.get("config", {}).get("through_services"):
        lines.append("rounds closed through the services: submission service, close, merge "
                     "pipeline, publication (scratch database)")
    comm = document.get("communication", {})
    if comm:
        if comm.get("bytes_per_client_round", 0) is None:
            lines.append("bytes per client per round: none, no client sent anything")
        else:
            lines.append(
                f"bytes per client per round: {comm.get('bytes_per_client_round', 0):.0f} raw, "
                f"{comm.get('gzip_bytes_per_client_round', 0):.0f} gzip, "
                f"{comm.get('dcz_bytes_per_client_round', 0):.0f} dcz (zstd against the pulled "
                "global; round 1: the probe set's requests and the schema)"
            )
        per_round = sorted(
            ((k, v) for k, v in comm.items() if k.startswith("bytes_round_")),
            key=lambda kv: int(kv[0].removeprefix("bytes_round_")),
        )
        if per_round:
            lines.append(
                "  per round (raw / dcz): "
                + ", ".join(
                    f"{k.removeprefix('bytes_round_')}: {v:.0f} / "
                    f"{comm.get('dcz_' + k, 0):.0f}"
                    for k, v in per_round
                )
            )
    diag = document.get("diagnostics", {})
    if diag.get("reranker_contraction_p99") is not None:
        lam = document.get("config", {}).get("mask_strength", 1.0)
        lipschitz = diag.get(f"masking_lipschitz_lambda_{lam:g}_p99")
        lines.append(
            (f"masking L_e (99%) at λ={lam:g}: {lipschitz:.3f}; " if lipschitz is not None else "")
            + f"reranker contraction L_R (99%): {diag['reranker_contraction_p99']:.3f}, "
            + (f"margin Δ (5%): {diag['margin_p5']:.3f}, " if diag.get("margin_p5") is not None
               else "")
            + "decisions unchanged under noise: "
            f"{diag['decisions_unchanged_under_noise']:.1%}"
            + (f"; candidates changed under noise: {diag['candidates_changed_under_noise']:.1%}"
               if diag.get("candidates_changed_under_noise") is not None else "")
            + (f", L_R (99%) where they did not: {diag['reranker_contraction_p99_same_candidates']:.3f}"
               if diag.get("reranker_contraction_p99_same_candidates") is not None else "")
        )
    privacy = document.get("privacy", {})
    if privacy and privacy.get("membership_auroc") is None:
        lines.append("membership inference: not measured (no client sent a text beside a tested "
                     "tool's held-out request)")
    elif privacy:
        lines.append(
            "membership-inference AUROC {membership_auroc:.3f}, token overlap {token_overlap:.3f}, "
            "clients under 0.10 overlap {share_clients_overlap_below_0_10:.0%}".format(**privacy)
            + ("; non-members (same tools, never in the log) {token_overlap_nonmember:.3f}, "
               "excess {token_overlap_excess:.3f}, clients under 0.10 excess "
               "{share_clients_excess_below_0_10:.0%}".format(**privacy)
               if "token_overlap_excess" in privacy else "")
        )
    if document.get("adversarial_clients"):
        config = document.get("config") or {}
        lines.append(
            f"adversarial clients: {document['adversarial_clients']} of "
            f"{config.get('orgs', 0) * config.get('clients_per_org', 0)} "
            f"({config.get('adversarial_mode', '')}, --adversarial-fraction "
            f"{config.get('adversarial_fraction', 0):g})"
        )
    screened = document.get("screening") or {}
    if screened.get("dropped_honest") or screened.get("adversarial_submissions"):
        lines.append(
            "implausible-source check: dropped {dropped_honest} of {honest_submissions} honest "
            "client submissions".format(**screened)
            + (", {dropped_adversarial} of {adversarial_submissions} adversarial".format(**screened)
               if screened.get("adversarial_submissions") else "")
        )
    if (document.get("targeting") or {}).get("victim_queries"):
        lines.append(f"targeted attack's aim (its target tool, whether attacked or not): "
                     f"{_targeted(document['targeting'])}")
    adversarial = document.get("adversarial") or []
    if adversarial:
        lines.append("adversarial clients (final round, mean over seeds; submissions dropped whole):")
        for row in adversarial:
            spread = _spread(row["accuracy"], row["accuracy_sd"], one_seed)
            dropped = (
                f"  honest {row['dropped_honest']}/{row['honest_submissions']}, adversarial "
                f"{row['dropped_adversarial']}/{row['adversarial_submissions']}"
                if "dropped_honest" in row else ""
            )
            if row.get("robust_dropped_honest") or row.get("robust_dropped_adversarial"):
                dropped += (f"; rule dropped scenarios: honest {row['robust_dropped_honest']}, "
                            f"adversarial {row['robust_dropped_adversarial']}")
            if row.get("relabelled_adversarial_scenarios"):
                dropped += (f"; relabelled {row['relabelled_adversarial_scenarios']} of "
                            f"{row['adversarial_scenarios']} adversarial scenarios sent")
            if row.get("victim_queries"):
                dropped += f"; {_targeted(row)}"
            played = (f" ({row['adversarial_clients']:.0f} clients)"
                      if row.get("adversarial_clients") is not None else "")
            lines.append(
                f"  {row['adversarial_mode']:<24} {row['adversarial_fraction']:>4.0%}{played} "
                f"{row['robust_rule']:<12} {spread:>16}{dropped}"
            )
    lines += _sweep_lines(document, one_seed)
    transfer = summarize_transfer(document.get("transfer") or [])
    if transfer:
        lines.append("transfer of the final global compendium (mean over seeds):")
        lines.append(
            f"  {'model':<36} {'reranker':<8} {'accuracy':>16} {'macro':>7} {'fallbacks':>11}  llm"
        )
        for row in transfer:
            spread = _spread(row["accuracy_mean"], row["accuracy_sd"], one_seed)
            fallbacks = f"{row['fallbacks']}/{row['queries']}"
            lines.append(
                f"  {row['model']:<36} {row['reranker']:<8} {spread:>16} "
                f"{row['macro_accuracy_mean']:>7.3f} {fallbacks:>11}  {row['llm'] or '-'}"
            )
    return "\n".join(lines)


def _targeted(counts: dict[str, int]) -> str:
    return (f"{counts['victims_routed_to_target']} of {counts['victim_queries']} victim-tool test "
            f"queries routed to the target")


def _sweep_lines(document: dict[str, Any], one_seed: bool) -> list[str]:
    """The privacy, release, τ, summarizer, contradiction and cadence sweeps, one line per
    variant."""
    lines = []

    def privacy(row: dict) -> str:  # accuracy, membership AUROC, token overlap, bytes
        def figure(key: str) -> str:
            value = row.get(key)
            return "-" if value is None else f"{value:.3f}"

        sent = row.get("bytes_per_client_round")
        return (
            f"{_spread(row['accuracy'], row.get('accuracy_sd', 0.0), one_seed):>16} "
            f"{figure('membership_auroc'):>6} {figure('token_overlap'):>8} "
            f"{'nothing sent' if sent is None else f'{sent:.0f}':>12}"
        )

    rows = document.get("privacy_sweep") or []
    if rows:
        lines.append("privacy sweep (final round, mean over seeds):")
        lines.append(f"  {'ε':>5} {'λ':>5} {'accuracy':>16} {'AUROC':>6} {'overlap':>8} {'bytes':>12}")
        for row in rows:
            lines.append(f"  {row['epsilon']:>5g} {row['mask_strength']:>5g} {privacy(row)}")
    rows = document.get("release_sweep") or []
    if rows:
        lines.append("k-anonymous release sweep (final round, mean over seeds):")
        lines.append(f"  {'k':>5} {'accuracy':>16} {'AUROC':>6} {'overlap':>8} {'bytes':>12}")
        for row in sorted(rows, key=lambda r: r["min_users"]):
            lines.append(f"  {row['min_users']:>5} {privacy(row)}")
    rows = document.get("tau_sweep") or []
    if rows:
        lines.append("τ sweep (final round, mean over seeds):")
        lines.append(f"  {'τ':>5} {'accuracy':>16} {'scenarios':>10} {'KB':>8} {'dedup':>6}")
    for row in rows:
        lines.append(
            f"  {row['tau']:>5g} {_spread(row['accuracy'], row['accuracy_sd'], one_seed):>16} "
            f"{row.get('global_scenarios', 0):>10.0f} {row.get('global_size_bytes', 0) / 1000:>8.1f} "
            f"{row.get('dedup_rate', 0):>6.1%}"
        )
    rows = document.get("summarizer_sweep") or []
    if rows:
        lines.append("summarizer sweep (final round, mean over seeds):")
        for row in rows:
            kinds = row.get("summarizer_fallback_kinds") or {}
            why = (": " + ", ".join(f"{n:.0f} {kind}" for kind, n in kinds.items())) if kinds else ""
            written = (
                f"; an LLM wrote {row['llm_summaries']:.0f} of {row['summaries']:.0f} summaries "
                f"({row.get('summarizer_fallbacks', 0):.0f} fallbacks{why})"
                if row["summarizer"] in LLM_SUMMARIZERS and "llm_summaries" in row else ""
            )
            lines.append(
                f"  {row['summarizer']:<17} {_spread(row['accuracy'], row['accuracy_sd'], one_seed):>16}  "
                f"merges {row.get('merge_seconds_per_round', 0):.2f} s per round{written}"
            )
    rows = document.get("contradictions") or []
    if rows:
        lines.append("contradictory scenarios (final round, mean over seeds):")
        lines.append(f"  {'share':>5}  {'with the conflict log':>21}  {'without':>16}")
        for share in sorted({row["contradiction_fraction"] for row in rows}):
            cells = {row["conflict_log"]: _spread(row["accuracy"], row["accuracy_sd"], one_seed)
                     for row in rows if row["contradiction_fraction"] == share}
            lines.append(f"  {share:>5.0%}  {cells.get(True, '-'):>21}  {cells.get(False, '-'):>16}")
    rows = document.get("cadence") or []
    if rows:
        rounds = sorted(
            {int(k.removeprefix("accuracy_round_")) for row in rows for k in row
             if k.startswith("accuracy_round_")}
        )
        drift = (document.get("config") or {}).get("drift_every") or 0
        lines.append(
            "aggregation cadence, accuracy per round (mean over seeds"
            + (f"; new categories come into use every {drift} rounds)" if drift else ")")
        )
        for row in rows:
            every = row["aggregate_every"]
            name = "frozen" if every == 0 else f"every {every}"
            lines.append(f"  {name:<9} " + " ".join(
                _figure(row.get(f"accuracy_round_{r}")) for r in rounds))  # n/a: not measured
    return lines
