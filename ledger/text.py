"""Small text helpers shared by the command line, the wrapper and the tables.

It imports nothing of the ledger, so any module may import it.
"""

from __future__ import annotations


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
