"""The data the dashboard pages show, scoped by the organizations a user may see.

Organization data (clients, their submissions) is always filtered by `organizations`, the queryset
from `federation.services.visible_organizations`. The global compendium is published to every
member of the federation, so any signed-in user may browse it; rounds whose global result is not
published yet are the operator's alone.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import plotly.graph_objects as go
from django.core.paginator import Page, Paginator
from django.db.models import (
    Aggregate,
    Avg,
    Case,
    Count,
    Exists,
    FloatField,
    IntegerField,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Lower
from django.utils import timezone
from django.utils.safestring import SafeString
from plotly.colors import qualitative

from compendium.clipping import clip_bound
from compendium.models import (
    AnnexEntry,
    CompendiumVersion,
    NumericField,
    PrecautionEntry,
    ScenarioEntry,
    StatEntry,
    TemplateEntry,
    Tool,
)
from compendium.services import numeric_field_spec
from federation.dashboard.plots import (
    add_with_error_bars,
    count_axis,
    literal,
    render_figure,
    right_axis,
    styled,
)
from federation.merge.operator import noise_dominated, noise_to_window, published_noise_to_window
from federation.merge.robust import byzantine_count, krum_premise_from, krum_premise_met
from federation.merge.summarize import LLM_SUMMARIZERS, summary_counts
from federation.models import AuditLog, Client, PrivacyLedgerEntry, Round
from federation.round_config import RoundConfig
from federation.simulation.report import summarize_transfer
from federation.simulation.runner import (
    CAMOUFLAGED_MODES,
    METHODS,
    TARGETED_MODES,
    SimulationConfig,
)

KIND_CLIENT = CompendiumVersion.Kind.CLIENT
KIND_EDGE = CompendiumVersion.Kind.EDGE
KIND_GLOBAL = CompendiumVersion.Kind.GLOBAL

# --- federation overview -----------------------------------------------------------------------


@dataclass
class RoundRow:
    round: Round
    submissions: int = 0
    # Of them, those of clients revoked since, in a round whose merge is still to read its
    # submissions (open, closing, failed): it will not read these (`submissions_to_merge`).
    revoked_submissions: int = 0
    submitted_bytes: int = 0
    edges: int = 0
    global_version: CompendiumVersion | None = None
    failure_reason: str = ""  # as the viewer may read it (federation.services.failure_reason_for)
    # The global's top-1 on the public probe set (nearest scenario; the server merge's record),
    # and over how many probe requests.
    probe_accuracy: float | None = None
    probe_queries: int = 0
    # An open or failed round: whether it has a submission its merge would read (of every
    # organization, revoked clients' left out: federation.services.submissions_to_merge). Without
    # one its merge fails: closing it is warned of, a retry is refused.
    mergeable: bool = False
    # A failed round: the first later round published (None: none), after which it can never be
    # retried (`federation.services.published_after`: globals are published in round order).
    published_after: int | None = None
    # A failed round the operator could otherwise retry: why the privacy budget refuses its retry
    # now ("" when it fits; `federation.services.retry_budget_refusal`, as retry_round refuses).
    retry_refusal: str = ""


@dataclass
class ClientRow:
    client: Client
    rounds: int = 0
    last_round: int | None = None
    last_size_bytes: int | None = None
    last_gzip_bytes: int | None = None
    # What the last submission weighed on the wire, and its Content-Encoding ("" plain).
    last_wire_bytes: int | None = None
    last_encoding: str = ""
    mean_size_bytes: float | None = None
    submitted_open: bool = False  # has a submission in the open round
    # submissions to the open round refused for unmasked text (audit entries submission.unmasked)
    refused_unmasked_open: int = 0


# The bytes chart draws a line per client up to this many clients with points, else one per
# organization (the median of its clients, with their range).
BYTES_CHART_CLIENTS = 12
# The open round's waiting clients named above the client table (the rest: its filter).
WAITING_SHOWN = 50
CLIENT_TARGET = "client"  # AuditLog.target_type of an entry about a client


@dataclass(frozen=True)
class ClientFilters:
    """The Overview's client table narrowed to an organization (its slug), a status, and the
    approved clients that have not submitted to the open round (`waiting`)."""

    organization: str = ""
    status: str = ""
    waiting: bool = False

    def apply(self, clients: QuerySet, *, open_round: bool) -> QuerySet:
        """`clients` (annotated with `submitted_open`) narrowed; `waiting` narrows nothing while
        no round is open (the page says so)."""
        if self.organization:
            clients = clients.filter(organization__slug=self.organization)
        if self.status:
            clients = clients.filter(status=self.status)
        if self.waiting and open_round:
            clients = clients.filter(status=Client.Status.APPROVED, submitted_open=False)
        return clients

    @property
    def active(self) -> bool:
        return bool(self.organization or self.status or self.waiting)


def client_filters(params, organizations: QuerySet) -> ClientFilters:
    """The client table's filters from the query string (`organization`: a slug of a visible
    organization; `status`: one of Client.Status; `waiting`: 1). Raises BadRequest naming a
    value it cannot take."""
    slug = (params.get("organization") or "").strip()
    if slug and not organizations.filter(slug=slug).exists():
        # an organization the viewer may not see reads as one that does not exist
        raise BadRequest(f"organization: no organization {slug[:100]!r} among those you can see")
    status = (params.get("status") or "").strip()
    if status and status not in Client.Status.values:
        raise BadRequest(f"status must be one of {', '.join(Client.Status.values)}, "
                         f"not {status[:40]!r}")
    waiting = (params.get("waiting") or "").strip()
    if waiting not in ("", "0", "1"):
        raise BadRequest(f"waiting must be 1 (or left out), not {waiting[:40]!r}")
    return ClientFilters(organization=slug, status=status, waiting=waiting == "1")


@dataclass
class Overview:
    rounds: list[RoundRow]
    clients: list[ClientRow]  # the client table's page
    state_counts: dict[str, int]
    bytes_chart: str = ""
    # under a chart drawn per organization: why, and where each client's figures are
    bytes_caption: str = ""
    participation_chart: str = ""
    probe_chart: str = ""
    # of every visible client, whatever the table's filters and page
    totals: dict[str, int] = field(default_factory=dict)
    # The open round, if any, and the first WAITING_SHOWN of the approved clients that have not
    # submitted to it, of `waiting_count`.
    open_round: Round | None = None
    waiting: list[ClientRow] = field(default_factory=list)
    waiting_count: int = 0
    filters: ClientFilters = field(default_factory=ClientFilters)
    client_page: Page | None = None

    @property
    def waiting_more(self) -> int:
        """How many waiting clients are not named (the filter lists them)."""
        return self.waiting_count - len(self.waiting)


def federation_overview(
    organizations: QuerySet,
    *,
    include_unpublished: bool = False,
    max_rounds: int = 50,
    viewer=None,
    filters: ClientFilters | None = None,
    page=None,
    per_page: int = 50,
) -> Overview:
    """Rounds with state, participation and compendium sizes; bytes sent over rounds; the
    client table's `page` (Paginator.get_page: the nearest page to a number out of range, the
    first for one that is not a number), `per_page` clients under `filters`.

    Participation and per-client figures count only clients of `organizations`; the global
    compendium of a round not yet published is shown only with `include_unpublished` (operator);
    a failed round's reason as `viewer` may read it. The table holds the latest `max_rounds`
    rounds.
    """
    from federation.services import (
        failure_reason_for,
        retry_budget_refusals,
        round_figures,
        submissions_to_merge,
    )

    rounds = list(
        round_figures(Round.objects.order_by("-number"), organizations.values_list("pk", flat=True))
        [:max_rounds]
    )
    round_ids = [r.pk for r in rounds]
    rows = {
        r.pk: RoundRow(round=r, failure_reason=failure_reason_for(viewer, r),
                       submissions=r.n_submissions, submitted_bytes=r.n_submitted_bytes or 0)
        for r in rounds
    }
    pending = [r.pk for r in rounds if r.state in (Round.State.OPEN, Round.State.FAILED)]
    if pending:
        for round_id in set(
            submissions_to_merge(round_id__in=pending).values_list("round_id", flat=True)
        ):
            rows[round_id].mergeable = True
    unread = [r.pk for r in rounds
              if r.state in (Round.State.OPEN, Round.State.CLOSING, Round.State.FAILED)]
    if unread:
        merged = dict(
            submissions_to_merge(round_id__in=unread, client__organization__in=organizations)
            .order_by().values("round_id").annotate(n=Count("id")).values_list("round_id", "n")
        )
        for round_id in unread:
            rows[round_id].revoked_submissions = rows[round_id].submissions - merged.get(round_id, 0)
    # The table holds the latest rounds, so every round published after one of its rows is in it.
    published = sorted(r.number for r in rounds if r.state == Round.State.PUBLISHED)
    retryable = []
    for r in rounds:
        if r.state == Round.State.FAILED:
            row = rows[r.pk]
            row.published_after = next((n for n in published if n > r.number), None)
            if include_unpublished and row.published_after is None and row.mergeable:
                retryable.append(r)
    # the operator's Retry: not offered where retry_round would refuse it (one ledger reading)
    for pk, refusal in retry_budget_refusals(retryable).items():
        rows[pk].retry_refusal = refusal

    submissions = CompendiumVersion.objects.filter(
        kind=KIND_CLIENT, round_id__in=round_ids, client__organization__in=organizations
    )
    for item in (
        CompendiumVersion.objects.filter(
            kind=KIND_EDGE, round_id__in=round_ids, organization__in=organizations
        )
        .order_by()
        .values("round_id")
        .annotate(n=Count("id"))
    ):
        rows[item["round_id"]].edges = item["n"]
    global_results = CompendiumVersion.objects.filter(kind=KIND_GLOBAL, round_id__in=round_ids)
    if not include_unpublished:
        global_results = global_results.filter(round__state=Round.State.PUBLISHED)
    for version in global_results.defer("content", "routing_head"):  # heads: ~0.5 MB each
        row = rows[version.round_id]
        row.global_version = version
        # shown with the global it measured
        row.probe_accuracy = row.round.merge_probe_accuracy
        row.probe_queries = row.round.merge_probe_queries or 0

    # The bytes chart's points: the table's rounds. Drawn per client up to BYTES_CHART_CLIENTS
    # clients with points, per organization above that (a line per client at 300 clients was
    # an unreadable chart and most of an 800 kB page).
    charted = submissions.order_by().values("client_id").distinct().count()
    if charted > BYTES_CHART_CLIENTS:
        overview_bytes = bytes_per_organization_figure(submissions, charted)
        bytes_caption = (
            f"One line per organization, because {charted} clients sent submissions in these "
            f"rounds: the median over its clients of the bytes each sent, with the range from "
            f"the least to the most (hover: how many clients the round counted). The client "
            f"table below has each client's figures."
        )
    else:
        overview_bytes = bytes_per_client_figure(*client_points(submissions)) if charted else None
        bytes_caption = ""

    state_counts = dict(
        Round.objects.order_by().values_list("state").annotate(n=Count("id")).values_list("state", "n")
    )
    visible_clients = Client.objects.filter(organization__in=organizations)
    every = CompendiumVersion.objects.filter(kind=KIND_CLIENT, client__organization__in=organizations)
    client_totals = visible_clients.order_by().aggregate(
        clients=Count("id"), approved=Count("id", filter=Q(status=Client.Status.APPROVED)))
    overview = Overview(
        rounds=list(rows.values()),
        clients=[],
        state_counts=state_counts,
        totals={
            "rounds": sum(state_counts.values()),
            "clients": client_totals["clients"],
            "approved_clients": client_totals["approved"],
            "submissions": every.count(),
        },
        bytes_caption=bytes_caption,
        filters=filters or ClientFilters(),
    )
    overview.open_round = next((r for r in rounds if r.state == Round.State.OPEN), None)
    open_number = overview.open_round.number if overview.open_round is not None else None
    in_open = CompendiumVersion.objects.filter(
        kind=KIND_CLIENT, round__number=open_number, client=OuterRef("pk"))
    clients = visible_clients.select_related("organization").annotate(
        submitted_open=Exists(in_open)).order_by("organization__slug", "name", "pk")
    if overview.open_round is not None:
        waiting = clients.filter(status=Client.Status.APPROVED, submitted_open=False)
        overview.waiting_count = waiting.count()
        overview.waiting = [ClientRow(client=c) for c in waiting[:WAITING_SHOWN]]
    overview.client_page = Paginator(
        overview.filters.apply(clients, open_round=overview.open_round is not None), per_page
    ).get_page(page)
    client_rows = {c.pk: ClientRow(client=c, submitted_open=c.submitted_open)
                   for c in overview.client_page}
    overview.clients = list(client_rows.values())
    # The page's clients' figures over every round, not only the table's latest `max_rounds`:
    # its rounds submitted and mean size (one aggregate) and its last submission (DISTINCT ON).
    shown = every.filter(client_id__in=list(client_rows))
    for item in shown.order_by().values("client_id").annotate(n=Count("id"), mean=Avg("size_bytes")):
        row = client_rows[item["client_id"]]
        row.rounds, row.mean_size_bytes = item["n"], item["mean"]
    for last in shown.order_by("client_id", "-round__number").distinct("client_id").values(
        "client_id", "round__number", "size_bytes", "gzip_bytes",
        "submission__wire_bytes", "submission__content_encoding",
    ):
        row = client_rows[last["client_id"]]
        row.last_round = last["round__number"]
        row.last_size_bytes = last["size_bytes"]
        row.last_gzip_bytes = last["gzip_bytes"]
        row.last_wire_bytes = last["submission__wire_bytes"]
        row.last_encoding = last["submission__content_encoding"] or ""
    if overview.open_round is not None:
        refused = (
            AuditLog.objects.order_by()
            .filter(
                action=AuditLog.Action.SUBMISSION_UNMASKED,
                organization__in=organizations,
                target_type=CLIENT_TARGET,
                target_id__in=[str(pk) for pk in client_rows],
                details__round=overview.open_round.number,
            )
            .values_list("target_id")
            .annotate(n=Count("id"))
        )
        for target_id, n in refused:
            client_rows[int(target_id)].refused_unmasked_open = n
    if overview_bytes is not None:
        overview.bytes_chart = render_figure(
            overview_bytes,
            div_id="bytes-per-client",
            label=overview_bytes.layout.title.text,
        )
    if any(row.submissions or row.global_version for row in overview.rounds):
        overview.participation_chart = render_figure(
            participation_figure(overview.rounds),
            div_id="participation",
            label="Submissions and global compendium size per round",
        )
    if any(row.probe_accuracy is not None for row in overview.rounds):
        overview.probe_chart = render_figure(
            probe_accuracy_figure(overview.rounds),
            div_id="probe-accuracy",
            label="The global compendium's top-1 on the public probe set per round",
        )
    return overview


class Median(Aggregate):
    """PostgreSQL's median of a column: percentile_cont(0.5) within the group's values."""

    function = "percentile_cont"
    template = "%(function)s(0.5) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()


def _sent_bytes():
    """What a client submission weighed on the wire (a dcz or gzip body's bytes), or its
    canonical bytes where it was sent plain or the server did not record it."""
    return Coalesce("submission__wire_bytes", "size_bytes")


def client_points(submissions: QuerySet) -> tuple[dict, dict[int, list[dict]]]:
    """The bytes chart's points per client (`bytes_per_client_figure`'s arguments) of the client
    compendium versions `submissions`, in one query: {client id: its label} and {client id: its
    points, by round}."""
    labels, per_client = {}, defaultdict(list)
    for point in submissions.order_by("round__number").values(
        "client_id", "client__organization__slug", "client__name", "round__number", "size_bytes",
        "gzip_bytes", "submission__wire_bytes", "submission__content_encoding",
    ):
        labels[point["client_id"]] = SimpleNamespace(
            client=f"{point['client__organization__slug']}/{point['client__name']}")
        per_client[point["client_id"]].append(point)
    return labels, per_client


def bytes_per_client_figure(client_rows: dict, per_client: dict) -> go.Figure:
    """What each client put on the wire per round (a dcz or gzip body's bytes; the canonical bytes
    where it sent them plain or the server did not record it), with the canonical and gzip sizes
    on hover. `client_rows`: {client id: what has the client as `.client`}."""
    fig = go.Figure()
    for client_id, series in sorted(per_client.items(), key=lambda kv: str(client_rows[kv[0]].client)):
        fig.add_trace(
            go.Scatter(
                x=[p["round__number"] for p in series],
                y=[(p["submission__wire_bytes"] or p["size_bytes"]) / 1000 for p in series],
                customdata=[
                    [p["submission__content_encoding"] or "identity", p["size_bytes"] / 1000,
                     p["gzip_bytes"] / 1000]
                    for p in series
                ],
                mode="lines+markers",
                name=literal(client_rows[client_id].client),
                hovertemplate=(
                    "%{fullData.name}<br>round %{x}<br>%{y:.1f} kB sent (%{customdata[0]})"
                    "<br>%{customdata[1]:.1f} kB canonical, %{customdata[2]:.1f} kB gzip"
                    "<extra></extra>"
                ),
            )
        )
    return styled(
        fig,
        title={"text": "Bytes each client sent per round"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis={"title": {"text": "sent (kB)"}, "rangemode": "tozero", "tickformat": ".3~f"},
    )


def bytes_per_organization_figure(submissions: QuerySet, clients: int) -> go.Figure:
    """Per organization and round, the median over its clients of the bytes each sent (as
    `bytes_per_client_figure` counts them), with bars from the least to the most (none where one
    client counted), summed up in the database: one row per organization and round. `clients`:
    how many clients the chart stands for (its title says it)."""
    sent = _sent_bytes()
    per_org: dict[str, list[dict]] = defaultdict(list)
    for point in (
        submissions.order_by()
        .values("client__organization_id", "client__organization__name", "round__number")
        .annotate(median=Median(sent), least=Min(sent), most=Max(sent), n=Count("id"))
        .order_by("client__organization__name", "round__number")
    ):
        per_org[point["client__organization__name"]].append(point)
    fig = go.Figure()
    def kb(value: float) -> float:  # to the half byte a median can fall on: a shorter page
        return round(value / 1000, 4)

    for name, series in per_org.items():
        median = [kb(p["median"]) for p in series]
        add_with_error_bars(
            fig,
            go.Scatter(
                x=[p["round__number"] for p in series], y=median,
                customdata=[[p["n"], p["least"] / 1000, p["most"] / 1000] for p in series],
                mode="lines+markers", name=literal(name),
                hovertemplate=(
                    "%{fullData.name}<br>round %{x}<br>median %{y:.1f} kB sent by "
                    "%{customdata[0]} client(s)<br>%{customdata[1]:.1f} to %{customdata[2]:.1f} kB"
                    "<extra></extra>"
                ),
            ),
            [round(kb(p["most"]) - m, 4) if p["n"] > 1 else None
             for p, m in zip(series, median, strict=True)],
            below=[round(m - kb(p["least"]), 4) if p["n"] > 1 else None
                   for p, m in zip(series, median, strict=True)],
        )
    return styled(
        fig,
        title={"text": f"Bytes sent per round: median of each organization's clients ({clients} clients)"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis={"title": {"text": "sent (kB)"}, "rangemode": "tozero", "tickformat": ".3~f"},
    )

def participation_figure(rows: list[RoundRow]) -> go.Figure:
    """Submissions per round (bars) and the published global's size (line, right axis). Both
    axes run from zero to a tenth above their largest value, so that a full round's bar and the
    latest global's marker do not sit on the frame."""
    ordered = sorted(rows, key=lambda r: r.round.number)
    numbers = [r.round.number for r in ordered]
    submissions = [r.submissions for r in ordered]
    sizes = [r.global_version.size_bytes / 1000 if r.global_version else None for r in ordered]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=numbers, y=submissions, name="client submissions", yaxis="y"))
    fig.add_trace(
        go.Scatter(
            x=numbers, y=sizes, name="global compendium (kB)", mode="lines+markers", yaxis="y2",
            connectgaps=False,
        )
    )
    yaxis = count_axis("submissions", max(submissions, default=0))
    yaxis2 = right_axis("global size (kB)")
    if max(submissions, default=0) > 0:
        yaxis["range"] = [0, 1.1 * max(submissions)]
    if any(sizes):
        yaxis2["range"] = [0, 1.1 * max(s for s in sizes if s is not None)]
    return styled(
        fig,
        title={"text": "Participation and global compendium size"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis=yaxis,
        yaxis2=yaxis2,
    )


def probe_accuracy_figure(rows: list[RoundRow]) -> go.Figure:
    """The live federation's accuracy curve: each published global routed by its nearest scenario
    on the public probe set, as the server merge measured it. The probe set also chooses the
    probe-extractive summaries and trains the routing head, so this is a health check of the
    rounds, not a held-out accuracy (`manage.py simulate` measures that)."""
    ordered = sorted((r for r in rows if r.probe_accuracy is not None), key=lambda r: r.round.number)
    fig = go.Figure(go.Scatter(
        x=[r.round.number for r in ordered], y=[r.probe_accuracy for r in ordered],
        customdata=[r.probe_queries for r in ordered], mode="lines+markers",
        name="nearest-scenario top-1",
        hovertemplate="round %{x}<br>top-1 %{y:.3f} on %{customdata} probe requests<extra></extra>",
    ))
    return styled(
        fig,
        title={"text": "Global compendium on the public probe set"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis={"title": {"text": "top-1 (nearest scenario)"}, "range": [0, 1]},
    )


# --- compendium browser --------------------------------------------------------------------------


class BadRequest(ValueError):
    """A query parameter that cannot be understood; the message names it."""


def global_versions(user) -> QuerySet:
    """The global compendium versions `user` may browse, newest round first."""
    versions = CompendiumVersion.objects.filter(kind=KIND_GLOBAL).select_related("round")
    if not user.is_superuser:
        versions = versions.filter(round__state=Round.State.PUBLISHED)
    # neither the content nor the routing head (~0.5 MB each at 199 tools): the pages list them
    return versions.defer("content", "routing_head").order_by("-round__number")


def round_number(raw: str | None) -> int | None:
    """`federation.services.round_number`, refusing with this page's BadRequest."""
    from federation.errors import InvalidRequest
    from federation.services import round_number as parse

    try:
        return parse(raw)
    except InvalidRequest as error:
        raise BadRequest(error.detail) from None


def choose_global_version(user, round_param: str | None) -> CompendiumVersion | None:
    """The version of `?round=N` (or the latest one when absent); None when there is none.

    Raises BadRequest for a malformed round and CompendiumVersion.DoesNotExist for a round without
    a global compendium this user may see.
    """
    versions = global_versions(user)
    number = round_number(round_param)
    return versions.first() if number is None else versions.get(round__number=number)


@dataclass
class EntryText:
    text: str
    support: int = 1
    since_round: int | None = None
    preconditions: dict = field(default_factory=dict)


@dataclass
class ToolCard:
    tool: Tool
    scenarios: list[EntryText] = field(default_factory=list)
    precautions: list[EntryText] = field(default_factory=list)
    templates: list[TemplateEntry] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    annex: list[AnnexEntry] = field(default_factory=list)

    @property
    def noise_dominated(self) -> bool:
        return any(s.get("noise_dominated") for s in self.stats)


ENTRY_MODELS = (ScenarioEntry, PrecautionEntry, TemplateEntry, StatEntry)


def tools_in_version(version: CompendiumVersion, query: str = "") -> QuerySet:
    """Registry tools with an entry in `version`, optionally matching `query` in the tool's id,
    name, description or category, or in the text of one of its entries."""
    in_version = Q()
    for model in ENTRY_MODELS:
        in_version |= Q(pk__in=model.objects.filter(version=version).values("tool_id"))
    tools = Tool.objects.filter(in_version)
    query = query.strip()
    if query:
        match = (
            Q(tool_id__icontains=query)
            | Q(name__icontains=query)
            | Q(description__icontains=query)
            | Q(category__icontains=query)
        )
        for model, column in (
            (ScenarioEntry, "text"),
            (PrecautionEntry, "text"),
            (TemplateEntry, "template"),
        ):
            entries = model.objects.filter(version=version, **{f"{column}__icontains": query})
            match |= Q(pk__in=entries.values("tool_id"))
        tools = tools.filter(match)
        # The tool the query names first (the registry links each id to this search), then the
        # others whose texts mention it.
        named_first = Case(When(tool_id__iexact=query, then=Value(0)), default=Value(1))
        return tools.order_by(named_first, Lower("tool_id"), "tool_id")
    return tools.order_by(Lower("tool_id"), "tool_id")


def _first_rounds(model, version: CompendiumVersion, visible: QuerySet, tool_ids, texts) -> dict:
    """For each (tool, text) of `version`, the earliest visible global round that held it."""
    if not texts:
        return {}
    rows = (
        model.objects.filter(
            version__in=visible.filter(round__number__lte=version.round.number),
            tool_id__in=tool_ids,
            text__in=texts,
        )
        .order_by()
        .values("tool_id", "text")
        .annotate(first=Min("version__round__number"))
    )
    return {(r["tool_id"], r["text"]): r["first"] for r in rows}


def _releases(
    version: CompendiumVersion, tools: dict[int, str], organizations: QuerySet | None = None
) -> tuple[dict[tuple[int, str], list[float]], dict[tuple[int, str], int]]:
    """The Laplace scales behind each published statistic of `version`'s `tools` (pk: tool id),
    and the round that released it, both keyed by (pk, field). The round is the last one up to
    the version's (the version's own, published or not, and published ones before it) whose
    edges released the (tool, field): a tool no edge reported keeps the earlier global's figure
    (server_merge carries it forward), so an earlier round than the version's means the figure
    is carried forward from it. The scales are that round's ledger rows, of each edge's latest
    release in it (a re-release after an erasure replaces only its own edge's; an edge
    re-materialized without statistics has none), one per edge that noised it. A statistic
    without a ledger row has neither.

    `organizations`: only the scales of these organizations' edges (None: every edge, for the
    operator). An edge's scale is Δ/(K·ε_j) with Δ and ε_j public, so it tells its K, the count of
    its organization's submissions, which that organization alone (and the operator) may see; the
    round is still chosen from every edge's rows, as the global compendium is."""
    from functools import reduce
    from operator import or_

    pks = {tool_id: pk for pk, tool_id in tools.items()}
    # An edge re-materialized past the budget (an erasure's) carries no statistics any more, and
    # its earlier release's rows stay in the ledger: they back nothing published.
    withdrawn = CompendiumVersion.objects.filter(
        Q(entry_counts__metadata__isnull=True) | Q(entry_counts__metadata__lte=0),  # none, 0, null
        kind=CompendiumVersion.Kind.EDGE, round_id=OuterRef("round_id"),
        organization_id=OuterRef("organization_id"),
    )
    backing = PrivacyLedgerEntry.objects.filter(
        Q(round__state=Round.State.PUBLISHED) | Q(round_id=version.round_id),
        round__number__lte=version.round.number,
        tool_id__in=list(pks),
    ).filter(~Exists(withdrawn))
    # The round that last released each (tool, field), found in the database, then that round's
    # rows only: reading every earlier round's rows (per edge and release) grew with each round.
    latest = [
        Q(tool_id=item["tool_id"], field=item["field"], round__number=item["last"])
        for item in backing.order_by().values("tool_id", "field").annotate(last=Max("round__number"))
    ]
    if not latest:
        return defaultdict(list), {}
    rows = (
        backing.filter(reduce(or_, latest))
        .order_by("-round__number", "organization_id", "-release")
        .values_list("tool_id", "field", "round__number", "organization_id", "release", "noise_scale")
    )
    shown = None if organizations is None else set(organizations.values_list("pk", flat=True))
    chosen_round: dict[tuple[int, str], int] = {}
    seen: set[tuple[int, str, int]] = set()
    scales: dict[tuple[int, str], list[float]] = defaultdict(list)
    for tool_id, name, number, organization_id, _release, scale in rows:
        key = (pks[tool_id], name)
        if chosen_round.setdefault(key, number) != number or (*key, organization_id) in seen:
            continue  # an earlier round's, or an edge's earlier release
        seen.add((*key, organization_id))
        if shown is None or organization_id in shown:
            scales[key].append(scale)
    return scales, chosen_round


def compendium_page(
    version: CompendiumVersion,
    visible: QuerySet,
    *,
    query: str = "",
    page: str | int | None = 1,
    per_page: int = 20,
    release_organizations: QuerySet | None = None,
) -> tuple[Page, list[ToolCard]]:
    """One page of tools of `version` with their scenarios, precautions, templates, noisy
    statistics and annex triples, each text with the round it first appeared in.

    Each statistic carries the noise scales of the edges that released it: of every edge (the
    operator, `release_organizations` None) or only of `release_organizations`' edges (anyone
    else: their own organization's; another organization's scale tells its K), and the round
    that released it: an earlier one than the version's for a figure carried forward."""
    paginator = Paginator(tools_in_version(version, query), per_page)
    page_obj = paginator.get_page(page)
    tools = list(page_obj.object_list)
    cards = {t.pk: ToolCard(tool=t) for t in tools}
    tool_ids = list(cards)

    scenarios = list(ScenarioEntry.objects.filter(version=version, tool_id__in=tool_ids).order_by("-support", "text"))
    precautions = list(
        PrecautionEntry.objects.filter(version=version, tool_id__in=tool_ids).order_by("-support", "text")
    )
    first_scenario = _first_rounds(
        ScenarioEntry, version, visible, tool_ids, {s.text for s in scenarios}
    )
    first_precaution = _first_rounds(
        PrecautionEntry, version, visible, tool_ids, {p.text for p in precautions}
    )
    for s in scenarios:
        cards[s.tool_id].scenarios.append(
            EntryText(
                text=s.text,
                support=s.support,
                since_round=first_scenario.get((s.tool_id, s.text)),
                preconditions=s.preconditions,
            )
        )
    for p in precautions:
        cards[p.tool_id].precautions.append(
            EntryText(text=p.text, support=p.support, since_round=first_precaution.get((p.tool_id, p.text)))
        )
    for t in TemplateEntry.objects.filter(version=version, tool_id__in=tool_ids).order_by("signature"):
        cards[t.tool_id].templates.append(t)
    fields = {f.name: f for f in NumericField.objects.all()}
    specs = {name: numeric_field_spec(f) for name, f in fields.items()}
    scales, rounds = _releases(version, {t.pk: t.tool_id for t in tools}, release_organizations)
    for s in StatEntry.objects.filter(version=version, tool_id__in=tool_ids).order_by("field"):
        spec = fields.get(s.field)
        noise = scales.get((s.tool_id, s.field), [])  # s.tool_id: the Tool's pk
        released = rounds.get((s.tool_id, s.field))
        window = clip_bound(specs[s.field]) if spec else None
        cards[s.tool_id].stats.append(
            {
                "field": s.field,
                "value": s.value,
                # the round whose edges released it (None: no ledger row says), and whether
                # that is an earlier round's figure carried forward into this global
                "round": released,
                "carried": released is not None and released < version.round.number,
                "unit": spec.unit if spec else "",
                "description": spec.description if spec else "",
                "noise_scale": min(noise) if noise else None,
                "noise_scale_max": max(noise) if noise else None,
                "edges": len(noise),
                # The clipping window [min, min(max, min + Δ)] every figure is clamped to, whose
                # width the noise is calibrated to (None: the field is no longer declared)
                "window": (window.lo, window.hi) if window else None,
                # A single edge's noise is at least as wide as that window: the clamped value
                # lands anywhere in it whatever the clients reported.
                "noise_dominated": bool(noise and spec and noise_dominated(
                    min(noise), specs[s.field])),
                # b / window: about this many times the ε, or the clients per edge, would
                # bring the noise under the window
                "noise_to_window": (noise_to_window(min(noise), specs[s.field])
                                    if noise and spec else None),
            }
        )
    by_term = defaultdict(list)
    for tool in tools:
        for term in {tool.tool_id, tool.name} - {""}:
            by_term[term].append(tool.pk)
    if by_term:
        terms = list(by_term)
        for triple in AnnexEntry.objects.filter(version=version).filter(
            Q(subject__in=terms) | Q(object__in=terms)
        ).order_by("subject", "relation", "object"):
            for pk in set(by_term.get(triple.subject, []) + by_term.get(triple.object, [])):
                cards[pk].annex.append(triple)
    return page_obj, [cards[t.pk] for t in tools]


def annex_page(
    version: CompendiumVersion, *, query: str = "", page: str | int | None = 1, per_page: int = 50
) -> Page:
    """One page of the annex triples of `version`, optionally matching `query` in any term."""
    triples = AnnexEntry.objects.filter(version=version)
    query = query.strip()
    if query:
        triples = triples.filter(
            Q(subject__icontains=query) | Q(relation__icontains=query) | Q(object__icontains=query)
        )
    return Paginator(triples.order_by("subject", "relation", "object"), per_page).get_page(page)


# --- tool registry -------------------------------------------------------------------------------


def _count_in(model, version: CompendiumVersion | None):
    if version is None:
        return Value(0, output_field=IntegerField())
    counts = (
        model.objects.filter(version=version, tool_id=OuterRef("pk"))
        .order_by()
        .values("tool_id")
        .annotate(n=Count("id"))
        .values("n")
    )
    return Coalesce(Subquery(counts, output_field=IntegerField()), 0)


def tool_registry(
    *,
    query: str = "",
    category: str = "",
    latest: CompendiumVersion | None = None,
    page: str | int | None = 1,
    per_page: int = 50,
) -> Page:
    """One page of registry tools, with how many scenarios and precautions the latest global
    compendium holds for each."""
    tools = Tool.objects.all()
    query = query.strip()
    if query:
        tools = tools.filter(
            Q(tool_id__icontains=query)
            | Q(name__icontains=query)
            | Q(description__icontains=query)
            | Q(category__icontains=query)
        )
    if category:
        tools = tools.filter(category=category)
    tools = tools.annotate(
        scenario_count=_count_in(ScenarioEntry, latest),
        precaution_count=_count_in(PrecautionEntry, latest),
    ).order_by(Lower("tool_id"), "tool_id")
    return Paginator(tools, per_page).get_page(page)


def tool_categories() -> list[str]:
    return list(
        Tool.objects.exclude(category="").order_by("category").values_list("category", flat=True).distinct()
    )


# --- organizations -------------------------------------------------------------------------------


@dataclass
class OrganizationPage:
    organization: object
    clients: dict[str, list[Client]]
    can_admin: bool
    edge_rows: list[dict]
    chart: str = ""
    edge_page: Page | None = None  # the page of rounds `edge_rows` holds, newest first


def organization_page(organization, actor, page=1, per_page=50) -> OrganizationPage:
    """An organization's clients by status, whether `actor` may manage them, and its edge's
    figures per round, one page of `per_page` rounds, the latest first: submissions, edge
    compendium size and entries, conflicts, rejected
    submissions, and scenarios dropped by the merge's cross-checks (whole submissions of
    implausible clients, by name; tool confusion, with the margin used; incoherent batches; batches
    a robust rule dropped across clients, and members it dropped inside a cluster). The chart
    draws every round."""
    from federation.models import MergeRecord
    from federation.services import can_admin

    clients = {status: [] for status in Client.Status.values}
    for client in Client.objects.filter(organization=organization).select_related("token").order_by("name"):
        clients[client.status].append(client)
    submissions = dict(
        CompendiumVersion.objects.filter(kind=KIND_CLIENT, client__organization=organization)
        .order_by()
        .values_list("round__number")
        .annotate(n=Count("id"))
    )
    edges = {
        v.round.number: v
        for v in CompendiumVersion.objects.filter(kind=KIND_EDGE, organization=organization)
        .select_related("round")
        .defer("content", "routing_head")
    }
    recorded = set(
        MergeRecord.objects.filter(organization=organization).values_list("round__number", flat=True)
    )
    numbers = sorted(set(submissions) | set(edges) | recorded)
    edge_page = Paginator(numbers[::-1], per_page).get_page(page)
    records = {
        m.round.number: m
        for m in MergeRecord.objects.filter(
            organization=organization, round__number__in=list(edge_page.object_list)
        ).select_related("round")
    }
    names = {f"client:{pk}": name for pk, name in
             Client.objects.filter(organization=organization).values_list("pk", "name")}
    rows = []
    for n in edge_page.object_list:
        record = records.get(n)
        stats = record.stats if record else {}
        rows.append(
            {
                "round": n,
                "submissions": submissions.get(n, 0),
                "edge": edges.get(n),
                "conflicts": stats.get("conflicts"),
                "rejected": len(record.rejected) if record else None,
                "flagged": len(record.flagged) if record else None,
                "scenarios_in": stats.get("scenarios_in"),
                "confusion_margin": stats.get("confusion_margin"),
                "dropped_clients": [names.get(source, source)
                                    for source in stats.get("dropped_sources") or ()],
                "krum_premise": krum_premise_note(
                    stats, RoundConfig.from_stored(record.round.config), "the edge's clients"
                ) if record else "",
                "flags_held_back": flags_held_back_note(stats, "the edge compendium",
                                                        "of the edge's clients"),
                "unanswered_consistency": unanswered_consistency_note(stats, "the edge merge"),
                **_summary_figures(stats),
            }
        )
    page = OrganizationPage(organization, clients, can_admin(actor, organization.pk), rows,
                            edge_page=edge_page)
    if numbers:
        fig = go.Figure()
        counts = [submissions.get(n, 0) for n in numbers]
        fig.add_trace(go.Bar(x=numbers, y=counts, name="client submissions"))
        fig.add_trace(
            go.Scatter(
                x=numbers,
                y=[edges[n].size_bytes / 1000 if n in edges else None for n in numbers],
                name="edge compendium (kB)",
                mode="lines+markers",
                yaxis="y2",
            )
        )
        styled(
            fig,
            title={"text": f"{literal(organization.name)}: submissions and edge compendium size"},
            xaxis={"title": {"text": "round"}, "dtick": 1},
            yaxis=count_axis("submissions", max(counts)),
            yaxis2=right_axis("edge size (kB)"),
        )
        page.chart = render_figure(fig, div_id="edge-figures", label=f"Edge figures of {organization}")
    return page


def server_merge_summaries(version: CompendiumVersion, *, operator: bool) -> dict | None:
    """What the server merge's summarizer did for this global (`_summary_figures`), or None
    without a record of it. A fallback's reason can quote the LLM's answer, and an answer in
    prose repeats the cluster's texts, which in the server merge come from several
    organizations' edges (as its conflicts' do): the operator reads the reason, anyone else its
    cause (the fallback's `kind`, such as "unusable answer")."""
    from federation.models import MergeRecord

    record = MergeRecord.objects.filter(round=version.round, organization__isnull=True).first()
    if record is None:
        return None
    rows = not_released_fields(Round.objects.filter(pk=version.round_id))
    not_released = rows[0][1] if rows else []
    # How far the noise was from releasable follows from the largest organization's K: the
    # operator's to know (an organization's people do not see another edge's K).
    ratio = not_released_noise_to_window(version.round) if operator and not_released else None
    epsilon = RoundConfig.from_stored(version.round.config).epsilon
    return {**_summary_figures(record.stats, reason="reason" if operator else "kind"),
            "conflicts": record.stats.get("conflicts") or 0,
            "stats_withheld": record.stats.get("stats_withheld") or 0,
            # the operator chose the rule; the sizes count edges and their members
            "krum_premise": krum_premise_note(
                record.stats, RoundConfig.from_stored(version.round.config), "the edges"
            ) if operator else "",
            "flags_held_back": flags_held_back_note(record.stats, "this global compendium",
                                                    "edges"),
            "unanswered_consistency": unanswered_consistency_note(record.stats, "the server merge"),
            "fields_not_released": not_released,
            "not_released_noise_to_window": ratio,
            # more than this ε per round (or ratio times the clients per organization) would
            # have released them
            "releasable_epsilon": ratio * epsilon if ratio is not None else None}


def not_released_noise_to_window(round_: Round) -> float | None:
    """For a round whose edges released no numeric field (`merge.drowned_fields`): how many
    times its clipping window the narrowest published noise would have been
    (`merge.operator.published_noise_to_window`), from its edges' merge records (the most
    submissions one organization merged, how many organizations merged) and its configuration,
    against the schema in force now. The noise falls as 1/ε and 1/K, so more than that many
    times the round's ε, or about that many times the clients per organization, would have
    released them. None without edge records."""
    from federation.models import MergeRecord
    from federation.submissions import schema_in_force

    per_organization: dict[int, int] = {}
    for organization, stats in MergeRecord.objects.filter(
        round=round_, organization__isnull=False
    ).values_list("organization", "stats"):
        inputs = (stats or {}).get("inputs")  # the source ids the edge merged
        count = len(inputs) if isinstance(inputs, list) else int(inputs or 0)
        per_organization[organization] = max(per_organization.get(organization, 0), count)
    return published_noise_to_window(
        schema_in_force(), RoundConfig.from_stored(round_.config),
        max(per_organization.values(), default=0), len(per_organization),
    )


def flags_held_back_note(stats: dict, compendium: str, sources: str) -> str:
    """What a merge's record says of the precondition flag names it left off `compendium`
    (`MergeStats.flags_held_back`: fewer than FLAG_MIN_SOURCES of its `sources` carried each for
    its tool), as a count, never a name; "" when there were none or the record predates the
    count."""
    from federation.merge.operator import FLAG_MIN_SOURCES

    count = stats.get("flags_held_back") or 0
    if not isinstance(count, int) or count <= 0:
        return ""
    one = count == 1
    return (f"{count} precondition flag name{'' if one else 's'} {'was' if one else 'were'} left "
            f"off {compendium}: fewer than {FLAG_MIN_SOURCES} {sources} carried "
            f"{'it' if one else 'each'} for its tool (a name only one source writes could name "
            f"a person or an account).")


def unanswered_consistency_note(stats: dict, merge: str) -> str:
    """What a merge's record says of the LLM's consistency questions it got no usable answer to
    (`MergeStats.consistency_unanswered`), in a sentence; "" where there were none (or the record
    is from before they were counted)."""
    missed, asked = stats.get("consistency_unanswered") or 0, stats.get("consistency_asked") or 0
    if not isinstance(missed, int) or missed <= 0:
        return ""
    return (f"The LLM gave no usable answer to {missed:,} of {merge}'s {asked:,} consistency "
            f"question{'' if asked == 1 else 's'} (unreachable, or no Consistent/Inconsistent in "
            f"its answer): those pairs of scenarios were judged by their precondition flags "
            f"alone, so a contradiction only the LLM would have caught merged with no conflict "
            f"logged.")


def krum_premise_note(stats: dict, config: RoundConfig, sources: str) -> str:
    """What a merge's record says of the groups Krum judged with fewer than 2f + 3 inputs
    (`MergeStats.krum_below_premise`), where its guarantee does not hold, in a sentence for the
    operator; "" where the round's rule is not Krum or there were none (a record from before the
    count was kept has none). `sources`: what the merge's sources are ("the edge's clients")."""
    count = stats.get("krum_below_premise") or 0
    if config.robust_rule != "krum" or not count:
        return ""
    sizes = stats.get("krum_below_premise_sizes") or []
    if len(sizes) == 1:
        where = f" (n = {sizes[0]['n']}, f = {sizes[0]['f']})"
    elif sizes:
        where = " (" + "; ".join(f"{s['groups']} at n = {s['n']}, f = {s['f']}" for s in sizes) + ")"
    else:
        where = ""
    try:
        fraction = float(config.trim_fraction)
        start = krum_premise_from(fraction)
    except (TypeError, ValueError):  # a configuration recorded before the bounds: not said
        start = None
    share = (f" At this f share ({fraction:g}) every group of {start} or more inputs meets it."
             if start else "")
    return (f"Krum judged {count} group{'' if count == 1 else 's'} (a tool's batches across "
            f"{sources}, or a scenario cluster's members) with fewer than 2f + 3 inputs{where}: "
            f"its guarantee does not hold there.{share} The trimmed mean needs only n > 2f, which "
            f"every group meets.")


def _summary_figures(stats: dict, reason: str = "reason") -> dict:
    """What a merge's summarizer did (`summary_counts`), which summarizer it was, and the most
    frequent reason it fell back (or, with `reason="kind"`, the most frequent cause)."""
    reasons = Counter(f.get(reason, "") for f in stats.get("summarizer_fallbacks") or [])
    return {
        **summary_counts(stats),
        "summarizer": stats.get("summarizer") or None,
        "fallback_reason": reasons.most_common(1)[0][0] if reasons else "",
        "llm_summarizer": stats.get("summarizer") in LLM_SUMMARIZERS,
    }


# --- audit log -----------------------------------------------------------------------------------


AUDIT_CSV_COLUMNS = (
    "created_at", "actor", "action", "organization", "target_type", "target_id", "target_label",
    "ip", "details",
)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value) -> str:
    """A cell a spreadsheet shows as text: one that would start a formula (a client's name like
    `=HYPERLINK(...)`) is prefixed with an apostrophe (OWASP's CSV injection advice)."""
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def audit_csv_lines(entries: QuerySet, user):
    """The audit entries as CSV lines (header first), streamed from the database in chunks, with
    the details `user` may read."""
    from federation.services import audit_entry_for

    buffer = io.StringIO()
    writer = csv.writer(buffer)

    def line(cells) -> str:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow([_csv_cell(cell) for cell in cells])
        return buffer.getvalue()

    yield line(AUDIT_CSV_COLUMNS)
    for e in entries.iterator(chunk_size=2000):
        shown = audit_entry_for(user, e)
        yield line((
            e.created_at.isoformat(), e.actor_label, e.action,
            e.organization.slug if e.organization else "", e.target_type, e.target_id,
            e.target_label, shown.ip or "",
            json.dumps(shown.details, sort_keys=True, ensure_ascii=False),
        ))


def audit_entries(organizations: QuerySet, *, operator: bool, filters: dict) -> QuerySet:
    """Audit entries the user may see (operator: all; others: their organizations' entries),
    filtered as the API filters them (`federation.services.filtered_audit_log`: action,
    organization slug, target_type, target_id, round, period), but by actor as a substring.
    Raises BadRequest naming a malformed filter."""
    from federation.errors import InvalidRequest
    from federation.services import filtered_audit_log

    entries = AuditLog.objects.select_related("organization")
    if not operator:
        entries = entries.filter(organization__in=organizations)
    actor = (filters.get("actor") or "").strip()
    if actor:  # a substring here, where the API takes the whole label
        entries = entries.filter(actor_label__icontains=actor)
    exact = {name: (filters.get(name) or "").strip() for name in (
        "action", "organization", "target_type", "target_id", "round", "since", "until")}
    try:
        entries = filtered_audit_log(entries, exact)
    except InvalidRequest as error:
        raise BadRequest(str(error)) from None
    return entries.order_by("-created_at", "-id")


# --- privacy -------------------------------------------------------------------------------------


@dataclass
class PrivacyPage:
    budget: float
    federation: object  # composed ε′ recorded in the ledger (federation-wide)
    organizations: list[tuple]  # (name, composition) of the visible organizations only
    ledger: Page
    next_epsilon: float
    would_exceed: bool
    projected: object  # committed ε′ after one more round at next_epsilon
    committed: object = None  # composed ε′ of the ledger plus the open rounds' reservations
    reserved: list[tuple] = field(default_factory=list)  # (round number, projected ε)
    warning: str = ""
    charts: list[str] = field(default_factory=list)
    # The latest round's releases per visible edge: what the noise leaves of them (release_signal)
    signal: list[dict] = field(default_factory=list)
    # (round number, fields no edge released) of the latest published rounds (not_released_fields)
    not_released: list[tuple[int, list[str]]] = field(default_factory=list)
    # The open round's number (None: none): the next round opens only once it has closed.
    open_round: int | None = None

    @property
    def reserved_epsilon(self) -> float:
        return sum(eps for _, eps in self.reserved)


def not_released_fields(
    rounds: QuerySet | None = None, limit: int = 10
) -> list[tuple[int, list[str]]]:
    """(round number, numeric fields) of the latest `limit` of `rounds` (default: the published
    ones) whose edges left fields unreleased because no release of the round could make them
    useful (`merge.drowned_fields`), read from the edges' merge records: a fact of the round's
    counts and configuration, the same for every organization, so shown to every member. Newest
    first."""
    from federation.models import MergeRecord

    if rounds is None:
        rounds = Round.objects.filter(state=Round.State.PUBLISHED)
    per_round: dict[int, set[str]] = defaultdict(set)
    for number, names in MergeRecord.objects.filter(
        organization__isnull=False, round__in=rounds
    ).values_list("round__number", "stats__fields_not_released"):
        per_round[number].update(names or ())
    return [(n, sorted(f)) for n, f in sorted(per_round.items(), reverse=True) if f][:limit]


def release_signal(releases: dict, names: dict[int, str], round_numbers: dict[int, int]) -> list[dict]:
    """Per edge of the organizations `names` ({id: name}), its latest release of the latest round
    it released in: how many statistics, at which K and ε per statistic, and how many of them
    carry noise at least as wide as the whole window the clients' clipped values lie in (b >= Δ,
    that is K·ε <= 1), which leaves a released average next to nothing of what the clients sent.
    Newest round first, then by organization name. `releases`: the ledger's releases with their
    figures (`accounting.ledger_releases(figures=True)`); `round_numbers`: {round id: number}."""
    latest: dict[int, tuple[int, int]] = {}
    for (org, round_id, release) in releases:
        if org in names:
            # an erasure's re-release supersedes the one before (whose rows stay in the ledger,
            # spent): mixing them counted statistics twice and their K
            key = (round_numbers.get(round_id, 0), release)
            if org not in latest or key > latest[org][0]:
                latest[org] = (key, round_id)
    out = []
    for org, ((number, release), round_id) in latest.items():
        figures = releases[(org, round_id, release)]
        out.append({
            "organization": names[org], "round": number, "releases": figures.rows,
            "noisy": figures.noisy, "k_min": figures.k_min, "k_max": figures.k_max,
            "eps_min": figures.eps_min, "eps_max": figures.eps_max,
            "field_cap": figures.field_cap,
        })
    return sorted(out, key=lambda r: (-r["round"], r["organization"]))


def _composition_curve(per_round: list[float], delta_prime: float):
    from federation.merge.privacy import compose_prefixes

    return compose_prefixes(per_round, delta_prime)


def _ledger_page(ledger: QuerySet, page, releases: dict, organizations: set[int],
                 counted: tuple[int | None, dict[int, int]] | None) -> Page:
    """The ledger table's `page` (50 rows), its row count summed from the releases already read
    (the rows of `organizations`' releases, of round number `counted[0]` when not None;
    `counted[1]`: {round id: number}) rather than counted again over the ledger; `counted` None:
    counted by the database (a tool filter, which the releases do not break down)."""
    paginator = Paginator(ledger, 50)
    if counted is not None:
        number, round_numbers = counted
        paginator.count = sum(  # Paginator.count is a cached_property: this is its value
            r.rows for (org, round_id, _), r in releases.items()
            if org in organizations and (number is None or round_numbers.get(round_id) == number))
    return paginator.get_page(page)


def privacy_page(
    organizations: QuerySet, *, operator: bool, page=1, next_epsilon=None,
    ledger_round: int | None = None, ledger_tool: str = "",
) -> PrivacyPage:
    """The ledger (rows of the visible organizations), the composed ε′ per federation and
    organization (basic and advanced) against the cap, the committed ε′ (the ledger plus the
    reservations of rounds not released yet), and whether opening the next round at
    `next_epsilon` (default: the last round's ε) would be refused.

    Federation-wide figures are shown to every member: the global compendium is released to
    every organization, so its ε concerns all of them. Per-organization figures and ledger rows
    are those of `organizations` (the visible ones) only; the ledger's rows of round
    `ledger_round` and of tools whose id contains `ledger_tool` (case-insensitive), when given."""
    from federation import accounting
    from federation.models import PrivacyLedgerEntry

    # The ledger, read once (two grouped queries) for the report, the check, the charts, what
    # the noise leaves of each edge's latest release and the ledger table's count.
    releases = accounting.ledger_releases(figures=True)
    spends = accounting.spends_of(releases)
    committed = accounting.commitments(spends)
    report = accounting.privacy_report(spends, committed)
    fed_rounds = accounting._federation_rounds(spends)
    round_numbers = dict(Round.objects.values_list("pk", "number"))
    names = dict(organizations.values_list("pk", "name"))
    visible_ids = set(names)
    config = next_round_config(next_epsilon)
    next_epsilon = config.epsilon
    check = accounting.check_budget(config, spends=spends, committed=committed)
    ledger = (
        PrivacyLedgerEntry.objects.filter(organization__in=organizations)
        .filter(**({"round__number": ledger_round} if ledger_round is not None else {}))
        .filter(**({"tool_id__icontains": ledger_tool} if ledger_tool else {}))
        .select_related("round", "organization")
        .order_by("-round__number", "organization__name", "release", "tool_id", "field")
    )
    result = PrivacyPage(
        budget=report.budget,
        federation=report.federation,
        organizations=[(names[k], v) for k, v in report.organizations.items() if k in visible_ids],
        ledger=_ledger_page(ledger, page, releases, visible_ids,
                            None if ledger_tool else (ledger_round, round_numbers)),
        next_epsilon=next_epsilon,
        would_exceed=check.exceeded,
        projected=check.after,
        committed=report.committed,
        reserved=sorted((round_numbers.get(r, r), eps) for r, eps in report.reserved.items()),
        warning=budget_warning(config, check),
        signal=release_signal(releases, names, round_numbers),
        not_released=not_released_fields(),
        open_round=Round.objects.filter(state=Round.State.OPEN)
        .values_list("number", flat=True).first(),
    )
    delta = accounting.delta_prime()
    series = [("federation", fed_rounds)] + [
        (literal(names[k]), spends[k]) for k in sorted(spends) if k in visible_ids
    ]
    if fed_rounds:
        spent = go.Figure()
        for name, per_round in series:
            ids = sorted(per_round, key=lambda r: round_numbers.get(r, 0))
            spent.add_trace(go.Bar(x=[round_numbers.get(r) for r in ids],
                                   y=[per_round[r] for r in ids], name=name))
        styled(spent, title={"text": "ε spent per round"}, barmode="group",
               xaxis={"title": {"text": "round"}, "dtick": 1},
               yaxis={"title": {"text": "ε"}, "rangemode": "tozero"})
        result.charts.append(render_figure(spent, div_id="epsilon-per-round"))
        composed = go.Figure()
        for name, per_round in series:
            ids = sorted(per_round, key=lambda r: round_numbers.get(r, 0))
            curve = _composition_curve([per_round[r] for r in ids], delta)
            x = [round_numbers.get(r) for r in ids]
            dash = None if name == "federation" else "dot"
            composed.add_trace(go.Scatter(x=x, y=[c.basic_epsilon for c in curve], mode="lines+markers",
                                          name=f"{name}: basic", line={"dash": dash}))
            composed.add_trace(go.Scatter(x=x, y=[c.advanced_epsilon for c in curve],
                                          mode="lines+markers", name=f"{name}: advanced",
                                          line={"dash": "dash" if name == "federation" else "dot"}))
        composed.add_hline(y=report.budget, line={"color": "#b42318", "width": 2},
                           annotation_text=f"budget cap ε = {report.budget:g}")
        styled(composed, title={"text": "Composed ε′ over rounds (the cap applies to the tighter)"},
               xaxis={"title": {"text": "round"}, "dtick": 1},
               yaxis={"title": {"text": "ε′"}, "rangemode": "tozero"})
        result.charts.append(render_figure(composed, div_id="epsilon-composed"))
    return result


# --- conflict review -----------------------------------------------------------------------------


@dataclass
class ConflictCard:
    conflict: object
    composed: str
    choices: list[str]
    decision: object | None
    # The tools the candidates were claimed for: more than one across tools, where the pick
    # names the tool the scenario wins for (the centroid and a dissenter may share a text).
    tools: list[str]
    can_decide: bool
    closed_by: object | None = None  # the later round after whose merge no decision applies
    paused_by: object | None = None  # a later round merging now: decide once it is done
    failed: object | None = None  # its own round failed: no merge reads its log unless retried
    seen: str = ""  # the decision shown (`conflicts.decision_seen`), sent back with the forms
    # An accept whose text is no longer the precaution composed (`conflicts.accept_out_of_date`):
    # the next merge publishes the precaution as composed now, not the text accepted.
    stale: bool = False
    # Of an undecided conflict: the latest decision on the same (organization, tool, cluster id)
    # in an earlier round (the same sources contradicting each other again), shown, not applied;
    # `again` holds the form fields that take it again, None where it cannot be (its scenario is
    # no longer one of this conflict's, or no precaution can be composed to accept).
    earlier: object | None = None
    again: dict | None = None
    # Across tools: each (form value, text, tool, picked) the pick list offers, one per candidate
    # text with the tool it was claimed for (`conflicts.pick_value`).
    picks: list[tuple[str, str, str, bool]] = field(default_factory=list)
    # The conflict's tools the registry in force does not list (deactivated): no merge publishes
    # a precaution or scenario for them (`conflicts.out_of_registry`), so the forms that would
    # are left out (`editable`, `pickable`, `picks`): the service refuses them.
    out_of_registry: list[str] = field(default_factory=list)
    editable: bool = True
    pickable: bool = True


def conflict_groups(
    organizations: QuerySet, actor, *, round_number=None, organization_slug="", page=1, per_page=50
):
    """One page of conflicted clusters of the visible edges, grouped per (organization, round),
    newest round first, each with its composed precaution, the scenarios that may win, and its
    decision; the operator also sees the server merge's (organization None: conflicts between
    edges, whose texts come from several organizations). Returns (page, groups)."""
    from compendium.services import current_schema
    from federation.conflicts import (
        MERGING_STATES,
        accept_out_of_date,
        can_decide,
        candidate_tools,
        closed_by_each,
        composed_precaution,
        decision_seen,
        failed_round,
        out_of_registry,
        paused_by,
        pick_value,
        scenario_candidates,
        scenario_choices,
        visible_conflicts,
    )
    from federation.models import ConflictDecision
    from federation.pipeline import merged_under_flag_rule_each

    conflicts = visible_conflicts(organizations, actor).select_related("round", "organization")
    if round_number is not None:
        conflicts = conflicts.filter(round__number=round_number)
    if organization_slug:
        conflicts = conflicts.filter(organization__slug=organization_slug)
    page_obj = Paginator(
        conflicts.order_by("-round__number", "organization__name", "tool_id", "centroid_id"), per_page
    ).get_page(page)
    conflicts = list(page_obj.object_list)
    decisions = {
        (d.round_id, d.organization_id, d.tool_id, d.centroid_id): d
        for d in ConflictDecision.objects.filter(
            round__in={c.round_id for c in conflicts}
        ).select_related("decided_by")
    }
    earlier = _earlier_decisions(
        [c for c in conflicts
         if (c.round_id, c.organization_id, c.tool_id, c.centroid_id) not in decisions]
    )
    schema = current_schema() if conflicts else None
    groups: dict[tuple, list[ConflictCard]] = {}
    admin = {}
    # Of every (organization, round) group of the page at once: a query per group grew with it.
    closed = closed_by_each(conflicts)
    released = merged_under_flag_rule_each((c.round_id, c.organization_id) for c in conflicts)
    merging = list(Round.objects.filter(state__in=MERGING_STATES).order_by("number"))
    for c in conflicts:
        if c.organization_id not in admin:
            admin[c.organization_id] = can_decide(actor, c.organization_id)
        paused = paused_by(c, merging)
        composed = composed_precaution(
            c, schema, flags_released=(c.round_id, c.organization_id) in released)
        decision = decisions.get((c.round_id, c.organization_id, c.tool_id, c.centroid_id))
        choices, tools = scenario_choices(c), candidate_tools(c)
        Action = ConflictDecision.Action
        editable = not out_of_registry(c, schema, Action.EDIT)
        pickable = not out_of_registry(c, schema, Action.SCENARIO)
        missing = [t for t in dict.fromkeys(
            [*out_of_registry(c, schema, Action.EDIT), *tools]) if t not in schema.tools_by_id]
        picks = []
        if len(tools) > 1:
            candidates = scenario_candidates(c)
            picked = None
            if decision is not None and decision.action == ConflictDecision.Action.SCENARIO:
                # a decision from before the tool was recorded: the first candidate with the text
                picked = next(((t, x) for t, x in candidates if x == decision.text
                               and decision.winner_tool_id in ("", t)), None)
            picks = [(pick_value(t, x), x, t, (t, x) == picked) for t, x in candidates
                     if not out_of_registry(c, schema, Action.SCENARIO, t)]
            pickable = bool(picks)
        before = earlier.get(c.pk)
        again = _take_again(before, composed, choices, tools)
        if again is not None and out_of_registry(c, schema, again["action"],
                                                 again.get("scenario_tool", "")):
            again = None
        groups.setdefault((c.organization, c.round), []).append(
            ConflictCard(
                conflict=c,
                composed=composed,
                choices=choices,
                decision=decision,
                tools=tools,
                # Of a closed conflict the merge that read it applied the accept as it stood.
                stale=closed[(c.organization_id, c.round_id)] is None
                and accept_out_of_date(decision, composed),
                can_decide=admin[c.organization_id]
                and closed[(c.organization_id, c.round_id)] is None
                and paused is None and failed_round(c) is None,
                closed_by=closed[(c.organization_id, c.round_id)],
                paused_by=paused,
                failed=failed_round(c),
                seen=decision_seen(decision),
                earlier=before,
                again=again,
                picks=picks,
                out_of_registry=missing,
                editable=editable,
                pickable=pickable,
            )
        )
    return page_obj, [
        {"organization": o, "round": r, "cards": cards} for (o, r), cards in groups.items()
    ]


def _earlier_decisions(conflicts) -> dict:
    """Per conflict pk, the latest decision on the same (organization, tool, cluster id) in a
    round before the conflict's: one query for all of `conflicts`. Keyed by the conflict's own
    organization, so it is as visible as the conflict."""
    from federation.models import ConflictDecision

    if not conflicts:
        return {}
    match = Q()
    for c in conflicts:
        match |= Q(organization_id=c.organization_id, tool_id=c.tool_id,
                   centroid_id=c.centroid_id, round__number__lt=c.round.number)
    found: dict[tuple, list] = {}
    for d in ConflictDecision.objects.filter(match).select_related("round", "decided_by").order_by(
        "-round__number"
    ):
        found.setdefault((d.organization_id, d.tool_id, d.centroid_id), []).append(d)
    earlier = {}
    for c in conflicts:
        for d in found.get((c.organization_id, c.tool_id, c.centroid_id), []):
            if d.round.number < c.round.number:
                earlier[c.pk] = d
                break
    return earlier


def _take_again(decision, composed: str, choices: list[str], tools: list[str]) -> dict | None:
    """The decide form's fields that take `decision` (of an earlier round) again on a conflict
    with this composed precaution, scenarios and tools; None where it cannot be taken as it was."""
    from federation.models import ConflictDecision

    Action = ConflictDecision.Action
    if decision is None:
        return None
    if decision.action == Action.ACCEPT:
        # An accept stores the precaution composed now, which may differ from the earlier text.
        return {"action": Action.ACCEPT} if composed else None
    if decision.action == Action.EDIT:
        return {"action": Action.EDIT, "text": decision.text}
    if decision.action == Action.SCENARIO:
        if decision.text not in choices:
            return None
        tool = decision.winner_tool_id
        if tool and len(tools) > 1 and tool not in tools:
            return None
        return {"action": Action.SCENARIO, "scenario": decision.text,
                "scenario_tool": tool if len(tools) > 1 else ""}
    return {"action": Action.DISMISS}


# --- accuracy ------------------------------------------------------------------------------------


@dataclass
class AccuracyPage:
    run: object | None
    runs: list
    summary: list[dict] = field(default_factory=list)
    per_category: list[dict] = field(default_factory=list)
    charts: dict[str, str] = field(default_factory=dict)
    adversarial: list[dict] = field(default_factory=list)
    adversarial_table: list[dict] = field(default_factory=list)  # per row: counts in words
    camouflage_share: float | None = None  # what camouflaged adversaries relabel, if any ran
    clean_to_target: float | None = None  # the targeting share of the run without adversaries
    privacy_sweep: list[dict] = field(default_factory=list)
    release_sweep: list[dict] = field(default_factory=list)  # k-anonymous release, per k
    transfer: list[dict] = field(default_factory=list)  # mean over seeds per (model, reranker, llm)
    tau_sweep: list[dict] = field(default_factory=list)  # per τ: accuracy, global size, dedup rate
    summarizer_sweep: list[dict] = field(default_factory=list)
    cadence: list[dict] = field(default_factory=list)  # per cadence: accuracy per round
    contradictions: list[dict] = field(default_factory=list)  # per (share, conflict log)
    contradiction_table: list[dict] = field(default_factory=list)  # per share: with / without
    cadence_table: list[dict] = field(default_factory=list)  # per cadence: last, worst, mean round
    drift_every: int = 0  # the run's workload drift: new categories every D rounds (0: none)
    setup: list[str] = field(default_factory=list)  # the run's configuration, in words
    host: str = ""  # where it ran (`run_host`), shown to the operator


def run_setup(doc: dict) -> list[str]:
    """What a stored simulation ran, in the words an operator reads its figures with: the
    federation, the data each client had, and the privacy and merge settings (the cadence, the
    drift, contradictions, users per client, the robust rules' share, the linear head, conflict
    log and carry-forward where they are not the defaults: runs that differ there look alike
    otherwise)."""
    config = doc.get("config") or {}
    if not config:
        return []
    default = SimulationConfig()

    def changed(name: str):
        """The run's setting where it is not the default (a setting not named ran at it)."""
        value = config.get(name, getattr(default, name))
        return value if value != getattr(default, name) else None

    seeds = doc.get("seeds") or []
    every = changed("aggregate_every")
    out = [
        f"{config.get('orgs')} organizations × {config.get('clients_per_org')} clients, "
        f"{config.get('rounds')} rounds, "
        + ("" if every is None else "frozen after round 1, " if every == 0
           else f"aggregating every {every} rounds, ")
        + f"{config.get('partition')} partition, "
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
        + (f" ({', '.join(map(str, seeds))})" if seeds else "")
        + (", rounds closed through the services (submission service, close, merge pipeline)"
           if config.get("through_services") else ""),
    ]
    data = [f"public probe set {config.get('probe_fraction', 0.1):.0%} of the queries"]
    if config.get("queries_per_client"):
        data.insert(0, f"at most {config['queries_per_client']} train queries per client")
    if config.get("test_limit"):
        data.append(f"at most {config['test_limit']} test queries")  # a sample of the split, if larger
    if changed("users_per_client"):
        data.insert(0, f"{config['users_per_client']} users per client")
    if changed("drift_every"):
        data.append(f"new categories come into use every {config['drift_every']} rounds")
    if changed("contradiction_fraction"):
        data.append(f"{config['contradiction_fraction']:.0%} of each honest client's scenarios "
                    "contradicted")
    out.append(", ".join(data))
    trim = changed("trim_fraction")
    out.append(
        f"ε = {config.get('epsilon')} per round, λ = {config.get('mask_strength')}, "
        f"τ = {config.get('tau')}, summarizer {config.get('summarizer')}, "
        f"robust rule {config.get('robust_rule')}"
        + (f" (share of possibly adversarial sources f = {trim:g})" if trim is not None else "")
        + f", reranker {config.get('reranker')}"
        + (", without the linear head" if changed("linear_head") is False else "")
        + (", without the conflict log" if changed("conflict_log") is False else "")
        + (", without carry-forward" if changed("carry_forward") is False else "")
        + (f", router tuned for {config['tune_router_epochs']} epoch(s)"
           if config.get("tune_router_epochs") else "")
    )
    clients = client_setup(config)
    if clients:
        out.append("clients: " + ", ".join(clients))
    return out


def client_setup(config: dict) -> list[str]:
    """The client-side settings of a stored simulation that differ from the defaults, in words
    (what each client left out, cut or withheld, and the adversaries among them): two runs
    that differ only there look alike otherwise. A setting a document does not name ran at its
    default."""
    default = SimulationConfig()

    def get(name: str):
        return config.get(name, getattr(default, name))

    out = []
    since = get("since_confidence")
    if since != default.since_confidence:
        out.append("the pulled router's rule off" if since > 1 else f"the pulled router's rule at {since:g}")
    if get("max_bytes"):
        out.append(f"at most {get('max_bytes'):,} canonical bytes each")
    if get("max_words"):
        out.append(f"each request as its first {get('max_words')} words")
    if get("min_users") > 1:
        out.append(f"k-anonymous release K = {get('min_users')}")
    if get("pool_users") > 1:
        out.append(f"pooled release of {get('pool_users')} users")
    if get("shared_word_users") != default.shared_word_users:
        shared = get("shared_word_users")
        out.append("shared words off" if not shared else f"shared words at {shared} users")
    if get("client_tau") is not None:
        out.append(f"collapse at τ = {get('client_tau')}")
    if get("adversarial_fraction"):
        out.append(f"{get('adversarial_fraction'):.0%} adversarial ({get('adversarial_mode')})")
    return out


def run_host(doc: dict) -> str:
    """Where a stored simulation ran, for the operator (the server's hardware is theirs to see):
    the same code gives slightly different int8 embeddings on other hosts, so runs compare best
    with equal fingerprints. For a document from before documents said where they ran, that it
    does not say (the operator would otherwise compare it as if it ran on this host)."""
    hosts = [h for h in (doc.get("hosts") or [doc.get("host")]) if h]
    described = dict.fromkeys(
        f"{h.get('cpu') or 'unknown CPU'} ({', '.join(h.get('isa') or []) or 'no ISA listed'})"
        + (f", embedding fingerprint {h['embedding_fingerprint']}"
           if h.get("embedding_fingerprint") else "")
        + (f", code {h['code'][:12]}{'+' if h['code'].endswith('+') else ''}"
           if h.get("code") else "")
        for h in hosts
    )
    if not described:
        return ("where it ran is not recorded (written before runs recorded their host): its "
                "embeddings may differ slightly from this host's")
    return "ran on " + "; ".join(described)


# A loader prefix before a model's name or path ("bf16:", "onnx-int8:"); not a URL's scheme.
_MODEL_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9.+-]+:)(?!//)")


def model_path(name: str) -> bool:
    """Whether a model named to a simulation (`--transfer-models`, `--embedding-model`, an LLM's
    model) is a path on the server rather than a name: absolute, under ~ or relative to a
    folder ("./", "../"), with backslashes, or of more than two parts (a hub name is
    "organization/model"), after any loader prefix."""
    bare = _MODEL_PREFIX.sub("", name, count=1)
    return (bare.startswith(("/", "~", "./", "../")) or "\\" in bare
            or bare.strip("/").count("/") > 1)


def shown_model(name: str | None, operator: bool) -> str | None:
    """A model's name as a viewer of a stored simulation may read it. A path on the server is
    the operator's, as the server's insides are on the routing playground
    (`routing.services.shown_fallback_reason`): anyone else reads its prefix and last part
    ("bf16:…/all-mpnet-base-v2"). An LLM named with its endpoint ("openai:MODEL@URL") is read
    without the endpoint's URL, its model by the same rule."""
    if not name or operator:
        return name
    if name.startswith("openai:") and "@" in name:
        model = name[len("openai:"):].rsplit("@", 1)[0]
        return "openai:" + shown_model(model, operator)
    if not model_path(name):
        return name
    prefix = _MODEL_PREFIX.match(name)
    last = name.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    return f"{prefix.group(1) if prefix else ''}…/{last}"


def _adversarial_table(rows: list[dict], clean: float | None) -> list[dict]:
    """The adversarial sweep's rows as an operator reads them: accuracy against the clean run's,
    submissions the implausible-source check dropped whole, the share of what the adversaries
    sent that carried another tool than their honest one, and the share of the attack's victim
    tools' test queries routed to its target."""
    out = []
    for row in sorted(rows, key=lambda r: (r.get("adversarial_mode", ""), r.get("robust_rule", ""),
                                          r.get("adversarial_fraction", 0))):
        sent = row.get("adversarial_scenarios") or 0
        out.append({
            **dict.fromkeys(("accuracy_sd", "adversarial_submissions", "honest_submissions")),
            **row,
            "of_clean": row["accuracy"] / clean if clean else None,
            "relabelled_share": (row.get("relabelled_adversarial_scenarios", 0) / sent) if sent else None,
            # only where the mode aims at the target: for the others it is an unrelated tool
            "to_target": _share(row) if row.get("adversarial_mode") in TARGETED_MODES else None,
        })
    return out


def _share(counts: dict) -> float | None:
    """The percentage of victim-tool test queries routed to the attack's target (None: not
    measured)."""
    victims = counts.get("victim_queries") or 0
    return 100 * counts.get("victims_routed_to_target", 0) / victims if victims else None


def _spreads(rows: list[dict]) -> list[float | None]:
    """Each row's accuracy sd over its seeds, the error bar `add_with_error_bars` draws: 0 where
    a row of several seeds stores none (a document from before sds were kept), None where one
    seed (or none) measured it: there is no spread to draw."""
    return [None if row.get("seeds", 2) < 2 else (row.get("accuracy_sd") or 0) for row in rows]


def method_colors(methods) -> dict[str, str]:
    """One colour per method, the same on every run's chart: the simulation's methods by their
    fixed place in METHODS, then any other (a run stored by another version) in the order given.
    Plotly's default cycle has 10 colours for the 11 methods: the last took SYNAPSE's."""
    others = [m for m in methods if m not in METHODS]
    place = {m: i for i, m in enumerate([*METHODS, *others])}
    palette = qualitative.Dark24
    return {m: palette[place[m] % len(palette)] for m in methods}


def accuracy_page(run_id=None, *, operator: bool = False) -> AccuracyPage:
    """Figures of the latest (or a chosen) SimulationRun: accuracy over rounds per method
    (methods without rounds as horizontal lines), per category, adversarial curves, the
    privacy–utility frontier and the transfer table (the final global under other models; a
    model's server path and an LLM's endpoint only for the `operator`: `shown_model`)."""
    from federation.models import SimulationRun

    runs = list(SimulationRun.objects.defer("document").order_by("-created_at")[:20])
    if run_id not in (None, ""):
        try:
            run = SimulationRun.objects.get(pk=int(run_id))
        except ValueError:
            raise BadRequest(f"run must be a simulation id, not {str(run_id)[:40]!r}") from None
    else:
        run = SimulationRun.objects.order_by("-created_at").first()
    if run is not None and run.pk not in {r.pk for r in runs}:
        runs.append(run)  # an older run chosen by ?run=: the picker names the run it shows
    page = AccuracyPage(run=run, runs=runs)
    if run is None:
        return page
    doc = run.document or {}
    page.setup = run_setup(doc)
    page.host = run_host(doc)
    page.summary = list(doc.get("summary") or [])
    page.per_category = [
        {"category": c, **v} for c, v in sorted((doc.get("per_category") or {}).items())
    ]
    page.adversarial = list(doc.get("adversarial") or [])
    last = max((r for r in page.summary if r.get("method") == "synapse" and r.get("round") is not None),
               key=lambda r: r["round"], default=None)
    # The run's own SYNAPSE accuracy at its last round; None where that round was not measured
    # (under drift, no held-out query of the categories in use: `summarize` stores null).
    final = last.get("accuracy_mean") if last else None
    # "× clean" against the run's own SYNAPSE only when that run had no adversaries; else none
    # (a ratio to a poisoned run would flatter the sweep).
    clean = last and not (doc.get("config") or {}).get("adversarial_fraction")
    page.adversarial_table = _adversarial_table(page.adversarial, final if clean else None)
    page.clean_to_target = _share(doc.get("targeting") or {}) if clean else None
    if any(r.get("adversarial_mode") in CAMOUFLAGED_MODES for r in page.adversarial):
        page.camouflage_share = (doc.get("config") or {}).get("camouflage_share")
    page.privacy_sweep = list(doc.get("privacy_sweep") or [])
    page.release_sweep = sorted(doc.get("release_sweep") or [], key=lambda r: r.get("min_users", 1))
    page.transfer = [
        {**row, "model": shown_model(row["model"], operator), "llm": shown_model(row["llm"], operator)}
        for row in summarize_transfer(list(doc.get("transfer") or []))
    ]
    page.tau_sweep = sorted(doc.get("tau_sweep") or [], key=lambda r: r.get("tau", 0))
    page.summarizer_sweep = list(doc.get("summarizer_sweep") or [])
    page.cadence = list(doc.get("cadence") or [])
    page.contradictions = sorted(doc.get("contradictions") or [],
                                 key=lambda r: (r.get("contradiction_fraction", 0), not r.get("conflict_log")))
    page.contradiction_table = _contradiction_table(page.contradictions)
    page.cadence_table = [_cadence_row(row) for row in page.cadence]
    page.drift_every = int((doc.get("config") or {}).get("drift_every") or 0)

    curves = go.Figure()
    by_method: dict[str, list[dict]] = defaultdict(list)
    for row in page.summary:
        by_method[row["method"]].append(row)
    all_rounds = sorted({r["round"] for r in page.summary if r["round"] is not None})
    colors = method_colors(by_method)
    # SYNAPSE drawn last, over the baselines that start where its first round does (the frozen
    # round-1 global), and listed first.
    for method, rows in sorted(by_method.items(), key=lambda item: item[0] == "synapse"):
        stepped = sorted((r for r in rows if r["round"] is not None), key=lambda r: r["round"])
        if stepped:
            add_with_error_bars(curves, go.Scatter(
                x=[r["round"] for r in stepped], y=[r["accuracy_mean"] for r in stepped],
                mode="lines+markers", name=method, legendrank=1 if method == "synapse" else 1000,
                line={"width": 3 if method == "synapse" else 2, "color": colors[method]},
            ), _spreads(stepped))
        for r in rows:
            if r["round"] is None and all_rounds:
                # markers too: a one-round run's line has no length
                curves.add_trace(go.Scatter(
                    x=[all_rounds[0], all_rounds[-1]], y=[r["accuracy_mean"]] * 2,
                    mode="lines+markers" if len(all_rounds) == 1 else "lines",
                    name=method, line={"dash": "dash", "color": colors[method]},
                ))
    if page.summary:
        styled(curves, title={"text": "Routing accuracy over rounds"},
               xaxis={"title": {"text": "round"}, "dtick": 1},
               yaxis={"title": {"text": "top-1 accuracy"}, "range": [0, 1]})
        page.charts["curves"] = render_figure(curves, div_id="accuracy-curves")
    if page.per_category:
        bars = go.Figure(go.Bar(x=[r["category"] for r in page.per_category],
                                y=[r["accuracy"] for r in page.per_category]))
        styled(bars, title={"text": "SYNAPSE accuracy per category (last round)"},
               yaxis={"title": {"text": "accuracy"}, "range": [0, 1]})
        page.charts["categories"] = render_figure(bars, div_id="accuracy-categories")
    if page.adversarial:
        adv = go.Figure()
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for row in page.adversarial:
            groups[(row.get("adversarial_mode", ""), row.get("robust_rule", "none"))].append(row)
        for (mode, rule), rows in sorted(groups.items()):
            rows = sorted(rows, key=lambda r: r.get("adversarial_fraction", 0))
            add_with_error_bars(adv, go.Scatter(
                x=[r.get("adversarial_fraction", 0) for r in rows], y=[r["accuracy"] for r in rows],
                mode="lines+markers", name=f"{mode} · {rule}"), _spreads(rows))
        styled(adv, title={"text": "Accuracy under adversarial clients"},
               xaxis={"title": {"text": "adversarial fraction"}},
               yaxis={"title": {"text": "accuracy"}, "range": [0, 1]})
        page.charts["adversarial"] = render_figure(adv, div_id="accuracy-adversarial")
    if page.privacy_sweep or page.release_sweep:
        frontier = go.Figure()
        by_lambda: dict = defaultdict(list)
        for row in page.privacy_sweep:
            by_lambda[row.get("mask_strength")].append(row)
        for lam, rows in sorted(by_lambda.items(), key=lambda kv: kv[0] or 0):
            rows = sorted(rows, key=lambda r: r.get("epsilon", 0))
            add_with_error_bars(frontier, go.Scatter(
                x=[r.get("membership_auroc") for r in rows], y=[r["accuracy"] for r in rows],
                text=[f"ε={r.get('epsilon')}" for r in rows], mode="lines+markers+text",
                textposition="top center", name=f"λ = {lam}", cliponaxis=False,
            ), _spreads(rows))
        if page.release_sweep:
            rows = page.release_sweep
            add_with_error_bars(frontier, go.Scatter(
                x=[r.get("membership_auroc") for r in rows], y=[r["accuracy"] for r in rows],
                text=[f"k={r.get('min_users')} · " + (
                          "nothing sent" if r.get("bytes_per_client_round", 0) is None
                          else f"{r.get('bytes_per_client_round', 0):,.0f} B") for r in rows],
                mode="lines+markers+text", textposition="bottom center",
                name="k-anonymous release", line={"dash": "dash"}, cliponaxis=False,
            ))
        accuracies = [r["accuracy"] for r in [*page.privacy_sweep, *page.release_sweep]]
        config = doc.get("config") or {}
        auroc = (doc.get("privacy") or {}).get("membership_auroc")
        # A sweep row is the run where it varies nothing the run did not set so: the ε × λ
        # sweep's at the run's (ε, λ), the release sweep's at the run's K.
        swept = {(r.get("epsilon"), r.get("mask_strength")) for r in page.privacy_sweep}
        own_k = config.get("min_users", SimulationConfig().min_users)
        is_swept = ((config.get("epsilon"), config.get("mask_strength")) in swept
                    or any(r.get("min_users", 1) == own_k for r in page.release_sweep))
        if final is not None and auroc is not None and not is_swept:
            # The run's own configuration, played on the same splits as its sweeps: where the
            # operating point sits among them.
            # Named in the legend and on hover, with no label beside it: one printed over the
            # swept points' own labels (the demo's star sits by its λ = 0 point).
            frontier.add_trace(go.Scatter(
                x=[auroc], y=[final], mode="markers",
                marker={"symbol": "star", "size": 14, "color": "#111"},
                name=f"this run's configuration (ε={config.get('epsilon')}, "
                     f"λ={config.get('mask_strength')})",
                cliponaxis=False,
            ))
            accuracies.append(final)
        frontier.add_vline(x=0.5, line={"dash": "dot", "color": "#888"},
                           annotation_text="chance (AUROC 0.5)")
        # At least 5 points of accuracy either side of the points: autorange would stretch a
        # spread of a tenth of a point (two runs within the noise) over the whole chart.
        y_range = [max(0.0, min(accuracies) - 0.05), min(1.0, max(accuracies) + 0.05)]
        sweeps = [name for name, rows in (("ε × λ", page.privacy_sweep),
                                          ("k-anonymous release", page.release_sweep)) if rows]
        styled(frontier, title={"text": f"Privacy–utility frontier ({', '.join(sweeps)})"},
               xaxis={"title": {"text": "membership attack AUROC (lower is more private)"}},
               yaxis={"title": {"text": "accuracy"}, "range": y_range})
        page.charts["frontier"] = render_figure(frontier, div_id="privacy-frontier")
    if page.cadence:
        page.charts["cadence"] = _cadence_figure(page.cadence, page.drift_every)
    if page.contradictions:
        conflicts = go.Figure()
        for log in (True, False):
            rows = [r for r in page.contradictions if bool(r.get("conflict_log", True)) == log]
            if rows:
                add_with_error_bars(conflicts, go.Scatter(
                    x=[r.get("contradiction_fraction", 0) for r in rows],
                    y=[r["accuracy"] for r in rows],
                    mode="lines+markers",
                    name="with the conflict log" if log else "without the conflict log",
                    line={"dash": "solid" if log else "dash"},
                ), _spreads(rows))
        styled(conflicts, title={"text": "Accuracy under contradictory scenarios"},
               xaxis={"title": {"text": "share of scenarios contradicted"}, "tickformat": ".0%"},
               yaxis={"title": {"text": "accuracy"}, "range": [0, 1]})
        page.charts["contradictions"] = render_figure(conflicts, div_id="accuracy-contradictions")
    if page.tau_sweep:
        tau = add_with_error_bars(go.Figure(), go.Scatter(
            x=[r.get("tau") for r in page.tau_sweep], y=[r["accuracy"] for r in page.tau_sweep],
            text=[f"{r.get('global_scenarios', 0):,.0f} scenarios · dedup {r.get('dedup_rate', 0):.0%}"
                  for r in page.tau_sweep],
            mode="lines+markers+text", textposition="bottom center", name="SYNAPSE",
            cliponaxis=False,  # a label at the top or bottom point stays whole
        ), _spreads(page.tau_sweep))
        styled(tau, title={"text": "Sensitivity to the cosine threshold τ (last round)"},
               xaxis={"title": {"text": "τ"}}, yaxis={"title": {"text": "accuracy"}})
        page.charts["tau"] = render_figure(tau, div_id="accuracy-tau")
    return page


def _contradiction_table(rows: list[dict]) -> list[dict]:
    """One line per contradicted share: the sweep's row with the conflict log (`with`) and the
    ablation's (`without`), and the accuracy the log keeps (`gain`, None when one side is missing)."""
    by_share: dict[float, dict] = {}
    for row in rows:
        line = by_share.setdefault(row.get("contradiction_fraction", 0), {"with": None, "without": None})
        line["with" if row.get("conflict_log", True) else "without"] = row
    table = []
    for share, line in sorted(by_share.items()):
        with_log, without = line["with"], line["without"]
        gain = (with_log["accuracy"] - without["accuracy"]) if with_log and without else None
        table.append({"share": share, "with": with_log, "without": without, "gain": gain})
    return table


def _round_accuracies(row: dict) -> list[tuple[int, float]]:
    """A sweep row's accuracy per round, the rounds measured only (None: under drift, a round
    whose categories in use had no held-out query)."""
    return sorted(
        (int(k.removeprefix("accuracy_round_")), v) for k, v in row.items()
        if k.startswith("accuracy_round_") and v is not None
    )


def _cadence_row(row: dict) -> dict:
    """A cadence's figures over the rounds: the last round's accuracy, the worst round and the
    mean over the rounds (what the operators' users got on average under drift)."""
    points = _round_accuracies(row)
    worst = min(points, key=lambda p: p[1]) if points else (None, None)
    return {
        "aggregate_every": row.get("aggregate_every", 1),
        "seeds": row.get("seeds"),
        "accuracy": row.get("accuracy"),
        "worst_round": worst[0],
        "worst_accuracy": worst[1],
        "mean_accuracy": sum(v for _, v in points) / len(points) if points else None,
        "bytes_per_client_round": row.get("bytes_per_client_round"),
        "global_scenarios": row.get("global_scenarios"),
    }


def _cadence_figure(rows: list[dict], drift: int) -> SafeString:
    """Accuracy per round under each aggregation cadence, drift events as dotted lines."""
    figure = go.Figure()
    last = 0
    for row in rows:
        points = _round_accuracies(row)
        last = max([last, *(r for r, _ in points)])
        every = row.get("aggregate_every", 1)
        figure.add_trace(go.Scatter(
            x=[r for r, _ in points], y=[v for _, v in points], mode="lines+markers",
            name="frozen after round 1" if every == 0 else f"aggregate every {every}",
        ))
    for event in range(1 + drift, last + 1, drift) if drift > 0 else ():
        figure.add_vline(x=event, line={"dash": "dot", "color": "#888"},
                         annotation_text="new categories", annotation_position="top left")
    styled(figure, title={"text": "Accuracy over rounds by aggregation cadence"},
           xaxis={"title": {"text": "round"}, "dtick": 1, "range": [0.5, last + 0.5]},
           yaxis={"title": {"text": "top-1 accuracy"}, "range": [0, 1]})
    return render_figure(figure, div_id="accuracy-cadence")


def next_round_config(epsilon: float | None = None):
    """The configuration of the next round as the dashboard proposes it: the last round's, with
    `epsilon` when given."""
    from federation.round_config import RoundConfig

    latest = Round.objects.order_by("-number").first()
    config = dict(latest.config) if latest else {}
    if epsilon is not None:
        config["epsilon"] = epsilon
    return RoundConfig.from_stored(config)


def budget_warning(config, check=None) -> str:
    """The one budget message, from the one accountant: the refusal `services.open_round` would
    raise for a round with `config` (empty when it would be accepted for the budget). `check`:
    `accounting.check_budget(config)` when already made."""
    from federation import accounting

    check = check or accounting.check_budget(config)
    refusal = check.refusal(f"opening a round at ε = {config.epsilon:g}")
    return f"This will be refused: {refusal}." if refusal else ""


FIELD_CAP_HELP = (
    "Field cap F*: each user feeds at most F* tools' statistics (every numeric field of each), so "
    "the edges split ε over the statistics one user can move, 2·F* tools' fields (a replaced "
    "user's and the replacement's), instead of over all T registry tools × F fields (on MetaTool "
    "without a cap: ε/796 each). Clients build with it: synapse-client participate takes the "
    "round's F*, the compendium records the cap it was built with, and the server refuses "
    "statistics whose compendium records a larger cap or none (that the client did clip so, "
    "no server can check). Empty: no cap."
)


ROBUST_RULE_HELP = (
    "Robust rule: f = ⌊share · n⌋ of a group's n inputs (a tool's batches across an edge's "
    "clients, or a scenario cluster's members) are assumed adversarial. Krum's guarantee needs "
    "n ≥ 2f + 3: with 4 clients per edge at a share of 0.25, f = 1 and n = 4 < 5, so Krum judges "
    "without it (the rule is applied all the same, and the organization page counts such groups). "
    "The trimmed mean needs only n > 2f, which every group meets."
)


def krum_premise_warning(config: RoundConfig) -> str:
    """Under Krum, the organizations whose approved clients, all reporting a tool, would make a
    group below Krum's premise n ≥ 2f + 3 at the configuration's share (a non-blocking note for
    the operator); "" under another rule or where none would. Smaller groups (a tool some
    clients report, a cluster) can fall below it too: the merge counts those."""
    if config.robust_rule != "krum":
        return ""
    try:
        fraction = float(config.trim_fraction)
    except (TypeError, ValueError):
        return ""
    counts = (Client.objects.filter(status=Client.Status.APPROVED).order_by()
              .values_list("organization__name").annotate(n=Count("id")))
    sizes = [(name, n, byzantine_count(n, fraction)) for name, n in counts]
    short = sorted((name, n, f) for name, n, f in sizes if n >= 3 and not krum_premise_met(n, f))
    if not short:
        return ""
    named = "; ".join(f"{name} (n = {n}, f = {f})" for name, n, f in short[:5])
    more = f" and {len(short) - 5} more" if len(short) > 5 else ""
    return (f"Krum at an f share of {fraction:g}: a tool every approved client of an edge reports "
            f"is judged below its premise n ≥ 2f + 3, where its guarantee does not hold, at "
            f"{named}{more}.")


def round_controls() -> dict:
    """The operator's round form: the open round, defaults (the last round's configuration),
    choices, and a warning when opening the next round with those defaults would be refused for
    the budget."""
    from typing import get_args

    from federation import accounting
    from federation.round_config import RobustRule, RoundConfig, Summarizer

    defaults = next_round_config()
    open_round = Round.objects.filter(state=Round.State.OPEN).first()
    check = accounting.check_budget(defaults)
    return {
        "open_round": open_round,
        "open_config": RoundConfig.from_stored(open_round.config) if open_round else None,
        # Past its deadline, an open round takes no submissions and waits for the next check.
        "deadline_passed": bool(
            open_round and open_round.closes_at and open_round.closes_at <= timezone.now()
        ),
        "round_defaults": defaults,
        "summarizers": get_args(Summarizer),
        "robust_rules": get_args(RobustRule),
        "global_metadata_choices": get_args(RoundConfig.model_fields["global_metadata"].annotation),
        "field_cap_help": FIELD_CAP_HELP,
        "robust_rule_help": ROBUST_RULE_HELP,
        # non-blocking: the form's defaults, and the open round, under Krum
        "krum_warning": krum_premise_warning(defaults),
        "open_krum_warning": krum_premise_warning(RoundConfig.from_stored(open_round.config))
        if open_round else "",
        "budget_warning": budget_warning(defaults, check),
        # Where the committed ε′ stands against the cap, and where the next round would take it.
        "budget": {
            "committed": check.before.epsilon,
            "cap": check.cap,
            "percent": f"{100 * check.before.epsilon / check.cap:.0f}",
            "epsilon": f"{defaults.epsilon:g}",
            "after": check.after.epsilon,
        },
    }


@dataclass
class RouterTuning:
    """What the routing playground says about the served global's router (federation.tuning)."""

    round_number: int | None
    epochs_setting: int
    record: object | None  # routing.models.TunedRouter of the served global, if any

    @property
    def unusable(self) -> bool:
        """The record is ready, but this process's router of the global could not use its
        folder (lost or damaged: `routing.services._tuned_parts`) and routes with the frozen
        model. Read when the page renders, after the page routed its query."""
        from routing.services import serves_tuned

        record = self.record
        if record is None or record.state != "ready":
            return False
        loaded = serves_tuned(record.version_id, record.directory)
        if loaded is None:  # not built here yet: whether its folder can be read at all
            from pathlib import Path

            from routing.finetune import ROUTER_STATE

            return not (Path(record.directory) / ROUTER_STATE).is_file()
        return not loaded


def router_tuning() -> RouterTuning:
    from federation.tuning import tune_epochs
    from routing.models import TunedRouter
    from routing.services import published_global_version

    version = published_global_version()
    record = TunedRouter.objects.filter(version=version).first() if version is not None else None
    return RouterTuning(version.round.number if version else None, tune_epochs(), record)


# --- routing API traffic (operator) --------------------------------------------------------------


@dataclass
class TrafficView:
    traffic: object  # routing.services.RoutingTraffic
    chart: SafeString | None


def routing_traffic_view(now=None) -> TrafficView:
    """The routing API's last day for the operator: latency per reranker, batch throughput, and
    p50/p95 per hour."""
    from routing.services import routing_traffic

    now = now or timezone.now()
    traffic = routing_traffic(now=now)
    chart = None
    if traffic.hourly:
        chart = render_figure(
            routing_latency_figure(traffic.hourly, now),
            div_id="routing-latency",
            label="Routing API single-query latency (p50, p95) and calls per hour, last 24 hours",
        )
    return TrafficView(traffic, chart)


HOUR_MS = 3_600_000


def routing_latency_figure(hourly: list[dict], now) -> go.Figure:
    """Single-query calls per hour as bars (the batch form is not in it), p50/p95 as lines, over the 24 whole hours up to the current one
    (a single busy hour would otherwise fill the axis down to milliseconds), in the server's
    time zone."""

    def local(when):  # plotly.js reads a date string without its UTC offset
        return timezone.localtime(when).replace(tzinfo=None)

    end = local(now).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    hours = [local(row["hour"]) + timedelta(minutes=30) for row in hourly]  # a bar over its hour
    fig = go.Figure()
    fig.add_trace(go.Bar(x=hours, y=[row["calls"] for row in hourly], name="single-query calls", yaxis="y2",
                         width=0.9 * HOUR_MS, marker={"color": "#9aa7ba"}, opacity=0.35))
    for key, name in (("p50_ms", "p50"), ("p95_ms", "p95")):
        fig.add_trace(go.Scatter(x=hours, y=[row[key] for row in hourly], name=f"{name} latency",
                                 mode="lines+markers"))
    return styled(
        fig,
        title={"text": "Routing API: single-query latency per hour"},
        xaxis={"title": {"text": f"hour ({timezone.get_current_timezone_name()})"}, "type": "date",
               "range": [end - timedelta(hours=24), end]},
        yaxis={"title": {"text": "latency (ms)"}, "rangemode": "tozero"},
        # whole calls (the automatic ticks put a small count's at 0.5, 1.5), from its own step
        yaxis2={**right_axis("single-query calls"),
                **count_axis("single-query calls", max((row["calls"] for row in hourly), default=0)),
                "tickmode": "linear"},
    )
