"""A simulated federation on a labelled routing dataset, through the real components.

Clients turn their share of the train queries into usage logs and build their compendiums with
the client toolkit (`compendium.builder`: masking, clipping, collapse); each organization's edge
merges its clients with `federation.merge.edge_merge`; the server merges the edges with
`server_merge`; queries are routed with `routing.router.Router`. These are the functions the
server pipeline and the client toolkit run; here they run in memory, so that many seeds, sweeps
and baselines finish in minutes and nothing touches a live federation's data.

Transfer (`Simulation.transfer`): the final round's published global compendium, unchanged, is
routed by other consumers (other embedding models, rerankers, LLM endpoints), each refitting only
its fusion weights and calibration on the public probe split: one artifact, many consumers.

Pure: no Django.
"""

from __future__ import annotations

import gzip
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compendium import transport
from compendium.builder import BuildOptions, build_compendium, shared_words
from compendium.canonical import canonical_bytes
from compendium.client_api import nothing_to_submit
from compendium.delta import (
    DEFAULT_SINCE_CONFIDENCE,
    delta_since,
    fit_budget,
    routed_by,
    sent_keys,
    without_sent,
)
from compendium.masking import SHARED_WORD_USERS
from compendium.registry import LabelledQuery, RoutingDataset, Split
from compendium.schema import Compendium, Scenario, Schema, ToolSpec
from compendium.usage_log import parse_record
from federation.merge import drowned_fields, edge_merge, server_merge
from federation.merge.llm import merge_llm
from federation.merge.summarize import LLM_SUMMARIZERS, ProbeSet
from federation.merge.types import ConflictEntry, MergeInput
from federation.round_config import RoundConfig
from federation.simulation.data import (
    ClientShare,
    confusable_tools,
    partition_train,
    split_dataset,
    stable_unit,
    unasked_tools,
    usage_log,
)
from federation.simulation.diagnostics import (
    masking_lipschitz,
    reranker_contraction,
    scenario_pair_lipschitz,
)
from federation.simulation.metrics import (
    accuracy_report,
    auroc,
    membership_scores,
    tokens,
)
from federation.simulation.through_services import ServiceRounds
from routing.embeddings import SETTING_ADVICE, EmbeddingModelUnavailable, get_engine
from routing.router import RERANKERS, Router, fit_router

METHODS = (
    "synapse",
    # Through the services: the final global as the routing API serves it (`routing.services`:
    # the head and fusion weights fitted at publication, the query engine of the settings; with
    # --tune-router, once the server's tuning service has tuned its encoder on it).
    "synapse_served",
    "centralized",
    "local_only",
    "local_only_public_probe",
    "description_only",
    "bm25",
    "unstructured_pool",
    "unstructured_pool_bypass",
    "fed_icl",
    "static_global",
    "reranker_bypass",
)


def probe_requests(probe: Sequence[LabelledQuery]) -> list[str]:
    """The public probe split's requests as a client that fetched them holds them (`GET
    /api/v1/compendium/probe/` orders them by qid): the first part of its round-1 dcz dictionary."""
    return [q.query for q in sorted(probe, key=lambda q: q.qid)]


# Camouflaged poisoning relabels this share of what a client would send honestly and sends the
# rest as it is: an adversary who knows the implausible-source check (whole submissions near
# chance) and stays under it.
CAMOUFLAGE_SHARE = 0.3


def _mean(values: Sequence[float]) -> float | None:
    """The mean; None of nothing (never NaN, which JSON and the stored run cannot hold)."""
    return float(np.mean(values)) if len(values) else None


def communication(outcomes: Sequence[RoundOutcome]) -> dict[str, float | None]:
    """Bytes per client submission over the rounds (None: no client sent anything), and per
    round (0 in a round without submissions)."""
    out = {
        "bytes_per_client_round": _mean([b for o in outcomes for b in o.bytes_raw]),
        "gzip_bytes_per_client_round": _mean([b for o in outcomes for b in o.bytes_gzip]),
        "dcz_bytes_per_client_round": _mean([b for o in outcomes for b in o.bytes_dcz]),
    }
    for o in outcomes:  # the first round sends everything; later ones only what changed
        out[f"bytes_round_{o.round}"] = float(np.mean(o.bytes_raw or [0]))
        out[f"dcz_bytes_round_{o.round}"] = float(np.mean(o.bytes_dcz or [0]))
    return out


def adversary_count(clients: int, fraction: float) -> int:
    """How many of `clients` are adversarial at `fraction` (rounded to the nearest, half to
    even): what `Simulation.prepare` draws."""
    return round(clients * fraction)


@dataclass
class SimulationConfig:
    orgs: int = 5
    clients_per_org: int = 4
    rounds: int = 3
    partition: str = "category"
    epsilon: float = 1.0
    mask_strength: float = 1.0
    tau: float = 0.85
    summarizer: str = "probe-extractive"
    robust_rule: str = "none"
    trim_fraction: float = 0.1  # f = floor(trim_fraction * n) for the robust rule
    reranker: str = "fusion"
    users_per_client: int = 3
    error_rate: float = 0.15
    probe_fraction: float = 0.1
    test_fraction: float = 0.4
    test_limit: int | None = None
    queries_per_client: int | None = None  # cap each client's share (quick runs, the demo)
    fed_icl_exemplars: int = 8
    fit_limit: int | None = 1000  # probe queries used to fit fusion weights and calibration
    membership_samples: int = 40
    baselines: bool = True
    adversarial_fraction: float = 0.0
    adversarial_mode: str = "random_corruption"
    # Camouflaged poisoning: the share of each submission's scenarios relabelled (`corrupt`).
    camouflage_share: float = CAMOUFLAGE_SHARE
    # The server carries the previous global forward and each client sends only what changed
    # since the global it pulled (compendium.delta); False: every client resends everything
    # but what the public probe set's router already routes (as `participate` does then).
    carry_forward: bool = True
    # A client also leaves out the scenarios the pulled global's router (before any global, or
    # without carry-forward: the public probe set's) already sends to their tool, and the
    # precautions whose request it sends to another tool, with at least this calibrated
    # confidence (compendium.delta); above 1: the cosine rule alone.
    since_confidence: float = DEFAULT_SINCE_CONFIDENCE
    # Each honest client cuts what it sends to at most this many canonical bytes
    # (`compendium.delta.fit_budget`); None: no budget. Adversaries ignore it.
    max_bytes: int | None = None
    # k-anonymous release at the clients (compendium.builder): entries supported by fewer distinct
    # users stay local; `client_tau` is the clients' collapse threshold (None: `tau`).
    min_users: int = 1
    pool_users: int = 1  # pooled release at the clients (compendium.builder.pool_entries); 1: off
    pool_size: int = 0  # requests per pool at least (0: pool_users)
    shared_word_users: int = SHARED_WORD_USERS  # compendium.builder.shared_words; 0: off
    max_words: int = 0  # BuildOptions.max_words: what clients send; Centralized pools whole requests
    client_tau: float | None = None
    linear_head: bool = True  # routers fit the linear head on the compendium they route with
    diagnostics: bool = True  # the paper's Lipschitz, contraction and margin diagnostics
    diagnostic_pairs: int = 1000  # text pairs for the Lipschitz ratios
    diagnostic_queries: int = 300  # held-out queries for the contraction ratio and margin

    # Transfer: the final global compendium evaluated, unchanged, under each (model, reranker);
    # models are `routing.embeddings.get_engine` names ("" = the simulation's own engine). Either
    # tuple non-empty asks for it (no models: the own engine; no rerankers: fusion).
    transfer_models: tuple[str, ...] = ()
    transfer_rerankers: tuple[str, ...] = ()
    llm_url: str | None = None  # OpenAI-compatible endpoint for the `llm` reranker and summarizers
    llm_model: str = ""

    # Aggregation cadence: the federation aggregates in round 1 and then every `aggregate_every`
    # rounds; in between, clients keep working against the global they pulled and send nothing.
    # 0: frozen after round 1.
    aggregate_every: int = 1
    # Drift of the workload: with `drift_every` D > 0, half of the tool categories are in use in
    # round 1 and the others come into use in groups at rounds 1 + D, 1 + 2D, ... (`drift_plan`);
    # clients meet a category's requests only once it is in use, and each round is scored on the
    # held-out requests of the categories in use then (none: the round is not measured, its
    # figures null, `_row`). 0: no drift.
    drift_every: int = 0
    # Contradictory scenarios: this share of each honest client's scenarios is contradicted by
    # another client of its organization, which reports the same request for a confusable tool
    # (`contradict`). `conflict_log`: the merges' IsConsistent and conflict log (RoundConfig).
    contradiction_fraction: float = 0.0
    conflict_log: bool = True
    # The server's tuned router (`routing.finetune.tune_router`, SYNAPSE_ROUTER_TUNE_EPOCHS in the
    # product): with E > 0, every published global (and Centralized's) is routed with an encoder
    # fine-tuned on it for E epochs; `synapse_untuned` rows keep the frozen router's accuracy.
    tune_router_epochs: int = 0
    # The rounds close through the product's services (`through_services`; what `simulate` does
    # unless --in-memory): submission service, close, eager Celery merge pipeline, publication,
    # in a scratch database; False (the default here, for the benchmarks that build a Simulation
    # themselves): the same merge operator called in memory (faster;
    # tests/test_simulation_pipeline.py checks that both publish the same compendium).
    through_services: bool = False


