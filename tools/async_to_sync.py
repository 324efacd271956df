#!/usr/bin/env python3
"""Write the sync Python client from the async one: ``ledger/aio.py`` -> ``ledger/client.py``.

The async client is the one source (as psycopg does with its
``tools/async_to_sync.py``). This tool works on tokens, so the generated file
keeps the source's layout, comments and docstrings:

- ``if ASYNC:`` blocks keep their ``else:`` branch (or nothing), and
  ``if not ASYNC:`` blocks their body: what only one client does;
- ``async`` before ``def``/``with``/``for`` and every ``await`` go;
- ``Awaitable[X]`` becomes ``X``, ``ashield(end)`` becomes ``end``;
- names are renamed by :data:`NAMES` (``AsyncLedger`` -> ``Ledger``,
  ``ALock`` -> ``Lock``, ...), in code, docstrings and comments alike, and a
  few phrases of prose by :data:`PHRASES`;
- continuation lines aligned to an opening bracket stay aligned.

``--check`` fails (exit 1, with a diff) when a generated file is not what the
source makes of it: CI runs it, so the generated file is never edited by hand.

Usage: ``python tools/async_to_sync.py [--check]`` (``make sync``, ``make sync-check``).
"""

from __future__ import annotations

import argparse
import difflib
import io
import keyword
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "ledger/aio.py": "ledger/client.py",
    # the client's behaviour tests: one source, the sync twin generated like the client
    "tests/client/test_client_async.py": "tests/client/test_client.py",
}
"""source -> generated, relative to the repository."""

NAMES = {
    # the client's own classes
    "AsyncLedger": "Ledger",
    "AsyncRunContext": "RunContext",
    "AsyncLeaseContext": "LeaseContext",
    "AsyncScheduledJob": "ScheduledJob",
    "AsyncHolding": "Holding",
    "_AsyncHolding": "_Holding",
    "AsyncControl": "Control",
    "_AsyncControl": "_Control",
    "AsyncHeartbeat": "Heartbeat",
    "AsyncWatchdog": "Watchdog",
    # psycopg, psycopg_pool, typing
    "AsyncConnection": "Connection",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncClientCursor": "ClientCursor",
    "AsyncIterator": "Iterator",
    "AsyncGenerator": "Generator",
    "AsyncTransaction": "Transaction",
    "asynccontextmanager": "contextmanager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    # ledger._acompat: each async primitive and its sync twin
    "ALock": "Lock",
    "AEvent": "Event",
    "aspawn": "spawn",
    "adefer": "defer",
    "ADeferred": "Deferred",
    "ajoin": "join",
    "in_task": "in_thread",
    "await_event": "wait_event",
    "keep_result_async": "keep_result",
    # ledger.connect
    "connect_async": "connect",
    "execute_bounded_async": "execute_bounded",
    "make_async_pool": "make_pool",
    "open_async_pool": "open_pool",
    # the tests
    "aledger": "ledger",
    "aconn": "conn",
    "apool": "pool",
    "test_client_async": "test_client",
    "adb": "db",  # the async twins of tests/conftest.py's fixtures: adb is db, aconnect is connect
    "aconnect": "connect",
    "asleep": "sleep",  # asyncio.sleep and time.sleep, imported as these names in an `if ASYNC:` block
    # the async test checks the loop's tasks beside the threads; its sync twin is named without them
    "test_no_task_thread_or_connection_leaks_after_1000_runs": "test_no_thread_or_connection_leaks_after_1000_runs",
}

PHRASES = [
    # prose that names the flavour, and the articles before renamed names
    ("an AsyncLedger", "a Ledger"),
    ("an AsyncConnectionPool", "a ConnectionPool"),
    ("an AsyncConnection", "a Connection"),
    ("The asyncio Python client", "The sync Python client"),
    ("``async with``", "``with``"),
    ("``async for``", "``for``"),
    ("``async with ", "``with "),
    ("``async for ", "``for "),
    ("``await ", "``"),
    ("the event loop", "the thread that finds it"),
    ("a task of the loop", "a daemon thread"),
    ("an ``async def``", "a function"),
    ("ledger/aio.py (the source)", "ledger/aio.py (its source)"),
]

