//! `Config` and `EndpointConfig` from a service's own configuration file (feature `serde`):
//! every field optional, defaulting as [`Config::default`] (or, per endpoint, to the runtime's
//! settings); durations and sizes in [the grammar](super::grammar) the attribute reads.

use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};

use super::{
    Config, EndpointConfig, FailureMode, Methods, MissingKeyStatus, Oversized, ReuseStatus,
    grammar, header_refusal, lease_refusal, status_refusal,
};
use crate::scope::Anonymous;

/// A duration or a size in [the grammar](super::grammar) the attribute shares, or a number (of
/// seconds for a duration, of bytes for a size).
struct Human<T>(T);

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Number(f64),
    Text(String),
}

impl<'de> Deserialize<'de> for Human<Duration> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Number(secs) => Duration::try_from_secs_f64(secs).map_err(|_| {
                de::Error::custom(format!(
                    "{secs} is not a duration: a number is seconds, at least zero"
                ))
            }),
            Raw::Text(text) => grammar::parse_duration(&text)
                .map_err(|e| de::Error::custom(format!("{text:?} {e}"))),
        }
        .map(Human)
    }
}

impl<'de> Deserialize<'de> for Human<usize> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Number(n) if n >= 0.0 && n.fract() == 0.0 && n <= usize::MAX as f64 => {
                Ok(n as usize)
            }
            Raw::Number(n) => Err(de::Error::custom(format!(
                "{n} is not a size: a number is a whole number of bytes"
            ))),
            Raw::Text(text) => {
                grammar::parse_size(&text).map_err(|e| de::Error::custom(format!("{text:?} {e}")))
            }
        }
        .map(Human)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    Closed,
    Open,
}

impl From<Mode> for FailureMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Closed => Self::Closed,
            Mode::Open => Self::Open,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum OversizedPolicy {
    RunAgain,
    RecordWithoutBody,
}

