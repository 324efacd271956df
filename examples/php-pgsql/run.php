<?php
// The job ledger from PHP with the pgsql extension (on libpq): the ledger's
// whole API is SQL functions, so any client that can run a query can use it.
//
//   LEDGER_DSN=postgres://user@host:5432/db php run.php run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
//   php run.php zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
//   php run.php tokens <job> <owner> [count]            # int8 comes as a string: (int) it
//   php run.php guarded <job> <owner>                   # CALL ledger.run_guarded inside a transaction, then in autocommit
//
// Debian: php-cli, php-pgsql. Without LEDGER_DSN, libpq reads PGHOST, PGPORT,
// PGUSER, PGPASSWORD, PGDATABASE. Each mode prints one JSON line saying what
// happened. `run` and `zombie` write into a table the caller created:
//   CREATE TABLE fenced_writes (token bigint, written_by text)
//
// Behind a transaction pooler (PgBouncer pool_mode=transaction) nothing needs
// setting: pg_query_params sends Parse, Bind and Execute of the unnamed
// statement in one round trip (libpq's PQexecParams). Do not use pg_prepare
// (a named statement lives on one server connection) nor a session SET.
declare(strict_types=1);

const TABLE_INSERT = 'INSERT INTO fenced_writes (token, written_by) VALUES ($1, $2)';

// The fence's resource name. Tokens count per job, so a resource belongs to
// the first job that fenced it (another job gets LD006): one per job.
function resource_of(string $job): string
{
    return "fenced_writes:$job";
}

// Tokens and run ids are bigint (int8), and the pgsql extension returns every
// column as a string. Convert with (int): a PHP int is 64-bit on every 64-bit
// build, exactly int8's range (a 32-bit PHP would need GMP or bcmath strings).
// Never (float): exact only to 2^53, and tokens jump by 2^32 at each standby
// promotion. And never compare them as strings: PHP's < and > happen to
// compare two numeric strings as numbers, but strcmp, sort(SORT_STRING) and
// string keys do not, and there "9" > "10". An int goes back as a query
// parameter as its decimal text. For JSON, print it as a string, as the other
// examples do.
if (PHP_INT_SIZE !== 8) {
    fwrite(STDERR, "this example needs a 64-bit PHP (PHP_INT_SIZE 8) for bigint tokens\n");
    exit(1);
}

function int8(?string $value): ?int
{
    return $value === null ? null : (int) $value;
}

// A ledger error: the SQLSTATE (LD001..LD006 for the ledger's own, 22004 for
// a NULL argument, 22023 for an invalid one), the message, and the DETAIL, a
// JSON object of facts (job, token, current_token, holder, ...).
final class DbError extends RuntimeException
{
    public function __construct(public readonly ?string $sqlstate, string $message, public readonly ?string $detail)
    {
        parent::__construct($message);
    }
}

// pg_query_params() answers an error with false and a warning: the SQLSTATE
// and the DETAIL are lost. pg_send_query_params() and pg_get_result() keep
// the failed result, and pg_result_error_field() reads its fields.
function query(PgSql\Connection $conn, string $sql, array $params = []): PgSql\Result
{
    if (!pg_send_query_params($conn, $sql, $params)) {
        throw new DbError(null, pg_last_error($conn), null);
    }
    $result = null;
    while (($next = pg_get_result($conn)) !== false) { // read every result, keep the last
        $result = $next;
    }
    $status = pg_result_status($result);
    if ($status === PGSQL_FATAL_ERROR || $status === PGSQL_BAD_RESPONSE || $status === PGSQL_NONFATAL_ERROR) {
        $detail = pg_result_error_field($result, PGSQL_DIAG_MESSAGE_DETAIL);
        throw new DbError(pg_result_error_field($result, PGSQL_DIAG_SQLSTATE) ?: null,
            (string) pg_result_error_field($result, PGSQL_DIAG_MESSAGE_PRIMARY),
            $detail === false ? null : $detail);
    }
    return $result;
}

