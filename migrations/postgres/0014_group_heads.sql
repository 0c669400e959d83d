-- Only a group's head is claimable (issue 27, the groups review): the jobs
-- behind it wait in the state `blocked`, outside the claim's index, so a
-- claim never reads past them (a hot group of 10,000 waiting jobs cost every
-- claim 9 ms). The transaction that ends a group's live job (succeeded,
-- dead, cancelled) makes the group's oldest blocked job `available`
-- (runtime/src/store/queries.rs, `group_next`); an insert leaves its job
-- blocked only while it holds a share lock on an open job of the group, so
-- that job cannot end before the insert commits (`group_open`).
-- Jobs enqueued through `idem_enqueue` stay `available` (the claim's head
-- check orders them): a producer's transaction must never hold up a
-- worker's.
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check CHECK (state IN
    ('available', 'running', 'retrying', 'succeeded', 'dead', 'cancelled', 'blocked'));

-- A group's open jobs in enqueue order: the claim's "no earlier waiting
-- job" check, an insert's look at the group's last open job, and the
-- promotion of the oldest blocked one. Replaces jobs_group_waiting.
CREATE INDEX jobs_group_open ON jobs (group_key, id)
    WHERE group_key IS NOT NULL AND state IN ('available', 'retrying', 'running', 'blocked');
DROP INDEX jobs_group_waiting;

-- Jobs already waiting behind their group's head become blocked.
UPDATE jobs SET state = 'blocked'
WHERE group_key IS NOT NULL AND state IN ('available', 'retrying')
  AND EXISTS (SELECT 1 FROM jobs h
              WHERE h.group_key = jobs.group_key
                AND h.state IN ('available', 'retrying', 'running')
                AND (h.state = 'running' OR h.id < jobs.id));
