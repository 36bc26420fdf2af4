"""Token-saliency masking with strength λ: planted personal data goes, routing words stay, and a
larger λ never masks less."""

from __future__ import annotations

import random

import pytest

from compendium.masking import (
    PLACEHOLDERS,
    TextMasker,
    share,
    threshold,
    tokenize,
    without_placeholders,
)
from tests.client_fixtures import PLANTED, metatool, plant

LAMBDAS = [0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0]


def masker(strength: float, seed: int = 0) -> TextMasker:
    return TextMasker.for_registry(metatool().tools, strength=strength, seed=seed)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    rng = random.Random(7)
    queries = [q.query for q in rng.sample(metatool().queries, 700)]
    return queries + [plant(q, i) for i, q in enumerate(queries[:300])]


def test_planted_names_emails_phones_and_numbers_are_removed_at_lambda_1():
    m = masker(1.0)
    sentence = (
        "Please check the weather forecast for my flight, my manager Margaret Thornbury "
        "(margaret.thornbury@example.org, +1 415 555 0199) booked ticket 48213 via "
        "https://travel.example.com/booking?id=PX77Q and order AB-99812."
    )
    out = m.mask(sentence).text
    for secret in ("Margaret", "Thornbury", "margaret.thornbury@example.org", "415", "0199",
                   "48213", "travel.example.com", "PX77Q", "AB-99812"):
        assert secret not in out, (secret, out)
    for kept in ("weather", "forecast", "flight", "manager", "booked", "ticket", "order"):
        assert kept in out, (kept, out)
    for label in ("[NAME]", "[EMAIL]", "[PHONE]", "[NUMBER]", "[URL]", "[ID]"):
        assert label in out, (label, out)


def test_planted_data_in_real_queries_never_survives_lambda_1(texts):
    m = masker(1.0)
    secrets = {part for name, email, phone, number in PLANTED
               for part in (*name.split(), email, phone, number)}
    planted = [t for t in texts if "My colleague" in t]
    assert len(planted) == 300
    for text in planted:
        out = m.mask(text).text
        assert not [s for s in secrets if s in out], out


def test_tool_relevant_words_are_kept(texts):
    """Words of the public registry are never masked (they carry the routing meaning)."""
    m = masker(1.5)
    vocabulary = m.protected
    kept = total = 0
    for text in texts[:400]:
        out_tokens = {t.text.lower() for t in tokenize(m.mask(text).text)}
        for token in tokenize(text):
            if token.kind == "word" and token.text.lower() in vocabulary:
                total += 1
                kept += token.text.lower() in out_tokens
    assert total > 1000
    assert kept == total


def test_lambda_zero_masks_nothing(texts):
    m = masker(0)
    for text in texts:
        result = m.mask(text)
        assert result.text == text
        assert result.masked_tokens == 0


def test_masking_is_monotone_in_lambda(texts):
    """The masked set at a larger λ contains the masked set at a smaller one, text by text."""
    maskers = [masker(lam) for lam in LAMBDAS]
    totals = [0] * len(LAMBDAS)
    words = 0
    for text in texts:
        sets = [m.mask(text).masked_indices for m in maskers]
        for smaller, larger in zip(sets, sets[1:], strict=False):
            assert smaller <= larger, text
        for i, chosen in enumerate(sets):
            totals[i] += len(chosen)
        words += sum(t.is_word for t in tokenize(text))
    fractions = [t / words for t in totals]
    assert fractions[0] == 0
    assert all(a <= b for a, b in zip(fractions, fractions[1:], strict=False))
    # it really grows: 0 < λ=0.5 < λ=1 < λ=1.5
    by_lambda = dict(zip(LAMBDAS, fractions, strict=True))
    assert 0 < by_lambda[0.5] < by_lambda[1.0] < by_lambda[1.5]


def test_threshold_falls_and_share_grows_with_lambda():
    grid = [i / 10 for i in range(0, 80)]
    assert threshold(0) == 1 and share(0) == 0
    assert all(threshold(a) > threshold(b) for a, b in zip(grid, grid[1:], strict=False))
    assert all(share(a) < share(b) for a, b in zip(grid, grid[1:], strict=False))


def test_deterministic_for_a_seed(texts):
    one, other = masker(0.75, seed=4), masker(0.75, seed=4)
    first = [one.mask(t).text for t in texts]
    assert first == [other.mask(t).text for t in texts]
    assert first == [one.mask(t).text for t in texts]


