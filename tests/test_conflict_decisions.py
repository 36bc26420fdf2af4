"""A reviewer's decision on a logged conflict changes the next round's edge merge (the real
pipeline: edge merge of round 1 logs the conflict, the decision is taken through the service,
round 2's edge merge applies it)."""

from __future__ import annotations

import html
import re

import pytest

from compendium.models import CompendiumVersion
from compendium.schema import Compendium
from compendium.services import store_compendium
from federation.conflicts import decide_conflict
from federation.errors import Conflict
from federation.models import ConflictDecision, ConflictLogEntry, PrivacyLedgerEntry, Round
from federation.services import Actor
from federation.signals import round_closed
from tests.merge_helpers import build_federation, plant_weather_conflict

pytestmark = pytest.mark.django_db

COMPOSED_PREFIX = "Use WeatherNow for will it rain tomorrow in Paris"


def close(round_, capture):
    with capture(execute=True):
        round_closed.send(sender=Round, round=round_)
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason


def conflicted_round(capture):
    """Round 1 at acme: two clients say the weather scenario needs a city, a third says not."""
    round_, clients = build_federation(config={"summarizer": "none"})
    org = plant_weather_conflict(round_, clients)
    close(round_, capture)
    [conflict] = ConflictLogEntry.objects.filter(round=round_, organization=org)
    return org, clients, conflict


def next_round_edge(org, clients, capture) -> dict:
    nxt = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=nxt,
        client=clients[("acme", "a1")])
    close(nxt, capture)
    return CompendiumVersion.objects.get(kind="edge", round=nxt, organization=org).content


@pytest.mark.parametrize("action", ["none", "edit", "scenario", "dismiss"])
def test_decision_changes_the_next_rounds_edge_merge(action, django_capture_on_commit_callbacks):
    org, clients, conflict = conflicted_round(django_capture_on_commit_callbacks)
    winner = next(d["text"] for d in conflict.dissenters)
    if action == "edit":
        decide_conflict(Actor.system(), conflict, "edit", "Ask for the city before using WeatherNow")
    elif action == "scenario":
        decide_conflict(Actor.system(), conflict, "scenario", winner)
    elif action == "dismiss":
        decide_conflict(Actor.system(), conflict, "dismiss")
    edge = next_round_edge(org, clients, django_capture_on_commit_callbacks)
    precautions = [p["text"] for p in edge["precautions"]]
    weather = [(s["text"], s.get("preconditions", {})) for s in edge["scenarios"] if s["tool_id"] == "weather"]
    composed = any(t.startswith(COMPOSED_PREFIX) for t in precautions)
    if action == "none":
        assert composed, precautions
        assert weather == []
    elif action == "edit":
        assert not composed and "Ask for the city before using WeatherNow" in precautions
    elif action == "scenario":
        assert not composed, precautions
        assert (winner, {"has_city": False}) in weather
    else:
        assert not composed and weather == [], (precautions, weather)


