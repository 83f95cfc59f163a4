-- The outbox's messages (DESIGN.md §6). `{table}` is the configured, quoted and
-- schema-qualified table name; `{name}` the bare one, which names its constraints and indexes.
CREATE TABLE IF NOT EXISTS {table} (
    -- Insertion order: per ordering key, messages go out in this order among the committed.
    seq           bigint      GENERATED ALWAYS AS IDENTITY,
    -- The stable id receivers deduplicate by; enqueuing it again is a no-op.
    id            text        NOT NULL,
    destination   text        NOT NULL,
    ordering_key  text,
    header_names  text[]      NOT NULL DEFAULT '{}',
    header_values text[]      NOT NULL DEFAULT '{}',
    payload       bytea       NOT NULL,
    state         text        NOT NULL DEFAULT 'pending'
                              CONSTRAINT "{name}_state_check" CHECK (state IN ('pending', 'delivered', 'dead')),
    -- Claims so far: a relay that died mid-publish counts.
    attempts      integer     NOT NULL DEFAULT 0,
    -- Not claimed before this time (backoff after a failure).
    available_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The claim: a relay holds the message until lease_until, under lease_token.
    lease_until   timestamptz,
    lease_token   bigint,
    last_error    text,
    enqueued_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at  timestamptz,
    CONSTRAINT "{name}_pkey" PRIMARY KEY (id)
);
-- The relay's claim: pending messages in insertion order.
CREATE INDEX IF NOT EXISTS "{name}_pending_idx" ON {table} (seq) WHERE state = 'pending';
-- The per-key check: is an earlier message of this key still pending?
CREATE INDEX IF NOT EXISTS "{name}_key_idx" ON {table} (ordering_key, seq)
    WHERE state = 'pending' AND ordering_key IS NOT NULL;
-- The sweeper: delivered messages older than the retention.
CREATE INDEX IF NOT EXISTS "{name}_sweep_idx" ON {table} (delivered_at) WHERE state = 'delivered';
-- The operators' list of dead letters.
CREATE INDEX IF NOT EXISTS "{name}_dead_idx" ON {table} (seq) WHERE state = 'dead';