def test_seed_breaks_ties():
    # twenty copies of one moderately rare word: equal saliency (about 0.46) below θ(0.3) = 0.74,
    # so only the share rule masks, floor(ρ(0.3)·20) = 1 of them; the seed picks which
    text = " ".join(["kayak"] * 20)
    outs = {TextMasker(strength=0.3, seed=s).mask(text).text for s in range(12)}
    assert all(out.count("[MASK]") == 1 for out in outs)
    assert len(outs) > 1
    assert TextMasker(strength=0.3, seed=5).mask(text) == TextMasker(strength=0.3, seed=5).mask(text)


def test_placeholders_and_template_slots_are_never_masked_again():
    m = masker(10.0)
    first = m.mask("Send the forecast for {city} to Oswald Pemberton at o.p@mail.net", slots=True)
    assert "{city}" in first.text
    second = m.mask(first.text, slots=True)
    assert second.text == first.text
    for token in tokenize(first.text):
        if token.kind == "placeholder":
            assert token.text.strip("[]") in PLACEHOLDERS


def test_same_placeholder_runs_collapse_to_one():
    out = masker(1.0).mask("please tell Ingrid Maria Vasquez about it").text
    assert "[NAME]" in out and "[NAME] [NAME]" not in out


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_invalid_strength_is_refused(bad):
    with pytest.raises(ValueError, match="masking strength"):
        TextMasker(strength=bad)


def test_without_placeholders_leaves_the_words_the_mask_kept():
    assert without_placeholders("Book a flight to [NAME]  on [NUMBER], please") == \
        "Book a flight to on , please"
    assert without_placeholders("Weather in Paris\ntomorrow") == "Weather in Paris\ntomorrow"
    assert without_placeholders("a {city} slot and [brackets]") == "a {city} slot and [brackets]"
    assert without_placeholders("[MASK] [NAME]") == "[MASK] [NAME]"
    masked = masker(3.0).mask("Send the invoice to jane.doe@example.com about order AB-12345").text
    assert "[EMAIL]" in masked and not any(f"[{p}]" in without_placeholders(masked)
                                           for p in PLACEHOLDERS)


def test_shared_words_are_released_except_where_they_stand_as_names():
    sentence = "Track the ethereum price at dawn, as Margaret Thornbury asked on 48213"
    plain = masker(1.0).mask(sentence).text
    assert "ethereum" not in plain  # rare in English: masked at λ = 1
    shared = masker(1.0).sharing({"ethereum", "margaret", "thornbury"}).mask(sentence).text
    assert "ethereum" in shared
    for secret in ("Margaret", "Thornbury", "48213"):  # a name stays a name, a number a number
        assert secret not in shared, shared
    # At the start of a sentence a capitalized word is an ordinary word.
    assert "Ethereum" in masker(1.0).sharing({"ethereum"}).mask("Ethereum price now?").text


def test_masked_text_has_no_residue_at_its_strength_whatever_the_shared_words(texts):
    """What the server checks of a client's masking (`residue`) never refuses what masking at
    the same λ sent, with or without shared words, on real queries with planted personal data
    and on the same texts in capitals, across lines and with extra sentences."""
    variants = texts + [t.upper() for t in texts[:100]] + [t.replace(" ", "\n", 3) for t in texts[100:200]]
    variants += [t + " Call 555-1234 or Ms. O'Brien-Smith at A1b2. Then 7." for t in texts[200:300]]
    every_word = {t.text.lower() for v in variants for t in tokenize(v) if t.kind == "word"}
    for strength in (0.05, 0.5, 1.0, 3.0):
        for shared in (set(), every_word):
            m = masker(strength, seed=3).sharing(shared)
            for text in variants:
                out = m.mask(text).text
                assert m.residue(out) == [], (strength, bool(shared), text, out)


def test_residue_finds_what_masking_removes_from_any_text():
    """Unmasked, the planted data is found, by kind and place; plain words are not judged (a word
    enough users wrote is released, and the server cannot tell), nor are registry words."""
    m = masker(1.0)
    text = plant("Find me a weather forecast", 0)
    found = {(r.kind, text[r.start:r.end]) for r in m.residue(text)}
    assert found == {
        ("NAME", "Margaret"), ("NAME", "Thornbury"), ("EMAIL", "margaret.thornbury@example.org"),
        ("PHONE", "+1 415 555 0199"), ("NUMBER", "48213"),
    }
    assert m.residue("horoscope for ethereum dealership bedrooms") == []
    assert masker(0).residue(text) == []
    # λ = 0.5 keeps a two-digit number (saliency 0.6 under θ = 0.61); λ = 1 does not
    assert masker(0.5).residue("rain in 10 days") == []
    assert [r.kind for r in masker(1.0).residue("rain in 10 days")] == ["NUMBER"]


