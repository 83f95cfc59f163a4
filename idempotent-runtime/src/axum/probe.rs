//! Compile-time checks the expansion calls, spanned at the user's types, with messages that say
//! what is wrong and how to fix it, and that name none of these items.

use std::marker::PhantomData;

use axum::extract::FromRef;

use crate::handle::Idempotency;

/// Request bodies that are streams.
pub trait StreamingBody {}
impl StreamingBody for axum::body::Body {}
impl StreamingBody for axum::body::BodyDataStream {}

/// The probe: `BodyProbe::<T>::STREAMS` is this inherent constant when `T` is a streaming body
/// and [`CheckOther::STREAMS`] for every other type. The expansion asserts it is `false` in a
/// constant, whose failure carries the message on the user's type.
pub struct BodyProbe<T: ?Sized>(PhantomData<T>);

impl<T: StreamingBody + ?Sized> BodyProbe<T> {
    /// `T` streams the request body.
    pub const STREAMS: bool = true;
}

/// The probe's answer for every type that is not a streaming body (in scope through
/// `use … as _`).
pub trait CheckOther {
    /// `T` does not stream the request body.
    const STREAMS: bool = false;
}
impl<T: ?Sized> CheckOther for BodyProbe<T> {}

/// A state a `#[idempotent]` handler can find its [`Idempotency`] in: every `S` with
/// `Idempotency: FromRef<S>`. Implement [`FromRef`] for the handle (or derive it on the state),
/// never this trait. The macro checks it on the `State<S>` a handler names, so a state without
/// the handle fails there, with the fix, rather than at `.route(…)` with axum's `Handler` error.
#[diagnostic::on_unimplemented(
    message = "the state `{Self}` does not provide the `Idempotency` handle #[idempotent] needs",
    label = "`Idempotency` cannot be taken from this state",
    note = "implement `FromRef<{Self}> for Idempotency` (or `#[derive(FromRef)]` on the state with an \
            `Idempotency` field), or take `Extension<Idempotency>` in the handler and add the handle \
            with `.layer(Extension(idempotency))`"
)]
pub trait ProvidesIdempotency {
    /// The expansion's check: calling it needs `Self: ProvidesIdempotency`.
    #[doc(hidden)]
    fn provides_idempotency() {}
}

// The impl's bound (`FromRef`) is axum's, and would lead the reader there instead of to the fix.
#[diagnostic::do_not_recommend]
impl<S> ProvidesIdempotency for S where Idempotency: FromRef<S> {}
