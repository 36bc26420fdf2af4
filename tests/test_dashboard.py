"""The dashboard's pages, navigation, scoping and plot rendering, through Django's test client."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.http import Http404
from django.test import RequestFactory
from django.urls import reverse

from compendium.models import CompendiumVersion
from federation.dashboard import nav
from federation.dashboard.plots import add_with_error_bars, literal, render_figure, styled
from federation.dashboard.scoping import organization_or_404, organization_scoped
from federation.models import Organization, Submission
from federation.services import visible_organizations
from tests.dashboard_data import PASSWORD, add_review_data, build_federation

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["dashboard:overview", "dashboard:compendium", "dashboard:tools"]


@pytest.fixture
def federation(db):
    return build_federation()


@pytest.fixture
def operator_client(client, federation):
    assert client.login(username="operator", password=PASSWORD)
    return client


@pytest.fixture
def member_client(client, federation):
    assert client.login(username="member", password=PASSWORD)
    return client


def figures_in(content: str) -> list[dict]:
    return [json.loads(html.unescape(raw)) for raw in re.findall(r'data-plotly="([^"]*)"', content)]


# --- access -------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("name", PAGES)
def test_anonymous_user_is_sent_to_login(client, name):
    url = reverse(name)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('login')}?next={url}"


@pytest.mark.django_db
def test_site_root_is_the_overview():
    assert reverse("dashboard:overview") == "/"


def test_login_page_has_csrf_token_and_logout_is_a_post(client, federation):
    page = client.get(reverse("login"))
    assert page.status_code == 200
    assert b'name="csrfmiddlewaretoken"' in page.content
    client.login(username="operator", password=PASSWORD)
    # a GET (a typed or bookmarked address) asks, and leaves the session signed in
    confirm = client.get(reverse("logout"))
    assert confirm.status_code == 200
    assert b"Log out of SYNAPSE?" in confirm.content and b'method="post"' in confirm.content
    assert client.get("/").status_code == 200
    response = client.post(reverse("logout"))
    assert response.status_code == 302 and response["Location"] == reverse("login")
    assert client.get("/").status_code == 302
    client.login(username="operator", password=PASSWORD)  # the browsable API's logout alike
    assert b"Log out of SYNAPSE?" in client.get(reverse("rest_framework:logout")).content
    client.post(reverse("rest_framework:logout"))
    assert client.get("/").status_code == 302
    signed_out = client.get(reverse("logout"))  # nothing to sign out of: the login page
    assert signed_out.status_code == 302 and signed_out["Location"] == reverse("login")


def test_login_is_csrf_protected(federation):
    from django.test import Client as TestClient

    strict = TestClient(enforce_csrf_checks=True)
    response = strict.post(reverse("login"), {"username": "operator", "password": PASSWORD})
    assert response.status_code == 403


# --- scoping --------------------------------------------------------------------------------------


def test_visible_organizations(federation):
    assert set(visible_organizations(federation.operator)) == {federation.acme, federation.globex}
    assert list(visible_organizations(federation.member)) == []
    assert list(visible_organizations(AnonymousUser())) == []
    federation.operator.is_active = False
    assert list(visible_organizations(federation.operator)) == []


def test_organization_or_404(federation):
    assert organization_or_404(federation.operator, slug="acme") == federation.acme
    with pytest.raises(Http404):
        organization_or_404(federation.member, slug="acme")


def test_organization_scoped_decorator(federation):
    seen = {}

    @organization_scoped
    def view(request):
        seen["orgs"] = list(request.organizations)
        from django.http import HttpResponse

        return HttpResponse("ok")

    factory = RequestFactory()
    anonymous = factory.get("/x")
    anonymous.user = AnonymousUser()
    assert view(anonymous).status_code == 302
    request = factory.get("/x")
    request.user = federation.member
    assert view(request).status_code == 200 and seen["orgs"] == []
    request.user = federation.operator
    view(request)
    assert set(seen["orgs"]) == set(Organization.objects.all())


# --- navigation -----------------------------------------------------------------------------------


def test_nav_shows_only_registered_pages_that_resolve(operator_client):
    content = operator_client.get("/").content.decode()
    nav_html = content.split("<nav", 1)[1].split("</nav>", 1)[0]
    labels = re.findall(r'<a href="[^"]*"[^>]*>([^<]+)</a>', nav_html)
    assert labels == [
        "Overview", "Organizations", "Conflicts", "Privacy", "Accuracy", "Compendium",
        "Tool registry", "Routing", "Audit log", "Settings",
    ]
    assert 'aria-current="page"' in nav_html.split("Compendium")[0]


def test_nav_registry_orders_and_skips_unresolvable(federation):
    saved = dict(nav._registry)
    try:
        nav.unregister("privacy")
        nav.register("unbuilt", "Not built", "dashboard:page-not-built")
        nav.register("secret", "Operator only", "dashboard:overview", operator_only=True)
        nav.register("privacy", "Privacy", "dashboard:privacy")  # registered last, ordered by NAV_ORDER
        keys = [i["key"] for i in nav.items_for(federation.operator, active="privacy")]
        assert keys == [
            "overview", "organizations", "conflicts", "privacy", "accuracy", "compendium",
            "tools", "routing", "audit", "settings", "secret",
        ]
        member_keys = [i["key"] for i in nav.items_for(federation.member)]
        assert "secret" not in member_keys and "unbuilt" not in member_keys
        active = [i["key"] for i in nav.items_for(federation.operator, active="privacy") if i["active"]]
        assert active == ["privacy"]
    finally:
        nav._registry.clear()
        nav._registry.update(saved)


# --- overview ---------------------------------------------------------------------------------------


def test_overview_for_the_operator(operator_client, federation):
    response = operator_client.get("/")
    assert response.status_code == 200
    overview = response.context["overview"]
    by_number = {row.round.number: row for row in overview.rounds}
    assert [row.round.number for row in overview.rounds] == [4, 3, 2, 1]
    assert by_number[1].submissions == 3 and by_number[2].submissions == 4
    assert by_number[4].submissions == 0 and by_number[4].global_version is None
    assert by_number[3].global_version is not None  # unpublished, but the operator sees it
    assert by_number[2].global_version.size_bytes > by_number[1].global_version.size_bytes
    assert overview.state_counts == {"published": 2, "merging": 1, "open": 1}
    clients = {str(row.client): row for row in overview.clients}
    assert clients["acme/acme-node-1"].rounds == 3 and clients["acme/acme-node-1"].last_round == 3
    assert clients["globex/globex-pending"].rounds == 0

    figures = figures_in(response.content.decode())
    assert len(figures) == 2
    participation = next(f for f in figures if "Participation" in f["layout"]["title"]["text"])
    assert participation["data"][0]["y"] == [3, 4, 4, 0]  # rounds 1-4
    # Both axes leave room above the largest value: a full round's bar and the latest global's
    # marker do not sit on the frame.
    assert participation["layout"]["yaxis"]["range"] == [0, pytest.approx(4.4)]
    largest = max(y for y in participation["data"][1]["y"] if y is not None)
    assert participation["layout"]["yaxis2"]["range"] == [0, pytest.approx(1.1 * largest)]
    bytes_fig = next(f for f in figures if "each client sent" in f["layout"]["title"]["text"])
    traces = {t["name"]: t for t in bytes_fig["data"]}
    assert set(traces) == {"acme/acme-node-1", "acme/acme-node-2", "globex/globex-node-1", "globex/globex-node-2"}
    node = traces["acme/acme-node-1"]
    assert list(node["x"]) == [1, 2, 3]
    assert node["y"][0] < node["y"][1] < node["y"][2]  # the submissions grow over rounds
    # Sent plain, a body is its canonical bytes; sent as dcz, the chart shows the dcz bytes.
    assert [row[0] for row in node["customdata"]] == ["identity"] * 3
    assert node["y"] == [row[1] for row in node["customdata"]]
    version = CompendiumVersion.objects.get(kind="client", client__name="acme-node-1",
                                            round__number=2)
    Submission.objects.create(client=version.client, round=version.round, idempotency_key="k",
                              request_sha256="0" * 64, version=version, response={},
                              wire_bytes=1234, content_encoding="dcz")
    figures = figures_in(operator_client.get("/").content.decode())
    bytes_fig = next(f for f in figures if "each client sent" in f["layout"]["title"]["text"])
    node = next(t for t in bytes_fig["data"] if t["name"] == "acme/acme-node-1")
    assert node["y"][1] == 1.234 and node["customdata"][1][0] == "dcz"
    content = response.content.decode()
    assert "vendor/plotly.min.js" in content and "Globex Health" in content


def test_overview_totals_and_client_figures_count_every_round_not_only_the_tables(federation):
    """The table holds the latest `max_rounds` rounds; the submission total and each client's
    rounds submitted and mean size were counted over those alone (past 50 daily rounds, the
    Overview under-counted without a word)."""
    from federation.dashboard.services import federation_overview
    from federation.models import Organization

    everything = federation_overview(Organization.objects.all(), include_unpublished=True)
    latest_two = federation_overview(Organization.objects.all(), include_unpublished=True,
                                     max_rounds=2)
    assert [row.round.number for row in latest_two.rounds] == [4, 3]
    assert latest_two.totals["submissions"] == everything.totals["submissions"] == 11
    node = {str(r.client): r for r in latest_two.clients}["acme/acme-node-1"]
    whole = {str(r.client): r for r in everything.clients}["acme/acme-node-1"]
    assert node.rounds == whole.rounds == 3 and node.last_round == 3
    assert node.mean_size_bytes == whole.mean_size_bytes


def test_overview_for_a_user_without_organizations(member_client, federation):
    response = member_client.get("/")
    assert response.status_code == 200
    content = response.content.decode()
    for secret in ("Acme Research", "Globex Health", "acme-node", "globex-node"):
        assert secret not in content
    overview = response.context["overview"]
    assert overview.clients == [] and all(row.submissions == 0 for row in overview.rounds)
    assert "not a member of any organization" in content
    by_number = {row.round.number: row for row in overview.rounds}
    assert by_number[2].global_version is not None
    assert by_number[3].global_version is None  # merged, not published: the operator's alone
    assert not any("each client sent" in f["layout"]["title"]["text"] for f in figures_in(content))


def test_overview_draws_the_globals_on_the_public_probe_set(client, federation):
    from federation.models import MergeRecord

    for number, accuracy in ((1, 0.41), (2, 0.53), (3, 0.6)):
        MergeRecord.objects.create(round=federation.rounds[number], accuracy=accuracy,
                                   probe_queries=597)
    MergeRecord.objects.create(round=federation.rounds[2], organization=federation.acme)  # an edge's
    assert client.login(username="operator", password=PASSWORD)
    response = client.get("/")
    rows = {row.round.number: row for row in response.context["overview"].rounds}
    assert [rows[n].probe_accuracy for n in (1, 2, 3, 4)] == [0.41, 0.53, 0.6, None]
    chart = next(f for f in figures_in(response.content.decode())
                 if "public probe set" in f["layout"]["title"]["text"])
    assert chart["data"][0]["x"] == [1, 2, 3] and chart["data"][0]["y"] == [0.41, 0.53, 0.6]
    assert chart["data"][0]["customdata"] == [597] * 3
    assert 'title="on 597 probe requests">0.530<' in response.content.decode()
    # a member sees the published rounds' figures only, as it sees their globals only
    assert client.login(username="member", password=PASSWORD)
    response = client.get("/")
    rows = {row.round.number: row for row in response.context["overview"].rounds}
    assert [rows[n].probe_accuracy for n in (1, 2, 3)] == [0.41, 0.53, None]
    chart = next(f for f in figures_in(response.content.decode())
                 if "public probe set" in f["layout"]["title"]["text"])
    assert chart["data"][0]["x"] == [1, 2]


def test_overview_without_rounds(client, db):
    get_user_model().objects.create_superuser("op", "op@example.org", PASSWORD)
    client.login(username="op", password=PASSWORD)
    content = client.get("/").content.decode()
    assert "No rounds yet" in content and "data-plotly" not in content
    assert "vendor/plotly.min.js" not in content


# --- compendium browser -----------------------------------------------------------------------------


def test_compendium_defaults_to_latest_visible_round(operator_client, member_client):
    # the test client holds one session: the member logged in last
    response = member_client.get(reverse("dashboard:compendium"))
    assert response.context["version"].round.number == 2  # round 3 is not published
    assert "Unpublished merge result" not in response.content.decode()
    assert [v.round.number for v in response.context["versions"]] == [2, 1]
    assert member_client.get(reverse("dashboard:compendium"), {"round": 3}).status_code == 404


def test_compendium_page_says_what_the_server_merge_summarizer_did(member_client):
    from federation.models import MergeRecord, Round

    page = member_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
    assert 'id="merge-summaries"' not in page  # no record of the server merge: nothing said
    MergeRecord.objects.create(round=Round.objects.get(number=2), stats={
        "summarizer": "llm-single-shot", "summaries": {"llm-single-shot": 3, "probe-extractive": 1},
        "summarizer_fallbacks": [{"summarizer": "llm-single-shot", "tool_id": "weather",
                                  "reason": "LLM answer has no non-empty 'summary' string",
                                  "kind": "unusable answer"}]})
    page = member_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
    said = re.search(r'<span id="merge-summaries">(.*?)</span></p>', page, re.S).group(1)
    assert "summarized 4 clusters of more than one text with llm-single-shot" in said
    # the cause, not the reason (which may quote the LLM's answer: the operator's alone)
    assert "3 by the LLM, 1 fell back" in said and 'title="unusable answer"' in said


def test_compendium_page_tells_the_operator_where_the_server_merge_s_krum_lacked_its_premise(
    client, federation
):
    """Three edges under Krum at an f share of 0.4 (f = 1, n = 3 < 2f + 3): the operator reads how
    many groups the server merge judged so; under the trimmed mean nothing is said."""
    from federation.models import MergeRecord, Round

    round_ = Round.objects.get(number=2)
    MergeRecord.objects.create(round=round_, stats={
        "summarizer": "centroid", "krum_below_premise": 3,
        "krum_below_premise_sizes": [{"n": 3, "f": 1, "groups": 2}, {"n": 5, "f": 2, "groups": 1}]})
    for rule, operator_sees in (("krum", True), ("trimmed-mean", False)):
        Round.objects.filter(pk=round_.pk).update(config={**round_.config, "robust_rule": rule,
                                                          "trim_fraction": 0.4})
        for username in ("operator", "member"):
            assert client.login(username=username, password=PASSWORD)
            page = html.unescape(client.get(reverse("dashboard:compendium"),
                                            {"round": 2}).content.decode())
            note = re.search(r'<p class="hint" id="krum-premise-note">(.*?)</p>', page)
            if not (operator_sees and username == "operator"):
                assert note is None, (rule, username)
                continue
            assert note.group(1) == (
                "The server merge: Krum judged 3 groups (a tool's batches across the edges, or a "
                "scenario cluster's members) with fewer than 2f + 3 inputs (2 at n = 3, f = 1; 1 "
                "at n = 5, f = 2): its guarantee does not hold there. At this f share (0.4) every "
                "group of 11 or more inputs meets it. The trimmed mean needs only n > 2f, which "
                "every group meets.")


def test_compendium_page_counts_the_flag_names_the_server_merge_held_back(client, federation):
    """The server merge leaves off a flag name fewer than two edges carried for a tool: the
    Compendium page says how many (a count, to everyone who sees the page); one held back is
    said in the singular; none, nothing."""
    from federation.models import MergeRecord, Round

    round_ = Round.objects.get(number=2)
    record = MergeRecord.objects.create(round=round_, stats={"summarizer": "centroid",
                                                             "flags_held_back": 1})
    for username in ("operator", "member"):
        assert client.login(username=username, password=PASSWORD)
        page = html.unescape(client.get(reverse("dashboard:compendium"),
                                        {"round": 2}).content.decode())
        note = re.search(r'<p class="hint" id="flags-held-back-note">(.*?)</p>', page)
        assert note.group(1) == (
            "The server merge: 1 precondition flag name was left off this global compendium: "
            "fewer than 2 edges carried it for its tool (a name only one source writes could "
            "name a person or an account).")
    MergeRecord.objects.filter(pk=record.pk).update(stats={"summarizer": "centroid"})
    page = client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
    assert "flags-held-back-note" not in page
    # the LLM's unanswered consistency questions in the server merge, as a count
    MergeRecord.objects.filter(pk=record.pk).update(stats={
        "summarizer": "centroid", "consistency_asked": 3, "consistency_unanswered": 1})
    page = html.unescape(client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode())
    note = re.search(r'<p class="hint" id="unanswered-consistency-note">(.*?)</p>', page)
    assert note.group(1).startswith(
        "The LLM gave no usable answer to 1 of the server merge's 3 consistency questions")


def test_the_server_merge_s_fallback_reason_quoting_an_llm_answer_is_the_operator_s(client, federation):
    """A summarizer's fallback reason quotes the LLM's answer ("LLM answer is not JSON: '...'"),
    and a model answering in prose repeats the cluster's texts, which in the server merge come
    from several organizations' edges (as the server merge's conflicts do, which only the
    operator sees). The Compendium page showed every signed-in person the server merge's most
    frequent reason: another organization's edge text that the global does not publish. Anyone
    but the operator now reads the cause (`kind`), not the quote."""
    from compendium.schema import Schema, ToolSpec
    from federation.merge import MergeInput, server_merge
    from federation.merge.llm import OpenAICompatibleLLM
    from federation.models import MergeRecord, Round
    from federation.round_config import RoundConfig
    from routing.embeddings import get_engine
    from tests.chat_server import ChatServer

    schema = Schema(tools=[ToolSpec(tool_id="weather", description="Weather forecasts for a city")])
    edge_text = {"acme": ["Will it rain tomorrow in the city?", "Will it rain tomorrow in this city?"],
                 "globex": ["Will it rain tomorrow in our city, Springfield?"]}
    edges = [MergeInput(org, {"schema_version": "1.0", "scenarios": [
        {"tool_id": "weather", "text": text, "preconditions": {}} for text in texts]})
        for org, texts in edge_text.items()]
    quoted = edge_text["globex"][0]
    # A model that ignores "answer only with JSON" and lists what it was given.
    server = ChatServer(default=f"Sure. They all ask: {quoted}")
    try:
        result = server_merge(edges, schema, RoundConfig(summarizer="llm-single-shot", tau=0.5),
                              embed=get_engine().embed, llm=OpenAICompatibleLLM(server.url))
    finally:
        server.close()
    published = {s.text for s in result.compendium.scenarios}
    assert quoted not in published  # the global publishes another text of the cluster
    assert quoted in result.stats.summarizer_fallbacks[0]["reason"]
    MergeRecord.objects.create(round=Round.objects.get(number=2), stats=result.stats.as_dict())
    for username, sees in (("member", False), ("operator", True)):
        assert client.login(username=username, password=PASSWORD)
        page = client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
        said = re.search(r'<span id="merge-summaries">(.*?)</span></p>', page, re.S).group(1)
        assert "fell back" in said
        assert (html.escape(quoted) in page) is sees, username
        assert ("unusable answer" in said) is not sees, username


def test_operator_sees_unpublished_global_result(operator_client):
    response = operator_client.get(reverse("dashboard:compendium"))
    assert response.context["version"].round.number == 3
    assert "Unpublished merge result scenario" in response.content.decode()


def test_compendium_cards_carry_entries_and_provenance(member_client):
    response = member_client.get(reverse("dashboard:compendium"), {"round": 2})
    cards = {c.tool.tool_id: c for c in response.context["cards"]}
    assert set(cards) == {"weather", "flights", "calculator"}
    flights = {s.text: s.since_round for s in cards["flights"].scenarios}
    assert flights == {
        "Find a cheap flight between two airports": 1,
        "Change the date of a booked flight": 2,
    }
    weather = cards["weather"]
    assert {s["field"]: s["value"] for s in weather.stats} == {"calls": 43.5, "success_rate": 0.93}
    assert weather.templates[0].signature == "forecast(city, days)"
    assert weather.scenarios[0].preconditions == {"has_city": True}
    assert {(a.subject, a.object) for a in cards["flights"].annex} == {
        ("flights", "airport code"),
        ("hotel booking", "flights"),
    }
    assert cards["calculator"].precautions[0].text == "Do not use for currency conversion"
    content = response.content.decode()
    assert "calls/round" in content and "since round 1" in content and "since round 2" in content


def test_compendium_statistics_carry_their_noise_and_say_when_it_drowns_them(operator_client, federation):
    add_review_data(federation)  # ledger rows at each edge
    response = operator_client.get(reverse("dashboard:compendium"), {"round": 2})
    cards = {c.tool.tool_id: c for c in response.context["cards"]}
    weather = {s["field"]: s for s in cards["weather"].stats}
    # Round 2's ledger: each of the two edges noised calls at b = 2.5 and success_rate at b = 2.
    assert (weather["calls"]["noise_scale"], weather["calls"]["edges"]) == (2.5, 2)
    # b = 2.5 against the clipping window [0, Δ = 50] the figure is clamped to
    assert not weather["calls"]["noise_dominated"]
    assert weather["success_rate"]["noise_scale"] == 2.0
    assert weather["success_rate"]["noise_dominated"]  # b = 2 against a window of 1
    assert cards["weather"].noise_dominated
    flights = cards["flights"].stats[0]  # no ledger row: nothing to say about its noise
    assert flights["noise_scale"] is None and not flights["noise_dominated"]
    # how many times its window: about that many times the ε or the clients would do
    assert weather["success_rate"]["noise_to_window"] == 2.0
    assert weather["success_rate"]["window"] == (0.0, 1.0)
    assert weather["calls"]["window"] == (0.0, 50.0)
    content = response.content.decode()
    assert "noise b 2.5 (2 edges)" in content and 'class="noise-dominated"' in content
    assert "noise b 2 (2 edges) <span class=\"window\">= 2× window</span>" in content
    assert "2 times the clipping window [0, 1]" in html.unescape(content)
    assert content.count('id="noise-note"') == 1  # said once for the page


def test_compendium_says_how_many_statistics_the_global_left_out(member_client, federation):
    from federation.models import MergeRecord

    body = member_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
    assert 'id="withheld-note"' not in body
    MergeRecord.objects.create(round=federation.rounds[2], stats={"stats_withheld": 3})
    body = member_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode()
    note = body[body.index('id="withheld-note"'):]
    note = note[: note.index("</p>")]
    assert "3 statistics of this round are left out of this global compendium" in note
    assert "at least as wide as the field's clipping window" in note
    # the edges' records name the fields no edge released (drowned before any noise was drawn)
    assert 'id="not-released-note"' not in body
    MergeRecord.objects.create(round=federation.rounds[2], organization=federation.acme,
                               stats={"fields_not_released": ["latency_ms", "success_rate"]})
    body = html.unescape(member_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode())
    note = body[body.index('id="not-released-note"'):]
    note = note[: note.index("</p>")]
    assert "No edge released latency_ms, success_rate this round" in note
    assert "No noise was drawn and no ε spent on them" in note
    assert "clipping window" in note and 'id="not-released-ratio"' not in note


def test_compendium_tells_the_operator_how_far_unreleased_fields_were_from_releasable(
    client, federation
):
    """No edge released the round's fields: the operator reads how many times its clipping window
    the narrowest published noise would have been, and the ε (or the clients per organization)
    that would have released them. Round 2 at ε = 1 under a field cap F* = 1: ε_j = 1/(2·1·4),
    two edges of two submissions each: b/w = 1/(K·ε_j·√E) = 8/(2·√2) ≈ 2.828. That follows from
    the largest organization's K, so an organization's people read only the rule."""
    from federation.models import MergeRecord

    rnd = federation.rounds[2]
    rnd.config = {"epsilon": 1.0, "field_cap": 1}
    rnd.save(update_fields=["config"])
    MergeRecord.objects.create(round=rnd, stats={"stats_withheld": 0})
    fields = ["calls", "frequency", "latency_ms", "success_rate"]
    for org, inputs in ((federation.acme, ["a1", "a2"]), (federation.globex, ["g1", "g2"])):
        MergeRecord.objects.create(round=rnd, organization=org,
                                   stats={"fields_not_released": fields, "inputs": inputs})
    for username, operator in (("operator", True), ("member", False)):
        assert client.login(username=username, password=PASSWORD)
        body = html.unescape(client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode())
        note = body[body.index('id="not-released-note"'):]
        note = note[: note.index("</p>")]
        assert "clipping window" in note
        if operator:
            assert "2.828 times the window" in note
            assert "more than ε = 2.828 per round" in note
            assert "about 2.828 times as many clients per organization" in note
        else:
            assert "times the window" not in note and "2.828" not in note


def release_flights_calls(fed):
    """Round 2's flights.calls, released by both edges at the same ε_j = 0.25 over their own K
    submissions: b = Δ / (K · ε_j) = 50 / (8 · 0.25) = 25 at Acme, inside the clipping window
    [0, 50] the figure is clamped to, and 50 / (1 · 0.25) = 200 at Globex: a fifth of the declared
    range of 1,000 calls, but four times the window. Globex re-released it once after an erasure
    (its K went from 2 to 1): its latest release is the one behind the global."""
    from federation.models import PrivacyLedgerEntry

    for org, release, k in ((fed.acme, 0, 8), (fed.globex, 0, 2), (fed.globex, 1, 1)):
        PrivacyLedgerEntry.objects.create(
            round=fed.rounds[2], organization=org, release=release, tool_id="flights",
            field="calls", sensitivity=50.0, contributors=k, epsilon=0.25,
            noise_scale=50.0 / (k * 0.25), mechanism="laplace",
        )


def flights_card(client) -> tuple[dict, str, str]:
    response = client.get(reverse("dashboard:compendium"), {"round": 2})
    assert response.status_code == 200
    card = next(c for c in response.context["cards"] if c.tool.tool_id == "flights")
    body = response.content.decode()
    article = body[body.index('id="tool-flights"'):]
    return card.stats[0], article[: article.index("</article>")], body


@pytest.mark.parametrize(
    "username, scales, shown",
    [
        # the operator: every edge's release, as before
        ("operator", (25.0, 200.0, 2), "noise b 25–200 (2 edges)"),
        # an organization's people: their own edge's, not the other organization's (its K)
        ("acme-admin", (25.0, 25.0, 1), "noise b 25 (your edge)"),
        ("acme-member", (25.0, 25.0, 1), "noise b 25 (your edge)"),
        ("globex-admin", (200.0, 200.0, 1), "noise b 200 (your edge)"),
        # someone in no organization: none
        ("member", (None, None, 0), None),
    ],
)
def test_compendium_shows_each_viewer_only_the_noise_of_edges_they_may_see(
    client, federation, username, scales, shown
):
    add_review_data(federation)
    release_flights_calls(federation)
    assert client.login(username=username, password=PASSWORD)
    stat, card, body = flights_card(client)
    assert stat["value"] == 12.25  # the published global figure: the same for everyone
    assert (stat["noise_scale"], stat["noise_scale_max"], stat["edges"]) == scales
    others = {"25", "200"} - set(re.findall(r"[\d,]+", shown or ""))
    if shown:
        assert shown in card
    else:
        assert "noise b" not in card
    for figure in others:  # another organization's scale appears nowhere in its card
        assert not re.search(rf"b {figure}\b", card) and f"–{figure}" not in card
    # the greying-out follows the scales shown: Globex's own b (200) is wider than the clipping
    # window [0, 50] (not than the declared range of 1,000); Acme's, and the operator's narrowest
    # edge, are not (else it would tell Globex's K to Acme)
    assert stat["noise_dominated"] is (username == "globex-admin")
    if username == "operator":
        assert 'id="noise-scope"' not in body
    else:
        assert 'id="noise-scope"' in body and "which is that organization" in body


def test_an_edge_rematerialized_without_statistics_shows_no_noise_scale(operator_client, federation):
    """An erasure past the budget re-materializes the edge without statistics (no release, no
    ledger row); its earlier release's rows stay in the append-only ledger but back nothing
    published, so the page shows only the other edge's scale."""
    from compendium.models import CompendiumVersion

    add_review_data(federation)
    release_flights_calls(federation)
    edge = CompendiumVersion.objects.get(kind="edge", round=federation.rounds[2],
                                         organization=federation.globex)
    edge.entry_counts = {**edge.entry_counts, "metadata": 0}  # as the re-materialization stores it
    edge.save(update_fields=["entry_counts"])
    stat, card, _ = flights_card(operator_client)
    assert (stat["noise_scale"], stat["noise_scale_max"], stat["edges"]) == (25.0, 25.0, 1)
    assert "noise b 25" in card and "200" not in card


