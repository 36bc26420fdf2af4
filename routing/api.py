"""Routing API: thin views over routing.services."""

from __future__ import annotations

from django.conf import settings
from django.utils.module_loading import import_string
from rest_framework import status
from rest_framework.exceptions import ParseError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from routing import services


class _RoutingView(APIView):
    # Routing tokens, the federation's client and user tokens, and browser sessions: configured in
    # settings so that routing does not import the federation app.
    authentication_classes = [import_string(path) for path in settings.SYNAPSE_ROUTING_AUTHENTICATION]
    permission_classes = [IsAuthenticated]

    def _body(self, request) -> dict:
        try:
            data = request.data
        except ParseError as exc:
            raise services.RoutingInputError(f"the body is not valid JSON: {exc.detail}") from None
        if not isinstance(data, dict):
            raise services.RoutingInputError("the body must be a JSON object")
        return data

    def post(self, request):
        try:
            body = self._body(request)
            return Response(self.route(body))
        except services.RoutingInputError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except services.NothingPublished as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE)


class RouteView(_RoutingView):
    """POST {"query", "top_k"?, "reranker"?} -> the routing decision."""

    def route(self, body: dict) -> dict:
        if "query" not in body:
            raise services.RoutingInputError("query is required")
        return services.route_query(body["query"], body.get("top_k"), body.get("reranker"))


class RouteBatchView(_RoutingView):
    """POST {"queries": [...], "top_k"?, "reranker"?} -> {"results": [decision, ...], ...}."""

    def route(self, body: dict) -> dict:
        if "queries" not in body:
            raise services.RoutingInputError("queries is required")
        return services.route_queries(body["queries"], body.get("top_k"), body.get("reranker"))
