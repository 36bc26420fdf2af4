"""The round pipeline on the real database (Celery eager in-process; the real-worker run is in
test_merge_worker.py)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from django.core.management import call_command

from compendium.models import CompendiumVersion, ScenarioEntry
from compendium.schema import Compendium, Scenario
from compendium.services import load_compendium
from federation import accounting, pipeline
from federation.merge import drowned_fields
from federation.models import (
    AuditLog,
    Client,
    ConflictLogEntry,
    MergeRecord,
    PrivacyLedgerEntry,
    Round,
)
from routing.router import LinearHead
from tests.merge_helpers import RELEASING_CONFIG, build_federation, plant_weather_conflict
from tests.merge_helpers import close_round as close

pytestmark = pytest.mark.django_db




def test_full_round_publishes_global_with_embeddings_ledger_and_accuracy(
    probes, django_capture_on_commit_callbacks
):
    round_, _ = build_federation(config=RELEASING_CONFIG)
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    assert probes == 6
    edges = CompendiumVersion.objects.filter(kind="edge", round=round_)
    assert edges.count() == 2
    acme = edges.get(organization__slug="acme")
    assert acme.sources.count() == 2
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.all()) == set(edges)
    assert ScenarioEntry.objects.filter(version=glob, embedding__isnull=True).count() == 0
    assert ScenarioEntry.objects.filter(version=glob).count() == glob.entry_counts["scenarios"]
    # The routing head is fitted on the published scenarios, one row per tool that has some.
    head = LinearHead.from_bytes(glob.routing_head)
    assert head.tools == sorted({s["tool_id"] for s in glob.content["scenarios"]})
    assert head.weights.shape[0] == len(head.tools) >= 2
    # ... and on the public probe set: refitted on the same rows without it, the head gives the
    # probe requests' own tools less probability.
    rows = list(ScenarioEntry.objects.filter(version=glob).select_related("tool").order_by("id"))
    published = Compendium(
        scenarios=[Scenario(tool_id=r.tool.tool_id, text=r.text) for r in rows],
        metadata=load_compendium(glob).metadata,
    )
    vectors = np.array([r.embedding for r in rows], dtype=np.float32)
    probe = pipeline.load_probe_set()
    blind = LinearHead.from_bytes(pipeline.routing_head(published, vectors, pipeline._embed()))
    taught = LinearHead.from_bytes(pipeline.routing_head(published, vectors, pipeline._embed(), probe))
    assert np.allclose(taught.weights, head.weights, atol=1e-4)
    assert set(probe.labels) <= set(head.tools)
    # It carries the fusion weights and calibration fitted with it on the probe; without a
    # probe there is nothing to fit them on.
    assert head.params is not None and head.params.fitted_on == "the public probe set, at publication"
    assert head.params.weights.head != 0.0
    assert blind.params is None

    def own_log_proba(h):
        own = [h.tools.index(label) for label in probe.labels]
        return np.mean(h.log_proba(probe.vectors)[np.arange(len(probe)), own])

    assert own_log_proba(taught) > own_log_proba(blind) + 0.05
    # each edge releases every registry tool x declared field (what clients reported or not:
    # the released set must not reveal which tools were used), over all its K submissions, but
    # for the fields no release of the round could make useful: with at most 2 clients an edge
    # and 2 edges at ε_j = 1/2, 1/(K·ε_j·√E) = 1/√2 < 1, so none (the ratio of the noise to a
    # field's clipping window is the same for every field: all are drowned or none)
    ledger = PrivacyLedgerEntry.objects.filter(round=round_)
    schema = pipeline.current_schema()
    keys = sorted((t.tool_id, f.name) for t in schema.tools for f in schema.numeric_fields)
    drowned = drowned_fields(schema, pipeline._config(round_), 2, 2)
    assert drowned == frozenset()
    assert drowned_fields(schema, pipeline._config(round_).model_copy(update={"epsilon": 1.0}),
                          2, 2) == {f.name for f in schema.numeric_fields}
    assert sorted((e.organization.slug, e.tool_id, e.field) for e in ledger) == [
        (org, *key) for org in ("acme", "globex") for key in keys if key[1] not in drowned
    ]
    assert MergeRecord.objects.get(round=round_, organization__slug="acme").stats[
        "fields_not_released"] == sorted(drowned)
    acme_calls = ledger.get(organization__slug="acme", tool_id="weather", field="calls")
    assert acme_calls.contributors == 2 and acme_calls.epsilon == pytest.approx(0.5)
    assert acme_calls.noise_scale == pytest.approx(50 / (2 * 0.5))
    # The server averages the edges' releases (weighted by users) and publishes the average
    # without the digits below its own noise, as each edge does: the scale of Σ w_i·x_i / W is
    # √(Σ (w_i·b_i)²) / W, kept to a hundredth of its order of magnitude.
    def calls(version):
        return {m["tool_id"]: m["stats"] for m in version.content["metadata"]}["weather"]["calls"]

    users = {e.organization.slug: e.content["num_users"] for e in edges}
    total = sum(users.values())
    average = sum(calls(e) * users[e.organization.slug] for e in edges) / total
    scale = math.sqrt(sum(
        (users[e.organization.slug] * ledger.get(organization=e.organization, tool_id="weather",
                                                 field="calls").noise_scale) ** 2
        for e in edges)) / total
    step = 10.0 ** (math.floor(math.log10(scale)) - 2)
    published = calls(glob)
    spec = schema.fields_by_name["calls"]
    assert abs(published - min(spec.max, max(spec.min, average))) <= step / 2 + 1e-9
    assert published == pytest.approx(round(published / step) * step)
    record = MergeRecord.objects.get(round=round_, organization__isnull=True)
    assert record.probe_queries == 6 and 0.0 <= record.accuracy <= 1.0
    assert record.stats["scenarios_in"] > 0
    # acme's two near-identical weather requests are one cluster, summarized by the round's
    # summarizer; the record keeps what wrote each summary (the organization page shows it).
    acme_record = MergeRecord.objects.get(round=round_, organization__slug="acme")
    assert acme_record.stats["summaries"] == {"centroid": 1}
    assert acme_record.stats["summarizer_fallbacks"] == []
    report = accounting.privacy_report()
    # max over the two edges, one round: every field released, the round's ε
    assert report.federation.epsilon == pytest.approx(4.0)


def test_an_edge_neither_counts_charges_nor_releases_a_field_of_kind_other():
    """A declared field of kind `other` (no client derives it from a usage log) took a share of
    ε at every edge (ε_j = ε/(2·F*·5) for the four fields released, 0.4 instead of 0.5), a ledger
    row per tool, and a release of whatever a client sent for it. Declared now, the edge's ledger
    is the four fields' at ε_j = 1/2, the round costs its ε, the reservation before any release
    was the same, and a stored submission carrying a value for it (a client that is not the
    toolkit) has it left out of the edge's release."""
    from compendium.models import NumericField
    from compendium.services import store_compendium
    from federation.models import Organization

    NumericField.objects.create(name="error_budget", kind="other", min_value=0, max_value=1,
                                sensitivity=1)
    round_, _ = build_federation(config=RELEASING_CONFIG, state="merging")
    assert accounting.releasable_numeric_fields() == {
        "calls", "frequency", "latency_ms", "success_rate"}
    assert accounting.commitments().reserved == {round_.pk: pytest.approx(4.0)}
    acme = Organization.objects.get(slug="acme")
    other = Client.objects.create(organization=acme, name="a3", status="approved")
    store_compendium(Compendium.model_validate({
        "metadata": [{"tool_id": "weather", "stats": {"error_budget": 0.9, "calls": 5}}],
        "scenarios": [{"tool_id": "weather", "text": "Is it windy in Lyon?"}]}),
        kind="client", round=round_, client=other)
    pipeline.run_edge_merge(round_.pk, acme.pk)
    ledger = PrivacyLedgerEntry.objects.filter(round=round_)
    assert ledger.count() == 3 * 4 and not ledger.filter(field="error_budget").exists()
    assert [e.epsilon for e in ledger] == pytest.approx([0.5] * 12)
    assert accounting.privacy_report().federation.epsilon == pytest.approx(4.0)
    edge = CompendiumVersion.objects.get(kind="edge", round=round_)
    assert all("error_budget" not in m["stats"] for m in edge.content["metadata"])


def test_the_stored_edge_record_says_how_many_groups_krum_judged_past_its_premise():
    """An edge of four clients merged under Krum at an f share of 0.25 (f = 1, n = 4 < 2f + 3):
    the merge record the dashboard reads carries the groups Krum judged without its guarantee."""
    from compendium.services import import_registry, seed_default_numeric_fields, store_compendium
    from federation.models import Organization
    from tests.merge_helpers import TOOLS

    import_registry(TOOLS)
    seed_default_numeric_fields()
    round_ = Round.objects.create(number=1, state="merging", config={
        "summarizer": "centroid", "seed": 11, "robust_rule": "krum", "trim_fraction": 0.25})
    org = Organization.objects.create(slug="acme", name="acme")
    texts = [("What is 17 multiplied by 23?", "Will it rain tomorrow in Paris?"),
             ("Compute 144 divided by 12", "What is the temperature in Berlin today?"),
             ("Add 45 and 38", "Is it going to snow in Oslo tonight?"),
             ("What is 9 times 81?", "Weather forecast for Rome this weekend")]
    for i, (calculation, forecast) in enumerate(texts):
        client = Client.objects.create(organization=org, name=f"c{i}", status="approved")
        store_compendium(Compendium.model_validate({"scenarios": [
            {"tool_id": "calculator", "text": calculation}, {"tool_id": "weather", "text": forecast}]}),
            kind="client", round=round_, client=client)
    pipeline.run_edge_merge(round_.pk, org.pk)
    stats = MergeRecord.objects.get(round=round_, organization=org).stats
    assert stats["robust_dropped"] == 2
    assert stats["krum_below_premise"] == 2
    assert stats["krum_below_premise_sizes"] == [{"n": 4, "f": 1, "groups": 2}]


@pytest.mark.usefixtures("every_field_released")
def test_edge_merge_is_idempotent(probes):
    round_, clients = build_federation(state="merging")
    org = clients[("acme", "a1")].organization
    first = pipeline.run_edge_merge(round_.pk, org.pk)
    second = pipeline.run_edge_merge(round_.pk, org.pk)
    assert first.sha256 == second.sha256
    assert CompendiumVersion.objects.filter(kind="edge", round=round_).count() == 1
    schema = pipeline.current_schema()
    assert PrivacyLedgerEntry.objects.filter(round=round_).count() == len(schema.tools) * len(
        schema.numeric_fields)


