"""Server CPU of one accepted submission, measured in-process (no HTTP server, no load generator).

Sets up its own organization, clients and (if none is open) a round through the ORM, as
`bench/submit_load.py` does, builds the same MetaTool compendiums, then posts them through Django's
test client (the whole middleware, authentication, view and service stack) and reports the
process CPU (`time.process_time()`) per accepted submission and the SQL queries per request.
The database server's own CPU is not counted: it runs in another process.

    DEBUG=0 SECRET_KEY=bench .venv/bin/python bench/submit_cpu.py                      # ~7 KB
    DEBUG=0 SECRET_KEY=bench .venv/bin/python bench/submit_cpu.py --tools-per-client 40 \
        --scenarios-per-tool 3                                                         # ~30 KB
    ... --profile 25        # the 25 most expensive functions (cumulative) under cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")

from _routing_common import read_dataset, refuse_counts_below  # noqa: E402
from submit_load import DEFAULT_DATASET, build_compendiums, setup_federation  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3, help="submissions per client (new keys)")
    p.add_argument("--tools-per-client", type=int, default=12)
    p.add_argument("--scenarios-per-tool", type=int, default=2)
    p.add_argument("--dataset", default=str(DEFAULT_DATASET))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, help="print the N top functions by cumtime")
    p.add_argument("--sort", default="cumulative")
    args = p.parse_args(argv)
    # before anything runs: it warms up on two clients (an IndexError after the federation was
    # set up, with fewer), and random.sample refuses a negative count there
    refuse_counts_below(p, ("--clients", args.clients, 2), ("--rounds", args.rounds, 1),
                        ("--tools-per-client", args.tools_per_client, 1),
                        ("--scenarios-per-tool", args.scenarios_per_tool, 0),
                        ("--profile", args.profile, 0))
    return args


def main(argv=None):
    args = parse_args(argv)
    dataset = read_dataset(args.dataset, "submit_cpu")  # before the federation is set up
    _, _org, clients, rnd = setup_federation(args.clients, dataset.tools, args.rounds + 2)
    docs = build_compendiums(
        dataset, args.clients, args.tools_per_client, args.scenarios_per_tool, args.seed,
        not_released=frozenset(rnd.fields_not_released),
    )
    from django.db import connection
    from django.test import Client as HttpClient

    @contextmanager
    def captured_sql():
        """The SQL run inside the block. (Django's CaptureQueriesContext reads queries_log, which
        the test client's request_started signal resets mid-block.)"""
        statements: list[str] = []

        def record(execute, sql, params, many, context):
            statements.append(sql)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            yield statements

    http = HttpClient()

    def post(index, token, key):
        return http.post(
            "/api/v1/submissions/",
            data=docs[index],
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
            HTTP_IDEMPOTENCY_KEY=key,
        )

    # Warm-up (imports, schema and settings caches, connection), then the query counts of a
    # first, a replayed and a replacing submission, all outside the timing.
    (_, token0), (_, token1) = clients[0], clients[1]
    r = post(0, token0, "warm-0")
    assert r.status_code == 201, r.content[:300]
    with captured_sql() as first:
        r = post(1, token1, "warm-0")
    assert r.status_code == 201, r.content[:300]
    with captured_sql() as replay:
        r = post(1, token1, "warm-0")
    assert r.status_code == 201 and r["Idempotent-Replayed"] == "true"
    with captured_sql() as replacing:
        r = post(0, token0, "warm-1")
    assert r.status_code == 201 and r.json()["replaced"]

    profiler = cProfile.Profile(time.process_time) if args.profile else None
    cpu, accepted = {"first": [], "replacing": []}, 0
    for s in range(args.rounds):
        for index, (_pk, token) in enumerate(clients):
            if index < 2:
                continue
            key = f"cpu-{s}"
            if profiler:
                profiler.enable()
            t0 = time.process_time()
            r = post(index, token, key)
            cpu["replacing" if s else "first"].append(time.process_time() - t0)
            if profiler:
                profiler.disable()
            assert r.status_code == 201, r.content[:300]
            accepted += 1
    mean_kb = statistics.mean(len(d) for d in docs) / 1024
    print(f"round {rnd.number}; body {mean_kb:.1f} KB on average; {accepted} accepted submissions")
    for name, values in [("all", cpu["first"] + cpu["replacing"]), *cpu.items()]:
        if values:
            print(
                f"process CPU per accepted submission ({name}, n={len(values)}): "
                f"mean {statistics.mean(values) * 1000:.2f} ms, "
                f"median {statistics.median(values) * 1000:.2f} ms"
            )
    print(
        f"SQL queries: first submission {len(first)}, replacing submission {len(replacing)}, "
        f"replay {len(replay)}"
    )
    if os.environ.get("SHOW_SQL"):
        for label, captured in (("first", first), ("replacing", replacing)):
            print(f"  {label}:")
            for sql in captured:
                print("   ", " ".join(sql.split())[:150])
    if profiler:
        stats = pstats.Stats(profiler)
        stats.sort_stats(args.sort).print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
