"""The server's tuned router: after a global is published, the routing encoder is fine-tuned on it.

`tune_published_router(version_id)` runs `routing.finetune.tune_router` on the published global as
the routing API serves it (its stored scenarios, descriptions and precautions) and on the public
probe set: the encoder learns from the global and from the half of the probe the router's head
learns from, and the router's fusion weights are fitted on the other half. Model, re-embedded
global, head and weights go to one folder under `SYNAPSE_DATA_DIR/routers/`; the `TunedRouter`
row records the state, and the routing API switches to it once it is `ready` (routing.services).

Nothing that clients send changes, and nothing private is read: the global and the probe set are
what the server publishes. Measured (`manage.py simulate --tune-router 1`, README "Results"): on
MetaTool the tuned router lifts top-1 over the frozen MiniLM on every seed.

Called by the Celery task `synapse.tune_router` (queued when a global is published and
SYNAPSE_ROUTER_TUNE_EPOCHS > 0) and by `manage.py tune_router`. Idempotent: a version whose
router is ready is not tuned again; a failed or skipped one is retried by the command.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import re
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from compendium.models import CompendiumVersion
from compendium.services import load_compendium
from federation.errors import NotFound
from federation.pipeline import probe_pairs
from routing.models import TunedRouter
from routing.router import probe_halves
from routing.services import build_served, published_global_version, served_rows

log = logging.getLogger(__name__)


class TuningError(ValueError):
    """A tuning request that cannot be run, with what is wrong."""


class TuningBusy(TuningError):
    """Another process is tuning the same global's router (a second worker, a redelivered
    message, `manage.py tune_router` beside a worker): this one does not start."""


TUNING_FAILED_FOR_THE_OPERATOR = "the federation operator sees why and can tune it again"


class RouterUnavailable(NotFound):
    """A published global has no tuned router to download (yet, or any more): the detail says why
    and `code` names the case (router_off, router_tuning, router_failed, router_retired)."""

    def __init__(self, detail: str, code: str):
        super().__init__(detail)
        self.code = code


def tune_epochs() -> int:
    """SYNAPSE_ROUTER_TUNE_EPOCHS: epochs of fine-tuning after each publish (0: off)."""
    return int(getattr(settings, "SYNAPSE_ROUTER_TUNE_EPOCHS", 0) or 0)


def max_epochs() -> int:
    """The most epochs a tuning may run: what its row's column (TunedRouter.epochs) holds."""
    return connection.ops.integer_field_range(TunedRouter._meta.get_field("epochs").get_internal_type())[1]


def routers_dir() -> Path:
    return Path(settings.DATA_DIR) / "routers"


def folder_prefix(round_number: int, version_id: int, sha256: str) -> str:
    """The start of the name of every folder a tuning of that global writes (`_folder`)."""
    return f"round-{round_number}-v{version_id}-{sha256[:12]}-"


def _folder_prefix(version: CompendiumVersion) -> str:
    return folder_prefix(version.round.number, version.pk, version.sha256)


# `_folder`'s names, and the version id in them (a `.partial`: one being written).
_FOLDER_NAME = re.compile(r"round-\d+-v(\d+)-[0-9a-f]{12}-[0-9a-f]+(\.partial)?")


def remove_router_folders(prefixes, routers: Path | None = None) -> int:
    """Remove every folder of the tunings of the globals whose `folder_prefix` is in `prefixes`
    (deleted globals: an erasure merged their round again or removed their global): the ready or
    retired router and what a killed tuning left (`.partial`), each an encoder fine-tuned on the
    global's texts. A tuning of one still running finds its global gone and keeps nothing.
    Returns the folders removed."""
    root = routers or routers_dir()
    removed = 0
    for prefix in set(prefixes):
        for folder in root.glob(f"{glob.escape(prefix)}*"):
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
    return removed


def _folder(version: CompendiumVersion, routers: Path) -> Path:
    """A folder of its own for each tuning of `version` (a forced retune gets a new name, so
    that every server process sees a new router, not the old one it keeps in memory)."""
    return routers / f"{_folder_prefix(version)}{secrets.token_hex(4)}"


