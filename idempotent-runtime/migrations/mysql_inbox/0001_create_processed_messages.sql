-- The inbox's markers on MySQL / MariaDB InnoDB (DESIGN.md §6). `{table}` is the configured,
-- backtick-quoted table name; `{name}` the bare one, which names its index.
CREATE TABLE IF NOT EXISTS {table} (
    -- Bytes, no collation: two message ids that differ only in case are two messages.
    consumer     VARBINARY(255) NOT NULL,
    message_id   VARBINARY(512) NOT NULL,
    -- Milliseconds since the UNIX epoch by the database's clock.
    processed_at BIGINT         NOT NULL,
    -- A duplicate is recognised by error 1062 on this key (`PRIMARY`), never another's.
    PRIMARY KEY (consumer, message_id),
    -- The sweeper's predicate: one consumer's markers older than the retention.
    KEY `{name}_sweep_idx` (consumer, processed_at)
) ENGINE = InnoDB
