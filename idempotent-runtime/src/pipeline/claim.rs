//! The claim step: the request's claim and fingerprint ([`ClaimPlan`]), the claim in the store
//! (detached) or in the handler's transaction (enlisted, through [`ClaimMode`]), and one mapping
//! of its outcome to run, replay or refuse, counted and audited the same way in both modes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Effective, FailureMode};
use crate::fingerprint::{self, BodySubset, Fingerprint, FingerprintContributor, FingerprintInput};
use crate::handle::Idempotency;
use crate::key::IdempotencyKey;
use crate::observe::{self, AuditDecision, AuditEvent, Event, KeyDisplay};
use crate::problem::{Problem, ProblemCode};
use crate::record::{self, Verdict};
use crate::reservation::{ReleaseOnDrop, Reservation};
use crate::store::{ClaimRequest, FencingToken, RecordedResponse, StoreError};

/// What the pipeline tells the framework integration to do after claiming. `R` is what holds
/// the key: a reservation in detached mode, the open transaction in enlisted mode.
#[derive(Debug)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
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
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
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
    subset: Option<&'a BodySubset>,
    contributor: Option<&'a dyn FingerprintContributor>,
}

impl<'a> ClaimPlan<'a> {
    /// The plan, or the refusal of a body the endpoint's fingerprint cannot read (a subset
    /// fingerprint over a body that is not JSON), before anything is claimed.
    pub(crate) fn new(
        req: &'a BeginRequest<'a>,
        contributor: Option<&'a dyn FingerprintContributor>,
    ) -> Result<Self, Problem> {
        let scope = req.input.scope;
        let route = req.input.route.unwrap_or("");
        let subset = req.endpoint.fingerprint.as_ref();
        let fingerprint = match subset {
            None => fingerprint::compute(&req.input, contributor),
            Some(subset) => fingerprint::compute_subset(&req.input, subset, contributor)
                .map_err(|error| super::refusals::subset_invalid(&error, route))?,
        };
        Ok(Self {
            claim: ClaimRequest {
                scope: scope.hash(),
                key: req.key.as_str(),
                quota_bucket: scope.quota_bucket(),
                fingerprint,
                token: FencingToken::mint(),
                lease: req.endpoint.lease,
                retention: req.endpoint.retention,
                route: req.input.route.unwrap_or(""),
                response_room: req.endpoint.max_response,
            },
            route,
            input: &req.input,
            subset,
            contributor,
        })
    }

    /// Whether a stored fingerprint is this request's, compared with the encoder of the
    /// stored fingerprint's own version (an upgrade never turns retries into 422s).
    pub(crate) fn same_request(&self, stored: &Fingerprint) -> bool {
        let fp = self.claim.fingerprint;
        if stored.version == fp.version {
            return *stored == fp;
        }
        fingerprint::compute_version_subset(
            stored.version,
            self.input,
            self.subset,
            self.contributor,
        )
        .is_some_and(|f| f.is_ok_and(|f| f == *stored))
    }
}

/// How the pipeline claims a key: detached ([`begin`]) or enlisted (in the
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

    /// The route as the held key already shares it, if it does (one allocation of it a
    /// request, not two).
    fn shared_route(held: &Self::Held) -> Option<Arc<str>> {
        let _ = held;
        None
    }

    /// The claim decided before this returns, where nothing in it can suspend; `None` to
    /// [`begin`](Self::begin) it instead.
    fn begin_at_once(handle: &Idempotency, req: &BeginRequest<'_>) -> Option<Begin<Self::Held>> {
        let _ = (handle, req);
        None
    }

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

    /// Boxed: a claim over the network is hundreds of bytes of nested state, which the
    /// request's future would otherwise carry and move from step to step.
    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin> + Send + 'a {
        Box::pin(begin(handle, req))
    }

    fn shared_route(held: &Reservation) -> Option<Arc<str>> {
        Some(held.shared_route())
    }

    /// On the memory store, unless the request may wait for a duplicate to settle: nothing
    /// in its claim suspends.
    fn begin_at_once(handle: &Idempotency, req: &BeginRequest<'_>) -> Option<Begin> {
        let at_once = handle.store().answers_at_once() && req.endpoint.wait_in_progress.is_zero();
        at_once.then(|| crate::store::at_once(std::pin::pin!(begin(handle, req))))
    }

    /// Never asked (requests without a key pass untouched); nothing to hold if it were.
    async fn unkeyed(handle: &Idempotency, route: &str) -> Result<Reservation, Problem> {
        Ok(Reservation::unguarded(route, handle.enter_running()))
    }
}

/// Claims the key in the handle's store and decides: run, replay, or refuse (the detached
/// mode's claim).
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub async fn begin(handle: &Idempotency, req: &BeginRequest<'_>) -> Begin {
    let plan = match ClaimPlan::new(req, handle.contributor()) {
        Ok(plan) => plan,
        Err(problem) => return Begin::Refuse(problem),
    };
    let route = plan.route;
    let store = handle.store();
    let same_request = |f: &Fingerprint| plan.same_request(f);
    let wait = req.endpoint.wait_in_progress;
    let claimed = claim_waiting(handle, &plan.claim, req.key, same_request, wait).await;
    match claimed {
        Ok(claimed) => answer(handle, req, claimed, || {
            Reservation::held(
                store.clone(),
                *req.input.scope.hash(),
                req.key.clone(),
                plan.claim.token,
                req.endpoint.lease,
                req.endpoint.retention,
                req.endpoint.max_response,
                route,
                handle.enter_running(),
            )
            .with_recording(req.endpoint.recording.clone())
        }),
        Err(error) => {
            let mode = req.endpoint.failure_mode;
            // Boxed, as the waits below: a failed claim is rare, and every request's claim
            // future (moved whole from step to step) would otherwise carry its bytes.
            Box::pin(claim_failed(
                handle,
                error,
                &plan.claim,
                req.key,
                route,
                mode,
            ))
            .await
        }
    }
}

