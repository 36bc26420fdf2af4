"""Usage log -> the client's local compendium, masked, clipped and collapsed before it leaves.

- A successful routing becomes a usage scenario of the chosen tool (with its precondition flags).
- A failure becomes a precaution of the chosen tool: "Do not use <tool> for requests like: ...".
  A correction becomes the same precaution, naming the tool that was right, and a scenario of the
  tool it was corrected to (the request was served by it).
- Prompt templates come from the `template` field of successful lines; for each (tool, signature)
  the most frequent template is kept (ties: the lexicographically smallest).
- Every text is masked at strength λ before anything else looks at it (compendium.masking);
  with `max_words` = N > 0 a masked request is then cut to its first N words (fewer bytes, less
  of each request sent, some accuracy: README "Communication"); exact duplicates are merged
  (support adds up), then near-duplicates of the same tool (and, for scenarios, the same
  preconditions) are collapsed when their embeddings have cosine >= τ.
- Pooled release (`pool_users` = k > 1), in place of the near-duplicate collapse: the distinct
  requests of each tool are pooled with their nearest neighbours until a pool holds k distinct
  users' requests, and a pool is sent as the words that two distinct users in it wrote: no text
  sent is any one request.
- k-anonymous release (`min_users` = k > 1): after the collapse, a scenario or precaution is sent
  only when at least k distinct users' requests support it; the rest stays on the client (the
  report counts it). With a looser τ more requests fold together, so more entries reach k.
- Numeric statistics per tool: compendium.clipping (per-user clipping at Δ, field cap F*,
  average over the client's users). The compendium records the F* it was built with
  (`Compendium.field_cap`), which a capped round's server checks.

Pure: no Django. The embedding engine is passed in (routing.embeddings.get_engine() by default).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Protocol

import numpy as np

from compendium.clipping import ClientStatistics, client_statistics
from compendium.masking import (
    SHARED_WORD_USERS,
    MaskedText,
    TextMasker,
    normalized,
    tokenize,
    valid_shared_word_users,
    without_placeholders,
)
from compendium.schema import (
    FIELD_CAP_MAX,
    SEED_MAX,
    SEED_MIN,
    Compendium,
    MaskingInfo,
    NumericKind,
    Precaution,
    PromptTemplate,
    Scenario,
    Schema,
    ToolMetadata,
)
from compendium.scrub import masking_residue, scrub_text
from compendium.usage_log import UsageLog, UsageLogError, UsageRecord, read_usage_log
from compendium.validation import CompendiumInvalid, validate_compendium

DEFAULT_TAU = 0.85
EMBED_CHUNK = 256
# A request is masked up to this many times the longest text it can be sent in (a scenario or a
# precaution: Schema.strings, 1,000 characters by default), cut at a space: no more of it can
# leave, and masking a 900 KB log line whole took minutes. Masking can shorten a text (a run of
# one placeholder becomes one), hence the margin.
MASKED_REQUEST_FACTOR = 8
# The server's residue check, run at the end of the build on every text it sends: how many times
# what it finds is masked before the entry is withheld instead.
RESIDUE_ROUNDS = 4
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SPACES = re.compile(r"[ \t]+")


def _no_progress(iterable: Iterable, _label: str) -> Iterable:
    return iterable


class Embedder(Protocol):
    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class BuildError(ValueError):
    """The compendium cannot be built; the message is one line a person can act on."""


@dataclass
class BuildOptions:
    strength: float = 1.0  # λ
    seed: int = 0
    field_cap: int | None = None  # F*; None: every tool a user touched (F* = K_f)
    tau: float = DEFAULT_TAU
    collapse: bool = True  # embedding-based near-duplicate collapse (exact duplicates always merge)
    # k-anonymous release: a scenario or precaution leaves the client only when at least this many
    # distinct users' requests support it (after the collapse at τ); 1 releases everything.
    min_users: int = 1
    # Pooled release (`pool_entries`), in place of the collapse: a tool's distinct requests are
    # pooled until each pool holds requests of at least this many distinct users (and at least
    # `pool_size` requests; 0: as many as `pool_users`), and a pool is sent as the words two
    # distinct users in it wrote; 1: off.
    pool_users: int = 1
    pool_size: int = 0
    # Shared words (`shared_words`): a plain word that at least this many distinct users of the
    # log wrote in lower case is not masked (it cannot single out any one of them); 0: off.
    shared_word_users: int = SHARED_WORD_USERS
    # A request leaves the client (in a scenario or a precaution) as its first `max_words` words
    # at most, after masking; 0: whole. Fewer bytes, and less of each request leaves.
    max_words: int = 0
    skip_bad_lines: bool = False
    # Numeric fields the round's edges will not release (the open round's `fields_not_released`:
    # no release of it could make them useful): not computed, not sent.
    not_released: frozenset[str] = frozenset()


@dataclass
class BuildReport:
    """What the build did. Stays on the client (no raw text, no per-user values)."""

    source: str = ""
    lines_read: int = 0
    records: int = 0
    bad_lines: list[str] = field(default_factory=list)
    num_users: int = 0
    strength: float = 0.0
    seed: int = 0
    field_cap: int | None = None
    tau: float | None = None
    word_tokens: int = 0
    masked_tokens: int = 0
    scrubbed: int = 0  # e-mails, cards, phones, long digit strings masking left (`_MaskCache`)
    capped_requests: int = 0  # longer than can be sent: masked up to MASKED_REQUEST_FACTOR × limit
    # the server's residue check (`compendium.scrub.masking_residue`) run on every text sent:
    # tokens it found that were masked then, and entries withheld because it still found some
    # (or because masking them made the text longer than the schema allows)
    residue_masked: int = 0
    residue_withheld: int = 0
    scenarios_in: int = 0
    scenarios_out: int = 0
    precautions_in: int = 0
    precautions_out: int = 0
    templates_out: int = 0
    dropped: list[str] = field(default_factory=list)
    clip_bounds: dict[str, list[float]] = field(default_factory=dict)
    clipped_values: dict[str, int] = field(default_factory=dict)
    capped_contributions: int = 0
    skipped_fields: list[str] = field(default_factory=list)
    not_released: list[str] = field(default_factory=list)  # left out: the round will not release them
    delta: dict[str, int] | None = None  # what `--since` left out (compendium.delta)
    budget: dict[str, int] | None = None  # what `--max-bytes` kept for later (compendium.delta)
    min_users: int = 1
    withheld_scenarios: int = 0  # supported by fewer than `min_users` users: not sent
    withheld_precautions: int = 0
    withheld_templates: int = 0  # the most used body of a (tool, signature) had fewer users
    pool_users: int = 1
    pooled_scenarios: int = 0  # pools sent in place of the scenarios
    shared_word_users: int = 0  # the shared-words rule's K (0: off)
    max_words: int = 0  # BuildOptions.max_words (0: whole requests)
    cut_requests: int = 0  # requests cut to their first max_words words
    shared_words: int = 0  # how many distinct words it released (the words stay on the client)
    # over what one compendium may hold (Schema.limits): the least supported, not sent
    over_limit_scenarios: int = 0
    over_limit_precautions: int = 0

    @property
    def masked_fraction(self) -> float:
        return self.masked_tokens / self.word_tokens if self.word_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["masked_fraction"] = self.masked_fraction
        return out


def clean_text(text: str) -> str:
    """NFKC form (masking.normalized: a full-width ＠ or digit is the plain one, so masking finds
    what it spells), control characters and bidirectional overrides out, whitespace runs to one
    space."""
    text = _UNSAFE.sub(" ", normalized(text).replace("\r\n", "\n"))
    return _SPACES.sub(" ", text).strip()


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def cap(text: str, limit: int) -> str:
    """The first `limit` characters of `text`, cut before the last space among them when it is
    in their second half (a token is then not cut in two)."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:space] if space > limit // 2 else cut