HEADER = (
    "# Generated from {source} by tools/async_to_sync.py ('make sync'): do not edit.\n"
    "# Edit {source} and run 'make sync'; CI fails when this file is stale.\n"
)

UNWRAPPED = {"Awaitable": "[", "ashield": "("}
"""``Awaitable[X]`` is ``X`` and ``ashield(end)`` is ``end`` in the sync code."""

DROPPED = ("ASYNC", "Awaitable", "ashield")
"""Names the sync code does not import."""

_IF = re.compile(r"^(?P<indent>[ \t]*)if (?P<not>not )?ASYNC:[ \t]*(#.*)?$")
_ELSE = re.compile(r"^(?P<indent>[ \t]*)else:[ \t]*(#.*)?$")
_WORD_NAMES = sorted(NAMES, key=len, reverse=True)
_TEXT = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in _WORD_NAMES) + r")(?!\w)")


class GenerateError(Exception):
    pass


# -- step 1: the blocks that only one flavour has -----------------------------------------

def _block(lines: list[str], start: int, indent: str) -> int:
    """The index after the block that starts at ``start`` (lines indented deeper than ``indent``)."""
    end = start
    while end < len(lines):
        line = lines[end]
        if line.strip() and not (line.startswith(indent) and len(line) - len(line.lstrip()) > len(indent)):
            break
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1  # trailing blank lines belong to what follows
    return end


def _dedent(lines: list[str], by: int) -> list[str]:
    return [line[by:] if line.strip() else line for line in lines]


def resolve_flavour_blocks(text: str) -> str:
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _IF.match(lines[i].rstrip("\n"))
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match["indent"]
        body_end = _block(lines, i + 1, indent)
        body = lines[i + 1:body_end]
        other: list[str] = []
        after = body_end
        at = body_end
        while at < len(lines) and not lines[at].strip():
            at += 1  # blank lines between the body and its else:
        else_match = _ELSE.match(lines[at].rstrip("\n")) if at < len(lines) else None
        if else_match and else_match["indent"] == indent:
            after = _block(lines, at + 1, indent)
            other = lines[at + 1:after]
        keep = body if match["not"] else other
        if keep:
            by = len(keep[0]) - len(keep[0].lstrip()) - len(indent)
            out.extend(_dedent(keep, by))
        i = after
    return "".join(out)


# -- step 2: tokens ------------------------------------------------------------------

def _text(value: str) -> str:
    for old, new in PHRASES:
        value = value.replace(old, new)
    return _TEXT.sub(lambda match: NAMES[match.group(1)], value)


