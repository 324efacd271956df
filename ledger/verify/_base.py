"""What every check of ``jobledger verify`` shares: its result (:class:`Check`), its :class:`Probe`, the words.

Private to :mod:`ledger.verify`: the checks (``ledger.verify.guarantees``,
``ledger.verify.environment``) and the runner (``ledger.verify``) use it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from ledger.client import Ledger
from ledger.connect import connect

Status = Literal["held", "warn", "failed", "skipped"]

APPLICATION_NAME = "jobledger-verify"

JOBS: dict[str, str] = {
    "race": "jobledger-verify:race",
    "zombie": "jobledger-verify:zombie",
    "lost-lease": "jobledger-verify:lost-lease",
    "reconnect": "jobledger-verify:reconnect",
}
"""The scratch job of each check that writes (the same names on every run: their lease rows stay)."""

RESOURCES: dict[str, str] = {"zombie": "jobledger-verify:zombie"}
"""The resources the scratch jobs fence (their fences stay, as the lease rows do)."""

CHECK_TIMEOUT = 30.0
"""Seconds any one check may take before it is reported failed."""


@dataclass
class Check:
    """One guarantee, as found on this database."""

    name: str
    guarantee: str
    status: Status
    summary: str
    facts: dict[str, Any] = field(default_factory=dict)
    how_to_reproduce: str | None = None
    advice: str | None = None
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "guarantee": self.guarantee, "status": self.status, "summary": self.summary,
                "facts": self.facts, "how_to_reproduce": self.how_to_reproduce, "advice": self.advice,
                "seconds": round(self.seconds, 3)}


GUARANTEES: dict[str, str] = {
    "race": "two racing workers get one run per slot",
    "zombie": "a zombie past its ttl is refused by the fence",
    "lost-lease": "the client notices a lost lease by the lease's expiry",
    "reconnect": "tokens keep increasing across a reconnect",
    "clock": "the database's clock against this host's",
    "path": "the path to the database keeps transactions whole, and the settings in use are safe on it",
    "role": "the connecting role can run jobs and is no more than a ledger client",
    "replication": "commits reach a synchronous standby (what a failover may lose)",
    "mvcc": "nothing holds back the xmin horizon or piles dead versions on the ledger's hot rows",
    "state": "every job's stored state is what its log, schedule and lease give (ledger.verify_state() is empty)",
}

# How to see each guarantee by hand, with psql or Python: what a failed check prints.
REPRODUCE: dict[str, str] = {
    "race": """\
psql "$LEDGER_DSN" -c "SELECT FROM ledger.register_job(job => 'repro-race', schedule => '1 second', \
ttl => '10 seconds', max_backfill => 10)"
# in two shells at once, for a few seconds: start the due slot, complete what started
while :; do psql "$LEDGER_DSN" -qAt -c "SELECT (ledger.complete_run(run_id => s.run_id, token => s.token)).slot \
FROM ledger.start_due_run(job => 'repro-race', owner => 'shell-$$', ttl => '10 seconds') AS s \
WHERE s.outcome = 'started'"; done
psql "$LEDGER_DSN" -c "SELECT * FROM ledger.duplicates WHERE job = 'repro-race'"  # must stay empty""",
    "zombie": """\
psql "$LEDGER_DSN" <<'SQL'
SELECT run_id, token FROM ledger.start_run(job => 'repro-zombie', owner => 'zombie', ttl => '1 second') \\gset z_
SELECT pg_sleep(1.5);
SELECT outcome, token FROM ledger.start_run(job => 'repro-zombie', owner => 'successor', ttl => '1 minute');
BEGIN;
SELECT ledger.fence(job => 'repro-zombie', resource => 'repro-zombie', token => :z_token);  -- must fail: LD001
ROLLBACK;
SQL""",
    "lost-lease": """\
# a run whose renewals cannot commit: on_lost must fire by the lease's expiry
python - <<'PY'
import os, time
from datetime import timedelta
from ledger import Ledger
with Ledger(os.environ["LEDGER_DSN"]) as ledger:
    with ledger.run("repro-lost", ttl=timedelta(seconds=30), on_lost=lambda e: print(time.ctime(), e)) as run:
        print(time.ctime(), "run", run.run_id, "token", run.token, "lease for", run.time_left, "s")
        time.sleep(60)
PY
# meanwhile, in psql, hold the lease row with a heartbeat that never commits:
#   BEGIN; SELECT ledger.heartbeat(run_id => RUN, token => TOKEN);  -- wait past the lease, then ROLLBACK""",
    "reconnect": """\
psql "$LEDGER_DSN" -c "SELECT token FROM ledger.acquire(job => 'repro-reconnect', owner => 'a', ttl => '1 second')"
sleep 1.5
psql "$LEDGER_DSN" -c "SELECT token FROM ledger.acquire(job => 'repro-reconnect', owner => 'b', ttl => '1 second')"
# the second token is higher""",
    "clock": """\
psql "$LEDGER_DSN" -Atc "SELECT extract(epoch FROM clock_timestamp())"; date +%s.%N""",
    "path": """\
python - <<'PY'
import os, psycopg
a = psycopg.connect(os.environ["LEDGER_DSN"], autocommit=True)
b = psycopg.connect(os.environ["LEDGER_DSN"], autocommit=True, prepare_threshold=0)  # prepares at once
print("b", b.execute("SELECT pg_backend_pid()").fetchone())
with a.transaction():  # a statement pooler refuses this
    print("a", a.execute("SELECT pg_backend_pid()").fetchone())  # b's backend: a transaction pooler
    print("b", b.execute("SELECT pg_backend_pid()").fetchone())  # 26000 where prepared statements break
PY""",
    "role": """\
psql "$LEDGER_DSN" -c "SELECT rolsuper, pg_has_role('ledger_client', 'USAGE') AS client FROM pg_roles \
WHERE rolname = current_user"
psql "$LEDGER_DSN" -c "SELECT * FROM ledger.acquire(job => 'repro-role', owner => 'me', ttl => '1 second')" \
  # 42501 without ledger_client""",
    "replication": """\
psql "$LEDGER_DSN" -c "SHOW synchronous_standby_names" -c "SHOW synchronous_commit" \\
     -c "SELECT application_name, state, sync_state FROM pg_stat_replication"  # sync_state: sync, quorum""",
    "mvcc": """\
psql "$LEDGER_DSN" -c "SELECT pid, usename, state, age(backend_xmin), now() - xact_start FROM pg_stat_activity \
WHERE backend_xmin IS NOT NULL ORDER BY 4 DESC"
psql "$LEDGER_DSN" -c "SELECT relname, n_live_tup, n_dead_tup FROM pg_stat_user_tables \
WHERE schemaname = 'ledger'"  # dead versions on leases, counters""",
    "state": """\
psql "$LEDGER_DSN" -c "SELECT * FROM ledger.verify_state()"  # per job: the columns whose stored value differs""",
}


