"""Dashboard pages. Thin: the data comes from `federation.dashboard.services`."""

from __future__ import annotations

from django.core.exceptions import ObjectDoesNotExist
from django.http import Http404
from django.shortcuts import render

from compendium.models import NumericField, Tool
from federation.dashboard import services
from federation.dashboard.scoping import DashboardView


class OverviewView(DashboardView):
    template_name = "dashboard/overview.html"
    nav_key = "overview"
    title = "Federation overview"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["overview"] = services.federation_overview(
            self.organizations, include_unpublished=self.is_operator
        )
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
            return render(
                request,
                "dashboard/bad_request.html",
                {"page_title": "Bad request", "message": str(error), "nav_key": self.nav_key},
                status=400,
            )
        except ObjectDoesNotExist:
            raise Http404("no global compendium for that round") from None
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
            )
            context.update(page_obj=page_obj, cards=cards)
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
