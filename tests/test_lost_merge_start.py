"""A round whose close (or retry) committed but whose start of the merges was never queued (the
process died between the commit and the broker) used to stay `closing` for good: no task would
move it on, and only the operator's Fail and Retry got it going. Celery beat's check
(`services.requeue_lost_merges`) starts it again as a new run; a round whose start was queued is
left alone, however long its start waits in the queue."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from federation import services
from federation.models import AuditLog, Round
from federation.signals import round_closed
from tests.merge_helpers import build_federation

pytestmark = pytest.mark.django_db


def backdate(rnd: Round, seconds: float) -> None:
    Round.objects.filter(pk=rnd.pk).update(
        attempt_started_at=timezone.now() - dt.timedelta(seconds=seconds))


def test_a_close_whose_start_was_never_queued_is_started_again_as_a_new_run(
    without_merge_pipeline, django_capture_on_commit_callbacks
):
    round_, _ = build_federation(state="open")
    with django_capture_on_commit_callbacks(execute=True):
        services.close_round(services.Actor.system(), round_)  # no receiver: as if it died
    round_.refresh_from_db()
    assert round_.state == "closing" and round_.queued_attempt is None
    assert services.requeue_lost_merges(120) == []  # its start may still be on its way
    backdate(round_, 600)

    from workers.receivers import start_pipeline_on_close

    round_closed.connect(start_pipeline_on_close, dispatch_uid="synapse.start_round_pipeline")
    with django_capture_on_commit_callbacks(execute=True):  # eager: the new run merges here
        [requeued] = services.requeue_lost_merges(120)
    round_.refresh_from_db()
    assert requeued.pk == round_.pk
    assert round_.state == "published", round_.failure_reason
    assert round_.attempt == 2 and round_.queued_attempt == 2
    entry = AuditLog.objects.get(action="round.requeue")
    assert entry.details == {"lost_attempt": 1,
                             "reason": "the start of its merges was never queued"}
    assert services.requeue_lost_merges(0) == []  # published: nothing more to do


def test_a_queued_start_is_left_alone_however_long_it_waits(
    without_merge_pipeline, django_capture_on_commit_callbacks
):
    round_, _ = build_federation(state="open")
    with django_capture_on_commit_callbacks(execute=True):
        services.close_round(services.Actor.system(), round_)
    round_.refresh_from_db()
    services.mark_queued(round_, round_.attempt)  # what the receiver does once it is queued
    backdate(round_, 86400)
    assert services.requeue_lost_merges(120) == []
    round_.refresh_from_db()
    assert round_.attempt == 1 and round_.state == "closing"
    # a retry is a new run: its start must be queued again
    services.mark_failed(round_, "worker lost")
    with django_capture_on_commit_callbacks(execute=True):
        services.retry_round(services.Actor.system(), round_)
    backdate(round_, 600)
    with django_capture_on_commit_callbacks(execute=True):
        assert [r.number for r in services.requeue_lost_merges(120)] == [round_.number]
    round_.refresh_from_db()
    assert round_.attempt == 3 and round_.state == "closing"  # no receiver here: not queued


def test_a_stale_mark_does_not_cover_a_later_run(without_merge_pipeline):
    round_, _ = build_federation()
    Round.objects.filter(pk=round_.pk).update(attempt=2)
    services.mark_queued(round_, 1)  # a late mark of run 1 (the round moved on to run 2)
    round_.refresh_from_db()
    assert round_.queued_attempt is None


def test_the_beat_schedule_runs_the_check(settings):
    from synapse_web.celery import app
    from workers.tasks import requeue_lost_merges_task

    schedule = settings.CELERY_BEAT_SCHEDULE["requeue-lost-merges"]
    assert schedule["task"] == requeue_lost_merges_task.name and schedule["task"] in app.tasks
    assert requeue_lost_merges_task.apply().get() == []


def test_a_round_open_when_queued_attempt_was_added_is_watched_once_it_closes(
    without_merge_pipeline, django_capture_on_commit_callbacks
):
    """The migration that added `queued_attempt` marked every existing round's run as queued,
    the open one's too; its close kept that mark, so a start lost at its close was never
    started again. The close clears it."""
    round_, _ = build_federation(state="open")
    Round.objects.filter(pk=round_.pk).update(queued_attempt=1)  # as the migration left it
    with django_capture_on_commit_callbacks(execute=True):
        services.close_round(services.Actor.system(), round_)  # no receiver: as if it died
    round_.refresh_from_db()
    assert round_.queued_attempt is None
    backdate(round_, 600)
    with django_capture_on_commit_callbacks(execute=True):
        assert [r.pk for r in services.requeue_lost_merges(120)] == [round_.pk]


def test_a_start_lost_again_and_again_fails_the_round_saying_so(
    without_merge_pipeline, django_capture_on_commit_callbacks
):
    """Each start again reset the round's pending time, so a start lost every time looped
    unseen; after MERGE_REQUEUE_LIMIT starts again the round fails, and the operator's retry
    begins the count anew."""
    round_, _ = build_federation(state="open")
    with django_capture_on_commit_callbacks(execute=True):
        services.close_round(services.Actor.system(), round_)  # no receiver: never queued

    def check():
        backdate(round_, 600)
        with django_capture_on_commit_callbacks(execute=True):
            started = services.requeue_lost_merges(120)
        round_.refresh_from_db()
        return [r.pk for r in started]

    for _ in range(services.MERGE_REQUEUE_LIMIT):
        assert check() == [round_.pk]
    assert round_.state == "closing" and round_.attempt == 1 + services.MERGE_REQUEUE_LIMIT
    assert check() == []
    assert round_.state == "failed"
    assert round_.failure_reason.startswith(
        f"the start of its merges was never queued, {services.MERGE_REQUEUE_LIMIT + 1} times in a row")
    assert AuditLog.objects.filter(action="round.requeue").count() == services.MERGE_REQUEUE_LIMIT
    with django_capture_on_commit_callbacks(execute=True):
        services.retry_round(services.Actor.system(), round_)
    assert check() == [round_.pk]  # the retry's count starts at zero
