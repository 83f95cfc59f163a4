-- Idempotency records (DESIGN.md §3, §5). `{table}` is the configured, quoted table name;
-- `{name}` the bare table name, used to name its index. Times are integer milliseconds since
-- the UNIX epoch, from the store's clock.
CREATE TABLE IF NOT EXISTS {table} (
    scope       BLOB    NOT NULL,
    key         TEXT    NOT NULL,
    token       INTEGER NOT NULL,
    fingerprint BLOB    NOT NULL,
    fp_version  INTEGER NOT NULL,
    -- 0 reserved, 1 completed.
    state       INTEGER NOT NULL CHECK (state IN (0, 1)),
    lease_until INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "{name}_expires_at_idx" ON {table} (expires_at);
