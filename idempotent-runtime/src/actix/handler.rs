//! The glue `#[idempotent]` expansions call: the rewritten handler takes the request and its raw
//! payload, and the sequence runs around the handler's own extractors and body.

use std::future::Future;

use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};

use super::adapter::{ActixHead, HANDLE_MISSING_FIX as FIX, handle_of, publish};
use crate::adapter::{self, Entry, Extracted, OuterStep, Served};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;

/// The rewritten handler's body. `extract` runs the original extractors, in order, on the
/// payload it is given; `handler` runs the original function on their values and the claimed
/// request's context, in a task of its own.
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
    H: FnOnce(A, Option<IdempotencyContext>, HttpRequest) -> HF + 'static,
    HF: Future<Output = HttpResponse> + 'static,
    A: 'static,
{
    let payload = payload.into_inner();
    let outer = req.extensions().get::<OuterStep>().copied();
    // Under an outer middleware, the context (if any) is the one it left.
    let context = outer.and_then(|_| req.extensions().get::<IdempotencyContext>().cloned());
    let route = || req.match_pattern().unwrap_or_default();
    let method = req.method().as_str();
    let keyed = |name: &str| context.is_some() || req.headers().contains_key(name);
    let handle = handle_of(&req);
    let handle = match adapter::entry(outer, handle, endpoint, method, route, keyed, FIX) {
        Entry::Answer(answer) => return answer,
        Entry::Outer | Entry::Bypass => {
            return match extract(req.clone(), payload).await {
                Ok(args) => handler(args, context, req).await,
                Err(rejection) => rejection,
            };
        }
        Entry::Sequence(handle) => handle,
    };
    req.extensions_mut().insert(OuterStep::of(endpoint));
    let head = ActixHead::matched(&req);
    // The handler's extractors run on the buffered body before the claim, on replays too: an
    // authentication extractor still rejects a caller whatever was recorded, and may publish
    // the caller's identity for the scope.
    let extractors = |payload| extract(req.clone(), payload);
    let extracted = adapter::prepare_extracting(&handle, endpoint, &head, payload, extractors);
    let (claimed, extracted) = match extracted.await {
        Extracted::Pass(Ok(args)) => return handler(args, None, req).await,
        Extracted::Pass(Err(rejection)) | Extracted::Answer(rejection) => return rejection,
        Extracted::Claimed(claimed, extracted) => (claimed, extracted),
    };
    let context = publish(&req, claimed.context());
    let run = async move {
        match extracted {
            Ok(args) => handler(args, context, req).await,
            Err(rejection) => rejection,
        }
    };
    claimed.answer_local(Served::ByHandler, run).await
}

/// The rewritten enlisted handler's body: as [`handle`], with the transaction handed to
/// `handler` and back, then recorded in and committed.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn handle_enlisted<DB, A, X, XF, H, HF>(
    req: HttpRequest,
    payload: web::Payload,
    endpoint: &'static EndpointConfig,
    extract: X,
    handler: H,
) -> HttpResponse
where
    X: FnOnce(HttpRequest, dev::Payload) -> XF,
    XF: Future<Output = Result<A, HttpResponse>>,
    DB: crate::enlisted::Enlistable,
    H: FnOnce(A, Option<IdempotencyContext>, HttpRequest, crate::enlisted::EnlistedTx<DB>) -> HF
        + 'static,
    HF: Future<Output = (crate::enlisted::EnlistedTx<DB>, HttpResponse)> + 'static,
    A: 'static,
{
    let payload = payload.into_inner();
    let outer = req.extensions().get::<OuterStep>().copied();
    let route = req.match_pattern().unwrap_or_default();
    let handle = match adapter::enlisted_entry(outer, handle_of(&req), &route, FIX) {
        Ok(handle) => handle,
        Err(answer) => return answer,
    };
    req.extensions_mut().insert(OuterStep::of(endpoint));
    let head = ActixHead::matched(&req);
    let extractors = |payload| extract(req.clone(), payload);
    let enlisted = adapter::prepare_enlisted_extracting::<DB, _, _, _, _, _, _>(
        &handle, endpoint, &head, payload, extractors,
    );
    let (claimed, extracted) = match enlisted.await {
        Ok(claimed) => claimed,
        Err(answer) => return answer,
    };
    let context = publish(&req, claimed.context());
    let run = move |tx| async move {
        match extracted {
            Ok(args) => handler(args, context, req, tx).await,
            // A recordable rejection (malformed JSON, say) is this request's answer.
            Err(rejection) => (tx, rejection),
        }
    };
    claimed.run_local(run).await
}
