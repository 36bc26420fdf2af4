"""`synapse-client`: the toolkit that runs inside a client organization. No Django needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compendium.schema import Schema
from compendium.validation import validate_compendium


def _load_schema(path: str) -> Schema:
    try:
        return Schema.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"synapse-client: cannot read schema {path}: {exc}") from None


def cmd_validate(args: argparse.Namespace) -> int:
    schema = _load_schema(args.schema)
    try:
        data = Path(args.compendium).read_bytes()
    except OSError as exc:
        raise SystemExit(f"synapse-client: cannot read {args.compendium}: {exc.strerror}") from None
    result = validate_compendium(data, schema)
    if result.ok:
        counts = ", ".join(f"{n} {k}" for k, n in result.compendium.entry_counts().items())
        print(f"{args.compendium}: valid ({counts})")
        return 0
    for violation in result.violations:
        print(f"{args.compendium}: {violation}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="synapse-client", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check a compendium against the federation's schema")
    validate.add_argument("compendium")
    validate.add_argument("--schema", required=True, help="schema.json (python manage.py export_schema)")
    validate.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
