-- One at a time per entity (issue 27): a job may name a group (a concurrency
-- key, e.g. an order id). At most one job of a group runs at a time, in
-- enqueue order.
-- * jobs_group_running: the database holds the promise. Two claims whose
--   snapshots disagree about a group's head (a job committed late with a
--   lower id, a replayed dead job) cannot both mark a job of the group
--   running: the second fails on this index and claims again.
-- * jobs_group_waiting: a claim finds whether a waiting job of the group
--   comes before the one it looks at (the group's head is its oldest
--   unfinished job; a retrying head keeps its place).
-- Jobs without a group are in neither index.
ALTER TABLE jobs ADD COLUMN group_key TEXT COLLATE "C";
CREATE UNIQUE INDEX jobs_group_running ON jobs (group_key)
    WHERE group_key IS NOT NULL AND state = 'running';
CREATE INDEX jobs_group_waiting ON jobs (group_key, id)
    WHERE group_key IS NOT NULL AND state IN ('available', 'retrying');

-- Wake-ups: when a job of a group finishes (or is cancelled), the next job
-- of its group may be claimed, and no insert announces it. Only grouped
-- jobs call the function (the WHEN clause is checked in C for every row).
CREATE FUNCTION idem_jobs_notify_group_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_jobs', NEW.queue);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_group_moved AFTER UPDATE OF state ON jobs
    FOR EACH ROW
    WHEN (OLD.group_key IS NOT NULL AND NEW.state IN ('succeeded', 'dead', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION idem_jobs_notify_group_moved();
