"""Server-side routing: the published global compendium, pgvector retrieval, latency records.

The decision code is the client toolkit's (`routing.router.Router`). The served version's scenario
embeddings are loaded from pgvector once; retrieval is an exact cosine product over them by default
(`SYNAPSE_ROUTING_RETRIEVAL=memory`, the client's own ranking), or a pgvector query per request
(`exact` scan or `hnsw` index, see `PgvectorRetriever`); the batch path always multiplies the
cached matrix. The router of a published version
is built once per process and cached by the version's id and sha256. Tools the registry has
deactivated since (read with the published version) are excluded from its decisions by routers
derived from it (`ServedCompendium.without_tools`), nothing rebuilt.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta

import numpy as np
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Aggregate, Count, FloatField, Sum
from django.db.models.functions import Coalesce, TruncHour
from django.utils import timezone

from compendium.models import CompendiumVersion, PrecautionEntry, ScenarioEntry, Tool
from compendium.schema import Precaution, Scenario
from compendium.services import load_compendium
from routing.models import RoutingCall, TunedRouter
from routing.router import (
    RERANKERS,
    LinearHead,
    Router,
    RoutingParams,
    RoutingParamsError,
    ScenarioIndex,
    query_problem,
    rescore,
)


class RoutingUnavailable(Exception):
    """The routing API cannot route now (503), saying why."""


class NothingPublished(RoutingUnavailable):
    """No global compendium has been published yet."""


class ServedVersionGone(RoutingUnavailable):
    """pgvector holds no row of the served version any more (an erasure or a re-materialized
    round deleted it while a process still served it)."""


class RouterBuildFailed(RoutingUnavailable):
    """The published global's router could not be built, and no router was served before it
    (or the one served before is of a global that no longer exists: an erasure deleted it).
    Its text says why (an exception's: a server path, a database's host): for the operator;
    `public` says the same without why, for every other caller."""

    def __init__(self, message: str, public: str):
        super().__init__(message)
        self.public = public


class RateLimited(Exception):
    """The caller routed more queries this minute than SYNAPSE_ROUTE_RATE_LIMIT allows."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RoutingInputError(ValueError):
    """A request the router cannot take, with what is wrong."""


def max_query_chars() -> int:
    return int(getattr(settings, "SYNAPSE_MAX_QUERY_CHARS", 2000))


def max_batch() -> int:
    return int(getattr(settings, "SYNAPSE_MAX_ROUTE_BATCH", 1000))


def rate_limit() -> int:
    """Queries one caller may route a minute (a batch counts each query); 0: no limit."""
    return settings.SYNAPSE_ROUTE_RATE_LIMIT


def caller_key(user) -> str:
    """Who is routing, for the rate limit: a routing token, a federation client, or a person
    (their tokens and browser sessions share one allowance)."""
    token = getattr(user, "token", None)  # routing.authentication.RoutingPrincipal
    if token is not None:
        return f"routing-token:{token.pk}"
    client = getattr(user, "client", None)  # federation.api.authentication.ClientPrincipal
    if client is not None:
        return f"client:{client.pk}"
    return f"user:{user.pk}"


def admit(caller: str, queries: int, now: float | None = None) -> float | None:
    """Count `queries` routed queries against `caller`'s allowance for the current minute,
    shared by every server process (`federation.ratelimit`). Over it, the request is refused
    whole (RateLimited, with the seconds until the minute ends) and counts nothing; a batch larger
    than the allowance itself could never pass, so it is bad input."""
    from federation import ratelimit

    limit = rate_limit()
    if limit <= 0:
        return None
    if queries > limit:
        raise RoutingInputError(
            f"a batch of {queries} queries is more than one caller may route in a minute "
            f"({limit}, SYNAPSE_ROUTE_RATE_LIMIT): send at most {limit} at a time"
        )
    now = time.time() if now is None else now
    key = f"route:{caller}"
    decision = ratelimit.hit(key, limit, 60, now, amount=queries)
    if decision.allowed:
        return now  # for `give_back`
    ratelimit.take_back(key, ratelimit.window(60, now).start, amount=queries)
    used = decision.count - queries
    raise RateLimited(
        f"rate limit: this caller routed {used} of its {limit} queries a minute "
        f"(SYNAPSE_ROUTE_RATE_LIMIT) and asked for {queries} more; retry in "
        f"{decision.retry_after} s",
        decision.retry_after,
    )


def give_back(caller: str, queries: int, admitted: float | None) -> None:
    """Uncount `queries` that `admit` counted at `admitted` (what it returned) for a request
    that then routed nothing (a 503)."""
    from federation import ratelimit

    if admitted is not None:
        ratelimit.take_back(f"route:{caller}", ratelimit.window(60, admitted).start, amount=queries)


def llm_batch_seconds() -> float:
    """How long one batch may spend on LLM calls before its other queries fall back to fusion."""
    return float(getattr(settings, "SYNAPSE_LLM_BATCH_SECONDS", 30))


def validate_query(query, where: str = "query") -> str:
    if not isinstance(query, str):
        raise RoutingInputError(f"{where} must be a string")
    problem = query_problem(query)
    if problem:
        raise RoutingInputError(f"{where} {problem}")
    if len(query) > max_query_chars():
        raise RoutingInputError(
            f"{where} is too long: {len(query)} characters, at most {max_query_chars()}"
        )
    return query


