from __future__ import annotations

import io
import json
import re

import pytest
from django.core.management import CommandError, call_command

from compendium.models import Tool
from compendium.registry import RegistryFormatError, load_dataset, load_registry, tools_from_mcp
from tests.conftest import METATOOL


def test_metatool_registry_reads_all_tools():
    tools = load_registry(METATOOL)
    assert len(tools) == 199
    by_id = {t.tool_id: t for t in tools}
    assert by_id["calculator"].category == "Productivity & Documents"
    assert by_id["calculator"].spec["display_name"] == "Calculator"


def test_a_tools_file_named_in_capitals_is_read_as_jsonl(tmp_path):
    """TOOLS.JSONL (a file system or an export that writes names in capitals) was read as an MCP
    tools/list result and refused as "not valid JSON (Extra data)"."""
    upper = tmp_path / "TOOLS.JSONL"
    upper.write_bytes((METATOOL / "tools.jsonl").read_bytes())
    assert [t.tool_id for t in load_registry(upper)] == [t.tool_id for t in load_registry(METATOOL)]


def test_metatool_dataset_reads_labelled_queries():
    dataset = load_dataset(METATOOL)
    assert len(dataset.queries) == 20558
    assert {q.tool_id for q in dataset.queries} <= dataset.tool_ids
    assert len({q.query for q in dataset.queries if q.label_conflict}) == 12  # 12 texts, several lines each


MCP_RESULT = {
    "jsonrpc": "2.0",
    "id": 1,
    "result": {
        "tools": [
            {
                "name": "get_weather",
                "title": "Weather",
                "description": "Get current weather for a location",
                "inputSchema": {"type": "object", "properties": {"location": {"type": "string"}}},
            },
            {"name": "search_files", "description": "Search files by name", "inputSchema": {"type": "object"}},
        ]
    },
}


def test_mcp_tools_list_result():
    tools = tools_from_mcp(MCP_RESULT)
    assert [t.tool_id for t in tools] == ["get_weather", "search_files"]
    assert tools[0].name == "Weather"
    assert tools[0].spec["inputSchema"]["properties"]["location"]["type"] == "string"
    assert [t.tool_id for t in tools_from_mcp(MCP_RESULT["result"])] == ["get_weather", "search_files"]


def test_bad_registries_name_the_problem(tmp_path):
    bad = tmp_path / "tools.jsonl"
    bad.write_text('{"tool_id": "a", "description": "x"}\n{"tool_id": "b"}\n')
    with pytest.raises(RegistryFormatError, match=r"tools.jsonl:2: missing or non-string description"):
        load_registry(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"tool_id": "a", "description": "x"}\n{"tool_id": "a", "description": "y"}\n')
    with pytest.raises(RegistryFormatError, match="duplicate tool id 'a'"):
        load_registry(dup)
    with pytest.raises(RegistryFormatError, match="not an MCP tools/list result"):
        tools_from_mcp({"something": 1})


@pytest.mark.django_db
def test_import_tools_command_both_formats(tmp_path, capsys):
    call_command("import_tools", str(METATOOL))
    assert Tool.objects.count() == 199
    call_command("import_tools", str(METATOOL))  # idempotent
    assert Tool.objects.count() == 199
    assert "0 created, 0 updated, 199 unchanged" in capsys.readouterr().out

    mcp = tmp_path / "tools_list.json"
    mcp.write_text(json.dumps(MCP_RESULT))
    call_command("import_tools", str(mcp))
    assert Tool.objects.count() == 201
    assert Tool.objects.get(tool_id="get_weather").spec["inputSchema"]["type"] == "object"
    # A tool the file leaves out stays as it is (an import adds and updates): the line says how
    # many, since an operator who dropped a tool from the file expected it gone and heard nothing.
    assert ("2 created, 0 updated, 0 unchanged; 199 active tools of the registry are not in "
            "this file and stay active") in capsys.readouterr().out


@pytest.mark.django_db
def test_import_tools_command_reports_bad_path(tmp_path):
    with pytest.raises(CommandError, match="no such file or folder"):
        call_command("import_tools", str(tmp_path / "missing.json"))


@pytest.mark.django_db
def test_exported_schema_validates_with_the_client_cli(tmp_path, valid_doc, small_schema):
    from compendium.client_cli import main
    from compendium.services import import_registry

    import_registry(small_schema.tools)
    schema_path = tmp_path / "schema.json"
    call_command("export_schema", "--out", str(schema_path))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(valid_doc))
    assert main(["validate", str(good), "--schema", str(schema_path)]) == 0
    valid_doc["scenarios"][0]["tool_id"] = "ghost"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(valid_doc))
    assert main(["validate", str(bad), "--schema", str(schema_path)]) == 1


def _dataset(folder, queries, tools=('{"tool_id": "a", "description": "x"}',
                                    '{"tool_id": "b", "description": "y"}')):
    folder.mkdir(exist_ok=True)
    (folder / "tools.jsonl").write_text("\n".join(tools) + "\n")
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    return folder


