"""The Laplace noise an edge adds must not be computable by the other members of the federation.

Every edge release's noise comes from a seeded generator so that a round can be replayed, but the
seed's inputs (the round's configuration, its number, the organization's slug, the release) are
all known to every client: `GET /api/v1/rounds/` shows the configuration with its seed to any
client token, and the default seed is 0. Whoever can recompute the noise can subtract it from the
published global and read another organization's clipped average exactly: differential privacy
is gone. The server mixes a secret into the seed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from rest_framework.test import APIClient

from compendium.schema import Compendium
from compendium.services import store_compendium
from federation import pipeline, services
from federation.merge.privacy import laplace_scale
from federation.models import Client, Organization, Round
from federation.round_config import RoundConfig
from federation.signals import round_closed
from tests.federation_fixtures import SYSTEM
from tests.merge_helpers import build_federation

pytestmark = pytest.mark.django_db

GLOBEX_CALLS = 30.0  # the one figure of Globex's only client (within the clipping window)


def _public_seed(config: dict, number: int, slug: str, release: int) -> np.random.SeedSequence:
    """The seed as anyone can rebuild it from public values (what edge_seed drew before)."""
    slug_int = int.from_bytes(hashlib.sha256(slug.encode()).digest()[:8], "big")
    return np.random.SeedSequence([RoundConfig(**config).seed, number, slug_int, release])


def test_a_client_of_another_organization_cannot_remove_an_edges_noise(
    django_capture_on_commit_callbacks,
):
    round_, clients = build_federation(
        config={"epsilon": 1.0, "summarizer": "none", "seed": 0}
    )
    # Globex's only client is the only one reporting calls of the flights tool: the global's
    # figure is Globex's edge release.
    globex = Organization.objects.get(slug="globex")
    g2 = Client.objects.create(organization=globex, name="g2", status=Client.Status.APPROVED)
    store_compendium(
        Compendium.model_validate({
            "scenarios": [{"tool_id": "flights", "text": "Fly me from Oslo to Paris on Friday"}],
            "metadata": [{"tool_id": "flights", "stats": {"calls": GLOBEX_CALLS}}],
        }),
        kind="client", round=round_, client=g2,
    )
    Client.objects.filter(organization=globex).exclude(pk=g2.pk).update(
        status=Client.Status.REVOKED
    )
    with django_capture_on_commit_callbacks(execute=True):
        round_closed.send(sender=Round, round=round_)
    round_.refresh_from_db()
    assert round_.state == "published", round_.failure_reason

    # Acme's client sees the round's configuration (its seed) and the global, as every client does.
    token = services.rotate_client_token(SYSTEM, clients[("acme", "a1")]).token
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    config = api.get("/api/v1/rounds/").json()["results"][0]["config"]
    assert config["seed"] == 0
    schema = api.get("/api/v1/compendium/schema/").json()
    sensitivity = next(f["sensitivity"] for f in schema["numeric_fields"] if f["name"] == "calls")
    compendium = api.get("/api/v1/compendium/global/").json()["compendium"]
    published = next(m["stats"]["calls"] for m in compendium["metadata"] if m["tool_id"] == "flights")
    scale = laplace_scale(sensitivity, 1, RoundConfig(**config).per_field_epsilon(1))
    assert abs(published - GLOBEX_CALLS) > 1, "the test needs a draw that hides the figure"

    noise = np.random.default_rng(_public_seed(config, round_.number, "globex", 0)).laplace(
        0.0, scale
    )
    recovered = published - noise
    # Before the secret, this was Globex's figure to a tenth of a call.
    assert abs(recovered - GLOBEX_CALLS) > 1


def test_the_edge_seed_needs_the_servers_secret(settings):
    round_, _ = build_federation(config={"seed": 5})
    org = Organization.objects.get(slug="acme")
    config = RoundConfig(**round_.config)

    def draw() -> float:
        return float(np.random.default_rng(pipeline.edge_seed(config, round_, org, 0)).random())

    first = draw()
    assert draw() == first  # a replay on this server draws the same noise
    public = float(np.random.default_rng(_public_seed(round_.config, 1, "acme", 0)).random())
    assert first != public
    settings.SYNAPSE_NOISE_SECRET = "another deployment's secret"
    assert draw() != first