MAX_TOP_K = 50  # candidates a request may ask to be shown (the API document says so)


def validate_top_k(top_k) -> int:
    """top_k as an int: null (None) is the default, 5; a whole float (5.0) is its integer, since
    JSON has one number type and several clients write whole numbers so; 5.5, a bool or a
    string is refused."""
    if top_k is None:
        return 5
    if isinstance(top_k, float) and top_k.is_integer() and 1 <= top_k <= MAX_TOP_K:
        top_k = int(top_k)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise RoutingInputError(f"top_k must be an integer between 1 and {MAX_TOP_K}")
    return top_k


def validate_reranker(reranker) -> str:
    if reranker is None:
        return getattr(settings, "SYNAPSE_ROUTING_RERANKER", "fusion") or "fusion"
    if reranker not in RERANKERS:
        raise RoutingInputError(f"reranker must be one of {', '.join(RERANKERS)}")
    return reranker


def remove_router_folder(instance, **_signal) -> None:
    """post_delete of a TunedRouter: its folder is removed once the deletion commits."""
    import shutil

    from django.db import transaction

    directory = instance.directory
    if directory:
        transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))


def published_global_version() -> CompendiumVersion | None:
    """The latest global compendium whose round is published."""
    return (
        CompendiumVersion.objects.filter(kind=CompendiumVersion.Kind.GLOBAL, round__state="published")
        .defer("routing_head")  # read once per version, by `build_served`
        .select_related("round")
        .order_by("-round__number")
        .first()
    )


# Which version is published (with its ready tuned router's folder and the tools the registry
# has deactivated), remembered for a moment so that a routing call does not ask the database every
# time. A save or delete of a round, compendium version, tuned router or registry tool in this
# process forgets it at once (routing.apps connects the signals); other processes notice within
# the TTL.
_published: tuple[float, CompendiumVersion | None, str, frozenset[str]] | None = None


def version_ttl() -> float:
    return float(getattr(settings, "SYNAPSE_ROUTING_VERSION_TTL", 2.0))


def forget_published_version(**_signal) -> None:
    global _published
    _published = None


def inactive_tools() -> frozenset[str]:
    """The tools the operator has deactivated in the registry: no routing answer names them."""
    return frozenset(Tool.objects.filter(active=False).values_list("tool_id", flat=True))


def _current_version() -> tuple[CompendiumVersion | None, str, frozenset[str]]:
    """The published global, the folder of its ready tuned router ("" when there is none) and
    the deactivated tools."""
    global _published
    now = time.monotonic()
    remembered = _published  # one read: another thread may forget it meanwhile
    if remembered is not None and now - remembered[0] < version_ttl():
        return remembered[1:]
    version = published_global_version()
    directory, inactive = "", frozenset()
    if version is not None:  # "nothing published" is not remembered: the first publish is seen
        directory = (
            TunedRouter.objects.filter(version=version, state=TunedRouter.State.READY)
            .values_list("directory", flat=True)
            .first()
        ) or ""
        inactive = inactive_tools()
        _published = (now, version, directory, inactive)
    return version, directory, inactive


# --- pgvector retrieval -----------------------------------------------------------------------------

HNSW_DEFAULT_EF_SEARCH = 40
HNSW_MAX_EF_SEARCH = 1000


def _raw_connection():
    """The psycopg connection under Django's, with pgvector's binary type adapters registered
    (once per physical connection)."""
    connection.ensure_connection()
    raw = connection.connection
    if not getattr(raw, "_synapse_vector_registered", False):
        from pgvector.psycopg import register_vector

        register_vector(raw)
        raw._synapse_vector_registered = True
    return raw


