"""A tiny federation simulated end to end with the real client toolkit, merge operator and router."""

from __future__ import annotations

import io
import json
import re
import tempfile
import types

import pytest
from django.core.management import CommandError, call_command

from federation.models import Client, Round, SimulationRun

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


@pytest.mark.django_db(transaction=True)  # the rounds go through the services (a scratch database)
def test_tiny_simulation_end_to_end(twin_dataset, tmp_path):
    out = tmp_path / "results.json"
    call_command(
        "simulate", "--dataset", str(twin_dataset), "--orgs", "2", "--clients-per-org", "2",
        "--rounds", "3", "--partition", "category", "--seed", "1", "--out", str(out),
        "--sweep-epsilon", "1", "--sweep-lambda", "0,1", "--sweep-adversarial", "0.5",
        "--sweep-modes", "tool_confusion", "--sweep-rules", "none,krum", "--label", "tiny",
        "--sweep-min-users", "1,2", "--probe-fraction", "0.05",
        verbosity=0,
    )
    document = json.loads(out.read_text())
    for section in ("results", "summary", "communication", "privacy", "per_category",
                    "privacy_sweep", "adversarial", "rounds", "config", "diagnostics"):
        assert section in document, section
    rows = document["results"]
    assert {r["method"] for r in rows} == {
        "synapse", "synapse_served", "centralized", "local_only", "local_only_public_probe", "description_only",
        "bm25", "unstructured_pool", "unstructured_pool_bypass", "fed_icl", "static_global",
        "reranker_bypass",
    }
    assert all(set(r) >= {"method", "round", "seed", "accuracy", "macro_accuracy"} for r in rows)
    synapse = sorted((r["round"], r["accuracy"]) for r in rows if r["method"] == "synapse")
    assert [r for r, _ in synapse] == [1, 2, 3]
    assert synapse[-1][1] > synapse[0][1], synapse  # accuracy rises over rounds
    by_method = {r["method"]: r for r in rows if r["round"] is None}
    assert synapse[-1][1] > by_method["local_only"]["accuracy"]
    # Centralized is computed on the same split: same seed, same test queries.
    assert by_method["centralized"]["seed"] == 1 and 0 < by_method["centralized"]["accuracy"] <= 1
    assert document["communication"]["bytes_per_client_round"] > 0
    communication = document["communication"]
    assert communication["gzip_bytes_per_client_round"] < communication["bytes_per_client_round"]
    # dcz against the schema, then against the global each client pulled, beats plain gzip.
    assert communication["dcz_bytes_per_client_round"] < communication["gzip_bytes_per_client_round"]
    assert 0 <= document["privacy"]["membership_auroc"] <= 1
    # Token overlap against its chance level: the same measure on the paired non-members (the
    # same tools' held-out requests, never sent) shares vocabulary too, so the excess is what
    # says something about leakage.
    privacy = document["privacy"]
    assert 0 < privacy["token_overlap_nonmember"] < privacy["token_overlap"]
    assert privacy["token_overlap_excess"] == pytest.approx(  # each rounded to 4 places
        privacy["token_overlap"] - privacy["token_overlap_nonmember"], abs=2e-4)
    assert 0 <= privacy["share_clients_excess_below_0_10"] <= 1
    # Where it ran: int8 embeddings differ slightly between instruction sets.
    assert document["host"]["cpu"] and isinstance(document["host"]["isa"], list)
    assert document["host"]["onnxruntime"] and document["host"]["python"].count(".") == 2
    assert len(document["host"]["embedding_fingerprint"]) == 16
    assert len(document["privacy_sweep"]) == 2 and len(document["adversarial"]) == 2
    anonymous = {row["min_users"]: row for row in document["release_sweep"]}
    assert anonymous[2]["bytes_per_client_round"] < anonymous[1]["bytes_per_client_round"]
    stored = SimulationRun.objects.get(label="tiny")
    assert stored.document["summary"] == document["summary"]
    # Every federation of the run and its sweeps closed its rounds through the services, in a
    # scratch database: the operator's has the stored run and nothing else.
    assert document["config"]["through_services"]
    assert not Round.objects.exists() and not Client.objects.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--rounds", "0"], "^--rounds must be at least 1, not 0$"),
    (["--queries-per-client", "-5"], "^--queries-per-client must be at least 1, not -5$"),
])
def test_demo_rounds_refuse_a_count_below_one(tiny_dataset, flags, message):
    """'--rounds 0' answered '0 rounds are already published; nothing to do'."""
    with pytest.raises(CommandError, match=message):
        call_command("demo_rounds", "--dataset", str(tiny_dataset), *flags)


@pytest.mark.django_db(transaction=True)
def test_demo_rounds_publish_through_the_real_pipeline(tiny_dataset):
    from compendium.models import CompendiumVersion, NumericField
    from federation.models import ConflictLogEntry, PrivacyLedgerEntry, Round, Submission
    from federation.services import bootstrap_demo_federation

    call_command("import_tools", str(tiny_dataset), verbosity=0)
    bootstrap_demo_federation()
    out = io.StringIO()
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "2",
                 "--queries-per-client", "30", stdout=out)
    logged = ConflictLogEntry.objects.filter(round__number__in=[1, 2]).count()
    # A client with nothing new (everything covered, no statistic the round releases) sends
    # nothing, as participate does.
    submitted = Submission.objects.filter(round__number__in=[1, 2]).count()
    assert out.getvalue().strip() == (
        f"demo rounds: published rounds 1, 2 from {submitted} submissions; {logged} conflict(s) "
        "logged for review; a new round is open"
    )
    published = Round.objects.filter(state="published").order_by("number")
    assert [r.number for r in published] == [1, 2]
    assert Round.objects.filter(state="open").count() == 1
    for rnd in published:
        assert 0 < CompendiumVersion.objects.filter(kind="client", round=rnd).count() <= 24
        glob = CompendiumVersion.objects.get(kind="global", round=rnd)
        assert glob.entry_counts["scenarios"] > 0
        # Sent as `synapse-client submit --since` sends: dcz, read back by the server's decoder.
        sent = Submission.objects.filter(round=rnd)
        assert {s.content_encoding for s in sent} == {"dcz"}
        assert all(0 < s.wire_bytes < s.version.size_bytes for s in sent)
    # The demo's eight clients an organization, field cap and ε = 2 let the edges release every
    # field with noise narrower than its clipping window, so the privacy ledger a new user opens
    # has rows; with two clients an edge no field would be released (noise 2.3 times the window).
    fields = set(NumericField.objects.values_list("name", flat=True))
    for rnd in published:
        assert rnd.config["field_cap"] == 1 and rnd.config["epsilon"] == 2.0
        assert rnd.fields_not_released == []
        released = PrivacyLedgerEntry.objects.filter(round=rnd)
        assert released.exists() and set(released.values_list("field", flat=True)) == fields
        for entry in released:
            assert entry.noise_scale < entry.sensitivity  # narrower than the window
    spent = PrivacyLedgerEntry.objects.count()
    # Restarting the demo spends no more budget.
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "2")
    assert Round.objects.filter(state="published").count() == 2
    assert PrivacyLedgerEntry.objects.count() == spent


@pytest.mark.django_db(transaction=True)
def test_demo_rounds_stopped_midway_resume_where_they_stopped(tiny_dataset):
    """A demo stopped after its first round played every round again when restarted (3 asked
    for, 4 published), spending privacy budget on a round nobody asked for."""
    from federation.models import Round
    from federation.services import bootstrap_demo_federation

    call_command("import_tools", str(tiny_dataset), verbosity=0)
    bootstrap_demo_federation()
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "1",
                 "--queries-per-client", "30", stdout=io.StringIO())
    out = io.StringIO()
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "2",
                 "--queries-per-client", "30", stdout=out)
    assert out.getvalue().startswith("demo rounds: published rounds 2 from "), out.getvalue()
    assert [r.number for r in Round.objects.filter(state="published").order_by("number")] == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_demo_rounds_merge_again_a_round_a_stopped_demo_left_merging(tiny_dataset, monkeypatch):
    """A demo stopped (Ctrl-C) during a round's merge leaves it merging, and without a broker
    nothing moves it on. The restarted demo opened and published the next round past it: the
    stuck round kept its privacy reservation for good (a round's ε committed twice, against the
    README's "no round's ε is spent twice") and could never be retried (a later round was
    published). The demo now fails it and merges it again, as the operator would."""
    from federation import demo
    from federation.models import AuditLog
    from federation.services import bootstrap_demo_federation

    call_command("import_tools", str(tiny_dataset), verbosity=0)
    bootstrap_demo_federation()
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "1",
                 "--queries-per-client", "30", stdout=io.StringIO())

    def stopped_during_the_merge(actor, rnd):  # round 2's submissions are in; then Ctrl-C
        Round.objects.filter(pk=rnd.pk).update(state=Round.State.MERGING)
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(demo, "close_round", stopped_during_the_merge)
        with pytest.raises(KeyboardInterrupt):
            call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "3",
                         "--queries-per-client", "30", stdout=io.StringIO())
    assert Round.objects.get(number=2).state == "merging"

    out = io.StringIO()
    call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "2",
                 "--queries-per-client", "30", stdout=out)
    assert out.getvalue().startswith("demo rounds: published rounds 2 from 0 submissions"), (
        out.getvalue())
    assert list(Round.objects.order_by("number").values_list("number", "state")) == [
        (1, "published"), (2, "published"), (3, "open")]
    assert AuditLog.objects.filter(action=AuditLog.Action.ROUND_RETRY,
                                   target_id=str(Round.objects.get(number=2).pk)).count() == 1


def test_demo_rounds_with_a_broker_stop_at_a_round_left_merging(tiny_dataset, settings):
    """With a broker a worker may still be merging the round: the demo says so and changes
    nothing."""
    from federation.models import ProbeQuery
    from federation.services import bootstrap_demo_federation

    settings.CELERY_TASK_ALWAYS_EAGER = False
    call_command("import_tools", str(tiny_dataset), verbosity=0)
    bootstrap_demo_federation()  # opens round 1
    Round.objects.filter(number=1).update(state=Round.State.MERGING)
    with pytest.raises(CommandError, match=r"^round 1 is merging: wait for its merge .*retry_round 1"):
        call_command("demo_rounds", "--dataset", str(tiny_dataset), "--rounds", "1",
                     "--queries-per-client", "30", stdout=io.StringIO())
    assert list(Round.objects.values_list("number", "state")) == [(1, "merging")]
    assert not ProbeQuery.objects.exists()


def test_clients_send_only_what_changed_when_the_global_is_carried_forward(tiny_dataset):
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    schema = Schema(tools=dataset.tools)
    results = {}
    for carry in (True, False):
        # Without carrying forward, and with the routing rule off, clients send everything.
        config = SimulationConfig(orgs=2, clients_per_org=2, rounds=3, baselines=False,
                                  carry_forward=carry, since_confidence=0.8 if carry else 1.01)
        result = Simulation(dataset, schema, get_engine(), config).run_seed(1)
        results[carry] = result
    delta, full = results[True], results[False]
    # Round 1 leaves out what the probe set's router already routes; afterwards a client sends
    # less than its whole compendium.
    assert delta.communication["bytes_round_1"] < full.communication["bytes_round_1"]
    assert delta.communication["bytes_round_3"] < full.communication["bytes_round_3"]
    assert delta.communication["bytes_per_client_round"] < full.communication["bytes_per_client_round"]
    # ...and the global keeps what earlier rounds taught it: no accuracy is lost.
    last = {c: [r["accuracy"] for r in res.rows if r["method"] == "synapse"][-1]
            for c, res in results.items()}
    assert last[True] >= last[False] - 0.05, last


