-- Idempotency records on MySQL / MariaDB InnoDB (DESIGN.md §3, §5). `{table}` is the configured,
-- backtick-quoted table name; `{name}` the bare one, used to name its index. The columns are the
-- PostgreSQL store's. Times are milliseconds since the UNIX epoch by the database's clock
-- (`NOW(3)` in a UTC session): no time zone, no 2038 limit, no DST step.
CREATE TABLE IF NOT EXISTS {table} (
    scope       BINARY(32)     NOT NULL,
    -- Keys are 1-255 visible ASCII characters compared exactly: bytes, no collation.
    `key`       VARBINARY(255) NOT NULL,
    -- Fencing token of the current holder (or of whoever completed the record).
    token       BIGINT         NOT NULL,
    fingerprint VARBINARY(64)  NOT NULL,
    fp_version  SMALLINT       NOT NULL,
    -- 0 reserved, 1 completed.
    state       TINYINT        NOT NULL,
    lease_until BIGINT         NOT NULL,
    expires_at  BIGINT         NOT NULL,
    -- The earliest the record can expire (claim time plus retention; a completion only lowers
    -- it): what the sweeper's index holds, so a completion changes no indexed column and writes
    -- no secondary index entry.
    sweep_after BIGINT         NOT NULL,
    status      SMALLINT,
    -- Recorded headers and trailers, each in the crate's length-prefixed encoding.
    headers     LONGBLOB,
    body        LONGBLOB,
    trailers    LONGBLOB,
    -- What an operator's inspect reads (DESIGN.md §5 "Admin").
    route       TEXT,
    created_at  BIGINT,
    PRIMARY KEY (scope, `key`),
    KEY `{name}_sweep_after_idx` (sweep_after),
    CONSTRAINT `{name}_state_check` CHECK (state IN (0, 1))
) ENGINE = InnoDB;
