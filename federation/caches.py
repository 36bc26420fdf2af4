"""What a server process keeps in memory of what clients sent, forgotten after an erasure.

The caches (each process its own):
- every embedding engine's vectors, by a hash of the text (`routing.embeddings`): in a merge
  worker every text a merge embedded (the submissions' scenarios and precautions), in a web
  worker the routing queries and the texts of the tuned router's global;
- the published global (its content) and the routers built from it, candidates' texts included
  (`routing.services`);
- the word frequencies of masking, by word (`compendium.masking.zipf`): the words of every text
  masked or checked for residue;
- the last published globals' canonical bytes, the submission dictionaries
  (`federation.submissions`).

An erasure raises `ErasureGeneration` in its own transaction (`bump`), and its process forgets its
caches once it commits. Every other process reads the generation (one primary-key query) at the
start of each request (`synapse_web.middleware.ErasureCachesMiddleware`) and each Celery task
(`workers.receivers`), and forgets all of the above when it moved since it last read it: the
generation commits with the erasure, so a process that reads the new value reads the rows as the
erasure left them. A request or task that began before it noticed an erasure may fill a cache from
rows it read before the erasure committed: `settle`, at its end, forgets again. A process that
serves nothing would keep them until its next request or task: a thread in each gunicorn and
Celery worker process (`start_watcher`) reads the generation every
SYNAPSE_ERASURE_CHECK_SECONDS as well.

Forgetting drops this process's references; the freed memory holds the bytes until it is reused.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError, connection, connections

from federation.models import ErasureGeneration

# The generation this process's caches were last checked against; None: never checked, or the
# check failed (the caches were forgotten then).
_seen: int | None = None
_lock = threading.Lock()


_GENERATION_SQL = f"SELECT value FROM {ErasureGeneration._meta.db_table} WHERE id = 1"


def generation() -> int:
    """The erasures committed so far (0 before the first). Read on every request and task: a
    plain statement, without the ORM's compiling of a query (about half of its cost)."""
    with connection.cursor() as cursor:
        cursor.execute(_GENERATION_SQL)
        row = cursor.fetchone()
    return row[0] if row else 0


def bump() -> None:
    """Raise the generation, in the erasure's transaction (erasures are serialized by the
    publication lock, so two never create the row at once), and have this process forget its
    caches once it commits."""
    from django.db import transaction
    from django.db.models import F

    if not ErasureGeneration.objects.filter(pk=1).update(value=F("value") + 1):
        ErasureGeneration.objects.create(pk=1, value=1)
    transaction.on_commit(forget)


def forget_all() -> None:
    """Drop every cache of clients' texts this process keeps (see the module's docstring)."""
    from compendium.masking import zipf
    from federation import submissions
    from routing import embeddings
    from routing import services as routing

    # Which global is published first: a request between the two then reads it again.
    routing.forget_published_version()
    routing.forget_served()
    for engine in embeddings.engines():
        engine.forget()
    zipf.cache_clear()
    submissions.clear_dictionary_cache()


def forget() -> None:
    """Forget the caches now: what the process that made the erasure runs once it committed (its
    next `check` forgets them once more, whatever it reads)."""
    global _seen
    with _lock:
        forget_all()
        _seen = None


def check() -> int | None:
    """Read the generation and forget the caches when it moved since this process last read it
    (or never did). Returns it, for `settle`; None when it cannot be read (the caches are
    forgotten then: nothing says they are still good)."""
    global _seen
    try:
        now = generation()
    except DatabaseError as exc:
        logging.getLogger(__name__).warning(
            "cannot read the erasure generation (%s: %s): forgetting the in-memory caches",
            exc.__class__.__name__, exc,
        )
        with _lock:
            forget_all()
            _seen = None
        return None
    with _lock:
        if now != _seen:
            forget_all()
            if _seen is not None:
                logging.getLogger(__name__).info(
                    "erasure generation %s (was %s): forgot the in-memory caches of clients' texts",
                    now, _seen,
                )
            _seen = now
    return now


def settle(started: int | None) -> None:
    """At the end of a request or task that `check` began under `started`: when another thread
    noticed an erasure meanwhile, what this one cached may come from rows read before the erasure
    committed, so the caches are forgotten again. No query."""
    if started is not None and _seen != started:
        with _lock:
            forget_all()


def warm_up() -> bool:
    """`routing.services.warm_up` (a gunicorn worker's router built before its first request),
    the generation read first, so that the first request does not forget what it built."""
    from routing.services import warm_up as warm_up_router

    started = check()
    try:
        return warm_up_router()  # closes this thread's connection at its end
    finally:
        settle(started)


def check_seconds() -> float:
    return float(getattr(settings, "SYNAPSE_ERASURE_CHECK_SECONDS", 60.0))


def watch_once() -> None:
    """One check of the watcher thread, on its own connection, closed after (not held between
    checks)."""
    try:
        check()
    finally:
        connections.close_all()  # this thread's


def _watch(seconds: float) -> None:
    while True:
        time.sleep(seconds)
        try:
            watch_once()
        except Exception:  # never let the watcher die: the next check tries again
            logging.getLogger(__name__).exception("checking the erasure generation failed")


def start_watcher() -> threading.Thread | None:
    """Start this process's watcher (a daemon thread that runs `check` every
    SYNAPSE_ERASURE_CHECK_SECONDS), so that an idle process does not keep an erased client's
    texts until its next request or task. None when the setting is 0 (off)."""
    seconds = check_seconds()
    if seconds <= 0:
        return None
    thread = threading.Thread(target=_watch, args=(seconds,), name="synapse-erasure-watch",
                              daemon=True)
    thread.start()
    return thread
