"""The router: query -> tool, against a global compendium (paper, "Inference-time routing").

Pure (numpy + rank-bm25, no Django): the client toolkit routes in memory with it and the server
uses the very same decision code with pgvector retrieval plugged in as the retriever.

1. Retrieve the top-k scenarios by cosine similarity (normalized embeddings, so a dot product).
2. Rerank, by name:
   - `none`: the top-1 cosine candidate's tool (the paper's reranker bypass);
   - `fusion` (default without an LLM): per tool of a candidate pool, dense similarity (best
     cosine), lexical BM25 (normalized in the pool), the tool's share of the top-k, a penalty
     for a precaution of the tool that matches the query and the linear head's log-probability
     (whose best tools join the pool, including tools that the public probe set labels but that
     have no scenario in the compendium yet); a linear score with weights fitted on a labelled
     probe set (`fit_fusion_weights`, conditional logit);
   - `llm`: the LLM picks one of the top-k candidates and so its parent tool; a malformed answer or
     a down endpoint falls back to `fusion`, with the reason recorded in the decision.
3. Confidence: a calibrated probability that the chosen tool is right (Platt scaling over the
   chosen tool's score and its margin to the runner-up, fitted on the probe set by
   `fit_calibration`, which reports the expected calibration error); `escalate` below a threshold.

A router built with `excluded_tools` (the server's: tools the registry has deactivated since the
global was published) decides over the other tools alone: their scenarios are never retrieved and
the head never brings them into the pool, so no decision, candidate or ranking names them; the
remaining tools are scored as they would be with them.
"""

from __future__ import annotations

import copy
import json
import random
import re
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from compendium.schema import Compendium
from compendium.validation import no_duplicate_keys

RERANKERS = ("fusion", "none", "llm")
DEFAULT_PARAMS_PATH = Path(__file__).with_name("default_params.json")
# Words for the lexical feature: runs of letters and digits of any script (not [a-z0-9], which
# left a request in Cyrillic or Chinese without a token); ASCII text reads as [a-z0-9]+ did.
_TOKEN = re.compile(r"[^\W_]+")

# (indices into the scenario list, cosine scores), best first
Retrieved = tuple[np.ndarray, np.ndarray]
Retriever = Callable[[np.ndarray, int], Retrieved]


try:  # BLAS threads fight over busy cores: a 2-thread mat-vec took 6-12 ms here, 1 thread 0.2 ms
    from threadpoolctl import ThreadpoolController

    _blas = ThreadpoolController()

    def single_thread_blas():
        return _blas.limit(limits=1, user_api="blas")

except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn/scipy stacks
    from contextlib import nullcontext as single_thread_blas


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


_SURROGATE = re.compile("[\ud800-\udfff]")


def query_problem(query: str) -> str | None:
    """What makes `query` unroutable, or None: an empty one (nothing but whitespace, control or
    format characters), or one holding a lone surrogate (a broken escape or a mis-decoded
    argument), which no tokenizer can read. The routing API
    and `synapse-client route` refuse both with this reason."""
    if not query.strip():
        return "is empty"
    if all(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in query):
        # NULs, escapes, zero-width characters: no text, yet routed as if it were some
        return (
            "is empty: it holds nothing but whitespace, control or format characters "
            f"(U+{ord(query.strip()[0]):04X} first)"
        )
    bad = _SURROGATE.search(query)
    if bad:
        return (
            f"contains a lone surrogate U+{ord(bad.group()):04X} at position {bad.start()} "
            "(not valid Unicode text; check the encoding of what sent it)"
        )
    return None


@dataclass
class RoutingDecision:
    tool: str | None
    confidence: float
    escalate: bool
    candidates: list[dict] = field(default_factory=list)  # [{tool, scenario, score}], best first
    precautions: list[str] = field(default_factory=list)  # the chosen tool's, most relevant first
    template: str | None = None
    # The reranker that decided; None when none did (nothing to rank: no scenario, no head).
    reranker: str | None = "fusion"
    # Why the requested reranker did not decide: another did (an LLM fallback), or none did.
    # In full: the operator's (it may name the LLM endpoint's URL, a model file's path).
    fallback_reason: str | None = None
    # The best-scored tools, best first: why the decision went as it did (`Router.ranking`).
    ranking: list[dict] = field(default_factory=list)
    # `fallback_reason` as anyone else may read it (`LLMUnavailable.public`), set with it.
    public_fallback_reason: str | None = None

    def as_dict(self) -> dict:
        """The decision as its own router's user reads it (synapse-client route --json): the
        fallback reason in full."""
        out = asdict(self)
        del out["public_fallback_reason"]
        return out


@dataclass
class FusionWeights:
    dense: float = 10.0
    bm25: float = 1.0
    vote: float = 1.0
    # A precaution of a tool whose similarity to the query reaches the threshold costs the tool
    # `precaution` * (1 + how far above the threshold it is, scaled to [0, 1]).
    precaution: float = 5.0
    precaution_threshold: float = 0.6
    head: float = 0.0  # weight of the linear head's log-probability (0: no head, or unfitted)
    # Added to a candidate tool without scenarios in the compendium (one the head knows from the
    # public probe set only; its dense, bm25 and vote features are 0). Fitted with the others
    # when the probe has such candidates; unfitted, such a tool wins only on a strong head score.
    unbacked: float = 0.0


@dataclass
class Calibration:
    """P(chosen tool is right) = sigmoid(score_coef * score + margin_coef * margin + intercept)."""

    score_coef: float = 4.0
    margin_coef: float = 4.0
    intercept: float = -2.0

    def probability(self, score: float, margin: float) -> float:
        z = self.score_coef * score + self.margin_coef * margin + self.intercept
        return float(1.0 / (1.0 + np.exp(-np.clip(z, -50, 50))))


