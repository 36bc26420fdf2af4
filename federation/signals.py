"""Signals of the federation.

`round_closed(sender=Round, round=<Round>)` is sent after the transaction that moved a round to
`closing` has committed (on close and on retry). The merge pipeline connects a receiver to it.
"""

from django.dispatch import Signal

round_closed = Signal()
