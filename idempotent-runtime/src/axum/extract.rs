//! The extractor `#[idempotent]` wraps a handler's last parameter in.

use std::convert::Infallible;
use std::marker::PhantomData;

use axum::extract::{FromRef, FromRequest, FromRequestParts, OptionalFromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use futures_util::future::Either;
use http::request::Parts;

use super::adapter::{HANDLE_MISSING_FIX as FIX, head, params, route_of};
use super::probe::ProvidesIdempotency;
use crate::Idempotency;
use crate::adapter::{self, Claimed, Entry, OuterStep, Served};
use crate::config::{Endpoint, EndpointConfig};
use crate::context::IdempotencyContext;

/// Where the extractor finds the [`Idempotency`].
pub trait HandleSource<S>: Send + Sync + 'static {
    /// The handle, or `None` when the application did not provide one.
    fn handle(extensions: &http::Extensions, state: &S) -> Option<Idempotency>;
}

/// From the application state: `Idempotency: FromRef<S>`, checked at compile time (the
/// default).
#[derive(Debug)]
pub enum FromState {}

impl<S> HandleSource<S> for FromState
where
    Idempotency: FromRef<S>,
{
    fn handle(_: &http::Extensions, state: &S) -> Option<Idempotency> {
        Some(Idempotency::from_ref(state))
    }
}

/// From the application state `S` the expansion names when the handler has no `State`
/// parameter: `S: ProvidesIdempotency`, a bound rustc cannot solve by guessing `S` (see the
/// expansion), so a router whose state lacks the handle is refused with that trait's message.
#[derive(Debug)]
pub struct FromStateOf<S>(PhantomData<fn() -> S>);

impl<S: ProvidesIdempotency + 'static> HandleSource<S> for FromStateOf<S> {
    fn handle(_: &http::Extensions, state: &S) -> Option<Idempotency> {
        Some(state.idempotency())
    }
}

/// From the request extensions (`.layer(Extension(idempotency))`), checked only at run time: a
/// missing handle answers 500. Chosen when the handler takes an `Extension<Idempotency>`.
#[derive(Debug)]
pub enum FromExtension {}

impl<S> HandleSource<S> for FromExtension {
    fn handle(extensions: &http::Extensions, _: &S) -> Option<Idempotency> {
        extensions.get::<Idempotency>().cloned()
    }
}

/// The extraction marker of [`Idempotent<T>`]: `M` is how `T` itself extracts (from the parts
/// or from the whole request), so the wrapper works around either kind.
#[derive(Debug)]
pub struct Via<M>(PhantomData<M>);

/// The wrapper `#[idempotent]` puts around a handler's last parameter (any extractor `T`,
/// whichever way it extracts: the free `M` lets `Idempotent<Json<T>>` and
/// `Idempotent<Path<u32>>` both work).
///
/// Extracting it runs the whole pipeline before the handler: key, body, scope, claim. A replay
/// or a refusal is its rejection, so the handler never runs for them. The endpoint's settings
/// are its type parameter `E` ([`Endpoint::CONFIG`], built in a `const` by the expansion; the
/// default `()` is an optional key and the runtime's settings).
/// [`run`](Self::run) then runs the handler in its own task and records the response.
#[must_use]
pub struct Idempotent<T, Src = FromState, E: Endpoint = ()> {
    value: T,
    context: Option<IdempotencyContext>,
    claimed: Option<Claimed>,
    _source: PhantomData<fn() -> (Src, E)>,
}

impl<T, Src, E: Endpoint> Idempotent<T, Src, E> {
    /// The endpoint settings `E` names.
    pub const ENDPOINT: &'static EndpointConfig = E::CONFIG;

    /// The inner extractor.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// The claimed request's context (`None` when the request had no key).
    pub fn context(&self) -> Option<&IdempotencyContext> {
        self.context.as_ref()
    }

    /// Runs the handler: in its own task when the key is held (a client that disconnects
    /// never cancels it), recording or releasing the response before it is returned.
    ///
    /// The handler's future is made when this is called: when the key is held it is boxed with
    /// the steps around it at once ([`Claimed::answer`]), so the future returned holds a few
    /// words, not the handler's state.
    pub fn run<F, Fut>(self, handler: F) -> impl Future<Output = Response> + use<F, Fut, T, Src, E>
    where
        F: FnOnce(T, Option<IdempotencyContext>) -> Fut,
        Fut: Future<Output = Response> + Send + 'static,
    {
        let future = handler(self.value, self.context);
        match self.claimed {
            None => Either::Left(future),
            Some(claimed) => Either::Right(claimed.answer(Served::ByHandler, future)),
        }
    }
}

impl<S, M, T, Src, E: Endpoint> FromRequest<S, Via<M>> for Idempotent<T, Src, E>
where
    T: FromRequest<S, M> + Send,
    S: Send + Sync,
    Src: HandleSource<S>,
{
    type Rejection = Response;

    // A block, not an `async fn`: the request is kept once (an `async fn` keeps its arguments
    // and the bindings it moves them into), in the future axum boxes for every request.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice (the argument and its rebinding)"
    )]
    fn from_request(
        request: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        async move {
            let extensions = request.extensions();
            let outer = extensions.get::<OuterStep>().copied();
            // Under an outer step (the layer), the context is the one it left.
            let context = outer.and_then(|_| extensions.get::<IdempotencyContext>().cloned());
            let handle = Src::handle(extensions, state);
            let route = || route_of(extensions);
            let method = request.method().as_str();
            let headers = request.headers();
            let keyed = |name: &str| context.is_some() || headers.contains_key(name);
            let entry = adapter::entry(outer, handle, Self::ENDPOINT, method, route, keyed, FIX);
            let (request, claimed) = match entry {
                Entry::Answer(answer) => return Err(answer),
                Entry::Outer | Entry::Bypass => (request, None),
                Entry::Sequence(handle) => {
                    adapter::http::prepare(&handle, Self::ENDPOINT, request, params, head).await?
                }
            };
            let context = claimed.as_ref().map_or(context, |c| c.context().cloned());
            let extracted = T::from_request(request, state).await;
            match extracted.map_err(IntoResponse::into_response) {
                Ok(value) => Ok(Self {
                    value,
                    context,
                    claimed,
                    _source: PhantomData,
                }),
                // The extractor's rejection of a claimed request (malformed JSON, say) is its
                // answer: recorded like any 4xx, so the retry gets the same rejection.
                Err(rejection) => match claimed {
                    Some(claimed) => Err(claimed.settle(rejection).await),
                    None => Err(rejection),
                },
            }
        }
    }
}

/// The claimed request's context, for handlers behind [`IdempotencyLayer`](super::IdempotencyLayer)
/// (with `#[idempotent]`, take it as a parameter and the macro supplies it). A request without
/// a key has none: take `Option<IdempotencyContext>` on endpoints where the key is optional.
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyContext>()
            .cloned()
            .ok_or_else(context_missing)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Infallible> {
        Ok(parts.extensions.get::<IdempotencyContext>().cloned())
    }
}

/// The answer when a handler needs an [`IdempotencyContext`] and the request has none: a setup
/// mistake (no key on an endpoint that does not require one, or no idempotency layer).
pub fn context_missing() -> Response {
    adapter::context_missing()
}
