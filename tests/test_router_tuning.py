"""The server's tuned router (federation.tuning): tuned after a publish, served by the routing API,
skipped for a global that is no longer served, failures recorded while routing goes on frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import call_command

from compendium.schema import Compendium
from federation.models import ProbeQuery, Round
from federation.signals import global_published
from federation.tuning import TuningError, tune_published_router
from routing import services
from routing.models import TunedRouter
from tests.routing_data import publish_with_probe, published_global_data

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def _fresh(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    services.forget_published_version()
    services.forget_served()
    yield
    services.forget_served()


@pytest.fixture(scope="module")
def data():
    data = published_global_data(12, seed=5, test_fraction=0.3, max_per_tool=10)
    return {**data, "probe": data["test"][:80], "queries": [q.query for q in data["test"][80:120]]}


def _publish(data, number=1, compendium=None):
    return publish_with_probe(data, number, compendium)


def _holding_the_tuning_lock(version):
    """Another database session (another process, as far as the server knows) holding the lock
    of `version`'s tuning; closing it releases the lock, as a killed worker's session would."""
    import psycopg
    from django.db import connection

    from federation import tuning

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    other = psycopg.connect(**params, autocommit=True)
    other.execute("SELECT pg_advisory_lock(%s, %s)", [tuning._TUNING_LOCK, version.pk])
    return other


def _gone(other) -> None:
    """Close the session of `_holding_the_tuning_lock` and wait until the server has ended it:
    closing returns as soon as the goodbye is sent, and the server process releases the
    session's locks as it exits, a moment later (a try-lock right after could still fail)."""
    import time

    from django.db import connection

    pid = other.info.backend_pid
    other.close()
    for _ in range(1000):
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE pid = %s", [pid])
            if not cursor.fetchone()[0]:
                return
        time.sleep(0.01)
    raise AssertionError(f"the session {pid} still holds locks 10 s after it was closed")


