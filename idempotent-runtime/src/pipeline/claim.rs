//! The claim step: the request's claim and fingerprint ([`ClaimPlan`]), the claim in the store
//! (detached) or in the handler's transaction (enlisted, through [`ClaimMode`]), and one mapping
//! of its outcome to run, replay or refuse, counted and audited the same way in both modes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Effective, FailureMode};
use crate::fingerprint::{self, Fingerprint, FingerprintContributor, FingerprintInput};
use crate::handle::Idempotency;
use crate::key::IdempotencyKey;
use crate::observe::{self, AuditDecision, AuditEvent, Event, KeyDisplay};
use crate::problem::{Problem, ProblemCode};
use crate::record::{self, Claimed};
use crate::reservation::Reservation;
use crate::store::{ClaimRequest, FencingToken, RecordedResponse, StoreError};

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
                route: req.input.route.unwrap_or(""),
                response_room: req.endpoint.max_response,
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

/// How the pipeline claims a key: detached ([`Idempotency::begin`]) or enlisted (in the
/// transaction the handler then writes through). Monomorphised, so the detached path pays
/// nothing for the choice.
pub(crate) trait ClaimMode {
    /// What holds the key while the handler runs.
    type Held: Send + 'static;

    /// Whether a request without a key (on an optional endpoint) is read in full too, and
    /// held by [`unkeyed`](Self::unkeyed), instead of passing untouched.
    const BUFFERS_UNKEYED: bool;

    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin<Self::Held>> + Send + 'a;

    /// What holds a request without a key, when [`BUFFERS_UNKEYED`](Self::BUFFERS_UNKEYED).
    fn unkeyed<'a>(
        handle: &'a Idempotency,
        route: &'a str,
    ) -> impl Future<Output = Result<Self::Held, Problem>> + Send + 'a;
}

/// The default mode: the reservation commits before the handler runs.
pub(crate) enum Detached {}

impl ClaimMode for Detached {
    type Held = Reservation;

    const BUFFERS_UNKEYED: bool = false;

    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin> + Send + 'a {
        handle.begin(req)
    }

    /// Never asked (requests without a key pass untouched); nothing to hold if it were.
    async fn unkeyed(handle: &Idempotency, route: &str) -> Result<Reservation, Problem> {
        Ok(Reservation::unguarded(route, handle.enter_running()))
    }
}

/// A claim whose store call is in flight. Dropped armed (the request's future was dropped
/// mid-call: the client went away, the server is shutting down), it releases whatever the call
/// may have written under the request's own token, so the key does not stand at 409 for a
/// whole lease. The token is fresh, so the release can free nothing but this claim's.
struct InFlight<'a> {
    store: &'a Arc<dyn crate::store::erased::DynStore>,
    claim: &'a ClaimRequest<'a>,
    armed: bool,
}

impl InFlight<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, scope, key, token) = (
            Arc::clone(self.store),
            *self.claim.scope,
            self.claim.key.to_owned(),
            self.claim.token,
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.release(&scope, &key, token).await;
            });
        }
    }
}

impl Idempotency {
    /// Claims the key and decides: run, replay, or refuse.
    pub async fn begin(&self, req: &BeginRequest<'_>) -> Begin {
        let plan = ClaimPlan::new(req, self.contributor());
        let route = plan.route;
        let store = self.store();
        let in_flight = InFlight {
            store,
            claim: &plan.claim,
            armed: true,
        };
        let claimed = record::claim(&**store, &plan.claim, |f| plan.same_request(f)).await;
        in_flight.disarm();
        match claimed {
            Ok(claimed) => self.answer(req, claimed, || {
                Reservation::held(
                    Arc::clone(store),
                    *req.input.scope.hash(),
                    req.key.clone(),
                    plan.claim.token,
                    req.endpoint.lease,
                    req.endpoint.retention,
                    req.endpoint.max_response,
                    route,
                    self.enter_running(),
                )
                .with_recording(req.endpoint.recording.clone())
            }),
            Err(error) => {
                let mode = req.endpoint.failure_mode;
                self.claim_failed(error, &plan.claim, req.key, route, mode)
                    .await
            }
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
            if let Some(sink) = self.audit() {
                sink.record(&AuditEvent {
                    decision,
                    scope_hash: req.input.scope.hash(),
                    key_hash: observe::key_hash(req.key.as_str()),
                    route,
                });
            }
        };
        match claimed {
            Claimed::Acquired { reclaimed } => {
                if reclaimed {
                    observe::decided("reclaimed");
                    audit(AuditDecision::Reclaimed);
                    observe::count(Event::Reclaimed, route);
                    tracing::warn!(
                        route,
                        key_hash = %KeyDisplay(req.key.as_str()),
                        "reclaimed an abandoned reservation; its handler may have run before"
                    );
                }
                if !reclaimed {
                    observe::decided("executed");
                    audit(AuditDecision::Executed);
                }
                observe::count(Event::Executed, route);
                Begin::Run(held())
            }
            Claimed::Replay(response) => {
                observe::decided("replayed");
                observe::count(Event::Replayed, route);
                audit(AuditDecision::Replayed);
                tracing::debug!(route, key_hash = %KeyDisplay(req.key.as_str()), "replayed");
                Begin::Replay(response)
            }
            Claimed::InProgress { lease_left } => {
                observe::decided("in_progress");
                observe::count(Event::InProgress, route);
                audit(AuditDecision::InProgress);
                let retry_after = record::in_progress_retry_after(
                    self.config().in_progress_retry_after(),
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
                observe::decided("key_reused");
                observe::count(Event::KeyReused, route);
                audit(AuditDecision::KeyReused);
                Begin::Refuse(Problem::new(
                    req.endpoint.reuse_status.code(),
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
        failure_mode: FailureMode,
    ) -> Begin {
        let config = self.config();
        let retry_after = record::ceil_secs(config.store_retry_after()).max(1);
        let (code, event) = match error {
            StoreError::Full | StoreError::QuotaExceeded => {
                (ProblemCode::StoreFull, Event::StoreFull)
            }
            // A claim is required of every store; a wrapper that reports it unsupported is a
            // store that cannot serve, which the client sees as unavailable.
            StoreError::Unavailable(_) | StoreError::Unsupported { .. } => {
                (ProblemCode::StoreUnavailable, Event::StoreError)
            }
        };
        observe::count(event, route);
        observe::decided(event.name());
        tracing::warn!(route, key_hash = %KeyDisplay(key.as_str()), %error, "idempotency claim failed");
        if matches!(error, StoreError::Unavailable(_)) {
            // The claim may have been written before the connection dropped: free it if so, so
            // the client's retry is not blocked for a whole lease.
            let release = self.store().release(claim.scope, claim.key, claim.token);
            let _ = tokio::time::timeout(Duration::from_secs(2), release).await;
            if failure_mode == FailureMode::Open {
                tracing::warn!(route, "failing open: running the handler unprotected");
                observe::decided("executed_unprotected");
                observe::count(Event::Executed, route);
                return Begin::Run(Reservation::unguarded(route, self.enter_running()));
            }
        }
        let detail = match code {
            ProblemCode::StoreFull => "the idempotency store has no room for this caller's request",
            _ => "the idempotency store cannot be reached; retry later",
        };
        Begin::Refuse(Problem::new(503, code, detail).with_retry_after(retry_after))
    }
}
