"""The dashboard's organization, round, audit, privacy, conflict, accuracy and routing pages, for
every role: the operator, an admin of A, a read-only member of A, and an admin of B."""

from __future__ import annotations

import csv
import html
import io
import json
import re

import pytest
from django.test import RequestFactory
from django.urls import reverse

from federation import people, services, submissions
from federation.dashboard import views
from federation.errors import BudgetExceeded
from federation.models import (
    AuditLog,
    Client,
    ClientToken,
    ConflictDecision,
    ConflictLogEntry,
    MergeRecord,
    PrivacyLedgerEntry,
    Round,
    SimulationRun,
)
from tests.federation_fixtures import SYSTEM

pytestmark = pytest.mark.django_db

PAGES = [
    "dashboard:organizations",
    "dashboard:conflicts",
    "dashboard:privacy",
    "dashboard:accuracy",
    "dashboard:routing",
    "dashboard:audit",
]
ROLES = ["operator", "admin_a", "member_a", "admin_b"]


def figures_in(content: str) -> list[dict]:
    return [json.loads(html.unescape(raw)) for raw in re.findall(r'data-plotly="([^"]*)"', content)]


def login(client, fed, role):
    client.force_login(getattr(fed, role))
    return client


# --- access --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAGES + ["dashboard:organization"])
def test_anonymous_is_sent_to_login(client, fed, name):
    url = reverse(name, args=["org-a"]) if name == "dashboard:organization" else reverse(name)
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_the_login_page_says_where_logins_and_new_passwords_come_from(client, fed):
    # it named only `make demo`, which a deployed federation's people never run
    body = html.unescape(client.get(reverse("login")).content.decode())
    assert "admin of your organization or the federation operator" in body
    assert "a new password if you forgot yours" in body


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_for_every_role_and_is_in_the_nav(client, fed, role, name):
    response = login(client, fed, role).get(reverse(name))
    assert response.status_code == 200
    nav = [item["url"] for item in response.context["nav_items"]]
    assert reverse(name) in nav


def test_post_actions_need_csrf(fed):
    from django.test import Client as HttpClient

    http = HttpClient(enforce_csrf_checks=True)
    http.force_login(fed.admin_a)
    response = http.post(reverse("dashboard:client-enroll", args=["org-a"]), {"name": "x"})
    assert response.status_code == 403
    assert not Client.objects.filter(name="x").exists()
    # the dashboard's page saying what happened and what to do, not Django's bare refusal
    body = response.content.decode()
    assert "<h1>Form expired</h1>" in body and "reload the page and send the form again" in body


# --- organizations -------------------------------------------------------------------------------


def test_organization_list_is_scoped(client, fed):
    body = login(client, fed, "admin_a").get(reverse("dashboard:organizations")).content.decode()
    assert "Org A" in body and "Org B" not in body
    body = login(client, fed, "operator").get(reverse("dashboard:organizations")).content.decode()
    assert "Org A" in body and "Org B" in body


def test_admin_of_b_gets_404_on_a(client, fed):
    login(client, fed, "admin_b")
    assert client.get(reverse("dashboard:organization", args=["org-a"])).status_code == 404
    for action in ("approve", "rotate", "revoke"):
        url = reverse("dashboard:client-action", args=["org-a", fed.pending_a.pk, action])
        assert client.post(url).status_code == 404
    assert client.post(reverse("dashboard:client-enroll", args=["org-a"]), {"name": "evil"}).status_code == 404
    # a client of A addressed under B's slug is not found either
    url = reverse("dashboard:client-action", args=["org-b", fed.client_a.pk, "revoke"])
    assert client.post(url).status_code == 404
    fed.client_a.refresh_from_db()
    assert fed.client_a.status == "approved"
    assert not Client.objects.filter(name="evil").exists()


def test_member_sees_but_cannot_act(client, fed):
    login(client, fed, "member_a")
    page = client.get(reverse("dashboard:organization", args=["org-a"]))
    assert page.status_code == 200
    body = page.content.decode()
    assert "a-pending" in body and "a1" in body
    assert 'id="enroll"' not in body and "Rotate token" not in body
    response = client.post(reverse("dashboard:client-enroll", args=["org-a"]), {"name": "m"})
    assert response.status_code == 403
    assert "admin" in response.content.decode()
    assert "<h1>Not allowed</h1>" in response.content.decode()
    url = reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "revoke"])
    assert client.post(url).status_code == 403
    fed.client_a.refresh_from_db()
    assert fed.client_a.status == "approved" and not Client.objects.filter(name="m").exists()


def test_admin_enrolls_and_operator_approves_with_the_token_shown_once(client, fed):
    login(client, fed, "admin_a")
    response = client.post(
        reverse("dashboard:client-enroll", args=["org-a"]), {"name": "lab-7", "contact": "it@a"}
    )
    assert response.status_code == 302
    new = Client.objects.get(organization=fed.org_a, name="lab-7")
    assert new.status == "pending"
    assert AuditLog.objects.filter(action="client.enroll", target_id=str(new.pk), actor=fed.admin_a).exists()
    # federation policy: admins may not approve by default
    url = reverse("dashboard:client-action", args=["org-a", new.pk, "approve"])
    denied = client.post(url)
    assert denied.status_code == 403 and "allow_admin_approval" in denied.content.decode()
    new.refresh_from_db()
    assert new.status == "pending"

    login(client, fed, "operator")
    response = client.post(url)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    token = response.context["issued_token"]
    assert token.startswith("syn_c_") and token in response.content.decode()
    assert services.client_for_token(token) == new
    stored = ClientToken.objects.get(client=new)
    assert stored.token_hash == services.hash_token(token) and token not in stored.token_hash
    again = client.get(reverse("dashboard:organization", args=["org-a"])).content.decode()
    assert token not in again and stored.prefix in again
    assert token not in json.dumps(list(AuditLog.objects.values("details", "target_label")))


@pytest.mark.parametrize(("url_name", "args", "data", "words"), [
    ("dashboard:client-enroll", ["org-a"], {"name": "l" * 201}, "name is at most 200 characters"),
    ("dashboard:client-enroll", ["org-a"], {"name": "lab-8", "contact": "c" * 255},
     "contact is at most 254 characters"),
    ("dashboard:client-enroll", ["org-a"], {"name": "lab-9", "description": "d" * 2001},
     "description is at most 2000 characters"),
    ("dashboard:organizations", [], {"name": "Org C", "description": "d" * 2001},
     "description is at most 2000 characters"),
    ("dashboard:person-add", ["org-a"],
     # cut at 254 characters it would be another valid address, ending in "abcde"
     {"username": "carol", "email": "carol@" + "abcdefgh." * 30 + "org"},
     "e-mail address is at most 254 characters"),
])
def test_an_over_long_form_value_is_refused_not_cut(client, fed, url_name, args, data, words):
    """A value longer than the form allows (a script, a pasted text) is a 400 naming the field:
    cutting it would store a name, contact or address other than the one given."""
    login(client, fed, "operator")
    before = AuditLog.objects.count()
    response = client.post(reverse(url_name, args=args), data)
    assert response.status_code == 400 and words in response.content.decode()
    assert AuditLog.objects.count() == before
    assert not Client.objects.filter(name__startswith="l" * 20).exists()
    assert not Client.objects.filter(name__in=["lab-8", "lab-9"]).exists()
    assert not fed.org_a.memberships.filter(user__username="carol").exists()


def test_an_over_long_revoke_reason_is_refused_and_the_client_stays(client, fed):
    login(client, fed, "admin_a")
    url = reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "revoke"])
    response = client.post(url, {"reason": "r" * 501})
    assert response.status_code == 400 and "reason is at most 500 characters" in response.content.decode()
    fed.client_a.refresh_from_db()
    assert fed.client_a.status == "approved" and not AuditLog.objects.filter(action="client.revoke").exists()


def test_admin_may_approve_when_the_policy_allows(client, fed):
    services.update_settings(SYSTEM, allow_admin_approval=True)
    login(client, fed, "admin_a")
    url = reverse("dashboard:client-action", args=["org-a", fed.pending_a.pk, "approve"])
    response = client.post(url)
    assert response.status_code == 200 and response.context["issued_token"]
    # approving twice is a clear 409, not a second token
    again = client.post(url)
    assert again.status_code == 409 and "pending" in again.content.decode()
    # the way back is the page the button was on, not the action's URL
    page = "http://testserver" + reverse("dashboard:organization", args=["org-a"])
    again = client.post(url, HTTP_REFERER=page)
    assert f'<a href="{page}" id="back">Back</a>' in again.content.decode()
    elsewhere = client.post(url, HTTP_REFERER="https://evil.example/")
    assert f'<a href="{reverse("dashboard:overview")}" id="back">' in elsewhere.content.decode()
    # From the token page the approval answered (without JavaScript the browser's address is the
    # action's, which answers POST only): back to the organization page, not to a 405.
    again = client.post(url, HTTP_REFERER="http://testserver" + url)
    organization = reverse("dashboard:organization", args=["org-a"])
    assert f'<a href="{organization}" id="back">Back</a>' in again.content.decode()
    conflict = reverse("dashboard:conflict-decide", args=[1])
    assert views.back_url(RequestFactory().post(url, HTTP_REFERER="http://testserver" + conflict)) \
        == reverse("dashboard:conflicts")


@pytest.mark.parametrize("url", [
    "/rounds/open/", "/rounds/2/close/", "/organizations/org-a/enroll/",
    "/organizations/org-a/people/add/", "/conflicts/1/decide/",
])
def test_a_get_on_a_forms_action_is_a_page_that_says_so(client, fed, url):
    """A form's action opened with a GET (a sign-in's ?next= after the session ran out, a
    bookmark, a reload) was a blank 405: it says what the address is and leads back."""
    login(client, fed, "operator")
    before = AuditLog.objects.count()
    response = client.get(url)
    assert response.status_code == 405 and response["Allow"] == "POST"
    body = html.unescape(response.content.decode())
    assert "takes a POST" in body and "<h1>Not possible here</h1>" in body
    assert f'<a href="{reverse("dashboard:overview")}" id="back">' in body
    assert AuditLog.objects.count() == before


def test_a_page_that_is_not_there_is_the_dashboards_not_found(client, fed, settings):
    settings.DEBUG = False  # as make demo serves it
    login(client, fed, "admin_a")
    response = client.get("/organizations/org-b/")  # another organization's page
    assert response.status_code == 404
    body = response.content.decode()
    assert "<h1>Not found</h1>" in body and 'href="/"' in body and "Org B" not in body


def test_admin_rotates_and_revokes(client, fed):
    login(client, fed, "admin_a")
    rotate = reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "rotate"])
    response = client.post(rotate)
    assert response.status_code == 200
    new_token = response.context["issued_token"]
    assert new_token != fed.token_a
    with pytest.raises(services.TokenRejected):
        services.client_for_token(fed.token_a)
    assert services.client_for_token(new_token) == fed.client_a
    revoke = reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "revoke"])
    assert client.post(revoke, {"reason": "lost laptop"}).status_code == 302
    fed.client_a.refresh_from_db()
    assert fed.client_a.status == "revoked"
    with pytest.raises(services.TokenRejected):
        services.client_for_token(new_token)
    entry = AuditLog.objects.filter(action="client.revoke").first()
    assert entry.details["reason"] == "lost laptop" and entry.actor == fed.admin_a
    assert client.post(revoke).status_code == 409
    assert client.post(reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "bogus"])).status_code == 404


def test_rotating_a_clients_token_asks_first(client, fed):
    """Rotating stops the client's current token at once (a running client fails its next
    submission until it is reconfigured), as revoking does: the button asks before it is sent."""
    page = login(client, fed, "admin_a").get(
        reverse("dashboard:organization", args=["org-a"])).content.decode()
    rotate = reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "rotate"])
    [form] = re.findall(rf'<form method="post" action="{re.escape(rotate)}"[^>]*>', page)
    assert 'data-confirm="Rotate the token of a1? Its current token stops working at once' in form


def test_enroll_and_add_are_not_actions_on_a_named_client_or_person(client, fed):
    """clients/<id>/enroll/ enrolled a new client and people/<id>/add/ added a new login, whatever
    the id named (as rounds/<N>/open/ opened the next round): enrolling and adding have one address
    each, and these are 404 with nothing stored."""
    login(client, fed, "admin_a")
    clients, logins = Client.objects.count(), people.people(fed.operator).count()
    enroll = f"/organizations/org-a/clients/{fed.client_a.pk}/enroll/"
    assert client.post(enroll, {"name": "a-twin"}).status_code == 404
    add = f"/organizations/org-a/people/{fed.member_a.pk}/add/"
    assert client.post(add, {"username": "carol", "role": "member"}).status_code == 404
    assert Client.objects.count() == clients and people.people(fed.operator).count() == logins


def test_organization_page_shows_edge_figures(client, fed):
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    r1 = Round.objects.get(number=1)
    store_compendium(Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "rain?"}]}),
                     kind="client", round=r1, client=fed.client_a)
    store_compendium(Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "rain?"}]}),
                     kind="edge", round=r1, organization=fed.org_a)
    from federation.models import MergeRecord

    MergeRecord.objects.create(
        round=r1, organization=fed.org_a,
        stats={"scenarios_in": 40, "confusion_margin": 0.3719,
               "dropped_sources": [f"client:{fed.client_a.pk}"], "summarizer": "llm-single-shot",
               "summaries": {"llm-single-shot": 2, "probe-extractive": 5},
               "summarizer_fallbacks": [
                   {"summarizer": "llm-single-shot", "tool_id": "weather",
                    "reason": "LLM answer is not JSON: 'Sure'"}] * 5},
        flagged=[{"source": "x", "tool_id": "weather", "text": "t"}] * 3,
    )
    r2 = Round.objects.get(number=2)
    MergeRecord.objects.create(round=r2, organization=fed.org_a, stats={"scenarios_in": 4})
    response = login(client, fed, "member_a").get(reverse("dashboard:organization", args=["org-a"]))
    page = response.content.decode()
    [fig] = figures_in(page)
    assert fig["data"][0]["y"] == [1, 0]  # round 2: a merge record, no submission stored
    assert fig["data"][1]["y"][0] > 0
    assert "dropped by<br>the cross-checks" in page
    assert re.search(r'class="num confusion">3 of 40 <span class="meta">\(margin 0\.37\)', page)
    # The client whose whole submission the implausible-source check dropped, by name.
    assert f'class="meta dropped-clients">whole submission of {fed.client_a.name}</span>' in page
    # What the summarizer did: 7 summaries, 2 of them the LLM's, the reason for the 5 fallbacks.
    second, first = re.findall(r'<td class="num summaries">(.*?)</td>', page)  # newest first
    assert first.startswith("7 ") and "(2 by the LLM, 5 fell back)" in first
    assert "LLM answer is not JSON" in first
    assert second == "–"  # a record from before the counts were kept


def test_organization_page_says_where_krum_judged_groups_past_its_premise(client, fed):
    """An edge merged under Krum at an f share of 0.25 with 4 clients judged groups of n = 4 at
    f = 1, below Krum's premise n ≥ 2f + 3: the edge's row is followed by a line saying so. A
    round under the trimmed mean has no such line, whatever its record holds."""
    r1, r2 = Round.objects.get(number=1), Round.objects.get(number=2)
    Round.objects.filter(pk=r1.pk).update(config={"epsilon": 1.0, "robust_rule": "krum",
                                                  "trim_fraction": 0.25})
    Round.objects.filter(pk=r2.pk).update(config={"epsilon": 1.0, "robust_rule": "trimmed-mean",
                                                  "trim_fraction": 0.25})
    premise = {"krum_below_premise": 12, "krum_below_premise_sizes": [{"n": 4, "f": 1, "groups": 12}]}
    MergeRecord.objects.create(round=r1, organization=fed.org_a,
                               stats={"scenarios_in": 40, "robust_dropped": 14, **premise})
    MergeRecord.objects.create(round=r2, organization=fed.org_a,
                               stats={"scenarios_in": 40, "robust_dropped": 20, **premise})
    for role in ("operator", "admin_a"):
        body = html.unescape(login(client, fed, role).get(
            reverse("dashboard:organization", args=["org-a"])).content.decode())
        [line] = re.findall(r'<p class="hint krum-premise" id="krum-premise-(\d+)">(.*?)</p>', body)
        assert line[0] == "1"
        assert line[1] == (
            "Round 1: Krum judged 12 groups (a tool's batches across the edge's clients, or a "
            "scenario cluster's members) with fewer than 2f + 3 inputs (n = 4, f = 1): its "
            "guarantee does not hold there. At this f share (0.25) every group of 5 or more inputs "
            "meets it. The trimmed mean needs only n > 2f, which every group meets.")
    # No count (a record from before it was kept, or none below the premise): nothing said.
    MergeRecord.objects.filter(round=r1).update(stats={"scenarios_in": 40})
    body = login(client, fed, "operator").get(
        reverse("dashboard:organization", args=["org-a"])).content.decode()
    assert "krum-premise" not in body and "2f + 3" not in body


def test_pages_say_where_the_llm_left_consistency_questions_unanswered(client, fed):
    """An LLM down mid-merge: the pairs it did not judge were merged on their flags alone, a
    contradiction only it would have caught with no conflict logged; the edge's row (and the
    server merge on the Compendium page) says so, as a count; nothing where every question was
    answered."""
    r1 = Round.objects.get(number=1)
    MergeRecord.objects.create(round=r1, organization=fed.org_a, stats={
        "scenarios_in": 40, "consistency_asked": 1200, "consistency_unanswered": 1200})
    body = html.unescape(login(client, fed, "admin_a").get(
        reverse("dashboard:organization", args=["org-a"])).content.decode())
    [line] = re.findall(
        r'<p class="hint unanswered-consistency" id="unanswered-consistency-1">(.*?)</p>', body)
    assert line == (
        "Round 1: The LLM gave no usable answer to 1,200 of the edge merge's 1,200 consistency "
        "questions (unreachable, or no Consistent/Inconsistent in its answer): those pairs of "
        "scenarios were judged by their precondition flags alone, so a contradiction only the "
        "LLM would have caught merged with no conflict logged.")
    MergeRecord.objects.filter(round=r1).update(stats={
        "scenarios_in": 40, "consistency_asked": 1200, "consistency_unanswered": 0})
    body = login(client, fed, "admin_a").get(
        reverse("dashboard:organization", args=["org-a"])).content.decode()
    assert "unanswered-consistency" not in body


