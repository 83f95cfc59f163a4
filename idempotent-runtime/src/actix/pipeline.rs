//! The per-request pipeline both actix integrations share: decide (key, body, scope, claim),
//! run the claimed handler in its own task, then record or release.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::error::InternalError;
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use crate::config::{Effective, EndpointConfig};
use crate::context::IdempotencyContext;
use crate::fingerprint::FingerprintInput;
use crate::key::{self, IdempotencyKey};
use crate::problem::{self, Problem};
use crate::record;
use crate::runtime::{
    Begin, BeginRequest, BufferPermit, ClaimMode, Detached, Idempotency, Outcome, Reservation,
};
use crate::scope::{self, Identity};
use crate::store::RecordedResponse;

/// Set in the request extensions by the outermost idempotency step that applied to a request,
/// so an inner one (a scope middleware inside another, or an attribute under a middleware)
/// steps aside: the outer one decides.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Handled;

/// The header marking a replayed response.
pub(crate) const REPLAYED: &str = "idempotency-replayed";

/// The matched route and its path parameters' values, decoded, in pattern order.
pub(crate) struct Target {
    pub(crate) route: Option<String>,
    pub(crate) params: Vec<String>,
}

impl Target {
    /// For a request whose resource has been matched (inside a handler).
    pub(crate) fn matched(req: &HttpRequest) -> Self {
        Self {
            route: req.match_pattern(),
            params: req
                .match_info()
                .iter()
                .map(|(_, value)| percent_decode(value).into_owned())
                .collect(),
        }
    }
}

/// What to do after the key and body steps.
pub(crate) enum Read {
    /// No key on an optional endpoint: run the handler as if the runtime were not there.
    Untouched(dev::Payload),
    /// A refusal.
    Respond(HttpResponse),
    /// A keyed request with its whole body.
    Buffered(Buffered),
}

/// A keyed request whose body has been read.
pub(crate) struct Buffered {
    key: IdempotencyKey,
    pub(crate) body: Bytes,
    permit: Option<BufferPermit>,
    effective: Effective,
    target: Target,
}

/// What to do after the claim. `R` holds the key (see [`ClaimMode`]).
pub(crate) enum Claimed<R = Reservation> {
    /// A refusal or a replay.
    Respond(HttpResponse),
    /// The key is held: run the handler on the buffered body.
    Run(Run<R>),
}

/// A claimed request, ready to run.
pub(crate) struct Run<R = Reservation> {
    pub(crate) store: Idempotency,
    pub(crate) reservation: R,
    pub(crate) body: Bytes,
    pub(crate) context: IdempotencyContext,
    pub(crate) permit: Option<BufferPermit>,
    pub(crate) route: String,
}

/// The store handle from the application data: `web::Data<Idempotency>`, or a plain
/// `Idempotency` registered with `app_data`.
pub(crate) fn store_of(req: &HttpRequest) -> Option<Idempotency> {
    req.app_data::<web::Data<Idempotency>>()
        .map(|data| Idempotency::clone(data))
        .or_else(|| req.app_data::<Idempotency>().cloned())
}

/// The answer when the application registered no store: a setup mistake, said loudly.
pub(crate) fn store_missing(route: &str) -> HttpResponse {
    tracing::error!(
        route,
        "no Idempotency in the application data: register one with \
         App::new().app_data(web::Data::new(Idempotency::memory()))"
    );
    HttpResponse::InternalServerError()
        .content_type("text/plain; charset=utf-8")
        .body("the idempotency store is not configured")
}

/// Steps 1–2 of the pipeline: key syntax, key presence, body.
pub(crate) async fn read(
    req: &HttpRequest,
    mut payload: dev::Payload,
    store: &Idempotency,
    endpoint: &EndpointConfig,
    target: Target,
) -> Read {
    let route = target.route.as_deref().unwrap_or("");
    let values = req.headers().get_all(key::HEADER_NAME);
    let key = match key::parse_header_values(values.map(HeaderValue::as_bytes)) {
        Ok(Some(key)) => key,
        Ok(None) if endpoint.require_key => {
            return Read::Respond(problem_response(&store.key_missing(route)));
        }
        Ok(None) => return Read::Untouched(payload),
        Err(error) => return Read::Respond(problem_response(&store.key_invalid(error, route))),
    };
    let effective = endpoint.resolve(store.config());
    match buffer(req, &mut payload, store, effective.max_body, route).await {
        Ok((body, permit)) => Read::Buffered(Buffered {
            key,
            body,
            permit,
            effective,
            target,
        }),
        Err(response) => Read::Respond(response),
    }
}

/// Steps 3–4 of the pipeline: scope and claim.
pub(crate) async fn claim(req: &HttpRequest, store: &Idempotency, buffered: Buffered) -> Claimed {
    claim_with::<Detached>(req, store, buffered).await
}

