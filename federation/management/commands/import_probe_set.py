from django.core.management.base import BaseCommand, CommandError

from compendium.registry import RegistryFormatError
from federation.pipeline import import_probe_set


class Command(BaseCommand):
    help = "Import the public probe set (labelled benchmark queries, never client data)."

    def add_arguments(self, parser):
        parser.add_argument("path", help="routing-benchmark dataset folder (tools.jsonl + queries.jsonl)")
        parser.add_argument("--per-tool", type=int, default=None, help="at most N queries per tool")
        parser.add_argument("--seed", type=int, default=0, help="seed of the per-tool sample")
        parser.add_argument(
            "--only", action="store_true",
            help="drop the probe queries of every other dataset (the probe set is every dataset "
                 "imported, each named after its folder; a dataset imported again replaces its own)",
        )

    def handle(self, *args, path, per_tool, seed, only, **options):
        if per_tool is not None and per_tool < 1:
            raise CommandError("--per-tool must be at least 1")
        if seed < 0:
            raise CommandError(f"--seed must be 0 or more, not {seed}")
        try:
            result = import_probe_set(path, per_tool=per_tool, seed=seed, only=only)
        except RegistryFormatError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"imported {result.imported} probe queries for {result.tools} tools "
            f"(dataset {result.dataset})"
        )
        if result.others:
            # The edges use every dataset's: a benchmark's new release from a folder of another
            # name was added beside the old one, silently.
            kept = ", ".join(f"{name} ({n} queries)" for name, n in result.others.items())
            self.stdout.write(f"the probe set also holds: {kept}; --only drops them")
