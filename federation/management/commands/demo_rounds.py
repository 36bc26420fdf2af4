import sys

from django.core.management.base import BaseCommand, CommandError
from pydantic import ValidationError

from compendium.registry import RegistryFormatError
from federation.demo import DEMO_QUERIES_PER_CLIENT, DemoError, run_demo_rounds
from federation.errors import FederationError
from federation.services import demo_round_config
from routing.embeddings import EmbeddingModelUnavailable


class Command(BaseCommand):
    help = (
        "Play live demo rounds: the demo federation's clients build and submit real compendiums, "
        "the merge pipeline publishes them, until that many rounds are published (a stopped demo resumes)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dataset", required=True)
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument("--queries-per-client", type=int, default=DEMO_QUERIES_PER_CLIENT,
                            help="each demo client's share of the dataset's requests "
                                 "(default %(default)s)")
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, *args, dataset, rounds, queries_per_client, seed, **options):
        def progress(message: str) -> None:
            print(f"demo: {message}", file=sys.stderr, flush=True)

        for flag, value in (("--rounds", rounds), ("--queries-per-client", queries_per_client)):
            if value < 1:
                raise CommandError(f"{flag} must be at least 1, not {value}")
        try:
            # The seed of every round the demo opens: refused before anything is imported.
            demo_round_config(seed)
        except ValidationError as exc:
            raise CommandError(f"--seed {seed}: {exc.errors()[0]['msg']}") from None
        try:
            report = run_demo_rounds(
                dataset, rounds=rounds, queries_per_client=queries_per_client, seed=seed,
                progress=progress,
            )
        except (DemoError, RegistryFormatError, EmbeddingModelUnavailable) as exc:
            raise CommandError(str(exc)) from None
        except FederationError as exc:  # a round refused (over the privacy budget, say)
            raise CommandError(f"demo rounds stopped: {exc.detail}") from None
        if report.skipped:
            self.stdout.write(f"demo rounds: {rounds} rounds are already published; nothing to do")
        else:
            published = ", ".join(map(str, report.rounds_published))
            self.stdout.write(
                f"demo rounds: published rounds {published} from {report.submissions} submissions; "
                f"{report.conflicts} conflict(s) logged for review; a new round is open"
            )
