import contextlib
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import get_args

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from compendium.client_api import CannotWrite, out_file_problem, write_atomically
from compendium.delta import DEFAULT_SINCE_CONFIDENCE
from compendium.masking import SHARED_WORD_USERS, valid_shared_word_users
from compendium.registry import RegistryFormatError, load_dataset
from compendium.schema import Schema
from federation.merge.summarize import LLM_SUMMARIZERS
from federation.merge.summarize import ORDER as SUMMARIZERS
from federation.round_config import RobustRule, config_problems
from federation.simulation.data import (
    TESTED_FROM,
    dataset_fingerprint,
    federation_problem,
    listing,
    query_category_mismatches,
    some_uncategorized,
    unasked_tools,
    untested_tools,
)
from federation.simulation.report import (
    PlayedRuns,
    code_revisions,
    combine,
    run,
    sweep,
    table,
)
from federation.simulation.runner import (
    ADVERSARIAL_MODES,
    CAMOUFLAGE_SHARE,
    CAMOUFLAGED_MODES,
    MODEL_NAMES,
    Simulation,
    SimulationConfig,
    adversary_count,
    aggregates_in,
    unavailable_model,
)
from federation.simulation.through_services import (
    ScratchDatabaseUnavailable,
    SimulatedRoundFailed,
    check_scratch_database,
    scratch_database,
)
from routing.embeddings import EmbeddingModelUnavailable, get_engine
from routing.llm import LLMUnavailable
from routing.router import RERANKERS

ADVERSARIAL_MODE = SimulationConfig.adversarial_mode
IN_MEMORY_HINT = "pass --in-memory to call the merge operator directly"
# The flags --combine reads; every other flag of the command is a run's.
COMBINE_FLAGS = ("combine", "out", "no_store", "label", "unless_stored")
SWEEP_RULES = ",".join(get_args(RobustRule))  # every rule the round configuration takes

# The round configuration's fields as this command's flags name them.
FLAGS = {
    "epsilon": "--epsilon", "mask_strength": "--lambda", "tau": "--tau",
    "summarizer": "--summarizer", "robust_rule": "--robust-rule", "trim_fraction": "--trim-fraction",
}


def _listed(text: str, flag: str, parse, expected: str) -> list:
    """A comma-separated list, each item read by `parse`, or a CommandError naming the flag and
    the item it cannot read, or the value it lists twice (a sweep would play and store its row
    twice)."""
    values: dict = {}  # each value read -> the item that first gave it
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = parse(item)
        except ValueError:
            raise CommandError(f"{flag}: expected {expected}, got {item!r}") from None
        if value in values:
            first = values[value]
            also = "" if item == first else f" (again as {item})"
            raise CommandError(f"{flag} lists {first} twice{also}: give each value once")
        values[value] = item
    if not values and text:  # commas alone (a default is never this): the flag would be off
        raise CommandError(f"{flag}: expected {expected}, got {text!r}")
    return list(values)


def _floats(text: str, flag: str) -> list[float]:
    return _listed(text, flag, float, "comma-separated numbers")


def _integers(text: str, flag: str) -> list[int]:
    return _listed(text, flag, int, "whole numbers")


def _names(text: str, flag: str) -> tuple[str, ...]:
    return tuple(_listed(text, flag, str, "names"))


def _known(names: tuple[str, ...], choices, flag: str) -> tuple[str, ...]:
    """`names`, or a CommandError naming those not among `choices`."""
    unknown = set(names) - set(choices)
    if unknown:
        raise CommandError(
            f"{flag}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(choices)}"
        )
    return names


