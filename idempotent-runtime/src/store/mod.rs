//! The `Store` trait every backend implements, and the record it keeps ([the contract](crate::design) §3, §5).
//!
//! A store does the conditional writes; the decisions (replay, 409, 422, reclaim) are made by
//! the runtime from what the store reports, identically for every backend. A store reports
//! time-dependent state (lease running, abandoned, expired) by its own clock: the in-memory store
//! by an injectable [`Clock`](crate::clock::Clock), the SQL stores by the database's.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

mod backend;
pub mod cache;
mod enlist;
pub(crate) mod erased;
pub mod memory;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "postgres")]
pub(crate) mod postgres_tls;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;

#[cfg(any(test, feature = "testing"))]
pub mod contract;

/// The SQL stores' (and the inbox's) shared naming error and DDL for users' own migration tools.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use crate::sql::{ConnectError, InvalidName, Migration, Migrations};
pub(crate) use backend::{Backend, Compact, at_once};
pub use enlist::Enlisting;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use enlist::{Enlist, Glanced, Joinable};

/// A fencing token: fresh for every claim and reclaim. Completing, releasing and renewing are
/// conditional on it, so a holder whose lease lapsed can never touch its successor's record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// A new token, unpredictable, and distinct from the others with overwhelming probability
    /// (a 64-bit keyed hash of a counter: two of them meet once in about 2^32 tokens, and a
    /// repeat only matters between two claims of the same key).
    pub fn mint() -> Self {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::OnceLock;
        use std::sync::atomic::{AtomicU64, Ordering};
        // SipHash keyed with process-random keys over a counter: unpredictable, and random
        // across replicas. (A keyed hash, not a permutation: repeats are possible, not likely.)
        static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = KEYS.get_or_init(Default::default).build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        Self(h.finish())
    }

    /// The token as a signed integer, for SQL `bigint` columns.
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }

    /// The token from a SQL `bigint` column.
    pub fn from_i64(v: i64) -> Self {
        Self(v as u64)
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({:016x})", self.0)
    }
}

/// The response kept for replay.
///
/// Built with [`new`](Self::new) (and [`with_trailers`](Self::with_trailers)), so that a later
/// version can add a part of the answer without breaking the stores and tests that build one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordedResponse {
    /// Final status code.
    pub status: u16,
    /// Allowlisted headers, lowercase names, in response order.
    pub headers: Vec<(String, Bytes)>,
    /// The complete body.
    pub body: Bytes,
    /// Allowlisted trailers (the fields sent after the body: HTTP trailers, gRPC's
    /// `grpc-status` and `grpc-message`), lowercase names, in the order they were sent; empty
    /// when the answer had none. A replay sends them after the body.
    pub trailers: Vec<(String, Bytes)>,
}

impl RecordedResponse {
    /// An answer of `status`, these recorded headers and `body`, without trailers.
    pub fn new(status: u16, headers: Vec<(String, Bytes)>, body: Bytes) -> Self {
        Self {
            status,
            headers,
            body,
            trailers: Vec::new(),
        }
    }

    /// This answer with these recorded trailers (lowercase names, in the order sent).
    #[must_use]
    pub fn with_trailers(mut self, trailers: Vec<(String, Bytes)>) -> Self {
        self.trailers = trailers;
        self
    }

    /// Bytes this record occupies beyond its struct: headers, body and trailers.
    pub fn weight(&self) -> usize {
        let fields = |list: &[(String, Bytes)]| {
            list.iter()
                .map(|(n, v)| n.len() + v.len() + 16)
                .sum::<usize>()
        };
        self.body.len() + fields(&self.headers) + fields(&self.trailers)
    }