def test_a_byte_budget_holds_each_honest_submission(tiny_dataset):
    from compendium.canonical import canonical_bytes

    free = _simulation(tiny_dataset, rounds=3)
    setup = free.prepare(1)
    unbounded = free.federate(setup.shares, setup.logs, setup.split.probe, 1)
    first = min(unbounded[0].bytes_raw)
    budget = max(first // 2, 600)
    bounded = _simulation(tiny_dataset, rounds=3, max_bytes=budget)
    outcomes = bounded.federate(setup.shares, setup.logs, setup.split.probe, 1)
    for outcome in outcomes:
        for client, sent in outcome.submissions.items():
            size = len(canonical_bytes(sent))
            statistics = len(canonical_bytes(sent.model_copy(update={"scenarios": [], "precautions": []})))
            assert size <= max(budget, statistics), (outcome.round, client, size)
    assert sum(outcomes[0].bytes_raw) < sum(unbounded[0].bytes_raw)



def test_a_client_with_nothing_to_submit_is_neither_measured_nor_counted(tiny_dataset):
    """A client whose pulled global already routes everything it has sends nothing (as
    `participate`, the services and the in-memory merges): the bytes per client per round average
    the bodies sent (the rounds a client sends in, as the dashboard says), not an empty
    compendium's 170 bytes for a client that sent none, and the screening counts the
    submissions made."""
    import numpy as np

    from compendium.canonical import canonical_bytes
    from compendium.client_api import nothing_to_submit
    from federation.simulation.runner import communication, screening

    simulation = _simulation(tiny_dataset, rounds=3, diagnostics=False)
    outcomes = simulation.play(simulation.prepare(1), 1)
    bodies = {o.round: [len(canonical_bytes(c)) for c in o.submissions.values()
                        if not nothing_to_submit(c)] for o in outcomes}
    sent = sum(map(len, bodies.values()))
    assert 0 < sent < sum(len(o.submissions) for o in outcomes)  # some client had nothing new
    figures = communication(outcomes)
    assert figures["bytes_per_client_round"] == pytest.approx(
        np.mean([b for sizes in bodies.values() for b in sizes]))
    for round_, sizes in bodies.items():
        assert figures[f"bytes_round_{round_}"] == pytest.approx(np.mean(sizes or [0]))
    assert screening(outcomes, set())["honest_submissions"] == sent

def test_what_the_byte_budget_deferred_is_offered_again_in_a_later_round(tiny_dataset, monkeypatch):
    """A client's record of what it sent holds what it sent, not what it built: an entry the byte
    budget left out of round 1 is not "already sent", so a later round offers it again."""
    from compendium.delta import sent_keys
    from compendium.schema import Compendium
    from federation.simulation import runner

    free = _simulation(tiny_dataset, rounds=3)
    setup = free.prepare(1)
    unbounded = free.federate(setup.shares, setup.logs, setup.split.probe, 1)
    first_round = len(unbounded[0].submissions)
    calls = []

    def defer_round_1(compendium, max_bytes):  # round 1's budget defers every entry
        calls.append(max_bytes)
        if len(calls) <= first_round:
            compendium = compendium.model_copy(update={"scenarios": [], "precautions": []})
        return compendium, None

    monkeypatch.setattr(runner, "fit_budget", defer_round_1)
    outcomes = _simulation(tiny_dataset, rounds=3, max_bytes=10**9).federate(
        setup.shares, setup.logs, setup.split.probe, 1)
    assert not any(sent.scenarios for sent in outcomes[0].submissions.values())
    offered_again = {
        client: sent_keys(built) & set().union(
            *(sent_keys(o.submissions.get(client, Compendium())) for o in outcomes[1:]))
        for client, built in unbounded[0].submissions.items()
    }
    assert any(offered_again.values()), offered_again


# --- transfer: the final global compendium under other models, rerankers and LLMs -------------

FP32 = "bundled:all-MiniLM-L6-v2"
ONNX = "onnx-int8:all-MiniLM-L6-v2"  # another engine of the same family (fp32 compute, onnxruntime)


def _simulation(tiny_dataset, **changes):
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    config = SimulationConfig(**{"orgs": 2, "clients_per_org": 2, "rounds": 2, "baselines": False,
                                 **changes})
    return Simulation(dataset, Schema(tools=dataset.tools), get_engine(FP32), config)


def test_transfer_rows_match_a_freshly_fitted_router_on_the_final_global(tiny_dataset):
    import numpy as np

    from compendium.canonical import canonical_bytes
    from routing.embeddings import get_engine
    from routing.router import fit_router

    sim = _simulation(tiny_dataset, transfer_models=(FP32, ONNX), transfer_rerankers=("none", "fusion"))
    result = sim.run_seed(1)
    rows = result.transfer
    assert [(r["model"], r["reranker"]) for r in rows] == [
        (FP32, "none"), (FP32, "fusion"), (ONNX, "none"), (ONNX, "fusion")]
    setup = sim.prepare(1)
    for r in rows:
        assert r["seed"] == 1 and r["llm"] is None and r["fallbacks"] == 0
        assert r["queries"] == len(setup.test)
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["macro_accuracy"] <= 1
    by = {(r["model"], r["reranker"]): r for r in rows}
    # The simulation's own engine with fusion is the last round's SYNAPSE figure: same artifact.
    synapse = [r for r in result.rows if r["method"] == "synapse"][-1]
    assert by[(FP32, "fusion")]["accuracy"] == synapse["accuracy"]

    # Again: the same seed's final global, a router per model fitted afresh as the server fits
    # one (its linear head on the compendium and the probe split, fusion weights on the probe).
    final = sim.federate(setup.shares, setup.logs, setup.split.probe, 1, setup.adversaries)[-1]
    glob = final.global_compendium
    assert len(canonical_bytes(glob)) == result.rounds[-1]["global_size_bytes"]
    pairs = [(q.query, q.tool_id) for q in setup.split.probe]
    truth = [q.tool_id for q in setup.test]
    for model in (FP32, ONNX):
        fresh = fit_router(glob, get_engine(model), pairs, "fusion")
        decisions = fresh.route_batch([q.query for q in setup.test])
        accuracy = float(np.mean([d.tool == t for d, t in zip(decisions, truth, strict=True)]))
        assert by[(model, "fusion")]["accuracy"] == round(accuracy, 4), model
    # Transfer leaves the compendium as it was.
    before = canonical_bytes(glob)
    sim.transfer(glob, setup.split.probe, setup.test, sim.transfer_variants()[:1])
    assert canonical_bytes(glob) == before


def test_transfer_llm_reranker_over_an_openai_compatible_server(tiny_dataset):
    from federation.simulation.runner import TransferVariant
    from tests.chat_server import ChatServer

    server = ChatServer(default="1")  # always the first option: the top cosine candidate
    try:
        sim = _simulation(tiny_dataset, rounds=1, test_limit=40, transfer_rerankers=("none", "llm"),
                          llm_url=server.url, llm_model="router-model")
        variants = sim.transfer_variants()  # one request checks the endpoint
        assert len(server.requests) == 1
        setup = sim.prepare(1)
        glob = sim.federate(setup.shares, setup.logs, setup.split.probe, 1)[-1].global_compendium
        bypass, llm = sim.transfer(glob, setup.split.probe, setup.test, variants)
        assert llm["reranker"] == "llm" and llm["fallbacks"] == 0 and llm["queries"] == 40
        assert llm["llm"].endswith(f"{server.url}/v1") and "router-model" in llm["llm"]
        assert bypass["llm"] is None
        # The LLM picked the top cosine candidate every time: the bypass reranker's decisions.
        assert llm["accuracy"] == bypass["accuracy"]
        asked = server.requests[1:]
        assert len(asked) == 40 and all(r["path"] == "/v1/chat/completions" for r in asked)
        assert all(r["body"]["model"] == "router-model" for r in asked)
        # Unusable answers, or no LLM at all: every decision falls back to fusion and says so.
        server.default = "the banana one"
        garbled, fusion, without = sim.transfer(glob, setup.split.probe, setup.test, [
            variants[1], TransferVariant(None, "fusion"), TransferVariant(None, "llm", None)])
        assert garbled["fallbacks"] == 40 and without["fallbacks"] == 40 and without["llm"] is None
        assert garbled["accuracy"] == fusion["accuracy"] == without["accuracy"]
    finally:
        server.close()


def test_transfer_in_the_command_document_table_and_store(tiny_dataset, tmp_path):
    out = tmp_path / "results.json"
    stdout = io.StringIO()
    call_command(
        "simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2",
        "--rounds", "2", "--seed", "1", "--seeds", "2", "--no-baselines", "--out", str(out),
        "--transfer-models", f"{FP32},{ONNX}", "--transfer-rerankers", "none,fusion,llm", "--in-memory",
        "--label", "transfer", verbosity=0, stdout=stdout,
    )
    document = json.loads(out.read_text())
    rows = document["transfer"]
    assert len(rows) == 2 * 2 * 3 and {r["seed"] for r in rows} == {1, 2}
    assert document["config"]["transfer_rerankers"] == ["none", "fusion", "llm"]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1
        # `llm` without --llm still runs: every decision falls back to fusion, and the row says so.
        assert r["fallbacks"] == (r["queries"] if r["reranker"] == "llm" else 0)
    table = stdout.getvalue()
    assert "transfer of the final global compendium" in table
    assert sum(line.strip().startswith((FP32, ONNX)) for line in table.splitlines()) == 6
    assert SimulationRun.objects.get(label="transfer").document["transfer"] == rows


@pytest.mark.parametrize(("flags", "named"), [
    (["--transfer-models", "no-such-model-xyz"], "no-such-model-xyz"),
    (["--transfer-rerankers", "fusion,colbert"], "colbert"),
    (["--transfer-rerankers", "llm", "--llm", "http://127.0.0.1:9"], "127.0.0.1:9"),  # nothing there
])
def test_unknown_transfer_variant_fails_before_the_federation_runs(tiny_dataset, capsys, flags, named):
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--rounds", "2", "--no-baselines", *flags, verbosity=1)
    message = str(error.value)
    assert named in message and "\n" not in message
    assert "round 1" not in capsys.readouterr().err  # no federation round was started
    assert not SimulationRun.objects.exists()


def test_baselines_under_a_cadence_whose_last_round_does_not_aggregate_are_refused(tiny_dataset):
    """The baselines are built from the last round's client compendiums: a last round that does
    not aggregate has none, and Local-only and the pool scored 0.0 without a word."""
    with pytest.raises(CommandError, match="round 2, the last, does not aggregate"):
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--rounds", "2", "--aggregate-every", "0", verbosity=0)
    assert not SimulationRun.objects.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-bytes", "0"], "--max-bytes must be a positive number of bytes, not 0"),
    (["--shared-word-users", "1"], "--shared-word-users must be 0 [(]off[)] or at least 2"),
    (["--max-words", "-1"], "--max-words must be 0 [(]whole requests[)] or at least 1, not -1"),
    (["--pool-users", "0"], "--pool-users must be at least 1"),
    (["--pool-users", "2", "--pool-size", "-1"], "--pool-size must be 0 [(]--pool-users[)] or more"),
])
def test_bad_client_options_are_refused_before_anything_runs(tiny_dataset, capsys, flags, message):
    with pytest.raises(CommandError, match=message):
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--rounds", "2", "--no-baselines", *flags, verbosity=1)
    assert "round 1" not in capsys.readouterr().err
    assert not SimulationRun.objects.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--rounds", "0"], "--rounds must be at least 1, not 0"),
    (["--seeds", "0"], "--seeds must be at least 1, not 0"),
    (["--test-limit", "0"], "--test-limit must be at least 1, not 0"),
    (["--adversarial-fraction", "1.5"], r"--adversarial-fraction must be in \[0, 1\], not 1\.5"),
    (["--camouflage-share", "-0.1"], r"--camouflage-share must be in \[0, 1\], not -0\.1"),
    (["--lambda", "-1"], "^--lambda: Input should be greater than or equal to 0$"),
    (["--epsilon", "0"], "^--epsilon: Input should be greater than or equal to"),
    # A sweep's bad value is refused before the main run, not after it.
    (["--sweep-lambda", "1,-1"], "^--sweep-lambda: Input should be greater than or equal to 0$"),
    (["--sweep-adversarial", "0.4", "--sweep-rules", "krum,median"], "^--sweep-rules: Input should be"),
    (["--sweep-adversarial", "0.4", "--sweep-modes", "nope"], "--sweep-modes: unknown nope; choose from"),
    (["--sweep-adversarial", "1.2"], "--sweep-adversarial: every fraction must be in"),
    # A flag for something the run does not have was silently ignored.
    (["--sweep-modes", "nope"], "^--sweep-modes applies only with --sweep-adversarial FRACTIONS; "),
    (["--sweep-rules", "krum"], "^--sweep-rules applies only with --sweep-adversarial FRACTIONS; "),
    (["--adversarial-mode", "tool_confusion"],
     "^--adversarial-mode applies only with --adversarial-fraction above 0; "),
    (["--camouflage-share", "0.5"], "^--camouflage-share applies only with adversaries of a camouflaged mode"),
    (["--camouflage-share", "0.5", "--adversarial-fraction", "0.4", "--adversarial-mode", "tool_confusion",
      "--sweep-adversarial", "0.2", "--sweep-modes", "cross_source"],
     "^--camouflage-share applies only with adversaries of a camouflaged mode"),
    (["--pool-size", "4"], "^--pool-size applies only with --pool-users 2 or more; "),
    (["--llm-model", "smollm2"], "^--llm-model applies only with --llm URL; "),
    # An endpoint nothing in the run asks: the run did not use what the user pointed at.
    (["--llm", "http://127.0.0.1:9/v1"], "^--llm applies only with an LLM summarizer [(]--summarizer "
     "or --sweep-summarizers llm-single-shot or textgrad[)] or --transfer-rerankers llm; "),
    (["--llm", "http://127.0.0.1:9/v1", "--llm-model", "smollm2", "--transfer-rerankers", "none,fusion",
      "--sweep-summarizers", "centroid,none"], "^--llm applies only with an LLM summarizer"),
    # f of a robust rule, where no merge applies one.
    (["--trim-fraction", "0.2"], "^--trim-fraction applies only with a robust rule [(]--robust-rule "
     "or --sweep-rules with --sweep-adversarial[)]; "),
    (["--trim-fraction", "0.2", "--sweep-adversarial", "0.4", "--sweep-rules", "none"],
     "^--trim-fraction applies only with a robust rule"),
    # Pooling takes the place of the clients' near-duplicate collapse, whose threshold it is.
    (["--client-tau", "0.9", "--pool-users", "2"],
     "^--client-tau applies only with the clients' near-duplicate collapse [(]--pool-users 1[)]; "),
    # No drift event within the rounds: the drift was silently none.
    (["--drift-every", "3", "--rounds", "3"],
     "^--drift-every 3: the first categories would come into use at round 4, after --rounds 3"),
    # An unknown transfer reranker is named before the dataset and the model load.
    (["--transfer-rerankers", "fusion,bm25"], "^--transfer-rerankers: unknown bm25; choose from "),
    # The simulation's own routers are never given an LLM: every decision fell back to fusion,
    # and the run was stored as the LLM reranker's.
    (["--reranker", "llm"], "^--reranker llm: the simulation's own routers have no LLM"),
    (["--reranker", "llm", "--llm", "http://127.0.0.1:9/v1"], "^--reranker llm: the simulation's own routers have no LLM"),
    # A value a sweep lists twice: its row was played (or reused) and stored twice.
    (["--sweep-epsilon", "1,1,2"], "^--sweep-epsilon lists 1 twice: give each value once$"),
    (["--sweep-lambda", "0.5,1,0.50"], "^--sweep-lambda lists 0.5 twice [(]again as 0.50[)]: "),
    (["--sweep-tau", "0.8,0.9,0.8"], "^--sweep-tau lists 0.8 twice: "),
    (["--sweep-adversarial", "0.5,0.5"], "^--sweep-adversarial lists 0.5 twice: "),
    (["--sweep-adversarial", "0.5", "--sweep-modes", "tool_confusion,tool_confusion"],
     "^--sweep-modes lists tool_confusion twice: "),
    (["--sweep-adversarial", "0.5", "--sweep-rules", "krum,none,krum"], "^--sweep-rules lists krum twice: "),
    (["--sweep-min-users", "1,2,1"], "^--sweep-min-users lists 1 twice: "),
    (["--sweep-contradictions", "0,0.2,0"], "^--sweep-contradictions lists 0 twice: "),
    (["--sweep-cadence", "1,01"], "^--sweep-cadence lists 1 twice [(]again as 01[)]: "),
    (["--sweep-summarizers", "centroid,none,centroid"], "^--sweep-summarizers lists centroid twice: "),
    (["--transfer-rerankers", "fusion,fusion"], "^--transfer-rerankers lists fusion twice: "),
    (["--transfer-models", "bundled:all-MiniLM-L6-v2,bundled:all-MiniLM-L6-v2"],
     "^--transfer-models lists bundled:all-MiniLM-L6-v2 twice: "),
    # A contradiction comes from another client of the same organization: with one client per
    # organization none was injected, and the rows were those of share 0.
    (["--clients-per-org", "1", "--contradiction-fraction", "0.4"],
     "^--contradiction-fraction 0.4 needs 2 or more --clients-per-org"),
    (["--clients-per-org", "1", "--sweep-contradictions", "0,0.4"],
     "^--sweep-contradictions 0.4 needs 2 or more --clients-per-org"),
    # A list flag given nothing but commas, or the adversarial sweep's modes or rules emptied:
    # the sweep was silently none.
    (["--sweep-tau", ","], "^--sweep-tau: expected comma-separated numbers, got ','$"),
    (["--sweep-adversarial", " , "], "^--sweep-adversarial: expected comma-separated numbers, got ' , '$"),
    (["--sweep-adversarial", "0.5", "--sweep-rules", ""], "^--sweep-rules: expected names, got ''$"),
    (["--sweep-adversarial", "0.5", "--sweep-modes", ","], "^--sweep-modes: expected names, got ','$"),
    (["--sweep-min-users", "0"], "--sweep-min-users: every k must be at least 1"),
    (["--sweep-min-users", "nan"], "^--sweep-min-users: expected whole numbers, got 'nan'$"),
    (["--sweep-min-users", "inf"], "^--sweep-min-users: expected whole numbers, got 'inf'$"),
    (["--sweep-min-users", "1,1.5"], "^--sweep-min-users: expected whole numbers, got '1.5'$"),
    (["--sweep-cadence", "1,2.5"], "^--sweep-cadence: expected whole numbers, got '2.5'$"),
    (["--contradiction-fraction", "1.5"], r"^--contradiction-fraction must be in \[0, 1\], not 1\.5$"),
    (["--contradiction-fraction", "nan"], r"^--contradiction-fraction must be in \[0, 1\], not nan$"),
    (["--sweep-contradictions", "0,0.2,2"], r"^--sweep-contradictions: every share must be in \[0, 1\]$"),
    # A list of numbers that holds something else is refused naming its flag.
    (["--sweep-tau", "0.8,abc"], "^--sweep-tau: expected comma-separated numbers, got 'abc'$"),
    (["--sweep-epsilon", "1;2"], "^--sweep-epsilon: expected comma-separated numbers, got '1;2'$"),
    (["--sweep-lambda", "x"], "^--sweep-lambda: expected comma-separated numbers, got 'x'$"),
    (["--sweep-adversarial", "0.2,a"], "^--sweep-adversarial: expected comma-separated numbers, got 'a'$"),
    (["--sweep-contradictions", "0,b"], "^--sweep-contradictions: expected comma-separated numbers, got 'b'$"),
    (["--since-confidence", "inf"], "^--since-confidence must be a finite number, at least 0, not inf$"),
    (["--since-confidence", "nan"], "^--since-confidence must be a finite number, at least 0, not nan$"),
    (["--since-confidence", "-0.5"], "^--since-confidence must be a finite number, at least 0, not -0.5$"),
    (["--orgs", "0"], "^--orgs must be at least 1, not 0$"),
    (["--clients-per-org", "-2"], "^--clients-per-org must be at least 1, not -2$"),
    (["--tune-router", "-1"], "^--tune-router must be at least 0, not -1$"),
    (["--seed", str(2**63 - 2), "--seeds", "3"], "^the last seed [(]--seed [+] --seeds - 1[)] must be below 2[*][*]63"),
    # Thresholds more distinct users than a client has: nothing would ever be released.
    (["--min-users", "4"], "^--min-users 4 is more than --users-per-client 3: no client could release"),
    (["--pool-users", "5", "--users-per-client", "4"], "^--pool-users 5 is more than --users-per-client 4"),
    (["--sweep-min-users", "1,4"], "^--sweep-min-users 4 is more than --users-per-client 3"),
    (["--users-per-client", "1"], "^--shared-word-users 2 is more than --users-per-client 1: "
     "no client has that many users to share a word"),
    (["--shared-word-users", "4"], "^--shared-word-users 4 is more than --users-per-client 3"),
    # Cadences that aggregate in the same rounds: one federation, played and stored twice.
    (["--sweep-cadence", "1,5", "--rounds", "1", "--no-baselines"],
     "^--sweep-cadence 1 and 5 both aggregate in round 1 alone of --rounds 1: the same federation"),
    (["--sweep-cadence", "0,1,5", "--rounds", "3", "--no-baselines"],
     "^--sweep-cadence 0 and 5 both aggregate in round 1 alone of --rounds 3"),
    (["--sweep-cadence", "2,3,4", "--rounds", "3", "--no-baselines"],
     "^--sweep-cadence 3 and 4 both aggregate in round 1 alone of --rounds 3"),
    # A share that rounds to no adversarial client (4 clients: 0.4 of one rounds to 0).
    (["--orgs", "2", "--clients-per-org", "2", "--adversarial-fraction", "0.1"],
     r"^--adversarial-fraction 0\.1 of 4 clients is no adversarial client \(it rounds to 0\); use 0 or a share above 0\.125$"),
    (["--orgs", "2", "--clients-per-org", "2", "--sweep-adversarial", "0,0.1,0.5"],
     "^--sweep-adversarial 0.1 of 4 clients is no adversarial client"),
])
def test_bad_run_and_sweep_options_are_refused_by_their_flag_before_the_data_loads(flags, message):
    """The dataset named does not exist: each refusal came first, naming the flag, in one line
    (a sweep's bad value used to surface after the main run, a bad λ as pydantic's report)."""
    with pytest.raises(CommandError, match=message) as error:
        call_command("simulate", "--dataset", "/no/such/dataset", "--no-store", *flags)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags", [
    ["--camouflage-share", "0.5", "--sweep-adversarial", "0.4", "--sweep-modes", "camouflaged_poisoning"],
    ["--camouflage-share", "0.5", "--adversarial-fraction", "0.4", "--adversarial-mode",
     "coordinated_camouflage"],
    ["--sweep-adversarial", "0.4", "--sweep-rules", "krum", "--sweep-modes", "tool_confusion"],
    ["--adversarial-fraction", "0.4", "--adversarial-mode", "tool_confusion"],
    ["--pool-users", "2", "--pool-size", "4"],
    ["--llm", "http://127.0.0.1:9/v1", "--llm-model", "smollm2", "--transfer-rerankers", "llm"],
    ["--llm", "http://127.0.0.1:9/v1", "--summarizer", "llm-single-shot"],
    ["--llm", "http://127.0.0.1:9/v1", "--sweep-summarizers", "centroid,textgrad"],
    ["--client-tau", "0.9", "--pool-users", "1"],
    ["--trim-fraction", "0.2", "--robust-rule", "krum"],
    ["--clients-per-org", "2", "--contradiction-fraction", "0.4", "--sweep-contradictions", "0,0.4"],
    ["--clients-per-org", "1", "--sweep-contradictions", "0"],
    ["--trim-fraction", "0.2", "--sweep-adversarial", "0.4", "--sweep-rules", "none,trimmed-mean"],
    ["--users-per-client", "1", "--shared-word-users", "0"],
    ["--sweep-cadence", "1,5,0", "--drift-every", "3", "--rounds", "10", "--no-baselines"],
])
def test_flags_that_apply_to_the_run_pass_the_checks(flags):
    """The other side of the refusals above: where the run has what a flag applies to, the
    checks let it through (the first problem is then the dataset that does not exist)."""
    with pytest.raises(CommandError, match="^/no/such/dataset: no such file or folder$"):
        call_command("simulate", "--dataset", "/no/such/dataset", "--no-store", *flags)


