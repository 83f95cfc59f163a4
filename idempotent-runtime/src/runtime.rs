//! The handle applications share ([`Idempotency`]) and the framework-free request pipeline
//! the axum and actix integrations drive: begin (claim and decide), run the claimed handler under
//! a renewed lease, then record or release.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Notify;

use crate::config::{Config, Effective, FailureMode};
use crate::fingerprint::{self, Fingerprint, FingerprintContributor, FingerprintInput};
use crate::key::{IdempotencyKey, KeyError};
use crate::observe::{self, AuditDecision, AuditEvent, AuditSink, DiscardAudit, Event, KeyDisplay};
use crate::problem::{Problem, ProblemCode};
use crate::record::{self, Claimed};
use crate::scope::{ScopeError, ScopeHash};
use crate::store::memory::MemoryStore;
use crate::store::{ClaimRequest, FencingToken, RecordedResponse, Store, StoreError};

/// Rows (or entries) a sweep deletes per statement.
pub const SWEEP_BATCH: usize = 500;

/// The idempotency runtime an application shares with its handlers: a store, the settings, and
/// the hooks. Cheap to clone. Put it in your application state (axum: implement
/// `FromRef<AppState>`; actix: `web::Data`).
///
/// ```
/// use idempotent_runtime::Idempotency;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let idempotency = Idempotency::memory();
/// assert_eq!(idempotency.config().lease().as_secs(), 60);
/// # }
/// ```
#[derive(Clone)]
pub struct Idempotency {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    config: Config,
    audit: Arc<dyn AuditSink>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    running: Running,
    buffered: AtomicUsize,
    max_buffered: usize,
    sweeper: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(sweeper) = &self.sweeper {
            sweeper.abort();
        }
    }
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("config", &self.inner.config)
            .field("running", &self.running())
            .finish_non_exhaustive()
    }
}

/// Builds an [`Idempotency`].
#[must_use]
pub struct Builder {
    store: Arc<dyn Store>,
    config: Config,
    audit: Arc<dyn AuditSink>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    sweeper: bool,
    max_buffered: usize,
}

impl Builder {
    /// Settings (default [`Config::default`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Where replayed, in-progress and key-reused decisions are reported (default: discarded).
    pub fn audit(mut self, sink: impl AuditSink) -> Self {
        self.audit = Arc::new(sink);
        self
    }

    /// A hook that changes what the fingerprint covers.
    pub fn fingerprint_contributor(mut self, contributor: impl FingerprintContributor) -> Self {
        self.contributor = Some(Arc::new(contributor));
        self
    }

    /// Whether to run the background sweeper (default on, when built inside a Tokio runtime).
    /// Turn it off when another process sweeps the shared store.
    pub fn sweeper(mut self, on: bool) -> Self {
        self.sweeper = on;
        self
    }

    /// Bound on the bytes of request and response bodies buffered at once across all requests
    /// (default 256 MiB). Past it, new requests get 503 `IDEMPOTENCY_STORE_FULL`.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered = bytes;
        self
    }

    /// The handle.
    pub fn build(self) -> Idempotency {
        let sweeper = (self.sweeper && tokio::runtime::Handle::try_current().is_ok()).then(|| {
            crate::store::spawn_sweeper(
                Arc::downgrade(&self.store),
                self.config.retention,
                SWEEP_BATCH,
            )
        });
        Idempotency {
            inner: Arc::new(Inner {
                store: self.store,
                config: self.config,
                audit: self.audit,
                contributor: self.contributor,
                running: Running::default(),
                buffered: AtomicUsize::new(0),
                max_buffered: self.max_buffered,
                sweeper,
            }),
        }
    }
}

/// What the pipeline tells the framework integration to do after claiming. `R` is what holds
/// the key: a [`Reservation`] in detached mode, the open transaction in enlisted mode.
#[derive(Debug)]
pub enum Begin<R = Reservation> {
    /// The key is held: run the handler, then settle the reservation.
    Run(R),
    /// Replay this recorded response with `Idempotency-Replayed: true`.
    Replay(Arc<RecordedResponse>),
    /// Answer this refusal.
    Refuse(Problem),
}

