"""Issue or revoke a routing-API token: `manage.py routing_token NAME [--revoke]`."""

from django.core.management.base import BaseCommand, CommandError

from federation.errors import FederationError
from federation.services import Actor, issue_routing_token, revoke_routing_token


class Command(BaseCommand):
    help = "Issue a bearer token for the routing API (printed once), or revoke one by name; both audited."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--revoke", action="store_true")

    def handle(self, *args, name, revoke, **options):
        try:  # bytes that were not UTF-8 in the shell's argument come as lone surrogates
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise CommandError(
                f"a routing token's name must be UTF-8 text: {name!r} holds an undecodable byte "
                f"at position {exc.start}"
            ) from None
        actor = Actor.system("manage.py routing_token")
        try:
            if revoke:
                revoke_routing_token(actor, name)
                self.stdout.write(f"revoked routing token {name}")
                return
            self.stdout.write(issue_routing_token(actor, name))
        except FederationError as exc:
            raise CommandError(str(exc)) from None