def test_unless_stored_skips_only_a_run_of_the_same_label(tiny_dataset, capsys):
    from federation.services import store_simulation_run

    store_simulation_run({"dataset": "tiny", "config": {}, "results": []}, label="demo v1")
    flags = ["--dataset", str(tiny_dataset), "--unless-stored", "--min-users", "0"]
    call_command("simulate", *flags, "--label", "demo v1")  # stored: nothing runs, nothing checked
    assert "labelled 'demo v1' is stored already" in capsys.readouterr().out
    # Another label goes on (and so meets the bad option), as does no label with nothing stored.
    with pytest.raises(CommandError, match="--min-users must be at least 1"):
        call_command("simulate", *flags, "--label", "demo v2")
    SimulationRun.objects.all().delete()
    with pytest.raises(CommandError, match="--min-users must be at least 1"):
        call_command("simulate", *flags)


def test_the_edges_drop_relabelling_clients_whole_and_spare_honest_ones(tiny_dataset):
    """Half the clients relabel their requests at random: the edges' implausible-source check
    drops their submissions whole, no honest one, and the counts reach the sweep rows."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.report import sweep
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    schema = Schema(tools=dataset.tools)
    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=3, baselines=False,
                              diagnostics=False)

    def make(cfg):
        return Simulation(dataset, schema, get_engine(), cfg)

    [row] = sweep(make, config, [{"adversarial_fraction": 0.5,
                                  "adversarial_mode": "tool_confusion"}], [1])
    assert row["adversarial_submissions"] == 6 and row["honest_submissions"] == 6
    assert row["dropped_honest"] == 0
    assert row["dropped_adversarial"] == 6
    # Relabelled at random over 8 tools: most of what they sent carries another tool.
    assert 0.6 * row["adversarial_scenarios"] < row["relabelled_adversarial_scenarios"] \
        <= row["adversarial_scenarios"]
    clean = make(config).run_seed(1).screening
    # 4 clients x 3 rounds, of which 3 had nothing new to send and sent nothing.
    assert clean == {"honest_submissions": 9, "dropped_honest": 0, "adversarial_submissions": 0,
                     "dropped_adversarial": 0, "robust_dropped_honest": 0,
                     "robust_dropped_adversarial": 0, "adversarial_scenarios": 0,
                     "relabelled_adversarial_scenarios": 0}


@pytest.mark.parametrize("share", [0.3, 0.5])
def test_a_camouflaged_adversary_relabels_that_share_of_every_submission(tiny_dataset, share):
    """The client rules leave home what the pulled global already routes to its tool, which a
    relabelled entry never is: the camouflaged adversary relabels a share of what it would send
    honestly, so that share holds in every round, not only in what it built."""
    from federation.simulation.runner import _relabelled

    sim = _simulation(tiny_dataset, rounds=3, adversarial_fraction=0.5,
                      adversarial_mode="camouflaged_poisoning", camouflage_share=share)
    setup = sim.prepare(1)
    outcomes = sim.federate(setup.shares, setup.logs, setup.split.probe, 1, setup.adversaries)
    checked = 0
    for outcome in outcomes:
        for client in setup.adversaries:
            sent = outcome.submissions.get(client)
            if sent is None or not sent.scenarios:
                continue
            honest = outcome.client_compendiums[client]
            assert outcome.relabelled[client] == _relabelled(honest, sent) \
                == round(share * len(sent.scenarios)), (outcome.round, client)
            assert all(s.support == 50 for s in sent.scenarios
                       if s.tool_id not in {h.tool_id for h in honest.scenarios if h.text == s.text})
            checked += 1
    assert checked >= 3
    assert sum(o.relabelled.get(c, 0) for o in outcomes for c in o.submissions) > 0
    # Honest clients are not counted.
    assert all(c in setup.adversaries for o in outcomes for c in o.relabelled)


def test_adversarial_modes_are_schema_valid_and_camouflage_poisons_only_a_share():
    from compendium.schema import Compendium, Schema, ToolSpec
    from compendium.validation import validate_compendium
    from federation.simulation.runner import (
        ADVERSARIAL_MODES,
        CAMOUFLAGE_SHARE,
        coordinated_poison,
        corrupt,
        plant,
    )

    schema = Schema(tools=[ToolSpec(tool_id=f"t{i}", name=f"t{i}", description=f"tool {i}")
                           for i in range(40)])
    honest = Compendium.model_validate(
        {"scenarios": [{"tool_id": "t0", "text": f"request number {i} for the first tool"}
                       for i in range(20)]}
    )
    for mode in ADVERSARIAL_MODES:
        if mode == "coordinated_camouflage":  # plants what the adversaries agreed on
            sent, _ = plant(honest, coordinated_poison([honest], [], "t5", ["t0"]), CAMOUFLAGE_SHARE)
        else:
            sent = corrupt(honest, mode, schema, seed=3)
        assert validate_compendium(sent.model_dump(mode="json", exclude_none=True), schema).ok, mode
    camouflaged = corrupt(honest, "camouflaged_poisoning", schema, seed=3).scenarios
    relabelled = [s for s in camouflaged if s.tool_id != "t0"]
    kept = [s for s in camouflaged if s.tool_id == "t0" and s.support == 1]
    # Every text still sent; exactly the share relabelled, each to another tool, with support 50.
    assert [s.text for s in camouflaged] == [s.text for s in honest.scenarios]
    assert len(relabelled) == round(CAMOUFLAGE_SHARE * 20) == 6
    assert all(s.support == 50 for s in relabelled) and len(kept) == 14
    # Another client or round (salt) draws other scenarios; the share is the caller's.
    other = corrupt(honest, "camouflaged_poisoning", schema, seed=3, salt="c2|2").scenarios
    assert [s.tool_id for s in other] != [s.tool_id for s in camouflaged]
    half = corrupt(honest, "camouflaged_poisoning", schema, seed=3, share=0.5).scenarios
    assert sum(s.tool_id != "t0" for s in half) == 10


def test_coordinated_adversaries_plant_the_same_few_entries_among_honest_ones():
    """Coordinated camouflage: colluders pool their requests of the victim tools, order them one
    way they all share, and each adds the head of that list, labelled with the target, to what
    it would send honestly; the first entries are identical across adversaries (as many sources
    as adversaries). Without requests of the victims among them, the public probe set's."""
    from compendium.registry import LabelledQuery
    from compendium.schema import Compendium
    from federation.simulation.runner import coordinated_poison, plant

    def comp(tool, texts):
        return Compendium.model_validate(
            {"scenarios": [{"tool_id": tool, "text": t} for t in texts]})

    a = comp("v1", [f"victim request {i}" for i in range(6)])
    b = comp("v2", [f"other victim request {i}" for i in range(4)])
    c = comp("x", [f"unrelated request {i}" for i in range(10)])
    poison = coordinated_poison([a, b, c], [], "target", ["v1", "v2"])
    assert sorted(p.text for p in poison) == sorted(
        [f"victim request {i}" for i in range(6)] + [f"other victim request {i}" for i in range(4)])
    assert all(p.tool_id == "target" and p.support == 20 for p in poison)
    assert coordinated_poison([c, b, a], [], "target", ["v1", "v2"]) == poison  # one shared order

    planted, added = plant(c, poison, 0.3)
    assert added == 3 and planted.scenarios[:10] == c.scenarios
    assert [s.text for s in planted.scenarios[10:]] == [p.text for p in poison[:3]]
    other, _ = plant(b, poison, 0.3)  # another adversary: the same first entries
    assert [s for s in other.scenarios if s.tool_id == "target"] == poison[:1]
    # An adversary holding a planted text under its victim tool leaves that entry out.
    own, added = plant(a, poison, 1.0)
    assert added == 6 and len({s.text for s in own.scenarios}) == len(own.scenarios)
    planted_texts = {p.text for p in poison[:6]}
    assert planted_texts & {s.text for s in a.scenarios}  # it held some of them under v1
    assert all(s.tool_id == "target" for s in own.scenarios if s.text in planted_texts)
    assert plant(Compendium(), poison, 0.3)[1] == 1  # at least one

    probe = [LabelledQuery(qid="p1", query="public victim request", tool_id="v1"),
             LabelledQuery(qid="p2", query="public other request", tool_id="x")]
    assert [p.text for p in coordinated_poison([c], probe, "target", ["v1"])] == [
        "public victim request"]