    /// Headers in a compact length-prefixed encoding, for SQL `bytea`/`blob` columns.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(header_bytes(&self.headers));
        self.encode_headers_into(&mut out);
        out
    }

    /// [`encode_headers`](Self::encode_headers), appended to `out`.
    pub(crate) fn encode_headers_into(&self, out: &mut Vec<u8>) {
        encode_fields_into(&self.headers, out);
    }

    /// Trailers in the encoding of [`encode_headers`](Self::encode_headers) (and decoded by
    /// [`decode_headers`](Self::decode_headers)); empty when there are none.
    pub fn encode_trailers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(header_bytes(&self.trailers));
        encode_fields_into(&self.trailers, &mut out);
        out
    }

    /// Inverse of [`encode_headers`](Self::encode_headers) (and of
    /// [`encode_trailers`](Self::encode_trailers)); `None` on corrupt input.
    pub fn decode_headers(mut raw: &[u8]) -> Option<Vec<(String, Bytes)>> {
        let mut headers = Vec::new();
        while !raw.is_empty() {
            let name = String::from_utf8(take_field(&mut raw)?.to_vec()).ok()?;
            let value = Bytes::copy_from_slice(take_field(&mut raw)?);
            headers.push((name, value));
        }
        Some(headers)
    }

    /// [`decode_headers`](Self::decode_headers) of `buf`, each value a view of `buf` rather
    /// than a copy of its own.
    pub(crate) fn decode_headers_in(buf: &Bytes) -> Option<Vec<(String, Bytes)>> {
        let mut raw = &buf[..];
        let mut headers = Vec::new();
        while !raw.is_empty() {
            let name = std::str::from_utf8(take_field(&mut raw)?).ok()?.to_owned();
            let value = buf.slice_ref(take_field(&mut raw)?);
            headers.push((name, value));
        }
        Some(headers)
    }
}

/// The next name or value of [`RecordedResponse::encode_headers`]' encoding, taken off `raw`.
fn take_field<'a>(raw: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, rest) = raw.split_first_chunk::<4>()?;
    let len = u32::from_be_bytes(*len) as usize;
    if rest.len() < len {
        return None;
    }
    let (v, rest) = rest.split_at(len);
    *raw = rest;
    Some(v)
}

/// A claim: install `token` for `(scope, key)` unless a live record stands there.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// Scope hash, the first half of the store key.
    pub scope: &'a ScopeHash,
    /// The idempotency key, the second half.
    pub key: &'a str,
    /// Per-scope quota bucket (see [`Scope::quota_bucket`](crate::scope::Scope::quota_bucket)).
    pub quota_bucket: u64,
    /// The request's fingerprint, kept with the reservation.
    pub fingerprint: Fingerprint,
    /// The token to install.
    pub token: FencingToken,
    /// The reservation's lease.
    pub lease: Duration,
    /// How long records live once expired from their lease or completed.
    pub retention: Duration,
    /// The matched route pattern, kept with the record for [`Store::inspect`] (never part of
    /// the store key: the fingerprint already tells routes apart).
    pub route: &'a str,
    /// The most bytes the answer's body may record (the endpoint's `max_response`). A store
    /// that sets room aside for answers at the claim, so a claimed request's answer is never
    /// refused for room at completion, sets aside this much plus its own allowance for the
    /// status and recorded headers; 0 sets nothing aside.
    pub response_room: usize,
}

/// Outcome of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The request's token now holds the key.
    Acquired,
    /// A record stands under the key; the caller decides from it.
    Standing(Standing),
}

/// A record found under a key, with its time-dependent state judged by the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    /// The token of whoever holds or completed it.
    pub token: FencingToken,
    /// The fingerprint it was claimed with.
    pub fingerprint: Fingerprint,
    /// Its state.
    pub state: StandingState,
    /// How long until it expires, by the store's clock, where the store reports it (the
    /// crate's stores do for completed records). A [cache](cache::CachedStore) in front of the
    /// store keeps a copy of a replayed record no longer than this; `None` keeps it from
    /// caching replays of records another process completed.
    pub expires_in: Option<Duration>,
}

/// The state of a standing record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StandingState {
    /// Reserved and its lease is running.
    Running {
        /// What is left of the lease.
        lease_left: Duration,
    },
    /// Reserved, its lease lapsed, not yet expired: its holder is presumed dead.
    Abandoned,
    /// Completed and within retention.
    Completed(Arc<RecordedResponse>),
    /// Past its expiry: as good as gone (expiry is enforced when claiming).
    Expired,
}