class Command(BaseCommand):
    help = (
        "Simulate a federation on a routing-benchmark dataset with the real client toolkit, merge "
        "operator and router; compare with the baselines; optional privacy and adversarial sweeps "
        "and transfer of the final global compendium to other embedding models, rerankers and LLMs."
    )

    def add_arguments(self, parser):
        common = {action.dest for action in parser._actions}  # Django's own: --verbosity, ...
        parser.add_argument(
            "--dataset", default="../shared/data/metatool",
            help="a folder in the routing-benchmark format (tools.jsonl, queries.jsonl)",
        )
        parser.add_argument("--orgs", type=int, default=5, help="organizations, one edge each")
        parser.add_argument("--clients-per-org", type=int, default=4)
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument(
            "--partition", choices=["iid", "category", "random"], default="category",
            help="how the train queries are dealt: category (each organization specializes in a "
            "subset of tool categories: the tools' categories in tools.jsonl, which drift and the "
            "per-category table read too), iid (at random), random (each client's own tool "
            "preferences)",
        )
        parser.add_argument("--seed", type=int, default=0, help="first seed")
        parser.add_argument("--seeds", type=int, default=1, help="number of seeds (mean ± sd)")
        parser.add_argument("--epsilon", type=float, default=1.0, help="per-round ε")
        parser.add_argument("--lambda", dest="mask_strength", type=float, default=1.0,
                            help="the clients' masking strength λ (0: no masking)")
        parser.add_argument("--tau", type=float, default=0.85,
                            help="cosine threshold τ of the merges' clustering")
        parser.add_argument("--reranker", choices=["fusion", "none", "llm"], default="fusion",
                            help="how the router reranks the retrieved scenarios (none: top-1 cosine; llm is "
                            "refused: the LLM reranker is measured by --transfer-rerankers llm)")
        parser.add_argument(
            "--summarizer",
            choices=SUMMARIZERS,
            default="probe-extractive",
        )
        parser.add_argument("--robust-rule", choices=["none", "krum", "trimmed-mean"], default="none",
                            help="the merges' Byzantine-robust rule (f from --trim-fraction); "
                            "Krum's guarantee needs n >= 2f + 3 inputs, the trimmed mean's only "
                            "n > 2f")
        parser.add_argument(
            "--trim-fraction", type=float, default=0.1,
            help="share of the inputs the robust rule assumes adversarial, f = floor(share * n), "
            "across sources per tool and within clusters (the round setting trim_fraction; "
            "0 <= share < 0.5, default 0.1). With 4 clients per edge, 0.25 makes f = 1 and "
            "n = 4 < 2f + 3: Krum runs below its premise there (the merge stats count such "
            "groups, krum_below_premise)",
        )
        parser.add_argument(
            "--shared-word-users", type=int, default=SHARED_WORD_USERS, metavar="K",
            help="clients release the plain words that at least K of their users wrote (0: off)",
        )
        parser.add_argument("--max-words", type=int, default=0, metavar="N",
                            help="clients send each request's first N words at most (synapse-client "
                            "build --max-words; 0: whole requests)")
        parser.add_argument("--users-per-client", type=int, default=3,
                            help="distinct users in each client's usage log")
        parser.add_argument("--test-limit", type=int, default=None, help="evaluate on a sample")
        parser.add_argument(
            "--probe-fraction", type=float, default=0.1,
            help="share of the queries in the public probe set (the edges' probe, the routers' "
            "fitting set and the head's public examples; default 0.1)",
        )
        parser.add_argument(
            "--queries-per-client", type=int, default=None, help="cap each client's train share"
        )
        parser.add_argument(
            "--unless-stored", action="store_true",
            help="do nothing if a run with this --label is stored already (without --label: any run)",
        )
        parser.add_argument("--no-baselines", action="store_true",
                            help="SYNAPSE's rows only: no Centralized, Local-only, BM25, ... rows")
        parser.add_argument(
            "--no-diagnostics",
            action="store_true",
            help="skip the Lipschitz / contraction / margin diagnostics of the final round",
        )
        parser.add_argument(
            "--no-linear-head",
            action="store_true",
            help="route without the linear head (a logistic regression over the compendium's "
            "scenario embeddings, fitted when a router is built): the ablation",
        )
        parser.add_argument(
            "--no-carry-forward",
            action="store_true",
            help="clients resend their whole compendium each round and the server does not carry "
            "the previous global forward (default: carry it forward, clients send what changed)",
        )
        parser.add_argument(
            "--since-confidence", type=float, default=DEFAULT_SINCE_CONFIDENCE,
            help="with carry-forward, clients also leave out the scenarios the pulled global "
            "already routes to their tool with at least this calibrated confidence (default "
            "%(default)s; above 1: only what the global covers at cosine >= tau is left out)",
        )
        parser.add_argument(
            "--max-bytes", type=int, default=None,
            help="each honest client sends at most this many canonical bytes a round: the "
            "statistics, then scenarios in turns over the tools, then precautions; the rest waits "
            "for a later round (default: no budget)",
        )
        parser.add_argument("--adversarial-fraction", type=float, default=0.0,
                            help="share of the clients that are adversarial, in [0, 1]")
        parser.add_argument("--adversarial-mode", choices=ADVERSARIAL_MODES, default=ADVERSARIAL_MODE,
                            help="what the adversarial clients send")
        parser.add_argument(
            "--camouflage-share", type=float, default=CAMOUFLAGE_SHARE,
            help="camouflaged poisoning: the share of each adversarial submission's scenarios "
            "relabelled to another tool; the rest is what an honest client would send. "
            "Coordinated camouflage: the share added of planted entries, identical across the "
            f"adversaries (default {CAMOUFLAGE_SHARE:g})",
        )
        parser.add_argument(
            "--min-users", type=int, default=1,
            help="k-anonymous release: clients send only entries that k distinct users support",
        )
        parser.add_argument(
            "--pool-users", type=int, default=1,
            help="pooled release: clients pool each tool's requests until every pool holds k "
            "distinct users' requests and send a pool as the words two distinct users in it wrote",
        )
        parser.add_argument(
            "--pool-size", type=int, default=0,
            help="with --pool-users: at least this many requests per pool (default: --pool-users)",
        )
        parser.add_argument(
            "--client-tau", type=float, default=None,
            help="the clients' near-duplicate collapse threshold (default: --tau)",
        )
        parser.add_argument(
            "--sweep-min-users", default="",
            help="e.g. 1,2,3: the k-anonymous release sweep (accuracy, AUROC, bytes)",
        )
        parser.add_argument("--sweep-epsilon", default="", help="e.g. 0.5,1,2 (with --sweep-lambda)")
        parser.add_argument("--sweep-lambda", default="", help="e.g. 0.5,1,1.5")
        parser.add_argument("--sweep-adversarial", default="", help="fractions, e.g. 0,0.2,0.4")
        parser.add_argument("--sweep-modes", default=",".join(ADVERSARIAL_MODES),
                            help="adversarial modes of --sweep-adversarial (default: all)")
        parser.add_argument("--sweep-rules", default=SWEEP_RULES,
                            help="robust rules of --sweep-adversarial")
        parser.add_argument(
            "--sweep-tau", default="",
            help="e.g. 0.75,0.8,0.85,0.9,0.95: the cosine threshold sweep (accuracy, global "
            "scenarios and size, dedup rate)",
        )
        parser.add_argument(
            "--sweep-summarizers", default="",
            help=f"e.g. probe-extractive,centroid,none: the edge summarizer sweep (accuracy, merge "
            f"seconds per round); {' and '.join(sorted(LLM_SUMMARIZERS))} need --llm",
        )
        parser.add_argument(
            "--aggregate-every", type=int, default=1, metavar="K",
            help="aggregate in round 1 and then every K rounds; clients send nothing in between "
            "(0: frozen after round 1; default 1)",
        )
        parser.add_argument(
            "--drift-every", type=int, default=0, metavar="D",
            help="workload drift: half of the tool categories are in use from round 1, the rest "
            "come into use in groups at rounds 1+D, 1+2D, ...; each round is scored on the "
            "categories in use then (default 0: no drift)",
        )
        parser.add_argument(
            "--sweep-cadence", default="",
            help="e.g. 1,5,0: the aggregation cadence sweep (accuracy per round; 0: frozen), "
            "best with --drift-every and more --rounds",
        )
        parser.add_argument(
            "--contradiction-fraction", type=float, default=0.0, metavar="P",
            help="share of each honest client's scenarios that another client of its organization "
            "contradicts, reporting the same request for a confusable tool (default 0)",
        )
        parser.add_argument(
            "--no-conflict-log", action="store_true",
            help="merge without IsConsistent and the conflict log (the ablation)",
        )
        parser.add_argument(
            "--sweep-contradictions", default="",
            help="e.g. 0,0.2,0.4,0.6: contradictory-scenario injection, each share with and "
            "without the conflict log",
        )
        parser.add_argument(
            "--in-memory", action="store_true",
            help="call the merge operator in memory instead of closing each round through the "
            "services: the same compendiums are published (tests/test_simulation_pipeline.py; "
            "on MetaTool and the cheat sheets, 5 seeds, the same accuracy to the digit) in about "
            "two thirds of the time, and no scratch database is needed. Default: every round "
            "through the product's services, as a live federation runs it: each client's "
            "compendium through the submission service (the server's arrival checks included), "
            "the operator's close, the Celery merge pipeline (eager, in this process) and "
            "publication, in a scratch database created for the run and dropped after it (the "
            "database user must be allowed to create databases)",
        )
        parser.add_argument(
            "--through-services", action="store_true",
            help="the default (kept for the commands recorded with it)",
        )
        parser.add_argument(
            "--tune-router", type=int, default=0, metavar="EPOCHS",
            help="route each published global (and Centralized's) with an encoder fine-tuned on "
            "it for EPOCHS epochs, as the server does with SYNAPSE_ROUTER_TUNE_EPOCHS; rows "
            "synapse_untuned keep the frozen router's accuracy; through the services, the "
            "synapse_served row is the router the server's own tuning serves (0: off)",
        )
        parser.add_argument(
            "--embedding-model", default=None,
            help="the engine clients, merges and routers embed with, e.g. "
            "onnx-int8-dynamic:all-MiniLM-L6-v2 or a sentence-transformers path (default: "
            "SYNAPSE_EMBEDDING_MODEL, else the bundled MiniLM)",
        )
        parser.add_argument(
            "--transfer-models",
            default="",
            help="evaluate the final global compendium, unchanged, with these embedding models too "
            "(comma-separated sentence-transformers names or paths, bundled:all-MiniLM-L6-v2, "
            "bf16:all-MiniLM-L6-v2, onnx-int8:all-MiniLM-L6-v2, onnx-int8-dynamic:all-MiniLM-L6-v2)",
        )
        parser.add_argument(
            "--transfer-rerankers",
            default="",
            help="rerankers of the transfer evaluation, e.g. none,fusion,llm (default: fusion)",
        )
        parser.add_argument(
            "--llm", dest="llm_url", default=None,
            help="OpenAI-compatible endpoint for the llm transfer reranker (without it every "
            "llm decision falls back to fusion) and the LLM summarizers of the merges (whose "
            "IsConsistent probe asks it too); refused where the run has neither",
        )
        parser.add_argument("--llm-model", default="", help="model name sent to --llm")
        parser.add_argument(
            "--combine", nargs="+", default=None, metavar="JSON",
            help="run nothing: combine --out files of the same configuration on disjoint seeds "
            "(a long run split over processes) into one, printed, written to --out and stored",
        )
        parser.add_argument("--out", default=None, help="write the JSON results here")
        parser.add_argument("--no-store", action="store_true", help="do not keep the run for the dashboard")
        parser.add_argument("--label", default="", help="a name for the stored run")
        # What a run reads and --combine does not (it joins the files as they were played).
        self.run_flags = {
            action.dest: (action.option_strings[0], action.default)
            for action in parser._actions
            if action.dest not in common and action.dest not in COMBINE_FLAGS
        }

    def handle(self, *args, **o):
        if o["no_store"] and o["label"]:
            raise CommandError("--label names the stored run; with --no-store nothing is stored")
        if o["no_store"] and o["unless_stored"]:
            raise CommandError(
                "--unless-stored looks for this run stored; with --no-store it never is, so every "
                "call would run it again"
            )
        _check_label(o["label"])
        if not o["no_store"]:
            _check_storable()
        if o["unless_stored"]:
            from federation.models import SimulationRun

            stored = SimulationRun.objects.all()
            if o["label"]:
                stored = stored.filter(label=o["label"])
            if stored.exists():
                named = f" labelled {o['label']!r}" if o["label"] else ""
                self.stdout.write(f"a simulation run{named} is stored already; nothing to do")
                return
        if o["combine"]:
            given = sorted(flag for dest, (flag, default) in self.run_flags.items()
                           if o[dest] != default)
            if given:
                raise CommandError(
                    f"{', '.join(given)}: --combine runs nothing, it joins the --out files as they "
                    "were played; leave out the flags of a run"
                )
            files: dict[Path, str] = {}  # each file as the command line first names it
            for path in o["combine"]:
                resolved = Path(path).resolve()
                if resolved in files:  # its seeds would be in two documents
                    raise CommandError(f"--combine names {files[resolved]} twice")
                files[resolved] = path
            if o["out"] and Path(o["out"]).resolve() in files:  # the part replaced by the whole
                raise CommandError(
                    f"--out {o['out']} is one of the files --combine joins; name another file"
                )
            if o["out"]:
                _check_out(o["out"])
            documents = []
            for path in o["combine"]:
                try:  # utf-8-sig: a file an editor saved with a byte-order mark first
                    documents.append(json.loads(Path(path).read_text(encoding="utf-8-sig")))
                except OSError as exc:
                    raise CommandError(f"cannot read {path}: {exc.strerror}") from None
                except UnicodeDecodeError as exc:
                    raise CommandError(f"{path} is not UTF-8 text ({exc.reason})") from None
                except json.JSONDecodeError as exc:
                    raise CommandError(f"{path} is not JSON ({exc.msg})") from None
                except RecursionError:
                    raise CommandError(f"{path} is not JSON (nested too deeply)") from None
                except ValueError:  # an integer of more digits than Python reads (4,300)
                    raise CommandError(f"{path} holds a number of more than 4,300 digits") from None
            try:
                document = combine(documents, o["combine"])
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            document["command"] = command_line()
            revisions = code_revisions(document)
            if len(revisions) > 1:  # allowed (a change may not touch what is measured), said
                self.stderr.write(
                    f"warning: the runs joined ran different code ({', '.join(revisions)}); "
                    "their figures are comparable only where the changes between them touch "
                    "nothing they measure"
                )
            return self._emit(document, o)
        if o["out"]:
            _check_out_beside(o["out"], o["dataset"])
            _check_out(o["out"])
        for flag, least in (("rounds", 1), ("users_per_client", 1), ("seeds", 1), ("seed", 0),
                            ("orgs", 1), ("clients_per_org", 1), ("tune_router", 0)):
            if o[flag] < least:
                raise CommandError(f"--{flag.replace('_', '-')} must be at least {least}, not {o[flag]}")
        last_seed = o["seed"] + o["seeds"] - 1
        if last_seed >= 2**63:  # a round's seed (RoundConfig.seed) is a 64-bit integer
            raise CommandError(f"the last seed (--seed + --seeds - 1) must be below 2**63, not {last_seed}")
        for flag in ("queries_per_client", "test_limit"):
            if o[flag] is not None and o[flag] < 1:
                raise CommandError(f"--{flag.replace('_', '-')} must be at least 1, not {o[flag]}")
        if not 0 <= o["adversarial_fraction"] <= 1:
            raise CommandError(
                f"--adversarial-fraction must be in [0, 1], not {o['adversarial_fraction']:g}"
            )
        if not math.isfinite(o["since_confidence"]) or o["since_confidence"] < 0:
            raise CommandError(
                f"--since-confidence must be a finite number, at least 0, not {o['since_confidence']:g}"
            )
        clients = o["orgs"] * o["clients_per_org"]
        _some_adversary(o["adversarial_fraction"], "--adversarial-fraction", clients)
        if not 0 <= o["camouflage_share"] <= 1:
            raise CommandError(f"--camouflage-share must be in [0, 1], not {o['camouflage_share']:g}")
        if o["min_users"] < 1:
            raise CommandError("--min-users must be at least 1")
        if o["pool_users"] < 1:
            raise CommandError("--pool-users must be at least 1")
        for flag in ("min_users", "pool_users"):
            _releases(o[flag], f"--{flag.replace('_', '-')}", o["users_per_client"])
        if o["pool_size"] < 0:
            raise CommandError("--pool-size must be 0 (--pool-users) or more")
        unused = _unused_flag(o)
        if unused:
            raise CommandError(unused)
        if o["reranker"] == "llm":  # Simulation.router gives its routers no LLM backend
            raise CommandError(
                "--reranker llm: the simulation's own routers have no LLM, so every decision "
                "would fall back to fusion; evaluate the LLM reranker on the final global with "
                "--transfer-rerankers llm --llm URL"
            )
        if not valid_shared_word_users(o["shared_word_users"]):
            raise CommandError("--shared-word-users must be 0 (off) or at least 2")
        if o["shared_word_users"] > o["users_per_client"]:  # no word has that many users
            raise CommandError(
                f"--shared-word-users {o['shared_word_users']} is more than --users-per-client "
                f"{o['users_per_client']}: no client has that many users to share a word, so "
                "the clients would release none and only Centralized (over every client's "
                "users) would; use --shared-word-users 0 (off) or more --users-per-client"
            )
        if o["max_words"] < 0:
            raise CommandError(
                f"--max-words must be 0 (whole requests) or at least 1, not {o['max_words']}"
            )
        if not 0 < o["probe_fraction"] < 0.6:  # 40% is held out for testing
            raise CommandError(f"--probe-fraction must be in (0, 0.6), not {o['probe_fraction']:g}")
        if not 0 <= o["trim_fraction"] < 0.5:
            raise CommandError(f"--trim-fraction must be in [0, 0.5), not {o['trim_fraction']:g}")
        if o["client_tau"] is not None and not 0 < o["client_tau"] <= 1:
            raise CommandError("--client-tau must be in (0, 1]")
        if o["max_bytes"] is not None and o["max_bytes"] < 1:
            raise CommandError(f"--max-bytes must be a positive number of bytes, not {o['max_bytes']}")
        if o["in_memory"] and o["through_services"]:
            raise CommandError("--in-memory and --through-services exclude each other")
        if o["aggregate_every"] < 0:
            raise CommandError("--aggregate-every must be 0 (frozen after round 1) or a number of rounds")
        if not o["no_baselines"] and not aggregates_in(o["rounds"], o["aggregate_every"]):
            # the baselines are built from the last round's client compendiums: none exist then
            raise CommandError(
                f"--aggregate-every {o['aggregate_every']}: round {o['rounds']}, the last, does not "
                "aggregate, and the baselines are built from the last round's client compendiums; "
                "add --no-baselines or choose a number of rounds the cadence aggregates in"
            )
        if o["drift_every"] < 0:
            raise CommandError("--drift-every must be 0 (no drift) or a number of rounds")
        if 0 < o["rounds"] <= o["drift_every"]:  # drift_plan: no event, every category from round 1
            raise CommandError(
                f"--drift-every {o['drift_every']}: the first categories would come into use at "
                f"round {1 + o['drift_every']}, after --rounds {o['rounds']}, so there would be no "
                "drift; use more --rounds or a shorter interval"
            )
        taus = _floats(o["sweep_tau"], "--sweep-tau")
        if any(not 0 < t <= 1 for t in taus):
            raise CommandError("--sweep-tau: every τ must be in (0, 1]")
        flag = "--sweep-summarizers"
        summarizers = _known(_names(o["sweep_summarizers"], flag), SUMMARIZERS, flag)
        flag = "--transfer-rerankers"
        rerankers = _known(_names(o["transfer_rerankers"], flag), RERANKERS, flag)
        llm_summarizer = bool({o["summarizer"], *summarizers} & set(LLM_SUMMARIZERS))
        if not o["llm_url"] and llm_summarizer:
            raise CommandError(
                f"the {' and '.join(sorted(LLM_SUMMARIZERS))} summarizers need an LLM endpoint: pass --llm URL"
            )
        if o["llm_url"] and not llm_summarizer and "llm" not in rerankers:
            # Nothing else asks it (the merges through the services neither: ServiceRounds).
            raise CommandError(
                "--llm applies only with an LLM summarizer (--summarizer or --sweep-summarizers "
                f"{' or '.join(sorted(LLM_SUMMARIZERS))}) or --transfer-rerankers llm; this run "
                "has none, so it would be ignored"
            )
        contradictions = _floats(o["sweep_contradictions"], "--sweep-contradictions")
        if not 0 <= o["contradiction_fraction"] <= 1:
            raise CommandError(
                f"--contradiction-fraction must be in [0, 1], not {o['contradiction_fraction']:g}"
            )
        if any(not 0 <= p <= 1 for p in contradictions):
            raise CommandError("--sweep-contradictions: every share must be in [0, 1]")
        if o["clients_per_org"] < 2:  # `contradict`: another client of the same organization
            for flag, share in (("--contradiction-fraction", o["contradiction_fraction"]),
                                *(("--sweep-contradictions", p) for p in contradictions)):
                if share > 0:
                    raise CommandError(
                        f"{flag} {share:g} needs 2 or more --clients-per-org: a contradiction "
                        f"comes from another client of the same organization, and with "
                        f"--clients-per-org {o['clients_per_org']} there is none"
                    )
        cadences = _integers(o["sweep_cadence"], "--sweep-cadence")
        if any(k < 0 for k in cadences):
            raise CommandError("--sweep-cadence: every cadence must be 0 (frozen) or a number of rounds")
        aggregating: dict[tuple, int] = {}  # the rounds a cadence aggregates in -> the cadence
        for k in cadences:  # (two cadences share them only where both aggregate in round 1 alone)
            rounds = tuple(r for r in range(1, o["rounds"] + 1) if aggregates_in(r, k))
            if rounds in aggregating:  # the same federation, played and stored twice
                raise CommandError(
                    f"--sweep-cadence {aggregating[rounds]} and {k} both aggregate in round 1 "
                    f"alone of --rounds {o['rounds']}: the same federation; use more --rounds or "
                    "other cadences"
                )
            aggregating[rounds] = k
        privacy_variants = []
        if o["sweep_epsilon"] or o["sweep_lambda"]:
            epsilons = _floats(o["sweep_epsilon"], "--sweep-epsilon") or [o["epsilon"]]
            lambdas = _floats(o["sweep_lambda"], "--sweep-lambda") or [o["mask_strength"]]
            privacy_variants = [{"epsilon": e, "mask_strength": m} for e in epsilons for m in lambdas]
        min_users = _integers(o["sweep_min_users"], "--sweep-min-users")
        if any(k < 1 for k in min_users):
            raise CommandError("--sweep-min-users: every k must be at least 1")
        for k in min_users:
            _releases(k, "--sweep-min-users", o["users_per_client"])
        adversarial_variants = []
        if o["sweep_adversarial"]:
            fractions = _floats(o["sweep_adversarial"], "--sweep-adversarial")
            if any(not 0 <= f <= 1 for f in fractions):
                raise CommandError("--sweep-adversarial: every fraction must be in [0, 1]")
            for fraction in fractions:
                _some_adversary(fraction, "--sweep-adversarial", clients)
            flag = "--sweep-modes"
            modes = _known(_names(o["sweep_modes"], flag), ADVERSARIAL_MODES, flag)
            rules = _names(o["sweep_rules"], "--sweep-rules")
            for flag, names in (("--sweep-modes", modes), ("--sweep-rules", rules)):
                if not names:  # emptied (the defaults hold every one): no adversarial row
                    raise CommandError(f"{flag}: expected names, got ''")
            adversarial_variants = [
                {"adversarial_mode": m, "adversarial_fraction": f, "robust_rule": r}
                for m in modes
                for f in fractions
                for r in rules
            ]
        # Every round configuration the run and its sweeps will play, checked before the dataset
        # and the model load: a bad value in a sweep must not surface after an hour's main run.
        sweep_flags = {
            "epsilon": "--sweep-epsilon", "mask_strength": "--sweep-lambda",
            "robust_rule": "--sweep-rules", "tau": "--sweep-tau",
        }
        base = {field: o[field] for field in FLAGS}
        for changes in [{}, *privacy_variants, *adversarial_variants, *({"tau": t} for t in taus)]:
            swept = {k: v for k, v in changes.items() if k in FLAGS}
            problem = config_problems(
                {**base, **swept}, {**FLAGS, **{k: sweep_flags[k] for k in swept}}
            )
            if problem:
                raise CommandError(problem)
        config = SimulationConfig(
            orgs=o["orgs"],
            clients_per_org=o["clients_per_org"],
            rounds=o["rounds"],
            partition=o["partition"],
            epsilon=o["epsilon"],
            mask_strength=o["mask_strength"],
            tau=o["tau"],
            summarizer=o["summarizer"],
            robust_rule=o["robust_rule"],
            trim_fraction=o["trim_fraction"],
            reranker=o["reranker"],
            users_per_client=o["users_per_client"],
            test_limit=o["test_limit"],
            probe_fraction=o["probe_fraction"],
            queries_per_client=o["queries_per_client"],
            baselines=not o["no_baselines"],
            diagnostics=not o["no_diagnostics"],
            linear_head=not o["no_linear_head"],
            adversarial_fraction=o["adversarial_fraction"],
            adversarial_mode=o["adversarial_mode"],
            camouflage_share=o["camouflage_share"],
            carry_forward=not o["no_carry_forward"],
            since_confidence=o["since_confidence"],
            max_bytes=o["max_bytes"],
            min_users=o["min_users"],
            pool_users=o["pool_users"],
            pool_size=o["pool_size"],
            shared_word_users=o["shared_word_users"],
            max_words=o["max_words"],
            client_tau=o["client_tau"],
            transfer_models=_names(o["transfer_models"], "--transfer-models"),
            transfer_rerankers=rerankers,
            llm_url=o["llm_url"] or None,
            llm_model=o["llm_model"] or "",
            aggregate_every=o["aggregate_every"],
            drift_every=o["drift_every"],
            contradiction_fraction=o["contradiction_fraction"],
            conflict_log=not o["no_conflict_log"],
            tune_router_epochs=o["tune_router"],
            through_services=not o["in_memory"],
        )
        seeds = list(range(o["seed"], o["seed"] + o["seeds"]))
        if config.through_services:  # checked when storing (_check_storable), not with --no-store
            try:
                check_scratch_database()
            except ScratchDatabaseUnavailable as exc:
                raise CommandError(f"{exc}; {IN_MEMORY_HINT}") from None
        try:
            dataset = load_dataset(o["dataset"])
        except RegistryFormatError as exc:
            raise CommandError(str(exc)) from None
        problem = federation_problem(
            dataset, seeds, orgs=config.orgs, clients_per_org=config.clients_per_org,
            partition=config.partition, probe_fraction=config.probe_fraction,
            test_fraction=config.test_fraction, drift_every=config.drift_every,
        )
        if problem:
            raise CommandError(problem)
        unasked = unasked_tools(dataset)
        if unasked:
            self.stderr.write(
                f"simulate: {len(unasked)} of {len(dataset.tools)} tools have no query in "
                f"queries.jsonl ({listing(unasked)}): no client's log holds them and they are "
                "never tested"
            )
        untested, few = untested_tools(dataset)
        if untested:
            self.stderr.write(
                f"simulate: {untested} of {len(dataset.tools)} tools have fewer than {TESTED_FROM} "
                f"distinct queries ({few} queries in all): they stay in train and are never tested"
            )
        lacking = some_uncategorized(dataset)
        if lacking:
            self.stderr.write(
                f"simulate: {len(lacking)} of {len(dataset.tools)} tools have no category in "
                f"tools.jsonl ({listing(lacking)}): the partition, drift and the per-category "
                "table read them as one category, 'uncategorized'"
            )
        differ, example = query_category_mismatches(dataset)
        if differ:
            tool_category = next(t.category for t in dataset.tools if t.tool_id == example.tool_id)
            self.stderr.write(
                f"simulate: {differ} of {len(dataset.queries)} queries in queries.jsonl carry a "
                f"category other than their tool's in tools.jsonl (e.g. {example.tool_id}: "
                f"{example.category!r}, not {repr(tool_category) if tool_category else 'none'}); "
                "the simulation reads a query's category from its tool (partition, drift, "
                "per-category table)"
            )
        try:
            engine = get_engine(o["embedding_model"])
        except EmbeddingModelUnavailable as exc:
            if not o["embedding_model"]:  # the setting's model: the message says to set it
                raise CommandError(str(exc)) from None
            raise CommandError(unavailable_model(
                o["embedding_model"], exc, f"--embedding-model takes {MODEL_NAMES}")) from None
        schema = Schema(tools=dataset.tools)
        quiet = o["verbosity"] == 0

        started = time.monotonic()

        def progress(message: str) -> None:
            if not quiet:  # with the time since the start: a long run's lines say how it goes
                elapsed = datetime.timedelta(seconds=int(time.monotonic() - started))
                print(f"simulate: [{elapsed}] {message}", file=sys.stderr, flush=True)

        def make(cfg: SimulationConfig) -> Simulation:
            return Simulation(dataset, schema, engine, cfg, progress)

        simulation = make(config)
        try:  # transfer models, rerankers and the LLM endpoint: checked before the long run
            simulation.transfer_variants()
        except (ValueError, EmbeddingModelUnavailable, LLMUnavailable) as exc:
            raise CommandError(str(exc)) from None
        scratch = (
            scratch_database(embedding_model=engine.model_name, llm_url=config.llm_url,
                             llm_model=config.llm_model, dropped=self._dropped)
            if config.through_services else contextlib.nullcontext()
        )
        sweeps = {  # the document's section -> the federations it plays (none: no section)
            "privacy_sweep": privacy_variants,
            "release_sweep": [{"min_users": k} for k in min_users],
            "adversarial": adversarial_variants,
            "tau_sweep": [{"tau": t} for t in taus],
            "summarizer_sweep": [{"summarizer": name} for name in summarizers],
            "contradictions": [{"contradiction_fraction": share, "conflict_log": log}
                               for share in contradictions for log in (True, False)],
            "cadence": [{"aggregate_every": k} for k in cadences],
        }
        try:
            with scratch:
                played = PlayedRuns()  # a sweep variant equal to a run already played reuses it
                document = run(simulation, seeds, played)
                for section, variants in sweeps.items():
                    if variants:
                        document[section] = sweep(make, config, variants, seeds, played, name=section)
        except ScratchDatabaseUnavailable as exc:
            raise CommandError(f"{exc}; {IN_MEMORY_HINT}") from None
        except (SimulatedRoundFailed, ValueError) as exc:
            raise CommandError(str(exc)) from None
        # The whole command's time, its sweeps included (run() timed the main run alone): what
        # the dashboard says the run took.
        document["seconds"] = round(time.monotonic() - started, 1)
        document["dataset_fingerprint"] = dataset_fingerprint(dataset)  # --combine compares it
        document["command"] = command_line()
        self._emit(document, o)

    def _dropped(self, names: list[str]) -> None:
        self.stderr.write(
            f"simulate: dropped {len(names)} scratch database(s) that killed runs left behind: "
            + ", ".join(names)
        )

    def _emit(self, document, o):
        """Print the table, store the run, then write --out: a file that cannot be written at
        the end (checked at the start, `_check_out`) does not cost the stored run, and a store
        that fails at the end does not cost the file."""
        self.stdout.write(table(document))
        try:  # a NaN or an infinity: not JSON, and no stored run (jsonb) can hold it
            text = json.dumps(document, indent=2, allow_nan=False)
        except ValueError:
            raise CommandError(
                "the results hold a NaN or an infinity, which JSON cannot represent: nothing "
                "stored or written"
            ) from None
        stored = not_stored = None
        if not o["no_store"]:
            try:
                stored = _store(document, o["label"])
                self.stdout.write(f"stored as simulation run {stored} (shown on the dashboard)")
            except DatabaseError as exc:
                not_stored = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if o["out"]:
            try:  # through a file beside it renamed over it: never half a file
                write_atomically(Path(o["out"]), text.encode("utf-8"))
            except CannotWrite as exc:
                kept = f"the run is stored as simulation run {stored}, but " if stored else ""
                raise CommandError(f"{kept}--out: {exc}") from None
            self.stdout.write(f"results written to {o['out']}")
        if not_stored is not None:
            kept = (f"its results are written to {o['out']}: store them with `python manage.py "
                    f"simulate --combine {o['out']}`" if o["out"] else
                    "its results are the table above only (--out FILE keeps them in a file)")
            raise CommandError(f"the run could not be stored ({not_stored}); {kept}")


