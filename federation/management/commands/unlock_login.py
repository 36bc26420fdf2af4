from django.core.management.base import BaseCommand, CommandError

from federation.login_throttle import parsed_address
from federation.people import unlock_sign_in
from federation.services import Actor
from synapse_web.command_arguments import utf8_text


class Command(BaseCommand):
    help = (
        "Clear the failed sign-in counts of a username and/or a client address, so that a "
        "locked-out account (the operator's too) can sign in again at once."
    )

    def add_arguments(self, parser):
        parser.add_argument("username", nargs="?", help="the locked username (any case)")
        parser.add_argument(
            "--address", help="also clear this client address's count (as the login.throttled "
            "audit entry names it)"
        )

    def handle(self, *args, username, address, **options):
        address = (address or "").strip() or None
        if username:
            utf8_text("a username", username)
        if not username and not address:
            raise CommandError("name a username, an --address, or both")
        if address and parsed_address(address) is None:
            # Counted under no key: clearing it would clear nothing and say sign-in is open.
            raise CommandError(
                f"--address {address!r} is not an IP address (give it as the login.throttled "
                "audit entry names it)"
            )
        removed = unlock_sign_in(Actor.system("manage.py unlock_login"), username, address)
        what = " and ".join(
            part for part in (username and f"username {username!r}", address and f"address {address}")
            if part
        )
        self.stdout.write(f"{what}: {removed} failure count(s) cleared; sign-in is open again")
