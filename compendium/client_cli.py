"""`synapse-client`: the toolkit that runs inside a client organization. No Django needed.

Commands: validate, build, inspect, submit, pull (`--router`: also the encoder the server tuned on
the global), participate, status, fetch-probe, route. Every error is one line on stderr and a
non-zero exit code (a malformed usage log lists each bad line first, one line each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from compendium import transport
from compendium.canonical import canonical_dict, canonical_form
from compendium.delta import (
    DEFAULT_SINCE_CONFIDENCE,
    delta_since,
    fit_budget,
    routed_by,
    sent_keys,
    without_sent,
)
from compendium.masking import SHARED_WORD_USERS, valid_shared_word_users
from compendium.schema import (
    DEFAULT_NUMERIC_FIELDS,
    FIELD_CAP_MAX,
    SEED_MAX,
    SEED_MIN,
    Compendium,
    Schema,
    exceeds_field_cap,
)
from compendium.scrub import submission_rules
from compendium.validation import (
    CompendiumInvalid,
    duplicate_key,
    format_path,
    validate_compendium,
    validation_summary,
)

PROG = "synapse-client"


class CliError(Exception):
    """One line for the user; the command exits with status 1."""


UTF8_BOM = b"\xef\xbb\xbf"


def _load_schema(path: str) -> Schema:
    try:
        data = Path(path).read_bytes().removeprefix(UTF8_BOM)
    except OSError as exc:
        raise CliError(f"cannot read schema {path}: {exc.strerror}") from None
    _refuse_duplicate_keys(path, data)
    try:
        return Schema.model_validate_json(data)
    except ValidationError as exc:
        raise CliError(f"{path} is not a schema: {validation_summary(exc)}") from None


def _read_bytes(path: str) -> bytes:
    """A JSON file's bytes, without the UTF-8 byte-order mark that Windows editors (Notepad,
    PowerShell 5's Out-File) put first: "Invalid JSON: expected value at line 1 column 1" told
    the user nothing they could act on (a usage log's is dropped as well)."""
    try:
        data = Path(path).read_bytes().removeprefix(UTF8_BOM)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    _refuse_duplicate_keys(path, data)
    return data


def _refuse_duplicate_keys(path: str, data: bytes) -> None:
    """A key given twice in one object, refused as the API refuses such a body: pydantic's
    parser kept the last (`{"tool_id": "a", "tool_id": "b"}` read as "b", which another reader
    takes as "a"), and what `submit` sent had only that one."""
    reason = duplicate_key(data)
    if reason is not None:
        raise CliError(f"{path}: not valid JSON: {reason}")


def _load_pulled(path: str) -> Compendium:
    """The global compendium a client pulled (--since): the file `pull` saves, or the body of
    GET /api/v1/compendium/global/ saved as it came (curl -o), whose `compendium` it is (as
    `route --compendium` reads it)."""
    from compendium.client_api import global_document

    data = _read_bytes(path)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for json
        return _load_compendium(path, data)  # names what is wrong with it
    inner = global_document(doc)
    return _load_compendium(path, data if inner is doc else json.dumps(inner).encode())


def _non_finite(compendium: Compendium) -> list[str]:
    """The paths of the numbers a compendium read from JSON holds that no JSON can write (1e999
    reads as infinity): its canonical form, which inspect shows and submit sends, cannot."""
    paths = []
    if compendium.masking is not None and not math.isfinite(compendium.masking.strength):
        paths.append("$.masking.strength")
    for index, entry in enumerate(compendium.metadata):
        paths += [
            f"$.metadata[{index}].stats.{name}"
            for name, value in entry.stats.items()
            if not math.isfinite(value)
        ]
    return paths


def _load_compendium(path: str, data: bytes | None = None) -> Compendium:
    data = _read_bytes(path) if data is None else data
    try:
        compendium = Compendium.model_validate_json(data, strict=True)
    except ValidationError as exc:
        for error in exc.errors()[:20]:
            print(f"{path}: {format_path(error['loc'])}: {error['msg']}", file=sys.stderr)
        raise CliError(f"{path} is not a compendium ({exc.error_count()} error(s))") from None
    infinite = _non_finite(compendium)
    if infinite:
        for where in infinite[:20]:
            print(f"{path}: {where}: number is not finite", file=sys.stderr)
        raise CliError(f"{path} is not a compendium ({len(infinite)} error(s))")
    return compendium


def _progress(quiet: bool):
    def wrap(iterable: Iterable, label: str, total: int | None = None, unit: str = "it"):
        if quiet:
            return iterable
        from tqdm import tqdm

        # disable=None: no bars where stderr is not a terminal (cron, a log file), whose
        # carriage returns would leave every frame of them in the log.
        return tqdm(
            iterable, desc=label, total=total, unit=unit, file=sys.stderr, leave=False,
            dynamic_ncols=True, disable=None,
        )

    return wrap


# --- validate ---------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from compendium.masking import TextMasker
    from compendium.scrub import masking_residue

    schema = _load_schema(args.schema)
    if args.strength is not None and not (math.isfinite(args.strength) and args.strength >= 0):
        raise CliError("--lambda must be a finite number >= 0")
    data = _read_bytes(args.compendium)
    result = validate_compendium(data, schema)
    # what the server refuses in a client's submission besides the schema's rules
    violations = result.violations if not result.ok else submission_rules(result.compendium)
    if violations:
        for violation in violations:
            print(f"{args.compendium}: {violation}", file=sys.stderr)
        return 1
    compendium = result.compendium
    strength = args.strength
    if strength is None and compendium.masking is not None:
        strength = compendium.masking.strength
    masking = "masking not checked: it records no λ (pass --lambda)"
    if strength is not None:
        # what the server checks on arrival at the open round's λ (see "What the server checks")
        residue = masking_residue(compendium, TextMasker.for_registry(schema.tools, strength=strength))
        if residue:
            for violation in residue:
                print(f"{args.compendium}: {violation}", file=sys.stderr)
            return 1
        masking = f"masked at λ = {strength:g} as far as the server checks"
    counts = ", ".join(f"{n} {k}" for k, n in compendium.entry_counts().items())
    print(f"{args.compendium}: valid ({counts}); {masking}")
    return 0


# --- build ------------------------------------------------------------------------------------


def report_path(out: Path) -> Path:
    return out.with_name(out.name + ".report.json")


def _field_names(value: str | None, schema) -> frozenset[str]:
    """--not-released: comma-separated declared numeric fields (an unknown name is an error)."""
    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(schema.fields_by_name))
    if unknown:
        raise CliError(
            f"--not-released names no declared numeric field: {', '.join(unknown)} (the schema "
            f"declares {', '.join(sorted(schema.fields_by_name)) or 'none'})"
        )
    return names


def _check_seed_and_field_cap(args: argparse.Namespace) -> None:
    """--seed and --field-cap as the compendium records them (a bigint, an integer column):
    refused before any work, not as the built compendium's validation error at its end."""
    if not SEED_MIN <= args.seed <= SEED_MAX:
        raise CliError(f"--seed must be a whole number from {SEED_MIN} to {SEED_MAX}")
    if args.field_cap is not None and not 1 <= args.field_cap <= FIELD_CAP_MAX:
        raise CliError(f"--field-cap must be from 1 to {FIELD_CAP_MAX}")


