"""Organization scoping for dashboard pages.

Every page asks `federation.services.visible_organizations(user)` which organizations the user may
see, and filters organization data (clients, submissions, edge results) by it. Pages go through
`DashboardView` (class-based) or `organization_scoped` (function views); both require a login.
"""

from __future__ import annotations

from functools import cached_property, wraps

from django.contrib.auth.decorators import login_required
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import get_object_or_404
from django.views.generic import TemplateView

from federation.services import visible_organizations


def organization_or_404(user, **lookup):
    """The organization matching `lookup` if `user` may see it; 404 otherwise (an organization the
    user may not see is indistinguishable from one that does not exist)."""
    return get_object_or_404(visible_organizations(user), **lookup)


def organization_scoped(view_func):
    """Function-view decorator: login required, and `request.organizations` set to the
    organizations the user may see."""

    @login_required
    @wraps(view_func)
    def wrapper(request, *args, **kwargs):
        request.organizations = visible_organizations(request.user)
        return view_func(request, *args, **kwargs)

    return wrapper


class DashboardView(LoginRequiredMixin, TemplateView):
    """Base of the dashboard pages: login required, organizations resolved once per request,
    navigation key and operator flag in the context."""

    nav_key: str | None = None
    title: str = ""

    @cached_property
    def organizations(self):
        return visible_organizations(self.request.user)

    @property
    def is_operator(self) -> bool:
        return self.request.user.is_superuser

    def get_organization_or_404(self, **lookup):
        return get_object_or_404(self.organizations, **lookup)

    def base_query(self) -> str:
        """The current query string without `page`, ready to prefix `page=N` in page links."""
        params = self.request.GET.copy()
        params.pop("page", None)
        encoded = params.urlencode()
        return f"{encoded}&" if encoded else ""

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(
            nav_key=self.nav_key,
            page_title=self.title,
            organizations=self.organizations,
            is_operator=self.is_operator,
            base_query=self.base_query(),
        )
        return context