@pytest.mark.parametrize(("queries", "message"), [
    ([{"query": "hi", "tool_id": "a", "label_conflict": 5}], ":1: 'label_conflict' must be a list of tool ids"),
    ([{"query": "hi", "tool_id": "a", "label_conflict": "b"}], ":1: 'label_conflict' must be a list of tool ids"),
    ([{"query": "hi", "tool_id": "a", "label_conflict": ["a", 3]}], ":1: 'label_conflict' must be a list"),
    ([{"query": "hi", "tool_id": "a"}, {"query": "ho", "tool_id": "a", "label_conflict": ["a", "zz"]}],
     ":2: label_conflict names 'zz', not in tools.jsonl"),
    ([{"query": "hi", "tool_id": "a"}, {"query": "", "tool_id": "a"}], ":2: blank query"),
    ([{"query": " \t", "tool_id": "b"}], ":1: blank query"),
    # zero-width spaces, a byte-order mark: no text (the routing API refuses it as empty)
    ([{"query": "\u200b\ufeff", "tool_id": "b"}], ":1: blank query"),
    ([{"query": "hi", "tool_id": "a", "qid": "q1"}, {"query": "ho", "tool_id": "b", "qid": "q1"}],
     ":2: qid 'q1' is already on line 1"),
    ([{"query": "hi", "tool_id": "a", "qid": "q" * 201}], ":1: qid is 201 characters long; at most 200"),
    ([], "queries.jsonl: no queries"),
])
def test_bad_queries_are_refused_naming_the_file_and_line(tmp_path, queries, message):
    with pytest.raises(RegistryFormatError, match=re.escape(message)) as error:
        load_dataset(_dataset(tmp_path / "d", queries))
    assert str(error.value).startswith(str(tmp_path / "d"))


def test_conflicting_labels_are_kept_as_tool_ids(tmp_path):
    dataset = load_dataset(_dataset(tmp_path / "d", [
        {"query": "hi", "tool_id": "a", "label_conflict": ["a", "b"]},
        {"query": "ho", "tool_id": "b", "label_conflict": []}]))
    assert [q.label_conflict for q in dataset.queries] == [("a", "b"), ()]


def test_labels_are_read_as_the_tools_ids_are_with_surrounding_spaces_left_out(tmp_path):
    """tools.jsonl's ids are read stripped; the labels were not, so a dataset that wrote ' a'
    in both files was refused: "tool_id ' a' is not in tools.jsonl", which has it."""
    dataset = load_dataset(_dataset(tmp_path / "d", [
        {"query": "hi", "tool_id": " a", "label_conflict": [" a", "b\t"]},
        {"query": "ho", "tool_id": "b "}],
        tools=('{"tool_id": " a", "description": "x"}', '{"tool_id": "b ", "description": "y"}')))
    assert [t.tool_id for t in dataset.tools] == ["a", "b"]
    assert [(q.tool_id, q.label_conflict) for q in dataset.queries] == [("a", ("a", "b")), ("b", ())]


@pytest.mark.parametrize(("tool", "message"), [
    ('{"tool_id": "  ", "description": "x"}', "tools.jsonl:2: blank tool_id"),
    (json.dumps({"tool_id": "t" * 129, "description": "x"}), "tools.jsonl:2: tool_id is 129 characters long; at most 128"),
    (json.dumps({"tool_id": "t", "name": "n" * 201, "description": "x"}), "tools.jsonl:2: name is 201 characters"),
    (json.dumps({"tool_id": "t", "category": "c" * 201, "description": "x"}), "tools.jsonl:2: category is 201"),
])
def test_tools_the_database_cannot_store_are_refused_at_load(tmp_path, tool, message):
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x"}', tool))
    with pytest.raises(RegistryFormatError, match=re.escape(message)):
        load_registry(folder)


def test_a_dataset_name_too_long_to_store_is_refused(tmp_path):
    folder = _dataset(tmp_path / ("d" * 101), [{"query": "hi", "tool_id": "a"}])
    with pytest.raises(RegistryFormatError, match="name [(]its folder's[)] is 101 characters long; at most 100"):
        load_dataset(folder)


def test_files_that_cannot_be_read_are_refused_naming_them(tmp_path):
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}])
    queries = folder / "queries.jsonl"
    queries.write_bytes('{"query": "hi", "tool_id": "a"}\n{"query": "caf\xe9", "tool_id": "a"}\n'.encode("latin-1"))
    with pytest.raises(RegistryFormatError, match=re.escape(f"{queries}:2: not UTF-8 text")):
        load_dataset(folder)
    queries.unlink()
    queries.mkdir()
    with pytest.raises(RegistryFormatError, match=re.escape(f"{queries}: cannot be read (Is a directory)")):
        load_dataset(folder)
    mcp = tmp_path / "tools_list.json"
    mcp.write_bytes('{"tools": [{"name": "caf\xe9"}]}'.encode("latin-1"))
    with pytest.raises(RegistryFormatError, match=re.escape(f"{mcp}: not UTF-8 text")):
        load_registry(mcp)


@pytest.mark.django_db
def test_the_stored_lengths_are_the_ones_the_reader_checks():
    from compendium import registry
    from federation.models import ProbeQuery

    def length(model, name):
        return model._meta.get_field(name).max_length

    assert (length(Tool, "tool_id"), length(Tool, "name"), length(Tool, "category")) == (
        registry.TOOL_ID_MAX_LENGTH, registry.TOOL_NAME_MAX_LENGTH, registry.CATEGORY_MAX_LENGTH)
    assert (length(ProbeQuery, "dataset"), length(ProbeQuery, "qid")) == (
        registry.DATASET_NAME_MAX_LENGTH, registry.QID_MAX_LENGTH)