// json_decode gives JSON integers as int (exact within 64 bits);
// JSON_BIGINT_AS_STRING makes a larger one a string instead of a rounded
// float. Objects stay objects (an empty {} stays {}).
function describe(Throwable $err): array
{
    if (!$err instanceof DbError) {
        return ['code' => null, 'message' => $err->getMessage(), 'detail' => null];
    }
    $detail = $err->detail;
    if ($detail !== null && str_starts_with($detail, '{')) {
        $parsed = json_decode($detail, false, 512, JSON_BIGINT_AS_STRING);
        if ($parsed !== null) {
            $detail = $parsed; // else: not JSON after all, keep the text
        }
    }
    return ['code' => $err->sqlstate, 'message' => $err->getMessage(), 'detail' => $detail];
}

// libpq runs every statement outside BEGIN in autocommit: each ledger call is
// its own transaction. pg_connect() hands back the SAME connection for the
// same connection string: PGSQL_CONNECT_FORCE_NEW opens a connection of its own.
function connect(): PgSql\Connection
{
    if (getenv('PGAPPNAME') === false) {
        putenv('PGAPPNAME=ledger-php-example'); // libpq reads it; LEDGER_DSN may be a URI
    }
    $dsn = getenv('LEDGER_DSN') ?: '';
    $conn = pg_connect($dsn, PGSQL_CONNECT_FORCE_NEW);
    if ($conn === false) {
        throw new RuntimeException('cannot connect to PostgreSQL');
    }
    return $conn;
}

// One transaction holds the fence and the application's write: they commit
// together or not at all. The fence raises LD001 when `token` is no longer the
// job's live token (it expired, or another runner took over), LD002 when a
// newer token already wrote to the resource, LD006 when the resource belongs
// to another job; then the INSERT never commits.
function fenced_write(PgSql\Connection $conn, string $job, string $resource, int $token, string $writtenBy): void
{
    query($conn, 'BEGIN');
    try {
        query($conn, 'SELECT ledger.fence(job => $1, resource => $2, token => $3)', [$job, $resource, $token]);
        query($conn, TABLE_INSERT, [$token, $writtenBy]);
        query($conn, 'COMMIT');
    } catch (Throwable $err) {
        query($conn, 'ROLLBACK');
        throw $err;
    }
}

function iso_utc(?string $timestamptz): ?string
{
    // timestamptz comes as text with microseconds ("2024-06-01 02:00:00.123456+00").
    return $timestamptz === null ? null
        : (new DateTimeImmutable($timestamptz))->setTimezone(new DateTimeZone('UTC'))->format('Y-m-d\TH:i:s.u\Z');
}

