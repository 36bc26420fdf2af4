"""Bad input a client developer can give `synapse-client` and the routing API: each is one clear
line naming what is wrong (exit status 1, or a 400), never a traceback or a 500, and nothing is
sent or loaded before it is found."""

from __future__ import annotations

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
    [("http://[::1", "is not a valid URL"), ("http://", "names no host"), ("https:///x", "names no host")],
)
def test_a_server_url_httpx_cannot_use_is_one_clear_error(server, reason):
    with pytest.raises(ClientError, match=reason):
        SynapseClient(server, TOKEN)


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
        ("--retries", "-1", "--retries must be 0 or more, not -1"),
        ("--backoff", "-1", "--backoff must be 0 or more seconds, not -1"),
    ],
)
def test_bad_network_options_are_refused_before_any_request(capsys, flag, value, message):
    code = main(["status", "--server", NOWHERE, "--token", TOKEN, flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"synapse-client: {message}"]


@pytest.mark.parametrize("server", ["http://[::1", "http://"])
def test_the_cli_reports_a_bad_server_url_in_one_line(capsys, server):
    assert main(["status", "--server", server, "--token", TOKEN]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("synapse-client: --server ")


def test_the_cli_reports_a_non_ascii_token_in_one_line(capsys):
    assert main(["status", "--server", NOWHERE, "--token", "syn_c_é"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "check --token or SYNAPSE_TOKEN" in err[0]


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
