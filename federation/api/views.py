"""REST API of the federation (thin: the services decide and check)."""

from __future__ import annotations

from django.db import transaction
from django.http import FileResponse, HttpResponse
from django.shortcuts import get_object_or_404
from django.utils.decorators import method_decorator
from django.views.decorators.gzip import gzip_page
from django.views.decorators.vary import vary_on_headers
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from pydantic import ValidationError as PydanticValidationError
from rest_framework import exceptions, generics, status
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from compendium.models import CompendiumVersion
from federation import people, services, submissions
from federation.api.authentication import (
    ANY_AUTH,
    CLIENT_AUTH,
    PEOPLE_AUTH,
    ClientPrincipal,
    PersonSessionRecognition,
    UserTokenAuthentication,
)
from federation.api.serializers import (
    AddPersonSerializer,
    AuditLogSerializer,
    ChangePersonSerializer,
    ClientSerializer,
    CompendiumBodySerializer,
    DeadlineSerializer,
    DetailSerializer,
    EnrollSerializer,
    FailRoundSerializer,
    FederationSettingsSerializer,
    GlobalCompendiumSerializer,
    InvalidSubmissionSerializer,
    IssuedPasswordSerializer,
    IssuedTokenSerializer,
    OpenRoundSerializer,
    OrganizationSerializer,
    OwnSubmissionSerializer,
    PersonSerializer,
    RenameOrganizationSerializer,
    RevokeSerializer,
    RoundSerializer,
    SubmissionResultSerializer,
)
from federation.errors import FederationError, InvalidRequest, NotAllowed
from federation.models import AuditLog, Client, Membership, Organization, Round, Submission

# A round number as a query parameter: 1, 2, ... (services.round_number refuses the rest).
ROUND_NUMBER = {"type": "integer", "minimum": 1, "maximum": services.MAX_ROUND_NUMBER}
ROUND_PARAMETER = OpenApiParameter("round", ROUND_NUMBER, description="round number")
DETAIL = OpenApiResponse(DetailSerializer)


# --- permissions and the common base ----------------------------------------------------------


class IsClient(BasePermission):
    message = "this endpoint is for clients: authenticate with the client's API token"

    def has_permission(self, request, view):
        return isinstance(request.user, ClientPrincipal)


class IsSubmittingClient(IsClient):
    """Submissions are a client's: a person's session or token cannot submit or list them."""

    def has_permission(self, request, view):
        if request.method == "GET":
            self.message = (
                "this lists the calling client's own submissions: authenticate with a client's "
                "API token (syn_c_…); people see submissions on the dashboard"
            )
        else:
            self.message = (
                "only clients may submit: authenticate with a client's API token (syn_c_…); a "
                "person's session or token cannot submit a compendium"
            )
        return super().has_permission(request, view)


class IsPerson(BasePermission):
    message = "this endpoint is for people (operator, organization admins and members)"

    def has_permission(self, request, view):
        user = request.user
        return bool(user and user.is_authenticated and not isinstance(user, ClientPrincipal))


class IsAuthenticatedAny(BasePermission):
    def has_permission(self, request, view):
        return bool(request.user and request.user.is_authenticated)


def client_ip(request) -> str | None:
    return services.client_ip(request)


def actor_for(request) -> services.Actor:
    return services.Actor.for_user(request.user, client_ip(request))


# A comment, not a docstring: a view without its own docstring would inherit it, and
# drf-spectacular would publish it as that operation's description.
class FederationView(APIView):
    # Maps the services' domain errors to responses: 400/403/404/409/411/413/415/422/429.

    # The query parameters a GET takes (besides ?format=): any other is refused, as a body's
    # unknown field is (_refuse_unknown_fields): a misspelt filter (?sinse=, ?organisation=)
    # would otherwise answer the whole list as if it had been filtered.
    query_parameters: tuple[str, ...] = ()

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if request.method in ("GET", "HEAD"):
            _refuse_unknown_query_parameters(request, self.query_parameters)

    def handle_exception(self, exc):
        if isinstance(exc, submissions.SubmissionInvalid):
            body = {"detail": exc.detail, "violations": [v.as_dict() for v in exc.violations]}
            if exc.code:
                body["code"] = exc.code
            return Response(body, status=400)
        if isinstance(exc, FederationError):
            body = {"detail": exc.detail}
            if exc.code:
                body["code"] = exc.code
            response = Response(body, status=exc.status_code)
            retry_after = getattr(exc, "retry_after", None)
            if retry_after is not None:
                response["Retry-After"] = str(retry_after)
            return response
        if isinstance(exc, PydanticValidationError):
            errors = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            return Response({"detail": f"invalid round configuration: {errors}"}, status=400)
        return super().handle_exception(exc)