class PgvectorRetriever:
    """Top-n scenarios of one version by cosine distance in pgvector.

    Used when settings.SYNAPSE_ROUTING_RETRIEVAL is `exact` or `hnsw`. The default, `memory`, needs
    no retriever: the served version's embeddings (loaded from pgvector) are already in memory for
    the reranker, and an exact product over them takes 0.2 ms for 5,000 scenarios, ranking exactly
    as the client toolkit does. `exact`: an exact scan of the version's rows in pgvector (same
    ranking; 5.5 ms for 4,761 scenarios with pgvector 0.6). `hnsw`: the HNSW index (about 0.5 ms),
    approximate: on MetaTool about 1% of decisions differed from the exact ones.

    The query vector travels in pgvector's binary format with the statement bound on the server
    (a 384-float text literal, parsed twice per query, cost more than the search itself). The HNSW
    index is shared by every stored version, so its scan is filtered by version after the fact:
    ef_search (the candidates the scan keeps) is raised in proportion to the share of the index
    that belongs to this version, and whenever the answer still comes up short, an exact scan of
    the version's rows answers instead, so the caller always gets min(n, rows) scenarios in exact
    cosine order. Given the served index's vectors, it asks for 16 rows beyond n
    (`ScenarioIndex.RESCORED_BEYOND`) and returns the best n rescored on them (`rescore`), the
    scores the in-memory retrieval and the batch path give.
    """

    _SQL = (
        "SELECT id, embedding <=> %(q)s FROM compendium_scenarioentry "
        "WHERE version_id = %(v)s AND embedding IS NOT NULL{excluded} ORDER BY {order} LIMIT %(n)s"
    )

    MODES = ("exact", "hnsw")  # settings.SYNAPSE_ROUTING_RETRIEVAL also takes "memory"

    def __init__(
        self,
        version_id: int,
        entry_ids: np.ndarray,
        indexed_rows: int | None = None,
        mode: str = "exact",
        entry_tools: np.ndarray | None = None,
        embeddings: np.ndarray | None = None,
    ):
        if mode not in self.MODES:
            raise ValueError(f"unknown retrieval mode {mode!r}: choose memory, exact or hnsw")
        self.mode = mode
        self.version_id = version_id
        self.position = {int(pk): i for i, pk in enumerate(entry_ids)}
        self.available = len(entry_ids)
        # Rows with embeddings in the whole index, when the served version was loaded.
        self.indexed_rows = max(indexed_rows or self.available, self.available, 1)
        self.exact_fallbacks = 0
        # The registry row (Tool pk) of each entry, and those whose rows are never returned.
        self.entry_tools = np.asarray(entry_tools if entry_tools is not None else [], dtype=np.int64)
        self.excluded: tuple[int, ...] = ()
        # The served index's vectors (row i of entry i): the shortlist pgvector returns is
        # rescored on them as the in-memory retrieval rescores its own (`rescore`), so a query
        # gets the same scores alone (pgvector's float32 distances) as in a batch (one product).
        self.embeddings = embeddings

    def without_tools(self, tool_pks) -> PgvectorRetriever:
        """This retriever leaving out the rows of the registry rows `tool_pks` (deactivated)."""
        narrowed = copy.copy(self)
        narrowed.excluded = tuple(sorted(int(pk) for pk in tool_pks))
        narrowed.available = int((~np.isin(self.entry_tools, narrowed.excluded)).sum())
        return narrowed

    def ef_search(self, n: int) -> int:
        share = self.available / self.indexed_rows
        wanted = int(np.ceil(2 * n / max(share, 1e-9)))
        return int(min(HNSW_MAX_EF_SEARCH, max(HNSW_DEFAULT_EF_SEARCH, wanted)))

    def _query(self, vector, n: int, exact: bool) -> list[tuple[int, float]]:
        import psycopg

        raw = _raw_connection()
        # The exact scan breaks ties by row, as the in-memory retrieval does by position (rows
        # are loaded by id): one text sent for two tools is retrieved alike both ways, for any n.
        # HNSW orders by distance alone (a second key would keep the planner off the index).
        order = "(embedding <=> %(q)s) + 0, id" if exact else "embedding <=> %(q)s"
        with psycopg.Cursor(raw) as cursor:  # server-side binding, binary vector
            if not exact:  # a search setting only; set each time (a rollback would undo it)
                cursor.execute(f"SET hnsw.ef_search = {self.ef_search(n)}")
            params = {"q": vector, "v": self.version_id, "n": n}
            excluded = ""
            if self.excluded:  # deactivated tools' rows
                excluded, params["x"] = " AND tool_id <> ALL(%(x)s)", list(self.excluded)
            cursor.execute(self._SQL.format(order=order, excluded=excluded), params, binary=True)
            return cursor.fetchall()

    def __call__(self, vector: np.ndarray, n: int):
        n = min(n, self.available)
        vector = np.asarray(vector, dtype=np.float32)
        # With the vectors at hand, a shortlist as long as the in-memory retrieval's, rescored.
        wanted = n if self.embeddings is None else min(n + ScenarioIndex.RESCORED_BEYOND, self.available)
        rows = self._query(vector, wanted, exact=self.mode == "exact")
        if len(rows) < wanted:
            self.exact_fallbacks += 1
            rows = self._query(vector, wanted, exact=True)
            if len(rows) < wanted:
                raise ServedVersionGone(
                    f"the served global (version {self.version_id}) was deleted while this "
                    "request routed with it; ask again"
                )
        idx = np.array([self.position[pk] for pk, _ in rows], dtype=np.int64)
        if self.embeddings is not None:
            return rescore(self.embeddings, idx, vector, n)
        scores = np.array([1.0 - d for _, d in rows], dtype=np.float32)
        return idx, scores


# --- the served compendium ----------------------------------------------------------------------


