"""A person's own API tokens from the dashboard (Account → API tokens): issued once, stored as a
hash, usable against the REST API with the person's rights, revoked at once; audited; nobody
revokes or sees another person's tokens."""

from __future__ import annotations

import re

import pytest
from django.test import Client as BrowserClient
from django.urls import reverse
from rest_framework.test import APIClient

from federation import services
from federation.errors import InvalidRequest, NotFound
from federation.models import AuditLog, UserToken
from tests.federation_fixtures import SYSTEM, record_outcome

pytestmark = pytest.mark.django_db
PAGE = reverse("dashboard:tokens")


def browser(user) -> BrowserClient:
    client = BrowserClient()
    client.force_login(user)
    return client


def calls_api(token: str) -> int:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return api.get("/api/v1/admin/clients/").status_code


def test_a_person_issues_a_token_shown_once_and_uses_it(world):
    page = browser(world.admin_a)
    response = page.post(PAGE, {"label": "  nightly   export "})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    token = re.search(r'id="token-value">(syn_u_[\w-]+)<', response.content.decode()).group(1)
    row = UserToken.objects.get(user=world.admin_a)
    assert row.label == "nightly export" and token.startswith(row.prefix)
    assert row.token_hash == services.hash_token(token) and token not in str(row.__dict__)
    assert calls_api(token) == 200  # the admin's rights: its organization's clients
    # listed afterwards by prefix, never the token again
    listed = page.get(PAGE).content.decode()
    assert f"{row.prefix}…" in listed and token not in listed and "nightly export" in listed
    entry = AuditLog.objects.get(action=AuditLog.Action.TOKEN_ISSUE)
    assert entry.actor == world.admin_a and entry.organization == world.org_a
    assert entry.details["token_prefix"] == row.prefix and token not in str(entry.details)


def test_revoking_stops_the_token_at_once_and_is_audited(world):
    token = services.issue_user_token(services.Actor.for_user(world.member_a), world.member_a)
    row = UserToken.objects.get(user=world.member_a)
    assert calls_api(token) == 200
    response = browser(world.member_a).post(PAGE, {"action": "revoke", "token": str(row.pk)})
    assert response.status_code == 302
    assert calls_api(token) == 401
    row.refresh_from_db()
    assert row.revoked_at is not None
    assert AuditLog.objects.filter(action=AuditLog.Action.TOKEN_REVOKE, actor=world.member_a).count() == 1
    # revoking again changes nothing and audits nothing more
    browser(world.member_a).post(PAGE, {"action": "revoke", "token": str(row.pk)})
    assert AuditLog.objects.filter(action=AuditLog.Action.TOKEN_REVOKE).count() == 1


def test_nobody_revokes_or_sees_another_persons_token(world):
    token = services.issue_user_token(SYSTEM, world.admin_b, "b's script")
    row = UserToken.objects.get(user=world.admin_b)
    operator = browser(world.operator)
    refused = operator.post(PAGE, {"action": "revoke", "token": str(row.pk)})
    assert refused.status_code == 404 and "no such token of yours" in refused.content.decode()
    assert "b&#x27;s script" not in operator.get(PAGE).content.decode()
    with pytest.raises(NotFound):
        services.revoke_user_token(services.Actor.for_user(world.admin_a), row.pk)
    assert calls_api(token) == 200
    for bad in ("x", "-1", "9" * 40, ""):
        assert browser(world.admin_b).post(PAGE, {"action": "revoke", "token": bad}).status_code == 400


def test_bad_label_and_anonymous_visitor(world):
    with pytest.raises(InvalidRequest, match="at most 100"):
        services.issue_user_token(services.Actor.for_user(world.admin_a), world.admin_a, "x" * 101)
    too_long = browser(world.admin_a).post(PAGE, {"label": "x" * 101})
    assert too_long.status_code == 400 and not UserToken.objects.exists()
    anonymous = BrowserClient().get(PAGE)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith(reverse("login"))
    assert BrowserClient().post(PAGE, {"label": "x"}).status_code == 302
    assert not UserToken.objects.exists()


@pytest.mark.parametrize("action", ["Revoke", "revoke ", "delete", "bogus"])
def test_an_unknown_action_is_refused_and_issues_nothing(world, action):
    """A mistyped revoke (a script's `Revoke`, a trailing blank) must not issue a fresh token
    while the one it meant to stop keeps working."""
    token = services.issue_user_token(services.Actor.for_user(world.member_a), world.member_a)
    row = UserToken.objects.get(user=world.member_a)
    response = browser(world.member_a).post(PAGE, {"action": action, "token": str(row.pk)})
    assert response.status_code == 400 and "action must be" in response.content.decode()
    assert UserToken.objects.filter(user=world.member_a).count() == 1
    assert AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).count() == 1
    assert calls_api(token) == 200  # nothing revoked either: the refusal says so


@pytest.mark.parametrize(
    ("label", "words"),
    [
        ("nightly\x00export", "control character U+0000 at position 7"),
        ("nightly \u202etropxe", "bidirectional override U+202E at position 8"),
        ("nightly\u200bexport", "invisible character U+200B"),
    ],
)
def test_a_label_with_a_nul_bidi_or_invisible_character_is_refused(world, label, words):
    """An override or an invisible character made the label read otherwise than it is stored
    (on the tokens page and in the audit log, which the organization's admins and the operator
    read); a NUL reached the database (DataError) from a caller other than the web's forms."""
    with pytest.raises(InvalidRequest, match=f"a token's label contains an? {re.escape(words)}"):
        services.issue_user_token(world.actor(world.admin_a), world.admin_a, label)
    if "\x00" not in label:  # (the web's middleware refuses a NUL in any field)
        page = browser(world.admin_a).post(PAGE, {"label": label})
        assert page.status_code == 400, page.content[:300]
        assert "a token&#x27;s label contains" in page.content.decode()
    assert not UserToken.objects.exists()
    assert not AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).exists()


@pytest.mark.parametrize("name", ["app\u202e", "app\u200b", "app\x07"])
def test_a_routing_token_named_with_a_bidi_invisible_or_control_character_is_refused(world, name):
    with pytest.raises(InvalidRequest, match="a routing token's name contains"):
        services.issue_routing_token(world.actor(world.operator), name)
    assert not AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).exists()


@pytest.mark.django_db(transaction=True)
def test_two_commands_issuing_one_new_routing_token_name_at_once(monkeypatch):
    """No row to lock yet: both found the name free, both inserted, and the second command ended
    in an IntegrityError traceback. One is issued; the other is refused (409) naming the name."""
    import threading

    from routing.models import RoutingToken

    both_looked = threading.Barrier(2, timeout=30)
    real_issue = RoutingToken.issue.__func__

    def issue_once_both_looked(cls, name):
        both_looked.wait()
        return real_issue(cls, name)

    monkeypatch.setattr(RoutingToken, "issue", classmethod(issue_once_both_looked))
    outcomes = []

    def command():
        record_outcome(outcomes, lambda: services.issue_routing_token(SYSTEM, "nightly-app"))

    threads = [threading.Thread(target=command) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    issued = [o for o in outcomes if isinstance(o, str)]
    refused = [o for o in outcomes if not isinstance(o, str)]
    assert len(issued) == 1 and issued[0].startswith(RoutingToken.PREFIX)
    assert [type(e).__name__ for e in refused] == ["Conflict"], refused
    assert "was issued meanwhile" in str(refused[0])
    assert RoutingToken.objects.filter(name="nightly-app").count() == 1
    assert AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).count() == 1
