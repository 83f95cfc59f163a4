//! The Redis / Valkey store ([the contract](crate::design) §5): several replicas share one Redis,
//! standalone or Redis Cluster.
//!
//! One record is one key, `{prefix}:{<scope hex>}:<key>`, holding a compact binary value (a
//! 66-byte header, then the recorded headers, trailers and body, in a versioned layout). The scope in braces is a Redis Cluster
//! hash tag: a scope's records share a slot, so the same scripts run unchanged on a cluster.
//! Every operation is one Lua script, loaded when the store connects and called by its SHA
//! (`EVALSHA`, loaded again on `NOSCRIPT`), so one round trip: it reads the record, judges its
//! lease and expiry by the server's clock (`TIME` inside the script) and writes conditionally on
//! the fencing token. Expiry is the key's TTL, so no sweeper is needed: [`Store::sweep`] does
//! nothing and says so.
//!
//! A connection failure mid-operation leaves its outcome unknown; the operation is sent again
//! (a few times, on a reconnected connection) because every script is safe to resend: a claim
//! that finds its own token reports it acquired, a completion or release resent after it landed
//! reports success, and a renewal simply renews again. A claim that still fails is answered 503
//! after the pipeline's best-effort token-conditional release, which leaves a tombstone of the
//! token so that a copy of the claim reaching Redis later writes nothing.
//!
//! A claim sets its answer's room aside in Redis (the request's
//! [`response_room`](super::ClaimRequest::response_room) plus [`HEADER_ROOM`]), so over
//! `maxmemory` a claim is refused before its handler runs, never its completion.
//!
//! ```no_run
//! # async fn example() -> Result<(), redis::RedisError> {
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::store::redis::RedisStore;
//!
//! let store = RedisStore::builder()
//!     .prefix("orders-idem")
//!     .connect("redis://127.0.0.1:6379/0")
//!     .await?;
//! let idempotency = Idempotency::builder(store).build();
//! # Ok(()) }
//! ```
//!
//! Durability is Redis's own: see the README's "Redis / Valkey" section for which failures can
//! lose an acknowledged record (and let a retry run again), and the settings that close them.
//!
//! # How it behaves
//!
//! - One record is one key, `{prefix}:{<scope hex>}:<key>`, holding a compact binary value: a
//!   66-byte header (state, token, lease and expiry times, fingerprint, status) followed by the
//!   recorded headers and body, so a reservation is 66 bytes and a completed record 66 bytes plus
//!   its headers and body (no JSON, no base64). The braces are a hash tag: on Redis Cluster a scope's
//!   records share a slot, and the same scripts run unchanged. (A single very busy caller therefore
//!   lands on one shard.)
//! - Every operation (claim, reclaim, complete, release, renew) is one Lua script, loaded when the
//!   store connects and then called by its SHA (`EVALSHA`; reloaded on `NOSCRIPT`), so one round trip:
//!   a first request costs two (claim, complete), a replay one. Each script is conditional on the
//!   fencing token and judges leases by the server's clock (`TIME` inside the script), so replicas
//!   never disagree about a lease.
//! - Expiry is the key's TTL (lease + retention for a reservation, retention for a completed
//!   record): there is nothing to sweep, and the store's sweep does nothing.
//! - A connection that fails mid-operation (a restart, a failover, `CLIENT KILL`, a timeout) gets the
//!   operation resent, up to three sends, on a reconnected connection. That is safe for every script:
//!   a resent claim that finds its own token reports it acquired, a resent completion or release
//!   that finds its first send landed reports success, a renewal renews again. A claim that still
//!   fails is answered 503 after a best-effort token-conditional release. The release leaves a
//!   tombstone of the claim's token under the key for 15 minutes (longer than TCP keeps resending a
//!   dropped connection's data), so a copy of the claim that reaches Redis after it (queued on a
//!   connection that failed; the connection manager had reconnected and sent the release on the
//!   new one) writes nothing instead of holding the key for a whole lease; any other request's claim
//!   takes the key as if it were free. A claim refused for room after a resend leaves the same
//!   tombstone. (A late copy that arrives after another request has claimed *and* released the same
//!   key in between is not covered: the tombstone is the later release's.)
//! - **Capacity: a claim Redis accepts is one whose answer it will take.** With `maxmemory` and
//!   `maxmemory-policy noeviction`, each claim sets its answer's room aside in Redis at once: a
//!   string of the endpoint's `max_response` + 4 KiB (`HEADER_ROOM`, for the status and recorded
//!   headers) beside the record, in its slot, with the reservation's TTL. The completion deletes the
//!   room as it writes the answer, and a release, forget or takeover deletes it, so every request in
//!   flight holds its `max_response` of Redis memory (counted in `used_memory`, which is what
//!   `maxmemory` is compared with) until it settles. Over `maxmemory` Redis refuses the claim's first
//!   write, so the request gets 503 `IDEMPOTENCY_STORE_FULL` before its handler runs; a replay, which
//!   writes nothing, is still answered. Completions, releases, renewals and forgets run with the
//!   `allow-oom` flag: they only replace or free what the claim holds, so a claimed answer up to
//!   `max_response` is never refused, and its retry replays it. Redis checks `maxmemory` when a
//!   script starts, so it may end up above the limit by the last accepted claim's room (and by the
//!   recorded headers of an answer beyond 4 KiB). Set `max_response` per endpoint to what its answers
//!   need: the room is allocated and zero-filled, measured on this machine (Redis 7.0.15, server
//!   time per call from `INFO commandstats`) at about 24 µs for 1 MiB and 4 µs for 200 KB, against
//!   about 3 µs for the rest of such a script; through `redis-benchmark` (4 clients) a script that
//!   sets aside and frees 1 MiB ran 15,000 times a second, 34,000 with 200 KB, 45,000 with none.
//!   Do not run it under an evicting policy (`allkeys-lru`, `volatile-*`): an evicted reservation,
//!   room or record lets its retry run again.
//! - Tested with the store contract suite and the model-based test on standalone Redis and on a
//!   three-node Redis Cluster the test starts itself; the conformance suite on both frameworks with
//!   `--store redis`; and two server processes sharing one Redis: 100 keys each sent 8 times at once
//!   ran exactly 100 handlers, and a replica SIGKILLed mid-handler leaves its key at 409 until the
//!   lease lapses, after which it runs once.
//!
//! **Durability.** A record is as durable as Redis makes its writes, and a lost record means the retry
//! runs the handler again. Three failures lose acknowledged records: a restart of a Redis that
//! persists nothing (the default of many installs, and of this project's test machines) loses all of
//! them; with `appendonly yes` and the default `appendfsync everysec`, a crash of the machine loses up
//! to about a second of writes; and a failover to a replica (Sentinel) loses whatever the replica had
//! not received yet, because replication is asynchronous. `appendonly yes` with `appendfsync always`
//! closes the first two at the cost of an fsync per write. The failover window is closed for what
//! the store acknowledges by [`RedisStoreBuilder::wait_for_replicas`]: a completion counts as
//! recorded only once that many replicas acknowledged it (`WAIT`), and one they did not acknowledge
//! in time is reported ([`StoreError::NotReplicated`]), logged and counted, its answer still sent.
//! Tested with a replica of the test's own promoted after its primary was killed: without the
//! option every completion acknowledged after the replica fell behind was lost; with it, none was.
//! If a retry must never run twice across such failures, use PostgreSQL, and its enlisted mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{ErrorKind, RedisError, Script, ScriptInvocation, ServerErrorKind, Value};
use bytes::Bytes;
use tokio::sync::oneshot;

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordState, RecordedResponse, Standing,
    StandingState, Store, StoreError, header_bytes, time_from_millis,
};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idem";