def test_organization_page_counts_the_flag_names_the_edge_held_back(client, fed):
    """The edge merge leaves off a precondition flag name fewer than two of its clients carried
    for a tool (`MergeStats.flags_held_back`); the record counted them but no page said so. The
    edge's row is followed by the count (never a name); nothing without one."""
    r1 = Round.objects.get(number=1)
    MergeRecord.objects.create(round=r1, organization=fed.org_a,
                               stats={"scenarios_in": 40, "flags_held_back": 3})
    for role in ("operator", "admin_a"):
        body = html.unescape(login(client, fed, role).get(
            reverse("dashboard:organization", args=["org-a"])).content.decode())
        [line] = re.findall(r'<p class="hint flags-held-back" id="flags-held-back-1">(.*?)</p>',
                            body)
        assert line == (
            "Round 1: 3 precondition flag names were left off the edge compendium: fewer than "
            "2 of the edge's clients carried each for its tool (a name only one source writes "
            "could name a person or an account).")
    MergeRecord.objects.filter(round=r1).update(stats={"scenarios_in": 40, "flags_held_back": 0})
    body = login(client, fed, "operator").get(
        reverse("dashboard:organization", args=["org-a"])).content.decode()
    assert "flags-held-back" not in body


def test_organization_edge_table_is_paginated_newest_first(client, fed):
    """The edge figures grow by a row each round: the table shows 50 rounds a page, the latest
    first, with links to the older ones (it listed every round the edge ever merged)."""
    rounds = [Round.objects.create(number=n, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
              for n in range(3, 63)]
    MergeRecord.objects.bulk_create(
        MergeRecord(round=r, organization=fed.org_a, stats={"conflicts": r.number}) for r in rounds)
    url = reverse("dashboard:organization", args=["org-a"])
    login(client, fed, "admin_a")

    def shown(page):
        return [int(n) for n in re.findall(r'<tr><td class="num">(\d+)</td>', page)]

    first = client.get(url).content.decode()
    assert shown(first) == list(range(62, 12, -1))
    assert 'page 1 of 2 (60 rounds)' in first and f'href="{url}?page=2#edge"' in first
    second = client.get(url, {"page": 2}).content.decode()
    assert shown(second) == list(range(12, 2, -1))
    # the chart still draws every round
    [fig] = figures_in(first)
    assert fig["data"][0]["x"] == list(range(3, 63))
    # A page shown in answer to a form (a rotated token) links to the organization's pages, not
    # to ?page=2 of the form's action (a GET there is refused).
    rotated = client.post(
        reverse("dashboard:client-action", args=["org-a", fed.client_a.pk, "rotate"])
    ).content.decode()
    assert f'href="{url}?page=2#edge" rel="next"' in rotated


# --- rounds --------------------------------------------------------------------------------------


def test_operator_closes_opens_and_retries_rounds(client, fed):
    login(client, fed, "operator")
    overview = client.get(reverse("dashboard:overview")).content.decode()
    assert "round-controls" in overview and "Close" in overview
    assert client.post(reverse("dashboard:round-action", args=[2, "close"])).status_code == 302
    assert Round.objects.get(number=2).state == "closing"
    assert 'id="open-round"' in client.get(reverse("dashboard:overview")).content.decode()
    response = client.post(reverse("dashboard:round-open"), {
        "epsilon": "0.5", "mask_strength": "0.8", "tau": "0.9", "summarizer": "centroid",
        "robust_rule": "krum", "trim_fraction": "0.25", "seed": "7"})
    assert response.status_code == 302
    r3 = Round.objects.get(number=3)
    assert r3.state == "open"
    assert (r3.config["epsilon"], r3.config["mask_strength"], r3.config["tau"]) == (0.5, 0.8, 0.9)
    assert (r3.config["summarizer"], r3.config["robust_rule"], r3.config["seed"]) == ("centroid", "krum", 7)
    assert r3.config["trim_fraction"] == 0.25
    assert "(f = ⌊0.25·n⌋)" in client.get(reverse("dashboard:overview")).content.decode()
    assert AuditLog.objects.filter(action="round.open", target_id=str(r3.pk), actor=fed.operator).exists()
    # a second open round is refused with the reason
    again = client.post(reverse("dashboard:round-open"), {"epsilon": "1"})
    assert again.status_code == 409 and "still open" in again.content.decode()
    # a refusal's page is headed for what it is, not "Bad request" whatever the status
    assert "<h1>Not possible now</h1>" in again.content.decode()
    published = client.post(reverse("dashboard:round-action", args=[1, "close"]))
    assert published.status_code == 409
    assert "this needs an open round" in html.unescape(published.content.decode())
    services.close_round(SYSTEM, r3)
    services.mark_failed(r3, "worker lost")
    # with no submission its merge fails again at once: no Retry button, but why not
    page = client.get(reverse("dashboard:overview")).content.decode()
    assert reverse("dashboard:round-action", args=[3, "retry"]) not in page
    assert "no submission to merge: a retry would fail again" in page
    # a failed round with submissions keeps its Retry button (the row's state set directly: the
    # page is what is tested)
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client",
        round=Round.objects.get(number=1), client=fed.client_a)
    Round.objects.filter(number=1).update(state="failed")
    page = client.get(reverse("dashboard:overview")).content.decode()
    assert reverse("dashboard:round-action", args=[1, "retry"]) in page
    Round.objects.filter(number=1).update(state="published")
    # nor does the action accept it: refused (409) naming why, the round left as it was
    refused = client.post(reverse("dashboard:round-action", args=[3, "retry"]))
    assert refused.status_code == 409
    assert "no submission to merge" in html.unescape(refused.content.decode())
    assert Round.objects.get(number=3).state == "failed"
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it snow"}]}), kind="client", round=r3,
        client=fed.client_b)
    assert client.post(reverse("dashboard:round-action", args=[3, "retry"])).status_code == 302
    assert Round.objects.get(number=3).state == "closing"
    assert AuditLog.objects.filter(action="round.retry", actor=fed.operator).exists()


def test_no_retry_is_offered_on_a_failed_round_a_later_publication_left_behind(client, fed):
    """Found by review: a failed round with submissions kept its Retry button after a later round
    was published, though `retry_round` refuses it then (globals are published in round order):
    the button could only ever answer 409. The page says why instead, as for a round without a
    submission to merge."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    login(client, fed, "operator")
    r1, r2 = Round.objects.get(number=1), Round.objects.get(number=2)
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client", round=r1,
        client=fed.client_a)
    Round.objects.filter(pk=r1.pk).update(state="failed", failure_reason="worker lost")
    Round.objects.filter(pk=r2.pk).update(state="published")
    retry = reverse("dashboard:round-action", args=[1, "retry"])
    page = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert retry not in page
    assert "round 2 is published after it: it cannot be retried" in page
    # the button would only have been refused
    refused = client.post(retry)
    assert refused.status_code == 409 and "round 2 is published already" in html.unescape(
        refused.content.decode())
    # before round 2 is published, the Retry button is there
    Round.objects.filter(pk=r2.pk).update(state="open")
    assert retry in client.get(reverse("dashboard:overview")).content.decode()


def test_operator_fails_a_round_whose_merge_is_stuck_from_the_dashboard(client, fed):
    """Found by review: a round left `merging` by a worker that died with its message (the whole
    worker killed: Redis gives the message back only after its visibility timeout, 12 h) could
    be failed, and so retried, only through the API; the overview showed it merging, with no
    action. It now has a Fail form, which takes a reason."""
    login(client, fed, "operator")
    r2 = Round.objects.get(number=2)
    fail = reverse("dashboard:round-action", args=[2, "fail"])
    assert fail not in client.get(reverse("dashboard:overview")).content.decode()  # open
    services.close_round(SYSTEM, r2)
    Round.objects.filter(pk=r2.pk).update(state="merging")
    page = client.get(reverse("dashboard:overview")).content.decode()
    assert f'action="{fail}"' in page and 'name="reason"' in page
    # a reason is needed: the round and its audit entry say why it failed
    refused = client.post(fail, {"reason": "  "})
    assert refused.status_code == 400 and "reason" in html.unescape(refused.content.decode())
    assert Round.objects.get(pk=r2.pk).state == "merging"
    # another person may not
    client.logout()
    login(client, fed, "member_a")
    assert client.post(fail, {"reason": "x"}).status_code == 403
    client.logout()
    login(client, fed, "operator")
    done = client.post(fail, {"reason": "its worker was killed"}, follow=True)
    assert "Round 2 failed: its worker was killed." in html.unescape(done.content.decode())
    r2.refresh_from_db()
    assert r2.state == "failed" and r2.failure_reason == "its worker was killed"
    entry = AuditLog.objects.get(action="round.fail", target_id=str(r2.pk))
    assert entry.actor == fed.operator and entry.details == {"reason": "its worker was killed"}
    # a round that is not closing or merging is refused, naming why
    again = client.post(fail, {"reason": "again"})
    assert again.status_code == 409 and "cannot fail round 2: it is failed" in html.unescape(
        again.content.decode())


def test_a_rounds_own_url_does_not_open_a_round(client, fed):
    """rounds/<N>/open/ opened the next round whatever N named (the round-action route took
    "open" as an action); opening a round is rounds/open/ alone."""
    login(client, fed, "operator")
    services.close_round(SYSTEM, Round.objects.get(number=2))
    before = Round.objects.count()
    response = client.post(reverse("dashboard:round-action", args=[1, "open"]), {"epsilon": "1"})
    assert response.status_code == 404
    assert Round.objects.count() == before


def test_the_round_form_notes_krum_s_premise_and_warns_where_an_edge_falls_below_it(client, fed):
    """The form says what Krum's guarantee needs (n ≥ 2f + 3); under Krum, the open round and the
    form's defaults name the organizations whose approved clients make a tool's group below it
    (Org A, 4 clients at 0.25: f = 1, 4 < 5; Org B's one client is not judged). Nothing under the
    trimmed mean."""
    for name in ("a2", "a3", "a4"):
        services.approve_client(SYSTEM, services.enroll_client(SYSTEM, fed.org_a, name))
    r2 = Round.objects.get(number=2)
    warning = ("Krum at an f share of 0.25: a tool every approved client of an edge reports is "
               "judged below its premise n ≥ 2f + 3, where its guarantee does not hold, at "
               "Org A (n = 4, f = 1).")
    for rule in ("krum", "trimmed-mean"):
        Round.objects.filter(pk=r2.pk).update(state=Round.State.OPEN, config={
            "epsilon": 1.0, "robust_rule": rule, "trim_fraction": 0.25})
        page = html.unescape(login(client, fed, "operator").get(
            reverse("dashboard:overview")).content.decode())
        said = re.search(r'<p class="hint" id="open-krum-warning">(.*?)</p>', page)
        assert (said.group(1) if said else None) == (warning if rule == "krum" else None)
        Round.objects.filter(pk=r2.pk).update(state=Round.State.PUBLISHED)
        page = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
        help_ = re.search(r'<p class="meta" id="robust-rule-help">(.*?)</p>', page).group(1)
        assert "Krum's guarantee needs n ≥ 2f + 3" in help_
        assert "The trimmed mean needs only n > 2f" in help_
        said = re.search(r'<p class="hint" id="krum-warning">(.*?)</p>', page)
        assert (said.group(1) if said else None) == (warning if rule == "krum" else None)


def test_round_form_rejects_bad_config_naming_the_field(client, fed):
    login(client, fed, "operator")
    services.close_round(SYSTEM, Round.objects.get(number=2))
    response = client.post(reverse("dashboard:round-open"), {"epsilon": "-1", "robust_rule": "median",
                                                              "trim_fraction": "0.5"})
    assert response.status_code == 400
    body = response.content.decode()
    assert "epsilon" in body and "robust_rule" in body and "trim_fraction" in body
    assert not Round.objects.filter(number=3).exists()


def test_the_round_form_sets_the_field_cap_and_the_other_fields_the_api_takes(client, fed):
    login(client, fed, "operator")
    services.close_round(SYSTEM, Round.objects.get(number=2))
    form = client.get(reverse("dashboard:overview")).content.decode()
    form = html.unescape(form[form.index('id="open-round"'):form.index("</form>", form.index('id="open-round"'))])
    for name in ("field_cap", "textgrad_steps", "max_scenarios_per_tool", "global_metadata",
                 "carry_forward"):
        assert f'name="{name}"' in form
    # the last round set no cap: the field is empty, and the form says what F* does
    assert re.search(r'name="field_cap" value=""', form)
    help_text = client.get(reverse("dashboard:overview")).context["field_cap_help"]
    assert "at most F* tools' statistics" in help_text and "one user can move" in help_text
    assert "2·F* tools' fields" in help_text and "participate takes the round's F*" in help_text
    response = client.post(reverse("dashboard:round-open"), {
        "epsilon": "1", "field_cap": " 5 ", "summarizer": "textgrad", "textgrad_steps": "4",
        "max_scenarios_per_tool": "3", "global_metadata": "stats", "carry_forward": "false"})
    assert response.status_code == 302
    r3 = Round.objects.get(number=3)
    assert r3.config["field_cap"] == 5 and r3.config["textgrad_steps"] == 4
    assert r3.config["max_scenarios_per_tool"] == 3 and r3.config["global_metadata"] == "stats"
    assert r3.config["carry_forward"] is False
    line = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    line = line[line.index('id="open-round-config"'):]
    line = line[: line.index("</p>")]
    assert "field cap F* = 5" in line and "textgrad (4 steps)" in line
    assert "global M stats" in line and "at most 3 scenarios per tool" in line
    assert "carry-forward off" in line
    # the next round's form proposes this round's cap; left empty, the round has none
    services.close_round(SYSTEM, r3)
    assert re.search(r'name="field_cap" value="5"',
                     client.get(reverse("dashboard:overview")).content.decode())
    assert client.post(reverse("dashboard:round-open"), {"epsilon": "1", "field_cap": ""}).status_code == 302
    r4 = Round.objects.get(number=4)
    assert r4.config["field_cap"] is None and r4.config["carry_forward"] is True
    line = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert "no field cap F*" in line[line.index('id="open-round-config"'):]


@pytest.mark.parametrize(
    "value, says",
    [
        ("0", "greater than or equal to 1"),
        ("-2", "greater than or equal to 1"),
        ("2.5", "valid integer"),
        ("five", "valid integer"),
        ("1e3", "valid integer"),
        ("2147483648", "less than or equal to 2147483647"),  # past the ledger's column
    ],
)
def test_the_round_form_refuses_a_bad_field_cap_naming_the_field(client, fed, value, says):
    login(client, fed, "operator")
    services.close_round(SYSTEM, Round.objects.get(number=2))
    response = client.post(reverse("dashboard:round-open"), {"epsilon": "1", "field_cap": value})
    assert response.status_code == 400
    body = html.unescape(response.content.decode())
    assert "field_cap (field cap F*)" in body and says in body
    assert not Round.objects.filter(number=3).exists()


@pytest.mark.parametrize("role", ["admin_a", "member_a", "admin_b"])
def test_only_the_operator_drives_rounds(client, fed, role):
    login(client, fed, role)
    assert "round-controls" not in client.get(reverse("dashboard:overview")).content.decode()
    assert client.post(reverse("dashboard:round-action", args=[2, "close"])).status_code == 403
    assert client.post(reverse("dashboard:round-open"), {"epsilon": "1"}).status_code == 403
    assert Round.objects.get(number=2).state == "open"


@pytest.mark.usefixtures("every_field_released")
def test_overview_warns_before_the_budget_is_exceeded(client, fed):
    login(client, fed, "operator")
    assert "will be refused" not in client.get(reverse("dashboard:overview")).content.decode()
    # committed: round 1 recorded in the ledger (1.0) + open round 2 reserved (1.0)
    with pytest.raises(BudgetExceeded):
        services.update_settings(SYSTEM, epsilon_budget=1.9)
    services.update_settings(SYSTEM, epsilon_budget=2.5)
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert "will be refused" in body
    assert "committed ε′ from 2 to 3" in body and "privacy budget of 2.5" in body
    # the dashboard's message is the refusal open_round raises, word for word
    services.close_round(SYSTEM, Round.objects.get(number=2))
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    with pytest.raises(BudgetExceeded) as refused:
        services.open_round(SYSTEM, {"epsilon": 1.0})
    assert str(refused.value) in body
    privacy = client.get(reverse("dashboard:privacy")).context["privacy"]
    assert privacy.would_exceed and str(refused.value) in privacy.warning


# --- audit log -----------------------------------------------------------------------------------


def test_audit_log_is_scoped_and_filterable(client, fed):
    login(client, fed, "operator")
    page = client.get(reverse("dashboard:audit"))
    labels = {e.target_label for e in page.context["page_obj"].object_list}
    assert {"org-a/a1", "org-b/b1"} <= labels
    login(client, fed, "admin_a")
    entries = list(client.get(reverse("dashboard:audit")).context["page_obj"].object_list)
    assert entries and all(e.organization_id == fed.org_a.pk for e in entries)
    # a filter for B's entries yields nothing for A's admin
    assert not client.get(reverse("dashboard:audit"), {"organization": "org-b"}).context["page_obj"].object_list
    approve = client.get(reverse("dashboard:audit"), {"action": "client.approve"}).context["page_obj"]
    assert [e.target_label for e in approve.object_list] == ["org-a/a1"]
    assert not client.get(reverse("dashboard:audit"), {"actor": "nobody"}).context["page_obj"].object_list
    today = entries[0].created_at.date().isoformat()
    assert client.get(reverse("dashboard:audit"), {"since": today, "until": today}).context["page_obj"].object_list
    assert not client.get(reverse("dashboard:audit"), {"until": "2000-01-01"}).context["page_obj"].object_list


@pytest.mark.parametrize("params,word", [({"since": "yesterday"}, "since"), ({"action": "x.y"}, "action")])
def test_audit_bad_filter_is_400(client, fed, params, word):
    response = login(client, fed, "operator").get(reverse("dashboard:audit"), params)
    assert response.status_code == 400 and word in response.content.decode()


def test_audit_log_paginates(client, fed):
    for i in range(60):
        services.audit(SYSTEM, AuditLog.Action.SETTINGS_CHANGE, target_type="settings", target_label=f"s{i}")
    page = login(client, fed, "operator").get(reverse("dashboard:audit"), {"action": "settings.change"})
    assert len(page.context["page_obj"].object_list) == 50
    assert page.context["page_obj"].paginator.num_pages == 2
    second = client.get(reverse("dashboard:audit"), {"action": "settings.change", "page": 2})
    assert len(second.context["page_obj"].object_list) == 10


# --- privacy -------------------------------------------------------------------------------------


def test_privacy_page_for_the_operator(client, fed):
    response = login(client, fed, "operator").get(reverse("dashboard:privacy"))
    body = response.content.decode()
    privacy = response.context["privacy"]
    assert privacy.federation.basic_epsilon == pytest.approx(1.0)
    assert len(privacy.ledger.object_list) == 4
    spent, composed = figures_in(body)
    assert [t["name"] for t in spent["data"]] == ["federation", "Org A", "Org B"]
    assert spent["data"][0]["y"] == [pytest.approx(1.0)]
    names = [t["name"] for t in composed["data"]]
    assert "federation: basic" in names and "federation: advanced" in names
    assert composed["layout"]["shapes"][0]["y0"] == privacy.budget  # the cap line
    assert "budget-warning" not in body


def test_privacy_page_is_scoped(client, fed):
    response = login(client, fed, "admin_b").get(reverse("dashboard:privacy"))
    ledger = list(response.context["privacy"].ledger.object_list)
    assert ledger and {e.organization_id for e in ledger} == {fed.org_b.pk}
    assert [n for n, _ in response.context["privacy"].organizations] == ["Org B"]
    spent, _ = figures_in(response.content.decode())
    assert [t["name"] for t in spent["data"]] == ["federation", "Org B"]


@pytest.mark.parametrize("role", ["admin_a", "member_a"])
def test_privacy_page_hides_other_organizations_but_shows_the_federation(client, fed, role):
    response = login(client, fed, role).get(reverse("dashboard:privacy"))
    privacy = response.context["privacy"]
    body = response.content.decode()
    # per-organization: A's row and A's ledger rows only
    assert [n for n, _ in privacy.organizations] == ["Org A"]
    assert {e.organization_id for e in privacy.ledger.paginator.object_list} == {fed.org_a.pk}
    table = body[body.index('id="privacy-organizations"'):]
    table = table[: table.index("</table>")]
    assert "Org A" in table and "Org B" not in table
    ledger = body[body.index('id="ledger"'):]
    assert "Org B" not in ledger[: ledger.index("</table>")]
    spent, _ = figures_in(body)
    assert [t["name"] for t in spent["data"]] == ["federation", "Org A"]
    # federation-wide ε′ is deliberately visible to members, and the page says why
    assert privacy.federation.basic_epsilon == pytest.approx(1.0)
    assert privacy.committed.basic_epsilon == pytest.approx(2.0)
    assert 'id="privacy-scope"' in body and "released to all of them" in body


@pytest.mark.parametrize(
    "role, edges",
    [
        ("operator", {"Org A": ("7", "714.3"), "Org B": ("13", "384.6")}),
        ("admin_a", {"Org A": ("7", "714.3")}),
        ("member_a", {"Org A": ("7", "714.3")}),
        ("admin_b", {"Org B": ("13", "384.6")}),
    ],
)
def test_privacy_ledger_shows_an_edges_k_and_noise_only_to_its_organization_and_the_operator(
    client, fed, role, edges
):
    r1 = Round.objects.get(number=1)
    for org, k in ((fed.org_a, 7), (fed.org_b, 13)):
        PrivacyLedgerEntry.objects.create(
            round=r1, organization=org, tool_id="flights", field="calls", sensitivity=50.0,
            contributors=k, epsilon=0.01, noise_scale=50.0 / (k * 0.01), mechanism="laplace",
        )
    body = login(client, fed, role).get(reverse("dashboard:privacy"), {"tool": "flights"}).content.decode()
    ledger = body[body.index('id="ledger"'):]
    ledger = ledger[: ledger.index("</table>")]
    rows = re.findall(
        r"<tr><td class=\"num\">1</td><td>([^<]*)</td><td class=\"num\">0</td><td><code>flights.calls"
        r"</code></td><td class=\"num\">50</td><td class=\"num\">(\d+)</td><td class=\"num\">0.01</td>"
        r"<td class=\"num\">([\d.,]+)</td>", ledger)
    assert {name: (k, b) for name, k, b in rows} == edges
    # nor does another organization's release show anywhere else on the page
    for _k, b in {("7", "714.3"), ("13", "384.6")} - set(edges.values()):
        assert b not in body


def _release_signal_rows(body: str) -> list[tuple]:
    """The rows of the Privacy page's "What the noise leaves" table: (edge, round, statistics,
    K, ε per statistic, F*, noisy)."""
    section = body[body.index('id="release-signal"'):]
    section = section[: section.index("</section>")]
    return re.findall(r"<tr[^>]*><td>([^<]*)</td><td class=\"num\">(\d+)</td><td class=\"num\">(\d+)"
                      r"</td><td class=\"num\">([^<]*)</td><td class=\"num\">([^<]*)</td>"
                      r"<td class=\"num\">([^<]*)</td><td class=\"num\">([^<]*)</td>", section)


@pytest.mark.parametrize("role", ["operator", "admin_b"])
def test_privacy_page_says_how_many_released_statistics_the_noise_swamps(client, fed, role):
    # Org A released again in a later round, once at K·ε = 10 (b = 0.1 < Δ) and once at
    # K·ε = 1 (b = Δ); Org B's latest is the fixture's round 1, where every b > Δ.
    r3 = Round.objects.create(number=3, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
    for field, eps in (("calls", 1.0), ("success_rate", 0.1)):
        PrivacyLedgerEntry.objects.create(
            round=r3, organization=fed.org_a, tool_id="weather", field=field, sensitivity=1.0,
            contributors=10, epsilon=eps, noise_scale=1.0 / (10 * eps), mechanism="laplace",
            field_cap=2,
        )
    body = login(client, fed, role).get(reverse("dashboard:privacy")).content.decode()
    section = body[body.index('id="release-signal"'):]
    section = section[: section.index("</section>")]
    rows = _release_signal_rows(body)
    expected = {
        "Org A": ("3", "2", "10", "0.1–1", "2", "1 of 2"),
        "Org B": ("1", "2", "3", "0.4–0.6", "none", "2 of 2"),
    }
    if role == "admin_b":  # another organization's K and ε stay hidden
        expected.pop("Org A")
        assert "Org A" not in section
    assert {name: rest for name, *rest in rows} == {k: list(v) for k, v in expected.items()}
    if role == "operator":
        # An erasure re-released Org A's round 3 over 9 clients: the page shows that release,
        # not the superseded one's statistics and K mixed in with it.
        PrivacyLedgerEntry.objects.create(
            round=r3, organization=fed.org_a, release=1, tool_id="weather", field="calls",
            sensitivity=1.0, contributors=9, epsilon=1.0, noise_scale=1.0 / 9, mechanism="laplace",
            field_cap=2,
        )
        body = login(client, fed, role).get(reverse("dashboard:privacy")).content.decode()
        rows = _release_signal_rows(body)
        assert {name: rest for name, *rest in rows}["Org A"] == ["3", "1", "9", "1", "2", "0 of 1"]


@pytest.mark.usefixtures("every_field_released")
def test_privacy_page_shows_the_committed_figure_with_reservations(client, fed):
    response = login(client, fed, "operator").get(reverse("dashboard:privacy"))
    privacy = response.context["privacy"]
    body = html.unescape(response.content.decode())
    assert privacy.federation.basic_epsilon == pytest.approx(1.0)  # recorded in the ledger
    assert privacy.reserved == [(2, pytest.approx(1.0))]  # open round 2, no ledger rows yet
    assert privacy.committed.basic_epsilon == pytest.approx(2.0)
    assert privacy.projected.basic_epsilon == pytest.approx(3.0)  # plus one more round at ε = 1
    committed = body[body.index('id="committed-epsilon"'):]
    assert committed.startswith('id="committed-epsilon"><span class="value">2.000</span>')
    assert "recorded in the ledger plus reserved by rounds not released yet" in committed
    assert "round 2: 1" in body[body.index('id="reserved-epsilon"'):]


def test_privacy_page_names_the_fields_no_edge_released(client, fed):
    """Published rounds whose edges left fields unreleased (drowned before any noise) are named,
    for every member: a fact of the round's counts and configuration."""
    r1 = Round.objects.get(number=1)
    MergeRecord.objects.create(round=r1, organization=fed.org_a,
                               stats={"fields_not_released": ["frequency", "latency_ms"]})
    MergeRecord.objects.create(round=r1, organization=fed.org_b,
                               stats={"fields_not_released": ["latency_ms"]})
    MergeRecord.objects.create(round=Round.objects.get(number=2), organization=fed.org_a,
                               stats={"fields_not_released": ["calls"]})  # not published
    response = login(client, fed, "member_a").get(reverse("dashboard:privacy"))
    assert response.context["privacy"].not_released == [(1, ["frequency", "latency_ms"])]
    body = html.unescape(response.content.decode())
    note = body[body.index('id="not-released"'):]
    assert note.startswith('id="not-released">Fields no edge released, by round: round 1: '
                           "frequency, latency_ms.")
    assert "no noise was drawn and no ε spent on them" in note[: note.index("</p>")]


