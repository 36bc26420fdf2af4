"""Shared fixtures of the federation tests: two organizations with people of every role."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model

from compendium.services import current_schema, import_registry, seed_default_numeric_fields
from federation import services, submissions
from federation.models import ConflictLogEntry, Membership, PrivacyLedgerEntry, Round

SYSTEM = services.Actor.system("tests")


@dataclass
class World:
    org_a: object
    org_b: object
    operator: object
    admin_a: object
    member_a: object
    admin_b: object
    client_a: object
    token_a: str
    client_b: object
    token_b: str
    pending_a: object
    pending_b: object

    def actor(self, user):
        return services.Actor.for_user(user, "10.0.0.1")


def client_api(token: str | None = None, scheme: str = "Bearer"):
    """A REST API client sending `Authorization: <scheme> <token>` (none without a token)."""
    from rest_framework.test import APIClient

    api = APIClient()
    if token:
        api.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
    return api


def make_user(username, org=None, role=None, superuser=False):
    user = get_user_model().objects.create_user(username)  # unusable password: fast
    if superuser:
        user.is_superuser = user.is_staff = True
        user.save()
    if org is not None:
        Membership.objects.create(user=user, organization=org, role=role)
    return user


@pytest.fixture
def registry(small_schema):
    # The declared numeric fields come from a data migration; a transactional test's flush
    # removes them, so they are put back here for the tests that follow one.
    seed_default_numeric_fields()
    import_registry(small_schema.tools)
    return current_schema()


@pytest.fixture
def world(registry) -> World:
    org_a = services.create_organization(SYSTEM, "Org A", "org-a")
    org_b = services.create_organization(SYSTEM, "Org B", "org-b")
    operator = make_user("op", superuser=True)
    admin_a = make_user("admin_a", org_a, Membership.Role.ADMIN)
    member_a = make_user("member_a", org_a, Membership.Role.MEMBER)
    admin_b = make_user("admin_b", org_b, Membership.Role.ADMIN)
    client_a = services.enroll_client(SYSTEM, org_a, "a1")
    client_b = services.enroll_client(SYSTEM, org_b, "b1")
    token_a = services.approve_client(SYSTEM, client_a).token
    token_b = services.approve_client(SYSTEM, client_b).token
    pending_a = services.enroll_client(SYSTEM, org_a, "a-pending")
    pending_b = services.enroll_client(SYSTEM, org_b, "b-pending")
    client_a.refresh_from_db()
    client_b.refresh_from_db()
    return World(
        org_a, org_b, operator, admin_a, member_a, admin_b,
        client_a, token_a, client_b, token_b, pending_a, pending_b,
    )


@pytest.fixture
def fresh_routing(settings, tmp_path):
    """A server data folder of the test's own (tuned routers go there), tuning by hand, and no
    published version or served router remembered from another test, before or after."""
    from routing import services as routing_services

    settings.DATA_DIR = tmp_path / "server"
    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 0  # tuned by hand
    routing_services.forget_published_version()
    routing_services.forget_served()
    yield
    routing_services.forget_published_version()
    routing_services.forget_served()


@pytest.fixture(autouse=True)
def _fresh_settings_cache():
    services.clear_settings_cache()
    submissions.clear_dictionary_cache()
    yield
    services.clear_settings_cache()
    submissions.clear_dictionary_cache()


def record_outcome(outcome: list, step, finished: threading.Event | None = None) -> None:
    """Run `step`, as the target of a thread with its own database connection: append its result,
    or the exception it raised (which the test asserts on), to `outcome`; set `finished` once it is
    done; close the thread's connection."""
    from django.db import connection

    try:
        outcome.append(step())
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome.append(exc)
    finally:
        if finished is not None:
            finished.set()
        connection.close()


def another_waits_on_a_lock(
    timeout: float = 5.0, *, count: int = 1, done: threading.Event | None = None
) -> bool:
    """Until `count` other database sessions wait for a lock (the interleaving a race test
    needs), polled on this thread's connection; False after `timeout`, or once `done` is set
    (the step watched finished without waiting: the code under test took no lock the other
    session had to wait for)."""
    import time

    from django.db import connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (done is not None and done.is_set()):
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted")
            if cursor.fetchone()[0] >= count:
                return True
        threading.Event().wait(0.01)
    return False


@pytest.fixture
def fed(world):
    """(The dashboard tests' federation; modules with a `fed` of their own override it.)
    world (orgs A and B, people of every role) plus a published round 1 with a conflict and
    ledger rows at each edge, and an open round 2."""
    r1 = Round.objects.create(number=1, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
    Round.objects.create(number=2, state=Round.State.OPEN, config={"epsilon": 1.0})
    for org, word in ((world.org_a, "Paris"), (world.org_b, "Berlin")):
        ConflictLogEntry.objects.create(
            round=r1, organization=org, tool_id="weather", centroid_id="c0",
            centroid={"text": f"Will it rain tomorrow in {word}?", "preconditions": {"has_city": True}},
            dissenters=[{"text": f"Rain in {word} without a city", "preconditions": {"has_city": False}}],
            reason="preconditions disagree",
        )
        for field, eps in (("calls", 0.4), ("success_rate", 0.6)):
            PrivacyLedgerEntry.objects.create(
                round=r1, organization=org, tool_id="weather", field=field, sensitivity=1.0,
                contributors=3, epsilon=eps, noise_scale=1.0 / eps, mechanism="laplace",
            )
    return world
