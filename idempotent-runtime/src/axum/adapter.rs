//! axum's half of the adapter: its request head in the sequence's terms (an [`HttpHead`] with
//! axum's matched route, path parameters and peer address, for
//! [`adapter::http::prepare`](crate::adapter::http::prepare)), its body as an [`HttpBody`],
//! and the glue every axum entry point shares.

use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::extract::{ConnectInfo, FromRequestParts, MatchedPath, RawPathParams};
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::request::Parts;

use crate::adapter::http::{HttpBody, HttpHead};

impl HttpBody for Body {
    fn wrap<T>(body: T) -> Self
    where
        T: http_body::Body<Data = Bytes, Error = axum::Error> + Send + 'static,
    {
        Body::new(body)
    }
}

/// The request's head as the sequence reads it, borrowing the path parameters [`params`] read.
pub(crate) fn head<'a>(parts: &'a Parts, params: &'a Option<RawPathParams>) -> HttpHead<'a> {
    let extensions = &parts.extensions;
    let route = extensions.get::<MatchedPath>().map(MatchedPath::as_str);
    let params = params.iter().flat_map(|p| p.iter().map(|(_, v)| v));
    HttpHead::new(parts, route, params.collect(), peer(extensions))
}

/// The path parameters, read from the router's extension (ready at once).
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

/// The matched route of a request, `""` outside one.
pub(crate) fn route_of(extensions: &http::Extensions) -> &str {
    extensions
        .get::<MatchedPath>()
        .map_or("", MatchedPath::as_str)
}

/// The fix to log when a handler finds no [`Idempotency`](crate::Idempotency) handle in the request extensions.
pub(crate) const HANDLE_MISSING_FIX: &str =
    "add `.layer(Extension(idempotency))` to the router, or take it from the state (FromRef)";
