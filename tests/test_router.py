"""The pure router: retrieval, rerankers, precautions, calibration, the LLM reranker over HTTP, CLI."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from compendium.canonical import canonical_dict
from compendium.registry import load_dataset, stratified_split
from compendium.schema import Compendium, Precaution, PromptTemplate, Scenario
from routing.cli import add_route_command
from routing.datasets import compendium_from_queries
from routing.embeddings import get_query_engine
from routing.llm import LLMUnavailable, OpenAICompatibleLLM, judge_consistency, parse_choice
from routing.router import (
    RERANKERS,
    LinearHead,
    PoolBM25,
    Router,
    RoutingParams,
    calibration_data,
    evaluate_calibration,
    expected_calibration_error,
    fit_calibration,
    fit_linear_head,
    fit_params,
    fit_router,
    top_n,
)
from tests.chat_server import ChatServer
from tests.routing_data import METATOOL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return get_query_engine()


@pytest.fixture(scope="module")
def metatool_split():
    dataset = load_dataset(METATOOL)
    tools = sorted(dataset.tool_ids)[:40]
    queries = [q for q in dataset.queries if q.tool_id in set(tools)]
    return dataset, stratified_split(queries, seed=7, probe_fraction=0.2, test_fraction=0.2)


@pytest.fixture(scope="module")
def metatool_router(engine, metatool_split):
    dataset, split = metatool_split
    compendium = compendium_from_queries(dataset.tools, split.train, max_per_tool=25)
    return Router(compendium, engine, "fusion", params=RoutingParams())


def test_in_memory_retrieval_matches_brute_force_cosine(metatool_router, metatool_split, engine):
    _, split = metatool_split
    queries = [q.query for q in split.test[:60]]
    vectors = engine.embed(queries)
    matrix = engine.embed(metatool_router.index.texts)
    for query, vector in zip(queries, vectors, strict=True):
        brute = matrix @ vector
        expected = np.argsort(-brute, kind="stable")[:5]
        idx, scores = metatool_router.index.retrieve(vector, 5)
        assert list(idx) == list(expected)
        assert np.allclose(scores, brute[expected], atol=1e-6)
        decision = metatool_router.with_reranker("none").route(query, 5)
        assert [c["scenario"] for c in decision.candidates] == [
            metatool_router.index.texts[i] for i in expected
        ]
        # The bypass picks the parent tool of the top-1 cosine scenario.
        assert decision.tool == decision.candidates[0]["tool"]


def test_how_many_candidates_are_shown_does_not_change_the_decision(metatool_router, metatool_split):
    """top_k lists the nearest scenarios; the decision is what the router was fitted with."""
    _, split = metatool_split
    for query in [q.query for q in split.test[:40]]:
        shown = {k: metatool_router.route(query, k) for k in (1, 5, 50)}
        assert len({(d.tool, d.confidence) for d in shown.values()}) == 1, query
        assert [len(d.candidates) for d in shown.values()] == [1, 5, 50]
        assert shown[1].ranking == shown[50].ranking
        # the ranking is best first and always holds the chosen tool
        scores = [r["score"] for r in shown[5].ranking]
        assert scores == sorted(scores, reverse=True) and len(scores) <= Router.RANKED
        assert shown[5].tool in [r["tool"] for r in shown[5].ranking]
        assert shown[5].ranking[0]["tool"] == shown[5].tool
    batch = metatool_router.route_batch([q.query for q in split.test[:10]], top_k=2)
    assert [d.tool for d in batch] == [metatool_router.route(q.query).tool for q in split.test[:10]]


def test_batch_routing_equals_one_by_one(metatool_router, metatool_split):
    _, split = metatool_split
    queries = [q.query for q in split.test[:25]]
    batch = metatool_router.route_batch(queries)
    assert [d.tool for d in batch] == [metatool_router.route(q).tool for q in queries]
    assert [d.confidence for d in batch] == [metatool_router.route(q).confidence for q in queries]


def test_a_query_is_decided_alike_alone_and_in_a_batch_of_any_size(metatool_router, metatool_split):
    """The batch form scored every scenario for the whole batch in one matrix product, whose
    float32 sums BLAS blocks by the product's shape: the same query got other candidate scores,
    ranking scores and at times another confidence from POST /api/v1/route/ than from
    /api/v1/route/batch/, and in a batch of 7 than in one of 60."""
    _, split = metatool_split
    queries = [q.query for q in split.test[:60]]
    alone = [metatool_router.route(q, 10).as_dict() for q in queries]
    for size in (7, 60):
        batched = [
            d.as_dict()
            for start in range(0, len(queries), size)
            for d in metatool_router.route_batch(queries[start : start + size], 10)
        ]
        assert batched == alone, size


def _top1(router: Router, labelled: list[tuple[str, str]]) -> float:
    """Top-1 accuracy of `router` on (query, tool) pairs."""
    decisions = router.route_batch([q for q, _ in labelled])
    return float(np.mean([d.tool == t for d, (_, t) in zip(decisions, labelled, strict=True)]))


def _currency_compendium(with_precaution: bool) -> Compendium:
    precautions = (
        [Precaution(tool_id="fx", text="Do not use for converting US dollars to euros; the rates are stale")]
        if with_precaution
        else []
    )
    return Compendium(
        scenarios=[
            Scenario(tool_id="fx", text="Convert an amount of money from one currency to another"),
            Scenario(tool_id="calc", text="Do math with numbers, including sums of money amounts"),
            Scenario(tool_id="weather", text="Will it rain tomorrow in Paris?"),
        ],
        precautions=precautions,
        templates=[PromptTemplate(tool_id="calc", signature="eval(expr)", template="Compute {expr}")],
    )


def test_a_matching_precaution_lowers_its_tool(engine):
    query = "Convert 100 US dollars into euros"
    plain = Router(_currency_compendium(False), engine, "fusion", params=RoutingParams()).route(query)
    assert plain.tool == "fx"
    guarded = Router(_currency_compendium(True), engine, "fusion", params=RoutingParams()).route(query)
    assert guarded.tool == "calc"
    assert guarded.template == "Compute {expr}"
    # An unrelated query is not affected by the precaution.
    other = Router(_currency_compendium(True), engine, "fusion", params=RoutingParams())
    assert other.route("Change 20 pounds sterling to yen").tool == "fx"
    # The bypass ignores precautions, as in the paper.
    bypass = Router(_currency_compendium(True), engine, "none", params=RoutingParams())
    assert bypass.route(query).tool == "fx"


def test_calibration_lowers_expected_calibration_error_on_held_out(metatool_router, metatool_split):
    _, split = metatool_split
    probe = [(q.query, q.tool_id) for q in split.probe]
    held_out = [(q.query, q.tool_id) for q in split.test]
    params = fit_params(metatool_router, probe, fitted_on="test")
    assert set(params.calibration) == {"none", "fusion", "llm"}
    fitted = metatool_router.with_reranker("fusion", params=params)
    report = evaluate_calibration(fitted, held_out, "fusion")
    assert report["queries"] == len(held_out)
    assert report["ece_calibrated"] < report["ece_raw"]
    # Fitted weights are at least as accurate on the held-out split as the defaults.
    assert _top1(fitted, held_out) >= _top1(metatool_router, held_out) - 0.02
    # Parameters survive a JSON round trip.
    again = RoutingParams.from_dict(json.loads(params.to_json()))
    assert again.weights == params.weights and again.calibration["fusion"] == params.calibration["fusion"]
    # Escalation follows the threshold.
    strict = metatool_router.with_reranker("fusion", params=params, escalate_threshold=1.01)
    assert all(d.escalate for d in strict.route_batch([q for q, _ in held_out[:10]]))
    # ... and is decided on the confidence shown: at a threshold equal to it, no escalation
    # (it was decided on the unrounded value, so 0.4999996 showed 0.5 and escalated at 0.5).
    queries = [q for q, _ in held_out[:20]]
    for query, shown in zip(queries, fitted.route_batch(queries), strict=True):
        at = fitted.with_reranker("fusion", params=params, escalate_threshold=shown.confidence)
        above = fitted.with_reranker(
            "fusion", params=params, escalate_threshold=shown.confidence + 1e-6
        )
        assert not at.route(query).escalate and above.route(query).escalate


@pytest.mark.parametrize("draw", range(5))
def test_a_small_probe_moves_the_fusion_weights_only_as_far_as_it_has_evidence_to(engine, draw):
    """Eight tools of two scenarios each and a probe of 12 to 24 requests, the fusion weights
    fitted on half of it, which some weighting separates perfectly. Maximum likelihood has no
    answer there: the unregularized fit ran off along a separating direction (dense 52, vote 29
    on one draw; dense -158 and bm25 -11 in the simulation's tiny federation), with scores that
    saturated the calibrated confidences. The fit stays within two of the weights it starts from
    (the shipped ones), and the dense weight counts for a tool."""
    from tests.simulation_fixtures import OPENERS, SUFFIXES, TOOLS

    rng = random.Random(3)

    def ask(intent: str) -> str:
        return f"{rng.choice(OPENERS)} {intent}{rng.choice(SUFFIXES)}"

    compendium = Compendium(scenarios=[
        Scenario(tool_id=tool, text=ask(intent)) for tool, (_, intents) in TOOLS.items() for intent in intents[:2]
    ])
    probe = [(ask(intent), tool) for tool, (_, intents) in TOOLS.items() for intent in intents[2:4]]
    random.Random(draw).shuffle(probe)
    probe = probe[: (12, 16, 16, 16, 24)[draw]]
    start = RoutingParams.load().weights
    fitted = fit_router(compendium, engine, probe).params.weights
    assert fitted.dense > 0, fitted
    for name in ("dense", "bm25", "vote", "head"):
        assert abs(getattr(fitted, name) - getattr(start, name)) < 2.0, (name, fitted)


def test_a_small_probe_calibrates_confidences_short_of_certainty(engine):
    """Platt's targets: on 16 probe requests, one of them routed wrong, the score separates right
    from wrong, and 0/1 targets have no finite fit: it ran off and the confidences came out 0 or
    1, which clients' delta rule read as certainty. With (N+ + 1) / (N+ + 2) and 1 / (N- + 2) as
    targets none is."""
    from tests.simulation_fixtures import OPENERS, SUFFIXES, TOOLS

    rng = random.Random(3)

    def ask(intent: str) -> str:
        return f"{rng.choice(OPENERS)} {intent}{rng.choice(SUFFIXES)}"

    compendium = Compendium(scenarios=[
        Scenario(tool_id=tool, text=ask(intent)) for tool, (_, intents) in TOOLS.items() for intent in intents[:2]
    ])
    probe = [(ask(intent), tool) for tool, (_, intents) in TOOLS.items() for intent in intents[:2]][:16]
    router = Router(compendium, engine, "fusion")
    # The request the router is least sure of is labelled with another tool: routed wrong, and
    # the score separates it from the 15 routed right.
    least = int(np.argmin(calibration_data(router, probe, "fusion")[:, 0]))
    tools = list(TOOLS)
    probe[least] = (probe[least][0], tools[(tools.index(probe[least][1]) + 1) % len(tools)])
    data = calibration_data(router, probe, "fusion")
    right = int(data[:, 3].sum())
    assert 0 < right < len(data)
    cal, report = fit_calibration(router, probe, "fusion")
    confidences = np.array([cal.probability(s, m) for s, m in data[:, :2]])
    # 0/1 targets: a score weight of 24 and confidences of 1.0000 and 0.002; Platt's: 2.4, 0.67
    # to 0.99
    assert 0.005 < confidences.min() and confidences.max() < 0.995, (confidences, cal)
    assert report["probe_accuracy"] == right / len(data)  # the outcomes, not the targets


def test_expected_calibration_error_definition():
    assert expected_calibration_error(np.array([1.0, 1.0]), np.array([1, 1])) == 0.0
    assert expected_calibration_error(np.array([0.9, 0.9]), np.array([0, 0])) == pytest.approx(0.9)
    assert expected_calibration_error(np.array([0.25, 0.75]), np.array([0, 1])) == pytest.approx(0.25)


@pytest.fixture
def chat_server():
    server = ChatServer()
    yield server
    server.close()


def test_llm_reranker_over_openai_compatible_http(engine, chat_server):
    compendium = _currency_compendium(False)
    llm = OpenAICompatibleLLM(chat_server.url, model="router-model", api_key="k", retries=0)
    # the LLM is shown the params' top_k nearest scenarios
    router = Router(compendium, engine, "llm", params=RoutingParams(top_k=3), llm=llm)
    query = "Convert 100 US dollars into euros"
    fusion = router.with_reranker("fusion").route(query, top_k=3)
    assert fusion.tool == "fx"
    # The options are the candidates in cosine order; the LLM picks the calc scenario.
    pick = [c["tool"] for c in fusion.candidates].index("calc") + 1
    chat_server.answers.append(f"{pick}")
    decision = router.route(query, top_k=3)
    assert decision.tool == "calc" and decision.fallback_reason is None
    sent = chat_server.requests[-1]
    assert sent["path"] == "/v1/chat/completions" and sent["auth"] == "Bearer k"
    assert sent["body"]["model"] == "router-model"
    assert query in sent["body"]["messages"][-1]["content"]
    # A garbled answer falls back to fusion, and says why.
    chat_server.answers.append("I think the best is the banana one")
    garbled = router.route(query, top_k=3)
    assert garbled.tool == fusion.tool
    assert "no option number" in garbled.fallback_reason and "banana" in garbled.fallback_reason
    # What the endpoint answered is the operator's to read: an endpoint that answers with an
    # error text (its host, a key) would otherwise show it to every caller.
    assert "no option number" in garbled.public_fallback_reason
    assert "banana" not in garbled.public_fallback_reason
    chat_server.answers.append("7")
    out_of_range = router.route(query, top_k=3)
    assert "not between 1 and 3" in out_of_range.fallback_reason
    # Judge-consistency speaks the same protocol.
    chat_server.answers.append("Contradictory.")
    assert judge_consistency(llm, "use for money", "never use for money").consistent is False


@pytest.mark.parametrize("refuses", [False, True])
def test_json_mode_is_asked_for_and_dropped_where_the_server_refuses_it(refuses):
    """With a JSON schema the server is asked for a JSON object of it (llama.cpp constrains its
    decoding to the schema); a server that refuses `response_format` is asked again without it,
    once, and never with it again."""
    server = ChatServer(default='{"summary": "ok"}', refuse_response_format=refuses)
    try:
        llm = OpenAICompatibleLLM(server.url, retries=0)
        schema = {"type": "object", "properties": {"summary": {"type": "string"}}}
        assert llm.complete("Summarize as JSON", json_schema=schema) == '{"summary": "ok"}'
        assert llm.complete("Summarize as JSON again", json_schema=schema) == '{"summary": "ok"}'
        assert llm.complete("Plain question") == '{"summary": "ok"}'
        formats = [r["body"].get("response_format") for r in server.requests]
        if refuses:
            assert formats == [{"type": "json_object", "schema": schema}, None, None, None]
            assert llm.json_mode_refused.startswith("HTTP 400") and "response_format" in llm.json_mode_refused
        else:
            assert formats == [{"type": "json_object", "schema": schema}] * 2 + [None]
            assert llm.json_mode_refused == ""
    finally:
        server.close()


def test_a_question_refused_with_and_without_json_mode_raises_and_keeps_the_json_mode():
    server = ChatServer(refuse_all=True)
    try:
        llm = OpenAICompatibleLLM(server.url, retries=0)
        with pytest.raises(LLMUnavailable, match="refused the request: HTTP 400"):
            llm.complete("A prompt far too long", json_schema={"type": "object"})
        assert [("response_format" in r["body"]) for r in server.requests] == [True, False]
        assert llm.json_mode_refused == ""  # the question was refused, not the JSON mode
    finally:
        server.close()


def test_llm_endpoint_down_is_one_line_and_falls_back(engine):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = OpenAICompatibleLLM(f"http://127.0.0.1:{port}", retries=1, backoff=0.0, timeout=2)
    router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
    decision = router.route("Convert 100 US dollars into euros")
    assert decision.tool == "fx"
    assert "is down" in decision.fallback_reason and "\n" not in decision.fallback_reason


def test_an_endpoint_found_down_is_not_asked_again_for_a_pause_and_a_garbled_answer_falls_back(engine):
    """Each routing request waited through its own timeouts and retries against an endpoint
    already found down (16 such requests held every gunicorn thread); an answer that did not
    decode (Content-Encoding: gzip over a plain body) was a 500, not a fallback."""
    server = ChatServer(default="1")
    try:
        llm = OpenAICompatibleLLM(server.url, retries=1, backoff=0.0, pause=30)
        clock = [100.0]
        llm._clock = lambda: clock[0]
        server.status = 503
        # names where its URL comes from on the server and in the client (was the server's alone)
        with pytest.raises(LLMUnavailable, match="is down: HTTP 503 after 2 attempts; .*SYNAPSE_LLM_BASE_URL.*--llm-url"):
            llm.complete("Which option?")
        assert len(server.requests) == 2
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
        decision = router.route("Convert 100 US dollars into euros")
        assert decision.tool == "fx" and "not asked again for 30 s" in decision.fallback_reason
        assert len(server.requests) == 2  # not asked
        server.status = None
        clock[0] += 31
        assert llm.complete("Which option?") == "1" and len(server.requests) == 3
        server.status = 503
        clock[0] += 1
        with pytest.raises(LLMUnavailable, match="after 2 attempts"):  # found down again
            llm.complete("Which option?")

        server.status, server.garbled = None, True
        garbled = OpenAICompatibleLLM(server.url, retries=0)
        with pytest.raises(LLMUnavailable, match="answered unreadably: DecodingError"):
            garbled.complete("Which option?")
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(),
                        llm=garbled)
        decision = router.route("Convert 100 US dollars into euros")
        assert decision.tool == "fx" and "unreadably" in decision.fallback_reason
    finally:
        server.close()


def test_credentials_in_the_llm_url_are_used_but_never_shown(engine):
    """SYNAPSE_LLM_BASE_URL may carry a user and password (http://user:secret@host, httpx sends
    them as basic authentication): the URL went whole into every error, hence into each routing
    answer's fallback_reason, which any caller of the routing API (a routing token) reads."""
    server = ChatServer(default="1")
    try:
        url = server.url.replace("http://", "http://app:s3cret@")
        llm = OpenAICompatibleLLM(url, retries=0, backoff=0.0)
        assert llm.complete("Which option?") == "1"
        assert server.requests[-1]["auth"].startswith("Basic ")  # still sent
        assert "s3cret" not in llm.name and "app:" not in llm.name
        server.status = 503
        with pytest.raises(LLMUnavailable) as down:
            llm.complete("Which option?")
        assert "is down" in str(down.value) and "s3cret" not in str(down.value)
        assert "***@127.0.0.1" in str(down.value)
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
        decision = router.route("Convert 100 US dollars into euros")
        assert decision.reranker == "fusion" and "s3cret" not in decision.fallback_reason
        server.status = None
        server.refuse_all = True
        with pytest.raises(LLMUnavailable, match="refused the request") as refused:
            llm.complete("Which option?")
        assert "s3cret" not in str(refused.value)
    finally:
        server.close()


def test_each_llm_failure_brings_the_words_anyone_may_read(engine, tmp_path):
    """What a caller other than the operator reads of an LLM fallback was parsed out of the
    failure's text. Each raise site now words it: the kind of failure, never the endpoint's
    URL, its error text or a file's path; the decision keeps both, the full reason and that."""
    import socket

    from routing.llm import BudgetedLLM, LlamaCppLLM, UnusableLLM

    said = " (the operator's routing page says why)"

    def decided(llm):
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
        decision = router.route("Convert 100 US dollars into euros")
        assert decision.reranker == "fusion" and decision.tool == "fx"
        return decision

    def public(kind):
        return f"LLM answer unusable (LLM unavailable: {kind}); fell back to fusion"

    server = ChatServer(default="1")
    try:
        port = server.url.rsplit(":", 1)[1]
        server.status = 503
        down = decided(OpenAICompatibleLLM(server.url, retries=1, backoff=0.0, pause=30))
        assert "is down: HTTP 503" in down.fallback_reason and port in down.fallback_reason
        assert down.public_fallback_reason == public(f"the LLM endpoint gave no usable answer{said}")
        server.status = None
        server.refuse_all = True
        refused = decided(OpenAICompatibleLLM(server.url, retries=0))
        assert "the prompt exceeds the context" in refused.fallback_reason
        assert refused.public_fallback_reason == public(f"the LLM endpoint refused the request{said}")
        server.refuse_all, server.garbled = False, True
        garbled = decided(OpenAICompatibleLLM(server.url, retries=0))
        assert "DecodingError" in garbled.fallback_reason
        assert garbled.public_fallback_reason == public(f"the LLM endpoint gave no usable answer{said}")
        server.garbled, server.silent = False, 5.0
        slow = decided(OpenAICompatibleLLM(server.url, retries=0, timeout=0.5))
        assert "no answer within 0.5s" in slow.fallback_reason
        assert slow.public_fallback_reason == public(f"the LLM endpoint did not answer in time{said}")
    finally:
        server.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    unreachable = decided(OpenAICompatibleLLM(f"http://127.0.0.1:{closed}", retries=0))
    assert "cannot connect" in unreachable.fallback_reason
    assert unreachable.public_fallback_reason == public(f"the LLM endpoint could not be reached{said}")

    # the batch's own budget names nothing of the server's: read whole; a failure met earlier
    # in the batch is marked so, in both readings
    spent = decided(BudgetedLLM(OpenAICompatibleLLM(f"http://127.0.0.1:{closed}"), -1.0))
    assert spent.public_fallback_reason == spent.fallback_reason
    assert "time budget of -1 s (SYNAPSE_LLM_BATCH_SECONDS) is spent" in spent.fallback_reason
    batch = BudgetedLLM(OpenAICompatibleLLM(f"http://127.0.0.1:{closed}", retries=0), 60.0)
    decided(batch)
    again = decided(batch)
    assert again.fallback_reason.startswith(
        "LLM answer unusable (LLM unavailable: unavailable earlier in this batch (LLM endpoint http://")
    assert again.public_fallback_reason == public(
        f"unavailable earlier in this batch: the LLM endpoint could not be reached{said}")

    # a model that cannot be loaded (llama-cpp-python missing, or its file): the operator's
    gone = str(tmp_path / "secret-models" / "smol.gguf")
    with pytest.raises(LLMUnavailable) as failed:
        LlamaCppLLM(gone)
    assert failed.value.public == "the configured LLM could not be loaded"
    unusable = decided(UnusableLLM(f"the configured LLM could not be loaded: {failed.value}"))
    assert str(failed.value) in unusable.fallback_reason
    assert unusable.public_fallback_reason == public(f"the configured LLM could not be loaded{said}")
    # and a raise site that words nothing gives a generic line, not its text
    assert LLMUnavailable("inference-box-7:8000 said no").public == "the LLM endpoint gave no usable answer"
    for decision in (down, refused, garbled, slow, unreachable, again, unusable):
        shown = decision.public_fallback_reason
        assert not any(part in shown for part in ("127.0.0.1", port, str(closed), "secret-models"))


def test_the_in_process_llm_words_a_native_failure_but_lets_a_time_limit_through():
    """llama.cpp's own failures become one LLMUnavailable line (the callers fall back); the
    worker's soft time limit met during an answer is not such a failure: wrapped, the merge's
    summarizer took it for an unusable answer and went on until the hard limit killed it."""
    import threading

    from billiard.exceptions import SoftTimeLimitExceeded

    from routing.llm import LlamaCppLLM

    class Native:
        def __init__(self, exc):
            self.exc = exc

        def create_chat_completion(self, **kwargs):
            raise self.exc

    llm = object.__new__(LlamaCppLLM)
    llm.name, llm._lock = "llama.cpp:smol.gguf", threading.Lock()
    llm._llama = Native(ValueError("Requested tokens exceed context window"))
    with pytest.raises(LLMUnavailable, match="ValueError: Requested tokens exceed"):
        llm.complete("hello")
    llm._llama = Native(SoftTimeLimitExceeded())
    with pytest.raises(SoftTimeLimitExceeded):
        llm.complete("hello")


def test_parse_choice():
    assert parse_choice("2", 3).index == 1
    assert parse_choice("Option 3.", 3).index == 2
    assert parse_choice("", 3).index is None
    assert parse_choice("zero", 3).reason.startswith("no option number")


def _route_command(tmp_path, monkeypatch, compendium: Compendium):
    """A pulled global at tmp_path/global.json and the `route` command's parser."""
    monkeypatch.setenv("SYNAPSE_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "global.json"
    body = {"round": 3, "sha256": "x", "compendium": canonical_dict(compendium)}
    path.write_text(json.dumps(body), encoding="utf-8")
    parser = argparse.ArgumentParser(prog="synapse-client")
    add_route_command(parser.add_subparsers(dest="command", required=True))
    return path, parser


def test_route_command(tmp_path, capsys, engine, monkeypatch):
    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(True))
    args = parser.parse_args(
        ["route", "Will it rain in Paris tomorrow?", "--compendium", str(path), "--json", "--top-k", "2"]
    )
    assert args.func(args) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["tool"] == "weather" and len(decision["candidates"]) == 2
    # The pulled compendium's embeddings (by the merge's engine, as the server stored them) are
    # kept on disk and reused by the next call.
    cached = sorted((tmp_path / "cache" / "compendium-embeddings").glob("*.npy"))
    assert cached and all(f.stat().st_size > 0 for f in cached)
    # So is its linear head, fitted as the server fits it at publication.
    heads = sorted((tmp_path / "cache" / "routing-heads").glob("*.npz"))
    assert len(heads) == 1
    # Reused, not written again (written files are replaced whole: another inode); a read
    # refreshes a file's time only, so that the caches' pruning removes the least used first.
    stamps = [f.stat().st_ino for f in cached + heads]
    args = parser.parse_args(["route", "Will it rain?", "--compendium", str(path), "--reranker", "none"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("tool: weather")
    assert [f.stat().st_ino for f in cached + heads] == stamps
    args = parser.parse_args(["route", "Will it rain?", "--compendium", str(path), "--no-linear-head"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("tool: weather")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    args = parser.parse_args(["route", "x", "--compendium", str(bad)])
    with pytest.raises(SystemExit, match="not valid JSON"):
        args.func(args)


def test_route_command_refits_damaged_cache_files(tmp_path, capsys, engine, monkeypatch):
    """A cached head or embeddings file cut short (a full disk, a killed write: the head was
    written in place) was read back by every later call: a BadZipFile or ValueError traceback
    until the file was found and removed by hand."""
    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(True))
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path)])
    assert args.func(args) == 0
    first = capsys.readouterr().out
    cache = tmp_path / "cache"
    damaged = sorted(cache.glob("routing-heads/*.npz")) + sorted(
        cache.glob("compendium-embeddings/*.npy")
    )
    assert len(damaged) == 3  # the head, the scenarios', the precautions'
    whole = {f: f.read_bytes() for f in damaged}
    for f in damaged:
        f.write_bytes(whole[f][:50])
    assert args.func(args) == 0
    assert capsys.readouterr().out == first  # routed as before
    assert {f: f.read_bytes() for f in damaged} == whole  # and written whole again
    assert not [f for f in cache.rglob("*") if f.name.startswith(".")]  # no temporary left


def test_route_command_routes_when_its_cache_cannot_be_written(tmp_path, capsys, engine, monkeypatch):
    """SYNAPSE_MODEL_CACHE (or ~/.cache) not writable: the query engine already fell back, and the
    head's cache was skipped, but the compendium's embeddings cache was a NotADirectoryError or
    PermissionError traceback."""
    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(True))
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path)])
    assert args.func(args) == 0
    cached = capsys.readouterr().out
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("SYNAPSE_MODEL_CACHE", str(blocker / "cache"))
    assert args.func(args) == 0
    assert capsys.readouterr().out == cached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "cache", "global.json"]


