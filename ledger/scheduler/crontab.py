"""``jobledger scheduler import-crontab``: a crontab's lines as a jobs file.

Each job line (five time fields, or a macro such as ``@daily``, then the
command) becomes a ``[jobs.NAME]`` table with the schedule and the command as a
shell string (cron runs it with ``/bin/sh -c`` too), and a ``ttl`` to review.
Comments and blank lines are left out. What has no faithful translation is
refused, with the line and the reason, and nothing is written: an environment
line (``MAILTO=``, ``PATH=``, ``CRON_TZ=``: say it as a job's ``env`` or
``time_zone``), ``@reboot`` (a boot is not a slot), a ``%`` in a command (cron
turns it into a newline and stdin), a system crontab's user field is not
guessed: pass ``--system`` for ``/etc/crontab`` lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ledger.scheduler.jobsfile import check_schedule

__all__ = ["CrontabError", "convert"]

_ENV_LINE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\s*=")
DEFAULT_TTL = "1h"


@dataclass(frozen=True)
class _Line:
    number: int
    text: str
    problem: str


class CrontabError(ValueError):
    """Lines without a faithful translation: nothing is written."""

    def __init__(self, problems: list[_Line]) -> None:
        self.problems = problems
        super().__init__("crontab refused, no jobs file written:\n" + "\n".join(
            f"  line {line.number}: {line.problem}: {line.text}" for line in problems))


def convert(lines: Iterable[str], *, system: bool = False, ttl: str = DEFAULT_TTL) -> str:
    """The jobs file (TOML text) for a crontab's ``lines``; CrontabError naming each refused line."""
    jobs: list[tuple[str, str, str, str]] = []  # name, schedule, command, the line
    problems: list[_Line] = []
    names: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.rstrip("\n")
        line = text.strip()
        if not line or line.startswith("#"):
            continue
        if _ENV_LINE.match(line):
            problems.append(_Line(number, text, "an environment line has no place in a jobs file (give the "
                                                "variable in each job's env table, a zone as its time_zone)"))
            continue
        if line.startswith("@"):
            macro, _, rest = line.partition(" ")
            if macro.lower() == "@reboot":
                problems.append(_Line(number, text, "@reboot is not a schedule (a boot is not a slot): run it "
                                                    "from the system's boot instead"))
                continue
            schedule, command = macro, rest.strip()
        else:
            fields = line.split(None, 5)
            if len(fields) < 6:
                problems.append(_Line(number, text, "expected five time fields and a command"))
                continue
            schedule, command = " ".join(fields[:5]), fields[5]
        if system:
            user, _, command = command.partition(" ")
            command = command.strip()
            if not user or not command:
                problems.append(_Line(number, text, "expected a user field and a command (--system)"))
                continue
        error = check_schedule(schedule)
        if error is not None:
            problems.append(_Line(number, text, error))
            continue
        if not command:
            problems.append(_Line(number, text, "no command"))
            continue
        if re.search(r"(?<!\\)%", command):
            problems.append(_Line(number, text, "a % in the command is cron's newline and stdin: write the "
                                                "command as a script"))
            continue
        name = _name(command, names)
        jobs.append((name, schedule, command.replace("\\%", "%"), text))
    if problems:
        raise CrontabError(problems)
    out = ["# Converted by `jobledger scheduler import-crontab`: review each ttl (the longest a run may go",
           "# without a heartbeat) and the names; `jobledger scheduler check FILE` checks the result.",
           'removed = "pause"', ""]
    for name, schedule, command, text in jobs:
        out += [f"# {text}", f"[jobs.{name}]", f"schedule = {json.dumps(schedule)}", f"ttl = {json.dumps(ttl)}",
                f"command = {json.dumps(command)}", ""]
    return "\n".join(out)


def _name(command: str, taken: dict[str, int]) -> str:
    """A job name from the command's program (``/usr/bin/backup.sh --x`` -> ``backup``), unique in the file."""
    program = command.split()[0].rsplit("/", 1)[-1]
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", program.rsplit(".", 1)[0] if "." in program[1:] else program).strip("-")
    base = (base or "job").lower()[:60]
    if not base[0].isalnum():
        base = "job-" + base
    count = taken.get(base, 0) + 1
    taken[base] = count
    return base if count == 1 else f"{base}-{count}"