@pytest.mark.django_db
def test_import_probe_set_refuses_duplicate_qids_before_storing(tmp_path):
    from federation.models import ProbeQuery

    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a", "qid": "q"},
                                       {"query": "ho", "tool_id": "a", "qid": "q"}])
    with pytest.raises(CommandError, match="qid 'q' is already on line 1"):
        call_command("import_probe_set", str(folder))
    assert not ProbeQuery.objects.exists()


@pytest.mark.django_db
def test_a_probe_set_from_a_folder_of_another_name_says_what_it_keeps_and_only_drops_it(tmp_path):
    """The probe set is every dataset imported, each named after its folder: a benchmark's new
    release imported from a folder of another name was added beside the old one, silently, and
    the edges kept using the old queries with no way to drop them but the database shell."""
    from federation.models import ProbeQuery

    old = _dataset(tmp_path / "bench-v1", [{"query": f"old {n}", "tool_id": "a", "qid": f"q{n}"}
                                           for n in range(3)])
    new = _dataset(tmp_path / "bench-v2", [{"query": "new", "tool_id": "a", "qid": "q0"}])
    call_command("import_probe_set", str(old), stdout=io.StringIO())
    out = io.StringIO()
    call_command("import_probe_set", str(new), stdout=out)
    assert out.getvalue().splitlines() == [
        "imported 1 probe queries for 1 tools (dataset bench-v2)",
        "the probe set also holds: bench-v1 (3 queries); --only drops them",
    ]
    out = io.StringIO()
    call_command("import_probe_set", str(new), "--only", stdout=out)
    assert out.getvalue().splitlines() == ["imported 1 probe queries for 1 tools (dataset bench-v2)"]
    assert list(ProbeQuery.objects.values_list("dataset", "text")) == [("bench-v2", "new")]


@pytest.mark.parametrize(("value", "message"), [
    ("NaN", "not valid JSON (NaN is not a JSON number)"),
    ("-Infinity", "not valid JSON (-Infinity is not a JSON number)"),
    # a JSON number, but past a double's range: Python reads it as inf, jsonb refused it
    ("-1e400", "not valid JSON (-1e400 is beyond what a double holds)"),
    ("9" * 5000, "holds a number of more than 4,300 digits"),
    ("[" * 100_000, "not valid JSON (nested too deeply)"),
])
def test_what_json_cannot_hold_is_refused_naming_the_file_and_line(tmp_path, value, message):
    """NaN and Infinity (which Python's json reads, and jsonb refuses: a DataError at import),
    a number too large for a double (1e400, which Python reads as inf: the same DataError),
    a number of more digits than Python reads (ValueError) and JSON nested too deeply
    (RecursionError) were tracebacks of import_tools, import_probe_set and simulate."""
    tool = '{"tool_id": "b", "description": "y", "weight": ' + value + "}"
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x"}', tool))
    with pytest.raises(RegistryFormatError, match=re.escape(f"tools.jsonl:2: {message}")):
        load_dataset(folder)
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}])
    (folder / "queries.jsonl").write_text('{"query": "hi", "tool_id": "a", "qid": ' + value + "}\n")
    with pytest.raises(RegistryFormatError, match=re.escape(f"queries.jsonl:1: {message}")):
        load_dataset(folder)
    mcp = tmp_path / "tools_list.json"
    mcp.write_text('{"tools": [{"name": "a", "inputSchema": {"default": ' + value + "}}]}")
    with pytest.raises(RegistryFormatError, match=re.escape(f"{mcp}: {message}")):
        load_registry(mcp)


