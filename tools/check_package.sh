#!/usr/bin/env bash
# make package-check: prove that what users get from PyPI works without this
# source tree. Builds the sdist and the wheel (PyPI's `build`), runs
# `twine check --strict`, checks what each carries, installs the wheel with
# its `web` and `embedded` extras into a fresh venv outside the checkout, and
# from there: `jobledger install`, `jobledger sql | psql`, `jobledger demo` on
# the embedded server, and the dashboard (`jobledger web`) page by page.
#
# Everything lives in one temporary directory and two scratch databases on
# the server below; an EXIT trap removes them and stops the dashboard. Any
# failure exits non-zero, naming the step. Runs as root too (CI): pgserver
# runs the embedded server as its own `pgserver` user, as for `make demo`.
#
#   PYTHON          the interpreter for the venvs (python3)
#   CHECK_PGHOST    the server for the scratch databases (127.0.0.1),
#   CHECK_PGPORT    5432, CHECK_PGUSER postgres (trust auth, CREATEDB)
#   KEEP=1          keep the temporary directory (its logs) for a look
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
PG_HOST=${CHECK_PGHOST:-127.0.0.1}
PG_PORT=${CHECK_PGPORT:-5432}
PG_USER=${CHECK_PGUSER:-postgres}
STARTED=$SECONDS

STEP="setup"
WORK=""
WEB_PID=""
DATABASES=()

say() { echo "package-check: $*"; }
fail() { echo "package-check: FAILED in step '$STEP': $*" >&2; exit 1; }
step() { STEP=$1; say "== $STEP"; }

# A command's output goes to a log of its own; shown (its tail) only when it fails.
quiet() {
    local log="$WORK/logs/$(echo "$STEP" | tr -c 'A-Za-z0-9\n' '_').log"
    if ! "$@" >>"$log" 2>&1; then
        tail -n 40 "$log" >&2
        fail "command failed: $* (whole log: $log)"
    fi
}

on_error() {
    local status=$? line=$1
    [ "$BASHPID" = "$$" ] || return 0  # a command substitution's failure: said once, by the shell itself
    echo "package-check: FAILED in step '$STEP' (exit $status, tools/check_package.sh line $line)" >&2
}
trap 'on_error $LINENO' ERR

admin_psql() {
    psql -X -q -v ON_ERROR_STOP=1 -At -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" "$@"
}

cleanup() {
    local status=$?
    trap - ERR
    set +e
    if [ -n "$WEB_PID" ] && kill -0 "$WEB_PID" 2>/dev/null; then
        kill -TERM "$WEB_PID" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$WEB_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$WEB_PID" 2>/dev/null
    fi
    # The demo's embedded server stops when its last user exits; one left behind (a killed demo) by its pid.
    local pidfile="${WORK:-/nonexistent}/home/pgdata/postmaster.pid"
    if [ -f "$pidfile" ]; then
        local pid
        pid=$(head -n 1 "$pidfile")
        [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    for db in "${DATABASES[@]}"; do
        admin_psql -d postgres -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 \
            || echo "package-check: could not drop database $db" >&2
    done
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        if [ "${KEEP:-0}" = 1 ]; then
            echo "package-check: kept $WORK" >&2
        else
            rm -rf "$WORK"
        fi
    fi
    exit "$status"
}
trap cleanup EXIT

# -- setup --------------------------------------------------------------------------------

WORK=$(mktemp -d "${TMPDIR:-/tmp}/package-check.XXXXXX")
WORK=$(cd "$WORK" && pwd -P)
case "$WORK/" in
    "$(cd "$ROOT" && pwd -P)/"*) fail "the temporary directory $WORK is inside the checkout $ROOT" ;;
esac
mkdir -p "$WORK/logs" "$WORK/dist" "$WORK/home"
command -v psql >/dev/null || fail "psql is not installed"
admin_psql -d postgres -c "SELECT 1" >/dev/null \
    || fail "no PostgreSQL at $PG_HOST:$PG_PORT as $PG_USER (CHECK_PGHOST, CHECK_PGPORT, CHECK_PGUSER)"

