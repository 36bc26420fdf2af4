from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from federation.errors import FederationError
from federation.services import Actor, issue_user_token
from synapse_web.command_arguments import utf8_text


class Command(BaseCommand):
    help = "Issue an API token for a person (operator, organization admin or member); shown once."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument(
            "--label", default="", help="what the token is for (shown on the API tokens page)"
        )

    def handle(self, *args, username, label, **options):
        utf8_text("a username", username)
        utf8_text("a token's label", label)
        users = get_user_model().objects
        user = users.filter(username=username).first()
        if user is None:
            # Usernames are unique in any case, and signing in takes them as written: name the
            # login that differs only in case, rather than say there is none.
            other = users.filter(username__iexact=username).values_list("username", flat=True)
            hint = f" (usernames are case-sensitive: {other[0]!r}?)" if other else ""
            raise CommandError(f"no user {username!r}{hint}")
        try:
            token = issue_user_token(Actor.system("issue_user_token"), user, label)
        except FederationError as exc:
            raise CommandError(exc.detail) from None
        self.stdout.write(token)
