from django.core.management.base import BaseCommand, CommandError

from federation.login_throttle import unlock


class Command(BaseCommand):
    help = (
        "Clear the failed sign-in counts of a username and/or a client address, so that a "
        "locked-out account (the operator's too) can sign in again at once."
    )

    def add_arguments(self, parser):
        parser.add_argument("username", nargs="?", help="the locked username (any case)")
        parser.add_argument("--address", help="also clear this client address's count")

    def handle(self, *args, username, address, **options):
        if not username and not address:
            raise CommandError("name a username, an --address, or both")
        removed = unlock(username, address)
        what = " and ".join(
            part for part in (username and f"username {username!r}", address and f"address {address}")
            if part
        )
        self.stdout.write(f"{what}: {removed} failure count(s) cleared; sign-in is open again")
