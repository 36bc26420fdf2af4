from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from federation.models import Client
from federation.pipeline import (
    ERASURE_TABLES,
    VacuumFailed,
    erase_client,
    first_line,
    vacuum_erased_tables,
)
from federation.services import Actor
from synapse_web.command_arguments import utf8_text


class Command(BaseCommand):
    help = (
        "Right to erasure: remove every submission of one client and re-materialize the edge and "
        "global compendiums built from them or from the conflict logs that held them, removing "
        "reviewers' decisions that no longer fit. CLIENT is a client id or ORG-SLUG/NAME. "
        "PostgreSQL keeps the deleted rows' bytes in its table files until they are rewritten: "
        "--vacuum rewrites the tables that held them (VACUUM FULL, once the erasure has committed)."
    )

    def add_arguments(self, parser):
        parser.add_argument("client")
        parser.add_argument(
            "--vacuum", action="store_true",
            help="after the erasure commits, VACUUM FULL the tables an erasure deletes from ("
            + ", ".join(ERASURE_TABLES) + ") and CHECKPOINT, so that the erased rows' bytes leave "
            "the table files (not the WAL already written, nor backups). Each table is locked "
            "exclusively while it is rewritten: the routing API and submissions wait meanwhile.",
        )
        parser.add_argument(
            "--lock-timeout", type=float, default=10.0, metavar="SECONDS",
            help="with --vacuum: how long to wait for each table's lock before giving up "
            "(default 10; the erasure stands either way)",
        )

    def handle(self, *args, client, vacuum=False, lock_timeout=10.0, **options):
        utf8_text("a client", client)
        if vacuum and not 0 < lock_timeout < 86400:
            raise CommandError("--lock-timeout must be a number of seconds above 0 (below a day)")
        if vacuum and connection.in_atomic_block:
            raise CommandError("--vacuum cannot run inside a transaction (VACUUM cannot): nothing "
                               "was erased")
        try:
            if client.isascii() and client.isdigit():
                target = Client.objects.get(pk=int(client))
            else:
                slug, _, name = client.partition("/")
                target = Client.objects.get(organization__slug=slug, name=name)
        except Client.DoesNotExist:
            raise CommandError(f"no client {client!r} (give an id or ORG-SLUG/NAME)") from None
        try:
            report = erase_client(target, actor=Actor.system("manage.py erase_client"))
        except Exception as exc:
            # erase_client is all or nothing: nothing was deleted or re-published.
            raise CommandError(
                f"erasing {target} failed, nothing was changed (run it again once the cause is "
                f"fixed): {exc}"
            ) from exc
        self.stdout.write(
            f"erased {report.submissions_removed} submission(s) of {report.client}; "
            f"re-materialized {len(report.edges_rematerialized)} edge and "
            f"{len(report.globals_rematerialized)} global compendium(s); "
            f"removed {report.decisions_removed} conflict decision(s)"
            + (f"; removed {len(report.edges_removed)} edge(s) left without submissions"
               if report.edges_removed else "")
            + (f"; round(s) {', '.join(map(str, report.globals_removed))} left without a global "
               "compendium (removed)" if report.globals_removed else "")
            + (f"; deleted {len(report.edges_deleted)} edge(s) of failed rounds that can no "
               "longer be retried" if report.edges_deleted else "")
        )
        target.refresh_from_db()
        if target.status == Client.Status.APPROVED:
            # Erasure removes what the client sent; it does not stop the client sending again.
            self.stdout.write(
                f"{target} is still enrolled ({target.status}) and its token still submits: revoke it "
                "on its organization's page if it is to send nothing more"
            )
        elif target.status == Client.Status.PENDING:
            # No token yet (it was "its token still submits"): an approval would give it one.
            self.stdout.write(
                f"{target} is still enrolled (pending approval): it has no token yet, and approving "
                "it would let it submit; revoke it on its organization's page if it is to send nothing"
            )
        if vacuum:
            self._vacuum(target, lock_timeout)

    def _vacuum(self, target, lock_timeout: float) -> None:
        """VACUUM FULL after the erasure committed: a failure here undoes nothing."""
        self.stdout.write(
            f"VACUUM FULL of {len(ERASURE_TABLES)} table(s), one at a time, each under an exclusive "
            "lock: the routing API and submissions that use a table wait until it is rewritten"
        )
        again = (f"run `manage.py erase_client {target.organization.slug}/{target.name} --vacuum` "
                 "again: erasing again removes nothing more")
        try:
            report = vacuum_erased_tables(lock_timeout_s=lock_timeout)
        except VacuumFailed as exc:
            raise CommandError(
                f"the erasure of {target} stands (committed); {exc}; "
                + (f"not vacuumed: {', '.join(exc.not_vacuumed)} ({again})" if exc.not_vacuumed
                   else "every table was vacuumed (the old files go at the next checkpoint)")
            ) from exc
        except Exception as exc:  # the connection, before any table
            raise CommandError(
                f"the erasure of {target} stands (committed); the vacuum failed: {first_line(exc)}; not "
                f"vacuumed: {', '.join(ERASURE_TABLES)} ({again})"
            ) from exc
        for table, seconds in report.vacuumed:
            self.stdout.write(f"vacuumed {table} in {seconds:.2f} s")
        self.stdout.write(
            f"vacuumed {len(report.vacuumed)} table(s) in {report.seconds:.2f} s in all"
            + ("; checkpoint done" if report.checkpoint is None else "")
        )
        if report.checkpoint is not None:
            self.stdout.write(f"no CHECKPOINT: {report.checkpoint}")
