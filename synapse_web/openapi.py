"""The OpenAPI document's error responses, completed for every operation.

Views document the errors particular to them (409 on a closed round, 413 on a large body);
the statuses any operation of this API can answer are added here, all with the one error body
(`Detail`, synapse_web.api_errors): 401 (no or unknown credentials) and 403 (known, but not
allowed) where the operation needs credentials, 400 where it reads query parameters or a body
(a malformed value, a NUL character), 415 where it reads a body (another media type), and 404
where its path names an object."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.views import SpectacularAPIView
from rest_framework.renderers import JSONRenderer

DETAIL_REF = {"$ref": "#/components/schemas/Detail"}

REASONS = {
    "400": "the request is malformed: `detail` names what is wrong",
    "401": "no credentials, or credentials the server does not know",
    "403": "the credentials are known but may not do this",
    "404": "no such object that the caller may see",
    "415": "a body in a media type the operation does not read (or a malformed multipart body)",
}


def _error(status: str) -> dict:
    return {"description": REASONS[status], "content": {"application/json": {"schema": DETAIL_REF}}}


def complete_error_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook (SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"])."""
    for path, item in result.get("paths", {}).items():
        for operation in item.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            wanted = []
            security = operation.get("security", result.get("security")) or []
            if security and {} not in security:  # {}: credentials optional
                wanted += ["401", "403"]
            if "requestBody" in operation or any(
                p.get("in") == "query" for p in operation.get("parameters", [])
            ):
                wanted.append("400")
            if "requestBody" in operation:
                wanted.append("415")
            if "{" in path:
                wanted.append("404")
            for status in wanted:
                operation["responses"].setdefault(status, _error(status))
    return result


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The security scheme of an authentication class that reads a bearer token: a subclass
    names the class (target_class), the scheme (name) and the token (description)."""

    description = ""

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": self.description}


class SchemaView(SpectacularAPIView):
    """/api/schema/: the OpenAPI document (YAML, or JSON by `?format=json` or Accept), and its
    refusals (405, 400 on an unknown `format`, 406) in the API's one JSON error body, not dumped
    through the document's YAML renderer."""

    def finalize_response(self, request, response, *args, **kwargs):
        if getattr(response, "exception", False):
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)
