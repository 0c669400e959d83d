-- Attempts charged to jobs that ran (issue 22). A claim no longer proves
-- the job ran: jobs claimed ahead wait in a worker's buffer, and a crash
-- there must not cost them an attempt.
-- * jobs.started: 0 from the claim until the worker records that the
--   attempt's plugin call began (carried by the job's next heartbeat, or
--   implied by its stored plan). Rows that exist already count as started.
-- * jobs.unstarted_rescues: rescues of claims that never started; each
--   gives the attempt back, and at the bound the job is dead with
--   `rescued_unstarted` (a host that dies every time this job starts).
-- * effects.claim_job, effects.claim_attempt: the job and attempt whose
--   claim holds the key now, so a claim retried by its own claimer (a batch
--   that committed but answered an error) is recognised as the same claim.
ALTER TABLE jobs ADD COLUMN started BIGINT NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD COLUMN unstarted_rescues BIGINT NOT NULL DEFAULT 0;
ALTER TABLE effects ADD COLUMN claim_job BIGINT NOT NULL DEFAULT 0;
ALTER TABLE effects ADD COLUMN claim_attempt BIGINT NOT NULL DEFAULT 0;
