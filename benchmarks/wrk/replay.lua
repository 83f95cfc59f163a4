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
