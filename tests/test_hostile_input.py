"""Hostile input: whatever a client sends, validation answers with violations, never raises
(property-based); whatever a person or client puts in a query parameter, a form or a request body,
the API and the dashboard answer with a 4xx naming what is wrong, never a 500."""

from __future__ import annotations

import html
import json
import math

import pytest
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from compendium.models import CompendiumVersion
from compendium.validation import validate_compendium
from federation import services
from federation.models import ConflictDecision, ConflictLogEntry, Organization, Round, Submission
from tests.federation_fixtures import SYSTEM, client_api

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=40,
)

entry_keys = st.sampled_from(["tool_id", "text", "preconditions", "support", "signature", "template",
                              "subject", "relation", "object", "stats", "description", "spec"])
entries = st.dictionaries(entry_keys, json_values, max_size=6)
compendium_like = st.fixed_dictionaries(
    {},
    optional={
        "schema_version": json_values,
        "metadata": st.lists(entries, max_size=4) | json_values,
        "scenarios": st.lists(entries, max_size=4) | json_values,
        "precautions": st.lists(entries, max_size=4),
        "templates": st.lists(entries, max_size=4),
        "annex": st.lists(entries, max_size=4),
        "masking": json_values,
        "extra": json_values,
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(doc=compendium_like)
def test_random_compendium_like_documents_never_raise(small_schema, doc):
    result = validate_compendium(doc, small_schema)
    if not result.ok:
        assert result.compendium is None
        assert all(v.path.startswith("$") and v.reason for v in result.violations)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(raw=st.binary(max_size=300))
def test_random_bytes_never_raise(small_schema, raw):
    result = validate_compendium(raw, small_schema)
    assert result.ok == (result.compendium is not None)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(doc=json_values)
def test_random_json_text_never_raises(small_schema, doc):
    result = validate_compendium(json.dumps(doc), small_schema)
    assert result.ok == (result.compendium is not None)
    if result.ok:  # only an object with nothing but known, empty-able components passes
        assert isinstance(doc, dict) and not set(doc) - {"metadata", "scenarios", "precautions",
                                                        "templates", "annex", "masking"}


# --- hostile query parameters and form values on the API and the dashboard ----------------------
# Whatever a person or client sends, the answer is a 4xx naming what is wrong, never a 500.

HUGE = "9" * 5000  # int() refuses more than 4300 digits


def person_api(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {services.issue_user_token(SYSTEM, user)}")
    return api


def operator_page(client, world):
    client.force_login(world.operator)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/compendium/global/", "/api/v1/compendium/global/head/"])
@pytest.mark.parametrize("number", ["²", "١", HUGE, "-1", "1.0"])
def test_global_round_that_is_no_round_number_is_400(world, path, number):
    response = person_api(world.member_a).get(path, {"round": number})
    assert response.status_code == 400
    assert response.json()["detail"] == "round must be a round number"


@pytest.mark.django_db
@pytest.mark.parametrize("number", ["²", "١", HUGE, "-1", "1.0"])
def test_own_submissions_round_that_is_no_round_number_is_400(world, number):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    response = api.get("/api/v1/submissions/", {"round": number})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("round must be a round number")


@pytest.mark.django_db
@pytest.mark.parametrize("top_k", ["²", HUGE, "0", "51"])
def test_routing_playground_top_k_out_of_range_is_400(client, world, top_k):
    response = operator_page(client, world).get(reverse("dashboard:routing"),
                                                {"q": "rain", "top_k": top_k})
    assert response.status_code == 400
    assert "top_k must be" in response.content.decode()


def test_advanced_composition_of_a_huge_epsilon_is_infinite_not_an_error():
    from federation.merge.privacy import advanced_composition, compose

    assert advanced_composition(1000.0, 1, 1e-5) == math.inf
    composed = compose([1000.0], 1e-5)
    assert composed.epsilon == 1000.0 and composed.tighter == "basic"


@pytest.mark.django_db
def test_round_far_over_budget_is_refused_not_a_500(client, world):
    privacy = operator_page(client, world).get(reverse("dashboard:privacy"), {"epsilon": "1000"})
    assert privacy.status_code == 200
    assert "above its privacy budget" in privacy.content.decode()
    api = person_api(world.operator).post("/api/v1/admin/rounds/", {"epsilon": 1000}, format="json")
    assert api.status_code == 409 and "above its privacy budget" in api.json()["detail"]
    page = client.post(reverse("dashboard:round-open"), {"epsilon": "1000"})
    assert page.status_code == 409 and "above its privacy budget" in page.content.decode()
    assert not Round.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "field, value",
    [("mask_strength", "inf"), ("mask_strength", "nan"), ("epsilon", "nan"), ("tau", "nan"),
     ("trim_fraction", "-inf"), ("seed", "-1"), ("epsilon", "1e-320")],
)
def test_dashboard_round_with_non_finite_or_out_of_range_value_is_400(client, world, field, value):
    response = operator_page(client, world).post(reverse("dashboard:round-open"), {field: value})
    assert response.status_code == 400
    assert f"invalid round configuration: {field}" in response.content.decode()
    assert not Round.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("body", [{"seed": -1}, {"epsilon": 1e-320}, {"mask_strength": "inf"},
                                  {"trim_fraction": 0, "robust_rule": "krum"}])
def test_api_round_that_could_never_be_merged_is_refused_at_open(world, body):
    response = person_api(world.operator).post("/api/v1/admin/rounds/", body, format="json")
    assert response.status_code == 400
    assert next(iter(body)) in json.dumps(response.json())
    assert not Round.objects.exists()


@pytest.mark.django_db
def test_privacy_page_with_an_epsilon_below_the_minimum_is_400(client, world):
    response = operator_page(client, world).get(reverse("dashboard:privacy"), {"epsilon": "1e-320"})
    assert response.status_code == 400 and "epsilon must be" in response.content.decode()


@pytest.mark.django_db
def test_a_round_recorded_before_the_bounds_still_shows_and_fails_with_its_reason(
    client, world, django_capture_on_commit_callbacks
):
    """A round stored with a negative seed (accepted before the bound) does not break the pages
    that read its configuration; closing it fails the round with the reason."""
    rnd = Round.objects.create(number=1, config={"epsilon": 1.0, "seed": -1})
    operator_page(client, world)
    assert client.get(reverse("dashboard:overview")).status_code == 200
    assert client.get(reverse("dashboard:privacy")).status_code == 200
    with django_capture_on_commit_callbacks(execute=True):
        response = person_api(world.operator).post(f"/api/v1/admin/rounds/{rnd.pk}/close/")
    assert response.status_code == 200
    rnd.refresh_from_db()
    assert rnd.state == Round.State.FAILED and "seed" in rnd.failure_reason


@pytest.mark.django_db(transaction=True)
def test_pipeline_that_fails_at_once_does_not_turn_a_committed_close_into_a_500(
    world, monkeypatch
):
    """Celery eager mode runs the pipeline in the request, after the close commits; its failure
    is recorded on the round and the request answers normally."""
    from federation import pipeline

    def broken(round_id, attempt=None):
        raise RuntimeError("merge machinery broke")

    monkeypatch.setattr(pipeline, "start_round", broken)
    rnd = services.open_round(SYSTEM)
    api = person_api(world.operator)
    response = api.post(f"/api/v1/admin/rounds/{rnd.pk}/close/")
    assert response.status_code == 200
    rnd.refresh_from_db()
    assert rnd.state == Round.State.FAILED and "merge machinery broke" in rnd.failure_reason
    # a round with a submission to merge (one without is not retried) fails again at its start
    from compendium.schema import Compendium
    from compendium.services import store_compendium

    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client", round=rnd,
        client=world.client_a)
    retry = api.post(f"/api/v1/admin/rounds/{rnd.pk}/retry/")
    assert retry.status_code == 200 and retry.json()["state"] == Round.State.FAILED


NUL_API = [
    ("/api/v1/admin/audit/", "actor"),
    ("/api/v1/admin/audit/", "action"),
    ("/api/v1/admin/audit/", "organization"),
    ("/api/v1/admin/audit/", "target_type"),
    ("/api/v1/admin/clients/", "status"),
    ("/api/v1/admin/clients/", "organization"),
    ("/api/v1/rounds/", "state"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("path, param", NUL_API)
def test_api_query_parameter_with_nul_is_400_naming_it(world, path, param):
    response = person_api(world.operator).get(path, {param: "a\x00b"})
    assert response.status_code == 400
    assert response.json()["detail"] == f"query parameter {param!r} must not contain NUL characters"


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["since", "until"])
@pytest.mark.parametrize(
    "value",
    ["bad", "2025-13-01", "2025-01-01T25:00:00", "0001-01-01T00:00:00+01:00",
     "9999-12-31T23:59:59-01:00", "2025-01-01T00:00:00+25:00", HUGE],
)
def test_api_audit_period_that_is_no_date_is_400_naming_it(world, name, value):
    response = person_api(world.operator).get("/api/v1/admin/audit/", {name: value})
    assert response.status_code == 400
    assert response.json() == {
        "detail": f"{name} must be a date YYYY-MM-DD or an ISO 8601 datetime "
        f"(e.g. 2025-01-31T08:00:00Z), not {value[:40]!r}"
    }


@pytest.mark.django_db
@pytest.mark.parametrize("name, value", [("since", "0001-01-01"), ("until", "9999-12-31")])
def test_api_audit_period_at_the_ends_of_the_calendar_is_not_an_error(world, name, value):
    response = person_api(world.operator).get("/api/v1/admin/audit/", {name: value})
    assert response.status_code == 200 and response.json()["count"] > 0


@pytest.mark.django_db
@pytest.mark.parametrize("number", ["²", "١", "0", "-1", HUGE])
def test_audit_round_that_is_no_round_number_is_400_on_the_api_and_the_dashboard(
    client, world, number
):
    """The audit log's ?round= was read with str.isdigit, which takes "²" and "١" that int()
    refuses: a 500 on the API and the dashboard alike. It is read as every other ?round= is."""
    response = person_api(world.operator).get("/api/v1/admin/audit/", {"round": number})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("round must be a round number")
    page = operator_page(client, world).get(reverse("dashboard:audit"), {"round": number})
    assert page.status_code == 400 and "round must be a round number" in html_text(page)


@pytest.mark.django_db
def test_empty_submission_is_400_and_replaces_nothing(world):
    services.open_round(SYSTEM)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    for n, body in enumerate(["{}", '{"metadata": [], "annex": []}', '{"num_users": 1}']):
        response = api.post("/api/v1/submissions/", body, content_type="application/json",
                            HTTP_IDEMPOTENCY_KEY=f"k{n}")
        assert response.status_code == 400 and response.json()["code"] == "empty_compendium"
    assert not CompendiumVersion.objects.filter(kind="client").exists()


@pytest.mark.django_db
def test_idempotency_key_with_nul_is_400(world):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    response = api.post("/api/v1/submissions/", "{}", content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="k\x00")
    assert response.status_code == 400 and "Idempotency-Key" in response.json()["detail"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "page, param",
    [("dashboard:audit", "actor"), ("dashboard:tools", "q"), ("dashboard:tools", "category"),
     ("dashboard:conflicts", "organization"), ("dashboard:compendium", "q"),
     ("dashboard:routing", "q")],
)
def test_dashboard_query_parameter_with_nul_is_400_naming_it(client, world, page, param):
    response = operator_page(client, world).get(reverse(page), {param: "a\x00b"})
    assert response.status_code == 400
    assert f"query parameter {param!r} must not contain NUL characters" in html_text(response)


def html_text(response) -> str:
    return html.unescape(response.content.decode())


@pytest.mark.django_db
def test_dashboard_forms_with_nul_are_400_and_change_nothing(client, world):
    rnd = Round.objects.create(number=1, state=Round.State.PUBLISHED)
    conflict = ConflictLogEntry.objects.create(
        round=rnd, organization=world.org_a, tool_id="weather", centroid_id="c0",
        centroid={"text": "Will it rain?"}, dissenters=[], reason="preconditions disagree",
    )
    operator_page(client, world)
    clients_before = world.org_a.clients.count()
    posts = [
        (reverse("dashboard:client-enroll", args=["org-a"]), {"name": "a\x00b"}, "name"),
        (reverse("dashboard:client-action", args=["org-a", world.client_a.pk, "revoke"]),
         {"reason": "gone\x00"}, "reason"),
        (reverse("dashboard:conflict-decide", args=[conflict.pk]),
         {"action": "edit", "text": "Use it\x00 carefully"}, "text"),
    ]
    for url, data, field in posts:
        response = client.post(url, data)
        assert response.status_code == 400, url
        assert f"form field {field!r} must not contain NUL characters" in html_text(response)
    world.client_a.refresh_from_db()
    assert world.client_a.status == "approved"
    assert world.org_a.clients.count() == clients_before
    assert not ConflictDecision.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/rounds/", "/api/v1/admin/clients/", "/api/v1/admin/audit/"])
def test_api_list_with_a_huge_limit_is_capped(world, path):
    services.open_round(SYSTEM)  # a row in each list (an empty list is answered without a query)
    api = person_api(world.operator)
    response = api.get(path, {"limit": "99999999999999999999"})
    assert response.status_code == 200
    assert api.get(path, {"limit": HUGE, "offset": "99999999999999999999"}).status_code == 200


@pytest.mark.django_db
def test_organization_with_a_long_name_gets_a_slug_that_fits(world):
    api = person_api(world.operator)
    response = api.post("/api/v1/admin/organizations/", {"name": "a" * 150}, format="json")
    assert response.status_code == 201, response.content
    slug_limit = Organization._meta.get_field("slug").max_length
    assert response.json()["slug"] == "a" * slug_limit
    # Another long name with the same first 100 characters: its slug clashes, a 409 naming it.
    clash = api.post("/api/v1/admin/organizations/", {"name": "a" * 150 + "b"}, format="json")
    assert clash.status_code == 409 and "slug" in clash.json()["detail"]


@pytest.mark.django_db
def test_organization_named_without_latin_letters_is_asked_for_a_slug(world):
    api = person_api(world.operator)
    response = api.post("/api/v1/admin/organizations/", {"name": "東京医療"}, format="json")
    assert response.status_code == 400
    assert "has no Latin letters or digits to make a slug from" in response.json()["detail"]
    assert not Organization.objects.filter(name="東京医療").exists()
    named = api.post(
        "/api/v1/admin/organizations/", {"name": "東京医療", "slug": "tokyo-medical"}, format="json"
    )
    assert named.status_code == 201 and named.json()["slug"] == "tokyo-medical"


DEEP_JSON = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "method, path",
    [("post", "/api/v1/route/"), ("post", "/api/v1/route/batch/"), ("post", "/api/v1/admin/clients/"),
     ("post", "/api/v1/admin/rounds/"), ("patch", "/api/v1/admin/settings/"),
     ("post", "/api/v1/admin/organizations/")],
)
def test_json_body_nested_too_deeply_is_400_naming_it(world, method, path):
    """Python's JSON parser gives up on deep nesting with a RecursionError; the API says so."""
    api = person_api(world.operator)
    response = getattr(api, method)(path, DEEP_JSON, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["detail"].endswith("JSON parse error - the body nests too deeply")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query, named",
    [({"limit": "true"}, "limit must be an integer"), ({"limit": "0"}, "limit must be at least 1"),
     ({"offset": "-5"}, "offset must be at least 0"), ({"offset": "null"}, "offset must be an integer"),
     # int() reads these as whole numbers; the README says a whole number
     ({"limit": "+5"}, "limit must be an integer"), ({"limit": "1_0"}, "limit must be an integer"),
     ({"offset": " 5"}, "offset must be an integer"), ({"limit": "５"}, "limit must be an integer")],
)
def test_api_list_refuses_a_page_it_cannot_read(world, query, named):
    """DRF's pagination ignores a limit or offset it cannot read and answers the first page, which
    a caller paging through a list would take for the page it asked for."""
    services.open_round(SYSTEM)
    response = person_api(world.operator).get("/api/v1/rounds/", query)
    assert response.status_code == 400 and named in response.json()["detail"]
    assert person_api(world.operator).get("/api/v1/rounds/", {"limit": ""}).status_code == 200


# --- the submission path under races and oversized documents ------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("header", ["\xa0", "\x85", " \xa0 "])
def test_an_authorization_header_of_unicode_spaces_is_no_credential_not_a_500(world, header):
    """Python's str.split() takes U+00A0 and U+0085 for white space; a server passes such bytes
    through (decoded as Latin-1), and the header then splits into nothing."""
    response = APIClient().get("/api/v1/rounds/", HTTP_AUTHORIZATION=header)
    assert response.status_code in (401, 403)


@pytest.mark.django_db
def test_a_chunked_submission_without_content_length_is_411(world, valid_doc):
    services.open_round(SYSTEM)
    from django.test import RequestFactory

    from federation.api.views import SubmissionView

    request = RequestFactory().post(
        "/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {world.token_a}", HTTP_IDEMPOTENCY_KEY="chunked",
    )
    del request.META["CONTENT_LENGTH"]  # as a chunked body arrives
    request.META["HTTP_TRANSFER_ENCODING"] = "chunked"
    response = SubmissionView.as_view()(request)
    assert response.status_code == 411 and "Content-Length" in response.data["detail"]
    assert not CompendiumVersion.objects.filter(kind="client").exists()


def _once_checked(monkeypatch, then):
    """The next submission's body is checked, then `then()` runs before its claim (as another
    request would commit meanwhile); later submissions are checked as usual."""
    import federation.submissions as submissions

    check = submissions.validate_compendium

    def check_then(body, schema):
        result = check(body, schema)
        monkeypatch.setattr(submissions, "validate_compendium", check)
        then()
        return result

    monkeypatch.setattr(submissions, "validate_compendium", check_then)


@pytest.mark.django_db
def test_a_round_that_changes_while_a_submission_is_checked_stores_nothing(world, valid_doc, monkeypatch,
                                                                          without_merge_pipeline):
    """The body was checked against round 1 (its λ, its schema); round 1 closes and round 2 opens
    before the claim: 409 `round_changed`, nothing stored, and a resubmission goes to round 2."""

    first = services.open_round(SYSTEM)

    def switch_rounds():
        services.close_round(SYSTEM, first)
        services.open_round(SYSTEM)

    _once_checked(monkeypatch, switch_rounds)
    api = client_api(world.token_a)
    response = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="k1")
    assert response.status_code == 409 and response.json()["code"] == "round_changed"
    assert "round 1" in response.json()["detail"] and "round 2 is open" in response.json()["detail"]
    assert not CompendiumVersion.objects.filter(kind="client").exists()
    again = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                     HTTP_IDEMPOTENCY_KEY="k2")
    assert again.status_code == 201 and again.json()["round"] == 2


