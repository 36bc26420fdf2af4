import json

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

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

# A global compendium holds thousands of entries and about a megabyte of canonical JSON: its page
# shows counts with links to the entries' own (paginated) lists, and the head of the JSON.
CONTENT_PREVIEW_CHARS = 4000
SOURCES_SHOWN = 50
ENTRY_LISTS = (
    ("scenarios", ScenarioEntry),
    ("precautions", PrecautionEntry),
    ("templates", TemplateEntry),
    ("stats", StatEntry),
    ("annex", AnnexEntry),
)


# Stored compendiums are content-addressed (sha256) and published globals are what clients
# pulled: shown here, never edited.
@admin.register(CompendiumVersion)
class CompendiumVersionAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "round", "client", "organization", "size_bytes", "gzip_bytes", "created_at")
    list_filter = ("kind", "round")
    list_select_related = ("round", "client__organization", "organization")
    fields = ("kind", "round", "client", "organization", "schema_version", "sha256", "size_bytes",
              "gzip_bytes", "entry_counts", "entries", "merged_from", "created_at", "content_preview")
    readonly_fields = fields
    raw_id_fields = ("client", "organization", "round", "sources")

    def get_queryset(self, request):
        return super().get_queryset(request).defer("content", "routing_head")

    @admin.display(description="entries")
    def entries(self, obj):
        return format_html_join(
            ", ", '<a href="{}?version__id__exact={}">{} {}</a>',
            (
                (reverse(f"admin:compendium_{model._meta.model_name}_changelist"), obj.pk,
                 model.objects.filter(version=obj).count(), name)
                for name, model in ENTRY_LISTS
            ),
        )

    @admin.display(description="merged from")
    def merged_from(self, obj):
        sources = obj.sources.select_related("client__organization", "organization")
        shown = [str(v) for v in sources[:SOURCES_SHOWN]]
        total = sources.count()
        return "; ".join(shown) + (f"; and {total - len(shown)} more" if total > len(shown) else "")

    @admin.display(description="content (canonical JSON, its head)")
    def content_preview(self, obj):
        text = json.dumps(obj.content, ensure_ascii=False)  # deferred in lists: loaded here
        more = f" … ({len(text) - CONTENT_PREVIEW_CHARS:,} more characters)" if len(
            text) > CONTENT_PREVIEW_CHARS else ""
        return format_html("<pre style='white-space: pre-wrap'>{}{}</pre>",
                           text[:CONTENT_PREVIEW_CHARS], more)


class _EntryAdmin(ReadOnlyAdmin):
    """The entries of stored compendiums, by version (`?version__id__exact=`): the version is
    shown by its id, without loading its content."""

    list_select_related = ("tool",)
    raw_id_fields = ("version", "tool")
    vectors: tuple[str, ...] = ()  # not shown, not loaded

    def get_exclude(self, request, obj=None):
        return self.vectors

    def get_queryset(self, request):
        return super().get_queryset(request).defer(*self.vectors)


@admin.register(ScenarioEntry)
class ScenarioEntryAdmin(_EntryAdmin):
    vectors = ("embedding",)
    list_display = ("id", "version_id", "tool", "support", "text")
    search_fields = ("text", "tool__tool_id")


@admin.register(PrecautionEntry)
class PrecautionEntryAdmin(_EntryAdmin):
    vectors = ("embedding",)
    list_display = ("id", "version_id", "tool", "support", "text")
    search_fields = ("text", "tool__tool_id")


@admin.register(TemplateEntry)
class TemplateEntryAdmin(_EntryAdmin):
    list_display = ("id", "version_id", "tool", "signature")
    search_fields = ("signature", "tool__tool_id")


@admin.register(StatEntry)
class StatEntryAdmin(_EntryAdmin):
    list_display = ("id", "version_id", "tool", "field", "value")
    search_fields = ("field", "tool__tool_id")


@admin.register(AnnexEntry)
class AnnexEntryAdmin(_EntryAdmin):
    list_select_related = ()
    raw_id_fields = ("version",)
    list_display = ("id", "version_id", "subject", "relation", "object")
    search_fields = ("subject", "object")
