//! The body probe `#[idempotent]` expansions call through `__private`, for both frameworks.

use std::marker::PhantomData;

/// The compile-time check that a handler's extractor does not stream the request body, for
/// both frameworks: `BodyProbe::<T>::STREAMS` is this inherent constant when `T` streams the
/// body and [`NotStreaming::STREAMS`] for every other type. The expansion asserts it is
/// `false` in a constant, whose failure carries the message on the user's type and names none
/// of these items.
pub struct BodyProbe<T: ?Sized>(PhantomData<T>);

impl<T: StreamingBody + ?Sized> BodyProbe<T> {
    /// `T` streams the request body.
    pub const STREAMS: bool = true;
}

/// The probe's answer for every type that is not a streaming body (in scope through
/// `use … as _`).
pub trait NotStreaming {
    /// `T` does not stream the request body.
    const STREAMS: bool = false;
}
impl<T: ?Sized> NotStreaming for BodyProbe<T> {}

/// The extractors that stream the request body, in either framework.
pub trait StreamingBody {}
#[cfg(feature = "axum")]
impl StreamingBody for ::axum::body::Body {}
#[cfg(feature = "axum")]
impl StreamingBody for ::axum::body::BodyDataStream {}
#[cfg(feature = "actix")]
impl StreamingBody for ::actix_web::web::Payload {}
#[cfg(feature = "actix")]
impl StreamingBody for ::actix_web::dev::Payload {}
