"""Template context for every page: the navigation the current user may see."""

from __future__ import annotations

from federation.dashboard import nav


def navigation(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_items": []}
    match = getattr(request, "resolver_match", None)
    view_class = getattr(getattr(match, "func", None), "view_class", None)
    return {"nav_items": nav.items_for(user, active=getattr(view_class, "nav_key", None))}
