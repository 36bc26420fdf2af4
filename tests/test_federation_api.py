"""The REST API on the real database: submissions, rounds, schema, global compendium, and the
organization-scoped administration (every endpoint against every role)."""

from __future__ import annotations

import datetime as dt
import gzip
import json

import numpy as np
import pytest
from django.test import Client as BrowserClient
from django.test import RequestFactory, override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from compendium import transport
from compendium.canonical import canonical_bytes
from compendium.models import CompendiumVersion, ScenarioEntry, Tool
from compendium.schema import Compendium, Schema
from compendium.services import store_compendium
from federation import services, submissions
from federation.models import AuditLog, Client, Organization, ProbeQuery, Round, Submission
from routing.router import LinearHead
from synapse_web.middleware import server_error
from tests.federation_fixtures import SYSTEM, client_api

pytestmark = pytest.mark.django_db

SUBMIT = "/api/v1/submissions/"


def person_api(user) -> APIClient:
    return client_api(services.issue_user_token(SYSTEM, user))


def post_doc(api, doc, key="k1", **extra):
    body = doc if isinstance(doc, bytes | str) else json.dumps(doc)
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return api.post(SUBMIT, body, content_type="application/json", **headers, **extra)


@pytest.fixture
def open_round(world):
    return services.open_round(SYSTEM)


# --- submissions -------------------------------------------------------------------------------


def test_submission_is_stored_and_replayed_with_same_key(world, open_round, valid_doc):
    api = client_api(world.token_a)
    first = post_doc(api, valid_doc, key="abc")
    assert first.status_code == 201, first.content
    body = first.json()
    assert set(body) >= {"id", "round", "client", "sha256", "size_bytes", "gzip_bytes", "entry_counts"}
    assert body["round"] == 1 and body["client"] == world.client_a.pk
    assert body["entry_counts"]["scenarios"] == 2
    version = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert version.sha256 == body["sha256"] and version.round == open_round

    again = post_doc(api, valid_doc, key="abc")
    assert again.status_code == 201
    assert again.json() == body
    assert again["Idempotent-Replayed"] == "true"
    assert Submission.objects.count() == 1
    assert CompendiumVersion.objects.filter(kind="client").count() == 1


def test_a_body_saved_with_a_byte_order_mark_is_read_as_the_file_shows(world, open_round, valid_doc):
    """`curl --data-binary @compendium.json` of a file Notepad or PowerShell 5 saved (a UTF-8 byte
    order mark first) was a 400, "not valid JSON: Unexpected UTF-8 BOM", though `synapse-client`
    reads such files; RFC 8259 lets a parser ignore the mark. Stored as the same compendium as the
    file without it; a mark anywhere else is still refused."""
    api = client_api(world.token_a)
    plain = json.dumps(valid_doc).encode()
    marked = post_doc(api, b"\xef\xbb\xbf" + plain, key="bom")
    assert marked.status_code == 201, marked.content
    assert marked.json()["sha256"] == post_doc(api, plain, key="plain").json()["sha256"]
    inside = post_doc(api, b" \xef\xbb\xbf" + plain, key="inside")
    assert inside.status_code == 400 and "not valid JSON" in inside.json()["violations"][0]["reason"]


def test_an_erasure_leaves_no_submission_record_to_list_or_replay(world, open_round, valid_doc):
    """`erase_client` deleted the client's compendiums but kept its Submission rows: the
    request's sha256, its sizes and the stored answer stayed listed (GET /api/v1/submissions/,
    round_status, the admin, /metrics), and a replay of its Idempotency-Key answered the stored
    201, naming a compendium that no longer exists. The rows go with the erasure, counted in its
    report and audit entry; a later request under that key is a new submission."""
    from federation import pipeline

    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="first").status_code == 201
    changed = dict(valid_doc, scenarios=valid_doc["scenarios"][:1])
    assert post_doc(api, changed, key="second").status_code == 201  # replaces the first
    assert post_doc(client_api(world.token_b), valid_doc, key="first").status_code == 201
    report = pipeline.erase_client(world.client_a)
    # the key again, the round still open and the client still enrolled: sent again, stored anew
    again = post_doc(api, changed, key="second")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert CompendiumVersion.objects.filter(pk=again.json()["version"], kind="client",
                                            client=world.client_a).exists()
    # after a later erasure and the round's close: no round takes it, nothing answered as stored
    pipeline.erase_client(world.client_a)
    assert not Submission.objects.filter(client=world.client_a).exists()
    assert Submission.objects.filter(client=world.client_b).count() == 1
    assert api.get(SUBMIT).json()["results"] == []
    assert (report.submissions_removed, report.submission_records_removed) == (1, 2)
    erasures = AuditLog.objects.filter(action="client.erase").order_by("id")
    assert [e.details["submission_records_removed"] for e in erasures] == [2, 1]
    services.close_round(SYSTEM, open_round)
    closed = post_doc(api, changed, key="second")
    assert closed.status_code == 409 and "Idempotent-Replayed" not in closed
    assert not Submission.objects.filter(client=world.client_a).exists()


def test_a_client_lists_its_own_submissions(world, open_round, valid_doc):
    api = client_api(world.token_a)
    first = post_doc(api, valid_doc, key="first").json()
    changed = dict(valid_doc, scenarios=valid_doc["scenarios"][:1])
    second = post_doc(api, changed, key="second").json()
    assert post_doc(client_api(world.token_b), valid_doc, key="b").status_code == 201
    rows = api.get(SUBMIT).json()["results"]
    assert [r["idempotency_key"] for r in rows] == ["second", "first"]  # its own, newest first
    assert [r["in_effect"] for r in rows] == [True, False]  # the second replaced the first
    assert rows[0]["sha256"] == second["sha256"] and rows[1]["sha256"] == first["sha256"]
    assert rows[0]["round"] == 1 and rows[0]["round_state"] == "open"
    assert rows[0]["entry_counts"]["scenarios"] == 1 and rows[0]["size_bytes"] == second["size_bytes"]
    assert api.get(SUBMIT + "?round=2").json()["results"] == []
    assert len(api.get(SUBMIT + "?round=1").json()["results"]) == 2
    bad = api.get(SUBMIT + "?round=one")
    assert bad.status_code == 400 and "round" in bad.json()["detail"]
    person = person_api(world.admin_a).get(SUBMIT)
    assert person.status_code == 403 and "own submissions" in person.json()["detail"]
    assert client_api().get(SUBMIT).status_code == 401


def test_token_scheme_is_also_accepted(world, open_round, valid_doc):
    assert post_doc(client_api(world.token_a, "Token"), valid_doc).status_code == 201


def test_same_key_with_other_body_is_refused(world, open_round, valid_doc):
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="abc").status_code == 201
    valid_doc["scenarios"].pop()
    response = post_doc(api, valid_doc, key="abc")
    assert response.status_code == 422
    assert "different body" in response.json()["detail"]


def test_new_key_replaces_earlier_submission_of_the_round(world, open_round, valid_doc):
    api = client_api(world.token_a)
    first = post_doc(api, valid_doc, key="one").json()
    valid_doc["scenarios"].pop()
    second = post_doc(api, valid_doc, key="two")
    assert second.status_code == 201 and second.json()["replaced"] is True
    versions = CompendiumVersion.objects.filter(kind="client", client=world.client_a)
    assert versions.count() == 1
    assert versions.get().sha256 == second.json()["sha256"] != first["sha256"]
    assert not CompendiumVersion.objects.filter(pk=first["version"]).exists()
    assert Submission.objects.get(pk=first["id"]).version is None
    assert len(versions.get().content["scenarios"]) == 1
    # Client submissions keep only their canonical content: no per-entry rows to write.
    assert not ScenarioEntry.objects.filter(version__client=world.client_a).exists()
    # The second key's replay is its own answer; nothing new is stored.
    replay = post_doc(api, valid_doc, key="two")
    assert replay.json() == second.json() and replay["Idempotent-Replayed"] == "true"
    assert Submission.objects.filter(client=world.client_a).count() == 2


def test_a_replaced_submissions_key_is_refused_not_replayed(world, open_round, valid_doc):
    """A, then B (replaces A), then A again under A's key: replaying A's 201 would tell the client
    that A is in effect while B is. The server answers 409 `replaced` and stores nothing; a new
    key puts A back in effect. Once the round takes no more submissions, A's first key is still
    refused (a later key holds A in effect), and the key in effect replays."""
    api = client_api(world.token_a)
    first = post_doc(api, valid_doc, key="a")
    other = dict(valid_doc, scenarios=valid_doc["scenarios"][:1])
    second = post_doc(api, other, key="b")
    assert first.status_code == second.status_code == 201
    again = post_doc(api, valid_doc, key="a")
    assert again.status_code == 409 and again.json()["code"] == "replaced"
    assert "new Idempotency-Key" in again.json()["detail"]
    assert "Idempotent-Replayed" not in again
    in_effect = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert in_effect.sha256 == second.json()["sha256"]
    # the same key with another body is still a misuse of the key
    assert post_doc(api, other, key="a").status_code == 422
    # B's key replays: B is in effect
    assert post_doc(api, other, key="b")["Idempotent-Replayed"] == "true"
    back = post_doc(api, valid_doc, key="a-2")
    assert back.status_code == 201 and back.json()["replaced"] is True
    assert CompendiumVersion.objects.get(kind="client", client=world.client_a).sha256 == (
        first.json()["sha256"])
    # a round that takes no more submissions: the key in effect replays; A's first key is
    # refused, saying that the same compendium is in effect under a later key
    Round.objects.filter(pk=open_round.pk).update(state=Round.State.CLOSING)
    late = post_doc(api, valid_doc, key="a")
    assert late.status_code == 409 and late.json()["code"] == "replaced"
    assert "same compendium" in late.json()["detail"]
    assert "new Idempotency-Key" not in late.json()["detail"]
    assert post_doc(api, valid_doc, key="a-2")["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("stop", ["deadline", "closing", "published"])
def test_a_replaced_key_is_refused_once_the_round_takes_no_more_submissions(
    world, open_round, valid_doc, stop
):
    """A (key a), then B (key b), then the round stops taking submissions (past its deadline,
    still open; closing; published): A's key must not replay A's 201, which would tell the client
    A is in effect while B is what the merge reads. 409 `replaced`, saying B is in effect and
    that nothing can put A back now (no advice to submit under a new key); B's key replays."""
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="a").status_code == 201
    other = dict(valid_doc, scenarios=valid_doc["scenarios"][:1])
    second = post_doc(api, other, key="b")
    assert second.status_code == 201
    if stop == "deadline":
        Round.objects.filter(pk=open_round.pk).update(
            closes_at=timezone.now() - dt.timedelta(minutes=1))
    else:
        Round.objects.filter(pk=open_round.pk).update(state=stop)
    again = post_doc(api, valid_doc, key="a")
    assert again.status_code == 409, again.content
    assert again.json()["code"] == "replaced" and "Idempotent-Replayed" not in again
    detail = again.json()["detail"]
    assert "later submission" in detail and "in effect" in detail
    assert "no longer takes submissions" in detail and "nothing can put it back" in detail
    assert "new Idempotency-Key" not in detail
    assert Submission.objects.filter(client=world.client_a).count() == 2
    assert CompendiumVersion.objects.get(kind="client", client=world.client_a).sha256 == (
        second.json()["sha256"])
    # the key whose submission is in effect replays as before; a misused key is still a 422
    replay = post_doc(api, other, key="b")
    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    assert post_doc(api, other, key="a").status_code == 422


def test_a_submission_for_another_round_than_the_open_one_is_refused(world, open_round, valid_doc):
    """`X-Synapse-Round` names the round the client checked its body for: a retry that lands
    after that round closed and another opened stores nothing (409 round_changed)."""
    api = client_api(world.token_a)
    stale = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND="7")
    assert stale.status_code == 409 and stale.json()["code"] == "round_changed"
    assert "round 7" in stale.json()["detail"] and "round 1 is open" in stale.json()["detail"]
    assert not Submission.objects.exists()
    bad = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND="one")
    assert bad.status_code == 400 and "X-Synapse-Round" in bad.json()["detail"]
    ok = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND="1")
    assert ok.status_code == 201 and ok.json()["round"] == 1
    # round 1 published, round 2 open: the key's stored answer (of round 1) is replayed, a new
    # key checked for round 1 is refused
    Round.objects.filter(pk=open_round.pk).update(state=Round.State.PUBLISHED)
    services.open_round(SYSTEM)
    replay = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND="1")
    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    late = post_doc(api, valid_doc, key="r-late", HTTP_X_SYNAPSE_ROUND="1")
    assert late.status_code == 409 and late.json()["code"] == "round_changed"
    assert Submission.objects.count() == 1
    # the key of round 1's submission sent again for round 2, which is open: its 201 of round 1
    # was replayed, telling a client that keys on its body that it entered round 2 (422 now)
    reused = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND="2")
    assert reused.status_code == 422, reused.content
    assert "already used for the submission to round 1" in reused.json()["detail"]
    assert "round 2 (X-Synapse-Round)" in reused.json()["detail"]
    assert Submission.objects.count() == 1


