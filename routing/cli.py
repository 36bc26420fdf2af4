"""`synapse-client route`: route a query in memory against a pulled global compendium, with the
encoder the server tuned on it when `synapse-client pull --router` saved it beside the compendium
(COMPENDIUM.router/), else with the frozen model and the published head; never to a tool of the
global that the schema in force `pull` saved beside it (COMPENDIUM.schema.json) does not list,
as the routing API never names a tool deactivated in the registry."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routing.router import RERANKERS, RoutingParams, RoutingParamsError, query_problem


def _load_compendium(path: str):
    from pydantic import ValidationError

    from compendium.client_api import global_document
    from compendium.schema import Compendium
    from compendium.validation import DuplicateKey, no_duplicate_keys, validation_summary

    try:
        doc = json.loads(  # a byte-order mark too
            Path(path).read_text(encoding="utf-8-sig"), object_pairs_hook=no_duplicate_keys
        )
    except FileNotFoundError:
        raise SystemExit(
            f"synapse-client: no compendium at {path}: pull the global first "
            f"(synapse-client pull --out {path})"
        ) from None
    except OSError as exc:
        raise SystemExit(f"synapse-client: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SystemExit(f"synapse-client: {path} is not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"synapse-client: {path} is not valid JSON ({exc.msg})") from None
    except DuplicateKey as exc:  # one reader's "a" is another's "b"
        raise SystemExit(f"synapse-client: {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise SystemExit(f"synapse-client: {path} is not a compendium: it nests too deeply") from None
    except ValueError:  # an integer of more digits than Python reads (4,300)
        raise SystemExit(
            f"synapse-client: {path} is not a compendium: it holds a number of more than 4,300 "
            "digits"
        ) from None
    try:
        return Compendium.model_validate(global_document(doc))
    except ValidationError as exc:
        raise SystemExit(
            f"synapse-client: {path} is not a compendium: {validation_summary(exc)}"
        ) from None


def _cached_head(router, documents, folder: Path):
    """The compendium's linear head as the server fits it at publication (scenario and
    description embeddings by the merge engine), kept on disk per compendium and engine."""
    import hashlib
    import zipfile

    from compendium.canonical import canonical_form
    from compendium.client_api import ClientError, write_atomically
    from routing.embeddings import TEXT_FORM, mark_used, prune_cache_folder
    from routing.router import LinearHead, fit_linear_head

    compendium = router.index.compendium
    key = hashlib.sha256(
        f"{canonical_form(compendium).sha256}|{getattr(documents, 'model_name', '')}"
        f"|{TEXT_FORM}".encode()
    ).hexdigest()[:32]
    path = folder / f"{key}.npz"
    if path.exists():
        try:
            head = LinearHead.from_bytes(path.read_bytes())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            head = None  # a damaged cache file is fitted and written again
        if head is not None and router.index.for_tools(head.tools) is not None:
            mark_used(path)
            return head
    head = fit_linear_head(compendium, router.index.embeddings, documents.embed)
    if head is not None:
        try:  # whole or not at all: a file cut short would be read back by every later call
            write_atomically(path, head.to_bytes())
        except ClientError:  # a read-only cache only costs the next call a refit
            return head
        prune_cache_folder(folder, keep=path, pattern="*.npz")
    return head


@dataclass
class PulledTunedRouter:
    """The server's tuned router as `synapse-client pull --router` saved it, checked against the
    compendium it routes (`pulled_tuned_router`)."""

    folder: Path
    loaded: object  # routing.finetune.LoadedTunedRouter
    scenario_embeddings: np.ndarray
    precaution_embeddings: np.ndarray
    round: int | None
    epochs: int | None


def _warn(message: str) -> None:
    print(f"synapse-client: warning: {message}", file=sys.stderr)


def pulled_tuned_router(compendium, folder: Path | None) -> PulledTunedRouter | None:
    """The tuned router in `folder` when it was tuned on `compendium` (its manifest names the
    compendium's sha256 and lists its files); None when there is none, and None after a warning
    when the folder is there but cannot be used (routing then goes on with the frozen model).
    The saved vectors are used when they are aligned with this copy's rows (rows_sha256);
    otherwise the rows are embedded again with the tuned model."""
    from compendium.canonical import canonical_form
    from routing.finetune import (
        embed_rows,
        load_tuned_router,
        manifest_problem,
        read_manifest,
        rows_digest,
    )

    if folder is None or not Path(folder).is_dir():
        return None
    folder = Path(folder)
    manifest = read_manifest(folder)
    problem = "it has no manifest" if manifest is None else manifest_problem(manifest)
    if not problem and manifest.get("global_sha256") != canonical_form(compendium).sha256:
        problem = (
            f"it was tuned on another global (round {manifest.get('round')}); pull with --router "
            "again"
        )
    if problem:
        _warn(f"ignoring the tuned router in {folder}: {problem}; routing with the frozen model")
        return None
    try:
        loaded = load_tuned_router(folder)
    except Exception as exc:  # a damaged folder must not stop routing
        _warn(
            f"ignoring the tuned router in {folder}: {exc.__class__.__name__}: {exc}; routing "
            "with the frozen model"
        )
        return None
    scenarios, precautions = loaded.scenario_embeddings, loaded.precaution_embeddings
    aligned = (
        manifest["rows_sha256"] == rows_digest(compendium)
        and len(scenarios) == len(compendium.scenarios)
        and len(precautions) == len(compendium.precautions)
    )
    if not aligned:
        scenarios, precautions = embed_rows(loaded.engine, compendium)
    epochs = manifest.get("epochs")
    return PulledTunedRouter(
        folder, loaded, scenarios, precautions,
        manifest.get("round") if isinstance(manifest.get("round"), int) else None,
        epochs if isinstance(epochs, int) else None,
    )


def pulled_router(
    compendium,
    *,
    embedding_model: str | None = None,
    reranker: str = "fusion",
    params_path: str | None = None,
    llm=None,
    escalate_threshold: float | None = None,
    linear_head: bool = True,
    head_path: Path | None = None,
    tuned: PulledTunedRouter | None = None,
    active_tools: frozenset[str] | None = None,
):
    """A router over a pulled global compendium that ranks as the server does: scenario
    embeddings by the merge engine (cached on disk per compendium), the linear head the server
    published with it (`head_path`, which `synapse-client pull` saves beside the compendium; when
    it is missing or belongs to other tools, a head fitted here from the compendium alone, cached
    too, without the server's probe set), the routing parameters fitted with that head (else
    `params_path`, else the defaults; `params_path` wins when given). With `tuned` (the
    server's tuned router, `pulled_tuned_router`) it routes as the server does once tuning is
    ready: queries and rows embedded by the tuned model, its head and fusion weights
    (`params_path` still overrides the weights). With `active_tools` (the schema in force's
    tools) it never names a tool it knows that is not among them, as the routing API never names
    a tool deactivated in the registry (`Router.excluded_tools`); None: every tool it knows.
    Raises `EmbeddingModelUnavailable` when the model cannot be loaded."""
    router = _pulled_router(
        compendium, embedding_model=embedding_model, reranker=reranker, params_path=params_path,
        llm=llm, escalate_threshold=escalate_threshold, linear_head=linear_head,
        head_path=head_path, tuned=tuned,
    )
    if active_tools is None:
        return router
    left_out = frozenset(router.index.tool_names) - active_tools
    return router.with_reranker(router.reranker, excluded_tools=left_out) if left_out else router


def _pulled_router(
    compendium, *, embedding_model, reranker, params_path, llm, escalate_threshold, linear_head,
    head_path, tuned,
):
    from routing.embeddings import embed_cached, get_engine, get_query_engine, model_cache_dir
    from routing.router import Router, RoutingParams

    if tuned is not None:
        loaded = tuned.loaded
        router = Router(
            compendium,
            loaded.engine,
            reranker,
            params=RoutingParams.load(params_path) if params_path else loaded.params,
            llm=llm,
            escalate_threshold=escalate_threshold,
            scenario_embeddings=tuned.scenario_embeddings,
            precaution_embeddings=tuned.precaution_embeddings,
        )
        head = loaded.head if linear_head else None
        if head is not None and router.index.for_tools(head.tools) is None:
            _warn(f"the tuned router in {tuned.folder} has a head for other tools; not using it")
            head = None
        return router.with_reranker(reranker, head=head) if head is not None else router

    engine = get_query_engine(embedding_model)
    # The server's stored scenario embeddings come from the merge engine
    # (SYNAPSE_EMBEDDING_MODEL): embedding them with the same engine here makes the client
    # rank as the server does, to the digit.
    documents = get_engine(embedding_model or None)
    cache = model_cache_dir() / "compendium-embeddings"
    router = Router(
        compendium,
        engine,
        reranker,
        params=RoutingParams.load(params_path),
        llm=llm,
        escalate_threshold=escalate_threshold,
        scenario_embeddings=embed_cached(documents, [s.text for s in compendium.scenarios], cache),
        precaution_embeddings=embed_cached(
            documents, [p.text for p in compendium.precautions], cache
        ),
    )
    if linear_head:
        head = _served_head(head_path, router) or _cached_head(
            router, documents, cache.parent / "routing-heads"
        )
        # the weights the server fitted with its head, as its routing API uses them
        router = router.with_reranker(
            reranker, head=head, params=RoutingParams.for_head(head, params_path)
        )
    return router


def probe_router(probe: list[tuple[str, str]], *, embedding_model: str | None = None):
    """What a client routes with before any global is published: the public probe set's
    labelled requests alone, as the server's router learns from them (`fit_router` over an
    empty compendium: the head on the whole probe, the fusion weights and calibration
    cross-fitted on its halves). The probe's vectors are cached on disk (`embed_cached`), so a
    client embeds them once. Raises `EmbeddingModelUnavailable` when the model cannot be
    loaded."""
    from compendium.schema import Compendium
    from routing.embeddings import embed_cached, get_engine, model_cache_dir
    from routing.router import fit_router

    engine = get_engine(embedding_model or None)
    vectors = embed_cached(
        engine, [text for text, _ in probe], model_cache_dir() / "compendium-embeddings"
    )
    return fit_router(
        Compendium(), engine, probe, "fusion", probe_vectors=vectors,
        fitted_on="public probe set",
    )


def _served_head(path: Path | None, router):
    """The head the server published with this compendium, when `path` holds it (its tools must
    be the index's); otherwise None, after a warning on stderr if the file is there but unusable."""
    import zipfile

    from routing.router import LinearHead

    if path is None or not Path(path).exists():
        return None
    try:
        head = LinearHead.from_bytes(Path(path).read_bytes())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        _warn(f"ignoring {path}: {exc}")
        return None
    if router.index.for_tools(head.tools) is None:
        _warn(f"ignoring {path}: it was published for other tools than this compendium's")
        return None
    dimension = router.index.embeddings.shape[1]
    if head.weights.shape != (len(head.tools), dimension) or head.bias.shape != (len(head.tools),):
        # e.g. --embedding-model names another model than the server's: every route would fail
        _warn(
            f"ignoring {path}: its weights have shape {head.weights.shape}, not "
            f"({len(head.tools)}, {dimension}) for this embedding model's vectors"
        )
        return None
    return head


def _schema_in_force(
    compendium_path: Path, named: str | None
) -> tuple[Path | None, frozenset[str] | None]:
    """The schema in force that `route` routes under, and its tools: the file `--schema` names,
    else the one `pull` saved beside the global (`schema_file`); (None, None) when none was
    named and none is there (a global pulled by hand, or by an older client: every tool of it
    is routed to). A file that cannot be read, or is no schema, is one line (SystemExit)."""
    from compendium.client_api import schema_file
    from compendium.client_cli import CliError, _load_schema  # `build`'s reading of a schema

    path = Path(named) if named else schema_file(compendium_path)
    if not named and not path.exists():
        return None, None
    try:
        return path, _load_schema(str(path)).tool_ids
    except CliError as exc:
        if named:
            raise SystemExit(f"synapse-client: --schema: {exc}") from None
        raise SystemExit(
            f"synapse-client: {exc}; pull again, or name the schema in force with --schema"
        ) from None


def cmd_route(args: argparse.Namespace) -> int:
    from compendium.client_api import head_file, router_dir
    from routing.embeddings import EmbeddingModelUnavailable
    from routing.llm import LLMUnavailable, get_llm

    if args.top_k < 1:
        raise SystemExit("synapse-client: --top-k must be at least 1")
    if args.escalate_below is not None and not 0 <= args.escalate_below <= 1:  # NaN too
        raise SystemExit(
            f"synapse-client: --escalate-below is a confidence in [0, 1], not {args.escalate_below:g}"
        )
    problem = query_problem(args.query)
    if problem:
        raise SystemExit(f"synapse-client: the query {problem}")
    if args.params:  # a file named and unusable is an error, never the defaults in silence
        try:
            RoutingParams.load(args.params)
        except RoutingParamsError as exc:
            raise SystemExit(f"synapse-client: --params: {exc}") from None
    compendium = _load_compendium(args.compendium)
    # before the model is loaded: a damaged file is said at once
    schema_path, active_tools = _schema_in_force(Path(args.compendium), args.schema)
    if not compendium.scenarios and not head_file(Path(args.compendium)).exists():
        raise SystemExit(
            f"synapse-client: {args.compendium} has no scenarios to route against, and no head "
            "was pulled with it (the server publishes one that routes from its public probe set)"
        )
    try:
        llm = get_llm(args.llm_url, args.llm_model) if args.reranker == "llm" else None
        tuned = (
            None if args.frozen else pulled_tuned_router(compendium, router_dir(Path(args.compendium)))
        )
        router = pulled_router(
            compendium,
            embedding_model=args.embedding_model,
            reranker=args.reranker,
            params_path=args.params,
            llm=llm,
            escalate_threshold=args.escalate_below,
            linear_head=not args.no_linear_head,
            head_path=head_file(Path(args.compendium)),
            tuned=tuned,
            active_tools=active_tools,
        )
    except (EmbeddingModelUnavailable, LLMUnavailable) as exc:
        raise SystemExit(f"synapse-client: {exc}") from None
    if not compendium.scenarios and router.head is None:  # nothing to route with: no decision
        why = (
            "--no-linear-head sets aside the head pulled with it" if args.no_linear_head
            else "the head pulled with it cannot be used (see the warning above); pull again"
        )
        raise SystemExit(
            f"synapse-client: {args.compendium} has no scenarios to route against, and {why}"
        )
    decision = router.route(args.query, args.top_k)
    left_out = sorted(router.excluded_tools)
    if args.json:  # "tuned_router" as in the routing API's answers; the rest the client's own
        print(json.dumps({
            **decision.as_dict(), "tuned_router": tuned is not None,
            "schema": str(schema_path) if schema_path else None, "excluded_tools": left_out,
        }, indent=2))
        return 0
    if decision.tool is None:  # every tool of the global left out: the routing API's answer
        print(f"tool: none ({decision.fallback_reason}" + (
            f": the schema in force, {schema_path}, lists none of the tools of "
            f"{args.compendium}: {', '.join(left_out)})" if left_out else ")"
        ))
        return 0
    flag = "  ESCALATE to a human" if decision.escalate else ""
    print(f"tool: {decision.tool}  confidence: {decision.confidence:.3f}{flag}")
    if tuned is not None:
        epochs = f", {tuned.epochs} epoch(s)" if tuned.epochs else ""
        print(f"encoder: tuned by the server on the global of round {tuned.round}{epochs}")
    print(f"reranker: {decision.reranker}" + (
        f" ({decision.fallback_reason})" if decision.fallback_reason else ""
    ))
    if left_out:
        print(f"left out (not in the schema in force, {schema_path}): {', '.join(left_out)}")
    print("tools ranked (score; best scenario cosine; head probability):")
    for rank, r in enumerate(decision.ranking, start=1):
        cosine = f"{r['best_cosine']:.4f}" if r["backed"] else "no scenario"
        head = f"; {r['head_probability']:.3f}" if "head_probability" in r else ""
        warned = "; a precaution matched" if r["precaution_matched"] else ""
        print(f"  {rank}. {r['score']:.4f}  {r['tool']} ({cosine}{head}{warned})")
    print("nearest scenarios:")
    for rank, c in enumerate(decision.candidates, start=1):
        print(f"  {rank}. {c['score']:.4f}  {c['tool']}: {c['scenario']}")
    for text in decision.precautions:
        print(f"  precaution: {text}")
    if decision.template:
        print(f"template: {decision.template}")
    return 0


def add_route_command(subparsers) -> argparse.ArgumentParser:
    route = subparsers.add_parser(
        "route", help="route a query to a tool with a pulled global compendium (in memory)"
    )
    route.add_argument("query", help="the request to route (not empty)")
    route.add_argument(
        "--compendium", required=True, help="global.json (GET /api/v1/compendium/global/)"
    )
    route.add_argument(
        "--reranker", choices=RERANKERS, default="fusion",
        help="fusion (default), none (the nearest scenario's tool) or llm (an LLM picks; "
        "falls back to fusion, saying why)",
    )
    route.add_argument(
        "--top-k", type=int, default=5, dest="top_k",
        help="how many nearest scenarios to list (default 5; the decision does not depend on it)",
    )
    route.add_argument(
        "--params", default=None,
        help="a fitted routing parameters file (JSON) that overrides the ones published with "
        "the global",
    )
    route.add_argument(
        "--escalate-below", type=float, default=None, dest="escalate_below",
        help="flag the decision for a human below this confidence (default: the parameters', 0.5)",
    )
    route.add_argument(
        "--embedding-model", default=None, dest="embedding_model",
        help="sentence-transformers model/path (default: $SYNAPSE_EMBEDDING_MODEL, else the "
        "bundled MiniLM)",
    )
    route.add_argument("--llm-url", default=None, dest="llm_url", help="OpenAI-compatible base URL")
    route.add_argument("--llm-model", default=None, dest="llm_model", help="the model to ask there")
    route.add_argument("--json", action="store_true", help="print the decision as JSON")
    route.add_argument(
        "--no-linear-head", action="store_true", dest="no_linear_head",
        help="route without the linear head the server uses (fitted on the compendium, cached)",
    )
    route.add_argument(
        "--schema", default=None,
        help="the schema in force (GET /api/v1/compendium/schema/): the global's tools it does "
        "not list, deactivated in the registry since, are never named (default: "
        "COMPENDIUM.schema.json, which pull saves beside the global, when it is there)",
    )
    route.add_argument(
        "--frozen", action="store_true",
        help="route with the frozen model even when COMPENDIUM.router/ holds the encoder the "
        "server tuned on this global (saved by pull --router)",
    )
    route.set_defaults(func=cmd_route)
    return route


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="synapse-client")
    add_route_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
