"""Usage log -> local compendium: valid under the MetaTool schema, nothing private left in it,
near-duplicates collapsed, and the whole toolkit runs without Django."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from compendium.builder import BuildError, BuildOptions, build_compendium
from compendium.canonical import canonical_form
from compendium.client_cli import main
from compendium.masking import TextMasker
from compendium.schema import Compendium
from compendium.usage_log import parse_lines
from compendium.validation import validate_compendium
from tests.client_fixtures import PLANTED, metatool_schema, usage_records, write_log
from tests.conftest import ROOT


def secrets() -> list[str]:
    return [part for name, email, phone, number in PLANTED
            for part in (*name.split(), email, phone, number)]


def parsed(records):
    log = parse_lines([json.dumps(r) for r in records], known_tools=metatool_schema().tool_ids)
    assert not log.errors
    return log.records


@pytest.mark.parametrize(("options", "says"), [
    ({"field_cap": 2**31}, "^field_cap must be a whole number from 1 to 2147483647, not 2147483648$"),
    ({"field_cap": 0}, "^field_cap must be a whole number from 1 to 2147483647, not 0$"),
    ({"seed": 2**63}, r"^seed must be a whole number from -2\*\*63 to 2\*\*63-1, not 9223372036854775808$"),
])
def test_build_options_no_compendium_can_record_are_refused_by_their_name_before_any_work(
        options, says):
    """The library's callers (the simulation, the demo, tooling) pass F* and the seed as
    BuildOptions: past the columns a compendium records them in, the build ran to its end and
    failed there as pydantic's report on Compendium, several lines (F* = 0 as clipping's
    "the field cap F* must be at least 1")."""
    with pytest.raises(BuildError, match=says):
        build_compendium(parsed(usage_records(users=2, lines=20)), metatool_schema(),
                         BuildOptions(collapse=False, **options))


def test_a_log_of_several_users_builds_a_valid_compendium():
    records = usage_records(users=6, lines=240)
    schema = metatool_schema()
    compendium, report = build_compendium(parsed(records), schema, BuildOptions(collapse=False))
    assert validate_compendium(compendium, schema).ok
    assert compendium.num_users == 6 == report.num_users
    assert compendium.masking.strength == 1.0 and compendium.masking.seed == 0
    assert 0 < compendium.masking.masked_fraction < 0.5

    outcomes = Counter(r["outcome"] for r in records)
    served = Counter(
        r["tool"] if r["outcome"] == "success" else r["corrected_to"]
        for r in records if r["outcome"] != "failure"
    )
    assert sum(s.support for s in compendium.scenarios) == outcomes["success"] + outcomes["corrected"]
    by_tool = Counter()
    for s in compendium.scenarios:
        by_tool[s.tool_id] += s.support
    assert by_tool == served
    assert sum(p.support for p in compendium.precautions) == outcomes["failure"] + outcomes["corrected"]
    assert all(p.text.startswith(f"Do not use {p.tool_id} for requests like: ")
               for p in compendium.precautions)
    corrected = {(r["tool"], r["corrected_to"]) for r in records if r["outcome"] == "corrected"}
    assert {
        (p.tool_id, p.text.rsplit("(use ", 1)[1].removesuffix(" instead)"))
        for p in compendium.precautions if p.text.endswith(" instead)")
    } == corrected
    assert any(s.preconditions for s in compendium.scenarios)
    assert {t.signature for t in compendium.templates} == {"ask(question)"}
    assert all("{question}" in t.template for t in compendium.templates)
    called = {r["tool"] for r in records}
    assert {m.tool_id for m in compendium.metadata} == called
    assert all(set(m.stats) == {"calls", "success_rate", "frequency", "latency_ms"}
               for m in compendium.metadata)

    sent = canonical_form(compendium).data.decode()
    assert not [s for s in secrets() if s in sent]
    assert "user-" not in sent  # user ids stay on the client


def test_same_log_and_seed_give_the_same_bytes():
    records = parsed(usage_records(users=4, lines=120, seed=9))
    schema = metatool_schema()
    a, _ = build_compendium(records, schema, BuildOptions(collapse=False, seed=3, field_cap=2))
    b, _ = build_compendium(list(reversed(records)), schema,
                            BuildOptions(collapse=False, seed=3, field_cap=2))
    assert canonical_form(a).sha256 == canonical_form(b).sha256


def test_the_compendium_records_the_field_cap_it_was_built_with():
    # The server refuses a capped round's statistics unless the compendium records a cap no
    # larger than the round's: the build writes it into the typed artifact, not only the report.
    records = parsed(usage_records(users=4, lines=120, seed=9))
    schema = metatool_schema()
    capped, report = build_compendium(records, schema, BuildOptions(collapse=False, field_cap=2))
    assert capped.field_cap == report.field_cap == 2
    assert canonical_form(capped).document["field_cap"] == 2
    uncapped, _ = build_compendium(records, schema, BuildOptions(collapse=False))
    assert uncapped.field_cap is None
    # no cap, nothing recorded: the canonical bytes of an uncapped build (and of every compendium
    # from before the field) are what they were
    assert "field_cap" not in canonical_form(uncapped).document
    assert Compendium.model_validate_json(canonical_form(capped).data).field_cap == 2


def test_masked_fraction_grows_with_lambda():
    records = parsed(usage_records(users=3, lines=150, seed=4))
    schema = metatool_schema()
    fractions = [
        build_compendium(records, schema, BuildOptions(collapse=False, strength=lam))[0]
        .masking.masked_fraction
        for lam in (0, 0.5, 1.0, 1.5)
    ]
    assert fractions[0] == 0
    assert fractions[0] < fractions[1] < fractions[2] < fractions[3]


def test_long_queries_are_cut_to_the_declared_limit():
    schema = metatool_schema()
    long_query = "Please compare the weather forecast across many cities " * 60
    records = parsed([
        {"query": long_query, "tool": "WeatherTool", "outcome": "success", "latency_ms": 5, "user": 1},
        {"query": long_query, "tool": "NewsTool", "outcome": "failure", "latency_ms": 5, "user": 1},
    ])
    compendium, _ = build_compendium(records, schema, BuildOptions(collapse=False))
    assert validate_compendium(compendium, schema).ok
    assert len(compendium.scenarios[0].text) <= schema.strings.scenario
    assert len(compendium.precautions[0].text) <= schema.strings.precaution


@pytest.mark.slow
@pytest.mark.parametrize(
    "limits",
    [{"scenarios": 10}, {"precautions": 3}, {"bytes": 25000}, {"scenarios": 5, "precautions": 2}],
)
def test_a_log_bigger_than_one_compendium_may_hold_keeps_the_most_supported(limits):
    # It failed with "the built compendium is not valid under the schema: $.scenarios: N
    # entries; the limit is L", and --max-bytes could not help: it runs after that check.
    schema = metatool_schema()
    schema = schema.model_copy(update={"limits": schema.limits.model_copy(update=limits)})
    records = parsed(usage_records(users=6, lines=240))
    full, _ = build_compendium(records, metatool_schema(), BuildOptions(collapse=False))
    compendium, report = build_compendium(records, schema, BuildOptions(collapse=False))
    assert validate_compendium(compendium, schema).ok
    assert len(compendium.scenarios) <= schema.limits.scenarios
    assert len(compendium.precautions) <= schema.limits.precautions
    assert len(canonical_form(compendium).data) <= schema.limits.bytes
    assert report.over_limit_scenarios == len(full.scenarios) - len(compendium.scenarios)
    assert report.over_limit_precautions == len(full.precautions) - len(compendium.precautions)
    assert report.over_limit_scenarios + report.over_limit_precautions > 0
    assert compendium.metadata == full.metadata  # the statistics always go
    # the most supported first: nothing left out is supported more than what was kept
    kept = {(s.tool_id, s.text) for s in compendium.scenarios}
    left = [s.support for s in full.scenarios if (s.tool_id, s.text) not in kept]
    if left and compendium.scenarios and "bytes" not in limits:
        assert max(left) <= max(s.support for s in compendium.scenarios)


def test_a_usage_line_with_more_flags_than_the_schema_allows_is_a_bad_line(tmp_path, capsys):
    # It failed the whole build ("$.scenarios[0].preconditions: 40 flags; the limit is 32")
    # naming no line, and --skip-bad-lines could not skip it.
    records = usage_records(users=3, lines=20)
    records[4] = {**records[4], "preconditions": {f"flag_{i}": True for i in range(40)}}
    log = write_log(tmp_path / "usage.jsonl", records)
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    args = ["build", "--log", str(log), "--schema", str(schema_path), "--out",
            str(tmp_path / "c.json"), "--no-collapse", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{log}:5: 'preconditions' has 40 flags; the schema allows at most 32" in err
    assert main([*args, "--skip-bad-lines"]) == 0


def test_build_draws_no_progress_bars_into_a_log_file(tmp_path, capsys):
    # Run from cron with stderr to a file, every frame of the bars (carriage returns) stayed in
    # the log. Bars are for a terminal; the summary lines are for everyone.
    log = write_log(tmp_path / "usage.jsonl", usage_records(users=3, lines=20))
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    assert main(["build", "--log", str(log), "--schema", str(schema_path), "--out",
                 str(tmp_path / "c.json"), "--no-collapse"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "it/s" not in captured.err
    assert "c.json: " in captured.out + captured.err


def test_near_duplicate_scenarios_are_collapsed_with_the_embedding_engine():
    from routing.embeddings import get_engine

    schema = metatool_schema()
    texts = [
        "What will the weather be like tomorrow in Lisbon?",
        "What will the weather be like in Lisbon tomorrow?",
        "How will the weather be tomorrow in Lisbon?",
        "Is there a tornado warning for this region right now?",
        "What will the weather be like tomorrow in Lisbon?",  # exact duplicate
    ]
    records = parsed([
        {"query": q, "tool": "WeatherTool", "outcome": "success", "latency_ms": 10, "user": f"u{i}"}
        for i, q in enumerate(texts)
    ])
    exact, _ = build_compendium(records, schema, BuildOptions(collapse=False))
    assert sorted(s.support for s in exact.scenarios) == [1, 1, 1, 2]

    collapsed, report = build_compendium(records, schema, BuildOptions(tau=0.85), get_engine())
    assert sorted(s.support for s in collapsed.scenarios) == [1, 4]
    assert report.scenarios_in == 5 and report.scenarios_out == 2
    kept = max(collapsed.scenarios, key=lambda s: s.support)
    assert "weather" in kept.text and "Lisbon" not in kept.text
    assert validate_compendium(collapsed, schema).ok


def test_cli_build_inspect_and_validate(tmp_path, capsys):
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    log = write_log(tmp_path / "usage.jsonl", usage_records(users=5, lines=100, seed=8))
    out = tmp_path / "compendium.json"
    assert main(["build", "--log", str(log), "--schema", str(schema_path), "--out", str(out),
                 "--lambda", "1.0", "--seed", "2", "--field-cap", "3", "--no-collapse",
                 "--quiet"]) == 0
    assert "5 users" in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    assert not [s for s in secrets() if s in text]

    assert main(["inspect", str(out), "--schema", str(schema_path)]) == 0
    shown = capsys.readouterr().out
    doc = json.loads(text)
    form = canonical_form(Compendium.model_validate_json(text))
    assert f"size: {form.size_bytes} bytes raw, {form.gzip_bytes} bytes gzip" in shown
    assert "masking: λ=1" in shown
    for scenario in doc["scenarios"]:
        assert scenario["text"] in shown
    for precaution in doc["precautions"]:
        assert precaution["text"] in shown
    assert "calls: per-user values clipped to [0, 50] (Δ=50)" in shown
    assert "field cap F*=3" in shown
    assert "field cap: F*=3 recorded" in shown  # the compendium's own record
    assert "validation: valid under the schema" in shown

    # A report edited into another shape is ignored with a word, not a traceback.
    report = out.with_name(out.name + ".report.json")
    report.write_text(json.dumps({"clip_bounds": {"calls": [0]}}), encoding="utf-8")
    assert main(["inspect", str(out), "--schema", str(schema_path)]) == 0
    shown = capsys.readouterr()
    assert "is not a report build wrote: ignored" in shown.err
    assert "contribution(s) left out" not in shown.out and "field cap: F*=3 recorded" in shown.out

    assert main(["validate", str(out), "--schema", str(schema_path)]) == 0
    assert "masked at λ = 1 as far as the server checks" in capsys.readouterr().out

    # validate checks the text as the server will: what masking at λ removes may not remain
    doc["scenarios"][0]["text"] += " for Mr. Pemberton, ticket 772910"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc), encoding="utf-8")
    assert main(["validate", str(edited), "--schema", str(schema_path)]) == 1
    err = capsys.readouterr().err
    assert "$.scenarios[0].text: not masked at λ = 1" in err and "Pemberton" not in err
    assert main(["validate", str(edited), "--schema", str(schema_path), "--lambda", "0"]) == 0
    del doc["masking"]
    edited.write_text(json.dumps(doc), encoding="utf-8")
    assert main(["validate", str(edited), "--schema", str(schema_path)]) == 0
    assert "masking not checked: it records no λ" in capsys.readouterr().out
    assert main(["validate", str(edited), "--schema", str(schema_path), "--lambda", "2"]) == 1


def test_inspect_reports_violations_and_fails(tmp_path, capsys):
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    doc = {"scenarios": [{"tool_id": "teleporter", "text": "beam me up"}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert main(["inspect", str(path), "--schema", str(schema_path)]) == 1
    assert "$.scenarios[0].tool_id" in capsys.readouterr().out


def test_toolkit_runs_without_django(tmp_path):
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    log = write_log(tmp_path / "usage.jsonl", usage_records(users=2, lines=30))
    code = (
        "import sys\n"
        "from compendium.client_cli import main\n"
        "import compendium.builder, compendium.client_api, compendium.masking\n"
        f"rc = main(['build', '--log', {str(log)!r}, '--schema', {str(schema_path)!r}, "
        f"'--out', {str(tmp_path / 'c.json')!r}, '--no-collapse', '--quiet'])\n"
        "rc = rc or main(['inspect', " + repr(str(tmp_path / "c.json")) + "])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'django')\n"
        "print('DJANGO', loaded)\n"
        "sys.exit(rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "DJANGO []" in done.stdout


def test_k_anonymous_release_sends_only_what_enough_users_support():
    from routing.embeddings import get_engine

    schema = metatool_schema()
    tool, other = sorted(schema.tool_ids)[:2]

    def line(query, user, chosen=tool, outcome="success"):
        out = {"query": query, "tool": chosen, "outcome": outcome, "latency_ms": 100, "user": user}
        if outcome == "corrected":
            out["corrected_to"] = tool
        return out

    records = parsed([
        line("Show me the weather forecast for tomorrow", "u1"),
        line("Show me the weather forecast for tomorrow please", "u2"),  # the same request
        line("Translate this paragraph into German", "u3"),  # one user only...
        line("Translate this paragraph into German", "u3"),  # ...even when repeated
        line("Play some relaxing jazz music", "u1", chosen=other, outcome="corrected"),
    ])
    engine = get_engine()
    everything, _ = build_compendium(records, schema, BuildOptions(strength=0), engine)
    assert len(everything.scenarios) == 3 and len(everything.precautions) == 1
    k2, report = build_compendium(records, schema, BuildOptions(strength=0, min_users=2), engine)
    assert [s.text for s in k2.scenarios] == ["Show me the weather forecast for tomorrow"]
    assert k2.scenarios[0].support == 2 and k2.precautions == []
    assert report.withheld_scenarios == 2 and report.withheld_precautions == 1
    assert report.as_dict()["min_users"] == 2
    with pytest.raises(BuildError):
        build_compendium(records, schema, BuildOptions(min_users=0), engine)


def test_pooled_release_sends_pools_of_enough_users_as_the_words_they_share():
    from compendium.builder import pool_text
    from routing.embeddings import get_engine

    assert pool_text([("Book a cheap hotel in Rome", frozenset({"u1"})),
                      ("find a CHEAP hotel near [NAME]", frozenset({"u2"})),
                      ("hotel Rome", frozenset({"u1"}))]) == "a cheap hotel"
    assert pool_text([("rain tomorrow", frozenset({"u1"})), ("sunny today", frozenset({"u2"}))]) == ""
    # a word that started a sentence goes in lower case (mid-pool it would read as a name, which
    # the server refuses); acronyms stay
    pooled = pool_text([("hotel deals in the USA", frozenset({"u1"})),
                        ("Show me USA hotel deals", frozenset({"u2"})),
                        ("Show hotels", frozenset({"u3"}))])
    assert pooled == "hotel deals USA show"
    assert TextMasker.for_registry(metatool_schema().tools).residue(pooled) == []
    schema = metatool_schema()
    tool, other = sorted(schema.tool_ids)[:2]

    def line(query, user, chosen=tool):
        return {"query": query, "tool": chosen, "outcome": "success", "latency_ms": 100, "user": user}

    records = parsed([
        line("Show me the weather forecast for Lisbon tomorrow", "u1"),
        line("What is the weather forecast for the weekend", "u2"),
        line("Translate this paragraph into German", "u3"),
        line("Translate my letter into German", "u1"),
        line("Play some relaxing jazz music", "u1", chosen=other),  # one user alone for this tool
    ])
    engine = get_engine()
    pooled, report = build_compendium(records, schema, BuildOptions(strength=0, pool_users=2), engine)
    texts = sorted(s.text for s in pooled.scenarios)
    assert texts == ["the weather forecast for", "translate into german"]
    assert {s.tool_id for s in pooled.scenarios} == {tool}
    assert sorted(s.support for s in pooled.scenarios) == [2, 2]
    sent = {r.query for r in records}
    assert not sent & set(texts)  # no text sent is any one request
    assert report.pooled_scenarios == 2 and report.withheld_scenarios == 1
    assert report.as_dict()["pool_users"] == 2
    alone, report = build_compendium(records, schema, BuildOptions(strength=0, pool_users=4), engine)
    assert alone.scenarios == [] and report.withheld_scenarios == 5
    with pytest.raises(BuildError, match="pool_users"):
        build_compendium(records, schema, BuildOptions(pool_users=0), engine)
    with pytest.raises(BuildError, match="pooled release needs an embedding engine"):
        build_compendium(records, schema, BuildOptions(pool_users=2, collapse=False), None)


def test_words_that_enough_users_wrote_are_released_and_no_others():
    from compendium.builder import shared_words

    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]

    def line(query, user):
        return {"query": query, "tool": tool, "outcome": "success", "latency_ms": 80, "user": user}

    records = parsed([
        line("Price of ethereum today", "u1"),
        line("ethereum gas fees this week", "u2"),
        line("Is dogecoin up? Ask Thornbury", "u1"),
        line("dogecoin chart please", "u1"),  # the same user twice: one user
        line("Thornbury wants the Thornbury report", "u3"),
    ])
    assert shared_words(records, 2) == {"ethereum"}  # "Price" is capitalized: not counted
    assert "dogecoin" not in shared_words(records, 2)
    assert "thornbury" not in shared_words(records, 1)  # only lower-case occurrences count
    assert "ethereum" not in shared_words(records, 3)

    def sent(k):
        options = BuildOptions(collapse=False, shared_word_users=k)
        return " ".join(s.text for s in build_compendium(records, schema, options)[0].scenarios)

    assert "ethereum" in sent(2) and "dogecoin" not in sent(2)
    assert "ethereum" not in sent(0) and "ethereum" not in sent(3)
    assert "Thornbury" not in sent(2)


def test_shared_words_never_release_planted_personal_data():
    records = usage_records(users=3, lines=240)
    compendium, _ = build_compendium(
        parsed(records), metatool_schema(), BuildOptions(collapse=False, shared_word_users=2)
    )
    text = canonical_form(compendium).data.decode()
    assert not [s for s in secrets() if s in text]


def test_what_the_server_would_scrub_never_leaves_the_client():
    """A study number many users ask about is a shared word, which masking releases; an e-mail
    the masker's λ leaves: the build scrubs both as the server does on arrival, so the server's
    scrub finds nothing (MetaTool's NCT05859269 reached the server before)."""
    from compendium.scrub import scrub_compendium

    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]
    records = parsed([
        {"query": f"requirements of the trial nct05859269 for {who}", "tool": tool,
         "outcome": "success", "latency_ms": 80, "user": who}
        for who in ("u1", "u2", "u3")
    ] + [{"query": "write to help@example.org about refunds", "tool": tool, "outcome": "success",
          "latency_ms": 80, "user": "u1"}])
    compendium, report = build_compendium(
        records, schema, BuildOptions(collapse=False, shared_word_users=2, strength=0.05)
    )
    text = canonical_form(compendium).data.decode()
    assert "05859269" not in text and "help@example.org" not in text
    assert "[number]" in text and report.scrubbed >= 2
    assert scrub_compendium(compendium) == (compendium, 0)


