"""Issue or revoke a routing-API token: `manage.py routing_token NAME [--revoke]`."""

from django.core.management.base import BaseCommand, CommandError

from routing.models import RoutingToken


class Command(BaseCommand):
    help = "Issue a bearer token for the routing API (printed once), or revoke one by name."

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
        if revoke:
            if not RoutingToken.objects.filter(name=name).update(revoked=True):
                raise CommandError(f"no routing token named {name!r}")
            self.stdout.write(f"revoked routing token {name}")
            return
        if not name.strip():
            # `routing_token "$NAME"` with NAME unset: a token nobody could tell from another
            raise CommandError("a routing token needs a name (it is how the token is revoked)")
        limit = RoutingToken._meta.get_field("name").max_length
        if len(name) > limit:
            raise CommandError(f"a routing token's name is at most {limit} characters, not {len(name)}")
        if RoutingToken.objects.filter(name=name).exists():
            raise CommandError(f"a routing token named {name!r} exists; pick another name")
        _, raw = RoutingToken.issue(name)
        self.stdout.write(raw)