/// [`claim`], claiming the key the way `M` does.
pub(crate) async fn claim_with<M: ClaimMode>(
    req: &HttpRequest,
    store: &Idempotency,
    buffered: Buffered,
) -> Claimed<M::Held> {
    let Buffered {
        key,
        body,
        permit,
        effective,
        target,
    } = buffered;
    let route = target.route.as_deref().unwrap_or("");
    let config = store.config();
    let resolved = {
        let extensions = req.extensions();
        let peer = req.peer_addr().map(|addr| {
            let forwarded = req
                .headers()
                .get_all("x-forwarded-for")
                .filter_map(|v| v.to_str().ok());
            scope::client_ip(addr.ip(), forwarded, config.trusted_proxies())
        });
        scope::resolve(
            extensions.get::<Identity>(),
            req.headers().contains_key(header::AUTHORIZATION),
            peer,
            config.anonymous(),
        )
    };
    let scope = match resolved {
        Ok(scope) => scope,
        Err(error) => {
            return Claimed::Respond(problem_response(&store.scope_unresolved(error, route)));
        }
    };
    let params: Vec<&str> = target.params.iter().map(String::as_str).collect();
    let begin = BeginRequest {
        key: &key,
        input: FingerprintInput {
            method: req.method().as_str(),
            route: target.route.as_deref(),
            path_params: &params,
            query: req.uri().query(),
            scope: &scope,
            content_type: req
                .headers()
                .get(header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
            body: &body,
        },
        endpoint: &effective,
    };
    match M::begin(store, &begin).await {
        Begin::Run(reservation) => {
            let context = IdempotencyContext::new(key, *scope.hash());
            req.extensions_mut().insert(context.clone());
            Claimed::Run(Run {
                store: store.clone(),
                reservation,
                body,
                context,
                permit,
                route: route.to_owned(),
            })
        }
        Begin::Replay(recorded) => Claimed::Respond(replay_response(&recorded)),
        Begin::Refuse(problem) => Claimed::Respond(problem_response(&problem)),
    }
}

/// Reads the whole request body, at most `max_body` bytes, within `body_timeout`.
async fn buffer(
    req: &HttpRequest,
    payload: &mut dev::Payload,
    store: &Idempotency,
    max_body: usize,
    route: &str,
) -> Result<(Bytes, Option<BufferPermit>), HttpResponse> {
    let too_large = || problem_response(&store.payload_too_large(max_body, route));
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max_body as u64) {
        return Err(too_large());
    }
    let Some(mut permit) = store.buffer_permit(0) else {
        return Err(problem_response(&store.buffers_full(route)));
    };
    let deadline = tokio::time::Instant::now() + store.config().body_timeout();
    // One chunk (the common case) is kept as it came, without a copy.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let mut len = 0usize;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Err(_elapsed) => return Err(problem_response(&store.body_timeout(route))),
            Ok(None) => break,
            Ok(Some(Err(error))) => return Err(HttpResponse::from_error(error)),
            Ok(Some(Ok(chunk))) => chunk,
        };
        if chunk.len() > max_body - len {
            return Err(too_large());
        }
        if !permit.grow(chunk.len()) {
            return Err(problem_response(&store.buffers_full(route)));
        }
        len += chunk.len();
        match first.take() {
            None if joined.is_empty() => first = Some(chunk),
            None => joined.extend_from_slice(&chunk),
            Some(head) => {
                joined.reserve(head.len() + chunk.len());
                joined.extend_from_slice(&head);
                joined.extend_from_slice(&chunk);
            }
        }
    }
    let body = first.unwrap_or_else(|| joined.freeze());
    Ok((body, Some(permit)))
}

/// Step 5: runs `handler` in its own task (a client disconnect never cancels a claimed
/// handler), under the reservation's renewed lease, then records or releases. `T` travels
/// beside the response (the middleware's request).
pub(crate) async fn execute<T, F>(
    run: Run,
    handler: F,
) -> Result<(HttpResponse, T), actix_web::Error>
where
    F: Future<Output = Result<(HttpResponse, T), actix_web::Error>> + 'static,
    T: 'static,
{
    let Run {
        store,
        mut reservation,
        permit,
        route,
        ..
    } = run;
    let panicked = {
        let store = store.clone();
        let route = route.clone();
        move || {
            let problem = store.panicked(&route);
            InternalError::from_response(
                "the idempotent handler panicked",
                problem_response(&problem),
            )
            .into()
        }
    };
    let task = actix_web::rt::spawn(async move {
        let permit = permit;
        match reservation.run(handler).await {
            Outcome::Panicked => Err(panicked()),
            Outcome::Returned(Err(error)) => {
                // An inner service failed before producing a response: nothing to record.
                reservation.release().await;
                Err(error)
            }
            Outcome::Returned(Ok((response, extra))) => {
                drop(permit);
                Ok((settle(&store, reservation, response).await, extra))
            }
        }
    });
    match task.await {
        Ok(result) => result,
        Err(_join_error) => {
            let problem = run_panicked(&route);
            Err(InternalError::from_response("the idempotent handler task failed", problem).into())
        }
    }
}

fn run_panicked(route: &str) -> HttpResponse {
    tracing::error!(route, "idempotent handler task failed; its key is released");
    problem_response(&Problem::new(
        500,
        problem::ProblemCode::HandlerPanicked,
        "the request failed; it may be retried with the same Idempotency-Key",
    ))
}

