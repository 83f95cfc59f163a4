//! Settings, with the defaults of [the contract](crate::design), and the per-endpoint overrides the attribute emits.

use std::time::Duration;

use ipnet::IpNet;

use crate::scope::Anonymous;

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
/// use idempotent_runtime::EndpointConfig;
/// use idempotent_runtime::config::Oversized;
///
/// // A charge must never run twice, however large its receipt.
/// const CHARGE: EndpointConfig = EndpointConfig {
///     oversized: Some(Oversized::RecordWithoutBody),
///     ..EndpointConfig::REQUIRED
/// };
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
    pub(crate) key_header: String,
    pub(crate) credential_headers: Vec<String>,
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
            key_header: crate::key::HEADER_NAME.to_owned(),
            credential_headers: vec!["authorization".to_owned()],
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

    /// The header that carries the key (lowercase; default `idempotency-key`).
    pub fn key_header(&self) -> &str {
        &self.key_header
    }
    /// Headers that carry a credential (lowercase; default `authorization`): a request with one
    /// of them for which no identity was established is refused, never scoped by its peer.
    pub fn credential_headers(&self) -> &[String] {
        &self.credential_headers
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
    /// The finished configuration.
    pub fn build(self) -> Config {
        self.0
    }
}

/// Per-endpoint settings, as written in `#[idempotent(...)]` or given to the layer and
/// middleware ([`endpoint`](crate::axum::IdempotencyLayer::endpoint)); `None` falls back to
/// [`Config`].
///
/// The attribute emits this as a constant, so overrides cost nothing per request. Lists are
/// `'static` slices for the same reason: header names in lowercase.
///
/// ```
/// use idempotent_runtime::EndpointConfig;
/// use idempotent_runtime::config::{FailureMode, ReuseStatus};
///
/// const PAYMENTS: EndpointConfig = EndpointConfig {
///     reuse_status: Some(ReuseStatus::Conflict),
///     non_replayable: Some(&[401, 403, 408, 412, 429, 404]),
///     recorded_headers: Some(&["content-type", "location", "x-payment-id"]),
///     failure_mode: Some(FailureMode::Closed),
///     ..EndpointConfig::REQUIRED
/// };
/// assert!(PAYMENTS.require_key);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndpointConfig {
    /// Refuse requests without a key.
    pub require_key: bool,
    /// Lease override.
    pub lease: Option<Duration>,
    /// Retention override.
    pub retention: Option<Duration>,
    /// Request body cap override.
    pub max_body: Option<usize>,
    /// Recorded response cap override.
    pub max_response: Option<usize>,
    /// Status for a reused key, overriding [`Config::reuse_status`].
    pub reuse_status: Option<ReuseStatus>,
    /// Statuses below 500 never recorded, replacing [`ConfigBuilder::non_replayable`]'s list.
    pub non_replayable: Option<&'static [u16]>,
    /// Response headers kept in the record (lowercase), replacing
    /// [`ConfigBuilder::recorded_headers`]'s list; the never-recorded ones stay excluded.
    pub recorded_headers: Option<&'static [&'static str]>,
    /// Fail closed or open when the store is unreachable, overriding [`Config::failure_mode`].
    pub failure_mode: Option<FailureMode>,
    /// What an answer over `max_response` leaves behind, overriding [`Config::oversized`].
    pub oversized: Option<Oversized>,
}

impl EndpointConfig {
    /// An endpoint where the key is optional.
    pub const OPTIONAL: Self = Self {
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
    };
    /// An endpoint that requires a key.
    pub const REQUIRED: Self = Self {
        require_key: true,
        ..Self::OPTIONAL
    };

    /// The settings in force for this endpoint.
    pub fn resolve(&self, config: &Config) -> Effective {
        Effective {
            require_key: self.require_key,
            lease: self.lease.unwrap_or(config.lease),
            retention: self.retention.unwrap_or(config.retention),
            max_body: self.max_body.unwrap_or(config.max_body),
            max_response: self.max_response.unwrap_or(config.max_response),
            reuse_status: self.reuse_status.unwrap_or(config.reuse_status),
            failure_mode: self.failure_mode.unwrap_or(config.failure_mode),
            recording: Recording {
                non_replayable: self.non_replayable,
                recorded_headers: self.recorded_headers,
                oversized: self.oversized,
            },
        }
    }
}

