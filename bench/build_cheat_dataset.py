"""Build a second routing benchmark from the cheat sheets bundled in the PyPI sdist cheat==2.5.1.

Each cheat sheet (cheat/cheatsheets/NAME) documents one command-line tool with comment lines
such as `# To extract an uncompressed archive:` directly above an example command. Every such
comment is a natural-language task, labelled with the sheet's command: that is the dataset. The
examples of `eg` (PyPI eg==1.2.3, eg/examples/NAME.md: a description line, then the command
indented under it) can be added as further queries with `--eg` (the checked-in dataset has them).

    python bench/build_cheat_dataset.py --sdist cheat-2.5.1.tar.gz [--eg eg-1.2.3.tar.gz]
        [--out bench/datasets/cheat]

Standard library only. `--sdist` and `--eg` each take the sdist (.tar.gz) or its unpacked folder.
Writes `tools.jsonl`, `queries.jsonl`, `LICENSE` and `README.md` in the routing-benchmark format
(../shared/data/README.md).

Rules for queries (the same in the dataset's README):

- cheat: a *comment block* is a run of consecutive lines whose first non-blank character is `#`.
  It is a task description only when the very next line is an example: not blank, not a
  comment and not indented. A block followed by a blank line, another heading or an indented
  table (section headings such as `# Movement` in vim, notes, warnings) yields nothing.
- Within a block, lines starting with `##` are headings and are skipped; the text is the first
  remaining line, continued by the following lines only while the previous line ends without
  `.`, `:`, `!` or `?` and either the next one starts with a lower-case letter, `(` or `/`, or
  the previous one ends with a comma or a CONTINUING_WORDS word (a sentence wrapped over
  comment lines); a later line that starts a new sentence is a note and is left out. Anything after ` | ` on a line (the sheets' own "task | note" separator) is a note.
- eg: in each example file's first section (before the second `# ` heading), a paragraph of
  non-indented lines followed (after blank lines) by a line indented by four or more spaces.
- Cleaning: strip the `#` and surrounding whitespace, collapse runs of whitespace, strip one
  trailing `:`; a leading "To " (any case) is removed and the next letter upper-cased
  ("To extract an uncompressed archive:" -> "Extract an uncompressed archive"). Nothing else is
  rewritten (spelling mistakes stay).
- Dropped: texts with fewer than two words (one-word headings such as "Linux" or "Install"),
  texts that do not start with a letter, `"` or `(`, texts starting with a note marker
  (NOTE_MARKERS below, checked before "To " is removed), texts over 1,000 characters, the
  texts in MANUAL_DROPS (read by hand: headings, notes, pointers to other sheets), sheets in
  EXCLUDED_SHEETS (reference pages that are not one command), and repeats of the same text
  for the same tool (compared ignoring case and a final full stop; the first is kept).
- A text labelled with more than one tool is kept once per tool, each line with
  `label_conflict` listing all of them (as in MetaTool).
- Tools with fewer than MIN_QUERIES queries are dropped with their queries, so every tool can
  appear in train, probe and test splits.

Tools: tool_id is the sheet's (or eg file's) name. Description and category come from the
checked-in table `cheat_tools.json` next to this file, never from the queries: the description
is the command's man-page NAME line as printed by `whatis` on Debian (man-db), or written by hand
where the machine had no man page (`description_source` says which); the category is a hand-made
functional grouping (`category_source: derived-manual`). A kept tool missing from the table is
an error.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import statistics
import sys
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "cheat_tools.json"
DEFAULT_OUT = HERE / "datasets" / "cheat"
MIN_QUERIES = 3
MAX_CHARS = 1000

# Sheets that are reference pages rather than one command: colour escape codes, ASCII-art
# samples, a mix of hardware commands, library concepts, Markdown and org-mode syntax, readline
# key bindings, shell redirection.
EXCLUDED_SHEETS = {
    "ansi": "ANSI colour escape codes, not a command",
    "asciiart": "ASCII-art samples (figlet/toilet output), not a command",
    "hardware-info": "a mix of commands (lshw, lsmod, lspci, dmesg, ...), not one command",
    "lib": "notes on shared libraries (ldconfig, ldd, file locations), not one command",
    "markdown": "Markdown syntax, not a command",
    "org-mode": "Emacs org-mode syntax, not a command",
    "readline": "readline key bindings, not a command",
    "stdout": "shell redirection syntax, not a command",
}

# A description whose raw text starts with one of these words (case-insensitive, followed by a
# non-letter) is a note, not a task.
NOTE_MARKERS = ("note", "nb", "warning", "remember", "desc", "source", "or", "e.g", "tip", "doc", "link")
_NOTE = re.compile(r"^(?:{})(?![a-z])".format("|".join(map(re.escape, NOTE_MARKERS))), re.I)
# A wrapped description continues on the next comment line after a line ending in one of these.
CONTINUING_WORDS = {
    "a", "an", "the", "to", "of", "and", "or", "in", "on", "with", "for", "from", "by", "as", "at",
    "into", "using",
}

# Texts the rules keep but that are not requests (headings, notes, pointers to another sheet),
# dropped by hand after reading every kept text once: (tool, cleaned text) -> why.
MANUAL_DROPS = {
    ("apt", "Full command"): "label for a combination of the two previous examples",
    ("apt-get", "Full command"): "label for a combination of the two previous examples",
    ("chmod", "Numeric representations"): "heading of a legend, not a command",
    ("crontab", "crontab format"): "heading of a format diagram",
    ("less", "Method 2 - This should work whether input is a pipe or an ordinary file."): "note",
    ("netstat", "For netstat-r"): "pointer to the ip(8) replacement",
    ("netstat", "For netstat -i"): "pointer to the ip(8) replacement",
    ("netstat", "For netstat-g"): "pointer to the ip(8) replacement",
    ("ntp", "Config file"): "a file location, not a command",
    ("pacman", "You can't directly install packages from the Arch User Database (AUR) with pacman."): "note",
    ("pushd", "Return use popd"): "pointer to the popd sheet",
    ("python", "Python v2.7"): "version heading",
    ("python", "Python 3"): "version heading",
    ("sqlmap", "Enumeration flags"): "heading",
    ("sqlmap", "Other database commands"): "heading",
    ("systemd", "Unit file locations"): "a file location, not a command",
    ("yaourt", "All pacman commands are working the same way with yaourt."): "note",
    ("yaourt", "For all of the above commands, if you want yaourt to stop asking constantly for confirmations,"): "note",
    ("zip", "List, test and extract zip archives, see unzip"): "pointer to the unzip sheet",
}
_TO = re.compile(r"^to\s+", re.I)
_SENTENCE_END = (".", ":", "!", "?")


@dataclass(frozen=True)
class Task:
    text: str
    tool_id: str
    source: str  # "cheat" or "eg"


# ---------------------------------------------------------------------------------------------
# reading the sdists


def _members(path: Path, inner: str) -> dict[str, str]:
    """name -> text of the files directly under `inner` (e.g. cheat/cheatsheets) in an sdist
    (.tar.gz) or its unpacked folder."""
    files: dict[str, str] = {}
    if path.is_dir():
        folder = path / inner
        if not folder.is_dir():
            candidates = [p for p in path.iterdir() if (p / inner).is_dir()]
            if len(candidates) != 1:
                raise SystemExit(f"{path}: no {inner}/ folder in it")
            folder = candidates[0] / inner
        for item in sorted(folder.iterdir()):
            if item.is_file():
                files[item.name] = item.read_text(encoding="utf-8")
        return files
    with tarfile.open(path, "r:gz") as archive:
        for member in archive.getmembers():
            parts = member.name.split("/")
            # <package-version>/<inner...>/<name>
            if member.isfile() and "/".join(parts[1:-1]) == inner:
                handle = archive.extractfile(member)
                assert handle is not None
                files[parts[-1]] = io.TextIOWrapper(handle, encoding="utf-8").read()
    if not files:
        raise SystemExit(f"{path}: no files under {inner}/ in this archive")
    return dict(sorted(files.items()))


def _sha256(path: Path) -> str | None:
    if path.is_dir():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_one(path: Path, relative: str) -> str | None:
    """One file of an sdist (.tar.gz, under its top folder) or of its unpacked folder."""
    if path.is_dir():
        target = path / relative
        return target.read_text(encoding="utf-8") if target.is_file() else None
    with tarfile.open(path, "r:gz") as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.split("/", 1)[-1] == relative:
                handle = archive.extractfile(member)
                assert handle is not None
                return io.TextIOWrapper(handle, encoding="utf-8").read()
    return None


def _package(path: Path) -> dict[str, str | None]:
    info = _read_one(path, "PKG-INFO") or ""
    fields = dict(re.findall(r"^(Name|Version|Home-page): (.*)$", info, re.M))
    return {
        "name": fields.get("Name"),
        "version": fields.get("Version"),
        "home": fields.get("Home-page"),
        "file": path.name,
        "sha256": _sha256(path),
    }


# ---------------------------------------------------------------------------------------------
# parsing


def clean(text: str) -> str | None:
    """The user-facing request for one description, or None when it is not a task."""
    text = " ".join(text.split())
    if _NOTE.match(text):
        return None
    if text.endswith(":"):
        text = text[:-1].rstrip()
    if _TO.match(text):
        text = _TO.sub("", text, count=1)
        text = text[:1].upper() + text[1:]
    if not text or not (text[0].isalpha() or text[0] in "\"("):
        return None
    if len(text.split()) < 2 or len(text) > MAX_CHARS:
        return None
    return text


def _key(text: str) -> str:
    """What two texts must share to count as the same request: case and a final full stop aside."""
    return text.casefold().rstrip(".").rstrip()


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def _comment_text(line: str) -> str:
    return line.lstrip().lstrip("#").strip()


def _block_text(block: list[str]) -> str:
    lines = [line for line in block if not line.lstrip().startswith("##")]
    lines = [_comment_text(line).split(" | ")[0].strip() for line in lines]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    text = [lines[0]]
    for line in lines[1:]:
        previous = text[-1]
        if previous.endswith(_SENTENCE_END):
            break
        wrapped = (
            line[0].islower()
            or line[0] in "(/"
            or previous.endswith(",")
            or previous.split()[-1].lower() in CONTINUING_WORDS
        )
        if not wrapped:
            break
        text.append(line)
    return " ".join(text)


def parse_cheatsheet(body: str) -> list[str]:
    """Raw description texts of one cheat sheet, in order (before `clean`)."""
    lines = body.splitlines()
    texts = []
    i = 0
    while i < len(lines):
        if not _is_comment(lines[i]):
            i += 1
            continue
        j = i
        while j < len(lines) and _is_comment(lines[j]):
            j += 1
        following = lines[j] if j < len(lines) else ""
        if following.strip() and not following[0].isspace():
            text = _block_text(lines[i:j])
            if text:
                texts.append(text)
        i = j
    return texts


def parse_eg(body: str) -> list[str]:
    """Raw description texts of one eg example file's first section (before `clean`)."""
    lines = body.splitlines()
    start = next((n + 1 for n, line in enumerate(lines) if line.startswith("# ")), 0)
    end = next((n for n in range(start, len(lines)) if lines[n].startswith("# ")), len(lines))
    texts: list[str] = []
    paragraph: list[str] = []
    blank_since = False
    for line in lines[start:end]:
        if not line.strip():
            blank_since = True
            continue
        if line[:1].isspace():
            if paragraph:
                texts.append(" ".join(part.strip() for part in paragraph))
            paragraph = []
        else:
            if blank_since:
                paragraph = []
            paragraph.append(line)
        blank_since = False
    return texts



