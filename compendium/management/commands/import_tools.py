from django.core.management.base import BaseCommand, CommandError

from compendium.registry import RegistryFormatError, load_registry
from compendium.services import RegistryTooLarge, ToolIdRefused, import_registry


class Command(BaseCommand):
    help = (
        "Import a tool registry: a dataset folder or tools.jsonl in the routing-benchmark format, "
        "or an MCP tools/list result (JSON)."
    )

    def add_arguments(self, parser):
        parser.add_argument("path", help="dataset folder, tools.jsonl, or MCP tools/list JSON")

    def handle(self, *args, path, **options):
        try:
            tools = load_registry(path)
        except RegistryFormatError as exc:
            raise CommandError(str(exc)) from None
        try:
            result = import_registry(tools)
        except (ToolIdRefused, RegistryTooLarge) as exc:
            raise CommandError(f"{path}: {exc}; nothing was imported") from None
        untouched = (
            f"; {result.not_named} active tools of the registry are not in this file and stay "
            "active (deactivate a tool in the admin to take it out)"
            if result.not_named else ""
        )
        self.stdout.write(
            f"{result.total} tools from {path}: {result.created} created, "
            f"{result.updated} updated, {result.unchanged} unchanged{untouched}"
        )
