-- The ledger's tables and their invariants: constraints and unique partial
-- indexes hold them whatever the writer, not only the functions.

-- Pools: a limit shared by jobs, whichever they are: at most `size` live
-- leases of its member jobs at once (63_pools.sql). A start that would
-- exceed it is skipped as skipped_pool_full, never an error.
CREATE TABLE ledger.pools (
    pool        ledger.label PRIMARY KEY,
    size        integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The last start the pool admitted, written under the row's lock by
    -- each admission: a start in a REPEATABLE READ transaction whose
    -- snapshot predates another's admission then fails (40001) instead of
    -- counting the pool without it.
    admitted_at timestamptz,
    CONSTRAINT pools_size_valid CHECK (size BETWEEN 1 AND 100000)
);
COMMENT ON TABLE ledger.pools IS 'Named limits shared by jobs: at most size live leases of the member jobs at once';

CREATE TABLE ledger.jobs (
    job           ledger.label PRIMARY KEY,
    schedule      text,
    time_zone     text        NOT NULL DEFAULT 'UTC',
    ttl           interval,
    max_backfill  integer     NOT NULL DEFAULT 1,
    paused        boolean     NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The schedule parsed once, at registration (see 15_schedule_eval.sql).
    schedule_spec ledger.schedule_spec,
    -- Health bounds (ledger.job_health), all optional: the grace before a
    -- due slot not started is late; no success for longer than down_after
    -- is down; a success shorter than min_runtime is too fast; a run longer
    -- than max_runtime overruns (and `jobledger run` stops it there); the
    -- end of the Nth failure in a row pauses the job.
    late_after           interval,
    down_after           interval,
    min_runtime          interval,
    max_runtime          interval,
    pause_after_failures integer,
    -- When and why the job was paused: 'operator' (pause_job) or 'failures'
    -- (pause_after_failures); NULL while it runs free.
    paused_at     timestamptz,
    pause_reason  text,
    -- The scheduler's options (62_scheduler.sql): a per-slot start offset
    -- in [0, jitter), derived from (job, slot) so every host agrees; a slot
    -- not started within start_deadline after its due time (+ jitter) is
    -- skipped, never run late; what a slot or a trigger that comes due
    -- during a live run does (docs/contract.md, Overlap policies).
    jitter         interval,
    start_deadline interval,
    overlap_policy text        NOT NULL DEFAULT 'catch_up',
    -- The source (a jobs file) that last defined the job through
    -- ledger.sync_jobs; NULL for a job registered by hand.
    defined_by     text,
    -- The pool the job belongs to (ledger.pools), NULL: none. Its lease
    -- row carries a copy (ledger.leases.pool), written with it under the
    -- job's lease row lock, so a start reads it from the row it locks.
    pool           ledger.label REFERENCES ledger.pools (pool),
    -- Up to this many live runs (and bare leases) at once, each in its own
    -- seat with its own token (ledger.lease_seats); 1 is the single holder.
    -- Last: the column an upgrade adds.
    max_concurrent integer     NOT NULL DEFAULT 1,
    CONSTRAINT jobs_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT jobs_bounds_positive CHECK (late_after > interval '0' AND down_after > interval '0'
                                           AND min_runtime > interval '0' AND max_runtime > interval '0'
                                           AND pause_after_failures >= 1),
    CONSTRAINT jobs_pause_reason_valid CHECK (pause_reason IS NULL
                                              OR (pause_reason IN ('operator', 'failures', 'removed') AND paused)),
    CONSTRAINT jobs_overlap_policy_valid CHECK (overlap_policy IN ('catch_up', 'skip', 'buffer_one', 'replace')),
    CONSTRAINT jobs_jitter_valid CHECK (jitter > interval '0' AND jitter <= interval '24 hours'),
    CONSTRAINT jobs_start_deadline_positive CHECK (start_deadline > interval '0'),
    CONSTRAINT jobs_max_backfill_positive CHECK (max_backfill >= 1),
    CONSTRAINT jobs_schedule_parsed CHECK ((schedule IS NULL) = (schedule_spec IS NULL)),
    CONSTRAINT jobs_max_concurrent_valid CHECK (max_concurrent BETWEEN 1 AND 1000)
);
COMMENT ON TABLE ledger.jobs IS 'Registered jobs: schedule, time zone, default ttl, catch-up bound, paused';

