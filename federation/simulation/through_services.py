"""A simulated federation's rounds through the product's own services (what `simulate` does
unless `--in-memory`), in a scratch database that exists for the run.

Each federation (a seed, a sweep point) starts from an empty federation: the dataset's tools, the
seed's public probe set, one organization per simulated organization and one approved client per
simulated client. Each round the server opens the round with the simulation's round
configuration, the clients read from it which fields it will not release and build without
them, every client's compendium goes as the dcz body `synapse-client submit --since` sends
through the decoder and the submission service the REST API uses (the server's arrival checks
included: a refused submission is counted, never merged), the
operator's close runs the real merge pipeline (Celery tasks run eagerly, in this process, on the
scratch database), and the clients pull the published global compendium. Nothing of this touches
the operator's database: it is created before the run and dropped after it.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from compendium.client_api import nothing_to_submit
from compendium.registry import LabelledQuery, RoutingDataset
from compendium.schema import Compendium
from federation.round_config import RoundConfig
from federation.simulation.data import ClientShare

# The scratch federation's policy: no cap that the simulated rounds could reach (the simulation
# reports ε; the budget is the operator's own decision), and no rate limit on a client that
# submits once per round, many rounds a minute.
SCRATCH_SETTINGS = {"epsilon_budget": 1e9, "submissions_per_minute": 1_000_000}

_scratch: list[str] = []  # the scratch database in use (`scratch_database`)


class ScratchDatabaseUnavailable(RuntimeError):
    """The scratch database cannot be created; says why."""


def _may_create_databases(connection) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cursor.fetchone()
    return bool(row and row[0])


class SimulatedRoundFailed(RuntimeError):
    """A simulated round ended failed in the pipeline; says which and why."""


class NotInScratchDatabase(RuntimeError):
    """A federation through the services would empty the database it runs on: only a scratch
    database may be used."""


def _process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_leftover_scratch_databases(connection, original: str) -> list[str]:
    """Drop the scratch databases of `original` that runs killed before they could drop them
    left behind (`<original>_simulate_<pid>`; a run of this machine's that still runs, or any
    database a session is connected to, is left alone), and return their names. One that cannot
    be dropped (connected to since, another user's) is left too."""
    from django.db import DatabaseError

    pattern = re.compile(rf"{re.escape(original)}_simulate_(\d+)")
    with connection._nodb_cursor() as cursor:  # DROP DATABASE runs outside any transaction
        cursor.execute(
            "SELECT datname FROM pg_database d WHERE NOT EXISTS "
            "(SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname) ORDER BY datname"
        )
        names = [name for (name,) in cursor.fetchall()]
        dropped = []
        for name in names:
            match = pattern.fullmatch(name)
            if not match or int(match[1]) == os.getpid() or _process_alive(int(match[1])):
                continue
            try:  # refused while a session is connected: a run that has just created it
                cursor.execute(f"DROP DATABASE {connection.ops.quote_name(name)}")
            except DatabaseError:
                continue
            dropped.append(name)
    return dropped


def check_scratch_database() -> None:
    """Raise ScratchDatabaseUnavailable, saying why in one line, where `scratch_database` cannot
    make its database: the database is out of reach, or its user may not create databases."""
    from django.db import DatabaseError, connection

    try:
        allowed = _may_create_databases(connection)
    except DatabaseError as exc:  # psycopg's hint on a line of its own: the first line says it
        raise ScratchDatabaseUnavailable(
            "cannot reach the database to make the run's scratch database "
            f"({str(exc).strip().splitlines()[0]})"
        ) from None
    if not allowed:
        raise ScratchDatabaseUnavailable(
            f"the database user {connection.settings_dict.get('USER') or '(default)'} may not "
            "create databases, and rounds through the services run in a scratch database"
        )


@contextmanager
def scratch_database(*, embedding_model: str = "", llm_url: str | None = None,
                     llm_model: str = "",
                     dropped: Callable[[list[str]], None] | None = None) -> Iterator[None]:
    """Within the block, the default database is a new one, migrated, and Celery runs the merge
    pipeline's tasks in this process (on that database) with the simulation's embedding model
    (its engine's `model_name`: the pipeline's engine is then the very same) and LLM endpoint;
    after it, the database is dropped and everything is as it was. A run killed inside the block
    leaves its database behind: the next one drops it first
    (`drop_leftover_scratch_databases`), and tells `dropped` which it dropped."""
    from django.db import connection
    from django.test.utils import override_settings

    from synapse_web.celery import app

    check_scratch_database()
    original = connection.settings_dict["NAME"]
    leftovers = drop_leftover_scratch_databases(connection, original)
    if leftovers and dropped is not None:
        dropped(leftovers)
    with ExitStack() as undo:  # everything below is put back on the way out
        # create_test_db makes the database under TEST's NAME and points the connection at it;
        # a name of this process's own, never the test suite's test_<name>, which autoclobber
        # would drop. (Django fills every connection's TEST settings, so there is one to put back.)
        test = connection.settings_dict["TEST"]
        connection.settings_dict["TEST"] = {**test, "NAME": f"{original}_simulate_{os.getpid()}"}
        undo.callback(connection.settings_dict.__setitem__, "TEST", test)
        eager = {key: app.conf[key] for key in ("task_always_eager", "task_eager_propagates")}
        app.conf.update(task_always_eager=True, task_eager_propagates=True)
        undo.callback(app.conf.update, eager)
        _scratch.append(connection.creation.create_test_db(
            verbosity=0, autoclobber=True, serialize=False
        ))
        undo.callback(connection.creation.destroy_test_db, original, verbosity=0)
        undo.callback(_scratch.pop)
        undo.enter_context(override_settings(
            SYNAPSE_EMBEDDING_MODEL=embedding_model,
            SYNAPSE_LLM_BASE_URL=llm_url or "",
            SYNAPSE_LLM_MODEL=llm_model,
            SYNAPSE_ROUTER_TUNE_EPOCHS=0,  # the simulation tunes its own routers (--tune-router)
        ))
        yield


class ServiceRounds:
    """Closes a simulated federation's rounds through the services (see the module). Used inside
    `scratch_database`: `begin` empties the database for a new federation."""

    def __init__(self, dataset: RoutingDataset, llm_url: str | None = None):
        self.dataset = dataset
        # The merges' LLM (summarizer and IsConsistent probe), as the in-memory merges get it
        # (`Simulation.summarizer_llm`): the run's --llm only with an LLM summarizer. The
        # scratch database configures --llm for the whole run, whose other federations (a
        # summarizer sweep's non-LLM variants, a run for the llm transfer reranker) merge
        # without it.
        self.llm_url = llm_url or ""
        self.clients: dict[str, Any] = {}  # simulated client -> Client
        self.seed = 0
        self.round = None  # the open Round

    def begin(self, shares: Sequence[ClientShare], probe: Sequence[LabelledQuery], seed: int) -> None:
        from django.core.management import call_command
        from django.db import connection

        from compendium.services import import_registry, seed_default_numeric_fields
        from federation import services, submissions
        from federation.pipeline import store_probe_queries

        if not _scratch or connection.settings_dict["NAME"] != _scratch[-1]:
            raise NotInScratchDatabase(
                f"refusing to empty {connection.settings_dict['NAME']!r} for a simulated "
                "federation: run it inside through_services.scratch_database()"
            )
        call_command("flush", interactive=False, verbosity=0)
        services.clear_settings_cache()
        submissions.clear_dictionary_cache()
        seed_default_numeric_fields()  # what the migration seeded, gone with the flush
        system = services.Actor.system("simulate")
        services.update_settings(system, **SCRATCH_SETTINGS)
        import_registry(self.dataset.tools)
        store_probe_queries(self.dataset.name, probe)
        organizations = {}
        self.clients = {}
        self.round = None
        for share in shares:
            if share.organization not in organizations:
                organizations[share.organization] = services.create_organization(
                    system, share.organization, slug=share.organization
                )
            client = services.enroll_client(system, organizations[share.organization], share.client)
            services.approve_client(system, client)
            client.refresh_from_db()
            self.clients[share.client] = client
        self.seed = seed

    def open(self, config: RoundConfig) -> frozenset[str]:
        """The operator opens a round with `config` (unless one is open still: a round to which
        nobody had anything to send stays open); what the clients read of it before they build:
        the numeric fields it will not release, which they leave out."""
        from federation.services import Actor, open_round

        if self.round is None:
            self.round = open_round(Actor.system("simulate"), config)
        return frozenset(self.round.fields_not_released)

    def close(self, round_: int, sent: dict[str, Compendium],
              wires: dict[str, bytes]) -> tuple[Compendium | None, dict[str, Any]]:
        """The open round (`open`): submit what each client sends as it travels (`wires`: the dcz
        body `synapse-client submit --since` sends, which the server decodes against a
        dictionary it holds, as the REST API does), close it, and return the published global
        compendium with the merges' statistics per organization ("server": the server merge's;
        "refused": per client, why the server refused its submission). None when nothing
        reached a merge (no round is published then)."""
        from django.test.utils import override_settings

        from compendium import transport
        from compendium.models import CompendiumVersion
        from compendium.services import load_compendium
        from federation import submissions
        from federation.errors import FederationError
        from federation.models import MergeRecord, Round
        from federation.services import Actor, close_round

        if all(nothing_to_submit(c) for c in sent.values()):
            return None, {}  # no client has anything new: the round stays open
        system = Actor.system("simulate")
        rnd, self.round = self.round, None
        refused: dict[str, str] = {}
        accepted = 0
        for name, compendium in sent.items():
            if nothing_to_submit(compendium):
                continue  # as `synapse-client participate`: nothing new, nothing sent
            wire = wires[name]
            try:
                submissions.submit(self.clients[name], wire, f"simulate-{self.seed}-{round_}-{name}",
                                   content_encoding=transport.CONTENT_ENCODING)
                accepted += 1
            except FederationError as exc:
                refused[name] = str(exc)
        with override_settings(SYNAPSE_LLM_BASE_URL=self.llm_url):  # the eager merge pipeline
            close_round(system, rnd)
        rnd.refresh_from_db()
        if not accepted:  # the server refused every submission: the round failed, unpublished
            return None, {"refused": refused}
        if rnd.state != Round.State.PUBLISHED:
            raise SimulatedRoundFailed(
                f"seed {self.seed}: round {round_} ended {rnd.state} in the merge pipeline: "
                f"{rnd.failure_reason or 'no reason recorded'}"
            )
        names = {f"client:{client.pk}": name for name, client in self.clients.items()}
        stats: dict[str, Any] = {}
        for record in MergeRecord.objects.filter(round=rnd).select_related("organization"):
            key = record.organization.slug if record.organization else "server"
            stats[key] = _named(record.stats, names)
        if refused:
            stats["refused"] = refused
        published = load_compendium(CompendiumVersion.objects.get(kind="global", round=rnd))
        return published, stats


    def served_router(self, reranker: str, tune_epochs: int = 0):
        """The router the routing API serves for the last published global, built as the
        product builds it (`routing.services.served_compendium`); None where no round was
        published (nothing sent, every submission refused): the API serves nothing. With
        `tune_epochs`, once the server has tuned its routing encoder on that global as a worker
        does after a publication (`federation.tuning.tune_published_router`, into a folder of
        the run's own that is removed after: the router is in memory by then)."""
        from federation.tuning import tune_published_router
        from routing import services as routing
        from routing.models import TunedRouter

        routing.forget_published_version()  # the last federation's version is not this one's
        if routing.published_global_version() is None:
            return None
        if not tune_epochs:
            return routing.served_compendium().routers[reranker]
        with tempfile.TemporaryDirectory(prefix="synapse-served-router-") as folder:
            version = routing.published_global_version()
            record = (tune_published_router(version.pk, tune_epochs, routers=Path(folder))
                      if version is not None else None)
            if record is None or record.state != TunedRouter.State.READY:
                why = record.detail if record is not None else "no global is published"
                raise SimulatedRoundFailed(
                    f"seed {self.seed}: the server could not tune its router on the final "
                    f"global: {why}"
                )
            routing.forget_published_version()  # now with its tuned router
            served = routing.served_compendium()
            if not served.tuned:
                raise SimulatedRoundFailed(f"seed {self.seed}: the tuned router is not served")
            return served.routers[reranker]


def _named(stats: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An edge's statistics with its sources named as the simulation names its clients."""
    out = dict(stats)
    if "dropped_sources" in out:
        out["dropped_sources"] = [names.get(s, s) for s in out["dropped_sources"]]
    if "robust_sources" in out:
        out["robust_sources"] = {names.get(s, s): n for s, n in out["robust_sources"].items()}
    return out
