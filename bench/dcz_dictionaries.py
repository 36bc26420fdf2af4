"""Bytes on the wire of the same client submissions against each dcz dictionary a client could hold.

For each seed: the federation `manage.py simulate` runs (`Simulation.prepare`, `federate`: the same
split, usage logs, client builds, deltas and merges), and every client's canonical bytes of each
round compressed as `synapse-client submit` sends them (`compendium.transport`), against
- round 1: the schema alone (`--schema`), the public probe set's requests then the schema
  (`--schema --probe`, what simulate measures);
- later rounds: the pulled global (`--since`), and the probe requests then the pulled global (a
  dictionary the server does not offer; measured to show what it would save);
and gzip. Paired: the same bodies under every dictionary. Where the bytes go: for each section of
the body (numeric statistics, scenarios, precautions, templates, annex), the dcz bytes the body
loses without it, under the shipped dictionary (round 1: probe requests + schema; later rounds: the
pulled global), and how many entries of it a client sends; and the scenarios' texts alone (one per
line, no tool ids, no JSON) under the same dictionary: the floor the requests' own words set;
and the shipped bodies at zstd's strongest level, 22, against the shipped level.

    python bench/dcz_dictionaries.py --dataset ../shared/data/metatool --seed 0 --seeds 5 \\
        --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 --out FILE
"""

from __future__ import annotations

import gzip
import os
import sys
import time

import numpy as np

# _routing_common also puts the repository on sys.path.
from _routing_common import (
    body_mean,
    federation_parser,
    federation_simulation,
    played_rounds,
    print_table,
    sent_compendiums,
    write_json,
)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def main(argv: list[str] | None = None) -> int:
    parser = federation_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import django

    django.setup()
    from compendium import transport
    from compendium.canonical import canonical_bytes

    dataset, simulation = federation_simulation(args, "dcz_dictionaries", rounds=args.rounds)
    rows = []
    started = time.perf_counter()
    for seed, outcome, probe, base in played_rounds(simulation, args.seed, args.seeds):
        sent = sent_compendiums(outcome)
        if not sent:  # nothing on the wire this round (simulate measures no body either)
            continue
        bodies = [canonical_bytes(c) for c in sent]
        first = outcome.round == 1
        name = "schema" if first else "pulled global"
        dictionaries = {name: base, f"probe + {name}": probe + base}
        row = {"seed": seed, "round": outcome.round, "clients": len(bodies),
               "raw": float(np.mean([len(b) for b in bodies])),
               "gzip": float(np.mean([len(gzip.compress(b, 9, mtime=0)) for b in bodies]))}
        for label, dictionary in dictionaries.items():
            row[f"dcz: {label}"] = float(
                np.mean([len(transport.compress(b, dictionary)) for b in bodies])
            )
        shipped = probe + base if first else base
        # the same bodies at zstd's strongest level (22) instead of the shipped LEVEL: what a
        # slower compressor would still find in them
        row["dcz: shipped, level 22"] = float(
            np.mean([len(transport.compress(b, shipped, level=22)) for b in bodies])
        )
        row.update(section_bytes(sent, shipped))
        rows.append(row)
    if not rows:
        raise SystemExit("dcz_dictionaries: no client sent anything in any round: no body to measure")
    columns = ["seed", "round", "raw", "gzip", "dcz: schema", "dcz: probe + schema",
               "dcz: pulled global", "dcz: probe + pulled global", "dcz: shipped, level 22"]
    print_table(rows, columns)
    sections = [f"{kind}: {s}" for s in SECTIONS for kind in ("dcz", "entries")]
    sections.append("dcz: scenario texts alone")
    print_table(rows, ["seed", "round", *sections])
    summary = {}
    for column in columns[2:] + sections:
        if any(column in r for r in rows):
            summary[column] = body_mean(rows, column)
    # Per client per round over all rounds, as simulate's dcz figure: round 1 against the schema
    # (before) or the probe requests and the schema (shipped), later rounds the pulled global.
    for label, first in (("before: schema, then pulled global", "dcz: schema"),
                         ("shipped: probe + schema, then pulled global", "dcz: probe + schema")):
        summary[label] = body_mean(
            [{**r, label: r[first] if r["round"] == 1 else r["dcz: pulled global"]} for r in rows],
            label,
        )
    print("mean over seeds and rounds where it applies:", summary)
    write_json(args.out, {
        "command": "python bench/dcz_dictionaries.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows, "mean": summary,
        "seconds": round(time.perf_counter() - started, 1),
    })
    return 0


SECTIONS = ("metadata", "scenarios", "precautions", "templates", "annex")


def section_bytes(compendiums: list, dictionary: bytes) -> dict[str, float]:
    """Mean over the bodies: the dcz bytes each section adds (the body's dcz size less that of the
    same body without the section) and how many entries of it the body holds."""
    from compendium import transport
    from compendium.canonical import canonical_bytes

    def dcz(compendium) -> int:
        return len(transport.compress(canonical_bytes(compendium), dictionary))

    out = {}
    for section in SECTIONS:
        out[f"dcz: {section}"] = float(np.mean([
            dcz(c) - dcz(c.model_copy(update={section: []})) for c in compendiums
        ]))
        out[f"entries: {section}"] = float(np.mean([len(getattr(c, section)) for c in compendiums]))
    out["dcz: scenario texts alone"] = float(np.mean([
        len(transport.compress("\n".join(s.text for s in c.scenarios).encode(), dictionary))
        for c in compendiums
    ]))
    return out


if __name__ == "__main__":
    sys.exit(main())
