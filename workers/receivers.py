"""Connects federation signals to the Celery pipeline (workers depend on federation, not the
other way round)."""

from __future__ import annotations

from django.dispatch import receiver

from federation.signals import round_closed


@receiver(round_closed, dispatch_uid="synapse.start_round_pipeline")
def start_pipeline_on_close(sender, round, **kwargs):
    from workers.tasks import start_round_pipeline

    return start_round_pipeline.delay(round.pk)
