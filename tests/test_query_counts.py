"""N+1 audit: every dashboard page and REST API list endpoint, for the operator and an
organization admin, makes as many SQL queries at a small federation as after more rows of what
it lists (clients, people, rounds, submissions, conflicts and their decisions, ledger rows, merge
records, simulation runs, audit entries, tokens). A count that grows with the rows is a query a
row: the page then reads the database once per line it shows."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from compendium.models import CompendiumVersion
from federation import accounting, services
from federation.models import (
    Client,
    ConflictDecision,
    ConflictLogEntry,
    FederationSettings,
    Membership,
    MergeRecord,
    PrivacyLedgerEntry,
    Round,
    SimulationRun,
    Submission,
)
from routing.models import RoutingToken
from tests.federation_fixtures import SYSTEM, client_api, make_user
from tests.test_dashboard_pages import DOCUMENT

pytestmark = pytest.mark.django_db

PAGES = [
    "dashboard:overview", "dashboard:organizations", "dashboard:organization",
    "dashboard:conflicts", "dashboard:privacy", "dashboard:accuracy", "dashboard:compendium",
    "dashboard:tools", "dashboard:routing", "dashboard:audit", "dashboard:settings",
    "dashboard:tokens",
]
PERSON_API = [
    "/api/v1/rounds/", "/api/v1/rounds/{round}/", "/api/v1/admin/organizations/",
    "/api/v1/admin/organizations/{org}/", "/api/v1/admin/clients/", "/api/v1/admin/people/",
    "/api/v1/admin/audit/", "/api/v1/admin/settings/", "/api/v1/compendium/schema/",
]
CLIENT_API = ["/api/v1/submissions/", "/api/v1/rounds/"]


def _client_submission(client, round_, key):
    version = CompendiumVersion.objects.create(
        kind="client", round=round_, client=client, organization=client.organization,
        schema_version="1", content={}, sha256="0" * 64, size_bytes=1, gzip_bytes=1,
    )
    Submission.objects.create(client=client, round=round_, idempotency_key=key,
                              request_sha256="0" * 64, version=version, response={})


def _more_rows(fed, numbers):
    """For each number: a published round with, at each organization, a new approved client and
    member (with an API token), a submission of the new and of the fixture's client, a conflict
    and its decision, a ledger row and a merge record; a server merge record, a simulation run, a
    routing token, tokens of the operator and admin A, and a submission to the open round 2."""
    open_round = Round.objects.get(number=2)
    for i in numbers:
        round_ = Round.objects.create(number=100 + i, state=Round.State.PUBLISHED,
                                      config={"epsilon": 1.0})
        for org, own in ((fed.org_a, fed.client_a), (fed.org_b, fed.client_b)):
            client = services.enroll_client(SYSTEM, org, f"{org.slug}-more-{i}")
            services.approve_client(SYSTEM, client)
            client = Client.objects.get(pk=client.pk)
            services.issue_user_token(SYSTEM, make_user(f"{org.slug}-m{i}", org, Membership.Role.MEMBER))
            _client_submission(client, round_, f"k{i}")
            _client_submission(client, open_round, f"o{i}")
            _client_submission(own, round_, f"own{i}")
            ConflictLogEntry.objects.create(
                round=round_, organization=org, tool_id="weather", centroid_id=f"c{i}",
                centroid={"text": f"Rain at {i}?", "preconditions": {"has_city": True}},
                dissenters=[{"text": f"Rain at {i}", "preconditions": {"has_city": False}}],
                reason="preconditions disagree",
            )
            ConflictDecision.objects.create(round=round_, organization=org, tool_id="weather",
                                            centroid_id=f"c{i}", action="dismiss",
                                            decided_by=fed.operator)
            PrivacyLedgerEntry.objects.create(
                round=round_, organization=org, tool_id="weather", field="calls", sensitivity=1.0,
                contributors=3, epsilon=0.01, noise_scale=100.0, mechanism="laplace",
            )
            MergeRecord.objects.create(round=round_, organization=org, stats={"scenarios_in": 4})
        MergeRecord.objects.create(round=round_, organization=None, stats={}, accuracy=0.5)
        SimulationRun.objects.create(label=f"run {i}", dataset="tiny", document=DOCUMENT)
        RoutingToken.issue(f"app {i}")
        services.issue_user_token(SYSTEM, fed.operator)
        services.issue_user_token(SYSTEM, fed.admin_a)


def _more_organizations(fed, numbers):
    """For each number: an organization with an admin, a member and an approved client that
    submitted to the published round 1 and the open round 2, and in round 1 a conflict, a
    decision, a ledger row, a merge record and an edge compendium."""
    round_1, open_round = Round.objects.get(number=1), Round.objects.get(number=2)
    for i in numbers:
        org = services.create_organization(SYSTEM, f"Org {i}", f"org-more-{i}")
        make_user(f"org-more-{i}-admin", org, Membership.Role.ADMIN)
        make_user(f"org-more-{i}-member", org, Membership.Role.MEMBER)
        client = services.enroll_client(SYSTEM, org, f"org-more-{i}-client")
        services.approve_client(SYSTEM, client)
        client = Client.objects.get(pk=client.pk)
        _client_submission(client, round_1, "r1")
        _client_submission(client, open_round, "r2")
        CompendiumVersion.objects.create(
            kind="edge", round=round_1, organization=org, schema_version="1", content={},
            sha256="1" * 64, size_bytes=1, gzip_bytes=1,
        )
        ConflictLogEntry.objects.create(
            round=round_1, organization=org, tool_id="weather", centroid_id="c0",
            centroid={"text": "Rain?", "preconditions": {"has_city": True}},
            dissenters=[{"text": "Rain", "preconditions": {"has_city": False}}],
            reason="preconditions disagree",
        )
        ConflictDecision.objects.create(round=round_1, organization=org, tool_id="weather",
                                        centroid_id="c0", action="dismiss", decided_by=fed.operator)
        PrivacyLedgerEntry.objects.create(
            round=round_1, organization=org, tool_id="weather", field="calls", sensitivity=1.0,
            contributors=3, epsilon=0.01, noise_scale=100.0, mechanism="laplace",
        )
        MergeRecord.objects.create(round=round_1, organization=org, stats={"scenarios_in": 4})


def _query_counts(browser, fed, role, token) -> dict[str, tuple[int, int]]:
    """(status, queries) of each page and endpoint, as `role` (the client endpoints as client A)."""
    counts = {}

    def count(name, get, url):
        with CaptureQueriesContext(connection) as captured:
            status = get(url).status_code
        counts[name] = (status, len(captured))

    browser.force_login(getattr(fed, role))
    for name in PAGES:
        count(name, browser.get,
              reverse(name, args=["org-a"]) if name == "dashboard:organization" else reverse(name))
    person, client = client_api(token), client_api(fed.token_a)
    ids = {"round": Round.objects.get(number=2).pk, "org": fed.org_a.pk}
    for url in PERSON_API:
        count(url, person.get, url.format(**ids))
    for url in CLIENT_API:
        count(f"client {url}", client.get, url)
    return counts


def _counts_do_not_grow(client, fed, role, more, what: str) -> None:
    """Every page's and endpoint's query count with `more(fed, range(2))` added, then the same
    after `more(fed, range(2, 12))`: none may grow."""
    token = services.issue_user_token(SYSTEM, getattr(fed, role))
    more(fed, range(2))
    _query_counts(client, fed, role, token)  # the caches a first request fills
    small = _query_counts(client, fed, role, token)
    assert all(status == 200 for status, _ in small.values()), small
    more(fed, range(2, 12))
    grown = _query_counts(client, fed, role, token)
    assert {k: v for k, v in grown.items() if v != small[k]} == {}, (
        f"query count grew with the {what}: " + ", ".join(
            f"{k} {small[k][1]} -> {grown[k][1]}" for k in small if grown[k] != small[k]))


@pytest.mark.parametrize("role", ["operator", "admin_a"])
def test_no_page_or_list_endpoint_makes_a_query_per_row(client, fed, role):
    # a small federation: some rows of every kind a page lists, then more
    _counts_do_not_grow(client, fed, role, _more_rows, "rows")


@pytest.mark.parametrize("role", ["operator", "admin_a"])
def test_no_page_or_list_endpoint_makes_a_query_per_organization(client, fed, role):
    """The same at a federation of more organizations (each with its people, client, submissions,
    conflict, ledger row and merge record): a page reading the database once per organization
    (the operator's, which lists them all, or a member's, whose page still composes the
    federation's figures) grows with the federation."""
    _counts_do_not_grow(client, fed, role, _more_organizations, "organizations")


def _failed_rounds(fed, numbers):
    """For each number: a failed round after the last published one, with a submission of client
    A still to merge (the overview offers the operator its Retry, or says why the budget refuses
    it)."""
    for i in numbers:
        round_ = Round.objects.create(number=200 + i, state=Round.State.FAILED,
                                      config={"epsilon": 1.0}, failure_reason="worker lost")
        _client_submission(fed.client_a, round_, f"failed{i}")


def test_the_overview_reads_the_budget_once_for_every_failed_round(client, fed):
    """The overview tells, of each failed round it could retry, whether the privacy budget would
    refuse the retry: one reading of the ledger and the settings for all of them, not a reading
    per failed round (a run of failed merges made the operator's overview slower with each)."""
    client.force_login(fed.operator)
    _failed_rounds(fed, range(1))
    client.get(reverse("dashboard:overview"))  # the caches a first request fills

    def count():
        with CaptureQueriesContext(connection) as captured:
            response = client.get(reverse("dashboard:overview"))
        assert response.status_code == 200
        return len(captured), response.content.decode().count("Retry")

    small, retries_small = count()
    _failed_rounds(fed, range(1, 6))
    grown, retries_grown = count()
    assert retries_grown > retries_small > 0
    assert grown == small, f"overview: {small} queries at one failed round, {grown} at six"


@pytest.mark.parametrize(("budget", "refused"), [(1.0, 2), (2.5, 1), (100.0, 0)])
def test_the_retry_refusals_read_at_once_are_those_of_each_round(fed, budget, refused):
    """retry_budget_refusals (the overview's and retry_round's, one ledger reading) says of each
    failed round what the budget check of its reservation alone says: a round with ledger rows
    (nothing reserved), one without."""
    _failed_rounds(fed, range(2))
    with_rows = Round.objects.get(number=200)
    PrivacyLedgerEntry.objects.create(
        round=with_rows, organization=fed.org_a, tool_id="weather", field="calls", sensitivity=1.0,
        contributors=3, epsilon=0.3, noise_scale=1.0, mechanism="laplace",
    )
    services.get_settings()
    # below what is committed already (2.3), which update_settings refuses: both retries refused
    FederationSettings.objects.filter(pk=1).update(epsilon_budget=budget)
    failed = list(Round.objects.filter(state=Round.State.FAILED))
    expected = {r.pk: accounting.budget_refusal(accounting.round_reservation(r),
                                                f"retrying round {r.number}") for r in failed}
    assert services.retry_budget_refusals(failed) == expected
    assert sum(bool(refusal) for refusal in expected.values()) == refused


def _published_ledger_rounds(fed, numbers):
    """For each number: a published round whose edges (A and B) released weather's statistics."""
    for n in numbers:
        round_ = Round.objects.create(number=n, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
        for org in (fed.org_a, fed.org_b):
            for release in (0, 1):  # a re-release (an erasure's) after the first
                for field in ("calls", "success_rate"):
                    PrivacyLedgerEntry.objects.create(
                        round=round_, organization=org, release=release, tool_id="weather",
                        field=field, sensitivity=1.0, contributors=3, epsilon=0.01,
                        noise_scale=100.0 + release, mechanism="laplace",
                    )


def _ledger_rows_read(browser, url) -> dict[str, int]:
    """{query: rows it returned} of the queries of the privacy ledger that answering `url` made."""
    read = {}

    def count_rows(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if "federation_privacyledgerentry" in sql and sql.lstrip().startswith("SELECT"):
            read[sql[:160]] = read.get(sql[:160], 0) + context["cursor"].rowcount
        return result

    with connection.execute_wrapper(count_rows):
        assert browser.get(url).status_code == 200
    return read


@pytest.mark.parametrize("role", ["operator", "admin_a"])
def test_the_compendium_page_reads_the_ledger_rows_of_the_rounds_it_shows(client, fed, role):
    """The noise scales behind a global's statistics are those of the round that released them:
    the page reads those rows, not every ledger row of every earlier round (which grew with each
    round the federation published, rows per tool · field · edge · release)."""
    from compendium.schema import Compendium, ToolMetadata
    from compendium.services import store_compendium

    _published_ledger_rounds(fed, [500])
    store_compendium(
        Compendium(metadata=[ToolMetadata(tool_id="weather",
                                          stats={"calls": 3.0, "success_rate": 0.5})]),
        kind="global", round=Round.objects.get(number=500),
    )
    client.force_login(getattr(fed, role))
    _published_ledger_rounds(fed, range(10, 12))
    small = _ledger_rows_read(client, reverse("dashboard:compendium"))
    _published_ledger_rounds(fed, range(12, 40))
    grown = _ledger_rows_read(client, reverse("dashboard:compendium"))
    assert grown == small, f"ledger rows read grew with the rounds: {small} -> {grown}"
    card = client.get(reverse("dashboard:compendium")).context["cards"][0]
    # the latest release of round 500 at each edge the viewer may see
    assert {s["field"]: s["noise_scale"] for s in card.stats} == {
        "calls": 101.0, "success_rate": 101.0}


@pytest.mark.parametrize(("counts_a", "edges"), [
    (None, 2),                   # no edge compendium stored for A: its rows count
    ({"metadata": 2}, 2),        # A's edge carries statistics
    ({"metadata": 0}, 1),        # re-materialized without statistics (an erasure past the budget)
    ({"scenarios": 4}, 1),       # no metadata count at all
    ({"metadata": None}, 1),
    ({}, 1),
])
def test_the_ledger_rows_of_an_edge_without_statistics_back_nothing(client, fed, counts_a, edges):
    """The rows the compendium page reads leave out, in the database, those of an edge whose
    compendium carries no statistics (entry_counts' metadata missing, 0 or null), as the page
    did in Python when it read every row."""
    from compendium.schema import Compendium, ToolMetadata
    from compendium.services import store_compendium

    _published_ledger_rounds(fed, [500])
    round_ = Round.objects.get(number=500)
    store_compendium(Compendium(metadata=[ToolMetadata(tool_id="weather", stats={"calls": 3.0})]),
                     kind="global", round=round_)
    for org, counts in ((fed.org_a, counts_a), (fed.org_b, {"metadata": 3})):
        if counts is not None:
            CompendiumVersion.objects.create(
                kind="edge", round=round_, organization=org, schema_version="1", content={},
                sha256="1" * 64, size_bytes=1, gzip_bytes=1, entry_counts=counts,
            )
    client.force_login(fed.operator)
    card = client.get(reverse("dashboard:compendium")).context["cards"][0]
    assert card.stats[0]["edges"] == edges


@pytest.mark.parametrize("role", ["operator", "admin_a"])
def test_no_dashboard_page_reads_the_globals_routing_heads(client, fed, role):
    """A published global carries its routing head (the linear head's weights, about half a
    megabyte at 199 tools): the pages that list or show globals (the overview's rounds, the
    compendium's round picker, the tool registry) need none of it, and read it from no row."""
    from compendium.schema import Compendium, ToolMetadata
    from compendium.services import store_compendium

    for number in (1, 3):
        round_ = Round.objects.get(number=1) if number == 1 else Round.objects.create(
            number=3, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
        store_compendium(
            Compendium(metadata=[ToolMetadata(tool_id="weather", stats={"calls": 3.0})]),
            kind="global", round=round_, routing_head=b"\0" * 1000,
        )
    client.force_login(getattr(fed, role))
    for name in PAGES:
        url = reverse(name, args=["org-a"]) if name == "dashboard:organization" else reverse(name)
        with CaptureQueriesContext(connection) as captured:
            assert client.get(url).status_code == 200
        read = [q["sql"][:120] for q in captured if '"routing_head"' in q["sql"]]
        assert read == [], f"{name} read routing heads: {read}"
