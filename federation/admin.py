from django import forms
from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db import router, transaction
from django.utils.decorators import method_decorator
from django.views.decorators.debug import sensitive_post_parameters

from compendium.models import NumericField, Tool
from compendium.services import new_tool_id_problem, schema_problem
from federation import people
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
from federation.services import Actor, audit_schema_edit, client_ip
from synapse_web.readonly_admin import ReadOnlyAdmin

# The admin's login form says when the sign-in throttle refused (federation.login_throttle).
admin.site.login_form = AdminLoginForm


def _operator_only(request) -> bool:
    """The Django admin is the operator's (a superuser's) alone: its pages show every
    organization's records, and a staff login given view permissions (directly or by a group)
    would see across organizations, which the dashboard never shows an organization's people."""
    return request.user.is_active and request.user.is_superuser


admin.site.has_permission = _operator_only


@admin.register(Organization)
class OrganizationAdmin(ReadOnlyAdmin):
    """Created on the dashboard's Organizations page or POST /api/v1/admin/organizations/."""

    list_display = ("name", "slug", "created_at")
    search_fields = ("name", "slug")


@admin.register(Client)
class ClientAdmin(ReadOnlyAdmin):
    """Enrollment, approval, rotation and revocation go through the audited API and dashboard."""

    list_display = ("name", "organization", "status", "contact", "created_at")
    list_select_related = ("organization",)
    list_filter = ("status", "organization")
    search_fields = ("name", "contact")


@admin.register(Membership)
class MembershipAdmin(ReadOnlyAdmin):
    """People are added, given roles, reset and deactivated on the organization's page (People)
    or /api/v1/admin/people/: checked (an operator's login stays the operator's) and audited."""

    list_display = ("user", "organization", "role", "created_at")
    list_filter = ("role", "organization")


@admin.register(Round)
class RoundAdmin(ReadOnlyAdmin):
    """Opened, closed, retried and given deadlines on the dashboard or /api/v1/admin/rounds/
    (audited); deleting one would take its ε spend out of the privacy ledger."""

    list_display = ("number", "state", "opened_at", "closed_at", "published_at")
    list_filter = ("state",)


@admin.register(Submission)
class SubmissionAdmin(ReadOnlyAdmin):
    """What clients sent: erased only with `manage.py erase_client` (audited, with the merges'
    provenance), never deleted here."""

    list_select_related = ("client__organization", "round")
    list_display = (
        "client", "round", "idempotency_key", "status_code", "scrubbed", "wire_bytes",
        "content_encoding", "created_at",
    )
    list_filter = ("round",)


@admin.register(FederationSettings)
class FederationSettingsAdmin(ReadOnlyAdmin):
    """Changes go through the Settings page or PATCH /api/v1/admin/settings/, which audit them."""

    list_display = ("epsilon_budget", "delta_prime", "allow_admin_approval", "updated_at")


@admin.register(AuditLog)
class AuditLogAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "actor_label", "action", "organization", "target_label", "ip")
    list_select_related = ("organization",)
    list_filter = ("action", "organization")
    search_fields = ("actor_label", "target_label")


def _actor(request) -> Actor:
    """Who acts in the admin, as the audit log names them."""
    return Actor.for_user(request.user, client_ip(request))


class SchemaRowForm(forms.ModelForm):
    """A registry row or numeric field as the schema in force will read it: a value the schema
    refuses (a field name that is not an identifier, a spec that is not an object) is a form
    error here, not a schema that every submission, download and merge then fails to load."""

    def _post_clean(self):
        super()._post_clean()  # the instance now holds the form's values
        if not self.errors:
            problem = schema_problem(self.instance)
            if problem:
                self.add_error(None, f"the schema in force would not load: {problem}")


class ToolRowForm(SchemaRowForm):
    """A registry row: a new one's id may not read otherwise than it is stored nor as a stored
    tool's (new_tool_id_problem, as import_tools refuses it). The id of a stored row is not
    edited (AuditedSchemaAdmin.identity), so not checked again."""

    def clean_tool_id(self):
        tool_id = self.cleaned_data["tool_id"]
        if problem := new_tool_id_problem(tool_id):
            raise forms.ValidationError(f"{problem}; choose another id")
        return tool_id


