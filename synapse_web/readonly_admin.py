"""The Django admin's model pages are for looking: every change to the federation's records goes
through the audited services (dashboard, API, management commands), which check it and write the
audit log; the Django admin does neither. Its user pages are the exception (federation.admin)."""

from django.contrib import admin


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown, never added, changed or deleted here."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
