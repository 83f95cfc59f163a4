//! actix-web's half of the pipeline: its request head, bodies and responses in the pipeline's
//! terms ([`Head`], [`Chunks`], [`Reply`]), and the glue the attribute and the middleware share.

use std::error::Error as StdError;
use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::error::{InternalError, PayloadError};
use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};
use bytes::Bytes;
use futures_util::Stream;

use crate::Idempotency;
use crate::REPLAYED_HEADER;
use crate::adapter::{Chunks, Head, Reply, Resumed};
use crate::context::IdempotencyContext;
use crate::scope::Identity;

/// A request head as the pipeline reads it: the request, with its matched route and decoded
/// path parameters (which the middleware, running before the router, finds itself).
pub(crate) struct ActixHead<'a> {
    pub(crate) req: &'a HttpRequest,
    pub(crate) route: Option<String>,
    pub(crate) params: Vec<String>,
}

impl<'a> ActixHead<'a> {
    /// For a request whose resource has been matched (inside a handler).
    pub(crate) fn matched(req: &'a HttpRequest) -> Self {
        let (route, params) = (req.match_pattern(), decoded(req.match_info()));
        Self { req, route, params }
    }
}

/// The decoded path parameters `pattern` captures in the request's path, for the middleware,
/// which runs before the router matched it.
pub(crate) fn captured(req: &dev::ServiceRequest, pattern: &dev::ResourceDef) -> Vec<String> {
    let mut path = req.match_info().clone();
    path.reset();
    if pattern.capture_match_info(&mut path) {
        decoded(&path)
    } else {
        Vec::new()
    }
}

/// The path parameters' values, percent-decoded as the fingerprint reads them.
pub(crate) fn decoded(path: &dev::Path<dev::Url>) -> Vec<String> {
    let values = path
        .iter()
        .map(|(_, v)| crate::adapter::decode_path_param(v));
    values.map(std::borrow::Cow::into_owned).collect()
}

impl Head for ActixHead<'_> {
    fn method(&self) -> &str {
        self.req.method().as_str()
    }

    fn route(&self) -> Option<&str> {
        self.route.as_deref()
    }

    fn path_params(&self) -> Vec<&str> {
        self.params.iter().map(String::as_str).collect()
    }

    fn query(&self) -> Option<&str> {
        self.req.uri().query()
    }

    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.req.headers().get_all(name).map(HeaderValue::as_bytes)
    }

    fn peer(&self) -> Option<IpAddr> {
        self.req.peer_addr().map(|addr| addr.ip())
    }

    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T {
        f(self.req.extensions().get::<Identity>())
    }
}

impl Chunks for dev::Payload {
    type Error = PayloadError;

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, PayloadError>>> {
        Pin::new(self).poll_next(cx)
    }
}

/// actix-web's response bodies have no trailers: the default `poll_chunk_keeping` keeps none, so
/// an actix answer is recorded and replayed without any.
impl Chunks for BoxBody {
    type Error = Box<dyn StdError>;

    fn exact_len(&self) -> Option<u64> {
        match self.size() {
            BodySize::None => Some(0),
            BodySize::Sized(len) => Some(len),
            BodySize::Stream => None,
        }
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Pin::new(self).poll_next(cx)
    }
}

impl Reply for HttpResponse {
    type Head = HttpResponse<()>;
    type Body = BoxBody;

    fn status(&self) -> u16 {
        HttpResponse::status(self).as_u16()
    }

    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        HttpResponse::headers(self)
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
    }

    fn into_parts(self) -> (Self::Head, BoxBody) {
        HttpResponse::into_parts(self)
    }

    fn from_parts(head: Self::Head, body: BoxBody) -> Self {
        head.set_body(body)
    }

    fn recorded(head: Self::Head, bytes: Bytes, drained: BoxBody) -> Self {
        // "No body" (a 204, say) stays without one, rather than becoming an empty body.
        if matches!(drained.size(), BodySize::None) {
            head.set_body(drained)
        } else {
            head.set_body(BoxBody::new(bytes))
        }
    }

    fn resumed(
        head: Self::Head,
        read: Bytes,
        error: Option<Box<dyn StdError>>,
        rest: BoxBody,
    ) -> Self {
        head.set_body(BoxBody::new(Resumed::new(read, error, rest)))
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
        let mut builder =
            HttpResponse::build(StatusCode::from_u16(status).unwrap_or(StatusCode::OK));
        for (name, value) in headers {
            let name = HeaderName::from_bytes(name.as_bytes());
            let value = HeaderValue::from_bytes(value);
            if let (Ok(name), Ok(value)) = (name, value) {
                builder.append_header((name, value));
            }
        }
        builder.body(body)
    }
}

/// A resumed response body is a stream of its own.
impl MessageBody for Resumed<BoxBody> {
    type Error = Box<dyn StdError>;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        self.get_mut().poll_chunk(cx)
    }
}

/// The claimed request's context, in the extensions for the handler's own extractors too.
pub(crate) fn publish(
    req: &HttpRequest,
    context: Option<&IdempotencyContext>,
) -> Option<IdempotencyContext> {
    let context = context.cloned();
    if let Some(context) = &context {
        req.extensions_mut().insert(context.clone());
    }
    context
}

/// `response` as the error actix-web's extractors and services fail with (`message` is what
/// actix logs).
pub(crate) fn failed(message: &'static str, response: HttpResponse) -> actix_web::Error {
    InternalError::from_response(message, response).into()
}

/// The handle registered as application data (`web::Data<Idempotency>`, or a plain
/// `Idempotency` through `app_data`).
pub(crate) fn handle_of(req: &HttpRequest) -> Option<Idempotency> {
    req.app_data::<web::Data<Idempotency>>()
        .map(|data| Idempotency::clone(data))
        .or_else(|| req.app_data::<Idempotency>().cloned())
}

/// The fix to log when no [`Idempotency`] handle is registered.
pub(crate) const HANDLE_MISSING_FIX: &str = "register it once, outside the HttpServer factory: \
    `let idempotency = web::Data::new(Idempotency::memory());` then \
    `App::new().app_data(idempotency.clone())`";
