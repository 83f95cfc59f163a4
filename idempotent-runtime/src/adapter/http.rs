//! What every adapter over the [`http`] crate's types shares (axum here; a hyper, tonic or
//! poem adapter the same way): [`Head`] over a request's [`Parts`](http::request::Parts)
//! ([`HttpHead`]), [`Chunks`] over any body that implements [`HttpBody`] (trailers kept when a
//! response is recorded), and [`Reply`] for `http::Response<B>`, trailers included. An adapter
//! over such a framework implements [`HttpBody`] for its body type (one constructor),
//! finds the route, the path parameters and the peer address its framework's way, and takes
//! a whole `http::Request` through [`prepare`] (or [`prepare_enlisted`]).

use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, request};
use http_body::{Frame, SizeHint};

use super::{Chunks, Claimed, Head, Prepared, Reply};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::scope::Identity;
use crate::store::RecordedResponse;
use crate::{Idempotency, REPLAYED_HEADER};

/// A request head as the sequence reads it: the request's parts, and what the framework
/// knows of it (the matched route pattern, the decoded path parameters in pattern order, the
/// connection's peer address). The caller's [`Identity`] is read from the parts' extensions.
#[derive(Debug)]
pub struct HttpHead<'a> {
    parts: &'a request::Parts,
    route: Option<&'a str>,
    params: Vec<&'a str>,
    peer: Option<IpAddr>,
    known: Known<'a>,
}

impl<'a> HttpHead<'a> {
    /// The head of the request whose parts are `parts`.
    pub fn new(
        parts: &'a request::Parts,
        route: Option<&'a str>,
        params: Vec<&'a str>,
        peer: Option<IpAddr>,
    ) -> Self {
        Self {
            parts,
            route,
            params,
            peer,
            known: Known::of(&parts.headers),
        }
    }
}

/// The headers every keyed request reads (the key, the body's type and length, the credential
/// and the forwarded address), found in one pass over the request's headers: a lookup by name
/// hashes the name and probes the map, and a request made five of them.
#[derive(Debug, Default)]
struct Known<'a> {
    /// The first line of each of [`KNOWN_NAMES`], in its order.
    first: [Option<&'a HeaderValue>; KNOWN_NAMES.len()],
    /// Which of them have more lines than one: those are read from the map, every line.
    repeated: u8,
}

/// The names [`Known`] keeps, as the `&str`s a lookup is asked for.
const KNOWN_NAMES: [&str; 5] = [
    crate::key::HEADER_NAME,
    "content-type",
    "content-length",
    "authorization",
    "x-forwarded-for",
];

/// [`KNOWN_NAMES`] as `HeaderName`s, made at compile time: the pass compares the request's
/// names with these (a standard name is an enum, compared as one), and the map is looked up
/// by them (by `&str`, a lookup parses and lowercases the name first, which costs more than
/// the lookup itself).
static KNOWN: [HeaderName; KNOWN_NAMES.len()] = [
    HeaderName::from_static(KNOWN_NAMES[0]),
    HeaderName::from_static(KNOWN_NAMES[1]),
    HeaderName::from_static(KNOWN_NAMES[2]),
    HeaderName::from_static(KNOWN_NAMES[3]),
    HeaderName::from_static(KNOWN_NAMES[4]),
];

impl<'a> Known<'a> {
    fn of(headers: &'a HeaderMap) -> Self {
        let mut known = Self::default();
        for (name, value) in headers {
            if let Some(i) = KNOWN.iter().position(|known| known == name) {
                match known.first[i] {
                    None => known.first[i] = Some(value),
                    Some(_) => known.repeated |= 1 << i,
                }
            }
        }
        known
    }

    fn index(name: &str) -> Option<usize> {
        KNOWN_NAMES.iter().position(|known| *known == name)
    }

    /// The one line of `name`, when it is a known name with at most one line (`Some(None)`:
    /// none); `None` to read the map.
    fn single(&self, name: &str) -> Option<Option<&'a HeaderValue>> {
        let i = Self::index(name)?;
        (self.repeated & (1 << i) == 0).then_some(self.first[i])
    }
}

impl<'a> HttpHead<'a> {
    /// Every line of header `name`, from the map (a known name by its `HeaderName`).
    fn lookup(&self, name: &str) -> http::header::ValueIter<'a, HeaderValue> {
        let headers = &self.parts.headers;
        let values = match Known::index(name) {
            Some(i) => headers.get_all(&KNOWN[i]),
            None => headers.get_all(name),
        };
        values.iter()
    }
}