/// What an operator sees of a record ([`Store::inspect`], [the contract](crate::design) §5
/// "Admin"): its state, times and sizes, and its response only when asked for.
///
/// Non-exhaustive, so that a later version can report more: a store of its own builds one with
/// [`RecordInfo::new`] and sets the fields it knows.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idempotent_runtime::store::{RecordInfo, RecordState};
///
/// let mut info = RecordInfo::new(RecordState::Completed, SystemTime::now() + Duration::from_secs(60));
/// info.status = Some(201);
/// info.body_bytes = 2;
/// assert_eq!(info.response, None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// Its state, judged by the store's clock.
    pub state: RecordState,
    /// The recorded status (completed records).
    pub status: Option<u16>,
    /// The route pattern it was claimed on (`None` for records written before routes were kept).
    pub route: Option<String>,
    /// When it was claimed (or last reclaimed); `None` for records written before this was kept.
    pub created_at: Option<SystemTime>,
    /// When its response was recorded (completed records).
    pub completed_at: Option<SystemTime>,
    /// When its reservation's lease runs out (reserved records).
    pub lease_until: Option<SystemTime>,
    /// When it expires and its key is free again.
    pub expires_at: SystemTime,
    /// Bytes of the recorded body (0 while reserved).
    pub body_bytes: usize,
    /// Bytes of the recorded headers in their [stored encoding](RecordedResponse::encode_headers):
    /// for each header, its name and value plus 8 bytes of lengths (0 while reserved).
    pub header_bytes: usize,
    /// The recorded response, when the caller asked for it and the record is completed.
    pub response: Option<Arc<RecordedResponse>>,
}

impl RecordInfo {
    /// A record in `state` that expires at `expires_at`, with nothing else known: no status,
    /// route or times, sizes 0, no response. Set the fields the store reads.
    pub fn new(state: RecordState, expires_at: SystemTime) -> Self {
        Self {
            state,
            status: None,
            route: None,
            created_at: None,
            completed_at: None,
            lease_until: None,
            expires_at,
            body_bytes: 0,
            header_bytes: 0,
            response: None,
        }
    }
}

/// A record's state as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Reserved, its handler running (lease not lapsed).
    Running,
    /// Reserved, its lease lapsed: its holder is presumed dead; a retry reclaims it.
    Abandoned,
    /// Completed: its response is replayed.
    Completed,
    /// Past its expiry, not yet swept: as good as gone.
    Expired,
}

impl RecordState {
    /// `"running"`, `"abandoned"`, `"completed"` or `"expired"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Abandoned => "abandoned",
            Self::Completed => "completed",
            Self::Expired => "expired",
        }
    }

    /// The state of a record by `now`, from its stored parts (every store judges the same way).
    pub fn judge(
        completed: bool,
        now: SystemTime,
        lease_until: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        if now >= expires_at {
            Self::Expired
        } else if completed {
            Self::Completed
        } else if now < lease_until {
            Self::Running
        } else {
            Self::Abandoned
        }
    }
}

/// Milliseconds since the UNIX epoch as a time (negative values clamp to the epoch).
pub(crate) fn time_from_millis(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// What an SQL store's inspect statement read, column by column (times in ms by the database's
/// clock), before it is what an operator sees.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) struct InspectedRow {
    pub(crate) completed: bool,
    pub(crate) status: Option<i64>,
    pub(crate) route: Option<String>,
    pub(crate) created: Option<i64>,
    pub(crate) lease: i64,
    pub(crate) expires: i64,
    pub(crate) now: i64,
    pub(crate) body_bytes: i64,
    pub(crate) header_bytes: i64,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    /// The encoded trailers; `None` for a record without any (and rows written before
    /// trailers were kept).
    pub(crate) trailers: Option<Vec<u8>>,
}

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
impl InspectedRow {
    /// The record as an operator sees it; `Err` when its stored headers do not decode.
    pub(crate) fn into_info(self) -> Result<RecordInfo, StoreError> {
        let status = self.status.and_then(|s| u16::try_from(s).ok());
        let response = match (self.completed, status, self.headers) {
            (true, Some(status), Some(headers)) => {
                let corrupt = |what: &str| {
                    StoreError::unavailable(format!("corrupt idempotency record: {what}"))
                };
                let headers = RecordedResponse::decode_headers(&headers)
                    .ok_or_else(|| corrupt("headers do not decode"))?;
                let trailers =
                    RecordedResponse::decode_headers(self.trailers.as_deref().unwrap_or_default())
                        .ok_or_else(|| corrupt("trailers do not decode"))?;
                let body = Bytes::from(self.body.unwrap_or_default());
                Some(Arc::new(
                    RecordedResponse::new(status, headers, body).with_trailers(trailers),
                ))
            }
            _ => None,
        };
        let (lease, expires) = (time_from_millis(self.lease), time_from_millis(self.expires));
        Ok(RecordInfo {
            state: RecordState::judge(self.completed, time_from_millis(self.now), lease, expires),
            status,
            route: self.route,
            created_at: self.created.map(time_from_millis),
            completed_at: self.completed.then_some(lease),
            lease_until: (!self.completed).then_some(lease),
            expires_at: expires,
            body_bytes: usize::try_from(self.body_bytes).unwrap_or(0),
            header_bytes: usize::try_from(self.header_bytes).unwrap_or(0),
            response,
        })
    }
}

