from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from synapse_web.backup import BackupError, backup


class Command(BaseCommand):
    help = (
        "Back up the whole database (the embedded one, or DATABASE_URL's) to FILE with pg_dump's "
        "custom format: every table, pgvector columns and indexes included. Consistent while the "
        "server and workers run (one snapshot). `manage.py restore_db FILE` restores it."
    )
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)

    def handle(self, *args, file, **options):
        try:
            size = backup(settings.DATABASES["default"], file)
        except BackupError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"backed up database {settings.DATABASES['default']['NAME']!r} to {file} "
                          f"({size} bytes)")
