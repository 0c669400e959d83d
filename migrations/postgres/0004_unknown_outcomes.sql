-- Effects whose outcome is unknown (issue 9).
-- reached: sticky, 1 once any try may have carried the effect out (an answer
--   of success, an ambiguous failure, a holder that vanished mid-call).
-- in_doubt: 1 while idem will not send it again and an operator must say
--   what happened (`idem effects resolve`).
-- first_sent_at: when the first try was claimed for sending (the provider's
--   dedupe window counts from here).
ALTER TABLE effects ADD COLUMN reached BIGINT NOT NULL DEFAULT 0 CHECK (reached IN (0, 1));
ALTER TABLE effects ADD COLUMN in_doubt BIGINT NOT NULL DEFAULT 0 CHECK (in_doubt IN (0, 1));
ALTER TABLE effects ADD COLUMN first_sent_at BIGINT;
UPDATE effects SET first_sent_at = created_at,
    reached = CASE WHEN status <> 'failed'
                     OR last_error_code IN ('ambiguous_not_retried', 'provider_timeout',
                                            'provider_connection_lost', 'provider_error')
                   THEN 1 ELSE 0 END,
    in_doubt = CASE WHEN status = 'failed' AND last_error_code = 'ambiguous_not_retried'
                    THEN 1 ELSE 0 END;

-- Jobs: when the current run of deferrals began (bounded by max_deferral),
-- and shutdown give-backs, counted apart from attempts.
ALTER TABLE jobs ADD COLUMN deferred_since BIGINT;
ALTER TABLE jobs ADD COLUMN interruptions BIGINT NOT NULL DEFAULT 0;
-- Waiting jobs already at their last attempt (given back at shutdown by an
-- earlier release): the next claim hands out the last attempt, not one more.
UPDATE jobs SET attempt = max_attempts - 1
    WHERE state IN ('available', 'retrying') AND attempt >= max_attempts;
