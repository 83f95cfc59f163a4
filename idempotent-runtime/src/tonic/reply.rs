//! A unary call's answer as the sequence records and replays it.
//!
//! gRPC answers every call with HTTP 200 and puts its status in the trailers (or, for an
//! answer without a message, in the headers: "trailers-only"). The sequence decides what to
//! record by the answer's status before it reads the body, so the layer reads the answer first
//! (a unary answer is one message, bounded by `max_response`), and this type tells the
//! sequence 200 for a gRPC status the method records and 500 for one it does not. What is
//! recorded is HTTP's: status 200, the allowlisted metadata, the framed message, and the
//! trailers (`grpc-status`, `grpc-message`, `grpc-status-details-bin` always; others through
//! the allowlist). An answer without a message is sent back trailers-only, as tonic sends it.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

/// What tonic's bodies and services fail with.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

use bytes::{Buf as _, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body as _, Frame};

use super::request::{FRAME_HEADER, frame};
use crate::REPLAYED_HEADER;
use crate::adapter::{Chunks, Reply};
use crate::problem::{Problem, ProblemCode, RenderedRefusal};

const GRPC_STATUS: &str = "grpc-status";
const GRPC_ENCODING: &str = "grpc-encoding";

/// The status the sequence sees for an answer it records / releases.
const RECORDED: u16 = 200;
const RELEASED: u16 = 500;

/// A unary call's answer: a gRPC response read in full (or, when it could not be, its first
/// part and the rest of its stream), or a refusal or replay built by the sequence.
pub(crate) struct GrpcReply {
    head: GrpcHead,
    body: GrpcBody,
}

/// Everything but the body: the HTTP head and what the sequence is told of the status.
pub(crate) struct GrpcHead {
    parts: http::response::Parts,
    status: u16,
}

/// An answer's body: read in full, with its trailers, or still streaming.
pub(crate) enum GrpcBody {
    /// The framed message (empty for none) and the trailers that follow it.
    Full {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// A body that goes on as a stream (past the cap, or a method that streams answers).
    Stream(::tonic::body::Body),
}

impl GrpcReply {
    /// The HTTP response tonic's server sends.
    pub(crate) fn into_http(self) -> http::Response<::tonic::body::Body> {
        let GrpcHead { mut parts, .. } = self.head;
        let body = match self.body {
            GrpcBody::Stream(body) => body,
            GrpcBody::Full { data, trailers } if data.is_empty() => {
                // No message: trailers-only, the status in the headers.
                if let Some(trailers) = trailers {
                    extend(&mut parts.headers, trailers);
                }
                ::tonic::body::Body::empty()
            }
            GrpcBody::Full { data, trailers } => ::tonic::body::Body::new(Trailing {
                data: Some(data),
                trailers,
            }),
        };
        http::Response::from_parts(parts, body)
    }

    fn new(parts: http::response::Parts, status: u16, body: GrpcBody) -> Self {
        Self {
            head: GrpcHead { parts, status },
            body,
        }
    }
}

/// Why an answer was not read in full (`None`: it was).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Partial {
    TooLarge,
    Streams,
    Broken,
}

