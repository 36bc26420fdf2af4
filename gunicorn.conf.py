"""Gunicorn settings, read from the working directory by `make demo` and the Docker image.

Each worker builds its router in the background as soon as it starts (`routing.services.warm_up`),
so that the first routing request it serves is not the one that loads the embedding model and the
published global (about 4 seconds on 2 cores); a request that comes before it is done waits for
the same build.
"""

import os
import threading

# Each routing request's query vector is cached by its text: at the engine's default (200,000
# texts, about 360 MB per worker) distinct queries would fill every worker's memory.
os.environ.setdefault("SYNAPSE_EMBEDDING_CACHE_ENTRIES", "10000")

# A bad setting stops gunicorn here, in one line: in a worker it was a traceback from each one.
# (Not from synapse_web.celery: that would build the Celery app in gunicorn's master.)
from synapse_web.startup import settings_or_exit  # noqa: E402

settings_or_exit()

# One line per request on stdout (the container's log), as `make demo` serves: without it the
# image's and docker-compose's gunicorn logged no request at all, not even a 500's path. No URL
# of the site carries a token or password (they travel in headers and bodies).
accesslog = "-"


def post_worker_init(worker):
    from federation.caches import start_watcher, warm_up

    # A worker that serves nothing still forgets an erased client's texts (federation.caches).
    start_watcher()
    threading.Thread(target=warm_up, name="synapse-router-warm-up", daemon=True).start()
