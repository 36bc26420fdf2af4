"""Load test of `POST /api/v1/submissions/` against a running server.

Sets up its own organization, N approved clients with tokens and (if none is open) a round, through
the Django ORM of this checkout (so run it from the repository root, on the server's database);
builds one MetaTool-sized compendium per client from real MetaTool queries; then every client
submits its compendium (each key sent `--duplicates` times, as a client retrying would) and the
figures are printed: requests/s, accepted submissions/s, p50/p95/p99 latency, errors. Finally the
database is checked: exactly one Submission row per accepted key, one current compendium per
client, each equal to the client's last accepted submission (0 lost, 0 duplicated).

    python bench/submit_load.py --url http://127.0.0.1:8301 --clients 200 --out bench/out/submit.json

`--rate R` paces the clients to R requests/s in all (open loop); without it every client fires
at once (a burst) and the latency includes the time spent queueing behind the others.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
sys.path.insert(0, str(ROOT / "bench"))
from _routing_common import METATOOL as DEFAULT_DATASET  # noqa: E402
from _routing_common import check_out, read_dataset, refuse_counts_below  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8301", help="base URL of the running server")
    p.add_argument("--clients", type=int, default=200, help="simulated clients (default 200)")
    p.add_argument("--submissions", type=int, default=1, help="distinct keys per client")
    p.add_argument("--duplicates", type=int, default=2, help="times each key is sent (retries)")
    p.add_argument("--rate", type=float, default=0.0, help="total requests/s; 0 = all at once")
    p.add_argument("--tools-per-client", type=int, default=12)
    p.add_argument("--scenarios-per-tool", type=int, default=2)
    p.add_argument("--dataset", default=str(DEFAULT_DATASET))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--gzip", action="store_true",
        help="send the bodies gzip-encoded (Content-Encoding: gzip), as synapse-client submit does",
    )
    p.add_argument("--out", help="write the figures as JSON rows to this file")
    p.add_argument(
        "--server-pid",
        type=int,
        help="the server's master process (default: the process listening on --url's port); its "
        "CPU and its children's is reported per accepted submission",
    )
    args = p.parse_args(argv)
    # before anything runs: a negative count was random.sample's traceback once the federation
    # was set up in the database, and no client, key or send a load of nothing reported as run
    refuse_counts_below(p, ("--clients", args.clients, 1), ("--submissions", args.submissions, 1),
                        ("--duplicates", args.duplicates, 1),
                        ("--tools-per-client", args.tools_per_client, 1),
                        ("--scenarios-per-tool", args.scenarios_per_tool, 0))
    if not (math.isfinite(args.rate) and args.rate >= 0):
        p.error(f"--rate must be a finite number >= 0, not {args.rate:g}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a finite number > 0, not {args.timeout:g}")
    return args


# --- set-up through the ORM -------------------------------------------------------------------


def setup_federation(n_clients: int, tools: list, per_client_requests: int):
    """`tools`: the dataset's (`read_dataset`), imported when the registry lacks one."""
    import django

    django.setup()
    from compendium.models import Tool
    from compendium.services import import_registry
    from federation import services
    from federation.models import Round

    actor = services.Actor.system("bench/submit_load")
    if Tool.objects.filter(tool_id__in=[t.tool_id for t in tools], active=True).count() < len(tools):
        import_registry(tools)
    settings_row = services.get_settings()
    needed = per_client_requests + 5  # the most a client of this run may send in a minute
    if settings_row.submissions_per_minute < needed:
        services.update_settings(actor, submissions_per_minute=needed)
    run_id = uuid.uuid4().hex[:8]
    org = services.create_organization(actor, f"bench {run_id}", f"bench-{run_id}")
    clients = []
    for i in range(n_clients):
        client = services.enroll_client(actor, org, f"sim-{i:04d}")
        clients.append((client.pk, services.approve_client(actor, client).token))
    rnd = services.current_round()
    if rnd is None:
        rnd = services.open_round(actor)
    return run_id, org, clients, Round.objects.get(pk=rnd.pk)


