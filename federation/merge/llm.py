"""A configured LLM behind an OpenAI-compatible endpoint (vLLM, llama.cpp server, Ollama, a hosted
API), used for the consistency probe, single-shot summaries and TextGrad. Pure: no Django."""

from __future__ import annotations

import re

from routing import llm as routing_llm
from routing.llm import LLMUnavailable

__all__ = ["LLMUnavailable", "OpenAICompatibleLLM", "consistency_probe", "merge_llm"]

# How long one question of a merge (a summary, a TextGrad step, a consistency probe) may take in
# all, its retries and their backoff included, unless SYNAPSE_MERGE_LLM_CALL_SECONDS says.
MERGE_CALL_SECONDS = 60.0


class OpenAICompatibleLLM(routing_llm.OpenAICompatibleLLM):
    """The routing app's OpenAI-compatible client (timeouts, retries, one-line errors, the
    per-call deadline `call_seconds` and the `pause` after the endpoint was found down) with the
    longer answers and patience that summaries need, and a count of calls made."""

    call_seconds_variable = "SYNAPSE_MERGE_LLM_CALL_SECONDS"

    def __init__(self, base_url: str, model: str = "", api_key: str = "", *, timeout_s: float = 60.0,
                 temperature: float = 0.0, call_seconds: float | None = None, pause: float = 0.0):
        super().__init__(base_url, model, api_key, timeout=timeout_s, temperature=temperature,
                         call_seconds=call_seconds, pause=pause)
        self.calls = 0

    def complete(self, prompt: str, system: str | None = None, max_tokens: int = 512,
                 json_schema: dict | None = None) -> str:
        self.calls += 1
        return super().complete(prompt, system=system or "", max_tokens=max_tokens,
                                json_schema=json_schema)


def merge_llm(base_url: str, model: str = "", api_key: str = "") -> OpenAICompatibleLLM:
    """The merge's client of an endpoint, bounded as routing's is (`routing.llm.get_llm`): each
    question given up after SYNAPSE_MERGE_LLM_CALL_SECONDS (60; 0: no limit but each attempt's
    60 s), after which the endpoint counts as down and is not asked again for
    SYNAPSE_LLM_PAUSE_SECONDS (30): a silent endpoint held a merge (retries + 1) × 60 s for every
    cluster it summarized. Its own variable, not routing's: a summary is a longer answer than a
    routing decision, written in a worker rather than while a user waits."""
    call = routing_llm._env_seconds("SYNAPSE_MERGE_LLM_CALL_SECONDS", MERGE_CALL_SECONDS)
    pause = routing_llm._env_seconds("SYNAPSE_LLM_PAUSE_SECONDS", 30)
    return OpenAICompatibleLLM(base_url, model, api_key, call_seconds=call if call > 0 else None,
                               pause=pause)


_VERDICT = re.compile(r"\b(inconsistent|consistent)\b", re.IGNORECASE)

CONSISTENCY_PROMPT = (
    "Two usage scenarios were written for the same tool. Do they describe consistent uses of the "
    "tool (one does not contradict the other)? Answer with exactly one word: Consistent or "
    "Inconsistent.\n\nScenario A: {a}\nScenario B: {b}"
)


class ConsistencyQuestions:
    """A ConsistencyProbe: True/False from the LLM's one-word answer, None if unusable (the LLM
    unreachable, or no Consistent/Inconsistent in its answer), counted in `unanswered`: such a
    pair is judged by its precondition flags alone, and a contradiction only the LLM would have
    caught merges with no conflict logged, which the merge's record says."""

    def __init__(self, llm: OpenAICompatibleLLM):
        self.llm = llm
        self.asked = 0
        self.unanswered = 0

    def __call__(self, a: str, b: str) -> bool | None:
        self.asked += 1
        try:
            answer = self.llm.complete(CONSISTENCY_PROMPT.format(a=a, b=b))
        except LLMUnavailable:
            answer = ""
        match = _VERDICT.search(answer)
        if match is None:
            self.unanswered += 1
            return None
        return match.group(1).lower() == "consistent"


def consistency_probe(llm: OpenAICompatibleLLM) -> ConsistencyQuestions:
    return ConsistencyQuestions(llm)