def test_route_command_uses_the_head_the_server_published(tmp_path, capsys, engine, monkeypatch):
    from compendium.client_api import head_file

    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("tool: weather")
    # A published head (as `synapse-client pull` saves it) that is sure of calc decides.
    tools = ["calc", "fx", "weather"]
    sure = LinearHead(tools, np.zeros((3, engine.dimension), dtype=np.float32),
                      np.array([60.0, 0.0, 0.0], dtype=np.float32))
    head_file(path).write_bytes(sure.to_bytes())
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("tool: calc")
    # A head for other tools, or of another model's vectors (a traceback of a matmul before: an
    # --embedding-model other than the server's), or a broken file, is ignored with a warning:
    # the head fitted here.
    other = LinearHead(["a", "b"], np.zeros((2, engine.dimension), dtype=np.float32),
                       np.array([60.0, 0.0], dtype=np.float32))
    wider = LinearHead(tools, np.zeros((3, 768), dtype=np.float32),
                       np.array([60.0, 0.0, 0.0], dtype=np.float32))
    for data, why in ((other.to_bytes(), "other tools"), (b"broken", "ignoring"),
                      (wider.to_bytes(), f"shape (3, 768), not (3, {engine.dimension})")):
        head_file(path).write_bytes(data)
        assert args.func(args) == 0
        out, err = capsys.readouterr()
        assert out.startswith("tool: weather") and why in err
    # A global with no scenario routes by the published head alone (as the routing API does);
    # without a head there is nothing to route with.
    empty = _currency_compendium(False).model_copy(update={"scenarios": [], "precautions": []})
    path, parser = _route_command(tmp_path, monkeypatch, empty)
    args = parser.parse_args(["route", "What is 2 + 2?", "--compendium", str(path)])
    head_file(path).unlink()
    with pytest.raises(SystemExit, match="has no scenarios to route against, and no head"):
        args.func(args)
    head_file(path).write_bytes(sure.to_bytes())
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("tool: calc") and "calc (no scenario" in out  # the head named it
    assert out.split("nearest scenarios:\n")[1].startswith("template:")  # no scenario listed


