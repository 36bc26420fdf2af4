from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from synapse_web.embedded_db import embedded_database_pid, stop_embedded_database


class Command(BaseCommand):
    help = "Manage the embedded PostgreSQL + pgvector server (used when DATABASE_URL is unset)."
    # It looks at the server and must not need it (the settings do not start it for this command).
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["status", "stop"])

    def handle(self, *args, action, **options):
        pgdata = settings.DATA_DIR / "pgdata"
        if action == "status":
            running = embedded_database_pid(pgdata) is not None
            self.stdout.write(f"embedded PostgreSQL in {pgdata}: {'running' if running else 'stopped'}")
        elif stop_embedded_database(pgdata):
            self.stdout.write(f"stopped the embedded PostgreSQL in {pgdata}")
        else:
            raise CommandError(f"no embedded PostgreSQL is running in {pgdata}")
