"""The Celery app. Without CELERY_BROKER_URL, tasks run eagerly in the calling process."""

import os

from celery import Celery

from synapse_web.startup import settings_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")

app = Celery("synapse")
# Sent just before the app reads the settings, the first time anything asks for its conf.
app.on_configure.connect(settings_or_exit, weak=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
if not os.environ.get("CELERY_BROKER_URL"):
    # No broker configured: eager mode needs no transport, keep Celery from dialing AMQP.
    app.conf.broker_url = "memory://localhost/"  # a host named: kombu warns of none
    app.conf.result_backend = "cache+memory://"
app.autodiscover_tasks()
