"""The simulation's in-memory rounds against the round pipeline: the same submissions, closed
through the real services (submission, the server's checks, eager Celery merge, publication),
publish the same global compendium that `Simulation.federate` computes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from django.core.management import call_command

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _entries(compendium) -> tuple[list, list]:
    return (sorted((s.tool_id, s.text) for s in compendium.scenarios),
            sorted((p.tool_id, p.text) for p in compendium.precautions))


def _released(compendium) -> list:
    return sorted((m.tool_id, tuple(sorted(m.stats or {}))) for m in compendium.metadata)


def test_the_simulation_publishes_what_the_round_pipeline_publishes(tiny_dataset, tmp_path):
    from compendium.canonical import canonical_bytes
    from compendium.client_api import nothing_to_submit
    from compendium.models import CompendiumVersion
    from compendium.registry import load_dataset
    from compendium.services import current_schema, load_compendium, seed_default_numeric_fields
    from federation import submissions
    from federation.models import Client, FederationSettings, Organization, Round
    from federation.pipeline import import_probe_set
    from federation.services import Actor, close_round, open_round
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    call_command("import_tools", str(tiny_dataset), verbosity=0)
    seed_default_numeric_fields()  # transactional tests flush what the migration seeded
    dataset = load_dataset(str(tiny_dataset))
    # ε = 16 over the 8 tools' 4 fields: ε_j = 1/2, so edges of 2 clients release every field
    # (the noise 1/(K·ε_j·√E) = 0.71 of each clipping window); at ε = 1 none would be. Three
    # rounds of it need a budget of 48.
    from federation.services import get_settings

    get_settings()
    FederationSettings.objects.update(epsilon_budget=100.0)
    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=3, baselines=False, diagnostics=False,
                              epsilon=16.0)
    sim = Simulation(dataset, current_schema(), get_engine(), config)
    setup = sim.prepare(1)
    outcomes = sim.federate(setup.shares, setup.logs, setup.split.probe, 1)

    # The same public probe set, organizations and clients in the database.
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "tools.jsonl").write_text("".join(
        json.dumps({"tool_id": t.tool_id, "description": t.description}) + "\n" for t in dataset.tools))
    (probe / "queries.jsonl").write_text("".join(
        json.dumps({"query": q.query, "tool_id": q.tool_id, "qid": q.qid}) + "\n"
        for q in setup.split.probe))
    import_probe_set(str(probe))
    clients = {}
    for share in setup.shares:
        org, _ = Organization.objects.get_or_create(slug=share.organization,
                                                    defaults={"name": share.organization})
        clients[share.client] = Client.objects.create(organization=org, name=share.client,
                                                      status=Client.Status.APPROVED)
    system = Actor(None, label="conformance")
    compared = released = 0
    for outcome in outcomes:
        rnd = open_round(system, sim._round_config(1))
        for client, sent in outcome.submissions.items():
            if nothing_to_submit(sent):
                continue
            submissions.submit(clients[client], canonical_bytes(sent), f"r{outcome.round}-{client}")
        close_round(system, rnd)
        rnd.refresh_from_db()
        assert rnd.state == Round.State.PUBLISHED, rnd.failure_reason
        published = load_compendium(CompendiumVersion.objects.get(kind="global", round=rnd))
        assert _entries(published) == _entries(outcome.global_compendium), outcome.round
        # The same statistics released for the same tools; their values differ by the noise
        # (the pipeline's seeds hold the server's secret).
        assert _released(published) == _released(outcome.global_compendium), outcome.round
        released += sum(len(fields) for _, fields in _released(published))
        compared += len(published.scenarios)
    assert compared > 0 and released > 0


def _synapse_rows(document) -> list:
    return sorted((r["seed"], r["round"], r["accuracy"], r["macro_accuracy"])
                  for r in document["results"] if r["method"] == "synapse")


def test_simulate_through_services_plays_the_rounds_in_a_scratch_database(tiny_dataset, tmp_path):
    """`simulate` (without `--in-memory`): the rounds go through the submission service, the close and
    the eager merge pipeline in a database of their own, publish what the in-memory rounds
    publish (the same accuracy round by round), and leave the operator's database with the
    stored run only."""
    from federation.models import Client, Organization, Round, SimulationRun

    common = ["--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2",
              "--rounds", "3", "--seed", "1", "--no-baselines", "--no-diagnostics"]
    memory, services = tmp_path / "memory.json", tmp_path / "services.json"
    call_command("simulate", *common, "--in-memory", "--out", str(memory), "--no-store",
                 verbosity=0)
    call_command("simulate", *common, "--out", str(services), "--label", "through services",
                 verbosity=0)  # the default
    in_memory, through = json.loads(memory.read_text()), json.loads(services.read_text())
    assert through["config"]["through_services"] and not in_memory["config"]["through_services"]
    assert len(_synapse_rows(through)) == 3
    # What the routing API serves for the final global, scored on the same test queries.
    [served] = [r for r in through["results"] if r["method"] == "synapse_served"]
    assert served["round"] == 3 and 0.5 < served["accuracy"] <= 1
    assert not [r for r in in_memory["results"] if r["method"] == "synapse_served"]
    assert _synapse_rows(through) == _synapse_rows(in_memory)
    for ours, theirs in zip(through["rounds"][0], in_memory["rounds"][0], strict=True):
        assert ours["global_scenarios"] == theirs["global_scenarios"] > 0
        assert ours["scenarios_submitted"] == theirs["scenarios_submitted"]
        # The pipeline's merge records, per organization (by slug) and the server's.
        assert set(ours["merge"]) == set(theirs["merge"]) and "server" in ours["merge"]
        assert "refused" not in ours["merge"]  # every dcz body decoded against a known dictionary
    assert through["screening"]["honest_submissions"] == in_memory["screening"]["honest_submissions"]
    # The scratch federation stayed in its database, which is gone.
    assert not Round.objects.exists() and not Client.objects.exists()
    assert not Organization.objects.exists()
    assert SimulationRun.objects.get(label="through services").document["config"]["through_services"]
    assert _scratch_databases() == 0


def test_adversaries_are_screened_alike_through_the_services(tiny_dataset):
    """Half the clients relabel their requests at random: the pipeline's edges drop the same
    submissions whole as the in-memory merges do, and the counts name the simulated clients."""
    from django.db import connection

    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.runner import Simulation, SimulationConfig
    from federation.simulation.through_services import scratch_database
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=2, baselines=False,
                              diagnostics=False, adversarial_fraction=0.5,
                              adversarial_mode="tool_confusion")
    schema = Schema(tools=dataset.tools)
    in_memory = Simulation(dataset, schema, get_engine(), config).run_seed(1).screening
    test_settings = dict(connection.settings_dict["TEST"])
    with scratch_database():
        through = Simulation(dataset, schema, get_engine(),
                             dataclasses.replace(config, through_services=True)).run_seed(1).screening
    assert connection.settings_dict["TEST"] == test_settings  # its own TEST name put back
    assert through == in_memory
    assert through["dropped_adversarial"] == through["adversarial_submissions"] == 4
    assert through["dropped_honest"] == 0


def test_the_llm_reaches_the_pipelines_merges_only_where_the_in_memory_merges_get_it(
        tiny_dataset):
    """`--llm` is the endpoint of the LLM summarizers and of the llm transfer reranker. The
    in-memory merges get it only with an LLM summarizer (`Simulation.summarizer_llm`); through
    the services the scratch database configured it for the pipeline, whose merges then asked it
    IsConsistent of every cluster whatever the summarizer: another compendium than in memory."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.merge.llm import CONSISTENCY_PROMPT
    from federation.simulation.runner import Simulation, SimulationConfig
    from federation.simulation.through_services import scratch_database
    from routing.embeddings import get_engine
    from tests.chat_server import ChatServer

    asks_consistency = CONSISTENCY_PROMPT.split("\n")[0]

    def consistency_questions(server) -> int:
        return sum(asks_consistency in json.dumps(r["body"]) for r in server.requests)

    dataset = load_dataset(str(tiny_dataset))
    schema = Schema(tools=dataset.tools)
    server = ChatServer(default="Inconsistent")
    try:
        for summarizer, asked in (("probe-extractive", False), ("llm-single-shot", True)):
            config = SimulationConfig(orgs=2, clients_per_org=2, rounds=2, baselines=False,
                                      diagnostics=False, summarizer=summarizer,
                                      llm_url=server.url, through_services=True)
            server.requests.clear()
            with scratch_database(llm_url=server.url):
                Simulation(dataset, schema, get_engine(), config).run_seed(1)
            assert (consistency_questions(server) > 0) == asked, summarizer
    finally:
        server.close()