class OperatorEditsOnly:
    """Mixin of a ModelAdmin that only the operator (a superuser) may add, change or delete in:
    a staff login given Django's model permissions (directly or by a group) could otherwise
    edit the schema in force, or make itself a superuser."""

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


class AuditedSchemaAdmin(OperatorEditsOnly, admin.ModelAdmin):
    """The schema in force: what clients build and validate against, and (numeric fields) the
    ranges and sensitivities that set the Laplace noise. The operator (a superuser) alone edits
    it here, and every addition, change (each field from / to) and deletion is audited as
    schema.change. The identifier (`identity`) is fixed once created: stored compendiums, the
    conflict log and the privacy ledger name rows by it; a tool or field is renamed by adding
    the new one and deactivating (a tool) or deleting (a field) the old."""

    form = SchemaRowForm
    identity = ""

    def get_readonly_fields(self, request, obj=None):
        fixed = (self.identity,) if obj is not None else ()
        return (*super().get_readonly_fields(request, obj), *fixed)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change:
            fields = {
                name: {"from": form.initial.get(name), "to": form.cleaned_data.get(name)}
                for name in form.changed_data
            }
        else:
            fields = {name: {"to": value} for name, value in form.cleaned_data.items()}
        if fields or not change:
            audit_schema_edit(_actor(request), obj, "change" if change else "add", fields)

    def delete_model(self, request, obj):
        audit_schema_edit(_actor(request), obj, "delete")
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        actor = _actor(request)
        for obj in queryset:
            audit_schema_edit(actor, obj, "delete")
        super().delete_queryset(request, queryset)


@admin.register(Tool)
class ToolAdmin(AuditedSchemaAdmin):
    """A tool no longer offered is made inactive rather than deleted (stored compendiums name it;
    the admin refuses the deletion of a tool they reference)."""

    form = ToolRowForm
    identity = "tool_id"
    list_display = ("tool_id", "name", "category", "active", "updated_at")
    list_filter = ("category", "active")
    search_fields = ("tool_id", "name", "description")


@admin.register(NumericField)
class NumericFieldAdmin(AuditedSchemaAdmin):
    identity = "name"
    list_display = ("name", "kind", "min_value", "max_value", "sensitivity", "unit")


User = get_user_model()
admin.site.unregister(User)


@admin.register(User)
class AuditedUserAdmin(OperatorEditsOnly, UserAdmin):
    """Logins, editable here by the operator alone and audited like every other change (see
    federation.people's admin_login_* functions): adding, changing (what changed, from / to),
    setting a password (never the password) and deleting. People of an organization are better
    managed on its People page (roles, generated passwords, the organization admins' rules)."""

    def save_model(self, request, obj, form, change):
        # The login as stored, locked until the change and its audit entry commit together (the
        # admin's change view is one transaction).
        form._login_before = (
            people.login_snapshot(User.objects.select_for_update().get(pk=obj.pk))
            if change
            else None
        )
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)  # groups, permissions
        people.admin_login_saved(
            _actor(request), form.instance, getattr(form, "_login_before", None)
        )

    @method_decorator(sensitive_post_parameters())
    def user_change_password(self, request, id, form_url=""):
        with transaction.atomic(using=router.db_for_write(self.model)):
            user = self.get_object(request, unquote(id))
            before = user.password if user is not None else None
            response = super().user_change_password(request, id, form_url)
            if user is not None and request.method == "POST":
                user.refresh_from_db()
                if user.password != before:
                    people.admin_password_set(_actor(request), user)
            return response

    def delete_model(self, request, obj):
        people.admin_login_deleted(_actor(request), obj)
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        actor = _actor(request)
        for user in queryset:
            people.admin_login_deleted(actor, user)
        super().delete_queryset(request, queryset)