def test_coordinated_camouflage_runs_through_a_federation_and_counts_its_aim(tiny_dataset):
    """In a federation, every adversary sends its honest entries plus the planted ones, the
    same texts as the other adversaries' in that round; every run reports how many of the
    victim tools' test queries the final global routes to the target, and the sweep rows carry
    it."""
    from federation.simulation.report import PlayedRuns, sweep
    from federation.simulation.runner import Simulation, attack_target

    sim = _simulation(tiny_dataset, rounds=2, adversarial_fraction=0.5,
                      adversarial_mode="coordinated_camouflage", camouflage_share=0.3,
                      diagnostics=False)
    setup = sim.prepare(1)
    target, victims = attack_target(sim.dataset.tools, 1)
    assert victims and target not in victims
    outcomes = sim.federate(setup.shares, setup.logs, setup.split.probe, 1, setup.adversaries)
    for outcome in outcomes:
        planted = {}
        for client in setup.adversaries:
            sent = outcome.submissions.get(client)
            if sent is None:
                continue
            honest = {(s.tool_id, s.text) for s in outcome.client_compendiums[client].scenarios}
            extra = [s for s in sent.scenarios if (s.tool_id, s.text) not in honest]
            assert extra and all(s.tool_id == target and s.support == 20 for s in extra)
            assert outcome.relabelled[client] == len(extra)
            texts = [s.text for s in sent.scenarios]
            assert len(set(texts)) == len(texts)  # never on both sides of its own claim
            planted[client] = [s.text for s in extra]
        assert len(planted) == 2
        first = [texts[0] for texts in planted.values()]
        assert len(set(first)) == 1, outcome.round  # identical across the adversaries

    played = PlayedRuns()
    [result] = played.results(sim, [1])
    victim_tests = [q for q in setup.test_at(2, sim.category_of) if q.tool_id in victims]
    router = sim.router(outcomes[-1].global_compendium, setup.split.probe)  # deterministic
    routed = [d.tool for d in router.route_batch([q.query for q in victim_tests])]
    assert result.targeting == {"victim_queries": len(victim_tests),
                                "victims_routed_to_target": routed.count(target)}
    assert len(victim_tests) > 0

    [row] = sweep(lambda cfg: Simulation(sim.dataset, sim.schema, sim.engine, cfg), sim.config,
                  [{}], [1], played)  # the run just played, not played again
    assert (row["victim_queries"], row["victims_routed_to_target"]) == (
        len(victim_tests), routed.count(target))