@dataclass
class ServedCompendium:
    version_id: int
    sha256: str
    round_number: int
    index: ScenarioIndex
    retriever: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
    routers: dict[str, Router]
    tuned: bool = False  # routed with the encoder tuned on this version (federation.tuning)
    # The registry row (pk) of each tool the routers know, to leave a deactivated tool's rows
    # out of a pgvector retrieval; the tools left out of these routers' decisions.
    tool_pks: dict[str, int] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()
    # The last `without_tools` answer (deactivations change rarely): (tools, ServedCompendium).
    _narrowed: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def without_tools(self, inactive: frozenset[str]) -> ServedCompendium:
        """These routers deciding without the `inactive` tools they know (their scenarios not
        retrieved, the head not bringing them into the pool): derived from the built ones, with
        no model or row loaded again; itself when it knows none of them."""
        known = set(self.routers["fusion"].index.tool_names)
        excluded = frozenset(inactive) & known
        if excluded == self.excluded:
            return self
        narrowed = self._narrowed
        if narrowed is not None and narrowed[0] == excluded:
            return narrowed[1]
        retriever = self.retriever
        if isinstance(retriever, PgvectorRetriever):
            retriever = retriever.without_tools(
                self.tool_pks[t] for t in excluded if t in self.tool_pks
            )
        outside = retriever if isinstance(retriever, PgvectorRetriever) else None
        routers = {
            name: router.with_reranker(name, retriever=outside, excluded_tools=excluded)
            for name, router in self.routers.items()
        }
        served = replace(
            self, retriever=outside or routers["fusion"].retrieve, routers=routers,
            excluded=excluded,
        )
        self._narrowed = (excluded, served)
        return served


_served: dict[tuple[int, str, str], ServedCompendium] = {}
_served_lock = threading.Lock()
# The last build that failed: (key, when, why, whether the router served before may go on).
_failed: tuple[tuple[int, str, str], float, str, bool] | None = None


def forget_served() -> None:
    """Drop this process's router and the memory of a failed build: the next request builds."""
    global _failed
    with _served_lock:
        _served.clear()
        _failed = None


def rebuild_seconds() -> float:
    """SYNAPSE_ROUTING_REBUILD_SECONDS: how long after a failed build the next one is tried."""
    return float(getattr(settings, "SYNAPSE_ROUTING_REBUILD_SECONDS", 30))


def check_routing_params_setting() -> None:
    """At start-up (`RoutingConfig.ready`): SYNAPSE_ROUTING_PARAMS, when set, must be a routing
    parameters file, or the process stops with one line saying why. Settings check only that the
    file is there; one that is there but not a parameters file (a JSON of something else, a
    hand edit's typo) started, and every router build logged a warning and routed with other
    weights than the operator's. A file broken after start-up still only warns
    (`routing_params`): routing goes on."""
    configured = getattr(settings, "SYNAPSE_ROUTING_PARAMS", "") or None
    if configured:
        try:
            RoutingParams.load(configured)
        except RoutingParamsError as exc:
            raise ImproperlyConfigured(f"SYNAPSE_ROUTING_PARAMS={configured!r}: {exc}") from None


def routing_params(head: LinearHead | None = None, fitted: RoutingParams | None = None) -> RoutingParams:
    """The fusion weights and calibration of the served routers: the operator's file
    SYNAPSE_ROUTING_PARAMS when set, else `fitted` (the tuned router's), else those published
    with `head` (`RoutingParams.for_head`), as `synapse-client route --params` decides."""
    configured = getattr(settings, "SYNAPSE_ROUTING_PARAMS", "") or None
    if configured:
        try:
            return RoutingParams.load(configured)
        except RoutingParamsError as exc:
            # A broken operator file must not stop routing, nor be ignored without a word.
            logging.getLogger(__name__).warning(
                "SYNAPSE_ROUTING_PARAMS: %s; routing with the parameters fitted with the global "
                "(else routing/default_params.json) instead",
                exc,
            )
    return fitted if fitted is not None else RoutingParams.for_head(head)


def served_rows(version: CompendiumVersion):
    """The version's compendium as the routing API serves it, with its stored scenario and
    precaution rows: scenarios in row id order (pgvector answers with their ids), only those
    with embeddings."""
    scenario_rows = list(
        ScenarioEntry.objects.filter(version=version, embedding__isnull=False)
        .select_related("tool")
        .order_by("id")
    )
    precaution_rows = list(
        PrecautionEntry.objects.filter(version=version).select_related("tool").order_by("id")
    )
    compendium = load_compendium(version)
    compendium.scenarios = [
        Scenario(tool_id=r.tool.tool_id, text=r.text, preconditions=r.preconditions, support=r.support)
        for r in scenario_rows
    ]
    compendium.precautions = [
        Precaution(tool_id=r.tool.tool_id, text=r.text, support=r.support) for r in precaution_rows
    ]
    return compendium, scenario_rows, precaution_rows


def served_llm():
    """The configured LLM for the LLM reranker, or None; one that cannot be loaded is an
    UnusableLLM (routing with `reranker: llm` then falls back to fusion, saying why)."""
    from routing.llm import NOT_LOADED, UnusableLLM, get_llm

    try:
        return get_llm(
            getattr(settings, "SYNAPSE_LLM_BASE_URL", None),
            getattr(settings, "SYNAPSE_LLM_MODEL", None),
            getattr(settings, "SYNAPSE_LLM_API_KEY", None),
        )
    except Exception as exc:  # LLMUnavailable, or llama.cpp refusing a broken file
        logging.getLogger(__name__).warning("routing without its LLM: %s", exc)
        return UnusableLLM(f"the configured LLM could not be loaded: {exc}", public=NOT_LOADED)