@pytest.mark.django_db
def test_a_schema_that_changes_while_a_submission_is_checked_stores_nothing(world, valid_doc, monkeypatch,
                                                                           without_merge_pipeline):
    """The body was checked against the schema of the look-ahead; a numeric field changes (as a
    tool deactivated in the admin would) before the claim: 409 `schema_changed`, nothing
    stored, and the same body sent again is checked against the new schema and stored."""
    from compendium.models import NumericField

    services.open_round(SYSTEM)

    def change_the_schema():
        field = NumericField.objects.order_by("name").first()
        field.sensitivity *= 2
        field.save()

    _once_checked(monkeypatch, change_the_schema)
    api = client_api(world.token_a)
    response = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="k1")
    assert response.status_code == 409 and response.json()["code"] == "schema_changed"
    assert "nothing was stored" in response.json()["detail"]
    assert not CompendiumVersion.objects.filter(kind="client").exists()
    again = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                     HTTP_IDEMPOTENCY_KEY="k1")
    assert again.status_code == 201, again.content


@pytest.mark.django_db
def test_a_client_revoked_while_its_submission_is_checked_stores_nothing(world, valid_doc, monkeypatch):
    import federation.submissions as submissions

    services.open_round(SYSTEM)
    api = client_api(world.token_a)
    earlier = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                       HTTP_IDEMPOTENCY_KEY="k1")
    assert earlier.status_code == 201
    check = submissions.validate_compendium

    def validate_then_revoke(body, schema):
        services.revoke_client(SYSTEM, world.client_a, "revoked under the submission, for the test")
        return check(body, schema)

    monkeypatch.setattr(submissions, "validate_compendium", validate_then_revoke)
    doc = json.loads(json.dumps(valid_doc))
    doc["scenarios"][0]["text"] = "Will it snow tomorrow in a city?"
    response = api.post("/api/v1/submissions/", json.dumps(doc), content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="k2")
    assert response.status_code == 403 and "revoked" in response.json()["detail"]
    # The earlier submission stays as it was: nothing replaced, nothing half-written.
    kept = CompendiumVersion.objects.get(kind="client")
    assert kept.pk == earlier.json()["version"]
    assert Submission.objects.filter(client=world.client_a).count() == 1


