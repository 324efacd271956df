#!/usr/bin/env bash
# The job ledger from cron with bash and psql: the ledger's whole API is SQL
# functions, so a shell script can use it as well as any driver.
#
#   LEDGER_DSN=postgres://user@host:5432/db ./run.sh run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
#   ./run.sh zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
#   ./run.sh tokens <job> <owner> [count]            # bigint tokens in bash and psql
#
# Without LEDGER_DSN, psql reads PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE.
# psql sends every statement as a simple query (never prepared), so it needs
# nothing more behind PgBouncer in transaction mode. Each mode prints one JSON
# line saying what happened (psql builds it: see emit); `run` and `zombie`
# write into a table the caller created:
#   CREATE TABLE fenced_writes (token bigint, written_by text)
# A crontab line: */5 * * * * LEDGER_DSN=... /path/to/run.sh run nightly "$(hostname)"
set -euo pipefail

usage() {
    echo "usage: $0 run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]" >&2
    echo "       $0 zombie <job> <owner> <run_id> <token>" >&2
    echo "       $0 tokens <job> <owner> [count]" >&2
    exit 64
}

dsn=()
[ -n "${LEDGER_DSN:-}" ] && dsn=(--dbname="$LEDGER_DSN")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# psql for scripts: no ~/.psqlrc (-X), bare values (-At), no command tags (-q),
# stop at the first error with exit status 3 (ON_ERROR_STOP: the rest of the
# script never runs, and an open transaction is rolled back as psql
# disconnects), errors with their SQLSTATE (VERBOSITY=verbose). Values go in
# as psql variables and into SQL as :'name', which psql quotes as a literal.
sql() {
    psql -X -q -At -v ON_ERROR_STOP=1 -v VERBOSITY=verbose "${dsn[@]}" "$@"
}

