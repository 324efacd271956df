"""Every statement the Python package sends, in one place: constants, named notation, explicit columns.

The clients (``ledger.aio`` and the generated ``ledger.client``), the command
line, the wrapper, the metrics and the embedded server all take their SQL
from here; nothing else in the package writes a statement. They never build
SQL from pieces at run time; they only bind parameters. Columns are listed by
name, so that a column added to a type or view later (the contract allows
additions) does not break the typed rows; a row's columns are written once,
as the fields of its dataclass in :mod:`ledger.models`
(``tests/client/test_queries.py`` checks them against the database and plans every
statement).

``time_left`` (``expires_at - clock_timestamp()`` on the server) lets the
heartbeat keep a local deadline without trusting the client's clock.
"""

from __future__ import annotations

from dataclasses import fields

from ledger.models import DbRisk, Event, EventSettings, Job, JobStatus, Pool, PoolStatus, Run


def _columns(row: type, alias: str) -> str:
    """``alias.a, alias.b, ...``: the dataclass's fields, in order (the typed row's columns)."""
    return ", ".join(f"{alias}.{field.name}" for field in fields(row))


RUN_COLUMNS = _columns(Run, "r")
JOB_COLUMNS = _columns(Job, "j")
JOB_STATUS_COLUMNS = _columns(JobStatus, "js")
EVENT_COLUMNS = _columns(Event, "e")
EVENT_SETTINGS_COLUMNS = _columns(EventSettings, "s")
DB_RISK_COLUMNS = _columns(DbRisk, "r")
POOL_COLUMNS = _columns(Pool, "p")
POOL_STATUS_COLUMNS = _columns(PoolStatus, "ps")

# -- leases -----------------------------------------------------------------

ACQUIRE = """
SELECT l.job, l.owner, l.token, l.acquired_at, l.expires_at,
       l.expires_at - clock_timestamp() AS time_left
  FROM ledger.acquire(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s) AS l
"""

RENEW = """
SELECT e AS expires_at, e - clock_timestamp() AS time_left, NULL::text AS ended_as
  FROM ledger.renew(job => %(job)s, owner => %(owner)s, token => %(token)s, ttl => %(ttl)s) AS e
"""

RELEASE = "SELECT ledger.release(job => %(job)s, owner => %(owner)s, token => %(token)s)"

IS_CURRENT = "SELECT ledger.is_current(job => %(job)s, token => %(token)s)"

ASSERT_CURRENT = "SELECT ledger.assert_current(job => %(job)s, token => %(token)s)"

# -- fences -----------------------------------------------------------------

# Job-aware fences, one round trip each: the fence itself checks that `token`
# is the job's current live token (LD001 otherwise, with assert_current's
# DETAIL), binds the resource to the job on first use and refuses another
# job's token (LD006). No assert_current before it: that is the fence's job.
# Run them in the transaction of the write they guard.

# Lenient: the current holder may write many times; LD002 when a higher token
# of the job already wrote (a takeover committed in between).
FENCE = "SELECT ledger.fence(job => %(job)s, resource => %(resource)s, token => %(token)s)"

# Strict: at most one fenced write per token; false when this token already wrote.
ADVANCE_FENCE = "SELECT ledger.advance_fence(job => %(job)s, resource => %(resource)s, token => %(token)s)"

# A transaction that carries the token (SET LOCAL, both in one round trip):
# the tables ledger.protect guards run the fence themselves on every write.
CARRY_TOKEN = "SELECT set_config('ledger.job', %(job)s, true), set_config('ledger.token', %(token)s, true)"

# -- runs -------------------------------------------------------------------

START_RUN = """
SELECT s.outcome, s.run_id, s.token, s.expires_at, s.slot, s.holder, s.holder_expires_at,
       s.expires_at - clock_timestamp() AS time_left
  FROM ledger.start_run(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s, slot => %(slot)s,
                        idempotency_key => %(idempotency_key)s, detail => %(detail)s) AS s
"""

START_DUE_RUN = """
SELECT s.outcome, s.run_id, s.token, s.expires_at, s.slot, s.holder, s.holder_expires_at,
       s.expires_at - clock_timestamp() AS time_left
  FROM ledger.start_due_run(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s) AS s
"""

# Why a run was lost: 'cancelled' when an operator asked, else its failure_reason (NULL: not ended).
_ENDED_AS = """(SELECT CASE WHEN r.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE r.failure_reason END
              FROM ledger.job_execution_log AS r WHERE r.run_id = %(run_id)s)"""

# ended_as: why a heartbeat that answered NULL lost the run, read in the
# same statement. Its snapshot is the statement's: it sees what ended the
# run before this call, but not what committed while the heartbeat waited
# for the run's row (a cancel in flight): then it is NULL, and RUN_ENDED_AS,
# a statement of its own, reads it again.
HEARTBEAT = f"""
SELECT e AS expires_at, e - clock_timestamp() AS time_left,
       CASE WHEN e IS NULL THEN {_ENDED_AS} END AS ended_as
  FROM ledger.heartbeat(run_id => %(run_id)s, token => %(token)s, ttl => %(ttl)s) AS e
"""
RUN_ENDED_AS = f"SELECT {_ENDED_AS} AS ended_as"

COMPLETE_RUN = f"""
SELECT {RUN_COLUMNS}
  FROM ledger.complete_run(run_id => %(run_id)s, token => %(token)s, detail => %(detail)s) AS r
"""

# With the resources the run fenced: success only when each fence holds the
# run's token (docs/contract.md, the safety net). Sent only when the run
# fenced, so that a client newer than its ledger completes as before.
COMPLETE_FENCED_RUN = f"""
SELECT {RUN_COLUMNS}
  FROM ledger.complete_run(run_id => %(run_id)s, token => %(token)s, detail => %(detail)s,
                           fenced => %(fenced)s::text[]) AS r
"""