def _written(record: TunedRouter, **fields) -> TunedRouter | None:
    """`fields` set on `record` and written over its row; None when the row is gone: its global
    was deleted meanwhile (an erasure merged its round again, or deleted its global), and the row
    with it (cascade). `save()` would insert the row again for a version that no longer exists,
    an IntegrityError in the worker."""
    for name, value in fields.items():
        setattr(record, name, value)
    return record if TunedRouter.objects.filter(pk=record.pk).update(**fields) else None


def _finish(record: TunedRouter, state: str, detail: str = "", **fields) -> TunedRouter | None:
    return _written(record, state=state, detail=detail[:2000], finished_at=timezone.now(),
                    requeues=0, **fields)


def queue_tuning(version: CompendiumVersion, epochs: int) -> TunedRouter:
    """The version's TunedRouter row, (re)set to `queued` unless it is ready or running."""
    record, created = TunedRouter.objects.get_or_create(
        version=version, defaults={"epochs": epochs, "queued_at": timezone.now()}
    )
    if not created and record.state not in (TunedRouter.State.READY, TunedRouter.State.RUNNING):
        record.state = TunedRouter.State.QUEUED
        record.epochs = epochs
        record.detail = ""
        record.queued_at = timezone.now()
        record.finished_at = None
        record.save()
    return record


def requeue_lost_tuning(after_seconds: float) -> TunedRouter | None:
    """The served global's tuning, to queue again when its message was lost: a row `queued` for
    more than `after_seconds` (the broker was down when the global was published, or lost the
    message), a row `running` while no process holds its lock (its worker died, and Redis would
    deliver the message again only after its visibility timeout) or no row at all while tuning is
    on (it was turned on after the publication). The row is set back to `queued` now, so that it
    is not queued again at every check while its task waits; the caller queues the task. None:
    nothing to queue (tuning off, no published global, its tuning recent, running, or done: a
    failed one is retried by `manage.py tune_router`), or given up: queued again
    SYNAPSE_TASK_MAX_DELIVERIES times since it last finished, it fails saying so. A message that
    was only slow is harmless to queue twice: the second run finds the router ready, or the
    tuning busy."""
    epochs = tune_epochs()
    version = published_global_version()
    if epochs < 1 or version is None:
        return None
    record = TunedRouter.objects.filter(version=version).first()
    if record is None:
        return queue_tuning(version, epochs)
    if record.state not in (TunedRouter.State.QUEUED, TunedRouter.State.RUNNING):
        return None
    since = record.queued_at or record.created_at
    if (timezone.now() - since).total_seconds() < after_seconds:
        return None
    with _tuning_lock(version.pk) as held:
        if not held:  # a tuning of it runs
            return None
        record = TunedRouter.objects.filter(pk=record.pk).first()
        if record is None or record.state not in (TunedRouter.State.QUEUED,
                                                  TunedRouter.State.RUNNING):
            return None  # it finished between the two reads, or its global was deleted
        _remove_partials(version, None)  # what a dead run left (this process holds the lock)
        lost = f"its task was lost ({record.state} since {since:%Y-%m-%d %H:%M:%S %Z})"
        if record.requeues >= settings.SYNAPSE_TASK_MAX_DELIVERIES:
            log.warning("the tuning of round %s's router is given up: %s", version.round.number, lost)
            _finish(record, TunedRouter.State.FAILED,
                    f"{lost} after being queued again {record.requeues} times; "
                    "manage.py tune_router tries again")
            return None
        log.warning("the tuning of round %s's router is queued again: %s", version.round.number,
                    lost)
        record.state = TunedRouter.State.QUEUED
        record.epochs = epochs
        record.queued_at = timezone.now()
        record.requeues += 1
        record.save(update_fields=["state", "epochs", "queued_at", "requeues"])
        return record