def test_the_submission_headers_are_published_as_they_are_checked(world, open_round, valid_doc):
    """The OpenAPI document bounds X-Synapse-Round and Idempotency-Key as the endpoint does: a
    round number past MAX_ROUND_NUMBER and a key of spaces or of other than printable ASCII,
    which it refuses, are outside what it publishes."""
    import re

    from drf_spectacular.generators import SchemaGenerator

    document = SchemaGenerator().get_schema(request=None, public=True)
    headers = {p["name"]: p["schema"] for p in document["paths"][SUBMIT]["post"]["parameters"]}
    assert headers["X-Synapse-Round"]["maximum"] == services.MAX_ROUND_NUMBER
    pattern = re.compile(headers["Idempotency-Key"]["pattern"])
    api = client_api(world.token_a)
    past = post_doc(api, valid_doc, key="r", HTTP_X_SYNAPSE_ROUND=str(services.MAX_ROUND_NUMBER + 1))
    assert past.status_code == 400 and "X-Synapse-Round" in past.json()["detail"]
    for key in ("   ", "clé"):
        assert not pattern.search(key)
        assert post_doc(api, valid_doc, key=key).status_code == 400
    assert pattern.search("a b-1") and post_doc(api, valid_doc, key="a b-1").status_code == 201


def test_statistics_the_open_round_will_not_release_are_refused(world, open_round, valid_doc):
    """The world's rounds (two organizations of one approved client each) release no numeric
    field (each one's noise at least its clipping window): statistics for one would be dropped by
    the merge and kept un-noised until then, so they are refused, naming the fields, and nothing
    is stored."""
    assert open_round.fields_not_released == ["calls", "frequency", "latency_ms", "success_rate"]
    api = client_api(world.token_a)
    valid_doc["metadata"][0]["stats"].update({"success_rate": 0.9, "latency_ms": 320})
    refused = post_doc(api, valid_doc, key="s")
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "fields_not_released"
    assert "latency_ms, success_rate" in refused.json()["detail"]
    assert "--not-released latency_ms,success_rate" in refused.json()["detail"]
    assert not Submission.objects.exists() and not CompendiumVersion.objects.exists()
    # audited for the operator and the client's organization: a client built against another
    # configuration than the round's
    entry = AuditLog.objects.get(action="submission.policy")
    assert entry.organization == world.client_a.organization
    assert entry.details["code"] == "fields_not_released" and entry.details["round"] == 1
    metrics = BrowserClient()
    metrics.force_login(world.operator)
    exposition = metrics.get("/metrics").content.decode()
    slug = world.client_a.organization.slug
    assert f'synapse_submissions_refused_policy_total{{organization="{slug}"}} 1.0' in exposition
    del valid_doc["metadata"][0]["stats"]["success_rate"], valid_doc["metadata"][0]["stats"]["latency_ms"]
    assert post_doc(api, valid_doc, key="s").status_code == 201


def test_statistics_for_a_field_of_kind_other_are_refused(world, open_round, valid_doc):
    """No edge releases a declared field of kind `other` (no client derives it from a usage log;
    the round's fields_not_released names drowned fields only). A client that is not the toolkit
    sending a value for one had it stored and noised into the edge's release; it is refused now,
    as a field the round will not release, naming it and why, and nothing is stored. A field
    declared after the round opened is refused the same: the schema in force decides."""
    from compendium.models import NumericField

    NumericField.objects.create(name="error_budget", kind="other", min_value=0, max_value=1,
                                sensitivity=1)
    assert "error_budget" not in open_round.fields_not_released
    api = client_api(world.token_a)
    valid_doc["metadata"][0]["stats"]["error_budget"] = 0.9
    refused = post_doc(api, valid_doc, key="o")
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "fields_not_released"
    detail = refused.json()["detail"]
    assert "error_budget" in detail and "kind other" in detail and "--not-released" not in detail
    assert not Submission.objects.exists() and not CompendiumVersion.objects.exists()
    del valid_doc["metadata"][0]["stats"]["error_budget"]
    assert post_doc(api, valid_doc, key="o2").status_code == 201