def test_route_command_never_names_a_tool_the_schema_in_force_does_not_list(
    tmp_path, capsys, engine, monkeypatch
):
    """A tool deactivated in the registry since the global was published is out of the schema in
    force, which `pull` saves beside the global: `route` leaves it out as the routing API does
    (not the answer, nor a candidate, nor ranked; the head does not bring it back), and with
    every tool of the global left out there is no decision: "no active tools"."""
    from compendium.client_api import head_file, schema_file
    from compendium.schema import Schema, ToolSpec

    def schema(*tools: str) -> bytes:
        return Schema(tools=[ToolSpec(tool_id=t, description=f"the {t} tool") for t in tools]
                      ).model_dump_json().encode()

    def named(decision: dict) -> set:
        return ({decision["tool"]} | {c["tool"] for c in decision["candidates"]}
                | {r["tool"] for r in decision["ranking"]})

    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(True))
    query = "Will it rain in Paris tomorrow?"

    def route(*extra: str) -> dict:
        args = parser.parse_args(["route", query, "--compendium", str(path), "--json",
                                  "--top-k", "3", *extra])
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    before = route()  # no schema beside it: routed as before, nothing left out
    assert before["tool"] == "weather" and named(before) == {"calc", "fx", "weather"}
    assert before["excluded_tools"] == [] and before["schema"] is None
    schema_file(path).write_bytes(schema("calc", "fx", "weather", "maps"))  # all of them active
    same = route()
    assert {k: v for k, v in same.items() if k != "schema"} == {
        k: v for k, v in before.items() if k != "schema"}
    assert same["schema"] == str(schema_file(path))

    schema_file(path).write_bytes(schema("calc", "fx"))  # weather deactivated since
    for reranker in ("fusion", "none"):
        after = route("--reranker", reranker)
        assert after["tool"] in {"calc", "fx"} and "weather" not in named(after), after
        assert after["excluded_tools"] == ["weather"] and len(after["candidates"]) == 2
    args = parser.parse_args(["route", query, "--compendium", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "weather" not in out.replace(query, "").split("left out")[0]
    assert f"left out (not in the schema in force, {schema_file(path)}): weather" in out

    # --schema names another file; the one beside the global is not read then.
    elsewhere = tmp_path / "schema.json"
    elsewhere.write_bytes(schema("calc", "fx", "weather"))
    assert route("--schema", str(elsewhere))["tool"] == "weather"

    # A head that names a tool the global has no scenario of (from the public probe set), sure
    # of it: left out too when the schema does not list it.
    tools = ["calc", "fx", "weather", "maps"]
    sure = LinearHead(tools, np.zeros((4, engine.dimension), dtype=np.float32),
                      np.array([0.0, 0.0, 0.0, 60.0], dtype=np.float32))
    head_file(path).write_bytes(sure.to_bytes())
    assert route("--schema", str(elsewhere))["tool"] == "weather"  # maps: not in the schema
    assert route("--schema", str(elsewhere))["excluded_tools"] == ["maps"]
    schema_file(path).write_bytes(schema("calc", "fx", "weather", "maps"))
    assert route()["tool"] == "maps"

    # None of the global's tools in force: no decision, as the routing API answers it.
    schema_file(path).write_bytes(schema("translate"))
    nothing = route()
    assert nothing["tool"] is None and nothing["reranker"] is None
    assert nothing["fallback_reason"] == "no active tools" and nothing["escalate"] is True
    assert nothing["candidates"] == [] and nothing["ranking"] == []
    assert nothing["excluded_tools"] == sorted(tools)
    args = parser.parse_args(["route", query, "--compendium", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("tool: none (no active tools: the schema in force")
    assert "calc, fx, maps, weather" in out


def test_in_process_llm_backend_fails_in_one_clear_line(monkeypatch, tmp_path):
    from routing.llm import get_llm

    monkeypatch.delenv("SYNAPSE_LLM_BASE_URL", raising=False)
    monkeypatch.setenv("SYNAPSE_LLM_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(LLMUnavailable) as error:
        get_llm()
    message = str(error.value)
    assert "\n" not in message
    assert "llama-cpp-python" in message or "not found" in message
    monkeypatch.delenv("SYNAPSE_LLM_GGUF")
    assert get_llm() is None


# --- the linear head -------------------------------------------------------------------------------


def test_linear_head_fits_the_compendium_and_improves_fusion_on_held_out(
    metatool_router, metatool_split, engine
):
    _, split = metatool_split
    index = metatool_router.index
    head = fit_linear_head(index.compendium, index.embeddings, engine.embed)
    assert head.tools == metatool_router.index.tool_names
    assert head.weights.shape == (len(head.tools), engine.dimension)
    # The head alone reads its own training scenarios back.
    own = head.log_proba(metatool_router.index.embeddings).argmax(axis=1)
    assert np.mean(own == metatool_router.index.scenario_tool) > 0.95
    probe = [(q.query, q.tool_id) for q in split.probe]
    held_out = [(q.query, q.tool_id) for q in split.test]
    without = metatool_router.with_reranker("fusion", params=fit_params(metatool_router, probe))
    headed = metatool_router.with_reranker("fusion", head=head)
    params = fit_params(headed, probe)
    assert params.weights.head > 0  # the probe set finds the head informative
    headed = headed.with_reranker("fusion", params=params)
    assert _top1(headed, held_out) >= _top1(without, held_out)
    # The bypass never consults the head.
    query = held_out[0][0]
    assert headed.with_reranker("none").route(query).tool == without.with_reranker("none").route(query).tool
    # Stored and loaded, the head decides the same.
    again = LinearHead.from_bytes(head.to_bytes())
    assert again.tools == head.tools
    vectors = engine.embed([q for q, _ in held_out[:10]])
    assert np.allclose(again.log_proba(vectors), head.log_proba(vectors))


def test_linear_head_brings_tools_that_retrieval_missed_into_the_pool(engine):
    # Near-identical "weather" scenarios fill the pool; the head's top tools join it.
    weather = [Scenario(tool_id="weather", text=f"what is the weather in city number {i} today") for i in range(30)]
    sports = [Scenario(tool_id="sports", text="latest football scores of the league")]
    other = [Scenario(tool_id="news", text="headlines about politics this morning")]
    compendium = Compendium(scenarios=weather + sports + other)
    params = RoutingParams(pool=5)
    router = Router(compendium, engine, "fusion", params=params)
    headed = router.with_linear_head()
    head = headed.head
    query = "what is the weather in my city today"
    vector = engine.embed([query])[0]
    idx, scores = router.index.retrieve(vector, 5)
    plain = router.features(query, vector, idx, scores, 5)
    assert [router.index.tool_names[t] for t in plain.tools] == ["weather"]
    with_head = headed.features(query, vector, idx, scores, 5)
    names = [router.index.tool_names[t] for t in with_head.tools]
    assert names[0] == "weather" and set(names) == {"weather", "sports", "news"}
    # An added tool's dense feature is its best scenario cosine; its head column is its log-prob.
    row = names.index("sports")
    sports_rows = router.index.rows_of_tool[router.index.tool_names.index("sports")]
    assert with_head.matrix[row, 0] == pytest.approx(float((router.index.embeddings[sports_rows] @ vector).max()))
    log_proba = head.log_proba(vector)[0]
    assert np.allclose(with_head.matrix[:, 4], log_proba[with_head.tools])
    assert with_head.matrix[row, 2] == 0.0  # not in the top-k: no vote


def test_an_excluded_tool_is_never_named_and_the_others_decide_without_it(engine):
    """The server excludes the tools its registry has deactivated since the global was published:
    whatever the reranker and however the router retrieves, the decision, its candidates, its
    ranking and the head's additions to the pool never name them, and the bare cosine answers the
    nearest scenario of another tool (the next best)."""
    weather = [Scenario(tool_id="weather", text=f"what is the weather in city number {i} today")
               for i in range(30)]
    others = [Scenario(tool_id="sports", text="latest football scores of the league"),
              Scenario(tool_id="news", text="headlines about politics this morning"),
              Scenario(tool_id="forecast", text="will it rain in my town tomorrow")]
    compendium = Compendium(scenarios=weather + others)
    headed = Router(compendium, engine, "fusion", params=RoutingParams(pool=5)).with_linear_head()
    query = "what is the weather in my city today"
    assert headed.route(query).tool == "weather"
    nearest = [c["tool"] for c in headed.with_reranker("none").route(query, 40).candidates]

    def named(d):
        return {d.tool} | {c["tool"] for c in d.candidates} | {r["tool"] for r in d.ranking}

    without = headed.with_reranker("fusion", excluded_tools={"weather"})
    outside = without.with_reranker("fusion", retriever=lambda v, n: headed.index.retrieve(v, n))
    for router in (without, outside):  # in memory, and through a retriever of its own
        for reranker in RERANKERS:
            decision = router.with_reranker(reranker).route(query, 40)
            assert decision.tool and "weather" not in named(decision), (reranker, decision)
        assert router.with_reranker("none").route(query, 40).tool == next(
            t for t in nearest if t != "weather")
        assert [d.tool for d in router.route_batch([query, "football scores"])] == [
            router.route(query).tool, router.route("football scores").tool]
    # The head's probabilities of the others are as they were: only the pool lost a tool.
    vector = engine.embed([query])[0]
    idx, scores = without.retrieve(vector, 5)
    assert set(without.index.scenario_tool[idx]) <= {
        headed.index.tool_names.index(t) for t in ("sports", "news", "forecast")}
    features = without.features(query, vector, idx, scores, 5)
    assert np.allclose(features.matrix[:, 4], headed.head.log_proba(vector)[0][features.tools])
    # Nothing left to name: no reranker decides, and the answer says why.
    nothing = headed.with_reranker("fusion", excluded_tools={"weather", "sports", "news", "forecast"})
    decision = nothing.route(query)
    assert (decision.tool, decision.reranker, decision.fallback_reason) == (
        None, None, "no active tools")
    assert headed.with_reranker("fusion", excluded_tools={"unknown"}).route(query).tool == "weather"


def test_linear_head_needs_two_tools_and_matching_tools(engine):
    one = Router(Compendium(scenarios=[Scenario(tool_id="a", text="do a thing")]), engine, "fusion")
    assert one.with_linear_head().head is None
    two = Router(
        Compendium(scenarios=[Scenario(tool_id="a", text="book a flight"), Scenario(tool_id="b", text="order a pizza")]),
        engine,
        "fusion",
    )
    head = two.with_linear_head().head  # sklearn's binary form, turned into two rows
    assert head.weights.shape[0] == 2
    assert head.log_proba(engine.embed(["order a pizza"]))[0].argmax() == 1
    three = Router(
        Compendium(scenarios=two.index.compendium.scenarios + [Scenario(tool_id="c", text="play music")]),
        engine,
        "fusion",
    )
    with pytest.raises(ValueError, match="another compendium"):
        three.with_reranker("fusion", head=head)


def test_linear_head_learns_from_labelled_public_examples(metatool_split, engine):
    dataset, split = metatool_split
    thin = compendium_from_queries(dataset.tools, split.train, max_per_tool=2)
    router = Router(thin, engine, "fusion")
    vectors = engine.embed([q.query for q in split.probe])
    labels = [q.tool_id for q in split.probe]
    blind = fit_linear_head(thin, router.index.embeddings, engine.embed)
    taught = fit_linear_head(thin, router.index.embeddings, engine.embed, examples=(vectors, labels))
    assert taught.tools == blind.tools == router.index.tool_names
    held_out = [q for q in split.test if q.tool_id in set(taught.tools)]
    test_vectors = engine.embed([q.query for q in held_out])
    gold = np.array([taught.tools.index(q.tool_id) for q in held_out])

    def accuracy(head):
        return float(np.mean(head.log_proba(test_vectors).argmax(axis=1) == gold))

    assert accuracy(taught) > accuracy(blind) + 0.03
    # Examples of a tool without scenarios add it after the index's tools.
    more = fit_linear_head(
        thin, router.index.embeddings, engine.embed,
        examples=(np.vstack([vectors, vectors[:1]]), labels + ["zz_new_tool"]),
    )
    assert more.tools == taught.tools + ["zz_new_tool"]
    extended = router.with_reranker("fusion", head=more)
    assert extended.index.tool_names == more.tools
    assert router.index.tool_names == taught.tools  # the original index is left as it was
    with pytest.raises(ValueError, match="3 example vectors for 2 labels"):
        fit_linear_head(thin, router.index.embeddings, engine.embed, examples=(vectors[:3], labels[:2]))
    # Router.with_linear_head passes them through.
    assert np.allclose(router.with_linear_head(examples=(vectors, labels)).head.weights, taught.weights)


def test_tools_without_scenarios_are_routed_from_the_public_probe_set(metatool_split, engine):
    """A global that holds no scenario of some tools (a first round that released little, a new
    tool) still routes to them: the head learns them from the public probe set, they join the
    pool when it ranks them high, and the fusion weights learn how far to trust that."""
    dataset, split = metatool_split
    full = compendium_from_queries(dataset.tools, split.train, max_per_tool=10)
    tools = sorted({s.tool_id for s in full.scenarios})
    missing = set(tools[::3])
    partial = full.model_copy(
        update={"scenarios": [s for s in full.scenarios if s.tool_id not in missing]}
    )
    probe = [(q.query, q.tool_id) for q in split.probe]
    router = fit_router(partial, engine, probe)
    backed = sorted(set(tools) - missing)
    assert router.index.tool_names == backed + sorted(missing)
    assert router.params.weights.unbacked != 0.0  # fitted: the probe had such candidates
    # the same router without them: the probe's requests of those tools left out
    blind = fit_router(partial, engine, [(q, t) for q, t in probe if t not in missing])
    assert blind.index.tool_names == backed
    test = split.test
    decisions = router.route_batch([q.query for q in test])
    assert [d.tool for d in decisions[:20]] == [router.route(q.query).tool for q in test[:20]]
    right = np.array([d.tool == q.tool_id for d, q in zip(decisions, test, strict=True)])
    of_missing = np.array([q.tool_id in missing for q in test])
    blind_right = np.array(
        [d.tool == q.tool_id for d, q in zip(blind.route_batch([q.query for q in test]), test, strict=True)]
    )
    assert not blind_right[of_missing].any()  # it can never name them
    assert right[of_missing].mean() > 0.4
    assert right.mean() > blind_right.mean() + 0.1
    chosen = next(d for d, q in zip(decisions, test, strict=True) if d.tool in missing)
    assert all(c["tool"] in set(backed) for c in chosen.candidates)  # candidates are scenarios
    assert chosen.precautions == []
    # its ranking says why: the chosen tool has no scenario, only the head's probability
    named = next(r for r in chosen.ranking if r["tool"] == chosen.tool)
    assert named["backed"] is False and named["best_cosine"] is None and named["head_probability"] > 0
    # a global with no scenario at all (every client withheld everything): the head alone routes
    empty = full.model_copy(update={"scenarios": [], "precautions": []})
    alone = fit_router(empty, engine, probe)
    assert alone.index.tool_names == sorted({t for _, t in probe})
    decisions = alone.route_batch([q.query for q in test])
    assert all(d.tool is not None and d.candidates == [] for d in decisions)
    assert np.mean([d.tool == q.tool_id for d, q in zip(decisions, test, strict=True)]) > 0.4
    assert alone.with_reranker("none").route(test[0].query).fallback_reason == "no scenarios"


def test_pool_bm25_scores_are_rank_bm25s_to_the_bit(metatool_split):
    """The router's BM25 over a decision's pool is rank_bm25's get_batch_scores, computed without
    its per-call conversion of every document length: the same floats, so the same decisions."""
    from routing.router import tokenize

    _, split = metatool_split
    train, test = split.train, split.test
    corpus = [tokenize(q.query) or ["_"] for q in train]
    bm25 = PoolBM25(corpus)
    rng = np.random.default_rng(0)
    for q in test[:200]:
        pool = rng.choice(len(corpus), size=30, replace=False).tolist()
        query = tokenize(q.query) + ["never-a-word"]  # an unknown token scores 0 in both
        assert bm25.get_batch_scores(query, pool) == bm25.okapi.get_batch_scores(query, pool)


def test_int8_engine_embeds_a_list_as_it_embeds_each_text_alone():
    """The int8-compute engine runs one text per call, a list of texts on several threads at a
    time: the vectors are those of each text embedded alone, to the bit."""
    from routing.embeddings import _OnnxMiniLM

    texts = [q.query for q in load_dataset(METATOOL).queries[:120]]
    parallel = _OnnxMiniLM(threads=2, dynamic=True, workers=3)
    alone = np.stack([parallel.encode([t])[0] for t in texts])  # the two-thread session
    assert np.array_equal(parallel.encode(texts), alone)  # single-threaded calls, 3 at a time



def _answering(body: bytes) -> OpenAICompatibleLLM:
    """An OpenAI-compatible LLM whose endpoint answers every request with `body` (HTTP 200)."""
    import httpx

    llm = OpenAICompatibleLLM("http://llm.invalid", retries=0)
    llm._client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"Content-Type": "application/json"})
    ))
    return llm


def test_an_llm_answer_nested_too_deeply_falls_back_to_fusion(engine):
    """An endpoint answering JSON nested past Python's parser (a broken proxy, a hostile
    endpoint) raised RecursionError out of the router: a 500 from the routing API, a traceback
    from `synapse-client route`, instead of the fallback every other garbled answer gets."""
    llm = _answering(b"[" * 100_000 + b"]" * 100_000)
    router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
    decision = router.route("Convert 100 US dollars into euros")
    assert decision.tool == "fx" and decision.reranker == "fusion"
    assert "not a chat completion" in decision.fallback_reason


def test_an_llm_answer_whose_content_is_not_text_falls_back_to_fusion(engine):
    """A chat completion's content is text. One that was an object or a list was turned into its
    Python repr and its first digit read as the option: {"pick": [1, 2]} chose option 1."""
    router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams())
    fusion = router.with_reranker("fusion").route("Convert 100 US dollars into euros")
    for content in ({"pick": [1, 2]}, [3], 2):
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
        decision = router.with_reranker("llm", llm=_answering(body.encode())).route(
            "Convert 100 US dollars into euros"
        )
        assert decision.reranker == "fusion" and decision.tool == fusion.tool, content
        assert "not a chat completion" in decision.fallback_reason, content


