"""Navigation items of the dashboard, registered by the pages that exist.

A page registers itself beside its URL pattern (see `federation/dashboard/urls.py`):

    nav.register("privacy", "Privacy", "dashboard:privacy")

Only registered items whose URL resolves are shown, so a page that is not built yet never appears
as a dead link. Items are ordered by `NAV_ORDER`; unknown keys follow in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.urls import NoReverseMatch, get_resolver, reverse

# The dashboard's sections in the order users read them.
NAV_ORDER: tuple[str, ...] = (
    "overview",
    "organizations",
    "conflicts",
    "privacy",
    "accuracy",
    "compendium",
    "tools",
    "routing",
    "audit",
    "settings",
)


@dataclass(frozen=True)
class NavItem:
    key: str
    label: str
    url_name: str
    operator_only: bool = False


_registry: dict[str, NavItem] = {}


def register(key: str, label: str, url_name: str, *, operator_only: bool = False) -> NavItem:
    """Add (or replace) the navigation item `key`; returns it."""
    item = NavItem(key=key, label=label, url_name=url_name, operator_only=operator_only)
    _registry[key] = item
    return item


def unregister(key: str) -> None:
    _registry.pop(key, None)


def registered() -> list[NavItem]:
    known = {key: i for i, key in enumerate(NAV_ORDER)}
    order = list(_registry)
    return sorted(
        _registry.values(), key=lambda item: (known.get(item.key, len(known)), order.index(item.key))
    )


def items_for(user, active: str | None = None) -> list[dict]:
    """The navigation a user sees: label, url and whether it is the current page."""
    get_resolver().url_patterns  # noqa: B018 - importing the URLconf registers the pages
    items = []
    for item in registered():
        if item.operator_only and not getattr(user, "is_superuser", False):
            continue
        try:
            url = reverse(item.url_name)
        except NoReverseMatch:
            continue
        items.append({"key": item.key, "label": item.label, "url": url, "active": item.key == active})
    return items