# -- 1. build -----------------------------------------------------------------------------

step "build: sdist and wheel with PyPI's build"
quiet "$PYTHON" -m venv "$WORK/tools"
quiet "$WORK/tools/bin/python" -m pip install --upgrade pip
quiet "$WORK/tools/bin/python" -m pip install "build>=1" "twine>=5"
# build makes the sdist, then the wheel from the unpacked sdist: the sdist alone must suffice.
quiet "$WORK/tools/bin/python" -m build --outdir "$WORK/dist" "$ROOT"
shopt -s nullglob
sdists=("$WORK"/dist/*.tar.gz)
wheels=("$WORK"/dist/*.whl)
shopt -u nullglob
[ ${#sdists[@]} -eq 1 ] || fail "expected one sdist in $WORK/dist, found ${#sdists[@]}"
[ ${#wheels[@]} -eq 1 ] || fail "expected one wheel in $WORK/dist, found ${#wheels[@]}"
SDIST=${sdists[0]}
WHEEL=${wheels[0]}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$ROOT/ledger/__init__.py")
[ -n "$VERSION" ] || fail "no __version__ = \"...\" line in ledger/__init__.py"
[ "$(basename "$WHEEL")" = "pg_job_ledger-$VERSION-py3-none-any.whl" ] \
    || fail "the wheel is $(basename "$WHEEL"), expected pg_job_ledger-$VERSION-py3-none-any.whl"
[ "$(basename "$SDIST")" = "pg_job_ledger-$VERSION.tar.gz" ] \
    || fail "the sdist is $(basename "$SDIST"), expected pg_job_ledger-$VERSION.tar.gz"

# -- 2. twine check -----------------------------------------------------------------------

step "twine check --strict"
quiet "$WORK/tools/bin/twine" check --strict "$SDIST" "$WHEEL"

# -- 3. contents --------------------------------------------------------------------------

step "contents of the wheel and the sdist"
"$WORK/tools/bin/python" - "$ROOT" "$WHEEL" "$SDIST" "$VERSION" <<'PY' || fail "see above"
import sys, tarfile, zipfile
from pathlib import Path

root, wheel, sdist, version = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
problems = []

def need(names, wanted, where):
    for name in wanted:
        if name not in names:
            problems.append(f"{where} lacks {name}")

def need_some(names, prefix, suffix, where):
    if not any(n.startswith(prefix) and n.endswith(suffix) for n in names):
        problems.append(f"{where} has no {prefix}*{suffix}")

wheel_names = set(zipfile.ZipFile(wheel).namelist())
sql = sorted(p.name for p in (root / "sql").glob("*.sql"))
versions = sorted(p.name for p in (root / "migrations" / "versions").iterdir() if p.is_file() and p.suffix in (".py", ".sql"))
need(wheel_names, [f"ledger/_sql/{name}" for name in sql], "the wheel")
need(wheel_names, [f"ledger/_migrations/versions/{name}" for name in versions], "the wheel")
need(wheel_names, ["ledger/_migrations/env.py", "ledger/_migrations/script.py.mako", "ledger/py.typed",
                   "ledger/__init__.py", "ledger/cli/__init__.py", "ledger/resources.py",
                   "ledger/monitoring/alert-rules.yml", "ledger/monitoring/grafana-dashboard.json",
                   f"pg_job_ledger-{version}.dist-info/entry_points.txt",
                   f"pg_job_ledger-{version}.dist-info/licenses/LICENSE"], "the wheel")
for folder in ("templates", "static"):
    shipped = sorted(p.name for p in (root / "ledger" / "web" / folder).iterdir() if p.is_file())
    if not shipped:
        problems.append(f"ledger/web/{folder} is empty in the source tree")
    need(wheel_names, [f"ledger/web/{folder}/{name}" for name in shipped], "the wheel")
stray = sorted(n for n in wheel_names
               if not (n.startswith("ledger/") or n.startswith(f"pg_job_ledger-{version}.dist-info/"))
               or "__pycache__" in n or n.endswith(".pyc"))
if stray:
    problems.append(f"the wheel carries files outside ledger/: {stray[:10]}")
entry_points = zipfile.ZipFile(wheel).read(f"pg_job_ledger-{version}.dist-info/entry_points.txt").decode()
if "jobledger = ledger.cli:main" not in entry_points:
    problems.append("the wheel's entry points lack jobledger = ledger.cli:main")

top = f"pg_job_ledger-{version}/"
sdist_names = {n[len(top):] for n in tarfile.open(sdist).getnames() if n.startswith(top)}
need(sdist_names, ["pyproject.toml", "README.md", "LICENSE", "PKG-INFO", "ledger/__init__.py", "ledger/py.typed",
                   "ledger/web/templates/base.html", "ledger/web/static/style.css",
                   "ledger/monitoring/alert-rules.yml", "migrations/env.py"], "the sdist")
need(sdist_names, [f"sql/{name}" for name in sql], "the sdist")
need(sdist_names, [f"migrations/versions/{name}" for name in versions], "the sdist")
stray = sorted(n for n in sdist_names if n.split("/")[0] in (".venv", "dist", "build", ".pg", "site")
               or "__pycache__" in n or n.endswith(".pyc"))
if stray:
    problems.append(f"the sdist carries build or cache files: {stray[:10]}")

if problems:
    print("\n".join(f"package-check: {p}" for p in problems), file=sys.stderr)
    sys.exit(1)
print(f"package-check: the wheel has {len(wheel_names)} files ({len(sql)} sql, {len(versions)} revision files), "
      f"the sdist {len(sdist_names)}")
PY

# -- 4. a fresh venv, outside the checkout ------------------------------------------------

step "install the wheel with [web,embedded] into a fresh venv"
cd "$WORK"
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
VENV="$WORK/venv"
quiet "$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install --upgrade pip
quiet "$VENV/bin/python" -m pip install "$WHEEL[web,embedded]"
quiet "$VENV/bin/python" -m pip check
JOBLEDGER="$VENV/bin/jobledger"
[ -x "$JOBLEDGER" ] || fail "the wheel installed no jobledger command"
"$VENV/bin/python" - "$VENV" "$VERSION" <<'PY' || fail "see above"
import importlib.metadata, sys
from pathlib import Path

venv, version = Path(sys.argv[1]).resolve(), sys.argv[2]
import ledger
from ledger import migrate, monitoring, resources
import ledger.web.app

print(f"package-check: import ledger: {ledger.__file__}")
checks = {
    "ledger": Path(ledger.__file__),
    "sql_dir()": resources.sql_dir(),
    "migrations_dir()": resources.migrations_dir(),
    "the alert rules": monitoring.path(monitoring.ALERT_RULES),
    "the templates": ledger.web.app.HERE / "templates",
}
problems = [f"{what} is {path}, not inside {venv}" for what, path in checks.items()
            if not path.resolve().is_relative_to(venv)]
if resources.sql_dir().name != "_sql" or resources.migrations_dir().name != "_migrations":
    problems.append(f"resources found the source tree's files: {resources.sql_dir()}, {resources.migrations_dir()}")
if not resources.sql_files():
    problems.append("resources.sql_files() is empty")
if ledger.__version__ != version or importlib.metadata.version("pg-job-ledger") != version:
    problems.append(f"versions: ledger.__version__ {ledger.__version__}, metadata "
                    f"{importlib.metadata.version('pg-job-ledger')}, expected {version}")
if problems:
    print("\n".join(f"package-check: {p}" for p in problems), file=sys.stderr)
    sys.exit(1)
print(f"package-check: head revision {migrate.head()}")
PY
HEAD=$("$VENV/bin/python" -c "from ledger import migrate; print(migrate.head())")
"$JOBLEDGER" --help >/dev/null || fail "jobledger --help failed"

# -- 5. install and sql -------------------------------------------------------------------

STAMP="pkgcheck_$(date +%s)_$$"
DB_INSTALL="${STAMP}_install"
DB_SQL="${STAMP}_sql"
dsn() { echo "postgresql://$PG_USER@$PG_HOST:$PG_PORT/$1"; }

check_ledger() {  # database: the ledger is there, at the package's head revision
    local db=$1 revision
    admin_psql -d "$db" -c "SELECT count(*) FROM ledger.jobs" >/dev/null \
        || fail "database $db has no ledger.jobs"
    revision=$(admin_psql -d "$db" -c "SELECT string_agg(version_num, ',') FROM ledger.alembic_version")
    [ "$revision" = "$HEAD" ] || fail "database $db is at revision '$revision', the package's head is $HEAD"
}

step "jobledger install --dsn (database $DB_INSTALL)"
DATABASES+=("$DB_INSTALL")
admin_psql -d postgres -c "CREATE DATABASE \"$DB_INSTALL\"" >/dev/null
out=$("$JOBLEDGER" install --dsn "$(dsn "$DB_INSTALL")") || fail "jobledger install failed: $out"
say "$out"
check_ledger "$DB_INSTALL"
out=$("$JOBLEDGER" install --dsn "$(dsn "$DB_INSTALL")") || fail "a second jobledger install failed: $out"
case "$out" in *"already current"*) ;; *) fail "a second jobledger install did not say 'already current': $out" ;; esac

step "jobledger sql | psql (database $DB_SQL)"
DATABASES+=("$DB_SQL")
admin_psql -d postgres -c "CREATE DATABASE \"$DB_SQL\"" >/dev/null
"$JOBLEDGER" sql | admin_psql -d "$DB_SQL" >"$WORK/logs/sql.log" 2>&1 \
    || { tail -n 40 "$WORK/logs/sql.log" >&2; fail "jobledger sql | psql -v ON_ERROR_STOP=1 failed"; }
check_ledger "$DB_SQL"
say "both databases have the ledger at revision $HEAD"

# -- 6. the demo on the embedded server ---------------------------------------------------

step "jobledger demo (embedded PostgreSQL, LEDGER_HOME=$WORK/home)"
env -u PGHOST -u PGHOSTADDR -u PGPORT -u PGUSER -u PGDATABASE -u PGPASSWORD -u PGSERVICE -u LEDGER_DSN \
    LEDGER_HOME="$WORK/home" "$JOBLEDGER" demo >"$WORK/demo.log" 2>&1 \
    || { tail -n 40 "$WORK/demo.log" >&2; fail "jobledger demo exited non-zero"; }
last=$(tail -n 1 "$WORK/demo.log")
[ "$last" = "audit: ledger.overlaps has 0 rows" ] \
    || { tail -n 20 "$WORK/demo.log" >&2; fail "the demo's last line is '$last', not the clean overlaps audit"; }
say "$last"

# -- 7. the dashboard ---------------------------------------------------------------------

step "jobledger web --dsn (database $DB_INSTALL)"
RUN_ID=$(admin_psql -d "$DB_INSTALL" <<'SQL'
SELECT ledger.register_job('package-check', ttl => '10 minutes') \g /dev/null
SELECT run_id, token FROM ledger.start_run(job => 'package-check', owner => 'package-check') \gset
SELECT status FROM ledger.complete_run(run_id => :run_id, token => :token) \g /dev/null
SELECT :run_id;
SQL
) || fail "could not register a job and record a run"
: >"$WORK/web.log"  # before the background job opens it: the loop below reads it at once
"$JOBLEDGER" web --dsn "$(dsn "$DB_INSTALL")" --host 127.0.0.1 --port 0 --refresh 60 >"$WORK/web.log" 2>&1 &
WEB_PID=$!
URL=""
deadline=$((SECONDS + 60))
while [ -z "$URL" ]; do
    kill -0 "$WEB_PID" 2>/dev/null || { cat "$WORK/web.log" >&2; fail "jobledger web exited before it served"; }
    [ $SECONDS -lt $deadline ] || { cat "$WORK/web.log" >&2; fail "jobledger web did not say where it serves in 60 s"; }
    URL=$(sed -n 's|^jobledger: serving the dashboard on \(http://[^/ ]*\)/.*|\1|p' "$WORK/web.log")
    [ -n "$URL" ] || sleep 0.2
done
"$VENV/bin/python" - "$URL" "$RUN_ID" "$VENV" <<'PY' || { cat "$WORK/web.log" >&2; fail "see above"; }
import json, re, sys, time, urllib.error, urllib.request
from pathlib import Path

base, run_id, venv = sys.argv[1], sys.argv[2], Path(sys.argv[3])
job = "package-check"

def get(path):
    try:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("content-type", ""), error.read()

deadline = time.monotonic() + 60
while True:  # the socket listens before uvicorn answers: poll, no fixed sleep
    try:
        status, _, _ = get("/")
        if status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"package-check: {base}/ did not answer 200 within 60 s")
    time.sleep(0.2)

problems, static = [], set()
pages = {
    "/": ("text/html", job), f"/jobs/{job}": ("text/html", job), f"/runs/{run_id}": ("text/html", job),
    "/alerts": ("text/html", "Alerts"),
    "/api/jobs": ("application/json", None), f"/api/jobs/{job}": ("application/json", None),
    f"/api/runs/{run_id}": ("application/json", None), "/api/alerts": ("application/json", None),
    "/metrics": ("text/plain", "jobledger_up 1.0"), f"/badge/{job}.svg": ("image/svg+xml", "<svg"),
}
for path, (kind, text) in pages.items():
    status, content_type, body = get(path)
    if status != 200 or not content_type.startswith(kind):
        problems.append(f"GET {path}: {status} {content_type}, expected 200 {kind}")
        continue
    if text and text not in body.decode():
        problems.append(f"GET {path}: no {text!r} in the answer")
    if kind == "application/json":
        json.loads(body)
    if kind == "text/html":
        static.update(re.findall(r'(?:href|src)="(/static/[^"]+)"', body.decode()))
if job not in json.dumps(json.loads(get("/api/jobs")[2])):
    problems.append(f"/api/jobs does not list {job}")
stylesheets = [s for s in static if s.split("?")[0].endswith(".css")]
if not stylesheets:
    problems.append(f"the pages reference no stylesheet under /static/ (found {sorted(static)})")
shipped = Path(next(venv.glob("lib/python*/site-packages/ledger/web/static")))
for path in sorted(static):
    status, content_type, body = get(path)
    name = path.split("?")[0][len("/static/"):]
    if status != 200 or not body:
        problems.append(f"GET {path}: {status}, {len(body)} bytes")
    elif name == "states.css":  # written by the app from ledger.states (the one table of states), not a file
        if b".state-crashed" not in body:
            problems.append(f"GET {path} has no style of the state crashed")
    elif body != (shipped / name).read_bytes():
        problems.append(f"GET {path} is not the installed package's {shipped / name}")
if problems:
    print("\n".join(f"package-check: {p}" for p in problems), file=sys.stderr)
    sys.exit(1)
print(f"package-check: {len(pages)} pages and {len(static)} static files ({', '.join(sorted(static))}) "
      f"answered 200 from {base}")
PY
kill -TERM "$WEB_PID"
status=0
wait "$WEB_PID" || status=$?
WEB_PID=""
[ "$status" -eq 0 ] || { cat "$WORK/web.log" >&2; fail "jobledger web exited $status on SIGTERM"; }
grep -q "dashboard stopped" "$WORK/web.log" || fail "jobledger web did not say it stopped"

# -- 8. summary ---------------------------------------------------------------------------

STEP="summary"
say "sdist and wheel OK ($(basename "$WHEEL")): twine, contents, install, sql, demo, web" \
    "in $((SECONDS - STARTED)) s"