@pytest.mark.parametrize("prepare", [True, False])
def test_submission_path_prepares_its_statements_unless_told_not_to(
    world, open_round, valid_doc, prepare
):
    """The hot path's statements are prepared on the server once a connection has run them five
    times (Django's `prepare_threshold` option, set unless SYNAPSE_DB_PREPARE=0); without it (a
    pooler in transaction mode) nothing is prepared and the same requests work. Either way the
    rows are the same: the canonical content, the response with the version's id, the replaced
    submissions without one."""
    from django.conf import settings
    from django.db import connection

    def prepared() -> set[str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            return {row[0] for row in cursor.fetchall()}

    assert settings.DATABASES["default"]["OPTIONS"]["prepare_threshold"] == 5
    connection.ensure_connection()
    threshold = connection.connection.prepare_threshold
    connection.connection.prepare_threshold = 5 if prepare else None
    try:
        before = prepared()
        api = client_api(world.token_a)
        answers = []
        for key in ("k1", "k2", "k3", "k4", "k5", "k6", "k6"):
            if key != "k6" or len(answers) == 5:
                valid_doc["scenarios"][0]["text"] = f"Will it rain tomorrow? (take {key[1:]})"
            answers.append(post_doc(api, valid_doc, key=key))
        after = prepared()
    finally:
        connection.connection.prepare_threshold = threshold
    assert [a.status_code for a in answers] == [201] * 7, answers[-1].content
    answers = [a.json() for a in answers]
    if prepare:
        assert any("INSERT INTO compendium_compendiumversion" in sql for sql in after), after
        assert any("FOR UPDATE" in sql for sql in after)
    else:
        assert after == before
    assert answers[6] == answers[5] and answers[5]["replaced"] is True
    version = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert version.pk == answers[5]["version"] and version.sha256 == answers[5]["sha256"]
    assert version.content == json.loads(canonical_bytes(Compendium.model_validate(valid_doc)))
    stored = Submission.objects.get(pk=answers[5]["id"])
    assert stored.version_id == version.pk and stored.response["version"] == version.pk
    assert {"id": stored.pk, **stored.response} == answers[5]
    earlier = Submission.objects.filter(pk__in=[a["id"] for a in answers[:5]])
    assert earlier.count() == 5 and not earlier.filter(version__isnull=False).exists()


def test_invalid_compendium_lists_every_violation_by_path(world, open_round, valid_doc):
    valid_doc["metadata"][0]["stats"]["calls"] = 5000
    valid_doc["scenarios"][1]["tool_id"] = "ghost"
    valid_doc["templates"][0]["unexpected"] = 1
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 400
    paths = {v["path"] for v in response.json()["violations"]}
    assert {"$.metadata[0].stats.calls", "$.scenarios[1].tool_id", "$.templates[0].unexpected"} <= paths
    assert "detail" in response.json()
    assert not Submission.objects.exists() and not CompendiumVersion.objects.exists()


@pytest.mark.parametrize(
    "body", [b"{not json", b"[]", b"\xff\xfe", b'{"a": NaN}', b"", b'{"scenarios": 1}']
)
def test_malformed_bodies_are_400_not_500(world, open_round, body):
    response = post_doc(client_api(world.token_a), body)
    assert response.status_code == 400
    assert response.json()["violations"]


# "é": WSGI hands header bytes over as Latin-1, so it was stored and listed back as "Ã©".
@pytest.mark.parametrize("key", [None, "", "x" * 201, "é", "r1-\u00e9t\u00e9", "k\x07"])
def test_idempotency_key_is_required_and_bounded(world, open_round, valid_doc, key):
    response = post_doc(client_api(world.token_a), valid_doc, key=key)
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["detail"]


def test_submission_authentication(world, open_round, valid_doc):
    assert post_doc(client_api(), valid_doc).status_code == 401
    assert post_doc(client_api("syn_c_not-a-token"), valid_doc).status_code == 401
    unknown = post_doc(client_api("garbage"), valid_doc)
    assert unknown.status_code == 401 and unknown.json()["detail"]
    # People may not submit, even the operator.
    person = post_doc(person_api(world.operator), valid_doc)
    assert person.status_code == 403
    assert person.json()["detail"].startswith("only clients may submit")
    services.revoke_client(SYSTEM, world.client_a)
    revoked = post_doc(client_api(world.token_a), valid_doc)
    assert revoked.status_code == 403 and "revoked" in revoked.json()["detail"]
    assert not Submission.objects.exists()


def test_a_logged_in_person_submitting_is_403_not_401(world, open_round, valid_doc):
    """A browser session (without a CSRF token: the answer is the same) is a person: 403 saying
    only clients submit, as for a person's token, not 401 "credentials were not provided"."""
    for user in (world.operator, world.member_a):
        browser = APIClient(enforce_csrf_checks=True)
        browser.force_login(user)
        response = post_doc(browser, valid_doc)
        assert response.status_code == 403, response.content
        assert response.json()["detail"] == (
            "only clients may submit: authenticate with a client's API token (syn_c_…); a "
            "person's session or token cannot submit a compendium"
        )
    assert not Submission.objects.exists()
    # Nobody at all is still 401, with the Bearer challenge.
    anonymous = post_doc(APIClient(enforce_csrf_checks=True), valid_doc)
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"] == 'Bearer realm="synapse"'


EMPTY_DOCS = [
    {},
    {"schema_version": "1.0", "metadata": [], "scenarios": [], "precautions": [], "templates": [],
     "annex": []},
    {"num_users": 3, "masking": {"strength": 1.0, "masked_fraction": 0.0}},
]


@pytest.mark.parametrize("empty", EMPTY_DOCS)
def test_a_compendium_without_entries_is_400_and_keeps_the_earlier_submission(
    world, open_round, valid_doc, empty
):
    api = client_api(world.token_a)
    first = post_doc(api, valid_doc, key="real")
    assert first.status_code == 201
    plain = post_doc(api, empty, key="empty")
    packed = post_doc(api, gzip.compress(json.dumps(empty).encode()), key="empty-gzip",
                      HTTP_CONTENT_ENCODING="gzip")
    for response in (plain, packed):
        assert response.status_code == 400, response.content
        assert response.json() == {
            "detail": "the compendium has no entries (metadata, scenarios, precautions, templates "
            "and annex are all empty): there is nothing to submit, and the client's earlier "
            "submission to this round, if any, is kept",
            "code": "empty_compendium",
        }
    version = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert version.sha256 == first.json()["sha256"] and version.round == open_round
    assert version.entry_counts == first.json()["entry_counts"]
    assert list(Submission.objects.values_list("idempotency_key", flat=True)) == ["real"]
    # A refused key is not stored: the same key with a real compendium is a new submission.
    retry = post_doc(api, valid_doc, key="empty")
    assert retry.status_code == 201 and retry.json()["replaced"] is True


def test_a_first_submission_without_entries_stores_nothing(world, open_round):
    response = post_doc(client_api(world.token_a), {})
    assert response.status_code == 400 and response.json()["code"] == "empty_compendium"
    assert not Submission.objects.exists()
    assert not CompendiumVersion.objects.filter(kind="client").exists()


def test_one_entry_is_enough_to_submit(world, open_round):
    doc = {"annex": [{"subject": "flights", "relation": "needs", "object": "airport code"}]}
    response = post_doc(client_api(world.token_a), doc)
    assert response.status_code == 201, response.content
    assert response.json()["entry_counts"]["annex"] == 1


@pytest.mark.usefixtures("every_field_released")  # one client an organization
def test_a_capped_round_refuses_statistics_whose_compendium_records_no_cap_or_a_larger_one(world):
    # The edge charges ε for 2·F* tools' fields per user: statistics built with no cap, or a
    # larger one, would be under-charged. The compendium says what it was built with.
    services.open_round(SYSTEM, {"field_cap": 2})
    api = client_api(world.token_a)
    doc = {
        "metadata": [{"tool_id": "weather", "stats": {"calls": 12.0}}],
        "scenarios": [{"tool_id": "weather", "text": "Will it rain tomorrow in a city?"}],
    }
    accepted = post_doc(api, {**doc, "field_cap": 2}, key="capped")
    assert accepted.status_code == 201, accepted.content
    for recorded, says in [
        (None, "records no field cap (built without one, or by tooling that does not record it)"),
        (3, "records field cap F* = 3"),
    ]:
        body = doc if recorded is None else {**doc, "field_cap": recorded}
        for response in (
            post_doc(api, body, key=f"over-{recorded}"),
            post_doc(api, gzip.compress(json.dumps(body).encode()), key=f"over-{recorded}-gzip",
                     HTTP_CONTENT_ENCODING="gzip"),
        ):
            assert response.status_code == 400, response.content
            assert response.json() == {
                "detail": f"round 1 caps each user's numeric statistics at F* = 2 tool(s), but "
                f"this compendium carries statistics and {says}: build it again with "
                "synapse-client build --field-cap 2 (or less) and submit; nothing was stored",
                "code": "field_cap_exceeded",
            }
    # nothing stored: the accepted submission is still the client's only one, unreplaced
    assert list(Submission.objects.values_list("idempotency_key", flat=True)) == ["capped"]
    refusals = AuditLog.objects.filter(action="submission.policy")
    assert refusals.count() == 4
    assert {e.details["code"] for e in refusals} == {"field_cap_exceeded"}
    version = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert version.sha256 == accepted.json()["sha256"] and version.content["field_cap"] == 2


@pytest.mark.usefixtures("every_field_released")  # one client an organization
def test_a_capped_round_takes_an_equal_or_smaller_cap_and_text_without_statistics(world):
    services.open_round(SYSTEM, {"field_cap": 2})
    api = client_api(world.token_a)
    scenarios = [{"tool_id": "weather", "text": "Will it rain tomorrow in a city?"}]
    stats = [{"tool_id": "weather", "stats": {"calls": 12.0}}]
    for key, doc in [
        ("equal", {"metadata": stats, "scenarios": scenarios, "field_cap": 2}),
        ("smaller", {"metadata": stats, "scenarios": scenarios, "field_cap": 1}),
        # F* bounds numeric statistics only: text, or metadata entries without statistics, pass
        # whatever the compendium records
        ("text", {"scenarios": scenarios}),
        ("no-stats", {"metadata": [{"tool_id": "weather"}], "scenarios": scenarios}),
        ("text-larger", {"scenarios": scenarios, "field_cap": 5}),
    ]:
        response = post_doc(api, doc, key=key)
        assert response.status_code == 201, (key, response.content)
    stored = CompendiumVersion.objects.get(kind="client", client=world.client_a)
    assert stored.content["field_cap"] == 5  # what the compendium records is kept as it is


@pytest.mark.parametrize("cap", [0, -1, 2**31, "2", True, 2.0])
def test_a_field_cap_that_is_not_a_positive_integer_is_a_violation(world, open_round, cap):
    doc = {"scenarios": [{"tool_id": "weather", "text": "Will it rain tomorrow in a city?"}],
           "field_cap": cap}
    response = post_doc(client_api(world.token_a), doc)
    assert response.status_code == 400, response.content
    assert [v["path"] for v in response.json()["violations"]] == ["$.field_cap"]
    assert not Submission.objects.exists()


def test_no_open_round_is_409(world, valid_doc):
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 409
    assert response.json() == {"detail": "no round is open"}


def test_closed_round_takes_no_more_submissions(world, open_round, valid_doc):
    services.close_round(SYSTEM, open_round)
    assert post_doc(client_api(world.token_a), valid_doc).status_code == 409


def test_body_over_the_limit_is_413(world, open_round, valid_doc):
    services.update_settings(SYSTEM, max_submission_bytes=200)
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 413
    assert "limit is 200 bytes" in response.json()["detail"]
    assert not Submission.objects.exists()


def test_a_gzip_body_is_stored_as_the_same_submission(world, open_round, valid_doc):
    api = client_api(world.token_a)
    body = json.dumps(valid_doc).encode()
    packed = gzip.compress(body)
    response = post_doc(api, packed, key="z", HTTP_CONTENT_ENCODING="gzip")
    assert response.status_code == 201, response.json()
    assert len(packed) < len(body)
    # The same content sent plain under the same key is a replay of it, not a conflict.
    again = post_doc(api, body, key="z")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.json() == response.json()
    assert Submission.objects.count() == 1


@pytest.mark.parametrize(
    "encoding, body, status, message",
    [
        ("br", b"{}", 415, "Content-Encoding 'br' is not supported"),
        ("gzip", b"not gzip at all", 400, "not valid gzip"),
        ("gzip", gzip.compress(b'{"a": 1}')[:-12], 400, "truncated"),
        ("gzip", gzip.compress(b'{"a": 1}') + b"junk", 400, "bytes after its gzip stream"),
        # 1 MB of zeros is 1 KB compressed: held to the limit once inflated, never inflated whole.
        ("gzip", gzip.compress(b" " * 1_000_000), 413, "decompressed body exceeds the limit of 5000"),
    ],
)
def test_a_bad_encoded_body_is_a_clear_4xx(world, open_round, encoding, body, status, message):
    services.update_settings(SYSTEM, max_submission_bytes=5000)
    response = post_doc(client_api(world.token_a), body, HTTP_CONTENT_ENCODING=encoding)
    assert response.status_code == status
    assert message in response.json()["detail"]
    assert not Submission.objects.exists()


def _schema(api) -> Schema:
    return Schema.model_validate_json(api.get("/api/v1/compendium/schema/").content)


def _schema_dictionary(api) -> bytes:
    return transport.schema_dictionary(_schema(api))


def test_a_dcz_body_against_the_schema_is_stored_with_its_wire_size(world, open_round, valid_doc):
    api = client_api(world.token_a)
    data = canonical_bytes(Compendium.model_validate(valid_doc))
    packed = transport.compress(data, _schema_dictionary(api))
    response = post_doc(api, packed, key="d", HTTP_CONTENT_ENCODING="dcz")
    assert response.status_code == 201, response.json()
    submission = Submission.objects.get()
    assert (submission.wire_bytes, submission.content_encoding) == (len(packed), "dcz")
    assert submission.version.sha256 == response.json()["sha256"]
    assert bytes(json.dumps(submission.version.content, separators=(",", ":"), sort_keys=True,
                            ensure_ascii=False), "utf-8") == data
    # The same content sent plain under the same key is a replay, not a conflict.
    again = post_doc(api, data, key="d")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    plain = post_doc(client_api(world.token_b), data, key="p")
    assert plain.status_code == 201
    assert Submission.objects.get(client=world.client_b).content_encoding == ""
    # The operator's overview shows what each client's last submission weighed on the wire.
    browser = BrowserClient()
    browser.force_login(world.operator)
    rows = {row.client.pk: row for row in browser.get("/").context["overview"].clients}
    assert (rows[world.client_a.pk].last_wire_bytes, rows[world.client_a.pk].last_encoding) == (
        len(packed), "dcz"
    )
    assert (rows[world.client_b.pk].last_wire_bytes, rows[world.client_b.pk].last_encoding) == (
        len(data), ""
    )


def test_a_dcz_body_against_a_published_global(world, valid_doc):
    _publish_global(valid_doc)
    services.open_round(SYSTEM)
    api = client_api(world.token_a)
    pulled = api.get("/api/v1/compendium/global/").json()
    dictionary = transport.global_dictionary(Compendium.model_validate(pulled["compendium"]))
    assert transport.dictionary_hash(dictionary) == pulled["sha256"]
    valid_doc["scenarios"].append({"tool_id": "weather", "text": "Is it sunny in a town today?"})
    data = canonical_bytes(Compendium.model_validate(valid_doc))
    packed = transport.compress(data, dictionary)
    assert len(packed) < len(gzip.compress(data, 9)) / 2  # nearly all of it already published
    response = post_doc(api, packed, key="g", HTTP_CONTENT_ENCODING="dcz")
    assert response.status_code == 201, response.json()
    assert response.json()["entry_counts"]["scenarios"] == 3
    assert Submission.objects.get().wire_bytes == len(packed)


def _import_probe(texts: list[str]) -> None:
    """What `import_probe_set` does to the rows: replaces them."""
    ProbeQuery.objects.all().delete()
    ProbeQuery.objects.bulk_create(
        [ProbeQuery(dataset="pub", qid=f"q{n:03d}", text=t, tool_id="weather")
         for n, t in enumerate(texts)]
    )


def test_the_probe_set_is_served_to_clients_and_names_a_first_round_dictionary(
    world, open_round, valid_doc
):
    assert APIClient().get("/api/v1/compendium/probe/").status_code == 401
    api = client_api(world.token_a)
    texts = [f"Will it rain tomorrow in town {n}?" for n in range(20)]
    _import_probe(texts)
    response = api.get("/api/v1/compendium/probe/")
    assert response.status_code == 200
    body = response.json()
    assert (body["count"], body["texts"], body["tools"]) == (20, texts, ["weather"] * 20)
    assert transport.probe_texts_of(body) == texts
    assert transport.probe_labelled_of(body) == [(t, "weather") for t in texts]
    cached = api.get("/api/v1/compendium/probe/", HTTP_IF_NONE_MATCH=response["ETag"],
                     HTTP_ACCEPT_ENCODING="gzip")
    assert cached.status_code == 304 and cached["ETag"] == response["ETag"]
    zipped = api.get("/api/v1/compendium/probe/", HTTP_ACCEPT_ENCODING="gzip")
    assert zipped["Content-Encoding"] == "gzip" and zipped["ETag"] == response["ETag"]
    # The ETag names the labels too: relabelled requests are a new probe set to a client that
    # routes with it, though the dictionary (`sha256`) is the same.
    ProbeQuery.objects.filter(qid="q000").update(tool_id="flights")
    relabelled = api.get("/api/v1/compendium/probe/", HTTP_IF_NONE_MATCH=response["ETag"])
    assert relabelled.status_code == 200 and relabelled["ETag"] != response["ETag"]
    assert relabelled.json()["sha256"] == body["sha256"]
    assert relabelled.json()["tools"][0] == "flights"
    ProbeQuery.objects.filter(qid="q000").update(tool_id="weather")
    dictionary = transport.probe_dictionary(_schema(api), texts)
    data = canonical_bytes(Compendium.model_validate(valid_doc))
    packed = transport.compress(data, dictionary)
    accepted = post_doc(api, packed, key="p", HTTP_CONTENT_ENCODING="dcz")
    assert accepted.status_code == 201, accepted.json()
    assert Submission.objects.get().wire_bytes == len(packed)
    # Once the probe set is replaced, a body against the old one is refused with the reason,
    # and the stored submission stays as it was.
    _import_probe(texts[:10])
    refused = post_doc(api, packed, key="q", HTTP_CONTENT_ENCODING="dcz")
    assert refused.status_code == 400 and refused.json()["code"] == "unknown_dictionary"
    assert Submission.objects.get().idempotency_key == "p"
    fresh = transport.compress(data, transport.probe_dictionary(_schema(api), texts[:10]))
    assert post_doc(api, fresh, key="q", HTTP_CONTENT_ENCODING="dcz").status_code == 201


def test_the_probe_set_names_no_deactivated_tool_and_keeps_its_dictionary(world, open_round):
    """A request labelled with a tool the registry does not offer (deactivated, never imported)
    stays in `texts`, so the dictionary and `sha256` are the same, but gets no tool: `labels`
    holds null there and `tools` (what clients before `labels` read, all strings) is left out,
    so no client learns the tool or routes to it; the ETag changes both ways."""
    api = client_api(world.token_a)
    texts = [f"Will it rain tomorrow in town {n}?" for n in range(4)] + [
        f"A cheap seat from city {n} to city {n + 1}" for n in range(4)]
    ProbeQuery.objects.bulk_create(
        [ProbeQuery(dataset="pub", qid=f"q{n:03d}", text=t,
                    tool_id="weather" if n < 4 else "flights") for n, t in enumerate(texts)]
    )
    served = api.get("/api/v1/compendium/probe/")
    body = served.json()
    assert body["labels"] == body["tools"] == ["weather"] * 4 + ["flights"] * 4
    flights = Tool.objects.get(tool_id="flights")
    flights.active = False
    flights.save()
    deactivated = api.get("/api/v1/compendium/probe/", HTTP_IF_NONE_MATCH=served["ETag"])
    assert deactivated.status_code == 200 and deactivated["ETag"] != served["ETag"]
    after = deactivated.json()
    assert (after["count"], after["texts"], after["sha256"]) == (8, texts, body["sha256"])
    assert after["labels"] == ["weather"] * 4 + [None] * 4
    assert "tools" not in after and "flights" not in deactivated.content.decode()
    assert transport.probe_labelled_of(after) == [(t, "weather") for t in texts[:4]]
    # The dictionary a client makes of what it was served is still one the server holds.
    schema = _schema(api)
    assert "flights" not in schema.tool_ids
    dictionary = transport.probe_dictionary(schema, after["texts"])
    assert submissions.submission_dictionary(transport.dictionary_hash(dictionary)) == dictionary
    # A label the registry never had is no tool either; reactivated, the set is what it was.
    ProbeQuery.objects.filter(qid="q000").update(tool_id="not-imported")
    assert api.get("/api/v1/compendium/probe/").json()["labels"][:5] == [None, "weather",
                                                                           "weather", "weather", None]
    ProbeQuery.objects.filter(qid="q000").update(tool_id="weather")
    flights.active = True
    flights.save()
    again = api.get("/api/v1/compendium/probe/", HTTP_IF_NONE_MATCH=deactivated["ETag"])
    assert again.status_code == 200 and again["ETag"] == served["ETag"]
    assert again.json() == body


def test_a_global_an_erasure_removed_is_no_dictionary_in_a_process_that_kept_it(world, valid_doc):
    """Each process kept the last few globals' bytes by hash, for good: after an erasure deleted
    or replaced a global, a process that had used it kept its bytes (the erased text among them)
    and went on decoding bodies against it, which every other process refused."""
    _publish_global(valid_doc)
    services.open_round(SYSTEM)
    pulled = client_api(world.token_a).get("/api/v1/compendium/global/").json()
    dictionary = transport.global_dictionary(Compendium.model_validate(pulled["compendium"]))
    sha = pulled["sha256"]
    assert submissions.submission_dictionary(sha) == dictionary  # kept by this process now
    CompendiumVersion.objects.filter(kind="global", sha256=sha).delete()  # what erasure does
    assert submissions.submission_dictionary(sha) is None
    assert sha not in submissions._global_bytes_cache
    data = canonical_bytes(Compendium.model_validate(valid_doc))
    refused = post_doc(client_api(world.token_a), transport.compress(data, dictionary),
                       HTTP_CONTENT_ENCODING="dcz")
    assert refused.status_code == 400 and refused.json()["code"] == "unknown_dictionary"


def test_a_process_forgets_an_erased_globals_bytes_at_its_next_dictionary_lookup(world, valid_doc):
    """A process forgot a global an erasure deleted only when a body named that global again:
    otherwise its bytes (the erased text among them) stayed in its memory until four newer
    globals pushed them out, however long that took. Any lookup of a global dictionary now drops
    the kept globals that are no longer published."""
    _publish_global(valid_doc)
    erased = CompendiumVersion.objects.get(kind="global")
    assert submissions.submission_dictionary(erased.sha256) is not None  # kept by this process
    valid_doc["scenarios"].pop()
    _publish_global(valid_doc)
    kept = CompendiumVersion.objects.filter(kind="global").exclude(pk=erased.pk).get()
    erased.delete()  # what an erasure does
    assert submissions.submission_dictionary(kept.sha256) is not None
    assert list(submissions._global_bytes_cache) == [kept.sha256]


def test_a_dcz_body_against_a_dictionary_the_server_does_not_hold(world, valid_doc):
    # A global that is stored but not published is no dictionary: nobody could have pulled it.
    rnd = services.open_round(SYSTEM)
    services.close_round(SYSTEM, rnd)
    services.mark_merging(rnd)
    store_compendium(Compendium.model_validate(valid_doc), kind="global", round=rnd)
    services.open_round(SYSTEM)
    data = canonical_bytes(Compendium.model_validate(valid_doc))
    for dictionary in (data, b"a dictionary nobody published"):
        response = post_doc(
            client_api(world.token_a), transport.compress(data, dictionary),
            HTTP_CONTENT_ENCODING="dcz",
        )
        assert response.status_code == 400
        assert response.json()["code"] == "unknown_dictionary"
        assert "pull the global again, or send gzip" in response.json()["detail"]
    assert not Submission.objects.exists()


def test_a_bad_dcz_body_is_a_clear_4xx(world, open_round, valid_doc):
    services.update_settings(SYSTEM, max_submission_bytes=5000)
    api = client_api(world.token_a)
    dictionary = _schema_dictionary(api)
    bomb = transport.compress(b" " * 1_000_000, dictionary)
    cases = [
        (b"{}", 400, "must start with the 40-byte skippable frame"),
        (bomb, 413, "would be 1000000 bytes; the limit is 5000"),
        (bomb[:-4], 413, "would be 1000000 bytes"),  # refused from its declared size alone
        (transport.compress(b'{"a": 1}', dictionary) + b"junk", 400, "does not decompress"),
    ]
    for body, status, message in cases:
        response = post_doc(api, body, HTTP_CONTENT_ENCODING="dcz")
        assert response.status_code == status, response.json()
        assert message in response.json()["detail"]
    assert not Submission.objects.exists()


@pytest.fixture
def one_window(monkeypatch):
    """The rate limiter's clock held at the start of a minute: its windows are fixed minutes, and
    a test whose posts straddled a minute's end (a slow host) saw the count start again."""
    import math
    import time
    from types import SimpleNamespace

    from federation import ratelimit

    start = math.floor(time.time() / 60) * 60 + 1
    monkeypatch.setattr(ratelimit, "time", SimpleNamespace(time=lambda: start))


def test_rate_limit_is_429_with_retry_after(world, open_round, valid_doc, one_window):
    services.update_settings(SYSTEM, submissions_per_minute=1)
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="a").status_code == 201
    limited = post_doc(api, valid_doc, key="b")
    assert limited.status_code == 429
    assert 1 <= int(limited["Retry-After"]) <= 60
    # A replay past the rate is a 429 too (its body would be decoded to compare it with the
    # key's); it is answered in the next window.
    assert post_doc(api, valid_doc, key="a").status_code == 429
    # Another client has its own budget.
    assert post_doc(client_api(world.token_b), valid_doc, key="a").status_code == 201


