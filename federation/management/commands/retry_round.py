from django.core.management.base import BaseCommand, CommandError

from federation.errors import FederationError
from federation.models import Round
from federation.services import Actor, pipeline_outcome, retry_round


class Command(BaseCommand):
    help = "Retry the merge pipeline of a failed round (operator action, audited)."

    def add_arguments(self, parser):
        parser.add_argument("number", type=int, help="round number")

    def handle(self, *args, number, **options):
        try:
            rnd = retry_round(Actor(None, label="manage.py retry_round"), Round.objects.get(number=number))
        except Round.DoesNotExist:
            raise CommandError(f"no round {number}") from None
        except FederationError as exc:
            raise CommandError(exc.detail) from None
        # Without a broker the pipeline has run by now: said as it ended, not "closing again".
        self.stdout.write(f"round {number} retried; {pipeline_outcome(rnd)}")
