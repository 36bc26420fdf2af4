"""An organization admin's right is checked under a lock of their membership row inside every
admin action's transaction, not only in the People actions: adding a person, enrolling,
approving, rotating and revoking a client, deciding a conflict. An admin whom another admin (or
the operator) deactivated or demoted while their request was in flight, after it was
authenticated, is refused and nothing is created or changed; the operator acts as before."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from federation import conflicts, people, services
from federation.errors import NotAllowed
from federation.models import (
    AuditLog,
    Client,
    ClientToken,
    ConflictDecision,
    ConflictLogEntry,
    Membership,
    Round,
)
from tests.federation_fixtures import SYSTEM, another_waits_on_a_lock

pytestmark = pytest.mark.django_db


def conflict_of(org) -> ConflictLogEntry:
    rnd = Round.objects.create(number=1, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
    return ConflictLogEntry.objects.create(
        round=rnd, organization=org, tool_id="weather", centroid_id="c0",
        centroid={"text": "Will it rain tomorrow in Paris?", "preconditions": {"has_city": True}},
        dissenters=[{"text": "Rain in Paris without a city", "preconditions": {"has_city": False}}],
        reason="preconditions disagree",
    )


def state(world) -> dict:
    """What any of the actions below would change."""
    return {
        "logins": sorted(get_user_model().objects.values_list("username", flat=True)),
        "clients": sorted(Client.objects.values_list("name", "status")),
        "tokens": sorted(ClientToken.objects.values_list("client_id", "token_hash", "revoked_at")),
        "decisions": ConflictDecision.objects.count(),
        "audit": AuditLog.objects.count(),
    }


# Each admin action of an organization admin of org A, with the audit action it records.
ACTIONS = {
    "add person": (
        lambda w, actor: people.add_person(actor, w.org_a, "carol", "member"),
        "person.add",
    ),
    "enroll client": (
        lambda w, actor: services.enroll_client(actor, w.org_a, "a-new"),
        "client.enroll",
    ),
    "approve client": (
        lambda w, actor: services.approve_client(actor, w.pending_a),
        "client.approve",
    ),
    "rotate token": (
        lambda w, actor: services.rotate_client_token(actor, w.client_a),
        "client.rotate",
    ),
    "revoke client": (
        lambda w, actor: services.revoke_client(actor, w.client_a, "lost laptop"),
        "client.revoke",
    ),
    "decide conflict": (
        lambda w, actor: conflicts.decide_conflict(actor, w.conflict_a, "dismiss"),
        "conflict.decide",
    ),
}


# What another admin (or the operator) did to admin A meanwhile, straight in the database.
CHANGES = {
    "deactivated": lambda w: get_user_model().objects.filter(pk=w.admin_a.pk).update(is_active=False),
    "demoted": lambda w: Membership.objects.filter(user=w.admin_a).update(role=Membership.Role.MEMBER),
    "moved to org B": lambda w: Membership.objects.filter(user=w.admin_a).update(organization=w.org_b),
}


@pytest.fixture
def acting(world):
    """world, with admin approval allowed (so that an admin's approval is refused for their
    right, not for the policy) and a conflict of org A's edge to decide."""
    services.update_settings(world.actor(world.operator), allow_admin_approval=True)
    world.conflict_a = conflict_of(world.org_a)
    return world


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("action", list(ACTIONS))
def test_an_admin_deactivated_or_demoted_in_flight_is_refused_and_changes_nothing(acting, action, change):
    """The actor is built (and their membership read, as the request's authentication and a
    page's can_admin do) before another admin's change commits; the action then runs with it."""
    call, audited = ACTIONS[action]
    world = acting
    actor = world.actor(world.admin_a)
    assert services.can_admin(actor, world.org_a.pk)  # what the request saw
    CHANGES[change](world)
    before = state(world)
    with pytest.raises(NotAllowed, match="only"):
        call(world, actor)
    assert state(world) == before
    assert not AuditLog.objects.filter(action=audited, actor=world.admin_a).exists()


@pytest.mark.parametrize("action", list(ACTIONS))
def test_an_admin_whose_right_still_holds_acts(acting, action):
    call, audited = ACTIONS[action]
    call(acting, acting.actor(acting.admin_a))
    assert AuditLog.objects.filter(action=audited, actor=acting.admin_a).exists()


@pytest.mark.parametrize("action", list(ACTIONS))
@pytest.mark.parametrize("who", ["operator", "system"])
def test_the_operator_and_the_system_act_as_before(acting, action, who):
    """The operator is in no organization, and the system has no login: neither is refused."""
    call, audited = ACTIONS[action]
    actor = acting.actor(acting.operator) if who == "operator" else SYSTEM
    call(acting, actor)
    assert AuditLog.objects.filter(action=audited).exists()


@pytest.mark.django_db(transaction=True)
def test_an_admin_deactivated_while_enrolling_a_client_is_refused(registry, monkeypatch):
    """Ann deactivates Ben while Ben's enrollment is in flight: Ben's enrollment waits for the
    lock Ann's deactivation holds on Ben's membership, then finds Ben inactive and creates no
    client (before, its check read Ben as an admin and the client was created)."""
    org = services.create_organization(SYSTEM, "Org T", "org-t")
    ann = people.add_person(SYSTEM, org, "ann", "admin").membership
    ben = people.add_person(SYSTEM, org, "ben", "admin").membership
    ben_actor = services.Actor.for_user(get_user_model().objects.get(pk=ben.user_id))
    assert services.can_admin(ben_actor, org.pk)  # Ben's request was authenticated as an admin
    real_audit = people.audit
    ann_holds_locks = threading.Event()

    def slow_audit(actor, action, **kwargs):  # the deactivation holds its locks until the
        if actor.name == "ann":                # enrollment waits for them
            ann_holds_locks.set()
            another_waits_on_a_lock()
        return real_audit(actor, action, **kwargs)

    monkeypatch.setattr(people, "audit", slow_audit)
    outcomes = {}

    def ann_deactivates_ben():
        try:
            actor = services.Actor.for_user(get_user_model().objects.get(pk=ann.user_id))
            people.set_active(actor, ben, False)
            outcomes["ann"] = "done"
        finally:
            connection.close()

    def ben_enrolls():
        ann_holds_locks.wait(5)
        try:
            services.enroll_client(ben_actor, org, "t-new")
            outcomes["ben"] = "enrolled"
        except NotAllowed as exc:
            outcomes["ben"] = exc.detail
        finally:
            connection.close()

    threads = [threading.Thread(target=ann_deactivates_ben), threading.Thread(target=ben_enrolls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert outcomes["ann"] == "done" and "only an admin" in outcomes["ben"]
    assert not Client.objects.filter(organization=org).exists()
    assert not AuditLog.objects.filter(action="client.enroll", organization=org).exists()
