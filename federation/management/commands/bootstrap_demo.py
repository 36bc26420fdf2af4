from django.core.management import call_command
from django.core.management.base import BaseCommand

from federation.services import reset_operator


class Command(BaseCommand):
    help = "Prepare the demo: import the tool registry and (re)issue the operator's login."

    def add_arguments(self, parser):
        parser.add_argument("--dataset", required=True, help="dataset folder or registry file")
        parser.add_argument("--url", default="http://127.0.0.1:8000/", help="where the site is served")

    def handle(self, *args, dataset, url, **options):
        call_command("import_tools", dataset, stdout=self.stdout)
        creds = reset_operator()
        line = "=" * 72
        self.stdout.write(
            f"{line}\nSYNAPSE is starting on {url}\n"
            f"  log in at {url} (the dashboard) as the federation operator\n"
            f"  username: {creds.username}\n  password: {creds.password}   (new on every start)\n"
            f"  API schema: {url}api/schema/   API docs: {url}api/docs/\n{line}"
        )
