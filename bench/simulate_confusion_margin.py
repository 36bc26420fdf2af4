"""Diagnostic: `manage.py simulate` with the merge's tool-confusion check at another margin.

The merge operator (`federation.merge.operator`) drops a submitted scenario whose text is closer
to another tool's profile than to its own tool's by more than a margin (its own tool not the
nearest): `CONFUSION_MARGIN` (0.2), raised with the probe set so that at most
`CONFUSION_HONEST_RATE` (10%) of the probe's honest requests would be flagged. `simulate` has no
flag for either; this wrapper runs `simulate` with the simulation's `edge_merge` and
`server_merge` (so SYNAPSE and the Centralized baseline alike; the rounds are played
`--in-memory`, since the pipeline's merges would not see these settings) given
`--confusion-margin M` (the
floor; above 2 the check is off, cosine gaps are at most 2) and, with `--honest-rate R`, that
rate (1 keeps the margin at its floor: the fixed margin of earlier versions). With
`--source-limit L` the implausible-source check uses that limit instead of `SOURCE_LIMIT` (above
1 it is off: percentiles are at most 1), to measure the other defences without it. The settings
and this command are recorded in the `--out` JSON.

    python bench/simulate_confusion_margin.py --confusion-margin 9 --dataset bench/datasets/cheat \\
        [any other simulate arguments] --out FILE --no-store
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from _routing_common import record_wrapper  # also puts the repository on sys.path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--confusion-margin", type=float, default=None)
    parser.add_argument("--source-limit", type=float, default=None)
    parser.add_argument("--honest-rate", type=float, default=None)
    parser.add_argument("--out", default=None)
    args, rest = parser.parse_known_args(argv)

    import django

    django.setup()
    from django.core.management import call_command

    import federation.merge.operator as operator
    import federation.simulation.runner as runner

    if args.honest_rate is not None:
        if not 0 < args.honest_rate <= 1:
            parser.error("--honest-rate must be in (0, 1]")
        operator.CONFUSION_HONEST_RATE = args.honest_rate
    if args.confusion_margin is None and args.source_limit is None:
        parser.error("give --confusion-margin, --source-limit or both")
    checks = {}
    if args.confusion_margin is not None:
        checks["confusion_margin"] = args.confusion_margin
    if args.source_limit is not None:
        checks["source_limit"] = args.source_limit
    runner.edge_merge = functools.partial(runner.edge_merge, **checks)
    runner.server_merge = functools.partial(runner.server_merge, **checks)
    # The settings reach the simulation's merges, called in memory: the pipeline's own (through
    # the services) would not see them.
    in_memory = [] if "--in-memory" in rest else ["--in-memory"]
    call_command("simulate", *rest, *in_memory, *(["--out", args.out] if args.out else []))
    record_wrapper(
        args.out, "simulate_confusion_margin.py", argv,
        confusion_margin=args.confusion_margin if args.confusion_margin is not None
        else operator.CONFUSION_MARGIN,
        source_limit=args.source_limit if args.source_limit is not None else operator.SOURCE_LIMIT,
        confusion_honest_rate=(
            args.honest_rate if args.honest_rate is not None else operator.CONFUSION_HONEST_RATE
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
