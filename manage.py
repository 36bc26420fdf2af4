#!/usr/bin/env python
"""Django's command-line utility for SYNAPSE."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # Configuration problems (no pgvector, missing secret...) are one line, not a traceback.
        print(f"synapse: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
