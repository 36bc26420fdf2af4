"""The pure merge operator on crafted cases, with the real bundled embedding model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from compendium.canonical import canonical_bytes
from compendium.schema import Compendium, Schema, ToolSpec
from federation.merge import (
    BudgetExceeded,
    ConflictEntry,
    MergeInput,
    ProbeSet,
    conflicts_to_precautions,
    drowned_fields,
    edge_merge,
    server_merge,
)
from federation.merge.clustering import Item, decide_cluster, flags_satisfiable, greedy_cluster
from federation.merge.operator import noise_dominated
from federation.merge.robust import byzantine_count
from federation.merge.summarize import fallback_kinds
from federation.round_config import RoundConfig
from routing.embeddings import get_engine


@pytest.fixture(scope="module")
def embed():
    return get_engine().embed


@pytest.fixture(scope="module")
def schema() -> Schema:
    return Schema(
        tools=[
            ToolSpec(tool_id="weather", name="WeatherNow",
                     description="Weather forecasts, rain and temperature for a city"),
            ToolSpec(tool_id="flights", name="FlightFinder",
                     description="Search and book airline flights between airports"),
            ToolSpec(tool_id="calculator", name="Calculator",
                     description="Evaluate arithmetic expressions and compute numbers"),
            ToolSpec(tool_id="recipes", name="RecipeBox",
                     description="Find cooking recipes and ingredients for dishes"),
        ]
    )


def sub(source, scenarios=(), precautions=(), metadata=(), templates=(), annex=()):
    return MergeInput(
        source,
        {
            "schema_version": "1.0",
            "metadata": list(metadata),
            "scenarios": list(scenarios),
            "precautions": list(precautions),
            "templates": list(templates),
            "annex": list(annex),
        },
    )


def sc(tool, text, **flags):
    return {"tool_id": tool, "text": text, "preconditions": flags}


def test_paraphrases_cluster_into_one_scenario_with_summed_support(schema, embed):
    subs = [
        sub("c1", [sc("weather", "Will it rain tomorrow in Paris?")]),
        sub("c2", [sc("weather", "Will it rain tomorrow in Paris")]),
        sub("c3", [sc("weather", "will it rain tomorrow in paris?")]),
        sub("c4", [sc("flights", "Book a cheap flight from Boston to Denver")]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="centroid"), embed=embed)
    weather = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert len(weather) == 1 and weather[0].support == 3
    assert result.stats.scenarios_in == 4 and result.stats.scenarios_out == 2
    assert result.stats.dedup_rate == pytest.approx(0.5)
    assert not result.conflicts


def test_counts_that_add_up_past_the_limit_are_published_at_the_limit(schema, embed):
    """Each input is within the counts' limit; their sums are not, and the merge publishes at
    most the limit (the stored support is a 32-bit column, and the merge validates its output)."""
    cap = schema.limits.counts
    subs = [
        MergeInput(source, {
            "scenarios": [{**sc("weather", "Will it rain tomorrow in Paris?"), "support": cap}],
            "precautions": [{"tool_id": "weather", "text": "Not for tide tables", "support": cap}],
            "num_users": cap,
        })
        for source in ("c1", "c2", "c3")
    ]
    for merge in (edge_merge, server_merge):  # the server merge adds up its edges' num_users
        result = merge(subs, schema, RoundConfig(summarizer="centroid"), embed=embed)
        assert not result.rejected
        assert [s.support for s in result.compendium.scenarios] == [cap]
        assert [p.support for p in result.compendium.precautions] == [cap]
    assert result.compendium.num_users == cap


def test_contradictory_preconditions_make_a_conflict_with_majority_centroid(schema, embed):
    subs = [
        sub("c1", [sc("weather", "Get the weather forecast for a city", has_city=True)]),
        sub("c2", [sc("weather", "Get the weather forecast for a city.", has_city=True)]),
        sub("c3", [sc("weather", "Get the weather forecast for a city!", has_city=False)]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="centroid"), embed=embed)
    assert len(result.conflicts) == 1
    entry = result.conflicts[0]
    assert entry.tool_id == "weather"
    assert entry.centroid["preconditions"] == {"has_city": True}
    assert [d["source"] for d in entry.dissenters] == ["c3"]
    assert "precondition flags contradict" in entry.reason
    kept = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert len(kept) == 1 and kept[0].support == 2 and kept[0].preconditions == {"has_city": True}


def test_a_member_without_the_flag_does_not_merge_both_sides_of_a_contradiction(schema, embed):
    """Compatibility is not transitive: a member that states no `has_city` agrees with `has_city`
    and with `not has_city`. Before, it was taken as the anchor (compatible with all three
    sources), all three were merged into it with support 3, and the conflict was logged with
    no dissenter at all, so ConflictsToPrecautions had nothing to compose. The agreeing
    members must agree with each other: one side of the contradiction is a dissenter."""
    subs = [
        sub("c1", [sc("weather", "Get the weather forecast for a city", has_city=True)]),
        sub("c2", [sc("weather", "Get the weather forecast for a city.", has_city=False)]),
        sub("c3", [sc("weather", "Get the weather forecast for a city!")]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="centroid"), embed=embed)
    assert len(result.conflicts) == 1
    entry = result.conflicts[0]
    assert "precondition flags contradict" in entry.reason
    assert len(entry.dissenters) == 1
    assert entry.dissenters[0]["source"] in ("c1", "c2")
    agreeing = {"c1", "c2", "c3"} - {entry.dissenters[0]["source"]}
    assert entry.centroid["source"] in agreeing
    kept = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert len(kept) == 1 and kept[0].support == 2
    # and the next round has the exception as a precaution (the centroid states no flag: the
    # dissenter's own flag is the exception)
    flag = str(entry.dissenters[0]["preconditions"]["has_city"]).lower()
    [precaution] = conflicts_to_precautions(result.conflicts, schema)
    assert precaution.tool_id == "weather" and precaution.text.endswith(f"has_city is {flag}")
    # The same with an LLM probe that finds one member ("other") inconsistent with the
    # cluster's center: the member the probe did not judge against it must not merge the two.
    vectors = np.array([[1.0, 0.0], [0.9, 0.436], [0.9, -0.436]])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    members = [Item(f"c{i}", "weather", text, {}, 1, vectors[i])
               for i, text in enumerate(["center", "other", "both"])]
    decision = decide_cluster(members, probe=lambda a, b: "other" not in (a, b))
    assert not decision.consistent
    assert decision.dissenters and not {0, 1} <= set(decision.agreeing)


def test_one_source_stating_a_huge_support_does_not_outvote_the_others(schema, embed):
    """The support an entry states is its submitter's word: nine clients that agree outvote one
    that disagrees however large a support it states (before, the one with 1,000,000 won and the
    nine were logged as its dissenters)."""
    honest = [sub(f"c{i}", [sc("weather", "Will it rain tomorrow in Paris", online=True)])
              for i in range(9)]
    liar = sub("a0", [{**sc("weather", "Will it rain tomorrow in Paris", online=False),
                       "support": 1_000_000}])
    for rule in ("none", "krum", "trimmed-mean"):
        result = edge_merge([liar, *honest], schema, RoundConfig(summarizer="centroid",
                                                                 robust_rule=rule), embed=embed)
        entry = result.conflicts[0]
        assert entry.centroid["preconditions"] == {"online": True}, rule
        assert [d["source"] for d in entry.dissenters] == ["a0"], rule
        kept = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
        assert len(kept) == 1 and kept[0].preconditions == {"online": True}, rule


def test_an_edge_merge_of_precautions_alone_with_a_probe_set(schema, embed):
    """Clients that send only precautions (a delta that changes nothing else): the probe-scored
    summarizer found no scenario to score against and the merge raised AttributeError."""
    probe_texts = ["Is it going to snow in Berlin?", "Cheapest flight to Tokyo next week"]
    probe = ProbeSet(probe_texts, ["weather", "flights"], embed(probe_texts))
    subs = [sub(f"c{i}", precautions=[{"tool_id": "weather", "text": text}])
            for i, text in enumerate(["Do not use it for flight delays",
                                      "Do not use it for flight delays."])]
    result = edge_merge(subs, schema, RoundConfig(), embed=embed, probe_set=probe)
    assert [(p.tool_id, p.support) for p in result.compendium.precautions] == [("weather", 2)]
    assert result.compendium.scenarios == []


def test_a_released_figure_stays_in_its_fields_range_after_rounding(schema, embed):
    """A noised figure is rounded to a hundredth of its noise's order of magnitude: for a field
    whose range is narrower than that step (a rating in [1, 5] under a scale in the thousands)
    the rounding took it out of range, the merge refused its own compendium, and the round (and
    every retry, with the same seed) failed."""
    from compendium.schema import NumericFieldSpec, NumericKind

    # of a kind an edge releases (a field of kind `other` is never released)
    narrow = Schema(tools=schema.tools, numeric_fields=[
        NumericFieldSpec(name="rating", kind=NumericKind.COUNT, min=1, max=5, sensitivity=4)])
    subs = [sub("c1", metadata=[{"tool_id": "weather", "stats": {"rating": 4.5}}])]
    for seed in range(12):
        result = edge_merge(subs, narrow, RoundConfig(epsilon=0.001, seed=seed), embed=embed)
        released = [m.stats["rating"] for m in result.compendium.metadata if "rating" in m.stats]
        assert released and all(1 <= v <= 5 for v in released), seed
    # and never -0.0, which jsonb stores as 0 (the stored global would not hash to its sha256)
    from federation.merge.operator import _published_number

    assert str(_published_number(-0.0001, 1.0, -1.0, 1.0)) == "0.0"


def test_is_consistent_structural_rules(embed):
    v = embed(["a", "b"])
    a = Item("x", "weather", "a", {"f": True}, 1, v[0])
    b = Item("y", "weather", "b", {"g": False}, 1, v[1])
    assert decide_cluster([a, b]).consistent
    c = Item("z", "weather", "b", {"f": False}, 1, v[1])
    assert not decide_cluster([a, c]).consistent
    assert flags_satisfiable([{"f": True}, {"g": True}, {"f": True}])
    assert not flags_satisfiable([{"f": True}, {"f": False}])
    # An LLM probe that says "inconsistent" marks the cluster conflicted even with agreeing flags.
    assert not decide_cluster([a, b], probe=lambda x, y: False).consistent
    assert decide_cluster([a, b], probe=lambda x, y: None).consistent  # unusable answer: ignored


def test_the_merge_does_not_depend_on_the_order_of_its_inputs(schema, embed):
    """Edge and server merges over the same inputs in another order publish the same bytes and
    log the same conflicts, with conflicted clusters, paraphrases, precautions, templates and
    annex triples, a robust rule and a probe set; and every conflicted cluster logs a dissenter."""
    import json
    import random

    pool = {
        "weather": ["Will it rain tomorrow in Paris?", "Will it rain tomorrow in Paris",
                    "Get the weather forecast for a city", "Get the weather forecast for a city."],
        "flights": ["Book a cheap flight from Boston to Denver",
                    "Book a cheap flight from Boston to Denver.", "Search airline tickets to Tokyo"],
        "recipes": ["Find a recipe for lasagna", "Find a recipe for lasagna."],
    }
    rng = random.Random(0)
    subs = []
    for i in range(6):
        scenarios = [
            {**sc(tool, text, **rng.choice([{}, {"online": True}, {"online": False}])),
             "support": rng.randint(1, 3)}
            for tool, texts in pool.items() for text in rng.sample(texts, 2)
        ]
        subs.append(sub(
            f"c{i}", scenarios,
            precautions=[{"tool_id": "weather",
                          "text": rng.choice(["Not for tide tables", "Not for tide tables."])}],
            templates=[{"tool_id": "weather", "signature": "city",
                        "template": rng.choice(["Weather in {city}", "Forecast {city}"])}],
            annex=[{"subject": "weather", "relation": rng.choice(["needs", "requires"]),
                    "object": "city"}],
        ))
    probe_texts = ["Is it going to rain in London tomorrow?", "Find me a flight to Tokyo",
                   "How do I make pancakes?"]
    probe = ProbeSet(probe_texts, ["weather", "flights", "recipes"], embed(probe_texts))
    config = RoundConfig(summarizer="probe-extractive", robust_rule="krum")

    def merged(merge, inputs, **kwargs):
        result = merge(inputs, schema, config, embed=embed, probe_set=probe, **kwargs)
        return result, (canonical_bytes(result.compendium),
                        json.dumps([c.as_dict() for c in result.conflicts], sort_keys=True))

    first, expected = merged(edge_merge, subs, seed=3)
    assert first.conflicts and all(c.dissenters for c in first.conflicts)
    shuffled = subs[:]
    for _ in range(3):
        rng.shuffle(shuffled)
        assert merged(edge_merge, shuffled, seed=3)[1] == expected
    edges = [MergeInput("org:a", first.compendium),
             MergeInput("org:b", edge_merge(subs[:3], schema, config, embed=embed, seed=4).compendium)]
    assert merged(server_merge, edges)[1] == merged(server_merge, edges[::-1])[1]


def test_greedy_clustering_is_deterministic_and_thresholded():
    vectors = np.array([[1, 0], [0.99, 0.141], [0, 1], [0.1, 0.995]], dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert greedy_cluster(vectors, 0.9) == [[0, 1], [2, 3]]
    assert greedy_cluster(vectors, 0.9999) == [[0], [1], [2], [3]]


def test_tool_confusion_entry_is_dropped_and_honest_entries_kept(schema, embed):
    honest = [
        sub(f"h{i}", [sc("weather", t)])
        for i, t in enumerate(
            ["Will it rain tomorrow in Paris?", "What is the temperature in Berlin today?",
             "Is there a storm forecast for Miami this weekend?"]
        )
    ] + [sub("h9", [sc("recipes", "Find a recipe for vegetable lasagna")])]
    attacker = sub("evil", [sc("calculator", "Will it rain this weekend in Paris?")])
    result = edge_merge(honest + [attacker], schema, RoundConfig(summarizer="centroid"),
                        embed=embed)
    assert [(f.source, f.tool_id, f.closest_tool) for f in result.flagged] == [
        ("evil", "calculator", "weather")
    ]
    assert all(s.tool_id != "calculator" for s in result.compendium.scenarios)
    assert sum(s.support for s in result.compendium.scenarios if s.tool_id == "weather") == 3


def test_copies_of_one_relabelled_text_do_not_vouch_for_each_other(schema, embed):
    """Colluding clients send the same weather request labelled with the calculator. Each copy is
    judged by a calculator profile without its copies (the tool's entries at cosine >= τ to it),
    so they cannot pull that profile towards weather and pass as plausible: all three are
    dropped, as one would be. Other tools' profiles keep their entries near it (the evidence
    against it). What remains: the copies still sit in the calculator's profile when the honest
    weather request of the same meaning is judged, and it goes too; the conflict log would have
    kept it against them, had it reached it."""
    from federation.merge.clustering import confusion_verdicts, tool_profiles

    honest = [sub(f"h{i}", [sc("weather", t)]) for i, t in enumerate(
        ["Will it rain tomorrow in Paris?", "What is the temperature in Berlin today?"])]
    colluders = [sub(f"evil{i}", [sc("calculator", "Will it rain this weekend in Paris?")])
                 for i in range(3)]
    result = edge_merge(honest + colluders, schema, RoundConfig(summarizer="centroid"),
                        embed=embed, source_limit=2.0)
    assert sorted((f.source, f.tool_id, f.closest_tool) for f in result.flagged) == [
        (f"evil{i}", "calculator", "weather") for i in range(3)] + [("h0", "weather", "calculator")]
    assert [(s.tool_id, s.support) for s in result.compendium.scenarios] == [("weather", 1)]

    # What only the copies' exclusion changes: each copy alone left out, they vouch for each other.
    tools = [t.tool_id for t in schema.tools]
    descriptions = np.stack(embed([t.description for t in schema.tools]))
    text = "Will it rain this weekend in Paris?"
    items = [Item(f"evil{i}", "calculator", text, {}, 1, embed([text])[0]) for i in range(3)]
    profiles = tool_profiles(tools, descriptions, items)
    assert all(v.flagged for v in confusion_verdicts(items, tools, profiles, margin=0.2, rank=1))
    copies_apart = [confusion_verdicts([item], tools, profiles, margin=0.2, rank=1)[0]
                    for item in items]
    assert not any(v.flagged for v in copies_apart)
    # A near paraphrase counts as a copy at τ, not at the default (exact copies only).
    paraphrase = Item("evil3", "calculator", "", {}, 1, embed(["Will it rain this weekend in Paris"])[0])
    pair = [items[0], paraphrase]
    profiles = tool_profiles(tools, descriptions, pair)
    assert not any(v.flagged for v in confusion_verdicts(pair, tools, profiles, margin=0.2, rank=1))
    assert all(v.flagged for v in confusion_verdicts(pair, tools, profiles, margin=0.2, rank=1,
                                                     near=RoundConfig().tau))


def test_a_registry_of_one_tool_confuses_nothing():
    from federation.merge.clustering import confusion_verdicts, tool_profiles

    items = [Item(f"c{i}", "only", "", {}, 1, np.eye(3)[i]) for i in range(3)]
    profiles = tool_profiles(["only"], np.eye(3)[:1], items)
    verdicts = confusion_verdicts(items, ["only"], profiles, margin=0.0, rank=1, near=0.5)
    assert [(v.flagged, v.closest_tool) for v in verdicts] == [(False, "only")] * 3


def test_honest_gaps_and_the_calibrated_margin():
    """Profiles from the descriptions (the axes) and the labelled requests themselves, each request
    left out of its own tool's profile."""
    from federation.merge.clustering import calibrated_margin, honest_gaps

    tools = ["a", "b", "c"]
    vectors = np.array([[1.0, 0, 0], [0.6, 0.8, 0], [0, 0.6, 0.8]])
    gaps = honest_gaps(vectors, ["a", "a", "c"], tools, np.eye(3))
    assert np.allclose(gaps, [-2 / 5**0.5, 0.2, -0.2])
    assert honest_gaps(vectors, ["zzz"] * 3, tools, np.eye(3)).size == 0  # not in the registry
    assert calibrated_margin(gaps, floor=0.3, honest_rate=0.05) == 0.3  # honest ones pass already
    assert calibrated_margin(np.linspace(0, 1, 101), floor=0.2, honest_rate=0.05) == pytest.approx(0.95)
    assert calibrated_margin(np.zeros(0), floor=0.2, honest_rate=0.05) == 0.2


