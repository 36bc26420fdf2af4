"""A client sends only what the global compendium it pulled does not already cover."""

from __future__ import annotations

import json

import pytest

from compendium import transport
from compendium.canonical import canonical_bytes, entry_size
from compendium.client_cli import main
from compendium.delta import delta_since, fit_budget
from compendium.schema import Compendium
from routing.embeddings import get_engine


@pytest.fixture(scope="module")
def engine():
    return get_engine()


def comp(scenarios=(), precautions=(), templates=(), metadata=()):
    return Compendium.model_validate(
        {
            "scenarios": [{"tool_id": t, "text": x} for t, x in scenarios],
            "precautions": [{"tool_id": t, "text": x} for t, x in precautions],
            "templates": list(templates),
            "metadata": list(metadata),
        }
    )


def test_covered_entries_are_left_out_and_new_ones_kept(engine):
    pulled = comp(
        scenarios=[("weather", "Will it rain tomorrow in Paris?")],
        precautions=[("calculator", "Do not use calculator for requests like: currency rates")],
        templates=[{"tool_id": "weather", "signature": "f(city)", "template": "Forecast {city}"}],
    )
    local = comp(
        scenarios=[
            ("weather", "Will it rain tomorrow in Paris"),  # a paraphrase: covered
            ("flights", "Will it rain tomorrow in Paris?"),  # same text, other tool: not covered
            ("weather", "UV index at noon in Madrid"),  # new
        ],
        precautions=[("calculator", "Do not use calculator for requests like: currency rates!")],
        templates=[
            {"tool_id": "weather", "signature": "f(city)", "template": "Forecast {city}"},
            {"tool_id": "weather", "signature": "g(day)", "template": "Forecast on {day}"},
        ],
        metadata=[{"tool_id": "weather", "stats": {"success_rate": 0.8}}],
    )
    delta, report = delta_since(local, pulled, engine, tau=0.85)
    assert [(s.tool_id, s.text) for s in delta.scenarios] == [
        ("flights", "Will it rain tomorrow in Paris?"),
        ("weather", "UV index at noon in Madrid"),
    ]
    assert delta.precautions == [] and report.precautions_covered == 1
    assert [t.signature for t in delta.templates] == ["g(day)"]
    assert delta.metadata == local.metadata  # this round's statistics are always sent
    assert report.scenarios_covered == 1 and report.scenarios_kept == 2
    same, _ = delta_since(local, Compendium(), engine)
    assert same == local


def test_a_scenario_under_other_preconditions_is_not_covered_nor_taken_as_sent(engine):
    """The pulled global's "rain in Paris" needs a city; this client's says it does not: another
    case, which the edge's consistency check must see, not a paraphrase left out as covered."""
    from compendium.delta import sent_keys, without_sent

    def flagged(has_city):
        return Compendium.model_validate({"scenarios": [
            {"tool_id": "weather", "text": "Will it rain tomorrow in Paris?",
             "preconditions": {"has_city": has_city}}]})

    delta, report = delta_since(flagged(False), flagged(True), engine, tau=0.85)
    assert len(delta.scenarios) == 1 and report.scenarios_covered == 0
    delta, report = delta_since(flagged(True), flagged(True), engine, tau=0.85)
    assert delta.scenarios == [] and report.scenarios_covered == 1
    kept, dropped = without_sent(flagged(False), sent_keys(flagged(True)))
    assert dropped == 0 and len(kept.scenarios) == 1
    # a scenario without preconditions keeps the key it had (records written before still match)
    plain = comp(scenarios=[("weather", "Will it rain tomorrow in Paris?")])
    import hashlib

    assert sent_keys(plain) == {hashlib.sha256(
        b"s\0weather\0Will it rain tomorrow in Paris?").hexdigest()[:32]}


