"""Summarizers: one text for a cluster of entries, selectable per round.

- `probe-extractive` (default without an LLM): among the cluster's members nearest its mean and the
  combination of the two nearest, the text with the lowest routing failure on the public probe set
  (top-1 cosine routing over the candidate compendium's scenario embeddings);
- `centroid`: the member nearest the cluster's mean embedding;
- `none`: the cluster's first member in canonical order, unchanged;
- `llm-single-shot`: one LLM call asked for JSON {"summary": ...};
- `textgrad`: S critique-update steps of TextGrad from the probe-extractive start, the loss being
  routing failure on the probe set; the best text seen (the start included) is kept.

An LLM answer that cannot be parsed falls back to the next summarizer in this order:
textgrad -> llm-single-shot -> probe-extractive -> centroid -> none, and the reason is recorded.
Probe sets are public benchmark queries, never client data.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from compendium.validation import _FORBIDDEN_CHARS
from federation.merge.clustering import (
    central_order,
    honest_gaps,
    probe_coherence,
    trusted_profiles,
)
from federation.merge.llm import LLMUnavailable, OpenAICompatibleLLM

ORDER = ("textgrad", "llm-single-shot", "probe-extractive", "centroid", "none")
LLM_SUMMARIZERS = {"textgrad", "llm-single-shot"}

Embed = Callable[[Sequence[str]], np.ndarray]


class SummaryUnparseable(ValueError):
    """A summarizer that could not give a summary: an LLM answer without a usable one, or what
    it needs is missing. `kind` names the cause in a word or two, so that fallbacks can be counted
    by cause (`fallback_kinds`)."""

    def __init__(self, message: str, kind: str = "unusable answer"):
        super().__init__(message)
        self.kind = kind


def fallback_kind(exc: Exception) -> str:
    """The cause of a summarizer's fallback, as counted in sweeps and shown on the dashboard."""
    return exc.kind if isinstance(exc, SummaryUnparseable) else "LLM unavailable"


@dataclass
class ProbeSet:
    """Public labelled queries and their embeddings."""

    texts: list[str]
    labels: list[str]
    vectors: np.ndarray
    # What the merge's cross-checks derive from the probe, kept per registry: the same in every
    # edge and server merge of a round (`honest_gaps` costs about 0.1 s on MetaTool's probe).
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.texts)

    def honest_gaps(self, tool_ids: Sequence[str], descriptions: np.ndarray,
                    near: float = 1.0) -> np.ndarray:
        """`clustering.honest_gaps` of these requests against the registry given."""
        key = ("gaps", tuple(tool_ids), np.ascontiguousarray(descriptions).tobytes(), near)
        if key not in self._derived:
            self._derived[key] = honest_gaps(self.vectors, self.labels, tool_ids, descriptions,
                                             near=near)
        return self._derived[key]

    def profiles(self, tool_ids: Sequence[str], descriptions: np.ndarray) -> np.ndarray:
        """`clustering.trusted_profiles` of the registry given and these requests."""
        key = ("profiles", tuple(tool_ids), np.ascontiguousarray(descriptions).tobytes())
        if key not in self._derived:
            self._derived[key] = trusted_profiles(tool_ids, descriptions, self.vectors, self.labels)
        return self._derived[key]

    def coherence(self) -> dict[str, float]:
        """`clustering.probe_coherence` of these requests."""
        if "coherence" not in self._derived:
            self._derived["coherence"] = probe_coherence(self.vectors, self.labels)
        return self._derived["coherence"]


