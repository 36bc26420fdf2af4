"""Celery tasks of the round pipeline: thin wrappers around federation.pipeline.

Closing a round runs a group of edge merges (one per organization with submissions) and then the
server merge as a chord. Tasks are acknowledged late and rejected when their worker dies, so a
merge interrupted by a killed worker is delivered again; the services are idempotent, so the
retry produces the same compendium. Each delivery is counted (workers.deliveries): a task whose
worker died SYNAPSE_TASK_MAX_DELIVERIES times fails its round (a tuning: its router) with that
reason instead of being delivered forever. A task that fails for any other reason sets the round
to `failed` with the reason; so does one that runs past SYNAPSE_TASK_TIME_LIMIT_SECONDS (the
soft limit raised in it), or is killed by the worker a grace period later (`on_failure`, run by
the worker's main process).
"""

from __future__ import annotations

import inspect

from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery import Task, chord, group, shared_task
from celery.utils.log import get_task_logger

from federation import pipeline
from workers import deliveries

log = get_task_logger(__name__)


def _time_limit(exc: BaseException | None) -> BaseException | None:
    """The time limit behind `exc`: itself, or one that code turned into another error on its
    way up (a model loader's "cannot load" says nothing of the limit that stopped it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, SoftTimeLimitExceeded | TimeLimitExceeded):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _why(exc: BaseException) -> str:
    """A task's failure in words: a time limit says which, and how long it is."""
    from django.conf import settings

    limit = _time_limit(exc)
    if limit is None:
        return str(exc)
    killed = "" if isinstance(limit, SoftTimeLimitExceeded) else (
        f" and was killed {settings.TASK_KILL_GRACE_SECONDS} s later")
    return (f"it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS "
            f"({settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS} s){killed}")


def time_limit_words(exc: BaseException) -> str | None:
    """"it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS (…)" when a time limit is behind `exc`, else
    None: for what records a failure itself (a tuning's row), in the words a round's has."""
    return _why(exc) if _time_limit(exc) is not None else None


class PipelineTask(Task):
    """A task of the round pipeline. Its body fails the round on any error it sees; a task the
    worker kills at its hard time limit runs no more of its body, so the worker's main process
    fails the round here (`what`: the step, formatted with the task's arguments)."""

    what = "a merge step"

    def failure_reason(self, exc: BaseException, **arguments) -> str:
        """The reason a round fails for when this task fails with `exc` (`arguments`: the task's,
        those `what` names)."""
        return f"{self.what.format(**arguments)} failed: {_why(exc)}"

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        if not isinstance(exc, TimeLimitExceeded):
            return  # the body failed the round (or left it to a later delivery)
        bound = inspect.signature(self.run).bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        # Called before the worker kills the task's process, which may hold the round's lock:
        # waited for briefly, so that the worker is not held by the task it is stopping.
        pipeline.fail_round(given["round_id"], self.failure_reason(exc, **given),
                            given.get("attempt"), briefly=True)


class TuningTask(Task):
    """The tuning task: one the worker kills at its hard time limit runs no more of its body, so
    the worker's main process fails its router here (the pipeline's on_failure read a round the
    tuning does not have: a KeyError, and the row left `running`)."""

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        if not isinstance(exc, TimeLimitExceeded):
            return  # the body recorded the failure on the row
        from federation.tuning import fail_killed_tuning

        bound = inspect.signature(self.run).bind(*args, **kwargs)
        fail_killed_tuning(bound.arguments["version_id"], f"tuning the router failed: {_why(exc)}")


TASK_OPTIONS = dict(acks_late=True, reject_on_worker_lost=True, base=PipelineTask)


def _counted(task, round_id: int, attempt: int | None, what: str):
    """Count this delivery of a pipeline task's message: (the delivery, None), or past
    SYNAPSE_TASK_MAX_DELIVERIES (the delivery, the reason) with the round failed for it."""
    delivery = deliveries.count(task)
    if not delivery.exhausted:
        return delivery, None
    reason = delivery.reason(what)
    pipeline.fail_round(round_id, reason, attempt)
    return delivery, reason


# Each task carries the pipeline run (`Round.attempt`) it belongs to; a task of an earlier run
# (delivered late, or still running when the operator failed the round and retried it) raises
# pipeline.StaleAttempt under the round's lock, writes nothing and fails nothing. `attempt` None:
# a task queued before runs were counted, treated as the current run.


@shared_task(name="synapse.start_round_pipeline", bind=True, what="starting the merge",
             **TASK_OPTIONS)
def start_round_pipeline(self, round_id: int, attempt: int | None = None) -> dict:
    """Start the chord; returns the ids of its edge tasks and of the server task. A redelivery
    of a start that dispatched its chord answers what it dispatched, without a second chord."""
    delivery, given_up = _counted(self, round_id, attempt, "the start of the merges")
    if given_up:
        return {"organizations": [], "edge_tasks": [], "server_task": None, "given_up": given_up}
    if delivery.outcome is not None:
        log.warning("start of round %s delivered again: its merges were dispatched", round_id)
        return delivery.outcome
    try:
        organizations = pipeline.start_round(round_id, attempt)
    except pipeline.StaleAttempt as stale:
        log.warning("not started: %s", stale)
        return {"organizations": [], "edge_tasks": [], "server_task": None, "stale": str(stale)}
    except Exception as exc:
        pipeline.fail_round(round_id, self.failure_reason(exc), attempt)
        raise
    if not organizations:
        return {"organizations": [], "edge_tasks": [], "server_task": None}
    header = group(edge_merge_task.si(round_id, org, attempt) for org in organizations)
    try:
        result = chord(header)(server_merge_task.si(round_id, attempt))
    except Exception as exc:  # the broker unreachable: the round is merging and nothing would run
        pipeline.fail_round(round_id, f"dispatching the merges failed: {exc}", attempt)
        raise
    edge_ids = [child.id for child in (result.parent.results if result.parent else [])]
    outcome = {"organizations": organizations, "edge_tasks": edge_ids, "server_task": result.id}
    deliveries.record_outcome(self, outcome)
    return outcome


