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

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
    if "--out" in argv:
        path = Path(argv[argv.index("--out") + 1])
        document = json.loads(path.read_text())
        document["command"] = "python bench/simulate_absent_clients.py " + " ".join(argv)
        document["reference"] = "the adversarial clients send no scenarios or precautions"
        path.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