@dataclass
class Probe:
    """What every check gets: the DSN, an owner of this verify's own, and the flag that stops waiting."""

    dsn: str
    owner: str
    stop: threading.Event = field(default_factory=threading.Event)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A connection with the ledger's settings (autocommit, nothing prepared), named in pg_stat_activity."""
        return connect(self.dsn, application_name=APPLICATION_NAME, **kwargs)

    def ledger(self, conn: psycopg.Connection[Any], owner: str | None = None) -> Ledger:
        """The client over ``conn``, its contexts' own connections opened from the whole DSN (a multi-host
        one included: a psycopg connection knows only the host it reached)."""
        return Ledger(conn, owner=owner or self.owner, heartbeat_conninfo=self.dsn)

    def wait(self, seconds: float) -> bool:
        """Sleep; False when the verify is being stopped (a check ran out of time)."""
        return not self.stop.wait(seconds)


CheckFunction = Callable[[Probe], Check]


def verdict(name: str, status: Status, summary: str, facts: dict[str, Any] | None = None, *,
            how_to_reproduce: str | None = None, advice: str | None = None) -> Check:
    """The check ``name``'s result; a failure says how to reproduce it (REPRODUCE) unless told otherwise."""
    if status == "failed" and how_to_reproduce is None:
        how_to_reproduce = REPRODUCE[name]
    return Check(name, GUARANTEES[name], status, summary, facts or {}, how_to_reproduce, advice)


def timed_out(name: str, timeout: float) -> Check:
    """The failure of a check that ran out of time (or was stopped because another one did)."""
    check = verdict(name, "failed", f"did not finish within {timeout:g} s", {"timeout_seconds": timeout})
    check.seconds = timeout
    return check


# -- small helpers -------------------------------------------------------------------------

def fetch_all(conn: psycopg.Connection[Any], query: str,
              params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params or {})
        return cur.fetchall()


def fetch_one(conn: psycopg.Connection[Any], query: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    rows = fetch_all(conn, query, params)
    assert rows, query
    return rows[0]


def fetch_value(conn: psycopg.Connection[Any], query: str, params: Mapping[str, Any] | None = None) -> Any:
    return next(iter(fetch_one(conn, query, params).values()))


def dsn_params(dsn: str) -> dict[str, Any]:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        params = {}
    hosts = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "").split(",")
    return {"hosts": [host for host in hosts if host] or ["(libpq's default)"],
            "target_session_attrs": params.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS")}


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def plain(value: Any) -> Any:
    """A fact as JSON takes it."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def ident(name: str) -> str:
    """A role name as SQL writes it."""
    return name if name.isidentifier() and name == name.lower() else '"' + name.replace('"', '""') + '"'