def test_an_llm_answer_larger_than_any_completion_is_cut_off(engine):
    """An attempt read the endpoint's whole answer into memory, however large, within its
    timeout: a broken proxy or a hostile endpoint sending hundreds of megabytes (400 MiB here
    took 3 s over loopback and 835 MiB of the worker's memory) held twice that per routing
    request, and a gzip-encoded answer many times its size on the wire. Reading stops at
    `max_answer_bytes` and the decision falls back to fusion, saying why."""
    import httpx

    chunk, sent = b" " * (64 << 10), []
    completion = json.dumps({"choices": [{"message": {"content": "1"}}]}).encode()

    def huge():  # 64 MiB of whitespace (valid JSON around the completion), then the completion
        for _ in range(1024):
            sent.append(len(chunk))
            yield chunk
        yield completion

    llm = OpenAICompatibleLLM("http://llm.invalid", retries=0)
    llm._client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=huge(), headers={"Content-Type": "application/json"})
    ))
    router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
    decision = router.route("Convert 100 US dollars into euros")
    assert decision.reranker == "fusion" and decision.tool == "fx"
    assert f"more than {OpenAICompatibleLLM.max_answer_bytes} bytes" in decision.fallback_reason
    assert decision.public_fallback_reason == (
        "LLM answer unusable (LLM unavailable: the LLM endpoint gave no usable answer (the "
        "operator's routing page says why)); fell back to fusion")
    assert sum(sent) <= OpenAICompatibleLLM.max_answer_bytes + len(chunk)
    # an answer of ordinary size is read as before
    assert _answering(completion).complete("pick one", max_tokens=8) == "1"


