from __future__ import annotations

import json

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