def _whole(where: str, value) -> int:
    """A count read from a parameters file: an integer, or a float that is one (JSON writers may
    write 5.0). Not int() of anything: 2.5 was cut to 2, "5" read as 5, and infinity (1e999 in
    the file) raised OverflowError, past the ValueError a broken file is refused with."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (
        isinstance(value, float) and not value.is_integer()
    ):
        raise ValueError(f"{where} must be a whole number, not {value!r}")
    return int(value)


class RoutingParamsError(ValueError):
    """A routing parameters file that was named but cannot be used, with why."""


@dataclass
class RoutingParams:
    """Everything fitted on the probe set, stored as a small JSON file."""

    weights: FusionWeights = field(default_factory=FusionWeights)
    calibration: dict[str, Calibration] = field(
        default_factory=lambda: {name: Calibration() for name in RERANKERS}
    )
    pool: int = 20  # scenarios considered by fusion (>= top_k)
    # Scenarios that vote, and the options the LLM reranker is shown: what the weights and the
    # calibration were fitted with. A caller's top_k only sets how many candidates are shown.
    top_k: int = 5
    escalate_threshold: float = 0.5
    fitted_on: str = ""  # what the parameters were fitted on
    report: dict = field(default_factory=dict)  # ECE before/after, accuracy on the probe set

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, doc: dict) -> RoutingParams:
        """The parameters `doc` holds; ValueError naming the first value no router can route
        with (a weight that is not a finite number, a top_k or pool below 1, an escalation
        threshold outside [0, 1]), so that a broken file is refused where it is read, not by
        every routing call that uses it."""
        params = cls(
            weights=FusionWeights(**doc.get("weights", {})),
            calibration={k: Calibration(**v) for k, v in doc.get("calibration", {}).items()}
            or {name: Calibration() for name in RERANKERS},
            pool=_whole("pool", doc.get("pool", 20)),
            top_k=_whole("top_k", doc.get("top_k", 5)),
            escalate_threshold=float(doc.get("escalate_threshold", 0.5)),
            fitted_on=str(doc.get("fitted_on", "")),
            report=dict(doc.get("report", {})),
        )
        numbers = [(f"weights.{k}", v) for k, v in asdict(params.weights).items()] + [
            (f"calibration.{name}.{k}", v)
            for name, cal in params.calibration.items()
            for k, v in asdict(cal).items()
        ]
        for where, value in numbers:
            if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
                raise ValueError(f"{where} must be a finite number, not {value!r}")
        for where, value in (("pool", params.pool), ("top_k", params.top_k)):
            if value < 1:
                raise ValueError(f"{where} must be at least 1, not {value}")
        if not 0.0 <= params.escalate_threshold <= 1.0:  # NaN too
            raise ValueError(
                f"escalate_threshold is a confidence in [0, 1], not {params.escalate_threshold:g}"
            )
        return params

    @classmethod
    def load(cls, path: str | Path | None = None) -> RoutingParams:
        """The parameters in the file at `path`; without one, `routing/default_params.json`
        (the built-in values when that is gone). A named file that cannot be read or is not a
        parameters file raises `RoutingParamsError` saying so: never the defaults in silence."""
        if not path:
            if not DEFAULT_PARAMS_PATH.exists():
                return cls()
            path = DEFAULT_PARAMS_PATH
        path = Path(path)
        try:
            # utf-8-sig: a file saved with a byte-order mark (Notepad, PowerShell) reads as it shows
            # a key given twice (one reader's "a", another's "b") refused, naming it
            doc = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=no_duplicate_keys)
        except OSError as exc:
            raise RoutingParamsError(
                f"cannot read routing parameters {path}: {exc.strerror}"
            ) from None
        except RecursionError:  # was a traceback (the CLI) or a 500 on every route (the server)
            raise RoutingParamsError(
                f"{path} is not a routing parameters file: it nests too deeply"
            ) from None
        except ValueError as exc:
            raise RoutingParamsError(f"{path} is not a routing parameters file: {exc}") from None
        if not isinstance(doc, dict) or not {"weights", "calibration"} & doc.keys():
            raise RoutingParamsError(
                f"{path} is not a routing parameters file (no 'weights' or 'calibration'; "
                "bench/route_accuracy.py --save-params writes one)"
            )
        try:
            return cls.from_dict(doc)
        except (TypeError, ValueError, AttributeError) as exc:
            raise RoutingParamsError(f"{path} is not a routing parameters file: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def for_head(cls, head: LinearHead | None, path: str | Path | None = None) -> RoutingParams:
        """The parameters a router with `head` uses: the file at `path` when given (an
        operator's choice); else those fitted with the head when its global was published
        (`LinearHead.params`); else `routing/default_params.json`. The routing API and
        `synapse-client route` both decide so."""
        if not path and head is not None and head.params is not None:
            return head.params
        return cls.load(path or None)


@dataclass
class LinearHead:
    """P(tool | query) by a multinomial logistic regression over the compendium's own scenario
    embeddings (and its tools' published descriptions): a linear read-out that pools every
    scenario of a tool instead of trusting its single nearest one. Row i of `weights` is tool
    `tools[i]`, the index's tool order. `params`: the fusion weights and calibration fitted on
    the probe set with this head (`fit_router`), which routers of its compendium use unless told
    otherwise; None: the configured ones."""

    tools: list[str]
    weights: np.ndarray  # (n_tools, dim), float32
    bias: np.ndarray  # (n_tools,)
    params: RoutingParams | None = None

    def log_proba(self, vectors: np.ndarray) -> np.ndarray:
        z = np.atleast_2d(vectors) @ self.weights.T + self.bias
        z -= z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    def to_bytes(self) -> bytes:
        import io

        buffer = io.BytesIO()
        extra = {} if self.params is None else {"params": np.array(self.params.to_json())}
        np.savez_compressed(
            buffer, tools=np.array(self.tools), weights=self.weights, bias=self.bias, **extra
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> LinearHead:
        """The head `to_bytes` wrote; ValueError saying why for anything else (a damaged or
        foreign archive), so that no reader of a head file meets another exception, nor a head
        that fails, or answers NaN, at its first route."""
        import io
        import zipfile
        import zlib

        if not zipfile.is_zipfile(io.BytesIO(bytes(data))):
            # not numpy's words, which advise loading such bytes as a pickle, unsafely
            raise ValueError("not an .npz archive")
        try:
            with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as npz:
                tools, weights, bias = npz["tools"], npz["weights"], npz["bias"]
                doc = json.loads(str(npz["params"])) if "params" in npz.files else None
        except (OSError, KeyError, EOFError, zipfile.BadZipFile, zlib.error, RecursionError) as exc:
            raise ValueError(f"not a routing head archive: {exc.__class__.__name__}: {exc}") from None
        arrays = (tools, weights, bias)
        if not all(isinstance(a, np.ndarray) for a in arrays) or tools.ndim != 1 or (
            tools.dtype.kind != "U" and tools.size
        ):
            raise ValueError("not a routing head: its tools are not a list of names")
        n = len(tools)
        if weights.ndim != 2 or weights.shape[0] != n or bias.shape != (n,):
            raise ValueError(
                f"not a routing head: weights {weights.shape} and bias {bias.shape} do not fit "
                f"{n} tools"
            )
        if weights.dtype.kind != "f" or bias.dtype.kind != "f" or not (
            np.isfinite(weights).all() and np.isfinite(bias).all()
        ):
            raise ValueError("not a routing head: its weights are not all finite numbers")
        if doc is not None and not isinstance(doc, dict):
            raise ValueError("not a routing head: its parameters are not a JSON object")
        try:
            params = RoutingParams.from_dict(doc) if doc is not None else None
        except (TypeError, AttributeError) as exc:  # ValueError passes as it is
            raise ValueError(f"not a routing head: its parameters: {exc}") from None
        return cls([str(t) for t in tools], weights, bias, params)


HEAD_C = 10.0  # inverse L2 strength of the head, for unit-norm sentence embeddings


def head_tools(compendium: Compendium, example_tools: Sequence[str] = ()) -> list[str]:
    """The tools a linear head ranks: those with scenarios in `compendium`, sorted, then those
    only labelled examples name, sorted."""
    backed = sorted({s.tool_id for s in compendium.scenarios})
    return backed + sorted(set(example_tools) - set(backed))


def fit_linear_head(
    compendium: Compendium,
    scenario_embeddings: np.ndarray,
    embed,
    c: float = HEAD_C,
    examples: tuple[np.ndarray, Sequence[str]] | None = None,
) -> LinearHead | None:
    """Fit the head on the scenarios' embeddings (row-aligned with `compendium.scenarios`) plus
    `examples`: public labelled requests (the probe set, as (vectors by the same engine, tool
    ids)); they are unmasked, real requests, the kind the router is asked; plus one row per tool
    of the head whose description the compendium publishes, embedded by `embed` (the engine that
    embedded the scenarios). Its tools are the compendium's tools with scenarios, sorted (as
    `ScenarioIndex.tool_names`), then the examples' other tools, sorted: tools the federation has
    no scenario of yet (a first round that released little, a new tool) stay routable from the
    public probe set alone (`ScenarioIndex.for_tools`). None when fewer than two tools:
    nothing to choose between."""
    from sklearn.linear_model import LogisticRegression

    tools = head_tools(compendium, examples[1] if examples is not None else ())
    if len(tools) < 2:
        return None
    position = {t: i for i, t in enumerate(tools)}
    x = np.asarray(scenario_embeddings, dtype=np.float32)
    y = np.array([position[s.tool_id] for s in compendium.scenarios], dtype=np.int64)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} scenario embeddings for {len(y)} scenarios")
    described = {m.tool_id: m.description for m in compendium.metadata if m.description}
    with_text = [t for t in tools if t in described]
    if with_text:
        x = np.vstack([x, np.asarray(embed([described[t] for t in with_text]), dtype=np.float32)])
        y = np.concatenate([y, np.array([position[t] for t in with_text], dtype=np.int64)])
    if examples is not None:
        vectors, labels = examples
        if len(vectors) != len(labels):
            raise ValueError(f"{len(vectors)} example vectors for {len(labels)} labels")
        if len(labels):
            x = np.vstack([x, np.asarray(vectors, dtype=np.float32)])
            y = np.concatenate([y, np.array([position[t] for t in labels], dtype=np.int64)])
    with warnings.catch_warnings():
        # Many tools with one or two rows each (a head over a small probe set alone, before any
        # global) is still a classification: sklearn's "could represent a regression" guess is not.
        warnings.filterwarnings(
            "ignore", message="The number of unique classes is greater than 50%",
            category=UserWarning,
        )
        model = LogisticRegression(C=c, max_iter=1000).fit(x, y)
    # Every tool has a scenario or an example, so the classes are exactly 0..len(tools)-1.
    coef, intercept = model.coef_, model.intercept_
    if len(tools) == 2:  # sklearn's binary form: logit of class 1 = its softmax with class 0 at 0
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.concatenate([[0.0], intercept])
    return LinearHead(
        tools, np.ascontiguousarray(coef, dtype=np.float32), np.asarray(intercept, dtype=np.float32)
    )


class PoolBM25:
    """rank_bm25's BM25Okapi over the scenarios, scoring a query against the few scenarios of a
    decision's pool with the very operations of its `get_batch_scores`, in the same order (the
    same floats), but without turning the whole corpus's document lengths into an array on every
    call: that conversion was most of a routing decision's time at 14,000 scenarios."""

    def __init__(self, corpus: list[list[str]]):
        from rank_bm25 import BM25Okapi

        self.okapi = BM25Okapi(corpus)
        okapi = self.okapi
        doc_len = np.array(okapi.doc_len)
        self._norm = okapi.k1 * (1 - okapi.b + okapi.b * doc_len / okapi.avgdl)

    def get_batch_scores(self, query: Sequence[str], doc_ids: Sequence[int]) -> list[float]:
        okapi = self.okapi
        score = np.zeros(len(doc_ids))
        norm = self._norm[doc_ids]
        for q in query:
            q_freq = np.array([(okapi.doc_freqs[di].get(q) or 0) for di in doc_ids])
            score += (okapi.idf.get(q) or 0) * (q_freq * (okapi.k1 + 1) / (q_freq + norm))
        return score.tolist()


