"""Delivery counts of task messages (workers.deliveries): a task whose worker dies every time gives
up after SYNAPSE_TASK_MAX_DELIVERIES, failing its round (a tuning: its router) with the reason,
and a redelivered start answers what it dispatched instead of dispatching the merges again.

The tasks run in this process with a request pushed as a worker pushes it (a task id, not eager);
tests/test_merge_worker.py has the same on a real worker whose pool process is killed."""

from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from django.test import override_settings

from compendium.models import CompendiumVersion
from federation import pipeline
from federation.models import Round
from tests.merge_helpers import build_federation
from workers import deliveries, tasks
from workers.models import TaskDelivery

pytestmark = pytest.mark.django_db


@contextmanager
def delivered(task, task_id: str):
    """`task` runs as a worker's delivery of message `task_id` would."""
    task.push_request(id=task_id, is_eager=False)
    try:
        yield task
    finally:
        task.pop_request()


def _fake(task_id: str, eager: bool = False):
    return SimpleNamespace(name="synapse.test", request=SimpleNamespace(id=task_id, is_eager=eager))


@override_settings(SYNAPSE_TASK_MAX_DELIVERIES=2)
def test_deliveries_are_counted_per_message_and_exhaust_past_the_limit():
    first, second, third = (deliveries.count(_fake("m1")) for _ in range(3))
    assert [d.number for d in (first, second, third)] == [1, 2, 3]
    assert [d.exhausted for d in (first, second, third)] == [False, False, True]
    assert deliveries.count(_fake("m2")).number == 1  # another message, its own count
    assert "delivered 3 times" in third.reason("the job") and "SYNAPSE_TASK_MAX_DELIVERIES = 2" in third.reason("x")
    # Eager calls (no broker) and calls without a message are not counted.
    assert deliveries.count(_fake("m3", eager=True)).number == 1
    assert deliveries.count(_fake(None)).number == 1
    assert set(TaskDelivery.objects.values_list("task_id", flat=True)) == {"m1", "m2"}


def test_an_outcome_is_kept_for_the_next_delivery_and_old_counts_are_pruned():
    task = _fake("m1")
    assert deliveries.count(task).outcome is None
    deliveries.record_outcome(task, {"edge_tasks": ["a", "b"]})
    assert deliveries.count(task).outcome == {"edge_tasks": ["a", "b"]}
    assert deliveries.prune(86400, now=time.time() + 3600) == 0
    assert deliveries.prune(86400, now=time.time() + 2 * 86400) == 1
    assert not TaskDelivery.objects.exists()


@override_settings(SYNAPSE_TASK_MAX_DELIVERIES=2)
def test_an_edge_merge_whose_worker_keeps_dying_fails_its_round_with_the_reason(monkeypatch):
    round_, clients = build_federation()
    pipeline.start_round(round_.pk, round_.attempt)
    org = sorted({c.organization_id for c in clients.values()})[0]
    runs = []
    monkeypatch.setattr(pipeline, "run_edge_merge", lambda *a, **k: runs.append(a) or (_ for _ in ()).throw(
        SystemExit("the worker died")))
    for _ in range(2):  # the worker "dies" in the merge: the message is delivered again
        with delivered(tasks.edge_merge_task, "edge-1") as task, pytest.raises(SystemExit):
            task.run(round_.pk, org, round_.attempt)
    with delivered(tasks.edge_merge_task, "edge-1") as task:
        answer = task.run(round_.pk, org, round_.attempt)
    assert len(runs) == 2, "the third delivery does not run the merge"
    round_.refresh_from_db()
    assert round_.state == Round.State.FAILED
    assert round_.failure_reason.startswith(
        f"the edge merge of organization {org} was delivered 3 times and its worker died every time")
    assert answer["given_up"] == round_.failure_reason


@override_settings(SYNAPSE_TASK_MAX_DELIVERIES=1)
def test_a_server_merge_and_a_start_give_up_the_same_way():
    round_, _ = build_federation()
    with delivered(tasks.server_merge_task, "server-1") as task:
        deliveries.count(task)  # the first delivery, whose worker died
        assert task.run(round_.pk, round_.attempt) is None
    round_.refresh_from_db()
    assert round_.state == Round.State.FAILED and "the server merge was delivered 2 times" in round_.failure_reason

    other, _ = build_federation(round_number=2)
    with delivered(tasks.start_round_pipeline, "start-2") as task:
        deliveries.count(task)
        assert "was delivered 2 times" in task.run(other.pk, other.attempt)["given_up"]
    other.refresh_from_db()
    assert other.state == Round.State.FAILED and other.failure_reason.startswith("the start of the merges")


def test_a_redelivered_start_does_not_dispatch_the_merges_again(monkeypatch):
    round_, _ = build_federation()
    with delivered(tasks.start_round_pipeline, "start-1") as task:
        first = task.run(round_.pk, round_.attempt)  # eager here: the chord runs in this process
    round_.refresh_from_db()
    assert round_.state == Round.State.PUBLISHED and len(first["organizations"]) == 2
    assert first["server_task"]
    edges = CompendiumVersion.objects.filter(kind="edge", round=round_).count()
    merges = []
    monkeypatch.setattr(pipeline, "run_edge_merge", lambda *a, **k: merges.append(a))
    with delivered(tasks.start_round_pipeline, "start-1") as task:  # the same message again
        assert task.run(round_.pk, round_.attempt) == first
    assert merges == [] and CompendiumVersion.objects.filter(kind="edge", round=round_).count() == edges
    round_.refresh_from_db()
    assert round_.state == Round.State.PUBLISHED


@override_settings(SYNAPSE_TASK_MAX_DELIVERIES=1)
def test_a_tuning_whose_worker_keeps_dying_fails_its_router():
    from federation import tuning
    from routing.models import TunedRouter

    round_, _ = build_federation()
    pipeline.start_round(round_.pk)
    for org in pipeline.organizations_with_submissions(round_):
        pipeline.run_edge_merge(round_.pk, org)
    pipeline.run_server_merge(round_.pk)
    version = CompendiumVersion.objects.get(kind="global", round=round_)
    tuning.queue_tuning(version, 1)
    with delivered(tasks.tune_router_task, "tune-1") as task:
        deliveries.count(task)
        answer = task.run(version.pk, 1)
    record = TunedRouter.objects.get(version=version)
    assert record.state == TunedRouter.State.FAILED and answer["state"] == "failed"
    assert record.detail.startswith("the tuning of this router was delivered 2 times")


def test_the_beat_prunes_delivery_counts_hourly():
    from django.conf import settings

    from synapse_web.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["prune-task-deliveries"]
    assert entry["task"] == tasks.prune_task_deliveries_task.name and entry["task"] in app.tasks
    assert entry["schedule"] == 3600.0