def test_a_key_given_twice_on_a_line_is_refused_naming_the_file_and_line(tmp_path):
    """`{"query": "a", "tool_id": "x", "tool_id": "y"}`: Python's json keeps the last key, other
    readers the first, so the label meant what the reader picked; it was read as "y". Refused
    naming the key, the file and the line, as the API refuses such a body."""
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}])
    (folder / "queries.jsonl").write_text(
        '{"query": "hi", "tool_id": "a"}\n{"query": "ho", "tool_id": "a", "tool_id": "b"}\n')
    with pytest.raises(RegistryFormatError, match=re.escape(
            'queries.jsonl:2: not valid JSON (duplicate key "tool_id" in one object)')):
        load_dataset(folder)
    folder = _dataset(tmp_path / "e", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x", "description": "y"}',))
    with pytest.raises(RegistryFormatError, match=re.escape(
            'tools.jsonl:1: not valid JSON (duplicate key "description" in one object)')):
        load_dataset(folder)


@pytest.mark.django_db
def test_import_tools_refuses_nan_in_one_line_and_stores_nothing(tmp_path):
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x", "weight": NaN}',))
    with pytest.raises(CommandError, match=re.escape("tools.jsonl:1: not valid JSON (NaN is not")):
        call_command("import_tools", str(folder))
    assert not Tool.objects.exists()


@pytest.mark.parametrize(("tool", "message"), [
    ('{"tool_id": "b\\u0000", "description": "y"}', "tools.jsonl:2: tool_id holds a NUL character"),
    ('{"tool_id": "b", "description": "y\\ud800"}',
     "tools.jsonl:2: description holds a lone surrogate at character 1"),
    ('{"tool_id": "b", "description": "y", "notes": "B\\u0000"}',
     "tools.jsonl:2: 'notes' holds a NUL character"),
    ('{"tool_id": "b", "description": "y", "args": {"x": ["\\u0000"]}}',
     "tools.jsonl:2: 'args' holds a NUL character"),
])
def test_text_the_database_cannot_store_is_refused_at_load(tmp_path, tool, message):
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x"}', tool))
    with pytest.raises(RegistryFormatError, match=re.escape(message + ", which the database cannot")):
        load_registry(folder)


@pytest.mark.django_db
@pytest.mark.parametrize(("command", "tools", "query", "message"), [
    ("import_tools", '{"tool_id": "a", "description": "x\\u0000"}', '{"query": "hi", "tool_id": "a"}',
     "tools.jsonl:1: description holds a NUL character"),
    ("import_tools", '{"tool_id": "a", "description": "x", "inputSchema": {"d": "\\ud83d"}}',
     '{"query": "hi", "tool_id": "a"}', "tools.jsonl:1: 'inputSchema' holds a lone surrogate"),
    ("import_probe_set", '{"tool_id": "a", "description": "x"}', '{"query": "hi\\u0000", "tool_id": "a"}',
     "queries.jsonl:1: query holds a NUL character"),
    ("import_probe_set", '{"tool_id": "a", "description": "x"}', '{"query": "hi \\udfff", "tool_id": "a"}',
     "queries.jsonl:1: query holds a lone surrogate at character 3"),
    ("import_probe_set", '{"tool_id": "a", "description": "x"}',
     '{"query": "hi", "tool_id": "a", "qid": "q\\u0000"}', "queries.jsonl:1: qid holds a NUL"),
])
def test_import_commands_refuse_text_the_database_cannot_store_in_one_line(tmp_path, command, tools,
                                                                          query, message):
    """A NUL character or a lone surrogate (an escaped half emoji) was PostgreSQL's DataError or
    psycopg's UnicodeEncodeError traceback when the command stored the tool or probe query."""
    from federation.models import ProbeQuery

    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "tools.jsonl").write_text(tools + "\n")
    (folder / "queries.jsonl").write_text(query + "\n")
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command(command, str(folder))
    assert not Tool.objects.exists() and not ProbeQuery.objects.exists()


@pytest.mark.django_db
def test_import_tools_names_the_file_that_is_not_an_mcp_result(tmp_path):
    """It said only "not an MCP tools/list result: ..." without naming the file imported."""
    mcp = tmp_path / "tools_list.json"
    mcp.write_text(json.dumps({"result": {"tools": "weather"}}))
    with pytest.raises(CommandError, match=re.escape(f"{mcp}: not an MCP tools/list result")):
        call_command("import_tools", str(mcp))


@pytest.mark.parametrize("where", [".", "sub/..", "./"])
def test_a_dataset_read_as_dot_is_named_after_its_folder(tmp_path, monkeypatch, where):
    """`--dataset .` (run from inside the dataset's folder) named the dataset "" (and "sub/.."
    named it ".."): the stored run, the probe set and `--combine` (which matches runs by dataset
    name) all had a blank or meaningless name."""
    folder = _dataset(tmp_path / "mydata", [{"query": "hi", "tool_id": "a"}])
    (folder / "sub").mkdir()
    monkeypatch.chdir(folder)
    dataset = load_dataset(where)
    assert dataset.name == "mydata" and dataset.queries[0].qid == "mydata-1"


