from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from compendium.registry import LabelledQuery, RoutingDataset
from compendium.schema import ToolSpec
from federation.simulation.data import (
    confusable_tools,
    partition_train,
    split_dataset,
    untested_tools,
    usage_log,
)
from federation.simulation.metrics import accuracy_report, auroc, membership_scores, token_overlap


@pytest.fixture
def dataset() -> RoutingDataset:
    tools = [
        ToolSpec(tool_id=f"t{i}", description=f"tool {i}", category=f"cat{i % 4}") for i in range(12)
    ]
    queries = [
        LabelledQuery(query=f"query {n} for t{i}", tool_id=f"t{i}", category=f"cat{i % 4}")
        for i in range(12)
        for n in range(20)
    ]
    return RoutingDataset("toy", tools, queries)


def test_split_is_stratified_disjoint_and_seeded(dataset):
    split = split_dataset(dataset, seed=3, probe_fraction=0.1, test_fraction=0.4)
    sizes = (len(split.train), len(split.probe), len(split.test))
    assert sum(sizes) == len(dataset.queries)
    assert Counter(q.tool_id for q in split.test) == {f"t{i}": 8 for i in range(12)}
    assert Counter(q.tool_id for q in split.probe) == {f"t{i}": 2 for i in range(12)}
    ids = lambda qs: {q.query for q in qs}  # noqa: E731
    assert not ids(split.train) & ids(split.test) and not ids(split.probe) & ids(split.test)
    again = split_dataset(dataset, seed=3, probe_fraction=0.1, test_fraction=0.4)
    assert [q.query for q in again.test] == [q.query for q in split.test]
    other = split_dataset(dataset, seed=4, probe_fraction=0.1, test_fraction=0.4)
    assert [q.query for q in other.test] != [q.query for q in split.test]


def test_the_copies_of_a_text_go_to_one_split_and_count_once():
    """A dataset drawn from usage logs repeats requests ("weather tomorrow" a hundred times):
    the split dealt each copy on its own, so the test split held requests that were, word for
    word, in the clients' logs (and the probe set), and a tool of three copies of one text was
    'tested' on the text it trained on."""
    tools = [ToolSpec(tool_id=t, description=t, category="c") for t in ("a", "b", "c")]
    queries = [LabelledQuery(query=f"request {n % 10} for a", tool_id="a", qid=f"a{n}")
               for n in range(60)]  # ten texts, six copies each
    queries += [LabelledQuery(query="one request for b", tool_id="b", qid=f"b{n}") for n in range(4)]
    queries += [LabelledQuery(query=f"request {n} for c", tool_id="c", qid=f"c{n}") for n in range(10)]
    dataset = RoutingDataset("logs", tools, queries)
    for seed in range(5):
        split = split_dataset(dataset, seed=seed)
        texts = [{(q.tool_id, q.query) for q in part} for part in (split.train, split.probe, split.test)]
        assert not texts[0] & texts[1] and not texts[0] & texts[2] and not texts[1] & texts[2]
        assert sorted(q.qid for q in [*split.train, *split.probe, *split.test]) == sorted(
            q.qid for q in queries)  # every copy dealt, once
        # a's ten texts shared as ten distinct queries are: 4 tested, 1 probe, 5 train
        assert Counter(q.tool_id for q in split.test) == {"a": 24, "c": 4}
        assert Counter(q.tool_id for q in split.probe) == {"a": 6, "c": 1}
        assert [q.tool_id for q in split.train].count("b") == 4  # one text: never tested
    assert untested_tools(dataset) == (1, 4)


def test_a_held_out_text_can_be_in_train_under_another_label_and_never_under_its_own():
    """What the split's docstring says holds, and what it does not: it said a held-out query
    is never one a client's log holds word for word, but each tool's queries are dealt on their
    own, so a text labelled with two tools can be held out under one and in train under the
    other (3 to 7 of MetaTool's 8,230 test queries a seed). Under its own label it never is."""
    tools = [ToolSpec(tool_id=t, description=t, category="c") for t in ("a", "b")]
    queries = [LabelledQuery(query=f"request {n} for {t}", tool_id=t, qid=f"{t}{n}")
               for t in ("a", "b") for n in range(9)]
    queries += [LabelledQuery(query="the shared request", tool_id=t, qid=f"{t}-shared")
                for t in ("a", "b")]
    dataset = RoutingDataset("two labels", tools, queries)
    crossed = 0
    for seed in range(20):
        split = split_dataset(dataset, seed=seed)
        pairs = [{(q.query, q.tool_id) for q in part} for part in (split.train, split.probe)]
        held_out = {(q.query, q.tool_id) for q in split.test}
        assert not held_out & (pairs[0] | pairs[1])  # never under its own label
        texts = {text for text, _ in pairs[0]}
        crossed += any(text in texts for text, _ in held_out)
    assert crossed  # some seeds hold a text out under one label and train on it under the other