-- Slots the catch-up bound dropped: one row per drop, a range of slots, so a
-- year of downtime costs one row, not half a million.
CREATE TABLE ledger.skipped_slots (
    job         ledger.label NOT NULL REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    first_slot  timestamptz NOT NULL,
    last_slot   timestamptz NOT NULL,
    slot_count  bigint      NOT NULL,
    reason      text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT skipped_slots_pkey PRIMARY KEY (job, first_slot),
    CONSTRAINT skipped_slots_range CHECK (first_slot <= last_slot),
    CONSTRAINT skipped_slots_count CHECK (slot_count >= 1 AND (slot_count = 1) = (first_slot = last_slot)),
    CONSTRAINT skipped_slots_reason_valid CHECK (reason IN ('backfill_limit', 'start_deadline', 'overlap'))
);
COMMENT ON TABLE ledger.skipped_slots IS
    'Ranges of schedule slots not run: dropped by the catch-up bound, past their start deadline, or skipped by the overlap policy';

-- One row per job that ever held a lease. The row is never deleted: its
-- token is the job's high-water mark, and a token is never issued twice.
CREATE TABLE ledger.leases (
    job         ledger.label PRIMARY KEY,
    owner       ledger.label NOT NULL,
    token       bigint      NOT NULL,
    ttl         interval    NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_at timestamptz,
    -- WAL timeline that issued `token`: a change means a standby was
    -- promoted, and the next token jumps past anything the old primary issued.
    timeline    integer     NOT NULL,
    -- The job's pool (ledger.jobs.pool, copied under this row's lock): a
    -- live lease of a row with a pool counts against that pool's size.
    pool        ledger.label,
    -- Seats mode (a job registered with max_concurrent > 1, for good): the
    -- row is only the job's token counter, kept released, so every check
    -- of a live token on it fails, and each holder is a row of
    -- ledger.lease_seats. Last: the column an upgrade adds.
    multi       boolean     NOT NULL DEFAULT false,
    CONSTRAINT leases_token_positive CHECK (token > 0),
    CONSTRAINT leases_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT leases_timeline_positive CHECK (timeline > 0),
    CONSTRAINT leases_released_ends_lease CHECK (released_at IS NULL OR expires_at <= released_at),
    CONSTRAINT leases_multi_released CHECK (NOT multi OR released_at IS NOT NULL)
);
COMMENT ON TABLE ledger.leases IS 'Per-job lease: holder, fencing token, expiry';
-- A pool's live leases, counted by each start of a member job
-- (ledger._pool_admits). pool rarely changes, so the renewals of the row
-- stay HOT updates.
CREATE INDEX leases_pool ON ledger.leases (pool) WHERE pool IS NOT NULL;

-- The holders of a job in seats mode (ledger.leases.multi): one row per
-- seat ever taken, 1 to the job's max_concurrent, each a lease of its own.
-- Its token is issued by the job's row in ledger.leases (the high-water
-- mark), so the tokens of all seats of a job are strictly increasing and
-- never issued twice. Written only under the job's lease row lock.
CREATE TABLE ledger.lease_seats (
    job         ledger.label NOT NULL REFERENCES ledger.leases (job),
    seat        integer     NOT NULL,
    owner       ledger.label NOT NULL,
    token       bigint      NOT NULL,
    ttl         interval    NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_at timestamptz,
    -- the seat's running run (NULL: none, or a bare acquire): what the
    -- job's state reads to tell a crashed seat without reading the log
    run_id      bigint,
    CONSTRAINT lease_seats_pkey PRIMARY KEY (job, seat),
    CONSTRAINT lease_seats_one_per_token UNIQUE (job, token),
    CONSTRAINT lease_seats_seat_valid CHECK (seat BETWEEN 1 AND 1000),
    CONSTRAINT lease_seats_token_positive CHECK (token > 0),
    CONSTRAINT lease_seats_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT lease_seats_released_ends_lease CHECK (released_at IS NULL OR expires_at <= released_at)
);
COMMENT ON TABLE ledger.lease_seats IS 'Per job in seats mode (max_concurrent > 1): each seat''s holder, token, expiry';

