//! The request sequence of [the contract](crate::design) §2, written once for every framework:
//!
//! ```text
//! key syntax → key presence → body → scope → fingerprint → claim → run → settle
//! ```
//!
//! `front` checks the key and reads the body (bounded by `max_body`, `body_timeout` and the
//! buffer budget); `claim` resolves the caller's scope, fingerprints the request and claims the
//! key, detached or enlisted (`ClaimMode`); `work` runs the claimed handler under its renewed
//! lease and settles its response (record or release); `drive` runs that work where no
//! client disconnect can cancel it. Each framework adapter (`crate::axum`, `crate::actix`) only
//! translates: it implements `Head` over its request, `Chunks` over its bodies and `Reply`
//! over its response, and calls these steps in order. Between `front` and `claim` actix runs
//! the handler's own extractors (they may publish the caller's identity); axum has already run
//! them, as its extractors run left to right.

// Driven by the framework integrations (and unit-tested here without one).
#![cfg_attr(
    not(any(feature = "axum", feature = "actix", feature = "tonic")),
    allow(dead_code, unused_imports)
)]

mod body;
pub(crate) mod claim;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod enlisted;
mod refusals;
mod settle;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::future::Future;
use std::net::IpAddr;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;

pub(crate) use body::BodyError;
pub use body::Chunks;
pub(crate) use claim::{Begin, BeginRequest};
pub(crate) use claim::{ClaimMode, Detached};
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use enlisted::{Enlisted, enlisted_work, settle_enlisted};
pub(crate) use refusals::misconfigured;
pub(crate) use settle::settle;

use crate::budget::BufferPermit;
use crate::config::{Effective, EndpointConfig};
use crate::context::IdempotencyContext;
use crate::fingerprint::FingerprintInput;
use crate::handle::Idempotency;
use crate::key::{self, IdempotencyKey};
use crate::problem::{Problem, ProblemCode, RenderedRefusal};
use crate::reservation::{Ran, Reservation};
use crate::scope::{self, Identity, Resolution};
use crate::store::RecordedResponse;

/// The header that marks a replayed response (`Idempotency-Replayed: true`).
pub const REPLAYED_HEADER: &str = "idempotency-replayed";

/// What the pipeline reads of a request's head (see [`crate::adapter`]).
pub trait Head {
    /// The method, e.g. `POST`.
    fn method(&self) -> &str;
    /// The matched route pattern (with any nest or scope prefix); `None` outside a route.
    fn route(&self) -> Option<&str>;
    /// The path parameters' values as the framework decodes them, in pattern order.
    fn path_params(&self) -> Vec<&str>;
    /// The raw query string; `None` when the URI has no `?`.
    fn query(&self) -> Option<&str>;
    /// Every value of a header, in order.
    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a;
    /// The connection's peer address.
    fn peer(&self) -> Option<IpAddr>;
    /// Calls `f` with the identity the application published in the request extensions.
    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T;
}

/// What the pipeline needs of a framework's response: read it apart, put it back together,
/// and build the answers the pipeline gives itself.
pub trait Reply: Sized {
    /// Everything but the body.
    type Head;
    /// The body, read to record it.
    type Body: Chunks;