def test_a_negative_llm_answer_is_no_option():
    """"-1" (what models answer for "none of these") was read as option 1: the LLM's refusal
    became its pick of the first scenario. A hyphen inside a word is no minus sign."""
    for answer in ("-1", "Answer: -2", "−1"):
        choice = parse_choice(answer, 3)
        assert choice.index is None and "not between 1 and 3" in choice.reason, answer
    assert parse_choice("option-2", 3).index == 1
    assert parse_choice("2 - 3", 3).index == 1


def test_route_command_ignores_a_pulled_head_damaged_in_any_way(tmp_path, capsys, engine, monkeypatch):
    """A pulled head whose compressed bytes were damaged (zlib.error), whose stored parameters
    were not a parameters object (TypeError, AttributeError), or whose arrays were not numbers
    (a matmul's UFuncTypeError) or not finite (a NaN confidence) was a traceback, or a decision
    of NaN, instead of the warning and the head fitted here that a file not a zip gets."""
    import io
    import zipfile

    from compendium.client_api import head_file

    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path),
                              "--json"])
    assert args.func(args) == 0
    without = json.loads(capsys.readouterr().out)
    tools, dim = ["calc", "fx", "weather"], engine.dimension

    def archive(**arrays):
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **{"tools": np.array(tools),
                                       "weights": np.zeros((3, dim), dtype=np.float32),
                                       "bias": np.zeros(3, dtype=np.float32), **arrays})
        return buffer.getvalue()

    good = archive()
    flipped = bytearray(good)
    start = flipped.find(b"weights.npy") + 60
    flipped[start:start + 60] = bytes(b ^ 0xFF for b in flipped[start:start + 60])
    members = io.BytesIO()
    with zipfile.ZipFile(members, "w") as z:
        for name in ("tools.npy", "weights.npy", "bias.npy"):
            z.writestr(name, b"not an array")
    damaged = {
        "flipped bytes": bytes(flipped),
        "parameters of unknown weights": archive(params=np.array('{"weights": {"bogus": 1}}')),
        "parameters not an object": archive(params=np.array("[1]")),
        "tools not a list": archive(tools=np.array("calc")),
        "weights not numbers": archive(weights=np.full((3, dim), "x")),
        "weights not finite": archive(weights=np.full((3, dim), np.nan, dtype=np.float32)),
        "members not arrays": members.getvalue(),
    }
    for why, data in damaged.items():
        head_file(path).write_bytes(data)
        assert args.func(args) == 0, why
        out, err = capsys.readouterr()
        assert json.loads(out) == without, why
        assert f"ignoring {head_file(path)}" in err, why


