from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from compendium.models import CompendiumVersion, Tool
from compendium.registry import RegistryFormatError, load_registry
from federation.errors import FederationError
from federation.services import bootstrap_demo_federation


class Command(BaseCommand):
    help = (
        "Prepare the demo: import the tool registry, (re)issue the operator's login, and create "
        "a demo federation (organizations with admin logins, approved clients, round 1)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dataset", required=True, help="dataset folder or registry file")
        parser.add_argument("--url", default="http://127.0.0.1:8000/", help="where the site is served")

    def handle(self, *args, dataset, url, **options):
        url = url.rstrip("/") + "/"  # the banner appends the pages' paths to it
        refuse_another_datasets_demo(dataset)
        call_command("import_tools", dataset, stdout=self.stdout)
        try:
            demo = bootstrap_demo_federation()
        except FederationError as exc:  # nothing was changed: the logins before still work
            raise CommandError(f"the demo federation was not set up: {exc.detail}") from None
        creds = demo.operator
        line = "=" * 72
        # A login the demo left as it found it (deactivated, demoted, moved) has no password: why.
        admins = "\n".join(
            f"    {slug:<10} username: {c.username:<18} "
            + (f"password: {c.password}" if c.password else c.withheld)
            for slug, c in demo.admins
        )
        clients = "\n".join(
            f"    {slug + '/' + name:<24} token: {token}" for slug, name, token in demo.clients
        )
        if demo.round is None:
            round_line = "no round"
        else:
            opened = " (opened now)" if demo.opened_round else ""
            round_line = f"round {demo.round.number} is {demo.round.state}{opened}"
        # On stderr: the banner (stdout) is shown again later, when the round has moved on.
        self.stderr.write(f"bootstrap_demo: {round_line}")
        self.stdout.write(
            f"{line}\nSYNAPSE is starting on {url}\n"
            f"  log in at {url} (the dashboard) as the federation operator\n"
            f"  username: {creds.username}\n  password: {creds.password}   (new on every start)\n"
            f"  organization admins (new passwords on every start), log in at {url} too "
            f"(their organization's clients, conflicts and figures)\n{admins}\n"
            f"  client API tokens (shown once, new on every start; only hashes are stored):\n"
            f"{clients}\n"
            f"  API: {url}api/v1/rounds/   schema: {url}api/schema/   docs: {url}api/docs/\n"
            f"{line}"
        )


def refuse_another_datasets_demo(dataset: str) -> None:
    """A data folder that has played rounds (a compendium is stored) on another registry is not this dataset's demo: its
    rounds, tuned router and simulation are found and not played again (`demo_rounds`,
    `simulate`), so the new dataset's tools were only added beside the others and the pages
    showed the first dataset's federation. Refused, naming the folder to use instead."""
    try:
        named = {tool.tool_id for tool in load_registry(dataset)}
    except RegistryFormatError:
        return  # import_tools says what is wrong with it
    others = Tool.objects.filter(active=True).exclude(tool_id__in=named)
    if named and others.exists() and CompendiumVersion.objects.exists():
        raise CommandError(
            f"this data folder played the demo on another registry ({others.count()} active "
            f"tools are not in {dataset}, e.g. {others.order_by('tool_id').first().tool_id!r}); "
            "its rounds would be found and not played again on this one: run this dataset's demo "
            "in a data folder of its own (make demo DATASET=... SYNAPSE_DATA_DIR=.data/NAME)"
        )
