"""Reference: `manage.py simulate` with the would-be adversarial clients sending nothing.

The adversarial curves compare SYNAPSE under attack with the clean federation. A defence that
filters adversaries out can at best reach what the honest clients alone give: the chosen clients
(`--adversarial-fraction F`, the same clients as an attack at F with the same seed) take part but
send no scenarios or precautions, as if the merge had dropped exactly them and nothing else.
`--adversarial-mode` is then irrelevant. The wrapper and its command are recorded in the `--out`
JSON.

    python bench/simulate_absent_clients.py --dataset bench/datasets/cheat --adversarial-fraction 0.4 \\
        [any other simulate arguments] --out FILE --no-store
"""

from __future__ import annotations

import os
import sys

from _routing_common import record_wrapper  # also puts the repository on sys.path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import django

    django.setup()
    from django.core.management import call_command

    import federation.simulation.runner as runner

    def absent(compendium, mode, schema, seed):
        return compendium.model_copy(update={"scenarios": [], "precautions": []})

    runner.corrupt = absent
    call_command("simulate", *argv)
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else None
    record_wrapper(out, "simulate_absent_clients.py", argv,
                   reference="the adversarial clients send no scenarios or precautions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
