"""The second benchmark dataset (bench/datasets/cheat, built from the cheat==2.5.1 and eg==1.2.3
sdists by bench/build_cheat_dataset.py): what the checked-in files guarantee, and what the
builder does on a tiny synthetic sdist."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from compendium.registry import load_dataset, stratified_split
from tests.conftest import ROOT

CHEAT = ROOT / "bench" / "datasets" / "cheat"


def _builder():
    spec = importlib.util.spec_from_file_location("build_cheat_dataset", ROOT / "bench" / "build_cheat_dataset.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # the module's dataclass looks itself up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_checked_in_dataset_loads_with_the_project_loader():
    dataset = load_dataset(CHEAT)  # the loader itself refuses a query whose tool is not in tools.jsonl
    assert (len(dataset.tools), len(dataset.queries)) == (165, 1412)
    assert {q.tool_id for q in dataset.queries} == dataset.tool_ids  # no tool without queries

    per_tool = Counter(q.tool_id for q in dataset.queries)
    assert min(per_tool.values()) >= 3
    qids = [q.qid for q in dataset.queries]
    assert len(set(qids)) == len(qids) and all(q.startswith("cheat-") for q in qids)

    categories = {t.category for t in dataset.tools}
    assert "" not in categories and 8 <= len(categories) <= 14
    category_of = {t.tool_id: t.category for t in dataset.tools}
    assert all(q.category == category_of[q.tool_id] for q in dataset.queries)
    assert all(0 < len(q.query) <= 1000 and q.query == q.query.strip() for q in dataset.queries)

    # every tool reaches the test split of the split the simulation uses
    split = stratified_split(dataset.queries, seed=0)
    assert {q.tool_id for q in split.test} == dataset.tool_ids


def test_checked_in_tools_keep_their_provenance():
    tools = _lines(CHEAT / "tools.jsonl")
    queries = _lines(CHEAT / "queries.jsonl")
    assert {t["description_source"] for t in tools} == {"whatis (Debian man-db)", "manual"}
    assert {t["category_source"] for t in tools} == {"derived-manual"}
    for tool in tools:
        assert tool["description"].strip()
        # a whatis line names the man section it came from; a hand-written one has none
        assert bool(tool.get("man_section")) == (tool["description_source"] != "manual")
    # descriptions are never taken from the queries; the one that equals a query is chown's
    # man-page NAME line, which a cheat sheet happens to repeat word for word
    texts = defaultdict(set)
    for q in queries:
        texts[q["tool_id"]].add(q["query"].casefold())
    assert [t["tool_id"] for t in tools if t["description"].casefold() in texts[t["tool_id"]]] == ["chown"]
    assert {q["source"] for q in queries} == {"cheat", "eg"}
    assert (CHEAT / "LICENSE").read_text().count("Permission is hereby granted") == 2


def test_checked_in_label_conflicts_are_consistent():
    queries = _lines(CHEAT / "queries.jsonl")
    by_text = defaultdict(list)
    for q in queries:
        by_text[q["query"].casefold().rstrip(".")].append(q)
    for group in by_text.values():
        tools = sorted({q["tool_id"] for q in group})
        if len(tools) == 1:
            assert len(group) == 1 and "label_conflict" not in group[0]  # no repeats per tool
        else:
            assert all(q["label_conflict"] == tools for q in group)


TAR_SHEET = """\
# To extract an uncompressed archive:
tar -xvf /path/to/foo.tar

# To create a .gz archive and exclude
# the backups:
tar czvf foo.tgz --exclude=*.bak foo/

## Heading
# Note: this is a note, not a task
tar --help

# Section heading

  an indented table row

# Show the version | the part after the bar is a note
tar --version

# Linux
tar

# to extract an uncompressed archive.
tar xf foo.tar
"""

ZIP_SHEET = """\
# To create a zip archive:
zip a.zip a

# To extract an uncompressed archive:
unzip a.zip
# Add a file to an archive
# This second sentence is a note.
zip -u a.zip b
"""

EG_TAR = """\
# tar

list the contents of an archive

    tar tf foo.tar


# Basic Usage

prose that is not a task

    tar xf foo.tar
