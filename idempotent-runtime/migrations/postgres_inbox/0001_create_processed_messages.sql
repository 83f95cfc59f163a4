-- The inbox's markers (DESIGN.md §6). `{table}` is the configured, quoted and schema-qualified
-- table name; `{name}` the bare one, which names its constraint and index.
--
-- Written idempotently, as releases before versioned migrations created it inline: a table
-- left by them is adopted as it is.
CREATE TABLE IF NOT EXISTS {table} (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    -- A duplicate is recognised by a unique violation of this constraint, by its name.
    CONSTRAINT "{name}_pkey" PRIMARY KEY (consumer, message_id)
);
-- The sweeper's predicate: one consumer's markers older than the retention.
CREATE INDEX IF NOT EXISTS "{name}_sweep_idx" ON {table} (consumer, processed_at);