def build_served(version: CompendiumVersion, tuned_directory: str = "") -> ServedCompendium:
    """The routers of `version` (with the encoder tuned on it when `tuned_directory` holds one)."""
    compendium, scenario_rows, precaution_rows = served_rows(version)
    tuned = _tuned_parts(version, compendium, tuned_directory) if tuned_directory else None
    if tuned is not None:
        compendium, engine, index, fitted, head = tuned
        retriever = index.retrieve  # pgvector holds the frozen model's vectors
        params = routing_params(head, fitted)
    else:
        engine, index = _frozen_index(compendium, scenario_rows, precaution_rows)
        retriever = _retriever(version, index, scenario_rows)
        head = _stored_head(version, index)
        params = routing_params(head)
    llm = served_llm()
    routers = {
        name: Router(
            compendium, engine, name, params=params, llm=llm, index=index, retriever=retriever,
            head=head,
        )
        for name in RERANKERS
    }
    return ServedCompendium(
        version.pk, version.sha256, version.round.number, index, retriever, routers,
        tuned=tuned is not None,
        tool_pks={r.tool.tool_id: r.tool_id for r in scenario_rows},
    )


def query_engine():
    """The engine the server embeds routing queries with, for the stored vectors of the
    configured SYNAPSE_EMBEDDING_MODEL (`embeddings.get_query_engine`)."""
    from routing.embeddings import get_query_engine

    return get_query_engine(documents_model=settings.SYNAPSE_EMBEDDING_MODEL)


def _frozen_index(compendium, scenario_rows, precaution_rows):
    """The query engine and the index over the stored (frozen model's) vectors."""
    from routing.embeddings import get_engine

    engine = query_engine()
    scenario_vectors = np.array([r.embedding for r in scenario_rows], dtype=np.float32).reshape(
        len(scenario_rows), engine.dimension
    )
    missing = [i for i, r in enumerate(precaution_rows) if r.embedding is None]
    precaution_vectors = np.zeros((len(precaution_rows), engine.dimension), dtype=np.float32)
    for i, r in enumerate(precaution_rows):
        if r.embedding is not None:
            precaution_vectors[i] = np.asarray(r.embedding, dtype=np.float32)
    if missing:  # by the engine that embeds stored rows, as the client toolkit does
        documents = get_engine(getattr(settings, "SYNAPSE_EMBEDDING_MODEL", "") or None)
        precaution_vectors[missing] = documents.embed([precaution_rows[i].text for i in missing])
    return engine, ScenarioIndex(compendium, engine, scenario_vectors, precaution_vectors)


def _retriever(version, index: ScenarioIndex, scenario_rows):
    mode = getattr(settings, "SYNAPSE_ROUTING_RETRIEVAL", "memory")
    if mode == "memory":
        return index.retrieve
    return PgvectorRetriever(
        version.pk,
        np.array([r.pk for r in scenario_rows]),
        indexed_rows=ScenarioEntry.objects.filter(embedding__isnull=False).count(),
        mode=mode,
        entry_tools=np.array([r.tool_id for r in scenario_rows]),
        embeddings=index.embeddings,
    )


def _tuned_parts(version, served, directory: str):
    """(compendium, engine, index, params, head) of the encoder tuned on `version`
    (`federation.tuning`): queries and the global embedded by the tuned model, its own head and
    fusion weights. The saved vectors are aligned with the published content's rows (what
    clients pull: their copies use the same files), or, in a folder tuned before its manifest
    said so, with the `served` rows. None, with a warning, when its folder cannot be read or does
    not match the version: routing goes on with the frozen model."""
    from routing.finetune import load_tuned_router, read_manifest, rows_digest

    try:
        tuned = load_tuned_router(directory)
        manifest = read_manifest(directory) or {}
        compendium = load_compendium(version)
        if manifest.get("rows_sha256") != rows_digest(compendium):
            compendium = served
        if len(tuned.scenario_embeddings) != len(compendium.scenarios):
            raise ValueError("its vectors do not match the global's scenarios")
        index = ScenarioIndex(
            compendium, tuned.engine, tuned.scenario_embeddings, tuned.precaution_embeddings
        )
        if tuned.head is not None and index.for_tools(tuned.head.tools) is None:
            raise ValueError("its head was fitted on another compendium's tools")
    except Exception as exc:  # a lost or foreign folder must not stop routing
        logging.getLogger(__name__).warning(
            "round %s: the tuned router in %s cannot be used (%s: %s); routing with the frozen "
            "model", version.round.number, directory, exc.__class__.__name__, exc,
        )
        return None
    return compendium, tuned.engine, index, tuned.params, tuned.head


def _stored_head(version: CompendiumVersion, index: ScenarioIndex) -> LinearHead | None:
    """The linear head fitted when `version` was published, if it matches the served index
    (versions published before heads existed route without one)."""
    data = CompendiumVersion.objects.filter(pk=version.pk).values_list("routing_head", flat=True)
    data = data.first()
    if not data:
        return None
    head = LinearHead.from_bytes(data)
    if index.for_tools(head.tools) is None:
        logging.getLogger(__name__).warning(
            "round %s: the stored routing head does not match the served scenarios; routing "
            "without it", version.round.number,
        )
        return None
    return head


