-- Idempotency records (DESIGN.md §3, §5). `{table}` is the configured, quoted and
-- schema-qualified table name; `{name}` the bare table name, used to name its index.
CREATE TABLE IF NOT EXISTS {table} (
    scope       bytea       NOT NULL,
    key         text        NOT NULL,
    -- Fencing token of the current holder (or of whoever completed the record).
    token       bigint      NOT NULL,
    fingerprint bytea       NOT NULL,
    fp_version  smallint    NOT NULL,
    -- 0 reserved, 1 completed.
    state       smallint    NOT NULL CHECK (state IN (0, 1)),
    -- Times come from the database's clock, so replicas never disagree about a lease.
    lease_until timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    status      smallint,
    headers     bytea,
    body        bytea,
    PRIMARY KEY (scope, key)
);

-- The sweeper's predicate: `expires_at <= now()`.
CREATE INDEX IF NOT EXISTS "{name}_expires_at_idx" ON {table} (expires_at);
