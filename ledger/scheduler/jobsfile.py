"""The jobs file (TOML) of ``jobledger scheduler``: parsed and checked without a database.

One ``[jobs.NAME]`` table per job, whose keys are ``register_job``'s arguments
(what :func:`ledger.scheduler.sync.sync_file` hands to ``ledger.sync_jobs``)
plus what the process itself needs to run the job's command
(``command``, ``env``, ``cwd``, ``timeout``, ``retries``, ``backoff``, as
``jobledger run`` names them). Top-level keys: ``source`` (the name under which
the file's jobs are synced; default ``file:<the file's name>``, so the same
file on several hosts is one source), ``removed`` (``pause`` or ``unregister``:
what becomes of a job the file no longer has), the ``[upkeep]`` table, and the
``[pools]`` table (``name = size``: the pools the scheduler registers, with
``ledger.register_pool``, before it syncs the jobs, so that a job's ``pool``
key may name one of them).

A file with any mistake is refused whole: :class:`JobsFileError` lists every
problem, each naming the job and the key. The SQL checks the values again at
sync time (the database is the authority); what is checked here is what can be
checked offline: keys, types, the schedule's syntax, the time zone (zoneinfo),
durations and bounds.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ledger.durations import parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["JobDefinition", "definition", "JobsFile", "JobsFileError", "Problem", "Upkeep", "check_schedule",
           "load", "parse"]

#: register_job's arguments that take a duration (interval).
DURATION_KEYS = ("ttl", "late_after", "down_after", "min_runtime", "max_runtime", "jitter", "start_deadline")
#: register_job's arguments that take an integer.
INTEGER_KEYS = ("max_backfill", "pause_after_failures", "max_concurrent")
#: register_job's arguments that take text.
TEXT_KEYS = ("schedule", "time_zone", "overlap_policy", "pool")
REGISTER_KEYS = TEXT_KEYS + DURATION_KEYS + INTEGER_KEYS
#: What the process needs to run the command; never sent to the ledger.
PROCESS_KEYS = ("command", "env", "cwd", "timeout", "retries", "backoff")
OVERLAP_POLICIES = ("catch_up", "skip", "buffer_one", "replace")
REMOVED = ("pause", "unregister")
TOP_KEYS = ("source", "removed", "upkeep", "pools", "jobs")
#: A pool's size: 1 to this (ledger._max_pool_size(); the SQL checks it again).
MAX_POOL_SIZE = 100_000
UPKEEP_DEFAULTS: dict[str, timedelta | None] = {
    "reap_every": timedelta(seconds=30),
    "sync_alerts_every": timedelta(seconds=30),
    "purge_every": timedelta(hours=1),
    "purge_log_older_than": None,  # no log purge unless the file asks for one
    "purge_events_every": timedelta(hours=1),
}
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$")


@dataclass(frozen=True)
class Problem:
    """One mistake of the file: where (``job``, ``key``; None at the top level) and what."""

    job: str | None
    key: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.job is not None:
            where.append(f"job {self.job}")
        if self.key is not None:
            where.append(f"key {self.key}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


class JobsFileError(ValueError):
    """The file is refused whole; ``problems`` names each mistake (job and key)."""

    def __init__(self, path: str, problems: Sequence[Problem]) -> None:
        self.path = path
        self.problems = list(problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        super().__init__(f"jobs file {path} refused ({len(self.problems)} problem"
                         f"{'' if len(self.problems) == 1 else 's'}), nothing changed:\n{lines}")


@dataclass(frozen=True)
class JobDefinition:
    """One job of the file: its register_job arguments and how to run it."""

    name: str
    register: Mapping[str, Any]  # register_job argument -> value (durations as timedelta)
    command: tuple[str, ...] | str | None = None  # argv, or a shell string
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout: timedelta | None = None
    retries: int = 0
    backoff: timedelta = timedelta(seconds=30)

    @property
    def argv(self) -> tuple[str, ...]:
        """The command as an argv: a shell string runs under ``/bin/sh -c``, as cron runs it."""
        if isinstance(self.command, str):
            return ("/bin/sh", "-c", self.command)
        return self.command or ()

    @property
    def ttl(self) -> timedelta | None:
        value = self.register.get("ttl")
        return value if isinstance(value, timedelta) else None

    def sql_arguments(self) -> dict[str, Any]:
        """The register_job arguments as JSON values (a duration as interval text in seconds)."""
        result: dict[str, Any] = {}
        for key, value in self.register.items():
            result[key] = f"{value.total_seconds():g} seconds" if isinstance(value, timedelta) else value
        return result


@dataclass(frozen=True)
class Upkeep:
    """The ``[upkeep]`` table: the cadence of what the elected scheduler runs."""

    reap_every: timedelta | None = UPKEEP_DEFAULTS["reap_every"]
    sync_alerts_every: timedelta | None = UPKEEP_DEFAULTS["sync_alerts_every"]
    purge_every: timedelta | None = UPKEEP_DEFAULTS["purge_every"]
    purge_log_older_than: timedelta | None = None
    purge_events_every: timedelta | None = UPKEEP_DEFAULTS["purge_events_every"]


@dataclass(frozen=True)
class JobsFile:
    """A valid jobs file."""

    path: str
    source: str
    removed: str
    jobs: Mapping[str, JobDefinition]
    upkeep: Upkeep
    digest: str  # of the file's bytes: the scheduler resyncs when it changes
    pools: Mapping[str, int] = field(default_factory=dict)  # [pools]: name -> size, registered before the jobs

    def definitions(self) -> dict[str, dict[str, Any]]:
        """``ledger.sync_jobs``'s first argument: {job: {register_job argument: value}}."""
        return {name: job.sql_arguments() for name, job in self.jobs.items()}


