"""Live demo rounds: the demo federation's clients build, submit and merge real compendiums.

Each demo client gets a share of a routing-benchmark dataset's queries (category partition: each
organization specializes), turns it into a usage log, builds its compendium with the client
toolkit, keeps what the last published global does not already cover, and submits it through the very submission service the REST API uses; the operator's
close of each round runs the real merge pipeline (eager Celery without a broker). A new user
therefore lands on a federation with published rounds, ledger rows, the cross-checks' figures and
conflicts to review. The conflicts are the data's own: MetaTool has near-identical requests for
different tools (research papers for ResearchHelper and internetSearch, QR codes for
create_qr_code and qreator), which clients of one organization, or of two, claim for different
tools. How many a demo logs depends on how much usage each client has (measured on MetaTool, seed
0, three rounds, two clients an organization: 120 requests per client logged none, 400 five, all
between organizations, 500 eight, two of them inside one organization's edge). With eight clients
an organization (`DEMO_ORGANIZATIONS`: what it takes for any statistic to be released) each gets
DEMO_QUERIES_PER_CLIENT = 125, the 3,000 requests six clients of 500 had, so the demo does the
same work.

The demo's rounds are opened with `demo_round_config` (a field cap F* and ε = 2, so that with
eight clients an edge the edges release statistics whose noise is narrower than their clipping
window, and the privacy ledger a new user sees fills).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings

from compendium import transport
from compendium.builder import BuildOptions, build_compendium
from compendium.canonical import canonical_form
from compendium.client_api import nothing_to_submit
from compendium.delta import delta_since, routed_by
from compendium.registry import load_dataset
from compendium.schema import Compendium
from compendium.services import current_schema, load_compendium
from compendium.usage_log import parse_record
from federation import submissions
from federation.models import Client, ConflictLogEntry, Round
from federation.pipeline import import_probe_set, probe_pairs
from federation.round_config import RoundConfig
from federation.services import (
    DEMO_ORGANIZATIONS,
    Actor,
    InvalidTransition,
    close_round,
    current_round,
    demo_round_config,
    fail_round_by_hand,
    open_round,
    retry_round,
)
from federation.simulation.data import confusable_tools, partition_train, split_dataset, usage_log
from routing.cli import probe_router
from routing.embeddings import get_engine
from routing.services import published_global_version, served_compendium

DEMO_QUERIES_PER_CLIENT = 125


class DemoError(RuntimeError):
    """A demo round could not be published; says which and why."""


@dataclass(frozen=True)
class DemoReport:
    rounds_published: list[int]
    submissions: int
    skipped: bool
    conflicts: int = 0  # entries the published rounds' merges logged, for review


def _merge_stuck_rounds_again(system: Actor, progress: Callable[[str], None]) -> list[int]:
    """A demo stopped (Ctrl-C) during a round's merge leaves the round closing or merging, and
    without a broker nothing moves it on; played past, it would keep its privacy reservation
    for good and could never be retried once a later round is published. Without a broker the
    demo fails it and merges it again, as the operator would (Fail, then retry_round); with one,
    its worker may still be merging it, so the demo stops and says so. Returns the rounds so
    published."""
    published = []
    for stuck in Round.objects.filter(
        state__in=(Round.State.CLOSING, Round.State.MERGING)
    ).order_by("number"):
        if not settings.CELERY_TASK_ALWAYS_EAGER:
            raise DemoError(
                f"round {stuck.number} is {stuck.state}: wait for its merge to end (a Celery "
                "worker runs it); if its worker died, fail it on the dashboard's Overview and "
                f"run manage.py retry_round {stuck.number}; then run demo_rounds again"
            )
        progress(f"demo round {stuck.number}: left {stuck.state} by a demo stopped during its "
                 "merge; merging it again")
        fail_round_by_hand(system, stuck, "a demo was stopped during this round's merge; the "
                                          "demo merges it again")
        try:
            retry_round(system, stuck)  # the pipeline runs in this process (no broker)
        except InvalidTransition as exc:  # nothing to merge: it stays failed, reserving nothing
            progress(f"demo round {stuck.number}: {exc}")
            continue
        stuck.refresh_from_db()
        if stuck.state != Round.State.PUBLISHED:
            raise DemoError(f"demo round {stuck.number} ended {stuck.state}: "
                            f"{stuck.failure_reason}")
        published.append(stuck.number)
    return published


def run_demo_rounds(
    dataset_path: str,
    *,
    rounds: int = 3,
    queries_per_client: int = DEMO_QUERIES_PER_CLIENT,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
) -> DemoReport:
    """Play the demo clients' rounds until `rounds` rounds are published: none when that many are
    published already, and a demo stopped midway resumes where it stopped (so restarting the
    demo spends no more privacy budget than the rounds asked for). Leaves a round open."""
    already = Round.objects.filter(state=Round.State.PUBLISHED).count()
    if already >= rounds:
        return DemoReport([], 0, skipped=True)
    system = Actor(None, label="demo")
    recovered = _merge_stuck_rounds_again(system, progress)
    already = Round.objects.filter(state=Round.State.PUBLISHED).count()
    if already >= rounds:  # the round merged again was the last one asked for
        if current_round() is None:
            open_round(system, demo_round_config(seed))
        conflicts = ConflictLogEntry.objects.filter(round__number__in=recovered).count()
        return DemoReport(recovered, 0, skipped=False, conflicts=conflicts)
    dataset = load_dataset(dataset_path)
    schema = current_schema()
    slugs = [slug for _, slug, _ in DEMO_ORGANIZATIONS]
    per_org = max(len(names) for _, _, names in DEMO_ORGANIZATIONS)
    clients = {
        (c.organization.slug, c.name): c
        for c in Client.objects.select_related("organization").filter(
            organization__slug__in=slugs, status=Client.Status.APPROVED
        )
    }
    split = split_dataset(dataset, seed=seed)
    shares = partition_train(
        split.train, dataset.tools, orgs=len(slugs), clients_per_org=per_org, mode="category", seed=seed
    )
    confusions = confusable_tools(dataset.tools, seed)
    logs = {}
    for share in shares:
        org_index = int(share.organization.split("-")[1]) - 1
        client_index = int(share.client.rsplit("-", 1)[1]) - 1
        _, slug, names = DEMO_ORGANIZATIONS[org_index]
        client = clients.get((slug, names[client_index])) if client_index < len(names) else None
        if client is None:
            continue
        share.queries = share.queries[:queries_per_client]
        logs[client] = usage_log(share, confusions, seed=seed)
    if not logs:  # every round would open, have no submissions and fail
        raise DemoError(
            "no approved demo clients to play the rounds: run manage.py bootstrap_demo first "
            "(make demo does)"
        )
    import_probe_set(dataset_path, per_tool=3, seed=seed)

    published, sent = recovered, 0
    # Each round a client has seen more of its log: period p of `rounds` holds the first p parts.
    for period in range(already + 1, rounds + 1):
        rnd = current_round() or open_round(system, demo_round_config(seed))
        progress(f"demo round {rnd.number}: {len(logs)} clients build and submit")
        # As `synapse-client participate` does: the fields the round will not release stay out.
        not_released = frozenset(rnd.fields_not_released)
        field_cap = RoundConfig.from_stored(rnd.config).field_cap
        # What each client pulled: it sends only what that global does not cover (the server
        # carries the global forward).
        latest = published_global_version()
        pulled = load_compendium(latest) if latest is not None else None
        dictionary = (
            transport.global_dictionary(pulled)
            if pulled
            else transport.probe_dictionary(schema, submissions.probe_texts())
        )
        # The pulled global's router, as the routing API serves it; before any global, the
        # public probe set's router (`synapse-client build --probe`).
        if latest is not None:
            route = routed_by(served_compendium().routers["fusion"])
        else:
            pairs = probe_pairs()  # what the probe endpoint labels with a tool
            route = routed_by(probe_router(pairs)) if pairs else None
        for client, lines in logs.items():
            experience = lines[: len(lines) * period // rounds]
            records = [parse_record(line, n, schema.tool_ids) for n, line in enumerate(experience, 1)]
            compendium, _ = build_compendium(
                records, schema,
                BuildOptions(strength=1.0, seed=seed, not_released=not_released,
                             field_cap=field_cap),
                embedder=get_engine(),
            )
            if pulled is not None or route is not None:
                compendium, _ = delta_since(
                    compendium, pulled or Compendium(), get_engine(), route=route
                )
            if nothing_to_submit(compendium):
                continue  # as `synapse-client participate`: nothing new, nothing sent
            form = canonical_form(compendium)
            # Sent as `synapse-client submit --since` sends it: dcz against the pulled global
            # (round 1: the probe set's requests and the schema), read back by the server's own
            # decoder.
            wire = transport.compress(form.data, dictionary)
            submissions.submit(
                client, wire, f"demo-r{rnd.number}-{form.sha256[:32]}",
                content_encoding=transport.CONTENT_ENCODING,
            )
            sent += 1
        progress(f"demo round {rnd.number}: closing; edges and the server merge")
        close_round(system, rnd)
        rnd.refresh_from_db()
        if rnd.state != Round.State.PUBLISHED:
            raise DemoError(f"demo round {rnd.number} ended {rnd.state}: {rnd.failure_reason}")
        published.append(rnd.number)
    open_round(system, demo_round_config(seed))
    conflicts = ConflictLogEntry.objects.filter(round__number__in=published).count()
    return DemoReport(published, sent, skipped=False, conflicts=conflicts)
