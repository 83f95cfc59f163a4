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
use futures_util::FutureExt as _;
use tracing::Instrument as _;

#[cfg(any(feature = "axum", feature = "tonic"))]
pub mod http;

use crate::Idempotency;
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::pipeline::{self, Detached};
use crate::problem::Problem;
use crate::reservation::Reservation;
use crate::scope::Scope;

pub use crate::pipeline::{Chunks, Ended, Head, Reply, Served};

/// The caller's scope, resolved exactly as the sequence resolves it for a keyed request ([the
/// contract](crate::design) §4), as a framework's extractor for the operators' routes
/// (`inspect`, `forget`) hands it out: the adapter implements its framework's extractor
/// trait for it, finding the handle its own way (`Src` says how, where there are several).
pub struct CallerScope<Src = ()> {
    scope: Scope,
    _source: std::marker::PhantomData<fn() -> Src>,
}

impl<Src> CallerScope<Src> {
    /// Resolves the scope of the request whose head is `head`; `Err` is the refusal the
    /// sequence would answer the same request, rendered by the handle's renderer.
    pub async fn resolve<H: Head, R: Reply>(handle: &Idempotency, head: &H) -> Result<Self, R> {
        match pipeline::scope_of(handle, head).await {
            Ok(scope) => Ok(Self {
                scope,
                _source: std::marker::PhantomData,
            }),
            Err(problem) => Err(refusal(handle, &problem)),
        }
    }

    /// The scope hash that leads the caller's store keys.
    pub fn hash(&self) -> &crate::scope::ScopeHash {
        self.scope.hash()
    }

    /// The resolved scope: its segments and hash.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The resolved scope, by value.
    pub fn into_inner(self) -> Scope {
        self.scope
    }
}

impl<R> Ended<R, (), std::convert::Infallible> {
    /// The answer of work that cannot fail without one: the handler's, or a panic's 500.
    pub fn answer(self) -> R {
        match self {
            Self::Answered(response, ()) | Self::Panicked(response) => response,
            Self::Failed(never) => match never {},
        }
    }
}

impl<Src> std::fmt::Debug for CallerScope<Src> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CallerScope").field(&self.scope).finish()
    }
}

/// A path parameter's raw segment percent-decoded as [`Head::path_params`] must return it
/// (for a framework that hands out raw segments, as actix does): the fingerprint reads
/// decoded values, the same in every framework.
pub fn decode_path_param(segment: &str) -> std::borrow::Cow<'_, str> {
    crate::fingerprint::percent_decode(segment)
}

/// A refusal as the adapter's response, rendered by the handle's
/// [renderer](crate::IdempotencyBuilder::refusal_renderer).
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
    /// Boxed: a `Claimed` is handed from step to step (and through the framework's extractor
    /// and handler futures) by value, and moving a pointer is cheaper than its few hundred bytes.
    inner: Box<pipeline::Admitted<Reservation>>,
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
pub async fn front<H: Head, B: Chunks + From<Bytes>, R: Reply>(
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
        let inner = Box::new(claimed.instrument(span).await?);
        Ok(Claimed { handle, inner })
    }

    /// [`claim`](Self::claim) after the framework's own extractors ran on [`body`](Self::body)
    /// (they may publish the caller's identity for the scope): a rejection that would not be
    /// recorded ([`records`](Self::records)) is answered without claiming; anything else is
    /// claimed and handed back beside the claim, a recordable rejection to be settled as the
    /// request's answer.
    pub async fn claim_after<H: Head, R: Reply, A>(
        self,
        head: &H,
        extracted: Result<A, R>,
    ) -> Result<(Claimed, Result<A, R>), R> {
        match extracted {
            Err(rejection) if !self.records(rejection.status()) => Err(rejection),
            extracted => Ok((self.claim(head).await?, extracted)),
        }
    }
}

