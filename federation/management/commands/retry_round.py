from django.core.management.base import BaseCommand, CommandError

from federation.errors import FederationError
from federation.models import Round
from federation.services import Actor, retry_round


class Command(BaseCommand):
    help = "Retry the merge pipeline of a failed round (operator action, audited)."

    def add_arguments(self, parser):
        parser.add_argument("number", type=int, help="round number")

    def handle(self, *args, number, **options):
        try:
            retry_round(Actor(None, label="manage.py retry_round"), Round.objects.get(number=number))
        except Round.DoesNotExist:
            raise CommandError(f"no round {number}") from None
        except FederationError as exc:
            raise CommandError(exc.detail) from None
        self.stdout.write(f"round {number} is closing again; the merge pipeline was started")