/// Bytes of a record before its headers and body (see `redis.lua` for the layout).
pub const RECORD_HEADER_LEN: usize = 66;

/// The record format of reservations, tombstones and completed records without trailers
/// (byte 0 of every value; see `redis.lua` for the layout).
const FORMAT: u8 = 1;

/// The record format of a completed record with trailers: [`FORMAT`]'s layout with the trailers'
/// length and encoding between the headers and the body. A release that reads only
/// [`FORMAT`] refuses it as an unknown format rather than replaying it without its trailers.
const FORMAT_TRAILERS: u8 = 2;

/// How often an operation is sent when its connection fails (the first send included).
const ATTEMPTS: u32 = 3;

/// The longest lease or retention a script is handed (100 years), so times stay exact in Lua's
/// doubles and `PX` accepts them.
const MAX_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// Bytes set aside at a claim beyond the body's bound, for the status and the recorded
/// headers (the allowlisted ones, typically a few hundred bytes). An answer whose headers take
/// more is still recorded; Redis is then over `maxmemory` by the excess.
pub const HEADER_ROOM: usize = 4 << 10;

/// The most bytes of room one claim sets aside: Redis's largest string (`proto-max-bulk-len`'s
/// default, 512 MiB), which no recorded answer can outgrow either.
const MAX_ROOM: usize = 512 << 20;

/// How long a release keeps its token's tombstone, so a copy of the claim delivered after the
/// release (sent on a connection that failed, still in the network or in Redis's socket buffer)
/// finds it and writes nothing instead of standing for a whole lease. 15 minutes outlasts
/// TCP's retransmission of a connection's unacknowledged data (`tcp_retries2`'s default gives
/// up after about 924 s).
const RELEASED_KEEP_MS: u64 = 15 * 60 * 1000;

/// A script: the shared prelude (`redis.lua`) then `$body`, after a `#!lua flags=...` line
/// when flags are given (a shebang must be the script's first line; Redis 7 or later).
/// `allow-oom` lets a script run when Redis is over `maxmemory`; a script without a shebang
/// runs there too but has its first write that may grow memory (a `SET`) refused with `OOM`.
macro_rules! script {
    (flags = $flags:literal, $body:literal) => {
        concat!(
            "#!lua flags=",
            $flags,
            "\n",
            include_str!("redis.lua"),
            $body
        )
    };
    ($body:literal) => {
        concat!(include_str!("redis.lua"), $body)
    };
}

/// KEYS[1] the record; ARGV: 1 clock offset, 2 token (8 bytes), 3 fingerprint (2-byte version
/// and digest), 4 lease ms, 5 retention ms, 6 stale token (reclaim) or empty (claim), 7 route,
/// 8 bytes of room to set aside for the answer. Replies `{1}` when the request's token holds
/// the key, `{2}` when this token was released before the claim arrived (nothing written),
/// else `{0, lease_until - now, record, expires_at - now}`.
///
/// No shebang, on purpose: over `maxmemory` a replay (which writes nothing) is still answered,
/// and a claim that would write has its first `SET` refused with `OOM` before anything is
/// written, so the request is refused before its handler runs. A claim Redis lets write sets
/// the answer's room aside at once (a string of that many bytes beside the record, in its
/// slot), so Redis's own `used_memory` counts every claimed answer before it is written and
/// the claims after it are refused once the rooms reach `maxmemory`.
const CLAIM: &str = script!(
    r#"
local rec = redis.call('GET', KEYS[1])
local now = now_ms()
if rec then
  local token = string.sub(rec, 3, 10)
  local state = string.byte(rec, 2)
  if state == 2 then
    -- A release's tombstone. Its own token: a copy of a claim that was released before it
    -- arrived (its connection failed), which must not stand; any other claim takes the key.
    if token == ARGV[2] then
      return {2}
    end
  else
    local reserved = state == 0
    -- A claim resent after its first send landed finds its own (unique) token.
    if token == ARGV[2] and reserved then
      return {1}
    end
    local lease_until = u64(rec, 11)
    local takeable = u64(rec, 19) <= now
      or (ARGV[6] ~= '' and token == ARGV[6] and reserved and lease_until <= now)
    if not takeable then
      return {0, lease_until - now, rec, u64(rec, 19) - now}
    end
  end
end
local lease = tonumber(ARGV[4])
local retention = tonumber(ARGV[5])
-- The first write, so the one Redis refuses over maxmemory (see above): nothing before it.
redis.call('SET', KEYS[1],
  '\1\0' .. ARGV[2] .. be64(now + lease) .. be64(now + lease + retention) .. ARGV[3]
    .. '\0\0\0\0\0\0',
  'PX', lease + retention)
-- What an operator reads beside the record (creation time, route), in its slot, never on the
-- replay path. A space cannot occur in a key, so no record is another's meta or room.
redis.call('SET', KEYS[1] .. ' meta', be64(now) .. ARGV[7], 'PX', lease + retention)
local room = KEYS[1] .. ' room'
if rec then
  -- A takeover: the previous holder's room goes, this claim's replaces it.
  redis.call('DEL', room)
end
local bytes = tonumber(ARGV[8])
if bytes > 0 then
  -- SETRANGE past the end zero-fills: the room is allocated in Redis, not built in Lua.
  redis.call('SETRANGE', room, bytes - 1, '\0')
  redis.call('PEXPIRE', room, lease + retention)
end
return {1}
"#
);

