"""Bad input a client developer can give `synapse-client` and the routing API: each is one clear
line naming what is wrong (exit status 1, or a 400), never a traceback or a 500, and nothing is
sent or loaded before it is found."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from compendium.client_api import ClientError, SynapseClient
from compendium.client_cli import main
from routing import services
from routing.router import RoutingParams, RoutingParamsError

TOKEN = "syn_c_" + "a" * 43
NOWHERE = "http://127.0.0.1:9"  # never reached: every case is refused before a request


@pytest.mark.parametrize(
    "server, reason",
    [
        ("http://[::1", "is not a valid URL"), ("http://", "names no host"),
        ("https:///x", "names no host"),
        # UnicodeError tracebacks before: from the socket layer at the first request (an empty
        # or overlong label) and from httpx decoding an invalid punycode label
        ("http://synapse..example", "names a host that is not a valid domain name"),
        ("http://" + "a" * 64 + ".example", "names a host that is not a valid domain name"),
        ("http://xn--zz.example", "names a host that is not a valid domain name"),
        # httpx takes any number: the socket layer connected port 99999 to 34463 (99999 mod
        # 65536), and sent the token to whatever listens there
        ("http://127.0.0.1:99999", "names port 99999, which no TCP port is"),
        ("http://127.0.0.1:0", "names port 0, which no TCP port is"),
        ("http://127.0.0.1:-1", "names port -1, which no TCP port is"),
    ],
)
def test_a_server_url_httpx_cannot_use_is_one_clear_error(server, reason):
    with pytest.raises(ClientError, match=reason):
        SynapseClient(server, TOKEN)


@pytest.mark.parametrize("server", ["https://bob:s3cret@synapse.example", "https://bob@synapse.example"])
def test_a_server_url_with_credentials_is_refused_without_echoing_them(server):
    """httpx sent a URL's user:password as Basic credentials in place of the API token (every
    request a 401), and every error that names the server printed the password."""
    with pytest.raises(ClientError, match="carries a user name or password") as refused:
        SynapseClient(server, TOKEN)
    assert "s3cret" not in str(refused.value) and "bob" not in str(refused.value)


@pytest.mark.parametrize("token", ["syn_c_é", "syn_c_a\nb", "syn_c_a b", "syn_c_\x00"])
def test_a_token_no_http_header_can_carry_is_one_clear_error(token):
    with pytest.raises(ClientError, match="check --token or SYNAPSE_TOKEN"):
        SynapseClient(NOWHERE, token)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--timeout", "0", "--timeout must be a positive number of seconds, not 0"),
        ("--timeout", "-5", "--timeout must be a positive number of seconds, not -5"),
        ("--timeout", "nan", "--timeout must be a positive number of seconds, not nan"),
        ("--retries", "-1", "--retries must be from 0 to 100, not -1"),
        # a dead server was retried for ever (each wait capped at 30 s)
        ("--retries", str(10**30), f"--retries must be from 0 to 100, not {10**30}"),
        ("--backoff", "-1", "--backoff must be 0 or more seconds, not -1"),
    ],
)
def test_bad_network_options_are_refused_before_any_request(capsys, flag, value, message):
    code = main(["status", "--server", NOWHERE, "--token", TOKEN, flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"synapse-client: {message}"]


@pytest.mark.parametrize("command", ["build", "validate", "participate"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_lambda_no_masking_can_use_is_a_usage_error(tmp_path, capsys, command, value):
    """README: a negative --lambda gets the usage and the error, status 2, as anything argparse
    cannot parse. Before, main() printed one line without the usage for a negative one, and a NaN
    or infinite one was an ordinary error (status 1) found only once the command had begun."""
    args = {
        "build": ["build", "--log", "u.jsonl", "--schema", "s.json", "--out", "o.json"],
        "validate": ["validate", "c.json", "--schema", "s.json"],
        "participate": ["participate", "--log", "u.jsonl", "--dir", str(tmp_path),
                        "--server", NOWHERE, "--token", TOKEN],
    }[command]
    with pytest.raises(SystemExit) as stopped:
        main(args + ["--lambda", value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.startswith(f"usage: synapse-client {command} ")
    assert err.strip().splitlines()[-1] == (
        f"synapse-client {command}: error: argument --lambda: must be a finite number >= 0, "
        f"not {value}"
    )


@pytest.mark.parametrize("server", ["http://[::1", "http://", "http://synapse..example"])
def test_the_cli_reports_a_bad_server_url_in_one_line(capsys, server):
    assert main(["status", "--server", server, "--token", TOKEN]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("synapse-client: --server ")


def test_the_cli_reports_a_non_ascii_token_in_one_line(capsys):
    assert main(["status", "--server", NOWHERE, "--token", "syn_c_é"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "check --token or SYNAPSE_TOKEN" in err[0]


_SOCKSIO = importlib.util.find_spec("socksio") is not None


@pytest.mark.parametrize(
    "variable, proxy, said",
    [
        ("HTTPS_PROXY", "ftp://proxy.example:21", "Unknown scheme for proxy URL"),
        # an SSH tunnel's proxy: httpx needs the socksio package for it, which is not installed
        pytest.param("ALL_PROXY", "socks5://127.0.0.1:1080", "socksio",
                     marks=pytest.mark.skipif(_SOCKSIO, reason="socksio is installed")),
    ],
)
def test_a_proxy_in_the_environment_httpx_cannot_use_is_one_clear_line(
    monkeypatch, capsys, variable, proxy, said
):
    """httpx sets up the environment's proxies when the client is made: an ImportError or a
    ValueError traceback before, for every command that talks to the server."""
    monkeypatch.setenv(variable, proxy)
    assert main(["status", "--server", NOWHERE, "--token", TOKEN]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "synapse-client: cannot use the proxy the environment names (HTTP_PROXY, HTTPS_PROXY or "
        "ALL_PROXY): "
    ) and said in err[0]


def test_a_missing_certificate_file_in_the_environment_is_named(monkeypatch, tmp_path, capsys):
    """SSL_CERT_FILE naming no file: "synapse-client: No such file or directory" before, which
    named neither the file nor what it was for."""
    missing = tmp_path / "missing-ca.pem"
    monkeypatch.setenv("SSL_CERT_FILE", str(missing))
    assert main(["status", "--server", NOWHERE, "--token", TOKEN]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "synapse-client: cannot load the certificates that check the server's TLS certificate "
        f"(SSL_CERT_FILE={missing}): No such file or directory"
    ]


@pytest.mark.parametrize(
    "query, message",
    [
        ("", "the query is empty"),
        ("   ", "the query is empty"),
        # what Python makes of a command-line argument that is not UTF-8 (surrogateescape)
        ("caf\udcff", "the query contains a lone surrogate U+DCFF at position 3"),
    ],
)
def test_route_refuses_an_unroutable_query_before_loading_anything(tmp_path, query, message):
    missing = tmp_path / "global.json"  # never read: the query is checked first
    with pytest.raises(SystemExit) as exit_:
        main(["route", query, "--compendium", str(missing)])
    assert str(exit_.value.code).startswith(f"synapse-client: {message}")


def test_route_refuses_a_params_file_it_cannot_use(tmp_path):
    missing = tmp_path / "global.json"
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(missing), "--params", str(tmp_path / "no.json")])
    assert str(exit_.value.code) == (
        f"synapse-client: --params: cannot read routing parameters {tmp_path / 'no.json'}: "
        "No such file or directory"
    )
    other = tmp_path / "global-copy.json"
    other.write_text(json.dumps({"round": 1, "compendium": {}}), encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(missing), "--params", str(other)])
    assert "is not a routing parameters file" in str(exit_.value.code)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"garbage", "is not a schema: $: Invalid JSON: expected value at line 1 column 1"),
        (b"\xff\xfe{}", "is not a schema: $: Invalid JSON: expected value at line 1 column 1"),
        (b'{"tools": 1}', "is not a schema: $.tools: Input should be a valid array"),
        (b'{"tools": [], "tools": []}', ': not valid JSON: duplicate key "tools" in one object'),
        (b"[" * 5000 + b"]" * 5000, "is not a schema: $: Invalid JSON: recursion limit exceeded"),
        (None, "cannot read schema"),  # a folder in its place
    ],
)
def test_route_refuses_a_schema_file_it_cannot_use_before_loading_the_model(tmp_path, monkeypatch,
                                                                            data, reason):
    """The schema beside the pulled global (`pull` saves it: `route` leaves out the global's
    tools it does not list) or named by --schema, damaged: one line naming it, never a
    traceback, and never routing as if it were not there (a deactivated tool named again)."""
    from compendium.client_api import schema_file
    from routing import embeddings

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the schema was read")

    monkeypatch.setattr(embeddings, "get_query_engine", no_model)
    monkeypatch.setattr(embeddings, "get_engine", no_model)
    pulled = tmp_path / "global.json"
    pulled.write_text(json.dumps({"scenarios": [{"tool_id": "weather", "text": "Will it rain?"}]}),
                      encoding="utf-8")
    named = tmp_path / "schema.json"
    for path in (schema_file(pulled), named):
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(pulled)])
    message = str(exit_.value.code)
    assert message.startswith("synapse-client: ") and reason in message and "\n" not in message
    assert str(schema_file(pulled)) in message
    assert message.endswith("pull again, or name the schema in force with --schema")
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(pulled), "--schema", str(named)])
    message = str(exit_.value.code)
    assert message.startswith("synapse-client: --schema: ") and reason in message
    assert str(named) in message


def test_route_refuses_a_schema_file_named_that_is_not_there(tmp_path):
    """Beside the global, a missing schema routes as before (a global pulled by hand, or by an
    older client); one named with --schema must be there."""
    pulled = tmp_path / "global.json"
    pulled.write_text(json.dumps({"scenarios": [{"tool_id": "weather", "text": "Will it rain?"}]}),
                      encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(pulled), "--schema",
              str(tmp_path / "no.json")])
    assert str(exit_.value.code) == (
        f"synapse-client: --schema: cannot read schema {tmp_path / 'no.json'}: No such file or "
        "directory"
    )


def test_routing_params_load_names_the_problem_of_a_named_file(tmp_path):
    assert RoutingParams.load() == RoutingParams.load(None)  # the defaults file
    with pytest.raises(RoutingParamsError, match="cannot read"):
        RoutingParams.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(RoutingParamsError, match="not a routing parameters file"):
        RoutingParams.load(bad)
    bad.write_text(json.dumps({"weights": {"no_such_weight": 1}}), encoding="utf-8")
    with pytest.raises(RoutingParamsError, match="no_such_weight"):
        RoutingParams.load(bad)
    good = tmp_path / "good.json"
    RoutingParams(top_k=7).save(good)
    assert RoutingParams.load(good).top_k == 7


def test_a_broken_server_params_file_is_logged_not_ignored(settings, tmp_path, caplog):
    settings.SYNAPSE_ROUTING_PARAMS = str(tmp_path / "missing.json")
    with caplog.at_level(logging.WARNING, logger="routing.services"):
        params = services.routing_params()
    assert params == RoutingParams.load()
    assert "SYNAPSE_ROUTING_PARAMS: cannot read routing parameters" in caplog.text


@pytest.mark.parametrize(
    "doc, problem",
    [
        ({"weights": {}, "top_k": 0}, "top_k must be at least 1, not 0"),
        ({"weights": {}, "pool": -2}, "pool must be at least 1, not -2"),
        # 1e999 reads as infinity: int() of it was an OverflowError, no RoutingParamsError (a
        # traceback of `route --params`, a router the server could never build); 2.5 was
        # silently cut to 2.
        ({"weights": {}, "top_k": float("inf")}, "top_k must be a whole number, not inf"),
        ({"weights": {}, "pool": 2.5}, "pool must be a whole number, not 2.5"),
        ({"weights": {}, "top_k": "5"}, "top_k must be a whole number, not '5'"),
        ({"weights": {"dense": "high"}}, "weights.dense must be a finite number, not 'high'"),
        ({"weights": {"bm25": True}}, "weights.bm25 must be a finite number, not True"),
        ({"calibration": {"fusion": {"score_coef": "x"}}}, "calibration.fusion.score_coef"),
        ({"calibration": {"llm": {"intercept": None}}}, "calibration.llm.intercept"),
        ({"weights": {}, "escalate_threshold": 1.5}, "escalate_threshold is a confidence in"),
    ],
)
def test_routing_params_that_no_router_can_route_with_are_refused_when_read(
    settings, tmp_path, caplog, doc, problem
):
    # Each was read without a word, then every routing call failed: a traceback of
    # `synapse-client route --params`, and a 500 from every routing API call when it was the
    # server's SYNAPSE_ROUTING_PARAMS.
    bad = tmp_path / "params.json"
    bad.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(RoutingParamsError, match="is not a routing parameters file: " + problem):
        RoutingParams.load(bad)
    settings.SYNAPSE_ROUTING_PARAMS = str(bad)
    with caplog.at_level(logging.WARNING, logger="routing.services"):
        assert services.routing_params() == RoutingParams.load()
    assert problem in caplog.text
    RoutingParams.from_dict(json.loads(RoutingParams.load().to_json()))  # the defaults pass


@pytest.mark.parametrize("query", ["\ud800", "ok \udfff"])
def test_the_routing_api_refuses_a_lone_surrogate_with_a_400_reason(query):
    # The tokenizer raised TypeError on it: a 500 from POST /api/v1/route/ and /route/batch/.
    with pytest.raises(services.RoutingInputError, match="query contains a lone surrogate"):
        services.validate_query(query)
    with pytest.raises(services.RoutingInputError, match=r"queries\[1\] contains a lone surrogate"):
        services.route_queries(["fine", query])


def test_a_file_that_is_not_a_schema_is_named_by_path_not_pydantic_echo(tmp_path, capsys):
    # It was pydantic's text: "1 validation error for Schema Invalid JSON: ... [type=json_invalid,
    # input_value='{"query": "...', input_type=str] For further information visit https://..."
    log = tmp_path / "usage.jsonl"
    log.write_text('{"query": "my secret request", "tool": "weather"}\n{"query": "more"}\n')
    compendium = tmp_path / "compendium.json"
    compendium.write_text(json.dumps({"scenarios": [], "annex": []}))
    assert main(["validate", str(compendium), "--schema", str(log)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"synapse-client: {log} is not a schema: $: Invalid JSON: trailing characters at line 2 "
        "column 1"
    )
    assert main(["validate", str(compendium), "--schema", str(compendium)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"synapse-client: {compendium} is not a schema: $.scenarios: Extra inputs")
    assert "errors.pydantic.dev" not in err and "input_value" not in err


@pytest.mark.parametrize("value", ["nan", "-0.1", "1.5"])
def test_route_refuses_an_escalation_threshold_that_is_not_a_confidence(tmp_path, value):
    # NaN never escalated anything, in silence
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(tmp_path / "g.json"), "--escalate-below", value])
    assert str(exit_.value.code).startswith("synapse-client: --escalate-below is a confidence in [0, 1]")


def test_route_without_a_pulled_global_says_to_pull_it(tmp_path):
    missing = tmp_path / "global.json"
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(missing)])
    assert str(exit_.value.code) == (
        f"synapse-client: no compendium at {missing}: pull the global first "
        f"(synapse-client pull --out {missing})"
    )


def test_a_garbled_answer_is_retried_then_one_clear_error_and_backoff_never_overflows():
    """A proxy that says gzip and sends something else: httpx cannot decode the body. That is
    retried as a network error is (a submission carries its idempotency key), then one clear
    error; and the backoff of attempt 1,100 is the 30 s cap, not an OverflowError."""
    import httpx



    calls = []

    def garbled(request):
        calls.append(request.url.path)
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=b"not gzip at all")

    client = SynapseClient("http://server.test", "syn_c_token", retries=2, backoff=0,
                           sleep=lambda s: None, transport=httpx.MockTransport(garbled))
    with pytest.raises(ClientError, match=r"failed after 3 attempt\(s\): DecodingError"):
        client.request("GET", "/api/v1/rounds/")
    assert len(calls) == 3
    slow = SynapseClient("http://server.test", "syn_c_token", backoff=0.5)
    assert slow._delay(1100, None) == 30.0


def test_a_router_answer_with_a_code_that_is_not_text_is_a_clear_error(tmp_path):
    import httpx



    def odd(request):
        return httpx.Response(404, json={"detail": "no", "code": 7})

    client = SynapseClient("http://server.test", "syn_c_token", retries=0,
                           transport=httpx.MockTransport(odd))
    with pytest.raises(ClientError, match="no tuned router to download: no"):
        client.pull_router(tmp_path / "global.json")


def _router_server(files: dict[str, bytes]):
    """A server publishing a tuned router of `files` (path -> bytes), as an httpx transport."""
    import hashlib

    import httpx

    from routing.finetune import MANIFEST_FORMAT

    def answer(request):
        if request.url.path == "/api/v1/compendium/global/router/":
            return httpx.Response(200, json={
                "format": MANIFEST_FORMAT, "round": 1, "epochs": 1, "global_sha256": "a" * 64,
                "rows_sha256": hashlib.sha256(b"".join(files.values())).hexdigest(),
                "files": [{"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                          for name, data in sorted(files.items())],
            })
        name = request.url.path.removeprefix("/api/v1/compendium/global/router/files/")
        return httpx.Response(200, content=files[name]) if name in files else httpx.Response(404)

    return httpx.MockTransport(answer)


def test_a_router_that_cannot_be_put_in_place_leaves_the_previous_copy(tmp_path, monkeypatch):
    """pull --router renamed the router folder to .old, then the new one into place: when that
    last rename failed, the user was left with no router folder (its files in .old, which the
    next pull deleted first). The previous copy stays in place now, and a .old a killed pull left
    behind is put back, not deleted."""
    import pathlib

    from compendium.client_api import router_dir
    from routing.finetune import ROUTER_MANIFEST, ROUTER_PARAMS, ROUTER_STATE, read_manifest

    out = tmp_path / "global.json"
    folder = router_dir(out)
    first = {ROUTER_STATE: b"state one", ROUTER_PARAMS: b'{"one": 1}'}
    second = {ROUTER_STATE: b"state two", ROUTER_PARAMS: b'{"two": 2}'}

    def pull(files):
        with SynapseClient("http://server.test", "syn_c_token", retries=0,
                           transport=_router_server(files)) as client:
            return client.pull_router(out)

    assert pull(first).updated
    manifest = (folder / ROUTER_MANIFEST).read_bytes()
    rename = pathlib.Path.rename

    def failing(self, target):
        if self.name.endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(target))
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", failing)
    with pytest.raises(ClientError, match=f"^cannot put the tuned router in place at {folder} "
                       r"\(Permission denied\); the previous copy is kept$"):
        pull(second)
    monkeypatch.undo()
    # no .old, no .partial (the lock file stays, as lock files do)
    assert {p.name for p in tmp_path.iterdir()} == {folder.name, folder.name + ".lock"}
    assert (folder / ROUTER_STATE).read_bytes() == b"state one"
    assert (folder / ROUTER_MANIFEST).read_bytes() == manifest
    # A pull killed between its two renames left the copy in .old alone: the next one puts it
    # back, and it is up to date (it was deleted and downloaded again).
    folder.rename(folder.with_name(folder.name + ".old"))
    again = pull(first)
    assert not again.updated and again.downloaded_bytes == 0
    assert (folder / ROUTER_STATE).read_bytes() == b"state one"
    assert read_manifest(folder) is not None
    assert {p.name for p in tmp_path.iterdir()} == {folder.name, folder.name + ".lock"}


def test_two_pulls_of_the_router_at_once_leave_every_file_in_place(tmp_path):
    """Two pull --router of one global at once (a scheduler's and a person's) shared one
    COMPENDIUM.router.partial folder: the second removed what the first had downloaded there
    and renamed the folder into place under it, and the first failed with "No such file or
    directory" (or, in the other order, put in place a folder without some of its files, beside
    a manifest naming them). The second now waits for the first and finds its folder."""
    import threading

    import httpx

    from compendium.client_api import _intact, router_dir
    from routing.finetune import ROUTER_PARAMS, ROUTER_STATE, read_manifest

    out = tmp_path / "global.json"
    folder = router_dir(out)
    files = {ROUTER_STATE: b"state", ROUTER_PARAMS: b'{"p": 1}'}
    served = _router_server(files)
    second = {}

    def pull_second():
        try:
            second["result"] = pull(served)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            second["error"] = exc

    other = threading.Thread(target=pull_second)

    def answer(request):  # the other pull starts while this one is half-way
        if request.url.path.endswith(ROUTER_STATE) and not other.is_alive():
            other.start()
            other.join(timeout=1.0)  # it waits for this pull rather than run under it
        return served.handle_request(request)

    def pull(transport):
        with SynapseClient("http://server.test", "syn_c_token", retries=0,
                           transport=transport) as client:
            return client.pull_router(out)

    assert pull(httpx.MockTransport(answer)).updated
    other.join(timeout=30)
    assert "error" not in second, second.get("error")
    assert not second["result"].updated  # it found the folder the first one put in place
    manifest = read_manifest(folder)
    assert manifest is not None and all(_intact(folder / f["path"], f) for f in manifest["files"])
    assert {p.name for p in tmp_path.iterdir()} == {folder.name, folder.name + ".lock"}  # no .partial


def test_a_head_that_fails_to_download_leaves_no_older_head_beside_the_new_global(tmp_path):
    """Round 2's global arrives but its head download fails: round 1's head is not left beside
    it (route and build --since would use it), and the next pull, a 304, fetches round 2's."""
    import httpx
    import numpy as np

    from compendium.canonical import canonical_form
    from compendium.client_api import head_file
    from compendium.schema import Compendium
    from routing.router import LinearHead

    state = {"round": 1, "head_down": False}

    def head_bytes(round_number):
        weights = np.full((2, 3), float(round_number), "float32")
        return LinearHead(["a", "b"], weights, np.zeros(2, "float32")).to_bytes()

    def server(request):
        path = request.url.path
        if path == "/api/v1/compendium/global/":
            compendium = Compendium.model_validate(
                {"scenarios": [{"tool_id": "a", "text": f"what round {state['round']} learnt"}]})
            etag = f'"{canonical_form(compendium).sha256}"'
            if request.headers.get("If-None-Match") == etag:
                return httpx.Response(304, headers={"ETag": etag})
            body = {"round": state["round"], "compendium": compendium.model_dump(mode="json")}
            return httpx.Response(200, json=body, headers={"ETag": etag})
        if path == "/api/v1/compendium/global/head/":
            if state["head_down"]:
                return httpx.Response(503, json={"detail": "restarting"})
            return httpx.Response(200, content=head_bytes(state["round"]))
        return httpx.Response(404, json={"detail": "no"})

    client = SynapseClient("http://server.test", "syn_c_token", retries=0,
                           transport=httpx.MockTransport(server))
    out = tmp_path / "global.json"
    assert client.pull(out).head == head_file(out)
    state.update(round=2, head_down=True)
    second = client.pull(out)
    assert second.updated and second.head is None and not head_file(out).exists()
    assert any("routing head was not downloaded" in w for w in second.warnings)
    state["head_down"] = False
    third = client.pull(out)
    assert not third.updated and third.head == head_file(out)
    assert head_file(out).read_bytes() == head_bytes(2)