class FederationGenericView(FederationView, generics.GenericAPIView):
    # The serializer of a method's request body where it is not the answer's (serializer_class):
    # the browsable API builds its forms from get_serializer_class(), and a form of the answer's
    # fields sent fields the request refuses (_refuse_unknown_fields). The OpenAPI document
    # takes each operation's request from its extend_schema.
    request_serializers: dict = {}

    def get_serializer_class(self):
        request = getattr(self, "request", None)
        method = request.method if request is not None else None
        return self.request_serializers.get(method) or super().get_serializer_class()


def _refuse_unknown_fields(data, refusal: str | None = None) -> None:
    """400 naming the body's fields that the (validated) serializer `data` does not have, or
    has read-only (an organization's `id` and `created_at`, the settings' `updated_at`: the
    server sets them): DRF drops both silently, and a misspelt field ("epsilom", "is_activ")
    would otherwise leave its default or the current value under a 2xx, as if the request had
    been applied, and a read-only one look stored. `refusal` opens the message for unknown
    fields; by default it says which fields the request takes."""
    # (The browsable API's HTML forms carry their CSRF token as a field.)
    sent = set(data.initial_data) - {"csrfmiddlewaretoken"}
    others = sorted(sent - set(data.fields))
    read_only = sorted(name for name in sent & set(data.fields) if data.fields[name].read_only)
    if not (others or read_only):
        return
    takes = ", ".join(name for name, field in data.fields.items() if not field.read_only)
    parts = []
    if others:
        shown = ", ".join(name[:40] for name in others[:20])
        more = f" and {len(others) - 20} more" if len(others) > 20 else ""
        parts.append(f"{refusal or f'this request takes {takes}; unknown field(s):'} {shown}{more}")
    if read_only:
        set_by_server = f"read-only field(s), set by the server: {', '.join(read_only)}"
        parts.append(set_by_server if others else f"this request takes {takes}; {set_by_server}")
    raise InvalidRequest("; ".join(parts))


def _validated(data, refusal: str | None = None) -> dict:
    """The validated fields of the bound serializer `data`: 400 on an invalid value, or on a
    field the request does not take (_refuse_unknown_fields, with `refusal`)."""
    data.is_valid(raise_exception=True)
    _refuse_unknown_fields(data, refusal)
    return data.validated_data


PAGINATION = ("limit", "offset")  # BoundedLimitOffsetPagination's


def _refuse_unknown_query_parameters(request, taken: tuple[str, ...]) -> None:
    """400 naming the query parameters of `request` outside `taken` (and DRF's ?format=)."""
    unknown = sorted(set(request.query_params) - set(taken) - {"format"})
    if unknown:
        raise InvalidRequest(
            f"unknown query parameter(s): {', '.join(unknown)[:200]}; this takes "
            f"{', '.join(taken) or 'none'}"
        )


def _choice(request, name: str, choices: list[str]) -> str | None:
    """The query parameter `name` of `request`, one of `choices` (400 naming them if not), or
    None when it is not given or empty."""
    value = request.query_params.get(name)
    if value and value not in choices:
        raise InvalidRequest(f"{name} must be one of {', '.join(choices)}")
    return value or None


# --- clients: submissions ---------------------------------------------------------------------