@pytest.mark.usefixtures("every_field_released")
def test_a_retry_over_changed_inputs_is_a_new_release_with_fresh_noise(probes):
    """The same noise over other inputs would give away the difference (three clients' average
    and two clients' average under one draw yield the third client's value): an edge merge run
    again after a client was revoked makes a new release, with another seed and its own ε; run
    again over the same inputs, it replays its release."""
    from federation.models import Client

    round_, clients = build_federation(state="merging")
    org = clients[("acme", "a1")].organization
    pipeline.run_edge_merge(round_.pk, org.pk)
    pipeline.run_edge_merge(round_.pk, org.pk)  # a replay: the same release
    releases = PrivacyLedgerEntry.objects.filter(round=round_, organization=org)
    assert sorted(set(releases.values_list("release", flat=True))) == [0]
    Client.objects.filter(pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED)
    pipeline.run_edge_merge(round_.pk, org.pk)
    assert sorted(set(releases.values_list("release", flat=True))) == [0, 1]
    record = MergeRecord.objects.get(round=round_, organization=org)
    assert record.stats["release"] == 1 and record.stats["inputs"] == [
        CompendiumVersion.objects.get(kind="client", round=round_, client=clients[("acme", "a1")]).pk
    ]
    pipeline.run_edge_merge(round_.pk, org.pk)  # again over those inputs: release 1 replayed
    assert sorted(set(releases.values_list("release", flat=True))) == [0, 1]
    # The same inputs under another schema (a numeric field removed): the same seed would draw
    # the same noise for other statistics, in another order; a new release, fresh noise.
    from compendium.models import NumericField

    NumericField.objects.filter(name="latency_ms").delete()
    pipeline.run_edge_merge(round_.pk, org.pk)
    assert sorted(set(releases.values_list("release", flat=True))) == [0, 1, 2]
    pipeline.run_edge_merge(round_.pk, org.pk)  # and replayed as such
    assert sorted(set(releases.values_list("release", flat=True))) == [0, 1, 2]


@pytest.mark.usefixtures("every_field_released")
def test_a_retry_after_an_organizations_clients_were_all_revoked_publishes_nothing_of_theirs(
    probes
):
    """The first run merged both edges, then the round failed; every client of globex was then
    revoked (thought malicious) and the round retried: globex's edge of the first run is
    removed, not published by the retry's server merge."""
    from federation import services
    from tests.federation_fixtures import SYSTEM

    round_, clients = build_federation()
    for organization in pipeline.start_round(round_.pk, 1):
        pipeline.run_edge_merge(round_.pk, organization, attempt=1)
    globex = clients[("globex", "g1")].organization
    assert CompendiumVersion.objects.filter(kind="edge", round=round_, organization=globex).exists()
    services.mark_failed(round_, "the server merge failed")
    Client.objects.filter(organization=globex).update(status=Client.Status.REVOKED)
    services.retry_round(SYSTEM, round_)
    organizations = pipeline.start_round(round_.pk, 2)
    assert organizations == [clients[("acme", "a1")].organization_id]
    assert not CompendiumVersion.objects.filter(kind="edge", round=round_, organization=globex).exists()
    assert not MergeRecord.objects.filter(round=round_, organization=globex).exists()
    for organization in organizations:
        pipeline.run_edge_merge(round_.pk, organization, attempt=2)
    pipeline.run_server_merge(round_.pk, attempt=2)
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert {v.organization_id for v in glob.sources.all()} == set(organizations)
    assert PrivacyLedgerEntry.objects.filter(round=round_, organization=globex).exists()  # spent


def test_tasks_of_an_earlier_pipeline_run_change_nothing(probes):
    """The operator fails a round whose merge hangs and retries it: the first run's tasks, still
    running or delivered late, neither write edges or a global nor fail the retry."""
    from federation import services
    from tests.federation_fixtures import SYSTEM
    from workers import tasks

    round_, clients = build_federation()
    org = clients[("acme", "a1")].organization
    assert round_.attempt == 1
    assert pipeline.start_round(round_.pk, 1)
    services.mark_failed(round_, "the merge hangs")
    services.retry_round(SYSTEM, round_)
    round_.refresh_from_db()
    assert (round_.state, round_.attempt) == ("closing", 2)

    late = tasks.edge_merge_task(round_.pk, org.pk, 1)
    assert "run 1" in late["stale"] and "run 2" in late["stale"]
    assert tasks.start_round_pipeline(round_.pk, 1)["stale"]
    pipeline.fail_round(round_.pk, "edge merge of organization 1 failed: worker lost", 1)
    round_.refresh_from_db()
    assert round_.state == "closing" and round_.failure_reason == ""
    assert not CompendiumVersion.objects.filter(kind="edge", round=round_).exists()
    assert not PrivacyLedgerEntry.objects.filter(round=round_).exists()

    organizations = pipeline.start_round(round_.pk, 2)
    for organization in organizations:
        assert "sha256" in tasks.edge_merge_task(round_.pk, organization, 2)
    assert tasks.server_merge_task(round_.pk, 1) is None  # the first run's server merge
    round_.refresh_from_db()
    assert round_.state == "merging" and not CompendiumVersion.objects.filter(
        kind="global", round=round_).exists()
    sha = tasks.server_merge_task(round_.pk, 2)
    round_.refresh_from_db()
    assert round_.state == "published"
    assert CompendiumVersion.objects.get(kind="global", round=round_).sha256 == sha


def test_tasks_of_an_earlier_pipeline_run_stop_before_merging(probes, monkeypatch):
    """Found by review: a late task of a run the operator failed and retried computed its whole
    merge (the probe set embedded, the LLM's summaries asked) before the check under the lock
    refused to write it."""
    from federation import services
    from tests.federation_fixtures import SYSTEM
    from workers import tasks

    round_, clients = build_federation()
    org = clients[("acme", "a1")].organization
    assert pipeline.start_round(round_.pk, 1)
    services.mark_failed(round_, "the merge hangs")
    services.retry_round(SYSTEM, round_)

    def no_merge_work(*args, **kwargs):
        raise AssertionError("a stale task started merging")

    monkeypatch.setattr(pipeline, "load_probe_set", no_merge_work)
    assert "run 1" in tasks.edge_merge_task(round_.pk, org.pk, 1)["stale"]
    assert tasks.server_merge_task(round_.pk, 1) is None
    services.mark_failed(Round.objects.get(pk=round_.pk), "failed again")
    assert "failed" in tasks.edge_merge_task(round_.pk, org.pk, 2)["stale"]  # the round is over


def test_a_start_of_a_round_that_is_over_changes_nothing_and_raises_nothing(monkeypatch):
    """Found by audit: the start of a run whose round the operator failed before it ran (Fail on a
    closing round), or published by a chord its first delivery dispatched before its worker died,
    raised PipelineError ("round 1 is failed, not closing"): a traceback in the worker and a task
    in FAILURE, where the edge and server merges of such a run answer `stale`."""
    from federation import services
    from workers import tasks

    round_, _ = build_federation()
    services.mark_failed(round_, "the operator failed it")
    answer = tasks.start_round_pipeline(round_.pk, 1)
    assert "failed" in answer["stale"] and answer["organizations"] == []
    round_.refresh_from_db()
    assert (round_.state, round_.failure_reason) == ("failed", "the operator failed it")

    published, _ = build_federation(round_number=2)
    dispatched = tasks.start_round_pipeline(published.pk, 1)  # eager: the chord publishes it
    published.refresh_from_db()
    assert published.state == "published" and dispatched["organizations"]
    merges = []
    monkeypatch.setattr(pipeline, "run_edge_merge", lambda *a, **k: merges.append(a))
    assert "published" in tasks.start_round_pipeline(published.pk, 1)["stale"]
    published.refresh_from_db()
    assert published.state == "published" and merges == []
    with pytest.raises(pipeline.PipelineError, match="not closing"):  # a direct call: refused
        pipeline.start_round(published.pk)


def test_merges_that_cannot_be_dispatched_fail_the_round(probes, monkeypatch):
    """The round is merging once started; if its merges cannot be queued (the broker down),
    nothing would ever run them: the round fails with the reason instead of staying merging."""
    from workers import tasks

    round_, _ = build_federation()

    def broker_down(*args, **kwargs):
        raise ConnectionError("the broker is down")

    monkeypatch.setattr(tasks, "chord", broker_down)
    with pytest.raises(ConnectionError):
        tasks.start_round_pipeline(round_.pk)
    round_.refresh_from_db()
    assert round_.state == "failed"
    assert round_.failure_reason == "dispatching the merges failed: the broker is down"


def test_a_close_whose_pipeline_cannot_be_queued_fails_the_round_for_a_retry(
    probes, monkeypatch, django_capture_on_commit_callbacks
):
    """The broker down when the round closes: its start task is never queued, so nothing would
    ever move the round on from closing (which no retry accepts). It fails saying why, and the
    operator's retry, once the broker is back, publishes it."""
    from federation import services
    from tests.federation_fixtures import SYSTEM
    from workers import tasks

    round_, _ = build_federation(state="open")

    def broker_down(*args, **kwargs):
        raise ConnectionError("the broker is down")

    with monkeypatch.context() as patch:  # with a broker (not eager), which is down
        patch.setitem(tasks.start_round_pipeline.app.conf, "task_always_eager", False)
        patch.setattr(tasks.start_round_pipeline, "delay", broker_down)
        with django_capture_on_commit_callbacks(execute=True):
            services.close_round(SYSTEM, round_)  # the close itself commits
    round_.refresh_from_db()
    assert round_.state == "failed"
    assert round_.failure_reason == (
        "the merge pipeline could not be queued (the broker, CELERY_BROKER_URL, or the result "
        "backend did not answer): the broker is down; retry the round once they answer")
    with django_capture_on_commit_callbacks(execute=True):  # the broker back (eager here)
        services.retry_round(SYSTEM, round_)
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason


def test_a_close_queued_while_redis_is_down_says_so_in_one_line_without_a_false_restart(
    monkeypatch, django_capture_on_commit_callbacks
):
    """Found by review: a web process that had not reached Redis yet (a fresh gunicorn worker)
    waits about 20 s for the result backend and gets Celery's RuntimeError over three lines,
    ending "The Celery application must be restarted.": stored as the round's failure reason,
    it told the operator to restart what needs no restart (measured: the same process queues the
    next task as soon as Redis answers again)."""
    from federation import services
    from tests.federation_fixtures import SYSTEM
    from workers import tasks

    round_, _ = build_federation(state="open")

    def backend_down(*args, **kwargs):
        raise RuntimeError("\nRetry limit exceeded while trying to reconnect to the Celery result "
                           "store\nbackend. The Celery application must be restarted.\n")

    with monkeypatch.context() as patch:
        patch.setitem(tasks.start_round_pipeline.app.conf, "task_always_eager", False)
        patch.setattr(tasks.start_round_pipeline, "delay", backend_down)
        with django_capture_on_commit_callbacks(execute=True):
            services.close_round(SYSTEM, round_)
    round_.refresh_from_db()
    assert round_.state == "failed"
    assert round_.failure_reason == (
        "the merge pipeline could not be queued (the broker, CELERY_BROKER_URL, or the result "
        "backend did not answer): Retry limit exceeded while trying to reconnect to the Celery "
        "result store backend.; retry the round once they answer")


