-- First requests: POST /orders with the 1 KiB JSON body and a fresh Idempotency-Key on every
-- request (thread id + counter, so keys never repeat within a run; each server starts empty).
-- Every request also carries a fresh session cookie (22 base64url characters), which only the
-- axum-idempotent peer reads: it records nothing for a request without a session, and a fresh
-- session per request keeps its per-session field map at one entry (its most favourable case).
-- Other servers ignore the cookie.
local counter = 0
local threads = 0

all_threads = {}

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
  table.insert(all_threads, thread)
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

-- Every answer is checked: throughput counts only fresh 201 answers, never marked replayed; scripts/bench reads the count below.
unexpected = 0

-- Header names arrive as the server wrote them (lowercase from hyper and actix).
function replayed(headers)
  for name, value in pairs(headers) do
    if string.lower(name) == "idempotency-replayed" then
      return value
    end
  end
  return nil
end

function response(status, headers, body)
  if status ~= 201 or replayed(headers) ~= nil then
    unexpected = unexpected + 1
  end
end

function done(summary, latency, requests)
  local n = 0
  for _, t in ipairs(all_threads) do
    n = n + t:get("unexpected")
  end
  io.write(string.format("Unexpected responses: %d\n", n))
end
