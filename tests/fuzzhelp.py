"""Machinery for tests/sql/test_fuzz.py: the public functions as the catalog
declares them, hostile values for their arguments, session settings, a
snapshot of every ledger table, and the property every call must keep.

The property (``check_call``), for one call under one set of session
settings:

1. the call succeeds, or raises one of the documented SQLSTATEs
   (docs/contract.md: 22004, 22023, LD001-LD006);
2. a call that raised changed no ledger table (every table in schema
   `ledger`, read from the catalog, compared before and after from a second
   connection with fixed settings);
3. a call whose arguments break the contract's Bounds (a NULL for a required
   argument, an invalid label, a non-positive token, a ttl out of range, ...)
   does not succeed;
4. a 22004 or a label's 22023 blames an argument that really is NULL or
   invalid.

Values are bound as parameters with explicit casts (`%s::interval`). A value
that does not parse as its type under the session's settings is not the
ledger's business: it is cast first, in a statement of its own, and skipped
when PostgreSQL rejects it.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from hypothesis import strategies as st

# docs/contract.md: "A NULL for a required argument raises SQLSTATE 22004; an
# invalid value raises 22023", and the LD error table. No 40001: the fuzz
# runs on one connection, and without a concurrent transaction neither
# REPEATABLE READ nor SERIALIZABLE can fail to serialize.
ALLOWED_SQLSTATES = frozenset({"22004", "22023", "LD001", "LD002", "LD003", "LD004", "LD005", "LD006", "LD008"})
# A procedure that commits (ledger.run_guarded) adds, per the contract, 25001
# (called inside a transaction block) and PostgreSQL's 2D000 (its COMMIT
# where COMMIT is impossible); and it re-raises its command's error, whatever
# the SQLSTATE, once the failed run records it (see check_call).
PROCEDURE_SQLSTATES = frozenset({"25001", "2D000"})
# protect and unprotect name a table (docs/contract.md, Protected tables):
# one that does not exist (42P01), that the caller does not own (42501),
# that is protected already (42710), whose lock is not had in time (55P03).
TABLE_SQLSTATES = {"protect": frozenset({"42P01", "42501", "42710", "55P03"}),
                   "unprotect": frozenset({"42P01", "42501", "55P03"}),
                   # a pool that jobs still belong to (docs/contract.md, Pools)
                   "drop_pool": frozenset({"2BP01"})}

# ------------------------------------------------------------------ the catalog

TYPE_NAMES = {
    "text": "text",
    "bigint": "bigint",
    "integer": "integer",
    "interval": "interval",
    "timestamp with time zone": "timestamptz",
    "jsonb": "jsonb",
    "boolean": "boolean",
    "regclass": "regclass",
    "text[]": "text[]",
}
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class Arg:
    name: str
    type: str  # one of TYPE_NAMES' values
    has_default: bool
    default: str | None  # the default as SQL text, casts stripped


@dataclass(frozen=True)
class Signature:
    schema: str
    name: str
    args: tuple[Arg, ...]
    procedure: bool = False  # CALL, not SELECT

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def __str__(self) -> str:
        return f"{self.qualified}({', '.join(f'{a.name} {a.type}' for a in self.args)})"


def _strip_cast(default: str) -> str:
    return re.sub(r"::[a-z][a-z ]*(\[\])?$", "", default.strip())


def signatures(conn: psycopg.Connection, schema: str) -> dict[str, Signature]:
    """Every function of `schema` whose name does not start with '_'."""
    rows = conn.execute(
        """
        SELECT p.proname, p.prokind = 'p',
               -- IN and INOUT only (a procedure returns its INOUT arguments): each is passed;
               -- RETURNS TABLE's columns (mode t) are results, not arguments
               coalesce(p.proargmodes <@ '{i,b,t}'::"char"[], true),
               coalesce(array(SELECT n.name FROM unnest(p.proargnames) WITH ORDINALITY n(name, i)
                               WHERE p.proargmodes IS NULL OR p.proargmodes[n.i] IN ('i', 'b') ORDER BY n.i), '{}'),
               array(SELECT format_type(u.t, NULL)
                       FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY u(t, i) ORDER BY u.i),
               p.pronargdefaults, pg_get_function_arguments(p.oid)
          FROM pg_proc p
         WHERE p.pronamespace = %s::regnamespace AND left(p.proname, 1) <> '_'
         ORDER BY p.proname
        """,
        [schema],
    ).fetchall()
    found: dict[str, Signature] = {}
    for name, procedure, in_only, names, types, ndefaults, arguments in rows:
        assert in_only, f"{schema}.{name} has OUT arguments: teach fuzzhelp.signatures about them"
        assert name not in found, f"{schema}.{name} is overloaded (the contract allows one signature)"
        assert len(names) == len(types), f"{schema}.{name} has unnamed arguments"
        defaults: list[str | None] = [None] * len(types)
        for i, text in enumerate(arguments.split(", ") if arguments else []):
            if " DEFAULT " in text:
                defaults[i] = _strip_cast(text.split(" DEFAULT ", 1)[1])
        args = []
        for i, (arg, typ) in enumerate(zip(names, types)):
            assert IDENTIFIER.match(arg), f"{schema}.{name}: odd argument name {arg!r}"
            assert typ in TYPE_NAMES, f"{schema}.{name}({arg}): no fuzz support for type {typ}"
            args.append(Arg(arg, TYPE_NAMES[typ], i >= len(types) - ndefaults, defaults[i]))
        found[name] = Signature(schema, name, tuple(args), procedure)
    return found


# ------------------------------------------------------------------ hostile values

# Characters a label must not hold (contract, Bounds): control (Cc), format
# (Cf), line and paragraph separators, and every space separator but ' '.
# Python 3.11 knows Unicode 14; U+13439-U+1343F became Cf in Unicode 15,
# which the ledger follows.
FORBIDDEN_CATEGORIES: Any = ("Cc", "Cf", "Zl", "Zp", "Zs")


def forbidden_char(ch: str) -> bool:
    cp = ord(ch)
    if 0x13439 <= cp <= 0x1343F:
        return True
    category = unicodedata.category(ch)
    return category in FORBIDDEN_CATEGORIES and ch != " "


def label_problem(value: str | None) -> str | None:
    """Why the contract refuses this non-NULL label, or None when it accepts it."""
    if value is None:
        return None
    if value == "":
        return "is empty"
    if len(value) > 200:
        return f"has {len(value)} characters (more than 200)"
    bad = sorted({f"U+{ord(ch):04X}" for ch in value if forbidden_char(ch)})
    if bad:
        return f"holds {', '.join(bad[:5])}"
    return None


# NUL is impossible in text (tests/sql/test_fuzz.py proves it), so it is not here.
HOSTILE_CHARS = [
    "\u200f", "\u202e", "\u202a", "\u2066", "\u2069", "\u061c",  # bidirectional marks, overrides, isolates
    "\ufeff", "\u200b", "\u200c", "\u200d", "\u2060", "\u00ad", "\u180e",  # BOM, zero-width, soft hyphen
    "\u2028", "\u2029",  # line and paragraph separators
    "\u00a0", "\u1680", "\u2000", "\u2007", "\u202f", "\u205f", "\u3000",  # non-ASCII spaces
    "\x01", "\t", "\n", "\x0b", "\x0c", "\r", "\x1b", "\x1f", "\x7f", "\x85", "\x9f",  # C0, DEL, C1
    "\U000e0001", "\U000e007f", "\U00013439", "\U000110bd", "\U0001d173", "\ufff9", "\u0600",
]
# Odd but visible: letters of other scripts, combining marks, emoji, private
# use, noncharacters. The contract accepts all of them.
ODD_VISIBLE = [
    "é", "e\u0301", "ß", "İ", "ﬁ", "𝔘", "\u05d0\u05d1", "\u0627\u0644", "😀", "👩🏽", "\ue000",
    "\ufffd", "\uffff", "\U0010ffff", "\u0e01\u0e34", "ᄀ", "\U0001f1fa\U0001f1f8",
]
SQLISH = [
    "'; DROP SCHEMA ledger CASCADE; --", "%s", "%I %L %%", "\\", "'", '"', "\\x00", "NULL",
    "null", "$1", "$$", "E'\\n'", "x' OR '1'='1", "}{", "[]",
]

_visible_char = st.characters(codec="utf-8", exclude_categories=FORBIDDEN_CATEGORIES + ("Cs",))
_forbidden = st.characters(codec="utf-8", categories=FORBIDDEN_CATEGORIES, exclude_characters="\x00 ")
_visible_text = st.text(_visible_char, min_size=1, max_size=12)


def _insert(base: str, ch: str, where: int) -> str:
    where = where % (len(base) + 1)
    return base[:where] + ch + base[where:]


def _sampled(values: Sequence[Any], fallback: Any = None) -> st.SearchStrategy[Any]:
    """One of `values` (of `fallback` when there are none), drawn as an index
    modulo their number: the draw keeps its shape when a sequence example
    replays against a ledger whose lists grew or shrank a little (a slot
    crossed by the clock), so hypothesis can still shrink it."""
    choices = list(values) or [fallback]
    return st.integers(0, 63).map(lambda i: choices[i % len(choices)])


def labels(live: Sequence[str] = ()) -> st.SearchStrategy[str | None]:
    names = list(live) or ["nightly"]
    return st.one_of(
        st.none(),
        _sampled(names, "nightly"),
        st.sampled_from(["", " ", "  x  ", "NIGHTLY", "nightly ", " nightly"]),
        _visible_text,
        st.builds(_insert, st.sampled_from(names) | _visible_text,
                  st.sampled_from(HOSTILE_CHARS) | _forbidden, st.integers(0, 30)),
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "😀", "\u05d0", "\u202e"]),
                  st.sampled_from([199, 200, 201, 10_000])),
        st.sampled_from(ODD_VISIBLE + SQLISH),
    )


BIGINT_EXTREMES = [0, -1, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**53 + 1, 2**63 - 1, -(2**63), -(2**63) + 1]


def bigints(live: Sequence[int] = ()) -> st.SearchStrategy[int | None]:
    return st.one_of(
        st.none(),
        _sampled(live, 1),
        st.sampled_from(BIGINT_EXTREMES),
        st.integers(-(2**63), 2**63 - 1),
        st.integers(-3, 100),
    )


def integers32() -> st.SearchStrategy[int | None]:
    return st.one_of(
        st.none(),
        st.sampled_from([0, 1, -1, 2, 5, 999, 1000, 1001, 2**31 - 1, -(2**31)]),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(-2, 1002),
    )


INTERVALS = [
    "-1 year 361 days", "1 day -1 hour", "1 day -1 microsecond", "-1 month 31 days", "178000000 years",
    "-178000000 years", "1 microsecond", "-1 microsecond", "0", "0 seconds", "00:00:00", "1 month",
    "30 days", "30 days 1 microsecond", "720 hours", "720:00:00.000001", "29 days 24 hours",
    "29 days 23:59:59.999999", "2147483647 months", "-2147483648 months", "2147483647 days",
    "2562047788:00:54.775807", "-2562047788:00:54.775808",
    "178000000 years 2147483647 days 2562047788 hours",
    "100 years", "100 years 1 microsecond", "1200 months", "36000 days", "36500 days", "864000 hours",
    "10 milliseconds", "9 milliseconds", "1 year", "1 year 1 microsecond", "365 days", "13 months",
    "@ 1 hour ago", "1 day ago", "P1D", "PT0.000001S", "P-1Y361D", "P0D", "P1Y2M3DT4H5M6S", "PT720H",
    "P1M", "-P1D", "1-2", "-1 2:03:04", "+1 -2:03:04", "1 2:00", "0-0 0 0:0:0.000001", "45 minutes",
    "1 minute", "80 minutes", "15 minutes", "1 hour", "10 minutes", "1 week", "4 weeks 2 days",
    "1 millennium", "1 century", "1 decade", "0.5 months", "1.5 years", "0.000001 seconds",
    "  1 hour  ", "1 hour 1 hour", "2 days ago 3 hours",
]
UNITS = ["microseconds", "milliseconds", "seconds", "minutes", "hours", "days", "weeks", "months", "years",
         "decades", "centuries", "millennia"]
_interval_part = st.tuples(
    st.one_of(st.integers(-100, 100),
              st.sampled_from([0, 1, -1, 24, 30, 31, 60, 365, 1000, 10**6, 178_000_000, 2**31 - 1, -(2**31)])),
    st.sampled_from(UNITS),
)


def intervals() -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        st.sampled_from(INTERVALS),
        st.lists(_interval_part, min_size=1, max_size=4).map(lambda ps: " ".join(f"{n} {u}" for n, u in ps)),
        st.builds("P{}Y{}M{}DT{}H{}M{}S".format, *[st.integers(-3, 40)] * 6),
        st.builds("{}-{} {} {}:{:02d}:{:02d}".format, st.integers(-2, 200), st.integers(0, 11),
                  st.integers(-40, 40), st.integers(-30, 800), st.integers(0, 59), st.integers(0, 59)),
    )


TIMESTAMPS = [
    "infinity", "-infinity", "294276-12-31", "294276-12-31 23:59:59.999999+00", "4713-01-01 BC",
    "4714-11-24 00:00:00+00 BC", "1900-01-01", "1969-12-31 23:59:59.999999+00", "1970-01-01 00:00:00+00",
    "1970-01-01 00:00:00", "1970-01-01 00:00:00+14", "2199-12-31 23:59:59.999999+00",
    "2200-01-01 00:00:00+00", "2199-12-31 23:59:59", "2200-01-01 00:00:00-12", "epoch", "now", "today",
    "tomorrow", "yesterday", "01/02/2003", "13/01/2020", "2020-03-08 02:30 America/New_York",
    "2020-03-08 02:30:00", "2020-11-01 01:30:00", "2020-10-25 02:30 Europe/Berlin",
    "2011-12-30 12:00 Pacific/Apia", "2000-01-01 00:00:00+14:59", "J2451545", "2000-01-01T00:00:00Z",
    "20000101T000000", "2000-02-29", "2001-02-29", "2038-01-19 03:14:08+00", "2106-02-07 06:28:16+00",
]
_OFFSETS = ["+00", "-12", "+14", "+05:45", "-03:30", "", " America/New_York", " Europe/Berlin", " UTC", "Z",
            " Australia/Lord_Howe", " Asia/Kathmandu"]


def instants(live: Sequence[str] = ()) -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        _sampled(live, "2000-01-01 00:00:00+00"),
        st.sampled_from(TIMESTAMPS),
        st.builds(lambda d, o: d.isoformat(sep=" ") + o,
                  st.datetimes(min_value=datetime(1960, 1, 1), max_value=datetime(2210, 1, 1)),
                  st.sampled_from(_OFFSETS)),
    )


def _deep(depth: int, kind: str) -> str:
    if kind == "object":
        return '{"a": ' * depth + "1" + "}" * depth
    return '{"a": ' + "[" * depth + "1" + "]" * depth + "}"


def _sized(n: int) -> str:
    # '{"x": "' + n characters + '"}' is n + 9 bytes as jsonb text
    return json.dumps({"x": "a" * n})


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(_visible_char | _forbidden, max_size=8),
                       st.floats(allow_nan=False, allow_infinity=False))
_json_tree = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=5).filter(lambda s: "\x00" not in s), inner, max_size=3),
                          max_leaves=10)


def details() -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        st.sampled_from(['{}', '[]', '"text"', '1', 'null', 'true', '{"a": null}', '{"": ""}',
                         '{"a": 1, "a": 2}', '{"n": 1e308}', '{"n": -0}', '{"n": ' + "9" * 1000 + '}',
                         '{"k": "\\u202e\\ufeff\\u2028"}', '{"\\ud83d\\ude00": "\\u00e9"}',
                         '{"seed": false, "more": {"x": [1, 2, 3]}}']),
        st.builds(_deep, st.sampled_from([1000, 5000]), st.sampled_from(["object", "array"])),
        st.builds(_sized, st.sampled_from([65_527, 65_528, 100_000])),
        st.builds(json.dumps, st.dictionaries(st.text(max_size=5).filter(lambda s: "\x00" not in s), _json_tree, max_size=4),
                  ensure_ascii=st.booleans()),
        st.builds(json.dumps, _json_tree),
    )


def definitions() -> st.SearchStrategy[str | None]:
    """A jobs file as sync_jobs takes it: mostly objects of register_job's
    arguments, some values or keys the contract refuses."""
    value = st.one_of(st.sampled_from(["1 minute", "@hourly", "*/5 * * * *", "UTC", "Mars/Olympus2", "skip", "0", ""]),
                      st.integers(-2, 1002), texts(), st.none())
    definition = st.dictionaries(st.sampled_from([*DEFINITION_KEYS, "command", "Schedule"]), value, max_size=4)
    jobs = st.dictionaries(st.sampled_from(["every", "nightly", "fz-new", "", "a\u202eb"]), definition, max_size=3)
    return st.one_of(st.none(), st.sampled_from(["[]", "1", '"x"', '{"every": 1}', "{}"]), jobs.map(json.dumps))


def texts() -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        st.sampled_from(["", "boom", "%s %I %L", "line 1\nline 2\r\n\ttab"] + SQLISH + HOSTILE_CHARS),
        st.text(_visible_char | _forbidden, max_size=30),
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "😀", "\u202e"]),
                  st.sampled_from([8191, 8192, 8193, 10_000, 100_000])),
    )


_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
_CRON_GARBAGE = ["L", "W", "?", "#", "H", "5L", "1#2", "", "-", ",", "*/0", "*/", "/5", "1-", "-1", "1--2", "1,,2",
                 "999999", "1000000", "0x1", "1.5", "*-5", "*/5/2", "**", "١", "\u00a0", "Sat-Sun", "sun-sat",
                 "MON-FRI", "Jan-Dec", "dec-jan", "7", "0-7", "8", "24", "60", "32", "13", "0"]


def _cron_item(lo: int, hi: int, names: list[str]) -> st.SearchStrategy[str]:
    n = st.one_of(st.integers(lo, hi), st.integers(lo - 1, hi + 1), st.sampled_from([0, 999999]))
    named = st.sampled_from(names + [x.upper() for x in names] + [x.title() for x in names]) if names else st.nothing()
    value = st.one_of(n.map(str), named)
    return st.one_of(
        st.just("*"),
        st.builds("*/{}".format, st.integers(0, hi - lo + 2)),
        value,
        st.builds("{}-{}".format, value, value),
        st.builds("{}-{}/{}".format, value, value, st.integers(0, hi - lo + 2)),
        st.builds("{}/{}".format, value, st.integers(1, hi - lo + 1)),
        st.sampled_from(_CRON_GARBAGE),
    )


def _cron_field(lo: int, hi: int, names: list[str] | None = None) -> st.SearchStrategy[str]:
    return st.lists(_cron_item(lo, hi, names or []), min_size=1, max_size=3).map(",".join)


_cron_fields = st.tuples(_cron_field(0, 59), _cron_field(0, 23), _cron_field(1, 31),
                         _cron_field(1, 12, _MONTHS), _cron_field(0, 7, _DAYS))
_separators = st.sampled_from([" ", " ", " ", "  ", "\t", " \n ", "\u00a0", "\u3000"])


def _join_cron(fields: tuple[str, ...], sep: str, extra: int) -> str:
    parts = list(fields) + ["*"] * max(extra, 0)
    parts = parts[: len(parts) + min(extra, 0)]
    return sep.join(parts)


VALID_CRON = ["*/15 * * * *", "*/15 2 * * *", "0 * * * *", "30 2 * * *", "0,30 2 * * *", "0 0 29 2 *",
              "0 0 29 2 */7", "0 0 31 * *", "0 12 * * Sat,Sun", "59 23 31 12 *",
              "0 0 1 1 *", "* * * * *", "0 9-17/2 * * mon-fri", "0 2 * * 0,7", "0 0 13 * fri",
              "30 1 * * *", "0 3 * * *", "15 1,2,3 * * *", "*/7 */5 */3 */2 */2"]
MACROS = ["@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually", "@reboot",
          "@every 5m", "@HOURLY", "@ hourly", "@", "@daily *"]


def schedules(valid_only: bool = False) -> st.SearchStrategy[str | None]:
    valid = st.one_of(st.sampled_from(VALID_CRON + MACROS[:7]),
                      st.sampled_from(["10 milliseconds", "1 second", "45 minutes", "90 minutes", "1 day",
                                       "24 hours", "1 week", "1 month", "1 year", "1 mon 1 day", "PT45M",
                                       "1 day 2 hours 3", "7 days"]))
    if valid_only:
        return valid
    return st.one_of(
        st.none(),
        valid,
        st.builds(_join_cron, _cron_fields, _separators, st.sampled_from([0, 0, 0, 1, -1, 2])),
        st.sampled_from(MACROS + ["", " ", "\t\n", "*", "* * * *", "* * * * * *", "x y z w v", "1 2 3 4 5"]),
        intervals().filter(lambda v: v is not None),
        st.builds(lambda c, n: c * n, st.sampled_from(["*", "1", "* ", "1,"]), st.sampled_from([200, 201, 10_000])),
        st.text(max_size=15).filter(lambda s: "\x00" not in s),
    )


VALID_ZONES = ["UTC", "Etc/UTC", "GMT", "utc", "America/New_York", "america/new_york", "Europe/Berlin",
               "Europe/Dublin", "Australia/Lord_Howe", "Pacific/Apia", "Pacific/Kiritimati", "Asia/Kathmandu",
               "America/Sao_Paulo", "America/Havana", "Antarctica/Troll", "Africa/Casablanca", "Asia/Gaza",
               "America/Santiago", "America/St_Johns", "Etc/GMT-14", "Etc/GMT+12", "EST5EDT", "Europe/Kyiv",
               "Asia/Calcutta", "America/Argentina/ComodRivadavia", "America/North_Dakota/New_Salem",
               "Pacific/Chatham", "Asia/Tehran", "Europe/Moscow", "Africa/Juba", "America/Caracas"]
# Not time zones at all: each must be refused. The ones with a digit after a
# slash read as POSIX TZ strings to PostgreSQL ('Asia/Riyadh87' is 87 hours
# west of UTC), which is not a time zone name either.
UNKNOWN_ZONES = ["Mars/Olympus", "Europe/Atlantis", "", " ", "America/New York", "../etc/passwd", "UTC ", "Z/Z/Z",
                 "Mars/Olympus2", "Asia/Riyadh87", "Foo/Bar3Baz", "A/B167", "Etc/GMT-15", "Etc/GMT+13"]
# Names the server loads that the contract refuses all the same (docs/contract.md,
# Bounds): the host's own zone, POSIX TZ strings, offsets, leap-second zones,
# and abbreviations, also those that are zone files too ('CET' reads as the
# abbreviation, without DST).
REFUSED_ZONES = ["localtime", "posixrules", "LocalTime", "right/UTC", "RIGHT/utc", "UTC+3", "UTC-14",
                 "EST5EDT,M3.2.0,M11.1.0", "abc3", "<+03>-3", "+03:00", "PST", "CEST", "MSK", "Z", "CET", "cet",
                 "EET", "MET", "WET", "EST", "MST", "HST"]
# Left to the server: accepted or refused, the fuzz does not say.
ODD_ZONES = ["posix/Europe/Paris", "GMT+0", "Factory", "US/Pacific-New", "x" * 300]
_posixish = st.builds("{}/{}{}".format, st.sampled_from(["Mars", "Asia", "Europe", "Foo", "X"]),
                      st.sampled_from(["Olympus", "Riyadh", "Paris", "Bar", "Y"]),
                      st.sampled_from(["2", "87", "167", "-167", "3Baz", "-15", "24", "0"]))


def zones(valid_only: bool = False) -> st.SearchStrategy[str | None]:
    if valid_only:
        return st.sampled_from(VALID_ZONES)
    return st.one_of(
        st.none(),
        st.sampled_from(VALID_ZONES),
        st.sampled_from(UNKNOWN_ZONES + REFUSED_ZONES + ODD_ZONES),
        _posixish,
        _posixish,
        st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=12),
    )


# Commands for ledger.run_guarded: some succeed, some fence with the run's own
# token, some fail in every way a statement can (the procedure records the
# failure and re-raises it).
GOOD_COMMANDS = [
    "SELECT 1", "  select 1 ;", "SELECT 1; SELECT 2", "SELECT current_setting('ledger.slot')",
    "SELECT ledger.fence(current_setting('ledger.job'), 'guarded-r', current_setting('ledger.token')::bigint)",
    "SELECT ledger.assert_current(current_setting('ledger.job'), current_setting('ledger.token')::bigint)",
    "SELECT ledger.heartbeat(current_setting('ledger.run_id')::bigint, current_setting('ledger.token')::bigint)",
    "SELECT '" + "x" * 10_000 + "'",
]
BAD_COMMANDS = [
    "SELECT 1/0", "SELEC 1", "COMMIT", "ROLLBACK", "VACUUM", "SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(0.2)",
    "CALL ledger.run_guarded('fz-nested', 'SELECT 1', ttl => '1 minute')", "SELECT ledger.assert_current('nope', 1)",
    "DO $$ BEGIN RAISE EXCEPTION 'boom' USING ERRCODE = 'P0001', HINT = 'mine'; END $$",
    "SELECT ledger.complete_run(current_setting('ledger.run_id')::bigint, current_setting('ledger.token')::bigint)",
    "SELECT ledger.start_run(current_setting('ledger.job'), 'usurper', '1 minute')",
    "SELECT ledger.release(current_setting('ledger.job'), current_setting('ledger.owner'), current_setting('ledger.token')::bigint)",
    "SELECT current_setting('ledger.nothing')", "RAISE NOTICE 'x'", "\\x", "SELECT '\u202e'::int",
]


def commands() -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        st.sampled_from(["", " ", "\n\t ", ";", "--", "/* */"]),
        st.sampled_from(GOOD_COMMANDS),
        st.sampled_from(BAD_COMMANDS),
        st.text(_visible_char | _forbidden, max_size=20),
    )


# Tables to protect (the seed makes schema fuzz_protect): an ordinary one, a
# view, a partitioned table, a table of the ledger, system catalogs, OIDs of
# nothing; a name that resolves to nothing fails in the cast (no business of
# the ledger).
TABLES = ["fuzz_protect.target", "fuzz_protect.target_view", "fuzz_protect.parted", "ledger.fences",
          "ledger.job_status", "pg_catalog.pg_class", "information_schema.sql_features", "4000000000", "0",
          "no_such_table"]


def tables() -> st.SearchStrategy[str | None]:
    return st.one_of(st.none(), st.sampled_from(TABLES))


# ------------------------------------------------------------------ values for a signature

@dataclass
class Live:
    """Values the ledger holds right now, so that calls hit real rows."""
    jobs: list[str] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    resources: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    run_ids: list[int] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)
    leases: list[list[Any]] = field(default_factory=list)  # [job, owner, token] of every lease row
    runs: list[list[Any]] = field(default_factory=list)  # [run_id, token] of every run
    pools: list[str] = field(default_factory=list)

    def labels_for(self, arg: str) -> list[str]:
        return {"job": self.jobs, "owner": self.owners, "resource": self.resources,
                "idempotency_key": self.keys, "pool": self.pools}.get(arg, [])


LIVE_QUERY = """
WITH scheduled AS (SELECT * FROM ledger.jobs WHERE schedule IS NOT NULL),
     clock AS (SELECT at FROM fuzz_seed.clock),  -- the seed's now(), so that a replay draws alike
     candidate AS (
        SELECT r.slot AS at FROM ledger.job_execution_log r WHERE r.slot IS NOT NULL
        UNION SELECT p.done_through FROM ledger.purged_slots p
        UNION SELECT s.first_slot FROM ledger.skipped_slots s
        UNION SELECT s.last_slot FROM ledger.skipped_slots s
        UNION SELECT ledger._slot_at_or_before(j.schedule_spec, j.time_zone, clock.at - o.back)
                FROM scheduled j, clock, (VALUES (interval '0'), ('1 minute'), ('1 hour'), ('1 day'), ('40 days'),
                                          ('1 year'), ('30 years')) o(back)
        UNION SELECT ledger._slot_after(j.schedule_spec, j.time_zone, clock.at) FROM scheduled j, clock)
