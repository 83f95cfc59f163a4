//! axum's half of the pipeline: its request head, bodies and responses in the pipeline's terms
//! ([`Head`], [`Chunks`], [`Reply`]), and the glue every axum entry point shares.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::extract::{ConnectInfo, FromRequestParts, MatchedPath, RawPathParams, Request};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use http_body::{Body as _, Frame, SizeHint};

use crate::adapter::{self, Chunks, Ended, Head, REPLAYED_HEADER, Reply, Served};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::handle::Idempotency;
use crate::problem::Problem;
use crate::scope::{Identity, Scope};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(crate::key::HEADER_NAME);
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// A request head as the pipeline reads it.
struct AxumHead<'a> {
    parts: &'a Parts,
    params: Option<RawPathParams>,
    /// Read once: every step asks for it, and each read is an extension lookup.
    route: Option<&'a str>,
}

impl<'a> AxumHead<'a> {
    fn new(parts: &'a mut Parts) -> Self {
        // Ready at once: it only reads the router's extension.
        let params = RawPathParams::from_request_parts(parts, &())
            .now_or_never()
            .and_then(Result::ok);
        let parts: &'a Parts = parts;
        let route = parts
            .extensions
            .get::<MatchedPath>()
            .map(MatchedPath::as_str);
        Self {
            parts,
            params,
            route,
        }
    }
}

impl Head for AxumHead<'_> {
    fn method(&self) -> &str {
        self.parts.method.as_str()
    }

    fn route(&self) -> Option<&str> {
        self.route
    }

    fn path_params(&self) -> Vec<&str> {
        self.params
            .iter()
            .flat_map(|p| p.iter().map(|(_, v)| v))
            .collect()
    }

    fn query(&self) -> Option<&str> {
        self.parts.uri.query()
    }

    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let headers = &self.parts.headers;
        // The names every keyed request looks up, as `HeaderName`s: a lookup by `&str` parses
        // and lowercases the name first, which cost more than the lookup itself.
        let values = match name {
            crate::key::HEADER_NAME => headers.get_all(IDEMPOTENCY_KEY),
            "content-type" => headers.get_all(http::header::CONTENT_TYPE),
            "content-length" => headers.get_all(http::header::CONTENT_LENGTH),
            "authorization" => headers.get_all(http::header::AUTHORIZATION),
            "x-forwarded-for" => headers.get_all(X_FORWARDED_FOR),
            _ => headers.get_all(name),
        };
        values.iter().map(HeaderValue::as_bytes)
    }

    fn peer(&self) -> Option<IpAddr> {
        // `MockConnectInfo` (tests) counts as a peer address, as for axum's own extractor.
        let extensions = &self.parts.extensions;
        extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip())
            .or_else(|| {
                let MockConnectInfo(addr) = extensions.get::<MockConnectInfo<SocketAddr>>()?;
                Some(addr.ip())
            })
    }

    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T {
        f(self.parts.extensions.get::<Identity>())
    }
}

impl Chunks for Body {
    type Error = axum::Error;

    fn exact_len(&self) -> Option<u64> {
        self.size_hint().exact()
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>> {
        loop {
            match ready!(Pin::new(&mut *self).poll_frame(cx)) {
                None => return Poll::Ready(None),
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                    // Trailers and empty chunks carry no body bytes.
                    _ => {}
                },
            }
        }
    }

    fn poll_chunk_keeping(
        &mut self,
        cx: &mut Context<'_>,
        trailers: &mut Vec<(String, Bytes)>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        loop {
            match ready!(Pin::new(&mut *self).poll_frame(cx)) {
                None => return Poll::Ready(None),
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                    Ok(_empty) => {}
                    Err(frame) => {
                        if let Ok(map) = frame.into_trailers() {
                            trailers.extend(map.iter().map(|(name, value)| {
                                let value = Bytes::copy_from_slice(value.as_bytes());
                                (name.as_str().to_owned(), value)
                            }));
                        }
                    }
                },
            }
        }
    }
}

/// A body, then its trailers as a last frame: how a response with trailers is rebuilt after
/// its body was read (to record it) or replayed.
struct Trailing {
    body: Body,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for Trailing {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            Some(frame) => Poll::Ready(Some(frame)),
            None => Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.trailers.is_none() && self.body.is_end_stream()
    }