@pytest.mark.parametrize("mode", ["iid", "category", "random"])
def test_partitions_deal_every_train_query_once(dataset, mode):
    split = split_dataset(dataset, seed=1)
    shares = partition_train(split.train, dataset.tools, orgs=2, clients_per_org=3, mode=mode, seed=1)
    assert len(shares) == 6
    dealt = [q.query for s in shares for q in s.queries]
    assert sorted(dealt) == sorted(q.query for q in split.train)


def test_category_partition_gives_each_org_its_own_categories(dataset):
    split = split_dataset(dataset, seed=1)
    shares = partition_train(split.train, dataset.tools, orgs=2, clients_per_org=2, mode="category", seed=1)
    cats = {}
    for share in shares:
        cats.setdefault(share.organization, set()).update(q.category for q in share.queries)
    assert cats["org-1"].isdisjoint(cats["org-2"])
    assert cats["org-1"] | cats["org-2"] == {"cat0", "cat1", "cat2", "cat3"}


def test_usage_log_has_failures_corrections_and_users(dataset):
    split = split_dataset(dataset, seed=1)
    shares = partition_train(split.train, dataset.tools, orgs=1, clients_per_org=1, mode="iid", seed=1)
    log = usage_log(shares[0], confusable_tools(dataset.tools, 1), seed=1, users=3, error_rate=0.3)
    outcomes = Counter(line["outcome"] for line in log)
    assert outcomes["success"] > outcomes["corrected"] > 0 and outcomes["failure"] > 0
    assert len({line["user"] for line in log}) == 3
    for line in log:
        if line["outcome"] == "corrected":
            assert line["corrected_to"] != line["tool"]
    assert log == usage_log(shares[0], confusable_tools(dataset.tools, 1), seed=1, users=3, error_rate=0.3)


def test_accuracy_report():
    report = accuracy_report(["a", "b", "b", "c"], ["a", "b", "c", "c"], ["x", "x", "y", "y"])
    assert report.accuracy == 0.75
    assert report.per_category == {"x": {"accuracy": 1.0, "n": 2}, "y": {"accuracy": 0.5, "n": 2}}
    assert report.macro_accuracy == 0.75


def test_auroc_and_membership_scores():
    assert auroc([0.9, 0.8, 0.7], [0.1, 0.2, 0.3]) == 1.0
    assert auroc([0.1, 0.2], [0.8, 0.9]) == 0.0
    assert auroc([0.5, 0.5], [0.5, 0.5]) == 0.5
    released = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    candidates = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    assert np.allclose(membership_scores(candidates, released), [0.8, 1.0])


def test_token_overlap():
    assert token_overlap("Book a flight to Rome", ["book [MASK] flight"]) == pytest.approx(2 / 5)
    assert token_overlap("Book a flight to Rome", []) == 0.0


def test_token_overlap_counts_words_of_any_script():
    """Tokens were [a-z0-9] runs: a Cyrillic or Greek request released word for word scored an
    overlap of 0, so a dataset in such a language reported no leakage at all, and accented words
    were cut into pieces."""
    request = "Какая погода в Москве завтра"
    assert token_overlap(request, [request]) == 1.0
    assert token_overlap(request, ["какая [MASK] в [MASK] завтра"]) == pytest.approx(3 / 5)
    assert token_overlap("καιρός στην Αθήνα", ["Καιρός [MASK]"]) == pytest.approx(1 / 3)
    assert token_overlap("un café crème", ["café"]) == pytest.approx(1 / 3)
    assert token_overlap("un café crème", ["caf"]) == 0.0


def test_text_distance_is_token_levenshtein_over_the_longer_text():
    from federation.simulation.diagnostics import text_distance

    assert text_distance("Book a flight to Rome", "book a flight to rome") == 0.0
    assert text_distance("Book a flight to Rome", "Book a flight to [NAME]") == pytest.approx(1 / 5)
    assert text_distance("a b c d", "a b") == pytest.approx(2 / 4)
    assert text_distance("", "") == 0.0


