"""Renaming an organization: the operator's, through the service, the API and the dashboard; its
slug never changes; bad names are a 4xx naming the problem; every rename is audited, also two at
once."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.urls import reverse
from rest_framework.test import APIClient

from federation import services
from federation.errors import Conflict, InvalidRequest, NotAllowed
from federation.models import AuditLog, Organization
from tests.federation_fixtures import SYSTEM, another_waits_on_a_lock

pytestmark = pytest.mark.django_db

ORGANIZATIONS = "/api/v1/admin/organizations/"


def person_api(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {services.issue_user_token(SYSTEM, user)}")
    return api


def renames():
    return AuditLog.objects.filter(action="organization.rename").order_by("id")


# --- the service -------------------------------------------------------------------------------


def test_the_operator_renames_an_organization_and_its_slug_clients_and_links_stay(client, world):
    org = services.rename_organization(world.actor(world.operator), world.org_a, "  Org Alpha ")
    assert (org.name, org.slug) == ("Org Alpha", "org-a")
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org Alpha"
    entry = renames().get()
    assert entry.actor == world.operator and entry.ip == "10.0.0.1"
    assert entry.organization == world.org_a and entry.target_label == "Org Alpha"
    assert entry.details == {"name": "Org Alpha", "previous_name": "Org A", "slug": "org-a"}
    # what names the organization by its slug keeps working: its clients' tokens, its page
    assert services.client_for_token(world.token_a).organization.name == "Org Alpha"
    client.force_login(world.admin_a)
    page = client.get(reverse("dashboard:organization", args=["org-a"]))
    assert page.status_code == 200 and "Org Alpha" in page.content.decode()
    # the same name again changes nothing and writes nothing
    services.rename_organization(world.actor(world.operator), world.org_a, "Org Alpha")
    assert renames().count() == 1


@pytest.mark.parametrize(
    ("name", "slug", "error", "words"),
    [
        ("", None, InvalidRequest, "needs a name"),
        ("   ", None, InvalidRequest, "needs a name"),
        ("x" * 201, None, InvalidRequest, "at most 200 characters"),
        ("Org B", None, Conflict, "an organization named 'Org B' exists"),
        ("Org Alpha", "org-alpha", InvalidRequest, "slug 'org-a' cannot change"),
        # what reads as "Org A-Bank" but is stored otherwise; a bell no one sees
        ("Org \u202eknaB-A", None, InvalidRequest, "bidirectional override U\\+202E at position 4"),
        ("Org\x07 A", None, InvalidRequest, "control character U\\+0007 at position 3"),
    ],
)
def test_a_bad_rename_says_what_is_wrong_and_changes_nothing(world, name, slug, error, words):
    with pytest.raises(error, match=words):
        services.rename_organization(world.actor(world.operator), world.org_a, name, slug=slug)
    world.org_a.refresh_from_db()
    assert (world.org_a.name, world.org_a.slug) == ("Org A", "org-a")
    assert not renames().exists()


def test_creation_and_renaming_check_a_name_alike(world):
    operator = world.actor(world.operator)
    for bad in ("", "x" * 201, "Org\u2066 C"):
        with pytest.raises(InvalidRequest) as created:
            services.create_organization(operator, bad, "some-slug")
        with pytest.raises(InvalidRequest) as renamed:
            services.rename_organization(operator, world.org_a, bad)
        assert created.value.detail == renamed.value.detail


def test_the_current_slug_may_be_sent_along(world):
    services.rename_organization(world.actor(world.operator), world.org_a, "Org Alpha", slug="org-a")
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org Alpha"


@pytest.mark.parametrize("role", ["admin_a", "member_a", "admin_b"])
def test_only_the_operator_renames_organizations(world, role):
    with pytest.raises(NotAllowed, match="only the federation operator may rename organizations"):
        services.rename_organization(world.actor(getattr(world, role)), world.org_a, "Mine now")
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org A" and not renames().exists()


@pytest.mark.django_db(transaction=True)
def test_two_renames_at_once_are_both_recorded_in_order(registry, monkeypatch):
    org = services.create_organization(SYSTEM, "Org T", "org-t")
    real_audit = services.audit
    first_inside = threading.Event()

    def slow_audit(actor, action, **kwargs):  # the first rename holds its lock until the
        if kwargs.get("details", {}).get("name") == "First":  # second one waits for it
            first_inside.set()
            another_waits_on_a_lock()
        return real_audit(actor, action, **kwargs)

    monkeypatch.setattr(services, "audit", slow_audit)
    failures = []

    def rename(name):
        if name == "Second":
            first_inside.wait(5)
        try:
            services.rename_organization(SYSTEM, org.pk, name)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=rename, args=(n,)) for n in ("First", "Second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not failures
    # The second rename read the name after the first had committed: the log is a chain.
    chain = [(e.details["previous_name"], e.details["name"]) for e in renames()]
    assert chain == [("Org T", "First"), ("First", "Second")]
    assert Organization.objects.get(pk=org.pk).name == "Second"


# --- the API -----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["admin_a", "member_a", "admin_b"])
def test_creating_an_organization_tells_no_one_but_the_operator_which_slugs_exist(world, role):
    """Who asks is checked before the body: a taken slug and a free one are the same 403."""
    api = person_api(getattr(world, role))
    for slug in ("org-b", "org-a", "nothing-here"):
        response = api.post(ORGANIZATIONS, {"name": "X", "slug": slug}, format="json")
        assert response.status_code == 403, (slug, response.content)
        assert "slug" not in response.json()["detail"]
    assert Organization.objects.count() == 2
    taken = person_api(world.operator).post(ORGANIZATIONS, {"name": "X", "slug": "org-b"}, format="json")
    # a 409, as a taken name is (it was DRF's unique validator's 400)
    assert taken.status_code == 409 and "slug 'org-b' exists" in taken.json()["detail"]


@pytest.mark.parametrize(
    ("role", "own", "other"),
    [("operator", 200, 200), ("admin_a", 200, 404), ("member_a", 200, 404), ("admin_b", 404, 200)],
)
def test_organization_detail_scope(world, role, own, other):
    api = person_api(getattr(world, role))
    response = api.get(f"{ORGANIZATIONS}{world.org_a.pk}/")
    assert response.status_code == own
    if own == 200:
        assert response.json()["slug"] == "org-a" and response.json()["name"] == "Org A"
    assert api.get(f"{ORGANIZATIONS}{world.org_b.pk}/").status_code == other
    assert api.get(f"{ORGANIZATIONS}999999/").status_code == 404


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 200), ("admin_a", 403), ("member_a", 403), ("admin_b", 404)],
)
def test_renaming_over_the_api(world, role, expected):
    response = person_api(getattr(world, role)).patch(
        f"{ORGANIZATIONS}{world.org_a.pk}/", {"name": "Org Alpha"}, format="json"
    )
    assert response.status_code == expected, response.content
    name = Organization.objects.get(pk=world.org_a.pk).name
    if expected == 200:
        assert response.json() == {**response.json(), "name": "Org Alpha", "slug": "org-a"}
        assert name == "Org Alpha" and renames().get().actor == world.operator
    else:
        assert name == "Org A" and not renames().exists()
    if expected == 403:
        assert "only the federation operator" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"name": ""}, 400, "needs a name"),
        ({"name": "x" * 201}, 400, "at most 200 characters"),
        ({"name": "Org B"}, 409, "an organization named 'Org B' exists"),
        ({"name": "Org Alpha", "slug": "org-alpha"}, 400, "cannot change"),
        ({"slug": "org-alpha"}, 400, "name"),
        ({"name": "Org Alpha", "description": "new"}, 400, "not description"),
        ({}, 400, "name"),
        ({"name": None}, 400, "name"),
        ({"name": ["Org"]}, 400, "name"),
        (["Org Alpha"], 400, ""),
    ],
)
def test_a_bad_rename_over_the_api_is_a_4xx_naming_the_problem(world, body, status, words):
    response = person_api(world.operator).patch(
        f"{ORGANIZATIONS}{world.org_a.pk}/", body, format="json"
    )
    assert response.status_code == status, response.content
    assert words in response.content.decode()
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org A" and not renames().exists()


def test_clients_cannot_reach_the_organization_detail(world):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    url = f"{ORGANIZATIONS}{world.org_a.pk}/"
    assert api.get(url).status_code == 403
    assert api.patch(url, {"name": "Client's"}, format="json").status_code == 403
    assert APIClient().patch(url, {"name": "Anyone's"}, format="json").status_code in (401, 403)
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org A"


# --- the dashboard -----------------------------------------------------------------------------


def test_the_operator_renames_an_organization_on_its_page(client, world):
    client.force_login(world.operator)
    page = client.get(reverse("dashboard:organization", args=["org-a"])).content.decode()
    assert 'id="rename-organization"' in page
    url = reverse("dashboard:organization-rename", args=["org-a"])
    done = client.post(url, {"name": "Org Alpha"}, follow=True)
    assert done.redirect_chain == [("/organizations/org-a/", 302)]
    assert [str(m) for m in done.context["messages"]] == ["Organization Org A renamed to Org Alpha."]
    assert "<h1>Org Alpha" in done.content.decode()
    assert renames().get().details["previous_name"] == "Org A"
    # the name it already has: the page said nothing, as if the rename had been lost
    same = client.post(url, {"name": "Org Alpha"}, follow=True)
    assert [str(m) for m in same.context["messages"]] == [
        "Organization Org Alpha already has that name: nothing changed."]
    assert renames().count() == 1
    for data, status, words in [
        ({"name": ""}, 400, "needs a name"),
        ({"name": "x" * 201}, 400, "at most 200 characters"),
        ({"name": "Org B"}, 409, "exists"),
        ({"name": "Org C", "slug": "org-c"}, 400, "cannot change"),
    ]:
        response = client.post(url, data)
        assert response.status_code == status and words in response.content.decode(), data
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org Alpha"
    assert renames().count() == 1


@pytest.mark.parametrize(("role", "status"), [("admin_a", 403), ("member_a", 403), ("admin_b", 404)])
def test_others_see_no_rename_form_and_cannot_rename(client, world, role, status):
    client.force_login(getattr(world, role))
    page = client.get(reverse("dashboard:organization", args=["org-a"]))
    assert 'id="rename-organization"' not in page.content.decode()
    response = client.post(reverse("dashboard:organization-rename", args=["org-a"]), {"name": "Mine"})
    assert response.status_code == status
    assert Organization.objects.get(pk=world.org_a.pk).name == "Org A" and not renames().exists()


@pytest.mark.parametrize(
    ("body", "clash"),
    [
        ({"name": "Elsewhere", "slug": "ORG-B"}, "'org-b'"),
        ({"name": "ORG B", "slug": "elsewhere"}, "'Org B'"),
    ],
)
def test_an_organization_that_differs_from_another_only_in_case_is_refused(world, body, clash):
    """'ORG-B' was created next to 'org-b' (and 'ORG B' next to 'Org B'): two organizations
    that read and type as one."""
    response = person_api(world.operator).post(ORGANIZATIONS, body, format="json")
    assert response.status_code == 409, response.content
    assert "only in case" in response.json()["detail"] and clash in response.json()["detail"]
    assert Organization.objects.count() == 2


def test_a_rename_to_another_organizations_name_in_other_case_is_refused(world):
    org_a = Organization.objects.get(slug="org-a")
    response = person_api(world.operator).patch(f"{ORGANIZATIONS}{org_a.pk}/", {"name": "org b"}, format="json")
    assert response.status_code == 409 and "only in case" in response.json()["detail"], response.content
    org_a.refresh_from_db()
    assert org_a.name != "org b"
    # its own name in another case is a rename like any other
    assert person_api(world.operator).patch(
        f"{ORGANIZATIONS}{org_a.pk}/", {"name": org_a.name.upper()}, format="json").status_code == 200


# --- invisible twins ---------------------------------------------------------------------------

# What reads as "Org C" (or as "Org A", an existing name) but is stored otherwise: a zero-width
# space, non-joiner, joiner, word joiner, byte-order mark, soft hyphen, a Hangul filler.
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u3164"]


@pytest.mark.parametrize("char", INVISIBLE)
def test_a_name_with_an_invisible_character_is_refused_naming_it(world, char):
    operator = world.actor(world.operator)
    for name in (f"Org{char} C", f"Org{char} A"):
        with pytest.raises(InvalidRequest, match=f"an organization's name contains an invisible "
                           f"character U\\+{ord(char):04X} .*at position 3"):
            services.create_organization(operator, name, "org-c")
        with pytest.raises(InvalidRequest, match="organization's name contains an invisible"):
            services.rename_organization(operator, world.org_b, name)
    assert sorted(Organization.objects.values_list("name", flat=True)) == ["Org A", "Org B"]
    assert not renames().exists()


@pytest.mark.parametrize(
    "twin",
    ["Org\u00a0A", "Org\u202fA", "Org  A", "org a", "ＯＲＧ Ａ", "\tOrg \n A"],
)
def test_an_organization_named_as_another_but_for_spacing_or_width_is_a_conflict(world, twin):
    """A no-break space for a space, two spaces for one, full-width letters: the dashboard shows
    the same name twice."""
    api = person_api(world.operator)
    created = api.post(ORGANIZATIONS, {"name": twin, "slug": "org-twin"}, format="json")
    assert created.status_code == 409, created.content
    detail = created.json()["detail"]
    assert detail.startswith("an organization named 'Org A' exists (slug 'org-a')")
    assert "differs from it only in case, spacing or invisible characters" in detail
    renamed = api.patch(f"{ORGANIZATIONS}{world.org_b.pk}/", {"name": twin}, format="json")
    assert renamed.status_code == 409 and renamed.json()["detail"] == detail, renamed.content
    assert sorted(Organization.objects.values_list("name", flat=True)) == ["Org A", "Org B"]
    assert not renames().exists()


def test_the_dashboard_refuses_invisible_twins_as_the_api_does(client, world):
    client.force_login(world.operator)
    created = client.post(reverse("dashboard:organizations"), {"name": "Org\u00a0A", "slug": "x"})
    assert created.status_code == 409 and "only in case, spacing" in created.content.decode()
    renamed = client.post(
        reverse("dashboard:organization-rename", args=["org-b"]), {"name": "Org\u200bA"}
    )
    assert renamed.status_code == 400 and "invisible character U+200B" in renamed.content.decode()
    enrolled = client.post(reverse("dashboard:client-enroll", args=["org-a"]), {"name": "A1"})
    assert enrolled.status_code == 409 and "already has a client" in enrolled.content.decode()
    assert Organization.objects.count() == 2
    assert world.org_a.clients.count() == 2 and world.org_b.name == "Org B"
