"""Server-side routing: pgvector retrieval, parity with the client router, the API and latencies."""

from __future__ import annotations

import json

import numpy as np
import pytest
from django.db import connection
from django.test import Client as HttpClient

from compendium.models import CompendiumVersion
from compendium.services import import_registry, store_compendium
from federation.models import Client, Organization, Round
from routing import services
from routing.embeddings import get_query_engine
from routing.models import RoutingCall, RoutingToken
from routing.router import Router, ScenarioIndex
from tests.routing_data import published_global_data

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def _forget_published_version():
    # A test's rollback sends no delete signals: start each test without a remembered version.
    services.forget_published_version()


@pytest.fixture(scope="module")
def data():
    data = published_global_data(30, seed=3, test_fraction=0.2, max_per_tool=12)
    return {**data, "queries": [q.query for q in data["test"][:150]], "engine": get_query_engine()}


def _publish(data, number=1, state="published", with_client_copy=True):
    import_registry(data["tools"])
    round_ = Round.objects.create(number=number, state=state)
    if with_client_copy:
        # Another version's rows share the HNSW index: retrieval must filter them out and still
        # return k rows of the global version.
        org = Organization.objects.create(name=f"org{number}", slug=f"org{number}")
        client = Client.objects.create(organization=org, name="c", status="approved")
        store_compendium(
            data["compendium"], kind="client", round=round_, client=client,
            scenario_embeddings=data["embeddings"],
        )
    return store_compendium(
        data["compendium"], kind="global", round=round_, scenario_embeddings=data["embeddings"],
        routing_head=data["head"],
    )


def test_pgvector_retrieval_matches_brute_force_cosine(data, settings):
    settings.SYNAPSE_ROUTING_RETRIEVAL = "exact"
    version = _publish(data)
    served = services.served_compendium()
    assert served.version_id == version.pk and served.round_number == 1
    matrix = served.index.embeddings
    for vector in data["engine"].embed(data["queries"]):
        brute = matrix @ vector
        expected = np.argsort(-brute, kind="stable")[:5]
        idx, scores = served.retriever(vector, 5)
        assert len(idx) == 5
        assert np.allclose(scores, brute[idx], atol=1e-4)
        assert np.allclose(np.sort(brute[expected])[::-1], scores, atol=1e-4)
        assert list(idx) == list(expected) or np.allclose(brute[idx], brute[expected], atol=1e-5)
    idx, _ = served.retriever(data["engine"].embed_one(data["queries"][0]), 40)
    assert len(idx) == 40
    # The per-process cache serves the same object until a new version is published.
    assert services.served_compendium() is served


def test_hnsw_search_widens_when_other_versions_fill_the_index(data, settings):
    """With HNSW retrieval, six more versions share the index (the served one holds a seventh of
    it): the scan keeps proportionally more candidates (ef_search), and answers are complete."""
    settings.SYNAPSE_ROUTING_RETRIEVAL = "hnsw"
    _publish(data, number=1)
    for number in (2, 3):
        _publish(data, number=number, state="failed")
    version = _publish(data, number=4, with_client_copy=False)
    served = services.served_compendium()
    assert served.version_id == version.pk
    retriever = served.retriever
    assert retriever.mode == "hnsw"
    assert retriever.available * 4 <= retriever.indexed_rows + 4
    assert retriever.ef_search(20) >= 4 * 2 * 20
    matrix = served.index.embeddings
    for vector in data["engine"].embed(data["queries"]):
        idx, scores = retriever(vector, 20)
        assert len(idx) == 20  # HNSW, or the exact scan when the filtered scan came up short
        assert np.allclose(scores, matrix[idx] @ vector, atol=1e-4)
    with connection.cursor() as cursor:  # the scan kept enough candidates for this version,
        cursor.execute("SHOW hnsw.ef_search")  # for the 20 and the shortlist rescored beyond them
        assert int(cursor.fetchone()[0]) == retriever.ef_search(20 + ScenarioIndex.RESCORED_BEYOND)


@pytest.mark.parametrize("retrieval", ["memory", "exact"])
def test_client_router_and_server_pick_the_same_tool(data, settings, retrieval):
    settings.SYNAPSE_ROUTING_RETRIEVAL = retrieval
    _publish(data)
    # The client embeds the pulled scenarios with the engine that embedded the server's rows (the
    # CLI does the same); queries go through the query engine on both sides.
    client_router = Router(
        data["compendium"], data["engine"], "fusion", params=services.routing_params(),
        document_engine=data["documents"],
    ).with_linear_head(data["documents"].embed)
    assert services.served_compendium().routers["fusion"].head is not None
    assert client_router.head.tools == services.served_compendium().routers["fusion"].head.tools
    for query in data["queries"]:
        server = services.route_query(query, 5)
        local = client_router.route(query, 5)
        assert server["tool"] == local.tool
        assert server["confidence"] == pytest.approx(local.confidence, abs=1e-3)
        assert [c["tool"] for c in server["candidates"]] == [c["tool"] for c in local.candidates]
    batch = services.route_queries(data["queries"], 5)
    assert [r["tool"] for r in batch["results"]] == [client_router.route(q).tool for q in data["queries"]]


def test_a_global_without_a_stored_head_routes_without_one(data):
    version = _publish(data)
    assert services.served_compendium().routers["fusion"].head is not None
    with_head = services.route_query(data["queries"][0])
    # Published before heads existed (or the head is of other scenarios): served without it.
    CompendiumVersion.objects.filter(pk=version.pk).update(routing_head=None)
    services.forget_served()  # a version's build is kept for as long as it is served
    assert services.served_compendium().routers["fusion"].head is None
    plain = services.route_query(data["queries"][0])
    assert plain["tool"] and plain["candidates"] == with_head["candidates"]


def test_publication_fits_the_weights_and_tools_without_scenarios_stay_routable(
    data, settings, tmp_path
):
    """A global published with the public probe set: its head carries the fusion weights fitted
    with it, and the tools the global has no scenario of (here a third of them) are learnt from
    the probe's requests. The routing API and `synapse-client route` use those weights (unless the
    operator configured a file) and send such requests to those tools."""
    from federation.merge.summarize import ProbeSet
    from federation.pipeline import routing_head
    from routing.cli import pulled_router
    from routing.router import LinearHead, RoutingParams

    documents = data["documents"]
    tools = sorted({s.tool_id for s in data["compendium"].scenarios})
    missing = set(tools[::3])
    keep = [i for i, s in enumerate(data["compendium"].scenarios) if s.tool_id not in missing]
    partial = data["compendium"].model_copy(
        update={"scenarios": [data["compendium"].scenarios[i] for i in keep]}
    )
    vectors = data["embeddings"][keep]
    probe = data["probe_split"] + data["test"][150:]  # public labelled requests, not the queries
    probe_set = ProbeSet(
        [q.query for q in probe], [q.tool_id for q in probe], documents.embed([q.query for q in probe])
    )
    blob = routing_head(partial, vectors, documents.embed, probe_set)
    head = LinearHead.from_bytes(blob)
    assert head.tools == sorted(set(tools) - missing) + sorted(missing)
    assert head.params is not None and head.params.weights.unbacked != 0.0
    import_registry(data["tools"])
    round_ = Round.objects.create(number=1, state="published")
    store_compendium(
        partial, kind="global", round=round_, scenario_embeddings=vectors, routing_head=blob
    )
    served = services.served_compendium()
    assert served.routers["fusion"].params.weights == head.params.weights
    queries = data["test"][:150]
    answers = services.route_queries([q.query for q in queries], 5)["results"]
    right = [a["tool"] == q.tool_id for a, q in zip(answers, queries, strict=True)]
    of_missing = [r for r, q in zip(right, queries, strict=True) if q.tool_id in missing]
    assert of_missing and np.mean(of_missing) > 0.4
    # The client routes as the server does with the head it pulled (`OUT.head.npz`).
    head_path = tmp_path / "global.head.npz"
    head_path.write_bytes(blob)
    local = pulled_router(partial, head_path=head_path)
    assert local.params.weights == head.params.weights
    assert [local.route(q.query).tool for q in queries[:40]] == [a["tool"] for a in answers[:40]]
    # An operator's params file wins, on both sides.
    own = tmp_path / "params.json"
    RoutingParams().save(own)
    settings.SYNAPSE_ROUTING_PARAMS = str(own)
    services.forget_served()
    assert services.served_compendium().routers["fusion"].params.weights == RoutingParams().weights
    assert pulled_router(partial, head_path=head_path, params_path=str(own)).params.weights == (
        RoutingParams().weights
    )


