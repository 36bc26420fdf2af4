"""Federation services on the real database: enrollment, tokens, audit, settings, rounds."""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.db.utils import DatabaseError

from compendium.models import NumericField
from federation import accounting, ratelimit, services
from federation.errors import (
    BudgetExceeded,
    Conflict,
    InvalidTransition,
    NoOpenRound,
    NotAllowed,
    RateLimited,
)
from federation.merge.privacy import round_spend
from federation.models import (
    AppendOnlyError,
    AuditLog,
    Client,
    ClientToken,
    PrivacyLedgerEntry,
    Round,
)
from federation.round_config import RoundConfig
from federation.signals import round_closed

pytestmark = pytest.mark.django_db


def _submit(rnd, client, text="Will it rain"):
    """A client's submission to `rnd` as the merge reads it (its compendium version)."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    return store_compendium(
        Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": text}]}),
        kind="client", round=rnd, client=client,
    )


def test_approval_issues_a_token_stored_only_as_hash(world):
    row = ClientToken.objects.get(client=world.client_a)
    assert world.token_a.startswith("syn_c_") and len(world.token_a) > 40
    assert row.token_hash == services.hash_token(world.token_a)
    assert world.token_a not in row.token_hash
    assert services.client_for_token(world.token_a) == world.client_a


def test_token_lookup_loads_the_client_with_its_organization_in_one_query(
    world, django_assert_num_queries
):
    with django_assert_num_queries(1):
        client = services.client_for_token(world.token_a)
        assert str(client) == f"{world.org_a.slug}/{world.client_a.name}"
    stored = Client.objects.select_related("organization").get(pk=world.client_a.pk)
    for field in Client._meta.concrete_fields:
        assert getattr(client, field.attname) == getattr(stored, field.attname)
    for field in type(stored.organization)._meta.concrete_fields:
        assert getattr(client.organization, field.attname) == getattr(stored.organization, field.attname)
    assert not client._state.adding and client._state.db == stored._state.db


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


def test_a_revoked_clients_name_is_refused_saying_it_is_revoked(world):
    """A revoked client keeps its name; an admin who sees no such client among the active ones
    is told why the name is taken."""
    admin = world.actor(world.admin_a)
    with pytest.raises(Conflict) as active:
        services.enroll_client(admin, world.org_a, "a1")
    assert "revoked" not in str(active.value)
    services.revoke_client(admin, world.client_a)
    with pytest.raises(Conflict) as revoked:
        services.enroll_client(admin, world.org_a, world.client_a.name)
    assert "(revoked: a revoked client keeps its name" in str(revoked.value)


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


def test_a_refused_enrollment_uses_up_none_of_the_hourly_enrollments(world):
    """A name the organization already has is refused before the rate limit counts it: an admin
    who mistypes twice can still enroll the client the hour allows."""
    services.update_settings(world.actor(world.operator), enrollments_per_hour=1)
    admin = world.actor(world.admin_a)
    for _ in range(2):
        with pytest.raises(Conflict):
            services.enroll_client(admin, world.org_a, "a1")
    services.enroll_client(admin, world.org_a, "r1")
    with pytest.raises(RateLimited):
        services.enroll_client(admin, world.org_a, "r2")


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
    _submit(rnd, world.client_b)  # a round without a submission to merge is not retried
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
    # The row was created with the deployment's default cap (settings.SYNAPSE_EPSILON_BUDGET).
    assert entry.details == {
        "epsilon_budget": {"from": django_settings.SYNAPSE_EPSILON_BUDGET, "to": 20.0}
    }
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


@pytest.mark.usefixtures("every_field_released")
def test_privacy_budget_caps_rounds(world):
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=1.5)
    rnd = services.open_round(operator, RoundConfig(epsilon=1.0))
    services.close_round(operator, rnd)  # closing, not merged: still reserved
    with pytest.raises(BudgetExceeded, match="privacy budget"):
        services.open_round(operator, RoundConfig(epsilon=1.0))
    services.open_round(operator, RoundConfig(epsilon=0.5))
    with pytest.raises(BudgetExceeded):
        services.update_settings(operator, epsilon_budget=1.0)
    assert Round.objects.count() == 2


# --- one privacy accountant: the ledger plus reservations of rounds not released yet -------------


def _ledger_rows(rnd, org, per_field_eps, cap=None, release=0):
    fields = ["calls", "success_rate", "latency_ms", "error_rate", "frequency"]
    for name, eps in zip(fields, per_field_eps, strict=False):
        PrivacyLedgerEntry.objects.create(
            round=rnd, organization=org, release=release, tool_id="weather", field=name,
            sensitivity=1.0, contributors=3, epsilon=eps, noise_scale=1.0 / (3 * eps),
            field_cap=cap,
        )


def test_projected_round_spend_is_the_ledger_formula(world):
    f = NumericField.objects.count()  # the declared fields of the schema in force
    assert f >= 3
    capped = RoundConfig(epsilon=1.2, field_cap=2)
    # the cap is on tools, each moving all F fields, and a replaced user's tools and the
    # replacement's can differ: ε_j = ε/(2·F*·F) over T·F statistics, and a round costs the
    # 2·F* largest per-tool sums (the projection: one tool's F fields at ε/F)
    assert capped.per_field_epsilon(10 * f, fields_per_tool=f) == pytest.approx(1.2 / (4 * f))
    assert accounting.projected_round_spend(capped) == pytest.approx(1.2)
    assert accounting.projected_round_spend(capped) == pytest.approx(
        round_spend([capped.per_field_epsilon(f, fields_per_tool=f)] * f, 2, ["t"] * f)
    )
    # no cap: ε_j = ε/F, the round costs Σ_j ε_j
    plain = RoundConfig(epsilon=1.2)
    assert accounting.projected_round_spend(plain) == pytest.approx(f * (1.2 / f))
    assert accounting.projected_round_spend(RoundConfig(epsilon=1.2, field_cap=9)) == pytest.approx(1.2)
    # nothing declared: nothing is noised, nothing is reserved
    assert accounting.projected_round_spend(capped, fields=0) == 0.0


@pytest.mark.usefixtures("every_field_released")
def test_open_round_reserves_its_projected_spend(world):
    operator = world.actor(world.operator)
    assert accounting.committed_composition().epsilon == 0.0
    rnd = services.open_round(operator, RoundConfig(epsilon=0.8, field_cap=2))
    committed = accounting.commitments()
    assert committed.recorded == {}
    assert committed.reserved == {rnd.pk: pytest.approx(2 * 0.4)}  # F*·ε_j with ε_j = ε/F*
    assert accounting.committed_composition().basic_epsilon == pytest.approx(0.8)
    services.close_round(operator, rnd)  # closing and merging rounds keep their reservation
    assert accounting.commitments().reserved == {rnd.pk: pytest.approx(0.8)}
    services.mark_merging(rnd)
    assert accounting.commitments().reserved == {rnd.pk: pytest.approx(0.8)}
    services.mark_failed(rnd, "worker lost")  # a failed round without ledger rows holds nothing
    assert accounting.commitments().reserved == {}
    # without declared numeric fields a round reserves nothing
    NumericField.objects.all().delete()
    _submit(rnd, world.client_a)
    services.retry_round(operator, rnd)
    assert accounting.commitments().reserved == {}



def test_a_round_reserves_nothing_for_the_fields_it_will_not_release(world):
    """A round fixes when it opens the numeric fields its merges will never release
    (`fields_not_released`: with so few clients no release of them could be useful). It
    reserved ε for them all the same: in the demo a round at ε = 1 releasing 1 of its 4 fields
    reserved 1.0 until it released 0.25, and the committed ε′ shown (and the budget check of
    the next round) counted 0.75 that no merge could spend. It now reserves the released
    fields' share, and the budget check of opening a round counts what that round would. With one
    client per organization at ε = 0.8 the noise is as wide as every field's clipping window (it
    is calibrated to the window, so all fields drown together): the round releases nothing and
    reserves nothing."""
    operator = world.actor(world.operator)
    f = NumericField.objects.count()
    config = RoundConfig(epsilon=0.8)
    not_released = accounting.fields_not_released(config)
    assert len(not_released) == f, not_released  # one client per organization
    assert accounting.check_budget(config).extra == [0.0]
    rnd = services.open_round(operator, config)
    assert sorted(rnd.fields_not_released) == sorted(not_released)
    assert accounting.commitments().reserved == {}
    services.close_round(operator, rnd)
    services.mark_merging(rnd)
    assert accounting.commitments().reserved == {}
    services.mark_failed(rnd, "worker lost")
    assert accounting.round_reservation(rnd) == 0.0  # what a retry takes again
    # a budget below ε: the round opens (it would have been refused for what it cannot spend)
    services.update_settings(operator, epsilon_budget=0.5)
    services.open_round(operator, RoundConfig(epsilon=0.8))


def test_a_round_reserves_the_fields_it_releases_after_one_it_named_was_removed(world):
    """A round's reservation counts the declared fields it releases: those of the schema in
    force that it did not name when it opened. It counted the declared fields less the number
    of names, so a named field removed from the schema while the round was open (the merge reads
    the schema in force) was subtracted though no longer declared: with 4 fields and 3 named,
    removing one of the 3 reserved nothing, while its edges release the fourth at ε/3."""
    from compendium.schema import Compendium
    from compendium.services import current_schema
    from federation.merge.operator import _release_metadata

    names = sorted(NumericField.objects.values_list("name", flat=True))
    assert len(names) >= 3
    kept, *named = names
    config = RoundConfig(epsilon=1.0)
    rnd = Round.objects.create(number=1, state=Round.State.OPEN,
                               config=config.model_dump(mode="json"), fields_not_released=named)
    assert accounting.commitments().reserved == {rnd.pk: pytest.approx(1.0 / len(names))}
    NumericField.objects.filter(name=named[0]).delete()
    # what its edges release now: the schema in force, less the fields the round named
    _, ledger = _release_metadata([("c", Compendium())], current_schema(), config, 1, None, True,
                                  drowned=frozenset(named))
    spent = round_spend([e.epsilon for e in ledger], None)
    assert {e.field for e in ledger} == {kept} and spent == pytest.approx(1.0 / (len(names) - 1))
    assert accounting.commitments().reserved == {rnd.pk: pytest.approx(spent)}
    assert accounting.round_reservation(rnd) == pytest.approx(spent)


def test_a_field_of_kind_other_takes_no_share_of_a_rounds_reservation(world):
    """A declared field of kind `other` is never released, so it is outside F: a round that named
    one of the four released fields reserves 3 · ε/4, what its edges then charge, where it
    reserved (and they charged) 4 · ε/5, its share split over a field no edge can release."""
    from compendium.schema import Compendium
    from compendium.services import current_schema
    from federation.merge.operator import _release_metadata

    NumericField.objects.create(name="error_budget", kind="other", min_value=0, max_value=1,
                                sensitivity=1)
    released = accounting.releasable_numeric_fields()
    assert "error_budget" not in released and len(released) == 4
    config = RoundConfig(epsilon=1.0)
    rnd = Round.objects.create(number=1, state=Round.State.OPEN,
                               config=config.model_dump(mode="json"), fields_not_released=["calls"])
    assert accounting.commitments().reserved == {rnd.pk: pytest.approx(0.75)}
    _, ledger = _release_metadata([("c", Compendium())], current_schema(), config, 1, None, True,
                                  drowned=frozenset({"calls"}))
    assert {e.field for e in ledger} == released - {"calls"}
    assert round_spend([e.epsilon for e in ledger], None) == pytest.approx(0.75)


@pytest.mark.usefixtures("every_field_released")
def test_a_round_with_ledger_rows_is_counted_once(world):
    operator = world.actor(world.operator)
    r1 = services.open_round(operator, RoundConfig(epsilon=1.0, field_cap=2))
    services.close_round(operator, r1)
    services.mark_merging(r1)
    assert accounting.committed_composition().basic_epsilon == pytest.approx(1.0)
    # org A's edge released two fields at ε_j = 0.5: the round now counts its ledger spend only
    _ledger_rows(r1, world.org_a, [0.5, 0.5], cap=2)
    committed = accounting.commitments()
    assert committed.recorded == {r1.pk: pytest.approx(1.0)} and committed.reserved == {}
    assert accounting.committed_composition().basic_epsilon == pytest.approx(1.0)
    _ledger_rows(r1, world.org_b, [0.25, 0.25, 0.25], cap=2)  # parallel: still max over orgs
    services.mark_published(r1)
    r2 = services.open_round(operator, RoundConfig(epsilon=0.5))
    committed = accounting.commitments()
    assert committed.recorded == {r1.pk: pytest.approx(1.0)}
    assert committed.reserved == {r2.pk: pytest.approx(0.5)}
    report = accounting.privacy_report()
    assert report.federation.basic_epsilon == pytest.approx(1.0)  # recorded in the ledger
    assert report.committed.basic_epsilon == pytest.approx(1.5)  # plus the reservation
    assert report.as_dict()["reserved_by_round"] == {"2": pytest.approx(0.5)}
    # organizations by their slug, as the operator knows them (their database ids before)
    by_org = report.as_dict()["organizations"]
    assert set(by_org) == {world.org_a.slug, world.org_b.slug}
    assert by_org[world.org_a.slug]["basic_epsilon"] == pytest.approx(1.0)
    assert by_org[world.org_b.slug]["basic_epsilon"] == pytest.approx(0.75)
    assert accounting.would_exceed()[1].basic_epsilon == pytest.approx(1.5)
    assert accounting.would_exceed(RoundConfig(epsilon=0.25))[1].basic_epsilon == pytest.approx(1.75)


@pytest.mark.usefixtures("every_field_released")
def test_open_round_refuses_exactly_above_the_cap(world):
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=0.3)
    r1 = services.open_round(operator, RoundConfig(epsilon=0.1))
    services.close_round(operator, r1)
    # 0.1 + 0.2 is 0.30000000000000004 in floats: at the cap, accepted
    r2 = services.open_round(operator, RoundConfig(epsilon=0.2, field_cap=3))
    services.close_round(operator, r2)
    assert accounting.committed_composition().epsilon == pytest.approx(0.3)
    assert not accounting.would_exceed()[0]
    with pytest.raises(BudgetExceeded) as refused:
        services.open_round(operator, RoundConfig(epsilon=0.001))
    message = str(refused.value)
    assert "from 0.3 to 0.301" in message and "privacy budget of 0.3" in message
    assert "2 reserved by rounds not released yet" in message
    assert accounting.would_exceed(RoundConfig(epsilon=0.001))[0]
    assert Round.objects.count() == 2


@pytest.mark.usefixtures("every_field_released")
def test_update_settings_refuses_a_budget_below_the_committed_figure(world):
    operator = world.actor(world.operator)
    r1 = services.open_round(operator, RoundConfig(epsilon=1.0))
    services.close_round(operator, r1)
    services.mark_merging(r1)
    _ledger_rows(r1, world.org_a, [0.25] * 4)
    services.mark_published(r1)
    r2 = services.open_round(operator, RoundConfig(epsilon=0.5))  # reserved, not in the ledger
    with pytest.raises(BudgetExceeded, match=r"committed \(1.5 at δ′ = 1e-05: recorded in the ledger plus reserved"):
        services.update_settings(operator, epsilon_budget=1.4)
    assert services.get_settings().epsilon_budget == django_settings.SYNAPSE_EPSILON_BUDGET
    services.update_settings(operator, epsilon_budget=1.5)  # exactly the committed figure
    assert accounting.epsilon_budget() == 1.5
    services.close_round(operator, r2)
    with pytest.raises(BudgetExceeded, match="privacy budget of 1.5"):
        services.open_round(operator, RoundConfig(epsilon=0.1))
    services.update_settings(operator, allow_admin_approval=True)  # other settings: no check


def test_a_settings_form_that_sends_the_budget_unchanged_is_no_budget_change(world):
    """Once the committed ε′ is past the cap (a round opened before any numeric field was
    declared reserves nothing; one declared after, its ε), the dashboard's settings form, which
    sends the budget and δ′ as they are with every save, still changes a rate limit."""
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=1.0)
    Round.objects.create(number=1, state=Round.State.OPEN, config=RoundConfig(epsilon=2.0).model_dump(mode="json"))
    assert accounting.committed_composition().epsilon > 1.0
    row = services.get_settings()
    services.update_settings(operator, epsilon_budget=row.epsilon_budget, delta_prime=row.delta_prime,
                             submissions_per_minute=30)
    assert services.get_settings().submissions_per_minute == 30
    with pytest.raises(BudgetExceeded):
        services.update_settings(operator, epsilon_budget=1.5)  # a change is still checked


def test_a_round_that_fills_the_budget_exactly_is_released(world):
    """ε = 99.3 over 199 tools x 4 fields sums, share by share, to 99.30000000000115: the release
    that open_round accepted (the reservation is ε itself) is not refused at the merge for its
    last bits (the accountant's relative tolerance)."""
    from compendium.schema import DEFAULT_NUMERIC_FIELDS, Compendium, Schema, ToolSpec
    from federation.merge.operator import _release_metadata

    schema = Schema(
        tools=[ToolSpec(tool_id=f"t{i}", name=f"T{i}", description="d", category="c") for i in range(199)],
        numeric_fields=list(DEFAULT_NUMERIC_FIELDS),
    )
    _, ledger = _release_metadata([("c", Compendium())], schema, RoundConfig(epsilon=99.3), 1, 99.3, True)
    assert len(ledger) == 796
    assert not accounting.over_cap(0.7 + 99.30000000000115, 100.0)
    assert accounting.over_cap(100.001, 100.0)
    from federation.merge.privacy import BudgetExceeded as ReleaseOverBudget

    with pytest.raises(ReleaseOverBudget):
        _release_metadata([("c", Compendium())], schema, RoundConfig(epsilon=99.3), 1, 99.29, True)


def test_update_settings_refuses_a_delta_prime_that_takes_the_committed_figure_past_the_cap(world):
    """Many small rounds compose tighter under advanced composition; a smaller δ′ loosens it, so
    changing δ′ alone can take the committed ε′ past an unchanged cap."""
    operator = world.actor(world.operator)
    for number in range(1, 51):
        rnd = Round.objects.create(number=number, state=Round.State.PUBLISHED)
        _ledger_rows(rnd, world.org_a, [0.01])
    services.update_settings(operator, epsilon_budget=0.45, delta_prime=1e-5)
    assert accounting.committed_composition().epsilon < 0.45  # advanced: about 0.34
    with pytest.raises(BudgetExceeded, match=r"committed \(0.5 at δ′ = 1e-12"):
        services.update_settings(operator, delta_prime=1e-12)
    assert services.get_settings().delta_prime == 1e-5
    with pytest.raises(BudgetExceeded, match=r"committed \(0.5 at δ′ = 1e-12"):
        services.update_settings(operator, epsilon_budget=0.46, delta_prime=1e-12)
    services.update_settings(operator, epsilon_budget=0.5, delta_prime=1e-12)
    assert accounting.committed_composition().epsilon == pytest.approx(0.5)


@pytest.mark.usefixtures("every_field_released")
def test_retry_takes_the_reservation_again(world):
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=1.0)
    r1 = services.open_round(operator, RoundConfig(epsilon=1.0))
    services.close_round(operator, r1)
    services.mark_failed(r1, "worker lost")
    _submit(r1, world.client_a)
    r2 = services.open_round(operator, RoundConfig(epsilon=1.0))  # r1 freed its reservation
    with pytest.raises(BudgetExceeded, match="retrying round 1"):
        services.retry_round(operator, r1)
    r1.refresh_from_db()
    assert r1.state == Round.State.FAILED
    services.close_round(operator, r2)
    services.mark_failed(r2, "worker lost")
    services.retry_round(operator, r1)
    assert accounting.commitments().reserved == {r1.pk: pytest.approx(1.0)}