def test_tool_confusion_labels_with_tools_plausibly_mistaken_for_the_right_one():
    """Tool confusion is the mistake a weaker frozen LLM makes: each scenario labelled with a tool
    of its own tool's category (`confusable_tools`), never any tool at random (that is
    schema-valid poisoning), which the implausible-source check finds far more easily."""
    from compendium.schema import Compendium, Schema, ToolSpec
    from federation.simulation.runner import corrupt

    schema = Schema(tools=[ToolSpec(tool_id=f"t{i}", name=f"t{i}", description=f"tool {i}",
                                    category=f"c{i // 4}") for i in range(40)])
    honest = Compendium.model_validate(
        {"scenarios": [{"tool_id": f"t{i % 8}", "text": f"request number {i}"} for i in range(40)]}
    )
    confused = corrupt(honest, "tool_confusion", schema, seed=3).scenarios
    category = {t.tool_id: t.category for t in schema.tools}
    assert all(c.tool_id != h.tool_id and category[c.tool_id] == category[h.tool_id]
               for c, h in zip(confused, honest.scenarios, strict=True))
    poisoned = corrupt(honest, "schema_valid_poisoning", schema, seed=3).scenarios
    assert sum(category[p.tool_id] != category[h.tool_id]
               for p, h in zip(poisoned, honest.scenarios, strict=True)) > 20


@pytest.mark.django_db(transaction=True)  # through the services: rounds without aggregation
def test_cadence_under_drift_frozen_globals_miss_the_new_categories(twin_dataset, tmp_path):
    """Half the categories come into use at round 3. Twins can be told apart only by the clients'
    experience, so a global frozen after round 1 routes the new categories' twins no better than a
    coin, while aggregating every round learns them; the frozen federation sends nothing after
    round 1 and publishes nothing new."""
    out = tmp_path / "cadence.json"
    stdout = io.StringIO()
    call_command(
        "simulate", "--dataset", str(twin_dataset), "--orgs", "2", "--clients-per-org", "2",
        "--rounds", "4", "--drift-every", "2", "--seed", "1", "--no-baselines", "--no-diagnostics",
        "--sweep-cadence", "1,0", "--probe-fraction", "0.05", "--out", str(out), "--no-store",
        verbosity=0, stdout=stdout,
    )
    document = json.loads(out.read_text())
    every, frozen = document["cadence"]
    assert (every["aggregate_every"], frozen["aggregate_every"]) == (1, 0)
    assert every["accuracy_round_1"] == frozen["accuracy_round_1"]  # the same round 1
    assert every["accuracy_round_4"] >= frozen["accuracy_round_4"] + 0.2, (every, frozen)
    rounds = document["rounds"][0]
    # Each round is scored on the categories in use then: more of them from round 3.
    assert rounds[0]["test_queries"] == rounds[1]["test_queries"] < rounds[2]["test_queries"]
    assert "aggregation cadence" in stdout.getvalue() and "frozen" in stdout.getvalue()

    sim = _simulation(twin_dataset, rounds=4, drift_every=2, aggregate_every=0)
    setup = sim.prepare(1)
    starts = {s.client: setup.starts(s, sim.category_of) for s in setup.shares}
    outcomes = sim.federate(setup.shares, setup.logs, setup.split.probe, 1, None, starts)
    assert [bool(o.submissions) for o in outcomes] == [True, False, False, False]
    assert all(o.global_compendium is outcomes[0].global_compendium for o in outcomes)
    late = {c for c, r in setup.category_start.items() if r == 3}
    first = outcomes[0].client_compendiums
    assert late and not any(sim.category_of[s.tool_id] in late for c in first.values() for s in c.scenarios)


def test_tau_and_summarizer_sweeps(tiny_dataset, tmp_path):
    out = tmp_path / "sweeps.json"
    stdout = io.StringIO()
    call_command(
        "simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2",
        "--rounds", "2", "--seed", "1", "--no-baselines", "--no-diagnostics", "--sweep-tau", "0.5,0.95",
        "--sweep-summarizers", "centroid,none", "--out", str(out), "--no-store", "--in-memory",
        verbosity=0,
        stdout=stdout,
    )
    document = json.loads(out.read_text())
    loose, tight = document["tau_sweep"]
    assert (loose["tau"], tight["tau"]) == (0.5, 0.95)
    # A lower threshold merges more: fewer, and more deduplicated, global scenarios.
    assert loose["global_scenarios"] < tight["global_scenarios"]
    assert loose["dedup_rate"] > tight["dedup_rate"] >= 0
    assert loose["global_size_bytes"] < tight["global_size_bytes"]
    for row in document["tau_sweep"] + document["summarizer_sweep"]:
        assert row["accuracy_round_2"] == row["accuracy"] and 0 < row["accuracy_round_1"] <= 1
        assert row["merge_seconds_per_round"] > 0
    assert [r["summarizer"] for r in document["summarizer_sweep"]] == ["centroid", "none"]
    table = stdout.getvalue()
    assert "τ sweep" in table and "summarizer sweep" in table
    # What the run played on, beyond the folder's name (--combine compares it).
    from compendium.registry import load_dataset
    from federation.simulation.data import dataset_fingerprint

    assert document["dataset_fingerprint"] == dataset_fingerprint(load_dataset(tiny_dataset))


def test_a_sweep_reuses_a_federation_already_played_and_only_that(tiny_dataset):
    """A sweep variant equal to the main run's configuration takes the main run's seeds instead of
    playing the same deterministic federation again; a main run with baselines, or any other
    variant, is played."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.report import PlayedRuns, run, sweep
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    schema = Schema(tools=dataset.tools)
    played_seeds = []

    class Counted(Simulation):
        def run_seed(self, seed):
            played_seeds.append((self.config.tau, self.config.baselines, seed))
            return super().run_seed(seed)

    progress = []

    def make(cfg):
        return Counted(dataset, schema, get_engine(), cfg, progress.append)

    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=2, baselines=False,
                              diagnostics=False)
    played = PlayedRuns()
    document = run(make(config), [1], played)
    rows = sweep(make, config, [{"tau": config.tau}, {"tau": 0.6}], [1], played)
    assert played_seeds == [(config.tau, False, 1), (0.6, False, 1)]
    main_last = [r for r in document["results"] if r["method"] == "synapse"][-1]["accuracy"]
    assert rows[0]["accuracy"] == main_last
    # Played anew, the same variant gives the same figures: reusing it changes nothing. A named
    # sweep's progress lines say which sweep and variant is playing.
    del progress[:]
    [again] = sweep(make, config, [{"tau": config.tau}], [1], name="tau_sweep")
    assert progress and all(
        line.startswith(f"tau_sweep 1/1 (tau={config.tau}): seed 1 (1/1): ") for line in progress)
    timing = "merge_seconds_per_round"
    assert {k: v for k, v in again.items() if k != timing} == {
        k: v for k, v in rows[0].items() if k != timing}
    assert len(played_seeds) == 3

    with_baselines = PlayedRuns()
    run(make(SimulationConfig(orgs=2, clients_per_org=2, rounds=2, diagnostics=False)), [1],
        with_baselines)
    sweep(make, config, [{"tau": config.tau}], [1], with_baselines)
    assert played_seeds[3:] == [(config.tau, True, 1), (config.tau, False, 1)]


def test_an_adversarial_sweep_plays_the_federation_without_adversaries_once_not_once_per_mode(
        tiny_dataset):
    """At fraction 0 no client is adversarial, so what an adversary would send (the mode, the
    camouflage share) decides nothing: `--sweep-adversarial 0,0.2,0.4` (the dashboard's own
    example) played the same federation again for every mode, 6 times too many per rule with
    the 7 modes. Each mode keeps its row, with the one federation's figures."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.report import PlayedRuns, sweep
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    dataset = load_dataset(str(tiny_dataset))
    schema = Schema(tools=dataset.tools)
    played = []

    class Counted(Simulation):
        def run_seed(self, seed):
            played.append((self.config.adversarial_mode, self.config.adversarial_fraction))
            return super().run_seed(seed)

    def make(cfg):
        return Counted(dataset, schema, get_engine(), cfg)

    config = SimulationConfig(orgs=2, clients_per_org=2, rounds=1, baselines=False,
                              diagnostics=False)
    modes = ("tool_confusion", "camouflaged_poisoning", "coordinated_camouflage")
    variants = [{"adversarial_mode": mode, "adversarial_fraction": fraction, "robust_rule": "none"}
                for mode in modes for fraction in (0.0, 0.5)]
    rows = sweep(make, config, variants, [1], PlayedRuns())
    assert played == [("tool_confusion", 0.0), ("tool_confusion", 0.5),
                      ("camouflaged_poisoning", 0.5), ("coordinated_camouflage", 0.5)]
    clean = [row for row in rows if row["adversarial_fraction"] == 0.0]
    assert [row["adversarial_mode"] for row in clean] == list(modes)
    assert len({row["accuracy"] for row in clean}) == 1


