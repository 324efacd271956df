// The job ledger from Go with database/sql and lib/pq (github.com/lib/pq): the
// ledger's whole API is SQL functions, so any client that can run a query can
// use it.
//
//	LEDGER_DSN=postgres://user@host:5432/db ./build/ledger-libpq run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
//	./build/ledger-libpq zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
//	./build/ledger-libpq tokens <job> <owner> [count]            # tokens as int64, not as strings
//	./build/ledger-libpq guarded <job> <owner>                   # CALL ledger.run_guarded inside a transaction, then in autocommit
//
// Built offline from Debian's packages (golang, golang-github-lib-pq-dev), in
// GOPATH mode: build.sh. Without LEDGER_DSN, lib/pq reads PGHOST, PGPORT,
// PGUSER, PGPASSWORD, PGDATABASE. Each mode prints one JSON line saying what
// happened. `run` and `zombie` write into a table the caller created:
//
//	CREATE TABLE fenced_writes (token bigint, written_by text)
//
// BEHIND A TRANSACTION POOLER (PgBouncer pool_mode=transaction) add
// binary_parameters=yes to the DSN. By default lib/pq sends a query with
// parameters in two round trips, Parse+Describe+Sync and then Bind+Execute+
// Sync: outside a transaction the pooler may hand the second to another
// server connection, where the unnamed statement is not ours (an error, or
// another client's statement run with our parameters). With
// binary_parameters=yes lib/pq sends Parse, Bind and Execute at once.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"
)

const tableInsert = "INSERT INTO fenced_writes (token, written_by) VALUES ($1, $2)"

// The fence's resource name. Tokens count per job, so a resource belongs to
// the first job that fenced it (another job gets LD006): one per job.
func resourceOf(job string) string { return "fenced_writes:" + job }

var ctx = context.Background()

// A *sql.DB is a pool: each statement may run on any of its connections. The
// example takes dedicated connections from it (db.Conn) so that the ledger's
// calls and the application's transaction are on connections of their own.
// database/sql runs every statement outside BeginTx in autocommit: each
// ledger call is its own transaction.
func open() (*sql.DB, error) {
	// application_name as a startup parameter, from PGAPPNAME (lib/pq reads
	// it), unless the caller set one: never a SET, which behind a
	// transaction pooler would stick to a shared server connection.
	if os.Getenv("PGAPPNAME") == "" {
		os.Setenv("PGAPPNAME", "ledger-go-libpq-example")
	}
	return sql.Open("postgres", os.Getenv("LEDGER_DSN")) // "" lets lib/pq read the PG* variables
}

// Tokens and run ids are bigint (int8): lib/pq returns them as int64, exact
// at any size; pass int64 back. Never float64 (exact only to 2^53: tokens
// jump by 2^32 at each standby promotion), never compare their text
// ("10" < "9"). The JSON output prints them as decimal strings, as the other
// examples do.
func str(n int64) string { return strconv.FormatInt(n, 10) }

// The ledger's errors are *pq.Error: Code is the SQLSTATE (LD001..LD006 for
// the ledger's own, 22004 for a NULL argument, 22023 for an invalid one) and
// Detail a JSON object of facts (job, token, current_token, holder, ...).
// Decode it with UseNumber: encoding/json otherwise makes every number a
// float64 and rounds a token past 2^53 (so does jq). A json.Number keeps the
// digits: n.Int64() gives the exact token, and it is re-encoded as it came.
func describe(err error) map[string]any {
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) {
		return map[string]any{"code": nil, "message": err.Error(), "detail": nil}
	}
	var detail any = nil
	if pqErr.Detail != "" {
		detail = pqErr.Detail
		if strings.HasPrefix(pqErr.Detail, "{") {
			dec := json.NewDecoder(strings.NewReader(pqErr.Detail))
			dec.UseNumber()
			var facts map[string]any
			if dec.Decode(&facts) == nil {
				detail = facts // not JSON after all: keep the text
			}
		}
	}
	return map[string]any{"code": string(pqErr.Code), "message": pqErr.Message, "detail": detail}
}

// One transaction holds the fence and the application's write: they commit
// together or not at all. The fence raises LD001 when `token` is no longer
// the job's live token (it expired, or another runner took over), LD002 when
// a newer token already wrote to the resource, LD006 when the resource
// belongs to another job; then the INSERT never commits.
func fencedWrite(conn *sql.Conn, job, resource string, token int64, writtenBy string) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() // a no-op once committed
	if _, err := tx.ExecContext(ctx, "SELECT ledger.fence(job => $1, resource => $2, token => $3)", job, resource, token); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, tableInsert, token, writtenBy); err != nil {
		return err
	}
	return tx.Commit()
}

type options struct {
	resource, key string
	ttl, workMs   int64
	hasKey        bool
}