/// The claim, tried again while the key is in progress and `wait` lasts (an endpoint's
/// `wait_in_progress`, or a plain function's wait): woken when a request of this process
/// settles, else at growing intervals. Between two tries nothing is held (no connection, no
/// lock); the caller counts and audits only the last outcome.
///
/// A waiting request keeps its body's charge on the buffer budget: its bytes stay in memory
/// (the handler runs on them if the first request is released), and the budget bounds the
/// bytes held at once, not the bytes of running requests. Releasing the charge while waiting
/// would let a duplicate storm hold `max_body` each uncounted; keeping it means the storm is
/// refused 503 at the body step, before anything is claimed, once the budget is spent. The
/// wait is bounded by `wait_in_progress` (an opt-in).
pub(crate) async fn claim_waiting(
    handle: &Idempotency,
    claim: &ClaimRequest<'_>,
    key: &IdempotencyKey,
    same_request: impl Fn(&Fingerprint) -> bool,
    wait: Duration,
) -> Result<Verdict, StoreError> {
    const FIRST_POLL: Duration = Duration::from_millis(10);
    const LAST_POLL: Duration = Duration::from_millis(250);
    let store = handle.store();
    let deadline = (!wait.is_zero()).then(|| tokio::time::Instant::now() + wait);
    let mut poll = FIRST_POLL;
    loop {
        // Released if this future is dropped while the store call is out.
        let in_flight = ReleaseOnDrop::new(store.clone(), *claim.scope, key.clone(), claim.token);
        let claimed = record::claim(store, claim, &same_request).await;
        in_flight.disarm();
        // The clock is read only by a request that may wait: most claims do not.
        let waiting = match (&claimed, deadline) {
            (Ok(Verdict::InProgress { .. }), Some(deadline)) => {
                let now = tokio::time::Instant::now();
                (now < deadline).then(|| deadline.min(now + poll))
            }
            _ => None,
        };
        match waiting {
            Some(until) => {
                Box::pin(handle.settled_or(until)).await;
                poll = (poll * 2).min(LAST_POLL);
            }
            None => return claimed,
        }
    }
}

/// Turns a claim's outcome into the answer, counting and auditing it the same way in
/// detached and enlisted mode; `held` builds what holds an acquired key.
pub(crate) fn answer<R>(
    handle: &Idempotency,
    req: &BeginRequest<'_>,
    claimed: Verdict,
    held: impl FnOnce() -> R,
) -> Begin<R> {
    let route = req.input.route.unwrap_or("");
    let audit = |decision| {
        if let Some(sink) = handle.audit() {
            sink.record(&AuditEvent {
                decision,
                scope_hash: req.input.scope.hash(),
                key_hash: observe::key_hash(req.key.as_str()),
                route,
            });
        }
    };
    match claimed {
        Verdict::Acquired { reclaimed } => {
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
        Verdict::Replay(response) => {
            observe::decided("replayed");
            observe::count(Event::Replayed, route);
            audit(AuditDecision::Replayed);
            tracing::debug!(route, key_hash = %KeyDisplay(req.key.as_str()), "replayed");
            Begin::Replay(response)
        }
        Verdict::InProgress { lease_left } => {
            observe::decided("in_progress");
            observe::count(Event::InProgress, route);
            audit(AuditDecision::InProgress);
            let retry_after = record::in_progress_retry_after(
                handle.config().in_progress_retry_after(),
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
        Verdict::KeyReused => {
            observe::decided("key_reused");
            observe::count(Event::KeyReused, route);
            audit(AuditDecision::KeyReused);
            Begin::Refuse(Problem::new(
                req.endpoint.reuse_status.code(),
                ProblemCode::KeyReused,
                "this idempotency key was already used with a different request",
            ))
        }
    }
}

async fn claim_failed(
    handle: &Idempotency,
    error: StoreError,
    claim: &ClaimRequest<'_>,
    key: &IdempotencyKey,
    route: &str,
    failure_mode: FailureMode,
) -> Begin {
    let config = handle.config();
    let retry_after = record::ceil_secs(config.store_retry_after()).max(1);
    let (code, event) = match error {
        StoreError::Full | StoreError::QuotaExceeded => (ProblemCode::StoreFull, Event::StoreFull),
        // A claim is required of every store; a wrapper that reports it unsupported is a
        // store that cannot serve, which the client sees as unavailable.
        StoreError::Unavailable(_)
        | StoreError::Unsupported { .. }
        | StoreError::NotReplicated { .. } => (ProblemCode::StoreUnavailable, Event::StoreError),
    };
    observe::count(event, route);
    observe::decided(event.name());
    tracing::warn!(route, key_hash = %KeyDisplay(key.as_str()), %error, "idempotency claim failed");
    if matches!(error, StoreError::Unavailable(_)) {
        // The claim may have been written before the connection dropped: free it if so, so
        // the client's retry is not blocked for a whole lease.
        let release = handle.store().release(claim.scope, claim.key, claim.token);
        let _ = tokio::time::timeout(Duration::from_secs(2), release).await;
        if failure_mode == FailureMode::Open {
            tracing::warn!(route, "failing open: running the handler unprotected");
            observe::decided("executed_unprotected");
            observe::count(Event::Executed, route);
            return Begin::Run(Reservation::unguarded(route, handle.enter_running()));
        }
    }
    let detail = match code {
        ProblemCode::StoreFull => "the idempotency store has no room for this caller's request",
        _ => "the idempotency store cannot be reached; retry later",
    };
    Begin::Refuse(Problem::new(503, code, detail).with_retry_after(retry_after))
}