def test_compendium_statistics_carried_forward_name_the_round_that_released_them(
    operator_client, federation
):
    """A tool no edge reported this round keeps the earlier global's statistics (server_merge
    carries them forward): the page must say which round released them, not label them with the
    round being browsed."""
    from federation.models import PrivacyLedgerEntry

    add_review_data(federation)  # weather released by both edges in rounds 1 and 2
    PrivacyLedgerEntry.objects.create(  # flights.calls released in round 1 only
        round=federation.rounds[1], organization=federation.acme, tool_id="flights",
        field="calls", sensitivity=50.0, contributors=4, epsilon=0.5, noise_scale=25.0,
        mechanism="laplace",
    )
    response = operator_client.get(reverse("dashboard:compendium"), {"round": 2})
    cards = {c.tool.tool_id: c for c in response.context["cards"]}
    flights = cards["flights"].stats[0]
    assert (flights["round"], flights["carried"]) == (1, True)
    assert {(s["field"], s["round"], s["carried"]) for s in cards["weather"].stats} == {
        ("calls", 2, False), ("success_rate", 2, False)}
    body = response.content.decode()
    article = body[body.index('id="tool-flights"'):]
    article = article[: article.index("</article>")]
    assert "carried forward from round 1" in article
    assert "release, round 2" not in article  # not labelled with the browsed round
    weather = body[body.index('id="tool-weather"'):]
    weather = weather[: weather.index("</article>")]
    assert "carried forward" not in weather and "released in round 2" in weather

    # The operator's view of round 3 (merged, not yet published): its own releases are its own,
    # not carried forward from round 2.
    PrivacyLedgerEntry.objects.create(
        round=federation.rounds[3], organization=federation.acme, tool_id="weather",
        field="calls", sensitivity=1.0, contributors=5, epsilon=0.4, noise_scale=3.0,
        mechanism="laplace",
    )
    response = operator_client.get(reverse("dashboard:compendium"), {"round": 3})
    weather = {s["field"]: s for s in next(
        c for c in response.context["cards"] if c.tool.tool_id == "weather").stats}
    assert (weather["calls"]["round"], weather["calls"]["carried"]) == (3, False)
    assert weather["calls"]["noise_scale"] == 3.0
    assert (weather["success_rate"]["round"], weather["success_rate"]["carried"]) == (2, True)


