"""Small text helpers shared by the command line, the wrapper and the tables.

It imports nothing of the ledger, so any module may import it.
"""

from __future__ import annotations

import re


def first_line(what: BaseException | str | None, limit: int | None = None) -> str:
    """The first line of a text, or of an error's message (its class name when the message is empty).

    ``""`` for None or blank text. With ``limit``, a longer line is cut to
    ``limit`` characters, its last one an ellipsis.
    """
    if isinstance(what, BaseException):
        line = first_line(str(what)) or type(what).__name__
    else:
        lines = (what or "").strip().splitlines()
        line = lines[0] if lines else ""
    if limit is not None and len(line) > limit:
        return line[: limit - 1] + "…"
    return line


#: The control characters: C0 (U+0000-U+001F), DEL (U+007F) and C1 (U+0080-U+009F), Unicode's Cc.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or f"\\x{ord(char):02x}"


def visible(text: str, limit: int | None = None) -> str:
    """``text`` to show on a terminal: every control character written as an escape, never sent.

    Newline, tab and carriage return become ``\\n``, ``\\t``, ``\\r``, every other
    C0, DEL and C1 character ``\\xNN`` (ESC is ``\\x1b``, C1's CSI ``\\x9b``): text
    from the ledger (a run's error, a command's stderr) cannot move the cursor,
    retitle the terminal, make a hyperlink, or start a new line that looks like
    a row of its own. A backslash stays as it is. With ``limit``, a longer
    result is cut to ``limit`` characters, its last one an ellipsis.
    """
    if _CONTROL.search(text) is not None:
        text = _CONTROL.sub(_escaped, text)
    if limit is not None and len(text) > limit:
        return text[: limit - 1] + "…"
    return text