/// Bytes of a record's headers as [`RecordInfo::header_bytes`] counts them: the length of
/// their [stored encoding](RecordedResponse::encode_headers).
pub(crate) fn header_bytes(headers: &[(String, Bytes)]) -> usize {
    headers.iter().map(|(n, v)| 8 + n.len() + v.len()).sum()
}

/// Fields (headers or trailers) in [`RecordedResponse::encode_headers`]' encoding, appended to
/// `out`: each name and value as a 4-byte big-endian length and its bytes.
pub(crate) fn encode_fields_into(fields: &[(String, Bytes)], out: &mut Vec<u8>) {
    for (name, value) in fields {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
}

/// Why a store operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached or answered with an error; the outcome is unknown.
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
    /// The store is at its record or byte bound.
    Full,
    /// The caller's scope is at its record quota.
    QuotaExceeded,
    /// The store does not implement `operation` (a [`Store`] method with a default, such as
    /// [`inspect`](Store::inspect), that this store leaves out). Nothing was read or changed.
    Unsupported {
        /// The [`Store`] method's name.
        operation: &'static str,
    },
    /// The write was applied by the store's primary but acknowledged by fewer replicas than
    /// the store was told to wait for, within its timeout (the Redis store's
    /// `wait_for_replicas`). It stands on the primary; a failover before the replicas catch
    /// up loses it.
    NotReplicated {
        /// Replicas that acknowledged the write.
        acknowledged: u32,
        /// Replicas the store waits for.
        wanted: u32,
    },
}

impl StoreError {
    /// Wraps a backend error.
    pub fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Unavailable(e.into())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unavailable(e) => write!(f, "idempotency store unavailable: {e}"),
            Self::Full => f.write_str("idempotency store full"),
            Self::QuotaExceeded => {
                f.write_str("the caller's share of the idempotency store is full")
            }
            Self::Unsupported { operation } => {
                write!(f, "this idempotency store does not support `{operation}`")
            }
            Self::NotReplicated {
                acknowledged,
                wanted,
            } => write!(
                f,
                "written to the idempotency store's primary but acknowledged by {acknowledged} \
                 of {wanted} replicas in time: a failover now would lose it"
            ),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(&**e),
            _ => None,
        }
    }
}

