//! Settings, with the defaults of [the contract](crate::design), and the per-endpoint overrides the attribute emits.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::fingerprint::BodySubset;
use crate::key::KeySource;
use crate::scope::Anonymous;

pub(crate) mod effective;
pub mod grammar;

pub(crate) use effective::{Effective, Recording};

/// Status for a key reused with a different request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReuseStatus {
    /// 422 Unprocessable Content (the IETF draft's choice; default).
    #[default]
    UnprocessableContent,
    /// 409 Conflict.
    Conflict,
}

impl ReuseStatus {
    /// The HTTP status code.
    pub fn code(self) -> u16 {
        match self {
            Self::UnprocessableContent => 422,
            Self::Conflict => 409,
        }
    }
}

/// Status for a missing key on a `require_key` endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKeyStatus {
    /// 400 Bad Request (the IETF draft's choice; default).
    #[default]
    BadRequest,
    /// 428 Precondition Required.
    PreconditionRequired,
}

impl MissingKeyStatus {
    /// The HTTP status code.
    pub fn code(self) -> u16 {
        match self {
            Self::BadRequest => 400,
            Self::PreconditionRequired => 428,
        }
    }
}

/// What happens when the store cannot be reached while claiming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailureMode {
    /// Refuse with 503 `IDEMPOTENCY_STORE_UNAVAILABLE` (default): nothing runs unprotected.
    #[default]
    Closed,
    /// Run the handler unprotected and record nothing. Duplicates may run twice while the store
    /// is down; choose this only where availability matters more than exactly-once.
    Open,
}

/// What an answer whose body is over `max_response` leaves behind
/// ([the contract](crate::design) §3, "Oversized answers").
///
/// ```
/// use idempotent_runtime::config::EndpointConfig;
/// use idempotent_runtime::config::Oversized;
///
/// // A charge must never run twice, however large its receipt.
/// const CHARGE: EndpointConfig = EndpointConfig::REQUIRED.oversized(Oversized::RecordWithoutBody);
/// # let _ = CHARGE;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Oversized {
    /// Release the key (default): the answer is sent but not recorded, and a retry runs the
    /// handler again. For handlers that are safe to run again, or whose answer the client needs.
    #[default]
    RunAgain,
    /// Record the status and the recorded headers without the body: a retry is answered with
    /// them, an empty body, `Idempotency-Replayed: true` and `Idempotency-Replay: body-omitted`,
    /// and the handler never runs twice. A body of unknown size that streams past the cap (or
    /// past the buffer budget) is sent whole to the first caller and recorded the same way; a
    /// body that breaks off mid-stream still releases the key. For effects that must never repeat (a charge); the
    /// client fetches the result another way (its `Location`).
    RecordWithoutBody,
}

/// The request methods an endpoint applies to: a set of POST, PUT, PATCH and DELETE (default
/// POST and PATCH, [the contract](crate::design) §1). GET, HEAD, OPTIONS and TRACE are safe by
/// HTTP semantics and CONNECT opens a tunnel, so none of them can be listed: such a request
/// always passes through untouched, keyed or not.
///
/// ```
/// use idempotent_runtime::config::Methods;
///
/// let methods = Methods::DEFAULT.with(Methods::PUT);
/// assert!(methods.contains("PUT") && methods.contains("POST") && methods.contains("PATCH"));
/// assert!(!methods.contains("DELETE") && !methods.contains("GET"));
/// assert_eq!(Methods::parse("PUT"), Ok(Methods::PUT));
/// assert!(Methods::parse("GET").is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Methods(u8);

