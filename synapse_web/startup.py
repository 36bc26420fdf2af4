"""What a process checks before it serves: the settings load, or it stops in one line."""

from __future__ import annotations

import os
import sys


def settings_or_exit(*args, **kwargs) -> None:
    """Load the settings, or stop the process with their one line (as manage.py does) when a
    variable is bad: `celery worker` and `celery beat` read the settings first while parsing
    their options, and gunicorn (gunicorn.conf.py) before it boots a worker, each of which
    printed the traceback. (Any arguments: it is also a receiver of Celery's on_configure.)"""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018  (loads the settings module)
    except ImproperlyConfigured as exc:
        sys.exit(f"synapse: {exc}")