def test_a_round_is_not_published_or_retried_after_a_later_one_was_published(world):
    """Each global carries the one before it forward and the latest is served: round 1, merging
    slowly or failed while round 2 was opened and published, would be in no served global."""
    operator = world.actor(world.operator)
    r1 = services.open_round(operator, RoundConfig(epsilon=0.1))
    services.close_round(operator, r1)
    services.mark_merging(r1)
    r2 = services.open_round(operator, RoundConfig(epsilon=0.1))
    services.close_round(operator, r2)
    services.mark_merging(r2)
    services.mark_published(r2)
    with pytest.raises(services.InvalidTransition,
                       match="round 1 cannot be published: round 2 is published already"):
        services.mark_published(r1)
    r1.refresh_from_db()
    assert r1.state == Round.State.MERGING
    services.mark_failed(r1, "worker lost")
    with pytest.raises(services.InvalidTransition,
                       match="round 1 cannot be retried: round 2 is published already.*submit again"):
        services.retry_round(operator, r1)
    r1.refresh_from_db()
    assert r1.state == Round.State.FAILED and r1.failure_reason == "worker lost"
    # A later round that is not published yet does not stand in the way.
    r3 = services.open_round(operator, RoundConfig(epsilon=0.1))
    services.close_round(operator, r3)
    services.mark_failed(r3, "worker lost")
    _submit(r3, world.client_a)
    r4 = services.open_round(operator, RoundConfig(epsilon=0.1))
    services.close_round(operator, r4)
    services.retry_round(operator, r3)
    assert Round.objects.get(pk=r3.pk).state == Round.State.CLOSING