def test_the_noise_note_does_not_give_a_carried_figure_the_browsed_rounds_epsilon(
    operator_client, federation
):
    """The note on greyed statistics explained their noise by 'this round's ε': a figure
    carried forward was noised at the ε of the round that released it."""
    from federation.models import PrivacyLedgerEntry

    add_review_data(federation)
    PrivacyLedgerEntry.objects.create(  # flights.calls released in round 1 only, noise-dominated
        round=federation.rounds[1], organization=federation.acme, tool_id="flights",
        field="calls", sensitivity=50.0, contributors=1, epsilon=0.025, noise_scale=2000.0,
        mechanism="laplace",
    )
    body = html.unescape(
        operator_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode())
    note = body[body.index('id="noise-note"'):]
    note = note[: note.index("</p>")]
    assert "Greyed figures carried forward from round 1 were noised at the ε of that round" in note
    # without a carried figure among the greyed ones, nothing is said of it
    PrivacyLedgerEntry.objects.filter(tool_id="flights").delete()
    body = html.unescape(
        operator_client.get(reverse("dashboard:compendium"), {"round": 2}).content.decode())
    note = body[body.index('id="noise-note"'):]
    assert "carried forward" not in note[: note.index("</p>")]


@pytest.mark.parametrize(
    "query, expected",
    [
        ("weath", {"weather"}),  # tool id
        ("airports", {"flights"}),  # scenario text
        ("CURRENCY", {"calculator"}),  # precaution text, case-insensitive
        ("over {days}", {"weather"}),  # template text
        ("Travel", {"flights"}),  # category
        ("no such thing", set()),
    ],
)
def test_compendium_search(member_client, query, expected):
    response = member_client.get(reverse("dashboard:compendium"), {"q": query})
    assert {c.tool.tool_id for c in response.context["cards"]} == expected
    if not expected:
        assert "No tool matches" in response.content.decode()


