//! Compile-time checks the expansion calls, spanned at the user's types, with messages that say
//! what is wrong and how to fix it, and that name none of these items.

use axum::extract::FromRef;

use crate::Idempotency;

/// A state a `#[idempotent]` handler can find its [`Idempotency`] in: every `S` with
/// `Idempotency: FromRef<S>`. Implement [`FromRef`] for the handle (or derive it on the state),
/// never this trait. The macro checks it on the `State<S>` a handler names, so a state without
/// the handle fails there, with the fix, rather than at `.route(…)` with axum's `Handler` error.
#[diagnostic::on_unimplemented(
    message = "the state `{Self}` does not provide the `Idempotency` handle #[idempotent] needs",
    label = "`Idempotency` cannot be taken from this state",
    note = "give the router the handle as its state (`.with_state(idempotency)`), or implement \
            `FromRef<{Self}> for Idempotency` (or `#[derive(FromRef)]` on the state with an \
            `Idempotency` field), or take `Extension<Idempotency>` in the handler and add the handle \
            with `.layer(Extension(idempotency))`"
)]
pub trait ProvidesIdempotency {
    /// The expansion's check: calling it needs `Self: ProvidesIdempotency`.
    #[doc(hidden)]
    fn provides_idempotency() {}

    /// The handle in this state.
    #[doc(hidden)]
    fn idempotency(&self) -> Idempotency;
}

// The impl's bound (`FromRef`) is axum's, and would lead the reader there instead of to the fix.
#[diagnostic::do_not_recommend]
impl<S> ProvidesIdempotency for S
where
    Idempotency: FromRef<S>,
{
    fn idempotency(&self) -> Idempotency {
        Idempotency::from_ref(self)
    }
}