def test_scenarios_the_pulled_router_already_gets_right_are_left_out(engine):
    pulled = comp(scenarios=[("weather", "Will it rain tomorrow in Paris?"),
                             ("flights", "Find a cheap flight to Rome")])
    local = comp(scenarios=[
        ("weather", "Do I need an umbrella in Oslo on Sunday"),  # routed right, confident: out
        ("flights", "Any seats left to Lisbon next week"),  # routed right, unsure: kept
        ("weather", "Is the Rome flight on time"),  # routed to another tool: kept
    ])
    answers = {
        "Do I need an umbrella in Oslo on Sunday": ("weather", 0.9),
        "Any seats left to Lisbon next week": ("flights", 0.3),
        "Is the Rome flight on time": ("flights", 0.95),
    }
    asked = []

    def route(texts):
        asked.append(list(texts))
        return [answers[t] for t in texts]

    delta, report = delta_since(local, pulled, engine, tau=0.99, route=route, confidence=0.5)
    assert [s.text for s in delta.scenarios] == [
        "Any seats left to Lisbon next week", "Is the Rome flight on time"
    ]
    assert (report.scenarios_covered, report.scenarios_routed, report.scenarios_kept) == (1, 1, 2)
    assert asked == [[s.text for s in local.scenarios]]
    # Above 1 the routing rule is off; with nothing pulled and no router nothing is left out.
    off, off_report = delta_since(local, pulled, engine, tau=0.99, route=route, confidence=1.01)
    assert off.scenarios == local.scenarios and off_report.scenarios_routed == 0
    same, _ = delta_since(local, Compendium(), engine)
    assert same == local and len(asked) == 1
    # Before any global (nothing pulled, the public probe set's router): the routing rule alone.
    first, first_report = delta_since(local, Compendium(), engine, route=route, confidence=0.5)
    assert [s.text for s in first.scenarios] == ["Any seats left to Lisbon next week",
                                                  "Is the Rome flight on time"]
    assert (first_report.scenarios_covered, first_report.scenarios_routed) == (1, 1)
    assert asked[-1] == [s.text for s in local.scenarios]
    # A router that answers for the wrong number of texts is an error, not a silent drop.
    with pytest.raises(ValueError, match="2 decisions for 3 texts"):
        delta_since(local, pulled, engine, tau=0.99, route=lambda texts: route(texts)[:2])


def test_precautions_whose_request_the_pulled_router_already_sends_elsewhere_are_left_out(engine):
    pulled = comp(scenarios=[("weather", "Will it rain tomorrow in Paris?"),
                             ("flights", "Find a cheap flight to Rome")])
    avoided = "Do not use weather for requests like: Any seats left to Lisbon (use flights instead)"
    still_chosen = "Do not use flights for requests like: Is the Rome flight on time"
    unsure = "Do not use weather for requests like: Cheap hotels near the airport"
    other_wording = "Never call weather for flight bookings"
    local = comp(precautions=[("weather", avoided), ("flights", still_chosen),
                              ("weather", unsure), ("weather", other_wording)])
    answers = {
        "Any seats left to Lisbon": ("flights", 0.9),  # the global already avoids weather: out
        "Is the Rome flight on time": ("flights", 0.95),  # still sent to flights: kept
        "Cheap hotels near the airport": ("flights", 0.3),  # elsewhere, but unsure: kept
    }
    asked = []

    def route(texts):
        asked.append(list(texts))
        return [answers[t] for t in texts]

    delta, report = delta_since(local, pulled, engine, tau=0.99, route=route, confidence=0.5)
    assert [p.text for p in delta.precautions] == [still_chosen, unsure, other_wording]
    assert (report.precautions_covered, report.precautions_routed) == (1, 1)
    # Only the requests are routed ("(use Y instead)" is not part of one); other wording is not.
    assert asked == [["Any seats left to Lisbon", "Is the Rome flight on time",
                      "Cheap hotels near the airport"]]
    off, off_report = delta_since(local, pulled, engine, tau=0.99, route=route, confidence=1.01)
    assert off.precautions == local.precautions and off_report.precautions_routed == 0


TWO_TOOLS = {
    "tools": [
        {"tool_id": "weather", "description": "Weather forecasts for a city"},
        {"tool_id": "flights", "description": "Search and book flights"},
    ],
}


