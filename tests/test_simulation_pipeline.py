"""The simulation's in-memory rounds against the round pipeline: the same submissions, closed
through the real services (submission, the server's checks, eager Celery merge, publication),
publish the same global compendium that `Simulation.federate` computes."""

from __future__ import annotations

import json

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
    from compendium.models import CompendiumVersion, NumericField
    from compendium.registry import load_dataset
    from compendium.schema import DEFAULT_NUMERIC_FIELDS
    from compendium.services import current_schema, load_compendium
    from federation import submissions
    from federation.models import Client, Organization, Round
    from federation.pipeline import import_probe_set
    from federation.services import Actor, close_round, open_round
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    call_command("import_tools", str(tiny_dataset), verbosity=0)
    for spec in DEFAULT_NUMERIC_FIELDS:  # transactional tests flush what the migration seeded
        NumericField.objects.get_or_create(
            name=spec.name,
            defaults=dict(kind=spec.kind.value, min_value=spec.min, max_value=spec.max,
                          sensitivity=spec.sensitivity, unit=spec.unit, description=spec.description),
        )
    dataset = load_dataset(str(tiny_dataset))
    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=3, baselines=False, diagnostics=False)
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
