//! Plain functions run at most once per key ([the contract](crate::design) §6, "Plain
//! functions"): a scheduled job, a CLI command, a consumer on a broker without a database, a
//! step of a saga. The same claim, lease renewal, fencing and release as a request, on any
//! store, with the function's serialisable output recorded and returned to every later call.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::once::{Once, OnceError};
//! use idempotent_runtime::scope::{ClientId, Identity, Scope};
//!
//! let idempotency = Idempotency::memory();
//! // Who runs it: the job's own identity, so its keys never meet a customer's.
//! let billing = Scope::from_identity(&Identity::client(ClientId::OAuth("billing".into())), None).unwrap();
//!
//! let charge = |amount: u64| async move { Ok::<_, std::io::Error>(format!("ch_{amount}")) };
//! let invoice = || Once::new(&idempotency, &billing, "invoice-42");
//! let first = invoice().run(&1200u64, || charge(1200)).await;
//! let again = invoice().run(&1200u64, || charge(1200)).await;
//! assert_eq!(first.unwrap(), "ch_1200");
//! assert_eq!(again.unwrap(), "ch_1200"); // recorded: the closure did not run again
//!
//! let changed = invoice().run(&999u64, || charge(999)).await;
//! assert!(matches!(changed, Err(OnceError::InputChanged)));
//! # }
//! ```
//!
//! # What is recorded
//!
//! The output as JSON (`serde_json`), with the encoding named in the record
//! (`idempotent-once: json/1`), so a later release can read what an earlier one wrote. The input
//! is fingerprinted, never stored: its JSON in RFC 8785 canonical form (so map order and number
//! forms do not matter), framed with the name given to [`Once::name`], under a version of its
//! own, so a record written by a request is never taken for a function's.
//!
//! # Failure
//!
//! An `Err` or a panic of the function releases the key: the next call runs it again, as it
//! does after an output larger than `max_response` (returned, not recorded). A store
//! that cannot be reached is [`OnceError::Store`] before anything runs (always fail closed: a
//! function has no client to tell). A crash while it runs leaves the key held until its lease
//! lapses; the next call after that runs it once more (counted `reclaimed`).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use tracing::Instrument as _;

use crate::digest::Encoder;
use crate::fingerprint::Fingerprint;
use crate::handle::Idempotency;
use crate::key::{IdempotencyKey, KeyError};
use crate::observe::{self, Event};
use crate::pipeline::claim::claim_waiting;
use crate::record::{self, Verdict};
use crate::reservation::{Ran, Reservation};
use crate::scope::Scope;
use crate::store::{ClaimRequest, FencingToken, RecordedResponse, StoreError};

/// The fingerprint version of a plain function's input: apart from every request version.
pub(crate) const ONCE_VERSION: u16 = 0x0100;

/// The header naming a recorded output's encoding.
const ENCODING_HEADER: &str = "idempotent-once";
const ENCODING: &str = "json/1";
const TAG: &[u8] = b"idempotent-once/v1\n";

/// Why [`Once::run`] did not return the function's output.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The function returned this error; the key was released.
    Failed(E),
    /// The function panicked; the key was released.
    Panicked,
    /// Another call with this key is running (past the [`wait`](Once::wait), if one was set).
    InProgress {
        /// When to try again: the configured `in_progress_retry_after`, capped by what is left
        /// of the running call's lease.
        retry_after: Duration,
    },
    /// The key was used with another input: a different call under a used key.
    InputChanged,
    /// The key breaks the key syntax (1–255 visible ASCII characters).
    InvalidKey(KeyError),
    /// The store could not be reached, or had no room, before anything ran.
    Store(StoreError),
    /// The input or output could not be encoded, or a recorded output read back as `T`
    /// (nothing ran, or the key was released).
    Encoding(serde_json::Error),
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "the function failed: {e}"),
            Self::Panicked => f.write_str("the function panicked"),
            Self::InProgress { retry_after } => write!(
                f,
                "another call with this key is running; try again in {} s",
                retry_after.as_secs()
            ),
            Self::InputChanged => f.write_str("this key was used with another input"),
            Self::InvalidKey(e) => write!(f, "invalid key: {e}"),
            Self::Store(e) => write!(f, "the idempotency store failed: {e}"),
            Self::Encoding(e) => write!(f, "the input or output could not be encoded: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for OnceError<E> {}

/// A call of a plain function under a key: [`Once::new`], its settings, then
/// [`run`](Self::run).
#[must_use = "nothing runs until `run` is awaited"]
pub struct Once<'a> {
    handle: &'a Idempotency,
    scope: &'a Scope,
    key: &'a str,
    name: &'a str,
    lease: Duration,
    retention: Duration,
    wait: Duration,
}

