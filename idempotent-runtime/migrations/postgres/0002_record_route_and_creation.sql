-- What an operator's inspect reads (DESIGN.md §5 "Admin"): the route pattern a record was claimed
-- on and when it was claimed (a completed record's completion time is its `lease_until`).
-- Nullable without a default, so adding them rewrites no row; rows written before read as unknown.
-- No index: the completion changes neither, and both are read by primary key only.
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS route      text,
    ADD COLUMN IF NOT EXISTS created_at timestamptz;