def test_a_federation_through_the_services_never_empties_the_operators_database(tiny_dataset):
    from compendium.registry import load_dataset
    from federation.models import Organization
    from federation.simulation.through_services import NotInScratchDatabase, ServiceRounds

    Organization.objects.create(slug="kept", name="kept")
    with pytest.raises(NotInScratchDatabase, match="scratch_database"):
        ServiceRounds(load_dataset(str(tiny_dataset))).begin([], [], seed=0)
    assert Organization.objects.filter(slug="kept").exists()


def _scratch_databases() -> int:
    """This process's scratch databases (a simulation run beside the tests on the same server
    has its own, named after its process)."""
    import os

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname LIKE %s",
                       [f"%\\_simulate\\_{os.getpid()}"])
        return cursor.fetchone()[0]


def test_the_next_run_drops_the_scratch_databases_that_killed_runs_left_behind():
    """A run killed inside the scratch database (SIGKILL, SIGTERM, the machine's memory) never
    dropped it, and no later run did (each names its own after its process): they piled up on
    the server for good. The next run drops those of processes that are gone; a database of a
    process still running, one a session is connected to, or another name are left alone."""
    import subprocess
    import sys

    from django.db import connection

    from federation.simulation.through_services import scratch_database

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    original = connection.settings_dict["NAME"]
    killed = f"{original}_simulate_{int(gone.stdout)}"
    running = f"{original}_simulate_{os.getppid()}"  # a process that runs: this one's parent
    other = f"{original}_simulate_{int(gone.stdout)}_mine"
    quote = connection.ops.quote_name
    with connection._nodb_cursor() as cursor:
        for name in (killed, running, other):
            cursor.execute(f"CREATE DATABASE {quote(name)}")
    reported = []
    try:
        with scratch_database(dropped=reported.append):
            pass
        assert reported == [[killed]]
        assert _databases(killed, running, other) == {running, other}
        with scratch_database(dropped=reported.append):  # nothing left to drop: nothing said
            pass
        assert reported == [[killed]]
    finally:
        with connection._nodb_cursor() as cursor:
            for name in (killed, running, other):
                cursor.execute(f"DROP DATABASE IF EXISTS {quote(name)}")