# The error psql wrote into FILE: in the bash variables err_code,
# err_message and err_detail, and as the psql variables PREFIX_code,
# PREFIX_message and PREFIX_detail (for error_json and emit):
#   psql:<stdin>:3: ERROR:  LD001: lease superseded: ...
#   DETAIL:  {"job": "nightly", "token": 1, "current_token": 2, ...}
# psql keeps the SQLSTATE and the message in :LAST_ERROR_SQLSTATE and
# :LAST_ERROR_MESSAGE for a script that goes on after an error, but has no
# variable for the DETAIL: it is on stderr only. The DETAIL stays text here;
# only psql parses it (json keeps its numbers exact; see tokens_mode for jq).
error_vars() {
    local prefix=$1 file=$2 line
    line=$(grep -m1 'ERROR:  ' "$file" || true)
    line=${line#*ERROR:  }
    err_code=""
    if [[ $line =~ ^([0-9A-Z]{5}):\ (.*)$ ]]; then
        err_code=${BASH_REMATCH[1]} err_message=${BASH_REMATCH[2]}
    else  # not from the server (a connection failure, say): psql's words
        err_message=${line:-$(head -n1 "$file")}
    fi
    err_detail=$(sed -n 's/^DETAIL:  //p' "$file" | head -n1)
    vars+=(-v "${prefix}_code=$err_code" -v "${prefix}_message=$err_message" -v "${prefix}_detail=$err_detail")
}

# The SQL of the error object of error_vars PREFIX (just called). The DETAIL
# goes in as json when it is JSON (chosen here: a cast of a constant in a
# CASE branch is evaluated even when the branch is not taken), else as text.
error_json() {
    local p=$1 detail="to_json(nullif(:'$1_detail', ''))"
    [[ $err_detail == "{"* ]] && detail=":'${p}_detail'::json"
    echo "json_build_object('code', nullif(:'${p}_code', ''), 'message', :'${p}_message', 'detail', $detail)"
}

# Print one JSON line: json_build_object over the fields (SQL expressions,
# key and value in turn; values as psql variables in `vars`). The DETAIL
# goes in as json, which keeps the server's text: 2^53 + 1 stays 2^53 + 1.
emit() {
    local IFS=,
    sql "${vars[@]}" <<<"SELECT json_build_object(${fields[*]});"
}

resource_of() {
    # Tokens count per job, so a resource belongs to the first job that fenced
    # it (another job gets LD006): one per job.
    echo "fenced_writes:$1"
}

# One transaction holds the fence and the application's write: they commit
# together or not at all. LD001 (the token is no longer live), LD002 (a newer
# token wrote) or LD006 (another job's resource) stops psql (ON_ERROR_STOP)
# before the INSERT, and its transaction is rolled back. Error in FILE.
fenced_write() {
    local job=$1 resource=$2 token=$3 owner=$4 file=$5
    sql -v job="$job" -v resource="$resource" -v token="$token" -v owner="$owner" >/dev/null 2>"$file" <<'SQL'
BEGIN;
SELECT ledger.fence(job => :'job', resource => :'resource', token => :'token');
INSERT INTO fenced_writes (token, written_by) VALUES (:'token', :'owner');
COMMIT;
SQL
}

# End the run (this also releases the lease): complete_run, or fail_run when
# an error text is given. A zombie learns here too that it lost (LD001: a
# newer token took over; LD003: already closed). Error in FILE.
end_run() {
    local args=(-v run_id="$1" -v token="$2") file=$3
    [ $# -ge 4 ] && args+=(-v error="$4")
    sql "${args[@]}" >/dev/null 2>"$file" <<'SQL'
\if :{?error}
SELECT run_id FROM ledger.fail_run(run_id => :'run_id', token => :'token', error => :'error');
\else
SELECT run_id FROM ledger.complete_run(run_id => :'run_id', token => :'token');
\endif
SQL
}

# One heartbeat: status 0 when the lease was extended; 1 when it is lost
# (NULL, or LD001/LD003 raised: the error in $tmp/lost.err).
heartbeat() {
    local out
    out=$(sql -v run_id="$run_id" -v token="$token" 2>"$tmp/lost.err" <<'SQL'
SELECT ledger.heartbeat(run_id => :'run_id', token => :'token') AS expires_at \gset
\if :{?expires_at}
\echo :expires_at
\endif
SQL
    ) || return 1
    [ -n "$out" ] || { echo "ERROR:  lease lost: heartbeat returned NULL" >"$tmp/lost.err"; return 1; }
}

# In the background: a heartbeat every ttl/3 (two may be lost before the lease
# expires); when the lease is lost, stop the work (kill WORK_PID). On TERM it
# ends, but after a heartbeat in flight (bash runs the trap once psql returns).
heartbeats() {
    local work_pid=$1 sleeper=""
    trap '[ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null; exit 0' TERM
    while :; do
        sleep "$every" & sleeper=$!
        wait "$sleeper" || true
        if heartbeat; then
            echo beat >>"$tmp/beats"
        else
            touch "$tmp/lost"
            kill "$work_pid" 2>/dev/null || true
            exit 0
        fi
    done
}

seconds() {  # milliseconds as seconds for sleep: 2500 -> 2.500
    printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000))
}

