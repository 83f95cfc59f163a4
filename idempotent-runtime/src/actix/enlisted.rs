//! `#[idempotent(enlisted)]` for actix-web: the same pipeline as the detached attribute, claiming
//! the key inside the transaction the handler then writes through (see [`crate::enlisted`]).

use std::future::Future;
use std::panic::AssertUnwindSafe;

use actix_web::body::{BodySize, BoxBody, MessageBody as _};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};
use futures_util::FutureExt as _;

use super::pipeline::{self, Claimed, Collected, Handled, Read, Target, problem_response};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::enlisted::{self, Enlisted, EnlistedTx, Held, Settle};
use crate::record;
use crate::runtime::{BufferPermit, Idempotency};
use crate::store::RecordedResponse;

/// The rewritten enlisted handler's body: as [`super::__private::handle`], with the
/// transaction handed to `handler` and back, then recorded in and committed.
pub async fn handle<A, X, XF, H, HF>(
    req: HttpRequest,
    payload: web::Payload,
    endpoint: &'static EndpointConfig,
    extract: X,
    handler: H,
) -> HttpResponse
where
    X: FnOnce(HttpRequest, dev::Payload) -> XF,
    XF: Future<Output = Result<A, HttpResponse>>,
    H: FnOnce(A, Option<IdempotencyContext>, HttpRequest, EnlistedTx) -> HF + 'static,
    HF: Future<Output = (EnlistedTx, HttpResponse)> + 'static,
    A: 'static,
{
    let payload = payload.into_inner();
    let target = Target::matched(&req);
    let route = target.route.clone().unwrap_or_default();
    if req.extensions().contains::<Handled>() {
        tracing::error!(
            route,
            "#[idempotent(enlisted)] handler inside IdempotencyMiddleware: the middleware already \
             claimed the key outside any transaction; remove the middleware from this route or \
             `enlisted` from the handler"
        );
        return HttpResponse::InternalServerError()
            .content_type("text/plain; charset=utf-8")
            .body("an enlisted handler cannot run inside the idempotency middleware");
    }
    let Some(store) = pipeline::store_of(&req) else {
        return pipeline::store_missing(&route);
    };
    req.extensions_mut().insert(Handled);
    let buffered = match pipeline::read(&req, payload, &store, endpoint, target).await {
        Read::Untouched(payload) => {
            let Held { tx, mut settle } = match enlisted::begin_unkeyed(&store, &route).await {
                Ok(held) => held,
                Err(problem) => return problem_response(&problem),
            };
            let tx = settle.hand_out(tx);
            // A rejection drops the transaction, which rolls back: nothing ran.
            let args = match extract(req.clone(), payload).await {
                Ok(args) => args,
                Err(rejection) => return rejection,
            };
            return execute(store, settle, None, route, handler(args, None, req, tx)).await;
        }
        Read::Respond(response) => return response,
        Read::Buffered(buffered) => buffered,
    };
    // Extractors run before the claim, on replays too, as in detached mode.
    let config = store.config();
    let extracted = match extract(req.clone(), dev::Payload::from(buffered.body.clone())).await {
        Err(rejection) if !config.is_recordable_status(rejection.status().as_u16()) => {
            return rejection;
        }
        extracted => extracted,
    };
    let run = match pipeline::claim_with::<Enlisted>(&req, &store, buffered).await {
        Claimed::Respond(response) => return response,
        Claimed::Run(run) => run,
    };
    let Held { tx, mut settle } = run.reservation;
    let tx = settle.hand_out(tx);
    let context = run.context;
    let fut = async move {
        match extracted {
            Ok(args) => handler(args, Some(context), req, tx).await,
            // A recordable rejection (malformed JSON, say) is this request's answer.
            Err(rejection) => (tx, rejection),
        }
    };
    execute(run.store, settle, run.permit, run.route, fut).await
}

/// Runs the handler in a task of its own (a client that disconnects never cancels it), then
/// commits or rolls back.
async fn execute<F>(
    store: Idempotency,
    settle: Settle,
    permit: Option<BufferPermit>,
    route: String,
    handler: F,
) -> HttpResponse
where
    F: Future<Output = (EnlistedTx, HttpResponse)> + 'static,
{
    let task = actix_web::rt::spawn(async move {
        let _request_body = permit;
        // A statement of its own, so a panicked future (and the transaction in it) is dropped
        // before the rollback waits for the transaction to come back.
        let outcome = AssertUnwindSafe(handler).catch_unwind().await;
        match outcome {
            Ok((tx, response)) => settle_response(&store, settle, tx, response).await,
            Err(_) => {
                settle.panicked().await;
                problem_response(&store.panicked(&route))
            }
        }
    });
    match task.await {
        Ok(response) => response,
        Err(_join_error) => HttpResponse::InternalServerError().finish(),
    }
}

/// The final status decides: recordable → record in the transaction and commit, then answer
/// (503 if the commit failed); anything else → roll back and answer. A recordable status whose
/// response cannot be recorded rolls back and answers 500.
async fn settle_response(
    store: &Idempotency,
    settle: Settle,
    tx: EnlistedTx,
    response: HttpResponse,
) -> HttpResponse {
    let config = store.config();
    let status = response.status().as_u16();
    if !config.is_recordable_status(status) {
        settle.rollback(tx, "final status not recordable").await;
        return response;
    }
    if !settle.is_keyed() {
        return match settle.commit(tx, None).await {
            Ok(()) => response,
            Err(problem) => problem_response(&problem),
        };
    }
    let route = settle.route().to_owned();
    let headers = record::recorded_headers(
        config,
        response
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    );
    let cap = settle.max_response();
    let (head, mut body) = response.into_parts();
    let fits = !matches!(body.size(), BodySize::Sized(len) if len > cap as u64);
    let (Some(headers), true) = (headers, fits) else {
        settle.rollback(tx, "response not recordable").await;
        return problem_response(&enlisted::not_recordable(&route));
    };
    let empty = matches!(body.size(), BodySize::None);
    let bytes = match pipeline::collect(&mut body, cap, store).await {
        Collected::Complete(bytes) => bytes,
        Collected::Partial { .. } => {
            settle.rollback(tx, "response over max_response").await;
            return problem_response(&enlisted::not_recordable(&route));
        }
    };
    let recorded = RecordedResponse {
        status,
        headers,
        body: bytes.clone(),
    };
    match settle.commit(tx, Some(&recorded)).await {
        Ok(()) if empty => head.set_body(body),
        Ok(()) => head.set_body(BoxBody::new(bytes)),
        Err(problem) => problem_response(&problem),
    }
}