def command_line() -> str:
    """The command line this run was started with, as its document records it: `python
    manage.py simulate ...`, or a bench wrapper's own (`python bench/SCRIPT.py ...`), which
    calls this command in its process, so that sys.argv is the wrapper's."""
    if Path(sys.argv[0]).name == "manage.py":
        return "python manage.py " + " ".join(sys.argv[1:])
    return "python " + " ".join(sys.argv)


def _store(document: dict, label: str) -> int:
    """Store the run for the dashboard, its id. The connection checked at the start may have
    been closed by the server while the run played (a restart, an idle timeout over a run of
    hours): a store that fails is tried once more on a new connection."""
    from django.db import connection

    from federation.services import store_simulation_run

    try:
        return store_simulation_run(document, label=label).pk
    except DatabaseError:
        connection.close()
        return store_simulation_run(document, label=label).pk


def _check_out(path: str) -> None:
    """Refuse, before anything runs, an --out the run could not write at its end
    (`out_file_problem`); creates the parent folder, leaves no file behind."""
    problem = out_file_problem(path)
    if problem:
        raise CommandError(problem)


def _check_out_beside(path: str, dataset: str) -> None:
    """Refuse an --out that is one of the dataset's own files: the results written over its
    tools.jsonl or queries.jsonl at the end of the run would destroy the data it ran on."""
    out = Path(path).resolve()
    for name in ("tools.jsonl", "queries.jsonl"):
        if out == (Path(dataset) / name).resolve():
            raise CommandError(
                f"--out {path} is the dataset's {name}: the results would replace it; name "
                "another file"
            )