@pytest.mark.usefixtures("every_field_released")
def test_an_erasure_rerelease_cannot_take_an_open_rounds_reservation(world):
    operator = world.actor(world.operator)
    services.update_settings(operator, epsilon_budget=2.5)
    r1 = services.open_round(operator, RoundConfig(epsilon=1.0))
    services.close_round(operator, r1)
    services.mark_merging(r1)
    _ledger_rows(r1, world.org_a, [0.5, 0.5])
    services.mark_published(r1)
    services.open_round(operator, RoundConfig(epsilon=1.0))
    # org A's re-release 1 of round 1: cap − (its release 0 in round 1 + round 2's reservation)
    assert accounting.remaining_for_release(r1.pk, world.org_a.pk, 1) == pytest.approx(0.5)
    # a retry of release 0 itself is not counted twice
    assert accounting.remaining_for_release(r1.pk, world.org_a.pk, 0) == pytest.approx(1.5)


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
        rnd.refresh_from_db()
        closed = rnd.closed_at
        assert rnd.attempt_started_at == closed
        services.mark_failed(rnd, "edge 2 timed out")
        _submit(rnd, world.client_a)
        with django_capture_on_commit_callbacks(execute=True):
            services.retry_round(operator, rnd)
    finally:
        round_closed.disconnect(receiver)
    assert received == [(Round, 1, "closing"), (Round, 1, "closing")]
    rnd.refresh_from_db()
    assert rnd.failure_reason == ""
    # The retry starts a new run of the pipeline; the round was still closed at its close.
    assert rnd.closed_at == closed and rnd.attempt_started_at > closed


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