@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_a_router_of_a_deleted_global_gives_way_to_the_current_one(data, settings, retrieval):
    """With pgvector retrieval, a process that still served an erased (deleted) global found
    none of its rows and answered 'no scenarios' until its version TTL ran out."""
    settings.SYNAPSE_ROUTING_RETRIEVAL = retrieval
    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600
    services.forget_served()
    first = _publish(data, number=1, with_client_copy=False)
    assert services.route_query(data["queries"][0])["compendium_round"] == 1
    second = _publish(data, number=2, with_client_copy=False)
    CompendiumVersion.objects.filter(pk=first.pk).delete()  # this process still serves round 1
    answer = services.route_query(data["queries"][0])
    assert answer["compendium_round"] == 2 and answer["tool"] and answer["candidates"]
    assert services.served_compendium().version_id == second.pk


def test_latest_published_round_is_served(data):
    _publish(data, number=1, with_client_copy=False)
    Round.objects.create(number=2, state="open")
    assert services.route_query(data["queries"][0])["compendium_round"] == 1


def _request_while_building(monkeypatch):
    """A request in a thread of its own that builds the served router slowly: the build starts
    (`building` is set) and waits for `release`. Returns the thread (not started), the routers it
    got, and the two events."""
    import threading

    building, release = threading.Event(), threading.Event()
    real_build = services.build_served

    def slow_build(version, tuned_directory=""):
        building.set()
        assert release.wait(30)
        return real_build(version, tuned_directory)

    monkeypatch.setattr(services, "build_served", slow_build)
    built = []

    def request():
        try:
            built.append(services.served_compendium())
        finally:
            connection.close()

    return threading.Thread(target=request), built, building, release


@pytest.mark.django_db(transaction=True)  # the building thread has its own connection
def test_a_switch_is_built_by_one_request_while_the_others_keep_routing(data, monkeypatch):
    _publish(data, number=1, with_client_copy=False)
    first = services.served_compendium()
    second_version = _publish(data, number=2, with_client_copy=False)
    services.forget_published_version()
    worker, built, building, release = _request_while_building(monkeypatch)
    worker.start()
    try:
        assert building.wait(30)
        # While round 2 is being built, another request is answered at once with round 1.
        assert services.served_compendium() is first
    finally:
        release.set()
        worker.join(30)
    assert built and built[0].version_id == second_version.pk
    assert services.served_compendium() is built[0]


@pytest.mark.django_db(transaction=True)  # the building thread has its own connection
def test_while_a_switch_is_built_no_request_routes_with_a_deleted_global(data, monkeypatch):
    """While one request built the router of the global that replaced an erased one, the others
    were answered at once with the erased global's router: its scenarios (an erased client's
    text) as candidates, until the build was done."""
    import threading

    _publish(data, number=1, with_client_copy=False)
    first = services.served_compendium()
    second = _publish(data, number=2, with_client_copy=False)
    CompendiumVersion.objects.filter(pk=first.version_id).delete()  # an erasure re-made it
    services.forget_published_version()
    real_lock = services._served_lock
    worker, built, building, release = _request_while_building(monkeypatch)

    class Lock:  # lets the build finish once this test's request waits for it
        def acquire(self, blocking=True):
            if blocking and threading.current_thread() is threading.main_thread():
                release.set()
            return real_lock.acquire(blocking)

        def release(self):
            real_lock.release()

    monkeypatch.setattr(services, "_served_lock", Lock())
    worker.start()
    try:
        assert building.wait(30)
        asked = services.served_compendium()  # while round 2 is being built
    finally:
        release.set()
        worker.join(30)
    assert asked.version_id == second.pk and built and asked is built[0]


def test_a_router_that_cannot_be_built_is_tried_again_later_not_by_every_request(
    data, monkeypatch, settings
):
    """A build that kept failing (a stored head that does not load, a model of another dimension)
    answered 500 to every request, each of them building again for seconds."""
    settings.SYNAPSE_ROUTING_REBUILD_SECONDS = 3600
    services.forget_served()
    _publish(data, number=1, with_client_copy=False)
    real_build, builds = services.build_served, []

    def broken(version, tuned_directory=""):
        builds.append(version.pk)
        raise ValueError("the stored routing head does not load")

    monkeypatch.setattr(services, "build_served", broken)
    # No router served before: a 503 naming why, and the build is not tried by the next request.
    for _ in range(2):
        with pytest.raises(services.RouterBuildFailed, match="does not load.*tried again within 3600 s"):
            services.served_compendium()
    assert len(builds) == 1
    _, raw = RoutingToken.issue("app")
    answer = _post(HttpClient(), "/api/v1/route/", {"query": data["queries"][0]}, raw)
    assert answer.status_code == 503 and "could not be built" in answer.json()["detail"]

    # Once it builds again, a failing switch to round 2 keeps serving round 1's router.
    monkeypatch.setattr(services, "build_served", real_build)
    services.forget_served()
    first = services.served_compendium()
    second = _publish(data, number=2, with_client_copy=False)
    services.forget_published_version()
    monkeypatch.setattr(services, "build_served", broken)
    assert services.served_compendium() is first and services.served_compendium() is first
    assert builds[-1] == second.pk and builds.count(second.pk) == 1

    # ... unless round 1's global is gone (an erasure deleted it): then it is a 503, not routing
    # with an erased client's scenarios.
    services.forget_served()
    monkeypatch.setattr(services, "build_served", real_build)
    services.forget_published_version()
    CompendiumVersion.objects.filter(pk=second.pk).delete()  # round 1 served again
    stale = services.served_compendium()
    assert stale.version_id == first.version_id
    CompendiumVersion.objects.filter(pk=first.version_id).delete()
    third = _publish(data, number=3, with_client_copy=False)
    services.forget_published_version()
    monkeypatch.setattr(services, "build_served", broken)
    with pytest.raises(services.RouterBuildFailed):
        services.served_compendium()
    # After SYNAPSE_ROUTING_REBUILD_SECONDS it is built again.
    settings.SYNAPSE_ROUTING_REBUILD_SECONDS = 0
    monkeypatch.setattr(services, "build_served", real_build)
    assert services.served_compendium().version_id == third.pk


