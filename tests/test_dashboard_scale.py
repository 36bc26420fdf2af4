"""The dashboard at a federation of many clients: the Overview's bytes chart drawn per
organization above 12 clients, its client table paginated and filtered, the open round's waiting
clients named up to 50; the Privacy page's ledger aggregations made once each; the audit log's
filters served by indexes."""

from __future__ import annotations

import html
import re
import statistics

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from compendium.models import CompendiumVersion
from federation.models import Client, Round, Submission
from tests.test_dashboard import figures_in

pytestmark = pytest.mark.django_db

BYTES_CHART_CLIENTS = 12  # the owner's decision: a line per client up to 12 clients
WAITING_SHOWN = 50  # the open round's waiting clients named above the table


def _clients(org, count: int, prefix: str, status=Client.Status.APPROVED) -> list[Client]:
    return Client.objects.bulk_create(
        Client(organization=org, name=f"{prefix}-{i:03d}", status=status) for i in range(count))


def _submit(clients, round_, size=lambda i: 1000 + 10 * i, wire=None) -> None:
    """A client submission of each of `clients` to `round_`: canonical `size(i)` bytes, sent as
    `wire(i)` bytes dcz (plain where `wire` is None)."""
    versions = CompendiumVersion.objects.bulk_create(
        CompendiumVersion(kind="client", round=round_, client=c, organization=c.organization,
                          schema_version="1", content={}, sha256="0" * 64,
                          size_bytes=size(i), gzip_bytes=size(i) // 2)
        for i, c in enumerate(clients))
    Submission.objects.bulk_create(
        Submission(client=c, round=round_, idempotency_key=f"k{round_.number}",
                   request_sha256="0" * 64, version=v, response={},
                   wire_bytes=None if wire is None else wire(i),
                   content_encoding="" if wire is None else "dcz")
        for i, (c, v) in enumerate(zip(clients, versions, strict=True)))


def _bytes_chart(client) -> dict:
    body = client.get(reverse("dashboard:overview")).content.decode()
    return next(f for f in figures_in(body) if "Bytes" in f["layout"]["title"]["text"])


# --- the bytes chart -------------------------------------------------------------------------------


def test_the_bytes_chart_draws_a_line_per_client_up_to_twelve_clients(client, fed):
    round_1 = Round.objects.get(number=1)
    clients = [fed.client_a, fed.client_b] + _clients(fed.org_a, BYTES_CHART_CLIENTS - 2, "n")
    _submit(clients, round_1)
    client.force_login(fed.operator)
    chart = _bytes_chart(client)
    assert len(chart["data"]) == BYTES_CHART_CLIENTS
    assert {t["name"] for t in chart["data"]} == {str(c) for c in clients}
    assert 'id="bytes-caption"' not in client.get(reverse("dashboard:overview")).content.decode()


def test_the_bytes_chart_draws_organizations_above_twelve_clients(client, fed):
    """At 13 clients with points a line per organization: the median over its clients of the
    bytes each sent in a round (dcz bytes where recorded, canonical ones otherwise), with bars
    from the least to the most, and how many clients the round counted on hover; a caption says
    why and points to the table."""
    round_1, round_2 = Round.objects.get(number=1), Round.objects.get(number=2)
    many = _clients(fed.org_a, 11, "n")
    _submit([fed.client_a] + many, round_1, wire=lambda i: 500 + 100 * i)  # A: 12 clients
    _submit([fed.client_b], round_1, size=lambda i: 7000)  # B: one client, sent plain
    _submit(many[:2] + [fed.client_b], round_2, size=lambda i: 3000 + 1000 * i)
    Client.objects.filter(pk=many[0].pk).update(status=Client.Status.REVOKED)  # still drawn
    client.force_login(fed.operator)
    chart = _bytes_chart(client)
    traces = {t["name"]: t for t in chart["data"] if t.get("meta") != "error bars"}
    assert set(traces) == {"Org A", "Org B"}
    a, b = traces["Org A"], traces["Org B"]
    sent_a1 = [(500 + 100 * i) / 1000 for i in range(12)]
    assert list(a["x"]) == [1, 2]
    assert a["y"] == [pytest.approx(statistics.median(sent_a1)), pytest.approx(3.5)]
    assert [row[0] for row in a["customdata"]] == [12, 2]  # clients each round counted
    assert "client(s)" in a["hovertemplate"]
    bars = a["error_y"]
    assert bars["symmetric"] is False
    assert bars["array"] == [pytest.approx(max(sent_a1) - statistics.median(sent_a1)),
                             pytest.approx(0.5)]
    assert bars["arrayminus"] == [pytest.approx(statistics.median(sent_a1) - min(sent_a1)),
                                  pytest.approx(0.5)]
    # B: one client a round, no spread: no bar (plotly would draw a "± 0")
    assert b["y"] == [7.0, 5.0] and not b.get("error_y", {}).get("array")
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    caption = re.search(r'id="bytes-caption">([^<]*)<', body).group(1)
    assert "because 13 clients sent submissions" in caption and "table below" in caption
    # a member sees its organization's clients only: one, a line per client again
    client.force_login(fed.admin_b)
    assert [t["name"] for t in _bytes_chart(client)["data"]] == [str(fed.client_b)]


def test_an_organization_line_with_some_spread_draws_its_bars_from_a_companion(client, fed):
    """A round that one client of an organization counted has no bar, another that several did
    has one: add_with_error_bars draws them from an unlisted companion trace."""
    round_1, round_2 = Round.objects.get(number=1), Round.objects.get(number=2)
    many = _clients(fed.org_a, 13, "n")
    _submit(many, round_1)
    _submit(many[:1], round_2)
    client.force_login(fed.operator)
    data = _bytes_chart(client)["data"]
    [line] = [t for t in data if t.get("meta") != "error bars"]
    [bars] = [t for t in data if t.get("meta") == "error bars"]
    assert line["x"] == [1, 2] and bars["x"] == [1]
    assert bars["error_y"]["array"] == [pytest.approx(0.06)]  # 1.12 kB most, 1.06 median
    assert bars["error_y"]["arrayminus"] == [pytest.approx(0.06)]


# --- the client table ------------------------------------------------------------------------------


def _table(response) -> list[str]:
    return [row.client.name for row in response.context["overview"].clients]


def test_the_client_table_is_paginated_keeping_the_totals(client, fed):
    _clients(fed.org_a, 70, "n")
    _clients(fed.org_b, 40, "m", status=Client.Status.PENDING)
    client.force_login(fed.operator)
    url = reverse("dashboard:overview")
    first = client.get(url)
    assert len(_table(first)) == 50
    totals = first.context["overview"].totals
    assert totals["clients"] == 114 and totals["approved_clients"] == 72
    body = first.content.decode()
    assert "page 1 of 3 (114 clients)" in body and '?page=2#client-list"' in body
    assert len(_table(client.get(url, {"page": 3}))) == 14
    # a page past the last is the last, one that is not a number the first: never a 500
    assert _table(client.get(url, {"page": 99})) == _table(client.get(url, {"page": 3}))
    assert _table(client.get(url, {"page": "x"})) == _table(first)
    # every client once over the pages
    shown = sum((_table(client.get(url, {"page": n})) for n in (1, 2, 3)), [])
    assert len(shown) == len(set(shown)) == 114
    # a member sees its own organization's clients and totals
    client.force_login(fed.admin_b)
    response = client.get(url)
    assert response.context["overview"].totals["clients"] == 42
    assert all(row.client.organization_id == fed.org_b.pk
               for row in response.context["overview"].clients)


def test_the_client_table_filters_by_organization_status_and_waiting(client, fed):
    open_round = Round.objects.get(number=2)
    waiting = _clients(fed.org_b, 60, "w")
    _submit(waiting[:5] + [fed.client_a], open_round)
    _clients(fed.org_b, 3, "r", status=Client.Status.REVOKED)
    client.force_login(fed.operator)
    url = reverse("dashboard:overview")
    response = client.get(url, {"organization": "org-a"})
    assert sorted(_table(response)) == ["a-pending", "a1"]
    assert response.context["overview"].totals["clients"] == 67  # the totals are not filtered
    assert sorted(_table(client.get(url, {"status": "revoked"}))) == ["r-000", "r-001", "r-002"]
    assert sorted(_table(client.get(url, {"status": "pending", "organization": "org-b"}))) == [
        "b-pending"]
    response = client.get(url, {"waiting": "1"})
    assert response.context["overview"].client_page.paginator.count == 56  # b1 and 55 of w
    assert "w-000" not in _table(response) and "a1" not in _table(response)
    # the page links keep the filters
    body = client.get(url, {"waiting": "1", "organization": "org-b"}).content.decode()
    assert "?waiting=1&amp;organization=org-b&amp;page=2#client-list" in body
    # the form works without JavaScript: a GET form with the filters as they stand
    form = body.split('id="client-filters"')[1].split("</form>")[0]
    assert 'value="org-b" selected' in form and 'name="waiting" value="1" checked' in form
    assert 'method="get"' in body.split('id="client-filters"')[0][-200:]
    assert "No client matches" in client.get(
        url, {"organization": "org-a", "status": "revoked"}).content.decode()


@pytest.mark.parametrize(("params", "message"), [
    ({"status": "gone"}, "status must be one of pending, approved, revoked, not 'gone'"),
    ({"organization": "nowhere"}, "no organization 'nowhere' among those you can see"),
    ({"organization": "org-b"}, "no organization 'org-b' among those you can see"),  # not hers
    ({"waiting": "yes"}, "waiting must be 1 (or left out), not 'yes'"),
])
def test_a_client_filter_it_cannot_take_is_a_400_naming_it(client, fed, params, message):
    client.force_login(fed.admin_a)
    response = client.get(reverse("dashboard:overview"), params)
    assert response.status_code == 400
    assert message in html.unescape(response.content.decode())


def test_the_waiting_filter_without_an_open_round_says_so(client, fed):
    Round.objects.filter(number=2).update(state=Round.State.CLOSING)
    client.force_login(fed.operator)
    response = client.get(reverse("dashboard:overview"), {"waiting": "1"})
    assert response.status_code == 200 and 'id="no-open-round"' in response.content.decode()
    assert len(_table(response)) == 4


def test_the_open_rounds_waiting_clients_are_named_up_to_50_with_a_link_to_all(client, fed):
    _clients(fed.org_a, 70, "w")  # with b1: 71 approved clients have not submitted
    _submit([fed.client_a], Round.objects.get(number=2))
    client.force_login(fed.operator)
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    notice = re.search(r'id="open-round-participation"[^>]*>(.*?)</p>', body, re.S).group(1)
    assert "of 72 approved clients, 71 have not submitted yet (the first 50: " in notice
    assert notice.count("org-a/w-") + notice.count("org-b/b1") == WAITING_SHOWN
    assert '?waiting=1#client-list" id="waiting-link">all 71 in the table</a>' in notice
    confirm = re.search(r'data-confirm="(Close round 2[^"]*)"', body).group(1)
    assert "71 of 72 approved clients have not submitted" in confirm
    assert "and 21 more)" in confirm and confirm.count("org-a/w-") <= WAITING_SHOWN


def _overview_queries(client, params=None) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(reverse("dashboard:overview"), params or {}).status_code == 200
    return len(captured)


@pytest.mark.parametrize("params", [{}, {"page": "2"}, {"waiting": "1", "organization": "org-a"}])
def test_the_overviews_queries_do_not_grow_with_clients_and_rounds(client, fed, params):
    """Past a page of clients and past 12 clients with points (the chart per organization) the
    Overview makes as many queries as at a few clients: none per client, round or page."""
    client.force_login(fed.operator)
    round_1, open_round = Round.objects.get(number=1), Round.objects.get(number=2)
    _submit(_clients(fed.org_a, 3, "n"), round_1)
    _overview_queries(client, params)  # the caches a first request fills
    small = _overview_queries(client, params)
    for number in range(3, 9):
        rnd = Round.objects.create(number=100 + number, state=Round.State.PUBLISHED,
                                   config={"epsilon": 1.0})
        _submit(_clients(fed.org_a, 20, f"x{number}"), rnd)
    _submit(list(Client.objects.filter(name__startswith="x3")), open_round)
    assert Client.objects.count() > 100
    assert _overview_queries(client, params) == small


# --- the privacy page ------------------------------------------------------------------------------


def _ledger_reads(client, params=None) -> tuple[list[str], object]:
    """The SQL of the queries on the ledger that answering the Privacy page made, and the
    response."""
    with CaptureQueriesContext(connection) as captured:
        response = client.get(reverse("dashboard:privacy"), params or {})
    assert response.status_code == 200
    return [q["sql"] for q in captured if "federation_privacyledgerentry" in q["sql"]], response


@pytest.mark.parametrize("role", ["operator", "admin_a"])
@pytest.mark.parametrize("params", [{}, {"round": "3"}])
def test_the_privacy_page_aggregates_the_ledger_once(client, fed, role, params):
    """The budget figures, the charts, what the noise leaves of each edge's latest release and
    the ledger table's row count all come from one grouped reading of the ledger (two queries:
    releases without and under a field cap); the only other query on it is the table's page of
    rows. It aggregated the whole ledger again for each edge's latest round, its latest
    release, their figures and the count (about 200 ms at 146,000 rows)."""
    from federation.models import PrivacyLedgerEntry

    for number in (3, 4):
        rnd = Round.objects.create(number=number, state=Round.State.PUBLISHED,
                                   config={"epsilon": 1.0})
        for org, cap in ((fed.org_a, 2), (fed.org_b, None)):
            for release in (0, 1):
                for tool in ("weather", "flights"):
                    PrivacyLedgerEntry.objects.create(
                        round=rnd, organization=org, release=release, tool_id=tool,
                        field="calls", sensitivity=1.0, contributors=5 + release, epsilon=0.1,
                        noise_scale=1.0, mechanism="laplace", field_cap=cap)
    client.force_login(getattr(fed, role))
    reads, response = _ledger_reads(client, params)
    aggregations = [sql for sql in reads if "LIMIT" not in sql]
    assert len(aggregations) == 2 and all("GROUP BY" in sql for sql in aggregations), aggregations
    assert len(reads) == 3
    visible = PrivacyLedgerEntry.objects.filter(
        organization__in=response.context["organizations"],
        **({"round__number": 3} if params else {}))
    assert response.context["page_obj"].paginator.count == visible.count()
    signal = {row["organization"]: row for row in response.context["privacy"].signal}
    assert signal["Org A"]["round"] == 4 and signal["Org A"]["releases"] == 2
    assert signal["Org A"]["k_min"] == signal["Org A"]["k_max"] == 6  # release 1's
    assert signal["Org A"]["field_cap"] == 2 and signal["Org A"]["noisy"] == 2
    # a tool filter, which the releases do not break down, is counted by the database
    reads, response = _ledger_reads(client, {"tool": "flig"})
    assert response.context["page_obj"].paginator.count == PrivacyLedgerEntry.objects.filter(
        organization__in=response.context["organizations"], tool_id="flights").count()


# --- the audit log's filters -----------------------------------------------------------------------


def _plan(queryset) -> str:
    """PostgreSQL's plan of `queryset` with sequential scans priced out: an index the filter's
    SQL can use is then used (on a test's small table a scan would otherwise win)."""
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = on")
    return plan


@pytest.mark.parametrize(("filters", "index"), [
    ({"target_type": "client", "target_id": "7"}, "audit_target_created"),
    ({"action": "submission.unmasked", "target_type": "client", "target_id": "7"},
     "audit_target_created"),
    ({"round": "4"}, "audit_details_round"),
])
def test_the_audit_filters_use_their_indexes(fed, filters, index):
    """The audit page's and the API's filters on target_type / target_id and on the round
    (details__round, ("details" -> 'round') = '4'::jsonb in SQL: the index is on that very
    expression) are served by an index, the page's 50 rows and its count, not by a scan of the
    whole log (9 ms and 33 ms a filter at 100,000 entries, growing with the log)."""
    from federation.dashboard.services import audit_entries
    from federation.models import AuditLog, Organization

    AuditLog.objects.bulk_create(
        AuditLog(actor_label="test", action=AuditLog.Action.SUBMISSION_UNMASKED,
                 organization=fed.org_a, target_type="client" if i % 3 else "round",
                 target_id=str(i % 40), details={"round": i % 30})
        for i in range(600))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE federation_auditlog")
    entries = audit_entries(Organization.objects.all(), operator=True, filters=filters)
    assert entries.exists()
    for query in (entries[:50], entries.order_by().values("id")):  # the page, its count
        plan = _plan(query)
        assert index in plan, plan
