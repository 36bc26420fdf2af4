"""The Celery app. Without CELERY_BROKER_URL, tasks run eagerly in the calling process."""

import os
import sys

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def settings_or_exit(*args, **kwargs) -> None:
    """Load the settings, or stop the process with their one line (as manage.py does) when a
    variable is bad: `celery worker` and `celery beat` read the settings first while parsing
    their options, and gunicorn (gunicorn.conf.py) before it boots a worker, each of which
    printed the traceback."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018  (loads the settings module)
    except ImproperlyConfigured as exc:
        sys.exit(f"synapse: {exc}")


app = Celery("synapse")
# Sent just before the app reads the settings, the first time anything asks for its conf.
app.on_configure.connect(settings_or_exit, weak=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
if not os.environ.get("CELERY_BROKER_URL"):
    # No broker configured: eager mode needs no transport, keep Celery from dialing AMQP.
    app.conf.broker_url = "memory://localhost/"  # a host named: kombu warns of none
    app.conf.result_backend = "cache+memory://"
app.autodiscover_tasks()
