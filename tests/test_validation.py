"""Definition 1's validity rules (a)-(d), and the structural rules around them."""

from __future__ import annotations

import copy
import json

import pytest

from compendium.schema import Compendium
from compendium.validation import CompendiumInvalid, load_valid_compendium, validate_compendium


def paths(result):
    return {v.path: v.reason for v in result.violations}


def test_valid_compendium_is_accepted(valid_doc, small_schema):
    result = validate_compendium(valid_doc, small_schema)
    assert result.ok, result.violations
    assert isinstance(result.compendium, Compendium)
    assert result.compendium.scenarios[0].preconditions == {"has_city": True}


def test_bytes_and_text_inputs_are_accepted(valid_doc, small_schema):
    raw = json.dumps(valid_doc).encode()
    assert validate_compendium(raw, small_schema).ok
    assert validate_compendium(raw.decode(), small_schema).ok


# (a) every tool id of M is in the registry
def test_rule_a_unknown_tool_id_in_metadata(valid_doc, small_schema):
    valid_doc["metadata"][1]["tool_id"] = "teleporter"
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "$.metadata[1].tool_id" in found
    assert "unknown tool id 'teleporter'" in found["$.metadata[1].tool_id"]


# (b) numeric fields lie in their declared range
@pytest.mark.parametrize("value", [-1, 1001, 1e9])
def test_rule_b_value_out_of_declared_range(valid_doc, small_schema, value):
    valid_doc["metadata"][0]["stats"]["calls"] = value
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "outside the declared range [0, 1000]" in found["$.metadata[0].stats.calls"]


def test_rule_b_range_bounds_are_inclusive(valid_doc, small_schema):
    valid_doc["metadata"][0]["stats"].update({"calls": 1000, "success_rate": 0.0})
    assert validate_compendium(valid_doc, small_schema).ok


def test_rule_b_undeclared_numeric_field(valid_doc, small_schema):
    valid_doc["metadata"][0]["stats"]["revenue"] = 3.0
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "unknown numeric field 'revenue'" in found["$.metadata[0].stats.revenue"]


# (c) scenarios, precautions and templates reference registered tools
@pytest.mark.parametrize("component", ["scenarios", "precautions", "templates"])
def test_rule_c_reference_to_unregistered_tool(valid_doc, small_schema, component):
    valid_doc[component][0]["tool_id"] = "ghost"
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "references unregistered tool 'ghost'" in found[f"$.{component}[0].tool_id"]


# (d) string length and encoding
def test_rule_d_string_too_long(valid_doc, small_schema):
    valid_doc["scenarios"][1]["text"] = "x" * 1001
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "1001 characters; the declared limit for scenario is 1000" in found["$.scenarios[1].text"]


@pytest.mark.parametrize(
    "bad, what",
    [("\x00", "control character"), ("\x1b[2J", "control character"), ("\u202e", "bidirectional")],
)
def test_rule_d_control_characters(valid_doc, small_schema, bad, what):
    valid_doc["precautions"][0]["text"] = f"never {bad} here"
    found = paths(validate_compendium(valid_doc, small_schema))
    assert what in found["$.precautions[0].text"]


def test_rule_d_lone_surrogate_is_not_utf8(valid_doc, small_schema):
    raw = json.dumps(valid_doc).replace("Find a cheap", "Find \\ud800 cheap")
    found = paths(validate_compendium(raw, small_schema))
    assert "lone surrogate" in found["$.scenarios[1].text"]


def test_rule_d_invalid_utf8_bytes(valid_doc, small_schema):
    raw = json.dumps(valid_doc).encode().replace(b"cheap", b"ch\xffap")
    found = paths(validate_compendium(raw, small_schema))
    assert found["$"].startswith("not valid UTF-8 at byte")


def test_newlines_and_tabs_are_allowed_in_templates(valid_doc, small_schema):
    valid_doc["templates"][0]["template"] = "Forecast\tfor\n{city}"
    assert validate_compendium(valid_doc, small_schema).ok


# wrong types, missing fields, unknown fields, duplicates
def test_wrong_type_missing_and_unknown_fields_all_reported(valid_doc, small_schema):
    valid_doc["metadata"][0]["stats"]["calls"] = "twelve"
    del valid_doc["scenarios"][0]["text"]
    valid_doc["annex"][0]["weight"] = 3
    valid_doc["templates"][0]["signature"] = 7
    found = paths(validate_compendium(valid_doc, small_schema))
    assert found["$.metadata[0].stats.calls"] == "wrong type: expected a number"
    assert found["$.scenarios[0].text"] == "required field is missing"
    assert found["$.annex[0].weight"].startswith("unknown field")
    assert found["$.templates[0].signature"] == "wrong type: expected a string"


def test_booleans_are_not_numbers(valid_doc, small_schema):
    valid_doc["metadata"][0]["stats"]["calls"] = True
    found = paths(validate_compendium(valid_doc, small_schema))
    assert found["$.metadata[0].stats.calls"] == "wrong type: expected a number"