def test_why_a_router_could_not_be_built_is_the_operators_alone(data, monkeypatch, settings):
    """A failed build answered every caller of the routing API (an application's routing token,
    a client, any person) with the exception's text: a database's host and user, a server path.
    As for a failed tuning (`federation.tuning.downloadable_router`), only the operator reads why;
    the others are told the router could not be built and when it is tried again."""
    from django.contrib.auth.models import User

    settings.SYNAPSE_ROUTING_REBUILD_SECONDS = 3600
    services.forget_served()
    _publish(data, number=1, with_client_copy=False)
    secret = "connection to db.internal:5432 failed for user synapse"

    def broken(version, tuned_directory=""):
        raise OSError(secret)

    monkeypatch.setattr(services, "build_served", broken)
    _, raw = RoutingToken.issue("app")
    http = HttpClient()
    for path, body in (("/api/v1/route/", {"query": "hello"}),
                       ("/api/v1/route/batch/", {"queries": ["hello"]})):
        answer = _post(http, path, body, raw)
        assert answer.status_code == 503, answer.content
        detail = answer.json()["detail"]
        assert "could not be built" in detail and "tried again within 3600 s" in detail, detail
        assert "db.internal" not in detail and "OSError" not in detail, detail
    member = HttpClient()
    member.force_login(User.objects.create_user("member", password="pw-long-enough-1"))
    assert "db.internal" not in _post(member, "/api/v1/route/", {"query": "hello"}).json()["detail"]
    operator = HttpClient()
    operator.force_login(User.objects.create_superuser("op", password="pw-long-enough-1"))
    shown = _post(operator, "/api/v1/route/", {"query": "hello"})
    assert shown.status_code == 503 and secret in shown.json()["detail"]


@pytest.mark.django_db(transaction=True)  # the warm-up thread has its own connection
def test_a_worker_warms_its_router_before_the_first_request(data):
    """gunicorn.conf.py starts routing.services.warm_up in a thread of each new worker."""
    import threading

    results = []

    def warm():
        results.append(services.warm_up())

    def in_a_thread():
        thread = threading.Thread(target=warm)
        thread.start()
        thread.join(120)

    services.forget_served()  # what earlier tests built in this process
    in_a_thread()
    assert results == [False] and not services._served  # nothing published: nothing to warm
    _publish(data, number=1, with_client_copy=False)
    services.forget_published_version()
    in_a_thread()
    assert results[-1] is True and len(services._served) == 1
    assert services.served_compendium() is next(iter(services._served.values()))


@pytest.fixture
def api():
    token, raw = RoutingToken.issue("app")
    return HttpClient(), raw, token