run_mode() {
    local job=$1 owner=$2 resource=$3 ttl=$4 work_ms=$5 key=$6
    local line outcome run_id token rest
    vars=(-v job="$job" -v owner="$owner")
    fields=("'mode'" "'run'" "'job'" ":'job'" "'owner'" ":'owner'")

    # \gset sets a psql variable per column, but leaves the variable of a NULL
    # column unset (not empty), and an unset :'token' is sent as the text
    # :'token' itself. So ask :{?token} before using one: only 'started' sets
    # run_id and token, only 'skipped_overlap' holder and holder_expires_at.
    line=$(sql -v job="$job" -v owner="$owner" -v ttl="$ttl seconds" -v key="$key" <<'SQL'
SELECT outcome, run_id, token, holder, to_json(holder_expires_at) #>> '{}' AS holder_expires_at
  FROM ledger.start_run(job => :'job', owner => :'owner', ttl => :'ttl', idempotency_key => nullif(:'key', ''))
\gset
\if :{?token}
\echo :outcome :run_id :token
\elif :{?holder}
\echo :outcome :holder_expires_at :holder
\else
\echo :outcome
\endif
SQL
    )
    read -r outcome run_id token rest <<<"$line"
    vars+=(-v outcome="$outcome")
    fields+=("'outcome'" ":'outcome'")
    case $outcome in
    started) ;;
    skipped_overlap)  # another owner's lease is live: not a failure, try at the next tick
        vars+=(-v holder_expires_at="$run_id" -v holder="$token${rest:+ $rest}")
        fields+=("'run_id'" "NULL" "'token'" "NULL" "'wrote'" "false" "'heartbeats'" "0" "'error'" "NULL"
                 "'holder'" ":'holder'" "'holder_expires_at'" ":'holder_expires_at'")
        emit
        return ;;
    already_done | paused)  # this slot or key already succeeded (or runs); the job is paused
        fields+=("'run_id'" "NULL" "'token'" "NULL" "'wrote'" "false" "'heartbeats'" "0" "'error'" "NULL")
        emit
        return ;;
    *) echo "unexpected outcome: $line" >&2; exit 1 ;;
    esac
    # run_id and token are bigint: bash's integers are 64-bit, and here they
    # are never computed with, only passed on as text.
    vars+=(-v run_id="$run_id" -v token="$token")
    fields+=("'run_id'" ":'run_id'" "'token'" ":'token'")

    # The job's real work goes here (a sleep), in the background so that the
    # heartbeats can stop it when the lease is lost.
    local every work_pid beats_pid wrote=false error=()
    every=$(seconds $((ttl * 1000 / 3)))
    : >"$tmp/beats"
    sleep "$(seconds "$work_ms")" & work_pid=$!
    heartbeats "$work_pid" & beats_pid=$!
    wait "$work_pid" || true
    if [ -e "$tmp/lost" ]; then
        error_vars error "$tmp/lost.err"
    elif fenced_write "$job" "$resource" "$token" "$owner" "$tmp/write.err"; then
        wrote=true
    else
        error_vars error "$tmp/write.err"
    fi
    kill -TERM "$beats_pid" 2>/dev/null || true
    wait "$beats_pid" || true
    fields+=("'wrote'" "$wrote" "'heartbeats'" "$(wc -l <"$tmp/beats")")

    if [ "$wrote" = true ]; then
        fields+=("'error'" "NULL")
        end_run "$run_id" "$token" "$tmp/end.err" || { error_vars end_error "$tmp/end.err"
            fields+=("'end_error'" "$(error_json end_error)"); }
    else
        fields+=("'error'" "$(error_json error)")
        # The failure recorded as 'SQLSTATE: message'.
        end_run "$run_id" "$token" "$tmp/end.err" "${err_code:-error}: $err_message" || {
            error_vars end_error "$tmp/end.err"
            fields+=("'end_error'" "$(error_json end_error)"); }
    fi
    emit
}

# A process that slept through its lease wakes up and writes with the token
# it had. The fence refuses it (LD001) and its row is rolled back; ending the
# run is refused as well.
zombie_mode() {
    local job=$1 owner=$2 run_id=$3 token=$4 wrote=false
    vars=(-v job="$job" -v owner="$owner" -v run_id="$run_id" -v token="$token")
    fields=("'mode'" "'zombie'" "'job'" ":'job'" "'owner'" ":'owner'" "'run_id'" ":'run_id'" "'token'" ":'token'")
    if fenced_write "$job" "$(resource_of "$job")" "$token" "$owner" "$tmp/write.err"; then
        fields+=("'wrote'" "true" "'error'" "NULL")
    else
        error_vars error "$tmp/write.err"
        fields+=("'wrote'" "false" "'error'" "$(error_json error)")
        if [[ $err_detail == "{"* ]]; then
            # What a cron script logs: a field of the DETAIL, read by psql as
            # text, exact at any size (jq 1.6 would print 2^53 + 1 as 2^53).
            echo "refused ($err_code): token $token; the job's current token is" \
                "$(sql -v detail="$err_detail" <<<"SELECT (:'detail'::jsonb) ->> 'current_token';")" >&2
        fi
    fi
    end_run "$run_id" "$token" "$tmp/end.err" || { error_vars end_error "$tmp/end.err"
        fields+=("'end_error'" "$(error_json end_error)"); }
    emit
}