def test_the_confusion_margin_is_raised_where_honest_requests_overlap(schema):
    """Two tools that overlap in meaning: honest weather entries, and the public probe's weather
    request, sit closer to the flights profile than to their own. The fixed margin (0.2) drops the
    honest entries; calibrated on the probe it keeps them, and still drops an entry far from its
    tool."""
    axis = {"weather": [1.0, 0, 0], "flights": [0, 1.0, 0], "calculator": [0, 0, 1.0],
            "recipes": [0.0, 0.0, -1.0]}
    vectors = {t.description: axis[t.tool_id] for t in schema.tools}
    vectors.update({
        "weather case one": [0.3, 0.9, 0.3], "weather case two": [0.3, 0.9, -0.3],
        "flights case": [0.05, 0.998, 0.0], "arithmetic, labelled recipes": [0.0, 0.0, 1.0],
        "weather request": [0.3, 0.9, 0.3], "flights request": [0.0, 1.0, 0.0],
    })

    def embed(texts):
        out = np.array([vectors[t] for t in texts], dtype=np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    inputs = [sub("h1", [sc("weather", "weather case one")]),
              sub("h2", [sc("weather", "weather case two"), sc("flights", "flights case")]),
              sub("evil", [sc("recipes", "arithmetic, labelled recipes")])]
    # In this three-dimensional space the weather cases are near-duplicates of the flights case
    # (cosine 0.95), which the conflict log resolves across tools; this test is about the
    # confusion check alone.
    config = RoundConfig(summarizer="centroid", conflict_log=False)
    fixed = edge_merge(inputs, schema, config, embed=embed)
    assert sorted(f.source for f in fixed.flagged) == ["evil", "h1", "h2"]
    assert fixed.stats.confusion_margin == 0.2
    probe_texts = ["weather request", "flights request"]
    probe = ProbeSet(probe_texts, ["weather", "flights"], embed(probe_texts))
    calibrated = edge_merge(inputs, schema, config, embed=embed, probe_set=probe)
    assert [f.source for f in calibrated.flagged] == ["evil"]
    # Two probe requests, gaps about 0.60 (weather) and -0.44 (flights): the margin sits at the
    # (1 - rate) quantile between them, above the honest entries' 0.22 and below evil's 2.
    from federation.merge.operator import CONFUSION_HONEST_RATE

    expected = -0.442 + (1 - CONFUSION_HONEST_RATE) * (0.603 + 0.442)
    assert calibrated.stats.confusion_margin == pytest.approx(expected, abs=0.01)
    # The margin depends on the registry and the probe only: what is submitted cannot move it.
    flood = inputs + [sub(f"x{i}", [sc("weather", "flights case")]) for i in range(5)]
    assert edge_merge(flood, schema, config, embed=embed, probe_set=probe).stats.confusion_margin \
        == calibrated.stats.confusion_margin
    assert sum(s.support for s in calibrated.compendium.scenarios if s.tool_id == "weather") == 2


def test_mean_pairwise_cosine_and_probe_coherence():
    from federation.merge.clustering import mean_pairwise_cosine, probe_coherence

    axes = np.eye(3)
    assert mean_pairwise_cosine(axes) == pytest.approx(0.0)
    assert mean_pairwise_cosine(np.array([[1.0, 0], [1.0, 0], [1.0, 0]])) == pytest.approx(1.0)
    pair = np.array([[1.0, 0], [0.6, 0.8]])
    assert mean_pairwise_cosine(pair) == pytest.approx(0.6)
    assert probe_coherence(np.vstack([pair, axes[:1, :2]]), ["a", "a", "b"]) == {"a": pytest.approx(0.6)}


def test_a_flood_of_relabelled_scenarios_from_one_source_is_dropped_as_an_incoherent_batch(schema):
    """One client labels requests of every kind with one tool: its batch for that tool is far less
    alike than the tool's probe requests, and goes; an honest client's batch for the same tool,
    as alike as the probe, stays; so do batches too small to judge."""
    rng = np.random.default_rng(0)

    def near(axis, n, spread=0.3):
        out = np.array(axis, dtype=np.float64) + spread * rng.standard_normal((n, 4))
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    weather_axis, other_axes = [1.0, 0, 0, 0], [[0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]]
    honest = near(weather_axis, 6)
    flood = np.vstack([near(axis, 2) for axis in other_axes])  # six requests of three other kinds
    texts = {f"honest {i}": v for i, v in enumerate(honest)}
    texts.update({f"flood {i}": v for i, v in enumerate(flood)})
    texts.update({t.description: v for t, v in zip(schema.tools, np.eye(4), strict=True)})
    texts.update({f"probe {i}": v for i, v in enumerate(near(weather_axis, 8))})
    texts.update({"small 0": flood[0], "small 1": flood[2]})

    def embed(batch):
        return np.array([texts[t] for t in batch], dtype=np.float32)

    inputs = [sub("honest", [sc("weather", f"honest {i}") for i in range(6)]),
              sub("flood", [sc("weather", f"flood {i}") for i in range(6)]),
              sub("small", [sc("weather", "small 0"), sc("weather", "small 1")])]
    probe_texts = [f"probe {i}" for i in range(8)]
    probe = ProbeSet(probe_texts, ["weather"] * 8, embed(probe_texts))
    # The confusion and implausible-source checks off (margin 9, limit 9), to see this check alone.
    result = edge_merge(inputs, schema, RoundConfig(summarizer="centroid"), embed=embed,
                        probe_set=probe, confusion_margin=9.0, source_limit=9.0)
    dropped = [f for f in result.flagged if f.reason == "incoherent batch"]
    assert {f.source for f in dropped} == {"flood"} and len(dropped) == 6
    assert result.stats.flagged_incoherent == 6 and result.stats.flagged_confusion == 0
    assert dropped[0].own_similarity < 0.5 * dropped[0].closest_similarity
    kept = {text for s in result.compendium.scenarios for text in [s.text]}
    assert not any(t.startswith("flood") for t in kept)
    assert sum(s.support for s in result.compendium.scenarios) == 8  # six honest, two small
    # Without a probe there is no reference, and nothing is dropped this way.
    plain = edge_merge(inputs, schema, RoundConfig(summarizer="centroid"), embed=embed,
                       confusion_margin=9.0, source_limit=9.0)
    assert plain.stats.flagged_incoherent == 0


def test_own_tool_percentiles_and_implausible_sources():
    from federation.merge.clustering import implausible_sources, own_tool_percentiles

    profiles = np.eye(5)
    vectors = np.array([[1.0, 0.2, 0.1, 0, 0], [0, 0.1, 1.0, 0.2, 0]])
    # Own tool nearest: 0; second nearest of five: 1/4; beaten by three tools (a tie does not
    # count): 3/4.
    assert own_tool_percentiles(vectors, [0, 3], profiles).tolist() == [0.0, 0.25]
    assert own_tool_percentiles(vectors, [3, 2], profiles).tolist() == [0.75, 0.0]
    tools = ["a", "b", "c", "d", "e"]
    # Text r sits nearest tool r, then r+1, then r+2 (mod 5).
    texts = np.array([np.eye(5)[r] + 0.1 * np.eye(5)[(r + 1) % 5] + 0.05 * np.eye(5)[(r + 2) % 5]
                      for r in range(5)])

    def items(source, pairs):
        return [Item(source, tools[label], "", {}, 1, texts[row]) for row, label in pairs]

    honest = items("honest", [(i % 5, i % 5) for i in range(6)])  # every label its text's tool
    liar = items("liar", [(i % 5, (i + 2) % 5) for i in range(6)])  # every label third: 0.5
    few = items("few", [(0, 4), (1, 3)])  # off, but too few to judge
    near = items("near", [(i % 5, (i + 1) % 5) for i in range(6)])  # every label second: 0.25
    mixed = items("mixed", [(0, 0), (1, 1), (2, 4), (3, 0), (4, 1), (0, 2)])  # 2 right, 4 at 0.5
    found = implausible_sources(honest + liar + few + near + mixed, tools, profiles, limit=0.25,
                                minimum=5)
    assert found == {"liar": (pytest.approx(0.5), 6), "mixed": (pytest.approx(1 / 3), 6)}
    assert implausible_sources(liar, tools, profiles, limit=0.25, minimum=5,
                               exempt=frozenset({"liar"})) == {}


@pytest.mark.parametrize("with_probe", [True, False])
def test_a_source_whose_labels_do_not_fit_its_texts_is_dropped_whole(schema, embed, with_probe):
    """A client that relabels real requests: most of its labels point away from the text's tool
    among the trusted profiles (registry descriptions, and probe requests when there is a probe),
    so all its scenarios go, the correctly labelled ones and its precautions with them, while an
    honest client with the same requests, and a source too small to judge, stay."""
    requests = {
        "weather": ["Will it rain in Lisbon tomorrow?", "What's the temperature in Oslo tonight?"],
        "flights": ["Find me a flight from Boston to Denver", "Book a plane ticket to Rome"],
        "calculator": ["What is 17 times 23?", "Compute the square root of 1764"],
        "recipes": ["How do I cook a mushroom risotto?", "Ingredients for banana bread"],
    }
    tools = list(requests)
    honest = [sc(tool, text) for tool in tools for text in requests[tool]]
    # Six of eight labels shifted to another tool; two kept right.
    relabelled = [sc(tool if i in (0, 3) else tools[(tools.index(tool) + 1 + i % 3) % 4], text)
                  for i, (tool, text) in enumerate((t, x) for t in tools for x in requests[t])]
    liar_precaution = {"tool_id": "weather", "text": "Never use this for anything in Lisbon"}
    inputs = [
        sub("honest", honest),
        sub("liar", relabelled, precautions=[liar_precaution]),
        sub("small", [sc("recipes", "What is 17 times 23?"), sc("weather", "Book a plane ticket")]),
    ]
    probe = None
    if with_probe:
        probe_texts = ["Is it going to snow in Berlin?", "Cheapest flight to Tokyo next week",
                       "What is 45 divided by 9?", "A quick recipe for pancakes"]
        probe = ProbeSet(probe_texts, tools, embed(probe_texts))
    result = edge_merge(inputs, schema, RoundConfig(summarizer="centroid"), embed=embed,
                        probe_set=probe, confusion_margin=9.0)
    assert result.stats.dropped_sources == ["liar"]
    dropped = [f for f in result.flagged if f.reason == "implausible source"]
    assert {f.source for f in dropped} == {"liar"} and len(dropped) == 8
    assert result.stats.flagged_sources == 8
    assert dropped[0].own_similarity > dropped[0].closest_similarity == 0.25
    kept = {(s.tool_id, s.text) for s in result.compendium.scenarios}
    assert {(s["tool_id"], s["text"]) for s in honest} <= kept
    # Even the liar's two correct labels go: the whole source is dropped, not entry by entry. The
    # small source stays; its "17 times 23" for recipes contradicts the honest calculator entry
    # word for word, and the conflict log keeps the label that fits.
    assert ("recipes", "What is 17 times 23?") not in kept
    assert result.stats.cross_tool_dropped == 1
    assert sum(s.support for s in result.compendium.scenarios) == len(honest) + 1
    assert not any("Lisbon" in p.text for p in result.compendium.precautions)
    # The check off: the liar's six relabelled requests contradict the honest client's, and the
    # conflict log keeps the labels that fit the texts (the confusion check is off here too).
    off = edge_merge(inputs, schema, RoundConfig(summarizer="centroid"), embed=embed,
                     probe_set=probe, confusion_margin=9.0, source_limit=9.0)
    assert off.stats.dropped_sources == [] and not off.flagged
    assert off.stats.cross_tool_dropped == 6 + 1
    assert {(s.tool_id, s.text) for s in off.compendium.scenarios} == kept
    # With the conflict log off as well, everything comes through.
    bare = edge_merge(inputs, schema, RoundConfig(summarizer="centroid", conflict_log=False),
                      embed=embed, probe_set=probe, confusion_margin=9.0, source_limit=9.0)
    assert sum(s.support for s in bare.compendium.scenarios) == len(honest) + 2 + 8


def test_invalid_submission_is_rejected_and_others_merged(schema, embed):
    bad = sub("bad", [sc("no-such-tool", "anything")])
    good = sub("good", [sc("weather", "Will it rain tomorrow?")])
    result = edge_merge([bad, good], schema, RoundConfig(), embed=embed)
    assert [r.source for r in result.rejected] == ["bad"]
    assert "no-such-tool" in " ".join(result.rejected[0].reasons)
    assert result.accepted_sources == ["good"]


def test_conflicts_to_precautions_composes_use_and_exception(schema):
    entry = ConflictEntry(
        tool_id="calculator",
        centroid_id="abc",
        centroid={"text": "Symbolic integration of an expression.", "preconditions": {}},
        dissenters=[{"text": "Expressions nested deeper than 4 levels"},
                    {"text": "Currency conversion"}],
        reason="LLM probe found the scenarios inconsistent",
    )
    [p] = conflicts_to_precautions([entry], schema)
    assert p.tool_id == "calculator" and p.support == 3
    assert p.text == (
        "Use Calculator for symbolic integration of an expression; do not use Calculator when "
        "expressions nested deeper than 4 levels or when currency conversion"
    )


def test_a_picked_scenario_wins_only_while_it_is_one_of_the_conflicts_candidates(schema):
    """A reviewer's winning scenario is applied only if its text is still the centroid's or a
    dissenter's: after an erasure re-merged the log without the client that wrote it, the text
    is not published; the conflict is composed as if undecided, from what the log holds now."""
    from federation.merge.operator import conflict_winners

    centroid = {"source": "client:1", "tool_id": "weather", "text": "Rain in Paris",
                "preconditions": {"outdoor": True}, "support": 1}
    other = {"source": "client:3", "tool_id": "weather", "text": "Rain in Paris now",
             "preconditions": {"outdoor": False}, "support": 1}

    def picked(text):
        return ConflictEntry("weather", "abc", centroid, [other], "precondition flags contradict",
                             "scenario", text)

    current = picked("Rain in Paris now")
    assert [(s.tool_id, s.text) for s in conflict_winners([current], schema)] == [
        ("weather", "Rain in Paris now")]
    assert conflicts_to_precautions([current], schema) == []
    gone = picked("Rain in Paris ERASEDSECRET")  # the erased client's dissenter, no longer logged
    assert conflict_winners([gone], schema) == []
    assert [p.text for p in conflicts_to_precautions([gone], schema)] == [
        "Use WeatherNow for rain in Paris; do not use WeatherNow when rain in Paris now and "
        "outdoor is false"]


def test_previous_conflicts_become_precautions_in_the_next_edge_merge(schema, embed):
    first = edge_merge(
        [sub("a", [sc("weather", "Forecast for a city", has_city=True)]),
         sub("b", [sc("weather", "Forecast for a city", has_city=True)]),
         sub("c", [sc("weather", "Forecast for a city.", has_city=False)])],
        schema, RoundConfig(summarizer="none"), embed=embed,
    )
    second = edge_merge([sub("a", [sc("flights", "Book a flight")])], schema,
                        RoundConfig(summarizer="none"), first.conflicts, embed=embed)
    texts = [p.text for p in second.compendium.precautions]
    assert texts == ["Use WeatherNow for forecast for a city; do not use WeatherNow when "
                     "forecast for a city and has_city is false"]
    assert second.stats.precautions_from_conflicts == 1


def _numeric_subs(values):
    return [
        sub(f"c{i}", metadata=[{"tool_id": "weather", "stats": {"success_rate": v}}])
        for i, v in enumerate(values)
    ]


def test_numeric_release_writes_ledger_and_stays_in_range(schema, embed):
    result = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema,
                        RoundConfig(epsilon=2.0), embed=embed, seed=7)
    # every registry tool x declared field is released (a data-independent set), over all K
    n = len(schema.tools) * len(schema.numeric_fields)
    assert len(result.ledger) == n == 16
    [entry] = [e for e in result.ledger if (e.tool_id, e.field) == ("weather", "success_rate")]
    assert entry.contributors == 4
    assert entry.epsilon == pytest.approx(2.0 / n)  # ε_j = ε / K_f
    assert entry.noise_scale == pytest.approx(1.0 / (4 * 2.0 / n))
    assert result.stats.epsilon_spent == pytest.approx(2.0)
    weather = {m.tool_id: m for m in result.compendium.metadata}["weather"]
    assert 0.0 <= weather.stats["success_rate"] <= 1.0
    assert weather.description == schema.tools_by_id["weather"].description
    again = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema, RoundConfig(epsilon=2.0),
                       embed=embed, seed=7)
    assert canonical_bytes(again.compendium) == canonical_bytes(result.compendium)


