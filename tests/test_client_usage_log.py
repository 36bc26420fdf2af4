"""The usage log: every malformed line is reported with its line number; nothing is dropped
silently."""

from __future__ import annotations

import json

import pytest

from compendium.builder import BuildOptions, build_from_log
from compendium.client_cli import main
from compendium.usage_log import UsageLogError, parse_lines, read_usage_log
from tests.client_fixtures import metatool_schema, usage_records, write_log

GOOD = {"query": "weather in a city", "tool": "weather", "outcome": "success", "latency_ms": 12,
        "user": "u1"}


def line(**changes) -> str:
    item = {**GOOD, **changes}
    return json.dumps({k: v for k, v in item.items() if v is not None})


def test_every_bad_line_is_reported_with_its_number():
    lines = [
        line(),  # 1 ok
        '{"query": "broken", ',  # 2 not JSON
        "",  # 3 blank: skipped, not an error
        line(user=None),  # 4 user missing
        line(outcome="maybe"),  # 5 bad outcome
        line(outcome="corrected"),  # 6 corrected without corrected_to
        line(tool="teleporter"),  # 7 unknown tool
        line(latency_ms=-3),  # 8 negative latency
        line(preconditions={"has city": True}),  # 9 flag not an identifier
        "[1, 2]",  # 10 not an object
        line(outcome="corrected", corrected_to="flights"),  # 11 ok
        line(latency_ms=True),  # 12 bool is not a number
        line(corrected_to="flights"),  # 13 corrected_to without correction
    ]
    log = parse_lines(lines, source="usage.jsonl", known_tools={"weather", "flights"})
    assert [r.line for r in log.records] == [1, 11]
    errors = {e.line: e.message for e in log.errors}
    assert sorted(errors) == [2, 4, 5, 6, 7, 8, 9, 10, 12, 13]
    assert "not valid JSON" in errors[2]
    assert "'user' is missing" in errors[4]
    assert "'outcome' must be one of" in errors[5]
    assert "'corrected_to' is missing" in errors[6]
    assert "'teleporter' is not a tool" in errors[7]
    assert ">= 0" in errors[8]
    assert "not an identifier" in errors[9]
    assert "expected a JSON object" in errors[10]
    assert "must be a number" in errors[12]
    assert "only allowed when" in errors[13]
    assert log.error_lines()[0].startswith("usage.jsonl:2: ")


def test_an_unknown_tool_names_the_registry_ids_it_is_closest_to():
    lines = [line(tool="Weather"), line(tool="flight"), line(tool="teleporter"),
             line(outcome="corrected", corrected_to="fligths")]
    log = parse_lines(lines, source="usage.jsonl", known_tools={"weather", "flights", "hotels"})
    errors = {e.line: e.message for e in log.errors}
    assert errors[1].endswith("'Weather' is not a tool of the schema's registry (did you mean 'weather'?)")
    assert errors[2].endswith("(did you mean 'flights'?)")
    assert errors[3].endswith("'teleporter' is not a tool of the schema's registry")
    assert errors[4].endswith("'fligths' is not a tool of the schema's registry (did you mean 'flights'?)")