FAIL_RUN = f"""
SELECT {RUN_COLUMNS}
  FROM ledger.fail_run(run_id => %(run_id)s, token => %(token)s, error => %(error)s,
                       detail => %(detail)s) AS r
"""

CANCEL_RUN = f"""
SELECT {RUN_COLUMNS}
  FROM ledger.cancel_run(run_id => %(run_id)s, token => %(token)s, error => %(error)s) AS r
"""

GET_RUN = f"""
SELECT {RUN_COLUMNS}
  FROM ledger.job_execution_log AS r
 WHERE r.run_id = %(run_id)s
"""

REAP_EXPIRED = "SELECT ledger.reap_expired(job => %(job)s)"

# -- schedules --------------------------------------------------------------

REGISTER_JOB = f"""
SELECT {JOB_COLUMNS}
  FROM ledger.register_job(job => %(job)s, schedule => %(schedule)s, ttl => %(ttl)s,
                           max_backfill => %(max_backfill)s, time_zone => %(time_zone)s,
                           late_after => %(late_after)s, down_after => %(down_after)s,
                           min_runtime => %(min_runtime)s, max_runtime => %(max_runtime)s,
                           pause_after_failures => %(pause_after_failures)s, jitter => %(jitter)s,
                           start_deadline => %(start_deadline)s, overlap_policy => %(overlap_policy)s,
                           pool => %(pool)s, max_concurrent => %(max_concurrent)s) AS j
"""

PAUSE_JOB = "SELECT ledger.pause_job(job => %(job)s)"

# -- operator commands -------------------------------------------------------

BACKFILL = """
SELECT s.outcome, s.run_id, s.token, s.expires_at, s.slot, s.holder, s.holder_expires_at,
       s.expires_at - clock_timestamp() AS time_left
  FROM ledger.backfill(job => %(job)s, owner => %(owner)s, from_slot => %(from_slot)s, to_slot => %(to_slot)s,
                       ttl => %(ttl)s) AS s
"""

UNREGISTER_JOB = "SELECT ledger.unregister_job(job => %(job)s, with_history => %(with_history)s)"

FORCE_RELEASE = "SELECT ledger.force_release(job => %(job)s)"

REQUEST_CANCEL = "SELECT ledger.request_cancel(run_id => %(run_id)s)"

RESUME_JOB = "SELECT ledger.resume_job(job => %(job)s)"

# Protected tables (sql/45_protect.sql): the table's name goes as text and is
# resolved by the cast to regclass in the caller's search_path.
PROTECT = "SELECT ledger.protect(table_name => %(table)s::text::regclass, job => %(job)s, mode => %(mode)s)"

UNPROTECT = "SELECT ledger.unprotect(table_name => %(table)s::text::regclass)"

PROTECTED_TABLES = """
SELECT p.table_name::text AS table_name, p.job, p.resource, p.mode, p.enabled
  FROM ledger.protected_tables AS p
 ORDER BY p.job, p.table_name::text
"""

# Pools (sql/35_pools.sql): a limit of live leases shared by jobs. register_pool and resize_pool
# answer the pool's row of ledger.pools; what uses it is its row of the pool_status view.
REGISTER_POOL = f"SELECT {POOL_COLUMNS} FROM ledger.register_pool(pool => %(pool)s, size => %(size)s) AS p"

RESIZE_POOL = f"SELECT {POOL_COLUMNS} FROM ledger.resize_pool(pool => %(pool)s, size => %(size)s) AS p"

DROP_POOL = "SELECT ledger.drop_pool(pool => %(pool)s, detach => %(detach)s)"

POOL_STATUSES = f"""
SELECT {POOL_STATUS_COLUMNS}
  FROM ledger.pool_status AS ps
 ORDER BY ps.pool
"""

POOL_STATUS = f"""
SELECT {POOL_STATUS_COLUMNS}
  FROM ledger.pool_status AS ps
 WHERE ps.pool = %(pool)s
"""

DUE_SLOTS = "SELECT s FROM ledger.due_slots(job => %(job)s, at => %(at)s) AS s"

# -- reporting --------------------------------------------------------------

JOB_STATUS = f"""
SELECT {JOB_STATUS_COLUMNS}
  FROM ledger.job_status AS js
 WHERE js.job = %(job)s
"""

JOB_STATUSES = f"""
SELECT {JOB_STATUS_COLUMNS}
  FROM ledger.job_status AS js
 ORDER BY js.job
"""

PURGE_LOG = "SELECT ledger.purge_log(older_than => %(older_than)s)"

# One batch of a purge (the client's purge_log_in_batches calls it until
# next_run_id is NULL, each call its own transaction).
PURGE_LOG_BATCH = """
SELECT b.deleted, b.next_run_id
  FROM ledger.purge_log_batch(older_than => %(older_than)s, from_run_id => %(from_run_id)s) b
"""

# -- events -------------------------------------------------------------------
# ledger.events, its settings and the alert sync (the client's events methods,
# `jobledger events`, `watch`, `notify`, `configure-events`). event_id order is
# the order the ids were taken, not always the order of the commits: the tail
# (ledger.tail) reads with EVENT_TAIL_PAGE, which tells it what may still come.

CONFIGURE_EVENTS = f"""
SELECT {EVENT_SETTINGS_COLUMNS}
  FROM ledger.configure_events(run_events => %(run_events)s, notify => %(notify)s,
                               retention => %(retention)s, max_events => %(max_events)s) AS s
"""

# The settings as they are (configure_events with no arguments would also re-align the
# triggers, a write, and needs EXECUTE; a reader may read this).
EVENT_SETTINGS = f"SELECT {EVENT_SETTINGS_COLUMNS} FROM ledger.event_settings AS s"

SYNC_ALERTS = f"SELECT {EVENT_COLUMNS} FROM ledger.sync_alerts() AS e ORDER BY e.event_id"

PURGE_EVENTS = "SELECT ledger.purge_events()"