def test_compendium_round_choice_and_bad_input(member_client):
    round1 = member_client.get(reverse("dashboard:compendium"), {"round": "1"})
    assert round1.context["version"].round.number == 1
    assert "Change the date" not in round1.content.decode()
    bad = member_client.get(reverse("dashboard:compendium"), {"round": "two"})
    assert bad.status_code == 400 and "round must be a round number" in bad.content.decode()
    assert member_client.get(reverse("dashboard:compendium"), {"round": "99"}).status_code == 404


def test_compendium_annex_view_and_pagination(member_client, federation):
    response = member_client.get(reverse("dashboard:compendium"), {"view": "annex", "q": "iso"})
    triples = list(response.context["page_obj"])
    assert [(t.subject, t.object) for t in triples] == [("currency", "ISO 4217 code")]
    from federation.dashboard.services import compendium_page, global_versions

    version = global_versions(federation.member).first()
    page, cards = compendium_page(version, global_versions(federation.member), page=2, per_page=2)
    assert page.paginator.num_pages == 2 and [c.tool.tool_id for c in cards] == ["weather"]


def test_compendium_empty_state(client, db):
    get_user_model().objects.create_user("lonely", password=PASSWORD)
    client.login(username="lonely", password=PASSWORD)
    response = client.get(reverse("dashboard:compendium"))
    assert response.status_code == 200 and "No global compendium has been published" in response.content.decode()


