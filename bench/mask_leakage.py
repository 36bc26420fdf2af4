"""How much of a text survives client-side masking, and how much of what identifies it.

On the queries of a routing-benchmark dataset (default: MetaTool, the texts a client's scenarios
are made of), for each masking strength λ:

- `masked_fraction`: masked content tokens / content tokens (all texts pooled);
- `token_overlap`: per text, the share of the original's lower-cased word tokens (as a multiset)
  still present in the masked text; mean over texts;
- `jaccard`: per text, Jaccard similarity of the two sets of lower-cased word tokens; mean;
- `d_text`: per text, token-level Levenshtein distance / max(token counts) (the paper's d_text);
- `distinctive_removed`: share of distinctive token occurrences that were masked. A token is
  DISTINCTIVE when it is personal-data-like (an e-mail, URL, phone number, number, or identifier
  mixing letters and digits) or rare in the public reference vocabulary: Zipf frequency < 3.0 in
  wordfreq's English list (fewer than one occurrence per million words; unknown words count).
  The definition does not use the masker's own scores, capitalization or the registry;
- `distinctive_private_removed`: the same over distinctive tokens that are NOT words of the tool
  registry (those are public already, and the masker keeps them on purpose);
- `planted_removed`: every `--plant-every`-th text gets a synthetic name, e-mail, phone and ticket
  number appended; the share of those planted tokens masked;
- `mask_ms_per_text`: wall-clock masking time per text.

Usage: python bench/mask_leakage.py [--dataset ../shared/data/metatool] [--limit N] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAMBDAS = (0.0, 0.5, 1.0, 1.5)
RARE_ZIPF = 3.0
PII_KINDS = ("email", "url", "phone", "number", "ident")
FIRST = ["Margaret", "Oswald", "Ingrid", "Tobias", "Priyanka", "Lucian", "Henrietta", "Dmitri"]
LAST = ["Thornbury", "Pemberton", "Vasquez", "Okonkwo", "Haldane", "Szymanski", "Castellanos"]


def plant(text: str, rng: random.Random) -> tuple[str, list[str]]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    email = f"{first.lower()}.{last.lower()}@example{rng.randrange(100)}.org"
    phone = f"+1 {rng.randrange(200, 999)} 555 {rng.randrange(1000, 9999)}"
    ticket = str(rng.randrange(10_000, 9_999_999))
    planted = f"{text} Ask my colleague {first} {last} at {email} or {phone} about ticket {ticket}."
    return planted, [first, last, email, phone, ticket]


def levenshtein(a: list[str], b: list[str]) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def run(dataset: Path, limit: int | None, plant_every: int, seed: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from _routing_common import read_dataset

    from compendium.masking import TextMasker, registry_vocabulary, tokenize, zipf

    data = read_dataset(dataset, "mask_leakage")
    rng = random.Random(seed)
    texts = [q.query for q in data.queries]
    if limit:
        texts = rng.sample(texts, min(limit, len(texts)))
    planted_tokens: dict[int, list[str]] = {}
    for index in range(0, len(texts), plant_every):
        texts[index], planted_tokens[index] = plant(texts[index], rng)
    public = registry_vocabulary(data.tools)

    def words(text: str) -> list[str]:
        return [t.text.lower() for t in tokenize(text) if t.is_word]

    def distinctive(token) -> bool:
        return token.kind in PII_KINDS or (token.kind == "word" and zipf(token.text.lower()) < RARE_ZIPF)

    rows = []
    for strength in LAMBDAS:
        masker = TextMasker.for_registry(data.tools, strength=strength, seed=seed)
        masker.mask(texts[0])  # load the reference vocabulary outside the timing
        counts: Counter = Counter()
        overlap = jaccard = d_text = 0.0
        started = time.perf_counter()
        results = [masker.mask(text) for text in texts]
        elapsed = time.perf_counter() - started
        for index, (text, result) in enumerate(zip(texts, results, strict=True)):
            tokens = tokenize(text)
            original, masked = words(text), words(result.text)
            counts["word_tokens"] += result.word_tokens
            counts["masked_tokens"] += result.masked_tokens
            if original:
                kept = sum((Counter(original) & Counter(masked)).values())
                overlap += kept / len(original)
                union = set(original) | set(masked)
                jaccard += len(set(original) & set(masked)) / len(union)
                d_text += levenshtein(original, masked) / max(len(original), len(masked))
            for position, token in enumerate(tokens):
                if not token.is_word or not distinctive(token):
                    continue
                gone = position in result.masked_indices
                counts["distinctive"] += 1
                counts["distinctive_removed"] += gone
                if token.text.lower() not in public:
                    counts["private"] += 1
                    counts["private_removed"] += gone
            for secret in planted_tokens.get(index, []):
                counts["planted"] += 1
                counts["planted_removed"] += secret not in result.text
        n = len(texts)
        rows.append(
            {
                "dataset": dataset.name,
                "masking_strength": strength,
                "seed": seed,
                "texts": n,
                "planted_texts": len(planted_tokens),
                "word_tokens": counts["word_tokens"],
                "masked_fraction": counts["masked_tokens"] / counts["word_tokens"],
                "token_overlap": overlap / n,
                "jaccard": jaccard / n,
                "d_text": d_text / n,
                "distinctive_tokens": counts["distinctive"],
                "distinctive_removed": counts["distinctive_removed"] / max(1, counts["distinctive"]),
                "distinctive_private_tokens": counts["private"],
                "distinctive_private_removed": counts["private_removed"] / max(1, counts["private"]),
                "planted_removed": counts["planted_removed"] / max(1, counts["planted"]),
                "mask_ms_per_text": 1000 * elapsed / n,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "metatool"))
    parser.add_argument("--limit", type=int, default=None, help="sample this many texts")
    parser.add_argument("--plant-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    # before the dataset is read: random.sample refused a negative count with a traceback
    from _routing_common import check_out, refuse_counts_below

    if args.limit is not None:
        refuse_counts_below(parser, ("--limit", args.limit, 1))

    check_out(args.out, "mask_leakage")
    rows = run(Path(args.dataset), args.limit, max(1, args.plant_every), args.seed)
    columns = [
        ("λ", "masking_strength", "{:.1f}"),
        ("masked", "masked_fraction", "{:.3f}"),
        ("overlap", "token_overlap", "{:.3f}"),
        ("jaccard", "jaccard", "{:.3f}"),
        ("d_text", "d_text", "{:.3f}"),
        ("distinct.rm", "distinctive_removed", "{:.3f}"),
        ("private.rm", "distinctive_private_removed", "{:.3f}"),
        ("planted.rm", "planted_removed", "{:.3f}"),
        ("ms/text", "mask_ms_per_text", "{:.3f}"),
    ]
    first = rows[0]
    print(
        f"{first['dataset']}: {first['texts']} texts ({first['planted_texts']} with planted "
        f"personal data), {first['word_tokens']} tokens, {first['distinctive_tokens']} distinctive "
        f"({first['distinctive_private_tokens']} not in the registry)"
    )
    print(" ".join(f"{title:>11}" for title, _, _ in columns))
    for row in rows:
        print(" ".join(f"{fmt.format(row[key]):>11}" for _, key, fmt in columns))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
