-- Heap-only completions (DESIGN.md §5): the completion changes no indexed column, so where its
-- page has room PostgreSQL writes no index entry for it, and a first request writes one entry
-- in each of the table's two indexes, at the claim.
--
-- The sweeper no longer finds expired rows by `expires_at` (the completion sets it) but by
-- `sweep_after`, set when a record is claimed to the earliest it can expire: claim time plus
-- retention. A reservation expires at `lease_until + retention`, a completed record at
-- completion time plus retention, and both times are later than the claim, so
-- `sweep_after <= expires_at` (a completion kept for less than the claim's retention lowers
-- `sweep_after` to its own expiry; one kept as long leaves it unchanged, which does not stand in
-- the way of a heap-only update). The sweeper reads `sweep_after <= now AND expires_at <= now`.
--
-- Rows claimed before this migration read `-infinity` (no rewrite: a constant default is stored
-- once, not in every row) and are checked against their `expires_at` by each sweep until they
-- are gone, within one retention.
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS sweep_after timestamptz NOT NULL DEFAULT '-infinity';
CREATE INDEX IF NOT EXISTS "{name}_sweep_after_idx" ON {table} (sweep_after);
DROP INDEX IF EXISTS {schema}"{name}_expires_at_idx";
-- Room on each page for a completion to stay on it (new pages only; existing ones fill as rows
-- are freed).
ALTER TABLE {table} SET (fillfactor = 70);