def test_duplicate_ids_are_reported(valid_doc, small_schema):
    valid_doc["metadata"].append(copy.deepcopy(valid_doc["metadata"][0]))
    valid_doc["templates"].append(copy.deepcopy(valid_doc["templates"][0]))
    valid_doc["scenarios"].append(copy.deepcopy(valid_doc["scenarios"][1]))
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "duplicate tool id 'weather': already at $.metadata[0]" in found["$.metadata[2].tool_id"]
    assert "same as $.templates[0]" in found["$.templates[1]"]
    assert "same as $.scenarios[1]" in found["$.scenarios[2]"]


def test_every_violation_is_listed_not_just_the_first(valid_doc, small_schema):
    valid_doc["metadata"][0]["tool_id"] = "nope"
    valid_doc["scenarios"][0]["tool_id"] = "nope"
    valid_doc["scenarios"][1]["text"] = "y" * 2000
    valid_doc["metadata"][1]["stats"]["calls"] = -5
    result = validate_compendium(valid_doc, small_schema)
    assert len(result.violations) == 4
    with pytest.raises(CompendiumInvalid) as info:
        load_valid_compendium(valid_doc, small_schema)
    assert len(info.value.violations) == 4


def test_schema_version_mismatch(valid_doc, small_schema):
    valid_doc["schema_version"] = "9.9"
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "not supported" in found["$.schema_version"]


def test_bad_flag_name_and_empty_text(valid_doc, small_schema):
    valid_doc["scenarios"][0]["preconditions"] = {"has city": True}
    valid_doc["precautions"][0]["text"] = "   "
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "identifier" in found['$.scenarios[0].preconditions["has city"]']
    assert found["$.precautions[0].text"] == "text is empty"


@pytest.mark.parametrize("blank", ["\u200b\u200b", "\ufeff", " \u00ad ", "\u2060\u3164"])
def test_a_text_of_nothing_but_invisible_characters_is_empty(valid_doc, small_schema, blank):
    """Only whitespace counted as empty: a scenario of zero-width spaces (or a soft hyphen, a
    byte-order mark) was stored and published, a text no one can read that routing embeds,
    where the routing API refuses the same query as empty."""
    valid_doc["scenarios"][0]["text"] = blank
    valid_doc["precautions"][0]["text"] = blank
    valid_doc["annex"][0]["object"] = blank
    found = [(v.path, v.reason) for v in validate_compendium(valid_doc, small_schema).violations]
    assert ("$.scenarios[0].text", "text is empty") in found
    assert ("$.precautions[0].text", "text is empty") in found
    assert ("$.annex[0].object", "object is empty") in found


@pytest.mark.parametrize("part", ["signature", "template"])
@pytest.mark.parametrize("blank", ["", "  ", "\u200b"])
def test_a_template_with_an_empty_signature_or_body_is_refused(valid_doc, small_schema, part, blank):
    """A prompt template of no signature, or of no text, passed validation and was published
    (routing answers a tool's template with it): the usage log refuses either empty, the
    server did not."""
    valid_doc["templates"][0][part] = blank
    found = [(v.path, v.reason) for v in validate_compendium(valid_doc, small_schema).violations]
    assert (f"$.templates[0].{part}", f"{part} is empty") in found


def test_a_flag_name_ending_in_a_newline_is_no_identifier(valid_doc, small_schema):
    """IDENTIFIER's `$` also matches before a final newline: "has_city\n" passed as a flag name
    and was stored, a flag apart from "has_city" in every merge that compares them."""
    valid_doc["scenarios"][0]["preconditions"] = {"has_city\n": True}
    found = paths(validate_compendium(valid_doc, small_schema))
    assert "identifier" in found['$.scenarios[0].preconditions["has_city\\n"]']


def test_the_flag_limit_applies_to_flag_names_not_to_field_names(valid_doc, small_schema):
    """A declared flag limit shorter than the word "preconditions" still accepts scenarios with
    preconditions; a flag name over it is reported at the flag."""
    tight = small_schema.model_copy(
        update={"strings": small_schema.strings.model_copy(update={"flag": 8})}
    )
    assert validate_compendium(valid_doc, tight).ok  # "has_city" is 8 characters
    valid_doc["scenarios"][0]["preconditions"] = {"has_a_city": True}
    found = paths(validate_compendium(valid_doc, tight))
    assert found == {
        "$.scenarios[0].preconditions.has_a_city":
            "key is 10 characters; the declared limit for flag is 8"
    }


