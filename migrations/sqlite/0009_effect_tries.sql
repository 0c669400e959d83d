-- When the latest try of an effect that may have reached its provider was
-- claimed (issue 25): a provider's "not applied" answer to a lookup is
-- trusted only for a try older than the provider's timeout plus its settle
-- delay. try_at: set by every claim, and put back to prior_try_at when the
-- claim ends without calling the provider (a deferral, a refusal), so a
-- claim that only asked does not make the try look younger. prior_try_at:
-- the try_at a takeover found (the claim answers its age).
ALTER TABLE effects ADD COLUMN try_at INTEGER;
ALTER TABLE effects ADD COLUMN prior_try_at INTEGER;
-- The reconcile sweep asks about a key no sooner than this (set when its
-- provider could not answer, or answered what fits neither outcome), so keys
-- that stay unknown do not crowd out the rest; cleared by a claim.
ALTER TABLE effects ADD COLUMN ask_after INTEGER;