class _MaskCache:
    """Masks each distinct text once and keeps the totals for the masked fraction. What masking
    leaves of an e-mail address, card, phone or long digit string (masking keeps a word the
    registry covers, such as a trial number a tool's description names) is then scrubbed as the server scrubs on arrival (`compendium.scrub`), so
    none leaves the client for the server to remove."""

    def __init__(self, masker: TextMasker):
        self.masker = masker
        self.cache: dict[tuple[str, bool, int], tuple[MaskedText, str, int, bool]] = {}
        self.word_tokens = 0
        self.masked_tokens = 0
        self.scrubbed = 0  # items scrubbed, over every occurrence
        self.capped = 0  # texts masked only up to `limit` characters, over every occurrence

    def __call__(self, text: str, slots: bool = False, limit: int = 0) -> str:
        """`text` cleaned, masked (`slots`: a template body or signature) and scrubbed; with
        `limit` > 0 only its first `limit` characters, cut at a space where one is in the
        second half (`cap`)."""
        key = (text, slots, limit)
        cached = self.cache.get(key)
        if cached is None:
            cleaned = clean_text(text)
            capped = bool(limit) and len(cleaned) > limit
            if capped:
                cleaned = cap(cleaned, limit)
            result = self.masker.mask(cleaned, slots=slots)
            scrubbed = scrub_text(result.text)
            cached = self.cache[key] = (result, scrubbed.text, scrubbed.total, capped)
        result, out, scrubbed_items, capped = cached
        self.capped += capped
        # every occurrence counts: the fraction is over all the text the log contributes
        self.word_tokens += result.word_tokens
        self.masked_tokens += result.masked_tokens
        self.scrubbed += scrubbed_items
        return out