class AlwaysJSON(BaseContentNegotiation):
    """JSON whatever the request's Accept header or ?format= asks for (RFC 9110 12.5.1 lets a
    server disregard Accept). The submission endpoint reads its body raw (no parser), which DRF's
    browsable API cannot build its forms from: its HTML answer to a client was a 500, after the
    submission had been stored."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class RawJSONMetadata(SimpleMetadata):
    """OPTIONS of a view that reads its JSON body raw (no parser): it parses JSON all the same."""

    def determine_metadata(self, request, view):
        return {**super().determine_metadata(request, view), "parses": ["application/json"]}


@extend_schema(
    methods=["GET"],
    summary="The calling client's own submissions, newest first",
    parameters=[OpenApiParameter("round", ROUND_NUMBER, description="only those of round N")],
    auth=[{"clientToken": []}],
)
class SubmissionView(FederationGenericView):
    # People's tokens and sessions are recognized so that a person gets 403 (only clients
    # submit), not 401 (no credentials).
    authentication_classes = CLIENT_AUTH + [UserTokenAuthentication, PersonSessionRecognition]
    permission_classes = [IsSubmittingClient]
    query_parameters = ("round", *PAGINATION)
    parser_classes: list = []  # the body is read raw, after its declared length was checked
    renderer_classes = [JSONRenderer]  # a machine's endpoint: no browsable API (see AlwaysJSON)
    content_negotiation_class = AlwaysJSON
    metadata_class = RawJSONMetadata
    serializer_class = OwnSubmissionSerializer
    # OPTIONS describes a POST by the compendium a client sends, not by the list's rows.
    request_serializers = {"POST": CompendiumBodySerializer}

    def get_queryset(self):
        queryset = Submission.objects.filter(client=self.request.auth).select_related("round")
        number = services.round_number(self.request.query_params.get("round"))
        if number is not None:
            queryset = queryset.filter(round__number=number)
        return queryset.order_by("-created_at", "-id")

    @extend_schema(responses={200: OwnSubmissionSerializer(many=True)})
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(
        summary="Submit the client's compendium for the open round",
        description="The canonical JSON, plain, with `Content-Encoding: gzip`, or with "
        "`Content-Encoding: dcz` (RFC 9842: zstd against a dictionary named by its SHA-256 in the "
        "body's first 40 bytes; the dictionary is the canonical bytes of a published global "
        "compendium, or before any, the schema in force as canonical JSON). Held to the same size "
        "limit once decompressed. A dictionary the server does not hold is a 400 with "
        "`code: unknown_dictionary`; a compendium without entries one with `code: "
        "empty_compendium`; text that still holds what masking at the open round's λ removes "
        "from any text (names, numbers, identifiers, e-mails, URLs, phones) one with `code: "
        "unmasked_text` and a violation per text (nothing stored); numeric statistics for a "
        "round with a field cap F* from a compendium that records no `field_cap`, or a larger "
        "one, one with `code: field_cap_exceeded` naming both (nothing stored). A body sent "
        "chunked, without `Content-Length`, is a 411; one checked against a round that stopped taking "
        "submissions while another opened is a 409 with `code: round_changed` (build against "
        "the new round and submit again); one checked against a tool registry or numeric fields "
        "that changed meanwhile a 409 with `code: schema_changed`; one sent with `X-Synapse-Round: N` "
        "while another round is open a 409 with `code: round_changed`. Numeric statistics for a "
        "field the open round will not release (its `fields_not_released`), or that no round "
        "releases (a declared field of kind `other`), are a 400 with `code: "
        "fields_not_released` naming them (nothing stored). An Idempotency-Key whose submission "
        "a later one of the client replaced in the open round is not replayed: a 409 with `code: "
        "replaced` (nothing stored; a new key submits it again and puts it back in effect). The "
        "client's rate is checked before the body is inflated.",
        request={"application/json": OpenApiTypes.OBJECT},
        # Only a client's token submits; people's tokens and sessions are recognized to be refused.
        auth=[{"clientToken": []}],
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                # printable ASCII, not only spaces (submissions.check_key)
                {"type": "string", "minLength": 1, "maxLength": submissions.MAX_KEY_LENGTH,
                 "pattern": "^[ -~]*[!-~][ -~]*$"},
                OpenApiParameter.HEADER,
                required=True,
                description="1-200 printable ASCII characters (e.g. a UUID); a retry with the same "
                "key returns the same result",
            ),
            OpenApiParameter(
                "X-Synapse-Round",
                ROUND_NUMBER,
                OpenApiParameter.HEADER,
                required=False,
                description="the round the body was built and checked for: when another round is "
                "open the answer is a 409 with `code: round_changed` and nothing is stored",
            ),
        ],
        responses={
            201: SubmissionResultSerializer,
            400: InvalidSubmissionSerializer,
            401: DETAIL,
            403: DETAIL,
            409: DETAIL,
            411: DETAIL,
            413: DETAIL,
            415: DETAIL,
            422: DETAIL,
            429: DETAIL,
        },
    )
    def post(self, request):
        submissions.check_content_type(request.META.get("CONTENT_TYPE"))
        submissions.check_declared_length(
            request.META.get("CONTENT_LENGTH"), request.META.get("HTTP_TRANSFER_ENCODING")
        )
        limit = submissions.max_submission_bytes()
        body = request._request.read(limit + 1)
        if len(body) > limit:
            raise submissions.PayloadTooLarge(f"the body exceeds the limit of {limit} bytes")
        outcome = submissions.submit(
            request.auth,
            body,
            request.META.get("HTTP_IDEMPOTENCY_KEY"),
            content_encoding=request.META.get("HTTP_CONTENT_ENCODING"),
            expected_round=submissions.expected_round(request.META.get("HTTP_X_SYNAPSE_ROUND")),
            token_hash=request.user.token_hash,
        )
        response = Response(outcome.body, status=outcome.status_code)
        if outcome.replayed:
            response["Idempotent-Replayed"] = "true"
        return response


# --- everyone authenticated: rounds, schema, global compendium -------------------------------


@extend_schema(
    summary="Rounds with their state, configuration and submission figures, newest first",
    parameters=[
        OpenApiParameter("state", str, enum=Round.State.values, description="only rounds in this state")
    ],
)
class RoundListView(FederationView, generics.ListAPIView):
    """Rounds with their state, configuration and submission figures, newest first."""

    authentication_classes = ANY_AUTH
    permission_classes = [IsAuthenticatedAny]
    query_parameters = ("state", *PAGINATION)
    serializer_class = RoundSerializer

    def get_queryset(self):
        queryset = Round.objects.all()
        state = _choice(self.request, "state", Round.State.values)
        if state:
            queryset = queryset.filter(state=state)
        scope = services.figure_scope(self.request.user)
        return services.round_figures(queryset, scope).order_by("-number")


@extend_schema_view(
    get=extend_schema(summary="One round with its state, configuration and submission figures")
)
class RoundDetailView(FederationView, generics.RetrieveAPIView):
    """One round: its state, configuration and submission figures (scoped as the list is)."""

    authentication_classes = ANY_AUTH
    permission_classes = [IsAuthenticatedAny]
    serializer_class = RoundSerializer

    def get_queryset(self):
        return services.round_figures(Round.objects.all(), services.figure_scope(self.request.user))


# Public to every member of the federation, large (the global is ~150 KB of JSON, a quarter of
# that gzipped) and free of secrets: sent gzipped to callers that accept it. Every answer, a 304
# or a body too small to compress included, says it varies with Accept-Encoding, as a cache
# needs the 304 to say what the 200 said (RFC 9110, 15.4.5). Their ETags are weak: gzip_page
# weakens the ETag of a body it compresses, not of a 304, so a strong one had a gzip-accepting
# caller's 304 name another validator than its 200 (a cache matches the two by it, RFC 9111
# 4.3.4); a weak one is the same on every answer, gzipped or not.
GZIPPED = [gzip_page, vary_on_headers("Accept-Encoding")]


@method_decorator(GZIPPED, name="dispatch")
class SchemaView(FederationView):
    authentication_classes = ANY_AUTH
    permission_classes = [IsAuthenticatedAny]

    @extend_schema(
        summary="The compendium schema S in force (tool registry, numeric fields, limits)",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request):
        return Response(submissions.schema_in_force().model_dump(mode="json"))


@method_decorator(GZIPPED, name="dispatch")
class ProbeSetView(FederationView):
    authentication_classes = ANY_AUTH
    permission_classes = [IsAuthenticatedAny]

    @extend_schema(
        summary="The public probe set's requests (for dcz before any global is published)",
        description=(
            "The requests of the public probe set the edges use (labelled benchmark queries, "
            "never client data), in the order of the dcz dictionary a client uses before any "
            "global is published: these requests, then the schema (`synapse-client fetch-probe`, "
            "then `submit --schema schema.json --probe probe.json`), and `labels`, each request's "
            "tool (`build --probe` routes with them before any global), null where the registry "
            "does not offer it (deactivated or never imported): the request stays, so the "
            "dictionary does too. `tools`, the labels as clients before `labels` read them, is "
            "served only when no label is null. `sha256` names the requests (the dictionary); "
            "the ETag names requests and labels; If-None-Match gives 304."
        ),
        responses={200: OpenApiTypes.OBJECT, 304: None},
    )
    def get(self, request):
        probe = submissions.probe_set()
        etag = f'W/"{submissions.probe_etag(probe)}"'  # weak: see GZIPPED
        if _etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response(probe, headers={"ETag": etag})


def _etag_matches(request, etag: str) -> bool:
    """Whether the request's If-None-Match names `etag` (weakly, or by `*`): the answer is a 304."""
    header = request.META.get("HTTP_IF_NONE_MATCH", "")
    if not header:
        return False
    if header.strip() == "*":
        return True
    etag = etag.removeprefix("W/")
    return any(candidate.strip().removeprefix("W/") == etag for candidate in header.split(","))