@pytest.mark.django_db
def test_a_token_rotated_while_its_submission_is_checked_stores_nothing(world, valid_doc, monkeypatch):
    """A rotation is what an admin does when a token leaked: a submission the old token sent just
    before it, stored once the rotation committed, would let the leaked token replace the client's
    compendium after it was meant to stop. 403, nothing stored; the new token submits."""
    services.open_round(SYSTEM)
    api = client_api(world.token_a)
    earlier = api.post("/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
                       HTTP_IDEMPOTENCY_KEY="k1")
    assert earlier.status_code == 201
    rotated = {}
    _once_checked(monkeypatch, lambda: rotated.update(token=services.rotate_client_token(
        SYSTEM, world.client_a).token))
    doc = json.loads(json.dumps(valid_doc))
    doc["scenarios"][0]["text"] = "Will it snow tomorrow in a city?"
    response = api.post("/api/v1/submissions/", json.dumps(doc), content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="k2")
    assert response.status_code == 403, response.content
    assert "rotated" in response.json()["detail"] and "nothing was stored" in response.json()["detail"]
    kept = CompendiumVersion.objects.get(kind="client")
    assert kept.pk == earlier.json()["version"]
    assert Submission.objects.filter(client=world.client_a).count() == 1
    again = client_api(rotated["token"]).post(
        "/api/v1/submissions/", json.dumps(doc), content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k2")
    assert again.status_code == 201 and again.json()["replaced"] is True


def test_a_collection_over_its_limit_is_refused_before_its_entries_are_checked(small_schema):
    cap = small_schema.limits.scenarios
    result = validate_compendium({"scenarios": [0] * (cap + 1), "annex": [0] * 3}, small_schema)
    assert [str(v) for v in result.violations] == [
        f"$.scenarios: {cap + 1} entries; the limit is {cap} per compendium"
    ]


def test_many_violations_are_listed_up_to_a_bound_and_counted(small_schema):
    from compendium.validation import MAX_REPORTED_VIOLATIONS

    result = validate_compendium({"scenarios": [0] * 1000}, small_schema)
    assert len(result.violations) == MAX_REPORTED_VIOLATIONS + 1
    assert str(result.violations[-1]) == (
        f"$: {1000 - MAX_REPORTED_VIOLATIONS} more violation(s) not listed; fix those above and "
        "validate again"
    )


@pytest.mark.parametrize("count", [10**6 + 1, 10**400])
def test_a_support_or_user_count_over_the_limit_is_a_violation(small_schema, count):
    doc = {
        "scenarios": [{"tool_id": "weather", "text": "Will it rain?", "support": count}],
        "precautions": [{"tool_id": "weather", "text": "Not for tides", "support": count}],
        "num_users": count,
    }
    result = validate_compendium(json.dumps(doc).encode(), small_schema)
    paths = {v.path for v in result.violations}
    assert {"$.scenarios[0].support", "$.precautions[0].support", "$.num_users"} <= paths
    assert all("exceeds the limit of 1000000" in v.reason for v in result.violations
               if v.path.endswith(("support", "num_users")))
    doc["scenarios"][0]["support"] = doc["precautions"][0]["support"] = doc["num_users"] = 10**6
    assert validate_compendium(doc, small_schema).ok


# --- JSON bodies the parser must refuse, and fields a request cannot set -------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "method, path, body, named",
    [
        # an unknown field's name, echoed in the refusal: was a UnicodeEncodeError (500) rendering it
        ("post", "/api/v1/admin/organizations/", '{"name": "Org C", "\\ud800": 1}',
         "$ has a key holding a lone surrogate U+D800"),
        # a choice echoed in DRF's "is not a valid choice": the same 500
        ("post", "/api/v1/admin/people/", '{"username": "carol", "organization": "org-a", '
         '"role": "\\udfff"}', "$.role holds a lone surrogate U+DFFF"),
        ("patch", "/api/v1/admin/people/{member}/", '{"role": "admin\\ud800"}',
         "$.role holds a lone surrogate U+D800"),
        ("post", "/api/v1/admin/rounds/", '{"summarizer": "\\udfff"}',
         "$.summarizer holds a lone surrogate U+DFFF"),
        ("post", "/api/v1/admin/rounds/", '{"robust_rule": "krum", "global_metadata": "\\ud83d"}',
         "$.global_metadata holds a lone surrogate U+D83D"),
        ("post", "/api/v1/route/batch/", '{"queries": ["rain", {"x": ["\\udc00"]}]}',
         "$.queries[1].x[0] holds a lone surrogate U+DC00"),
    ],
)
def test_a_json_body_holding_a_lone_surrogate_is_400_naming_where(world, method, path, body,
                                                                   named):
    """JSON can escape half of a character ("\\ud800"), which is no text: wherever it is in a
    body the API reads, the answer is a 400 naming where, and nothing is done."""
    api = person_api(world.operator)
    path = path.format(member=world.member_a.pk)
    response = getattr(api, method)(path, body, content_type="application/json")
    assert response.status_code == 400, response.content
    assert named in response.json()["detail"]
    assert "half of an escaped character" in response.json()["detail"]
    assert not Organization.objects.filter(name="Org C").exists()
    assert not Round.objects.exists()
    assert world.member_a.membership.role == "member"
    assert world.org_a.memberships.count() == 2