def _out_file(value: str) -> Path:
    """--out: the file to write. Refused, naming it, before any work (the build, the download),
    when no file can be written there: a path that ends in a separator (or in "." or "..")
    names a folder, which Path would drop (`--out newdir/` wrote a file called newdir), and so
    does a folder that exists; a device, a pipe or a socket (or a link to one) would be replaced
    by the file written (write_atomically refuses it too, but only at the end); a path under a
    file cannot be created. The last three were found only once the result was written: after
    the whole build, or after the download."""
    from compendium.client_api import names_a_folder, special_file

    out = Path(value)
    if names_a_folder(value) or out.is_dir():
        raise CliError(
            f"--out {value} names a folder, not a file: --out is the file to write; name a file "
            "(nothing written)"
        )
    special = special_file(out)
    if special:  # in write_atomically's words
        raise CliError(
            f"cannot write {out}: it is {special}, not a regular file, and the file written "
            "would replace it; name a file"
        )
    above = next((p for p in out.parents if p.exists()), None)  # the folders are made at the end
    if above is not None and not above.is_dir():
        raise CliError(f"--out {value}: {above} is a file, not a folder (nothing written)")
    return out


def _same_file(a, b) -> bool:
    """Whether the paths `a` and `b` name one existing file."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is not there
        return False


def cmd_build(args: argparse.Namespace) -> int:
    from compendium.builder import BuildError, BuildOptions, BuildReport, build_compendium
    from compendium.client_api import write_atomically
    from compendium.usage_log import NotUtf8Log, log_lines, parse_lines

    schema = _load_schema(args.schema)
    if not math.isfinite(args.strength):
        raise CliError("--lambda must be a finite number")
    _check_seed_and_field_cap(args)
    if not 0 < args.tau <= 1:
        raise CliError("--tau must be in (0, 1]")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise CliError(f"--max-bytes must be a positive number of bytes, not {args.max_bytes}")
    if not args.since_confidence >= 0:  # also NaN
        raise CliError(f"--since-confidence must be at least 0, not {args.since_confidence:g}")
    if args.min_users < 1:
        raise CliError("--min-users must be at least 1")
    if args.pool_users < 1:
        raise CliError("--pool-users must be at least 1")
    if args.pool_users > 1 and args.no_collapse:
        raise CliError("--pool-users needs the embedding model: leave out --no-collapse")
    if not valid_shared_word_users(args.shared_word_users):
        raise CliError("--shared-word-users must be 0 (off) or at least 2")
    if args.max_words < 0:
        raise CliError(f"--max-words must be 0 (whole requests) or at least 1, not {args.max_words}")
    out = _out_file(args.out)
    for flag in ("log", "schema", "since", "probe"):  # a typo would overwrite what it reads
        given = getattr(args, flag, None)
        for written in (out, report_path(out)):
            if given and _same_file(given, written):
                raise CliError(
                    f"--out {args.out} would overwrite the --{flag} file {written}: name another "
                    "file; nothing built"
                )
    if args.since and args.no_collapse:  # before any work: it needs the engine the build skips
        raise CliError("--since needs the embedding model (drop --no-collapse)")
    if (args.since_confidence != DEFAULT_SINCE_CONFIDENCE and not args.since
            and not getattr(args, "probe", None)):
        raise CliError(
            "--since-confidence applies only with --since GLOBAL or --probe PROBE; this build "
            "has neither, so it would be ignored"
        )
    probe = None
    if getattr(args, "probe", None):
        if args.since:
            raise CliError("--probe is for before any global is published: drop it with --since")
        if args.no_collapse:
            raise CliError("--probe needs the embedding model (drop --no-collapse)")
        probe = _load_probe_labelled(args.probe, schema.tool_ids)
    # read before the log and the embedding model: a --since it cannot use is said before the
    # build's work, not after it
    pulled = _load_pulled(args.since) if args.since else None
    options = BuildOptions(
        strength=args.strength,
        seed=args.seed,
        field_cap=args.field_cap,
        tau=args.tau,
        collapse=not args.no_collapse,
        skip_bad_lines=args.skip_bad_lines,
        min_users=args.min_users,
        pool_users=args.pool_users,
        shared_word_users=args.shared_word_users,
        max_words=args.max_words,
        not_released=_field_names(args.not_released, schema),
    )
    progress = _progress(args.quiet)
    try:
        with open(args.log, "rb") as handle:
            log = parse_lines(
                progress(log_lines(handle), "reading log", unit="line"),
                source=args.log,
                known_tools=schema.tool_ids,
                max_flags=schema.limits.preconditions,
            )
    except OSError as exc:
        raise CliError(f"cannot read {args.log}: {exc.strerror}") from None
    except NotUtf8Log as exc:
        raise CliError(str(exc)) from None
    if log.errors:
        for line in log.error_lines():
            print(line, file=sys.stderr)
        if not args.skip_bad_lines:
            raise CliError(
                f"{len(log.errors)} malformed line(s) in {args.log}; fix them, or pass "
                "--skip-bad-lines to build from the other lines"
            )
        print(
            f"{PROG}: skipped {len(log.errors)} malformed line(s) of {log.lines_read}",
            file=sys.stderr,
        )

    engine = None
    if options.collapse:
        from routing.embeddings import EmbeddingModelUnavailable, get_engine

        try:
            engine = get_engine(args.embedding_model)
        except EmbeddingModelUnavailable as exc:
            raise CliError(f"{exc} (or pass --no-collapse)") from None

    report = BuildReport(source=args.log, lines_read=log.lines_read, bad_lines=log.error_lines())
    try:
        compendium, report = build_compendium(
            log.records, schema, options, engine, report, progress=progress
        )
    except BuildError as exc:
        raise CliError(str(exc)) from None
    except CompendiumInvalid as exc:
        raise CliError(f"the built compendium is not valid under the schema: {exc}") from None
    notes = ""
    if pulled is not None:
        route = None
        if args.since_confidence <= 1.0 and pulled.scenarios:
            from compendium.client_api import head_file
            from routing.cli import pulled_router

            route = routed_by(
                pulled_router(
                    pulled,
                    embedding_model=args.embedding_model,
                    head_path=head_file(Path(args.since)),
                )
            )
        compendium, delta = delta_since(
            compendium, pulled, engine, options.tau, route=route, confidence=args.since_confidence
        )
        report.delta = delta.as_dict()
        notes = (
            f" Since {args.since}: {delta.scenarios_covered} scenario(s) "
            f"({delta.scenarios_routed} of them already routed right by it) and "
            f"{delta.precautions_covered} precaution(s) ({delta.precautions_routed} of them "
            "about requests it already sends to another tool) already covered, not sent."
        )
        earlier = getattr(args, "sent_before", None)
        if earlier:
            compendium, again = without_sent(compendium, earlier)
            report.delta["sent_before"] = again
            notes += (
                f" {again} scenario(s) and precaution(s) this client sent in earlier rounds "
                "(the global holds them, merged), not sent again."
            )
    elif probe and args.since_confidence <= 1.0:
        from routing.cli import probe_router

        route = routed_by(probe_router(probe, embedding_model=args.embedding_model))
        compendium, delta = delta_since(
            compendium, Compendium(), engine, options.tau, route=route,
            confidence=args.since_confidence,
        )
        report.delta = delta.as_dict()
        notes = (
            f" Against the public probe set ({args.probe}): {delta.scenarios_routed} scenario(s) "
            f"that its router already sends to their tool and {delta.precautions_routed} "
            "precaution(s) about requests it sends to another tool, not sent."
        )

    if args.max_bytes is not None:
        compendium, budget = fit_budget(compendium, args.max_bytes)
        report.budget = budget.as_dict()
        if budget.scenarios_deferred or budget.precautions_deferred:
            notes += (
                f" Over the budget of {args.max_bytes} bytes: {budget.scenarios_deferred} "
                f"scenario(s) and {budget.precautions_deferred} precaution(s) kept for a later "
                "round."
            )
        if budget.bytes_after > args.max_bytes:
            notes += (
                f" The statistics and templates alone take {budget.bytes_after} bytes, over the "
                "budget."
            )

    text = json.dumps(canonical_dict(compendium), ensure_ascii=False, indent=1, sort_keys=True)
    form = canonical_form(compendium)
    write_atomically(out, (text + "\n").encode("utf-8"))  # CannotWrite: one line
    # The report names the compendium it describes: a report left beside another file (a
    # rebuild that failed half-way, a compendium edited or copied over) is not read as its.
    described = {**report.as_dict(), "compendium_sha256": form.sha256}
    write_atomically(
        report_path(out),
        (json.dumps(described, indent=1, sort_keys=True) + "\n").encode("utf-8"),
    )
    counts = ", ".join(f"{n} {k}" for k, n in compendium.entry_counts().items())
    if options.pool_users > 1:
        notes += (
            f" Pooled: {report.pooled_scenarios} pool(s) of at least {options.pool_users} users "
            "sent in place of the scenarios."
        )
    if report.withheld_scenarios or report.withheld_precautions or report.withheld_templates:
        k = max(options.min_users, options.pool_users)
        notes += (
            f" Withheld (fewer than {k} users): {report.withheld_scenarios} "
            f"scenario(s), {report.withheld_precautions} precaution(s), "
            f"{report.withheld_templates} template(s)."
        )
    if report.over_limit_scenarios or report.over_limit_precautions:
        limits = schema.limits
        notes += (
            f" Over what one compendium may hold ({limits.scenarios} scenarios, "
            f"{limits.precautions} precautions, {limits.bytes} bytes): "
            f"{report.over_limit_scenarios} scenario(s) and {report.over_limit_precautions} "
            "precaution(s), the least supported, not sent."
        )
    if report.shared_words:
        notes += (
            f" Released {report.shared_words} word(s) that at least "
            f"{options.shared_word_users} users wrote (--shared-word-users)."
        )
    if report.cut_requests:
        notes += (
            f" Cut {report.cut_requests} request(s) to their first {options.max_words} words "
            "(--max-words)."
        )
    if report.scrubbed:
        notes += (
            f" Replaced {report.scrubbed} e-mail address(es), card, phone or long digit "
            "number(s) that masking left (words the registry covers or many users wrote), as "
            "the server scrubs them."
        )
    print(
        f"{out}: {counts}; {report.num_users} users; masked {report.masked_fraction:.1%} of "
        f"{report.word_tokens} tokens at λ={options.strength:g}; {form.size_bytes} bytes "
        f"({form.gzip_bytes} gzip).{notes} Check it with: {PROG} inspect {out}"
    )
    return 0


# --- inspect ----------------------------------------------------------------------------------


def _usable_report(doc) -> dict | None:
    """The build report beside a compendium as inspect reads it, or None when its shape is not
    what `build` writes (a report edited by hand)."""
    if not isinstance(doc, dict):
        return None

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    bounds = doc.get("clip_bounds", {})
    if not isinstance(bounds, dict) or not all(
        isinstance(b, list) and len(b) == 2 and all(map(number, b)) for b in bounds.values()
    ):
        return None
    kinds = {"clipped_values": dict, "bad_lines": list, "dropped": list}
    if not all(isinstance(doc.get(key, kind()), kind) for key, kind in kinds.items()):
        return None
    cap = doc.get("field_cap")
    if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1):
        return None
    if not isinstance(doc.get("compendium_sha256", ""), str):
        return None
    return doc


def _load_report(compendium_path: Path, compendium: Compendium) -> tuple[Path, dict | None]:
    """Where the build report beside a compendium is, and what it holds: None when there is none,
    when it is not a report `build` wrote, or when it names another compendium than this one
    (its `compendium_sha256`: the file was edited or replaced since the build); the last two are
    said on stderr."""
    where = report_path(compendium_path)
    if not where.exists():
        return where, None
    try:
        report = _usable_report(json.loads(where.read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError):
        report = None
    if report is None:
        print(f"{PROG}: {where} is not a report build wrote: ignored", file=sys.stderr)
        return where, None
    described = report.get("compendium_sha256")
    if described is not None and described != canonical_form(compendium).sha256:
        print(
            f"{PROG}: {where} describes another build than {compendium_path} (changed since): "
            "ignored",
            file=sys.stderr,
        )
        return where, None
    return where, report


def cmd_inspect(args: argparse.Namespace) -> int:
    compendium = _load_compendium(args.compendium)
    schema = _load_schema(args.schema) if args.schema else None
    path = Path(args.compendium)
    _, report = _load_report(path, compendium)
    form = canonical_form(compendium)
    out = sys.stdout
    masking = compendium.masking
    print(f"# {path}: what would leave this client", file=out)
    print(
        f"size: {form.size_bytes} bytes raw, {form.gzip_bytes} bytes gzip "
        f"(sha256 {form.sha256})",
        file=out,
    )
    if masking is None:
        print("masking: NONE recorded: this text was not masked by synapse-client", file=out)
    else:
        print(
            f"masking: λ={masking.strength:g}, {masking.masked_fraction:.1%} of tokens masked, "
            f"seed {masking.seed}",
            file=out,
        )
    print(f"users averaged over: {compendium.num_users or 'not recorded'}", file=out)
    cap = compendium.field_cap
    print(
        "field cap: "
        + (f"F*={cap} recorded" if cap is not None
           else "none recorded: a round with a field cap refuses its numeric statistics"),
        file=out,
    )

    fields = {f.name: f for f in (schema.numeric_fields if schema else DEFAULT_NUMERIC_FIELDS)}
    bounds = (report or {}).get("clip_bounds", {})
    print(f"\n## numbers ({len(compendium.metadata)} tools)", file=out)
    for name, spec in fields.items():
        lo, hi = bounds.get(name, [spec.min, min(spec.max, spec.min + spec.sensitivity)])
        clipped = (report or {}).get("clipped_values", {}).get(name)
        note = f", {clipped} per-user value(s) clipped" if clipped is not None else ""
        print(
            f"  {name}: per-user values clipped to [{lo:g}, {hi:g}] (Δ={spec.sensitivity:g}), "
            f"mean over the client's users{note}",
            file=out,
        )
    for entry in compendium.metadata:
        numbers = ", ".join(f"{k}={v:.6g}" for k, v in sorted(entry.stats.items()))
        print(f"  [{entry.tool_id}] {numbers}", file=out)
    if report and report.get("field_cap") is not None:
        print(
            f"  field cap F*={report['field_cap']}: {report.get('capped_contributions', 0)} "
            "user-tool contribution(s) left out",
            file=out,
        )

    print(f"\n## scenarios ({len(compendium.scenarios)})", file=out)
    for s in compendium.scenarios:
        flags = " " + json.dumps(s.preconditions, sort_keys=True) if s.preconditions else ""
        print(f"  [{s.tool_id}] ×{s.support}{flags}: {s.text}", file=out)
    print(f"\n## precautions ({len(compendium.precautions)})", file=out)
    for p in compendium.precautions:
        print(f"  [{p.tool_id}] ×{p.support}: {p.text}", file=out)
    print(f"\n## templates ({len(compendium.templates)})", file=out)
    for t in compendium.templates:
        print(f"  [{t.tool_id}] {t.signature}: {t.template}", file=out)
    print(f"\n## annex ({len(compendium.annex)})", file=out)
    for a in compendium.annex:
        print(f"  ({a.subject}, {a.relation}, {a.object})", file=out)
    if report:
        print(
            f"\nbuild: {report.get('records')} log lines used of {report.get('lines_read')}, "
            f"{len(report.get('bad_lines', []))} malformed skipped; scenarios "
            f"{report.get('scenarios_in')} -> {report.get('scenarios_out')}, precautions "
            f"{report.get('precautions_in')} -> {report.get('precautions_out')} after "
            f"deduplication (τ={report.get('tau')})",
            file=out,
        )
        if report.get("max_words"):
            print(
                f"  each request sent as its first {report['max_words']} words (--max-words): "
                f"{report.get('cut_requests', 0)} cut",
                file=out,
            )
        for note in report.get("dropped", []):
            print(f"  dropped: {note}", file=out)

    if schema is None:
        print("\nvalidation: not checked against a schema (pass --schema schema.json)", file=out)
        return 0
    result = validate_compendium(compendium, schema)
    violations = result.violations if not result.ok else submission_rules(compendium)
    if not violations:
        print("\nvalidation: valid under the schema", file=out)
        return 0
    print(f"\nvalidation: {len(violations)} violation(s)", file=out)
    for violation in violations:
        print(f"  {violation}", file=out)
    return 1


# --- submit / pull ----------------------------------------------------------------------------


def _client(args: argparse.Namespace):
    from compendium.client_api import SynapseClient

    token = args.token or os.environ.get("SYNAPSE_TOKEN", "")
    if not token:
        raise CliError("no API token: pass --token or set SYNAPSE_TOKEN")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CliError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    if not 0 <= args.retries <= MAX_RETRIES:
        raise CliError(f"--retries must be from 0 to {MAX_RETRIES}, not {args.retries}")
    if not (math.isfinite(args.backoff) and args.backoff >= 0):
        raise CliError(f"--backoff must be 0 or more seconds, not {args.backoff:g}")
    client = SynapseClient(
        args.server, token, timeout=args.timeout, retries=args.retries, backoff=args.backoff
    )
    if client.in_clear and client.server not in _WARNED_IN_CLEAR:  # once per command
        _WARNED_IN_CLEAR.add(client.server)
        print(
            f"{PROG}: warning: --server {client.server} is plain http:// to another machine: the "
            "API token and everything sent cross the network unencrypted; use https://",
            file=sys.stderr,
        )
    return client


# the servers `_client` warned about in this command (participate and pull --router make two
# clients of one server); main() starts each command with none
_WARNED_IN_CLEAR: set[str] = set()


# retries of one request at most (each wait capped at 30 s: 100 is about 50 minutes)
MAX_RETRIES = 100


def round_field_cap(current: dict, refused: str = "") -> int | None:
    """The round's F* (its configuration's `field_cap`): the most tools one user may feed the
    numeric statistics, which the edge's noise is calibrated for; None when it sets no cap. One
    that no compendium can record (not a whole number from 1 to FIELD_CAP_MAX) is a CliError
    naming the round's field_cap (not --field-cap, which the user may not have passed), ending
    with `refused` (what was not done)."""
    from compendium.client_api import round_config

    cap = round_config(current).get("field_cap")
    if cap is None or (isinstance(cap, int) and not isinstance(cap, bool)
                       and 1 <= cap <= FIELD_CAP_MAX):
        return cap
    raise CliError(
        f"round {current.get('number')} sets field_cap {cap!r}, which no compendium can record "
        f"(F* is a whole number from 1 to {FIELD_CAP_MAX}): ask the server's operator to "
        "correct the round" + (f"; {refused}" if refused else "")
    )


def _field_cap_check(path: Path, compendium: Compendium):
    """Before `submit` sends anything: the open round's F* against the field cap the compendium
    records it was built with (`Compendium.field_cap`), as the server checks on arrival. With
    numeric statistics and no cap recorded (built without one, by an older synapse-client or by
    other tooling) or a larger one under a capped round, it is refused (the edge would
    under-charge its statistics). A compendium without numeric statistics has nothing F* bounds."""

    def check(current: dict) -> None:
        required = round_field_cap(current, "nothing sent")
        if not exceeds_field_cap(compendium, required):
            return
        built = compendium.field_cap
        recorded = (
            "records no field cap (built without --field-cap, or by an older synapse-client "
            "or other tooling)" if built is None else f"was built with --field-cap {built}"
        )
        raise CliError(
            f"{path} {recorded}, but round {current['number']} caps each user at F* = "
            f"{required} tool(s) (the edge's noise assumes no more, and the server refuses it): "
            f"build it again with --field-cap {required} (or less); nothing sent"
        )

    return check


def round_not_released(current: dict) -> list[str]:
    """The numeric fields the open round says its edges will not release (`fields_not_released`
    of the rounds endpoint), sorted; [] when it names none."""
    names = current.get("fields_not_released")
    return sorted({n for n in names if isinstance(n, str)}) if isinstance(names, list) else []


def _not_released_check(path: Path, compendium: Compendium):
    """Before `submit` sends anything: statistics for numeric fields the open round will not
    release are refused, as the server refuses them (the merge would drop them, and the server
    would keep the client's numbers as sent until then). `build --not-released` leaves them out;
    `participate` passes the round's."""

    def check(current: dict) -> None:
        unreleased = set(round_not_released(current))
        carried = sorted(
            {name for entry in compendium.metadata for name in entry.stats} & unreleased
        )
        if not carried:
            return
        raise CliError(
            f"round {current['number']} will not release the numeric field(s) "
            f"{', '.join(carried)}, but {path} carries statistics for them: build it again with "
            f"--not-released {','.join(round_not_released(current))} (participate does); "
            "nothing sent"
        )

    return check


def _weaker_masking_warning(compendium: Compendium, allow_weaker: bool):
    """`--allow-weaker-masking`: text masked more weakly than the open round expects (or with no
    masking recorded), which `SynapseClient.submit` refuses otherwise (MaskedTooWeakly), is sent
    anyway (a compendium masked by other tooling, which records no λ), with a warning on stderr
    before it is sent: whatever the server answers (a refusal, an error, no answer at all), the
    text may have reached it."""

    from compendium.client_api import weaker_masking

    def check(current: dict) -> None:
        applied = compendium.masking.strength if compendium.masking else None
        problem = weaker_masking(current, applied)
        if problem is None or not allow_weaker:
            return
        print(
            f"{PROG}: warning: {problem}; this compendium "
            + ("records no masking" if applied is None else f"was masked at λ={applied:g}")
            + ": sent as it is (--allow-weaker-masking)",
            file=sys.stderr,
        )

    return check


def _privacy_refusal(path: str, exc) -> CliError:
    """What `submit` says when `SynapseClient.submit` found, before sending anything, what must
    not leave the client (a PrivacyViolation): the violations one line each on stderr (not for
    the masking strength, which is one line of its own), then what to do."""
    from compendium.client_api import MaskedTooWeakly, NotForSending, TextNotMasked

    if isinstance(exc, MaskedTooWeakly):
        return CliError(
            f"{exc.problem}, but {path} "
            + ("records no masking" if exc.applied is None else f"was masked at λ = {exc.applied:g}")
            + f": build it again with --lambda {exc.expected:g} (or more), or pass "
            "--allow-weaker-masking to send it as it is; nothing sent"
        )
    for violation in exc.violations:
        print(f"{path}: {violation}", file=sys.stderr)
    if isinstance(exc, NotForSending):
        # text no masking check reads: it must not leave, and the server refuses it
        return CliError(
            f"{path} carries what a client does not send (listed above): its metadata holds "
            "statistics only (no description or spec), its precondition flag names no personal "
            "data (build writes neither); nothing sent"
        )
    if isinstance(exc, TextNotMasked):
        return CliError(
            f"{len(exc.violations)} text(s) of {path} still hold what masking at round "
            f"{exc.round_number}'s λ = {exc.strength:g} removes from any text, which the server "
            f"refuses: build it again with --lambda {exc.strength:g} (or mask those texts); "
            "nothing sent"
        )
    return CliError(f"{path}: {exc}")


def _checks(*checks):
    """One `check` for ClientApi.submit that runs each of `checks` in turn."""

    def check(current: dict) -> None:
        for each in checks:
            each(current)

    return check


def cmd_submit(args: argparse.Namespace) -> int:
    _submit(args)
    return 0


def _submit(args: argparse.Namespace):
    """`submit`: send the compendium, print what happened and return the SubmissionResult (the
    server's answer names the round it stored the submission in); a CliError or ClientError
    when nothing was stored."""
    from compendium.client_api import PrivacyViolation, SubmissionRejected, nothing_to_submit

    compendium = _load_compendium(args.compendium)
    if nothing_to_submit(compendium):
        raise CliError(
            f"{args.compendium} has no entries (metadata, scenarios, precautions, templates and "
            "annex are all empty): nothing to submit, nothing sent"
        )
    dictionary = None
    if args.no_gzip and (args.since or args.schema):
        raise CliError("--no-gzip sends the body plain: drop --since and --schema with it")
    if args.probe and not args.schema:
        raise CliError("--probe goes with --schema (before any global is published)")
    if args.since:
        dictionary = transport.global_dictionary(_load_pulled(args.since))
    elif args.schema:
        probe = _load_probe(args.probe) if args.probe else []
        dictionary = transport.probe_dictionary(_load_schema(args.schema), probe)
    allow_weaker = getattr(args, "allow_weaker_masking", False)
    with _client(args) as client:
        try:
            # the library runs the checks of the privacy boundary before sending anything
            # (PrivacyViolation); these are the CLI's own, on the round's other terms
            result = client.submit(
                compendium, compress=not args.no_gzip, dictionary=dictionary,
                allow_weaker_masking=allow_weaker,
                check=_checks(
                    _field_cap_check(Path(args.compendium), compendium),
                    _not_released_check(Path(args.compendium), compendium),
                    _weaker_masking_warning(compendium, allow_weaker),
                ),
            )
        except PrivacyViolation as exc:
            raise _privacy_refusal(args.compendium, exc) from None
        except SubmissionRejected as exc:
            for v in exc.violations:
                print(f"{args.compendium}: {v['path']}: {v['reason']}", file=sys.stderr)
            raise CliError(f"the server rejected {args.compendium}: {exc.detail}") from None
    for warning in result.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    body = result.body
    again = " (the server already had it: replayed, not stored twice)" if result.replayed else ""
    if result.reinstated and result.replayed:
        # A later submission had replaced it under its first key, and an earlier run (or a try
        # whose answer was lost) already put it back under the key printed: nothing went again.
        again = (
            "; a later submission had replaced it under its first key, and it is already in "
            "effect under the key that follows (the server already had it: replayed, not stored twice)"
        )
    elif result.reinstated:
        again = (
            "; its earlier submission to this round had been replaced by a later one, so it "
            "went again under a new key and is in effect again"
        )
    print(
        f"{args.compendium}: submitted to round {result.round} as submission {body.get('id')}, "
        f"sha256 {str(body.get('sha256', ''))[:12]}…, {body.get('size_bytes')} bytes "
        f"({result.sent_bytes} sent, {result.content_encoding or 'plain'}){again}; "
        f"key {result.idempotency_key}"  # whole: a key sent again ends in -2, -3, ...
    )
    return result


def _server_time(stamp: object) -> datetime | None:
    """An ISO 8601 time from the server (which always names its zone) in UTC; None when it does
    not parse."""
    try:
        return datetime.fromisoformat(str(stamp)).astimezone(UTC) if stamp else None
    except ValueError:
        return None


def _when(stamp: object) -> str:
    """A server time as `YYYY-MM-DD HH:MM UTC` (as given when it does not parse)."""
    when = _server_time(stamp)
    return when.strftime("%Y-%m-%d %H:%M UTC") if when else str(stamp)


def _past(stamp: object, now: datetime | None = None) -> bool:
    """Whether the server time `stamp` has passed by `now` (None: this machine's clock)."""
    when = _server_time(stamp)
    return when is not None and when <= (now or datetime.now(UTC))


def cmd_status(args: argparse.Namespace) -> int:
    """Where this client stands: the open round and what the client submitted to it, and the
    latest published global. Exit status 0; 3 with --require-submitted when this client's part
    of the open round is not done (for a scheduler to act on): it has no submission in effect,
    and participate did not record in --dir that it had nothing new to send in the round."""
    from compendium.client_api import (
        BY_THIS_CLOCK,
        had_nothing_new,
        round_config,
        round_mask_strength,
        sent_file,
    )

    with _client(args) as client:
        open_rounds = client.rounds("open")
        server_date = client.server_date  # the server's clock judges the deadline
        published = client.rounds("published")
        current = max(open_rounds, key=lambda r: r["number"]) if open_rounds else None
        # the newest page, and how many there are in all: a cron's participate may have
        # replaced more submissions in the round than one page lists
        mine, made = client.counted_submissions(current["number"]) if current else ([], 0)
    missing = False
    if current is None:
        print("no round is open: nothing to submit to now")
    else:
        config = round_config(current)
        terms = [f"ε = {config['epsilon']:g}"] if isinstance(config.get("epsilon"), int | float) else []
        # the λ the server checks the round's text at, named by its configuration or not
        terms.append(f"masking λ ≥ {round_mask_strength(current):g}")
        if config:
            cap = round_field_cap(current)
            terms.append("no field cap" if cap is None else f"field cap F* = {cap}")
        extra = f"; {', '.join(terms)}" if terms else ""
        print(f"round {current['number']} is open (opened {_when(current.get('opened_at'))}{extra})")
        if current.get("closes_at"):
            if _past(current["closes_at"], server_date):
                print(
                    f"  its deadline {_when(current['closes_at'])} has passed: it takes no more "
                    "submissions and closes at the server's next check"
                    + (f" ({BY_THIS_CLOCK})" if server_date is None else "")
                )
            else:
                print(f"  it takes submissions until {_when(current['closes_at'])}, then closes")
        effective = [s for s in mine if s.get("in_effect")]
        ledger = sent_file(Path(args.dir)) if args.dir else None
        if not effective and ledger and had_nothing_new(ledger, current["number"]):
            print(
                f"  participate had nothing new to send to round {current['number']} (recorded "
                f"in {ledger}): this client's part of the round is done"
            )
        elif not effective:
            missing = True
            print(f"  this client has not submitted to round {current['number']} yet")
        for sub in effective:
            counts = sub.get("entry_counts")
            counts = counts if isinstance(counts, dict) else {}  # another shape: not shown
            entries = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            sent = sub.get("wire_bytes")
            encoding = sub.get("content_encoding") or "plain"
            print(
                f"  this client submitted at {_when(sub.get('created_at'))}: sha256 "
                f"{str(sub.get('sha256', ''))[:12]}…, {sub.get('size_bytes')} bytes"
                + (f" ({sent} sent, {encoding})" if sent is not None else "")
                + (f"; {entries}" if entries else "")
            )
        replaced = made - len(effective)
        if replaced:
            print(f"  ({replaced} earlier submission(s) of this round replaced by the one above)")
    if published:
        latest = max(published, key=lambda r: r["number"])
        probe = latest.get("probe_accuracy")
        print(
            f"latest published global: round {latest['number']} "
            f"(published {_when(latest.get('published_at'))}"
            + (f"; top-1 {probe:.3f} on {latest.get('probe_queries')} public probe requests"
               if isinstance(probe, int | float) else "")
            + "); `pull` downloads it"
        )
    else:
        print("no global compendium is published yet")
    return 3 if missing and args.require_submitted else 0


def cmd_participate(args: argparse.Namespace) -> int:
    """One client round, as a scheduler runs it: the schema in force, the latest global (or,
    before any, the public probe set), `build` against it at the round's masking strength, and
    `submit` as dcz against it. Files go to --dir, with a record of what each round's
    submission held (sent.json): what the pulled global's rounds already received is not sent
    again. Running it again in the same round sends the same bytes (replayed by the server, not
    stored twice) or, after new usage, replaces the round's earlier submission."""
    from compendium.client_api import (
        NO_ROUND_FOR_SUBMISSION,
        CannotWrite,
        NothingPublished,
        deadline_passed,
        etag_file,
        head_file,
        merged_rounds,
        nothing_to_submit,
        record_nothing_new,
        record_sent,
        round_config,
        round_mask_strength,
        schema_file,
        sent_before,
        sent_file,
        weaker_masking,
    )

    _check_seed_and_field_cap(args)
    if args.no_collapse and args.since_confidence != DEFAULT_SINCE_CONFIDENCE:
        # what the global or the probe set routes is left out with the embedding model only
        raise CliError(
            "--since-confidence needs the embedding model, which --no-collapse skips: leave out "
            "one of them"
        )
    folder = Path(args.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file (mkdir's "File exists" read as if the folder were there)
        raise CliError(f"--dir {folder} is a file, not a folder") from None
    except OSError as exc:
        raise CliError(f"cannot create {folder}: {exc.strerror}") from None
    schema_path, global_path = folder / "schema.json", folder / "global.json"
    probe_path, out = folder / "probe.json", folder / "compendium.json"
    for written in (schema_path, global_path, etag_file(global_path), head_file(global_path),
                    schema_file(global_path), probe_path, out, report_path(out),
                    sent_file(folder)):
        if _same_file(args.log, written):  # a download would overwrite the usage log
            raise CliError(
                f"--log {args.log} is {written}, a file participate writes in --dir: keep the "
                "usage log outside --dir or under another name; nothing built or sent"
            )
    with _client(args) as client:
        current = client.open_round()  # no open round: one clear error, nothing built
        late = deadline_passed(current, client.server_date)  # by the server's clock
        if late:  # the server would refuse the submission with these words, after the build
            raise CliError(f"{NO_ROUND_FOR_SUBMISSION}: {late}")
        required = round_field_cap(current, "nothing built or sent")
        field_cap = required if args.field_cap is None else args.field_cap
        if required is not None and field_cap > required:
            raise CliError(
                f"round {current['number']} caps each user at F* = {required} tool(s) (the edge's "
                f"noise assumes no more): --field-cap {field_cap} is larger; pass --field-cap "
                f"{required} or less, or leave it out; nothing built or sent"
            )
        weaker = None if args.strength is None else weaker_masking(current, args.strength)
        if weaker is not None and not args.allow_weaker_masking:
            raise CliError(
                f"{weaker}: --lambda {args.strength:g} is weaker; pass --lambda "
                f"{round_mask_strength(current):g} or more, or leave it out (or pass "
                "--allow-weaker-masking); nothing built or sent"
            )
        in_force = client.fetch_schema(schema_path)  # pull saves it beside the global too
        schema = in_force[0]
        # A round that does not carry the previous global forward builds its global from this
        # round's submissions alone: a client then sends what the global covers too.
        carried = round_config(current).get("carry_forward") is not False
        try:
            pulled = client.pull(global_path, schema=in_force)
        except NothingPublished:
            pulled = None
            for stale in (global_path, etag_file(global_path), head_file(global_path),
                          schema_file(global_path), sent_file(folder)):
                stale.unlink(missing_ok=True)  # a global of an earlier federation
        if pulled is None or not carried:
            client.fetch_probe(probe_path)
        global_round = pulled.round if pulled else None
        # the published rounds: which of them the pulled global holds (see merged_rounds)
        published = client.rounds("published") if pulled and carried else []
        if pulled and global_round is None:
            # 304: the copy held is the latest published global, and a 304 names no round
            published = published or client.rounds("published")
            global_round = max((r["number"] for r in published), default=None)
    for warning in pulled.warnings if pulled else ():
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    strength = round_mask_strength(current) if args.strength is None else args.strength
    since = str(global_path) if pulled else None  # what the body is compressed against
    # the build leaves out what this one covers; that takes the embedding model, so without it
    # (--no-collapse) everything is built, as before any global (the body is still dcz against it)
    build_since = since if carried and not args.no_collapse else None
    print(
        f"round {current['number']}: "
        + (f"against the global of round {global_round}" if global_round is not None
           else "against the global held (unchanged)" if pulled
           else "no global yet: against the public probe set")
        + (" (compressed only: the round does not carry it forward, so what it covers is sent "
           "too, all but what the public probe set already routes)"
           if pulled and not carried else "")
        + (" (compressed only: --no-collapse builds without the embedding model, which leaving "
           "out what the global covers needs, so that is sent too)"
           if pulled and carried and args.no_collapse else "")
        + f", masking at λ = {strength:g}, "
        + ("no field cap" if field_cap is None else f"field cap F* = {field_cap}")
        + (f" (the round's is {required})" if required is not None and field_cap < required else "")
    )
    # The round's fields are never sent (the server refuses them); --not-released may leave out
    # more, never fewer. A field of the round's that the schema in force no longer declares (the
    # round read them when it opened) is not computed anyway.
    withheld = [n for n in round_not_released(current) if n in schema.fields_by_name]
    if withheld:
        print(f"the round will not release {', '.join(withheld)}: not sent")
    for name in (args.not_released or "").split(","):
        if name.strip() and name.strip() not in withheld:
            withheld.append(name.strip())
    not_released = ",".join(withheld) or None
    # What this client sent in the rounds the pulled global merged (recorded in --dir): a
    # global carried forward holds it, so the same text is not sent again.
    ledger = sent_file(folder)
    cmd_build(argparse.Namespace(
        **{**vars(args), "log": args.log, "schema": str(schema_path), "out": str(out),
           "since": build_since,
           "probe": None if build_since or args.no_collapse else str(probe_path),
           "strength": strength,
           "field_cap": field_cap, "not_released": not_released,
           "sent_before": sent_before(ledger, merged_rounds(published, global_round))
           if build_since else None},
    ))
    built = _load_compendium(str(out))
    if nothing_to_submit(built):
        print(f"{out}: nothing new since the global: nothing sent this round")
        try:  # this client's part of the round is done: status --require-submitted --dir
            record_nothing_new(ledger, current["number"])
        except CannotWrite as exc:
            print(f"{PROG}: warning: {exc}: status --require-submitted --dir will not know that "
                  "this round is done", file=sys.stderr)
        return 0
    result = _submit(argparse.Namespace(
        **{**vars(args), "compendium": str(out), "no_gzip": False, "since": since,
           "schema": None if since else str(schema_path), "probe": None if since else str(probe_path)},
    ))
    # Recorded under the round it was stored in: when the round read above closed during the
    # build and another opened, submit checked and sent it for that one (X-Synapse-Round, which
    # the server stores in or refuses), not for `current`.
    try:
        record_sent(ledger, result.round, sent_keys(built))
    except CannotWrite as exc:
        print(f"{PROG}: warning: {exc}: the next round may send some of this again",
              file=sys.stderr)
    return 0


def _probe_document(path: str):
    """The JSON of a probe.json (`fetch-probe`), or a CliError naming the file."""
    data = _read_bytes(path)
    try:
        return json.loads(data)
    except RecursionError:
        raise CliError(f"{path} is not a probe set: it nests too deeply") from None
    except ValueError as exc:
        raise CliError(f"{path} is not a probe set: {exc}") from None


def _load_probe(path: str) -> list[str]:
    try:
        return transport.probe_texts_of(_probe_document(path))
    except ValueError as exc:
        raise CliError(f"{path} is not a probe set: {exc}") from None


def _load_probe_labelled(path: str, tool_ids: frozenset[str]) -> list[tuple[str, str]] | None:
    """The probe set's (request, tool) pairs for `build --probe`, those labelled with a tool of
    the schema only (`tool_ids`, the active tools: a probe.json saved from an older server, or
    before a tool was deactivated, may still name it, and the probe's router is never to route
    to it); None (with a warning) when no pair is left: nothing is left out then."""
    try:
        document = _probe_document(path)
        pairs = transport.probe_labelled_of(document)
    except ValueError as exc:
        raise CliError(f"{path} is not a probe set: {exc}") from None
    if pairs is None:
        why = "has no tools (fetched from an older server; fetch-probe again)"
    elif not document["texts"]:
        why = "has no requests (the server has no probe set imported)"
    else:
        pairs = [(text, tool) for text, tool in pairs if tool in tool_ids]
        why = "labels none of its requests with a tool of the schema"
    if not pairs:
        print(f"{PROG}: warning: {path} {why}: every scenario is sent", file=sys.stderr)
        return None
    return pairs


def cmd_fetch_probe(args: argparse.Namespace) -> int:
    out = _out_file(args.out)
    with _client(args) as client:
        count = client.fetch_probe(out)
    if count:
        print(f"{args.out}: the public probe set's {count} requests saved")
    else:
        print(
            f"{args.out}: saved, but the server has no probe set imported (its operator runs "
            "manage.py import_probe_set); submit --schema --probe then compresses against the "
            "schema alone"
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    out = _out_file(args.out)
    with _client(args) as client:
        result = client.pull(out, round_number=args.round)
    for warning in result.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    if not result.updated:
        print(f"{out}: up to date (ETag {result.etag})")
    else:
        print(f"{out}: global compendium of round {result.round} saved (sha256 {result.sha256})")
    if result.head is not None:
        print(f"{result.head}: its routing head")
    if result.schema is not None:
        print(f"{result.schema}: the schema in force (route leaves out the global's tools it "
              "does not list)")
    if args.router:
        with _client(args) as client:
            router = client.pull_router(out, round_number=args.round)
        for warning in router.warnings:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        if not router.available:
            print(
                f"{PROG}: warning: no tuned router to download: {router.detail}", file=sys.stderr
            )
        elif not router.updated:
            print(f"{router.path}: the tuned router of round {router.round} is up to date")
        else:
            print(
                f"{router.path}: the encoder the server tuned on round {router.round}'s global "
                f"({router.epochs} epoch(s), {router.total_bytes / 1e6:.1f} MB: "
                f"{router.downloaded_bytes / 1e6:.1f} MB downloaded, {router.delta_files} "
                f"file(s) rebuilt from a delta against the bundled model, {router.reused_files} "
                "kept from the previous copy); route now ranks with it"
            )
    return 0


# --- parser -----------------------------------------------------------------------------------


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    server = os.environ.get("SYNAPSE_SERVER", "").strip()
    parser.add_argument(
        "--server", default=server or None, required=not server,
        help="base URL, e.g. https://synapse.example (default: $SYNAPSE_SERVER)",
    )
    parser.add_argument("--token", help="client API token (default: $SYNAPSE_TOKEN)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument(
        "--retries", type=int, default=5,
        help=f"retries on network errors, 5xx and 429 (default 5, at most {MAX_RETRIES}); a 429 "
        "or 503 waits as long as its Retry-After asks (at most 60 s)",
    )
    parser.add_argument("--backoff", type=float, default=0.5, help="first retry delay, seconds")


def _strength(value: str) -> float:
    """--lambda's type: a masking strength argparse refuses (usage, error, status 2) unless it is
    a finite number >= 0."""
    try:
        strength = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {value!r}") from None
    if not (math.isfinite(strength) and strength >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {value}")
    return strength


def _add_build_options(
    parser: argparse.ArgumentParser,
    lambda_default: float | None = 1.0,
    lambda_help: str = "masking strength λ >= 0 (0 masks nothing; larger masks more; default 1.0)",
    field_cap_help: str = "F*: at most this many tools per user feed the numeric statistics "
    "(default: no cap; a round with a field_cap refuses a submission built with none or a larger "
    "one)",
) -> None:
    """The options of `build`, shared with `participate`."""
    parser.add_argument(
        "--lambda", dest="strength", type=_strength, default=lambda_default,
        help=lambda_help,
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for masking and cap tie-breaks")
    parser.add_argument("--field-cap", type=int, default=None, help=field_cap_help)
    parser.add_argument(
        "--not-released", default=None, metavar="FIELD,...",
        help="numeric fields the round's edges will not release (the open round's "
        "fields_not_released; participate reads it): not computed, not sent",
    )
    parser.add_argument("--tau", type=float, default=0.85, help="cosine for near-duplicate collapse")
    parser.add_argument(
        "--min-users", type=int, default=1, metavar="K",
        help="send a scenario or precaution only when at least K distinct users' requests "
        "support it (k-anonymous release; default 1: send everything)",
    )
    parser.add_argument(
        "--pool-users", type=int, default=1, metavar="K",
        help="pooled release: pool each tool's requests with their nearest ones until a pool "
        "holds K distinct users' requests, and send a pool as the words two of its users wrote "
        "(no text sent is any one request; default 1: off)",
    )
    parser.add_argument(
        "--shared-word-users", type=int, default=SHARED_WORD_USERS, metavar="K",
        help="release, unmasked, the ordinary words that at least K distinct users of the log "
        f"wrote in lower case (0: off; default {SHARED_WORD_USERS})",
    )
    parser.add_argument(
        "--max-words", type=int, default=0, dest="max_words", metavar="N",
        help="send each request (in a scenario or a precaution) as its first N words at most, "
        "after masking: fewer bytes and less of each request leaves, at some accuracy (see the "
        "README, \"Communication\"; default 0: whole requests)",
    )
    parser.add_argument(
        "--no-collapse", action="store_true",
        help="merge exact duplicates only; skip the embedding model",
    )
    parser.add_argument(
        "--skip-bad-lines", action="store_true",
        help="build from the good lines and report the malformed ones (default: fail)",
    )
    parser.add_argument(
        "--since-confidence", type=float, default=DEFAULT_SINCE_CONFIDENCE,
        dest="since_confidence", metavar="P",
        help="against the pulled global (--since) or the public probe set (--probe), also leave "
        "out the scenarios it already routes to their tool with calibrated confidence >= P "
        "(default %(default)s; above 1: off)",
    )
    parser.add_argument(
        "--max-bytes", type=int, default=None, dest="max_bytes", metavar="B",
        help="send at most B canonical bytes: the statistics, then scenarios in turns over the "
        "tools, then precautions; the rest waits for a later round",
    )
    parser.add_argument("--embedding-model", default=None, help="sentence-transformers model/path")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_allow_weaker_masking(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-weaker-masking", action="store_true", dest="allow_weaker_masking",
        help="send text masked more weakly than the open round's expected λ, or with no masking "
        "recorded (default: refused before anything is sent); text that still holds what "
        "masking at the round's λ removes from any text is refused all the same, before it is "
        "sent (the server refuses it too)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check a compendium against the federation's schema")
    validate.add_argument("compendium")
    validate.add_argument("--schema", required=True, help="schema.json (python manage.py export_schema)")
    validate.add_argument(
        "--lambda", dest="strength", type=_strength, default=None,
        help="check the text as the server does against a round expecting this λ: nothing "
        "masking at λ removes from any text (names, numbers, identifiers, contact details) may "
        "remain (default: the λ the compendium records)",
    )
    validate.set_defaults(func=cmd_validate)

    build = sub.add_parser("build", help="build the local compendium from a usage log")
    build.add_argument("--log", required=True, help="usage log, one JSON object per line")
    build.add_argument("--schema", required=True, help="schema.json from the server")
    build.add_argument("--out", required=True, help="compendium file to write")
    build.add_argument(
        "--since", default=None, metavar="GLOBAL",
        help="the global compendium last pulled: send only what it does not already cover "
        "(the server carries it forward)",
    )
    build.add_argument(
        "--probe", default=None, metavar="PROBE",
        help="before any global is published: probe.json from fetch-probe; leave out the "
        "scenarios that its router (the public probe set alone) already sends to their tool "
        "with calibrated confidence >= --since-confidence, as --since does against a global",
    )
    _add_build_options(build)
    build.set_defaults(func=cmd_build)

    inspect = sub.add_parser("inspect", help="dry run: show exactly what would leave this client")
    inspect.add_argument("compendium")
    inspect.add_argument("--schema", help="also validate against this schema.json")
    inspect.set_defaults(func=cmd_inspect)

    submit = sub.add_parser("submit", help="submit a compendium to the open round")
    submit.add_argument("compendium")
    submit.add_argument(
        "--no-gzip", action="store_true", dest="no_gzip",
        help="send the body uncompressed (default: Content-Encoding gzip)",
    )
    submit.add_argument(
        "--since", default=None, metavar="GLOBAL",
        help="the global compendium last pulled (as for build --since): the body goes as dcz, "
        "zstd against it, which the server also holds (about 37%% fewer bytes than gzip)",
    )
    submit.add_argument(
        "--schema", default=None,
        help="before any global is published: dcz against schema.json instead (ignored with "
        "--since)",
    )
    submit.add_argument(
        "--probe", default=None,
        help="with --schema: probe.json from fetch-probe goes before the schema in the dictionary "
        "(about a fifth fewer bytes in the first round on MetaTool)",
    )
    _add_allow_weaker_masking(submit)
    _add_server_arguments(submit)
    submit.set_defaults(func=cmd_submit)

    pull = sub.add_parser("pull", help="download the published global compendium")
    pull.add_argument(
        "--out", required=True,
        help="where to save it (ETag kept in OUT.etag, its routing head in OUT.head.npz, the "
        "schema in force in OUT.schema.json)",
    )
    pull.add_argument("--round", type=int, default=None, help="a given round (default: latest)")
    pull.add_argument(
        "--router", action="store_true",
        help="also download the routing encoder the server tuned on this global (about 90 MB; "
        "only changed files) into OUT.router/, so that route ranks exactly as the server does",
    )
    _add_server_arguments(pull)
    pull.set_defaults(func=cmd_pull)

    participate = sub.add_parser(
        "participate",
        help="one client round: fetch the schema and the latest global, build, submit (for cron)",
    )
    participate.add_argument("--log", required=True, help="usage log, one JSON object per line")
    participate.add_argument(
        "--dir", required=True,
        help="folder for schema.json, global.json, probe.json and compendium.json (kept between "
        "rounds: the global's ETag saves downloading it again)",
    )
    _add_build_options(
        participate, lambda_default=None,
        lambda_help="masking strength λ >= 0 (default: the λ the open round expects, which is 1.0 "
        "when its configuration names none, as the server checks it)",
        field_cap_help="F*: at most this many tools per user feed the numeric statistics "
        "(default: the open round's field_cap; a larger one is refused, a smaller one is stricter)",
    )
    _add_allow_weaker_masking(participate)
    _add_server_arguments(participate)
    participate.set_defaults(func=cmd_participate)

    status = sub.add_parser(
        "status", help="the open round, what this client submitted to it, the latest global"
    )
    status.add_argument(
        "--require-submitted",
        action="store_true",
        help="exit with status 3 when this client's part of the open round is not done, for a "
        "scheduler to run participate again: no submission of it is in effect and (with --dir) "
        "participate did not record that it had nothing new to send in the round (the pulled "
        "global covers everything: that round is done too); 0 otherwise, also with no round open",
    )
    status.add_argument(
        "--dir", default=None,
        help="participate's --dir: its record (sent.json) of the rounds in which it had nothing "
        "new to send, which --require-submitted counts as done (without it, such a round exits 3)",
    )
    _add_server_arguments(status)
    status.set_defaults(func=cmd_status)

    fetch_probe = sub.add_parser(
        "fetch-probe", help="download the public probe set's requests (for submit --probe)"
    )
    fetch_probe.add_argument("--out", required=True, help="where to save it, e.g. probe.json")
    _add_server_arguments(fetch_probe)
    fetch_probe.set_defaults(func=cmd_fetch_probe)

    from routing.cli import add_route_command  # the same router the server uses

    add_route_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from compendium.client_api import ClientError

    for stream in (sys.stdout, sys.stderr):
        # a stream in another encoding than UTF-8 (stdout redirected to a file on Windows is
        # cp1252): λ (--help's too) and the users' text as escapes, not a UnicodeEncodeError
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    _WARNED_IN_CLEAR.clear()
    try:
        return args.func(args)
    except (CliError, ClientError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `synapse-client inspect c.json | head`
        sys.stderr.close()
        return 1
    except OSError as exc:  # a file or folder a command needed (e.g. pull --router's copy)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{PROG}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