/// The steps before the handler, in order, for one request: [`front`], then
/// [`Buffered::claim`].
pub async fn prepare<H: Head, B: Chunks + From<Bytes>, R: Reply>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &H,
    body: B,
) -> Prepared<B, R> {
    // The two halves under one instrumentation of the request's span, not one each: a request
    // that goes straight from its body to its claim enters and leaves the span half as often.
    let span = crate::observe::request_span(head.route().unwrap_or(""));
    let steps = async {
        match pipeline::front::<Detached, _, _>(handle, endpoint, head, body).await {
            pipeline::Front::Pass(body) => Prepared::Pass(body),
            pipeline::Front::Refuse(problem) => {
                Prepared::Answer(pipeline::refuse(handle, &problem))
            }
            pipeline::Front::Buffered(buffered) => {
                match pipeline::claim::<Detached, _, R>(handle, head, buffered).await {
                    Ok(admitted) => Prepared::Claimed(Claimed {
                        handle: handle.clone(),
                        inner: Box::new(admitted),
                    }),
                    Err(answer) => Prepared::Answer(answer),
                }
            }
        }
    };
    steps.instrument(span).await
}

/// What [`prepare_extracting`] decided.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Extracted<A, R> {
    /// As [`Prepared::Pass`]: the extractors ran on the body as it came.
    Pass(Result<A, R>),
    /// As [`Prepared::Answer`].
    Answer(R),
    /// The key is held; the extractors ran on the buffered body (a recordable rejection is
    /// the request's answer, to be settled as the handler's).
    Claimed(Claimed, Result<A, R>),
}

/// [`prepare`] for a framework whose own extractors run between the body and the claim
/// (actix): [`front`], then `extract` on the buffered body (or, passing, the body as it came),
/// then [`Buffered::claim_after`].
pub async fn prepare_extracting<H, B, R, A, X, XF>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &H,
    body: B,
    extract: X,
) -> Extracted<A, R>
where
    H: Head,
    B: Chunks + From<Bytes>,
    R: Reply,
    X: FnOnce(B) -> XF,
    XF: Future<Output = Result<A, R>>,
{
    let buffered = match front(handle, endpoint, head, body).await {
        Front::Pass(body) => return Extracted::Pass(extract(body).await),
        Front::Answer(answer) => return Extracted::Answer(answer),
        Front::Buffered(buffered) => buffered,
    };
    let extracted = extract(B::from(buffered.body().clone())).await;
    match buffered.claim_after(head, extracted).await {
        Ok((claimed, extracted)) => Extracted::Claimed(claimed, extracted),
        Err(answer) => Extracted::Answer(answer),
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
    ///
    /// The handler and the steps around it are boxed when this is called, so the returned
    /// future is a few words whatever the handler's size, and nothing the handler holds is
    /// copied as that future moves.
    pub fn run<R, T, E, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> impl Future<Output = Ended<R, T, E>> + use<R, T, E, Fut>
    where
        Fut: Future<Output = Result<(R, T), E>> + Send + 'static,
        R: Reply + Send + 'static,
        R::Head: Send,
        R::Body: Send,
        <R::Body as Chunks>::Error: Send,
        T: Send + 'static,
        E: Send + 'static,
    {
        pipeline::drive(self.work(served, handler), tokio::spawn)
    }

    /// [`run`](Self::run) for a framework whose futures are not `Send` (actix-web): unfinished
    /// work goes on in a task of the current thread's `LocalSet` (`tokio::task::spawn_local`).
    pub fn run_local<R, T, E, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> impl Future<Output = Ended<R, T, E>> + use<R, T, E, Fut>
    where
        Fut: Future<Output = Result<(R, T), E>> + 'static,
        R: Reply + 'static,
        T: 'static,
        E: 'static,
    {
        pipeline::drive(self.work(served, handler), tokio::task::spawn_local)
    }

    fn work<R, T, E, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> pipeline::Work<impl Future<Output = Ended<R, T, E>> + use<R, T, E, Fut>>
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
        } = *inner;
        let future = Box::pin(
            pipeline::work(handle.clone(), held, permit, served, Box::pin(handler))
                .instrument(span),
        );
        pipeline::Work {
            handle,
            route,
            future,
        }
    }

    /// Settles `response` as this request's answer without running the handler (an
    /// extractor's rejection): recorded like any response of its status, or the key released.
    pub async fn settle<R: Reply>(self, response: R) -> R {
        // Boxed: a rejection is the rare path, and the extractor futures that may take it stay
        // small without the settling's kilobytes.
        let Self { handle, inner } = self;
        let mut held = inner.held;
        Box::pin(pipeline::settle(&handle, &mut held, response)).await
    }

    /// [`run`](Self::run) for a handler that always answers: its response, or the 500 of a
    /// handler that panicked.
    pub fn answer<R, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> impl Future<Output = R> + use<R, Fut>
    where
        Fut: Future<Output = R> + Send + 'static,
        R: Reply + Send + 'static,
        R::Head: Send,
        R::Body: Send,
        <R::Body as Chunks>::Error: Send,
    {
        self.run(served, handler.map(answered)).map(Ended::answer)
    }

    /// [`answer`](Self::answer) for a framework whose futures are not `Send`, as
    /// [`run_local`](Self::run_local).
    pub fn answer_local<R, Fut>(
        self,
        served: Served,
        handler: Fut,
    ) -> impl Future<Output = R> + use<R, Fut>
    where
        Fut: Future<Output = R> + 'static,
        R: Reply + 'static,
    {
        self.run_local(served, handler.map(answered))
            .map(Ended::answer)
    }
}

