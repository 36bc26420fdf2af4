"""A reviewer's decision on a logged conflict changes the next round's edge merge (the real
pipeline: edge merge of round 1 logs the conflict, the decision is taken through the service,
round 2's edge merge applies it)."""

from __future__ import annotations

import pytest

from compendium.models import CompendiumVersion
from compendium.schema import Compendium
from compendium.services import store_compendium
from federation.conflicts import decide_conflict
from federation.models import ConflictLogEntry, Round
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
