from django.core.management.base import BaseCommand, CommandError

from federation.models import Client
from federation.pipeline import erase_client
from federation.services import Actor
from synapse_web.command_arguments import utf8_text


class Command(BaseCommand):
    help = (
        "Right to erasure: remove every submission of one client and re-materialize the edge and "
        "global compendiums built from them or from the conflict logs that held them, removing "
        "reviewers' decisions that no longer fit. CLIENT is a client id or ORG-SLUG/NAME."
    )

    def add_arguments(self, parser):
        parser.add_argument("client")

    def handle(self, *args, client, **options):
        utf8_text("a client", client)
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
