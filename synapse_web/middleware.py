"""Request checks that hold for every page and endpoint."""

from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render

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
