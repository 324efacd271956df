-- The ledger's tables and their invariants: constraints and unique partial
-- indexes hold them whatever the writer, not only the functions.

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
    CONSTRAINT jobs_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT jobs_max_backfill_positive CHECK (max_backfill >= 1),
    CONSTRAINT jobs_schedule_parsed CHECK ((schedule IS NULL) = (schedule_spec IS NULL))
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
    CONSTRAINT skipped_slots_reason_valid CHECK (reason IN ('backfill_limit'))
);
COMMENT ON TABLE ledger.skipped_slots IS 'Ranges of schedule slots the catch-up bound dropped';

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
    CONSTRAINT leases_token_positive CHECK (token > 0),
    CONSTRAINT leases_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT leases_timeline_positive CHECK (timeline > 0),
    CONSTRAINT leases_released_ends_lease CHECK (released_at IS NULL OR expires_at <= released_at)
);
COMMENT ON TABLE ledger.leases IS 'Per-job lease: holder, fencing token, expiry';

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
    CONSTRAINT log_status_valid CHECK (status IN ('running', 'success', 'failure')),
    CONSTRAINT log_failure_reason_valid
        CHECK (failure_reason IN ('error', 'lease_expired', 'superseded', 'cancelled')),
    CONSTRAINT log_reason_iff_failure CHECK ((status = 'failure') = (failure_reason IS NOT NULL)),
    CONSTRAINT log_completed_iff_ended CHECK ((status = 'running') = (completed_at IS NULL)),
    CONSTRAINT log_completed_after_start CHECK (completed_at >= started_at),
    CONSTRAINT log_slot_finite CHECK (isfinite(slot)),
    CONSTRAINT log_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT log_token_positive CHECK (token > 0),
    -- a token is issued once, so it names at most one run
    CONSTRAINT log_one_run_per_token UNIQUE (job, token)
);
COMMENT ON TABLE ledger.job_execution_log IS 'One row per run: running, success or failure';

-- At most one running run per job.
CREATE UNIQUE INDEX job_execution_log_one_running
    ON ledger.job_execution_log (job) WHERE status = 'running';
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

-- Monotonic per-job counters. Skips leave no run row, and purge_log removes
-- old rows, so counting the log would undercount and go backwards.
CREATE TABLE ledger.counters (
    job              ledger.label PRIMARY KEY,
    runs_started     bigint NOT NULL DEFAULT 0,
    successes        bigint NOT NULL DEFAULT 0,
    failures         bigint NOT NULL DEFAULT 0,
    skipped_overlap  bigint NOT NULL DEFAULT 0,
    skipped_backfill bigint NOT NULL DEFAULT 0,
    leases_lost      bigint NOT NULL DEFAULT 0,
    CONSTRAINT counters_non_negative CHECK (
        runs_started >= 0 AND successes >= 0 AND failures >= 0
        AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0)
);
COMMENT ON TABLE ledger.counters IS 'Monotonic per-job counters behind ledger.job_counters';

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
