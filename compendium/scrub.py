"""Defence-in-depth scrubbing of personal data from submitted text (pure, no Django).

Clients mask their text before it leaves them; the server still removes what is obviously
personal on arrival: e-mail addresses, payment card numbers (Luhn-checked), phone numbers and long
digit strings (account, ID or order numbers). Each is replaced by a bracketed tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compendium.schema import Compendium

EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# 13-19 digits, optionally grouped by single spaces or dashes.
CARD = re.compile(r"(?<![\d])\d(?:[ -]?\d){12,18}(?![\d])")
# International or national phone numbers: optional +CC, optional (area), groups split by
# space, dot or dash; at least 9 digits in all (checked below).
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,5}(?:[ .-]\d{2,5}){1,4}(?![\w])"
)
LONG_DIGITS = re.compile(r"(?<!\d)\d{8,}(?!\d)")

TAGS = {"email": "[email]", "card": "[card]", "phone": "[phone]", "number": "[number]"}


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


def scrub_text(text: str) -> ScrubResult:
    """Replace e-mail addresses, card numbers, phone numbers and long digit strings."""
    counts = {"email": 0, "card": 0, "phone": 0, "number": 0}
    if not any(ch.isdigit() for ch in text) and "@" not in text:
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

    text = EMAIL.sub(email, text)
    text = CARD.sub(card, text)
    text = PHONE.sub(phone, text)
    text = LONG_DIGITS.sub(number, text)
    return ScrubResult(text, counts)


def scrub_compendium(compendium: Compendium) -> tuple[Compendium, int]:
    """A copy of the compendium with every free text scrubbed, and how many items were removed.

    Entries that become identical after scrubbing are merged (scenarios and precautions add their
    support; the first template of a (tool, signature) key wins), so the result stays a set.
    """
    removed = 0

    def clean(text: str) -> str:
        nonlocal removed
        result = scrub_text(text)
        removed += result.total
        return result.text

    doc = compendium.model_copy(deep=True)
    scenarios: dict[tuple, object] = {}
    for s in doc.scenarios:
        s.text = clean(s.text)
        key = (s.tool_id, s.text, tuple(sorted(s.preconditions.items())))
        if key in scenarios:
            scenarios[key].support += s.support
        else:
            scenarios[key] = s
    doc.scenarios = list(scenarios.values())
    precautions: dict[tuple, object] = {}
    for p in doc.precautions:
        p.text = clean(p.text)
        key = (p.tool_id, p.text)
        if key in precautions:
            precautions[key].support += p.support
        else:
            precautions[key] = p
    doc.precautions = list(precautions.values())
    templates: dict[tuple, object] = {}
    for t in doc.templates:
        t.signature = clean(t.signature)
        t.template = clean(t.template)
        templates.setdefault((t.tool_id, t.signature), t)
    doc.templates = list(templates.values())
    annex: dict[tuple, object] = {}
    for a in doc.annex:
        a.subject, a.relation, a.object = clean(a.subject), clean(a.relation), clean(a.object)
        annex.setdefault((a.subject, a.relation, a.object), a)
    doc.annex = list(annex.values())
    return doc, removed
