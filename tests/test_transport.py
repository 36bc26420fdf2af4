"""RFC 9842 dcz bodies (compendium.transport): round trip, the dictionary named by its hash, and
every malformed or oversized body refused with a reason, never inflated past the limit."""

from __future__ import annotations

import gzip
import hashlib

import pytest
import zstandard

from compendium import transport
from compendium.canonical import canonical_bytes
from compendium.schema import Compendium, Schema, ToolSpec


@pytest.fixture
def schema():
    return Schema(
        tools=[
            ToolSpec(tool_id="weather", name="Weather", description="Forecasts for a city"),
            ToolSpec(tool_id="flights", name="Flights", description="Search flights"),
        ]
    )


def test_round_trip_names_the_dictionary_by_its_sha256(valid_doc):
    dictionary = canonical_bytes(Compendium.model_validate(valid_doc))
    data = canonical_bytes(Compendium.model_validate({**valid_doc, "precautions": []}))
    body = transport.compress(data, dictionary)
    assert body[:8] == transport.HEADER_MAGIC  # a 32-byte zstd skippable frame...
    assert body[8:40] == hashlib.sha256(dictionary).digest()  # ...holding the dictionary's hash
    assert transport.body_dictionary_hash(body) == transport.dictionary_hash(dictionary)
    assert transport.decompress(body, dictionary, limit=len(data)) == data
    # Any standard zstd decoder reads the stream after the header with the same raw dictionary.
    raw = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    assert zstandard.ZstdDecompressor(dict_data=raw).decompress(body[40:]) == data
    # zstd's strongest level (bench/dcz_dictionaries.py measures it): the server decodes it alike
    strongest = transport.compress(data, dictionary, level=22)
    assert strongest[:40] == body[:40]
    assert transport.decompress(strongest, dictionary, limit=len(data)) == data


def test_a_dictionary_that_shares_the_text_beats_gzip(valid_doc):
    pulled = Compendium.model_validate(valid_doc)
    sent = pulled.model_copy(update={"metadata": []})  # nearly all of it already published
    data = canonical_bytes(sent)
    with_dictionary = transport.compress(data, transport.global_dictionary(pulled))
    assert len(with_dictionary) < len(gzip.compress(data, 9)) / 2


def test_the_schema_dictionary_does_not_depend_on_the_order_of_the_tools_and_fields(schema):
    """A client whose schema lists the tools in its registry file's order holds the dictionary
    of the server's schema, which lists them by tool id."""
    shuffled = schema.model_copy(update={"tools": list(reversed(schema.tools)),
                                         "numeric_fields": list(reversed(schema.numeric_fields))})
    assert [t.tool_id for t in shuffled.tools] != [t.tool_id for t in schema.tools]
    assert transport.schema_dictionary(shuffled) == transport.schema_dictionary(schema)


def test_the_schema_dictionary_is_the_same_bytes_on_both_sides(schema):
    again = Schema.model_validate_json(schema.model_dump_json())  # as schema.json is read back
    assert transport.schema_dictionary(again) == transport.schema_dictionary(schema)
    renamed = ToolSpec(tool_id="flights", name="Flights", description="Book flights")
    changed = Schema(tools=[schema.tools[0], renamed])
    assert transport.schema_dictionary(changed) != transport.schema_dictionary(schema)


def _frame(data: bytes, dictionary: bytes, **options) -> bytes:
    raw = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdCompressor(dict_data=raw, **options).compress(data)


DICTIONARY = b"a shared dictionary of routing text " * 4
HEADER = transport.HEADER_MAGIC + hashlib.sha256(DICTIONARY).digest()


@pytest.mark.parametrize(
    "body, error, message",
    [
        (b"{}", transport.DczError, "must start with the 40-byte skippable frame"),
        (HEADER[:30], transport.DczError, "must start with the 40-byte skippable frame"),
        (HEADER + b"not zstd at all", transport.DczError, "not readable"),
        (
            HEADER + _frame(b"x" * 100, DICTIONARY, write_content_size=False),
            transport.DczError,
            "must declare its content size",
        ),
        # 10 MB of spaces is a few hundred bytes: refused from the declared size, never inflated.
        (HEADER + _frame(b" " * 10_000_000, DICTIONARY), transport.DczTooLarge, "would be 10000000"),
        (HEADER + _frame(b"x" * 100, DICTIONARY) + b"junk", transport.DczError, "does not decompress"),
        (HEADER + _frame(b"x" * 100, DICTIONARY)[:-3], transport.DczError, "does not decompress"),
        (
            transport.HEADER_MAGIC + hashlib.sha256(b"another one").digest() + _frame(b"x", DICTIONARY),
            transport.DczError,
            "another dictionary",
        ),
    ],
)
def test_a_bad_body_is_refused_with_its_reason(body, error, message):
    with pytest.raises(error, match=message):
        transport.decompress(body, DICTIONARY, limit=5000)


