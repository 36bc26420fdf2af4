"""Pagination of the API's lists."""

from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """?limit= and ?offset= as DRF's LimitOffsetPagination, with ?limit= capped at `max_limit`
    (an unbounded limit would reach the database as an out-of-range LIMIT). An offset past the
    end gives an empty page without a query."""

    max_limit = 1000