def test_a_conflict_between_edges_becomes_a_precaution_of_the_next_global(django_capture_on_commit_callbacks):
    """The server merge is the same operator one level up (paper, Algorithm 1): a request that
    two organizations' edges claim for different tools is logged in the server's conflict log,
    and the next server merge composes it into a precaution of the global compendium, or applies
    the operator's decision on it."""
    from tests.merge_helpers import CROSS_EDGE_REQUEST as request
    from tests.merge_helpers import plant_cross_edge_conflict

    capture = django_capture_on_commit_callbacks
    # Two tools a request can honestly be meant for; each edge sees one of them only.
    r1 = Round.objects.create(number=1, state="closing", config={"summarizer": "none"})
    clients = plant_cross_edge_conflict(r1)
    close(r1, capture)
    assert not ConflictLogEntry.objects.filter(organization__isnull=False).exists()  # no edge saw two tools
    [conflict] = ConflictLogEntry.objects.filter(round=r1, organization=None)
    assert conflict.tool_id == "flights"  # better supported: two clients of acme
    assert [(d["tool_id"], d["source"]) for d in conflict.dissenters] == [("fares", "org:globex")]
    first = CompendiumVersion.objects.get(kind="global", round=r1).content
    assert [s["tool_id"] for s in first["scenarios"] if s["text"] == request] == ["flights"]

    def next_global(number):
        nxt = Round.objects.create(number=number, state="closing", config={"summarizer": "none"})
        store_compendium(Compendium.model_validate({"scenarios": [
            {"tool_id": "weather", "text": "Will it snow in Oslo tomorrow?"}]}), kind="client",
            round=nxt, client=clients["a2"])
        close(nxt, capture)
        return [(p["tool_id"], p["text"]) for p in
                CompendiumVersion.objects.get(kind="global", round=nxt).content.get("precautions", [])]

    composed = ("fares", "Do not use AirfareWatch for requests like: Book a cheap flight from Boston "
                         "to Denver next week (use FlightFinder instead)")
    assert composed in next_global(2)
    # Round 2's server merge has been published: no merge reads round 1's log again, so a
    # decision on it would never apply and is refused, saying why.
    with pytest.raises(Conflict, match="round 2's server merge has been published since round 1"):
        decide_conflict(Actor.system(), conflict, "edit", "Do not use AirfareWatch to book plane tickets")
    # Re-merge round 2 from scratch (a test's shortcut: the product never deletes ledger rows,
    # which protect it), deciding before it merges this time.
    PrivacyLedgerEntry.objects.filter(round__number=2).delete()
    Round.objects.filter(number=2).delete()
    decide_conflict(Actor.system(), conflict, "edit", "Do not use AirfareWatch to book plane tickets")
    precautions = next_global(2)
    assert ("fares", "Do not use AirfareWatch to book plane tickets") in precautions
    assert composed not in precautions


def test_a_decision_that_no_merge_would_read_is_refused(django_capture_on_commit_callbacks, client):
    """A decision applies in the next merge of the conflict's edge that reads its round's log. A
    round in which the organization sat out does not read it (the next one still does); once a
    later round's merge of the organization has been published, none will, so deciding is refused
    (409 on the dashboard, naming the round), and so it is while a later round is merging. The
    conflict review shows such a conflict as closed, without the forms."""
    from django.contrib.auth.models import User

    capture = django_capture_on_commit_callbacks
    org, clients, conflict = conflicted_round(capture)
    # Round 2: only globex submits; acme's edge sat it out, so round 1's log is still to be read.
    r2 = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=r2,
        client=clients[("globex", "g1")])
    close(r2, capture)
    decide_conflict(Actor.system(), conflict, "dismiss")
    # Round 3 is merging: refused until it has been published or has failed.
    r3 = Round.objects.create(number=3, state="merging", config={"summarizer": "none"})
    with pytest.raises(Conflict, match="round 3 is merging"):
        decide_conflict(Actor.system(), conflict, "edit", "Ask for the city first")
    operator = User.objects.create_superuser("op", password="pw-long-enough-1")
    client.force_login(operator)
    page = client.get("/conflicts/").content.decode()
    assert "round 3 is merging: decide once it is done" in page
    assert f'action="/conflicts/{conflict.pk}/decide/"' not in page
    # Round 3 merges acme's edge (it read the dismissal) and is published: closed for good.
    r3.state = "closing"
    r3.save()
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=r3,
        client=clients[("acme", "a1")])
    close(r3, capture)
    edge = CompendiumVersion.objects.get(kind="edge", round=r3, organization=org).content
    assert not any(p["text"].startswith(COMPOSED_PREFIX) for p in edge.get("precautions", []))
    with pytest.raises(Conflict, match="round 3's merge of acme has been published since round 1"):
        decide_conflict(Actor.system(), conflict, "edit", "Ask for the city first")
    assert ConflictDecision.objects.get().action == "dismiss"  # the earlier decision stands
    page = client.get("/conflicts/").content.decode()
    assert "closed: round 3 merged after it" in page
    assert f'action="/conflicts/{conflict.pk}/decide/"' not in page
    refused = client.post(f"/conflicts/{conflict.pk}/decide/", {"action": "dismiss"})
    assert refused.status_code == 409


