//! [`IdempotencyLayer`]: the same semantics as `#[idempotent]` for a whole router.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{MatchedPath, Request};
use axum::response::{IntoResponse, Response};
use tower_layer::Layer;
use tower_service::Service;

use super::adapter::{self, Prepared};
use crate::config::EndpointConfig;
use crate::handle::Idempotency;
use crate::pipeline::{self, Handled, Served};
use crate::watch::LayerWatch;

/// Makes every route of a router idempotent, with the semantics of `#[idempotent]` (runtime
/// checks only). It applies to the [`methods`](EndpointConfig::methods) of its endpoint
/// settings (POST and PATCH by default) and passes other methods and requests that matched no
/// route (fallbacks) through untouched. Where a handler also carries `#[idempotent]`, the layer
/// decides and the attribute steps aside.
///
/// Add it with `Router::layer` or `Router::route_layer` (it reads the matched route, which only
/// exists inside the router). Put around a finished `Router` it could protect nothing: it says
/// so on the first request it would apply to, and in [strict mode](crate::Config::strict)
/// refuses each of them with 500 `IDEMPOTENCY_MISCONFIGURED`.
///
/// ```
/// use axum::{Router, routing::post};
/// use idempotent_runtime::{EndpointConfig, Idempotency};
/// use idempotent_runtime::axum::IdempotencyLayer;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let idempotency = Idempotency::memory();
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .layer(IdempotencyLayer::new(idempotency).endpoint(EndpointConfig::REQUIRED));
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

#[derive(Debug, Clone)]
struct Shared {
    handle: Idempotency,
    endpoint: EndpointConfig,
    watch: Arc<LayerWatch>,
}

impl IdempotencyLayer {
    /// A layer over the handle `idempotency`: key optional, POST and PATCH.
    pub fn new(idempotency: Idempotency) -> Self {
        Self {
            shared: Arc::new(Shared {
                handle: idempotency,
                endpoint: EndpointConfig::OPTIONAL,
                watch: Arc::default(),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Shared)) -> Self {
        f(Arc::make_mut(&mut self.shared));
        self
    }

    /// The endpoint settings of every route inside (default [`EndpointConfig::OPTIONAL`]): the
    /// key required or not, lease, retention, caps, statuses, headers, methods; the same value
    /// the attribute builds from its arguments, built in code or read from a file.
    pub fn endpoint(self, endpoint: EndpointConfig) -> Self {
        self.edit(|s| s.endpoint = endpoint)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let wraps_router = LayerWatch::wraps_router(std::any::type_name::<S>());
        IdempotencyService {
            inner,
            shared: Arc::clone(&self.shared),
            wraps_router,
        }
    }
}

/// The service [`IdempotencyLayer`] wraps routes in.
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
    /// Put around a finished router: no request it sees can have a matched route of its own.
    wraps_router: bool,
}

impl<S> Service<Request> for IdempotencyService<S>
where
    S: Service<Request, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        // The clone that was polled ready serves this request; the fresh one waits for its turn.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let shared = Arc::clone(&self.shared);
        let wraps_router = self.wraps_router;
        Box::pin(async move {
            let handle = &shared.handle;
            let method = request.method().as_str();
            let by_method = shared.endpoint.applies_to(Some(handle.config()), method);
            let matched = request.extensions().get::<MatchedPath>().is_some();
            if by_method && wraps_router && !matched {
                shared.watch.outside_router(request.uri().path());
                if handle.config().strict() {
                    return Ok(pipeline::refuse(handle, &pipeline::misconfigured()));
                }
            } else if by_method {
                shared.watch.saw(matched, request.uri().path());
            }
            let applies = by_method && matched && request.extensions().get::<Handled>().is_none();
            if !applies {
                return Ok(inner.call(request).await.into_response());
            }
            let require_key = shared.endpoint.require_key;
            request.extensions_mut().insert(Handled { require_key });
            let response = match adapter::prepare(handle, &shared.endpoint, request).await {
                Err(answer) => answer,
                Ok(Prepared::Pass(request)) => inner.call(request).await.into_response(),
                Ok(Prepared::Claimed(request, claimed)) => {
                    let handler = async move { inner.call(request).await.into_response() };
                    adapter::run_claimed(claimed, Served::ThroughRouter, handler).await
                }
            };
            Ok(response)
        })
    }
}
