from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from synapse_web.embedded_db import stop_embedded_database


class Command(BaseCommand):
    help = "Manage the embedded PostgreSQL + pgvector server (used when DATABASE_URL is unset)."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["status", "stop"])

    def handle(self, *args, action, **options):
        pgdata = settings.DATA_DIR / "pgdata"
        if action == "status":
            running = (pgdata / "postmaster.pid").exists()
            self.stdout.write(f"embedded PostgreSQL in {pgdata}: {'running' if running else 'stopped'}")
        elif stop_embedded_database(pgdata):
            self.stdout.write(f"stopped the embedded PostgreSQL in {pgdata}")
        else:
            raise CommandError(f"no embedded PostgreSQL is running in {pgdata}")
