import gc
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
application = get_wsgi_application()


def _load_everything() -> None:
    """Import now what the first request would: the URLconf and the views behind it (the
    dashboard's imports alone take seconds of CPU), so that no request waits for them. With
    `gunicorn --preload` this runs once in the master and the workers share it. Then the
    objects loaded so far are moved out of the garbage collector's reach (`gc.freeze`): they live
    as long as the process, and every full collection would otherwise walk them again (and, in
    forked workers, copy the pages holding them)."""
    from importlib import import_module

    from django.conf import settings
    from django.db import connections

    import_module(settings.ROOT_URLCONF)  # its include()s import every app's URLconf and views
    connections.close_all()  # nothing opened while loading may be shared with forked workers
    gc.collect()
    gc.freeze()


_load_everything()
