all_threads = {}

function setup(thread)
  table.insert(all_threads, thread)
end

-- Replays: POST /orders with the 1 KiB JSON body under one fixed Idempotency-Key (and one fixed
-- session cookie, for the axum-idempotent peer). scripts/bench sends the first request with
-- curl before wrk starts, so every request wrk sends is a replay.
function init(args)
  local f = assert(io.open(os.getenv("BODY_FILE") or "benchmarks/wrk/order.json", "rb"))
  body = f:read("*a")
  f:close()
end

function request()
  local headers = {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "replayed-key",
    ["Cookie"] = "session=000000000000000000000A",
  }
  return wrk.format("POST", "/orders", headers, body)
end

-- Every answer is checked: throughput counts only 201 answers marked `Idempotency-Replayed: true`
-- (a bare handler, run with BENCH_REPLAYED=0, replays nothing: there its 201 answers count);
-- scripts/bench reads the count below.
unexpected = 0
local want_replayed = os.getenv("BENCH_REPLAYED") ~= "0"

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
  if status ~= 201 or (want_replayed and replayed(headers) ~= "true") then
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