def test_progress_lines_say_how_long_the_run_has_taken(tiny_dataset, capsys):
    call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                 "2", "--rounds", "2", "--no-baselines", "--no-diagnostics", "--in-memory",
                 "--sweep-tau", "0.6", "--no-store", verbosity=1)
    lines = capsys.readouterr().err.splitlines()
    assert "simulate: [0:00:00] seed 0 (1/1): round 1/2: clients build" in lines[:1]
    assert all(re.fullmatch(r"simulate: \[\d+:\d\d:\d\d\] .+", line) for line in lines), lines
    assert any(re.fullmatch(r"simulate: \[[^]]+\] tau_sweep 1/1 \(tau=0\.6\): seed 0 \(1/1\): evaluating", line)
               for line in lines)


def test_bm25_over_a_final_global_without_scenarios_routes_nothing(tiny_dataset, tmp_path):
    """A byte budget no scenario fits in (the clients send their statistics alone) leaves the
    final global without a scenario: the BM25 baseline over it crashed after the whole run
    (rank_bm25 divides by the size of an empty corpus), nothing stored or written. Over a
    global of no scenario it routes nothing: accuracy 0."""
    out = tmp_path / "run.json"
    call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                 "2", "--rounds", "1", "--max-bytes", "1", "--no-diagnostics", "--in-memory",
                 "--no-store", "--out", str(out), verbosity=0)
    document = json.loads(out.read_text())
    assert document["rounds"][0][-1]["global_scenarios"] == 0
    [bm25] = [row for row in document["summary"] if row["method"] == "bm25"]
    assert bm25["accuracy_mean"] == 0.0


def test_a_runs_seconds_count_its_sweeps_too(tiny_dataset, tmp_path, monkeypatch):
    """The document's `seconds` (the dashboard's "stored … (N s)") is the whole command's time,
    sweeps included: it gave the main run's alone (the demo's 1,208 s run read 871 s)."""
    from federation.management.commands import simulate as command

    real_run, real_sweep = command.run, command.sweep

    def instant_run(*args, **kwargs):
        return {**real_run(*args, **kwargs), "seconds": 0.0}

    clock = [0.0]  # the command's clock, which only the sweep moves (by 100 s)

    def slow_sweep(*args, **kwargs):
        clock[0] += 100.0
        return real_sweep(*args, **kwargs)

    monkeypatch.setattr(command, "run", instant_run)
    monkeypatch.setattr(command, "sweep", slow_sweep)
    monkeypatch.setattr(command, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    out = tmp_path / "run.json"
    call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                 "2", "--rounds", "1", "--no-baselines", "--no-diagnostics", "--in-memory",
                 "--sweep-tau", "0.6", "--out", str(out), "--no-store", verbosity=0)
    assert json.loads(out.read_text())["seconds"] == 100.0


def test_llm_summarizers_speak_to_the_llm_endpoint_or_are_refused(tiny_dataset):
    from tests.chat_server import ChatServer

    with pytest.raises(CommandError, match="need an LLM endpoint: pass --llm"):
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--rounds", "1", "--no-baselines", "--sweep-summarizers",
                     "centroid,llm-single-shot", "--no-store", verbosity=0)
    server = ChatServer(default='{"summary": "Forecasts and weather for a place"}')
    try:
        # The clients send all they built (since_confidence above 1): which clusters reach an
        # edge with two members must not hang on what the probe's router already routes. The
        # canned answer fits only a weather cluster; written for another tool's cluster, the
        # server's confusion check drops it (closest to weather, not to its own tool).
        sim = _simulation(tiny_dataset, rounds=1, summarizer="llm-single-shot", llm_url=server.url,
                          llm_model="summary-model", since_confidence=1.01)
        setup = sim.prepare(1)
        [outcome] = sim.federate(setup.shares, setup.logs, setup.split.probe, 1)
        asked = [r for r in server.requests if "Write one concise text" in json.dumps(r["body"])]
        assert asked and all(r["body"]["model"] == "summary-model" for r in asked)
        # ... asking for the JSON object the summarizer parses (llama.cpp decodes to the schema).
        assert all(r["body"]["response_format"]["schema"]["required"] == ["summary"] for r in asked)
        texts = [(s.tool_id, s.text) for s in outcome.global_compendium.scenarios]
        assert ("weather", "Forecasts and weather for a place") in texts
        counts = [stats["summaries"] for stats in outcome.merge_stats.values()]
        assert sum(c.get("llm-single-shot", 0) for c in counts) > 0
    finally:
        server.close()


@pytest.mark.django_db(transaction=True)  # through the services: the pipeline asks the LLM
@pytest.mark.parametrize("answer, from_llm", [('{"summary": "Forecasts for a place"}', True),
                                              ("Sure! Here is a summary of the texts.", False)])
def test_the_summarizer_sweep_counts_what_the_llm_wrote_and_what_fell_back(tiny_dataset, tmp_path,
                                                                          answer, from_llm):
    """A weak model that ignores the JSON format falls back to probe-extractive on every cluster;
    the sweep says so instead of reporting an LLM summarizer's accuracy as if the LLM had written
    the summaries."""
    from tests.chat_server import ChatServer

    out = tmp_path / "summarizers.json"
    stdout = io.StringIO()
    server = ChatServer(default=answer)
    try:
        call_command(
            "simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2",
            "--rounds", "2", "--seed", "1", "--no-baselines", "--no-diagnostics",
            "--sweep-summarizers", "centroid,llm-single-shot", "--llm", server.url,
            "--out", str(out), "--no-store", verbosity=0, stdout=stdout,
        )
    finally:
        server.close()
    centroid, llm = json.loads(out.read_text())["summarizer_sweep"]
    assert centroid["llm_summaries"] == 0 and centroid["summarizer_fallbacks"] == 0
    assert centroid["summaries"] > 0 and llm["summaries"] > 0
    line = next(x for x in stdout.getvalue().splitlines() if x.strip().startswith("llm-single-shot"))
    if from_llm:
        assert llm["llm_summaries"] == llm["summaries"] and llm["summarizer_fallbacks"] == 0
        assert llm["summarizer_fallback_kinds"] == {}
        assert (f"an LLM wrote {llm['llm_summaries']:.0f} of {llm['summaries']:.0f} summaries "
                "(0 fallbacks)") in line
    else:
        assert llm["llm_summaries"] == 0 and llm["summarizer_fallbacks"] == llm["summaries"]
        # why: every fallback was the answer (not JSON), none the endpoint
        assert llm["summarizer_fallback_kinds"] == {
            "llm-single-shot: unusable answer": llm["summarizer_fallbacks"]}
        assert (f"an LLM wrote 0 of {llm['summaries']:.0f} summaries "
                f"({llm['summarizer_fallbacks']:.0f} fallbacks: {llm['summarizer_fallbacks']:.0f} "
                "llm-single-shot: unusable answer)") in line


@pytest.mark.django_db(transaction=True)  # through the services: the edges' conflict logs
def test_contradictory_scenarios_with_and_without_the_conflict_log(twin_dataset, tmp_path):
    """40% of the clients' scenarios contradicted by another client of their organization (the same
    request for a confusable twin): contradictions cost accuracy with or without the conflict
    log, and the global does not take the contradicting copies; with no contradictions the log
    changes nothing here. (On these twins, whose descriptions are the same and whose probe
    covers one intent in three, the probe cannot tell which label is right; see
    EXPERIMENTS.md.)"""
    out = tmp_path / "contradictions.json"
    stdout = io.StringIO()
    call_command(
        "simulate", "--dataset", str(twin_dataset), "--orgs", "2", "--clients-per-org", "2",
        "--rounds", "3", "--seed", "1", "--no-baselines", "--no-diagnostics",
        "--sweep-contradictions", "0,0.4", "--out", str(out), "--no-store",
        verbosity=0, stdout=stdout,
    )
    rows = {(r["contradiction_fraction"], r["conflict_log"]): r for r in json.loads(out.read_text())["contradictions"]}
    assert set(rows) == {(0.0, True), (0.0, False), (0.4, True), (0.4, False)}
    assert rows[(0.0, True)]["accuracy"] == rows[(0.0, False)]["accuracy"]
    assert rows[(0.0, True)]["global_scenarios"] == rows[(0.0, False)]["global_scenarios"]
    for log in (True, False):
        assert rows[(0.4, log)]["accuracy"] < rows[(0.0, log)]["accuracy"], rows
    assert "contradictory scenarios" in stdout.getvalue()