def test_budget_cap_fails_round_before_any_merge(settings, django_capture_on_commit_callbacks):
    settings.SYNAPSE_EPSILON_BUDGET = 0.5
    round_, _ = build_federation(config={"epsilon": 1.0, "summarizer": "none"})
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "failed"
    assert "epsilon budget of 0.5" in round_.failure_reason
    assert not CompendiumVersion.objects.filter(round=round_).exclude(kind="client").exists()
    assert not PrivacyLedgerEntry.objects.exists()


@pytest.mark.usefixtures("every_field_released")
def test_merged_round_is_counted_once_ledger_not_reservation(
    settings, django_capture_on_commit_callbacks
):
    """A round is reserved at its projected spend until its edges release, then counted by its
    ledger rows only; a cap of exactly one round lets it through (no double count). The
    projection is an upper bound: it reserves every declared field (here the edges release them
    all, so the two agree)."""
    settings.SYNAPSE_EPSILON_BUDGET = 1.0
    round_, _ = build_federation(config={"epsilon": 1.0, "field_cap": 2, "summarizer": "none"})
    assert accounting.commitments().reserved == {round_.pk: pytest.approx(1.0)}
    assert not accounting.would_exceed()[0]
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    committed = accounting.commitments()
    assert committed.reserved == {}
    assert committed.recorded == {round_.pk: pytest.approx(1.0)}
    assert accounting.committed_composition().epsilon == pytest.approx(1.0)
    assert accounting.projected_round_spend(round_.config) >= committed.recorded[round_.pk]
    exceeded, projected = accounting.would_exceed(1e-3)
    assert exceeded and projected.epsilon == pytest.approx(1.001)
    assert not accounting.would_exceed(0.0)[0]


@pytest.mark.usefixtures("every_field_released")
def test_edge_refuses_release_over_remaining_budget(settings):
    """The operator-level guard too: a release above what is left is refused before noise."""
    settings.SYNAPSE_EPSILON_BUDGET = 0.9  # the release needs 1 (every field)
    round_, _ = build_federation(state="merging", config={"epsilon": 1.0})
    org = CompendiumVersion.objects.filter(kind="client", round=round_).first().client.organization
    with pytest.raises(pipeline.BudgetExceeded, match="epsilon budget"):
        pipeline.run_edge_merge(round_.pk, org.pk)
    assert not PrivacyLedgerEntry.objects.exists()
    assert not CompendiumVersion.objects.filter(kind="edge").exists()


def test_failed_round_can_be_retried(settings, django_capture_on_commit_callbacks):
    settings.SYNAPSE_EPSILON_BUDGET = 0.5
    round_, _ = build_federation(config={"epsilon": 1.0, "summarizer": "none"})
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "failed"
    settings.SYNAPSE_EPSILON_BUDGET = 5.0
    with django_capture_on_commit_callbacks(execute=True):
        call_command("retry_round", str(round_.number))
    round_.refresh_from_db()
    assert round_.state == "published" and round_.failure_reason == ""


def test_conflicts_are_logged_and_become_next_round_precautions(
    django_capture_on_commit_callbacks,
):
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    round_, clients = build_federation(config={"summarizer": "none"})
    org = plant_weather_conflict(round_, clients)
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    [conflict] = ConflictLogEntry.objects.filter(round=round_, organization=org)
    assert conflict.tool_id == "weather"
    assert conflict.dissenters[0]["preconditions"] == {"has_city": False}
    nxt = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=nxt,
        client=clients[("acme", "a1")])
    close(nxt, django_capture_on_commit_callbacks)
    edge = CompendiumVersion.objects.get(kind="edge", round=nxt, organization=org)
    texts = [p["text"] for p in edge.content["precautions"]]
    assert any(t.startswith("Use WeatherNow for will it rain tomorrow in Paris") and
               "has_city is false" in t for t in texts), texts


@pytest.mark.usefixtures("every_field_released")
def test_erasure_rematerializes_without_the_client_and_keeps_the_ledger(
    probes, django_capture_on_commit_callbacks
):
    round_, clients = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    before = CompendiumVersion.objects.get(kind="global", round=round_).sha256
    spent_before = accounting.privacy_report().federation.epsilon
    target = clients[("acme", "a2")]
    out = io.StringIO()
    call_command("erase_client", "acme/a2", stdout=out)
    assert not CompendiumVersion.objects.filter(kind="client", client=target).exists()
    # Erasure does not revoke: the command says the client may still submit, and how to stop it.
    assert out.getvalue().splitlines()[-1].startswith(f"{target} is still enrolled (approved)")
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization__slug="acme")
    assert [v.client_id for v in edge.sources.all()] == [clients[("acme", "a1")].pk]
    texts = [s["text"] for s in edge.content["scenarios"]]
    assert "What is 17 multiplied by 23?" not in texts
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert glob.sha256 != before
    assert all("17 multiplied" not in s["text"] for s in glob.content["scenarios"])
    # The head is refitted on what is published now; the probe's tools left without scenarios
    # (calculator: a2 was its only client) stay after them, routable from the probe alone.
    backed = sorted({s["tool_id"] for s in glob.content["scenarios"]})
    probe_only = sorted(set(pipeline.load_probe_set().labels) - set(backed))
    assert "calculator" in probe_only
    assert LinearHead.from_bytes(glob.routing_head).tools == backed + probe_only
    # Spent budget is kept; the re-release is appended as release 1.
    releases = sorted(set(PrivacyLedgerEntry.objects.filter(
        organization__slug="acme").values_list("release", flat=True)))
    assert releases == [0, 1]
    assert accounting.privacy_report().federation.epsilon >= spent_before


def test_erase_client_says_which_compendiums_it_removed_rather_than_re_materialized(
    probes, django_capture_on_commit_callbacks
):
    """An erasure that leaves an edge without submissions removes it, and a published round left
    without edges loses its global: the command counted both as "re-materialized", so the
    operator was not told that the round's global compendium was gone."""
    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)

    def erase(name):
        out = io.StringIO()
        call_command("erase_client", name, stdout=out)
        return out.getvalue().splitlines()[0]

    # globex/g1 was its organization's only client: its edge goes, the global is merged again
    assert erase("globex/g1") == (
        "erased 1 submission(s) of globex/g1; re-materialized 0 edge and 1 global compendium(s); "
        "removed 0 conflict decision(s); removed 1 edge(s) left without submissions")
    assert not CompendiumVersion.objects.filter(kind="edge", organization__slug="globex").exists()
    erase("acme/a1")
    assert erase("acme/a2") == (
        "erased 1 submission(s) of acme/a2; re-materialized 0 edge and 0 global compendium(s); "
        "removed 0 conflict decision(s); removed 1 edge(s) left without submissions; "
        "round(s) 1 left without a global compendium (removed)")
    assert not CompendiumVersion.objects.filter(kind__in=["edge", "global"]).exists()
    # the audit entry says so too, not that they were merged again
    entry = AuditLog.objects.filter(action=AuditLog.Action.CLIENT_ERASE).latest("pk")
    acme = Client.objects.get(name="a2").organization
    assert entry.details["edges_rematerialized"] == [] and entry.details["edges_removed"] == [
        [1, acme.pk]]
    assert entry.details["globals_rematerialized"] == [] and entry.details["globals_removed"] == [1]


@pytest.mark.usefixtures("every_field_released")
def test_an_erasure_release_is_checked_again_under_the_budget_lock(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """An erasure's re-release is new ε beyond the round's reservation. What remained when its
    merge began may have been committed meanwhile (a round opened): under the lock that opening
    a round takes, the remainder is read again, and a release that no longer fits is withheld."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    ledger_before = PrivacyLedgerEntry.objects.count()
    readings = iter([100.0, 0.0])  # when the merge began; under the lock, after a round opened
    monkeypatch.setattr(accounting, "remaining_for_release", lambda *args: next(readings))
    acme = CompendiumVersion.objects.filter(
        kind="edge", round=round_, organization__slug="acme").get().organization
    with CaptureQueriesContext(connection) as queries:
        pipeline.run_edge_merge(round_.pk, acme.pk, rematerialize=True)
    settings_table = pipeline.FederationSettings._meta.db_table
    assert any(settings_table in q["sql"] and "FOR UPDATE" in q["sql"] for q in queries.captured_queries)
    assert PrivacyLedgerEntry.objects.count() == ledger_before  # nothing released past the cap
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.stats["release"] == 1 and "epsilon budget" in record.stats["numeric_withheld"]


def test_erasure_that_fails_changes_nothing_and_can_be_run_again(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """A re-merge that fails during an erasure leaves the client's submissions, the edges and the
    published global as they were, so the erasure can be run again and then completes."""
    from django.core.management.base import CommandError

    round_, clients = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    target = clients[("acme", "a2")]
    glob_before = CompendiumVersion.objects.get(kind="global", round=round_).sha256
    edge_before = CompendiumVersion.objects.get(
        kind="edge", round=round_, organization__slug="acme").sha256
    ledger_before = PrivacyLedgerEntry.objects.count()

    def broken(*args, **kwargs):
        raise RuntimeError("server merge broke")

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "run_server_merge", broken)
        with pytest.raises(CommandError, match="nothing was changed.*server merge broke"):
            call_command("erase_client", "acme/a2")
    assert CompendiumVersion.objects.filter(kind="client", client=target).count() == 1
    assert CompendiumVersion.objects.get(kind="global", round=round_).sha256 == glob_before
    assert CompendiumVersion.objects.get(
        kind="edge", round=round_, organization__slug="acme").sha256 == edge_before
    assert PrivacyLedgerEntry.objects.count() == ledger_before
    # Run again: it finds the same edges and completes.
    report = pipeline.erase_client(target)
    assert report.submissions_removed == 1 and report.globals_rematerialized == [1]
    assert not CompendiumVersion.objects.filter(kind="client", client=target).exists()
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert all("17 multiplied" not in s["text"] for s in glob.content["scenarios"])


def _second_round(config=None, number=2, text="Which airline flies nonstop to Lisbon?",
                  also=None):
    """A closing round with g1's submission of `text` (and, from the client `also`, one of
    "Cheap flights to Rome": its organization's edge merges too)."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    round2 = Round.objects.create(number=number, state="closing",
                                  config=config or {"summarizer": "centroid", "seed": 12})
    for client, request in ((Client.objects.get(name="g1"), text), (also, "Cheap flights to Rome")):
        if client is not None:
            store_compendium(
                Compendium.model_validate({"scenarios": [{"tool_id": "flights", "text": request}]}),
                kind="client", round=round2, client=client,
            )
    return round2