def test_queries_are_read_line_by_line_not_whole(tmp_path):
    """A multi-GB queries.jsonl must not be held in memory whole (let alone several times over,
    as bytes, then split into lines): the reader streams it, so reading through a file takes
    memory of the order of one line, whatever the file's size."""
    import tracemalloc

    from compendium.registry import _read_jsonl

    path = tmp_path / "queries.jsonl"
    line = json.dumps({"query": "x" * 200, "tool_id": "a"}) + "\n"
    path.write_text(line * 40_000)  # about 9 MB
    tracemalloc.start()
    try:
        count = sum(1 for _ in _read_jsonl(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 40_000
    assert peak < 1_000_000, f"reading a {path.stat().st_size:,}-byte file peaked at {peak:,} bytes"


def test_lines_are_numbered_as_before_whatever_ends_them(tmp_path):
    """Lines end at LF, CRLF or a lone CR, as they always did: the line an error names is the
    line an editor shows."""
    from compendium.registry import _read_jsonl

    path = tmp_path / "queries.jsonl"
    # 1 CRLF, 2 CR, 3 (blank) CR, 4 LF, 5 (spaces) CRLF, 6 LF, 7 without an end
    data = b'{"n": 1}\r\n{"n": 2}\r\r{"n": 4}\n  \r\n{"n": 6}\n{"n": 7}'
    assert len(data.splitlines()) == 7
    path.write_bytes(data)
    assert [(n, item["n"]) for n, item in _read_jsonl(path)] == [(1, 1), (2, 2), (4, 4), (6, 6), (7, 7)]
    path.write_bytes(b'{"n": 1}\r{"n": 2}\r\n\xff\n')
    with pytest.raises(RegistryFormatError, match=re.escape(f"{path}:3: not UTF-8 text")):
        list(_read_jsonl(path))
    path.write_bytes(b'{"n": 1}\r\n\r\n{"n": 3\r\n')
    with pytest.raises(RegistryFormatError, match=re.escape(f"{path}:3: not valid JSON")):
        list(_read_jsonl(path))


BOM = "\ufeff"  # what Notepad and PowerShell 5's Out-File write first


@pytest.mark.django_db
def test_dataset_files_saved_with_a_byte_order_mark_are_read(tmp_path):
    """A tools.jsonl or queries.jsonl saved by a Windows editor starts with a UTF-8 byte-order
    mark: import_tools, import_probe_set and simulate said "tools.jsonl:1: not valid JSON
    (Unexpected UTF-8 BOM (decode using utf-8-sig))"; they read it as the editor shows it, as
    the client reads a usage log. One further on is still no JSON."""
    from federation.models import ProbeQuery

    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"},
                                      {"query": "ho", "tool_id": "b"}])
    for name in ("tools.jsonl", "queries.jsonl"):
        path = folder / name
        path.write_text(BOM + path.read_text(encoding="utf-8").replace("\n", "\r\n"),
                        encoding="utf-8")
    dataset = load_dataset(folder)
    assert [t.tool_id for t in dataset.tools] == ["a", "b"]
    assert [q.query for q in dataset.queries] == ["hi", "ho"]
    call_command("import_tools", str(folder / "tools.jsonl"), stdout=io.StringIO())
    call_command("import_probe_set", str(folder), stdout=io.StringIO())
    assert set(Tool.objects.values_list("tool_id", flat=True)) == {"a", "b"}
    assert ProbeQuery.objects.count() == 2
    mcp = tmp_path / "tools.json"
    mcp.write_text(BOM + json.dumps({"tools": [{"name": "c", "description": "z"}]}),
                   encoding="utf-8")
    assert [t.tool_id for t in load_registry(mcp)] == ["c"]
    (folder / "queries.jsonl").write_text('{"query": "hi", "tool_id": "a"}\n' + BOM + "{}\n",
                                          encoding="utf-8")
    with pytest.raises(RegistryFormatError, match=re.escape("queries.jsonl:2: not valid JSON")):
        load_dataset(folder)


@pytest.mark.django_db
def test_a_reimport_that_changes_a_description_changes_the_schema_in_force():
    """import_tools updates changed tools with bulk_update, which leaves `updated_at` (auto_now)
    as it was: the schema's fingerprint (active and total counts, latest updated_at) stayed the
    same, so every process that had read the schema kept serving the old descriptions from
    GET /compendium/schema/ and its dcz dictionary, and submissions were checked against it."""
    from compendium.schema import ToolSpec
    from compendium.services import import_registry
    from federation import submissions

    import_registry([ToolSpec(tool_id="a", description="old"), ToolSpec(tool_id="b", description="b")])
    assert submissions.schema_in_force().tools_by_id["a"].description == "old"
    before = Tool.objects.get(tool_id="a").updated_at
    result = import_registry([ToolSpec(tool_id="a", description="new", category="maps")])
    assert (result.updated, result.unchanged) == (1, 0)
    assert Tool.objects.get(tool_id="a").updated_at > before
    in_force = submissions.schema_in_force().tools_by_id["a"]
    assert (in_force.description, in_force.category) == ("new", "maps")


@pytest.mark.parametrize(("tool", "message"), [
    ('{"tool_id": "b", "description": "y\\fz"}',
     "tools.jsonl:2: description: string contains a control character U+000C at position 1"),
    ('{"tool_id": "b", "description": "y \\u202e"}',
     "tools.jsonl:2: description: string contains a bidirectional override U+202E"),
    ('{"tool_id": "b\\u001b", "description": "y"}',
     "tools.jsonl:2: tool_id 'b\\x1b' holds a control character U+001B at position 1"),
    ('{"tool_id": "b", "description": "' + "y" * 4001 + '"}',
     "tools.jsonl:2: description: string is 4001 characters; the declared limit for description is"),
    ('{"tool_id": "b", "description": "y", "args": {"help": "' + "z" * 4001 + '"}}',
     'tools.jsonl:2: spec.args.help: string is 4001 characters'),
    ('{"tool_id": "b", "description": "y", "args": ' + "[" * 30 + "]" * 30 + "}",
     "tools.jsonl:2: spec.args[0][0][0]"),
])
def test_a_tool_no_global_compendium_could_publish_is_refused_at_load(tmp_path, tool, message):
    """Every global compendium publishes each registry tool's description and spec, and the merge
    checks its own output against the schema: a registry description holding a form feed or a
    bidirectional override (pasted from a PDF or a word processor), one past the schema's 4,000
    characters, or a spec string past it or nested past its depth was imported, and then every
    round failed ("merge produced an invalid compendium")."""
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x"}', tool))
    with pytest.raises(RegistryFormatError, match=re.escape(message)):
        load_registry(folder)
    mcp = tmp_path / "tools.json"
    mcp.write_text(json.dumps({"tools": [{"name": "a", "description": "x\x0bz"}]}))
    with pytest.raises(RegistryFormatError, match=re.escape(
            f"{mcp}: tools[0]: description: string contains a control character U+000B")):
        load_registry(mcp)