/// A handler's answer as [`Claimed::run`] takes it: nothing beside it, and no error.
fn answered<R>(response: R) -> Result<(R, ()), std::convert::Infallible> {
    Ok((response, ()))
}

/// What was read of a response body, then its error (if reading failed), then the rest of
/// the stream: how a framework without a stream combinator of its own rebuilds a response
/// that [`Reply::resumed`] hands back.
pub struct Resumed<B: Chunks> {
    read: Option<Bytes>,
    error: Option<B::Error>,
    rest: B,
}

impl<B: Chunks> Resumed<B> {
    /// `read`, then `error`, then `rest`.
    pub fn new(read: Bytes, error: Option<B::Error>, rest: B) -> Self {
        let read = Some(read).filter(|r| !r.is_empty());
        Self { read, error, rest }
    }
}

impl<B: Chunks> std::fmt::Debug for Resumed<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumed").finish_non_exhaustive()
    }
}

impl<B: Chunks<Error: Unpin>> Chunks for Resumed<B> {
    type Error = B::Error;

    fn poll_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Bytes, B::Error>>> {
        if let Some(read) = self.read.take() {
            return std::task::Poll::Ready(Some(Ok(read)));
        }
        if let Some(error) = self.error.take() {
            return std::task::Poll::Ready(Some(Err(error)));
        }
        self.rest.poll_chunk(cx)
    }
}

/// The mark the outermost idempotency step that applies to a request (a router-level layer or
/// middleware, or the attribute) leaves in the request's extensions, so an inner one steps
/// aside: the outer decides. An adapter inserts [`OuterStep::of`] when it takes a request on,
/// and an inner step that finds one steps aside ([`entry`]).
#[derive(Debug, Clone, Copy)]
pub struct OuterStep {
    require_key: bool,
}

impl OuterStep {
    /// The mark of a step with these endpoint settings.
    pub fn of(endpoint: &EndpointConfig) -> Self {
        Self {
            require_key: endpoint.require_key,
        }
    }
}

