"""No dangling link in the docs: every relative link of README.md, docs/*.md,
RELIABILITY.md, BENCHMARKS.md and CHANGELOG.md points to a file or directory
of the repository, and its #anchor, where given, to a heading of that page
(GitHub's anchors, which the site uses too: mkdocs.yml's toc slugify).

Links in code blocks and code spans are not links. `make docs` (mkdocs build
--strict) checks the site on top of this; the last test here catches the one
thing the site adds early: a page the site includes from the root must not
link to a root file, which the site does not have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from repo import ROOT

ROOT_PAGES = ("RELIABILITY.md", "BENCHMARKS.md", "CHANGELOG.md")
HOME_END = "<!-- end of the site's home page"  # docs/index.md includes README.md up to here

FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target "title") and ![alt](target); text may hold one level of brackets and span lines.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)", re.S)
REFERENCE = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML = re.compile(r"<a\s[^>]*href=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t#]*$")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def pages() -> list[str]:
    found = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    return found + [name for name in ROOT_PAGES if (ROOT / name).exists()]


def prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (line numbers kept)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(lines))


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(path.read_text()).splitlines():
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(re.findall(r"<a\s[^>]*(?:id|name)=\"([^\"]+)\"", path.read_text()))
    return found


@dataclass(frozen=True)
class Link:
    page: str
    line: int
    target: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.target}"


def links(page: str, text: str | None = None) -> list[Link]:
    body = prose((ROOT / page).read_text() if text is None else text)
    found = []
    for pattern in (INLINE, REFERENCE, HTML):
        for match in pattern.finditer(body):
            target = match.group(1)
            if not EXTERNAL.match(target):
                found.append(Link(page, body.count("\n", 0, match.start()) + 1, target))
    return sorted(found, key=lambda link: link.line)


def resolve(link: Link) -> tuple[Path, str]:
    path, _, anchor = link.target.partition("#")
    target = (ROOT / link.page).parent / unquote(path) if path else ROOT / link.page
    return target.resolve(), unquote(anchor)


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_points_to_a_file_and_a_heading(page):
    problems = []
    for link in links(page):
        target, anchor = resolve(link)
        if ROOT not in (target, *target.parents):
            problems.append(f"{link.where}: outside the repository")
        elif not target.exists():
            problems.append(f"{link.where}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            problems.append(f"{link.where}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_the_link_check_sees_links_and_anchors():
    """The checker itself: it finds a broken file, a broken anchor, and skips code."""
    sample = ("See [a](docs/contract.md#bounds), [b](docs/nowhere.md), [c](docs/contract.md#no-such),\n"
              "[d\nwrapped](#quick-start) and `[e](not-a-link.md)`.\n\n```md\n[f](in-code.md)\n```\n")
    found = links("README.md", sample)
    assert [link.target for link in found] == ["docs/contract.md#bounds", "docs/nowhere.md",
                                               "docs/contract.md#no-such", "#quick-start"]
    assert [link.line for link in found] == [1, 1, 1, 2]
    assert "bounds" in anchors(ROOT / "docs" / "contract.md")
    assert "no-such" not in anchors(ROOT / "docs" / "contract.md")
    assert not (ROOT / "docs" / "nowhere.md").exists()
    assert github_slug("`ledger.run_guarded(job text, owner text DEFAULT NULL)`") == \
        "ledgerrun_guardedjob-text-owner-text-default-null"
    assert github_slug("Command line: `jobledger`") == "command-line-jobledger"


def test_the_pages_the_site_includes_from_the_root_link_only_into_docs():
    """docs/index.md includes README.md up to HOME_END, docs/reliability.md and
    the like include the root pages: their links are rewritten relative to
    docs/, so each must lead into docs/ (a root file is not in the site)."""
    readme = (ROOT / "README.md").read_text()
    assert HOME_END in readme, "README.md lost the marker where docs/index.md stops including it"
    included = {"README.md": readme.split(HOME_END, 1)[0]}
    included.update({name: (ROOT / name).read_text() for name in ROOT_PAGES if (ROOT / name).exists()})
    for page, text in included.items():
        wrapper = "docs/index.md" if page == "README.md" else f"docs/{page.lower()}"
        assert f'"../{page}"' in (ROOT / wrapper).read_text(), f"{wrapper} does not include {page}"
        for link in links(page, text):
            target, _ = resolve(link)
            if link.target.startswith("#"):
                continue
            assert ROOT / "docs" in target.parents and target.suffix == ".md", \
                f"{link.where}: the site has no such page; link a page under docs/ instead"
