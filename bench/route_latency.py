"""Routing latency: the router function alone and the routing API through gunicorn, per reranker,
on the --dataset's tools (default MetaTool: 199 tools) and on a synthetic catalogue of three
variants of each (597 tools on MetaTool), plus the throughput of the batch form.

It uses its own embedded database (bench/out/route-latency-db, or --data-dir), publishes each
catalogue as a global compendium (store_compendium with embeddings), starts gunicorn on
127.0.0.1:--port (default 8306) and measures sequential requests. Query embedding is included in
every figure (the engine's cache is cleared before each timed run and every query is distinct),
except the `router_function_embedding_cached` rows, which repeat the same queries to show what the
router costs beside the query embedding. The `rate_limit_admit` row is the rate limit's own share
of a request (`routing.services.admit`, under SYNAPSE_ROUTE_RATE_LIMIT as the server runs it).

    python bench/route_latency.py [--dataset ../shared/data/metatool] [--queries 300]
        [--batch 500] [--out FILE]

A dataset it cannot read, or one `manage.py simulate` would refuse (fewer than two tools, no
query to hold out), is refused in one line before the database starts.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _routing_common import (
    METATOOL,
    ROOT,
    cached_embed,
    check_out,
    print_table,
    read_dataset,
    write_json,
)

SCENARIOS_PER_TOOL = 8
# The bench's one token routes far more than a caller's default allowance a minute; the limit
# stays on (its counter's upsert is part of every request's latency), out of reach.
BENCH_RATE_LIMIT = "1000000000"
VARIANT_PLACES = ("for my team", "on my phone", "for a client")
# Of each tool's queries: held out (the timed queries), and in the probe split (unused here).
TEST_FRACTION, PROBE_FRACTION = 0.2, 0.1


def _setup_django(data_dir: Path) -> None:
    os.environ["SYNAPSE_DATA_DIR"] = str(data_dir)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def dataset_problem(dataset, seed: int) -> str | None:
    """Why `dataset` cannot be timed (None: it can), as `manage.py simulate` refuses it
    (`federation_problem`, for the split `catalogues` makes): fewer than two tools, no query to
    hold out. One organization of one client: nothing is dealt."""
    from federation.simulation.data import federation_problem

    return federation_problem(
        dataset, [seed], orgs=1, clients_per_org=1, partition="iid",
        probe_fraction=PROBE_FRACTION, test_fraction=TEST_FRACTION,
    )


def catalogues(dataset, seed: int):
    """(name, tools, compendium, held-out queries) for the dataset (named after it) and its
    synthetic 3x expansion."""
    from compendium.registry import stratified_split
    from compendium.schema import ToolSpec
    from routing.datasets import compendium_from_queries

    split = stratified_split(
        dataset.queries, seed=seed, probe_fraction=PROBE_FRACTION, test_fraction=TEST_FRACTION
    )
    base = compendium_from_queries(dataset.tools, split.train, SCENARIOS_PER_TOOL)
    # In a seeded order: the split holds them tool by tool, and a row times the first --queries.
    test = [q.query for q in split.test]
    random.Random(seed).shuffle(test)
    yield dataset.name, dataset.tools, base, test

    # Synthetic: every dataset tool becomes three tools; each keeps a share of the tool's train
    # queries (up to 8), phrased for its own setting, so the catalogue is 3x larger and denser.
    from compendium.registry import LabelledQuery

    tools, train = [], []
    by_tool: dict[str, list[str]] = {}
    for q in split.train:
        by_tool.setdefault(q.tool_id, []).append(q.query)
    for tool in dataset.tools:
        for v, place in enumerate(VARIANT_PLACES):
            tool_id = f"{tool.tool_id}.v{v}"
            tools.append(
                ToolSpec(
                    tool_id=tool_id,
                    name=f"{tool.name} ({place})",
                    description=f"{tool.description} Variant {place}.",
                    category=tool.category,
                )
            )
            for text in by_tool.get(tool.tool_id, [])[v::3][: SCENARIOS_PER_TOOL * 2]:
                train.append(LabelledQuery(query=f"{text} {place}", tool_id=tool_id))
    synthetic = compendium_from_queries(tools, train, SCENARIOS_PER_TOOL)
    yield "synthetic", tools, synthetic, [f"{q} {VARIANT_PLACES[i % 3]}" for i, q in enumerate(test)]


def percentiles(values_ms: list[float]) -> dict:
    a = np.asarray(values_ms)
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p95_ms": round(float(np.percentile(a, 95)), 2),
        "p99_ms": round(float(np.percentile(a, 99)), 2),
    }


def publish(tools, compendium, vectors, head: bytes | None):
    from compendium.services import import_registry, store_compendium
    from federation.models import Round

    import_registry(tools)
    number = (Round.objects.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    round_ = Round.objects.create(number=number, state="published")
    store_compendium(
        compendium, kind="global", round=round_, scenario_embeddings=vectors, routing_head=head
    )
    return number


def start_gunicorn(port: int, data_dir: Path, workers: int) -> subprocess.Popen:
    env = dict(
        os.environ,
        SYNAPSE_DATA_DIR=str(data_dir),
        DEBUG="0",
        SECRET_KEY="route-latency-bench",
        ALLOWED_HOSTS="127.0.0.1",
        HF_HUB_OFFLINE="1",
        SYNAPSE_ROUTE_RATE_LIMIT=os.environ.get("SYNAPSE_ROUTE_RATE_LIMIT", BENCH_RATE_LIMIT),
    )
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn", "synapse_web.wsgi:application",
            "-b", f"127.0.0.1:{port}", "-w", str(workers), "--timeout", "300",
            "--log-level", "warning",
        ],
        cwd=ROOT,
        env=env,
    )
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"gunicorn exited with {proc.returncode}")
    proc.terminate()
    raise SystemExit("gunicorn did not answer /healthz within 120 s")


def warm_up(http, url: str, reranker: str, round_number: int, workers: int,
            within_s: float = 120.0) -> None:
    """Route until the server answers from `round_number`'s global, 4 answers a worker in a row:
    each worker goes on with the global it serves until its cached version expires
    (SYNAPSE_ROUTING_VERSION_TTL) and builds its router once. Stops the script with one line
    when the server still answers from another round `within_s` seconds on."""
    deadline = time.monotonic() + within_s
    in_a_row, sent = 0, 0
    while in_a_row < 4 * workers:
        r = http.post(f"{url}/route/", json={"query": f"warm up {sent}", "reranker": reranker})
        sent += 1
        r.raise_for_status()
        served = r.json()["compendium_round"]
        if served == round_number:
            in_a_row += 1
            continue
        in_a_row = 0
        if time.monotonic() > deadline:
            raise SystemExit(
                f"route_latency: the server still routes with round {served}'s global "
                f"{within_s:.0f} s after round {round_number} was published"
            )
        time.sleep(0.1)


def time_admit(requests: int) -> dict:
    """What the rate limit adds to a routing request: `routing.services.admit` as the API calls it
    (one upsert of the caller's counter for the minute, in the bench's database), under the limit
    the server runs with (0: off, nothing to count)."""
    from django.test import override_settings

    from routing.services import admit

    limit = int(os.environ.get("SYNAPSE_ROUTE_RATE_LIMIT", BENCH_RATE_LIMIT))
    timings = []
    with override_settings(SYNAPSE_ROUTE_RATE_LIMIT=limit):
        for _ in range(requests):
            started = time.perf_counter()
            admit("route-latency-bench:admit", 1)
            timings.append((time.perf_counter() - started) * 1000)
    return {"catalogue": "-", "target": "rate_limit_admit", "rate_limit": limit,
            "requests": requests, **percentiles(timings)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(METATOOL))
    parser.add_argument("--queries", type=int, default=300, help="timed queries per row")
    parser.add_argument("--batch", type=int, default=500, help="queries per batch request")
    parser.add_argument("--port", type=int, default=8306)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=str(ROOT / "bench" / "out" / "route-latency-db"))
    parser.add_argument("--keep-db", action="store_true", help="leave the bench database running")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    check_out(args.out, "route_latency")
    dataset = read_dataset(args.dataset, "route_latency")
    problem = dataset_problem(dataset, args.seed)
    if problem:
        raise SystemExit(f"route_latency: {problem}")

    data_dir = Path(args.data_dir).resolve()
    _setup_django(data_dir)
    import httpx

    from routing.embeddings import get_engine, get_query_engine
    from routing.models import RoutingToken
    from routing.router import Router, RoutingParams, fit_linear_head

    engine = get_query_engine()
    params = RoutingParams.load()
    RoutingToken.objects.filter(name="route-latency-bench").delete()
    _, token = RoutingToken.issue("route-latency-bench")
    headers = {"Authorization": f"Bearer {token}"}
    server = start_gunicorn(args.port, data_dir, args.workers)
    url = f"http://127.0.0.1:{args.port}/api/v1"
    rows = []
    try:
        for name, tools, compendium, test in catalogues(dataset, args.seed):
            # As in the product: scenarios from the merge's engine, queries from the query engine.
            vectors = cached_embed(get_engine(), [s.text for s in compendium.scenarios])
            # ... and the linear head fitted as publication fits it.
            head = fit_linear_head(compendium, vectors, get_engine().embed)
            round_number = publish(tools, compendium, vectors, head.to_bytes())
            n_tools = len({s.tool_id for s in compendium.scenarios})
            print(
                f"{name}: {n_tools} tools, {len(compendium.scenarios)} scenarios, "
                f"published as round {round_number}",
                flush=True,
            )
            queries = test[: args.queries]
            common = {"catalogue": name, "tools": n_tools, "scenarios": len(compendium.scenarios)}
            base = Router(
                compendium, engine, "fusion", params=params, scenario_embeddings=vectors, head=head
            )
            with httpx.Client(timeout=120, headers=headers) as http:
                for reranker in ("none", "fusion"):
                    router = base.with_reranker(reranker)
                    engine._cache.clear()
                    timings = []
                    for q in queries:
                        started = time.perf_counter()
                        router.route(q)
                        timings.append((time.perf_counter() - started) * 1000)
                    rows.append({**common, "target": "router_function", "reranker": reranker,
                                 "requests": len(queries), **percentiles(timings)})
                    # Where the time goes: the same queries again, embeddings now cached.
                    timings = []
                    for q in queries:
                        started = time.perf_counter()
                        router.route(q)
                        timings.append((time.perf_counter() - started) * 1000)
                    rows.append({**common, "target": "router_function_embedding_cached",
                                 "reranker": reranker, "requests": len(queries), **percentiles(timings)})
                    # Warm the workers on this version (each builds its router once).
                    warm_up(http, url, reranker, round_number, args.workers)
                    timings = []
                    for i, q in enumerate(queries):
                        body = {"query": f"{q} ({reranker} {i})", "reranker": reranker}
                        started = time.perf_counter()
                        r = http.post(f"{url}/route/", json=body)
                        timings.append((time.perf_counter() - started) * 1000)
                        r.raise_for_status()
                    rows.append({**common, "target": "api", "reranker": reranker,
                                 "requests": len(queries), **percentiles(timings)})
                    print_table(rows[-3:], ["catalogue", "target", "reranker", "p50_ms", "p95_ms", "p99_ms"])
                for reranker in ("none", "fusion"):
                    batch = [f"{test[i % len(test)]} [batch {reranker} {i}]" for i in range(args.batch)]
                    engine._cache.clear()
                    started = time.perf_counter()
                    base.with_reranker(reranker).route_batch(batch)
                    elapsed = time.perf_counter() - started
                    rows.append({**common, "target": "router_function_batch", "reranker": reranker,
                                 "requests": 1, "batch_size": len(batch),
                                 "queries_per_s": round(len(batch) / elapsed, 1)})
                    rates = []
                    for rep in range(3):
                        batch = [f"{q} #{rep}" for q in batch]
                        started = time.perf_counter()
                        r = http.post(f"{url}/route/batch/", json={"queries": batch, "reranker": reranker})
                        elapsed = time.perf_counter() - started
                        r.raise_for_status()
                        rates.append(len(batch) / elapsed)
                    rows.append({**common, "target": "api_batch", "reranker": reranker,
                                 "requests": 3, "batch_size": len(batch),
                                 "queries_per_s": round(float(np.median(rates)), 1)})
                    print_table(rows[-2:], ["catalogue", "target", "reranker", "batch_size", "queries_per_s"])
        # Last, with the workers idle (they build their routers in the background as they start).
        rows.insert(0, time_admit(args.queries))
        print_table(rows[:1], ["target", "rate_limit", "p50_ms", "p95_ms", "p99_ms"])
    finally:
        server.terminate()
        server.wait(timeout=30)
        from django.db import connections

        from synapse_web.embedded_db import stop_embedded_database

        connections.close_all()
        if not args.keep_db:
            stop_embedded_database(data_dir / "pgdata")
    print()
    print_table(
        rows,
        ["catalogue", "tools", "target", "reranker", "p50_ms", "p95_ms", "p99_ms", "batch_size",
         "queries_per_s", "rate_limit"],
    )
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