def released_fraction(value: float) -> float:
    """A fraction as `Compendium.masking` sends it: 3 significant digits, as released statistics
    are rounded (the exact ratio, 4/19, says how many tokens the log held)."""
    return float(f"{value:.3g}")


class _ResidueCheck:
    """The server's check of a client's masking (`compendium.scrub.masking_residue`, at the
    build's λ, with the registry's protected words and no shared words: the server knows none),
    run on a text as it will be sent. What it finds is replaced by its placeholder and the text
    scrubbed again, until it finds nothing (at most RESIDUE_ROUNDS times); a text it still
    flags, or that masking made longer than `limit`, is withheld (None). Needed because what
    happens to a masked text after masking (a cut, a precaution's wording around it, the scrub's
    tags, a pool of words) can leave tokens that read differently; the report counts both."""

    def __init__(self, checker: TextMasker, report: BuildReport):
        self.checker = checker
        self.report = report

    def __call__(self, text: str, limit: int, slots: bool = False) -> str | None:
        text = normalized(text)  # as the server reads it
        for round_ in range(RESIDUE_ROUNDS + 1):
            found = self.checker.residue(text, slots=slots)
            if not found:
                if len(text) > limit:
                    break
                return text
            if round_ == RESIDUE_ROUNDS:
                break
            parts, last = [], 0
            for r in found:  # tokens: in order, never overlapping
                parts += [text[last:r.start], f"[{r.kind}]"]
                last = r.end
            parts.append(text[last:])
            text = scrub_text("".join(parts)).text
            self.report.residue_masked += len(found)
        self.report.residue_withheld += 1
        return None


def _embed(embedder: Embedder, texts: list[str], progress, label: str) -> np.ndarray:
    chunks = [texts[i : i + EMBED_CHUNK] for i in range(0, len(texts), EMBED_CHUNK)]
    parts = [embedder.embed(chunk) for chunk in progress(chunks, label)]
    return np.concatenate(parts, axis=0)