SELECT (SELECT coalesce(array_agg(job::text ORDER BY job), '{}')
          FROM (SELECT job FROM ledger.jobs UNION SELECT job FROM ledger.leases) s),
       (SELECT coalesce(array_agg(owner::text ORDER BY owner), '{}')
          FROM (SELECT owner FROM ledger.leases UNION SELECT owner FROM ledger.job_execution_log) s),
       (SELECT coalesce(array_agg(resource::text ORDER BY resource), '{}') FROM ledger.fences),
       (SELECT coalesce(array_agg(k::text ORDER BY k), '{}')
          FROM (SELECT idempotency_key FROM ledger.job_execution_log
                UNION SELECT idempotency_key FROM ledger.purged_keys) s(k) WHERE k IS NOT NULL),
       (SELECT coalesce(array_agg(t ORDER BY t), '{}')
          FROM (SELECT token FROM ledger.leases UNION SELECT token FROM ledger.job_execution_log
                UNION SELECT token FROM ledger.fences) s(t)),
       (SELECT coalesce(array_agg(run_id ORDER BY run_id), '{}')
          || (SELECT coalesce(max(run_id), 0) + 1 FROM ledger.job_execution_log)
          FROM ledger.job_execution_log),
       (SELECT coalesce(array_agg(to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00' ORDER BY at), '{}')
          FROM candidate WHERE at IS NOT NULL AND isfinite(at) AND at > '0001-01-01+00'),
       (SELECT coalesce(jsonb_agg(jsonb_build_array(job, owner, token) ORDER BY job), '[]') FROM ledger.leases),
       (SELECT coalesce(jsonb_agg(jsonb_build_array(run_id, token) ORDER BY run_id), '[]')
          FROM ledger.job_execution_log),
       (SELECT coalesce(array_agg(pool::text ORDER BY pool), '{}') FROM ledger.pools)
"""


def live_values(conn: psycopg.Connection) -> Live:
    row = conn.execute(LIVE_QUERY).fetchone()
    assert row is not None and all(isinstance(v, list) for v in row), row
    return Live(*[list(v) for v in row])


def strategy_for(arg: Arg, live: Live) -> st.SearchStrategy[Any]:
    """Hostile values for one argument, chosen by its name and type."""
    key = (arg.name, arg.type)
    if arg.type == "text" and arg.name in LABEL_ARGS:
        return labels(live.labels_for(arg.name))
    if key in {("token", "bigint"), ("run_id", "bigint"), ("from_run_id", "bigint")}:
        return bigints(live.tokens if arg.name == "token" else live.run_ids)
    if key == ("deleted", "bigint"):  # purge_log_in_batches' INOUT result: its input is ignored
        return st.one_of(st.none(), st.integers(-2**63, 2**63 - 1))
    if arg.type == "interval" and arg.name in DURATION_BOUNDS:
        return intervals()
    if arg.type == "timestamptz" and arg.name in INSTANT_ARGS:
        return instants(live.slots)
    if key == ("detail", "jsonb"):
        return details()
    if key == ("error", "text"):
        return texts()
    if key == ("schedule", "text"):
        return schedules()
    if key == ("time_zone", "text"):
        return zones()
    if key == ("command", "text"):
        return commands()
    if key == ("table_name", "regclass"):
        return tables()
    if key == ("fenced", "text[]"):  # complete_run: the resources the run fenced
        return st.one_of(st.none(), st.just([]), st.lists(labels(live.resources), max_size=3),
                         st.integers(99, 102).map(lambda n: [f"r{i}" for i in range(n)]))
    if key == ("mode", "text"):
        return st.one_of(st.none(), st.sampled_from(["lenient", "strict", "", "Strict", "lenient ", "none"]), texts())
    if key in {("with_history", "boolean"), ("run_events", "boolean"), ("notify", "boolean")}:
        return st.one_of(st.none(), st.booleans())
    if key == ("max_events", "bigint"):
        return st.one_of(st.none(), st.sampled_from([999, 1000, 1_000_000_000, 1_000_000_001, 0, -1]),
                         st.integers(-2**63, 2**63 - 1))
    if key in {("max_backfill", "integer"), ("count", "integer"), ("pause_after_failures", "integer"),
               ("pid", "integer"), ("max_runs", "integer"), ("max_concurrent", "integer")}:
        return integers32()
    if key == ("jobs", "text[]"):
        return st.one_of(st.none(), st.lists(labels(live.jobs), max_size=4))
    if key == ("size", "integer"):
        return st.one_of(st.none(), st.sampled_from([0, 1, 100_000, 100_001, -1]), integers32())
    if key == ("detach", "boolean"):
        return st.one_of(st.none(), st.booleans())
    if key == ("overlap_policy", "text"):
        return st.one_of(st.none(), st.sampled_from([*OVERLAP_POLICIES, "Skip", "", "forbid", "allow_all"]), texts())
    if key == ("removed", "text"):
        return st.one_of(st.none(), st.sampled_from(["pause", "unregister", "Pause", "", "delete"]), texts())
    if key == ("stopping", "boolean"):
        return st.one_of(st.none(), st.booleans())
    if key == ("definitions", "jsonb"):
        return definitions()
    raise LookupError(f"no fuzz strategy for argument {arg.name} {arg.type}: add one to tests/fuzzhelp.py")


TTLS = ["1 minute", "10 minutes", "1 hour", "30 days", "1 day", "720 hours", "1 millisecond", "1 microsecond"]


def friendly(live: Live) -> dict[str, st.SearchStrategy[Any]]:
    """Valid values, most of them naming what the ledger holds: the other
    arguments of a call whose one or two hostile values are under test, so
    that the call gets past the first check and into the ledger's logic."""
    def known(values: Sequence[Any], *extra: Any) -> st.SearchStrategy[Any]:
        return _sampled([*values, *extra], fallback=1)

    return {
        "job": known(live.jobs, "fz-new"),
        "owner": known(["host-1", "host-2", "host-3", "host-4", "fz-owner"]),
        "resource": known(live.resources, "fz-r"),
        "idempotency_key": known(live.keys, None, "fz-k"),
        "token": known(live.tokens) | st.integers(1, max(live.tokens, default=1) + 2),
        "run_id": known(live.run_ids),
        "slot": known(live.slots, None),
        "at": st.one_of(st.none(), known(live.slots, "now"),
                        st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2199, 12, 30))
                        .map(lambda d: d.isoformat(sep=" ") + "+00")),
        "ttl": known(TTLS, None),
        "older_than": known(["1 microsecond", "1 second", "1 hour", "1 day", "36500 days"]),
        "max_backfill": known([1, 2, 5, 1000]) | st.integers(1, 1000),
        "count": known([1, 10, 1000]) | st.integers(1, 50),
        "late_after": known([None, "0", "1 second", "10 minutes", "365 days"]),
        "down_after": known([None, "0", "1 hour", "1 day"]),
        "min_runtime": known([None, "0", "1 millisecond", "1 minute"]),
        "max_runtime": known([None, "0", "1 second", "2 hours"]),
        "pause_after_failures": known([None, 0, 1, 3, 1000]),
        "with_history": known([False, True]),
        "run_events": known([None, False, True]),
        "notify": known([None, False, True]),
        "retention": known([None, "1 hour", "7 days", "36500 days"]),
        "max_events": known([None, 1000, 1_000_000]),
        "from_slot": known(live.slots, "2026-01-01 00:00+00"),
        "to_slot": known(live.slots, "now"),
        "after": st.one_of(st.none(), known(live.slots, "now"),
                           st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2199, 12, 30))
                           .map(lambda d: d.isoformat(sep=" ") + "+00")),
        "detail": known([None, "{}", '{"a": 1}', '{"nested": {"b": [1, "x", null]}}', '{"seed": false}']),
        "error": known([None, "boom", "Traceback (most recent call last): ..."]),
        "schedule": st.none() | schedules(valid_only=True),
        "time_zone": zones(valid_only=True),
        "command": known(GOOD_COMMANDS),
        "table_name": known(["fuzz_protect.target"]),
        "mode": known(["lenient", "strict"]),
        "fenced": st.one_of(st.none(), st.just([]), st.lists(known(live.resources, "fz-r"), max_size=2)),
        "jobs": known([["every"], ["nightly", "every", "minutely"], [], ["fz-new"]]),
        "overlap_policy": known([None, *OVERLAP_POLICIES]),
        "max_concurrent": known([None, 1, 2]),
        "jitter": known([None, "0", "1 second", "1 minute"]),
        "start_deadline": known([None, "0", "30 seconds", "1 hour"]),
        "requested_by": known([None, "operator", "cli"]),
        "scheduler": known(["sched-1", "sched-2"]),
        "host": known(["host-1", "host-2"]),
        "version": known(["0.2.0"]),
        "pid": known([1, 4242]),
        "stopping": known([False, True]),
        "max_runs": known([None, 1, 10]),
        "definitions": known(['{}', '{"every": {"schedule": "15 minutes", "ttl": "10 minutes"}}',
                              '{"fz-new": {"schedule": "@hourly", "ttl": "1 minute", "jitter": "1 minute"}}']),
        "source": known(["jobs.toml", "other.toml"]),
        "removed": known(["pause", "unregister"]),
        "pool": known(live.pools, "fz-pool"),
        "size": known([1, 2, 3, 100_000]),
        "detach": known([False, True]),
    }