-- A fence belongs to the job that first wrote through it: tokens are counted
-- per job, so only that job's tokens can be compared with the one recorded.
CREATE TABLE ledger.fences (
    resource    ledger.label PRIMARY KEY,
    job         ledger.label NOT NULL REFERENCES ledger.leases (job),
    token       bigint      NOT NULL,
    advanced_at timestamptz NOT NULL,
    CONSTRAINT fences_token_positive CHECK (token > 0)
);
COMMENT ON TABLE ledger.fences IS 'Per-resource highest accepted fencing token, and the job it belongs to';

CREATE TABLE ledger.job_execution_log (
    run_id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job             ledger.label NOT NULL REFERENCES ledger.leases (job),
    owner           ledger.label NOT NULL,
    token           bigint      NOT NULL,
    slot            timestamptz,
    idempotency_key ledger.label,
    status          text        NOT NULL,
    started_at      timestamptz NOT NULL,
    heartbeat_at    timestamptz,
    completed_at    timestamptz,
    failure_reason  text,
    error           text,
    detail          jsonb,
    -- An operator asked the run to stop (ledger.request_cancel): the
    -- holder's next heartbeat ends it as cancelled and answers NULL.
    cancel_requested_at timestamptz,
    -- The seat the run holds (ledger.lease_seats); 1 for a single-holder
    -- job. Last: the column an upgrade adds.
    seat            integer     NOT NULL DEFAULT 1,
    CONSTRAINT log_status_valid CHECK (status IN ('running', 'success', 'failure')),
    CONSTRAINT log_failure_reason_valid
        CHECK (failure_reason IN ('error', 'lease_expired', 'superseded', 'cancelled')),
    CONSTRAINT log_reason_iff_failure CHECK ((status = 'failure') = (failure_reason IS NOT NULL)),
    CONSTRAINT log_completed_iff_ended CHECK ((status = 'running') = (completed_at IS NULL)),
    CONSTRAINT log_completed_after_start CHECK (completed_at >= started_at),
    CONSTRAINT log_slot_finite CHECK (isfinite(slot)),
    CONSTRAINT log_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT log_token_positive CHECK (token > 0),
    CONSTRAINT log_seat_valid CHECK (seat BETWEEN 1 AND 1000),
    -- a token is issued once, so it names at most one run
    CONSTRAINT log_one_run_per_token UNIQUE (job, token)
);
COMMENT ON TABLE ledger.job_execution_log IS 'One row per run: running, success or failure';

-- At most one running run per job and seat (a single-holder job has seat 1
-- only: one running run).
CREATE UNIQUE INDEX job_execution_log_one_running
    ON ledger.job_execution_log (job, seat) WHERE status = 'running';
-- At most one running-or-successful run per (job, slot) and per (job, key);
-- a failed slot may be retried. The first also finds a job's newest done slot.
CREATE UNIQUE INDEX job_execution_log_one_per_slot
    ON ledger.job_execution_log (job, slot)
    WHERE status IN ('running', 'success') AND slot IS NOT NULL;
CREATE UNIQUE INDEX job_execution_log_one_per_key
    ON ledger.job_execution_log (job, idempotency_key)
    WHERE status IN ('running', 'success') AND idempotency_key IS NOT NULL;
-- Reports, the overlap audit and purge read runs by job in time order.
CREATE INDEX job_execution_log_job_started
    ON ledger.job_execution_log (job, started_at);

