//! The compile-time check that an actix-web handler's parameters do not stream the request
//! body, which `#[idempotent]` expansions call through `__private`: its failure carries the
//! message on the user's type and names none of these items.

use actix_web::{dev, web};

/// The probe: `Probe::<T>::STREAMS` is this inherent constant when `T` streams the request body
/// and [`NotStreaming::STREAMS`] for every other type. The expansion asserts it is `false` in a
/// constant.
pub struct Probe<T: ?Sized>(core::marker::PhantomData<T>);

impl<T: Streaming + ?Sized> Probe<T> {
    /// `T` streams the request body.
    pub const STREAMS: bool = true;
}

/// The probe's answer for every other type (in scope through `use … as _`).
pub trait NotStreaming {
    /// `T` does not stream the request body.
    const STREAMS: bool = false;
}
impl<T: ?Sized> NotStreaming for Probe<T> {}

/// Implemented by the extractors that stream the request body.
pub trait Streaming {}
impl Streaming for web::Payload {}
impl Streaming for dev::Payload {}