def test_fields_the_round_will_not_release_are_not_computed_nor_sent():
    records = parsed(usage_records(users=5, lines=100, seed=8))
    schema = metatool_schema()
    full, _ = build_compendium(records, schema, BuildOptions(collapse=False))
    part, report = build_compendium(
        records, schema,
        BuildOptions(collapse=False, not_released=frozenset({"latency_ms", "success_rate"})),
    )
    assert report.not_released == ["latency_ms", "success_rate"]
    assert {n for m in part.metadata for n in m.stats} == {"calls", "frequency"}
    assert {m.tool_id: m.stats["calls"] for m in part.metadata} == {
        m.tool_id: m.stats["calls"] for m in full.metadata}
    none, _ = build_compendium(
        records, schema,
        BuildOptions(collapse=False, not_released=frozenset(f.name for f in schema.numeric_fields)),
    )
    assert none.metadata == [] and none.scenarios == part.scenarios



def _cli_build(tmp_path: Path, lines: int, seed: int) -> tuple[list[str], Path]:
    """`synapse-client build` arguments for a log of three users (no collapse, quiet), and the
    compendium file they write."""
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    log = write_log(tmp_path / "usage.jsonl", usage_records(users=3, lines=lines, seed=seed))
    out = tmp_path / "c.json"
    return ["build", "--log", str(log), "--schema", str(schema_path), "--out", str(out),
            "--no-collapse", "--quiet"], out