/// Whether `#[idempotent]` applies to a request with this method: not to GET, HEAD, OPTIONS or
/// TRACE, which are idempotent by HTTP semantics (DESIGN.md §8). Such a request passes through
/// untouched, keyed or not, even under `require_key`, on both frameworks alike.
#[cfg(any(feature = "axum", feature = "actix"))]
pub(crate) fn attribute_applies_to(method: &str) -> bool {
    !matches!(method, "GET" | "HEAD" | "OPTIONS" | "TRACE")
}

/// Which responses an endpoint records: its overrides of [`Config`]'s lists, `None` meaning
/// the configured one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recording {
    /// Statuses below 500 never recorded.
    pub non_replayable: Option<&'static [u16]>,
    /// Response headers kept (lowercase).
    pub recorded_headers: Option<&'static [&'static str]>,
    /// What an answer over `max_response` leaves behind.
    pub oversized: Option<Oversized>,
}

impl Recording {
    /// Whether a response with this final status may be recorded and replayed.
    pub fn is_recordable_status(&self, config: &Config, status: u16) -> bool {
        match self.non_replayable {
            Some(list) => (200..500).contains(&status) && !list.contains(&status),
            None => config.is_recordable_status(status),
        }
    }

    /// What an answer over `max_response` leaves behind on this endpoint.
    pub fn oversized(&self, config: &Config) -> Oversized {
        self.oversized.unwrap_or(config.oversized)
    }

    /// Whether a response header (lowercase name) is kept in the record.
    pub fn records_header(&self, config: &Config, lowercase_name: &str) -> bool {
        match self.recorded_headers {
            Some(list) => {
                !NEVER_RECORDED.contains(&lowercase_name) && list.contains(&lowercase_name)
            }
            None => config.records_header(lowercase_name),
        }
    }
}

/// Endpoint settings merged with the runtime's [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effective {
    /// Refuse requests without a key.
    pub require_key: bool,
    /// Lease.
    pub lease: Duration,
    /// Retention.
    pub retention: Duration,
    /// Request body cap.
    pub max_body: usize,
    /// Recorded response cap.
    pub max_response: usize,
    /// Status for a reused key.
    pub reuse_status: ReuseStatus,
    /// Fail closed or open.
    pub failure_mode: FailureMode,
    /// Which responses are recorded.
    pub recording: Recording,
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

/// `Config` from a service's own configuration file (feature `serde`): every field optional,
/// defaulting as [`Config::default`]; durations and sizes in human units.
#[cfg(feature = "serde")]
mod file {
    use std::time::Duration;

    use serde::Deserialize;
    use serde::de::{self, Deserializer};

    use super::{Config, FailureMode, MissingKeyStatus, Oversized, ReuseStatus};
    use crate::scope::Anonymous;