@pytest.mark.django_db
def test_a_json_body_with_a_byte_order_mark_first_is_read_as_its_file_shows(world):
    """A body a Windows tool saved (a UTF-8 byte order mark first, sent with curl --data-binary
    @file) was a 400, "Unexpected UTF-8 BOM", on every endpoint but submissions; RFC 8259 lets a
    parser ignore it. A mark after the first character is still not JSON."""
    api = person_api(world.operator)
    created = api.post("/api/v1/admin/organizations/", '\ufeff{"name": "Org C"}'.encode(),
                       content_type="application/json")
    assert created.status_code == 201, created.content
    inside = api.post("/api/v1/admin/organizations/", ' \ufeff{"name": "Org D"}'.encode(),
                      content_type="application/json")
    assert inside.status_code == 400 and "JSON parse error" in inside.json()["detail"]
    assert list(Organization.objects.filter(name__startswith="Org ").values_list("name", flat=True)
                .order_by("name")) == ["Org A", "Org B", "Org C"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "method, path, body, key",
    [
        ("post", "/api/v1/admin/rounds/", '{"epsilon": 1, "epsilon": 1000}', "epsilon"),
        ("patch", "/api/v1/admin/settings/", '{"epsilon_budget": 5, "epsilon_budget": 50}',
         "epsilon_budget"),
        ("post", "/api/v1/admin/organizations/", '{"name": "Org C", "name": "Org D"}', "name"),
        ("post", "/api/v1/route/", '{"query": "rain", "top_k": 3, "top_k": 4}', "top_k"),
        ("patch", "/api/v1/admin/people/{member}/", '{"x": {"role": 1, "role": 2}}', "role"),
    ],
)
def test_a_json_body_with_a_key_twice_is_400_naming_it(world, method, path, body, key):
    """Parsers disagree on which of two equal keys counts (Python's the last, others the first):
    as a compendium's body already is, a body with a key twice is refused, not read one way."""
    api = person_api(world.operator)
    budget = services.get_settings().epsilon_budget
    path = path.format(member=world.member_a.pk)
    response = getattr(api, method)(path, body, content_type="application/json")
    assert response.status_code == 400, response.content
    assert f'duplicate key "{key}" in one object' in response.json()["detail"]
    assert not Round.objects.exists()
    assert not Organization.objects.filter(name__in=["Org C", "Org D"]).exists()
    services.clear_settings_cache()
    assert services.get_settings().epsilon_budget == budget


