from django.contrib import admin

from federation.models import Client, Organization, Round


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "created_at")
    search_fields = ("name", "slug")
    prepopulated_fields = {"slug": ("name",)}


@admin.register(Client)
class ClientAdmin(admin.ModelAdmin):
    list_display = ("name", "organization", "status", "contact", "created_at")
    list_filter = ("status", "organization")
    search_fields = ("name", "contact")


@admin.register(Round)
class RoundAdmin(admin.ModelAdmin):
    list_display = ("number", "state", "opened_at", "closed_at", "published_at")
    list_filter = ("state",)