"""


def _synthetic(tmp_path: Path) -> tuple[Path, Path, Path]:
    cheat = tmp_path / "cheat-9.9"
    sheets = cheat / "cheat" / "cheatsheets"
    sheets.mkdir(parents=True)
    (sheets / "tar").write_text(TAR_SHEET)
    (sheets / "zip").write_text(ZIP_SHEET)
    (sheets / "small").write_text("# List things\nsmall -l\n\n# Remove things\nsmall -r\n")
    (sheets / "ansi").write_text("# Regular Colors\nBlack='\\e[0;30m'\n# Bold text\nB='\\e[1m'\n# Blue text\nX=1\n")
    (cheat / "licenses").mkdir()
    (cheat / "licenses" / "mit.txt").write_text("MIT cheat text\n")
    (cheat / "PKG-INFO").write_text("Name: cheat\nVersion: 9.9\nHome-page: https://example.org/cheat\n")
    eg = tmp_path / "eg-1.0"
    (eg / "eg" / "examples").mkdir(parents=True)
    (eg / "eg" / "examples" / "tar.md").write_text(EG_TAR)
    (eg / "LICENSE.txt").write_text("MIT eg text\n")
    table = tmp_path / "table.json"
    table.write_text(
        json.dumps(
            {
                "tar": {"description": "an archiving utility", "description_source": "whatis (Debian man-db)",
                        "man_section": "1", "category": "Archives"},
                "zip": {"description": "package and compress files", "description_source": "manual",
                        "category": "Archives"},
            }
        )
    )
    return cheat, eg, table


def test_builder_on_a_synthetic_sdist(tmp_path):
    cheat, eg, table = _synthetic(tmp_path)
    out = tmp_path / "out"
    assert _builder().main(["--sdist", str(cheat), "--eg", str(eg), "--out", str(out), "--table", str(table)]) == 0

    conflict = {"label_conflict": ["tar", "zip"]}
    assert _lines(out / "queries.jsonl") == [
        {"query": "Extract an uncompressed archive", "tool_id": "tar", "category": "Archives", **conflict,
         "qid": "cheat-0", "source": "cheat"},
        {"query": "Create a .gz archive and exclude the backups", "tool_id": "tar", "category": "Archives",
         "qid": "cheat-1", "source": "cheat"},
        {"query": "Show the version", "tool_id": "tar", "category": "Archives", "qid": "cheat-2", "source": "cheat"},
        {"query": "Create a zip archive", "tool_id": "zip", "category": "Archives", "qid": "cheat-3", "source": "cheat"},
        {"query": "Extract an uncompressed archive", "tool_id": "zip", "category": "Archives", **conflict,
         "qid": "cheat-4", "source": "cheat"},
        {"query": "Add a file to an archive", "tool_id": "zip", "category": "Archives", "qid": "cheat-5",
         "source": "cheat"},
        {"query": "list the contents of an archive", "tool_id": "tar", "category": "Archives", "qid": "cheat-6",
         "source": "eg"},
    ]
    assert _lines(out / "tools.jsonl") == [
        {"tool_id": "tar", "name": "tar", "description": "an archiving utility", "category": "Archives",
         "description_source": "whatis (Debian man-db)", "category_source": "derived-manual", "man_section": "1"},
        {"tool_id": "zip", "name": "zip", "description": "package and compress files", "category": "Archives",
         "description_source": "manual", "category_source": "derived-manual"},
    ]
    license_text = (out / "LICENSE").read_text()
    assert "MIT cheat text" in license_text and "MIT eg text" in license_text
    readme = (out / "README.md").read_text()
    assert "**2 tools, 7 queries**" in readme and "tools: small" in readme
    dataset = load_dataset(out)
    assert len(dataset.tools) == 2 and len(dataset.queries) == 7
    # --check: the folder is what the builder writes from these sources, until a file changes
    check = ["--sdist", str(cheat), "--eg", str(eg), "--out", str(out), "--table", str(table), "--check"]
    assert _builder().main(check) == 0
    (out / "queries.jsonl").write_text("")
    assert _builder().main(check) == 1


def test_builder_reads_the_tarball_the_same_and_refuses_a_tool_without_a_table_entry(tmp_path):
    import tarfile

    cheat, eg, table = _synthetic(tmp_path)
    archive = tmp_path / "cheat-9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as handle:
        handle.add(cheat, arcname="cheat-9.9")
    builder = _builder()
    builder.build(cheat, None, tmp_path / "from_dir", table)
    stats = builder.build(archive, None, tmp_path / "from_tar", table)
    for name in ("tools.jsonl", "queries.jsonl", "LICENSE"):
        assert (tmp_path / "from_dir" / name).read_bytes() == (tmp_path / "from_tar" / name).read_bytes()
    assert stats["queries"] == 6 and stats["cheat"]["sha256"] and stats["eg"] is None

    entries = json.loads(table.read_text())
    del entries["zip"]
    table.write_text(json.dumps(entries))
    with pytest.raises(SystemExit, match="no description/category for zip"):
        builder.build(cheat, None, tmp_path / "again", table)