impl Head for HttpHead<'_> {
    fn method(&self) -> &str {
        self.parts.method.as_str()
    }

    fn route(&self) -> Option<&str> {
        self.route
    }

    fn path_params(&self) -> Vec<&str> {
        self.params.clone()
    }

    fn query(&self) -> Option<&str> {
        self.parts.uri.query()
    }

    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        // A known name with one line at most is answered from the pass `new` made; any other
        // is looked up.
        let (single, all) = match self.known.single(name) {
            Some(single) => (single, None),
            None => (None, Some(self.lookup(name))),
        };
        let values = single.into_iter().chain(all.into_iter().flatten());
        values.map(HeaderValue::as_bytes)
    }

    fn peer(&self) -> Option<IpAddr> {
        self.peer
    }

    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T {
        f(self.parts.extensions.get::<Identity>())
    }
}

/// [`adapter::prepare`](super::prepare) over a whole `http::Request`: takes it apart, reads
/// its head with `head` (from its parts, and from what `read` took from them first: axum's path
/// parameters come from an extractor that needs the parts mutably), runs the steps before the
/// handler, and puts the request back together, with the buffered body and the claimed
/// request's [`IdempotencyContext`] in its extensions when the key is held. `Err` is the
/// answer to send instead of running the handler.
///
/// The request is taken apart when this is called: the future returned keeps its parts once
/// (an `async fn` would keep the request and the parts it was taken apart into).
pub fn prepare<B: HttpBody, P>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: http::Request<B>,
    read: impl FnOnce(&mut request::Parts) -> P,
    head: impl for<'a> FnOnce(&'a request::Parts, &'a P) -> HttpHead<'a>,
) -> impl Future<Output = Result<(http::Request<B>, Option<Claimed>), http::Response<B>>> {
    let (mut parts, body) = request.into_parts();
    let read = read(&mut parts);
    async move {
        let prepared = super::prepare(handle, endpoint, &head(&parts, &read), body).await;
        match prepared {
            Prepared::Pass(body) => Ok((http::Request::from_parts(parts, body), None)),
            Prepared::Answer(answer) => Err(answer),
            Prepared::Claimed(claimed) => {
                let body = rebuilt(&mut parts, claimed.context(), claimed.body());
                Ok((http::Request::from_parts(parts, body), Some(claimed)))
            }
        }
    }
}

/// [`prepare`] in enlisted mode ([`adapter::prepare_enlisted`](super::prepare_enlisted)): the
/// claim inside the transaction the handler then writes through.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn prepare_enlisted<DB: crate::enlisted::Enlistable, B: HttpBody, P>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: http::Request<B>,
    read: impl FnOnce(&mut request::Parts) -> P,
    head: impl for<'a> FnOnce(&'a request::Parts, &'a P) -> HttpHead<'a>,
) -> Result<(http::Request<B>, super::ClaimedTx<DB>), http::Response<B>> {
    let (mut parts, body) = request.into_parts();
    let read = read(&mut parts);
    let head = head(&parts, &read);
    let claimed = super::prepare_enlisted(handle, endpoint, &head, body).await?;
    drop(head);
    let body = rebuilt(&mut parts, claimed.context(), claimed.body());
    Ok((http::Request::from_parts(parts, body), claimed))
}

/// The claimed request's body, its context put in the extensions.
fn rebuilt<B: HttpBody>(
    parts: &mut request::Parts,
    context: Option<&IdempotencyContext>,
    body: &Bytes,
) -> B {
    if let Some(context) = context {
        parts.extensions.insert(context.clone());
    }
    B::from(body.clone())
}

/// A framework's body type over the [`http_body`] traits, as the sequence reads and rebuilds
/// it: from bytes (a recorded or replayed body), or wrapping another body (the rest of a
/// stream, a body followed by its trailers). Implementing it gives the type [`Chunks`], and
/// `http::Response<Self>` [`Reply`].
pub trait HttpBody:
    http_body::Body<Data = Bytes, Error: Send + 'static> + From<Bytes> + Unpin + Send + Sized + 'static
{
    /// `body` as this type.
    fn wrap<T>(body: T) -> Self
    where
        T: http_body::Body<Data = Bytes, Error = Self::Error> + Send + 'static;
}

/// The next data frame of `body`; trailers go to `trailers` (or are skipped), empty chunks
/// are skipped.
fn poll_data<B: HttpBody>(
    body: &mut B,
    cx: &mut Context<'_>,
    mut trailers: Option<&mut Vec<(String, Bytes)>>,
) -> Poll<Option<Result<Bytes, B::Error>>> {
    loop {
        let frame = match ready!(Pin::new(&mut *body).poll_frame(cx)) {
            None => return Poll::Ready(None),
            Some(Err(error)) => return Poll::Ready(Some(Err(error))),
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
            Ok(_empty) => {}
            Err(frame) => {
                if let (Some(kept), Ok(map)) = (trailers.as_deref_mut(), frame.into_trailers()) {
                    kept.extend(map.iter().map(|(name, value)| {
                        let value = Bytes::copy_from_slice(value.as_bytes());
                        (name.as_str().to_owned(), value)
                    }));
                }
            }
        }
    }
}

impl<B: HttpBody> Chunks for B {
    type Error = B::Error;

