"""Defence in depth on submitted text (pure, no Django).

Clients mask their text before it leaves them; the server checks on arrival what it can of that
masking (`masking_residue`: what masking at the round's λ removes from any text, whatever the
client's log, must not be there) and still removes what is obviously personal: e-mail addresses
(also written to dodge filters, "john(at)example(dot)org", or on a host without a top-level
domain), payment card numbers (Luhn-checked), phone numbers and long digit strings (account, ID or
order numbers, also written a digit at a time, in digits or in words). Each is replaced by a
bracketed tag.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from compendium.masking import (
    COMBINING_MARKS,
    HOST_ADDRESS_PATTERN,
    MAIL_LOCAL_CHAR,
    OBFUSCATED_MAIL_PATTERN,
    PERCENT_MAIL_PATTERN,
    TextMasker,
    normalized,
)
from compendium.schema import AnnexTriple, Compendium, Precaution, PromptTemplate, Scenario
from compendium.validation import Violation, metadata_free_text

# The local part (RFC 5322's atext: "mary.o'brien") and the domain in letters of any script
# (RFC 6531, IDNA), combining marks included, as masking reads them.
_LABEL_CHAR = r"(?:[^\W_]|-|[" + COMBINING_MARKS + r"])"
EMAIL = re.compile(
    rf"(?<!{MAIL_LOCAL_CHAR}){MAIL_LOCAL_CHAR}+@{_LABEL_CHAR}+(?:\.{_LABEL_CHAR}+)*\.[^\W\d_]{{2,}}"
)
# 13-19 digits, optionally grouped by single spaces or dashes.
CARD = re.compile(r"(?<![\d])\d(?:[ -]?\d){12,18}(?![\d])")
# International or national phone numbers: optional +CC, optional (area), groups split by
# space, dot or dash; at least 9 digits in all (checked below).
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,5}(?:[ .-]\d{2,5}){1,4}(?![\w])"
)
LONG_DIGITS = re.compile(r"(?<!\d)\d{8,}(?!\d)")
# A number written a digit at a time ("ssn 1 2 3 4 5 6 7 8 9"): 6 or more single digits split by
# a space, dot or dash (masking leaves one-character tokens alone).
SPACED_DIGITS = re.compile(r"(?<![\w.-])\d(?:[ .-]\d){5,}(?![\w])")
# An e-mail address written to dodge filters ("john(at)example(dot)org", "john @ example . com",
# "john dot smith at gmail dot com") or on a host without a top-level domain (the
# "hunter@dbserver" of "admin:hunter@dbserver"), as masking reads them: the round's λ = 0 let them
# through the client, and EMAIL did not know them.
DODGED_EMAIL = re.compile(
    OBFUSCATED_MAIL_PATTERN + "|" + HOST_ADDRESS_PATTERN + "|" + PERCENT_MAIL_PATTERN
)
# A number spelled a digit at a time in words, or words and digits ("four eight two one five
# six", "4 eight 2 one 5 six", "Nine-Zero-Seven-..."): 6 or more, as SPACED_DIGITS, at least one
# a word (digits alone are SPACED_DIGITS's; "pages 1, 2, 3, 4, 5, 6" stays).
_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DIGIT_ITEM = r"(?:" + "|".join(_DIGIT_WORDS) + r"|\d)"
SPELLED_DIGITS = re.compile(
    r"(?<!\w)(?i:" + _DIGIT_ITEM + r"(?:(?:[ \t]{1,3}|[ \t]{0,3}[,\-][ \t]{0,3})" + _DIGIT_ITEM
    + r"){5,})(?!\w)"
)

_MAY_CONTAIN = re.compile(r"[\d@]")  # without either, only DODGED_EMAIL and SPELLED_DIGITS can


def _may_dodge(text: str, low: str) -> bool:
    """Whether `text` (`low` its lower case) has what DODGED_EMAIL needs: an "@" or its URL
    encoding "%40", a "dot", or an "at" with a bracket (substring tests: the pattern itself is
    slow to try everywhere)."""
    return ("@" in text or "%40" in text or "dot" in low
            or ("at" in low and any(b in text for b in "([{<")))


def _may_spell(low: str) -> bool:
    return any(word in low for word in _DIGIT_WORDS)


TAGS = {"email": "[email]", "card": "[card]", "phone": "[phone]", "number": "[number]"}
NAMES = {"email": "e-mail address", "card": "card number", "phone": "phone number",
         "number": "long number"}


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


@dataclass(frozen=True)
class ScrubResult:
    text: str
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def found(self) -> str:
        """What was replaced, in words ("1 phone number, 2 e-mail addresses"); "" for nothing."""
        return ", ".join(
            f"{n} {NAMES[kind]}{'es' if n > 1 and kind == 'email' else 's' if n > 1 else ''}"
            for kind, n in self.counts.items() if n
        )


def scrub_text(text: str) -> ScrubResult:
    """Replace e-mail addresses (plain, written to dodge filters, or on a host without a
    top-level domain), card numbers, phone numbers and long digit strings (in digits or spelled
    a digit at a time in words), in the text's NFKC form (a full-width ＠, a card grouped by no-break spaces)."""
    counts = {"email": 0, "card": 0, "phone": 0, "number": 0}
    text = normalized(text)
    low = text.lower()
    dodge, spell = _may_dodge(text, low), _may_spell(low)
    if not (dodge or spell or _MAY_CONTAIN.search(text)):
        return ScrubResult(text, counts)

    def email(m: re.Match) -> str:
        counts["email"] += 1
        return TAGS["email"]

    def card(m: re.Match) -> str:
        digits = re.sub(r"\D", "", m.group())
        if _luhn_ok(digits):
            counts["card"] += 1
            return TAGS["card"]
        return m.group()

    def phone(m: re.Match) -> str:
        if sum(ch.isdigit() for ch in m.group()) >= 9:
            counts["phone"] += 1
            return TAGS["phone"]
        return m.group()

    def number(m: re.Match) -> str:
        counts["number"] += 1
        return TAGS["number"]

    def spelled(m: re.Match) -> str:
        if not any(ch.isalpha() for ch in m.group()):
            return m.group()
        return number(m)

    text = EMAIL.sub(email, text)
    if dodge:
        text = DODGED_EMAIL.sub(email, text)
    text = CARD.sub(card, text)
    text = PHONE.sub(phone, text)
    text = LONG_DIGITS.sub(number, text)
    text = SPACED_DIGITS.sub(number, text)
    if spell:
        text = SPELLED_DIGITS.sub(spelled, text)
    return ScrubResult(text, counts)


