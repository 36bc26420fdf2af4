"""`synapse-client submit` and `pull` against a live HTTP server on 127.0.0.1.

The server below is a real HTTP server (http.server in a thread) that speaks the submission and
global-compendium API of the federation server (HELPERS contract 3): bearer tokens, the open
round list, idempotency by key (same key -> the same answer plus `Idempotent-Replayed: true`),
400 with per-path violations (it validates with the same `validate_compendium`), ETag/304. It can
drop a connection after storing a submission and before answering, which is how a response gets
lost in real networks.
"""

from __future__ import annotations

import datetime as dt
import gzip
import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import format_datetime, formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest

from compendium import transport
from compendium.canonical import canonical_form
from compendium.client_api import (
    ClientError,
    MaskedTooWeakly,
    NotForSending,
    NothingToSubmit,
    PrivacyViolation,
    SynapseClient,
    TextNotMasked,
    answer_date,
    etag_file,
    head_file,
    http_date,
    schema_file,
)
from compendium.client_cli import main
from compendium.schema import (
    Compendium,
    MaskingInfo,
    Scenario,
    Schema,
    ToolMetadata,
    ToolSpec,
)
from compendium.validation import validate_compendium
from routing.router import LinearHead

TOKEN = "tok-client-1"
SCHEMA = Schema(
    tools=[
        ToolSpec(tool_id="weather", description="Weather forecasts for a city"),
        ToolSpec(tool_id="flights", description="Search and book flights"),
    ]
)


@dataclass
class ServerState:
    round_number: int | None = 4
    field_cap: int | None = None  # the open round's F* (config.field_cap)
    # the open round's config.mask_strength; None: its configuration names none (written by hand)
    mask_strength: float | None = 1.0
    closes_at: str | None = None  # the open round's deadline (ISO 8601)
    # the server's clock minus this machine's, as its Date header gives it; None: no Date header
    clock_ahead_s: float | None = 0.0
    # a cache between: the answer is served age_s seconds after the server made it, its Date that
    # old, with an Age header saying so (RFC 9111); None: no cache, no Age header
    age_s: int | None = None
    not_released: list[str] = field(default_factory=list)  # the open round's fields_not_released
    drop_next_posts: int = 0  # store, then close the connection without an answer
    fail_next_posts: int = 0  # answer fail_status before doing anything
    fail_status: int = 503
    conflict_code: str = "round_changed"  # the code of a 409 answered by fail_next_posts
    retry_after: str | None = None  # the Retry-After of another fail_status (a 503's)
    posts: list[dict] = field(default_factory=list)  # every POST seen: key, replayed
    post_requests: int = 0  # every POST that reached the server, whatever it answered
    created: int = 0  # rows ever created (a replacement also counts)
    rows: dict[tuple[int, str], dict] = field(default_factory=dict)  # one per (round, client)
    answers: dict[str, tuple[int, dict]] = field(default_factory=dict)  # idempotency key ->
    published: dict | None = None
    global_requests: list[dict] = field(default_factory=list)
    heads: dict[int, bytes] = field(default_factory=dict)  # round -> routing head published
    head_requests: list[str] = field(default_factory=list)  # their ?round=
    # the schema in force GET /api/v1/compendium/schema/ answers (None: SCHEMA), and its status
    # (another than 200: that status with a detail, as a server restarting answers)
    schema: Schema | None = None
    schema_status: int = 200
    schema_requests: int = 0
    speaks_dcz: bool = True  # False: a server from before dcz (415, as for any other coding)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def dictionaries(self) -> dict[str, bytes]:
        """What the real server decodes dcz against: the schema, and the published global."""
        found = [transport.schema_dictionary(SCHEMA)]
        if self.published is not None:
            pulled = Compendium.model_validate(self.published["compendium"])
            found.append(transport.global_dictionary(pulled))
        return {transport.dictionary_hash(d): d for d in found}