def build_compendiums(data, n: int, tools_per_client: int, per_tool: int, seed: int,
                      not_released=()):
    """`n` compendium bodies; without statistics for the fields in `not_released` (the open
    round's `fields_not_released`, which the server refuses, as a client's toolkit leaves out)."""
    from compendium.masking import TextMasker

    # Masked at λ = 1 as a client's toolkit masks them (the server refuses text that still holds
    # what masking at the round's λ removes from any text).
    masker = TextMasker.for_registry(data.tools, strength=1.0)
    by_tool: dict[str, list[str]] = defaultdict(list)
    for q in data.queries:
        text = masker.mask(q.query).text
        if len(text) <= 1000:  # the schema's limit for a scenario's text
            by_tool[q.tool_id].append(text)
    tool_ids = sorted(t for t in by_tool if by_tool[t])
    rng = random.Random(seed)
    docs = []
    for c in range(n):
        chosen = rng.sample(tool_ids, min(tools_per_client, len(tool_ids)))
        metadata, scenarios, precautions, templates, annex = [], [], [], [], []
        for t in chosen:
            stats = {
                "calls": float(rng.randint(1, 50)),
                "success_rate": round(rng.random(), 3),
                "frequency": round(rng.random() / tools_per_client, 4),
                "latency_ms": float(rng.randint(50, 3000)),
            }
            metadata.append(
                {"tool_id": t, "stats": {k: v for k, v in stats.items() if k not in not_released}}
            )
            seen = set()
            for text in rng.sample(by_tool[t], min(per_tool, len(by_tool[t]))):
                if text not in seen:
                    seen.add(text)
                    scenarios.append({"tool_id": t, "text": text, "preconditions": {"online": True}})
            if rng.random() < 0.5:
                precautions.append({"tool_id": t, "text": f"Not for requests outside the scope of {t}"})
            if rng.random() < 0.25:
                templates.append(
                    {"tool_id": t, "signature": f"{t}(query)", "template": f"Use {t} for: {{query}}"}
                )
                annex.append({"subject": t, "relation": "used_by", "object": "a client"})
        doc = {
            "schema_version": "1.0",
            "metadata": metadata,
            "scenarios": scenarios,
            "precautions": precautions,
            "templates": templates,
            "annex": annex,
            "masking": {"strength": 1.0, "masked_fraction": 0.1, "seed": c},
            "num_users": rng.randint(5, 50),
        }
        docs.append(json.dumps(doc).encode())
    return docs


# --- the load -------------------------------------------------------------------------------


class _Closed(Exception):
    """The server closed a connection before answering."""


async def _read_response(reader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-cased names) and body (Content-Length,
    chunked, or up to the end of the connection)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise _Closed() from exc
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    else:
        body = await reader.read()
    return status, headers, body


async def drive(url, clients, docs, submissions, duplicates, rate, timeout, compress=False):
    """Every client sends its requests over its own connection (kept alive when the server
    allows it). The requests are written as bytes prepared in advance: a small HTTP/1.1 client
    instead of a general one, so that the load generator takes less of the CPU it shares with the
    server. Every response is read whole and checked by the caller."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    path = (parts.path.rstrip("/") or "") + "/api/v1/submissions/"
    # Compressed before the clock starts, as a client compresses before it connects.
    bodies = [gzip.compress(d, 9, mtime=0) for d in docs] if compress else docs
    encoding = b"Content-Encoding: gzip\r\n" if compress else b""
    results = []  # (client_pk, key, status, latency_s, replayed, body)
    transport_retries: list[str] = []
    start = time.perf_counter()

    async def one_client(index, client_pk, token):
        prefix = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
        ).encode() + encoding
        connection = None
        k = 0
        for s in range(submissions):
            key = f"bench-{client_pk}-{s}"
            body = bodies[index] if s == 0 else bodies[(index + s) % len(bodies)]
            request = (
                prefix + f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            for _ in range(duplicates):
                if rate > 0:
                    due = start + (k * len(clients) + index) / rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                k += 1
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(timeout):
                        for attempt in range(2):
                            reused = connection is not None
                            if connection is None:
                                connection = await asyncio.open_connection(host, port)
                            reader, writer = connection
                            try:
                                writer.write(request)
                                status, headers, raw = await _read_response(reader)
                                break
                            except (_Closed, ConnectionError):
                                writer.close()
                                connection = None
                                # A kept-alive connection the server had just closed: retry once
                                # with the same key, as a client would (counted below).
                                if attempt or not reused:
                                    raise
                                transport_retries.append(key)
                        if headers.get("connection", "").lower() == "close":
                            writer.close()
                            connection = None
                    latency = time.perf_counter() - t0
                    if headers.get("content-type", "").startswith("application/json"):
                        payload = json.loads(raw)
                    else:
                        payload = {"detail": raw[:200].decode("utf-8", "replace")}
                    replayed = headers.get("idempotent-replayed") == "true"
                    results.append((client_pk, key, status, latency, replayed, payload))
                except (OSError, _Closed, TimeoutError, ValueError) as exc:
                    if connection is not None:
                        connection[1].close()
                        connection = None
                    results.append(
                        (client_pk, key, 0, time.perf_counter() - t0, False, {"detail": repr(exc)})
                    )
        if connection is not None:
            connection[1].close()

    await asyncio.gather(*(one_client(i, pk, tok) for i, (pk, tok) in enumerate(clients)))
    return results, time.perf_counter() - start, len(transport_retries)


def _run(coroutine):
    """asyncio.run on uvloop's event loop when it is installed (a dev dependency: the load
    generator shares the server's CPU, and uvloop's loop costs it less per request)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def verify(org, rnd, results):
    from compendium.models import CompendiumVersion
    from federation.models import Submission

    accepted_keys = {(pk, key) for pk, key, status, *_ in results if status == 201}
    rows = list(
        Submission.objects.filter(client__organization=org, round=rnd).values_list(
            "client_id", "idempotency_key"
        )
    )
    duplicated = len(rows) - len(set(rows))
    lost = len(accepted_keys - set(rows))
    unexpected = len(set(rows) - accepted_keys)
    last_sha = {}
    for pk, _key, status, _lat, _rep, body in sorted(results, key=lambda r: r[5].get("id", 0)):
        if status == 201:
            last_sha[pk] = body["sha256"]
    versions = dict(
        CompendiumVersion.objects.filter(
            kind="client", round=rnd, client__organization=org
        ).values_list("client_id", "sha256")
    )
    wrong_current = sum(1 for pk, sha in last_sha.items() if versions.get(pk) != sha)
    extra_versions = len(set(versions) - set(last_sha))
    return {
        "rows": len(rows),
        "lost_rows": lost + wrong_current,
        "duplicated_rows": duplicated + unexpected + extra_versions,
    }


