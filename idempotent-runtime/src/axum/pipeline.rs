//! The request pipeline in axum's types, shared by the extractor and the layer: key, body,
//! scope, claim (DESIGN.md §2 order), then recording the handler's response.

use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::task::Poll;

use axum::body::Body;
use axum::extract::{ConnectInfo, FromRequestParts, MatchedPath, RawPathParams, Request};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;

use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::fingerprint::FingerprintInput;
use crate::key::{self, HEADER_NAME};
use crate::problem::{self, Problem};
use crate::runtime::{
    Begin, BeginRequest, BufferPermit, ClaimMode, Detached, Idempotency, Outcome, Reservation,
};
use crate::scope::{self, Identity};
use crate::store::RecordedResponse;

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotency-replayed";

/// Marks a request the layer already handles: an attribute further in steps aside.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerApplied;

/// What to do with a request after the steps before the handler. `R` holds the key (see
/// [`ClaimMode`]).
pub(crate) enum Prepared<R = Reservation> {
    /// No key on an optional endpoint: run the handler untouched.
    Pass(Request),
    /// A refusal or a replay; the handler does not run.
    Answer(Response),
    /// The key is held: run the handler on this (re-assembled) request, then settle.
    Claimed(Box<Claimed<R>>),
}

pub(crate) struct Claimed<R = Reservation> {
    pub request: Request,
    pub reservation: R,
    pub context: IdempotencyContext,
    pub permit: Option<BufferPermit>,
    pub route: String,
}

/// Key syntax → key presence → body → scope → claim.
pub(crate) async fn prepare(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: Request,
) -> Prepared {
    prepare_with::<Detached>(handle, endpoint, request).await
}

/// [`prepare`], claiming the key the way `M` does.
pub(crate) async fn prepare_with<M: ClaimMode>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    request: Request,
) -> Prepared<M::Held> {
    let (mut parts, body) = request.into_parts();
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let route_str = route.as_deref().unwrap_or("");
    let config = handle.config();
    let effective = endpoint.resolve(config);

    let key = match key::parse_header_values(
        parts
            .headers
            .get_all(HEADER_NAME)
            .iter()
            .map(HeaderValue::as_bytes),
    ) {
        Err(error) => return Prepared::Answer(problem(&handle.key_invalid(error, route_str))),
        Ok(None) if effective.require_key => {
            return Prepared::Answer(problem(&handle.key_missing(route_str)));
        }
        Ok(None) => return Prepared::Pass(Request::from_parts(parts, body)),
        Ok(Some(key)) => key,
    };

    let (body, permit) =
        match buffer_body(handle, &parts.headers, body, effective.max_body, route_str).await {
            Ok(buffered) => buffered,
            Err(answer) => return Prepared::Answer(answer),
        };

    // Through the extractor, so `MockConnectInfo` (tests) counts as a peer address too.
    let peer = ConnectInfo::<SocketAddr>::from_request_parts(&mut parts, &())
        .await
        .ok()
        .map(|ConnectInfo(addr)| {
            scope::client_ip(
                addr.ip(),
                parts
                    .headers
                    .get_all("x-forwarded-for")
                    .iter()
                    .filter_map(|v| v.to_str().ok()),
                config.trusted_proxies(),
            )
        });
    let scope = match scope::resolve(
        parts.extensions.get::<Identity>(),
        parts.headers.contains_key(AUTHORIZATION),
        peer,
        config.anonymous(),
    ) {
        Ok(scope) => scope,
        Err(error) => {
            return Prepared::Answer(problem(&handle.scope_unresolved(error, route_str)));
        }
    };

    // Matched routes always carry their parameters; outside a route there are none.
    let raw_params = RawPathParams::from_request_parts(&mut parts, &())
        .await
        .ok();
    let path_params: Vec<&str> = raw_params
        .as_ref()
        .map(|p| p.iter().map(|(_, v)| v).collect())
        .unwrap_or_default();
    let input = FingerprintInput {
        method: parts.method.as_str(),
        route: route.as_deref(),
        path_params: &path_params,
        query: parts.uri.query(),
        scope: &scope,
        content_type: parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
        body: &body,
    };
    let begin_request = BeginRequest {
        key: &key,
        input,
        endpoint: &effective,
    };
    let begin = M::begin(handle, &begin_request).await;
    drop(raw_params);
    match begin {
        Begin::Replay(recorded) => Prepared::Answer(replay(&recorded)),
        Begin::Refuse(refusal) => Prepared::Answer(problem(&refusal)),
        Begin::Run(reservation) => {
            let context = IdempotencyContext::new(key, *scope.hash());
            parts.extensions.insert(context.clone());
            Prepared::Claimed(Box::new(Claimed {
                request: Request::from_parts(parts, Body::from(body)),
                reservation,
                context,
                permit,
                route: route.unwrap_or_default(),
            }))
        }
    }
}