def test_masking_residue_names_each_text_by_path_and_never_its_words():
    from compendium.schema import Compendium, Precaution, Scenario
    from compendium.scrub import masking_residue

    leaking = plant("Find me a weather forecast", 1)
    compendium = Compendium(
        scenarios=[Scenario(tool_id="a", text="weather please"), Scenario(tool_id="b", text=leaking)],
        precautions=[Precaution(tool_id="a", text="Do not use a for Ms. Pemberton")],
    )
    violations = masking_residue(compendium, masker(1.0))
    assert [v.path for v in violations] == ["$.scenarios[1].text", "$.precautions[0].text"]
    assert "2 names" in violations[0].reason and "1 e-mail address" in violations[0].reason
    for secret in ("Oswald", "Pemberton", "mailhost", "7946", "772910"):
        assert all(secret not in v.reason for v in violations)


def test_the_residue_shortcut_never_hides_what_the_tokens_show(texts):
    """`residue` skips the tokenizer on texts its pattern clears; on raw, capitalized, re-lined,
    bracketed and masked texts it finds exactly what tokenizing finds, at three strengths."""
    variants = texts + [t.title() for t in texts[:200]] + [t.upper() for t in texts[200:300]]
    variants += [t.replace(" ", "\n", 2) for t in texts[300:400]]
    variants += [t.replace(". ", ". [NAME] ").replace(" ", "  (", 2) for t in texts[400:500]]
    variants += ["hi. [NAME] Bob", "x [Bob", "we O'Brien", "a\n Bob", "a \nBob", "a; Bob", "x_Bob"]
    for strength in (0.3, 1.0):
        for m in (masker(strength), TextMasker(strength)):
            masked = [m.mask(t).text for t in variants]
            for text in variants + masked:
                assert m.residue(text) == m._tokenized_residue(text), (strength, text)
    cleared = masker(1.0)
    assert sum(cleared._clear(cleared.mask(t).text) for t in texts) > 0.8 * len(texts)


def test_typographic_apostrophes_read_as_plain_ones():
    """"I’m" inside a sentence is the function word "i'm", not a name; a shared word written
    with either apostrophe is the same word."""
    out = masker(1.0).mask("Well, I’m sure I’ve seen Margaret’s car").text
    assert out.startswith("Well, I’m sure I’ve seen ") and "Margaret" not in out
    shared = masker(3.0).sharing({"dealership’s"}).mask("the dealership's hours").text
    assert "dealership's" in shared


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("will it rain at the office of Dr. Miller tomorrow", "Miller"),
        ("book a table for Mrs. Davis at eight", "Davis"),
        ("ask prof. Okonkwo about the schedule", "Okonkwo"),
        # titles of office and of other languages are titles too
        ("I asked Sen. Warren about the bill", "Warren"),
        ("a letter from Gov. Brown arrived", "Brown"),
        ("call Rep. King about the vote", "King"),
        ("ask Fr. Brown about the mass", "Brown"),
        ("Det. Black will call back", "Black"),
        ("a speech by Pres. Lincoln", "Lincoln"),
        ("book a room for Mme. Martin", "Martin"),
        ("ask Sra. Lopez about the order", "Lopez"),
    ],
)
def test_the_name_after_a_title_is_masked_as_a_name(text, kept):
    """A title's full stop starts no sentence: the surname after it is a name (before, it was
    scored as the first word of a sentence, and 72 of 80 common surnames stayed at λ = 1)."""
    m = masker(1.0)
    out = m.mask(text).text
    assert kept not in out and "[NAME]" in out
    assert m.residue(out) == []  # what masking leaves, the server's check takes
    # In raw text the server finds the surname as a name to remove.
    assert any(r.kind == "NAME" and text[r.start:r.end] == kept for r in m.residue(text))
    # A sentence that ends before a capitalized word is still a sentence.
    assert m.residue("It rained. Then it stopped") == []