# --- CPU by process kind ------------------------------------------------------------------


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _listening_pid(url: str) -> int | None:
    """The process listening on the URL's port on this machine (a pre-fork server's master), or
    None."""
    from urllib.parse import urlsplit

    import psutil

    port = urlsplit(url).port or 80
    try:
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except psutil.Error:
        return None
    if not pids:
        return None
    process = psutil.Process(min(pids))
    # A worker of a pre-fork server shares the socket: go up to the master (same command line).
    while (parent := process.parent()) is not None and parent.cmdline() == process.cmdline():
        process = parent
    return process.pid


class CpuMeter:
    """User+system CPU seconds of three kinds of process over the load: the server (its master and
    every child), the database server (the postmaster of this run's connection and its children)
    and this load generator. Processes that end during the load are not counted (none should)."""

    def __init__(self, url: str, server_pid: int | None):
        import psutil
        from django.db import connection

        self.kinds: dict[str, list] = {"loadgen": [psutil.Process()]}
        server_pid = server_pid or _listening_pid(url)
        if server_pid:
            self.kinds["server"] = _tree(server_pid)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (backend,) = cursor.fetchone()
        try:
            postmaster = psutil.Process(backend).ppid()
            self.kinds["database"] = _tree(postmaster)
        except psutil.Error:
            pass  # a database on another machine: not measured
        self.started_at = time.time()
        self.start = self._sample()
        self.machine_start = self._machine_busy()

    @staticmethod
    def _machine_busy() -> float:
        """CPU seconds the whole machine has been busy (every process, the kernel included)."""
        import psutil

        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)

    def others_share(self, spent: dict[str, float], wall_s: float) -> float:
        """The share of the machine's CPU used during the load by anything but the measured
        processes (another job: then the machine was not quiet)."""
        busy = self._machine_busy() - self.machine_start
        return max(0.0, busy - sum(spent.values())) / (wall_s * (os.cpu_count() or 1))

    @staticmethod
    def _cpu(process) -> float:
        t = process.cpu_times()
        return t.user + t.system

    def _sample(self) -> dict[str, dict[int, float]]:
        import psutil

        out: dict[str, dict[int, float]] = {}
        for kind, processes in self.kinds.items():
            out[kind] = {}
            for process in processes:
                try:
                    out[kind][process.pid] = self._cpu(process)
                except psutil.Error:
                    pass
        return out

    def stop(self) -> dict[str, float]:
        """CPU seconds by kind since the start; a process started since (a worker or a database
        backend forked during the load) counts whole."""
        import psutil

        spent = {}
        for kind, processes in self.kinds.items():
            if kind != "loadgen":  # the trees again, with the processes born meanwhile
                processes = _tree(processes[0].pid)
            total = 0.0
            for process in processes:
                try:
                    before = self.start[kind].get(process.pid)
                    if before is None and process.create_time() < self.started_at - 1:
                        continue  # not seen at the start though older: not ours to count
                    total += self._cpu(process) - (before or 0.0)
                except psutil.Error:
                    pass
            spent[kind] = total
        return spent


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[index]