def test_refused_submissions_count_towards_the_rate_limit(
    world, open_round, valid_doc, without_merge_pipeline, one_window
):
    """An accepted submission's hit is committed with it; an invalid one, one refused for want of
    an open round, and a replay (its body is decoded) are counted on their own; requests refused
    for the rate are not."""
    from federation.models import RateCounter

    services.update_settings(SYSTEM, submissions_per_minute=4)
    api = client_api(world.token_a)
    assert post_doc(api, b"{not json", key="bad").status_code == 400
    assert post_doc(api, valid_doc, key="a").status_code == 201
    assert post_doc(api, valid_doc, key="a").status_code == 201  # a replay
    services.close_round(SYSTEM, open_round)
    assert post_doc(api, valid_doc, key="b").status_code == 409
    services.open_round(SYSTEM)
    assert post_doc(api, valid_doc, key="c").status_code == 429
    assert post_doc(api, valid_doc, key="a").status_code == 429  # a replay past the rate
    counter = RateCounter.objects.get(key=f"submit:client:{world.client_a.pk}")
    assert counter.count == 4


def test_a_client_past_its_rate_costs_no_decompression(world, open_round, valid_doc, one_window,
                                                        monkeypatch):
    """The rate is checked before the body is inflated: a client past its rate that sends a
    compressed body (here one that is not even gzip) gets its 429 with nothing decoded."""
    services.update_settings(SYSTEM, submissions_per_minute=1)
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="a").status_code == 201
    decoded = []
    original = submissions.decoded_body
    monkeypatch.setattr(submissions, "decoded_body",
                        lambda *args: decoded.append(args) or original(*args))
    limited = post_doc(api, b"not gzip at all", key="b", HTTP_CONTENT_ENCODING="gzip")
    assert limited.status_code == 429, limited.content
    assert decoded == []
    # Nor a replay past the rate (a stored key would otherwise make decoding free).
    replay = post_doc(api, gzip.compress(json.dumps(valid_doc).encode()), key="a",
                      HTTP_CONTENT_ENCODING="gzip")
    assert replay.status_code == 429 and decoded == []


def test_a_body_that_does_not_decode_counts_towards_the_rate(world, open_round, valid_doc,
                                                            one_window):
    from federation.models import RateCounter

    services.update_settings(SYSTEM, submissions_per_minute=2)
    api = client_api(world.token_a)
    assert post_doc(api, b"not gzip at all", key="a", HTTP_CONTENT_ENCODING="gzip").status_code == 400
    bomb = gzip.compress(b" " * (submissions.max_submission_bytes() + 10))
    assert post_doc(api, bomb, key="b", HTTP_CONTENT_ENCODING="gzip").status_code == 413
    assert post_doc(api, valid_doc, key="c").status_code == 429
    assert RateCounter.objects.get(key=f"submit:client:{world.client_a.pk}").count == 2
    assert not Submission.objects.exists()


@pytest.mark.parametrize("same_body, status", [(True, 201), (False, 422)])
def test_a_key_stored_while_the_body_was_checked_counts_towards_the_rate(
    world, open_round, valid_doc, one_window, monkeypatch, same_body, status
):
    """Requests of one key sent together all pass the look-ahead (the key is not stored yet) and
    each has its body checked; all but the first find the key stored under the client's lock and
    replay it (or refuse another body). They count as a replay found by the look-ahead does:
    else a burst of one key cost a validation per request and one hit in all, past any rate."""
    from federation.models import RateCounter

    services.update_settings(SYSTEM, submissions_per_minute=2)
    api = client_api(world.token_a)
    original = submissions.validate_compendium
    concurrent = []

    def validate_while_the_key_is_stored(body, schema):
        if not concurrent:  # the request sent at the same time commits while this one is checked
            concurrent.append(None)
            concurrent[0] = post_doc(api, valid_doc, key="k")
        return original(body, schema)

    monkeypatch.setattr(submissions, "validate_compendium", validate_while_the_key_is_stored)
    other = {**valid_doc, "annex": []}
    response = post_doc(api, valid_doc if same_body else other, key="k")
    assert concurrent[0].status_code == 201
    assert response.status_code == status, response.content
    assert RateCounter.objects.get(key=f"submit:client:{world.client_a.pk}").count == 2
    # Past the rate now, as after a replay the look-ahead found.
    assert post_doc(api, valid_doc, key="k").status_code == 429
    assert Submission.objects.count() == 1


def test_a_limit_of_zero_refuses_before_any_work(world, open_round, valid_doc):
    services.update_settings(SYSTEM, submissions_per_minute=0)
    api = client_api(world.token_a)
    assert post_doc(api, b"{not json", key="bad").status_code == 429
    assert post_doc(api, valid_doc, key="a").status_code == 429
    assert not Submission.objects.exists()


def test_personal_data_is_scrubbed_on_arrival(world, valid_doc):
    """In a round that expects no masking (λ = 0) the text is taken as it comes, and the server
    still scrubs what is obviously personal."""
    services.open_round(SYSTEM, {"mask_strength": 0})
    valid_doc["scenarios"][0]["text"] = "Weather for jane@example.org, call +44 20 7946 0958"
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 201, response.content
    assert response.json()["scrubbed"] == 2
    stored = CompendiumVersion.objects.get(kind="client")
    texts = [s["text"] for s in stored.content["scenarios"]]
    assert "Weather for [email], call [phone]" in texts
    assert "jane@example.org" not in json.dumps(stored.content)


def test_a_scrub_that_breaks_a_limit_is_a_400_not_a_submission_the_merge_drops(world, valid_doc):
    """The scrub writes NFKC text and tags, which can be longer (U+FDFA is 18 characters), and
    merges entries that became one (their supports add up): the result was stored with a 201 and
    then rejected at the round's merge, the client's contribution silently lost."""
    services.open_round(SYSTEM, {"mask_strength": 0})
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="clean").status_code == 201
    long = json.loads(json.dumps(valid_doc))
    long["scenarios"][0]["text"] = "\ufdfa" * 55 + " call +44 20 7946 0958"
    response = post_doc(api, long, key="long")
    assert response.status_code == 400, response.content
    [violation] = response.json()["violations"]
    assert violation["path"] == "$.scenarios[0].text"
    assert violation["reason"].startswith("after the server's scrub of what looked like personal")
    assert "1000" in violation["reason"]
    heavy = json.loads(json.dumps(valid_doc))
    heavy["scenarios"] = [{"tool_id": "weather", "text": f"Rain for order {n}?", "support": 1_000_000}
                          for n in (48151623, 42424242)]
    response = post_doc(api, heavy, key="heavy")
    assert response.status_code == 400 and "exceeds" in json.dumps(response.json()["violations"])
    assert Submission.objects.filter(status_code=201).count() == 1  # the clean one stays


def test_a_clients_metadata_carries_statistics_only(world, open_round, valid_doc):
    """A description or spec in a client's metadata is free text no masking check or scrub
    reads (and the merge drops): it was stored as sent, names and addresses included."""
    api = client_api(world.token_a)
    for field, value in (("description", "Patient John Smith, john.smith@example.com"),
                         ("spec", {"note": "Alice Jones, 12 Main St"})):
        doc = json.loads(json.dumps(valid_doc))
        doc["metadata"][0][field] = value
        response = post_doc(api, doc, key=field)
        assert response.status_code == 400, response.content
        [violation] = response.json()["violations"]
        assert violation["path"] == f"$.metadata[0].{field}"
        assert "only its statistics" in violation["reason"]
    assert not Submission.objects.exists() and not CompendiumVersion.objects.exists()


def test_a_flag_name_holding_personal_data_is_refused_and_ordinary_flags_pass(
    world, open_round, valid_doc
):
    """Flag names are identifiers no masking check or scrub read: a phone, card or account
    number as a flag name was stored as sent and merged into the global compendium published to
    every organization. It is a 400 naming the scenario's preconditions (never the name), with
    nothing stored; condition names with digits, dots or colons are taken."""
    api = client_api(world.token_a)
    for key, flag, found in (("phone", "555_123_4567", "1 phone number"),
                             ("card", "4111111111111111", "1 card number"),
                             ("account", "acct_12345678", "1 long number"),
                             ("mail", "john_at_example_dot_com", "1 e-mail address")):
        doc = json.loads(json.dumps(valid_doc))
        doc["scenarios"][1]["preconditions"] = {"has_city": True, flag: True}
        response = post_doc(api, doc, key=key)
        assert response.status_code == 400, response.content
        [violation] = response.json()["violations"]
        assert violation["path"] == "$.scenarios[1].preconditions"
        assert violation["reason"].startswith(f"flag name 2 of 2 holds {found}")
        assert flag not in response.content.decode()
    assert not Submission.objects.exists() and not CompendiumVersion.objects.exists()

    doc = json.loads(json.dumps(valid_doc))
    doc["scenarios"][1]["preconditions"] = {"lang:en": True, "v2": False, "retry_count_gt_3": True,
                                            "is_weekend": True, "region:eu-west-1": False}
    response = post_doc(api, doc, key="ordinary")
    assert response.status_code == 201, response.content


def test_a_submission_declared_as_another_media_type_is_a_415_and_gzip_members_join(
    world, open_round, valid_doc
):
    api = client_api(world.token_a)
    body = json.dumps(valid_doc)
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        response = api.post(SUBMIT, body, content_type=media, HTTP_IDEMPOTENCY_KEY="m")
        assert response.status_code == 415 and "Content-Type: application/json" in response.json()["detail"]
    assert not Submission.objects.exists()
    # several gzip members (pigz, cat a.gz b.gz) are one body, their contents joined
    raw = body.encode()
    members = gzip.compress(raw[:40]) + gzip.compress(raw[40:])
    response = api.post(SUBMIT, members, content_type="application/json; charset=utf-8",
                        HTTP_IDEMPOTENCY_KEY="m", HTTP_CONTENT_ENCODING="gzip")
    assert response.status_code == 201, response.content


