"""Federation services on the real database: enrollment, tokens, audit, settings, rounds."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError

from federation import ratelimit, services
from federation.errors import (
    BudgetExceeded,
    Conflict,
    InvalidTransition,
    NoOpenRound,
    NotAllowed,
    RateLimited,
)
from federation.models import AppendOnlyError, AuditLog, Client, ClientToken, Round
from federation.round_config import RoundConfig
from federation.signals import round_closed

pytestmark = pytest.mark.django_db


def test_approval_issues_a_token_stored_only_as_hash(world):
    row = ClientToken.objects.get(client=world.client_a)
    assert world.token_a.startswith("syn_c_") and len(world.token_a) > 40
    assert row.token_hash == services.hash_token(world.token_a)
    assert world.token_a not in row.token_hash
    assert services.client_for_token(world.token_a) == world.client_a


def test_admin_enrolls_but_only_operator_approves_by_default(world):
    admin = world.actor(world.admin_a)
    client = services.enroll_client(admin, world.org_a, "new", contact="ops@a.example")
    assert client.status == Client.Status.PENDING
    with pytest.raises(NotAllowed, match="allow_admin_approval"):
        services.approve_client(admin, client)
    issued = services.approve_client(world.actor(world.operator), client)
    assert issued.client.status == Client.Status.APPROVED


def test_policy_lets_admin_approve_own_clients_only(world):
    services.update_settings(world.actor(world.operator), allow_admin_approval=True)
    issued = services.approve_client(world.actor(world.admin_a), world.pending_a)
    assert services.client_for_token(issued.token) == world.pending_a
    with pytest.raises(NotAllowed):
        services.approve_client(world.actor(world.admin_a), world.pending_b)


def test_member_and_foreign_admin_cannot_manage_clients(world):
    for user in (world.member_a, world.admin_b):
        actor = world.actor(user)
        with pytest.raises(NotAllowed):
            services.enroll_client(actor, world.org_a, "x")
        with pytest.raises(NotAllowed):
            services.rotate_client_token(actor, world.client_a)
        with pytest.raises(NotAllowed):
            services.revoke_client(actor, world.client_a)


def test_rotation_stops_old_token_at_once(world):
    issued = services.rotate_client_token(world.actor(world.admin_a), world.client_a)
    with pytest.raises(services.TokenRejected) as exc:
        services.client_for_token(world.token_a)
    assert exc.value.status_code == 401
    assert services.client_for_token(issued.token) == world.client_a


def test_revocation_stops_token_at_once(world):
    services.revoke_client(world.actor(world.admin_a), world.client_a, "laptop stolen")
    with pytest.raises(services.TokenRejected) as exc:
        services.client_for_token(world.token_a)
    assert exc.value.status_code == 403
    with pytest.raises(InvalidTransition):
        services.rotate_client_token(world.actor(world.operator), world.client_a)
    with pytest.raises(InvalidTransition):
        services.approve_client(world.actor(world.operator), world.client_a)


def test_duplicate_client_name_is_a_conflict(world):
    with pytest.raises(Conflict):
        services.enroll_client(world.actor(world.admin_a), world.org_a, "a1")


def test_enrollment_is_rate_limited_per_organization(world):
    services.update_settings(world.actor(world.operator), enrollments_per_hour=2)
    admin = world.actor(world.admin_a)
    services.enroll_client(admin, world.org_a, "r1")
    services.enroll_client(admin, world.org_a, "r2")
    with pytest.raises(RateLimited) as exc:
        services.enroll_client(admin, world.org_a, "r3")
    assert 1 <= exc.value.retry_after <= 3600
    # Another organization has its own window.
    services.enroll_client(world.actor(world.admin_b), world.org_b, "r1")


def test_rate_limit_window_resets():
    first = [ratelimit.hit("t:key", 2, 60, now=120.0).allowed for _ in range(3)]
    assert first == [True, True, False]
    assert ratelimit.hit("t:key", 2, 60, now=180.5).allowed
    assert ratelimit.hit("t:key", 2, 60, now=150.0).retry_after == 30


def test_every_state_change_is_audited(world):
    operator = world.actor(world.operator)
    services.rotate_client_token(world.actor(world.admin_a), world.client_a)
    services.revoke_client(world.actor(world.admin_a), world.client_a)
    services.update_settings(operator, epsilon_budget=20.0)
    rnd = services.open_round(operator, RoundConfig(epsilon=0.5))
    services.close_round(operator, rnd)
    services.mark_failed(rnd, "worker died")
    services.retry_round(operator, rnd)
    actions = list(AuditLog.objects.order_by("id").values_list("action", flat=True))
    for action in [
        "organization.create", "client.enroll", "client.approve", "client.rotate",
        "client.revoke", "settings.change", "round.open", "round.close", "round.fail",
        "round.retry",
    ]:
        assert action in actions
    entry = AuditLog.objects.get(action="settings.change")
    assert entry.actor == world.operator and entry.ip == "10.0.0.1"
    assert entry.details == {"epsilon_budget": {"from": 50.0, "to": 20.0}}
    revoke = AuditLog.objects.get(action="client.revoke")
    assert revoke.organization == world.org_a and revoke.actor_label == "admin_a"


def test_audit_log_is_append_only_in_model_and_database(world):
    entry = AuditLog.objects.first()
    entry.action = "client.approve"
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        AuditLog.objects.all().update(actor_label="x")
    with pytest.raises(AppendOnlyError):
        AuditLog.objects.all().delete()
    for sql in (
        "UPDATE federation_auditlog SET actor_label = 'forged'",
        "DELETE FROM federation_auditlog",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql)
    assert not AuditLog.objects.filter(actor_label="forged").exists()


def test_round_state_machine(world):
    operator = world.actor(world.operator)
    r1 = services.open_round(operator, RoundConfig(tau=0.9, seed=7))
    assert (r1.number, r1.state) == (1, "open")
    assert RoundConfig(**r1.config) == RoundConfig(tau=0.9, seed=7)
    with pytest.raises(Conflict, match="still open"):
        services.open_round(operator)
    with pytest.raises(InvalidTransition, match="it is open"):
        services.mark_published(r1)
    services.close_round(operator)
    with pytest.raises(InvalidTransition):
        services.close_round(operator, r1)
    with pytest.raises(InvalidTransition):
        services.retry_round(operator, r1)
    services.mark_merging(r1)
    services.mark_published(r1)
    r1.refresh_from_db()
    assert r1.state == "published" and r1.published_at and r1.closed_at
    with pytest.raises(InvalidTransition, match="final"):
        services.mark_failed(r1, "too late")
    r2 = services.open_round(operator)
    assert r2.number == 2
    services.close_round(operator)
    with pytest.raises(NoOpenRound):
        services.close_round(operator)


def test_only_operator_drives_rounds(world):
    for user in (world.admin_a, world.member_a):
        with pytest.raises(NotAllowed):
            services.open_round(world.actor(user))
    rnd = services.open_round(world.actor(world.operator))
    with pytest.raises(NotAllowed):
        services.close_round(world.actor(world.admin_a), rnd)
    with pytest.raises(NotAllowed):
        services.update_settings(world.actor(world.admin_a), allow_admin_approval=True)


def test_privacy_budget_caps_rounds(world):
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=1.5)
    rnd = services.open_round(operator, RoundConfig(epsilon=1.0))
    services.close_round(operator, rnd)
    with pytest.raises(BudgetExceeded, match="privacy budget"):
        services.open_round(operator, RoundConfig(epsilon=1.0))
    services.open_round(operator, RoundConfig(epsilon=0.5))
    with pytest.raises(BudgetExceeded):
        services.update_settings(operator, epsilon_budget=1.0)
    assert Round.objects.count() == 2


def test_round_closed_signal_is_sent_after_commit_on_close_and_retry(
    world, django_capture_on_commit_callbacks, without_merge_pipeline
):
    received = []

    def receiver(sender, round, **kwargs):
        received.append((sender, round.number, round.state))

    round_closed.connect(receiver)
    try:
        operator = world.actor(world.operator)
        rnd = services.open_round(operator)
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            services.close_round(operator, rnd)
            assert received == []  # not before the transaction commits
        assert len(callbacks) == 1
        services.mark_failed(rnd, "edge 2 timed out")
        with django_capture_on_commit_callbacks(execute=True):
            services.retry_round(operator, rnd)
    finally:
        round_closed.disconnect(receiver)
    assert received == [(Round, 1, "closing"), (Round, 1, "closing")]
    rnd.refresh_from_db()
    assert rnd.failure_reason == ""


def test_close_rolled_back_sends_nothing(world, django_capture_on_commit_callbacks):
    rnd = services.open_round(world.actor(world.operator))
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            services.close_round(world.actor(world.operator), rnd)
            raise RuntimeError("abort")
    assert callbacks == []
    rnd.refresh_from_db()
    assert rnd.state == "open"


def test_retry_needs_a_failed_round_and_close_an_open_one(world):
    operator = world.actor(world.operator)
    rnd = services.open_round(operator)
    with pytest.raises(InvalidTransition, match="needs a failed round"):
        services.retry_round(operator, rnd)
    services.close_round(operator, rnd)
    services.mark_failed(rnd, "boom")
    with pytest.raises(InvalidTransition, match="needs an? open round"):
        services.close_round(operator, rnd)