# --- tool registry ----------------------------------------------------------------------------------


def test_tool_registry_lists_searches_and_paginates(member_client):
    url = reverse("dashboard:tools")
    first = member_client.get(url)
    assert first.context["page_obj"].paginator.count == 33
    assert first.context["page_obj"].paginator.num_pages == 1
    assert len(first.context["page_obj"].object_list) == 33
    weather = member_client.get(url, {"q": "forecast"})
    tools = list(weather.context["page_obj"])
    assert [t.tool_id for t in tools] == ["weather"]
    assert tools[0].scenario_count == 1 and tools[0].precaution_count == 0  # round 2, published
    assert "1 of 33 tools match." in weather.content.decode()
    assert 'id="tools-matched"' not in first.content.decode()
    misc = member_client.get(url, {"category": "Misc", "page": "2"})
    assert misc.context["page_obj"].paginator.count == 30 and misc.context["page_obj"].number == 1
    assert "calls/round" in first.content.decode()  # declared numeric fields
    assert 'id="tools-no-global"' not in first.content.decode()
    assert "never released" not in first.content.decode()
    # a field of kind `other` is declared but never released (no share of ε): the page says so
    from compendium.models import NumericField

    NumericField.objects.create(name="error_budget", kind="other", min_value=0, max_value=1,
                                sensitivity=1)
    page = member_client.get(url).content.decode()
    assert page.count("(never released)") == 1
    assert page.index("(never released)") > page.index("<code>error_budget</code>")