def test_invalid_utf8_line_is_reported(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_bytes(line().encode() + b"\n" + b'{"query": "\xff\xfe"}\n' + line().encode() + b"\n")
    log = read_usage_log(path)
    assert [e.line for e in log.errors] == [2]
    assert "UTF-8" in log.errors[0].message
    assert len(log.records) == 2


def test_a_byte_order_mark_before_the_first_line_is_not_an_error(tmp_path):
    # Windows tools write one (PowerShell 5's Out-File -Encoding UTF8, Notepad); line 1 was
    # "not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)".
    path = tmp_path / "usage.jsonl"
    path.write_bytes(("\n".join([line(), line(user="u2")]) + "\n").encode("utf-8-sig"))
    log = read_usage_log(path)
    assert log.errors == [] and [r.user for r in log.records] == ["u1", "u2"]
    # only as the file's first bytes: elsewhere it is a character the line should not start with
    path.write_bytes((line() + "\n\ufeff" + line() + "\n").encode("utf-8"))
    assert [e.line for e in read_usage_log(path).errors] == [2]


def test_build_fails_on_bad_lines_unless_asked_to_skip(tmp_path):
    records = usage_records(users=3, lines=40)
    path = write_log(tmp_path / "usage.jsonl", records, {3: "{oops", 9: '{"query": 5}'})
    schema = metatool_schema()
    with pytest.raises(UsageLogError) as caught:
        build_from_log(str(path), schema, BuildOptions(collapse=False))
    assert [e.line for e in caught.value.log.errors] == [3, 9]
    assert f"{path}:3:" in str(caught.value)

    compendium, report = build_from_log(
        str(path), schema, BuildOptions(collapse=False, skip_bad_lines=True)
    )
    assert report.records == 40
    assert [b.split(": ")[0] for b in report.bad_lines] == [f"{path}:3", f"{path}:9"]
    assert compendium.num_users == 3


def test_cli_reports_bad_line_numbers_and_exits_non_zero(tmp_path, capsys):
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    log = write_log(tmp_path / "usage.jsonl", usage_records(users=2, lines=20), {5: "not json"})
    out = tmp_path / "c.json"
    args = ["build", "--log", str(log), "--schema", str(schema_path), "--out", str(out),
            "--no-collapse", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{log}:5: not valid JSON" in err
    assert "--skip-bad-lines" in err.strip().splitlines()[-1]
    assert not out.exists()

    assert main(args + ["--skip-bad-lines"]) == 0
    captured = capsys.readouterr()
    assert f"{log}:5: not valid JSON" in captured.err
    assert "skipped 1 malformed line(s) of 21" in captured.err
    report = json.loads((tmp_path / "c.json.report.json").read_text())
    assert report["bad_lines"] == [f"{log}:5: not valid JSON: Expecting value (column 1)"]
    assert report["records"] == 20


def test_huge_numbers_and_lone_surrogates_are_bad_lines_not_a_crash():
    """A number too large for a float or for Python to read, and half an escaped emoji in a text,
    are each reported as the line's error (build then stops, or skips them), never a traceback."""
    good = b'{"query":"q","tool":"t","outcome":"success","latency_ms":1,"user":"u"}'
    lines = [
        b'{"query":"q","tool":"t","outcome":"success","latency_ms":1' + b"0" * 400 + b',"user":"u"}',
        b'{"query":"q","tool":"t","outcome":"success","latency_ms":1,"user":' + b"1" * 5000 + b"}",
        b'{"query":"q","tool":"t","outcome":"success","latency_ms":1,"user":"anna\\ud83d"}',
        b'{"query":"rain in Oslo\\udc00","tool":"t","outcome":"success","latency_ms":1,"user":"u"}',
        good,
    ]
    log = parse_lines(lines)
    assert len(log.records) == 1
    messages = {e.line: e.message for e in log.errors}
    assert set(messages) == {1, 2, 3, 4}
    assert "finite number" in messages[1] and "(401 digits)" in messages[1] and len(messages[1]) < 120
    assert "more than 4,300 digits" in messages[2]
    assert "'user' holds a lone surrogate" in messages[3]
    assert "'query' holds a lone surrogate at character 12" in messages[4]


def test_an_overlong_line_is_reported_without_reading_it_into_memory(tmp_path):
    """A line over the 1 MB limit is reported with its length and skipped to its newline a chunk
    at a time: the lines after it are read, and memory never holds the whole line."""
    import tracemalloc

    from compendium.usage_log import MAX_LINE_BYTES

    path = tmp_path / "usage.jsonl"
    big = b'{"query": "' + b"x" * (5 * MAX_LINE_BYTES) + b'"}\n'  # 5 MB and its newline
    with path.open("wb") as handle:
        handle.write(line().encode() + b"\n")
        handle.write(big)
        handle.write(line(user="u2").encode() + b"\n")
        handle.write(b"y" * (2 * MAX_LINE_BYTES))  # the last line, without a newline
    tracemalloc.start()
    try:
        log = read_usage_log(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.user for r in log.records] == ["u1", "u2"]
    assert [(e.line, e.message) for e in log.errors] == [
        (2, f"line is {len(big)} bytes; the limit is {MAX_LINE_BYTES}"),
        (4, f"line is {2 * MAX_LINE_BYTES} bytes; the limit is {MAX_LINE_BYTES}"),
    ]
    del big
    assert peak < 3 * MAX_LINE_BYTES  # a line and a chunk at most, never the 5 MB line


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_log_is_one_clear_error_not_one_per_line(tmp_path, capsys, encoding):
    """Windows PowerShell 5.1 writes UTF-16 (with a byte order mark) with `>` and Out-File: one
    error saying so and how to save it as UTF-8, for the whole file."""
    from compendium.usage_log import NotUtf8Log

    path = tmp_path / "usage.jsonl"
    path.write_bytes(("\n".join([line(), line(user="u2")]) + "\n").encode(encoding))
    with pytest.raises(NotUtf8Log, match="UTF-16"):
        read_usage_log(path)
    schema = tmp_path / "schema.json"
    schema.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    assert main(["build", "--log", str(path), "--schema", str(schema), "--out",
                 str(tmp_path / "c.json"), "--no-collapse", "--quiet", "--skip-bad-lines"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"synapse-client: {path} is UTF-16, not UTF-8; save it as UTF-8 (e.g. Out-File "
        "-Encoding utf8) and build again"
    )
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "kind, message",
    [("gzip", "is gzip-compressed, not UTF-8 text; decompress it (gunzip) and build again"),
     ("binary", "is not a text file (it holds NUL bytes): a usage log is UTF-8 text, one JSON "
                "object a line")],
)
def test_a_compressed_or_binary_log_is_not_called_utf16(tmp_path, capsys, kind, message):
    """Any NUL byte on line 1 was taken for UTF-16: a gzip-compressed log (usage.jsonl.gz) or
    another binary file was told to be saved as UTF-8 with PowerShell's Out-File."""
    import gzip

    from compendium.usage_log import NotUtf8Log

    text = ("\n".join([line(), line(user="u2")]) + "\n").encode()
    path = tmp_path / "usage.jsonl.gz"
    path.write_bytes(gzip.compress(text) if kind == "gzip" else b"\x07\x00\x00\x01\xff\x00" * 40)
    with pytest.raises(NotUtf8Log, match="not"):
        read_usage_log(path)
    # UTF-16 without a byte order mark whose characters put a NUL in the other byte too (一 is
    # U+4E00): still UTF-16, not a binary file
    chinese = tmp_path / "chinese.jsonl"
    for query in ("一天的天气 in a city", "一天的天气" * 100):  # mostly not ASCII: few NULs
        for encoding in ("utf-16-le", "utf-16-be"):
            chinese.write_bytes((json.dumps({**GOOD, "query": query}, ensure_ascii=False)
                                 + "\n").encode(encoding))
            with pytest.raises(NotUtf8Log, match="is UTF-16, not UTF-8"):
                read_usage_log(chinese)
    schema = tmp_path / "schema.json"
    schema.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    assert main(["build", "--log", str(path), "--schema", str(schema), "--out",
                 str(tmp_path / "c.json"), "--no-collapse", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == f"synapse-client: {path} {message}"
    assert not (tmp_path / "c.json").exists()


def test_a_huge_value_is_shown_cut_in_its_error_line():
    """A bad line's error quotes what is wrong, not the whole of it: an unknown tool, outcome or
    flag name of half a megabyte was echoed whole, a 500 kB error line on the terminal and in
    the build report."""
    big = "x" * 500_000
    lines = [line(tool=big), line(outcome=big), line(preconditions={big: True}),
             line(outcome="corrected", corrected_to=big)]
    log = parse_lines(lines, known_tools=["weather", "flights"])
    assert [e.line for e in log.errors] == [1, 2, 3, 4]
    for error in log.errors:
        assert len(error.message) < 200
        assert "… (500000 characters)" in error.message
    assert log.errors[0].message == (f"'tool' '{'x' * 40}'… (500000 characters) is not a tool "
                                     "of the schema's registry")


@pytest.mark.parametrize(
    "changes, message",
    [({"outcome": "corrected", "corrected_to": None}, "'corrected_to' is null, not a string"),
     ({"tool": 5}, "'tool' is a number, not a string"),
     ({"query": ["a"]}, "'query' is an array, not a string"),
     ({"query": {"a": 1}}, "'query' is an object, not a string"),
     ({"query": False}, "'query' is true or false, not a string"),
     ({"template": {"signature": 2.5, "template": "t"}}, "'signature' is a number, not a string")],
)
def test_a_value_of_the_wrong_type_is_named_by_its_json_type(changes, message):
    """A JSON null was "a NoneType", a list "a list", 5 "a int": Python's names, not what the
    line holds."""
    item = {**GOOD, **changes}
    log = parse_lines([json.dumps(item)], known_tools=["weather", "flights"])
    assert [e.message for e in log.errors] == [message]


def test_a_line_that_is_no_object_is_named_by_its_json_type():
    log = parse_lines(["[1, 2]", "7", '"text"', "null"])
    assert [e.message for e in log.errors] == [
        f"expected a JSON object, got {kind}" for kind in ("an array", "a number", "a string",
                                                             "null")
    ]


def test_a_flag_name_holding_personal_data_is_an_error_of_its_line(tmp_path, capsys):
    """Flag names leave the client as written (neither masked nor scrubbed): a phone number, a
    card, an account number or a spelled-out e-mail address as a flag name left it whole and was
    published to every organization. The reader refuses it as an error of its line, naming the
    flag; condition names with digits, dots or colons stay."""
    from tests.test_scrub import ORDINARY_FLAGS

    lines = [
        line(preconditions={"has_city": True, "555-123-4567": True}),  # 1
        line(preconditions=dict.fromkeys(ORDINARY_FLAGS[:32], True)),  # 2 ok
        line(preconditions={"card_4111_1111_1111_1111": False}),  # 3
        line(preconditions={"john_at_example_dot_com": True}),  # 4
        line(preconditions={"acct_12345678": True}),  # 5
        line(preconditions={"john.smith@x": True}),  # 6 not an identifier at all
        line(preconditions=dict.fromkeys(ORDINARY_FLAGS[32:], True)),  # 7 ok
    ]
    log = parse_lines(lines, source="usage.jsonl", known_tools={"weather", "flights"})
    assert [r.line for r in log.records] == [2, 7]
    errors = {e.line: e.message for e in log.errors}
    assert errors[1] == ("precondition flag '555-123-4567' holds 1 phone number: a flag names "
                         "a condition (has_city), never a person, an account or a contact; "
                         "rename it")
    assert errors[3].startswith("precondition flag 'card_4111_1111_1111_1111' holds 1 card number")
    assert errors[4].startswith(
        "precondition flag 'john_at_example_dot_com' holds 1 e-mail address")
    assert errors[5].startswith("precondition flag 'acct_12345678' holds 1 long number")
    assert "not an identifier" in errors[6]

    # build stops on it, naming file, line and flag (nothing is written)
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(metatool_schema().model_dump_json(), encoding="utf-8")
    records = usage_records(users=2, lines=10)
    records[3]["preconditions"] = {"tel:5551234567": True}
    path = write_log(tmp_path / "usage.jsonl", records)
    out = tmp_path / "c.json"
    assert main(["build", "--log", str(path), "--schema", str(schema_path), "--out", str(out),
                 "--no-collapse", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4: precondition flag 'tel:5551234567' holds 1 long number" in err
    assert not out.exists()


def test_a_key_given_twice_on_a_line_is_an_error_of_that_line():
    """`{"tool": "flights", ..., "tool": "weather"}`: Python's json keeps the last key, other
    readers the first, so the line's label (or outcome, or user) was what the reader picked: it
    was read as "weather" and the request sent as a weather scenario. An error of the line, as
    a registry's or the API's body with a key twice is refused."""
    twice = line()[:-1] + ', "tool": "flights"}'
    nested = line(template={"signature": "f(city)", "template": "T"})[:-2] + ', "template": "U"}}'
    log = parse_lines([line(), twice, nested], source="usage.jsonl",
                      known_tools={"weather", "flights"})
    assert [r.line for r in log.records] == [1]
    assert log.error_lines() == [
        'usage.jsonl:2: not valid JSON: duplicate key "tool" in one object',
        'usage.jsonl:3: not valid JSON: duplicate key "template" in one object',
    ]


def test_a_flag_name_ending_in_a_newline_is_an_error_of_its_line():
    """The flag pattern's `$` also matches before a final newline: {"has_city\n": true} was
    read as a flag, and sent, apart from "has_city"."""
    log = parse_lines([line(preconditions={"has_city\n": True})], source="usage.jsonl")
    assert [e.line for e in log.errors] == [1] and "not an identifier" in log.errors[0].message


def test_a_query_of_nothing_but_zero_width_characters_is_empty():
    """A query of zero-width spaces (or a byte-order mark) passed as text, and masking, which
    drops what no reader sees, then left nothing: the line's scenario vanished without a word
    while its statistics were counted. It is an empty query, an error of its line."""
    log = parse_lines([line(query="\u200b\u200b"), line(query="\ufeff ")], source="usage.jsonl")
    assert [(e.line, e.message) for e in log.errors] == [(1, "'query' is empty"), (2, "'query' is empty")]
