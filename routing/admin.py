from django.contrib import admin

from routing.models import RoutingCall, RoutingToken
from synapse_web.readonly_admin import ReadOnlyAdmin


@admin.register(RoutingToken)
class RoutingTokenAdmin(ReadOnlyAdmin):
    """Issued and revoked with `manage.py routing_token NAME [--revoke]`."""

    list_display = ("name", "revoked", "created_at")
    list_filter = ("revoked",)
    readonly_fields = ("token_hash", "created_at")
    search_fields = ("name",)


@admin.register(RoutingCall)
class RoutingCallAdmin(ReadOnlyAdmin):
    list_display = ("at", "latency_ms", "queries", "reranker", "compendium_round")
    # thirty days of calls: no DISTINCT over the table for a filter, no exact count per page
    date_hierarchy = "at"
    show_full_result_count = False
