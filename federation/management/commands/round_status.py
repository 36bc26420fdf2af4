from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count, Q

from federation.models import Client, Round
from federation.services import (
    MAX_ROUND_NUMBER,
    published_after,
    retry_budget_refusal,
    submissions_to_merge,
)

# The rounds whose merge has yet to read their submissions.
UNREAD = (Round.State.OPEN, Round.State.CLOSING, Round.State.FAILED)


class Command(BaseCommand):
    help = "Where the federation's rounds stand: the latest rounds with their state and submissions."

    def add_arguments(self, parser):
        parser.add_argument("--last", type=int, default=5, help="how many of the latest rounds")

    def handle(self, *args, last, **options):
        if last < 1:
            raise CommandError(f"--last must be 1 or more, not {last}")
        last = min(last, MAX_ROUND_NUMBER)  # no federation has more; a larger LIMIT is a DataError
        rounds = list(
            Round.objects.annotate(
                n=Count("submissions__client", distinct=True),
                revoked=Count("submissions__client", distinct=True,
                              filter=Q(submissions__client__status=Client.Status.REVOKED)),
            ).order_by("-number")[:last]
        )
        if not rounds:
            self.stdout.write("no round yet: the operator opens round 1 on the dashboard's Overview")
            return
        for rnd in rounds:
            # a retried round's merge runs since the retry, not since the close
            when = rnd.published_at or rnd.attempt_started_at or rnd.closed_at or rnd.opened_at
            verb = {"open": "opened", "published": "published"}.get(rnd.state, "since")
            line = (
                f"round {rnd.number}: {rnd.state} ({verb} {when:%Y-%m-%d %H:%M} UTC), "
                f"submissions from {rnd.n} client{'s' if rnd.n != 1 else ''}"
            )
            if rnd.revoked and rnd.state in UNREAD:
                # its merge, still to come, reads none of theirs (`submissions_to_merge`)
                line += f" ({rnd.revoked} revoked since, not merged)"
            if rnd.attempt > 1:
                line += f", merge run {rnd.attempt}"
            if rnd.state == Round.State.FAILED:
                line += f"; failed: {rnd.failure_reason} ({_retry(rnd)})"
            self.stdout.write(line)


def _retry(rnd: Round) -> str:
    """What the operator can do with a failed round: it named `retry_round` for rounds that
    retry_round refuses (a later round published, nothing to merge, or its reservation past the
    privacy budget)."""
    later = published_after(rnd)
    if later is not None:
        return (f"round {later} is published after it, so it cannot be retried: globals are "
                "published in round order")
    if not submissions_to_merge(round=rnd).exists():
        return "it has no submission to merge, so it cannot be retried: open the next round instead"
    refusal = retry_budget_refusal(rnd)
    if refusal:
        return f"the privacy budget refuses its retry now: {refusal}"
    return f"manage.py retry_round {rnd.number} runs it again"