def test_since_confidence_with_nothing_it_leaves_out_against_is_refused(tmp_path, capsys):
    """--since-confidence leaves out what the pulled global (--since) or the probe set's router
    (--probe) already routes: build without either, or participate with --no-collapse (which
    builds without the embedding model either needs), ignored it without a word."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    out = tmp_path / "c.json"
    assert main(["build", "--log", str(tmp_path / "missing.jsonl"), "--schema", str(schema),
                 "--out", str(out), "--since-confidence", "0.5", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: --since-confidence applies only with --since GLOBAL or --probe PROBE; "
        "this build has neither, so it would be ignored"
    )
    assert not out.exists()
    assert main(["participate", "--log", str(tmp_path / "usage.jsonl"), "--dir", str(tmp_path / "s"),
                 "--server", NOWHERE, "--token", TOKEN, "--no-collapse",
                 "--since-confidence", "0.5"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: --since-confidence needs the embedding model, which --no-collapse "
        "skips: leave out one of them"
    )
    assert not (tmp_path / "s").exists()


def test_build_since_without_the_embedding_model_is_refused_before_any_work(tmp_path, capsys):
    """`--since` needs the embedding model that `--no-collapse` skips: said before the log is
    read (here it does not even exist), not after the whole build ran."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    assert main(["build", "--log", str(tmp_path / "missing.jsonl"), "--schema", str(schema),
                 "--out", str(tmp_path / "c.json"), "--since", str(tmp_path / "global.json"),
                 "--no-collapse", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == (
        "synapse-client: --since needs the embedding model (drop --no-collapse)"
    )
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--seed", str(2**63), "--seed must be a whole number from -9223372036854775808 to "
         "9223372036854775807"),
        ("--seed", str(-(2**63) - 1), "--seed must be a whole number from -9223372036854775808 to "
         "9223372036854775807"),
        ("--field-cap", str(2**31), "--field-cap must be from 1 to 2147483647"),
    ],
)
def test_build_refuses_a_seed_or_field_cap_no_compendium_can_record(tmp_path, capsys, flag, value,
                                                                    message):
    """A seed past 64 bits or a field cap past the ledger's integer was pydantic's traceback
    once the whole log had been masked (MaskingInfo.seed, Compendium.field_cap); now one line
    before the log is read (here it does not even exist), and nothing is written."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    out = tmp_path / "c.json"
    assert main(["build", "--log", str(tmp_path / "missing.jsonl"), "--schema", str(schema),
                 "--out", str(out), "--no-collapse", "--quiet", flag, value]) == 1
    assert capsys.readouterr().err.strip() == f"synapse-client: {message}"
    assert not out.exists()


def test_participate_refuses_a_seed_no_compendium_can_record_before_any_request(tmp_path, capsys):
    assert main(["participate", "--log", str(tmp_path / "usage.jsonl"), "--dir", str(tmp_path / "s"),
                 "--server", NOWHERE, "--token", TOKEN, "--seed", str(2**64)]) == 1
    assert capsys.readouterr().err.strip().startswith("synapse-client: --seed must be a whole number")


def test_a_json_file_nested_too_deeply_is_one_clear_line_not_a_recursion_error(tmp_path, capsys):
    """A --since, --probe, route --compendium or build report nested deeper than Python's json
    reads was a RecursionError traceback (a number of 5,000 digits a ValueError one, a file that
    is not UTF-8 a UnicodeDecodeError one for route)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000, encoding="utf-8")
    compendium = tmp_path / "c.json"
    compendium.write_text(json.dumps({"scenarios": [{"tool_id": "weather", "text": "forecast"}]}))
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    server = ["--server", NOWHERE, "--token", TOKEN, "--retries", "0"]

    assert main(["submit", str(compendium), "--since", str(deep), *server]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"synapse-client: {deep} is not a compendium (1 error(s))"
    assert main(["submit", str(compendium), "--schema", str(schema), "--probe", str(deep),
                 *server]) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: {deep} is not a probe set: it nests too deeply"
    )

    (tmp_path / "c.json.report.json").write_text("[" * 100_000, encoding="utf-8")
    assert main(["inspect", str(compendium)]) == 0
    assert "c.json.report.json is not a report build wrote: ignored" in capsys.readouterr().err

    huge = tmp_path / "huge.json"
    huge.write_text('{"num_users": ' + "9" * 5000 + "}", encoding="utf-8")
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"scenarios": [{"tool_id": "weather", "text": "caf\xe9"}]}'.encode("latin-1"))
    for path, reason in [(deep, "is not a compendium: it nests too deeply"),
                         (huge, "is not a compendium: it holds a number of more than 4,300 digits"),
                         (latin, "is not UTF-8 text (invalid continuation byte)")]:
        with pytest.raises(SystemExit) as exit_:
            main(["route", "weather?", "--compendium", str(path)])
        assert str(exit_.value.code) == f"synapse-client: {path} {reason}"


