"""A small federation stored through the real services, for the dashboard tests.

Two organizations with two clients each, rounds 1 and 2 published with client submissions and a
global compendium each, round 3 merged but not published (its global result is the operator's
alone), round 4 open. 30 extra registry tools make the tool registry paginate.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model

from compendium.schema import (
    AnnexTriple,
    Compendium,
    Precaution,
    PromptTemplate,
    Scenario,
    ToolMetadata,
    ToolSpec,
)
from compendium.services import import_registry, store_compendium
from federation.models import Client, Organization, Round

PASSWORD = "correct-horse-battery-staple"

TOOLS = [
    ToolSpec(tool_id="weather", name="Weather", description="Weather forecasts for a city", category="Weather"),
    ToolSpec(tool_id="flights", name="Flights", description="Search and book flights", category="Travel"),
    ToolSpec(tool_id="calculator", name="Calculator", description="Evaluate arithmetic", category="Math"),
] + [
    ToolSpec(tool_id=f"extra{i:02d}", description=f"Extra tool number {i}", category="Misc")
    for i in range(30)
]


@dataclass
class Federation:
    acme: Organization
    globex: Organization
    clients: list[Client]
    rounds: dict[int, Round]
    operator: object
    member: object


def client_compendium(client_index: int, round_number: int) -> Compendium:
    """Submissions that grow over rounds, so the bytes chart has a slope."""
    scenarios = [
        Scenario(tool_id="weather", text=f"client {client_index} asks for rain, round {r}")
        for r in range(1, round_number + 1)
    ]
    return Compendium(
        metadata=[ToolMetadata(tool_id="weather", stats={"calls": 10.0 + client_index})],
        scenarios=scenarios,
        precautions=[Precaution(tool_id="calculator", text="Do not convert currencies")],
    )


def global_compendium(round_number: int) -> Compendium:
    scenarios = [
        Scenario(tool_id="weather", text="Will it rain tomorrow in a city?", support=3,
                 preconditions={"has_city": True}),
        Scenario(tool_id="flights", text="Find a cheap flight between two airports", support=2),
    ]
    if round_number >= 2:
        scenarios.append(Scenario(tool_id="flights", text="Change the date of a booked flight"))
    if round_number >= 3:
        scenarios.append(Scenario(tool_id="weather", text="Unpublished merge result scenario"))
    return Compendium(
        metadata=[
            ToolMetadata(tool_id="weather", stats={"calls": 41.5 + round_number, "success_rate": 0.93}),
            ToolMetadata(tool_id="flights", stats={"calls": 12.25}),
        ],
        scenarios=scenarios,
        precautions=[Precaution(tool_id="calculator", text="Do not use for currency conversion", support=2)],
        templates=[PromptTemplate(tool_id="weather", signature="forecast(city, days)",
                                  template="Forecast for {city} over {days} days")],
        annex=[
            AnnexTriple(subject="flights", relation="needs", object="airport code"),
            AnnexTriple(subject="hotel booking", relation="follows", object="flights"),
            AnnexTriple(subject="currency", relation="is measured in", object="ISO 4217 code"),
        ],
    )


def build_federation() -> Federation:
    import_registry(TOOLS)
    acme = Organization.objects.create(name="Acme Research", slug="acme")
    globex = Organization.objects.create(name="Globex Health", slug="globex")
    clients = [
        Client.objects.create(organization=org, name=f"{org.slug}-node-{i}", status=Client.Status.APPROVED)
        for org in (acme, globex)
        for i in (1, 2)
    ]
    clients.append(Client.objects.create(organization=globex, name="globex-pending", status="pending"))
    rounds = {
        1: Round.objects.create(number=1, state=Round.State.PUBLISHED),
        2: Round.objects.create(number=2, state=Round.State.PUBLISHED),
        3: Round.objects.create(number=3, state=Round.State.MERGING),
        4: Round.objects.create(number=4, state=Round.State.OPEN),
    }
    for number in (1, 2, 3):
        participants = clients[:4] if number > 1 else clients[:3]
        for index, client in enumerate(participants):
            store_compendium(
                client_compendium(index, number), kind="client", round=rounds[number], client=client
            )
        store_compendium(global_compendium(number), kind="global", round=rounds[number])
    user_model = get_user_model()
    operator = user_model.objects.create_superuser("operator", "op@example.org", PASSWORD)
    member = user_model.objects.create_user("member", "member@example.org", PASSWORD)
    return Federation(acme, globex, clients, rounds, operator, member)