def collapse_near_duplicates(
    items: list[tuple[tuple, str, int, frozenset]],
    embedder: Embedder | None,
    tau: float,
    progress: Callable[[Iterable, str], Iterable] | None = None,
    label: str = "embedding",
    members: dict[tuple, list[tuple]] | None = None,
) -> list[tuple[tuple, str, int, frozenset]]:
    """(group key, text, support, users) entries; within a group, an entry whose embedding has
    cosine >= tau with an already kept one is folded into it (support adds up, users join).
    Entries are visited by descending support then text, so the result does not depend on input
    order. `members`, when given, receives for each returned (group, text) the (group, text) of
    every entry it holds (itself first)."""
    ordered = sorted(items, key=lambda e: (repr(e[0]), -e[2], e[1]))
    if embedder is None or not ordered:
        if members is not None:
            members.update(((g, t), [(g, t)]) for g, t, *_ in ordered)
        return ordered
    vectors = _embed(embedder, [e[1] for e in ordered], progress or _no_progress, label)
    kept: list[list] = []  # [group, text, support, users]
    folded: list[list[tuple]] = []  # the (group, text) of the entries each kept one holds
    # A group's entries are consecutive (sorted by it): its kept vectors fill a matrix allocated
    # once for the group, compared with each new entry in one product, never copied (the kept
    # rows copied for every entry made this quadratic in memory traffic: 8,000 distinct
    # requests of a tool took 53 s).
    for group, rows in groupby(range(len(ordered)), key=lambda row: ordered[row][0]):
        rows = list(rows)
        matrix = np.empty((len(rows), vectors.shape[1]), dtype=vectors.dtype)
        count, first = 0, len(kept)  # kept[first + i] is matrix row i
        for row in rows:
            _, text, support, users = ordered[row]
            if count:
                sims = matrix[:count] @ vectors[row]
                best = int(np.argmax(sims))
                if float(sims[best]) >= tau:
                    kept[first + best][2] += support
                    kept[first + best][3] = kept[first + best][3] | users
                    folded[first + best].append((group, text))
                    continue
            matrix[count] = vectors[row]
            count += 1
            kept.append([group, text, support, users])
            folded.append([(group, text)])
    if members is not None:
        members.update(((g, t), held) for (g, t, *_), held in zip(kept, folded, strict=True))
    return [(g, t, s, u) for g, t, s, u in kept]


def _words(text: str) -> list[str]:
    return [t.text for t in tokenize(text) if t.kind in ("word", "ident", "number")]


def pool_text(entries: Sequence[tuple[str, frozenset]]) -> str:
    """The words of (text, users) entries that at least two distinct users wrote (compared in
    lower case; the placeholders never count), each once, in the order they first appear; ''
    when no word is. A capitalized word is sent in lower case: one that masking kept stood at the
    start of a sentence (inside one it would be a name, masked unless the registry has it), and
    in the middle of a pool it would read as a name, which the server refuses
    (`TextMasker.residue`); the embedding model is uncased."""
    who: dict[str, set] = defaultdict(set)
    for text, users in entries:
        for word in _words(text):
            who[word.lower()].update(users)
    kept: list[str] = []
    done: set[str] = set()
    for text, _ in entries:
        for word in _words(text):
            key = word.lower()
            if len(who[key]) >= 2 and key not in done:
                done.add(key)
                kept.append(key if word[:1].isupper() and not word.isupper() else word)
    return " ".join(kept)


def pool_entries(
    items: list[tuple[tuple, str, int, frozenset]],
    embedder: Embedder,
    users: int,
    size: int = 0,
    progress: Callable[[Iterable, str], Iterable] | None = None,
    label: str = "pooling",
    members: dict[tuple, list[tuple]] | None = None,
) -> tuple[list[tuple[tuple, str, int, frozenset]], int]:
    """Pooled release: within a group, each entry (by descending support, then text) that no pool
    holds yet seeds a pool, which takes its nearest free entries (cosine) until it holds at least
    `users` distinct users' requests and at least `size` entries (0: `users`). Entries too few
    to make a pool of their own join the nearest pool of their group. A pool is sent as
    `pool_text` of its
    entries (support and users add up; pools with the same words merge): no sent text is any one
    request, and each word in it appears in requests of at least two distinct users, provided an
    entry's users all wrote its text (identical requests merged, never near-duplicates). Returns the
    pools and how many entries were withheld (a group with too few users or entries, or a pool
    with no shared word). `members`, when given, receives for each returned (group, text) the
    (group, text) of every entry it holds."""
    ordered = sorted(items, key=lambda e: (repr(e[0]), -e[2], e[1]))
    if not ordered:
        return [], 0
    size = max(size, users)
    held = members  # the parameter's name is taken by each pool's rows below
    texts = [without_placeholders(e[1]) for e in ordered]
    vectors = _embed(embedder, texts, progress or _no_progress, label)
    by_group: dict[tuple, list[int]] = defaultdict(list)
    for row, entry in enumerate(ordered):
        by_group[entry[0]].append(row)
    def complete(members: list[int], who: set) -> bool:
        return len(who) >= users and len(members) >= size

    pooled: dict[tuple[tuple, str], list] = {}  # two pools with the same words are one entry
    withheld = 0
    for group, rows in by_group.items():
        free = list(rows)
        pools: list[list[int]] = []
        while free:
            seed, rest = free[0], free[1:]
            rest.sort(key=lambda r: -float(vectors[r] @ vectors[seed]))
            members, who = [seed], set(ordered[seed][3])
            for r in rest:
                if complete(members, who):
                    break
                members.append(r)
                who |= ordered[r][3]
            if not complete(members, who):
                break  # what is left cannot make a pool of its own
            pools.append(members)
            taken = set(members)
            free = [r for r in free if r not in taken]
        if free and pools:  # the leftovers join the nearest pool of their group
            seeds = np.stack([vectors[p[0]] for p in pools])
            for r in free:
                pools[int(np.argmax(seeds @ vectors[r]))].append(r)
        else:
            withheld += len(free)
        for members in pools:
            text = pool_text([(ordered[r][1], ordered[r][3]) for r in members])
            if not text:
                withheld += len(members)
                continue
            entry = pooled.setdefault((group, text), [0, frozenset()])
            entry[0] += sum(ordered[r][2] for r in members)
            entry[1] = entry[1].union(*(ordered[r][3] for r in members))
            if held is not None:
                held.setdefault((group, text), []).extend(ordered[r][:2] for r in members)
    return [(g, t, n, u) for (g, t), (n, u) in pooled.items()], withheld


