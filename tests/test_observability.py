"""Watching the service: the routing API's traffic figures (dashboard and /metrics), their
retention, and the Prometheus page of the federation's state."""

from __future__ import annotations

import html
import json
import re
from datetime import datetime, timedelta

import numpy as np
import pytest
from django.test import Client as HttpClient
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from compendium.services import store_compendium
from federation import accounting, services
from federation.models import ConflictDecision, Round, Submission
from routing import services as routing_services
from routing.models import RoutingCall
from tests.dashboard_data import add_review_data, build_federation, client_compendium

METRICS_TOKEN = "m" * 32


def _calls(now, latencies, *, ago: timedelta, reranker: str = "fusion", queries: int = 1,
           batch: bool | None = None):
    RoutingCall.objects.bulk_create(
        RoutingCall(at=now - ago, latency_ms=ms, queries=queries, reranker=reranker,
                    compendium_round=2, batch=queries > 1 if batch is None else batch)
        for ms in latencies
    )


@pytest.fixture
def traffic(db):
    routing_services.recorder.flush()
    RoutingCall.objects.all().delete()
    now = timezone.now()
    recent = [float(ms) for ms in range(1, 101)]  # 1..100 ms, in the last hour
    _calls(now, recent, ago=timedelta(minutes=2))
    _calls(now, [7.0, 9.0], ago=timedelta(minutes=3), reranker="none")
    earlier = [200.0, 300.0, 400.0]  # 5 hours ago: in the day, not in the hour
    _calls(now, earlier, ago=timedelta(hours=5))
    _calls(now, [50.0, 150.0], ago=timedelta(minutes=10), queries=100)  # two batches of 100
    _calls(now, [5.0], ago=timedelta(days=2))  # outside the day
    return now, recent, earlier


# --- the figures -----------------------------------------------------------------------------------


def test_routing_traffic_figures_are_the_percentiles_of_the_records(traffic):
    now, recent, earlier = traffic
    t = routing_services.routing_traffic(now=now)
    rows = {(r["window"], r["reranker"]): r for r in t.recent}
    assert set(rows) == {("1 h", "fusion"), ("1 h", "none"), ("24 h", "fusion"), ("24 h", "none")}
    hour, day = rows[("1 h", "fusion")], rows[("24 h", "fusion")]
    assert hour["calls"] == 100 and day["calls"] == 103
    for row, values in ((hour, recent), (day, recent + earlier)):
        for name, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
            assert row[name] == pytest.approx(np.percentile(values, q))
    assert rows[("1 h", "none")]["p50_ms"] == pytest.approx(8.0)
    # batches: their queries per second of routing time, apart from the single-query latency
    assert t.batch == {"calls": 2, "queries": 200, "queries_per_second": pytest.approx(1000.0)}
    assert t.calls == 105 + 2
    # per hour, oldest first: the 5-hours-ago hour and the recent one(s)
    assert sum(h["calls"] for h in t.hourly) == 105
    assert t.hourly[0]["p50_ms"] == pytest.approx(300.0)
    assert [h["hour"] for h in t.hourly] == sorted(h["hour"] for h in t.hourly)


def test_routing_latency_summary_over_a_window(traffic):
    summary = routing_services.routing_latency(timedelta(hours=1))
    assert summary["calls"] == 100 + 2 + 2 and summary["queries"] == 104 + 200 - 2
    fusion = routing_services.routing_latency(timedelta(hours=1), reranker="none")
    assert fusion["calls"] == 2 and fusion["p95_ms"] == pytest.approx(8.9)


def test_old_routing_records_are_pruned_after_the_retention(traffic, settings):
    now = traffic[0]
    settings.SYNAPSE_ROUTING_CALL_RETENTION_DAYS = 1
    assert routing_services.prune_routing_calls(now=now) == 1  # the one from two days ago
    assert not RoutingCall.objects.filter(at__lt=now - timedelta(days=1)).exists()
    assert RoutingCall.objects.count() == 107
    settings.SYNAPSE_ROUTING_CALL_RETENTION_DAYS = 30
    assert routing_services.prune_routing_calls(now=now) == 0


def test_the_beat_schedule_prunes_routing_records(settings):
    from synapse_web.celery import app
    from workers.tasks import prune_routing_calls_task

    entry = settings.CELERY_BEAT_SCHEDULE["prune-routing-calls"]
    assert entry["task"] == prune_routing_calls_task.name and entry["task"] in app.tasks


# --- the dashboard ---------------------------------------------------------------------------------