@dataclass
class RoutingContext:
    """The candidate compendium's scenario slots (one per cluster) against which a cluster's
    candidates are scored: replacing slot i by a candidate changes only slot i's scores."""

    probe: ProbeSet
    slot_tools: list[str]
    slot_vectors: np.ndarray
    _labels: np.ndarray = field(init=False)

    def __post_init__(self):
        self._labels = np.asarray(self.probe.labels, dtype=object)
        self._tools = np.asarray(self.slot_tools, dtype=object)
        if len(self.slot_tools):
            scores = self.probe.vectors @ self.slot_vectors.T
            order = np.argsort(-scores, axis=1, kind="stable")[:, :2]
            self._top1 = order[:, 0]
            self._top1_score = np.take_along_axis(scores, order[:, :1], axis=1)[:, 0]
            if scores.shape[1] > 1:
                self._top2 = order[:, 1]
                self._top2_score = np.take_along_axis(scores, order[:, 1:2], axis=1)[:, 0]
            else:
                self._top2 = np.zeros(len(order), dtype=int)
                self._top2_score = np.full(len(order), -np.inf)
        else:  # no scenario slot (a merge of precautions alone): no query has a best scenario
            self._top1_score = np.full(len(self.probe), -np.inf)

    def scenario_failures(self, slot: int, candidates: np.ndarray) -> np.ndarray:
        """Routing failure rate on the probe set for each candidate vector placed at `slot`."""
        sims = self.probe.vectors @ candidates.T  # (queries, candidates)
        other_is_top1 = self._top1 != slot
        best_other = np.where(other_is_top1, self._top1_score, self._top2_score)
        other_tool = np.where(other_is_top1, self._tools[self._top1], self._tools[self._top2])
        wins = sims > best_other[:, None]
        predicted = np.where(wins, self.slot_tools[slot], other_tool[:, None])
        return (predicted != self._labels[:, None]).mean(axis=0)

    def precaution_failures(self, tool_id: str, candidates: np.ndarray) -> np.ndarray:
        """Share of the tool's own probe queries a precaution would wrongly veto: the precaution
        is closer to the query than the query's best scenario."""
        mine = self._labels == tool_id
        if not mine.any():
            return np.zeros(len(candidates))
        sims = self.probe.vectors[mine] @ candidates.T
        return (sims > self._top1_score[mine][:, None]).mean(axis=0)


@dataclass
class Cluster:
    kind: str  # "scenario" | "precaution" | "template"
    tool_id: str
    texts: list[str]
    vectors: np.ndarray
    slot: int | None = None  # scenario slot in the routing context


@dataclass
class Summary:
    text: str
    summarizer: str
    fallbacks: list[dict] = field(default_factory=list)


def _combine(a: str, b: str, limit: int) -> str | None:
    text = f"{a.rstrip(' .;')}; {b[:1].lower()}{b[1:]}"
    return text if len(text) <= limit else None