def _releases(k: int, flag: str, users: int) -> None:
    """Refuse a release threshold of more distinct users than a client has: every entry would
    stay on the clients and SYNAPSE's rows would be the public probe set's accuracy."""
    if k > users:
        raise CommandError(
            f"{flag} {k} is more than --users-per-client {users}: no client could release anything"
        )


def _unused_flag(o: dict) -> str | None:
    """A flag given a value of its own where the run has nothing it applies to (it would be
    silently ignored): what to pass with it, or None."""
    sweep_modes = _names(o["sweep_modes"], "--sweep-modes") if o["sweep_adversarial"] else ()
    sweep_rules = _names(o["sweep_rules"], "--sweep-rules") if o["sweep_adversarial"] else ()
    camouflaged = ((o["adversarial_fraction"] > 0 and o["adversarial_mode"] in CAMOUFLAGED_MODES)
                   or bool(set(sweep_modes) & set(CAMOUFLAGED_MODES)))
    for flag, given, applies, needs in (
        ("--sweep-modes", o["sweep_modes"] != ",".join(ADVERSARIAL_MODES), o["sweep_adversarial"],
         "--sweep-adversarial FRACTIONS"),
        ("--sweep-rules", o["sweep_rules"] != SWEEP_RULES, o["sweep_adversarial"],
         "--sweep-adversarial FRACTIONS"),
        ("--adversarial-mode", o["adversarial_mode"] != ADVERSARIAL_MODE,
         o["adversarial_fraction"] > 0, "--adversarial-fraction above 0"),
        ("--camouflage-share", o["camouflage_share"] != CAMOUFLAGE_SHARE, camouflaged,
         f"adversaries of a camouflaged mode ({' or '.join(CAMOUFLAGED_MODES)}, in "
         "--adversarial-mode or --sweep-modes)"),
        ("--pool-size", o["pool_size"] > 0, o["pool_users"] > 1, "--pool-users 2 or more"),
        ("--llm-model", bool(o["llm_model"]), bool(o["llm_url"]), "--llm URL"),
        ("--trim-fraction", o["trim_fraction"] != SimulationConfig.trim_fraction,
         any(rule != "none" for rule in (o["robust_rule"], *sweep_rules)),
         "a robust rule (--robust-rule or --sweep-rules with --sweep-adversarial)"),
        ("--client-tau", o["client_tau"] is not None, o["pool_users"] <= 1,  # pooling replaces it
         "the clients' near-duplicate collapse (--pool-users 1)"),
    ):
        if given and not applies:
            return f"{flag} applies only with {needs}; this run has none, so it would be ignored"
    return None