class ScenarioIndex:
    """The compendium's scenarios and precautions with embeddings, BM25 and per-tool lookups."""

    def __init__(
        self,
        compendium: Compendium,
        engine,
        scenario_embeddings: np.ndarray | None = None,
        precaution_embeddings: np.ndarray | None = None,
    ):
        self.compendium = compendium
        scenarios = compendium.scenarios
        self.texts = [s.text for s in scenarios]
        self.tool_names = sorted({s.tool_id for s in scenarios})
        tool_pos = {t: i for i, t in enumerate(self.tool_names)}
        self.scenario_tool = np.array([tool_pos[s.tool_id] for s in scenarios], dtype=np.int64)
        dim = engine.dimension
        if scenario_embeddings is None:
            scenario_embeddings = engine.embed(self.texts) if self.texts else np.zeros((0, dim))
        self.embeddings = np.ascontiguousarray(scenario_embeddings, dtype=np.float32)
        if self.embeddings.shape != (len(self.texts), dim):
            raise ValueError(
                f"scenario embeddings have shape {self.embeddings.shape}, "
                f"expected ({len(self.texts)}, {dim})"
            )
        self.bm25 = PoolBM25([tokenize(t) or ["_"] for t in self.texts]) if self.texts else None
        # Precautions of tools that have scenarios (a tool that only the head knows has none here).
        precautions = [p for p in compendium.precautions if p.tool_id in tool_pos]
        self.precaution_texts = [p.text for p in precautions]
        self.precaution_tool = np.array([tool_pos[p.tool_id] for p in precautions], dtype=np.int64)
        if precaution_embeddings is None:
            precaution_embeddings = (
                engine.embed(self.precaution_texts) if precautions else np.zeros((0, dim))
            )
        elif len(precaution_embeddings) != len(compendium.precautions):
            raise ValueError("precaution embeddings must be row-aligned with compendium.precautions")
        else:
            keep = [i for i, p in enumerate(compendium.precautions) if p.tool_id in tool_pos]
            precaution_embeddings = np.asarray(precaution_embeddings)[keep]
        self.precaution_embeddings = np.ascontiguousarray(precaution_embeddings, dtype=np.float32)
        templates: dict[str, list[tuple[str, str]]] = {}
        for t in compendium.templates:
            templates.setdefault(t.tool_id, []).append((t.signature, t.template))
        self.templates = {tool: sorted(items)[0][1] for tool, items in templates.items()}
        order = np.argsort(self.scenario_tool, kind="stable")
        bounds = np.searchsorted(self.scenario_tool[order], np.arange(len(self.tool_names) + 1))
        self.rows_of_tool = [order[bounds[t] : bounds[t + 1]] for t in range(len(self.tool_names))]
        self.backed = len(self.tool_names)  # tool_names[:backed] have scenarios

    def __len__(self) -> int:
        return len(self.texts)

    def for_tools(self, tools: Sequence[str]) -> ScenarioIndex | None:
        """This index ranking `tools` (a linear head's): itself when they are its tools, a copy
        that also knows the tools after them (without scenarios: a head learnt them from the
        public probe set) when they begin with its tools, else None (a head of another
        compendium)."""
        tools = list(tools)
        backed = self.tool_names[: self.backed]
        if tools == self.tool_names:
            return self
        if tools[: self.backed] != backed or len(set(tools)) != len(tools):
            return None
        extended = copy.copy(self)
        extended.tool_names = tools
        extended.rows_of_tool = self.rows_of_tool[: self.backed] + [
            np.zeros(0, dtype=np.int64) for _ in tools[self.backed :]
        ]
        return extended

    def retrieve(self, query_vector: np.ndarray, n: int, blocked: np.ndarray | None = None) -> Retrieved:
        """Exact top-n by cosine, ties broken by scenario order (without the `blocked` rows)."""
        return self.nearest(query_vector, self.embeddings @ query_vector, n, blocked)

    # How many scenarios past the n-th by a float32 product's scores are scored again exactly.
    RESCORED_BEYOND = 16

    def nearest(
        self, query_vector: np.ndarray, scores: np.ndarray, n: int, blocked: np.ndarray | None = None
    ) -> Retrieved:
        """The top-n of `scores` (the query's cosines to every scenario, from a float32 product:
        the query's own, or its row of a batch's), with their cosines computed again so that
        they do not depend on that product. BLAS sums a product in an order set by its shape,
        so a query's row of a batch's product differed in the last bits from its product alone,
        and from its row in a batch of another size: the same query got other scores and at
        times another confidence from /api/v1/route/ than from /api/v1/route/batch/. Products of
        float32 numbers are exact in float64, and each row is summed in the same order whatever
        the rows beside it, so the nearest n + RESCORED_BEYOND by `scores` are scored so, and
        the best n of those kept (ties broken by scenario order, as `top_n`). `blocked`: a mask
        of rows never to return (scenarios of excluded tools)."""
        if blocked is not None:
            scores = np.where(blocked, -np.inf, scores)
        idx, _ = top_n(scores, n + self.RESCORED_BEYOND)
        if blocked is not None:  # fewer rows than asked for: the -inf ones came too
            idx = idx[~blocked[idx]]
        return rescore(self.embeddings, idx, query_vector, n)