def test_cli_build_refuses_a_not_released_field_the_schema_does_not_declare(tmp_path, capsys):
    args, out = _cli_build(tmp_path, lines=30, seed=2)
    assert main([*args, "--not-released", "latency_ms,colour"]) == 1
    assert "--not-released names no declared numeric field: colour" in capsys.readouterr().err
    assert not out.exists()
    assert main([*args, "--not-released", "latency_ms, success_rate"]) == 0
    sent = json.loads(out.read_text())
    assert {n for m in sent["metadata"] for n in m["stats"]} == {"calls", "frequency"}


def test_max_words_sends_each_request_as_its_first_words():
    schema = metatool_schema()
    query = "Can you find me a cheap flight from Lisbon to Oslo for next weekend please"
    records = parsed([
        {"query": query, "tool": "MapTool", "outcome": "success", "latency_ms": 5, "user": 1},
        {"query": "weather tomorrow", "tool": "WeatherTool", "outcome": "success",
         "latency_ms": 5, "user": 1},
        {"query": query, "tool": "WeatherTool", "outcome": "corrected", "corrected_to": "MapTool",
         "latency_ms": 5, "user": 2},
    ])
    options = BuildOptions(collapse=False, strength=0)
    whole, _ = build_compendium(records, schema, options)
    cut, report = build_compendium(records, schema, replace(options, max_words=5))
    assert {s.text for s in whole.scenarios} == {query, "weather tomorrow"}
    assert {s.text for s in cut.scenarios} == {"Can you find me a", "weather tomorrow"}
    assert [p.text for p in cut.precautions] == [
        "Do not use WeatherTool for requests like: Can you find me a (use MapTool instead)"
    ]
    assert report.max_words == 5 and report.cut_requests == 2  # the short request stays whole
    assert validate_compendium(cut, schema).ok
    with pytest.raises(BuildError, match="max_words must be 0"):
        build_compendium(records, schema, replace(options, max_words=-1))


