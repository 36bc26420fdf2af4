"""People of an organization: adding logins, roles, password resets, deactivation and a person's
own password change, through the services, the API and the dashboard, for every role."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client as BrowserClient
from django.urls import reverse
from rest_framework.test import APIClient

from federation import people, services
from federation.errors import Conflict, InvalidRequest, NotAllowed
from federation.models import AuditLog, Membership, Organization, UserToken
from tests.federation_fixtures import SYSTEM, another_waits_on_a_lock

pytestmark = pytest.mark.django_db

PEOPLE = "/api/v1/admin/people/"


def person_api(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {services.issue_user_token(SYSTEM, user)}")
    return api


def signs_in(username: str, password: str) -> bool:
    browser = BrowserClient()
    response = browser.post(reverse("login"), {"username": username, "password": password})
    return response.status_code == 302 and "_auth_user_id" in browser.session


def membership(user) -> Membership:
    return Membership.objects.select_related("user", "organization").get(user=user)


# --- services ----------------------------------------------------------------------------------


def test_an_admin_adds_a_person_whose_password_works_once_issued(world):
    issued = people.add_person(
        world.actor(world.admin_a), world.org_a, "carol", "member", "carol@a.example"
    )
    user = issued.membership.user
    assert issued.membership.organization == world.org_a and issued.membership.role == "member"
    assert user.email == "carol@a.example" and issued.password not in user.password
    assert signs_in("carol", issued.password)
    entry = AuditLog.objects.get(action="person.add")
    assert entry.actor == world.admin_a and entry.organization == world.org_a
    assert entry.details == {"user": "carol", "role": "member", "email": "carol@a.example"}
    assert issued.password not in json.dumps(entry.details)


@pytest.mark.parametrize(
    ("username", "email", "role", "error", "words"),
    [
        ("", "", "member", InvalidRequest, "needs a username"),
        ("has space", "", "member", InvalidRequest, "username 'has space'"),
        ("x" * 151, "", "member", InvalidRequest, "at most 150"),
        ("dora", "not-an-address", "member", InvalidRequest, "not an e-mail"),
        ("dora", "", "owner", InvalidRequest, "role must be one of admin, member"),
        ("ADMIN_A", "", "member", Conflict, "exists"),  # usernames differ by more than case
        ("ａｄｍｉｎ_Ａ", "", "member", Conflict, "exists"),  # or by full-width letters (NFKC)
    ],
)
def test_adding_a_person_refuses_bad_input_and_stores_nothing(world, username, email, role, error, words):
    before = get_user_model().objects.count()
    with pytest.raises(error, match=words):
        people.add_person(world.actor(world.operator), world.org_a, username, role, email)
    assert get_user_model().objects.count() == before
    assert not AuditLog.objects.filter(action="person.add").exists()


@pytest.mark.parametrize("role", ["member_a", "admin_b"])
def test_only_the_organizations_admins_and_the_operator_manage_its_people(world, role):
    actor = world.actor(getattr(world, role))
    target = membership(world.member_a) if role == "admin_b" else membership(world.admin_a)
    with pytest.raises(NotAllowed):
        people.add_person(actor, world.org_a, "eve", "admin")
    with pytest.raises(NotAllowed):
        people.set_role(actor, target, "member")
    with pytest.raises(NotAllowed):
        people.reset_password(actor, target)
    with pytest.raises(NotAllowed):
        people.set_active(actor, target, False)
    assert not get_user_model().objects.filter(username="eve").exists()
    target.refresh_from_db()
    target.user.refresh_from_db()
    assert target.user.is_active and not AuditLog.objects.filter(action__startswith="person.").exists()


def test_nobody_changes_their_own_role_activity_or_password_here(world):
    actor = world.actor(world.admin_a)
    own = membership(world.admin_a)
    for act in (
        lambda: people.set_role(actor, own, "member"),
        lambda: people.reset_password(actor, own),
        lambda: people.set_active(actor, own, False),
    ):
        with pytest.raises(NotAllowed, match="yourself"):
            act()
    own.refresh_from_db()
    assert own.role == "admin" and get_user_model().objects.get(pk=world.admin_a.pk).is_active


@pytest.mark.parametrize("kind", ["superuser", "staff"])
def test_an_admin_cannot_take_over_an_operator_or_staff_login_that_belongs_to_the_organization(
    world, kind
):
    # A superuser or staff user may also have a membership (the Django admin creates any); an
    # organization admin who reset its password would sign in as the operator.
    if kind == "superuser":
        target = Membership.objects.create(user=world.operator, organization=world.org_a, role="member")
    else:
        staff = get_user_model().objects.create_user("staffer", is_staff=True)
        target = Membership.objects.create(user=staff, organization=world.org_a, role="member")
    password = target.user.password
    api = person_api(world.admin_a)
    url = f"{PEOPLE}{target.user_id}/"
    for response in (
        api.post(url + "reset-password/"),
        api.patch(url, {"is_active": False}, format="json"),
        api.patch(url, {"role": "admin"}, format="json"),
    ):
        assert response.status_code == 403 and "only the operator" in response.json()["detail"]
        assert "password" not in response.json()
    user = get_user_model().objects.get(pk=target.user_id)
    assert user.password == password and user.is_active and membership(user).role == "member"
    assert not AuditLog.objects.filter(action__startswith="person.").exists()
    # the operator (here: the system, as a management command) still manages it
    assert signs_in(user.username, people.reset_password(SYSTEM, target).password)


def test_role_changes_take_effect_and_are_audited_once(world):
    target = membership(world.member_a)
    people.set_role(world.actor(world.admin_a), target, "admin")
    fresh = get_user_model().objects.get(pk=world.member_a.pk)
    assert services.can_admin(world.actor(fresh), world.org_a.pk)
    people.set_role(world.actor(world.admin_a), target, "admin")  # no change: no entry
    entries = AuditLog.objects.filter(action="person.role")
    assert entries.count() == 1
    assert entries.get().details == {"user": "member_a", "role": "admin", "previous_role": "member"}


def test_a_reset_password_replaces_the_old_one_and_ends_sessions(world):
    first = people.add_person(world.actor(world.admin_a), world.org_a, "frank", "member")
    browser = BrowserClient()
    browser.post(reverse("login"), {"username": "frank", "password": first.password})
    assert browser.get(reverse("dashboard:overview")).status_code == 200
    second = people.reset_password(world.actor(world.operator), first.membership)
    assert second.password != first.password
    assert not signs_in("frank", first.password) and signs_in("frank", second.password)
    # the session opened with the old password is over
    assert browser.get(reverse("dashboard:overview")).status_code == 302
    assert AuditLog.objects.filter(action="person.password_reset", actor=world.operator).exists()


def test_a_reset_password_stops_the_persons_api_tokens(world, client):
    issued = people.add_person(world.actor(world.admin_a), world.org_a, "hugo", "member")
    user = issued.membership.user
    api = person_api(user)  # a token issued while the old password held
    services.issue_user_token(world.actor(user), user, "second script")
    assert api.get(PEOPLE).status_code == 200
    reset = people.reset_password(world.actor(world.admin_a), issued.membership)
    assert reset.tokens_revoked == 2
    assert api.get(PEOPLE).status_code == 401
    assert not UserToken.objects.filter(user=user, revoked_at__isnull=True).exists()
    entry = AuditLog.objects.filter(action="person.password_reset").latest("id")
    assert entry.details["tokens_revoked"] == 2
    # a token issued after the reset works; a second reset says it stopped it, in the browser too
    fresh = person_api(user)
    assert fresh.get(PEOPLE).status_code == 200
    client.force_login(world.admin_a)
    page = client.post(reverse("dashboard:person-action", args=["org-a", user.pk, "reset-password"]))
    body = page.content.decode()
    assert "personal API tokens have stopped working (1 token revoked" in body
    assert fresh.get(PEOPLE).status_code == 401
    over_api = person_api(world.admin_a).post(f"{PEOPLE}{user.pk}/reset-password/")
    assert over_api.status_code == 200 and over_api.json()["tokens_revoked"] == 0


def test_deactivation_stops_sign_in_sessions_and_tokens_and_reactivation_restores_sign_in(world):
    issued = people.add_person(world.actor(world.admin_a), world.org_a, "gina", "admin")
    api = person_api(issued.membership.user)
    assert api.get(PEOPLE).status_code == 200
    browser = BrowserClient()
    browser.post(reverse("login"), {"username": "gina", "password": issued.password})
    people.set_active(world.actor(world.admin_a), issued.membership, False)
    assert api.get(PEOPLE).status_code == 401
    assert browser.get(reverse("dashboard:overview")).status_code == 302
    assert not signs_in("gina", issued.password)
    assert not UserToken.objects.filter(user=issued.membership.user, revoked_at__isnull=True).exists()
    entry = AuditLog.objects.get(action="person.deactivate")
    assert entry.details["tokens_revoked"] == 1
    people.set_active(world.actor(world.admin_a), issued.membership, True)
    assert signs_in("gina", issued.password)
    assert api.get(PEOPLE).status_code == 401  # a revoked token stays revoked
    assert AuditLog.objects.filter(action="person.reactivate").count() == 1


def test_a_session_open_at_deactivation_stays_ended_after_reactivation(world):
    # A reactivation gives the person back their sign-in, not a session that was open when the
    # login was taken away (a borrowed or stolen browser's), as it gives back no revoked token.
    issued = people.add_person(world.actor(world.admin_a), world.org_a, "ines", "member")
    browser = BrowserClient()
    browser.post(reverse("login"), {"username": "ines", "password": issued.password})
    assert browser.get(reverse("dashboard:overview")).status_code == 200
    colleague = BrowserClient()  # another login's session is left alone
    colleague.force_login(world.member_a)
    people.set_active(world.actor(world.admin_a), issued.membership, False)
    people.set_active(world.actor(world.admin_a), issued.membership, True)
    assert browser.get(reverse("dashboard:overview")).status_code == 302
    assert colleague.get(reverse("dashboard:overview")).status_code == 200
    assert signs_in("ines", issued.password)
    entry = AuditLog.objects.get(action="person.deactivate")
    assert entry.details["sessions_ended"] == 1


# --- API ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "visible"),
    [
        ("operator", {"admin_a", "member_a", "admin_b"}),
        ("admin_a", {"admin_a", "member_a"}),
        ("member_a", {"admin_a", "member_a"}),
        ("admin_b", {"admin_b"}),
    ],
)
def test_people_list_scope(world, role, visible):
    api = person_api(getattr(world, role))
    rows = api.get(PEOPLE).json()["results"]
    assert {r["username"] for r in rows} == visible
    assert all("password" not in r for r in rows)
    assert bool(api.get(PEOPLE + "?organization=org-a").json()["results"]) == ("admin_a" in visible)
    detail = api.get(f"{PEOPLE}{world.member_a.pk}/")
    assert detail.status_code == (200 if "member_a" in visible else 404)
    assert api.get(PEOPLE + "?role=owner").status_code == 400
    # e-mail addresses and sign-in times are for the organization's admins and the operator
    if "admin_a" in visible:
        world.admin_a.email = "boss@a.example"
        world.admin_a.save(update_fields=["email"])
        fresh = {r["username"]: r for r in api.get(PEOPLE).json()["results"]}
        assert fresh["admin_a"]["email"] == (None if role == "member_a" else "boss@a.example")
        assert fresh["member_a"]["email"] == ""  # one's own is always shown
        shown = api.get(f"{PEOPLE}{world.admin_a.pk}/").json()
        assert (shown["email"], shown["last_login"] is None) == (
            (None, True) if role == "member_a" else ("boss@a.example", True)
        )


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 201), ("admin_a", 201), ("member_a", 403), ("admin_b", 400)],
)
def test_adding_through_the_api(world, role, expected):
    response = person_api(getattr(world, role)).post(
        PEOPLE, {"organization": "org-a", "username": "hal", "role": "admin"}, format="json"
    )
    assert response.status_code == expected, response.content
    assert "detail" in response.json() or expected == 201
    if expected == 201:
        body = response.json()
        assert response["Cache-Control"] == "no-store"
        assert body["person"]["organization"] == "org-a" and body["person"]["role"] == "admin"
        assert signs_in("hal", body["password"])
    else:
        assert not get_user_model().objects.filter(username="hal").exists()


def test_the_operator_names_the_organization_and_an_admin_need_not(world):
    missing = person_api(world.operator).post(PEOPLE, {"username": "ian"}, format="json")
    assert missing.status_code == 400 and "organization" in missing.json()["detail"]
    own = person_api(world.admin_b).post(PEOPLE, {"username": "ian"}, format="json")
    assert own.status_code == 201 and own.json()["person"]["organization"] == "org-b"
    assert own.json()["person"]["role"] == "member"
    again = person_api(world.admin_b).post(PEOPLE, {"username": "ian"}, format="json")
    assert again.status_code == 409 and "exists" in again.json()["detail"]


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 200), ("admin_a", 200), ("member_a", 403), ("admin_b", 404)],
)
def test_patch_and_reset_scope(world, role, expected):
    api = person_api(getattr(world, role))
    url = f"{PEOPLE}{world.member_a.pk}/"
    response = api.patch(url, {"role": "admin", "is_active": False}, format="json")
    assert response.status_code == expected, response.content
    target = membership(world.member_a)
    assert (target.role, target.user.is_active) == (
        ("admin", False) if expected == 200 else ("member", True)
    )
    reset = api.post(url + "reset-password/")
    assert reset.status_code == expected
    if expected == 200:
        assert reset["Cache-Control"] == "no-store" and len(reset.json()["password"]) >= 16


def test_refused_patches_say_why_and_change_nothing(world):
    api = person_api(world.admin_a)
    response = api.patch(f"{PEOPLE}{world.admin_a.pk}/", {"is_active": False}, format="json")
    assert response.status_code == 403 and "yourself" in response.json()["detail"]
    other = people.add_person(SYSTEM, world.org_a, "jo", "member").membership
    bad = api.patch(f"{PEOPLE}{other.user_id}/", {"role": "superuser"}, format="json")
    assert bad.status_code == 400 and "role" in bad.json()["errors"]
    assert bad.json()["detail"].startswith("role: ")  # every error has a detail naming the field
    empty = api.patch(f"{PEOPLE}{other.user_id}/", {}, format="json")
    assert empty.status_code == 400 and "nothing to change" in empty.json()["detail"]
    assert membership(other.user).role == "member" and get_user_model().objects.get(pk=world.admin_a.pk).is_active


@pytest.mark.parametrize("form", ["multipart", None])
def test_a_form_patch_changes_only_the_fields_it_sends(world, form):
    # A form (or multipart) body that names only the role leaves the login active: a field it
    # does not send is not an unchecked box.
    api = person_api(world.admin_a)
    url = f"{PEOPLE}{world.member_a.pk}/"
    response = (api.patch(url, {"role": "admin"}, format=form) if form else
                api.patch(url, "role=admin", content_type="application/x-www-form-urlencoded"))
    assert response.status_code == 200, response.content
    assert response.json()["is_active"] is True and response.json()["role"] == "admin"
    target = membership(world.member_a)
    assert (target.role, target.user.is_active) == ("admin", True)


@pytest.mark.parametrize(
    ("method", "path", "body", "named"),
    [
        ("patch", "person", {"role": "admin", "is_activ": False}, "is_activ"),
        ("post", "people", {"username": "kim", "rol": "admin"}, "rol"),
        ("post", "clients", {"name": "a9", "contacts": "ops@a.example"}, "contacts"),
        ("post", "revoke", {"reasons": "token leaked"}, "reasons"),
        ("post", "organizations", {"name": "Org C", "descripton": "x"}, "descripton"),
    ],
)
def test_a_field_an_admin_endpoint_does_not_have_is_refused_naming_it(world, method, path, body, named):
    # A misspelt field was dropped under a 2xx: the role changed but the login stayed active, a
    # person was added as a member, a client enrolled without its contact, revoked without the
    # reason in the audit log. Nothing is done.
    url = {
        "person": f"{PEOPLE}{world.member_a.pk}/",
        "people": PEOPLE,
        "clients": "/api/v1/admin/clients/",
        "revoke": f"/api/v1/admin/clients/{world.client_a.pk}/revoke/",
        "organizations": "/api/v1/admin/organizations/",
    }[path]
    api = person_api(world.operator if path == "organizations" else world.admin_a)
    before = AuditLog.objects.count()
    response = getattr(api, method)(url, body, format="json")
    assert response.status_code == 400, response.content
    assert named in response.json()["detail"]
    assert AuditLog.objects.count() == before
    target = membership(world.member_a)
    assert (target.role, target.user.is_active) == ("member", True)
    world.client_a.refresh_from_db()
    assert world.client_a.status == "approved" and not Organization.objects.filter(name="Org C")


def test_clients_cannot_reach_the_people_endpoints(world):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    assert api.get(PEOPLE).status_code == 403
    assert APIClient().get(PEOPLE).status_code in (401, 403)


# --- dashboard ---------------------------------------------------------------------------------


def page(client, slug="org-a"):
    return client.get(reverse("dashboard:organization", args=[slug]))


def test_an_admin_adds_a_person_in_the_browser_and_sees_the_password_once(client, world):
    client.force_login(world.admin_a)
    body = page(client).content.decode()
    assert 'id="add-person"' in body and "member_a" in body and "(you)" in body
    response = client.post(
        reverse("dashboard:person-add", args=["org-a"]),
        {"username": "kim", "email": "kim@a.example", "role": "admin"},
    )
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    password = response.context["issued_password"]
    assert password in response.content.decode() and signs_in("kim", password)
    assert password not in page(client).content.decode()
    assert membership(get_user_model().objects.get(username="kim")).role == "admin"


def test_an_admin_resets_changes_role_and_deactivates_in_the_browser(client, world):
    client.force_login(world.admin_a)
    def action(name, **data):
        return client.post(
            reverse("dashboard:person-action", args=["org-a", world.member_a.pk, name]), data
        )

    reset = action("reset-password")
    assert reset.status_code == 200 and signs_in("member_a", reset.context["issued_password"])
    assert "This login is deactivated" not in reset.content.decode()
    assert action("role", role="admin").status_code == 302
    assert membership(world.member_a).role == "admin"
    assert action("deactivate").status_code == 302
    assert not get_user_model().objects.get(pk=world.member_a.pk).is_active
    assert "deactivated" in page(client).content.decode()
    # A password reset while deactivated says the login must be reactivated first.
    reset = action("reset-password")
    assert "This login is deactivated" in reset.content.decode()
    assert not signs_in("member_a", reset.context["issued_password"])
    assert action("reactivate").status_code == 302
    assert signs_in("member_a", reset.context["issued_password"])
    assert get_user_model().objects.get(pk=world.member_a.pk).is_active
    bad = action("role", role="owner")
    assert bad.status_code == 400 and "role must be one of" in bad.content.decode()
    own = client.post(reverse("dashboard:person-action", args=["org-a", world.admin_a.pk, "deactivate"]))
    assert own.status_code == 403 and "yourself" in own.content.decode()


def test_the_role_message_names_the_new_role(client, world):
    client.force_login(world.admin_a)
    url = reverse("dashboard:person-action", args=["org-a", world.member_a.pk, "role"])
    done = client.post(url, {"role": "admin"}, follow=True)
    assert [str(m) for m in done.context["messages"]] == ["member_a is now organization admin."]
    done = client.post(url, {"role": "member"}, follow=True)
    assert [str(m) for m in done.context["messages"]] == ["member_a is now read-only member."]


def test_members_see_people_without_buttons_and_others_get_404(client, world):
    world.admin_a.email = "boss@a.example"
    world.admin_a.save(update_fields=["email"])
    client.force_login(world.member_a)
    body = page(client).content.decode()
    assert "admin_a" in body and 'id="add-person"' not in body and "Reset password" not in body
    assert "boss@a.example" not in body and "last sign-in" not in body
    denied = client.post(reverse("dashboard:person-add", args=["org-a"]), {"username": "lee"})
    assert denied.status_code == 403 and not get_user_model().objects.filter(username="lee").exists()
    client.force_login(world.admin_b)
    assert page(client).status_code == 404
    foreign = client.post(reverse("dashboard:person-action", args=["org-a", world.member_a.pk, "deactivate"]))
    assert foreign.status_code == 404
    # a person of another organization is not found through one's own organization either
    across = client.post(reverse("dashboard:person-action", args=["org-b", world.member_a.pk, "deactivate"]))
    assert across.status_code == 404
    assert get_user_model().objects.get(pk=world.member_a.pk).is_active


def test_the_operator_creates_an_organization_in_the_browser(client, world):
    client.force_login(world.operator)
    listing = client.get(reverse("dashboard:organizations"))
    assert 'id="create-organization"' in listing.content.decode()
    counts = {org.slug: org.n_people for org in listing.context["rows"]}
    assert counts == {"org-a": 2, "org-b": 1}
    response = client.post(reverse("dashboard:organizations"), {"name": "Initech", "description": "x"})
    assert response.status_code == 302 and response["Location"] == "/organizations/initech/"
    assert Organization.objects.filter(slug="initech").exists()
    bad = client.post(reverse("dashboard:organizations"), {"name": "Bad", "slug": "a b/c"})
    assert bad.status_code == 400 and "slug" in bad.content.decode()
    clash = client.post(reverse("dashboard:organizations"), {"name": "Initech"})
    assert clash.status_code == 409
    client.force_login(world.admin_a)
    assert 'id="create-organization"' not in client.get(reverse("dashboard:organizations")).content.decode()
    assert client.post(reverse("dashboard:organizations"), {"name": "Mine"}).status_code == 403
    assert not Organization.objects.filter(name="Mine").exists()


def test_a_person_changes_their_own_password(client, world):
    issued = people.add_person(SYSTEM, world.org_a, "max", "member")
    browser = BrowserClient()
    browser.post(reverse("login"), {"username": "max", "password": issued.password})
    form = browser.get(reverse("password_change"))
    assert form.status_code == 200 and 'name="old_password"' in form.content.decode()
    wrong = browser.post(
        reverse("password_change"),
        {"old_password": "nope", "new_password1": "a-Long-new-pass-42", "new_password2": "a-Long-new-pass-42"},
    )
    assert wrong.status_code == 200 and "incorrectly" in wrong.content.decode()
    weak = browser.post(
        reverse("password_change"),
        {"old_password": issued.password, "new_password1": "password", "new_password2": "password"},
    )
    assert weak.status_code == 200 and "too common" in weak.content.decode()
    done = browser.post(
        reverse("password_change"),
        {"old_password": issued.password, "new_password1": "a-Long-new-pass-42",
         "new_password2": "a-Long-new-pass-42"},
        follow=True,
    )
    assert done.status_code == 200 and "Your password was changed." in done.content.decode()
    assert signs_in("max", "a-Long-new-pass-42") and not signs_in("max", issued.password)
    entry = AuditLog.objects.get(action="person.password_change")
    assert entry.actor.username == "max" and entry.organization == world.org_a
    assert entry.details == {"tokens_revoked": 0}

    # A token issued under the old password (by a stolen session: no password asked) kept working
    # after the change; it is revoked with it, as after a reset, and the page says so.
    user = get_user_model().objects.get(username="max")
    raw = services.issue_user_token(services.Actor.for_user(user), user, "script")
    api = BrowserClient()
    assert api.get("/api/v1/rounds/", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    again = browser.post(
        reverse("password_change"),
        {"old_password": "a-Long-new-pass-42", "new_password1": "b-Long-new-pass-43",
         "new_password2": "b-Long-new-pass-43"},
        follow=True,
    )
    assert "your 1 API token(s) revoked" in again.content.decode()
    assert api.get("/api/v1/rounds/", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    assert BrowserClient().get(reverse("password_change")).status_code == 302  # login first


def test_a_password_change_whose_audit_fails_is_not_kept(world, monkeypatch):
    issued = people.add_person(SYSTEM, world.org_a, "max", "member")
    browser = BrowserClient(raise_request_exception=False)
    browser.post(reverse("login"), {"username": "max", "password": issued.password})

    def broken(*args, **kwargs):
        raise RuntimeError("the audit log is unreachable")

    monkeypatch.setattr(people, "audit", broken)
    failed = browser.post(
        reverse("password_change"),
        {"old_password": issued.password, "new_password1": "a-Long-new-pass-42",
         "new_password2": "a-Long-new-pass-42"},
    )
    assert failed.status_code == 500
    assert signs_in("max", issued.password) and not signs_in("max", "a-Long-new-pass-42")
    assert not AuditLog.objects.filter(action="person.password_change").exists()


@pytest.mark.django_db(transaction=True)
def test_two_admins_deactivating_each_other_at_once_leave_one_admin(registry, monkeypatch):
    import threading

    from django.db import connection

    org = services.create_organization(SYSTEM, "Org T", "org-t")
    one = people.add_person(SYSTEM, org, "ann", "admin").membership
    two = people.add_person(SYSTEM, org, "ben", "admin").membership
    real_audit = people.audit
    first_holds_locks = threading.Event()

    def slow_audit(actor, action, **kwargs):  # the first deactivation holds its locks until
        if actor.name == "ann":                # the second one waits for them
            first_holds_locks.set()
            another_waits_on_a_lock()
        return real_audit(actor, action, **kwargs)

    monkeypatch.setattr(people, "audit", slow_audit)
    outcomes = {}

    def deactivate(actor_membership, target):
        if actor_membership.user.username == "ben":
            first_holds_locks.wait(5)
        try:
            actor = services.Actor.for_user(
                get_user_model().objects.get(pk=actor_membership.user_id)
            )
            people.set_active(actor, target, False)
            outcomes[actor_membership.user.username] = "done"
        except NotAllowed as exc:
            outcomes[actor_membership.user.username] = exc.detail
        finally:
            connection.close()

    threads = [threading.Thread(target=deactivate, args=(one, two)),
               threading.Thread(target=deactivate, args=(two, one))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert outcomes["ann"] == "done" and "only an admin" in outcomes["ben"]
    active = get_user_model().objects.filter(membership__organization=org, is_active=True)
    assert list(active.values_list("username", flat=True)) == ["ann"]


def test_an_operator_login_in_an_organization_shows_no_buttons_to_its_admins(client, world):
    Membership.objects.create(user=world.operator, organization=world.org_a, role="member")
    client.force_login(world.admin_a)
    body = page(client).content.decode()
    row = body.split(f'id="person-{world.operator.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "the operator manages it" in row and "Reset password" not in row
    client.force_login(world.operator)
    row = page(client).content.decode().split(f'id="person-{world.operator.pk}"', 1)[1]
    assert "(you)" in row.split("</tr>", 1)[0]


def test_only_the_operator_reactivates_a_login_the_operator_deactivated(world):
    target = membership(world.member_a)
    people.set_active(world.actor(world.operator), target, False)
    with pytest.raises(NotAllowed, match="only the operator may reactivate"):
        people.set_active(world.actor(world.admin_a), target, True)
    assert not get_user_model().objects.get(pk=world.member_a.pk).is_active
    people.set_active(world.actor(world.operator), target, True)
    # an admin's own deactivation is the organization's to reverse
    people.set_active(world.actor(world.admin_a), target, False)
    people.set_active(world.actor(world.admin_a), target, True)
    assert get_user_model().objects.get(pk=world.member_a.pk).is_active


@pytest.mark.django_db(transaction=True)
def test_adding_bob_and_BOB_at_once_makes_one_login(registry, monkeypatch):
    import threading

    from django.db import connection

    org = services.create_organization(SYSTEM, "Org R", "org-r")
    real_create = Membership.objects.create
    first_inside = threading.Event()

    def slow_create(**kwargs):  # the first add holds its transaction open until the second
        if kwargs["user"].username == "bob":  # waits on its lock
            first_inside.set()
            another_waits_on_a_lock()
        return real_create(**kwargs)

    monkeypatch.setattr(Membership.objects, "create", slow_create)
    outcomes = {}

    def add(name):
        if name == "BOB":
            first_inside.wait(5)
        try:
            people.add_person(SYSTEM, org, name, "member")
            outcomes[name] = "added"
        except Conflict as exc:
            outcomes[name] = exc.detail
        finally:
            connection.close()

    threads = [threading.Thread(target=add, args=(n,)) for n in ("bob", "BOB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert outcomes["bob"] == "added" and "exists" in outcomes["BOB"]
    assert get_user_model().objects.filter(username__iexact="bob").count() == 1


def test_a_read_only_member_reads_no_colleagues_e_mail_in_the_audit_log(client, world):
    """The people list hides colleagues' e-mail addresses from a read-only member; the audit
    log's person.add entries showed them anyway (page, CSV and API). Admins and the operator
    still read them, and a member reads the one of their own entry."""
    people.add_person(world.actor(world.admin_a), world.org_a, "carol", "member", "carol@a.example")
    people.add_person(world.actor(world.admin_a), world.org_a, "dave", "member", "dave@a.example")
    dave = get_user_model().objects.get(username="dave")
    audit_page, csv_url = reverse("dashboard:audit"), reverse("dashboard:audit") + "?format=csv"
    for user, sees_carol in ((dave, False), (world.member_a, False), (world.admin_a, True),
                             (world.operator, True)):
        client.force_login(user)
        body = client.get(audit_page).content.decode()
        csv_text = b"".join(client.get(csv_url).streaming_content).decode()
        api = person_api(user).get("/api/v1/admin/audit/?action=person.add").json()["results"]
        details = {entry["details"]["user"]: entry["details"] for entry in api}
        for shown in (body, csv_text):
            assert ("carol@a.example" in shown) is sees_carol, user
        assert ("email" in details["carol"]) is sees_carol and details["carol"]["role"] == "member"
        assert ("dave@a.example" in body) is (sees_carol or user == dave)


def test_a_read_only_member_reads_no_colleagues_address_in_the_audit_log(client, world):
    """The audit log's `from` column showed a read-only member every colleague's IP address (page,
    CSV and API), where their e-mail addresses and sign-in times are hidden from them. Admins and
    the operator still read it, and a member reads the address of their own action."""
    services.audit(services.Actor.for_user(world.admin_a, "203.0.113.7"), "person.role",
                   organization=world.org_a, target_label="admin's action")
    services.audit(services.Actor.for_user(world.member_a, "198.51.100.9"), "person.password_change",
                   organization=world.org_a, target_label="member's action")
    audit_page, csv_url = reverse("dashboard:audit"), reverse("dashboard:audit") + "?format=csv"
    for user, sees_admins in ((world.member_a, False), (world.admin_a, True), (world.operator, True)):
        client.force_login(user)
        body = client.get(audit_page).content.decode()
        csv_text = b"".join(client.get(csv_url).streaming_content).decode()
        api = person_api(user).get("/api/v1/admin/audit/").json()["results"]
        ips = {entry["target_label"]: entry["ip"] for entry in api}
        for shown in (body, csv_text):
            assert ("203.0.113.7" in shown) is sees_admins, user
            assert "198.51.100.9" in shown, user
        assert ips["admin's action"] == ("203.0.113.7" if sees_admins else None)
        assert ips["member's action"] == "198.51.100.9"


def test_a_read_only_member_reads_no_colleagues_sign_in_address_in_a_lock_entry(
    client, world, settings
):
    """A lock of a colleague's username (login.throttled, in the colleague's organization's log)
    names the address the failed sign-ins came from twice: as the entry's address, hidden from a
    read-only member, and in its details, which showed it to them anyway (page, CSV and API).
    Admins and the operator still read both."""
    from federation import login_throttle

    settings.SYNAPSE_LOGIN_FAILURES_PER_USERNAME = 2
    for _ in range(2):
        attempt = login_throttle.begin_attempt("admin_a", "203.0.113.45")
        login_throttle.end_attempt(attempt, succeeded=False)
    audit_page = reverse("dashboard:audit") + "?action=login.throttled"
    csv_url = audit_page + "&format=csv"
    for user, sees in ((world.member_a, False), (world.admin_a, True), (world.operator, True)):
        client.force_login(user)
        body = client.get(audit_page).content.decode()
        csv_text = b"".join(client.get(csv_url).streaming_content).decode()
        (entry,) = person_api(user).get("/api/v1/admin/audit/?action=login.throttled").json()[
            "results"
        ]
        assert entry["target_label"] == "admin_a" and entry["details"]["scope"] == "username"
        for shown in (body, csv_text, json.dumps(entry)):
            assert ("203.0.113.45" in shown) is sees, user


def test_a_client_s_contact_is_for_the_organization_s_admins_and_the_operator(client, world):
    """A client's contact is whom to reach about the machine, an e-mail address (254 characters,
    as a login's), and a colleague's e-mail address is for the organization's admins and the
    operator: a read-only member read it anyway in the client list and detail of the API, on the
    organization's page and in the audit log's client.enroll entry (page, CSV and API)."""
    enrolled = services.enroll_client(
        world.actor(world.admin_a), world.org_a, "lab-9", contact="lab9-owner@a.example"
    )
    organization_page = reverse("dashboard:organization", args=["org-a"])
    audit_page, csv_url = reverse("dashboard:audit"), reverse("dashboard:audit") + "?format=csv"
    for user, sees in ((world.member_a, False), (world.admin_a, True), (world.operator, True)):
        api = person_api(user)
        listed = {c["name"]: c for c in api.get("/api/v1/admin/clients/").json()["results"]}
        detail = api.get(f"/api/v1/admin/clients/{enrolled.pk}/").json()
        for shown in (listed["lab-9"], detail):
            assert shown["contact"] == ("lab9-owner@a.example" if sees else None), user
            assert shown["name"] == "lab-9"  # the client itself is still listed
        (entry,) = api.get("/api/v1/admin/audit/?action=client.enroll&target_type=client").json()[
            "results"
        ][:1]
        assert entry["details"]["name"] == "lab-9"
        assert ("contact" in entry["details"]) is sees, user
        client.force_login(user)
        page = client.get(organization_page).content.decode()
        assert "lab-9" in page
        body = client.get(audit_page).content.decode()
        csv_text = b"".join(client.get(csv_url).streaming_content).decode()
        for text in (page, body, csv_text):
            assert ("lab9-owner@a.example" in text) is sees, user


def test_a_member_reads_no_e_mail_of_a_former_colleague_who_had_the_same_username(client, world):
    """Found by audit: a read-only member read an entry's details whole when its `user` was their
    username, so a login deleted in the Django admin (a person who left) and added again under
    the same username (the next person to get it) showed the new person the former one's e-mail
    address in the former one's person.add entry (page, CSV and API). An entry is the member's own
    when it is about their login or their membership, not a username someone else had before."""
    people.add_person(world.actor(world.admin_a), world.org_a, "dave", "member", "old-dave@a.example")
    former = get_user_model().objects.get(username="dave")
    people.admin_login_deleted(world.actor(world.operator), former)
    former.delete()
    people.add_person(world.actor(world.admin_a), world.org_a, "dave", "member", "new-dave@a.example")
    dave = get_user_model().objects.get(username="dave")
    client.force_login(dave)
    audit_page = reverse("dashboard:audit")
    body = client.get(audit_page).content.decode()
    csv_text = b"".join(client.get(audit_page + "?format=csv").streaming_content).decode()
    api = person_api(dave).get("/api/v1/admin/audit/?action=person.add").json()["results"]
    for shown in (body, csv_text, json.dumps(api)):
        assert "old-dave@a.example" not in shown
        assert "new-dave@a.example" in shown  # their own entry, whole
