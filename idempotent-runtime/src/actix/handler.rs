//! The glue `#[idempotent]` expansions call: the rewritten handler takes the request and its raw
//! payload, and the sequence runs around the handler's own extractors and body.

use std::future::Future;

use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};

use super::adapter::{ActixHead, HANDLE_MISSING_FIX, handle_of};
use crate::adapter::{self, Entry, OuterStep, Served};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;

/// The claimed request's context, in the extensions for the handler's own extractors too.
fn publish(req: &HttpRequest, context: Option<&IdempotencyContext>) -> Option<IdempotencyContext> {
    let context = context.cloned();
    if let Some(context) = &context {
        req.extensions_mut().insert(context.clone());
    }
    context
}

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
    let (method, keyed) = (req.method().as_str(), context.is_some());
    let handle = handle_of(&req);
    let handle = match adapter::entry(outer, handle, endpoint, method, route, keyed, FIX) {
        Entry::Answer(answer) => return answer,
        Entry::Outer | Entry::Bypass => {
            return plain(req, payload, context, extract, handler).await;
        }
        Entry::Sequence(handle) => handle,
    };
    req.extensions_mut().insert(OuterStep::of(endpoint));
    let head = ActixHead::matched(&req);
    let buffered = match adapter::front(&handle, endpoint, &head, payload).await {
        adapter::Front::Pass(payload) => return plain(req, payload, None, extract, handler).await,
        adapter::Front::Answer(answer) => return answer,
        adapter::Front::Buffered(buffered) => buffered,
    };
    // The handler's extractors run on the buffered body before the claim, on replays too: an
    // authentication extractor still rejects a caller whatever was recorded, and may publish
    // the caller's identity for the scope.
    let extracted = extract(req.clone(), dev::Payload::from(buffered.body().clone())).await;
    let (claimed, extracted) = match buffered.claim_after(&head, extracted).await {
        Ok(claimed) => claimed,
        Err(answer) => return answer,
    };
    let context = publish(&req, claimed.context());
    let run = async move {
        let response = match extracted {
            Ok(args) => handler(args, context, req).await,
            Err(rejection) => rejection,
        };
        response
    };
    claimed.answer_local(Served::ByHandler, run).await
}

use HANDLE_MISSING_FIX as FIX;

/// The handler on the payload as it came: no sequence (or an outer one's).
async fn plain<A, X, XF, H, HF>(
    req: HttpRequest,
    payload: dev::Payload,
    context: Option<IdempotencyContext>,
    extract: X,
    handler: H,
) -> HttpResponse
where
    X: FnOnce(HttpRequest, dev::Payload) -> XF,
    XF: Future<Output = Result<A, HttpResponse>>,
    H: FnOnce(A, Option<IdempotencyContext>, HttpRequest) -> HF,
    HF: Future<Output = HttpResponse>,
{
    match extract(req.clone(), payload).await {
        Ok(args) => handler(args, context, req).await,
        Err(rejection) => rejection,
    }
}

/// The rewritten enlisted handler's body: as [`handle`], with the transaction handed to
/// `handler` and back, then recorded in and committed.
#[cfg(feature = "postgres")]
pub async fn handle_enlisted<A, X, XF, H, HF>(
    req: HttpRequest,
    payload: web::Payload,
    endpoint: &'static EndpointConfig,
    extract: X,
    handler: H,
) -> HttpResponse
where
    X: FnOnce(HttpRequest, dev::Payload) -> XF,
    XF: Future<Output = Result<A, HttpResponse>>,
    H: FnOnce(A, Option<IdempotencyContext>, HttpRequest, crate::enlisted::EnlistedTx) -> HF
        + 'static,
    HF: Future<Output = (crate::enlisted::EnlistedTx, HttpResponse)> + 'static,
    A: 'static,
{
    let payload = payload.into_inner();
    let route = || req.match_pattern().unwrap_or_default();
    if req.extensions().contains::<OuterStep>() {
        return adapter::enlisted_behind_layer(&route());
    }
    let Some(handle) = handle_of(&req) else {
        return adapter::handle_missing(&route(), FIX);
    };
    req.extensions_mut().insert(OuterStep::of(endpoint));
    let head = ActixHead::matched(&req);
    let buffered = match adapter::front_enlisted(&handle, endpoint, &head, payload).await {
        Ok(buffered) => buffered,
        Err(answer) => return answer,
    };
    // The handler's extractors run on the buffered body before the claim, on replays too: an
    // authentication extractor still rejects a caller whatever was recorded, and may publish
    // the caller's identity for the scope.
    let extracted = extract(req.clone(), dev::Payload::from(buffered.body().clone())).await;
    let (claimed, extracted) = match buffered.claim_after(&head, extracted).await {
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
