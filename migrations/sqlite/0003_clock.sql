-- The store's clock offset: zero in production. Tests that open the store
-- with an adjustable clock move it forward instead of sleeping.
CREATE TABLE idem_clock (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    offset_ms INTEGER NOT NULL
) STRICT;
INSERT INTO idem_clock (id, offset_ms) VALUES (1, 0);