def test_a_registry_larger_than_a_compendium_can_publish_is_refused(tmp_path):
    """A global publishes an entry per registry tool, and a compendium holds at most
    limits.metadata (20,000) of them: a larger registry made every merge fail."""
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps({"tool_id": f"t{i}", "description": "d"}) + "\n"
                            for i in range(20_001)))
    with pytest.raises(RegistryFormatError, match=re.escape(
            f"{path}: 20001 tools; the limit is 20000 per compendium")):
        load_registry(path)


@pytest.mark.django_db
def test_two_imports_together_past_what_a_compendium_can_publish_are_refused(tmp_path):
    """The 20,000-tool limit was checked per file: 15,000 tools, then a file of 5,001 others,
    left 20,001 active tools, and every merge failed. The second import is refused whole, naming
    the count, and the admin refuses to reactivate a tool past the limit."""
    from compendium.services import schema_problem

    def write(name, ids):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"tool_id": f"t{i}", "description": "d"}) + "\n"
                                for i in ids))
        return path

    call_command("import_tools", str(write("first.jsonl", range(15_000))), stdout=io.StringIO())
    Tool.objects.filter(tool_id="t0").update(active=False)
    second = write("second.jsonl", range(15_000, 20_001))
    call_command("import_tools", str(second), stdout=io.StringIO())  # 19,999 + 5,001 = 20,000
    assert Tool.objects.filter(active=True).count() == 20_000
    more = write("more.jsonl", [20_001])
    with pytest.raises(CommandError, match=re.escape(
            "would hold 20001 active tools; the limit is 20000 per compendium")):
        call_command("import_tools", str(more))
    assert not Tool.objects.filter(tool_id="t20001").exists()
    # the same file again changes nothing and passes: its tools are already active
    call_command("import_tools", str(second), stdout=io.StringIO())
    inactive = Tool.objects.get(tool_id="t0")
    inactive.active = True
    assert "would hold 20001 active tools" in schema_problem(inactive)


@pytest.mark.django_db
def test_the_operator_cannot_give_a_tool_a_description_no_global_could_publish():
    """The admin's form asks `schema_problem` before a registry row is saved."""
    from compendium.schema import ToolSpec
    from compendium.services import import_registry, schema_problem

    import_registry([ToolSpec(tool_id="a", description="x")])
    tool = Tool.objects.get(tool_id="a")
    tool.description = "pasted\x0ctext"
    problem = schema_problem(tool)
    assert problem is not None and "description" in problem and "U+000C" in problem
    tool.description = "pasted text"
    assert schema_problem(tool) is None


# --- tool ids that read otherwise than they are stored, or as another tool's -----------------


