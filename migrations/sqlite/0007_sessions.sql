-- Dashboard sessions (issue 24): one row per sign-in. The cookie holds a
-- random id; the row holds only its SHA-256 (`id_digest`), so a copy of the
-- table lets no one in. `token_fingerprint` is derived from the API token
-- the session was made with (never the token): a session is live only while
-- that token is configured, so changing the token ends every session made
-- with the old one. Rows are deleted once past `expires_at`, revoked or not.
CREATE TABLE sessions (
    id_digest         TEXT    PRIMARY KEY,
    token_fingerprint TEXT    NOT NULL,
    created_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    revoked_at        INTEGER
) STRICT;
CREATE INDEX sessions_by_expiry ON sessions (expires_at);