# The first `limit` events after `after` that match (NULL job, NULL kinds: any).
EVENTS_AFTER = f"""
SELECT {EVENT_COLUMNS}
  FROM ledger.events AS e
 WHERE e.event_id > %(after)s
   AND (%(job)s::text IS NULL OR e.job = %(job)s::text)
   AND (%(kinds)s::text[] IS NULL OR e.kind = ANY(%(kinds)s::text[]))
 ORDER BY e.event_id
 LIMIT %(limit)s
"""

# The newest `limit` events that match, up to `through` (NULL: the newest of all), oldest first.
EVENTS_NEWEST = f"""
SELECT {EVENT_COLUMNS}
  FROM (SELECT {EVENT_COLUMNS}
          FROM ledger.events AS e
         WHERE (%(through)s::bigint IS NULL OR e.event_id <= %(through)s::bigint)
           AND (%(job)s::text IS NULL OR e.job = %(job)s::text)
           AND (%(kinds)s::text[] IS NULL OR e.kind = ANY(%(kinds)s::text[]))
         ORDER BY e.event_id DESC
         LIMIT %(limit)s) AS e
 ORDER BY e.event_id
"""

NEWEST_EVENT_ID = "SELECT coalesce(max(e.event_id), 0) FROM ledger.events AS e"

# One read of the tail: the ids of the next `limit` events after `after` and of those that
# turned up in the gaps below it (ranges gap_first..gap_last, ids a transaction took and
# had not committed yet), every matching event's row among them (the others' columns are
# NULL), and the bounds of the read's snapshot: a gap whose transactions have all ended
# stays empty. One row when nothing is new (its `seen` is NULL).
EVENT_TAIL_PAGE = f"""
WITH page AS MATERIALIZED (
    (SELECT e.event_id FROM ledger.events AS e
      WHERE e.event_id > %(after)s
      ORDER BY e.event_id
      LIMIT %(limit)s)
    UNION ALL
    (SELECT e.event_id
       FROM unnest(%(gap_first)s::bigint[], %(gap_last)s::bigint[]) AS g(first_id, last_id)
       JOIN ledger.events AS e ON e.event_id BETWEEN g.first_id AND g.last_id)
), snapshot AS (
    SELECT pg_snapshot_xmin(c.snapshot)::text::bigint AS xmin, pg_snapshot_xmax(c.snapshot)::text::bigint AS xmax
      FROM pg_current_snapshot() AS c(snapshot)
)
SELECT s.xmin, s.xmax, p.event_id AS seen, {EVENT_COLUMNS}
  FROM snapshot AS s
  LEFT JOIN page AS p ON true
  LEFT JOIN ledger.events AS e
         ON e.event_id = p.event_id
        AND (%(job)s::text IS NULL OR e.job = %(job)s::text)
        AND (%(kinds)s::text[] IS NULL OR e.kind = ANY(%(kinds)s::text[]))
 ORDER BY p.event_id
"""

# Whether events are notified (the tail LISTENs only then: a listener no NOTIFY is sent to
# has nothing to wait for, and behind a transaction pooler LISTEN is not safe).
EVENTS_NOTIFIED = "SELECT s.notify FROM ledger.event_settings AS s"

LISTEN_EVENTS = "LISTEN ledger_events"

UNLISTEN_EVENTS = "UNLISTEN ledger_events"

# -- the views the command line and the demo read (ledger.lookups) -----------

# `jobledger verify-state`: the jobs whose stored state differs from the log's (ledger.verify_state;
# it reads the whole log).
VERIFY_STATE = "SELECT d.job, d.state, d.differences FROM ledger.verify_state() AS d ORDER BY d.job"

ALERTS = """
SELECT a.alert, a.job, a.run_id, a.message, a.since
  FROM ledger.alerts AS a
 ORDER BY a.job, a.alert, a.run_id
"""

JOB_HEALTH = """
SELECT h.job, h.state, h.since, h.reason, h.pause_reason, h.last_success_at, h.last_success_age,
       h.last_success_duration, h.missed_slots, h.missed_slots_capped, h.late_after, h.down_after,
       h.min_runtime, h.max_runtime, h.pause_after_failures, h.consecutive_failures,
       h.running_run_id, h.running_for
  FROM ledger.job_health AS h
 ORDER BY h.job
"""

RECENT_RUNS = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.failure_reason,
       r.started_at, r.heartbeat_at, r.completed_at,
       coalesce(r.completed_at, clock_timestamp()) - r.started_at AS duration,
       r.error, r.detail
  FROM ledger.job_execution_log AS r
 WHERE r.job = %(job)s
 ORDER BY r.run_id DESC
 LIMIT %(limit)s
"""

SKIPPED_SLOTS = """
SELECT s.job, s.first_slot, s.last_slot, s.slot_count, s.reason, s.recorded_at
  FROM ledger.skipped_slots AS s
 WHERE s.job = %(job)s
 ORDER BY s.first_slot
"""

OVERLAPS = """
SELECT o.job, o.run_id, o.other_run_id, o.started_at, o.other_started_at
  FROM ledger.overlaps AS o
 WHERE %(jobs)s::text[] IS NULL OR o.job = ANY(%(jobs)s::text[])
 ORDER BY o.job, o.run_id
"""

# The schedulers' registry (ledger.schedulers, kept by ledger.scheduler_heartbeat), by name:
# `jobledger status` (the live ones), `jobledger schedulers` (all, %(all)s) and the dashboard.
# A row is live until its expires_at (a scheduler that died stays, expired, until
# scheduler_stop removes it); status its word: live, stopping (SIGTERM: it starts no run) or
# expired; leader: it holds the upkeep lease (ledger.upkeep_leader) now.
# One clock for the whole read, the views' (ledger._view_now). %(first_jobs)s: how many of the
# jobs served to list (the dashboard's bound: a scheduler may serve 10,000); NULL all of them.
SCHEDULERS = """
SELECT s.scheduler, s.host, s.pid, s.version,
       CASE WHEN %(first_jobs)s::integer IS NULL THEN s.jobs ELSE s.jobs[1:%(first_jobs)s::integer] END AS jobs,
       cardinality(s.jobs) AS job_count, s.started_at,
       s.heartbeat_at, s.expires_at, s.stopping, s.expires_at > n.at AS live,
       CASE WHEN s.expires_at <= n.at THEN 'expired' WHEN s.stopping THEN 'stopping' ELSE 'live' END AS status,
       coalesce(u.expires_at > n.at, false) AS leader, n.at - s.heartbeat_at AS heartbeat_age
  FROM ledger.schedulers AS s
 CROSS JOIN (SELECT ledger._view_now() AS at) AS n
  LEFT JOIN ledger.upkeep_leader AS u ON u.scheduler = s.scheduler
 WHERE %(all)s OR s.expires_at > n.at
 ORDER BY s.scheduler
