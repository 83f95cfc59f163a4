//! Verifying inbound [Standard Webhooks](https://www.standardwebhooks.com/) signatures, before
//! the idempotency step (feature `webhooks`).
//!
//! A provider that follows the spec (Svix and the services that send through it, among others)
//! sends three headers beside the body:
//!
//! - `webhook-id`: the delivery's id, the same on every redelivery: the idempotency key;
//! - `webhook-timestamp`: the attempt's time, integer seconds since the UNIX epoch (fresh on each
//!   redelivery);
//! - `webhook-signature`: space-separated signatures `v1,<base64>`, each an HMAC-SHA256 of
//!   `{id}.{timestamp}.{body}` with the endpoint's secret (`whsec_<base64 of the key>`). Several
//!   appear while the provider rotates its secret; any one matching is enough.
//!
//! [`StandardWebhooks::verify`] checks that one signature matches (compared in constant time)
//! and that the timestamp is within the tolerance of now, both ways (default five minutes), so
//! a captured delivery cannot be replayed later.
//!
//! # Where it runs
//!
//! Verification is the receiver's authentication, so it runs *before* the idempotency step, an
//! outer layer in tower terms, exactly where the crate asks authentication to go: a delivery
//! with a bad signature must never claim its id (an attacker would otherwise block the real
//! delivery, or be handed its recorded answer). What the wiring looks like:
//!
//! - the route's key is the `webhook-id` header (`key = header("webhook-id")`);
//! - an axum middleware (`axum::middleware::from_fn`) or an actix-web `wrap_fn` around the
//!   idempotent route buffers the body (within the same `max_body`), calls
//!   `verify(|name| headers.get(name).map(|v| v.as_bytes()), &body, SystemTime::now())`,
//!   answers [`WebhookError::status`] (401) on `Err`, and on `Ok` puts the provider's
//!   [`Identity`](crate::scope::Identity) (say `Identity::subject("webhooks", "acme-payments")`) in
//!   the request extensions and passes the buffered body on: the provider is the scope's
//!   identity, so two providers' ids never meet;
//! - an extractor before the handler's last parameter works the same way with the attribute.
//!
//! A redelivery carries a new timestamp and signature for the same id and body, so the
//! fingerprint (which does not cover headers) is unchanged and the redelivery is answered with
//! the recorded 2xx. A provider treats any 2xx as delivered and anything else (409 included) as
//! "retry later", on its backoff schedule; `410 Gone` asks it to stop sending to the endpoint.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use idempotent_runtime::webhook::StandardWebhooks;
//!
//! let verifier = StandardWebhooks::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
//! let body = br#"{"test": 2432232314}"#;
//! let headers = [
//!     ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
//!     ("webhook-timestamp", "1614265330"),
//!     ("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="),
//! ];
//! let lookup = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_bytes());
//! let sent = SystemTime::UNIX_EPOCH + Duration::from_secs(1614265330);
//! assert!(verifier.verify(lookup, body, sent + Duration::from_secs(10)).is_ok());
//! assert!(verifier.verify(lookup, body, sent + Duration::from_secs(3600)).is_err()); // too old
//! assert!(verifier.verify(lookup, b"{}", sent).is_err()); // another body
//! ```

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The header carrying the delivery id.
pub(crate) const ID_HEADER: &str = "webhook-id";
/// The header carrying the attempt's timestamp.
pub(crate) const TIMESTAMP_HEADER: &str = "webhook-timestamp";
/// The header carrying the signatures.
pub(crate) const SIGNATURE_HEADER: &str = "webhook-signature";
/// The spec's default tolerance between the timestamp and now, either way.
pub(crate) const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

const SECRET_PREFIX: &str = "whsec_";

type HmacSha256 = Hmac<Sha256>;

/// A Standard Webhooks verifier for one endpoint: its secret(s) and timestamp tolerance.
///
/// Its `Debug` never shows a secret.
#[derive(Clone)]
pub struct StandardWebhooks {
    keys: Vec<Vec<u8>>,
    tolerance: Duration,
}

