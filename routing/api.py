"""Routing API: thin views over routing.services."""

from __future__ import annotations

from django.conf import settings
from django.utils.module_loading import import_string
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import ParseError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from routing import services
from synapse_web.openapi import BearerTokenScheme
from synapse_web.parsers import BoundedJSONParser


class _LengthRequired(Exception):
    """A body sent without its length (411)."""


class _RoutingView(APIView):
    # Routing tokens, the federation's client and user tokens, and browser sessions: configured in
    # settings so that routing does not import the federation app.
    authentication_classes = [import_string(path) for path in settings.SYNAPSE_ROUTING_AUTHENTICATION]
    permission_classes = [IsAuthenticated]
    # JSON only: a form's values are all strings (top_k=3 was refused as not an integer, a
    # form's list of queries read as its last one), yet the API document offered both forms.
    parser_classes = [BoundedJSONParser]
    fields: tuple[str, ...] = ()  # what the body may hold

    def _body(self, request) -> dict:
        if not request.META.get("CONTENT_LENGTH") and request.META.get("HTTP_TRANSFER_ENCODING"):
            # Django reads no further than the declared length: a chunked body reads as empty,
            # and was answered "query is required".
            raise _LengthRequired(
                "the routing API needs a Content-Length header, not Transfer-Encoding: "
                f"{request.META['HTTP_TRANSFER_ENCODING'][:40]}: send the body with its length"
            )
        try:
            data = request.data
        except ParseError as exc:
            raise services.RoutingInputError(f"the body is not valid JSON: {exc.detail}") from None
        if not isinstance(data, dict):
            raise services.RoutingInputError("the body must be a JSON object")
        # A misspelt option ("topk", "re_ranker") would otherwise be routed without, in silence.
        unknown = [str(name) for name in data if name not in self.fields]
        if unknown:
            shown = ", ".join(repr(name[:40]) for name in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise services.RoutingInputError(
                f"unknown field {shown}{more}: the body takes {', '.join(self.fields)}"
            )
        return data

    def post(self, request):
        # The operator reads why: a router could not be built, an LLM was not used (the server's
        # insides: a path, a host); every other caller what happened.
        operator = getattr(request.user, "is_superuser", False)
        try:
            body = self._body(request)
            return Response(self.route(body, services.caller_key(request.user), operator))
        except _LengthRequired as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_411_LENGTH_REQUIRED)
        except services.RoutingInputError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except services.RateLimited as exc:
            return Response(
                {"detail": str(exc)},
                status=status.HTTP_429_TOO_MANY_REQUESTS,
                headers={"Retry-After": str(exc.retry_after)},
            )
        except services.RoutingUnavailable as exc:
            detail = str(exc) if operator else getattr(exc, "public", str(exc))
            return Response({"detail": detail}, status=status.HTTP_503_SERVICE_UNAVAILABLE)


class RoutingTokenScheme(BearerTokenScheme):
    target_class = "routing.authentication.RoutingTokenAuthentication"
    name = "routingToken"
    description = "An application's routing token: `manage.py routing_token NAME`."


_CANDIDATE = inline_serializer(
    "RouteCandidate",
    {"tool": serializers.CharField(), "scenario": serializers.CharField(), "score": serializers.FloatField()},
)
_DECISION = inline_serializer(
    "RouteDecision",
    {
        "tool": serializers.CharField(
            allow_null=True,
            help_text="the tool to call: never one deactivated in the registry, nor are "
            "`candidates` and `ranking`",
        ),
        "confidence": serializers.FloatField(),
        "escalate": serializers.BooleanField(),
        "candidates": _CANDIDATE.__class__(many=True),
        "precautions": serializers.ListField(child=serializers.CharField()),
        "template": serializers.CharField(allow_null=True),
        "reranker": serializers.ChoiceField(
            choices=["fusion", "none", "llm"], allow_null=True,
            help_text="the reranker that decided; null when none did (the global has no scenario "
            "and no linear head: nothing to rank, tool null, fallback_reason \"no scenarios\"; "
            "or every tool it could name is deactivated: \"no active tools\")",
        ),
        "fallback_reason": serializers.CharField(
            allow_null=True,
            help_text="why another reranker decided than the one asked for (an LLM that did not "
            "answer), or \"no scenarios\" (\"no active tools\": every tool the global could name "
            "is deactivated) when none did, else null",
        ),
        "ranking": inline_serializer(
            "RouteRanking",
            {
                "tool": serializers.CharField(),
                "score": serializers.FloatField(),
                "best_cosine": serializers.FloatField(
                    allow_null=True, help_text="null when the tool has no scenario"
                ),
                "backed": serializers.BooleanField(help_text="the tool has a scenario"),
                "precaution_matched": serializers.BooleanField(),
                "head_probability": serializers.FloatField(
                    required=False, help_text="the linear head's probability, where there is one"
                ),
            },
            many=True,
        ),
        "compendium_round": serializers.IntegerField(),
        "tuned_router": serializers.BooleanField(
            help_text="routed with the encoder fine-tuned on this global (SYNAPSE_ROUTER_TUNE_EPOCHS)"
        ),
        "latency_ms": serializers.FloatField(),
    },
)
_ERROR = inline_serializer("RouteError", {"detail": serializers.CharField()})