@pytest.fixture
def fed(db):
    fed = build_federation()
    return fed, add_review_data(fed)


def test_the_operator_sees_the_routing_traffic(client, fed, traffic):
    client.force_login(fed[0].operator)
    response = client.get(reverse("dashboard:routing"))
    body = response.content.decode()
    assert response.status_code == 200 and 'id="routing-traffic"' in body
    table = body[body.index('id="routing-latency-table"'):body.index("</table>", body.index('id="routing-latency-table"'))]
    assert "<td>last 1 h</td><td>fusion</td><td class=\"num\">100</td><td class=\"num\">50.5</td>" in table
    assert "Batch form: 2 calls, 200 queries, 1000 queries per second" in body
    assert 'id="routing-latency"' in body and "vendor/plotly.min.js" in body
    chart = json.loads(html.unescape(re.search(r'id="routing-latency"[^>]*data-plotly="([^"]*)"', body)[1]))
    start, end = (datetime.fromisoformat(x) for x in chart["layout"]["xaxis"]["range"])
    assert end - start == timedelta(hours=24)  # the whole day, however few hours had calls
    bars = next(t for t in chart["data"] if t["type"] == "bar")
    assert sum(bars["y"]) == 105 and all(start < datetime.fromisoformat(x) < end for x in bars["x"])
    assert bars["name"] == "single-query calls"  # the batch form's calls are not in them


def test_the_routing_traffic_is_the_operators_alone(client, fed, traffic):
    client.force_login(fed[1].acme_admin)
    body = client.get(reverse("dashboard:routing")).content.decode()
    assert 'id="route-form"' in body and "routing-traffic" not in body


def test_no_traffic_says_so(client, fed):
    routing_services.recorder.flush()
    RoutingCall.objects.all().delete()
    client.force_login(fed[0].operator)
    body = client.get(reverse("dashboard:routing")).content.decode()
    assert "No routing API calls in the last 24 hours." in body and 'id="routing-latency"' not in body


# --- /metrics ----------------------------------------------------------------------------------------


def _metrics(response) -> dict:
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_need_the_operator_or_the_metrics_token(client, fed, settings):
    federation, review = fed
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401 and "credentials were not provided" in anonymous.content.decode()
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    client.force_login(review.acme_admin)
    refused = client.get("/metrics")
    assert refused.status_code == 403 and "operator or the metrics token" in refused.content.decode()
    client.force_login(federation.operator)
    assert client.get("/metrics").status_code == 200
    bare = HttpClient()
    token = services.issue_user_token(services.Actor.for_user(federation.operator), federation.operator)
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    member_token = services.issue_user_token(services.Actor.for_user(review.acme_admin), review.acme_admin)
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {member_token}").status_code == 403
    # the scraper's token: only when configured, compared whole
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}").status_code == 401
    settings.SYNAPSE_METRICS_TOKEN = METRICS_TOKEN
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}").status_code == 200
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN[:-1]}").status_code == 401
    # Prometheus' own Accept header gets the text format
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    assert bare.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}",
                    HTTP_ACCEPT=accept).status_code == 200


