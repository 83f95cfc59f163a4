//! The extractor `#[idempotent(enlisted)]` wraps a handler's last parameter in: the same
//! pipeline as [`Idempotent`](super::Idempotent), claiming the key inside the transaction the
//! handler then writes through (see [`crate::enlisted`]).

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;

use axum::body::Body;
use axum::extract::{FromRequest, MatchedPath, Request};
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt as _;
use http::StatusCode;
use http_body::Body as _;

use super::extract::{FromState, StoreSource, Via};
use super::pipeline::{self, LayerApplied, Prepared, Read};
use crate::config::EndpointConfig;
use crate::context::IdempotencyContext;
use crate::enlisted::{self, Enlisted, EnlistedTx, Held, Settle};
use crate::record;
use crate::runtime::{BufferPermit, Idempotency};
use crate::store::RecordedResponse;

/// The wrapper `#[idempotent(enlisted)]` puts around a handler's last parameter. Extracting it
/// opens the transaction and claims the key in it; [`run`](Self::run) hands the transaction to
/// the handler, then records the response in it and commits before the response is returned.
/// The attribute writes it for you; see [`crate::enlisted`] for the handler side:
///
/// ```no_run
/// use axum::http::StatusCode;
/// use idempotent_runtime::axum::idempotent;
/// use idempotent_runtime::enlisted::EnlistedTx;
///
/// #[idempotent(require_key, enlisted)]
/// async fn close_ticket(tx: &mut EnlistedTx, id: String) -> StatusCode {
///     match sqlx::query("UPDATE tickets SET closed = true WHERE id = $1")
///         .bind(id)
///         .execute(tx.conn())
///         .await
///     {
///         Ok(_) => StatusCode::NO_CONTENT,
///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
///     }
/// }
/// ```
#[must_use]
pub struct EnlistedIdempotent<
    T,
    Src = FromState,
    const REQUIRE_KEY: bool = false,
    const LEASE_MS: u64 = 0,
    const RETENTION_MS: u64 = 0,
    const MAX_BODY: u64 = 0,
    const MAX_RESPONSE: u64 = 0,
> {
    value: T,
    context: Option<IdempotencyContext>,
    session: Session,
    _source: PhantomData<fn() -> Src>,
}

struct Session {
    handle: Idempotency,
    held: Held,
    permit: Option<BufferPermit>,
    route: String,
}