@dataclass
class Summarizer:
    """Summarizes clusters with the configured method and its fallbacks."""

    method: str
    embed: Embed
    context: RoutingContext | None = None
    llm: OpenAICompatibleLLM | None = None
    textgrad_steps: int = 3
    max_candidates: int = 4
    text_limit: int = 1000
    fallbacks: list[dict] = field(default_factory=list)
    # Clusters of more than one text summarized, by the method whose text was kept (after any
    # fallback): how many summaries an LLM actually wrote.
    counts: dict[str, int] = field(default_factory=dict)
    # Embeddings of candidate texts made by `prepare`, so that many clusters cost one batch.
    _prepared: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def prepare(self, clusters: list[Cluster]) -> None:
        """Embed, in one batch, the combined candidates the clusters' summaries will score (one
        model call per cluster took most of a 500-client edge merge)."""
        if self.method not in ORDER or ORDER.index(self.method) > ORDER.index("probe-extractive"):
            return
        wanted = []
        for cluster in clusters:
            if len(cluster.texts) > 1 and cluster.kind != "template":
                texts, _ = self._distinct_nearest(cluster)
                combined = self._combined(texts)
                if combined is not None and combined not in texts:
                    wanted.append(combined)
        wanted = [t for t in dict.fromkeys(wanted) if t not in self._prepared]
        if wanted:
            self._prepared.update(zip(wanted, self.embed(wanted), strict=True))

    def summarize(self, cluster: Cluster) -> Summary:
        if len(cluster.texts) == 1:
            return Summary(cluster.texts[0], "single")
        start = ORDER.index(self.method)
        notes: list[dict] = []
        for method in ORDER[start:]:
            try:
                text = getattr(self, "_" + method.replace("-", "_"))(cluster)
            except (SummaryUnparseable, LLMUnavailable) as exc:
                notes.append({"summarizer": method, "tool_id": cluster.tool_id, "reason": str(exc),
                              "kind": fallback_kind(exc)})
                continue
            self.fallbacks.extend(notes)
            self.counts[method] = self.counts.get(method, 0) + 1
            return Summary(text, method, notes)
        raise AssertionError("the 'none' summarizer cannot fail")

    # --- non-LLM ----------------------------------------------------------------------------

    def _none(self, cluster: Cluster) -> str:
        return cluster.texts[0]

    def _centroid(self, cluster: Cluster) -> str:
        return cluster.texts[next(central_order(cluster.vectors))]

    def _distinct_nearest(self, cluster: Cluster) -> tuple[list[str], list[np.ndarray]]:
        texts, rows = [], []
        for i in central_order(cluster.vectors):
            if cluster.texts[i] not in texts:
                texts.append(cluster.texts[i])
                rows.append(cluster.vectors[i])
            if len(texts) == self.max_candidates:
                break
        return texts, rows

    def _combined(self, texts: list[str]) -> str | None:
        return _combine(texts[0], texts[1], self.text_limit) if len(texts) >= 2 else None

    def _candidates(self, cluster: Cluster) -> tuple[list[str], np.ndarray]:
        texts, rows = self._distinct_nearest(cluster)
        vectors = np.stack(rows)
        combined = self._combined(texts)
        if combined is not None and combined not in texts:
            vector = self._prepared.get(combined)
            if vector is None:
                vector = self.embed([combined])[0]
            texts.append(combined)
            vectors = np.vstack([vectors, vector[None, :]])
        return texts, vectors

    def _failures(self, cluster: Cluster, vectors: np.ndarray) -> np.ndarray:
        if cluster.kind == "scenario" and cluster.slot is not None:
            return self.context.scenario_failures(cluster.slot, vectors)
        return self.context.precaution_failures(cluster.tool_id, vectors)

    def _probe_extractive(self, cluster: Cluster) -> str:
        if self.context is None or not len(self.context.probe):
            raise SummaryUnparseable("no public probe set is loaded", kind="no probe set")
        if cluster.kind == "template":
            counts: dict[str, int] = {}
            for text in cluster.texts:
                counts[text] = counts.get(text, 0) + 1
            return min(counts, key=lambda t: (-counts[t], len(t), t))
        texts, vectors = self._candidates(cluster)
        failures = self._failures(cluster, vectors)
        return texts[int(np.argmin(failures))]  # ties: the member nearest the mean

    # --- LLM ---------------------------------------------------------------------------------

    def _require_llm(self) -> OpenAICompatibleLLM:
        if self.llm is None:
            raise SummaryUnparseable("no LLM endpoint is configured", kind="no LLM endpoint")
        return self.llm

    def _llm_single_shot(self, cluster: Cluster) -> str:
        llm = self._require_llm()
        listing = "\n".join(f"- {t}" for t in cluster.texts[:20])
        answer = llm.complete(
            f"These {cluster.kind} texts for the tool '{cluster.tool_id}' say the same thing. "
            "Write one concise text that covers them all. Answer only with JSON "
            '{"summary": "..."}.\n' + listing,
            json_schema=SUMMARY_SCHEMA,
        )
        return _parse_summary(answer, self.text_limit)

    def _textgrad(self, cluster: Cluster) -> str:
        llm = self._require_llm()
        if cluster.kind == "template":
            raise SummaryUnparseable(
                "textgrad needs a task-success signal for templates; no executor is configured",
                kind="no template executor",
            )
        if self.context is None or not len(self.context.probe):
            raise SummaryUnparseable("textgrad scores its texts on the public probe set: none is "
                                     "loaded", kind="no probe set")
        engine = _textgrad_engine(llm)
        import textgrad as tg
        start = self._probe_extractive(cluster)
        best_text = start
        best_loss = float(self._failures(cluster, self.embed([start]))[0])
        variable = tg.Variable(
            start,
            role_description=f"{cluster.kind} text of tool '{cluster.tool_id}' in a routing "
            "compendium; a query is routed to the tool whose scenario embedding is nearest",
            requires_grad=True,
        )
        optimizer = tg.TGD(parameters=[variable], engine=engine)
        for _ in range(self.textgrad_steps):
            current_loss = float(self._failures(cluster, self.embed([variable.value]))[0])
            report = (
                f"Routing failure on the public probe set is {current_loss:.3f} for this "
                f"{cluster.kind}. Critique how the text should change so that queries meant for "
                f"'{cluster.tool_id}' reach it and others do not."
            )
            loss = tg.TextLoss(report, engine=engine)(variable)
            optimizer.zero_grad()
            loss.backward(engine)
            try:
                optimizer.step()
            except IndexError as exc:
                raise SummaryUnparseable(f"textgrad update could not be parsed: {exc}"[:300]) from None
            text = variable.value.strip()[: self.text_limit]
            if not text:
                raise SummaryUnparseable("textgrad produced an empty text")
            _storable(text, "textgrad's text")
            loss_value = float(self._failures(cluster, self.embed([text]))[0])
            if loss_value < best_loss:
                best_text, best_loss = text, loss_value
        return best_text