-- Each known job's state row: its monotonic counters and its state as the
-- log says it, one row per job that was registered, took a lease or ran
-- (ledger.job_status, job_health and alerts list exactly these jobs).
-- One writer: ledger._set_state (27_state.sql), called by every function
-- that changes a job's runs or registration, after it took the job's lease
-- row, so the row never lags its log and two writers never interleave.
-- Skips leave no run row, and purge_log removes old rows, so counting the
-- log would undercount and go backwards: the counts are kept, not counted.
CREATE TABLE ledger.counters (
    job              ledger.label PRIMARY KEY,
    runs_started     bigint NOT NULL DEFAULT 0,
    successes        bigint NOT NULL DEFAULT 0,
    failures         bigint NOT NULL DEFAULT 0,
    skipped_overlap  bigint NOT NULL DEFAULT 0,
    skipped_backfill bigint NOT NULL DEFAULT 0,
    leases_lost      bigint NOT NULL DEFAULT 0,
    -- The job's state, so that the whole-ledger reads (job_status,
    -- job_health, alerts, a metrics scrape) cost per job, not per log row,
    -- and never evaluate a schedule. Each is what the log (and what
    -- purge_log removed of it: ledger.purged_state) says, as
    -- ledger._state_from_log recomputes it and ledger.verify_state checks:
    --   last_*          the run that started last (started_at, run_id);
    --   last_success_*  the success that started last;
    --   running_*       the running run;
    --   done_slot       the newest slot that succeeded;
    --   longest_success the longest successful run;
    --   consecutive_failures  failures started after the last success
    --                   started; a cancel (failure_reason 'cancelled') is
    --                   no failure here: it neither adds nor resets;
    --   next_due        the job's first slot after done_slot (after its
    --                   registration while none succeeded); NULL without a
    --                   schedule. Once it is older than the grace, the job
    --                   is late;
    --   down_due        the ledger._down_after_slots()th slot after the
    --                   same instant: once it is older than the grace, the
    --                   job is down;
    --   latest_end      the latest end of any of its runs;
    --   overlap_run_id  the newest run that started before an earlier run
    --                   ended (none: NULL), the alerts' overlap audit in
    --                   O(1) per job. The writers start a run only once the
    --                   previous one ended, so only a write past the
    --                   functions or a clock stepped back sets it.
    last_run_id             bigint,
    last_status             text,
    last_started_at         timestamptz,
    last_completed_at       timestamptz,
    last_success_started_at timestamptz,
    last_success_at         timestamptz,
    running_run_id          bigint,
    running_token           bigint,
    running_started_at      timestamptz,
    done_slot               timestamptz,
    longest_success         interval,
    consecutive_failures    bigint NOT NULL DEFAULT 0,
    next_due                timestamptz,
    latest_end              timestamptz,
    overlap_run_id          bigint,
    down_due                timestamptz,
    -- slots skipped because their start deadline had passed (last: the
    -- column 0007 added, where an upgrade puts it)
    skipped_deadline        bigint NOT NULL DEFAULT 0,
    -- starts skipped because the job's pool was full (0010 added it)
    skipped_pool_full       bigint NOT NULL DEFAULT 0,
    CONSTRAINT counters_non_negative CHECK (
        runs_started >= 0 AND successes >= 0 AND failures >= 0
        AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0
        AND consecutive_failures >= 0 AND skipped_deadline >= 0),
    CONSTRAINT counters_pool_full_non_negative CHECK (skipped_pool_full >= 0)
);
COMMENT ON TABLE ledger.counters IS 'Each known job''s state row: its counters and its state from the log (one writer: ledger._set_state)';

-- Skips counted without a WAL flush: a skip (another owner's live lease)
-- writes only this UNLOGGED table, so its commit waits for no disk, and it
-- issues no token. One row per job and backend shard (pg_backend_pid() % 16),
-- so concurrent skippers of one hot job rarely wait for each other, and a
-- few spare rows per shard (ledger._count_skips: shard + 16, + 32, + 48) for
-- a skip whose row another transaction holds (an end folding it). The
-- ending of a run folds the job's pending skips into ledger.counters (rows it
-- can lock without waiting); a crash loses at most the skips not folded yet
-- (harmless: no decision depends on a skip count). ledger.job_counters adds
-- both.
CREATE UNLOGGED TABLE ledger.skip_counts (
    job             ledger.label NOT NULL,
    shard           smallint    NOT NULL,
    skipped_overlap bigint      NOT NULL DEFAULT 0,
    CONSTRAINT skip_counts_pkey PRIMARY KEY (job, shard),
    CONSTRAINT skip_counts_non_negative CHECK (skipped_overlap >= 0)
);
COMMENT ON TABLE ledger.skip_counts IS 'Skips not yet folded into ledger.counters (unlogged: a skip costs no WAL flush)';

