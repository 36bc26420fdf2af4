"""GET /metrics: the federation's state for Prometheus (federation.metrics), for the operator
(session or personal API token) or a scraper holding SYNAPSE_METRICS_TOKEN."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from drf_spectacular.utils import extend_schema
from prometheus_client import CONTENT_TYPE_LATEST
from rest_framework.authentication import BaseAuthentication
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.renderers import BaseRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from federation.api.authentication import PEOPLE_AUTH, bearer_token
from federation.api.views import IsOperator
from federation.metrics import exposition


class MetricsScraper(AnonymousUser):
    """request.user for the holder of the metrics token: may read /metrics, nothing else."""

    @property
    def is_authenticated(self) -> bool:  # type: ignore[override]
        return True

    def __str__(self) -> str:
        return "metrics scraper"


class MetricsTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <SYNAPSE_METRICS_TOKEN>`; any other token is left to the people's
    authenticators (an operator's personal token works too)."""

    def authenticate(self, request):
        expected = getattr(settings, "SYNAPSE_METRICS_TOKEN", "")
        token = bearer_token(request)
        if not expected or token is None:
            return None
        if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), expected.encode()):
            return None
        return MetricsScraper(), None

    def authenticate_header(self, request):
        return 'Bearer realm="synapse"'


class MayReadMetrics(BasePermission):
    message = "only the federation operator or the metrics token may read /metrics"

    def has_permission(self, request, view):
        return isinstance(request.user, MetricsScraper) or IsOperator().has_permission(
            request, view
        )


class PrometheusTextRenderer(BaseRenderer):
    """Prometheus' text exposition format; an error is its `detail` as one line of text."""

    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, bytes):
            return data
        if isinstance(data, dict) and "detail" in data:
            return f"{data['detail']}\n".encode()
        return str(data).encode()


class AlwaysText(BaseContentNegotiation):
    """Prometheus asks for OpenMetrics first and takes text/plain; every client gets the text."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class MetricsView(APIView):
    authentication_classes = [MetricsTokenAuthentication, *PEOPLE_AUTH]
    permission_classes = [MayReadMetrics]
    renderer_classes = [PrometheusTextRenderer]
    content_negotiation_class = AlwaysText

    @extend_schema(exclude=True)
    def get(self, request):
        response = Response(exposition(), content_type=CONTENT_TYPE_LATEST)
        response["Cache-Control"] = "no-store"
        return response
