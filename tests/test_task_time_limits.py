"""Time limits of the worker's tasks: a merge that hangs (an LLM endpoint answering too slowly to
be given up on, a lock never released) is stopped at SYNAPSE_TASK_TIME_LIMIT_SECONDS and fails its
round saying so, instead of holding its worker and leaving the round `merging` for good.

Found by review: no task had a time limit. The soft limit raises in the task (its body fails the
round); the hard one, a grace period later, kills the task's process, so the worker's main process
fails the round (`PipelineTask.on_failure`), without waiting on a lock the dying task may hold.
tests/test_merge_worker.py has the soft limit on a real worker with an LLM endpoint that hangs."""

from __future__ import annotations

import threading

import pytest
from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from django.conf import settings
from django.db import connections, transaction
from django.test import override_settings

from federation import pipeline
from federation.models import AuditLog, Round
from tests.merge_helpers import build_federation
from tests.test_task_deliveries import delivered
from workers import tasks


def _merging():
    round_, clients = build_federation()
    pipeline.start_round(round_.pk, round_.attempt)
    round_.refresh_from_db()
    assert round_.state == Round.State.MERGING
    return round_, sorted({c.organization_id for c in clients.values()})


def test_every_task_has_a_soft_and_a_hard_time_limit_below_the_visibility_timeout():
    from synapse_web.celery import app

    soft, hard = app.conf.task_soft_time_limit, app.conf.task_time_limit
    assert soft == settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS == 10800
    assert hard == soft + settings.TASK_KILL_GRACE_SECONDS
    # Redis must not hand a task that is still running to a second worker.
    assert hard < settings.SYNAPSE_TASK_VISIBILITY_SECONDS


@pytest.mark.django_db
def test_a_merge_past_the_soft_limit_fails_its_round_saying_so(monkeypatch):
    round_, orgs = _merging()

    def hangs(*args, **kwargs):
        # What the worker raises in the task at the soft limit, here met while a model loaded
        # and turned by the loader into its own one-line error.
        try:
            raise SoftTimeLimitExceeded()
        except SoftTimeLimitExceeded as exc:
            raise RuntimeError(f"cannot load embedding model: {exc!r}") from None

    monkeypatch.setattr(pipeline, "run_edge_merge", hangs)
    with delivered(tasks.edge_merge_task, "edge-slow") as task, pytest.raises(RuntimeError):
        task.run(round_.pk, orgs[0], round_.attempt)
    round_.refresh_from_db()
    assert round_.state == Round.State.FAILED
    assert round_.failure_reason == (
        f"edge merge of organization {orgs[0]} failed: it ran past "
        f"SYNAPSE_TASK_TIME_LIMIT_SECONDS ({settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS} s)")


@pytest.mark.django_db
@pytest.mark.parametrize("task_name, arguments, what", [
    ("edge_merge_task", lambda r, o: ([r.pk, o[1], r.attempt], {}), "edge merge of organization {o}"),
    ("server_merge_task", lambda r, o: ([r.pk], {"attempt": r.attempt}), "server merge"),
    ("start_round_pipeline", lambda r, o: ([r.pk, r.attempt], {}), "starting the merge"),
])
def test_a_task_killed_at_the_hard_limit_fails_its_round(task_name, arguments, what):
    """The worker calls the task's on_failure with TimeLimitExceeded in its main process, and
    kills the task's process: none of the task's own code runs to fail the round."""
    round_, orgs = _merging()
    args, kwargs = arguments(round_, orgs)
    task = getattr(tasks, task_name)
    task.on_failure(TimeLimitExceeded(settings.CELERY_TASK_TIME_LIMIT), "killed-1", args, kwargs, None)
    round_.refresh_from_db()
    assert round_.state == Round.State.FAILED
    assert round_.failure_reason == (
        f"{what.format(o=orgs[1])} failed: it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS "
        f"({settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS} s) and was killed "
        f"{settings.TASK_KILL_GRACE_SECONDS} s later")
    assert AuditLog.objects.filter(action=AuditLog.Action.ROUND_FAIL, target_id=str(round_.pk)).count() == 1