def test_fields_no_release_can_make_useful_are_drowned_by_counts_alone(schema):
    """A field is drowned when w/(K·ε_j)/√E, the narrowest the published average can get, is at
    least its clipping window w = min(Δ, range), the interval its values are clipped to and its
    figure clamped to: 16 statistics at ε = 2 give ε_j = 1/8, so every field (calls too: window
    [0, 50] in a range of 1,000) needs K·√E > 8. The noise is calibrated to the window, so the
    ratio is the same for every field: all drowned or none."""
    from federation.merge.operator import published_noise_to_window

    config = RoundConfig(epsilon=2.0)
    every = {"calls", "success_rate", "frequency", "latency_ms"}
    assert drowned_fields(schema, config, 4, 1) == every
    assert drowned_fields(schema, config, 4, 4) == every  # K·√E = 8
    assert published_noise_to_window(schema, config, 4, 4) == pytest.approx(1.0)
    assert drowned_fields(schema, config, 5, 4) == frozenset()  # K·√E = 10
    assert published_noise_to_window(schema, config, 5, 4) == pytest.approx(0.8)
    assert "calls" in drowned_fields(schema, RoundConfig(epsilon=0.01), 4, 1)
    assert drowned_fields(schema, config, 0, 0) == frozenset()  # nobody submitted
    assert published_noise_to_window(schema, config, 0, 0) is None
    # a field cap splits ε over fewer statistics: 2·F*·F = 8, ε_j = 1/4, so K·√E > 4 will do
    assert drowned_fields(schema, RoundConfig(epsilon=2.0, field_cap=1), 4, 4) == frozenset()
    assert drowned_fields(schema, RoundConfig(epsilon=2.0, field_cap=1), 2, 4) == every  # = 4


def test_a_statistic_noisier_than_its_clipping_window_is_neither_released_nor_published(
    schema, embed
):
    """`calls` declares [0, 1000] but its values are clipped to the window [0, Δ = 50], and the
    noise is calibrated to that width: at K = 2 and ε_j = 1/8 its scale is 50/(2/8) = 200. That
    is a fifth of the declared range, but four times the window the figure is clamped to: the
    published value lands at 0 or 50 whatever the clients reported. Judged against the range,
    the edges released it (ε spent) and the global published it; judged against the window,
    no edge releases it (no noise, no ledger row, no ε), and a global handed such a figure
    leaves it out."""
    config = RoundConfig(epsilon=2.0)  # 16 statistics: ε_j = 1/8
    assert "calls" in drowned_fields(schema, config, 2, 1)
    subs = [sub(f"c{i}", metadata=[{"tool_id": "weather", "stats": {"calls": c}}])
            for i, c in enumerate((10.0, 30.0))]
    result = edge_merge(subs, schema, config, embed=embed, seed=5,
                        drowned=drowned_fields(schema, config, 2, 1))
    assert not [e for e in result.ledger if e.field == "calls"]
    assert result.stats.epsilon_spent == 0.0
    assert all("calls" not in m.stats for m in result.compendium.metadata)
    edges = [sub("org-a", metadata=[{"tool_id": "weather", "stats": {"calls": 50.0}}])]
    scales = {"org-a": {("weather", "calls"): 200.0}}
    published = server_merge(edges, schema, RoundConfig(), embed=embed, noise_scales=scales)
    assert published.stats.stats_withheld == 1
    assert all("calls" not in m.stats for m in published.compendium.metadata)
    spec = schema.fields_by_name["calls"]
    assert noise_dominated(200.0, spec) and noise_dominated(50.0, spec)
    assert not noise_dominated(49.0, spec)


def test_a_drowned_field_is_not_released_nor_charged(schema, embed):
    """The edge draws no noise, writes no ledger row and spends no ε for the drowned fields; the
    others are released exactly as without them (same ε_j), and every tool keeps its entry."""
    drowned = frozenset({"success_rate", "frequency", "latency_ms"})
    full = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema, RoundConfig(epsilon=2.0),
                      embed=embed, seed=7)
    part = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema, RoundConfig(epsilon=2.0),
                      embed=embed, seed=7, drowned=drowned)
    assert {e.field for e in part.ledger} == {"calls"} and len(part.ledger) == len(schema.tools)
    assert [e.epsilon for e in part.ledger] == [e.epsilon for e in full.ledger if e.field == "calls"]
    assert part.stats.epsilon_spent == pytest.approx(2.0 / 4)
    assert part.stats.fields_not_released == sorted(drowned)
    assert {m.tool_id: set(m.stats) for m in part.compendium.metadata} == {
        t.tool_id: {"calls"} for t in schema.tools}
    # A statistic's noise is its own: leaving other fields out does not shift the draws (one
    # stream in key order put one statistic's draw on another's value, so two runs of a release
    # with different drowned sets told a difference of private figures exactly).
    calls = {m.tool_id: m.stats["calls"] for m in full.compendium.metadata}
    assert {m.tool_id: m.stats["calls"] for m in part.compendium.metadata} == calls
    nothing = edge_merge(_numeric_subs([0.5]), schema, RoundConfig(epsilon=2.0), embed=embed,
                         seed=7, drowned=frozenset(f.name for f in schema.numeric_fields))
    assert nothing.ledger == [] and nothing.stats.epsilon_spent == 0.0
    assert all(m.stats == {} for m in nothing.compendium.metadata)


def test_a_field_of_kind_other_is_not_counted_released_nor_charged(schema, embed):
    """A declared field of kind `other` cannot be derived from a usage log, so no client of the
    toolkit sends it. The edge still counted it in F (ε_j = ε/(T·5) for 4 released fields, every
    figure noisier than it needed), wrote a ledger row per tool for it, and released it: the
    noised neutral value, or, from a client that sent one, its value noised. It is now outside
    the split, the ledger and the release: the other fields' figures and rows are exactly those of
    the schema without it, and a value some client sent for it never leaves the edge."""
    from compendium.schema import NumericFieldSpec, NumericKind
    from federation.merge.operator import published_noise_to_window

    other = NumericFieldSpec(name="error_budget", kind=NumericKind.OTHER, min=0, max=1,
                             sensitivity=1)
    wider = Schema(tools=schema.tools, numeric_fields=[*schema.numeric_fields, other])
    assert [f.name for f in wider.releasable_fields] == [f.name for f in schema.numeric_fields]
    subs = [sub(f"c{i}", metadata=[{"tool_id": "weather",
                                    "stats": {"success_rate": v, "error_budget": 0.9}}])
            for i, v in enumerate([0.2, 0.4, 0.6, 0.8])]
    for config in (RoundConfig(epsilon=2.0), RoundConfig(epsilon=2.0, field_cap=1)):
        plain = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema, config, embed=embed,
                           seed=7)
        assert plain.stats.accepted == 4
        result = edge_merge(subs, wider, config, embed=embed, seed=7)
        assert {e.field for e in result.ledger} == {f.name for f in schema.numeric_fields}
        assert [e.epsilon for e in result.ledger] == [e.epsilon for e in plain.ledger]
        assert result.ledger[0].epsilon == pytest.approx(
            2.0 / (16 if config.field_cap is None else 8))  # T·F = 16, 2·F*·F = 8
        assert result.stats.epsilon_spent == pytest.approx(2.0)
        assert all("error_budget" not in m.stats for m in result.compendium.metadata)
        assert canonical_bytes(result.compendium) == canonical_bytes(plain.compendium)
        # which fields drown, and how far, is the released fields' matter alone
        for k, e in ((4, 1), (4, 4), (5, 4)):
            assert drowned_fields(wider, config, k, e) == drowned_fields(schema, config, k, e)
            assert published_noise_to_window(wider, config, k, e) == pytest.approx(
                published_noise_to_window(schema, config, k, e))
    # nor does the server publish one an edge handed it (an edge of an older release)
    edges = [sub("org-a", metadata=[{"tool_id": "weather",
                                     "stats": {"error_budget": 0.9, "success_rate": 0.5}}])]
    scales = {"org-a": {("weather", "success_rate"): 0.01}}
    published = server_merge(edges, wider, RoundConfig(), embed=embed, noise_scales=scales)
    [weather] = [m for m in published.compendium.metadata if m.tool_id == "weather"]
    assert weather.stats == {"success_rate": 0.5}
    # nor carries forward one a global published before this rule holds, for a tool no edge
    # reported this round
    previous = Compendium.model_validate({"metadata": [
        {"tool_id": "flights", "stats": {"error_budget": 0.4, "calls": 7.0}}]})
    carried = server_merge(edges, wider, RoundConfig(), embed=embed, noise_scales=scales,
                           previous=previous)
    [flights] = [m for m in carried.compendium.metadata if m.tool_id == "flights"]
    assert flights.stats == {"calls": 7.0}


def test_an_edge_merge_without_a_seed_draws_fresh_noise_not_the_rounds_public_seed(schema, embed):
    """edge_merge's seed defaulted to RoundConfig.seed, which the rounds API shows to every
    client: a caller that passed none published noise anyone could draw again."""
    config = RoundConfig(epsilon=2.0, seed=0)

    def released(**seed):
        result = edge_merge(_numeric_subs([0.2, 0.4, 0.6, 0.8]), schema, config, embed=embed,
                            drowned=frozenset({"success_rate", "frequency", "latency_ms"}), **seed)
        return {m.tool_id: m.stats["calls"] for m in result.compendium.metadata}

    # Fresh draws differ (drawn from the round's public seed, they would all be its draw), but
    # the released figures are clipped to the field's window and two draws can both land at its
    # ends for every tool (CI met one such pair): of four fresh draws, not all are the same.
    assert len({tuple(sorted(released().items())) for _ in range(4)}) > 1
    assert released(seed=config.seed) == released(seed=config.seed)  # a seed given: replayable