def served_compendium() -> ServedCompendium:
    """The routers of the published global, deciding without the tools the registry has
    deactivated since (`ServedCompendium.without_tools`)."""
    version, tuned_directory, inactive = _current_version()
    return _served_version(version, tuned_directory).without_tools(inactive)


def _served_version(version: CompendiumVersion | None, tuned_directory: str) -> ServedCompendium:
    if version is None:
        raise NothingPublished(
            "no global compendium is published yet: routing starts after the first round is "
            "published"
        )
    key = (version.pk, version.sha256, tuned_directory)
    served = _served.get(key)
    if served is not None:
        return served
    # A switch (a new global, or its tuned router becoming ready) loads a model and embeds or
    # reads the global: one request builds it while the others go on with the one served so far
    # (as stale as the version TTL already allows); only the very first build, and one that
    # replaces a deleted global, is waited for.
    previous = next(iter(tuple(_served.values())), None)
    if previous is not None and previous.version_id != version.pk and not _alive(previous):
        # Its global was deleted (an erasure re-materialized it): this request waits for the
        # current one rather than route with an erased client's scenarios meanwhile.
        previous = None
    if _recently_failed(key):
        return _instead_of_failed(version, previous)
    if not _served_lock.acquire(blocking=previous is None):
        return previous
    try:
        served = _served.get(key)
        if served is None:
            if _recently_failed(key):  # it failed while this request waited for the lock
                return _instead_of_failed(version, previous)
            served = _build(key, version, tuned_directory, previous)
            if served is None:
                return _instead_of_failed(version, previous)
            _served.clear()  # only the current version is kept
            _served[key] = served
    finally:
        _served_lock.release()
    return served


def serves_tuned(version_id: int, tuned_directory: str) -> bool | None:
    """Whether this process's router of `version_id`, built with the tuned router in
    `tuned_directory`, routes with it (False: its folder could not be used, the frozen model
    routes); None when this process has not built that router. Builds nothing."""
    for (pk, _sha256, directory), served in tuple(_served.items()):
        if pk == version_id and directory == tuned_directory:
            return served.tuned
    return None


def _drop(served: ServedCompendium) -> None:
    """Forget `served` (its global is gone) and which global is published: the next request
    asks the database and builds the current one, rather than going on with `served`."""
    for key, value in tuple(_served.items()):
        if value.version_id == served.version_id:  # `served` may be derived from it
            _served.pop(key, None)
    forget_published_version()


def _alive(served: ServedCompendium) -> bool:
    """Whether `served`'s global still exists (an erasure deletes the globals it re-makes)."""
    return CompendiumVersion.objects.filter(pk=served.version_id).exists()


def _recently_failed(key) -> bool:
    failed = _failed
    return failed is not None and failed[0] == key and time.monotonic() - failed[1] < rebuild_seconds()


def _build(key, version: CompendiumVersion, tuned_directory: str, previous):
    """`build_served`, or None when it fails (remembered in `_failed`, with whether `previous`
    may go on: the next build is tried SYNAPSE_ROUTING_REBUILD_SECONDS later, not by every
    request meanwhile)."""
    global _failed
    try:
        served = build_served(version, tuned_directory)
    except Exception as exc:
        reason = f"{exc.__class__.__name__}: {exc}"
        logging.getLogger(__name__).exception(
            "building the router of round %s failed; tried again in %.0f s",
            version.round.number, rebuild_seconds(),
        )
        # The router served before goes on only while its global exists (not after an erasure
        # deleted it: it would route with an erased client's scenarios).
        alive = previous is not None and _alive(previous)
        _failed = (key, time.monotonic(), reason, alive)
        return None
    _failed = None
    return served


def _instead_of_failed(version: CompendiumVersion, previous):
    """What a request gets while the build of `version`'s router is failing: the router served
    before (when its global still exists), else RouterBuildFailed saying why."""
    failed = _failed
    if previous is not None and failed is not None and failed[3]:
        return previous
    reason = failed[2] if failed is not None else "unknown error"
    what = f"the router of round {version.round.number}'s global could not be built"
    again = f"it is tried again within {rebuild_seconds():.0f} s"
    raise RouterBuildFailed(
        f"{what} ({reason}); {again}",
        f"{what} (the operator's log says why); {again}",
    )


def warm_up() -> bool:
    """Build this process's served router and route one request, so that the first real
    request does not pay for loading the model and the global (seconds). Called by each gunicorn
    worker as it starts (`gunicorn.conf.py`). True when a router is warm; False when nothing is
    published yet or the build failed (logged: the first request then builds it and says why)."""
    from django.db import connections

    try:
        served_compendium().routers["fusion"].route("warm-up request", 1)
        return True
    except NothingPublished:
        return False
    except Exception as exc:  # the first request will meet the same error, and report it
        logging.getLogger(__name__).warning("warming up the router failed: %s: %s",
                                            exc.__class__.__name__, exc)
        return False
    finally:
        connections.close_all()  # this thread's; it ends here


# What a caller other than the operator reads of a fallback whose decision gave no public reason.
WITHHELD_FALLBACK = "the requested reranker did not decide (the operator's routing page says why)"


