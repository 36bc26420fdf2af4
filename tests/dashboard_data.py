"""A small federation stored through the real services, for the dashboard tests.

Two organizations with two clients each, rounds 1 and 2 published with client submissions and a
global compendium each, round 3 merged but not published (its global result is the operator's
alone), round 4 open. 30 extra registry tools make the tool registry paginate.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.utils import timezone

from compendium.schema import (
    AnnexTriple,
    Compendium,
    Precaution,
    PromptTemplate,
    Scenario,
    ToolMetadata,
    ToolSpec,
)
from compendium.services import import_registry, seed_default_numeric_fields, store_compendium
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
    # The pages read the declared numeric fields (flights.calls' window); a transactional test
    # run before flushes the rows the migration seeded.
    seed_default_numeric_fields()
    acme = Organization.objects.create(name="Acme Research", slug="acme")
    globex = Organization.objects.create(name="Globex Health", slug="globex")
    clients = [
        Client.objects.create(organization=org, name=f"{org.slug}-node-{i}", status=Client.Status.APPROVED)
        for org in (acme, globex)
        for i in (1, 2)
    ]
    clients.append(Client.objects.create(organization=globex, name="globex-pending", status="pending"))
    rounds = {
        1: Round.objects.create(number=1, state=Round.State.PUBLISHED, published_at=timezone.now()),
        2: Round.objects.create(number=2, state=Round.State.PUBLISHED, published_at=timezone.now()),
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


ACCURACY_DOCUMENT = {
    "summary": [
        {"method": "synapse", "round": r, "seeds": 2, "accuracy_mean": a, "accuracy_sd": 0.02,
         "macro_accuracy_mean": a - 0.05}
        for r, a in ((1, 0.52), (2, 0.61), (3, 0.66), (4, 0.69))
    ] + [
        {"method": "static_global", "round": r, "seeds": 2, "accuracy_mean": 0.52, "accuracy_sd": 0.0,
         "macro_accuracy_mean": 0.47}
        for r in (1, 2, 3, 4)
    ] + [
        {"method": "centralized", "round": None, "seeds": 2, "accuracy_mean": 0.74,
         "accuracy_sd": 0.01, "macro_accuracy_mean": 0.7},
        {"method": "local_only", "round": None, "seeds": 2, "accuracy_mean": 0.41,
         "accuracy_sd": 0.03, "macro_accuracy_mean": 0.37},
    ],
    "per_category": {"Math": {"accuracy": 0.81, "n": 16}, "Travel": {"accuracy": 0.66, "n": 24},
                     "Weather": {"accuracy": 0.58, "n": 12}},
    "adversarial": [
        {"adversarial_mode": mode, "adversarial_fraction": f, "robust_rule": rule,
         "accuracy": round(0.69 - f * drop, 3)}
        for mode in ("random_corruption", "label_flip")
        for rule, drop in (("none", 0.6), ("krum", 0.15))
        for f in (0.0, 0.2, 0.4)
    ],
    "privacy_sweep": [
        {"epsilon": e, "mask_strength": m, "accuracy": round(0.55 + 0.04 * e - 0.05 * m, 3),
         "membership_auroc": round(0.5 + 0.03 * e + 0.08 * (1 - m), 3)}
        for e in (0.5, 1.0, 2.0, 4.0)
        for m in (0.0, 1.0)
    ],
}


@dataclass
class Review:
    acme_admin: object
    acme_member: object
    globex_admin: object


def add_review_data(fed: Federation, *, embed: bool = False) -> Review:
    """People of every role (admin and member of Acme, admin of Globex), admin approval allowed,
    edge compendiums, conflicts and ledger rows at each edge, and a stored simulation. With
    `embed`, the published global compendium of round 2 gets its scenario embeddings (the routing
    playground needs them; loads the embedding model)."""
    from compendium.models import CompendiumVersion, ScenarioEntry
    from federation import services
    from federation.models import (
        ConflictLogEntry,
        MergeRecord,
        PrivacyLedgerEntry,
        SimulationRun,
    )

    system = services.Actor.system("demo data")
    user_model = get_user_model()
    people = {}
    for username, org, role in (
        ("acme-admin", fed.acme, "admin"),
        ("acme-member", fed.acme, "member"),
        ("globex-admin", fed.globex, "admin"),
    ):
        people[username] = user_model.objects.create_user(username, f"{username}@example.org", PASSWORD)
        services.set_membership(system, people[username], org, role)
    services.update_settings(system, allow_admin_approval=True)
    services.enroll_client(system, fed.acme, "acme-node-3", contact="lab3@acme.example")
    for number in (1, 2):
        rnd = fed.rounds[number]
        for org in (fed.acme, fed.globex):
            store_compendium(client_compendium(0, number), kind="edge", round=rnd, organization=org)
            MergeRecord.objects.create(round=rnd, organization=org, stats={"conflicts": 1})
            for field, eps in (("calls", 0.4), ("success_rate", 0.5)):
                PrivacyLedgerEntry.objects.create(
                    round=rnd, organization=org, tool_id="weather", field=field, sensitivity=1.0,
                    contributors=2 + number, epsilon=eps * (1 if org == fed.acme else 0.8),
                    noise_scale=1.0 / eps, mechanism="laplace",
                )
    for org, city in ((fed.acme, "Paris"), (fed.globex, "Berlin")):
        ConflictLogEntry.objects.create(
            round=fed.rounds[2], organization=org, tool_id="weather", centroid_id="c0",
            centroid={"text": f"Will it rain tomorrow in {city}?", "preconditions": {"has_city": True}},
            dissenters=[{"text": f"Is it going to rain near {city} airport",
                         "preconditions": {"has_city": False}}],
            reason="preconditions disagree: has_city",
        )
    SimulationRun.objects.create(label="demo simulation", dataset="tiny", document=ACCURACY_DOCUMENT,
                                 seconds=42)
    if embed:
        from routing.embeddings import get_query_engine

        version = CompendiumVersion.objects.get(kind="global", round=fed.rounds[2])
        rows = list(ScenarioEntry.objects.filter(version=version).order_by("id"))
        vectors = get_query_engine().embed([r.text for r in rows])
        for row, vector in zip(rows, vectors, strict=True):
            row.embedding = vector.tolist()
            row.save(update_fields=["embedding"])
    return Review(people["acme-admin"], people["acme-member"], people["globex-admin"])