def test_budget_cap_refuses_before_noise(schema, embed):
    class Exploding:
        def laplace(self, *a, **k):  # pragma: no cover - must never be reached
            raise AssertionError("noise drawn")

    with pytest.raises(BudgetExceeded, match="epsilon budget"):
        edge_merge(_numeric_subs([0.5, 0.5]), schema, RoundConfig(epsilon=1.0), embed=embed,
                   epsilon_remaining=0.5)
    ok = edge_merge(_numeric_subs([0.5, 0.5]), schema, RoundConfig(epsilon=1.0), embed=embed,
                    epsilon_remaining=1.0)
    assert ok.stats.epsilon_spent == pytest.approx(1.0)


def test_an_edge_release_by_hand_plain_and_trimmed(embed):
    """One tool, one field, ε = 3 (ε_j = 3): five clients report success rates 0.1, 0.2, 0.3,
    0.4 and 1.0. Plain: mean 0.4, b = 1/(5 · 3). Under a robust rule at share 0.2 (f = 1) the
    lowest and highest go: mean 0.3 of K − 2f = 3, b = 1/(3 · 3). Each figure is that mean plus
    the statistic's own Laplace draw (`_statistic_rng` of the release's seed), clamped to the
    window and kept to a hundredth of b's order of magnitude; the ledger says what was spent."""
    from compendium.schema import NumericFieldSpec, NumericKind
    from federation.merge.operator import _published_number, _statistic_rng
    from federation.merge.privacy import laplace_release

    one = Schema(
        tools=[ToolSpec(tool_id="weather", name="WeatherNow", description="Weather forecasts")],
        numeric_fields=[NumericFieldSpec(name="success_rate", kind=NumericKind.RATE, min=0,
                                         max=1, sensitivity=1)],
    )
    subs = [sub(f"c{i}", metadata=[{"tool_id": "weather", "stats": {"success_rate": v}}])
            for i, v in enumerate([0.1, 0.2, 0.3, 0.4, 1.0])]
    plain, trimmed = [0.1, 0.2, 0.3, 0.4, 1.0], [0.2, 0.3, 0.4]
    for rule, values, kept, mechanism in (("none", plain, 5, "laplace"),
                                          ("trimmed-mean", trimmed, 3, "laplace-trimmed-mean"),
                                          ("krum", trimmed, 3, "laplace-trimmed-mean")):
        config = RoundConfig(epsilon=3.0, robust_rule=rule, trim_fraction=0.2)
        result = edge_merge(subs, one, config, embed=embed, seed=5)
        [entry] = result.ledger
        b = 1 / (kept * 3.0)
        assert (entry.contributors, entry.epsilon, entry.sensitivity, entry.mechanism) == (
            kept, 3.0, 1.0, mechanism)
        assert entry.noise_scale == pytest.approx(b)
        # the mean of what is kept, released with the statistic's own generator (by hand:
        # test_the_laplace_release_is_the_clipped_mean_plus_a_draw_of_scale_w_over_k_epsilon)
        value, _ = laplace_release(
            values, lower=0.0, upper=1.0, sensitivity=1.0, epsilon=3.0,
            rng=_statistic_rng(np.random.SeedSequence(5), "weather", "success_rate"))
        expected = _published_number(value, b, 0.0, 1.0)
        assert result.compendium.metadata[0].stats == {"success_rate": expected}
        assert result.stats.epsilon_spent == pytest.approx(3.0)


def test_a_release_at_a_huge_epsilon_is_published_not_an_overflow(schema, embed):
    """RoundConfig takes any finite ε from 1e-6 up (the cap is the operator's). At ε = 1e307 the
    noise scale is about 1e-308, and the published figure was rounded to a hundredth of that
    scale's order of magnitude: 0.3 / 1e-310 overflows to infinity and round() raised
    OverflowError, so the edge merge failed the round ("cannot convert float infinity to
    integer"). The figure is the clipped mean, to 6 significant digits."""
    result = edge_merge(_numeric_subs([0.2, 0.4]), schema, RoundConfig(epsilon=1e307),
                        embed=embed, seed=3)
    assert result.ledger and all(e.noise_scale < 1e-300 for e in result.ledger)
    weather = {m.tool_id: m for m in result.compendium.metadata}["weather"]
    assert weather.stats["success_rate"] == pytest.approx(0.3)


def test_field_cap_splits_epsilon_by_f_star(schema, embed):
    subs = [
        sub("c1", metadata=[{"tool_id": "weather", "stats": {"success_rate": 0.5, "calls": 3}},
                            {"tool_id": "flights", "stats": {"calls": 2}}]),
    ]
    plain = edge_merge(subs, schema, RoundConfig(epsilon=1.2), embed=embed)
    assert [e.epsilon for e in plain.ledger] == pytest.approx([1.2 / 16] * 16)  # 4 tools x 4
    # F* = 1 tool, each moving its 4 fields, and a replacement user may feed another: 2·F* tools
    # move, ε_j = ε / (2·F*·4)
    capped = edge_merge(subs, schema, RoundConfig(epsilon=1.2, field_cap=1), embed=embed)
    assert [e.epsilon for e in capped.ledger] == pytest.approx([1.2 / 8] * 16)
    assert capped.stats.epsilon_spent == pytest.approx(1.2)
    # F* = 2: 2·F* = 4 tools is the whole registry, the cap saves nothing
    wide = edge_merge(subs, schema, RoundConfig(epsilon=1.2, field_cap=2), embed=embed)
    assert [e.epsilon for e in wide.ledger] == pytest.approx([1.2 / 16] * 16)
    assert wide.stats.epsilon_spent == pytest.approx(1.2)


def test_server_merge_averages_without_noise_and_merges_text(schema, embed):
    e1 = edge_merge(_numeric_subs([0.2, 0.2]) + [sub("x", [sc("weather", "Rain tomorrow?")])],
                    schema, RoundConfig(), embed=embed, seed=1)
    e2 = edge_merge(_numeric_subs([0.9]) + [sub("y", [sc("weather", "Rain tomorrow")])],
                    schema, RoundConfig(), embed=embed, seed=2)
    result = server_merge([MergeInput("org-a", e1.compendium), MergeInput("org-b", e2.compendium)],
                          schema, RoundConfig(summarizer="centroid"), embed=embed)
    assert result.ledger == []
    w1, w2 = e1.compendium.num_users, e2.compendium.num_users

    def rate(comp):
        return {m.tool_id: m.stats for m in comp.metadata}["weather"]["success_rate"]

    expected = (rate(e1.compendium) * w1 + rate(e2.compendium) * w2) / (w1 + w2)
    assert rate(result.compendium) == pytest.approx(expected, abs=1e-5)
    assert [s.support for s in result.compendium.scenarios] == [2]


def test_probe_extractive_picks_the_member_that_routes_the_probe_set(schema, embed):
    probe_texts = ["Will it snow in Oslo tomorrow?", "Find flights to Rome", "What is 17 times 3?"]
    probe = ProbeSet(probe_texts, ["weather", "flights", "calculator"], embed(probe_texts))
    subs = [
        sub("a", [sc("weather", "Weather forecast: will it snow tomorrow in a city?")]),
        sub("b", [sc("weather", "Weather forecast: will it snow tomorrow in a city")]),
        sub("c", [sc("flights", "Search for flights to a destination")]),
        sub("d", [sc("calculator", "Multiply two numbers")]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="probe-extractive", tau=0.8),
                        embed=embed, probe_set=probe)
    assert result.stats.summarizer_fallbacks == []
    weather = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert len(weather) == 1 and "snow" in weather[0].text
    none = edge_merge(subs, schema, RoundConfig(summarizer="probe-extractive"), embed=embed)
    assert none.stats.summarizer_fallbacks[0]["reason"] == "no public probe set is loaded"
    assert none.stats.summarizer_fallbacks[0]["kind"] == "no probe set"