def _databases(*names: str) -> set[str]:
    """Those of `names` that are databases on the server."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", [list(names)])
        return {name for (name,) in cursor.fetchall()}


def test_a_round_the_pipeline_fails_ends_the_run_with_its_reason_and_no_scratch_left(
        tiny_dataset, monkeypatch):
    from django.core.management import CommandError

    from federation import pipeline
    from federation.models import SimulationRun

    def broken(*args, **kwargs):
        raise RuntimeError("the server merge broke")

    monkeypatch.setattr(pipeline, "server_merge_operator", broken)
    with pytest.raises(CommandError, match=r"^seed 1: round 1 ended failed in the merge pipeline: "
                                           r".*the server merge broke"):
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2",
                     "--clients-per-org", "2", "--rounds", "2", "--seed", "1", "--no-baselines",
                     "--no-diagnostics", verbosity=0)
    assert not SimulationRun.objects.exists() and _scratch_databases() == 0


@pytest.mark.parametrize("flags", [
    ["--max-bytes", "1"],  # a budget no entry fits in: no client has anything to send
    ["--adversarial-fraction", "1"],  # every submission refused or dropped
])
def test_a_federation_that_published_nothing_has_no_served_row_instead_of_a_traceback(
        tiny_dataset, tmp_path, flags):
    """Through the services, a federation in which no round was published (nothing sent, every
    submission refused) ended the whole run in a traceback when the `synapse_served` row asked
    the routing service for the router it serves (NothingPublished), after every round and
    sweep was played. The routing API serves nothing then: no such row, as Local-only has none
    where no client holds a compendium."""
    out = tmp_path / "run.json"
    call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                 "2", "--rounds", "1", "--seed", "1", "--no-baselines", "--no-diagnostics",
                 *flags, "--out", str(out), "--no-store", verbosity=0)
    document = json.loads(out.read_text())
    assert {row["method"] for row in document["results"]} == {"synapse"}
    assert _scratch_databases() == 0


def test_without_the_right_to_create_databases_the_run_says_so_before_it_starts(
        tiny_dataset, monkeypatch, capsys):
    from django.core.management import CommandError

    from federation.simulation import through_services

    monkeypatch.setattr(through_services, "_may_create_databases", lambda connection: False)
    with pytest.raises(CommandError, match="may not create databases.*; pass --in-memory"):
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2",
                     "--clients-per-org", "2", "--rounds", "2", "--no-baselines", "--no-store",
                     verbosity=1)
    assert "round 1" not in capsys.readouterr().err


def test_a_database_out_of_reach_is_said_in_one_line_before_the_data_loads(monkeypatch):
    """Through the services with --no-store (the store's check skipped), a database out of reach
    was an OperationalError traceback once the dataset and the model had loaded; the store's
    check said it in two lines (psycopg's hint on a line of its own)."""
    from django.core.management import CommandError
    from django.db import OperationalError, connection

    from federation.simulation import through_services

    def unreachable(*args, **kwargs):
        raise OperationalError('connection failed: connection to server at "127.0.0.1", port 1 '
                               "failed: Connection refused\n\tIs the server running on that host?")

    monkeypatch.setattr(through_services, "_may_create_databases", unreachable)
    with pytest.raises(CommandError, match="^cannot reach the database to make the run's scratch "
                       "database [(]connection failed: .*Connection refused[)]; pass --in-memory") as error:
        call_command("simulate", "--dataset", "/no/such/dataset", "--no-store")
    assert "\n" not in str(error.value)
    monkeypatch.setattr(connection.introspection, "table_names", unreachable)
    with pytest.raises(CommandError, match="^cannot reach the database to store the run "
                       "[(]connection failed: .*Connection refused[)]; pass --no-store") as error:
        call_command("simulate", "--dataset", "/no/such/dataset", "--in-memory")
    assert "\n" not in str(error.value)


def test_with_tune_router_the_served_row_is_the_servers_tuned_router(tiny_dataset, settings,
                                                                      tmp_path, monkeypatch):
    """`--tune-router` through the services: the `synapse_served` row routes with the router the
    server's tuning service (`federation.tuning`, what a worker runs after a publication) tuned
    on the final global, in a folder of the run's own; the operator's tuned routers stay."""
    import tempfile

    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation import tuning
    from federation.simulation.runner import Simulation, SimulationConfig
    from federation.simulation.through_services import ServiceRounds, scratch_database
    from routing.embeddings import get_engine

    settings.DATA_DIR = str(tmp_path)
    operators = tmp_path / "routers" / "round-7-v3-0123456789ab"
    operators.mkdir(parents=True)
    tuned_into, served = [], []
    tune, serve = tuning.tune_published_router, ServiceRounds.served_router

    def tune_spy(version_id, epochs=None, **kwargs):
        record = tune(version_id, epochs, **kwargs)
        tuned_into.append((epochs, kwargs.get("routers"), record.state, record.directory))
        return record

    def serve_spy(self, reranker, tune_epochs=0):
        router = serve(self, reranker, tune_epochs)
        served.append(router.engine.model_name)
        return router

    monkeypatch.setattr(tuning, "tune_published_router", tune_spy)
    monkeypatch.setattr(ServiceRounds, "served_router", serve_spy)
    dataset = load_dataset(str(tiny_dataset))
    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=2, baselines=False,
                              diagnostics=False, through_services=True)
    with scratch_database():
        frozen = Simulation(dataset, Schema(tools=dataset.tools), get_engine(), config).run_seed(1)
        result = Simulation(dataset, Schema(tools=dataset.tools), get_engine(),
                            dataclasses.replace(config, tune_router_epochs=1)).run_seed(1)
    [(epochs, routers, state, directory)] = tuned_into  # once, on the final global
    assert epochs == 1 and state == "ready" and directory.startswith(str(routers))
    assert str(routers).startswith(tempfile.gettempdir()) and not routers.exists()  # removed after
    assert served[0] != served[1] and served[1] == directory  # the frozen model, then the tuned one
    assert operators.is_dir()  # the operator's routers are not the run's to retire
    [row] = [r for r in result.rows if r["method"] == "synapse_served"]
    [untuned] = [r for r in frozen.rows if r["method"] == "synapse_served"]
    assert row["round"] == untuned["round"] == 2 and 0 < row["accuracy"] <= 1