def test_a_404_page_that_is_not_the_apis_is_not_taken_for_nothing_published(tmp_path):
    """A proxy's or another site's 404 page was NothingPublished: `pull` said "no global
    compendium is published", and `participate` took it for a new federation and deleted the
    global it held, its ETag and head, and its record of what it sent (sent.json)."""
    import httpx

    from compendium.client_api import NothingPublished

    def server(request):
        if request.url.path == "/api/v1/compendium/global/":
            return httpx.Response(404, headers={"Content-Type": "text/html"},
                                  content=b"<html><body>404 Not Found</body></html>")
        return httpx.Response(404, json={"detail": "no global compendium is published yet"})

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError, match="not an answer of the SYNAPSE API .* check --server") as err:
        client.pull(tmp_path / "global.json")
    assert not isinstance(err.value, NothingPublished)

    def api(request):
        return httpx.Response(404, json={"detail": "no global compendium is published yet"})

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(api))
    with pytest.raises(NothingPublished, match="no global compendium is published yet"):
        client.pull(tmp_path / "global.json")


@pytest.mark.parametrize("flag", ["--log", "--schema"])
def test_build_refuses_an_out_that_is_the_file_it_reads(tmp_path, capsys, flag):
    """`build --log usage.jsonl --out usage.jsonl` wrote the compendium over the usage log it
    had just read (and --out schema.json over the schema): the log was gone."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    log = tmp_path / "usage.jsonl"
    line = {"query": "rain in Lisbon?", "tool": "weather", "outcome": "success",
            "latency_ms": 120, "user": "u1"}
    log.write_text(json.dumps(line) + "\n", "utf-8")
    before = {path: path.read_bytes() for path in (log, schema)}
    out = log if flag == "--log" else schema
    assert main(["build", "--log", str(log), "--schema", str(schema), "--out", str(out),
                 "--no-collapse", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: --out {out} would overwrite the {flag} file {out}: name another file; "
        "nothing built"
    )
    assert {path: path.read_bytes() for path in (log, schema)} == before


@pytest.mark.parametrize("answer", [[], "stored", 7, None])
def test_an_accepted_submission_whose_answer_is_not_an_object_is_one_clear_error(answer):
    """A 201 whose body is JSON but not an object (a proxy, another service at --server): one
    line saying so, not an AttributeError traceback from printing the submission's id."""
    import httpx

    from compendium.schema import Compendium, MaskingInfo, Scenario

    def server(request):
        if request.url.path == "/api/v1/rounds/":  # λ = 1 by default: the schema is read
            return httpx.Response(200, json={"results": [{"number": 4, "config": {}}]})
        if request.url.path == "/api/v1/compendium/schema/":
            return httpx.Response(200, json={"tools": [{"tool_id": "weather",
                                                        "description": "Weather"}]})
        return httpx.Response(201, content=json.dumps(answer).encode())

    compendium = Compendium(scenarios=[Scenario(tool_id="weather", text="rain in a city?")],
                            masking=MaskingInfo(strength=1.0, masked_fraction=0.2))
    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError, match=r"the server's answer to the submission \(HTTP 201\) "
                                          r"is not a JSON object"):
        client.submit(compendium)


