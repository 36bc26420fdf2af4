from django.contrib import admin

from compendium.models import (
    AnnexEntry,
    CompendiumVersion,
    PrecautionEntry,
    ScenarioEntry,
    StatEntry,
    TemplateEntry,
)
from synapse_web.readonly_admin import ReadOnlyAdmin

# The tool registry and the declared numeric fields (the schema in force) are edited in the admin
# by the operator alone, audited: federation.admin registers their pages.


class _EntryInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True
    raw_id_fields = ("tool",)


class ScenarioInline(_EntryInline):
    model = ScenarioEntry
    fields = ("tool", "text", "preconditions", "support")
    readonly_fields = fields


class PrecautionInline(_EntryInline):
    model = PrecautionEntry
    fields = ("tool", "text", "support")
    readonly_fields = fields


class TemplateInline(_EntryInline):
    model = TemplateEntry
    fields = ("tool", "signature", "template")
    readonly_fields = fields


class StatInline(_EntryInline):
    model = StatEntry
    fields = ("tool", "field", "value")
    readonly_fields = fields


# Stored compendiums are content-addressed (sha256) and published globals are what clients
# pulled: shown here, never edited.
@admin.register(CompendiumVersion)
class CompendiumVersionAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "round", "client", "organization", "size_bytes", "gzip_bytes", "created_at")
    list_filter = ("kind", "round")
    readonly_fields = ("sha256", "size_bytes", "gzip_bytes", "entry_counts", "created_at")
    raw_id_fields = ("client", "organization", "round", "sources")
    inlines = [ScenarioInline, PrecautionInline, TemplateInline, StatInline]


@admin.register(ScenarioEntry)
class ScenarioEntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "version", "tool", "support", "text")
    search_fields = ("text", "tool__tool_id")
    raw_id_fields = ("version", "tool")
    exclude = ("embedding",)


@admin.register(PrecautionEntry)
class PrecautionEntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "version", "tool", "support", "text")
    search_fields = ("text", "tool__tool_id")
    raw_id_fields = ("version", "tool")
    exclude = ("embedding",)


@admin.register(AnnexEntry)
class AnnexEntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "version", "subject", "relation", "object")
    search_fields = ("subject", "object")
    raw_id_fields = ("version",)