def test_diagnostics_measure_masking_distortion_and_reranker_contraction():
    from compendium.schema import Compendium, Scenario, ToolSpec
    from federation.simulation.diagnostics import (
        masking_lipschitz,
        reranker_contraction,
        scenario_pair_lipschitz,
    )
    from routing.embeddings import get_engine
    from routing.router import Router

    engine = get_engine()
    tools = [ToolSpec(tool_id="weather", description="Weather forecasts for a city"),
             ToolSpec(tool_id="flights", description="Search and book flights")]
    texts = ["Will it rain in Reykjavik on Thursday?", "Email anna.berg@example.com the forecast",
             "Cheapest flight from Oslo to Tromsø for 2 people", "weather forecast"]
    masked = masking_lipschitz(texts, tools, [0.5, 1.5], engine.embed, seed=0)
    # Masking is monotone in λ: the stronger setting changes at least as many texts, as much.
    assert masked["masking_lipschitz_lambda_1.5_share_changed"] >= masked["masking_lipschitz_lambda_0.5_share_changed"] > 0
    assert masked["masking_lipschitz_lambda_1.5_mean_text_distance"] >= masked["masking_lipschitz_lambda_0.5_mean_text_distance"]
    assert masked["masking_lipschitz_lambda_1.5_p99"] > 0
    # Masked as a client masks: the words enough of its users wrote are released, so its texts
    # change less (the diagnostic masked every client's words, a harsher masking than sent).
    words = [frozenset(w.lower() for w in t.replace("?", " ").split()) for t in texts]
    released = masking_lipschitz(texts, tools, [1.5], engine.embed, seed=0, shared=words)
    assert (released["masking_lipschitz_lambda_1.5_mean_text_distance"]
            < masked["masking_lipschitz_lambda_1.5_mean_text_distance"])
    pairs = scenario_pair_lipschitz(texts, engine.embed, pairs=20, seed=0)
    assert pairs["scenario_lipschitz_pairs"] == 20 and pairs["scenario_lipschitz_p99"] > 0
    compendium = Compendium(scenarios=[
        Scenario(tool_id="weather", text="Will it rain tomorrow?"),
        Scenario(tool_id="weather", text="Temperature forecast for the weekend"),
        Scenario(tool_id="flights", text="Book a cheap flight to Rome"),
        Scenario(tool_id="flights", text="Flight delay status at the airport"),
    ])
    router = Router(compendium, engine, "fusion")
    queries = ["Is it going to rain in Paris?", "Find me a flight to Lisbon", "sunny or not"]
    result = reranker_contraction(router, queries, sigma=0.05, seed=1)
    assert result["queries"] == 3
    assert 0 <= result["share_contracting"] <= 1 and result["reranker_contraction_p99"] > 0
    assert 0 <= result["margin_p5"] <= result["margin_p50"] <= 1
    # Ten times the noise moves at least as many decisions.
    loud = reranker_contraction(router, queries, sigma=0.5, seed=1)
    assert loud["decisions_unchanged_under_noise"] <= result["decisions_unchanged_under_noise"]


def test_contraction_reports_apart_the_queries_whose_candidates_the_noise_changed():
    """A tool outside the candidates has probability 0 (the router cannot pick it), so a candidate
    set that changes under the perturbation is a jump of the map, not a contraction figure:
    reported as a share, and L_R over the queries whose candidates stayed is reported apart."""
    from types import SimpleNamespace

    import numpy as np

    from federation.simulation.diagnostics import reranker_contraction

    class Stub:
        engine = SimpleNamespace(embed=lambda texts: np.eye(8)[: len(texts)])

        def __init__(self, swap: bool):
            self.swap, self.calls = swap, 0

        def tool_scores(self, query, vector, top_k):
            self.calls += 1  # odd calls: the clean embedding, even: the perturbed one
            runner_up = 2 if self.swap and self.calls % 2 == 0 else 1
            return np.array([0, runner_up]), np.array([1.0, 0.5 + 0.01 * float(vector[0])])

    queries = ["a", "b", "c", "d"]
    steady = reranker_contraction(Stub(swap=False), queries, seed=0)
    assert steady["candidates_changed_under_noise"] == 0.0
    assert steady["reranker_contraction_p99_same_candidates"] == pytest.approx(
        steady["reranker_contraction_p99"])
    swapped = reranker_contraction(Stub(swap=True), queries, seed=0)
    assert swapped["candidates_changed_under_noise"] == 1.0
    assert swapped["reranker_contraction_p99_same_candidates"] is None
    # The swap moves the runner-up's whole mass: far more than the smooth map ever does.
    assert swapped["reranker_contraction_p50"] > 10 * steady["reranker_contraction_p50"]