@pytest.mark.django_db
def test_a_body_that_sets_a_read_only_field_is_400_naming_it(world):
    """An organization's `id` and `created_at`, the settings' `updated_at`: the server sets them.
    A body naming them was answered 2xx with them ignored (a client that sent `created_at` took
    it for stored); as an unknown field is, such a body is a 400 naming them, nothing done."""
    api = person_api(world.operator)
    created = api.post(
        "/api/v1/admin/organizations/",
        {"name": "Org C", "id": 999, "created_at": "2020-01-01T00:00:00Z"}, format="json",
    )
    assert created.status_code == 400, created.content
    assert created.json()["detail"] == (
        "this request takes name, slug, description; read-only field(s), set by the server: "
        "created_at, id"
    )
    assert not Organization.objects.filter(name="Org C").exists()
    budget = services.get_settings().epsilon_budget
    changed = api.patch(
        "/api/v1/admin/settings/", {"epsilon_budget": budget + 1, "updated_at": "2020-01-01"},
        format="json",
    )
    assert changed.status_code == 400, changed.content
    assert changed.json()["detail"].endswith("read-only field(s), set by the server: updated_at")
    services.clear_settings_cache()
    assert services.get_settings().epsilon_budget == budget
    # with an unknown field as well: both named, in one answer
    both = api.post("/api/v1/admin/organizations/", {"name": "Org C", "id": 1, "colour": "red"},
                    format="json")
    assert both.status_code == 400
    assert both.json()["detail"] == (
        "this request takes name, slug, description; unknown field(s): colour; read-only "
        "field(s), set by the server: id"
    )
    # the same bodies without them still work
    assert api.post("/api/v1/admin/organizations/", {"name": "Org C"}, format="json").status_code == 201
    assert api.patch("/api/v1/admin/settings/", {"epsilon_budget": budget + 1},
                     format="json").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("kind", ["form", "multipart", "files"])
