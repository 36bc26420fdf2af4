"""Request checks that hold for every page and endpoint."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import JsonResponse
from django.shortcuts import render
from django.views import defaults
from rest_framework.response import Response as DrfResponse

NUL = "\x00"
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
CHECKED_HEADERS = {"HTTP_IDEMPOTENCY_KEY": "the Idempotency-Key header"}


def nul_problem(request) -> str | None:
    """What in the request holds a NUL character (PostgreSQL text cannot store one), or None.

    Looks at the query string, the Idempotency-Key header and, outside the API, the values of a
    submitted form. The API's bodies are parsed by DRF, whose string fields refuse NUL already;
    its submission body is read raw and must stay unread here."""
    for key, values in request.GET.lists():
        if NUL in key or any(NUL in v for v in values):
            return f"query parameter {key.replace(NUL, '')[:40]!r} must not contain NUL characters"
    for meta, label in CHECKED_HEADERS.items():
        if NUL in request.META.get(meta, ""):
            return f"{label} must not contain NUL characters"
    if (
        request.method == "POST"
        and not request.path.startswith("/api/")
        and request.content_type in FORM_TYPES
    ):
        for key, values in request.POST.lists():
            if NUL in key or any(NUL in v for v in values):
                return f"form field {key.replace(NUL, '')[:40]!r} must not contain NUL characters"
    return None


class RejectNulMiddleware:
    """400 naming the parameter for any request value that contains a NUL character (instead of
    the database error it would cause wherever it reaches a query)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        problem = nul_problem(request)
        if problem is None:
            return self.get_response(request)
        if request.path.startswith("/api/"):
            return JsonResponse({"detail": problem}, status=400)
        return render(
            request,
            "dashboard/bad_request.html",
            {"page_title": "Bad request", "message": problem, "status": 400},
            status=400,
        )


API_PREFIX = "/api/"


def is_api(request) -> bool:
    return request.path.startswith(API_PREFIX)


def _shown_path(request) -> str:
    path = request.path
    return path if len(path) <= 200 else path[:200] + "…"


class ApiJsonNotFoundMiddleware:
    """Every 404 under /api/ answers JSON `{"detail": ...}`, as the API's other errors do.

    A path no URL pattern matches (`/api/v1/rounds/abc/`, an unknown endpoint) raises Resolver404
    before any view runs, and Django answers it with its HTML 404: with DEBUG the technical page
    listing every URL pattern (chosen in `response_for_exception` whatever `handler404` says),
    without it `handler404`'s page. Such an answer under /api/ is replaced here; the views' own
    404s are JSON already and pass as they are. Listed after CommonMiddleware, so that a path
    missing its trailing slash still gets CommonMiddleware's redirect. Pages outside /api/ keep
    their HTML 404; a DRF view's own 404 (JSON, or the browsable API's page) is left as it is."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            response.status_code == 404
            and is_api(request)
            and not isinstance(response, DrfResponse)  # a view's own 404 (JSON, or browsable)
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            if getattr(request, "resolver_match", None) is None:  # no URL pattern matched
                detail = f"no API endpoint at {_shown_path(request)} (see /api/docs/)"
            else:
                detail = f"not found: {_shown_path(request)}"
            return JsonResponse({"detail": detail}, status=404)
        return response


def server_error(request, template_name=defaults.ERROR_500_TEMPLATE_NAME):
    """handler500: JSON `{"detail": ...}` under /api/, Django's page elsewhere (used when DEBUG is
    off; with DEBUG on Django shows its traceback page)."""
    if is_api(request):
        return JsonResponse({"detail": "internal server error"}, status=500)
    return defaults.server_error(request, template_name)


def _body_too_big() -> JsonResponse:
    return JsonResponse(
        {"detail": f"the request body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} "
                   "bytes, the server's limit for one request: send less (a routing "
                   "batch: fewer queries)"},
        status=413,
    )


def _body_over_a_limit(exception) -> JsonResponse | None:
    """The JSON answer naming the limit a request body went past (Django refuses it while DRF or
    Django reads it): its size, its form fields or its files; None for any other exception."""
    if isinstance(exception, RequestDataTooBig):
        return _body_too_big()
    if isinstance(exception, TooManyFieldsSent):
        limit, what = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS, "fields"
    elif isinstance(exception, TooManyFilesSent):
        limit, what = settings.DATA_UPLOAD_MAX_NUMBER_FILES, "files"
    else:
        return None
    return JsonResponse(
        {"detail": f"the request body has more than {limit} {what}, the server's limit for one "
                   "request"},
        status=400,
    )


def bad_request(request, exception, template_name=defaults.ERROR_400_TEMPLATE_NAME):
    """handler400 (a SuspiciousOperation or BadRequest that no view answered): JSON under /api/,
    where a body past DATA_UPLOAD_MAX_MEMORY_SIZE (one that DRF or Django read whole, as a
    routing batch) is a 413 naming the limit, and one past the limits on form fields or files a
    400 naming it; Django's page elsewhere."""
    if is_api(request):
        return _body_over_a_limit(exception) or JsonResponse({"detail": "bad request"}, status=400)
    return defaults.bad_request(request, exception, template_name)


class ApiBodyTooBigMiddleware:
    """A view under /api/ that reads a body past DATA_UPLOAD_MAX_MEMORY_SIZE answers the JSON
    413 naming the limit with DEBUG on too, and one past DATA_UPLOAD_MAX_NUMBER_FIELDS or
    _FILES (a form or multipart body) the JSON 400 naming it. `handler400` says so only with
    DEBUG off: with DEBUG on Django answers a SuspiciousOperation with its HTML debug page,
    status 400 (the default configuration, `runserver`, where client developers try the API)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        return _body_over_a_limit(exception) if is_api(request) else None


class ErasureCachesMiddleware:
    """Each request starts by reading the erasure generation (one primary-key query) and this
    process forgets its caches of clients' texts when an erasure committed since it last read it;
    at the request's end it forgets them again if another thread noticed one meanwhile
    (`federation.caches`). No request is answered from a cache that holds an erased text."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        from federation import caches

        started = caches.check()
        try:
            return self.get_response(request)
        finally:
            caches.settle(started)