impl Methods {
    /// `POST`.
    pub const POST: Self = Self(1);
    /// `PUT`.
    pub const PUT: Self = Self(2);
    /// `PATCH`.
    pub const PATCH: Self = Self(4);
    /// `DELETE`.
    pub const DELETE: Self = Self(8);
    /// POST and PATCH, the default of the attribute and the layer alike.
    pub const DEFAULT: Self = Self(1 | 4);
    const NAMES: [(&'static str, Self); 4] = [
        ("POST", Self::POST),
        ("PUT", Self::PUT),
        ("PATCH", Self::PATCH),
        ("DELETE", Self::DELETE),
    ];

    /// Both sets.
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The set these bits spell (`POST` 1, `PUT` 2, `PATCH` 4, `DELETE` 8), as the attribute
    /// writes it; other bits are dropped.
    pub const fn from_bits(bits: u8) -> Self {
        Self(bits & 0b1111)
    }

    /// The bits of [`from_bits`](Self::from_bits).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Whether a request with this method (as sent, upper case) is in the set.
    pub fn contains(self, method: &str) -> bool {
        Self::NAMES
            .iter()
            .any(|(name, m)| *name == method && self.0 & m.0 != 0)
    }

    /// One method by name (upper case, as HTTP spells it). The error says why a name cannot
    /// be listed.
    pub fn parse(name: &str) -> Result<Self, &'static str> {
        if let Some((_, m)) = Self::NAMES.iter().find(|(n, _)| *n == name) {
            return Ok(*m);
        }
        Err(match name {
            "GET" | "HEAD" | "OPTIONS" | "TRACE" => {
                "GET, HEAD, OPTIONS and TRACE are safe methods: repeating them changes nothing, \
                 so they always pass through untouched"
            }
            "CONNECT" => "CONNECT opens a tunnel: there is no response to record and replay",
            _ => "expected one of POST, PUT, PATCH, DELETE (upper case)",
        })
    }
}

impl Default for Methods {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl std::fmt::Debug for Methods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = Self::NAMES.iter().filter(|(_, m)| self.0 & m.0 != 0);
        f.debug_set().entries(names.map(|(n, _)| n)).finish()
    }
}

impl FromIterator<Methods> for Methods {
    fn from_iter<I: IntoIterator<Item = Methods>>(iter: I) -> Self {
        iter.into_iter().fold(Self(0), Self::with)
    }
}

/// Runtime settings. Build with [`Config::builder`].
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::config::{Config, ReuseStatus};
///
/// let config = Config::builder()
///     .lease(Duration::from_secs(30))
///     .reuse_status(ReuseStatus::Conflict)
///     .build();
/// assert_eq!(config.lease(), Duration::from_secs(30));
/// assert_eq!(config.retention(), Duration::from_secs(24 * 3600));
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) store_retry_after: Duration,
    pub(crate) max_body: usize,
    pub(crate) max_response: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) non_replayable: Vec<u16>,
    pub(crate) recorded_headers: Vec<String>,
    pub(crate) reuse_status: ReuseStatus,
    pub(crate) missing_key_status: MissingKeyStatus,
    pub(crate) failure_mode: FailureMode,
    pub(crate) oversized: Oversized,
    pub(crate) anonymous: Anonymous,
    pub(crate) trusted_proxies: Vec<IpNet>,
    pub(crate) shutdown_grace: Duration,
    pub(crate) wait_in_progress: Duration,
    pub(crate) key_header: String,
    pub(crate) credential_headers: Vec<String>,
    pub(crate) methods: Methods,
    pub(crate) strict: bool,
    pub(crate) max_buffered_bytes: usize,
    pub(crate) sweeper: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
            in_progress_retry_after: Duration::from_secs(1),
            store_retry_after: Duration::from_secs(1),
            max_body: 1 << 20,
            max_response: 1 << 20,
            body_timeout: Duration::from_secs(30),
            non_replayable: vec![401, 403, 408, 412, 429],
            recorded_headers: [
                "content-type",
                "location",
                "content-location",
                "etag",
                "last-modified",
            ]
            .map(String::from)
            .to_vec(),
            reuse_status: ReuseStatus::default(),
            missing_key_status: MissingKeyStatus::default(),
            failure_mode: FailureMode::default(),
            oversized: Oversized::default(),
            anonymous: Anonymous::default(),
            trusted_proxies: Vec::new(),
            shutdown_grace: Duration::from_secs(30),
            wait_in_progress: Duration::ZERO,
            key_header: crate::key::HEADER_NAME.to_owned(),
            credential_headers: vec!["authorization".to_owned()],
            methods: Methods::DEFAULT,
            strict: cfg!(debug_assertions),
            max_buffered_bytes: 256 << 20,
            sweeper: true,
        }
    }
}

