from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from federation.tuning import TuningError, tune_epochs, tune_published_router
from routing.services import published_global_version


class Command(BaseCommand):
    help = (
        "Fine-tune the routing encoder on the published global compendium now (federation.tuning); "
        "the routing API routes with it once it is ready."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--epochs", type=int, default=None,
            help="epochs of fine-tuning (default: SYNAPSE_ROUTER_TUNE_EPOCHS, or 1 when it is 0)",
        )
        parser.add_argument("--force", action="store_true", help="tune again when already ready")

    def handle(self, *args, epochs, force, **options):
        version = published_global_version()
        if version is None:
            raise CommandError("no global compendium is published yet: nothing to tune")
        epochs = epochs if epochs is not None else (tune_epochs() or 1)
        started = timezone.now()
        try:
            record = tune_published_router(version.pk, epochs, force=force)
        except TuningError as exc:
            raise CommandError(str(exc)) from None
        if record is None:
            raise CommandError(
                f"round {version.round.number}: its global compendium was replaced "
                "(re-materialized) before it could be tuned; run tune_router again to tune the "
                "one published now"
            )
        if record.state != record.State.READY:
            raise CommandError(f"round {version.round.number}: tuning {record.state}: {record.detail}")
        figures = (
            f"{record.rows} texts, {record.epochs} epoch(s) on "
            f"{record.device or 'an unrecorded device'}, {record.seconds:.0f} s; probe top-1 "
            f"(held half) {_pct(record.probe_accuracy)} tuned, "
            f"{_pct(record.frozen_probe_accuracy)} frozen"
        )
        if record.finished_at is not None and record.finished_at < started:
            if force:
                # A forced retune that failed leaves the row ready (the router tuned before is
                # still served), its detail saying why: not "already tuned", and not exit 0.
                raise CommandError(
                    f"round {version.round.number}: "
                    f"{record.detail or 'the router was not tuned again'}"
                )
            # Ready before this call (a restarted `make demo`): nothing was tuned now.
            self.stdout.write(
                f"round {version.round.number}: routing encoder already tuned at "
                f"{record.finished_at:%Y-%m-%d %H:%M} UTC ({figures}); in {record.directory}; "
                "--force tunes it again"
            )
            return
        self.stdout.write(
            f"round {version.round.number}: routing encoder tuned on {figures}; "
            f"saved in {record.directory}"
        )


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"