@pytest.mark.parametrize(
    ("text", "secret", "kind"),
    [
        ("reach me at john.smith＠example．com", "john", "EMAIL"),
        # the ideographic full stop (and the half-width one, which NFKC makes it) is a dot of a
        # domain name to IDNA, and what a CJK input method types for one
        ("reach me at john\u3002smith＠example\u3002com", "john", "EMAIL"),
        ("reach me at john\uff61smith@example\uff61com", "john", "EMAIL"),
        ("call ⁴¹⁵⁵⁵⁵⁰¹⁹⁹ after lunch", "⁴¹⁵", "NUMBER"),
        ("the code is ①②③④⑤⑥⑦⑧⑨", "①", "NUMBER"),
        ("phone ４１５ ５５５ ０１９９ tonight", "５５５", "PHONE"),
    ],
)
def test_look_alike_characters_are_masked_and_checked_as_what_they_spell(text, secret, kind):
    """Full-width, superscript and circled characters spell an address or a number as well as
    plain ones: the client masks the text's NFKC form, and the server checks that form."""
    from compendium.builder import clean_text
    from compendium.masking import normalized

    m = masker(1.0)
    out = m.mask(clean_text(text)).text
    assert secret not in out and f"[{kind}]" in out
    assert kind in {r.kind for r in m.residue(normalized(text))}


def test_the_server_scrubs_what_look_alike_characters_spell():
    from compendium.scrub import scrub_text

    assert scrub_text("write to jane.doe＠gmail.com").text == "write to [email]"
    assert scrub_text("write to jane\u3002doe＠gmail\u3002com").text == "write to [email]"
    assert scrub_text("card 4111\u00a01111\u00a01111\u00a01111 please").text == "card [card] please"
    assert scrub_text("plain text stays as it is").counts == {"email": 0, "card": 0, "phone": 0, "number": 0}


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("email the contract to {margaret_thornbury} today", ["thornbury"]),
        ("remind me to call {Oswald_Pemberton_07700900123}", ["Oswald", "Pemberton", "0770"]),
        ("send the invoice for account {acct_4417123456789113}", ["4417"]),
        ("book a table for {Margaret} tonight", ["Margaret"]),
    ],
)
def test_braces_in_a_request_hold_words_not_slots(text, secrets):
    """`{slot}` is kept only in templates: in a request, braces are punctuation and what they
    hold is masked as any other word (before, "{margaret_thornbury}" left at λ = 1 as written,
    and the server's check skipped it too)."""
    m = masker(1.0)
    result = m.mask(text)
    assert result.masked_tokens > 0
    assert not [s for s in secrets if s in result.text], result.text
    assert m.residue(result.text) == []
    if text != text.lower():  # plain lower-case words are not the server's to judge
        assert m.residue(text) != []  # sent unmasked, the server finds it
    # in a template body the same braces are a slot, kept, and the server does not judge it
    template = m.mask("Call {city_name} with {query}", slots=True).text
    assert "{city_name}" in template and "{query}" in template
    assert m.residue("Call {Oswald_Pemberton} with {query}", slots=True) == []


def test_the_server_flags_brace_wrapped_names_in_scenarios_but_not_template_slots():
    from compendium.schema import Compendium, PromptTemplate, Scenario
    from compendium.scrub import masking_residue

    compendium = Compendium(
        scenarios=[Scenario(tool_id="a", text="remind me to call {Oswald_Pemberton} tomorrow")],
        templates=[PromptTemplate(tool_id="a", signature="call(name)",
                                  template="Call {Oswald_Pemberton} now")],
    )
    violations = masking_residue(compendium, masker(1.0))
    assert [v.path for v in violations] == ["$.scenarios[0].text"]
    assert "2 names" in violations[0].reason


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("deliver to Hauptstraße4b tomorrow", "4b"),
        ("ticket Ré5ABC123 status", "5ABC"),
        ("parcel for Øresund12 depot", "12"),
        ("the order ÄÖ-7731x arrived", "7731"),
    ],
)
def test_identifiers_with_letters_of_any_script_are_one_token(text, secret):
    """A run of letters and digits is an identifier whatever its letters: with ASCII-only
    classes "Hauptstraße4b" was a name and "4b", masked "[NAME]4b", which the server's check
    flags as an identifier."""
    m = masker(1.0)
    idents = [t.text for t in tokenize(text) if t.kind == "ident"]
    assert len(idents) == 1 and secret in idents[0]
    out = m.mask(text).text
    assert secret not in out and "[ID]" in out
    assert m.residue(out) == []


