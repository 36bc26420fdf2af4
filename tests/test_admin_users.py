"""The Django admin's user pages (/admin/auth/user/): the operator's alone, and every change made
there is in the federation's audit log with what changed (never a password); a deactivation
there stands as the operator's; `createsuperuser` still makes the first operator."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client as BrowserClient
from django.urls import reverse

from federation import people, services
from federation.errors import NotAllowed
from federation.models import AuditLog, Membership, UserToken
from tests.federation_fixtures import SYSTEM

pytestmark = pytest.mark.django_db

User = get_user_model()
NEW_PASSWORD = "a-Long-admin-pass-42"


class _FormFields(HTMLParser):
    """The values a browser would submit from the page's main form (inputs, checked boxes,
    selected options, textareas)."""

    def __init__(self):
        super().__init__()
        self.data: dict[str, list[str]] = {}
        self._select = None
        self._textarea = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button"):
            if a.get("type") in ("checkbox", "radio"):
                if "checked" not in a:
                    return
                a.setdefault("value", "on")
            self.data.setdefault(name, []).append(a.get("value") or "")
        elif tag == "select" and name:
            self._select = name
            self.data.setdefault(name, [])
        elif tag == "option" and self._select and "selected" in a:
            self.data[self._select].append(a.get("value") or "")
        elif tag == "textarea" and name:
            self._textarea = name
            self.data[name] = [""]

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data):
        if self._textarea:
            self.data[self._textarea][0] += data


def change_form(browser, user, page_name="admin:auth_user_change") -> dict:
    page = browser.get(reverse(page_name, args=[user.pk]))
    assert page.status_code == 200
    parser = _FormFields()
    parser.feed(page.content.decode())
    data = {k: v if len(v) > 1 else v[0] for k, v in parser.data.items() if v}
    data.pop("_selected_action", None)
    return data


def _to_login(response) -> bool:
    """The admin turned the request away to its sign-in page (it is the operator's alone)."""
    return response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))


def operator_browser(world) -> BrowserClient:
    browser = BrowserClient()
    browser.force_login(world.operator)
    return browser


def entries(action):
    return AuditLog.objects.filter(action=action).order_by("id")


def test_adding_a_login_in_the_admin_is_audited(world):
    browser = operator_browser(world)
    response = browser.post(
        reverse("admin:auth_user_add"),
        {"username": "second-op", "usable_password": "true",
         "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert response.status_code == 302, response.content
    user = User.objects.get(username="second-op")
    entry = entries("user.add").get()
    assert entry.actor == world.operator and entry.target_id == str(user.pk)
    assert entry.target_type == "user" and entry.target_label == "second-op"
    assert entry.details["user"] == "second-op" and entry.details["via"] == "django admin"
    assert entry.details["login"]["usable_password"] is True
    assert entry.details["login"]["is_superuser"] is False
    assert NEW_PASSWORD not in json.dumps(entry.details) and user.password not in json.dumps(entry.details)


def test_a_colleagues_address_changed_in_the_admin_is_not_shown_to_a_read_only_member(world):
    """The entry keeps the change under `changes`; a read-only member of the organization reads
    that the login changed, not the addresses, on the page, in its CSV and through the API; the
    organization's admin and the member it is about read them."""
    from tests.federation_fixtures import client_api, make_user

    browser = operator_browser(world)
    data = change_form(browser, world.member_a)
    data.update(email="member@a.example")
    assert browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data).status_code == 302
    colleague = make_user("member_a2", world.org_a, Membership.Role.MEMBER)
    for reader, shown in ((colleague, False), (world.admin_a, True), (world.member_a, True)):
        page = BrowserClient()
        page.force_login(reader)
        html = page.get(reverse("dashboard:audit")).content.decode()
        csv = b"".join(page.get(reverse("dashboard:audit"), {"format": "csv"}).streaming_content).decode()
        token = services.issue_user_token(services.Actor.for_user(reader), reader, "t")
        api = client_api(token).get("/api/v1/admin/audit/").content.decode()
        for text in (html, csv, api):
            assert ("member@a.example" in text) is shown, (reader.username, text[:300])
        assert "member_a" in api and "user.change" in api


def test_making_someone_staff_in_the_admin_is_audited_with_what_changed(world):
    browser = operator_browser(world)
    data = change_form(browser, world.member_a)
    data.update(is_staff="on", email="member@a.example")
    response = browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data)
    assert response.status_code == 302, response.content
    entry = entries("user.change").get()
    assert entry.actor == world.operator and entry.organization == world.org_a
    assert entry.details == {
        "user": "member_a",
        "via": "django admin",
        "changes": {
            "is_staff": {"from": False, "to": True},
            "email": {"from": "", "to": "member@a.example"},
        },
    }
    # saving the form again unchanged (its dates to the second, in local time) records nothing
    browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]),
                 change_form(browser, world.member_a))
    assert entries("user.change").count() == 1
    assert not entries("person.deactivate").exists() and not entries("person.reactivate").exists()