def test_global_carries_the_previous_one_forward_and_erasure_reaches_it(
    probes, django_capture_on_commit_callbacks
):
    round1, _ = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2 = _second_round()
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason
    first = CompendiumVersion.objects.get(kind="global", round=round1)
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    texts = [s["text"] for s in glob.content["scenarios"]]
    # Round 2 had one delta submission; what round 1 learnt is still there.
    assert "Which airline flies nonstop to Lisbon?" in texts
    assert "What is 17 multiplied by 23?" in texts
    assert first in set(glob.sources.all())
    # Erasing a round-1 client re-materializes round 1 and the round 2 that carried it forward.
    report = pipeline.erase_client(Client.objects.get(name="a2"))
    assert report.globals_rematerialized == [1, 2]
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    texts = [s["text"] for s in glob.content["scenarios"]]
    assert "What is 17 multiplied by 23?" not in texts
    assert "Which airline flies nonstop to Lisbon?" in texts


def test_an_erasure_that_deletes_the_served_global_has_the_earlier_one_tuned_again(
    probes, django_capture_on_commit_callbacks, tmp_path
):
    """Round 2's only submitter is erased: round 2's global is deleted, with its tuned router's
    folder (the encoder learnt from what was erased), and round 1's global, served again, is
    announced as published again so that its retired router is tuned again."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation.signals import global_published
    from routing.models import TunedRouter

    round1, _ = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    first = CompendiumVersion.objects.get(kind="global", round=round1)
    round2 = Round.objects.create(number=2, state="closing", config={"summarizer": "centroid", "seed": 12})
    late = Client.objects.create(organization=Client.objects.get(name="g1").organization, name="g9",
                                 status=Client.Status.APPROVED)
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Which airline flies nonstop to Lisbon?"}]}),
        kind="client", round=round2, client=late)
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason
    second = CompendiumVersion.objects.get(kind="global", round=round2)
    folder = tmp_path / "round-2"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    TunedRouter.objects.create(version=second, state="ready", epochs=1, directory=str(folder))
    TunedRouter.objects.create(version=first, state="retired", epochs=1, directory="")

    announced = []

    def seen(sender, round, version, **kwargs):
        announced.append(version.pk)

    global_published.connect(seen, dispatch_uid="test-erasure-announce")
    try:
        with django_capture_on_commit_callbacks(execute=True):
            report = pipeline.erase_client(late)
    finally:
        global_published.disconnect(dispatch_uid="test-erasure-announce")
    assert report.globals_rematerialized == [] and report.globals_removed == [2]
    assert not CompendiumVersion.objects.filter(kind="global", round=round2).exists()
    assert not folder.exists()
    assert announced == [first.pk]


def test_a_round_without_carry_forward_publishes_only_its_own_submissions(
    probes, django_capture_on_commit_callbacks
):
    round1, _ = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2 = _second_round({"summarizer": "centroid", "seed": 12, "carry_forward": False})
    close(round2, django_capture_on_commit_callbacks)
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    assert [s["text"] for s in glob.content["scenarios"]] == ["Which airline flies nonstop to Lisbon?"]
    # Round 3 carries round 2's global forward, which holds nothing of round 1's: erasing a
    # round-1 client merges round 1 again, and neither round 2 nor round 3.
    round3 = _second_round(number=3, text="Book me a flight to Oslo tomorrow")
    close(round3, django_capture_on_commit_callbacks)
    assert round3.state == "published", round3.failure_reason
    third = CompendiumVersion.objects.get(kind="global", round=round3)
    assert pipeline.erase_client(Client.objects.get(name="a2")).globals_rematerialized == [1]
    assert CompendiumVersion.objects.get(kind="global", round=round3).pk == third.pk


def _ledger_row(round_, org, eps, field="calls", release=0, cap=None):
    return PrivacyLedgerEntry.objects.create(
        round=round_, organization=org, release=release, tool_id="weather", field=field,
        sensitivity=1.0, contributors=2, epsilon=eps, noise_scale=1.0 / (2 * eps), field_cap=cap,
    )


def test_accountant_composes_per_organization_and_federation(settings):
    from federation.merge.privacy import advanced_composition
    from federation.models import Organization

    settings.SYNAPSE_EPSILON_BUDGET = 3.0
    a = Organization.objects.create(name="A", slug="a")
    b = Organization.objects.create(name="B", slug="b")
    r1 = Round.objects.create(number=1, state="published")
    r2 = Round.objects.create(number=2, state="published")
    _ledger_row(r1, a, 0.5, "calls")
    _ledger_row(r1, a, 0.5, "success_rate")
    _ledger_row(r1, b, 0.25)
    _ledger_row(r2, b, 0.75)
    org_a = accounting.organization_composition(a.pk)
    assert org_a.basic_epsilon == pytest.approx(1.0) and org_a.rounds == 1
    org_b = accounting.organization_composition(b.pk)
    assert org_b.basic_epsilon == pytest.approx(1.0)
    assert org_b.advanced_epsilon == pytest.approx(advanced_composition(0.75, 2, 1e-5))
    fed = accounting.federation_composition()
    assert fed.basic_epsilon == pytest.approx(1.75)  # max per round: 1.0 then 0.75
    assert fed.epsilon == pytest.approx(1.75) and fed.tighter == "basic"
    # A's next release in round 2: only B's round 2 spend runs in parallel to it.
    assert accounting.remaining_for_release(r2.pk, a.pk, 0) == pytest.approx(3.0 - 1.0)
    exceeded, projected = accounting.would_exceed(1.5)
    assert exceeded and projected.basic_epsilon == pytest.approx(3.25)
    assert not accounting.would_exceed(1.25)[0]


def test_the_ledgers_spends_summed_in_the_database_are_the_per_release_rule():
    """`_spends` sums in the database (one row per release, or per tool under a field cap) what
    `round_spend` defines per release over the ledger's rows; the same figures, with one release
    left out as a retry's check leaves it out."""
    import random
    from collections import defaultdict

    from federation.merge.privacy import round_spend
    from federation.models import Organization

    rng = random.Random(5)
    orgs = [Organization.objects.create(name=n, slug=n) for n in ("a", "b")]
    rounds = [Round.objects.create(number=n, state="published") for n in (1, 2, 3)]
    rows = []
    for org in orgs:
        for rnd in rounds:
            for release in range(rng.randint(1, 2)):
                cap = rng.choice([None, 1, 2])
                for tool in ("weather", "flights", "calculator", "recipes"):
                    for field in ("calls", "success_rate"):
                        eps = rng.choice([0.01, 0.02, 0.05, 0.125])
                        PrivacyLedgerEntry.objects.create(
                            round=rnd, organization=org, release=release, tool_id=tool,
                            field=field, sensitivity=1.0, contributors=3, epsilon=eps,
                            noise_scale=1.0 / eps, field_cap=cap)
                        rows.append((org.pk, rnd.pk, release, cap, tool, eps))

    def expected(leave_out=None):
        releases = defaultdict(list)
        for org, rnd, release, cap, tool, eps in rows:
            if (org, rnd, release) != leave_out:
                releases[(org, rnd, release)].append((eps, cap, tool))
        out = defaultdict(lambda: defaultdict(float))
        for (org, rnd, _), entries in releases.items():
            out[org][rnd] += round_spend([e[0] for e in entries], entries[0][1],
                                         [e[2] for e in entries])
        return {o: dict(r) for o, r in out.items()}

    def measured(**kwargs):
        return {o: dict(r) for o, r in accounting._spends(**kwargs).items()}

    for leave_out in (None, (orgs[0].pk, rounds[1].pk, 0)):
        got, want = measured(exclude=leave_out), expected(leave_out)
        assert got.keys() == want.keys()
        for org in want:
            assert got[org] == pytest.approx(want[org], rel=1e-12)


def test_ledger_is_append_only():
    from federation.models import Organization

    org = Organization.objects.create(name="A", slug="a")
    row = _ledger_row(Round.objects.create(number=1), org, 0.5)
    with pytest.raises(PermissionError):
        row.delete()
    row.epsilon = 0.0
    with pytest.raises(PermissionError):
        row.save()


# --- the pipeline's state changes are audited -----------------------------------------------------


def _round_audit(round_):
    return list(
        AuditLog.objects.filter(target_type="round", target_id=str(round_.pk))
        .order_by("id")
        .values_list("action", "actor_id", "actor_label")
    )


def _by_pipeline(*actions):
    return [(action, None, "merge pipeline") for action in actions]


def test_a_publication_hook_that_fails_does_not_fail_the_published_round(
    probes, django_capture_on_commit_callbacks
):
    """What runs on `global_published` (queueing the router's tuning) may fail after the
    publication committed (the broker down): the round stays published and the close that ran
    the pipeline does not fail."""
    from federation.signals import global_published

    heard = []

    def broker_down(version, **kwargs):
        heard.append(version.pk)
        raise ConnectionError("the broker is down")

    global_published.connect(broker_down, dispatch_uid="test.broker_down")
    try:
        round_, _ = build_federation()
        close(round_, django_capture_on_commit_callbacks)
    finally:
        global_published.disconnect(dispatch_uid="test.broker_down")
    assert round_.state == "published", round_.failure_reason
    assert heard == [CompendiumVersion.objects.get(kind="global", round=round_).pk]


def test_merging_and_publication_are_audited_once_each(probes, django_capture_on_commit_callbacks):
    from rest_framework.test import APIClient

    from federation import services
    from tests.federation_fixtures import SYSTEM, make_user

    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    assert _round_audit(round_) == _by_pipeline("round.merging", "round.publish")
    # Re-merging a published round's global (as an erasure does) changes no state: no entry.
    pipeline.run_server_merge(round_.pk)
    assert _round_audit(round_) == _by_pipeline("round.merging", "round.publish")
    # What the reviewer asked the API for.
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION="Bearer " + services.issue_user_token(
        SYSTEM, make_user("op", superuser=True)))
    for action in ("round.merging", "round.publish"):
        rows = api.get(f"/api/v1/admin/audit/?action={action}").json()["results"]
        assert [(r["action"], r["target_id"]) for r in rows] == [(action, str(round_.pk))]


def test_a_round_failed_by_the_pipeline_is_audited_with_its_reason(
    settings, django_capture_on_commit_callbacks
):
    settings.SYNAPSE_EPSILON_BUDGET = 0.5
    round_, _ = build_federation(config={"epsilon": 1.0, "summarizer": "none"})
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "failed"
    assert _round_audit(round_) == _by_pipeline("round.fail")
    entry = AuditLog.objects.get(action="round.fail")
    assert entry.details == {"reason": round_.failure_reason}
    assert "epsilon budget of 0.5" in entry.details["reason"]


def test_fail_round_audits_the_change_once_and_keeps_the_first_reason():
    round_, _ = build_federation(state="merging")
    pipeline.fail_round(round_.pk, "edge merge of organization 1 failed: boom")
    pipeline.fail_round(round_.pk, "edge merge of organization 2 failed: bang")  # a second edge
    round_.refresh_from_db()
    assert round_.state == "failed" and round_.failure_reason.endswith("boom")
    assert _round_audit(round_) == _by_pipeline("round.fail")
    assert AuditLog.objects.get(action="round.fail").details == {"reason": round_.failure_reason}
    # A published round is never failed.
    published = Round.objects.create(number=2, state="published")
    pipeline.fail_round(published.pk, "late")
    published.refresh_from_db()
    assert published.state == "published" and _round_audit(published) == []