/// Reads a unary answer, up to `cap` bytes with its frame: read in full it becomes an answer the
/// sequence records when `records(code)`; otherwise what was read goes on with the rest of
/// the stream, released.
pub(crate) async fn read_answer<B>(
    response: http::Response<B>,
    cap: usize,
    records: impl Fn(::tonic::Code) -> bool,
) -> (GrpcReply, Option<Partial>)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    let mut body = ::tonic::body::Body::new(body);
    if let Some(code) = code_in(&parts.headers) {
        // Trailers-only: the status and its metadata are the headers. They are recorded as
        // trailers (so `grpc-status` always is, and the rest through the allowlist) and sent
        // back in the headers again.
        let content_type = parts.headers.remove(http::header::CONTENT_TYPE);
        let trailers = std::mem::take(&mut parts.headers);
        if let Some(content_type) = content_type {
            parts
                .headers
                .insert(http::header::CONTENT_TYPE, content_type);
        }
        let status = if records(code) { RECORDED } else { RELEASED };
        let full = GrpcBody::Full {
            data: Bytes::new(),
            trailers: Some(trailers),
        };
        drop(body);
        return (GrpcReply::new(parts, status, full), None);
    }
    let mut data = BytesMut::new();
    let partial = |parts, data: BytesMut, error: Option<::tonic::Status>, rest, why| {
        let read = Frame::data(data.freeze());
        let frames = futures_util::stream::iter(std::iter::once(Ok(read)).chain(error.map(Err)));
        let rest = http_body_util::BodyStream::new(rest);
        let stream = futures_util::StreamExt::chain(frames, rest);
        let body = ::tonic::body::Body::new(http_body_util::StreamBody::new(stream));
        let reply = GrpcReply::new(parts, RELEASED, GrpcBody::Stream(body));
        (reply, Some(why))
    };
    let trailers = loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => break None,
            Some(Err(status)) => {
                return partial(parts, data, Some(status), body, Partial::Broken);
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(chunk) => {
                    data.extend_from_slice(&chunk);
                    // `max_response` counts the framed answer; past it the key is released
                    // whatever `oversized` says: a gRPC answer without its message is no answer.
                    if data.len() > cap {
                        return partial(parts, data, None, body, Partial::TooLarge);
                    }
                    if frames_past_one(&data) {
                        return partial(parts, data, None, body, Partial::Streams);
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        break Some(trailers);
                    }
                }
            },
        }
    };
    // A body that ends without a status is a broken answer (tonic's client says so).
    let code = trailers.as_ref().and_then(code_in);
    let mut data = data.freeze();
    let compressed = data.first() == Some(&1);
    let whole = data.is_empty() || one_frame(&data);
    let mut recordable = whole && code.is_some_and(&records);
    if recordable && compressed {
        // Recorded as the message itself, so a replay needs no encoding the retrying client
        // may not accept; the first answer goes out uncompressed too.
        let gzip = parts.headers.get(GRPC_ENCODING).map(HeaderValue::as_bytes) == Some(b"gzip");
        let room = cap.saturating_sub(FRAME_HEADER);
        match inflate(&data[FRAME_HEADER..], room).filter(|_| gzip) {
            Some(message) => {
                data = frame(&message);
                parts.headers.remove(GRPC_ENCODING);
            }
            None => recordable = false,
        }
    }
    let status = if recordable { RECORDED } else { RELEASED };
    let reply = GrpcReply::new(parts, status, GrpcBody::Full { data, trailers });
    (reply, None)
}

/// Whether `data` is exactly one frame.
fn one_frame(data: &[u8]) -> bool {
    data.len() >= FRAME_HEADER
        && data.len()
            == FRAME_HEADER + u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize
}

/// A gzip-compressed message inflated, if it is one and fits `cap`.
fn inflate(compressed: &[u8], cap: usize) -> Option<Vec<u8>> {
    use std::io::Read as _;
    let decoder = flate2::read::GzDecoder::new(compressed);
    let mut message = Vec::new();
    let limit = u64::try_from(cap).unwrap_or(u64::MAX).saturating_add(1);
    decoder.take(limit).read_to_end(&mut message).ok()?;
    (message.len() <= cap).then_some(message)
}

/// Whether `data` holds the start of a second message after a whole first one.
fn frames_past_one(data: &[u8]) -> bool {
    if data.len() < FRAME_HEADER {
        return false;
    }
    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
    data.len() > FRAME_HEADER + len
}

/// The gRPC status in `headers` (the trailers, or a trailers-only answer's headers).
fn code_in(headers: &HeaderMap) -> Option<::tonic::Code> {
    let value = headers.get(GRPC_STATUS)?;
    let code = std::str::from_utf8(value.as_bytes())
        .ok()?
        .trim()
        .parse::<i32>()
        .ok()?;
    Some(::tonic::Code::from_i32(code))
}

fn extend(headers: &mut HeaderMap, more: HeaderMap) {
    let mut name = None;
    for (next, value) in more {
        if let Some(next) = next {
            name = Some(next);
        }
        if let Some(name) = &name {
            headers.append(name.clone(), value);
        }
    }
}

