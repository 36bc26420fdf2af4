"""One error shape for the whole REST API: every 4xx body has `detail`, a sentence naming what is
wrong. A serializer's field errors ({"tau": ["A valid number is required."]}) keep their
per-field form under `errors`, and `detail` says the same in one line ("tau: A valid number is
required."), so a client reads `detail` whatever refused it, as the OpenAPI document says."""

from __future__ import annotations

from typing import Any

from rest_framework.views import exception_handler as drf_exception_handler


def _messages(value: Any, prefix: str = "") -> list[str]:
    """Field errors as "field: message" lines (nested fields dotted, list items by index)."""
    if isinstance(value, dict):
        out: list[str] = []
        for key, inner in value.items():
            name = str(key) if key != "non_field_errors" else ""
            out += _messages(inner, f"{prefix}.{name}" if prefix and name else prefix or name)
        return out
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            text = " ".join(str(v) for v in value)
            return [f"{prefix}: {text}" if prefix else text] if text else []
        out = []
        for i, inner in enumerate(value):
            out += _messages(inner, f"{prefix}[{i}]" if prefix else f"[{i}]")
        return out
    return [f"{prefix}: {value}" if prefix else str(value)]


def error_body(data: Any) -> dict:
    """`data` (DRF's error data) as the API's error body: unchanged when it has a `detail`."""
    if isinstance(data, dict) and "detail" in data:
        return data
    lines = _messages(data)
    return {"detail": "; ".join(lines) or "invalid request", "errors": data}


def exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is not None:
        response.data = error_body(response.data)
    return response