/// Everything the pipeline needs to know about a keyed request.
#[derive(Debug, Clone, Copy)]
pub struct BeginRequest<'a> {
    /// The parsed key.
    pub key: &'a IdempotencyKey,
    /// Fingerprint input (includes the scope).
    pub input: FingerprintInput<'a>,
    /// Endpoint settings in force.
    pub endpoint: &'a Effective,
}

/// A request's claim, and how to recognise the same request in a stored record: what the
/// detached and enlisted paths share before they claim.
pub(crate) struct ClaimPlan<'a> {
    pub(crate) claim: ClaimRequest<'a>,
    pub(crate) route: &'a str,
    input: &'a FingerprintInput<'a>,
    contributor: Option<&'a dyn FingerprintContributor>,
}

impl<'a> ClaimPlan<'a> {
    pub(crate) fn new(
        req: &'a BeginRequest<'a>,
        contributor: Option<&'a dyn FingerprintContributor>,
    ) -> Self {
        let scope = req.input.scope;
        Self {
            claim: ClaimRequest {
                scope: scope.hash(),
                key: req.key.as_str(),
                quota_bucket: scope.quota_bucket(),
                fingerprint: fingerprint::compute(&req.input, contributor),
                token: FencingToken::mint(),
                lease: req.endpoint.lease,
                retention: req.endpoint.retention,
            },
            route: req.input.route.unwrap_or(""),
            input: &req.input,
            contributor,
        }
    }

    /// Whether a stored fingerprint is this request's, compared with the encoder of the
    /// stored fingerprint's own version (an upgrade never turns retries into 422s).
    pub(crate) fn same_request(&self, stored: &Fingerprint) -> bool {
        let fp = self.claim.fingerprint;
        if stored.version == fp.version {
            return *stored == fp;
        }
        fingerprint::compute_version(stored.version, self.input, self.contributor)
            .is_some_and(|f| f == *stored)
    }
}

/// How a framework pipeline claims a key: detached ([`Idempotency::begin`]) or enlisted
/// (in the transaction the handler then writes through). Monomorphised, so the detached path
/// pays nothing for the choice.
#[cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]
pub(crate) trait ClaimMode {
    /// What holds the key while the handler runs.
    type Held: Send + 'static;

    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin<Self::Held>> + Send + 'a;
}

/// The default mode: the reservation commits before the handler runs.
#[cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]
pub(crate) enum Detached {}

impl ClaimMode for Detached {
    type Held = Reservation;

    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin> + Send + 'a {
        handle.begin(req)
    }
}

