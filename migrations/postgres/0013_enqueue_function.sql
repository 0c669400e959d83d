-- Enqueue from any language, inside the producer's own transaction (issue
-- 27): `SELECT idem_enqueue(plugin => 'send_invoice_email', payload =>
-- '{"invoice_id":42}'::jsonb, key => 'invoice-42')` inserts a job in the
-- caller's transaction (the outbox: the business row and its job commit or
-- roll back together) and returns its id, or the existing job's id when the
-- plugin already has a job under that key (as `idem enqueue` does). A
-- second transaction enqueuing the same key waits for the first one's
-- uncommitted row, then gets its id (or inserts, if the first rolled back).
-- `idem_enqueue_many(jsonb)` takes an array of objects with the same fields
-- and returns the ids in input order; one bad element refuses the call,
-- naming the element (from 0).
--
-- The checks are those of every other producer path (runtime/src/store/
-- input.rs, runtime/src/boundary.rs; the shared vectors in
-- tests/vectors/strings.json are run through these functions by
-- tests/tests/producers.rs): queue and plugin names, the key, the group and
-- the correlation id, the payload limit (1 MiB of JSON text), attempts at
-- least 1. A refusal is SQLSTATE 22023 with a message naming the field,
-- `idem_enqueue: key "a\u{7}" refused: only printable ASCII is allowed`.
-- Times come from the store's clock (the database clock plus idem_clock's
-- offset, zero but in tests), so `run_at => NULL` is now to the workers.
-- The insert wakes workers like any other (the NOTIFY trigger of 0005, sent
-- when the transaction commits).
--
-- max_attempts: NULL now means "not chosen by the producer": the claim that
-- first takes the job resolves it, from the plugin's operator file
-- (`max_attempts` in <plugin>.toml), else the worker's configured
-- `max_attempts`, and writes it into the row, so retries, rescues and the
-- dead-letter decision read a number as before. A SQL producer does not
-- know the plugins' files; the worker that runs the job does. Waiting jobs
-- are the only ones that can hold a NULL.
--
-- SECURITY DEFINER with a fixed search_path: the producer's role needs only
-- EXECUTE on the two functions (granted by the operator; no PUBLIC grant),
-- no privilege on idem's tables, and the functions find idem's tables in
-- the schema they were created in whatever the caller's search_path.
ALTER TABLE jobs ALTER COLUMN max_attempts DROP NOT NULL;