def test_masking_hashes_a_text_once_not_once_per_token(monkeypatch):
    """Ties were broken by hashing (seed, position, whole text) for every candidate token:
    quadratic in the text's length (20,000 tokens: 4.8 s). The bytes hashed are now linear."""
    import hashlib

    import compendium.masking as masking

    hashed = []

    class Counting:
        def blake2b(self, data=b"", **kwargs):
            hashed.append(len(data))
            return hashlib.blake2b(data, **kwargs)

    monkeypatch.setattr(masking, "hashlib", Counting())
    rng = random.Random(5)
    words = ["kayak", "Bravo", "lantern", "delta123", "harbor", "foxtrot", "Hotel", "57"]
    text = " ".join(rng.choice(words) for _ in range(3000))
    m = TextMasker(strength=0.5, seed=2)
    first = m.mask(text)
    assert first.masked_tokens > 0
    assert sum(hashed) < 2 * len(text.encode()) + 64 * 3000
    assert m.mask(text) == first  # deterministic
    # equal saliencies: the seed picks which of them the share rule takes
    kayaks = " ".join(["kayak"] * 3000)
    picks = {TextMasker(strength=0.3, seed=s).mask(kayaks).masked_indices for s in range(3)}
    assert len(picks) == 3


@pytest.mark.parametrize(
    ("text", "secret", "kind"),
    [
        ("reply to john.doe@example\u200b.com about it", "john", "EMAIL"),
        ("reply to john.doe@example\u2060.com about it", "john", "EMAIL"),
        ("reply to jo\u00adhn.doe@example\ufeff.com about it", "john", "EMAIL"),
        ("see ticket 4\u200b8\u200b2\u200b1\u200b3 please", "8", "NUMBER"),
        ("the code is 9\U000e00208\U000e00207\U000e00206\U000e00205 today", "8", "NUMBER"),
    ],
)
def test_invisible_characters_do_not_hide_what_a_text_spells(text, secret, kind):
    """A zero-width space, word joiner, soft hyphen, byte-order mark or tag character is not
    seen by whoever reads the text, but it split the tokens masking looks for: "john.doe@example
    [ZWSP].com" left the client whole at λ = 1 (its words are common), and the server's check
    found nothing in it. The client masks, and the server checks, the text without them."""
    from compendium.builder import clean_text
    from compendium.masking import normalized
    from compendium.schema import Compendium, Scenario
    from compendium.scrub import masking_residue

    m = masker(1.0)
    out = m.mask(clean_text(text)).text
    assert secret not in out and f"[{kind}]" in out, out
    assert kind in {r.kind for r in m.residue(normalized(text))}
    sent = Compendium(scenarios=[Scenario(tool_id="a", text=text)])  # as a submission's check
    assert [v.path for v in masking_residue(sent, m)] == ["$.scenarios[0].text"]


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("please reply to josé.garcía@empresa.es about it", "garcía"),
        ("please reply to müller.anna@example.de about it", "müller"),
        ("please reply to jоhn.smith@example.com about it", "smith"),  # a Cyrillic о
        ("please reply to anna.berg@bücherei.de about it", "berg"),
    ],
)
@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_an_email_address_with_letters_of_any_script_is_an_email_address(text, secret, strength):
    """The local part of an address may hold any letters (RFC 6531): with ASCII-only classes
    "josé.garcía@empresa.es" was two words and a domain, and at λ = 0.5 the name left the
    client; the server's check, reading the same tokens, found nothing to refuse, and its scrub
    took no address with a domain in other letters ("bücherei.de")."""
    from compendium.scrub import scrub_text

    m = masker(strength)
    out = m.mask(text).text
    assert secret not in out and "[EMAIL]" in out, out
    assert [r.kind for r in m.residue(text)] == ["EMAIL"]
    assert scrub_text(text).counts["email"] == 1  # and the server's scrub removes it


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("please call M\u0336a\u0336r\u0336g\u0336a\u0336r\u0336e\u0336t\u0336 now", "a\u0336r\u0336g"),
        ("please call Marg\u0332aret Thornbury now", "aret"),
        ("please call m\u0336a\u0336r\u0336g\u0336a\u0336r\u0336e\u0336t\u0336 now", "a\u0336r\u0336g"),
        ("order AB\u0332-99812 arrived", "99812"),
    ],
)
def test_a_word_with_combining_marks_is_one_word(text, secret):
    """A combining mark NFKC cannot fold into its letter (a strike-through or an underline) is
    part of the word it marks: before, "M̶a̶r̶g̶a̶r̶e̶t̶" was eight one-letter words, which masking
    never takes, and it left the client whole at any λ, the server's check finding nothing."""
    m = masker(1.0)
    out = m.mask(text).text
    assert secret not in out, out
    assert m.residue(out) == []
    if text != text.lower():  # plain lower-case words are not the server's to judge
        assert m.residue(text) != []


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("write to mary.o'brien@example.com today", ("mary", "brien")),
        ("write to mary.o\u2019brien@example.com today", ("mary", "brien")),  # typographic
        ("write to john&jane@example.com today", ("john",)),
        ("write to o'neill@dbserver today", ("neill",)),
    ],
)
def test_an_email_address_with_an_apostrophe_or_other_atext_is_one_address(text, secrets):
    """A local part may hold ' & ! # $ * / = ? ^ ` { | } ~ (RFC 5322's atext): "o'brien" is
    how an Irish surname is written in an address. The local part stopped at the apostrophe,
    so of "mary.o'brien@example.com" the name left the client and only "example.com" went, as
    a URL; the server's scrub took "brien@example.com" and left "mary.o'"."""
    from compendium.scrub import scrub_text

    _masked_whole(text, secrets, "EMAIL")
    assert masker(1.0).mask(text).text == "write to [EMAIL] today"
    assert scrub_text(text).text == "write to [email] today"


