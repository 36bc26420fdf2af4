"""The data the dashboard pages show, scoped by the organizations a user may see.

Organization data (clients, their submissions) is always filtered by `organizations`, the queryset
from `federation.services.visible_organizations`. The global compendium is published to every
member of the federation, so any signed-in user may browse it; rounds whose global result is not
published yet are the operator's alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import plotly.graph_objects as go
from django.core.paginator import Page, Paginator
from django.db.models import Count, IntegerField, Min, OuterRef, Q, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Coalesce

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
from federation.dashboard.plots import render_figure, styled
from federation.models import Client, Round

KIND_CLIENT = CompendiumVersion.Kind.CLIENT
KIND_EDGE = CompendiumVersion.Kind.EDGE
KIND_GLOBAL = CompendiumVersion.Kind.GLOBAL

# --- federation overview -----------------------------------------------------------------------


@dataclass
class RoundRow:
    round: Round
    submissions: int = 0
    submitted_bytes: int = 0
    edges: int = 0
    global_version: CompendiumVersion | None = None


@dataclass
class ClientRow:
    client: Client
    rounds: int = 0
    last_round: int | None = None
    last_size_bytes: int | None = None
    last_gzip_bytes: int | None = None
    mean_size_bytes: float | None = None


@dataclass
class Overview:
    rounds: list[RoundRow]
    clients: list[ClientRow]
    state_counts: dict[str, int]
    bytes_chart: str = ""
    participation_chart: str = ""
    totals: dict[str, int] = field(default_factory=dict)


def federation_overview(
    organizations: QuerySet, *, include_unpublished: bool = False, max_rounds: int = 50
) -> Overview:
    """Rounds with state, participation and compendium sizes; per-client bytes over rounds.

    Participation and per-client figures count only clients of `organizations`; the global
    compendium of a round not yet published is shown only with `include_unpublished` (operator).
    The table holds the latest `max_rounds` rounds.
    """
    rounds = list(Round.objects.order_by("-number")[:max_rounds])
    round_ids = [r.pk for r in rounds]
    rows = {r.pk: RoundRow(round=r) for r in rounds}

    submissions = CompendiumVersion.objects.filter(
        kind=KIND_CLIENT, round_id__in=round_ids, client__organization__in=organizations
    )
    for item in (
        submissions.order_by()
        .values("round_id")
        .annotate(n=Count("id"), total=Sum("size_bytes"))
    ):
        rows[item["round_id"]].submissions = item["n"]
        rows[item["round_id"]].submitted_bytes = item["total"] or 0
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
    for version in global_results.defer("content"):
        rows[version.round_id].global_version = version

    points = list(
        submissions.order_by("round__number").values(
            "client_id", "round__number", "size_bytes", "gzip_bytes"
        )
    )
    clients = list(
        Client.objects.filter(organization__in=organizations).select_related("organization")
    )
    client_rows = {c.pk: ClientRow(client=c) for c in clients}
    per_client: dict[int, list[dict]] = defaultdict(list)
    for point in points:
        per_client[point["client_id"]].append(point)
    for client_id, series in per_client.items():
        row = client_rows[client_id]
        row.rounds = len(series)
        row.last_round = series[-1]["round__number"]
        row.last_size_bytes = series[-1]["size_bytes"]
        row.last_gzip_bytes = series[-1]["gzip_bytes"]
        row.mean_size_bytes = sum(p["size_bytes"] for p in series) / len(series)

    state_counts = dict(
        Round.objects.order_by().values_list("state").annotate(n=Count("id")).values_list("state", "n")
    )
    overview = Overview(
        rounds=list(rows.values()),
        clients=sorted(client_rows.values(), key=lambda r: str(r.client)),
        state_counts=state_counts,
        totals={
            "rounds": sum(state_counts.values()),
            "clients": len(clients),
            "approved_clients": sum(c.status == Client.Status.APPROVED for c in clients),
            "submissions": len(points),
        },
    )
    if points:
        overview.bytes_chart = render_figure(
            bytes_per_client_figure(client_rows, per_client),
            div_id="bytes-per-client",
            label="Canonical compendium bytes per client over rounds",
        )
    if any(row.submissions or row.global_version for row in overview.rounds):
        overview.participation_chart = render_figure(
            participation_figure(overview.rounds),
            div_id="participation",
            label="Submissions and global compendium size per round",
        )
    return overview


def bytes_per_client_figure(client_rows: dict[int, ClientRow], per_client: dict) -> go.Figure:
    fig = go.Figure()
    for client_id, series in sorted(per_client.items(), key=lambda kv: str(client_rows[kv[0]].client)):
        name = str(client_rows[client_id].client)
        fig.add_trace(
            go.Scatter(
                x=[p["round__number"] for p in series],
                y=[p["size_bytes"] / 1024 for p in series],
                customdata=[p["gzip_bytes"] / 1024 for p in series],
                mode="lines+markers",
                name=name,
                hovertemplate=(
                    f"{name}<br>round %{{x}}<br>%{{y:.1f}} kB canonical"
                    "<br>%{customdata:.1f} kB gzip<extra></extra>"
                ),
            )
        )
    return styled(
        fig,
        title={"text": "Bytes per client per round (canonical form)"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis={"title": {"text": "size (kB)"}, "rangemode": "tozero", "tickformat": ".3~f"},
    )


def participation_figure(rows: list[RoundRow]) -> go.Figure:
    ordered = sorted(rows, key=lambda r: r.round.number)
    numbers = [r.round.number for r in ordered]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(x=numbers, y=[r.submissions for r in ordered], name="client submissions", yaxis="y")
    )
    fig.add_trace(
        go.Scatter(
            x=numbers,
            y=[r.global_version.size_bytes / 1024 if r.global_version else None for r in ordered],
            name="global compendium (kB)",
            mode="lines+markers",
            yaxis="y2",
            connectgaps=False,
        )
    )
    return styled(
        fig,
        title={"text": "Participation and global compendium size"},
        xaxis={"title": {"text": "round"}, "dtick": 1},
        yaxis={"title": {"text": "submissions"}, "rangemode": "tozero"},
        yaxis2={
            "title": {"text": "global size (kB)"},
            "tickformat": ".3~f",
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
            "showgrid": False,
        },
    )


# --- compendium browser --------------------------------------------------------------------------


class BadRequest(ValueError):
    """A query parameter that cannot be understood; the message names it."""


def global_versions(user) -> QuerySet:
    """The global compendium versions `user` may browse, newest round first."""
    versions = CompendiumVersion.objects.filter(kind=KIND_GLOBAL).select_related("round")
    if not user.is_superuser:
        versions = versions.filter(round__state=Round.State.PUBLISHED)
    return versions.defer("content").order_by("-round__number")


def choose_global_version(user, round_param: str | None) -> CompendiumVersion | None:
    """The version of `?round=N` (or the latest one when absent); None when there is none.

    Raises BadRequest for a malformed round and CompendiumVersion.DoesNotExist for a round without
    a global compendium this user may see.
    """
    versions = global_versions(user)
    if round_param in (None, ""):
        return versions.first()
    try:
        number = int(round_param)
    except ValueError:
        raise BadRequest(f"round must be a round number, not {round_param[:40]!r}") from None
    return versions.get(round__number=number)


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
    return tools.order_by("tool_id")


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


def compendium_page(
    version: CompendiumVersion,
    visible: QuerySet,
    *,
    query: str = "",
    page: str | int | None = 1,
    per_page: int = 20,
) -> tuple[Page, list[ToolCard]]:
    """One page of tools of `version` with their scenarios, precautions, templates, noisy
    statistics and annex triples, each text with the round it first appeared in."""
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
    for s in StatEntry.objects.filter(version=version, tool_id__in=tool_ids).order_by("field"):
        spec = fields.get(s.field)
        cards[s.tool_id].stats.append(
            {
                "field": s.field,
                "value": s.value,
                "unit": spec.unit if spec else "",
                "description": spec.description if spec else "",
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
    ).order_by("tool_id")
    return Paginator(tools, per_page).get_page(page)


def tool_categories() -> list[str]:
    return list(
        Tool.objects.exclude(category="").order_by("category").values_list("category", flat=True).distinct()
    )
