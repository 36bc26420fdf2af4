from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from synapse_web.backup import BackupError, restore


class Command(BaseCommand):
    help = (
        "Restore a backup made by `manage.py backup_db` into the configured database, which must "
        "be empty (a new DATABASE_URL database, or a new SYNAPSE_DATA_DIR for the embedded one); "
        "in one transaction. Then run `manage.py migrate` if the code is newer than the backup."
    )
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)

    def handle(self, *args, file, **options):
        try:
            restore(settings.DATABASES["default"], file)
        except BackupError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"restored {file} into database {settings.DATABASES['default']['NAME']!r}")