def test_cli_build_max_words(tmp_path, capsys):
    args, out = _cli_build(tmp_path, lines=40, seed=4)
    assert main([*args, "--max-words", "-2"]) == 1
    assert "--max-words must be 0 (whole requests) or at least 1, not -2" in capsys.readouterr().err
    assert not out.exists()
    assert main([*args, "--max-words", "4"]) == 0
    assert "request(s) to their first 4 words (--max-words)" in capsys.readouterr().out
    sent = json.loads(out.read_text())
    assert sent["scenarios"] and all(len(s["text"].split()) <= 4 for s in sent["scenarios"])
    cut = json.loads(out.with_name(out.name + ".report.json").read_text())["cut_requests"]
    assert cut > 0
    assert main(["inspect", str(out)]) == 0
    assert f"each request sent as its first 4 words (--max-words): {cut} cut" in capsys.readouterr().out


def _line(query, user, tool, **extra):
    return {"query": query, "tool": tool, "outcome": "success", "latency_ms": 100, "user": user,
            **extra}


@pytest.mark.parametrize("ids", [
    # "Alice", " alice " and a full-width "ＡＬＩＣＥ" counted as three users: three times the
    # clipping's Δ and F* for one person, and a k-users threshold passed alone.
    ("Alice", " alice ", "ＡＬＩＣＥ", "alice\u00a0"),
    # An id with a zero-width space or a byte-order mark in it reads as the same id, and was
    # another user.
    ("alice", "ali\u200bce", "\ufeffalice", "alice\u2060"),
])
def test_one_user_is_one_user_however_the_log_writes_the_id(ids):
    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]
    records = parsed([_line("Show me the weather forecast for tomorrow", user, tool) for user in ids])
    assert {r.user for r in records} == {"alice"}
    compendium, report = build_compendium(records, schema, BuildOptions(strength=0, min_users=2,
                                                                        collapse=False))
    assert report.num_users == 1 and compendium.scenarios == []