# ---------------------------------------------------------------------------------------------
# building


def collect(cheat: dict[str, str], eg: dict[str, str] | None) -> tuple[list[Task], Counter]:
    """Every kept (text, tool) pair in source order, and counts of what was dropped why."""
    dropped: Counter = Counter()
    tasks: list[Task] = []
    seen: set[tuple[str, str]] = set()

    def add(raw: str, tool: str, source: str) -> None:
        text = clean(raw)
        if text is None:
            dropped[f"not a task ({source})"] += 1
            return
        if (tool, text) in MANUAL_DROPS:
            dropped[f"dropped by hand ({source})"] += 1
            return
        key = (_key(text), tool)
        if key in seen:
            dropped[f"repeat for the same tool ({source})"] += 1
            return
        seen.add(key)
        tasks.append(Task(text, tool, source))

    for name, body in cheat.items():
        if name in EXCLUDED_SHEETS:
            dropped["in an excluded sheet (cheat)"] += len(parse_cheatsheet(body))
            continue
        for raw in parse_cheatsheet(body):
            add(raw, name, "cheat")
    for name, body in (eg or {}).items():
        if not name.endswith(".md"):
            continue
        for raw in parse_eg(body):
            add(raw, name[: -len(".md")], "eg")
    return tasks, dropped