def test_a_form_body_with_more_fields_than_the_server_reads_is_a_json_400_naming_the_limit(
    world, settings, debug, kind
):
    """A form or multipart body past DATA_UPLOAD_MAX_NUMBER_FIELDS or _FILES (Django's
    TooManyFieldsSent, TooManyFilesSent) was `{"detail": "bad request"}` with DEBUG off and
    Django's HTML debug page with DEBUG on, where every other error under /api/ is JSON naming
    what is wrong; nothing is created."""
    settings.DEBUG = debug
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = settings.DATA_UPLOAD_MAX_NUMBER_FILES = 50
    api = person_api(world.operator)
    api.raise_request_exception = False
    names = ["name"] + [f"f{i}" for i in range(60)]
    file = '; filename="a.txt"' if kind == "files" else ""
    if kind == "form":
        body, content_type = "&".join(f"{n}=x" for n in names), "application/x-www-form-urlencoded"
    else:
        body = "".join(f'--b\r\nContent-Disposition: form-data; name="{n}"{file}\r\n\r\nx\r\n'
                       for n in names) + "--b--\r\n"
        content_type = "multipart/form-data; boundary=b"
    response = api.post("/api/v1/admin/organizations/", body, content_type=content_type)
    assert response.status_code == 400
    assert response["Content-Type"].startswith("application/json")
    what = "files" if kind == "files" else "fields"
    assert response.json() == {
        "detail": f"the request body has more than 50 {what}, the server's limit for one request"
    }
    assert not Organization.objects.filter(name="x").exists()