def test_the_submission_endpoint_answers_json_whatever_the_client_accepts(
    world, open_round, valid_doc
):
    """A client whose requests say `Accept: text/html` (a browser's, curl -H, ?format=api) gets
    the endpoint's JSON: DRF's browsable API cannot build its forms for a view that reads its
    body raw, and its answer was a 500 after the submission had been stored."""
    api = client_api(world.token_a)
    stored = post_doc(api, valid_doc, key="html", HTTP_ACCEPT="text/html")
    assert stored.status_code == 201, stored.content
    assert stored["Content-Type"].startswith("application/json")
    assert stored.json()["round"] == open_round.number
    replayed = post_doc(api, valid_doc, key="html", HTTP_ACCEPT="text/html")
    assert replayed.status_code == 201 and replayed["Idempotent-Replayed"] == "true"
    assert Submission.objects.count() == 1
    refused = post_doc(api, b"{nope", key="bad", HTTP_ACCEPT="text/html")
    assert refused.status_code == 400 and refused.json()["violations"]
    for listed in (api.get(SUBMIT, HTTP_ACCEPT="text/html"), api.get(SUBMIT + "?format=api")):
        assert listed.status_code == 200 and listed.json()["count"] == 1
    assert api.options(SUBMIT, HTTP_ACCEPT="text/html").status_code == 200


def test_the_submission_endpoints_options_describe_the_compendium_a_client_posts(world):
    """OPTIONS described a POST by the fields of the list's rows (id, round_state, idempotency_key,
    in_effect, ...), none of which a client sends, and said the endpoint parses nothing."""
    response = client_api(world.token_a).options(SUBMIT)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["parses"] == ["application/json"]
    post = body["actions"]["POST"]
    assert set(post) == set(Compendium.model_fields)
    assert not any(field["required"] or field["read_only"] for field in post.values())
    assert post["scenarios"]["type"] == "list"
    assert "tool_id, text, preconditions, support" in post["scenarios"]["help_text"]
    assert post["field_cap"]["min_value"] == 1


UNMASKED = "Ask my colleague Henrietta Castellanos at henrietta@example.org about ticket 8587766"


def test_text_not_masked_at_the_rounds_strength_is_refused_whole(world, open_round, valid_doc):
    """What masking at the round's λ removes from any text (names, numbers, identifiers, contact
    details) must not arrive: the submission is a 400 naming each text by path and what it holds
    (never the words), nothing is stored, and the client's earlier submission stays in effect."""
    api = client_api(world.token_a)
    assert post_doc(api, valid_doc, key="clean").status_code == 201
    before = CompendiumVersion.objects.get(kind="client").content
    leaking = json.loads(json.dumps(valid_doc))
    leaking["scenarios"][1]["text"] = UNMASKED
    leaking["precautions"][0]["text"] = "Do not use it for Mr. Thornbury's account A17-22"
    response = post_doc(api, leaking, key="leaking")
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "unmasked_text" and "λ = 1" in body["detail"]
    paths = {v["path"]: v["reason"] for v in body["violations"]}
    assert set(paths) == {"$.scenarios[1].text", "$.precautions[0].text"}
    assert "2 names" in paths["$.scenarios[1].text"] and "e-mail address" in paths["$.scenarios[1].text"]
    assert "number" in paths["$.scenarios[1].text"]
    assert "identifier" in paths["$.precautions[0].text"] and "name" in paths["$.precautions[0].text"]
    for secret in ("Henrietta", "example.org", "8587766", "Thornbury", "A17"):
        assert secret not in response.content.decode()
    assert CompendiumVersion.objects.get(kind="client").content == before
    assert Submission.objects.filter(client=world.client_a).count() == 1
    # the operator and the client's organization see the refusal in the audit log, without words
    entry = AuditLog.objects.get(action=AuditLog.Action.SUBMISSION_UNMASKED)
    assert entry.organization == world.client_a.organization and entry.target_id == str(world.client_a.pk)
    assert entry.details["round"] == open_round.number and entry.details["mask_strength"] == 1.0
    assert entry.details["texts"] == 2 and entry.details["violations"] == body["violations"]
    for secret in ("Henrietta", "example.org", "8587766", "Thornbury", "A17"):
        assert secret not in json.dumps(entry.details)
    metrics = BrowserClient()
    metrics.force_login(world.operator)
    exposition = metrics.get("/metrics").content.decode()
    slug = world.client_a.organization.slug
    assert f'synapse_submissions_refused_unmasked_total{{organization="{slug}"}} 1.0' in exposition


def test_text_spelt_in_look_alike_characters_is_refused_as_unmasked(world, open_round, valid_doc):
    """A full-width ＠ and full-width digits spell an e-mail address and a phone number: the
    server checks the text's NFKC form, as the client masks it."""
    leaking = json.loads(json.dumps(valid_doc))
    leaking["scenarios"][0]["text"] = "write to jane.doe＠gmail．com or call ４１５ ５５５ ０１９９"
    response = post_doc(client_api(world.token_a), leaking)
    assert response.status_code == 400, response.content
    reason = response.json()["violations"][0]["reason"]
    assert response.json()["code"] == "unmasked_text" and "e-mail address" in reason and "phone" in reason
    assert not Submission.objects.exists()


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("write to jane.doe@gmail\u200b.com about it", "e-mail address"),
        ("write to josé.garcía@empresa.es about it", "e-mail address"),
        ("please call M\u0336a\u0336r\u0336g\u0336a\u0336r\u0336e\u0336t\u0336 now", "name"),
        # a dot bracketed as written, which the check's shortcut for ASCII text passed over (it
        # looked only for a bracketed "at")
        ("write to jane at gmail [.] com about it", "e-mail address"),
    ],
)
def test_text_split_by_invisible_or_combining_characters_is_refused_as_unmasked(
    world, open_round, valid_doc, text, kind
):
    """A zero-width space inside an address, an address in letters of any script, a name struck
    through with combining marks: the server's check read them as pieces that masking never
    takes, and stored them."""
    leaking = json.loads(json.dumps(valid_doc))
    leaking["scenarios"][0]["text"] = text
    response = post_doc(client_api(world.token_a), leaking)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "unmasked_text"
    assert kind in response.json()["violations"][0]["reason"]
    assert not Submission.objects.exists()


def test_what_the_client_toolkit_masks_is_accepted(world, open_round, valid_doc):
    """The same text masked by the client toolkit at the round's λ passes the check."""
    from compendium.masking import TextMasker
    from compendium.services import current_schema

    masker = TextMasker.for_registry(current_schema().tools)
    valid_doc["scenarios"][1]["text"] = masker.mask(UNMASKED).text
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 201, response.content


def test_a_stronger_round_refuses_what_a_weaker_one_takes(world, valid_doc):
    """The check is at the open round's λ: a short number that λ = 0.5 keeps, λ = 1 removes."""
    valid_doc["scenarios"][0]["text"] = "Will it rain in 10 days in a city?"
    services.open_round(SYSTEM, {"mask_strength": 0.5})
    assert post_doc(client_api(world.token_a), valid_doc, key="a").status_code == 201
    rnd = Round.objects.get(state=Round.State.OPEN)
    Round.objects.filter(pk=rnd.pk).update(config={**rnd.config, "mask_strength": 1.0})
    response = post_doc(client_api(world.token_a), valid_doc, key="b")
    assert response.status_code == 400 and response.json()["code"] == "unmasked_text"


@pytest.mark.parametrize("stored", ["0.5", True, None, -2])
def test_a_hand_written_mask_strength_that_is_no_lambda_is_checked_at_the_default(
    world, valid_doc, stored
):
    """A round configuration written by hand whose mask_strength is no λ: the client toolkit
    reads it as the default λ (`expected_mask_strength`), while the server read a string as the
    λ it spells and met `true` with the database's cast error (a 500 to every submission). The
    server reads it as the client does now: at the default."""
    valid_doc["scenarios"][0]["text"] = "Will it rain in 10 days in a city?"  # λ = 0.5 keeps it
    rnd = services.open_round(SYSTEM, {"mask_strength": 0.5})
    Round.objects.filter(pk=rnd.pk).update(config={**rnd.config, "mask_strength": stored})
    response = post_doc(client_api(world.token_a), valid_doc)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "unmasked_text" and "λ = 1:" in response.json()["detail"]


# --- rounds, schema, global compendium ---------------------------------------------------------


def test_an_open_round_names_the_fields_its_edges_will_not_release(world, open_round):
    """With every approved client submitting (one in each of two organizations), no field
    could come out of its noise at ε = 1 (its noise as wide as each field's clipping window, calls'
    [0, 50] too, not its declared range of 1,000): all are named, fixed when the round opened,
    for clients to leave out; a round opened with more approved clients names fewer."""
    from federation.merge import drowned_fields

    api = client_api(world.token_a)
    row = api.get("/api/v1/rounds/?state=open").json()["results"][0]
    assert row["fields_not_released"] == ["calls", "frequency", "latency_ms", "success_rate"]
    config = services.RoundConfig.from_stored(open_round.config)
    assert row["fields_not_released"] == sorted(
        drowned_fields(submissions.schema_in_force(), config, 1, 2))
    opened = AuditLog.objects.get(action=AuditLog.Action.ROUND_OPEN)
    assert opened.details["fields_not_released"] == row["fields_not_released"]
    for n in range(40):  # org A with 41 approved clients: K·√E = 41·1.41 = 58
        Client.objects.create(organization=world.client_a.organization, name=f"extra{n}",
                              status=Client.Status.APPROVED)
    # fixed for the round: clients that left fields out are never counted at a neutral value
    assert api.get(f"/api/v1/rounds/{open_round.pk}/").json()["fields_not_released"] == (
        row["fields_not_released"])
    Round.objects.filter(pk=open_round.pk).update(state=Round.State.PUBLISHED)
    later = services.open_round(SYSTEM)
    fewer = api.get(f"/api/v1/rounds/{later.pk}/").json()["fields_not_released"]
    assert fewer == sorted(drowned_fields(submissions.schema_in_force(), config, 41, 2))
    assert len(fewer) < 4


def test_rounds_list_and_detail_with_figures(world, open_round, valid_doc):
    post_doc(client_api(world.token_a), valid_doc)
    post_doc(client_api(world.token_b), valid_doc)
    api = client_api(world.token_a)
    listing = api.get("/api/v1/rounds/?state=open").json()
    assert listing["count"] == 1
    row = listing["results"][0]
    assert {"id", "number", "state", "config"} <= set(row)
    # the figures are of what the caller may see, as on the dashboard: a client its organization's
    assert row["submissions"] == 1 and row["organizations"] == 1 and row["submitted_bytes"] > 0
    everyone = person_api(world.operator).get("/api/v1/rounds/?state=open").json()["results"][0]
    assert everyone["submissions"] == 2 and everyone["organizations"] == 2
    assert everyone["submitted_bytes"] == 2 * row["submitted_bytes"]
    assert api.get("/api/v1/rounds/?state=published").json()["count"] == 0
    assert api.get("/api/v1/rounds/?state=bogus").status_code == 400
    detail = person_api(world.member_a).get(f"/api/v1/rounds/{open_round.pk}/")
    assert detail.status_code == 200 and detail.json()["number"] == 1
    assert detail.json()["submissions"] == 1  # a member: their organization's
    assert api.get("/api/v1/rounds/999999/").status_code == 404
    assert client_api().get("/api/v1/rounds/").status_code == 401


def test_a_published_round_says_how_its_global_routes_the_probe_set(world, open_round):
    from federation.models import MergeRecord

    MergeRecord.objects.create(round=open_round, accuracy=0.61234, probe_queries=597)
    api = client_api(world.token_a)
    # recorded at the server merge, shown once the round is published
    row = api.get(f"/api/v1/rounds/{open_round.pk}/").json()
    assert (row["probe_accuracy"], row["probe_queries"]) == (None, 0)
    Round.objects.filter(pk=open_round.pk).update(state=Round.State.PUBLISHED)
    row = api.get("/api/v1/rounds/?state=published").json()["results"][0]
    assert (row["probe_accuracy"], row["probe_queries"]) == (0.6123, 597)
    # an edge's record is not the global's
    later = services.open_round(SYSTEM)
    MergeRecord.objects.create(round=later, organization=world.client_a.organization)
    row = api.get(f"/api/v1/rounds/{later.pk}/").json()
    assert (row["probe_accuracy"], row["probe_queries"]) == (None, 0)


def test_schema_endpoint(world):
    response = client_api(world.token_a).get("/api/v1/compendium/schema/")
    assert response.status_code == 200
    assert {t["tool_id"] for t in response.json()["tools"]} == {"weather", "flights", "calculator"}


def _publish_global(valid_doc, number_of_rounds=1):
    for _ in range(number_of_rounds):
        rnd = services.open_round(SYSTEM)
        services.close_round(SYSTEM, rnd)
        services.mark_merging(rnd)
        store_compendium(Compendium.model_validate(valid_doc), kind="global", round=rnd)
        services.mark_published(rnd)
    return rnd


