"""HTTP client of the SYNAPSE server API for the client toolkit (submit, pull). No Django.

Speaks the REST API exactly as the server defines it:
- `GET /api/v1/rounds/?state=open` -> {"count", "results": [{"number", ...}]}
- `POST /api/v1/submissions/` with `Idempotency-Key` and `X-Synapse-Round` (the round the body
  was checked for); 201, or the same answer again with `Idempotent-Replayed: true`; 400
  {"detail", "violations": [{"path", "reason"}]}; 401/403; 409 when no round is open
  (`code: round_changed` when another round is open than the one named, or opened while the body
  was checked, `code: schema_changed` when the registry or the numeric fields changed meanwhile,
  `code: replaced` when the key's submission was replaced by a later one in its round: then
  the same body goes again under the next key, `r<round>-<sha256>-2`, `-3`, ..., which the round
  refuses once it takes no more submissions: the later one stays in effect); 413; 429 with
  `Retry-After`.
- `GET /api/v1/compendium/global/` -> {"round", "sha256", "published_at", "compendium"} with an
  ETag; 304 when `If-None-Match` matches; 404 when nothing is published.
- `GET /api/v1/compendium/schema/` -> the schema in force (the active tools, the numeric fields,
  the limits): `fetch_schema`, and `pull` saves it beside the global (`schema_file`).
- `GET /api/v1/compendium/probe/` -> {"count", "sha256", "texts", "labels"} (and "tools" when no
  label is null): the public probe set's requests and their tools, null for a tool the
  registry does not offer.
- `GET /api/v1/compendium/global/router/` -> the manifest of the encoder the server tuned on the
  global ({"round", "global_sha256", "rows_sha256", "files": [{"path", "size", "sha256"}], ...});
  404 with a `code` when there is none; each file at `.../router/files/<path>`.

`SynapseClient.submit` runs the checks of the privacy boundary before any byte of a compendium is
sent (PrivacyViolation: what a client never sends, masking weaker than the round's λ, and the
server's own check of the text at that λ), whoever calls it: the CLI, or an organization's script.

Network errors, 5xx and 429 are retried with exponential backoff, or as long as a 429's or a
503's `Retry-After` asks, in seconds or as an HTTP-date (at most a minute). A POST is safe to
retry because the idempotency key is derived from the content and the round: the server stores
it once.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import ipaddress
import json
import math
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import filelock
import httpx
from pydantic import ValidationError

from compendium import transport
from compendium.canonical import canonical_form, canonical_positions
from compendium.masking import TextMasker, expected_mask_strength
from compendium.schema import Compendium, Schema
from compendium.scrub import masking_residue, submission_rules
from compendium.validation import Violation, reindex_paths, validation_summary

USER_AGENT = "synapse-client/0.1"
# JSON can escape half of a character ("\ud800"), which no UTF-8 file or canonical form holds
LONE_SURROGATE = "it holds a lone surrogate (half of an escaped character), which is not text"
MAX_RETRY_AFTER_S = 60.0
# How long pull --router waits for another pull of the same folder to end.
ROUTER_LOCK_WAIT_SECONDS = 600
# How many violations a PrivacyViolation's message lists (all of them are in `violations`)
MAX_LISTED_VIOLATIONS = 20


class ClientError(Exception):
    """Anything that went wrong talking to the server, as one line a person can act on."""


class CannotWrite(ClientError):
    """A file of the client toolkit could not be written (a folder in the way, no space, no
    permission), named with the reason."""

    def __init__(self, path: Path, exc: OSError):
        super().__init__(f"cannot write {path}: {exc.strerror or exc}")


class SubmissionRejected(ClientError):
    """The server rejected the compendium (400) and said why, by JSON path: paths (and the paths
    quoted in reasons) index the entries of the compendium as `submit` was given it, not the
    sorted canonical form that was sent."""

    def __init__(self, detail: str, violations: list[dict[str, str]]):
        self.detail = detail
        self.violations = violations
        super().__init__(f"the server rejected the compendium: {detail}")


class PrivacyViolation(ClientError):
    """The compendium holds what must not leave this client (see DESIGN.md, "The privacy
    boundary"), found by `SynapseClient.submit` before any byte of it was sent: nothing was
    sent. The server refuses it too, but only once the text has reached it. `violations` lists
    each by path, as validation names them (the compendium as `submit` was given it), and what
    it holds, never the text itself."""

    summary = "the compendium holds what must not leave this client"

    def __init__(self, violations: list[Violation], summary: str | None = None):
        self.violations = list(violations)
        if summary is not None:
            self.summary = summary
        listed = "; ".join(str(v) for v in self.violations[:MAX_LISTED_VIOLATIONS])
        more = len(self.violations) - MAX_LISTED_VIOLATIONS
        if more > 0:
            listed += f"; and {more} more"
        super().__init__(f"{self.summary}; nothing sent: {listed}")


class NotForSending(PrivacyViolation):
    """What a client never sends, whatever the round (`compendium.scrub.submission_rules`): free
    text in a metadata entry (a client sends only its statistics; the description and spec are
    the registry's) and personal data in a precondition flag name (sent as written, neither
    masked nor scrubbed). `build` writes neither; a compendium edited by hand or made by other
    tooling may hold them."""

    summary = (
        "the compendium carries what a client does not send: its metadata holds statistics only "
        "(no description or spec), its precondition flag names no personal data"
    )


class MaskedTooWeakly(PrivacyViolation):
    """The compendium records masking weaker than the open round expects (`weaker_masking`), or
    none: what masking at the round's λ would have removed from its text, beyond what the server
    can check, would leave the client. `submit(..., allow_weaker_masking=True)` sends it anyway
    (text masked by other tooling, which records no λ)."""

    def __init__(self, round_number: int, expected: float, applied: float | None, problem: str):
        self.round_number, self.expected, self.applied = round_number, expected, applied
        self.problem = problem
        recorded = "records no masking" if applied is None else f"was masked at λ = {applied:g}"
        super().__init__(
            [Violation("$.masking", f"{problem}, but the compendium {recorded}")],
            f"masked more weakly than round {round_number} expects: mask it at λ = {expected:g} "
            "(or more), or pass allow_weaker_masking=True to send it as it is",
        )


class TextNotMasked(PrivacyViolation):
    """Texts of the compendium still hold what masking at the open round's λ removes from any
    text, with the registry in force protected (`compendium.scrub.masking_residue`: e-mail
    addresses, phone numbers, identifiers, names...): the server's own check, run before
    sending, whatever λ the compendium records and whatever `allow_weaker_masking` says."""

    def __init__(self, round_number: int, strength: float, violations: list[Violation]):
        self.round_number, self.strength = round_number, strength
        super().__init__(
            violations,
            f"{len(violations)} text(s) of the compendium still hold what masking at round "
            f"{round_number}'s λ = {strength:g} removes from any text, which the server refuses",
        )


class NothingPublished(ClientError):
    """The server has published no global compendium yet (the first round)."""


class NothingToSubmit(ClientError):
    """The compendium has no entries at all: the server refuses it (it would replace the client's
    earlier submission to the round with nothing), so it is not sent."""


def nothing_to_submit(compendium: Compendium) -> bool:
    """True when the compendium has no entry in any collection (metadata, scenarios, precautions,
    templates, annex): what `build --since` makes when the pulled global covers everything."""
    return not any(compendium.entry_counts().values())


@dataclass
class SubmissionResult:
    status: int
    body: dict[str, Any]
    replayed: bool
    idempotency_key: str
    round: int
    attempts: int
    warnings: list[str] = field(default_factory=list)
    sent_bytes: int = 0  # the body as it went on the wire
    # True: the submission of this content under its first key had been replaced by a later one
    # in the round, so it went again under the next key (`idempotency_key`) and is in effect now
    reinstated: bool = False
    content_encoding: str | None = None  # gzip, dcz or None (plain)


@dataclass
class PullResult:
    updated: bool  # False: 304, the local copy is current
    round: int | None = None
    sha256: str | None = None
    etag: str | None = None
    path: Path | None = None
    head: Path | None = None  # the routing head saved beside it (None: the server has none)
    # the schema in force saved beside it (`schema_file`); None: not saved (see `warnings`)
    schema: Path | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class RouterPullResult:
    available: bool  # False: the server has no tuned router for the global (detail says why)
    updated: bool = False  # False: the local copy was current (or there is none to pull)
    path: Path | None = None
    round: int | None = None
    epochs: int | None = None
    total_bytes: int = 0  # the router's files, all together
    downloaded_bytes: int = 0  # what came over the network this time
    reused_files: int = 0  # files kept from the previous local copy (same sha256)
    delta_files: int = 0  # files rebuilt from a delta against this client's base model
    warnings: list[str] = field(default_factory=list)
    detail: str = ""
    code: str = ""


def round_config(round_info: dict[str, Any]) -> dict[str, Any]:
    """An open round's configuration as the rounds endpoint gives it ({} when it gives none)."""
    config = round_info.get("config")
    return config if isinstance(config, dict) else {}


def round_mask_strength(round_info: dict[str, Any]) -> float:
    """The masking strength λ the round expects clients to mask with, read from its
    configuration's `mask_strength` as the server reads it (`expected_mask_strength`): a
    configuration that names none, or a value that is no masking strength (not a finite number
    >= 0), expects the default λ, at which the server checks the text it receives."""
    return expected_mask_strength(round_config(round_info).get("mask_strength"))


def weaker_masking(round_info: dict[str, Any], applied: float | None) -> str | None:
    """What is wrong when text masked at λ = `applied` (None: no masking recorded) goes to the
    round, which expects at least its mask_strength; None when nothing is."""
    expected = round_mask_strength(round_info)
    if expected <= 0 or (applied is not None and applied >= expected):
        return None
    return f"round {round_info['number']} expects masking strength λ >= {expected:g}"


def http_date(value: str | None) -> dt.datetime | None:
    """An HTTP-date (RFC 9110, as a Date or Retry-After header gives it: "Wed, 21 Oct 2015
    07:28:00 GMT") as an aware time; None when `value` is none or not one."""
    try:
        when = parsedate_to_datetime((value or "").strip())
    except (ValueError, TypeError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": the date is in UTC, its zone not said
        when = when.replace(tzinfo=dt.UTC)
    return when


def answer_date(headers: Mapping[str, str]) -> dt.datetime | None:
    """The server's clock when an answer reached us: its Date, plus its Age when a cache between
    served it later (RFC 9111, 5.1: the seconds since the server made it; an Age that is not a
    whole number >= 0 is ignored, as the RFC says). None without a usable Date."""
    when = http_date(headers.get("Date"))
    age = (headers.get("Age") or "").strip()
    if when is not None and age.isascii() and age.isdigit():
        try:
            when += dt.timedelta(seconds=min(int(age), 2**31 - 1))  # RFC 9111: cap at 2^31
        except OverflowError:  # a Date near year 9999: no later time to say
            return None
    return when


def retry_after_seconds(value: str, now: dt.datetime | None = None) -> float | None:
    """The seconds a Retry-After header asks to wait (RFC 9110: delay-seconds, or an HTTP-date
    such as "Wed, 21 Oct 2015 07:28:00 GMT", counted from `now`, the answer's Date; this machine's
    clock when None), not
    capped, negative for a date past; None when it is neither."""
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return None if math.isnan(seconds) else seconds
    when = http_date(value)
    if when is None:
        return None
    return (when - (now or dt.datetime.now(dt.UTC))).total_seconds()


# What `submit` says when the server refuses a submission because no round takes it (409 without
# a `code`), before the server's own words
NO_ROUND_FOR_SUBMISSION = "the server has no round open for this submission"


# What a judgement of a deadline by this machine's clock adds to its words
BY_THIS_CLOCK = "judged by this machine's clock: the server's answer carried no usable Date header"


def deadline_passed(round_info: dict[str, Any], server_date: dt.datetime | None) -> str | None:
    """The server's refusal of a submission to the open round `round_info` (as the rounds
    endpoint gives it) once its deadline (`closes_at`) has passed, in the server's words (the
    round takes no more submissions and closes at the server's next check); None while it takes
    them (no deadline, one to come, or one that does not parse). Judged by the server's clock,
    which decides: `server_date`, the Date of its answer that gave `round_info`
    (`SynapseClient.server_date`); by this machine's clock only when that is None (no usable
    Date header), and then the words say so."""
    stamp = round_info.get("closes_at")
    try:
        closes_at = dt.datetime.fromisoformat(stamp).astimezone(dt.UTC) if stamp else None
    except (TypeError, ValueError):
        return None
    if closes_at is None or closes_at > (server_date or dt.datetime.now(dt.UTC)):
        return None
    return (
        f"round {round_info['number']} stopped taking submissions at its deadline "
        f"({closes_at.isoformat()}); it closes shortly"
        + ("" if server_date is not None else f" ({BY_THIS_CLOCK})")
    )


# How many times one submit sends a compendium again under a new key when the server says the
# key's submission was replaced by a later one (A, then B, then A again: A's key is replaced).
MAX_RESUBMISSIONS = 50


def idempotency_key(compendium: Compendium, round_number: int, attempt: int = 1) -> str:
    """Same content for the same round -> same key; anything else -> another key. `attempt` > 1:
    the key of the same content sent again after the submission under the previous one was
    replaced by a later one (`r<round>-<sha256>-<attempt>`): deterministic, so that a retry after
    a lost answer finds the submission that is in effect."""
    digest = canonical_form(compendium).sha256
    return f"r{round_number}-{digest}" + (f"-{attempt}" if attempt > 1 else "")


def _answer_json(response: httpx.Response) -> Any:
    """`response.json()`, with an answer nested deeper than Python's json reads a ValueError, as
    one that is not JSON is (it was a RecursionError traceback of every command)."""
    try:
        return response.json()
    except RecursionError:
        raise ValueError("the answer nests too deeply") from None


def _code(response: httpx.Response) -> str | None:
    """The `code` of a JSON error answer; None for another answer (a proxy's)."""
    try:
        code = _answer_json(response).get("code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, str) else None


_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def _detail(response: httpx.Response) -> str:
    try:
        body = _answer_json(response)
    except ValueError:
        text = response.text.strip()
        if text.startswith("<"):  # a proxy's HTML page: its title, not its first tag
            title = _HTML_TITLE.search(text)
            named = " ".join(title.group(1).split()) if title else ""
            return named[:200] or response.reason_phrase
        lines = text.splitlines()
        return lines[0][:200] if lines else response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]
    return json.dumps(body)[:200]


def _api_answer(response: httpx.Response) -> bool:
    """The answer is the SYNAPSE API's own (a JSON object with a `detail`), not a page of a
    proxy or another site at --server: a 404 of those says nothing about what is published."""
    try:
        body = _answer_json(response)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("detail"), str)


def _dictionary_refused(response: httpx.Response) -> bool:
    """The server does not hold the dcz body's dictionary (400, code unknown_dictionary) or does
    not speak dcz (415)."""
    if response.status_code == 415:
        return True
    if response.status_code != 400:
        return False
    try:
        body = _answer_json(response)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("code") == "unknown_dictionary"


def _holds_etag(path: Path, etag: str) -> bool:
    """True when the file at `path` is the compendium the global's ETag names (the sha256 of its
    canonical bytes): only then may a 304 leave it alone. A copy edited, truncated or damaged
    since it was pulled is downloaded again instead of being called up to date."""
    digest = etag.removeprefix("W/").strip('"')
    try:
        held = Compendium.model_validate_json(path.read_bytes(), strict=True)
    except (OSError, ValueError):
        return False
    return canonical_form(held).sha256 == digest


def _loopback(host: str) -> bool:
    """`host` (as httpx.URL gives it: "::1" without brackets) is this machine: localhost, or a
    loopback address (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SynapseClient:
    def __init__(
        self,
        server: str,
        token: str,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ):
        if not server.lower().startswith(("http://", "https://")):  # schemes ignore case
            raise ClientError(f"--server must be an http(s) URL; got {server!r}")
        try:
            url = httpx.URL(server)
            host = url.host  # decodes punycode: an invalid "xn--" label is a UnicodeError
            # as the socket layer encodes it: an empty or overlong label ("a..b") is one too
            url.raw_host.decode("ascii").encode("idna")
        except httpx.InvalidURL as exc:
            raise ClientError(f"--server is not a valid URL ({exc}); got {server!r}") from None
        except UnicodeError:
            raise ClientError(f"--server names a host that is not a valid domain name; got {server!r}") from None
        if not host:
            raise ClientError(f"--server names no host; got {server!r}")
        if url.port is not None and not 1 <= url.port <= 65535:
            # the socket layer takes the port modulo 65536: 99999 would reach port 34463, with
            # the token, whatever listens there
            raise ClientError(
                f"--server names port {url.port}, which no TCP port is (1 to 65535); got {server!r}"
            )
        if url.userinfo:
            # httpx would send it as Basic credentials in place of the API token (every request
            # a 401), and it would be printed in every error naming the server
            raise ClientError(
                "--server carries a user name or password (user:password@host): the API token "
                "is what authenticates; give the URL without them"
            )
        if not token.strip():
            raise ClientError("the API token is empty")
        if not all(" " < char < "\x7f" for char in token.strip()):
            # an HTTP header cannot carry it; a token is printable ASCII (syn_c_…)
            raise ClientError(
                "the API token holds a space, a control character or a non-ASCII character, "
                "which no token has: check --token or SYNAPSE_TOKEN"
            )
        self.server = server.rstrip("/")
        # The bearer token (and every compendium) goes unencrypted to another machine: said by
        # the command line, not refused (a federation on a private network may choose it).
        self.in_clear = url.scheme == "http" and not _loopback(host)
        self.retries = max(0, retries)
        self.backoff = max(0.0, backoff)
        self._sleep = sleep
        try:
            self._http = httpx.Client(
                base_url=self.server,
                timeout=timeout,
                transport=transport,
                headers={
                    "Authorization": f"Bearer {token.strip()}",
                    "Accept": "application/json",
                    "User-Agent": USER_AGENT,
                },
            )
        except (ImportError, ValueError) as exc:
            # httpx sets up every proxy the environment names here: socks5:// without the
            # socksio package is an ImportError, another scheme a ValueError (tracebacks before)
            raise ClientError(
                "cannot use the proxy the environment names (HTTP_PROXY, HTTPS_PROXY or "
                f"ALL_PROXY): {exc}; name an http:// or https:// proxy, or unset it"
            ) from None
        except OSError as exc:  # SSL_CERT_FILE or SSL_CERT_DIR: missing, or holds no certificate
            # the one httpx read: SSL_CERT_FILE when set, else SSL_CERT_DIR
            name = next((n for n in ("SSL_CERT_FILE", "SSL_CERT_DIR") if os.environ.get(n)), None)
            named = f"{name}={os.environ[name]}" if name else ""
            raise ClientError(
                "cannot load the certificates that check the server's TLS certificate"
                + (f" ({named})" if named else "") + f": {exc.strerror or exc}"
            ) from None
        self.attempts = 0
        # When the server sent its latest answer, by its Date header (its own clock, which
        # decides whether a deadline has passed); None: no answer yet, or no usable Date.
        self.server_date: dt.datetime | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SynapseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """How long to wait before the next try: as long as a 429's or a 503's Retry-After asks
        (RFC 9110 allows it on both; a date counted from the answer's Date, the server's clock,
        or this machine's when it sent none), at most MAX_RETRY_AFTER_S; otherwise the backoff,
        doubling."""
        if response is not None and response.status_code in (429, 503):
            wait = retry_after_seconds(response.headers.get("Retry-After", ""),
                                       now=answer_date(response.headers))
            if wait is not None:
                return min(MAX_RETRY_AFTER_S, max(0.0, wait))
        return min(30.0, self.backoff * (2 ** min(attempt, 16)))  # 2**1025 is past a float

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One logical request: retried on network errors, 5xx and 429."""
        last = ""
        self.attempts = 0
        for attempt in range(self.retries + 1):
            self.attempts += 1
            response = None
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.RequestError as exc:  # network, or a body that does not decode (a proxy)
                last = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
            else:
                self.server_date = answer_date(response.headers)
                if response.status_code < 500 and response.status_code != 429:
                    return response
                last = f"HTTP {response.status_code}: {_detail(response)}"
            if attempt < self.retries:
                self._sleep(self._delay(attempt, response))
        raise ClientError(
            f"{method} {self.server}{path} failed after {self.attempts} attempt(s): {last}"
        )

    def _auth_error(self, response: httpx.Response) -> ClientError:
        return ClientError(
            f"the server refused the token (HTTP {response.status_code}): {_detail(response)}"
        )

    def _json(self, response: httpx.Response, what: str) -> Any:
        try:
            return _answer_json(response)
        except ValueError:
            raise ClientError(f"the server's answer to {what} is not JSON") from None

    def _get_json(self, path: str, failure: str, what: str, **kwargs: Any) -> Any:
        """The JSON of a 200 answer to GET `path`; otherwise the authentication error, or
        `failure (HTTP n): the server's detail`."""
        response = self.request("GET", path, **kwargs)
        if response.status_code in (401, 403):
            raise self._auth_error(response)
        if response.status_code == 404 and not _api_answer(response):
            # a page of a proxy or another site, or the server's own HTML 404 for a --server
            # with a path it does not serve (the API is under /api/, answering JSON)
            raise ClientError(
                f"{failure}: HTTP 404 from {self.server}, not an answer of the SYNAPSE API "
                f"({_detail(response)}): check --server"
            )
        if response.status_code != 200:
            raise ClientError(f"{failure} (HTTP {response.status_code}): {_detail(response)}")
        return self._json(response, what)

    def _page(
        self, path: str, failure: str, what: str, params: dict
    ) -> tuple[list[dict[str, Any]], int]:
        """The objects of the first page of a paginated list (`{"count", "results": [...]}`),
        and how many the whole list holds (its `count`; the page's length when it has none)."""
        body = self._get_json(path, failure, what, params=params)
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise ClientError(f"the server's answer to {what} has no 'results' list")
        objects = [r for r in results if isinstance(r, dict)]
        count = body.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < len(objects):
            count = len(objects)
        return objects, count

    def _results(self, path: str, failure: str, what: str, params: dict) -> list[dict[str, Any]]:
        """The objects of the first page of a paginated list (`{"results": [...]}`)."""
        return self._page(path, failure, what, params)[0]

    def rounds(self, state: str | None = None) -> list[dict[str, Any]]:
        """The latest rounds (newest first; the server's first page), optionally in one state."""
        params = {"state": state} if state else {}
        rounds = self._results("/api/v1/rounds/", "cannot list rounds", "the round list", params)
        return [r for r in rounds if isinstance(r.get("number"), int)]

    def open_round(self) -> dict[str, Any]:
        open_rounds = self.rounds("open")
        if not open_rounds:
            raise ClientError("no round is open on the server: nothing to submit to")
        return max(open_rounds, key=lambda r: r["number"])

    def submissions(self, round_number: int | None = None) -> list[dict[str, Any]]:
        """This client's own submissions as the server recorded them, newest first (the
        server's first page): round, time, sha256, sizes, entry counts, whether in effect."""
        return self.counted_submissions(round_number)[0]

    def counted_submissions(self, round_number: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """`submissions` (the newest, the server's first page) and how many this client made
        in all (of `round_number`), past that page too."""
        params = {"round": round_number} if round_number is not None else {}
        return self._page(
            "/api/v1/submissions/", "cannot list this client's submissions", "the submission list",
            params,
        )

    def submit(
        self,
        compendium: Compendium,
        compress: bool = True,
        dictionary: bytes | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
        allow_weaker_masking: bool = False,
    ) -> SubmissionResult:
        """Submit to the open round. Before any byte of the compendium is sent, the checks of
        the privacy boundary run, each a PrivacyViolation listing what it found (nothing sent):
        what a client never sends (NotForSending: free text in metadata, personal data in a flag
        name), masking weaker than the open round's λ, or none recorded (MaskedTooWeakly, unless
        `allow_weaker_masking`: text masked by other tooling, sent at the caller's word), and the
        server's own check of the text at the round's λ with the registry in force
        (TextNotMasked, whatever `allow_weaker_masking` says). The server refuses all of these,
        but only once the text has left the client. `compress`: the body goes gzip-encoded
        (`Content-Encoding: gzip`, about a quarter of the bytes of a MetaTool compendium), or,
        given a `dictionary` the server holds (`compendium.transport`: the pulled global's or the
        schema's), as `dcz` against it (about 30% fewer bytes again); when the server answers
        that it does not hold that dictionary, or does not speak dcz, the same submission goes
        again gzip-encoded, with a warning. The server stores the same canonical bytes either
        way, and the idempotency key does not depend on the encoding. A compendium without
        entries is not sent (NothingToSubmit). `check`, when given, is called with the open round
        (as `open_round` gives it, with its `config`) after those checks and before anything is
        sent; it raises to send nothing. Every POST names that round (`X-Synapse-Round`), so one
        that reaches the server once another round is open stores nothing (ClientError: the
        round changed). When the server answers that this content's key was replaced by a later
        submission in the round (409 `replaced`: the user submits an earlier compendium again),
        it goes again under the next key (`idempotency_key(..., attempt)`), which puts it back in
        effect (`reinstated`)."""
        if nothing_to_submit(compendium):
            raise NothingToSubmit(
                "the compendium has no entries (metadata, scenarios, precautions, templates and "
                "annex are all empty): nothing to submit"
            )
        refused = submission_rules(compendium)
        if refused:
            raise NotForSending(refused)
        round_info = self.open_round()
        self._check_masking(compendium, round_info, allow_weaker_masking)
        if check is not None:
            check(round_info)
        number = round_info["number"]
        form = canonical_form(compendium)
        warnings = []
        encoding = None
        if compress:
            encoding = transport.CONTENT_ENCODING if dictionary else "gzip"
        attempts = 0
        reinstated = False
        for attempt in range(1, MAX_RESUBMISSIONS + 2):
            key = idempotency_key(compendium, number, attempt)
            response, body = self._post_submission(form.data, key, number, encoding, dictionary)
            attempts += self.attempts
            if encoding == transport.CONTENT_ENCODING and _dictionary_refused(response):
                warnings.append(
                    f"the server cannot read this dictionary ({_detail(response)}); sent gzip "
                    "instead"
                )
                encoding = "gzip"
                response, body = self._post_submission(form.data, key, number, encoding, None)
                attempts += self.attempts
            if response.status_code != 409 or _code(response) != "replaced":
                break
            # This content's submission under `key` was replaced by a later one: the user wants
            # it in effect again, which the next key does (or finds, when it was already done).
            reinstated = True
            replaced_detail = _detail(response)
        else:
            raise ClientError(
                f"the server answered that this compendium's submission was replaced "
                f"{MAX_RESUBMISSIONS + 1} times in round {number}: {_detail(response)}"
            )
        status = response.status_code
        if reinstated and status == 409:
            # The round stopped taking submissions (or another opened) after the earlier
            # submission of this content was replaced: the later one stays in effect.
            raise ClientError(
                f"this compendium's submission to round {number} was replaced by a later one, "
                f"which stays in effect ({replaced_detail}); sending it again under a new key "
                f"was refused: {_detail(response)}"
            )
        if status in (200, 201):
            answer = self._json(response, "the submission")
            if not isinstance(answer, dict):
                raise ClientError(
                    f"the server's answer to the submission (HTTP {status}) is not a JSON object: "
                    f"{_detail(response)}; `synapse-client status` shows whether it was stored"
                )
            return SubmissionResult(
                warnings=warnings,
                status=status,
                body=answer,
                replayed=response.headers.get("Idempotent-Replayed", "").lower() == "true",
                idempotency_key=key,
                round=number,
                attempts=attempts,
                reinstated=reinstated,
                sent_bytes=len(body),
                content_encoding=encoding,
            )
        if status == 400:
            try:
                payload = _answer_json(response)
            except ValueError:  # a proxy's page, not the API's violations
                raise ClientError(
                    "the submission was refused (HTTP 400), by an answer that is not the SYNAPSE "
                    f"API's: {_detail(response)}"
                ) from None
            violations = payload.get("violations") if isinstance(payload, dict) else None
            # The server's paths index the canonical bytes sent (entries sorted); the caller's
            # compendium (a file, maybe edited or reordered by hand) has its own order.
            positions = canonical_positions(compendium)
            clean = [
                {
                    "path": reindex_paths(str(v.get("path", "$")), positions),
                    "reason": reindex_paths(str(v.get("reason", "")), positions),
                }
                for v in (violations if isinstance(violations, list) else [])
                if isinstance(v, dict)
            ]
            raise SubmissionRejected(_detail(response), clean)
        if status in (401, 403):
            raise self._auth_error(response)
        if status == 409:
            code = _code(response)
            if code == "round_changed":
                raise ClientError(f"the open round changed after this client checked the "
                                  f"submission for round {number}: {_detail(response)}")
            if code == "schema_changed":
                raise ClientError(f"the server's schema changed while it checked the submission: "
                                  f"{_detail(response)}")
            raise ClientError(f"{NO_ROUND_FOR_SUBMISSION}: {_detail(response)}")
        if status == 413:
            sent = f"{len(body)} sent{f' {encoding}' if encoding else ''}"
            raise ClientError(
                f"the server refused the compendium as too large (HTTP 413): {_detail(response)}; "
                f"it is {form.size_bytes} bytes ({sent}): build it again with --max-bytes under "
                "the limit"
            )
        raise ClientError(f"unexpected answer to the submission (HTTP {status}): {_detail(response)}")

    def _check_masking(
        self, compendium: Compendium, round_info: dict[str, Any], allow_weaker_masking: bool
    ) -> None:
        """The masking checks of `submit` against the open round `round_info`: the λ the
        compendium records against the round's (MaskedTooWeakly, unless `allow_weaker_masking`),
        then what the server checks on arrival, masking's residue at the round's λ with the
        registry in force protected (TextNotMasked). A round at λ = 0 takes text as it comes;
        one that names no λ expects the default, as the server does."""
        applied = compendium.masking.strength if compendium.masking is not None else None
        expected = round_mask_strength(round_info)
        problem = weaker_masking(round_info, applied)
        if problem is not None and not allow_weaker_masking:
            raise MaskedTooWeakly(round_info["number"], expected, applied, problem)
        if not expected:
            return
        schema, _ = self.schema()  # the registry the server protects, as in force now
        residue = masking_residue(compendium, TextMasker.for_registry(schema.tools, strength=expected))
        if residue:
            raise TextNotMasked(round_info["number"], expected, residue)

    def _post_submission(
        self, data: bytes, key: str, round_number: int, encoding: str | None,
        dictionary: bytes | None,
    ) -> tuple[httpx.Response, bytes]:
        # X-Synapse-Round: the round the body was checked for; a retry that reaches the server
        # after that round closed and another opened is refused (round_changed), not stored there.
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "X-Synapse-Round": str(round_number),
        }
        body = data
        if encoding == "gzip":
            body = gzip.compress(data, 9, mtime=0)
        elif encoding == transport.CONTENT_ENCODING:
            body = transport.compress(data, dictionary)
        if encoding:
            headers["Content-Encoding"] = encoding
        response = self.request("POST", "/api/v1/submissions/", content=body, headers=headers)
        return response, body

    def pull(
        self, out: Path, round_number: int | None = None,
        schema: tuple[Schema, bytes] | None = None,
    ) -> PullResult:
        """Save the published global compendium (of `round_number`, else the latest) to `out`,
        the routing head published with it beside it (`head_file`), and the schema in force
        (`schema_file`): the registry changes without a new global, so that is saved again on a
        304 too. `schema`: the schema in force as `schema()` returned it, when the caller holds
        it already (participate), saved instead of downloading it again."""
        out = Path(out)
        etag_path = etag_file(out)
        headers = {}
        if out.exists() and etag_path.exists():
            try:
                etag = etag_path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):  # unreadable or damaged: as if there were none
                etag = ""
            if etag and _holds_etag(out, etag):
                headers["If-None-Match"] = etag
        params = {"round": str(round_number)} if round_number is not None else None
        response = self.request("GET", "/api/v1/compendium/global/", params=params, headers=headers)
        status = response.status_code
        if status == 304 and "If-None-Match" not in headers:  # a proxy's cache: nothing held
            raise ClientError(
                f"the server answered 304 (not modified) though this client holds no copy of the "
                f"global compendium at {out} (it asked for it whole): check --server, or pull again"
            )
        if status == 304:
            result = PullResult(updated=False, etag=headers.get("If-None-Match"), path=out)
            if head_file(out).exists():
                result.head = head_file(out)
            else:  # pulled before the server published heads, or the file was removed
                self._pull_head(out, round_number, result)
            self._save_schema(out, result, schema)
            return result
        if status in (401, 403):
            raise self._auth_error(response)
        if status == 404 and _api_answer(response):
            raise NothingPublished(f"no global compendium is published: {_detail(response)}")
        if status == 404:  # a proxy's page, or another site at --server
            raise ClientError(
                f"cannot download the global compendium: HTTP 404 from {self.server}, not an "
                f"answer of the SYNAPSE API ({_detail(response)}): check --server"
            )
        if status != 200:
            raise ClientError(
                f"cannot download the global compendium (HTTP {status}): {_detail(response)}"
            )
        payload = self._json(response, "the global compendium request")
        doc = payload.get("compendium") if isinstance(payload, dict) else None
        if not isinstance(doc, dict):
            raise ClientError("the server's answer has no 'compendium' object")
        try:
            compendium = Compendium.model_validate(doc, strict=True)
            local = canonical_form(compendium).sha256
        except UnicodeEncodeError:
            raise ClientError(
                f"the server sent a compendium this client cannot read: {LONE_SURROGATE}"
            ) from None
        except ValidationError as exc:
            raise ClientError(
                f"the server sent a compendium this client cannot read: {validation_summary(exc)}"
            ) from None
        except ValueError:  # the canonical form's: 1e999 reads as infinity, which JSON cannot write
            raise ClientError(
                "the server sent a compendium this client cannot read: it holds a number that is "
                "not finite"
            ) from None
        result = PullResult(
            updated=True,
            round=payload.get("round") if isinstance(payload.get("round"), int) else None,
            sha256=payload.get("sha256") if isinstance(payload.get("sha256"), str) else None,
            etag=response.headers.get("ETag"),
            path=out,
        )
        if result.sha256 and result.sha256 != local:
            result.warnings.append(
                f"the server's sha256 {result.sha256[:12]}… differs from this client's canonical "
                f"form {local[:12]}…"
            )
        # The head beside `out` was published with the global it replaces: gone before the new
        # global is written, so that a head download that fails now leaves none (fetched again
        # on the next pull, even a 304) rather than the old round's head beside the new global.
        head_file(out).unlink(missing_ok=True)
        write_atomically(out, json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8"))
        if result.etag:
            write_atomically(etag_path, (result.etag + "\n").encode("utf-8"))
        elif etag_path.exists():
            etag_path.unlink()
        self._pull_head(out, result.round if result.round is not None else round_number, result)
        self._save_schema(out, result, schema)
        return result

    def schema(self) -> tuple[Schema, bytes]:
        """The schema S in force (registry, numeric fields, limits) and its JSON as saved."""
        payload = self._get_json(
            "/api/v1/compendium/schema/", "cannot download the schema", "the schema request"
        )
        try:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
            schema = Schema.model_validate_json(data)  # as `build` reads the file back
        except UnicodeEncodeError:
            raise ClientError(
                f"the server sent a schema this client cannot read: {LONE_SURROGATE}"
            ) from None
        except ValidationError as exc:
            raise ClientError(
                f"the server sent a schema this client cannot read: {validation_summary(exc)}"
            ) from None
        return schema, data

    def fetch_schema(self, out: Path) -> tuple[Schema, bytes]:
        """Save the schema S in force (registry, numeric fields, limits) to `out`; it is what
        `build` and `validate` read, and `pull` saves beside a global (`schema_file`). Returns
        it as `schema()` does."""
        schema, data = self.schema()
        write_atomically(Path(out), data)
        return schema, data

    def _save_schema(
        self, out: Path, result: PullResult, fetched: tuple[Schema, bytes] | None
    ) -> None:
        """Save the schema in force beside the pulled global (`schema_file`), which `route`
        reads to leave out the global's tools the registry has deactivated since. A failure
        here only warns: the global is saved, and the schema an earlier pull saved stays."""
        path = schema_file(out)
        try:
            if fetched is None:
                self.fetch_schema(path)
            else:
                write_atomically(path, fetched[1])
        except ClientError as exc:
            result.warnings.append(
                f"the schema in force was not saved ({exc}): "
                + (f"{path} is the one an earlier pull saved, and route leaves out the global's "
                   "tools it does not list" if path.exists() else
                   "route leaves out none of the global's tools until a pull saves it")
            )
            return
        result.schema = path

    def fetch_probe(self, out: Path) -> int:
        """Save the public probe set's requests to `out` (for dcz before any global is published:
        `transport.probe_dictionary`); how many there are."""
        payload = self._get_json(
            "/api/v1/compendium/probe/", "cannot download the probe set", "the probe set request"
        )
        try:
            texts = transport.probe_texts_of(payload)
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ClientError(
                f"the server sent a probe set this client cannot read: {LONE_SURROGATE}"
            ) from None
        except ValueError as exc:
            raise ClientError(f"the server sent a probe set this client cannot read: {exc}") from None
        write_atomically(Path(out), data)
        return len(texts)

    def _pull_head(self, out: Path, round_number: int | None, result: PullResult) -> None:
        """Save the routing head published with the pulled global beside it (`head_file`), or
        remove a stale one when the server has none. A failure here only warns: without the
        file the client's router fits a head of its own from the compendium."""
        path = head_file(out)
        params = {"round": str(round_number)} if round_number is not None else None
        try:
            response = self.request("GET", "/api/v1/compendium/global/head/", params=params)
        except ClientError as exc:
            result.warnings.append(f"the routing head was not downloaded: {exc}")
            return
        if response.status_code == 404:
            if path.exists():
                path.unlink()
            return
        if response.status_code != 200:
            result.warnings.append(
                f"the routing head was not downloaded (HTTP {response.status_code}): "
                f"{_detail(response)}"
            )
            return
        problem = _head_problem(response.content)
        if problem:
            result.warnings.append(f"the server's routing head is unusable ({problem}); not saved")
            return
        try:
            write_atomically(path, response.content)
        except CannotWrite as exc:
            result.warnings.append(f"the routing head was not saved: {exc}")
            return
        result.head = path


    def pull_router(self, out: Path, round_number: int | None = None) -> RouterPullResult:
        """Download the routing encoder the server tuned on the global pulled to `out` into
        `router_dir(out)` (about 90 MB with MiniLM), so that `synapse-client route` ranks
        exactly as the server does. Only files whose sha256 changed come over the network; each
        is checked against the manifest, and the folder is replaced whole or not at all. When the
        server has none (tuning off, running, failed), returns `available=False` with its reason
        and removes a local copy that belongs to another global."""
        folder = router_dir(out)
        # One pull of a folder at a time (a scheduler's and a person's): each removes, renames
        # and fills the folders beside it. The lock is the operating system's, so a killed pull
        # releases it; a pull that waits finds the folder the other one put in place.
        lock = filelock.FileLock(folder.with_name(folder.name + ".lock"))
        try:
            lock.acquire(timeout=ROUTER_LOCK_WAIT_SECONDS)
        except filelock.Timeout:
            raise ClientError(
                f"another synapse-client has been downloading the tuned router into {folder} "
                f"for {ROUTER_LOCK_WAIT_SECONDS // 60} minutes; try again when it ends"
            ) from None
        except OSError as exc:
            raise ClientError(
                f"cannot lock {lock.lock_file} ({exc.strerror or exc}) to download the tuned "
                "router"
            ) from None
        try:
            return self._pull_router(folder, out, round_number)
        finally:
            lock.release()

    def _pull_router(self, folder: Path, out: Path, round_number: int | None) -> RouterPullResult:
        from routing.finetune import ROUTER_MANIFEST, manifest_problem, read_manifest

        _restore_retired(folder)
        params = {"round": str(round_number)} if round_number is not None else None
        response = self.request("GET", "/api/v1/compendium/global/router/", params=params)
        if response.status_code in (401, 403):
            raise self._auth_error(response)
        if response.status_code == 404:
            body = self._json(response, "the tuned router request")
            code = body.get("code", "") if isinstance(body, dict) else ""
            if isinstance(code, str) and code.startswith("router_"):
                self._drop_stale_router(folder, out)
                return RouterPullResult(
                    available=False, path=folder, detail=_detail(response), code=code
                )
            raise ClientError(f"no tuned router to download: {_detail(response)}")
        if response.status_code != 200:
            raise ClientError(
                f"cannot download the tuned router's manifest (HTTP {response.status_code}): "
                f"{_detail(response)}"
            )
        manifest = self._json(response, "the tuned router request")
        problem = manifest_problem(manifest)
        if problem:
            raise ClientError(f"the server's tuned-router manifest is unusable: {problem}")
        files = manifest["files"]
        result = RouterPullResult(
            available=True, path=folder, round=manifest.get("round"),
            epochs=manifest.get("epochs"), total_bytes=sum(f["size"] for f in files),
        )
        local = read_manifest(folder) if folder.is_dir() else None
        if local is not None and _same_router(local, manifest) and all(
            _intact(folder / f["path"], f) for f in files
        ):
            return result
        if isinstance(manifest.get("round"), int):  # the files of this manifest's round, even if
            params = {"round": str(manifest["round"])}  # a newer global is published meanwhile
        # Under the lock: what a killed pull left here is no other pull's.
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            for entry in files:
                target = partial / entry["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                source = folder / entry["path"]
                if _intact(source, entry):  # the local copy already holds these bytes
                    shutil.copyfile(source, target)
                    result.reused_files += 1
                    continue
                if self._rebuild_from_delta(entry, params, target, result):
                    continue
                self._download_router_file(entry, params, target)
                result.downloaded_bytes += entry["size"]
            (partial / ROUTER_MANIFEST).write_text(
                json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8"
            )
            _replace_folder(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        result.updated = True
        return result

    def _rebuild_from_delta(
        self, entry: dict, params: dict | None, target: Path, result: RouterPullResult
    ) -> bool:
        """Rebuild `entry` at `target` from its delta and this client's copy of the base model
        (`routing.weights_delta`: about 40 MB instead of 91 for MiniLM) when the manifest offers
        one against a base file this client holds; False when it cannot (no delta, another
        base, or a rebuilt file that does not match: then the whole file is downloaded)."""
        from routing.finetune import file_sha256
        from routing.weights_delta import DeltaError, apply_delta

        delta = entry.get("delta")
        base = _local_base_file(entry["path"])
        if not delta or base is None or file_sha256(base) != delta["base_sha256"]:
            return False
        packed = target.with_name(target.name + ".delta")
        try:
            self._download_router_file(delta, params, packed)
            result.downloaded_bytes += delta["size"]
            rebuilt = apply_delta(packed.read_bytes(), base)
        except (ClientError, DeltaError, OSError) as exc:
            result.warnings.append(f"{entry['path']}: the delta did not serve ({exc}); downloading it whole")
            return False
        finally:
            packed.unlink(missing_ok=True)
        if len(rebuilt) != entry["size"] or hashlib.sha256(rebuilt).hexdigest() != entry["sha256"]:
            result.warnings.append(
                f"{entry['path']}: the file rebuilt from its delta does not match the manifest; "
                "downloading it whole"
            )
            return False
        target.write_bytes(rebuilt)
        result.delta_files += 1
        return True

    def _download_router_file(self, entry: dict, params: dict | None, target: Path) -> None:
        """Stream one file of the manifest to `target`, retried like any request, and check its
        size and sha256 against the manifest."""
        path = f"/api/v1/compendium/global/router/files/{entry['path']}"
        last = ""
        for attempt in range(self.retries + 1):
            failed = None
            try:
                with self._http.stream("GET", path, params=params) as response:
                    if response.status_code in (401, 403):
                        response.read()
                        raise self._auth_error(response)
                    if response.status_code == 200:
                        digest, size = hashlib.sha256(), 0
                        with open(target, "wb") as handle:
                            for block in response.iter_bytes(1 << 20):
                                digest.update(block)
                                size += len(block)
                                handle.write(block)
                        if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
                            raise ClientError(
                                f"the tuned router's {entry['path']} does not match its "
                                f"manifest ({size} bytes, sha256 {digest.hexdigest()[:12]}…; "
                                f"expected {entry['size']}, {entry['sha256'][:12]}…): not saved"
                            )
                        return
                    response.read()
                    last = f"HTTP {response.status_code}: {_detail(response)}"
                    if response.status_code < 500 and response.status_code != 429:
                        raise ClientError(f"cannot download the tuned router's {entry['path']} ({last})")
                    failed = response
            except httpx.RequestError as exc:
                last = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
            if attempt < self.retries:
                self._sleep(self._delay(attempt, failed))
        raise ClientError(
            f"GET {self.server}{path} failed after {self.retries + 1} attempt(s): {last}"
        )

    @staticmethod
    def _drop_stale_router(folder: Path, out: Path) -> None:
        """Remove a local tuned router that was tuned on another global than the one in `out`."""
        from routing.finetune import read_manifest

        manifest = read_manifest(folder) if folder.is_dir() else None
        if manifest is None:
            return
        try:
            local = canonical_form(
                Compendium.model_validate_json(Path(out).read_bytes(), strict=True)
            ).sha256
        except (OSError, ValueError):
            return
        if manifest.get("global_sha256") != local:
            shutil.rmtree(folder, ignore_errors=True)


def _retired(folder: Path) -> Path:
    return folder.with_name(folder.name + ".old")


def _restore_retired(folder: Path) -> None:
    """Put back the copy a pull killed between `_replace_folder`'s two renames left in .old
    (its only copy then); a .old beside a folder in place is a leftover of no use."""
    retired = _retired(folder)
    if not retired.is_dir():
        return
    if folder.exists():
        shutil.rmtree(retired, ignore_errors=True)
    else:
        retired.rename(folder)


def _replace_folder(new: Path, folder: Path) -> None:
    """Put the folder `new` in place of `folder` (a folder cannot be renamed over another that
    holds files): the old one moves aside to .old, the new one in, and the old one is removed.
    When the new one cannot be moved in, the old one goes back: the previous copy is kept, and
    the error says so."""
    retired = _retired(folder)
    shutil.rmtree(retired, ignore_errors=True)
    try:
        if folder.exists():
            folder.rename(retired)
        try:
            new.rename(folder)
        except OSError:
            if retired.exists() and not folder.exists():
                retired.rename(folder)
            raise
    except OSError as exc:
        raise ClientError(
            f"cannot put the tuned router in place at {folder} ({exc.strerror or exc}); the "
            "previous copy is kept"
        ) from None
    shutil.rmtree(retired, ignore_errors=True)


def _local_base_file(name: str) -> Path | None:
    """This client's copy of the base model's file `name` (the bundled MiniLM), if any."""
    try:
        from routing.embeddings import _bundled_path

        path = Path(_bundled_path()) / name
    except Exception:  # no bundled model here: the whole file is downloaded
        return None
    return path if path.is_file() else None


def _same_router(local: dict, remote: dict) -> bool:
    keys = ("global_sha256", "rows_sha256", "files")
    return all(local.get(k) == remote.get(k) for k in keys)


def _intact(path: Path, entry: dict) -> bool:
    """`path` holds the manifest entry's bytes (size, then sha256: a damaged local copy is
    downloaded again)."""
    from routing.finetune import file_sha256

    return (
        path.is_file() and path.stat().st_size == entry["size"]
        and file_sha256(path) == entry["sha256"]
    )


def router_dir(compendium_path: Path) -> Path:
    """Where `pull_router` saves the tuned router of a pulled global: COMPENDIUM.router/."""
    compendium_path = Path(compendium_path)
    return compendium_path.with_name(compendium_path.name + ".router")


def etag_file(out: Path) -> Path:
    return out.with_name(out.name + ".etag")


def global_document(doc):
    """A pulled global as JSON: the compendium itself (what `pull` saves) or the body of
    GET /api/v1/compendium/global/ saved as it came (curl -o), whose `compendium` it is."""
    if isinstance(doc, dict) and isinstance(doc.get("compendium"), dict):
        return doc["compendium"]
    return doc


def schema_file(compendium_path: Path) -> Path:
    """Where `pull` saves the schema in force beside a pulled global: COMPENDIUM.schema.json
    (`route` leaves out the global's tools it does not list: deactivated in the registry)."""
    compendium_path = Path(compendium_path)
    return compendium_path.with_name(compendium_path.name + ".schema.json")


def head_file(compendium_path: Path) -> Path:
    """Where `pull` saves the routing head of a pulled global: COMPENDIUM.head.npz."""
    compendium_path = Path(compendium_path)
    return compendium_path.with_name(compendium_path.name + ".head.npz")


def _head_problem(data: bytes) -> str | None:
    """Why `data` is not a routing head the router can use, or None: the router's own check
    (`LinearHead.from_bytes`), so that what `pull` saves is what `route` reads."""
    from routing.router import LinearHead

    try:
        LinearHead.from_bytes(data)
    except ValueError as exc:
        return str(exc)
    return None


def sent_file(folder: Path) -> Path:
    """Where `participate` records what this client sent, round by round: FOLDER/sent.json."""
    return Path(folder) / "sent.json"


def _sent_record(path: Path) -> dict:
    """The record at `path` as JSON ({"rounds": {round number (str): [keys]}, "nothing_new":
    [round numbers]}); {} when missing or unreadable."""
    try:
        record = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the parser
        return {}
    return record if isinstance(record, dict) else {}


def _sent_rounds(path: Path) -> dict:
    """The record at `path`: {round number (str): [keys]}; {} when missing or unreadable."""
    rounds = _sent_record(path).get("rounds", {})
    return rounds if isinstance(rounds, dict) else {}


def _nothing_new_rounds(path: Path) -> set[int]:
    """The rounds in which `participate` had nothing new to send (`record_nothing_new`)."""
    numbers = _sent_record(path).get("nothing_new", [])
    if not isinstance(numbers, list):
        return set()
    return {n for n in numbers if isinstance(n, int) and not isinstance(n, bool)}


def _write_sent(path: Path, rounds: dict, nothing_new: set[int]) -> None:
    record: dict[str, Any] = {"rounds": rounds}
    if nothing_new:
        record["nothing_new"] = sorted(nothing_new)
    write_atomically(Path(path), json.dumps(record, sort_keys=True).encode("utf-8"))


def merged_rounds(published: list[dict[str, Any]], global_round: int | None) -> set[int]:
    """The rounds whose submissions the global of `global_round` holds, from the published
    rounds (`ClientAPI.rounds("published")`, each with its `config`): that round and the
    published rounds before it, back to the latest one that did not carry the previous global
    forward (its global holds its own submissions alone), that one included. Rounds that failed
    or never published hold nothing. Rounds older than the list reaches are left out (what was
    sent then is offered again: never less)."""
    if global_round is None:
        return set()
    held: set[int] = set()
    for info in sorted(published, key=lambda r: r["number"], reverse=True):
        if info["number"] > global_round:
            continue
        held.add(info["number"])
        if round_config(info).get("carry_forward") is False:
            break
    return held


def sent_before(path: Path, rounds: set[int]) -> set[str]:
    """The keys (`delta.sent_keys`) of what this client sent in `rounds` (`merged_rounds`: those
    the global it pulled holds, merged); empty without a record, or when the record cannot be
    read (then everything is offered again: never less)."""
    try:
        return {
            key
            for number, keys in _sent_rounds(path).items()
            if int(number) in rounds
            for key in keys
            if isinstance(key, str)
        }
    except (ValueError, TypeError):
        return set()


def record_sent(path: Path, round_number: int, keys: set[str]) -> None:
    """Record what this client's submission to `round_number` holds; a new submission to the
    same round replaces it, as the server replaces the submission."""
    rounds = _sent_rounds(path)
    rounds[str(round_number)] = sorted(keys)
    _write_sent(path, rounds, _nothing_new_rounds(path) - {round_number})


def record_nothing_new(path: Path, round_number: int) -> None:
    """Record that `participate` had nothing new to send in `round_number` (the pulled global
    covers everything; the server refuses an empty compendium): this client's part of the round
    is done, which `status --require-submitted --dir` reads (`had_nothing_new`). What an earlier
    submission to the round held stays recorded."""
    _write_sent(path, _sent_rounds(path), _nothing_new_rounds(path) | {round_number})


def had_nothing_new(path: Path, round_number: int) -> bool:
    """Whether `participate` recorded at `path` that it had nothing new to send in
    `round_number`; False without a record, or when it cannot be read."""
    return round_number in _nothing_new_rounds(path)


def special_file(path: Path) -> str | None:
    """What `path` is when it exists as neither a regular file nor a folder ("a device", "a
    pipe (FIFO)", "a socket"; a link is followed), else None."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def names_a_folder(path: str) -> bool:
    """Whether `path` as written names a folder: it ends in a separator, "." or ".." (Path drops
    a trailing separator, so `--out newdir/` would write a file called newdir)."""
    return os.path.basename(str(path)) in ("", ".", "..")


def out_file_problem(path: str, flag: str = "--out") -> str | None:
    """Why a command could not write its results to `path` (given as `flag`) at its end, in one
    line, or None: a folder (one that exists, or a path written as one), a device or a pipe
    (write_atomically would replace it), a parent that is a file, a folder that cannot be
    created or written to. Checked before a long run; creates the parent folder, leaves no file
    behind."""
    out = Path(path)
    if names_a_folder(path) or out.is_dir():
        return f"{flag} {path} is a folder; name a file"
    special = special_file(out)
    if special:  # write_atomically would refuse it at the end, after the whole run
        return f"{flag} {path} is {special}, not a regular file; name a file"
    if out.parent.exists() and not out.parent.is_dir():
        return f"{flag} {path}: {out.parent} is a file, not a folder"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as exc:
        return f"{flag} {path} cannot be written ({exc.strerror or exc})"
    return None


def _own_link(path: Path) -> bool:
    """Whether `path` is a symbolic link owned by this process's effective user (False where the
    system has no user ids to compare, as on Windows: the link is then replaced)."""
    euid = getattr(os, "geteuid", None)
    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return False
    return euid is not None and stat.S_ISLNK(info.st_mode) and info.st_uid == euid()


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path` and rename it over: never a half-written file.
    A new file is readable by its owner only (mkstemp's 0600: what a client writes may hold its
    own masked text); a file replaced keeps the mode it had, so a global.json its owner opened to
    another account (the one its LLM runs as) stays readable after the next pull. An OSError
    names `path` (not the temporary file), as `cannot write PATH: reason`. A `path` that is a
    device, a pipe or a socket is refused, untouched: the rename would put a regular file in its
    place (`--out /dev/null` run as root replaced /dev/null itself). A `path` that is a symbolic
    link is written through: the file it names is replaced (beside it), and the link stays, as
    any write through a link does (renamed over, the link became a file of its own and the file
    it named, say the copy the client's LLM reads, kept the old content). Only a link of this
    process's own user is followed: one another account put in the way (in /tmp, say) is
    replaced, never followed to a file of its choosing."""
    special = special_file(path)
    if special:
        raise CannotWrite(path, OSError(
            f"it is {special}, not a regular file, and the file written would replace it; "
            "name a file"
        ))
    target = Path(os.path.realpath(path)) if _own_link(path) else path
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise CannotWrite(path, exc) from None
    try:
        try:
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        except FileNotFoundError:
            pass
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise CannotWrite(path, exc) from None
        raise
