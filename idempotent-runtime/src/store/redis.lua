-- Shared by every script of the Redis store (src/store/redis.rs), prepended to each one.
--
-- A record is one string value, `{prefix}:{<scope hex>}:<key>`, with this layout (1-based
-- positions as Lua's string.sub counts them; integers big-endian):
--
--   1       format: 1, or 2 for a completed record with trailers
--   2       state: 0 reserved, 1 completed, 2 released (a tombstone: bytes 1..10 alone)
--   3..10   fencing token
--   11..18  lease_until, ms since the epoch by the server's clock
--   19..26  expires_at, ms (the key's TTL is set to the same instant)
--   27..28  fingerprint encoding version
--   29..60  fingerprint digest
--   61..62  status (0 while reserved)
--   63..66  length of the encoded headers
--   67..    format 1: the headers (RecordedResponse::encode_headers), then the body;
--           format 2: the headers, the length of the encoded trailers (4 bytes), the trailers
--           (RecordedResponse::encode_trailers), then the body
--
-- The scripts read bytes 1..60 only, which both formats share; the store decodes the rest. A
-- record without trailers is still written in format 1, so a release that knows only format 1
-- reads it; one that meets format 2 refuses it as unknown rather than replaying it without its
-- trailers.
--
-- ARGV[1] of every script is the test clock offset in ms (0 outside tests), added to TIME.
--
-- Beside the record, in its slot (a space cannot occur in a key): `<record> meta` (creation
-- time, route) and `<record> room` (the answer's room, set aside by the claim).

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
end

local function u64(s, at)
  local n = 0
  for i = at, at + 7 do
    n = n * 256 + string.byte(s, i)
  end
  return n
end

local function be64(n)
  local b = {}
  for i = 8, 1, -1 do
    b[i] = n % 256
    n = math.floor(n / 256)
  end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8])
end