def test_tool_registry_before_any_publication_shows_no_counts(member_client):
    """Before a global is published every tool showed 0 scenarios and 0 precautions, as if the
    federation had published one without them."""
    from compendium.models import CompendiumVersion

    CompendiumVersion.objects.filter(kind="global").delete()
    page = member_client.get(reverse("dashboard:tools"), {"q": "forecast"}).content.decode()
    assert 'id="tools-no-global"' in page
    row = page[page.index('id="tools"'):]
    cells = re.findall(r'<td class="num">([^<]*)</td>', row[: row.index("</table>")])
    assert cells == ["–", "–"]


def test_tool_registry_says_when_its_counts_are_of_a_global_not_published(operator_client):
    """The operator's latest global may be a merged round not yet published (or failed): its
    counts were labelled 'the global compendium of round 3' as if clients were served it."""
    response = operator_client.get(reverse("dashboard:tools"))
    assert response.context["latest"].round.number == 3
    page = response.content.decode()
    assert "Counts are from the global compendium of round 3 (merging, not published)." in page


# --- plots and static files -------------------------------------------------------------------------


def test_render_figure_escapes_and_round_trips():
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name='<script>"x"</script>'))
    fig.update_layout(title={"text": "T & co"})
    rendered = str(render_figure(fig, div_id="p1"))
    assert "<script>" not in rendered
    assert 'aria-label="T &amp; co"' in rendered
    (payload,) = re.findall(r'data-plotly="([^"]*)"', rendered)
    figure = json.loads(html.unescape(payload))
    assert figure["data"][0]["name"] == '<script>"x"</script>'
    assert list(figure["data"][0]["y"]) == [3, 4]