def build(
    cheat_path: Path, eg_path: Path | None, out: Path, table_path: Path = TABLE
) -> dict:
    """Write the dataset into `out`; returns the counts that its README reports."""
    cheat = _members(cheat_path, "cheat/cheatsheets")
    eg = _members(eg_path, "eg/examples") if eg_path else None
    tasks, dropped = collect(cheat, eg)
    table = json.loads(table_path.read_text(encoding="utf-8"))

    per_tool = Counter(t.tool_id for t in tasks)
    small = sorted(tool for tool, n in per_tool.items() if n < MIN_QUERIES)
    for tool in small:
        dropped[f"tool with fewer than {MIN_QUERIES} queries"] += per_tool[tool]
    tasks = [t for t in tasks if t.tool_id not in small]
    kept_tools = sorted({t.tool_id for t in tasks})
    missing = [tool for tool in kept_tools if tool not in table]
    if missing:
        raise SystemExit(f"no description/category for {', '.join(missing)} in {table_path}")

    # label conflicts among the kept tools only
    labels: dict[str, set[str]] = defaultdict(set)
    for task in tasks:
        labels[_key(task.text)].add(task.tool_id)

    out.mkdir(parents=True, exist_ok=True)
    with (out / "tools.jsonl").open("w", encoding="utf-8") as handle:
        for tool in kept_tools:
            entry = table[tool]
            row = {
                "tool_id": tool,
                "name": tool,
                "description": entry["description"],
                "category": entry["category"],
                "description_source": entry["description_source"],
                "category_source": "derived-manual",
            }
            if entry.get("man_section"):
                row["man_section"] = entry["man_section"]
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    with (out / "queries.jsonl").open("w", encoding="utf-8") as handle:
        for number, task in enumerate(tasks):
            row = {"query": task.text, "tool_id": task.tool_id, "category": table[task.tool_id]["category"]}
            tools = labels[_key(task.text)]
            if len(tools) > 1:
                row["label_conflict"] = sorted(tools)
            row["qid"] = f"cheat-{number}"
            row["source"] = task.source
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    counts = Counter(t.tool_id for t in tasks)
    ordered = sorted(counts.values())
    stats = {
        "tools": len(kept_tools),
        "queries": len(tasks),
        "queries_by_source": dict(sorted(Counter(t.source for t in tasks).items())),
        "per_tool_min": ordered[0],
        "per_tool_median": statistics.median(ordered),
        "per_tool_max": ordered[-1],
        "largest_tools": [f"{tool} ({n})" for tool, n in counts.most_common(3)],
        "categories": dict(sorted(Counter(table[t]["category"] for t in kept_tools).items())),
        "conflicting_texts": sorted(text for text, tools in labels.items() if len(tools) > 1),
        "description_sources": dict(sorted(Counter(table[t]["description_source"] for t in kept_tools).items())),
        "dropped_tools": small,
        "dropped": dict(sorted(dropped.items())),
        "sheets": len(cheat),
        "eg_files": len([n for n in (eg or {}) if n.endswith(".md")]),
        "cheat": _package(cheat_path),
        "eg": _package(eg_path) if eg_path else None,
    }
    _write_license(out, cheat_path, eg_path)
    _write_readme(out, stats)
    return stats