/// A backend that keeps idempotency records.
///
/// Every method is one conditional write (or read) decided by the backend atomically; the
/// contract suite (`store::contract`, feature `testing`) checks an implementation. Write the
/// methods as plain `async fn`s: the trait declares each one's future `Send`, so no macro is
/// needed, and the runtime boxes each call once, where it holds the store behind its handle.
///
/// The request path needs the required methods (claim, reclaim, complete, release, renew,
/// sweep). The rest have defaults, and every operation added in a later version will come with
/// one, so a third-party store keeps compiling across minor versions: where no honest answer
/// exists without the backend (the operator's [`inspect`](Self::inspect) and
/// [`forget`](Self::forget)), the default fails with [`StoreError::Unsupported`] naming the
/// operation, rather than pretending nothing is stored.
///
/// # Capabilities
///
/// What a store can do beyond the required methods is stated by methods with defaults, never
/// found out from its type: [`enlisting`](Self::enlisting) (it can claim and record inside a
/// database transaction, for enlisted endpoints), [`gauges`](Self::gauges) (its records and
/// bytes, for [`Idempotency::report_gauges`](crate::Idempotency::report_gauges)) and
/// [`process_local`](Self::process_local) (it protects only the handles of this process that
/// share it). A wrapper around a store (metrics, retries, the [cache](cache::CachedStore)) keeps
/// every capability of the store it wraps by forwarding each one in a line:
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
///
/// use idempotent_runtime::scope::ScopeHash;
/// use idempotent_runtime::store::{
///     Claim, ClaimRequest, Enlisting, FencingToken, ProcessLocal, RecordInfo, RecordedResponse,
///     Store, StoreError, StoreGauges,
/// };
///
/// /// Counts the claims that reach the store it wraps.
/// struct Counted<S> {
///     inner: S,
///     claims: AtomicU64,
/// }
///
/// impl<S: Store> Store for Counted<S> {
///     async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
///         self.claims.fetch_add(1, Ordering::Relaxed);
///         self.inner.claim(req).await
///     }
///     async fn reclaim(&self, req: &ClaimRequest<'_>, stale: FencingToken)
///         -> Result<Claim, StoreError> {
///         self.inner.reclaim(req, stale).await
///     }
///     async fn complete(&self, scope: &ScopeHash, key: &str, token: FencingToken,
///         response: &RecordedResponse, retention: Duration) -> Result<bool, StoreError> {
///         self.inner.complete(scope, key, token, response, retention).await
///     }
///     async fn release(&self, scope: &ScopeHash, key: &str, token: FencingToken)
///         -> Result<bool, StoreError> {
///         self.inner.release(scope, key, token).await
///     }
///     async fn renew(&self, scope: &ScopeHash, key: &str, token: FencingToken, lease: Duration)
///         -> Result<bool, StoreError> {
///         self.inner.renew(scope, key, token, lease).await
///     }
///     async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
///         self.inner.sweep(batch).await
///     }
///     async fn inspect(&self, scope: &ScopeHash, key: &str, with_response: bool)
///         -> Result<Option<RecordInfo>, StoreError> {
///         self.inner.inspect(scope, key, with_response).await
///     }
///     async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
///         self.inner.forget(scope, key).await
///     }
///
///     // What the wrapped store is and can do, forwarded: without these lines the wrapper would
///     // be a `custom` store that cannot enlist, reports no gauges, and is not process-local.
///     fn kind(&self) -> &'static str { self.inner.kind() }
///     fn expires_by_itself(&self) -> bool { self.inner.expires_by_itself() }
///     fn enlisting(&self) -> Option<Enlisting<'_>> { self.inner.enlisting() }
///     fn gauges(&self) -> Option<StoreGauges> { self.inner.gauges() }
///     fn process_local(&self) -> Option<ProcessLocal> { self.inner.process_local() }
/// }
///
/// # use idempotent_runtime::store::memory::MemoryStore;
/// let store = Counted { inner: MemoryStore::default(), claims: AtomicU64::new(0) };
/// assert_eq!(store.kind(), "memory");
/// assert!(store.process_local().is_some(), "a wrapped memory store is still process-local");
/// ```
pub trait Store: Send + Sync + 'static {
    /// Installs `req.token` under `(scope, key)` if nothing live stands there; otherwise reports
    /// what stands. An expired record is either taken over here (reported as
    /// [`Claim::Acquired`]) or reported as [`StandingState::Expired`] for a [`reclaim`](Self::reclaim).
    fn claim(
        &self,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Takes over a record held by `stale` that is expired, or abandoned (lease lapsed): installs
    /// `req.token`, `req.fingerprint` and a new lease. If `stale` no longer holds the key, or the
    /// record is no longer takeable, reports what stands instead (or acquires, if nothing does).
    fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Turns the reservation held by `token` into a completed record kept for `retention`.
    /// `Ok(false)` when `token` no longer holds the key (fenced).
    fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes the reservation held by `token`. `Ok(false)` when `token` no longer holds it.
    fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease held by `token` to `lease` from now. `Ok(false)` when fenced or
    /// already completed.
    fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes up to `batch` expired records, re-checking expiry in the delete itself. Returns
    /// how many were deleted; a full batch means more may remain.
    fn sweep(&self, batch: usize) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Reads the record under `(scope, key)` for an operator, whatever its state (expired ones
    /// not yet swept included), without changing it. `with_response` asks for the recorded
    /// response too; otherwise [`RecordInfo::response`] is `None` and a store should not read
    /// the body. `Ok(None)` when there is no record.
    ///
    /// Default: [`StoreError::Unsupported`] (`operation: "inspect"`).
    fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send {
        let _ = (scope, key, with_response);
        std::future::ready(Err(StoreError::Unsupported {
            operation: "inspect",
        }))
    }

    /// Deletes the record under `(scope, key)` whatever its state and token, for an operator
    /// clearing a stuck or wrong record. `Ok(false)` when there was none. A handler still
    /// running under a forgotten reservation is fenced: its completion finds no record.
    ///
    /// Default: [`StoreError::Unsupported`] (`operation: "forget"`); nothing is deleted.
    fn forget(
        &self,
        scope: &ScopeHash,
        key: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (scope, key);
        std::future::ready(Err(StoreError::Unsupported {
            operation: "forget",
        }))
    }

    /// [`claim`](Self::claim), timed into the store latency histogram
    /// ([`STORE_LATENCY`](crate::observe::STORE_LATENCY), feature `metrics`) as `op="claim"`,
    /// `store=`[`kind`](Self::kind): what the runtime calls to claim. A wrapper that answers some
    /// claims itself, without the store behind it (the [`cache`](cache::CachedStore)),
    /// overrides it: what it answers is timed under its own label, and the rest goes to its
    /// store's `claim_timed`, so that a shared store's histogram counts only the claims that
    /// reached it. Any other wrapper may forward it or leave the default.
    fn claim_timed(
        &self,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        crate::observe::timed("claim", self.kind(), self.claim(req))
    }

    /// A short name for metrics labels (`memory`, `postgres`, `sqlite`, …); default `custom`.
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// Whether records expire by themselves (Redis key TTLs), so [`sweep`](Self::sweep) has
    /// nothing to delete and answers 0; default `false`.
    fn expires_by_itself(&self) -> bool {
        false
    }

    /// The database transactions this store can claim and record in, for enlisted endpoints
    /// ([`enlisted`](crate::enlisted)); default `None`: an enlisted endpoint over it answers
    /// 500 `IDEMPOTENCY_STORE_NOT_ENLISTABLE`. The PostgreSQL store answers its own; a wrapper
    /// forwards the store it wraps (`self.inner.enlisting()`), and then claims and completions
    /// of enlisted requests go to that store inside the request's transaction, not through the
    /// wrapper's [`claim`](Self::claim) and [`complete`](Self::complete).
    fn enlisting(&self) -> Option<Enlisting<'_>> {
        None
    }

    /// What the store holds now, for [`Idempotency::report_gauges`](crate::Idempotency::report_gauges)
    /// (the `idempotent_memory_store_records` and `idempotent_memory_store_bytes` gauges of
    /// [the contract](crate::design) §7); default `None`, for a store whose size lives elsewhere
    /// (the SQL stores, Redis). The memory store reports its own.
    fn gauges(&self) -> Option<StoreGauges> {
        None
    }

    /// `Some` when the store keeps its records in this process (the memory store), so that it
    /// protects only the handles that share it: the runtime then warns when two different
    /// process-local stores serve one route (a duplicate reaching the other one would run
    /// again). Default `None`, for a store shared through a server.
    fn process_local(&self) -> Option<ProcessLocal> {
        None
    }

    /// How a handle holds the store: the in-memory store as itself, so that its calls need no
    /// box ([`Backend`]); any other store erased. Hidden, and its type cannot be named outside
    /// the crate, so only the crate's own store overrides it.
    #[doc(hidden)]
    fn into_backend(self: Arc<Self>) -> Backend
    where
        Self: Sized,
    {
        Backend::erased(self)
    }
}