/// Headers that are never recorded, whatever the allowlist says: they belong to one response
/// or one connection.
const NEVER_RECORDED: [&str; 5] = [
    "set-cookie",
    "content-length",
    "transfer-encoding",
    "connection",
    "trailer",
];

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder(Self::default())
    }

    /// How long a claim blocks its key without renewal.
    pub fn lease(&self) -> Duration {
        self.lease
    }
    /// How long a completed response is replayed.
    pub fn retention(&self) -> Duration {
        self.retention
    }
    /// `Retry-After` on 409 in progress (capped by the lease left).
    pub fn in_progress_retry_after(&self) -> Duration {
        self.in_progress_retry_after
    }
    /// `Retry-After` on 503.
    pub fn store_retry_after(&self) -> Duration {
        self.store_retry_after
    }
    /// Request body cap in bytes.
    pub fn max_body(&self) -> usize {
        self.max_body
    }
    /// Recorded response cap in bytes.
    pub fn max_response(&self) -> usize {
        self.max_response
    }
    /// How long the request body may take to arrive.
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }
    /// Status for a reused key.
    pub fn reuse_status(&self) -> ReuseStatus {
        self.reuse_status
    }
    /// Status for a missing required key.
    pub fn missing_key_status(&self) -> MissingKeyStatus {
        self.missing_key_status
    }
    /// Fail closed or open.
    pub fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }
    /// What an answer over `max_response` leaves behind.
    pub fn oversized(&self) -> Oversized {
        self.oversized
    }
    /// Policy for callers without subject or client id.
    pub fn anonymous(&self) -> Anonymous {
        self.anonymous
    }
    /// Proxies whose forwarded headers are believed.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted_proxies
    }
    /// How long shutdown waits for claimed handlers.
    pub fn shutdown_grace(&self) -> Duration {
        self.shutdown_grace
    }
    /// How long a duplicate of a running request waits for it instead of answering 409
    /// (zero, the default: it answers 409 at once).
    pub fn wait_in_progress(&self) -> Duration {
        self.wait_in_progress
    }

    /// The header that carries the key (lowercase; default `idempotency-key`).
    pub fn key_header(&self) -> &str {
        &self.key_header
    }
    /// Headers that carry a credential (lowercase; default `authorization`): a request with one
    /// of them for which no identity was established is refused, never scoped by its peer.
    pub fn credential_headers(&self) -> &[String] {
        &self.credential_headers
    }

    /// The methods endpoints apply to where they do not say (default POST and PATCH).
    pub fn methods(&self) -> Methods {
        self.methods
    }
    /// Whether a setup mistake seen on a request is refused with 500
    /// `IDEMPOTENCY_MISCONFIGURED` (strict) or only logged once and counted (default: strict in
    /// debug builds, see [`ConfigBuilder::strict`]).
    pub fn strict(&self) -> bool {
        self.strict
    }
    /// Bound on the bytes of request and response bodies buffered at once across all requests
    /// (default 256 MiB; see [`ConfigBuilder::max_buffered_bytes`]).
    pub fn max_buffered_bytes(&self) -> usize {
        self.max_buffered_bytes
    }
    /// Whether the handle runs the background sweeper (default on).
    pub fn sweeper(&self) -> bool {
        self.sweeper
    }

    /// Whether a response with this final status may be recorded and replayed.
    pub fn is_recordable_status(&self, status: u16) -> bool {
        (200..500).contains(&status) && !self.non_replayable.contains(&status)
    }

    /// Whether a response header (lowercase name) is kept in the record.
    pub fn records_header(&self, lowercase_name: &str) -> bool {
        !NEVER_RECORDED.contains(&lowercase_name)
            && self.recorded_headers.iter().any(|h| h == lowercase_name)
    }
}

/// Builds a [`Config`].
#[derive(Debug, Clone)]
#[must_use]
pub struct ConfigBuilder(Config);