def _write_license(out: Path, cheat_path: Path, eg_path: Path | None) -> None:
    mit = _read_one(cheat_path, "licenses/mit.txt")
    if mit is None:
        raise SystemExit(f"{cheat_path}: no licenses/mit.txt")
    parts = [
        "The cheat sheets (queries with source \"cheat\") come from the PyPI package cheat 2.5.1,\n"
        "dual-licensed under the MIT and GPL-3 licenses; this dataset uses them under the MIT\n"
        "license (the text below, licenses/mit.txt in the package).\n\n" + mit.strip() + "\n"
    ]
    if eg_path:
        eg_license = _read_one(eg_path, "LICENSE.txt")
        if eg_license is None:
            raise SystemExit(f"{eg_path}: no LICENSE.txt")
        parts.append(
            "The examples with source \"eg\" come from the PyPI package eg 1.2.3 (MIT license,\n"
            "LICENSE.txt in the package):\n\n" + eg_license.strip() + "\n"
        )
    (out / "LICENSE").write_text(("\n" + "-" * 78 + "\n\n").join(parts), encoding="utf-8")


def _source_line(package: dict) -> str:
    digest = f", sha256 `{package['sha256']}`" if package["sha256"] else " (unpacked folder, no sha256)"
    return f"`{package['file']}` ({package['name']} {package['version']}, {package['home']}){digest}"