def tune_published_router(
    version_id: int, epochs: int | None = None, *, force: bool = False, routers: Path | None = None
) -> TunedRouter | None:
    """Tune the routing encoder on the published global `version_id` (`epochs`, default
    SYNAPSE_ROUTER_TUNE_EPOCHS, at least 1). Returns its TunedRouter row: `ready`, `skipped`
    (it is no longer the served global) or `failed` (with the reason); None when the version no
    longer exists (a re-materialized round replaced it, before or while it was tuned). `force`:
    tune again even when ready. `routers`: the folder that holds the tuned routers (default `routers_dir()`; a simulation's
    scratch federation keeps its own, away from the operator's)."""
    epochs = epochs if epochs is not None else tune_epochs()
    if epochs < 1:
        raise TuningError(f"epochs must be at least 1, not {epochs}")
    most = max_epochs()
    if epochs > most:  # the row's column holds no more (a larger figure was a DataError)
        raise TuningError(f"epochs must be at most {most}, not {epochs}")
    version = (
        CompendiumVersion.objects.filter(pk=version_id, kind=CompendiumVersion.Kind.GLOBAL)
        .select_related("round")
        .first()
    )
    if version is None:
        return None
    with _tuning_lock(version.pk) as held:
        if not held:
            raise TuningBusy(
                f"the router of round {version.round.number} is being tuned by another process; "
                "its row says when it is done"
            )
        return _tune_locked(version, epochs, force, routers)


# One tuning of a global's router at a time, across processes: a PostgreSQL session lock, which
# the server releases by itself when the process holding it dies (a worker killed mid-tuning does
# not keep the next delivery from taking over, as a `running` state in a row would).
_TUNING_LOCK = 0x53594E54  # "SYNT"


@contextlib.contextmanager
def _tuning_lock(version_id: int):
    key = [_TUNING_LOCK, version_id & 0x7FFFFFFF]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", key)
        (held,) = cursor.fetchone()
    try:
        yield held
    finally:
        if held:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s, %s)", key)
            except DatabaseError as exc:  # a lost connection took the lock with it
                log.warning("releasing the tuning lock of version %s: %s", version_id, exc)


def _tune_locked(
    version: CompendiumVersion, epochs: int, force: bool, routers: Path | None
) -> TunedRouter | None:
    record = queue_tuning(version, epochs)
    folder = Path(record.directory) if record.directory else None
    ready = record.state == TunedRouter.State.READY and folder is not None and folder.is_dir()
    if not _served(version):
        _remove_partials(version, routers)  # what a killed tuning of it left: it holds the lock
        if ready:  # a newer global's router retires it
            return record
        return _finish(
            record, TunedRouter.State.SKIPPED,
            "not the served global: a newer global is published, or this round is not published",
        )
    if ready and not force:
        return record
    # A forced retune of a ready router leaves it ready and served until the new one replaces
    # it (or keeps serving it if tuning again fails).
    retune = ready
    if not retune and _written(record, state=TunedRouter.State.RUNNING, epochs=epochs) is None:
        return None

    from routing.finetune import tune_router

    target = _folder(version, routers or routers_dir())
    partial = target.with_name(target.name + ".partial")
    _remove_partials(version, routers)  # what a killed tuning left (this one holds its lock)
    try:
        # The published content's rows, in its order: what clients pull (the saved vectors then
        # serve their copies as they are) and what the routing API routes with it.
        compendium = load_compendium(version)
        probe = probe_pairs()
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        seed = int(version.sha256[:8], 16)
        tuned = tune_router(
            compendium, probe, partial, epochs=epochs, seed=seed,
            manifest=_manifest_fields(version, epochs),
        )
    except Exception as exc:
        shutil.rmtree(partial, ignore_errors=True)
        log.warning("tuning the router of round %s failed: %s", version.round.number, exc)
        return _failed(record, exc, retune)
    # Minutes of tuning without a query: a connection the server closed meanwhile (its lock went
    # with it) is replaced rather than failing every query below. A live one is kept: it holds
    # the lock.
    if connection.connection is not None and not connection.is_usable():
        connection.close()
    try:
        record = _keep(version, record, tuned, probe, partial, target, retune)
    except Exception as exc:  # never left `running`, nor a folder no row names
        for folder in (partial, target):
            shutil.rmtree(folder, ignore_errors=True)
        log.warning("keeping the tuned router of round %s failed: %s", version.round.number, exc)
        return _failed(record, exc, retune)
    if record is None:  # its global was deleted while it was tuned: nothing serves the folder
        shutil.rmtree(target, ignore_errors=True)
        return None
    if record.state == TunedRouter.State.READY:
        try:
            retire_older(record)
        except Exception as exc:  # the new router is served; the old ones go next time
            log.warning("retiring the routers before round %s's failed: %s", version.round.number,
                        exc)
    return record


