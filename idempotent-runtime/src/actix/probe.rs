//! The compile-time check that an actix-web handler's parameters do not stream the request
//! body, which `#[idempotent]` expansions call through `__private`.

use actix_web::{dev, web};

/// Compile-time check that a handler parameter does not stream the request body.
pub struct Probe<T>(core::marker::PhantomData<T>);

impl<T> Probe<T> {
    /// A probe for `T`.
    pub const fn new() -> Self {
        Self(core::marker::PhantomData)
    }
}

impl<T> Default for Probe<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Implemented by the extractors that stream the request body.
pub trait Streaming {}
impl Streaming for web::Payload {}
impl Streaming for dev::Payload {}

/// A request body `#[idempotent]` can buffer.
#[diagnostic::on_unimplemented(
    message = "`{Self}` streams the request body, which an #[idempotent] handler cannot take",
    label = "streaming request body",
    note = "#[idempotent] buffers the body to fingerprint it and hands it to the handler's \
            extractors: take `web::Bytes`, `String`, `web::Json<T>` or `web::Form<T>` instead"
)]
pub trait BufferedBody {}

impl<T: Streaming> Probe<T> {
    /// Chosen over [`NotStreaming::check`] for streaming types, and fails to compile.
    pub fn check(&self)
    where
        T: BufferedBody,
    {
    }
}

/// The fallback [`Probe::check`] for every other type.
pub trait NotStreaming {
    /// Accepts the type.
    fn check(&self) {}
}
impl<T> NotStreaming for Probe<T> {}