@pytest.mark.django_db
def test_a_kill_of_a_task_of_an_earlier_run_or_another_failure_changes_nothing():
    round_, orgs = _merging()
    # a task of run 1 killed after the operator failed the round and retried it (run 2)
    Round.objects.filter(pk=round_.pk).update(attempt=2)
    tasks.edge_merge_task.on_failure(TimeLimitExceeded(1), "old-run", [round_.pk, orgs[0], 1], {}, None)
    round_.refresh_from_db()
    assert round_.state == Round.State.MERGING
    # any other failure was the task body's to report (or a redelivery's)
    tasks.edge_merge_task.on_failure(RuntimeError("boom"), "other", [round_.pk, orgs[0], 2], {}, None)
    round_.refresh_from_db()
    assert round_.state == Round.State.MERGING


@pytest.mark.django_db(transaction=True)
@override_settings(SYNAPSE_LOCK_WAIT_SECONDS=0.3)
def test_the_kill_does_not_wait_on_a_lock_the_dying_task_holds():
    """The worker's main process runs on_failure before it kills the task's process, which may
    be writing its merge with the round locked: the failure waits briefly and gives up, instead
    of hanging the worker on a lock that is released only once it has killed that process."""
    round_, orgs = _merging()
    locked, release = threading.Event(), threading.Event()

    def dying_task():
        try:
            with transaction.atomic():
                Round.objects.select_for_update().get(pk=round_.pk)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=dying_task)
    holder.start()
    try:
        assert locked.wait(30)
        finished = threading.Event()

        def kill():
            try:
                tasks.edge_merge_task.on_failure(
                    TimeLimitExceeded(1), "killed-2", [round_.pk, orgs[0], round_.attempt], {}, None)
            finally:
                connections.close_all()
                finished.set()

        threading.Thread(target=kill).start()
        assert finished.wait(10), "on_failure waited for the lock the dying task holds"
    finally:
        release.set()
        holder.join(30)
    round_.refresh_from_db()
    assert round_.state == Round.State.MERGING  # left as it was, logged


@pytest.mark.django_db
def test_a_tuning_killed_at_the_hard_limit_fails_its_router():
    """Found by audit: the tuning task shares the pipeline's on_failure, which read a `round_id`
    argument the tuning task does not have: a KeyError in the worker's main process as it killed
    a tuning past its limit, and the row left `running` (the routing page said "being tuned")."""
    from compendium.models import CompendiumVersion
    from federation import tuning
    from routing.models import TunedRouter

    round_, orgs = _merging()
    for org in orgs:
        pipeline.run_edge_merge(round_.pk, org)
    pipeline.run_server_merge(round_.pk)
    version = CompendiumVersion.objects.get(kind="global", round=round_)
    record = tuning.queue_tuning(version, 1)
    TunedRouter.objects.filter(pk=record.pk).update(state=TunedRouter.State.RUNNING)
    tasks.tune_router_task.on_failure(
        TimeLimitExceeded(settings.CELERY_TASK_TIME_LIMIT), "tune-killed", [version.pk, 1], {}, None)
    record.refresh_from_db()
    assert record.state == TunedRouter.State.FAILED and record.finished_at is not None
    assert record.detail == (
        f"tuning the router failed: it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS "
        f"({settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS} s) and was killed "
        f"{settings.TASK_KILL_GRACE_SECONDS} s later")
    assert Round.objects.get(pk=round_.pk).state == Round.State.PUBLISHED  # no round of its own

    # a ready router (a forced retune killed) stays ready and served
    TunedRouter.objects.filter(pk=record.pk).update(state=TunedRouter.State.READY, detail="")
    tasks.tune_router_task.on_failure(TimeLimitExceeded(1), "retune-killed", [version.pk, 1], {}, None)
    record.refresh_from_db()
    assert record.state == TunedRouter.State.READY and record.detail.startswith(
        "tuning again failed (tuning the router failed: it ran past")