def test_global_compendium_etag_and_rounds(world, valid_doc):
    api = client_api(world.token_a)
    assert api.get("/api/v1/compendium/global/").status_code == 404
    _publish_global(valid_doc)
    valid_doc["scenarios"].pop()
    _publish_global(valid_doc)
    response = api.get("/api/v1/compendium/global/")
    assert response.status_code == 200
    body = response.json()
    assert body["round"] == 2 and len(body["compendium"]["scenarios"]) == 1
    assert response["ETag"] == f'W/"{body["sha256"]}"'
    assert api.get("/api/v1/compendium/global/",  # a strong one a client saved before matches too
                   HTTP_IF_NONE_MATCH=f'"{body["sha256"]}"').status_code == 304
    cached = api.get("/api/v1/compendium/global/", HTTP_IF_NONE_MATCH=response["ETag"])
    assert cached.status_code == 304 and cached["ETag"] == response["ETag"]
    older = api.get("/api/v1/compendium/global/?round=1")
    assert older.json()["round"] == 1 and older["ETag"] != response["ETag"]
    assert api.get("/api/v1/compendium/global/?round=1", HTTP_IF_NONE_MATCH='"x"').status_code == 200
    assert api.get("/api/v1/compendium/global/?round=abc").status_code == 400
    # sent gzipped to a caller that takes it, and its (then weak) ETag still answers 304
    zipped = api.get("/api/v1/compendium/global/", HTTP_ACCEPT_ENCODING="gzip")
    assert zipped["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(zipped.content)) == body
    assert zipped["ETag"] == f'W/"{body["sha256"]}"'
    again = api.get("/api/v1/compendium/global/", HTTP_ACCEPT_ENCODING="gzip",
                    HTTP_IF_NONE_MATCH=zipped["ETag"])
    # the 304 names the validator the 200 did (it was the strong form, the 200's the weak one)
    assert again.status_code == 304 and again["ETag"] == zipped["ETag"]
    # a 304 says what the 200 varies with, so that a shared cache keys them alike
    vary = {v.strip().lower() for v in zipped["Vary"].split(",")}
    assert "accept-encoding" in vary
    assert {v.strip().lower() for v in again["Vary"].split(",")} == vary
    assert {v.strip().lower() for v in cached["Vary"].split(",")} == vary
    schema = api.get("/api/v1/compendium/schema/", HTTP_ACCEPT_ENCODING="gzip")
    assert schema["Content-Encoding"] == "gzip"  # the probe set too, once it is over 200 bytes


def test_unpublished_global_compendium_is_not_served(world, valid_doc):
    rnd = services.open_round(SYSTEM)
    services.close_round(SYSTEM, rnd)
    services.mark_merging(rnd)
    store_compendium(Compendium.model_validate(valid_doc), kind="global", round=rnd)
    api = client_api(world.token_a)
    assert api.get("/api/v1/compendium/global/").status_code == 404
    assert api.get("/api/v1/compendium/global/?round=1").status_code == 404


def test_global_routing_head_is_served_with_its_own_etag(world, valid_doc):
    api = client_api(world.token_a)
    path = "/api/v1/compendium/global/head/"
    assert api.get(path).status_code == 404  # nothing published
    first = _publish_global(valid_doc)
    missing = api.get(path)
    assert missing.status_code == 404 and "no routing head" in missing.json()["detail"]
    head = LinearHead(
        ["calculator", "weather"], np.ones((2, 384), dtype=np.float32), np.zeros(2, dtype=np.float32)
    )
    CompendiumVersion.objects.filter(kind="global", round=first).update(routing_head=head.to_bytes())
    for who in (api, person_api(world.member_a)):  # clients and people alike
        response = who.get(path)
        assert response.status_code == 200
        assert response["Content-Type"] == "application/octet-stream"
        assert LinearHead.from_bytes(response.content).tools == head.tools
    sha256 = api.get("/api/v1/compendium/global/").json()["sha256"]
    assert response["ETag"] == f'"{sha256}-head"'
    assert api.get(path, HTTP_IF_NONE_MATCH=response["ETag"]).status_code == 304
    valid_doc["scenarios"].pop()
    _publish_global(valid_doc)  # round 2, published without a head
    assert api.get(path).status_code == 404
    assert api.get(path + "?round=1").content == head.to_bytes()
    assert api.get(path + "?round=3").status_code == 404
    assert api.get(path + "?round=one").status_code == 400
    assert client_api().get(path).status_code == 401
    assert client_api("not-a-token").get(path).status_code == 401


def test_openapi_schema_and_docs_render(world):
    api = APIClient()
    schema = api.get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    for path in (
        "/api/v1/submissions/", "/api/v1/compendium/global/", "/api/v1/compendium/global/head/",
        "/api/v1/admin/clients/", "/api/v1/compendium/probe/",
    ):
        assert path in text
    assert api.get("/api/docs/").status_code == 200


@pytest.mark.parametrize(
    "method, query, accept, status",
    [("post", "", None, 405), ("delete", "", None, 405), ("get", "?format=xml", None, 400),
     ("get", "", "text/html", 406)],
)
def test_the_schema_endpoint_refuses_in_the_api_s_json_error_body(world, method, query, accept, status):
    # its errors were rendered by the schema's own YAML renderer as
    # "detail:\n  string: Method \"POST\" not allowed.\n  code: ..." (an ErrorDetail dumped whole)
    headers = {"HTTP_ACCEPT": accept} if accept else {}
    response = getattr(APIClient(), method)("/api/schema/" + query, **headers)
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    assert set(response.json()) == {"detail"} and response.json()["detail"]


@pytest.mark.parametrize(
    "path, taken",
    [("/api/v1/rounds/", "json, api"), ("/api/v1/admin/clients/", "json, api"),
     ("/api/v1/compendium/schema/", "json, api"), ("/api/schema/", "yaml, json")],
)
@pytest.mark.parametrize("value", ["xml", "csv", "JSON"])
def test_a_format_the_endpoint_does_not_answer_is_a_400_naming_the_ones_it_does(
    world, path, taken, value
):
    """`?format=` is taken by every endpoint (README, "Federation API"), but a value none of its
    renderers has was DRF's bare 404 "Not found.", as if the endpoint did not exist, where every
    other bad query parameter is a 400 naming what is wrong."""
    response = person_api(world.operator).get(path, {"format": value})
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "detail": f"format must be one of {taken} (?format=), not {value!r}"
    }


# --- organization-scoped administration: every endpoint against every role ----------------------

ROLES = ["operator", "admin_a", "member_a", "admin_b"]


def _api_for(world, role):
    return person_api(getattr(world, role if role != "operator" else "operator"))


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 200), ("admin_a", 200), ("member_a", 200), ("admin_b", 404)],
)
def test_client_detail_scope(world, role, expected):
    response = _api_for(world, role).get(f"/api/v1/admin/clients/{world.client_a.pk}/")
    assert response.status_code == expected


@pytest.mark.parametrize(
    ("role", "visible"),
    [
        ("operator", {"org-a", "org-b"}),
        ("admin_a", {"org-a"}),
        ("member_a", {"org-a"}),
        ("admin_b", {"org-b"}),
    ],
)
def test_client_list_scope(world, role, visible):
    api = _api_for(world, role)
    rows = api.get("/api/v1/admin/clients/").json()["results"]
    assert {r["organization"] for r in rows} == visible
    assert all("token" not in r for r in rows)
    # Filtering by a foreign organization yields nothing, never its clients.
    foreign = api.get("/api/v1/admin/clients/?organization=org-a").json()["results"]
    assert bool(foreign) == ("org-a" in visible)


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 201), ("admin_a", 201), ("member_a", 403), ("admin_b", 400)],
)
def test_enroll_scope(world, role, expected):
    response = _api_for(world, role).post(
        "/api/v1/admin/clients/",
        {"organization": "org-a", "name": "laptop-7", "contact": "it@a.example"},
        format="json",
    )
    assert response.status_code == expected, response.content
    created = Client.objects.filter(organization=world.org_a, name="laptop-7")
    assert created.exists() == (expected == 201)
    if expected == 201:
        assert created.get().status == "pending"


def test_admin_enrolls_into_own_organization_without_naming_it(world):
    response = person_api(world.admin_b).post(
        "/api/v1/admin/clients/", {"name": "edge-box"}, format="json"
    )
    assert response.status_code == 201 and response.json()["organization"] == "org-b"


@pytest.mark.parametrize(
    ("role", "policy", "expected"),
    [
        ("operator", False, 200),
        ("admin_a", False, 403),
        ("admin_a", True, 200),
        ("member_a", True, 403),
        ("admin_b", True, 404),
    ],
)
def test_approve_scope(world, role, policy, expected):
    services.update_settings(SYSTEM, allow_admin_approval=policy)
    response = _api_for(world, role).post(f"/api/v1/admin/clients/{world.pending_a.pk}/approve/")
    assert response.status_code == expected, response.content
    world.pending_a.refresh_from_db()
    assert (world.pending_a.status == "approved") == (expected == 200)
    if expected == 200:
        token = response.json()["token"]
        assert services.client_for_token(token) == world.pending_a
        assert response["Cache-Control"] == "no-store"  # no cache keeps the token
        # Shown once: the client listing never shows it again.
        listing = _api_for(world, role).get(f"/api/v1/admin/clients/{world.pending_a.pk}/")
        assert token not in listing.content.decode()


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 200), ("admin_a", 200), ("member_a", 403), ("admin_b", 404)],
)
def test_rotate_scope(world, role, expected, open_round, valid_doc):
    response = _api_for(world, role).post(f"/api/v1/admin/clients/{world.client_a.pk}/rotate/")
    assert response.status_code == expected
    old = post_doc(client_api(world.token_a), valid_doc)
    assert (old.status_code == 201) == (expected != 200)
    if expected == 200:  # the old token's 401 says a rotation may be why
        assert old.status_code == 401 and "replaced by a rotation" in old.json()["detail"]
    if expected == 200:
        assert response["Cache-Control"] == "no-store"
        assert post_doc(client_api(response.json()["token"]), valid_doc, key="k2").status_code == 201


@pytest.mark.parametrize(
    ("role", "expected"),
    [("operator", 200), ("admin_a", 200), ("member_a", 403), ("admin_b", 404)],
)
def test_revoke_scope(world, role, expected, open_round, valid_doc):
    response = _api_for(world, role).post(
        f"/api/v1/admin/clients/{world.client_a.pk}/revoke/", {"reason": "lost"}, format="json"
    )
    assert response.status_code == expected
    status = post_doc(client_api(world.token_a), valid_doc).status_code
    assert status == (403 if expected == 200 else 201)


@pytest.mark.parametrize(
    ("role", "visible"),
    [
        ("operator", {"org-a", "org-b", None}),
        ("admin_a", {"org-a"}),
        ("member_a", {"org-a"}),
        ("admin_b", {"org-b"}),
    ],
)
def test_audit_log_scope_and_filters(world, role, visible):
    services.update_settings(SYSTEM, epsilon_budget=30.0)  # a federation-wide entry
    api = _api_for(world, role)
    rows = api.get("/api/v1/admin/audit/?limit=500").json()["results"]
    assert {r["organization"] for r in rows} == visible
    approvals = api.get("/api/v1/admin/audit/?action=client.approve").json()["results"]
    assert approvals and all(r["action"] == "client.approve" for r in approvals)
    foreign = api.get("/api/v1/admin/audit/?organization=org-a").json()["results"]
    assert bool(foreign) == ("org-a" in visible)
    assert api.get("/api/v1/admin/audit/?since=2999-01-01T00:00:00Z").json()["count"] == 0


def test_audit_log_filters_by_target_and_round(world):
    """target_type with target_id names one object's entries; round, the round a submission
    refusal was about. A round that is not a number is a 400 naming it."""
    for client, number in ((world.client_a, 1), (world.client_a, 2), (world.client_b, 2)):
        services.audit(SYSTEM, AuditLog.Action.SUBMISSION_UNMASKED, target=client,
                       organization=client.organization, details={"round": number})
    api = _api_for(world, "operator")
    base = "/api/v1/admin/audit/?action=submission.unmasked&target_type=client"
    rows = api.get(f"{base}&target_id={world.client_a.pk}").json()["results"]
    assert sorted(r["details"]["round"] for r in rows) == [1, 2]
    rows = api.get(f"{base}&target_id={world.client_a.pk}&round=2").json()["results"]
    assert [(r["target_id"], r["details"]["round"]) for r in rows] == [(str(world.client_a.pk), 2)]
    refused = api.get("/api/v1/admin/audit/?round=two")
    assert refused.status_code == 400 and "round must be a round number" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("role", "visible"),
    [("operator", {"org-a", "org-b"}), ("admin_a", {"org-a"}), ("admin_b", {"org-b"})],
)
def test_organization_scope(world, role, visible):
    api = _api_for(world, role)
    assert {o["slug"] for o in api.get("/api/v1/admin/organizations/").json()["results"]} == visible
    created = api.post("/api/v1/admin/organizations/", {"name": "Org C"}, format="json")
    assert created.status_code == (201 if role == "operator" else 403)