impl Idempotency {
    /// The fingerprint hook, for the enlisted pipeline (which claims outside [`Self::begin`]).
    #[cfg_attr(
        not(all(feature = "postgres", any(feature = "axum", feature = "actix"))),
        allow(dead_code)
    )]
    pub(crate) fn contributor(&self) -> Option<&dyn FingerprintContributor> {
        self.inner.contributor.as_deref()
    }

    /// Counts a claimed handler until the guard drops, so [`Self::shutdown`] waits for it.
    #[cfg_attr(
        not(all(feature = "postgres", any(feature = "axum", feature = "actix"))),
        allow(dead_code)
    )]
    pub(crate) fn enter_running(&self) -> RunningGuard {
        self.inner.running.enter()
    }

    /// The embedded default: an in-memory store with default limits and settings.
    pub fn memory() -> Self {
        Self::new(MemoryStore::default())
    }

    /// A handle over `store` with default settings.
    pub fn new(store: impl Store) -> Self {
        Self::builder(store).build()
    }

    /// A builder over `store`.
    pub fn builder(store: impl Store) -> Builder {
        Self::builder_arc(Arc::new(store))
    }

    /// A builder over a store already behind an `Arc` (to keep a typed handle on it too).
    pub fn builder_arc(store: Arc<dyn Store>) -> Builder {
        Builder {
            store,
            config: Config::default(),
            audit: Arc::new(DiscardAudit),
            contributor: None,
            sweeper: true,
            max_buffered: 256 << 20,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Claimed handlers running now.
    pub fn running(&self) -> usize {
        self.inner.running.count.load(Ordering::Acquire)
    }

    /// Waits until every claimed handler has finished, at most `shutdown_grace`. Call it after
    /// the server stopped accepting requests. Returns `false` if handlers were still running.
    pub async fn shutdown(&self) -> bool {
        let grace = self.inner.config.shutdown_grace;
        tokio::time::timeout(grace, self.inner.running.idle())
            .await
            .is_ok()
    }

    /// The refusal for an invalid key (never echoing it).
    pub fn key_invalid(&self, error: KeyError, route: &str) -> Problem {
        observe::count(Event::KeyInvalid, route);
        tracing::debug!(route, %error, "idempotency key refused");
        Problem::new(400, ProblemCode::KeyInvalid, error.to_string())
    }

    /// The refusal for a missing key on a `require_key` endpoint.
    pub fn key_missing(&self, route: &str) -> Problem {
        observe::count(Event::KeyMissing, route);
        Problem::new(
            self.inner.config.missing_key_status.code(),
            ProblemCode::KeyRequired,
            "this endpoint requires an Idempotency-Key header",
        )
    }

    /// The refusal for a body over its cap.
    pub fn payload_too_large(&self, max_body: usize, route: &str) -> Problem {
        observe::count(Event::PayloadTooLarge, route);
        Problem::new(
            413,
            ProblemCode::PayloadTooLarge,
            format!("the request body is larger than {max_body} bytes"),
        )
    }

    /// The refusal for a body that arrived too slowly.
    pub fn body_timeout(&self, route: &str) -> Problem {
        observe::count(Event::BodyTimeout, route);
        Problem::new(
            408,
            ProblemCode::BodyTimeout,
            format!(
                "the request body did not arrive within {} s",
                self.inner.config.body_timeout.as_secs_f64()
            ),
        )
    }

    /// The refusal when no identity could be established: a setup mistake, logged with its fix.
    pub fn scope_unresolved(&self, error: ScopeError, route: &str) -> Problem {
        observe::count(Event::ScopeUnresolved, route);
        tracing::error!(route, "idempotency scope unresolved: {}", error.remedy());
        Problem::new(
            500,
            ProblemCode::ScopeUnresolved,
            "the caller's identity could not be established for this request",
        )
    }

    /// The refusal when the buffer budget is exhausted.
    pub fn buffers_full(&self, route: &str) -> Problem {
        observe::count(Event::StoreFull, route);
        Problem::new(
            503,
            ProblemCode::StoreFull,
            "too many request bodies are buffered right now",
        )
        .with_retry_after(record::ceil_secs(self.inner.config.store_retry_after).max(1))
    }

    /// Reserves `bytes` of the global buffer budget, or `None` when it is exhausted.
    pub fn buffer_permit(&self, bytes: usize) -> Option<BufferPermit> {
        let mut permit = BufferPermit {
            owner: Arc::downgrade(&self.inner),
            bytes: 0,
        };
        permit.grow(bytes).then_some(permit)
    }

    /// Claims the key and decides: run, replay, or refuse.
    pub async fn begin(&self, req: &BeginRequest<'_>) -> Begin {
        let inner = &*self.inner;
        let plan = ClaimPlan::new(req, inner.contributor.as_deref());
        let route = plan.route;
        match record::claim(&*inner.store, &plan.claim, |f| plan.same_request(f)).await {
            Ok(claimed) => self.answer(req, claimed, || Reservation {
                guard: Some(Guard {
                    store: Arc::clone(&inner.store),
                    scope: *req.input.scope.hash(),
                    key: req.key.clone(),
                    token: plan.claim.token,
                    armed: true,
                }),
                lease: req.endpoint.lease,
                retention: req.endpoint.retention,
                max_response: req.endpoint.max_response,
                route: route.into(),
                _running: inner.running.enter(),
            }),
            Err(error) => self.claim_failed(error, &plan.claim, req.key, route).await,
        }
    }

    /// Turns a claim's outcome into the answer, counting and auditing it the same way in
    /// detached and enlisted mode; `held` builds what holds an acquired key.
    pub(crate) fn answer<R>(
        &self,
        req: &BeginRequest<'_>,
        claimed: Claimed,
        held: impl FnOnce() -> R,
    ) -> Begin<R> {
        let route = req.input.route.unwrap_or("");
        let audit = |decision| {
            self.inner.audit.record(&AuditEvent {
                decision,
                scope_hash: req.input.scope.hash(),
                key_hash: observe::key_hash(req.key.as_str()),
                route,
            })
        };
        match claimed {
            Claimed::Acquired { reclaimed } => {
                if reclaimed {
                    observe::count(Event::Reclaimed, route);
                    tracing::warn!(
                        route,
                        key_hash = %KeyDisplay(req.key.as_str()),
                        "reclaimed an abandoned reservation; its handler may have run before"
                    );
                }
                observe::count(Event::Executed, route);
                Begin::Run(held())
            }
            Claimed::Replay(response) => {
                observe::count(Event::Replayed, route);
                audit(AuditDecision::Replayed);
                tracing::debug!(route, key_hash = %KeyDisplay(req.key.as_str()), "replayed");
                Begin::Replay(response)
            }
            Claimed::InProgress { lease_left } => {
                observe::count(Event::InProgress, route);
                audit(AuditDecision::InProgress);
                let retry_after = record::in_progress_retry_after(
                    self.inner.config.in_progress_retry_after,
                    lease_left,
                );
                Begin::Refuse(
                    Problem::new(
                        409,
                        ProblemCode::InProgress,
                        "a request with this Idempotency-Key is still being processed; retry later",
                    )
                    .with_retry_after(retry_after),
                )
            }
            Claimed::KeyReused => {
                observe::count(Event::KeyReused, route);
                audit(AuditDecision::KeyReused);
                Begin::Refuse(Problem::new(
                    self.inner.config.reuse_status.code(),
                    ProblemCode::KeyReused,
                    "this Idempotency-Key was already used with a different request",
                ))
            }
        }
    }

    async fn claim_failed(
        &self,
        error: StoreError,
        claim: &ClaimRequest<'_>,
        key: &IdempotencyKey,
        route: &str,
    ) -> Begin {
        let inner = &*self.inner;
        let retry_after = record::ceil_secs(inner.config.store_retry_after).max(1);
        let (code, event) = match error {
            StoreError::Full | StoreError::QuotaExceeded => {
                (ProblemCode::StoreFull, Event::StoreFull)
            }
            StoreError::Unavailable(_) => (ProblemCode::StoreUnavailable, Event::StoreError),
        };
        observe::count(event, route);
        tracing::warn!(route, key_hash = %KeyDisplay(key.as_str()), %error, "idempotency claim failed");
        if matches!(error, StoreError::Unavailable(_)) {
            // The claim may have been written before the connection dropped: free it if so, so
            // the client's retry is not blocked for a whole lease.
            let release = inner.store.release(claim.scope, claim.key, claim.token);
            let _ = tokio::time::timeout(Duration::from_secs(2), release).await;
            if inner.config.failure_mode == FailureMode::Open {
                tracing::warn!(route, "failing open: running the handler unprotected");
                observe::count(Event::Executed, route);
                return Begin::Run(Reservation {
                    guard: None,
                    lease: claim.lease,
                    retention: claim.retention,
                    max_response: 0,
                    route: route.into(),
                    _running: inner.running.enter(),
                });
            }
        }
        let detail = match code {
            ProblemCode::StoreFull => "the idempotency store has no room for this caller's request",
            _ => "the idempotency store cannot be reached; retry later",
        };
        Begin::Refuse(Problem::new(503, code, detail).with_retry_after(retry_after))
    }

    /// The response to a panicked handler: 500, key released.
    pub fn panicked(&self, route: &str) -> Problem {
        tracing::error!(route, "idempotent handler panicked; its key was released");
        Problem::new(
            500,
            ProblemCode::HandlerPanicked,
            "the request failed; it may be retried with the same Idempotency-Key",
        )
    }
}

/// A held key: run the handler through [`Reservation::run`], then [`complete`](Self::complete)
/// or [`release`](Self::release) it. Dropped unsettled (a panic, a cancelled task), it releases
/// the key in the background.
#[derive(Debug)]
pub struct Reservation {
    guard: Option<Guard>,
    lease: Duration,
    retention: Duration,
    max_response: usize,
    route: Arc<str>,
    _running: RunningGuard,
}

#[derive(Debug)]
struct Guard {
    store: Arc<dyn Store>,
    scope: ScopeHash,
    key: IdempotencyKey,
    token: FencingToken,
    armed: bool,
}

impl Guard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, scope, key, token) = (
            Arc::clone(&self.store),
            self.scope,
            self.key.clone(),
            self.token,
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.release(&scope, key.as_str(), token).await;
            });
        }
    }
}

