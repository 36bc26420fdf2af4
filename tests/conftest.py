from __future__ import annotations

from pathlib import Path

import pytest

from compendium.schema import Schema, ToolSpec

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
METATOOL = SHARED_DATA / "metatool"


@pytest.fixture(autouse=True, scope="session")
def _latencies_flushed_by_the_tests():
    """The routing API's latency records are flushed by the tests that read them, inside their
    transactions: the background flush of a server process (its own connection) would commit
    them outside, for later tests to find. tests/test_observability.py runs the flush thread."""
    from routing import services

    services.recorder.background = False


@pytest.fixture(scope="session")
def small_schema() -> Schema:
    return Schema(
        tools=[
            ToolSpec(tool_id="weather", description="Weather forecasts for a city", category="Weather"),
            ToolSpec(tool_id="flights", description="Search and book flights", category="Travel"),
            ToolSpec(tool_id="calculator", description="Evaluate arithmetic", category="Math"),
        ]
    )


@pytest.fixture
def valid_doc() -> dict:
    return {
        "schema_version": "1.0",
        "metadata": [
            # No statistics: the rounds of the `world` fixture (two organizations of one approved
            # client each) release no numeric field (their noise would be 2.8 times or more each
            # field's clipping window), and the server refuses statistics for them.
            {"tool_id": "weather", "stats": {}},
            {"tool_id": "flights", "stats": {}},
        ],
        "scenarios": [
            {"tool_id": "weather", "text": "Will it rain tomorrow in a city?", "preconditions": {"has_city": True}},
            {"tool_id": "flights", "text": "Find a cheap flight between two airports"},
        ],
        "precautions": [{"tool_id": "calculator", "text": "Do not use for unit conversions of currency"}],
        "templates": [
            {"tool_id": "weather", "signature": "forecast(city, days)", "template": "Forecast for {city}"}
        ],
        "annex": [{"subject": "flights", "relation": "needs", "object": "airport code"}],
    }


# Fixture modules: the federation (two organizations with people of every role) and the small
# datasets of the simulation tests.
pytest_plugins = ("tests.federation_fixtures", "tests.simulation_fixtures")


@pytest.fixture
def without_merge_pipeline():
    """Closing a round normally starts the merge pipeline; state-machine tests look at the round
    as the signal leaves it, so they take the pipeline's receiver off for their duration."""
    from federation.signals import round_closed
    from workers.receivers import start_pipeline_on_close

    round_closed.disconnect(dispatch_uid="synapse.start_round_pipeline")
    yield
    round_closed.connect(start_pipeline_on_close, dispatch_uid="synapse.start_round_pipeline")


@pytest.fixture
def probes(tmp_path):
    """The public probe set of tests.merge_helpers imported; its number of queries."""
    from django.core.management import call_command

    from federation.models import ProbeQuery
    from tests.merge_helpers import write_probe_dataset

    call_command("import_probe_set", str(write_probe_dataset(tmp_path / "probe")))
    return ProbeQuery.objects.count()


@pytest.fixture
def every_field_released(db, monkeypatch):
    """Rounds release every declared numeric field: no noise counts as drowning a figure
    (`merge.drowned_fields` names none, whatever the clients and ε, and the global withholds
    none), as in a federation with enough clients per organization. The tests of the budget's
    mechanics reserve a round's whole ε; a test world of one client per organization leaves every
    field drowned at open (its noise is calibrated to each field's clipping window, so
    1/(K·ε_j·√E) ≥ 1 drowns all of them whatever their declared ranges), and a round would
    reserve nothing."""
    from federation.merge import operator

    monkeypatch.setattr(operator, "noise_dominated", lambda scale, spec: False)
