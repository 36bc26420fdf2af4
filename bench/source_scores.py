"""What the implausible-source check saw: every client submission's score, honest and adversarial.

`manage.py simulate` with the edge merges' implausible-source check (`clustering.implausible_sources`,
called by `federation.merge.operator`) observed: for every client submission that reached an edge
merge, its number of scenarios, its score (the mean own-tool percentile against the trusted
profiles; the check drops a source of at least SOURCE_MIN scenarios above SOURCE_LIMIT), whether
the check dropped it, whether the client is one of the run's adversaries, and the share of its
scenarios labelled with a tool of its own organization's categories (under the category
partition, the tools only its organization's clients hold requests for). Nothing the check
decides changes: the wrapper scores every source again with no minimum and no limit, beside it.
Needs `--in-memory` (the merge operator called directly, which publishes the same globals as the
rounds through the services: tests/test_simulation_pipeline.py), where a merge's sources are the
simulation's client names.
Prints, for honest and adversarial submissions, how many the check saw and dropped, the honest
scores' quantiles at or above SOURCE_MIN, and every adversarial submission that passed; writes
those and every record to `--scores-out`. The wrapper and its command are recorded in simulate's
`--out` JSON.

    python bench/source_scores.py --scores-out FILE --dataset bench/datasets/cheat \\
        --adversarial-fraction 0.4 --adversarial-mode coordinated_targeting [any other simulate
        arguments] --in-memory --out FILE --no-store
"""

from __future__ import annotations

import os
import sys

import numpy as np
from _routing_common import record_wrapper, write_json  # also puts the repository on sys.path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--scores-out" not in argv[:-1]:
        print("--scores-out FILE is required", file=sys.stderr)
        return 2
    at = argv.index("--scores-out")
    scores_out = argv[at + 1]
    argv = argv[:at] + argv[at + 2 :]
    import django

    django.setup()
    from django.core.management import call_command

    import federation.merge.clustering as clustering
    import federation.merge.operator as operator
    import federation.simulation.runner as runner

    records: list[dict] = []
    seen: dict = {"seed": None, "adversaries": set(), "org_tools": {}, "org_of": {}}
    prepare = runner.Simulation.prepare

    def observed_prepare(self, seed):
        setup = prepare(self, seed)
        category_of = {t.tool_id: t.category for t in self.schema.tools}
        categories: dict[str, set] = {}
        for share in setup.shares:
            categories.setdefault(share.organization, set()).update(category_of.get(q.tool_id) for q in share.queries)
        seen.update(
            seed=seed,
            adversaries=set(setup.adversaries or ()),
            org_of={s.client: s.organization for s in setup.shares},
            org_tools={org: {t for t, c in category_of.items() if c in cats} for org, cats in categories.items()},
        )
        return setup

    check = operator.implausible_sources

    def observed_check(items, tool_ids, profiles, *, limit, minimum, exempt=frozenset()):
        dropped = check(items, tool_ids, profiles, limit=limit, minimum=minimum, exempt=exempt)
        every = clustering.implausible_sources(items, tool_ids, profiles, limit=-1.0, minimum=1, exempt=exempt)
        for source, (score, count) in every.items():
            org = seen["org_of"].get(source)
            if org is None:  # a server merge: its sources are edges
                continue
            labels = [item.tool_id for item in items if item.source == source]
            records.append({
                "seed": seen["seed"], "source": source, "organization": org, "scenarios": count, "score": round(score, 4),
                "dropped": source in dropped, "adversarial": source in seen["adversaries"],
                "own_org_tools": round(sum(t in seen["org_tools"][org] for t in labels) / len(labels), 3),
            })
        return dropped

    runner.Simulation.prepare = observed_prepare
    operator.implausible_sources = observed_check
    call_command("simulate", *argv)

    if not records:
        print("no client submission was scored: run with --in-memory (through the services the merge "
              "names its sources by the database's client ids)", file=sys.stderr)
        return 1
    honest = [r for r in records if not r["adversarial"]]
    adversarial = [r for r in records if r["adversarial"]]
    judged = [r["score"] for r in honest if r["scenarios"] >= operator.SOURCE_MIN]
    adversaries_of = {}  # (seed, organization) -> its adversarial clients
    for r in adversarial:
        adversaries_of.setdefault((r["seed"], r["organization"]), set()).add(r["source"])
    summary = {
        "source_min": operator.SOURCE_MIN, "source_limit": operator.SOURCE_LIMIT,
        "honest": {"submissions": len(honest), "dropped": sum(r["dropped"] for r in honest)},
        "adversarial": {"submissions": len(adversarial), "dropped": sum(r["dropped"] for r in adversarial)},
        "honest_scores_judged": {
            q: round(float(np.quantile(judged, q)), 4) for q in (0.5, 0.9, 0.99, 1.0)
        } if judged else {},
        "adversarial_passed": [
            {**r, "adversaries_in_organization": len(adversaries_of[(r["seed"], r["organization"])])}
            for r in adversarial if not r["dropped"]
        ],
    }
    print(f"honest submissions: {summary['honest']}; adversarial: {summary['adversarial']}")
    print(f"honest scores with at least {operator.SOURCE_MIN} scenarios (quantiles): {summary['honest_scores_judged']}")
    for r in summary["adversarial_passed"]:
        print(f"  passed: seed {r['seed']} {r['source']}: {r['scenarios']} scenarios, score {r['score']}, "
              f"{r['own_org_tools']:.0%} labelled with its organization's own tools, "
              f"{len(adversaries_of[(r['seed'], r['organization'])])} adversaries in {r['organization']}")
    write_json(scores_out, {"command": "python bench/source_scores.py " + " ".join(sys.argv[1:]),
                            "summary": summary, "records": records})
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else None
    record_wrapper(out, "source_scores.py", argv, observed="the implausible-source check's score of every source")
    return 0


if __name__ == "__main__":
    sys.exit(main())
