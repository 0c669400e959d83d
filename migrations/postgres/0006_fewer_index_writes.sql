-- Fewer index writes per state change (issue 8). Every transition of a job
-- (claim, finish, retry) rewrote an entry of jobs_state_queue (state, queue)
-- besides the partial index of the state it left and the one it entered.
-- Counts per state now read the partial index of each state group, which
-- carries the state and the queue for them:
--   waiting  (available, retrying)       jobs_claim
--   running                               jobs_running (was jobs_lease)
--   finished (succeeded, dead, cancelled) jobs_finished
DROP INDEX jobs_state_queue;

DROP INDEX jobs_claim;
CREATE INDEX jobs_claim ON jobs (queue, priority DESC, run_at, id, state)
    WHERE state IN ('available', 'retrying');

DROP INDEX jobs_lease;
CREATE INDEX jobs_running ON jobs (lease_until, queue) WHERE state = 'running';

DROP INDEX jobs_finished;
CREATE INDEX jobs_finished ON jobs (finished_at, state, queue)
    WHERE state IN ('succeeded', 'dead', 'cancelled');

-- Every update of a job that is not HOT (each transition changes an indexed
-- column) inserted a new entry into the (plugin, idempotency_key) index,
-- keyed or not; only keyed jobs need one (NULL keys are distinct anyway).
-- Inserts name the predicate in ON CONFLICT so the index is still inferred.
ALTER TABLE jobs DROP CONSTRAINT jobs_plugin_key;
CREATE UNIQUE INDEX jobs_plugin_key ON jobs (plugin, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