-- What purge_log must not forget: a slot or an idempotency key that
-- succeeded answers already_done for ever, even once its run row is gone.
-- Slots: per job, the newest slot whose success was purged (slots at or
-- before it count as done: one row per job). Keys: each purged successful
-- key, kept for ever (about 40 bytes plus the key and the job name).
CREATE TABLE ledger.purged_slots (
    job         ledger.label PRIMARY KEY,
    done_through timestamptz NOT NULL
);
COMMENT ON TABLE ledger.purged_slots IS 'Per job: slots at or before done_through succeeded, though purge_log removed their runs';

CREATE TABLE ledger.purged_keys (
    job             ledger.label NOT NULL,
    idempotency_key ledger.label NOT NULL,
    run_id          bigint      NOT NULL,
    completed_at    timestamptz NOT NULL,
    CONSTRAINT purged_keys_pkey PRIMARY KEY (job, idempotency_key)
);
COMMENT ON TABLE ledger.purged_keys IS 'Idempotency keys that succeeded, kept after purge_log removed their runs';

-- What purge_log removed that a job's state still counts, one row per job:
-- a purge never recounts the state down (ledger._state_from_log adds these
-- back). The longest success it removed; the failures it removed that had
-- started after the job's last success (whose start is streak_after, NULL:
-- none yet), which stay in the failure streak while that is still the last
-- success.
CREATE TABLE ledger.purged_state (
    job             ledger.label PRIMARY KEY,
    longest_success interval,
    streak_failures bigint      NOT NULL DEFAULT 0,
    streak_after    timestamptz,
    CONSTRAINT purged_state_streak_non_negative CHECK (streak_failures >= 0)
);
COMMENT ON TABLE ledger.purged_state IS
    'Per job: the longest success and the failures of its streak that purge_log removed, still counted in its state';

-- Run now (ledger.trigger): a manual run asked for, picked up by the next
-- start_due_run(s) of the job under its lease and overlap policy. At most
-- one pending trigger per job: a second request while one waits is the
-- same request.
CREATE TABLE ledger.triggers (
    trigger_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job          ledger.label NOT NULL REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    requested_by text,
    requested_at timestamptz NOT NULL,
    detail       jsonb,
    -- 'pending' until a start picks it: 'started' (run_id) or 'skipped'
    -- (skip_reason: 'overlap' under the skip policy, 'paused')
    status       text        NOT NULL DEFAULT 'pending',
    run_id       bigint,
    skip_reason  text,
    resolved_at  timestamptz,
    CONSTRAINT triggers_status_valid CHECK (status IN ('pending', 'started', 'skipped')),
    CONSTRAINT triggers_run_iff_started CHECK ((status = 'started') = (run_id IS NOT NULL)),
    CONSTRAINT triggers_reason_iff_skipped CHECK ((status = 'skipped') = (skip_reason IS NOT NULL)),
    CONSTRAINT triggers_skip_reason_valid CHECK (skip_reason IN ('overlap', 'paused')),
    CONSTRAINT triggers_resolved_iff_done CHECK ((status = 'pending') = (resolved_at IS NULL)),
    CONSTRAINT triggers_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT triggers_requested_by_valid CHECK (char_length(requested_by) BETWEEN 1 AND 200)
);
COMMENT ON TABLE ledger.triggers IS 'Manual runs asked for (ledger.trigger): pending, started (run_id) or skipped';
CREATE UNIQUE INDEX triggers_one_pending ON ledger.triggers (job) WHERE status = 'pending';
CREATE INDEX triggers_job_requested ON ledger.triggers (job, requested_at);

