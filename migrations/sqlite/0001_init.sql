-- idem store schema, SQLite. Times are INTEGER milliseconds since the Unix
-- epoch from the database clock. STRICT tables: a wrongly typed bind fails
-- loudly instead of being stored as text.

CREATE TABLE jobs (
    -- AUTOINCREMENT: ids are never reused after pruning, so a stale fence or a
    -- ledger row can never point at a different job.
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    queue              TEXT    NOT NULL CHECK (queue <> ''),
    plugin             TEXT    NOT NULL CHECK (plugin <> ''),
    payload            BLOB    NOT NULL,
    idempotency_key    TEXT,
    priority           INTEGER NOT NULL DEFAULT 0,
    run_at             INTEGER NOT NULL,
    state              TEXT    NOT NULL CHECK (state IN
                           ('available', 'running', 'retrying', 'succeeded', 'dead', 'cancelled')),
    attempt            INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts       INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_owner        TEXT,
    lease_until        INTEGER,
    heartbeat_at       INTEGER,
    last_error_code    TEXT,
    last_error_message TEXT,
    -- JSON array of error records, oldest first, bounded by the store.
    errors             TEXT    NOT NULL DEFAULT '[]',
    correlation_id     TEXT    NOT NULL,
    plugin_hash        TEXT,
    plan               TEXT,
    plan_hash          TEXT,
    rescues            INTEGER NOT NULL DEFAULT 0,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    finished_at        INTEGER,
    first_failed_at    INTEGER,
    last_failed_at     INTEGER,
    -- NULL keys are distinct: only keyed jobs are deduplicated.
    UNIQUE (plugin, idempotency_key)
) STRICT;

-- Claims: only waiting jobs are indexed, so finished jobs are never scanned.
CREATE INDEX jobs_claim ON jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('available', 'retrying');

-- The rescuer looks for expired leases among running jobs only.
CREATE INDEX jobs_lease ON jobs (lease_until) WHERE state = 'running';

-- Counts per state and queue (stats, drained, the queue concurrency limit).
CREATE INDEX jobs_state_queue ON jobs (state, queue);

-- Pruning walks finished jobs by age.
CREATE INDEX jobs_finished ON jobs (finished_at)
    WHERE state IN ('succeeded', 'dead', 'cancelled');

-- Dead-letter filters (by plugin and error code).
CREATE INDEX jobs_dead ON jobs (plugin, last_error_code) WHERE state = 'dead';

-- The effect ledger: one row per effect idempotency key. No foreign key to
-- jobs: the ledger must outlive pruned jobs, or a replayed or re-enqueued
-- operation would repeat its effects.
CREATE TABLE effects (
    key             TEXT    PRIMARY KEY NOT NULL,
    job_id          INTEGER NOT NULL,
    plugin          TEXT    NOT NULL,
    provider        TEXT    NOT NULL,
    fingerprint     TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('processing', 'succeeded', 'retrying', 'failed')),
    attempt         INTEGER NOT NULL CHECK (attempt >= 1),
    lease_owner     TEXT,
    lease_until     INTEGER,
    result_ref      TEXT,
    last_error_code TEXT,
    last_error_at   INTEGER,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
) STRICT;

CREATE INDEX effects_job ON effects (job_id);
