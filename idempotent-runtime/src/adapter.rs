//! The adapter API: what a framework integration implements and the one sequence it calls, so a
//! tonic, poem, salvo or hyper adapter can be written outside this crate as `axum` and `actix`
//! are inside it.
//!
//! An adapter only translates. It implements [`Head`] over its framework's request head,
//! [`Chunks`] over its request and response bodies and [`Reply`] over its response, then:
//!
//! 1. [`prepare`] runs the steps before the handler ([the contract](crate::design) §2): the
//!    method pass-through (and the misuse watch for a keyed unsafe method the endpoint does not
//!    list), key syntax and presence, the body bounded by `max_body`, `body_timeout` and the
//!    buffer budget, the caller's scope, the fingerprint and the claim. It answers
//!    [`Prepared::Pass`] (run the handler on the body as it came, no context),
//!    [`Prepared::Answer`] (a replay or a refusal: send it, run nothing) or
//!    [`Prepared::Claimed`] (the key is held; the buffered body is [`Claimed::body`]).
//! 2. [`Claimed::run`] runs the handler's future under the claim: the lease renewed while it
//!    runs, where no client disconnect can cancel it (`spawn` puts unfinished work in a task of
//!    the adapter's runtime), then settles: a recordable response is recorded, anything else
//!    releases the key. [`Claimed::settle`] settles an answer the adapter made itself without
//!    running the handler (an extractor's rejection).
//!
//! A framework whose extractors run after the body is read and before the claim (actix) calls
//! [`front`] and then [`Buffered::claim`] instead of [`prepare`]; the two are the same
//! sequence cut in two.
//!
//! A complete adapter over plain types, which replays, answers 409 for a duplicate in progress
//! and 422 for a reused key, is `idempotent-runtime/tests/adapter.rs`.

use std::future::Future;

use bytes::Bytes;
use tracing::Instrument as _;

use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::handle::Idempotency;
use crate::pipeline::{self, Detached};
use crate::problem::Problem;
use crate::reservation::Reservation;
use crate::scope::Scope;

pub use crate::pipeline::{Chunks, Ended, Head, REPLAYED_HEADER, Reply, Served};

/// The caller's scope exactly as [`prepare`] resolves it for a keyed request ([the
/// contract](crate::design) §4), for an operators' route (`inspect`, `forget`): `Err` is the
/// refusal the sequence would answer (render it with [`refusal`]).
pub async fn caller_scope<H: Head>(handle: &Idempotency, head: &H) -> Result<Scope, Problem> {
    pipeline::scope_of(handle, head).await
}

/// A refusal as the adapter's response, rendered by the handle's
/// [renderer](crate::handle::Builder::refusal_renderer).
pub fn refusal<R: Reply>(handle: &Idempotency, problem: &Problem) -> R {
    pipeline::refuse(handle, problem)
}

/// A request after the steps before the handler.
// Moved once, from `prepare` to its caller: boxing the large variant would cost every claimed
// request an allocation to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
pub enum Prepared<B, R> {
    /// Not for the sequence (a method the endpoint does not apply to, no key on an optional
    /// endpoint): run the handler on the body as it came, without a context.
    Pass(B),
    /// Send this instead of running the handler: a replay or a refusal.
    Answer(R),
    /// The key is held: run the handler on [`Claimed::body`] through [`Claimed::run`].
    Claimed(Claimed),
}

impl<B, R> std::fmt::Debug for Prepared<B, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pass(_) => "Pass",
            Self::Answer(_) => "Answer",
            Self::Claimed(_) => "Claimed",
        })
    }
}

/// A request whose body was read in full, ready to be claimed ([`front`]'s answer).
pub struct Buffered {
    handle: Idempotency,
    inner: pipeline::Buffered,
    span: tracing::Span,
}

impl std::fmt::Debug for Buffered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffered")
            .field("body", &self.inner.body.len())
            .finish_non_exhaustive()
    }
}

/// What [`front`] decided.
#[allow(clippy::large_enum_variant)]
pub enum Front<B, R> {
    /// As [`Prepared::Pass`].
    Pass(B),
    /// As [`Prepared::Answer`].
    Answer(R),
    /// The body is in memory; claim with [`Buffered::claim`].
    Buffered(Buffered),
}

/// A request that holds its key: run the handler, then settle.
pub struct Claimed {
    handle: Idempotency,
    inner: pipeline::Admitted<Reservation>,
}

impl std::fmt::Debug for Claimed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed")
            .field("route", &self.inner.route)
            .finish_non_exhaustive()
    }
}

