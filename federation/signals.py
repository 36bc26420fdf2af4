"""Signals of the federation.

`round_closed(sender=Round, round=<Round>)` is sent after the transaction that moved a round to
`closing` has committed (on close and on retry). The merge pipeline connects a receiver to it.

`global_published(sender=Round, round=<Round>, version=<CompendiumVersion>)` is sent after the
transaction that published a round's global compendium has committed (also when a round is
re-materialized, and when an erasure deleted the served global so that an earlier one is served
again). The tuned router (federation.tuning) connects a receiver to it.
"""

from django.dispatch import Signal

round_closed = Signal()
global_published = Signal()