def test_annex_and_templates_deduplicated(schema, embed):
    subs = [
        sub("a", templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T1 {city}"}],
            annex=[{"subject": "flights", "relation": "needs", "object": "airport code"}]),
        sub("b", templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T1 {city}"}],
            annex=[{"subject": "flights", "relation": "needs", "object": "airport code"}]),
        sub("c", templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T2 {city}"}]),
    ]
    result = edge_merge(subs, schema, RoundConfig(), embed=embed)
    assert [t.template for t in result.compendium.templates] == ["T1 {city}"]
    assert len(result.compendium.annex) == 1 and result.stats.annex_in == 2


def test_llm_merges_differing_templates_asking_for_the_json_schema(schema, embed):
    from federation.merge.llm import OpenAICompatibleLLM
    from tests.chat_server import ChatServer

    subs = [
        sub(name, templates=[{"tool_id": "weather", "signature": "f(city)", "template": body}])
        for name, body in (("a", "T1 {city}"), ("b", "T1 {city}"), ("c", "T2 {city}"))
    ]
    server = ChatServer(default='{"summary": "Weather for {city}"}')
    try:
        result = edge_merge(subs, schema, RoundConfig(summarizer="llm-single-shot"), embed=embed,
                            llm=OpenAICompatibleLLM(server.url))
    finally:
        server.close()
    assert [t.template for t in result.compendium.templates] == ["Weather for {city}"]
    [asked] = [r["body"] for r in server.requests if "Merge these prompt templates" in str(r["body"])]
    assert asked["response_format"]["schema"]["required"] == ["summary"]
    assert result.stats.summarizer_fallbacks == []


def test_server_keeps_the_best_supported_scenarios_per_tool(schema, embed):
    edge = edge_merge(
        [sub(f"c{i}", [sc("weather", "Will it rain tomorrow?")]) for i in range(3)]
        + [sub("d", [sc("weather", "Temperature in Berlin")]),
           sub("e", [sc("weather", "Is a storm coming to Miami")])],
        schema, RoundConfig(summarizer="none"), embed=embed,
    )
    result = server_merge([MergeInput("org", edge.compendium)], schema,
                          RoundConfig(summarizer="none", max_scenarios_per_tool=2), embed=embed)
    kept = result.compendium.scenarios
    assert len(kept) == 2 and kept[0].support == 3


def test_server_can_publish_stats_only_metadata(schema, embed):
    edge = edge_merge(_numeric_subs([0.5, 0.7]), schema, RoundConfig(), embed=embed)
    assert edge.compendium.metadata[0].description is not None
    result = server_merge([MergeInput("org", edge.compendium)], schema,
                          RoundConfig(global_metadata="stats"), embed=embed)
    meta = {m.tool_id: m for m in result.compendium.metadata}["weather"]
    assert meta.description is None and meta.spec is None and "success_rate" in meta.stats


def test_server_merge_carries_the_previous_global_forward(schema, embed):
    config = RoundConfig(summarizer="none")
    first = server_merge(
        [MergeInput("org", edge_merge(
            _numeric_subs([0.4, 0.6]) + [sub("x", [sc("weather", "Will it rain tomorrow?"),
                                                   sc("recipes", "A vegan lasagna recipe")])],
            schema, config, embed=embed, seed=1).compendium)],
        schema, config, embed=embed,
    ).compendium
    # Round 2: nobody resends the recipe scenario; one client repeats the rain question and
    # reports calculator statistics only.
    edge = edge_merge(
        [sub("y", [sc("weather", "Will it rain tomorrow"), sc("flights", "Cheap flights to Rome")],
             metadata=[{"tool_id": "calculator", "stats": {"success_rate": 0.2}}])],
        schema, config, embed=embed, seed=2,
    ).compendium
    carried = server_merge([MergeInput("org", edge)], schema, config, embed=embed,
                           previous=first).compendium
    texts = {(s.tool_id, s.text): s.support for s in carried.scenarios}
    assert ("recipes", "A vegan lasagna recipe") in texts  # kept from the previous global
    assert ("flights", "Cheap flights to Rome") in texts
    rain = [n for (tool, _), n in texts.items() if tool == "weather"]
    assert rain == [2]  # the repeated question joined the carried one: support adds up
    # an edge releases every registry tool's statistics: this round's replace the carried ones
    stats = {m.tool_id: m.stats for m in carried.metadata}
    assert set(stats) == schema.tool_ids
    assert stats["weather"] == {m.tool_id: m.stats for m in edge.metadata}["weather"]
    # an edge that released no statistics (an erasure past the budget): all are carried
    bare = edge_merge([sub("y", [sc("flights", "Cheap flights to Rome")])], schema, config,
                      embed=embed, seed=2, release_numeric=False).compendium
    kept = server_merge([MergeInput("org", bare)], schema, config, embed=embed,
                        previous=first).compendium
    assert {m.tool_id: m.stats for m in kept.metadata} == {m.tool_id: m.stats
                                                           for m in first.metadata}
    alone = server_merge([MergeInput("org", edge)], schema, config, embed=embed).compendium
    assert ("recipes", "A vegan lasagna recipe") not in {(s.tool_id, s.text) for s in alone.scenarios}


def test_carried_global_drops_tools_the_schema_no_longer_has(schema, embed):
    config = RoundConfig(summarizer="none")
    first = server_merge(
        [MergeInput("org", edge_merge([sub("x", [sc("recipes", "A vegan lasagna recipe"),
                                                 sc("weather", "Rain in Oslo?")])],
                                      schema, config, embed=embed).compendium)],
        schema, config, embed=embed,
    ).compendium
    smaller = Schema(tools=[t for t in schema.tools if t.tool_id != "recipes"])
    edge = edge_merge([sub("y", [sc("flights", "Cheap flights to Rome")])], smaller, config,
                      embed=embed).compendium
    result = server_merge([MergeInput("org", edge)], smaller, config, embed=embed, previous=first)
    assert result.rejected == []
    assert {s.tool_id for s in result.compendium.scenarios} == {"weather", "flights"}


def test_an_edge_merged_before_the_schema_changed_is_not_rejected_whole(schema, embed):
    """An edge compendium is merged at the server under the schema in force then: an erasure
    merges a published round's global again long after its edges were merged, and every edge
    releases statistics for every registry tool. A tool the registry dropped since, or a numeric
    field removed or narrowed, made each untouched edge invalid and rejected whole, and the
    re-published global lost every organization's entries. An edge is read as the schema in
    force reads it, as the carried-forward global is: the dropped tool's entries go, the rest
    stays."""
    config = RoundConfig(summarizer="none", epsilon=5.0)
    edge = edge_merge(
        [sub("x", [sc("recipes", "A vegan lasagna recipe"), sc("weather", "Rain in Oslo?")],
             metadata=[{"tool_id": "weather", "stats": {"calls": 40}}])],
        schema, config, embed=embed,
    ).compendium
    fields = {f.name: f for f in schema.numeric_fields}
    smaller = Schema(
        tools=[t for t in schema.tools if t.tool_id != "recipes"],
        numeric_fields=[fields["calls"].model_copy(update={"max": 1.0}),
                        *(f for name, f in fields.items() if name not in ("calls", "success_rate"))],
    )
    result = server_merge([MergeInput("org:a", edge)], smaller, config, embed=embed)
    assert result.rejected == [] and result.accepted_sources == ["org:a"]
    assert {(s.tool_id, s.text) for s in result.compendium.scenarios} == {("weather", "Rain in Oslo?")}
    for m in result.compendium.metadata:
        assert m.tool_id != "recipes"
        assert "success_rate" not in m.stats and m.stats.get("calls", 0) <= 1.0


def test_carried_global_keeps_its_entries_when_a_numeric_field_is_removed_or_narrowed(
    schema, embed
):
    """The operator removes a numeric field, or narrows one's range, between rounds: the carried
    global's statistics of it made the whole global rejected, and every scenario it carried was
    lost while clients sent only what changed."""
    config = RoundConfig(summarizer="none", epsilon=5.0)
    first = server_merge(
        [MergeInput("org", edge_merge(
            [sub("x", [sc("weather", "Rain in Oslo?")],
                 metadata=[{"tool_id": "weather", "stats": {"calls": 40, "success_rate": 0.9}}])],
            schema, config, embed=embed).compendium)],
        schema, config, embed=embed,
    ).compendium
    assert {"calls", "success_rate"} <= set(first.metadata[0].stats)
    fields = {f.name: f for f in schema.numeric_fields}
    narrowed = fields["calls"].model_copy(update={"max": 1.0})
    changed = Schema(tools=schema.tools, numeric_fields=[narrowed, *(
        f for name, f in fields.items() if name not in ("calls", "success_rate"))])
    edge = edge_merge([sub("y", [sc("flights", "Cheap flights to Rome")])], changed, config,
                      embed=embed).compendium
    result = server_merge([MergeInput("org", edge)], changed, config, embed=embed, previous=first)
    assert result.rejected == []
    assert {s.tool_id for s in result.compendium.scenarios} == {"weather", "flights"}
    for m in result.compendium.metadata:
        assert "success_rate" not in m.stats and m.stats.get("calls", 0) <= 1.0


def test_centrality_ties_do_not_depend_on_float_noise():
    from federation.merge.clustering import central_order

    a = np.array([0.6, 0.8, 0.0])
    b = np.array([0.8, 0.6, 0.0])
    # A two-member cluster: both members are exactly as central; batch noise of 1e-7 in either
    # must not pick the representative.
    for noise in (1e-7, -1e-7):
        nudged = b + np.array([0.0, noise, 0.0])
        assert list(central_order(np.stack([a, nudged]))) == [0, 1]
    far = np.array([0.0, 0.0, 1.0])
    assert next(central_order(np.stack([far, a, a]))) == 1  # a real difference still decides


def test_the_robust_rule_drops_a_relabelled_batch_across_sources(schema, embed):
    """Four clients send requests of the calculator under its label; a fifth sends cooking
    requests under the same label. With Krum and f = floor(0.25 * 5) = 1 the fifth's batch goes
    (flagged, reason "robust rule (krum)") and its other, honest batch stays; with rule none
    (every other check off) it comes through."""
    sums = [["What is 17 times 23?", "Compute 144 divided by 12", "Add 45 and 38"],
            ["Multiply 9 by 81", "What is the square root of 1764?", "Subtract 19 from 100"],
            ["Calculate 15 percent of 80", "What is 7 to the power of 3?", "Divide 1000 by 8"],
            ["How much is 12 plus 30?", "What is 6 times 7?", "Compute 2 to the 10th power"]]
    inputs = [sub(f"c{i}", [sc("calculator", t) for t in texts]) for i, texts in enumerate(sums)]
    cooking = ["How do I cook a mushroom risotto?", "Ingredients for banana bread",
               "A quick recipe for pancakes"]
    inputs.append(sub("liar", [sc("calculator", t) for t in cooking]
                      + [sc("weather", "Will it rain in Lisbon tomorrow?")]))
    config = RoundConfig(summarizer="centroid", tau=0.99, robust_rule="krum", trim_fraction=0.25)
    checks_off = {"confusion_margin": 9.0, "source_limit": 9.0}
    result = edge_merge(inputs, schema, config, embed=embed, **checks_off)
    robust = [f for f in result.flagged if f.reason == "robust rule (krum)"]
    assert {(f.source, f.tool_id) for f in robust} == {("liar", "calculator")} and len(robust) == 3
    assert result.stats.robust_dropped == 3 and result.stats.robust_sources == {"liar": 3}
    assert robust[0].own_similarity > robust[0].closest_similarity
    texts = {s.text for s in result.compendium.scenarios}
    assert not texts & set(cooking) and "Will it rain in Lisbon tomorrow?" in texts
    assert {t for texts_ in sums for t in texts_} <= texts
    plain = edge_merge(inputs, schema, config.model_copy(update={"robust_rule": "none"}),
                       embed=embed, **checks_off)
    assert not plain.flagged and set(cooking) <= {s.text for s in plain.compendium.scenarios}


def test_the_merge_counts_the_groups_krum_judged_past_its_premise(schema, embed):
    """Four clients per edge at an f share of 0.25: f = 1 and n = 4 < 2f + 3, so Krum's guarantee
    does not hold for the two tools it judges across the four sources. The merge still applies
    it (the same entries kept), and its stats say how many groups it judged so, at which (n, f);
    the trimmed mean (premise n > 2f) is never counted. The server merge counts the same way."""
    calc = [["What is 17 times 23?", "Add 45 and 38"], ["Multiply 9 by 81", "Subtract 19 from 100"],
            ["Calculate 15 percent of 80", "Divide 1000 by 8"], ["What is 6 times 7?", "Add 2 and 2"]]
    rain = ["Will it rain in Lisbon tomorrow?", "Is it sunny in Oslo today?",
            "Forecast for Rome this weekend", "How cold is it in Berlin tonight?"]
    inputs = [sub(f"c{i}", [sc("calculator", t) for t in calc[i]] + [sc("weather", rain[i])])
              for i in range(4)]
    config = RoundConfig(summarizer="centroid", tau=0.99, robust_rule="krum", trim_fraction=0.25)
    checks_off = {"confusion_margin": 9.0, "source_limit": 9.0}
    result = edge_merge(inputs, schema, config, embed=embed, **checks_off)
    assert result.stats.robust_dropped == 3  # one batch of each tool (n − f = 3 kept)
    assert result.stats.krum_below_premise == 2
    assert result.stats.krum_below_premise_sizes == [{"n": 4, "f": 1, "groups": 2}]
    assert result.stats.as_dict()["krum_below_premise"] == 2
    trimmed = edge_merge(inputs, schema, config.model_copy(update={"robust_rule": "trimmed-mean"}),
                         embed=embed, **checks_off)
    assert trimmed.stats.robust_dropped > 0 and trimmed.stats.krum_below_premise == 0
    assert trimmed.stats.krum_below_premise_sizes == []
    five = edge_merge([*inputs, sub("c4", [sc("calculator", "Compute 2 to the 10th power"),
                                           sc("weather", "Will it snow in Oslo?")])],
                      schema, config, embed=embed, **checks_off)
    assert five.stats.robust_dropped > 0 and five.stats.krum_below_premise == 0  # 5 ≥ 2·1 + 3
    server = server_merge(inputs, schema, config, embed=embed, **checks_off)
    assert server.stats.krum_below_premise == 2


def test_near_duplicates_claimed_for_different_tools_keep_the_claim_of_more_sources(schema, embed):
    """IsConsistent across tools: the same request reported for two tools is a contradiction.
    More sources win; at equal sources, the text nearer its tool's public profile. The losers
    are logged and, next round, become precautions on their own tools."""
    checks_off = {"confusion_margin": 10.0, "source_limit": 2.0}  # leave it to the conflict log
    subs = [
        sub("c1", [sc("flights", "Cheap tickets from Boston to Denver next week")]),
        sub("c2", [sc("flights", "Cheap tickets from Boston to Denver next week.")]),
        sub("c3", [sc("calculator", "Cheap tickets from Boston to Denver next week"),
                   sc("flights", "Will it rain in Paris tomorrow")]),
        sub("c4", [sc("weather", "Will it rain in Paris tomorrow?")]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="none"), embed=embed, **checks_off)
    kept = sorted((s.tool_id, s.support) for s in result.compendium.scenarios)
    assert kept == [("flights", 2), ("weather", 1)]
    assert result.stats.cross_tool_dropped == 2
    by_winner = {c.tool_id: c for c in result.conflicts}
    assert set(by_winner) == {"flights", "weather"}
    assert all(c.reason == "parent tools differ" for c in result.conflicts)
    [lost] = by_winner["flights"].dissenters
    assert (lost["tool_id"], lost["source"], lost["support"]) == ("calculator", "c3", 1)
    assert [d["tool_id"] for d in by_winner["weather"].dissenters] == ["flights"]  # a tie: nearer

    second = edge_merge([sub("a", [sc("recipes", "Vegan lasagna recipe")])], schema,
                        RoundConfig(summarizer="none"), result.conflicts, embed=embed)
    precautions = sorted((p.tool_id, p.text) for p in second.compendium.precautions)
    assert precautions == [
        ("calculator", "Do not use Calculator for requests like: Cheap tickets from Boston to "
                       "Denver next week (use FlightFinder instead)"),
        ("flights", "Do not use FlightFinder for requests like: Will it rain in Paris tomorrow "
                    "(use WeatherNow instead)"),
    ]
    # A reviewer's own precaution for such a conflict is the losing tool's too.
    edited = ConflictEntry(**{**by_winner["weather"].as_dict(), "resolution": "precaution",
                              "resolution_text": "Ask which city first"})
    assert [(p.tool_id, p.text) for p in conflicts_to_precautions([edited], schema)] == [
        ("flights", "Ask which city first")]
    # A reviewer who picks the dissenter makes it a scenario of its own tool.
    picked = [ConflictEntry(**{**by_winner["weather"].as_dict(), "resolution": "scenario",
                               "resolution_text": "Will it rain in Paris tomorrow"})]
    third = edge_merge([sub("a", [sc("recipes", "Vegan lasagna recipe")])], schema,
                       RoundConfig(summarizer="none"), picked, embed=embed)
    assert ("flights", "Will it rain in Paris tomorrow") in {
        (s.tool_id, s.text) for s in third.compendium.scenarios}

    # Without the conflict log everything merges as it comes: both claims stay, nothing logged.
    off = edge_merge(subs, schema, RoundConfig(summarizer="none", conflict_log=False), embed=embed,
                     **checks_off)
    assert sorted(s.tool_id for s in off.compendium.scenarios) == [
        "calculator", "flights", "flights", "weather"]
    assert not off.conflicts and off.stats.cross_tool_dropped == 0
    flagged = [sub(c, [sc("weather", "Get the weather forecast for a city", has_city=v)])
               for c, v in (("c1", True), ("c2", True), ("c3", False))]
    assert not edge_merge(flagged, schema, RoundConfig(conflict_log=False), embed=embed).conflicts


def test_a_huge_stated_support_does_not_win_a_conflict_across_tools(schema, embed):
    """Support is the submitter's word. One client claiming a flight request for the calculator
    with support 50 loses to one honest client's single claim for flights (equal sources, and
    the honest text is nearer the flights profile); two honest sources beat it even where the
    adversary's text would be nearer its own tool."""
    checks_off = {"confusion_margin": 10.0, "source_limit": 2.0}  # leave it to the conflict log
    config = RoundConfig(summarizer="none")
    loud = {**sc("calculator", "Cheap tickets from Boston to Denver next week"), "support": 50}
    one_each = [sub("honest", [sc("flights", "Cheap tickets from Boston to Denver next week.")]),
                sub("adversary", [loud])]
    result = edge_merge(one_each, schema, config, embed=embed, **checks_off)
    assert [(s.tool_id, s.support) for s in result.compendium.scenarios] == [("flights", 1)]
    [conflict] = result.conflicts
    assert conflict.tool_id == "flights"
    assert [(d["tool_id"], d["source"], d["support"]) for d in conflict.dissenters] == [
        ("calculator", "adversary", 50)]

    # Sources come first: the calculator's text is nearer its own profile here, and still loses
    # to two sources.
    numeric = {**sc("calculator", "compute 15% of the 420 dollar flight price"), "support": 50}
    two = [sub("h1", [sc("flights", "compute 15% of the 420 dollar flight price")]),
           sub("h2", [sc("flights", "Compute 15% of the 420 dollar flight price")]),
           sub("adversary", [numeric])]
    result = edge_merge(two, schema, config, embed=embed, **checks_off)
    assert [(s.tool_id, s.support) for s in result.compendium.scenarios] == [("flights", 2)]
    alone = edge_merge(two[:1] + two[2:], schema, config, embed=embed, **checks_off)
    assert [s.tool_id for s in alone.compendium.scenarios] == ["calculator"]

    # At the server the sources are edges, and an edge's support counts the clients that agreed
    # there: 30 of one edge's clients outweigh one client of another, though the calculator's
    # text is nearer its own profile (at an edge, the profile would decide between one source
    # each, as just above).
    text = "compute 15% of the 420 dollar flight price"
    edges = [sub("org-a", [{**sc("flights", text), "support": 30}]),
             sub("org-b", [sc("calculator", text)])]
    served = server_merge(edges, schema, config, embed=embed, **checks_off)
    assert [(s.tool_id, s.support) for s in served.compendium.scenarios] == [("flights", 30)]
    at_edge = edge_merge(edges, schema, config, embed=embed, **checks_off)
    assert [s.tool_id for s in at_edge.compendium.scenarios] == ["calculator"]


# --- Differential privacy of the numeric release (regressions) -------------------------------

def _stats(calls, rate, freq, latency):
    return {"calls": calls, "success_rate": rate, "frequency": freq, "latency_ms": latency}


def _release_loss(schema, embed, config, subs_a, subs_b, tools, seed):
    """Both edge releases (same seed) and the Laplace mechanism's worst-case privacy loss
    between them: Σ |mean_a − mean_b| / b over `tools`' fields (the means recomputed from the
    clipped inputs). The released keys and their noise scales must be the same in both."""
    a = edge_merge(subs_a, schema, config, embed=embed, seed=seed)
    b = edge_merge(subs_b, schema, config, embed=embed, seed=seed)
    la = {(e.tool_id, e.field): e for e in a.ledger}
    lb = {(e.tool_id, e.field): e for e in b.ledger}
    assert la.keys() == lb.keys()
    assert all(la[k].noise_scale == lb[k].noise_scale for k in la)
    ma, mb = _means(schema, subs_a, tools), _means(schema, subs_b, tools)
    moved = {tool for (tool, field), v in ma.items() if v != mb[(tool, field)]}
    return a, b, sum(abs(ma[k] - mb[k]) / la[k].noise_scale for k in ma), moved


def _means(schema, subs, tools):
    from compendium.clipping import clip_bound
    out = {}
    for tool in tools:
        for spec in schema.numeric_fields:
            bound = clip_bound(spec)
            vals = []
            for s in subs:
                got = [m["stats"] for m in s.document["metadata"] if m["tool_id"] == tool]
                vals.append(bound.clip(got[0][spec.name]) if got and spec.name in got[0]
                            else bound.neutral)
            out[(tool, spec.name)] = sum(vals) / len(vals)
    return out


def test_field_cap_charges_every_numeric_field_of_each_tool(schema, embed):
    """F* caps the *tools* a user feeds (compendium.clipping), and a user who feeds a tool moves
    all of its numeric fields. With F* = 1 and one-user clients, one user moves the 4 fields of
    one tool by up to Δ/K each: the privacy loss of the release must stay within ε and within
    what the ledger charges (it was 3.5·ε against a charged ε when ε_j was ε/F*)."""
    config = RoundConfig(epsilon=1.0, field_cap=1)
    other = sub("c2", metadata=[{"tool_id": "weather", "stats": _stats(10, 0.5, 0.5, 300)}])
    high = [sub("c1", metadata=[{"tool_id": "weather", "stats": _stats(50, 1, 1, 10000)}]), other]
    low = [sub("c1", metadata=[{"tool_id": "weather", "stats": _stats(0, 0, 0, 0)}]), other]
    a, _, loss, _ = _release_loss(schema, embed, config, high, low, ["weather"], seed=1)
    # ε_j = ε/(2·F*·4): one tool's 4 fields moving here cost half the round (the other half is
    # for a replacement that feeds another tool: the next test); each field moves by its whole
    # window over K, which its noise is calibrated to, so each costs exactly ε_j (frequency, a
    # window of width 1 under a declared Δ of 2, cost half of it when its noise was 2/(K·ε_j))
    assert loss == pytest.approx(4 * config.epsilon / 8)
    assert loss <= config.epsilon + 1e-9
    assert a.stats.epsilon_spent == pytest.approx(config.epsilon)
    assert a.stats.epsilon_spent >= loss


def test_field_cap_covers_a_replacement_user_who_feeds_other_tools(schema, embed):
    """Neighbouring datasets replace one user by another (K and U fixed). Under F* = 1 the
    replaced user fed weather and the replacement feeds flights: weather falls to the neutral
    value and flights rises from it, so 2·F* tools move. The release's loss must stay within ε
    and what the ledger charges; it was 1.75·ε when ε_j was ε/(F*·F)."""
    config = RoundConfig(epsilon=1.0, field_cap=1)
    other = sub("c2", metadata=[{"tool_id": "calculator", "stats": _stats(10, 0.5, 0.5, 300)}])
    before = [sub("c1", metadata=[{"tool_id": "weather", "stats": _stats(50, 1, 1, 10000)}]), other]
    after = [sub("c1", metadata=[{"tool_id": "flights", "stats": _stats(50, 1, 1, 10000)}]), other]
    a, _, loss, moved = _release_loss(schema, embed, config, before, after, schema.tool_ids,
                                      seed=1)
    assert moved == {"weather", "flights"}
    assert loss == pytest.approx(2 * 4 * config.epsilon / 8)
    assert loss <= config.epsilon + 1e-9
    assert a.stats.epsilon_spent == pytest.approx(config.epsilon)
    assert a.stats.epsilon_spent >= loss


def test_what_the_edge_releases_does_not_depend_on_which_tools_were_used(schema, embed):
    """The set of released (tool, field) statistics, their K and their noise scales are public;
    they must not change when one user's data changes (here: a client's only user used weather,
    or nothing). Releasing only reported pairs, averaged over the clients that reported them,
    published which tools were used with certainty (no ε bounds that)."""
    config = RoundConfig(epsilon=1.0)
    other = sub("c2", metadata=[{"tool_id": "flights", "stats": _stats(3, 1, 1, 200)}])
    used = [sub("c1", metadata=[{"tool_id": "weather", "stats": _stats(5, 1, 1, 100)}]), other]
    unused = [sub("c1"), other]
    a, b, loss, _ = _release_loss(schema, embed, config, used, unused, schema.tool_ids, seed=3)
    assert [m.tool_id for m in a.compendium.metadata] == [m.tool_id for m in b.compendium.metadata]
    assert {e.contributors for e in a.ledger} == {e.contributors for e in b.ledger} == {2}
    assert len(a.ledger) == len(schema.tools) * len(schema.numeric_fields)
    assert loss <= config.epsilon + 1e-9
    assert a.stats.epsilon_spent == pytest.approx(config.epsilon)


@pytest.mark.parametrize("field_cap", [None, 1])
@pytest.mark.parametrize("robust_rule", ["none", "trimmed-mean"])
def test_replacing_one_user_of_a_multi_user_client_costs_at_most_what_the_ledger_charges(
    schema, embed, field_cap, robust_rule
):
    """Both stages together, from usage logs: per-user clipping, the field cap and the average
    over U users at the client (compendium.clipping), then the edge's (trimmed) mean and Laplace
    noise. Replacing one user (U and K fixed) by one with extreme numbers must cost at most the
    ε the ledger charges, and that at most the round's ε; the trimmed mean's scale Δ/((K−2f)·ε_j)
    must cover the order statistics it keeps."""
    import random

    from compendium.clipping import client_statistics, clip_bound
    from compendium.usage_log import UsageRecord

    fields = list(schema.numeric_fields)
    config = RoundConfig(epsilon=1.0, field_cap=field_cap, robust_rule=robust_rule,
                         trim_fraction=0.2)

    def user_log(rng, user, extreme):
        out = []
        for tool in rng.sample(sorted(schema.tool_ids), rng.randint(1, len(schema.tool_ids))):
            for _ in range(rng.choice([1, 200]) if extreme else rng.randint(1, 8)):
                out.append(UsageRecord(
                    line=0, query="q", tool=tool, user=user,
                    outcome=rng.choice(["success", "failure"]),
                    latency_ms=rng.choice([0.0, 5e4]) if extreme else rng.uniform(10, 900)))
        return out

    def subs(logs):
        return [
            sub(f"c{i}", metadata=[{"tool_id": t, "stats": s} for t, s in client_statistics(
                log, fields, field_cap=field_cap).stats.items()])
            for i, log in enumerate(logs)
        ]

    def kept_means(submissions):
        k = len(submissions)
        f = byzantine_count(k, config.trim_fraction) if robust_rule != "none" else 0
        out = {}
        for tool in schema.tool_ids:
            for spec in fields:
                bound = clip_bound(spec)
                vals = []
                for s in submissions:
                    got = [m["stats"] for m in s.document["metadata"] if m["tool_id"] == tool]
                    vals.append(bound.clip(got[0][spec.name]) if got else bound.neutral)
                kept = sorted(vals)[f:k - f]
                out[(tool, spec.name)] = sum(kept) / len(kept)
        return out

    def fixed(user, high):  # every tool: 1 failed call at 0 ms, or 200 successful at 50,000 ms
        return [UsageRecord(line=0, query="q", tool=tool, user=user,
                            outcome="success" if high else "failure",
                            latency_ms=5e4 if high else 0.0)
                for tool in sorted(schema.tool_ids) for _ in range(200 if high else 1)]

    # The worst case for a trimmed mean first: five one-user clients, two low and two high, and
    # the victim moves from low to high, so the kept middle three move by a whole window.
    pairs = [([fixed(f"u{c}", c >= 3) for c in range(5)],
              [fixed("u0", True)] + [fixed(f"u{c}", c >= 3) for c in range(1, 5)])]
    rng = random.Random(11)
    for _ in range(12):
        logs = [[r for u in range(rng.randint(1, 3))
                 for r in user_log(rng, f"u{c}-{u}", rng.random() < 0.5)]
                for c in range(rng.randint(1, 5))]
        victim = rng.choice(sorted({r.user for r in logs[0]}))
        neighbour = [list(log) for log in logs]
        neighbour[0] = [r for r in logs[0] if r.user != victim] + user_log(rng, victim, True)
        pairs.append((logs, neighbour))
    worst = 0.0
    for logs, neighbour in pairs:
        a_subs, b_subs = subs(logs), subs(neighbour)
        a = edge_merge(a_subs, schema, config, embed=embed, seed=5)
        b = edge_merge(b_subs, schema, config, embed=embed, seed=5)
        scales = {(e.tool_id, e.field): e.noise_scale for e in a.ledger}
        assert scales == {(e.tool_id, e.field): e.noise_scale for e in b.ledger}
        ma, mb = kept_means(a_subs), kept_means(b_subs)
        loss = sum(abs(ma[key] - mb[key]) / scales[key] for key in scales)
        assert loss <= a.stats.epsilon_spent * (1 + 1e-9) + 1e-12
        assert a.stats.epsilon_spent <= config.epsilon * (1 + 1e-9)
        worst = max(worst, loss)
    assert worst > 0  # the neighbours did differ


def test_rematerialization_without_numeric_release_draws_no_noise(schema, embed):
    result = edge_merge(_numeric_subs([0.5]), schema, RoundConfig(), embed=embed,
                        epsilon_remaining=0.0, release_numeric=False)
    assert result.ledger == [] and result.compendium.metadata == []


def test_a_quoted_request_keeps_its_capitals_where_they_are_not_sentence_case(schema):
    entry = ConflictEntry(
        tool_id="calculator",
        centroid_id="abc",
        centroid={"text": "I'm integrating an expression.", "preconditions": {}},
        dissenters=[{"text": "PDF pages to convert"}, {"text": "Currency conversion"},
                    {"text": "iPhone storage sums"}],
        reason="LLM probe found the scenarios inconsistent",
    )
    [p] = conflicts_to_precautions([entry], schema)
    assert p.text == (
        "Use Calculator for I'm integrating an expression; do not use Calculator when "
        "PDF pages to convert or when currency conversion or when iPhone storage sums"
    )


def test_the_global_leaves_out_figures_its_noise_spans_the_clipping_window(schema, embed):
    """A released value whose Laplace noise is wider than the field's clipping window (here the
    declared range for success_rate; [0, 50] for calls) says nothing about the tool; the server
    merge publishes the others and counts what it left out."""
    edges = [
        sub("org-a", metadata=[
            {"tool_id": "weather", "stats": {"success_rate": 0.1, "calls": 42.0}},
            {"tool_id": "flights", "stats": {"success_rate": 0.93}},
            {"tool_id": "recipes", "stats": {"success_rate": 1.0}},
        ]),
        sub("org-b", metadata=[
            {"tool_id": "weather", "stats": {"success_rate": 0.9, "calls": 38.0}},
            {"tool_id": "flights", "stats": {"success_rate": 0.91}},
        ]),
    ]
    scales = {
        # success_rate spans [0, 1]: two edges of b = 1.6 average to b = 1.13, still wider
        "org-a": {("weather", "success_rate"): 1.6, ("weather", "calls"): 2.5,
                  ("flights", "success_rate"): 0.05, ("recipes", "success_rate"): 5.0},
        "org-b": {("weather", "success_rate"): 1.6, ("weather", "calls"): 2.5,
                  ("flights", "success_rate"): 0.05},
    }
    previous = Compendium.model_validate({"metadata": [
        {"tool_id": "recipes", "stats": {"success_rate": 0.5}},  # an older figure: replaced
        {"tool_id": "calculator", "stats": {"success_rate": 0.7}},  # no edge reported it: stays
    ]})
    for mode in ("stats", "full"):
        result = server_merge(edges, schema, RoundConfig(global_metadata=mode), embed=embed,
                              noise_scales=scales, previous=previous)
        stats = {m.tool_id: m.stats for m in result.compendium.metadata}
        assert stats["weather"] == {"calls": 40.0}  # success_rate left out
        assert stats["flights"] == {"success_rate": pytest.approx(0.92)}
        assert stats["calculator"] == {"success_rate": 0.7}
        assert result.stats.stats_withheld == 2
        assert result.stats.as_dict()["stats_withheld"] == 2
        if mode == "stats":  # nothing left to say about recipes
            assert "recipes" not in stats
        else:  # its description and spec still
            assert stats["recipes"] == {}
    # b = 0.9 at each of two edges averages to 0.64: under the window, published
    scales["org-a"][("weather", "success_rate")] = scales["org-b"][("weather", "success_rate")] = 0.9
    result = server_merge(edges, schema, RoundConfig(), embed=embed, noise_scales=scales)
    weather = {m.tool_id: m.stats for m in result.compendium.metadata}["weather"]
    assert weather["success_rate"] == pytest.approx(0.5) and result.stats.stats_withheld == 1


@pytest.mark.parametrize("rule", ["trimmed-mean", "krum"])
def test_under_a_robust_rule_no_released_statistic_is_one_the_global_would_withhold(
    schema, embed, rule
):
    """With a robust rule the edge's mean is trimmed: K − 2f of K values, noise Δ/((K−2f)·ε_j).
    Drowned fields were judged at Δ/(K·ε_j), so a field whose trimmed release spans its whole
    clipping window was still released and charged, and the global left it out: ε spent for
    nothing. Ten clients at f share 0.2 (ε_j = 1/8): success_rate (range 1, Δ 1) keeps 6, scale 4/3 ≥ 1; an
    edge of 9 would keep 7 (scale 8/7 ≥ 1), the most any edge of at most 10 keeps."""
    config = RoundConfig(epsilon=2.0, robust_rule=rule, trim_fraction=0.2)
    drowned = drowned_fields(schema, config, 10, 1)
    assert "success_rate" in drowned
    assert "success_rate" not in drowned_fields(schema, RoundConfig(epsilon=2.0), 10, 1)
    for k in range(1, 11):  # every edge a round of at most 10 clients an edge can have
        result = edge_merge(_numeric_subs([0.5] * k), schema, config, embed=embed, seed=3,
                            drowned=drowned)
        specs = schema.fields_by_name
        assert not [(e.tool_id, e.field) for e in result.ledger
                    if noise_dominated(e.noise_scale, specs[e.field])]
    # the bound is the best any edge of at most K gets, not the K−2f of K itself: 9 keeps 7 of 9,
    # more than 10 keeps (6), so a field useful only at 7 kept is not drowned at K = 10
    assert max(k - 2 * byzantine_count(k, 0.2) for k in range(1, 11)) == 7
    assert "success_rate" not in drowned_fields(
        schema, RoundConfig(epsilon=2.0 * 8 / 7 * 1.01, robust_rule=rule, trim_fraction=0.2), 10, 1)


@pytest.mark.parametrize("rule", ["krum", "trimmed-mean"])
def test_the_robust_rule_inside_a_cluster_does_not_judge_the_carried_forward_global(
    schema, embed, rule
):
    """The carried-forward global is the last published compendium, no source's submission: the
    rule across sources leaves it out, but inside a cluster it was one more member, so three edges'
    paraphrases outvoted it and a scenario's support accumulated over rounds (50) fell to this
    round's (6). It stays a member and keeps its support; the rule judges the edges' members."""
    previous = Compendium.model_validate({
        "schema_version": "1.0",
        "scenarios": [{**sc("weather", "Is rain expected tomorrow in Paris?"), "support": 50}],
    })
    edges = [
        MergeInput(f"org:{i}", Compendium.model_validate({
            "schema_version": "1.0", "scenarios": [{**sc("weather", text), "support": 2}]}))
        for i, text in enumerate(["Will it rain tomorrow in Paris?",
                                  "Will it rain tomorrow in Paris",
                                  "will it rain tomorrow in paris?"])
    ]
    config = RoundConfig(summarizer="centroid", robust_rule=rule, trim_fraction=0.25, tau=0.8)
    result = server_merge(edges, schema, config, embed=embed, previous=previous, source_limit=2.0)
    [weather] = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert weather.support == 56
    assert result.stats.robust_dropped == 0  # f = ⌊0.25·3⌋ = 0 over the three edges' members
    # A fourth edge makes f = 1: the rules still judge the edges (across sources Krum drops one
    # edge's batch, the trimmed mean two) and the carried scenario keeps its 50.
    edges.append(MergeInput("org:3", Compendium.model_validate({
        "schema_version": "1.0",
        "scenarios": [{**sc("weather", "Is it going to rain in Paris tomorrow?"), "support": 2}]})))
    result = server_merge(edges, schema, config, embed=embed, previous=previous, source_limit=2.0)
    [weather] = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    dropped = {"krum": 1, "trimmed-mean": 2}[rule]
    assert result.stats.robust_dropped == dropped
    assert weather.support == 50 + 2 * (4 - dropped)


@pytest.mark.parametrize("rule", ["krum", "trimmed-mean"])
def test_members_the_robust_rule_drops_inside_a_cluster_are_flagged(schema, embed, rule):
    """Inside a cluster the rule drops members too (one source's five paraphrases: no tool has
    three sources, so nothing is judged across sources). Each dropped member is in
    `result.flagged`, as the entries dropped across sources are, so that the operator's count of
    flagged entries accounts for every scenario the rule took out (before, `robust_dropped`
    counted them and `flagged` did not list them)."""
    texts = ["Will it rain tomorrow in Paris?", "Will it rain tomorrow in Paris",
             "will it rain tomorrow in paris?", "Is rain expected tomorrow in Paris?",
             "Is it going to rain in Paris tomorrow?"]
    inputs = [sub("c1", [sc("weather", t) for t in texts]),
              sub("c2", [sc("flights", "Book a cheap flight from Boston to Denver")])]
    config = RoundConfig(summarizer="centroid", tau=0.8, robust_rule=rule, trim_fraction=0.25)
    result = edge_merge(inputs, schema, config, embed=embed, confusion_margin=9.0,
                        source_limit=9.0)
    dropped = {"krum": 1, "trimmed-mean": 2}[rule]  # f = ⌊0.25·5⌋ = 1
    assert result.stats.robust_dropped == dropped
    robust = [f for f in result.flagged if f.reason.startswith("robust rule")]
    assert len(robust) == dropped
    assert all(f.reason == f"robust rule ({rule}) within a cluster" for f in robust)
    assert {(f.source, f.tool_id) for f in robust} == {("c1", "weather")}
    assert {f.text for f in robust} <= set(texts)
    assert all(f.own_similarity <= f.closest_similarity for f in robust)
    [weather] = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert weather.support == len(texts) - dropped


def _two_clients_two_templates():
    """Two clients' near-identical weather scenario, each with its own template for f(city)."""
    return [
        sub("a", [sc("weather", "Will it rain tomorrow in Paris?")],
            templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T1 {city}"}]),
        sub("b", [sc("weather", "Will it rain tomorrow in Paris")],
            templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T2 {city}"}]),
    ]


@pytest.mark.parametrize("bad", ["\u202e", "\x1b", "\x00", "\x85"])
def test_an_llm_summary_with_a_forbidden_character_falls_back(schema, embed, bad):
    """A summary (or merged template) an LLM answers with a control character or a bidirectional
    override is no text the compendium may hold: before, the merge emitted it and then refused
    its own compendium ("merge produced an invalid compendium"), failing the round. It is an
    unusable answer, and the summarizer falls back as for any other."""

    class Answers:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            if "Answer with exactly one word" in prompt:
                return "Consistent"
            return json.dumps({"summary": f"Rain in Paris{bad} tomorrow"})

    subs = _two_clients_two_templates()
    result = edge_merge(subs, schema, RoundConfig(summarizer="llm-single-shot"), embed=embed,
                        llm=Answers())
    [weather] = result.compendium.scenarios
    assert bad not in weather.text and weather.support == 2
    assert [t.template for t in result.compendium.templates] == ["T1 {city}"]
    kinds = [f.get("kind") for f in result.stats.summarizer_fallbacks
             if f["summarizer"] == "llm-single-shot"]
    assert "unusable answer" in kinds


def test_consistency_questions_the_llm_left_unanswered_are_counted(schema, embed):
    """An LLM down (or answering without a verdict) mid-merge: each consistency question it left
    unanswered judged the pair by its flags alone, so a contradiction only it would have caught
    merged with no conflict logged, and nothing in the merge's record said the check had not
    run."""
    from federation.merge.llm import LLMUnavailable

    class Down:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            raise LLMUnavailable("connection refused")

    class Vague:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            return "It depends." if "Answer with exactly one word" in prompt else "{}"

    class Answers:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            return "Consistent" if "Answer with exactly one word" in prompt else "{}"

    counts = {}
    for name, llm in (("down", Down()), ("vague", Vague()), ("answers", Answers())):
        stats = edge_merge(_two_clients_two_templates(), schema, RoundConfig(), embed=embed,
                           llm=llm).stats
        counts[name] = (stats.consistency_asked, stats.consistency_unanswered)
    assert counts == {"down": (1, 1), "vague": (1, 1), "answers": (1, 0)}
    without = edge_merge(_two_clients_two_templates(), schema, RoundConfig(), embed=embed).stats
    assert (without.consistency_asked, without.consistency_unanswered) == (0, 0)


def test_is_consistent_probes_every_pair_not_only_against_the_center():
    """IsConsistent (paper, App. "Edge Merge Operator"): a cluster is consistent iff the LLM
    probe finds *every pair* of its members consistent. Two members that each agree with the
    cluster's center but contradict each other ("use it when depth > 4" and "do not use it when
    depth > 4") made a consistent cluster when only member-center pairs were probed: the two
    were summarized into one scenario and no conflict was logged."""
    vectors = np.array([[1.0, 0.0], [0.95, 0.312], [0.95, -0.312]])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    texts = ["integrate symbolically", "integrate when depth > 4", "not when depth > 4"]
    members = [Item(f"c{i}", "wolfram", text, {}, 1, vectors[i]) for i, text in enumerate(texts)]
    contradicting = {frozenset(texts[1:])}
    asked = []

    def probe(a: str, b: str) -> bool:
        asked.append(frozenset((a, b)))
        return frozenset((a, b)) not in contradicting

    decision = decide_cluster(members, probe=probe)
    assert set(asked) == {frozenset(p) for p in
                          [(texts[0], texts[1]), (texts[0], texts[2]), (texts[1], texts[2])]}
    assert not decision.consistent
    assert "LLM probe" in decision.reason
    # the two that contradict each other are never merged together: one of them dissents
    assert len(decision.dissenters) == 1 and decision.dissenters[0] in (1, 2)
    assert 0 in decision.agreeing
    # identical texts (copies from several sources) are one statement: no pair of them is asked
    asked.clear()
    copies = [Item(f"d{i}", "wolfram", texts[0], {}, 1, vectors[0]) for i in range(3)]
    assert decide_cluster(copies, probe=probe).consistent and asked == []


def test_the_consistency_questions_of_a_large_cluster_are_bounded():
    """Every pair of d distinct texts is d(d-1)/2 questions to the LLM: a cluster of 60 distinct
    requests (a popular tool's) would be 1,770. Every pair among the PROBE_ALL_PAIRS most central
    texts is asked, each text beyond them against the center only: at most
    PROBE_ALL_PAIRS(PROBE_ALL_PAIRS-1)/2 + d - PROBE_ALL_PAIRS questions, and a contradiction
    with the center is still found wherever the text stands."""
    from federation.merge.clustering import PROBE_ALL_PAIRS

    d = PROBE_ALL_PAIRS + 5
    angles = np.linspace(0.0, 0.3, d)  # along an arc: its ends are the least central
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    members = [Item(f"c{i}", "wolfram", f"text {i}", {}, 1, vectors[i]) for i in range(d)]
    asked = []
    outer = members[0].text  # an end of the arc: among the least central

    def probe(a: str, b: str) -> bool:
        asked.append(frozenset((a, b)))
        return outer not in (a, b)

    decision = decide_cluster(members, probe=probe)
    k = PROBE_ALL_PAIRS
    assert len(asked) == len(set(asked)) == k * (k - 1) // 2 + (d - k)
    assert not decision.consistent and decision.dissenters == [0]


def test_the_noise_is_calibrated_to_the_window_the_clipping_guarantees(schema):
    """Each value is clipped to a window [min, min + Δ] inside the declared range, so it is no
    wider than min(Δ, max − min): replacing one client's value moves a mean of K by at most that
    over K. The frequency field declares Δ = 2 (the ℓ1 bound of a whole normalized vector, the
    paper's) in a range of [0, 1]: each tool's share lies in a window of width 1 and is released
    on its own, with its own ε_j, so its sensitivity is 1/K, and a scale of 2/(K·ε_j) added twice
    the noise ε_j needs. The ledger records the sensitivity the noise was calibrated to."""
    from compendium.clipping import clip_bound

    def embed(texts):
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest(), dtype=np.uint8)[:8]
                .astype(np.float32) - 127.5 for t in texts]
        out = np.array(rows, dtype=np.float32).reshape(len(texts), 8)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    k = 4
    subs = [sub(f"c{i}", metadata=[{"tool_id": "weather", "stats": {"frequency": i / 4}}])
            for i in range(k)]
    config = RoundConfig(epsilon=1.0, seed=3)
    result = edge_merge(subs, schema, config, embed=embed, seed=3)
    eps_j = config.per_field_epsilon(len(schema.tools) * len(schema.numeric_fields),
                                     fields_per_tool=len(schema.numeric_fields))
    for entry in result.ledger:
        spec = schema.fields_by_name[entry.field]
        width = clip_bound(spec).width
        assert width == min(spec.sensitivity, spec.max - spec.min)
        assert entry.sensitivity == pytest.approx(width), entry
        assert entry.noise_scale == pytest.approx(width / (k * eps_j)), entry
    [frequency] = [e for e in result.ledger if (e.tool_id, e.field) == ("weather", "frequency")]
    assert frequency.noise_scale == pytest.approx(1 / (k * eps_j))
    # the fields no release can make useful are judged by the same scale: with K·ε_j between 1
    # and 2 a frequency's noise (1/(K·ε_j) < 1) no longer spans its window of 1
    narrow = Schema(tools=schema.tools[:1], numeric_fields=[schema.fields_by_name["frequency"]])
    assert drowned_fields(narrow, RoundConfig(epsilon=0.75), most_contributors=2,
                          edges=1) == frozenset()


def test_a_released_value_is_clamped_to_the_clipping_window_not_the_declared_range(schema):
    """Every value averaged lies in the clipping window [min, min(max, min + Δ)], so the true
    mean does too; clamping the noised figure into that window is post-processing (no ε) and
    only brings it closer to the truth. `calls` declares [0, 1000] with Δ = 50: its window is
    [0, 50], and a noised mean clamped to the declared range could be published as 900 calls.
    The noise itself is untouched: the same seed draws the same noise (ledger scale and the
    figures inside the window are unchanged, see the goodness-of-fit test of laplace_release)."""
    from compendium.clipping import clip_bound

    def embed(texts):
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest(), dtype=np.uint8)[:8]
                .astype(np.float32) - 127.5 for t in texts]
        out = np.array(rows, dtype=np.float32).reshape(len(texts), 8)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    subs = [sub(f"c{i}", metadata=[{"tool_id": "weather", "stats": {"calls": 10.0 * i,
                                                                     "frequency": 0.25 * i}}])
            for i in range(3)]
    config = RoundConfig(epsilon=0.5)  # ε_j = 1/32: a calls scale of 50·32/3 ≈ 533 calls
    windows = {spec.name: clip_bound(spec) for spec in schema.numeric_fields}
    assert windows["calls"].hi == 50 < schema.fields_by_name["calls"].max
    released = []
    for seed in range(20):
        result = edge_merge(subs, schema, config, embed=embed, seed=seed)
        for meta in result.compendium.metadata:
            for name, value in meta.stats.items():
                released.append((name, value))
                assert windows[name].lo <= value <= windows[name].hi, (seed, meta.tool_id, name)
    # the noise reaches past the window on both sides: the clamp is what holds the figures in
    calls = [v for name, v in released if name == "calls"]
    assert 0.0 in calls and 50.0 in calls
    # The server's average over edges is clamped to the window too (an edge released before
    # this clamp may carry a figure up to the declared max).
    edge = sub("org-a", metadata=[{"tool_id": "weather", "stats": {"calls": 900.0}}])
    other = sub("org-b", metadata=[{"tool_id": "weather", "stats": {"calls": 40.0}}])
    result = server_merge([edge, other], schema, RoundConfig(), embed=embed)
    [weather] = [m for m in result.compendium.metadata if m.tool_id == "weather"]
    assert weather.stats["calls"] == 50.0