    /// The status code.
    fn status(&self) -> u16;
    /// Every header line, in order (names lowercase, as HTTP/2 and the `http` crate keep them).
    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])>;
    /// The response taken apart, to read its body.
    fn into_parts(self) -> (Self::Head, Self::Body);
    /// The response put back together, unchanged.
    fn from_parts(head: Self::Head, body: Self::Body) -> Self;
    /// The response with its body recorded in full; `drained` is the original body, read to
    /// its end (kept where the framework distinguishes "no body" from an empty one).
    fn recorded(head: Self::Head, bytes: Bytes, drained: Self::Body) -> Self;
    /// `read`, then `error` if reading failed, then the rest of the stream.
    fn resumed(
        head: Self::Head,
        read: Bytes,
        error: Option<<Self::Body as Chunks>::Error>,
        rest: Self::Body,
    ) -> Self;
    /// A response of the pipeline's own: `status`, these headers, `body`.
    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self;

    /// A refusal with the problem's status and `Retry-After` (when it has one), and the body
    /// the handle rendered for it (`application/problem+json` unless the application set a
    /// renderer). Built through [`adapter::refusal`](crate::adapter::refusal), never directly.
    fn problem(problem: &Problem, rendered: RenderedRefusal) -> Self {
        let retry_after = problem.retry_after().map(|s| s.to_string());
        let headers = [("content-type", rendered.content_type.as_bytes())]
            .into_iter()
            .chain(
                retry_after
                    .as_deref()
                    .map(|s| ("retry-after", s.as_bytes())),
            );
        Self::build(problem.status(), headers, rendered.body)
    }

    /// This response with [`REPLAYED_HEADER`]` = true` (a static name: a replay should not pay
    /// for parsing it).
    fn mark_replayed(self) -> Self;

    /// This response with `trailers` sent after its body (unchanged when there are none). The
    /// default drops them, for a framework whose responses have no trailers (actix-web).
    fn with_trailers(self, trailers: &[(String, Bytes)]) -> Self {
        let _ = trailers;
        self
    }

    /// A recorded response, marked with [`REPLAYED_HEADER`], its trailers after its body.
    fn replay(recorded: &RecordedResponse) -> Self {
        let headers = recorded.headers.iter().map(|(n, v)| (n.as_str(), &v[..]));
        Self::build(recorded.status, headers, recorded.body.clone())
            .with_trailers(&recorded.trailers)
            .mark_replayed()
    }

    /// A plain 500 for a setup mistake the log line explains.
    fn internal(message: &'static str) -> Self {
        let text = [("content-type", &b"text/plain; charset=utf-8"[..])];
        Self::build(500, text, Bytes::from_static(message.as_bytes()))
    }
}

/// The answer when the application provided no [`Idempotency`] handle: a setup mistake, logged
/// with `fix`.
pub(crate) fn handle_missing<R: Reply>(route: &str, fix: &str) -> R {
    tracing::error!(route, "#[idempotent] found no Idempotency handle: {fix}");
    R::internal("the idempotency store is not configured")
}

/// The answer when a handler takes an `IdempotencyContext` and the request has none: a keyless
/// request on an endpoint whose key is optional, or no idempotency step around the handler.
pub(crate) fn context_missing<R: Reply>() -> R {
    tracing::error!(
        "a handler takes IdempotencyContext but this request has no idempotency key: take \
         Option<IdempotencyContext>, or require the key on this endpoint"
    );
    R::internal("this request has no idempotency context")
}

/// The answer for an enlisted handler behind the router-level layer or middleware, which
/// already claimed the key outside any transaction.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn enlisted_behind_layer<R: Reply>(route: &str) -> R {
    tracing::error!(
        route,
        "#[idempotent(enlisted)] handler behind the idempotency layer or middleware: it already \
         claimed the key outside any transaction; remove it from this route or `enlisted` from \
         the handler"
    );
    R::internal("an enlisted handler cannot run behind the idempotency layer")
}

/// An attribute with `require_key` under an outer layer whose key is optional (the watch says
/// it once). In strict mode every request is refused (500), keyed or not; otherwise a keyless
/// one, which the outer step let through, is refused as the attribute alone would (400), and a
/// keyed one (`None`) goes on under the outer step's claim.
pub(crate) fn required_under_optional<R: Reply>(
    handle: Option<&Idempotency>,
    route: &str,
    keyed: bool,
) -> Option<R> {
    crate::watch::required_under_optional(handle.map(Idempotency::watch), route);
    let strict = handle.map_or(cfg!(debug_assertions), |h| h.config().strict());
    let problem = match handle {
        _ if strict => refusals::misconfigured(),
        _ if keyed => return None,
        Some(handle) => refusals::key_missing(handle.config(), route, None),
        None => Problem::new(
            400,
            ProblemCode::KeyRequired,
            "an Idempotency-Key header is required",
        ),
    };
    Some(match handle {
        Some(handle) => refuse(handle, &problem),
        None => R::problem(&problem, RenderedRefusal::problem_json(&problem)),
    })
}

/// A refusal as the framework's response, rendered by the handle's renderer.
pub(crate) fn refuse<R: Reply>(handle: &Idempotency, problem: &Problem) -> R {
    R::problem(problem, handle.render_refusal(problem))
}

fn first_header<'a, H: Head>(head: &'a H, name: &'a str) -> Option<&'a [u8]> {
    head.header_values(name).next()
}