def test_one_users_repeats_count_at_most_n_max_towards_an_entrys_support():
    """Support counted log lines: one user sending a request 5,000 times gave it a support of
    5,000 (the paper clips a user's usage counts at N_max, the count field's Δ: 50), and past the
    schema's count limit the build failed."""
    from compendium.builder import clipped_support, support_cap

    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]
    assert support_cap(schema) == 50
    assert clipped_support(["a"] * 5000 + ["b"] * 3, 50) == 53
    assert clipped_support(["a"] * 5000, None) == 5000
    records = parsed([_line("Show me the weather forecast for tomorrow", "heavy", tool)] * 120
                     + [_line("Show me the weather forecast for tomorrow", "light", tool)] * 2)
    compendium, _ = build_compendium(records, schema, BuildOptions(strength=0, collapse=False))
    assert [s.support for s in compendium.scenarios] == [52]
    small = schema.model_copy(update={"limits": schema.limits.model_copy(update={"counts": 10})})
    compendium, _ = build_compendium(records, small, BuildOptions(strength=0, collapse=False))
    assert [s.support for s in compendium.scenarios] == [10]  # at the limit, not a failed build


def test_one_user_counts_at_most_n_max_in_an_entry_whatever_requests_fold_into_it():
    """Each distinct request was clipped at N_max on its own, and entries then added up as they
    folded together (near-duplicates at τ, texts the residue check made equal): one user's 60
    requests worded two ways gave a scenario a support of 100, past the N_max = 50 the paper
    clips a user's usage counts at. The clip is of the user's requests in the entry sent."""
    from routing.embeddings import get_engine

    schema = metatool_schema()
    first = "What will the weather be like tomorrow in Lisbon?"
    second = "What will the weather be like in Lisbon tomorrow?"
    records = parsed(
        [_line(first, "heavy", "WeatherTool")] * 60 + [_line(second, "heavy", "WeatherTool")] * 60
        + [_line(first, "light", "WeatherTool")] * 2
        + [{**_line(q, "heavy", "WeatherTool"), "outcome": "failure"} for q in (first, second)] * 60
    )
    compendium, _ = build_compendium(records, schema, BuildOptions(tau=0.85), get_engine())
    assert [s.support for s in compendium.scenarios] == [52]
    assert [p.support for p in compendium.precautions] == [50]
    separate, _ = build_compendium(records, schema, BuildOptions(collapse=False))
    assert sorted(s.support for s in separate.scenarios) == [50, 52]