impl ConfigBuilder {
    /// In-progress lease (default 60 s), renewed every third while the handler runs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.0.lease = lease.max(Duration::from_millis(3));
        self
    }
    /// Replay window after completion (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.0.retention = retention;
        self
    }
    /// `Retry-After` on 409 in progress (default 1 s).
    pub fn in_progress_retry_after(mut self, d: Duration) -> Self {
        self.0.in_progress_retry_after = d;
        self
    }
    /// `Retry-After` on 503 (default 1 s).
    pub fn store_retry_after(mut self, d: Duration) -> Self {
        self.0.store_retry_after = d;
        self
    }
    /// Request body cap (default 1 MiB).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.0.max_body = bytes;
        self
    }
    /// Recorded response cap (default 1 MiB).
    pub fn max_response(mut self, bytes: usize) -> Self {
        self.0.max_response = bytes;
        self
    }
    /// Request body read timeout (default 30 s).
    pub fn body_timeout(mut self, d: Duration) -> Self {
        self.0.body_timeout = d;
        self
    }
    /// Statuses never recorded though below 500 (default 401, 403, 408, 412, 429).
    pub fn non_replayable(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.0.non_replayable = statuses.into_iter().collect();
        self
    }
    /// Response headers kept in the record (default `content-type`, `location`,
    /// `content-location`, `etag`, `last-modified`). `set-cookie`, `content-length`,
    /// `transfer-encoding`, `connection` and `trailer` are never kept.
    pub fn recorded_headers<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.0.recorded_headers = names
            .into_iter()
            .map(|n| n.as_ref().to_ascii_lowercase())
            .collect();
        self
    }
    /// 422 (default) or 409 for a reused key.
    pub fn reuse_status(mut self, status: ReuseStatus) -> Self {
        self.0.reuse_status = status;
        self
    }
    /// 400 (default) or 428 for a missing required key.
    pub fn missing_key_status(mut self, status: MissingKeyStatus) -> Self {
        self.0.missing_key_status = status;
        self
    }
    /// Fail closed (default) or open when the store is unreachable.
    pub fn failure_mode(mut self, mode: FailureMode) -> Self {
        self.0.failure_mode = mode;
        self
    }
    /// Release the key (default) or record the answer without its body when its body is over
    /// `max_response`.
    pub fn oversized(mut self, policy: Oversized) -> Self {
        self.0.oversized = policy;
        self
    }
    /// Scope anonymous callers by peer IP (default) or refuse them.
    pub fn anonymous(mut self, policy: Anonymous) -> Self {
        self.0.anonymous = policy;
        self
    }
    /// Proxies whose forwarded headers (`X-Forwarded-For`, `Forwarded`) are believed (default
    /// none). Peers are compared canonically: an IPv4-mapped IPv6 peer matches its IPv4 net.
    pub fn trusted_proxies(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.0.trusted_proxies = nets.into_iter().collect();
        self
    }
    /// How long shutdown waits for claimed handlers (default 30 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.0.shutdown_grace = d;
        self
    }
    /// Hold a duplicate of a running request up to `d` and answer it with the first one's
    /// recorded response, instead of 409 `IDEMPOTENCY_IN_PROGRESS` at once (default zero: no
    /// wait), for clients that cannot retry on 409. The duplicate holds no database connection
    /// while it waits: it is woken when a request of this process settles, and otherwise looks
    /// at the store again at growing intervals (10 ms doubling to 250 ms). If the first
    /// request's key is released (its answer was not recordable), the waiting duplicate claims
    /// it and runs; past `d` it is answered 409 as without the setting. Detached mode only: an
    /// enlisted duplicate is answered 409 at once ([the contract](crate::design) §5).
    pub fn wait_in_progress(mut self, d: Duration) -> Self {
        self.0.wait_in_progress = d;
        self
    }
    /// The header that carries the key (default `Idempotency-Key`), for APIs that already use
    /// another name such as `X-Idempotency-Key`. Compared case-insensitively.
    pub fn key_header(mut self, name: impl AsRef<str>) -> Self {
        self.0.key_header = name.as_ref().trim().to_ascii_lowercase();
        self
    }
    /// Headers that carry a credential (default `authorization`; add `cookie`, `x-api-key`, …
    /// as the application uses them). A request that carries one of them but for which no
    /// identity was established answers 500 `IDEMPOTENCY_SCOPE_UNRESOLVED` instead of being
    /// scoped by its peer address. Replaces the list; compared case-insensitively.
    pub fn credential_headers<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.0.credential_headers = names
            .into_iter()
            .map(|n| n.as_ref().trim().to_ascii_lowercase())
            .collect();
        self
    }
    /// The methods endpoints apply to where they do not say (default POST and PATCH; the
    /// attribute's `methods = [...]` and [`EndpointConfig::methods`] override it).
    pub fn methods(mut self, methods: Methods) -> Self {
        self.0.methods = methods;
        self
    }
    /// Refuse a setup mistake the runtime sees on a request (a router-level layer outside the
    /// router, two in-memory stores serving one route, a `require_key` attribute under a layer
    /// whose key is optional) with 500 `IDEMPOTENCY_MISCONFIGURED`, instead of logging it once
    /// and carrying on unprotected.
    ///
    /// On by default in debug builds and off in release builds: each of these mistakes turns
    /// protection off without failing a single request, so a log line is easy to miss while
    /// developing, and a 500 on the first request that shows it is not; in production the
    /// same mistake, deployed, is better logged, counted (`misconfigured`) and served than
    /// turned into an outage. Set it either way to decide for yourself.
    pub fn strict(mut self, on: bool) -> Self {
        self.0.strict = on;
        self
    }
    /// Bound on the bytes of request and response bodies buffered at once across all requests
    /// (default 256 MiB). Past it, new requests get 503 `IDEMPOTENCY_STORE_FULL`. The handle
    /// builder's [`max_buffered_bytes`](crate::IdempotencyBuilder::max_buffered_bytes), where
    /// given, wins.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.0.max_buffered_bytes = bytes;
        self
    }
    /// Whether the handle runs the background sweeper, when built inside a Tokio runtime
    /// (default on). Turn it off when another process sweeps the shared store. The handle
    /// builder's [`sweeper`](crate::IdempotencyBuilder::sweeper), where given, wins.
    pub fn sweeper(mut self, on: bool) -> Self {
        self.0.sweeper = on;
        self
    }
    /// The finished configuration.
    pub fn build(self) -> Config {
        self.0
    }
}