@dataclass
class RoundOutcome:
    round: int
    global_compendium: Compendium
    # Each client's whole local compendium: a flagrant adversary's as it corrupted it, a
    # camouflaged one's honest (it corrupts only what it sends, `submissions`).
    client_compendiums: dict[str, Compendium]
    # What each client had to send (the change since `pulled`); one with nothing in it
    # (`nothing_to_submit`) was not sent, and has no byte figure.
    submissions: dict[str, Compendium]
    bytes_raw: list[int]
    bytes_gzip: list[int]
    bytes_dcz: list[int]  # dcz against the dictionary the client holds (compendium.transport)
    merge_stats: dict[str, Any]
    # Per adversarial client, how many scenarios it sent under another tool than the one its
    # honest compendium gives their text (`_relabelled`).
    relabelled: dict[str, int] = field(default_factory=dict)


@dataclass
class SeedResult:
    seed: int
    rows: list[dict] = field(default_factory=list)
    per_category: dict[str, dict] = field(default_factory=dict)
    communication: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, float] = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    diagnostics: dict[str, float] = field(default_factory=dict)
    transfer: list[dict] = field(default_factory=list)  # one row per transfer variant
    # Client submissions over the rounds, honest and adversarial, and how many of each the edges'
    # implausible-source check dropped whole (`screening`).
    screening: dict[str, int] = field(default_factory=dict)
    # The final round's test queries of the attack's victim tools and how many of them were
    # routed to its target (`attack_target`; measured in every run, attacked or not).
    targeting: dict[str, int] = field(default_factory=dict)


@dataclass
class SeedSetup:
    """Everything a seed's federation starts from: the split, the test queries actually
    evaluated, the clients' shares and usage logs, the adversarial clients."""

    split: Split
    test: list[LabelledQuery]
    shares: list[ClientShare]
    logs: dict[str, list[dict]]
    adversaries: set[str] | None
    # The round from which each category is in use (`drift_plan`; all 1 without drift).
    category_start: dict[str, int] = field(default_factory=dict)

    def starts(self, share: ClientShare, category_of: dict[str, str]) -> list[int]:
        """Per line of the share's usage log (one per query, in order), the round from which
        it can occur."""
        return [self.category_start.get(category_of.get(q.tool_id) or "", 1) for q in share.queries]

    def in_use(self, round_: int) -> set[str]:
        """The categories in use in `round_` (all of them without drift)."""
        return {name for name, start in self.category_start.items() if start <= round_}

    def test_at(self, round_: int, category_of: dict[str, str]) -> list[LabelledQuery]:
        """The held-out requests of the categories in use in `round_` (possibly none: a round
        whose categories have no held-out request is not measured, `_row`)."""
        if not self.category_start:
            return self.test
        return [q for q in self.test
                if self.category_start.get(category_of.get(q.tool_id) or "", 1) <= round_]


@dataclass(frozen=True)
class TransferVariant:
    """One consumer of a published compendium: its embedding model (None: the simulation's own
    engine), its reranker, and for `llm` its LLM backend (None: every decision falls back to
    fusion, and the row counts it)."""

    model: str | None = None
    reranker: str = "fusion"
    llm: Any = None


Progress = Callable[[str], None]


def _records(lines: Sequence[dict], tool_ids: frozenset[str]):
    return [parse_record(line, number, tool_ids) for number, line in enumerate(lines, start=1)]