@shared_task(name="synapse.edge_merge", bind=True, **TASK_OPTIONS,
             what="edge merge of organization {organization_id}")
def edge_merge_task(self, round_id: int, organization_id: int, attempt: int | None = None) -> dict:
    _, given_up = _counted(self, round_id, attempt, f"the edge merge of organization {organization_id}")
    if given_up:
        return {"organization": organization_id, "given_up": given_up}
    log.info("edge merge started: round %s organization %s", round_id, organization_id)
    try:
        outcome = pipeline.run_edge_merge(round_id, organization_id, attempt=attempt)
    except pipeline.StaleAttempt as stale:
        log.warning("edge merge of organization %s not written: %s", organization_id, stale)
        return {"organization": organization_id, "stale": str(stale)}
    except Exception as exc:
        pipeline.fail_round(
            round_id, self.failure_reason(exc, organization_id=organization_id), attempt)
        raise
    return {"organization": organization_id, "sha256": outcome.sha256,
            "accepted": outcome.accepted, "rejected": outcome.rejected}


@shared_task(name="synapse.server_merge", bind=True, what="server merge", **TASK_OPTIONS)
def server_merge_task(self, round_id: int, attempt: int | None = None) -> str | None:
    if _counted(self, round_id, attempt, "the server merge")[1]:
        return None
    try:
        return pipeline.run_server_merge(round_id, attempt=attempt)
    except pipeline.StaleAttempt as stale:
        log.warning("server merge not written: %s", stale)
        return None
    except Exception as exc:
        pipeline.fail_round(round_id, self.failure_reason(exc), attempt)
        raise


@shared_task(name="synapse.tune_router", bind=True, **{**TASK_OPTIONS, "base": TuningTask})
def tune_router_task(self, version_id: int, epochs: int) -> dict:
    """Fine-tune the routing encoder on a published global (federation.tuning); the outcome,
    failures included, is recorded on its TunedRouter row."""
    from federation.tuning import TuningBusy, give_up_tuning, tune_published_router

    delivery = deliveries.count(self)
    if delivery.exhausted:
        record = give_up_tuning(version_id, delivery.reason("the tuning of this router"))
        return {"version": version_id, "state": record.state if record else "gone",
                "detail": record.detail if record else ""}
    try:
        record = tune_published_router(version_id, epochs)
    except TuningBusy as busy:  # another worker (or the command) is tuning it: that one reports
        log.warning("%s", busy)
        return {"version": version_id, "state": "busy", "detail": str(busy)}
    if record is None:
        return {"version": version_id, "state": "gone"}
    return {"version": version_id, "state": record.state, "detail": record.detail,
            "probe_accuracy": record.probe_accuracy}


def send_tuning(record):
    """Queue the tuning task of a TunedRouter row on SYNAPSE_ROUTER_TUNE_QUEUE."""
    from django.conf import settings

    queue = getattr(settings, "SYNAPSE_ROUTER_TUNE_QUEUE", "") or None
    return tune_router_task.apply_async((record.version_id, record.epochs), queue=queue)


@shared_task(name="synapse.requeue_lost_tuning")
def requeue_lost_tuning_task() -> int | None:
    """Celery beat's check for a lost tuning of the served global's router (its message lost, its
    worker dead): queued again (federation.tuning.requeue_lost_tuning). Returns its version."""
    from django.conf import settings

    from federation.tuning import requeue_lost_tuning

    record = requeue_lost_tuning(settings.SYNAPSE_TUNING_REQUEUE_SECONDS)
    if record is None:
        return None
    send_tuning(record)
    return record.version_id


@shared_task(name="synapse.close_due_rounds")
def close_due_rounds_task() -> list[int]:
    """Celery beat's every-minute check: close the open round whose deadline has come."""
    from federation.services import close_due_rounds

    return [rnd.number for rnd in close_due_rounds()]


@shared_task(name="synapse.requeue_lost_merges")
def requeue_lost_merges_task() -> list[int]:
    """Celery beat's check for a closing round whose start of the merges was never queued (the
    process that closed or retried it died first): started again as a new run
    (federation.services.requeue_lost_merges). Returns the rounds' numbers."""
    from django.conf import settings

    from federation.services import requeue_lost_merges

    return [rnd.number for rnd in requeue_lost_merges(settings.SYNAPSE_MERGE_REQUEUE_SECONDS)]


@shared_task(name="synapse.prune_rate_counters")
def prune_rate_counters_task() -> int:
    """Celery beat's hourly clean-up: rate-limit and sign-in counters older than a day."""
    from django.conf import settings

    from federation.ratelimit import prune

    # A sign-in lock lasts its window: never prune a counter younger than that.
    return prune(max(86400, settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS))


@shared_task(name="synapse.prune_task_deliveries")
def prune_task_deliveries_task() -> int:
    """Celery beat's hourly clean-up: delivery counts of messages last delivered a day ago."""
    return deliveries.prune()


@shared_task(name="synapse.prune_routing_calls")
def prune_routing_calls_task() -> int:
    """Celery beat's hourly clean-up: routing-call latency records past their retention."""
    from routing.services import prune_routing_calls

    return prune_routing_calls()
