"""Signals of the federation app."""

from django.dispatch import Signal

# Sent (via transaction.on_commit) once a round was committed in state "closing".
# Keyword arguments: round=<Round>.
round_closed = Signal()
