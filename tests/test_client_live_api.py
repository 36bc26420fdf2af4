"""The client toolkit against the real federation API served on 127.0.0.1 (pytest-django's live
server): submit twice without a duplicate row, and pull only what is published."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.utils import timezone

from compendium import transport
from compendium.canonical import canonical_form
from compendium.client_api import ClientError, SubmissionRejected, SynapseClient, TextNotMasked
from compendium.client_cli import main
from compendium.models import CompendiumVersion
from compendium.schema import Compendium
from compendium.validation import load_valid_compendium
from federation import services, submissions
from federation.models import ProbeQuery, Round, Submission

pytestmark = pytest.mark.django_db(transaction=True)


def _masked(doc: dict, schema) -> Compendium:
    """A compendium of `doc` that records masking at λ = 1, as `build` records it: the λ the
    rounds opened here expect (SynapseClient.submit refuses weaker masking, or none recorded,
    before sending anything)."""
    return load_valid_compendium(
        dict(doc, masking={"strength": 1.0, "masked_fraction": 0.25}), schema
    )



def _two_masked_files(tmp_path, valid_doc) -> dict:
    """Compendiums "a" (valid_doc) and "b" (its scenarios but the first), recording masking at
    λ = 1, written to files: the paths by name."""
    paths = {}
    for name, doc in (("a", valid_doc), ("b", dict(valid_doc, scenarios=valid_doc["scenarios"][1:]))):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(
            dict(doc, masking={"strength": 1.0, "masked_fraction": 0.2})), encoding="utf-8")
    return paths

def test_submit_and_pull_against_the_real_api(live_server, world, valid_doc, small_schema, tmp_path):
    services.open_round(services.Actor(None))
    compendium = _masked(valid_doc, small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        first = client.submit(compendium)
        again = client.submit(compendium)  # a duplicate send: same key, replayed answer
    assert first.body == again.body and not first.replayed and again.replayed
    assert Submission.objects.filter(client=world.client_a).count() == 1
    assert CompendiumVersion.objects.filter(kind="client", client=world.client_a).count() == 1
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(ClientError, match="published"):
            client.pull(tmp_path / "global.json")


def test_a_round_configured_without_a_lambda_is_checked_at_the_servers_lambda_before_sending(
    live_server, world, valid_doc, small_schema
):
    """A round whose configuration names no mask_strength (written by hand; one opened through
    the API, the dashboard or a command records RoundConfig's): the server checks masking's
    residue at λ = 1, RoundConfig's default, while SynapseClient.submit read "no λ" and checked
    none, so the raw text left the client and only the server refused it. Both read the round's
    λ by one definition now: submit refuses, before sending, exactly what the server refuses,
    and sends what it accepts."""
    from federation.submissions import UnmaskedText

    rnd = services.open_round(services.Actor(None))
    Round.objects.filter(pk=rnd.pk).update(
        config={k: v for k, v in rnd.config.items() if k != "mask_strength"})
    raw = _masked(dict(valid_doc, scenarios=[{
        "tool_id": "weather", "text": "Email John Smith at john.smith@acme.com about the forecast",
    }]), small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        assert "mask_strength" not in client.open_round()["config"]
        with pytest.raises(TextNotMasked) as refused:
            client.submit(raw)
        assert Submission.objects.count() == 0
        # what the server says of the same bytes once they reach it
        with pytest.raises(UnmaskedText) as server_refused:
            submissions.submit(world.client_a, canonical_form(raw).data, "k-raw")
        assert refused.value.strength == 1.0 and f"λ = {refused.value.strength:g}" in (
            server_refused.value.detail)
        assert [(v.path, v.reason) for v in refused.value.violations] == [
            (v.path, v.reason) for v in server_refused.value.violations]
        sent = client.submit(_masked(valid_doc, small_schema))
    assert sent.status == 201 and Submission.objects.filter(client=world.client_a).count() == 1


def test_revoked_token_is_one_clear_error(live_server, world, valid_doc, small_schema):
    services.open_round(services.Actor(None))
    services.revoke_client(services.Actor(None), world.client_a)
    compendium = _masked(valid_doc, small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(ClientError):
            client.submit(compendium)


def test_first_round_dcz_against_the_probe_set_and_the_schema(live_server, world, valid_doc, tmp_path,
                                                              capsys):
    services.open_round(services.Actor(None))
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    # Before the operator imports a probe set, fetch-probe says so instead of "0 requests saved".
    assert main(["fetch-probe", "--out", str(tmp_path / "none.json"), *server]) == 0
    assert "the server has no probe set imported" in capsys.readouterr().out
    ProbeQuery.objects.bulk_create([
        ProbeQuery(dataset="pub", qid=f"q{n:02d}", text=f"Will it rain tomorrow in city number {n}?",
                   tool_id="weather") for n in range(30)
    ])
    schema_path, probe_path, doc_path = (tmp_path / n for n in ("schema.json", "probe.json", "c.json"))
    schema_path.write_text(submissions.schema_in_force().model_dump_json(), encoding="utf-8")
    masked = dict(valid_doc, masking={"strength": 1.0, "masked_fraction": 0.2})  # the round's λ
    doc_path.write_text(json.dumps(masked), encoding="utf-8")
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    assert main(["fetch-probe", "--out", str(probe_path), *server]) == 0
    assert "the public probe set's 30 requests saved" in capsys.readouterr().out
    assert main(["submit", str(doc_path), "--schema", str(schema_path), "--probe", str(probe_path),
                 *server]) == 0
    assert "sent, dcz)" in capsys.readouterr().out
    stored = Submission.objects.get(client=world.client_a)
    data = canonical_form(Compendium.model_validate_json(doc_path.read_bytes(), strict=True)).data
    texts = json.loads(probe_path.read_text())["texts"]
    assert texts == [f"Will it rain tomorrow in city number {n}?" for n in range(30)]
    schema = submissions.schema_in_force()
    assert stored.content_encoding == "dcz"
    assert stored.wire_bytes == len(transport.compress(data, transport.probe_dictionary(schema, texts)))
    assert stored.wire_bytes < len(transport.compress(data, transport.schema_dictionary(schema)))


def test_status_tells_a_client_where_it_stands(live_server, world, valid_doc, tmp_path, capsys,
                                               monkeypatch):
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    assert main(["status", *server]) == 0
    out = capsys.readouterr().out
    assert "no round is open" in out and "no global compendium is published yet" in out
    deadline = timezone.now() + dt.timedelta(days=2)
    services.open_round(services.Actor(None), {"epsilon": 0.5, "mask_strength": 1.5}, closes_at=deadline)
    assert main(["status", "--require-submitted", *server]) == 3
    out = capsys.readouterr().out
    assert "round 1 is open (opened " in out and "ε = 0.5, masking λ ≥ 1.5" in out
    assert f"it takes submissions until {deadline:%Y-%m-%d %H:%M} UTC, then closes" in out
    assert "this client has not submitted to round 1 yet" in out
    doc_path = tmp_path / "c.json"
    masked = dict(valid_doc, masking={"strength": 1.5, "masked_fraction": 0.3})  # the round's λ
    doc_path.write_text(json.dumps(masked), encoding="utf-8")
    assert main(["submit", str(doc_path), *server]) == 0
    fewer = dict(masked, scenarios=valid_doc["scenarios"][:1])
    doc_path.write_text(json.dumps(fewer), encoding="utf-8")
    assert main(["submit", str(doc_path), *server]) == 0
    capsys.readouterr()
    assert main(["status", "--require-submitted", *server]) == 0
    out = capsys.readouterr().out
    effective = Submission.objects.filter(client=world.client_a, version__isnull=False).get()
    sha = effective.response["sha256"]
    assert "this client submitted at " in out and f"sha256 {sha[:12]}…" in out
    assert "1 scenarios" in out and "(1 earlier submission(s) of this round replaced" in out
    # the server from the environment, as the token can be (a short cron line)
    monkeypatch.setenv("SYNAPSE_SERVER", live_server.url)
    monkeypatch.setenv("SYNAPSE_TOKEN", world.token_a)
    assert main(["status", "--require-submitted", "--backoff", "0"]) == 0
    capsys.readouterr()
    # another client of the federation has its own answer
    assert main(["status", "--require-submitted", "--server", live_server.url, "--token",
                 world.token_b, "--backoff", "0"]) == 3


def test_status_counts_every_replaced_submission_of_the_round_past_one_page(
    live_server, world, valid_doc, tmp_path, capsys
):
    """`status` counted the replaced submissions of the open round on the first page of GET
    /api/v1/submissions/ (50): a client whose cron ran `participate` 80 times in a round read
    "(49 earlier submission(s) of this round replaced ...)". It counts them all now."""
    rnd = services.open_round(services.Actor(None))
    Submission.objects.bulk_create(
        Submission(client=world.client_a, round=rnd, idempotency_key=f"r1-old-{i}",
                   request_sha256=f"{i:064x}", response={"round": 1, "sha256": f"{i:064x}"})
        for i in range(79)  # replaced: no compendium version in effect
    )
    doc_path = tmp_path / "c.json"
    doc_path.write_text(json.dumps(dict(valid_doc, masking={"strength": 1.0, "masked_fraction": 0.3})),
                        encoding="utf-8")
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    assert main(["submit", str(doc_path), *server]) == 0
    capsys.readouterr()
    assert main(["status", "--require-submitted", *server]) == 0
    out = capsys.readouterr().out
    assert "this client submitted at " in out
    assert "(79 earlier submission(s) of this round replaced by the one above)" in out, out


def test_status_names_how_the_latest_global_routes_the_probe_set(live_server, world, capsys):
    from federation.models import MergeRecord

    published = Round.objects.create(number=1, state=Round.State.PUBLISHED,
                                     published_at=timezone.now())
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    assert main(["status", *server]) == 0
    assert "latest published global: round 1 (published " in capsys.readouterr().out
    MergeRecord.objects.create(round=published, accuracy=0.598, probe_queries=597)
    assert main(["status", *server]) == 0
    out = capsys.readouterr().out
    assert "; top-1 0.598 on 597 public probe requests); `pull` downloads it" in out


def _nothing_built_or_sent(state) -> None:
    """participate refused before fetching anything: no file in --dir, no submission stored."""
    assert not state.exists() or not any(state.iterdir())
    assert Submission.objects.count() == 0


def _usage_log(path) -> None:
    rows = [
        {"query": f"Will it rain tomorrow in {city}?", "tool": "weather", "outcome": "success",
         "latency_ms": 120, "user": f"u{n % 3}"}
        for n, city in enumerate(["Paris", "Lyon", "Nice", "Lille", "Metz", "Brest"])
    ] + [
        {"query": f"Find a cheap flight from {a} to {b}", "tool": "flights", "outcome": "success",
         "latency_ms": 300, "user": f"u{n % 3}"}
        for n, (a, b) in enumerate([("Oslo", "Rome"), ("Bern", "Kyiv"), ("Riga", "Faro")])
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")


def test_participate_runs_a_whole_client_round(live_server, world, tmp_path, capsys):
    from compendium.services import store_compendium

    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", *server]
    assert main(command) == 1
    assert "no round is open" in capsys.readouterr().err and not (state / "compendium.json").exists()

    ProbeQuery.objects.bulk_create([
        *(ProbeQuery(dataset="pub", qid=f"q{n}", text=f"Will it rain tomorrow in town {n}?",
                     tool_id="weather") for n in range(5)),
        *(ProbeQuery(dataset="pub", qid=f"r{n}", text=f"What is {n} times {n + 7}?",
                     tool_id="calculator") for n in range(5)),
    ])
    first = services.open_round(services.Actor(None), {"mask_strength": 1.5})
    # a weaker λ than the round expects is refused before anything is fetched, built or sent
    assert main([*command, "--lambda", "1"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: round 1 expects masking strength λ >= 1.5: --lambda 1 is weaker; pass "
        "--lambda 1.5 or more, or leave it out (or pass --allow-weaker-masking); nothing built "
        "or sent"
    )
    _nothing_built_or_sent(state)
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "round 1: no global yet: against the public probe set, masking at λ = 1.5" in out
    assert "submitted to round 1" in out and "dcz" in out
    sent = Submission.objects.get(client=world.client_a)
    assert sent.content_encoding == "dcz" and sent.round == first
    built = json.loads((state / "compendium.json").read_text())
    assert built["masking"]["strength"] == 1.5 and (state / "schema.json").exists()
    # Before any global, what the public probe set's router already sends to its tool stays
    # here: the probe knows no flights, so every flight request goes; the weather requests it
    # routes right, surely, do not.
    delta = json.loads((state / "compendium.json.report.json").read_text())["delta"]
    tools = [s["tool_id"] for s in built["scenarios"]]
    assert main(["build", "--log", str(log), "--schema", str(state / "schema.json"), "--quiet",
                 "--lambda", "1.5", "--out", str(tmp_path / "all.json"),
                 "--not-released", "calls,frequency,latency_ms,success_rate"]) == 0
    everything = [s["tool_id"] for s in json.loads((tmp_path / "all.json").read_text())["scenarios"]]
    assert tools.count("flights") == everything.count("flights") > 0
    assert delta["scenarios_routed"] == delta["scenarios_covered"] > 0
    assert tools.count("weather") == everything.count("weather") - delta["scenarios_routed"]
    # the fields the open round will not release (two organizations of one approved client each:
    # every field's noise would be wider than its clipping window) are neither computed nor sent
    expected = submissions.schema_in_force()
    assert ("the round will not release calls, frequency, latency_ms, success_rate: not sent"
            in out)
    assert {name for m in built["metadata"] for name in m["stats"]} == set()
    assert set(expected.fields_by_name) == {"calls", "frequency", "latency_ms", "success_rate"}
    # The same usage again, naming fewer fields to leave out than the round does: the round's
    # are left out all the same (the same compendium), so the server replays, nothing stored twice.
    assert main([*command, "--not-released", "success_rate"]) == 0
    assert "replayed" in capsys.readouterr().out and Submission.objects.count() == 1

    # round 1 publishes (here: the client's own compendium as the global), round 2 opens
    Round.objects.filter(pk=first.pk).update(state=Round.State.PUBLISHED, published_at=timezone.now())
    store_compendium(load_valid_compendium(built, submissions.schema_in_force()), kind="global",
                     round=first)
    services.open_round(services.Actor(None))
    assert main([*command, "--lambda", "1"]) == 0
    out = capsys.readouterr().out
    assert "round 2: against the global of round 1, masking at λ = 1" in out
    assert (state / "global.json").exists()
    # the schema in force beside the global too, for `route --compendium state/global.json`:
    # the one participate fetched for the build, not downloaded a second time
    assert (state / "global.json.schema.json").read_bytes() == (state / "schema.json").read_bytes()
    assert "nothing new since the global" in out or "submitted to round 2" in out
    # again: the global held is current (a 304 names no round) and is still named by its round
    assert main([*command, "--lambda", "1"]) == 0
    assert "round 2: against the global of round 1, masking at λ = 1" in capsys.readouterr().out


@pytest.mark.usefixtures("every_field_released")  # this round's statistics go
def test_participate_sends_what_the_global_covers_when_the_round_does_not_carry_it_forward(
    live_server, world, tmp_path, capsys
):
    """A round with carry_forward off builds its global from its own submissions: participate
    compresses against the pulled global but leaves nothing out because the global covers it."""
    from compendium.services import store_compendium

    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", "--lambda", "1",
               *server]
    first = services.open_round(services.Actor(None), {"mask_strength": 1.0})
    # The published global of round 1 already holds everything this client would build.
    schema_path, everything = tmp_path / "schema.json", tmp_path / "all.json"
    schema_path.write_text(submissions.schema_in_force().model_dump_json(), encoding="utf-8")
    assert main(["build", "--log", str(log), "--schema", str(schema_path), "--quiet",
                 "--out", str(everything)]) == 0
    built = json.loads(everything.read_text())
    Round.objects.filter(pk=first.pk).update(state=Round.State.PUBLISHED, published_at=timezone.now())
    store_compendium(load_valid_compendium(built, submissions.schema_in_force()), kind="global",
                     round=first)
    capsys.readouterr()
    # Carried forward (the default): every scenario is covered; this round's statistics go.
    services.open_round(services.Actor(None), {"mask_strength": 1.0})
    assert main(command) == 0
    assert "submitted to round 2" in capsys.readouterr().out
    assert built["scenarios"] and json.loads((state / "compendium.json").read_text())["scenarios"] == []
    # Not carried forward: every scenario goes (no probe set is imported here, so its router
    # leaves nothing out either), compressed against the pulled global.
    Round.objects.filter(state=Round.State.OPEN).update(state=Round.State.PUBLISHED,
                                                       published_at=timezone.now())
    services.open_round(services.Actor(None), {"mask_strength": 1.0, "carry_forward": False})
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "(compressed only: the round does not carry it forward" in out
    assert "submitted to round 3" in out
    sent = json.loads((state / "compendium.json").read_text())
    assert sent["scenarios"] == built["scenarios"]
    stored = Submission.objects.get(client=world.client_a, round__number=3)
    assert stored.content_encoding == "dcz"


@pytest.mark.usefixtures("every_field_released")  # this round's statistics go
def test_participate_does_not_send_again_what_it_sent_in_a_round_the_global_merged(
    live_server, world, tmp_path, capsys
):
    from compendium.client_api import record_sent, sent_before, sent_file
    from compendium.services import store_compendium

    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", "--lambda", "1",
               *server]
    first = services.open_round(services.Actor(None), {"mask_strength": 1.0})
    assert main(command) == 0
    round1 = json.loads((state / "compendium.json").read_text())
    entries = len(round1["scenarios"]) + len(round1["precautions"])
    assert round1["scenarios"] and len(sent_before(sent_file(state), {1})) == entries
    # Round 1 publishes a global that merged other clients' requests (nothing of this client's
    # wording survives: the cosine rule alone would send all of it again).
    other = {"scenarios": [{"tool_id": "calculator", "text": "Evaluate two plus two"}]}
    Round.objects.filter(pk=first.pk).update(state=Round.State.PUBLISHED, published_at=timezone.now())
    store_compendium(load_valid_compendium(other, submissions.schema_in_force()), kind="global",
                     round=first)
    services.open_round(services.Actor(None), {"mask_strength": 1.0})
    capsys.readouterr()
    assert main([*command, "--since-confidence", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{entries} scenario(s) and precaution(s) this client sent in earlier rounds" in out
    round2 = json.loads((state / "compendium.json").read_text())
    assert round2["scenarios"] == [] and round2["precautions"] == []
    report = json.loads((state / "compendium.json.report.json").read_text())
    assert report["delta"]["sent_before"] == entries
    # Again in the same round: the same bytes (round 2's own record does not count).
    assert main([*command, "--since-confidence", "2"]) == 0
    assert "replayed" in capsys.readouterr().out
    # Without the record (another machine, a lost folder) everything goes again: never less.
    sent_file(state).write_text("not json")
    assert sent_before(sent_file(state), {1}) == set()
    assert main([*command, "--since-confidence", "2"]) == 0
    resent = json.loads((state / "compendium.json").read_text())
    assert resent["scenarios"] == round1["scenarios"]
    # The record keeps one entry per round, the latest submission's.
    record_sent(sent_file(state), 1, {"a"})
    record_sent(sent_file(state), 2, {"b"})
    record_sent(sent_file(state), 2, {"c"})
    assert sent_before(sent_file(state), {1}) == {"a"}
    assert sent_before(sent_file(state), {1, 2}) == {"a", "c"}
    assert sent_before(sent_file(state), {2}) == {"c"} and sent_before(sent_file(state), set()) == set()


def test_merged_rounds_stop_at_a_round_that_did_not_carry_the_global_forward():
    from compendium.client_api import merged_rounds

    def published(number, carry=None):
        return {"number": number, "config": {} if carry is None else {"carry_forward": carry}}

    rounds = [published(5), published(4), published(3, carry=False), published(1)]  # 2 failed
    assert merged_rounds(rounds, 5) == {3, 4, 5}
    assert merged_rounds(rounds, 4) == {3, 4}
    assert merged_rounds(rounds, 3) == {3}
    assert merged_rounds(rounds, 1) == {1}
    assert merged_rounds(rounds, None) == set() and merged_rounds([], 5) == set()
    assert merged_rounds([published(2, carry=True), published(1)], 2) == {1, 2}


def test_participate_sends_again_what_a_global_that_was_not_carried_forward_dropped(
    live_server, world, tmp_path, capsys
):
    """Sent in round 1; round 2 builds its global from its own submissions (carry_forward off)
    and this client sat it out: round 3 pulls round 2's global, which holds nothing of round 1's,
    so what was sent in round 1 goes again."""
    from compendium.services import store_compendium

    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", "--lambda", "1",
               "--since-confidence", "2", *server]
    other = {"scenarios": [{"tool_id": "calculator", "text": "Evaluate two plus two"}]}
    first = services.open_round(services.Actor(None), {"mask_strength": 1.0})
    assert main(command) == 0
    round1 = json.loads((state / "compendium.json").read_text())
    assert round1["scenarios"]
    for number, config in ((1, None), (2, {"mask_strength": 1.0, "carry_forward": False})):
        rnd = first if number == 1 else services.open_round(services.Actor(None), config)
        Round.objects.filter(pk=rnd.pk).update(state=Round.State.PUBLISHED,
                                               published_at=timezone.now())
        store_compendium(load_valid_compendium(other, submissions.schema_in_force()),
                         kind="global", round=rnd)
    services.open_round(services.Actor(None), {"mask_strength": 1.0})
    capsys.readouterr()
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "round 3: against the global of round 2" in out and "submitted to round 3" in out
    assert "this client sent in earlier rounds" not in out
    assert json.loads((state / "compendium.json").read_text())["scenarios"] == round1["scenarios"]


def test_participate_and_status_follow_the_rounds_field_cap(live_server, world, tmp_path, capsys):
    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", "--no-collapse",
               *server]
    services.open_round(services.Actor(None), {"field_cap": 1, "mask_strength": 1.0})
    assert main(["status", *server]) == 0
    assert "masking λ ≥ 1, field cap F* = 1)" in capsys.readouterr().out
    # a larger cap than the round's is refused before anything is fetched, built or sent
    assert main([*command, "--field-cap", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "synapse-client: round 1 caps each user at F* = 1 tool(s) (the edge's noise assumes no "
        "more): --field-cap 2 is larger; pass --field-cap 1 or less, or leave it out; nothing "
        "built or sent"
    ]
    _nothing_built_or_sent(state)
    # by default it builds with the round's cap, which the compendium records and submit and the
    # server check
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "masking at λ = 1, field cap F* = 1" in out and "submitted to round 1" in out
    report = json.loads((state / "compendium.json.report.json").read_text())
    assert report["field_cap"] == 1 and report["capped_contributions"] > 0
    assert json.loads((state / "compendium.json").read_text())["field_cap"] == 1
    assert Submission.objects.filter(client=world.client_a).count() == 1
    # a plain `build` of the same log (no cap) is refused by `submit` under this round
    schema_path, plain = state / "schema.json", tmp_path / "plain.json"
    assert main(["build", "--log", str(log), "--schema", str(schema_path), "--out", str(plain),
                 "--no-collapse", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["submit", str(plain), *server]) == 1
    err = capsys.readouterr().err
    assert "records no field cap" in err and "--field-cap 1" in err
    assert Submission.objects.filter(client=world.client_a).count() == 1
    # sent past the client's check (other tooling, an older client), the server refuses it
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(SubmissionRejected) as refused:
            client.submit(Compendium.model_validate_json(plain.read_text()))
    assert refused.value.detail.startswith(
        "round 1 caps each user's numeric statistics at F* = 1 tool(s), but this compendium "
        "carries statistics and records no field cap"
    )
    assert Submission.objects.filter(client=world.client_a).count() == 1
    # a round without a cap: status says so, and participate builds without one
    Round.objects.update(state=Round.State.PUBLISHED, published_at=timezone.now())
    services.open_round(services.Actor(None))
    assert main(["status", *server]) == 0
    assert "no field cap" in capsys.readouterr().out


def test_participate_with_max_words_sends_each_request_cut(live_server, world, tmp_path, capsys):
    """`--max-words`: what the server decodes and stores holds each request as its first N words,
    and the server takes it as masked (a prefix of masked text is masked)."""
    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    services.open_round(services.Actor(None), {"mask_strength": 1.0})
    assert main(["participate", "--log", str(log), "--dir", str(state), "--quiet",
                 "--no-collapse", "--max-words", "3", *server]) == 0
    out = capsys.readouterr().out
    assert "submitted to round 1" in out and "to their first 3 words (--max-words)" in out
    stored = Submission.objects.get(client=world.client_a).version.content
    texts = [s["text"] for s in stored["scenarios"]]
    assert texts and all(len(text.split()) <= 3 for text in texts)
    assert any(text.startswith("Find a cheap") for text in texts)


def test_submitting_an_earlier_compendium_again_puts_it_back_in_effect(
    live_server, world, valid_doc, small_schema, tmp_path, capsys
):
    """A, then B (replaces A), then A again: the server does not replay A's old answer (B would
    stay in effect while the client is told A is); it answers 409 `replaced` and the client sends
    A again under the next key, r<round>-<sha256>-2, which puts it back in effect. The keys are
    deterministic, so a retry finds that submission instead of storing another."""
    services.open_round(services.Actor(None))
    a = _masked(valid_doc, small_schema)
    b = _masked(dict(valid_doc, scenarios=valid_doc["scenarios"][:1]), small_schema)

    def in_effect() -> str:
        return CompendiumVersion.objects.get(kind="client", client=world.client_a).sha256

    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        first = client.submit(a)
        client.submit(b)
        assert in_effect() == canonical_form(b).sha256
        third = client.submit(a)
        assert third.status == 201 and third.reinstated and not third.replayed
        assert third.idempotency_key == first.idempotency_key + "-2"
        assert in_effect() == canonical_form(a).sha256
        again = client.submit(a)  # run again (or its answer was lost): found, not stored twice
        assert again.replayed and again.idempotency_key == third.idempotency_key
        assert Submission.objects.filter(client=world.client_a).count() == 3
        client.submit(b)
        assert client.submit(a).idempotency_key == first.idempotency_key + "-3"
        assert in_effect() == canonical_form(a).sha256
    # the CLI says what happened
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    paths = _two_masked_files(tmp_path, valid_doc)
    assert main(["submit", str(paths["a"]), *server]) == 0
    assert main(["submit", str(paths["b"]), *server]) == 0
    capsys.readouterr()
    assert main(["submit", str(paths["a"]), *server]) == 0
    out = capsys.readouterr().out
    assert "had been replaced by a later one" in out and "is in effect again" in out
    assert "the server already had it" not in out
    assert in_effect() == canonical_form(load_valid_compendium(
        json.loads(paths["a"].read_text()), small_schema)).sha256


def test_an_earlier_compendium_sent_again_past_the_deadline_is_not_said_to_be_in_effect(
    live_server, world, valid_doc, small_schema
):
    """A, then B, then the round passes its deadline (still open, listed as open): sending A again
    cannot put it back. The client says that B stays in effect and why the new key was refused,
    not only that no round is open."""
    rnd = services.open_round(services.Actor(None))
    a = _masked(valid_doc, small_schema)
    b = _masked(dict(valid_doc, scenarios=valid_doc["scenarios"][:1]), small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        client.submit(a)
        client.submit(b)
        Round.objects.filter(pk=rnd.pk).update(closes_at=timezone.now() - dt.timedelta(minutes=1))
        with pytest.raises(ClientError, match="replaced by a later one, which stays in effect"
                           r".*nothing can put it back.*was refused: .*deadline"):
            client.submit(a)
    assert CompendiumVersion.objects.get(kind="client", client=world.client_a).sha256 == (
        canonical_form(b).sha256)
    assert Submission.objects.filter(client=world.client_a).count() == 2


def test_a_submission_checked_for_a_round_that_closed_meanwhile_is_not_stored_in_the_next(
    live_server, world, valid_doc, small_schema
):
    """The client checks the open round's configuration (F*, λ, fields not released) before it
    sends; the POST names that round (X-Synapse-Round), so a send or a retry that reaches the
    server once another round is open stores nothing there."""
    first = services.open_round(services.Actor(None))
    compendium = _masked(valid_doc, small_schema)

    def the_round_turns(current: dict) -> None:  # between the client's checks and its POST
        assert current["number"] == 1
        Round.objects.filter(pk=first.pk).update(
            state=Round.State.PUBLISHED, published_at=timezone.now()
        )
        services.open_round(services.Actor(None), {"field_cap": 1})

    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(ClientError, match="checked the submission for round 1: .*round 2 is open"):
            client.submit(compendium, check=the_round_turns)
    assert not Submission.objects.exists()


def test_participate_without_the_embedding_model_works_once_a_global_is_published(
    live_server, world, tmp_path, capsys
):
    """`--no-collapse` cannot leave out what the global covers (that needs the embedding model):
    participate builds everything, as before any global, and still compresses against it."""
    from compendium.services import store_compendium

    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    command = ["participate", "--log", str(log), "--dir", str(state), "--quiet", "--lambda", "1",
               "--no-collapse", *server]
    first = services.open_round(services.Actor(None), {"mask_strength": 1.0})
    assert main(command) == 0
    built = json.loads((state / "compendium.json").read_text())
    Round.objects.filter(pk=first.pk).update(state=Round.State.PUBLISHED, published_at=timezone.now())
    store_compendium(load_valid_compendium(built, submissions.schema_in_force()), kind="global",
                     round=first)
    services.open_round(services.Actor(None), {"mask_strength": 1.0})
    capsys.readouterr()
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "round 2: against the global of round 1" in out and "--no-collapse builds" in out
    assert "submitted to round 2" in out
    stored = Submission.objects.get(client=world.client_a, round__number=2)
    assert stored.content_encoding == "dcz"
    assert json.loads((state / "compendium.json").read_text())["scenarios"] == built["scenarios"]


def test_participate_past_the_rounds_deadline_stops_before_building_as_the_server_refuses(
    live_server, world, valid_doc, tmp_path, capsys
):
    """The open round's deadline has passed (it closes at the server's next check): participate
    downloaded, built (15-60 s) and only then got the server's refusal, though the rounds
    endpoint it reads first gives the deadline. It stops at once, with the words and the exit
    status of the server's refusal."""
    log, state = tmp_path / "usage.jsonl", tmp_path / "state"
    _usage_log(log)
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    rnd = services.open_round(services.Actor(None), {"mask_strength": 1.0},
                              closes_at=timezone.now() + dt.timedelta(hours=1))
    Round.objects.filter(pk=rnd.pk).update(closes_at=timezone.now() - dt.timedelta(minutes=5))
    doc_path = tmp_path / "c.json"
    doc_path.write_text(json.dumps(dict(valid_doc, masking={"strength": 1.0, "masked_fraction": 0.3})),
                        encoding="utf-8")
    assert main(["submit", str(doc_path), *server]) == 1
    refusal = capsys.readouterr().err.strip()
    assert "stopped taking submissions at its deadline" in refusal
    assert main(["participate", "--log", str(log), "--dir", str(state), "--quiet", "--no-collapse",
                 *server]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == refusal and captured.out == ""
    _nothing_built_or_sent(state)


def test_submit_prints_the_whole_key_and_what_a_resend_of_content_in_effect_did(
    live_server, world, valid_doc, small_schema, tmp_path, capsys
):
    """submit cut the idempotency key to 24 characters, hiding the -2/-3 of a key sent again
    after a replacement; and A, B, A, then A once more (A is in effect under -2 already, the
    server replays it) said A "went again under a new key and is in effect again" before
    "(replayed)": nothing went again, it was already in effect."""
    services.open_round(services.Actor(None))
    server = ["--server", live_server.url, "--token", world.token_a, "--backoff", "0"]
    paths = _two_masked_files(tmp_path, valid_doc)
    sha = canonical_form(load_valid_compendium(
        json.loads(paths["a"].read_text()), small_schema)).sha256
    assert main(["submit", str(paths["a"]), *server]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"; key r1-{sha}")
    assert main(["submit", str(paths["b"]), *server]) == 0
    capsys.readouterr()
    assert main(["submit", str(paths["a"]), *server]) == 0
    out = capsys.readouterr().out
    assert "went again under a new key and is in effect again" in out and "replayed" not in out
    assert out.rstrip().endswith(f"; key r1-{sha}-2")
    assert main(["submit", str(paths["a"]), *server]) == 0
    out = capsys.readouterr().out
    assert "went again" not in out and "in effect again" not in out
    assert "already in effect under the key that follows" in out and "replayed, not stored twice" in out
    assert out.rstrip().endswith(f"; key r1-{sha}-2")
    assert Submission.objects.filter(client=world.client_a).count() == 3