@pytest.mark.parametrize(
    "text",
    [
        "write to ade\u0301ba\u0301yo\u0323\u0300.okafor@example.com today",  # Yoruba ọ̀
        "write to j\u0301ohn.doe@example.com today",  # j with an acute: no precomposed form
    ],
)
def test_an_email_address_with_combining_marks_is_one_address(text):
    """A combining mark NFKC cannot fold into its letter split an address: what came before it
    was a word, which the shared-word rule released ("adébáyọ̀" that two users wrote left the
    client) and the server's scrub left in place, the address after it alone being taken."""
    from compendium.builder import clean_text
    from compendium.scrub import scrub_text

    text = clean_text(text)
    local = text.split(" ")[2].split("@")[0]
    m = masker(1.0).sharing(local.replace(".", " ").split())
    assert [t.kind for t in tokenize(text) if t.kind not in ("space",)].count("email") == 1
    out = m.mask(text).text
    assert out == "write to [EMAIL] today", out
    assert {r.kind for r in m.residue(text)} == {"EMAIL"}
    assert scrub_text(text).text == "write to [email] today"


@pytest.mark.parametrize(
    ("text", "secret", "strength"),
    [
        ("my pin is 4 8 2 1 please unlock the card", "4 8 2 1", 1.0),
        ("call me back on 4 8 2 1 3 5 5 tomorrow", "4 8 2", 1.0),
        ("the code is 4-8-2-1-3 for the door", "8-2-1", 1.0),
        ("ssn 123 45 6789 for the tax form", "45", 0.3),
    ],
)
def test_a_number_written_in_spaced_groups_is_one_number(text, secret, strength):
    """A number spelled a digit (or a few) at a time was a row of one-character tokens, which
    masking never takes: a PIN or a phone number written "4 8 2 1" left the client whole at any
    λ, and the server's check found nothing. Three or more groups are one number now."""
    m = masker(strength)
    out = m.mask(text).text
    assert secret not in out, out
    assert "[NUMBER]" in out, out
    assert m.residue(out) == []
    assert [r.kind for r in m.residue(text)] == ["NUMBER"]
    # two numbers in a sentence stay words of their own: nothing to join
    assert m.mask("rooms 2 and 3 for 4 nights").text == "rooms 2 and 3 for 4 nights"


