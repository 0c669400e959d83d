-- Only a group's head is claimable (issue 27, the groups review): the jobs
-- behind it wait in the state `blocked`, outside the claim's index, so a
-- claim never reads past them (a hot group of 10,000 waiting jobs cost every
-- claim 9 ms). The transaction that ends a group's live job (succeeded,
-- dead, cancelled) makes the group's oldest blocked job `available`
-- (runtime/src/store/queries.rs, `group_next`); an insert behind an open
-- job of its group leaves the new job blocked (`group_open`; SQLite has one
-- writer, so nothing ends that job meanwhile). The view `idem_enqueue` does
-- the same.
--
-- SQLite cannot change a CHECK in place: `jobs` is rebuilt as in 0012 (every
-- row, index and the id high-water mark kept); the view's trigger, which
-- names `jobs`, is dropped first and made again.

DROP TRIGGER idem_enqueue_insert;

CREATE TABLE jobs_rebuilt (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    queue              TEXT    NOT NULL CHECK (queue <> ''),
    plugin             TEXT    NOT NULL CHECK (plugin <> ''),
    payload            BLOB    NOT NULL,
    idempotency_key    TEXT,
    priority           INTEGER NOT NULL DEFAULT 0,
    run_at             INTEGER NOT NULL,
    state              TEXT    NOT NULL CHECK (state = 'available' OR state = 'running'
                           OR state = 'retrying' OR state = 'succeeded' OR state = 'dead'
                           OR state = 'cancelled' OR state = 'blocked'),
    attempt            INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    -- NULL: resolved by the first claim (the plugin's file, else the worker's default).
    max_attempts       INTEGER CHECK (max_attempts >= 1),
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
    deferred_since     INTEGER,
    interruptions      INTEGER NOT NULL DEFAULT 0,
    started            INTEGER NOT NULL DEFAULT 1,
    unstarted_rescues  INTEGER NOT NULL DEFAULT 0,
    group_key          TEXT
) STRICT;

INSERT INTO jobs_rebuilt (id, queue, plugin, payload, idempotency_key, priority, run_at, state,
    attempt, max_attempts, lease_owner, lease_until, heartbeat_at, last_error_code,
    last_error_message, errors, correlation_id, plugin_hash, plan, plan_hash, rescues,
    created_at, updated_at, finished_at, first_failed_at, last_failed_at, deferred_since,
    interruptions, started, unstarted_rescues, group_key)
SELECT id, queue, plugin, payload, idempotency_key, priority, run_at, state,
    attempt, max_attempts, lease_owner, lease_until, heartbeat_at, last_error_code,
    last_error_message, errors, correlation_id, plugin_hash, plan, plan_hash, rescues,
    created_at, updated_at, finished_at, first_failed_at, last_failed_at, deferred_since,
    interruptions, started, unstarted_rescues, group_key
FROM jobs ORDER BY id;

DELETE FROM sqlite_sequence WHERE name = 'jobs_rebuilt';
INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs_rebuilt', seq FROM sqlite_sequence WHERE name = 'jobs';
DROP TABLE jobs;
ALTER TABLE jobs_rebuilt RENAME TO jobs;

