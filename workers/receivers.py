"""Connects federation signals to the Celery pipeline (workers depend on federation, not the
other way round)."""

from __future__ import annotations

from celery.signals import task_postrun, task_prerun, worker_process_init
from django.dispatch import receiver

from federation import caches
from federation.signals import global_published, round_closed


@receiver(round_closed, dispatch_uid="synapse.start_round_pipeline")
def start_pipeline_on_close(sender, round, **kwargs):
    """Queue the start of the round's merges. A start that cannot be queued (the broker down)
    would leave the round closing for good, with no task to move it on and no retry accepted:
    it fails the round, saying why, for the operator to retry; one this process died before
    queuing is started again by Celery beat's check. (Eager, the pipeline runs here
    and records its own failures; the round is failed already and stays as it failed.)"""
    from federation.pipeline import fail_round
    from federation.services import mark_queued
    from workers.tasks import start_round_pipeline

    try:
        started = start_round_pipeline.delay(round.pk, round.attempt)
    except Exception as exc:
        if not start_round_pipeline.app.conf.task_always_eager:
            fail_round(round.pk, _not_queued(exc), round.attempt)
        raise
    # Queued: Celery beat's check (`services.requeue_lost_merges`) leaves this run alone.
    mark_queued(round, round.attempt)
    return started


def _not_queued(exc: Exception) -> str:
    """Why the start of a round's merges could not be queued, in one line, saying what to do.
    Celery's error for a Redis result backend it never reached says, over three lines, that "the
    Celery application must be restarted": it need not be (the same process queues the next task
    as soon as Redis answers again), so that sentence is left out."""
    said = " ".join(str(exc).split()).replace(" The Celery application must be restarted.", "")
    return (f"the merge pipeline could not be queued (the broker, CELERY_BROKER_URL, or the result "
            f"backend did not answer): {said}; retry the round once they answer")


@receiver(global_published, dispatch_uid="synapse.tune_router")
def tune_router_on_publish(sender, round, version, **kwargs):
    """Queue the tuning of the routing encoder on the new global when SYNAPSE_ROUTER_TUNE_EPOCHS
    > 0, on SYNAPSE_ROUTER_TUNE_QUEUE (docker-compose: the GPU worker's)."""
    from federation.tuning import queue_tuning, tune_epochs
    from workers.tasks import send_tuning

    epochs = tune_epochs()
    if epochs < 1:
        return None
    # A broker down now leaves the row queued: synapse.requeue_lost_tuning queues it again.
    return send_tuning(queue_tuning(version, epochs))


# The erasure generation each running task started under, by task id (`settle` at its end).
_task_generations: dict[str, int | None] = {}


@task_prerun.connect(dispatch_uid="synapse.erasure_check")
def check_erasures_before_task(task_id=None, **kwargs):
    """Before each task, one primary-key query: this process forgets its caches of clients' texts
    (the merges' embedding vectors above all) when an erasure committed since it last looked."""
    _task_generations[task_id] = caches.check()


@task_postrun.connect(dispatch_uid="synapse.erasure_settle")
def settle_erasures_after_task(task_id=None, **kwargs):
    caches.settle(_task_generations.pop(task_id, None))


@worker_process_init.connect(dispatch_uid="synapse.erasure_watcher")
def watch_erasures(**kwargs):
    """Each pool process of a worker checks the erasure generation every
    SYNAPSE_ERASURE_CHECK_SECONDS as well, so that one that gets no task does not keep an erased
    client's texts."""
    caches.start_watcher()