/// ARGV: 1 clock offset, 2 token, 3 retention ms, 4 the completed part (status, header length,
/// headers, then the body, or in format 2 the trailers before it), 5 `1` when resent, 6 the
/// record's format byte. Replies 1 when completed (or, resent, already completed by this token).
///
/// `allow-oom`: the answer takes the place of the room its claim set aside (deleted first), so
/// a completion never grows Redis past what the claim already holds and is never refused
/// over `maxmemory`.
const COMPLETE: &str = script!(
    flags = "allow-oom",
    r#"
local rec = redis.call('GETRANGE', KEYS[1], 0, 59)
if #rec < 60 or string.sub(rec, 3, 10) ~= ARGV[2] then
  return 0
end
if string.byte(rec, 2) ~= 0 then
  if ARGV[5] == '1' then return 1 end
  -- Sent again after its first reply was lost: its own answer, recorded, is success.
  local done = redis.call('GET', KEYS[1])
  if string.sub(done, 1, 1) == ARGV[6] and string.sub(done, 61) == ARGV[4] then return 1 end
  return 0
end
local now = now_ms()
local retention = tonumber(ARGV[3])
redis.call('DEL', KEYS[1] .. ' room')
redis.call('SET', KEYS[1],
  ARGV[6] .. '\1' .. ARGV[2] .. be64(now) .. be64(now + retention) .. string.sub(rec, 27, 60) .. ARGV[4],
  'PX', retention)
redis.call('PEXPIRE', KEYS[1] .. ' meta', retention)
return 1
"#
);

/// ARGV: 1 clock offset, 2 token, 3 `1` when resent, 4 how long the tombstone stays (ms).
/// Replies 1 when the reservation was deleted (or, resent, is gone).
///
/// The reservation, its meta and its room go, and a tombstone holding the token takes the
/// record's place (also where there was no record: the best-effort release after a failed
/// claim), so a copy of this token's claim that reaches Redis after the release, from a
/// connection that failed while it was queued, writes nothing. Any other claim takes the key
/// as if it were free. `allow-oom`: a release frees memory and must run over `maxmemory`.
const RELEASE: &str = script!(
    flags = "allow-oom",
    r#"
local rec = redis.call('GETRANGE', KEYS[1], 0, 9)
local tombstone = '\1\2' .. ARGV[2]
if #rec < 10 then
  redis.call('SET', KEYS[1], tombstone, 'PX', tonumber(ARGV[4]))
  if ARGV[3] == '1' then return 1 end
  return 0
end
if string.sub(rec, 3, 10) ~= ARGV[2] then
  return 0
end
local state = string.byte(rec, 2)
if state == 2 then
  -- Its own tombstone: a resend whose first send landed, or a release after a failed claim.
  if ARGV[3] == '1' then return 1 end
  return 0
end
if state ~= 0 then
  return 0
end
redis.call('DEL', KEYS[1] .. ' meta', KEYS[1] .. ' room')
redis.call('SET', KEYS[1], tombstone, 'PX', tonumber(ARGV[4]))
return 1
"#
);

/// ARGV: 1 clock offset, 2 token, 3 lease ms. A reservation expires its retention after its
/// lease: the renewal keeps that distance, for its meta and room too. Replies 1 when renewed.
/// `allow-oom`: it rewrites 16 bytes in place, and a lease that could not be renewed over
/// `maxmemory` would let another request take the key while the handler runs.
const RENEW: &str = script!(
    flags = "allow-oom",
    r#"
local rec = redis.call('GETRANGE', KEYS[1], 0, 25)
if #rec < 26 or string.sub(rec, 3, 10) ~= ARGV[2] or string.byte(rec, 2) ~= 0 then
  return 0
end
local now = now_ms()
local lease = tonumber(ARGV[3])
local keep = u64(rec, 19) - u64(rec, 11)
redis.call('SETRANGE', KEYS[1], 10, be64(now + lease) .. be64(now + lease + keep))
redis.call('PEXPIRE', KEYS[1], lease + keep)
redis.call('PEXPIRE', KEYS[1] .. ' meta', lease + keep)
redis.call('PEXPIRE', KEYS[1] .. ' room', lease + keep)
return 1
"#
);

/// KEYS[1] the record; ARGV: 1 clock offset. Replies `{now, record, meta}` (meta: created at,
/// 8 bytes, then the route; empty when missing), or nil when there is no record (a release's
/// tombstone is none). `no-writes`: it runs over `maxmemory` and on a replica.
const INSPECT: &str = script!(
    flags = "no-writes",
    r#"
local rec = redis.call('GET', KEYS[1])
if not rec or string.byte(rec, 2) == 2 then
  return false
end
return {now_ms(), rec, redis.call('GET', KEYS[1] .. ' meta') or ''}
"#
);

/// KEYS[1] the record, deleted whatever its state and token (an operator's forget), with its
/// meta, room and any tombstone. Replies 1 when there was a record. `allow-oom`: it only frees.
const FORGET: &str = script!(
    flags = "allow-oom",
    r#"
local state = redis.call('GETRANGE', KEYS[1], 1, 1)
redis.call('DEL', KEYS[1], KEYS[1] .. ' meta', KEYS[1] .. ' room')
if state == '' or state == '\2' then
  return 0
end
return 1
"#
);

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
    renew: Script,
    inspect: Script,
    forget: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(CLAIM),
            complete: Script::new(COMPLETE),
            release: Script::new(RELEASE),
            renew: Script::new(RENEW),
            inspect: Script::new(INSPECT),
            forget: Script::new(FORGET),
        }
    }

    fn all(&self) -> [&Script; 6] {
        [
            &self.claim,
            &self.complete,
            &self.release,
            &self.renew,
            &self.inspect,
            &self.forget,
        ]
    }
}

