"""A client sends only what the global compendium it pulled does not already cover."""

from __future__ import annotations

import json

import pytest

from compendium.client_cli import main
from compendium.delta import delta_since
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
    # Above 1 the routing rule is off; with nothing pulled nothing is routed.
    off, off_report = delta_since(local, pulled, engine, tau=0.99, route=route, confidence=1.01)
    assert off.scenarios == local.scenarios and off_report.scenarios_routed == 0
    same, _ = delta_since(local, Compendium(), engine, route=route)
    assert same == local and len(asked) == 1
    # A router that answers for the wrong number of texts is an error, not a silent drop.
    with pytest.raises(ValueError, match="2 decisions for 3 texts"):
        delta_since(local, pulled, engine, tau=0.99, route=lambda texts: route(texts)[:2])


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
    assert ("1 scenario(s) (0 of them already routed right by it) and 0 precaution(s) already "
            "covered") in capsys.readouterr().out
    full = json.loads((tmp_path / "full.json").read_text())
    delta = json.loads((tmp_path / "delta.json").read_text())
    assert len(full["scenarios"]) == 2
    assert [s["tool_id"] for s in delta["scenarios"]] == ["flights"]
    report = json.loads((tmp_path / "delta.json.report.json").read_text())
    assert report["delta"]["scenarios_covered"] == 1
    (tmp_path / "broken.json").write_text("{")
    assert main(args[:-1] + [str(tmp_path / "broken.json"), "--out", str(tmp_path / "x.json")]) == 1


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


def test_cli_build_min_users_withholds_what_one_user_alone_asked(tmp_path, capsys):
    schema = {"tools": [{"tool_id": "weather", "description": "Weather forecasts for a city"}]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    lines = [
        {"query": "Will it rain tomorrow?", "tool": "weather", "outcome": "success",
         "latency_ms": 90, "user": user}
        for user in ("u1", "u2")
    ] + [{"query": "UV index in Madrid at noon", "tool": "weather", "outcome": "success",
          "latency_ms": 90, "user": "u1"}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["build", "--log", str(tmp_path / "log.jsonl"), "--schema", str(tmp_path / "schema.json"),
            "--lambda", "0", "--quiet", "--out", str(tmp_path / "c.json")]
    assert main(args + ["--min-users", "2"]) == 0
    assert "Withheld (fewer than 2 users): 1 scenario(s)" in capsys.readouterr().out
    sent = json.loads((tmp_path / "c.json").read_text())
    assert [s["text"] for s in sent["scenarios"]] == ["Will it rain tomorrow?"]
    assert main(args + ["--min-users", "0"]) == 1
    assert "--min-users must be at least 1" in capsys.readouterr().err