def test_audit_period_takes_a_date_or_a_datetime(world):
    """A plain date is a whole day, inclusive at both ends (as on the dashboard); a datetime is an
    instant (`since` inclusive, `until` exclusive)."""
    api = person_api(world.operator)

    def count(**params) -> int:
        response = api.get("/api/v1/admin/audit/", params)
        assert response.status_code == 200, response.content
        return response.json()["count"]

    times = sorted(AuditLog.objects.values_list("created_at", flat=True))
    total, first, last = len(times), times[0], times[-1]
    assert total == count() > 0
    day = dt.timedelta(days=1)
    assert count(since=first.date().isoformat()) == total
    assert count(until=last.date().isoformat()) == total  # the whole day, not its first instant
    assert count(since=(last.date() + day).isoformat()) == 0
    assert count(until=(first.date() - day).isoformat()) == 0
    assert count(until=f"{first.date().isoformat()}T00:00:00Z") == 0
    assert count(since=first.isoformat()) == total
    assert count(until=first.isoformat()) == 0  # until an instant: before it
    hour = dt.timedelta(hours=1)
    assert count(since=(last + hour).isoformat()) == 0
    assert count(until=(last + hour).replace(tzinfo=None).isoformat()) == total  # naive: UTC
    assert count(since=(first - hour).strftime("%Y-%m-%dT%H:%M:%SZ")) == total


def test_an_audit_period_that_ends_before_it_starts_is_refused(world, client):
    """`since` after `until` answered an empty log, as if nothing had happened in that period
    (the dashboard's date fields swapped by mistake); a 400 naming both now, on the API and the
    dashboard. One day as both bounds is that whole day."""
    api = person_api(world.operator)
    swapped = api.get("/api/v1/admin/audit/", {"since": "2026-11-30", "until": "2026-11-01"})
    assert swapped.status_code == 400, swapped.content
    assert swapped.json()["detail"] == (
        "since (2026-11-30) is not before until (2026-11-01): no entry is in that period"
    )
    instants = {"since": "2026-11-30T10:00:00Z", "until": "2026-11-30T10:00:00Z"}
    assert api.get("/api/v1/admin/audit/", instants).status_code == 400  # until is exclusive
    today = AuditLog.objects.latest("created_at").created_at.date().isoformat()
    one_day = api.get("/api/v1/admin/audit/", {"since": today, "until": today})
    assert one_day.status_code == 200 and one_day.json()["count"] > 0
    client.force_login(world.operator)
    page = client.get("/audit/", {"since": "2026-11-30", "until": "2026-11-01"})
    assert page.status_code == 400
    assert "is not before until (2026-11-01)" in page.content.decode()


def test_an_audit_period_given_as_a_datetime_is_never_silently_dropped(world):
    """`since=2026-11-30T10:00:00Z` filters; an offset's '+' left unencoded in the URL (a query
    string reads it as a space) is a 400 saying so."""
    api = person_api(world.operator)
    assert api.get("/api/v1/admin/audit/?since=2026-11-30T10:00:00Z").status_code == 200
    assert api.get("/api/v1/admin/audit/?since=2999-11-30T10:00:00Z").json()["count"] == 0
    assert api.get("/api/v1/admin/audit/?since=2999-11-30T10:00:00%2B01:00").json()["count"] == 0
    unencoded = api.get("/api/v1/admin/audit/?since=2999-11-30T10:00:00+01:00")
    assert unencoded.status_code == 400, unencoded.content
    assert unencoded.json()["detail"].startswith("since must be a date YYYY-MM-DD or an ISO 8601 ")
    assert "write '+' as %2B" in unencoded.json()["detail"]


@pytest.mark.parametrize(
    ("path", "params", "detail"),
    [
        ("/api/v1/admin/audit/", {"since": "bad"},
         "since must be a date YYYY-MM-DD or an ISO 8601 datetime (e.g. 2025-01-31T08:00:00Z), "
         "not 'bad'"),
        ("/api/v1/admin/audit/", {"until": "2025-02-30"},
         "until must be a date YYYY-MM-DD or an ISO 8601 datetime (e.g. 2025-01-31T08:00:00Z), "
         "not '2025-02-30'"),
        ("/api/v1/admin/audit/", {"action": "nope"}, "action must be one of "),
        ("/api/v1/admin/clients/", {"status": "nope"}, "status must be one of "),
        ("/api/v1/rounds/", {"state": "nope"}, "state must be one of "),
    ],
)
def test_list_filters_answer_a_detail_naming_the_parameter(world, path, params, detail):
    response = person_api(world.operator).get(path, params)
    assert response.status_code == 400
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"detail"}
    assert body["detail"].startswith(detail)


@pytest.mark.parametrize(
    ("path", "params", "unknown", "takes"),
    [
        ("/api/v1/admin/audit/", {"sinse": "2999-01-01"}, "sinse",
         "action, organization, actor, target_type, target_id, round, since, until, limit, offset"),
        ("/api/v1/admin/audit/", {"organisation": "org-a", "limit": "5"}, "organisation", "since"),
        ("/api/v1/admin/clients/", {"state": "revoked"}, "state", "status, organization, limit"),
        ("/api/v1/admin/people/", {"status": "admin"}, "status", "organization, role, limit"),
        ("/api/v1/admin/organizations/", {"slug": "org-a"}, "slug", "limit, offset"),
        ("/api/v1/rounds/", {"status": "open"}, "status", "state, limit, offset"),
        ("/api/v1/admin/settings/", {"fields": "epsilon_budget"}, "fields", "none"),
        ("/api/v1/compendium/global/", {"rnd": "1"}, "rnd", "round"),
    ],
)
def test_a_query_parameter_a_list_does_not_take_is_refused_not_ignored(
    world, path, params, unknown, takes
):
    """A misspelt filter (?sinse=, ?organisation=, ?status= for ?state=) was ignored: the answer
    was the whole list, as if it had been filtered."""
    response = person_api(world.operator).get(path, params)
    assert response.status_code == 400, response.content
    detail = response.json()["detail"]
    assert detail.startswith(f"unknown query parameter(s): {unknown}; ")
    assert takes in detail


def test_the_query_parameters_a_list_takes_are_still_taken(world):
    api = person_api(world.operator)
    for path, params in [
        ("/api/v1/admin/audit/", {"action": "client.approve", "since": "2000-01-01",
                                  "limit": "1", "offset": "0", "format": "json"}),
        ("/api/v1/admin/clients/", {"status": "approved", "organization": "org-a"}),
        ("/api/v1/admin/people/", {"role": "admin", "organization": "org-a"}),
        ("/api/v1/rounds/", {"state": "open", "format": "json"}),
        ("/api/v1/admin/settings/", {}),
    ]:
        response = api.get(path, params)
        assert response.status_code == 200, (path, response.content)
    listed = client_api(world.token_a).get(SUBMIT, {"round": "1", "limit": "2"})
    assert listed.status_code == 200, listed.content
    refused = client_api(world.token_a).get(SUBMIT, {"rounds": "1"})
    assert refused.status_code == 400 and "rounds" in refused.json()["detail"]


# --- errors outside the views: unknown paths and 500s ---------------------------------------


UNKNOWN_API_PATHS = [
    "/api/v1/rounds/abc/",
    "/api/v1/admin/clients/abc/",
    "/api/v1/no-such-endpoint/",
    "/api/v2/rounds/",
    "/api/",
]


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("path", UNKNOWN_API_PATHS)
def test_an_unknown_api_path_is_a_json_404_with_or_without_debug(world, path, debug):
    with override_settings(DEBUG=debug):
        for api in (person_api(world.operator), client_api()):
            response = api.get(path)
            assert response.status_code == 404
            assert response["Content-Type"] == "application/json"
            assert response.json() == {"detail": f"no API endpoint at {path} (see /api/docs/)"}
        posted = person_api(world.operator).post(path, {}, format="json")
        assert posted.status_code == 404 and posted.json()["detail"].startswith("no API endpoint")


@pytest.mark.parametrize("debug", [True, False])
def test_api_views_keep_their_own_404_and_the_slash_redirect(world, debug):
    with override_settings(DEBUG=debug):
        api = person_api(world.operator)
        missing = api.get("/api/v1/rounds/999/")
        assert missing.status_code == 404
        assert missing.json() == {"detail": "No Round matches the given query."}
        none = api.get("/api/v1/compendium/global/")
        assert none.json() == {"detail": "no global compendium is published yet"}
        redirect = api.get("/api/v1/rounds")
        assert redirect.status_code == 301 and redirect["Location"] == "/api/v1/rounds/"


@pytest.mark.parametrize("debug", [True, False])
def test_dashboard_404_stays_html(client, world, debug):
    client.force_login(world.operator)
    with override_settings(DEBUG=debug):
        response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


def test_an_api_500_is_json_without_debug(world, monkeypatch):
    def broken():
        raise RuntimeError("the schema is gone")

    monkeypatch.setattr(submissions, "schema_in_force", broken)
    api = person_api(world.operator)
    api.raise_request_exception = False
    with override_settings(DEBUG=False):
        response = api.get("/api/v1/compendium/schema/")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": "internal server error"}


def test_the_500_handler_keeps_html_outside_the_api():
    api = server_error(RequestFactory().get("/api/v1/rounds/"))
    assert api.status_code == 500 and json.loads(api.content) == {"detail": "internal server error"}
    page = server_error(RequestFactory().get("/organizations/"))
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("role", ["admin_a", "member_a", "admin_b"])
def test_only_operator_drives_rounds_and_settings(world, role):
    api = _api_for(world, role)
    assert api.post("/api/v1/admin/rounds/", {}, format="json").status_code == 403
    rnd = services.open_round(SYSTEM)
    assert api.post(f"/api/v1/admin/rounds/{rnd.pk}/close/").status_code == 403
    assert api.patch("/api/v1/admin/settings/", {"epsilon_budget": 99}, format="json").status_code == 403
    assert api.get("/api/v1/admin/settings/").status_code == 200
    rnd.refresh_from_db()
    assert rnd.state == "open"


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/admin/clients/",
        "/api/v1/admin/audit/",
        "/api/v1/admin/organizations/",
        "/api/v1/admin/settings/",
    ],
)
def test_admin_endpoints_refuse_clients_and_anonymous(world, path):
    assert client_api(world.token_a).get(path).status_code == 403
    assert client_api().get(path).status_code in (401, 403)


def test_operator_round_lifecycle_over_the_api(world):
    api = person_api(world.operator)
    opened = api.post("/api/v1/admin/rounds/", {"tau": 0.8, "seed": 3}, format="json")
    assert opened.status_code == 201 and opened.json()["config"]["tau"] == 0.8
    rid = opened.json()["id"]
    assert api.post("/api/v1/admin/rounds/", {}, format="json").status_code == 409
    assert api.post("/api/v1/admin/rounds/", {"tau": 2}, format="json").status_code == 400
    # a field cap past the ledger's column is refused naming it, not accepted to fail the merge
    past = api.post("/api/v1/admin/rounds/", {"field_cap": 2**31}, format="json")
    assert past.status_code == 400 and "field_cap" in past.json()["detail"]
    assert api.post(f"/api/v1/admin/rounds/{rid}/retry/").status_code == 409
    closed = api.post(f"/api/v1/admin/rounds/{rid}/close/")
    assert closed.status_code == 200 and closed.json()["state"] == "closing"
    assert api.post(f"/api/v1/admin/rounds/{rid}/close/").status_code == 409
    failed = api.post(f"/api/v1/admin/rounds/{rid}/fail/", {"reason": "edge down"}, format="json")
    assert failed.json()["failure_reason"] == "edge down"
    # The reason is the operator's (a pipeline's can quote any organization's merge): a client,
    # an organization admin and a member read that it failed, on the API and the dashboard.
    listed = {r["id"]: r for r in api.get("/api/v1/rounds/").json()["results"]}
    assert listed[rid]["failure_reason"] == "edge down"
    for other in (client_api(world.token_a), person_api(world.admin_a), person_api(world.member_a)):
        mine = {r["id"]: r for r in other.get("/api/v1/rounds/").json()["results"]}[rid]
        assert (mine["state"], mine["failure_reason"]) == ("failed", services.FAILURE_FOR_THE_OPERATOR)
    from django.test import Client as Browser

    browser = Browser()
    browser.force_login(world.admin_a)
    page = browser.get("/").content.decode()
    assert "edge down" not in page and "the federation operator sees why" in page
    browser.force_login(world.operator)
    assert "edge down" in browser.get("/").content.decode()
    # nobody submitted to it: its merge would fail again at once, so the retry is refused
    refused = api.post(f"/api/v1/admin/rounds/{rid}/retry/")
    assert refused.status_code == 409
    assert "has no submission to merge" in refused.json()["detail"]
    assert "open the next round" in refused.json()["detail"]
    assert not AuditLog.objects.filter(action="round.retry").exists()
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client",
        round=Round.objects.get(pk=rid), client=world.client_a)
    assert api.post(f"/api/v1/admin/rounds/{rid}/retry/").json()["state"] == "closing"
    entry = AuditLog.objects.filter(action="round.retry").get()
    assert entry.actor == world.operator and entry.ip == "127.0.0.1"


