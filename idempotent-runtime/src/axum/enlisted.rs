//! The extractor `#[idempotent(enlisted)]` wraps a handler's last parameter in: the same
//! pipeline as [`Idempotent`](super::Idempotent), claiming the key inside the transaction the
//! handler then writes through (see [`crate::enlisted`]).

use std::marker::PhantomData;

use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};

use super::adapter::{HANDLE_MISSING_FIX, head, params, route_of};
use super::extract::{HandleSource, Via};
use crate::adapter::http::prepare_enlisted;
use crate::adapter::{self, ClaimedTx, OuterStep};
use crate::config::{Endpoint, EndpointConfig};
use crate::context::IdempotencyContext;
use crate::enlisted::{Enlistable, EnlistedTx};

/// The wrapper `#[idempotent(enlisted)]` puts around a handler's last parameter. Extracting it
/// opens the transaction and claims the key in it; [`run`](Self::run) hands the transaction to
/// the handler, then records the response in it and commits before the response is returned.
/// `DB` is the database of the handler's [`EnlistedTx`] (PostgreSQL for a plain `EnlistedTx`).
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
pub struct EnlistedIdempotent<T, Src, E: Endpoint, DB: Enlistable> {
    value: T,
    claimed: ClaimedTx<DB>,
    _source: PhantomData<fn() -> (Src, E)>,
}

impl<T, Src, E: Endpoint, DB: Enlistable> EnlistedIdempotent<T, Src, E, DB> {
    /// The endpoint settings `E` names.
    pub const ENDPOINT: &'static EndpointConfig = E::CONFIG;

    /// Runs the handler in its own task (a client that disconnects never cancels it) with the
    /// transaction, which it hands back with its response; then commits or rolls back.
    pub async fn run<F, Fut>(self, handler: F) -> Response
    where
        F: FnOnce(EnlistedTx<DB>, T, Option<IdempotencyContext>) -> Fut + Send + 'static,
        Fut: Future<Output = (EnlistedTx<DB>, Response)> + Send + 'static,
        T: Send + 'static,
    {
        let (value, context) = (self.value, self.claimed.context().cloned());
        self.claimed
            .run(move |tx| handler(tx, value, context))
            .await
    }
}

impl<S, M, T, Src, E: Endpoint, DB: Enlistable> FromRequest<S, Via<M>>
    for EnlistedIdempotent<T, Src, E, DB>
where
    T: FromRequest<S, M> + Send,
    S: Send + Sync,
    Src: HandleSource<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (extensions, fix) = (request.extensions(), HANDLE_MISSING_FIX);
        let outer = extensions.get::<OuterStep>().copied();
        let handle = Src::handle(extensions, state);
        let handle = adapter::enlisted_entry::<Response>(outer, handle, route_of(extensions), fix)?;
        let prepared = prepare_enlisted::<DB, _, _>(&handle, Self::ENDPOINT, request, params, head);
        let (request, claimed) = prepared.await?;
        let extracted = T::from_request(request, state).await;
        match extracted.map_err(IntoResponse::into_response) {
            Ok(value) => Ok(Self {
                value,
                claimed,
                _source: PhantomData,
            }),
            // The extractor's rejection (malformed JSON, say) is the request's answer, recorded
            // like any 4xx so the retry gets the same rejection.
            Err(rejection) => Err(claimed.settle(rejection).await),
        }
    }
}