def test_privacy_ledger_filters_by_round_and_tool(client, fed):
    r2 = Round.objects.get(number=2)
    PrivacyLedgerEntry.objects.create(
        round=r2, organization=fed.org_a, tool_id="flights", field="calls", sensitivity=50.0,
        contributors=2, epsilon=0.0025, noise_scale=10000.0, mechanism="laplace",
    )
    login(client, fed, "operator")

    def rows(**query):
        page = client.get(reverse("dashboard:privacy"), query).context["page_obj"]
        return [(e.round.number, e.tool_id) for e in page.object_list]

    assert set(rows()) == {(2, "flights"), (1, "weather")}
    assert set(rows(round="2")) == {(2, "flights")}
    assert set(rows(tool="WEATH")) == {(1, "weather")}
    assert rows(round="2", tool="weather") == []
    body = client.get(reverse("dashboard:privacy"), {"round": "2"}).content.decode()
    assert "10,000" in body and "1e+04" not in body  # a column of figures without exponents
    assert client.get(reverse("dashboard:privacy"), {"round": "two"}).status_code == 400
    assert client.get(reverse("dashboard:privacy"), {"round": "0"}).status_code == 400


def test_privacy_warning_and_bad_epsilon(client, fed):
    login(client, fed, "member_a")
    body = client.get(reverse("dashboard:privacy"), {"epsilon": "60"}).content.decode()
    assert 'id="budget-warning"' in body and 'id="budget-ok"' not in body
    # an ε that fits says so, in full (6.0001 is not rounded to 6.000)
    body = client.get(reverse("dashboard:privacy"), {"epsilon": "0.0001"}).content.decode()
    assert 'id="budget-ok"' in body and "A round at ε = 0.0001 would be within the budget" in body
    # not "accepted": round 2 is open, and open_round refuses a second open round (409)
    assert "Round 2 is open: the next round can be opened once it has closed" in body
    assert 'id="budget-ok"' not in client.get(reverse("dashboard:privacy")).content.decode()
    assert client.get(reverse("dashboard:privacy"), {"epsilon": "lots"}).status_code == 400
    assert client.get(reverse("dashboard:privacy"), {"epsilon": "-2"}).status_code == 400


# --- conflicts -----------------------------------------------------------------------------------


def conflict_of(fed, org):
    return ConflictLogEntry.objects.get(organization=org)


def test_conflicts_are_scoped(client, fed):
    body = login(client, fed, "admin_a").get(reverse("dashboard:conflicts")).content.decode()
    assert "in Paris" in body and "Berlin" not in body
    assert "Use Weather" in body or "Use weather" in body  # the composed precaution
    body = login(client, fed, "operator").get(reverse("dashboard:conflicts")).content.decode()
    assert "Paris" in body and "Berlin" in body
    assert client.get(reverse("dashboard:conflicts"), {"round": "x"}).status_code == 400
    # the same round parser as the other pages: no negative round, none past a round number
    for raw in ("-1", "0", "99999999999999"):
        refused = client.get(reverse("dashboard:conflicts"), {"round": raw})
        assert refused.status_code == 400 and "round must be a round number" in refused.content.decode()
    assert "Paris" in client.get(reverse("dashboard:conflicts"), {"round": "1"}).content.decode()
    assert "Berlin" not in client.get(reverse("dashboard:conflicts"), {"organization": "org-a"}).content.decode()
    # a filtered page says so and links to the whole review
    filtered = client.get(reverse("dashboard:conflicts"), {"round": "1", "organization": "org-a"}).content.decode()
    assert "Showing only the conflicts of round 1, organization <code>org-a</code>" in filtered
    assert f'<a href="{reverse("dashboard:conflicts")}">show all conflicts</a>' in filtered
    assert "Showing only" not in client.get(reverse("dashboard:conflicts")).content.decode()