def _post(http, path, body, raw=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
    return http.post(path, body, content_type="application/json", **headers)


def test_route_api_authentication(data, api):
    http, raw, token = api
    _publish(data, with_client_copy=False)
    assert _post(http, "/api/v1/route/", {"query": "hello"}).status_code == 401
    assert _post(http, "/api/v1/route/", {"query": "hello"}, "rt_wrong").status_code == 401
    ok = _post(http, "/api/v1/route/", {"query": data["queries"][0], "top_k": 3}, raw)
    assert ok.status_code == 200, ok.content
    body = ok.json()
    assert set(body) >= {
        "tool", "confidence", "escalate", "candidates", "precautions", "template",
        "compendium_round", "latency_ms",
    }
    assert len(body["candidates"]) == 3 and body["compendium_round"] == 1
    assert set(body["candidates"][0]) == {"tool", "scenario", "score"}
    assert body["template"] and 0.0 <= body["confidence"] <= 1.0
    token_alt = http.post(
        "/api/v1/route/", {"query": "hi there"}, content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {raw}",
    )
    assert token_alt.status_code == 200
    token.revoked = True
    token.save()
    assert _post(http, "/api/v1/route/", {"query": "hello"}, raw).status_code == 401
    # A signed-in operator may route from the browser (session authentication).
    from django.contrib.auth.models import User

    http.force_login(User.objects.create_user("op", password="pw-long-enough-1"))
    assert _post(http, "/api/v1/route/", {"query": "hello"}).status_code == 200


def test_a_routing_token_elsewhere_is_told_it_only_routes(data, api):
    """An application's live routing token on the federation's endpoints (the global, its head,
    the tuned router's manifest) was answered 401 "invalid token", the words for a wrong or
    revoked one, though it routes: 403 now says what it may do. A revoked one stays 401."""
    http, raw, token = api
    _publish(data, with_client_copy=False)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    for path in ("/api/v1/compendium/global/", "/api/v1/compendium/global/head/",
                 "/api/v1/compendium/global/router/", "/api/v1/rounds/"):
        response = http.get(path, **auth)
        assert response.status_code == 403, (path, response.content)
        assert "routing token" in response.json()["detail"], path
        assert "/api/v1/route/" in response.json()["detail"], path
    assert _post(http, "/api/v1/route/", {"query": data["queries"][0]}, raw).status_code == 200
    token.revoked = True
    token.save()
    assert http.get("/api/v1/compendium/global/", **auth).status_code == 401
    assert _post(http, "/api/v1/route/", {"query": "hello"}, raw).status_code == 401


def test_route_api_bad_input_is_400_naming_the_problem(data, api, settings):
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    settings.SYNAPSE_MAX_QUERY_CHARS = 50
    cases = [
        ({"query": ""}, "query is empty"),
        ({"query": "   "}, "query is empty"),
        ({"query": "x" * 51}, "too long"),
        ({"query": 5}, "must be a string"),
        ({}, "query is required"),
        ({"query": "ok", "top_k": 0}, "top_k"),
        ({"query": "ok", "top_k": "5"}, "top_k"),
        ({"query": "ok", "reranker": "magic"}, "reranker"),
    ]
    for body, message in cases:
        response = _post(http, "/api/v1/route/", body, raw)
        assert response.status_code == 400, body
        assert message in response.json()["detail"], (body, response.json())
    response = http.post(
        "/api/v1/route/", "{nope", content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["detail"]
    for body, message in [
        ({"queries": []}, "non-empty list"),
        ({"queries": "abc"}, "non-empty list"),
        ({"queries": ["fine", ""]}, "queries[1] is empty"),
    ]:
        response = _post(http, "/api/v1/route/batch/", body, raw)
        assert response.status_code == 400 and message in response.json()["detail"]
    settings.SYNAPSE_MAX_ROUTE_BATCH = 2
    response = _post(http, "/api/v1/route/batch/", {"queries": ["a", "b", "c"]}, raw)
    assert response.status_code == 400 and "too many queries" in response.json()["detail"]


def test_a_query_of_nothing_but_control_or_format_characters_is_empty(data, api):
    """A query of NULs, other control characters or zero-width ones holds no text, like one of
    spaces (400 "is empty"); it was routed, to whichever tool the empty string lies nearest
    (the same tool for each), as a decision like any other."""
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    for query in ("\x00", "\x00\x01 \x7f\n", "\u200b\ufeff", "\u200d \x1b"):
        response = _post(http, "/api/v1/route/", {"query": query}, raw)
        assert response.status_code == 400, (query, response.content)
        detail = response.json()["detail"]
        assert detail.startswith("query is empty: ") and "control or format" in detail, detail
        batch = _post(http, "/api/v1/route/batch/", {"queries": [data["queries"][0], query]}, raw)
        assert batch.status_code == 400 and batch.json()["detail"].startswith("queries[1] is empty")
    # text around such characters is routed as before
    for query in ("\x00hello\x00", "\u200bweather in Paris", "😀"):
        assert _post(http, "/api/v1/route/", {"query": query}, raw).status_code == 200, query


def test_route_api_refuses_unknown_fields_naming_them(data, api):
    # A misspelt option was routed without it, in silence: {"topk": 1} answered five candidates.
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    query = data["queries"][0]
    for path, body, message in [
        ("/api/v1/route/", {"query": query, "topk": 1},
         "unknown field 'topk': the body takes query, top_k, reranker"),
        ("/api/v1/route/", {"query": query, "queries": [query]}, "unknown field 'queries'"),
        ("/api/v1/route/batch/", {"queries": [query], "rerank": "none"},
         "unknown field 'rerank': the body takes queries, top_k, reranker"),
        ("/api/v1/route/batch/", {"queries": [query], **{f"f{i}": 1 for i in range(7)}},
         "unknown field 'f0', 'f1', 'f2', 'f3', 'f4' and 2 more"),
    ]:
        response = _post(http, path, body, raw)
        assert response.status_code == 400, (body, response.content)
        assert message in response.json()["detail"]
    assert _post(http, "/api/v1/route/", {"query": query, "top_k": 1, "reranker": "none"},
                 raw).status_code == 200


def test_route_api_takes_json_only_and_its_document_says_so(data, api):
    # A form was parsed too, though its values are all strings: top_k=3 was refused as "must be
    # an integer", and a form's repeated `queries` read as its last one; the API document offered
    # both form encodings for these operations.
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    for path, form in (("/api/v1/route/", "query=hello&top_k=3"),
                       ("/api/v1/route/batch/", "queries=a&queries=b")):
        response = http.generic("POST", path, form.encode(),
                                content_type="application/x-www-form-urlencoded", **auth)
        assert response.status_code == 415, response.content
        assert "application/x-www-form-urlencoded" in response.json()["detail"]
    multipart = http.post("/api/v1/route/", {"query": "hello"}, **auth)  # the test client's form
    assert multipart.status_code == 415 and "multipart/form-data" in multipart.json()["detail"]
    from drf_spectacular.generators import SchemaGenerator

    paths = SchemaGenerator().get_schema(request=None, public=True)["paths"]
    for path in ("/api/v1/route/", "/api/v1/route/batch/"):
        operation = paths[path]["post"]
        assert list(operation["requestBody"]["content"]) == ["application/json"], path
        assert "415" in operation["responses"], path


def test_a_chunked_body_without_content_length_is_411_not_a_missing_query(data, api):
    """A body sent chunked (Transfer-Encoding, no Content-Length: streaming HTTP clients do) is
    read by Django as empty: the routing API answered 400 "query is required" for a request that
    held one. It is a 411 saying to send the length, as a submission's is; the document says so."""
    from django.test import RequestFactory

    from routing.api import RouteBatchView, RouteView

    _, raw, _ = api
    _publish(data, with_client_copy=False)
    for view, path, body in ((RouteView, "/api/v1/route/", {"query": data["queries"][0]}),
                             (RouteBatchView, "/api/v1/route/batch/", {"queries": data["queries"][:2]})):
        request = RequestFactory().post(path, json.dumps(body), content_type="application/json",
                                        HTTP_AUTHORIZATION=f"Bearer {raw}")
        del request.META["CONTENT_LENGTH"]  # as a chunked body arrives
        request.META["HTTP_TRANSFER_ENCODING"] = "chunked"
        response = view.as_view()(request)
        assert response.status_code == 411, (path, response.data)
        assert "Content-Length" in response.data["detail"], response.data
    from drf_spectacular.generators import SchemaGenerator

    paths = SchemaGenerator().get_schema(request=None, public=True)["paths"]
    for path in ("/api/v1/route/", "/api/v1/route/batch/"):
        assert "411" in paths[path]["post"]["responses"], path


def test_a_body_over_the_request_limit_is_a_json_413_with_debug_on(data, api, settings):
    """The README's 413 (JSON, naming the limit) holds with DEBUG on, the default configuration
    (`runserver`, where client developers try the API): before, handler400 made it only with
    DEBUG off, and with DEBUG on a routing batch past the limit got Django's HTML debug page,
    status 400."""
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    settings.DEBUG = True
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps({"queries": ["天" * 500] * 4})  # ascii-escaped: 12,000+ bytes
    response = _post(http, "/api/v1/route/batch/", body, raw)
    assert response.status_code == 413, response.content[:200]
    assert response["Content-Type"].startswith("application/json")
    assert "10000 bytes" in response.json()["detail"]


def test_a_body_over_the_request_limit_is_a_json_413(data, api, settings):
    """A batch body past DATA_UPLOAD_MAX_MEMORY_SIZE (escaped non-Latin text is six bytes a
    character) is a JSON 413 naming the limit, not Django's HTML 400 page."""
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps({"queries": ["天" * 500] * 4})  # ascii-escaped: 12,000+ bytes
    response = _post(http, "/api/v1/route/batch/", body, raw)
    assert response.status_code == 413, response.content
    assert response["Content-Type"].startswith("application/json")
    assert "10000 bytes" in response.json()["detail"]
    # Elsewhere under /api/ too: a person's request past the limit answers JSON.
    from django.contrib.auth.models import User

    http.force_login(User.objects.create_superuser("op", password="pw-long-enough-1"))
    other = http.post("/api/v1/admin/organizations/", json.dumps({"name": "x" * 20_000}),
                      content_type="application/json")
    assert other.status_code == 413 and other["Content-Type"].startswith("application/json")
    assert "10000 bytes" in other.json()["detail"]
    # and the OpenAPI document says so for both routing operations (it listed no 413)
    from drf_spectacular.generators import SchemaGenerator

    paths = SchemaGenerator().get_schema(request=None, public=True)["paths"]
    for path in ("/api/v1/route/", "/api/v1/route/batch/"):
        assert "413" in paths[path]["post"]["responses"], path


def test_an_llm_that_cannot_be_loaded_leaves_routing_up_and_says_why(data, api, settings, monkeypatch):
    http, raw, _ = api
    monkeypatch.setenv("SYNAPSE_LLM_GGUF", "/nonexistent/model.gguf")
    settings.SYNAPSE_LLM_BASE_URL = ""
    _publish(data, with_client_copy=False)
    services.recorder.flush()
    RoutingCall.objects.all().delete()
    fused = _post(http, "/api/v1/route/", {"query": data["queries"][0]}, raw)
    assert fused.status_code == 200, fused.content
    asked = _post(http, "/api/v1/route/", {"query": data["queries"][0], "reranker": "llm"}, raw)
    assert asked.status_code == 200, asked.content
    body = asked.json()
    assert body["reranker"] == "fusion" and body["tool"] == fused.json()["tool"]
    # (llama-cpp-python missing, or the file: either way the kind of failure is said; the file's
    # path, the server's insides, only to the operator)
    assert "the configured LLM could not be loaded (the operator's routing page says why)" \
        in body["fallback_reason"]
    assert "nonexistent" not in body["fallback_reason"]
    # the traffic figures count the call under the reranker that decided it, and a batch of one
    # query as a batch
    _post(http, "/api/v1/route/batch/", {"queries": data["queries"][:1], "reranker": "llm"}, raw)
    services.recorder.flush()
    assert sorted(RoutingCall.objects.values_list("reranker", "batch", "queries")) == [
        ("fusion", False, 1), ("fusion", False, 1), ("fusion", True, 1)]
    # the operator reads the whole reason
    from django.contrib.auth import get_user_model

    http.force_login(get_user_model().objects.create_superuser("root", "root@example.org", "pw"))
    told = _post(http, "/api/v1/route/", {"query": data["queries"][0], "reranker": "llm"}).json()
    assert "the configured LLM could not be loaded: " in told["fallback_reason"]


class _CountingLLM:
    """An LLM that answers "1", or is down (LLMUnavailable); each call moves `clock` on by
    `seconds` (what a call costs, without waiting for it)."""

    name = "counting"

    def __init__(self, down: bool = False, seconds: float = 0.0):
        self.down, self.seconds, self.calls, self.now = down, seconds, 0, 0.0

    def clock(self) -> float:
        return self.now

    def complete(self, prompt, **kwargs):
        from routing.llm import LLMUnavailable

        self.calls += 1
        self.now += self.seconds
        if self.down:
            raise LLMUnavailable("LLM endpoint http://llm:8000/v1 is down: ConnectError after 3 attempts")
        return "1"


def test_an_llm_batch_stops_calling_a_down_llm(data, api, monkeypatch):
    http, raw, _ = api
    down = _CountingLLM(down=True)
    monkeypatch.setattr(services, "served_llm", lambda: down)
    _publish(data, with_client_copy=False)
    queries = data["queries"][:6]
    batch = _post(http, "/api/v1/route/batch/", {"queries": queries, "reranker": "llm"}, raw).json()
    assert down.calls == 1, "a down LLM is asked once a batch, not once a query"
    reasons = [r["fallback_reason"] for r in batch["results"]]
    # a routing token reads what happened, not the endpoint's URL (the operator's to read)
    assert "the LLM endpoint gave no usable answer (the operator's routing page says why)" in reasons[0]
    assert all("unavailable earlier in this batch: the LLM endpoint gave no usable answer" in r
               for r in reasons[1:])
    assert not any("http://llm:8000" in r for r in reasons)
    assert {r["reranker"] for r in batch["results"]} == {"fusion"}

    up = _CountingLLM()
    monkeypatch.setattr(services, "served_llm", lambda: up)
    services.forget_served()
    batch = _post(http, "/api/v1/route/batch/", {"queries": queries, "reranker": "llm"}, raw).json()
    assert up.calls == len(queries) and {r["reranker"] for r in batch["results"]} == {"llm"}


class _GatewayDownLLM:
    """An LLM whose failure names the server's insides (a host, a port, a gateway's error text)
    in words that hold no URL, no file name, and that mention a time budget; it gives no
    public wording of its own."""

    name = "gateway"
    detail = ("connection refused by inference-box-7 port 8000 (the gateway's time budget of "
              "5 s for this client is spent)")

    def __init__(self):
        self.calls = 0

    def complete(self, prompt, **kwargs):
        from routing.llm import LLMUnavailable

        self.calls += 1
        raise LLMUnavailable(self.detail)


def test_why_an_llm_failed_reaches_no_caller_but_the_operator_whatever_its_words(
    data, api, monkeypatch
):
    """What a routing token, a member and the playground read was worked out by parsing the
    reason's text: a failure whose text mentioned a time budget and held no "://" was taken
    for the batch's own budget and shown whole (here a host and port of the server's network).
    The public wording now comes with the failure, and one that brings none reads as a generic
    failure of the endpoint, on the single and the batch route and on the playground alike."""
    from django.contrib.auth.models import User
    from django.urls import reverse

    http, raw, _ = api
    down = _GatewayDownLLM()
    monkeypatch.setattr(services, "served_llm", lambda: down)
    services.forget_served()
    _publish(data, with_client_copy=False)
    query, queries = data["queries"][0], data["queries"][:3]
    public = ("LLM answer unusable (LLM unavailable: the LLM endpoint gave no usable answer "
              "(the operator's routing page says why)); fell back to fusion")
    again = ("LLM answer unusable (LLM unavailable: unavailable earlier in this batch: the LLM "
             "endpoint gave no usable answer (the operator's routing page says why)); fell back "
             "to fusion")

    one = _post(http, "/api/v1/route/", {"query": query, "reranker": "llm"}, raw).json()
    assert (one["reranker"], one["fallback_reason"]) == ("fusion", public)
    batch = _post(http, "/api/v1/route/batch/", {"queries": queries, "reranker": "llm"}, raw).json()
    assert [r["fallback_reason"] for r in batch["results"]] == [public, again, again]

    member = HttpClient()
    member.force_login(User.objects.create_user("member", password="pw-long-enough-1"))
    told = _post(member, "/api/v1/route/", {"query": query, "reranker": "llm"}).json()
    assert told["fallback_reason"] == public
    page = member.get(reverse("dashboard:routing"), {"q": query, "reranker": "llm"})
    assert page.status_code == 200 and "the LLM endpoint gave no usable answer" in page.content.decode()
    assert "inference-box-7" not in page.content.decode()

    operator = HttpClient()
    operator.force_login(User.objects.create_superuser("op", password="pw-long-enough-1"))
    full = _post(operator, "/api/v1/route/", {"query": query, "reranker": "llm"}).json()
    assert full["fallback_reason"] == f"LLM answer unusable (LLM unavailable: {down.detail}); fell back to fusion"
    batch = _post(operator, "/api/v1/route/batch/", {"queries": queries, "reranker": "llm"}).json()
    assert [r["fallback_reason"] for r in batch["results"]][1] == (
        f"LLM answer unusable (LLM unavailable: unavailable earlier in this batch ({down.detail})); "
        "fell back to fusion")
    page = operator.get(reverse("dashboard:routing"), {"q": query, "reranker": "llm"})
    assert page.status_code == 200 and "inference-box-7 port 8000" in page.content.decode()


def test_an_llm_batch_keeps_to_its_time_budget():
    """Once the batch's calls took its budget, the rest are refused at once (each query then
    falls back to fusion with this reason); a new batch has a budget of its own."""
    from routing.llm import BudgetedLLM, LLMUnavailable

    slow = _CountingLLM(seconds=20.0)
    batch = BudgetedLLM(slow, 30.0, clock=slow.clock)
    assert batch.complete("a") == "1" and batch.complete("b") == "1"  # 0 s, then 20 s spent
    with pytest.raises(LLMUnavailable, match=r"time budget of 30 s \(SYNAPSE_LLM_BATCH_SECONDS\) is spent"):
        batch.complete("c")  # 40 s spent
    assert slow.calls == 2
    assert BudgetedLLM(slow, 30.0, clock=slow.clock).complete("d") == "1"


def test_route_api_503_until_something_is_published(data, api):
    http, raw, _ = api
    response = _post(http, "/api/v1/route/", {"query": "hello"}, raw)
    assert response.status_code == 503 and "no global compendium is published" in response.json()["detail"]
    _publish(data, state="merging", with_client_copy=False)
    assert _post(http, "/api/v1/route/", {"query": "hello"}, raw).status_code == 503


def test_batch_api_and_latency_summary(data, api):
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    services.recorder.flush()
    RoutingCall.objects.all().delete()
    response = _post(http, "/api/v1/route/batch/", {"queries": data["queries"][:10], "top_k": 2}, raw)
    assert response.status_code == 200
    results = response.json()["results"]
    assert len(results) == 10 and all(len(r["candidates"]) == 2 for r in results)
    for query in data["queries"][:4]:
        assert _post(http, "/api/v1/route/", {"query": query}, raw).status_code == 200
    summary = services.routing_latency()
    assert summary["calls"] == 5
    assert 0 < summary["p50_ms"] <= summary["p95_ms"]
    assert RoutingCall.objects.filter(queries=10).count() == 1



@pytest.mark.parametrize("retrieval", ["memory", "exact"])  # hnsw is approximate
def test_a_query_gets_the_same_answer_alone_and_in_a_batch(data, api, settings, retrieval):
    """POST /api/v1/route/ and /api/v1/route/batch/ answered the same query with other scores
    in the last digits and at times another confidence (the batch's one matrix product sums in
    another order than one query's; with pgvector retrieval, pgvector's float32 distances)."""
    settings.SYNAPSE_ROUTING_RETRIEVAL = retrieval
    services.forget_served()
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    queries = data["queries"][:30]
    response = _post(http, "/api/v1/route/batch/", {"queries": queries, "top_k": 10}, raw)
    assert response.status_code == 200, response.content
    for query, in_batch in zip(queries, response.json()["results"], strict=True):
        alone = _post(http, "/api/v1/route/", {"query": query, "top_k": 10}, raw).json()
        del alone["latency_ms"], in_batch["latency_ms"]
        assert alone == in_batch, query


def test_route_api_accepts_a_federation_client_token(data, api):
    """An approved client's own API token routes too (the federation's token scheme)."""
    from federation.services import Actor, approve_client, create_organization, enroll_client

    http = api[0]
    _publish(data, with_client_copy=False)
    org = create_organization(Actor(None), name="Route Org", slug="route-org")
    client = enroll_client(Actor(None), org, name="router-client")
    token = approve_client(Actor(None), client).token
    response = _post(http, "/api/v1/route/", {"query": data["queries"][0]}, token)
    assert response.status_code == 200, response.content
    assert response.json()["tool"]


def test_route_api_rate_limits_each_caller_by_queries_a_minute(data, api, settings):
    """SYNAPSE_ROUTE_RATE_LIMIT: each caller's queries a minute, a batch counting each query; a
    refused request is refused whole (429, Retry-After) and counts nothing; another caller keeps its
    own allowance; a batch larger than the allowance is bad input; invalid input counts nothing."""
    from federation.models import RateCounter

    http, raw, token = api
    _publish(data, with_client_copy=False)
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 5
    queries = data["queries"]
    assert _post(http, "/api/v1/route/batch/", {"queries": queries[:3]}, raw).status_code == 200
    assert _post(http, "/api/v1/route/", {"query": ""}, raw).status_code == 400  # not counted
    assert _post(http, "/api/v1/route/", {"query": queries[3]}, raw).status_code == 200
    refused = _post(http, "/api/v1/route/batch/", {"queries": queries[4:6]}, raw)
    assert refused.status_code == 429, refused.content
    assert "4 of its 5 queries a minute" in refused.json()["detail"]
    assert "SYNAPSE_ROUTE_RATE_LIMIT" in refused.json()["detail"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    # The refused batch took nothing: one query still fits, then nothing does.
    assert _post(http, "/api/v1/route/", {"query": queries[4]}, raw).status_code == 200
    assert _post(http, "/api/v1/route/", {"query": queries[5]}, raw).status_code == 429
    assert RateCounter.objects.get(key=f"route:routing-token:{token.pk}").count == 5
    # Another routing token has its own allowance; a batch over the whole allowance is a 400.
    _other, other_raw = RoutingToken.issue("other-app")
    assert _post(http, "/api/v1/route/", {"query": queries[0]}, other_raw).status_code == 200
    too_big = _post(http, "/api/v1/route/batch/", {"queries": queries[:6]}, other_raw)
    assert too_big.status_code == 400 and "at most 5 at a time" in too_big.json()["detail"]
    # 0 turns the limit off.
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 0
    assert _post(http, "/api/v1/route/", {"query": queries[6]}, raw).status_code == 200


def test_the_playground_does_not_claim_a_tuned_router_that_cannot_be_used(data, api, tmp_path):
    """A tuned router whose row is ready but whose folder is lost or damaged is not used: the
    API routes with the frozen model (`tuned_router: false`). The playground, on the same page
    as that decision, said the global "is routed with an encoder fine-tuned on it", from the
    row alone."""
    from django.contrib.auth.models import User
    from django.urls import reverse

    from routing.models import TunedRouter

    http, raw, _ = api
    version = _publish(data, with_client_copy=False)
    TunedRouter.objects.create(version=version, state="ready", epochs=1, rows=10, seconds=1.0,
                               directory=str(tmp_path / "lost"), probe_accuracy=1.0,
                               frozen_probe_accuracy=1.0)
    services.forget_published_version()
    query = data["queries"][0]
    assert _post(http, "/api/v1/route/", {"query": query}, raw).json()["tuned_router"] is False
    http.force_login(User.objects.create_user("member", password="pw-long-enough-1"))
    for params in ({"q": query}, {}):  # with a decision shown, and without
        body = http.get(reverse("dashboard:routing"), params).content.decode()
        encoder = body[body.index('id="router-tuning"'):]
        encoder = encoder[: encoder.index("</section>")]
        assert "routed with an encoder fine-tuned on it" not in encoder, params
        assert "routed with the frozen MiniLM" in encoder and "could not be used" in encoder


def test_the_playground_counts_against_the_persons_rate_limit(data, api, settings):
    """A person's routing allowance covers their API tokens and browser session together
    (README), yet the routing playground, a GET in that same session, routed without counting:
    a member could route without limit, with the LLM reranker too, by asking the page instead of
    the API. It counts now, and past the allowance answers 429 with Retry-After."""
    from django.contrib.auth.models import User
    from django.urls import reverse

    http, _, _ = api
    _publish(data, with_client_copy=False)
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 3
    queries = data["queries"]
    http.force_login(User.objects.create_user("member", password="pw-long-enough-1"))
    page = reverse("dashboard:routing")
    assert http.get(page, {"q": queries[0]}).status_code == 200
    assert http.get(page, {"q": "", "top_k": "2"}).status_code == 200  # no query: nothing routed
    assert http.get(page, {"q": queries[1], "top_k": "0"}).status_code == 400  # counts nothing
    assert _post(http, "/api/v1/route/batch/", {"queries": queries[2:4]}).status_code == 200
    refused = http.get(page, {"q": queries[4]})
    assert refused.status_code == 429, refused.status_code
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert "SYNAPSE_ROUTE_RATE_LIMIT" in refused.content.decode()
    assert _post(http, "/api/v1/route/", {"query": queries[4]}).status_code == 429


def test_a_503_before_anything_is_published_counts_nothing_against_the_rate(data, api, settings):
    """A caller routes SYNAPSE_ROUTE_RATE_LIMIT queries a minute: one answered 503 (nothing
    published yet, so nothing routed) is no query routed, and an application that called while
    waiting for the first publication may route as soon as it is published."""
    from federation.models import RateCounter

    http, raw, token = api
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 2
    for body, path in [({"query": "hello"}, "/api/v1/route/")] * 2 + [
        ({"queries": ["a", "b"]}, "/api/v1/route/batch/")
    ]:
        assert _post(http, path, body, raw).status_code == 503
    assert not RateCounter.objects.filter(key=f"route:routing-token:{token.pk}", count__gt=0).exists()
    _publish(data, with_client_copy=False)
    services.forget_published_version()
    assert _post(http, "/api/v1/route/", {"query": data["queries"][0]}, raw).status_code == 200
    assert _post(http, "/api/v1/route/batch/", {"queries": data["queries"][1:3]}, raw).status_code == 429


def test_a_query_answered_503_when_its_global_vanished_counts_nothing(data, api, settings):
    """With pgvector retrieval, a process that still serves a global another process's erasure
    took away (the only one) finds none of its rows and asks for the current global: there is
    none, a 503. The query had been counted against the caller's allowance all the same, though
    a refused request counts nothing (README)."""
    from federation.models import RateCounter

    http, raw, token = api
    settings.SYNAPSE_ROUTING_RETRIEVAL = "exact"
    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 5
    services.forget_served()
    version = _publish(data, with_client_copy=False)
    assert _post(http, "/api/v1/route/", {"query": data["queries"][0]}, raw).status_code == 200
    with connection.cursor() as cursor:  # as another process's erasure: no signal here
        cursor.execute("DELETE FROM compendium_scenarioentry WHERE version_id = %s", [version.pk])
        cursor.execute("UPDATE federation_round SET state = 'failed' WHERE id = %s",
                       [version.round_id])
    gone = _post(http, "/api/v1/route/", {"query": data["queries"][1]}, raw)
    assert gone.status_code == 503, gone.content
    assert RateCounter.objects.get(key=f"route:routing-token:{token.pk}").count == 1


def test_rate_limit_windows_and_callers(db):
    """`admit` counts per caller and minute; the next minute starts afresh; people, clients and
    routing tokens are told apart."""
    from types import SimpleNamespace

    from django.test import override_settings

    with override_settings(SYNAPSE_ROUTE_RATE_LIMIT=2):
        services.admit("user:1", 2, now=120.0)
        with pytest.raises(services.RateLimited) as refused:
            services.admit("user:1", 1, now=150.0)
        assert refused.value.retry_after == 30
        services.admit("user:2", 2, now=150.0)
        services.admit("user:1", 2, now=180.0)
    assert services.caller_key(SimpleNamespace(token=SimpleNamespace(pk=7))) == "routing-token:7"
    assert services.caller_key(SimpleNamespace(client=SimpleNamespace(pk=8))) == "client:8"
    assert services.caller_key(SimpleNamespace(pk=9)) == "user:9"


def test_the_api_document_gives_top_k_its_range():
    """top_k is 1 to 50 (a 51 is a 400), but the API document gave it no maximum: a client
    generated from it, or checked against it, sent 51 as valid."""
    from drf_spectacular.generators import SchemaGenerator

    schemas = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    for name in ("RouteRequest", "RouteBatchRequest"):
        top_k = schemas[name]["properties"]["top_k"]
        assert (top_k["minimum"], top_k.get("maximum")) == (1, 50), name
    with pytest.raises(services.RoutingInputError, match="between 1 and 50"):
        services.validate_top_k(51)


def test_the_api_document_gives_queries_their_limits(settings):
    """A query is at most SYNAPSE_MAX_QUERY_CHARS characters and a batch at most
    SYNAPSE_MAX_ROUTE_BATCH queries (longer or more: a 400), but the API document gave neither
    bound: a client generated from it, or checked against it, sent them as valid."""
    from drf_spectacular.generators import SchemaGenerator

    schemas = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    chars, batch = settings.SYNAPSE_MAX_QUERY_CHARS, settings.SYNAPSE_MAX_ROUTE_BATCH
    assert schemas["RouteRequest"]["properties"]["query"].get("maxLength") == chars
    queries = schemas["RouteBatchRequest"]["properties"]["queries"]
    assert (queries.get("minItems"), queries.get("maxItems")) == (1, batch)
    assert queries["items"].get("maxLength") == chars


def test_why_an_llm_fell_back_is_told_in_full_to_the_operator_only():
    """A routing answer's fallback_reason quoted why the LLM was unavailable: the endpoint's
    URL, a model file's path, the endpoint's error text, to any caller (a routing token). Every
    other caller reads the decision's public reason, set with it where the failure was raised
    (tests/test_router.py: each kind); the operator (reveal) all of it. Neither is worked out
    from the other's text: a public reason is shown as it is, whatever the full one says, and
    a fallback that came without one shows a generic line, never the full reason."""
    from routing.router import RoutingDecision

    down = ("LLM answer unusable (LLM unavailable: LLM endpoint http://10.0.0.7:8080/v1 is down: "
            "HTTP 502 after 3 attempts; check the endpoint's URL); fell back to fusion")
    public = ("LLM answer unusable (LLM unavailable: the LLM endpoint gave no usable answer (the "
              "operator's routing page says why)); fell back to fusion")
    decision = RoutingDecision("t", 0.5, False, fallback_reason=down, public_fallback_reason=public)
    assert services.shown_fallback_reason(decision, reveal=True) == down
    assert services.shown_fallback_reason(decision, reveal=False) == public
    # a full reason that reads like the batch's own budget is not taken for it
    budget = ("LLM answer unusable (LLM unavailable: gateway box-7:8000 time budget spent); "
              "fell back to fusion")
    decision = RoutingDecision("t", 0.5, False, fallback_reason=budget, public_fallback_reason=public)
    assert services.shown_fallback_reason(decision, reveal=False) == public
    forgot = RoutingDecision("t", 0.5, False, fallback_reason=down)
    assert services.shown_fallback_reason(forgot, reveal=False) == services.WITHHELD_FALLBACK
    assert services.shown_fallback_reason(forgot, reveal=True) == down
    decided = RoutingDecision("t", 0.5, False)
    assert services.shown_fallback_reason(decided, reveal=False) is None


def _nullable(prop: dict) -> bool:
    """Whether an OpenAPI 3.0 property takes null: `nullable`, or drf-spectacular's enum form
    (oneOf the choices and NullEnum)."""
    return prop.get("nullable") is True or any(
        branch.get("$ref", "").endswith("/NullEnum") for branch in prop.get("oneOf", ())
    )


def test_null_options_are_the_defaults_and_the_api_document_says_so(data, api, settings):
    """`"top_k": null` and `"reranker": null` route with the defaults (5 and
    SYNAPSE_ROUTING_RERANKER), as an absent field does, but the API document gave neither as
    nullable: a client generated from it could not send null, and one checked against it read
    the server's answer as a breach of the document."""
    from drf_spectacular.generators import SchemaGenerator

    schemas = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    for name in ("RouteRequest", "RouteBatchRequest"):
        for field in ("top_k", "reranker"):
            prop = schemas[name]["properties"][field]
            assert _nullable(prop), (name, field, prop)
            assert "null" in prop.get("description", ""), (name, field, prop)
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    settings.SYNAPSE_ROUTING_RERANKER = "none"
    query = data["queries"][0]
    one = _post(http, "/api/v1/route/", {"query": query, "top_k": None, "reranker": None}, raw)
    assert one.status_code == 200, one.content
    assert len(one.json()["candidates"]) == 5 and one.json()["reranker"] == "none"
    batch = _post(http, "/api/v1/route/batch/", {"queries": [query], "top_k": None, "reranker": None}, raw)
    assert batch.status_code == 200, batch.content
    assert batch.json()["results"][0]["reranker"] == "none"


def test_a_whole_top_k_sent_as_a_float_is_that_integer(data, api):
    """JSON has one number type, and several clients write a whole number as 5.0 (a float in
    Python, Java or Go): `"top_k": 5.0` was refused as not an integer. A whole float is taken as
    its integer; 5.5, a float out of range, infinity or NaN are refused, and the API document
    still says integer."""
    from drf_spectacular.generators import SchemaGenerator

    for whole in (5.0, 1.0, 50.0):
        taken = services.validate_top_k(whole)
        assert taken == int(whole) and type(taken) is int
    for bad in (5.5, 0.0, 51.0, 1e300, float("inf"), float("nan"), True, "5"):
        with pytest.raises(services.RoutingInputError, match="top_k must be an integer"):
            services.validate_top_k(bad)
    schemas = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    for name in ("RouteRequest", "RouteBatchRequest"):
        assert schemas[name]["properties"]["top_k"]["type"] == "integer", name
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    query = data["queries"][0]
    one = _post(http, "/api/v1/route/", {"query": query, "top_k": 3.0}, raw)
    assert one.status_code == 200, one.content
    assert len(one.json()["candidates"]) == 3
    batch = _post(http, "/api/v1/route/batch/", {"queries": [query], "top_k": 2.0}, raw)
    assert batch.status_code == 200 and len(batch.json()["results"][0]["candidates"]) == 2
    for path, body in (("/api/v1/route/", {"query": query, "top_k": 2.5}),
                       ("/api/v1/route/batch/", {"queries": [query], "top_k": 2.5})):
        response = _post(http, path, body, raw)
        assert response.status_code == 400 and "top_k" in response.json()["detail"], path


def test_a_global_with_no_scenarios_names_no_reranker(api):
    """A global with no scenario and no linear head routes nothing: its answer (tool null,
    `fallback_reason: "no scenarios"`) named the reranker the caller asked for as the one that
    decided, though none did. `reranker` is null there, the API document says it may be, and the
    call is counted under the reranker asked for."""
    from drf_spectacular.generators import SchemaGenerator

    from compendium.schema import Compendium

    prop = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"][
        "RouteDecision"]["properties"]["reranker"]
    assert _nullable(prop) and "null" in prop["description"], prop
    round_ = Round.objects.create(number=1, state="published")
    store_compendium(Compendium(scenarios=[]), kind="global", round=round_)
    http, raw, _ = api
    services.recorder.flush()
    RoutingCall.objects.all().delete()
    one = _post(http, "/api/v1/route/", {"query": "hello", "reranker": "llm"}, raw)
    assert one.status_code == 200, one.content
    answer = one.json()
    assert (answer["tool"], answer["reranker"], answer["fallback_reason"]) == (
        None, None, "no scenarios")
    batch = _post(http, "/api/v1/route/batch/", {"queries": ["a", "b"], "reranker": "none"}, raw)
    assert batch.status_code == 200, batch.content
    assert [r["reranker"] for r in batch.json()["results"]] == [None, None]
    services.recorder.flush()
    assert sorted(RoutingCall.objects.values_list("reranker", "batch")) == [
        ("llm", False), ("none", True)]


def test_exact_pgvector_retrieval_takes_tied_scenarios_in_order_as_memory_does(data, settings):
    """Scenarios of one vector (one text sent for several tools) tie in distance: the exact scan
    orders them by row, as the in-memory retrieval orders them by position, so both retrievals
    return the same scenarios for every n and a decision does not depend on where it was routed."""
    from compendium.models import ScenarioEntry

    settings.SYNAPSE_ROUTING_RETRIEVAL = "exact"
    version = _publish(data)
    rows = list(ScenarioEntry.objects.filter(version=version).order_by("id"))
    shared = rows[0].embedding
    tied = rows[: len(rows) // 2]
    ScenarioEntry.objects.filter(pk__in=[r.pk for r in tied]).update(embedding=shared)
    services.forget_published_version()
    served = services.served_compendium()
    vector = np.asarray(shared, dtype=np.float32)
    for n in (1, 5, 20, len(tied), len(tied) + 3):
        idx, _ = served.retriever(vector, n)
        memory, _ = served.index.retrieve(vector, n)
        assert list(idx) == list(memory), n
        assert list(idx[: min(n, len(tied))]) == list(range(min(n, len(tied)))), n


# --- deactivated tools ----------------------------------------------------------------------------


def _set_active(tool_id: str, active: bool) -> None:
    """As the operator does in the admin (ToolAdmin saves the row)."""
    from compendium.models import Tool

    tool = Tool.objects.get(tool_id=tool_id)
    tool.active = active
    tool.save()


def _named(answer: dict) -> set:
    """Every tool an answer names: the decision, its nearest scenarios and its ranking."""
    return ({answer["tool"]} | {c["tool"] for c in answer["candidates"]}
            | {r["tool"] for r in answer["ranking"]})


def _without_latency(answers: list[dict]) -> list[dict]:
    return [{k: v for k, v in a.items() if k != "latency_ms"} for a in answers]


@pytest.mark.parametrize("retrieval", ["memory", "exact", "hnsw"])
def test_a_deactivated_tool_is_never_named_and_comes_back_when_reactivated(
    data, api, settings, retrieval
):
    """The operator deactivates a tool that must not be called any more: the routing API kept
    answering it (as `tool`, among `candidates` and in `ranking`) until a later round published
    a global without it. From the deactivation on, the API and the playground answer the next
    best active tool; reactivated, the tool comes back and the answers are what they were."""
    from collections import Counter

    from django.contrib.auth.models import User
    from django.urls import reverse

    settings.SYNAPSE_ROUTING_RETRIEVAL = retrieval
    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600  # this process's own save is seen at once
    http, raw, _ = api
    _publish(data, with_client_copy=False)
    queries = data["queries"][:40]
    batch = {"queries": queries, "top_k": 50}
    before = _post(http, "/api/v1/route/batch/", batch, raw).json()["results"]
    gone = Counter(r["tool"] for r in before).most_common(1)[0][0]
    its = [q for q, r in zip(queries, before, strict=True) if r["tool"] == gone]
    assert its and all(gone in _named(a) for a in before[:3])

    _set_active(gone, False)
    after = _post(http, "/api/v1/route/batch/", batch, raw).json()["results"]
    assert all(a["tool"] and gone not in _named(a) for a in after)
    assert all(len(a["candidates"]) == 50 for a in after)
    for query in its[:3]:
        alone = _post(http, "/api/v1/route/", {"query": query, "top_k": 50}, raw).json()
        assert alone["tool"] and gone not in _named(alone), alone
        # pgvector (exact, hnsw) was asked for the active tools' rows: none dropped afterwards
        assert len(alone["candidates"]) == 50
        # The bare cosine answers the nearest scenario of an active tool: the next best (HNSW
        # is approximate: its nearest scenarios may differ by a row).
        nearest = _post(http, "/api/v1/route/", {"query": query, "top_k": 50, "reranker": "none"},
                        raw).json()
        assert nearest["tool"] and gone not in _named(nearest)
        if retrieval != "hnsw":
            assert nearest["tool"] == next(
                c["tool"] for c in before[queries.index(query)]["candidates"] if c["tool"] != gone)
    http.force_login(User.objects.create_user("member", password="pw-long-enough-1"))
    page = http.get(reverse("dashboard:routing"), {"q": its[0], "top_k": "50"})
    assert page.status_code == 200 and gone not in _named(page.context["result"])

    _set_active(gone, True)
    again = _post(http, "/api/v1/route/batch/", batch, raw).json()["results"]
    assert _without_latency(again) == _without_latency(before)


def test_a_deactivation_by_another_process_is_seen_within_the_version_ttl_without_a_rebuild(
    data, settings
):
    """A registry change this process was not told of (another server process's admin save, or
    `import_tools`, whose bulk update sends no signal) is read with the published version, at
    most SYNAPSE_ROUTING_VERSION_TTL seconds later, as a new global is; it narrows the routers
    of the global already built (no reload of the model or the global's rows)."""
    from compendium.models import Tool

    _publish(data, with_client_copy=False)
    query = data["queries"][0]
    first = services.route_query(query, 50)
    built = services._served.copy()
    gone = first["tool"]
    settings.SYNAPSE_ROUTING_VERSION_TTL = 0  # another process's write, read at once
    Tool.objects.filter(tool_id=gone).update(active=False)  # no signal
    answer = services.route_query(query, 50)
    assert answer["tool"] and gone not in _named(answer)
    assert services._served.keys() == built.keys() and all(
        services._served[k] is v for k, v in built.items())  # nothing was built again
    Tool.objects.filter(tool_id=gone).update(active=True)
    assert _without_latency([services.route_query(query, 50)]) == _without_latency([first])