def shown_fallback_reason(decision, reveal: bool) -> str | None:
    """A decision's `fallback_reason` as its caller may read it. Why the LLM was unavailable
    names the server's insides (the endpoint's URL, a model file's path, the endpoint's error
    text): the operator's (`reveal`); any other caller (a routing token, a client, a member)
    reads the decision's public reason, worded where the failure was raised
    (`routing.llm.LLMUnavailable.public`): what kind of failure it was, and that the operator
    can see why. Neither is read from the other's text."""
    if reveal or decision.fallback_reason is None:
        return decision.fallback_reason
    return decision.public_fallback_reason or WITHHELD_FALLBACK


def _payload(decision, served: ServedCompendium, latency_ms: float, reveal: bool = False) -> dict:
    return {
        "tool": decision.tool,
        "confidence": decision.confidence,
        "escalate": decision.escalate,
        "candidates": decision.candidates,
        "precautions": decision.precautions,
        "template": decision.template,
        "reranker": decision.reranker,
        "fallback_reason": shown_fallback_reason(decision, reveal),
        "ranking": decision.ranking,
        "compendium_round": served.round_number,
        "tuned_router": served.tuned,
        "latency_ms": round(latency_ms, 3),
    }


def route_query(
    query: str,
    top_k: int | None = 5,
    reranker: str | None = None,
    record: bool = True,
    caller: str | None = None,
    reveal: bool = False,
) -> dict:
    """Route one query against the published global compendium (retrieval in pgvector). Its
    latency joins the routing API's traffic figures unless `record` is false (the dashboard's
    playground: people trying queries are not the API's traffic). With a `caller` (the API's),
    a valid query counts against its rate limit (`admit`) once there is a global to route it
    against. Why an LLM fallback happened is told in full only with `reveal` (the operator:
    `shown_fallback_reason`)."""
    started = time.perf_counter()
    query = validate_query(query)
    top_k = validate_top_k(top_k)
    reranker = validate_reranker(reranker)
    served = served_compendium()  # before admit: a 503 (nothing published) routed nothing
    admitted = admit(caller, 1) if caller is not None else None
    try:
        decision = served.routers[reranker].route(query, top_k)
    except ServedVersionGone:  # a router of a deleted global (pgvector retrieval): the current one
        _drop(served)
        try:
            served = served_compendium()
        except RoutingUnavailable:  # none: a 503, which routed nothing and counts nothing
            give_back(caller, 1, admitted)
            raise
        decision = served.routers[reranker].route(query, top_k)
    latency = (time.perf_counter() - started) * 1000
    if record:
        # counted under the reranker that decided, or the one asked for when none did
        recorder.record(latency, 1, decision.reranker or reranker, served.round_number)
    return _payload(decision, served, latency, reveal)


def route_queries(
    queries, top_k: int | None = 5, reranker: str | None = None, caller: str | None = None,
    reveal: bool = False,
) -> dict:
    """Route many queries at once: one embedding batch, one matrix product (exact cosine). With a
    `caller`, a valid batch counts each of its queries against its rate limit (`admit`)."""
    started = time.perf_counter()
    if not isinstance(queries, list) or not queries:
        raise RoutingInputError("queries must be a non-empty list of strings")
    if len(queries) > max_batch():
        raise RoutingInputError(f"too many queries: {len(queries)}, at most {max_batch()}")
    for i, q in enumerate(queries):
        validate_query(q, f"queries[{i}]")
    top_k = validate_top_k(top_k)
    reranker = validate_reranker(reranker)
    served = served_compendium()  # before admit: a 503 (nothing published) routed nothing
    if caller is not None:
        admit(caller, len(queries))
    router = served.routers[reranker]
    overrides = {}
    if reranker == "llm" and router.llm is not None:
        from routing.llm import BudgetedLLM

        overrides["llm"] = BudgetedLLM(router.llm, llm_batch_seconds())
    decisions = router.with_reranker(reranker, retriever=None, **overrides).route_batch(queries, top_k)
    latency = (time.perf_counter() - started) * 1000
    deciding = Counter(d.reranker or reranker for d in decisions).most_common(1)[0][0]
    recorder.record(latency, len(queries), deciding, served.round_number, batch=True)
    return {
        "compendium_round": served.round_number,
        "tuned_router": served.tuned,
        "latency_ms": round(latency, 3),
        "results": [_payload(d, served, latency / len(queries), reveal) for d in decisions],
    }


# --- latency records ------------------------------------------------------------------------------