def make_handler(state: ServerState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        def send_response(self, code, message=None):  # the Date by the server's own clock
            self.log_request(code)
            self.send_response_only(code, message)
            self.send_header("Server", self.version_string())
            if state.clock_ahead_s is not None:
                made = time.time() + state.clock_ahead_s - (state.age_s or 0)
                self.send_header("Date", formatdate(made, usegmt=True))
            if state.age_s is not None:
                self.send_header("Age", str(state.age_s))

        def _send(self, status: int, body: dict | None, headers: dict | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _client(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            return "client-1" if scheme in ("Bearer", "Token") and token == TOKEN else None

        def do_GET(self):
            url = urlparse(self.path)
            if self._client() is None:
                return self._send(401, {"detail": "Invalid token."})
            if url.path == "/api/v1/rounds/":
                state_filter = parse_qs(url.query).get("state", [""])[0]
                results = []
                if state.round_number is not None and state_filter in ("", "open"):
                    config = {"tau": 0.85, "mask_strength": state.mask_strength,
                              "field_cap": state.field_cap}
                    if state.mask_strength is None:
                        del config["mask_strength"]
                    results = [{"id": 10 + state.round_number, "number": state.round_number,
                                "state": "open", "config": config,
                                "closes_at": state.closes_at,
                                "fields_not_released": state.not_released}]
                return self._send(200, {"count": len(results), "next": None, "previous": None,
                                        "results": results})
            if url.path == "/api/v1/compendium/global/head/":  # as the real API: npz bytes
                number = parse_qs(url.query).get("round", [""])[0]
                state.head_requests.append(number)
                if state.published is None:
                    return self._send(404, {"detail": "no global compendium is published yet"})
                data = state.heads.get(int(number or state.published["round"]))
                if data is None:
                    return self._send(404, {"detail": "this global compendium has no routing head"})
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return None
            if url.path == "/api/v1/submissions/":  # status: this client's, none shown
                return self._send(200, {"count": 0, "next": None, "previous": None, "results": []})
            if url.path == "/api/v1/compendium/schema/":
                state.schema_requests += 1
                if state.schema_status != 200:
                    return self._send(state.schema_status, {"detail": "database restarting"})
                return self._send(200, (state.schema or SCHEMA).model_dump(mode="json"))
            if url.path == "/api/v1/compendium/probe/":  # as the real API
                texts = ["Will it rain in Lisbon?"]
                sha256 = transport.dictionary_hash(transport.probe_bytes(texts))
                return self._send(200, {"count": len(texts), "sha256": sha256, "texts": texts})
            if url.path == "/api/v1/compendium/global/":
                state.global_requests.append(dict(self.headers))
                if state.published is None:
                    return self._send(404, {"detail": "no global compendium is published yet"})
                etag = f'"{state.published["sha256"]}"'
                if self.headers.get("If-None-Match") == etag:
                    return self._send(304, None, {"ETag": etag})
                return self._send(200, state.published, {"ETag": etag})
            return self._send(404, {"detail": "not found"})

        def do_POST(self):
            with state.lock:
                state.post_requests += 1
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":  # as the real API: the same document, gzip-encoded
                raw = gzip.decompress(raw)
            elif encoding == "dcz" and state.speaks_dcz:
                dictionary = state.dictionaries().get(transport.body_dictionary_hash(raw))
                if dictionary is None:
                    state.posts.append({"key": self.headers.get("Idempotency-Key"),
                                        "replayed": False, "encoding": encoding, "refused": True})
                    return self._send(400, {"detail": "the body was compressed against "
                                            "dictionary 0123…, which is neither …",
                                            "code": "unknown_dictionary"})
                raw = transport.decompress(raw, dictionary, 1 << 20)
            elif encoding:
                return self._send(415, {"detail": f"Content-Encoding {encoding!r} is not supported"})
            if urlparse(self.path).path != "/api/v1/submissions/":
                return self._send(404, {"detail": "not found"})
            client = self._client()
            if client is None:
                return self._send(401, {"detail": "Invalid token."})
            key = self.headers.get("Idempotency-Key", "")
            if not 1 <= len(key) <= 200:
                return self._send(400, {"detail": "Idempotency-Key header is required",
                                        "violations": []})
            with state.lock:
                if state.fail_next_posts:
                    state.fail_next_posts -= 1
                    if state.fail_status == 429:
                        return self._send(429, {"detail": "slow down"}, {"Retry-After": "7"})
                    if state.fail_status == 409 and state.conflict_code == "schema_changed":
                        return self._send(409, {  # the real API's answer
                            "detail": "the tool registry or the declared numeric fields changed "
                                      "while this submission was being checked: pull the schema, "
                                      "build again and submit (nothing was stored)",
                            "code": "schema_changed"})
                    if state.fail_status == 409:  # the real API's answer when the round changed
                        return self._send(409, {
                            "detail": "round 4, which this submission was checked against, stopped "
                                      "taking submissions meanwhile and round 5 is open: build "
                                      "against its configuration and submit again (nothing was "
                                      "stored)",
                            "code": "round_changed"})
                    if state.fail_status == 413:  # the real API's words for an inflated body
                        return self._send(413, {"detail": "the decompressed body exceeds the "
                                                          "limit of 2097152 bytes"})
                    headers = {"Retry-After": state.retry_after} if state.retry_after else None
                    return self._send(state.fail_status, {"detail": "database restarting"}, headers)
                if key in state.answers:
                    state.posts.append({"key": key, "replayed": True, "encoding": encoding})
                    status, body = state.answers[key]
                    return self._send(status, body, {"Idempotent-Replayed": "true"})
                state.posts.append({"key": key, "replayed": False, "encoding": encoding,
                                    "round": self.headers.get("X-Synapse-Round")})
                if state.round_number is None:
                    return self._send(409, {"detail": "no round is open"})
                result = validate_compendium(raw, SCHEMA)
                if not result.ok:
                    body = {"detail": "the compendium is not valid under the schema: "  # as the API
                            f"{len(result.violations)} violation(s)",
                            "violations": [v.as_dict() for v in result.violations]}
                    state.answers[key] = (400, body)
                    return self._send(400, body)
                form = canonical_form(result.compendium)
                state.created += 1
                body = {"id": state.created, "round": state.round_number, "client": client,
                        "sha256": form.sha256, "size_bytes": form.size_bytes,
                        "gzip_bytes": form.gzip_bytes,
                        "entry_counts": result.compendium.entry_counts()}
                # one row per (round, client): a new submission replaces the old one
                state.rows[(state.round_number, client)] = body
                state.answers[key] = (201, body)
                if state.drop_next_posts:
                    state.drop_next_posts -= 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # stored, answer lost
                    return None
            return self._send(201, body)

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def compendium(text: str = "Will it rain tomorrow in a city?") -> Compendium:
    """Masked at the fake round's expected λ = 1, as `build` records it."""
    return Compendium(scenarios=[Scenario(tool_id="weather", text=text)], num_users=3,
                      masking=MaskingInfo(strength=1.0, masked_fraction=0.25))


def write(tmp_path, comp: Compendium, name: str = "compendium.json"):
    path = tmp_path / name
    path.write_text(comp.model_dump_json(), encoding="utf-8")
    return path


def submit_args(url: str, path, token: str = TOKEN) -> list[str]:
    return ["submit", "--server", url, "--token", token, str(path), "--backoff", "0",
            "--retries", "3", "--timeout", "10"]


def test_submit_survives_a_dropped_connection_and_a_duplicate_send(server, tmp_path, capsys):
    url, state = server
    state.drop_next_posts = 1
    path = write(tmp_path, compendium())

    assert main(submit_args(url, path)) == 0
    out = capsys.readouterr().out
    assert "submitted to round 4 as submission 1" in out
    # the first POST was stored and its answer lost; the retry carried the same key
    assert [p["replayed"] for p in state.posts] == [False, True]
    assert len({p["key"] for p in state.posts}) == 1

    assert main(submit_args(url, path)) == 0  # the operator runs it again
    captured = capsys.readouterr()
    assert "replayed, not stored twice" in captured.out
    assert state.created == 1
    assert len(state.rows) == 1
    key = state.posts[0]["key"]
    assert key == f"r4-{canonical_form(compendium()).sha256}"
    assert state.posts[0]["encoding"] == "gzip"  # the body goes compressed by default
    assert state.posts[0]["round"] == "4"  # the round it was checked for (X-Synapse-Round)


def test_weaker_masking_than_the_round_expects_is_refused_before_sending(server, tmp_path,
                                                                         capsys):
    url, state = server  # the open round expects λ >= 1
    unmasked = write(tmp_path, compendium().model_copy(update={"masking": None}), "raw.json")
    weak = write(tmp_path, compendium().model_copy(
        update={"masking": MaskingInfo(strength=0.5, masked_fraction=0.1)}), "weak.json")

    assert main(submit_args(url, unmasked)) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: round 4 expects masking strength λ >= 1, but {unmasked} records no "
        "masking: build it again with --lambda 1 (or more), or pass --allow-weaker-masking to "
        "send it as it is; nothing sent"
    )
    assert main(submit_args(url, weak)) == 1
    assert f"but {weak} was masked at λ = 0.5: build it again" in capsys.readouterr().err
    assert state.posts == [] and state.created == 0

    # the override sends it as it is, and says what went
    assert main(submit_args(url, weak) + ["--allow-weaker-masking"]) == 0
    captured = capsys.readouterr()
    assert "submitted to round 4" in captured.out
    assert "round 4 expects masking strength λ >= 1; this compendium was masked at λ=0.5" in (
        captured.err
    )
    assert state.created == 1
    # at the expected λ (or more) nothing is said
    assert main(submit_args(url, write(tmp_path, compendium()))) == 0
    assert "masking" not in capsys.readouterr().err


@pytest.mark.parametrize("status", [400, 409, 503])
def test_allow_weaker_masking_warns_whatever_the_server_answers(server, tmp_path, capsys, status):
    """The warning that weakly masked text is sent goes out before it is sent: a refused, failed
    or lost submission may have reached the server, and the user must know what went."""
    url, state = server
    state.fail_next_posts, state.fail_status = 10, status
    weak = write(tmp_path, compendium().model_copy(
        update={"masking": MaskingInfo(strength=0.5, masked_fraction=0.1)}), "weak.json")
    assert main(submit_args(url, weak) + ["--allow-weaker-masking"]) == 1
    err = capsys.readouterr().err
    assert err.count("round 4 expects masking strength λ >= 1; this compendium was masked at "
                     "λ=0.5") == 1
    assert state.fail_next_posts < 10  # it was sent


def test_no_gzip_sends_the_canonical_bytes_plain_under_the_same_key(server, tmp_path, capsys):
    url, state = server
    path = write(tmp_path, compendium())
    assert main(submit_args(url, path) + ["--no-gzip"]) == 0
    assert main(submit_args(url, path)) == 0  # the same content compressed: a replay
    assert [(p["encoding"], p["replayed"]) for p in state.posts] == [("", False), ("gzip", True)]
    assert state.created == 1


def _publish(state: ServerState, published: Compendium, number: int = 4) -> None:
    state.published = {"round": number, "sha256": canonical_form(published).sha256,
                       "published_at": "2026-01-01", "compendium": published.model_dump(mode="json")}


def test_submit_since_the_pulled_global_sends_dcz_against_it(server, tmp_path, capsys):
    url, state = server
    published = Compendium(scenarios=[
        Scenario(tool_id="weather", text=f"Will it rain in a city on day {n}?") for n in range(40)
    ])
    _publish(state, published)
    pulled = tmp_path / "global.json"
    assert main(["pull", "--server", url, "--token", TOKEN, "--out", str(pulled)]) == 0
    mine = compendium("Will it rain in a city on day [NUMBER]?")  # masked: the server checks
    path = write(tmp_path, mine)
    capsys.readouterr()
    assert main(submit_args(url, path) + ["--since", str(pulled)]) == 0
    out = capsys.readouterr().out
    sent = transport.compress(canonical_form(mine).data, transport.global_dictionary(published))
    assert f"({len(sent)} sent, dcz)" in out
    assert len(sent) < len(gzip.compress(canonical_form(mine).data, 9))
    assert [(p["encoding"], p["replayed"]) for p in state.posts] == [("dcz", False)]
    assert state.rows[(4, "client-1")]["sha256"] == canonical_form(mine).sha256


def test_submit_with_the_schema_sends_dcz_before_any_global(server, tmp_path, capsys):
    url, state = server
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(SCHEMA.model_dump_json(indent=2), encoding="utf-8")
    path = write(tmp_path, compendium())
    assert main(submit_args(url, path) + ["--schema", str(schema_path)]) == 0
    assert "sent, dcz)" in capsys.readouterr().out
    assert [p["encoding"] for p in state.posts] == ["dcz"]


@pytest.mark.parametrize("speaks_dcz", [True, False])
def test_a_dictionary_the_server_cannot_use_falls_back_to_gzip(server, tmp_path, capsys, speaks_dcz):
    url, state = server
    state.speaks_dcz = speaks_dcz
    stale = tmp_path / "stale.json"  # pulled from another federation, or never published
    stale.write_text(compendium("Book a flight to a city").model_dump_json(), encoding="utf-8")
    path = write(tmp_path, compendium())
    assert main(submit_args(url, path) + ["--since", str(stale)]) == 0
    captured = capsys.readouterr()
    assert "cannot read this dictionary" in captured.err and "sent gzip instead" in captured.err
    assert "sent, gzip)" in captured.out
    assert [p["encoding"] for p in state.posts][-1] == "gzip"
    assert state.created == 1


def test_no_gzip_with_a_dictionary_is_refused_before_sending(server, tmp_path, capsys):
    url, state = server
    path = write(tmp_path, compendium())
    assert main(submit_args(url, path) + ["--no-gzip", "--since", str(path)]) == 1
    assert "--no-gzip sends the body plain" in capsys.readouterr().err
    assert state.posts == []


@pytest.mark.parametrize(
    "empty",
    [Compendium(), Compendium(num_users=3, masking=MaskingInfo(strength=1.0, masked_fraction=0.2))],
)
def test_a_compendium_without_entries_is_not_sent(server, tmp_path, capsys, empty):
    """What `build --since` makes when the pulled global covers everything: the server would
    refuse it (it would replace the earlier submission with nothing), so nothing is sent."""
    url, state = server
    path = write(tmp_path, empty)
    assert main(submit_args(url, path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"synapse-client: {path} has no entries (metadata, scenarios, precautions, templates and "
        "annex are all empty): nothing to submit, nothing sent"
    ]
    with SynapseClient(url, TOKEN, backoff=0) as client:
        with pytest.raises(NothingToSubmit, match="has no entries"):
            client.submit(empty)
    assert state.posts == [] and state.created == 0


def test_changed_content_or_round_gives_a_new_key(server, tmp_path):
    url, state = server
    with SynapseClient(url, TOKEN, backoff=0) as client:
        first = client.submit(compendium())
        second = client.submit(compendium("Is it windy on the coast today?"))
        state.round_number = 5
        third = client.submit(compendium())
    assert len({first.idempotency_key, second.idempotency_key, third.idempotency_key}) == 3
    assert state.created == 3
    assert len(state.rows) == 2  # one row per (round, client)


def test_5xx_is_retried_with_backoff(server, tmp_path):
    url, state = server
    state.fail_next_posts = 2
    delays: list[float] = []
    with SynapseClient(url, TOKEN, retries=4, backoff=0.25, sleep=delays.append) as client:
        result = client.submit(compendium())
    assert result.status == 201 and result.attempts == 3
    assert delays == [0.25, 0.5]
    assert state.created == 1


def test_429_waits_as_long_as_the_server_asks(server, tmp_path):
    url, state = server
    state.fail_next_posts, state.fail_status = 1, 429
    delays: list[float] = []
    with SynapseClient(url, TOKEN, retries=2, backoff=0.25, sleep=delays.append) as client:
        result = client.submit(compendium())
    assert result.status == 201 and delays == [7.0]


@pytest.mark.parametrize(("retry_after", "waited"), [("7", 7.0), ("3600", 60.0)])
def test_503_waits_as_long_as_the_server_asks_capped_as_for_429(server, tmp_path, retry_after,
                                                                waited):
    """RFC 9110 lets a 503 carry Retry-After (a server in maintenance says when to come back);
    it was honoured on 429 only, and a 503's wait was the backoff's."""
    url, state = server
    state.fail_next_posts, state.retry_after = 1, retry_after
    delays: list[float] = []
    with SynapseClient(url, TOKEN, retries=2, backoff=0.25, sleep=delays.append) as client:
        result = client.submit(compendium())
    assert result.status == 201 and delays == [waited]


@pytest.mark.parametrize(("ahead", "low", "high"), [(30, 28.0, 30.0), (3600, 60.0, 60.0),
                                                    (-120, 0.0, 0.0)])
def test_retry_after_as_an_http_date_is_honoured_capped_as_the_seconds(server, ahead, low, high):
    """RFC 9110 lets Retry-After be an HTTP-date ("Wed, 21 Oct 2015 07:28:00 GMT") as well as
    seconds: the client ignored the date and waited its own backoff (0.25 s here). It waits
    until that time now, capped at a minute as the seconds form; a date past is no wait."""
    url, state = server
    when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ahead)
    state.fail_next_posts, state.retry_after = 1, format_datetime(when, usegmt=True)
    delays: list[float] = []
    with SynapseClient(url, TOKEN, retries=2, backoff=0.25, sleep=delays.append) as client:
        result = client.submit(compendium())
    assert result.status == 201 and len(delays) == 1
    assert low <= delays[0] <= high


def test_retry_after_as_an_http_date_is_counted_from_the_servers_clock(server):
    """RFC 9110 counts a Retry-After date from the answer's Date, the server's clock: a server
    an hour ahead asking for 20 s must not be waited a capped minute (nor, an hour behind, not
    at all)."""
    url, state = server
    for ahead in (3600, -3600):
        state.clock_ahead_s = ahead
        when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ahead + 20)
        state.fail_next_posts, state.retry_after = 1, format_datetime(when, usegmt=True)
        delays: list[float] = []
        with SynapseClient(url, TOKEN, retries=2, backoff=0.25, sleep=delays.append) as client:
            assert client.submit(compendium()).status in (200, 201)
        assert len(delays) == 1 and 17.0 <= delays[0] <= 21.0, (ahead, delays)


def test_gives_up_after_the_retries_with_one_line(server, tmp_path, capsys):
    url, state = server
    state.fail_next_posts = 10
    assert main(submit_args(url, write(tmp_path, compendium()))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "failed after 4 attempt(s): HTTP 503: database restarting" in err[0]
    assert state.created == 0


def test_413_says_the_limit_and_the_real_size_not_only_the_bytes_sent(server, tmp_path, capsys):
    # It said "the compendium (N bytes) is larger than the server accepts" with N the gzip bytes
    # sent, a fraction of the size the server measured, and dropped the server's limit.
    url, state = server
    state.fail_next_posts, state.fail_status = 1, 413
    comp = compendium()
    assert main(submit_args(url, write(tmp_path, comp))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    size = canonical_form(comp).size_bytes
    assert len(err) == 1 and err[0].startswith(
        "synapse-client: the server refused the compendium as too large (HTTP 413): the "
        f"decompressed body exceeds the limit of 2097152 bytes; it is {size} bytes ("
    )
    assert "sent gzip): build it again with --max-bytes under the limit" in err[0]


def test_400_prints_every_violation_by_path(server, tmp_path, capsys):
    url, _ = server
    bad = Compendium(scenarios=[Scenario(tool_id="teleporter", text="beam me up"),
                                Scenario(tool_id="weather", text=" ")],
                     masking=MaskingInfo(strength=1.0, masked_fraction=0.0))
    assert main(submit_args(url, write(tmp_path, bad))) == 1
    err = capsys.readouterr().err
    assert "$.scenarios[0].tool_id" in err  # ordering is canonical: teleporter < weather
    assert "$.scenarios[1].text: text is empty" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("synapse-client: the server rejected")
    assert last.count("violation(s)") <= 1  # the count was said twice


def test_no_open_round_is_one_clear_line(server, tmp_path, capsys):
    url, state = server
    state.round_number = None
    assert main(submit_args(url, write(tmp_path, compendium()))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["synapse-client: no round is open on the server: nothing to submit to"]


def test_a_round_that_changed_under_the_submission_is_one_clear_line(server, tmp_path, capsys):
    url, state = server
    state.fail_next_posts, state.fail_status = 1, 409
    assert main(submit_args(url, write(tmp_path, compendium()))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "synapse-client: the open round changed after this client checked the submission for "
        "round 4: round 4, "
    ) and err[0].endswith("submit again (nothing was stored)")


def test_a_schema_that_changed_under_the_submission_is_one_clear_line(server, tmp_path, capsys):
    url, state = server
    state.fail_next_posts, state.fail_status, state.conflict_code = 1, 409, "schema_changed"
    assert main(submit_args(url, write(tmp_path, compendium()))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "synapse-client: the server's schema changed while it checked the submission: the tool "
        "registry or the declared numeric fields changed while this submission was being checked: "
        "pull the schema, build again and submit (nothing was stored)"
    ]


def test_wrong_token_is_one_clear_line(server, tmp_path, capsys):
    url, _ = server
    assert main(submit_args(url, write(tmp_path, compendium()), token="nope")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused the token (HTTP 401): Invalid token." in err[0]


def test_unreachable_server_is_one_clear_line(tmp_path, capsys):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(submit_args(f"http://127.0.0.1:{port}", write(tmp_path, compendium()))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed after 4 attempt(s): ConnectError" in err[0]


def test_not_a_compendium_is_reported_before_anything_is_sent(server, tmp_path, capsys):
    url, state = server
    path = tmp_path / "broken.json"
    path.write_text('{"scenarios": [{"tool_id": "weather"}]}', encoding="utf-8")
    assert main(submit_args(url, path)) == 1
    err = capsys.readouterr().err
    assert "$.scenarios[0].text" in err and "is not a compendium" in err
    assert state.posts == []


def test_pull_saves_the_global_compendium_and_honours_the_etag(server, tmp_path, capsys):
    url, state = server
    out = tmp_path / "global.json"
    args = ["pull", "--server", url, "--token", TOKEN, "--out", str(out), "--backoff", "0"]
    assert main(args) == 1
    assert "no global compendium is published" in capsys.readouterr().err

    published = compendium("Check tomorrow's forecast for a city")
    form = canonical_form(published)
    state.published = {"round": 4, "sha256": form.sha256, "published_at": "2026-01-01T00:00:00Z",
                       "compendium": published.model_dump(mode="json")}
    assert main(args) == 0
    assert f"round 4 saved (sha256 {form.sha256})" in capsys.readouterr().out
    assert Compendium.model_validate_json(out.read_text()) == published
    assert etag_file(out).read_text().strip() == f'"{form.sha256}"'

    before = out.stat().st_mtime_ns
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert state.global_requests[-1].get("If-None-Match") == f'"{form.sha256}"'
    assert out.stat().st_mtime_ns == before

    newer = compendium("Find a flight for next week")
    newer_form = canonical_form(newer)
    state.published = {"round": 5, "sha256": newer_form.sha256, "published_at": "2026-01-02",
                       "compendium": newer.model_dump(mode="json")}
    assert main(args) == 0
    assert Compendium.model_validate_json(out.read_text()) == newer
    assert etag_file(out).read_text().strip() == f'"{newer_form.sha256}"'


def test_pull_through_a_link_updates_the_file_it_names(server, tmp_path, capsys):
    """An --out that is a symbolic link (global.json -> the copy the client's LLM reads, in a
    folder of its own): the pull updates the file the link names, as any write through a link
    does, and the link stays. Renaming the temporary file over the link replaced the link with a
    regular file and left the LLM's copy at the old global, while saying it was saved."""
    url, state = server
    shared = tmp_path / "llm" / "global.json"
    shared.parent.mkdir()
    old = compendium("Find a flight for next week")
    shared.write_text(old.model_dump_json(), encoding="utf-8")
    shared.chmod(0o644)  # opened to the LLM's account
    link = tmp_path / "global.json"
    link.symlink_to(shared)
    published = compendium()
    _publish(state, published)
    assert main(["pull", "--server", url, "--token", TOKEN, "--out", str(link)]) == 0
    assert "round 4 saved" in capsys.readouterr().out
    assert link.is_symlink() and link.resolve() == shared.resolve()
    assert Compendium.model_validate_json(shared.read_text()) == published
    assert shared.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in shared.parent.iterdir()) == ["global.json"]  # no temporary left

    # A link of another account (put in the way, in /tmp say) is not followed: it is replaced.
    if os.geteuid() == 0:  # only root can give a link to another user
        planted = tmp_path / "planted.json"
        planted.symlink_to(shared)
        os.lchown(planted, 4321, 4321)
        before = shared.read_bytes()
        assert main(["pull", "--server", url, "--token", TOKEN, "--out", str(planted)]) == 0
        assert not planted.is_symlink() and shared.read_bytes() == before


def test_pull_saves_the_routing_head_beside_the_global(server, tmp_path, capsys):
    url, state = server
    out = tmp_path / "global.json"
    args = ["pull", "--server", url, "--token", TOKEN, "--out", str(out), "--backoff", "0"]
    published = compendium()
    state.published = {"round": 4, "sha256": canonical_form(published).sha256,
                       "published_at": "2026-01-01", "compendium": published.model_dump(mode="json")}
    head = LinearHead(["flights", "weather"], np.ones((2, 8), dtype=np.float32),
                      np.zeros(2, dtype=np.float32))
    state.heads[4] = head.to_bytes()
    assert main(args) == 0
    assert f"{head_file(out)}: its routing head" in capsys.readouterr().out
    assert head_file(out).read_bytes() == head.to_bytes()
    assert state.head_requests == ["4"]  # the round of the compendium just pulled
    # Up to date, head present: one conditional request, no head download.
    assert main(args) == 0
    assert state.head_requests == ["4"]
    # A file that is not a head is refused with a warning, and nothing is written.
    head_file(out).unlink()
    state.heads[4] = b"not an archive"
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "routing head is unusable (not an .npz archive); not saved" in err
    assert "pickle" not in err  # numpy's advice to load a file of the server's unsafely
    assert not head_file(out).exists()
    # Found by review: pull checked a head less than the router reads one: an archive with NaN
    # weights, or not a head's arrays (text for weights), was saved, and every route then set it
    # aside with a warning. It is refused as the router refuses it, and nothing is written.
    buffer = io.BytesIO()
    np.savez_compressed(buffer, tools=np.array(head.tools), bias=head.bias,
                        weights=np.full_like(head.weights, np.nan))
    state.heads[4] = buffer.getvalue()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "routing head is unusable (" in err and "not saved" in err, err
    assert not head_file(out).exists()
    # A newer global without a head: the old head goes, it belongs to another compendium.
    state.heads[4] = head.to_bytes()
    assert main(args) == 0 and head_file(out).exists()
    newer = compendium("Find a flight for next week")
    state.published = {"round": 5, "sha256": canonical_form(newer).sha256,
                       "published_at": "2026-01-02", "compendium": newer.model_dump(mode="json")}
    assert main(args) == 0
    assert not head_file(out).exists()


def test_pull_saves_the_schema_in_force_beside_the_global_on_every_pull(server, tmp_path, capsys):
    """`route` leaves out the pulled global's tools that the schema in force does not list
    (deactivated in the registry since): `pull` saves that schema beside the global
    (OUT.schema.json), again on a pull that finds the global unchanged (304), since the registry
    changes without a new global. A schema that cannot be had only warns: the global pulled is
    kept, and so is the schema an earlier pull saved."""
    url, state = server
    out = tmp_path / "global.json"
    args = ["pull", "--server", url, "--token", TOKEN, "--out", str(out), "--backoff", "0",
            "--retries", "0"]
    _publish(state, compendium())
    assert main(args) == 0
    said = capsys.readouterr().out
    assert f"{schema_file(out)}: the schema in force" in said
    assert Schema.model_validate_json(schema_file(out).read_bytes()) == SCHEMA
    assert schema_file(out) == tmp_path / "global.json.schema.json"

    # The operator deactivates flights: the global is the same (304), the schema is not.
    state.schema = Schema(tools=SCHEMA.tools[:1])
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "up to date" in said and f"{schema_file(out)}: the schema in force" in said
    assert Schema.model_validate_json(schema_file(out).read_bytes()).tool_ids == {"weather"}
    with SynapseClient(url, TOKEN, backoff=0) as client:
        assert client.pull(out).schema == schema_file(out)

    # The schema cannot be had: the pull succeeds with a warning, the earlier schema stays.
    kept = schema_file(out).read_bytes()
    state.schema_status = 503
    newer = compendium("Find a flight for next week")
    _publish(state, newer, number=5)
    assert main(args) == 0
    captured = capsys.readouterr()
    failed = (f"GET {url}/api/v1/compendium/schema/ failed after 1 attempt(s): HTTP 503: "
              "database restarting")
    assert "round 5 saved" in captured.out and "the schema in force" not in captured.out
    assert Compendium.model_validate_json(out.read_text()) == newer
    assert schema_file(out).read_bytes() == kept
    assert captured.err.strip().splitlines() == [
        f"synapse-client: warning: the schema in force was not saved ({failed}): "
        f"{schema_file(out)} is the one an earlier pull saved, and route leaves out the global's "
        "tools it does not list"
    ]
    # ... and with none saved before, route names any tool of the global until a pull saves one.
    schema_file(out).unlink()
    assert main(args) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"synapse-client: warning: the schema in force was not saved ({failed}): route leaves "
        "out none of the global's tools until a pull saves it"
    ]
    assert not schema_file(out).exists() and out.exists()
    state.schema_status = 200
    assert main(args) == 0
    assert Schema.model_validate_json(schema_file(out).read_bytes()).tool_ids == {"weather"}


def test_pull_without_the_local_file_does_not_send_if_none_match(server, tmp_path):
    url, state = server
    published = compendium()
    state.published = {"round": 4, "sha256": canonical_form(published).sha256,
                       "published_at": "2026-01-01", "compendium": published.model_dump(mode="json")}
    out = tmp_path / "global.json"
    etag_file(out).write_text('"stale"')
    with SynapseClient(url, TOKEN, backoff=0) as client:
        result = client.pull(out)
    assert result.updated and "If-None-Match" not in state.global_requests[-1]


@pytest.mark.parametrize("damage", ["garbage\n", '{"scenarios": []}', None])
def test_pull_downloads_again_over_a_local_copy_that_is_not_the_etags(server, tmp_path, capsys,
                                                                       damage):
    # Edited, truncated or replaced since it was pulled: a 304 would have kept it ("up to date")
    # until the next global was published, and `route`/`build --since` would read it.
    url, state = server
    published = compendium()
    state.published = {"round": 4, "sha256": canonical_form(published).sha256,
                       "published_at": "2026-01-01", "compendium": published.model_dump(mode="json")}
    out = tmp_path / "global.json"
    args = ["pull", "--server", url, "--token", TOKEN, "--out", str(out), "--backoff", "0"]
    assert main(args) == 0
    good = out.read_bytes()
    out.write_text(damage if damage is not None else good.decode()[: len(good) // 2])
    capsys.readouterr()
    assert main(args) == 0
    assert "If-None-Match" not in state.global_requests[-1]
    assert "round 4 saved" in capsys.readouterr().out
    assert Compendium.model_validate_json(out.read_text()) == published


@pytest.mark.parametrize("command", ["pull", "fetch-probe"])
def test_an_out_path_that_cannot_be_written_is_one_line(server, tmp_path, capsys, command):
    url, state = server
    published = compendium()
    state.published = {"round": 4, "sha256": canonical_form(published).sha256,
                       "published_at": "2026-01-01", "compendium": published.model_dump(mode="json")}
    folder = tmp_path / "a-folder"
    folder.mkdir()
    args = [command, "--server", url, "--token", TOKEN, "--out", str(folder), "--backoff", "0"]
    assert main(args) == 1  # was a traceback (IsADirectoryError from os.replace)
    err = capsys.readouterr().err.strip().splitlines()
    # refused before the download now (test_an_out_that_cannot_be_the_file_written_is_refused_...)
    assert err == [f"synapse-client: --out {folder} names a folder, not a file: --out is the file "
                   "to write; name a file (nothing written)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"]  # no temporary file left


def test_bad_server_url_is_refused():
    with pytest.raises(ClientError, match="http"):
        SynapseClient("ftp://example", TOKEN)


def test_probe_goes_with_the_schema_and_must_be_a_probe_set(tmp_path, capsys):
    path = write(tmp_path, compendium())
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(SCHEMA.model_dump_json(), encoding="utf-8")
    probe_path = tmp_path / "probe.json"
    probe_path.write_text(json.dumps({"count": 1, "sha256": "0" * 64, "texts": ["Weather?"]}))
    url = "http://127.0.0.1:9"  # never reached: both are refused before any request
    assert main(submit_args(url, path) + ["--probe", str(probe_path)]) == 1
    assert "--probe goes with --schema" in capsys.readouterr().err
    assert main(submit_args(url, path) + ["--schema", str(schema_path), "--probe",
                                          str(probe_path)]) == 1
    assert f"{probe_path} is not a probe set: its 'sha256' does not match" in capsys.readouterr().err


def _build(tmp_path, name: str, *options: str):
    """`build` (no embedding model) of a log in which every user calls both tools, so a field
    cap of 1 leaves out part of each user's contribution."""
    log, schema_path = tmp_path / "usage.jsonl", tmp_path / "schema.json"
    if not log.exists():
        rows = [
            {"query": f"{what} number {n}", "tool": tool, "outcome": "success",
             "latency_ms": 100 + n, "user": f"u{n % 3}"}
            for n in range(12)
            for what, tool in (("Will it rain in town", "weather"), ("Find a flight to", "flights"))
        ]
        log.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
        schema_path.write_text(SCHEMA.model_dump_json(), encoding="utf-8")
    out = tmp_path / name
    assert main(["build", "--log", str(log), "--schema", str(schema_path), "--out", str(out),
                 "--no-collapse", "--quiet", *options]) == 0
    return out


def test_submit_refuses_a_build_over_the_rounds_field_cap_before_sending(server, tmp_path, capsys):
    # The edge's noise is calibrated for the round's F*: statistics built with no cap, or a
    # larger one, would be under-charged. The compendium records the cap it was built with, and
    # submit reads that (as the server does), not the report beside it.
    url, state = server
    state.field_cap = 1
    for name, options, built in [
        ("none.json", (), "records no field cap (built without --field-cap, or by an older "
                          "synapse-client or other tooling)"),
        ("two.json", ("--field-cap", "2"), "was built with --field-cap 2"),
    ]:
        path = _build(tmp_path, name, *options)
        capsys.readouterr()
        assert main(submit_args(url, path)) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"synapse-client: {path} {built}, but round 4 caps each user at F* = 1 tool(s) (the "
            "edge's noise assumes no more, and the server refuses it): build it again with "
            "--field-cap 1 (or less); nothing sent"
        ]
    assert state.posts == []
    # built with the round's cap: sent; a smaller cap than the round's is stricter: sent too
    assert main(submit_args(url, _build(tmp_path, "one.json", "--field-cap", "1"))) == 0
    state.field_cap = 3
    assert main(submit_args(url, _build(tmp_path, "one.json", "--field-cap", "1"))) == 0
    assert main(submit_args(url, _build(tmp_path, "three.json", "--field-cap", "3"))) == 0
    captured = capsys.readouterr()
    assert "field cap" not in captured.err and captured.out.count("submitted to round 4") == 3
    # a round without a cap takes any build
    state.field_cap = None
    assert main(submit_args(url, tmp_path / "none.json")) == 0
    assert "field cap" not in capsys.readouterr().err


@pytest.mark.parametrize("cap", [2**31, 0, 2.0, "2", True])
def test_a_rounds_field_cap_no_compendium_can_record_is_named_as_the_rounds(
    server, tmp_path, capsys, cap
):
    """The round's F* comes from the server (GET /api/v1/rounds/): one past the compendium's
    integer column was refused by participate as "--field-cap must be from 1 to ...", a flag the
    user never passed; submit advised building again with that --field-cap; one of another type
    read as no cap. Each names the round's field_cap now, and nothing is built or sent."""
    url, state = server
    built = _build(tmp_path, "uncapped.json")
    state.field_cap = cap
    log = tmp_path / "usage.jsonl"
    said = (f"synapse-client: round 4 sets field_cap {cap!r}, which no compendium can record "
            "(F* is a whole number from 1 to 2147483647): ask the server's operator to correct "
            "the round")
    capsys.readouterr()
    assert main(["participate", "--log", str(log), "--dir", str(tmp_path / "state"),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN,
                 "--backoff", "0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"{said}; nothing built or sent"]
    assert not (tmp_path / "state" / "compendium.json").exists()
    assert main(submit_args(url, built)) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"{said}; nothing sent"]
    assert main(["status", "--server", url, "--token", TOKEN, "--backoff", "0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [said]
    assert state.posts == []
    # The user's own --field-cap past the column is named as the flag, before any request.
    state.field_cap = None
    assert main(["participate", "--log", str(log), "--dir", str(tmp_path / "state"),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN,
                 "--backoff", "0", "--field-cap", str(2**31)]) == 1
    assert capsys.readouterr().err.strip() == "synapse-client: --field-cap must be from 1 to 2147483647"


def test_submit_refuses_statistics_the_open_round_will_not_release_before_sending(
    server, tmp_path, capsys
):
    """A plain `build` computes every declared field; the round says which it will not release
    (`fields_not_released`): submit names them and the build option that leaves them out, and
    sends nothing (the server refuses them too)."""
    url, state = server
    state.not_released = ["latency_ms", "success_rate"]
    path = _build(tmp_path, "all.json")
    capsys.readouterr()
    assert main(submit_args(url, path)) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"synapse-client: round 4 will not release the numeric field(s) latency_ms, success_rate, "
        f"but {path} carries statistics for them: build it again with --not-released "
        "latency_ms,success_rate (participate does); nothing sent"
    ]
    assert state.posts == []
    lean = _build(tmp_path, "lean.json", "--not-released", "latency_ms,success_rate")
    assert main(submit_args(url, lean)) == 0
    assert len(state.posts) == 1


def test_free_text_in_metadata_is_refused_before_sending_and_by_validate(server, tmp_path, capsys):
    """A metadata entry's description or spec is free text that no masking check reads, and the
    server refuses it: submit must not send it (raw text would leave the client only to be
    refused), and validate, which checks as the server will, must not call it valid."""
    url, state = server
    raw = "Call John Smith at john.smith@acme.com"
    path = write(tmp_path, compendium().model_copy(update={"metadata": [
        ToolMetadata(tool_id="weather", description=raw, stats={"calls": 1.0}),
        ToolMetadata(tool_id="flights", spec={"owner": raw}, stats={"calls": 2.0}),
    ]}))
    schema = tmp_path / "schema.json"
    schema.write_text(SCHEMA.model_dump_json(), encoding="utf-8")

    assert main(["validate", str(path), "--schema", str(schema)]) == 1
    captured = capsys.readouterr()
    assert "valid (" not in captured.out
    assert f"{path}: $.metadata[0].description: a client sends only its statistics" in captured.err
    assert f"{path}: $.metadata[1].spec: a client sends only its statistics" in captured.err
    assert main(["inspect", str(path), "--schema", str(schema)]) == 1  # the dry run says so too
    assert "$.metadata[0].description: a client sends only" in capsys.readouterr().out

    assert main(submit_args(url, path)) == 1
    err = capsys.readouterr().err
    assert f"{path}: $.metadata[0].description: a client sends only its statistics" in err
    assert f"{path}: $.metadata[1].spec: a client sends only its statistics" in err
    assert err.strip().endswith("nothing sent")
    assert raw not in err
    assert state.posts == [] and state.created == 0


def test_a_flag_name_holding_personal_data_is_refused_before_sending_and_by_validate(
    server, tmp_path, capsys
):
    """A precondition flag name is sent as written: one that is a phone or an account number
    (a hand-edited compendium, other tooling) would leave the client whole, only for the server
    to refuse it. validate reports it as the server will, inspect says so, submit sends nothing;
    none of them echoes the name. Ordinary condition names pass."""
    url, state = server
    flags = {"has_city": True, "555_123_4567": True, "acct_12345678": False}
    path = write(tmp_path, compendium().model_copy(update={"scenarios": [
        Scenario(tool_id="weather", text="Will it rain tomorrow in a city?", preconditions=flags),
    ]}))
    schema = tmp_path / "schema.json"
    schema.write_text(SCHEMA.model_dump_json(), encoding="utf-8")

    assert main(["validate", str(path), "--schema", str(schema)]) == 1
    captured = capsys.readouterr()
    assert "valid (" not in captured.out
    where = f"{path}: $.scenarios[0].preconditions: flag name"
    assert f"{where} 2 of 3 holds 1 phone number" in captured.err
    assert f"{where} 3 of 3 holds 1 long number" in captured.err
    assert "555" not in captured.err and "12345678" not in captured.err
    assert main(["inspect", str(path), "--schema", str(schema)]) == 1
    assert "$.scenarios[0].preconditions: flag name 2 of 3 holds" in capsys.readouterr().out

    assert main(submit_args(url, path)) == 1
    err = capsys.readouterr().err
    assert f"{path}: $.scenarios[0].preconditions: flag name 2 of 3 holds 1 phone number" in err
    assert "precondition flag names" in err.strip().splitlines()[-1]
    assert err.strip().endswith("nothing sent")
    assert "555" not in err and "12345678" not in err
    assert state.posts == [] and state.created == 0

    ordinary = write(tmp_path, compendium().model_copy(update={"scenarios": [
        Scenario(tool_id="weather", text="Will it rain tomorrow in a city?",
                 preconditions={"has_city": True, "lang:en": True, "v2": False,
                                "retry_count_gt_3": True, "after_2024_01_01": False}),
    ]}), "ordinary.json")
    assert main(["validate", str(ordinary), "--schema", str(schema)]) == 0
    assert main(submit_args(url, ordinary)) == 0
    assert len(state.posts) == 1


@pytest.mark.parametrize("allow", [False, True])
def test_text_the_server_would_find_unmasked_is_refused_before_sending(server, tmp_path, capsys,
                                                                       allow):
    """A compendium that records λ = 1 but holds text masking at the round's λ removes from any
    text (edited by hand, or from other tooling): the server refuses it as unmasked_text, but by
    then the raw text has left the client. submit runs the server's check (at the open round's
    λ, with the registry in force) first and sends nothing; --allow-weaker-masking does not
    change that, as the server refuses such text whatever the override."""
    url, state = server
    raw = "Email John Smith at john.smith@acme.com about the forecast"
    path = write(tmp_path, compendium(raw))
    options = ["--allow-weaker-masking"] if allow else []
    assert main(submit_args(url, path) + options) == 1
    err = capsys.readouterr().err
    assert f"{path}: $.scenarios[0].text: not masked at λ = 1: holds 1 e-mail address" in err
    assert err.strip().splitlines()[-1].endswith("nothing sent")
    assert "john.smith" not in err
    assert state.posts == [] and state.created == 0
    # masked text goes, as before
    assert main(submit_args(url, write(tmp_path, compendium(), "masked.json")) + options) == 0
    assert len(state.posts) == 1


RAW_METADATA = "Call John Smith on +1 555 123 4567"
RAW_SCENARIO = "Email John Smith at john.smith@acme.com about the forecast"


@pytest.mark.parametrize(("case", "refusal", "where", "holds"), [
    ("metadata description", NotForSending, "$.metadata[0].description",
     "a client sends only its statistics"),
    ("flag name", NotForSending, "$.scenarios[0].preconditions",
     "flag name 2 of 2 holds 1 phone number"),
    ("scenario text", TextNotMasked, "$.scenarios[0].text",
     "not masked at λ = 1: holds 1 e-mail address"),
    ("no masking recorded", MaskedTooWeakly, "$.masking",
     "round 4 expects masking strength λ >= 1"),
])
@pytest.mark.parametrize("allow_weaker", [False, True])
def test_the_python_api_checks_what_must_not_leave_the_client_before_sending(
    server, case, refusal, where, holds, allow_weaker
):
    """`SynapseClient.submit`, as an organization's script calls it, runs the checks of the
    privacy boundary that `synapse-client submit` runs: free text in metadata, personal data in
    a flag name, text that masking at the open round's λ (here 1) removes from any text, and
    masking weaker than the round expects. It ran none of them: the raw text went out in the
    POST, and only the server refused it. Nothing reaches the server now; the error lists each
    violation by path, never the text itself. Opting into weaker masking (as
    --allow-weaker-masking) lifts the λ check alone."""
    url, state = server
    comp = compendium()
    if case == "metadata description":
        comp = comp.model_copy(update={"metadata": [
            ToolMetadata(tool_id="weather", description=RAW_METADATA, stats={"calls": 1.0})]})
    elif case == "flag name":
        comp = comp.model_copy(update={"scenarios": [Scenario(
            tool_id="weather", text="Will it rain tomorrow in a city?",
            preconditions={"has_city": True, "555_123_4567": True})]})
    elif case == "scenario text":
        comp = compendium(RAW_SCENARIO)
    else:
        comp = comp.model_copy(update={"masking": None})
    with SynapseClient(url, TOKEN, backoff=0) as client:
        if allow_weaker and refusal is MaskedTooWeakly:  # the caller's explicit choice: sent
            assert client.submit(comp, allow_weaker_masking=True).status == 201
            assert state.post_requests == 1
            return
        with pytest.raises(refusal) as refused:
            client.submit(comp, allow_weaker_masking=allow_weaker)
    assert state.post_requests == 0 and state.created == 0
    assert isinstance(refused.value, PrivacyViolation) and isinstance(refused.value, ClientError)
    assert [v.path for v in refused.value.violations] == [where]
    assert holds in refused.value.violations[0].reason
    message = str(refused.value)
    assert f"{where}: {holds}" in message and "nothing sent" in message
    for raw in ("John", "555", "acme"):
        assert raw not in message


def test_a_round_whose_config_names_no_lambda_expects_the_servers_default(server):
    """A round configured without mask_strength is checked by the server at λ = 1 (RoundConfig's
    default); SynapseClient.submit read no λ and checked nothing, so text the server refuses
    went out, and so did a compendium that records no masking at all. It applies the same
    default now: those are refused before sending, masked text goes."""
    url, state = server
    state.mask_strength = None
    with SynapseClient(url, TOKEN, backoff=0) as client:
        with pytest.raises(TextNotMasked) as refused:
            client.submit(compendium(RAW_SCENARIO))
        assert refused.value.strength == 1.0
        assert "not masked at λ = 1: holds 1 e-mail address" in refused.value.violations[0].reason
        with pytest.raises(MaskedTooWeakly, match="round 4 expects masking strength λ >= 1"):
            client.submit(compendium().model_copy(update={"masking": None}))
        assert state.post_requests == 0
        assert client.submit(compendium()).status == 201
    assert state.created == 1


def _one_line_log(tmp_path) -> Path:
    log = tmp_path / "usage.jsonl"
    log.write_text(json.dumps({"query": "Will it rain tomorrow in a city?", "tool": "weather",
                               "outcome": "success", "latency_ms": 3, "user": "u1"}) + "\n",
                   encoding="utf-8")
    return log


@pytest.mark.parametrize(("ahead_s", "closes_in_s", "stops"), [
    (3600, 600, True),  # this machine's clock is an hour behind: the round is past its deadline
    (-3600, -600, False),  # an hour ahead: the round takes submissions for 50 minutes yet
])
def test_participate_judges_the_deadline_by_the_servers_clock(
    server, tmp_path, capsys, ahead_s, closes_in_s, stops
):
    """participate stops before building once the open round's deadline has passed; it judged
    that by this machine's clock, so a client whose clock was behind built and sent for a round
    the server had stopped taking, and one whose clock was ahead gave up on an open round. The
    server's clock decides, as its answer's Date header gives it; status says the same."""
    url, state = server
    state.clock_ahead_s = ahead_s
    closes_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=closes_in_s)
    state.closes_at = closes_at.isoformat()
    assert main(["status", "--server", url, "--token", TOKEN, "--backoff", "0"]) == 0
    out = capsys.readouterr().out
    assert ("has passed: it takes no more submissions" in out) is stops
    assert ("it takes submissions until" in out) is not stops
    folder = tmp_path / "state"
    code = main(["participate", "--log", str(_one_line_log(tmp_path)), "--dir", str(folder),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN, "--backoff", "0"])
    captured = capsys.readouterr()
    if stops:
        assert code == 1 and captured.out == ""
        assert captured.err.strip() == (
            "synapse-client: the server has no round open for this submission: round 4 stopped "
            f"taking submissions at its deadline ({closes_at.isoformat()}); it closes shortly")
        assert not (folder / "compendium.json").exists() and state.posts == []
    else:
        assert code == 0 and "submitted to round 4" in captured.out
        assert state.created == 1


def test_a_cached_answer_s_date_is_aged_by_its_age_header(server, tmp_path, capsys):
    """A cache between client and server serves an answer with the Date the server gave it when
    it was made and an Age header counting the seconds since (RFC 9111, 5.1). The client took
    that Date for the server's clock now: an answer an hour old made a round ten minutes past its
    deadline look open, and participate built and sent for it. Date + Age is the server's clock."""
    url, state = server
    state.age_s = 3600
    closes_at = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    state.closes_at = closes_at.isoformat()
    folder = tmp_path / "state"
    assert main(["participate", "--log", str(_one_line_log(tmp_path)), "--dir", str(folder),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN,
                 "--backoff", "0"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: the server has no round open for this submission: round 4 stopped "
        f"taking submissions at its deadline ({closes_at.isoformat()}); it closes shortly")
    assert state.posts == []


@pytest.mark.parametrize(("age", "seconds"), [("30", 30), (" 7 ", 7), ("-5", 0), ("ten", 0),
                                              ("1.5", 0), ("", 0), (None, 0)])
def test_answer_date_adds_a_valid_age_and_ignores_any_other(age, seconds):
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    headers = {"Date": date} if age is None else {"Date": date, "Age": age}
    assert answer_date(headers) == http_date(date) + dt.timedelta(seconds=seconds)
    assert answer_date({"Age": "30"}) is None


def test_participate_without_the_servers_date_judges_the_deadline_by_this_clock_and_says_so(
    server, tmp_path, capsys
):
    url, state = server
    state.clock_ahead_s = None  # no Date header: this machine's clock is all there is
    closes_at = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    state.closes_at = closes_at.isoformat()
    assert main(["status", "--server", url, "--token", TOKEN, "--backoff", "0"]) == 0
    assert ("has passed: it takes no more submissions and closes at the server's next check "
            "(judged by this machine's clock: the server's answer carried no usable Date "
            "header)") in capsys.readouterr().out
    folder = tmp_path / "state"
    assert main(["participate", "--log", str(_one_line_log(tmp_path)), "--dir", str(folder),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN,
                 "--backoff", "0"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: the server has no round open for this submission: round 4 stopped "
        f"taking submissions at its deadline ({closes_at.isoformat()}); it closes shortly "
        "(judged by this machine's clock: the server's answer carried no usable Date header)")
    assert not (folder / "compendium.json").exists() and state.posts == []


def test_participate_leaves_out_a_field_the_round_will_not_release_that_the_schema_dropped(
    server, tmp_path, capsys
):
    """The round's fields_not_released were read when it opened; a field the schema in force no
    longer declares is not computed anyway. participate refused the round with "--not-released
    names no declared numeric field", a flag the user never passed."""
    url, state = server
    state.not_released = ["latency_ms", "retired_field"]
    log = tmp_path / "usage.jsonl"
    log.write_text(json.dumps({"query": "Will it rain tomorrow in a city?", "tool": "weather",
                               "outcome": "success", "latency_ms": 3, "user": "u1"}) + "\n",
                   encoding="utf-8")
    assert main(["participate", "--log", str(log), "--dir", str(tmp_path / "state"),
                 "--no-collapse", "--quiet", "--server", url, "--token", TOKEN,
                 "--backoff", "0"]) == 0
    captured = capsys.readouterr()
    assert "the round will not release latency_ms: not sent" in captured.out
    assert "retired_field" not in captured.out + captured.err
    assert state.created == 1
    assert all("latency_ms" not in entry["stats"] for entry in json.loads(
        (tmp_path / "state" / "compendium.json").read_text(encoding="utf-8"))["metadata"])


def test_pull_treats_an_unreadable_etag_file_as_none(server, tmp_path, capsys):
    url, state = server
    published = compendium("Check tomorrow's forecast for a city")
    form = canonical_form(published)
    state.published = {"round": 4, "sha256": form.sha256, "published_at": "2026-01-01T00:00:00Z",
                       "compendium": published.model_dump(mode="json")}
    out = tmp_path / "global.json"
    args = ["pull", "--server", url, "--token", TOKEN, "--out", str(out), "--backoff", "0"]
    assert main(args) == 0
    etag_file(out).write_bytes(b"\xff\xfe\x00garbage\x81")  # not UTF-8: damaged on disk
    capsys.readouterr()
    assert main(args) == 0
    assert "round 4 saved" in capsys.readouterr().out
    assert "If-None-Match" not in state.global_requests[-1]
    assert etag_file(out).read_text().strip() == f'"{form.sha256}"'


def test_submit_reads_the_field_cap_the_compendium_records_not_its_report(server, tmp_path, capsys):
    # The record travels inside the compendium: a capped build goes without its report (copied
    # here without it), and no report vouches for a compendium that records no cap (a capped
    # build's report left beside an uncapped one, or a build of an older client).
    url, state = server
    state.field_cap = 2
    capped = _build(tmp_path, "capped.json", "--field-cap", "2")
    assert json.loads(capped.read_text(encoding="utf-8"))["field_cap"] == 2
    (tmp_path / "capped.json.report.json").unlink()
    capsys.readouterr()
    assert main(submit_args(url, capped)) == 0
    captured = capsys.readouterr()
    assert "field cap" not in captured.err and "submitted to round 4" in captured.out
    uncapped = _build(tmp_path, "uncapped.json")
    report = json.loads((tmp_path / "uncapped.json.report.json").read_text(encoding="utf-8"))
    report["field_cap"] = 2  # what the report says does not count
    (tmp_path / "uncapped.json.report.json").write_text(json.dumps(report), encoding="utf-8")
    capsys.readouterr()
    assert main(submit_args(url, uncapped)) == 1
    assert "records no field cap" in capsys.readouterr().err and len(state.posts) == 1
    # without numeric statistics there is nothing F* bounds: sent whatever it records
    assert main(submit_args(url, write(tmp_path, compendium(), "text-only.json"))) == 0
    assert "field cap" not in capsys.readouterr().err and len(state.posts) == 2


def test_rejected_paths_point_into_the_submitted_file_not_the_canonical_order(server, tmp_path,
                                                                             capsys):
    # The body goes in canonical order (entries sorted), which the server's paths index; a file
    # edited or reordered by hand has its own order, and `validate` reads the file as it is.
    url, state = server
    doc = {
        "metadata": [
            {"tool_id": "weather", "stats": {"calls": 5000.0}},
            {"tool_id": "flights", "stats": {"calls": 2.0}},
            {"tool_id": "weather", "stats": {"calls": 1.0}},
        ],
        "scenarios": [
            {"tool_id": "weather", "text": "Will it snow in the mountains?"},
            {"tool_id": "teleporter", "text": "Beam me up"},
            {"tool_id": "weather", "text": "Is it sunny on the coast?"},
            {"tool_id": "weather", "text": "Is it sunny on the coast?"},
        ],
        "masking": {"strength": 1.0, "masked_fraction": 0.0},
    }
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(SCHEMA.model_dump_json(), encoding="utf-8")
    assert main(["validate", str(path), "--schema", str(schema_path)]) == 1
    local = capsys.readouterr().err.strip().splitlines()
    assert main(submit_args(url, path)) == 1
    remote = capsys.readouterr().err.strip().splitlines()
    assert len(state.posts) == 1  # the server saw it, in canonical order
    assert remote[-1].startswith(f"synapse-client: the server rejected {path}")
    expected = {
        f"{path}: $.scenarios[1].tool_id: references unregistered tool 'teleporter': not in the "
        "tool registry (2 tools); register it or drop the entry",
        f"{path}: $.scenarios[3]: duplicate scenario: same as $.scenarios[2]",
        f"{path}: $.metadata[0].stats.calls: value 5000.0 is outside the declared range "
        "[0, 1000] of field 'calls'",
        f"{path}: $.metadata[2].tool_id: duplicate tool id 'weather': already at $.metadata[0]",
    }
    assert set(remote[:-1]) == expected and set(local) == expected


def test_participate_records_what_it_sent_under_the_round_the_server_stored_it_in(
    server, tmp_path, capsys, monkeypatch
):
    """Round 4 closes and round 5 opens while participate builds: submit reads the open round
    again, checks the compendium for round 5 and the server stores it there (its answer names
    the round). sent.json recorded it under round 4, the round read before the build, so the
    next round's build would leave out or send again the wrong entries."""
    import compendium.client_cli as cli

    url, state = server
    log = tmp_path / "usage.jsonl"
    log.write_text(json.dumps({"query": "Will it rain tomorrow in a city?", "tool": "weather",
                               "outcome": "success", "latency_ms": 3, "user": "u1"}) + "\n",
                   encoding="utf-8")
    build = cli.cmd_build

    def build_while_the_round_turns(args):
        status = build(args)
        state.round_number = 5
        return status

    monkeypatch.setattr(cli, "cmd_build", build_while_the_round_turns)
    folder = tmp_path / "state"
    assert main(["participate", "--log", str(log), "--dir", str(folder), "--no-collapse",
                 "--quiet", "--server", url, "--token", TOKEN, "--backoff", "0"]) == 0
    assert "round 4: no global yet" in capsys.readouterr().out
    assert list(state.rows) == [(5, "client-1")]  # stored in round 5, as the answer says
    recorded = json.loads((folder / "sent.json").read_text(encoding="utf-8"))["rounds"]
    assert list(recorded) == ["5"] and recorded["5"]


def test_a_round_participate_had_nothing_new_for_counts_as_done_for_a_scheduler(
    server, tmp_path, capsys, monkeypatch
):
    """When the pulled global covers everything, participate sends nothing (the server refuses
    an empty compendium) and the round has no submission of this client: status
    --require-submitted exited 3 for the rest of the round, and a scheduler retrying on 3
    rebuilt for ever. participate records that it had nothing new in the round (sent.json);
    status --dir reads it: the client's part of the round is done."""
    import compendium.client_cli as cli
    from compendium.client_api import record_sent, sent_before, sent_file

    url, state = server
    folder = tmp_path / "state"

    def build_covered_by_the_global(args):  # what build --since writes when the global covers all
        Path(args.out).write_text(Compendium().model_dump_json(), encoding="utf-8")
        return 0

    monkeypatch.setattr(cli, "cmd_build", build_covered_by_the_global)
    server_args = ["--server", url, "--token", TOKEN, "--backoff", "0"]
    log = tmp_path / "usage.jsonl"
    log.write_text("", encoding="utf-8")
    _publish(state, compendium(), number=3)
    record_sent(sent_file(folder), 3, {"k"})  # what round 3's submission held stays recorded
    assert main(["participate", "--log", str(log), "--dir", str(folder), "--no-collapse",
                 "--quiet", *server_args]) == 0
    assert "nothing new since the global: nothing sent this round" in capsys.readouterr().out
    assert state.posts == [] and sent_before(sent_file(folder), {3}) == {"k"}
    status = ["status", "--require-submitted", *server_args]
    assert main(status) == 3  # the server alone cannot tell: no submission in effect
    capsys.readouterr()
    assert main([*status, "--dir", str(folder)]) == 0
    assert ("participate had nothing new to send to round 4 (recorded in "
            f"{sent_file(folder)}): this client's part of the round is done") in capsys.readouterr().out
    state.round_number = 5  # the next round: not done until participate runs in it
    assert main([*status, "--dir", str(folder)]) == 3
    assert main([*status, "--dir", str(tmp_path / "elsewhere")]) == 3


def test_a_record_nested_past_the_parser_is_unreadable_not_a_traceback(server, tmp_path, capsys):
    """participate's record (sent.json) damaged into brackets nested past what json reads: a
    RecursionError traceback from status --dir (and participate), where a missing or unreadable
    record is read as none."""
    from compendium.client_api import sent_before, sent_file

    url, _ = server
    folder = tmp_path / "state"
    folder.mkdir()
    sent_file(folder).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert sent_before(sent_file(folder), {3}) == set()
    status = ["status", "--require-submitted", "--server", url, "--token", TOKEN, "--dir", str(folder)]
    assert main(status) == 3  # nothing recorded, nothing in effect: not done
    assert "this client has not submitted to round 4 yet" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["submit", "pull", "participate", "status", "fetch-probe"])
def test_retries_help_names_what_is_retried(command, capsys):
    """--retries said "retries on network errors/5xx", but a 429 is retried too (waiting as
    long as its Retry-After asks)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--retries RETRIES retries on network errors, 5xx and 429" in text


@pytest.mark.parametrize("command", ["build", "pull", "fetch-probe"])
@pytest.mark.parametrize("suffix", [os.sep, os.sep + "."])
def test_an_out_path_that_names_a_folder_is_refused_not_written_as_a_file(
    server, tmp_path, capsys, command, suffix
):
    """--out is the file to write. `--out newdir/`, a folder that does not exist, wrote a file
    called newdir (the trailing separator is lost once it is a Path)."""
    url, state = server
    _publish(state, compendium())
    out = str(tmp_path / "newdir") + suffix
    if command == "build":
        log, schema_path = tmp_path / "usage.jsonl", tmp_path / "schema.json"
        log.write_text(json.dumps({"query": "Will it rain?", "tool": "weather",
                                   "outcome": "success", "latency_ms": 3, "user": "u1"}) + "\n")
        schema_path.write_text(SCHEMA.model_dump_json(), encoding="utf-8")
        args = ["build", "--log", str(log), "--schema", str(schema_path), "--no-collapse",
                "--quiet", "--out", out]
    else:
        args = [command, "--server", url, "--token", TOKEN, "--backoff", "0", "--out", out]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"synapse-client: --out {out} names a folder, not a file: --out is the file "
                   "to write; name a file (nothing written)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert state.global_requests == []  # refused before anything is asked of the server


def _folder(tmp_path: Path) -> tuple[Path, str]:
    out = tmp_path / "results"
    out.mkdir()
    return out, f"--out {out} names a folder, not a file: --out is the file to write; name a file (nothing written)"


def _pipe(tmp_path: Path) -> tuple[Path, str]:
    out = tmp_path / "pipe.json"
    os.mkfifo(out)
    # as write_atomically says it at the end (test_an_out_that_is_a_pipe_or_device_is_refused_...)
    return out, (f"cannot write {out}: it is a pipe (FIFO), not a regular file, and the file "
                 "written would replace it; name a file")


def _under_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    out = tmp_path / "notes.txt" / "sub" / "out.json"
    return out, f"--out {out}: {tmp_path / 'notes.txt'} is a file, not a folder (nothing written)"


@pytest.mark.parametrize("command", ["build", "pull", "fetch-probe"])
@pytest.mark.parametrize("place", [_folder, _pipe, _under_a_file])
def test_an_out_that_cannot_be_the_file_written_is_refused_before_any_work(
    server, tmp_path, capsys, command, place
):
    """An --out that exists as a folder, that is a pipe or a device, or that lies under a file
    was found only when the result was written: after the whole build (minutes with the embedding
    model on a large log) or after the download, with `cannot write OUT: Is a directory`. Refused
    now, in one line naming it, before the log is read or the server is asked anything; what is
    there is left as it was."""
    url, state = server
    _publish(state, compendium())
    out, said = place(tmp_path)
    if command == "build":
        schema_path = tmp_path / "schema.json"
        schema_path.write_text(SCHEMA.model_dump_json(), encoding="utf-8")
        # a log that is not there: a build that got as far as reading it would say so instead
        args = ["build", "--log", str(tmp_path / "usage.jsonl"), "--schema", str(schema_path),
                "--no-collapse", "--quiet", "--out", str(out)]
    else:
        args = [command, "--server", url, "--token", TOKEN, "--backoff", "0", "--out", str(out)]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(args) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"synapse-client: {said}"]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if place is _under_a_file:
        assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert state.global_requests == []  # refused before anything is asked of the server
