"""Shared builders for the pipeline tests: a registry, organizations, clients and submissions."""

from __future__ import annotations

import json
from pathlib import Path

from compendium.schema import Compendium, ToolSpec
from compendium.services import import_registry, seed_default_numeric_fields, store_compendium
from federation.models import Client, Organization, Round

TOOLS = [
    ToolSpec(tool_id="weather", name="WeatherNow",
             description="Weather forecasts, rain and temperature for a city"),
    ToolSpec(tool_id="flights", name="FlightFinder",
             description="Search and book airline flights between airports"),
    ToolSpec(tool_id="calculator", name="Calculator",
             description="Evaluate arithmetic expressions and compute numbers"),
]

CLIENT_DOCS = {
    ("acme", "a1"): {
        "scenarios": [
            {"tool_id": "weather", "text": "Will it rain tomorrow in Paris?"},
            {"tool_id": "flights", "text": "Book a cheap flight from Boston to Denver"},
        ],
        "metadata": [{"tool_id": "weather", "stats": {"success_rate": 0.9, "calls": 10}}],
        "precautions": [{"tool_id": "calculator", "text": "Do not use for currency rates"}],
    },
    ("acme", "a2"): {
        "scenarios": [
            {"tool_id": "weather", "text": "Will it rain tomorrow in Paris"},
            {"tool_id": "calculator", "text": "What is 17 multiplied by 23?"},
        ],
        "metadata": [{"tool_id": "weather", "stats": {"success_rate": 0.7, "calls": 20}}],
    },
    ("globex", "g1"): {
        "scenarios": [
            {"tool_id": "weather", "text": "What is the temperature in Berlin today?"},
            {"tool_id": "flights", "text": "Find flights from Rome to Madrid next week"},
        ],
        "metadata": [{"tool_id": "flights", "stats": {"success_rate": 0.5}}],
    },
}

PROBES = [
    ("Is it going to rain in London tomorrow?", "weather"),
    ("How warm is it in Oslo today?", "weather"),
    ("Find me a flight to Tokyo", "flights"),
    ("Book a plane ticket to Lisbon", "flights"),
    ("What is 12 times 9?", "calculator"),
    ("Compute 144 divided by 12", "calculator"),
]


def write_probe_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "tools.jsonl").open("w") as handle:
        for tool in TOOLS:
            handle.write(json.dumps({"tool_id": tool.tool_id, "description": tool.description}) + "\n")
    with (folder / "queries.jsonl").open("w") as handle:
        for i, (text, tool) in enumerate(PROBES):
            handle.write(json.dumps({"query": text, "tool_id": tool, "qid": f"p{i}"}) + "\n")
    return folder


# A round configuration under which this world's edges (2 and 1 clients) release their numeric
# fields: ε = 4 under a field cap F* = 1, ε_j = ε/(2·F*·F) = 1/2, so the narrowest published noise
# is 1/(K·ε_j·√E) = 1/√2 of each field's clipping window. At the default ε = 1 it would be as
# wide as the window (2.83 times), and no edge would release anything.
RELEASING_CONFIG = {"summarizer": "centroid", "seed": 11, "epsilon": 4.0, "field_cap": 1}


def build_federation(round_number: int = 1, config: dict | None = None, state: str = "closing"):
    """Registry, two organizations, three clients and their submissions for one round."""
    import_registry(TOOLS)
    # Transactional tests flush the rows the data migration seeded; put the declared fields back.
    seed_default_numeric_fields()
    round_ = Round.objects.create(number=round_number, state=state,
                                  config=config or {"summarizer": "centroid", "seed": 11})
    clients = {}
    for (org_slug, name), doc in CLIENT_DOCS.items():
        org, _ = Organization.objects.get_or_create(slug=org_slug, defaults={"name": org_slug})
        client, _ = Client.objects.get_or_create(organization=org, name=name,
                                                 defaults={"status": Client.Status.APPROVED})
        clients[(org_slug, name)] = client
        store_compendium(Compendium.model_validate({"schema_version": "1.0", **doc}),
                         kind="client", round=round_, client=client)
    return round_, clients


def plant_weather_conflict(round_: Round, clients: dict) -> Organization:
    """At acme, two clients say the weather scenario needs a city and a third client says it does
    not: the edge merge of `round_` logs a conflict for the weather tool."""
    from compendium.models import CompendiumVersion

    org = Organization.objects.get(slug="acme")
    extra = Client.objects.create(organization=org, name="a3", status="approved")
    store_compendium(
        Compendium.model_validate({"scenarios": [
            {"tool_id": "weather", "text": "Will it rain tomorrow in Paris?",
             "preconditions": {"has_city": False}}]}),
        kind="client", round=round_, client=extra,
    )
    for client in (clients[("acme", "a1")], clients[("acme", "a2")]):
        version = CompendiumVersion.objects.get(kind="client", round=round_, client=client)
        content = dict(version.content)
        for s in content["scenarios"]:
            if s["tool_id"] == "weather":
                s["preconditions"] = {"has_city": True}
        version.delete()
        store_compendium(Compendium.model_validate(content), kind="client", round=round_,
                         client=client)
    return org


# A request two tools can honestly be meant for (both pass the confusion check), claimed at acme
# for one and at globex for the other: each edge sees one tool only, the server merge both.
CROSS_EDGE_REQUEST = "Book a cheap flight from Boston to Denver next week"
_CROSS_EDGE_USAGE = {
    "flights": ["Find flights from Rome to Madrid next week", "Search airline tickets to Tokyo in May",
                "Is there a direct flight from Chicago to Dallas?", "Cheapest plane ticket to Miami on Friday"],
    "fares": ["Compare airline ticket prices to Tokyo", "Cheapest flights from Paris to Rome this month",
              "Track the fare of a flight to Denver", "Which airline is cheapest to London?"],
}


def plant_cross_edge_conflict(round_: Round) -> dict[str, Client]:
    """Registry with a second flight tool (`fares`); acme's clients a1 and a2 claim
    CROSS_EDGE_REQUEST for `flights`, globex's g1 for `fares`, each with its usage, in `round_`:
    the server merge of the round logs a conflict between edges. Returns the clients by name."""
    import_registry([*TOOLS, ToolSpec(tool_id="fares", name="AirfareWatch",
                                      description="Search and compare airline flight prices between airports")])
    clients = {}
    for (slug, name), tool in {("acme", "a1"): "flights", ("acme", "a2"): "flights",
                               ("globex", "g1"): "fares"}.items():
        org, _ = Organization.objects.get_or_create(slug=slug, defaults={"name": slug})
        clients[name] = Client.objects.create(organization=org, name=name, status="approved")
        scenarios = [{"tool_id": tool, "text": text}
                     for text in [CROSS_EDGE_REQUEST, *_CROSS_EDGE_USAGE[tool]]]
        store_compendium(Compendium.model_validate({"scenarios": scenarios}), kind="client",
                         round=round_, client=clients[name])
    return clients


def close_round(round_: Round, capture) -> None:
    """Close `round_` through the pipeline (its on-commit tasks run eagerly) and reload it."""
    from federation.signals import round_closed

    with capture(execute=True):
        round_closed.send(sender=Round, round=round_)
    round_.refresh_from_db()