def test_a_conflict_logged_again_shows_its_earlier_rounds_decision(client, fed):
    """A decision belongs to its round's log: the same sources contradicting each other again are
    logged again in the next round, undecided, and the page gave no hint that a reviewer had
    decided them before. The undecided conflict shows the earlier round's decision (round, action,
    who, text), to its own organization only, with a form that takes it again; the earlier
    decisions of the whole page are read in one query."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    r1 = Round.objects.get(number=1)
    r2 = Round.objects.get(number=2)
    r2.state = Round.State.PUBLISHED
    r2.save(update_fields=["state"])

    def log(round_, org, centroid_id, word):
        return ConflictLogEntry.objects.create(
            round=round_, organization=org, tool_id="weather", centroid_id=centroid_id,
            centroid={"text": f"Will it rain tomorrow in {word}?", "preconditions": {"has_city": True}},
            dissenters=[{"text": f"Rain in {word} without a city", "preconditions": {"has_city": False}}],
            reason="preconditions disagree",
        )

    ConflictDecision.objects.create(round=r1, organization=fed.org_a, tool_id="weather",
                                    centroid_id="c0", action="dismiss", decided_by=fed.admin_a)
    ConflictDecision.objects.create(round=r1, organization=fed.org_b, tool_id="weather",
                                    centroid_id="c0", action="edit", text="Ask Berlin for the city",
                                    decided_by=fed.admin_b)
    log(r1, None, "s0", "Rome")
    ConflictDecision.objects.create(round=r1, organization=None, tool_id="weather", centroid_id="s0",
                                    action="scenario", text="Rain in Rome without a city",
                                    decided_by=fed.operator)
    again_a, again_b, again_server = log(r2, fed.org_a, "c0", "Paris"), log(r2, fed.org_b, "c0", "Berlin"), log(r2, None, "s0", "Rome")
    fresh = log(r2, fed.org_a, "c1", "Nice")  # never decided before

    login(client, fed, "admin_a")
    card = _conflict_card(client, again_a)
    assert "no decision" in card
    assert "The same conflict (tool and cluster id) was decided in round 1: dismiss by admin_a" in card
    assert 'class="again"' in card and 'name="action" value="dismiss"' in card.split('class="again"')[1]
    assert "decided in round" not in _conflict_card(client, fresh)
    body = client.get(reverse("dashboard:conflicts")).content.decode()
    assert "Ask Berlin" not in body and "Rome" not in body  # another organization's, the server's

    login(client, fed, "admin_b")
    card = _conflict_card(client, again_b)
    assert "decided in round 1: use an edited precaution by admin_b, <q>Ask Berlin for the city</q>" in card
    # taken again in one step: the form carries the earlier decision
    form = card.split('class="again"')[1].split("</form>")[0]
    fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form))
    assert fields["action"] == "edit" and fields["text"] == "Ask Berlin for the city"
    client.post(reverse("dashboard:conflict-decide", args=[again_b.pk]), fields)
    decision = ConflictDecision.objects.get(round=r2, organization=fed.org_b)
    assert (decision.action, decision.text) == ("edit", "Ask Berlin for the city")
    card = _conflict_card(client, again_b)
    assert "decided: use an edited precaution" in card and "decided in round" not in card

    login(client, fed, "operator")
    card = _conflict_card(client, again_server)
    assert "decided in round 1: pick the winning scenario by op" in card
    assert 'value="Rain in Rome without a city"' in card.split('class="again"')[1]

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert client.get(reverse("dashboard:conflicts")).status_code == 200
        return len(captured)

    before = queries()
    for n in range(2, 6):  # more conflicts logged again, each decided in round 1
        log(r1, fed.org_a, f"c{n}", "Lyon")
        ConflictDecision.objects.create(round=r1, organization=fed.org_a, tool_id="weather",
                                        centroid_id=f"c{n}", action="dismiss")
        log(r2, fed.org_a, f"c{n}", "Lyon")
    assert queries() == before


def test_admin_accepts_edits_picks_and_dismisses(client, fed):
    from federation.conflicts import composed_precaution

    conflict = conflict_of(fed, fed.org_a)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    login(client, fed, "admin_a")
    assert client.post(url, {"action": "accept"}).status_code == 302
    decision = ConflictDecision.objects.get()
    assert decision.action == "accept" and decision.text == composed_precaution(conflict)
    assert decision.decided_by == fed.admin_a
    client.post(url, {"action": "edit", "text": "  Do not use  Weather without a city "})
    decision.refresh_from_db()
    assert (decision.action, decision.text) == ("edit", "Do not use Weather without a city")
    client.post(url, {"action": "scenario", "scenario": "Rain in Paris without a city"})
    decision.refresh_from_db()
    assert (decision.action, decision.text) == ("scenario", "Rain in Paris without a city")
    client.post(url, {"action": "dismiss"})
    decision.refresh_from_db()
    assert (decision.action, decision.text) == ("dismiss", "")
    audited = AuditLog.objects.filter(action="conflict.decide", organization=fed.org_a)
    assert [e.details["action"] for e in audited.order_by("id")] == ["accept", "edit", "scenario", "dismiss"]
    # The texts' lengths, never their words nor a digest that would confirm a guess (a picked
    # scenario is a client's text).
    picked = audited.get(details__action="scenario").details
    assert picked == {"action": "scenario", "conflict": conflict.pk,
                      "chars": len("Rain in Paris without a city"), "tool": "weather"}
    assert "Paris" not in str([e.details for e in audited])
    page = client.get(reverse("dashboard:conflicts")).content.decode()
    assert "decided: dismiss" in page


def test_the_edit_field_starts_from_a_precaution_never_from_a_picked_scenario(client, fed):
    """After a winning scenario was picked, the edit field held that scenario (a client's request)
    as if it were the precaution: saved unchanged it became a precaution every organization
    reads. It starts from the composed precaution, or the precaution decided."""
    from federation.conflicts import composed_precaution

    conflict = conflict_of(fed, fed.org_a)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    login(client, fed, "admin_a")

    def edit_value():
        page = client.get(reverse("dashboard:conflicts")).content.decode()
        [value] = re.findall(r'name="text" value="([^"]*)"', page)
        return html.unescape(value)

    client.post(url, {"action": "scenario", "scenario": "Rain in Paris without a city"})
    assert edit_value() == composed_precaution(conflict)
    client.post(url, {"action": "edit", "text": "Ask for the city first"})
    assert edit_value() == "Ask for the city first"


def _conflict_card(client, conflict) -> str:
    """The conflict review page's card of `conflict`, its entities unescaped."""
    body = client.get(reverse("dashboard:conflicts")).content.decode()
    card = body[body.index(f'id="conflict-{conflict.pk}"'):]
    return html.unescape(card[: card.index("</article>")])


def _one_clients_flag_conflict(round_, organization, centroid_id):
    """A logged conflict whose flag `has_city` two clients carried and `jane_doe` one."""
    return ConflictLogEntry.objects.create(
        round=round_, organization=organization, tool_id="weather", centroid_id=centroid_id,
        centroid={"source": "client:1", "tool_id": "weather", "text": "Will it rain in Lyon?",
                  "preconditions": {"has_city": True, "jane_doe": False}, "support": 1},
        dissenters=[
            {"source": "client:2", "tool_id": "weather", "text": "Rain in Lyon without a city",
             "preconditions": {"has_city": False}, "support": 1},
            {"source": "client:1", "tool_id": "weather", "text": "Rain in Lyon for Jane",
             "preconditions": {"jane_doe": True}, "support": 1},
        ],
        reason="preconditions disagree",
    )


def test_a_conflict_log_merged_before_the_flag_rule_is_reviewed_without_one_clients_flag_names(client, fed):
    """A conflict log merged before the flag rule (its merge record has no `flags_held_back`)
    may hold a flag name that one client carried; the merge that reads it does not publish that
    name, yet the page showed, and an accept stored, the precaution composed from the log as
    stored ("... and jane_doe is true"). It is composed as the rule reads the conflict's own
    sources: a name two clients carried stays, one client's is left off. A log merged under the
    rule is composed as it is."""
    from federation.conflicts import composed_precaution, remove_unfit_decisions

    r1 = Round.objects.get(number=1)
    conflict = _one_clients_flag_conflict(r1, fed.org_a, "j0")
    as_stored = composed_precaution(conflict, flags_released=True)
    assert "jane_doe is true" in as_stored and "has_city is false" in as_stored
    composed = composed_precaution(conflict)  # no merge record of round 1: before the rule
    assert composed == composed_precaution(conflict, flags_released=False)
    assert "jane_doe" not in composed and "has_city is false" in composed
    assert "rain in Lyon for Jane" in composed

    login(client, fed, "admin_a")
    assert composed in _conflict_card(client, conflict) and "jane_doe is" not in _conflict_card(client, conflict)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    assert client.post(url, {"action": "accept"}).status_code == 302
    assert ConflictDecision.objects.get(centroid_id="j0").text == composed
    assert remove_unfit_decisions(r1, fed.org_a.pk, "test") == 0  # it fits the log as composed
    # merged under the rule: its names passed it then, and the precaution is composed as stored
    MergeRecord.objects.create(round=r1, organization=fed.org_a,
                               stats={"scenarios_in": 4, "flags_held_back": 0})
    assert composed_precaution(conflict) == as_stored
    ConflictDecision.objects.all().delete()
    assert as_stored in _conflict_card(client, conflict)


def test_an_accept_that_is_no_longer_the_composed_precaution_shows_as_out_of_date(client, fed):
    """An accept stored before the review held a log merged before the flag rule to its sources
    names one client's flag; the merge publishes the precaution as composed now instead
    (`pipeline._conflicts_of`). The page showed the old text as the decision and filled the edit
    field with it. It says the accepted text is out of date, offers the precaution composed now,
    and a new accept stores that. Of a closed conflict (its later merge applied the accept as it
    stood) nothing is said."""
    from federation.conflicts import composed_precaution

    r1 = Round.objects.get(number=1)
    conflict = _one_clients_flag_conflict(r1, fed.org_a, "s0")
    old = composed_precaution(conflict, flags_released=True)
    composed = composed_precaution(conflict)
    assert "jane_doe" in old and "jane_doe" not in composed
    ConflictDecision.objects.create(round=r1, organization=fed.org_a, tool_id="weather",
                                    centroid_id="s0", action="accept", text=old)

    login(client, fed, "admin_a")
    shown = _conflict_card(client, conflict)
    assert "accepted text out of date" in shown and "decided: accept" in shown
    assert f'name="text" value="{composed}"' in shown
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    assert client.post(url, {"action": "accept"}).status_code == 302
    assert ConflictDecision.objects.get(centroid_id="s0").text == composed
    assert "accepted text out of date" not in _conflict_card(client, conflict)
    # closed: round 2's merge of A, published, read the log with the old accept and applied it
    ConflictDecision.objects.filter(centroid_id="s0").update(text=old)
    Round.objects.filter(number=2).update(state=Round.State.PUBLISHED)
    MergeRecord.objects.create(round=Round.objects.get(number=2), organization=fed.org_a,
                               stats={"accepted": 2, "flags_held_back": 0})
    shown = _conflict_card(client, conflict)
    assert "closed: round 2" in shown and "accepted text out of date" not in shown


def test_the_pick_list_shows_the_scenario_picked(client, fed):
    """The winning-scenario list opened on the centroid whatever was picked: the page read as if
    the centroid had won, and pressing Pick replaced the decision with it."""
    conflict = conflict_of(fed, fed.org_a)
    login(client, fed, "admin_a")
    client.post(reverse("dashboard:conflict-decide", args=[conflict.pk]),
                {"action": "scenario", "scenario": "Rain in Paris without a city"})
    page = client.get(reverse("dashboard:conflicts")).content.decode()
    [options] = re.findall(r'<select name="scenario"[^>]*>(.*?)</select>', page)
    assert re.findall(r"<option selected>([^<]*)</option>", options) == ["Rain in Paris without a city"]


@pytest.mark.parametrize("data", [
    {"action": "accept"},
    {"action": "edit", "text": "Ask for the city first"},
    {"action": "scenario", "scenario": "Rain in Paris without a city"},
    {"action": "dismiss"},
])
def test_a_decision_posted_twice_is_recorded_and_audited_once(client, fed, data):
    """A double click (or a reload that posts again) repeats the same decision: nothing changes,
    so nothing more is written to the append-only audit log; a different decision still is."""
    url = reverse("dashboard:conflict-decide", args=[conflict_of(fed, fed.org_a).pk])
    login(client, fed, "admin_a")
    assert client.post(url, data).status_code == 302
    assert client.post(url, {**data, "text": f"  {data.get('text', '')} "}).status_code == 302
    login(client, fed, "operator")
    assert client.post(url, data).status_code == 302  # the same decision confirmed: unchanged
    decision = ConflictDecision.objects.get()
    assert decision.action == data["action"] and decision.decided_by == fed.admin_a
    audited = AuditLog.objects.filter(action="conflict.decide")
    assert [e.details["action"] for e in audited] == [data["action"]]
    other = "dismiss" if data["action"] != "dismiss" else "accept"
    assert client.post(url, {"action": other}).status_code == 302
    assert [e.details["action"] for e in audited.order_by("id")] == [data["action"], other]
    assert ConflictDecision.objects.get().decided_by == fed.operator


def test_a_decision_taken_since_the_page_was_loaded_is_not_replaced_unseen(client, fed):
    """Two reviewers on the same conflict: the operator dismisses it while the organization's
    admin, whose page still shows it undecided, saves an edited precaution. The later post
    replaced the dismissal unseen (each was told its decision applies). The forms carry the
    decision the page showed: a different one taken since is refused (409) naming it, and
    stands; reloaded, the page offers it and a decision replaces it as before. The same decision
    posted again (a double click) is still no change rather than a refusal."""
    conflict = conflict_of(fed, fed.org_a)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])

    def seen_on_page():
        [seen] = set(re.findall(r'name="seen" value="([^"]*)"', _conflict_card(client, conflict)))
        return seen

    login(client, fed, "admin_a")
    stale = seen_on_page()
    assert stale == ""
    login(client, fed, "operator")
    assert client.post(url, {"action": "dismiss", "seen": seen_on_page()}).status_code == 302
    login(client, fed, "admin_a")
    refused = client.post(url, {"action": "edit", "text": "Ask for the city first", "seen": stale})
    assert refused.status_code == 409
    assert f"decided since: dismiss by {fed.operator.get_username()}" in refused.content.decode()
    assert client.post(url, {"action": "dismiss", "seen": stale}).status_code == 302  # the same
    assert (ConflictDecision.objects.get().action, ConflictDecision.objects.get().decided_by) == (
        "dismiss", fed.operator)
    assert AuditLog.objects.filter(action="conflict.decide").count() == 1
    fresh = seen_on_page()
    assert fresh and fresh != stale
    assert client.post(url, {"action": "edit", "text": "Ask for the city first",
                             "seen": fresh}).status_code == 302
    assert ConflictDecision.objects.get().text == "Ask for the city first"


@pytest.mark.parametrize("data,word", [
    ({"action": "edit", "text": "  "}, "needs a text"),
    ({"action": "scenario", "scenario": "something else"}, "winning scenario"),
    ({"action": "approve"}, "action must be"),
])
def test_bad_decisions_are_400(client, fed, data, word):
    url = reverse("dashboard:conflict-decide", args=[conflict_of(fed, fed.org_a).pk])
    response = login(client, fed, "admin_a").post(url, data)
    assert response.status_code == 400 and word in response.content.decode()
    assert not ConflictDecision.objects.exists()


def test_member_and_other_admin_cannot_decide(client, fed):
    url = reverse("dashboard:conflict-decide", args=[conflict_of(fed, fed.org_a).pk])
    body = login(client, fed, "member_a").get(reverse("dashboard:conflicts")).content.decode()
    assert "Accept precaution" not in body
    assert client.post(url, {"action": "dismiss"}).status_code == 403
    assert login(client, fed, "admin_b").post(url, {"action": "dismiss"}).status_code == 404
    assert not ConflictDecision.objects.exists()


def test_decisions_change_the_next_rounds_merge_input(fed):
    """_previous_conflicts (what the next edge merge gets) follows the decisions."""
    from federation.conflicts import decide_conflict
    from federation.pipeline import _previous_conflicts

    r2 = Round.objects.get(number=2)
    for org in (fed.org_a, fed.org_b):  # both edges merged in round 1
        MergeRecord.objects.create(round=Round.objects.get(number=1), organization=org)
    conflict = conflict_of(fed, fed.org_a)
    [entry] = _previous_conflicts(r2, fed.org_a)
    assert (entry.resolution, entry.resolution_text) == ("", "")
    actor = fed.actor(fed.admin_a)
    decide_conflict(actor, conflict, "edit", "Never use Weather without a city")
    [entry] = _previous_conflicts(r2, fed.org_a)
    assert (entry.resolution, entry.resolution_text) == ("precaution", "Never use Weather without a city")
    decide_conflict(actor, conflict, "scenario", "Rain in Paris without a city")
    [entry] = _previous_conflicts(r2, fed.org_a)
    assert (entry.resolution, entry.resolution_text) == ("scenario", "Rain in Paris without a city")
    decide_conflict(actor, conflict, "dismiss")
    assert _previous_conflicts(r2, fed.org_a) == []
    # B's edge is untouched by A's decisions
    [entry_b] = _previous_conflicts(r2, fed.org_b)
    assert entry_b.resolution == ""


def test_resolutions_in_the_pure_merge_helpers(registry):
    from federation.merge import ConflictEntry
    from federation.merge.operator import conflict_winners, conflicts_to_precautions

    base = dict(tool_id="weather", centroid_id="c0",
                centroid={"text": "Rain in Paris?", "preconditions": {"has_city": True}},
                dissenters=[{"text": "Rain without city", "preconditions": {"has_city": False}}],
                reason="")
    [composed] = conflicts_to_precautions([ConflictEntry(**base)], registry)
    assert composed.text.startswith("Use weather for rain in Paris")
    [edited] = conflicts_to_precautions(
        [ConflictEntry(**base, resolution="precaution", resolution_text="Custom text")], registry)
    assert (edited.text, edited.support) == ("Custom text", 2)
    picked = ConflictEntry(**base, resolution="scenario", resolution_text="Rain without city")
    assert conflicts_to_precautions([picked], registry) == []
    [winner] = conflict_winners([picked], registry)
    assert (winner.text, winner.preconditions, winner.support) == ("Rain without city", {"has_city": False}, 2)
    assert conflict_winners([ConflictEntry(**base)], registry) == []


# --- accuracy ------------------------------------------------------------------------------------

DOCUMENT = {
    "summary": [
        {"method": "synapse", "round": 1, "seeds": 2, "accuracy_mean": 0.5, "accuracy_sd": 0.02,
         "macro_accuracy_mean": 0.45},
        {"method": "synapse", "round": 2, "seeds": 2, "accuracy_mean": 0.6, "accuracy_sd": 0.01,
         "macro_accuracy_mean": 0.55},
        {"method": "centralized", "round": None, "seeds": 2, "accuracy_mean": 0.7, "accuracy_sd": 0.0,
         "macro_accuracy_mean": 0.66},
    ],
    "per_category": {"Travel": {"accuracy": 0.8, "n": 10}, "Weather": {"accuracy": 0.4, "n": 5}},
    "adversarial": [
        {"adversarial_mode": "random_corruption", "adversarial_fraction": f, "robust_rule": r,
         "accuracy": a}
        for r, accs in (("none", (0.6, 0.4)), ("krum", (0.6, 0.55)))
        for f, a in zip((0.0, 0.4), accs, strict=True)
    ],
    "privacy_sweep": [
        {"epsilon": e, "mask_strength": m, "accuracy": 0.5 + e / 10, "membership_auroc": 0.5 + e / 20}
        for e in (0.5, 2.0) for m in (0.0, 1.0)
    ],
}


def test_accuracy_empty_state_names_the_command(client, fed):
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    assert "manage.py simulate" in body and "data-plotly" not in body
    # only the operator runs commands on the server: a member is not told to run one
    assert "Run one" not in body and "The federation operator runs one" in body
    body = login(client, fed, "operator").get(reverse("dashboard:accuracy")).content.decode()
    assert "Run one, for example" in body and "--sweep-epsilon" in body


def test_accuracy_page_draws_the_latest_simulation(client, fed):
    run = SimulationRun.objects.create(label="demo sim", dataset="tiny", document=DOCUMENT)
    response = login(client, fed, "admin_b").get(reverse("dashboard:accuracy"))
    body = response.content.decode()
    curves, categories, adversarial, frontier = figures_in(body)
    synapse = next(t for t in curves["data"] if t["name"] == "synapse")
    assert synapse["x"] == [1, 2] and synapse["y"] == [0.5, 0.6]
    flat = next(t for t in curves["data"] if t["name"] == "centralized")
    assert flat["y"] == [0.7, 0.7] and flat["x"] == [1, 2]  # a method without rounds: a line
    assert categories["data"][0]["x"] == ["Travel", "Weather"]
    assert {t["name"] for t in adversarial["data"]} == {
        "random_corruption · none", "random_corruption · krum"}
    assert {t["name"] for t in frontier["data"]} == {"λ = 0.0", "λ = 1.0"}
    assert frontier["data"][0]["x"] == [0.525, 0.6]
    accuracies = [y for t in frontier["data"] for y in t["y"]]
    assert frontier["layout"]["yaxis"]["range"] == [
        pytest.approx(min(accuracies) - 0.05), pytest.approx(max(accuracies) + 0.05)]
    assert "Travel" in body and "demo sim" in body
    assert client.get(reverse("dashboard:accuracy"), {"run": run.pk}).status_code == 200
    assert client.get(reverse("dashboard:accuracy"), {"run": "x"}).status_code == 400
    assert client.get(reverse("dashboard:accuracy"), {"run": run.pk + 99}).status_code == 404