def test_a_round_opened_with_a_form_keeps_the_defaults_it_does_not_send(world):
    # A form body without carry_forward opens the round with RoundConfig's default (True), as a
    # JSON body does: a field a form does not send is not an unchecked box.
    api = person_api(world.operator)
    opened = api.post("/api/v1/admin/rounds/", "epsilon=0.5",
                      content_type="application/x-www-form-urlencoded")
    assert opened.status_code == 201, opened.content
    assert Round.objects.get().config["carry_forward"] is True
    assert opened.json()["config"]["epsilon"] == 0.5


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/api/v1/admin/rounds/", {"epsilom": 0.1}, "epsilom"),
        ("/api/v1/admin/rounds/", {"epsilon": 0.5, "conflict_log": False}, "conflict_log"),
        ("/api/v1/admin/settings/", {"epsilon_budjet": 5}, "epsilon_budjet"),
    ],
)
def test_a_field_the_operator_cannot_set_is_refused_naming_it_not_ignored(world, path, body, named):
    # A misspelt ε would otherwise open the round at the default ε (or leave the budget as it was)
    # under a 2xx, as if the request had been applied.
    api = person_api(world.operator)
    send = api.post if path.endswith("rounds/") else api.patch
    response = send(path, body, format="json")
    assert response.status_code == 400, response.content
    assert named in response.json()["detail"]
    assert not Round.objects.exists() and not AuditLog.objects.filter(action="settings.change").exists()


def test_a_rounds_deadline_or_failure_with_a_field_it_does_not_take_is_refused(world, open_round):
    api = person_api(world.operator)
    url = f"/api/v1/admin/rounds/{open_round.pk}/"
    deadline = api.post(url + "deadline/", {"closes_at": None, "closes": "2999-01-01"}, format="json")
    assert deadline.status_code == 400 and "closes" in deadline.json()["detail"]
    services.close_round(SYSTEM, open_round)
    failed = api.post(url + "fail/", {"reason": "edge down", "retry": True}, format="json")
    assert failed.status_code == 400 and "retry" in failed.json()["detail"]
    open_round.refresh_from_db()
    assert open_round.state == Round.State.CLOSING and not open_round.failure_reason


@pytest.mark.parametrize("name", ["a1\u202e", "a\x1b[31m2"])
def test_a_client_named_with_a_control_or_bidi_character_is_refused(world, name):
    response = person_api(world.admin_a).post("/api/v1/admin/clients/", {"name": name}, format="json")
    assert response.status_code == 400 and "a client's name contains" in response.json()["detail"]
    assert not Client.objects.filter(name=name).exists()


@pytest.mark.parametrize("char", ["\u200b", "\u200d", "\u2060", "\ufeff", "\u00ad"])
def test_a_client_named_with_an_invisible_character_is_refused(world, char):
    response = person_api(world.admin_a).post(
        "/api/v1/admin/clients/", {"name": f"laptop{char}7"}, format="json"
    )
    assert response.status_code == 400, response.content
    assert response.json()["detail"].startswith(
        f"a client's name contains an invisible character U+{ord(char):04X}"
    )
    assert not Client.objects.filter(name__startswith="laptop").exists()


@pytest.mark.parametrize("twin", ["a\u00a01", "a\u202f1", "A 1", "a  1"])
def test_a_client_named_as_another_of_its_organization_but_for_spacing_is_a_conflict(world, twin):
    api = person_api(world.admin_a)
    assert api.post("/api/v1/admin/clients/", {"name": "a 1"}, format="json").status_code == 201
    response = api.post("/api/v1/admin/clients/", {"name": twin}, format="json")
    assert response.status_code == 409, response.content
    assert response.json()["detail"].startswith("organization 'org-a' already has a client 'a 1'")
    assert "only in case, spacing or invisible characters" in response.json()["detail"]
    assert not Client.objects.filter(name=twin).exists()
    # another organization's client may bear the name
    other = person_api(world.admin_b).post("/api/v1/admin/clients/", {"name": twin}, format="json")
    assert other.status_code == 201, other.content


def test_descriptions_and_reasons_past_the_dashboards_limits_are_refused_over_the_api(world):
    """The dashboard refused a description past 2000 characters and a revocation's reason past
    500; the API stored them up to the body's limit (megabytes, a reason in the audit log)."""
    operator = person_api(world.operator)
    org = operator.post(
        "/api/v1/admin/organizations/", {"name": "Org C", "description": "d" * 2001}, format="json"
    )
    assert org.status_code == 400, org.content
    assert org.json()["detail"] == "description is at most 2000 characters, not 2001"
    assert not Organization.objects.filter(name="Org C").exists()
    client = person_api(world.admin_a).post(
        "/api/v1/admin/clients/", {"name": "laptop-9", "description": "d" * 2001}, format="json"
    )
    assert client.status_code == 400, client.content
    assert client.json()["detail"] == "description is at most 2000 characters, not 2001"
    assert not Client.objects.filter(name="laptop-9").exists()
    revoked = operator.post(
        f"/api/v1/admin/clients/{world.client_a.pk}/revoke/", {"reason": "r" * 501}, format="json"
    )
    assert revoked.status_code == 400, revoked.content
    assert revoked.json()["detail"] == "reason is at most 500 characters, not 501"
    world.client_a.refresh_from_db()
    assert world.client_a.status == Client.Status.APPROVED
    assert not AuditLog.objects.filter(action="client.revoke").exists()
    # at the limits, as on the dashboard
    assert operator.post("/api/v1/admin/organizations/", {"name": "Org C", "description": "d" * 2000},
                         format="json").status_code == 201


@pytest.mark.parametrize(
    ("text", "words"),
    [("lab \u202eknab", "a bidirectional override U+202E at position 4"),
     ("\x1b[2Jlab", "a control character U+001B at position 0")],
)
def test_a_description_contact_or_reason_that_reads_otherwise_than_stored_is_refused(
    world, text, words
):
    """An organization's or client's description, a client's contact and a revocation's reason
    (kept in the audit log) took bidi overrides and terminal escapes, which names and compendium
    texts refuse: shown on the dashboard, in the audit log or a terminal, they read otherwise
    than they are stored. Newlines and tabs stay allowed."""
    operator = person_api(world.operator)
    org = operator.post("/api/v1/admin/organizations/", {"name": "Org C", "description": text},
                        format="json")
    assert org.status_code == 400, org.content
    assert org.json()["detail"] == f"description contains {words}; remove it"
    admin = person_api(world.admin_a)
    for field in ("description", "contact"):
        client = admin.post("/api/v1/admin/clients/", {"name": "laptop-9", field: text}, format="json")
        assert client.status_code == 400, client.content
        assert client.json()["detail"] == f"{field} contains {words}; remove it"
    revoked = operator.post(
        f"/api/v1/admin/clients/{world.client_a.pk}/revoke/", {"reason": text}, format="json"
    )
    assert revoked.status_code == 400 and revoked.json()["detail"] == f"reason contains {words}; remove it"
    assert not Organization.objects.filter(name="Org C").exists()
    assert not Client.objects.filter(name="laptop-9").exists()
    assert not AuditLog.objects.filter(action="client.revoke").exists()
    fine = admin.post("/api/v1/admin/clients/", {"name": "laptop-9", "description": "two\nlines\tok"},
                      format="json")
    assert fine.status_code == 201, fine.content


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/api/v1/admin/rounds/", {"mask_strength": False}, "mask_strength"),
        ("/api/v1/admin/rounds/", {"tau": True}, "tau"),
        ("/api/v1/admin/settings/", {"epsilon_budget": True}, "epsilon_budget"),
    ],
)
def test_true_or_false_for_a_number_is_refused_not_read_as_one_or_zero(world, path, body, named):
    # Python reads true as 1.0 and false as 0.0: a round opened with λ = 0 (no masking expected),
    # τ = 1, an ε budget of 1, from a body that sent no number at all.
    api = person_api(world.operator)
    send = api.post if path.endswith("rounds/") else api.patch
    response = send(path, body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["detail"].startswith(f"{named}: ")
    assert not Round.objects.exists() and not AuditLog.objects.filter(action="settings.change").exists()


def test_session_login_works_for_people(world):
    api = APIClient()
    api.force_login(world.admin_a)
    assert api.get("/api/v1/admin/clients/").status_code == 200


def test_settings_change_over_the_api_is_audited(world):
    api = person_api(world.operator)
    response = api.patch("/api/v1/admin/settings/", {"allow_admin_approval": True}, format="json")
    assert response.status_code == 200 and response.json()["allow_admin_approval"] is True
    entry = AuditLog.objects.get(action="settings.change")
    assert entry.details == {"allow_admin_approval": {"from": False, "to": True}}
    assert Round.objects.count() == 0


def test_an_empty_settings_change_is_refused_as_a_persons_is(world):
    """PATCH {} changed nothing and answered 200 (a person's PATCH {} is a 400): a body the
    caller meant to fill (a form sent as the wrong content type reads as {}) looked applied."""
    api = person_api(world.operator)
    for body, kind in (({}, "json"), ({}, "multipart")):
        response = api.patch("/api/v1/admin/settings/", body, format=kind)
        assert response.status_code == 400, response.content
        assert response.json()["detail"].startswith("nothing to change: send one or more of "
                                                    "epsilon_budget, delta_prime")
    assert not AuditLog.objects.filter(action="settings.change").exists()


def test_django_admin_pages_render_for_the_operator(world, open_round, valid_doc):
    post_doc(client_api(world.token_a), valid_doc)
    api = APIClient()
    api.force_login(world.operator)
    for model in ("organization", "client", "membership", "round", "submission", "auditlog",
                  "federationsettings"):
        response = api.get(f"/admin/federation/{model}/")
        assert response.status_code == 200, model


def test_the_django_admin_does_not_change_people_organizations_or_clients(world):
    # Those go through the audited services; the admin would skip their checks and the log.
    browser = APIClient()
    browser.force_login(world.operator)
    for model in ("organization", "membership", "client"):
        assert browser.get(f"/admin/federation/{model}/add/").status_code == 403, model
    membership = world.member_a.membership
    url = f"/admin/federation/membership/{membership.pk}/change/"
    browser.post(url, {"user": world.operator.pk, "organization": world.org_a.pk, "role": "admin"})
    membership.refresh_from_db()
    assert (membership.user_id, membership.role) == (world.member_a.pk, "member")
    browser.post(f"/admin/federation/organization/{world.org_a.pk}/delete/", {"post": "yes"})
    assert Organization.objects.filter(pk=world.org_a.pk).exists()


def test_the_django_admin_does_not_change_a_rounds_deadline(world, open_round):
    # Deadlines change through set_round_deadline (checked, audited); the admin shows rounds
    # read-only, the deadline too.
    services.set_round_deadline(SYSTEM, open_round, timezone.now() + dt.timedelta(hours=1))
    before = Round.objects.get(pk=open_round.pk).closes_at
    browser = APIClient()
    browser.force_login(world.operator)
    url = f"/admin/federation/round/{open_round.pk}/change/"
    assert 'name="closes_at' not in browser.get(url).content.decode()
    browser.post(url, {"closes_at_0": "2001-01-01", "closes_at_1": "00:00:00"})
    assert Round.objects.get(pk=open_round.pk).closes_at == before
    assert AuditLog.objects.filter(action="round.deadline").count() == 1


def test_organization_admin_can_log_in_to_the_browsable_api(world):
    world.admin_a.set_password("a-long-demo-password")
    world.admin_a.save()
    browser = APIClient(enforce_csrf_checks=False)
    assert browser.get("/api-auth/login/").status_code == 200
    browser.post(
        "/api-auth/login/", {"username": "admin_a", "password": "a-long-demo-password"}
    )
    page = browser.get("/api/v1/admin/clients/", HTTP_ACCEPT="text/html")
    assert page.status_code == 200 and b"a-pending" in page.content and b"b-pending" not in page.content


def test_the_browsable_apis_forms_offer_the_fields_each_request_takes(world):
    # Its HTML forms are built from the view's serializer: the enrollment and revocation forms
    # offered a client's fields (status among them), which those requests refuse as unknown.
    browser = APIClient()
    browser.force_login(world.admin_a)
    enroll = browser.get("/api/v1/admin/clients/", HTTP_ACCEPT="text/html").content.decode()
    assert 'name="contact"' in enroll and 'name="status"' not in enroll
    revoke_url = f"/api/v1/admin/clients/{world.client_a.pk}/revoke/"
    revoke = browser.get(revoke_url, HTTP_ACCEPT="text/html").content.decode()
    assert 'name="reason"' in revoke and 'name="status"' not in revoke
    people = browser.get("/api/v1/admin/people/", HTTP_ACCEPT="text/html").content.decode()
    assert 'name="username"' in people
    revoked = browser.post(revoke_url, {"reason": "lost laptop"}, HTTP_ACCEPT="text/html")
    assert revoked.status_code == 200
    world.client_a.refresh_from_db()
    assert world.client_a.status == "revoked"


def test_openapi_schema_has_no_warnings_or_errors(tmp_path):
    from django.core.management import call_command

    out = tmp_path / "schema.yml"
    # --fail-on-warn exits non-zero on any warning or error of the generator or the validator.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    text = out.read_text()
    assert "/api/v1/submissions/" in text and "clientToken" in text


def test_a_clients_token_issue_time_is_written_as_its_other_times(world):
    """GET /api/v1/admin/clients/ wrote `created_at` as DRF writes every time
    ("2026-11-30T22:18:45.817644Z") but `token_issued_at` by isoformat ("…+00:00"): two formats
    in one object, for a script to parse both. Both are now written the same way."""
    row = person_api(world.operator).get(f"/api/v1/admin/clients/{world.client_a.pk}/").json()
    assert row["created_at"].endswith("Z")
    assert row["token_issued_at"].endswith("Z") and "+00:00" not in row["token_issued_at"]
    issued = world.client_a.token.issued_at
    assert row["token_issued_at"] == issued.isoformat().replace("+00:00", "Z")