def draw_values(data: Any, sig: Signature, live: Live,
                overrides: dict[str, st.SearchStrategy[Any]] | None = None) -> dict[str, Any]:
    """Values for a call of `sig`, drawn from hypothesis' st.data(): mostly
    one hostile value (shrinking heads there), sometimes two, every value,
    or none; the others come from friendly() (or `overrides`). An argument
    with a DEFAULT is left out one time in four."""
    names = [a.name for a in sig.args]
    mode = data.draw(st.integers(0, 7), label="hostile: 0-4 one, 5 two, 6 every, 7 no argument")
    if not names:  # a function of no arguments: its call under the session is the test
        hostile: set[str] = set()
    elif mode <= 4:
        hostile = {data.draw(st.sampled_from(names), label="hostile argument")}
    elif mode == 5:
        hostile = set(data.draw(st.lists(st.sampled_from(names), min_size=2, max_size=2), label="hostile arguments"))
    else:
        hostile = set(names) if mode == 6 else set()
    valid = {**friendly(live), **(overrides or {})}
    # Half the time the friendly job, owner and token (or run_id and token)
    # belong together: a live lease or run, so the call gets past LD001.
    if "token" in names and data.draw(st.booleans(), label="coherent lease or run"):
        if "run_id" in names:
            run = data.draw(_sampled(live.runs), label="run")
            if run is not None:
                valid.update(run_id=st.just(run[0]), token=st.just(run[1]))
        elif "job" in names:
            lease = data.draw(_sampled(live.leases), label="lease")
            if lease is not None:
                valid.update(job=st.just(lease[0]), owner=st.just(lease[1]), token=st.just(lease[2]))
    values: dict[str, Any] = {}
    for arg in sig.args:
        if arg.has_default and data.draw(st.integers(0, 3), label=f"{arg.name} left out unless") == 0:
            continue
        strategy = strategy_for(arg, live) if arg.name in hostile or arg.name not in valid else valid[arg.name]
        values[arg.name] = data.draw(strategy, label=arg.name)
    return values