/// How a claimed handler ended.
pub enum Outcome<T> {
    /// It returned.
    Returned(T),
    /// It panicked; the key has been released.
    Panicked,
}

impl Reservation {
    /// The recorded-response cap in force (0 when running unprotected: nothing is recorded).
    pub fn max_response(&self) -> usize {
        if self.guard.is_some() {
            self.max_response
        } else {
            0
        }
    }

    /// Whether a store backs this reservation (false when failing open).
    pub fn is_guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// Runs the claimed handler to its end while renewing the lease every third of it. A panic
    /// is caught and the key released before this returns.
    pub async fn run<F: Future>(&mut self, handler: F) -> Outcome<F::Output> {
        let Some(guard) = &self.guard else {
            return match AssertUnwindSafe(handler).catch_unwind().await {
                Ok(v) => Outcome::Returned(v),
                Err(_) => Outcome::Panicked,
            };
        };
        let handler = AssertUnwindSafe(handler).catch_unwind();
        let renew = renew_forever(guard, self.lease, &self.route);
        let result = tokio::select! {
            biased;
            result = handler => result,
            never = renew => match never {},
        };
        match result {
            Ok(v) => Outcome::Returned(v),
            Err(_) => {
                self.release_now().await;
                Outcome::Panicked
            }
        }
    }

