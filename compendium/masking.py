"""Adaptive token-saliency masking of client text with strength λ (paper, "Privacy mechanisms").

An empirical defence, not differential privacy. Every token of a text gets a saliency in [0, 1],
how much it could identify a person or an organization:

- personal-data patterns: e-mail address (also written to dodge filters: "john(at)example(dot)org",
  "john dot smith at gmail dot com", "john @ example . com"; on a host without a top-level domain,
  "john@localhost"; a handle, "@john_smith"), URL or domain (any scheme,
  "ftp://host/john"; a common top-level domain in any case; any top-level domain before a path,
  "my.blog/posts/john-smith"), phone number -> 1.0; identifiers that mix
  letters and digits (order numbers, account ids) -> 0.95; numbers of 3 or more digits -> 0.9,
  shorter numbers -> 0.6 (a run of three or more digit groups split by spaces, dashes or the
  punctuation a digit string is written with or markup tags, "4 8 2 1", "4, 8, 2, 1", "4_8_2_1",
  "<b>4</b><b>8</b><b>2</b>", is one number, and so is a run of three or more number words, "four eight two one", digits
  among them or not, "4 eight 2 one", scored as the digits it spells);
- capitalized words inside a sentence (names of people, places, companies) -> 0.55 + 0.4 r;
- any other word -> its rarity r in a public reference vocabulary: r = clip((6 - z) / 6, 0, 1)
  where z is the word's Zipf frequency in English (log10 of occurrences per billion words) from the
  `wordfreq` package (public corpora: Wikipedia, subtitles, news, books, web, Reddit, Twitter);
  z >= 6 ("the", "you", "can") gives 0, an unknown word gives 1.
- protected, saliency 0: common function words, and every word that occurs in the tool registry
  (tool ids, names, descriptions, categories). Those are public already and carry the routing
  meaning. Personal-data patterns (e-mail, URL, phone) are never protected.
- shared, saliency 0 where the word does not stand as a name: the words the builder found that
  enough distinct users of the log wrote in lower case (`TextMasker.sharing`,
  compendium.builder.shared_words).

Given λ >= 0 a token is masked when its saliency exceeds the threshold θ(λ) = exp(-λ), or when it
is among the top ⌊ρ(λ)·n⌋ of the text's n unprotected tokens by saliency, ρ(λ) = 1 - exp(-λ/4)
(the adaptive part: every text loses its most identifying tokens, whatever their absolute score).
θ falls and ρ grows with λ, and the ranking does not depend on λ, so the masked set of a text at a
larger λ contains the masked set at a smaller one: masking is monotone in λ. λ = 0 masks nothing
(θ = 1 and no saliency exceeds 1; ρ = 0). Equal saliencies are ranked by a keyed hash of the
position under a hash of (seed, text), the text hashed once: the same text, λ and seed always
give the same output.

A masked token becomes a typed placeholder ([EMAIL], [URL], [PHONE], [ID], [NUMBER], [NAME],
[MASK]); a run of the same placeholder separated only by spaces becomes one. Placeholders are
never masked again, nor, in template bodies and signatures (`slots=True`), slots like {city}; in
any other text (a request, a scenario, a precaution) braces are punctuation and the words they
hold are masked as any other ("{margaret_thornbury}" is a name, not a slot).

Pure: standard library + wordfreq.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from compendium.schema import ToolSpec

PLACEHOLDERS = ("EMAIL", "URL", "PHONE", "ID", "NUMBER", "NAME", "MASK")

# Order matters: the first alternative that matches at a position wins. Every repetition is
# bounded (RFC lengths for e-mail parts and domain labels) so that tokenizing stays linear in the
# length of the text whatever it contains.
_LABEL = r"[A-Za-z0-9\-]{1,63}"


def _combining_marks() -> str:
    """The combining marks (Unicode category M) of the first two planes, as the body of a regex
    character class. Python's \\w leaves them out, so a mark NFKC cannot fold into its letter
    (a strike-through, an underline; the vowel signs of Indic scripts) split a word into pieces:
    "M̶a̶r̶g̶a̶r̶e̶t̶" was eight one-letter words, which masking never takes."""
    ranges: list[tuple[int, int]] = []
    for code in range(0x20000):
        if unicodedata.category(chr(code))[0] == "M":
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges)


_MARK = _combining_marks()
# A letter or a combining mark: what a word holds after its first letter.
_LETTER_OR_MARK = r"(?:[^\W\d_]|[" + _MARK + r"])"
# A template slot: only in template bodies and signatures (`slots=True`), where a {name} stands
# for what the template fills in. Anywhere else (queries, scenarios, precautions) braces are
# ordinary characters and the words inside them are words: "{margaret_thornbury}" in a request
# is a name to mask, not a slot to keep.
_SLOT = r"(?P<slot>\{[A-Za-z_][A-Za-z0-9_]{0,63}\})"
# An identifier: a run of letters (any script), digits, '_', '-' and '#' holding at least one
# digit and one letter ("AB-99812", "Hauptstraße4b", "Ré5ABC123"), taken whole: with ASCII-only
# classes a non-ASCII letter split the run, and the server's check then found the rest
# ("[NAME]4b") as an identifier the client had not masked.
_IDENT = (
    r"(?P<ident>\b(?=[\w\-#" + _MARK + r"]{0,63}\d)(?=[\w\-#" + _MARK + r"]{0,63}[^\W\d_])"
    r"(?:[^\W_]|#)[\w\-#" + _MARK + r"]{0,127})"
)
# A number written in groups of up to four digits split by spaces or dashes, three groups or
# more ("4 8 2 1", "123 45 6789", "4-8-2-1-3", "2021-01-01"), taken as one number: as separate
# tokens each single digit was a one-character token, which masking never takes, so a PIN or a
# phone number spelled a digit at a time left the client whole (and "45" of "123 45 6789" stayed
# at low λ). Its saliency counts all its digits.
# Between groups: spaces, or up to three of the punctuation a digit string is written with
# (dashes of any kind, "_", ".", ",", "/", ":", quotes), spaces around them: "4, 8, 2, 1",
# "4. 8. 2. 1", "4_8_2_1", "4–8–2–1" and JSON's ["4","8","2","1"] were one-character tokens too.
# A markup tag counts as such punctuation: "<b>4</b><b>8</b><b>2</b><b>1</b>" was four digits too.
_TAG = r"</?[A-Za-z][A-Za-z0-9]{0,15}(?:[ \t][^<>\n]{0,200})?/?>"
_DIGIT_SEP = (
    r"(?:[ \t]{1,3}|[ \t]{0,3}(?:(?:[\-\u2010-\u2015\u2212_.,/:'\"]|" + _TAG + r")[ \t]{0,3}){1,4})"
)
_DIGIT_RUN = r"\d{1,4}(?:" + _DIGIT_SEP + r"\d{1,4}){2,15}(?![\w])"
# A number spelled out in number words, three or more ("four eight two one", "five five five, one
# two three four", "Nine-Zero-Seven"), taken as one number: each is a common word (rarity 0), so a
# PIN or a phone number written so left the client whole at any λ. One or two number words stay
# words ("one or two", "top five", "twenty twenty"). Its saliency counts each word as a digit.
NUMBER_WORDS = frozenset(
    """zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen
    fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty
    ninety hundred thousand""".split()
)
_NUMBER_WORD = r"(?:" + "|".join(sorted(NUMBER_WORDS, key=lambda w: (-len(w), w))) + r")"
# Digit groups may stand among the words ("4 eight 2 one", "five 5 five 1234"): a run of digits
# alone is `_DIGIT_RUN`'s, tried first.
_NUMBER_ITEM = r"(?:" + _NUMBER_WORD + r"|\d{1,4})"
_WORD_RUN = (
    r"(?<!\w)(?i:" + _NUMBER_ITEM + r"(?:(?:[ \t]{1,3}|[ \t]{0,3}[,\-][ \t]{0,3})"
    + _NUMBER_ITEM + r"){2,15})(?!\w)"
)
# An e-mail address: its local part and domain in letters of any script (RFC 6531 and IDNA:
# "josé.garcía@empresa.es"), combining marks included ("adébáyọ̀": ọ̀ has no precomposed form);
# with ASCII-only classes, or without the marks, the address was words and a shorter address,
# and a name in it could leave the client (a word, the shared-word rule could release it). On
# ASCII text the classes are those of `_LABEL`.
_MAIL_LABEL = r"(?:[^\W_]|-|[" + _MARK + r"]){1,63}"
# A local part's characters: RFC 5322's atext (' & ! # $ * / = ? ^ ` { | } ~ besides letters,
# digits, "_", "-", "+", "%" and "."), the typographic apostrophe an editor puts for ', and
# combining marks: "mary.o'brien@example.com" stopped at the apostrophe, and "mary.o'brien" left
# the client as words.
_MAIL_LOCAL_CHAR = r"[\w.%+\-'’&!#$*/=?^`{|}~" + _MARK + r"]"
# (for the server's scrub, compendium.scrub)
COMBINING_MARKS = _MARK
MAIL_LOCAL_CHAR = _MAIL_LOCAL_CHAR
# An e-mail address written to dodge filters: "@" and "." spelled "at" and "dot", bracketed
# ("(at)", "[dot]", "{AT}", "<at>") or spaced ("john @ example . com"). Each piece was a common word
# or punctuation, so "john(at)example(dot)org" left the client whole. An "@" spaced or bracketed
# "at" makes the run an address (`_OBFUSCATED_MAIL`); the word "at" only with a "dot" word or a
# bracketed dot in it or after a dotted local part ("john.smith at example.com"), and not before
# a determiner ("stocks at the dot com bubble"): "at" and
# "dot" alone are ordinary words.
_BRACKETED = r"[ \t]{0,3}[\(\[\{<][ \t]{0,2}(?i:%s)[ \t]{0,2}[\)\]\}>][ \t]{0,3}"
# (an "@" with a space before it and none after starts a handle: "ask @jane.doe")
_STRONG_AT = r"(?:[ \t]{0,3}@[ \t]{1,3}|" + _BRACKETED % "at" + r")"
_WORD_AT = r"[ \t]{1,3}(?i:at)[ \t]{1,3}(?!(?i:the|a|an|this|that|these|those|my|your|his|her|its|our|their)\b)"
# (a dot bracketed as written, "[.]", "(.)", is a spelled one: security notices defang so)
_SPELLED_DOT = r"(?:" + _BRACKETED % r"dot|\." + r"|[ \t]{1,3}(?i:dot)[ \t]{1,3})"
# a "." with spaces after it only before a lower-case label ("example . com", not "home. Then")
_ANY_DOT = r"(?:[ \t]{0,3}\.(?:[ \t]{1,3}(?=[a-z]))?|" + _SPELLED_DOT + r")"
_LOCAL_DOT = r"(?:\.|" + _SPELLED_DOT + r")"
# possessive: a plain word gives back none of its letters trying them all as a local part
_MAIL_LOCAL = r"[\w%+\-]{1,64}+"
_OBF_LABEL = r"(?:[^\W_]|-){1,63}+"
# (never followed by another "at" and a dotted domain: of "me at jane dot doe at gmail dot com",
# "me at jane dot doe" is not the address; "... dot com at noon" is one)
_TLD = (
    r"[^\W\d_]{2,24}+(?![\w@])(?!(?:[ \t]{1,3}(?i:at)[ \t]{1,3}|" + _STRONG_AT + r")"
    + _OBF_LABEL + _ANY_DOT + r")"
)
_OBFUSCATED_MAIL = (
    # (the lookahead: most words, followed by none of these, are passed over at once)
    r"(?<![\w.%+\-])(?=[\w%+\-]{1,64}+(?:[ \t]{0,3}[@(\[{<.]|[ \t]{1,3}(?i:at|dot)[ \t]))(?:"
    # an "@" however spaced, or "at" in brackets
    + _MAIL_LOCAL + r"(?:" + _LOCAL_DOT + _MAIL_LOCAL + r"){0,4}" + _STRONG_AT
    + _OBF_LABEL + r"(?:" + _ANY_DOT + _OBF_LABEL + r"){0,7}" + _ANY_DOT + _TLD
    # the word "at", with a spelled dot in the local part or in the domain
    + r"|" + _MAIL_LOCAL + r"(?:" + _LOCAL_DOT + _MAIL_LOCAL + r"){0,3}" + _SPELLED_DOT
    + _MAIL_LOCAL + r"(?:" + _LOCAL_DOT + _MAIL_LOCAL + r"){0,3}" + _WORD_AT
    + _OBF_LABEL + r"(?:" + _ANY_DOT + _OBF_LABEL + r"){0,7}" + _ANY_DOT + _TLD
    + r"|" + _MAIL_LOCAL + r"(?:\." + _MAIL_LOCAL + r"){0,4}" + _WORD_AT
    + _OBF_LABEL + r"(?:" + _ANY_DOT + _OBF_LABEL + r"){0,3}" + _SPELLED_DOT
    + r"(?:" + _OBF_LABEL + _ANY_DOT + r"){0,3}" + _TLD
    # the word "at" after a dotted local part, before a plain domain: "john.smith at example.com"
    + r"|" + _MAIL_LOCAL + r"(?:\." + _MAIL_LOCAL + r"){1,4}" + _WORD_AT
    + _OBF_LABEL + r"(?:\." + _OBF_LABEL + r"){0,7}\." + _TLD
    + r")"
)
# An address on a host without a top-level domain ("john@localhost", the "hunter@dbserver" of
# "admin:hunter@dbserver") and a handle ("@john_smith", "@jane.doe"): the "@" was punctuation and
# the lower-case name beside it a common word. A host or a handle holds a letter ("2@3.99", "@5"
# stay as they are), and an "@" with a space after it is not one. So is an address at an IP
# literal ("jane@[192.168.0.1]", "bob@[IPv6:2001:db8::1]"): the digits became [NUMBER] and the
# name before the "@" left as a word.
_HOST_ADDRESS = (
    _MAIL_LOCAL_CHAR + r"{1,64}+@[^\W\d_](?:[^\W_]|-){0,62}+(?![\w@])"
    + r"|" + _MAIL_LOCAL_CHAR + r"{1,64}+@\[(?i:IPv6:)?[0-9A-Fa-f.:]{2,45}\]"
)
_BARE_ADDRESS = (
    _HOST_ADDRESS
    + r"|(?<![\w.%+\-@])@(?=[\w.\-]{0,63}[^\W\d_])\w(?:[\w.\-]{0,62}\w)?+(?![\w@])"
)
# An address copied from a URL's query, its "@" written "%40" ("jdoe%40contoso.com"): the local
# part was a word (most often the person's name) and the domain a URL.
_PERCENT_MAIL = (
    r"(?:(?!%40)" + _MAIL_LOCAL_CHAR + r"){1,64}+%40" + _MAIL_LABEL + r"(?:\." + _MAIL_LABEL
    + r"){0,8}\.[^\W\d_]{2,24}(?![\w])"
)
# What the server's scrub of unmasked text (compendium.scrub, for rounds at λ = 0) shares: an
# e-mail address written to dodge filters, one on a host without a top-level domain, and a
# number spelled out in number words.
OBFUSCATED_MAIL_PATTERN = _OBFUSCATED_MAIL
PERCENT_MAIL_PATTERN = _PERCENT_MAIL
HOST_ADDRESS_PATTERN = _HOST_ADDRESS
NUMBER_WORD_PATTERN = _NUMBER_WORD
# A URL: after any scheme ("ftp://fileserver/john", "file:///home/...", not only http(s)://), after
# www., a domain ending in a common top-level domain in any case ("EXAMPLE.COM"), or a domain with
# any top-level domain followed by a path ("my.blog/posts/john-smith", "best.pizza/order?id=..."):
# those left the client with the names in them.
_SCHEME = r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,15}://"
_PATH = r"/[^\s<>\"'\]\)]{0,2000}[^\s<>\"'\]\).,;:!?]"
_REST = (
    # (possessive: "@" is not among the local part's characters, so giving some back finds none)
    r"|(?P<email>" + _MAIL_LOCAL_CHAR + r"{1,64}+@" + _MAIL_LABEL + r"(?:\." + _MAIL_LABEL + r"){0,8}"
    r"\.[^\W\d_]{2,24}|" + _PERCENT_MAIL + r"|" + _OBFUSCATED_MAIL + r"|" + _BARE_ADDRESS + r")"
    r"|(?P<url>(?:" + _SCHEME + r"|www\.)[^\s<>\"'\]\)]{0,2000}[^\s<>\"'\]\).,;:!?]"
    r"|\b" + _LABEL + r"(?:\." + _LABEL + r"){0,8}\.(?i:com|org|net|io|edu|gov|co|ai|dev|app|info"
    r"|biz|me|us|uk|de|fr|eu)\b(?:" + _PATH + r")?"
    r"|\b" + _LABEL + r"(?:\." + _LABEL + r"){0,8}\.[A-Za-z]{2,24}" + _PATH + r")"
    r"|(?P<phone>(?<![\w.])(?:\+\d{1,3}[\s.\-]?)?(?:\(\d{2,4}\)[\s.\-]?)?\d{2,4}[\s.\-]\d{3,4}"
    r"(?:[\s.\-]\d{2,4}){1,4}(?![\w]))"
    r"|" + _IDENT +
    r"|(?P<number>" + _DIGIT_RUN + r"|" + _WORD_RUN + r"|\d{1,64}(?:[.,:/]\d{1,64}){0,16})"
    r"|(?P<word>[^\W\d_]" + _LETTER_OR_MARK + r"{0,127}(?:['’][^\W\d_]" + _LETTER_OR_MARK
    + r"{0,127}){0,4})"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)"
)
_PLACEHOLDER_TOKEN = r"(?P<placeholder>\[(?:" + "|".join(PLACEHOLDERS) + r")\])"
_TOKEN = re.compile(_PLACEHOLDER_TOKEN + _REST, re.DOTALL)
_TOKEN_WITH_SLOTS = re.compile(_PLACEHOLDER_TOKEN + "|" + _SLOT + _REST, re.DOTALL)

_SENTENCE_END = re.compile(r"[.!?:;\n]")
# Titles whose full stop starts no sentence: the capitalized word after one is a name. Titles
# of office (Sen., Gov., Rep., Pres., Det., Insp., Supt.), of the clergy (Fr.) and of other
# languages (Mme., Mlle., Sra., Srta.) too: "Sen. Warren" left "Warren" to its rarity.
TITLES = frozenset(
    """mr mrs ms mx dr prof rev st sr jr hon capt col gen lt sgt sen gov rep pres det insp supt
    fr mme mlle sra srta""".split()
)
_TITLE_BEFORE = re.compile(r"(?<![A-Za-z])(?:" + "|".join(sorted(TITLES)) + r")\.$", re.IGNORECASE)


# Characters a reader does not see (Unicode's Default_Ignorable_Code_Point: the zero-width space
# and joiners, the word joiner, the soft hyphen, the byte-order mark, variation selectors, Hangul
# fillers, tag characters...), but which split the tokens masking and scrubbing look for:
# "john.doe@example<U+200B>.com" reads as an address and was tokenized as three words. The
# bidirectional controls among them are left to the cleaning of the client (a space) and the
# server's validation (refused).
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u2060-\u2065\u206a-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)


# The ideographic full stop (U+3002; NFKC makes the half-width U+FF61 one) between a letter or
# digit and a Latin letter or digit: a dot of a domain name to IDNA, and what a CJK input method
# types for one, so "john。doe＠example。com" is an address (its "john" left the client before).
# Between two CJK characters it ends a sentence and stays.
_IDEOGRAPHIC_DOT = re.compile(r"(?<=[^\W_])\u3002(?=[A-Za-z0-9])")


def normalized(text: str) -> str:
    """The text in NFKC form (compatibility characters as their plain ones: a full-width ＠ or
    digit, superscript and circled digits, no-break spaces) without the characters a reader does
    not see (`_INVISIBLE`), and with an ideographic full stop inside a word as the dot it spells
    (`_IDEOGRAPHIC_DOT`), so that what masking and scrubbing look for is found however the
    characters spell it. ASCII is returned as it is."""
    if text.isascii():
        return text
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKC", _INVISIBLE.sub("", text)))
    return _IDEOGRAPHIC_DOT.sub(".", text) if "\u3002" in text else text
# What `TextMasker.residue` looks for before it tokenizes: an ASCII text with no `hard` match
# holds no e-mail, URL, phone, identifier or number, and every name (a capitalized word after a
# token of the same sentence) starts at a `capital` match whose group is the word itself (where
# it is not, the check tokenizes).
_RESIDUE_CANDIDATE = re.compile(r"(?P<hard>[\d@]|://|www|\.[A-Za-z]|" + _WORD_RUN + r"|\b(?i:dot)\b|[\(\[\{<][ \t]{0,2}(?i:at|\.)[ \t]{0,2}[\)\]\}>])|(?<![A-Za-z])(?P<capital>[A-Z][A-Za-z']*)")
_LETTERS = re.compile(r"[^\W\d_]+")
_PLACEHOLDER = re.compile(r"\[(?:" + "|".join(PLACEHOLDERS) + r")\]")

# English function words (closed classes: pronouns, determiners, prepositions, conjunctions,
# auxiliaries) and their contractions. Never identifying, always needed to read the text.
FUNCTION_WORDS = frozenset(
    """
    a about above after again against all am an and any are aren't as at be because been before
    being below between both but by can can't cannot could couldn't did didn't do does doesn't
    doing don't down during each few for from further had hadn't has hasn't have haven't having he
    he'd he'll he's her here here's hers herself him himself his how how's i i'd i'll i'm i've if
    in into is isn't it it's its itself let's me more most mustn't my myself no nor not of off on
    once only or other ought our ours ourselves out over own same shan't she she'd she'll she's
    should shouldn't so some such than that that's the their theirs them themselves then there
    there's these they they'd they'll they're they've this those through to too under until up
    very was wasn't we we'd we'll we're we've were weren't what what's when when's where where's
    which while who who's whom why why's with won't would wouldn't you you'd you'll you're you've
    your yours yourself yourselves also just will shall may might must please hi hello hey thanks
    thank yes okay ok
    """.split()
)

SCORE_PII = 1.0
SCORE_ID = 0.95
SCORE_LONG_NUMBER = 0.9
SCORE_SHORT_NUMBER = 0.6
SCORE_NAME_BASE = 0.55
SCORE_NAME_RARITY = 0.4
ZIPF_COMMON = 6.0
# A plain word that at least this many distinct users of a log wrote in lower case is released
# (compendium.builder.shared_words); 0 turns the rule off.
SHARED_WORD_USERS = 2


def valid_shared_word_users(k: int) -> bool:
    """0 (off) or at least 2: with 1, every word any user wrote would count as shared."""
    return k == 0 or k >= 2


@lru_cache(maxsize=200_000)
def zipf(word: str) -> float:
    """Zipf frequency of a word in the public English reference (wordfreq); 0 when unknown."""
    from wordfreq import zipf_frequency

    return zipf_frequency(word, "en")


def folded(word: str) -> str:
    """A word as the vocabularies hold it: lower case, a typographic apostrophe (’) written as
    ' ("I’m" is the function word "i'm")."""
    return word.lower().replace("’", "'")