/// What an inner step (the attribute, settings `endpoint`) answers under an outer one that
/// already decided: `None` to run the handler under the outer step (with its context, if
/// any), or the refusal when the attribute requires the key and the outer step does not (the
/// watch says that setup once; strict mode refuses every request, otherwise a keyless one is
/// refused as the attribute alone would).
///
/// Keyed means keyed where the attribute reads its key, as it would alone: the outer step
/// left a context, or the request carries the attribute's own key header (its `key =
/// header(…)`, else the configured one). A key read from the body cannot be seen before the
/// body is read, so there the outer step's decision stands.
pub(crate) fn under_outer<R: Reply>(
    outer: OuterStep,
    endpoint: &EndpointConfig,
    handle: Option<&Idempotency>,
    route: &str,
    keyed: impl FnOnce(&str) -> bool,
) -> Option<R> {
    if !endpoint.require_key || outer.require_key {
        return None;
    }
    let keyed = match endpoint.key_source() {
        Some(source) if source.reads_body() => true,
        Some(source) => keyed(source.header_name().unwrap_or(crate::key::HEADER_NAME)),
        None => keyed(handle.map_or(crate::key::HEADER_NAME, |h| h.config().key_header())),
    };
    pipeline::required_under_optional(handle, route, keyed)
}

/// The answer when the application provided no [`Idempotency`] handle: a setup mistake,
/// logged with `fix` (how to provide it in the adapter's framework).
pub fn handle_missing<R: Reply>(route: &str, fix: &str) -> R {
    pipeline::handle_missing(route, fix)
}

/// The answer when a handler takes an [`IdempotencyContext`] and the request has none: a
/// keyless request on an endpoint whose key is optional, or no idempotency step around it.
pub fn context_missing<R: Reply>() -> R {
    pipeline::context_missing()
}

/// What the attribute (the extractor or handler wrapper `#[idempotent]` expands to) does with
/// a request: [`entry`]'s answer.
#[derive(Debug)]
pub enum Entry<R> {
    /// An outer step already decided: run the handler with the context it left (if any).
    Outer,
    /// Nothing to do (no handle, and a method the endpoint does not apply to): run the
    /// handler without a context.
    Bypass,
    /// Answer this instead of running the handler (a setup mistake).
    Answer(R),
    /// Run the sequence with this handle ([`prepare`], or [`front`] and [`Buffered::claim`]).
    Sequence(Idempotency),
}

/// The attribute's first decision, the same in every framework: under an `outer` step it
/// steps aside, or refuses when it requires the key, the outer step does not, and the request
/// is keyless where the attribute reads its key; without a handle a method the endpoint does
/// not apply to needs none, and anything else is [`handle_missing`] with `fix`. `route` is
/// asked only when a log line needs it; `keyed(name)` says whether the outer step left a
/// context or the request carries header `name` (asked only under an outer step, with the
/// header the attribute reads its key from).
pub fn entry<R: Reply, S: AsRef<str>>(
    outer: Option<OuterStep>,
    handle: Option<Idempotency>,
    endpoint: &EndpointConfig,
    method: &str,
    route: impl FnOnce() -> S,
    keyed: impl FnOnce(&str) -> bool,
    fix: &str,
) -> Entry<R> {
    if let Some(outer) = outer {
        return match under_outer(outer, endpoint, handle.as_ref(), route().as_ref(), keyed) {
            Some(refusal) => Entry::Answer(refusal),
            None => Entry::Outer,
        };
    }
    match handle {
        Some(handle) => Entry::Sequence(handle),
        // With a handle, the sequence's first step decides what a method it does not apply to
        // means (a pass, or a setup mistake); without one, such a request needs none.
        None if !endpoint.applies_to(None, method) => Entry::Bypass,
        None => Entry::Answer(handle_missing(route().as_ref(), fix)),
    }
}

/// A router-level layer's (axum's `IdempotencyLayer`, actix's middleware) view of the requests
/// it sees, shared by its clones: whether it ever sees a matched route (put outside the router
/// it protects nothing, and says so once), and what each request gets ([`RouterLayer::step`]).
#[derive(Debug, Clone)]
pub struct RouterLayer {
    endpoint: std::sync::Arc<EndpointConfig>,
    watch: std::sync::Arc<crate::watch::LayerWatch>,
    around_router: bool,
}