def _published_globals(request):
    """Published global versions, newest round first, narrowed to ?round=N when given."""
    versions = CompendiumVersion.objects.filter(
        kind=CompendiumVersion.Kind.GLOBAL, round__state=Round.State.PUBLISHED
    ).select_related("round")
    number = services.round_number(request.query_params.get("round"))
    if number is not None:
        versions = versions.filter(round__number=number)
    return versions.order_by("-round__number"), number


def _none_published(number: int | None) -> exceptions.NotFound:
    which = f"for round {number}" if number is not None else "yet"
    return exceptions.NotFound(f"no global compendium is published {which}")


class _PublishedGlobalView(FederationView):
    # Base of the views of a published global (the latest, or that of ?round=N), open to every
    # member of the federation. (A comment: as a docstring it would be each view's published
    # description.)

    authentication_classes = ANY_AUTH
    permission_classes = [IsAuthenticatedAny]
    query_parameters = ("round",)


@method_decorator(GZIPPED, name="dispatch")
class GlobalCompendiumView(_PublishedGlobalView):
    @extend_schema(
        summary="The latest published global compendium (or that of ?round=N)",
        parameters=[ROUND_PARAMETER],
        responses={200: GlobalCompendiumSerializer, 304: None, 400: DETAIL, 404: DETAIL},
    )
    def get(self, request):
        versions, number = _published_globals(request)
        etag_only = versions.values("sha256").first()
        if etag_only is None:
            raise _none_published(number)
        etag = f'W/"{etag_only["sha256"]}"'  # weak: see GZIPPED
        if _etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        # Read again for the body (a 304 loads no content): a publication or an erasure between
        # the two reads answers that version, under its own ETag.
        version = versions.defer("routing_head").first()
        if version is None:
            raise _none_published(number)
        etag = f'W/"{version.sha256}"'
        body = {
            "round": version.round.number,
            "sha256": version.sha256,
            "published_at": version.round.published_at,
            "compendium": version.content,
        }
        return Response(body, headers={"ETag": etag})