def shared_words(records: Sequence[UsageRecord], users: int) -> frozenset[str]:
    """The plain words that at least `users` distinct users of the records wrote in their
    queries, in lower case: a word that several users use as a common word cannot single out any
    one of them. Only lower-case occurrences count (a capitalized word may be a name), and only
    words (never numbers, identifiers or personal-data patterns)."""
    seen: dict[str, set[str]] = defaultdict(set)
    for query, user in {(r.query, r.user) for r in records}:  # a repeated request counts once
        for token in tokenize(query):
            if token.kind == "word" and token.text.islower():
                seen[token.text].add(user)
    return frozenset(w for w, who in seen.items() if len(who) >= users)


def precaution_text(tool: str, masked_query: str, corrected_to: str, limit: int) -> str:
    """'Do not use X for requests like: <masked query> (use Y instead)', within `limit`."""
    prefix = f"Do not use {tool} for requests like: "
    suffix = f" (use {corrected_to} instead)" if corrected_to else ""
    return prefix + truncate(masked_query, max(16, limit - len(prefix) - len(suffix))) + suffix


def support_cap(schema: Schema) -> float | None:
    """N_max: how many of one user's requests an entry's support counts (the paper's per-user
    clipping of usage counts), the Δ of the schema's count field; None without one."""
    return min((f.sensitivity for f in schema.numeric_fields if f.kind == NumericKind.COUNT),
               default=None)


def clipped_support(users: Sequence[str], per_user: float | None) -> int:
    """An entry's support from the user behind each of its records: each user counts for at
    most `per_user` of them (one user repeating a request 5,000 times is not 5,000 uses)."""
    return clipped_count(Counter(users), per_user)


def clipped_count(requests: Counter, per_user: float | None) -> int:
    """`clipped_support` from how many of an entry's requests each user made."""
    if per_user is None:
        return sum(requests.values())
    return max(1, int(sum(min(n, per_user) for n in requests.values())))


def _within_limits(compendium: Compendium, schema: Schema, report: BuildReport) -> Compendium:
    """A large client's log can give more scenarios or precautions, or more bytes, than one
    compendium may hold (`Schema.limits`): the least supported are left out, as `--max-bytes`
    leaves them (they stay in the log for a later round), and the report says how many; the
    build no longer fails on it with no way round."""
    from compendium.canonical import canonical_bytes
    from compendium.delta import fit_budget, fit_counts

    limits = schema.limits
    compendium, scenarios, precautions = fit_counts(
        compendium, limits.scenarios, limits.precautions
    )
    if len(canonical_bytes(compendium)) > limits.bytes:
        compendium, budget = fit_budget(compendium, limits.bytes)
        scenarios += budget.scenarios_deferred
        precautions += budget.precautions_deferred
    report.over_limit_scenarios, report.over_limit_precautions = scenarios, precautions
    return compendium


