"""Bytes on the wire of the same client submissions with the numeric statistics released on
coarser grids than the shipped 4 significant digits (`compendium.clipping.released_value`).

For each seed, the federation `manage.py simulate` runs (`Simulation.prepare`, `federate`), and
every client's body of each round is compressed as `synapse-client submit` sends it (dcz against
the probe requests and the schema in round 1, the pulled global later) with its statistics
re-rounded to 3 or 2 significant digits, or to a grid of Δ/1000 or Δ/100 of the field's
sensitivity. Nothing else in the body changes, so the difference is what the grid saves.

    python bench/stats_grid.py --dataset ../shared/data/metatool --seed 0 --seeds 1 \\
        --embedding-model onnx-int8-dynamic:all-MiniLM-L6-v2 --out FILE
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
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


def significant(digits: int):
    def rule(spec, value: float) -> float:
        if value == 0 or not math.isfinite(value):
            return value
        return round(value, digits - 1 - math.floor(math.log10(abs(value))))
    return rule


def grid(divisor: int):
    def rule(spec, value: float) -> float:
        step = spec.sensitivity / divisor
        return float(f"{round(value / step) * step:.6g}")
    return rule


RULES = {"4 digits (shipped)": None, "3 digits": significant(3), "2 digits": significant(2),
         "grid Δ/1000": grid(1000), "grid Δ/100": grid(100)}


def main(argv: list[str] | None = None) -> int:
    parser = federation_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import django

    django.setup()
    from compendium import transport
    from compendium.canonical import canonical_bytes

    _, simulation = federation_simulation(args, "stats_grid", rounds=args.rounds)
    fields = simulation.schema.fields_by_name

    def regrid(compendium, rule):
        if rule is None:
            return compendium
        metadata = [
            m.model_copy(update={"stats": {k: rule(fields[k], v) for k, v in m.stats.items()}})
            for m in compendium.metadata
        ]
        return compendium.model_copy(update={"metadata": metadata})

    rows = []
    started = time.perf_counter()
    for seed, outcome, probe, base in played_rounds(simulation, args.seed, args.seeds):
        sent = sent_compendiums(outcome)
        if not sent:  # nothing on the wire this round (simulate measures no body either)
            continue
        dictionary = probe + base if outcome.round == 1 else base
        row = {"seed": seed, "round": outcome.round, "clients": len(sent)}
        for name, rule in RULES.items():
            row[name] = float(np.mean([
                len(transport.compress(canonical_bytes(regrid(c, rule)), dictionary))
                for c in sent
            ]))
        rows.append(row)
    if not rows:
        raise SystemExit("stats_grid: no client sent anything in any round: no body to measure")
    print_table(rows, ["seed", "round", "clients", *RULES])
    mean = {name: body_mean(rows, name) for name in RULES}
    print("dcz bytes per client per round:", mean)
    write_json(args.out, {
        "command": "python bench/stats_grid.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows, "mean": mean, "seconds": round(time.perf_counter() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