function run_mode(string $job, string $owner, array $opts): array
{
    $resource = $opts['resource'] ?? resource_of($job);
    $ttl = (int) ($opts['ttl'] ?? '30');
    $workMs = (int) ($opts['work-ms'] ?? '0');
    $result = ['mode' => 'run', 'job' => $job, 'owner' => $owner, 'outcome' => null, 'run_id' => null,
        'token' => null, 'wrote' => false, 'heartbeats' => 0, 'error' => null];
    // Two connections: the ledger's calls run in autocommit on one, the
    // application's transaction on the other. A heartbeat must never land
    // inside the application's open transaction (its lease update would stay
    // invisible, and be rolled back with it).
    $ledger = connect();
    $app = connect();
    try {
        // Named notation: the contract names every argument, so a call keeps
        // working when optional arguments are added. Parameters go untyped;
        // the server reads '30 seconds' as the interval the function takes.
        $start = pg_fetch_assoc(query($ledger,
            'SELECT outcome, run_id, token, holder, holder_expires_at FROM ledger.start_run('
            . 'job => $1, owner => $2, ttl => $3, idempotency_key => $4)',
            [$job, $owner, "$ttl seconds", $opts['key'] ?? null]));
        $result['outcome'] = $start['outcome'];
        switch ($start['outcome']) {
            case 'started':
                break;
            case 'skipped_overlap': // another owner's lease is live: not a failure, try at the next tick
                $result['holder'] = $start['holder'];
                $result['holder_expires_at'] = iso_utc($start['holder_expires_at']);
                return $result;
            case 'already_done': // this slot or idempotency key already succeeded (or is running)
            case 'paused': // the job is paused: do nothing
                return $result;
            default:
                throw new RuntimeException("unexpected outcome {$start['outcome']}");
        }
        $runId = int8($start['run_id']);
        $token = int8($start['token']);
        $result['run_id'] = (string) $runId;
        $result['token'] = (string) $token;

        // PHP has no threads: the work is done in slices, with a heartbeat
        // every ttl/3 between them (two beats may be lost before the lease
        // expires). NULL means the lease is lost (expired and taken over, or
        // reaped): stop working, nothing we write from now on would be
        // accepted anyway.
        try {
            $period = $ttl / 3.0;
            $now = microtime(true);
            $deadline = $now + $workMs / 1000.0;
            $nextBeat = $now + $period;
            while (($now = microtime(true)) < $deadline) {
                usleep((int) (1e6 * (min($deadline, $nextBeat) - $now))); // a slice of the job's real work
                if (microtime(true) >= $nextBeat) {
                    $nextBeat += $period;
                    $row = pg_fetch_assoc(query($ledger, 'SELECT ledger.heartbeat(run_id => $1, token => $2) AS expires_at',
                        [$runId, $token])); // LD001/LD003: the run is no longer ours
                    if ($row['expires_at'] === null) {
                        throw new RuntimeException('lease lost: heartbeat returned NULL');
                    }
                    $result['heartbeats'] += 1;
                }
            }
            fenced_write($app, $job, $resource, $token, $owner);
            $result['wrote'] = true;
        } catch (Throwable $err) {
            $result['error'] = describe($err); // any failure of the work fails the run
        }

        // End the run: this also releases the lease. A zombie learns here too
        // that it lost (LD001: a newer token took over; LD003: already closed).
        try {
            if ($result['error'] === null) {
                query($ledger, 'SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)', [$runId, $token]);
            } else {
                query($ledger, 'SELECT run_id FROM ledger.fail_run(run_id => $1, token => $2, error => $3)',
                    [$runId, $token, ($result['error']['code'] ?? 'error') . ': ' . $result['error']['message']]);
            }
        } catch (DbError $err) {
            $result['end_error'] = describe($err);
        }
        return $result;
    } finally {
        pg_close($ledger);
        pg_close($app);
    }
}

// A process that slept through its lease wakes up and writes with the token it
// had. The fence refuses it (LD001) and its row is rolled back; ending the run
// is refused as well.
function zombie_mode(string $job, string $owner, string $runId, string $token): array
{
    $result = ['mode' => 'zombie', 'job' => $job, 'owner' => $owner, 'run_id' => $runId, 'token' => $token,
        'wrote' => false, 'error' => null];
    $conn = connect();
    try {
        try {
            fenced_write($conn, $job, resource_of($job), (int) $token, $owner);
            $result['wrote'] = true;
        } catch (DbError $err) {
            $result['error'] = describe($err);
        }
        try {
            query($conn, 'SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)', [(int) $runId, (int) $token]);
        } catch (DbError $err) {
            $result['end_error'] = describe($err);
        }
        return $result;
    } finally {
        pg_close($conn);
    }
}

