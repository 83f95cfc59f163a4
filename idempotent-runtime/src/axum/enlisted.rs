//! The extractor `#[idempotent(enlisted)]` wraps a handler's last parameter in: the same
//! pipeline as [`Idempotent`](super::Idempotent), claiming the key inside the transaction the
//! handler then writes through (see [`crate::enlisted`]).

use std::marker::PhantomData;

use axum::extract::{FromRequest, MatchedPath, Request};
use axum::response::{IntoResponse, Response};

use super::adapter::{self, HANDLE_MISSING_FIX, Prepared};
use super::extract::{FromState, HandleSource, Via};
use crate::config::{Endpoint, EndpointConfig};
use crate::context::IdempotencyContext;
use crate::enlisted::{EnlistedTx, Held};
use crate::handle::Idempotency;
use crate::pipeline::{self, Admitted, Handled};

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
pub struct EnlistedIdempotent<T, Src = FromState, E: Endpoint = ()> {
    value: T,
    context: Option<IdempotencyContext>,
    session: Session,
    _source: PhantomData<fn() -> (Src, E)>,
}

struct Session {
    handle: Idempotency,
    claimed: Admitted<Held>,
}

impl<T, Src, E: Endpoint> EnlistedIdempotent<T, Src, E> {
    /// The endpoint settings `E` names.
    pub const ENDPOINT: &'static EndpointConfig = E::CONFIG;

    /// Runs the handler in its own task (a client that disconnects never cancels it) with the
    /// transaction, which it hands back with its response; then commits or rolls back.
    pub async fn run<F, Fut>(self, handler: F) -> Response
    where
        F: FnOnce(EnlistedTx, T, Option<IdempotencyContext>) -> Fut + Send + 'static,
        Fut: Future<Output = (EnlistedTx, Response)> + Send + 'static,
        T: Send + 'static,
    {
        let Session { handle, claimed } = self.session;
        let Admitted {
            held,
            permit,
            route,
            span,
            ..
        } = claimed;
        let (value, context) = (self.value, self.context);
        let handler = move |tx| handler(tx, value, context);
        let work = pipeline::enlisted_work(handle.clone(), held, permit, route.clone(), handler);
        let work = tracing::Instrument::instrument(work, span);
        adapter::drive(&handle, &route, work).await
    }
}

impl<S, M, T, Src, E: Endpoint> FromRequest<S, Via<M>> for EnlistedIdempotent<T, Src, E>
where
    T: FromRequest<S, M> + Send,
    S: Send + Sync,
    Src: HandleSource<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let route = request.extensions().get::<MatchedPath>();
        let route = route.map_or("", MatchedPath::as_str);
        if request.extensions().get::<Handled>().is_some() {
            return Err(pipeline::enlisted_behind_layer(route));
        }
        let Some(handle) = Src::handle(request.extensions(), state) else {
            return Err(pipeline::handle_missing(route, HANDLE_MISSING_FIX));
        };
        let (request, claimed) =
            match adapter::prepare_enlisted(&handle, Self::ENDPOINT, request).await? {
                Prepared::Claimed(request, claimed) => (request, claimed),
                Prepared::Pass(_) => {
                    unreachable!("enlisted mode reads every body before it begins")
                }
            };
        match T::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)
        {
            Ok(value) => Ok(Self {
                value,
                context: claimed.context.clone(),
                session: Session { handle, claimed },
                _source: PhantomData,
            }),
            // The extractor's rejection (malformed JSON, say) is the request's answer, recorded
            // like any 4xx so the retry gets the same rejection.
            Err(rejection) => {
                let Held { tx, settle } = claimed.held;
                Err(pipeline::settle_enlisted(&handle, settle, tx, rejection).await)
            }
        }
    }
}