# ------------------------------------------------------------------ session settings

@dataclass(frozen=True)
class Session:
    time_zone: str
    interval_style: str
    date_style: str
    isolation: str
    synchronous_commit: str
    explicit: bool  # inside BEGIN ... COMMIT, else one autocommit statement

    def __str__(self) -> str:
        return (f"TimeZone={self.time_zone}, IntervalStyle={self.interval_style}, DateStyle='{self.date_style}', "
                f"default_transaction_isolation='{self.isolation}', synchronous_commit={self.synchronous_commit}, "
                f"{'BEGIN ... COMMIT' if self.explicit else 'autocommit'}")


sessions = st.builds(
    Session,
    st.sampled_from(["UTC", "America/New_York", "Asia/Kathmandu", "Pacific/Kiritimati", "Australia/Lord_Howe"]),
    st.sampled_from(["postgres", "iso_8601", "sql_standard", "postgres_verbose"]),
    st.sampled_from(["ISO, MDY", "ISO, DMY", "SQL, MDY", "SQL, DMY", "German, MDY", "German, DMY"]),
    st.sampled_from(["read committed", "repeatable read", "serializable"]),
    st.sampled_from(["on", "off"]),
    st.booleans(),
)


def apply_session(conn: psycopg.Connection, session: Session) -> None:
    conn.execute(
        "SELECT set_config('TimeZone', %s, false), set_config('IntervalStyle', %s, false),"
        " set_config('DateStyle', %s, false), set_config('default_transaction_isolation', %s, false),"
        " set_config('synchronous_commit', %s, false)",
        [session.time_zone, session.interval_style, session.date_style, session.isolation,
         session.synchronous_commit])