def test_a_template_is_sent_by_the_users_who_used_it_not_by_one_users_repeats():
    """Templates skipped the k-users rule (one user's template went out at min_users=3) and
    their vote counted log lines (one user repeating a body chose it)."""
    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]

    def used(user, body):
        return _line("Show me the weather forecast for tomorrow", user, tool,
                     template={"signature": "forecast(city)", "template": body})

    records = parsed([used("a", "Forecast for {city}, for my boss")] * 5
                     + [used("b", "Forecast for {city}"), used("c", "Forecast for {city}")])
    compendium, _ = build_compendium(records, schema, BuildOptions(strength=0, collapse=False))
    assert [t.template for t in compendium.templates] == ["Forecast for {city}"]
    k3, report = build_compendium(records, schema, BuildOptions(strength=0, collapse=False,
                                                               min_users=3))
    assert k3.templates == [] and report.withheld_templates == 1
    k2, report = build_compendium(records, schema, BuildOptions(strength=0, collapse=False,
                                                               min_users=2))
    assert [t.template for t in k2.templates] == ["Forecast for {city}"]
    assert report.withheld_templates == 0


def _fuzz_records(schema, count: int, seed: int) -> list:
    """`count` seeded usage lines whose queries and templates mix non-ASCII letters, digits,
    braces, underscores, names, placeholders and punctuation, glued together or spaced."""
    import random

    rng = random.Random(seed)
    atoms = ["Hauptstraße", "4b", "Ré", "5ABC123", "{", "}", "_", "Oswald", "Pemberton",
             "07700900123", "margaret_thornbury", "{city}", "Øresund", "12", "José", "ÉCOLE",
             "O'Neil", "a1b2", "x@y.com", "www.foo.com", "[NAME]", "[MASK]", "Dr.", "the",
             "weather", "in", "Lisbon", ".", ":", "#42", "ＡＢＣ", "I’m", "-", "(", ")", "1 2 3 4 5 6 7",
             "4111 1111 1111 1111", "call", "Straße", "naïve", "Ωmega7", "ß9", "\n"]
    tools = sorted(schema.tool_ids)

    def text() -> str:
        parts = [rng.choice(atoms) for _ in range(rng.randint(1, 12))]
        glue = [rng.choice(["", " ", " ", "_"]) for _ in parts]
        return "".join(p + g for p, g in zip(parts, glue, strict=True)).strip() or "weather"

    lines = []
    for i in range(count):
        outcome = rng.choice(["success", "failure", "corrected"])
        tool, right = rng.sample(tools, 2)
        line = {"query": text(), "tool": tool, "outcome": outcome,
                "latency_ms": 50, "user": f"u{i % 7}"}
        if outcome == "corrected":
            line["corrected_to"] = right
        if outcome == "success" and i % 3 == 0:
            line["template"] = {"signature": f"ask({rng.choice(['q', 'Oswald7', 'city'])})",
                                "template": text() + " {question}"}
        lines.append(line)
    return parsed(lines)