def _keep(version, record, tuned, probe, partial: Path, target: Path, retune: bool
          ) -> TunedRouter | None:
    """The tuned router in `partial` made the served one (or dropped when a newer global was
    published meanwhile)."""
    if not _served(version):
        # A newer global was published while this one was tuned (and its router may be ready
        # already): this router would serve nothing, and retiring the others would retire that one.
        shutil.rmtree(partial, ignore_errors=True)
        return _finish(
            record, TunedRouter.State.SKIPPED,
            "a newer global was published while this one was tuned: its router was not kept",
        )
    try:
        partial.rename(target)  # the folder appears whole or not at all
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        return _failed(record, exc, retune)
    # Both routers on the probe half the encoder did not learn from (the tuned router's fusion
    # weights were fitted on it, and both heads learnt from the whole probe: a check that tuning
    # went well, not an unbiased estimate; `manage.py simulate --tune-router` gives that).
    _, held = probe_halves(len(probe))
    held = [probe[i] for i in held]
    try:
        checks = {
            "probe_accuracy": _accuracy(tuned.router, held),
            "frozen_probe_accuracy": _accuracy(build_served(version).routers["fusion"], held),
        }
    except Exception as exc:  # the router is kept, without its check (not left `running`)
        log.warning("the probe check of round %s's tuned router failed: %s", version.round.number, exc)
        checks = {}
    record = _finish(
        record, TunedRouter.State.READY, directory=str(target), rows=tuned.rows,
        seconds=round(tuned.seconds, 1), fine_tune_seconds=round(tuned.fine_tune_seconds, 1),
        device=tuned.device, **checks,
    )
    return record


def _failed(record: TunedRouter, exc: Exception, retune: bool) -> TunedRouter | None:
    """A tuning that failed: its row failed with the reason, or for a forced retune of a ready
    router, still ready (its router served) and saying that tuning again failed (None: the row
    is gone with its global)."""
    from workers.tasks import time_limit_words

    reason = time_limit_words(exc) or f"{exc.__class__.__name__}: {exc}"
    if not retune:
        return _finish(record, TunedRouter.State.FAILED, reason)
    return _written(
        record,
        detail=f"tuning again failed ({reason}); the router tuned before is still served"[:2000],
    )


def fail_killed_tuning(version_id: int, reason: str) -> TunedRouter | None:
    """The tuning of `version_id`'s router killed by its worker (past its hard time limit): its
    row `queued` or `running` -> failed with `reason`; a ready one (a forced retune killed) stays
    ready, its router served, saying that tuning again failed. Called by the worker's main
    process before it kills the tuning's, whose session holds the tuning's lock: the row is
    written without that lock, its row lock waited for briefly (a row still locked then is left
    to beat's check, logged). What the killed run leaves is removed by the next tuning of it.
    None: no row (its global deleted), or the row left as it was."""
    from federation import services
    from federation.errors import Busy

    try:
        with transaction.atomic(), services.waiting_briefly("fail the tuning"):
            record = TunedRouter.objects.select_for_update().filter(version_id=version_id).first()
            if record is None:
                return None
            if record.state == TunedRouter.State.READY:
                return _written(record, detail=(
                    f"tuning again failed ({reason}); the router tuned before is still served"
                )[:2000])
            if record.state not in (TunedRouter.State.QUEUED, TunedRouter.State.RUNNING):
                return record
            log.warning("tuning the router of version %s failed: %s", version_id, reason)
            return _finish(record, TunedRouter.State.FAILED, reason)
    except Busy as busy:
        log.warning("the tuning of version %s not failed (%s): %s", version_id, busy, reason)
        return None