# Acquire the job's lease COUNT times (each acquire issues a new, greater
# token) and find the newest token: with bash's 64-bit integers, and wrongly
# by comparing the strings.
tokens_mode() {
    local job=$1 owner=$2 count=$3 tokens newest=0 naive="" t current
    tokens=$(for ((i = 0; i < count; i++)); do
        echo "SELECT token FROM ledger.acquire(job => :'job', owner => :'owner', ttl => '1 minute');"
    done | sql -v job="$job" -v owner="$owner")
    [ "$(wc -l <<<"$tokens")" -eq "$count" ] || { echo "job $job is held by another owner" >&2; exit 1; }
    for t in $tokens; do
        ((t > newest)) && newest=$t       # 10 > 9: right
        [[ $t > $naive ]] && naive=$t     # "9" > "10": wrong
    done
    current=$(sql -v job="$job" -v owner="$owner" -v token="$newest" <<'SQL'
SELECT ledger.is_current(job => :'job', token => :'token') AS current \gset
SELECT ledger.release(job => :'job', owner => :'owner', token => :'token') \g /dev/null
\echo :current
SQL
    )
    vars=(-v job="$job" -v owner="$owner" -v tokens="${tokens//$'\n'/ }" -v newest="$newest" -v naive="$naive"
          -v current="$current")
    # 2^53 + 1 as a bigint, and what a double makes of it: float8 here, as a
    # JavaScript Number, awk, or jq 1.6 reading a DETAIL (echo '{"t":
    # 9007199254740993}' | jq .t prints 9007199254740992). Read such numbers
    # with psql, (:'detail'::jsonb) ->> 'current_token', or as text.
    fields=("'mode'" "'tokens'" "'job'" ":'job'" "'owner'" ":'owner'"
            "'tokens'" "to_json(string_to_array(:'tokens', ' '))" "'newest'" ":'newest'"
            "'naive_string_newest'" ":'naive'" "'newest_was_current'" ":'current'::boolean"
            "'beyond_2_53'" "json_build_object('bigint', 9007199254740993::bigint::text, 'number', 9007199254740993::bigint::float8::text::numeric::text)")
    emit
}

[ $# -ge 3 ] || usage
mode=$1
shift
case $mode in
run)
    resource="" ttl=30 work_ms=0 key="" args=()
    for arg; do
        case $arg in
        --resource=*) resource=${arg#*=} ;;
        --ttl=*) ttl=${arg#*=} ;;
        --work-ms=*) work_ms=${arg#*=} ;;
        --key=*) key=${arg#*=} ;;
        --*) usage ;;
        *) args+=("$arg") ;;
        esac
    done
    [ ${#args[@]} -eq 2 ] || usage
    [[ $ttl =~ ^[0-9]+$ && $work_ms =~ ^[0-9]+$ ]] || { echo "--ttl and --work-ms are whole numbers here" >&2; exit 64; }
    run_mode "${args[0]}" "${args[1]}" "${resource:-$(resource_of "${args[0]}")}" "$ttl" "$work_ms" "$key" ;;
zombie)
    [ $# -eq 4 ] || usage
    zombie_mode "$@" ;;
tokens)
    [ $# -le 3 ] || usage
    [[ ${3:-10} =~ ^[0-9]+$ ]] || usage
    tokens_mode "$1" "$2" "${3:-10}" ;;
*) usage ;;
esac