func runMode(db *sql.DB, job, owner string, opt options) (map[string]any, error) {
	result := map[string]any{"mode": "run", "job": job, "owner": owner, "outcome": nil, "run_id": nil,
		"token": nil, "wrote": false, "heartbeats": 0, "error": nil}
	// Two connections: the ledger's calls run in autocommit on one, the
	// application's transaction on the other. A heartbeat must never land
	// inside the application's open transaction (its lease update would stay
	// invisible, and be rolled back with it) nor queue behind a slow query.
	ledger, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer ledger.Close()
	app, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer app.Close()

	// Named notation: the contract names every argument, so a call keeps
	// working when optional arguments are added. lib/pq sends parameters
	// untyped; the ::interval cast says what '30 seconds' is.
	key := sql.NullString{String: opt.key, Valid: opt.hasKey}
	var outcome string
	var runID, token sql.NullInt64
	var holder sql.NullString
	var holderExpires sql.NullTime
	err = ledger.QueryRowContext(ctx, "SELECT outcome, run_id, token, holder, holder_expires_at FROM ledger.start_run("+
		"job => $1, owner => $2, ttl => $3::interval, idempotency_key => $4)",
		job, owner, fmt.Sprintf("%d seconds", opt.ttl), key).Scan(&outcome, &runID, &token, &holder, &holderExpires)
	if err != nil {
		return nil, err
	}
	result["outcome"] = outcome
	switch outcome {
	case "started":
	case "skipped_overlap": // another owner's lease is live: not a failure, try at the next tick
		result["holder"] = nil
		if holder.Valid {
			result["holder"] = holder.String
		}
		// time.Time keeps the server's microseconds.
		result["holder_expires_at"] = nil
		if holderExpires.Valid {
			result["holder_expires_at"] = holderExpires.Time.UTC().Format("2006-01-02T15:04:05.000000Z")
		}
		return result, nil
	case "already_done", "paused": // already succeeded (or running) / the job is paused: do nothing
		return result, nil
	default:
		return nil, fmt.Errorf("unexpected outcome %s", outcome)
	}
	result["run_id"], result["token"] = str(runID.Int64), str(token.Int64)

	// Heartbeat every ttl/3: two beats may be lost before the lease expires.
	// NULL means the lease is lost (expired and taken over, or reaped): stop
	// working, nothing we write from now on would be accepted anyway. While
	// the goroutine beats, only it uses `ledger`.
	lost := make(chan error, 1)
	stop := make(chan struct{})
	done := make(chan int)
	go func() {
		beats := 0
		ticker := time.NewTicker(time.Duration(opt.ttl) * time.Second / 3)
		defer func() { ticker.Stop(); done <- beats }()
		for {
			select {
			case <-stop:
				return
			case <-ticker.C:
				var expires sql.NullTime
				err := ledger.QueryRowContext(ctx, "SELECT ledger.heartbeat(run_id => $1, token => $2)",
					runID.Int64, token.Int64).Scan(&expires)
				if err == nil && !expires.Valid {
					err = errors.New("lease lost: heartbeat returned NULL")
				}
				if err != nil { // LD001/LD003: the run is no longer ours
					lost <- err
					return
				}
				beats++
			}
		}
	}()

	var runErr error
	select {
	case runErr = <-lost: // the heartbeat says the lease is lost: why
	case <-time.After(time.Duration(opt.workMs) * time.Millisecond): // the job's real work goes here
		runErr = fencedWrite(app, job, opt.resource, token.Int64, owner)
		result["wrote"] = runErr == nil
	}
	close(stop)
	result["heartbeats"] = <-done // a heartbeat in flight finishes before the run ends

	// End the run: this also releases the lease. A zombie learns here too
	// that it lost (LD001: a newer token took over; LD003: already closed).
	if runErr == nil {
		_, err = ledger.ExecContext(ctx, "SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)",
			runID.Int64, token.Int64)
	} else {
		e := describe(runErr)
		result["error"] = e
		code := "error"
		if c, ok := e["code"].(string); ok {
			code = c
		}
		_, err = ledger.ExecContext(ctx, "SELECT run_id FROM ledger.fail_run(run_id => $1, token => $2, error => $3)",
			runID.Int64, token.Int64, fmt.Sprintf("%s: %s", code, e["message"]))
	}
	if err != nil {
		result["end_error"] = describe(err)
	}
	return result, nil
}

// A process that slept through its lease wakes up and writes with the token
// it had. The fence refuses it (LD001) and its row is rolled back; ending the
// run is refused as well.
func zombieMode(db *sql.DB, job, owner string, runID, token int64) (map[string]any, error) {
	result := map[string]any{"mode": "zombie", "job": job, "owner": owner, "run_id": str(runID),
		"token": str(token), "wrote": false, "error": nil}
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if err := fencedWrite(conn, job, resourceOf(job), token, owner); err != nil {
		result["error"] = describe(err)
	} else {
		result["wrote"] = true
	}
	if _, err := conn.ExecContext(ctx, "SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)", runID, token); err != nil {
		result["end_error"] = describe(err)
	}
	return result, nil
}