"""

# -- one metrics scrape (ledger.metrics) --------------------------------------
# A scrape reads each job's state row once (ledger._job_state, the view
# job_status and job_health select from: counters, jobs and leases, one row of
# each per job, never the log) and the alerts (the same rows again, grouped),
# so that it costs microseconds per job however long the log is. `running`
# is a live run (not a crashed one: that is its state). The jobs from
# %(first)s to before %(end)s (NULL, NULL: every job; a part of a scrape in
# parts, METRIC_PART_BOUNDS): the bounds are known when the statement is
# planned (prepare=False), so a NULL one folds away and the other is a range
# of each table's primary key.
METRIC_JOBS = """
SELECT s.job, s.state, s.consecutive_failures, s.runs_started, s.successes, s.failures, s.skipped_overlap,
       s.skipped_backfill,
       -- only for a job in a pool or one a pool refused: no line for the jobs that never met one
       CASE WHEN s.pool IS NOT NULL OR s.skipped_pool_full > 0 THEN s.skipped_pool_full END AS skipped_pool_full,
       s.leases_lost, CASE WHEN s.live THEN 1 ELSE 0 END AS running,
       extract(epoch FROM s.ttl)::float8 AS ttl_seconds,
       CASE WHEN s.live THEN extract(epoch FROM s.running_for)::float8 END AS running_seconds,
       extract(epoch FROM s.longest_success)::float8 AS longest_success_seconds,
       extract(epoch FROM s.last_success_at - s.last_success_started_at)::float8 AS last_success_seconds,
       s.failures::float8 / nullif(s.successes + s.failures, 0) AS failure_ratio,
       s.alerts
  FROM ledger._job_state AS s
 WHERE (%(first)s::text IS NULL OR s.job >= %(first)s) AND (%(end)s::text IS NULL OR s.job < %(end)s)
 ORDER BY s.job
"""

# A scrape of many jobs reads them in parts at once, each on a connection of its own
# (ledger.metrics.read_text): the first job of each part after the first, so that each has
# about as many jobs (none under %(from_jobs)s jobs: one part). Each bound is an index-only
# walk of the state rows' primary key.
METRIC_PART_BOUNDS = """
SELECT b.job
  FROM (SELECT count(*) AS jobs FROM ledger.counters) AS n
 CROSS JOIN generate_series(1, %(parts)s - 1) AS p(part)
 CROSS JOIN LATERAL (SELECT c.job FROM ledger.counters AS c
                      ORDER BY c.job OFFSET n.jobs * p.part / %(parts)s LIMIT 1) AS b
 WHERE n.jobs >= %(from_jobs)s
 ORDER BY p.part
"""

# The snapshot the other parts of a scrape read (SET TRANSACTION SNAPSHOT), while this one is open.
EXPORT_SNAPSHOT = "SELECT pg_catalog.pg_export_snapshot()"

# Each part of a scrape in parts: the lines' float8 text as EXTRA_FLOAT_DIGITS sets it, and no
# parallel workers (the parts are the parallelism: 100,000 jobs in two parts on two cores took
# 0.85 to 0.92 s without workers, 1.02 to 1.06 s with them; BENCHMARKS.md).
PART_SETTINGS = ("SELECT pg_catalog.set_config('extra_float_digits', '1', true),"
                 " pg_catalog.set_config('max_parallel_workers_per_gather', '0', true)")

# The schedulers for the metrics: every row (an expired one is a scheduler that died), how
# long since its heartbeat, how many jobs it serves, whether it leads the upkeep now.
METRIC_SCHEDULERS = """
SELECT s.scheduler, s.host, s.expires_at > n.at AS live, extract(epoch FROM n.at - s.heartbeat_at)::float8,
       cardinality(s.jobs), coalesce(u.expires_at > n.at, false) AS leader
  FROM ledger.schedulers AS s
 CROSS JOIN (SELECT ledger._view_now() AS at) AS n
  LEFT JOIN ledger.upkeep_leader AS u ON u.scheduler = s.scheduler
 ORDER BY s.scheduler
"""

# The pools for the metrics (ledger.pool_status, one row per pool): size, used (live leases), running,
# jobs, waiting. The per-job count of the starts a full pool refused is METRIC_JOBS' skipped_pool_full.
METRIC_POOLS = """
SELECT ps.pool, ps.size, ps.used, ps.running, ps.jobs, ps.waiting
  FROM ledger.pool_status AS ps
 ORDER BY ps.pool
"""

# The audits, read only when asked (`jobledger metrics --audit`): they read the log, not the
# state rows. The state audit: the jobs whose stored state differs from the log's (always 0).
STATE_DIFFERENCES = "SELECT count(*) FROM ledger.verify_state() AS d"

# The duplicate audit (ledger.duplicates) over each job's newest 1,000 successes (the view audits
# the whole log): slots and keys that succeeded twice (always 0 while the unique indexes hold).
DUPLICATE_COUNT = """
WITH recent AS (
    SELECT w.job, w.slot, w.idempotency_key
      FROM ledger.counters AS c
     CROSS JOIN LATERAL (
           SELECT r.job, r.slot, r.idempotency_key FROM ledger.job_execution_log AS r
            WHERE r.job = c.job AND r.status = 'success'
            ORDER BY r.started_at DESC LIMIT 1000) AS w
     WHERE c.last_success_at IS NOT NULL
)
SELECT (SELECT count(*) FROM (SELECT FROM recent WHERE recent.slot IS NOT NULL
                               GROUP BY recent.job, recent.slot HAVING count(*) > 1) AS s)
     + (SELECT count(*) FROM (SELECT FROM recent WHERE recent.idempotency_key IS NOT NULL
                               GROUP BY recent.job, recent.idempotency_key HAVING count(*) > 1) AS k)