@pytest.mark.parametrize("counts", [[1, 2], "3 scenarios", 5])
def test_status_reads_a_submission_whose_entry_counts_are_not_an_object(monkeypatch, capsys,
                                                                        counts):
    """The submission list's `entry_counts` as another shape than an object: status says the
    rest of what it knows, not an AttributeError traceback."""
    monkeypatch.setattr(SynapseClient, "rounds", lambda self, state=None: [{"number": 4}])
    monkeypatch.setattr(SynapseClient, "counted_submissions", lambda self, number=None: ([
        {"in_effect": True, "sha256": "ab" * 32, "size_bytes": 10, "entry_counts": counts}], 1))
    assert main(["status", "--server", NOWHERE, "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert "this client submitted at None: sha256 abababababab…, 10 bytes\n" in out


def test_a_global_or_schema_holding_a_lone_surrogate_is_one_clear_error(tmp_path):
    """JSON can escape half of a character ("\\ud800"), which no file can hold: a global or a
    schema from the server with one was a UnicodeEncodeError traceback, and nothing is saved."""
    import httpx

    surrogate = b'"\\ud800"'

    def server(request):
        if request.url.path == "/api/v1/compendium/global/":
            return httpx.Response(200, content=b'{"round": 3, "compendium": {"scenarios": '
                                  b'[{"tool_id": "weather", "text": ' + surrogate + b"}]}}")
        return httpx.Response(200, content=b'{"tools": [{"tool_id": "weather", "description": '
                              + surrogate + b"}]}")

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError, match="the server sent a compendium this client cannot read: "
                                          "it holds a lone surrogate"):
        client.pull(tmp_path / "global.json")
    with pytest.raises(ClientError, match="the server sent a schema this client cannot read: it "
                                          "holds a lone surrogate"):
        client.fetch_schema(tmp_path / "schema.json")
    assert list(tmp_path.iterdir()) == []


def test_a_global_or_schema_the_client_cannot_read_is_named_with_what_is_wrong(tmp_path):
    """The server's compendium or schema that does not validate: each error by its path with
    its reason (only the first line of pydantic's text named the field, without the reason, and
    its echo of the input was printed)."""
    import httpx

    def server(request):
        if request.url.path == "/api/v1/compendium/global/":
            return httpx.Response(200, json={"round": 3, "compendium": {
                "scenarios": [{"tool_id": "weather", "text": 5}]}})
        return httpx.Response(200, json=["not", "a", "schema"])

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError) as pulled:
        client.pull(tmp_path / "global.json")
    assert str(pulled.value) == ("the server sent a compendium this client cannot read: "
                                 "$.scenarios[0].text: Input should be a valid string")
    with pytest.raises(ClientError) as fetched:
        client.fetch_schema(tmp_path / "schema.json")
    assert str(fetched.value) == ("the server sent a schema this client cannot read: $: Input "
                                  "should be an object")


