"""The README's links lead somewhere: each `#anchor` names one of its headings (as GitHub makes
anchors from them) and each relative path is a file of the repository."""

from __future__ import annotations

import re

from tests.conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped (letters
    of any script, digits, `_` and `-` kept), spaces made hyphens, a repeated one numbered."""
    anchors: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        anchor = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        numbered, n = anchor, 0
        while numbered in anchors:
            n += 1
            numbered = f"{anchor}-{n}"
        anchors.add(numbered)
    return anchors


def test_github_anchors_follow_githubs_rules():
    doc = "## Set-up: two commands\n```sh\n# not a heading\n```\n### Privacy: ε and λ\n## A\n## A\n"
    assert github_anchors(doc) == {"set-up-two-commands", "privacy-ε-and-λ", "a", "a-1"}
    assert github_anchors("### 5 organizations × 4 clients") == {"5-organizations--4-clients"}


def test_every_link_in_the_readme_leads_somewhere():
    readme = (ROOT / "README.md").read_text()
    anchors = github_anchors(readme)
    targets = LINK.findall(readme)
    assert any(t.startswith("#") for t in targets)  # the contents list, at least
    broken = [
        target for target in targets
        if not target.startswith(("http://", "https://", "mailto:"))
        and (target[1:] not in anchors if target.startswith("#")
             else not (ROOT / target.split("#")[0]).exists())
    ]
    assert broken == []