def _tools_file(path, *ids):
    path.write_text("".join(json.dumps({"tool_id": i, "description": "d"}) + "\n" for i in ids),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize(("tool_id", "message"), [
    ("pay\u200b", "an invisible character U+200B (ZERO WIDTH SPACE) at position 3"),
    ("pay\u2060now", "an invisible character U+2060 (WORD JOINER) at position 3"),
    ("ab\u202ecd", "a bidirectional override U+202E at position 2"),
    ("ab\u200fcd", "an invisible character U+200F (RIGHT-TO-LEFT MARK) at position 2"),
    ("a\tb", "a control character U+0009 at position 1"),
    ("a\u2028b", "a line separator U+2028 at position 1"),
    ("a\u2029b", "a paragraph separator U+2029 at position 1"),
    ("a\u00a0b", "a space other than U+0020: U+00A0 (NO-BREAK SPACE) at position 1"),
    ("\u0455earch", "letters of two scripts, Latin and Cyrillic: U+0455 (CYRILLIC SMALL LETTER DZE) "
                    "at position 0"),
    ("p\u03b1y", "letters of two scripts, Latin and Greek: U+03B1 (GREEK SMALL LETTER ALPHA) at "
                 "position 1"),
])
def test_a_tool_id_that_does_not_read_as_it_is_stored_is_refused_at_load(tmp_path, tool_id, message):
    """A tool id holding a zero-width, bidi or other format character, a control character, a
    line separator or an odd space reads otherwise than it is stored (in the admin, the conflict
    log, the routing API's answers, the audit log); one mixing Latin with Cyrillic or Greek
    letters ("ѕearch" with a Cyrillic dze) is a look-alike of another. Both were imported."""
    path = _tools_file(tmp_path / "tools.jsonl", "ok", tool_id)
    shown = repr(tool_id) if tool_id.isascii() else f"{tool_id!r} ({ascii(tool_id)})"
    with pytest.raises(RegistryFormatError, match=re.escape(f"{path}:2: tool_id {shown} holds {message}")):
        load_registry(path)
    mcp = tmp_path / "tools.json"
    mcp.write_text(json.dumps({"tools": [{"name": tool_id, "description": "d"}]}))
    with pytest.raises(RegistryFormatError, match=re.escape(f"{mcp}: tools[0]: tool_id {tool_id!r}")):
        load_registry(mcp)


@pytest.mark.parametrize(("first", "second"), [
    ("weather", "\uff57eather"),  # a full-width w
    ("caf\u00e9", "cafe\u0301"),  # precomposed, and e with a combining acute accent
    ("Search", "search"),
    ("\U0001d42cearch", "search"),  # a mathematical bold s
    ("pay", "\u0440\u0430\u0443"),  # all Cyrillic: er, a, u
    ("cop", "\u0441\u043e\u0440"),  # all Cyrillic: es, o, er
    ("POP", "\u03a1\u039f\u03a1"),  # all Greek capitals: rho, omicron, rho
    ("\u00ebxo", "\u0451\u0445\u043e"),  # Latin e with diaeresis; all Cyrillic: io, ha, o
    ("get weather", "get  weather"),
])
def test_two_tool_ids_that_read_alike_are_refused_naming_both(tmp_path, first, second):
    """Two ids a person cannot tell apart (case, width, composition, spacing, or letters of
    another script drawn alike) were imported as two tools: an operator reading the conflicts,
    the routing API's answers and the audit log saw one name for both, and anyone could add the
    look-alike of a tool to draw its queries."""
    path = _tools_file(tmp_path / "tools.jsonl", "ok", first, second)
    shown = f"{second!r} ({ascii(second)})" if not second.isascii() else repr(second)
    with pytest.raises(RegistryFormatError, match=re.escape(
            f"{path}:3: tool id {shown} reads as the tool id {first!r}")) as refused:
        load_registry(path)
    assert f"{path}:2" in str(refused.value)
    mcp = tmp_path / "tools.json"
    mcp.write_text(json.dumps({"tools": [{"name": first, "description": "d"},
                                         {"name": second, "description": "d"}]}))
    with pytest.raises(RegistryFormatError, match=re.escape(f"{mcp}: tools[1]: tool id {shown}")):
        load_registry(mcp)


def test_tool_ids_of_one_script_other_than_latin_or_with_spaces_still_load(tmp_path):
    ids = ["\u043f\u043e\u0433\u043e\u0434\u0430", "\u5929\u6c14", "\u03ba\u03b1\u03b9\u03c1\u03cc\u03c2",
           "get weather", "caf\u00e9", "na\u00efve", "C3_Glide", "v2.search:beta-1"]
    path = _tools_file(tmp_path / "tools.jsonl", *ids)
    assert [t.tool_id for t in load_registry(path)] == ids


@pytest.mark.django_db
def test_import_refuses_a_new_tool_id_that_reads_as_a_stored_one(tmp_path):
    """The database's registry holds "weather": a later file adding "ｗeather" (or "Weather")
    would make a twin of it there, though the file alone is fine. Refused naming both, nothing
    stored; a file naming the stored tool itself updates it as before."""
    from compendium.schema import ToolSpec
    from compendium.services import import_registry

    import_registry([ToolSpec(tool_id="weather", description="d")])
    for twin in ("\uff57eather", "Weather"):
        path = _tools_file(tmp_path / "tools.jsonl", "news", twin)
        with pytest.raises(CommandError, match=re.escape(
                f"{path}: tool id {twin!r}")) as refused:
            call_command("import_tools", str(path), stdout=io.StringIO())
        assert "reads as the registry's tool 'weather'" in str(refused.value)
        assert sorted(Tool.objects.values_list("tool_id", flat=True)) == ["weather"]
    call_command("import_tools", str(_tools_file(tmp_path / "tools.jsonl", "news", "weather")),
                 stdout=io.StringIO())
    assert sorted(Tool.objects.values_list("tool_id", flat=True)) == ["news", "weather"]


@pytest.mark.django_db
def test_twins_stored_before_the_rule_do_not_stop_a_reimport_of_either():
    from compendium.schema import ToolSpec
    from compendium.services import import_registry

    Tool.objects.create(tool_id="x", description="d")
    Tool.objects.create(tool_id="X", description="d")
    result = import_registry([ToolSpec(tool_id="x", description="new"),
                              ToolSpec(tool_id="X", description="d")])
    assert (result.created, result.updated, result.unchanged) == (0, 1, 1)


@pytest.mark.parametrize("tool, message", [
    ('{"tool_id": "b", "description": "y", "category": ["maps", "travel"]}',
     "tools.jsonl:2: category must be a string, not an array"),
    ('{"tool_id": "b", "description": "y", "category": 3}',
     "tools.jsonl:2: category must be a string, not a number"),
    ('{"tool_id": "b", "description": "y", "name": {"en": "B"}}',
     "tools.jsonl:2: name must be a string, not an object"),
    ('{"tool_id": "b", "description": "y", "name": false}',
     "tools.jsonl:2: name must be a string, not true or false"),
    ('{"tool_id": "b", "description": "  "}', "tools.jsonl:2: blank description"),
])
def test_a_tool_whose_fields_are_not_text_is_refused_naming_the_line(tmp_path, tool, message):
    """The format's name, category and description are strings, the description required: a
    list or an object there was stored as Python wrote it ("['maps', 'travel']" became the
    tool's category, which splits tools across simulated organizations), and a blank
    description was imported as the tool's description."""
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a"}],
                      tools=('{"tool_id": "a", "description": "x"}', tool))
    with pytest.raises(RegistryFormatError, match=re.escape(message)):
        load_registry(folder)
    # absent or null: the defaults, as before
    fine = tmp_path / "fine.jsonl"
    fine.write_text('{"tool_id": "b", "description": "y", "name": null, "category": null}\n')
    assert [(t.name, t.category) for t in load_registry(fine)] == [("b", "")]