@pytest.mark.parametrize("since", ["missing.json", "log.jsonl"])
def test_build_since_a_file_it_cannot_read_is_refused_before_any_work(tmp_path, capsys,
                                                                      monkeypatch, since):
    """A --since that is missing or not a global is found before the log is read and the
    embedding model loaded (which take minutes on a big log), not after the whole build."""
    from routing import embeddings

    def no_model(*args, **kwargs):
        raise AssertionError("the embedding model was loaded before --since was read")

    monkeypatch.setattr(embeddings, "get_engine", no_model)
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    log = tmp_path / "log.jsonl"
    log.write_text('{"query": "rain in Lisbon?", "tool": "weather", "outcome": "success", '
                   '"latency_ms": 3, "user": "u1"}\n', "utf-8")
    assert main(["build", "--log", str(log), "--schema", str(schema), "--out",
                 str(tmp_path / "c.json"), "--since", str(tmp_path / since), "--quiet"]) == 1
    path = tmp_path / since
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"synapse-client: cannot read {path}: No such file or directory"
        if since == "missing.json" else f"synapse-client: {path} is not a compendium (5 error(s))"
    )
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("value", [-1, -0.5, float("-inf"), float("nan"), True, "1", None])
def test_a_round_mask_strength_no_masking_can_use_is_the_default(value):
    """A round's mask_strength that is no masking strength (negative, not a number) is as if it
    named none: participate masked at it, and a negative one was masking's ValueError traceback
    in the middle of the build. A round that names none expects the default λ, at which the
    server checks its text (it read "none" as no λ at all, and the client checked nothing)."""
    from compendium.client_api import round_mask_strength, weaker_masking
    from compendium.masking import DEFAULT_MASK_STRENGTH

    info = {"number": 5, "config": {"mask_strength": value}}
    assert round_mask_strength(info) == DEFAULT_MASK_STRENGTH == 1.0
    assert round_mask_strength({"number": 5, "config": {}}) == DEFAULT_MASK_STRENGTH
    assert weaker_masking(info, None) == "round 5 expects masking strength λ >= 1"
    assert weaker_masking(info, DEFAULT_MASK_STRENGTH) is None


