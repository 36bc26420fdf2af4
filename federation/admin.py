from django.contrib import admin

from federation.auth import AdminLoginForm
from federation.models import (
    AuditLog,
    Client,
    FederationSettings,
    Membership,
    Organization,
    Round,
    Submission,
)

# The admin's login form says when the sign-in throttle refused (federation.login_throttle).
admin.site.login_form = AdminLoginForm


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown, never changed here: the change goes through the audited services (dashboard or
    API), which check it and write the audit log; the Django admin does neither."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Organization)
class OrganizationAdmin(ReadOnlyAdmin):
    """Created on the dashboard's Organizations page or POST /api/v1/admin/organizations/."""

    list_display = ("name", "slug", "created_at")
    search_fields = ("name", "slug")


@admin.register(Client)
class ClientAdmin(ReadOnlyAdmin):
    """Enrollment, approval, rotation and revocation go through the audited API and dashboard."""

    list_display = ("name", "organization", "status", "contact", "created_at")
    list_filter = ("status", "organization")
    search_fields = ("name", "contact")


@admin.register(Membership)
class MembershipAdmin(ReadOnlyAdmin):
    """People are added, given roles, reset and deactivated on the organization's page (People)
    or /api/v1/admin/people/: checked (an operator's login stays the operator's) and audited."""

    list_display = ("user", "organization", "role", "created_at")
    list_filter = ("role", "organization")


@admin.register(Round)
class RoundAdmin(admin.ModelAdmin):
    list_display = ("number", "state", "opened_at", "closed_at", "published_at")
    list_filter = ("state",)
    # Changed only through the audited services (the deadline: set_round_deadline).
    readonly_fields = (
        "number", "state", "config", "failure_reason", "closes_at", "closed_at", "published_at"
    )

    def has_add_permission(self, request):
        return False


@admin.register(Submission)
class SubmissionAdmin(admin.ModelAdmin):
    list_display = (
        "client", "round", "idempotency_key", "status_code", "scrubbed", "wire_bytes",
        "content_encoding", "created_at",
    )
    list_filter = ("round",)

    def has_change_permission(self, request, obj=None):
        return False

    def has_add_permission(self, request):
        return False


@admin.register(FederationSettings)
class FederationSettingsAdmin(admin.ModelAdmin):
    """Shown read-only: changes go through PATCH /api/v1/admin/settings/, which audits them."""

    list_display = ("epsilon_budget", "delta_prime", "allow_admin_approval", "updated_at")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = ("created_at", "actor_label", "action", "organization", "target_label", "ip")
    list_filter = ("action", "organization")
    search_fields = ("actor_label", "target_label")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
