"""How long the privacy accountant takes to read the ledger, as every budget check, the Privacy
page and each /metrics scrape do (`federation.accounting._spends`), against the number of ledger
rows: the per-release sums computed in PostgreSQL (what runs) and, for comparison, every row read
into Python and grouped there (what ran before 2026-11-29, re-implemented below).

The ledger is synthetic: ORGS organizations x ROUNDS published rounds x one release of TOOLS x
FIELDS statistics each (199 x 4 on MetaTool), every other organization under a field cap of 2. It
lives in a scratch database made for the run and dropped after it (the one `manage.py simulate`
uses), never in the federation's own. An --out it could not write is refused in one line before
the database is made.

    DEBUG=0 SECRET_KEY=bench .venv/bin/python bench/ledger_accounting.py
    ... --orgs 10 --rounds 100 --repeat 5 --out bench/results/ledger_accounting.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--orgs", type=int, default=10)
    p.add_argument("--rounds", type=int, nargs="+", default=[10, 50, 100],
                   help="ledger sizes to measure, in published rounds (cumulative)")
    p.add_argument("--tools", type=int, default=199)
    p.add_argument("--fields", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def python_grouping():
    """Every ledger row read into Python and grouped there: the accountant before 2026-11-29."""
    from federation.merge.privacy import round_spend
    from federation.models import PrivacyLedgerEntry

    groups = defaultdict(list)
    for org, rnd, release, epsilon, field_cap, tool in PrivacyLedgerEntry.objects.values_list(
        "organization_id", "round_id", "release", "epsilon", "field_cap", "tool_id"
    ).order_by():
        groups[(org, rnd, release)].append((epsilon, field_cap, tool))
    out = defaultdict(lambda: defaultdict(float))
    for (org, rnd, _), rows in groups.items():
        out[org][rnd] += round_spend([r[0] for r in rows], rows[0][1], [r[2] for r in rows])
    return out


def timed(function, repeat: int) -> tuple[list[float], object]:
    seconds, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def fill(orgs, first_round: int, last_round: int, tools: int, fields: int) -> None:
    from federation.models import Organization, PrivacyLedgerEntry, Round

    organizations = list(Organization.objects.order_by("pk"))
    rows = []
    for number in range(first_round, last_round + 1):
        rnd = Round.objects.create(number=number, state=Round.State.PUBLISHED)
        for index, org in enumerate(organizations):
            cap = 2 if index % 2 else None
            for t in range(tools):
                for f in range(fields):
                    rows.append(PrivacyLedgerEntry(
                        round=rnd, organization=org, release=0, tool_id=f"tool-{t}",
                        field=f"field_{f}", sensitivity=1.0, contributors=4,
                        epsilon=0.001 * (1 + (t + f) % 7), noise_scale=250.0, field_cap=cap,
                    ))
        if len(rows) >= 200_000:
            PrivacyLedgerEntry.objects.bulk_create(rows, batch_size=10_000)
            rows = []
    PrivacyLedgerEntry.objects.bulk_create(rows, batch_size=10_000)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from _routing_common import check_out

    check_out(args.out, "ledger_accounting")
    import django

    django.setup()
    from federation import accounting
    from federation.models import Organization, PrivacyLedgerEntry
    from federation.simulation.through_services import scratch_database

    results = []
    with scratch_database():
        for i in range(args.orgs):
            Organization.objects.create(name=f"Org {i}", slug=f"org-{i}")
        done = 0
        for rounds in sorted(args.rounds):
            fill(args.orgs, done + 1, rounds, args.tools, args.fields)
            done = rounds
            rows = PrivacyLedgerEntry.objects.count()
            database, now = timed(accounting._spends, args.repeat)
            python, before = timed(python_grouping, args.repeat)
            agree = all(
                abs(now[o][r] - before[o][r]) <= 1e-9 * max(1.0, before[o][r])
                for o in before for r in before[o]
            ) and {o: set(r) for o, r in now.items()} == {o: set(r) for o, r in before.items()}
            row = {
                "rounds": rounds, "ledger_rows": rows,
                "database_sums_s": round(statistics.median(database), 4),
                "python_grouping_s": round(statistics.median(python), 4),
                "same_figures": agree,
            }
            results.append(row)
            print(f"{rows:>9,} ledger rows ({rounds} rounds x {args.orgs} organizations): "
                  f"sums in PostgreSQL {row['database_sums_s']:.3f} s, every row grouped in "
                  f"Python {row['python_grouping_s']:.3f} s (median of {args.repeat}); "
                  f"same figures: {agree}")
    document = {
        "benchmark": "ledger_accounting",
        "command": "python bench/ledger_accounting.py " + " ".join(sys.argv[1:]),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {"orgs": args.orgs, "tools": args.tools, "fields": args.fields,
                   "repeat": args.repeat},
        "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return document


if __name__ == "__main__":
    main()