@pytest.mark.parametrize("tool, message", [
    ({"name": "a", "description": "d", "inputSchema": "object"},
     "tools[0]: inputSchema must be a JSON Schema object, not a string"),
    ({"name": "a", "description": "d", "inputSchema": [{"type": "object"}]},
     "tools[0]: inputSchema must be a JSON Schema object, not an array"),
    ({"name": "a", "description": "d", "title": 7}, "tools[0]: title must be a string, not a number"),
    ({"name": "a", "description": "d", "annotations": {"category": ["x"]}},
     "tools[0]: annotations.category must be a string, not an array"),
    # stored as the tool's spec, and published in every global, as they came
    ({"name": "a", "description": "d", "annotations": "read-only"},
     "tools[0]: annotations must be an object, not a string"),
    ({"name": "a", "description": "d", "annotations": [{"readOnlyHint": True}]},
     "tools[0]: annotations must be an object, not an array"),
])
def test_an_mcp_tool_whose_fields_are_not_what_mcp_says_is_refused(tmp_path, tool, message):
    """An MCP tool's inputSchema is a JSON Schema object, its title and annotations text: a
    string or a list as inputSchema was stored as the tool's spec, and a title or category of
    another type as Python's repr of it."""
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [tool]}))
    with pytest.raises(RegistryFormatError, match=re.escape(f"{path}: {message}")):
        load_registry(path)


@pytest.mark.parametrize("fields, message", [
    ({"qid": ["q", 1]}, "queries.jsonl:1: qid must be a string, not an array"),
    ({"qid": True}, "queries.jsonl:1: qid must be a string, not true or false"),
    ({"qid": 1.5}, "queries.jsonl:1: qid must be a string, not a number"),
    ({"category": {"en": "Travel"}}, "queries.jsonl:1: category must be a string, not an object"),
    ({"category": ["Travel", "Maps"]}, "queries.jsonl:1: category must be a string, not an array"),
])
def test_a_query_whose_qid_or_category_is_not_text_is_refused_naming_the_line(
    tmp_path, fields, message
):
    """queries.jsonl's qid and category are strings, as tools.jsonl's name and category are: a
    list, an object, true or a float there was stored as Python wrote it (a qid "['q', 1]" or
    "True" in the probe set, a per-category row "{'en': 'Travel'}" in simulate's results), and
    a qid of false or 0 was silently replaced by the line's default id."""
    folder = _dataset(tmp_path / "d", [{"query": "hi", "tool_id": "a", **fields}])
    with pytest.raises(RegistryFormatError, match=re.escape(message)):
        load_dataset(folder)
    # absent or null: the defaults, as before; a whole number: its digits
    folder = _dataset(tmp_path / "e", [{"query": "hi", "tool_id": "a", "qid": None, "category": None},
                                       {"query": "ho", "tool_id": "a", "qid": 7}])
    assert [(q.qid, q.category) for q in load_dataset(folder).queries] == [("e-1", ""), ("7", "")]


@pytest.mark.django_db
def test_a_dataset_folder_whose_name_is_not_utf8_is_refused_in_one_line(tmp_path):
    """A folder named with bytes that are not UTF-8 (a Latin-1 file system, an archive made on
    another system) reaches Python as lone surrogates: the dataset's name, and each default
    qid made of it, were psycopg's UnicodeEncodeError traceback when import_probe_set stored
    them (and simulate when it stored its run)."""
    from federation.models import ProbeQuery

    folder = _dataset(tmp_path / "caf\udce9", [{"query": "hi", "tool_id": "a"}])
    with pytest.raises(RegistryFormatError, match=re.escape(
            "the dataset's name (its folder's) holds a lone surrogate at character 3")):
        load_dataset(folder)
    with pytest.raises(CommandError, match="the dataset's name"):
        call_command("import_probe_set", str(folder))
    assert not ProbeQuery.objects.exists()


def test_a_blank_name_or_category_is_read_as_none_given(tmp_path):
    """A name of spaces was kept as the tool's name (shown blank on the dashboard, and in the
    templates a dataset's compendium writes, "Call   (...)"), not the tool id an absent name
    gives; a category of spaces became a category of its own, apart from the tools without
    one, when simulate splits tools across organizations by category."""
    path = tmp_path / "tools.jsonl"
    path.write_text('{"tool_id": "a", "description": "x", "name": "  ", "category": " \\t"}\n'
                    '{"tool_id": "b", "description": "y", "name": " B ", "category": " maps "}\n')
    assert [(t.name, t.category) for t in load_registry(path)] == [("a", ""), ("B", "maps")]
