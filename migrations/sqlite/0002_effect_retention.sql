-- Finished ledger rows are pruned by age; rows in flight are never touched.
CREATE INDEX effects_finished_by_age ON effects (updated_at) WHERE status <> 'processing';