def test_a_chart_is_a_figure_named_and_described_by_its_data():
    """A chart's div had role="img": plotly puts its mode bar's buttons inside, and an image's
    content is hidden from a screen reader (axe: nested-interactive), which heard the title alone.
    It is now a figure, named by its label and described by its data in words."""
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4], name="client submissions"))
    fig.add_trace(go.Scatter(x=[1, 2], y=[0.25, None], yaxis="y2", mode="lines+markers",
                             name=literal("a <b> & c")))
    add_with_error_bars(fig, go.Scatter(x=[1, 2], y=[0.5, 0.75], mode="markers", name="seeds"),
                        [0.1, None])
    fig.add_hline(y=3.5, annotation_text="budget cap ε = 3.5")
    styled(fig, title={"text": "Participation"}, xaxis={"title": {"text": "round"}},
           yaxis={"title": {"text": "submissions"}},
           yaxis2={"title": {"text": "global size (kB)"}, "overlaying": "y"})
    rendered = str(render_figure(fig, div_id="p1", label="Submissions per round"))
    assert 'role="img"' not in rendered
    assert re.search(r'<div id="p1" class="plot" role="figure" aria-label="Submissions per round"'
                     r' aria-describedby="p1-data"', rendered)
    (description,) = re.findall(r'<p id="p1-data" hidden>([^<]*)</p>', rendered)
    description = html.unescape(description)
    assert description.startswith("Horizontal axis: round; vertical axis: submissions; "
                                  "right axis: global size (kB).")
    assert "client submissions (bars): round 1: 3, round 2: 4." in description
    assert "a <b> & c (line, right axis (global size (kB))): round 1: 0.25, round 2: no value." in description
    assert "seeds (points): round 1: 0.5, round 2: 0.75." in description
    assert description.count("seeds") == 1  # its error bars' companion trace is not read out
    assert description.endswith("Marked: budget cap ε = 3.5.")


def test_a_long_series_is_described_up_to_a_bound():
    fig = go.Figure(go.Scatter(x=list(range(100)), y=list(range(100)), name="calls"))
    (description,) = re.findall(r'<p id="p2-data" hidden>([^<]*)</p>',
                                str(render_figure(fig, div_id="p2")))
    assert "39: 39, and 60 more." in description and "40: 40" not in description


