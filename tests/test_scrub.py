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
        # a dot bracketed as written, "[.]"; an ideographic full stop for a dot (IDNA)
        ("write john at example [.] com today", "write [email] today", "email"),
        ("write john\u3002doe＠example\u3002com today", "write [email] today", "email"),
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
        "ends at a full stop (.) then more",
        "北京。上海。 are cities",
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


# Precondition flag names are identifiers sent as written (neither masked nor scrubbed): one that
# spells out an account, a card, a phone or an e-mail address left the client whole and was
# published in the global compendium. `_`, `.` and `:` separate an identifier's words.
PERSONAL_FLAGS = [
    ("555-123-4567", "1 phone number"),
    ("555_123_4567", "1 phone number"),
    ("555:123:4567", "1 phone number"),
    ("tel:5551234567", "1 long number"),
    ("4111111111111111", "1 card number"),
    ("card_4111_1111_1111_1111", "1 card number"),
    ("acct_12345678", "1 long number"),
    ("iban_DE89370400440532013000", "1 long number"),
    ("john_at_example_dot_com", "1 e-mail address"),
    ("john.smith_at_gmail_dot_com", "1 e-mail address"),
    ("five_five_five_one_two_three_four", "1 long number"),
    ("ssn_1_2_3_4_5_6_7_8_9", "1 long number"),
]
# Condition names as clients write them (the tests', the bench's, MetaTool-like ones): none is
# personal data, whatever digits, dots or number words they hold.
ORDINARY_FLAGS = [
    "has_city", "needs_city", "outdoor", "online", "is_weekend", "lang:en", "v2",
    "retry_count_gt_3", "api.v2", "region:eu-west-1", "locale:en-US", "after_2024_01_01",
    "max_tokens_4096", "utf-8", "iso-8859-1", "http_status:404", "tz:utc-5", "has_phone",
    "has_email", "has_account", "is_at_home", "has_dot_com_domain", "ipv4_10.0.0.1", "py3.12",
    "gpt-4o-mini",
    "top_10_results", "page_1_2_3", "port_8080", "one_two_three", "step_one_of_three",
    *(f"flag_{i}" for i in range(32)),
]


@pytest.mark.parametrize(("name", "found"), PERSONAL_FLAGS)
def test_a_flag_name_holding_personal_data_says_what(name, found):
    from compendium.scrub import flag_name_holds

    assert flag_name_holds(name) == found


@pytest.mark.parametrize("name", ORDINARY_FLAGS)
def test_an_ordinary_flag_name_holds_nothing(name):
    from compendium.scrub import flag_name_holds

    assert flag_name_holds(name) == ""


def test_personal_flag_names_are_violations_at_their_scenario_never_echoed():
    from compendium.scrub import personal_flag_names

    compendium = Compendium(scenarios=[
        Scenario(tool_id="weather", text="rain?", preconditions={"has_city": True}),
        Scenario(tool_id="weather", text="snow?",
                 preconditions={"is_weekend": False, "555_123_4567": True,
                                "acct_12345678": False}),
    ])
    violations = personal_flag_names(compendium)
    assert [v.path for v in violations] == ["$.scenarios[1].preconditions"] * 2
    assert "flag name 2 of 3 holds 1 phone number" in violations[0].reason
    assert "flag name 3 of 3 holds 1 long number" in violations[1].reason
    assert not any("555" in v.reason or "12345678" in v.reason for v in violations)
    ordinary = Compendium(scenarios=[
        Scenario(tool_id="weather", text="rain?",
                 preconditions=dict.fromkeys(ORDINARY_FLAGS[:32], True)),
    ])
    assert personal_flag_names(ordinary) == []


def test_a_percent_encoded_email_address_is_scrubbed():
    """"%40" is how a URL writes "@": an address copied from one reached the server whole in a
    round at λ = 0."""
    result = scrub_text("forward to margaret.thornbury%40contoso.com please")
    assert result.text == "forward to [email] please"
    assert result.counts["email"] == 1
    assert scrub_text("a 40% discount at contoso.com").total == 0


def test_an_email_address_at_an_ip_literal_is_scrubbed():
    """ "jane@[192.168.0.1]" reached the server whole in a round at λ = 0."""
    result = scrub_text("mail to jane@[192.168.0.1] today")
    assert result.text == "mail to [email] today" and result.counts["email"] == 1