/// The connection: one server (through a reconnecting [`ConnectionManager`]) or a cluster
/// (whose connection follows slot moves and reconnects itself).
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    async fn invoke(&self, invocation: &ScriptInvocation<'_>) -> Result<Value, RedisError> {
        match self.clone() {
            Self::Single(mut c) => invocation.invoke_async(&mut c).await,
            Self::Cluster(mut c) => invocation.invoke_async(&mut c).await,
        }
    }

    async fn load(&self, script: &Script) -> Result<(), RedisError> {
        let invocation = script.prepare_invoke();
        match self.clone() {
            Self::Single(mut c) => invocation.load_async(&mut c).await.map(drop),
            Self::Cluster(mut c) => invocation.load_async(&mut c).await.map(drop),
        }
    }
}

/// Builds a [`RedisStore`]: key prefix and connection settings.
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    prefix: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    wait_for_replicas: Option<WaitForReplicas>,
}

/// What a completion waits for before it counts as recorded: `WAIT replicas timeout`.
#[derive(Debug, Clone, Copy)]
struct WaitForReplicas {
    replicas: u32,
    timeout: Duration,
}

/// The completions that wait for replicas, sent together on a connection of their own: every
/// completion that arrives while a batch is out goes in the next one, one pipeline of their
/// scripts followed by a single `WAIT`, which covers every write sent before it on its
/// connection. Claims and replays, on the store's other connection, never queue behind a
/// `WAIT`, and concurrent completions share one instead of waiting in turn.
struct Waiting {
    wait: WaitForReplicas,
    conn: ConnectionManager,
    queue: std::sync::Mutex<WaitQueue>,
}

#[derive(Default)]
struct WaitQueue {
    pending: Vec<(::redis::Cmd, WaitAnswer)>,
    /// Whether a task is sending batches.
    out: bool,
}

/// The most completions in one batch.
const MAX_WAIT_BATCH: usize = 128;

/// Dropped with the task that sends batches: when its runtime shut down under it, the
/// completions still queued are answered "outcome unknown" (their senders dropped, so they
/// resend alone) and the next completion starts a task again, rather than waiting for ever.
struct Sending<'a> {
    waiting: &'a Waiting,
    done: bool,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut queue = self.waiting.queue.lock().unwrap_or_else(|p| p.into_inner());
            queue.pending.clear();
            queue.out = false;
        }
    }
}

/// A completion's script reply and the replicas its batch's `WAIT` counted.
type WaitAnswer = oneshot::Sender<Result<(Value, i64), RedisError>>;

impl Waiting {
    /// Sends `completion` with the next batch; `None` when the batch's task was gone before it
    /// answered (the outcome is unknown).
    async fn submit(
        self: &Arc<Self>,
        completion: ::redis::Cmd,
    ) -> Option<Result<(Value, i64), RedisError>> {
        let (answer, reply) = oneshot::channel();
        let start = {
            let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            queue.pending.push((completion, answer));
            !std::mem::replace(&mut queue.out, true)
        };
        if start {
            // Its own task: a request that gives up must not take its neighbours' batch along.
            tokio::spawn(Arc::clone(self).send_batches());
        }
        reply.await.ok()
    }

