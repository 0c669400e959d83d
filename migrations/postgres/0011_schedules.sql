-- Schedules (issue 27): one row per `[[schedules]]` name, the last tick it
-- covered. Any node that sees a tick due enqueues it in one transaction that
-- first moves `last_tick_ms` forward (only to a newer tick: the conditional
-- upsert is what serialises two nodes) and then inserts the job under the
-- key `schedule:NAME:TICK`; the loser of the upsert does nothing. The row
-- outlives the jobs, so pruning old jobs never lets a past tick be enqueued
-- again. `last_job_id` is not a foreign key: jobs are pruned.
CREATE TABLE schedules (
    name         TEXT   PRIMARY KEY,
    last_tick_ms BIGINT NOT NULL,
    last_job_id  BIGINT,
    updated_at   BIGINT NOT NULL
);
