"""How long the operator's dashboard pages take, and how many bytes they send, at a federation of
many clients: the Overview (its bytes chart and client table), the Privacy page over a large
ε ledger, and the Audit log filtered by target and by round over many entries, with the plans
PostgreSQL chooses for those filters (EXPLAIN).

The federation is synthetic: ORGS organizations sharing CLIENTS clients (a few pending or
revoked), ROUNDS published rounds each with a submission of most approved clients and a global
compendium, one open round half of them submitted to, TOOLS x FIELDS ledger rows per
organization and round (29 x 4 over 30 organizations and 42 rounds: 146,160 rows), and
AUDIT audit entries about the clients and rounds. It lives in a scratch database made for the
run and dropped after it (the one `manage.py simulate` uses), never in the federation's own.
Pages are requested in-process with Django's test client as the operator, after one warm-up
request each; the time is the median of --repeat requests. An --out it could not write is
refused in one line before the database is made.

    DEBUG=0 SECRET_KEY=bench .venv/bin/python bench/dashboard_scale.py
    ... --clients 300 --orgs 30 --rounds 42 --repeat 5 --out bench/results/dashboard_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--orgs", type=int, default=30)
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--rounds", type=int, default=42, help="published rounds (one more is open)")
    p.add_argument("--tools", type=int, default=29, help="ledger rows: tools per release")
    p.add_argument("--fields", type=int, default=4, help="ledger rows: fields per tool")
    p.add_argument("--audit", type=int, default=100_000, help="audit entries")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    for name in ("orgs", "clients", "rounds", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def fill(args) -> dict:
    """The synthetic federation; returns what the page requests need (a client's id, a round)."""
    from django.contrib.auth import get_user_model

    from compendium.models import CompendiumVersion
    from federation.models import (
        AuditLog,
        Client,
        Organization,
        PrivacyLedgerEntry,
        Round,
        Submission,
    )

    orgs = Organization.objects.bulk_create(
        Organization(name=f"Organization {i:02d}", slug=f"org-{i:02d}") for i in range(args.orgs)
    )
    statuses = {7: Client.Status.PENDING, 11: Client.Status.REVOKED}
    clients = Client.objects.bulk_create(
        Client(organization=orgs[i % args.orgs], name=f"client-{i:03d}",
               status=statuses.get(i % 37, Client.Status.APPROVED))
        for i in range(args.clients)
    )
    submitting = [c for c in clients if c.status != Client.Status.PENDING]
    rounds = Round.objects.bulk_create(
        Round(number=n, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
        for n in range(1, args.rounds + 1)
    )
    open_round = Round.objects.create(number=args.rounds + 1, state=Round.State.OPEN,
                                      config={"epsilon": 1.0})
    versions, keys = [], []
    for rnd in rounds + [open_round]:
        for i, client in enumerate(submitting):
            # most clients every round, some skip; half of them have sent to the open round
            if (i + rnd.number) % 9 == 0 or (rnd is open_round and i % 2):
                continue
            size = 20_000 + 150 * rnd.number + 37 * (i % 50)
            versions.append(CompendiumVersion(
                kind="client", round=rnd, client=client, organization=client.organization,
                schema_version="1", content={}, sha256="0" * 64, size_bytes=size,
                gzip_bytes=size // 4,
            ))
            keys.append((client, rnd, size // 5))
        if rnd is not open_round:
            versions.append(CompendiumVersion(
                kind="global", round=rnd, schema_version="1", content={}, sha256="1" * 64,
                size_bytes=400_000, gzip_bytes=90_000,
                entry_counts={"scenarios": 800, "metadata": 199},
            ))
    versions = CompendiumVersion.objects.bulk_create(versions, batch_size=5000)
    Submission.objects.bulk_create(
        (Submission(client=client, round=rnd, idempotency_key=f"k{rnd.number}",
                    request_sha256="0" * 64, version=version, response={}, wire_bytes=wire,
                    content_encoding="dcz")
         for version, (client, rnd, wire) in zip(
             (v for v in versions if v.kind == "client"), keys, strict=True)),
        batch_size=5000,
    )
    ledger = []
    for rnd in rounds:
        for org in orgs:
            for t in range(args.tools):
                for f in range(args.fields):
                    ledger.append(PrivacyLedgerEntry(
                        round=rnd, organization=org, release=0, tool_id=f"tool-{t}",
                        field=f"field_{f}", sensitivity=1.0, contributors=10,
                        epsilon=1.0 / (args.tools * args.fields), noise_scale=100.0,
                    ))
        if len(ledger) >= 100_000:
            PrivacyLedgerEntry.objects.bulk_create(ledger, batch_size=10_000)
            ledger = []
    PrivacyLedgerEntry.objects.bulk_create(ledger, batch_size=10_000)
    actions = [AuditLog.Action.CLIENT_APPROVE, AuditLog.Action.SUBMISSION_UNMASKED,
               AuditLog.Action.SUBMISSION_POLICY, AuditLog.Action.CLIENT_ROTATE]
    AuditLog.objects.bulk_create(
        (AuditLog(actor_label="bench", action=actions[i % len(actions)],
                  organization=clients[i % len(clients)].organization, target_type="client",
                  target_id=str(clients[i % len(clients)].pk),
                  target_label=str(clients[i % len(clients)].name),
                  details={"round": 1 + (i // len(clients)) % (args.rounds + 1)})
         for i in range(args.audit)),
        batch_size=10_000,
    )
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    operator = get_user_model().objects.create_superuser("bench-operator", "op@example.org", "x")
    return {"operator": operator, "client": clients[1], "open_round": open_round.number}


def timed_get(http, url: str, repeat: int) -> dict:
    response = http.get(url)  # warm-up: caches, the connection, templates
    assert response.status_code == 200, (url, response.status_code, response.content[:300])
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = http.get(url)
        seconds.append(time.perf_counter() - started)
    return {"url": url, "status": response.status_code,
            "median_ms": round(1000 * statistics.median(seconds), 1),
            "kilobytes": round(len(response.content) / 1000, 1)}


def plans(setup: dict) -> dict:
    """EXPLAIN of the audit page's queries under its target and round filters."""
    from django.db import connection

    from federation.dashboard.services import audit_entries
    from federation.models import Organization

    every = Organization.objects.all()
    cases = {
        "target": {"target_type": "client", "target_id": str(setup["client"].pk)},
        "round": {"round": str(setup["open_round"])},
        "target_and_round": {"target_type": "client", "target_id": str(setup["client"].pk),
                             "round": str(setup["open_round"])},
    }
    out = {}
    for name, filters in cases.items():
        entries = audit_entries(every, operator=True, filters=filters)
        # the page's 50 rows and the paginator's count
        for part, query in (("page", entries[:50]), ("count", entries.order_by().values("id"))):
            sql, params = query.query.sql_with_params()
            if part == "count":
                sql = f"SELECT COUNT(*) FROM ({sql}) counted"
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql, params)
                out[f"{name} {part}"] = [row[0] for row in cursor.fetchall()]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from _routing_common import check_out

    check_out(args.out, "dashboard_scale")
    import django

    django.setup()
    from django.test import Client as HttpClient
    from django.test.utils import override_settings
    from django.urls import reverse

    from federation.simulation.through_services import scratch_database

    with scratch_database(), override_settings(ALLOWED_HOSTS=["testserver"]):
        started = time.perf_counter()
        setup = fill(args)
        print(f"federation filled in {time.perf_counter() - started:.1f} s")
        http = HttpClient()
        http.force_login(setup["operator"])
        overview, audit = reverse("dashboard:overview"), reverse("dashboard:audit")
        client_id, number = setup["client"].pk, setup["open_round"]
        urls = {
            "overview": overview,
            "overview_page_2": f"{overview}?page=2",
            "overview_waiting": f"{overview}?waiting=1",
            "privacy": reverse("dashboard:privacy"),
            "audit": audit,
            "audit_target": f"{audit}?target_type=client&target_id={client_id}",
            "audit_round": f"{audit}?round={number}",
        }
        pages = {}
        for name, url in urls.items():
            pages[name] = timed_get(http, url, args.repeat)
            print(f"{name:>16}: {pages[name]['median_ms']:8.1f} ms, "
                  f"{pages[name]['kilobytes']:8.1f} kB  {url}")
        explained = plans(setup)
        for name, plan in explained.items():
            scans = [line.strip() for line in plan
                     if "Scan" in line or "Execution Time" in line]
            print(f"EXPLAIN audit {name}: " + "; ".join(scans))
        from compendium.models import CompendiumVersion
        from federation.models import AuditLog, Client, PrivacyLedgerEntry

        counts = {"clients": Client.objects.count(),
                  "client_submissions": CompendiumVersion.objects.filter(kind="client").count(),
                  "ledger_rows": PrivacyLedgerEntry.objects.count(),
                  "audit_entries": AuditLog.objects.count()}
        print(counts)
    document = {
        "benchmark": "dashboard_scale",
        "command": "python bench/dashboard_scale.py " + " ".join(sys.argv[1:]),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: getattr(args, k) for k in
                   ("orgs", "clients", "rounds", "tools", "fields", "audit", "repeat")},
        "rows": counts,
        "pages": pages,
        "audit_plans": explained,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return document


if __name__ == "__main__":
    main()