def test_accuracy_curves_give_every_method_its_own_colour(client, fed):
    from federation.simulation.runner import METHODS

    summary = [{"method": m, "round": 1 if m in ("synapse", "reranker_bypass") else None,
                "seeds": 1, "accuracy_mean": 0.5, "accuracy_sd": 0.0, "macro_accuracy_mean": 0.5}
               for m in [*METHODS, "a_method_of_another_version"]]
    SimulationRun.objects.create(label="all methods", dataset="tiny",
                                 document={**DOCUMENT, "summary": summary})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    curves = figures_in(body)[0]
    colors = {t["name"]: t["line"]["color"] for t in curves["data"]}
    assert set(colors) == {row["method"] for row in summary}
    assert len(set(colors.values())) == len(colors)  # a colour each
    # SYNAPSE is drawn over the others and listed first
    assert curves["data"][-1]["name"] == "synapse" and curves["data"][-1]["legendrank"] == 1
    # and a method keeps its colour from one run to the next
    SimulationRun.objects.create(label="two methods", dataset="tiny", document=DOCUMENT)
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    again = {t["name"]: t["line"]["color"] for t in figures_in(body)[0]["data"]}
    assert again == {m: colors[m] for m in ("synapse", "centralized")}


def test_frontier_marks_the_runs_own_configuration(client, fed):
    document = {**DOCUMENT, "config": {"epsilon": 1.0, "mask_strength": 0.5},
                "privacy": {"membership_auroc": 0.7}}
    SimulationRun.objects.create(label="own point", dataset="tiny", document=document)
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    frontier = figures_in(body)[-1]
    [own] = [t for t in frontier["data"] if t["name"].startswith("this run's configuration")]
    # the last round of SYNAPSE (0.6) at the run's own attack AUROC, named in the legend with
    # its ε and λ; no label printed beside it, where it covered the swept points' labels
    assert own["x"] == [0.7] and own["y"] == [0.6]
    assert own["name"] == "this run's configuration (ε=1.0, λ=0.5)"
    assert own["mode"] == "markers" and "text" not in own
    assert frontier["layout"]["title"]["text"] == "Privacy–utility frontier (ε × λ)"
    # a run whose configuration is one of its sweep's rows: that row is the point already
    SimulationRun.objects.create(label="swept", dataset="tiny", document={
        **document, "config": {"epsilon": 2.0, "mask_strength": 1.0}})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    names = {t["name"] for t in figures_in(body)[-1]["data"]}
    assert names == {"λ = 0.0", "λ = 1.0"}


def test_frontier_draws_no_star_where_a_release_sweep_row_is_the_run(client, fed):
    """The release sweep plays the run's configuration at each k: its row at the run's own K (1
    by default) is the run, so no star is drawn beside it, with or without an ε × λ sweep. A run
    with another K than any swept gets its star."""
    release = [
        {"min_users": 1, "accuracy": 0.75, "membership_auroc": 0.72, "bytes_per_client_round": 3.0},
        {"min_users": 3, "accuracy": 0.61, "membership_auroc": 0.55, "bytes_per_client_round": 1.0},
    ]
    document = {**DOCUMENT, "privacy_sweep": [], "release_sweep": release,
                "config": {"epsilon": 1.0, "mask_strength": 0.5},
                "privacy": {"membership_auroc": 0.7}}
    SimulationRun.objects.create(label="release only", dataset="tiny", document=document)
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    names = {t["name"] for t in figures_in(body)[-1]["data"]}
    assert names == {"k-anonymous release"}
    # with an ε × λ sweep that does not hold the run's (ε, λ): its k = 1 row is the run still
    SimulationRun.objects.create(label="both", dataset="tiny", document={
        **document, "privacy_sweep": DOCUMENT["privacy_sweep"]})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    assert not any(t["name"].startswith("this run's configuration")
                   for t in figures_in(body)[-1]["data"])
    # a run at K = 2, swept at 1 and 3 only: no row is it
    SimulationRun.objects.create(label="k=2", dataset="tiny", document={
        **document, "config": {**document["config"], "min_users": 2}})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    assert any(t["name"].startswith("this run's configuration")
               for t in figures_in(body)[-1]["data"])


def test_accuracy_page_tables_the_adversarial_rows_against_the_clean_run(client, fed):
    rows = [
        {"adversarial_mode": "camouflaged_poisoning", "adversarial_fraction": 0.4, "robust_rule": "none",
         "accuracy": 0.54, "accuracy_sd": 0.02, "honest_submissions": 180, "dropped_honest": 1,
         "adversarial_submissions": 120, "dropped_adversarial": 21, "adversarial_scenarios": 1159,
         "relabelled_adversarial_scenarios": 345, "victim_queries": 80,
         "victims_routed_to_target": 6},
        {"adversarial_mode": "coordinated_camouflage", "adversarial_fraction": 0.4,
         "robust_rule": "none", "accuracy": 0.58, "victim_queries": 80,
         "victims_routed_to_target": 6},
        # a row from before the sweep counted submissions: dashes, not zeros
        {"adversarial_mode": "tool_confusion", "adversarial_fraction": 0.2, "robust_rule": "krum",
         "accuracy": 0.3},
    ]
    SimulationRun.objects.create(label="adv", dataset="tiny",
                                 document={**DOCUMENT, "adversarial": rows,
                                           "config": {"camouflage_share": 0.3},
                                           "targeting": {"victim_queries": 80,
                                                         "victims_routed_to_target": 2}})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    assert "Camouflaged poisoning relabels 30% of what it would send honestly" in body
    assert "routes to the target (2.5% in this run without adversaries)" in body
    table = body[body.index('id="accuracy-adversarial-table"'):]
    table = table[: table.index("</table>")]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr><td>.*?</tr>", table)]
    # against the clean run's last SYNAPSE round (0.6)
    assert cells[0] == ["camouflaged_poisoning", "40%", "none", "0.540", "0.020", "0.900",
                        "21 / 120", "1 / 180", "30%", "–"]  # it aims at no one tool
    assert cells[1] == ["coordinated_camouflage", "40%", "none", "0.580", "–", "0.967", "–", "–",
                        "–", "7.5%"]
    assert cells[2] == ["tool_confusion", "20%", "krum", "0.300", "–", "0.500", "–", "–", "–", "–"]
    # the curves carry each row's sd as error bars
    [adversarial] = [f for f in figures_in(body) if f["layout"]["title"]["text"].startswith(
        "Accuracy under adversarial")]
    bars = {t["name"]: t["error_y"]["array"] for t in adversarial["data"]}
    assert bars == {"camouflaged_poisoning · none": [0.02], "coordinated_camouflage · none": [0],
                    "tool_confusion · krum": [0]}
    # A run that itself had adversaries is no clean run to divide by: no "× clean".
    SimulationRun.objects.create(label="adv under attack", dataset="tiny", document={
        **DOCUMENT, "adversarial": rows, "config": {"adversarial_fraction": 0.4}})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    table = body[body.index('id="accuracy-adversarial-table"'):]
    table = table[: table.index("</table>")]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr><td>.*?</tr>", table)]
    assert [row[5] for row in cells] == ["–", "–", "–"]
    assert "in this run without adversaries" not in body


def test_accuracy_page_says_where_the_run_ran(client, fed):
    epyc = {"cpu": "AMD EPYC", "isa": ["avx2", "avx512_vnni"], "embedding_fingerprint": "a94d2abe2a0e4566"}
    other = {"cpu": "Intel Xeon", "isa": ["avx2"], "embedding_fingerprint": "0123456789abcdef"}
    config = {"orgs": 2, "clients_per_org": 2, "rounds": 1, "partition": "iid"}
    SimulationRun.objects.create(label="joined", dataset="tiny", document={
        "config": config, "seeds": [0, 1, 2], "summary": [], "hosts": [epyc, epyc, other]})
    body = login(client, fed, "operator").get(reverse("dashboard:accuracy")).content.decode()
    host = body[body.index('id="run-host"'):]
    host = host[: host.index("</p>")]
    assert ("ran on AMD EPYC (avx2, avx512_vnni), embedding fingerprint a94d2abe2a0e4566; "
            "Intel Xeon (avx2), embedding fingerprint 0123456789abcdef") in host
    # and from which code, where the runs recorded it ("+": with uncommitted changes)
    SimulationRun.objects.create(label="coded", dataset="tiny", document={
        "config": config, "seeds": [0], "summary": [], "host": {**other, "code": "c" * 40 + "+"}})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    assert f"embedding fingerprint 0123456789abcdef, code {'c' * 12}+" in body
    # the server's hardware is the operator's business, not an organization member's
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    assert 'id="run-setup"' in body and "AMD EPYC" not in body and 'id="run-host"' not in body
    # a run stored from a document written before runs recorded their host says it does not
    SimulationRun.objects.create(label="old", dataset="tiny", document={
        "config": config, "seeds": [0], "summary": []})
    body = login(client, fed, "operator").get(reverse("dashboard:accuracy")).content.decode()
    assert "where it ran is not recorded (written before runs recorded their host)" in body


def test_accuracy_page_shows_the_transfer_table_as_a_mean_over_seeds(client, fed):
    transfer = [
        {"seed": seed, "model": model, "reranker": reranker, "llm": llm, "accuracy": acc,
         "macro_accuracy": acc - 0.1, "queries": 50, "fallbacks": fallbacks}
        for seed, shift in ((0, 0.0), (1, 0.1))
        for model, reranker, llm, acc, fallbacks in (
            ("bundled:all-MiniLM-L6-v2", "fusion", None, 0.6 + shift, 0),
            ("onnx-int8:all-MiniLM-L6-v2", "llm", "openai:m@http://llm/v1", 0.5 + shift, 3),
        )
    ]
    SimulationRun.objects.create(label="with transfer", dataset="tiny",
                                 document={**DOCUMENT, "transfer": transfer})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    table = body[body.index('id="accuracy-transfer"'):]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>.*?</tr>", table)
    # the LLM's endpoint is the operator's (see the test below): a member reads its model
    assert rows == [("bundled:all-MiniLM-L6-v2", "fusion", "–"),
                    ("onnx-int8:all-MiniLM-L6-v2", "llm", "openai:m")]
    assert "0.650" in table and "0.550" in table  # mean over the two seeds
    assert "6 / 100" in table  # fallbacks over both seeds
    SimulationRun.objects.all().delete()
    SimulationRun.objects.create(label="no transfer", dataset="tiny", document=DOCUMENT)
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    assert 'id="accuracy-transfer"' not in body and "--transfer-models" in body


def test_accuracy_page_shows_server_paths_of_transfer_models_to_the_operator_only(client, fed):
    """A `--transfer-models` model given as a path on the server (absolute, under ~, behind a
    prefix such as bf16:), and an LLM endpoint's URL, are the operator's, as on the routing
    playground: a member reads the model by its last part, the LLM by its model; a hub name is
    a name, shown as it is."""
    transfer = [
        {"seed": 0, "model": model, "reranker": "fusion", "llm": llm, "accuracy": 0.6,
         "macro_accuracy": 0.5, "queries": 50, "fallbacks": 0}
        for model, llm in (
            ("/home/alice/secret-project/jina-v2", None),
            ("bf16:/home/alice/.cache/synapse/all-mpnet-base-v2", None),
            ("sentence-transformers/all-mpnet-base-v2", "openai:m@http://10.1.2.3:8000/v1"),
            ("bundled:all-MiniLM-L6-v2", "openai:/srv/weights/qwen@http://10.1.2.3:8000/v1"),
        )
    ]
    SimulationRun.objects.create(label="paths", dataset="tiny",
                                 document={**DOCUMENT, "transfer": transfer})

    def rows(role):
        body = login(client, fed, role).get(reverse("dashboard:accuracy")).content.decode()
        table = body[body.index('id="accuracy-transfer"'):]
        table = table[: table.index("</table>")]
        return body, re.findall(r"<tr><td>(.*?)</td><td>.*?</td><td>(.*?)</td>.*?</tr>", table)

    body, member = rows("member_a")
    assert member == [("…/jina-v2", "–"), ("bf16:…/all-mpnet-base-v2", "–"),
                      ("sentence-transformers/all-mpnet-base-v2", "openai:m"),
                      ("bundled:all-MiniLM-L6-v2", "openai:…/qwen")]
    assert "/home/alice" not in body and "10.1.2.3" not in body and "/srv/weights" not in body
    body, operator = rows("operator")
    assert [model for model, _ in operator] == [r["model"] for r in transfer]
    assert [llm for _, llm in operator] == ["–", "–", *(r["llm"] for r in transfer[2:])]


def test_accuracy_page_puts_the_release_sweep_on_the_frontier(client, fed):
    release = [
        {"min_users": 2, "accuracy": 0.61, "membership_auroc": 0.55, "token_overlap": 0.4,
         "bytes_per_client_round": 9000.0},
        {"min_users": 1, "accuracy": 0.75, "membership_auroc": 0.72, "token_overlap": 0.85,
         "bytes_per_client_round": 34000.0},
    ]
    SimulationRun.objects.create(label="release", dataset="tiny",
                                 document={**DOCUMENT, "release_sweep": release})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    frontier = figures_in(body)[-1]
    trace = next(t for t in frontier["data"] if t["name"] == "k-anonymous release")
    assert trace["x"] == [0.72, 0.55] and trace["y"] == [0.75, 0.61]  # ordered by k
    assert "k=2 · 9,000 B" in trace["text"]
    assert frontier["layout"]["title"]["text"] == (
        "Privacy–utility frontier (ε × λ, k-anonymous release)")
    assert "k-anonymous release</h2>" in body and "34000" in body


# --- routing playground --------------------------------------------------------------------------


def test_routing_playground_states(client, fed):
    from routing import services as routing_services

    routing_services.forget_published_version()
    login(client, fed, "member_a")
    empty = client.get(reverse("dashboard:routing"))
    assert empty.status_code == 200 and 'id="route-form"' in empty.content.decode()
    Round.objects.filter(state="published").update(state="failed")
    response = client.get(reverse("dashboard:routing"), {"q": "will it rain?"})
    assert response.status_code == 503 and 'id="route-error"' in response.content.decode()
    bad = client.get(reverse("dashboard:routing"), {"q": "x" * 5000})
    assert bad.status_code == 400 and "too long" in bad.content.decode()
    bad = client.get(reverse("dashboard:routing"), {"q": "rain", "top_k": "many"})
    assert bad.status_code == 400 and "top_k" in bad.content.decode()


def test_why_the_playgrounds_router_could_not_be_built_is_the_operators_alone(
    client, db, monkeypatch, settings
):
    """A member trying a query saw the failed build's exception text (a database host, a server
    path), which only the operator reads elsewhere (the routing API, a failed tuning)."""
    from routing import services as routing_services
    from tests.dashboard_data import add_review_data, build_federation

    routing_services.forget_published_version()
    routing_services.forget_served()
    federation = build_federation()
    review = add_review_data(federation)
    settings.SYNAPSE_ROUTING_REBUILD_SECONDS = 3600
    secret = "connection to db.internal:5432 failed for user synapse"

    def broken(version, tuned_directory=""):
        raise OSError(secret)

    monkeypatch.setattr(routing_services, "build_served", broken)
    try:
        client.force_login(review.acme_member)
        member = client.get(reverse("dashboard:routing"), {"q": "rain?"})
        assert member.status_code == 503 and "could not be built" in member.content.decode()
        assert "db.internal" not in member.content.decode()
        client.force_login(federation.operator)
        operator = client.get(reverse("dashboard:routing"), {"q": "rain?"})
        assert operator.status_code == 503 and "db.internal" in operator.content.decode()
    finally:
        routing_services.forget_served()


def test_routing_playground_routes_against_the_published_compendium(client, db):
    from routing import services as routing_services
    from routing.models import RoutingCall
    from tests.dashboard_data import add_review_data, build_federation

    routing_services.forget_published_version()
    review = add_review_data(build_federation(), embed=True)
    client.force_login(review.acme_member)
    routing_services.recorder.flush()
    calls_before = RoutingCall.objects.count()
    response = client.get(reverse("dashboard:routing"), {"q": "will it rain in Rome tomorrow?"})
    assert response.status_code == 200
    routing_services.recorder.flush()  # trying a query here is not the routing API's traffic
    assert RoutingCall.objects.count() == calls_before
    result = response.context["result"]
    assert result["tool"] == "weather" and result["compendium_round"] == 2
    body = response.content.decode()
    assert 'id="candidates"' in body and "Will it rain tomorrow in a city?" in body
    assert 0 <= result["confidence"] <= 1
    # why: the ranked tools, the chosen one marked; the list's length changes nothing else
    assert 'id="ranking"' in body and '<tr class="chosen"><td><code>weather</code>' in body
    assert result["ranking"][0]["tool"] == "weather" and result["ranking"][0]["backed"]
    one = client.get(reverse("dashboard:routing"), {"q": "will it rain in Rome tomorrow?", "top_k": "1"})
    assert len(one.context["result"]["candidates"]) == 1
    assert (one.context["result"]["tool"], one.context["result"]["confidence"]) == (
        result["tool"], result["confidence"])
    routing_services.forget_published_version()


