-- The outbox's messages on MySQL / MariaDB InnoDB (DESIGN.md §6). `{table}` is the configured,
-- backtick-quoted table name; `{name}` the bare one, which names its indexes and the table of
-- ordering keys' locks; `{schema}` the quoted database and a dot, or nothing. Times are
-- milliseconds since the UNIX epoch by the database's clock.
CREATE TABLE IF NOT EXISTS {table} (
    -- Insertion order: per ordering key, messages go out in this order among the committed.
    seq           BIGINT         NOT NULL AUTO_INCREMENT,
    -- The stable id receivers deduplicate by, compared as bytes; enqueuing it again is a no-op.
    id            VARBINARY(255) NOT NULL,
    destination   MEDIUMTEXT     CHARACTER SET utf8mb4 NOT NULL,
    ordering_key  VARBINARY(255),
    -- The headers as a JSON array of [name, value] pairs, in order.
    headers       MEDIUMBLOB     NOT NULL,
    payload       LONGBLOB       NOT NULL,
    state         VARCHAR(9)     CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    -- Claims so far: a relay that died mid-publish counts.
    attempts      INT            NOT NULL DEFAULT 0,
    -- Not claimed before this time (backoff after a failure).
    available_at  BIGINT         NOT NULL,
    -- The claim: a relay holds the message until lease_until, under lease_token.
    lease_until   BIGINT,
    lease_token   BIGINT,
    last_error    MEDIUMTEXT     CHARACTER SET utf8mb4,
    enqueued_at   BIGINT         NOT NULL,
    delivered_at  BIGINT,
    PRIMARY KEY (id),
    UNIQUE KEY `{name}_seq_key` (seq),
    -- The relay's claim: pending messages in insertion order (and the dead letters' list).
    KEY `{name}_pending_idx` (state, seq),
    -- The per-key check: is an earlier message of this key still pending, or one in flight?
    KEY `{name}_key_idx` (ordering_key, state, seq),
    -- The sweeper: delivered messages older than the retention.
    KEY `{name}_sweep_idx` (state, delivered_at),
    CONSTRAINT `{name}_state_check` CHECK (state IN ('pending', 'delivered', 'dead'))
) ENGINE = InnoDB;
-- One row per ordering key in use: `enqueue` and `retry` lock it (an upsert in the caller's
-- transaction) before they draw a message's `seq`, so per key `seq` order is commit order.
-- The sweeper deletes the rows of keys without messages.
CREATE TABLE IF NOT EXISTS {schema}`{name}_keys` (
    ordering_key VARBINARY(255) NOT NULL,
    PRIMARY KEY (ordering_key)
) ENGINE = InnoDB;
