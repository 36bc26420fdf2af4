"""The round pipeline on a real Celery worker on the machine's Redis and the real test database.

The worker is a subprocess (`celery -A synapse_web worker`) on Redis db 7 with a queue of its own;
it reaches the pytest test database through DATABASE_URL. Waiting is done on Celery results and on
the worker's log lines (through a queue with a timeout), never by sleeping.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit

import psutil
import pytest
from celery.result import AsyncResult
from django.db import connection

from compendium.models import CompendiumVersion
from federation import pipeline
from federation.merge import drowned_fields
from federation.models import Client, PrivacyLedgerEntry, Round
from federation.signals import round_closed
from tests.merge_helpers import RELEASING_CONFIG, build_federation

ROOT = Path(__file__).resolve().parent.parent
BROKER = "redis://127.0.0.1:6379/7"
CELERY = Path(sys.executable).with_name("celery")


class Worker:
    def __init__(self, queue_name: str, database_url: str, extra_env: dict | None = None,
                 queues: str | None = None):
        env = dict(os.environ)
        env.update(
            DATABASE_URL=database_url,
            CELERY_BROKER_URL=BROKER,
            CELERY_RESULT_BACKEND=BROKER,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            SYNAPSE_CONN_MAX_AGE="0",
            CELERY_TASK_DEFAULT_QUEUE=queue_name,
            SYNAPSE_ROUTER_TUNE_EPOCHS="0",  # with a broker it defaults to 1; one test turns it on
        )
        env.update(extra_env or {})
        self.env = env
        self.process = subprocess.Popen(
            [str(CELERY), "-A", "synapse_web", "worker", "-l", "info", "-c", "1", "-P", "prefork",
             "-Q", queues or queue_name, "-n", f"{queue_name}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.process.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, fragment: str, timeout: float = 300) -> str:
        while True:
            line = self.lines.get(timeout=timeout)  # raises queue.Empty on timeout
            if fragment in line:
                return line

    def kill_pool_child(self) -> int:
        children = psutil.Process(self.process.pid).children()
        assert children, "the worker has no pool process"
        os.kill(children[0].pid, signal.SIGKILL)
        return children[0].pid

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _database_url() -> str:
    s = connection.settings_dict
    host = quote(s["HOST"], safe="") if s["HOST"].startswith("/") else s["HOST"]
    port = f":{s['PORT']}" if s["PORT"] else ""
    return f"postgres://{s['USER']}:{quote(s['PASSWORD'] or '')}@{host}{port}/{s['NAME']}"


def _broker_problem(url: str = BROKER) -> str | None:
    """Why a worker could not reach `url`, or None. A Celery worker with no broker retries the
    connection 100 times, each a log line that `wait_for` reads as progress: the test waited most
    of an hour instead of failing."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=5):
            return None
    except OSError as exc:
        return (
            f"the Celery worker tests need a Redis server at {parts.hostname}:{parts.port or 6379} "
            f"({exc.strerror or exc}): install and start one (apt-get install redis-server)"
        )


@pytest.fixture
def worker(request, transactional_db, tmp_path_factory):
    from synapse_web.celery import app

    if problem := _broker_problem():
        pytest.fail(problem, pytrace=False)

    # request.param: (environment for the worker, "<tmp>" = a fresh folder, "<silent-llm>" = the
    # URL of an OpenAI-compatible endpoint that takes every request and never answers; extra
    # queues)
    extra_env, queues = getattr(request, "param", None) or ({}, None)
    silent = socket.create_server(("127.0.0.1", 0))  # accepted by the kernel, never read
    request.addfinalizer(silent.close)
    extra_env = {
        k: str(tmp_path_factory.mktemp("worker")) if v == "<tmp>"
        else f"http://127.0.0.1:{silent.getsockname()[1]}/v1" if v == "<silent-llm>" else v
        for k, v in extra_env.items()
    }
    queue_name = f"synapse-test-{uuid.uuid4().hex[:10]}"
    saved = {k: app.conf.get(k) for k in
             ("broker_url", "result_backend", "task_always_eager", "task_default_queue")}
    app.conf.update(broker_url=BROKER, result_backend=BROKER, task_always_eager=False,
                    task_default_queue=queue_name)
    # Earlier (eager) tests may have built the in-memory backend and broker pools: start fresh.
    cached = (app._backend_cache, getattr(app._local, "backend", None), app._pool,
              app.amqp._producer_pool)
    app._backend_cache, app._local.backend, app._pool, app.amqp._producer_pool = (
        None, None, None, None)
    running = Worker(queue_name, _database_url(), extra_env,
                     queues and f"{queue_name},{queues}")
    try:
        running.wait_for("ready.", timeout=180)
        yield running
    finally:
        running.stop()
        print("".join(running.log[-200:]))  # shown by pytest when a test fails
        app.conf.update(saved)
        app._backend_cache, app._local.backend, app._pool, app.amqp._producer_pool = cached