def test_accuracy_page_says_what_the_run_ran(client, fed):
    config = {"orgs": 3, "clients_per_org": 2, "rounds": 3, "partition": "category", "epsilon": 1.0,
              "mask_strength": 1.0, "tau": 0.85, "summarizer": "probe-extractive",
              "robust_rule": "none", "reranker": "fusion", "probe_fraction": 0.03,
              "queries_per_client": 300, "test_limit": 600, "tune_router_epochs": 0}
    SimulationRun.objects.create(label="demo", dataset="metatool", seconds=105,
                                 document={"config": config, "seeds": [0], "summary": []})
    body = login(client, fed, "admin_a").get(reverse("dashboard:accuracy")).content.decode()
    setup = body[body.index('id="run-setup"'):]
    setup = setup[: setup.index("</p>")]
    assert "3 organizations × 2 clients, 3 rounds, category partition, 1 seed (0)" in setup
    assert "at most 300 train queries per client, public probe set 3% of the queries, at most 600 test queries" in setup
    assert "ε = 1.0 per round, λ = 1.0, τ = 0.85" in setup and "router tuned" not in setup
    assert "through the services" not in setup and "clients:" not in setup  # client defaults
    SimulationRun.objects.create(label="services", dataset="metatool", seconds=105, document={
        "config": {**config, "through_services": True}, "seeds": [0], "summary": []})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    setup = body[body.index('id="run-setup"'):]
    assert "1 seed (0), rounds closed through the services (submission service, close, merge " \
        "pipeline)" in setup[: setup.index("</p>")]
    # what the clients did differently from the defaults is said, or two runs would look alike
    SimulationRun.objects.create(label="cut", dataset="metatool", seconds=105, document={
        "config": {**config, "max_words": 15, "shared_word_users": 0, "since_confidence": 1.01,
                   "adversarial_fraction": 0.4, "adversarial_mode": "coordinated_targeting"},
        "seeds": [0], "summary": []})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    setup = html.unescape(body[body.index('id="run-setup"'):])
    assert ("; clients: the pulled router's rule off, each request as its first 15 words, shared "
            "words off, 40% adversarial (coordinated_targeting).") in setup[: setup.index("</p>") + 4]


def test_accuracy_page_says_how_the_federation_and_its_merges_ran_where_not_the_defaults(client, fed):
    """The drift runs (new categories every 3 rounds, one without the linear head) read like a
    default run: their curves fall and rise with the categories coming into use, and the page
    named neither the drift nor the missing head, nor a cadence, contradictions, the conflict
    log or carry-forward turned off, the users per client or the robust rules' share f."""
    config = {"orgs": 5, "clients_per_org": 4, "rounds": 10, "partition": "category",
              "epsilon": 1.0, "mask_strength": 1.0, "tau": 0.85, "summarizer": "probe-extractive",
              "robust_rule": "none", "reranker": "fusion", "test_limit": 1000}
    SimulationRun.objects.create(label="drift", dataset="metatool", document={
        "config": {**config, "drift_every": 3, "linear_head": False}, "seeds": [0], "summary": []})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    setup = html.unescape(body[body.index('id="run-setup"'):].split("</p>")[0])
    assert "at most 1000 test queries, new categories come into use every 3 rounds;" in setup
    assert "reranker fusion, without the linear head." in setup
    SimulationRun.objects.create(label="all", dataset="metatool", document={
        "config": {**config, "aggregate_every": 0, "users_per_client": 20,
                   "contradiction_fraction": 0.4, "conflict_log": False, "carry_forward": False,
                   "trim_fraction": 0.25},
        "seeds": [0], "summary": []})
    setup = html.unescape(client.get(reverse("dashboard:accuracy")).content.decode())
    setup = setup[setup.index('id="run-setup"'):].split("</p>")[0]
    assert "10 rounds, frozen after round 1, category partition" in setup
    assert ("20 users per client, public probe set 10% of the queries, at most 1000 test queries, 40% of "
            "each honest client's scenarios contradicted;") in setup
    assert ("robust rule none (share of possibly adversarial sources f = 0.25), reranker fusion, "
            "without the conflict log, without carry-forward.") in setup
    # at the defaults, named or not, none of it is said
    SimulationRun.objects.create(label="defaults", dataset="metatool", document={
        "config": {**config, "aggregate_every": 1, "drift_every": 0, "linear_head": True},
        "seeds": [0], "summary": []})
    setup = html.unescape(client.get(reverse("dashboard:accuracy")).content.decode())
    setup = setup[setup.index('id="run-setup"'):].split("</p>")[0]
    for word in ("frozen", "every", "categories", "users per client", "contradicted", "without",
                 "adversarial sources"):
        assert word not in setup


def test_conflicts_paginate(client, fed):
    r1 = Round.objects.get(number=1)
    for i in range(60):
        ConflictLogEntry.objects.create(
            round=r1, organization=fed.org_a, tool_id="flights", centroid_id=f"x{i:02d}",
            centroid={"text": f"Book flight {i}"}, dissenters=[{"text": f"Cancel flight {i}"}],
        )
    login(client, fed, "admin_a")
    first = client.get(reverse("dashboard:conflicts"))
    assert sum(len(g["cards"]) for g in first.context["groups"]) == 50
    second = client.get(reverse("dashboard:conflicts"), {"page": 2})
    assert sum(len(g["cards"]) for g in second.context["groups"]) == 11  # 60 + Paris
    assert 'rel="prev"' in second.content.decode()


def test_accuracy_page_draws_contradictions_cadence_curves_and_the_tau_and_summarizer_sweeps(client, fed):
    cadence = [
        {"aggregate_every": every, "seeds": 1, "accuracy": curve[-1], "accuracy_sd": 0.0,
         "bytes_per_client_round": sent, "global_scenarios": 1200.0,
         **{f"accuracy_round_{r}": a for r, a in enumerate(curve, start=1)}}
        for every, curve, sent in ((1, [0.6, 0.7, 0.65, 0.8], 12059.5), (0, [0.6, 0.6, 0.4, 0.4], 7895.5))
    ]
    tau = [{"tau": t, "seeds": 1, "accuracy": a, "accuracy_sd": 0.0, "global_scenarios": n,
            "global_size_bytes": n * 100.0, "dedup_rate": d}
           for t, a, n, d in ((0.95, 0.8, 5000, 0.1), (0.75, 0.7, 2500, 0.55))]
    summarizers = [{"summarizer": "centroid", "seeds": 1, "accuracy": 0.77, "accuracy_sd": 0.0,
                    "merge_seconds_per_round": 12.5},
                   {"summarizer": "llm-single-shot", "seeds": 1, "accuracy": 0.76, "accuracy_sd": 0.0,
                    "merge_seconds_per_round": 40.0, "summaries": 120.0, "llm_summaries": 7.0,
                    "summarizer_fallbacks": 113.0,
                    "summarizer_fallback_kinds": {"llm-single-shot: unusable answer": 113.0}}]
    contradictions = [{"contradiction_fraction": share, "conflict_log": log, "seeds": 1,
                       "accuracy": a, "accuracy_sd": 0.0, "global_scenarios": n}
                      for share, log, a, n in ((0.4, False, 0.5, 1634.2), (0.0, True, 0.8, 500.0),
                                               (0.4, True, 0.7, 502.8), (0.0, False, 0.8, 514.4))]
    SimulationRun.objects.create(label="stresses", dataset="tiny", document={
        **DOCUMENT, "config": {"drift_every": 2}, "cadence": cadence, "tau_sweep": tau,
        "summarizer_sweep": summarizers, "contradictions": contradictions})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    *_, conflicts, curves, by_tau = figures_in(body)
    with_log, without = conflicts["data"]
    assert with_log["name"] == "with the conflict log" and with_log["y"] == [0.8, 0.7]
    assert without["x"] == [0.0, 0.4] and without["y"] == [0.8, 0.5]
    every, frozen = curves["data"]
    assert every["name"] == "aggregate every 1" and frozen["name"] == "frozen after round 1"
    assert every["x"] == [1, 2, 3, 4] and frozen["y"] == [0.6, 0.6, 0.4, 0.4]
    assert [shape["x0"] for shape in curves["layout"]["shapes"]] == [3]  # the drift event
    assert by_tau["data"][0]["x"] == [0.75, 0.95]  # ordered by τ
    assert "2,500 scenarios · dedup 55%" in by_tau["data"][0]["text"]
    table = body[body.index('id="accuracy-tau-table"'):]
    assert "55%" in table[: table.index("</table>")]
    table = body[body.index('id="accuracy-summarizer-table"'):]
    assert "centroid" in table and "12.50" in table[: table.index("</table>")]
    centroid, llm = table[: table.index("</table>")].split("<tr>")[2:]
    # one seed's sd, and a run from before the counts were kept: shown as unknown
    assert centroid.count("–") == 3 and centroid.count("one seed: no spread") == 1
    assert "120 (7)" in llm and ">113<" in llm  # an LLM wrote 7 of 120 summaries
    assert "113 llm-single-shot: unusable answer" in llm  # and why the others fell back
    # The sweeps' figures as tables: per share, with and without the log side by side.
    table = body[body.index('id="accuracy-contradictions-table"'):]
    rows = table[: table.index("</table>")].split("<tr>")[2:]
    assert [r[: r.index("</td>")] for r in rows] == ['<td class="num">0%', '<td class="num">40%']
    assert "0.700" in rows[1] and "0.500" in rows[1] and "0.200" in rows[1]  # 0.7 - 0.5 kept
    assert "503 / 1,634" in rows[1]
    table = body[body.index('id="accuracy-cadence-table"'):]
    every, frozen = table[: table.index("</table>")].split("<tr>")[2:]
    assert "every 1" in every and "0.688" in every and "0.600 (round 1)" in every  # mean, worst
    assert "12,060" in every
    assert "frozen after round 1" in frozen and "0.400 (round 3)" in frozen and "7,896" in frozen
    assert "new tool categories coming into use every 2 rounds" in body


def test_a_conflict_across_tools_shows_the_losing_tool_and_composes_its_precaution(client, fed):
    from federation.conflicts import composed_precaution

    conflict = ConflictLogEntry.objects.create(
        round=Round.objects.get(number=1), organization=fed.org_a, tool_id="weather",
        centroid_id="x1", centroid={"tool_id": "weather", "text": "Will it snow in Oslo?"},
        dissenters=[{"tool_id": "flights", "text": "Will it snow in Oslo", "preconditions": {}}],
        reason="parent tools differ")
    body = login(client, fed, "admin_a").get(reverse("dashboard:conflicts")).content.decode()
    card = body[body.index(f'id="conflict-{conflict.pk}"'):]
    card = card[: card.index("</article>")]
    assert '<code class="tool">flights</code> Will it snow in Oslo' in card
    composed = composed_precaution(conflict)
    assert composed == "Do not use flights for requests like: Will it snow in Oslo (use weather instead)"
    assert composed in card


# --- the audit log as CSV ----------------------------------------------------------------------


