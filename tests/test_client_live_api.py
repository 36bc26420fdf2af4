"""The client toolkit against the real federation API served on 127.0.0.1 (pytest-django's live
server): submit twice without a duplicate row, and pull only what is published."""

from __future__ import annotations

import pytest

from compendium.client_api import ClientError, SynapseClient
from compendium.models import CompendiumVersion
from compendium.validation import load_valid_compendium
from federation import services
from federation.models import Submission

pytestmark = pytest.mark.django_db(transaction=True)


def test_submit_and_pull_against_the_real_api(live_server, world, valid_doc, small_schema, tmp_path):
    services.open_round(services.Actor(None))
    compendium = load_valid_compendium(valid_doc, small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        first = client.submit(compendium)
        again = client.submit(compendium)  # a duplicate send: same key, replayed answer
    assert first.body == again.body and not first.replayed and again.replayed
    assert Submission.objects.filter(client=world.client_a).count() == 1
    assert CompendiumVersion.objects.filter(kind="client", client=world.client_a).count() == 1
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(ClientError, match="published"):
            client.pull(tmp_path / "global.json")


def test_revoked_token_is_one_clear_error(live_server, world, valid_doc, small_schema):
    services.open_round(services.Actor(None))
    services.revoke_client(services.Actor(None), world.client_a)
    compendium = load_valid_compendium(valid_doc, small_schema)
    with SynapseClient(live_server.url, world.token_a, backoff=0) as client:
        with pytest.raises(ClientError):
            client.submit(compendium)
