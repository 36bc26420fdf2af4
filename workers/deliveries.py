"""Counting the deliveries of task messages, so that a task whose worker dies every time (killed
for memory, say) gives up after SYNAPSE_TASK_MAX_DELIVERIES instead of being delivered forever.

One upsert per delivery of a task run by a worker; eager calls (no broker) are not counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection
from django.utils import timezone

from workers.models import TaskDelivery

_TABLE = TaskDelivery._meta.db_table
_UPSERT = f"""
INSERT INTO {_TABLE} (task_id, name, deliveries, first_at, last_at) VALUES (%s, %s, 1, %s, %s)
ON CONFLICT (task_id) DO UPDATE SET deliveries = {_TABLE}.deliveries + 1, last_at = EXCLUDED.last_at
RETURNING deliveries, outcome
"""


@dataclass(frozen=True)
class Delivery:
    number: int  # 1 for the first delivery of the message
    limit: int
    outcome: object | None  # what an earlier delivery recorded (record_outcome)

    @property
    def exhausted(self) -> bool:
        return self.number > self.limit

    def reason(self, what: str) -> str:
        return (
            f"{what} was delivered {self.number} times and its worker died every time before it "
            f"finished (killed for memory?); it is not tried again (SYNAPSE_TASK_MAX_DELIVERIES = "
            f"{self.limit})"
        )


def max_deliveries() -> int:
    return max(1, int(getattr(settings, "SYNAPSE_TASK_MAX_DELIVERIES", 3)))


def _message_id(task) -> str | None:
    """The id of the broker message `task` runs for; None for an eager call (no broker)."""
    request = task.request
    return None if request.is_eager else request.id or None


def count(task) -> Delivery:
    """Count this delivery of `task`'s message (a bound Celery task, inside its run)."""
    limit = max_deliveries()
    message = _message_id(task)
    if message is None:
        return Delivery(1, limit, None)
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT, [message, task.name[:200], now, now])
        number, outcome = cursor.fetchone()
    if isinstance(outcome, str):  # jsonb may come back as text
        outcome = json.loads(outcome)
    return Delivery(number, limit, outcome)


def record_outcome(task, outcome) -> None:
    """Keep what this delivery did, for a redelivery of the same message to answer with."""
    message = _message_id(task)
    if message is not None:
        TaskDelivery.objects.filter(task_id=message).update(outcome=outcome)


def prune(older_than_s: int = 86400, now: float | None = None) -> int:
    """Forget messages last delivered more than `older_than_s` ago."""
    now = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(now - older_than_s, UTC)
    deleted, _ = TaskDelivery.objects.filter(last_at__lt=cutoff).delete()
    return deleted