/// The field value of every line of header `name`, combined as HTTP combines them (RFC 9110
/// §5.3: joined by `, `, in order): two lines are one value, never just the first.
fn combined_header<'a, H: Head>(head: &'a H, name: &'static str) -> Option<Cow<'a, [u8]>> {
    let mut values = head.header_values(name);
    let first = values.next()?;
    let Some(second) = values.next() else {
        return Some(Cow::Borrowed(first));
    };
    let mut combined = first.to_vec();
    for value in std::iter::once(second).chain(values) {
        combined.extend_from_slice(b", ");
        combined.extend_from_slice(value);
    }
    Some(Cow::Owned(combined))
}

fn route_of<H: Head>(head: &H) -> &str {
    head.route().unwrap_or("")
}

/// GET, HEAD, OPTIONS and TRACE: repeating them changes nothing, so they always pass.
fn is_safe(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS" | "TRACE")
}

/// A request whose body was read in full, ready to be scoped and claimed.
pub(crate) struct Buffered {
    /// `None` only in a mode that buffers requests without a key (enlisted).
    key: Option<IdempotencyKey>,
    pub(crate) body: Bytes,
    permit: BufferPermit,
    effective: Effective,
}

impl Buffered {
    /// The endpoint's rules for what is recorded.
    pub(crate) fn recording(&self) -> crate::config::Recording {
        self.effective.recording.clone()
    }
}

/// What to do after the key and body steps.
pub(crate) enum Front<B> {
    /// No key on an optional endpoint: the request goes on untouched, with its body.
    Pass(B),
    /// A refusal; nothing was read into the budget or claimed.
    Refuse(Problem),
    /// The body is in memory.
    Buffered(Buffered),
}

/// Where this endpoint's key is read: a header (its own, else the configured one), or the body.
enum KeyAt<'a> {
    Header(&'a str),
    Body(&'a key::JsonPointer),
}

fn key_at<'a>(handle: &'a Idempotency, endpoint: &'a EndpointConfig) -> KeyAt<'a> {
    match endpoint.key_source() {
        None => KeyAt::Header(handle.config().key_header()),
        Some(source) => match source.body_pointer() {
            Some(pointer) => KeyAt::Body(pointer),
            None => KeyAt::Header(source.header_name().unwrap_or(key::HEADER_NAME)),
        },
    }
}

/// Key syntax → key presence → body; for a key read from the body, body → key syntax → key
/// presence. A request without a key on an optional endpoint passes (with its body, read or
/// not), except in a mode whose transaction must not wait for a slow body (enlisted).
pub(crate) async fn front<M: ClaimMode, H: Head, B: Chunks + From<Bytes>>(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &H,
    mut body: B,
) -> Front<B> {
    let route = route_of(head);
    let effective = endpoint.resolve(handle.config());
    let key_at = key_at(handle, endpoint);
    let applies = effective.methods.contains(head.method());
    let key = match key_at {
        KeyAt::Header(name) if applies => {
            match key::parse_header_values(head.header_values(name)) {
                Err(error) => return Front::Refuse(refusals::key_invalid(error, route)),
                Ok(None) if effective.require_key => {
                    return Front::Refuse(refusals::key_missing(
                        handle.config(),
                        route,
                        endpoint.key_source(),
                    ));
                }
                Ok(None) if !M::BUFFERS_UNKEYED => return Front::Pass(body),
                Ok(key) => key,
            }
        }
        // Known once the body is read.
        KeyAt::Body(_) if applies => None,
        _ => {
            // Not this endpoint's method: it passes untouched (enlisted: in a transaction, as
            // a request without a key). A keyed unsafe one shows a handler routed for a method
            // its attribute does not list.
            let method = head.method();
            let keyed = match key_at {
                KeyAt::Header(name) => head.header_values(name).next().is_some(),
                KeyAt::Body(_) => false,
            };
            if keyed && !is_safe(method) {
                handle.watch().unlisted_method(route, method);
                if handle.config().strict() {
                    return Front::Refuse(refusals::misconfigured());
                }
            }
            if !M::BUFFERS_UNKEYED {
                return Front::Pass(body);
            }
            None
        }
    };
    let announced = first_header(head, "content-length")
        .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<u64>().ok());
    let config = handle.config();
    let read = body::read_request(
        handle.budget(),
        &mut body,
        announced,
        effective.max_body,
        config.body_timeout(),
    )
    .await;
    let (body, permit) = match read {
        Ok(read) => read,
        Err(BodyError::TooLarge) => {
            return Front::Refuse(refusals::payload_too_large(effective.max_body, route));
        }
        Err(BodyError::Timeout) => {
            return Front::Refuse(refusals::body_timeout(handle.config(), route));
        }
        Err(BodyError::BuffersFull) => {
            return Front::Refuse(refusals::buffers_full(handle.config(), route));
        }
        Err(BodyError::Broken) => return Front::Refuse(refusals::body_invalid(route)),
    };
    let key = match key_at {
        KeyAt::Body(pointer) if applies => match key::key_from_body(pointer, &body) {
            Err(error) => return Front::Refuse(refusals::body_key_invalid(&error, route)),
            Ok(None) if effective.require_key => {
                return Front::Refuse(refusals::key_missing(
                    handle.config(),
                    route,
                    endpoint.key_source(),
                ));
            }
            // The body was read to look for the key: the handler gets it as it arrived.
            Ok(None) if !M::BUFFERS_UNKEYED => return Front::Pass(B::from(body)),
            Ok(key) => key,
        },
        _ => key,
    };
    Front::Buffered(Buffered {
        key,
        body,
        permit,
        effective,
    })
}

