"""Usage logs for the client toolkit tests, made from the real MetaTool queries."""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

from compendium.registry import RoutingDataset, load_dataset
from compendium.schema import Schema
from tests.conftest import METATOOL

# Personal data planted into some queries; none of it may leave the client.
PLANTED = [
    ("Margaret Thornbury", "margaret.thornbury@example.org", "+1 415 555 0199", "48213"),
    ("Oswald Pemberton", "o.pemberton@mailhost.net", "+44 20 7946 0958", "772910"),
    ("Ingrid Vasquez", "ingrid.v@corp-mail.com", "(312) 555-0142", "3390017"),
]


def metatool_path() -> Path:
    """../shared/data/metatool beside the project; SYNAPSE_SHARED_DATA overrides where the
    checkout has no shared/ beside it (a git worktree)."""
    override = os.environ.get("SYNAPSE_SHARED_DATA")
    return Path(override) / "metatool" if override else METATOOL


@lru_cache(maxsize=1)
def metatool() -> RoutingDataset:
    return load_dataset(metatool_path())


@lru_cache(maxsize=1)
def metatool_schema() -> Schema:
    return Schema(tools=metatool().tools)


def plant(query: str, index: int) -> str:
    name, email, phone, number = PLANTED[index % len(PLANTED)]
    return (
        f"{query} My colleague {name} asked; reply to {email} or call {phone} "
        f"about ticket {number}."
    )


def usage_records(users: int = 6, lines: int = 240, seed: int = 3) -> list[dict]:
    """A log of several users: successes, failures and corrections on MetaTool queries, with
    personal data planted into every fifth query and templates on some successes."""
    rng = random.Random(seed)
    data = metatool()
    tools = sorted(data.tool_ids)
    queries = rng.sample(data.queries, lines)
    out = []
    for index, q in enumerate(queries):
        text = plant(q.query, index) if index % 5 == 0 else q.query
        record = {
            "query": text,
            "user": f"user-{rng.randrange(users)}",
            "latency_ms": round(rng.uniform(40, 2500), 1),
        }
        roll = rng.random()
        if roll < 0.7:
            record.update(tool=q.tool_id, outcome="success")
            if index % 7 == 0:
                record["preconditions"] = {"has_account": bool(index % 2)}
            if index % 11 == 0:
                record["template"] = {
                    "signature": "ask(question)",
                    "template": "Answer with the tool: {question}",
                }
        elif roll < 0.85:
            record.update(tool=rng.choice(tools), outcome="failure")
        else:
            wrong = rng.choice([t for t in tools if t != q.tool_id])
            record.update(tool=wrong, outcome="corrected", corrected_to=q.tool_id)
        out.append(record)
    return out


def write_log(path: Path, records: list[dict], extra_lines: dict[int, str] | None = None) -> Path:
    """Write records one a line; `extra_lines` puts raw text at given 1-based line numbers."""
    lines = [json.dumps(r) for r in records]
    for number, raw in sorted((extra_lines or {}).items()):
        lines.insert(number - 1, raw)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
