//! The glue `#[idempotent]` expansions call: the rewritten handler takes the request and its raw
//! payload, and the pipeline runs around the handler's own extractors and body.

use std::convert::Infallible;
use std::future::Future;

use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev, web};

use super::adapter::{self, ActixHead, HANDLE_MISSING_FIX};
use crate::adapter::{self as sequence, Ended, Served};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::pipeline::{self, Handled};
#[cfg(feature = "postgres")]
use enlisted::{Prepared, prepare, request_span};

/// The enlisted path's steps before the handler, on the pipeline's enlisted claim mode.
#[cfg(feature = "postgres")]
mod enlisted {
    use std::future::Future;

    use actix_web::{HttpMessage, HttpRequest, HttpResponse, dev};

    use super::super::adapter::{self, ActixHead, HANDLE_MISSING_FIX};
    use crate::config::EndpointConfig;
    use crate::handle::Idempotency;
    use crate::pipeline::{self, Admitted, ClaimMode, Front, Handled};

    /// A request after the steps before the handler.
    // Moved once, from `prepare` to its caller: boxing the large variant would cost every claimed
    // request an allocation to save a copy of a few hundred bytes.
    #[allow(clippy::large_enum_variant)]
    pub(super) enum Prepared<H, A> {
        /// No key on an optional endpoint: the extractors' values, from the untouched payload.
        Pass(A),
        /// The key is held; the extractors ran on the buffered body (a recordable rejection is
        /// this request's answer).
        Claimed(Idempotency, Admitted<H>, Result<A, HttpResponse>),
    }

    /// Key → body → the handler's extractors → scope → claim. The extractors run before the claim,
    /// on replays too, so an authentication extractor still rejects a caller whatever was
    /// recorded, and may publish the caller's identity for the scope. `Err` is the answer.
    pub(super) async fn prepare<M, A, X, XF>(
        req: &HttpRequest,
        payload: dev::Payload,
        endpoint: &EndpointConfig,
        extract: X,
    ) -> Result<Prepared<M::Held, A>, HttpResponse>
    where
        M: ClaimMode,
        X: FnOnce(HttpRequest, dev::Payload) -> XF,
        XF: Future<Output = Result<A, HttpResponse>>,
    {
        let head = ActixHead::matched(req);
        let route = head.route.as_deref().unwrap_or("");
        let Some(handle) = adapter::handle_of(req) else {
            return Err(pipeline::handle_missing(route, HANDLE_MISSING_FIX));
        };
        let require_key = endpoint.require_key;
        req.extensions_mut().insert(Handled { require_key });
        let buffered = match pipeline::front::<M, _, _>(&handle, endpoint, &head, payload).await {
            Front::Pass(payload) => return extract(req.clone(), payload).await.map(Prepared::Pass),
            Front::Refuse(problem) => return Err(pipeline::refuse(&handle, &problem)),
            Front::Buffered(buffered) => buffered,
        };
        let (config, recording) = (handle.config(), endpoint.resolve(handle.config()).recording);
        let extracted = match extract(req.clone(), dev::Payload::from(buffered.body.clone())).await
        {
            Err(rejection)
                if !recording.is_recordable_status(config, rejection.status().as_u16()) =>
            {
                return Err(rejection);
            }
            extracted => extracted,
        };
        let claimed = pipeline::claim::<M, _, HttpResponse>(&handle, &head, buffered).await?;
        if let Some(context) = &claimed.context {
            req.extensions_mut().insert(context.clone());
        }
        Ok(Prepared::Claimed(handle, claimed, extracted))
    }

    /// The request's span ([`crate::observe`]), named after its route pattern.
    pub(super) fn request_span(req: &HttpRequest) -> tracing::Span {
        crate::observe::request_span(req.match_pattern().as_deref().unwrap_or(""))
    }
}