def earlier_rows(path: str | None) -> list[dict]:
    """The rows an existing --out holds, which the run's row is added to; [] for none. An --out
    holding anything else (not JSON, or JSON that is not a list of objects: another script's
    figures) stops the script with one line before it runs: found at the end, it was a traceback
    after the federation was set up and the load sent, and the row was written nowhere."""
    out = Path(path) if path else None
    if out is None or not out.exists():
        return []
    try:
        rows = json.loads(out.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        why = f"cannot be read ({exc.strerror})" if isinstance(exc, OSError) else "is not JSON"
    else:
        if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
            return rows
        why = "holds no list of rows"
    raise SystemExit(f"submit_load: --out {path} {why}: it adds its row to a JSON list of rows; "
                     "name a new file or such a list")


def main(argv=None):
    args = parse_args(argv)
    check_out(args.out, "submit_load")
    earlier_rows(args.out)  # before anything runs: its row is added to them at the end
    dataset = read_dataset(args.dataset, "submit_load")  # before the federation is set up
    print(f"setting up {args.clients} clients through the ORM ...", flush=True)
    run_id, org, clients, rnd = setup_federation(
        args.clients, dataset.tools, args.submissions * args.duplicates
    )
    docs = build_compendiums(
        dataset, args.clients, args.tools_per_client, args.scenarios_per_tool, args.seed,
        not_released=frozenset(rnd.fields_not_released),
    )
    mean_kb = statistics.mean(len(d) for d in docs) / 1024
    print(f"round {rnd.number}; compendium body {mean_kb:.1f} KB on average; sending ...", flush=True)
    meter = CpuMeter(args.url, args.server_pid)
    results, wall, retries = _run(
        drive(
            args.url, clients, docs, args.submissions, args.duplicates, args.rate, args.timeout,
            compress=args.gzip,
        )
    )
    cpu = meter.stop()
    others = meter.others_share(cpu, wall)
    checks = verify(org, rnd, results)

    latencies = [r[3] * 1000 for r in results]
    accepted = sum(1 for r in results if r[2] == 201 and not r[4])
    replayed = sum(1 for r in results if r[2] == 201 and r[4])
    errors = [r for r in results if r[2] != 201]
    statuses = defaultdict(int)
    for r in results:
        statuses[r[2]] += 1
    row = {
        "benchmark": "submit_load",
        "run_id": run_id,
        "url": args.url,
        "clients": args.clients,
        "submissions_per_client": args.submissions,
        "duplicates_per_key": args.duplicates,
        "target_rate_per_s": args.rate or None,
        "size_kb": round(mean_kb, 2),
        "gzip": args.gzip,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 1),
        "accepted_per_s": round(accepted / wall, 1),
        "accepted": accepted,
        "replayed": replayed,
        "errors": len(errors),
        "transport_retries": retries,
        "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "p50_ms": round(percentile(latencies, 50), 1),
        "p95_ms": round(percentile(latencies, 95), 1),
        "p99_ms": round(percentile(latencies, 99), 1),
        "max_ms": round(max(latencies), 1) if latencies else None,
        "lost_rows": checks["lost_rows"],
        "duplicated_rows": checks["duplicated_rows"],
        "stored_rows": checks["rows"],
        # CPU milliseconds per accepted submission, by process kind, over the load (replays
        # and errors included in the cost, not in the count).
        **{f"cpu_ms_per_accepted_{kind}": round(seconds * 1000 / max(accepted, 1), 2)
           for kind, seconds in cpu.items()},
        "cpu_ms_per_accepted_total": round(sum(cpu.values()) * 1000 / max(accepted, 1), 2),
        # The share of the machine's CPU that other processes took meanwhile (0 on a quiet one).
        "cpu_share_other_processes": round(others, 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    width = max(len(k) for k in row)
    print("-" * (width + 30))
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 30))
    for r in errors[:5]:
        print(f"error: HTTP {r[2]} {r[5].get('detail', '')!s:.160}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        rows = earlier_rows(args.out)  # read again: another run may have added its row since
        rows.append(row)
        out.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {out}")
    ok = not errors and row["lost_rows"] == 0 and row["duplicated_rows"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