def test_drift_brings_half_the_categories_in_at_round_one_and_the_rest_at_the_events():
    from federation.simulation.runner import aggregates_in, drift_plan

    categories = [f"cat{i}" for i in range(9)]
    plan = drift_plan(categories * 2, rounds=10, every=3, seed=4)
    assert set(plan) == set(categories)
    starts = Counter(plan.values())
    assert starts[1] == 5 and set(starts) == {1, 4, 7, 10}  # events at 1 + 3, 1 + 6, 1 + 9
    assert sum(starts.values()) == 9
    assert drift_plan(categories, rounds=10, every=3, seed=4) == plan  # seeded
    assert drift_plan(categories, rounds=10, every=3, seed=5) != plan
    # No event within the rounds, or no drift asked for: everything from round 1.
    assert set(drift_plan(categories, rounds=3, every=3, seed=4).values()) == {1}
    assert set(drift_plan(categories, rounds=10, every=0, seed=4).values()) == {1}
    assert [r for r in range(1, 12) if aggregates_in(r, 5)] == [1, 6, 11]
    assert [r for r in range(1, 12) if aggregates_in(r, 0)] == [1]
    assert [r for r in range(1, 4) if aggregates_in(r, 1)] == [1, 2, 3]


def test_a_clients_experience_meets_a_category_only_once_it_is_in_use():
    from federation.simulation.runner import _periods, _slices

    lines = list(range(12))
    assert _periods(lines, [1] * 12, 3) == _slices(lines, 3)  # no drift: consecutive periods
    starts = [1, 3, 1, 3, 1, 3, 1, 1, 3, 1, 1, 3]
    periods = _periods(lines, starts, 4)
    assert sorted(x for period in periods for x in period) == lines  # every line, once
    for r, period in enumerate(periods, start=1):
        assert all(starts[x] <= r for x in period), (r, period)
    assert periods[2] and all(any(starts[x] == 3 for x in p) for p in periods[2:])


def test_contradicting_clients_report_the_same_requests_for_confusable_tools():
    from compendium.schema import Compendium, Scenario
    from federation.simulation.runner import contradict

    confusions = {f"t{i}": [f"t{(i + 1) % 4}", f"t{(i + 2) % 4}"] for i in range(4)}
    compendiums = {
        client: Compendium(scenarios=[Scenario(tool_id=f"t{i % 4}", text=f"{client} request {i}", support=2)
                                      for i in range(200)])
        for client in ("a1", "a2", "b1")
    }
    organization_of = {"a1": "a", "a2": "a", "b1": "b"}
    out = contradict(compendiums, organization_of, 0.4, confusions, seed=3)
    assert out == contradict(compendiums, organization_of, 0.4, confusions, seed=3)  # stable draws
    assert out["b1"] == compendiums["b1"]  # alone in its organization: nobody to contradict it
    for client, other in (("a1", "a2"), ("a2", "a1")):
        original = {s.text: s for s in compendiums[other].scenarios}
        added = [s for s in out[client].scenarios if s.text in original]
        assert 0.3 < len(added) / len(original) < 0.5  # about 40% of the other's scenarios
        for s in added:  # the same request and support, a confusable tool
            assert s.tool_id in confusions[original[s.text].tool_id] and s.support == 2
        assert compendiums[client].scenarios == out[client].scenarios[: 200]  # its own stay
    assert contradict(compendiums, organization_of, 0.0, confusions, seed=3) == compendiums


def test_a_dataset_fingerprint_changes_with_any_tool_or_query():
    from dataclasses import replace

    from compendium.registry import LabelledQuery, RoutingDataset
    from federation.simulation.data import dataset_fingerprint

    tools = [ToolSpec(tool_id="a", description="first"), ToolSpec(tool_id="b", description="second")]
    queries = [LabelledQuery("one", "a"), LabelledQuery("two", "b")]
    base = dataset_fingerprint(RoutingDataset("d", tools, queries))
    assert base == dataset_fingerprint(RoutingDataset("other name", list(tools), list(queries)))
    changed = [
        RoutingDataset("d", tools, [queries[0], replace(queries[1], tool_id="a")]),
        RoutingDataset("d", tools, [*queries, LabelledQuery("three", "a")]),
        RoutingDataset("d", [tools[0], tools[1].model_copy(update={"category": "x"})], queries),
    ]
    assert len({base, *map(dataset_fingerprint, changed)}) == 4