    /// Never exact while trailers are to come: a server sends an HTTP/1.1 body of known length
    /// with `content-length`, which leaves no place for trailers.
    fn size_hint(&self) -> SizeHint {
        match self.trailers {
            None => self.body.size_hint(),
            Some(_) => {
                let mut hint = SizeHint::new();
                hint.set_lower(self.body.size_hint().lower());
                hint
            }
        }
    }
}

impl Reply for Response {
    type Head = http::response::Parts;
    type Body = Body;

    fn status(&self) -> u16 {
        self.status().as_u16()
    }

    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.headers()
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
    }

    fn into_parts(self) -> (Self::Head, Body) {
        Response::into_parts(self)
    }

    fn from_parts(head: Self::Head, body: Body) -> Self {
        Response::from_parts(head, body)
    }

    fn recorded(head: Self::Head, bytes: Bytes, _drained: Body) -> Self {
        Response::from_parts(head, Body::from(bytes))
    }

    fn resumed(head: Self::Head, read: Bytes, error: Option<axum::Error>, rest: Body) -> Self {
        let read = futures_util::stream::iter([Ok(Frame::data(read))]);
        let error = futures_util::stream::iter(error.map(Err));
        // Frames, not data: the rest's trailers go on too.
        let rest = http_body_util::BodyStream::new(rest);
        let frames = http_body_util::StreamBody::new(read.chain(error).chain(rest));
        Response::from_parts(head, Body::new(frames))
    }

    fn with_trailers(self, trailers: &[(String, Bytes)]) -> Self {
        if trailers.is_empty() {
            return self;
        }
        let mut map = HeaderMap::with_capacity(trailers.len());
        for (name, value) in trailers {
            let name = HeaderName::from_bytes(name.as_bytes());
            let value = HeaderValue::from_bytes(value);
            if let (Ok(name), Ok(value)) = (name, value) {
                map.append(name, value);
            }
        }
        let (head, body) = Response::into_parts(self);
        let body = Trailing {
            body,
            trailers: Some(map),
        };
        Response::from_parts(head, Body::new(body))
    }

    fn mark_replayed(mut self) -> Self {
        self.headers_mut().insert(
            HeaderName::from_static(REPLAYED_HEADER),
            HeaderValue::from_static("true"),
        );
        self
    }

    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self {
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        for (name, value) in headers {
            let name = HeaderName::from_bytes(name.as_bytes());
            let value = HeaderValue::from_bytes(value);
            if let (Ok(name), Ok(value)) = (name, value) {
                response.headers_mut().append(name, value);
            }
        }
        response
    }
}

/// The caller's scope exactly as the pipeline resolves it for this request (the one function
/// both call), or the pipeline's refusal when it cannot be resolved.
pub(crate) fn caller_scope(handle: &Idempotency, parts: &mut Parts) -> Result<Scope, Problem> {
    adapter::caller_scope(handle, &AxumHead::new(parts))
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
    let prepared = adapter::prepare(handle, endpoint, &AxumHead::new(&mut parts), body).await;
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
#[cfg(feature = "postgres")]
pub(crate) async fn prepare_enlisted(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: Request,
) -> Result<(Request, adapter::ClaimedTx), Response> {
    let (mut parts, body) = request.into_parts();
    let head = AxumHead::new(&mut parts);
    let claimed = adapter::prepare_enlisted(handle, endpoint, &head, body).await?;
    drop(head);
    let body = rebuilt(&mut parts, claimed.context(), claimed.body());
    Ok((Request::from_parts(parts, body), claimed))
}

/// Runs a claimed handler where no disconnect cancels it and records or releases its response.
pub(crate) async fn run_claimed<F>(
    claimed: adapter::Claimed,
    served: Served,
    handler: F,
) -> Response
where
    F: Future<Output = Response> + Send + 'static,
{
    let handler = handler.map(|response| Ok::<_, Infallible>((response, ())));
    match claimed.run(served, handler).await {
        Ended::Answered(response, ()) | Ended::Panicked(response) => response,
        Ended::Failed(never) => match never {},
    }
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
