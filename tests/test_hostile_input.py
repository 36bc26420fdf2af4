"""Property-based: whatever a client sends, validation answers with violations, never raises."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compendium.validation import validate_compendium

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=40,
)

entry_keys = st.sampled_from(["tool_id", "text", "preconditions", "support", "signature", "template",
                              "subject", "relation", "object", "stats", "description", "spec"])
entries = st.dictionaries(entry_keys, json_values, max_size=6)
compendium_like = st.fixed_dictionaries(
    {},
    optional={
        "schema_version": json_values,
        "metadata": st.lists(entries, max_size=4) | json_values,
        "scenarios": st.lists(entries, max_size=4) | json_values,
        "precautions": st.lists(entries, max_size=4),
        "templates": st.lists(entries, max_size=4),
        "annex": st.lists(entries, max_size=4),
        "masking": json_values,
        "extra": json_values,
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(doc=compendium_like)
def test_random_compendium_like_documents_never_raise(small_schema, doc):
    result = validate_compendium(doc, small_schema)
    if not result.ok:
        assert result.compendium is None
        assert all(v.path.startswith("$") and v.reason for v in result.violations)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(raw=st.binary(max_size=300))
def test_random_bytes_never_raise(small_schema, raw):
    result = validate_compendium(raw, small_schema)
    assert result.ok == (result.compendium is not None)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(doc=json_values)
def test_random_json_text_never_raises(small_schema, doc):
    result = validate_compendium(json.dumps(doc), small_schema)
    assert result.ok == (result.compendium is not None)
    if result.ok:  # only an object with nothing but known, empty-able components passes
        assert isinstance(doc, dict) and not set(doc) - {"metadata", "scenarios", "precautions",
                                                        "templates", "annex", "masking"}