fn append<'a>(map: &mut HeaderMap, pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) {
    for (name, value) in pairs {
        let name = HeaderName::from_bytes(name.as_bytes());
        let value = HeaderValue::from_bytes(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
}

/// The gRPC status of a refusal: the contract's mapping (§1, gRPC).
fn refusal_code(problem: &Problem) -> ::tonic::Code {
    use ::tonic::Code;
    match problem.code() {
        ProblemCode::InProgress => Code::Aborted,
        ProblemCode::KeyReused => Code::FailedPrecondition,
        ProblemCode::KeyRequired | ProblemCode::KeyInvalid | ProblemCode::BodyInvalid => {
            Code::InvalidArgument
        }
        ProblemCode::PayloadTooLarge => Code::ResourceExhausted,
        ProblemCode::BodyTimeout => Code::DeadlineExceeded,
        ProblemCode::StoreUnavailable | ProblemCode::StoreFull => Code::Unavailable,
        // A resolver may refuse with a status of its own (401, 403).
        _ => match problem.status() {
            400 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            408 => Code::DeadlineExceeded,
            409 => Code::Aborted,
            412 | 428 => Code::FailedPrecondition,
            413 | 429 => Code::ResourceExhausted,
            503 => Code::Unavailable,
            _ => Code::Internal,
        },
    }
}

/// A trailers-only answer with this status.
fn trailers_only(status: ::tonic::Status, http_status: u16) -> GrpcReply {
    let response = status.into_http::<()>();
    let (parts, ()) = response.into_parts();
    let empty = GrpcBody::Full {
        data: Bytes::new(),
        trailers: None,
    };
    GrpcReply::new(parts, http_status, empty)
}

impl Reply for GrpcReply {
    type Head = GrpcHead;
    type Body = GrpcBody;

    fn status(&self) -> u16 {
        self.head.status
    }

    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        let headers = self.head.parts.headers.iter();
        headers.map(|(name, value)| (name.as_str(), value.as_bytes()))
    }

    fn into_parts(self) -> (GrpcHead, GrpcBody) {
        (self.head, self.body)
    }

    fn from_parts(head: GrpcHead, body: GrpcBody) -> Self {
        Self { head, body }
    }

    fn recorded(head: GrpcHead, bytes: Bytes, _drained: GrpcBody) -> Self {
        // The trailers follow through `with_trailers`.
        let body = GrpcBody::Full {
            data: bytes,
            trailers: None,
        };
        Self { head, body }
    }

    fn resumed(
        head: GrpcHead,
        read: Bytes,
        error: Option<::tonic::Status>,
        rest: GrpcBody,
    ) -> Self {
        let read = futures_util::stream::iter(
            std::iter::once(Ok(Frame::data(read))).chain(error.map(Err)),
        );
        let rest = http_body_util::BodyStream::new(rest);
        let stream = futures_util::StreamExt::chain(read, rest);
        let body = ::tonic::body::Body::new(http_body_util::StreamBody::new(stream));
        Self {
            head,
            body: GrpcBody::Stream(body),
        }
    }

    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self {
        let mut response = http::Response::new(());
        append(response.headers_mut(), headers);
        let (parts, ()) = response.into_parts();
        let body = GrpcBody::Full {
            data: body,
            trailers: None,
        };
        Self::new(parts, status, body)
    }

    fn problem(problem: &Problem, _rendered: RenderedRefusal) -> Self {
        let code = refusal_code(problem);
        let reason = problem.code().as_str();
        let message = format!("{reason}: {}", problem.detail());
        let details =
            super::details::refusal_details(code as i32, &message, reason, problem.retry_after());
        let status = ::tonic::Status::with_details(code, message, details);
        trailers_only(status, problem.status())
    }

    fn internal(message: &'static str) -> Self {
        trailers_only(::tonic::Status::internal(message), 500)
    }

    fn mark_replayed(mut self) -> Self {
        self.head.parts.headers.insert(
            HeaderName::from_static(REPLAYED_HEADER),
            HeaderValue::from_static("true"),
        );
        self
    }

    fn with_trailers(mut self, sent: &[(String, Bytes)]) -> Self {
        if sent.is_empty() {
            return self;
        }
        let mut map = HeaderMap::with_capacity(sent.len());
        append(&mut map, sent.iter().map(|(n, v)| (n.as_str(), &v[..])));
        self.body = match self.body {
            GrpcBody::Full { data, trailers } => {
                let trailers = match trailers {
                    None => map,
                    Some(mut trailers) => {
                        extend(&mut trailers, map);
                        trailers
                    }
                };
                GrpcBody::Full {
                    data,
                    trailers: Some(trailers),
                }
            }
            stream @ GrpcBody::Stream(_) => stream,
        };
        self
    }
}

impl Chunks for GrpcBody {
    type Error = ::tonic::Status;

    fn exact_len(&self) -> Option<u64> {
        match self {
            Self::Full { data, .. } => Some(data.len() as u64),
            Self::Stream(body) => body.size_hint().exact(),
        }
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>> {
        self.poll_chunk_keeping(cx, &mut Vec::new())
    }

    fn poll_chunk_keeping(
        &mut self,
        cx: &mut Context<'_>,
        kept: &mut Vec<(String, Bytes)>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        match self {
            Self::Full { data, trailers } => {
                if !data.is_empty() {
                    return Poll::Ready(Some(Ok(data.split_to(data.len()))));
                }
                if let Some(trailers) = trailers.take() {
                    kept.extend(trailers.iter().map(|(name, value)| {
                        let value = Bytes::copy_from_slice(value.as_bytes());
                        (name.as_str().to_owned(), value)
                    }));
                }
                Poll::Ready(None)
            }
            Self::Stream(body) => loop {
                let frame = match ready!(Pin::new(&mut *body).poll_frame(cx)) {
                    None => return Poll::Ready(None),
                    Some(Err(status)) => return Poll::Ready(Some(Err(status))),
                    Some(Ok(frame)) => frame,
                };
                match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                    Ok(_) => {}
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            kept.extend(trailers.iter().map(|(name, value)| {
                                let value = Bytes::copy_from_slice(value.as_bytes());
                                (name.as_str().to_owned(), value)
                            }));
                        }
                    }
                }
            },
        }
    }
}

