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

/// The early store assertion on the `State<S>` a handler names: fails with
/// "`Idempotency: FromRef<S>` is not satisfied" when the state cannot provide the store.
pub fn assert_state_provides_store<S>()
where
    Idempotency: FromRef<S>,
{
}
