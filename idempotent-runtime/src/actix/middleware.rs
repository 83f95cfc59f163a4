//! The scope-level opt-in: [`IdempotencyMiddleware`].

use std::future::{Ready, ready};
use std::rc::Rc;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{self, ResourceDef, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::{Error, HttpMessage, HttpResponse};
use futures_util::future::LocalBoxFuture;

use super::adapter::{self, ActixHead, HANDLE_MISSING_FIX};
use crate::adapter::{
    self as sequence, Ended, LayerStep, OuterStep, Prepared, RoutePatterns, RouterLayer, Served,
};
use crate::config::EndpointConfig;

/// Makes every POST and PATCH route of an actix-web scope (or resource, or app) idempotent,
/// with the same semantics as `#[idempotent]` on each handler (runtime checks only); the
/// methods are a setting ([`EndpointConfig::methods`], given with [`endpoint`](Self::endpoint)).
///
/// Requests with other methods (HEAD, OPTIONS, GET, …) and requests that match no route
/// (default services) pass through untouched. Where this middleware and the attribute both
/// apply, the outer one decides and the attribute steps aside. The handle is the
/// `web::Data<Idempotency>` of the application data.
///
/// Claimed handlers run in their own task, so a client that disconnects does not cancel them:
/// the response is still recorded and the client's retry gets the replay. A service inside this
/// middleware that fails with an `Err` (rather than an error response) releases the key.
///
/// ```
/// use actix_web::{App, HttpResponse, web};
/// use idempotent_runtime::{Idempotency, config::EndpointConfig};
/// use idempotent_runtime::actix::IdempotencyMiddleware;
///
/// # #[actix_web::main] async fn main() {
/// let idempotency = web::Data::new(Idempotency::memory());
/// let app = App::new().app_data(idempotency).service(
///     web::scope("/payments")
///         .wrap(IdempotencyMiddleware::new().endpoint(EndpointConfig::REQUIRED))
///         .route("", web::post().to(|| async { HttpResponse::Created().finish() })),
/// );
/// # let _ = actix_web::test::init_service(app).await;
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct IdempotencyMiddleware {
    layer: RouterLayer,
}

impl IdempotencyMiddleware {
    /// POST and PATCH, key optional, the runtime's settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// The endpoint settings of every route inside (default [`EndpointConfig::OPTIONAL`]): the
    /// key required or not, lease, retention, caps, statuses, headers, methods; the same value
    /// the attribute builds from its arguments, built in code or read from a file.
    pub fn endpoint(self, endpoint: EndpointConfig) -> Self {
        let layer = self.layer.with_endpoint(endpoint);
        Self { layer }
    }
}

impl<S, B> Transform<S, ServiceRequest> for IdempotencyMiddleware
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = Error;
    type Transform = IdempotencyService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyService {
            service: Rc::new(service),
            layer: self.layer.clone(),
            patterns: Rc::default(),
        }))
    }
}

/// The service [`IdempotencyMiddleware`] wraps around its scope.
pub struct IdempotencyService<S> {
    service: Rc<S>,
    layer: RouterLayer,
    // Compiled once per worker: a scope middleware runs before the scope's router, so it reads
    // the path parameters of the route the request will match itself.
    patterns: Rc<RoutePatterns<ResourceDef>>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("endpoint", self.layer.endpoint())
            .finish_non_exhaustive()
    }
}

impl<S, B> Service<ServiceRequest> for IdempotencyService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    dev::forward_ready!(service);

    fn call(&self, mut req: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        let step = self.layer.step::<HttpResponse, _, _>(
            adapter::handle_of(req.request()),
            req.method().as_str(),
            req.match_pattern(),
            req.path(),
            req.extensions().get::<OuterStep>().copied(),
            HANDLE_MISSING_FIX,
        );
        let (handle, pattern) = match step {
            LayerStep::Pass => {
                return Box::pin(async move { Ok(service.call(req).await?.map_into_boxed_body()) });
            }
            LayerStep::Answer(response) => {
                return Box::pin(async move { Ok(req.into_response(response)) });
            }
            LayerStep::Sequence(handle, pattern, outer) => {
                req.extensions_mut().insert(outer);
                (handle, pattern)
            }
        };
        let compile = |pattern: &str| ResourceDef::new(pattern);
        let capture = |def: &ResourceDef| adapter::captured(&req, def);
        let params = self.patterns.with(&pattern, compile, capture);
        let layer = self.layer.clone();
        let steps = async move {
            let payload = req.take_payload();
            let head = ActixHead {
                req: req.request(),
                route: Some(pattern),
                params,
            };
            let prepared =
                sequence::prepare::<_, _, HttpResponse>(&handle, layer.endpoint(), &head, payload);
            let claimed = match prepared.await {
                Prepared::Pass(payload) => {
                    req.set_payload(payload);
                    return Ok(service.call(req).await?.map_into_boxed_body());
                }
                Prepared::Answer(answer) => return Ok(req.into_response(answer)),
                Prepared::Claimed(claimed) => claimed,
            };
            req.set_payload(dev::Payload::from(claimed.body().clone()));
            adapter::publish(req.request(), claimed.context());
            // The inner router matches inside `call`, and needs the only reference to the
            // request: nothing here may keep a clone of it.
            let inner = service.call(req);
            let handler = async move {
                let (req, response) = inner.await?.into_parts();
                Ok((response.map_into_boxed_body(), req))
            };
            match claimed.run_local(Served::ThroughRouter, handler).await {
                Ended::Answered(response, req) => Ok(ServiceResponse::new(req, response)),
                Ended::Failed(error) => Err(error),
                Ended::Panicked(response) => {
                    Err(adapter::failed("the idempotent handler panicked", response))
                }
            }
        };
        Box::pin(steps)
    }
}
