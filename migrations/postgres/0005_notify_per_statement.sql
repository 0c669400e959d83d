-- Wake-ups on insert: one trigger call per statement instead of one per row.
-- A batch enqueue of 20,000 jobs spent a third of its time calling the
-- row trigger (measured: 300 ms with it, 204 ms with this one, 185 ms with
-- none). The new rows are read from the statement's transition table; as
-- before, a rolled-back insert wakes nobody and one notification goes per
-- queue.
DROP TRIGGER jobs_notify_insert ON jobs;

CREATE FUNCTION idem_jobs_notify_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_jobs', ready.queue)
    FROM (SELECT DISTINCT queue FROM inserted_jobs
          WHERE state IN ('available', 'retrying')
            AND run_at <= (extract(epoch from clock_timestamp()) * 1000)::bigint) AS ready;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS inserted_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION idem_jobs_notify_inserted();
