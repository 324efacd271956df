"""Running the `jobledger` command line as a real subprocess, as cron or a shell would."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

JOBLEDGER = [sys.executable, "-m", "ledger"]
PG_VARIABLES = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE", "PGPASSWORD")


def environment(dsn: str | None = None, **extra: str) -> dict[str, str]:
    """Our environment without PG*/LEDGER_* variables, plus LEDGER_DSN and ``extra``."""
    env = {key: value for key, value in os.environ.items()
           if key not in PG_VARIABLES and not key.startswith("LEDGER_")}
    env["COLUMNS"] = "240"  # rich: no wrapping of the tables in captured output
    if dsn is not None:
        env["LEDGER_DSN"] = dsn
    env.update(extra)
    return env


def pg_variables(dsn: str) -> dict[str, str]:
    """The PG* variables naming ``dsn``'s server, database and user: how a reader's shell reaches the ledger."""
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE", "password": "PGPASSWORD"}
    return {names[key]: str(value) for key, value in conninfo_to_dict(dsn).items() if key in names and value}


def jobledger_on_path(directory: Path, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with a `jobledger` first on PATH that runs this checkout's (``python -m ledger``), so that
    a shell block of the docs runs as written."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "jobledger"
    shim.write_text(f'#!/bin/sh\nexec {shlex.join(JOBLEDGER)} "$@"\n')
    shim.chmod(0o755)
    return {**env, "PATH": f"{directory}{os.pathsep}{env.get('PATH', os.defpath)}"}


def jobledger(*args: str, dsn: str | None = None, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``jobledger ARGS`` to its end; stdout and stderr captured as text."""
    return subprocess.run([*JOBLEDGER, *args], env=dict(env) if env is not None else environment(dsn),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def start(*args: str, dsn: str | None = None, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None) -> subprocess.Popen[str]:
    """Start ``jobledger ARGS`` in the background (stdout and stderr piped).

    With SIGINT at its default action, whatever the test runner inherited: a
    suite started in the background of a shell (``nohup make test &``, some CI
    runners) ignores SIGINT, the child would inherit that, and the tests that
    press Ctrl-C on a command would wait for nothing.
    """
    return subprocess.Popen([*JOBLEDGER, *args], env=dict(env) if env is not None else environment(dsn),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def runs_of(conn: psycopg.Connection, job: str) -> list[dict[str, object]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute("SELECT * FROM ledger.job_execution_log WHERE job = %s ORDER BY run_id", (job,))
        return cur.fetchall()


def running_run(conn: psycopg.Connection, job: str) -> dict[str, object] | None:
    runs = [run for run in runs_of(conn, job) if run["status"] == "running"]
    return runs[0] if runs else None


def shell(script: str) -> Sequence[str]:
    return ["sh", "-c", script]