    async fn send_batches(self: Arc<Self>) {
        let mut conn = self.conn.clone();
        let mut sending = Sending {
            waiting: &self,
            done: false,
        };
        loop {
            let batch: Vec<_> = {
                let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                if queue.pending.is_empty() {
                    queue.out = false;
                    sending.done = true;
                    return;
                }
                let n = queue.pending.len().min(MAX_WAIT_BATCH);
                queue.pending.drain(..n).collect()
            };
            let mut pipe = ::redis::pipe();
            pipe.ignore_errors();
            let mut answers = Vec::with_capacity(batch.len());
            for (completion, answer) in batch {
                pipe.add_command(completion);
                answers.push(answer);
            }
            pipe.cmd("WAIT")
                .arg(self.wait.replicas)
                .arg(millis(self.wait.timeout));
            let replies: Result<Vec<Result<Value, RedisError>>, RedisError> =
                pipe.query_async(&mut conn).await;
            match replies {
                Ok(mut replies) => {
                    let acknowledged = match replies.pop() {
                        Some(Ok(Value::Int(n))) => Ok(n),
                        Some(Err(e)) => Err(e),
                        _ => Err(RedisError::from((
                            ErrorKind::UnexpectedReturnType,
                            "WAIT answered something other than a count",
                        ))),
                    };
                    for (answer, reply) in answers.into_iter().zip(replies) {
                        let _ =
                            answer.send(reply.and_then(|v| acknowledged.clone().map(|n| (v, n))));
                    }
                }
                Err(e) => {
                    for answer in answers {
                        let _ = answer.send(Err(e.clone()));
                    }
                }
            }
        }
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key (default `idem`): 1–64 bytes without `{`, `}` or whitespace (the
    /// braces are the scope's hash tag). Give each application sharing a Redis its own.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long an operation waits for Redis's answer before it counts as failed (default 2 s).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long a connection attempt may take (default 1 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Makes every completion wait until `replicas` replicas have acknowledged it, for at most
    /// `timeout` (Redis's `WAIT`), so an answer is reported recorded only once a failover to one
    /// of those replicas keeps it. Off by default: replication is asynchronous, and a failover
    /// loses the completions a replica had not received, letting their retries run again.
    ///
    /// Completions that wait go out on a connection of their own ([`connect`](Self::connect)
    /// opens it; [`build`](Self::build) uses the manager it is given, whose response timeout
    /// should then exceed `timeout`): the completions that arrive while one batch waits go out
    /// together as the next, their scripts and one `WAIT` in one pipeline. Claims and replays
    /// never queue behind a `WAIT`.
    ///
    /// When fewer replicas answer within `timeout`, the completion stands on the primary (and
    /// is replayed while it serves), the response is still sent, and the shortfall is an error
    /// ([`StoreError::NotReplicated`]), logged with the key's hash and counted `store_error`.
    /// The handler has run: a 503 would tell the client it had not, and send its retry into the
    /// very failover this guards against. Claims are not waited for: a claim lost by a
    /// failover lets a retry run while the first handler still runs, whose completion then
    /// finds no reservation and is counted `lease_lost`. Standalone connections only: a cluster
    /// build is refused. `replicas` 0 turns it off.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_for_replicas = (replicas > 0).then_some(WaitForReplicas { replicas, timeout });
        self
    }

    fn check_no_wait(&self) -> Result<(), RedisError> {
        if self.wait_for_replicas.is_some() {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "wait_for_replicas is not supported on a Redis Cluster connection",
            )));
        }
        Ok(())
    }

    fn check_prefix(&self) -> Result<(), RedisError> {
        let ok = !self.prefix.is_empty()
            && self.prefix.len() <= 64
            && !self
                .prefix
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control());
        if ok {
            Ok(())
        } else {
            Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "idempotency store prefix must be 1-64 bytes without '{', '}' or whitespace",
                self.prefix.clone(),
            )))
        }
    }

    /// Connects to one server at `url` (`redis://[user:password@]host:port/db`, or `rediss://`
    /// with TLS where the `redis` crate was built with it) and loads the scripts.
    pub async fn connect(self, url: &str) -> Result<RedisStore, RedisError> {
        self.check_prefix()?;
        let client = ::redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        let mut waiting = None;
        if let Some(wait) = self.wait_for_replicas {
            // A WAIT answers after its timeout at the latest: only past that has Redis failed.
            let config = config
                .set_response_timeout(Some(self.response_timeout.saturating_add(wait.timeout)));
            waiting = Some(ConnectionManager::new_with_config(client, config).await?);
        }
        self.finish(Connection::Single(manager), waiting).await
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port` each) and
    /// loads the scripts on every primary.
    pub async fn connect_cluster<I, S>(self, nodes: I) -> Result<RedisStore, RedisError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.check_prefix()?;
        self.check_no_wait()?;
        let nodes: Vec<String> = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        let client = ClusterClient::builder(nodes)
            .response_timeout(self.response_timeout)
            .connection_timeout(self.connection_timeout)
            .build()?;
        let conn = client.get_async_connection().await?;
        self.finish(Connection::Cluster(conn), None).await
    }

    /// Builds the store over an existing connection manager and loads the scripts. With
    /// [`wait_for_replicas`](Self::wait_for_replicas), completions wait on this manager too
    /// (holding it while replicas answer): give it a response timeout longer than the wait's.
    pub async fn build(self, manager: ConnectionManager) -> Result<RedisStore, RedisError> {
        self.check_prefix()?;
        let waiting = self.wait_for_replicas.map(|_| manager.clone());
        self.finish(Connection::Single(manager), waiting).await
    }

    /// Builds the store over an existing cluster connection and loads the scripts.
    pub async fn build_cluster(self, conn: ClusterConnection) -> Result<RedisStore, RedisError> {
        self.check_prefix()?;
        self.check_no_wait()?;
        self.finish(Connection::Cluster(conn), None).await
    }

    async fn finish(
        self,
        conn: Connection,
        waiting: Option<ConnectionManager>,
    ) -> Result<RedisStore, RedisError> {
        let scripts = Scripts::new();
        for script in scripts.all() {
            conn.load(script).await?;
        }
        Ok(RedisStore {
            conn,
            waiting: self.wait_for_replicas.zip(waiting).map(|(wait, conn)| {
                Arc::new(Waiting {
                    wait,
                    conn,
                    queue: Default::default(),
                })
            }),
            prefix: self.prefix,
            scripts,
            clock_offset_ms: AtomicI64::new(0),
            round_trips: AtomicU64::new(0),
        })
    }
}

/// The Redis / Valkey store (Redis 7.0 or later, Valkey 7.2 or later: the scripts declare
/// their flags in a `#!lua` line). Cheap to share behind an
/// `Arc`; build it with [`RedisStore::connect`] or [`RedisStore::builder`].
pub struct RedisStore {
    conn: Connection,
    waiting: Option<Arc<Waiting>>,
    prefix: String,
    scripts: Scripts,
    clock_offset_ms: AtomicI64,
    round_trips: AtomicU64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("cluster", &matches!(self.conn, Connection::Cluster(_)))
            .field(
                "wait_for_replicas",
                &self
                    .waiting
                    .as_ref()
                    .map(|w| (w.wait.replicas, w.wait.timeout)),
            )
            .finish_non_exhaustive()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).min(MAX_MS)
}

/// Whether `e` leaves the operation's outcome unknown or unapplied in a way that a resend can
/// settle: the connection failed or timed out, or the cluster was between primaries.
fn resendable(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
            )
        )
}

fn store_error(e: RedisError) -> StoreError {
    // `maxmemory` reached with a policy that refuses writes.
    if e.code() == Some("OOM") {
        return StoreError::Full;
    }
    StoreError::unavailable(e)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::unavailable(format!("corrupt idempotency record: {what}"))
}

fn unexpected(v: &Value) -> StoreError {
    StoreError::unavailable(format!(
        "unexpected reply from an idempotency script: {v:?}"
    ))
}

/// Hex digits of a scope hash.
fn hex(scope: &ScopeHash) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(64);
    for b in scope {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// A record as stored, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    completed: bool,
    token: FencingToken,
    lease_until_ms: u64,
    expires_at_ms: u64,
    fingerprint: Fingerprint,
    response: Option<RecordedResponse>,
}

impl Record {
    fn decode(raw: &[u8]) -> Result<Self, StoreError> {
        if raw.len() < RECORD_HEADER_LEN {
            return Err(corrupt("shorter than its header"));
        }
        let format = raw[0];
        if format != FORMAT && format != FORMAT_TRAILERS {
            return Err(corrupt("unknown format"));
        }
        let u64_at = |at: usize| {
            u64::from_be_bytes(raw[at..at + 8].try_into().expect("8 bytes in the header"))
        };
        let completed = match raw[1] {
            0 => false,
            1 => true,
            _ => return Err(corrupt("unknown state")),
        };
        let fingerprint = Fingerprint {
            version: u16::from_be_bytes([raw[26], raw[27]]),
            digest: raw[28..60].try_into().expect("32 bytes in the header"),
        };
        let response = if completed {
            let status = u16::from_be_bytes([raw[60], raw[61]]);
            let headers_len = u32::from_be_bytes(raw[62..66].try_into().expect("4 bytes")) as usize;
            let rest = &raw[RECORD_HEADER_LEN..];
            if rest.len() < headers_len {
                return Err(corrupt("headers overrun the record"));
            }
            let (headers, mut body) = rest.split_at(headers_len);
            let mut trailers = Vec::new();
            if format == FORMAT_TRAILERS {
                let (len, rest) = body
                    .split_first_chunk::<4>()
                    .ok_or_else(|| corrupt("trailers overrun the record"))?;
                let len = u32::from_be_bytes(*len) as usize;
                if rest.len() < len {
                    return Err(corrupt("trailers overrun the record"));
                }
                let (encoded, rest) = rest.split_at(len);
                trailers = RecordedResponse::decode_headers(encoded)
                    .ok_or_else(|| corrupt("trailers do not decode"))?;
                body = rest;
            }
            let headers = RecordedResponse::decode_headers(headers)
                .ok_or_else(|| corrupt("headers do not decode"))?;
            Some(
                RecordedResponse::new(status, headers, Bytes::copy_from_slice(body))
                    .with_trailers(trailers),
            )
        } else {
            None
        };
        Ok(Self {
            completed,
            token: FencingToken(u64_at(2)),
            lease_until_ms: u64_at(10),
            expires_at_ms: u64_at(18),
            fingerprint,
            response,
        })
    }
}

