"""`Authorization: Bearer <token>` (or `Token <token>`) for routing tokens."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header

from routing.models import RoutingToken


class RoutingPrincipal:
    """The caller behind a routing token: authenticated, not a Django user."""

    is_authenticated = True
    is_anonymous = False
    is_staff = False

    def __init__(self, token: RoutingToken):
        self.token = token
        self.pk = None
        self.username = f"routing-token:{token.name}"

    def __str__(self) -> str:
        return self.username


class RoutingTokenAuthentication(BaseAuthentication):
    """Accepts a live routing token; any other bearer token is left to the next authenticator
    (e.g. client tokens), so an unknown or revoked token ends in 401."""

    keywords = (b"bearer", b"token")

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() not in self.keywords:
            return None
        try:
            raw = parts[1].decode("ascii")
        except UnicodeDecodeError:
            return None
        token = RoutingToken.live(raw)
        if token is None:
            return None
        return RoutingPrincipal(token), token

    def authenticate_header(self, request):
        return 'Bearer realm="api"'