def test_a_silent_llm_endpoint_holds_a_summary_only_for_the_merges_call_time(
    schema, embed, monkeypatch
):
    """The merge's LLM client kept 60 s per attempt and no limit on a question in all: an
    endpoint that never answers held an edge or server merge (retries + 1) × 60 s per summary,
    for every cluster. `merge_llm` bounds each question by SYNAPSE_MERGE_LLM_CALL_SECONDS, as
    routing's are by SYNAPSE_LLM_CALL_SECONDS (routing.llm's deadline), and an endpoint found
    down is not asked again for SYNAPSE_LLM_PAUSE_SECONDS: the summaries fall back, saying why.
    The endpoint here holds each request 5 s and then drops it: with no call time the first
    summary alone waited three attempts (15 s) and the second asked again."""
    from federation.merge.llm import LLMUnavailable, merge_llm
    from tests.chat_server import ChatServer

    subs = [
        sub(name, scenarios=[sc("weather", text), sc("flights", trip)])
        for name, text, trip in (
            ("a", "Will it rain tomorrow in Paris?", "Book a flight from Oslo to Rome"),
            ("b", "Will it rain in Paris tomorrow?", "Book a flight from Oslo to Rome please"),
        )
    ]
    server = ChatServer()
    server.silent = 5.0
    monkeypatch.setenv("SYNAPSE_MERGE_LLM_CALL_SECONDS", "0.3")
    monkeypatch.setenv("SYNAPSE_LLM_PAUSE_SECONDS", "600")
    try:
        llm = merge_llm(server.url)
        assert llm.call_seconds == 0.3 and llm.pause == 600
        result = edge_merge(subs, schema, RoundConfig(summarizer="llm-single-shot"),
                            embed=embed, llm=llm)
    finally:
        server.close()
    fallbacks = [f for f in result.stats.summarizer_fallbacks
                 if f["summarizer"] == "llm-single-shot"]
    assert [f["tool_id"] for f in fallbacks] == ["flights", "weather"]
    first, second = fallbacks
    assert "no answer before the call's time ran out" in first["reason"], first
    assert "SYNAPSE_MERGE_LLM_CALL_SECONDS" in first["reason"], first
    assert "not asked again" in second["reason"], second  # the second never reached the server
    assert len(server.requests) == 1  # the deadline cut the first attempt: no retry was started
    assert result.stats.summaries == {"centroid": 2}  # no probe set: the centroid's texts

    # 0: no limit but each attempt's (60 s); unset: the default; not a number: refused, named
    monkeypatch.setenv("SYNAPSE_MERGE_LLM_CALL_SECONDS", "0")
    assert merge_llm(server.url).call_seconds is None
    monkeypatch.delenv("SYNAPSE_MERGE_LLM_CALL_SECONDS")
    assert merge_llm(server.url).call_seconds == 60
    monkeypatch.setenv("SYNAPSE_MERGE_LLM_CALL_SECONDS", "soon")
    with pytest.raises(LLMUnavailable, match="SYNAPSE_MERGE_LLM_CALL_SECONDS must be a number"):
        merge_llm(server.url)