def test_plotly_js_is_vendored_with_its_license():
    bundle = ROOT / "static" / "vendor" / "plotly.min.js"
    head = bundle.read_bytes()[:300].decode()
    assert "plotly.js v" in head and "Licensed under the MIT license" in head
    assert "MIT License" in (ROOT / "static" / "vendor" / "plotly.LICENSE.txt").read_text()


def test_static_assets_are_served(operator_client):
    for path in ("/static/vendor/plotly.min.js", "/static/dashboard/dashboard.css"):
        response = operator_client.get(path)
        assert response.status_code == 200, path


def test_sizes_are_shown_in_si_kilobytes_as_the_readme_counts_them():
    from federation.templatetags.dashboard_tags import kb

    assert [kb(999), kb(2048), kb(150528), kb(None), kb("x")] == ["999 B", "2.0 kB", "150.5 kB", "–", "–"]


# --- commands the pages suggest -----------------------------------------------------------------

SUGGESTED = re.compile(r"<code>(?:python )?manage\.py ([a-z_]+)([^<]*)</code>")


def _suggested_commands():
    root = Path(__file__).resolve().parent.parent / "templates"
    found = {(name, args.strip()) for page in root.rglob("*.html")
             for name, args in SUGGESTED.findall(page.read_text(encoding="utf-8"))}
    return sorted(found)


def test_the_pages_suggest_commands():
    assert ("simulate", "--tune-router 1") in _suggested_commands()


@pytest.mark.parametrize(("name", "args"), _suggested_commands())
def test_every_command_a_page_suggests_parses(name, args):
    """A command an operator copies from a page must run: its name exists and its own parser
    takes every flag (the Accuracy page once suggested `--robust-rules`, which no command has)."""
    from django.core.management import get_commands, load_command_class
    from django.core.management.base import CommandError

    parser = load_command_class(get_commands()[name], name).create_parser("manage.py", name)
    try:
        parser.parse_args(html.unescape(args).split())
    except SystemExit as exit_:  # --help exits 0
        assert exit_.code == 0, f"manage.py {name} {args}: exit {exit_.code}"
    except CommandError as error:
        pytest.fail(f"manage.py {name} {args}: {error}")


def test_names_in_charts_are_shown_as_written_not_read_as_plotly_markup():
    """A client named like a link (an organization admin names its clients) is a name in the
    legend and hover of the operator's chart, not a link: plotly.js reads <a href> and entities in
    those texts, so the name goes in escaped (plotly decodes the entities back to the characters)
    and the hover names the trace instead of holding the name as a template."""
    from types import SimpleNamespace

    from federation.dashboard.services import bytes_per_client_figure

    name = '<a href="https://evil.example/login">Session expired</a> & %{y}'
    fig = bytes_per_client_figure(
        {1: SimpleNamespace(client=name)},
        {1: [{"round__number": 1, "submission__wire_bytes": 900, "size_bytes": 2000,
              "gzip_bytes": 800, "submission__content_encoding": "dcz"}]},
    )
    trace = fig.data[0]
    assert trace.name == html.escape(name, quote=False)
    assert "<a " not in fig.to_json() and "evil.example" in fig.to_json()
    assert trace.hovertemplate.startswith("%{fullData.name}<br>") and "evil" not in trace.hovertemplate


def test_the_compendium_page_says_its_publication_time_is_utc(member_client):
    """The global's publication time was shown bare ("published, 2026-11-30 22:23"), unlike the
    other pages' times, all UTC."""
    response = member_client.get(reverse("dashboard:compendium"), {"round": 2})
    published = response.context["version"].round.published_at
    assert published is not None
    assert f"published, {published:%Y-%m-%d %H:%M} UTC)" in response.content.decode()


def test_a_registry_link_lands_on_its_tool_first(member_client):
    """A tool id in the registry links to the compendium searched for that id, which also finds
    every tool whose entries mention it; in the demo, BookTool's link listed ABCmouse first (its
    precautions say "use BookTool instead"), local's listed four other tools before it. The tool
    whose id the search names comes first, then the rest by id."""
    from compendium.models import CompendiumVersion, PrecautionEntry, Tool

    latest = member_client.get(reverse("dashboard:compendium")).context["version"]
    PrecautionEntry.objects.create(
        version=CompendiumVersion.objects.get(pk=latest.pk), tool=Tool.objects.get(tool_id="calculator"),
        text="Do not use for the weather (use weather instead)",
    )
    tools = member_client.get(reverse("dashboard:tools")).content.decode()
    link = reverse("dashboard:compendium") + "?q=weather"
    assert f'href="{link}"' in tools
    response = member_client.get(link)
    assert [c.tool.tool_id for c in response.context["cards"]] == ["weather", "calculator"]
    # The same with the id in another case: the tool it names still comes first.
    response = member_client.get(reverse("dashboard:compendium"), {"q": "WEATHER"})
    assert [c.tool.tool_id for c in response.context["cards"]] == ["weather", "calculator"]


def test_pandas_is_whole_before_any_figure_is_built():
    """Plotly's validators read sys.modules["pandas"] without the import lock; a gunicorn
    worker's router warm-up thread imports pandas (through scikit-learn) while requests build
    charts, and in the demo a chart page got a 500 ("partially initialized module 'pandas' has
    no attribute 'Series'"). Loading the URLconf, as synapse_web.wsgi does before that thread
    starts, now leaves pandas wholly imported."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, django; django.setup()\n"
        "from importlib import import_module\n"
        "from django.conf import settings\n"
        "import_module(settings.ROOT_URLCONF)\n"
        "pandas = sys.modules.get('pandas')\n"
        "print(pandas is not None and hasattr(pandas, 'Series'))\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "synapse_web.settings"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True"