def _masked_whole(text: str, secrets, placeholder: str, ignore: str = "") -> None:
    """`text` masked at λ = 1 holds none of `secrets` (outside `ignore`, a placeholder that may
    hold their characters) and `placeholder`; the server's check finds nothing left in the
    output and finds `placeholder` alone in the text sent unmasked."""
    m = masker(1.0)
    out = m.mask(text).text
    for secret in (secrets,) if isinstance(secrets, str) else secrets:
        assert secret not in (out.replace(ignore, "") if ignore else out), out
    assert f"[{placeholder}]" in out, out
    assert m.residue(out) == []
    assert {r.kind for r in m.residue(text)} == {placeholder}


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("my pin is four eight two one please unlock the card", ("four", "eight", "two")),
        ("call me at five five five, one two three four tomorrow", ("five", "three", "four")),
        ("my extension is Nine-Zero-Seven for the helpdesk", ("Nine", "Zero", "Seven")),
    ],
)
def test_a_number_spelled_out_in_words_is_one_number(text, secrets):
    """A PIN or a phone number written in number words ("four eight two one") was a row of
    common words, rarity 0, which masking never takes: it left the client whole at any λ and
    the server's check found nothing. A run of three or more number words is one number now,
    scored as the digits it spells; fewer stay words ("one or two", "top five")."""
    _masked_whole(text, secrets, "NUMBER")
    m = masker(1.0)
    for kept in ("book one or two rooms for ten nights", "the top five games of twenty twenty"):
        assert m.mask(kept).text == kept


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("mail john dot smith at gmail dot com about the invoice", ("john", "smith", "gmail")),
        ("write to john(at)example(dot)org for the refund", ("john", "example")),
        ("write to john [at] example.com for the refund", ("john", "example")),
        ("send it to jane.doe [at] corp [dot] co [dot] uk tonight", ("jane", "doe", "corp")),
        ("reply to john @ example . com today", ("john", "example")),
        ("contact Margaret {AT} thornbury {DOT} net please", ("Margaret", "thornbury")),
        # a dot bracketed as written, "[.]", as security notices defang an address
        ("write to john [at] example [.] com for the refund", ("john", "example")),
        ("write to jane (.) doe (at) corp (.) org tonight", ("jane", "doe", "corp")),
        ("mail john at example [.] com today", ("john", "example")),
        # the word "at" after a dotted local part: the dots say it is no plain word
        ("write to john.smith at example.com for the refund", ("john", "smith")),
    ],
)
def test_an_email_address_written_out_to_dodge_filters_is_an_email_address(text, secrets):
    """An address spelled "at"/"dot", bracketed "(at)" or spaced around "@" and "." was a row of
    common words and punctuation: "john(at)example(dot)org" and "john @ example . com" left the
    client whole, and of "john [at] example.com" the name did. The whole run is one e-mail
    address now; "at" and "dot" alone stay words."""
    _masked_whole(text, secrets, "EMAIL")
    m = masker(1.0)
    for kept in ("meet at the station at noon", "a polka dot dress at the shop",
                 "stocks at the dot com bubble", "I use node.js at home"):
        assert "[EMAIL]" not in m.mask(kept).text


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("my pin is 4, 8, 2, 1 please unlock the card", "8, 2"),
        ("my pin is 4. 8. 2. 1 please unlock the card", "8. 2"),
        ("my pin is 4_8_2_1 please unlock the card", "8_2"),
        ("my pin is 4–8–2–1 please unlock the card", "8–2"),  # en dash
        ('unlock with {"pin": ["4","8","2","1"]} please', '"8","2"'),
    ],
)
def test_a_number_written_a_digit_at_a_time_with_punctuation_is_one_number(text, secret):
    """The spaced-groups rule joined digits split by spaces or a hyphen only: split by commas,
    full stops, underscores, other dashes or JSON's quotes, each digit was still a
    one-character token that masking never takes, and "4, 8, 2, 1" left whole at any λ."""
    _masked_whole(text, secret, "NUMBER")
    m = masker(1.0)
    assert m.mask("rooms 2 and 3 for 4 nights").text == "rooms 2 and 3 for 4 nights"


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("fetch ftp://fileserver/john/taxes for the report", ("fileserver", "john", "taxes")),
        ("sync sftp://backup.local/home/jsmith tonight", ("backup.local", "jsmith")),
        ("open file:///home/jsmith/salary.txt please", ("jsmith", "salary")),
        ("see my.blog/posts/john-smith for details", ("my.blog", "john-smith")),
        ("order from best.pizza/order?id=smith please", ("best.pizza", "smith")),
        ("go to EXAMPLE.COM/john for the form", ("EXAMPLE.COM", "john")),
    ],
)
def test_a_url_with_any_scheme_or_any_domain_before_a_path_is_a_url(text, secrets):
    """A URL was one only after http(s)://, www. or a domain ending in one of a few lower-case
    top-level domains: ftp://, sftp:// or file:// paths, a domain like "my.blog/posts/..." and
    "EXAMPLE.COM/john" left the client with the names in them."""
    _masked_whole(text, secrets, "URL")
    m = masker(1.0)
    for kept in ("convert report.pdf to word", "read the docs at 5 p.m. today"):
        assert "[URL]" not in m.mask(kept).text


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("mail root at john@localhost about the backup", ("john",)),
        ("connect as admin:hunter@dbserver tonight", ("hunter", "dbserver")),
        ("follow @john_smith for the weather updates", ("john", "smith")),
        ("ask @jane.doe about the flight", ("jane", "doe")),
    ],
)
def test_an_address_without_a_top_level_domain_or_a_handle_is_an_email_address(text, secrets):
    """An e-mail address needed a dotted domain: "john@localhost" and the password of
    "admin:hunter@dbserver" went out, and so did a handle ("@john_smith"): the "@" was
    punctuation and the name beside it a lower-case word."""
    _masked_whole(text, secrets, "EMAIL")
    m = masker(1.0)
    for kept in ("meet @ 5pm for 2 @ 3.99 each", "the weather @ home"):
        assert "[EMAIL]" not in m.mask(kept).text


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("my pin is 4 eight 2 one please unlock the card", ("eight", "one")),
        ("call five 5 five 1234 tomorrow", ("five", "5")),
    ],
)
def test_a_number_mixing_digits_and_number_words_is_one_number(text, secrets):
    """Digits and number words mixed ("4 eight 2 one") were one-character tokens and common
    words, neither of which masking takes; three or more of either, mixed, are one number."""
    _masked_whole(text, secrets, "NUMBER", ignore="[NUMBER]")
    m = masker(1.0)
    assert m.mask("rooms 2 and 3 for 4 nights, one or two beds").text == (
        "rooms 2 and 3 for 4 nights, one or two beds")