/// Reads the whole request body under the cap, the read timeout and the global buffer budget.
async fn buffer_body(
    handle: &Idempotency,
    headers: &http::HeaderMap,
    body: Body,
    max_body: usize,
    route: &str,
) -> Result<(Bytes, Option<BufferPermit>), Response> {
    let too_large = || problem(&handle.payload_too_large(max_body, route));
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        return Err(too_large());
    }
    let mut reserved = declared.map_or(0, |n| n as usize);
    let Some(mut permit) = handle.buffer_permit(reserved) else {
        return Err(problem(&handle.buffers_full(route)));
    };
    enum Failure {
        TooLarge,
        Full,
        Broken,
    }
    let read = async {
        let mut body = body;
        let mut first: Option<Bytes> = None;
        let mut rest = BytesMut::new();
        let mut len = 0usize;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.map_err(|_| Failure::Broken)?.into_data() else {
                continue;
            };
            len = len.checked_add(data.len()).ok_or(Failure::TooLarge)?;
            if len > max_body {
                return Err(Failure::TooLarge);
            }
            if len > reserved {
                if !permit.grow(len - reserved) {
                    return Err(Failure::Full);
                }
                reserved = len;
            }
            // One chunk (the common case) is kept as is, without a copy.
            match first.take() {
                None if rest.is_empty() => first = Some(data),
                None => rest.extend_from_slice(&data),
                Some(f) => {
                    rest.reserve(f.len() + data.len());
                    rest.extend_from_slice(&f);
                    rest.extend_from_slice(&data);
                }
            }
        }
        Ok(first.unwrap_or_else(|| rest.freeze()))
    };
    match tokio::time::timeout(handle.config().body_timeout(), read).await {
        Ok(Ok(bytes)) => Ok((bytes, Some(permit))),
        Ok(Err(Failure::TooLarge)) => Err(too_large()),
        Ok(Err(Failure::Full)) => Err(problem(&handle.buffers_full(route))),
        Ok(Err(Failure::Broken)) => {
            Err((StatusCode::BAD_REQUEST, "failed to read the request body").into_response())
        }
        Err(_elapsed) => Err(problem(&handle.body_timeout(route))),
    }
}