@pytest.mark.parametrize("bad", ["\u202e", "\x00", "\x1b"])
def test_an_edited_precaution_with_a_forbidden_character_is_refused(
    bad, django_capture_on_commit_callbacks
):
    """An edited precaution enters the next round's merge as it is. One holding a character no
    compendium may (a bidirectional override, a control character) made that merge refuse its
    own compendium and fail the round, every retry too while the decision stood; a NUL could not
    even be stored (a 500). It is refused with a 400 naming the character, and nothing is
    recorded."""
    from federation.errors import InvalidRequest

    org, clients, conflict = conflicted_round(django_capture_on_commit_callbacks)
    with pytest.raises(InvalidRequest, match=f"U\\+{ord(bad):04X}"):
        decide_conflict(Actor.system(), conflict, "edit", f"Ask for the city{bad} first")
    assert not ConflictDecision.objects.exists()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("Call the owner at 555-123-4567 first", "1 phone number"),
        ("Ask jane.doe@example.org before booking", "1 e-mail address"),
        ("Never for the account 123456789012", "1 long number"),
    ],
)
def test_an_edited_precaution_holding_personal_data_is_refused(
    text, named, django_capture_on_commit_callbacks
):
    """An edited precaution goes into the global compendium every organization pulls, unmasked
    (it is the reviewer's own text). One holding what the server's scrub takes for personal data
    (a phone number, an e-mail address, a card or a long number: "Call the owner at
    555-123-4567") was stored and published as it was; it is refused with a 400 naming what was
    found, and nothing is recorded. An ordinary precaution with a number stays accepted."""
    from federation.errors import InvalidRequest

    org, clients, conflict = conflicted_round(django_capture_on_commit_callbacks)
    with pytest.raises(InvalidRequest, match=f"holds {named}"):
        decide_conflict(Actor.system(), conflict, "edit", text)
    assert not ConflictDecision.objects.exists()
    decide_conflict(Actor.system(), conflict, "edit", "Not for files over 25 MB or 3 cities")
    assert ConflictDecision.objects.get().text == "Not for files over 25 MB or 3 cities"


def test_a_scenario_picked_across_tools_wins_for_the_tool_picked(
    django_capture_on_commit_callbacks, client
):
    """A conflict across tools is the same request claimed for two tools, most often in the same
    words. The pick was stored as a text alone, and the merge took the first candidate holding
    it, the centroid: picking the dissenting organization's tool (`fares`) published the request
    for `flights` again, as if nobody had decided, and the page offered one choice only. The pick
    names the tool now (refused, naming both, when the text alone cannot say), and the next
    global holds the request for the tool picked only: the carried-forward global's claim for
    the tool it beat is left out, as the merge's own cross-tool check leaves out a losing claim."""
    from django.contrib.auth.models import User

    from federation.errors import InvalidRequest
    from tests.merge_helpers import CROSS_EDGE_REQUEST as request
    from tests.merge_helpers import plant_cross_edge_conflict

    capture = django_capture_on_commit_callbacks
    r1 = Round.objects.create(number=1, state="closing", config={"summarizer": "none"})
    clients = plant_cross_edge_conflict(r1)
    close(r1, capture)
    [conflict] = ConflictLogEntry.objects.filter(round=r1, organization=None)
    assert (conflict.tool_id, conflict.centroid["text"]) == ("flights", request)
    assert [(d["tool_id"], d["text"]) for d in conflict.dissenters] == [("fares", request)]
    with pytest.raises(InvalidRequest, match="claimed for flights and fares: name the tool"):
        decide_conflict(Actor.system(), conflict, "scenario", request)
    with pytest.raises(InvalidRequest, match="not claimed for weather, only for flights, fares"):
        decide_conflict(Actor.system(), conflict, "scenario", request, "weather")
    assert not ConflictDecision.objects.exists()

    operator = User.objects.create_superuser("op", password="pw-long-enough-1")
    client.force_login(operator)
    page = client.get("/conflicts/").content.decode()
    # One list of (tool, text) pairs: two lists, of texts and of tools, offered pairings that
    # were never claimed (a text for a tool it was not sent for), refused only once posted.
    [options] = re.findall(r'<select name="pick"[^>]*>(.*?)</select>', page, re.S)
    offered = [(html.unescape(v), label) for v, label in
               re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', options)]
    assert [label for _, label in offered] == [f"flights: {request}", f"fares: {request}"]
    assert '<select name="scenario_tool"' not in page
    assert client.post(f"/conflicts/{conflict.pk}/decide/",
                       {"action": "scenario", "pick": "fares"}).status_code == 400
    response = client.post(f"/conflicts/{conflict.pk}/decide/",
                           {"action": "scenario", "pick": offered[1][0]})
    assert response.status_code == 302
    decision = ConflictDecision.objects.get()
    assert (decision.action, decision.text, decision.winner_tool_id) == ("scenario", request, "fares")
    [options] = re.findall(r'<select name="pick"[^>]*>(.*?)</select>',
                           client.get("/conflicts/").content.decode(), re.S)
    assert re.findall(r"<option [^>]*selected>([^<]*)</option>", options) == [f"fares: {request}"]

    r2 = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it snow in Oslo tomorrow?"}]}), kind="client",
        round=r2, client=clients["a2"])
    close(r2, capture)
    published = CompendiumVersion.objects.get(kind="global", round=r2).content
    assert [s["tool_id"] for s in published["scenarios"] if s["text"] == request] == ["fares"]
    assert not [p for p in published.get("precautions", []) if request in p["text"]]


