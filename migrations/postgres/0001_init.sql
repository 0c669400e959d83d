-- idem store schema, PostgreSQL. Times are BIGINT milliseconds since the Unix
-- epoch from the database clock. Objects are created unqualified, so they land
-- in the schema first on the connection's search_path.

CREATE TABLE jobs (
    id                 BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue              TEXT    NOT NULL CHECK (queue <> ''),
    plugin             TEXT    NOT NULL CHECK (plugin <> ''),
    payload            BYTEA   NOT NULL,
    idempotency_key    TEXT,
    priority           INTEGER NOT NULL DEFAULT 0,
    run_at             BIGINT  NOT NULL,
    state              TEXT    NOT NULL CHECK (state IN
                           ('available', 'running', 'retrying', 'succeeded', 'dead', 'cancelled')),
    attempt            BIGINT  NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts       BIGINT  NOT NULL CHECK (max_attempts >= 1),
    lease_owner        TEXT,
    lease_until        BIGINT,
    heartbeat_at       BIGINT,
    last_error_code    TEXT,
    last_error_message TEXT,
    -- Array of error records, oldest first, bounded by the store.
    errors             JSONB   NOT NULL DEFAULT '[]'::jsonb,
    correlation_id     TEXT    NOT NULL,
    plugin_hash        TEXT,
    -- Text, not JSONB: the plan is kept byte for byte as the plugin returned it.
    plan               TEXT,
    plan_hash          TEXT,
    rescues            BIGINT  NOT NULL DEFAULT 0,
    created_at         BIGINT  NOT NULL,
    updated_at         BIGINT  NOT NULL,
    finished_at        BIGINT,
    first_failed_at    BIGINT,
    last_failed_at     BIGINT,
    -- NULL keys are distinct: only keyed jobs are deduplicated.
    CONSTRAINT jobs_plugin_key UNIQUE (plugin, idempotency_key)
);

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

-- Wake-ups: every job that becomes runnable now notifies 'idem_jobs' with its
-- queue, inside the writing transaction (so a rolled-back enqueue wakes
-- nobody). PostgreSQL folds identical notifications of one transaction, so a
-- batch insert sends one per queue.
CREATE FUNCTION idem_jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_jobs', NEW.queue);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobs FOR EACH ROW
    WHEN (NEW.state IN ('available', 'retrying')
          AND NEW.run_at <= (extract(epoch from clock_timestamp()) * 1000)::bigint)
    EXECUTE FUNCTION idem_jobs_notify();

CREATE TRIGGER jobs_notify_update AFTER UPDATE OF state ON jobs FOR EACH ROW
    WHEN (NEW.state IN ('available', 'retrying') AND OLD.state IS DISTINCT FROM NEW.state
          AND NEW.run_at <= (extract(epoch from clock_timestamp()) * 1000)::bigint)
    EXECUTE FUNCTION idem_jobs_notify();

-- The effect ledger: one row per effect idempotency key. No foreign key to
-- jobs: the ledger must outlive pruned jobs, or a replayed or re-enqueued
-- operation would repeat its effects.
CREATE TABLE effects (
    key             TEXT   PRIMARY KEY,
    job_id          BIGINT NOT NULL,
    plugin          TEXT   NOT NULL,
    provider        TEXT   NOT NULL,
    fingerprint     TEXT   NOT NULL,
    status          TEXT   NOT NULL CHECK (status IN ('processing', 'succeeded', 'retrying', 'failed')),
    attempt         BIGINT NOT NULL CHECK (attempt >= 1),
    lease_owner     TEXT,
    lease_until     BIGINT,
    result_ref      TEXT,
    last_error_code TEXT,
    last_error_at   BIGINT,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);

CREATE INDEX effects_job ON effects (job_id);
