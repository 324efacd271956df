// The job ledger from Node.js with node-postgres (`pg`): the ledger's whole
// API is SQL functions, so any client that can run a query can use it.
//
//   LEDGER_DSN=postgres://user@host:5432/db node run.mjs run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
//   node run.mjs zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
//   node run.mjs tokens <job> <owner> [count]            # why bigint tokens need BigInt
//
// Without LEDGER_DSN, `pg` reads PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE.
// Each mode prints one JSON line saying what happened. `run` and `zombie`
// write into a table the caller created:
//   CREATE TABLE fenced_writes (token bigint, written_by text)
import { parseArgs } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';

// Tokens and run ids are bigint (int8, type OID 20). node-postgres returns
// int8 as a *string*, because a JS Number is exact only up to 2^53 - 1. Strings
// compare as text, which is wrong for numbers: "10" < "9". Tokens jump by
// 2^32 at each standby promotion, so they do get large. Parse them as BigInt:
// exact at any size and compared numerically (10n > 9n). This applies to every
// int8 column, count(*) included. BigInt goes back to `pg` as a query
// parameter as is (it is sent as its decimal text); for JSON, print it as a
// string (JSON.stringify throws on BigInt).
pg.types.setTypeParser(pg.types.builtins.INT8, BigInt);

const connectionString = process.env.LEDGER_DSN || undefined;
const TABLE_INSERT = 'INSERT INTO fenced_writes (token, written_by) VALUES ($1, $2)';
// The fence's resource name. Tokens count per job, so a resource belongs to
// the first job that fenced it (another job gets LD006): one per job.
const resourceOf = (job) => `fenced_writes:${job}`;

async function connect() {
  const client = new pg.Client({ connectionString, application_name: 'ledger-node-example' });
  await client.connect();
  return client;
}

function print(result) {
  const json = JSON.stringify(result, (_, v) => (typeof v === 'bigint' ? v.toString() : v));
  process.stdout.write(json + '\n');
}

// The ledger's errors: err.code is the SQLSTATE (LD001..LD006 for the
// ledger's own, 22004 for a NULL argument, 22023 for an invalid one) and
// err.detail a JSON object of facts (job, token, current_token, holder, ...).
// JSON.parse makes every number a Number, which rounds integers past 2^53
// (about two million promotions away, but a token can get there): parseExact
// keeps those as their decimal strings. Use BigInt(detail.current_token),
// exact for both, to compare one with a token.
const JSON_TOKENS = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g;
const parseExact = (text) => JSON.parse(text.replace(JSON_TOKENS, (t) => (
  t[0] !== '"' && /^-?\d+$/.test(t) && !Number.isSafeInteger(Number(t)) ? `"${t}"` : t)));

function describe(err) {
  if (!(err instanceof pg.DatabaseError)) return { code: null, message: String(err?.message ?? err), detail: null };
  let detail = err.detail ?? null;
  if (detail?.startsWith('{')) {
    try {
      detail = parseExact(detail);
    } catch {
      // not JSON after all: keep the text
    }
  }
  return { code: err.code, message: err.message, detail };
}

// One transaction holds the fence and the application's write: they commit
// together or not at all. The fence raises LD001 when `token` is no longer
// the job's live token (it expired, or another runner took over), LD002 when
// a newer token already wrote to the resource, LD006 when the resource
// belongs to another job; then the INSERT never commits.
async function fencedWrite(client, job, resource, token, writtenBy) {
  await client.query('BEGIN');
  try {
    await client.query('SELECT ledger.fence(job => $1, resource => $2, token => $3)', [job, resource, token]);
    await client.query(TABLE_INSERT, [token, writtenBy]);
    await client.query('COMMIT');
  } catch (err) {
    await client.query('ROLLBACK');
    throw err;
  }
}

