//! [`IdempotencyLayer`]: the same semantics as `#[idempotent]` for a whole router.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::{MatchedPath, Request};
use axum::response::{IntoResponse, Response};
use tower_layer::Layer;
use tower_service::Service;

use super::adapter::{HANDLE_MISSING_FIX, head, params};
use crate::Idempotency;
use crate::adapter::http::prepare;
use crate::adapter::{LayerStep, OuterStep, RouterLayer, Served};
use crate::config::EndpointConfig;

/// Makes every route of a router idempotent, with the semantics of `#[idempotent]` (runtime
/// checks only). It applies to the [`methods`](EndpointConfig::methods) of its endpoint
/// settings (POST and PATCH by default) and passes other methods and requests that matched no
/// route (fallbacks) through untouched. Where a handler also carries `#[idempotent]`, the layer
/// decides and the attribute steps aside.
///
/// Add it with `Router::layer` or `Router::route_layer` (it reads the matched route, which only
/// exists inside the router). Put around a finished `Router` it could protect nothing: it says
/// so on the first request it would apply to, and in [strict mode](crate::config::Config::strict)
/// refuses each of them with 500 `IDEMPOTENCY_MISCONFIGURED`.
///
/// ```
/// use axum::{Router, routing::post};
/// use idempotent_runtime::{Idempotency, config::EndpointConfig};
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
    handle: Idempotency,
    layer: RouterLayer,
}

impl IdempotencyLayer {
    /// A layer over the handle `idempotency`: key optional, POST and PATCH.
    pub fn new(idempotency: Idempotency) -> Self {
        let layer = RouterLayer::default();
        Self {
            handle: idempotency,
            layer,
        }
    }

    /// The endpoint settings of every route inside (default [`EndpointConfig::OPTIONAL`]): the
    /// key required or not, lease, retention, caps, statuses, headers, methods; the same value
    /// the attribute builds from its arguments, built in code or read from a file.
    pub fn endpoint(self, endpoint: EndpointConfig) -> Self {
        let layer = self.layer.with_endpoint(endpoint);
        Self { layer, ..self }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            handle: self.handle.clone(),
            layer: self.layer.around(std::any::type_name::<S>()),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps routes in.
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    handle: Idempotency,
    /// The layer's watch, knowing what this service was put around.
    layer: RouterLayer,
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
        let extensions = request.extensions();
        let step = self.layer.step(
            Some(&self.handle),
            request.method().as_str(),
            extensions.get::<MatchedPath>().map(MatchedPath::as_str),
            request.uri().path(),
            extensions.get::<OuterStep>().copied(),
            HANDLE_MISSING_FIX,
        );
        let outer = match step {
            LayerStep::Answer(answer) => return Box::pin(async { Ok(answer) }),
            LayerStep::Pass => {
                return Box::pin(async move { Ok(inner.call(request).await.into_response()) });
            }
            LayerStep::Sequence(_, _, outer) => outer,
        };
        request.extensions_mut().insert(outer);
        let (handle, layer) = (self.handle.clone(), self.layer.clone());
        Box::pin(async move {
            let response = match prepare(&handle, layer.endpoint(), request, params, head).await {
                Err(answer) => answer,
                Ok((request, None)) => inner.call(request).await.into_response(),
                Ok((request, Some(claimed))) => {
                    let handler = async move { inner.call(request).await.into_response() };
                    claimed.answer(Served::ThroughRouter, handler).await
                }
            };
            Ok(response)
        })
    }
}
