-- Issue 24: error messages stored before URLs were redacted may hold a
-- provider's URL with its credential (a webhook's secret path, `?api_key=`,
-- a password). The store redacts them once, at open, with the function that
-- redacts every new message (runtime/src/store/upgrade.rs), and deletes the
-- task's row when done: one rule for old and new rows.
CREATE TABLE IF NOT EXISTS idem_upgrade_tasks (
    name TEXT PRIMARY KEY
);
INSERT INTO idem_upgrade_tasks (name) VALUES ('redact_error_urls') ON CONFLICT DO NOTHING;
