"""Content negotiation of the REST API: DRF's, but a `?format=` none of the view's renderers
answers is a 400 naming the formats it does, not DRF's bare 404 "Not found." (which read as if
the endpoint did not exist)."""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.negotiation import DefaultContentNegotiation


class UnknownFormat(exceptions.APIException):
    status_code = 400
    default_code = "unknown_format"


class NamedFormatNegotiation(DefaultContentNegotiation):
    def filter_renderers(self, renderers, format):
        chosen = [renderer for renderer in renderers if renderer.format == format]
        if not chosen:
            taken = ", ".join(dict.fromkeys(renderer.format for renderer in renderers))
            raise UnknownFormat(f"format must be one of {taken} (?format=), not {format[:40]!r}")
        return chosen