def test_a_deactivation_in_the_admin_is_the_operators_and_stands(world):
    token = services.issue_user_token(SYSTEM, world.member_a)
    browser = operator_browser(world)
    data = change_form(browser, world.member_a)
    data.pop("is_active")
    response = browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data)
    assert response.status_code == 302, response.content
    assert not User.objects.get(pk=world.member_a.pk).is_active
    entry = entries("person.deactivate").get()
    assert entry.actor == world.operator and entry.organization == world.org_a
    assert entry.target_type == "membership" and entry.target_id == str(world.member_a.membership.pk)
    assert entry.details == {"user": "member_a", "via": "django admin", "role": "member",
                             "tokens_revoked": 1, "sessions_ended": 0}
    assert not entries("user.change").exists()
    assert services.user_for_token(token) is None
    assert UserToken.objects.get(user=world.member_a).revoked_at is not None
    # the organization's admin cannot undo the operator's decision on the People page
    membership = Membership.objects.get(user=world.member_a)
    with pytest.raises(NotAllowed, match="only the operator may reactivate"):
        people.set_active(world.actor(world.admin_a), membership, True)
    # the operator reactivates there again, also recorded
    data["is_active"] = "on"
    browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data)
    assert User.objects.get(pk=world.member_a.pk).is_active
    assert entries("person.reactivate").get().details["via"] == "django admin"


def test_a_session_open_at_a_deactivation_in_the_admin_stays_ended_after_reactivation(world):
    session = BrowserClient()
    session.force_login(world.member_a)
    assert session.get(reverse("dashboard:overview")).status_code == 200
    browser = operator_browser(world)
    data = change_form(browser, world.member_a)
    data.pop("is_active")
    browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data)
    assert entries("person.deactivate").get().details["sessions_ended"] == 1
    data["is_active"] = "on"
    browser.post(reverse("admin:auth_user_change", args=[world.member_a.pk]), data)
    assert User.objects.get(pk=world.member_a.pk).is_active
    assert session.get(reverse("dashboard:overview")).status_code == 302
    assert browser.get(reverse("admin:index")).status_code == 200  # the operator's own stays


def test_a_password_set_in_the_admin_is_audited_without_the_password(world):
    token = services.issue_user_token(services.Actor.for_user(world.member_a), world.member_a)
    browser = operator_browser(world)
    url = reverse("admin:auth_user_password_change", args=[world.member_a.pk])
    assert browser.get(url).status_code == 200
    mismatch = browser.post(url, {"password1": NEW_PASSWORD, "password2": "something-else-42"})
    assert mismatch.status_code == 200 and not entries("user.password").exists()
    done = browser.post(url, {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD})
    assert done.status_code == 302, done.content
    user = User.objects.get(pk=world.member_a.pk)
    assert user.check_password(NEW_PASSWORD)
    entry = entries("user.password").get()
    assert entry.actor == world.operator and entry.organization == world.org_a
    # as after a reset (how a login thought compromised is taken back): its API tokens stop
    assert entry.details == {"user": "member_a", "via": "django admin", "usable_password": True,
                             "tokens_revoked": 1}
    assert NEW_PASSWORD not in json.dumps(entry.details)
    assert not UserToken.objects.filter(user=world.member_a, revoked_at__isnull=True).exists()
    assert services.user_for_token(token) is None
    # disabling password sign-in is recorded too
    browser.post(url, {"usable_password": "false", "unset-password": "1"})
    assert not User.objects.get(pk=world.member_a.pk).has_usable_password()
    assert [e.details["usable_password"] for e in entries("user.password")] == [True, False]


