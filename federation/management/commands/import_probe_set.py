from django.core.management.base import BaseCommand, CommandError

from compendium.registry import RegistryFormatError
from federation.pipeline import import_probe_set


class Command(BaseCommand):
    help = "Import the public probe set (labelled benchmark queries, never client data)."

    def add_arguments(self, parser):
        parser.add_argument("path", help="routing-benchmark dataset folder (tools.jsonl + queries.jsonl)")
        parser.add_argument("--per-tool", type=int, default=None, help="at most N queries per tool")
        parser.add_argument("--seed", type=int, default=0, help="seed of the per-tool sample")

    def handle(self, *args, path, per_tool, seed, **options):
        if per_tool is not None and per_tool < 1:
            raise CommandError("--per-tool must be at least 1")
        if seed < 0:
            raise CommandError(f"--seed must be 0 or more, not {seed}")
        try:
            result = import_probe_set(path, per_tool=per_tool, seed=seed)
        except RegistryFormatError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"imported {result.imported} probe queries for {result.tools} tools "
            f"(dataset {result.dataset})"
        )