/// Records a recordable response before it is sent; releases the key otherwise.
async fn settle(
    store: &Idempotency,
    reservation: Reservation,
    response: HttpResponse,
) -> HttpResponse {
    let config = store.config();
    let status = response.status().as_u16();
    if !reservation.is_guarded() || !config.is_recordable_status(status) {
        reservation.release().await;
        return response;
    }
    let headers = record::recorded_headers(
        config,
        response
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    );
    let Some(headers) = headers else {
        reservation.release().await;
        return response;
    };
    let cap = reservation.max_response();
    let (head, mut body) = response.into_parts();
    let collected = match body.size() {
        BodySize::None => Collected::Complete(Bytes::new()),
        BodySize::Sized(len) if len > cap as u64 => {
            reservation.release().await;
            return head.set_body(body);
        }
        BodySize::Sized(_) | BodySize::Stream => collect(&mut body, cap, store).await,
    };
    match collected {
        Collected::Complete(bytes) => {
            let recorded = RecordedResponse {
                status,
                headers,
                body: bytes.clone(),
            };
            reservation.complete(&recorded).await;
            if matches!(body.size(), BodySize::None) {
                head.set_body(body)
            } else {
                head.set_body(BoxBody::new(bytes))
            }
        }
        Collected::Partial { read, error } => {
            // Past the cap (or the buffer budget), or broken: send what was read and the rest
            // of the stream as it comes, unrecorded.
            reservation.release().await;
            head.set_body(BoxBody::new(Resume {
                read: Some(read),
                error,
                rest: body,
            }))
        }
    }
}

pub(crate) enum Collected {
    Complete(Bytes),
    Partial {
        read: Bytes,
        error: Option<Box<dyn StdError>>,
    },
}

/// Reads a response body up to `cap` bytes. Reading consumes the stream, so what was read is
/// handed back to be sent when the body does not end within the cap.
pub(crate) async fn collect(body: &mut BoxBody, cap: usize, store: &Idempotency) -> Collected {
    let mut permit = store.buffer_permit(0);
    let mut read = BytesMut::new();
    loop {
        match poll_fn(|cx| Pin::new(&mut *body).poll_next(cx)).await {
            None => return Collected::Complete(read.freeze()),
            Some(Ok(chunk)) => {
                let fits = chunk.len() <= cap.saturating_sub(read.len())
                    && permit.as_mut().is_some_and(|p| p.grow(chunk.len()));
                read.extend_from_slice(&chunk);
                if !fits {
                    return Collected::Partial {
                        read: read.freeze(),
                        error: None,
                    };
                }
            }
            Some(Err(error)) => {
                return Collected::Partial {
                    read: read.freeze(),
                    error: Some(error),
                };
            }
        }
    }
}

/// What was read of a response body, then its error (if reading failed), then the rest.
struct Resume {
    read: Option<Bytes>,
    error: Option<Box<dyn StdError>>,
    rest: BoxBody,
}

impl MessageBody for Resume {
    type Error = Box<dyn StdError>;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        if let Some(read) = this.read.take().filter(|r| !r.is_empty()) {
            return Poll::Ready(Some(Ok(read)));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        Pin::new(&mut this.rest).poll_next(cx)
    }
}

/// A refusal as `application/problem+json`, with `Retry-After` when it has one.
pub(crate) fn problem_response(problem: &Problem) -> HttpResponse {
    let status =
        StatusCode::from_u16(problem.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut builder = HttpResponse::build(status);
    builder.insert_header((header::CONTENT_TYPE, problem::CONTENT_TYPE));
    if let Some(seconds) = problem.retry_after() {
        builder.insert_header((header::RETRY_AFTER, seconds));
    }
    builder.body(problem.body())
}

/// A recorded response, marked replayed.
pub(crate) fn replay_response(recorded: &RecordedResponse) -> HttpResponse {
    let status = StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::OK);
    let mut builder = HttpResponse::build(status);
    for (name, value) in &recorded.headers {
        let name = HeaderName::from_bytes(name.as_bytes());
        let value = HeaderValue::from_maybe_shared(value.clone());
        if let (Ok(name), Ok(value)) = (name, value) {
            builder.append_header((name, value));
        }
    }
    builder.insert_header((
        HeaderName::from_static(REPLAYED),
        HeaderValue::from_static("true"),
    ));
    builder.body(recorded.body.clone())
}

/// Percent-decodes a path segment as `web::Path` does, lossily.
pub(crate) fn percent_decode(segment: &str) -> Cow<'_, str> {
    if !segment.contains('%') {
        return Cow::Borrowed(segment);
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) if hex(*hi).is_some() && hex(*lo).is_some() => {
                let (hi, lo) = (hex(*hi).unwrap_or(0), hex(*lo).unwrap_or(0));
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_fully_decoded() {
        assert_eq!(percent_decode("a%2Fb%20c"), "a/b c");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
        assert_eq!(percent_decode("%C3%A9"), "é");
    }
}