/// Why a secret was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretError {
    /// Nothing after the `whsec_` prefix.
    Empty,
    /// The part after `whsec_` is not standard base64 (with padding).
    NotBase64,
}

impl fmt::Display for SecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the webhook secret is empty"),
            Self::NotBase64 => f.write_str(
                "a Standard Webhooks secret is `whsec_` followed by standard base64 of the key",
            ),
        }
    }
}

impl std::error::Error for SecretError {}

/// Why a delivery was not verified. Every variant answers 401 ([`status`](Self::status)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WebhookError {
    /// A required header is absent (its name).
    MissingHeader(&'static str),
    /// A header is present but unusable: not UTF-8, empty, or (for `webhook-id`) containing `.`,
    /// which would make the signed content ambiguous.
    InvalidHeader(&'static str),
    /// `webhook-timestamp` is not integer seconds.
    InvalidTimestamp,
    /// The timestamp is older than the tolerance: a late replay.
    TimestampTooOld,
    /// The timestamp is further in the future than the tolerance.
    TimestampTooNew,
    /// No `v1` signature in the header matches.
    SignatureMismatch,
}

impl WebhookError {
    /// 401: the delivery is not authenticated. One status for every reason, so that a prober
    /// learns nothing from the answer; providers retry any non-2xx anyway.
    pub fn status(&self) -> u16 {
        401
    }
}

impl fmt::Display for WebhookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingHeader(name) => write!(f, "the webhook delivery has no `{name}` header"),
            Self::InvalidHeader(name) => {
                write!(f, "the webhook delivery's `{name}` header is unusable")
            }
            Self::InvalidTimestamp => {
                f.write_str("`webhook-timestamp` is not integer seconds since the epoch")
            }
            Self::TimestampTooOld => {
                f.write_str("the webhook delivery's timestamp is older than the tolerance")
            }
            Self::TimestampTooNew => f.write_str(
                "the webhook delivery's timestamp is further in the future than the tolerance",
            ),
            Self::SignatureMismatch => {
                f.write_str("no signature of the webhook delivery matches the secret")
            }
        }
    }
}

impl std::error::Error for WebhookError {}

fn decode_secret(secret: &str) -> Result<Vec<u8>, SecretError> {
    // As the spec's reference libraries: the prefix is optional.
    let encoded = secret.trim();
    let encoded = encoded.strip_prefix(SECRET_PREFIX).unwrap_or(encoded);
    if encoded.is_empty() {
        return Err(SecretError::Empty);
    }
    STANDARD.decode(encoded).map_err(|_| SecretError::NotBase64)
}