def test_a_server_merge_that_fails_leaves_neither_publication_nor_its_entry(
    probes, monkeypatch
):
    """State, audit entry and global are written in one transaction: an audit write that fails
    leaves the round merging, without a global, and the retried step publishes it once."""
    from federation import services

    round_, clients = build_federation(state="merging")
    for org in sorted({c.organization_id for c in clients.values()}):
        pipeline.run_edge_merge(round_.pk, org)
    real_audit = services.audit

    def broken(actor, action, **kwargs):
        if action == "round.publish":
            raise RuntimeError("audit table unavailable")
        return real_audit(actor, action, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(services, "audit", broken)
        with pytest.raises(RuntimeError, match="audit table unavailable"):
            pipeline.run_server_merge(round_.pk)
    round_.refresh_from_db()
    assert round_.state == "merging" and round_.published_at is None
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()
    assert not MergeRecord.objects.filter(round=round_, organization__isnull=True).exists()
    assert _round_audit(round_) == []
    pipeline.run_server_merge(round_.pk)
    round_.refresh_from_db()
    assert round_.state == "published" and round_.published_at is not None
    assert _round_audit(round_) == _by_pipeline("round.publish")


def test_a_server_merge_does_not_publish_a_round_failed_meanwhile(probes):
    """The operator failed the round while its server merge ran: the merge writes nothing, and
    the task's fail_round keeps the operator's reason; an erasure of one of its clients still
    runs (a round without a published global has none to re-merge)."""
    from federation import services

    round_, clients = build_federation(state="merging")
    for org in sorted({c.organization_id for c in clients.values()}):
        pipeline.run_edge_merge(round_.pk, org)
    services.mark_failed(round_, "operator: edge down")
    with pytest.raises(pipeline.PipelineError, match="is failed, not merging"):
        pipeline.run_server_merge(round_.pk)
    pipeline.fail_round(round_.pk, "server merge failed: round 1 is failed, not merging")
    round_.refresh_from_db()
    assert round_.state == "failed" and round_.failure_reason == "operator: edge down"
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()
    assert [a for a, _, _ in _round_audit(round_)] == ["round.fail"]
    report = pipeline.erase_client(clients[("acme", "a2")])
    assert report.submissions_removed == 1 and report.globals_rematerialized == []
    round_.refresh_from_db()
    assert round_.state == "failed"
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()


def test_release_headroom_accounts_for_advanced_composition(settings):
    """When advanced composition is the tighter bound, a release raises max ε_r and the committed
    ε′ grows by more than the release's own ε: the headroom an edge release is checked against
    must be what keeps the *composed* figure within the cap (it was cap − ε′, which let an
    erasure's re-release push ε′ from 3.46 to 4.1 over a cap of 3.9)."""
    from federation.merge.privacy import compose
    from federation.models import Organization

    settings.SYNAPSE_EPSILON_BUDGET = 3.9
    org = Organization.objects.create(name="A", slug="a")
    rounds = [Round.objects.create(number=n, state="published") for n in range(1, 41)]
    for r in rounds:
        _ledger_row(r, org, 0.1)
    before = accounting.federation_composition()
    assert before.tighter == "advanced" and before.epsilon < 3.5
    remaining = accounting.remaining_for_release(rounds[-1].pk, org.pk, 1)
    # a re-release of the last round at its ε = 0.1 would bring ε′ to 4.1 (basic) > 3.9
    assert compose([0.1] * 39 + [0.2], 1e-5).epsilon > 3.9
    assert remaining < 0.1
    assert compose([0.1] * 39 + [0.1 + remaining], 1e-5).epsilon <= 3.9 + 1e-9
    assert compose([0.1] * 39 + [0.1 + remaining + 1e-3], 1e-5).epsilon > 3.9
    # under basic composition the headroom is still cap − ε′ exactly
    settings.SYNAPSE_EPSILON_BUDGET = 100.0
    r = Round.objects.create(number=41, state="published")
    _ledger_row(r, org, 5.0)
    committed = accounting.committed_composition()
    assert committed.tighter == "basic"
    assert accounting.remaining_for_release(r.pk, org.pk, 1) == pytest.approx(100.0 - 9.0)


def test_edges_do_not_release_what_the_round_named_when_it_opened(probes, django_capture_on_commit_callbacks):
    """calls would come out of its noise at this round's counts, but the round named it when it
    opened (clients left it out): no edge releases it, so nothing is released or spent."""
    round_, _ = build_federation()
    Round.objects.filter(pk=round_.pk).update(fields_not_released=["calls"])
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    assert not PrivacyLedgerEntry.objects.filter(round=round_).exists()
    record = MergeRecord.objects.get(round=round_, organization__slug="acme")
    assert record.stats["fields_not_released"] == ["calls", "frequency", "latency_ms", "success_rate"]
    assert record.stats["epsilon_spent"] == 0.0


# --- erasure reaches what the conflict logs carried into later rounds --------------------------

SECRET = "Will it rain tomorrow in Paris, Zorblat?"


def _leaks(secret: str) -> list[str]:
    """Where `secret` is still stored: compendiums, conflict logs, merge records, decisions, the
    audit log."""
    from federation.models import AuditLog, ConflictDecision

    def has(value) -> bool:
        return secret in str(value)

    return (
        [f"{v.kind} {v.round.number} {v.organization_id}" for v in CompendiumVersion.objects.all()
         if has(v.content)]
        + [f"conflict {c.round.number} {c.organization_id}"
           for c in ConflictLogEntry.objects.all() if has([c.centroid, c.dissenters])]
        + [f"record {m.round.number} {m.organization_id}" for m in MergeRecord.objects.all()
           if has([m.flagged, m.rejected])]
        + [f"decision {d.round.number}" for d in ConflictDecision.objects.all() if has(d.text)]
        + [f"audit {e.action}" for e in AuditLog.objects.all() if has([e.details, e.target_label])]
    )


def _weather_conflict(capture, dissenters: dict[str, str]):
    """Round 1 (no summarizer): at acme, a1 and a2 say the weather request needs a city and each
    client of `dissenters` (name -> its text) says it does not: acme's edge logs one conflict."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    round_, clients = build_federation(config={"summarizer": "none"})
    org = plant_weather_conflict(round_, clients)
    # plant_weather_conflict's own dissenter (a3) is replaced by `dissenters`
    CompendiumVersion.objects.filter(kind="client", client__name="a3").delete()
    for name, text in dissenters.items():
        clients[("acme", name)], _ = Client.objects.get_or_create(
            organization=org, name=name, defaults={"status": "approved"})
        store_compendium(Compendium.model_validate({"scenarios": [
            {"tool_id": "weather", "text": text, "preconditions": {"has_city": False}}]}),
            kind="client", round=round_, client=clients[("acme", name)])
    close(round_, capture)
    assert round_.state == "published", round_.failure_reason
    [conflict] = ConflictLogEntry.objects.filter(round=round_, organization=org)
    assert sorted(d["text"] for d in conflict.dissenters) == sorted(dissenters.values())
    return org, clients, conflict


def _round_with(number, client, text, capture, **config):
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    round_ = Round.objects.create(number=number, state="closing",
                                  config={"summarizer": "none", **config})
    store_compendium(Compendium.model_validate({"scenarios": [{"tool_id": "flights", "text": text}]}),
                     kind="client", round=round_, client=client)
    close(round_, capture)
    assert round_.state == "published", round_.failure_reason
    return round_


@pytest.mark.usefixtures("every_field_released")
def test_erasure_merges_again_the_later_edges_that_made_precautions_of_its_conflicts(
    django_capture_on_commit_callbacks,
):
    """Round 1's conflict log keeps the erased client's dissent; round 2's edge (the client sat
    it out) composed it into a precaution, and round 3's global carried it forward. The erasure
    merges round 2's edge again (a replay of its release: no new ε) and every global after."""
    capture = django_capture_on_commit_callbacks
    org, clients, _ = _weather_conflict(capture, {"a3": SECRET})
    _round_with(2, clients[("acme", "a1")], "Book a flight to Rome", capture)
    _round_with(3, clients[("globex", "g1")], "Book a flight to Oslo", capture)
    assert any(where.startswith("global 3") for where in _leaks("Zorblat")), _leaks("Zorblat")
    report = pipeline.erase_client(clients[("acme", "a3")])
    assert _leaks("Zorblat") == []
    assert report.edges_rematerialized == [(1, org.pk), (2, org.pk)]
    assert report.globals_rematerialized == [1, 2, 3]
    releases = dict(PrivacyLedgerEntry.objects.filter(organization=org).values_list(
        "round__number", "release").order_by("release"))
    assert releases == {1: 1, 2: 0}  # round 1 released again; round 2's release replayed


def test_erasure_merges_again_a_global_that_made_precautions_of_the_servers_conflicts(
    django_capture_on_commit_callbacks,
):
    """The server's own log does the same one level up: round 1's conflict between edges (globex
    alone claims a request for another tool) became a precaution of round 2's global, which does
    not carry round 1's forward. Erasing globex's client merges round 2's global again."""
    from tests.merge_helpers import CROSS_EDGE_REQUEST as request
    from tests.merge_helpers import plant_cross_edge_conflict

    capture = django_capture_on_commit_callbacks
    r1 = Round.objects.create(number=1, state="closing", config={"summarizer": "none"})
    clients = plant_cross_edge_conflict(r1)
    close(r1, capture)
    assert ConflictLogEntry.objects.filter(round=r1, organization=None).count() == 1
    r2 = _round_with(2, clients["a1"], "Book a flight to Rome", capture, carry_forward=False)

    def fares_precautions():
        glob = CompendiumVersion.objects.get(kind="global", round=r2).content
        return [p["text"] for p in glob.get("precautions", []) if p["tool_id"] == "fares"]

    assert fares_precautions() == [f"Do not use AirfareWatch for requests like: {request} "
                                   "(use FlightFinder instead)"]
    report = pipeline.erase_client(clients["g1"])
    assert fares_precautions() == []
    assert not ConflictLogEntry.objects.filter(organization=None).exists()
    assert report.globals_rematerialized == [1, 2]


def test_erasure_removes_a_decision_that_picked_the_erased_clients_text(
    django_capture_on_commit_callbacks,
):
    """A reviewer picked the erased client's dissent as the winning scenario. The conflict stays
    after the erasure (another client dissents too) under the same centroid id, so the decision
    would still match it: the erasure removes it (audited), and round 2's edge, which published
    the pick, is merged again and composes the conflict as it stands now."""
    from federation.conflicts import decide_conflict
    from federation.models import ConflictDecision
    from federation.services import Actor

    capture = django_capture_on_commit_callbacks
    other = "Is rain expected in Paris tomorrow?"
    org, clients, conflict = _weather_conflict(capture, {"a3": SECRET, "a4": other})
    decide_conflict(Actor.system(), conflict, "scenario", SECRET)
    _round_with(2, clients[("acme", "a1")], "Book a flight to Rome", capture)
    assert f"edge 2 {org.pk}" in _leaks("Zorblat")
    report = pipeline.erase_client(clients[("acme", "a3")])
    assert _leaks("Zorblat") == []
    assert report.decisions_removed == 1 and not ConflictDecision.objects.exists()
    [after] = ConflictLogEntry.objects.filter(round__number=1, organization=org)
    assert after.centroid_id == conflict.centroid_id  # the decision's key still matched
    assert [d["text"] for d in after.dissenters] == [other]
    [removal] = AuditLog.objects.filter(action="conflict.decide", details__action="removed")
    assert removal.details["decision"] == "scenario" and "Zorblat" not in str(removal.details)
    edge = CompendiumVersion.objects.get(kind="edge", round__number=2, organization=org).content
    assert any("has_city is false" in p["text"] for p in edge["precautions"])