def rescore(embeddings: np.ndarray, idx: np.ndarray, query_vector: np.ndarray, n: int) -> Retrieved:
    """The best n of the shortlist `idx` (rows of `embeddings`) by their cosines to the query
    computed in float64 (products of float32 numbers are exact there, and each row is summed in
    one order), ties broken by row: the same scores whoever made the shortlist (a float32
    product of any shape, pgvector)."""
    idx = np.asarray(idx, dtype=np.int64)
    exact = (
        embeddings[idx].astype(np.float64) * np.asarray(query_vector, dtype=np.float64)
    ).sum(axis=1)
    order = np.lexsort((idx, -exact))[: max(n, 0)]
    return idx[order], exact[order]


def top_n(scores: np.ndarray, n: int) -> Retrieved:
    """The n best scores, best first, ties broken by position (the lowest first), whatever n:
    argpartition alone kept an arbitrary subset of the scores tied at the n-th, so scenarios of
    equal cosine (one text sent for two tools) were kept by position for one n and not for
    another, and a decision changed with how many candidates were asked to be shown."""
    n = min(n, len(scores))
    if n <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    if n < len(scores):
        negated = -scores
        cut = np.partition(negated, n - 1)[n - 1]  # minus the n-th best score
        above = np.flatnonzero(negated < cut)
        part = np.concatenate([above, np.flatnonzero(negated == cut)[: n - len(above)]])
    else:
        part = np.arange(len(scores))
    order = np.lexsort((part, -scores[part]))
    chosen = part[order]
    return chosen, scores[chosen]


@dataclass
class _Features:
    """Per candidate tool of one query: columns dense, bm25, vote, precaution match, head,
    unbacked (1: the tool has no scenario, the head alone put it in the pool)."""

    tools: np.ndarray  # tool positions
    matrix: np.ndarray  # (n_tools, 6)
    precaution_hits: dict[int, list[tuple[float, str]]]