def transform(text: str) -> str:
    """The sync code for the async ``text`` (after :func:`resolve_flavour_blocks`)."""
    lines = text.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    edits: dict[int, list[tuple[int, int, str]]] = {}  # row -> (col, end col, replacement)

    def edit(row: int, col: int, end: int, new: str) -> None:
        edits.setdefault(row, []).append((col, end, new))

    skip_close: list[int] = []  # bracket depths whose `]` closes an `Awaitable[`
    depth = 0
    dropped_parens = _await_parens(tokens)
    in_import = False  # inside an import statement (the only place DROPPED names may stand)
    for index, tok in enumerate(tokens):
        (row, col), (end_row, end_col) = tok.start, tok.end
        nxt = tokens[index + 1] if index + 1 < len(tokens) else None
        if tok.type == tokenize.NEWLINE:
            in_import = False
        elif tok.type == tokenize.NAME and tok.string in ("from", "import") and (
                index == 0 or tokens[index - 1].type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                         tokenize.DEDENT, tokenize.COMMENT)):
            in_import = True
        if index in dropped_parens:
            edit(row, col, end_col, "")
        if tok.type == tokenize.NAME and tok.string in ("async", "await"):
            if tok.string == "async" and (nxt is None or nxt.string not in ("def", "with", "for")):
                raise GenerateError(f"line {row}: 'async' before {nxt.string if nxt else 'nothing'}")
            # The keyword and the blank after it.
            stop = nxt.start[1] if nxt is not None and nxt.start[0] == row else end_col
            edit(row, col, stop, "")
        elif tok.type == tokenize.NAME and tok.string in UNWRAPPED and nxt is not None \
                and nxt.string == UNWRAPPED[tok.string]:
            edit(row, col, nxt.end[1], "")
            skip_close.append(depth)
        elif tok.type == tokenize.NAME and tok.string in DROPPED:
            # Imported only: ASYNC (the sync code has no flavour flag), Awaitable and ashield (see above).
            if not in_import:
                raise GenerateError(f"line {row}: {tok.string} used outside an import (ASYNC: only in 'if ASYNC:')")
            after = tokens[index + 2] if nxt.string == "," and index + 2 < len(tokens) else None
            stop = after.start[1] if after is not None and after.start[0] == row else nxt.end[1]
            edit(row, col, stop if nxt.string == "," else end_col, "")
        elif tok.type == tokenize.NAME and tok.string == "aio" and index >= 2 and tokens[index - 1].string == "." \
                and tokens[index - 2].string == "ledger":
            edit(row, col, end_col, "client")  # `from ledger.aio import` in the tests
        elif tok.type == tokenize.NAME and tok.string in NAMES:
            edit(row, col, end_col, NAMES[tok.string])
        elif tok.type == tokenize.OP and tok.string in "([{":
            if index > 0 and tokens[index - 1].string in UNWRAPPED and UNWRAPPED[tokens[index - 1].string] == tok.string:
                continue  # removed with its name; its depth is in skip_close
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            if skip_close and skip_close[-1] == depth:
                skip_close.pop()
                edit(row, col, end_col, "")
            else:
                depth -= 1
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = _text(tok.string)
            if new != tok.string:
                if row == end_row:
                    edit(row, col, end_col, new)
                else:  # a multi-line string: replace it whole, on its first row
                    edit(row, col, len(lines[row - 1]), new.split("\n", 1)[0] + "\n")
                    rest = new.split("\n")[1:]
                    for offset, part in enumerate(rest, start=1):
                        line = lines[row - 1 + offset]
                        last = row + offset == end_row
                        edit(row + offset, 0, end_col if last else len(line), part if last else part + "\n")
    return _apply(lines, tokens, edits)


def _await_parens(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """Indexes of the parentheses around a lone ``await`` primary: ``(await f(x))[0]`` becomes ``f(x)[0]``.

    Only where nothing but the awaited primary is inside (names, dots, calls,
    subscripts), so that removing them cannot change what binds to what.
    """
    found: set[int] = set()
    for index, tok in enumerate(tokens[:-1]):
        if tok.string != "(" or tokens[index + 1].string != "await":
            continue
        before = tokens[index - 1] if index else None
        if before is not None and (before.type in (tokenize.NAME, tokenize.STRING) and not keyword.iskeyword(
                before.string) or before.string in (")", "]")):
            continue  # a call's parentheses
        depth, close = 0, None
        for inner in range(index + 2, len(tokens)):
            string = tokens[inner].string
            if string in "([{" and tokens[inner].type == tokenize.OP:
                depth += 1
            elif string in ")]}" and tokens[inner].type == tokenize.OP:
                if depth == 0:
                    close = inner if string == ")" else None
                    break
                depth -= 1
            elif depth == 0 and tokens[inner].type == tokenize.OP:
                if string != ".":
                    break  # an operator beside the await: keep the parentheses
            elif depth == 0 and tokens[inner].type not in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING):
                break
        if close is not None:
            found.update((index, close))
    return found


def _shift(edits: list[tuple[int, int, str]], col: int) -> int:
    """How much the edits of one row move column ``col``."""
    return sum(len(new) - (end - start) for start, end, new in edits if end <= col)