def _some_adversary(fraction: float, flag: str, clients: int) -> None:
    """Refuse a nonzero adversarial share that rounds to no adversarial client."""
    if fraction > 0 and adversary_count(clients, fraction) == 0:
        raise CommandError(
            f"{flag} {fraction:g} of {clients} clients is no adversarial client (it rounds to 0); "
            f"use 0 or a share above {0.5 / clients:g}"
        )


def _check_label(label: str) -> None:
    """Refuse a --label longer than a stored run's label can be: it would be stored cut short,
    and `--unless-stored --label` (which looks for the whole label) would never find the run."""
    from federation.models import SimulationRun

    longest = SimulationRun._meta.get_field("label").max_length
    if len(label) > longest:
        raise CommandError(f"--label is at most {longest} characters, not {len(label)}")


def _check_storable() -> None:
    """Refuse, before anything runs, a run that could not be stored for the dashboard: a run of
    half an hour must not end in a database error."""
    from django.db import DatabaseError, connection

    from federation.models import SimulationRun

    try:
        tables = connection.introspection.table_names()
    except DatabaseError as exc:
        raise CommandError(
            f"cannot reach the database to store the run ({str(exc).strip().splitlines()[0]}); "
            "pass --no-store to write --out only"
        ) from None
    if SimulationRun._meta.db_table not in tables:
        raise CommandError(
            "the database has no table for simulation runs yet: run `python manage.py migrate` "
            "first, or pass --no-store to write --out only"
        )