"""

# The database's risks to the ledger (ledger.db_risks: the xmin horizon, dead rows and
# autovacuum lag on the hot tables), the horizon first: `jobledger metrics` and `jobledger risks`.
DB_RISKS = f"""
SELECT {DB_RISK_COLUMNS}
  FROM ledger.db_risks AS r
 ORDER BY array_position(ARRAY['xmin_horizon', 'dead_rows', 'autovacuum_lag'], r.kind), r.relation
"""

# -- the CLI ----------------------------------------------------------------
# The statements of the command line (``ledger.cli``), the wrapper
# (``ledger.wrapper``) and the embedded server (``ledger.embedded``).

# The database's clock: the tables show times relative to it (`status`, `runs`).
DATABASE_NOW = "SELECT clock_timestamp()"

# The job's pool and how full it is: `jobledger run`'s word on a start skipped_pool_full.
JOB_POOL = """
SELECT ps.pool, ps.size, ps.used
  FROM ledger.jobs AS j
  JOIN ledger.pool_status AS ps ON ps.pool = j.pool
 WHERE j.job = %(job)s
"""

# Whether `jobledger run` loops over the due slots (start_due_run) or starts one run (start_run).
# What `jobledger run` reads of the job once: whether it has a schedule, and its max_runtime.
JOB_RUN_OPTIONS = "SELECT j.schedule IS NOT NULL, j.max_runtime FROM ledger.jobs AS j WHERE j.job = %(job)s"

# The embedded server's database: templates for psycopg.sql (the {} is an Identifier).
DATABASE_EXISTS = "SELECT true FROM pg_database WHERE datname = %(database)s"

CREATE_DATABASE = "CREATE DATABASE {}"

DROP_DATABASE = "DROP DATABASE IF EXISTS {} WITH (FORCE)"

# Whether the demo's database already has the ledger (its newest function's signature).
LEDGER_INSTALLED = "SELECT to_regprocedure('ledger.start_due_run(text, text, interval)')"

# The installed revision (alembic's table), read before migrating the embedded database.
HAS_REVISION_TABLE = "SELECT to_regclass('ledger.alembic_version') IS NOT NULL"

INSTALLED_REVISION = "SELECT version_num FROM ledger.alembic_version"

# -- schedule preview ---------------------------------------------------------
# `jobledger next` (``ledger.cli.next``): a job's next slots, or a schedule's before it is
# registered, each with its wall clock, UTC offset and daylight-saving note.

NEXT_SLOTS = """
SELECT p.slot, p.local_time, p.utc_offset, p.dst_change
  FROM ledger.next_slots(job => %(job)s, count => %(count)s, after => %(after)s) AS p
"""

PREVIEW_SLOTS = """
SELECT p.slot, p.local_time, p.utc_offset, p.dst_change
  FROM ledger.preview_slots(schedule => %(schedule)s, time_zone => %(time_zone)s, count => %(count)s,
                            after => %(after)s) AS p
"""

# The job's schedule in words (`jobledger next JOB`): its text, zone and pause flag.
JOB_SCHEDULE = "SELECT j.schedule, j.time_zone, j.paused FROM ledger.jobs AS j WHERE j.job = %(job)s"

# The wrapper, when start_due_run answers nothing_due: whose live run holds the job, and for
# which slot (another host runs the due slot right now).
RUNNING_HOLDER = """
SELECT r.run_id, r.slot, r.owner, js.lease_expires_at
  FROM ledger.job_execution_log AS r
  JOIN ledger.job_status AS js ON js.job = r.job AND js.holder = r.owner AND js.token = r.token
 WHERE r.job = %(job)s AND r.status = 'running'
 ORDER BY r.run_id DESC
 LIMIT 1
"""

# -- the dashboard (ledger.web) ------------------------------------------------
# Each page of `jobledger web` reads in one read-only transaction as
# ledger_reader (ledger.readonly.read_only_transaction: search_path is
# pg_catalog, so every name is qualified). Every read is bounded: by the job
# (the log's index on (job, started_at)), by the page's window, by a LIMIT.

# The jobs page: the jobs per state that the name filter keeps (a case-insensitive
# substring; NULL: every job), counted here rather than fetched (100,000 jobs' rows into
# Python took seconds), and one page of their status, by name, that the state filter keeps
# too (NULL: every state). One job's (the job page, the badge) is JOB_STATUS.
WEB_JOB_COUNTS = """
SELECT js.state, count(*) AS jobs
  FROM ledger.job_status AS js
 WHERE %(name)s::text IS NULL OR strpos(lower(js.job), lower(%(name)s::text)) > 0
 GROUP BY js.state
"""

WEB_JOBS = f"""
SELECT {JOB_STATUS_COLUMNS}
  FROM ledger.job_status AS js
 WHERE js.job = ANY (ARRAY(
       -- the page's names first, from the state alone: the status of these jobs only
       SELECT p.job FROM ledger.job_status AS p
        WHERE (%(name)s::text IS NULL OR strpos(lower(p.job), lower(%(name)s::text)) > 0)
          AND (%(state)s::text IS NULL OR p.state = %(state)s::text)
        ORDER BY p.job LIMIT %(limit)s OFFSET %(offset)s))
 ORDER BY js.job
"""

# The job page's state, since when and why (one job's row of the state view).
WEB_JOB_HEALTH = """
SELECT h.state, h.since, h.reason
  FROM ledger.job_health AS h
 WHERE h.job = %(job)s