def _apply(lines: list[str], tokens: list[tokenize.TokenInfo], edits: dict[int, list[tuple[int, int, str]]]) -> str:
    # Continuation lines aligned one past an open bracket follow that bracket.
    moved: dict[int, int] = {}  # row -> how far its indentation moves
    open_brackets: list[tuple[int, int]] = []  # (row, col) of unclosed brackets of the logical line
    seen_rows: set[int] = set()
    for tok in tokens:
        row, col = tok.start
        if row not in seen_rows:
            seen_rows.add(row)
            if open_brackets and tok.type not in (tokenize.NL, tokenize.NEWLINE):
                line = lines[row - 1]
                indent = len(line) - len(line.lstrip(" "))
                for bracket_row, bracket_col in reversed(open_brackets):
                    if indent == bracket_col + 1:
                        new_col = bracket_col + _shift(edits.get(bracket_row, []), bracket_col)
                        moved[row] = new_col + moved.get(bracket_row, 0) - bracket_col
                        break
        if tok.type == tokenize.OP and tok.string in "([{":
            open_brackets.append((row, col))
        elif tok.type == tokenize.OP and tok.string in ")]}" and open_brackets:
            open_brackets.pop()
        elif tok.type == tokenize.NEWLINE:
            open_brackets.clear()
    out: list[str] = []
    for number, line in enumerate(lines, start=1):
        for start, end, new in sorted(edits.get(number, []), reverse=True):
            line = line[:start] + new + line[end:]
        shift = moved.get(number, 0)
        if shift < 0:
            line = line[-shift:] if line[:-shift].strip() == "" else line
        elif shift > 0:
            line = " " * shift + line
        out.append(line)
    return "".join(out)


_FROM_IMPORT = re.compile(r"^from (?P<module>[\w.]+) import (?P<names>\([^)]*\)|[^\n(]+)$", re.MULTILINE)
_WIDTH = 110


def sort_imports(text: str) -> str:
    """The names of each ``from M import ...`` in order again (renaming moved some), on one line if it fits."""
    def tidy(match: re.Match[str]) -> str:
        names = sorted(name.strip() for name in match["names"].strip("()").split(",") if name.strip())
        line = f"from {match['module']} import {', '.join(names)}"
        return line if len(line) <= _WIDTH else _wrapped(f"from {match['module']} import (", names)
    return _FROM_IMPORT.sub(tidy, text)


def _wrapped(lead: str, names: list[str]) -> str:
    lines, current = [], lead
    for index, name in enumerate(names):
        piece = name + ("," if index < len(names) - 1 else ")")
        if len(current) + len(piece) > _WIDTH and current != lead:
            lines.append(current.rstrip())
            current = " " * len(lead)
        current += piece + " "
    lines.append(current.rstrip())
    return "\n".join(lines)


def generate(source: str) -> str:
    text = (ROOT / source).read_text()
    sync = sort_imports(transform(resolve_flavour_blocks(text)))
    for word in ("await ", "async def", "async with", "async for", "asyncio"):
        if re.search(rf"(?<![\w`]){re.escape(word)}", _code_only(sync)):
            raise GenerateError(f"{source}: the sync code still says {word.strip()!r}")
    compile(sync, source, "exec")  # it must be Python
    return HEADER.format(source=source) + sync


def _code_only(text: str) -> str:
    """``text`` without its comments and strings (what the checks above look at)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string + " ")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a generated file is stale")
    args = parser.parse_args(argv)
    stale = []
    for source, target in FILES.items():
        wanted = generate(source)
        path = ROOT / target
        current = path.read_text() if path.exists() else ""
        if current == wanted:
            continue
        if args.check:
            stale.append(target)
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                f"{target} (in the tree)", f"{target} (from {source})", n=2))
        else:
            path.write_text(wanted)
            print(f"wrote {target} from {source}")
    if stale:
        print(f"stale: {', '.join(stale)}: run 'make sync' and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
