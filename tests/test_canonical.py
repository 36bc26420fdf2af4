from __future__ import annotations

import gzip
import json
import random

import pytest

from compendium.canonical import canonical_bytes, canonical_form
from compendium.validation import load_valid_compendium


def shuffled(doc: dict, seed: int) -> dict:
    rng = random.Random(seed)

    def walk(value):
        if isinstance(value, dict):
            items = list(value.items())
            rng.shuffle(items)
            return {k: walk(v) for k, v in items}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    out = walk(doc)
    for name in ("metadata", "scenarios", "precautions", "templates", "annex"):
        rng.shuffle(out[name])
    return out


def test_same_compendium_same_bytes_under_key_and_entry_order(valid_doc, small_schema):
    reference = canonical_bytes(load_valid_compendium(valid_doc, small_schema))
    for seed in range(20):
        variant = load_valid_compendium(json.dumps(shuffled(valid_doc, seed)), small_schema)
        assert canonical_bytes(variant) == reference


def test_canonical_bytes_change_with_content(valid_doc, small_schema):
    before = canonical_bytes(load_valid_compendium(valid_doc, small_schema))
    valid_doc["scenarios"][0]["text"] += "!"
    assert canonical_bytes(load_valid_compendium(valid_doc, small_schema)) != before


def test_canonical_form_sizes_and_round_trip(valid_doc, small_schema):
    compendium = load_valid_compendium(valid_doc, small_schema)
    form = canonical_form(compendium)
    assert form.size_bytes == len(form.data)
    assert 0 < form.gzip_bytes
    assert canonical_form(compendium).sha256 == form.sha256
    again = load_valid_compendium(form.data, small_schema)
    assert canonical_bytes(again) == form.data
    assert gzip.decompress(gzip.compress(form.data)) == form.data


def test_non_ascii_text_is_kept_as_utf8(valid_doc, small_schema):
    valid_doc["scenarios"][0]["text"] = "Wetter in München morgen?"
    data = canonical_bytes(load_valid_compendium(valid_doc, small_schema))
    assert "München".encode() in data


def test_scenarios_sharing_tool_and_text_are_ordered_by_their_preconditions(small_schema):
    """Scenarios are sorted by (tool, text) alone when those pairs are unique (the usual case);
    when two share them, their preconditions (as JSON) decide, as the full key says."""
    from compendium.canonical import _SORT_KEYS, canonical_dict

    flags = [{"b": True}, {}, {"a": True, "z": False}, {"a": False}]
    scenarios = [
        {"tool_id": tool, "text": text, "preconditions": f}
        for tool in ("weather", "flights")
        for text in ("Book it", "Check it")
        for f in flags
    ]
    for seed in range(5):
        random.Random(seed).shuffle(scenarios)
        for doc_scenarios in (scenarios, scenarios[::4]):  # shared pairs; then (mostly) unique
            compendium = load_valid_compendium({"scenarios": doc_scenarios}, small_schema)
            ordered = canonical_dict(compendium)["scenarios"]
            expected = sorted(
                (dict(s) for s in ordered), key=_SORT_KEYS["scenarios"]
            )
            assert ordered == expected
            assert [(s["tool_id"], s["text"]) for s in ordered] == sorted(
                (s["tool_id"], s["text"]) for s in ordered
            )


def test_fast_encoder_writes_the_bytes_json_dumps_writes():
    """orjson's bytes are used only where they are json.dumps's (sorted keys, compact, UTF-8):
    numbers json.dumps writes with an exponent, and NaN, go the standard way."""
    import math
    import struct

    from compendium.canonical import encode_document

    def standard(doc):
        return json.dumps(
            doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()

    rng = random.Random(3)
    values = [0.0, -0.0, 1.0, 0.1, 1e-4, 9.99e-5, 1e-5, 1e-7, 1e15, 1e16, 1.5e16, 1e22, 5e-324,
              12345678901234567, 2**63, -(2**63), 0.30000000000000004, "x\ty\n\"\\é漢\U0001f600\u2028"]
    for _ in range(20000):
        bits = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        values.append(bits if math.isfinite(bits) else rng.random())
        values.append(rng.random() * 10 ** rng.randint(-12, 20))
    for value in values:
        for doc in ({"b": value, "a": [value, 1]}, {"z": {"y": value}}):
            assert encode_document(doc) == standard(doc), value
    with pytest.raises(ValueError):
        encode_document({"x": float("nan")})


def test_fields_at_their_defaults_are_left_out_and_read_back_the_same():
    from compendium.canonical import canonical_dict, entry_size
    from compendium.schema import Compendium

    compendium = Compendium.model_validate({
        "scenarios": [
            {"tool_id": "weather", "text": "Rain in Paris?"},
            {"tool_id": "weather", "text": "Snow in Oslo?", "support": 3,
             "preconditions": {"needs_city": True}},
        ],
        "precautions": [
            {"tool_id": "weather", "text": "Do not use weather for flights"},
            {"tool_id": "weather", "text": "Do not use weather for trains", "support": 2},
        ],
    })
    doc = canonical_dict(compendium)
    assert doc["scenarios"] == [
        {"text": "Rain in Paris?", "tool_id": "weather"},
        {"preconditions": {"needs_city": True}, "support": 3, "text": "Snow in Oslo?",
         "tool_id": "weather"},
    ]
    assert doc["precautions"][0] == {"text": "Do not use weather for flights", "tool_id": "weather"}
    assert doc["precautions"][1]["support"] == 2
    assert Compendium.model_validate_json(canonical_bytes(compendium)) == compendium
    # an entry's size is what it adds to the document
    alone = compendium.model_copy(update={"scenarios": compendium.scenarios[:1], "precautions": []})
    empty = compendium.model_copy(update={"scenarios": [], "precautions": []})
    assert len(canonical_bytes(alone)) - len(canonical_bytes(empty)) == entry_size(
        "scenarios", compendium.scenarios[0]
    ) - 1


def test_canonical_positions_name_each_canonical_entry_in_the_compendiums_own_order(valid_doc,
                                                                                   small_schema):
    from compendium.canonical import _canonical_entry, canonical_dict, canonical_positions
    from compendium.schema import Compendium, Scenario

    for seed in range(10):
        variant = load_valid_compendium(json.dumps(shuffled(valid_doc, seed)), small_schema)
        mine = variant.model_dump(mode="json", exclude_none=True)
        canonical = canonical_dict(variant)
        positions = canonical_positions(variant)
        for name, order in positions.items():
            assert sorted(order) == list(range(len(mine[name])))
            assert [_canonical_entry(name, mine[name][i]) for i in order] == canonical[name]
    # equal entries (duplicates the server refuses) keep their relative order, as the sort does
    twins = Compendium(scenarios=[
        Scenario(tool_id="weather", text="b"), Scenario(tool_id="weather", text="a", support=2),
        Scenario(tool_id="weather", text="a", support=3),
        Scenario(tool_id="weather", text="a", preconditions={"f": True}),
    ])
    assert canonical_positions(twins)["scenarios"] == [3, 1, 2, 0]  # '{"f"' sorts before '{}'
    assert [s["support"] for s in canonical_dict(twins)["scenarios"][1:3]] == [2, 3]