def test_a_failed_round_without_a_submission_to_merge_is_not_retried(world):
    """Its merge fails again at once ("has no submissions to merge", pipeline.start_round): the
    retry was accepted all the same (the dashboard no longer offered it, the API and the service
    did). It is refused, saying why and what to do instead, and changes nothing. A submission
    of a client revoked since counts as none: no merge reads it."""
    operator = world.actor(world.operator)
    rnd = services.open_round(operator)
    services.close_round(operator, rnd)
    services.mark_failed(rnd, "round 1 has no submissions to merge")
    before = Round.objects.values("state", "attempt", "failure_reason", "attempt_started_at").get(
        pk=rnd.pk)
    entries = AuditLog.objects.count()

    def refused():
        with pytest.raises(InvalidTransition,
                           match="round 1 cannot be retried: it has no submission to merge.*"
                                 "open the next round") as exc:
            services.retry_round(operator, rnd)
        assert exc.value.status_code == 409
        assert Round.objects.values(*before).get(pk=rnd.pk) == before
        assert AuditLog.objects.count() == entries

    refused()
    _submit(rnd, world.client_a)
    services.revoke_client(operator, world.client_a)
    entries = AuditLog.objects.count()
    refused()
    _submit(rnd, world.client_b)
    retried = services.retry_round(operator, rnd)
    assert (retried.state, retried.attempt) == (Round.State.CLOSING, before["attempt"] + 1)