def test_the_audit_log_downloads_as_csv_with_the_filters_and_scope_of_the_page(client, world):
    services.enroll_client(world.actor(world.admin_a), world.org_a, "=HYPERLINK(\"http://x\")")
    people.add_person(world.actor(world.admin_b), world.org_b, "nina", "member")
    client.force_login(world.admin_a)
    page = client.get(reverse("dashboard:audit") + "?action=client.enroll")
    assert 'id="audit-csv"' in page.content.decode()
    assert "format=csv" in page.context["csv_query"] and "action=client.enroll" in page.context["csv_query"]
    response = client.get(reverse("dashboard:audit") + "?action=client.enroll&format=csv")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert rows and {r["action"] for r in rows} == {"client.enroll"}
    assert {r["organization"] for r in rows} == {"org-a"}  # org B's entries are not admin A's
    assert json.loads(rows[0]["details"])["name"] == '=HYPERLINK("http://x")'  # details as JSON
    everything = client.get(reverse("dashboard:audit") + "?format=csv")
    text = b"".join(everything.streaming_content).decode()
    assert "nina" not in text and "person.add" not in text
    bad = client.get(reverse("dashboard:audit") + "?format=csv&since=yesterday")
    assert bad.status_code == 400
    # a cell that a spreadsheet would run as a formula is kept as text
    services.create_organization(SYSTEM, "=1+1", "formula")
    client.force_login(world.operator)
    created = client.get(reverse("dashboard:audit") + "?action=organization.create&format=csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(created.streaming_content).decode())))
    assert "'=1+1" in [r["target_label"] for r in rows]


def test_the_overview_names_the_clients_that_have_not_submitted_to_the_open_round(client, world, valid_doc):
    rnd = services.open_round(SYSTEM)
    submissions.submit(world.client_a, json.dumps(valid_doc).encode(), "k1")
    client.force_login(world.admin_a)  # org A: client a1 submitted; a-pending is not approved
    response = client.get(reverse("dashboard:overview"))
    body = html.unescape(response.content.decode())
    assert f"Round {rnd.number} is open: of 1 approved client, all have submitted." in body
    rows = {r.client.name: r.submitted_open for r in response.context["overview"].clients}
    assert rows == {"a1": True, "a-pending": False}
    client.force_login(world.operator)  # every organization: org B's b1 has not
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert "of 2 approved clients, 1 has not submitted yet (org-b/b1)." in body
    assert "<span class=\"warn-text\">not yet</span>" in body
    services.close_round(SYSTEM, rnd)
    assert "open-round-participation" not in client.get(reverse("dashboard:overview")).content.decode()


def test_the_overview_flags_a_client_whose_submissions_were_refused_for_unmasked_text(
    client, world, valid_doc
):
    """The server refused b1's text (a name and a number at λ = 1): its organization's admin and
    the operator see it next to the client, linked to the audit entries; org A's admin does not."""
    services.open_round(SYSTEM)
    valid_doc["scenarios"][0]["text"] = "Will it rain on Mr. Pemberton's 40 acres?"
    for key in ("k1", "k2"):
        with pytest.raises(submissions.UnmaskedText):
            submissions.submit(world.client_b, json.dumps(valid_doc).encode(), key)
    client.force_login(world.operator)
    response = client.get(reverse("dashboard:overview"))
    rows = {r.client.name: r.refused_unmasked_open for r in response.context["overview"].clients}
    assert rows["b1"] == 2 and rows["a1"] == 0
    body = html.unescape(response.content.decode())
    assert "2 refused: unmasked text" in body and "?action=submission.unmasked" in body
    assert "Pemberton" not in body
    client.force_login(world.admin_a)
    assert "refused: unmasked text" not in client.get(reverse("dashboard:overview")).content.decode()
    client.force_login(world.admin_b)
    assert "2 refused: unmasked text" in client.get(reverse("dashboard:overview")).content.decode()
    audit = html.unescape(client.get(reverse("dashboard:audit") + "?action=submission.unmasked").content.decode())
    assert "submission.unmasked" in audit and "not masked at λ = 1" in audit and "Pemberton" not in audit


def test_the_unmasked_refusals_link_lists_that_clients_entries_only(client, world, valid_doc):
    """The overview's "N refused: unmasked text" beside a client linked to every
    submission.unmasked entry of every client and round: b1's 2 among a1's. It now lists the
    entries it counted: that client's (not those of b10, whose name extends b1's), in the open
    round (not an earlier round's of the same client)."""
    open_round = services.open_round(SYSTEM)
    b10 = services.enroll_client(SYSTEM, world.org_b, "b10")
    services.approve_client(SYSTEM, b10)
    b10.refresh_from_db()
    valid_doc["scenarios"][0]["text"] = "Will it rain on Mr. Pemberton's 40 acres?"
    for who, key in ((world.client_b, "k1"), (world.client_b, "k2"), (world.client_a, "k3"),
                     (b10, "k4")):
        with pytest.raises(submissions.UnmaskedText):
            submissions.submit(who, json.dumps(valid_doc).encode(), key)
    # b1's refusal of an earlier round, as that round's submission would have left it
    services.audit(SYSTEM, AuditLog.Action.SUBMISSION_UNMASKED, target=world.client_b,
                   organization=world.org_b, details={"round": open_round.number + 7})
    client.force_login(world.operator)
    body = client.get(reverse("dashboard:overview")).content.decode()
    links = {html.unescape(href): n for href, n in re.findall(
        r'<a class="warn-text refused-unmasked" href="([^"]+)"[^>]*>(\d+) refused', body)}
    assert sorted(links.values()) == ["1", "1", "2"]
    [link] = [href for href, n in links.items() if n == "2"]
    page = client.get(link)
    listed = page.context["page_obj"].object_list
    assert [e.target_id for e in listed] == [str(world.client_b.pk)] * 2
    assert f"in round {open_round.number}" in page.content.decode()
    # the narrowing survives the filter form: its hidden fields carry it
    form = page.content.decode().split('id="audit-filters"')[1].split("</form>")[0]
    assert f'name="target_id" value="{world.client_b.pk}"' in form
    assert f'name="round" value="{open_round.number}"' in form


def test_the_audit_page_refuses_a_round_filter_that_is_not_a_round_number(client, world):
    client.force_login(world.operator)
    response = client.get(reverse("dashboard:audit"), {"round": "3; DROP"})
    assert response.status_code == 400
    assert "round must be a round number" in response.content.decode()


def test_the_operator_changes_the_federation_settings_in_the_browser(client, world):
    url = reverse("dashboard:settings")
    client.force_login(world.member_a)
    page = client.get(url)
    assert page.status_code == 200 and 'id="settings-form"' not in page.content.decode()
    assert "allow_admin_approval" in page.content.decode()
    assert "<label" not in page.content.decode().split('id="settings"')[1]  # no input to label
    assert client.post(url, {"epsilon_budget": "99"}).status_code == 403
    client.force_login(world.operator)
    current = services.get_settings()
    form = {
        "epsilon_budget": "40", "delta_prime": str(current.delta_prime),
        "max_submission_bytes": "1000000", "submissions_per_minute": "30",
        "enrollments_per_hour": str(current.enrollments_per_hour), "allow_admin_approval": "on",
    }
    response = client.post(url, form, follow=True)
    assert "Settings saved: epsilon_budget, max_submission_bytes, submissions_per_minute, allow_admin_approval changed." in html.unescape(response.content.decode())
    row = services.get_settings()
    assert (row.epsilon_budget, row.allow_admin_approval, row.submissions_per_minute) == (40, True, 30)
    assert AuditLog.objects.filter(action="settings.change", actor=world.operator).count() == 1
    for bad, words in (
        ({"max_submission_bytes": "0"}, "max_submission_bytes must be a whole number of at least 1"),
        ({"submissions_per_minute": "-1"}, "submissions_per_minute must be a whole number of at least 0"),
        ({"enrollments_per_hour": "2.5"}, "enrollments_per_hour must be a whole number"),
        ({"epsilon_budget": "-1"}, "epsilon_budget must be a finite number"),
        ({"epsilon_budget": ""}, "epsilon_budget is required"),
    ):
        refused = client.post(url, {**form, **bad})
        assert refused.status_code == 400 and words in html.unescape(refused.content.decode())
    assert services.get_settings().submissions_per_minute == 30  # nothing half-written
    unchecked = {k: v for k, v in form.items() if k != "allow_admin_approval"}
    client.post(url, unchecked)
    assert services.get_settings().allow_admin_approval is False


def server_conflict(fed):
    """A conflict of round 1's server merge: org B's edge claimed A's request for another tool."""
    return ConflictLogEntry.objects.create(
        round=Round.objects.get(number=1), organization=None, tool_id="weather", centroid_id="s0",
        centroid={"source": "org:org-a", "tool_id": "weather", "text": "Is it snowing in Oslo?",
                  "support": 2},
        dissenters=[{"source": "org:org-b", "tool_id": "flights", "text": "Is it snowing in Oslo",
                     "support": 1}],
        reason="parent tools differ",
    )


def test_the_operator_alone_reviews_the_server_merges_conflicts(client, fed):
    """Conflicts between edges (no organization) carry other organizations' texts: the operator
    sees and decides them; organization admins and members neither see nor decide them."""
    conflict = server_conflict(fed)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    for role in ("admin_a", "member_a", "admin_b"):
        body = login(client, fed, role).get(reverse("dashboard:conflicts")).content.decode()
        assert "Oslo" not in body and "Server merge" not in body, role
        assert client.post(url, {"action": "dismiss"}).status_code == 404, role
    assert not ConflictDecision.objects.exists()
    body = login(client, fed, "operator").get(reverse("dashboard:conflicts")).content.decode()
    assert "Server merge (between organizations) · round 1" in body and "Is it snowing in Oslo?" in body
    assert "Do not use" in body  # the precaution composed for the losing tool
    response = client.post(url, {"action": "edit", "text": "Do not use Flights for the weather"}, follow=True)
    assert "next round&#x27;s server merge" in response.content.decode()
    decision = ConflictDecision.objects.get()
    assert (decision.organization, decision.action) == (None, "edit")
    entry = AuditLog.objects.get(action="conflict.decide")
    assert entry.organization is None and entry.details["conflict"] == conflict.pk
    # One decision per conflict of the server merge too: a second one replaces it.
    client.post(url, {"action": "dismiss"})
    assert list(ConflictDecision.objects.values_list("action", flat=True)) == ["dismiss"]


def test_an_edge_that_sat_a_round_out_or_merged_in_a_failed_one_gets_its_last_published_log(fed):
    """Org A merged in round 1 and logged a conflict, then sat round 2 out (org B merged in it),
    and merged in round 3, which failed: round 4's edge merge at A gets round 1's log (before, the
    round just before, whatever it was: the log and its reviewers' decisions were lost); B's
    edge gets round 2's, where it logged nothing."""
    from federation.pipeline import _previous_conflicts

    r1, r2 = Round.objects.get(number=1), Round.objects.get(number=2)
    Round.objects.filter(pk=r2.pk).update(state=Round.State.PUBLISHED)
    r3 = Round.objects.create(number=3, state=Round.State.FAILED)
    r4 = Round.objects.create(number=4, state=Round.State.MERGING)
    for rnd, org in ((r1, fed.org_a), (r1, fed.org_b), (r2, fed.org_b), (r3, fed.org_a)):
        MergeRecord.objects.create(round=rnd, organization=org)
    ConflictLogEntry.objects.create(
        round=r3, organization=fed.org_a, tool_id="weather", centroid_id="c3", centroid={},
        dissenters=[], reason="a failed round's log",
    )
    assert [e.centroid_id for e in _previous_conflicts(r4, fed.org_a)] == ["c0"]
    assert "Paris" in _previous_conflicts(r4, fed.org_a)[0].centroid["text"]
    assert _previous_conflicts(r4, fed.org_b) == []
    assert _previous_conflicts(r1, fed.org_a) == []


def test_decisions_on_the_server_merges_conflicts_reach_its_next_merge(fed):
    from federation.conflicts import decide_conflict
    from federation.errors import NotAllowed
    from federation.pipeline import _previous_conflicts

    conflict = server_conflict(fed)
    r2 = Round.objects.get(number=2)
    for org in (None, fed.org_a):  # the server merged round 1, and org A's edge
        MergeRecord.objects.create(round=Round.objects.get(number=1), organization=org)
    [entry] = _previous_conflicts(r2, None)
    assert (entry.centroid_id, entry.resolution) == ("s0", "")
    with pytest.raises(NotAllowed, match="only the operator"):
        decide_conflict(fed.actor(fed.admin_a), conflict, "dismiss")
    decide_conflict(fed.actor(fed.operator), conflict, "edit", "Do not use Flights for snow")
    [entry] = _previous_conflicts(r2, None)
    assert (entry.resolution, entry.resolution_text) == ("precaution", "Do not use Flights for snow")
    assert [e.centroid_id for e in _previous_conflicts(r2, fed.org_a)] == ["c0"]  # edges apart
    decide_conflict(fed.actor(fed.operator), conflict, "dismiss")
    assert _previous_conflicts(r2, None) == []


def test_who_may_decide_a_conflict_is_one_rule_for_the_page_and_the_service(fed):
    """The Conflicts page offers the decision form exactly to whom decide_conflict allows."""
    from federation.conflicts import can_decide

    roles = ("operator", "admin_a", "member_a", "admin_b")
    allowed = {
        org: [can_decide(fed.actor(getattr(fed, role)), org) for role in roles]
        for org in (None, fed.org_a.pk)
    }
    assert allowed == {None: [True, False, False, False], fed.org_a.pk: [True, True, False, False]}


@pytest.mark.parametrize("raw", ["true", "yes", "checked", "1"])
def test_an_unknown_admin_approval_value_is_refused_not_read_as_off(client, world, raw):
    """The checkbox sends "on" or nothing; a script's "true" was read as off and turned admin
    approval off while saying "Settings saved"."""
    services.update_settings(SYSTEM, allow_admin_approval=True)
    current = services.get_settings()
    form = {name: str(getattr(current, name)) for name in (
        "epsilon_budget", "delta_prime", "max_submission_bytes", "submissions_per_minute",
        "enrollments_per_hour")}
    client.force_login(world.operator)
    before = AuditLog.objects.count()
    refused = client.post(reverse("dashboard:settings"), {**form, "allow_admin_approval": raw})
    assert refused.status_code == 400
    assert "allow_admin_approval must be" in html.unescape(refused.content.decode())
    assert services.get_settings().allow_admin_approval is True
    assert AuditLog.objects.count() == before
    for value, expected in (("off", False), ("on", True), ("", False)):
        assert client.post(reverse("dashboard:settings"),
                           {**form, "allow_admin_approval": value}).status_code == 302
        assert services.get_settings().allow_admin_approval is expected, value


def test_settings_refuse_numbers_past_the_column_and_a_size_limit_past_the_servers_cap(
    client, world, settings
):
    """A rate limit past PostgreSQL's integer was a 500; a size limit above the server's cap was
    saved and shown although the cap applies. Both are 400s naming the bound; a stored limit
    above a cap lowered later does not block saving the other settings."""
    url = reverse("dashboard:settings")
    client.force_login(world.operator)
    current = services.get_settings()
    form = {
        "epsilon_budget": str(current.epsilon_budget), "delta_prime": str(current.delta_prime),
        "max_submission_bytes": str(current.max_submission_bytes),
        "submissions_per_minute": "60", "enrollments_per_hour": "20",
    }
    for bad, words in (
        ({"submissions_per_minute": "99999999999"}, "submissions_per_minute must be at most 2147483647"),
        ({"enrollments_per_hour": "99999999999999"}, "enrollments_per_hour must be at most 2147483647"),
        ({"max_submission_bytes": str(settings.SYNAPSE_MAX_SUBMISSION_BYTES + 1)},
         f"at most the server's cap of {settings.SYNAPSE_MAX_SUBMISSION_BYTES} bytes"),
    ):
        refused = client.post(url, {**form, **bad})
        assert refused.status_code == 400 and words in html.unescape(refused.content.decode())
    api = client.patch(
        "/api/v1/admin/settings/",
        json.dumps({"max_submission_bytes": settings.SYNAPSE_MAX_SUBMISSION_BYTES + 1}),
        content_type="application/json",
    )
    assert api.status_code == 400 and "server's cap" in api.json()["detail"]
    assert services.get_settings().max_submission_bytes == current.max_submission_bytes
    settings.SYNAPSE_MAX_SUBMISSION_BYTES = current.max_submission_bytes // 2  # lowered later
    saved = client.post(url, {**form, "submissions_per_minute": "30"}, follow=True)
    assert "Settings saved: submissions_per_minute changed." in html.unescape(saved.content.decode())


def test_accuracy_shows_no_spread_for_a_single_seed(client, fed):
    """One seed has no standard deviation: the table showed 0.000 (the demo's run), as if the
    seeds had agreed to the digit."""
    one_seed = {"summary": [{**row, "seeds": 1, "accuracy_sd": 0.0} for row in DOCUMENT["summary"]]}
    SimulationRun.objects.create(label="one seed", dataset="tiny", document=one_seed)
    body = login(client, fed, "operator").get(reverse("dashboard:accuracy")).content.decode()
    table = body[body.index('id="accuracy-summary"'):].split("</table>")[0]
    assert "0.000" not in table and table.count("one seed: no spread to show") == 3
    SimulationRun.objects.create(label="two seeds", dataset="tiny", document=DOCUMENT)
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    table = body[body.index('id="accuracy-summary"'):].split("</table>")[0]
    assert "0.020" in table and "no spread" not in table


def test_one_seeds_sweeps_and_curves_show_no_spread(client, fed):
    """A run of one seed has no standard deviation anywhere: the adversarial and contradiction
    tables showed its sweeps' 0.000, and every chart drew (and on hover wrote) "± 0" error bars,
    as if the seeds had agreed to the digit."""
    one = {"seeds": 1, "accuracy_sd": 0.0}
    document = {
        "seeds": [0],
        "summary": [{**row, **one} for row in DOCUMENT["summary"]],
        "adversarial": [{**row, **one} for row in DOCUMENT["adversarial"]],
        "privacy_sweep": [{**row, **one} for row in DOCUMENT["privacy_sweep"]],
        "contradictions": [{"contradiction_fraction": share, "conflict_log": log,
                            "accuracy": 0.65 if log else 0.6,
                            "global_scenarios": 500.0, **one}
                           for share in (0.0, 0.4) for log in (True, False)],
        "tau_sweep": [{"tau": t, "accuracy": 0.6, "global_scenarios": 500.0,
                       "global_size_bytes": 50000.0, "dedup_rate": 0.2, **one} for t in (0.8, 0.9)],
    }
    SimulationRun.objects.create(label="one seed", dataset="tiny", document=document)
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    for name in ("accuracy-adversarial-table", "accuracy-contradictions-table"):
        table = body[body.index(f'id="{name}"'):].split("</table>")[0]
        assert "0.000" not in table, name
    traces = [(figure["layout"]["title"]["text"], trace) for figure in figures_in(body)
              for trace in figure["data"]]
    assert [(title, trace["name"]) for title, trace in traces if trace.get("error_y")] == []
    # with more seeds, the sweeps' spread is shown and drawn
    two = {"seeds": 2, "accuracy_sd": 0.02}
    SimulationRun.objects.create(label="two seeds", dataset="tiny", document={
        **document, "seeds": [0, 1],
        **{key: [{**row, **two} for row in document[key]]
           for key in ("adversarial", "privacy_sweep", "contradictions", "tau_sweep")}})
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    for name in ("accuracy-adversarial-table", "accuracy-contradictions-table"):
        assert "0.020" in body[body.index(f'id="{name}"'):].split("</table>")[0], name
    drawn = {figure["layout"]["title"]["text"] for figure in figures_in(body)
             for trace in figure["data"] if trace.get("error_y")}
    assert drawn == {"Accuracy under adversarial clients", "Privacy–utility frontier (ε × λ)",
                     "Accuracy under contradictory scenarios",
                     "Sensitivity to the cosine threshold τ (last round)"}


def test_a_round_one_seed_measured_draws_no_error_bar_beside_those_that_have_one(client, fed):
    """Under drift, a round that only one seed of a multi-seed run measured has no spread (the
    Methods table shows "–"), but its curve drew a "± 0" bar there: plotly draws a null error as
    0, and a trace's bars are all or none. The bars of the other rounds are still drawn, in the
    curve's colour and legend group, and the legend lists each method once."""
    summary = [
        {"method": "synapse", "round": 1, "seeds": 2, "accuracy_mean": 0.5, "accuracy_sd": 0.02,
         "macro_accuracy_mean": 0.45},
        {"method": "synapse", "round": 2, "seeds": 1, "accuracy_mean": 0.6, "accuracy_sd": 0.0,
         "macro_accuracy_mean": 0.55},
        {"method": "synapse", "round": 3, "seeds": 2, "accuracy_mean": 0.7, "accuracy_sd": 0.01,
         "macro_accuracy_mean": 0.65},
        {"method": "static_global", "round": 1, "seeds": 2, "accuracy_mean": 0.5,
         "accuracy_sd": 0.02, "macro_accuracy_mean": 0.45},
        {"method": "static_global", "round": 2, "seeds": 2, "accuracy_mean": 0.55,
         "accuracy_sd": 0.03, "macro_accuracy_mean": 0.5},
    ]
    SimulationRun.objects.create(label="drift", dataset="tiny",
                                 document={"seeds": [0, 1], "summary": summary})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()
    [curves] = [f for f in figures_in(body) if f["layout"]["title"]["text"].startswith("Routing")]
    bars = {(t["x"][i], t["error_y"]["array"][i], t.get("legendgroup"),
             t["error_y"].get("color") or t["line"]["color"])
            for t in curves["data"] if t.get("error_y") for i in range(len(t["x"]))}
    synapse = next(t for t in curves["data"] if t["name"] == "synapse")
    static = next(t for t in curves["data"] if t["name"] == "static_global")
    colour, group = synapse["line"]["color"], synapse.get("legendgroup")
    assert group and static["line"]["color"] != colour
    assert {(x, e) for x, e, g, c in bars if g == group and c == colour} == {(1, 0.02), (3, 0.01)}
    assert static["error_y"]["array"] == [0.02, 0.03]  # a curve with no gap keeps its own bars
    assert "error_y" not in synapse  # no bar at round 2
    assert sorted(t["name"] for t in curves["data"] if t.get("showlegend") is not False) == [
        "static_global", "synapse"]


def test_the_empty_conflict_page_speaks_to_the_operator_and_to_a_member(client, world):
    client.force_login(world.operator)
    body = html.unescape(client.get(reverse("dashboard:conflicts")).content.decode())
    assert "No conflicts have been logged in the edge or server merges." in body
    client.force_login(world.member_a)
    body = html.unescape(client.get(reverse("dashboard:conflicts")).content.decode())
    assert "No conflicts have been logged in your organization's edge merges." in body


def test_a_round_or_run_that_is_not_there_is_named_in_the_404(client, fed):
    """?round=99 on the compendium and ?run=99 on the accuracy page answered 'There is nothing at
    /compendium/', as if the page itself were missing."""
    login(client, fed, "member_a")
    missing = client.get(reverse("dashboard:compendium"), {"round": "99"})
    body = missing.content.decode()
    assert missing.status_code == 404 and "<h1>Not found</h1>" in body
    assert "no global compendium is published for round 99" in body
    assert client.get(reverse("dashboard:compendium"), {"round": "2"}).status_code == 404  # open
    run = client.get(reverse("dashboard:accuracy"), {"run": "99"})
    assert run.status_code == 404 and "no simulation run 99 is stored" in run.content.decode()


@pytest.mark.django_db(transaction=True)
def test_closing_a_round_says_what_became_of_its_merge(
    client, fed, without_merge_pipeline, monkeypatch
):
    """Without a broker the merge runs in the Close request itself (over a minute in the demo),
    yet the message said 'the merge pipeline started' when the round was already published, or
    had already failed."""
    from federation.signals import round_closed
    from workers.receivers import start_pipeline_on_close

    login(client, fed, "operator")
    response = client.post(reverse("dashboard:round-action", args=[2, "close"]), follow=True)
    assert Round.objects.get(number=2).state == "closing"  # as a worker's pipeline leaves it
    assert "Round 2 closed; the merge pipeline started." in html.unescape(response.content.decode())
    services.mark_failed(Round.objects.get(number=2), "worker lost")
    # a round with a submission to merge (one without is not retried), whose pipeline fails at
    # once when it starts (eager, here in the request)
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation import pipeline

    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client",
        round=Round.objects.get(number=2), client=fed.client_a)

    def broken(round_id, attempt=None):
        raise RuntimeError("merge machinery broke")

    monkeypatch.setattr(pipeline, "start_round", broken)
    round_closed.connect(start_pipeline_on_close, dispatch_uid="synapse.start_round_pipeline")
    response = client.post(reverse("dashboard:round-action", args=[2, "retry"]), follow=True)
    assert Round.objects.get(number=2).state == "failed"  # eager: over, its start broke
    message = html.unescape(response.content.decode())
    assert "Round 2 retried; its merge failed: " in message and "pipeline started" not in message
    assert "merge machinery broke" in message