    fn exact_len(&self) -> Option<u64> {
        self.size_hint().exact()
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, B::Error>>> {
        poll_data(self, cx, None)
    }

    fn poll_chunk_keeping(
        &mut self,
        cx: &mut Context<'_>,
        trailers: &mut Vec<(String, Bytes)>,
    ) -> Poll<Option<Result<Bytes, B::Error>>> {
        poll_data(self, cx, Some(trailers))
    }
}

/// A body, then its trailers as a last frame: how a response with trailers is rebuilt after
/// its body was read (to record it) or replayed.
struct Trailing<B> {
    body: B,
    trailers: Option<HeaderMap>,
}

impl<B: HttpBody> http_body::Body for Trailing<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
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

/// Each pair whose name and value are valid in HTTP, appended to `map`.
fn append<'a>(map: &mut HeaderMap, pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) {
    for (name, value) in pairs {
        let name = HeaderName::from_bytes(name.as_bytes());
        let value = HeaderValue::from_bytes(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
}

impl<B: HttpBody> Reply for http::Response<B> {
    type Head = http::response::Parts;
    type Body = B;

    fn status(&self) -> u16 {
        self.status().as_u16()
    }

    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        let headers = self.headers().iter();
        headers.map(|(name, value)| (name.as_str(), value.as_bytes()))
    }

    fn into_parts(self) -> (Self::Head, B) {
        http::Response::into_parts(self)
    }

    fn from_parts(head: Self::Head, body: B) -> Self {
        http::Response::from_parts(head, body)
    }

    fn recorded(head: Self::Head, bytes: Bytes, _drained: B) -> Self {
        http::Response::from_parts(head, B::from(bytes))
    }

    fn resumed(head: Self::Head, read: Bytes, error: Option<B::Error>, rest: B) -> Self {
        let read = futures_util::stream::iter([Ok(Frame::data(read))]);
        let error = futures_util::stream::iter(error.map(Err));
        // Frames, not data: the rest's trailers go on too.
        let rest = http_body_util::BodyStream::new(rest);
        let frames = http_body_util::StreamBody::new(read.chain(error).chain(rest));
        http::Response::from_parts(head, B::wrap(frames))
    }

    fn with_trailers(self, trailers: &[(String, Bytes)]) -> Self {
        if trailers.is_empty() {
            return self;
        }
        let mut map = HeaderMap::with_capacity(trailers.len());
        append(&mut map, trailers.iter().map(|(n, v)| (n.as_str(), &v[..])));
        let (head, body) = http::Response::into_parts(self);
        let trailers = Some(map);
        http::Response::from_parts(head, B::wrap(Trailing { body, trailers }))
    }

    /// The recorded values are sent as they are: each is a `Bytes` already (often a view of the
    /// store's one copy of the answer), so it is checked, not copied.
    fn replay(recorded: &RecordedResponse) -> Self {
        let mut response = http::Response::new(B::from(recorded.body.clone()));
        *response.status_mut() = StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::OK);
        let headers = response.headers_mut();
        for (name, value) in &recorded.headers {
            let name = HeaderName::from_bytes(name.as_bytes());
            let value = HeaderValue::from_maybe_shared(value.clone());
            if let (Ok(name), Ok(value)) = (name, value) {
                headers.append(name, value);
            }
        }
        response.with_trailers(&recorded.trailers).mark_replayed()
    }

    fn mark_replayed(mut self) -> Self {
        // Checked once, at compile time, rather than at every replay.
        static NAME: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
        static TRUE: HeaderValue = HeaderValue::from_static("true");
        self.headers_mut().insert(NAME.clone(), TRUE.clone());
        self
    }

    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self {
        let mut response = http::Response::new(B::from(body));
        *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        append(response.headers_mut(), headers);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_answers_every_line_of_a_header_in_order_whether_kept_or_looked_up() {
        let request = http::Request::post("/orders")
            .header("content-type", "application/json")
            .header("idempotency-key", "k-1")
            .header("x-request-id", "r-1")
            .header("content-type", "charset=utf-8")
            .header("X-Forwarded-For", "203.0.113.7")
            .header("x-forwarded-for", "198.51.100.2")
            .body(())
            .expect("a request");
        let (parts, ()) = request.into_parts();
        let head = HttpHead::new(&parts, Some("/orders"), Vec::new(), None);
        let lines = |name| head.header_values(name).collect::<Vec<_>>();
        assert_eq!(lines("idempotency-key"), [b"k-1"]);
        assert_eq!(
            lines("content-type"),
            [&b"application/json"[..], b"charset=utf-8"],
            "a header with two lines: both, in order"
        );
        assert_eq!(
            lines("x-forwarded-for"),
            [&b"203.0.113.7"[..], b"198.51.100.2"]
        );
        assert_eq!(
            lines("x-request-id"),
            [b"r-1"],
            "a name the pass does not keep"
        );
        assert!(lines("authorization").is_empty());
        assert!(lines("content-length").is_empty());
        assert!(lines("cookie").is_empty());
    }
}