impl StandardWebhooks {
    /// A verifier for the secret `whsec_<base64>` (the prefix may be left out), with the
    /// default tolerance. A key of any length is accepted (the spec asks senders for 24 to 64
    /// random bytes; the conformance servers' `conformance` is 11).
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        Ok(Self::from_key(decode_secret(secret)?))
    }

    /// A verifier for the raw key bytes.
    pub fn from_key(key: impl Into<Vec<u8>>) -> Self {
        Self {
            keys: vec![key.into()],
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// Also accepts signatures made with `secret`: for the receiver's side of a secret rotation,
    /// while deliveries signed with the old secret may still arrive.
    pub fn also_accept(mut self, secret: &str) -> Result<Self, SecretError> {
        self.keys.push(decode_secret(secret)?);
        Ok(self)
    }

    /// How far the timestamp may be from now, either way (default five minutes).
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies a delivery: `header` looks a header up by its lowercase name (the first value;
    /// an adapter that received `webhook-signature` on several lines passes them joined by a
    /// space), `body` is the body as received, `now` the receiver's time.
    pub fn verify<'h>(
        &self,
        mut header: impl FnMut(&str) -> Option<&'h [u8]>,
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), WebhookError> {
        let id = header(ID_HEADER).ok_or(WebhookError::MissingHeader(ID_HEADER))?;
        let timestamp =
            header(TIMESTAMP_HEADER).ok_or(WebhookError::MissingHeader(TIMESTAMP_HEADER))?;
        let signatures =
            header(SIGNATURE_HEADER).ok_or(WebhookError::MissingHeader(SIGNATURE_HEADER))?;
        self.verify_parts(id, timestamp, signatures, body, now)
    }

    /// [`verify`](Self::verify) with the three header values given directly.
    pub fn verify_parts(
        &self,
        id: &[u8],
        timestamp: &[u8],
        signatures: &[u8],
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), WebhookError> {
        if id.is_empty() || id.contains(&b'.') || std::str::from_utf8(id).is_err() {
            return Err(WebhookError::InvalidHeader(ID_HEADER));
        }
        let sent = parse_timestamp(timestamp)?;
        let now = unix_seconds(now);
        let tolerance = i128::from(self.tolerance.as_secs());
        if now - sent > tolerance {
            return Err(WebhookError::TimestampTooOld);
        }
        if sent - now > tolerance {
            return Err(WebhookError::TimestampTooNew);
        }
        let signatures = std::str::from_utf8(signatures)
            .map_err(|_| WebhookError::InvalidHeader(SIGNATURE_HEADER))?;
        let candidates: Vec<Vec<u8>> = signatures
            .split(' ')
            .filter_map(|s| s.split_once(','))
            .filter(|(version, _)| *version == "v1")
            .filter_map(|(_, sig)| STANDARD.decode(sig).ok())
            .collect();
        for key in &self.keys {
            let mac = signed(key, id, timestamp, body);
            // `verify_slice` compares in constant time; a wrong-length candidate fails at once,
            // which reveals only its length, which the sender chose.
            if candidates
                .iter()
                .any(|candidate| mac.clone().verify_slice(candidate).is_ok())
            {
                return Ok(());
            }
        }
        Err(WebhookError::SignatureMismatch)
    }

    /// Signs a delivery as a Standard Webhooks sender does: `v1,<base64>` with the first
    /// secret (for tests, and for senders of this crate's own webhooks).
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let key = self.keys.first().map_or(&[][..], Vec::as_slice);
        let mac = signed(key, id.as_bytes(), timestamp.to_string().as_bytes(), body);
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// The MAC over `{id}.{timestamp}.{body}`, ready to finalize or verify.
fn signed(key: &[u8], id: &[u8], timestamp: &[u8], body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts a key of any length");
    mac.update(id);
    mac.update(b".");
    mac.update(timestamp);
    mac.update(b".");
    mac.update(body);
    mac
}

/// Integer seconds: ASCII digits only (at most 19, so it fits), as senders write them.
fn parse_timestamp(raw: &[u8]) -> Result<i128, WebhookError> {
    if raw.is_empty() || raw.len() > 19 || !raw.iter().all(u8::is_ascii_digit) {
        return Err(WebhookError::InvalidTimestamp);
    }
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse::<i128>().ok())
        .ok_or(WebhookError::InvalidTimestamp)
}

fn unix_seconds(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i128::from(d.as_secs()),
        Err(before) => -i128::from(before.duration().as_secs()),
    }
}