/// What a router-level layer does with one request ([`RouterLayer::step`]).
#[derive(Debug)]
pub enum LayerStep<R, H, P> {
    /// Not for this layer (another method, no matched route, an outer step decided): call the
    /// inner service untouched.
    Pass,
    /// Answer this instead (a setup mistake).
    Answer(R),
    /// Run the sequence with this handle (as given to [`RouterLayer::step`]) on this matched
    /// route pattern (as given); insert this layer's [`OuterStep`] in the request's extensions
    /// before anything inner runs.
    Sequence(H, P, OuterStep),
}

/// The layer's default settings: key optional, POST and PATCH, the runtime's settings
/// ([`EndpointConfig::OPTIONAL`]).
impl Default for RouterLayer {
    fn default() -> Self {
        Self::new(EndpointConfig::OPTIONAL)
    }
}

impl RouterLayer {
    /// A layer with these endpoint settings for every route inside.
    pub fn new(endpoint: EndpointConfig) -> Self {
        Self {
            endpoint: std::sync::Arc::new(endpoint),
            watch: std::sync::Arc::default(),
            around_router: false,
        }
    }

    /// The endpoint settings of every route inside.
    pub fn endpoint(&self) -> &EndpointConfig {
        &self.endpoint
    }

    /// This layer with other endpoint settings (the same watch).
    pub fn with_endpoint(self, endpoint: EndpointConfig) -> Self {
        let endpoint = std::sync::Arc::new(endpoint);
        Self { endpoint, ..self }
    }

    /// This layer put around a service whose type is named `inner`
    /// (`std::any::type_name`): around a finished axum `Router` no request it sees can have a
    /// matched route of its own, so the first one shows the layer misplaced.
    pub fn around(&self, inner: &str) -> Self {
        Self {
            around_router: crate::watch::LayerWatch::wraps_router(inner),
            ..self.clone()
        }
    }

    /// One request: by its `method` (with the handle's settings, when there is a handle),
    /// whether the router matched a route `pattern` for it, the `path` for log lines, and the
    /// `outer` step already on it. A request the layer applies to without a handle is
    /// [`handle_missing`] with `fix`.
    pub fn step<R, H, P>(
        &self,
        handle: Option<H>,
        method: &str,
        pattern: Option<P>,
        path: &str,
        outer: Option<OuterStep>,
        fix: &str,
    ) -> LayerStep<R, H, P>
    where
        R: Reply,
        H: std::borrow::Borrow<Idempotency>,
        P: AsRef<str>,
    {
        let (endpoint, config) = (&self.endpoint, handle.as_ref().map(|h| h.borrow().config()));
        if !endpoint.applies_to(config, method) {
            return LayerStep::Pass;
        }
        let Some(pattern) = pattern else {
            if self.around_router {
                self.watch.outside_router(path);
                if let Some(handle) = handle.filter(|h| h.borrow().config().strict()) {
                    let problem = pipeline::misconfigured();
                    return LayerStep::Answer(refusal(handle.borrow(), &problem));
                }
            } else {
                self.watch.saw(false, path);
            }
            return LayerStep::Pass;
        };
        self.watch.saw(true, path);
        if outer.is_some() {
            return LayerStep::Pass;
        }
        match handle {
            Some(handle) => LayerStep::Sequence(handle, pattern, OuterStep::of(endpoint)),
            None => LayerStep::Answer(handle_missing(pattern.as_ref(), fix)),
        }
    }
}

/// Route patterns compiled once each, for a router-level layer that runs before its
/// framework's router has matched the request (actix-web's scope middleware), and so reads the
/// path parameters of the pattern [`RouterLayer::step`] names itself: `T` is the framework's
/// compiled pattern. Not `Sync`: one per service, which such a framework builds per worker.
#[derive(Debug)]
pub struct RoutePatterns<T> {
    compiled: std::cell::RefCell<std::collections::HashMap<String, T>>,
}