# ------------------------------------------------------------------ state

Snapshot = tuple[tuple[str, str], ...]  # (table, row as JSON text), sorted


def snapshot_query(conn: psycopg.Connection) -> str:
    """One query returning every row of every table in schema ledger, as
    text (no JSON parsing: a detail may nest deeper than Python's json
    recursion limit). tests/sqlhelp.state() leaves out purged_slots,
    purged_keys and alembic_version, hence this one, built from the catalog."""
    tables = [r[0] for r in conn.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace"
        " AND c.relkind IN ('r', 'p') ORDER BY c.relname").fetchall()]
    assert {"jobs", "leases", "fences", "job_execution_log", "counters", "skipped_slots",
            "purged_slots", "purged_keys"} <= set(tables), tables
    return " UNION ALL ".join(f"SELECT '{t}', to_jsonb(t)::text FROM ledger.{t} t" for t in tables) + " ORDER BY 1, 2"


def state_diff(before: Snapshot, after: Snapshot) -> str:
    b, a = set(before), set(after)
    lines = [f"  {table}: - {short(row, 400)}" for table, row in sorted(b - a)]
    lines += [f"  {table}: + {short(row, 400)}" for table, row in sorted(a - b)]
    return "\n".join(lines)


# ------------------------------------------------------------------ the property