def fallback_kinds(stats: dict) -> dict[str, int]:
    """From a merge's `MergeStats.as_dict()`: how many times a summarizer fell back, by cause
    (records from before causes were kept count as "unrecorded")."""
    return dict(Counter(f"{f.get('summarizer', '?')}: {f.get('kind', 'unrecorded')}"
                        for f in stats.get("summarizer_fallbacks") or []))


def summary_counts(stats: dict) -> dict[str, int | None]:
    """From a merge's `MergeStats.as_dict()`: the clusters of more than one text it summarized
    (None for a record from before they were counted), how many kept an LLM's text, and how many
    times a summarizer fell back."""
    counts = stats.get("summaries")
    return {
        "summaries": sum(counts.values()) if counts is not None else None,
        "llm_summaries": sum(n for m, n in (counts or {}).items() if m in LLM_SUMMARIZERS),
        "summarizer_fallbacks": len(stats.get("summarizer_fallbacks") or []),
    }


# The answer `_parse_summary` reads; servers that can constrain their decoding to it do
# (`routing.llm.json_response_format`).
SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "minLength": 1}},
    "required": ["summary"],
}


def _parse_summary(answer: str, limit: int) -> str:
    match = re.search(r"\{.*\}", answer, re.DOTALL)
    if match is None:
        raise SummaryUnparseable(f"LLM answer is not JSON: {answer[:120]!r}")
    try:
        summary = json.loads(match.group(0)).get("summary")
    except (json.JSONDecodeError, AttributeError, RecursionError):  # RecursionError: nested deep
        raise SummaryUnparseable(f"LLM answer is not valid JSON: {answer[:120]!r}") from None
    if not isinstance(summary, str) or not summary.strip():
        raise SummaryUnparseable("LLM answer has no non-empty 'summary' string")
    return _storable(summary.strip()[:limit], "LLM answer's summary")


def _storable(text: str, what: str) -> str:
    """`text`, refused (SummaryUnparseable) when it holds a character no compendium string may
    (`compendium.validation`: a control character, a bidirectional override, a lone surrogate):
    the merge would emit it and then refuse its own compendium, failing the round."""
    bad = _FORBIDDEN_CHARS.search(text)
    if bad is not None:
        raise SummaryUnparseable(
            f"{what} contains the character U+{ord(bad.group()):04X}, which a compendium may not hold"
        )
    return text


def _textgrad_engine(llm: OpenAICompatibleLLM):
    """TextGrad's engine interface over our OpenAI-compatible client (no disk cache: a round is
    replayed through the endpoint, not through a local cache). Imported lazily: textgrad pulls in
    litellm, which would otherwise try to fetch a price list at import time."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # textgrad logs every prompt to ./logs/ on import; keep (masked) client text out of the
    # working directory.
    os.environ.setdefault(
        "TEXTGRAD_LOG_DIR", os.path.join(tempfile.gettempdir(), "synapse-textgrad-logs")
    )
    os.makedirs(os.environ["TEXTGRAD_LOG_DIR"], exist_ok=True)
    from textgrad.engine import EngineLM

    class Engine(EngineLM):
        def __init__(self):
            self.model_string = llm.model

        def generate(self, prompt, system_prompt=None, **kwargs):
            return llm.complete(str(prompt), system=system_prompt)

        def __call__(self, prompt, **kwargs):
            return self.generate(prompt, **kwargs)

    return Engine()
