import math
import time

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection

from federation.services import close_due_rounds, pipeline_outcome

MAX_EVERY = 86_400.0  # a day: rounds' deadlines are checked at least that often
MIN_EVERY = 1.0  # a second: a shorter loop only queries the database without pause


class Command(BaseCommand):
    help = (
        "Close the open round whose deadline has come (its merge pipeline starts). Once, for "
        "cron, or with --every N in a loop; docker-compose's Celery beat does the same."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--every", type=float, default=0,
            help="check every N seconds (1 to 86400) until interrupted (default 0: check once)"
        )

    def handle(self, *args, every, **options):
        if not math.isfinite(every) or every < 0 or every > MAX_EVERY or 0 < every < MIN_EVERY:
            # a negative interval was read as "once", silently; one past what time.sleep takes
            # failed with an OverflowError after the first check; --every 0.001 queried the
            # database a thousand times a second
            raise CommandError(
                f"--every must be 0 (check once) or a number of seconds from {MIN_EVERY:g} to "
                f"{MAX_EVERY:g}, not {every:g}"
            )
        while True:
            try:
                self._check()
            except DatabaseError as exc:
                if every <= 0:
                    raise
                # The loop runs unattended: a database restarted or out of reach for a moment
                # ended it with a traceback, and no round closed at its deadline after that.
                self.stderr.write(
                    f"close_due_rounds: the check failed ({' '.join(str(exc).split())}); "
                    f"checking again in {every:g} s"
                )
                connection.close_if_unusable_or_obsolete()  # the next check connects again
            if every <= 0:
                return
            try:
                time.sleep(every)
            except KeyboardInterrupt:  # Ctrl-C, the way to end the loop: between two checks
                return

    def _check(self) -> None:
        for rnd in close_due_rounds():
            # Without a broker the pipeline has run by now: said as it ended (retry_round too).
            self.stdout.write(
                f"round {rnd.number} closed at its deadline ({rnd.closes_at:%Y-%m-%d %H:%M} "
                f"UTC); {pipeline_outcome(rnd)}"
            )