"""

# The sparklines: the newest `per_job` runs of each of these jobs (an index scan each).
WEB_LAST_RUNS = """
SELECT k.job, r.run_id, r.owner, r.token, r.slot, r.status, r.failure_reason, r.started_at, r.completed_at,
       extract(epoch FROM coalesce(r.completed_at, ledger._view_now()) - r.started_at)::float8 AS seconds,
       left(r.error, 200) AS error
  FROM unnest(%(jobs)s::text[]) AS k(job)
 CROSS JOIN LATERAL (
       SELECT r.run_id, r.owner, r.token, r.slot, r.status, r.failure_reason, r.started_at, r.completed_at,
              r.error
         FROM ledger.job_execution_log AS r
        WHERE r.job = k.job
        ORDER BY r.started_at DESC, r.run_id DESC
        LIMIT %(per_job)s) AS r
 ORDER BY k.job, r.started_at, r.run_id
"""

# The job page's timeline and duration chart: the newest `limit` runs that
# started in the window, and the running run wherever it started.
WEB_WINDOW_RUNS = """
SELECT w.run_id, w.owner, w.token, w.slot, w.status, w.failure_reason, w.started_at, w.completed_at,
       extract(epoch FROM coalesce(w.completed_at, ledger._view_now()) - w.started_at)::float8 AS seconds,
       left(w.error, 200) AS error
  FROM ((SELECT r.run_id, r.owner, r.token, r.slot, r.status, r.failure_reason, r.started_at,
                r.completed_at, r.error
           FROM ledger.job_execution_log AS r
          WHERE r.job = %(job)s AND r.started_at >= %(since)s AND r.started_at <= %(until)s
          ORDER BY r.started_at DESC, r.run_id DESC
          LIMIT %(limit)s)
        UNION
        (SELECT r.run_id, r.owner, r.token, r.slot, r.status, r.failure_reason, r.started_at,
                r.completed_at, r.error
           FROM ledger.job_execution_log AS r
          WHERE r.job = %(job)s AND r.status = 'running')) AS w
 ORDER BY w.started_at, w.run_id
"""

# Recent failures with their error text, among the job's newest 1,000 runs
# (a job that never fails costs 1,000 index entries, not its whole log).
WEB_FAILURES = """
SELECT f.run_id, f.owner, f.token, f.slot, f.failure_reason, f.started_at, f.completed_at, f.error
  FROM (SELECT r.run_id, r.owner, r.token, r.slot, r.status, r.failure_reason, r.started_at,
               r.completed_at, r.error
          FROM ledger.job_execution_log AS r
         WHERE r.job = %(job)s
         ORDER BY r.started_at DESC, r.run_id DESC
         LIMIT 1000) AS f
 WHERE f.status = 'failure'
 ORDER BY f.started_at DESC, f.run_id DESC
 LIMIT %(limit)s
"""

# Skipped ranges that reach into the window. Ranges do not overlap, so the
# only one that starts before the window and reaches into it is the newest
# that starts before it.
WEB_SKIPPED = """
SELECT s.first_slot, s.last_slot, s.slot_count, s.reason, s.recorded_at
  FROM ((SELECT k.first_slot, k.last_slot, k.slot_count, k.reason, k.recorded_at
           FROM ledger.skipped_slots AS k
          WHERE k.job = %(job)s AND k.first_slot > %(since)s AND k.first_slot <= %(until)s
          ORDER BY k.first_slot DESC
          LIMIT %(limit)s)
        UNION ALL
        (SELECT k.first_slot, k.last_slot, k.slot_count, k.reason, k.recorded_at
           FROM ledger.skipped_slots AS k
          WHERE k.job = %(job)s AND k.first_slot <= %(since)s
          ORDER BY k.first_slot DESC
          LIMIT 1)) AS s
 WHERE s.last_slot >= %(since)s
 ORDER BY s.first_slot
"""

# How many slots the window holds (counted, not enumerated): the timeline
# marks them one by one only when there are few.
WEB_SLOT_COUNT = """
SELECT ledger._slot_count(j.schedule_spec, j.time_zone, %(since)s, %(until)s) AS slot_count
  FROM ledger.jobs AS j
 WHERE j.job = %(job)s AND j.schedule IS NOT NULL
"""

# The job page's duration chart: its ttl and the ttl_advice range.
WEB_TTL_ADVICE = """
SELECT t.ttl, t.longest_run, t.recommended_min, t.recommended_max, t.renew_every, t.verdict
  FROM ledger.ttl_advice AS t
 WHERE t.job = %(job)s
"""

# The run page: every column of its log row, and how long it ran (so far).
WEB_RUN = f"""
SELECT {RUN_COLUMNS}, coalesce(r.completed_at, ledger._view_now()) - r.started_at AS duration
  FROM ledger.job_execution_log AS r
 WHERE r.run_id = %(run_id)s
"""

# The run's neighbours in its job's history (links to the previous and next run).
WEB_RUN_NEIGHBOURS = """
SELECT (SELECT p.run_id FROM ledger.job_execution_log AS p
         WHERE p.job = %(job)s AND p.started_at <= %(started_at)s
           AND (p.started_at, p.run_id) < (%(started_at)s, %(run_id)s)
         ORDER BY p.started_at DESC, p.run_id DESC LIMIT 1) AS previous_run_id,
       (SELECT n.run_id FROM ledger.job_execution_log AS n
         WHERE n.job = %(job)s AND n.started_at >= %(started_at)s
           AND (n.started_at, n.run_id) > (%(started_at)s, %(run_id)s)
         ORDER BY n.started_at, n.run_id LIMIT 1) AS next_run_id