DURATION_BOUNDS = {  # argument -> upper bound in microseconds (a duration has no month part; a day is 24 hours)
    "ttl": 30 * 86_400_000_000,
    "older_than": 36_500 * 86_400_000_000,
    # register_job's health bounds: 0 clears one (ZERO_CLEARS)
    "late_after": 365 * 86_400_000_000,
    "down_after": 365 * 86_400_000_000,
    "min_runtime": 365 * 86_400_000_000,
    "max_runtime": 365 * 86_400_000_000,
    "retention": 36_500 * 86_400_000_000,  # configure_events
    # register_job's scheduler options: 0 clears one (jitter must also stay
    # under the schedule's shortest gap, which a refusal may name)
    "jitter": 24 * 3_600_000_000,
    "start_deadline": 365 * 86_400_000_000,
}
ZERO_CLEARS = frozenset({"late_after", "down_after", "min_runtime", "max_runtime", "jitter", "start_deadline"})
LABEL_ARGS = frozenset({"job", "owner", "resource", "idempotency_key", "requested_by", "scheduler", "host",
                        "version", "source", "pool"})
OVERLAP_POLICIES = ("catch_up", "skip", "buffer_one", "replace")
DEFINITION_KEYS = ("schedule", "ttl", "max_backfill", "time_zone", "late_after", "down_after", "min_runtime",
                   "max_runtime", "pause_after_failures", "jitter", "start_deadline", "overlap_policy", "pool",
                   "max_concurrent")
INSTANT_ARGS = frozenset({"slot", "at", "after", "from_slot", "to_slot"})

# The facts bound_violations() needs, computed by PostgreSQL from the value
# as the call will see it (the session's DateStyle, IntervalStyle, TimeZone).
# CASE keeps an infinite interval (PostgreSQL 17 has them) out of extract().
FACT_SQL = {
    "interval": "(SELECT CASE WHEN isfinite(v) THEN ARRAY[(extract(year FROM v) * 12 + extract(month FROM v))::numeric,"
                " extract(day FROM v)::numeric, ((extract(hour FROM v) * 3600 + extract(minute FROM v) * 60)"
                " * 1000000 + extract(microseconds FROM v))::numeric] END"
                " FROM (SELECT %s::interval AS v) s)",
    "timestamptz": "(SELECT ARRAY[isfinite(v), v >= timestamptz '1970-01-01 00:00:00+00'"
                   " AND v < timestamptz '2200-01-01 00:00:00+00'] FROM (SELECT %s::timestamptz AS v) s)",
    "jsonb": "(SELECT ARRAY[jsonb_typeof(v), octet_length(v::text)::text] FROM (SELECT %s::jsonb AS v) s)",
    "integer": "%s::integer",
    "bigint": "%s::bigint",
    "text": "%s::text IS NULL",
    "boolean": "%s::boolean",
    "regclass": "%s::regclass IS NULL",
    "text[]": "%s::text[] IS NULL",  # its elements are judged in Python (label_problem)
}


@dataclass
class Call:
    sig: Signature
    values: dict[str, Any]  # argument -> value; None is SQL NULL; missing: DEFAULT

    @property
    def bound(self) -> list[Arg]:
        return [a for a in self.sig.args if a.name in self.values]

    def sql(self) -> str:
        args = ", ".join(f"{a.name} => %s::{a.type}" for a in self.bound)
        if self.sig.procedure:
            return f"CALL {self.sig.qualified}({args})"
        return f"SELECT t::text FROM {self.sig.qualified}({args}) AS t"

    def params(self) -> list[Any]:
        return [self.values[a.name] for a in self.bound]

    def __str__(self) -> str:
        lines = [("CALL " if self.sig.procedure else "") + f"{self.sig.qualified}("
                 + ", ".join(f"{a.name} => %s::{a.type}" for a in self.bound) + ")"]
        for a in self.bound:
            lines.append(f"    {a.name} = {_show(self.values[a.name])}")
        left_out = [a.name for a in self.sig.args if a.name not in self.values]
        if left_out:
            lines.append(f"    (left out, DEFAULT: {', '.join(left_out)})")
        return "\n".join(lines)