/// Per-endpoint settings, as written in `#[idempotent(...)]`, given to the layer and the
/// middleware ([`IdempotencyLayer::endpoint`](crate::axum::IdempotencyLayer::endpoint),
/// `IdempotencyMiddleware::endpoint`), or read from a file (feature `serde`, the same keys as
/// the attribute's arguments); each setting left out falls back to [`Config`].
///
/// Every setter is a `const fn`, so a `const` can build one (the attribute's expansion does, so
/// overrides cost nothing per request); the lists also take owned values at run time
/// ([`non_replayable_owned`](Self::non_replayable_owned),
/// [`recorded_headers_owned`](Self::recorded_headers_owned)).
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::config::EndpointConfig;
/// use idempotent_runtime::config::{FailureMode, Oversized, ReuseStatus};
///
/// const PAYMENTS: EndpointConfig = EndpointConfig::new()
///     .require_key(true)
///     .lease(Duration::from_secs(30))
///     .reuse_status(ReuseStatus::Conflict)
///     .non_replayable(&[401, 403, 404, 408, 412, 429])
///     .recorded_headers(&["content-type", "location", "x-payment-id"])
///     .failure_mode(FailureMode::Closed)
///     .oversized(Oversized::RecordWithoutBody);
///
/// // The same at run time, with lists from elsewhere:
/// let statuses: Vec<u16> = vec![401, 403, 404, 408, 412, 429];
/// let loaded = EndpointConfig::new()
///     .require_key(true)
///     .lease(Duration::from_secs(30))
///     .reuse_status(ReuseStatus::Conflict)
///     .non_replayable_owned(statuses)
///     .recorded_headers_owned(["Content-Type", "Location", "X-Payment-Id"])
///     .failure_mode(FailureMode::Closed)
///     .oversized(Oversized::RecordWithoutBody);
/// assert_eq!(loaded, PAYMENTS);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EndpointConfig {
    pub(crate) require_key: bool,
    pub(crate) lease: Option<Duration>,
    pub(crate) retention: Option<Duration>,
    pub(crate) max_body: Option<usize>,
    pub(crate) max_response: Option<usize>,
    pub(crate) reuse_status: Option<ReuseStatus>,
    pub(crate) non_replayable: Option<Statuses>,
    pub(crate) recorded_headers: Option<HeaderNames>,
    pub(crate) failure_mode: Option<FailureMode>,
    pub(crate) oversized: Option<Oversized>,
    pub(crate) methods: Option<Methods>,
    pub(crate) key: Option<KeySource>,
    pub(crate) fingerprint: Option<BodySubset>,
    pub(crate) wait_in_progress: Option<Duration>,
}

/// A list of statuses: a `'static` slice (what a `const` holds) or a shared one (what a file
/// gives), cheap to clone either way, since every claimed request keeps its endpoint's lists.
#[derive(Clone)]
pub(crate) enum Statuses {
    Static(&'static [u16]),
    Shared(Arc<[u16]>),
}

impl Statuses {
    fn as_slice(&self) -> &[u16] {
        match self {
            Self::Static(list) => list,
            Self::Shared(list) => list,
        }
    }
}

/// A list of lowercase header names, as [`Statuses`].
#[derive(Clone)]
pub(crate) enum HeaderNames {
    Static(&'static [&'static str]),
    Shared(Arc<[Box<str>]>),
}

