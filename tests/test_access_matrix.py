"""Who may do and see what, for every URL the project serves: one table, built against the URL
resolver (a new URL without a rule here fails `test_every_url_has_a_rule`), sent as every kind of
caller, each request in a savepoint rolled back after it (so one role's change is not the next
role's state). Besides each answer's status, no answer to a caller of one organization may name
the other organization (its name, slug, clients, people, conflicts or audit entries), and no
answer holds a stored token.

Callers: nobody; an approved client of Acme (its token), the same client's token before a
rotation, a revoked client of Acme; a routing token; Acme's read-only member, Acme's admin,
Globex's admin and the operator (the REST API with their personal tokens, the dashboard with
their sessions); a revoked personal token, and the session of a deactivated login."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client as HttpClient
from django.urls import URLPattern, URLResolver, get_resolver

from federation import people, services
from federation.models import (
    ClientToken,
    ConflictLogEntry,
    Membership,
    Organization,
    UserToken,
)
from routing.models import RoutingToken
from tests.dashboard_data import add_review_data, build_federation

pytestmark = pytest.mark.django_db
SYSTEM = services.Actor.system("access matrix")

# --- the callers ---------------------------------------------------------------------------------

ANON, CLIENT, OLD_TOKEN, REVOKED_CLIENT, ROUTING = (
    "anonymous", "client", "rotated-out client token", "revoked client", "routing token",
)
MEMBER, ADMIN, OTHER_ADMIN, OPERATOR = "member of A", "admin of A", "admin of B", "operator"
REVOKED_TOKEN, INACTIVE = "revoked personal token", "deactivated login"
ROLES = (ANON, CLIENT, OLD_TOKEN, REVOKED_CLIENT, ROUTING, MEMBER, ADMIN, OTHER_ADMIN, OPERATOR,
         REVOKED_TOKEN, INACTIVE)
# Whose organization a caller belongs to: its answers may not name the other one.
OWN = {CLIENT: "acme", MEMBER: "acme", ADMIN: "acme", OTHER_ADMIN: "globex"}
MARKERS = {"acme": ("acme",), "globex": ("globex",)}


# --- what each caller gets, by kind of endpoint --------------------------------------------------
# A REST API answer for a caller without a usable credential: no credentials or an unknown /
# revoked token is a 401; a known token that may not act here (a revoked client's, or a live
# routing token, which only routes) a 403.
API_NOBODY = {ANON: 401, OLD_TOKEN: 401, REVOKED_CLIENT: 403, ROUTING: 403, REVOKED_TOKEN: 401,
              INACTIVE: 401}


def api(people_status: dict | int, *, client: int = 403, routing: int | None = None) -> dict:
    """Statuses of a REST API endpoint: `people_status` for each person (one status for all, or
    per person), `client` for the approved client, `routing` for a routing token (default: as
    for nobody)."""
    if isinstance(people_status, int):
        people_status = {MEMBER: people_status, ADMIN: people_status, OTHER_ADMIN: people_status,
                         OPERATOR: people_status}
    table = {**API_NOBODY, CLIENT: client, **people_status}
    if routing is not None:
        table[ROUTING] = routing
    return table


def for_everyone(status: int) -> dict:
    return dict.fromkeys(ROLES, status)


def page(people_status: dict | int) -> dict:
    """Statuses of a dashboard page: every caller without a session (tokens are not sessions)
    and a deactivated login are sent to sign in (302); people as given."""
    if isinstance(people_status, int):
        people_status = {MEMBER: people_status, ADMIN: people_status, OTHER_ADMIN: people_status,
                         OPERATOR: people_status}
    return {**dict.fromkeys(ROLES, 302), **people_status}


def scoped(member: int, admin: int, operator: int | None = None, other: int = 404) -> dict:
    """An organization A object: its member, its admin, the operator; B's admin gets 404 (the
    object is indistinguishable from one that does not exist)."""
    return {MEMBER: member, ADMIN: admin, OTHER_ADMIN: other,
            OPERATOR: admin if operator is None else operator}


def operator_only(operator: int) -> dict:
    return {MEMBER: 403, ADMIN: 403, OTHER_ADMIN: 403, OPERATOR: operator}


@dataclass
class Call:
    method: str
    url: str  # formatted with the federation's objects (`Fed`)
    expected: dict
    data: dict = field(default_factory=dict)


# Route (as the resolver spells it) -> the calls that exercise it. Statuses past authorization
# are the endpoint's own answers to the body given (a 409 for a round in the wrong state is a
# caller who was let in).
API_RULES: dict[str, list[Call]] = {
    "healthz": [Call("GET", "/healthz", for_everyone(200))],
    "metrics": [Call("GET", "/metrics",
                     api(operator_only(200), client=403))],
    # The OpenAPI document and its viewer describe the API; they are public (nothing private).
    "api/schema/": [Call("GET", "/api/schema/", for_everyone(200))],
    "api/docs/": [Call("GET", "/api/docs/", for_everyone(200))],
    "api/v1/submissions/": [
        Call("GET", "/api/v1/submissions/", api(403, client=200)),
        # past authorization, an empty body is refused for what it is
        Call("POST", "/api/v1/submissions/", api(403, client=400)),
    ],
    "api/v1/rounds/": [Call("GET", "/api/v1/rounds/", api(200, client=200))],
    "api/v1/rounds/<int:pk>/": [Call("GET", "/api/v1/rounds/{r4}/", api(200, client=200))],
    "api/v1/compendium/schema/": [Call("GET", "/api/v1/compendium/schema/", api(200, client=200))],
    "api/v1/compendium/probe/": [Call("GET", "/api/v1/compendium/probe/", api(200, client=200))],
    "api/v1/compendium/global/": [Call("GET", "/api/v1/compendium/global/", api(200, client=200))],
    # No head or tuned router in this federation: 404 for everyone let in.
    "api/v1/compendium/global/head/": [
        Call("GET", "/api/v1/compendium/global/head/", api(404, client=404))
    ],
    "api/v1/compendium/global/router/": [
        Call("GET", "/api/v1/compendium/global/router/", api(404, client=404))
    ],
    "api/v1/compendium/global/router/files/<path:name>": [
        Call("GET", "/api/v1/compendium/global/router/files/model.onnx", api(404, client=404))
    ],
    "api/v1/admin/organizations/": [
        Call("GET", "/api/v1/admin/organizations/", api(200)),
        Call("POST", "/api/v1/admin/organizations/", api(operator_only(201)), {"name": "New Org"}),
    ],
    "api/v1/admin/organizations/<int:pk>/": [
        Call("GET", "/api/v1/admin/organizations/{acme}/", api(scoped(200, 200))),
        Call("PATCH", "/api/v1/admin/organizations/{acme}/", api(scoped(403, 403, 200)),
             {"name": "Acme Renamed"}),
    ],
    "api/v1/admin/clients/": [
        Call("GET", "/api/v1/admin/clients/", api(200)),
        # naming A: B's admin is told there is no such organization it may manage
        Call("POST", "/api/v1/admin/clients/", api(scoped(403, 201, other=400)),
             {"name": "new-node", "organization": "acme"}),
    ],
    "api/v1/admin/clients/<int:pk>/": [
        Call("GET", "/api/v1/admin/clients/{acme_client}/", api(scoped(200, 200)))
    ],
    "api/v1/admin/clients/<int:pk>/approve/": [
        Call("POST", "/api/v1/admin/clients/{acme_pending}/approve/", api(scoped(403, 200)))
    ],
    "api/v1/admin/clients/<int:pk>/rotate/": [
        Call("POST", "/api/v1/admin/clients/{acme_client}/rotate/", api(scoped(403, 200)))
    ],
    "api/v1/admin/clients/<int:pk>/revoke/": [
        Call("POST", "/api/v1/admin/clients/{acme_client}/revoke/", api(scoped(403, 200)),
             {"reason": "test"})
    ],
    "api/v1/admin/people/": [
        Call("GET", "/api/v1/admin/people/", api(200)),
        Call("POST", "/api/v1/admin/people/", api(scoped(403, 201, other=400)),
             {"username": "newbie", "organization": "acme"}),
    ],
    "api/v1/admin/people/<int:pk>/": [
        Call("GET", "/api/v1/admin/people/{acme_member_user}/", api(scoped(200, 200))),
        Call("PATCH", "/api/v1/admin/people/{acme_member_user}/", api(scoped(403, 200)),
             {"role": "admin"}),
    ],
    "api/v1/admin/people/<int:pk>/reset-password/": [
        Call("POST", "/api/v1/admin/people/{acme_member_user}/reset-password/",
             api(scoped(403, 200)))
    ],
    "api/v1/admin/audit/": [Call("GET", "/api/v1/admin/audit/", api(200))],
    "api/v1/admin/rounds/": [
        # round 4 is open: the operator is let in and told another round is open
        Call("POST", "/api/v1/admin/rounds/", api(operator_only(409)), {"epsilon": 1.0})
    ],
    "api/v1/admin/rounds/<int:pk>/close/": [
        Call("POST", "/api/v1/admin/rounds/{r4}/close/", api(operator_only(200)))
    ],
    "api/v1/admin/rounds/<int:pk>/deadline/": [
        Call("POST", "/api/v1/admin/rounds/{r4}/deadline/", api(operator_only(200)),
             {"closes_at": None})
    ],
    "api/v1/admin/rounds/<int:pk>/retry/": [
        Call("POST", "/api/v1/admin/rounds/{r3}/retry/", api(operator_only(409)))
    ],
    "api/v1/admin/rounds/<int:pk>/fail/": [
        Call("POST", "/api/v1/admin/rounds/{r3}/fail/", api(operator_only(200)),
             {"reason": "test"})
    ],
    "api/v1/admin/settings/": [
        Call("GET", "/api/v1/admin/settings/", api(200)),
        Call("PATCH", "/api/v1/admin/settings/", api(operator_only(200)),
             {"enrollments_per_hour": 7}),
    ],
    # Routing: routing tokens, clients and people; past authorization an empty body is a 400.
    "api/v1/route/": [Call("POST", "/api/v1/route/", api(400, client=400, routing=400))],
    "api/v1/route/batch/": [Call("POST", "/api/v1/route/batch/", api(400, client=400, routing=400))],
}

DASHBOARD_RULES: dict[str, list[Call]] = {
    "": [Call("GET", "/", page(200))],
    "rounds/open/": [
        # round 4 is open: the operator is let in and told so
        Call("POST", "/rounds/open/", page(operator_only(409)), {"epsilon": "1"}),
    ],
    "rounds/<int:number>/<str:action>/": [
        Call("POST", "/rounds/4/close/", page(operator_only(302))),
        Call("POST", "/rounds/4/deadline/", page(operator_only(302)), {"closes_at": ""}),
        Call("POST", "/rounds/3/retry/", page(operator_only(409))),
    ],
    "organizations/": [
        Call("GET", "/organizations/", page(200)),
        Call("POST", "/organizations/", page(operator_only(302)), {"name": "New Org"}),
    ],
    "organizations/<slug:slug>/": [Call("GET", "/organizations/acme/", page(scoped(200, 200)))],
    "organizations/<slug:slug>/rename/": [
        Call("POST", "/organizations/acme/rename/", page(scoped(403, 403, 302)),
             {"name": "Acme Renamed"}),
    ],
    "organizations/<slug:slug>/people/add/": [
        Call("POST", "/organizations/acme/people/add/", page(scoped(403, 200)),
             {"username": "newbie", "role": "member"}),
    ],
    "organizations/<slug:slug>/people/<int:user_id>/<str:action>/": [
        Call("POST", "/organizations/acme/people/{acme_member_user}/role/",
             page(scoped(403, 302)), {"role": "admin"}),
        Call("POST", "/organizations/acme/people/{acme_member_user}/deactivate/",
             page(scoped(403, 302))),
        Call("POST", "/organizations/acme/people/{acme_member_user}/reactivate/",
             page(scoped(403, 302))),
        Call("POST", "/organizations/acme/people/{acme_member_user}/reset-password/",
             page(scoped(403, 200))),
        # A's page cannot address B's person, nor B's page A's
        Call("POST", "/organizations/acme/people/{globex_admin_user}/deactivate/",
             page(scoped(404, 404, 404))),
        Call("POST", "/organizations/globex/people/{acme_member_user}/deactivate/",
             page({MEMBER: 404, ADMIN: 404, OTHER_ADMIN: 404, OPERATOR: 404})),
    ],
    "organizations/<slug:slug>/enroll/": [
        Call("POST", "/organizations/acme/enroll/", page(scoped(403, 302)), {"name": "new-node"}),
    ],
    "organizations/<slug:slug>/clients/<int:client_id>/<str:action>/": [
        Call("POST", "/organizations/acme/clients/{acme_pending}/approve/", page(scoped(403, 200))),
        Call("POST", "/organizations/acme/clients/{acme_client}/rotate/", page(scoped(403, 200))),
        Call("POST", "/organizations/acme/clients/{acme_client}/revoke/", page(scoped(403, 302))),
        # another organization's client under A's slug, and under its own slug
        Call("POST", "/organizations/acme/clients/{globex_client}/rotate/",
             page(scoped(404, 404, 404))),
        Call("POST", "/organizations/globex/clients/{acme_client}/rotate/",
             page({MEMBER: 404, ADMIN: 404, OTHER_ADMIN: 404, OPERATOR: 404})),
    ],
    "conflicts/": [Call("GET", "/conflicts/", page(200))],
    "conflicts/<int:pk>/decide/": [
        # round 3 is merging: an admin let in is told a decision now could be missed
        Call("POST", "/conflicts/{acme_conflict}/decide/", page(scoped(403, 409)),
             {"action": "dismiss"}),
    ],
    "privacy/": [Call("GET", "/privacy/", page(200))],
    "accuracy/": [Call("GET", "/accuracy/", page(200))],
    "compendium/": [Call("GET", "/compendium/", page(200))],
    "tools/": [Call("GET", "/tools/", page(200))],
    "routing/": [Call("GET", "/routing/", page(200))],
    "audit/": [Call("GET", "/audit/", page(200)), Call("GET", "/audit/?format=csv", page(200))],
    "settings/": [
        Call("GET", "/settings/", page(200)),
        Call("POST", "/settings/", page(operator_only(302)), {
            "epsilon_budget": "50", "delta_prime": "1e-6", "max_submission_bytes": "1000000",
            "submissions_per_minute": "30", "enrollments_per_hour": "7",
        }),
    ],
    "account/tokens/": [
        Call("GET", "/account/tokens/", page(200)),
        Call("POST", "/account/tokens/", page(200), {"label": "script"}),
    ],
}

# Signing in and out: open to anybody (the password change page asks for a session).
SIGN_IN_RULES: dict[str, list[Call]] = {
    "accounts/login/": [Call("GET", "/accounts/login/", for_everyone(200))],
    "api-auth/login/": [Call("GET", "/api-auth/login/", for_everyone(200))],
    "accounts/logout/": [Call("GET", "/accounts/logout/", page(200))],
    "api-auth/logout/": [Call("GET", "/api-auth/logout/", page(200))],
    "accounts/password_change/": [Call("GET", "/accounts/password_change/", page(200))],
    "admin/password_change/": [Call("GET", "/admin/password_change/", page(200))],
}

# The Django admin (admin.site.urls) is one site with one rule, the operator's alone
# (federation.admin._operator_only): everyone else is sent to its sign-in page.
ADMIN_SITE_CALLS = [
    Call("GET", "/admin/", page({MEMBER: 302, ADMIN: 302, OTHER_ADMIN: 302, OPERATOR: 200})),
    Call("GET", "/admin/federation/client/",
         page({MEMBER: 302, ADMIN: 302, OTHER_ADMIN: 302, OPERATOR: 200})),
    Call("GET", "/admin/auth/user/",
         page({MEMBER: 302, ADMIN: 302, OTHER_ADMIN: 302, OPERATOR: 200})),
]


def _routes(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            if getattr(pattern, "app_name", None) == "admin":
                continue  # the Django admin site: ADMIN_SITE_CALLS
            yield from _routes(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern)


def test_every_url_has_a_rule():
    served = set(_routes(get_resolver().url_patterns))
    ruled = set(API_RULES) | set(DASHBOARD_RULES) | set(SIGN_IN_RULES)
    assert served - ruled == set(), "URLs without an access rule in tests/test_access_matrix.py"
    assert ruled - served == set(), "rules for URLs that are no longer served"


# --- the federation and its callers --------------------------------------------------------------


@dataclass
class Fed:
    ids: dict
    credentials: dict  # role -> ("token", raw) | ("session", user) | None
    secrets: list  # raw tokens no answer may hold
    live: list  # those of them stored now (a rotated-out token's digest was replaced)


@pytest.fixture
def fed(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    data = build_federation()
    review = add_review_data(data)
    acme_client, acme_other, globex_client = data.clients[0], data.clients[1], data.clients[2]
    acme_pending = data.acme.clients.get(status="pending")
    old_token = services.rotate_client_token(SYSTEM, acme_client).token
    client_token = services.rotate_client_token(SYSTEM, acme_client).token
    revoked_client_token = services.rotate_client_token(SYSTEM, acme_other).token
    services.revoke_client(SYSTEM, acme_other, "test")
    globex_token = services.rotate_client_token(SYSTEM, globex_client).token
    tokens = {
        role: services.issue_user_token(SYSTEM, user)
        for role, user in ((MEMBER, review.acme_member), (ADMIN, review.acme_admin),
                           (OTHER_ADMIN, review.globex_admin), (OPERATOR, data.operator))
    }
    revoked = services.issue_user_token(SYSTEM, review.acme_member, "revoked")
    services.revoke_user_token(services.Actor.for_user(review.acme_member),
                               UserToken.objects.get(label="revoked").pk)
    inactive = get_user_model().objects.create_user("acme-gone", password="x")
    Membership.objects.create(user=inactive, organization=data.acme, role="admin")
    gone_token = services.issue_user_token(SYSTEM, inactive)
    people.set_active(SYSTEM, inactive.membership, False)
    _, routing_token = RoutingToken.issue("app")
    sessions = {MEMBER: review.acme_member, ADMIN: review.acme_admin,
                OTHER_ADMIN: review.globex_admin, OPERATOR: data.operator, INACTIVE: inactive}
    credentials = {
        "api": {ANON: None, CLIENT: ("token", client_token), OLD_TOKEN: ("token", old_token),
                REVOKED_CLIENT: ("token", revoked_client_token),
                ROUTING: ("token", routing_token), REVOKED_TOKEN: ("token", revoked),
                INACTIVE: ("token", gone_token),
                **{role: ("token", token) for role, token in tokens.items()}},
        "dashboard": {ANON: None, CLIENT: ("token", client_token), OLD_TOKEN: ("token", old_token),
                      REVOKED_CLIENT: ("token", revoked_client_token),
                      ROUTING: ("token", routing_token), REVOKED_TOKEN: ("token", revoked),
                      **{role: ("session", user) for role, user in sessions.items()}},
    }
    ids = {
        "acme": data.acme.pk, "acme_client": acme_client.pk, "acme_pending": acme_pending.pk,
        "globex_client": globex_client.pk, "acme_member_user": review.acme_member.pk,
        "globex_admin_user": review.globex_admin.pk, "r3": data.rounds[3].pk,
        "r4": data.rounds[4].pk,
        "acme_conflict": ConflictLogEntry.objects.get(organization=data.acme).pk,
    }
    secrets = [client_token, old_token, revoked_client_token, globex_token, routing_token,
               revoked, gone_token, *tokens.values()]
    return Fed(ids, credentials, secrets, [s for s in secrets if s != old_token])


class _Rollback(Exception):
    pass


def _send(call: Call, fed: Fed, credential) -> tuple[int, bytes]:
    http = HttpClient()
    headers = {}
    if credential and credential[0] == "token":
        headers["HTTP_AUTHORIZATION"] = f"Bearer {credential[1]}"
    elif credential:
        http.force_login(credential[1])
    url = call.url.format(**fed.ids)
    if url.startswith("/api/"):
        response = getattr(http, call.method.lower())(
            url, json.dumps(call.data), content_type="application/json", **headers
        ) if call.method != "GET" else http.get(url, **headers)
    elif call.method == "GET":
        response = http.get(url, **headers)
    else:
        response = http.post(url, call.data, **headers)
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return response.status_code, body


def _walk(calls: list[Call], fed: Fed, credentials: dict) -> list[str]:
    problems = []
    for call in calls:
        for role in ROLES:
            try:
                with transaction.atomic():
                    status, body = _send(call, fed, credentials.get(role))
                    raise _Rollback
            except _Rollback:
                pass
            expected = call.expected[role]
            if status != expected:
                problems.append(f"{call.method} {call.url} as {role}: {status}, not {expected}")
            text = body.decode("utf-8", "replace").lower()
            own = OWN.get(role)
            if own is not None and 200 <= status < 300:
                for other, markers in MARKERS.items():
                    if other != own and any(marker in text for marker in markers):
                        problems.append(f"{call.method} {call.url} as {role} names {other}")
            for secret in fed.secrets:
                if secret.lower() in text:
                    problems.append(f"{call.method} {call.url} as {role} holds a stored token")
    return problems


def test_the_rest_api_answers_each_caller_as_its_rule_says(fed):
    calls = [call for rule in API_RULES.values() for call in rule]
    assert _walk(calls, fed, fed.credentials["api"]) == []


def test_the_dashboard_answers_each_caller_as_its_rule_says(fed):
    calls = [call for rule in (DASHBOARD_RULES, SIGN_IN_RULES) for calls in rule.values()
             for call in calls] + ADMIN_SITE_CALLS
    assert _walk(calls, fed, fed.credentials["dashboard"]) == []


def test_no_dashboard_post_acts_without_the_csrf_token(fed):
    """Every POST of the dashboard, sent from a signed-in browser without the form's CSRF token
    (what another site's form would send), is refused and changes nothing."""
    browser = HttpClient(enforce_csrf_checks=True)
    for role in (ADMIN, OPERATOR):
        browser.force_login(fed.credentials["dashboard"][role][1])
        for rule in DASHBOARD_RULES.values():
            for call in rule:
                if call.method != "POST":
                    continue
                before = (Organization.objects.count(), ClientToken.objects.count(),
                          UserToken.objects.count())
                response = browser.post(call.url.format(**fed.ids), call.data)
                assert response.status_code == 403, (call.url, role)
                assert (Organization.objects.count(), ClientToken.objects.count(),
                        UserToken.objects.count()) == before


def test_a_browser_session_needs_the_csrf_token_to_change_anything_over_the_api(fed):
    browser = HttpClient(enforce_csrf_checks=True)
    browser.force_login(fed.credentials["dashboard"][OPERATOR][1])
    response = browser.patch(
        f"/api/v1/admin/organizations/{fed.ids['acme']}/", json.dumps({"name": "Forged"}),
        content_type="application/json",
    )
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]
    assert Organization.objects.get(pk=fed.ids["acme"]).name == "Acme Research"