def test_a_400_to_a_submission_that_is_not_json_says_it_was_refused():
    """A proxy's 400 page (a body too large for it, a header it refuses): the error said only
    that the answer is not JSON, not that the submission was refused, nor the page's words."""
    import httpx

    from compendium.schema import Compendium, MaskingInfo, Scenario

    def server(request):
        if request.url.path == "/api/v1/rounds/":  # λ = 1 by default: the schema is read
            return httpx.Response(200, json={"results": [{"number": 4, "config": {}}]})
        if request.url.path == "/api/v1/compendium/schema/":
            return httpx.Response(200, json={"tools": [{"tool_id": "weather",
                                                        "description": "Weather"}]})
        return httpx.Response(400, content=b"400 Bad Request: request header too large\n<hr>")

    compendium = Compendium(scenarios=[Scenario(tool_id="weather", text="rain in a city?")],
                            masking=MaskingInfo(strength=1.0, masked_fraction=0.2))
    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError) as refused:
        client.submit(compendium)
    assert str(refused.value) == ("the submission was refused (HTTP 400), by an answer that is not "
                                  "the SYNAPSE API's: 400 Bad Request: request header too large")


def test_a_304_to_a_pull_that_asked_nothing_conditional_is_not_up_to_date(tmp_path):
    """A 304 (a proxy's cache) when this client holds no copy to keep: pull said
    "up to date (ETag None)" with no global saved, and build --since then found no file."""
    import httpx

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(lambda request: httpx.Response(304)))
    out = tmp_path / "global.json"
    with pytest.raises(ClientError, match=r"answered 304 \(not modified\) though this client "
                                          r"holds no copy of the global compendium"):
        client.pull(out)
    assert not out.exists()


@pytest.mark.parametrize("field", ["strength", "calls"])
@pytest.mark.parametrize("command", ["inspect", "submit"])
def test_a_compendium_with_a_number_past_a_float_is_one_clear_error(tmp_path, capsys, field,
                                                                     command):
    """1e999 reads as infinity, which the canonical form (what inspect shows, what submit sends
    and keys) cannot write: a ValueError traceback before, and nothing sent."""
    text = ('{"masking": {"strength": %s, "masked_fraction": 0.2}, "metadata": [{"tool_id": '
            '"weather", "stats": {"calls": %s}}]}')
    path = tmp_path / "c.json"
    path.write_text(text % (("1e999", "1.0") if field == "strength" else ("1.0", "1e999")), "utf-8")
    args = [command, str(path)] + (["--server", NOWHERE, "--token", TOKEN, "--retries", "0"]
                                   if command == "submit" else [])
    assert main(args) == 1
    where = "$.masking.strength" if field == "strength" else "$.metadata[0].stats.calls"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{path}: {where}: number is not finite",
        f"synapse-client: {path} is not a compendium (1 error(s))",
    ]


def test_a_pulled_global_with_a_number_past_a_float_is_one_clear_error(tmp_path):
    import httpx

    def server(request):
        return httpx.Response(200, content=b'{"round": 3, "compendium": {"metadata": [{"tool_id": '
                              b'"weather", "stats": {"calls": 1e999}}]}}')

    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    with pytest.raises(ClientError, match="the server sent a compendium this client cannot read: "
                                          "it holds a number that is not finite"):
        client.pull(tmp_path / "global.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("server", ["HTTPS://synapse.example", "Http://127.0.0.1:9"])
def test_a_server_url_whose_scheme_is_in_capitals_is_an_http_url(server):
    """URL schemes are case-insensitive (RFC 3986): "HTTPS://..." was refused as "must be an
    http(s) URL"."""
    client = SynapseClient(server, TOKEN)
    assert client._http.base_url.scheme in ("http", "https")
    client.close()


@pytest.mark.parametrize("where", ["texts", "tools"])
def test_a_probe_set_holding_a_lone_surrogate_is_one_clear_error(tmp_path, where):
    """A lone surrogate in the probe set's tools (which its sha256 does not cover) was a
    UnicodeEncodeError traceback as the file was saved; in its texts, Python's codec message."""
    import httpx

    from compendium import transport

    texts = ["\ud800"] if where == "texts" else ["a"]
    sha256 = transport.dictionary_hash(transport.probe_bytes(["a"]))
    body = json.dumps({"texts": texts, "sha256": sha256, "tools": ["\ud800"]})  # escaped
    client = SynapseClient("http://server.test", TOKEN, retries=0, transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=body.encode())))
    with pytest.raises(ClientError) as refused:
        client.fetch_probe(tmp_path / "probe.json")
    assert str(refused.value) == ("the server sent a probe set this client cannot read: it holds "
                                  "a lone surrogate (half of an escaped character), which is not "
                                  "text")
    assert list(tmp_path.iterdir()) == []


def test_a_head_that_cannot_be_written_only_warns_and_the_pull_succeeds(tmp_path, monkeypatch):
    """_pull_head's contract: a failure there only warns (the router fits a head of its own).
    A head that downloaded but could not be written (no space left) failed the whole pull,
    after the global itself was saved."""
    import httpx
    import numpy as np

    from compendium import client_api
    from compendium.schema import Compendium
    from routing.router import LinearHead

    head = LinearHead(["a", "b"], np.ones((2, 3), "float32"), np.zeros(2, "float32")).to_bytes()

    def server(request):
        if request.url.path == "/api/v1/compendium/global/":
            body = {"round": 1, "compendium": Compendium.model_validate(
                {"scenarios": [{"tool_id": "a", "text": "what round 1 learnt"}]}
            ).model_dump(mode="json")}
            return httpx.Response(200, json=body)
        if request.url.path == "/api/v1/compendium/schema/":
            return httpx.Response(200, json={"tools": [{"tool_id": "a", "description": "A"}]})
        return httpx.Response(200, content=head)

    written = client_api.write_atomically

    def no_space_for_heads(path, data):
        if path.name.endswith(".head.npz"):
            raise client_api.CannotWrite(path, OSError(28, "No space left on device"))
        written(path, data)

    monkeypatch.setattr(client_api, "write_atomically", no_space_for_heads)
    client = SynapseClient("http://server.test", TOKEN, retries=0,
                           transport=httpx.MockTransport(server))
    out = tmp_path / "global.json"
    result = client.pull(out)
    assert result.updated and out.exists() and result.head is None
    assert result.warnings == [
        f"the routing head was not saved: cannot write {out}.head.npz: No space left on device"
    ]


def test_participate_with_a_dir_that_is_a_file_says_so(tmp_path, capsys):
    """mkdir's "File exists" read as if the folder existed, which is fine; what is wrong is that
    --dir names a file. Said before any request."""
    log = tmp_path / "usage.jsonl"
    log.write_text("", "utf-8")
    assert main(["participate", "--log", str(log), "--dir", str(log), "--server", NOWHERE,
                 "--token", TOKEN]) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: --dir {log} is a file, not a folder"
    )


@pytest.mark.parametrize("name", ["schema.json", "global.json", "probe.json", "sent.json",
                                  "compendium.json"])
def test_participate_refuses_a_log_it_would_overwrite_in_its_dir(tmp_path, capsys, name):
    """participate --log state/schema.json (or global.json, probe.json, sent.json) downloaded
    the server's file over the usage log (build refused only its own --out). Said before any
    request, with the log left as it was."""
    folder = tmp_path / "state"
    folder.mkdir()
    log = folder / name
    log.write_text('{"query": "q", "tool": "t"}\n', "utf-8")
    assert main(["participate", "--log", str(log), "--dir", str(folder), "--server", NOWHERE,
                 "--token", TOKEN]) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: --log {log} is {log}, a file participate writes in --dir: keep the "
        "usage log outside --dir or under another name; nothing built or sent"
    )
    assert log.read_text("utf-8") == '{"query": "q", "tool": "t"}\n'