/// A request admitted to run: it holds its key (or, enlisted without a key, its transaction); run the
/// handler on `body`, then settle `held`.
pub(crate) struct Admitted<H> {
    pub(crate) held: H,
    pub(crate) body: Bytes,
    pub(crate) permit: BufferPermit,
    /// `None` for a request without a key.
    pub(crate) context: Option<IdempotencyContext>,
    /// Shared with the claimed work and its [`Work`] (one allocation a request, not one each).
    pub(crate) route: Arc<str>,
    /// The request's span, for the claimed work that may run in a task of its own.
    pub(crate) span: tracing::Span,
}

/// Scope → fingerprint → claim, the way `M` claims. `Err` is the answer instead of running:
/// a replay or a refusal.
///
/// A function returning a block, not an `async fn`: the buffered request's fields are kept once
/// (an `async fn` keeps its arguments and the bindings it moves them into), in a future every
/// request's extractor holds.
pub(crate) fn claim<'a, M: ClaimMode, H: Head, R: Reply + 'a>(
    handle: &'a Idempotency,
    head: &'a H,
    buffered: Buffered,
) -> impl Future<Output = Result<Admitted<M::Held>, R>> + 'a {
    let Buffered {
        key,
        body,
        permit,
        effective,
    } = buffered;
    async move {
        let route = route_of(head);
        let claimed = |held, context| Admitted {
            route: M::shared_route(&held).unwrap_or_else(|| Arc::from(route)),
            held,
            body: body.clone(),
            permit,
            context,
            span: tracing::Span::current(),
        };
        let Some(key) = key else {
            return match M::unkeyed(handle, route).await {
                Ok(held) => Ok(claimed(held, None)),
                Err(problem) => Err(refuse(handle, &problem)),
            };
        };
        let scope = match scope_of(handle, head).await {
            Ok(scope) => scope,
            Err(problem) => return Err(refuse(handle, &problem)),
        };
        crate::observe::scoped(scope.hash());
        let params = head.path_params();
        let content_type = combined_header(head, "content-type");
        let request = BeginRequest {
            key: &key,
            input: FingerprintInput {
                method: head.method(),
                route: head.route(),
                path_params: &params,
                query: head.query(),
                scope: &scope,
                content_type: content_type.as_deref(),
                body: &body,
            },
            endpoint: &effective,
        };
        // Before the claim, so strict mode refuses a second memory store's request with nothing
        // written.
        if handle.watch().served(route) && handle.config().strict() {
            return Err(refuse(handle, &refusals::misconfigured()));
        }
        let begun = match M::begin_at_once(handle, &request) {
            Some(begun) => begun,
            None => M::begin(handle, &request).await,
        };
        match begun {
            Begin::Run(held) => {
                let context = IdempotencyContext::new(key.clone(), *scope.hash());
                Ok(claimed(held, Some(context)))
            }
            Begin::Replay(recorded) => Err(R::replay(&recorded)),
            Begin::Refuse(problem) => Err(refuse(handle, &problem)),
        }
    }
}

