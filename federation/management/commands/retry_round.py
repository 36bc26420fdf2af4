from django.core.management.base import BaseCommand, CommandError

from federation.models import Round
from federation.pipeline import PipelineError, retry_round


class Command(BaseCommand):
    help = "Retry the merge pipeline of a failed round (operator action)."

    def add_arguments(self, parser):
        parser.add_argument("number", type=int, help="round number")

    def handle(self, *args, number, **options):
        try:
            retry_round(Round.objects.get(number=number))
        except Round.DoesNotExist:
            raise CommandError(f"no round {number}") from None
        except PipelineError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"round {number} is closing again; the merge pipeline was started")