def _write_readme(out: Path, stats: dict) -> None:
    categories = "\n".join(f"| {name} | {n} |" for name, n in stats["categories"].items())
    dropped = "\n".join(f"- {why}: {n}" for why, n in stats["dropped"].items())
    conflicts = len(stats["conflicting_texts"])
    by_source = ", ".join(f"{n:,} from {src}" for src, n in stats["queries_by_source"].items())
    sources = ", ".join(f"{n} {src}" for src, n in stats["description_sources"].items())
    eg_line = f"\n- {_source_line(stats['eg'])}: `eg/examples/*.md`, {stats['eg_files']} files." if stats["eg"] else ""
    excluded = ", ".join(f"`{name}`" for name in sorted(EXCLUDED_SHEETS))
    text = f"""# cheat: a routing benchmark from command-line cheat sheets

A second tool-routing dataset in the routing-benchmark format (`shared/data/README.md` beside the
project; the project reads it by path, e.g. `simulate --dataset bench/datasets/cheat`). Each
tool is a command-line program; each query is a task description that the program's cheat sheet
answers with an example command. Built by `bench/build_cheat_dataset.py` (standard library only)
with the descriptions and categories of `bench/cheat_tools.json`:

```sh
python bench/build_cheat_dataset.py --sdist cheat-2.5.1.tar.gz --eg eg-1.2.3.tar.gz \\
    --out bench/datasets/cheat
# with --check: build elsewhere and say whether the checked-in files are exactly that build
```

## Source

- {_source_line(stats['cheat'])}: `cheat/cheatsheets/*`, {stats['sheets']} sheets.{eg_line}

Both from PyPI (`pip download --no-deps cheat==2.5.1 eg==1.2.3`). Licenses: see `LICENSE` in this
folder, which must travel with any copy (cheat is dual MIT/GPL-3 and is used here under MIT; eg
is MIT).

## Counts

- **{stats['tools']} tools, {stats['queries']:,} queries** ({by_source}).
- Queries per tool: min {stats['per_tool_min']}, median {stats['per_tool_median']:g}, max {stats['per_tool_max']}
  (largest: {', '.join(stats['largest_tools'])}).
- {conflicts} query texts carry more than one tool (`label_conflict`, one line per tool).
- Descriptions: {sources}.
- {len(stats['categories'])} categories (`category_source: derived-manual`):

| category | tools |
| --- | --- |
{categories}

Dropped while building:
{dropped}
- tools: {', '.join(stats['dropped_tools']) or 'none'}

## Rules

Queries (`queries.jsonl`: `query`, `tool_id`, `category`, `qid` = `cheat-N` in build order,
`source` = `cheat` or `eg`, and `label_conflict` where a text has more than one tool):

- cheat sheets: a run of consecutive `#` lines is a task description only when the very next
  line is an example (not blank, not a comment, not indented); headings followed by a blank line
  or an indented table (vim, emacs, gpg, r2 sections) yield nothing. Lines starting with `##`
  are headings. The text is the block's first line, continued over following lines only while
  it is a wrapped sentence (the line does not end in `.`, `:`, `!`, `?` and the next starts in
  lower case, with `(` or `/`, or the line ends with a comma or a word like "the", "to", "of");
  later lines are notes and are left out, as is anything after ` | ` on a line.
- eg: in each example file's first section, a paragraph followed by an indented command.
- Cleaning: the `#` and surrounding whitespace go, whitespace is collapsed, one trailing `:` is
  removed, and a leading "To " is removed with the next letter upper-cased ("# To extract an
  uncompressed archive:" becomes "Extract an uncompressed archive"). Spelling is left as is.
- Dropped: texts of one word (headings such as "Linux", "Install"), texts that do not start
  with a letter, `"` or `(`, texts starting with a note word (Note, NB, WARNING, REMEMBER, Desc,
  Source, OR, e.g., Tip, Doc, Link), texts over 1,000 characters, repeats of a text for the same
  tool (ignoring case and a final full stop), {len(MANUAL_DROPS)} texts dropped by hand after reading every kept text
  (`MANUAL_DROPS` in the builder: "Full command", "For netstat -i", "Config file", pointers to
  other sheets), and the sheets that are not one command:
  {excluded}.
- Tools with fewer than {MIN_QUERIES} queries are dropped with their queries, so that every tool
  can appear in a stratified train / probe / test split.

Tools (`tools.jsonl`: `tool_id` = the sheet's name, `name`, `description`, `category`,
`description_source`, `category_source`, and `man_section` for whatis entries):

- `description` is never derived from the queries. `whatis (Debian man-db)`: the NAME line of
  the command's man page as `whatis -l -s 1,8 CMD` printed it on a Debian machine (the entry
  named exactly CMD), recorded once in `bench/cheat_tools.json` so that a build needs no man
  pages. `manual`: written by hand for commands without a man page on that machine, after the
  upstream man page's NAME line or the project's one-line summary where one is known.
- `category`: a hand-made functional grouping of the commands.

## Known issues

- The cheat sheets are community-written notes, not curated requests: some texts are notes
  ("You can also use --verify=<CA_BUNDLE_PATH> to set a CUSTOM CA BUNDLE path"), headings that
  happen to sit right above a command ("Regular Forms", "Basic auth"), or name their tool
  ("Watch the progress of 'dd'", "Start tmux"). The eg examples are terse and lower-case. Treat
  this as real-world noise.
- Some examples are run with another command than the sheet's (the `ntp` sheet is mostly
  `hwclock`, `hub` examples are `git ...` through the hub alias, `convert` ends with a bash
  loop); the label is the sheet, as a user browsing cheat sheets would find it.
- Overlapping tools: apt / apt-get / aptitude, yum / dnf / rpm, pacman / yaourt, nc / ncat /
  socat, ifconfig / ip / iwconfig, netstat / ss, systemctl / systemd, curl / wget / http,
  more / less, cpdf / pdftk, ps / top, head / tail. {conflicts} texts are labelled with two or
  more of them.
- whatis NAME lines are sometimes uninformative for routing ("apt: command-line interface",
  "git: the stupid content tracker", "less: opposite of more"); they are kept as published.
- Small: median {stats['per_tool_median']:g} queries per tool, so a 40% test split leaves few
  training queries for most tools.
- Label conflicts are detected by exact text (ignoring case and a final full stop) only;
  near-duplicates across tools ("Install a package" / "Install some packages") are not marked.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", required=True, type=Path, help="cheat-2.5.1.tar.gz or its unpacked folder")
    parser.add_argument("--eg", type=Path, default=None, help="eg-1.2.3.tar.gz or its unpacked folder (optional)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--table", type=Path, default=TABLE, help=argparse.SUPPRESS)
    parser.add_argument(
        "--check", action="store_true",
        help="build into a temporary folder and compare with --out instead of writing it; "
        "exit 1 naming the files that differ",
    )
    args = parser.parse_args(argv)
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            build(args.sdist, args.eg, Path(tmp), args.table)
            differ = [
                name for name in ("tools.jsonl", "queries.jsonl", "LICENSE")
                if (Path(tmp) / name).read_bytes() != (args.out / name).read_bytes()
            ]
        print(f"{args.out}: " + (f"differs in {', '.join(differ)}" if differ else "as built"))
        return 1 if differ else 0
    stats = build(args.sdist, args.eg, args.out, args.table)
    json.dump(stats, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