/// The completed part of a record (status, header length, headers, in format 2 the trailers'
/// length and the trailers, then the body) and the record's format: [`FORMAT`] for an answer
/// without trailers, exactly the layout earlier releases wrote, else [`FORMAT_TRAILERS`].
fn encode_response(response: &RecordedResponse) -> (u8, Vec<u8>) {
    let headers = response.encode_headers();
    let trailers = response.encode_trailers();
    let mut out = Vec::with_capacity(10 + headers.len() + trailers.len() + response.body.len());
    out.extend_from_slice(&response.status.to_be_bytes());
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    out.extend_from_slice(&headers);
    let format = if response.trailers.is_empty() {
        FORMAT
    } else {
        out.extend_from_slice(&(trailers.len() as u32).to_be_bytes());
        out.extend_from_slice(&trailers);
        FORMAT_TRAILERS
    };
    out.extend_from_slice(&response.body);
    (format, out)
}

fn fingerprint_bytes(fp: &Fingerprint) -> [u8; 34] {
    let mut out = [0u8; 34];
    out[..2].copy_from_slice(&fp.version.to_be_bytes());
    out[2..].copy_from_slice(&fp.digest);
    out
}

impl RedisStore {
    /// A builder: prefix `idem`, response timeout 2 s, connection timeout 1 s.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.to_owned(),
            response_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(1),
            wait_for_replicas: None,
        }
    }

    /// Connects to one server at `url` with the default settings (see [`builder`](Self::builder)).
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::builder().connect(url).await
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key of `(scope, key)`: `{prefix}:{<scope hex>}:<key>`.
    pub fn redis_key(&self, scope: &ScopeHash, key: &str) -> String {
        format!("{}:{{{}}}:{key}", self.prefix, hex(scope))
    }

    /// Moves the store's clock forward by `by` (an offset added to the server's `TIME` in every
    /// script), so the contract suite can test leases and retention without sleeping. Keys'
    /// TTLs still run on the real clock and so outlive their judged expiry; a record judged
    /// expired is taken over by the next claim.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn advance_clock_for_tests(&self, by: Duration) {
        self.clock_offset_ms.fetch_add(
            i64::try_from(by.as_millis()).unwrap_or(i64::MAX),
            Ordering::SeqCst,
        );
    }

    /// Scripts sent to Redis so far (each one round trip, resends included).
    #[doc(hidden)]
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Runs a script on the record of `(scope, key)` with `args` after the clock offset,
    /// resending it while its connection fails. `args` learns whether this send is a resend.
    async fn run(
        &self,
        script: &Script,
        scope: &ScopeHash,
        key: &str,
        args: impl Fn(&mut ScriptInvocation<'_>, bool),
    ) -> Result<Value, StoreError> {
        self.run_counted(script, scope, key, args).await.0
    }

    /// [`run`](Self::run), and whether a send's outcome was left unknown (it was resent).
    async fn run_counted(
        &self,
        script: &Script,
        scope: &ScopeHash,
        key: &str,
        args: impl Fn(&mut ScriptInvocation<'_>, bool),
    ) -> (Result<Value, StoreError>, bool) {
        let redis_key = self.redis_key(scope, key);
        let mut attempt = 0;
        loop {
            let mut invocation = script.prepare_invoke();
            invocation
                .key(&redis_key)
                .arg(self.clock_offset_ms.load(Ordering::SeqCst));
            args(&mut invocation, attempt > 0);
            self.round_trips.fetch_add(1, Ordering::Relaxed);
            match self.conn.invoke(&invocation).await {
                Ok(v) => return (Ok(v), attempt > 0),
                Err(e) if attempt + 1 < ATTEMPTS && resendable(&e) => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "idempotency store: resending a script");
                    tokio::time::sleep(Duration::from_millis(25 * u64::from(attempt))).await;
                }
                Err(e) => return (Err(store_error(e)), attempt > 0),
            }
        }
    }

    /// The completion sent with the next batch of completions that wait for replicas (see
    /// [`Waiting`]); when its batch failed, or Redis had lost the script (a promoted replica
    /// has no script cache), sent again alone with its own `WAIT`, like [`run`](Self::run).
    #[allow(clippy::too_many_arguments)]
    async fn complete_waited(
        &self,
        waiting: &Arc<Waiting>,
        scope: &ScopeHash,
        key: &str,
        token: &[u8; 8],
        tail: &[u8],
        format: u8,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let redis_key = self.redis_key(scope, key);
        let completion = |resent: bool| {
            let mut eval = ::redis::cmd("EVALSHA");
            eval.arg(self.scripts.complete.get_hash())
                .arg(1)
                .arg(&redis_key)
                .arg(self.clock_offset_ms.load(Ordering::SeqCst))
                .arg(&token[..])
                .arg(millis(retention).max(1))
                .arg(tail)
                .arg(if resent { "1" } else { "" })
                .arg(&[format][..]);
            eval
        };
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let answered = match waiting.submit(completion(false)).await {
            Some(Ok(answer)) => answer,
            Some(Err(e))
                if !(resendable(&e)
                    || e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)) =>
            {
                return Err(store_error(e));
            }
            // Outcome unknown (or not run, for NOSCRIPT): the completion is safe to resend.
            _ => self.complete_alone(waiting, &completion).await?,
        };
        let (reply, acknowledged) = answered;
        let done = flag(&reply)?;
        let acknowledged = u32::try_from(acknowledged.max(0)).unwrap_or(u32::MAX);
        if done && acknowledged < waiting.wait.replicas {
            return Err(StoreError::NotReplicated {
                acknowledged,
                wanted: waiting.wait.replicas,
            });
        }
        Ok(done)
    }

    /// A waited completion resent alone: the script and `WAIT` in one pipeline, loading the
    /// script where Redis lost it, resent while the connection fails.
    async fn complete_alone(
        &self,
        waiting: &Waiting,
        completion: &(dyn Fn(bool) -> ::redis::Cmd + Sync),
    ) -> Result<(Value, i64), StoreError> {
        let mut conn = waiting.conn.clone();
        let mut attempt = 1;
        let mut loaded = false;
        loop {
            let mut pipe = ::redis::pipe();
            pipe.add_command(completion(true))
                .cmd("WAIT")
                .arg(waiting.wait.replicas)
                .arg(millis(waiting.wait.timeout));
            self.round_trips.fetch_add(1, Ordering::Relaxed);
            let sent: Result<(Value, i64), RedisError> = pipe.query_async(&mut conn).await;
            match sent {
                Ok(answer) => return Ok(answer),
                Err(e) if !loaded && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    loaded = true;
                    self.scripts
                        .complete
                        .prepare_invoke()
                        .load_async(&mut conn)
                        .await
                        .map_err(store_error)?;
                }
                Err(e) if attempt < ATTEMPTS && resendable(&e) => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "idempotency store: resending a completion");
                    tokio::time::sleep(Duration::from_millis(25 * u64::from(attempt))).await;
                }
                Err(e) => return Err(store_error(e)),
            }
        }
    }

    async fn claim_script(
        &self,
        req: &ClaimRequest<'_>,
        stale: Option<FencingToken>,
    ) -> Result<Claim, StoreError> {
        let token = req.token.0.to_be_bytes();
        let fp = fingerprint_bytes(&req.fingerprint);
        let stale = stale.map(|t| t.0.to_be_bytes());
        let room = if req.response_room == 0 {
            0
        } else {
            req.response_room
                .saturating_add(RECORD_HEADER_LEN + HEADER_ROOM)
                .min(MAX_ROOM)
        };
        let (reply, resent) = self
            .run_counted(&self.scripts.claim, req.scope, req.key, |inv, _| {
                inv.arg(&token[..])
                    .arg(&fp[..])
                    .arg(millis(req.lease).max(1))
                    .arg(millis(req.retention))
                    .arg(stale.as_ref().map_or(&[][..], |s| &s[..]))
                    .arg(req.route)
                    .arg(room);
            })
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(StoreError::Full) if resent => {
                // Refused for room, but an earlier send's outcome is unknown: it may still
                // reach Redis. The pipeline releases only after an unknown outcome, so the
                // tombstone that keeps that copy from standing is left here.
                let _ = self.release(req.scope, req.key, req.token).await;
                return Err(StoreError::Full);
            }
            Err(e) => return Err(e),
        };
        let Value::Array(items) = &reply else {
            return Err(unexpected(&reply));
        };
        match items.as_slice() {
            [Value::Int(1)] => Ok(Claim::Acquired),
            [Value::Int(2)] => Err(StoreError::unavailable(
                "the claim reached Redis after its own release",
            )),
            [
                Value::Int(0),
                Value::Int(left),
                Value::BulkString(raw),
                Value::Int(expires_left),
            ] => {
                let record = Record::decode(raw)?;
                let (state, expires_in) = match record.response {
                    Some(response) => (
                        StandingState::Completed(Arc::new(response)),
                        Some(Duration::from_millis((*expires_left).max(0) as u64)),
                    ),
                    None if *left > 0 => (
                        StandingState::Running {
                            lease_left: Duration::from_millis(*left as u64),
                        },
                        None,
                    ),
                    None => (StandingState::Abandoned, None),
                };
                Ok(Claim::Standing(Standing {
                    token: record.token,
                    fingerprint: record.fingerprint,
                    state,
                    expires_in,
                }))
            }
            _ => Err(unexpected(&reply)),
        }
    }
}

