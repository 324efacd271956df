"""ledger.run_guarded from each native driver's example (`guarded <job> <owner>`): a CALL
inside the driver's own transaction is refused, before the procedure did anything, with
the SQLSTATE that driver gets; the same CALL in autocommit runs the command as a run of
the job. Directly and behind PgBouncer (with the driver's [pooler] settings).

Which SQLSTATE: a CALL sent on the extended protocol (parameters, or a driver that
always uses it) has a portal, the procedure cannot tell it is inside a transaction
block, and PostgreSQL refuses its first COMMIT with 2D000; on the simple protocol the
procedure sees the open transaction and raises 25001 itself (sql/80_pg_cron.sql).
docs/sql-clients.md says which one each driver gets.
"""

from __future__ import annotations

import subprocess
from typing import Any

import psycopg
import pytest
from pgbouncer import pgbouncer  # noqa: F401 - the fixture
from test_drivers import (  # noqa: F401 - fixtures
    DRIVERS,
    Example,
    _build_root,
    _expand,
    _writes,
    driver,
    example,
    transport,
)

BY_NAME = {d.name: d for d in DRIVERS}
# (driver, more query parameters of LEDGER_DSN, the SQLSTATE of the CALL inside a transaction)
CASES = [
    ("java-pgjdbc", {}, "2D000"),  # pgjdbc: always the extended protocol
    ("java-pgjdbc", {"preferQueryMode": "simple"}, "25001"),
    ("go-pgx", {}, "2D000"),
    ("go-pgx", {"prefer_simple_protocol": "true"}, "25001"),
    ("go-libpq", {}, "2D000"),  # with parameters; without, the simple protocol: 25001
    ("ruby-pg", {}, "2D000"),  # exec_params; conn.exec without parameters: 25001
    ("php-pgsql", {}, "2D000"),  # pg_query_params; pg_query without parameters: 25001
]
PARAMS = [pytest.param(BY_NAME[name], extra, code, id=name + "".join(f"-{k}={v}" for k, v in extra.items()))
          for name, extra, code in CASES if name in BY_NAME]


def _guarded(example: Example, extra: dict[str, str], job: str, owner: str) -> dict[str, Any]:
    env = example.env()
    if extra:
        query = "&".join(f"{k}={v}" for k, v in extra.items())
        env["LEDGER_DSN"] += ("&" if "?" in env["LEDGER_DSN"] else "?") + query
    return Example.result(subprocess.Popen(
        _expand(example.driver.argv, example._build_dir) + ["guarded", job, owner],
        cwd=example.driver.folder, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))


@pytest.mark.parametrize(("driver", "extra", "code"), PARAMS, indirect=["driver"])
def test_run_guarded_is_refused_inside_the_drivers_transaction_and_runs_in_autocommit(
        example: Example, db: psycopg.Connection, extra: dict[str, str], code: str) -> None:
    out = _guarded(example, extra, "nightly", "host-1")
    assert out["mode"] == "guarded"
    assert out["in_transaction"] is not None and out["in_transaction"]["code"] == code, out
    if code == "25001":
        assert out["in_transaction"]["detail"]["job"] == "nightly"  # the procedure's own error, JSON DETAIL
    assert out["autocommit"] is None, out

    # The refused CALL left nothing; the one in autocommit is run 1, its fenced write committed.
    assert db.execute("SELECT token, owner, status FROM ledger.job_execution_log "
                      "WHERE job = 'nightly'").fetchall() == [(1, "host-1", "success")]
    assert _writes(db) == [(1, "host-1")]
    assert db.execute("SELECT resource, token FROM ledger.fences").fetchall() == [("fenced_writes:nightly", 1)]
