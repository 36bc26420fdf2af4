"""The right to erasure against what server processes keep in memory of clients' texts: the
embedding engines' vectors (a merge embedded every submitted text), the served global and its
routers, masking's word frequencies. The process that erases forgets them when the erasure
commits; every other one at its next request or task, or at its watcher's next check, through the
erasure generation (`federation.caches`). Another process is played by this one having read the
generation before the erasure, whose own commit hook (the erasing process's) does not run here.
On the real embedded PostgreSQL, with the real merges and erasure."""

from __future__ import annotations

import threading

import pytest
from django.test import Client as HttpClient

from compendium.masking import zipf
from federation import caches, pipeline
from federation.models import Client
from routing import services
from routing.embeddings import get_engine
from routing.models import RoutingToken
from tests.merge_helpers import build_federation
from tests.merge_helpers import close_round as close
from workers.tasks import prune_routing_calls_task

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_routing")]

ERASED = "What is 17 multiplied by 23?"  # a2's scenario; no other client sent it
QUERY = "Multiply 17 by 23 for me"


@pytest.fixture
def federation(probes, django_capture_on_commit_callbacks, settings):
    """A published round whose merges embedded a2's texts, and a process that keeps the published
    global for an hour (an idle one: it does not ask which global is published meanwhile)."""
    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600
    caches.check()  # this process read the generation before it cached anything
    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    return get_engine(settings.SYNAPSE_EMBEDDING_MODEL or None)


def _fill(engine) -> None:
    """This process holds the erased text: in the merge engine's vectors, in the router it serves
    (among the candidates it answers) and, as masking's words, in the word cache."""
    assert engine.cached(ERASED)  # the edge merge embedded it
    assert _serves_erased(services.route_query(QUERY, top_k=10))
    zipf("multiplied")
    assert zipf.cache_info().currsize > 0


def _serves_erased(answer: dict) -> bool:
    return ERASED in str(answer["candidates"])


def _forgotten(engine) -> None:
    assert not engine.cached(ERASED)
    assert services._served == {} and services._published is None
    assert zipf.cache_info().currsize == 0


def _erase_in_another_process() -> None:
    """The real erasure, as another process makes it. Its commit hook that makes the erasing
    process forget is not this one's: it never runs in the test's transaction (which never
    commits), and is replaced where the test commits. Nor are the signals of the rows it deletes,
    which make the erasing process forget which global is published: this one still remembers
    the global it served."""
    remembered = services._published
    report = pipeline.erase_client(Client.objects.get(name="a2"))
    assert report.globals_rematerialized == [1]
    services._published = remembered  # fresh_routing forgets it after the test


@pytest.mark.django_db
def test_the_erasing_process_forgets_its_caches_once_the_erasure_commits(
    federation, django_capture_on_commit_callbacks
):
    _fill(federation)
    with django_capture_on_commit_callbacks(execute=True):
        pipeline.erase_client(Client.objects.get(name="a2"))
    _forgotten(federation)
    assert not _serves_erased(services.route_query(QUERY, top_k=10))


@pytest.mark.django_db
def test_another_process_forgets_them_at_its_next_request(federation):
    _fill(federation)
    _erase_in_another_process()
    # Nothing told this process yet: it still holds the text (what an idle worker did before).
    assert federation.cached(ERASED)
    assert _serves_erased(services.route_query(QUERY, top_k=10))
    _, raw = RoutingToken.issue("app")
    answer = HttpClient().post("/api/v1/route/", {"query": QUERY, "top_k": 10},
                               content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert answer.status_code == 200, answer.content
    assert not _serves_erased(answer.json())
    assert not federation.cached(ERASED)
    assert zipf.cache_info().currsize == 0


@pytest.mark.django_db
def test_another_process_forgets_them_at_its_next_task(federation):
    """A merge worker: its engine embedded every text its merges read."""
    _fill(federation)
    _erase_in_another_process()
    assert federation.cached(ERASED)
    prune_routing_calls_task.delay()  # any task: it reads the generation first
    _forgotten(federation)


@pytest.mark.django_db
def test_a_request_begun_before_another_thread_noticed_the_erasure_forgets_again_at_its_end(
    federation,
):
    """A request (or task) that began before the erasure committed may cache what it read before;
    another thread of its process noticed the erasure and forgot meanwhile: the caches are
    forgotten again when the earlier request ends."""
    started = caches.check()
    _erase_in_another_process()
    assert caches.check() != started  # another thread's request: the caches forgotten
    assert not federation.cached(ERASED)
    federation.embed([ERASED])  # the earlier request goes on with a text it read before
    assert federation.cached(ERASED)
    caches.settle(started)
    assert not federation.cached(ERASED)


@pytest.mark.django_db(transaction=True)  # the watcher's thread has its own connection
def test_an_idle_process_forgets_them_at_its_watchers_next_check(federation, monkeypatch):
    _fill(federation)
    # The erasure runs in another process: the hook that makes the erasing process forget at
    # once is not this one's.
    monkeypatch.setattr(caches, "forget", lambda: None)
    _erase_in_another_process()
    assert federation.cached(ERASED)
    watcher = threading.Thread(target=caches.watch_once)
    watcher.start()
    watcher.join(60)
    _forgotten(federation)


def test_the_watcher_is_off_at_zero(settings):
    settings.SYNAPSE_ERASURE_CHECK_SECONDS = 0
    assert caches.start_watcher() is None


@pytest.mark.django_db(transaction=True)  # the warm-up thread has its own connection
def test_a_workers_first_request_keeps_the_router_it_warmed(federation):
    """gunicorn.conf.py warms each new worker's router before its first request: the generation
    is read first, so that request does not count the warm router as filled before any check
    and forget it (the build takes seconds)."""
    services.forget_served()
    caches._seen = None  # a new worker: it never read the generation
    warmed = []
    thread = threading.Thread(target=lambda: warmed.append(caches.warm_up()))
    thread.start()
    thread.join(120)
    assert warmed == [True] and len(services._served) == 1
    router = next(iter(services._served.values()))
    caches.check()  # the first request
    assert list(services._served.values()) == [router]
