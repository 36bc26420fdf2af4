import json

from django.core.management.base import BaseCommand

from federation.accounting import privacy_report


class Command(BaseCommand):
    help = "Composed privacy spend (basic and advanced, the tighter reported) and the budget."

    def handle(self, *args, **options):
        self.stdout.write(json.dumps(privacy_report().as_dict(), indent=2, allow_nan=False))
