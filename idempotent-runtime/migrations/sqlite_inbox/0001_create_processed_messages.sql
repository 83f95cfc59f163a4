-- The inbox's markers on SQLite (DESIGN.md §6). `{table}` is the configured, quoted table name;
-- `{name}` the bare one, which names its index.
CREATE TABLE IF NOT EXISTS {table} (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    -- Milliseconds since the UNIX epoch by the inbox's clock.
    processed_at INTEGER NOT NULL,
    -- A duplicate is recognised by this key's constraint failure, naming its two columns.
    PRIMARY KEY (consumer, message_id)
);
-- The sweeper's predicate: one consumer's markers older than the retention.
CREATE INDEX IF NOT EXISTS "{name}_sweep_idx" ON {table} (consumer, processed_at);