impl http_body::Body for GrpcBody {
    type Data = Bytes;
    type Error = ::tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ::tonic::Status>>> {
        match &mut *self {
            Self::Full { data, trailers } => {
                if data.has_remaining() {
                    let data = data.split_to(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            Self::Stream(body) => Pin::new(body).poll_frame(cx),
        }
    }
}

/// A message, then its trailers.
struct Trailing {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for Trailing {
    type Data = Bytes;
    type Error = ::tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ::tonic::Status>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(problem: &Problem) -> (::tonic::Status, http::HeaderMap) {
        let reply = GrpcReply::problem(problem, RenderedRefusal::problem_json(problem));
        let response = reply.into_http();
        assert!(
            http_body::Body::is_end_stream(response.body()),
            "a refusal is trailers-only"
        );
        let headers = response.headers().clone();
        let status = ::tonic::Status::from_header_map(&headers).expect("a status in the headers");
        (status, headers)
    }

    #[test]
    fn each_refusal_is_its_grpc_status_with_the_code_and_error_info() {
        use ::tonic::Code;
        let cases = [
            (409, ProblemCode::InProgress, Code::Aborted, true),
            (422, ProblemCode::KeyReused, Code::FailedPrecondition, false),
            (400, ProblemCode::KeyRequired, Code::InvalidArgument, false),
            (400, ProblemCode::KeyInvalid, Code::InvalidArgument, false),
            (
                413,
                ProblemCode::PayloadTooLarge,
                Code::ResourceExhausted,
                false,
            ),
            (408, ProblemCode::BodyTimeout, Code::DeadlineExceeded, false),
            (503, ProblemCode::StoreUnavailable, Code::Unavailable, true),
            (503, ProblemCode::StoreFull, Code::Unavailable, true),
            (500, ProblemCode::ScopeUnresolved, Code::Internal, false),
            (
                401,
                ProblemCode::ScopeUnresolved,
                Code::Unauthenticated,
                false,
            ),
            (500, ProblemCode::HandlerPanicked, Code::Internal, false),
            (500, ProblemCode::Misconfigured, Code::Internal, false),
        ];
        for (http_status, problem_code, code, retry) in cases {
            let mut problem = Problem::new(http_status, problem_code, "why");
            if retry {
                problem = problem.with_retry_after(2);
            }
            let (status, headers) = refused(&problem);
            assert_eq!(status.code(), code, "{problem_code:?}");
            assert_eq!(status.message(), format!("{}: why", problem_code.as_str()));
            assert_eq!(headers["content-type"], "application/grpc");
            let details = super::super::details::RpcStatus::from_status(&status).expect("details");
            assert_eq!(details.code, code as i32);
            let info = details.error_info().expect("ErrorInfo");
            assert_eq!(info.reason, problem_code.as_str());
            assert_eq!(info.domain, super::super::ERROR_DOMAIN);
            let delay = details.retry_info().and_then(|r| r.retry_delay);
            assert_eq!(
                delay.map(|d| d.seconds),
                retry.then_some(2),
                "{problem_code:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_trailers_only_answer_is_recorded_as_trailers_and_sent_back_in_the_headers() {
        let status = ::tonic::Status::not_found("no such order");
        let response = status.into_http::<::tonic::body::Body>();
        let (reply, partial) = read_answer(response, 1024, |c| c == ::tonic::Code::NotFound).await;
        assert_eq!(partial, None);
        assert_eq!(reply.status(), RECORDED);
        let names: Vec<_> = reply.headers().map(|(n, _)| n.to_owned()).collect();
        assert_eq!(names, ["content-type"], "the status went to the trailers");
        let (head, mut body) = reply.into_parts();
        let mut kept = Vec::new();
        let end = std::future::poll_fn(|cx| body.poll_chunk_keeping(cx, &mut kept)).await;
        assert!(end.is_none());
        assert!(
            kept.iter()
                .any(|(n, v)| n == "grpc-status" && &v[..] == b"5")
        );
        let again = GrpcReply::recorded(head, Bytes::new(), body).with_trailers(&kept);
        let http = again.into_http();
        assert_eq!(http.headers()["grpc-status"], "5");
        assert_eq!(
            http.headers()["grpc-message"],
            "no%20such%20order",
            "as tonic percent-encodes it"
        );
        assert!(http_body::Body::is_end_stream(http.body()));
    }
}