// Acquire the job's lease `count` times (each acquire issues a new, greater
// token) and find the newest token, once as int64 and once as strings.
func tokensMode(db *sql.DB, job, owner string, count int) (map[string]any, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var tokens []int64
	var texts, printed []string
	for i := 0; i < count; i++ {
		var token int64
		var text string
		err := conn.QueryRowContext(ctx, "SELECT token, token::text FROM ledger.acquire(job => $1, owner => $2, ttl => '1 minute')",
			job, owner).Scan(&token, &text)
		if errors.Is(err, sql.ErrNoRows) {
			return nil, fmt.Errorf("job %s is held by another owner", job)
		} else if err != nil {
			return nil, err
		}
		tokens, texts, printed = append(tokens, token), append(texts, text), append(printed, str(token))
	}
	newest, naive := tokens[0], texts[0]
	for i := range tokens {
		if tokens[i] > newest { // 10 > 9: right
			newest = tokens[i]
		}
		if texts[i] > naive { // "9" > "10": wrong
			naive = texts[i]
		}
	}
	var current bool
	if err := conn.QueryRowContext(ctx, "SELECT ledger.is_current(job => $1, token => $2)", job, newest).Scan(&current); err != nil {
		return nil, err
	}
	if _, err := conn.ExecContext(ctx, "SELECT ledger.release(job => $1, owner => $2, token => $3)", job, owner, newest); err != nil {
		return nil, err
	}
	// And why not float64: past 2^53 it rounds, int64 stays exact.
	var big int64
	var bigText string
	if err := conn.QueryRowContext(ctx, "SELECT 9007199254740993::bigint, 9007199254740993::text").Scan(&big, &bigText); err != nil {
		return nil, err
	}
	asFloat, _ := strconv.ParseFloat(bigText, 64)
	return map[string]any{"mode": "tokens", "job": job, "owner": owner, "tokens": printed, "newest": str(newest),
		"naive_string_newest": naive, "newest_was_current": current,
		"beyond_2_53": map[string]any{"bigint": str(big), "number": strconv.FormatFloat(asFloat, 'f', -1, 64)}}, nil
}

// ledger.run_guarded is a procedure that COMMITs: CALL it in autocommit.
// lib/pq sends a statement with parameters on the extended protocol (a
// portal), so inside a transaction the procedure cannot tell in advance and
// PostgreSQL refuses its first COMMIT with 2D000
// (invalid_transaction_termination), before it did anything. A CALL without
// parameters goes on the simple protocol, and is refused with 25001.
const guardedCommand = "INSERT INTO fenced_writes (token, written_by) " +
	"SELECT ledger.fence(job => current_setting('ledger.job'), resource => 'fenced_writes:' || current_setting('ledger.job'), " +
	"token => current_setting('ledger.token')::bigint), current_setting('ledger.owner')"

func guardedMode(db *sql.DB, job, owner string) (map[string]any, error) {
	call := "CALL ledger.run_guarded(job => $1, command => $2, owner => $3, ttl => '1 minute')"
	result := map[string]any{"mode": "guarded", "job": job, "owner": owner, "in_transaction": nil, "autocommit": nil}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, call, job, guardedCommand, owner); err != nil {
		result["in_transaction"] = describe(err)
	}
	_ = tx.Rollback()
	if _, err := db.ExecContext(ctx, call, job, guardedCommand, owner); err != nil {
		result["autocommit"] = describe(err)
	}
	return result, nil
}

func usage() {
	fmt.Fprint(os.Stderr, "usage: ledger-libpq run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]\n"+
		"       ledger-libpq zombie <job> <owner> <run_id> <token>\n"+
		"       ledger-libpq tokens <job> <owner> [count]\n"+
		"       ledger-libpq guarded <job> <owner>\n")
	os.Exit(64)
}

func main() {
	var args []string
	opt := options{ttl: 30}
	for _, a := range os.Args[1:] {
		name, value, isOpt := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !isOpt {
			args = append(args, a)
			continue
		}
		var err error
		switch name {
		case "resource":
			opt.resource = value
		case "key":
			opt.key, opt.hasKey = value, true
		case "ttl":
			opt.ttl, err = strconv.ParseInt(value, 10, 64)
		case "work-ms":
			opt.workMs, err = strconv.ParseInt(value, 10, 64)
		default:
			usage()
		}
		if err != nil {
			usage()
		}
	}
	if len(args) < 3 {
		usage()
	}
	mode, job, owner := args[0], args[1], args[2]
	if opt.resource == "" {
		opt.resource = resourceOf(job)
	}
	db, err := open()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer db.Close()
	var result map[string]any
	switch mode {
	case "run":
		result, err = runMode(db, job, owner, opt)
	case "zombie":
		if len(args) < 5 {
			usage()
		}
		runID, err1 := strconv.ParseInt(args[3], 10, 64)
		token, err2 := strconv.ParseInt(args[4], 10, 64)
		if err1 != nil || err2 != nil {
			usage()
		}
		result, err = zombieMode(db, job, owner, runID, token)
	case "tokens":
		count := 10
		if len(args) > 3 {
			if count, err = strconv.Atoi(args[3]); err != nil {
				usage()
			}
		}
		result, err = tokensMode(db, job, owner, count)
	case "guarded":
		result, err = guardedMode(db, job, owner)
	default:
		usage()
	}
	if err == nil {
		err = json.NewEncoder(os.Stdout).Encode(result) // one line, with its newline
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
