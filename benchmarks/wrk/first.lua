-- First requests: POST /orders with the 1 KiB JSON body and a fresh Idempotency-Key on every
-- request (thread id + counter, so keys never repeat within a run; each server starts empty).
-- Every request also carries a fresh session cookie (22 base64url characters), which only the
-- axum-idempotent peer reads: it records nothing for a request without a session, and a fresh
-- session per request keeps its per-session field map at one entry (its most favourable case).
-- Other servers ignore the cookie.
local counter = 0
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function init(args)
  local f = assert(io.open(os.getenv("BODY_FILE") or "benchmarks/wrk/order.json", "rb"))
  body = f:read("*a")
  f:close()
end

function request()
  counter = counter + 1
  local headers = {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = string.format("first-%d-%d", tid, counter),
    ["Cookie"] = string.format("session=%010d%011dA", tid, counter),
  }
  return wrk.format("POST", "/orders", headers, body)
end