class LatencyRecorder:
    """An in-memory buffer of routing-call latencies, bulk-inserted every `flush_every` calls and,
    by a background thread of each process that records, within `flush_seconds` of a call (an
    idle process's calls must not wait for its next call to be counted), so that recording costs
    a list append on the request path."""

    def __init__(self, flush_every: int = 200, flush_seconds: float = 5.0, maxlen: int = 100_000):
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self._buffer: deque[RoutingCall] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self.background = True  # the tests flush explicitly, inside their transactions

    def record(self, latency_ms: float, queries: int, reranker: str, round_number: int | None,
               batch: bool = False):
        self._buffer.append(
            RoutingCall(
                at=timezone.now(),
                latency_ms=latency_ms,
                queries=queries,
                batch=batch,
                reranker=reranker,
                compendium_round=round_number,
            )
        )
        if len(self._buffer) >= self.flush_every:
            self.flush()
        else:
            self._start_flusher()

    def _start_flusher(self) -> None:
        # Started on the first call of each process (a thread does not survive a fork: each
        # gunicorn worker starts its own).
        if not self.background or (self._flusher is not None and self._flusher.is_alive()):
            return
        with self._lock:
            if self._flusher is None or not self._flusher.is_alive():
                self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                                 name="routing-latency-flush")
                self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            time.sleep(self.flush_seconds)
            if self._buffer:
                self.flush()
                connection.close()  # this thread's own connection: not held between flushes

    def flush(self) -> int:
        with self._lock:
            rows = []
            while self._buffer:
                rows.append(self._buffer.popleft())
        if rows:
            try:
                RoutingCall.objects.bulk_create(rows, batch_size=1000)
            except Exception:  # a failed flush must never fail a routing call
                logging.getLogger(__name__).warning("routing latency records lost: %s could not be stored", len(rows),
                            exc_info=True)
                return 0
        return len(rows)


recorder = LatencyRecorder()


class Percentile(Aggregate):
    """PostgreSQL's continuous percentile, `percentile_cont(f) WITHIN GROUP (ORDER BY x)`: the
    figures are computed where the rows are, not by loading a day of calls into Python."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: str, fraction: float, **extra):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("a percentile's fraction lies in [0, 1]")
        super().__init__(expression, fraction=repr(float(fraction)), **extra)


QUANTILES = {"p50_ms": 0.5, "p95_ms": 0.95, "p99_ms": 0.99}


def latency_figures(quantiles: dict[str, float] = QUANTILES) -> dict:
    """Aggregates of a set of routing calls: how many, their queries, latency quantiles (ms)."""
    return {
        "calls": Count("id"),
        "queries": Coalesce(Sum("queries"), 0),
        **{name: Percentile("latency_ms", q) for name, q in quantiles.items()},
    }


def routing_latency(window: timedelta = timedelta(hours=1), reranker: str | None = None) -> dict:
    """Calls, queries and p50/p95/p99 of routing-call latencies over the last `window` (this
    process's buffer included; other server processes' buffers are at most about
    `recorder.flush_seconds` behind)."""
    recorder.flush()
    calls = RoutingCall.objects.filter(at__gte=timezone.now() - window)
    if reranker:
        calls = calls.filter(reranker=reranker)
    return calls.aggregate(**latency_figures())


def single_query_latency(calls) -> list[dict]:
    """Per reranker, the single-query calls among `calls` (the latency a caller of POST
    /api/v1/route/ sees; a batch's latency is the whole batch's): one row each, in one query."""
    return list(
        calls.filter(batch=False).order_by().values("reranker")
        .annotate(**latency_figures()).order_by("reranker")
    )


@dataclass
class RoutingTraffic:
    """The routing API's traffic as the operator's dashboard shows it."""

    window: timedelta
    # single-query calls per reranker over the last hour and over `window`, each row with its
    # "window" label
    recent: list[dict]
    # batch calls (POST /api/v1/route/batch/) over `window`: their queries per second of latency
    batch: dict
    # single-query calls per hour over `window`, oldest first
    hourly: list[dict]
    retention_days: int
    calls: int  # every call over `window`, single and batch


def routing_traffic(window: timedelta = timedelta(hours=24), now=None) -> RoutingTraffic:
    recorder.flush()
    now = now or timezone.now()
    since = now - window
    calls = RoutingCall.objects.filter(at__gte=since, at__lte=now)
    recent = []
    for label, start in (("1 h", now - timedelta(hours=1)), (_window_label(window), since)):
        recent += [{"window": label, **row} for row in single_query_latency(calls.filter(at__gte=start))]
    batches = calls.filter(batch=True).aggregate(
        calls=Count("id"), queries=Coalesce(Sum("queries"), 0), seconds=Sum("latency_ms")
    )
    batch = {
        "calls": batches["calls"],
        "queries": batches["queries"],
        "queries_per_second": batches["queries"] / (batches["seconds"] / 1000.0)
        if batches["seconds"]
        else None,
    }
    hourly = list(
        calls.filter(batch=False)
        .annotate(hour=TruncHour("at"))
        .values("hour")
        .annotate(**latency_figures({"p50_ms": 0.5, "p95_ms": 0.95}))
        .order_by("hour")
    )
    return RoutingTraffic(window, recent, batch, hourly, retention_days(), calls.count())


def _window_label(window: timedelta) -> str:
    hours = window.total_seconds() / 3600
    return f"{hours:g} h"


def retention_days() -> int:
    return int(getattr(settings, "SYNAPSE_ROUTING_CALL_RETENTION_DAYS", 30))


def prune_routing_calls(now=None) -> int:
    """Delete latency records older than SYNAPSE_ROUTING_CALL_RETENTION_DAYS (Celery beat runs
    this hourly, so that a busy routing API's table holds a bounded number of rows); returns how
    many went."""
    recorder.flush()
    cutoff = (now or timezone.now()) - timedelta(days=retention_days())
    deleted, _ = RoutingCall.objects.filter(at__lt=cutoff).delete()
    return deleted