def _shown_undecidable(client, conflict, words: str) -> str:
    """The operator's conflicts page says `words` of `conflict` and offers no form for it, and a
    decision sent anyway is a 409; returns the page."""
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("op", password="pw-long-enough-1"))
    page = client.get("/conflicts/").content.decode()
    assert words in page
    assert f'action="/conflicts/{conflict.pk}/decide/"' not in page
    assert client.post(f"/conflicts/{conflict.pk}/decide/", {"action": "dismiss"}).status_code == 409
    return page


def test_a_conflict_of_a_failed_round_is_not_decided(
    django_capture_on_commit_callbacks, client, monkeypatch
):
    """A failed round's conflict log is read by no merge (the next round reads the latest
    published round's log) unless the round is retried and published. The same conflict logged
    again in a failed round looked like the one to decide: the decision was stored, the page said
    it applied in the next round's merge, and that merge composed the precaution from the
    published round's log, undecided. Deciding it is refused (409) naming the round, and the
    page says so; the published round's conflict is still decided and applied."""

    from federation import pipeline

    capture = django_capture_on_commit_callbacks
    org, clients, first = conflicted_round(capture)
    r2 = Round.objects.create(number=2, state="closing", config={"summarizer": "none"})
    for version in CompendiumVersion.objects.filter(kind="client", round__number=1,
                                                    client__organization=org):
        store_compendium(Compendium.model_validate(version.content), kind="client", round=r2,
                         client=version.client)

    def broken(*args, **kwargs):
        raise RuntimeError("server merge broke")

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "server_merge_operator", broken)
        with pytest.raises(RuntimeError, match="server merge broke"), capture(execute=True):
            round_closed.send(sender=Round, round=r2)  # eager tasks: the failure comes back
    r2.refresh_from_db()
    assert r2.state == "failed"
    [again] = ConflictLogEntry.objects.filter(round=r2, organization=org)
    assert (again.tool_id, again.centroid_id) == (first.tool_id, first.centroid_id)
    with pytest.raises(Conflict, match="round 2 failed"):
        decide_conflict(Actor.system(), again, "edit", "Ask for the city before using WeatherNow")
    assert not ConflictDecision.objects.exists()
    page = _shown_undecidable(client, again,
                              "round 2 failed: decide once it has been retried and published")
    assert f'action="/conflicts/{first.pk}/decide/"' in page
    decide_conflict(Actor.system(), first, "edit", "Ask for the city before using WeatherNow")
    r3 = Round.objects.create(number=3, state="closing", config={"summarizer": "none"})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight"}]}), kind="client", round=r3,
        client=clients[("acme", "a1")])
    close(r3, capture)
    edge = CompendiumVersion.objects.get(kind="edge", round=r3, organization=org).content
    precautions = [p["text"] for p in edge["precautions"]]
    assert "Ask for the city before using WeatherNow" in precautions
    assert not any(t.startswith(COMPOSED_PREFIX) for t in precautions)


def test_a_conflict_of_a_round_merging_again_is_not_decided(django_capture_on_commit_callbacks,
                                                             client):
    """A retried round merges its edges again and rewrites their conflict logs: a dismissal or
    an edit taken meanwhile applied to a conflict the reviewer never saw (picks and accepts were
    refused, the others stored). Every decision is refused (409) naming the round, and the page
    says it is merging, with no form; published again, the conflict is decided."""

    capture = django_capture_on_commit_callbacks
    org, clients, conflict = conflicted_round(capture)
    Round.objects.filter(pk=conflict.round_id).update(state="merging")  # its retry, under way
    for action in ("dismiss", "edit"):
        with pytest.raises(Conflict, match="round 1 is merging"):
            decide_conflict(Actor.system(), conflict, action, "Ask for the city first")
    assert not ConflictDecision.objects.exists()
    _shown_undecidable(client, conflict, "round 1 is merging: decide once it is done")
    Round.objects.filter(pk=conflict.round_id).update(state="published")
    decide_conflict(Actor.system(), conflict, "dismiss")
    assert ConflictDecision.objects.count() == 1