-- A value for an error message: quoted, everything but printable ASCII
-- escaped as \u{hex}, cut to 80 characters (as boundary::shown).
CREATE FUNCTION idem_shown(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT '"' || COALESCE((
        SELECT string_agg(CASE
                WHEN c IN ('"', '\') THEN '\' || c
                WHEN c ~ '^[ -~]$' THEN c
                ELSE '\u{' || to_hex(ascii(c)) || '}'
            END, '' ORDER BY i)
        FROM unnest(string_to_array(left(value, 80), NULL)) WITH ORDINALITY AS u(c, i)
    ), '') || '"' || CASE WHEN length(value) > 80 THEN '...' ELSE '' END
$$;

-- Why a queue or plugin name is refused (boundary::name), or NULL.
CREATE FUNCTION idem_name_refusal(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT CASE
        WHEN value = '' THEN 'it is empty'
        WHEN octet_length(value) > 128 THEN 'it is too long'
        WHEN value !~ '^[A-Za-z0-9_.:-]+$'
            THEN 'only ASCII letters, digits and _ . : - are allowed'
    END
$$;

-- Why a key, group or correlation id is refused (boundary::idempotency_key,
-- boundary::correlation_id: 1..=255 printable ASCII bytes), or NULL.
CREATE FUNCTION idem_key_refusal(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT CASE
        WHEN value = '' THEN 'it is empty'
        WHEN octet_length(value) > 255 THEN 'it is longer than 255 bytes'
        WHEN value ~ '[^ -~]' THEN 'only printable ASCII is allowed'
    END
$$;

-- Checks one job and inserts it; `context` starts every refusal
-- (`idem_enqueue`, `idem_enqueue_many: element 3`). NULL means the default
-- for every field but plugin and payload.
CREATE FUNCTION idem_enqueue_checked(
    context        text,
    p_plugin       text,
    p_payload      jsonb,
    p_key          text,
    p_queue        text,
    p_run_at       timestamptz,
    p_priority     integer,
    p_max_attempts integer,
    p_group_key    text,
    p_correlation  text
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_queue   text := COALESCE(p_queue, 'default');
    v_now     bigint;
    v_run_at  bigint;
    v_payload bytea;
    v_id      bigint;
    v_why     text;
BEGIN
    IF p_plugin IS NULL THEN
        RAISE EXCEPTION '%: plugin is required', context USING ERRCODE = '22023';
    END IF;
    v_why := idem_name_refusal(p_plugin);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION '%: plugin % refused: %', context, idem_shown(p_plugin), v_why
            USING ERRCODE = '22023';
    END IF;
    v_why := idem_name_refusal(v_queue);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION '%: queue % refused: %', context, idem_shown(v_queue), v_why
            USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION '%: payload is required (a JSON value, e.g. ''{}''::jsonb)', context
            USING ERRCODE = '22023';
    END IF;
    v_payload := convert_to(p_payload::text, 'UTF8');
    IF octet_length(v_payload) > 1048576 THEN
        RAISE EXCEPTION '%: payload refused: it is % bytes, at most 1048576 allowed: store large data elsewhere and enqueue a reference',
            context, octet_length(v_payload) USING ERRCODE = '22023';
    END IF;
    v_why := idem_key_refusal(p_key);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION '%: key % refused: %', context, idem_shown(p_key), v_why
            USING ERRCODE = '22023';
    END IF;
    v_why := idem_key_refusal(p_group_key);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION '%: group_key % refused: %', context, idem_shown(p_group_key), v_why
            USING ERRCODE = '22023';
    END IF;
    v_why := idem_key_refusal(p_correlation);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION '%: correlation_id % refused: %', context, idem_shown(p_correlation), v_why
            USING ERRCODE = '22023';
    END IF;
    IF p_max_attempts IS NOT NULL AND p_max_attempts < 1 THEN
        RAISE EXCEPTION '%: max_attempts % refused: it must be at least 1 (or NULL: the plugin''s or the configured default)',
            context, p_max_attempts USING ERRCODE = '22023';
    END IF;
    v_now := (extract(epoch from statement_timestamp()) * 1000)::bigint
        + (SELECT offset_ms FROM idem_clock WHERE id = 1);
    IF p_run_at IS NULL THEN
        v_run_at := v_now;
    ELSIF NOT isfinite(p_run_at) THEN
        RAISE EXCEPTION '%: run_at % refused: it must be a finite time', context, p_run_at
            USING ERRCODE = '22023';
    ELSE
        v_run_at := floor(extract(epoch from p_run_at) * 1000)::bigint;
        -- As the Rust path bounds a delay: about 100 years.
        IF v_run_at > v_now + 3153600000000 THEN
            RAISE EXCEPTION '%: run_at % refused: it is more than 100 years ahead', context, p_run_at
                USING ERRCODE = '22023';
        END IF;
    END IF;

    -- A conflicting job can be pruned between the insert and the read:
    -- try again then (pruning only removes old finished jobs).
    FOR n_try IN 1..3 LOOP
        INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, state,
                          max_attempts, correlation_id, created_at, updated_at, group_key)
        VALUES (v_queue, p_plugin, v_payload, p_key, COALESCE(p_priority, 0), v_run_at,
                'available', p_max_attempts,
                COALESCE(p_correlation, replace(gen_random_uuid()::text, '-', '')),
                v_now, v_now, p_group_key)
        ON CONFLICT (plugin, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
        -- A new statement: under READ COMMITTED it sees the row the insert
        -- waited for.
        SELECT id INTO v_id FROM jobs WHERE plugin = p_plugin AND idempotency_key = p_key;
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
    END LOOP;
    RAISE EXCEPTION '%: key % of plugin % conflicts on insert but cannot be read',
        context, idem_shown(p_key), idem_shown(p_plugin);
END
$$;

CREATE FUNCTION idem_enqueue(
    plugin       text,
    payload      jsonb,
    key          text        DEFAULT NULL,
    queue        text        DEFAULT 'default',
    run_at       timestamptz DEFAULT NULL,
    priority     integer     DEFAULT 0,
    max_attempts integer     DEFAULT NULL,
    group_key    text        DEFAULT NULL,
    correlation_id text      DEFAULT NULL
) RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER AS $$
    SELECT idem_enqueue_checked('idem_enqueue', plugin, payload, key, queue, run_at, priority,
                                max_attempts, group_key, correlation_id)
$$;

-- One element of idem_enqueue_many's array, as a field of the given type.
CREATE FUNCTION idem_enqueue_field(context text, element jsonb, field text, kind text)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    value jsonb := element -> field;
BEGIN
    IF value IS NULL OR jsonb_typeof(value) = 'null' THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(value) <> kind THEN
        RAISE EXCEPTION '%: % must be a JSON %, not %', context, field, kind, jsonb_typeof(value)
            USING ERRCODE = '22023';
    END IF;
    RETURN value;
END
$$;

-- An integer field of idem_enqueue_many's element, in PostgreSQL's integer range.
CREATE FUNCTION idem_enqueue_int(context text, element jsonb, field text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    value numeric := idem_enqueue_field(context, element, field, 'number')::text::numeric;
BEGIN
    IF value IS NULL THEN
        RETURN NULL;
    END IF;
    IF value <> trunc(value) OR value < -2147483648 OR value > 2147483647 THEN
        RAISE EXCEPTION '%: % % refused: it must be a whole number in -2147483648..=2147483647',
            context, field, value USING ERRCODE = '22023';
    END IF;
    RETURN value::integer;
END
$$;

CREATE FUNCTION idem_enqueue_many(jobs jsonb) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $$
DECLARE
    element jsonb;
    i       bigint;
    context text;
    unknown text;
    run_at  timestamptz;
    ids     bigint[] := '{}';
BEGIN
    IF jobs IS NULL OR jsonb_typeof(jobs) <> 'array' THEN
        RAISE EXCEPTION 'idem_enqueue_many: the argument must be a JSON array of objects, not %',
            COALESCE(jsonb_typeof(jobs), 'NULL') USING ERRCODE = '22023';
    END IF;
    FOR element, i IN SELECT e.value, e.ordinality - 1 FROM jsonb_array_elements(jobs) WITH ORDINALITY AS e
    LOOP
        context := format('idem_enqueue_many: element %s', i);
        IF jsonb_typeof(element) <> 'object' THEN
            RAISE EXCEPTION '%: must be a JSON object, not %', context, jsonb_typeof(element)
                USING ERRCODE = '22023';
        END IF;
        SELECT k INTO unknown FROM jsonb_object_keys(element) AS k
        WHERE k NOT IN ('plugin', 'payload', 'key', 'queue', 'run_at', 'priority',
                        'max_attempts', 'group_key', 'correlation_id')
        LIMIT 1;
        IF unknown IS NOT NULL THEN
            RAISE EXCEPTION '%: unknown field % (fields: plugin, payload, key, queue, run_at, priority, max_attempts, group_key, correlation_id)',
                context, idem_shown(unknown) USING ERRCODE = '22023';
        END IF;
        run_at := NULL;
        IF idem_enqueue_field(context, element, 'run_at', 'string') IS NOT NULL THEN
            BEGIN
                run_at := (element ->> 'run_at')::timestamptz;
            EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
                RAISE EXCEPTION '%: run_at % refused: it is not a timestamp (e.g. "2026-01-31T12:00:00Z")',
                    context, idem_shown(element ->> 'run_at') USING ERRCODE = '22023';
            END;
        END IF;
        ids := ids || idem_enqueue_checked(
            context,
            idem_enqueue_field(context, element, 'plugin', 'string') #>> '{}',
            -- A JSON null payload is a value, not an absent one.
            element -> 'payload',
            idem_enqueue_field(context, element, 'key', 'string') #>> '{}',
            idem_enqueue_field(context, element, 'queue', 'string') #>> '{}',
            run_at,
            idem_enqueue_int(context, element, 'priority'),
            idem_enqueue_int(context, element, 'max_attempts'),
            idem_enqueue_field(context, element, 'group_key', 'string') #>> '{}',
            idem_enqueue_field(context, element, 'correlation_id', 'string') #>> '{}');
    END LOOP;
    RETURN ids;
END
$$;

-- Only the operator grants these (GRANT EXECUTE ON FUNCTION idem_enqueue(text, jsonb, text, text,
-- timestamptz, integer, integer, text, text), idem_enqueue_many(jsonb) TO app), and every
-- function finds idem's tables in this schema, whatever the caller's search_path.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'idem_shown(text)',
        'idem_name_refusal(text)',
        'idem_key_refusal(text)',
        'idem_enqueue_checked(text, text, jsonb, text, text, timestamptz, integer, integer, text, text)',
        'idem_enqueue(text, jsonb, text, text, timestamptz, integer, integer, text, text)',
        'idem_enqueue_field(text, jsonb, text, text)',
        'idem_enqueue_int(text, jsonb, text)',
        'idem_enqueue_many(jsonb)'
    ] LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
    END LOOP;
END
$$;