/// Runs a claimed handler to its end in its own task, so a client that disconnects never
/// cancels it, and records or releases its response. Work that is done at its first poll has
/// nothing left to cancel, so it is answered without a task.
pub(crate) async fn run_claimed<F>(
    handle: Idempotency,
    mut reservation: Reservation,
    permit: Option<BufferPermit>,
    route: String,
    handler: F,
) -> Response
where
    F: Future<Output = Response> + Send + 'static,
{
    let mut work = Box::pin(async move {
        let _request_body = permit;
        match reservation.run(handler).await {
            Outcome::Returned(response) => settle(&handle, reservation, response).await,
            Outcome::Panicked => problem(&handle.panicked(&route)),
        }
    });
    // A task costs more than a typical handler over the memory store (an over-aligned
    // allocation, scheduling, a join handle). There is no await point between this poll and
    // the spawn, so a disconnect can never drop started work: it finishes here or in its task.
    let first = std::future::poll_fn(|cx| {
        Poll::Ready(panic::catch_unwind(AssertUnwindSafe(|| {
            work.as_mut().poll(cx)
        })))
    })
    .await;
    match first {
        Ok(Poll::Ready(response)) => return response,
        Ok(Poll::Pending) => {}
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
    match tokio::spawn(work).await {
        Ok(response) => response,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Records a recordable response before it is returned; releases the key otherwise. The first
/// response is never marked replayed.
pub(crate) async fn settle(
    handle: &Idempotency,
    reservation: Reservation,
    response: Response,
) -> Response {
    let config = handle.config();
    let status = response.status().as_u16();
    if !reservation.is_guarded() || !config.is_recordable_status(status) {
        reservation.release().await;
        return response;
    }
    let cap = reservation.max_response();
    let (parts, body) = response.into_parts();
    if body.size_hint().exact().is_some_and(|n| n > cap as u64) {
        reservation.release().await;
        return Response::from_parts(parts, body);
    }
    let Some(headers) = crate::record::recorded_headers(
        config,
        parts
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    ) else {
        reservation.release().await;
        return Response::from_parts(parts, body);
    };
    match read_capped(handle, body, cap).await {
        Read::Complete(bytes) => {
            reservation
                .complete(&RecordedResponse {
                    status,
                    headers,
                    body: bytes.clone(),
                })
                .await;
            Response::from_parts(parts, Body::from(bytes))
        }
        Read::Unrecordable(body) => {
            reservation.release().await;
            Response::from_parts(parts, body)
        }
    }
}

pub(crate) enum Read {
    Complete(Bytes),
    /// Past the cap, out of budget or broken: what was read, then the rest of the stream.
    Unrecordable(Body),
}

pub(crate) async fn read_capped(handle: &Idempotency, mut body: Body, cap: usize) -> Read {
    let hint = body.size_hint().lower() as usize;
    let mut permit = handle.buffer_permit(hint.min(cap));
    let mut reserved = hint.min(cap);
    let mut read = BytesMut::new();
    let mut single: Option<Bytes> = None;
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => {
                let read = take(&mut single, read);
                let stream = futures_util::stream::iter([Ok(read), Err(error)]);
                return Read::Unrecordable(Body::from_stream(stream));
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = single.as_ref().map_or(read.len(), Bytes::len) + data.len();
        let within_budget = len <= reserved
            || permit.as_mut().is_some_and(|p| {
                let ok = p.grow(len - reserved);
                if ok {
                    reserved = len;
                }
                ok
            });
        if len > cap || !within_budget {
            let head = take(&mut single, read);
            let read = futures_util::stream::iter([Ok::<_, axum::Error>(head), Ok(data)]);
            let stream = read.chain(body.into_data_stream());
            return Read::Unrecordable(Body::from_stream(stream));
        }
        match single.take() {
            None if read.is_empty() => single = Some(data),
            None => read.extend_from_slice(&data),
            Some(s) => {
                read.extend_from_slice(&s);
                read.extend_from_slice(&data);
            }
        }
    }
    Read::Complete(take(&mut single, read))
}

fn take(single: &mut Option<Bytes>, read: BytesMut) -> Bytes {
    single.take().unwrap_or_else(|| read.freeze())
}

/// A refusal as `application/problem+json`, with `Retry-After` when the client should retry.
pub(crate) fn problem(problem: &Problem) -> Response {
    let status =
        StatusCode::from_u16(problem.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, problem.body()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(problem::CONTENT_TYPE),
    );
    if let Some(seconds) = problem.retry_after() {
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// The recorded response, marked `Idempotency-Replayed: true`.
pub(crate) fn replay(recorded: &RecordedResponse) -> Response {
    let mut response = Response::new(Body::from(recorded.body.clone()));
    *response.status_mut() = StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in &recorded.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(
        HeaderName::from_static(REPLAYED_HEADER),
        HeaderValue::from_static("true"),
    );
    response
}