/// What a store holds, as [`Store::gauges`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreGauges {
    /// Records kept (reservations and completed).
    pub records: usize,
    /// Bytes they take, as the store counts them against its bounds.
    pub bytes: usize,
}

impl StoreGauges {
    /// `records` records taking `bytes` bytes.
    pub fn new(records: usize, bytes: usize) -> Self {
        Self { records, bytes }
    }
}

/// A process-local store's identity ([`Store::process_local`]): two handles whose stores report
/// the same one share their records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessLocal(usize);

impl ProcessLocal {
    /// The identity of the store at `store`'s address: call it with `self` from
    /// [`Store::process_local`] (the address stays the store's while a handle holds it).
    pub fn of<T>(store: &T) -> Self {
        Self(std::ptr::from_ref(store).addr())
    }

    pub(crate) fn id(self) -> usize {
        self.0
    }
}

/// Runs [`Store::sweep`] on a cadence of `min(retention, 1 h)`, sweeping again at once while
/// batches come back full, yielding to the runtime between batches (a store whose sweep never
/// suspends, like the in-memory one, would otherwise hold a worker thread until the last batch).
/// The task holds the store weakly and ends when the store is dropped (or when the returned
/// handle is aborted). Must be called inside a Tokio runtime.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn spawn_sweeper<S: Store>(
    store: std::sync::Weak<S>,
    retention: Duration,
    batch: usize,
) -> tokio::task::JoinHandle<()> {
    sweeper(store, retention, batch)
}