def rarity(word: str) -> float:
    return min(1.0, max(0.0, (ZIPF_COMMON - zipf(word.lower())) / ZIPF_COMMON))


def without_placeholders(text: str) -> str:
    """The text as a sentence encoder should read it: the masking placeholders left out (runs of
    spaces they leave become one). A placeholder says only that a word was there; a sentence
    encoder reads "[NAME]" as a word of its own, which pulls every masked text towards every other
    one and away from the unmasked requests it is compared with. A text without placeholders is
    returned as is; one made only of placeholders too (nothing else to read)."""
    if "[" not in text:
        return text
    stripped = " ".join(_PLACEHOLDER.sub(" ", text).split())
    return stripped or text


# The λ a round expects when its configuration names none: RoundConfig's default, which every
# round opened through the API, the dashboard or a command records; only a configuration written
# by hand lacks it.
DEFAULT_MASK_STRENGTH = 1.0


def expected_mask_strength(value: object) -> float:
    """The λ a round expects, from its configuration's `mask_strength` as stored (a JSON value):
    a finite number >= 0 as it is; anything else (absent or null, negative, not a number) names
    none, so DEFAULT_MASK_STRENGTH. The one reading of it: the server checks a submission's
    masking residue at this λ, and the client toolkit checks and masks at the same one before
    anything is sent."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return DEFAULT_MASK_STRENGTH
    return float(value) if math.isfinite(value) and value >= 0 else DEFAULT_MASK_STRENGTH


def threshold(strength: float) -> float:
    """θ(λ): saliency above which a token is always masked. Decreasing; θ(0) = 1."""
    return math.exp(-strength)


def share(strength: float) -> float:
    """ρ(λ): share of a text's unprotected tokens masked whatever their score. Increasing; ρ(0)=0."""
    return 1.0 - math.exp(-strength / 4.0)