@pytest.mark.parametrize("log", [True, False])
def test_the_global_takes_no_contradicting_copy(twin_dataset, log):
    """The globals do not take the contradicting copies of the twins' requests: the log resolves
    every one, and without it the confusion check drops both claims of nearly every contradicted
    request (the twins' profiles differ only by what was submitted, and an entry's own tool no
    longer counts its near duplicates; until 2026-11-30 the copies entered without the log).
    Checked on the globals themselves: how many requests the clients sent under two tools a
    global publishes under both (measured, seed 1: with the log 0 of 36 in every round; without
    it 1 of 38 in round 1, then 0; without the confusion check 11, 28, 28 of 31). This replaced
    a comparison of the globals' sizes, which the delta rule moves: a client less sure of its
    routing sends more."""
    from collections import defaultdict

    sim = _simulation(twin_dataset, rounds=3, contradiction_fraction=0.4, conflict_log=log)
    setup = sim.prepare(1)
    outcomes = sim.federate(setup.shares, setup.logs, setup.split.probe, 1)
    sent = defaultdict(set)
    for outcome in outcomes:
        for compendium in outcome.submissions.values():
            for s in compendium.scenarios:
                sent[s.text].add(s.tool_id)
    contradicted = {text for text, tools in sent.items() if len(tools) > 1}
    assert len(contradicted) >= 5, len(contradicted)  # the clients did send contradictions
    for outcome in outcomes:
        published = defaultdict(set)
        for s in outcome.global_compendium.scenarios:
            published[s.text].add(s.tool_id)
        both = {text for text in contradicted if len(published[text]) > 1}
        assert len(both) <= (0 if log else len(contradicted) // 10), (outcome.round, sorted(both)[:5])


def test_tuned_router_rows_route_each_global_with_an_encoder_tuned_on_it(tiny_dataset):
    sim = _simulation(tiny_dataset, tune_router_epochs=1, diagnostics=False, baselines=True)
    tuned_with = []
    tune = sim.tuned_router

    def spy(compendium, probe, seed, what):
        tuned_with.append((what, len(compendium.scenarios)))
        router = tune(compendium, probe, seed, what)
        assert router.engine.model_name.startswith(tempfile.gettempdir())  # the tuned model
        return router

    sim.tuned_router = spy
    result = sim.run_seed(1)
    assert [w for w, _ in tuned_with] == ["round 1", "round 2", "centralized"]
    methods = [(r["method"], r["round"]) for r in result.rows]
    for round_ in (1, 2):
        assert ("synapse", round_) in methods and ("synapse_untuned", round_) in methods
    untuned = _simulation(tiny_dataset, diagnostics=False).run_seed(1)
    # The frozen router's rows are those of a run without tuning: same federation, same router.
    assert [r["accuracy"] for r in result.rows if r["method"] == "synapse_untuned"] == [
        r["accuracy"] for r in untuned.rows if r["method"] == "synapse"]


def test_max_words_cuts_what_clients_send_and_not_centralized(tiny_dataset):
    """`--max-words`: every simulated client sends its requests cut to their first N words (the
    client toolkit's `BuildOptions.max_words`); Centralized, which sends nothing over a wire,
    pools the whole requests."""
    sim = _simulation(tiny_dataset, rounds=1, max_words=3)
    setup = sim.prepare(1)
    outcome = sim.federate(setup.shares, setup.logs, setup.split.probe, 1)[0]
    sent = [s.text for c in outcome.submissions.values() for s in c.scenarios]
    assert sent and all(len(text.split()) <= 3 for text in sent)
    central = sim.centralized_global(setup.shares, setup.logs, setup.split, 1)
    assert max(len(s.text.split()) for s in central.scenarios) > 3


def _small_dataset(folder, tools, queries_per_tool):
    """tools: (tool_id, category) pairs; queries_per_tool: how many queries each has."""
    folder.mkdir()
    (folder / "tools.jsonl").write_text("".join(
        json.dumps({"tool_id": t, "description": f"{t} service", "category": c}) + "\n" for t, c in tools))
    (folder / "queries.jsonl").write_text("".join(
        json.dumps({"query": f"request {n} for {t}", "tool_id": t}) + "\n"
        for (t, _), count in zip(tools, queries_per_tool, strict=True) for n in range(count)))
    return folder


@pytest.mark.parametrize(("tools", "counts", "flags", "message"), [
    ([("a", "x")], [10], [], "^the dataset d has 1 tool; routing needs at least 2$"),
    ([("a", "x"), ("b", "y")], [2, 1], [], "^the dataset d has no tool with 3 or more distinct queries: nothing to test"),
    ([("a", "x"), ("b", "x"), ("c", "x")], [20, 20, 20], ["--orgs", "2"],
     "^--partition category: the train queries' tools have 1 category for --orgs 2, so 1 organization[(]s[)] "
     "would get no queries; use fewer --orgs or --partition iid or random$"),
    ([("a", "x"), ("b", "y")], [20, 20], ["--partition", "iid", "--orgs", "5", "--clients-per-org", "5"],
     "^seed 0: 5 of 25 clients get no train queries [(]20 dealt by --partition iid[)]; use fewer --orgs"),
    # Before: drift_plan had nothing to bring in later, so the rounds ran without drift, scored
    # on every category, while the document said drift_every 1.
    ([("a", "x"), ("b", "x")], [20, 20], ["--partition", "iid", "--rounds", "2", "--drift-every", "1"],
     "^--drift-every 1: the dataset d's tools are all in one category, so none could come into "
     "use in a later round and the run would have no drift; use --drift-every 0 or a dataset "
     "whose tools have two or more categories$"),
    # Before: category y's only tool has no query, so drift brought nothing in at round 2 (or
    # at round 1, and x at round 2: the same rounds), again under drift_every 1.
    ([("a", "x"), ("b", "x"), ("c", "y")], [20, 20, 0],
     ["--partition", "iid", "--rounds", "2", "--drift-every", "1"],
     "^--drift-every 1: the queries of the dataset d are all of tools of one category, x [(]no "
     "query is of a tool of y[)], so none could come into use in a later round and the run would "
     "have no drift; use --drift-every 0 or a dataset whose queries are of tools of two or more "
     "categories$"),
])
def test_a_dataset_that_cannot_make_the_federation_is_refused_before_the_model_loads(
        tmp_path, tools, counts, flags, message):
    """Before: an IndexError in the merge (one tool), every method at 0.000 as if measured (no
    test split), organizations or clients with nothing, reported as the federation asked for."""
    folder = _small_dataset(tmp_path / "d", tools, counts)
    with pytest.raises(CommandError, match=message):
        call_command("simulate", "--dataset", str(folder), "--rounds", "1", "--no-store",
                     "--embedding-model", "no-such-model-xyz", *flags, verbosity=1)


@pytest.mark.parametrize("name", ["tools.jsonl", "queries.jsonl"])
def test_a_dataset_named_by_one_of_its_files_is_refused_as_not_a_folder(tmp_path, name):
    """--dataset d/tools.jsonl said 'no queries.jsonl in this folder' of a file; --dataset
    d/queries.jsonl read the queries as tools ('missing or non-string description')."""
    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y")], [5, 5])
    with pytest.raises(CommandError, match=f"^{re.escape(str(folder / name))}: a file, not a dataset "
                       "folder [(]one holding tools.jsonl and queries.jsonl[)]$"):
        call_command("simulate", "--dataset", str(folder / name), "--no-store", "--in-memory")


def test_an_embedding_model_that_cannot_load_is_said_in_one_line_naming_the_flag(
        tiny_dataset, monkeypatch):
    """--embedding-model NAME that cannot load printed the loader's two-line error and told to
    set SYNAPSE_EMBEDDING_MODEL, not the flag that named it."""
    from federation.management.commands import simulate
    from routing.embeddings import EmbeddingModelUnavailable

    def unavailable(name=None):
        raise EmbeddingModelUnavailable(
            f"cannot load embedding model {name!r}: OSError: We couldn't connect to the hub.\n"
            "Check your internet connection.. Set SYNAPSE_EMBEDDING_MODEL to a local model path")

    monkeypatch.setattr(simulate, "get_engine", unavailable)
    with pytest.raises(CommandError, match="^cannot load embedding model 'no-such-model-xyz': "
                       "OSError: We couldn't connect to the hub; --embedding-model takes "
                       "sentence-transformers names or local paths, or bundled:") as error:
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--no-store", "--in-memory", "--embedding-model", "no-such-model-xyz")
    assert "\n" not in str(error.value)


def test_a_flag_named_model_that_cannot_load_is_not_told_to_set_the_setting(tiny_dataset):
    """The real loader ends its one line with "Set SYNAPSE_EMBEDDING_MODEL to a local ... path",
    advice for the setting; a model named by a flag was told it too, before what the flag takes."""
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org",
                     "2", "--no-store", "--in-memory", "--embedding-model", "/nonexistent/model-xyz")
    message = str(error.value)
    assert "/nonexistent/model-xyz" in message and "--embedding-model takes" in message
    assert "SYNAPSE_EMBEDDING_MODEL" not in message and "\n" not in message


def test_tools_that_are_never_tested_are_counted_on_stderr(tmp_path, capsys):
    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y"), ("c", "z")], [20, 2, 1])
    with pytest.raises(CommandError, match="no-such-model-xyz"):  # after the warning, before a round
        call_command("simulate", "--dataset", str(folder), "--orgs", "1", "--clients-per-org", "2",
                     "--no-store", "--embedding-model", "no-such-model-xyz")
    assert ("simulate: 2 of 3 tools have fewer than 3 distinct queries (3 queries in all): they "
            "stay in train and are never tested") in capsys.readouterr().err


def test_tools_without_a_category_beside_tools_with_one_are_named(tmp_path, capsys):
    """Tools that tools.jsonl gives no category, beside others that have one, were dealt by
    --partition category as one category, 'uncategorized', without a word."""
    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", ""), ("c", "z"), ("d", "")],
                            [20, 20, 20, 20])
    with pytest.raises(CommandError, match="no-such-model-xyz"):
        call_command("simulate", "--dataset", str(folder), "--orgs", "2", "--clients-per-org", "2",
                     "--no-store", "--embedding-model", "no-such-model-xyz")
    assert ("simulate: 2 of 4 tools have no category in tools.jsonl (b and d): the partition, "
            "drift and the per-category table read them as one category, 'uncategorized'"
            in capsys.readouterr().err)


def test_tools_of_no_query_are_named_apart_from_those_that_stay_in_train(tmp_path, capsys):
    """A tool that queries.jsonl never names was counted among the tools of too few queries as
    one that "stays in train": no client's log holds it."""
    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y"), ("c", "z"), ("d", "z")],
                            [20, 0, 2, 0])
    with pytest.raises(CommandError, match="no-such-model-xyz"):
        call_command("simulate", "--dataset", str(folder), "--orgs", "1", "--clients-per-org", "2",
                     "--no-store", "--embedding-model", "no-such-model-xyz")
    err = capsys.readouterr().err
    assert ("simulate: 2 of 4 tools have no query in queries.jsonl (b and d): no client's log "
            "holds them and they are never tested") in err
    assert ("simulate: 1 of 4 tools have fewer than 3 distinct queries (2 queries in all): they "
            "stay in train and are never tested") in err


def test_a_tool_of_many_copies_of_few_texts_is_counted_as_never_tested(tmp_path, capsys):
    """Tool b has five queries, all one text: one distinct query, which stays in train."""
    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y")], [20, 0])
    with (folder / "queries.jsonl").open("a") as queries:
        queries.writelines(json.dumps({"query": "the same request", "tool_id": "b"}) + "\n"
                           for _ in range(5))
    with pytest.raises(CommandError, match="no-such-model-xyz"):
        call_command("simulate", "--dataset", str(folder), "--orgs", "1", "--clients-per-org", "2",
                     "--no-store", "--embedding-model", "no-such-model-xyz")
    assert ("simulate: 1 of 2 tools have fewer than 3 distinct queries (5 queries in all)"
            in capsys.readouterr().err)


@pytest.mark.parametrize("name", ["tools.jsonl", "queries.jsonl"])
def test_an_out_over_the_datasets_own_files_is_refused_before_anything_runs(tiny_dataset, name):
    """--out onto the dataset's queries.jsonl (or tools.jsonl) was taken, and the results were
    written over the data the run played on at its end."""
    before = {path.name: path.read_bytes() for path in tiny_dataset.iterdir()}
    # (--min-users 0: were the --out let through, the run would stop there, not play)
    with pytest.raises(CommandError, match=f"^--out .*/[.]/{name} is the dataset's {name}: "
                       "the results would replace it; name another file$"):
        call_command("simulate", "--dataset", str(tiny_dataset), "--out",
                     f"{tiny_dataset}/./{name}", "--no-store", "--in-memory", "--min-users", "0")
    assert {path.name: path.read_bytes() for path in tiny_dataset.iterdir()} == before


def test_a_label_too_long_to_store_whole_is_refused_before_anything_runs(tiny_dataset):
    """A label was stored cut to its column's 200 characters, and `--unless-stored` with the
    same label (which looks for all of it) never found the run: every call ran it again."""
    label = "x" * 201
    # (--min-users 0: were the label let through, the run would stop there, not play)
    flags = ["--dataset", str(tiny_dataset), "--unless-stored", "--label", label, "--min-users", "0"]
    with pytest.raises(CommandError, match="^--label is at most 200 characters, not 201$"):
        call_command("simulate", *flags)
    with pytest.raises(CommandError, match="^--label is at most 200 characters"):
        call_command("simulate", "--combine", "a.json", "--label", label)
    assert not SimulationRun.objects.exists()