def test_deleting_logins_in_the_admin_is_audited(world):
    browser = operator_browser(world)
    leaver = User.objects.create_user("leaver", email="leaver@example.org")
    response = browser.post(reverse("admin:auth_user_delete", args=[leaver.pk]), {"post": "yes"})
    assert response.status_code == 302 and not User.objects.filter(username="leaver").exists()
    entry = entries("user.delete").get()
    assert entry.actor == world.operator and entry.organization is None
    assert entry.target_id == str(leaver.pk) and entry.target_label == "leaver"
    assert entry.details == {"user": "leaver", "via": "django admin"}
    # the list's bulk action as well
    ids = [User.objects.create_user(name).pk for name in ("temp1", "temp2")]
    browser.post(
        reverse("admin:auth_user_changelist"),
        {"action": "delete_selected", "_selected_action": ids, "post": "yes"},
    )
    assert not User.objects.filter(pk__in=ids).exists()
    assert sorted(e.details["user"] for e in entries("user.delete")) == ["leaver", "temp1", "temp2"]
    # A person of an organization is not deleted here (memberships are read-only in the admin):
    # they are deactivated on the People page.
    refused = browser.post(reverse("admin:auth_user_delete", args=[world.member_a.pk]), {"post": "yes"})
    assert refused.status_code == 403 and User.objects.filter(pk=world.member_a.pk).exists()
    assert entries("user.delete").count() == 3


def test_a_staff_login_with_user_permissions_cannot_change_logins_in_the_admin(world):
    staff = User.objects.create_user("staffer", is_staff=True)
    staff.user_permissions.set(
        Permission.objects.filter(content_type__app_label="auth", codename__endswith="_user")
    )
    browser = BrowserClient()
    browser.force_login(staff)
    assert _to_login(browser.get(reverse("admin:auth_user_add")))
    url = reverse("admin:auth_user_change", args=[staff.pk])
    browser.post(url, {"username": "staffer", "is_active": "on", "is_staff": "on",
                       "is_superuser": "on"})
    assert not User.objects.get(pk=staff.pk).is_superuser
    password_url = reverse("admin:auth_user_password_change", args=[world.operator.pk])
    assert _to_login(browser.post(password_url, {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD}))
    assert not User.objects.get(pk=world.operator.pk).check_password(NEW_PASSWORD)
    assert not AuditLog.objects.filter(action__startswith="user.").exists()