def test_privacy_defaults_come_from_the_deployment_and_the_row_drives_the_accountant(
    world, settings
):
    settings.SYNAPSE_EPSILON_BUDGET = 7.0
    settings.SYNAPSE_DELTA_PRIME = 1e-4
    assert accounting.epsilon_budget() == 7.0 and accounting.delta_prime() == 1e-4
    row = services.get_settings()  # created now: the cap and δ′ do not jump
    assert (row.epsilon_budget, row.delta_prime) == (7.0, 1e-4)
    assert accounting.epsilon_budget() == 7.0 and accounting.delta_prime() == 1e-4
    services.update_settings(world.actor(world.operator), delta_prime=1e-7)
    assert accounting.delta_prime() == 1e-7


def test_settings_are_written_only_with_an_audit_entry(world):
    """A change writes the row and one settings.change entry; an update that changes nothing (the
    same values again, or none) writes neither, so updated_at never moves unaudited."""
    operator = world.actor(world.operator)
    created = services.get_settings().updated_at  # creating the default row is not a change
    assert not AuditLog.objects.filter(action="settings.change").exists()
    for same in ({"allow_admin_approval": False}, {}):
        row = services.update_settings(operator, **same)
        row.refresh_from_db()
        assert row.updated_at == created
    assert not AuditLog.objects.filter(action="settings.change").exists()
    row = services.update_settings(operator, allow_admin_approval=True, enrollments_per_hour=20)
    row.refresh_from_db()
    assert row.allow_admin_approval and row.updated_at > created
    entry = AuditLog.objects.get(action="settings.change")
    assert entry.details == {"allow_admin_approval": {"from": False, "to": True}}


