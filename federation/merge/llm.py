"""A configured LLM behind an OpenAI-compatible endpoint (vLLM, llama.cpp server, Ollama, a hosted
API), used for the consistency probe, single-shot summaries and TextGrad. Pure: no Django."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class LLMUnavailable(RuntimeError):
    """The endpoint could not be reached or answered with an error."""


@dataclass
class OpenAICompatibleLLM:
    base_url: str
    model: str
    api_key: str = "none"
    timeout_s: float = 60.0
    temperature: float = 0.0
    calls: int = field(default=0, init=False)

    def __post_init__(self):
        from openai import OpenAI

        self.client = OpenAI(
            base_url=self.base_url.rstrip("/"),
            api_key=self.api_key or "none",
            timeout=self.timeout_s,
            max_retries=1,
        )

    def complete(self, prompt: str, system: str | None = None) -> str:
        messages = []
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": prompt})
        self.calls += 1
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=messages, temperature=self.temperature
            )
        except Exception as exc:  # any transport or API error: one clear line
            raise LLMUnavailable(
                f"LLM endpoint {self.base_url} failed: {exc.__class__.__name__}: {exc}"
            ) from None
        return response.choices[0].message.content or ""


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