impl HeaderNames {
    fn contains(&self, lowercase_name: &str) -> bool {
        match self {
            Self::Static(list) => list.contains(&lowercase_name),
            Self::Shared(list) => list.iter().any(|n| &**n == lowercase_name),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &str> {
        let (fixed, shared) = match self {
            Self::Static(list) => (Some(list.iter().copied()), None),
            Self::Shared(list) => (None, Some(list.iter().map(|n| &**n))),
        };
        fixed
            .into_iter()
            .flatten()
            .chain(shared.into_iter().flatten())
    }
}

impl PartialEq for Statuses {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}
impl Eq for Statuses {}
impl std::fmt::Debug for Statuses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}
impl PartialEq for HeaderNames {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}
impl Eq for HeaderNames {}
impl std::fmt::Debug for HeaderNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The shortest lease an endpoint may set: it is renewed every third of it, so a few
/// milliseconds would renew in a busy loop.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(30);

/// Why a per-endpoint lease is refused (`None`: it is not).
pub(crate) const fn lease_refusal(lease: Duration) -> Option<&'static str> {
    if lease.as_nanos() < MIN_LEASE.as_nanos() {
        Some("`lease` must be at least 30ms: it is renewed every third of it")
    } else {
        None
    }
}

/// Why a status cannot be listed in `non_replayable` (`None`: it can). Only statuses 200–499
/// are ever recorded, so listing another would change nothing.
pub(crate) const fn status_refusal(status: u16) -> Option<&'static str> {
    if status >= 200 && status <= 499 {
        None
    } else {
        Some(
            "`non_replayable` lists statuses 200-499: 1xx and 5xx answers are never recorded, so \
             listing one changes nothing",
        )
    }
}

/// Why a name cannot be listed in `recorded_headers` as written (`None`: it can): names are
/// HTTP tokens, written in lower case.
pub(crate) const fn header_refusal(name: &str) -> Option<&'static str> {
    let bytes = name.as_bytes();
    if bytes.is_empty() {
        return Some("a header name in `recorded_headers` is empty");
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_uppercase() {
            return Some("header names in `recorded_headers` are written in lower case");
        }
        let token = b.is_ascii_lowercase()
            || b.is_ascii_digit()
            || matches!(
                b,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        if !token {
            return Some("a name in `recorded_headers` is not a header name (an HTTP token)");
        }
        i += 1;
    }
    None
}

impl EndpointConfig {
    /// An endpoint where the key is optional, with the runtime's settings: [`new`](Self::new).
    pub const OPTIONAL: Self = Self::new();
    /// An endpoint that requires a key: `new().require_key(true)`.
    pub const REQUIRED: Self = Self::new().require_key(true);

    /// Key optional, every other setting the runtime's ([`Config`]).
    pub const fn new() -> Self {
        Self {
            require_key: false,
            lease: None,
            retention: None,
            max_body: None,
            max_response: None,
            reuse_status: None,
            non_replayable: None,
            recorded_headers: None,
            failure_mode: None,
            oversized: None,
            methods: None,
            key: None,
            fingerprint: None,
            wait_in_progress: None,
        }
    }