impl fmt::Debug for StandardWebhooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StandardWebhooks")
            .field("secrets", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SPEC_TS: i64 = 1614265330;
    const SPEC_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    /// The conformance servers' secret: `whsec_` + base64("conformance").
    const CONFORMANCE_SECRET: &str = "whsec_Y29uZm9ybWFuY2U=";

    fn at(secs: i64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs as u64)
    }

    fn verify(
        v: &StandardWebhooks,
        id: &str,
        ts: &str,
        sig: &str,
        body: &[u8],
        now: i64,
    ) -> Result<(), WebhookError> {
        let headers = [
            (ID_HEADER, id),
            (TIMESTAMP_HEADER, ts),
            (SIGNATURE_HEADER, sig),
        ];
        v.verify(
            |name| {
                headers
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.as_bytes())
            },
            body,
            at(now),
        )
    }

    /// The spec's published vector (its reference libraries' tests, and the Svix libraries'),
    /// which an independent Python `hmac` computation reproduces too.
    #[test]
    fn the_published_test_vector_reproduces_exactly() {
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        assert_eq!(v.sign(SPEC_ID, SPEC_TS, SPEC_BODY), SPEC_SIGNATURE);
        let ts = SPEC_TS.to_string();
        assert_eq!(
            verify(&v, SPEC_ID, &ts, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
            Ok(())
        );
        // The reference Rust library's own vector, and the prefix is optional.
        let v = StandardWebhooks::new("C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
        assert_eq!(
            v.sign(
                "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                1649367553,
                br#"{"email":"test@example.com","username":"test_user"}"#
            ),
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
        );
    }

    #[test]
    fn the_conformance_secret_signs_and_verifies() {
        let v = StandardWebhooks::new(CONFORMANCE_SECRET).unwrap();
        assert_eq!(v.keys[0], b"conformance");
        let sig = v.sign("msg_1", 1_700_000_000, b"{\"n\":1}");
        // Independently: python3 -c 'import hmac,hashlib,base64;
        // print(base64.b64encode(hmac.new(b"conformance", b"msg_1.1700000000.{\"n\":1}", hashlib.sha256).digest()))'
        assert_eq!(sig, "v1,U5kmP1JmBxLQJMzDpXrdY+XBGiv39VZLsmk4MNU7j6I=");
        assert_eq!(
            verify(&v, "msg_1", "1700000000", &sig, b"{\"n\":1}", 1_700_000_000),
            Ok(())
        );
    }

    #[test]
    fn any_one_of_several_signatures_is_enough() {
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        let ts = SPEC_TS.to_string();
        let header = format!(
            "v1,bm9wZQ== v1a,{} v2,{} {SPEC_SIGNATURE} v1,not-base64!",
            &SPEC_SIGNATURE[3..],
            &SPEC_SIGNATURE[3..]
        );
        assert_eq!(
            verify(&v, SPEC_ID, &ts, &header, SPEC_BODY, SPEC_TS),
            Ok(())
        );
        // The right bytes under another version tag do not count.
        let other = format!("v1a,{} v2,{}", &SPEC_SIGNATURE[3..], &SPEC_SIGNATURE[3..]);
        assert_eq!(
            verify(&v, SPEC_ID, &ts, &other, SPEC_BODY, SPEC_TS),
            Err(WebhookError::SignatureMismatch)
        );
        assert_eq!(
            verify(&v, SPEC_ID, &ts, "", SPEC_BODY, SPEC_TS),
            Err(WebhookError::SignatureMismatch)
        );
    }

    #[test]
    fn anything_changed_breaks_the_signature() {
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        let ts = SPEC_TS.to_string();
        let later = (SPEC_TS + 1).to_string();
        for (id, ts, body) in [
            ("msg_p5jXN8AQM9LWM0D4loKWxJeK", ts.as_str(), SPEC_BODY),
            (SPEC_ID, later.as_str(), SPEC_BODY),
            (SPEC_ID, ts.as_str(), br#"{"test": 2432232315}"#.as_slice()),
        ] {
            assert_eq!(
                verify(&v, id, ts, SPEC_SIGNATURE, body, SPEC_TS),
                Err(WebhookError::SignatureMismatch)
            );
        }
        let other = StandardWebhooks::new(CONFORMANCE_SECRET).unwrap();
        assert_eq!(
            verify(&other, SPEC_ID, &ts, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
            Err(WebhookError::SignatureMismatch)
        );
        // Until it is told to accept the old secret too.
        let rotating = other.also_accept(SPEC_SECRET).unwrap();
        assert_eq!(
            verify(&rotating, SPEC_ID, &ts, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
            Ok(())
        );
    }

    #[test]
    fn clock_skew_is_tolerated_both_ways_up_to_the_bound() {
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        let ts = SPEC_TS.to_string();
        let check = |now| verify(&v, SPEC_ID, &ts, SPEC_SIGNATURE, SPEC_BODY, now);
        assert_eq!(check(SPEC_TS + 300), Ok(()));
        assert_eq!(check(SPEC_TS - 300), Ok(()));
        assert_eq!(check(SPEC_TS + 301), Err(WebhookError::TimestampTooOld));
        assert_eq!(check(SPEC_TS - 301), Err(WebhookError::TimestampTooNew));
        let strict = v.clone().tolerance(Duration::from_secs(10));
        assert_eq!(
            verify(
                &strict,
                SPEC_ID,
                &ts,
                SPEC_SIGNATURE,
                SPEC_BODY,
                SPEC_TS + 11
            ),
            Err(WebhookError::TimestampTooOld)
        );
        // A receiver clock before the epoch, or a timestamp at the top of the range, is just far.
        assert_eq!(
            v.verify_parts(
                SPEC_ID.as_bytes(),
                b"9999999999999999999",
                SPEC_SIGNATURE.as_bytes(),
                SPEC_BODY,
                UNIX_EPOCH - Duration::from_secs(5)
            ),
            Err(WebhookError::TimestampTooNew)
        );
    }

    #[test]
    fn unusable_headers_are_refused_before_any_mac() {
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        let ts = SPEC_TS.to_string();
        for bad in [
            "",
            "-1",
            "+1614265330",
            "1614265330.5",
            " 1614265330",
            "1e9",
            "99999999999999999999",
        ] {
            assert_eq!(
                verify(&v, SPEC_ID, bad, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
                Err(WebhookError::InvalidTimestamp),
                "{bad:?}"
            );
        }
        assert_eq!(
            verify(&v, "msg.1", &ts, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
            Err(WebhookError::InvalidHeader(ID_HEADER))
        );
        assert_eq!(
            verify(&v, "", &ts, SPEC_SIGNATURE, SPEC_BODY, SPEC_TS),
            Err(WebhookError::InvalidHeader(ID_HEADER))
        );
        let none = |_: &str| None;
        assert_eq!(
            v.verify(none, SPEC_BODY, at(SPEC_TS)),
            Err(WebhookError::MissingHeader(ID_HEADER))
        );
        let only_id = |name: &str| (name == ID_HEADER).then_some(SPEC_ID.as_bytes());
        assert_eq!(
            v.verify(only_id, SPEC_BODY, at(SPEC_TS)),
            Err(WebhookError::MissingHeader(TIMESTAMP_HEADER))
        );
        assert_eq!(WebhookError::SignatureMismatch.status(), 401);
    }

    #[test]
    fn secrets_are_checked_and_never_shown() {
        assert_eq!(
            StandardWebhooks::new("whsec_").unwrap_err(),
            SecretError::Empty
        );
        assert_eq!(
            StandardWebhooks::new("whsec_not base64").unwrap_err(),
            SecretError::NotBase64
        );
        let v = StandardWebhooks::new(SPEC_SECRET).unwrap();
        let debug = format!("{v:?}");
        assert!(!debug.contains("MfKQ") && !debug.contains("49"), "{debug}");
    }

    proptest! {
        #[test]
        fn arbitrary_headers_never_panic_and_never_verify(
            id in proptest::collection::vec(any::<u8>(), 0..40),
            ts in proptest::collection::vec(any::<u8>(), 0..24),
            sig in proptest::collection::vec(any::<u8>(), 0..120),
            body in proptest::collection::vec(any::<u8>(), 0..64),
            now in any::<u32>(),
        ) {
            let v = StandardWebhooks::new(CONFORMANCE_SECRET).unwrap();
            let r = v.verify_parts(&id, &ts, &sig, &body, at(i64::from(now)));
            prop_assert!(r.is_err());
        }

        #[test]
        fn what_is_signed_verifies(id in "[a-zA-Z0-9_-]{1,40}", body in proptest::collection::vec(any::<u8>(), 0..256), skew in -300i64..=300) {
            let v = StandardWebhooks::new(CONFORMANCE_SECRET).unwrap();
            let sig = v.sign(&id, SPEC_TS, &body);
            prop_assert_eq!(
                v.verify_parts(id.as_bytes(), SPEC_TS.to_string().as_bytes(), sig.as_bytes(), &body, at(SPEC_TS + skew)),
                Ok(())
            );
        }
    }
}