-- The indexes of 0012, with jobs_group_open (a group's open jobs in
-- enqueue order) in place of jobs_group_waiting.
CREATE UNIQUE INDEX jobs_plugin_key ON jobs (plugin, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_claim ON jobs (queue, priority DESC, run_at, id, state)
    WHERE state IN ('available', 'retrying');
CREATE INDEX jobs_running ON jobs (lease_until, queue) WHERE state = 'running';
CREATE INDEX jobs_finished ON jobs (finished_at, state, queue)
    WHERE state IN ('succeeded', 'dead', 'cancelled');
CREATE INDEX jobs_dead ON jobs (plugin, last_error_code) WHERE state = 'dead';
CREATE UNIQUE INDEX jobs_group_running ON jobs (group_key)
    WHERE group_key IS NOT NULL AND state = 'running';
CREATE INDEX jobs_group_open ON jobs (group_key, id)
    WHERE group_key IS NOT NULL AND state IN ('available', 'retrying', 'running', 'blocked');

-- Jobs already waiting behind their group's head become blocked.
UPDATE jobs SET state = 'blocked'
WHERE group_key IS NOT NULL AND state IN ('available', 'retrying')
  AND EXISTS (SELECT 1 FROM jobs h
              WHERE h.group_key = jobs.group_key
                AND h.state IN ('available', 'retrying', 'running')
                AND (h.state = 'running' OR h.id < jobs.id));

CREATE TRIGGER idem_enqueue_insert INSTEAD OF INSERT ON idem_enqueue
BEGIN
    -- plugin and queue: boundary::name, 1..=128 bytes of A-Z a-z 0-9 _ . : -
    SELECT RAISE(ABORT, 'idem_enqueue: plugin is required') WHERE NEW.plugin IS NULL;
    SELECT RAISE(ABORT, 'idem_enqueue: plugin refused: it must be text')
        WHERE typeof(NEW.plugin) <> 'text';
    SELECT RAISE(ABORT, 'idem_enqueue: plugin refused: it is empty')
        WHERE length(CAST(NEW.plugin AS BLOB)) = 0;
    SELECT RAISE(ABORT, 'idem_enqueue: plugin refused: it is too long')
        WHERE length(CAST(NEW.plugin AS BLOB)) > 128;
    SELECT RAISE(ABORT, 'idem_enqueue: plugin refused: only ASCII letters, digits and _ . : - are allowed')
        WHERE instr(CAST(NEW.plugin AS BLOB), x'00') > 0 OR NEW.plugin GLOB '*[^A-Za-z0-9_.:-]*';
    SELECT RAISE(ABORT, 'idem_enqueue: queue refused: it must be text')
        WHERE NEW.queue IS NOT NULL AND typeof(NEW.queue) <> 'text';
    SELECT RAISE(ABORT, 'idem_enqueue: queue refused: it is empty')
        WHERE length(CAST(NEW.queue AS BLOB)) = 0;
    SELECT RAISE(ABORT, 'idem_enqueue: queue refused: it is too long')
        WHERE length(CAST(NEW.queue AS BLOB)) > 128;
    SELECT RAISE(ABORT, 'idem_enqueue: queue refused: only ASCII letters, digits and _ . : - are allowed')
        WHERE instr(CAST(NEW.queue AS BLOB), x'00') > 0 OR NEW.queue GLOB '*[^A-Za-z0-9_.:-]*';

    -- payload: JSON text, at most MAX_PAYLOAD_BYTES (1 MiB).
    SELECT RAISE(ABORT, 'idem_enqueue: payload is required (JSON text, e.g. ''{}'')')
        WHERE NEW.payload IS NULL;
    SELECT RAISE(ABORT, 'idem_enqueue: payload refused: it must be JSON text')
        WHERE typeof(NEW.payload) <> 'text' OR instr(CAST(NEW.payload AS BLOB), x'00') > 0
           OR NOT json_valid(NEW.payload);
    SELECT RAISE(ABORT, 'idem_enqueue: payload refused: it is over 1048576 bytes: store large data elsewhere and enqueue a reference')
        WHERE length(CAST(NEW.payload AS BLOB)) > 1048576;

    -- key, group_key, correlation_id: boundary::idempotency_key,
    -- 1..=255 printable ASCII bytes.
    SELECT RAISE(ABORT, 'idem_enqueue: key refused: it must be text')
        WHERE NEW.key IS NOT NULL AND typeof(NEW.key) <> 'text';
    SELECT RAISE(ABORT, 'idem_enqueue: key refused: it is empty')
        WHERE length(CAST(NEW.key AS BLOB)) = 0;
    SELECT RAISE(ABORT, 'idem_enqueue: key refused: it is longer than 255 bytes')
        WHERE length(CAST(NEW.key AS BLOB)) > 255;
    SELECT RAISE(ABORT, 'idem_enqueue: key refused: only printable ASCII is allowed')
        WHERE instr(CAST(NEW.key AS BLOB), x'00') > 0 OR NEW.key GLOB '*[^ -~]*';
    SELECT RAISE(ABORT, 'idem_enqueue: group_key refused: it must be text')
        WHERE NEW.group_key IS NOT NULL AND typeof(NEW.group_key) <> 'text';
    SELECT RAISE(ABORT, 'idem_enqueue: group_key refused: it is empty')
        WHERE length(CAST(NEW.group_key AS BLOB)) = 0;
    SELECT RAISE(ABORT, 'idem_enqueue: group_key refused: it is longer than 255 bytes')
        WHERE length(CAST(NEW.group_key AS BLOB)) > 255;
    SELECT RAISE(ABORT, 'idem_enqueue: group_key refused: only printable ASCII is allowed')
        WHERE instr(CAST(NEW.group_key AS BLOB), x'00') > 0 OR NEW.group_key GLOB '*[^ -~]*';
    SELECT RAISE(ABORT, 'idem_enqueue: correlation_id refused: it must be text')
        WHERE NEW.correlation_id IS NOT NULL AND typeof(NEW.correlation_id) <> 'text';
    SELECT RAISE(ABORT, 'idem_enqueue: correlation_id refused: it is empty')
        WHERE length(CAST(NEW.correlation_id AS BLOB)) = 0;
    SELECT RAISE(ABORT, 'idem_enqueue: correlation_id refused: it is longer than 255 bytes')
        WHERE length(CAST(NEW.correlation_id AS BLOB)) > 255;
    SELECT RAISE(ABORT, 'idem_enqueue: correlation_id refused: only printable ASCII is allowed')
        WHERE instr(CAST(NEW.correlation_id AS BLOB), x'00') > 0
           OR NEW.correlation_id GLOB '*[^ -~]*';

    -- Numbers: integers, in the ranges the Rust types hold.
    SELECT RAISE(ABORT, 'idem_enqueue: priority refused: it must be an integer in -2147483648..=2147483647')
        WHERE NEW.priority IS NOT NULL AND (typeof(NEW.priority) <> 'integer'
            OR NEW.priority < -2147483648 OR NEW.priority > 2147483647);
    SELECT RAISE(ABORT, 'idem_enqueue: max_attempts refused: it must be an integer in 1..=2147483647 (or NULL: the plugin''s or the configured default)')
        WHERE NEW.max_attempts IS NOT NULL AND (typeof(NEW.max_attempts) <> 'integer'
            OR NEW.max_attempts < 1 OR NEW.max_attempts > 2147483647);
    SELECT RAISE(ABORT, 'idem_enqueue: run_at refused: it must be an integer, ms since the Unix epoch (or NULL: now)')
        WHERE NEW.run_at IS NOT NULL AND typeof(NEW.run_at) <> 'integer';
    -- As the Rust path bounds a delay: about 100 years.
    SELECT RAISE(ABORT, 'idem_enqueue: run_at refused: it is more than 100 years ahead')
        WHERE NEW.run_at > (julianday('now') - 2440587.5) * 86400000.0 + 3153600000000
            + (SELECT offset_ms FROM idem_clock WHERE id = 1);

    -- The store's clock: the database clock plus idem_clock's offset (zero
    -- but in tests). A key already held inserts nothing.
    INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, state,
                      max_attempts, correlation_id, created_at, updated_at, group_key)
    SELECT COALESCE(NEW.queue, 'default'), NEW.plugin, CAST(NEW.payload AS BLOB), NEW.key,
           COALESCE(NEW.priority, 0), COALESCE(NEW.run_at, clock.now),
           -- Behind an open job of its group: blocked (one writer, so
           -- nothing can end that job before this commits).
           CASE WHEN NEW.group_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM jobs o WHERE o.group_key = NEW.group_key
                      AND o.state IN ('available', 'retrying', 'running', 'blocked'))
                THEN 'blocked' ELSE 'available' END,
           NEW.max_attempts, COALESCE(NEW.correlation_id, lower(hex(randomblob(16)))),
           clock.now, clock.now, NEW.group_key
    FROM (SELECT CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)
                     + offset_ms AS now
          FROM idem_clock WHERE id = 1) AS clock
    WHERE true
    ON CONFLICT (plugin, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;

    INSERT INTO idem_enqueue_last (id, job_id)
    VALUES (1, CASE WHEN NEW.key IS NULL THEN last_insert_rowid()
                    ELSE (SELECT id FROM jobs WHERE plugin = NEW.plugin AND idempotency_key = NEW.key)
               END)
    ON CONFLICT (id) DO UPDATE SET job_id = excluded.job_id;
END;