def test_a_decision_on_a_conflict_an_erasure_merged_away_is_refused(
    django_capture_on_commit_callbacks,
):
    """A reviewer opened the conflict (the page read its row), then an erasure merged the log
    again and committed (or the decision waited on the erasure's lock of the row it deletes):
    the row read is gone, with the erased client's dissent in it. Picking that dissent now must
    not store the erased text in a decision after the erasure: refused, nothing written."""
    from federation.conflicts import decide_conflict
    from federation.errors import Conflict
    from federation.models import ConflictDecision
    from federation.services import Actor

    capture = django_capture_on_commit_callbacks
    org, clients, conflict = _weather_conflict(
        capture, {"a3": SECRET, "a4": "Is rain expected in Paris tomorrow?"})
    pipeline.erase_client(clients[("acme", "a3")])
    assert _leaks("Zorblat") == []
    with pytest.raises(Conflict, match="merged again"):
        decide_conflict(Actor.system(), conflict, "scenario", SECRET)
    assert not ConflictDecision.objects.exists() and _leaks("Zorblat") == []

def test_an_erasure_that_deletes_a_global_deletes_its_server_log_and_record(
    probes, django_capture_on_commit_callbacks, client
):
    """Round 2's only submitter is erased: its global goes, and so do its server merge's conflict
    log and merge record (they hold the edges' texts): round 3's global no longer composes
    precautions from them, and the dashboard still shows round 2."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    from compendium.schema import Compendium
    from compendium.services import store_compendium

    capture = django_capture_on_commit_callbacks
    round1, _ = build_federation()
    close(round1, capture)
    globex = Client.objects.get(name="g1").organization
    late = Client.objects.create(organization=globex, name="g9", status=Client.Status.APPROVED)
    round2 = Round.objects.create(number=2, state="closing", config={"summarizer": "centroid", "seed": 12})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain tomorrow in Paris, Zorblat?"}]}),
        kind="client", round=round2, client=late)
    close(round2, capture)
    # As round 2's server merge logs a conflict between its edge and another input (a test's
    # shortcut: the rows are written directly) and flags an edge's scenario.
    ConflictLogEntry.objects.create(
        round=round2, organization=None, tool_id="weather", centroid_id="c0",
        centroid={"source": "org:acme", "tool_id": "weather", "text": "Will it rain tomorrow in Paris?",
                  "preconditions": {"has_city": True}},
        dissenters=[{"source": "org:globex", "tool_id": "weather", "text": SECRET,
                     "preconditions": {"has_city": False}}],
        reason="precondition flags contradict")
    MergeRecord.objects.filter(round=round2, organization=None).update(
        flagged=[{"source": "org:globex", "tool_id": "weather", "text": SECRET}])
    _round_with(3, Client.objects.get(name="a1"), "Book a flight to Rome", capture,
                carry_forward=False)
    assert "global 3 None" in _leaks("Zorblat")
    report = pipeline.erase_client(late)
    assert _leaks("Zorblat") == []
    assert report.globals_rematerialized == [3] and report.globals_removed == [2]
    assert not MergeRecord.objects.filter(round=round2, organization=None).exists()
    assert pipeline._conflict_source(Round.objects.get(number=3), None).number == 1
    client.force_login(get_user_model().objects.create_superuser("op", "op@example.org", "pw"))
    page = client.get(reverse("dashboard:conflicts"), {"round": "2"})
    assert page.status_code == 200 and "Zorblat" not in page.content.decode()
    page = client.get(reverse("dashboard:compendium"), {"round": "2"})
    assert page.status_code == 404 and "no global compendium is published for round 2" in page.content.decode()
    for name in ("overview", "accuracy", "compendium"):
        assert client.get(reverse(f"dashboard:{name}")).status_code == 200, name


def test_an_erasure_is_audited_in_the_clients_organization(world, valid_doc):
    """`erase_client` removed a client's submissions and re-published what held them without a
    trace in the audit log (the README and the Django admin say it is audited): who erased which
    client, when, and what it took, for the operator and the client's organization."""
    from compendium.services import store_compendium
    from federation import services
    from federation.models import Round
    from tests.federation_fixtures import SYSTEM, client_api

    Round.objects.create(number=1, state=Round.State.OPEN, config={"epsilon": 1.0})
    store_compendium(Compendium.model_validate(valid_doc), kind="client",
                     round=Round.objects.get(number=1), client=world.client_a)
    call_command("erase_client", "org-a/a1")
    assert not CompendiumVersion.objects.filter(kind="client", client=world.client_a).exists()
    entry = AuditLog.objects.get(action="client.erase")
    assert entry.actor is None and entry.actor_label == "manage.py erase_client"
    assert entry.organization == world.org_a and entry.target_id == str(world.client_a.pk)
    assert entry.details["submissions_removed"] == 1
    assert entry.details["edges_rematerialized"] == [] and entry.details["decisions_removed"] == 0

    def actions(user):
        api = client_api(services.issue_user_token(SYSTEM, user))
        return [e["action"] for e in api.get("/api/v1/admin/audit/").json()["results"]]

    assert "client.erase" in actions(world.admin_a) and "client.erase" in actions(world.operator)
    assert "client.erase" not in actions(world.admin_b)


def test_a_submission_stored_before_a_tool_left_the_registry_is_merged_without_it(probes):
    """A client's submission was checked against the schema in force when it arrived; the
    operator may deactivate a tool while the round is still open. The edge merge validated the
    stored submission against the schema of the merge, so an honest client that had used the
    tool lost its whole submission (rejected, its other entries with it). It is read as the
    schema in force reads it, as the server merge reads its edges: the tool's entries go."""
    from compendium.models import Tool

    round_, clients = build_federation(state="merging")
    Tool.objects.filter(tool_id="calculator").update(active=False)
    org = clients[("acme", "a1")].organization
    pipeline.run_edge_merge(round_.pk, org.pk)
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=org)
    assert edge.sources.count() == 2
    texts = {(s["tool_id"], s["text"]) for s in edge.content["scenarios"]}
    assert ("flights", "Book a cheap flight from Boston to Denver") in texts
    assert all(tool != "calculator" for tool, _ in texts)
    assert all(p["tool_id"] != "calculator" for p in edge.content.get("precautions", []))