# --- precondition flag names: published only when two sources carried them ----------------------


def _flag_names(compendium) -> set[tuple[str, str]]:
    return {(s.tool_id, name) for s in compendium.scenarios for name in s.preconditions}


def test_edge_merge_publishes_a_flag_name_only_when_two_clients_carried_it(schema, embed):
    """Flag names are sent as written (identifiers, neither masked nor scrubbed): one client's
    `has_mary_account` reached the edge compendium and, through the server merge, every
    organization. A name reaches a published compendium only when two distinct sources carried
    it for that tool; the others are left off their scenarios (the scenarios stay) and counted,
    never named, in the merge's statistics."""
    subs = [
        sub("c1", [sc("weather", "Will it rain tomorrow in Paris?", has_city=True,
                      has_mary_account=True)]),
        sub("c2", [sc("weather", "Weather forecast for the weekend in Lisbon", has_city=False)]),
        sub("c3", [sc("flights", "Book a cheap flight from Boston to Denver")]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="none"), embed=embed)
    assert _flag_names(result.compendium) == {("weather", "has_city")}
    assert len(result.compendium.scenarios) == 3  # the scenario stays, without the name
    assert result.stats.flags_held_back == 1
    assert result.stats.as_dict()["flags_held_back"] == 1
    published = canonical_bytes(result.compendium)
    assert b"has_mary_account" not in published
    assert "has_mary_account" not in json.dumps(result.stats.as_dict())
    # the same name written by a second client is published
    again = edge_merge(subs + [sub("c4", [sc("weather", "Rain in Oslo", has_mary_account=True)])],
                       schema, RoundConfig(summarizer="none"), embed=embed)
    assert ("weather", "has_mary_account") in _flag_names(again.compendium)
    assert again.stats.flags_held_back == 0
    # counted per tool: the same name for another tool, by one client, is not published
    other = edge_merge(subs + [sub("c5", [sc("flights", "Flights to Rome", has_city=True)])],
                       schema, RoundConfig(summarizer="none"), embed=embed)
    assert ("flights", "has_city") not in _flag_names(other.compendium)
    assert other.stats.flags_held_back == 2