def test_route_command_refuses_a_query_of_control_characters(tmp_path, monkeypatch):
    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    args = parser.parse_args(["route", "\x1b\u200b", "--compendium", str(path)])
    with pytest.raises(SystemExit, match="the query is empty: .*control or format"):
        args.func(args)


def test_an_llm_endpoint_that_trickles_its_answer_is_cut_off_at_the_timeout(engine):
    """The timeout bounded each read, not the answer: an endpoint (or a proxy) sending its
    answer a byte at a time, each within the timeout, held a routing request for as long as it
    liked (20 s at a 1 s timeout here). An attempt now ends at the timeout, as one that sends
    nothing does, and the decision falls back to fusion, saying why."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"message": {"content": "1"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for byte in body:
                    if stop.wait(0.2):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
            except OSError:  # the client gave up
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        llm = OpenAICompatibleLLM(f"http://127.0.0.1:{server.server_address[1]}", retries=0,
                                  timeout=1.0)
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
        started = time.monotonic()
        decision = router.route("Convert 100 US dollars into euros")
        assert time.monotonic() - started < 3.0
        assert decision.reranker == "fusion" and decision.tool == "fx"
        assert "no answer within 1.0s" in decision.fallback_reason
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_route_command_refuses_a_global_without_scenarios_when_its_head_cannot_be_used(
    tmp_path, capsys, engine, monkeypatch
):
    """A global of no scenario routes by its published head alone; when that head was damaged,
    or --no-linear-head set it aside, there was nothing to route with, yet the command printed
    "tool: None" and exited 0, as if that were a decision."""
    from compendium.client_api import head_file

    empty = _currency_compendium(False).model_copy(update={"scenarios": [], "precautions": []})
    path, parser = _route_command(tmp_path, monkeypatch, empty)
    head_file(path).write_bytes(b"broken")
    args = parser.parse_args(["route", "What is 2 + 2?", "--compendium", str(path)])
    with pytest.raises(SystemExit, match="has no scenarios to route against, and the head pulled "
                                         "with it cannot be used"):
        args.func(args)
    tools = ["calc", "fx", "weather"]
    sure = LinearHead(tools, np.zeros((3, engine.dimension), dtype=np.float32),
                      np.array([60.0, 0.0, 0.0], dtype=np.float32))
    head_file(path).write_bytes(sure.to_bytes())
    args = parser.parse_args(["route", "What is 2 + 2?", "--compendium", str(path),
                              "--no-linear-head"])
    with pytest.raises(SystemExit, match="has no scenarios to route against, and --no-linear-head"):
        args.func(args)
    capsys.readouterr()


def test_a_pulled_head_that_is_not_an_archive_is_not_offered_as_a_pickle(tmp_path, capsys, engine,
                                                                          monkeypatch):
    """numpy's own words for bytes that are not an .npz were its advice to load the file as a
    pickle, unsafely ("If you trust the file you can load it unsafely using allow_pickle="),
    which the warning passed on about a file pulled from a server."""
    from compendium.client_api import head_file

    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    head_file(path).write_bytes(b"not a head at all")
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path)])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert "not an .npz archive" in err and "pickle" not in err, err


def test_route_command_ignores_a_pulled_router_whose_manifest_nests_too_deeply(
    tmp_path, capsys, engine, monkeypatch
):
    """A damaged COMPENDIUM.router/ is ignored with a warning, the frozen model routing; a
    manifest nested past Python's JSON parser was a RecursionError traceback instead."""
    from compendium.client_api import router_dir
    from routing.finetune import ROUTER_MANIFEST

    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    args = parser.parse_args(["route", "Will it rain in Paris tomorrow?", "--compendium", str(path)])
    folder = router_dir(path)
    folder.mkdir()
    (folder / ROUTER_MANIFEST).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("tool: weather") and "ignoring the tuned router" in err