def test_publishing_tunes_the_router_and_the_routing_api_switches_to_it(data, settings):
    round_, version = _publish(data)
    before = services.route_query(data["queries"][0])
    assert before["tuned_router"] is False  # routing works at once, with the frozen model

    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 0
    global_published.send(sender=Round, round=round_, version=version)
    assert not TunedRouter.objects.exists()  # off by default
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient
    from django.urls import reverse

    http = HttpClient()
    http.force_login(get_user_model().objects.create_superuser("op", "op@example.org", "pw"))
    page = http.get(reverse("dashboard:routing")).content.decode()
    assert "Routed with the frozen MiniLM" in page and "SYNAPSE_ROUTER_TUNE_EPOCHS=1" in page

    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 1
    global_published.send(sender=Round, round=round_, version=version)  # eager Celery task
    record = TunedRouter.objects.get(version=version)
    assert record.state == TunedRouter.State.READY, record.detail
    folder = Path(record.directory)
    assert folder.parent == settings.DATA_DIR / "routers"
    assert (folder / "synapse-router.npz").is_file() and (folder / "config.json").is_file()
    scenarios = len(data["compendium"].scenarios)
    assert record.rows >= scenarios + len(data["tools"])  # scenarios, descriptions, probe half
    assert 0.0 <= record.probe_accuracy <= 1.0 and 0.0 <= record.frozen_probe_accuracy <= 1.0
    # Where it was fine-tuned, as torch saw it: the GPU worker's operator checks this.
    from routing.finetune import torch_device_name

    assert record.device == torch_device_name() and record.device.split(":")[0] in ("cpu", "cuda")
    assert 0 < record.fine_tune_seconds <= record.seconds

    services.forget_published_version()
    served = services.served_compendium()
    assert served.tuned and served.routers["fusion"].engine.model_name == str(folder)
    assert served.index.embeddings.shape == (scenarios, 384)
    # Re-embedded by the tuned model, not the stored frozen vectors.
    assert abs(served.index.embeddings - data["embeddings"]).max() > 1e-3
    after = services.route_query(data["queries"][0])
    assert after["tuned_router"] is True and after["compendium_round"] == 1
    # An operator's params file overrides the tuned router's weights too, as the README says
    # and as `synapse-client route --params` does (it was ignored once the tuned router served).
    from routing.router import RoutingParams

    assert served.routers["fusion"].params.weights != RoutingParams().weights
    RoutingParams().save(settings.DATA_DIR / "params.json")
    settings.SYNAPSE_ROUTING_PARAMS = str(settings.DATA_DIR / "params.json")
    services.forget_served()
    overridden = services.served_compendium()
    assert overridden.tuned and overridden.routers["fusion"].params.weights == RoutingParams().weights
    settings.SYNAPSE_ROUTING_PARAMS = ""
    services.forget_served()
    batch = services.route_queries(data["queries"])
    assert batch["tuned_router"] is True and len(batch["results"]) == len(data["queries"])

    # The routing playground says which encoder routes, and how it did on the probe.
    page = http.get(reverse("dashboard:routing")).content.decode()
    assert 'id="router-tuning"' in page and "fine-tuned on it: 1 epoch(s)" in page
    assert f"{record.rows} texts" in page
    assert f's on <code id="tuning-device">{record.device}</code>' in page
    assert " s in all, the fine-tuning itself " in page
    assert "synapse-client pull --out global.json --router" in page

    # Asked again, a ready router is not tuned again.
    again = tune_published_router(version.pk, 1)
    assert again.pk == record.pk and again.finished_at == record.finished_at

    # A lost folder: routing goes on with the frozen model rather than failing.
    for path in sorted(folder.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    folder.rmdir()
    services.forget_served()
    assert services.route_query(data["queries"][1])["tuned_router"] is False


def test_the_tuned_router_never_names_a_deactivated_tool_either(data, settings):
    """The tuned router retrieves in memory over the tuned model's vectors, with its own head: a
    tool the operator deactivates is left out of its decisions as it is of the frozen router's,
    and comes back when reactivated, with no new tuning and no reload of the model."""
    from collections import Counter

    from compendium.models import Tool

    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600  # the admin's save in this process is seen at once
    _, version = _publish(data)
    assert tune_published_router(version.pk, 1).state == TunedRouter.State.READY
    services.forget_published_version()
    queries = data["queries"]
    before = services.route_queries(queries, 10)
    assert before["tuned_router"] is True
    gone = Counter(r["tool"] for r in before["results"]).most_common(1)[0][0]
    engine = services.served_compendium().routers["fusion"].engine

    def named(answer):
        return ({answer["tool"]} | {c["tool"] for c in answer["candidates"]}
                | {r["tool"] for r in answer["ranking"]})

    def without_latency(answers):
        return [{k: v for k, v in a.items() if k != "latency_ms"} for a in answers]

    tool = Tool.objects.get(tool_id=gone)
    tool.active = False
    tool.save()
    after = services.route_queries(queries, 10)
    assert after["tuned_router"] is True
    assert all(r["tool"] and gone not in named(r) for r in after["results"])
    query = next(q for q, r in zip(queries, before["results"], strict=True) if r["tool"] == gone)
    alone = services.route_query(query, 10)
    assert alone["tuned_router"] and alone["tool"] and gone not in named(alone)
    assert services.served_compendium().routers["fusion"].engine is engine  # nothing reloaded
    tool.active = True
    tool.save()
    again = services.route_queries(queries, 10)
    assert without_latency(again["results"]) == without_latency(before["results"])


def test_a_global_no_longer_served_is_skipped_and_newer_routers_retire_older_ones(data, settings):
    _, first = _publish(data, 1)
    assert tune_published_router(first.pk, 1).state == TunedRouter.State.READY
    # A file beside the routers (an operator's note) is no router: retiring leaves it.
    (settings.DATA_DIR / "routers" / "README.txt").write_text("routers tuned on the globals\n")
    _, second = _publish(data, 2)
    newer = tune_published_router(second.pk, 1)
    assert newer.state == TunedRouter.State.READY
    assert TunedRouter.objects.get(version=first).state == TunedRouter.State.RETIRED
    assert {p.name for p in (settings.DATA_DIR / "routers").iterdir()} == {
        "README.txt", Path(newer.directory).name
    }
    (settings.DATA_DIR / "routers" / "README.txt").unlink()
    services.forget_published_version()
    assert services.served_compendium().version_id == second.pk and services.served_compendium().tuned

    skipped = tune_published_router(first.pk, 1, force=True)  # not served: not tuned again
    assert skipped.state == TunedRouter.State.SKIPPED and "newer global" in skipped.detail
    assert [p.name for p in (settings.DATA_DIR / "routers").iterdir()] == [Path(newer.directory).name]


def test_a_global_superseded_while_it_is_tuned_keeps_no_router_and_retires_none(data, settings, monkeypatch):
    """Round 1's global is tuning when round 2's is published and its router made ready (by
    another worker or `manage.py tune_router`): round 1's tuning finishes after, keeps nothing
    and leaves round 2's router served."""
    import routing.finetune

    _, first = _publish(data, 1)
    tune = routing.finetune.tune_router
    newer = {}

    def tune_while_round_2_publishes(*args, **kwargs):
        tuned = tune(*args, **kwargs)
        monkeypatch.setattr(routing.finetune, "tune_router", tune)
        _, second = _publish(data, 2)
        services.forget_published_version()
        newer["record"] = tune_published_router(second.pk, 1)
        return tuned

    monkeypatch.setattr(routing.finetune, "tune_router", tune_while_round_2_publishes)
    stale = tune_published_router(first.pk, 1)
    assert stale.state == TunedRouter.State.SKIPPED and "published while" in stale.detail
    served = TunedRouter.objects.get(pk=newer["record"].pk)
    assert served.state == TunedRouter.State.READY
    assert [p.name for p in (settings.DATA_DIR / "routers").iterdir()] == [Path(served.directory).name]


@pytest.mark.django_db(transaction=True)  # each write commits, as in a worker
def test_a_global_merged_again_while_it_is_tuned_is_gone_not_an_error(data, settings, monkeypatch):
    """An erasure merges the served global's round again while its router is tuned: the version
    is deleted, and its TunedRouter row with it (cascade). The tuning that finishes after
    answers None (gone, as the task and the command say), keeps no folder, and neither inserts
    the row again for a version that no longer exists (an IntegrityError in the worker) nor
    fails: the new global's own tuning is queued by its publication."""
    import routing.finetune
    from compendium.models import CompendiumVersion
    from workers.tasks import tune_router_task

    _, first = _publish(data, 1)
    tune = routing.finetune.tune_router

    def tune_while_an_erasure_merges_again(*args, **kwargs):
        tuned = tune(*args, **kwargs)
        CompendiumVersion.objects.filter(pk=first.pk).delete()  # what the erasure commits
        return tuned

    monkeypatch.setattr(routing.finetune, "tune_router", tune_while_an_erasure_merges_again)
    assert tune_published_router(first.pk, 1) is None
    assert not TunedRouter.objects.exists()
    routers = settings.DATA_DIR / "routers"
    assert not routers.exists() or list(routers.iterdir()) == []

    _, second = _publish(data, 2)

    def fail_while_an_erasure_merges_again(*args, **kwargs):
        CompendiumVersion.objects.filter(pk=second.pk).delete()
        raise RuntimeError("out of memory")

    monkeypatch.setattr(routing.finetune, "tune_router", fail_while_an_erasure_merges_again)
    assert tune_router_task(second.pk, 1) == {"version": second.pk, "state": "gone"}
    assert not TunedRouter.objects.exists()


def test_a_second_tuning_of_the_same_router_does_not_start_while_one_runs(data, capsys):
    """Another process holds the global's tuning (here: a second database session holding its
    lock): a tuning asked for meanwhile, by the worker's task or the command, does not start and
    says why, leaving the row alone; once that process is gone (its session ended, as when a
    worker is killed) the next one tunes."""
    from django.core.management.base import CommandError

    from federation import tuning
    from workers.tasks import tune_router_task

    _, version = _publish(data, 1)
    other = _holding_the_tuning_lock(version)
    try:
        with pytest.raises(tuning.TuningBusy, match="being tuned by another process"):
            tune_published_router(version.pk, 1)
        assert not TunedRouter.objects.filter(version=version).exists()
        answer = tune_router_task(version.pk, 1)
        assert answer["state"] == "busy" and "another process" in answer["detail"]
        with pytest.raises(CommandError, match="being tuned by another process"):
            call_command("tune_router", "--epochs", "1")
    finally:
        _gone(other)  # the holder goes away: the server releases its lock
    record = tune_published_router(version.pk, 1)
    assert record.state == TunedRouter.State.READY


def test_a_forced_retune_serves_the_old_router_until_the_new_one_replaces_it(data, monkeypatch):
    """`tune_router --force`: the ready router stays ready and served while it runs; the new one
    gets a folder of its own, so every process's cached router changes, and the old folder goes;
    a retune that fails keeps the old router served and says so."""
    import routing.finetune

    _, version = _publish(data, 1)
    first = tune_published_router(version.pk, 1)
    old = Path(first.directory)
    services.forget_published_version()
    assert services.route_query(data["queries"][0])["tuned_router"] is True
    key = next(iter(services._served))
    tune = routing.finetune.tune_router
    seen = {}

    def tune_and_look(*args, **kwargs):
        row = TunedRouter.objects.get(pk=first.pk)
        seen["state"], seen["directory"] = row.state, row.directory
        return tune(*args, **kwargs)

    monkeypatch.setattr(routing.finetune, "tune_router", tune_and_look)
    again = tune_published_router(version.pk, 1, force=True)
    assert seen == {"state": TunedRouter.State.READY, "directory": str(old)}  # served meanwhile
    assert again.state == TunedRouter.State.READY and again.directory != str(old)
    assert Path(again.directory).is_dir() and not old.exists()
    services.forget_published_version()
    assert services.route_query(data["queries"][0])["tuned_router"] is True
    assert key not in services._served and next(iter(services._served))[2] == again.directory

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(routing.finetune, "tune_router", broken)
    failed = tune_published_router(version.pk, 1, force=True)
    assert failed.state == TunedRouter.State.READY and failed.directory == again.directory
    assert "tuning again failed (RuntimeError: out of memory)" in failed.detail
    assert Path(again.directory).is_dir()
    assert [p.name for p in Path(again.directory).parent.iterdir()] == [Path(again.directory).name]


def test_a_failure_after_the_fine_tuning_leaves_the_row_failed_and_no_folder(data, settings,
                                                                           monkeypatch):
    """The database connection lost during minutes of tuning (here: the check that the global is
    still served raising) left the row `running` for good, and a folder no row named."""
    from django.db import OperationalError

    from federation import tuning

    _, version = _publish(data, 1)
    served, calls = tuning._served, []

    def lost_after_tuning(v):
        calls.append(v.pk)
        if len(calls) > 1:
            raise OperationalError("server closed the connection unexpectedly")
        return served(v)

    monkeypatch.setattr(tuning, "_served", lost_after_tuning)
    record = tune_published_router(version.pk, 1)
    assert record.state == TunedRouter.State.FAILED and "OperationalError" in record.detail
    assert TunedRouter.objects.get(pk=record.pk).state == TunedRouter.State.FAILED
    routers = settings.DATA_DIR / "routers"
    assert not routers.exists() or list(routers.iterdir()) == []


def test_giving_up_a_tuning_removes_what_killed_runs_left_unless_one_still_runs(data, settings):
    """A worker killed mid-tuning leaves a .partial folder (about 130 MB); giving up after the
    last delivery left it for good, and failed the row even while a run still held the tuning."""
    from federation import tuning

    _, version = _publish(data, 1)
    record = tuning.queue_tuning(version, 1)
    leftover = settings.DATA_DIR / "routers" / f"{tuning._folder_prefix(version)}dead.partial"
    leftover.mkdir(parents=True)
    other = _holding_the_tuning_lock(version)
    try:
        running = tuning.give_up_tuning(version.pk, "worker lost 3 times")
        assert running.state == record.state and leftover.is_dir()  # left to the running one
    finally:
        _gone(other)
    given_up = tuning.give_up_tuning(version.pk, "worker lost 3 times")
    assert given_up.state == TunedRouter.State.FAILED and given_up.detail == "worker lost 3 times"
    assert not leftover.exists()


@pytest.mark.parametrize("meanwhile", ["ready", "deleted"])
def test_giving_up_reads_the_row_again_once_it_holds_the_tuning(data, monkeypatch, meanwhile):
    """Found by audit: giving up read the row before taking the tuning's lock and failed it from
    that read. A run that finished between the two (it held the lock, then released it) had its
    ready router overwritten `failed` (the routing API stopped serving it); a global deleted
    meanwhile (an erasure merged its round again) raised DoesNotExist in the worker."""
    import contextlib

    from federation import tuning

    _, version = _publish(data, 1)
    record = tuning.queue_tuning(version, 1)
    taken = tuning._tuning_lock

    @contextlib.contextmanager
    def finished_just_before(version_id):
        if meanwhile == "ready":  # the other run's last write, just before it released the lock
            TunedRouter.objects.filter(pk=record.pk).update(
                state=TunedRouter.State.READY, detail="", directory="/routers/round-1")
        else:
            version.delete()
        with taken(version_id) as held:
            yield held

    monkeypatch.setattr(tuning, "_tuning_lock", finished_just_before)
    answer = tuning.give_up_tuning(version.pk, "worker lost 3 times")
    if meanwhile == "ready":
        assert answer.state == TunedRouter.State.READY
        assert TunedRouter.objects.get(pk=record.pk).state == TunedRouter.State.READY
    else:
        assert answer is None and not TunedRouter.objects.filter(pk=record.pk).exists()


def test_the_beat_check_of_a_tuning_whose_global_is_deleted_meanwhile_queues_nothing(
        data, settings, monkeypatch):
    """Found by audit: the check read the row again under the lock with refresh_from_db, which
    raised DoesNotExist in Celery beat's task when an erasure deleted the global (and the row)
    between its first read and the lock."""
    import contextlib

    from federation import tuning
    from workers.tasks import requeue_lost_tuning_task

    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 1
    _, version = _publish(data, 1)
    record = tuning.queue_tuning(version, 1)
    taken = tuning._tuning_lock

    @contextlib.contextmanager
    def deleted_just_before(version_id):
        version.delete()
        with taken(version_id) as held:
            yield held

    monkeypatch.setattr(tuning, "_tuning_lock", deleted_just_before)
    settings.SYNAPSE_TUNING_REQUEUE_SECONDS = 0
    assert requeue_lost_tuning_task() is None
    assert not TunedRouter.objects.filter(pk=record.pk).exists()


def test_a_lost_tuning_is_queued_again_by_the_beat_check_and_given_up_after_the_limit(data, settings):
    """A tuning whose message was lost (the broker down at the publication: the row stayed
    `queued` for good) or whose worker died mid-run (`running`, no lock held) was never tried
    again; the routing page said 'being tuned' forever."""
    from datetime import timedelta

    from django.utils import timezone

    from federation import tuning
    from workers.tasks import requeue_lost_tuning_task

    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 1
    settings.SYNAPSE_TASK_MAX_DELIVERIES = 2
    _, version = _publish(data, 1)
    record = tuning.queue_tuning(version, 1)
    assert record.queued_at is not None and record.requeues == 0
    assert tuning.requeue_lost_tuning(3600) is None  # queued a moment ago: its task may wait

    an_hour_ago = timezone.now() - timedelta(seconds=3601)
    TunedRouter.objects.filter(pk=record.pk).update(queued_at=an_hour_ago)
    other = _holding_the_tuning_lock(version)
    try:
        assert tuning.requeue_lost_tuning(3600) is None  # a process is tuning it after all
    finally:
        _gone(other)
    again = tuning.requeue_lost_tuning(3600)
    assert again.state == TunedRouter.State.QUEUED and again.requeues == 1
    assert again.queued_at > an_hour_ago
    assert tuning.requeue_lost_tuning(3600) is None  # not queued again at every check

    # A worker that died mid-run: `running`, nobody holding the lock, its partial folder left.
    TunedRouter.objects.filter(pk=record.pk).update(state=TunedRouter.State.RUNNING,
                                                    queued_at=an_hour_ago)
    leftover = settings.DATA_DIR / "routers" / f"{tuning._folder_prefix(version)}dead.partial"
    leftover.mkdir(parents=True)
    again = tuning.requeue_lost_tuning(3600)
    assert again.state == TunedRouter.State.QUEUED and again.requeues == 2
    assert not leftover.exists()

    # Past SYNAPSE_TASK_MAX_DELIVERIES requeues it fails, saying why, instead of every hour.
    TunedRouter.objects.filter(pk=record.pk).update(queued_at=an_hour_ago)
    assert tuning.requeue_lost_tuning(3600) is None
    record.refresh_from_db()
    assert record.state == TunedRouter.State.FAILED and "queued again 2 times" in record.detail
    assert "its task was lost (queued since" in record.detail
    assert tuning.requeue_lost_tuning(0) is None  # failed: left to manage.py tune_router

    # The beat task queues the tuning (eager here) and it runs: ready, its count reset.
    TunedRouter.objects.filter(pk=record.pk).update(state=TunedRouter.State.QUEUED,
                                                    queued_at=an_hour_ago, requeues=0)
    assert requeue_lost_tuning_task.delay().get() == version.pk
    record.refresh_from_db()
    assert record.state == TunedRouter.State.READY and record.requeues == 0, record.detail
    assert requeue_lost_tuning_task.delay().get() is None  # ready: nothing to do


def test_the_beat_check_tunes_the_served_global_when_tuning_was_turned_on_after_it(data, settings):
    from federation import tuning

    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 0
    _, first = _publish(data, 1)
    assert tuning.requeue_lost_tuning(0) is None  # tuning off: nothing
    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 2
    queued = tuning.requeue_lost_tuning(3600)  # no row at all: queued at once
    assert queued.version_id == first.pk and queued.state == TunedRouter.State.QUEUED
    assert queued.epochs == 2 and queued.requeues == 0


def test_a_failed_tuning_is_recorded_and_routing_stays_frozen(data):
    one_tool = data["compendium"].scenarios[0].tool_id
    compendium = Compendium(
        scenarios=[s for s in data["compendium"].scenarios if s.tool_id == one_tool],
        metadata=data["compendium"].metadata,
    )
    _, version = _publish(data, compendium=compendium)
    # The probe's requests of other tools would teach it those: leave it one tool in all.
    ProbeQuery.objects.exclude(tool_id=one_tool).delete()
    record = tune_published_router(version.pk, 1)
    assert record.state == TunedRouter.State.FAILED
    assert "at least two labels" in record.detail
    assert not (Path(services.settings.DATA_DIR) / "routers").exists() or not any(
        p for p in (Path(services.settings.DATA_DIR) / "routers").iterdir()
        if not p.name.endswith(".partial")
    )
    assert services.route_query(data["queries"][0])["tuned_router"] is False
    with pytest.raises(TuningError, match="at least 1"):
        tune_published_router(version.pk, 0)


def test_tune_router_command(data, capsys):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no global compendium is published"):
        call_command("tune_router")
    _publish(data)
    call_command("tune_router", "--epochs", "1")
    out = capsys.readouterr().out
    assert "round 1: routing encoder tuned on" in out and "tuned," in out
    assert f"1 epoch(s) on {TunedRouter.objects.get().device}," in out
    assert TunedRouter.objects.get().state == TunedRouter.State.READY


def test_a_tuning_stopped_at_its_soft_time_limit_says_so(data, monkeypatch, settings):
    """Found by audit: README has a tuning past SYNAPSE_TASK_TIME_LIMIT_SECONDS fail its router
    saying it ran past that limit, as a merge fails its round; the row said
    "SoftTimeLimitExceeded: SoftTimeLimitExceeded()"."""
    from billiard.exceptions import SoftTimeLimitExceeded

    import routing.finetune

    def past_the_limit(*args, **kwargs):
        raise SoftTimeLimitExceeded()

    _, version = _publish(data, 1)
    monkeypatch.setattr(routing.finetune, "tune_router", past_the_limit)
    record = tune_published_router(version.pk, 1)
    assert record.state == TunedRouter.State.FAILED
    assert record.detail == (
        f"it ran past SYNAPSE_TASK_TIME_LIMIT_SECONDS ({settings.SYNAPSE_TASK_TIME_LIMIT_SECONDS} s)")