"""

# The job's lease as it is now (a run's token is current while it matches a live lease).
WEB_LEASE = """
SELECT l.owner, l.token, l.ttl, l.acquired_at, l.expires_at, l.released_at, l.timeline,
       (l.released_at IS NULL AND l.expires_at > ledger._view_now()) AS live,
       l.multi, coalesce(j.max_concurrent, 1) AS max_concurrent
  FROM ledger.leases AS l
  LEFT JOIN ledger.jobs AS j ON j.job = l.job
 WHERE l.job = %(job)s
"""

# A job in seats mode (ledger.leases.multi): each seat's lease, by seat. The
# job's row in ledger.leases is then only its token counter.
WEB_SEATS = """
SELECT s.seat, s.owner, s.token, s.ttl, s.acquired_at, s.expires_at, s.released_at, s.run_id,
       (s.released_at IS NULL AND s.expires_at > ledger._view_now()) AS live
  FROM ledger.lease_seats AS s
 WHERE s.job = %(job)s
 ORDER BY s.seat
"""

# The fence writes a run made, as far as the ledger knows them: a fence keeps
# only the highest token that wrote through it, so these are the resources
# whose last accepted write was this run's.
WEB_FENCES = """
SELECT f.resource, f.token, f.advanced_at
  FROM ledger.fences AS f
 WHERE f.job = %(job)s AND f.token = %(token)s
 ORDER BY f.resource
 LIMIT 100
"""

# -- jobledger verify (ledger.verify) -------------------------------------------
# The checks of `jobledger verify`: the catalogs it reads about the path, the
# role, replication and the xmin horizon, and what it reads back of its scratch
# jobs (jobledger-verify:...). Its ledger calls are the client's own (above).

# Where the connection landed, as the server sees it (behind a pooler: the server's address).
VERIFY_TARGET = """
SELECT current_database() AS dbname, current_user AS role, current_setting('server_version') AS server_version,
       host(inet_server_addr()) AS server_addr, inet_server_port() AS server_port
"""

# The connecting role: superuser, member of ledger_owner, may use ledger_client / ledger_reader, may
# start a run. Over the catalogs and oids: NULL, not an error, for a role or schema that does not exist
# (before an install) or that this role may not use (to_regprocedure needs USAGE on the schema).
VERIFY_ROLE = """
WITH f AS (
    SELECT p.oid FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
     WHERE n.nspname = 'ledger' AND p.proname = 'start_due_run'
)
SELECT r.rolname::text AS role, r.rolsuper AS superuser,
       EXISTS (SELECT FROM f) AS installed,
       coalesce(pg_has_role(r.oid, to_regrole('ledger_owner'), 'MEMBER'), false) AS owner_member,
       coalesce(pg_has_role(r.oid, to_regrole('ledger_client'), 'USAGE'), false) AS client,
       coalesce(pg_has_role(r.oid, to_regrole('ledger_reader'), 'USAGE'), false) AS reader,
       coalesce(has_schema_privilege(r.oid, to_regnamespace('ledger'), 'USAGE')
                AND has_function_privilege(r.oid, (SELECT f.oid FROM f LIMIT 1), 'EXECUTE'), false) AS can_start
  FROM pg_catalog.pg_roles AS r
 WHERE r.rolname = current_user
"""

# The ledger's clock seam (zero in every install but a test database's).
VERIFY_CLOCK_SEAM = "SELECT extract(epoch FROM ledger._clock_offset())::float8"

# Which server connection a transaction ran on (a transaction pooler moves a client between them).
VERIFY_BACKEND_PID = "SELECT pg_backend_pid()"

VERIFY_REPLICATION = """
SELECT current_setting('synchronous_standby_names') AS synchronous_standby_names,
       current_setting('synchronous_commit') AS synchronous_commit,
       pg_is_in_recovery() AS in_recovery,
       pg_has_role('pg_read_all_stats', 'USAGE') AS sees_all
"""

# The standbys streaming from this server (their states are hidden from a role without pg_read_all_stats).
VERIFY_STANDBYS = """
SELECT s.application_name, s.state, s.sync_state, s.client_addr::text AS client_addr,
       extract(epoch FROM s.replay_lag)::float8 AS replay_lag_seconds
  FROM pg_catalog.pg_stat_replication AS s
 ORDER BY s.application_name, s.pid
"""

# What holds back the xmin horizon of this database: sessions with a snapshot or a transaction id
# (a session of another role shows its pid and ages, not its state), ...
VERIFY_HORIZON_SESSIONS = """
SELECT a.pid, a.usename::text AS role, a.application_name, a.backend_type, a.state,
       greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS transaction_seconds,
       extract(epoch FROM clock_timestamp() - a.state_change)::float8 AS state_seconds,
       left(a.query, 200) AS query
  FROM pg_catalog.pg_stat_activity AS a
 WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
   AND a.pid <> pg_backend_pid()
   AND (a.datname = current_database() OR a.datname IS NULL)
   AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
 ORDER BY xid_age DESC NULLS LAST, a.pid
 LIMIT 10
"""

# ... replication slots that keep an xmin (a standby's hot_standby_feedback), ...
VERIFY_HORIZON_SLOTS = """
SELECT s.slot_name::text AS slot_name, s.slot_type, s.active, age(s.xmin) AS xid_age
  FROM pg_catalog.pg_replication_slots AS s
 WHERE s.xmin IS NOT NULL
 ORDER BY age(s.xmin) DESC
"""

# ... and prepared transactions, which outlive every session.
VERIFY_HORIZON_PREPARED = """
SELECT p.gid, p.owner::text AS role, p.database::text AS dbname, age(p.transaction) AS xid_age,
       extract(epoch FROM clock_timestamp() - p.prepared)::float8 AS seconds
  FROM pg_catalog.pg_prepared_xacts AS p
 ORDER BY p.prepared
"""

# Dead versions on the ledger's hot rows: every start, heartbeat and end updates a lease row and a
# counters row (skip counts: every skip), and only vacuum past the horizon removes the old versions.
VERIFY_HOT_ROWS = """
SELECT t.relname::text AS table_name, t.n_live_tup AS live, t.n_dead_tup AS dead,
       greatest(t.last_autovacuum, t.last_vacuum) AS last_vacuum
  FROM pg_catalog.pg_stat_user_tables AS t
 WHERE t.schemaname = 'ledger' AND t.relname IN ('leases', 'counters', 'skip_counts')
 ORDER BY t.relname
