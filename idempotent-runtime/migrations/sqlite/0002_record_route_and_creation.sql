-- What an operator's inspect reads (DESIGN.md §5 "Admin"): the route pattern a record was claimed
-- on and when it was claimed, in milliseconds (a completed record's completion time is its
-- `lease_until`). Nullable: rows written before read as unknown.
ALTER TABLE {table} ADD COLUMN route TEXT;
ALTER TABLE {table} ADD COLUMN created_at INTEGER;