/// The caller's scope ([the contract](crate::design) §4): the identity the application
/// published, else the resolver's, else the peer (past trusted proxies) for a request that
/// carries no credential header. The one resolution there is: the claim and the operators'
/// `CallerScope` extractors both call it, so an admin route reaches exactly the records the
/// same caller's requests made.
pub(crate) async fn scope_of<H: Head>(
    handle: &Idempotency,
    head: &H,
) -> Result<scope::Scope, Problem> {
    let config = handle.config();
    let route = route_of(head);
    let credential = config
        .credential_headers()
        .iter()
        .any(|name| first_header(head, name).is_some());
    // The forwarded headers are read only when the scope needs the address: an authenticated
    // caller behind a proxy that forwards nothing is still who it says it is.
    let peer = || match head.peer() {
        Some(ip) if config.trusted_proxies().is_empty() => {
            if let Some(value) = first_header(head, "x-forwarded-for") {
                handle.watch().forwarded_untrusted(ip, value, route);
            }
            // With no proxy trusted the peer is the client, as `client_ip` would answer; the
            // forwarded headers it would not read are not looked up either.
            Ok(Some(scope::canonical_ip(ip)))
        }
        Some(ip) => {
            // As bytes, every line: a line dropped for a byte the client wrote would drop the
            // hop the proxy appended to it (#27).
            let xff = head.header_values("x-forwarded-for");
            let forwarded = head.header_values("forwarded");
            scope::client_ip(ip, xff, forwarded, config.trusted_proxies()).map(Some)
        }
        None => Ok(None),
    };
    let resolve = |identity: Option<&Identity>| {
        let named = identity.is_some_and(|i| i.subject.is_some() || i.client.is_some());
        let peer = if named { None } else { peer()? };
        scope::resolve(identity, credential, peer, config.anonymous())
    };
    let unresolved = |error| refusals::scope_unresolved(error, route);
    if let Some(scoped) = head.with_identity(|published| published.map(|i| resolve(Some(i)))) {
        return scoped.map_err(unresolved);
    }
    let Some(resolver) = handle.resolver() else {
        return resolve(None).map_err(unresolved);
    };
    let headers = Headers(head);
    let request = || scope::RequestHead {
        method: head.method(),
        route: head.route(),
        peer: head.peer().map(scope::canonical_ip),
        headers: &headers,
    };
    let resolution = match resolver {
        scope::ResolveWith::Now(resolver) => resolver(&request()),
        scope::ResolveWith::Later(resolver) => {
            // The head is not held across the wait: the future owns what it read.
            let pending = resolver(&request());
            pending.await
        }
    };
    match resolution {
        Resolution::Identity(identity) => resolve(Some(&identity)).map_err(unresolved),
        Resolution::Unknown => resolve(None).map_err(unresolved),
        Resolution::Refuse(problem) => Err(refusals::resolver_refused(problem, route)),
    }
}

/// A [`Head`]'s headers, as a resolver reads them.
struct Headers<'a, H>(&'a H);

impl<H: Head> scope::HeaderLookup for Headers<'_, H> {
    fn first<'a>(&'a self, name: &'a str) -> Option<&'a [u8]> {
        self.0.header_values(name).next()
    }
}

/// How claimed work ended, for the adapter to answer.
pub enum Ended<R, T, E> {
    /// The handler answered `R` (recorded or released by now); `T` travels beside it.
    Answered(R, T),
    /// The handler failed without an answer (an inner service's error): the key was released.
    Failed(E),
    /// The handler panicked, or its task failed: answer this 500; the key was released.
    Panicked(R),
}

/// What answered a claimed request: the handler itself (the attribute), or a router the
/// layer or middleware sits in front of, which may refuse a request no handler serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// The handler's own answer: settled as it is.
    ByHandler,
    /// Through a router: its refusals (an empty 404, 405 or 501, with no `content-type`)
    /// release the key unrecorded.
    ThroughRouter,
}

/// Whether `response` is how a router refuses a request it routes to no handler: 404, 405 or
/// 501 with no body and no `content-type` (axum's method fallback, actix's resource and
/// default services). A layer or middleware sits in front of the router and cannot ask it in
/// advance which methods a route serves, so such an answer releases the key instead of
/// recording it: the client's correct request with the same key then runs
/// ([the contract](crate::design) §1 passes requests no route executes through untouched). A
/// handler's own empty 404/405/501 is left unrecorded too, which costs only a re-run of a
/// refusal.
pub(crate) fn routing_refusal<R: Reply>(response: R) -> Result<R, R> {
    if !matches!(response.status(), 404 | 405 | 501)
        || response
            .headers()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"))
    {
        return Err(response);
    }
    let (head, body) = response.into_parts();
    let empty = body.exact_len() == Some(0);
    let response = R::from_parts(head, body);
    if empty { Ok(response) } else { Err(response) }
}

