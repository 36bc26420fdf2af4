"""The pipeline's locks between real connections: a step running in another thread (its own
database connection, committing on its own) while the server merge holds its locks.
`test_pipeline_races.py` forces the interleavings inside one connection; these show that the
locks really make the other step wait."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from compendium.models import CompendiumVersion
from federation import pipeline
from federation.models import Client, Round
from tests.federation_fixtures import record_outcome
from tests.merge_helpers import build_federation

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_on_a_lock(done: threading.Event, timeout: float = 60.0) -> bool:
    """Whether another backend of this database waits on a lock (pg_stat_activity), polled until
    `done` is set (the other step finished without waiting) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done.is_set():
        with connection.cursor() as cursor:
            # The caller is inside its transaction, where the activity view is read once and
            # kept: clear that snapshot so that each poll reads the backends as they are now.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'")
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.02)
    return False


def server_merge_while(monkeypatch, round_: Round, step) -> tuple[bool, object]:
    """Run the round's server merge; once it holds its locks and is about to write the global,
    run `step` in another thread (its own connection) and let the write go on only when that
    thread waits on a lock, or has finished without waiting. Returns whether it waited and what
    `step` returned (or raised)."""
    holding, finished = threading.Event(), threading.Event()
    outcome: list = []
    waited: list[bool] = []

    def other_connection():
        def after_holding():
            assert holding.wait(60)
            return step()

        record_outcome(outcome, after_holding, finished)

    real_write = pipeline._write_global

    def write_while_the_other_waits(*args, **kwargs):
        if not waited:  # the server merge's write (`step` may write a global again later)
            holding.set()
            waited.append(_waiting_on_a_lock(finished))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_write_global", write_while_the_other_waits)
    worker = threading.Thread(target=other_connection)
    worker.start()
    try:
        pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    finally:
        holding.set()
        worker.join(120)
    assert len(waited) == 1 and len(outcome) == 1, (waited, outcome)
    return waited[0], outcome[0]


def test_an_edge_task_during_the_server_merges_write_waits_and_then_writes_nothing(
    probes, monkeypatch
):
    """acme's edge task (redelivered, after a client was revoked) runs while the server merge
    writes the global under the publication lock and the round's. It waits for them, and once
    the round is published it is a task of a round no longer merging: it writes nothing, so the
    published global's edges stay the ones it was merged from."""
    round_, clients = build_federation(state="merging")
    for org in pipeline.organizations_with_submissions(round_):
        pipeline.run_edge_merge(round_.pk, org, attempt=round_.attempt)
    acme = clients[("acme", "a1")].organization
    edges_before = set(CompendiumVersion.objects.filter(kind="edge", round=round_)
                       .values_list("pk", flat=True))

    def edge_task():
        Client.objects.filter(pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED)
        return pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)

    waited, outcome = server_merge_while(monkeypatch, round_, edge_task)
    assert waited, "the edge task did not wait on the server merge's locks"
    assert isinstance(outcome, pipeline.StaleAttempt), outcome
    round_.refresh_from_db()
    assert round_.state == Round.State.PUBLISHED
    edges = set(CompendiumVersion.objects.filter(kind="edge", round=round_)
                .values_list("pk", flat=True))
    assert edges == edges_before
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.values_list("pk", flat=True)) == edges


def test_an_erasure_during_the_server_merges_write_waits_and_then_reaches_the_published_global(
    probes, monkeypatch
):
    """A client is erased while the server merge writes the global from edges that hold what it
    sent. The erasure waits for the publication lock; once the round is published it finds the
    new global among the compendiums built from the client's submissions and merges it again:
    nothing the client sent is left in any compendium, and the global's edges are the ones now
    stored."""
    round_, clients = build_federation(state="merging")
    for org in pipeline.organizations_with_submissions(round_):
        pipeline.run_edge_merge(round_.pk, org, attempt=round_.attempt)
    erased = clients[("acme", "a2")]
    erased_texts = {s["text"] for v in CompendiumVersion.objects.filter(kind="client", client=erased)
                    for s in v.content["scenarios"]}
    assert erased_texts

    waited, outcome = server_merge_while(
        monkeypatch, round_, lambda: pipeline.erase_client(Client.objects.get(pk=erased.pk)))
    assert waited, "the erasure did not wait on the server merge's locks"
    assert isinstance(outcome, pipeline.ErasureReport), outcome
    round_.refresh_from_db()
    assert round_.state == Round.State.PUBLISHED
    assert not CompendiumVersion.objects.filter(kind="client", client=erased).exists()
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.all()) == set(CompendiumVersion.objects.filter(kind="edge", round=round_))
    for version in CompendiumVersion.objects.filter(round=round_).exclude(kind="client"):
        assert not erased_texts & {s["text"] for s in version.content["scenarios"]}, version.kind


