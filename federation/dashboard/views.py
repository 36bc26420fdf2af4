"""Dashboard pages. Thin: the data comes from `federation.dashboard.services`."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlsplit

from django.conf import settings as django_settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ObjectDoesNotExist
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Count, Q
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import Resolver404, resolve, reverse, reverse_lazy
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.http import url_has_allowed_host_and_scheme

from compendium.models import NumericField, Tool
from federation import people
from federation.auth import ThrottledPasswordChangeForm
from federation.conflicts import decide_conflict, read_pick, visible_conflicts
from federation.dashboard import services
from federation.dashboard.scoping import DashboardView
from federation.errors import FederationError, InvalidRequest, NotAllowed
from federation.models import (
    AuditLog,
    Client,
    ConflictDecision,
    FederationSettings,
    Membership,
    Round,
)
from federation.round_config import MIN_EPSILON, RoundConfig, config_problems
from federation.services import (
    DESCRIPTION_LIMIT,
    REASON_LIMIT,
    SETTINGS_FIELDS,
    TOKEN_LABEL_MAX,
    Actor,
    approve_client,
    audit_entry_for,
    client_ip,
    close_round,
    create_organization,
    enroll_client,
    fail_round_by_hand,
    free_text,
    get_settings,
    issue_user_token,
    open_round,
    pipeline_outcome,
    rename_organization,
    retry_round,
    revoke_client,
    revoke_user_token,
    rotate_client_token,
    set_round_deadline,
    update_settings,
    user_tokens,
)
from routing.services import (
    RateLimited,
    RoutingInputError,
    RoutingUnavailable,
    caller_key,
    route_query,
)


class OverviewView(DashboardView):
    template_name = "dashboard/overview.html"
    nav_key = "overview"
    title = "Federation overview"

    def get(self, request, *args, **kwargs):
        try:
            self.client_filters = services.client_filters(request.GET, self.organizations)
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["overview"] = overview = services.federation_overview(
            self.organizations, include_unpublished=self.is_operator, viewer=self.request.user,
            filters=self.client_filters, page=self.request.GET.get("page"),
        )
        context["page_obj"] = overview.client_page
        context["statuses"] = Client.Status.choices
        if self.is_operator:
            context.update(services.round_controls())
        return context


class CompendiumView(DashboardView):
    """The global compendium of the latest (or a chosen) round: tools and their entries, or the
    annex, searchable and paginated."""

    template_name = "dashboard/compendium.html"
    nav_key = "compendium"
    title = "Compendium browser"

    def get(self, request, *args, **kwargs):
        try:
            self.version = services.choose_global_version(request.user, request.GET.get("round"))
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        except ObjectDoesNotExist:
            number = services.round_number(request.GET.get("round"))
            return bad_request(
                request, f"no global compendium is published for round {number}", self.nav_key,
                status=404,
            )
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        params = self.request.GET
        query = params.get("q", "")[:200]
        tab = "annex" if params.get("view") == "annex" else "tools"
        context.update(
            version=self.version,
            versions=services.global_versions(self.request.user),
            query=query,
            tab=tab,
        )
        if self.version is None:
            return context
        context["merge_summaries"] = services.server_merge_summaries(
            self.version, operator=self.is_operator
        )
        if tab == "annex":
            context["page_obj"] = services.annex_page(
                self.version, query=query, page=params.get("page")
            )
        else:
            page_obj, cards = services.compendium_page(
                self.version,
                services.global_versions(self.request.user),
                query=query,
                page=params.get("page"),
                # An edge's noise scale tells its K: every edge's for the operator, otherwise
                # only the viewer's own organization's.
                release_organizations=None if self.is_operator else self.organizations,
            )
            context.update(page_obj=page_obj, cards=cards,
                           noise_dominated=any(c.noise_dominated for c in cards),
                           # greyed figures noised at an earlier round's ε, not this round's
                           noise_dominated_carried=sorted({
                               s["round"] for c in cards for s in c.stats
                               if s["noise_dominated"] and s["carried"]}),
                           round_config=RoundConfig.from_stored(self.version.round.config))
        return context


class ToolRegistryView(DashboardView):
    template_name = "dashboard/tools.html"
    nav_key = "tools"
    title = "Tool registry"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        params = self.request.GET
        query = params.get("q", "")[:200]
        category = params.get("category", "")[:200]
        latest = services.global_versions(self.request.user).first()
        context.update(
            query=query,
            category=category,
            categories=services.tool_categories(),
            latest=latest,
            total_tools=Tool.objects.count(),
            numeric_fields=NumericField.objects.all(),
            page_obj=services.tool_registry(
                query=query, category=category, latest=latest, page=params.get("page")
            ),
        )
        return context


# --- helpers for pages that act ------------------------------------------------------------------


# The heading of a refused request's page, by its status (a refusal that is no one's mistake, such
# as a round in the wrong state, is not a "bad request").
REFUSAL_TITLES = {
    400: "Bad request", 403: "Not allowed", 404: "Not found", 405: "Not possible here",
    409: "Not possible now", 429: "Too many requests",
}


def bad_request(
    request, message: str, nav_key: str | None = None, status: int = 400, back: str | None = None
):
    return render(
        request,
        "dashboard/bad_request.html",
        {"page_title": REFUSAL_TITLES.get(status, "Refused"), "message": message,
         "nav_key": nav_key, "status": status, "back": back or back_url(request)},
        status=status,
    )


def back_url(request) -> str:
    """Where a person goes back to from an error: the page the form was on (the Referer, when it
    is this site's), else this page without its parameters (a GET), else the overview."""
    referer = request.META.get("HTTP_REFERER", "")
    if referer and url_has_allowed_host_and_scheme(
        referer, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return _page_of(referer)
    return request.path if request.method == "GET" else reverse("dashboard:overview")


def _page_of(address: str) -> str:
    """`address`, or where a person reads what it showed when it answers POST only: a page shown
    as a POST's answer (an enrollment's token) has the action's address, and going back to it
    without JavaScript (which puts the page's own address in the history) was a 405."""
    try:
        match = resolve(urlsplit(address).path)
    except Resolver404:
        return address
    view_class = getattr(match.func, "view_class", None)
    if view_class is None or "get" in view_class.http_method_names:
        return address
    page_for = getattr(view_class, "page_for", None)
    return page_for(match.kwargs) if page_for else reverse("dashboard:overview")


def actor_for(request) -> Actor:
    return Actor.for_user(request.user, client_ip(request))


def posted_text(request, name: str, limit: int) -> str:
    """A form's text field, refused (400 naming it) when longer than `limit`: cut, it would store
    something other than what was given."""
    return free_text(name, request.POST.get(name, ""), limit)


class ActionView(DashboardView):
    """A POST-only page action (CSRF by the middleware): a federation error becomes its 4xx page."""

    http_method_names = ["post"]
    # page_for(kwargs): the page an action's forms are on, for `back_url` (default: the overview)

    def post(self, request, *args, **kwargs):
        try:
            return self.act(request, *args, **kwargs)
        except FederationError as error:
            return bad_request(request, str(error), self.nav_key, status=error.status_code)

    def handle_no_permission(self):
        """A form sent after the session ran out (or after signing out in another tab): the
        sign-in returns to the page the form was on (its Referer, when this site's, else the
        overview), not to the form's action, where a GET can only be refused; and it says that
        nothing was done, so the button is pressed again there."""
        request = self.request
        if request.user.is_authenticated or request.method in ("GET", "HEAD"):
            return super().handle_no_permission()
        messages.info(request, "You were signed out, so nothing was done: sign in, then send the "
                               "form again from its page.")
        back = urlsplit(back_url(request))
        return redirect_to_login(
            back.path + (f"?{back.query}" if back.query else ""),
            self.get_login_url(), self.get_redirect_field_name(),
        )

    def http_method_not_allowed(self, request, *args, **kwargs):
        """A form's action opened otherwise (a sign-in's ?next= after the session ran out, a
        bookmark): a page saying so, not a blank 405; back to the page it came from, if this
        site's, else the overview (never this address again)."""
        back = back_url(request)
        response = bad_request(
            request,
            f"{request.path} is a form's action: it takes a POST from its page's button, not a "
            f"{request.method}. Go back to the page and use the button there.",
            self.nav_key, status=405,
            back=reverse("dashboard:overview") if back == request.path else back,
        )
        response["Allow"] = ", ".join(self._allowed_methods())
        return response

    def act(self, request, *args, **kwargs):  # pragma: no cover - every subclass defines it
        raise NotImplementedError


# --- organizations -------------------------------------------------------------------------------


class OrganizationListView(ActionView):
    """The visible organizations; the operator creates one with a POST here."""

    http_method_names = ["get", "head", "post"]
    template_name = "dashboard/organizations.html"
    nav_key = "organizations"
    title = "Organizations"

    def act(self, request):
        organization = create_organization(
            actor_for(request),
            request.POST.get("name", ""),
            request.POST.get("slug", "").strip(),
            posted_text(request, "description", DESCRIPTION_LIMIT),
        )
        messages.success(
            request,
            f"Organization {organization.name} created. Add its first admin under People.",
        )
        return redirect("dashboard:organization", slug=organization.slug)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["rows"] = self.organizations.annotate(
            n_people=Count("memberships", distinct=True),
            n_clients=Count("clients", distinct=True),
            n_pending=Count("clients", filter=Q(clients__status="pending"), distinct=True),
            n_approved=Count("clients", filter=Q(clients__status="approved"), distinct=True),
            n_revoked=Count("clients", filter=Q(clients__status="revoked"), distinct=True),
        ).order_by("name")
        return context


class OrganizationView(DashboardView):
    template_name = "dashboard/organization.html"
    nav_key = "organizations"
    title = "Organization"

    @staticmethod
    def page_for(kwargs: dict) -> str:  # its actions' (rename, enroll, people, clients) page
        return reverse("dashboard:organization", args=[kwargs["slug"]])

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        organization = self.get_organization_or_404(slug=self.kwargs["slug"])
        context.update(
            organization=organization,
            page_title=organization.name,
            people=people.people(self.request.user, organization),
            roles=Membership.Role.choices,
            org=services.organization_page(organization, actor_for(self.request),
                                           page=self.request.GET.get("page")),
            allow_admin_approval=get_settings().allow_admin_approval,
        )
        return context


class OrganizationRenameView(ActionView, OrganizationView):
    """The operator renames the organization; its slug, and so this page's address, stay."""

    def act(self, request, slug):
        organization = self.get_organization_or_404(slug=slug)
        previous = organization.name
        organization = rename_organization(
            actor_for(request), organization, request.POST.get("name", ""),
            slug=request.POST.get("slug"),
        )
        if organization.name != previous:
            messages.success(request, f"Organization {previous} renamed to {organization.name}.")
        else:  # the page came back as it was, saying nothing: had the rename been lost?
            messages.info(request, f"Organization {previous} already has that name: nothing changed.")
        return redirect("dashboard:organization", slug=organization.slug)


class OrganizationActionView(ActionView, OrganizationView):
    """enroll / approve / rotate / revoke; a new token is shown once, in this response only."""

    def act(self, request, slug, action, client_id=None):
        organization = self.get_organization_or_404(slug=slug)
        actor = actor_for(request)
        token = None
        if action == "enroll" and client_id is not None:
            # clients/<id>/enroll/ would enroll a new client whatever <id> named: enrolling is
            # enroll/ alone
            raise Http404("unknown action")
        if action == "enroll":
            client = enroll_client(
                actor, organization, request.POST.get("name", ""),
                description=posted_text(request, "description", DESCRIPTION_LIMIT),
                contact=request.POST.get("contact", ""),
            )
            messages.success(request, f"Client {client.name} enrolled; it waits for approval.")
        else:
            client = get_object_or_404(Client, pk=client_id, organization=organization)
            if action == "approve":
                token = approve_client(actor, client).token
            elif action == "rotate":
                token = rotate_client_token(actor, client).token
            elif action == "revoke":
                revoke_client(actor, client, posted_text(request, "reason", REASON_LIMIT))
                messages.success(request, f"Client {client.name} revoked; its token stops working.")
            else:
                raise Http404("unknown action")
        if token is None:
            return redirect("dashboard:organization", slug=organization.slug)
        context = self.get_context_data(slug=slug)
        context.update(issued_token=token, issued_client=client, issued_action=action,
                       page_address=reverse("dashboard:organization", args=[organization.slug]))
        response = self.render_to_response(context)
        response["Cache-Control"] = "no-store"
        return response


class PersonActionView(ActionView, OrganizationView):
    """add / role / reset-password / deactivate / reactivate a person of the organization; a new
    password is shown once, in this response only."""

    def act(self, request, slug, action, user_id=None):
        organization = self.get_organization_or_404(slug=slug)
        actor = actor_for(request)
        if action == "add" and user_id is not None:
            # people/<id>/add/ would add a new login whatever <id> named: adding is people/add/
            raise Http404("unknown action")
        if action == "add":
            issued = people.add_person(
                actor,
                organization,
                request.POST.get("username", ""),
                request.POST.get("role", Membership.Role.MEMBER),
                request.POST.get("email", ""),
            )
        else:
            membership = get_object_or_404(
                people.people(request.user, organization), user_id=user_id
            )
            name = membership.user.get_username()
            if action == "role":
                membership = people.set_role(actor, membership, request.POST.get("role", ""))
                messages.success(request, f"{name} is now {membership.get_role_display()}.")
                issued = None
            elif action in ("deactivate", "reactivate"):
                people.set_active(actor, membership, action == "reactivate")
                messages.success(
                    request,
                    f"{name} reactivated." if action == "reactivate" else
                    f"{name} deactivated: their sign-in, sessions and personal API tokens stopped.",
                )
                issued = None
            elif action == "reset-password":
                issued = people.reset_password(actor, membership)
            else:
                raise Http404("unknown action")
        if issued is None:
            return redirect(reverse("dashboard:organization", args=[organization.slug]) + "#people")
        context = self.get_context_data(slug=slug)
        context.update(issued_password=issued.password, issued_person=issued.membership,
                       issued_action=action, issued_tokens_revoked=issued.tokens_revoked,
                       page_address=reverse("dashboard:organization", args=[organization.slug]))
        response = self.render_to_response(context)
        response["Cache-Control"] = "no-store"
        return response


# --- a person's own API tokens -------------------------------------------------------------------


class TokensView(ActionView):
    """The signed-in person's API tokens (for scripts against the REST API, with their own
    rights): issue one, shown once; revoke one, which stops at once."""

    http_method_names = ["get", "head", "post"]
    template_name = "dashboard/tokens.html"
    title = "API tokens"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(tokens=user_tokens(self.request.user),
                       label_max=TOKEN_LABEL_MAX)
        return context

    def act(self, request):
        actor = actor_for(request)
        action = request.POST.get("action", "")
        if action not in ("", "issue", "revoke"):
            # A mistyped revoke must not issue a token while the one meant to stop keeps working.
            raise InvalidRequest(
                f"action must be revoke (with token), or issue or none to issue a token, "
                f"not {action[:40]!r}"
            )
        if action == "revoke":
            raw = request.POST.get("token", "")
            if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
                raise InvalidRequest("token must name one of your tokens")
            row = revoke_user_token(actor, int(raw))
            messages.success(request, f"Token {row.prefix}… revoked: it has stopped working.")
            return redirect("dashboard:tokens")
        token = issue_user_token(actor, request.user, request.POST.get("label", ""))
        context = self.get_context_data()
        context.update(issued_token=token, page_address=reverse("dashboard:tokens"))
        response = self.render_to_response(context)
        response["Cache-Control"] = "no-store"
        return response


# --- federation settings -------------------------------------------------------------------------


SETTING_INPUTS = {
    "epsilon_budget": float,
    "delta_prime": float,
    "max_submission_bytes": int,
    "submissions_per_minute": int,
    "enrollments_per_hour": int,
}


class SettingsView(ActionView):
    """The federation's policy: every signed-in person reads it, the operator changes it here."""

    http_method_names = ["get", "head", "post"]
    template_name = "dashboard/settings.html"
    nav_key = "settings"
    title = "Federation settings"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        row = get_settings()
        context.update(
            settings_row=row,
            fields=[
                {"name": f, "value": getattr(row, f),
                 "help": FederationSettings._meta.get_field(f).help_text}
                for f in SETTINGS_FIELDS
            ],
            hard_cap=django_settings.SYNAPSE_MAX_SUBMISSION_BYTES,
        )
        return context

    def act(self, request):
        if not self.is_operator:
            raise NotAllowed("only the federation operator may change the federation's settings")
        changes = {}
        for name, kind in SETTING_INPUTS.items():
            raw = request.POST.get(name, "").strip()
            if not raw:
                raise InvalidRequest(f"{name} is required")
            try:
                changes[name] = kind(raw)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise InvalidRequest(f"{name} must be {what}, not {raw[:40]!r}") from None
        # The checkbox sends "on", or nothing when unchecked; any other value (a script's "true")
        # is refused rather than read as off.
        approval = request.POST.get("allow_admin_approval", "").strip()
        if approval not in ("", "on", "off"):
            raise InvalidRequest(
                f"allow_admin_approval must be on, off or absent (off), not {approval[:40]!r}"
            )
        changes["allow_admin_approval"] = approval == "on"
        before = get_settings()
        update_settings(actor_for(request), **changes)
        changed = [k for k, v in changes.items() if getattr(before, k) != v]
        messages.success(
            request,
            f"Settings saved: {', '.join(changed)} changed." if changed else "Nothing changed.",
        )
        return redirect("dashboard:settings")


class LogoutView(auth_views.LogoutView):
    """Sign-out is a POST (Django's CSRF-safe logout); a GET (a typed or bookmarked
    /accounts/logout/) shows a page with the button instead of a bare 405, or the login page to
    someone already signed out."""

    http_method_names = ["get", "post", "options"]

    def get(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect("login")
        return render(request, "registration/logout_confirm.html")


class PasswordChangeView(auth_views.PasswordChangeView):
    """A signed-in person changes their own password (the current one first); audited. Their
    other sessions end; this one stays signed in."""

    template_name = "registration/password_change_form.html"
    success_url = reverse_lazy("dashboard:overview")
    form_class = ThrottledPasswordChangeForm

    def get_form_kwargs(self):
        return {**super().get_form_kwargs(), "request": self.request}

    def form_valid(self, form):
        with transaction.atomic():  # the new password and its audit entry, or neither
            response = super().form_valid(form)
            revoked = people.password_changed(actor_for(self.request))
        if revoked:
            messages.success(
                self.request,
                f"Your password was changed, and your {revoked} API token(s) revoked: issue new "
                "ones under Account → API tokens.",
            )
        else:
            messages.success(self.request, "Your password was changed.")
        return response


# --- rounds (operator) ---------------------------------------------------------------------------


# The RoundConfig fields the "Open round" form sets, as the REST API does (conflict_log, the
# ablation switch, is left to the simulation). A blank input takes RoundConfig's default: no cap
# for field_cap and max_scenarios_per_tool.
ROUND_FIELDS = (
    "epsilon", "field_cap", "mask_strength", "tau", "summarizer", "textgrad_steps", "robust_rule",
    "trim_fraction", "seed", "max_scenarios_per_tool", "global_metadata", "carry_forward",
)

# The refusal names a bad field as RoundConfig (and the API) does, then as the form labels it.
ROUND_FIELD_LABELS = {
    "epsilon": "epsilon (ε)",
    "field_cap": "field_cap (field cap F*)",
    "mask_strength": "mask_strength (λ)",
    "tau": "tau (τ)",
    "textgrad_steps": "textgrad_steps (TextGrad steps)",
    "trim_fraction": "trim_fraction (f share)",
    "max_scenarios_per_tool": "max_scenarios_per_tool (scenarios per tool)",
    "global_metadata": "global_metadata (global M)",
    "carry_forward": "carry_forward (carry forward)",
}


def _deadline(raw: str):
    """A deadline from the dashboard's datetime-local input, read as UTC (the dashboard's times
    are UTC); empty: none."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        parsed = parse_datetime(raw)
    except ValueError:  # well formed, but no such time (2026-02-30, 25:00, an offset of +99:00)
        parsed = None
    if parsed is None:
        raise InvalidRequest(f"closes_at {raw[:40]!r} is not a date and time (YYYY-MM-DDTHH:MM, UTC)")
    return parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=dt.UTC)


class RoundActionView(ActionView):
    nav_key = "overview"

    def act(self, request, action, number=None):
        if not self.is_operator:
            raise NotAllowed(f"only the federation operator may {action} rounds")
        actor = actor_for(request)
        if action == "open" and number is not None:
            # rounds/<N>/open/ would open the next round whatever N named: opening is
            # rounds/open/ alone
            raise Http404("unknown action")
        if action == "open":
            raw = {k: request.POST[k].strip() for k in ROUND_FIELDS if request.POST.get(k, "").strip()}
            problems = config_problems(raw, ROUND_FIELD_LABELS)
            if problems:
                raise InvalidRequest(f"invalid round configuration: {problems}")
            config = RoundConfig(**raw)
            rnd = open_round(actor, config, closes_at=_deadline(request.POST.get("closes_at", "")))
            due = f"; it closes itself at {rnd.closes_at:%Y-%m-%d %H:%M} UTC" if rnd.closes_at else ""
            messages.success(request, f"Round {rnd.number} opened (ε = {config.epsilon:g}){due}.")
        else:
            rnd = get_object_or_404(Round, number=number)
            if action == "deadline":
                closes_at = _deadline(request.POST.get("closes_at", ""))
                current = rnd.closes_at
                if closes_at and current and closes_at == current.replace(second=0, microsecond=0):
                    closes_at = current  # the form shows minutes: saved as shown, unchanged
                rnd = set_round_deadline(actor, rnd, closes_at)
                messages.success(
                    request,
                    f"Round {rnd.number} closes itself at {rnd.closes_at:%Y-%m-%d %H:%M} UTC."
                    if rnd.closes_at else f"Round {rnd.number} has no deadline: close it by hand.",
                )
            elif action == "close":
                close_round(actor, rnd)
                messages.success(request, f"Round {rnd.number} closed; {pipeline_outcome(rnd)}.")
            elif action == "retry":
                retry_round(actor, rnd)
                messages.success(request, f"Round {rnd.number} retried; {pipeline_outcome(rnd)}.")
            elif action == "fail":
                rnd = fail_round_by_hand(actor, rnd, request.POST.get("reason", ""))
                messages.success(request, f"Round {rnd.number} failed: {rnd.failure_reason}.")
            else:
                raise Http404("unknown action")
        return redirect("dashboard:overview")


# --- audit log -----------------------------------------------------------------------------------


class AuditView(DashboardView):
    template_name = "dashboard/audit.html"
    nav_key = "audit"
    title = "Audit log"

    def get(self, request, *args, **kwargs):
        try:
            self.entries = services.audit_entries(
                self.organizations, operator=self.is_operator, filters=request.GET
            )
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        if request.GET.get("format") == "csv":
            response = StreamingHttpResponse(
                services.audit_csv_lines(self.entries, request.user),
                content_type="text/csv; charset=utf-8",
            )
            stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
            response["Content-Disposition"] = f'attachment; filename="synapse-audit-{stamp}.csv"'
            response["Cache-Control"] = "no-store"
            return response
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        csv_query = self.request.GET.copy()
        csv_query.pop("page", None)
        csv_query["format"] = "csv"
        page_obj = Paginator(self.entries, 50).get_page(self.request.GET.get("page"))
        for entry in page_obj:
            entry.shown_details, entry.shown_ip = audit_entry_for(self.request.user, entry)
        context.update(
            csv_query=csv_query.urlencode(),
            page_obj=page_obj,
            actions=AuditLog.Action.values,
            filters={k: self.request.GET.get(k, "")[:100]
                     for k in ("action", "organization", "actor", "since", "until",
                               "target_type", "target_id", "round")},
        )
        return context


# --- privacy -------------------------------------------------------------------------------------


class PrivacyView(DashboardView):
    template_name = "dashboard/privacy.html"
    nav_key = "privacy"
    title = "Privacy accounting"

    def get(self, request, *args, **kwargs):
        raw = request.GET.get("epsilon", "").strip()
        self.next_epsilon = None
        if raw:
            try:
                self.next_epsilon = float(raw)
            except ValueError:
                return bad_request(request, f"epsilon must be a number, not {raw[:40]!r}", self.nav_key)
            if not MIN_EPSILON <= self.next_epsilon < float("inf"):
                return bad_request(
                    request, f"epsilon must be a finite number of at least {MIN_EPSILON:g}",
                    self.nav_key,
                )
        try:
            self.ledger_round = services.round_number(request.GET.get("round"))
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        self.ledger_tool = request.GET.get("tool", "").strip()[:128]
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["privacy"] = services.privacy_page(
            self.organizations, operator=self.is_operator, page=self.request.GET.get("page"),
            next_epsilon=self.next_epsilon, ledger_round=self.ledger_round,
            ledger_tool=self.ledger_tool,
        )
        context["page_obj"] = context["privacy"].ledger
        context["checked"] = self.next_epsilon is not None  # the operator asked about an ε
        return context


# --- conflict review -----------------------------------------------------------------------------


class ConflictsView(DashboardView):
    template_name = "dashboard/conflicts.html"
    nav_key = "conflicts"
    title = "Conflict review"

    def get(self, request, *args, **kwargs):
        try:
            self.round_number = services.round_number(request.GET.get("round"))
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        organization_slug = self.request.GET.get("organization", "")[:100]
        page_obj, groups = services.conflict_groups(
            self.organizations, actor_for(self.request), round_number=self.round_number,
            organization_slug=organization_slug, page=self.request.GET.get("page"),
        )
        # A filter the page is under is said, with the way out of it: a decision returns to the
        # filtered page it was made on, which otherwise looked like the whole review.
        context.update(page_obj=page_obj, groups=groups, round_filter=self.round_number,
                       organization_filter=organization_slug)
        return context


class ConflictDecideView(ActionView):
    nav_key = "conflicts"

    @staticmethod
    def page_for(kwargs: dict) -> str:
        return reverse("dashboard:conflicts")

    def act(self, request, pk):
        actor = actor_for(request)
        conflict = get_object_or_404(
            visible_conflicts(self.organizations, actor).select_related("round", "organization"),
            pk=pk,
        )
        action = request.POST.get("action", "")
        text, tool = request.POST.get("text", ""), ""
        if action == ConflictDecision.Action.SCENARIO and "pick" in request.POST:
            tool, text = read_pick(request.POST["pick"])  # across tools: a text with its tool
        elif action == ConflictDecision.Action.SCENARIO:
            text, tool = request.POST.get("scenario", ""), request.POST.get("scenario_tool", "")
        # The forms carry the decision the page showed: one taken since refuses this one.
        decision = decide_conflict(actor, conflict, action, text, tool,
                                   seen=request.POST.get("seen"))
        where = f"merge of {conflict.organization}" if conflict.organization else "server merge"
        messages.success(
            request,
            f"Decision on {conflict.tool_id}/{conflict.centroid_id} of round {conflict.round.number}: "
            f"{decision.get_action_display()}. It applies in the next round's {where}.",
        )
        # Back to the page the form was on (its page and filters), at the conflict decided.
        page = reverse("dashboard:conflicts")
        back = back_url(request).split("#")[0]
        if urlsplit(back).path != page:
            back = page
        return redirect(f"{back}#conflict-{conflict.pk}")


# --- accuracy ------------------------------------------------------------------------------------


class AccuracyView(DashboardView):
    template_name = "dashboard/accuracy.html"
    nav_key = "accuracy"
    title = "Accuracy"

    def get(self, request, *args, **kwargs):
        try:
            self.accuracy = services.accuracy_page(request.GET.get("run"), operator=self.is_operator)
        except services.BadRequest as error:
            return bad_request(request, str(error), self.nav_key)
        except ObjectDoesNotExist:
            return bad_request(
                request, f"no simulation run {request.GET.get('run', '').strip()[:20]} is stored",
                self.nav_key, status=404,
            )
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["accuracy"] = self.accuracy
        return context


# --- routing playground --------------------------------------------------------------------------


class RoutingView(DashboardView):
    template_name = "dashboard/routing.html"
    nav_key = "routing"
    title = "Routing playground"

    def get(self, request, *args, **kwargs):
        query = request.GET.get("q", "")
        context = self.get_context_data(query=query[:2000], tuning=services.router_tuning())
        if self.is_operator:
            context["traffic"] = services.routing_traffic_view()
        if not query.strip():
            return self.render_to_response(context)
        try:
            raw_k = request.GET.get("top_k", "").strip() or "5"
            # ASCII digits only (str.isdigit takes "²"); validate_top_k bounds the value.
            if not (raw_k.isascii() and raw_k.isdigit()) or len(raw_k) > 4:
                raise RoutingInputError(
                    f"top_k must be a whole number between 1 and 50, not {raw_k[:20]!r}"
                )
            # counted against the person's allowance, which their API calls share
            result = route_query(query, top_k=int(raw_k),
                                 reranker=request.GET.get("reranker") or None, record=False,
                                 caller=caller_key(request.user),
                                 reveal=request.user.is_superuser)
            context["result"] = result
            # Whether the list of nearest scenarios shows why the tool was chosen.
            context["chosen_in_candidates"] = any(c["tool"] == result["tool"] for c in result["candidates"])
            context["chosen_ranking"] = next(
                (r for r in result["ranking"] if r["tool"] == result["tool"]), None
            )
        except RoutingInputError as error:
            context["error"] = str(error)
            return self.render_to_response(context, status=400)
        except RateLimited as error:
            context["error"] = str(error)
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(error.retry_after)
            return response
        except RoutingUnavailable as error:
            # why a router could not be built (an exception's text) is the operator's alone
            shown = str(error) if self.is_operator else getattr(error, "public", str(error))
            context["error"] = shown or "no global compendium is published yet"
            return self.render_to_response(context, status=503)
        return self.render_to_response(context)