@pytest.mark.parametrize("strength", [0.3, 1.0, 2.0])
def test_every_built_compendium_passes_the_servers_residue_check(strength):
    """Fuzz (seeded): whatever the log holds, build never writes what the server refuses whole
    (before, "Hauptstraße4b" went out as "[NAME]4b", "Ré5ABC123" as "[NAME]5ABC[NUMBER]", and
    "{Oswald_Pemberton_07700900123}" as "{Oswald_Pemberton_[number]}", all flagged)."""
    from compendium.scrub import masking_residue

    schema = metatool_schema()
    server = TextMasker.for_registry(schema.tools, strength=strength)
    withheld = 0
    for seed in range(3):
        records = _fuzz_records(schema, 150, seed)
        for shared in (0, 2):
            compendium, report = build_compendium(
                records, schema,
                BuildOptions(strength=strength, collapse=False, shared_word_users=shared),
            )
            assert masking_residue(compendium, server) == [], (strength, seed, shared)
            assert compendium.scenarios and compendium.precautions
            withheld += report.residue_withheld
    assert withheld == 0  # masking what the check finds is enough; nothing had to stay


def test_braces_in_a_request_are_masked_and_template_slots_kept():
    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]
    records = parsed([
        {"query": "email the contract to {Margaret_Thornbury} today", "tool": tool,
         "outcome": "success", "latency_ms": 80, "user": "u1",
         "template": {"signature": "ask(question)", "template": "Answer {question} for {city}"}},
        {"query": "remind me to call {Oswald_Pemberton_07700900123}", "tool": tool,
         "outcome": "failure", "latency_ms": 80, "user": "u2"},
    ])
    compendium, report = build_compendium(records, schema, BuildOptions(collapse=False))
    sent = canonical_form(compendium).data.decode()
    for secret in ("Margaret", "Thornbury", "Oswald", "Pemberton", "0770"):
        assert secret not in sent
    assert compendium.templates[0].template == "Answer {question} for {city}"
    assert report.residue_withheld == 0


