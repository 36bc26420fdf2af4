from django.contrib import admin

from routing.models import RoutingCall, RoutingToken


@admin.register(RoutingToken)
class RoutingTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "revoked", "created_at")
    list_filter = ("revoked",)
    readonly_fields = ("token_hash", "created_at")
    search_fields = ("name",)


@admin.register(RoutingCall)
class RoutingCallAdmin(admin.ModelAdmin):
    list_display = ("at", "latency_ms", "queries", "reranker", "compendium_round")
    list_filter = ("reranker",)
