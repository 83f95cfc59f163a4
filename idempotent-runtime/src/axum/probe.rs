//! Compile-time checks the expansion calls: trait bounds spanned at the user's types, with
//! messages that say what is wrong and how to fix it.

use std::marker::PhantomData;

use axum::extract::FromRef;

use crate::runtime::IdempotencyStore;

/// A request body `#[idempotent]` can buffer, fingerprint and replay. Only streaming bodies are
/// asked for it, and none of them has it.
#[diagnostic::on_unimplemented(
    message = "#[idempotent] cannot wrap a handler whose body extractor `{Self}` streams the request body",
    label = "streams the request body",
    note = "the request body is buffered (up to `max_body`) to fingerprint the request and replay the response; take `Bytes`, `String`, `Json<T>` or `Form<T>` instead, or leave this handler without #[idempotent]"
)]
pub trait BufferedBody {}

/// Request bodies that are streams.
pub trait StreamingBody {}
impl StreamingBody for axum::body::Body {}
impl StreamingBody for axum::body::BodyDataStream {}

/// The probe: `(&&BodyProbe::<T>::new()).__idempotent_check_buffered_body()` resolves to
/// [`CheckStreaming`] when `T` is a streaming body (and then requires `T: BufferedBody`, which
/// fails with its message), and to [`CheckOther`] for every other type.
pub struct BodyProbe<T: ?Sized>(PhantomData<T>);

impl<T: ?Sized> BodyProbe<T> {
    /// The probe for `T`.
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// Chosen for streaming bodies.
pub trait CheckStreaming<T: ?Sized> {
    /// Fails to compile: streaming bodies are not [`BufferedBody`].
    fn __idempotent_check_buffered_body(&self)
    where
        T: BufferedBody,
    {
    }
}
impl<T: StreamingBody + ?Sized> CheckStreaming<T> for &BodyProbe<T> {}

/// Chosen for everything else.
pub trait CheckOther {
    /// Always fine.
    fn __idempotent_check_buffered_body(&self) {}
}
impl<T: ?Sized> CheckOther for BodyProbe<T> {}

/// The early store assertion on the `State<S>` a handler names: fails with
/// "`IdempotencyStore: FromRef<S>` is not satisfied" when the state cannot provide the store.
pub fn assert_state_provides_store<S>()
where
    IdempotencyStore: FromRef<S>,
{
}