impl fmt::Debug for Once<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Once")
            .field("name", &self.name)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl<'a> Once<'a> {
    /// A call that runs at most once per `(scope, key)` under the handle `idempotency` (its
    /// store), with the runtime's lease, retention and `wait_in_progress`; see
    /// [the module](crate::once).
    pub fn new(idempotency: &'a Idempotency, scope: &'a Scope, key: &'a str) -> Self {
        let config = idempotency.config();
        Self {
            handle: idempotency,
            scope,
            key,
            name: "once",
            lease: config.lease(),
            retention: config.retention(),
            wait: config.wait_in_progress(),
        }
    }

    /// What the function is, for metrics, traces and [`inspect`](Idempotency::inspect) (its
    /// "route"; default `once`). It is part of the fingerprint: one key used by two functions
    /// is [`OnceError::InputChanged`].
    pub fn name(mut self, name: &'a str) -> Self {
        self.name = name;
        self
    }

    /// How long a crashed call blocks its key (renewed every third while the function runs);
    /// at least 30 ms, as everywhere a lease is set.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(crate::config::MIN_LEASE);
        self
    }

    /// How long the output is returned to later calls.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Wait up to `wait` for a running call with this key and return its output, instead of
    /// [`OnceError::InProgress`] at once; nothing (no connection, no lock) is held while it
    /// waits.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Runs `f` if no call with this key ran (or runs) with the same `input`, and records its
    /// output; otherwise returns the recorded output without running it.
    pub async fn run<I, T, E, F, Fut>(self, input: &I, f: F) -> Result<T, OnceError<E>>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // One span a call, as a request has, with the decision recorded in it.
        let span = observe::request_span(self.name);
        self.run_in_span(input, f).instrument(span).await
    }

    async fn run_in_span<I, T, E, F, Fut>(self, input: &I, f: F) -> Result<T, OnceError<E>>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let key = IdempotencyKey::new(self.key).map_err(OnceError::InvalidKey)?;
        observe::scoped(self.scope.hash());
        let fingerprint = fingerprint(self.name, input)?;
        let handle = self.handle;
        let store = handle.store();
        let claim = ClaimRequest {
            scope: self.scope.hash(),
            key: self.key,
            quota_bucket: self.scope.quota_bucket(),
            fingerprint,
            token: FencingToken::mint(),
            lease: self.lease,
            retention: self.retention,
            route: self.name,
            response_room: handle.config().max_response(),
        };
        let same_input = |f: &Fingerprint| *f == claim.fingerprint;
        let claimed = claim_waiting(handle, &claim, &key, same_input, self.wait).await;
        let verdict = claimed.map_err(|error| {
            observe::count(Event::StoreError, self.name);
            OnceError::Store(error)
        })?;
        match verdict {
            Verdict::Acquired { reclaimed } => {
                if reclaimed {
                    observe::count(Event::Reclaimed, self.name);
                    tracing::warn!(
                        name = self.name,
                        "reclaimed an abandoned call; its function may have run before"
                    );
                }
                observe::decided(if reclaimed { "reclaimed" } else { "executed" });
                observe::count(Event::Executed, self.name);
                let reservation = Reservation::held(
                    store.clone(),
                    *self.scope.hash(),
                    key,
                    claim.token,
                    self.lease,
                    self.retention,
                    handle.config().max_response(),
                    self.name,
                    handle.enter_running(),
                );
                let ran = self.execute(reservation, f).await;
                handle.wake_waiting();
                ran
            }
            Verdict::Replay(recorded) => {
                observe::decided("replayed");
                observe::count(Event::Replayed, self.name);
                decode(&recorded)
            }
            Verdict::InProgress { lease_left } => {
                observe::decided("in_progress");
                observe::count(Event::InProgress, self.name);
                let configured = handle.config().in_progress_retry_after();
                let secs = record::in_progress_retry_after(configured, lease_left);
                Err(OnceError::InProgress {
                    retry_after: Duration::from_secs(secs),
                })
            }
            Verdict::KeyReused => {
                observe::decided("key_reused");
                observe::count(Event::KeyReused, self.name);
                Err(OnceError::InputChanged)
            }
        }
    }

    /// Runs the function under the renewed lease, then records its output or releases the key.
    async fn execute<T, E, F, Fut>(
        &self,
        mut reservation: Reservation,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let work = std::pin::pin!(f());
        let output = match reservation.run(work).await {
            Ran::Panicked => {
                observe::count(Event::HandlerPanicked, self.name);
                return Err(OnceError::Panicked);
            }
            Ran::Returned(Err(error)) => {
                reservation.release().await;
                return Err(OnceError::Failed(error));
            }
            Ran::Returned(Ok(output)) => output,
        };
        match serde_json::to_vec(&output) {
            Ok(body) if body.len() > self.handle.config().max_response() => {
                // Kept only within the response cap, as an answer is: it is returned, and the
                // next call runs again.
                tracing::warn!(
                    name = self.name,
                    bytes = body.len(),
                    "the output is larger than max_response: returned, not recorded"
                );
                reservation.release().await;
                Ok(output)
            }
            Ok(body) => {
                let headers = vec![
                    (
                        "content-type".to_owned(),
                        Bytes::from_static(b"application/json"),
                    ),
                    (
                        ENCODING_HEADER.to_owned(),
                        Bytes::from_static(ENCODING.as_bytes()),
                    ),
                ];
                reservation
                    .complete(&RecordedResponse::new(200, headers, Bytes::from(body)))
                    .await;
                Ok(output)
            }
            Err(error) => {
                reservation.release().await;
                Err(OnceError::Encoding(error))
            }
        }
    }
}