class Router:
    def __init__(
        self,
        compendium: Compendium,
        engine,
        reranker: str = "fusion",
        *,
        params: RoutingParams | None = None,
        llm=None,
        escalate_threshold: float | None = None,
        scenario_embeddings: np.ndarray | None = None,
        precaution_embeddings: np.ndarray | None = None,
        retriever: Retriever | None = None,
        index: ScenarioIndex | None = None,
        document_engine=None,
        head: LinearHead | None = None,
        excluded_tools: Iterable[str] = (),
    ):
        if reranker not in RERANKERS:
            raise ValueError(f"unknown reranker {reranker!r}: choose one of {', '.join(RERANKERS)}")
        self.engine = engine
        self.reranker = reranker
        self.params = params or RoutingParams.load()
        self.llm = llm
        self.escalate_threshold = (
            self.params.escalate_threshold if escalate_threshold is None else escalate_threshold
        )
        # Scenarios and precautions are embedded by `document_engine` when given (the engine that
        # embedded the server's stored rows), queries always by `engine`.
        given = index or ScenarioIndex(
            compendium, document_engine or engine, scenario_embeddings, precaution_embeddings
        )
        self.index = given.for_tools(head.tools) if head is not None else given
        if self.index is None:
            raise ValueError("the linear head was fitted on another compendium's tools")
        if retriever is None or getattr(retriever, "__self__", None) is given:
            retriever = self.index.retrieve  # the same rows: keep batch retrieval in one product
        self.retriever = retriever
        self.head = head
        # Tools this router never names (`excluded_tools`), as positions in `index.tool_names`,
        # and the mask of their scenarios (None: nothing is excluded).
        self.excluded_tools = frozenset(excluded_tools)
        self._excluded = np.array(
            [i for i, t in enumerate(self.index.tool_names) if t in self.excluded_tools],
            dtype=np.int64,
        )
        self._blocked = (
            np.isin(self.index.scenario_tool, self._excluded) if len(self._excluded) else None
        )
        self._excluded_set = set(self._excluded.tolist())

    def with_linear_head(self, embed=None, examples=None) -> Router:
        """This router with a linear head fitted on its own index (descriptions embedded by
        `embed`, default: the query engine) and on labelled `examples` (see `fit_linear_head`)."""
        embed = embed or self.engine.embed
        index = self.index
        head = fit_linear_head(index.compendium, index.embeddings, embed, examples=examples)
        return self.with_reranker(self.reranker, head=head)

    def with_reranker(self, reranker: str, **overrides) -> Router:
        """The same index (no re-embedding) under another reranker or settings."""
        kwargs = {
            "params": self.params,
            "llm": self.llm,
            "escalate_threshold": self.escalate_threshold,
            "retriever": self.retriever if self.retriever != self.index.retrieve else None,
            "index": self.index,
            "head": self.head,
            "excluded_tools": self.excluded_tools,
        }
        kwargs.update(overrides)
        return Router(self.index.compendium, self.engine, reranker, **kwargs)

    # --- public API ------------------------------------------------------------------------------

    def route(self, query: str, top_k: int = 5) -> RoutingDecision:
        """The decision for `query`, with its `top_k` nearest scenarios as candidates. The
        decision itself does not depend on `top_k` (see `RoutingParams.top_k`)."""
        vector = self.engine.embed([query])[0]
        with single_thread_blas():
            return self.decide(query, vector, self.retrieve(vector, self._retrieve_n(top_k)), top_k)

    def route_batch(self, queries: Sequence[str], top_k: int = 5) -> list[RoutingDecision]:
        if not queries:
            return []
        vectors = self.engine.embed(list(queries))
        pool = self._retrieve_n(top_k)
        with single_thread_blas():
            if self.retriever == self.index.retrieve:  # one matrix product for the whole batch
                scores = vectors @ self.index.embeddings.T
                retrieved = [
                    self.index.nearest(v, row, pool, self._blocked)
                    for v, row in zip(vectors, scores, strict=True)
                ]
            else:
                retrieved = [self.retrieve(v, pool) for v in vectors]
            return [
                self.decide(q, v, r, top_k)
                for q, v, r in zip(queries, vectors, retrieved, strict=True)
            ]

    def retrieve(self, vector: np.ndarray, n: int) -> Retrieved:
        """The retriever's top-n scenarios (positions in `index`, and their cosines) without the
        scenarios of excluded tools (an outside retriever, such as the server's pgvector one, is
        asked to leave them out itself; any it returns anyway are dropped)."""
        if self._blocked is None:
            return self.retriever(vector, n)
        if self.retriever == self.index.retrieve:
            return self.index.retrieve(vector, n, self._blocked)
        idx, scores = self.retriever(vector, n)
        keep = ~self._blocked[idx]
        return idx[keep], scores[keep]

    # --- the decision ----------------------------------------------------------------------------

    def _pool(self, top_k: int) -> int:
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        return top_k if self.reranker == "none" else max(top_k, self.params.pool)

    def _retrieve_n(self, top_k: int) -> int:
        """Scenarios to retrieve: the decision's pool, or more when more are to be shown."""
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        return max(self._pool(self.params.top_k), top_k)

    def decide(
        self, query: str, vector: np.ndarray, retrieved: Retrieved, top_k: int = 5
    ) -> RoutingDecision:
        idx, scores = retrieved
        index = self.index
        candidates = [
            {
                "tool": index.tool_names[index.scenario_tool[i]],
                "scenario": index.texts[i],
                "score": round(float(s), 6),
            }
            for i, s in zip(idx[:top_k], scores[:top_k], strict=True)
        ]
        if len(idx) == 0 and not self._head_alone():
            return self._nothing_to_rank()
        # The decision sees what it was fitted with, whatever the caller wants shown.
        top_k = self.params.top_k
        pool = self._pool(top_k)
        idx, scores = idx[:pool], scores[:pool]
        features = self.features(query, vector, idx, scores, top_k)
        if not len(features.tools):  # the head's tools are all excluded too
            return self._nothing_to_rank()
        fused = features.matrix @ self._weight_vector()
        fallback = public_fallback = None
        if self.reranker == "none":
            chosen = int(index.scenario_tool[idx[0]])
            dense = features.matrix[:, 0]
            pos = int(np.flatnonzero(features.tools == chosen)[0])
            confidence = self._confidence("none", dense, pos)
        else:
            pos = int(np.argmax(fused))
            if self.reranker == "llm":
                llm_pos, fallback, public_fallback = self._llm_choice(query, idx[:top_k], features)
                if llm_pos is not None:
                    pos = llm_pos
            cal = "llm" if self.reranker == "llm" and fallback is None else "fusion"
            confidence = self._confidence(cal, fused, pos)
            chosen = int(features.tools[pos])
        tool = index.tool_names[chosen]
        confidence = round(confidence, 6)  # escalation decided on the confidence shown
        return RoutingDecision(
            tool=tool,
            confidence=confidence,
            escalate=confidence < self.escalate_threshold,
            candidates=candidates,
            precautions=self._precautions_of(chosen, vector),
            template=index.templates.get(tool),
            reranker="fusion" if fallback is not None else self.reranker,  # the one that decided
            fallback_reason=fallback,
            public_fallback_reason=public_fallback,
            ranking=self.ranking(features, dense if self.reranker == "none" else fused, pos),
        )

    def _nothing_to_rank(self) -> RoutingDecision:
        """No reranker decides: the compendium has no scenario (and no head to route without),
        or every tool it could name is excluded. Some excluded while others are not (under
        `none`, which does not read the head that knows them) is still "no scenarios": those
        tools are active, and fusion routes to them."""
        known = set(self.index.tool_names)
        why = "no active tools" if known and known <= self.excluded_tools else "no scenarios"
        return RoutingDecision(None, 0.0, True, [], [], None, None, why, public_fallback_reason=why)

    RANKED = 5  # tools a decision's ranking lists

    def ranking(self, features: _Features, scores: np.ndarray, pos: int) -> list[dict]:
        """The best-scored candidate tools (the chosen one always among them), each with the
        score the decision ranked by (fusion: the fitted weights over the features; none: the
        best cosine) and what went into it: the best cosine of any of its scenarios, whether it
        has any scenario in the compendium (`backed`: false for a tool only the linear head
        knows, from the public probe set), the head's probability when there is a head, and
        whether a precaution of the tool matched the query."""
        top = [int(i) for i in np.argsort(-scores, kind="stable")[: self.RANKED]]
        if pos not in top:  # `pos`: the chosen tool's row
            top[-1] = pos
        out = []
        for row in top:
            m = features.matrix[row]
            item = {
                "tool": self.index.tool_names[int(features.tools[row])],
                "score": round(float(scores[row]), 6),
                # null for a tool without a scenario (its feature is 0.0 for the fusion weights)
                "best_cosine": round(float(m[0]), 6) if np.isfinite(m[0]) and not m[5] else None,
                "backed": not m[5],
                "precaution_matched": bool(m[3] > 0),
            }
            if self.head is not None and self.reranker != "none":
                item["head_probability"] = round(float(np.exp(m[4])), 6)
            out.append(item)
        return out

    def tool_scores(
        self, query: str, vector: np.ndarray, top_k: int = 5
    ) -> tuple[np.ndarray, np.ndarray]:
        """The candidate tools (positions in `index.tool_names`) of a query and their fused
        scores (`none`: their best cosine) with `top_k` scenarios voting: as `decide` ranks them
        when `top_k` is the params' (`RoutingParams.top_k`, what `decide` always uses)."""
        idx, scores = self.retrieve(vector, self._pool(top_k))
        if len(idx) == 0 and not self._head_alone():
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        features = self.features(query, vector, idx, scores, top_k)
        if self.reranker == "none":
            return features.tools, features.matrix[:, 0]
        return features.tools, features.matrix @ self._weight_vector()

    def _head_alone(self) -> bool:
        """With no scenario retrieved (a global that has none), the linear head still names the
        tools it learnt from the public probe set, unless the reranker is the bare cosine."""
        return self.head is not None and self.reranker != "none"

    def _weight_vector(self) -> np.ndarray:
        w = self.params.weights
        return np.array(
            [w.dense, w.bm25, w.vote, -w.precaution, w.head, w.unbacked], dtype=np.float64
        )

    # tools the head ranks highest join the candidate pool (fusion, llm) even when retrieval missed
    HEAD_CANDIDATES = 5

    def features(
        self, query: str, vector: np.ndarray, idx: np.ndarray, scores: np.ndarray, top_k: int
    ) -> _Features:
        index = self.index
        tools_of = index.scenario_tool[idx]
        head = self.head if self.reranker != "none" else None
        log_proba = head.log_proba(vector)[0] if head is not None else None
        retrieved_tools = np.unique(tools_of)
        extra = np.zeros(0, dtype=np.int64)
        if log_proba is not None:
            ranked = np.argsort(-log_proba, kind="stable")
            if len(self._excluded):
                ranked = ranked[~np.isin(ranked, self._excluded)]
            best = ranked[: self.HEAD_CANDIDATES]
            extra = best[~np.isin(best, retrieved_tools)]
        tools = np.concatenate([retrieved_tools, extra])
        inverse = np.searchsorted(retrieved_tools, tools_of)
        matrix = np.zeros((len(tools), 6), dtype=np.float64)
        matrix[:, 0] = -np.inf
        np.maximum.at(matrix[:, 0], inverse, scores.astype(np.float64))
        for row, tool in enumerate(extra, start=len(retrieved_tools)):  # their best cosine
            rows = index.rows_of_tool[tool]
            if len(rows):
                matrix[row, 0] = float((index.embeddings[rows] @ vector).max())
            else:  # no scenario: only the head knows it
                matrix[row, 0] = 0.0
                matrix[row, 5] = 1.0
        if self.reranker != "none" and index.bm25 is not None and len(idx):
            tokens = tokenize(query)
            if tokens:
                bm = np.asarray(index.bm25.get_batch_scores(tokens, idx.tolist()), dtype=np.float64)
                top = bm.max()
                if top > 0:
                    best_bm = np.zeros(len(tools))
                    np.maximum.at(best_bm, inverse, bm / top)
                    matrix[:, 1] = best_bm
        k = min(top_k, len(idx))
        if k:
            np.add.at(matrix[:, 2], inverse[:k], 1.0 / k)
        if log_proba is not None:
            matrix[:, 4] = log_proba[tools]
        hits: dict[int, list[tuple[float, str]]] = {}
        if self.reranker != "none" and len(index.precaution_texts):
            sims = index.precaution_embeddings @ vector
            threshold = self.params.weights.precaution_threshold
            for j in np.flatnonzero(sims >= threshold):
                if self._excluded_set and int(index.precaution_tool[j]) in self._excluded_set:
                    continue  # the LLM is not told of a tool it cannot pick
                hits.setdefault(int(index.precaution_tool[j]), []).append(
                    (float(sims[j]), index.precaution_texts[j])
                )
            for row, tool in enumerate(tools):
                if int(tool) in hits:
                    best_hit = max(s for s, _ in hits[int(tool)])
                    matrix[row, 3] = 1.0 + (best_hit - threshold) / max(1e-6, 1.0 - threshold)
        return _Features(tools, matrix, hits)

    def _confidence(self, name: str, scores: np.ndarray, pos: int) -> float:
        others = np.delete(scores, pos)
        margin = float(scores[pos] - others.max()) if len(others) else float(scores[pos])
        cal = self.params.calibration.get(name) or Calibration()
        return cal.probability(float(scores[pos]), margin)

    def _precautions_of(self, tool: int, vector: np.ndarray, limit: int = 5) -> list[str]:
        index = self.index
        rows = np.flatnonzero(index.precaution_tool == tool)
        if not len(rows):
            return []
        sims = index.precaution_embeddings[rows] @ vector
        return [index.precaution_texts[rows[i]] for i in np.argsort(-sims, kind="stable")[:limit]]

    def _llm_choice(self, query: str, idx: np.ndarray, features: _Features):
        """(the chosen candidate's row, None, None), or (None, why not, why not as anyone may
        read it: `Choice.shown_reason`)."""
        from routing.llm import choose_one_of_n

        if self.llm is None:
            return None, "no LLM configured", "no LLM configured"
        if not len(idx):
            empty = "no scenario to show the LLM; fell back to fusion"
            return None, empty, empty
        index = self.index
        options = []
        for i in idx:
            tool = index.tool_names[index.scenario_tool[i]]
            options.append(f"tool {tool}: {index.texts[i]}")
        instruction = (
            "Each option is a usage scenario of a tool. Pick the scenario that best matches the "
            "request; its tool will be called."
        )
        warned = [
            f"{index.tool_names[t]}: {text}"
            for t, items in features.precaution_hits.items()
            for _, text in items
        ]
        if warned:
            instruction += " Do not pick a tool whose precaution applies: " + "; ".join(warned[:5])
        choice = choose_one_of_n(self.llm, query, options, instruction=instruction)
        if choice.index is None:
            return (None, f"LLM answer unusable ({choice.reason}); fell back to fusion",
                    f"LLM answer unusable ({choice.shown_reason}); fell back to fusion")
        tool = index.scenario_tool[idx[choice.index]]
        return int(np.flatnonzero(features.tools == tool)[0]), None, None