-- When a scheduler should next look at a job: at or before its next start
-- (ledger.next_start's answer for it), NULL when nothing can come due
-- (paused, or no schedule and no trigger). start_due_runs writes the exact
-- next start of each job it visits; whatever can make a start come earlier
-- (a registration or resume, a trigger, a run's end, a lease released)
-- moves it back to now (ledger._wake_job). So a round reads the jobs whose
-- mark has passed by an index range, and next_start the earliest marks,
-- not every job served: a round costs what is due, not the jobs served.
-- A mark earlier than the start (a lease extended by its heartbeat) costs
-- one visit that finds nothing and writes the later one.
CREATE TABLE ledger.wakeups (
    job ledger.label NOT NULL PRIMARY KEY REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    at  timestamptz,
    -- A start of the job found its pool full: the pool it waits a place
    -- in, and the mark it had then (its due time, which orders the waiting
    -- jobs: the oldest waits least). `at` is meanwhile when a place frees
    -- at the latest (the earliest expiry of the pool's live leases); an end
    -- or a release in the pool moves the waiting marks back to their due
    -- times (ledger._wake_job).
    pool_wait     ledger.label,
    waiting_since timestamptz
);
COMMENT ON TABLE ledger.wakeups IS
    'Per job: when a scheduler should next look at it (at or before its next start; NULL: nothing can come due)';
CREATE INDEX wakeups_at ON ledger.wakeups (at, job) WHERE at IS NOT NULL;
CREATE INDEX wakeups_pool_wait ON ledger.wakeups (pool_wait) WHERE pool_wait IS NOT NULL;

-- The live schedulers (jobledger scheduler, ledger.serve), one row each,
-- kept by ledger.scheduler_heartbeat; an expired row is a scheduler that
-- died (a graceful stop removes its row: ledger.scheduler_stop). A job that
-- expired rows serve and no live one does is down (ledger._job_state).
CREATE TABLE ledger.schedulers (
    scheduler    ledger.label PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    version      text        NOT NULL,
    jobs         text[]      NOT NULL,
    started_at   timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    stopping     boolean     NOT NULL DEFAULT false,
    CONSTRAINT schedulers_expiry_after_heartbeat CHECK (expires_at > heartbeat_at)
);
COMMENT ON TABLE ledger.schedulers IS 'Schedulers that heartbeat: host, pid, version, jobs served, expiry';

-- schedulers.jobs one row per (job, scheduler), kept by the heartbeat when
-- the list changes: a job's state reads its schedulers by primary key, not
-- by scanning every scheduler's array (10,000 jobs, 10,000 each).
CREATE TABLE ledger.scheduler_jobs (
    job       ledger.label NOT NULL,
    scheduler ledger.label NOT NULL REFERENCES ledger.schedulers (scheduler) ON DELETE CASCADE,
    CONSTRAINT scheduler_jobs_pkey PRIMARY KEY (job, scheduler)
);
COMMENT ON TABLE ledger.scheduler_jobs IS 'The jobs each scheduler serves (ledger.schedulers.jobs), one row per pair';
CREATE INDEX scheduler_jobs_scheduler ON ledger.scheduler_jobs (scheduler);

-- The upkeep leader: one scheduler at a time runs the ledger's upkeep
-- (reap_expired, sync_alerts, purges), elected by compare-and-set on this
-- one row, ttl-bound, as a lease is taken (ledger.scheduler_heartbeat).
-- term counts the changes of leader.
CREATE TABLE ledger.upkeep_leader (
    singleton   boolean     PRIMARY KEY DEFAULT true,
    scheduler   text,
    term        bigint      NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    expires_at  timestamptz,
    CONSTRAINT upkeep_leader_one_row CHECK (singleton),
    CONSTRAINT upkeep_leader_held CHECK ((scheduler IS NULL) = (expires_at IS NULL))
);
COMMENT ON TABLE ledger.upkeep_leader IS 'One row: the scheduler that runs the ledger''s upkeep, and until when';
INSERT INTO ledger.upkeep_leader DEFAULT VALUES;
