//! axum's half of the adapter: its request head in the sequence's terms (an
//! [`HttpHead`](crate::adapter::http::HttpHead) with axum's matched route, path parameters and
//! peer address), its body as an [`HttpBody`], and the glue every axum entry point shares.

use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::extract::{ConnectInfo, FromRequestParts, MatchedPath, RawPathParams, Request};
use axum::response::Response;
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::request::Parts;

use crate::Idempotency;
use crate::adapter;
use crate::adapter::http::{HttpBody, HttpHead};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;

impl HttpBody for Body {
    fn wrap<T>(body: T) -> Self
    where
        T: http_body::Body<Data = Bytes, Error = axum::Error> + Send + 'static,
    {
        Body::new(body)
    }
}

/// The request's head as the sequence reads it. The path parameters are read from the
/// router's extension (ready at once) into `params`, which the head borrows.
pub(crate) fn head<'a>(parts: &'a Parts, params: &'a Option<RawPathParams>) -> HttpHead<'a> {
    let extensions = &parts.extensions;
    let route = extensions.get::<MatchedPath>().map(MatchedPath::as_str);
    let params = params.iter().flat_map(|p| p.iter().map(|(_, v)| v));
    HttpHead::new(parts, route, params.collect(), peer(extensions))
}

pub(crate) fn params(parts: &mut Parts) -> Option<RawPathParams> {
    let params = RawPathParams::from_request_parts(parts, &()).now_or_never();
    params.and_then(Result::ok)
}

/// The connection's peer address; `MockConnectInfo` (tests) counts, as for axum's own extractor.
fn peer(extensions: &http::Extensions) -> Option<IpAddr> {
    let connected = extensions.get::<ConnectInfo<SocketAddr>>();
    let mock = || {
        extensions
            .get::<MockConnectInfo<SocketAddr>>()
            .map(|m| m.0.ip())
    };
    connected.map(|ConnectInfo(addr)| addr.ip()).or_else(mock)
}

/// Takes the request apart for [`adapter::prepare`] (key, body, scope, claim) and puts it back
/// together, with the buffered body and the context when the key is held; `Err` is the answer
/// instead of the handler's.
pub(crate) async fn prepare(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: Request,
) -> Result<(Request, Option<adapter::Claimed>), Response> {
    let (mut parts, body) = request.into_parts();
    let params = params(&mut parts);
    let prepared = adapter::prepare(handle, endpoint, &head(&parts, &params), body).await;
    match prepared {
        adapter::Prepared::Pass(body) => Ok((Request::from_parts(parts, body), None)),
        adapter::Prepared::Answer(answer) => Err(answer),
        adapter::Prepared::Claimed(claimed) => {
            let body = rebuilt(&mut parts, claimed.context(), claimed.body());
            Ok((Request::from_parts(parts, body), Some(claimed)))
        }
    }
}

/// The claimed request's body, its context put in the extensions.
fn rebuilt(parts: &mut Parts, context: Option<&IdempotencyContext>, body: &Bytes) -> Body {
    if let Some(context) = context {
        parts.extensions.insert(context.clone());
    }
    Body::from(body.clone())
}

/// [`prepare`] in enlisted mode: the claim inside the transaction the handler writes through.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) async fn prepare_enlisted<DB: crate::enlisted::Enlistable>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: Request,
) -> Result<(Request, adapter::ClaimedTx<DB>), Response> {
    let (mut parts, body) = request.into_parts();
    let params = params(&mut parts);
    let head = head(&parts, &params);
    let claimed = adapter::prepare_enlisted(handle, endpoint, &head, body).await?;
    drop(head);
    let body = rebuilt(&mut parts, claimed.context(), claimed.body());
    Ok((Request::from_parts(parts, body), claimed))
}

/// The matched route of a request, `""` outside one.
pub(crate) fn route_of(extensions: &http::Extensions) -> &str {
    extensions
        .get::<MatchedPath>()
        .map_or("", MatchedPath::as_str)
}

/// The fix to log when a handler finds no [`Idempotency`] handle in the request extensions.
pub(crate) const HANDLE_MISSING_FIX: &str =
    "add `.layer(Extension(idempotency))` to the router, or take it from the state (FromRef)";