@pytest.mark.parametrize("encoding", ["ascii", "cp1252"])
def test_output_to_a_stream_that_is_not_utf8_is_escaped_not_a_traceback(tmp_path, monkeypatch,
                                                                       encoding):
    """stdout redirected to a file on Windows is cp1252 (a latin-1 locale elsewhere): the λ of
    every report, and the users' text inspect shows, were a UnicodeEncodeError traceback."""
    import io
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    path = tmp_path / "c.json"
    path.write_text('{"masking": {"strength": 1.0, "masked_fraction": 0.2}, "scenarios": '
                    '[{"tool_id": "weather", "text": "天气 in a city"}]}', "utf-8")
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["validate", str(path), "--schema", str(schema)]) == 0
    assert main(["inspect", str(path)]) == 0
    out.flush()
    text = out.buffer.getvalue().decode(encoding)
    assert "masked at \\u03bb = 1 as far as the server checks" in text
    assert "\\u5929\\u6c14 in a city" in text
    fresh = io.TextIOWrapper(io.BytesIO(), encoding=encoding)  # --help, before any command
    monkeypatch.setattr(sys, "stdout", fresh)
    with pytest.raises(SystemExit) as helped:
        main(["build", "--help"])
    assert helped.value.code == 0
    fresh.flush()
    assert "masking strength \\u03bb >= 0" in fresh.buffer.getvalue().decode(encoding)


@pytest.mark.parametrize(
    "page, said",
    [("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>nginx</body></html>",
      "HTTP 502: 502 Bad Gateway"),
     ("<!DOCTYPE html>\n<html><body>down</body></html>", "HTTP 502: Bad Gateway")],
)
def test_a_proxys_html_error_page_is_named_by_its_title_not_its_first_tag(page, said):
    """nginx's 502 page: the error said "HTTP 502: <html>", its first line."""
    import httpx

    client = SynapseClient("http://server.test", TOKEN, retries=0, transport=httpx.MockTransport(
        lambda request: httpx.Response(502, content=page.encode(),
                                       headers={"Content-Type": "text/html"})))
    with pytest.raises(ClientError) as failed:
        client.rounds("open")
    assert str(failed.value).endswith(f"failed after 1 attempt(s): {said}")


def test_a_file_written_again_keeps_its_mode_and_a_new_one_is_the_owners(tmp_path):
    """write_atomically renames a fresh mkstemp file over the old one: every pull made the file
    0600 whatever its owner had set, so a global.json opened to the account an LLM runs as was
    unreadable to it after each pull. A replaced file keeps its mode; a new one is 0600."""
    import stat

    from compendium import client_api

    target = tmp_path / "global.json"
    client_api.write_atomically(target, b"{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    target.chmod(0o644)
    client_api.write_atomically(target, b'{"a": 1}')
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.read_bytes() == b'{"a": 1}'


def test_a_params_file_nested_too_deeply_is_one_clear_line_not_a_recursion_error(
    tmp_path, settings, caplog
):
    """`route --params` with such a file was a RecursionError traceback; the server's
    SYNAPSE_ROUTING_PARAMS, read for every routing request, a 500 on each."""
    deep = tmp_path / "params.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    said = f"{deep} is not a routing parameters file: it nests too deeply"
    with pytest.raises(RoutingParamsError, match=said):
        RoutingParams.load(deep)
    with pytest.raises(SystemExit) as exit_:
        main(["route", "weather?", "--compendium", str(tmp_path / "g.json"), "--params", str(deep)])
    assert str(exit_.value.code) == f"synapse-client: --params: {said}"
    settings.SYNAPSE_ROUTING_PARAMS = str(deep)
    with caplog.at_level(logging.WARNING, logger="routing.services"):
        assert services.routing_params() == RoutingParams.load()  # the defaults, said in the log
    assert said in caplog.text


BOM = b"\xef\xbb\xbf"  # what Notepad and PowerShell 5's Out-File write first


def test_json_files_saved_with_a_byte_order_mark_are_read(tmp_path, capsys):
    """A schema, compendium, pulled global, probe set or routing parameters file saved by a
    Windows editor starts with a UTF-8 byte-order mark: the client said "Invalid JSON: expected
    value at line 1 column 1" (or "Unexpected UTF-8 BOM"); it reads them as the editor shows them,
    as it reads a usage log."""
    from compendium.client_cli import _load_probe, _load_pulled
    from compendium.schema import Compendium, Scenario
    from routing.cli import _load_compendium as _load_global

    schema = tmp_path / "schema.json"
    schema.write_bytes(BOM + b'{"tools": [{"tool_id": "weather", "description": "Weather"}]}')
    compendium = Compendium(scenarios=[Scenario(tool_id="weather", text="Will it rain?")])
    saved = tmp_path / "c.json"
    saved.write_bytes(BOM + compendium.model_dump_json().encode())
    assert main(["inspect", str(saved), "--schema", str(schema)]) == 0
    assert main(["validate", str(saved), "--schema", str(schema)]) == 0, capsys.readouterr().err
    pulled = tmp_path / "global.json"
    pulled.write_bytes(BOM + json.dumps({"round": 2, "compendium": compendium.model_dump()}).encode())
    assert _load_pulled(str(pulled)).scenarios == compendium.scenarios
    assert _load_global(str(pulled)).scenarios == compendium.scenarios
    probe = tmp_path / "probe.json"
    from compendium import transport

    texts = ["Will it rain?"]
    sha256 = transport.dictionary_hash(transport.probe_bytes(texts))
    probe.write_bytes(BOM + json.dumps({"count": 1, "sha256": sha256, "texts": texts,
                                        "tools": ["weather"]}).encode())
    assert _load_probe(str(probe)) == ["Will it rain?"]
    params = tmp_path / "params.json"
    params.write_bytes(BOM + RoutingParams(top_k=7).to_json().encode())
    assert RoutingParams.load(params).top_k == 7


def test_an_out_that_is_a_pipe_or_device_is_refused_and_left_as_it_is(tmp_path, capsys):
    """The client writes a temporary file and renames it over its --out: over a pipe or a device
    that put a regular file in its place (`--out /dev/null`, run as root, replaced /dev/null for
    the whole machine). Refused, in one line, with the pipe left as it was; a link to one too."""
    import os
    import stat

    from compendium.client_api import CannotWrite, write_atomically

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    for path in (fifo, link):
        with pytest.raises(CannotWrite, match=f"cannot write {path}: it is a pipe .FIFO., not a "
                                              "regular file"):
            write_atomically(path, b"{}")
    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}]}', "utf-8")
    log = tmp_path / "usage.jsonl"
    log.write_text(json.dumps({"query": "Will it rain in a city?", "user": "u1", "tool": "weather",
                               "outcome": "success", "latency_ms": 40}) + "\n", "utf-8")
    capsys.readouterr()
    assert main(["build", "--log", str(log), "--schema", str(schema), "--out", str(link),
                 "--no-collapse", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"synapse-client: cannot write {link}: it is a pipe (FIFO), not a regular file, "
                   "and the file written would replace it; name a file"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "schema.json",
                                                         "usage.jsonl"]


@pytest.mark.parametrize(
    "server, in_clear",
    [
        ("http://synapse.example", True), ("HTTP://10.0.0.7:8000", True),
        ("http://[2001:db8::1]:8000", True), ("http://localhost.example", True),
        ("http://localhost:8000", False), ("http://LOCALHOST", False),
        ("http://127.0.0.1:8000", False), ("http://[::1]:8000", False),
        ("https://synapse.example", False), ("https://10.0.0.7", False),
    ],
)
def test_a_token_sent_over_plain_http_to_another_machine_is_named(server, in_clear):
    with SynapseClient(server, TOKEN) as client:
        assert client.in_clear is in_clear


def test_the_cli_warns_once_when_the_token_goes_unencrypted_but_does_not_refuse(capsys):
    """An http:// --server other than this machine sent the bearer token (and the compendium)
    unencrypted without a word. One warning line on stderr, then the command runs as before
    (here: a documentation address nothing answers, so it fails to connect)."""
    import compendium.client_cli as cli

    server = "http://192.0.2.1:9"  # TEST-NET-1: never routed
    args = cli.build_parser().parse_args(["status", "--server", "http://192.0.2.2:9",
                                          "--token", TOKEN])
    for _ in range(2):  # participate and pull --router make a client twice: said once
        cli._client(args).close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "synapse-client: warning: --server http://192.0.2.2:9 is plain http:// to another "
        "machine: the API token and everything sent cross the network unencrypted; use https://"
    ]
    assert main(["status", "--server", server, "--token", TOKEN, "--retries", "0",
                 "--timeout", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(f"synapse-client: warning: --server {server} is ")
    assert err[1].startswith("synapse-client: GET ")
    assert main(["status", "--server", "http://127.0.0.1:9", "--token", TOKEN, "--retries", "0",
                 "--timeout", "1"]) == 1
    assert "warning" not in capsys.readouterr().err


def test_json_files_with_a_key_given_twice_are_refused_naming_the_file_and_the_key(tmp_path, capsys):
    """Found by audit: the README says a key given twice in one object is refused in every JSON
    file synapse-client reads, as the API refuses such a body; only `validate` refused it. A
    schema with a tool's `tool_id` twice was read with the last one, and `inspect` and `submit`
    read a compendium's scenario `{"tool_id": "weather", ..., "tool_id": "flights"}` as a
    scenario of flights, and sent it so (the body sent has one key: the server never saw the
    doubt). A pulled global, a probe set and a routing parameters file too."""
    from compendium.client_cli import CliError, _load_probe, _load_pulled
    from routing.cli import _load_compendium as _load_global

    schema = tmp_path / "schema.json"
    schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}, '
                      '{"tool_id": "flights", "description": "Flights", "tool_id": "calc"}]}')
    good_schema = tmp_path / "good-schema.json"
    good_schema.write_text('{"tools": [{"tool_id": "weather", "description": "Weather"}, '
                           '{"tool_id": "flights", "description": "Flights"}]}')
    scenario = '{"tool_id": "weather", "text": "Will it rain?", "tool_id": "flights"}'
    twice = tmp_path / "c.json"
    twice.write_text('{"scenarios": [' + scenario + "]}")
    capsys.readouterr()
    assert main(["validate", str(twice), "--schema", str(good_schema)]) == 1
    assert main(["inspect", str(twice)]) == 1
    assert main(["submit", str(twice), "--server", NOWHERE, "--token", TOKEN]) == 1
    good = tmp_path / "ok.json"
    good.write_text('{"scenarios": [{"tool_id": "weather", "text": "Will it rain?"}]}')
    assert main(["inspect", str(good), "--schema", str(good_schema)]) == 0
    assert main(["inspect", str(good), "--schema", str(schema)]) == 1
    err = capsys.readouterr().err
    assert err.count('duplicate key "tool_id" in one object') == 4, err
    assert f"{schema}: " in err and f"{twice}: " in err
    pulled = tmp_path / "global.json"
    pulled.write_text('{"round": 2, "compendium": {"scenarios": [' + scenario + "]}}")
    with pytest.raises(CliError, match='duplicate key "tool_id"'):
        _load_pulled(str(pulled))
    with pytest.raises(SystemExit, match=f'{pulled}.*duplicate key "tool_id"'):
        _load_global(str(pulled))
    probe = tmp_path / "probe.json"
    probe.write_text('{"count": 1, "texts": ["a"], "texts": ["b"]}')
    with pytest.raises(CliError, match=f'{probe}.*duplicate key "texts"'):
        _load_probe(str(probe))
    params = tmp_path / "params.json"
    params.write_text('{"top_k": 7, "weights": {}, "top_k": 3}')
    with pytest.raises(RoutingParamsError, match=f'{params}.*duplicate key "top_k"'):
        RoutingParams.load(params)