def test_tokens_are_stored_as_their_digest_only(fed):
    stored = [
        *ClientToken.objects.values_list("token_hash", "prefix"),
        *UserToken.objects.values_list("token_hash", "prefix"),
        *RoutingToken.objects.values_list("token_hash", "name"),
    ]
    digests = {services.hash_token(secret) for secret in fed.live}
    for secret in fed.secrets:
        assert not any(secret in value for row in stored for value in row)
    assert digests <= {row[0] for row in stored}


@pytest.mark.parametrize("next_url", [
    "https://evil.example/", "//evil.example/", "/\\\\evil.example/", "\\\\evil.example",
    "https:evil.example", "http:/\\\\evil.example", " //evil.example", "javascript:alert(1)",
])
@pytest.mark.parametrize("form", ["/accounts/login/", "/api-auth/login/"])
def test_signing_in_never_sends_the_browser_to_another_site(world, settings, form, next_url):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = world.member_a
    user.set_password("pw-for-the-redirect-test")
    user.save()
    response = HttpClient().post(
        f"{form}?next={next_url}",
        {"username": "member_a", "password": "pw-for-the-redirect-test", "next": next_url},
    )
    assert response.status_code == 302
    assert response["Location"] == settings.LOGIN_REDIRECT_URL


@pytest.mark.parametrize("next_url", ["https://evil.example/", "//evil.example/"])
def test_signing_out_never_sends_the_browser_to_another_site(world, next_url):
    browser = HttpClient()
    browser.force_login(world.member_a)
    response = browser.post("/accounts/logout/", {"next": next_url})
    assert response.status_code in (200, 302)
    assert "evil.example" not in response.get("Location", "")