# The separators of an identifier's words, read as the spaces between them: "555_123_4567",
# "card_4111_1111_1111_1111" and "john_at_example_dot_com" are the number or the address they
# spell ("_" is a letter to the patterns above, which took none of them).
_FLAG_SEPARATORS = re.compile(r"[_.:]")


def flag_name_holds(name: str) -> str:
    """What a precondition flag name holds of what `scrub_text` takes for personal data (an
    e-mail address spelled "at" and "dot", a card, phone or long number, in digits or in
    words), in its words ("1 phone number"), or "" for nothing. Its separators `_ . :` read as
    spaces. Flag names are identifiers sent as written, neither masked nor scrubbed (a scrubbed
    name would be another flag): a condition ("has_city", "lang:en", "retry_count_gt_3",
    "after_2024_01_01") holds none of these. Names of people are not judged: masking finds them
    by their capital inside a sentence, which no identifier has, and its residue check takes an
    ordinary "v2" or "api.v2" for an identifier to remove."""
    return scrub_text(_FLAG_SEPARATORS.sub(" ", name)).found


def personal_flag_names(compendium: Compendium) -> list[Violation]:
    """A violation for every precondition flag name that holds personal data
    (`flag_name_holds`), at its scenario's preconditions: which flag (its place in the object)
    and what it holds, never the name itself. The server refuses such a compendium on arrival
    (its flags would be published as sent to every organization); the client toolkit before
    anything is sent (`submission_rules`)."""
    out = []
    for index, scenario in enumerate(compendium.scenarios):
        flags = scenario.preconditions
        for place, name in enumerate(flags, start=1):
            if found := flag_name_holds(name):
                out.append(Violation(
                    f"$.scenarios[{index}].preconditions",
                    f"flag name {place} of {len(flags)} holds {found}: a flag names a condition "
                    "(has_city), never a person, an account or a contact; rename it in the usage "
                    "log and build again",
                ))
    return out


def submission_rules(compendium: Compendium) -> list[Violation]:
    """What the server refuses in a client's compendium beyond the schema's rules, which the
    client toolkit (`validate`, `inspect`, `submit`) checks before anything is sent: free text
    in metadata (`metadata_free_text`) and personal data in flag names (`personal_flag_names`),
    neither of which a masking check or the scrub reads."""
    return metadata_free_text(compendium) + personal_flag_names(compendium)