def test_an_email_address_written_out_is_taken_whole_after_another_at():
    """"me at jane dot doe" read as an address of its own (the first "at" taken for the "@"), so
    of "reach me at jane dot doe at gmail dot com" the domain went out. An address's domain is
    never followed by another "at"."""
    m = masker(1.0)
    out = m.mask("reach me at jane dot doe at gmail dot com about the weather").text
    for secret in ("jane", "doe", "gmail"):
        assert secret not in out, out
    assert m.residue(out) == []


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("my pin is <b>4</b><b>8</b><b>2</b><b>1</b> please", "<b>8</b>"),
        ("<tr><td>4</td> <td>8</td> <td>2</td> <td>1</td></tr> is my pin", "<td>2</td>"),
        ('pin <span class="d">4</span>-<span class="d">8</span>-<span class="d">2</span>', ">8<"),
    ],
)
def test_a_number_split_by_markup_tags_is_one_number(text, secret):
    """A request can hold markup: digits each in their own tag were one-character tokens, which
    masking never takes, and "<b>4</b><b>8</b><b>2</b><b>1</b>" left the client whole."""
    _masked_whole(text, secret, "NUMBER")


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("forward to margaret.thornbury%40contoso.com please", ("margaret", "thornbury")),
        ("GET /api/users?email=jdoe%40contoso.com failed", ("jdoe",)),
        ("look up Jane.Doe%40Contoso.COM in the directory", ("Jane", "Doe", "Contoso")),
    ],
)
def test_a_percent_encoded_email_address_is_an_email_address(text, secrets):
    """An address copied from a URL's query ("jdoe%40contoso.com", "%40" being how a URL writes
    "@") was a word, a "%" and a URL: the domain became [URL] and the local part, most often the
    person's name, left the client (at λ = 0.3 "margaret.thornbury" whole)."""
    _masked_whole(text, secrets, "EMAIL")
    for strength in (0.3, 1.0):
        out = masker(strength).mask(text).text
        assert "[EMAIL]" in out and not any(s in out for s in secrets), out
    for kept in ("a 40% discount at contoso.com", "100%40 of them"):
        assert "[EMAIL]" not in masker(1.0).mask(kept).text


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("mail to jane@[192.168.0.1] today", ("jane", "192")),
        ("send it to bob.smith@[IPv6:2001:db8::1] now", ("bob", "smith", "2001")),
    ],
)
def test_an_email_address_at_an_ip_literal_is_an_email_address(text, secrets):
    """RFC 5321's address at an IP literal: the digits became [NUMBER] and the name before the
    "@" left the client ("mail to jane@[[NUMBER]]") at any λ."""
    _masked_whole(text, secrets, "EMAIL")
    for strength in (0.3, 1.0):
        out = masker(strength).mask(text).text
        assert "[EMAIL]" in out and not any(s in out for s in secrets), out
    assert "[EMAIL]" not in masker(1.0).mask("see note [3] @ [12:30]").text
