-- Trailers (DESIGN.md §3 "What a record holds"): the fields an answer sent after its body (HTTP
-- trailers, gRPC's `grpc-status` and `grpc-message`), allowlisted, in the encoding of `headers`
-- (each name and value as a 4-byte big-endian length and its bytes, in the order sent). NULL is
-- an answer without trailers: rows written before this migration read back with none.
ALTER TABLE {table} ADD COLUMN trailers BLOB;
