"""What the workers keep of their own: how often each task message was delivered."""

from __future__ import annotations

from django.db import models


class TaskDelivery(models.Model):
    """The deliveries of one task message (by its Celery task id). Tasks are acknowledged late
    and requeued when their worker dies, so a task that kills every worker it runs on (one that
    runs out of memory) would be delivered forever; the count lets it give up
    (workers.deliveries). `outcome`: what a task that must not repeat its effect on a redelivery
    (the start of a round's merges, which dispatches them) did, to answer with instead."""

    task_id = models.CharField(max_length=255, unique=True)
    name = models.CharField(max_length=200)
    deliveries = models.PositiveIntegerField(default=1)
    first_at = models.DateTimeField()
    last_at = models.DateTimeField()
    outcome = models.JSONField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} {self.task_id}: {self.deliveries} deliveries"