fn flag(reply: &Value) -> Result<bool, StoreError> {
    match reply {
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        other => Err(unexpected(other)),
    }
}

impl Store for RedisStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.claim_script(req, None).await
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.claim_script(req, Some(stale)).await
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let token = token.0.to_be_bytes();
        let (format, tail) = encode_response(response);
        if let Some(waiting) = &self.waiting {
            return self
                .complete_waited(waiting, scope, key, &token, &tail, format, retention)
                .await;
        }
        let reply = self
            .run(&self.scripts.complete, scope, key, |inv, resent| {
                inv.arg(&token[..])
                    .arg(millis(retention).max(1))
                    .arg(&tail[..])
                    .arg(if resent { "1" } else { "" })
                    .arg(&[format][..]);
            })
            .await?;
        flag(&reply)
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let token = token.0.to_be_bytes();
        let reply = self
            .run(&self.scripts.release, scope, key, |inv, resent| {
                inv.arg(&token[..])
                    .arg(if resent { "1" } else { "" })
                    .arg(RELEASED_KEEP_MS);
            })
            .await?;
        flag(&reply)
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let token = token.0.to_be_bytes();
        let reply = self
            .run(&self.scripts.renew, scope, key, |inv, _| {
                inv.arg(&token[..]).arg(millis(lease).max(1));
            })
            .await?;
        flag(&reply)
    }

    /// Does nothing and deletes nothing: Redis expires every record by its key's TTL (set to
    /// the record's expiry), and claims judge expiry themselves.
    /// One script: the record, its meta key (creation time and route, kept beside the record so
    /// a replay never reads them) and the server's time.
    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let reply = self
            .run(&self.scripts.inspect, scope, key, |_, _| {})
            .await?;
        let (now, raw, meta) = match &reply {
            Value::Nil => return Ok(None),
            Value::Array(items) => match items.as_slice() {
                [
                    Value::Int(now),
                    Value::BulkString(raw),
                    Value::BulkString(meta),
                ] => (*now, raw, &meta[..]),
                [Value::Int(now), Value::BulkString(raw), Value::Nil] => (*now, raw, &[][..]),
                _ => return Err(unexpected(&reply)),
            },
            _ => return Err(unexpected(&reply)),
        };
        let (created_at, route) = match meta.split_first_chunk::<8>() {
            Some((created, route)) => (
                Some(time_from_millis(
                    i64::try_from(u64::from_be_bytes(*created)).unwrap_or(i64::MAX),
                )),
                Some(String::from_utf8_lossy(route).into_owned()),
            ),
            None => (None, None),
        };
        let record = Record::decode(raw)?;
        let at = |ms: u64| time_from_millis(i64::try_from(ms).unwrap_or(i64::MAX));
        let lease_until = at(record.lease_until_ms);
        let expires_at = at(record.expires_at_ms);
        let state = RecordState::judge(
            record.completed,
            time_from_millis(now),
            lease_until,
            expires_at,
        );
        let response = record.response.map(Arc::new);
        Ok(Some(RecordInfo {
            state,
            status: response.as_ref().map(|r| r.status),
            route,
            created_at,
            // A completed record's lease field holds its completion time (COMPLETE sets it).
            completed_at: response.as_ref().map(|_| lease_until),
            lease_until: response.is_none().then_some(lease_until),
            expires_at,
            body_bytes: response.as_ref().map_or(0, |r| r.body.len()),
            header_bytes: response.as_ref().map_or(0, |r| header_bytes(&r.headers)),
            response: response.filter(|_| with_response),
        }))
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        let reply = self
            .run(&self.scripts.forget, scope, key, |_, _| {})
            .await?;
        flag(&reply)
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn expires_by_itself(&self) -> bool {
        true
    }

    async fn sweep(&self, _batch: usize) -> Result<usize, StoreError> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_hex_is_lowercase_and_complete() {
        let mut scope = [0u8; 32];
        scope[0] = 0xab;
        scope[31] = 0x0f;
        let h = hex(&scope);
        assert_eq!(h.len(), 64);
        assert!(h.starts_with("ab00"));
        assert!(h.ends_with("0f"));
    }

    #[test]
    fn completed_records_decode_from_their_layout() {
        let response = RecordedResponse::new(
            201,
            vec![("location".into(), Bytes::from_static(b"/o/1"))],
            Bytes::from_static(b"{}"),
        );
        let mut raw = vec![FORMAT, 1];
        raw.extend_from_slice(&7u64.to_be_bytes());
        raw.extend_from_slice(&1_000u64.to_be_bytes());
        raw.extend_from_slice(&2_000u64.to_be_bytes());
        raw.extend_from_slice(&fingerprint_bytes(&Fingerprint {
            version: 1,
            digest: [9; 32],
        }));
        let (format, tail) = encode_response(&response);
        assert_eq!(format, FORMAT, "an answer without trailers keeps format 1");
        raw.extend_from_slice(&tail);
        let record = Record::decode(&raw).unwrap();
        assert_eq!(record.token, FencingToken(7));
        assert_eq!(
            (record.lease_until_ms, record.expires_at_ms),
            (1_000, 2_000)
        );
        assert!(record.completed);
        assert_eq!(record.fingerprint.digest, [9; 32]);
        assert_eq!(record.response, Some(response));
        assert_eq!(raw.len(), RECORD_HEADER_LEN + 4 + 8 + 4 + 4 + 2);
        assert!(Record::decode(&raw[..65]).is_err());
        raw[0] = 3;
        assert!(
            Record::decode(&raw).is_err(),
            "an unknown format is refused"
        );
    }

    /// A completed record exactly as releases before trailers wrote it (format 1, built by hand
    /// from `redis.lua`'s layout), decoded by this one: the upgrade path. It reads back with no
    /// trailers.
    #[test]
    fn a_record_in_the_format_before_trailers_still_decodes_with_none() {
        let mut raw = vec![1u8, 1];
        raw.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 7]); // token
        raw.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x03, 0xe8]); // lease_until 1000
        raw.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x07, 0xd0]); // expires_at 2000
        raw.extend_from_slice(&[0, 1]); // fingerprint version
        raw.extend_from_slice(&[9; 32]); // digest
        raw.extend_from_slice(&[0, 201]); // status
        raw.extend_from_slice(&[0, 0, 0, 20]); // headers' length
        raw.extend_from_slice(b"\0\0\0\x08location\0\0\0\x04/o/1");
        raw.extend_from_slice(b"{}");
        let record = Record::decode(&raw).unwrap();
        let response = record.response.expect("completed");
        assert_eq!(response.status, 201);
        assert_eq!(
            response.headers,
            [("location".to_owned(), Bytes::from_static(b"/o/1"))]
        );
        assert_eq!(response.body, Bytes::from_static(b"{}"));
        assert!(response.trailers.is_empty());
    }

    #[test]
    fn a_record_with_trailers_round_trips_through_format_2_and_a_broken_one_is_refused() {
        let response = RecordedResponse::new(
            200,
            vec![(
                "content-type".into(),
                Bytes::from_static(b"application/grpc"),
            )],
            Bytes::from_static(b"\0\0\0\0\x02hi"),
        )
        .with_trailers(vec![
            ("grpc-status".into(), Bytes::from_static(b"0")),
            ("grpc-message".into(), Bytes::new()),
        ]);
        let mut raw = vec![FORMAT_TRAILERS, 1];
        raw.extend_from_slice(&[0; 24]);
        raw.extend_from_slice(&fingerprint_bytes(&Fingerprint {
            version: 1,
            digest: [3; 32],
        }));
        let (format, tail) = encode_response(&response);
        assert_eq!(format, FORMAT_TRAILERS);
        raw.extend_from_slice(&tail);
        assert_eq!(Record::decode(&raw).unwrap().response, Some(response));
        // Read as format 1, the trailers would be taken for the body: the format byte is what
        // tells them apart, and a truncated trailer section is refused, not misread.
        let cut = raw.len() - 7 - 8;
        assert!(Record::decode(&raw[..cut]).is_err());
    }

    #[test]
    fn prefixes_that_would_break_the_hash_tag_are_refused() {
        for bad in ["", "a{b", "a}b", "a b", &"x".repeat(65)] {
            assert!(
                RedisStore::builder().prefix(bad).check_prefix().is_err(),
                "{bad:?} accepted"
            );
        }
        assert!(
            RedisStore::builder()
                .prefix("app:idem")
                .check_prefix()
                .is_ok()
        );
    }
}