def test_a_decision_for_a_tool_out_of_the_registry_is_refused(django_capture_on_commit_callbacks, client):
    """A tool deactivated in the registry since its conflict was logged gets no precaution nor
    scenario from any merge (`conflicts_to_precautions`, `conflict_winners` read the schema in
    force). An edited precaution or a picked scenario for it was stored, the page said it applies
    in the next merge, and that merge left it out; an accept was refused with "edit one instead",
    which did not apply either. Each is refused (409) naming the tool; a dismissal still is
    taken. The page says why, and offers only Dismiss."""
    from django.contrib.auth.models import User

    from compendium.models import Tool

    capture = django_capture_on_commit_callbacks
    org, clients, conflict = conflicted_round(capture)
    winner = next(d["text"] for d in conflict.dissenters)
    Tool.objects.filter(tool_id="weather").update(active=False)
    for action, text in (("edit", "Ask for the city before using WeatherNow"),
                         ("scenario", winner), ("accept", "")):
        with pytest.raises(Conflict, match="weather is not in the registry in force"):
            decide_conflict(Actor.system(), conflict, action, text)
    assert not ConflictDecision.objects.exists()
    operator = User.objects.create_superuser("op", password="pw-long-enough-1")
    client.force_login(operator)
    card = html.unescape(client.get("/conflicts/").content.decode())
    assert "weather is not in the registry in force" in card
    assert re.findall(r'name="action" value="(\w+)"', card) == ["dismiss"]
    refused = client.post(f"/conflicts/{conflict.pk}/decide/",
                          {"action": "edit", "text": "Ask for the city first"})
    assert refused.status_code == 409
    decide_conflict(Actor.system(), conflict, "dismiss")
    # Reactivated before the next merge: the decisions apply again, and are taken.
    Tool.objects.filter(tool_id="weather").update(active=True)
    decide_conflict(Actor.system(), conflict, "edit", "Ask for the city before using WeatherNow")
    edge = next_round_edge(org, clients, capture)
    assert "Ask for the city before using WeatherNow" in [p["text"] for p in edge["precautions"]]


def test_across_tools_a_deactivated_losing_tool_leaves_only_the_pick_for_the_other(
    django_capture_on_commit_callbacks, client
):
    """Across tools the precaution is the losing tool's, and a pick wins for the tool it names:
    with `fares` deactivated, an edited precaution (for `fares`) and a pick for `fares` are
    refused naming it; a pick for `flights` is taken. The page offers that pick only."""
    from django.contrib.auth.models import User

    from compendium.models import Tool
    from tests.merge_helpers import CROSS_EDGE_REQUEST as request
    from tests.merge_helpers import plant_cross_edge_conflict

    r1 = Round.objects.create(number=1, state="closing", config={"summarizer": "none"})
    plant_cross_edge_conflict(r1)
    close(r1, django_capture_on_commit_callbacks)
    [conflict] = ConflictLogEntry.objects.filter(round=r1, organization=None)
    Tool.objects.filter(tool_id="fares").update(active=False)
    with pytest.raises(Conflict, match="fares is not in the registry in force"):
        decide_conflict(Actor.system(), conflict, "edit", "Do not use AirfareWatch to book")
    with pytest.raises(Conflict, match="fares is not in the registry in force"):
        decide_conflict(Actor.system(), conflict, "scenario", request, "fares")
    operator = User.objects.create_superuser("op", password="pw-long-enough-1")
    client.force_login(operator)
    page = html.unescape(client.get("/conflicts/").content.decode())
    assert "fares is not in the registry in force" in page
    assert 'class="edit"' not in page
    [options] = re.findall(r'<select name="pick"[^>]*>(.*?)</select>', page, re.S)
    assert re.findall(r"<option [^>]*>([^<]*)</option>", options) == [f"flights: {request}"]
    decide_conflict(Actor.system(), conflict, "scenario", request, "flights")
    assert ConflictDecision.objects.get().winner_tool_id == "flights"
