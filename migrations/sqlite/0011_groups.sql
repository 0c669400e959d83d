-- One at a time per entity (issue 27): a job may name a group (a concurrency
-- key, e.g. an order id). At most one job of a group runs at a time, in
-- enqueue order.
-- * jobs_group_running: the database holds the promise (SQLite has one
--   writer, so a claim always sees the group's running job; the index is
--   the same guard as on PostgreSQL, where snapshots can disagree).
-- * jobs_group_waiting: a claim finds whether a waiting job of the group
--   comes before the one it looks at (the group's head is its oldest
--   unfinished job; a retrying head keeps its place).
-- Jobs without a group are in neither index.
ALTER TABLE jobs ADD COLUMN group_key TEXT;
CREATE UNIQUE INDEX jobs_group_running ON jobs (group_key)
    WHERE group_key IS NOT NULL AND state = 'running';
CREATE INDEX jobs_group_waiting ON jobs (group_key, id)
    WHERE group_key IS NOT NULL AND state IN ('available', 'retrying');