def build_compendium(
    records: Sequence[UsageRecord],
    schema: Schema,
    options: BuildOptions | None = None,
    embedder: Embedder | None = None,
    report: BuildReport | None = None,
    progress: Callable[[Iterable, str], Iterable] | None = None,
) -> tuple[Compendium, BuildReport]:
    """Records (already parsed) -> a valid compendium and a report of what was done."""
    options = options or BuildOptions()
    report = report or BuildReport()
    report.strength, report.seed = options.strength, options.seed
    report.min_users = options.min_users
    report.pool_users = options.pool_users
    report.shared_word_users = options.shared_word_users
    report.max_words = options.max_words
    report.field_cap = options.field_cap
    report.tau = options.tau if options.collapse else None
    report.records = len(records)
    if not records:
        raise BuildError("the usage log has no usable lines: nothing to build")
    named = {r.tool for r in records} | {r.corrected_to for r in records if r.corrected_to}
    unknown = sorted(named - schema.tool_ids)
    if unknown:
        raise BuildError(f"the log names tools that are not in the schema: {', '.join(unknown)}")
    if options.min_users < 1:
        raise BuildError("min_users must be at least 1")
    if options.pool_users < 1 or options.pool_size < 0:
        raise BuildError("pool_users must be at least 1 and pool_size at least 0")
    if options.pool_users > 1 and embedder is None:
        raise BuildError("the pooled release needs an embedding engine")
    if not valid_shared_word_users(options.shared_word_users):
        raise BuildError("shared_word_users must be 0 (off) or at least 2")
    if options.max_words < 0:
        raise BuildError("max_words must be 0 (whole requests) or at least 1")
    # What the compendium records them in (a bigint, the ledger's integer column): refused here,
    # not as the built compendium's validation error once the work is done.
    if options.field_cap is not None and not 1 <= options.field_cap <= FIELD_CAP_MAX:
        raise BuildError(
            f"field_cap must be a whole number from 1 to {FIELD_CAP_MAX}, not {options.field_cap}"
        )
    if not SEED_MIN <= options.seed <= SEED_MAX:
        raise BuildError(f"seed must be a whole number from -2**63 to 2**63-1, not {options.seed}")
    if options.collapse and embedder is None:
        raise BuildError("near-duplicate collapse needs an embedding engine (or collapse=False)")
    each = progress or _no_progress

    masker = TextMasker.for_registry(schema.tools, strength=options.strength, seed=options.seed)
    checker = masker  # what the server checks with (no shared words: it cannot know them)
    if options.shared_word_users:
        shared = shared_words(records, options.shared_word_users)
        report.shared_words = len(shared)
        masker = masker.sharing(shared)
    mask = _MaskCache(masker)
    limits = schema.strings
    request_chars = MASKED_REQUEST_FACTOR * max(limits.scenario, limits.precaution)

    # (tool, flags or corrected_to, text) -> the user of each record behind it: the entry's
    # support (`clipped_support`), its distinct values the users who asked (k-anonymous release)
    scenario_users: dict[tuple, list[str]] = defaultdict(list)
    precaution_users: dict[tuple, list[str]] = defaultdict(list)
    # (tool, signature) -> body -> the user of each record that used it
    template_users: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(
        lambda: defaultdict(list))
    for record in each(records, "masking"):
        masked_query = mask(record.query, limit=request_chars)
        if options.max_words and len(words := masked_query.split()) > options.max_words:
            masked_query = " ".join(words[: options.max_words])
            report.cut_requests += 1
        if not masked_query.strip():
            report.dropped.append(f"line {record.line}: query is empty after cleaning")
            continue
        if record.outcome in ("success", "corrected"):
            tool = record.tool if record.outcome == "success" else record.corrected_to
            text = truncate(masked_query, limits.scenario)
            scenario_users[(tool, record.preconditions, text)].append(record.user)
        if record.outcome in ("failure", "corrected"):
            # grouped by (tool, corrected_to) and collapsed on the query alone: the fixed
            # wording around it would make unrelated precautions of a tool look alike
            precaution_users[(record.tool, record.corrected_to or "", masked_query)].append(record.user)
        if record.outcome == "success" and record.template is not None:
            signature = mask(record.template.signature, slots=True)
            body = mask(record.template.template, slots=True)
            if len(signature) > limits.signature or len(body) > limits.template:
                report.dropped.append(
                    f"line {record.line}: template of {record.tool} is longer than the schema "
                    f"allows ({limits.signature}/{limits.template} characters); not sent"
                )
            elif signature and body.strip():
                template_users[(record.tool, signature)][body].append(record.user)

    report.word_tokens, report.masked_tokens = mask.word_tokens, mask.masked_tokens
    report.scrubbed = mask.scrubbed
    report.capped_requests = mask.capped
    report.scenarios_in = sum(len(u) for u in scenario_users.values())
    report.precautions_in = sum(len(u) for u in precaution_users.values())
    per_user = support_cap(schema)
    scenario_items = [
        ((tool, flags), text, clipped_support(users, per_user), frozenset(users))
        for (tool, flags, text), users in scenario_users.items()
    ]
    precaution_items = [
        ((tool, right), text, clipped_support(users, per_user), frozenset(users))
        for (tool, right, text), users in precaution_users.items()
    ]
    # How many of each entry's requests each user made: an entry sent (near-duplicates folded
    # together, a pool, texts the residue check makes equal) counts each user at most N_max
    # times in all, not N_max times for each distinct request folded into it.
    scenario_requests = {
        ((tool, flags), text): Counter(users)
        for (tool, flags, text), users in scenario_users.items()
    }
    precaution_requests_in = {
        ((tool, right), text): Counter(users)
        for (tool, right, text), users in precaution_users.items()
    }
    scenario_members: dict[tuple, list[tuple]] = {}
    precaution_members: dict[tuple, list[tuple]] = {}
    if options.pool_users > 1:
        # pooling takes the place of the near-duplicate collapse: a word counts for the users who
        # wrote it, so it needs each distinct request as written (identical ones merged)
        report.tau = None
        scenarios, withheld = pool_entries(
            scenario_items, embedder, options.pool_users, options.pool_size, each,
            "pooling scenarios", scenario_members,
        )
        report.withheld_scenarios += withheld
        report.pooled_scenarios = len(scenarios)
        precautions, withheld = pool_entries(
            precaution_items, embedder, options.pool_users, options.pool_size, each,
            "pooling precautions", precaution_members,
        )
        report.withheld_precautions += withheld
    else:
        engine = embedder if options.collapse else None
        scenarios = collapse_near_duplicates(
            scenario_items, engine, options.tau, each, "embedding scenarios", scenario_members
        )
        precautions = collapse_near_duplicates(
            precaution_items, engine, options.tau, each, "embedding precautions",
            precaution_members,
        )

    def held_requests(requests: dict, members: dict, group: tuple, text: str) -> Counter:
        held: Counter = Counter()
        for member in members[(group, text)]:
            held.update(requests[member])
        return held

    if options.min_users > 1:
        report.withheld_scenarios += sum(len(u) < options.min_users for *_, u in scenarios)
        report.withheld_precautions += sum(len(u) < options.min_users for *_, u in precautions)
        scenarios = [e for e in scenarios if len(e[3]) >= options.min_users]
        precautions = [e for e in precautions if len(e[3]) >= options.min_users]
    # The server's residue check on every text as it will be sent (cut, wrapped in a
    # precaution's words, pooled, scrubbed): what it finds is masked, or the entry withheld.
    clear = _ResidueCheck(checker, report)
    merged_scenarios: dict[tuple, list] = {}
    for group, text, _, users in scenarios:
        held = held_requests(scenario_requests, scenario_members, group, text)
        text = clear(text, limits.scenario)
        if text is None:
            continue
        entry = merged_scenarios.setdefault((group, text), [Counter(), frozenset()])
        entry[0] += held
        entry[1] = entry[1] | users
    scenarios = [(g, t, clipped_count(n, per_user), u) for (g, t), (n, u) in merged_scenarios.items()]
    precaution_requests: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for (tool, right), text, _, _ in precautions:
        held = held_requests(precaution_requests_in, precaution_members, (tool, right), text)
        text = clear(precaution_text(tool, text, right, limits.precaution), limits.precaution)
        if text is not None:
            precaution_requests[(tool, text)] += held
    precaution_entries = {
        key: clipped_count(held, per_user) for key, held in precaution_requests.items()
    }

    fields = [f for f in schema.numeric_fields if f.name not in options.not_released]
    report.not_released = sorted(options.not_released & {f.name for f in schema.numeric_fields})
    stats: ClientStatistics = client_statistics(
        records, fields, field_cap=options.field_cap, seed=options.seed
    )
    report.num_users = stats.num_users
    report.clip_bounds = {name: [b.lo, b.hi] for name, b in stats.bounds.items()}
    report.clipped_values = stats.clipped_values
    report.capped_contributions = stats.capped_contributions
    report.skipped_fields = stats.skipped_fields

    # A template is text too: the body most users used (one user repeating theirs does not
    # outvote others), sent only when used by as many distinct users as a scenario needs.
    templates = []
    least = max(options.min_users, options.pool_users)
    for (tool, signature), bodies in sorted(template_users.items()):
        best, users = min(bodies.items(),
                          key=lambda kv: (-len(set(kv[1])), -len(kv[1]), kv[0]))
        if len(set(users)) < least:
            report.withheld_templates += 1
            continue
        signature = clear(signature, limits.signature, slots=True)
        best = clear(best, limits.template, slots=True) if signature is not None else None
        if signature is None or best is None or any(
            t.tool_id == tool and t.signature == signature for t in templates
        ):
            continue
        templates.append(PromptTemplate(tool_id=tool, signature=signature, template=best))

    compendium = Compendium(
        metadata=[ToolMetadata(tool_id=t, stats=v) for t, v in sorted(stats.stats.items()) if v],
        scenarios=[
            Scenario(tool_id=tool, text=text, preconditions=dict(flags),
                     support=min(n, schema.limits.counts))
            for (tool, flags), text, n, _ in scenarios
        ],
        precautions=[
            Precaution(tool_id=tool, text=text, support=min(n, schema.limits.counts))
            for (tool, text), n in sorted(precaution_entries.items())
        ],
        templates=templates,
        masking=MaskingInfo(
            strength=options.strength,
            # to 3 significant digits: 4/19 = 0.21052631578947367 in full gives the counts away
            masked_fraction=released_fraction(report.masked_fraction),
            seed=options.seed,
        ),
        num_users=stats.num_users,
        # what the statistics were capped at, so the server can refuse them under a round
        # with a smaller cap (or stats built with none) without trusting a file beside this one
        field_cap=options.field_cap,
    )
    compendium = _within_limits(compendium, schema, report)
    report.scenarios_out = len(compendium.scenarios)
    report.precautions_out = len(compendium.precautions)
    report.templates_out = len(compendium.templates)

    result = validate_compendium(compendium, schema)
    if not result.ok:
        raise CompendiumInvalid(result.violations)
    residue = masking_residue(compendium, checker)
    if residue:  # `_ResidueCheck` took all of it; never sent if not
        raise BuildError(f"{len(residue)} texts still hold what masking at λ = "
                         f"{options.strength:g} removes: {residue[0]}")
    return compendium, report


def build_from_log(
    path: str,
    schema: Schema,
    options: BuildOptions | None = None,
    embedder: Embedder | None = None,
    progress: Callable[[Iterable, str], Iterable] | None = None,
) -> tuple[Compendium, BuildReport]:
    """Read the log (every bad line reported), then build. Bad lines fail the build unless
    options.skip_bad_lines, in which case they are listed in the report."""
    options = options or BuildOptions()
    log: UsageLog = read_usage_log(
        path, known_tools=schema.tool_ids, max_flags=schema.limits.preconditions
    )
    if log.errors and not options.skip_bad_lines:
        raise UsageLogError(log)
    report = BuildReport(source=str(path), lines_read=log.lines_read, bad_lines=log.error_lines())
    return build_compendium(log.records, schema, options, embedder, report, progress)
