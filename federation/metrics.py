"""The federation's state in Prometheus' text format, read from the database at each scrape.

Every figure comes from the rows every server process shares (rounds, clients, submissions, the
privacy ledger, conflicts, routing-call records), so any gunicorn worker answers a scrape with the
same numbers and nothing is kept per process. Routing latency is a gauge over the last five
minutes (the records are pruned after SYNAPSE_ROUTING_CALL_RETENTION_DAYS, so counts over them
would fall back, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Count, Exists, OuterRef, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from federation import accounting
from federation.models import (
    AuditLog,
    Client,
    ConflictDecision,
    ConflictLogEntry,
    Organization,
    Round,
    Submission,
)
from federation.services import submissions_to_merge

ROUTING_WINDOW = timedelta(minutes=5)


def _seconds(when) -> float:
    return when.timestamp() if when is not None else 0.0


class FederationCollector:
    """A prometheus_client collector over the federation's tables."""

    def __init__(self, now=None):
        self.now = now or timezone.now()

    def collect(self):
        # read once per scrape: several families are labelled by them or start from it
        self.slugs = sorted(Organization.objects.values_list("id", "slug"), key=lambda r: r[1])
        self.published = (
            Round.objects.filter(state=Round.State.PUBLISHED).order_by("-number").first()
        )
        yield from self._rounds()
        yield from self._clients_and_submissions()
        yield from self._privacy()
        yield from self._conflicts()
        yield from self._routing()

    def _rounds(self):
        by_state = dict(Round.objects.order_by().values("state").annotate(n=Count("id")).values_list("state", "n"))
        rounds = GaugeMetricFamily("synapse_rounds", "Rounds by state.", labels=["state"])
        for state in Round.State.values:
            rounds.add_metric([state], by_state.get(state, 0))
        yield rounds
        published = self.published
        yield GaugeMetricFamily(
            "synapse_published_round",
            "Number of the latest published round (0: none yet).",
            value=published.number if published else 0,
        )
        yield GaugeMetricFamily(
            "synapse_published_round_timestamp_seconds",
            "When the latest published round was published (Unix time; 0: none yet).",
            value=_seconds(published.published_at if published else None),
        )
        open_round = Round.objects.filter(state=Round.State.OPEN).first()
        yield GaugeMetricFamily(
            "synapse_open_round",
            "Number of the open round (0: none open).",
            value=open_round.number if open_round else 0,
        )
        yield GaugeMetricFamily(
            "synapse_open_round_submitting_clients",
            "Clients with a submission in the open round that its merge will read: a client "
            "revoked since it submitted is not counted (no merge reads its submission).",
            # Their stored compendiums, as the merge reads them (`submissions_to_merge`): a
            # replaced submission's row and an erased client's rows are left without one.
            value=(
                submissions_to_merge(round=open_round).values("client").distinct().count()
                if open_round else 0
            ),
        )
        yield GaugeMetricFamily(
            "synapse_open_round_deadline_timestamp_seconds",
            "The open round's deadline (Unix time; 0: no round open or no deadline).",
            value=_seconds(open_round.closes_at if open_round else None),
        )
        # From the start of the pipeline's current run: a round retried today after failing
        # yesterday is not a merge stuck for a day.
        waiting = (
            Round.objects.filter(state__in=[Round.State.CLOSING, Round.State.MERGING])
            .annotate(started=Coalesce("attempt_started_at", "closed_at"))
            .order_by("started")
            .values_list("started", flat=True)
            .first()
        )
        yield GaugeMetricFamily(
            "synapse_merge_pending_seconds",
            "Seconds since the merge pipeline of the oldest closing or merging round started "
            "(its close, or its latest retry; 0: none).",
            value=max(0.0, (self.now - waiting).total_seconds()) if waiting else 0.0,
        )

    def _clients_and_submissions(self):
        clients = GaugeMetricFamily(
            "synapse_clients", "Enrolled clients by organization and status.",
            labels=["organization", "status"],
        )
        counts = {
            (org, status): n
            for org, status, n in Client.objects.order_by()
            .values("organization", "status")
            .annotate(n=Count("id"))
            .values_list("organization", "status", "n")
        }
        for org_id, slug in self.slugs:
            for status in Client.Status.values:
                clients.add_metric([slug, status], counts.get((org_id, status), 0))
        yield clients
        # Gauges, not counters: an erasure deletes its client's submission records, and a
        # counter that goes down reads to Prometheus as a reset (rate() would count the whole
        # total again).
        submissions = GaugeMetricFamily(
            "synapse_submissions",
            "Accepted compendium submissions on record, by organization: each one accepted, "
            "one a later submission of the same client and round replaced included (the "
            "Overview's client submissions count the compendiums in effect, one per client and "
            "round); an erasure removes its client's.",
            labels=["organization"],
        )
        wire = GaugeMetricFamily(
            "synapse_submission_wire_bytes",
            "Bytes of the accepted submissions on record as they came over the wire, by "
            "organization (an erasure removes its client's).",
            labels=["organization"],
        )
        rows = {
            org: (n, size or 0)
            for org, n, size in Submission.objects.order_by()
            .values("client__organization")
            .annotate(n=Count("id"), size=Sum("wire_bytes"))
            .values_list("client__organization", "n", "size")
        }
        for org_id, slug in self.slugs:
            n, size = rows.get(org_id, (0, 0))
            submissions.add_metric([slug], n)
            wire.add_metric([slug], size)
        yield submissions
        yield wire
        yield self._refusals(
            "synapse_submissions_refused_unmasked",
            "Submissions refused for text not masked at the open round's strength, by organization "
            "(nothing of them stored; each is in the audit log).",
            AuditLog.Action.SUBMISSION_UNMASKED,
        )
        yield self._refusals(
            "synapse_submissions_refused_policy",
            "Submissions refused by the open round's release policy (statistics built without its "
            "field cap or for fields it will not release), by organization (nothing of them "
            "stored; each is in the audit log).",
            AuditLog.Action.SUBMISSION_POLICY,
        )

    def _refusals(self, name: str, documentation: str, action: str) -> CounterMetricFamily:
        """Refused submissions per organization, counted from their audit entries (`action`)."""
        family = CounterMetricFamily(name, documentation, labels=["organization"])
        refused = dict(
            AuditLog.objects.order_by()
            .filter(action=action)
            .values("organization")
            .annotate(n=Count("id"))
            .values_list("organization", "n")
        )
        for org_id, slug in self.slugs:
            family.add_metric([slug], refused.get(org_id, 0))
        return family

    def _privacy(self):
        report = accounting.privacy_report()
        yield GaugeMetricFamily(
            "synapse_privacy_epsilon_budget", "The federation's ε cap.", value=report.budget
        )
        yield GaugeMetricFamily(
            "synapse_privacy_epsilon_spent",
            "ε the federation has spent (ledger, tighter of basic and advanced composition).",
            value=report.federation.epsilon,
        )
        yield GaugeMetricFamily(
            "synapse_privacy_epsilon_committed",
            "ε spent plus the projected spend of rounds that have not released yet.",
            value=report.committed.epsilon,
        )
        per_org = GaugeMetricFamily(
            "synapse_privacy_organization_epsilon_spent",
            "ε one user of the organization can lose, over all rounds.",
            labels=["organization"],
        )
        for org_id, slug in self.slugs:
            composition = report.organizations.get(org_id)
            per_org.add_metric([slug], composition.epsilon if composition else 0.0)
        yield per_org

    def _conflicts(self):
        """Conflicts of the latest published round without a reviewer's decision: the next
        round's merges compose them into precautions unless someone decides otherwise."""
        undecided = GaugeMetricFamily(
            "synapse_conflicts_undecided",
            "Conflicts logged by the latest published round's merges without a decision "
            "(scope edge: an organization's; server: between edges, the operator's).",
            labels=["scope"],
        )
        published = self.published
        counts = {"edge": 0, "server": 0}
        if published is not None:
            entries = ConflictLogEntry.objects.filter(round=published)
            counts["edge"] = _undecided(
                entries.filter(organization__isnull=False),
                organization=OuterRef("organization"),
            )
            counts["server"] = _undecided(
                entries.filter(organization__isnull=True), organization__isnull=True
            )
        for scope, n in counts.items():
            undecided.add_metric([scope], n)
        yield undecided

    def _routing(self):
        from routing.models import RoutingCall
        from routing.services import QUANTILES, recorder, single_query_latency

        recorder.flush()
        calls = RoutingCall.objects.filter(at__gte=self.now - ROUTING_WINDOW, at__lte=self.now)
        count = GaugeMetricFamily(
            "synapse_routing_calls_5m",
            "Routing API calls in the last five minutes (form single: /route/, batch: /route/batch/).",
            labels=["reranker", "form"],
        )
        queries = GaugeMetricFamily(
            "synapse_routing_queries_5m",
            "Queries routed in the last five minutes.",
            labels=["reranker", "form"],
        )
        for reranker, is_batch, n, q in (
            calls.order_by()
            .values("reranker", "batch")
            .annotate(n=Count("id"), q=Sum("queries"))
            .values_list("reranker", "batch", "n", "q")
        ):
            form = "batch" if is_batch else "single"
            count.add_metric([reranker, form], n)
            queries.add_metric([reranker, form], q or 0)
        yield count
        yield queries
        latency = GaugeMetricFamily(
            "synapse_routing_latency_seconds",
            "Latency of single-query routing calls over the last five minutes, by quantile "
            "(the routing service's time, without the network).",
            labels=["reranker", "quantile"],
        )
        for row in single_query_latency(calls):
            for name, q in QUANTILES.items():
                latency.add_metric([row["reranker"], f"{q:g}"], row[name] / 1000.0)
        yield latency


def _undecided(entries, **organization) -> int:
    """How many of `entries` (conflict log rows) have no decision keyed like them."""
    decision = ConflictDecision.objects.filter(
        round=OuterRef("round"), tool_id=OuterRef("tool_id"), centroid_id=OuterRef("centroid_id"),
        **organization,
    )
    return entries.filter(~Exists(decision)).count()


def exposition(now=None) -> bytes:
    """The metrics page's body."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FederationCollector(now))
    return generate_latest(registry)