def test_a_flag_name_one_client_writes_twice_is_held_back(schema, embed):
    """Sources, not scenarios, are counted: one client carrying a name on two scenarios is one."""
    subs = [
        sub("c1", [sc("weather", "Will it rain tomorrow in Paris?", john_smith=True),
                   sc("weather", "Weather forecast for the weekend in Lisbon", john_smith=True)]),
        sub("c2", [sc("weather", "Is it sunny in Madrid", has_city=True)]),
        sub("c3", [sc("weather", "Temperature in Rome today", has_city=True)]),
    ]
    result = edge_merge(subs, schema, RoundConfig(summarizer="none"), embed=embed)
    assert _flag_names(result.compendium) == {("weather", "has_city")}
    assert result.stats.flags_held_back == 1


def test_a_held_back_flag_name_enters_neither_the_conflict_log_nor_its_precautions(schema, embed):
    """The conflict log compares flags, and next round its dissenters' flags are written into a
    published precaution ("... when X and <flag> is true"): a name held back must not reach it
    that way. Left off before clustering, it makes no contradiction either; the centroid ids
    are computed without it, so they stay deterministic."""
    subs = [
        sub("a", [sc("weather", "Forecast for a city", has_city=True)]),
        sub("b", [sc("weather", "Forecast for a city", has_city=True)]),
        sub("c", [sc("weather", "Forecast for a city.", has_city=False, mary_smith=True)]),
        sub("d", [sc("weather", "Forecast for a city!", mary_smith=False)]),
    ]
    first = edge_merge(subs[:3], schema, RoundConfig(summarizer="none"), embed=embed)
    assert "mary_smith" not in json.dumps([c.dissenters for c in first.conflicts])
    [entry] = first.conflicts
    second = edge_merge([sub("a", [sc("flights", "Book a flight")])], schema,
                        RoundConfig(summarizer="none"), first.conflicts, embed=embed)
    assert [p.text for p in second.compendium.precautions] == [
        "Use WeatherNow for forecast for a city; do not use WeatherNow when forecast for a city "
        "and has_city is false"]
    # written by two clients, the name is compared (and logged) as any other
    both = edge_merge(subs, schema, RoundConfig(summarizer="none"), embed=embed)
    assert "mary_smith" in json.dumps([c.dissenters for c in both.conflicts])
    # by one client it is not there at all: the same log, centroid ids included, as if that
    # client had not written it
    without = edge_merge(subs[:2] + [sub("c", [sc("weather", "Forecast for a city.",
                                                   has_city=False)])],
                         schema, RoundConfig(summarizer="none"), embed=embed)
    assert first.conflicts == without.conflicts and entry.centroid_id


def test_a_conflict_log_merged_before_the_flag_rule_is_held_to_it(schema, embed):
    """A log written before the rule (`conflicts_flags_released=False`) may hold one client's
    flag name: its precautions and picked winners publish only the names this merge's sources
    carried twice. A log this operator wrote (the default) holds only names that passed."""
    centroid = {"source": "a", "tool_id": "weather", "text": "Rain in Paris",
                "preconditions": {"outdoor": True, "bob_jones": False}, "support": 2}
    dissenter = {"source": "c", "tool_id": "weather", "text": "Rain in Paris now",
                 "preconditions": {"outdoor": False, "bob_jones": True}, "support": 1}
    legacy = [ConflictEntry("weather", "abc", centroid, [dissenter], "precondition flags contradict")]
    subs = [sub("a", [sc("weather", "Is it sunny in Madrid", outdoor=True)]),
            sub("b", [sc("weather", "Temperature in Rome today", outdoor=False)])]
    trusted = edge_merge(subs, schema, RoundConfig(summarizer="none"), legacy, embed=embed)
    assert any("bob_jones" in p.text for p in trusted.compendium.precautions)
    held = edge_merge(subs, schema, RoundConfig(summarizer="none"), legacy, embed=embed,
                      conflicts_flags_released=False)
    assert [p.text for p in held.compendium.precautions] == [
        "Use WeatherNow for rain in Paris; do not use WeatherNow when rain in Paris now and "
        "outdoor is false"]
    assert held.stats.flags_held_back == 1
    picked = [ConflictEntry("weather", "abc", centroid, [dissenter], "precondition flags contradict",
                            "scenario", "Rain in Paris now")]
    won = edge_merge(subs, schema, RoundConfig(summarizer="none"), picked, embed=embed,
                     conflicts_flags_released=False)
    [winner] = [s for s in won.compendium.scenarios if s.text == "Rain in Paris now"]
    assert winner.preconditions == {"outdoor": False}


def test_server_merge_publishes_a_flag_name_only_when_two_edges_carried_it(schema, embed):
    config = RoundConfig(summarizer="none")

    def edge(scenarios):
        return Compendium.model_validate({"schema_version": "1.0", "scenarios": scenarios})

    edges = [
        MergeInput("org:a", edge([sc("weather", "Will it rain tomorrow in Paris?", has_city=True,
                                     acme_vip=True)])),
        MergeInput("org:b", edge([sc("weather", "Weather forecast for the weekend in Lisbon",
                                     has_city=True)])),
        MergeInput("org:c", edge([sc("flights", "Book a cheap flight from Boston to Denver")])),
    ]
    result = server_merge(edges, schema, config, embed=embed)
    assert _flag_names(result.compendium) == {("weather", "has_city")}
    assert len(result.compendium.scenarios) == 3
    assert result.stats.flags_held_back == 1


def test_the_carried_global_keeps_released_flag_names_and_holds_back_older_ones(schema, embed):
    """The server merges the last published global as one more input. A global this operator
    merged holds only names that passed the rule then: they stay, with no edge sending them again
    (clients send only what the global does not cover, so requiring fresh sources would drop
    them every other round). A global merged before the rule (`previous_flags_released=False`)
    may hold one client's name: its names count for no source, so only those two edges carry
    this round are kept."""
    config = RoundConfig(summarizer="none")

    def comp(scenarios):
        return Compendium.model_validate({"schema_version": "1.0", "scenarios": scenarios})

    previous = comp([sc("weather", "Will it rain tomorrow in Paris?", has_city=True,
                        jane_doe=True)])
    edges = [MergeInput("org:a", comp([sc("weather", "Rain in Lisbon", jane_doe=True)])),
             MergeInput("org:b", comp([sc("flights", "Book a cheap flight to Denver")]))]
    kept = server_merge(edges, schema, config, embed=embed, previous=previous)
    assert _flag_names(kept.compendium) == {("weather", "has_city"), ("weather", "jane_doe")}
    assert kept.stats.flags_held_back == 0
    old = server_merge(edges, schema, config, embed=embed, previous=previous,
                       previous_flags_released=False)
    assert _flag_names(old.compendium) == set()
    assert old.stats.flags_held_back == 2
    assert {s.text for s in old.compendium.scenarios} >= {"Will it rain tomorrow in Paris?"}
    twice = server_merge(
        edges + [MergeInput("org:c", comp([sc("weather", "Rain in Oslo", has_city=True)])),
                 MergeInput("org:d", comp([sc("weather", "Snow in Bergen", has_city=True)]))],
        schema, config, embed=embed, previous=previous, previous_flags_released=False)
    assert _flag_names(twice.compendium) == {("weather", "has_city")}


def test_a_time_limit_met_while_the_llm_merges_templates_stops_the_merge(schema, embed):
    """The worker's soft time limit is raised inside whatever the task runs, here the LLM call
    that merges two prompt templates. Before, the template merge caught every exception as an
    unusable answer, kept the majority and went on merging until the hard limit killed the
    process. Only an unusable or unreachable LLM falls back; the time limit stops the merge."""
    from billiard.exceptions import SoftTimeLimitExceeded

    class OutOfTime:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            if "Merge these prompt templates" in prompt:
                raise SoftTimeLimitExceeded()
            if "Answer with exactly one word" in prompt:
                return "Consistent"
            return json.dumps({"summary": "Rain in Paris tomorrow"})

    subs = _two_clients_two_templates()
    with pytest.raises(SoftTimeLimitExceeded):
        edge_merge(subs, schema, RoundConfig(summarizer="llm-single-shot"), embed=embed,
                   llm=OutOfTime())


def test_an_llm_answer_nested_too_deep_to_parse_is_an_unusable_answer(schema, embed):
    """json.loads raises RecursionError, not JSONDecodeError, on an answer nested thousands of
    levels deep: the template merge now lets through what is not an unusable answer, and that
    one would have failed the round. It is refused as unparseable, and the majority stays."""
    deep = '{"summary": ' + "[" * 100000 + "]" * 100000 + "}"

    class Deep:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            return "Consistent" if "Answer with exactly one word" in prompt else deep

    subs = _two_clients_two_templates()
    result = edge_merge(subs, schema, RoundConfig(summarizer="llm-single-shot"), embed=embed,
                        llm=Deep())
    assert [t.template for t in result.compendium.templates] == ["T1 {city}"]
    assert any("not valid JSON" in f["reason"] for f in result.stats.summarizer_fallbacks
               if f.get("tool_id") == "weather" and f["summarizer"] == "llm-single-shot")


def _templates_only():
    return [
        sub("a", templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T1 {city}"}]),
        sub("b", templates=[{"tool_id": "weather", "signature": "f(city)", "template": "T2 {city}"}]),
    ]


@pytest.mark.parametrize(("method", "answer", "expected"), [
    ("llm-single-shot", "no JSON here", [("llm-single-shot", "unusable answer")]),
    ("llm-single-shot", None, [("llm-single-shot", "no LLM endpoint")]),
    ("textgrad", "no JSON here", [("textgrad", "no template executor"),
                                  ("llm-single-shot", "unusable answer")]),
    ("textgrad", None, [("textgrad", "no template executor"),
                        ("llm-single-shot", "no LLM endpoint")]),
])
def test_a_template_merge_that_falls_back_records_its_cause(schema, embed, method, answer,
                                                             expected):
    """README, "Summarizers": a fallback is recorded in `stats.summarizer_fallbacks` with its cause
    (`kind`), which the sweeps count (`fallback_kinds`; a record without one reads as
    "unrecorded", from before causes were kept). Differing templates merged by an LLM fell back to
    the majority with records that had no `kind`, and with no LLM endpoint with no record at all,
    where a scenario cluster records "no LLM endpoint"."""

    class Answers:
        def complete(self, prompt, system=None, max_tokens=512, json_schema=None):
            return answer

    result = edge_merge(_templates_only(), schema, RoundConfig(summarizer=method), embed=embed,
                        llm=None if answer is None else Answers())
    assert [t.template for t in result.compendium.templates] == ["T1 {city}"]
    fallbacks = result.stats.summarizer_fallbacks
    assert [(f["summarizer"], f.get("kind")) for f in fallbacks] == expected
    assert all(f["tool_id"] == "weather" and f["reason"] for f in fallbacks)
    assert "unrecorded" not in " ".join(fallback_kinds(result.stats.as_dict()))