# --- fitting on a labelled probe set ---------------------------------------------------------------


def _probe_features(router: Router, queries: Sequence[str], top_k: int = 5):
    vectors = router.engine.embed(list(queries))
    pool = router._pool(top_k)
    out = []
    with single_thread_blas():
        scores = vectors @ router.index.embeddings.T
        for q, v, row in zip(queries, vectors, scores, strict=True):
            idx, s = router.index.nearest(v, row, pool)  # as routing retrieves them
            out.append(router.features(q, v, idx, s, top_k))
    return out


# The precision of `fit_fusion_weights`' Gaussian prior around the weights it starts from: a
# standard deviation of 1 per weight. A probe set that some weighting separates perfectly (a few
# dozen requests, or a fit on half of one) has no maximum-likelihood weights: without a prior
# that keeps counting as the probe shrinks, the fit ran off along a separating direction. On the
# tiny simulation dataset (a 14-request fitting half, every request routed right) it fitted
# dense -158, bm25 -11 (ranking tools by how little their scenarios resemble the request): held
# out, 0.56 against 0.85 for the bare cosine, and scores of +-100 that saturated every
# calibrated confidence to 0 or 1. On MetaTool's probe (1,000 requests fitted) the prior is
# worth a few requests and moves nothing.
FUSION_PRIOR = 0.5


