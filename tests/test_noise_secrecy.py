"""The Laplace noise an edge adds must not be computable by the other members of the federation.

Every edge release's noise comes from a seeded generator so that a round can be replayed, but the
seed's inputs (the round's configuration, its number, the organization's slug, the release) are
all known to every client: `GET /api/v1/rounds/` shows the configuration with its seed to any
client token, and the default seed is 0. Whoever can recompute the noise can subtract it from the
published global and read another organization's clipped average exactly: differential privacy
is gone. The server mixes a secret into the seed."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from rest_framework.test import APIClient

from compendium.schema import Compendium
from compendium.services import store_compendium
from federation import pipeline, services
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


@pytest.mark.usefixtures("every_field_released")  # one client at Globex: b = 600, 12 × the window
def test_a_client_of_another_organization_cannot_remove_an_edges_noise(
    settings, django_capture_on_commit_callbacks,
):
    """Globex's edge releases its only client's calls of the flights tool. The noise is drawn as
    the server draws it (`operator._statistic_rng` of the release's seed): from the server's own
    seed it comes off exactly (the control: the draw is modelled right), from the public values
    alone it does not. Without the secret the two seeds are one, and the figure is read to within
    its rounding. The round's seed (48) and the fixed secret give a draw, with the secret, that the
    field's clipping window [0, 50] does not clamp (a release is clamped to the window, not to
    the declared range: at b = 600 most draws are)."""
    from compendium.models import CompendiumVersion
    from federation.merge.operator import _statistic_rng
    from federation.merge.privacy import laplace_release
    from federation.models import PrivacyLedgerEntry

    settings.SYNAPSE_NOISE_SECRET = "a server-side secret"
    round_, clients = build_federation(
        config={"epsilon": 1.0, "summarizer": "none", "seed": 48}
    )
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

    # Acme's client sees the round's configuration (its seed), as every client does.
    token = services.rotate_client_token(SYSTEM, clients[("acme", "a1")]).token
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    config = api.get("/api/v1/rounds/").json()["results"][0]["config"]
    assert config["seed"] == 48

    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=globex).content
    released = next(m["stats"]["calls"] for m in edge["metadata"] if m["tool_id"] == "flights")
    row = PrivacyLedgerEntry.objects.get(round=round_, organization=globex, tool_id="flights",
                                         field="calls")
    assert row.contributors == 1

    def noise(seed: np.random.SeedSequence) -> float:  # the release's draw under `seed`
        value, _ = laplace_release([float(GLOBEX_CALLS)], lower=-math.inf, upper=math.inf,
                                   sensitivity=row.sensitivity, epsilon=row.epsilon,
                                   rng=_statistic_rng(seed, "flights", "calls"))
        return value - GLOBEX_CALLS

    server_seed = pipeline.edge_seed(RoundConfig(**round_.config), round_, globex, 0)
    assert abs(released - noise(server_seed) - GLOBEX_CALLS) <= 1  # the draw is modelled right
    assert abs(released - GLOBEX_CALLS) > 1, "the test needs a draw that hides the figure"
    recovered = released - noise(_public_seed(config, round_.number, "globex", 0))
    # Before the secret, this was Globex's figure to within the release's rounding.
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


@pytest.mark.usefixtures("every_field_released")
def test_a_replay_under_another_noise_secret_is_a_new_release(probes, settings):
    """A replay (a retry, an erasure's reader) draws its release's noise again from the seed,
    secret included. After the secret changed (SECRET_KEY rotated, SYNAPSE_NOISE_SECRET unset)
    the "same" release drew other noise over the same inputs and was recorded as the same
    release, charging nothing: two independent draws of one statistic, ε spent once. It is a new
    release now, charged, and replayed as such."""
    from federation.models import MergeRecord, PrivacyLedgerEntry

    round_, clients = build_federation(state="merging")
    acme = clients[("acme", "a1")].organization
    pipeline.run_edge_merge(round_.pk, acme.pk)
    ledger = PrivacyLedgerEntry.objects.filter(round=round_, organization=acme)
    assert set(ledger.values_list("release", flat=True)) == {0}
    settings.SYNAPSE_NOISE_SECRET = "rotated"
    pipeline.run_edge_merge(round_.pk, acme.pk)
    assert set(ledger.values_list("release", flat=True)) == {0, 1}
    assert MergeRecord.objects.get(round=round_, organization=acme).stats["release"] == 1
    pipeline.run_edge_merge(round_.pk, acme.pk)  # the same secret again: a replay of release 1
    assert set(ledger.values_list("release", flat=True)) == {0, 1}