def _slices(items: list, parts: int) -> list[list]:
    """Cut a client's experience into `parts` consecutive periods (one per round)."""
    size = len(items)
    return [items[(i * size) // parts : ((i + 1) * size) // parts] for i in range(parts)]


def drift_plan(categories: Sequence[str], rounds: int, every: int, seed: int) -> dict[str, int]:
    """The round from which each category's requests occur: with `every` D > 0 and at least one
    drift event within `rounds` (at rounds 1 + D, 1 + 2D, ...), a seeded half of the categories
    from round 1 and the rest in equal groups, one group per event; otherwise all from round 1."""
    names = sorted(set(categories))
    events = list(range(1 + every, rounds + 1, every)) if every > 0 else []
    if not events or len(names) < 2:
        return dict.fromkeys(names, 1)
    random.Random(f"drift|{seed}").shuffle(names)
    start = (len(names) + 1) // 2
    plan = dict.fromkeys(names[:start], 1)
    later = names[start:]
    for index, name in enumerate(later):
        plan[name] = events[(index * len(events)) // len(later)]
    return plan


def _periods(lines: list, starts: Sequence[int], rounds: int) -> list[list]:
    """A client's experience per round: the lines whose category comes into use at round a are
    spread over rounds a..`rounds` in their order (`starts`: a per line; all 1 without drift,
    which is `_slices`)."""
    periods: list[list] = [[] for _ in range(rounds)]
    for first in sorted(set(starts)):
        group = [line for line, a in zip(lines, starts, strict=True) if a == first]
        for offset, part in enumerate(_slices(group, rounds - first + 1)):
            periods[first - 1 + offset].extend(part)
    return periods


def aggregates_in(round_: int, every: int) -> bool:
    """Whether the federation aggregates in `round_` under the cadence `every` (0: frozen)."""
    if round_ == 1:
        return True
    return every > 0 and (round_ - 1) % every == 0


class Simulation:
    """One dataset, one engine; `run_seed` plays a whole federation for one seed."""

    def __init__(
        self,
        dataset: RoutingDataset,
        schema: Schema,
        engine,
        config: SimulationConfig,
        progress: Progress | None = None,
    ):
        self.dataset = dataset
        self.schema = schema
        self.engine = engine
        self.config = config
        self.progress = progress or (lambda message: None)
        self.tool_ids = frozenset(schema.tool_ids)
        self.category_of = {t.tool_id: t.category for t in dataset.tools}
        self._transfer_variants: list[TransferVariant] | None = None
        self._probe_cache: dict[int, dict[str, np.ndarray]] = {}
        self._summarizer_llm = None
        # Rounds closed through the product's services (in the scratch database that
        # `through_services.scratch_database` holds for the run).
        merges_llm = config.llm_url if config.summarizer in LLM_SUMMARIZERS else None
        self.services = (
            ServiceRounds(dataset, llm_url=merges_llm) if config.through_services else None
        )
        # The seeds of the run in play order (`seed_name`), and the round being played (None:
        # none): what a progress line or an error says.
        self.seeds: list[int] = []
        self.at_round: int | None = None

    def seed_name(self, seed: int) -> str:
        """'seed 7 (2/5)': the seed and its place among the run's seeds."""
        if seed not in self.seeds:
            return f"seed {seed}"
        return f"seed {seed} ({self.seeds.index(seed) + 1}/{len(self.seeds)})"

    # --- building blocks ---------------------------------------------------------------------

    def _round_config(self, seed: int) -> RoundConfig:
        c = self.config
        return RoundConfig(
            tau=c.tau,
            epsilon=c.epsilon,
            mask_strength=c.mask_strength,
            summarizer=c.summarizer,
            robust_rule=c.robust_rule,
            trim_fraction=c.trim_fraction,
            seed=seed,
            carry_forward=c.carry_forward,
            conflict_log=c.conflict_log,
        )

    def build_client(
        self, lines: Sequence[dict], seed: int, strength: float | None = None,
        not_released: frozenset[str] = frozenset(), max_words: int | None = None,
    ) -> Compendium:
        options = BuildOptions(
            not_released=not_released,
            strength=self.config.mask_strength if strength is None else strength,
            seed=seed,
            tau=self.config.client_tau or self.config.tau,
            min_users=self.config.min_users,
            pool_users=self.config.pool_users,
            pool_size=self.config.pool_size,
            shared_word_users=self.config.shared_word_users,
            max_words=self.config.max_words if max_words is None else max_words,
        )
        compendium, _ = build_compendium(
            _records(lines, self.tool_ids), self.schema, options, embedder=self.engine
        )
        return compendium

    def router(
        self,
        compendium: Compendium,
        probe: Sequence[LabelledQuery],
        reranker: str | None = None,
        *,
        engine=None,
        llm=None,
    ) -> Router:
        """A router over `compendium` as the server publishes it: the linear head
        (`config.linear_head`) fitted on the compendium and on the public probe split, as
        `federation.pipeline.routing_head` does; fusion weights and calibration fitted on the
        probe split too (never on test data), cross-fitted: they are fitted on one half of the
        probe with a head that learnt from the other half, so that they weigh a head that has not
        seen the requests they are fitted on. `engine` (default: the simulation's) embeds both
        the scenarios and the queries; `llm` is the `llm` reranker's backend."""
        engine = engine or self.engine
        return fit_router(
            compendium, engine, [(q.query, q.tool_id) for q in probe], reranker or self.config.reranker,
            probe_vectors=self._probe_vectors(engine, probe) if self.config.linear_head else None,
            linear_head=self.config.linear_head, fit_limit=self.config.fit_limit, llm=llm,
            fitted_on="simulation probe split",
        )

    def tuned_router(
        self, compendium: Compendium, probe: Sequence[LabelledQuery], seed: int, what: str
    ) -> Router:
        """The router the server publishes with `compendium` when it tunes its routing encoder
        (`routing.finetune.tune_router`, `config.tune_router_epochs` epochs): the simulation's
        model (in fp32 where it is a MiniLM build) fine-tuned on the compendium and the probe
        split's learn half, its fusion weights fitted on the other half."""
        import tempfile

        from routing.embeddings import MINILM_BUILDS
        from routing.finetune import tune_router

        name = getattr(self.engine, "model_name", "")
        base = None if name in MINILM_BUILDS else name
        epochs = self.config.tune_router_epochs
        self.progress(f"{self.seed_name(seed)}: {what}: tuning the routing encoder ({epochs} epoch(s))")
        with tempfile.TemporaryDirectory(prefix="synapse-tuned-router-") as path:
            tuned = tune_router(
                compendium, [(q.query, q.tool_id) for q in probe], path, epochs=epochs,
                seed=seed, base_model=base, fit_limit=self.config.fit_limit,
            )
        return tuned.router.with_reranker(self.config.reranker)

    def _probe_vectors(self, engine, probe: Sequence[LabelledQuery]) -> np.ndarray:
        """The probe split (or part of it) embedded by `engine`, kept for later routers."""
        texts = [q.query for q in probe]
        if not texts:
            return np.zeros((0, engine.dimension), dtype=np.float32)
        if id(engine) not in self._probe_cache:
            self._probe_cache.clear()  # one engine at a time
            self._probe_cache[id(engine)] = {}
        known = self._probe_cache[id(engine)]
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        if missing:
            known.update(zip(missing, np.asarray(engine.embed(missing), dtype=np.float32), strict=True))
        return np.array([known[t] for t in texts], dtype=np.float32)

    def evaluate(self, router: Router, test: Sequence[LabelledQuery]):
        return self._route_and_score(router, test)[0]

    def _route_and_score(self, router: Router, test: Sequence[LabelledQuery]):
        """The accuracy report of `router` on `test`, and its decisions."""
        decisions = router.route_batch([q.query for q in test])
        report = accuracy_report(
            [d.tool or "" for d in decisions],
            [q.tool_id for q in test],
            [self.category_of.get(q.tool_id, "") for q in test],  # the tool's (`_categories`)
        )
        return report, decisions

    def _probe_set(self, probe: Sequence[LabelledQuery]) -> ProbeSet:
        return ProbeSet(
            [q.query for q in probe],
            [q.tool_id for q in probe],
            self._probe_vectors(self.engine, probe),
        )

    def federate(
        self,
        shares: Sequence[ClientShare],
        logs: dict[str, list[dict]],
        probe: Sequence[LabelledQuery],
        seed: int,
        adversaries: set[str] | None = None,
        starts: dict[str, list[int]] | None = None,
    ) -> list[RoundOutcome]:
        """Rounds of client builds, edge merges and the server merge. `starts`: per client and
        log line, the round from which the line can occur (drift; default: all from round 1).
        Rounds in which the cadence does not aggregate (`aggregates_in`) send nothing and keep
        the last global."""
        config = self._round_config(seed)
        probe_set = self._probe_set(probe)
        rounds = self.config.rounds
        periods = {
            client: _periods(lines, (starts or {}).get(client) or [1] * len(lines), rounds)
            for client, lines in logs.items()
        }
        conflicts: dict[str | None, list[ConflictEntry]] = {}  # each edge's last log; the server's at None
        outcomes = []
        llm = self.summarizer_llm()
        confusions = confusable_tools(self.dataset.tools, seed)
        pulled: Compendium | None = None  # the global the clients pulled before this round
        published: Compendium | None = None  # the last global the server published
        # What `synapse-client submit --since` compresses against (round 1: `--schema --probe`).
        dictionary = transport.probe_dictionary(self.schema, probe_requests(probe))
        # What the open round says its edges will not release, every client approved
        # (`accounting.fields_not_released`): the clients leave those fields out.
        enrolled = Counter(share.organization for share in shares)
        not_released = drowned_fields(
            self.schema, config, max(enrolled.values(), default=0), len(enrolled)
        )
        sent_before: dict[str, set[str]] = defaultdict(set)  # each client's record of what it sent
        if self.services is not None:  # a new, empty federation in the scratch database
            self.services.begin(shares, probe, seed)
        mode = self.config.adversarial_mode
        camouflage = mode in CAMOUFLAGED_MODES
        target, victims = attack_target(self.dataset.tools, seed)
        for r in range(1, rounds + 1):
            self.at_round = r
            if published is not None and not aggregates_in(r, self.config.aggregate_every):
                outcomes.append(RoundOutcome(r, published, {}, {}, [], [], [], {}))
                continue
            leave_out = not_released
            if self.services is not None:  # the open round says what it will not release
                leave_out = self.services.open(config)
            self.progress(f"{self.seed_name(seed)}: round {r}/{rounds}: clients build")
            clients: dict[str, Compendium] = {}
            honest_of: dict[str, Compendium] = {}  # an adversary's honest compendium
            sent: dict[str, Compendium] = {}
            relabelled: dict[str, int] = {}
            route = None
            if self.config.since_confidence <= 1.0 and (pulled is None or pulled.scenarios):
                # What each client would route with: the pulled global, as published (round 1:
                # the public probe set alone, which every client holds).
                route = routed_by(self.router(pulled or Compendium(), probe))
            for share in shares:
                experience = [line for period in periods[share.client][:r] for line in period]
                if not experience:
                    continue
                compendium = self.build_client(experience, seed, not_released=leave_out)
                if adversaries and share.client in adversaries:
                    honest_of[share.client] = compendium
                    if not camouflage:
                        compendium = corrupt(compendium, self.config.adversarial_mode, self.schema, seed)
                clients[share.client] = compendium
            if self.config.contradiction_fraction > 0:
                honest = [s for s in shares if s.client in clients and s.client not in (adversaries or ())]
                clients.update(contradict({s.client: clients[s.client] for s in honest},
                                          {s.client: s.organization for s in honest},
                                          self.config.contradiction_fraction, confusions, seed))
            poison = (coordinated_poison(list(honest_of.values()), probe, target, victims)
                      if mode == "coordinated_camouflage" else [])
            for client, compendium in clients.items():
                adversary = bool(adversaries) and client in adversaries
                if pulled is not None or route is not None:
                    compendium, _ = delta_since(
                        compendium, pulled or Compendium(), self.engine, self.config.tau,
                        route=route, confidence=self.config.since_confidence,
                    )
                if pulled is not None:
                    compendium, _ = without_sent(compendium, sent_before[client])
                if self.config.max_bytes and not adversary:
                    compendium, _ = fit_budget(compendium, self.config.max_bytes)
                sent_before[client] |= sent_keys(compendium)  # what the budget deferred is not sent
                if adversary and mode == "coordinated_camouflage":
                    # It adds the share of what it sends that the colluders agreed on, the
                    # same entries as every other adversary's (its record holds the honest ones).
                    compendium, relabelled[client] = plant(
                        compendium, poison, self.config.camouflage_share)
                elif adversary:
                    if camouflage:
                        # It relabels a share of what it would send honestly, drawn afresh per
                        # client and round: that share of every submission is poisoned, whatever
                        # the client rules leave home (its record holds the honest entries).
                        compendium = corrupt(
                            compendium, mode, self.schema, seed,
                            share=self.config.camouflage_share, salt=f"{client}|{r}",
                        )
                    relabelled[client] = _relabelled(honest_of[client], compendium)
                sent[client] = compendium
            # A client with nothing to submit sends nothing (`synapse-client participate`; the
            # services and `_merge` skip it): no body is measured for it.
            bodies = {client: c for client, c in sent.items() if not nothing_to_submit(c)}
            payloads = [canonical_bytes(c) for c in bodies.values()]
            # What `synapse-client submit --since` puts on the wire: dcz against the dictionary
            # the client holds (the pulled global; round 1: the probe set's requests and schema).
            wires = [transport.compress(b, dictionary) for b in payloads]
            if self.services is not None:
                self.progress(f"{self.seed_name(seed)}: round {r}: submissions, close, merge pipeline")
                merged, stats = self.services.close(r, bodies, dict(zip(bodies, wires, strict=True)))
                if merged is None:  # nothing reached a merge: the last global stays
                    merged = published or Compendium()
            else:
                self.progress(f"{self.seed_name(seed)}: round {r}: edge and server merges")
                merged, stats = self._merge(
                    r, seed, shares, sent, config=config, probe_set=probe_set, llm=llm,
                    not_released=not_released, conflicts=conflicts, pulled=pulled,
                )
            published = merged
            if self.config.carry_forward:
                pulled = merged
            outcomes.append(
                RoundOutcome(
                    round=r,
                    global_compendium=merged,
                    client_compendiums=clients,
                    submissions=sent,
                    bytes_raw=[len(b) for b in payloads],
                    bytes_gzip=[len(gzip.compress(b, 9, mtime=0)) for b in payloads],
                    bytes_dcz=[len(w) for w in wires],
                    merge_stats=stats,
                    relabelled=relabelled,
                )
            )
            dictionary = transport.global_dictionary(merged)
        self.at_round = None
        return outcomes

    def _merge(
        self, r: int, seed: int, shares: Sequence[ClientShare], sent: dict[str, Compendium], *,
        config: RoundConfig, probe_set: ProbeSet | None, llm, not_released: frozenset[str],
        conflicts: dict[str | None, list[ConflictEntry]], pulled: Compendium | None,
    ) -> tuple[Compendium, dict[str, Any]]:
        """Round `r`'s edge merges (one per organization) and the server merge, in memory, as
        the pipeline runs them (tests/test_simulation_pipeline.py holds the two to the same
        result). `conflicts`: each edge's last log and the server's (at None), updated here."""
        edges = []
        stats = {}
        scales: dict[str, dict[tuple[str, str], float]] = {}
        # A client with nothing to submit sends nothing (`synapse-client participate`, and the
        # rounds through the services): its edge neither counts it nor merges without senders.
        sent = {client: c for client, c in sent.items() if not nothing_to_submit(c)}
        senders = Counter(s.organization for s in shares if s.client in sent)
        drowned = not_released | drowned_fields(
            self.schema, config, max(senders.values(), default=0), len(senders)
        )
        for org in sorted({s.organization for s in shares}):
            inputs = [
                MergeInput(s.client, sent[s.client])
                for s in shares
                if s.organization == org and s.client in sent
            ]
            if not inputs:
                continue
            result = edge_merge(
                inputs,
                self.schema,
                config,
                conflicts.get(org, ()),
                embed=self.engine.embed,
                probe_set=probe_set,
                llm=llm,
                seed=np.random.SeedSequence([seed, r, len(edges)]),
                drowned=drowned,
            )
            conflicts[org] = result.conflicts
            edges.append(MergeInput(org, result.compendium))
            scales[org] = result.noise_scales
            stats[org] = result.stats.as_dict()
        merged = server_merge(
            edges, self.schema, config, embed=self.engine.embed, probe_set=probe_set,
            llm=llm, previous=pulled, previous_conflicts=conflicts.get(None, ()),
            noise_scales=scales,
        )
        conflicts[None] = merged.conflicts
        stats["server"] = merged.stats.as_dict()
        return merged.compendium, stats

    # --- one seed ----------------------------------------------------------------------------

    def prepare(self, seed: int) -> SeedSetup:
        """The seed's split, test sample, client shares, usage logs and adversaries."""
        c = self.config
        split = split_dataset(
            self.dataset, seed=seed, probe_fraction=c.probe_fraction, test_fraction=c.test_fraction
        )
        test = split.test
        if c.test_limit and len(test) > c.test_limit:
            test = random.Random(seed).sample(test, c.test_limit)
        shares = partition_train(
            split.train, self.dataset.tools, orgs=c.orgs, clients_per_org=c.clients_per_org,
            mode=c.partition, seed=seed,
        )
        if c.queries_per_client:
            for share in shares:
                share.queries = share.queries[: c.queries_per_client]
        confusions = confusable_tools(self.dataset.tools, seed)
        logs = {
            s.client: usage_log(
                s, confusions, seed=seed, users=c.users_per_client, error_rate=c.error_rate
            )
            for s in shares
        }
        adversaries = None
        if c.adversarial_fraction > 0:
            count = adversary_count(len(shares), c.adversarial_fraction)
            adversaries = set(random.Random(seed).sample([s.client for s in shares], count))
        plan = {}
        if c.drift_every > 0:  # the categories of tools no query is of would bring nothing in
            unasked = set(unasked_tools(self.dataset))
            categories = [self.category_of.get(t.tool_id) or "" for t in self.dataset.tools
                          if t.tool_id not in unasked]
            plan = drift_plan(categories, c.rounds, c.drift_every, seed)
            if set(plan.values()) == {1}:
                plan = {}
        return SeedSetup(split, test, shares, logs, adversaries, plan)

    def play(self, setup: SeedSetup, seed: int) -> list[RoundOutcome]:
        """The seed's federation, round by round, from what `prepare(seed)` gave."""
        starts = (
            {s.client: setup.starts(s, self.category_of) for s in setup.shares}
            if setup.category_start else None
        )
        return self.federate(setup.shares, setup.logs, setup.split.probe, seed, setup.adversaries, starts)

    def run_seed(self, seed: int) -> SeedResult:
        c = self.config
        setup = self.prepare(seed)
        split, test, shares, logs = setup.split, setup.test, setup.shares, setup.logs
        variants = self.transfer_variants()  # checked before the federation runs
        result = SeedResult(seed)
        outcomes = self.play(setup, seed)
        result.screening = screening(outcomes, setup.adversaries or set())
        final = outcomes[-1]
        self.progress(f"{self.seed_name(seed)}: evaluating")
        router = untuned = static = routed = None
        for outcome in outcomes:
            if outcome.global_compendium is not routed:  # a round without aggregation keeps it
                routed = outcome.global_compendium
                router = untuned = self.router(routed, split.probe)
                if c.tune_router_epochs:
                    router = self.tuned_router(routed, split.probe, seed, f"round {outcome.round}")
                if static is None:  # the round-1 global's router, frozen
                    static = router
            scored = setup.test_at(outcome.round, self.category_of)
            if not scored:  # nothing to score it on: not measured, never a 0.000 (`_row`)
                in_use = sorted(setup.in_use(outcome.round))
                self.progress(
                    f"{self.seed_name(seed)}: round {outcome.round}: not measured: none of the "
                    f"{len(test)} test queries is of the categories in use then "
                    f"({', '.join(name or 'uncategorized' for name in in_use)})"
                )
            report, decisions = self._route_and_score(router, scored)
            result.rows.append(_row("synapse", outcome.round, seed, report))
            if outcome is final:
                result.targeting = targeting(scored, decisions, *attack_target(self.dataset.tools, seed))
            if c.tune_router_epochs:
                result.rows.append(
                    _row("synapse_untuned", outcome.round, seed, self.evaluate(untuned, scored))
                )
            result.rounds.append(
                {
                    "round": outcome.round,
                    "aggregated": bool(outcome.submissions),
                    "scenarios_submitted": sum(len(c.scenarios) for c in outcome.submissions.values()),
                    "test_queries": len(scored),
                    "global_scenarios": len(outcome.global_compendium.scenarios),
                    "global_size_bytes": len(canonical_bytes(outcome.global_compendium)),
                    "merge": outcome.merge_stats,
                }
            )
            if outcome is final:
                result.per_category = report.per_category
                final_router = router
            if c.baselines:
                bypass = self.evaluate(router.with_reranker("none"), scored)
                result.rows.append(_row("reranker_bypass", outcome.round, seed, bypass))
                result.rows.append(
                    _row("static_global", outcome.round, seed, self.evaluate(static, scored))
                )
        if self.services is not None:
            if c.tune_router_epochs:
                self.progress(f"{self.seed_name(seed)}: the server tunes its router on the final global "
                              f"({c.tune_router_epochs} epoch(s))")
            served = self.services.served_router(c.reranker, c.tune_router_epochs)
            if served is None:  # no row rather than a figure of a router nobody serves
                self.progress(f"{self.seed_name(seed)}: no round was published, the routing API "
                              "serves nothing: no synapse_served row")
            else:
                scored = setup.test_at(final.round, self.category_of)
                result.rows.append(
                    _row("synapse_served", final.round, seed, self.evaluate(served, scored)))
        result.communication = communication(outcomes)
        if c.diagnostics:
            self.progress(f"{self.seed_name(seed)}: diagnostics")
            result.diagnostics = self.diagnostics(final_router, split, test, seed, logs)
        sent = _everything_sent(outcomes)
        result.privacy = self.membership_attack(shares, sent, split.test, seed)
        if variants:
            self.progress(f"{self.seed_name(seed)}: transfer of the final global to {len(variants)} variants")
            rows = self.transfer(final.global_compendium, split.probe, test, variants)
            result.transfer = [{"seed": seed, **row} for row in rows]
        if c.baselines:
            self.progress(f"{self.seed_name(seed)}: baselines")
            for method, report in self.baselines(shares, logs, final, split, test, seed, sent,
                                                 adversaries=setup.adversaries).items():
                result.rows.append(_row(method, None, seed, report))
        return result

    # --- diagnostics --------------------------------------------------------------------------

    def diagnostics(self, router: Router, split, test, seed: int, logs) -> dict[str, float]:
        """federation.simulation.diagnostics on this seed: masking distortion of the clients'
        private queries at λ in {0.5, 1, 1.5} and the configured λ, each masked as its client
        masks it (with the words enough of its users wrote released), scenario pairs of the final
        global compendium, and the fusion reranker's contraction and margin on held-out queries."""
        c = self.config
        rng = random.Random(f"diagnostics|{seed}")
        released = {
            client: shared_words(_records(lines, self.tool_ids), c.shared_word_users)
            if c.shared_word_users else frozenset()
            for client, lines in logs.items()
        }
        pairs = [(line["query"], client) for client, lines in sorted(logs.items()) for line in lines]
        picked = rng.sample(pairs, min(c.diagnostic_pairs, len(pairs)))
        private = [text for text, _ in picked]
        strengths = sorted({0.5, 1.0, 1.5, c.mask_strength} - {0.0})
        out = masking_lipschitz(private, self.dataset.tools, strengths, self.engine.embed, seed,
                                shared=[released[client] for _, client in picked])
        out.update(
            scenario_pair_lipschitz(
                [s.text for s in router.index.compendium.scenarios], self.engine.embed,
                c.diagnostic_pairs, seed,
            )
        )
        queries = [q.query for q in rng.sample(list(test), min(c.diagnostic_queries, len(test)))]
        out.update(reranker_contraction(router.with_reranker("fusion"), queries, seed=seed))
        return out

    # --- transfer ----------------------------------------------------------------------------

    def summarizer_llm(self):
        """The edges' and the server's LLM (`--llm`) when the summarizer is an LLM one, as the
        pipeline passes its configured endpoint; None otherwise."""
        c = self.config
        if c.summarizer not in LLM_SUMMARIZERS or not c.llm_url:
            return None
        if self._summarizer_llm is None:
            self._summarizer_llm = merge_llm(c.llm_url, c.llm_model or "default")
        return self._summarizer_llm

    def transfer_variants(self) -> list[TransferVariant]:
        """The variants the configuration asks for, resolved once and checked up front (see
        `transfer_variants`)."""
        if self._transfer_variants is None:
            self._transfer_variants = transfer_variants(self.config)
        return self._transfer_variants

    def transfer(
        self,
        compendium: Compendium,
        probe: Sequence[LabelledQuery],
        test: Sequence[LabelledQuery],
        variants: Sequence[TransferVariant],
    ) -> list[dict]:
        """Route `test` against the same, never rebuilt `compendium` under each variant: its
        engine embeds the scenarios and the queries, fusion weights and calibration are refitted
        on the public probe split (`router`), and its reranker decides. One row per variant with
        accuracy, macro accuracy and how many decisions fell back (for `llm`: no LLM, or its
        answer was unusable)."""
        fitted: dict[str | None, Router] = {}  # one fit per model, shared by its rerankers
        rows = []
        for variant in variants:
            if variant.model not in fitted:
                engine = self.engine if variant.model is None else get_engine(variant.model)
                fitted[variant.model] = self.router(compendium, probe, "fusion", engine=engine)
            router = fitted[variant.model].with_reranker(variant.reranker, llm=variant.llm)
            report, decisions = self._route_and_score(router, test)
            rows.append(
                {
                    "model": getattr(router.engine, "model_name", None) or "simulation engine",
                    "reranker": variant.reranker,
                    "llm": getattr(variant.llm, "name", None) if variant.llm is not None else None,
                    "accuracy": round(report.accuracy, 4),
                    "macro_accuracy": round(report.macro_accuracy, 4),
                    "queries": len(decisions),
                    "fallbacks": sum(d.fallback_reason is not None for d in decisions),
                }
            )
        return rows

    # --- baselines ---------------------------------------------------------------------------

    def centralized_global(self, shares, logs, split, seed: int) -> Compendium:
        """The paper's Centralized-SYNAPSE: one client toolkit build over every client's log, then
        one server merge (no edges, no rounds)."""
        every_line = [line for s in shares for line in logs[s.client]]
        # nothing crosses a wire here, so nothing is cut to save bytes
        central = self.build_client(every_line, seed, max_words=0)
        return server_merge(
            [MergeInput("centralized", central)],
            self.schema,
            self._round_config(seed),
            embed=self.engine.embed,
            probe_set=self._probe_set(split.probe),
        ).compendium

    def baselines(
        self, shares, logs, final: RoundOutcome, split, test, seed, sent: dict[str, Compendium],
        adversaries: set[str] | None = None,
    ) -> dict[str, Any]:
        """Every baseline on the run's split and test sample. The ones that share data instead of
        a merged compendium (the unstructured pool, Fed-ICL) are routed by the same router as
        SYNAPSE (linear head and fusion weights fitted on the public probe split, which every
        participant has): what differs is what is shared, not the router. Description-only and
        BM25 are the paper's public-knowledge references (top-1 cosine over the descriptions,
        lexical retrieval over the global); `unstructured_pool_bypass` is the pool under top-1
        cosine, beside SYNAPSE's `reranker_bypass`."""
        out = {}
        central_global = self.centralized_global(shares, logs, split, seed)
        if self.config.tune_router_epochs:
            central_router = self.tuned_router(central_global, split.probe, seed, "centralized")
        else:
            central_router = self.router(central_global, split.probe)
        out["centralized"] = self.evaluate(central_router, test)

        # Each client alone: its router learns from the probe's requests of its own tools only (a
        # client outside the federation has no labelled requests of tools it never used); with
        # the federation's whole public probe set instead, its head also covers every other tool.
        # Honest clients only: an adversary's compendium is corrupted for the federation, not
        # what a client alone would route with.
        alone, with_probe = [], []
        for client, compendium in final.client_compendiums.items():
            if not compendium.scenarios or client in (adversaries or ()):
                continue
            own = {s.tool_id for s in compendium.scenarios}
            own_probe = [q for q in split.probe if q.tool_id in own]
            alone.append(self.evaluate(self.router(compendium, own_probe), test))
            with_probe.append(self.evaluate(self.router(compendium, split.probe), test))
        if alone:
            out["local_only"] = _mean_report(alone)
            out["local_only_public_probe"] = _mean_report(with_probe)
        else:  # no row rather than a 0.000 no client measured
            self.progress(f"{self.seed_name(seed)}: no honest client holds a compendium: no "
                          "local_only rows")

        descriptions = Compendium(
            scenarios=[Scenario(tool_id=t.tool_id, text=t.description) for t in self.dataset.tools]
        )
        out["description_only"] = self.evaluate(Router(descriptions, self.engine, "none"), test)
        out["bm25"] = self.bm25(final.global_compendium, test)
        # Every scenario the clients submitted over the rounds (masked, as sent), pooled
        # without a merge.
        pool = Compendium(
            scenarios=_unique_scenarios(s for c in sent.values() for s in c.scenarios)
        )
        out["unstructured_pool"] = self.evaluate(self.router(pool, split.probe), test)
        out["unstructured_pool_bypass"] = self.evaluate(Router(pool, self.engine, "none"), test)
        # Fed-ICL: each client shares k raw requests its log routed successfully, and the prompt
        # lists the tools (their descriptions), as any in-context routing prompt does.
        rng = random.Random(seed)
        exemplars = []
        for share in shares:
            successes = [line for line in logs[share.client] if line["outcome"] == "success"]
            for line in rng.sample(successes, min(self.config.fed_icl_exemplars, len(successes))):
                exemplars.append(Scenario(tool_id=line["tool"], text=line["query"]))
        icl = Compendium(scenarios=_unique_scenarios([*exemplars, *descriptions.scenarios]))
        out["fed_icl"] = self.evaluate(self.router(icl, split.probe), test)
        return out

    def bm25(self, compendium: Compendium, test: Sequence[LabelledQuery]):
        from rank_bm25 import BM25Okapi

        from routing.router import tokenize

        texts = [s.text for s in compendium.scenarios]
        tools = [s.tool_id for s in compendium.scenarios]
        predicted = [""] * len(test)  # a global of no scenario (rank_bm25 divides by its size)
        if texts:
            index = BM25Okapi([tokenize(t) or ["_"] for t in texts], k1=1.5, b=0.75)
            predicted = [tools[int(np.argmax(index.get_scores(tokenize(q.query) or ["_"])))]
                         for q in test]
        return accuracy_report(
            predicted,
            [q.tool_id for q in test],
            [self.category_of.get(q.tool_id, "") for q in test],  # the tool's (`_categories`)
        )

    # --- privacy -----------------------------------------------------------------------------

    def membership_attack(self, shares, released: dict[str, Compendium], held_out, seed) -> dict:
        """An adversary who sees only what a client submitted tries to tell whether a query was in
        that client's log: score = highest cosine similarity of the query to any submitted text.
        Members: queries of the client's log; non-members: held-out queries of the same tools."""
        rng = random.Random(f"mia|{seed}")
        by_tool: dict[str, list[LabelledQuery]] = {}
        for q in held_out:
            by_tool.setdefault(q.tool_id, []).append(q)
        member_scores: list[float] = []
        nonmember_scores: list[float] = []
        overlaps, baselines = [], []
        for share in shares:
            compendium = released.get(share.client)
            if compendium is None or not share.queries:
                continue
            texts = [s.text for s in compendium.scenarios] + [p.text for p in compendium.precautions]
            vectors = self.engine.embed(texts) if texts else np.zeros((0, self.engine.dimension))
            members = rng.sample(share.queries, min(self.config.membership_samples, len(share.queries)))
            # 50/50, each member beside a held-out request of its tool: a member of a tool that
            # is never tested (`data.TESTED_FROM`) has none, and is left out.
            members = [q for q in members if by_tool.get(q.tool_id)]
            nonmembers = [rng.choice(by_tool[q.tool_id]) for q in members]
            if not nonmembers:
                continue
            member_scores += membership_scores(self.engine.embed([q.query for q in members]), vectors).tolist()
            nonmember_scores += membership_scores(
                self.engine.embed([q.query for q in nonmembers]), vectors
            ).tolist()
            token_sets = [tokens(t) for t in texts]
            overlaps.append(
                float(np.mean([_best_overlap(q.query, texts, token_sets) for q in members]))
            )
            # The same measure for the paired non-members (held-out requests of the same tools,
            # never in the log): what shared vocabulary alone scores. Overlap says something
            # about leakage only above it.
            baselines.append(
                float(np.mean([_best_overlap(q.query, texts, token_sets) for q in nonmembers]))
            )
        if not member_scores:
            # No client could be measured (none sent anything, or none has a tested tool): the
            # figures are None, not a chance-level 0.5 and a perfect 0.0 overlap that read as
            # measured; a multi-seed mean leaves such a seed out (`report._mean_dicts`).
            return dict.fromkeys(PRIVACY_FIGURES)
        excess = [o - b for o, b in zip(overlaps, baselines, strict=True)]
        return {
            "membership_auroc": auroc(member_scores, nonmember_scores),
            "token_overlap": float(np.mean(overlaps)),
            "share_clients_overlap_below_0_10": float(np.mean([o < 0.10 for o in overlaps])),
            "token_overlap_nonmember": float(np.mean(baselines)),
            "token_overlap_excess": float(np.mean(excess)),
            "share_clients_excess_below_0_10": float(np.mean([e < 0.10 for e in excess])),
        }


# What `Simulation.membership_attack` measures, in its document's "privacy" section.
PRIVACY_FIGURES = (
    "membership_auroc", "token_overlap", "share_clients_overlap_below_0_10",
    "token_overlap_nonmember", "token_overlap_excess", "share_clients_excess_below_0_10",
)


MODEL_NAMES = (
    "sentence-transformers names or local paths, or bundled:all-MiniLM-L6-v2, "
    "bf16:all-MiniLM-L6-v2, onnx-int8:all-MiniLM-L6-v2, onnx-int8-dynamic:all-MiniLM-L6-v2"
)
TRANSFER_MODEL_HINT = f"--transfer-models takes {MODEL_NAMES}"


def unavailable_model(model: str, exc: Exception, hint: str) -> str:
    """One line for an embedding model that cannot be loaded: the first line of why (the
    loader's message may run over several), naming the model, then `hint` (what the flag that
    named it takes), without the loader's advice to set SYNAPSE_EMBEDDING_MODEL: the flag, not
    the setting, named this model."""
    first = (str(exc).splitlines() or [""])[0].removesuffix(SETTING_ADVICE).rstrip(". ")
    if model not in first:
        first = f"embedding model {model!r}: {first}"
    return f"{first}; {hint}"


def transfer_variants(config: SimulationConfig) -> list[TransferVariant]:
    """Every (model, reranker) the configuration asks for, checked before anything long runs:
    an unknown reranker is a ValueError, a model that cannot be loaded an
    EmbeddingModelUnavailable naming it (one line), an LLM endpoint that does not answer an
    `routing.llm.LLMUnavailable`. The engines are loaded (and cached) here."""
    if not (config.transfer_models or config.transfer_rerankers):
        return []
    rerankers = tuple(config.transfer_rerankers) or ("fusion",)
    for name in rerankers:
        if name not in RERANKERS:
            raise ValueError(
                f"unknown transfer reranker {name!r}: choose from {', '.join(RERANKERS)}"
            )
    models = tuple(m or None for m in config.transfer_models) or (None,)
    for model in models:
        if model is None:
            continue
        try:
            get_engine(model)
        except EmbeddingModelUnavailable as exc:
            raise EmbeddingModelUnavailable(
                unavailable_model(model, exc, TRANSFER_MODEL_HINT)) from None
    llm = None
    if config.llm_url and "llm" in rerankers:
        from routing.llm import get_llm

        llm = get_llm(config.llm_url, config.llm_model or "")
        # One request now: a wrong URL fails here, not as thousands of fallbacks after the run.
        llm.complete("Answer with the number 1 and nothing else.", max_tokens=4)
    return [
        TransferVariant(model, reranker, llm if reranker == "llm" else None)
        for model in dict.fromkeys(models)
        for reranker in dict.fromkeys(rerankers)
    ]


TARGETING_KEYS = ("victim_queries", "victims_routed_to_target")


def targeting(test: Sequence[LabelledQuery], decisions, target: str,
              victims: Sequence[str]) -> dict[str, int]:
    """How many of `test`'s queries belong to a victim tool, and how many of those were routed
    to the target: what a targeted attack wants, which accuracy over every tool hides."""
    wanted = set(victims)
    hits = [d.tool == target for q, d in zip(test, decisions, strict=True) if q.tool_id in wanted]
    return {"victim_queries": len(hits), "victims_routed_to_target": sum(hits)}


SCREENING_KEYS = ("honest_submissions", "dropped_honest", "adversarial_submissions",
                  "dropped_adversarial", "robust_dropped_honest", "robust_dropped_adversarial",
                  "adversarial_scenarios", "relabelled_adversarial_scenarios")


def screening(outcomes: Sequence[RoundOutcome], adversaries: set[str]) -> dict[str, int]:
    """How many client submissions, honest and adversarial, the edge merges dropped whole as
    implausible sources (their `dropped_sources`) or the server refused at arrival (through the
    services: "refused"), and how many of their scenarios the robust
    rule dropped across sources (`robust_sources`), over all rounds; and how many scenarios the
    adversaries sent, and of those how many under another tool than their honest one."""
    counts = dict.fromkeys(SCREENING_KEYS, 0)
    for outcome in outcomes:
        edges = [stats for org, stats in outcome.merge_stats.items() if org not in ("server", "refused")]
        dropped = {source for stats in edges for source in stats.get("dropped_sources", ())}
        dropped |= set(outcome.merge_stats.get("refused", ()))  # refused at arrival (services)
        for client, submission in outcome.submissions.items():
            if nothing_to_submit(submission):  # nothing new: it sent nothing (`federate`)
                continue
            kind = "adversarial" if client in adversaries else "honest"
            counts[f"{kind}_submissions"] += 1
            if client in adversaries:
                counts["adversarial_scenarios"] += len(outcome.submissions[client].scenarios)
                counts["relabelled_adversarial_scenarios"] += outcome.relabelled.get(client, 0)
            counts[f"dropped_{kind}"] += client in dropped
            counts[f"robust_dropped_{kind}"] += sum(
                stats.get("robust_sources", {}).get(client, 0) for stats in edges
            )
    return counts


def _everything_sent(outcomes: Sequence[RoundOutcome]) -> dict[str, Compendium]:
    """Per client, the union of what it sent over all rounds: what an observer of its
    submissions has seen."""
    out: dict[str, Compendium] = {}
    for outcome in outcomes:
        for client, sent in outcome.submissions.items():
            if client not in out:
                out[client] = sent
            else:
                seen = out[client]
                out[client] = seen.model_copy(
                    update={
                        "scenarios": list(seen.scenarios) + list(sent.scenarios),
                        "precautions": list(seen.precautions) + list(sent.precautions),
                    }
                )
    return out


def _best_overlap(query: str, texts: list[str], token_sets: list[set[str]]) -> float:
    original = tokens(query)
    if not original:
        return 0.0
    return max((len(original & t) / len(original) for t in token_sets), default=0.0)


def _unique_scenarios(scenarios) -> list[Scenario]:
    seen: set[tuple[str, str]] = set()
    out = []
    for s in scenarios:
        key = (s.tool_id, s.text)
        if key not in seen:
            seen.add(key)
            out.append(Scenario(tool_id=s.tool_id, text=s.text))
    return out


def _row(method: str, round_: int | None, seed: int, report) -> dict:
    """A result row; a report of no query (under drift, a round whose categories in use have
    no held-out request) was not measured: its figures are None (null), never 0."""
    measured = report.n > 0
    return {
        "method": method,
        "round": round_,
        "seed": seed,
        "accuracy": round(report.accuracy, 4) if measured else None,
        "macro_accuracy": round(report.macro_accuracy, 4) if measured else None,
    }


@dataclass
class _MeanReport:
    accuracy: float
    macro_accuracy: float
    n: int  # the queries the reports scored, together


def _mean_report(reports) -> _MeanReport:
    return _MeanReport(
        float(np.mean([r.accuracy for r in reports])),
        float(np.mean([r.macro_accuracy for r in reports])),
        sum(r.n for r in reports),
    )


# --- adversarial clients ---------------------------------------------------------------------

ADVERSARIAL_MODES = (
    "cross_source",
    "random_corruption",
    "tool_confusion",
    "schema_valid_poisoning",
    "coordinated_targeting",
    "camouflaged_poisoning",
    "coordinated_camouflage",
)
# Modes that aim at one target tool (`attack_target`): their rows' targeting counts measure them.
TARGETED_MODES = ("coordinated_targeting", "coordinated_camouflage")
# Modes that corrupt what the client would send honestly (after the client rules), not what it
# built.
CAMOUFLAGED_MODES = ("camouflaged_poisoning", "coordinated_camouflage")


def attack_target(tools: Sequence[ToolSpec], seed: int) -> tuple[str, list[str]]:
    """The tool coordinated adversaries push (the same for every adversary of a seed) and the
    tools whose requests they want it to take: its confusable tools (`confusable_tools`)."""
    ids = sorted(t.tool_id for t in tools)
    target = ids[seed % len(ids)]
    return target, confusable_tools(tools, seed).get(target, [])


def coordinated_poison(
    honest: Sequence[Compendium], probe: Sequence[LabelledQuery], target: str, victims: Sequence[str],
) -> list[Scenario]:
    """What colluding adversaries agree to plant (`coordinated_camouflage`): requests of the
    victim tools labelled with the target, in one order they all share, so that the first ones
    are identical across adversaries and count as that many sources. The requests come from
    their own honest compendiums, pooled among them; where those hold none of the victims', from
    the public probe set."""
    wanted = set(victims)
    texts = {s.text for c in honest for s in c.scenarios if s.tool_id in wanted}
    if not texts:
        texts = {q.query for q in probe if q.tool_id in wanted}
    ordered = sorted(texts, key=lambda t: (stable_unit("poison", target, t), t))
    return [Scenario(tool_id=target, text=t, support=20) for t in ordered]


def plant(compendium: Compendium, poison: Sequence[Scenario], share: float) -> tuple[Compendium, int]:
    """`compendium` with the first `share` of its size (at least one) of `poison` added, and how
    many it added. Its own entries of a planted text go: an adversary does not vote against
    itself."""
    planted = list(poison[:max(1, round(share * len(compendium.scenarios)))])
    texts = {p.text for p in planted}
    kept = [s for s in compendium.scenarios if s.text not in texts]
    return compendium.model_copy(update={"scenarios": _dedupe(kept + planted)}), len(planted)


def corrupt(
    compendium: Compendium, mode: str, schema: Schema, seed: int,
    share: float = CAMOUFLAGE_SHARE, salt: str = "",
) -> Compendium:
    """What an adversarial client submits instead of its honest compendium (schema-valid: the
    schema check alone cannot stop it). Camouflaged poisoning relabels `share` of the scenarios,
    each to another tool than its own; `salt` varies the draw (per client and round)."""
    rng = random.Random(f"adv|{mode}|{seed}" + (f"|{salt}" if salt else ""))
    tools = sorted(schema.tool_ids)
    scenarios = list(compendium.scenarios)
    if mode == "random_corruption":
        words = [w for s in scenarios for w in s.text.split()] or ["noise"]
        scenarios = [
            s.model_copy(update={"text": " ".join(rng.choice(words) for _ in range(8))})
            for s in scenarios
        ]
    elif mode == "tool_confusion":
        # Real scenarios labelled with a tool they are plausibly mistaken for (the same
        # category first, `confusable_tools`): the confusion a weaker frozen LLM makes, on
        # every scenario. Until 2026-11-30 the label was any tool, which is what
        # schema_valid_poisoning still draws.
        confusions = confusable_tools(list(schema.tools), seed)
        scenarios = [
            s.model_copy(update={"tool_id": rng.choice(confusions[s.tool_id])})
            if confusions.get(s.tool_id) else s
            for s in scenarios
        ]
    elif mode == "schema_valid_poisoning":
        # Real scenarios, wrong parent tools (any tool), with a large claimed support.
        scenarios = [s.model_copy(update={"tool_id": rng.choice(tools), "support": 50})
                     for s in scenarios]
    elif mode == "cross_source":
        # Scenarios copied from another tool's description: contamination across sources.
        by_id = schema.tools_by_id
        scenarios = [
            s.model_copy(update={"text": by_id[rng.choice(tools)].description[:200]}) for s in scenarios
        ]
    elif mode == "coordinated_camouflage":
        raise ValueError("coordinated_camouflage needs every adversary's compendium: "
                         "coordinated_poison and plant")
    elif mode == "camouflaged_poisoning":
        poisoned = set(rng.sample(range(len(scenarios)), round(share * len(scenarios))))
        scenarios = [
            s.model_copy(update={"tool_id": rng.choice([t for t in tools if t != s.tool_id]),
                                 "support": 50}) if i in poisoned else s
            for i, s in enumerate(scenarios)
        ]
    elif mode == "coordinated_targeting":
        # Every adversary pushes the same target tool for every scenario it has.
        target, _ = attack_target(list(schema.tools), seed)
        scenarios = [s.model_copy(update={"tool_id": target, "support": 20}) for s in scenarios]
    else:
        raise ValueError(f"unknown adversarial mode {mode!r}: {', '.join(ADVERSARIAL_MODES)}")
    scenarios = _dedupe(scenarios)
    return compendium.model_copy(update={"scenarios": scenarios})


def contradict(
    compendiums: dict[str, Compendium],
    organization_of: dict[str, str],
    fraction: float,
    confusions: dict[str, list[str]],
    seed: int,
) -> dict[str, Compendium]:
    """Contradictory scenarios between honest clients: each scenario of a client is, with
    probability `fraction` (a stable draw per seed, tool and text, so that a contradiction stays
    from round to round), contradicted by another client of its organization, which reports the
    same request, with the same support, for one of the tool's confusable tools. Returns the
    clients' compendiums with the contradicting scenarios added."""
    members: dict[str, list[str]] = {}
    for client in compendiums:
        members.setdefault(organization_of[client], []).append(client)
    added: dict[str, list[Scenario]] = {client: [] for client in compendiums}
    for client, compendium in compendiums.items():
        others = [c for c in members[organization_of[client]] if c != client]
        for s in compendium.scenarios:
            if not others or not confusions.get(s.tool_id):
                continue
            if stable_unit("contradict", seed, s.tool_id, s.text) >= fraction:
                continue
            pick = stable_unit("contradictor", seed, s.tool_id, s.text)
            other = others[int(pick * len(others))]
            tools = confusions[s.tool_id]
            tool = tools[int(stable_unit("contradicting tool", seed, s.tool_id, s.text) * len(tools))]
            added[other].append(s.model_copy(update={"tool_id": tool}))
    return {
        client: compendium.model_copy(update={"scenarios": _dedupe(list(compendium.scenarios) + added[client])})
        if added[client] else compendium
        for client, compendium in compendiums.items()
    }


def _relabelled(honest: Compendium, sent: Compendium) -> int:
    """How many scenarios of `sent` carry a text of `honest` under a tool that `honest` does not
    give it."""
    tools_of: dict[str, set[str]] = defaultdict(set)
    for s in honest.scenarios:
        tools_of[s.text].add(s.tool_id)
    return sum(1 for s in sent.scenarios if s.text in tools_of and s.tool_id not in tools_of[s.text])


def _dedupe(scenarios: list[Scenario]) -> list[Scenario]:
    seen = set()
    out = []
    for s in scenarios:
        key = (s.tool_id, s.text, tuple(sorted(s.preconditions.items())))
        if key not in seen and s.text.strip():
            seen.add(key)
            out.append(s)
    return out
