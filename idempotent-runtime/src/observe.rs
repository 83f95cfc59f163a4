//! Observability ([the contract](crate::design) §7): one `tracing` span per handled request
//! (`idempotency`, with the route, the decision and the scope hash's prefix) and events for each
//! decision; `metrics` counters, store latency histograms and gauges (feature `metrics`); and an
//! audit sink. Keys are never logged; their hash may be.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idempotent_<decision>_total` (the decisions of the contract §7) | counter | `route` |
//! | `idempotent_store_operation_seconds` | histogram | `op` (claim, reclaim, complete, release, renew, sweep, inspect, forget), `store` (`cache` for claims the process cache answered) |
//! | `idempotent_running_reservations` | gauge | |
//! | `idempotent_buffered_bytes` | gauge | |
//! | `idempotent_memory_store_records`, `idempotent_memory_store_bytes` | gauge | |
//!
//! Gauges are set by [`Idempotency::report_gauges`](crate::Idempotency::report_gauges): call it
//! before each scrape (or on a timer).

use std::fmt;
use std::future::Future;

use sha2::{Digest, Sha256};

pub(crate) use crate::digest::ShortHash;
use crate::scope::ScopeHash;

/// Each decision the runtime counts. The `metrics` counter is `idempotent_<name>_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum Event {
    /// A claimed handler ran.
    Executed,
    /// A recorded response was replayed.
    Replayed,
    /// A duplicate arrived while the first was running (409).
    InProgress,
    /// A key was reused with a different request (422/409).
    KeyReused,
    /// A required key was missing.
    KeyMissing,
    /// A key was malformed.
    KeyInvalid,
    /// A request body exceeded its cap.
    PayloadTooLarge,
    /// A request body arrived too slowly.
    BodyTimeout,
    /// No identity could be established.
    ScopeUnresolved,
    /// The store failed.
    StoreError,
    /// The store, or a scope's share of it, was full.
    StoreFull,
    /// A response was sent but not recorded (5xx, non-replayable, too large, completion failed).
    NotRecorded,
    /// An abandoned reservation was taken over: its handler may run a second time.
    Reclaimed,
    /// A running handler's lease could not be kept: a duplicate may run concurrently.
    LeaseLost,
    /// A claimed handler panicked (or its task failed); its key was released.
    HandlerPanicked,
    /// A setup that would silently weaken protection was detected (logged with its fix).
    Misconfigured,
}

impl Event {
    /// The counter's short name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::InProgress => "in_progress",
            Self::KeyReused => "key_reused",
            Self::KeyMissing => "key_missing",
            Self::KeyInvalid => "key_invalid",
            Self::PayloadTooLarge => "payload_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::ScopeUnresolved => "scope_unresolved",
            Self::StoreError => "store_error",
            Self::StoreFull => "store_full",
            Self::NotRecorded => "not_recorded",
            Self::Reclaimed => "reclaimed",
            Self::LeaseLost => "lease_lost",
            Self::HandlerPanicked => "handler_panicked",
            Self::Misconfigured => "misconfigured",
        }
    }

    #[cfg(feature = "metrics")]
    fn counter(self) -> &'static str {
        match self {
            Self::Executed => "idempotent_executed_total",
            Self::Replayed => "idempotent_replayed_total",
            Self::InProgress => "idempotent_in_progress_total",
            Self::KeyReused => "idempotent_key_reused_total",
            Self::KeyMissing => "idempotent_key_missing_total",
            Self::KeyInvalid => "idempotent_key_invalid_total",
            Self::PayloadTooLarge => "idempotent_payload_too_large_total",
            Self::BodyTimeout => "idempotent_body_timeout_total",
            Self::ScopeUnresolved => "idempotent_scope_unresolved_total",
            Self::StoreError => "idempotent_store_error_total",
            Self::StoreFull => "idempotent_store_full_total",
            Self::NotRecorded => "idempotent_not_recorded_total",
            Self::Reclaimed => "idempotent_reclaimed_total",
            Self::LeaseLost => "idempotent_lease_lost_total",
            Self::HandlerPanicked => "idempotent_handler_panicked_total",
            Self::Misconfigured => "idempotent_misconfigured_total",
        }
    }
}