def test_metrics_report_the_federations_state(client, fed, traffic):
    federation, review = fed
    acme_client = federation.clients[0]
    stored = store_compendium(client_compendium(0, 4), kind="client", round=federation.rounds[4],
                              client=acme_client)
    for key, size, version in (("a", 1200, None), ("b", 800, stored)):  # "a" was replaced by "b"
        Submission.objects.create(client=acme_client, round=federation.rounds[4], idempotency_key=key,
                                  request_sha256="0" * 64, response={}, wire_bytes=size,
                                  version=version)
    # A submission row whose compendium is gone: not a client submitting now.
    Submission.objects.create(client=federation.clients[2], round=federation.rounds[4],
                              idempotency_key="erased", request_sha256="0" * 64, response={},
                              wire_bytes=0)
    # Round 3 was closed yesterday, failed, and was retried 7 minutes ago: its merge has been
    # pending 7 minutes, not a day (the alert on a stuck merge fired at every retry).
    retried = timezone.now() - timedelta(minutes=7)
    Round.objects.filter(number=3).update(closed_at=timezone.now() - timedelta(days=1),
                                          attempt_started_at=retried)
    client.force_login(federation.operator)
    m = _metrics(client.get("/metrics"))

    assert m[("synapse_rounds", (("state", "published"),))] == 2
    assert m[("synapse_rounds", (("state", "open"),))] == 1
    assert m[("synapse_rounds", (("state", "failed"),))] == 0
    assert m[("synapse_published_round", ())] == 2
    assert m[("synapse_open_round", ())] == 4
    assert m[("synapse_open_round_submitting_clients", ())] == 1
    assert m[("synapse_merge_pending_seconds", ())] == pytest.approx(7 * 60, abs=60)
    assert m[("synapse_clients", (("organization", "globex"), ("status", "pending")))] == 1
    assert m[("synapse_clients", (("organization", "acme"), ("status", "approved")))] == 2
    # gauges of the records kept: an erasure deletes its client's (a counter going down would read
    # to Prometheus as a reset)
    assert m[("synapse_submissions", (("organization", "acme"),))] == 2
    assert m[("synapse_submissions", (("organization", "globex"),))] == 1
    assert m[("synapse_submission_wire_bytes", (("organization", "acme"),))] == 2000
    assert "# TYPE synapse_submissions gauge" in client.get("/metrics").content.decode()
    report = accounting.privacy_report()
    assert m[("synapse_privacy_epsilon_budget", ())] == report.budget
    assert m[("synapse_privacy_epsilon_spent", ())] == pytest.approx(report.federation.epsilon)
    spent = accounting.organization_composition(federation.acme.pk).epsilon
    assert spent > 0
    assert m[("synapse_privacy_organization_epsilon_spent", (("organization", "acme"),))] == pytest.approx(spent)
    # routing: the last five minutes only (the 10-minute-old batches and older calls are out)
    assert m[("synapse_routing_calls_5m", (("form", "single"), ("reranker", "fusion")))] == 100
    assert ("synapse_routing_calls_5m", (("form", "batch"), ("reranker", "fusion"))) not in m
    p95 = m[("synapse_routing_latency_seconds", (("quantile", "0.95"), ("reranker", "fusion")))]
    assert p95 == pytest.approx(np.percentile(np.arange(1, 101), 95) / 1000)


def test_metrics_count_the_conflicts_awaiting_a_decision(client, fed):
    federation, _ = fed
    client.force_login(federation.operator)
    before = _metrics(client.get("/metrics"))[("synapse_conflicts_undecided", (("scope", "edge"),))]
    assert before == 2  # one at each edge in round 2, the latest published
    ConflictDecision.objects.create(round=federation.rounds[2], organization=federation.acme,
                                    tool_id="weather", centroid_id="c0", action="dismiss")
    after = _metrics(client.get("/metrics"))
    assert after[("synapse_conflicts_undecided", (("scope", "edge"),))] == 1
    assert after[("synapse_conflicts_undecided", (("scope", "server"),))] == 0


def test_metrics_are_not_part_of_the_json_api_document(client, fed):
    client.force_login(fed[0].operator)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    assert "/metrics" not in schema["paths"]


@pytest.mark.django_db(transaction=True)
def test_an_idle_processs_calls_are_flushed_by_its_own_thread():
    """A server process records a call and then gets none for a while: its records reached the
    database only with its next call, so /metrics and the dashboard (read by another process)
    missed them, or never counted them once they fell out of the five-minute window."""
    import time as clock

    recorder = routing_services.LatencyRecorder(flush_seconds=0.05)
    recorder.record(12.5, 1, "fusion", 3)
    recorder.record(40.0, 1, "none", 3, batch=True)
    deadline = clock.monotonic() + 30  # waits for the thread; not a measure of its speed
    while RoutingCall.objects.count() < 2 and clock.monotonic() < deadline:
        clock.sleep(0.05)
    assert sorted(RoutingCall.objects.values_list("reranker", "batch", "latency_ms")) == [
        ("fusion", False, 12.5), ("none", True, 40.0)]
    # the module's recorder runs no thread in the tests (they flush inside their transactions)
    assert routing_services.recorder.background is False


def test_a_batch_of_one_query_is_a_batch_and_the_deciding_reranker_is_recorded(traffic):
    """POST /route/batch/ with one query counted as a /route/ call, its whole-batch latency
    (LLM batch budget included) in the single-query percentiles."""
    now, recent, _ = traffic
    _calls(now, [5000.0], ago=timedelta(minutes=1), batch=True)  # one query, by the batch endpoint
    t = routing_services.routing_traffic(now=now)
    hour = {r["reranker"]: r for r in t.recent if r["window"] == "1 h"}
    assert hour["fusion"]["calls"] == len(recent)
    assert t.batch["calls"] == 3 and t.batch["queries"] == 201
