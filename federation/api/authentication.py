"""Authentication for the REST API: client tokens (machines) and user tokens (people), both sent
as `Authorization: Bearer <token>` (or `Token <token>`), and sessions for people in a browser."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, SessionAuthentication

from federation.services import (
    TOKEN_PREFIX_CLIENT,
    TOKEN_PREFIX_USER,
    TokenRejected,
    client_for_token,
    hash_token,
    user_for_token,
)
from synapse_web.openapi import BearerTokenScheme

SCHEMES = ("bearer", "token")


def bearer_token(request) -> str | None:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if not header:
        return None
    parts = header.split()  # Python's whitespace: also bytes like 0xA0 a server passes through
    if not parts or parts[0].lower() not in SCHEMES:
        return None
    if len(parts) != 2:
        raise exceptions.AuthenticationFailed("malformed Authorization header: use 'Bearer <token>'")
    return parts[1]


class ClientPrincipal(AnonymousUser):
    """request.user for a client machine: authenticated, but never a person or an operator."""

    def __init__(self, client, token_hash: str | None = None):
        super().__init__()
        self.client = client
        # The hash of the token that authenticated the request: a submission checks under the
        # client's lock that it is still the client's (not rotated away meanwhile).
        self.token_hash = token_hash

    @property
    def is_authenticated(self) -> bool:  # type: ignore[override]
        return True

    def __str__(self) -> str:
        return f"client {self.client}"


class Forbidden(exceptions.PermissionDenied):
    pass


class ClientTokenAuthentication(BaseAuthentication):
    """A client's API token. Unknown token: 401; revoked or unapproved client: 403."""

    def authenticate(self, request):
        token = bearer_token(request)
        if token is None or not token.startswith(TOKEN_PREFIX_CLIENT):
            return None
        try:
            client = client_for_token(token)
        except TokenRejected as exc:
            if exc.status_code == 403:
                raise Forbidden(exc.detail) from exc
            raise exceptions.AuthenticationFailed(exc.detail) from exc
        return ClientPrincipal(client, hash_token(token)), client

    def authenticate_header(self, request):
        return 'Bearer realm="synapse"'


class UserTokenAuthentication(BaseAuthentication):
    """A person's API token (operator, organization admin or member) for scripts."""

    def authenticate(self, request):
        token = bearer_token(request)
        if token is None or token.startswith(TOKEN_PREFIX_CLIENT):
            return None
        if not token.startswith(TOKEN_PREFIX_USER):
            from routing.models import RoutingToken

            if RoutingToken.live(token) is not None:
                # valid, yet "invalid token" sent its application looking for a typo
                raise Forbidden(
                    "this is a routing token: it may only route (POST /api/v1/route/ and "
                    "/api/v1/route/batch/); the rest of the API takes a client's or a person's token"
                )
            raise exceptions.AuthenticationFailed("invalid token")
        user = user_for_token(token)
        if user is None:
            raise exceptions.AuthenticationFailed("invalid token")
        return user, None

    def authenticate_header(self, request):
        return 'Bearer realm="synapse"'


class PersonSessionRecognition(SessionAuthentication):
    """A person's browser session, recognized without the CSRF check, only on an endpoint that
    refuses every person (the submission endpoint): so that a logged-in person gets 403 saying
    only clients may use it, not 401 "credentials were not provided" (nor a CSRF failure). Such
    an endpoint does nothing for a person, so there is nothing to forge."""

    def enforce_csrf(self, request):
        return None


class ClientTokenScheme(BearerTokenScheme):
    target_class = "federation.api.authentication.ClientTokenAuthentication"
    name = "clientToken"
    description = "A client's API token (syn_c_…), issued once on approval or rotation."


class UserTokenScheme(BearerTokenScheme):
    target_class = "federation.api.authentication.UserTokenAuthentication"
    name = "userToken"
    description = "A person's API token (syn_u_…): `manage.py issue_user_token USER`."


CLIENT_AUTH = [ClientTokenAuthentication]
# Client tokens are recognized on people's endpoints too, so that a client gets 403, not 401.
PEOPLE_AUTH = [ClientTokenAuthentication, UserTokenAuthentication, SessionAuthentication]
ANY_AUTH = [ClientTokenAuthentication, UserTokenAuthentication, SessionAuthentication]
