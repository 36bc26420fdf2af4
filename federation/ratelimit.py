"""Fixed-window rate limits shared by every server process: one atomic upsert per hit."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import connection, models

from federation.models import RateCounter

_UPSERT = f"""
INSERT INTO {RateCounter._meta.db_table} (key, window_start, count) VALUES (%s, %s, %s)
ON CONFLICT (key, window_start) DO UPDATE SET count = {RateCounter._meta.db_table}.count + %s
RETURNING count
"""


@dataclass(frozen=True)
class Window:
    start: datetime  # the start of the current fixed window
    retry_after: int  # seconds until it ends (at least 1)


def window(window_s: int, now: float | None = None) -> Window:
    """The current window of `window_s` seconds (for callers that count with their own SQL,
    as `federation.submissions` does inside a larger statement)."""
    now = time.time() if now is None else now
    start = math.floor(now / window_s) * window_s
    return Window(datetime.fromtimestamp(start, UTC), max(1, math.ceil(start + window_s - now)))


@dataclass(frozen=True)
class Decision:
    allowed: bool
    count: int
    limit: int
    retry_after: int  # seconds until the window ends (meaningful when refused)


def hit(key: str, limit: int, window_s: int, now: float | None = None, amount: int = 1) -> Decision:
    """Count `amount` events (one by default) for `key` in the current window; refused once the
    count exceeds limit."""
    current = window(window_s, now)
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT, [key, current.start, amount, amount])
        (count,) = cursor.fetchone()
    return Decision(count <= limit, count, limit, current.retry_after)


def take_back(key: str, window_start: datetime, amount: int = 1) -> None:
    """Uncount `amount` events `hit` counted for `key` in the window starting at `window_start`
    (an attempt counted before it was known whether it should count: a sign-in that succeeded, a
    batch refused whole)."""
    RateCounter.objects.filter(key=key, window_start=window_start, count__gte=amount).update(
        count=models.F("count") - amount
    )


def count(key: str, window_s: int, now: float | None = None) -> int:
    """How many events `key` has in the current window, without counting one (a check that must
    not itself count, as the sign-in throttle's before it tries a password)."""
    current = window(window_s, now)
    row = RateCounter.objects.filter(key=key, window_start=current.start).values_list("count")
    return row[0][0] if row else 0


def prune(older_than_s: int = 86400) -> int:
    cutoff = datetime.fromtimestamp(time.time() - older_than_s, UTC)
    deleted, _ = RateCounter.objects.filter(window_start__lt=cutoff).delete()
    return deleted