"""

# The state audit: the jobs whose stored state differs from their log (ledger.verify_state, which reads
# the whole log); the first few, and how many.
VERIFY_STATE = """
SELECT d.job, d.state, d.differences, count(*) OVER () AS jobs
  FROM ledger.verify_state() AS d
 ORDER BY d.job
 LIMIT 10
"""

# The racing workers' job: its runs per slot.
VERIFY_SLOT_RUNS = """
SELECT r.slot, count(*) FILTER (WHERE r.status = 'success') AS successes, count(*) AS runs
  FROM ledger.job_execution_log AS r
 WHERE r.job = %(job)s AND r.slot IS NOT NULL
 GROUP BY r.slot
 ORDER BY r.slot
"""

VERIFY_DUPLICATES = """
SELECT d.kind, d.value, d.run_ids
  FROM ledger.duplicates AS d
 WHERE d.job = %(job)s
"""

# The time left of a lease as committed (a read: it does not wait for the lease row's lock).
VERIFY_LEASE_TIME_LEFT = """
SELECT extract(epoch FROM l.expires_at - clock_timestamp())::float8
  FROM ledger.leases AS l
 WHERE l.job = %(job)s AND l.token = %(token)s
"""

# The zombie check's fenced write: a table of its transaction's own (never outlives it, so it is
# safe behind a transaction pooler and leaves nothing behind), written in the statement that makes it.
VERIFY_FENCED_WRITE = "CREATE TEMP TABLE jobledger_verify_write ON COMMIT DROP AS SELECT %(token)s::bigint AS token"

# What the scratch jobs leave: no registration and no run; their lease rows and fences stay (the
# token high-water marks).
VERIFY_SCRATCH_REMAINS = """
SELECT (SELECT count(*) FROM ledger.jobs AS j WHERE j.job = ANY(%(jobs)s::text[])) AS jobs,
       (SELECT count(*) FROM ledger.job_execution_log AS r WHERE r.job = ANY(%(jobs)s::text[])) AS runs,
       (SELECT count(*) FROM ledger.leases AS l WHERE l.job = ANY(%(jobs)s::text[])) AS leases,
       (SELECT count(*) FROM ledger.fences AS f WHERE f.resource = ANY(%(resources)s::text[])) AS fences
"""

# -- the scheduler (ledger.scheduler) ----------------------------------------------------

# The earliest moment something of these jobs is due to start (NULL: nothing ever).
NEXT_START = "SELECT ledger.next_start(jobs => %(jobs)s) - clock_timestamp() AS wait"

# What is due of these jobs, started in one call; time_left as START_DUE_RUN computes it, for the
# adopting run context's local deadline.
START_DUE_RUNS = """
SELECT s.job, s.outcome, s.run_id, s.token, s.expires_at, s.slot, s.trigger_id,
       s.expires_at - clock_timestamp() AS time_left
  FROM ledger.start_due_runs(jobs => %(jobs)s, owner => %(owner)s, max_runs => %(max_runs)s) AS s
"""

SCHEDULER_HEARTBEAT = """
SELECT ledger.scheduler_heartbeat(scheduler => %(scheduler)s, host => %(host)s, pid => %(pid)s,
                                  version => %(version)s, jobs => %(jobs)s, ttl => %(ttl)s,
                                  stopping => %(stopping)s)
"""

SCHEDULER_STOP = "SELECT ledger.scheduler_stop(scheduler => %(scheduler)s)"

SYNC_JOBS = """
SELECT s.job, s.action
  FROM ledger.sync_jobs(definitions => %(definitions)s, source => %(source)s, removed => %(removed)s) AS s
 ORDER BY s.job
"""

TRIGGER = "SELECT ledger.trigger(job => %(job)s, requested_by => %(requested_by)s, detail => %(detail)s)"

LISTEN_SCHEDULER = "LISTEN ledger_scheduler"

# What became of a trigger (`jobledger trigger --here` when another scheduler was faster).
TRIGGER_STATE = "SELECT t.status, t.run_id, t.skip_reason FROM ledger.triggers AS t WHERE t.trigger_id = %(trigger_id)s"

REAP_ALL = "SELECT ledger.reap_expired()"

# The scrape's per-job sample lines, written by PostgreSQL (ledger.metrics generates `columns`, one
# string_agg per family, and `labels`, each label column escaped once, from its one family table).
EXTRA_FLOAT_DIGITS = "SELECT pg_catalog.set_config('extra_float_digits', '1', true)"


def metric_job_text(columns: str, labels: str) -> str:
    """The statement that writes the sample lines of ``METRIC_JOBS``' jobs (``%(first)s`` to
    before ``%(end)s``), ordered by job, and, last, their alerts by kind, ``{kind: count}`` (the kinds no job raises left out), counted from
    each job's kinds (``ledger._job_state.alerts``, what ledger.alerts unnests) in the same
    pass: each state row is read once. (The aggregate inside the subquery is the outer query's.)"""
    alert_counts = ("(SELECT coalesce(jsonb_object_agg(k.alert, k.n), '{}')\n"
                    "          FROM (SELECT a.alert, count(*) AS n\n"
                    "                  FROM jsonb_array_elements(jsonb_agg(q.alerts)"
                    " FILTER (WHERE cardinality(q.alerts) > 0)) AS j(kinds)\n"
                    "                 CROSS JOIN jsonb_array_elements_text(j.kinds) AS a(alert)\n"
                    "                 GROUP BY a.alert) AS k)")
    return (f"SELECT {columns},\n       {alert_counts}\n"
            f"  FROM (SELECT m.*, {labels} FROM ({METRIC_JOBS}) AS m ORDER BY m.job) AS q")
