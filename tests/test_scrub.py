"""Scrubbing personal data from submitted text on arrival (pure function)."""

from __future__ import annotations

import pytest

from compendium.schema import AnnexTriple, Compendium, Precaution, PromptTemplate, Scenario
from compendium.scrub import scrub_compendium, scrub_text


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("mail jane.doe+x@example.co.uk about it", "mail [email] about it", "email"),
        ("pay with 4111 1111 1111 1111 now", "pay with [card] now", "card"),
        ("card 4111-1111-1111-1111", "card [card]", "card"),
        ("call +1 (555) 123-4567 today", "call [phone] today", "phone"),
        ("call 030 1234 5678", "call [phone]", "phone"),
        ("account 123456789012 is blocked", "account [number] is blocked", "number"),
        # written a digit at a time (masking leaves one-character tokens alone)
        ("ssn 1 2 3 4 5 6 7 8 9 please", "ssn [number] please", "number"),
        ("code 4-7-1-9-2-2", "code [number]", "number"),
        # the forms masking removes and a round at λ = 0 let through the client whole
        ("write john(at)example(dot)org today", "write [email] today", "email"),
        ("write john @ example . com today", "write [email] today", "email"),
        ("mail john dot smith at gmail dot com now", "mail [email] now", "email"),
        ("log in as admin:hunter@dbserver", "log in as admin:[email]", "email"),
        ("my pin is four eight two one five six", "my pin is [number]", "number"),
        ("ssn 4 eight 2 one, 5 six 7", "ssn [number]", "number"),
        ("call Nine-Zero-Seven-Five-Five-Five", "call [number]", "number"),
    ],
)
def test_personal_data_is_replaced(text, expected, kind):
    result = scrub_text(text)
    assert result.text == expected
    assert result.counts[kind] == 1
    assert result.total == 1


@pytest.mark.parametrize(
    "text",
    [
        "Will it rain tomorrow in Paris?",
        "Convert 100 USD to EUR in 2024",
        "Book a flight on 2024-05-01 for 2 adults",
        "Version 3.11 of Python, port 8080",
        "the user@ sign alone",
        "rate it 4 5 stars",
        "version 1.2.3 of the app",
        "top 5 movies of 2023",
        "one or two tickets for three people at four",
        "pages 1, 2, 3, 4, 5, 6 of the report",
        "meet me at the dot com museum",
        "stocks at the dot com bubble",
        "email (at) most one person",
    ],
)
def test_ordinary_text_is_left_alone(text):
    result = scrub_text(text)
    assert result.text == text
    assert result.total == 0


def test_card_like_number_failing_luhn_is_still_a_long_number():
    # 16 digits that are not a valid card number: still removed, as a long digit string.
    assert scrub_text("ref 1234567812345678").text == "ref [number]"


def test_compendium_texts_are_scrubbed_and_collisions_merged():
    compendium = Compendium(
        scenarios=[
            Scenario(tool_id="mail", text="write to a@b.org about the invoice"),
            Scenario(tool_id="mail", text="write to c@d.org about the invoice", support=2),
            Scenario(tool_id="mail", text="draft a reply"),
        ],
        precautions=[Precaution(tool_id="mail", text="never send 4111111111111111")],
        templates=[PromptTemplate(tool_id="mail", signature="send(to)", template="To: x@y.com")],
        annex=[AnnexTriple(subject="mail", relation="owner", object="bob@corp.com")],
    )
    scrubbed, removed = scrub_compendium(compendium)
    assert removed == 5
    texts = {s.text: s.support for s in scrubbed.scenarios}
    assert texts == {"write to [email] about the invoice": 3, "draft a reply": 1}
    assert scrubbed.precautions[0].text == "never send [card]"
    assert scrubbed.templates[0].template == "To: [email]"
    assert scrubbed.annex[0].object == "[email]"
    # The input is not modified.
    assert compendium.scenarios[0].text == "write to a@b.org about the invoice"