def test_a_dictionary_needs_eight_bytes():
    with pytest.raises(ValueError, match="at least 8 bytes"):
        transport.compress(b"data", b"short")


def test_the_probe_dictionary_puts_the_public_requests_before_the_schema(schema):
    probe = ["What will the weather be like in Paris this weekend?",
             "Can you find me a cheap flight from Boston to Denver next Friday?"]
    dictionary = transport.probe_dictionary(schema, probe)
    assert dictionary == transport.probe_bytes(probe) + transport.schema_dictionary(schema)
    assert transport.probe_dictionary(schema, []) == transport.schema_dictionary(schema)
    # A first-round request worded like the public ones costs fewer bytes against it.
    data = b'{"scenarios":[{"text":"What will the weather be like in [MASK] this weekend?",' \
           b'"tool_id":"weather"}]}'
    with_probe = transport.compress(data, dictionary)
    assert len(with_probe) < len(transport.compress(data, transport.schema_dictionary(schema)))
    assert transport.decompress(with_probe, dictionary, limit=len(data)) == data


def test_a_probe_set_document_is_checked_against_its_sha256():
    texts = ["Book a flight to Rome", "Weather in Oslo"]
    sha256 = transport.dictionary_hash(transport.probe_bytes(texts))
    assert transport.probe_texts_of({"count": 2, "sha256": sha256, "texts": texts}) == texts
    with pytest.raises(ValueError, match="does not match its texts"):
        transport.probe_texts_of({"sha256": sha256, "texts": texts[:1]})
    for bad in ([], {"texts": "Weather in Oslo"}, {"texts": [1, 2]}):
        with pytest.raises(ValueError, match="'texts' is a list of strings"):
            transport.probe_texts_of(bad)
    # Its labels: (request, tool) pairs, None from a server that does not send them.
    labelled = {"count": 2, "sha256": sha256, "texts": texts, "tools": ["flights", "weather"]}
    assert transport.probe_labelled_of(labelled) == [("Book a flight to Rome", "flights"),
                                                  ("Weather in Oslo", "weather")]
    assert transport.probe_labelled_of({"sha256": sha256, "texts": texts}) is None
    with pytest.raises(ValueError, match="1 tool id"):
        transport.probe_labelled_of(dict(labelled, tools=["flights"]))
    for tools in ("weather", ["flights", ""], ["flights", 3]):
        with pytest.raises(ValueError, match="'tools' is not a list of tool ids"):
            transport.probe_labelled_of(dict(labelled, tools=tools))


def test_a_probe_request_without_a_tool_is_no_label_to_route_with():
    """`labels` (a tool id, or null for a tool the registry does not offer) is read before
    `tools`; a request labelled null is no pair, though it stays a request of the dictionary."""
    texts = ["Book a flight to Rome", "Weather in Oslo"]
    sha256 = transport.dictionary_hash(transport.probe_bytes(texts))
    document = {"count": 2, "sha256": sha256, "texts": texts, "labels": [None, "weather"]}
    assert transport.probe_texts_of(document) == texts
    assert transport.probe_labelled_of(document) == [("Weather in Oslo", "weather")]
    assert transport.probe_labelled_of(dict(document, labels=[None, None])) == []
    # `labels` is what a server that sends it means, whatever `tools` says.
    assert transport.probe_labelled_of(dict(document, tools=["flights", "weather"])) == [
        ("Weather in Oslo", "weather")]
    with pytest.raises(ValueError, match="1 label"):
        transport.probe_labelled_of(dict(document, labels=["weather"]))
    for labels in ("weather", ["flights", ""], ["flights", 3]):
        with pytest.raises(ValueError, match="'labels' is not a list of tool ids and nulls"):
            transport.probe_labelled_of(dict(document, labels=labels))