@pytest.mark.parametrize("field", ["epsilon_budget", "delta_prime"])
@pytest.mark.parametrize("value", [True, "0.5", None, [0.5]])
def test_update_settings_refuses_a_privacy_setting_that_is_no_number(world, field, value):
    """The API and the settings form hand the service numbers, but the service is what holds the
    rule (the whole-number settings already refused true and false): true was stored as a budget
    of 1.0 (Python's bool is an int), and a string or None ended in a TypeError, a 500."""
    from federation.errors import InvalidRequest

    before = services.get_settings()
    with pytest.raises(InvalidRequest, match=f"{field} must be a"):
        services.update_settings(world.actor(world.operator), **{field: value})
    row = services.get_settings()
    assert (row.epsilon_budget, row.delta_prime) == (before.epsilon_budget, before.delta_prime)
    assert not AuditLog.objects.filter(action="settings.change").exists()


def _held_elsewhere(lock):
    """Run `lock()` (which takes row locks) in a transaction on another connection and hold them
    until the returned `release` is called."""
    import threading

    held, done = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                lock()
                held.set()
                done.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(30)

    def release():
        done.set()
        thread.join(30)

    return release


@pytest.mark.django_db(transaction=True)
def test_failing_a_stuck_round_answers_busy_instead_of_waiting_out_a_long_lock(world, settings):
    """Found by review: the operator's fail of a merging round (the API's, which the dashboard's
    Fail now shares) waited for the round's lock however long another transaction held it (an
    erasure re-merging that round holds it for minutes), past the web server's timeout. It now
    answers 409 busy after SYNAPSE_LOCK_WAIT_SECONDS, changes nothing, and works once free."""
    from federation.errors import Busy
    from tests.test_federation_api import person_api

    settings.SYNAPSE_LOCK_WAIT_SECONDS = 0.2
    operator = world.actor(world.operator)
    stuck = services.open_round(operator)
    Round.objects.filter(pk=stuck.pk).update(state=Round.State.MERGING)
    url = f"/api/v1/admin/rounds/{stuck.pk}/fail/"
    release = _held_elsewhere(lambda: Round.objects.select_for_update().get(pk=stuck.pk))
    try:
        with pytest.raises(Busy, match="cannot fail the round now"):
            services.fail_round_by_hand(operator, stuck, "its worker was killed")
        busy = person_api(world.operator).post(url, {"reason": "its worker was killed"},
                                               format="json")
        assert busy.status_code == 409 and busy.json()["code"] == "busy", busy.content
    finally:
        release()
    assert Round.objects.get(pk=stuck.pk).state == Round.State.MERGING
    done = person_api(world.operator).post(url, {"reason": "its worker was killed"}, format="json")
    assert done.status_code == 200 and done.json()["failure_reason"] == "its worker was killed"
    # a reason the audit log would show otherwise than stored is refused, naming it
    Round.objects.filter(pk=stuck.pk).update(state=Round.State.MERGING)
    bidi = person_api(world.operator).post(url, {"reason": "killed \u202e"}, format="json")
    assert bidi.status_code == 400 and "reason contains" in bidi.json()["detail"]