def write_client(tmp_path, queries, pulled):
    """schema.json (two tools), log.jsonl of (query, tool) lines by distinct users, global.json;
    the `build --since` arguments without --out."""
    (tmp_path / "schema.json").write_text(json.dumps(TWO_TOOLS))
    lines = [
        {"query": q, "tool": t, "outcome": "success", "latency_ms": 120, "user": f"u{i}"}
        for i, (q, t) in enumerate(queries)
    ]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "global.json").write_text(pulled.model_dump_json())
    return ["build", "--log", str(tmp_path / "log.jsonl"), "--schema", str(tmp_path / "schema.json"),
            "--lambda", "0", "--quiet", "--since", str(tmp_path / "global.json")]


def test_cli_build_since_a_pulled_global(tmp_path, capsys):
    args = write_client(
        tmp_path,
        [("Will it rain tomorrow in Paris?", "weather"), ("Find a cheap flight to Rome", "flights")],
        comp(scenarios=[("weather", "Will it rain tomorrow in Paris?")]),
    )
    assert main(args[:-2] + ["--out", str(tmp_path / "full.json")]) == 0
    assert main(args + ["--out", str(tmp_path / "delta.json")]) == 0
    assert ("1 scenario(s) (0 of them already routed right by it) and 0 precaution(s) (0 of them "
            "about requests it already sends to another tool) already covered") in capsys.readouterr().out
    full = json.loads((tmp_path / "full.json").read_text())
    delta = json.loads((tmp_path / "delta.json").read_text())
    assert len(full["scenarios"]) == 2
    assert [s["tool_id"] for s in delta["scenarios"]] == ["flights"]
    report = json.loads((tmp_path / "delta.json.report.json").read_text())
    assert report["delta"]["scenarios_covered"] == 1
    (tmp_path / "broken.json").write_text("{")
    assert main(args[:-1] + [str(tmp_path / "broken.json"), "--out", str(tmp_path / "x.json")]) == 1
    # The global saved as GET /api/v1/compendium/global/ answers it (curl -o) reads the same.
    pulled = json.loads((tmp_path / "global.json").read_text())
    (tmp_path / "body.json").write_text(
        json.dumps({"round": 1, "sha256": "ab" * 32, "published_at": None, "compendium": pulled})
    )
    assert main(args[:-1] + [str(tmp_path / "body.json"), "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text()) == delta


def test_cli_build_since_leaves_out_what_the_pulled_global_already_routes(tmp_path, capsys):
    args = write_client(
        tmp_path,
        [("Is it going to be sunny in Madrid on Friday?", "weather"),
         ("Find a cheap flight to Rome", "flights")],
        comp(scenarios=[("weather", "Will it rain tomorrow in Paris?"),
                        ("flights", "Find a cheap flight to Rome")]),
    )
    # The rule off: only the cosine rule applies, and the new weather question is sent.
    assert main(args + ["--out", str(tmp_path / "off.json"), "--since-confidence", "2"]) == 0
    assert [s["tool_id"] for s in json.loads((tmp_path / "off.json").read_text())["scenarios"]] == [
        "weather"
    ]
    # Confidence 0: whatever the pulled global's router already sends to its tool stays local.
    assert main(args + ["--out", str(tmp_path / "on.json"), "--since-confidence", "0"]) == 0
    assert json.loads((tmp_path / "on.json").read_text())["scenarios"] == []
    assert "2 scenario(s) (1 of them already routed right by it)" in capsys.readouterr().out
    report = json.loads((tmp_path / "on.json.report.json").read_text())
    assert report["delta"]["scenarios_routed"] == 1
    assert main(args + ["--out", str(tmp_path / "x.json"), "--since-confidence", "-1"]) == 1
    assert "--since-confidence must be at least 0" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def probe_document(pairs: list[tuple[str, str]], *, tools: bool = True) -> dict:
    """A probe set as GET /api/v1/compendium/probe/ serves it (and fetch-probe saves it)."""
    texts = [q for q, _ in pairs]
    doc = {"count": len(texts), "sha256": transport.dictionary_hash(transport.probe_bytes(texts)),
           "texts": texts}
    return dict(doc, tools=[t for _, t in pairs]) if tools else doc


PROBE = [
    *[(f"What is the weather forecast for {city} tomorrow?", "weather")
      for city in ("Paris", "Oslo", "Rome", "Lisbon", "Madrid", "Berlin", "Vienna", "Prague")],
    *[(f"Find me a cheap flight from {a} to {b}", "flights")
      for a, b in (("Paris", "Rome"), ("Oslo", "Berlin"), ("Madrid", "Lisbon"), ("Vienna", "Prague"),
                   ("Rome", "Oslo"), ("Berlin", "Madrid"), ("Lisbon", "Vienna"), ("Prague", "Paris"))],
]


def test_cli_build_probe_leaves_out_what_the_public_probe_set_already_routes(tmp_path, capsys):
    """Before any global is published, `build --probe` (what participate passes in round 1) routes
    with the public probe set alone and leaves out what that router already sends to its tool."""
    queries = [("What is the weather forecast for Zurich tomorrow?", "weather"),
               ("Find me a cheap flight from Zurich to Athens", "flights"),
               ("Book a table for two at an Italian restaurant", "flights")]
    args = write_client(tmp_path, queries, Compendium())[:-2]
    probe_path = tmp_path / "probe.json"
    probe_path.write_text(json.dumps(probe_document(PROBE)))
    assert main(args + ["--out", str(tmp_path / "all.json")]) == 0
    assert main(args + ["--out", str(tmp_path / "first.json"), "--probe", str(probe_path),
                        "--since-confidence", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"Against the public probe set ({probe_path}): 2 scenario(s)" in out
    everything = json.loads((tmp_path / "all.json").read_text())["scenarios"]
    sent = json.loads((tmp_path / "first.json").read_text())["scenarios"]
    assert len(everything) == 3
    # Its router is unsure the restaurant request is for "flights" (no tool fits it): it is sent.
    assert [s["text"] for s in sent] == ["Book a table for two at an Italian restaurant"]
    report = json.loads((tmp_path / "first.json.report.json").read_text())
    assert report["delta"]["scenarios_routed"] == 2
    # The rule off: everything goes; a probe set without tools (an older server): everything,
    # with a warning.
    assert main(args + ["--out", str(tmp_path / "off.json"), "--probe", str(probe_path),
                        "--since-confidence", "2"]) == 0
    assert len(json.loads((tmp_path / "off.json").read_text())["scenarios"]) == 3
    probe_path.write_text(json.dumps(probe_document(PROBE, tools=False)))
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "old.json"), "--probe", str(probe_path),
                        "--since-confidence", "0"]) == 0
    assert "has no tools (fetched from an older server; fetch-probe again)" in capsys.readouterr().err
    assert len(json.loads((tmp_path / "old.json").read_text())["scenarios"]) == 3
    # A damaged probe set, or --probe with --since, is refused before anything is built.
    probe_path.write_text(json.dumps(dict(probe_document(PROBE), tools=["weather"])))
    assert main(args + ["--out", str(tmp_path / "bad.json"), "--probe", str(probe_path)]) == 1
    assert "is not a probe set: it has 1 tool id(s) for 16 request(s)" in capsys.readouterr().err
    probe_path.write_text(json.dumps(probe_document(PROBE)))
    assert main(args + ["--out", str(tmp_path / "bad.json"), "--probe", str(probe_path),
                        "--since", str(tmp_path / "global.json")]) == 1
    assert "--probe is for before any global is published" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


def test_cli_build_probe_routes_to_no_tool_the_schema_does_not_offer(tmp_path, capsys, monkeypatch):
    """`build --probe` routes with the probe's requests labelled with a tool of the schema in
    force only: a request the server gives no tool (`labels` null) is left out, and so is one
    labelled with a tool out of the schema (deactivated: a probe.json from an older server, which
    still names it in `tools`), so the probe's router never names a deactivated tool."""
    import routing.cli

    handed = []
    real = routing.cli.probe_router

    def spy(probe, **kwargs):
        handed.append(list(probe))
        return real(probe, **kwargs)

    monkeypatch.setattr(routing.cli, "probe_router", spy)
    trains = [(f"Book a train from {a} to {b}", "trains") for a, b in (("Paris", "Rome"),
                                                                      ("Oslo", "Berlin"))]
    queries = [("What is the weather forecast for Zurich tomorrow?", "weather"),
               ("Find me a cheap flight from Zurich to Athens", "flights")]
    args = write_client(tmp_path, queries, Compendium())[:-2]
    probe_path = tmp_path / "probe.json"
    older = probe_document(PROBE + trains)  # `tools` only, naming "trains"
    probe_path.write_text(json.dumps(older))
    assert main(args + ["--out", str(tmp_path / "older.json"), "--probe", str(probe_path)]) == 0
    newer = dict(older, labels=[t for _, t in PROBE] + [None, None])
    del newer["tools"]
    probe_path.write_text(json.dumps(newer))
    assert main(args + ["--out", str(tmp_path / "newer.json"), "--probe", str(probe_path)]) == 0
    assert handed == [PROBE, PROBE]
    # Nothing left to route with: every scenario is sent, with a warning saying why.
    probe_path.write_text(json.dumps(dict(newer, labels=[None] * len(newer["texts"]))))
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "none.json"), "--probe", str(probe_path),
                        "--since-confidence", "0"]) == 0
    assert "labels none of its requests with a tool of the schema" in capsys.readouterr().err
    assert len(json.loads((tmp_path / "none.json").read_text())["scenarios"]) == 2
    assert len(handed) == 2


