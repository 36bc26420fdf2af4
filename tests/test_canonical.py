from __future__ import annotations

import gzip
import json
import random

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