def give_up_tuning(version_id: int, reason: str) -> TunedRouter | None:
    """The tuning of `version_id`'s router is not tried again (its worker died every time):
    its row -> failed with `reason` and what the killed runs left removed, unless it is ready,
    or a tuning of it is running after all (it holds the lock: left to finish). None: no row."""
    record = TunedRouter.objects.filter(version_id=version_id).first()
    if record is None or record.state == TunedRouter.State.READY:
        return record
    with _tuning_lock(version_id) as held:
        if not held:
            return record
        # Read again under the lock: a run that held it may have finished the router meanwhile
        # (ready: left served), or its global been deleted, and the row with it (None).
        record = TunedRouter.objects.filter(pk=record.pk).select_related("version").first()
        if record is None or record.state == TunedRouter.State.READY:
            return record
        _remove_partials(record.version, None)
        log.warning("tuning the router of version %s given up: %s", version_id, reason)
        return _finish(record, TunedRouter.State.FAILED, reason)


def _remove_partials(version: CompendiumVersion, routers: Path | None) -> None:
    """Remove the unfinished folders of tunings of `version` (the caller holds its lock)."""
    for stale in (routers or routers_dir()).glob(f"{_folder_prefix(version)}*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def _served(version: CompendiumVersion) -> bool:
    """Whether `version` is the published global the routing API serves (the latest)."""
    latest = published_global_version()
    return latest is not None and latest.pk == version.pk


def _accuracy(router, pairs: list[tuple[str, str]]) -> float | None:
    if not pairs:
        return None
    decisions = router.route_batch([q for q, _ in pairs])
    return sum(d.tool == tool for d, (_, tool) in zip(decisions, pairs, strict=True)) / len(pairs)


def retire_older(current: TunedRouter) -> int:
    """Only the served global's tuned router is kept on disk: ready routers of other versions are
    retired and every other folder beside it (under routers_dir(), or the folder it was tuned
    into) is removed (those of versions deleted by a re-materialized round included, and the
    `.partial` folders of such versions, which a tuning killed mid-way left; a process still
    serving an older router keeps it in memory until it sees the new one). Returns the folders
    removed."""
    for other in TunedRouter.objects.filter(state=TunedRouter.State.READY).exclude(pk=current.pk):
        _finish(other, TunedRouter.State.RETIRED, f"replaced by the router of {current.version}")
    removed = 0
    keep = Path(current.directory)
    folders = [f for f in keep.parent.iterdir() if f.name != keep.name and f.is_dir()]
    # A `.partial` is one being tuned, unless its global no longer exists: what a tuning killed
    # mid-way left (an encoder half fine-tuned on the texts of a global an erasure deleted).
    partial = {f: _FOLDER_NAME.fullmatch(f.name) for f in folders if f.name.endswith(".partial")}
    existing = set(CompendiumVersion.objects.filter(
        pk__in={int(m.group(1)) for m in partial.values() if m}).values_list("pk", flat=True))
    for folder in folders:
        if folder in partial:
            match = partial[folder]
            if match is None or int(match.group(1)) in existing:
                continue  # one being tuned, or not this module's
        shutil.rmtree(folder, ignore_errors=True)
        removed += 1
    return removed


# --- the tuned router for clients to download ---------------------------------------------------


def _manifest_fields(version: CompendiumVersion, epochs: int) -> dict:
    return {"round": version.round.number, "global_sha256": version.sha256, "epochs": epochs}


def downloadable_router(
    version: CompendiumVersion, reveal: bool = True
) -> tuple[TunedRouter, dict]:
    """The ready tuned router of the published global `version` and its manifest (written now
    for a folder tuned before manifests existed), for clients to route exactly as the server
    does (`synapse-client pull --router`). Raises RouterUnavailable saying why there is none;
    why a tuning failed (an exception's text: a server path, a database error) only with
    `reveal` (the operator)."""
    from routing.finetune import read_manifest, write_manifest

    number = version.round.number
    record = TunedRouter.objects.filter(version=version).first()
    if record is None:
        if tune_epochs() < 1:
            raise RouterUnavailable(
                f"the global of round {number} has no tuned router: tuning is off on this server "
                "(SYNAPSE_ROUTER_TUNE_EPOCHS=0; an operator can run manage.py tune_router); "
                "route with the frozen model",
                "router_off",
            )
        raise RouterUnavailable(
            f"the global of round {number} has no tuned router yet; route with the frozen model",
            "router_tuning",
        )
    state = record.state
    if state in (TunedRouter.State.QUEUED, TunedRouter.State.RUNNING):
        raise RouterUnavailable(
            f"the router of round {number} is being tuned ({state}); route with the frozen model "
            "meanwhile and pull again later",
            "router_tuning",
        )
    if state == TunedRouter.State.FAILED:
        why = record.detail if reveal else TUNING_FAILED_FOR_THE_OPERATOR
        raise RouterUnavailable(
            f"tuning the router of round {number} failed ({why}); route with the frozen model",
            "router_failed",
        )
    folder = Path(record.directory) if record.directory else None
    if state != TunedRouter.State.READY or folder is None or not folder.is_dir():
        raise RouterUnavailable(
            f"the global of round {number} is no longer served with a tuned router ({state}); "
            "pull the latest global",
            "router_retired",
        )
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("global_sha256") != version.sha256:
        # Tuned before manifests: its vectors follow the served rows' order (a client whose copy
        # is in the published order embeds its rows again with the tuned model).
        compendium, _, _ = served_rows(version)
        try:
            manifest = write_manifest(folder, compendium, **_manifest_fields(version, record.epochs))
        except OSError:  # the folder was retired while this request read it
            raise RouterUnavailable(
                f"the tuned router of round {number} was retired while it was asked for; pull "
                "the latest global",
                "router_retired",
            ) from None
    return record, manifest


def router_manifest(version: CompendiumVersion, reveal: bool = True) -> tuple[str, dict]:
    """(ETag, body) of GET /api/v1/compendium/global/router/ for `version`: its manifest with
    when and how the router was tuned. The ETag changes with the global and the files.
    `reveal`: as for `downloadable_router`."""
    import hashlib
    import json

    record, manifest = downloadable_router(version, reveal)
    files = json.dumps(manifest.get("files", []), sort_keys=True).encode("utf-8")
    etag = f'"{version.sha256}-router-{hashlib.sha256(files).hexdigest()[:16]}"'
    body = {
        **manifest,
        "tuned_at": record.finished_at,
        "rows": record.rows,
        "device": record.device,
        "probe_accuracy": record.probe_accuracy,
        "frozen_probe_accuracy": record.frozen_probe_accuracy,
    }
    return etag, body


def router_file(
    version: CompendiumVersion, name: str, reveal: bool = True
) -> tuple[BinaryIO, dict]:
    """The file `name` of the global's downloadable tuned router, open for reading, with its
    manifest entry; only files the manifest lists, and their deltas (RouterUnavailable otherwise,
    as when there is no router, or when the router was retired while this request read it).
    `reveal`: as for `downloadable_router`."""
    record, manifest = downloadable_router(version, reveal)
    listed = list(manifest["files"]) + [f["delta"] for f in manifest["files"] if "delta" in f]
    entry = next((f for f in listed if f["path"] == name), None)
    if entry is None:
        raise RouterUnavailable(
            f"the tuned router of round {version.round.number} has no file {name!r}", "router_file"
        )
    path = Path(record.directory) / entry["path"]
    try:
        handle = path.open("rb")  # open before answering: the folder may be retired any time
    except OSError:
        raise RouterUnavailable(
            f"the tuned router of round {version.round.number} lost its file {name!r} (retired "
            "while it was asked for); pull the latest global",
            "router_retired",
        ) from None
    return handle, entry