@pytest.mark.parametrize(
    "call, failure",
    [(lambda client, tmp: client.rounds("open"), "cannot list rounds"),
     (lambda client, tmp: client.submissions(1), "cannot list this client's submissions"),
     (lambda client, tmp: client.schema(), "cannot download the schema"),
     (lambda client, tmp: client.fetch_probe(tmp / "probe.json"), "cannot download the probe set")],
)
def test_a_404_page_that_is_not_the_apis_says_to_check_the_server_on_every_request(
    tmp_path, call, failure
):
    """A --server with a path the SYNAPSE server does not serve (https://host/synapse when the
    API is at https://host/api/v1/) answers the server's own HTML 404 page. `pull` said to check
    --server; `status`, `submit` and `participate`, which start with the round list, said
    "cannot list rounds (HTTP 404): SYNAPSE · SYNAPSE", the page's title, and nothing more."""
    import httpx

    page = b"<!DOCTYPE html><html><head><title>SYNAPSE \xc2\xb7 SYNAPSE</title></head></html>"
    client = SynapseClient("http://server.test/synapse", TOKEN, retries=0,
                           transport=httpx.MockTransport(lambda request: httpx.Response(
                               404, headers={"Content-Type": "text/html"}, content=page)))
    with pytest.raises(ClientError) as failed:
        call(client, tmp_path)
    said = str(failed.value)
    assert said.startswith(f"{failure}: HTTP 404 from http://server.test/synapse, not an answer "
                           "of the SYNAPSE API"), said
    assert said.endswith("check --server"), said
    assert not (tmp_path / "probe.json").exists()


@pytest.mark.django_db(transaction=True)
def test_the_cli_names_a_server_path_that_is_not_the_api(live_server, world, capsys, settings):
    """Against the real server, with a --server path it does not serve: one line that says to
    check --server, and the server's 404 page is named for what it is."""
    settings.DEBUG = False
    assert main(["status", "--server", live_server.url + "/synapse", "--token", world.token_a,
                 "--retries", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot list rounds: HTTP 404" in err and "not an answer of the SYNAPSE API" in err
    assert "(Not found · SYNAPSE)" in err and err.rstrip().endswith("check --server")


@pytest.mark.parametrize("status", [200, 400, 404])
def test_an_answer_nested_too_deeply_is_a_client_error_not_a_recursion_error(tmp_path, status):
    """An answer (of a proxy, or a server that is not SYNAPSE, at --server) nested deeper than
    Python's json reads was a RecursionError traceback of status, pull and fetch-probe, where an
    answer that is not JSON at all is one clear line."""
    import httpx

    def deep(request):
        return httpx.Response(status, headers={"Content-Type": "application/json"},
                              content=b"[" * 100_000)

    client = SynapseClient("http://server.test", "syn_c_token", retries=0,
                           transport=httpx.MockTransport(deep))
    with pytest.raises(ClientError):
        client.rounds()
    with pytest.raises(ClientError):
        client.fetch_probe(tmp_path / "probe.json")