def load(path: str | Path, *, require_command: bool = True) -> JobsFile:
    """Read and check the file at ``path``; JobsFileError (every problem) when it is not valid."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise JobsFileError(name, [Problem(None, None, f"cannot read the file: {error.strerror}")]) from error
    return parse(data, name, require_command=require_command)


def parse(data: bytes | str, path: str = "<jobs file>", *, require_command: bool = True) -> JobsFile:
    """Check the TOML text ``data``; JobsFileError (every problem) when it is not valid.

    A duplicate ``[jobs.NAME]`` table is TOML's own error (the parser refuses it,
    naming the line), reported as a problem of that job.
    """
    raw = data.encode() if isinstance(data, str) else data
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise JobsFileError(path, [Problem(None, None, f"not UTF-8 text ({error.reason})")]) from error
    except tomllib.TOMLDecodeError as error:
        raise JobsFileError(path, [_toml_problem(str(error))]) from error
    problems: list[Problem] = []
    for key in document:
        if key not in TOP_KEYS:
            problems.append(Problem(None, key, f"unknown key (the top level takes {', '.join(TOP_KEYS)}; "
                                              f"a job is a [jobs.NAME] table)"))
    source = document.get("source", f"file:{Path(path).name}")
    if not isinstance(source, str) or not source.strip():
        problems.append(Problem(None, "source", "must be a non-empty string"))
        source = ""
    removed = document.get("removed", "pause")
    if removed not in REMOVED:
        problems.append(Problem(None, "removed", f"must be one of {', '.join(REMOVED)} (got {removed!r})"))
    upkeep = _upkeep(document.get("upkeep", {}), problems)
    pools = _pools(document.get("pools", {}), problems)
    tables = document.get("jobs", {})
    jobs: dict[str, JobDefinition] = {}
    if not isinstance(tables, dict):
        problems.append(Problem(None, "jobs", "must be a table of [jobs.NAME] tables"))
        tables = {}
    for name, table in tables.items():
        job = _job(name, table, problems, require_command=require_command)
        if job is not None:
            jobs[name] = job
    if problems:
        raise JobsFileError(path, problems)
    return JobsFile(path=path, source=source, removed=str(removed), jobs=jobs, upkeep=upkeep,
                    digest=hashlib.sha256(raw).hexdigest(), pools=pools)


def _toml_problem(message: str) -> Problem:
    duplicate = re.search(r"[Cc]annot (?:declare|overwrite) .*?\('jobs', '([^']+)'\)", message)
    if duplicate:
        return Problem(duplicate.group(1), None, f"the job is defined twice ({message})")
    return Problem(None, None, f"not valid TOML: {message}")


def _upkeep(table: Any, problems: list[Problem]) -> Upkeep:
    if not isinstance(table, dict):
        problems.append(Problem(None, "upkeep", "must be a table"))
        return Upkeep()
    values: dict[str, timedelta | None] = {}
    for key, value in table.items():
        if key not in UPKEEP_DEFAULTS:
            problems.append(Problem(None, f"upkeep.{key}",
                                    f"unknown key (upkeep takes {', '.join(UPKEEP_DEFAULTS)})"))
            continue
        if value in ("never", "off", False):  # a cadence switched off
            values[key] = None
            continue
        duration = _duration(value, None, f"upkeep.{key}", problems)
        if duration is not None:
            values[key] = duration
    return Upkeep(**values)


def _pools(table: Any, problems: list[Problem]) -> dict[str, int]:
    """The ``[pools]`` table: ``name = size``, each size an integer from 1 to :data:`MAX_POOL_SIZE`."""
    if not isinstance(table, dict):
        problems.append(Problem(None, "pools", "must be a table of name = size ([pools] heavy = 3)"))
        return {}
    pools: dict[str, int] = {}
    for name, size in table.items():
        key = f"pools.{name}"
        if not _JOB_NAME.match(name):
            problems.append(Problem(None, key, "invalid pool name (letters, digits and _ . : @ / -, at most 200, "
                                               "starting with a letter or digit)"))
        elif isinstance(size, bool) or not isinstance(size, int):
            problems.append(Problem(None, key, f"the size must be an integer (got {size!r})"))
        elif not 1 <= size <= MAX_POOL_SIZE:
            problems.append(Problem(None, key, f"the size must be from 1 to {MAX_POOL_SIZE:,} (got {size})"))
        else:
            pools[name] = size
    return pools


def definition(name: str, table: Mapping[str, Any], *, require_command: bool = True) -> JobDefinition:
    """One job from its keys (a ``[jobs.NAME]`` table as a dict: ``ledger.job``'s options); JobsFileError."""
    problems: list[Problem] = []
    job = _job(name, dict(table), problems, require_command=require_command)
    if job is None or problems:
        raise JobsFileError(f"job {name}", problems)
    return job


def _job(name: str, table: Any, problems: list[Problem], *, require_command: bool) -> JobDefinition | None:
    if not _JOB_NAME.match(name):
        problems.append(Problem(name, None, "invalid job name (letters, digits and _ . : @ / -, at most 200, "
                                            "starting with a letter or digit)"))
    if not isinstance(table, dict):
        problems.append(Problem(name, None, "must be a table ([jobs.NAME])"))
        return None
    before = len(problems)
    register: dict[str, Any] = {}
    for key, value in table.items():
        if key not in REGISTER_KEYS and key not in PROCESS_KEYS:
            problems.append(Problem(name, key, "unknown key (a job takes " + ", ".join(REGISTER_KEYS + PROCESS_KEYS)
                                    + ")"))
        elif key in DURATION_KEYS:
            duration = _duration(value, name, key, problems, zero=key not in ("ttl",))
            if duration is not None:
                register[key] = duration
        elif key in INTEGER_KEYS:
            if _integer(value, name, key, problems, low=1 if key in ("max_backfill", "max_concurrent") else 0):
                register[key] = value
        elif key in TEXT_KEYS:
            if not isinstance(value, str):
                problems.append(Problem(name, key, f"must be a string (got {type(value).__name__})"))
            else:
                register[key] = value
    if isinstance(register.get("time_zone"), str):
        _check_zone(name, register["time_zone"], problems)
    if isinstance(register.get("schedule"), str):
        error = check_schedule(register["schedule"])
        if error:
            problems.append(Problem(name, "schedule", error))
    elif "schedule" not in table:
        problems.append(Problem(name, "schedule", "missing: a scheduler runs jobs with a schedule"))
    policy = register.get("overlap_policy")
    if isinstance(policy, str) and policy not in OVERLAP_POLICIES:
        problems.append(Problem(name, "overlap_policy", f"must be one of {', '.join(OVERLAP_POLICIES)} "
                                                        f"(got {policy!r})"))
    if isinstance(register.get("max_concurrent"), int) and register["max_concurrent"] > 1 \
            and policy in ("replace", "buffer_one"):
        problems.append(Problem(name, "overlap_policy", f"{policy} needs max_concurrent 1 "
                                                        f"(got {register['max_concurrent']})"))
    command = _command(name, table.get("command"), problems, required=require_command)
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        problems.append(Problem(name, "env", "must be a table of strings (NAME = \"value\")"))
        env = {}
    cwd = table.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        problems.append(Problem(name, "cwd", "must be a string (a directory)"))
        cwd = None
    timeout = _duration(table["timeout"], name, "timeout", problems) if "timeout" in table else None
    retries = table.get("retries", 0)
    if not _integer(retries, name, "retries", problems, low=0):
        retries = 0
    backoff = (_duration(table["backoff"], name, "backoff", problems) if "backoff" in table else None)
    if len(problems) > before:
        return None
    return JobDefinition(name=name, register=register, command=command, env=env, cwd=cwd, timeout=timeout,
                         retries=retries, backoff=backoff or timedelta(seconds=30))


def _command(name: str, value: Any, problems: list[Problem], *, required: bool) -> tuple[str, ...] | str | None:
    if value is None:
        if required:
            problems.append(Problem(name, "command", "missing: an argv list ([\"./job.sh\", \"--full\"]) or a "
                                                     "shell string"))
        return None
    if isinstance(value, str):
        if not value.strip():
            problems.append(Problem(name, "command", "must not be empty"))
        return value
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return tuple(value)
    problems.append(Problem(name, "command", "must be a non-empty list of strings (argv) or a shell string"))
    return None


def _duration(value: Any, job: str | None, key: str, problems: list[Problem], *,
              zero: bool = False) -> timedelta | None:
    """A TOML string ("80m", "2 seconds") or a number of seconds."""
    try:
        if isinstance(value, bool):
            raise ValueError("a duration, not a boolean")
        if isinstance(value, timedelta):  # ledger.job(ttl=timedelta(...))
            duration = value
        elif isinstance(value, (int, float)):
            duration = timedelta(seconds=value)
        elif isinstance(value, str):
            duration = parse_duration(value)
        else:
            raise ValueError(f"a duration (\"80m\", \"2 seconds\") or a number of seconds, not "
                             f"{type(value).__name__}")
    except (ValueError, OverflowError) as error:
        problems.append(Problem(job, key, f"invalid duration: {error}"))
        return None
    if duration < timedelta(0) or (duration == timedelta(0) and not zero):
        problems.append(Problem(job, key, f"must be {'zero or ' if zero else ''}positive (got {value!r})"))
        return None
    return duration


def _integer(value: Any, job: str, key: str, problems: list[Problem], *, low: int) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(Problem(job, key, f"must be an integer (got {value!r})"))
        return False
    if value < low:
        problems.append(Problem(job, key, f"must be at least {low} (got {value})"))
        return False
    return True


def _check_zone(job: str, zone: str, problems: list[Problem]) -> None:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        problems.append(Problem(job, "time_zone", f"unknown time zone {zone!r} (name one such as Europe/Paris)"))


# -- the schedule's syntax, as ledger._parse_schedule reads it ------------------------------------------

_MACROS = {"@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually"}
_FIELDS = (
    ("minute", 0, 59, None),
    ("hour", 0, 23, None),
    ("day-of-month", 1, 31, None),
    ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
    ("day-of-week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)
_INTERVAL_UNITS = re.compile(r"^(?:\s*[0-9.]+\s*(?:[a-z]+)?)+\s*$")
_CALENDAR_UNITS = {"mon", "mons", "month", "months", "y", "yr", "yrs", "year", "years"}


def check_schedule(schedule: str) -> str | None:
    """None when ``schedule`` reads as a five-field cron expression, a macro or an interval; else why not.

    The offline twin of ``ledger._parse_schedule`` for the mistakes one makes
    (a field out of range, a bad name, a wrong field count, an unknown unit);
    the SQL stays the authority when the file is synced.
    """
    text = schedule.strip().lower()
    if not text:
        return "invalid schedule: must not be empty"
    if text.startswith("@"):
        if text in _MACROS:
            return None
        if text == "@reboot":
            return "invalid schedule '@reboot': a scheduler runs slots, not boots"
        return f"invalid schedule {schedule!r}: unknown macro (use {', '.join(sorted(_MACROS))})"
    fields = text.split()
    if len(fields) == 5:
        cron_error = _check_cron(schedule, fields)
        if cron_error is None:
            return None
    else:
        cron_error = None
    interval_error = _check_interval(text)
    if interval_error is None:
        return None
    if cron_error is not None:
        return cron_error
    return (f"invalid schedule {schedule!r}: expected an interval such as '45 minutes' or a five-field cron "
            f"expression (got {len(fields)} fields)")


def _check_interval(text: str) -> str | None:
    if re.fullmatch(r"[0-9. ]+", text) or not _INTERVAL_UNITS.match(text):
        return "not an interval"
    units = re.findall(r"[a-z]+", text)
    if units and all(unit in _CALENDAR_UNITS for unit in units):
        return None  # '1 month': the calendar moves it (the SQL checks the bounds)
    try:
        duration = parse_duration(" ".join(part for part in re.findall(r"[0-9.]+\s*[a-z]*", text)
                                           if re.sub(r"[0-9.\s]", "", part) not in _CALENDAR_UNITS))
    except ValueError as error:
        return str(error)
    if duration <= timedelta(0) and not units:
        return "the interval must be positive"
    return None


def _check_cron(schedule: str, fields: list[str]) -> str | None:
    for text, (label, low, high, names) in zip(fields, _FIELDS):
        for item in text.split(","):
            if not item:
                return f"invalid schedule {schedule!r}: empty list element in the {label} field"
            part, _, step = item.partition("/")
            if "/" in item:
                if not re.fullmatch(r"[0-9]{1,6}", step) or int(step) == 0 or int(step) > high - low + 1:
                    return f"invalid schedule {schedule!r}: invalid step {step!r} in the {label} field"
            if part == "*":
                continue
            bounds = part.split("-")
            if not part or len(bounds) > 2:
                return f"invalid schedule {schedule!r}: invalid {label} element {item!r}"
            numbers = []
            for value in bounds:
                if re.fullmatch(r"[0-9]{1,6}", value):
                    number = int(value)
                elif names is not None and value in names:
                    number = names.index(value) + low
                else:
                    return f"invalid schedule {schedule!r}: invalid {label} value {value!r}"
                if not low <= number <= high:
                    return f"invalid schedule {schedule!r}: {label} value {number} is out of range {low}-{high}"
                numbers.append(number)
            if len(numbers) == 2 and numbers[0] > numbers[1] and not (label == "day-of-week" and numbers[1] == 0):
                return f"invalid schedule {schedule!r}: {label} range {part!r} runs backwards"
    return None