def test_masked_fraction_is_sent_to_three_significant_digits():
    """The exact ratio (4/19 = 0.21052631578947367) says how many tokens the log held."""
    compendium, report = build_compendium(
        parsed(usage_records(users=3, lines=60)), metatool_schema(), BuildOptions(collapse=False)
    )
    sent = compendium.masking.masked_fraction
    assert sent == float(f"{report.masked_fraction:.3g}")
    assert sent != report.masked_fraction and len(repr(sent)) <= 5
    assert abs(sent - report.masked_fraction) <= 0.0005


def test_a_huge_request_is_masked_only_as_far_as_it_can_be_sent():
    """A 900 KB log line took minutes to mask (ties hashed the whole text per token); only
    the first 1,000 characters can be sent, so a request is masked up to 8 times that."""
    schema = metatool_schema()
    tool = sorted(schema.tool_ids)[0]
    words = ["weather", "Oswald", "kayak", "a1b2", "the", "forecast", "12345"]
    huge = " ".join(words[i % len(words)] for i in range(150_000))
    records = parsed([{"query": huge, "tool": tool, "outcome": "corrected",
                       "corrected_to": sorted(schema.tool_ids)[1], "latency_ms": 1, "user": "u"}])
    compendium, report = build_compendium(records, schema, BuildOptions(collapse=False))
    assert report.capped_requests == 1
    assert report.word_tokens < 2_000  # what was masked: the first 8,000 characters
    (scenario,) = compendium.scenarios
    assert scenario.text.startswith("weather [NAME] ")
    assert "[ID] the forecast [NUMBER] weather" in scenario.text
    assert len(scenario.text) <= schema.strings.scenario
    assert "Oswald" not in canonical_form(compendium).data.decode()


def _collapse_reference(items, embedder, tau):
    """collapse_near_duplicates as it was (the kept rows copied for every entry)."""
    from collections import defaultdict

    import numpy as np

    ordered = sorted(items, key=lambda e: (repr(e[0]), -e[2], e[1]))
    vectors = embedder.embed([e[1] for e in ordered])
    kept, by_group = [], defaultdict(list)
    for row, (group, text, support, users) in enumerate(ordered):
        target = None
        candidates = by_group[group]
        if candidates:
            sims = vectors[[kept[i][4] for i in candidates]] @ vectors[row]
            best = int(np.argmax(sims))
            if float(sims[best]) >= tau:
                target = candidates[best]
        if target is None:
            by_group[group].append(len(kept))
            kept.append([group, text, support, users, row])
        else:
            kept[target][2] += support
            kept[target][3] = kept[target][3] | users
    return [(g, t, s, u) for g, t, s, u, _ in kept]


def test_near_duplicate_collapse_gives_what_it_gave_before():
    """The collapse compares each entry with its group's kept vectors in a matrix grown in
    place (copying them for every entry was quadratic: 8,000 distinct requests, 53 s); the
    result is the same, entry for entry (`bench/collapse_scaling.py` has the timings)."""
    import numpy as np

    from compendium.builder import collapse_near_duplicates

    rng = np.random.default_rng(4)
    centres = rng.standard_normal((40, 32))

    class Clustered:
        def embed(self, texts):
            out = np.stack([centres[hash(t) % 40] + 0.45 * rng.standard_normal(32) for t in texts])
            return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    items = [((f"tool{i % 3}", (("flag", bool(i % 2)),) if i % 5 else ()), f"request {i}",
              1 + i % 4, frozenset({f"u{i % 9}"})) for i in range(1500)]
    for tau in (0.6, 0.85):
        embedder = Clustered()
        state = rng.bit_generator.state
        expected = _collapse_reference(items, embedder, tau)
        rng.bit_generator.state = state
        got = collapse_near_duplicates(items, embedder, tau)
        assert got == expected
        assert len(expected) < len(items)