def short(text: str, limit: int) -> str:
    """At most about `limit` characters of `text`: its head and its tail."""
    return text if len(text) <= limit else f"{text[: limit // 2]}…{text[-limit // 4:]}"


def _show(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        for k in range(1, 9):  # 'x' * 10000 rather than ten thousand x
            unit = value[:k]
            if len(value) > 40 and unit * (len(value) // k) + unit[: len(value) % k] == value:
                return f"{ascii(unit)} * {len(value) / k:g}  ({len(value)} characters)"
        if len(value) > 160:
            return f"{ascii(value[:80])} … {ascii(value[-40:])}  ({len(value)} characters)"
        return ascii(value)
    return repr(value)


def precast(conn: psycopg.Connection, call: Call) -> dict[str, Any] | None:
    """Cast every value to its type under the session's settings, in a
    statement of its own; the facts the bounds are checked against, or None
    when PostgreSQL refuses a value as its type (no business of the ledger)."""
    bound = call.bound
    if not bound:
        return {}
    sql = "SELECT " + ", ".join(FACT_SQL[a.type] for a in bound)
    try:
        row = conn.execute(sql, call.params()).fetchone()
    except psycopg.Error:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        return None
    assert row is not None
    return {a.name: v for a, v in zip(bound, row)}


def bound_violations(call: Call, facts: dict[str, Any]) -> list[str]:
    """Why docs/contract.md must refuse this call (empty: it may succeed)."""
    problems: list[str] = []
    for arg in call.sig.args:
        if arg.name not in call.values:
            continue
        value, fact = call.values[arg.name], facts.get(arg.name)  # type: Any, Any
        if value is None:
            if not arg.has_default:
                problems.append(f"required argument {arg.name} is NULL")
            continue
        if arg.name == "pool" and value == "" and call.sig.name == "register_job":
            continue  # '' takes the job out of its pool
        if arg.type == "text" and arg.name in LABEL_ARGS:
            why = label_problem(value)
            if why:
                problems.append(f"label {arg.name} {why}")
        elif arg.type == "text[]" and arg.name == "fenced":
            if len(value) > 100:
                problems.append(f"fenced has {len(value)} resources (more than 100)")
            for i, element in enumerate(value, 1):
                why = "is NULL" if element is None else label_problem(element)
                if why:
                    problems.append(f"fenced element {i} {why}")
        elif arg.type == "bigint" and arg.name in {"token", "run_id", "from_run_id"} and fact <= 0:
            problems.append(f"{arg.name} {fact} is not positive")
        elif arg.type == "interval" and arg.name in DURATION_BOUNDS and fact is None:
            problems.append(f"{arg.name} is infinite")
        elif arg.type == "interval" and arg.name in DURATION_BOUNDS:
            months, days, micros = (int(x) for x in fact)
            total = days * 86_400_000_000 + micros
            if months != 0:
                problems.append(f"{arg.name} has a month part ({months} months): not an exact duration")
            elif days < 0 or micros < 0:
                problems.append(f"{arg.name} has a negative part ({months} months, {days} days, {micros} µs)")
            elif total < 0 or (total == 0 and arg.name not in ZERO_CLEARS):
                problems.append(f"{arg.name} is not positive")
            elif total > DURATION_BOUNDS[arg.name]:
                problems.append(f"{arg.name} is over its bound ({months} months, {days} days, {micros} µs)")
        elif arg.type == "timestamptz" and arg.name in INSTANT_ARGS:
            finite, inside = fact
            if not finite:
                problems.append(f"{arg.name} is infinite")
            elif not inside:
                problems.append(f"{arg.name} is outside 1970-01-01 00:00 UTC to before 2200-01-01 00:00 UTC")
        elif arg.type == "text[]" and arg.name == "jobs":
            bad = [j for j in value if j is None or label_problem(j)]
            if bad:
                problems.append(f"jobs holds {len(bad)} element(s) that are no label")
        elif arg.name == "overlap_policy" and value not in OVERLAP_POLICIES:
            problems.append(f"overlap_policy {value!r} is not one of {OVERLAP_POLICIES}")
        elif arg.name == "removed" and value not in ("pause", "unregister"):
            problems.append(f"removed {value!r} is not pause or unregister")
        elif arg.name == "max_runs" and fact < 1:
            problems.append(f"max_runs {fact} is not positive")
        elif arg.name == "pid" and fact < 0:
            problems.append(f"pid {fact} is negative")
        elif arg.type == "jsonb" and arg.name == "definitions":
            kind, _ = fact
            if kind != "object":
                problems.append(f"definitions is a JSON {kind}, not an object")
        elif arg.type == "jsonb" and arg.name == "detail":
            kind, size = fact
            if kind != "object":
                problems.append(f"detail is a JSON {kind}, not an object")
            elif int(size) > 65_536:
                problems.append(f"detail is {size} bytes as text (over 65536)")
        elif arg.name == "size" and not 1 <= fact <= 100_000:
            problems.append(f"size {fact} is outside 1 to 100000")
        elif arg.name == "max_concurrent" and not 1 <= fact <= 1000:
            problems.append(f"max_concurrent {fact} is outside 1 to 1000")
        elif arg.name == "max_backfill" and not 1 <= fact <= 1000:
            problems.append(f"max_backfill {fact} is outside 1 to 1000")
        elif arg.name == "pause_after_failures" and not 0 <= fact <= 1000:
            problems.append(f"pause_after_failures {fact} is outside 0 to 1000")
        elif arg.name == "max_events" and not 1000 <= fact <= 1_000_000_000:
            problems.append(f"max_events {fact} is outside 1000 to 1000000000")
        elif arg.name == "count" and not 1 <= fact <= 1000:
            problems.append(f"count {fact} is outside 1 to 1000")
        elif arg.name == "command" and re.fullmatch(r"[ \t\n\r\f\v]*", value):
            problems.append("command is empty or only white space")
        elif arg.name == "schedule" and len(value) > 200:
            problems.append(f"schedule has {len(value)} characters (over 200)")
        elif arg.name == "time_zone" and (value in UNKNOWN_ZONES or value in REFUSED_ZONES or re.fullmatch(r"[A-Za-z]+/[A-Za-z]+-?\d+[A-Za-z]*", value)
                                           and value not in VALID_ZONES):
            problems.append(f"time_zone {value!r} is not a time zone name the contract accepts")
    return problems


def blame_problems(call: Call, facts: dict[str, Any], error: psycopg.Error) -> list[str]:
    """A 22004 must name an argument that is NULL; a label's 22023 (the one
    whose DETAIL carries a length) must name a label that is invalid."""
    message = error.diag.message_primary or ""
    if error.sqlstate == "22004":
        m = re.match(r"(?:argument )?(\w+) must not be null", message, re.IGNORECASE)
        if not m:
            return [f"22004 whose message names no argument: {message!r}"]
        name = m.group(1)
        if not any(a.name == name for a in call.sig.args):
            return [f"22004 names {name!r}, which is not an argument of {call.sig.qualified}"]
        if name not in call.values:
            return [f"22004 names {name!r}, which the call left out (its DEFAULT applies)"]
        if call.values[name] is not None:
            return [f"22004 names {name!r}, which is not NULL"]
    if error.sqlstate == "22023":
        try:
            detail = json.loads(error.diag.message_detail or "null")
        except ValueError:
            return [f"22023 whose DETAIL is not JSON: {error.diag.message_detail!r}"]
        if isinstance(detail, dict) and detail.get("argument") in LABEL_ARGS and "length" in detail:
            name = detail["argument"]
            if name in call.values and call.values[name] is not None and label_problem(call.values[name]) is None:
                return [f"22023 refuses label {name}, which the contract accepts"]
    return []


def _row(text: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return row if isinstance(row, dict) else {}


def recorded_failure(before: Snapshot, after: Snapshot, error: psycopg.Error) -> str | None:
    """The job of a run that appeared, failed, with `error` recorded as
    'SQLSTATE: message' (what run_guarded does with its command's error)."""
    for table, text in sorted(set(after) - set(before)):
        row = _row(text)
        if (table == "job_execution_log" and row.get("status") == "failure"
                and str(row.get("error") or "").startswith(f"{error.sqlstate}: ")):
            return str(row.get("job"))
    return None


def stray_changes(before: Snapshot, after: Snapshot, job: str) -> list[str]:
    """Changed rows that are not `job`'s run, lease, counters, skipped slots or events."""
    changed = set(before) ^ set(after)
    return [f"  {table}: {short(text, 300)}" for table, text in sorted(changed)
            if table not in {"job_execution_log", "leases", "counters", "skipped_slots", "events"}
            or _row(text).get("job") != job]


@dataclass
class Outcome:
    ok: bool
    rows: list[Any] | None = None
    error: psycopg.Error | None = None


def run_call(conn: psycopg.Connection, call: Call, session: Session) -> Outcome:
    try:
        if session.explicit:
            conn.execute("BEGIN")
        cursor = conn.execute(call.sql(), call.params())
        rows = cursor.fetchall() if cursor.description is not None else []
        if session.explicit:
            conn.execute("COMMIT")  # deferred triggers fire here: part of the call
        return Outcome(True, rows=rows)
    except psycopg.Error as error:
        if not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        return Outcome(False, error=error)


def _describe_error(error: psycopg.Error) -> str:
    diag = error.diag
    lines = [f"raised {error.sqlstate or type(error).__name__}: {diag.message_primary or error}"]
    if diag.message_detail:
        lines.append(f"DETAIL: {short(diag.message_detail, 600)}")
    if diag.context:
        lines.append("CONTEXT: " + short(diag.context, 1500).replace("\n", "\n         "))
    return "\n".join(lines)


class Fuzz:
    """One database under fuzz: the connection that calls, an observer with
    fixed settings that takes the snapshots, the seed to restore."""

    def __init__(self, conn: psycopg.Connection, observer: psycopg.Connection) -> None:
        self.conn = conn
        self.observer = observer
        # jit off: the harness' own queries (LIVE_QUERY) would otherwise pay
        # JIT compilation, seconds on a busy machine, for a handful of rows.
        observer.execute("SET TimeZone = 'UTC'; SET IntervalStyle = 'postgres'; SET DateStyle = 'ISO, YMD';"
                         " SET jit = off")
        conn.execute("SET statement_timeout = '20s'")  # a hang is a finding, not a stuck suite
        self._snapshot_sql = snapshot_query(observer)
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (function, 'ok' or SQLSTATE)
        self.slowest: list[tuple[float, str]] = []  # the five slowest calls

    # The tables as last seen, while nothing can have changed them since (a
    # restore, or a call that raised and was checked); None after a success.
    known: Snapshot | None = None
    seed_state: Snapshot | None = None

    def snapshot(self) -> Snapshot:
        return tuple((t, r) for t, r in self.observer.execute(self._snapshot_sql).fetchall())

    def save_seed(self) -> None:
        """Copy every ledger table into schema fuzz_seed; restore() puts it back."""
        tables = [r[0] for r in self.observer.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace"
            " AND c.relkind IN ('r', 'p') AND c.relname <> 'alembic_version' ORDER BY c.relname").fetchall()]
        self.observer.execute("CREATE SCHEMA fuzz_seed; CREATE TABLE fuzz_seed.clock AS SELECT now() AS at")
        body = []
        for t in tables:
            self.observer.execute(f"CREATE TABLE fuzz_seed.{t} AS TABLE ledger.{t}")
            body.append(f"DELETE FROM ledger.{t}; INSERT INTO ledger.{t} OVERRIDING SYSTEM VALUE"
                        f" SELECT * FROM fuzz_seed.{t};")
        # the run ids the next runs get, too (a sequence does not roll back)
        last, called = self.observer.execute(
            "SELECT last_value, is_called FROM ledger.job_execution_log_run_id_seq").fetchone() or (1, False)
        body.append(f"PERFORM setval(pg_get_serial_sequence('ledger.job_execution_log', 'run_id'), {int(last)}, {bool(called)});")
        # replica: no foreign key or trigger fires while the tables are refilled
        self.observer.execute(
            "CREATE FUNCTION fuzz_seed.restore() RETURNS void LANGUAGE plpgsql AS $$ BEGIN"
            " PERFORM set_config('session_replication_role', 'replica', true); "
            + " ".join(body)
            # the event triggers follow ledger.event_settings again
            + " PERFORM ledger.configure_events(); END $$")

    def restore(self) -> None:
        """Put the seed back (nothing to do when no call changed it since)."""
        if self.seed_state is None:
            self.seed_state = self.snapshot_of_seed()
        if self.known is not None and self.known == self.seed_state:
            return
        self.observer.execute("SELECT fuzz_seed.restore()")
        self.known = self.seed_state

    def snapshot_of_seed(self) -> Snapshot:
        self.observer.execute("SELECT fuzz_seed.restore()")
        return self.snapshot()

    def check_call(self, call: Call, session: Session, allowed: frozenset[str] = ALLOWED_SQLSTATES,
                   skip: Callable[[], None] | None = None) -> Outcome | None:
        """Run one call and check the property; None when a value does not
        parse as its type (then `skip` is called first, e.g. hypothesis.assume)."""
        apply_session(self.conn, session)
        facts = precast(self.conn, call)
        if facts is None:
            if skip is not None:
                skip()
            return None
        must_refuse = bound_violations(call, facts)
        before = self.known if self.known is not None else self.snapshot()
        self.known = None
        started = time.perf_counter()
        outcome = run_call(self.conn, call, session)
        elapsed = time.perf_counter() - started
        self.slowest = sorted([*self.slowest, (elapsed, f"{call} [{session}]")], key=lambda x: -x[0])[:5]
        self.outcomes[call.sig.name, "ok" if outcome.ok else str(outcome.error.sqlstate if outcome.error else "?")] += 1
        problems: list[str] = []
        if outcome.ok:
            if must_refuse:
                problems.append("succeeded, yet the contract's bounds refuse it: " + "; ".join(must_refuse))
        else:
            error = outcome.error
            assert error is not None
            after = self.snapshot()
            self.known = after
            recorded = recorded_failure(before, after, error) if call.sig.procedure else None
            if recorded is not None:
                # The procedure's command failed: the run records it, and the
                # change stays within that job's run, lease and counters.
                stray = stray_changes(before, after, recorded)
                if stray:
                    problems.append(f"the command's failure was recorded for job {recorded!r}, yet more changed:\n"
                                    + "\n".join(stray))
            else:
                documented = allowed | PROCEDURE_SQLSTATES if call.sig.procedure else allowed
                documented |= TABLE_SQLSTATES.get(call.sig.name, frozenset())
                if error.sqlstate not in documented:
                    problems.append(f"undocumented SQLSTATE {error.sqlstate} ({type(error).__name__})")
                else:
                    problems.extend(blame_problems(call, facts, error))
                if after != before:
                    problems.append("the call raised, yet it changed the ledger's tables:\n"
                                    + state_diff(before, after))
        if problems:
            report = [f"FUZZ FINDING in {call.sig.qualified}", *problems, "call: " + str(call),
                      f"session: {session}"]
            if outcome.error is not None:
                report.append(_describe_error(outcome.error))
            else:
                report.append(f"returned: {short(repr(outcome.rows), 300)}")
            raise AssertionError("\n".join(report))
        return outcome