impl<T, Src, const R: bool, const L: u64, const RT: u64, const MB: u64, const MR: u64>
    EnlistedIdempotent<T, Src, R, L, RT, MB, MR>
{
    /// The endpoint settings these const parameters spell.
    pub const ENDPOINT: EndpointConfig = super::Idempotent::<T, Src, R, L, RT, MB, MR>::ENDPOINT;

    /// Runs the handler in its own task (a client that disconnects never cancels it) with the
    /// transaction, which it hands back with its response; then commits or rolls back.
    pub async fn run<F, Fut>(self, handler: F) -> Response
    where
        F: FnOnce(EnlistedTx, T, Option<IdempotencyContext>) -> Fut,
        Fut: Future<Output = (EnlistedTx, Response)> + Send + 'static,
    {
        let Session {
            handle,
            held: Held { tx, mut settle },
            permit,
            route,
        } = self.session;
        let tx = settle.hand_out(tx);
        let future = handler(tx, self.value, self.context);
        let task = tokio::spawn(async move {
            let _request_body = permit;
            // A statement of its own, so a panicked future (and the transaction in it) is
            // dropped before the rollback waits for the transaction to come back.
            let outcome = AssertUnwindSafe(future).catch_unwind().await;
            match outcome {
                Ok((tx, response)) => settle_response(&handle, settle, tx, response).await,
                Err(_) => {
                    settle.panicked().await;
                    pipeline::problem(&handle.panicked(&route))
                }
            }
        });
        match task.await {
            Ok(response) => response,
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }
}

impl<S, M, T, Src, const R: bool, const L: u64, const RT: u64, const MB: u64, const MR: u64>
    FromRequest<S, Via<M>> for EnlistedIdempotent<T, Src, R, L, RT, MB, MR>
where
    T: FromRequest<S, M> + Send,
    S: Send + Sync,
    Src: StoreSource<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        if request.extensions().get::<LayerApplied>().is_some() {
            tracing::error!(
                route,
                "#[idempotent(enlisted)] handler behind IdempotencyLayer: the layer already \
                 claimed the key outside any transaction; remove the layer from this route or \
                 `enlisted` from the handler"
            );
            return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
        }
        let Some(handle) = Src::store(request.extensions(), state) else {
            tracing::error!(
                "#[idempotent] handler found no Idempotency in the request extensions: add \
                 `.layer(Extension(store))` to the router"
            );
            return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
        };
        let session = |held, permit, route| Session {
            handle: handle.clone(),
            held,
            permit,
            route,
        };
        match pipeline::prepare_with::<Enlisted>(&handle, &Self::ENDPOINT, request).await {
            Prepared::Answer(response) => Err(response),
            Prepared::Pass(request) => {
                let held = enlisted::begin_unkeyed(&handle, &route)
                    .await
                    .map_err(|p| pipeline::problem(&p))?;
                // A rejection drops the transaction, which rolls back: nothing ran.
                let value = T::from_request(request, state)
                    .await
                    .map_err(IntoResponse::into_response)?;
                Ok(Self {
                    value,
                    context: None,
                    session: session(held, None, route),
                    _source: PhantomData,
                })
            }
            Prepared::Claimed(claimed) => {
                let pipeline::Claimed {
                    request,
                    reservation: held,
                    context,
                    permit,
                    route,
                } = *claimed;
                let extracted = T::from_request(request, state)
                    .await
                    .map_err(IntoResponse::into_response);
                match extracted {
                    Ok(value) => Ok(Self {
                        value,
                        context: Some(context),
                        session: session(held, permit, route),
                        _source: PhantomData,
                    }),
                    // The extractor's rejection (malformed JSON, say) is the request's answer,
                    // recorded like any 4xx so the retry gets the same rejection.
                    Err(rejection) => {
                        let Held { tx, settle } = held;
                        Err(settle_response(&handle, settle, tx, rejection).await)
                    }
                }
            }
        }
    }
}

/// The final status decides: recordable → record in the transaction and commit, then answer
/// (503 if the commit failed); anything else → roll back and answer. A recordable status whose
/// response cannot be recorded rolls back and answers 500.
async fn settle_response(
    handle: &Idempotency,
    settle: Settle,
    tx: EnlistedTx,
    response: Response,
) -> Response {
    let config = handle.config();
    let status = response.status().as_u16();
    if !config.is_recordable_status(status) {
        settle.rollback(tx, "final status not recordable").await;
        return response;
    }
    if !settle.is_keyed() {
        return match settle.commit(tx, None).await {
            Ok(()) => response,
            Err(problem) => pipeline::problem(&problem),
        };
    }
    let route = settle.route().to_owned();
    let cap = settle.max_response();
    let (parts, body) = response.into_parts();
    let headers = record::recorded_headers(
        config,
        parts
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    );
    let fits = body.size_hint().exact().is_none_or(|n| n <= cap as u64);
    let (Some(headers), true) = (headers, fits) else {
        settle.rollback(tx, "response not recordable").await;
        return pipeline::problem(&enlisted::not_recordable(&route));
    };
    match pipeline::read_capped(handle, body, cap).await {
        Read::Complete(bytes) => {
            let recorded = RecordedResponse {
                status,
                headers,
                body: bytes.clone(),
            };
            match settle.commit(tx, Some(&recorded)).await {
                Ok(()) => Response::from_parts(parts, Body::from(bytes)),
                Err(problem) => pipeline::problem(&problem),
            }
        }
        Read::Unrecordable(_) => {
            settle.rollback(tx, "response over max_response").await;
            pipeline::problem(&enlisted::not_recordable(&route))
        }
    }
}