async function runMode(job, owner, { resource = resourceOf(job), ttl = '30', 'work-ms': workMs = '0', key } = {}) {
  const ttlSeconds = Number(ttl);
  const result = { mode: 'run', job, owner, outcome: null, run_id: null, token: null, wrote: false, heartbeats: 0, error: null };
  // Two connections: the ledger's calls run in autocommit on one, the
  // application's transaction on the other. A heartbeat must never land
  // inside the application's open transaction (its lease update would stay
  // invisible, and be rolled back with it) nor queue behind a slow query.
  const ledger = await connect();
  const app = await connect();
  try {
    // Named notation: the contract names every argument, so a call keeps
    // working when optional arguments are added. ttl is an interval; its text
    // form ('30 seconds') is cast by the server.
    const { rows: [start] } = await ledger.query(
      'SELECT * FROM ledger.start_run(job => $1, owner => $2, ttl => $3, idempotency_key => $4)',
      [job, owner, `${ttlSeconds} seconds`, key ?? null]);
    result.outcome = start.outcome;
    switch (start.outcome) {
      case 'started':
        break;
      case 'skipped_overlap': // another owner's lease is live: not a failure, try at the next tick
        result.holder = start.holder;
        // timestamptz comes back as a Date, cut to milliseconds (the server
        // keeps microseconds): select `holder_expires_at::text` for the exact value.
        result.holder_expires_at = start.holder_expires_at;
        return result;
      case 'already_done': // this slot or idempotency key already succeeded (or is running)
      case 'paused': // the job is paused: do nothing
        return result;
      default:
        throw new Error(`unexpected outcome ${start.outcome}`);
    }
    const { run_id: runId, token } = start; // both BigInt
    result.run_id = runId;
    result.token = token;

    // Heartbeat every ttl/3: two beats may be lost before the lease expires.
    // NULL means the lease is lost (expired and taken over, or reaped): stop
    // working, nothing we write from now on would be accepted anyway.
    const lost = new AbortController();
    let beat = Promise.resolve();
    const timer = setInterval(() => {
      beat = ledger.query('SELECT ledger.heartbeat(run_id => $1, token => $2) AS expires_at', [runId, token])
        .then(({ rows: [row] }) => {
          if (row.expires_at === null) lost.abort(new Error('lease lost: heartbeat returned NULL'));
          else result.heartbeats += 1;
        })
        .catch((err) => lost.abort(err)); // LD001/LD003: the run is no longer ours
    }, (ttlSeconds * 1000) / 3);

    try {
      await sleep(Number(workMs), undefined, { signal: lost.signal }); // the job's real work goes here
      await fencedWrite(app, job, resource, token, owner);
      result.wrote = true;
    } catch (err) {
      // Any failure of the work fails the run. Aborted by the heartbeat:
      // report why the lease was lost.
      result.error = describe(lost.signal.aborted && err.name === 'AbortError' ? lost.signal.reason : err);
    } finally {
      clearInterval(timer);
      await beat; // let a heartbeat in flight finish before the run ends
    }

    // End the run: this also releases the lease. A zombie learns here too
    // that it lost (LD001: a newer token took over; LD003: already closed).
    try {
      if (result.error === null) {
        await ledger.query('SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)', [runId, token]);
      } else {
        await ledger.query('SELECT run_id FROM ledger.fail_run(run_id => $1, token => $2, error => $3)',
          [runId, token, `${result.error.code ?? 'error'}: ${result.error.message}`]);
      }
    } catch (err) {
      result.end_error = describe(err);
    }
    return result;
  } finally {
    await Promise.all([ledger.end(), app.end()]);
  }
}

// A process that slept through its lease wakes up and writes with the token
// it had. The fence refuses it (LD001) and its row is rolled back; ending the
// run is refused as well.
async function zombieMode(job, owner, runId, token) {
  const result = { mode: 'zombie', job, owner, run_id: runId, token, wrote: false, error: null };
  const client = await connect();
  try {
    try {
      await fencedWrite(client, job, resourceOf(job), BigInt(token), owner);
      result.wrote = true;
    } catch (err) {
      result.error = describe(err);
    }
    try {
      await client.query('SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)', [BigInt(runId), BigInt(token)]);
    } catch (err) {
      result.end_error = describe(err);
    }
    return result;
  } finally {
    await client.end();
  }
}

// Acquire the job's lease `count` times (each acquire issues a new, greater
// token) and find the newest token, once as BigInt and once as the strings
// node-postgres returns by default.
async function tokensMode(job, owner, count = '10') {
  const client = await connect();
  try {
    const tokens = [];
    const texts = [];
    for (let i = 0; i < Number(count); i += 1) {
      const { rows } = await client.query(
        "SELECT token, token::text AS token_text FROM ledger.acquire(job => $1, owner => $2, ttl => '1 minute')", [job, owner]);
      if (rows.length === 0) throw new Error(`job ${job} is held by another owner`);
      tokens.push(rows[0].token); // BigInt, thanks to the type parser above
      texts.push(rows[0].token_text); // what `pg` gives without it
    }
    const newest = tokens.reduce((a, b) => (b > a ? b : a)); // 10n > 9n: right
    const naive = texts.reduce((a, b) => (b > a ? b : a)); // "9" > "10": wrong
    // Pass the BigInt back as a parameter: the server compares bigints.
    const { rows: [cur] } = await client.query('SELECT ledger.is_current(job => $1, token => $2) AS ok', [job, newest]);
    await client.query('SELECT ledger.release(job => $1, owner => $2, token => $3)', [job, owner, newest]);
    // And why not Number: past 2^53 it rounds, BigInt stays exact.
    const { rows: [big] } = await client.query('SELECT 9007199254740993::bigint AS b, 9007199254740993::text AS t');
    return {
      mode: 'tokens', job, owner, tokens, newest, naive_string_newest: naive,
      newest_was_current: cur.ok,
      beyond_2_53: { bigint: big.b, number: String(Number(big.t)) },
    };
  } finally {
    await client.end();
  }
}

const { positionals, values } = parseArgs({
  allowPositionals: true,
  options: { resource: { type: 'string' }, ttl: { type: 'string' }, 'work-ms': { type: 'string' }, key: { type: 'string' } },
});
const [mode, ...args] = positionals;
const modes = {
  run: () => runMode(args[0], args[1], values),
  zombie: () => zombieMode(...args),
  tokens: () => tokensMode(...args),
};
if (!modes[mode] || args.length < 2) {
  process.stderr.write('usage: node run.mjs run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]\n'
    + '       node run.mjs zombie <job> <owner> <run_id> <token>\n'
    + '       node run.mjs tokens <job> <owner> [count]\n');
  process.exit(64);
}
try {
  print(await modes[mode]());
} catch (err) {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exit(1);
}