def free_texts(compendium: Compendium) -> Iterator[tuple[str, str]]:
    """(path, text) of every free text of a compendium, paths as validation names them."""
    for index, s in enumerate(compendium.scenarios):
        yield f"$.scenarios[{index}].text", s.text
    for index, p in enumerate(compendium.precautions):
        yield f"$.precautions[{index}].text", p.text
    for index, t in enumerate(compendium.templates):
        yield f"$.templates[{index}].signature", t.signature
        yield f"$.templates[{index}].template", t.template
    for index, a in enumerate(compendium.annex):
        for part in ("subject", "relation", "object"):
            yield f"$.annex[{index}].{part}", getattr(a, part)


def holds_slots(path: str) -> bool:
    """Whether the free text at `path` (as `free_texts` names it) is a template's body or
    signature, the only texts where a `{slot}` is a slot (compendium.masking.tokenize)."""
    return path.startswith("$.templates[")


_RESIDUE_NAMES = {
    "EMAIL": "e-mail address", "URL": "URL", "PHONE": "phone number", "ID": "identifier",
    "NUMBER": "number", "NAME": "name",
}


def masking_residue(compendium: Compendium, masker: TextMasker) -> list[Violation]:
    """A violation for every free text that still holds what `masker` removes from any text
    (`TextMasker.residue`): text that was not masked at the masker's λ (or not at all). The
    reason says what kinds, how many and where (character offsets), never the words themselves.
    A `{slot}` is kept only in a template's body and signature: in a scenario or a precaution
    what braces hold is judged as any other text."""
    out = []
    for path, text in free_texts(compendium):
        # offsets: in the normalized form (NFKC, without the characters no reader sees)
        found = masker.residue(normalized(text), slots=holds_slots(path))
        if not found:
            continue
        kinds = Counter(r.kind for r in found)
        what = ", ".join(
            f"{n} {_RESIDUE_NAMES[kind]}{'s' if n > 1 else ''}" for kind, n in sorted(kinds.items())
        )
        where = ", ".join(f"{r.start}-{r.end}" for r in found[:5]) + (", ..." if len(found) > 5 else "")
        out.append(Violation(
            path,
            f"not masked at λ = {masker.strength:g}: holds {what} (characters {where}) that "
            "masking at that strength removes",
        ))
    return out


def scrub_compendium(compendium: Compendium) -> tuple[Compendium, int]:
    """The compendium with every free text scrubbed, and how many items were removed. The input
    is not modified; when nothing is found it is returned as it is (no copy).

    Entries that become identical after scrubbing are merged (scenarios and precautions add their
    support; the first template of a (tool, signature) key and the first annex triple win), so
    the result stays a set.
    """
    texts = [text for _, text in free_texts(compendium)]
    if not any(scrub_text(t).total for t in texts):
        return compendium, 0
    removed = 0

    def clean(text: str) -> str:
        nonlocal removed
        result = scrub_text(text)
        removed += result.total
        return result.text

    scenarios = [s.model_copy(update={"text": clean(s.text)}) for s in compendium.scenarios]
    precautions = [p.model_copy(update={"text": clean(p.text)}) for p in compendium.precautions]
    templates = [
        t.model_copy(update={"signature": clean(t.signature), "template": clean(t.template)})
        for t in compendium.templates
    ]
    annex = [
        a.model_copy(
            update={"subject": clean(a.subject), "relation": clean(a.relation), "object": clean(a.object)}
        )
        for a in compendium.annex
    ]
    if not removed:
        return compendium, 0

    merged_scenarios: dict[tuple, Scenario] = {}
    for s in scenarios:
        key = (s.tool_id, s.text, tuple(sorted(s.preconditions.items())))
        if key in merged_scenarios:
            merged_scenarios[key].support += s.support
        else:
            merged_scenarios[key] = s.model_copy(update={"preconditions": dict(s.preconditions)})
    merged_precautions: dict[tuple, Precaution] = {}
    for p in precautions:
        key = (p.tool_id, p.text)
        if key in merged_precautions:
            merged_precautions[key].support += p.support
        else:
            merged_precautions[key] = p
    unique_templates: dict[tuple, PromptTemplate] = {}
    for t in templates:
        unique_templates.setdefault((t.tool_id, t.signature), t)
    unique_annex: dict[tuple, AnnexTriple] = {}
    for a in annex:
        unique_annex.setdefault((a.subject, a.relation, a.object), a)
    result = compendium.model_copy(
        update={
            "scenarios": list(merged_scenarios.values()),
            "precautions": list(merged_precautions.values()),
            "templates": list(unique_templates.values()),
            "annex": list(unique_annex.values()),
        }
    )
    return result, removed