/// [`spawn_sweeper`] over the store behind a handle.
pub(crate) fn sweeper(
    store: std::sync::Weak<dyn erased::DynStore>,
    retention: Duration,
    batch: usize,
) -> tokio::task::JoinHandle<()> {
    let cadence = retention
        .min(Duration::from_secs(3600))
        .max(Duration::from_millis(10));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(cadence);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(store) = store.upgrade() else { return };
            loop {
                match crate::observe::timed("sweep", store.kind(), store.sweep(batch)).await {
                    Ok(n) if n >= batch => tokio::task::yield_now().await,
                    Ok(n) => {
                        if n > 0 {
                            tracing::debug!(deleted = n, "idempotency sweep");
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "idempotency sweep failed; will retry next cadence");
                        break;
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_their_encoding() {
        let r = RecordedResponse::new(
            201,
            vec![
                ("location".into(), Bytes::from_static(b"/orders/1")),
                ("etag".into(), Bytes::from_static(b"")),
            ],
            Bytes::new(),
        )
        .with_trailers(vec![
            ("grpc-status".into(), Bytes::from_static(b"0")),
            ("x-checksum".into(), Bytes::from_static(b"\x00\xff")),
        ]);
        assert_eq!(
            RecordedResponse::decode_headers(&r.encode_trailers()),
            Some(r.trailers.clone())
        );
        assert_eq!(
            RecordedResponse::decode_headers(
                &RecordedResponse::new(200, vec![], Bytes::new()).encode_trailers()
            ),
            Some(vec![]),
            "no trailers encode as nothing"
        );
        assert_eq!(
            RecordedResponse::decode_headers(&r.encode_headers()),
            Some(r.headers)
        );
        assert_eq!(RecordedResponse::decode_headers(&[0, 0, 0, 9, b'x']), None);
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_empties_full_batches_at_once_and_stops_with_its_store() {
        use crate::clock::ManualClock;
        use crate::fingerprint::Fingerprint;
        use crate::store::memory::{MemoryLimits, MemoryStore};

        let clock = ManualClock::new();
        let store = Arc::new(
            MemoryStore::builder()
                .clock(clock.clone())
                .limits(MemoryLimits {
                    // Many claims of one scope in flight at once.
                    response_headroom: 4 << 10,
                    ..MemoryLimits::default()
                })
                .build(),
        );
        let scope = [7u8; 32];
        for i in 0..1_200 {
            let key = format!("k{i}");
            let req = ClaimRequest {
                scope: &scope,
                key: &key,
                quota_bucket: 7,
                fingerprint: Fingerprint {
                    version: 1,
                    digest: [0; 32],
                },
                token: FencingToken::mint(),
                lease: Duration::from_secs(1),
                retention: Duration::from_secs(1),
                route: "/test",
                response_room: 0,
            };
            assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        }
        let live = ClaimRequest {
            scope: &scope,
            key: "live",
            quota_bucket: 7,
            fingerprint: Fingerprint {
                version: 1,
                digest: [0; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(3600),
            retention: Duration::from_secs(1),
            route: "/test",
            response_room: 0,
        };
        assert_eq!(store.claim(&live).await.unwrap(), Claim::Acquired);
        clock.advance(Duration::from_secs(3));

        let sweeper = spawn_sweeper(Arc::downgrade(&store), Duration::from_secs(1), 500);
        // One cadence: the first tick sweeps 500, 500, then 200 without waiting for more ticks.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(
            store.len(),
            1,
            "the expired records are gone, the live one stays"
        );

        drop(store);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(sweeper.is_finished(), "the sweeper outlived its store");
    }

    #[test]
    fn minted_tokens_do_not_repeat() {
        let tokens: std::collections::HashSet<_> =
            (0..10_000).map(|_| FencingToken::mint()).collect();
        assert_eq!(tokens.len(), 10_000);
    }
}