    /// Refuse requests without a key (the attribute's `require_key`).
    pub const fn require_key(mut self, on: bool) -> Self {
        self.require_key = on;
        self
    }
    /// How long a claim blocks its key without renewal, overriding [`Config::lease`].
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }
    /// How long a completed response is replayed, overriding [`Config::retention`].
    pub const fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }
    /// Request body cap in bytes, overriding [`Config::max_body`].
    pub const fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = Some(bytes);
        self
    }
    /// Recorded response cap in bytes, overriding [`Config::max_response`].
    pub const fn max_response(mut self, bytes: usize) -> Self {
        self.max_response = Some(bytes);
        self
    }
    /// 422 or 409 for a reused key, overriding [`Config::reuse_status`].
    pub const fn reuse_status(mut self, status: ReuseStatus) -> Self {
        self.reuse_status = Some(status);
        self
    }
    /// Fail closed or open when the store is unreachable, overriding [`Config::failure_mode`].
    pub const fn failure_mode(mut self, mode: FailureMode) -> Self {
        self.failure_mode = Some(mode);
        self
    }
    /// What an answer over `max_response` leaves behind, overriding [`Config::oversized`].
    pub const fn oversized(mut self, policy: Oversized) -> Self {
        self.oversized = Some(policy);
        self
    }
    /// The methods this endpoint applies to, overriding [`Config::methods`] (POST and PATCH);
    /// other methods pass through untouched. GET, HEAD, OPTIONS, TRACE and CONNECT always pass
    /// (a set of [`Methods`] cannot hold them).
    pub const fn methods(mut self, methods: Methods) -> Self {
        self.methods = Some(methods);
        self
    }

    /// Where the key comes from ([the contract](crate::design) §4): a header other than
    /// [`Config::key_header`] (a webhook provider's `webhook-id`), or a JSON Pointer into the
    /// body (`KeySource::body_static("/id")`, a Stripe-style event id). With a body source the
    /// body is read within its bounds before the key is known: the order of checks becomes
    /// body → key syntax → key presence → scope → claim, and a pointer that selects nothing is
    /// a missing key, one that selects an object, an array or a body that is not JSON an
    /// invalid one.
    pub const fn key(mut self, source: KeySource) -> Self {
        std::mem::forget(self.key.replace(source));
        self
    }

    /// Compare retries by these fields of a JSON body instead of the whole body
    /// ([`BodySubset`]: fingerprint version 2, the selected values in RFC 8785 form), so a
    /// client timestamp or nonce elsewhere in the body does not turn an honest retry into a
    /// 422. A body that is not JSON is then refused, 400 `IDEMPOTENCY_BODY_INVALID`.
    pub const fn fingerprint(mut self, subset: BodySubset) -> Self {
        std::mem::forget(self.fingerprint.replace(subset));
        self
    }

    /// How long a duplicate of a running request waits for its answer instead of 409,
    /// overriding [`Config::wait_in_progress`] (zero: no wait).
    pub const fn wait_in_progress(mut self, wait: Duration) -> Self {
        self.wait_in_progress = Some(wait);
        self
    }

    /// The key source in force: the endpoint's, else the configured header.
    pub(crate) fn key_source(&self) -> Option<&KeySource> {
        self.key.as_ref()
    }

    /// Statuses below 500 never recorded, replacing [`ConfigBuilder::non_replayable`]'s list.
    ///
    /// # Panics
    ///
    /// On a status outside 200–499 (never recorded anyway): in a `const`, a compile error.
    #[track_caller]
    pub const fn non_replayable(self, statuses: &'static [u16]) -> Self {
        let mut i = 0;
        while i < statuses.len() {
            if let Some(why) = status_refusal(statuses[i]) {
                panic!("{}", why);
            }
            i += 1;
        }
        self.with_statuses(Statuses::Static(statuses))
    }

    /// [`non_replayable`](Self::non_replayable) from a list built at run time.
    pub fn non_replayable_owned(self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.with_statuses(Statuses::Shared(statuses.into_iter().collect()))
    }

    /// Response headers kept in the record, replacing [`ConfigBuilder::recorded_headers`]'s
    /// list; the never-recorded ones (`set-cookie`, `content-length`, …) stay excluded.
    ///
    /// # Panics
    ///
    /// On a name that is not a lowercase HTTP token: in a `const`, a compile error.
    #[track_caller]
    pub const fn recorded_headers(self, lowercase_names: &'static [&'static str]) -> Self {
        let mut i = 0;
        while i < lowercase_names.len() {
            if let Some(why) = header_refusal(lowercase_names[i]) {
                panic!("{}", why);
            }
            i += 1;
        }
        self.with_headers(HeaderNames::Static(lowercase_names))
    }

    /// [`recorded_headers`](Self::recorded_headers) from names given at run time, in any case.
    pub fn recorded_headers_owned<I, S>(self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let names = names.into_iter();
        let names = names.map(|n| n.as_ref().trim().to_ascii_lowercase().into_boxed_str());
        self.with_headers(HeaderNames::Shared(names.collect()))
    }

    // A `const fn` cannot drop a value that owns memory: the replaced list is taken out and
    // forgotten, which leaks only when a list given at run time is replaced by a `'static`
    // one on the same value.
    const fn with_statuses(mut self, list: Statuses) -> Self {
        std::mem::forget(self.non_replayable.replace(list));
        self
    }

    const fn with_headers(mut self, list: HeaderNames) -> Self {
        std::mem::forget(self.recorded_headers.replace(list));
        self
    }

    /// The settings in force for this endpoint.
    pub(crate) fn resolve(&self, config: &Config) -> Effective {
        Effective {
            require_key: self.require_key,
            lease: self.lease.unwrap_or(config.lease),
            retention: self.retention.unwrap_or(config.retention),
            max_body: self.max_body.unwrap_or(config.max_body),
            max_response: self.max_response.unwrap_or(config.max_response),
            reuse_status: self.reuse_status.unwrap_or(config.reuse_status),
            failure_mode: self.failure_mode.unwrap_or(config.failure_mode),
            methods: self.methods.unwrap_or(config.methods),
            fingerprint: self.fingerprint.clone(),
            wait_in_progress: self.wait_in_progress.unwrap_or(config.wait_in_progress),
            recording: Recording {
                non_replayable: self.non_replayable.clone(),
                recorded_headers: self.recorded_headers.clone(),
                oversized: self.oversized,
            },
        }
    }

    /// Whether this endpoint applies to a request with `method`: one of its
    /// [`methods`](Self::methods), else the configured ones. Any other request passes through
    /// untouched, keyed or not, even under `require_key`, on both frameworks alike.
    pub fn applies_to(&self, config: Option<&Config>, method: &str) -> bool {
        let configured = config.map_or(Methods::DEFAULT, |c| c.methods);
        self.methods.unwrap_or(configured).contains(method)
    }
}