def test_a_broker_nobody_answers_on_is_named_at_once():
    """Found by review: without a Redis server on 127.0.0.1:6379 (a fresh machine: the README's
    `make test` installs nothing by hand but Chromium), each worker test waited on a worker that
    retries the connection 100 times, reading its retry lines as progress: most of an hour a
    test. The fixture now fails it in one line naming the broker and how to get one."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    problem = _broker_problem(f"redis://127.0.0.1:{port}/7")
    assert problem is not None
    assert f"127.0.0.1:{port}" in problem and "redis-server" in problem


def _close_round(round_: Round) -> dict:
    responses = round_closed.send(sender=Round, round=round_)
    [started] = [r for _, r in responses if isinstance(r, AsyncResult)]
    return started.get(timeout=120)


def _wait_for_round(info: dict, timeout: float = 600) -> str:
    """The edge tasks first (a failed edge raises here instead of leaving the chord body
    pending), then the server merge."""
    for task_id in info["edge_tasks"]:
        AsyncResult(task_id).get(timeout=timeout)
    return AsyncResult(info["server_task"]).get(timeout=timeout)


def _released_per_round() -> int:
    """Two edges, each releasing every registry tool x declared numeric field that a release of
    the round can make useful (at most 2 clients an edge, 2 edges, RELEASING_CONFIG: all)."""
    schema = pipeline.current_schema()
    config = pipeline._config(Round.objects.get())
    drowned = drowned_fields(schema, config, 2, 2)
    assert drowned == frozenset()
    return 2 * len(schema.tools) * (len(schema.numeric_fields) - len(drowned))


def test_full_round_on_a_real_worker(worker):
    round_, _ = build_federation(config=RELEASING_CONFIG)
    info = _close_round(round_)
    assert len(info["organizations"]) == 2 and len(info["edge_tasks"]) == 2
    # the receiver recorded that this run's start is queued: beat's check leaves it alone
    assert Round.objects.get(pk=round_.pk).queued_attempt == 1
    sha = _wait_for_round(info)
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert glob.sha256 == sha
    assert CompendiumVersion.objects.filter(kind="edge", round=round_).count() == 2
    assert PrivacyLedgerEntry.objects.filter(round=round_).count() == _released_per_round()


FORGOT = "erasure generation 1 (was 0): forgot the in-memory caches of clients' texts"


@pytest.mark.parametrize("worker", [({"LOG_LEVEL": "INFO", "SYNAPSE_ERASURE_CHECK_SECONDS": "0"},
                                     None)], indirect=True)
def test_a_worker_forgets_an_erased_clients_texts_at_its_next_task(worker):
    """The pool process's merges embedded a2's texts (its engine keeps their vectors); the erasure
    runs in this process. The worker's next task reads the erasure generation first and forgets
    its caches (federation.caches; tests/test_erasure_caches.py checks what forgetting drops)."""
    from workers.tasks import prune_routing_calls_task

    round_, _ = build_federation(config=RELEASING_CONFIG)
    _wait_for_round(_close_round(round_))
    pipeline.erase_client(Client.objects.get(name="a2"))
    assert not any(FORGOT in line for line in worker.log)  # no task yet, no watcher
    prune_routing_calls_task.delay().get(timeout=120)
    worker.wait_for(FORGOT, timeout=60)  # logged before the task ran


@pytest.mark.parametrize("worker", [({"LOG_LEVEL": "INFO", "SYNAPSE_ERASURE_CHECK_SECONDS": "1"},
                                     None)], indirect=True)
def test_an_idle_worker_forgets_an_erased_clients_texts_at_its_watchers_check(worker):
    """The same pool process with no task after the erasure: its watcher thread reads the
    generation (every second here) and forgets."""
    round_, _ = build_federation(config=RELEASING_CONFIG)
    _wait_for_round(_close_round(round_))
    pipeline.erase_client(Client.objects.get(name="a2"))
    worker.wait_for(FORGOT, timeout=120)


def test_worker_killed_mid_merge_yields_the_same_global_compendium(worker):
    round_, clients = build_federation(config=RELEASING_CONFIG)
    info = _close_round(round_)
    worker.wait_for("edge merge started")
    killed = worker.kill_pool_child()
    sha = _wait_for_round(info)
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason
    log = "".join(worker.log)
    assert f"{killed}" in log or "WorkerLostError" in log or "exited with" in log
    starts = log.count("edge merge started")
    assert starts >= 3, "the interrupted edge merge was delivered again"
    # no double release
    assert PrivacyLedgerEntry.objects.filter(round=round_).count() == _released_per_round()
    # An undisturbed run of the same round, in this process, gives the same canonical bytes.
    orgs = sorted({c.organization_id for c in clients.values()})
    for org in orgs:
        pipeline.run_edge_merge(round_.pk, org)
    assert pipeline.run_server_merge(round_.pk) == sha


@pytest.mark.parametrize("worker", [({"SYNAPSE_TASK_MAX_DELIVERIES": "2"}, None)], indirect=True)
def test_an_edge_merge_whose_worker_always_dies_fails_the_round_instead_of_looping(worker):
    """Every edge merge's pool process is killed as it starts (as the OOM killer would, every
    time): each message is delivered again until its third delivery, which gives up and fails the
    round with the reason, instead of being delivered forever."""
    round_, _ = build_federation()
    _close_round(round_)
    killed, deadline = 0, time.monotonic() + 400
    while time.monotonic() < deadline:
        line = worker.lines.get(timeout=max(1.0, deadline - time.monotonic()))
        if "edge merge started" in line:
            worker.kill_pool_child()  # the line comes from the pool process, before its merge
            killed += 1
        elif "failed: the edge merge of organization" in line:
            break
    round_.refresh_from_db()
    assert round_.state == "failed", "".join(worker.log[-50:])
    assert "was delivered 3 times and its worker died every time" in round_.failure_reason
    assert 2 <= killed <= 4, killed  # each message ran at most twice
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()


@pytest.mark.parametrize(
    "worker", [({"SYNAPSE_LLM_BASE_URL": "<silent-llm>", "SYNAPSE_TASK_TIME_LIMIT_SECONDS": "40"},
                None)], indirect=True,
)
def test_a_merge_held_by_an_llm_that_never_answers_fails_its_round_at_the_time_limit(worker):
    """Found by review: no task had a time limit. An edge merge whose LLM endpoint never answers
    is stopped at SYNAPSE_TASK_TIME_LIMIT_SECONDS (the soft limit, raised in the task) and its
    round fails saying so; before, it waited out the LLM and published, however long that took
    (an endpoint that answers each question just within its limit holds a merge for hours)."""
    round_, _ = build_federation(config={"summarizer": "llm-single-shot", "seed": 11})
    info = _close_round(round_)
    for task_id in info["edge_tasks"]:
        AsyncResult(task_id).get(timeout=300, propagate=False)
    round_.refresh_from_db()
    assert round_.state == "failed", round_.state
    assert "failed: it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS (40 s)" in round_.failure_reason
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()


TUNE_QUEUE = f"synapse-test-tune-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize(
    "worker",
    [({"SYNAPSE_ROUTER_TUNE_EPOCHS": "1", "SYNAPSE_ROUTER_TUNE_QUEUE": TUNE_QUEUE,
       "SYNAPSE_DATA_DIR": "<tmp>"}, TUNE_QUEUE)],
    indirect=True,
)
def test_a_published_global_has_its_router_tuned_by_a_worker_task(worker):
    from routing import services as routing_services
    from routing.models import TunedRouter

    round_, _ = build_federation()
    _wait_for_round(_close_round(round_))
    # The worker that published queued the tuning on SYNAPSE_ROUTER_TUNE_QUEUE; the same worker
    # consumes that queue too, so the task's result arrives through the broker.
    received = worker.wait_for("Task synapse.tune_router[", timeout=120)
    assert "received" in received.lower() or "succeeded" in received, received
    task_id = received.split("synapse.tune_router[", 1)[1].split("]", 1)[0]
    outcome = AsyncResult(task_id).get(timeout=600)
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert outcome["version"] == glob.pk and outcome["state"] == "ready", outcome
    record = TunedRouter.objects.get(version=glob)
    assert record.state == TunedRouter.State.READY and Path(record.directory).is_dir()
    routing_services.forget_published_version()
    routing_services.forget_served()
    served = routing_services.served_compendium()
    assert served.tuned and served.routers["fusion"].engine.model_name == record.directory
    routing_services.forget_served()


def _beat_until_published(worker, tmp_path, check: str, round_, never: str) -> None:
    """Run Celery beat, checking every second, until the worker logs `check` returning
    `round_`'s number and then its server merge succeeding (`never`: the failure if the check
    never does)."""
    beat = subprocess.Popen(
        [str(CELERY), "-A", "synapse_web", "beat", "-l", "info",
         "--schedule", str(tmp_path / "beat-schedule")],
        cwd=ROOT, env={**worker.env, "SYNAPSE_DEADLINE_CHECK_SECONDS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    give_up = time.monotonic() + 300
    try:
        returned = f": [{round_.number}]"
        while not worker.wait_for(f"{check}[", timeout=120).rstrip().endswith(returned):
            assert time.monotonic() < give_up, never
        while "succeeded" not in worker.wait_for("Task synapse.server_merge[", timeout=600):
            assert time.monotonic() < give_up + 600, "the merge never finished"
    finally:
        beat.terminate()
        beat.wait(timeout=30)


def test_beat_closes_a_round_at_its_deadline_and_the_worker_publishes_it(worker, tmp_path):
    import datetime as dt

    from django.utils import timezone

    from federation.models import AuditLog

    round_, _ = build_federation(state="open")
    Round.objects.filter(pk=round_.pk).update(closes_at=timezone.now() + dt.timedelta(seconds=3))
    # Beat sends the check every second; one of them finds the deadline passed and closes.
    _beat_until_published(worker, tmp_path, "synapse.close_due_rounds", round_,
                          "beat's checks never closed the round")
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason
    close = AuditLog.objects.get(action="round.close", target_id=str(round_.pk))
    assert close.actor_label == "round deadline" and close.actor is None


def test_beat_starts_again_a_round_whose_start_was_never_queued(worker, tmp_path):
    """The close committed, then its process died before queuing the start of the merges: beat's
    check starts the round again as run 2, and the worker publishes it."""
    import datetime as dt

    from django.utils import timezone

    from federation.models import AuditLog

    round_, _ = build_federation()  # closing, its start never queued
    Round.objects.filter(pk=round_.pk).update(
        attempt_started_at=timezone.now() - dt.timedelta(minutes=10))
    _beat_until_published(worker, tmp_path, "synapse.requeue_lost_merges", round_,
                          "beat's checks never started the round again")
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason
    assert round_.attempt == 2 and round_.queued_attempt == 2
    requeue = AuditLog.objects.get(action="round.requeue", target_id=str(round_.pk))
    assert requeue.actor_label == "merge pipeline" and requeue.details["lost_attempt"] == 1