def test_an_edge_that_accepted_nothing_does_not_lose_the_conflict_log_it_read(
    django_capture_on_commit_callbacks,
):
    """Round 1 logs a conflict at acme; in round 2 acme's only submission is rejected at the
    merge (no edge is stored: nothing it composed is published); round 3's edge of acme must
    still turn round 1's log into precautions. It read round 2's empty log: the conflict, and
    any reviewer's decision on it, were lost for good."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    round_, clients = build_federation(config={"summarizer": "none"})
    org = plant_weather_conflict(round_, clients)
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    assert ConflictLogEntry.objects.filter(round=round_, organization=org).exists()

    second = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    for key, text in ((("acme", "a1"), "Book a flight"), (("globex", "g1"), "Find a flight")):
        store_compendium(Compendium.model_validate({"scenarios": [
            {"tool_id": "flights", "text": text}]}), kind="client", round=second,
            client=clients[key])
    # stored valid, unreadable at the merge: rejected whole
    CompendiumVersion.objects.filter(kind="client", round=second, client=clients[("acme", "a1")]
                                     ).update(content={"scenarios": [{"tool_id": "flights"}]})
    close(second, django_capture_on_commit_callbacks)
    assert second.state == "published", second.failure_reason
    assert not CompendiumVersion.objects.filter(kind="edge", round=second, organization=org).exists()
    assert MergeRecord.objects.get(round=second, organization=org).stats["accepted"] == 0
    # and a reviewer may still decide on it: the next merge of acme's edge will read it
    from federation.conflicts import closed_by

    assert closed_by(ConflictLogEntry.objects.get(round=round_, organization=org)) is None

    third = Round.objects.create(number=3, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=third,
        client=clients[("acme", "a1")])
    close(third, django_capture_on_commit_callbacks)
    assert third.state == "published", third.failure_reason
    edge = CompendiumVersion.objects.get(kind="edge", round=third, organization=org)
    texts = [p["text"] for p in edge.content["precautions"]]
    assert any(t.startswith("Use WeatherNow for will it rain tomorrow in Paris") for t in texts), texts


def test_an_erasure_deletes_the_edges_of_a_failed_round_that_can_no_longer_be_retried(
    probes, django_capture_on_commit_callbacks
):
    """Round 1 merged its edges, then failed; round 2 was published, so round 1 can never be
    retried (`services._refuse_after_a_later_publication`) and its edges feed nothing: no global,
    no later merge's conflict log (`_conflict_source` reads published rounds only). The erasure of
    a round-1 client re-materialized its edge all the same: a new release with fresh noise,
    charged to the ledger (the accountant counts every round's rows, whatever its state), over
    a compendium nobody reads. That edge, its conflict log and its merge record are deleted now:
    the erased client's data goes, the ledger keeps what was spent and nothing more."""
    from federation import services
    from tests.federation_fixtures import SYSTEM

    round1, clients = build_federation()
    for organization in pipeline.start_round(round1.pk, 1):
        pipeline.run_edge_merge(round1.pk, organization, attempt=1)
    services.mark_failed(round1, "the server merge failed")
    round2 = _second_round()
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason
    with pytest.raises(services.InvalidTransition, match="round 2 is published already"):
        services.retry_round(SYSTEM, round1)
    acme = clients[("acme", "a2")].organization
    assert CompendiumVersion.objects.filter(kind="edge", round=round1, organization=acme).exists()
    ledger_before = sorted(PrivacyLedgerEntry.objects.values_list("round_id", "organization_id",
                                                                  "release", "tool_id", "field"))
    spent_before = accounting.privacy_report().federation.epsilon
    glob_before = CompendiumVersion.objects.get(kind="global", round=round2).sha256

    report = pipeline.erase_client(clients[("acme", "a2")])

    # no new release: the ledger holds exactly what it held, and ε′ is unchanged
    assert sorted(PrivacyLedgerEntry.objects.values_list(
        "round_id", "organization_id", "release", "tool_id", "field")) == ledger_before
    assert accounting.privacy_report().federation.epsilon == spent_before
    assert report.edges_rematerialized == []
    assert report.edges_deleted == [(1, acme.pk)]
    assert not CompendiumVersion.objects.filter(kind="edge", round=round1, organization=acme).exists()
    assert not MergeRecord.objects.filter(round=round1, organization=acme).exists()
    assert not ConflictLogEntry.objects.filter(round=round1, organization=acme).exists()
    # round 2 did not carry anything of the failed round: its global is untouched
    assert CompendiumVersion.objects.get(kind="global", round=round2).sha256 == glob_before
    # globex's edge of round 1 held nothing of the erased client: it stays as it was
    globex = clients[("globex", "g1")].organization
    assert CompendiumVersion.objects.filter(kind="edge", round=round1, organization=globex).exists()
    entry = AuditLog.objects.get(action="client.erase")
    assert entry.details["edges_deleted"] == [[1, acme.pk]]


def test_a_global_merged_before_the_flag_rule_has_its_one_source_flag_names_held_back(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Flag names are published only when two sources carried them (`FLAG_MIN_SOURCES`); a
    global published before that rule may hold one client's name, and the next server merge
    carries that global forward. Its record (no `flags_held_back`) says so: the names it holds
    count for no source there, so the one client's name is not published again. A global merged
    under the rule keeps its names (they passed then), with no edge sending them again."""
    from compendium.services import store_compendium
    from federation.merge import operator

    round1, clients = build_federation()
    version = CompendiumVersion.objects.get(kind="client", round=round1,
                                            client=clients[("acme", "a1")])
    content = dict(version.content)
    for s in content["scenarios"]:
        if s["tool_id"] == "weather":
            s["preconditions"] = {"jane_doe": True}
    version.delete()
    store_compendium(Compendium.model_validate(content), kind="client", round=round1,
                     client=clients[("acme", "a1")])
    monkeypatch.setattr(operator, "FLAG_MIN_SOURCES", 1)  # as merged before the rule
    close(round1, django_capture_on_commit_callbacks)
    monkeypatch.undo()
    first = CompendiumVersion.objects.get(kind="global", round=round1)

    def names(version):
        return {n for s in version.content["scenarios"] for n in s.get("preconditions", {})}

    assert names(first) == {"jane_doe"}
    record = MergeRecord.objects.get(round=round1, organization__isnull=True)
    record.stats = {k: v for k, v in record.stats.items() if k != "flags_held_back"}
    record.save()
    round2 = _second_round()
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    assert names(glob) == set()
    assert any(s["text"].startswith("Will it rain tomorrow in Paris")
               for s in glob.content["scenarios"])  # the scenario stays, without the name
    assert MergeRecord.objects.get(round=round2, organization__isnull=True).stats[
        "flags_held_back"] == 1
    # merged under the rule, the same global's names stay
    record.stats = {**record.stats, "flags_held_back": 0}
    record.save()
    pipeline.run_server_merge(round2.pk)
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    assert names(glob) == {"jane_doe"}


def test_an_edge_log_merged_before_the_flag_rule_has_its_one_source_flag_names_held_back(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """An edge's conflict log of a round merged before the flag rule may hold one client's flag
    name, which the next round writes into a published precaution ("... when Y and <name> is
    true"). Its record (no `flags_held_back`) says so, and the next edge merge holds those names
    to its own sources; a log merged under the rule is composed as it is."""
    from compendium.services import store_compendium
    from federation.merge import operator
    from federation.models import Organization

    round1, clients = build_federation()
    org = Organization.objects.get(slug="acme")
    flags = {("acme", "a1"): {"has_city": True, "jane_doe": False},
             ("acme", "a2"): {"has_city": True, "jane_doe": False}}
    for key, value in flags.items():
        version = CompendiumVersion.objects.get(kind="client", round=round1, client=clients[key])
        content = dict(version.content)
        for s in content["scenarios"]:
            if s["tool_id"] == "weather":
                s["preconditions"] = value
        version.delete()
        store_compendium(Compendium.model_validate(content), kind="client", round=round1,
                         client=clients[key])
    a3 = Client.objects.create(organization=org, name="a3", status="approved")
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain tomorrow in Paris?",
         "preconditions": {"has_city": False, "jane_doe": True}}]}),
        kind="client", round=round1, client=a3)
    monkeypatch.setattr(operator, "FLAG_MIN_SOURCES", 1)  # as merged before the rule
    close(round1, django_capture_on_commit_callbacks)
    monkeypatch.undo()
    assert "jane_doe" in str(ConflictLogEntry.objects.get(round=round1, organization=org).dissenters)
    record = MergeRecord.objects.get(round=round1, organization=org)
    record.stats = {k: v for k, v in record.stats.items() if k != "flags_held_back"}
    record.save()
    round2 = _second_round(also=clients[("acme", "a1")])
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason

    def precautions():
        edge = CompendiumVersion.objects.get(kind="edge", round=round2, organization=org)
        return " ".join(p["text"] for p in edge.content["precautions"])

    assert "jane_doe" not in precautions()
    assert MergeRecord.objects.get(round=round2, organization=org).stats["flags_held_back"] == 2
    record.stats = {**record.stats, "flags_held_back": 0}  # merged under the rule
    record.save()
    pipeline.run_edge_merge(round2.pk, org.pk)
    assert "jane_doe is true" in precautions()


def test_an_accept_of_a_log_merged_before_the_flag_rule_naming_one_clients_flag_is_composed_again(
    probes, django_capture_on_commit_callbacks
):
    """An accepted precaution of a conflict log merged before the flag rule, stored before the
    review held such a log to its sources, may name one client's flag ("... and jane_doe is
    true"); the next merge published it as it stood. An accept whose text is not the precaution
    composed now counts as no decision, and the merge composes it afresh, holding the log's names
    to its own sources; one accepted as composed now is published as it stands."""
    from federation.conflicts import composed_precaution
    from federation.models import ConflictDecision, Organization

    round1, clients = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    org = Organization.objects.get(slug="acme")
    a1, a2 = (f"client:{clients[('acme', name)].pk}" for name in ("a1", "a2"))
    conflict = ConflictLogEntry.objects.create(
        round=round1, organization=org, tool_id="weather", centroid_id="j0",
        centroid={"source": a1, "tool_id": "weather", "text": "Will it rain in Lyon?",
                  "preconditions": {"has_city": True, "jane_doe": False}, "support": 1},
        dissenters=[
            {"source": a2, "tool_id": "weather", "text": "Rain in Lyon without a city",
             "preconditions": {"has_city": False}, "support": 1},
            {"source": a1, "tool_id": "weather", "text": "Rain in Lyon for Jane",
             "preconditions": {"jane_doe": True}, "support": 1},
        ],
        reason="preconditions disagree",
    )
    record = MergeRecord.objects.get(round=round1, organization=org)
    record.stats = {k: v for k, v in record.stats.items() if k != "flags_held_back"}
    record.save()  # merged before the rule
    stored = composed_precaution(conflict, flags_released=True)  # as accepted before the fix
    assert "jane_doe is true" in stored
    decision = ConflictDecision.objects.create(
        round=round1, organization=org, tool_id="weather", centroid_id="j0", action="accept",
        text=stored)
    round2 = _second_round(also=clients[("acme", "a1")])
    [entry] = [e for e in pipeline._previous_conflicts(round2, org) if e.centroid_id == "j0"]
    assert (entry.resolution, entry.resolution_text) == ("", "")
    close(round2, django_capture_on_commit_callbacks)
    assert round2.state == "published", round2.failure_reason

    def precautions():
        edge = CompendiumVersion.objects.get(kind="edge", round=round2, organization=org)
        return [p["text"] for p in edge.content["precautions"]]

    [afresh] = [t for t in precautions() if "rain in Lyon for Jane" in t]
    assert "jane_doe" not in afresh and afresh != stored
    # accepted as the review composes it now: applied as it stands
    decision.text = composed_precaution(conflict)
    decision.save()
    assert "jane_doe" not in decision.text and "has_city is false" in decision.text
    [entry] = [e for e in pipeline._previous_conflicts(round2, org) if e.centroid_id == "j0"]
    assert (entry.resolution, entry.resolution_text) == ("precaution", decision.text)
    pipeline.run_edge_merge(round2.pk, org.pk)
    assert decision.text in precautions()


def test_an_edge_merge_reads_the_round_of_its_conflict_log_once_then_again_under_the_lock(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """The round whose conflict log an edge merge reads (`_conflict_source`) decides both what
    it turns into precautions and whether that log is held to the flag rule: it was read up to
    three times before the write (each read could see another round published meanwhile) and
    twice more under the lock. It is read once before the merge, and once under the lock to
    see whether it changed."""
    from federation.models import Organization

    round1, clients = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2 = _second_round(also=clients[("acme", "a1")])
    reads = []
    real = pipeline._conflict_source

    def counted(round_, organization):
        reads.append(real(round_, organization))
        return reads[-1]

    monkeypatch.setattr(pipeline, "_conflict_source", counted)
    pipeline.run_edge_merge(round2.pk, Organization.objects.get(slug="acme").pk)
    assert reads == [round1, round1]


def test_an_edge_merge_merges_again_when_its_log_came_under_another_flag_rule_meanwhile(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Whether the log an edge merge reads is held to the flag rule was read before the merge
    and not again under the lock: an erasure that merged that log again meanwhile (its record
    now with, or without, `flags_held_back`) left the merge holding the log's flag names to the
    wrong rule. The merge runs again with the rule as it now stands."""
    from federation.models import Organization

    round1, clients = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    acme = Organization.objects.get(slug="acme")
    round2 = _second_round(also=clients[("acme", "a1")])
    rules = _rule_changed_after_the_first_merge(monkeypatch, "edge_merge", round1, acme)
    pipeline.run_edge_merge(round2.pk, acme.pk)
    assert rules == [True, False]


def test_a_server_merge_merges_again_when_its_log_came_under_another_flag_rule_meanwhile(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """The server merge read the round of its conflict log twice, once for the log and once for
    whether it was merged under the flag rule, and checked only the log under the lock. Both are
    read once, with what else it read, and a change of either merges again."""
    round1, clients = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2 = _second_round(also=clients[("acme", "a1")])
    for organization in pipeline.start_round(round2.pk, round2.attempt):
        pipeline.run_edge_merge(round2.pk, organization, attempt=round2.attempt)
    rules = _rule_changed_after_the_first_merge(monkeypatch, "server_merge_operator", round1, None)
    pipeline.run_server_merge(round2.pk, attempt=round2.attempt)
    assert rules == [True, False]


def _rule_changed_after_the_first_merge(monkeypatch, operator: str, round1, organization):
    """`pipeline.<operator>` made to record the flag rule of each merge it runs, and after the
    first one to rewrite `round1`'s record (of `organization`; None: the server's) as a merge
    before the rule leaves it (no `flags_held_back`), as an erasure merging it again would.
    Returns the list of rules seen."""
    rules = []
    real = getattr(pipeline, operator)

    def merged_meanwhile(*args, **kwargs):
        rules.append(kwargs["conflicts_flags_released"])
        result = real(*args, **kwargs)
        if len(rules) == 1:
            record = MergeRecord.objects.get(round=round1, organization=organization)
            record.stats = {k: v for k, v in record.stats.items() if k != "flags_held_back"}
            record.save()
        return result

    monkeypatch.setattr(pipeline, operator, merged_meanwhile)
    return rules


def test_a_tool_the_registry_does_not_offer_is_not_learnt_from_the_probe_set(registry, probes):
    """The published routing head learns the probe set's tools too, so that a tool without
    scenarios stays routable from the probe alone: a tool the operator deactivated (or never
    registered) that the probe set still labels was learnt, and the routing API could answer
    it. The probe counts only requests labelled with a tool of the registry in force."""
    from compendium.models import Tool

    Tool.objects.filter(tool_id="calculator").update(active=False)
    probe = pipeline.load_probe_set()
    assert "calculator" not in probe.labels and len(probe) == probes - 2
    assert len(probe.vectors) == len(probe.texts) == len(probe)
    published = Compendium(scenarios=[Scenario(tool_id="weather", text="Will it rain in Oslo?"),
                                      Scenario(tool_id="flights", text="Book a flight to Rome")])
    vectors = pipeline._embed()([s.text for s in published.scenarios])
    head = LinearHead.from_bytes(pipeline.routing_head(published, vectors, pipeline._embed(), probe))
    assert "calculator" not in head.tools


@pytest.mark.usefixtures("every_field_released")
def test_an_erasure_reaches_the_merge_record_of_an_edge_that_rejected_the_clients_submission(
    probes, django_capture_on_commit_callbacks
):
    """An edge merge that rejected a client's submission (stored valid, unreadable at the merge)
    names it in its merge record (`rejected`: the source and why) and among the inputs it read.
    The erasure found the edges to merge again through the provenance links, which only accepted
    sources have, so that record kept naming the erased client's submission for good. It is
    merged again as a replay of its release: the edge, the global and the ledger stay as they
    were (the rejected submission changed none of them)."""
    round_, clients = build_federation()
    target = clients[("acme", "a2")]
    CompendiumVersion.objects.filter(kind="client", client=target).update(
        content={"scenarios": [{"tool_id": "flights"}]})
    erased_pk = CompendiumVersion.objects.get(kind="client", client=target).pk
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    acme = target.organization
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert [r["source"] for r in record.rejected] == [f"client:{target.pk}"]
    assert erased_pk in record.stats["inputs"]
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme)
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    ledger = sorted(PrivacyLedgerEntry.objects.values_list("organization_id", "release", "field"))

    report = pipeline.erase_client(target)

    assert report.submissions_removed == 1
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.rejected == [] and record.stats["rejected"] == 0
    assert erased_pk not in record.stats["inputs"]
    assert not any(f"client:{target.pk}" in str(m.rejected) + str(m.flagged)
                   for m in MergeRecord.objects.all())
    # nothing it changed was published: the same edge and global, no new release
    assert CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme).pk == edge.pk
    assert CompendiumVersion.objects.get(kind="global", round=round_).pk == glob.pk
    assert sorted(PrivacyLedgerEntry.objects.values_list(
        "organization_id", "release", "field")) == ledger


def test_an_erasure_keeps_what_a_client_revoked_since_gave_a_published_round(
    probes, django_capture_on_commit_callbacks
):
    """A client revoked after its round was published stays in that round's global (nothing
    merges a published round again for a revocation). An erasure of another client of its
    organization merged that edge again over the submissions a merge reads now, revoked clients
    left out: erasing acme/a2 took acme/a1's scenarios out of the published global too (acme's
    edge was removed, left without a submission), which nobody asked for."""
    round_, clients = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    kept = clients[("acme", "a1")]
    Client.objects.filter(pk=kept.pk).update(status=Client.Status.REVOKED)

    report = pipeline.erase_client(clients[("acme", "a2")])

    assert report.edges_removed == []
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=kept.organization)
    assert [v.client_id for v in edge.sources.all()] == [kept.pk]
    texts = {s["text"] for s in CompendiumVersion.objects.get(
        kind="global", round=round_).content["scenarios"]}
    assert "Book a cheap flight from Boston to Denver" in texts
    assert not any("17 multiplied" in t for t in texts)


@pytest.mark.usefixtures("every_field_released")
def test_an_erasures_replay_of_a_later_edge_keeps_a_client_revoked_since(
    django_capture_on_commit_callbacks,
):
    """Round 2's edge of acme (a1 alone) read round 1's log, which holds the erased client's
    dissent; a1 was revoked after round 2 was published. The erasure's merge of round 2's edge
    again is a replay of its release: it read a1's submission, and still does (it removed the
    edge, left without a submission a merge reads now, and a1's flight from the global)."""
    capture = django_capture_on_commit_callbacks
    org, clients, _ = _weather_conflict(capture, {"a3": SECRET})
    second = _round_with(2, clients[("acme", "a1")], "Book a flight to Rome", capture)
    Client.objects.filter(pk=clients[("acme", "a1")].pk).update(status=Client.Status.REVOKED)
    report = pipeline.erase_client(clients[("acme", "a3")])
    assert _leaks("Zorblat") == []
    assert report.edges_rematerialized == [(1, org.pk), (2, org.pk)] and report.edges_removed == []
    releases = dict(PrivacyLedgerEntry.objects.filter(organization=org).values_list(
        "round__number", "release").order_by("release"))
    assert releases == {1: 1, 2: 0}  # round 2's release replayed, no new ε
    texts = {s["text"] for s in CompendiumVersion.objects.get(
        kind="global", round=second).content["scenarios"]}
    assert "Book a flight to Rome" in texts


def test_no_audit_entry_of_a_decision_holds_a_digest_of_a_clients_text(
    django_capture_on_commit_callbacks,
):
    """A conflict's centroid id is a digest of its anchor's text (a client's request: sha256 of
    tool, text and flags). The `conflict.decide` entries (append-only) named the conflict by it,
    the decision's and the erasure's removal of it alike: with a guess of the text it confirms
    the guess, which the audit log is kept from holding (lengths, never words nor digests). The
    erasure of the anchor's client wrote a fresh one, of the erased text, into the log."""
    from federation.conflicts import decide_conflict
    from federation.services import Actor

    capture = django_capture_on_commit_callbacks
    org, clients, conflict = _weather_conflict(capture, {"a3": SECRET})
    decide_conflict(Actor.system(), conflict, "dismiss")
    anchor = next(c for c in clients.values() if any(
        s["text"] == conflict.centroid["text"] and s.get("preconditions") == {"has_city": True}
        for v in CompendiumVersion.objects.filter(kind="client", client=c)
        for s in v.content["scenarios"]))
    report = pipeline.erase_client(anchor)
    assert report.decisions_removed == 1
    entries = AuditLog.objects.filter(action="conflict.decide")
    assert sorted(e.details["action"] for e in entries) == ["dismiss", "removed"]
    assert not any(conflict.centroid_id in e.target_label + str(e.details) for e in entries)
    assert all(e.target_label == f"weather conflict of round 1 at {org.slug}" for e in entries)


@pytest.mark.usefixtures("every_field_released")
def test_an_erasure_deletes_a_dead_rounds_edge_that_rejected_the_clients_submission(
    probes, django_capture_on_commit_callbacks
):
    """As an edge built from the erased client's submission, one of a failed round past retrying
    whose merge only rejected it (its record naming it) is deleted rather than merged again: a
    merge over the inputs a merge reads now (a1 revoked since) would be a new release, ε spent on
    a compendium nobody reads."""
    from federation import services

    round1, clients = build_federation()
    target = clients[("acme", "a2")]
    CompendiumVersion.objects.filter(kind="client", client=target).update(
        content={"scenarios": [{"tool_id": "flights"}]})
    for organization in pipeline.start_round(round1.pk, 1):
        pipeline.run_edge_merge(round1.pk, organization, attempt=1)
    services.mark_failed(round1, "the server merge failed")
    close(_second_round(), django_capture_on_commit_callbacks)
    Client.objects.filter(pk=clients[("acme", "a1")].pk).update(status=Client.Status.REVOKED)
    acme = target.organization
    assert f"client:{target.pk}" in str(MergeRecord.objects.get(round=round1, organization=acme).rejected)
    ledger = sorted(PrivacyLedgerEntry.objects.values_list("round_id", "organization_id", "release"))

    report = pipeline.erase_client(target)

    assert report.edges_deleted == [(1, acme.pk)] and report.edges_rematerialized == []
    assert not MergeRecord.objects.filter(round=round1, organization=acme).exists()
    assert sorted(PrivacyLedgerEntry.objects.values_list(
        "round_id", "organization_id", "release")) == ledger


def test_erasure_removes_an_edited_precaution_that_still_quotes_the_erased_clients_text(
    django_capture_on_commit_callbacks,
):
    """The edit field starts from the composed precaution, which quotes each dissenter's request:
    a reviewer who changed a few words kept the erased client's request in the decision. The
    conflict stays logged (another client dissents too), so the edit stayed, and every later
    merge of the edge published it again: the erased text survived the erasure. An edit that
    still quotes a text of the erased client is removed like a pick of it (audited)."""
    from federation.conflicts import composed_precaution, decide_conflict
    from federation.models import ConflictDecision
    from federation.services import Actor

    capture = django_capture_on_commit_callbacks
    other = "Is rain expected in Paris tomorrow?"
    org, clients, conflict = _weather_conflict(capture, {"a3": SECRET, "a4": other})
    composed = composed_precaution(conflict)
    assert "Zorblat" in composed
    decide_conflict(Actor.system(), conflict, "edit", composed + " Ask for the city first.")
    _round_with(2, clients[("acme", "a1")], "Book a flight to Rome", capture)
    assert f"edge 2 {org.pk}" in _leaks("Zorblat")
    report = pipeline.erase_client(clients[("acme", "a3")])
    assert _leaks("Zorblat") == []
    assert report.decisions_removed == 1 and not ConflictDecision.objects.exists()
    [removal] = AuditLog.objects.filter(action="conflict.decide", details__action="removed")
    assert removal.details["decision"] == "edit" and "quotes" in removal.details["reason"]


def test_erasure_keeps_an_edited_precaution_that_quotes_nothing_of_the_erased_client(
    django_capture_on_commit_callbacks,
):
    from federation.conflicts import decide_conflict
    from federation.models import ConflictDecision
    from federation.services import Actor

    capture = django_capture_on_commit_callbacks
    other = "Is rain expected in Paris tomorrow?"
    org, clients, conflict = _weather_conflict(capture, {"a3": SECRET, "a4": other})
    decide_conflict(Actor.system(), conflict, "edit", "Ask for the city before a forecast.")
    report = pipeline.erase_client(clients[("acme", "a3")])
    assert report.decisions_removed == 0
    assert ConflictDecision.objects.get().text == "Ask for the city before a forecast."