def test_a_decision_waiting_on_an_erasure_of_its_conflict_is_refused_after_it(
    monkeypatch, settings, django_capture_on_commit_callbacks
):
    """A reviewer picks the erased client's dissent as the winning scenario while the erasure
    merges that conflict log again. The decision waits for the log row the erasure deleted;
    once the erasure commits the row is gone, and the decision is refused instead of storing
    the erased text in a decision row after the erasure."""
    from federation import conflicts
    from federation.errors import Conflict
    from federation.models import ConflictDecision, ConflictLogEntry
    from federation.services import Actor
    from tests.test_merge_pipeline import SECRET, _weather_conflict

    # A decision waits this long at most for the erasure (then 409 busy): here it outlasts it.
    settings.SYNAPSE_LOCK_WAIT_SECONDS = 120
    org, clients, conflict = _weather_conflict(
        django_capture_on_commit_callbacks,
        {"a3": SECRET, "a4": "Is rain expected in Paris tomorrow?"})
    finished, outcome, waited = threading.Event(), [], []

    def decide():
        record_outcome(outcome, lambda: conflicts.decide_conflict(
            Actor.system(), conflict, "scenario", SECRET), finished)

    real_remove = conflicts.remove_unfit_decisions

    def remove_while_the_reviewer_decides(round_, organization_id, cause):
        if not waited:  # the log of round 1's edge is merged again: its old rows are deleted
            threading.Thread(target=decide).start()
            waited.append(_waiting_on_a_lock(finished))
        return real_remove(round_, organization_id, cause)

    monkeypatch.setattr(conflicts, "remove_unfit_decisions", remove_while_the_reviewer_decides)
    pipeline.erase_client(clients[("acme", "a3")])
    assert finished.wait(60) and waited == [True], (waited, outcome)
    [refusal] = outcome
    assert isinstance(refusal, Conflict) and "merged again" in str(refusal), refusal
    assert not ConflictDecision.objects.exists()
    [after] = ConflictLogEntry.objects.filter(round__number=1, organization=org)
    assert SECRET not in str(after.dissenters)


def test_a_retry_during_an_erasure_that_re_releases_an_earlier_round_is_not_a_deadlock(
    probes, monkeypatch, without_merge_pipeline
):
    """An erasure re-releases round 1's edge (a new release: it holds the settings' lock to its
    commit), then merges again the edge of round 2, which failed, from the same client's
    submission. The operator retries round 2 meanwhile: the retry locks round 2, then waits for
    the settings' lock the erasure holds, and the erasure waits for round 2's. PostgreSQL broke
    that cycle by aborting one of them ("deadlock detected"): the retry was a 500, or the
    erasure failed. The retry is refused (409, busy) without waiting for the settings' lock,
    and the erasure goes through."""
    from federation import services
    from federation.errors import Busy
    from federation.models import FederationSettings
    from federation.services import Actor
    from tests.merge_helpers import CLIENT_DOCS, RELEASING_CONFIG

    services.get_settings()
    FederationSettings.objects.filter(pk=1).update(epsilon_budget=1000.0)
    first, clients = build_federation(config=RELEASING_CONFIG, state="merging")
    # A third client at acme: with a2 erased its edge still releases (two clients: see
    # RELEASING_CONFIG), so the erasure's new release of round 1 writes ledger rows.
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    acme = clients[("acme", "a1")].organization
    clients[("acme", "a3")] = Client.objects.create(organization=acme, name="a3", status="approved")
    docs = {**CLIENT_DOCS, ("acme", "a3"): CLIENT_DOCS[("acme", "a1")]}
    store_compendium(Compendium.model_validate(docs[("acme", "a3")]), kind="client", round=first,
                     client=clients[("acme", "a3")])
    for org in pipeline.organizations_with_submissions(first):
        pipeline.run_edge_merge(first.pk, org, attempt=first.attempt)
    pipeline.run_server_merge(first.pk, attempt=first.attempt)
    second = Round.objects.create(number=2, state="merging", config=RELEASING_CONFIG)
    for key, doc in docs.items():
        store_compendium(Compendium.model_validate({"schema_version": "1.0", **doc}),
                         kind="client", round=second, client=clients[key])
    for org in pipeline.organizations_with_submissions(second):
        pipeline.run_edge_merge(second.pk, org, attempt=second.attempt)
    services.mark_failed(second, "a server merge that failed")

    finished, outcome, waited = threading.Event(), [], []

    def retry():
        record_outcome(outcome, lambda: services.retry_round(Actor.system("operator"), second.pk),
                       finished)

    real_server_merge = pipeline.run_server_merge

    def server_merge_while_the_operator_retries(round_id, **kwargs):
        if not waited:  # round 1's global, after its edge's new release
            threading.Thread(target=retry).start()
            waited.append(_waiting_on_a_lock(finished))
        return real_server_merge(round_id, **kwargs)

    monkeypatch.setattr(pipeline, "run_server_merge", server_merge_while_the_operator_retries)
    report = pipeline.erase_client(clients[("acme", "a2")])
    assert finished.wait(60) and len(waited) == 1, (waited, outcome)
    [retried] = outcome
    assert isinstance(retried, Busy), repr(retried)
    second.refresh_from_db()
    assert second.state == Round.State.FAILED
    assert (1, clients[("acme", "a2")].organization_id) in report.edges_rematerialized
    assert not CompendiumVersion.objects.filter(kind="client", client=clients[("acme", "a2")]).exists()


