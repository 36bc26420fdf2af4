"""A configured LLM behind an OpenAI-compatible endpoint (vLLM, llama.cpp server, Ollama, a hosted
API), used for the consistency probe, single-shot summaries and TextGrad. Pure: no Django."""

from __future__ import annotations

import re

from routing import llm as routing_llm
from routing.llm import LLMUnavailable

__all__ = ["LLMUnavailable", "OpenAICompatibleLLM", "consistency_probe"]


class OpenAICompatibleLLM(routing_llm.OpenAICompatibleLLM):
    """The routing app's OpenAI-compatible client (timeouts, retries, one-line errors) with the
    longer answers and patience that summaries need, and a count of calls made."""

    def __init__(self, base_url: str, model: str = "", api_key: str = "", *, timeout_s: float = 60.0,
                 temperature: float = 0.0):
        super().__init__(base_url, model, api_key, timeout=timeout_s, temperature=temperature)
        self.calls = 0

    def complete(self, prompt: str, system: str | None = None, max_tokens: int = 512,
                 json_schema: dict | None = None) -> str:
        self.calls += 1
        return super().complete(prompt, system=system or "", max_tokens=max_tokens,
                                json_schema=json_schema)


_VERDICT = re.compile(r"\b(inconsistent|consistent)\b", re.IGNORECASE)

CONSISTENCY_PROMPT = (
    "Two usage scenarios were written for the same tool. Do they describe consistent uses of the "
    "tool (one does not contradict the other)? Answer with exactly one word: Consistent or "
    "Inconsistent.\n\nScenario A: {a}\nScenario B: {b}"
)


def consistency_probe(llm: OpenAICompatibleLLM):
    """A ConsistencyProbe: True/False from the LLM's one-word answer, None if unusable."""

    def probe(a: str, b: str) -> bool | None:
        try:
            answer = llm.complete(CONSISTENCY_PROMPT.format(a=a, b=b))
        except LLMUnavailable:
            return None
        match = _VERDICT.search(answer)
        if match is None:
            return None
        return match.group(1).lower() == "consistent"

    return probe