/// A type that names an endpoint's settings, so that an extractor can carry them as its one
/// type parameter: what `#[idempotent(...)]` emits for each handler. `()` is the default, an
/// endpoint with the key optional and the runtime's settings.
pub trait Endpoint: Send + Sync + 'static {
    /// The settings, built in a `const`: a bad value is a compile error.
    const CONFIG: &'static EndpointConfig;
}

impl Endpoint for () {
    const CONFIG: &'static EndpointConfig = &EndpointConfig::OPTIONAL;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_design() {
        let c = Config::default();
        assert_eq!(c.lease(), Duration::from_secs(60));
        assert_eq!(c.retention(), Duration::from_secs(86_400));
        assert_eq!(c.in_progress_retry_after(), Duration::from_secs(1));
        assert_eq!(c.store_retry_after(), Duration::from_secs(1));
        assert_eq!((c.max_body(), c.max_response()), (1 << 20, 1 << 20));
        assert_eq!(c.reuse_status().code(), 422);
        assert_eq!(c.missing_key_status().code(), 400);
        assert_eq!(c.failure_mode(), FailureMode::Closed);
        assert_eq!(c.oversized(), Oversized::RunAgain);
        assert_eq!(c.key_header(), "idempotency-key");
        assert_eq!(c.credential_headers(), ["authorization"]);
        for s in [200, 201, 302, 400, 404, 409, 422, 499] {
            assert!(c.is_recordable_status(s), "{s}");
        }
        for s in [100, 101, 401, 403, 408, 412, 429, 500, 503] {
            assert!(!c.is_recordable_status(s), "{s}");
        }
    }

    #[test]
    fn never_recorded_headers_cannot_be_allowlisted() {
        let c = Config::builder()
            .recorded_headers(["Set-Cookie", "X-Request-Id", "content-length"])
            .build();
        assert!(!c.records_header("set-cookie"));
        assert!(!c.records_header("content-length"));
        assert!(c.records_header("x-request-id"));
        assert!(!c.records_header("content-type"));
    }

    #[test]
    fn header_names_are_kept_lowercase() {
        let c = Config::builder()
            .key_header("X-Idempotency-Key")
            .credential_headers(["Authorization", "Cookie"])
            .build();
        assert_eq!(c.key_header(), "x-idempotency-key");
        assert_eq!(c.credential_headers(), ["authorization", "cookie"]);
    }

    #[test]
    fn endpoint_overrides_win() {
        let e = EndpointConfig {
            lease: Some(Duration::from_secs(5)),
            ..EndpointConfig::REQUIRED
        };
        let eff = e.resolve(&Config::default());
        assert!(eff.require_key);
        assert_eq!(eff.lease, Duration::from_secs(5));
        assert_eq!(eff.retention, Duration::from_secs(86_400));
        let config = Config::default();
        assert_eq!(eff.recording.oversized(&config), Oversized::RunAgain);
        let bodiless = EndpointConfig {
            oversized: Some(Oversized::RecordWithoutBody),
            ..EndpointConfig::REQUIRED
        };
        let eff = bodiless.resolve(&config);
        assert_eq!(
            eff.recording.oversized(&config),
            Oversized::RecordWithoutBody
        );
    }
}

#[cfg(feature = "serde")]
mod file;