impl From<OversizedPolicy> for Oversized {
    fn from(policy: OversizedPolicy) -> Self {
        match policy {
            OversizedPolicy::RunAgain => Self::RunAgain,
            OversizedPolicy::RecordWithoutBody => Self::RecordWithoutBody,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum AnonymousPolicy {
    PeerIp,
    Refuse,
}

fn reuse_status<E: de::Error>(status: u16) -> Result<ReuseStatus, E> {
    match status {
        422 => Ok(ReuseStatus::UnprocessableContent),
        409 => Ok(ReuseStatus::Conflict),
        other => Err(E::custom(format!("reuse_status {other}: 422 or 409"))),
    }
}

fn methods<E: de::Error>(names: &[String]) -> Result<Methods, E> {
    names
        .iter()
        .map(|n| Methods::parse(n).map_err(|why| E::custom(format!("methods: {n:?}: {why}"))))
        .collect()
}

/// Lowercase header names, each an HTTP token.
fn header_names<E: de::Error>(setting: &str, names: &[String]) -> Result<Vec<String>, E> {
    names
        .iter()
        .map(|n| {
            let lower = n.trim().to_ascii_lowercase();
            match header_refusal(&lower) {
                None => Ok(lower),
                Some(_) => Err(E::custom(format!("{setting}: {n:?} is not a header name"))),
            }
        })
        .collect()
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
    wait_in_progress: Option<Human<Duration>>,
    key_header: Option<String>,
    credential_headers: Option<Vec<String>>,
    methods: Option<Vec<String>>,
    strict: Option<bool>,
    max_buffered_bytes: Option<Human<usize>>,
    sweeper: Option<bool>,
}

/// Every field is optional and defaults as [`Config::default`]. Durations are strings in [the
/// grammar](super::grammar) the attribute reads (`"30s"`, `"1.5m"`, `"7d"`) or seconds as a
/// number; sizes are strings in the same grammar (`"64KiB"`, `"1MB"`, case matters) or bytes
/// as a number; `reuse_status` is 422 or 409, `missing_key_status` 400 or 428, `failure_mode`
/// `"closed"` or `"open"`, `oversized` `"run_again"` or `"record_without_body"`, `anonymous`
/// `"peer_ip"` or `"refuse"`, `trusted_proxies` CIDR strings, `key_header` a header name,
/// `credential_headers` a list of them, `methods` a list of `"POST"`, `"PUT"`, `"PATCH"`,
/// `"DELETE"`, `strict` and `sweeper` booleans, `max_buffered_bytes` a size. Unknown fields are
/// refused, so a misspelt setting never silently keeps its default.
///
/// ```
/// # fn main() -> Result<(), serde_json::Error> {
/// use std::time::Duration;
/// use idempotent_runtime::config::Config;
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
        if let Some(Human(v)) = f.wait_in_progress {
            b = b.wait_in_progress(v);
        }
        if let Some(v) = f.non_replayable {
            b = b.non_replayable(v);
        }
        if let Some(v) = f.recorded_headers {
            b = b.recorded_headers(v);
        }
        if let Some(status) = f.reuse_status {
            b = b.reuse_status(reuse_status::<D::Error>(status)?);
        }
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
        if let Some(mode) = f.failure_mode {
            b = b.failure_mode(mode.into());
        }
        if let Some(policy) = f.oversized {
            b = b.oversized(policy.into());
        }
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
        if let Some(name) = f.key_header {
            let [name] = <[String; 1]>::try_from(header_names::<D::Error>("key_header", &[name])?)
                .expect("one name in, one out");
            b = b.key_header(name);
        }
        if let Some(names) = f.credential_headers {
            b = b.credential_headers(header_names::<D::Error>("credential_headers", &names)?);
        }
        if let Some(names) = f.methods {
            b = b.methods(methods::<D::Error>(&names)?);
        }
        if let Some(on) = f.strict {
            b = b.strict(on);
        }
        if let Some(Human(bytes)) = f.max_buffered_bytes {
            b = b.max_buffered_bytes(bytes);
        }
        if let Some(on) = f.sweeper {
            b = b.sweeper(on);
        }
        Ok(b.build())
    }
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct EndpointFile {
    require_key: Option<bool>,
    lease: Option<Human<Duration>>,
    retention: Option<Human<Duration>>,
    max_body: Option<Human<usize>>,
    max_response: Option<Human<usize>>,
    oversized: Option<OversizedPolicy>,
    reuse_status: Option<u16>,
    failure_mode: Option<Mode>,
    non_replayable: Option<Vec<u16>>,
    recorded_headers: Option<Vec<String>>,
    methods: Option<Vec<String>>,
    key: Option<crate::key::KeySource>,
    fingerprint: Option<crate::fingerprint::BodySubset>,
    wait_in_progress: Option<Human<Duration>>,
}

/// The keys are the attribute's arguments (`require_key = true` where the attribute writes
/// the bare flag), each optional, read in the same grammar and refused where the attribute
/// would refuse them: a lease under 30 ms, a `non_replayable` status outside 200–499, a
/// `recorded_headers` entry that is not a header name (names are lowercased). Unknown fields
/// are refused. `key` is a header name (`"webhook-id"`) or `"body:/pointer"`; `fingerprint` a
/// list of JSON Pointers.
///
/// ```
/// # fn main() -> Result<(), serde_json::Error> {
/// use std::time::Duration;
/// use idempotent_runtime::config::EndpointConfig;
/// use idempotent_runtime::config::ReuseStatus;
///
/// let payments: EndpointConfig = serde_json::from_str(
///     r#"{"require_key": true, "lease": "30s", "reuse_status": 409, "non_replayable": [404]}"#,
/// )?;
/// const PAYMENTS: EndpointConfig = EndpointConfig::REQUIRED
///     .lease(Duration::from_secs(30))
///     .reuse_status(ReuseStatus::Conflict)
///     .non_replayable(&[404]);
/// assert_eq!(payments, PAYMENTS);
/// # Ok(()) }
/// ```
impl<'de> Deserialize<'de> for EndpointConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let f = EndpointFile::deserialize(d)?;
        let mut e = EndpointConfig::new();
        if let Some(on) = f.require_key {
            e = e.require_key(on);
        }
        if let Some(Human(lease)) = f.lease {
            if let Some(why) = lease_refusal(lease) {
                return Err(de::Error::custom(why));
            }
            e = e.lease(lease);
        }
        if let Some(Human(v)) = f.retention {
            e = e.retention(v);
        }
        if let Some(Human(v)) = f.max_body {
            e = e.max_body(v);
        }
        if let Some(Human(v)) = f.max_response {
            e = e.max_response(v);
        }
        if let Some(policy) = f.oversized {
            e = e.oversized(policy.into());
        }
        if let Some(status) = f.reuse_status {
            e = e.reuse_status(reuse_status::<D::Error>(status)?);
        }
        if let Some(mode) = f.failure_mode {
            e = e.failure_mode(mode.into());
        }
        if let Some(statuses) = f.non_replayable {
            if let Some(why) = statuses.iter().find_map(|&s| status_refusal(s)) {
                return Err(de::Error::custom(why));
            }
            e = e.non_replayable_owned(statuses);
        }
        if let Some(names) = f.recorded_headers {
            e = e.recorded_headers_owned(header_names::<D::Error>("recorded_headers", &names)?);
        }
        if let Some(names) = f.methods {
            e = e.methods(methods::<D::Error>(&names)?);
        }
        if let Some(source) = f.key {
            e = e.key(source);
        }
        if let Some(Human(wait)) = f.wait_in_progress {
            e = e.wait_in_progress(wait);
        }
        if let Some(subset) = f.fingerprint {
            if subset.pointers().is_empty() {
                return Err(de::Error::custom(
                    "fingerprint: an empty list would compare no part of the body; list the \
                     fields that make two requests the same, or leave it out for the whole body",
                ));
            }
            e = e.fingerprint(subset);
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file form reads durations and sizes through the one grammar: it accepts what the
    /// grammar accepts, with the same value, and refuses the rest with its message.
    #[test]
    fn durations_and_sizes_read_through_the_grammar() {
        let texts = [
            "500ms", "1.5s", "1.5m", "2m", "24h", "7d", "30", "0s", "30 s", "1min", "30S", "64KiB",
            "0.5KiB", "2MB", "4096", "1 MiB", "64kib", "64kB", "1.3B", "1m", "", "MiB", "-1s",
            "1e3s", "soon",
        ];
        for text in texts {
            let retention = serde_json::from_str::<Config>(&format!("{{\"retention\": {text:?}}}"));
            match grammar::parse_duration(text) {
                Ok(d) => assert_eq!(retention.unwrap().retention(), d, "{text:?}"),
                Err(e) => {
                    let error = retention.unwrap_err().to_string();
                    assert!(error.contains(e.message()), "{text:?}: {error}");
                }
            }
            let size = serde_json::from_str::<Config>(&format!("{{\"max_body\": {text:?}}}"));
            match grammar::parse_size(text) {
                Ok(n) => assert_eq!(size.unwrap().max_body(), n, "{text:?}"),
                Err(e) => {
                    let error = size.unwrap_err().to_string();
                    assert!(error.contains(e.message()), "{text:?}: {error}");
                }
            }
        }
        let numbers: Config = serde_json::from_str(r#"{"lease": 30, "max_body": 4096}"#).unwrap();
        assert_eq!(numbers.lease(), Duration::from_secs(30));
        assert_eq!(numbers.max_body(), 4096);
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
            r#"{"methods": ["GET"]}"#,
            r#"{"methods": ["post"]}"#,
            r#"{"strict": "yes"}"#,
            r#"{"key_header": "x idempotency key"}"#,
            r#"{"credential_headers": [""]}"#,
            r#"{"sweeper": 1}"#,
            r#"{"max_buffered_bytes": "lots"}"#,
        ] {
            assert!(
                serde_json::from_str::<Config>(bad).is_err(),
                "{bad} accepted"
            );
        }
        let empty: Config = serde_json::from_str("{}").unwrap();
        assert_eq!(format!("{empty:?}"), format!("{:?}", Config::default()));
    }

    #[test]
    fn an_endpoint_is_refused_where_the_attribute_would_be() {
        for (bad, why) in [
            (r#"{"lease": "10ms"}"#, "at least 30ms"),
            (r#"{"lease": "30 s"}"#, "without spaces"),
            (r#"{"max_response": "1mb"}"#, "case-sensitive"),
            (r#"{"non_replayable": [503]}"#, "200-499"),
            (r#"{"recorded_headers": ["x trace"]}"#, "not a header name"),
            (r#"{"reuse_status": 418}"#, "422 or 409"),
            (r#"{"methods": ["GET"]}"#, "safe methods"),
            (r#"{"require_key": "yes"}"#, "bool"),
            (r#"{"key_header": "x-key"}"#, "unknown field"),
            (r#"{"key": "body:id"}"#, "starts with `/`"),
            (r#"{"key": "x key"}"#, "not allowed in a header name"),
            (r#"{"fingerprint": []}"#, "compare no part of the body"),
            (r#"{"fingerprint": ["amount"]}"#, "starts with `/`"),
        ] {
            let error = serde_json::from_str::<EndpointConfig>(bad)
                .unwrap_err()
                .to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
        let empty: EndpointConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, EndpointConfig::OPTIONAL);
    }

    /// `key` and `fingerprint` read as the attribute writes them.
    #[test]
    fn key_source_and_fingerprint_fields() {
        use crate::fingerprint::BodySubset;
        use crate::key::{JsonPointer, KeySource};

        const FIELDS: &[JsonPointer] = &[
            JsonPointer::from_static("/type"),
            JsonPointer::from_static("/data"),
        ];
        const EVENTS: EndpointConfig = EndpointConfig::REQUIRED
            .key(KeySource::body_static("/id"))
            .fingerprint(BodySubset::from_static(FIELDS));
        let read: EndpointConfig = serde_json::from_str(
            r#"{"require_key": true, "key": "body:/id", "fingerprint": ["/type", "/data"]}"#,
        )
        .unwrap();
        assert_eq!(read, EVENTS);
        let header: EndpointConfig = serde_json::from_str(r#"{"key": "Webhook-Id"}"#).unwrap();
        assert_eq!(
            header,
            EndpointConfig::new().key(KeySource::header_static("webhook-id"))
        );
    }
}