def test_local_only_is_the_mean_over_the_honest_clients_alone(tiny_dataset, monkeypatch):
    """Local-only (each client alone) averaged every client's compendium, an adversary's
    corrupted one included: with adversarial clients the baseline was dragged down by
    compendiums no honest client would hold (half the clients relabelling everything here)."""
    import numpy as np

    from federation.simulation.runner import Simulation

    sim = _simulation(tiny_dataset, rounds=1, baselines=True, diagnostics=False,
                      adversarial_fraction=0.5, adversarial_mode="tool_confusion")
    seen = {}
    original = Simulation.baselines

    def recording(self, shares, logs, final, split, test, *args, **kwargs):
        seen.update(final=final, split=split, test=test)
        return original(self, shares, logs, final, split, test, *args, **kwargs)

    monkeypatch.setattr(Simulation, "baselines", recording)
    result = sim.run_seed(0)
    adversaries = sim.prepare(0).adversaries
    assert len(adversaries) == 2
    split, test = seen["split"], seen["test"]
    alone = []
    for client, compendium in seen["final"].client_compendiums.items():
        if client in adversaries:
            continue
        own = {s.tool_id for s in compendium.scenarios}
        router = sim.router(compendium, [q for q in split.probe if q.tool_id in own])
        alone.append(sim.evaluate(router, test).accuracy)
    assert len(alone) == 2
    row = next(r for r in result.rows if r["method"] == "local_only")
    assert row["accuracy"] == round(float(np.mean(alone)), 4)


def test_a_drift_round_without_test_queries_is_not_measured_rather_than_scored_zero(tmp_path, capsys):
    """Under drift each round is scored on the held-out queries of the categories in use then.
    Here category y's tools have two queries each (never tested): a round in which only y is in
    use has nothing to score. It was scored 0.000, printed and written as if measured, and
    pulled every mean over the rounds down; now it is null in the JSON, n/a in the table, left
    out of the means, and a progress line says why."""
    from federation.simulation.report import _shape_problem, summarize
    from federation.simulation.runner import drift_plan

    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "x"), ("c", "y"), ("d", "y")],
                            [20, 20, 2, 2])
    seed = next(s for s in range(20) if drift_plan(["x", "y"], 2, 1, s)["y"] == 1)
    out = tmp_path / "drift.json"
    stdout = io.StringIO()
    call_command(
        "simulate", "--dataset", str(folder), "--orgs", "1", "--clients-per-org", "2",
        "--partition", "iid", "--rounds", "2", "--drift-every", "1", "--seed", str(seed),
        "--no-baselines", "--no-diagnostics", "--in-memory", "--no-store", "--out", str(out),
        "--embedding-model", FP32, "--sweep-cadence", "1", stdout=stdout,
    )
    document = json.loads(out.read_text())
    synapse = {r["round"]: r for r in document["results"] if r["method"] == "synapse"}
    assert synapse[1]["accuracy"] is None and synapse[1]["macro_accuracy"] is None
    assert synapse[2]["accuracy"] is not None and synapse[2]["accuracy"] > 0
    assert document["rounds"][0][0]["test_queries"] == 0
    summary = {(r["method"], r["round"]): r for r in document["summary"]}
    assert summary[("synapse", 1)]["accuracy_mean"] is None
    assert summary[("synapse", 1)]["seeds"] == 0  # no seed measured it
    assert summary[("synapse", 2)]["accuracy_mean"] == synapse[2]["accuracy"]
    # The cadence sweep's round-1 figure is none either, not a 0 in its mean over the rounds.
    (cadence,) = document["cadence"]
    assert cadence["accuracy_round_1"] is None
    assert cadence["accuracy_round_2"] == synapse[2]["accuracy"]
    table = stdout.getvalue()
    line = next(line for line in table.splitlines() if re.match(r"synapse\s+1 ", line))
    assert "n/a" in line and "0.000" not in line
    assert "not measured" in table
    err = capsys.readouterr().err
    assert re.search(r"round 1: not measured: none of the \d+ test queries is of the categories "
                     r"in use then \(y\)", err), err
    # A document with such a round is still one --combine and the summary read.
    assert _shape_problem(document) is None
    assert summarize(document["results"]) == document["summary"]


def _dataset_with_query_categories(folder, tools, queries_per_tool, query_category):
    """`_small_dataset` whose queries carry a category of their own: `query_category(tool,
    tool's category)`."""
    _small_dataset(folder, tools, queries_per_tool)
    (folder / "queries.jsonl").write_text("".join(
        json.dumps({"query": f"request {n} for {t}", "tool_id": t,
                    "category": query_category(t, c)}) + "\n"
        for (t, c), count in zip(tools, queries_per_tool, strict=True) for n in range(count)))
    return folder


def test_categories_only_in_queries_jsonl_are_named_where_the_partition_looks(tmp_path):
    """The category partition deals the tools' categories (tools.jsonl). A dataset whose
    categories are only on its queries was refused with "1 category for --orgs 2", which did not
    say that tools.jsonl gives its tools none, nor that queries.jsonl's are not read for it."""
    folder = _dataset_with_query_categories(
        tmp_path / "d", [("a", ""), ("b", ""), ("c", "")], [20, 20, 20],
        lambda tool, _: "x" if tool == "a" else "y")
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--dataset", str(folder), "--orgs", "2", "--rounds", "1",
                     "--no-store", "--embedding-model", "no-such-model-xyz")
    assert str(error.value) == (
        "--partition category deals the organizations the tools' categories, and tools.jsonl "
        "gives none of the dataset d's 3 tools a category (the 2 categories in queries.jsonl, "
        "x and y, are not read for it): put each tool's category in tools.jsonl, or use "
        "--partition iid or random")
    # Drift brings in the tools' categories too.
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--dataset", str(folder), "--orgs", "1", "--rounds", "2",
                     "--drift-every", "1", "--partition", "iid", "--no-store",
                     "--embedding-model", "no-such-model-xyz")
    assert str(error.value).startswith(
        "--drift-every 1: tools.jsonl gives none of the dataset d's 3 tools a category (the 2 "
        "categories in queries.jsonl, x and y, are not read for it), so none could come into "
        "use in a later round")


def test_the_per_category_table_uses_the_tools_category_as_the_partition_does(tmp_path, capsys):
    """The partition (and drift) read a query's category from its tool; the per-category table
    read the query's own category first: on a dataset where they differ the table's categories
    were not those the organizations specialized in. Both now read the tool's, and simulate says
    how many queries carry another category."""
    folder = _dataset_with_query_categories(
        tmp_path / "d", [("a", "x"), ("b", "x"), ("c", "y"), ("d", "y")], [20, 20, 20, 20],
        lambda tool, category: "other" if tool in ("a", "c") else category)
    sim = _simulation(folder, rounds=1, diagnostics=False, partition="iid")
    result = sim.run_seed(0)
    assert set(result.per_category) == {"x", "y"}
    assert sum(row["n"] for row in result.per_category.values()) == len(sim.prepare(0).test)
    with pytest.raises(CommandError, match="no-such-model-xyz"):  # after the warning
        call_command("simulate", "--dataset", str(folder), "--orgs", "1", "--no-store",
                     "--embedding-model", "no-such-model-xyz")
    assert ("simulate: 40 of 80 queries in queries.jsonl carry a category other than their "
            "tool's in tools.jsonl (e.g. a: 'other', not 'x'); the simulation reads a query's "
            "category from its tool (partition, drift, per-category table)"
            in capsys.readouterr().err)


def test_the_membership_attack_pairs_each_member_with_a_non_member_of_its_tool(tmp_path, monkeypatch):
    """Members and non-members are drawn 50/50, a held-out request of the member's tool for
    each member: a member of a tool that is never tested (fewer than three distinct requests)
    has no non-member, and was scored anyway, unpaired (the AUROC and the token overlap then
    compared members of more tools than the non-members beside them)."""
    from compendium.registry import load_dataset
    from compendium.schema import Compendium, Scenario, Schema
    from federation.simulation import runner
    from federation.simulation.data import untested_tools
    from federation.simulation.runner import Simulation, SimulationConfig
    from routing.embeddings import get_engine

    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y"), ("c", "x")], [20, 20, 2])
    dataset = load_dataset(str(folder))
    assert untested_tools(dataset) == (1, 2)
    simulation = Simulation(dataset, Schema(tools=dataset.tools), get_engine(FP32),
                            SimulationConfig(orgs=1, clients_per_org=2, partition="iid"))
    setup = simulation.prepare(0)
    assert any(q.tool_id == "c" for share in setup.shares for q in share.queries)
    released = {share.client: Compendium(scenarios=[Scenario(tool_id=q.tool_id, text=q.query)
                                                    for q in share.queries[:3]])
                for share in setup.shares}
    scored = []
    monkeypatch.setattr(runner, "auroc", lambda members, nonmembers: scored.append(
        (len(members), len(nonmembers))) or 0.5)
    privacy = simulation.membership_attack(setup.shares, released, setup.split.test, 0)
    [(members, nonmembers)] = scored
    assert members == nonmembers == sum(
        1 for share in setup.shares for q in share.queries if q.tool_id != "c")
    assert 0 <= privacy["token_overlap"] <= 1


def test_drift_deals_only_the_categories_some_query_is_of(tmp_path):
    """The drift plan dealt every category of tools.jsonl, those of tools no query is labelled
    with too: such a category took a place among the half in use from round 1, or a drift
    event that then brought nothing in (with three categories and one event, the seeds that put
    z last had no drift at all). Now only the categories of the queries' tools are dealt."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation.runner import Simulation, SimulationConfig

    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "x"), ("c", "y"), ("d", "z")],
                            [20, 20, 20, 0])
    dataset = load_dataset(folder)
    config = SimulationConfig(orgs=1, clients_per_org=2, partition="iid", rounds=2, drift_every=1)
    simulation = Simulation(dataset, Schema(tools=dataset.tools), None, config)
    for seed in range(10):
        plan = simulation.prepare(seed).category_start
        assert set(plan) == {"x", "y"} and sorted(plan.values()) == [1, 2], (seed, plan)


def test_a_membership_attack_that_could_score_no_client_says_so(tmp_path):
    """No client could be scored (here: none sent anything): the figures were a chance-level
    AUROC 0.5 and a perfect 0.0 token overlap, printed as measured; they are None, the table
    says 'not measured', and the document still reads back (combine, table)."""
    from compendium.registry import load_dataset
    from compendium.schema import Schema
    from federation.simulation import report
    from federation.simulation.runner import PRIVACY_FIGURES, Simulation, SimulationConfig
    from routing.embeddings import get_engine

    folder = _small_dataset(tmp_path / "d", [("a", "x"), ("b", "y")], [20, 20])
    dataset = load_dataset(str(folder))
    simulation = Simulation(dataset, Schema(tools=dataset.tools), get_engine(FP32),
                            SimulationConfig(orgs=1, clients_per_org=2, partition="iid"))
    setup = simulation.prepare(0)
    privacy = simulation.membership_attack(setup.shares, {}, setup.split.test, 0)
    assert privacy == dict.fromkeys(PRIVACY_FIGURES)
    assert report._mean_dicts([privacy, privacy]) == privacy
    document = {"dataset": "d", "config": {}, "seeds": [0], "results": [],
                "communication": {"bytes_per_client_round": None,
                                  "gzip_bytes_per_client_round": None},
                "privacy": privacy}
    assert report._shape_problem(document) is None
    printed = report.table(report.combine([document]))
    assert "membership inference: not measured" in printed
    assert "AUROC 0.500" not in printed