/// SHA-256 over the version tag, the function's name and the input's canonical JSON.
fn fingerprint<I: Serialize + ?Sized, E>(
    name: &str,
    input: &I,
) -> Result<Fingerprint, OnceError<E>> {
    let json = serde_json::to_vec(input).map_err(OnceError::Encoding)?;
    // serde_json writes maps in their iteration order (a HashMap's is random): RFC 8785 makes
    // one input one fingerprint.
    let doc = crate::key::json::parse(&json).map_err(|e| {
        OnceError::Encoding(serde::ser::Error::custom(format!(
            "the input is not I-JSON: {e}"
        )))
    })?;
    let mut canonical = Vec::with_capacity(json.len());
    crate::key::json::write_canonical(&doc, &mut canonical).map_err(|e| {
        OnceError::Encoding(serde::ser::Error::custom(format!(
            "the input is not I-JSON: {e}"
        )))
    })?;
    let mut h = Sha256::new();
    h.update(TAG);
    let mut enc = Encoder(&mut h);
    enc.bytes(name.as_bytes());
    enc.bytes(&canonical);
    Ok(Fingerprint {
        version: ONCE_VERSION,
        digest: h.finalize().into(),
    })
}

/// A recorded output, read back in the encoding its record names.
fn decode<T: DeserializeOwned, E>(recorded: &RecordedResponse) -> Result<T, OnceError<E>> {
    let encoding = recorded
        .headers
        .iter()
        .find(|(name, _)| name == ENCODING_HEADER)
        .map(|(_, value)| &value[..]);
    if encoding != Some(ENCODING.as_bytes()) {
        return Err(OnceError::Encoding(serde::de::Error::custom(
            "the record under this key is not a function's output (a request's, or an unknown encoding)",
        )));
    }
    serde_json::from_slice(&recorded.body).map_err(OnceError::Encoding)
}

#[cfg(test)]
mod tests;