/// Counts one event (a `metrics` counter with the route as label, when the feature is on).
#[inline]
pub(crate) fn count(event: Event, route: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(event.counter(), "route" => route.to_owned()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (event, route);
}

/// The histogram of store operation latency, in seconds, labelled `op` and `store`.
pub const STORE_LATENCY: &str = "idempotent_store_operation_seconds";

/// One store operation, timed into [`STORE_LATENCY`] when the `metrics` feature is on (from
/// now, when it is made, to its end: it is awaited where it is made). Not an `async fn`: that
/// would keep `operation` twice in its state (the argument and the awaited future), and the
/// futures of every request's claim, completion and renewal would carry and move both copies.
#[inline]
pub(crate) fn timed<F: Future>(
    op: &'static str,
    store: &'static str,
    operation: F,
) -> impl Future<Output = F::Output> {
    #[cfg(feature = "metrics")]
    {
        use futures_util::FutureExt as _;
        let start = std::time::Instant::now();
        operation.map(move |out| {
            metrics::histogram!(STORE_LATENCY, "op" => op, "store" => store)
                .record(start.elapsed().as_secs_f64());
            out
        })
    }
    #[cfg(not(feature = "metrics"))]
    {
        let _ = (op, store);
        operation
    }
}

/// Records one store operation that started at `started` and just ended, as [`timed`] does.
#[inline]
pub(crate) fn took(op: &'static str, store: &'static str, started: Started) {
    #[cfg(feature = "metrics")]
    metrics::histogram!(STORE_LATENCY, "op" => op, "store" => store)
        .record(started.0.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (op, store, started);
}

/// When a store operation timed by [`took`] started (nothing without the `metrics` feature).
#[derive(Clone, Copy)]
pub(crate) struct Started(#[cfg(feature = "metrics")] std::time::Instant);

impl Started {
    #[inline]
    pub(crate) fn now() -> Self {
        Self(
            #[cfg(feature = "metrics")]
            std::time::Instant::now(),
        )
    }
}

/// The span every handled request runs in: `idempotency` at INFO level, with `route`, and
/// `decision` and `scope` (the scope hash's first 8 hex digits) recorded once known. The key
/// itself is never a field.
#[cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]
pub(crate) fn request_span(route: &str) -> tracing::Span {
    // A disabled span still costs: with tracing's `log` feature (which axum's defaults turn on)
    // its fields go to `log` whenever no subscriber was ever set. Skipped only where neither a
    // subscriber nor a logger would read it.
    let logged = !tracing::dispatcher::has_been_set() && log::max_level() >= log::Level::Info;
    if !spans_recorded() && !logged {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "idempotency",
        route,
        decision = tracing::field::Empty,
        scope = tracing::field::Empty
    )
}

/// Whether a [`request_span`] can be enabled at all: no subscriber listens at its level, so
/// there is no current span to look up (a thread-local read and a dispatch each) or to record
/// on. `LevelFilter::current()` is the most verbose level of every dispatcher, global or scoped.
fn spans_recorded() -> bool {
    tracing::level_enabled!(tracing::Level::INFO)
}

/// Records the request's decision on the current [`request_span`] (a no-op outside one).
pub(crate) fn decided(decision: &'static str) {
    if spans_recorded() {
        tracing::Span::current().record("decision", decision);
    }
}

/// Records the scope hash's prefix on the current [`request_span`].
pub(crate) fn scoped(scope: &ScopeHash) {
    if !spans_recorded() {
        return;
    }
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("scope", tracing::field::display(ShortHash(scope)));
    }
}

/// A decision reported to the [`AuditSink`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuditDecision {
    /// A claimed handler runs (the key was free, or expired).
    Executed,
    /// A claimed handler runs after taking over an abandoned reservation: it may have run
    /// before.
    Reclaimed,
    /// A recorded response was replayed.
    Replayed,
    /// A duplicate was refused while the first ran.
    InProgress,
    /// A key was reused with a different request.
    KeyReused,
}

/// What the audit sink receives: hashes, the route and the decision; never the key or a body.
#[derive(Debug, Clone, Copy)]
pub struct AuditEvent<'a> {
    /// The decision.
    pub decision: AuditDecision,
    /// The caller's scope hash.
    pub scope_hash: &'a ScopeHash,
    /// SHA-256 of the key.
    pub key_hash: [u8; 32],
    /// The matched route pattern.
    pub route: &'a str,
}

/// Receives every decision on a keyed request: executions (and reclaims), replays, in-progress
/// and key-reused refusals, e.g. to keep an audit trail. Called inline on the request path:
/// keep it cheap, hand off I/O.
pub trait AuditSink: Send + Sync + 'static {
    /// Records one decision.
    fn record(&self, event: &AuditEvent<'_>);
}

impl AuditDecision {
    /// `"executed"`, `"reclaimed"`, `"replayed"`, `"in_progress"` or `"key_reused"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Reclaimed => "reclaimed",
            Self::Replayed => "replayed",
            Self::InProgress => "in_progress",
            Self::KeyReused => "key_reused",
        }
    }
}

/// SHA-256 of a key, the only form in which a key leaves the runtime.
pub(crate) fn key_hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A key's short hash for log lines, computed only if the line is actually written.
pub(crate) struct KeyDisplay<'a>(pub &'a str);

impl fmt::Display for KeyDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        ShortHash(&key_hash(self.0)).fmt(f)
    }
}
