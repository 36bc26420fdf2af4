from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from compendium.services import current_schema


class Command(BaseCommand):
    help = "Write the schema S in force (registry, numeric fields, limits) as JSON for clients."

    def add_arguments(self, parser):
        parser.add_argument("--out", default="-", help="file to write, or - for standard output")

    def handle(self, *args, out, **options):
        text = current_schema().model_dump_json(indent=2)
        if out == "-":
            self.stdout.write(text)
        else:
            try:
                Path(out).write_text(text, encoding="utf-8")
            except OSError as exc:
                raise CommandError(
                    f"cannot write the schema to {out}: {exc.strerror or exc}"
                ) from None
            self.stdout.write(f"schema written to {out}")
