"""The fenced blocks of the docs and their markers, read the way a reader sees them.

tests/docs/test_docs_examples.py holds the rule (every python and sql block
runs, unless a marker names the test that runs it or says why not); the tests
that run a page's blocks themselves (tests/cli/test_report.py,
tests/docs/test_readme_sql.py ...) read them through here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from repo import ROOT

EXECUTED = ("python", "sql")

MARKER = re.compile(r"^<!--\s*(?:executed by (?P<by>tests/[\w/]+\.py)\b.*?|not executed:(?P<reason>.*?))\s*-->$")
MARKER_LIKE = re.compile(r"^<!--\s*(?:not )?executed\b", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<lang>[^\s`]*)[^`]*$")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t#]*$")


def pages() -> list[str]:
    """Every page whose examples count, relative to the repository root."""
    found = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    return found + [name for name in ("RELIABILITY.md", "BENCHMARKS.md", "CHANGELOG.md") if (ROOT / name).exists()]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    section: str  # the ## heading it is under ("" before the first)
    executed_by: str | None  # a test file, from an `executed by` marker
    not_executed: str | None  # the reason, from a `not executed` marker

    @property
    def runs_here(self) -> bool:
        return self.lang in EXECUTED and self.executed_by is None and self.not_executed is None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` in document order, with their markers."""
    lines = (ROOT / page).read_text().splitlines()
    blocks: list[Block] = []
    section = ""
    previous = ""  # the last non-blank line outside a fence
    number = 0
    while number < len(lines):
        line = lines[number]
        opening = FENCE.match(line)
        if opening is None:
            heading = HEADING.match(line)
            if heading and len(heading.group(1)) == 2:
                section = heading.group(2)
            if line.strip():
                previous = line.strip()
            number += 1
            continue
        indent, fence = opening.group("indent"), opening.group("fence")
        body: list[str] = []
        end = number + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{fence}`*[ \t]*$", lines[end]):
            body.append(lines[end][len(indent):] if lines[end].startswith(indent) else lines[end].lstrip())
            end += 1
        marker = MARKER.match(previous)
        blocks.append(Block(
            page=page, line=number + 1, lang=opening.group("lang").lower(), body="".join(f"{b}\n" for b in body),
            section=section, executed_by=marker.group("by") if marker else None,
            not_executed=marker.group("reason").strip() if marker and marker.group("reason") is not None else None))
        previous = ""
        number = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in page_blocks(page)]


def pages_with_examples_here() -> list[str]:
    return [page for page in pages() if any(block.runs_here for block in page_blocks(page))]
