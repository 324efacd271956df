"""Every statement the Python client sends: constants, named notation, explicit columns.

Shared by the sync (``ledger.client``) and async (``ledger.aio``) clients. The
client never builds SQL from pieces; it only binds parameters. Columns are
listed by name so that a column added to a type or view later (the contract
allows additions) does not break the typed rows.

``time_left`` (``expires_at - clock_timestamp()`` on the server) lets the
heartbeat keep a local deadline without trusting the client's clock.
"""

from __future__ import annotations

# -- leases -----------------------------------------------------------------

ACQUIRE = """
SELECT l.job, l.owner, l.token, l.acquired_at, l.expires_at,
       l.expires_at - clock_timestamp() AS time_left
  FROM ledger.acquire(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s) AS l
"""

RENEW = """
SELECT e AS expires_at, e - clock_timestamp() AS time_left
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

HEARTBEAT = """
SELECT e AS expires_at, e - clock_timestamp() AS time_left
  FROM ledger.heartbeat(run_id => %(run_id)s, token => %(token)s, ttl => %(ttl)s) AS e
"""

COMPLETE_RUN = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.started_at,
       r.heartbeat_at, r.completed_at, r.failure_reason, r.error, r.detail
  FROM ledger.complete_run(run_id => %(run_id)s, token => %(token)s, detail => %(detail)s) AS r
"""

FAIL_RUN = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.started_at,
       r.heartbeat_at, r.completed_at, r.failure_reason, r.error, r.detail
  FROM ledger.fail_run(run_id => %(run_id)s, token => %(token)s, error => %(error)s,
                       detail => %(detail)s) AS r
"""

CANCEL_RUN = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.started_at,
       r.heartbeat_at, r.completed_at, r.failure_reason, r.error, r.detail
  FROM ledger.cancel_run(run_id => %(run_id)s, token => %(token)s, error => %(error)s) AS r
"""

GET_RUN = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.started_at,
       r.heartbeat_at, r.completed_at, r.failure_reason, r.error, r.detail
  FROM ledger.job_execution_log AS r
 WHERE r.run_id = %(run_id)s
"""

REAP_EXPIRED = "SELECT ledger.reap_expired(job => %(job)s)"

# -- schedules --------------------------------------------------------------

REGISTER_JOB = """
SELECT j.job, j.schedule, j.time_zone, j.ttl, j.max_backfill, j.paused, j.created_at, j.updated_at
  FROM ledger.register_job(job => %(job)s, schedule => %(schedule)s, ttl => %(ttl)s,
                           max_backfill => %(max_backfill)s, time_zone => %(time_zone)s) AS j
"""

PAUSE_JOB = "SELECT ledger.pause_job(job => %(job)s)"

RESUME_JOB = "SELECT ledger.resume_job(job => %(job)s)"

DUE_SLOTS = "SELECT s FROM ledger.due_slots(job => %(job)s, at => %(at)s) AS s"

# -- reporting --------------------------------------------------------------

JOB_STATUS = """
SELECT js.job, js.schedule, js.time_zone, js.ttl, js.max_backfill, js.paused, js.holder, js.token,
       js.lease_expires_at, js.last_run_id, js.last_status, js.last_started_at,
       js.last_completed_at, js.last_success_at, js.running_run_id, js.running_for, js.next_slot,
       js.overdue, js.consecutive_failures, js.runs_started, js.successes, js.failures,
       js.skipped_overlap, js.skipped_backfill, js.leases_lost
  FROM ledger.job_status AS js
 WHERE js.job = %(job)s
"""

JOB_STATUSES = """
SELECT js.job, js.schedule, js.time_zone, js.ttl, js.max_backfill, js.paused, js.holder, js.token,
       js.lease_expires_at, js.last_run_id, js.last_status, js.last_started_at,
       js.last_completed_at, js.last_success_at, js.running_run_id, js.running_for, js.next_slot,
       js.overdue, js.consecutive_failures, js.runs_started, js.successes, js.failures,
       js.skipped_overlap, js.skipped_backfill, js.leases_lost
  FROM ledger.job_status AS js
 ORDER BY js.job
"""

PURGE_LOG = "SELECT ledger.purge_log(older_than => %(older_than)s)"