/// A claimed handler's whole run: the handler under the renewed lease, then its response
/// recorded or the key released. `handler` yields the response and whatever travels beside it.
///
/// A function returning a block, not an `async fn`: the block keeps each argument once, where
/// an `async fn` keeps its arguments and the copies it rebinds them to (the reservation alone is
/// 232 bytes, and this future is boxed on every claimed request).
pub(crate) fn work<R, T, E>(
    handle: Idempotency,
    mut reservation: Reservation,
    permit: BufferPermit,
    served: Served,
    handler: impl Future<Output = Result<(R, T), E>>,
) -> impl Future<Output = Ended<R, T, E>>
where
    R: Reply,
{
    /// Wakes duplicates waiting for this key (`wait_in_progress`) once it is settled, however
    /// the work ends.
    struct Settled<'a>(&'a Idempotency);
    impl Drop for Settled<'_> {
        fn drop(&mut self) {
            self.0.wake_waiting();
        }
    }
    async move {
        let _settled = Settled(&handle);
        // The handler pinned and run in a block of its own: its bytes are free for the
        // settling's once it ends. Its outcome is taken apart within the block too: a value
        // bound outside it would keep its bytes in this future across the settling's await.
        let (response, extra) = {
            let handler = std::pin::pin!(handler);
            match reservation.run(handler).await {
                Ran::Panicked => {
                    let route = reservation.route();
                    return Ended::Panicked(refuse(&handle, &refusals::panicked(route)));
                }
                Ran::Returned(Err(error)) => {
                    reservation.releasing().await;
                    return Ended::Failed(error);
                }
                Ran::Returned(Ok(answered)) => answered,
            }
        };
        // The handler is done with the request's body.
        drop(permit);
        let response = match served {
            Served::ByHandler => response,
            Served::ThroughRouter => match routing_refusal(response) {
                Ok(refusal) => {
                    tracing::debug!(
                        route = reservation.route(),
                        "the router refused the request (no handler serves it): key released"
                    );
                    reservation.releasing().await;
                    return Ended::Answered(refusal, extra);
                }
                Err(response) => response,
            },
        };
        Ended::Answered(settle(&handle, &mut reservation, response).await, extra)
    }
}

/// Drives claimed work to its end where a client disconnect cannot cancel it: `spawn` puts it
/// in a task of its own (tokio's, or actix's for its `!Send` futures). Work that is done at its
/// first poll has nothing left to cancel, so it is answered without a task (a task costs more
/// than a typical handler on the memory store); there is no await point between that poll and
/// the spawn, so started work always finishes, here or in its task.
pub(crate) async fn drive<W, R, T, E, J, F>(work: Work<W>, spawn: F) -> Ended<R, T, E>
where
    W: Future<Output = Ended<R, T, E>>,
    R: Reply,
    F: FnOnce(Pin<Box<W>>) -> J,
    J: Future<Output = Result<Ended<R, T, E>, tokio::task::JoinError>>,
{
    let Work {
        handle,
        route,
        future: mut work,
    } = work;
    let first = std::future::poll_fn(|cx| {
        Poll::Ready(panic::catch_unwind(AssertUnwindSafe(|| {
            work.as_mut().poll(cx)
        })))
    })
    .await;
    match first {
        Ok(Poll::Ready(ended)) => ended,
        Ok(Poll::Pending) => match spawn(work).await {
            Ok(ended) => ended,
            Err(_) => Ended::Panicked(refuse(&handle, &refusals::task_failed(&route))),
        },
        Err(_) => Ended::Panicked(refuse(&handle, &refusals::task_failed(&route))),
    }
}

/// A claimed request's work for [`drive`], boxed where it is made: the futures around it (the
/// adapter's, the handler's) hold a pointer instead of the work's kilobytes, and do not copy
/// them each time one is moved into the next.
pub(crate) struct Work<W> {
    pub(crate) handle: Idempotency,
    pub(crate) route: Arc<str>,
    pub(crate) future: Pin<Box<W>>,
}