def test_a_decision_behind_an_erasures_locks_answers_busy_instead_of_waiting_it_out(
    settings, django_capture_on_commit_callbacks
):
    """An erasure holds the rows of the conflict logs it merges again, and the locks of the
    rounds it merges again, until it commits (minutes with an LLM summarizer). A reviewer's
    decision waited for them however long: the page hung until the erasure committed (or a
    proxy in front cut the request off). It answers 409 busy after SYNAPSE_LOCK_WAIT_SECONDS,
    decides nothing, and goes through once the locks are free."""
    from federation.conflicts import decide_conflict
    from federation.errors import Busy
    from federation.models import ConflictDecision, ConflictLogEntry
    from federation.services import Actor
    from tests.test_federation_services import _held_elsewhere
    from tests.test_merge_pipeline import _weather_conflict

    settings.SYNAPSE_LOCK_WAIT_SECONDS = 0.2
    _, _, conflict = _weather_conflict(django_capture_on_commit_callbacks,
                                       {"a3": "Is rain expected in Paris tomorrow?"})
    # a later round that failed (an erasure merges its edges again): the decision still applies
    later = Round.objects.create(number=2, state=Round.State.FAILED, failure_reason="boom")
    for lock in (
        lambda: Round.objects.select_for_update().get(pk=later.pk),
        lambda: list(ConflictLogEntry.objects.select_for_update().filter(pk=conflict.pk)),
    ):
        release = _held_elsewhere(lock)
        try:
            started = time.monotonic()
            with pytest.raises(Busy, match="cannot decide the conflict now"):
                decide_conflict(Actor.system(), conflict, "dismiss")
            assert time.monotonic() - started < 10
        finally:
            release()
        assert not ConflictDecision.objects.exists()
    decide_conflict(Actor.system(), conflict, "dismiss")
    assert ConflictDecision.objects.get().action == "dismiss"


def test_a_retried_rounds_start_during_an_erasure_is_not_a_deadlock(
    probes, monkeypatch, without_merge_pipeline
):
    """Round 1 failed after its edges merged; acme's clients were revoked since, and one of them
    is erased. The erasure deletes its submission (and the provenance that links it to acme's
    edge) first, then merges acme's edge again under round 1's lock. The operator retries the
    round meanwhile: its start locked round 1 and deleted acme's edge (no client of acme left to
    merge), which waited for the provenance rows the erasure had deleted, while the erasure
    waited for round 1. PostgreSQL broke the deadlock by aborting the start (the round failed
    again, "deadlock detected") or the whole erasure. The start takes the publication lock
    first, as every other write of the pipeline does: it waits for the erasure, then merges."""
    from federation import services
    from federation.services import Actor

    round_, clients = build_federation(state="merging")
    for org in pipeline.organizations_with_submissions(round_):
        pipeline.run_edge_merge(round_.pk, org, attempt=round_.attempt)
    services.mark_failed(round_, "a server merge that failed")
    Client.objects.filter(organization__slug="acme").update(status=Client.Status.REVOKED)
    erased = clients[("acme", "a2")]

    finished, outcome, waited = threading.Event(), [], []

    def retry_and_start():
        def step():
            retried = services.retry_round(Actor.system("operator"), round_.pk)
            return pipeline.start_round(retried.pk, retried.attempt)

        record_outcome(outcome, step, finished)

    real_readers = pipeline._conflict_readers

    def readers_while_the_operator_retries(round_arg, organization):
        if not waited:  # the erasure is about to merge acme's edge of round 1 again
            threading.Thread(target=retry_and_start).start()
            waited.append(_waiting_on_a_lock(finished, timeout=20))
        return real_readers(round_arg, organization)

    monkeypatch.setattr(pipeline, "_conflict_readers", readers_while_the_operator_retries)
    report = pipeline.erase_client(Client.objects.get(pk=erased.pk))
    assert finished.wait(60) and len(waited) == 1, (waited, outcome)
    [started] = outcome
    assert not isinstance(started, Exception), repr(started)
    globex = clients[("globex", "g1")].organization_id
    assert started == [globex]
    round_.refresh_from_db()
    assert round_.state == Round.State.MERGING
    assert report.submissions_removed == 1
    assert set(CompendiumVersion.objects.filter(kind="edge", round=round_)
               .values_list("organization_id", flat=True)) == {globex}