    /// Records the response for replay. A failed or fenced write is logged and counted; the
    /// response is still sent and the reservation lapses with its lease.
    pub async fn complete(mut self, response: &RecordedResponse) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let result = guard
            .store
            .complete(
                &guard.scope,
                guard.key.as_str(),
                guard.token,
                response,
                self.retention,
            )
            .await;
        match result {
            Ok(true) => {}
            Ok(false) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::LeaseLost, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    "response not recorded: the lease was lost to another request"
                );
            }
            Err(error) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::StoreError, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    %error,
                    "response not recorded: the reservation stands until its lease lapses"
                );
            }
        }
        // Settled: the guard must not release what was just completed.
        guard.disarm();
    }

    /// Frees the key without recording (5xx, non-replayable, too large).
    pub async fn release(mut self) {
        observe::count(Event::NotRecorded, &self.route);
        self.release_now().await;
    }

    async fn release_now(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        if let Err(error) = guard
            .store
            .release(&guard.scope, guard.key.as_str(), guard.token)
            .await
        {
            tracing::warn!(
                route = %self.route,
                key_hash = %KeyDisplay(guard.key.as_str()),
                %error,
                "could not release the key; it frees itself when its lease lapses"
            );
        }
        guard.disarm();
    }
}

async fn renew_forever(guard: &Guard, lease: Duration, route: &str) -> std::convert::Infallible {
    let period = lease / 3;
    let mut last_kept = tokio::time::Instant::now();
    let mut lost = false;
    loop {
        tokio::time::sleep(period).await;
        if lost {
            continue;
        }
        match guard
            .store
            .renew(&guard.scope, guard.key.as_str(), guard.token, lease)
            .await
        {
            Ok(true) => last_kept = tokio::time::Instant::now(),
            Ok(false) => lost = true,
            Err(error) => {
                tracing::warn!(route, %error, "lease renewal failed; retrying next tick");
                lost = last_kept.elapsed() >= lease;
            }
        }
        if lost {
            observe::count(Event::LeaseLost, route);
            tracing::error!(
                route,
                key_hash = %KeyDisplay(guard.key.as_str()),
                "lease lost while the handler runs: a duplicate may run concurrently"
            );
        }
    }
}

