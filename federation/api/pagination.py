"""Pagination of the API's lists."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination


def _count_param(request, name: str, *, minimum: int) -> int | None:
    """The query parameter `name` as an integer >= `minimum`; None when absent (or empty, as a
    form sends it); a 400 naming the parameter otherwise (DRF's pagination ignores a limit of
    "true" or an offset of "-5" and answers another page than the one asked for)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    digits = raw[1:] if raw.startswith("-") else raw
    # ASCII digits only: int() also reads "+5", " 5", "1_0" and full-width "５"
    if not (digits.isascii() and digits.isdigit()):
        raise ValidationError({"detail": f"{name} must be an integer, not {raw[:40]!r}"})
    significant = digits.lstrip("0") or "0"
    value = 10**18 if len(significant) > 18 else int(significant)  # past any list: the cap, or the end
    if (raw.startswith("-") and value) or value < minimum:
        raise ValidationError({"detail": f"{name} must be at least {minimum}, not {raw[:40]}"})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """?limit= and ?offset= as DRF's LimitOffsetPagination, with ?limit= capped at `max_limit`
    (an unbounded limit would reach the database as an out-of-range LIMIT), and a limit or
    offset that is not a whole number in range refused (400) rather than ignored. An offset
    past the end gives an empty page without a query."""

    max_limit = 1000

    def get_limit(self, request):
        limit = _count_param(request, self.limit_query_param, minimum=1)
        return self.default_limit if limit is None else min(limit, self.max_limit)

    def get_offset(self, request):
        return _count_param(request, self.offset_query_param, minimum=0) or 0

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            minimum = 1 if parameter["name"] == self.limit_query_param else 0
            parameter["schema"] = {**parameter["schema"], "minimum": minimum}
            if parameter["name"] == self.limit_query_param:
                parameter["description"] = (
                    f"Number of results to return per page (at most {self.max_limit}: a larger "
                    "limit gives that many)."
                )
        return parameters