def test_route_command_says_which_llm_api_key_cannot_be_sent(tmp_path, monkeypatch):
    """An API key an HTTP header cannot carry (pasted with a non-ASCII character) was a
    UnicodeEncodeError traceback from `synapse-client route --reranker llm`; it is one line
    naming the setting, without the key."""
    path, parser = _route_command(tmp_path, monkeypatch, _currency_compendium(False))
    monkeypatch.setenv("SYNAPSE_LLM_API_KEY", "sk-ключ")
    args = parser.parse_args(["route", "Will it rain?", "--compendium", str(path), "--reranker",
                              "llm", "--llm-url", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    message = str(exit_.value.code)
    assert "SYNAPSE_LLM_API_KEY" in message and "ключ" not in message and "\n" not in message


def test_one_llm_question_is_given_up_when_its_call_time_runs_out(engine, monkeypatch):
    """An endpoint that never answers held one routing request through every attempt's timeout
    and the backoff between them ((retries + 1) × timeout, twice that when the question was asked
    again without JSON mode): 60 s at the defaults. `call_seconds` bounds the whole question; the
    decision falls back to fusion, saying the call's time ran out, and get_llm gives the served
    router SYNAPSE_LLM_CALL_SECONDS."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from routing.llm import LLMUnavailable, get_llm

    stop = threading.Event()
    asked = []

    class Silent(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            asked.append(time.monotonic())
            stop.wait(10)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        llm = OpenAICompatibleLLM(url, retries=4, timeout=1.0, backoff=0.05, call_seconds=1.5)
        router = Router(_currency_compendium(False), engine, "llm", params=RoutingParams(), llm=llm)
        started = time.monotonic()
        decision = router.route("Convert 100 US dollars into euros")
        took = time.monotonic() - started
        assert took < 2.5, took  # five attempts of 1 s each before
        assert decision.reranker == "fusion" and decision.tool == "fx"
        assert "after 2 attempts" in decision.fallback_reason
        assert "SYNAPSE_LLM_CALL_SECONDS" in decision.fallback_reason

        monkeypatch.setenv("SYNAPSE_LLM_CALL_SECONDS", "7.5")
        assert get_llm(url).call_seconds == 7.5
        monkeypatch.setenv("SYNAPSE_LLM_CALL_SECONDS", "0")
        assert get_llm(url).call_seconds is None
        monkeypatch.delenv("SYNAPSE_LLM_CALL_SECONDS")
        assert get_llm(url).call_seconds == 20
        monkeypatch.setenv("SYNAPSE_LLM_CALL_SECONDS", "soon")
        with pytest.raises(LLMUnavailable, match="SYNAPSE_LLM_CALL_SECONDS must be a number"):
            get_llm(url)
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_tokenize_reads_words_of_any_script():
    """The lexical feature (the router's BM25, the BM25 baseline) split text on [a-z0-9] only: a
    request in Cyrillic, Greek or Chinese had no token at all (its BM25 feature 0 for every
    tool) and an accented word was cut in two. Letters and digits of any script now, lowercased;
    ASCII text tokenizes as before (an underscore still splits)."""
    from routing.router import tokenize

    assert tokenize("Погода в Москве завтра?") == ["погода", "в", "москве", "завтра"]
    assert tokenize("Réserve un café à Zürich") == ["réserve", "un", "café", "à", "zürich"]
    assert tokenize("天气 预报") == ["天气", "预报"]
    assert tokenize("Book 2 tickets via flight_api, ASAP!") == ["book", "2", "tickets", "via",
                                                               "flight", "api", "asap"]
    index = PoolBM25([tokenize(t) for t in ("прогноз погоды на завтра", "курс доллара сегодня",
                                            "перевести текст на английский")])
    scores = index.get_batch_scores(tokenize("Какой прогноз на завтра?"), [0, 1, 2])
    assert scores[0] > max(scores[1], scores[2]) and scores[1] == 0


@pytest.mark.parametrize("reranker", ["fusion", "none", "llm"])
def test_a_compendium_with_nothing_to_rank_names_no_reranker(engine, reranker):
    """With no scenario and no linear head nothing is ranked: the decision named the reranker it
    was asked for as the one that decided (`reranker` is "the one that decided"), though none
    did. It names none (None), and `fallback_reason` says why."""
    empty = Router(Compendium(scenarios=[]), engine, reranker, params=RoutingParams())
    for decision in [empty.route("Convert 100 US dollars into euros"), *empty.route_batch(["a", "b"])]:
        assert (decision.tool, decision.reranker, decision.fallback_reason) == (
            None, None, "no scenarios")


def test_scenarios_of_equal_cosine_are_taken_in_scenario_order_whatever_top_k(engine):
    """One text sent for two tools ties in cosine. Retrieval kept an arbitrary subset of the
    scenarios tied at the n-th score (argpartition), which depended on n, so the `none`
    reranker's five voting scenarios were a, a, a, b, b when 5 were asked to be shown and
    a x 5 when 20 were: the confidence went 0.88 -> 0.998 with `top_k`, which the decision does
    not depend on. Ties are now taken in scenario order (the lowest first) for every n."""
    text = "Convert 100 US dollars into euros"
    scenarios = ([Scenario(tool_id="recipes", text="Bake a chocolate cake for a birthday")] * 30
                 + [Scenario(tool_id="a", text=text)] * 30 + [Scenario(tool_id="b", text=text)] * 70)
    scores = np.r_[np.full(30, 0.5), np.full(100, 0.9)].astype(np.float32)
    for n in (1, 5, 20, 50, 129, 130, 500):
        assert top_n(scores, n)[0].tolist() == list(np.argsort(-scores, kind="stable")[:n]), n
    for reranker in ("none", "fusion"):
        router = Router(Compendium(scenarios=scenarios), engine, reranker, params=RoutingParams())
        shown = {k: router.route(text, k) for k in (1, 5, 20, 50)}
        assert len({(d.tool, d.confidence) for d in shown.values()}) == 1, reranker
        assert all(d.ranking == shown[1].ranking for d in shown.values()), reranker
        assert [c["tool"] for c in shown[50].candidates] == ["a"] * 30 + ["b"] * 20
        assert [c["tool"] for c in shown[5].candidates] == ["a"] * 5


def test_no_scenario_of_an_active_tool_is_not_said_to_be_no_active_tool(engine):
    """A global without scenarios routes by its linear head (tools the public probe set taught
    it) under fusion; under `none` nothing is ranked, and the README says why: "no scenarios".
    With one of the head's tools deactivated, `none` answered "no active tools" though the others
    are active (and fusion routes to them); that phrase is for every tool the global could name
    deactivated."""
    tools = ["calc", "fx", "weather"]
    head = LinearHead(tools, np.zeros((3, engine.dimension), dtype=np.float32),
                      np.array([0.0, 5.0, 0.0], dtype=np.float32))
    empty = Compendium(scenarios=[])
    for excluded in ((), ("calc",)):
        bare = Router(empty, engine, "none", params=RoutingParams(), head=head,
                      excluded_tools=excluded)
        decision = bare.route("Convert 100 US dollars into euros")
        assert (decision.tool, decision.reranker, decision.fallback_reason) == (
            None, None, "no scenarios"), excluded
        assert bare.with_reranker("fusion").route("Convert 100 US dollars").tool == "fx"
    # every tool deactivated: "no active tools" under either reranker
    for reranker in ("none", "fusion"):
        nothing = Router(empty, engine, reranker, params=RoutingParams(), head=head,
                         excluded_tools=tools).route("Convert 100 US dollars")
        assert (nothing.tool, nothing.fallback_reason) == (None, "no active tools"), reranker
    # scenarios of deactivated tools only, the head knowing active ones without scenarios:
    # `none` has nothing to rank among the active tools' (absent) scenarios
    some = Compendium(scenarios=[Scenario(tool_id="calc", text="Do math with numbers")])
    head2 = LinearHead(tools, np.zeros((3, engine.dimension), dtype=np.float32),
                       np.array([0.0, 5.0, 0.0], dtype=np.float32))
    bare = Router(some, engine, "none", params=RoutingParams(), head=head2, excluded_tools=["calc"])
    assert bare.route("Add 2 and 2").fallback_reason == "no scenarios"
    assert bare.with_reranker("fusion").route("Add 2 and 2").tool == "fx"