/// Counts claimed handlers so shutdown can wait for them.
#[derive(Default)]
struct Running {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Running {
    fn enter(&self) -> RunningGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        RunningGuard {
            count: Arc::clone(&self.count),
            idle: Arc::clone(&self.idle),
        }
    }

    async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[derive(Debug)]
pub(crate) struct RunningGuard {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }
}

/// A share of the global buffer budget, returned when dropped.
#[derive(Debug)]
pub struct BufferPermit {
    owner: Weak<Inner>,
    bytes: usize,
}

impl BufferPermit {
    /// Takes `more` bytes of the budget; `false` (and nothing taken) when it is exhausted.
    pub fn grow(&mut self, more: usize) -> bool {
        let Some(inner) = self.owner.upgrade() else {
            return true;
        };
        let before = inner.buffered.fetch_add(more, Ordering::AcqRel);
        if before.saturating_add(more) > inner.max_buffered {
            inner.buffered.fetch_sub(more, Ordering::AcqRel);
            return false;
        }
        self.bytes += more;
        true
    }
}

impl Drop for BufferPermit {
    fn drop(&mut self) {
        if let Some(inner) = self.owner.upgrade() {
            inner.buffered.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointConfig;
    use crate::scope::{Identity, Scope};

    fn input<'a>(scope: &'a Scope, body: &'a [u8]) -> FingerprintInput<'a> {
        FingerprintInput {
            method: "POST",
            route: Some("/orders"),
            path_params: &[],
            query: None,
            scope,
            content_type: None,
            body,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_waits_for_claimed_handlers_up_to_the_grace() {
        let handle = Idempotency::builder(MemoryStore::default())
            .config(
                Config::builder()
                    .shutdown_grace(Duration::from_secs(5))
                    .build(),
            )
            .build();
        let scope = Scope::from_identity(&Identity::subject("t", "u"), None).unwrap();
        let key = IdempotencyKey::new("k").unwrap();
        let endpoint = EndpointConfig::REQUIRED.resolve(handle.config());
        let req = BeginRequest {
            key: &key,
            input: input(&scope, b"{}"),
            endpoint: &endpoint,
        };
        let Begin::Run(reservation) = handle.begin(&req).await else {
            panic!("a new key runs");
        };
        assert_eq!(handle.running(), 1);
        assert!(
            !handle.shutdown().await,
            "returned while a handler was running"
        );

        let finisher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            reservation.release().await;
        });
        assert!(handle.shutdown().await, "did not see the handler finish");
        assert_eq!(handle.running(), 0);
        finisher.await.unwrap();
    }

    #[tokio::test]
    async fn the_buffer_budget_is_returned_when_permits_drop() {
        let handle = Idempotency::builder(MemoryStore::default())
            .max_buffered_bytes(100)
            .build();
        let mut a = handle.buffer_permit(60).expect("within the budget");
        assert!(handle.buffer_permit(60).is_none(), "over the budget");
        assert!(!a.grow(41), "growing past the budget");
        assert!(a.grow(40));
        drop(a);
        assert!(handle.buffer_permit(100).is_some(), "the budget came back");
    }
}