def fit_fusion_weights(
    router: Router, probe: Sequence[tuple[str, str]], top_k: int = 5, l2: float = FUSION_PRIOR
) -> FusionWeights:
    """Fit the fusion weights by conditional logit (softmax over the pool's tools) on queries
    whose right tool is in the pool: dense, bm25 and vote always; the head's weight when the
    router has a linear head; the precaution penalty only if the probe set has queries that match
    precautions (else it keeps its configured value). A maximum a posteriori fit: `l2` times the
    squared distance from the router's weights (the shipped or published ones, which the fit
    starts from) is added to the summed log-loss, so a small probe moves them only as far as
    it has evidence to."""
    from scipy.optimize import minimize

    fusion = router.with_reranker("fusion")
    feats = _probe_features(fusion, [q for q, _ in probe], top_k)
    pos = {t: i for i, t in enumerate(router.index.tool_names)}
    rows = []
    for f, (_, tool) in zip(feats, probe, strict=True):
        hit = np.flatnonzero(f.tools == pos.get(tool, -1))
        if len(hit) and len(f.tools) > 1:
            rows.append((f.matrix, int(hit[0])))
    current = router.params.weights
    if not rows:
        return current
    has_head = router.head is not None
    unbacked = any(m[:, 5].any() for m, _ in rows)
    start = np.array(
        [current.dense, current.bm25, current.vote, -current.precaution,
         (current.head or 1.0) if has_head else 0.0, current.unbacked]
    )
    free = np.array(
        [True, True, True, any(m[:, 3].any() for m, _ in rows), has_head, unbacked]
    )
    fixed = np.where(free, 0.0, start)
    prior = start[free]

    def loss(w):
        full = fixed.copy()
        full[free] = w
        total, grad = 0.0, np.zeros(len(full))
        for m, y in rows:
            z = m @ full
            z -= z.max()
            p = np.exp(z)
            p /= p.sum()
            total -= np.log(p[y] + 1e-12)
            grad -= m[y] - p @ m
        shift = w - prior
        total += l2 * (shift @ shift)
        return total / len(rows), (grad[free] + 2 * l2 * shift) / len(rows)

    result = minimize(loss, start[free], jac=True, method="L-BFGS-B")
    w = fixed.copy()
    w[free] = result.x
    return FusionWeights(
        dense=float(w[0]),
        bm25=float(w[1]),
        vote=float(w[2]),
        precaution=float(-w[3]),
        precaution_threshold=current.precaution_threshold,
        head=float(w[4]),
        unbacked=float(w[5]),
    )


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = 10) -> float:
    confidence = np.clip(np.asarray(confidence, dtype=np.float64), 0.0, 1.0)
    correct = np.asarray(correct, dtype=np.float64)
    if not len(confidence):
        return 0.0
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            ece += mask.mean() * abs(confidence[mask].mean() - correct[mask].mean())
    return float(ece)


def _score_margin(router: Router, f: _Features, reranker: str) -> tuple[float, float, int]:
    scores = f.matrix[:, 0] if reranker == "none" else f.matrix @ router._weight_vector()
    pos = int(np.argmax(scores))
    others = np.delete(scores, pos)
    margin = float(scores[pos] - others.max()) if len(others) else float(scores[pos])
    return float(scores[pos]), margin, int(f.tools[pos])


def calibration_data(router: Router, labelled: Sequence[tuple[str, str]], reranker: str, top_k=5):
    """(score, margin, raw confidence = top cosine, correct) per query."""
    r = router.with_reranker(reranker)
    feats = _probe_features(r, [q for q, _ in labelled], top_k)
    rows = []
    for f, (_, tool) in zip(feats, labelled, strict=True):
        if not len(f.tools):  # nothing to choose from (no scenario, and no head in this reranker)
            continue
        score, margin, chosen = _score_margin(r, f, reranker)
        raw = float(f.matrix[:, 0].max())
        rows.append((score, margin, raw, float(router.index.tool_names[chosen] == tool)))
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