@pytest.mark.parametrize("digits", [400, 40])
def test_an_integer_too_large_for_a_number_field_is_a_violation(valid_doc, small_schema, digits):
    """An integer past the float range used to raise OverflowError (a 500 at the API)."""
    valid_doc["metadata"][0]["stats"]["calls"] = 12
    raw = json.dumps(valid_doc).replace('"calls": 12', '"calls": ' + "9" * digits).encode()
    found = paths(validate_compendium(raw, small_schema))
    reason = found["$.metadata[0].stats.calls"]
    assert ("outside the declared range" in reason) if digits == 40 else reason == (
        "wrong type: expected a number"
    )


# hostile documents
def test_deep_nesting_is_rejected_cleanly(small_schema):
    deep = "[" * 100_000 + "]" * 100_000
    result = validate_compendium(deep, small_schema)
    assert not result.ok and result.violations[0].path == "$"


def test_moderately_deep_nesting_inside_a_field(valid_doc, small_schema):
    nested: dict = {}
    cursor = nested
    for _ in range(60):
        cursor["a"] = {}
        cursor = cursor["a"]
    valid_doc["metadata"][0]["spec"] = nested
    result = validate_compendium(valid_doc, small_schema)
    assert any("nested deeper than the limit" in v.reason for v in result.violations)


def test_oversized_document_is_rejected_before_parsing(small_schema):
    limits = small_schema.limits.model_copy(update={"bytes": 1000})
    schema = small_schema.model_copy(update={"limits": limits})
    result = validate_compendium(b" " * 5000, schema)
    assert result.violations[0].reason == "document is 5000 bytes; the limit is 1000 bytes"


def test_too_many_entries(valid_doc, small_schema):
    limits = small_schema.limits.model_copy(update={"scenarios": 3})
    schema = small_schema.model_copy(update={"limits": limits})
    valid_doc["scenarios"] = [
        {"tool_id": "weather", "text": f"scenario {i}"} for i in range(5)
    ]
    found = paths(validate_compendium(valid_doc, schema))
    assert found["$.scenarios"] == "5 entries; the limit is 3 per compendium"


@pytest.mark.parametrize(
    "raw, expected",
    [
        ('{"scenarios": [NaN]}', "not valid JSON: NaN is not a valid JSON number"),
        ('{"a": 1, "a": 2}', 'not valid JSON: duplicate key "a" in one object'),
        ("{not json", "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ("[]", "a compendium must be a JSON object"),
    ],
)
def test_malformed_json(small_schema, raw, expected):
    result = validate_compendium(raw, small_schema)
    assert [v.reason for v in result.violations] == [expected]


@pytest.mark.parametrize(
    "raw",
    [
        None,  # the valid document itself
        b'{"a": 1, "a": 2}',  # duplicate keys: orjson would keep the last
        b'{"a": "x:y", "a": "\\u003a"}',  # duplicates with an escaped colon
        b'{"n": 123456789012345678901234}',  # past 64 bits: orjson would make it a float
        b'{"n": 18446744073709551615, "m": -9223372036854775809}',
        b'{"x": NaN}',
        b'{"x": 1e400}',
        b'{"x": "\\ud800"}',  # a lone surrogate
        b'\xef\xbb\xbf{"x": 1}',  # a byte order mark
        b'{"x": -0, "y": -0.0, "z": 1E5, "w": 2.5e-7, "v": "\\u00e9\\n\\t\\"", "u": [true, false, null]}',
        b'[' * 3000 + b']' * 3000,
        b'{"x": 1,}',
    ],
)
def test_fast_parser_gives_what_the_standard_parser_gives(valid_doc, small_schema, raw):
    """orjson reads a document only where it gives the standard parser's value (types and all);
    everything else (duplicates, long integers, NaN, surrogates, deep nesting, bad JSON) goes the
    standard way, with the standard messages."""
    import compendium.validation as validation

    data = json.dumps(valid_doc).encode() if raw is None else raw
    fast = validation.parse_document(data, 10**7, fast=True)
    standard = validation.parse_document(data, 10**7)
    assert fast[1] == standard[1]
    assert json.dumps(fast[0]) == json.dumps(standard[0])  # equal values of equal types
    assert repr(fast[0]) == repr(standard[0])
    with_orjson = validate_compendium(data, small_schema)
    orjson, validation.orjson = validation.orjson, None
    try:
        without = validate_compendium(data, small_schema)
    finally:
        validation.orjson = orjson
    assert with_orjson.violations == without.violations
    assert with_orjson.compendium == without.compendium
    if raw is None:
        assert validation._orjson_parse(data) is not validation._UNPARSED  # the fast path ran


def test_a_masking_seed_past_what_a_database_stores_is_a_violation(valid_doc, small_schema):
    doc = copy.deepcopy(valid_doc)
    doc["masking"] = {"strength": 1.0, "masked_fraction": 0.1, "seed": 10**4000}
    result = validate_compendium(json.dumps(doc), small_schema)
    assert not result.ok and any(v.path == "$.masking.seed" for v in result.violations)
    doc["masking"]["seed"] = 2**63 - 1
    assert validate_compendium(json.dumps(doc), small_schema).ok