class GlobalRoutingHeadView(_PublishedGlobalView):
    @extend_schema(
        summary="The routing head published with the latest global compendium (or ?round=N)",
        description=(
            "The linear head the routing API uses with that global (fitted at publication on its "
            "scenarios, its tools' descriptions and the public probe set), as a NumPy .npz archive "
            "(arrays tools, weights, bias). `synapse-client pull` saves it beside the compendium "
            "so that `synapse-client route` ranks exactly as the server does. The ETag is the "
            "global's sha256 with the suffix -head."
        ),
        parameters=[ROUND_PARAMETER],
        responses={
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            304: None, 400: DETAIL, 404: DETAIL,
        },
    )
    def get(self, request):
        versions, number = _published_globals(request)
        row = versions.values("sha256", "routing_head").first()
        if row is None:
            raise _none_published(number)
        if row["routing_head"] is None:
            raise exceptions.NotFound(
                "this global compendium has no routing head (fewer than two tools have scenarios)"
            )
        etag = f'"{row["sha256"]}-head"'
        if _etag_matches(request, etag):
            return HttpResponse(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return HttpResponse(
            bytes(row["routing_head"]),
            content_type="application/octet-stream",
            headers={"ETag": etag},
        )


def _is_operator(request) -> bool:
    return IsOperator().has_permission(request, None)


def _served_global(request):
    versions, number = _published_globals(request)
    version = versions.defer("routing_head", "content").first()
    if version is None:
        raise _none_published(number)
    return version


class GlobalRouterView(_PublishedGlobalView):
    @extend_schema(
        summary="The manifest of the routing encoder tuned on the latest global (or ?round=N)",
        description=(
            "After a global is published the server fine-tunes the routing encoder on it "
            "(SYNAPSE_ROUTER_TUNE_EPOCHS) and routes with it once it is ready. This manifest "
            "lists the tuned router's files (relative path, size, sha256; about 90 MB with "
            "MiniLM), the digest of the compendium rows its vectors are aligned with "
            "(rows_sha256), the global's sha256, the round and the epochs; each file is at "
            "files/<path>. `synapse-client pull --router` downloads and verifies them, and "
            "`synapse-client route` then ranks exactly as the server does. 404 with a code "
            "saying why when there is none: router_off (tuning off), router_tuning (queued or "
            "running), router_failed, router_retired (a newer global is served)."
        ),
        parameters=[ROUND_PARAMETER],
        responses={200: OpenApiTypes.OBJECT, 304: None, 400: DETAIL, 404: DETAIL},
    )
    def get(self, request):
        from federation.tuning import router_manifest

        etag, body = router_manifest(_served_global(request), _is_operator(request))
        if _etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response(body, headers={"ETag": etag})


class GlobalRouterFileView(_PublishedGlobalView):
    @extend_schema(
        summary="One file of the tuned router's manifest (latest global, or ?round=N)",
        description="Only the paths the manifest lists. The ETag is the file's sha256.",
        parameters=[ROUND_PARAMETER],
        responses={
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            304: None, 400: DETAIL, 404: DETAIL,
        },
    )
    def get(self, request, name: str):
        from federation.tuning import router_file

        handle, entry = router_file(_served_global(request), name, _is_operator(request))
        etag = f'"{entry["sha256"]}"'
        if _etag_matches(request, etag):
            handle.close()
            return HttpResponse(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        response = FileResponse(handle, content_type="application/octet-stream")  # closes it
        response["ETag"] = etag
        return response


# --- people: organization-scoped administration ----------------------------------------------


def _scoped(queryset, user, field: str = "organization_id"):
    visible = services.visible_organization_ids(user)
    return queryset if visible is None else queryset.filter(**{f"{field}__in": visible})


@extend_schema_view(get=extend_schema(summary="Organizations the caller may see"))
class OrganizationListView(FederationView, generics.ListCreateAPIView):
    """Organizations: the operator sees and creates all; others see their own."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    query_parameters = PAGINATION
    serializer_class = OrganizationSerializer

    def get_queryset(self):
        return _scoped(Organization.objects.all(), self.request.user, "id")

    @extend_schema(
        summary="Create an organization (operator)",
        responses={201: OrganizationSerializer, 403: DETAIL, 409: DETAIL},
    )
    def post(self, request, *args, **kwargs):
        actor = actor_for(request)
        # Who asks first: the body's check (a slug already taken) would otherwise tell anyone
        # signed in which organizations exist.
        services.require_operator(actor, "create organizations")
        given = _validated(OrganizationSerializer(data=request.data))
        org = services.create_organization(
            actor,
            given["name"],
            given.get("slug", ""),
            given.get("description", ""),
        )
        return Response(OrganizationSerializer(org).data, status=201)


class OrganizationDetailView(FederationGenericView):
    """One organization the caller may see (else 404); PATCH renames it (the operator)."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    serializer_class = OrganizationSerializer
    request_serializers = {"PATCH": RenameOrganizationSerializer}

    def visible_organization(self, pk) -> Organization:
        return get_object_or_404(_scoped(Organization.objects.all(), self.request.user, "id"), pk=pk)

    @extend_schema(
        summary="One organization the caller may see",
        responses={200: OrganizationSerializer, 404: DETAIL},
    )
    def get(self, request, pk):
        return Response(OrganizationSerializer(self.visible_organization(pk)).data)

    @extend_schema(
        request=RenameOrganizationSerializer,
        responses={200: OrganizationSerializer, 400: DETAIL, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Rename an organization (operator); its slug cannot change",
    )
    def patch(self, request, pk):
        organization = self.visible_organization(pk)
        given = _validated(RenameOrganizationSerializer(data=request.data),
                           "only an organization's name can be changed here, not")
        organization = services.rename_organization(
            actor_for(request),
            organization,
            given["name"],
            slug=given.get("slug"),
        )
        return Response(OrganizationSerializer(organization).data)


def _target_organization(request, slug: str | None) -> Organization:
    """The organization a person's POST acts on: the slug given (one they may see), else their
    own; the operator, a member of none, must name one."""
    if slug:
        organization = Organization.objects.filter(slug=slug).first()
        if organization is None or not services.can_view(actor_for(request), organization.pk):
            raise InvalidRequest(f"no organization {slug!r} that you may manage")
        return organization
    membership = services.membership_of(request.user)
    if membership is None:
        raise InvalidRequest("organization (slug) is required")
    return membership.organization


@extend_schema(
    methods=["GET"],
    summary="Clients of the organizations the caller may see",
    parameters=[
        OpenApiParameter("status", str, enum=Client.Status.values),
        OpenApiParameter("organization", str, description="organization slug (operator)"),
    ]
)
class ClientListView(FederationGenericView, generics.ListAPIView):
    """Clients of the organizations the caller may see; POST enrolls a new (pending) client."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    query_parameters = ("status", "organization", *PAGINATION)
    serializer_class = ClientSerializer
    request_serializers = {"POST": EnrollSerializer}

    def get_queryset(self):
        queryset = _scoped(
            Client.objects.select_related("organization", "token"), self.request.user
        )
        client_status = _choice(self.request, "status", Client.Status.values)
        if client_status:
            queryset = queryset.filter(status=client_status)
        params = self.request.query_params
        if params.get("organization"):
            queryset = queryset.filter(organization__slug=params["organization"])
        return queryset.order_by("organization__name", "name")

    @extend_schema(
        summary="Enroll a client (pending until approved)",
        request=EnrollSerializer,
        responses={201: ClientSerializer, 400: DETAIL, 403: DETAIL, 409: DETAIL, 429: DETAIL},
    )
    def post(self, request):
        given = _validated(EnrollSerializer(data=request.data))
        actor = actor_for(request)
        organization = _target_organization(request, given.get("organization"))
        client = services.enroll_client(
            actor,
            organization,
            given["name"],
            given["description"],
            given["contact"],
        )
        return Response(ClientSerializer(client).data, status=201)


@extend_schema_view(get=extend_schema(summary="One client the caller may see"))
class ClientDetailView(FederationGenericView, generics.RetrieveAPIView):
    """One client of an organization the caller may see (else 404)."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    serializer_class = ClientSerializer

    def get_queryset(self):
        return _scoped(Client.objects.select_related("organization", "token"), self.request.user)


class _ClientActionView(FederationGenericView):
    # Base of approve/rotate/revoke: the client must be visible to the caller (else 404). (A
    # comment: as a docstring it would be each action's published description.)

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    serializer_class = ClientSerializer

    def get_queryset(self):
        return _scoped(Client.objects.all(), self.request.user)

    def visible_client(self, pk) -> Client:
        return get_object_or_404(self.get_queryset(), pk=pk)


def _token_response(issued) -> Response:
    """A freshly issued client token, shown once: no cache may keep the answer."""
    return Response({"client": ClientSerializer(issued.client).data, "token": issued.token},
                    headers={"Cache-Control": "no-store"})


class ClientApproveView(_ClientActionView):
    @extend_schema(
        request=None,
        responses={200: IssuedTokenSerializer, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Approve a pending client; its API token is in the answer, once",
    )
    def post(self, request, pk):
        issued = services.approve_client(actor_for(request), self.visible_client(pk))
        return _token_response(issued)


class ClientRotateView(_ClientActionView):
    @extend_schema(
        request=None,
        responses={200: IssuedTokenSerializer, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Issue a new token; the previous one stops working at once",
    )
    def post(self, request, pk):
        issued = services.rotate_client_token(actor_for(request), self.visible_client(pk))
        return _token_response(issued)


class ClientRevokeView(_ClientActionView):
    request_serializers = {"POST": RevokeSerializer}

    @extend_schema(
        request=RevokeSerializer,
        responses={200: ClientSerializer, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Revoke a client; its token stops working at once",
    )
    def post(self, request, pk):
        given = _validated(RevokeSerializer(data=request.data))
        client = services.revoke_client(
            actor_for(request), self.visible_client(pk), given["reason"]
        )
        return Response(ClientSerializer(client).data)


@extend_schema(
    methods=["GET"],
    summary="People of the organizations the caller may see",
    parameters=[
        OpenApiParameter("organization", str, description="organization slug"),
        OpenApiParameter("role", str, enum=Membership.Role.values),
    ]
)
class PersonListView(FederationGenericView, generics.ListAPIView):
    """The people of the organizations the caller may see; POST adds a login (operator, or an
    admin of the organization) and answers its generated password once."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    query_parameters = ("organization", "role", *PAGINATION)
    serializer_class = PersonSerializer
    request_serializers = {"POST": AddPersonSerializer}

    def get_queryset(self):
        queryset = people.people(self.request.user)
        role = _choice(self.request, "role", Membership.Role.values)
        if role:
            queryset = queryset.filter(role=role)
        params = self.request.query_params
        if params.get("organization"):
            queryset = queryset.filter(organization__slug=params["organization"])
        return queryset

    @extend_schema(
        request=AddPersonSerializer,
        responses={201: IssuedPasswordSerializer, 400: DETAIL, 403: DETAIL, 409: DETAIL},
        summary="Add a person to an organization; the generated password is in the answer, once",
    )
    def post(self, request):
        given = _validated(AddPersonSerializer(data=request.data))
        organization = _target_organization(request, given.get("organization"))
        issued = people.add_person(
            actor_for(request),
            organization,
            given["username"],
            given["role"],
            given["email"],
        )
        return _password_response(issued, status=201)


def _password_response(issued, status: int = 200) -> Response:
    """A freshly issued password, shown once: no cache may keep the answer."""
    body = {"person": PersonSerializer(issued.membership).data, "password": issued.password,
            "tokens_revoked": issued.tokens_revoked}
    return Response(body, status=status, headers={"Cache-Control": "no-store"})


class _PersonView(FederationGenericView):
    """A person visible to the caller (else 404), addressed by the user's id."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    serializer_class = PersonSerializer

    def visible_person(self, pk) -> Membership:
        return get_object_or_404(people.people(self.request.user), user_id=pk)


class PersonDetailView(_PersonView):
    request_serializers = {"PATCH": ChangePersonSerializer}

    @extend_schema(
        summary="One person the caller may see", responses={200: PersonSerializer, 404: DETAIL}
    )
    def get(self, request, pk):
        return Response(
            PersonSerializer(self.visible_person(pk), context={"request": request}).data
        )

    @extend_schema(
        request=ChangePersonSerializer,
        responses={200: PersonSerializer, 400: DETAIL, 403: DETAIL, 404: DETAIL},
        summary="Change a person's role or deactivate / reactivate their login",
    )
    def patch(self, request, pk):
        membership = self.visible_person(pk)
        # partial: a form body (FormParser, MultiPartParser) without is_active is not an
        # unchecked box (DRF reads a missing boolean of a form as false): it changes only the
        # fields it sends, as a JSON body does.
        given = _validated(ChangePersonSerializer(data=request.data, partial=True))
        if not given:
            raise InvalidRequest("nothing to change: send role and/or is_active")
        actor = actor_for(request)
        with transaction.atomic():
            if "role" in given:
                people.set_role(actor, membership, given["role"])
            if "is_active" in given:
                people.set_active(actor, membership, given["is_active"])
        return Response(
            PersonSerializer(self.visible_person(pk), context={"request": request}).data
        )


class PersonResetPasswordView(_PersonView):
    @extend_schema(
        request=None,
        responses={200: IssuedPasswordSerializer, 403: DETAIL, 404: DETAIL},
        summary="Give a person a new password (the old one, their sessions and personal API "
        "tokens stop); shown once",
    )
    def post(self, request, pk):
        return _password_response(people.reset_password(actor_for(request), self.visible_person(pk)))


@extend_schema(
    summary="The audit log, newest first (the caller's organization; the operator: all)",
    parameters=[
        OpenApiParameter("action", str, enum=AuditLog.Action.values),
        OpenApiParameter("organization", str, description="organization slug"),
        OpenApiParameter("actor", str, description="username (or 'system', 'merge pipeline')"),
        OpenApiParameter("target_type", str, description="e.g. client, round, organization"),
        OpenApiParameter("target_id", str, description="the target's id, with target_type"),
        OpenApiParameter("round", int, description="entries about that round (their details' round)"),
        OpenApiParameter(
            "since", str,
            description="a date YYYY-MM-DD (from that day on, inclusive) or an ISO 8601 datetime "
            "(from that instant on)",
        ),
        OpenApiParameter(
            "until", str,
            description="a date YYYY-MM-DD (up to that day, inclusive) or an ISO 8601 datetime "
            "(before that instant)",
        ),
    ]
)
class AuditLogView(FederationView, generics.ListAPIView):
    """The audit log, newest first. Organization admins and members see their organization's
    entries; the operator sees everything (federation-wide entries have no organization)."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]
    query_parameters = (
        "action", "organization", "actor", "target_type", "target_id", "round", "since", "until",
        *PAGINATION,
    )
    serializer_class = AuditLogSerializer

    def get_queryset(self):
        queryset = _scoped(AuditLog.objects.select_related("organization"), self.request.user)
        return services.filtered_audit_log(queryset, self.request.query_params)


# --- operator: rounds and settings ------------------------------------------------------------


class IsOperator(BasePermission):
    message = "only the federation operator may do this"

    def has_permission(self, request, view):
        return bool(IsPerson().has_permission(request, view) and request.user.is_superuser)


class RoundOpenView(FederationView):
    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsOperator]

    @extend_schema(
        request=OpenRoundSerializer,
        responses={201: RoundSerializer, 400: DETAIL, 403: DETAIL, 409: DETAIL},
        summary="Open the next round with its configuration and optional deadline (operator)",
    )
    def post(self, request):
        # partial: a form body without carry_forward takes RoundConfig's default (true), as a
        # JSON body does, not the false DRF reads for a form's missing boolean.
        given = _validated(OpenRoundSerializer(data=request.data, partial=True),
                           "not a round configuration field the API sets:")
        config = dict(given)
        closes_at = config.pop("closes_at", None)
        rnd = services.open_round(actor_for(request), config, closes_at=closes_at)
        rnd = services.round_figures(Round.objects.filter(pk=rnd.pk)).get()
        return Response(RoundSerializer(rnd, context={"request": request}).data, status=201)


class _RoundActionView(FederationView):
    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsOperator]

    def respond(self, rnd: Round) -> Response:
        rnd = services.round_figures(Round.objects.filter(pk=rnd.pk)).get()
        return Response(RoundSerializer(rnd, context={"request": self.request}).data)


class RoundCloseView(_RoundActionView):
    @extend_schema(
        request=None,
        responses={200: RoundSerializer, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Close an open round (operator); the merge pipeline starts after commit",
    )
    def post(self, request, pk):
        return self.respond(services.close_round(actor_for(request), pk))


class RoundDeadlineView(_RoundActionView):
    @extend_schema(
        request=DeadlineSerializer,
        responses={200: RoundSerializer, 400: DETAIL, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Set, move or remove (null) the open round's deadline (operator)",
    )
    def post(self, request, pk):
        given = _validated(DeadlineSerializer(data=request.data))
        return self.respond(services.set_round_deadline(actor_for(request), pk, given["closes_at"]))


class RoundRetryView(_RoundActionView):
    @extend_schema(
        request=None,
        responses={200: RoundSerializer, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Retry a failed round (operator): failed -> closing, the pipeline starts again",
    )
    def post(self, request, pk):
        return self.respond(services.retry_round(actor_for(request), pk))


class RoundFailView(_RoundActionView):
    @extend_schema(
        request=FailRoundSerializer,
        responses={200: RoundSerializer, 400: DETAIL, 403: DETAIL, 404: DETAIL, 409: DETAIL},
        summary="Mark a closing or merging round failed, with a reason (operator)",
    )
    def post(self, request, pk):
        given = _validated(FailRoundSerializer(data=request.data))
        return self.respond(services.fail_round_by_hand(actor_for(request), pk, given["reason"]))


class SettingsView(FederationView):
    """The federation's policy: every person may read it, only the operator changes it."""

    authentication_classes = PEOPLE_AUTH
    permission_classes = [IsPerson]

    @extend_schema(
        summary="The federation's policy (budgets, limits, approval)",
        responses={200: FederationSettingsSerializer},
    )
    def get(self, request):
        return Response(FederationSettingsSerializer(services.get_settings()).data)

    @extend_schema(
        summary="Change the federation's policy (operator)",
        request=FederationSettingsSerializer,
        responses={200: FederationSettingsSerializer, 400: DETAIL, 403: DETAIL, 409: DETAIL},
    )
    def patch(self, request):
        if not request.user.is_superuser:
            raise NotAllowed("only the federation operator may change the federation's settings")
        given = _validated(FederationSettingsSerializer(services.get_settings(), data=request.data,
                                                        partial=True), "unknown settings:")
        if not given:  # as a person's PATCH: an empty body is a mistake, not a change of nothing
            raise InvalidRequest(
                f"nothing to change: send one or more of {', '.join(services.SETTINGS_FIELDS)}"
            )
        row = services.update_settings(actor_for(request), **given)
        return Response(FederationSettingsSerializer(row).data)