@pytest.mark.django_db(transaction=True)
def test_operator_requests_answer_busy_instead_of_waiting_out_a_long_lock(world, settings):
    """An erasure holds the settings' lock (and its rounds') until all its re-merges commit:
    opening a round, retrying one or changing the settings then answers 409 busy after
    SYNAPSE_LOCK_WAIT_SECONDS instead of waiting minutes, changes nothing, and works once the
    lock is free."""
    from federation.errors import Busy
    from federation.models import FederationSettings

    settings.SYNAPSE_LOCK_WAIT_SECONDS = 0.2
    operator = world.actor(world.operator)
    failed = services.open_round(operator)
    Round.objects.filter(pk=failed.pk).update(state=Round.State.FAILED, failure_reason="boom")
    _submit(failed, world.client_a)
    budget = services.get_settings().epsilon_budget
    release = _held_elsewhere(
        lambda: FederationSettings.objects.select_for_update().get(pk=services.get_settings().pk)
    )
    try:
        with pytest.raises(Busy, match="cannot open a round now") as busy:
            services.open_round(operator)
        assert busy.value.status_code == 409 and busy.value.code == "busy"
        with pytest.raises(Busy, match="cannot change the federation's settings now"):
            services.update_settings(operator, epsilon_budget=budget + 1)
        with pytest.raises(Busy, match="cannot retry the round now"):
            services.retry_round(operator, failed)
    finally:
        release()
    assert services.get_settings().epsilon_budget == budget
    assert Round.objects.get(pk=failed.pk).state == Round.State.FAILED
    assert Round.objects.count() == 1
    # the round's own lock (an erasure re-merging that round) is waited for the same way
    release = _held_elsewhere(lambda: Round.objects.select_for_update().get(pk=failed.pk))
    try:
        with pytest.raises(Busy, match="cannot retry the round now"):
            services.retry_round(operator, failed)
    finally:
        release()
    # free again: the same requests go through, and a later lock in the same transaction is
    # not limited (the wait applies to the request's own locks only)
    services.update_settings(operator, epsilon_budget=budget + 1)
    with transaction.atomic():
        with services.waiting_briefly("test"):
            pass
        with connection.cursor() as cur:
            cur.execute("SELECT current_setting('lock_timeout')")
            assert cur.fetchone()[0] == "0"
    assert services.retry_round(operator, failed).attempt == failed.attempt + 1
