"""Issue or revoke a routing-API token: `manage.py routing_token NAME [--revoke]`."""

from django.core.management.base import BaseCommand, CommandError

from federation.errors import FederationError
from federation.services import Actor, issue_routing_token, revoke_routing_token
from synapse_web.command_arguments import utf8_text


class Command(BaseCommand):
    help = "Issue a bearer token for the routing API (printed once), or revoke one by name; both audited."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--revoke", action="store_true")

    def handle(self, *args, name, revoke, **options):
        utf8_text("a routing token's name", name)
        actor = Actor.system("manage.py routing_token")
        try:
            if revoke:
                revoke_routing_token(actor, name)
                self.stdout.write(f"revoked routing token {name}")
                return
            self.stdout.write(issue_routing_token(actor, name))
        except FederationError as exc:
            raise CommandError(str(exc)) from None