@dataclass(frozen=True)
class Token:
    text: str
    kind: str  # placeholder slot email url phone ident number word space other
    start: int

    @property
    def is_word(self) -> bool:
        """Counts as a content token for the masked fraction."""
        return self.kind not in ("space", "other", "placeholder", "slot")


def tokenize(text: str, slots: bool = False) -> list[Token]:
    """The tokens of a text. `slots`: a template body or signature, where `{name}` is a slot
    (kept whole, never masked); elsewhere braces are punctuation and what they hold is read as
    any other word, identifier or number."""
    pattern = _TOKEN_WITH_SLOTS if slots else _TOKEN
    return [Token(m.group(), m.lastgroup or "other", m.start()) for m in pattern.finditer(text)]


def _split_identifier(text: str) -> list[str]:
    """'ResearchHelper' -> research helper; 'create_qr_code' -> create qr code."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|[_\-.:/]+", " ", text)
    return spaced.split()


def registry_vocabulary(tools: Iterable[ToolSpec]) -> frozenset[str]:
    """Lower-cased tokens of the public tool registry: the words that carry routing meaning."""
    vocab: set[str] = set()
    for tool in tools:
        texts = [tool.tool_id, tool.name, tool.description, tool.category]
        texts += _split_identifier(tool.tool_id) + _split_identifier(tool.name)
        for text in texts:
            for token in tokenize(text):
                if token.kind in ("word", "ident", "number"):
                    vocab.add(token.text.lower())
    return frozenset(vocab)


@dataclass(frozen=True)
class Scored:
    index: int
    saliency: float
    placeholder: str


@dataclass(frozen=True)
class Residue:
    """A token of an already masked text that masking should have removed: its placeholder kind
    (EMAIL, URL, PHONE, ID, NUMBER, NAME) and where it stands (characters start:end)."""

    kind: str
    start: int
    end: int


@dataclass(frozen=True)
class MaskedText:
    text: str
    word_tokens: int
    masked_tokens: int
    masked_indices: frozenset[int]  # positions in tokenize(original); never the original text

    @property
    def masked_fraction(self) -> float:
        return self.masked_tokens / self.word_tokens if self.word_tokens else 0.0


class TextMasker:
    """Masks texts at strength λ, protecting a routing vocabulary; deterministic for a seed."""

    def __init__(
        self,
        strength: float = 1.0,
        seed: int = 0,
        protected: Iterable[str] = (),
        shared: Iterable[str] = (),
    ):
        if not (isinstance(strength, int | float) and math.isfinite(strength) and strength >= 0):
            raise ValueError(f"masking strength λ must be a finite number >= 0; got {strength!r}")
        self.strength = float(strength)
        self.seed = int(seed)
        self.protected = frozenset(folded(w) for w in protected) | FUNCTION_WORDS
        # Shared vocabulary (lower case): plain words that enough of the log's users wrote
        # (compendium.builder.shared_words); saliency 0 except where a word stands as a name.
        self.shared = frozenset(folded(w) for w in shared)

    @classmethod
    def for_registry(cls, tools: Iterable[ToolSpec], strength: float = 1.0, seed: int = 0):
        return cls(strength=strength, seed=seed, protected=registry_vocabulary(tools))

    def sharing(self, words: Iterable[str]) -> TextMasker:
        """The same masker with `words` released as shared vocabulary (see `shared`)."""
        return TextMasker(
            self.strength, self.seed, self.protected, self.shared | frozenset(folded(w) for w in words)
        )

    def score(self, tokens: list[Token]) -> list[Scored]:
        """Saliency and placeholder of every content token (protected ones score 0)."""
        out = []
        sentence_start = True
        previous = ""  # the last word, folded ("" after anything else)
        for index, token in enumerate(tokens):
            kind = token.kind
            if kind in ("space", "other"):
                if kind == "other" and _SENTENCE_END.match(token.text):
                    # "Dr. Miller": the full stop of a title starts no sentence
                    if not (token.text == "." and previous in TITLES):
                        sentence_start = True
                    previous = ""
                elif kind == "space" and "\n" in token.text:
                    sentence_start = True
                continue
            if kind in ("placeholder", "slot"):
                sentence_start = False
                previous = ""
                continue
            lower = folded(token.text)
            previous = lower if kind == "word" else ""
            if kind == "email":
                scored = Scored(index, SCORE_PII, "EMAIL")
            elif kind == "url":
                scored = Scored(index, SCORE_PII, "URL")
            elif kind == "phone":
                scored = Scored(index, SCORE_PII, "PHONE")
            elif lower in self.protected or len(token.text) == 1:
                scored = Scored(index, 0.0, "MASK")
            elif kind == "ident":
                scored = Scored(index, SCORE_ID, "ID")
            elif kind == "number":
                # in a run of number words each word counts as a digit
                digits = sum(c.isdigit() for c in token.text) + len(_LETTERS.findall(token.text))
                scored = Scored(
                    index, SCORE_LONG_NUMBER if digits >= 3 else SCORE_SHORT_NUMBER, "NUMBER"
                )
            else:
                r = rarity(lower)
                title = token.text[0].isupper() and not token.text.isupper()
                if title and not sentence_start:
                    scored = Scored(index, SCORE_NAME_BASE + SCORE_NAME_RARITY * r, "NAME")
                elif lower in self.shared:
                    scored = Scored(index, 0.0, "MASK")
                else:
                    scored = Scored(index, r, "MASK")
            sentence_start = False
            out.append(scored)
        return out

    # Up to this many characters a token's tie is drawn as it always was, from (seed, position,
    # text): every compendium built before keeps its masking, and with it every figure measured
    # on it. Beyond, hashing the whole text again for every token grows with the square of its
    # length (20,000 tokens: 4.8 s), so a longer text is hashed once and its tokens' ties derive
    # from that digest.
    TIE_WHOLE_TEXT_CHARS = 4096

    def _tie_key(self, text: str):
        """The tie-break of each token position of `text` (seeded, deterministic)."""
        if len(text) <= self.TIE_WHOLE_TEXT_CHARS:
            return lambda index: hashlib.blake2b(
                f"{self.seed}\x00{index}\x00{text}".encode("utf-8", "surrogatepass"), digest_size=8
            ).digest()
        digest = hashlib.blake2b(
            f"{self.seed}\x00{text}".encode("utf-8", "surrogatepass"), digest_size=16
        ).digest()
        return lambda index: hashlib.blake2b(
            index.to_bytes(8, "big"), key=digest, digest_size=8
        ).digest()

    def select(self, text: str, scored: list[Scored]) -> dict[int, str]:
        """Token index -> placeholder of the tokens to mask at this strength."""
        if self.strength == 0:
            return {}
        theta = threshold(self.strength)
        chosen = {s.index: s.placeholder for s in scored if s.saliency > theta}
        candidates = [s for s in scored if s.saliency > 0]
        k = math.floor(share(self.strength) * len(candidates))
        if k:
            tie = self._tie_key(text)
            ranked = sorted(candidates, key=lambda s: (-s.saliency, tie(s.index)))
            chosen.update((s.index, s.placeholder) for s in ranked[:k])
        return chosen

    def _clear(self, text: str) -> bool:
        """True when an ASCII text can hold no residue: no e-mail, URL, phone, identifier or
        number, and every capitalized word inside a sentence (the character before it, spaces
        aside, is none of .!?:; and no line break comes between; a placeholder counts as a word)
        is one masking never takes: protected, all capitals, or one letter. Saves `residue` the
        tokenizer on most masked texts."""
        if not text.isascii():
            return False
        for match in _RESIDUE_CANDIDATE.finditer(text):
            word = match.group("capital")
            if word is None:
                return False
            if len(word) == 1 or word.isupper() or word.lower() in self.protected:
                continue
            j = match.start() - 1
            while j >= 0 and text[j] in " \t\r\f\v":
                j -= 1
            if j >= 0 and text[j] not in ".!?:;\n":
                return False
            if j >= 0 and text[j] == "." and _TITLE_BEFORE.search(text, 0, j + 1):
                return False  # after a title's full stop: the tokens decide
        return True

    def residue(self, text: str, slots: bool = False) -> list[Residue]:
        """What an already masked `text` still holds that masking at this strength removes from
        any text, whatever the log: e-mails, URLs, phone numbers, identifiers, numbers and names
        (capitalized inside a sentence) whose saliency exceeds θ(λ) and that the protected
        vocabulary does not cover. What the server can check of a client's masking without its
        log: plain words are not judged (a word enough of a client's users wrote is released, and
        who wrote what stays on the client), nor the adaptive share ρ(λ) (its ranking is of the
        text before masking). Masking's output keeps the tokens it leaves and their sentence
        positions, so `mask(t).text` has no residue at the same strength and protected vocabulary,
        whatever the shared words (tested on MetaTool's queries). `slots`: `text` is a template
        body or signature, whose `{slot}`s are kept (`tokenize`); anywhere else what braces hold
        is judged as any other token."""
        if self.strength == 0 or self._clear(text):
            return []
        return self._tokenized_residue(text, slots)

    def _tokenized_residue(self, text: str, slots: bool = False) -> list[Residue]:
        """`residue` from the tokens themselves, without the shortcut of `_clear`."""
        theta = threshold(self.strength)
        tokens = tokenize(text, slots)
        out = []
        for s in self.score(tokens):
            if s.placeholder != "MASK" and s.saliency > theta:
                token = tokens[s.index]
                out.append(Residue(s.placeholder, token.start, token.start + len(token.text)))
        return out

    def mask(self, text: str, slots: bool = False) -> MaskedText:
        """`text` masked at this strength. `slots`: a template body or signature, whose
        `{slot}`s are kept as they are (`tokenize`)."""
        tokens = tokenize(text, slots)
        scored = self.score(tokens)
        chosen = self.select(text, scored)
        parts: list[str] = []
        last_placeholder: str | None = None  # placeholder at the end of `parts`, across spaces
        pending_space = ""
        for index, token in enumerate(tokens):
            if index in chosen:
                label = f"[{chosen[index]}]"
                if last_placeholder == label and pending_space.strip() == "":
                    pending_space = ""
                    continue
                parts.append(pending_space)
                pending_space = ""
                parts.append(label)
                last_placeholder = label
            elif token.kind == "space" and last_placeholder is not None:
                pending_space += token.text
            else:
                parts.append(pending_space)
                pending_space = ""
                parts.append(token.text)
                last_placeholder = None
        parts.append(pending_space)
        return MaskedText(
            text="".join(parts),
            word_tokens=sum(1 for t in tokens if t.is_word),
            masked_tokens=len(chosen),
            masked_indices=frozenset(chosen),
        )