def fit_calibration(
    router: Router, probe: Sequence[tuple[str, str]], reranker: str, top_k: int = 5, l2: float = 1e-6
) -> tuple[Calibration, dict]:
    """Platt scaling of (score, margin) -> P(correct) on the probe set, with its ECE report.

    As Platt (1999) prescribes, the fit's targets are not 0 and 1 but (N+ + 1) / (N+ + 2) for the
    N+ requests routed right and 1 / (N- + 2) for the N- routed wrong: on a small probe that the
    score separates (a few dozen requests, nearly all right) 0/1 targets have no finite fit and
    it ran off (a score weight of 43 on 14 requests), giving confidences of 0 or 1 only, which
    the clients' delta rule then read as certainty. On a probe of a thousand the targets are
    within 0.005 of 0/1. The report's accuracy and ECE are against the 0/1 outcomes."""
    from scipy.optimize import minimize

    data = calibration_data(router, probe, reranker, top_k)
    if len(data) < 2 or data[:, 3].min() == data[:, 3].max():
        return Calibration(), {"probe_queries": len(data), "note": "too little signal to fit"}
    x = np.column_stack([data[:, 0], data[:, 1], np.ones(len(data))])
    y = data[:, 3]
    right = float(y.sum())
    wrong = len(y) - right
    target = np.where(y > 0.5, (right + 1.0) / (right + 2.0), 1.0 / (wrong + 2.0))

    def loss(w):
        z = x @ w
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))
        eps = 1e-12
        value = (-np.mean(target * np.log(p + eps) + (1 - target) * np.log(1 - p + eps))
                 + l2 * (w[:2] @ w[:2]))
        grad = x.T @ (p - target) / len(y) + 2 * l2 * np.append(w[:2], 0.0)
        return value, grad

    result = minimize(loss, np.zeros(3), jac=True, method="L-BFGS-B")
    cal = Calibration(float(result.x[0]), float(result.x[1]), float(result.x[2]))
    fitted = np.array([cal.probability(s, m) for s, m in data[:, :2]])
    report = {
        "probe_queries": int(len(data)),
        "probe_accuracy": float(y.mean()),
        "probe_ece_raw": expected_calibration_error(data[:, 2], y),
        "probe_ece_calibrated": expected_calibration_error(fitted, y),
    }
    return cal, report


def evaluate_calibration(
    router: Router, held_out: Sequence[tuple[str, str]], reranker: str, top_k: int = 5
) -> dict:
    """ECE of raw top cosine vs the calibrated confidence on held-out queries."""
    data = calibration_data(router, held_out, reranker, top_k)
    cal = router.params.calibration.get(reranker) or Calibration()
    fitted = np.array([cal.probability(s, m) for s, m in data[:, :2]])
    return {
        "queries": int(len(data)),
        "accuracy": float(data[:, 3].mean()) if len(data) else 0.0,
        "ece_raw": expected_calibration_error(data[:, 2], data[:, 3]),
        "ece_calibrated": expected_calibration_error(fitted, data[:, 3]),
    }


def fit_params(
    router: Router, probe: Sequence[tuple[str, str]], top_k: int = 5, fitted_on: str = ""
) -> RoutingParams:
    """Fusion weights, then one calibration per reranker (llm shares fusion's until fitted with
    an LLM in the loop), all on the probe set."""
    params = RoutingParams(
        weights=fit_fusion_weights(router, probe, top_k),
        pool=router.params.pool,
        top_k=top_k,
        escalate_threshold=router.params.escalate_threshold,
        fitted_on=fitted_on,
    )
    fitted = router.with_reranker("fusion", params=params)
    report = {}
    for name in ("none", "fusion"):
        params.calibration[name], report[name] = fit_calibration(fitted, probe, name, top_k)
    params.calibration["llm"] = params.calibration["fusion"]
    params.report = report
    return params


def fit_published_head(
    compendium: Compendium,
    scenario_embeddings: np.ndarray,
    describe,
    engine,
    probe: Sequence[tuple[str, str]] = (),
    *,
    probe_vectors: np.ndarray | None = None,
    precaution_embeddings: np.ndarray | None = None,
) -> LinearHead | None:
    """The head a global is published with (`federation.pipeline.routing_head`): with the
    public probe set `probe` ((request, tool id); `probe_vectors`: its requests as `describe`
    embeds them), `fit_router`'s head, which learns the probe's tools too and carries the fusion
    weights and calibration fitted with it (queries embedded by `engine`, the routing API's);
    without a probe, a head over the compendium alone and no parameters. `describe` embeds the
    tools' descriptions (the engine of the stored rows). None: fewer than two tools."""
    if not len(probe):
        return fit_linear_head(compendium, scenario_embeddings, describe)
    return fit_router(
        compendium, engine, probe, probe_vectors=probe_vectors, describe=describe,
        scenario_embeddings=scenario_embeddings, precaution_embeddings=precaution_embeddings,
        fitted_on="the public probe set, at publication",
    ).head


def probe_halves(size: int) -> tuple[list[int], list[int]]:
    """The positions of a probe set of `size` requests that a router's head learns from, and
    those its fusion weights are fitted on (`fit_router`): a fixed shuffle, halved."""
    order = random.Random(size).sample(range(size), size)
    return sorted(order[: size // 2]), sorted(order[size // 2 :])


def fit_router(
    compendium: Compendium,
    engine,
    probe: Sequence[tuple[str, str]],
    reranker: str = "fusion",
    *,
    probe_vectors: np.ndarray | None = None,
    linear_head: bool = True,
    fit_limit: int | None = 1000,
    llm=None,
    scenario_embeddings: np.ndarray | None = None,
    precaution_embeddings: np.ndarray | None = None,
    fitted_on: str = "probe set",
    describe=None,
) -> Router:
    """A router over `compendium` with everything fitted on the public probe set `probe`
    ((request, tool id) pairs, never test data): the linear head (`linear_head`) on the
    compendium and the whole probe, as `federation.pipeline.routing_head` does; fusion weights
    and calibration cross-fitted: on one half of the probe (`probe_halves`, at most `fit_limit`
    pairs) with a head that learnt from the other half, so that they weigh a head that has not
    seen the requests they are fitted on. `engine` embeds the queries and, unless given, the
    scenarios and precautions; `probe_vectors`: the probe's requests as the head learns them
    (default: embedded by `engine`); `describe`: embeds the tools' descriptions for the head
    (default: `engine.embed`). The head carries the fitted parameters (`LinearHead.params`)."""
    base = Router(
        compendium, engine, "fusion",
        scenario_embeddings=scenario_embeddings, precaution_embeddings=precaution_embeddings,
    )
    pairs = list(probe)
    fitted = base
    if linear_head:
        if probe_vectors is None:
            probe_vectors = engine.embed([q for q, _ in pairs]) if pairs else None
        labels = [t for _, t in pairs]
        learn, held = probe_halves(len(pairs))
        if pairs:
            fitted = base.with_linear_head(
                describe, examples=(probe_vectors[learn], [labels[i] for i in learn])
            )
            base = base.with_linear_head(describe, examples=(probe_vectors, labels))
        else:
            fitted = base = base.with_linear_head(describe)
        pairs = [pairs[i] for i in held]
    if fit_limit and len(pairs) > fit_limit:
        pairs = random.Random(len(pairs)).sample(pairs, fit_limit)
    params = fit_params(fitted, pairs, fitted_on=fitted_on) if pairs else base.params
    head = replace(base.head, params=params) if base.head is not None else None
    return base.with_reranker(reranker, params=params, llm=llm, head=head)