// Acquire the job's lease `count` times (each acquire issues a new, greater
// token) and find the newest token, once as int and once as the strings the
// extension returns, compared as strings.
function tokens_mode(string $job, string $owner, string $count = '10'): array
{
    $conn = connect();
    try {
        $texts = [];
        for ($i = 0; $i < (int) $count; $i++) {
            $row = pg_fetch_assoc(query($conn, "SELECT token FROM ledger.acquire(job => \$1, owner => \$2, ttl => '1 minute')",
                [$job, $owner]));
            if ($row === false) {
                throw new RuntimeException("job $job is held by another owner");
            }
            $texts[] = $row['token']; // a string
        }
        $tokens = array_map('int8', $texts);
        $newest = max($tokens); // 10 > 9: right
        $naive = array_reduce($texts, fn ($a, $b) => ($a === null || strcmp($b, $a) > 0) ? $b : $a); // "9" > "10": wrong
        // Pass the int back as a parameter: the server compares bigints.
        $current = pg_fetch_assoc(query($conn, 'SELECT ledger.is_current(job => $1, token => $2) AS ok', [$job, $newest]))['ok'] === 't';
        query($conn, 'SELECT ledger.release(job => $1, owner => $2, token => $3)', [$job, $owner, $newest]);
        // And why not float: past 2^53 it rounds, int stays exact.
        $big = pg_fetch_assoc(query($conn, 'SELECT 9007199254740993::bigint AS b'))['b'];
        return ['mode' => 'tokens', 'job' => $job, 'owner' => $owner, 'tokens' => array_map('strval', $tokens),
            'newest' => (string) $newest, 'naive_string_newest' => $naive, 'newest_was_current' => $current,
            'beyond_2_53' => ['bigint' => (string) int8($big), 'number' => (string) (int) (float) $big]];
    } finally {
        pg_close($conn);
    }
}

// ledger.run_guarded is a procedure that COMMITs: CALL it in autocommit.
// pg_query_params (and pg_send_query_params) go on the extended protocol (a
// portal), so inside a transaction the procedure cannot tell in advance and
// PostgreSQL refuses its first COMMIT with 2D000
// (invalid_transaction_termination), before it did anything; pg_query of a
// CALL without parameters goes on the simple protocol and is refused with 25001.
const GUARDED_COMMAND = 'INSERT INTO fenced_writes (token, written_by) '
    . "SELECT ledger.fence(job => current_setting('ledger.job'), resource => 'fenced_writes:' || current_setting('ledger.job'), "
    . "token => current_setting('ledger.token')::bigint), current_setting('ledger.owner')";

function guarded_mode(string $job, string $owner): array
{
    $call = "CALL ledger.run_guarded(job => \$1, command => \$2, owner => \$3, ttl => '1 minute')";
    $result = ['mode' => 'guarded', 'job' => $job, 'owner' => $owner, 'in_transaction' => null, 'autocommit' => null];
    $conn = connect();
    try {
        query($conn, 'BEGIN');
        try {
            query($conn, $call, [$job, GUARDED_COMMAND, $owner]);
        } catch (DbError $err) {
            $result['in_transaction'] = describe($err);
        } finally {
            query($conn, 'ROLLBACK');
        }
        try {
            query($conn, $call, [$job, GUARDED_COMMAND, $owner]);
        } catch (DbError $err) {
            $result['autocommit'] = describe($err);
        }
        return $result;
    } finally {
        pg_close($conn);
    }
}

$opts = [];
$args = [];
foreach (array_slice($argv, 1) as $a) {
    if (preg_match('/\A--([a-z-]+)=(.*)\z/s', $a, $m)) {
        $opts[$m[1]] = $m[2];
    } else {
        $args[] = $a;
    }
}
$mode = $args[0] ?? null;
$rest = array_slice($args, 1);
$modes = [
    'run' => fn () => run_mode($rest[0], $rest[1], $opts),
    'zombie' => fn () => zombie_mode(...array_slice($rest, 0, 4)),
    'tokens' => fn () => tokens_mode(...array_slice($rest, 0, 3)),
    'guarded' => fn () => guarded_mode($rest[0], $rest[1]),
];
if (!isset($modes[$mode]) || count($rest) < 2 || ($mode === 'zombie' && count($rest) < 4)) {
    fwrite(STDERR, "usage: php run.php run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]\n"
        . "       php run.php zombie <job> <owner> <run_id> <token>\n"
        . "       php run.php tokens <job> <owner> [count]\n"
        . "       php run.php guarded <job> <owner>\n");
    exit(64);
}
try {
    echo json_encode($modes[$mode](), JSON_THROW_ON_ERROR | JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE), "\n";
} catch (Throwable $err) {
    fwrite(STDERR, $err . "\n");
    exit(1);
}