def weather_build_args(tmp_path, queries: list[tuple[str, str]]) -> list[str]:
    """`synapse-client build` arguments (λ = 0) for a one-tool schema and a log of (query, user)
    successes."""
    schema = {"tools": [{"tool_id": "weather", "description": "Weather forecasts for a city"}]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    lines = [{"query": q, "tool": "weather", "outcome": "success", "latency_ms": 90, "user": u}
             for q, u in queries]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["build", "--log", str(tmp_path / "log.jsonl"), "--schema", str(tmp_path / "schema.json"),
            "--lambda", "0", "--quiet", "--out", str(tmp_path / "c.json")]


def test_cli_build_min_users_withholds_what_one_user_alone_asked(tmp_path, capsys):
    args = weather_build_args(tmp_path, [("Will it rain tomorrow?", "u1"), ("Will it rain tomorrow?", "u2"),
                                         ("UV index in Madrid at noon", "u1")])
    assert main(args + ["--min-users", "2"]) == 0
    assert "Withheld (fewer than 2 users): 1 scenario(s)" in capsys.readouterr().out
    sent = json.loads((tmp_path / "c.json").read_text())
    assert [s["text"] for s in sent["scenarios"]] == ["Will it rain tomorrow?"]
    assert main(args + ["--min-users", "0"]) == 1
    assert "--min-users must be at least 1" in capsys.readouterr().err


def test_cli_build_pool_users_sends_pools_not_requests(tmp_path, capsys):
    args = weather_build_args(tmp_path, [("Will it rain tomorrow in Oslo?", "u1"),
                                         ("Will it rain tomorrow?", "u2"),
                                         ("UV index in Madrid at noon", "u1")])
    assert main(args + ["--pool-users", "2"]) == 0
    assert "Pooled: 1 pool(s) of at least 2 users" in capsys.readouterr().out
    sent = json.loads((tmp_path / "c.json").read_text())
    assert [(s["text"], s["support"]) for s in sent["scenarios"]] == [("will it rain tomorrow", 3)]
    assert main(args + ["--pool-users", "0"]) == 1
    assert "--pool-users must be at least 1" in capsys.readouterr().err
    assert main(args + ["--pool-users", "2", "--no-collapse"]) == 1
    assert "--pool-users needs the embedding model" in capsys.readouterr().err


def budget_case():
    """Three tools; weather has three scenarios, the others one each; and this round's stats."""
    return comp(
        scenarios=[
            ("weather", "Will it rain tomorrow in Paris?"),
            ("weather", "Do I need an umbrella in Oslo on Sunday?"),
            ("weather", "How windy is it on the coast of Brittany this afternoon?"),
            ("flights", "Any seats left to Lisbon next week?"),
            ("hotels", "A quiet room near the station in Porto"),
        ],
        precautions=[("flights", "Do not use flights for requests like: train times")],
        metadata=[{"tool_id": t, "stats": {"calls": 2.5}} for t in ("weather", "flights", "hotels")],
    )


def test_a_budget_sends_the_statistics_then_scenarios_in_turns_over_tools_most_supported_first():
    local = budget_case()
    support = {  # weather's are the most supported, yet each tool gets one before weather two
        "Will it rain tomorrow in Paris?": 9,
        "Do I need an umbrella in Oslo on Sunday?": 8,
        "How windy is it on the coast of Brittany this afternoon?": 7,
        "Any seats left to Lisbon next week?": 2,
        "A quiet room near the station in Porto": 1,
    }
    local = local.model_copy(
        update={"scenarios": [s.model_copy(update={"support": support[s.text]}) for s in local.scenarios]}
    )
    full = len(canonical_bytes(local))
    same, report = fit_budget(local, full)
    assert same == local and report.bytes_after == full and report.scenarios_deferred == 0
    stats_only = local.model_copy(update={"scenarios": [], "precautions": []})
    base = len(canonical_bytes(stats_only))
    sizes = {s.text: entry_size("scenarios", s) for s in local.scenarios}
    order = [  # weather's most supported, then flights', then hotels', then weather's second
        "Will it rain tomorrow in Paris?",
        "Any seats left to Lisbon next week?",
        "A quiet room near the station in Porto",
        "Do I need an umbrella in Oslo on Sunday?",
    ]
    budget = base + sum(sizes[t] for t in order[:3])
    cut, report = fit_budget(local, budget)
    assert sorted(s.text for s in cut.scenarios) == sorted(order[:3])
    assert cut.metadata == local.metadata and cut.precautions == []
    assert len(canonical_bytes(cut)) <= budget == report.max_bytes
    assert (report.scenarios_deferred, report.precautions_deferred) == (2, 1)
    assert report.bytes_after == len(canonical_bytes(cut)) and report.bytes_before == full
    # Room for one more: weather's second goes before any precaution.
    more, _ = fit_budget(local, budget + sizes[order[3]])
    assert sorted(s.text for s in more.scenarios) == sorted(order) and more.precautions == []
    # Two bytes less and hotels' no longer fits; nothing shorter is left to take its place.
    fewer, _ = fit_budget(local, budget - 2)
    assert sorted(s.text for s in fewer.scenarios) == sorted(order[:2])
    # Statistics are never cut: a budget below them sends them alone, and says so.
    tiny, tiny_report = fit_budget(local, 10)
    assert tiny == stats_only and tiny_report.bytes_after == base > 10


def test_what_does_not_fit_is_sent_in_a_later_round(engine):
    """Round 1 sends what fits; the server carries it forward, so round 2's delta leaves it out
    and the budget goes to what was held back."""
    local = comp(
        scenarios=[(t, q) for t, q in [
            ("weather", "Will it rain tomorrow in Paris?"),
            ("weather", "How strong is the wind on the Brittany coast today?"),
            ("weather", "What is the UV index at noon in Madrid?"),
            ("flights", "Book a business class ticket from Tokyo to Sydney"),
            ("flights", "Which airlines fly direct from Boston to Dublin?"),
            ("flights", "Is flight AF1234 delayed?"),
        ]],
        metadata=[{"tool_id": t, "stats": {"calls": 2.5}} for t in ("weather", "flights")],
    )
    stats_only = len(canonical_bytes(local.model_copy(update={"scenarios": []})))
    budget = stats_only + sum(sorted(entry_size("scenarios", s) for s in local.scenarios)[-2:])
    first, report = fit_budget(local, budget)
    assert len(first.scenarios) == 2 and report.scenarios_deferred == 4
    assert {s.tool_id for s in first.scenarios} == {"weather", "flights"}
    pulled = first.model_copy(update={"metadata": []})  # the global now holds what was sent
    delta, _ = delta_since(local, pulled, engine, tau=0.85)
    second, _ = fit_budget(delta, budget)
    sent_first = {s.text for s in first.scenarios}
    assert len(second.scenarios) == 2 and not sent_first & {s.text for s in second.scenarios}
    third, _ = fit_budget(delta_since(local, pulled.model_copy(
        update={"scenarios": first.scenarios + second.scenarios}), engine, tau=0.85)[0], budget)
    assert {s.text for s in first.scenarios + second.scenarios + third.scenarios} == {
        s.text for s in local.scenarios
    }


def test_cli_build_max_bytes_sends_at_most_the_budget(tmp_path, capsys):
    queries = [(q, "weather") for q in (
        "Will it rain tomorrow in Paris?", "Is a heatwave coming to Seville this summer?",
        "How strong is the wind on the Brittany coast today?", "Should I expect snow in Oslo?",
        "What is the UV index at noon in Madrid?", "Is there fog at dawn over San Francisco?",
    )]
    queries += [(q, "flights") for q in (
        "Find a cheap flight to Rome", "Any seats left to Lisbon next week?",
        "Book a business class ticket from Tokyo to Sydney", "Is flight AF1234 delayed?",
        "Which airlines fly direct from Boston to Dublin?", "Cheapest way to get to Iceland in May",
    )]
    args = write_client(tmp_path, queries, comp())[:-2]
    assert main(args + ["--out", str(tmp_path / "full.json")]) == 0
    assert main(args + ["--out", str(tmp_path / "cut.json"), "--max-bytes", "900"]) == 0
    assert "Over the budget of 900 bytes:" in capsys.readouterr().out
    cut = Compendium.model_validate_json((tmp_path / "cut.json").read_text())
    assert len(canonical_bytes(cut)) <= 900
    assert {s.tool_id for s in cut.scenarios} == {"weather", "flights"}
    report = json.loads((tmp_path / "cut.json.report.json").read_text())
    full = json.loads((tmp_path / "full.json").read_text())
    assert len(canonical_bytes(Compendium.model_validate(full))) > 900
    assert report["budget"]["scenarios_deferred"] == len(full["scenarios"]) - len(cut.scenarios) > 0
    assert main(args + ["--out", str(tmp_path / "x.json"), "--max-bytes", "0"]) == 1
    assert "--max-bytes must be a positive number of bytes, not 0" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_cli_build_releases_words_enough_users_wrote_and_refuses_k_of_1(tmp_path, capsys):
    schema = {"tools": [{"tool_id": "crypto", "description": "Prices of coins"}]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    lines = [
        {"query": f"what is the ethereum price {when}", "tool": "crypto", "outcome": "success",
         "latency_ms": 90, "user": user}
        for user, when in (("u1", "today"), ("u2", "now"))
    ]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["build", "--log", str(tmp_path / "log.jsonl"), "--schema", str(tmp_path / "schema.json"),
            "--quiet", "--no-collapse", "--out", str(tmp_path / "c.json")]

    def sent() -> str:
        return " ".join(s["text"] for s in json.loads((tmp_path / "c.json").read_text())["scenarios"])

    assert main(args) == 0  # the default: K = 2
    assert "word(s) that at least 2 users wrote" in capsys.readouterr().out
    assert "ethereum" in sent()
    assert main(args + ["--shared-word-users", "0"]) == 0
    assert "ethereum" not in sent()
    assert main(args + ["--shared-word-users", "1"]) == 1
    assert "--shared-word-users must be 0 (off) or at least 2" in capsys.readouterr().err