impl<T> Default for RoutePatterns<T> {
    fn default() -> Self {
        let compiled = std::cell::RefCell::default();
        Self { compiled }
    }
}

impl<T> RoutePatterns<T> {
    /// `read` over `pattern` compiled; `compile` runs the first time a pattern is met only.
    /// Both run while the cache is borrowed: neither may call back into this `RoutePatterns`.
    pub fn with<A>(
        &self,
        pattern: &str,
        compile: impl FnOnce(&str) -> T,
        read: impl FnOnce(&T) -> A,
    ) -> A {
        let mut compiled = self.compiled.borrow_mut();
        if let Some(known) = compiled.get(pattern) {
            return read(known);
        }
        read(
            compiled
                .entry(pattern.to_owned())
                .or_insert_with(|| compile(pattern)),
        )
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub use enlisted::{
    BufferedTx, ClaimedTx, enlisted_entry, front_enlisted, prepare_enlisted,
    prepare_enlisted_extracting,
};

/// Enlisted mode's entry points ([`crate::enlisted`]): the same sequence, claiming the key
/// inside the transaction the handler then writes through, and committing the record with the
/// handler's writes before the answer goes out. The transaction is the one the store enlists
/// in ([`Store::enlisting`](crate::store::Store::enlisting)); the adapter only hands the
/// [`EnlistedTx`] to the handler and takes it back with the answer. Each entry point is generic
/// over the [`Enlistable`] database the handler's transaction is on (its `EnlistedTx<DB>`), so a
/// store that enlists in another database changes nothing here.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod enlisted {
    use std::future::Future;
    use std::marker::PhantomData;

    use bytes::Bytes;
    use tracing::Instrument as _;

    use super::{Chunks, Ended, Head, Reply};
    use crate::Idempotency;
    use crate::config::EndpointConfig;
    use crate::context::IdempotencyContext;
    use crate::enlisted::{Enlistable, EnlistedTx, Held};
    use crate::pipeline::{self, Enlisted};

    /// An enlisted request whose body was read in full, ready to be claimed in its
    /// transaction ([`front_enlisted`]'s answer).
    pub struct BufferedTx<DB: Enlistable> {
        handle: Idempotency,
        inner: pipeline::Buffered,
        span: tracing::Span,
        _database: PhantomData<fn() -> DB>,
    }

    impl<DB: Enlistable> std::fmt::Debug for BufferedTx<DB> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("BufferedTx")
                .field("body", &self.inner.body.len())
                .finish_non_exhaustive()
        }
    }

    /// An enlisted request that holds its transaction (and, with a key, its reservation in
    /// it): run the handler with the transaction through [`run`](Self::run), or settle an
    /// answer the adapter made itself.
    pub struct ClaimedTx<DB: Enlistable> {
        handle: Idempotency,
        inner: pipeline::Admitted<Held<DB>>,
    }

    impl<DB: Enlistable> std::fmt::Debug for ClaimedTx<DB> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ClaimedTx")
                .field("route", &self.inner.route)
                .finish_non_exhaustive()
        }
    }

    /// [`front`](super::front) in enlisted mode: every body is read before its transaction
    /// begins (a request without a key too, so a slow client never holds a connection), so
    /// there is no pass; `Err` is a refusal.
    pub async fn front_enlisted<DB, H, B, R>(
        handle: &Idempotency,
        endpoint: &EndpointConfig,
        head: &H,
        body: B,
    ) -> Result<BufferedTx<DB>, R>
    where
        DB: Enlistable,
        H: Head,
        B: Chunks + From<Bytes>,
        R: Reply,
    {
        let span = crate::observe::request_span(head.route().unwrap_or(""));
        let front = pipeline::front::<Enlisted<DB>, _, _>(handle, endpoint, head, body);
        match front.instrument(span.clone()).await {
            pipeline::Front::Pass(_) => unreachable!("enlisted mode reads every body"),
            pipeline::Front::Refuse(problem) => Err(pipeline::refuse(handle, &problem)),
            pipeline::Front::Buffered(inner) => Ok(BufferedTx {
                handle: handle.clone(),
                inner,
                span,
                _database: PhantomData,
            }),
        }
    }

    impl<DB: Enlistable> BufferedTx<DB> {
        /// The request body, read in full.
        pub fn body(&self) -> &Bytes {
            &self.inner.body
        }

        /// Whether a response with this status would be recorded on this endpoint (see
        /// [`Buffered::records`](super::Buffered::records)).
        pub fn records(&self, status: u16) -> bool {
            let config = self.handle.config();
            self.inner.recording().is_recordable_status(config, status)
        }

        /// Scope, fingerprint, and the claim inside a new transaction. `Err` is the answer
        /// instead of running: a replay or a refusal.
        pub async fn claim<H: Head, R: Reply>(self, head: &H) -> Result<ClaimedTx<DB>, R> {
            let Self {
                handle,
                inner,
                span,
                ..
            } = self;
            let claimed = pipeline::claim::<Enlisted<DB>, _, R>(&handle, head, inner);
            let inner = claimed.instrument(span).await?;
            Ok(ClaimedTx { handle, inner })
        }

        /// [`Buffered::claim_after`](super::Buffered::claim_after) in enlisted mode.
        pub async fn claim_after<H: Head, R: Reply, A>(
            self,
            head: &H,
            extracted: Result<A, R>,
        ) -> Result<(ClaimedTx<DB>, Result<A, R>), R> {
            match extracted {
                Err(rejection) if !self.records(rejection.status()) => Err(rejection),
                extracted => Ok((self.claim(head).await?, extracted)),
            }
        }
    }

    /// [`prepare_extracting`](super::prepare_extracting) in enlisted mode: `Err` is the
    /// answer instead of running.
    pub async fn prepare_enlisted_extracting<DB, H, B, R, A, X, XF>(
        handle: &Idempotency,
        endpoint: &EndpointConfig,
        head: &H,
        body: B,
        extract: X,
    ) -> Result<(ClaimedTx<DB>, Result<A, R>), R>
    where
        DB: Enlistable,
        H: Head,
        B: Chunks + From<Bytes>,
        R: Reply,
        X: FnOnce(B) -> XF,
        XF: Future<Output = Result<A, R>>,
    {
        let buffered = front_enlisted::<DB, _, _, _>(handle, endpoint, head, body).await?;
        let extracted = extract(B::from(buffered.body().clone())).await;
        buffered.claim_after(head, extracted).await
    }

    /// The enlisted attribute's first decision: an outer step already claimed the key
    /// outside any transaction (a setup mistake), or there is no handle
    /// ([`handle_missing`](super::handle_missing) with `fix`); otherwise the handle to run
    /// the sequence with.
    pub fn enlisted_entry<R: Reply>(
        outer: Option<super::OuterStep>,
        handle: Option<Idempotency>,
        route: &str,
        fix: &str,
    ) -> Result<Idempotency, R> {
        match (outer, handle) {
            (Some(_), _) => Err(pipeline::enlisted_behind_layer(route)),
            (None, None) => Err(super::handle_missing(route, fix)),
            (None, Some(handle)) => Ok(handle),
        }
    }

    /// [`prepare`](super::prepare) in enlisted mode: [`front_enlisted`], then
    /// [`BufferedTx::claim`].
    pub async fn prepare_enlisted<DB, H, B, R>(
        handle: &Idempotency,
        endpoint: &EndpointConfig,
        head: &H,
        body: B,
    ) -> Result<ClaimedTx<DB>, R>
    where
        DB: Enlistable,
        H: Head,
        B: Chunks + From<Bytes>,
        R: Reply,
    {
        front_enlisted::<DB, _, _, _>(handle, endpoint, head, body)
            .await?
            .claim(head)
            .await
    }

    impl<DB: Enlistable> ClaimedTx<DB> {
        /// The request body, read in full: the handler reads this instead of the original.
        pub fn body(&self) -> &Bytes {
            &self.inner.body
        }

        /// The claimed key's context (`None` for a request without a key).
        pub fn context(&self) -> Option<&IdempotencyContext> {
            self.inner.context.as_ref()
        }

        fn work<R, F, Fut>(
            self,
            handler: F,
        ) -> pipeline::Work<impl Future<Output = Ended<R, (), std::convert::Infallible>>>
        where
            R: Reply,
            F: FnOnce(EnlistedTx<DB>) -> Fut,
            Fut: Future<Output = (EnlistedTx<DB>, R)>,
        {
            let Self { handle, inner } = self;
            let pipeline::Admitted {
                held,
                permit,
                route,
                span,
                ..
            } = inner;
            let future = Box::pin(
                pipeline::enlisted_work(handle.clone(), held, permit, route.clone(), handler)
                    .instrument(span),
            );
            pipeline::Work {
                handle,
                route,
                future,
            }
        }

        /// Runs `handler` with the transaction to its end where no client disconnect can
        /// cancel it (in a Tokio task when it is not done at its first poll); the handler
        /// hands the transaction back with its answer, which is then recorded in it and
        /// committed, or everything is rolled back ([`crate::enlisted`]).
        pub async fn run<R, F, Fut>(self, handler: F) -> R
        where
            R: Reply + Send + 'static,
            R::Head: Send,
            R::Body: Send,
            <R::Body as Chunks>::Error: Send,
            F: FnOnce(EnlistedTx<DB>) -> Fut + Send + 'static,
            Fut: Future<Output = (EnlistedTx<DB>, R)> + Send + 'static,
        {
            pipeline::drive(self.work(handler), tokio::spawn)
                .await
                .answer()
        }

        /// [`run`](Self::run) for a framework whose futures are not `Send` (actix-web), on
        /// the current thread's `LocalSet`.
        pub async fn run_local<R, F, Fut>(self, handler: F) -> R
        where
            R: Reply + 'static,
            F: FnOnce(EnlistedTx<DB>) -> Fut + 'static,
            Fut: Future<Output = (EnlistedTx<DB>, R)> + 'static,
        {
            let spawn = tokio::task::spawn_local;
            pipeline::drive(self.work(handler), spawn).await.answer()
        }

        /// Settles `response` as this request's answer without running the handler (an
        /// extractor's rejection): recorded in the transaction and committed like any
        /// response of its status, or rolled back.
        pub async fn settle<R: Reply>(self, response: R) -> R {
            let Held { tx, settle } = self.inner.held;
            pipeline::settle_enlisted(&self.handle, settle, tx, response).await
        }
    }
}

#[cfg(test)]
mod tests {
    /// `axum/`, `actix/` and `tonic/` are adapters over this module only: a framework adapter
    /// written outside the crate could do all they do. Their tests may reach further.
    #[test]
    fn the_framework_adapters_use_only_the_public_adapter_api() {
        const INTERNAL: [&str; 6] = [
            "crate::handle",
            "crate::pipeline",
            "crate::watch",
            "crate::record",
            "crate::reservation",
            "crate::budget",
        ];
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut read = 0;
        for framework in ["axum", "actix", "tonic"] {
            for entry in std::fs::read_dir(src.join(framework)).expect("the adapter's sources") {
                let path = entry.expect("a source file").path();
                if path.file_name().is_some_and(|n| n == "tests.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("a source file");
                read += 1;
                for internal in INTERNAL {
                    assert!(
                        !text.contains(internal),
                        "{} names {internal}: go through crate::adapter",
                        path.display()
                    );
                }
            }
        }
        assert!(read >= 14, "found only {read} adapter sources");
    }
}