    /// A duration: `"30s"`, `"500ms"`, `"1.5m"`, `"24h"`, `"7d"`, or a number of seconds.
    struct Human<T>(T);

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(f64),
        Text(String),
    }

    fn split(text: &str) -> Option<(f64, &str)> {
        let text = text.trim();
        let at = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(at);
        let number: f64 = number.parse().ok()?;
        (number.is_finite() && number >= 0.0).then_some((number, unit.trim()))
    }

    pub(super) fn duration(raw: &str) -> Option<Duration> {
        let (n, unit) = split(raw)?;
        let secs = match unit {
            "ms" => n / 1000.0,
            "" | "s" => n,
            "m" | "min" => n * 60.0,
            "h" => n * 3600.0,
            "d" => n * 86_400.0,
            _ => return None,
        };
        Duration::try_from_secs_f64(secs).ok()
    }

    pub(super) fn size(raw: &str) -> Option<usize> {
        let (n, unit) = split(raw)?;
        let factor: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "kib" | "k" => 1024.0,
            "mib" | "m" => 1024.0 * 1024.0,
            "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
            _ => return None,
        };
        let bytes = n * factor;
        (bytes.fract() == 0.0 && bytes <= usize::MAX as f64).then_some(bytes as usize)
    }

    impl<'de> Deserialize<'de> for Human<Duration> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            match Raw::deserialize(d)? {
                Raw::Number(secs) => Duration::try_from_secs_f64(secs).ok(),
                Raw::Text(text) => duration(&text),
            }
            .map(Human)
            .ok_or_else(|| {
                de::Error::custom("expected a duration such as \"30s\", \"500ms\", \"24h\"")
            })
        }
    }

    impl<'de> Deserialize<'de> for Human<usize> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            match Raw::deserialize(d)? {
                Raw::Number(n) if n >= 0.0 && n.fract() == 0.0 => Some(n as usize),
                Raw::Number(_) => None,
                Raw::Text(text) => size(&text),
            }
            .map(Human)
            .ok_or_else(|| de::Error::custom("expected a size such as \"1MiB\", \"64KiB\", 4096"))
        }
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Closed,
        Open,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum OversizedPolicy {
        RunAgain,
        RecordWithoutBody,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum AnonymousPolicy {
        PeerIp,
        Refuse,
    }

    #[derive(Deserialize, Default)]
    #[serde(default, deny_unknown_fields)]
    struct File {
        lease: Option<Human<Duration>>,
        retention: Option<Human<Duration>>,
        in_progress_retry_after: Option<Human<Duration>>,
        store_retry_after: Option<Human<Duration>>,
        max_body: Option<Human<usize>>,
        max_response: Option<Human<usize>>,
        body_timeout: Option<Human<Duration>>,
        non_replayable: Option<Vec<u16>>,
        recorded_headers: Option<Vec<String>>,
        reuse_status: Option<u16>,
        missing_key_status: Option<u16>,
        failure_mode: Option<Mode>,
        oversized: Option<OversizedPolicy>,
        anonymous: Option<AnonymousPolicy>,
        trusted_proxies: Option<Vec<String>>,
        shutdown_grace: Option<Human<Duration>>,
    }

    /// Every field is optional and defaults as [`Config::default`]. Durations are strings with
    /// a unit (`ms`, `s`, `m`, `h`, `d`) or seconds as a number; sizes are strings with a unit
    /// (`KiB`, `MiB`, `GiB`, `kB`, `MB`, `GB`) or bytes as a number; `reuse_status` is 422 or
    /// 409, `missing_key_status` 400 or 428, `failure_mode` `"closed"` or `"open"`, `oversized`
    /// `"run_again"` or `"record_without_body"`, `anonymous` `"peer_ip"` or `"refuse"`,
    /// `trusted_proxies` CIDR strings. Unknown fields are refused, so a misspelt setting never
    /// silently keeps its default.
    ///
    /// ```
    /// # fn main() -> Result<(), serde_json::Error> {
    /// use std::time::Duration;
    /// use idempotent_runtime::Config;
    ///
    /// let config: Config = serde_json::from_str(r#"{"lease": "30s", "max_body": "64KiB"}"#)?;
    /// assert_eq!(config.lease(), Duration::from_secs(30));
    /// assert_eq!(config.max_body(), 64 * 1024);
    /// # Ok(()) }
    /// ```
    impl<'de> Deserialize<'de> for Config {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let f = File::deserialize(d)?;
            let mut b = Config::builder();
            if let Some(Human(v)) = f.lease {
                b = b.lease(v);
            }
            if let Some(Human(v)) = f.retention {
                b = b.retention(v);
            }
            if let Some(Human(v)) = f.in_progress_retry_after {
                b = b.in_progress_retry_after(v);
            }
            if let Some(Human(v)) = f.store_retry_after {
                b = b.store_retry_after(v);
            }
            if let Some(Human(v)) = f.max_body {
                b = b.max_body(v);
            }
            if let Some(Human(v)) = f.max_response {
                b = b.max_response(v);
            }
            if let Some(Human(v)) = f.body_timeout {
                b = b.body_timeout(v);
            }
            if let Some(Human(v)) = f.shutdown_grace {
                b = b.shutdown_grace(v);
            }
            if let Some(v) = f.non_replayable {
                b = b.non_replayable(v);
            }
            if let Some(v) = f.recorded_headers {
                b = b.recorded_headers(v);
            }
            b = match f.reuse_status {
                None => b,
                Some(422) => b.reuse_status(ReuseStatus::UnprocessableContent),
                Some(409) => b.reuse_status(ReuseStatus::Conflict),
                Some(other) => {
                    return Err(de::Error::custom(format!(
                        "reuse_status {other}: 422 or 409"
                    )));
                }
            };
            b = match f.missing_key_status {
                None => b,
                Some(400) => b.missing_key_status(MissingKeyStatus::BadRequest),
                Some(428) => b.missing_key_status(MissingKeyStatus::PreconditionRequired),
                Some(other) => {
                    return Err(de::Error::custom(format!(
                        "missing_key_status {other}: 400 or 428"
                    )));
                }
            };
            b = match f.failure_mode {
                None => b,
                Some(Mode::Closed) => b.failure_mode(FailureMode::Closed),
                Some(Mode::Open) => b.failure_mode(FailureMode::Open),
            };
            b = match f.oversized {
                None => b,
                Some(OversizedPolicy::RunAgain) => b.oversized(Oversized::RunAgain),
                Some(OversizedPolicy::RecordWithoutBody) => {
                    b.oversized(Oversized::RecordWithoutBody)
                }
            };
            b = match f.anonymous {
                None => b,
                Some(AnonymousPolicy::PeerIp) => b.anonymous(Anonymous::PeerIp),
                Some(AnonymousPolicy::Refuse) => b.anonymous(Anonymous::Refuse),
            };
            if let Some(nets) = f.trusted_proxies {
                let nets = nets
                    .iter()
                    .map(|n| {
                        n.parse().map_err(|_| {
                            de::Error::custom(format!("trusted_proxies: {n:?} is not a CIDR"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                b = b.trusted_proxies(nets);
            }
            Ok(b.build())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn durations_and_sizes_read_in_human_units() {
            assert_eq!(duration("500ms"), Some(Duration::from_millis(500)));
            assert_eq!(duration("1.5s"), Some(Duration::from_millis(1500)));
            assert_eq!(duration("2m"), Some(Duration::from_secs(120)));
            assert_eq!(duration("24h"), Some(Duration::from_secs(86_400)));
            assert_eq!(duration("7d"), Some(Duration::from_secs(7 * 86_400)));
            assert_eq!(duration("30"), Some(Duration::from_secs(30)));
            for bad in ["", "s", "-1s", "3 fortnights", "1e3s"] {
                assert_eq!(duration(bad), None, "{bad:?}");
            }
            assert_eq!(size("64KiB"), Some(65_536));
            assert_eq!(size("1 MiB"), Some(1 << 20));
            assert_eq!(size("2MB"), Some(2_000_000));
            assert_eq!(size("4096"), Some(4096));
            assert_eq!(size("0.5KiB"), Some(512));
            for bad in ["", "MiB", "1.3B", "1 parsec"] {
                assert_eq!(size(bad), None, "{bad:?}");
            }
        }

        #[test]
        fn unknown_fields_and_bad_values_are_refused() {
            for bad in [
                r#"{"leese": "30s"}"#,
                r#"{"lease": "soon"}"#,
                r#"{"reuse_status": 418}"#,
                r#"{"failure_mode": "maybe"}"#,
                r#"{"oversized": "truncate"}"#,
                r#"{"trusted_proxies": ["10.0.0.0/99"]}"#,
            ] {
                assert!(
                    serde_json::from_str::<Config>(bad).is_err(),
                    "{bad} accepted"
                );
            }
            let empty: Config = serde_json::from_str("{}").unwrap();
            assert_eq!(format!("{empty:?}"), format!("{:?}", Config::default()));
        }
    }
}