def test_createsuperuser_still_makes_the_first_operator(monkeypatch):
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", NEW_PASSWORD)
    call_command("createsuperuser", interactive=False, username="root", email="root@example.org",
                 verbosity=0)
    root = User.objects.get(username="root")
    assert root.is_superuser and root.is_staff and root.check_password(NEW_PASSWORD)
    browser = BrowserClient()
    assert browser.post(reverse("admin:login"), {"username": "root", "password": NEW_PASSWORD,
                                                 "next": "/admin/"}).status_code == 302
    assert browser.get(reverse("admin:auth_user_changelist")).status_code == 200
    added = browser.post(
        reverse("admin:auth_user_add"),
        {"username": "second-op", "usable_password": "true",
         "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert added.status_code == 302
    assert entries("user.add").get().actor == root


def test_the_federations_records_are_read_only_in_the_admin(world):
    """Rounds (their ε spend), submissions (provenance for erasure), stored compendiums
    (content-addressed, what clients pulled), routing tokens and calls are shown in the admin but
    never changed or deleted there: the README says so, and a deleted round took its ε spend out
    of the privacy ledger without an audit entry."""
    from compendium.models import CompendiumVersion, ScenarioEntry
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation.models import Round
    from routing.models import RoutingToken

    rnd = services.open_round(SYSTEM)
    version = store_compendium(
        Compendium.model_validate(
            {"scenarios": [{"tool_id": "weather", "text": "Will it rain in Oslo tomorrow?"}]}
        ),
        kind="global", round=rnd,
    )
    token, _ = RoutingToken.issue("ops")
    browser = operator_browser(world)
    for model, obj in (
        ("federation_round", rnd), ("compendium_compendiumversion", version),
        ("compendium_scenarioentry", ScenarioEntry.objects.filter(version=version).first()),
        ("routing_routingtoken", token),
    ):
        assert browser.get(reverse(f"admin:{model}_change", args=[obj.pk])).status_code == 200, model
        assert browser.post(
            reverse(f"admin:{model}_delete", args=[obj.pk]), {"post": "yes"}
        ).status_code == 403, model
        assert browser.get(reverse(f"admin:{model}_add")).status_code == 403, model
    assert Round.objects.filter(pk=rnd.pk).exists()
    assert CompendiumVersion.objects.filter(pk=version.pk).exists()
    assert RoutingToken.objects.filter(pk=token.pk, revoked=False).exists()
    revoke = browser.post(
        reverse("admin:routing_routingtoken_change", args=[token.pk]), {"name": "ops", "revoked": "on"}
    )
    assert revoke.status_code == 403 and not RoutingToken.objects.get(pk=token.pk).revoked


def test_the_schemas_numeric_fields_and_tools_are_the_operators_and_audited(world):
    """A sensitivity sets the Laplace noise of every edge: lowering it in the admin weakens the
    privacy of every later round, and nothing recorded it. Now each change is schema.change with
    what changed, and a staff login with the compendium permissions changes nothing."""
    from compendium.models import NumericField, Tool

    field = NumericField.objects.get(name="calls")
    before = field.sensitivity
    url = reverse("admin:compendium_numericfield_change", args=[field.pk])
    staff = User.objects.create_user("schema-staff", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(content_type__app_label="compendium"))
    browser = BrowserClient()
    browser.force_login(staff)
    form = change_form(operator_browser(world), field, "admin:compendium_numericfield_change")
    assert _to_login(browser.post(url, {**form, "sensitivity": "0.001"}))
    assert _to_login(browser.get(reverse("admin:compendium_tool_add")))

    operator = operator_browser(world)
    response = operator.post(url, {**form, "sensitivity": "0.001"})
    assert response.status_code == 302, response.content[:2000]
    assert NumericField.objects.get(pk=field.pk).sensitivity == 0.001
    entry = entries("schema.change").get()
    assert entry.actor == world.operator and (entry.target_type, entry.target_label) == (
        "numericfield", "calls"
    )
    assert entry.details == {
        "via": "django admin", "operation": "change", "model": "numeric field",
        "fields": {"sensitivity": {"from": before, "to": 0.001}},
    }
    operator.post(url, {**form, "sensitivity": "0.001"})  # saved unchanged: nothing to record
    assert entries("schema.change").count() == 1
    # A bad range is the form's error, not a 500, and nothing is recorded.
    refused = operator.post(url, {**form, "min_value": "5", "max_value": "1"})
    assert refused.status_code == 200 and entries("schema.change").count() == 1

    tool = Tool.objects.create(tool_id="ghost", name="Ghost", description="Never used")
    delete = reverse("admin:compendium_tool_delete", args=[tool.pk])
    assert operator.post(delete, {"post": "yes"}).status_code == 302
    deleted = entries("schema.change").last()
    assert deleted.details["operation"] == "delete" and deleted.target_label == "ghost"


def test_the_admin_is_the_operators_alone_whatever_permissions_a_staff_login_holds(world):
    """Its pages show every organization's clients, audit entries and submissions: a staff login
    given view permissions (here by a group) sees none of them."""
    from django.contrib.auth.models import Group

    viewers = Group.objects.create(name="viewers")
    viewers.permissions.set(Permission.objects.filter(codename__startswith="view_"))
    staff = User.objects.create_user("looker", is_staff=True)
    staff.groups.add(viewers)
    browser = BrowserClient()
    browser.force_login(staff)
    for page in ("admin:index", "admin:federation_client_changelist",
                 "admin:federation_auditlog_changelist", "admin:compendium_compendiumversion_changelist",
                 "admin:auth_group_changelist"):
        assert _to_login(browser.get(reverse(page))), page
    assert operator_browser(world).get(reverse("admin:federation_client_changelist")).status_code == 200


def test_a_schema_row_the_schema_would_refuse_is_a_form_error_and_ids_are_fixed(world):
    """A numeric field named like "p95 latency" or a tool spec that is not an object was saved,
    and then the schema in force failed to load: every submission, schema download and merge
    failed. Now each is the form's error and nothing is saved; and the identifier a stored
    compendium, the conflict log and the ledger name a row by is not editable once created."""
    from compendium.models import NumericField, Tool
    from compendium.services import current_schema

    operator = operator_browser(world)
    add = reverse("admin:compendium_numericfield_add")
    refused = operator.post(add, {"name": "p95 latency", "kind": "latency", "min_value": "0",
                                  "max_value": "10", "sensitivity": "10", "unit": "",
                                  "description": ""})
    assert refused.status_code == 200
    assert "the schema in force would not load" in refused.content.decode()
    assert not NumericField.objects.filter(name="p95 latency").exists()
    tool = Tool.objects.get(tool_id="weather")
    url = reverse("admin:compendium_tool_change", args=[tool.pk])
    form = change_form(operator, tool, "admin:compendium_tool_change")
    assert "tool_id" not in form  # shown, not editable
    refused = operator.post(url, {**form, "spec": "[]"})
    assert refused.status_code == 200 and "the schema in force would not load" in refused.content.decode()
    assert Tool.objects.get(pk=tool.pk).spec == tool.spec
    assert not entries("schema.change").exists()
    current_schema()  # still loads
    # the identifier sent with the form is ignored; other fields change
    saved = operator.post(url, {**form, "tool_id": "renamed", "name": "Weather now"})
    assert saved.status_code == 302, saved.content[:2000]
    assert Tool.objects.get(pk=tool.pk).tool_id == "weather"
    assert Tool.objects.get(pk=tool.pk).name == "Weather now"
    field = NumericField.objects.get(name="calls")
    assert "name" not in change_form(operator, field, "admin:compendium_numericfield_change")


def test_the_operator_cannot_add_a_tool_whose_id_reads_as_another(world):
    """The registry holds "weather": adding "ｗeather" (a full-width w) or "Weather" in the
    admin made a second tool that reads as the first wherever tools are named; an id holding a
    zero-width space reads as the id without it. Each is the form's error, nothing saved."""
    from compendium.models import Tool

    operator = operator_browser(world)
    add = reverse("admin:compendium_tool_add")
    for tool_id, says in (("\uff57eather", "reads as the registry&#x27;s tool &#x27;weather&#x27;"),
                          ("Weather", "reads as the registry&#x27;s tool &#x27;weather&#x27;"),
                          ("news\u200b", "an invisible character U+200B")):
        refused = operator.post(add, {"tool_id": tool_id, "name": "", "description": "d",
                                      "category": "", "spec": "{}", "active": "on"})
        assert refused.status_code == 200 and says in refused.content.decode(), tool_id
        assert not Tool.objects.filter(tool_id=tool_id).exists()
    assert not entries("schema.change").exists()
    added = operator.post(add, {"tool_id": "news", "name": "", "description": "d", "category": "",
                                "spec": "{}", "active": "on"})
    assert added.status_code == 302 and Tool.objects.filter(tool_id="news").exists()


def test_a_compendiums_admin_page_links_its_entries_instead_of_listing_them(world):
    from compendium.models import CompendiumVersion
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    rnd = services.open_round(SYSTEM)
    version = store_compendium(
        Compendium.model_validate({"scenarios": [
            {"tool_id": "weather", "text": f"Will it rain in Oslo in {n} days?"} for n in range(3)]}),
        kind="global", round=rnd,
    )
    other = store_compendium(
        Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "Sun in Rome?"}]}),
        kind="client", round=rnd, client=world.client_a,
    )
    operator = operator_browser(world)
    page = operator.get(reverse("admin:compendium_compendiumversion_change", args=[version.pk]))
    html = page.content.decode()
    assert page.status_code == 200
    link = f"{reverse('admin:compendium_scenarioentry_changelist')}?version__id__exact={version.pk}"
    assert f'<a href="{link}">3 scenarios</a>' in html
    assert "Will it rain in Oslo in 1 days?" in html  # in the content's head, once
    listed = operator.get(link)
    assert listed.status_code == 200
    assert listed.content.decode().count("Will it rain in Oslo") == 3
    assert "Sun in Rome" not in listed.content.decode()
    assert CompendiumVersion.objects.filter(pk=other.pk).exists()
    for page_name in ("admin:compendium_compendiumversion_changelist",
                      "admin:compendium_statentry_changelist",
                      "admin:compendium_templateentry_changelist",
                      "admin:routing_routingcall_changelist",
                      "admin:federation_auditlog_changelist"):
        assert operator.get(reverse(page_name)).status_code == 200, page_name