def _query_field():
    """A query as the API document describes it, with this server's SYNAPSE_MAX_QUERY_CHARS."""
    return serializers.CharField(min_length=1, max_length=services.max_query_chars())



# null is taken as the default, as an absent field is (services.validate_top_k, validate_reranker).
_OPTIONS = {
    "top_k": serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=services.MAX_TOP_K,
        help_text="how many of the nearest scenarios `candidates` lists; absent or null: 5 (a whole "
        "number written as a float, 5.0, is taken as that integer)",
    ),
    "reranker": serializers.ChoiceField(
        choices=["fusion", "none", "llm"], required=False, allow_null=True,
        help_text="absent or null: the server's default (SYNAPSE_ROUTING_RERANKER)",
    ),
}


@extend_schema(
    request=inline_serializer(
        "RouteRequest", {"query": _query_field(), **_OPTIONS}
    ),
    responses={200: _DECISION, 400: _ERROR, 401: _ERROR, 411: _ERROR, 413: _ERROR, 415: _ERROR,
               429: _ERROR, 503: _ERROR},
    summary="Route one query: the tool to call, its calibrated confidence and why",
)
class RouteView(_RoutingView):
    """POST {"query", "top_k"?, "reranker"?} -> the routing decision."""

    fields = ("query", "top_k", "reranker")

    def route(self, body: dict, caller: str, operator: bool) -> dict:
        if "query" not in body:
            raise services.RoutingInputError("query is required")
        return services.route_query(
            body["query"], body.get("top_k"), body.get("reranker"), caller=caller, reveal=operator
        )


@extend_schema(
    request=inline_serializer(
        "RouteBatchRequest",
        {"queries": serializers.ListField(
            child=_query_field(), min_length=1, max_length=services.max_batch()  # SYNAPSE_MAX_ROUTE_BATCH
        ), **_OPTIONS},
    ),
    responses={
        200: inline_serializer(
            "RouteBatchResponse",
            {
                "compendium_round": serializers.IntegerField(),
                "tuned_router": serializers.BooleanField(),
                "latency_ms": serializers.FloatField(help_text="the whole batch"),
                "results": _DECISION.__class__(many=True),
            },
        ),
        400: _ERROR,
        401: _ERROR,
        411: _ERROR,  # chunked, without Content-Length
        413: _ERROR,  # a body past DATA_UPLOAD_MAX_MEMORY_SIZE (synapse_web.middleware)
        415: _ERROR,  # not application/json
        429: _ERROR,
        503: _ERROR,
    },
    summary="Route many queries in one request (at most SYNAPSE_MAX_ROUTE_BATCH, 1,000 by default)",
)
class RouteBatchView(_RoutingView):
    """POST {"queries": [...], "top_k"?, "reranker"?} -> {"results": [decision, ...], ...}."""

    fields = ("queries", "top_k", "reranker")

    def route(self, body: dict, caller: str, operator: bool) -> dict:
        if "queries" not in body:
            raise services.RoutingInputError("queries is required")
        return services.route_queries(
            body["queries"], body.get("top_k"), body.get("reranker"), caller=caller, reveal=operator
        )