fn answer(ended: Ended<HttpResponse, (), Infallible>) -> HttpResponse {
    match ended {
        Ended::Answered(response, ()) | Ended::Panicked(response) => response,
        Ended::Failed(never) => match never {},
    }
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
    let outer = req.extensions().get::<Handled>().copied();
    if let Some(outer) = outer {
        // An outer middleware decided; the context, if any, is its.
        let context = req.extensions().get::<IdempotencyContext>().cloned();
        if endpoint.require_key && !outer.require_key {
            let route = req.match_pattern().unwrap_or_default();
            let handle = adapter::handle_of(&req);
            let keyed = context.is_some();
            if let Some(refusal) = pipeline::required_under_optional(handle.as_ref(), &route, keyed)
            {
                return refusal;
            }
        }
        return match extract(req.clone(), payload).await {
            Ok(args) => handler(args, context, req).await,
            Err(rejection) => rejection,
        };
    }
    let Some(handle) = adapter::handle_of(&req) else {
        // Without a handle, a method the endpoint does not apply to needs none.
        if !endpoint.applies_to(None, req.method().as_str()) {
            return match extract(req.clone(), payload).await {
                Ok(args) => handler(args, None, req).await,
                Err(rejection) => rejection,
            };
        }
        let route = req.match_pattern().unwrap_or_default();
        return pipeline::handle_missing(&route, HANDLE_MISSING_FIX);
    };
    let require_key = endpoint.require_key;
    req.extensions_mut().insert(Handled { require_key });
    let head = ActixHead::matched(&req);
    let buffered = match sequence::front(&handle, endpoint, &head, payload).await {
        sequence::Front::Pass(payload) => {
            return match extract(req.clone(), payload).await {
                Ok(args) => handler(args, None, req).await,
                Err(rejection) => rejection,
            };
        }
        sequence::Front::Answer(answer) => return answer,
        sequence::Front::Buffered(buffered) => buffered,
    };
    // The handler's extractors run on the buffered body before the claim, on replays too: an
    // authentication extractor still rejects a caller whatever was recorded, and may publish
    // the caller's identity for the scope. A rejection that would not be recorded is answered
    // without claiming.
    let extracted = match extract(req.clone(), dev::Payload::from(buffered.body().clone())).await {
        Err(rejection) if !buffered.records(rejection.status().as_u16()) => return rejection,
        extracted => extracted,
    };
    let claimed = match buffered.claim(&head).await {
        Ok(claimed) => claimed,
        Err(answer) => return answer,
    };
    let context = claimed.context().cloned();
    if let Some(context) = &context {
        req.extensions_mut().insert(context.clone());
    }
    let run = async move {
        let response = match extracted {
            Ok(args) => handler(args, context, req).await,
            Err(rejection) => rejection,
        };
        Ok((response, ()))
    };
    answer(claimed.run_local(Served::ByHandler, run).await)
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
    use tracing::Instrument as _;
    let payload = payload.into_inner();
    if req.extensions().contains::<Handled>() {
        let route = req.match_pattern().unwrap_or_default();
        return pipeline::enlisted_behind_layer(&route);
    }
    let enlisted = prepare::<pipeline::Enlisted, _, _, _>(&req, payload, endpoint, extract);
    let (handle, claimed, extracted) = match enlisted.instrument(request_span(&req)).await {
        Err(answer) => return answer,
        Ok(Prepared::Claimed(handle, claimed, extracted)) => (handle, claimed, extracted),
        Ok(Prepared::Pass(_)) => unreachable!("enlisted mode reads every body before it begins"),
    };
    let pipeline::Admitted {
        held,
        permit,
        context,
        route,
        span,
        ..
    } = claimed;
    let run = move |tx| async move {
        match extracted {
            Ok(args) => handler(args, context, req, tx).await,
            // A recordable rejection (malformed JSON, say) is this request's answer.
            Err(rejection) => (tx, rejection),
        }
    };
    let work =
        pipeline::enlisted_work(handle.clone(), held, permit, route.clone(), run).instrument(span);
    answer(adapter::drive(&handle, &route, work).await)
}