/// The first half of [`prepare`]: method, key and body. The request's span (named after its
/// route) covers this and the claim.
pub async fn front<H: Head, B: Chunks, R: Reply>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &H,
    body: B,
) -> Front<B, R> {
    let span = crate::observe::request_span(head.route().unwrap_or(""));
    let front = pipeline::front::<Detached, _, _>(handle, endpoint, head, body);
    match front.instrument(span.clone()).await {
        pipeline::Front::Pass(body) => Front::Pass(body),
        pipeline::Front::Refuse(problem) => Front::Answer(pipeline::refuse(handle, &problem)),
        pipeline::Front::Buffered(inner) => Front::Buffered(Buffered {
            handle: handle.clone(),
            inner,
            span,
        }),
    }
}

impl Buffered {
    /// The request body, read in full: what the handler (and its extractors) read instead.
    pub fn body(&self) -> &Bytes {
        &self.inner.body
    }

    /// Whether a response with this status would be recorded on this endpoint: an extractor's
    /// rejection that would not (401, 403, 5xx) is answered without claiming the key.
    pub fn records(&self, status: u16) -> bool {
        let config = self.handle.config();
        self.inner.recording().is_recordable_status(config, status)
    }

    /// The second half of [`prepare`]: scope, fingerprint, claim. `Err` is the answer instead
    /// of running: a replay or a refusal.
    pub async fn claim<H: Head, R: Reply>(self, head: &H) -> Result<Claimed, R> {
        let Self {
            handle,
            inner,
            span,
        } = self;
        let claimed = pipeline::claim::<Detached, _, R>(&handle, head, inner);
        let inner = claimed.instrument(span).await?;
        Ok(Claimed { handle, inner })
    }
}

/// The steps before the handler, in order, for one request: [`front`], then
/// [`Buffered::claim`].
pub async fn prepare<H: Head, B: Chunks, R: Reply>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &H,
    body: B,
) -> Prepared<B, R> {
    match front(handle, endpoint, head, body).await {
        Front::Pass(body) => Prepared::Pass(body),
        Front::Answer(answer) => Prepared::Answer(answer),
        Front::Buffered(buffered) => match buffered.claim(head).await {
            Ok(claimed) => Prepared::Claimed(claimed),
            Err(answer) => Prepared::Answer(answer),
        },
    }
}

impl Claimed {
    /// The request body, read in full: the handler reads this instead of the original.
    pub fn body(&self) -> &Bytes {
        &self.inner.body
    }

    /// What the handler may read of the claim: the key's derived values and scope.
    pub fn context(&self) -> Option<&IdempotencyContext> {
        self.inner.context.as_ref()
    }

    /// Runs `handler` under the claim to its end where no client disconnect can cancel it
    /// (work that is not done at its first poll goes on in a Tokio task of its own), then
    /// records its response or releases the key. `served` says whether the handler itself
    /// answers, or a router that may refuse requests no handler serves. `T` travels beside the
    /// response; `E` is an inner service's error, which releases the key.
    pub async fn run<R, T, E, Fut>(self, served: Served, handler: Fut) -> Ended<R, T, E>
    where
        Fut: Future<Output = Result<(R, T), E>> + Send + 'static,
        R: Reply + Send + 'static,
        R::Head: Send,
        R::Body: Send,
        <R::Body as Chunks>::Error: Send,
        T: Send + 'static,
        E: Send + 'static,
    {
        let (handle, route, work) = self.work(served, handler);
        pipeline::drive(&handle, &route, work, tokio::spawn).await
    }

    /// [`run`](Self::run) for a framework whose futures are not `Send` (actix-web): unfinished
    /// work goes on in a task of the current thread's `LocalSet` (`tokio::task::spawn_local`).
    pub async fn run_local<R, T, E, Fut>(self, served: Served, handler: Fut) -> Ended<R, T, E>
    where
        Fut: Future<Output = Result<(R, T), E>> + 'static,
        R: Reply + 'static,
        T: 'static,
        E: 'static,
    {
        let (handle, route, work) = self.work(served, handler);
        pipeline::drive(&handle, &route, work, tokio::task::spawn_local).await
    }

    fn work<R, T, E, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> (
        Idempotency,
        String,
        impl Future<Output = Ended<R, T, E>> + use<R, T, E, Fut>,
    )
    where
        Fut: Future<Output = Result<(R, T), E>>,
        R: Reply,
    {
        let Self { handle, inner } = self;
        let pipeline::Admitted {
            held,
            permit,
            route,
            span,
            ..
        } = inner;
        let work = pipeline::work(handle.clone(), held, permit, route.clone(), served, handler)
            .instrument(span);
        (handle, route, work)
    }

    /// Settles `response` as this request's answer without running the handler (an
    /// extractor's rejection): recorded like any response of its status, or the key released.
    pub async fn settle<R: Reply>(self, response: R) -> R {
        pipeline::settle(&self.handle, self.inner.held, response).await
    }
}
