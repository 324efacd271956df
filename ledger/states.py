"""How every surface draws a job's state: a colour and a symbol per state word, nothing else.

The state itself is the ledger's: ``ledger.job_health.state`` (and
``ledger.job_status.state``), worked out by one view in SQL
(``ledger._job_state``; docs/contract.md has the one table of the states, their
order and what each means). No Python code decides a job's state: the command
line, the dashboard, its badge and the metrics show the word they read. This
module is the one place that maps the word to how it looks, so that the
terminal, the pages and the badge agree.

A state this version does not know (a newer ledger's) still shows, as its
word, in :data:`UNKNOWN`'s look.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATES", "UNKNOWN", "Look", "look"]


@dataclass(frozen=True)
class Look:
    """How a state is drawn: ``colour`` on the pages and the badge, ``terminal`` (a rich style) in the
    command line's tables, ``symbol`` before the word where there is room."""

    colour: str
    terminal: str
    symbol: str


#: The ledger's states in their order of precedence (the first that holds is the job's state).
STATES: dict[str, Look] = {
    "crashed": Look("#c2410c", "bold red", "✖"),
    "overrun": Look("#d1242f", "bold red", "⧗"),
    "paused": Look("#6b7280", "yellow", "‖"),
    "running": Look("#1f6feb", "cyan", "▶"),
    "down": Look("#a40e26", "bold red", "▼"),
    "late": Look("#9a6700", "bold yellow", "◔"),
    "failing": Look("#d1242f", "red", "✗"),
    "never_run": Look("#57606a", "dim", "○"),
    "ok": Look("#1a7f37", "green", "✓"),
}

#: The look of a state word this version does not know, and of the badge of an unknown job.
UNKNOWN = Look("#57606a", "", "?")


def look(state: str | None) -> Look:
    """The look of ``state`` (``UNKNOWN``'s for a word not in :data:`STATES`, or none)."""
    return STATES.get(state or "", UNKNOWN)