def test_the_simulation_picker_selects_the_run_shown_even_past_the_latest_twenty(client, fed):
    """The picker listed the latest 20 runs only: ?run= of an older one drew that run while the
    picker, without it, showed the newest as chosen (and Show went back to the newest)."""
    runs = [SimulationRun.objects.create(label=f"run {i}", dataset="tiny", document=DOCUMENT)
            for i in range(22)]
    login(client, fed, "member_a")
    body = client.get(reverse("dashboard:accuracy"), {"run": runs[0].pk}).content.decode()
    selected = re.findall(r'<option value="(\d+)" selected>', body)
    assert selected == [str(runs[0].pk)]
    assert "run 0 on tiny" in body
    body = client.get(reverse("dashboard:accuracy")).content.decode()  # the latest 20, as before
    options = re.findall(r'<option value="(\d+)"', body)
    assert len(options) == 20 and re.findall(r'<option value="(\d+)" selected>', body) == [
        str(runs[-1].pk)]


def test_a_decision_returns_to_the_page_and_filter_it_was_made_on(client, fed):
    """Deciding a conflict on page 2, or under a round or organization filter, went back to the
    unfiltered first page, where the conflict and its anchor are not: the reviewer lost their
    place and did not see the decision."""
    conflict = conflict_of(fed, fed.org_a)
    url = reverse("dashboard:conflict-decide", args=[conflict.pk])
    page = "http://testserver" + reverse("dashboard:conflicts") + "?round=1&organization=org-a&page=2"
    login(client, fed, "admin_a")
    response = client.post(url, {"action": "dismiss"}, HTTP_REFERER=page)
    assert response.status_code == 302
    assert response["Location"] == page + f"#conflict-{conflict.pk}"
    # from elsewhere (another site, another page, or no Referer): the conflict page
    for referer in ("https://evil.example/conflicts/?page=2", "http://testserver/privacy/", None):
        extra = {"HTTP_REFERER": referer} if referer else {}
        response = client.post(url, {"action": "accept"}, **extra)
        assert response["Location"] == reverse("dashboard:conflicts") + f"#conflict-{conflict.pk}"


def test_the_release_and_cadence_tables_say_when_nothing_was_sent(client, fed):
    """A run in which no client sent anything stores no byte figure (None): the frontier's label
    said "nothing sent", but the k-anonymous release and cadence tables showed an empty cell."""
    release = [{"min_users": 50, "seeds": 1, "accuracy": 0.4, "membership_auroc": 0.5,
                "token_overlap": 0.0, "bytes_per_client_round": None}]
    cadence = [{"aggregate_every": 2, "seeds": 1, "accuracy": 0.5, "accuracy_round_1": 0.5,
                "bytes_per_client_round": None, "global_scenarios": 0}]
    SimulationRun.objects.create(label="silent", dataset="tiny", document={
        **DOCUMENT, "release_sweep": release, "cadence": cadence})
    body = login(client, fed, "member_a").get(reverse("dashboard:accuracy")).content.decode()

    def cells(table_id):
        table = body[body.index(f'id="{table_id}"'):]
        table = table[: table.index("</table>")]
        return re.findall(r"<td[^>]*>(.*?)</td>", table)

    assert cells("accuracy-release-table")[-1] == "nothing sent"
    assert cells("accuracy-cadence-table")[-2] == "nothing sent"
    assert "k=50 · nothing sent" in figures_in(body)[-2]["data"][-1]["text"]


def test_a_round_not_measured_is_shown_as_such_and_left_out_of_the_cadence_means(client, fed):
    """Under drift a round whose categories in use have no held-out query is not measured: its
    figures are null (`simulate`). The cadence table's worst round compared None with numbers
    (a 500) and the summary table showed an empty cell; now the round is n/a and left out of the
    worst round and the mean over the rounds."""
    summary = [
        {"method": "synapse", "round": 1, "seeds": 0, "accuracy_mean": None, "accuracy_sd": None,
         "macro_accuracy_mean": None},
        {"method": "synapse", "round": 2, "seeds": 1, "accuracy_mean": 0.6, "accuracy_sd": 0.0,
         "macro_accuracy_mean": 0.55},
    ]
    cadence = [{"aggregate_every": 1, "seeds": 1, "accuracy": 0.6, "accuracy_round_1": None,
                "accuracy_round_2": 0.6, "accuracy_round_3": 0.8,
                "bytes_per_client_round": 100.0, "global_scenarios": 10}]
    SimulationRun.objects.create(label="drift", dataset="tiny", document={
        **DOCUMENT, "summary": summary, "cadence": cadence, "config": {"drift_every": 1}})
    response = login(client, fed, "member_a").get(reverse("dashboard:accuracy"))
    assert response.status_code == 200
    body = response.content.decode()

    def cells(table_id):
        table = body[body.index(f'id="{table_id}"'):]
        return re.findall(r"<td[^>]*>(.*?)</td>", table[: table.index("</table>")])

    cadence_cells = cells("accuracy-cadence-table")
    assert cadence_cells[3] == "0.700"  # the mean over the rounds measured, not over a 0
    assert cadence_cells[4] == "0.600 (round 2)"
    first = cells("accuracy-summary")[:6]
    assert first[:3] == ["synapse", "1", "0"]
    assert all("n/a" in cell for cell in (first[3], first[5])), first


def test_a_last_round_not_measured_draws_no_star_and_no_ratio_to_the_clean_run(client, fed):
    """Under drift the last round itself can be unmeasured (null figures). The frontier put the
    run's own point at that null accuracy and took the smallest of the accuracies with it (a 500
    for everyone); the adversarial table's "× clean" would divide by it. Now there is no star
    and no ratio where the run's last round was not measured."""
    summary = [
        {"method": "synapse", "round": 1, "seeds": 1, "accuracy_mean": 0.6, "accuracy_sd": 0.0,
         "macro_accuracy_mean": 0.55},
        {"method": "synapse", "round": 2, "seeds": 0, "accuracy_mean": None, "accuracy_sd": None,
         "macro_accuracy_mean": None},
    ]
    adversarial = [{"adversarial_mode": "label_flip", "adversarial_fraction": 0.2,
                    "robust_rule": "none", "accuracy": 0.4}]
    SimulationRun.objects.create(label="drift, last round unmeasured", dataset="tiny", document={
        **DOCUMENT, "summary": summary, "adversarial": adversarial,
        "config": {"drift_every": 1, "epsilon": 1.0, "mask_strength": 0.5},
        "privacy": {"membership_auroc": 0.7}})
    response = login(client, fed, "member_a").get(reverse("dashboard:accuracy"))
    assert response.status_code == 200
    body = response.content.decode()
    frontier = figures_in(body)[-1]
    assert frontier["layout"]["title"]["text"].startswith("Privacy–utility frontier")
    assert not any(t["name"].startswith("this run's configuration") for t in frontier["data"])
    table = body[body.index('id="accuracy-adversarial-table"'):]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", table[: table.index("</table>")])
    assert cells[5] == "–"  # × clean: the clean run's last round has no figure


@pytest.mark.django_db(transaction=True)
def test_the_same_decision_posted_twice_at_once_is_audited_once(world, monkeypatch):
    """A double click sends the same decision twice at once. With no later round to lock (the
    conflict's round is the latest), both requests read "no decision yet": the second waited on
    the first's insert, then updated the row to the same values and audited the decision again
    in the append-only log. The conflict's row is now locked while a decision is made, so the
    second finds the first's decision and changes and audits nothing."""
    import threading

    from django.db import connection

    from federation import conflicts
    from tests.federation_fixtures import another_waits_on_a_lock

    rnd = Round.objects.create(number=1, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
    conflict = ConflictLogEntry.objects.create(
        round=rnd, organization=world.org_a, tool_id="weather", centroid_id="c0",
        centroid={"text": "Will it rain tomorrow in Paris?"}, dissenters=[{"text": "Rain in Paris"}],
    )
    real_audit = conflicts.audit
    first_writes = threading.Event()

    def slow_audit(actor, action, **kwargs):  # the first decision holds its transaction open
        if not first_writes.is_set():        # until the second waits on it
            first_writes.set()
            another_waits_on_a_lock()
        return real_audit(actor, action, **kwargs)

    monkeypatch.setattr(conflicts, "audit", slow_audit)
    errors = []

    def decide(wait: bool):
        if wait:
            first_writes.wait(5)
        try:
            conflicts.decide_conflict(world.actor(world.operator), conflict, "dismiss")
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(False,)),
               threading.Thread(target=decide, args=(True,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    assert ConflictDecision.objects.get().action == "dismiss"
    assert AuditLog.objects.filter(action="conflict.decide").count() == 1


@pytest.mark.parametrize(
    "bad, says, not_says",
    [
        ({"delta_prime": "2"}, "delta_prime must be a number between 0 and 1 (exclusive), not 2",
         "epsilon_budget must"),
        ({"delta_prime": "nan"}, "delta_prime must be a number between 0 and 1 (exclusive), not nan",
         "epsilon_budget must"),
        ({"epsilon_budget": "0"}, "epsilon_budget must be a finite number greater than 0, not 0",
         "delta_prime must"),
        ({"epsilon_budget": "inf"}, "epsilon_budget must be a finite number greater than 0, not inf",
         "delta_prime must"),
    ],
)
def test_a_refused_budget_setting_names_the_field_that_is_wrong(client, world, bad, says, not_says):
    """A bad δ′ was refused as "epsilon_budget must be a finite number > 0 and delta_prime in
    (0, 1)", naming the budget the operator had not touched: the refusal names the field given
    and its value."""
    current = services.get_settings()
    form = {
        "epsilon_budget": str(current.epsilon_budget), "delta_prime": str(current.delta_prime),
        "max_submission_bytes": str(current.max_submission_bytes),
        "submissions_per_minute": str(current.submissions_per_minute),
        "enrollments_per_hour": str(current.enrollments_per_hour),
    }
    client.force_login(world.operator)
    refused = client.post(reverse("dashboard:settings"), {**form, **bad})
    body = html.unescape(refused.content.decode())
    assert refused.status_code == 400
    assert says in body and not_says not in body
    row = services.get_settings()
    assert (row.epsilon_budget, row.delta_prime) == (current.epsilon_budget, current.delta_prime)


def test_every_time_the_organization_tokens_and_accuracy_pages_show_says_utc(client, fed):
    """The organization page (a client's enrolment and token issue, a person's last sign-in), the
    token page (when a token was revoked) and the accuracy page (when a run was stored) showed
    bare times, while every other page marks its times UTC: an operator away from UTC read them
    as local."""
    from django.utils import timezone

    stamp = "%Y-%m-%d %H:%M"
    fed.member_a.last_login = timezone.now()
    fed.member_a.save(update_fields=["last_login"])
    login(client, fed, "admin_a")
    body = client.get(reverse("dashboard:organization", args=["org-a"])).content.decode()
    token = ClientToken.objects.get(client=fed.client_a)
    assert f"{fed.client_a.created_at:{stamp}} UTC" in body
    assert f"issued {token.issued_at:{stamp}} UTC" in body
    assert f"{fed.member_a.last_login:{stamp}} UTC" in body

    services.issue_user_token(services.Actor.for_user(fed.admin_a), fed.admin_a, "cron")
    issued = services.user_tokens(fed.admin_a).get()
    row = services.revoke_user_token(services.Actor.for_user(fed.admin_a), issued.pk)
    body = client.get(reverse("dashboard:tokens")).content.decode()
    assert f"revoked {row.revoked_at:{stamp}} UTC" in body

    run = SimulationRun.objects.create(label="demo sim", dataset="tiny", document=DOCUMENT)
    body = client.get(reverse("dashboard:accuracy")).content.decode()
    assert f"stored {run.created_at:{stamp}} UTC" in body
    assert f"demo sim · {run.created_at:{stamp}} UTC" in body
    # and the overview's rounds table says so in its headings, not only on hover
    body = client.get(reverse("dashboard:overview")).content.decode()
    for heading in ("opened", "closed", "published"):
        assert f">{heading} (UTC)</th>" in body


def test_closing_a_round_asks_first_and_says_who_has_not_submitted(client, fed):
    """Close ended the open round at one click, with no confirmation, whoever had not submitted
    yet (with none submitted, its merge then fails): the button asks first, as Revoke does, and
    names what closing leaves out."""
    login(client, fed, "operator")
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    action = reverse("dashboard:round-action", args=[2, "close"])
    form = re.search(rf'<form method="post" action="{re.escape(action)}"[^>]*>', body).group(0)
    confirm = re.search(r'data-confirm="([^"]*)"', form)
    assert confirm, form
    assert "Close round 2?" in confirm.group(1)
    assert "2 of 2 approved clients have not submitted (org-a/a1, org-b/b1)" in confirm.group(1)
    assert "no client has submitted to it (or only clients revoked since), so its merge will fail" \
        in confirm.group(1)

    def close_confirmation():
        body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
        form = re.search(rf'<form method="post" action="{re.escape(action)}"[^>]*>', body).group(0)
        return re.search(r'data-confirm="([^"]*)"', form).group(1)

    # a submission of a client revoked since is not one its merge reads: the warning stays (it
    # counted every submission, so closing a round whose merge was sure to fail said nothing)
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    store_compendium(Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "rain?"}]}),
                     kind="client", round=Round.objects.get(number=2), client=fed.client_a)
    assert "so its merge will fail" not in close_confirmation()
    services.revoke_client(services.Actor.for_user(fed.operator), fed.client_a)
    assert "so its merge will fail" in close_confirmation()


def test_round_figures_tell_apart_a_revoked_clients_submission_the_merge_does_not_read(
    client, fed, without_merge_pipeline
):
    """The close warning and Retry leave out a revoked client's submission
    (`submissions_to_merge`); the Overview's per-round count, the open round's submitting
    clients in /metrics and the round.close audit entry counted it as one the merge reads."""
    from prometheus_client.parser import text_string_to_metric_families

    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation.models import Submission

    open_round = Round.objects.get(number=2)
    for c in (fed.client_a, fed.client_b):
        version = store_compendium(Compendium.model_validate(
            {"scenarios": [{"tool_id": "weather", "text": "rain?"}]}),
            kind="client", round=open_round, client=c)
        Submission.objects.create(client=c, round=open_round, idempotency_key="k",
                                  request_sha256="0" * 64, response={}, version=version)
    services.revoke_client(services.Actor.for_user(fed.operator), fed.client_a)
    login(client, fed, "operator")
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    row = re.search(r"<tr>\s*<td class=\"num\">2</td>.*?</tr>", body, re.S).group(0)
    assert "2 (1 from a revoked client, not merged)" in " ".join(re.sub(r"<[^>]+>", " ", row).split())
    metrics = {
        sample.name: sample.value
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
        for sample in family.samples
    }
    assert metrics["synapse_open_round_submitting_clients"] == 1
    from django.core.management import call_command

    out = io.StringIO()
    call_command("round_status", stdout=out)
    assert "round 2: open" in out.getvalue()
    assert "submissions from 2 clients (1 revoked since, not merged)" in out.getvalue()
    services.close_round(services.Actor.for_user(fed.operator), open_round)
    entry = AuditLog.objects.get(action="round.close", target_id=str(open_round.pk))
    assert entry.details == {"submissions": 2, "from_revoked_clients": 1}
    # a published round's merge is done: a client revoked since is not marked
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert "from a revoked client" in body  # round 2, closing: its merge has not read it yet
    Round.objects.filter(pk=open_round.pk).update(state=Round.State.PUBLISHED)
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert "from a revoked client" not in body


def test_submission_count_axes_tick_whole_submissions(client, fed):
    """The overview's participation chart and an organization's edge chart count submissions,
    but their axes were left to plotly's automatic ticks, which on the demo's 2 or 6 submissions
    a round read 0.5, 1.5 (half a submission): they now tick whole numbers from zero."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    r1 = Round.objects.get(number=1)
    for kind, where in (("client", {"client": fed.client_a}), ("edge", {"organization": fed.org_a})):
        store_compendium(
            Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "rain?"}]}),
            kind=kind, round=r1, **where,
        )
    login(client, fed, "operator")
    overview = figures_in(client.get(reverse("dashboard:overview")).content.decode())
    participation = next(f for f in overview if "Participation" in f["layout"]["title"]["text"])
    [edge] = figures_in(client.get(reverse("dashboard:organization", args=["org-a"])).content.decode())
    for fig in (participation, edge):
        axis = fig["layout"]["yaxis"]
        assert axis["title"]["text"] == "submissions"
        assert axis["tick0"] == 0 and axis["dtick"] == 1 and axis["tickformat"] == "d"


def test_the_round_controls_say_where_the_committed_epsilon_stands_against_the_cap(client, fed):
    """The operator's round controls said nothing of the privacy budget until opening the next
    round would be refused: where ε′ stood against the cap was on the Privacy page only. They now
    say it, and what the next round at the form's ε would bring it to."""
    from django.template.defaultfilters import floatformat

    from federation import accounting
    from federation.dashboard import services as dashboard_services

    check = accounting.check_budget(dashboard_services.next_round_config())
    committed = check.before.epsilon
    login(client, fed, "operator")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html.unescape(
        client.get(reverse("dashboard:overview")).content.decode())))
    assert committed > 0
    assert (f"Privacy budget: the federation's committed ε′ is {committed:.3f} of the cap "
            f"{floatformat(check.cap, '-3')} ({100 * committed / check.cap:.0f} %)") in text
    assert f"one more round at ε = 1 would bring it to {check.after.epsilon:.3f}" in text
    # A member sees no round controls, so no budget line either.
    login(client, fed, "member_a")
    assert "Privacy budget:" not in client.get(reverse("dashboard:overview")).content.decode()


def test_the_playground_names_no_reranker_when_nothing_was_ranked(client, fed):
    """A global with no scenario and no linear head ranks nothing, and its decision names no
    reranker (null): the playground's latency label read "latency (None)"."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from routing import services as routing_services

    routing_services.forget_published_version()
    Round.objects.filter(state="published").update(state="failed")
    store_compendium(Compendium(scenarios=[]), kind="global",
                     round=Round.objects.create(number=99, state="published"))
    login(client, fed, "member_a")
    body = client.get(reverse("dashboard:routing"), {"q": "will it rain?"}).content.decode()
    assert "latency (nothing ranked)" in body and "(None)" not in body
