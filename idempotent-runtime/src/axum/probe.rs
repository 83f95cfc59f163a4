//! Compile-time checks the expansion calls: trait bounds spanned at the user's types, with
//! messages that say what is wrong and how to fix it.

use std::marker::PhantomData;

use axum::extract::FromRef;

use crate::handle::Idempotency;

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

/// The probe: `(&&BodyProbe::<T>::new()).__idempotent_body_kind()` resolves to
/// [`CheckStreaming`] when `T` is a streaming body and to [`CheckOther`] for every other type;
/// [`require_buffered_body`] then requires `T: BufferedBody` of the streaming ones only, which
/// fails with that trait's message.
pub struct BodyProbe<T: ?Sized>(PhantomData<T>);

impl<T: ?Sized> BodyProbe<T> {
    /// The probe for `T`.
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// What the probe found: a streaming body `T`.
pub struct Streaming<T: ?Sized>(PhantomData<T>);
/// What the probe found: anything else.
pub struct NotStreaming;

/// Bodies `#[idempotent]` accepts.
pub trait Accepted {}
impl<T: BufferedBody + ?Sized> Accepted for Streaming<T> {}
impl Accepted for NotStreaming {}

/// Chosen for streaming bodies.
pub trait CheckStreaming<T: ?Sized> {
    /// The probe's verdict.
    fn __idempotent_body_kind(&self) -> Streaming<T> {
        Streaming(PhantomData)
    }
}
impl<T: StreamingBody + ?Sized> CheckStreaming<T> for &BodyProbe<T> {}

/// Chosen for everything else.
pub trait CheckOther {
    /// The probe's verdict.
    fn __idempotent_body_kind(&self) -> NotStreaming {
        NotStreaming
    }
}
impl<T: ?Sized> CheckOther for BodyProbe<T> {}

/// Fails to compile for a streaming body.
pub fn require_buffered_body<K: Accepted>(_: K) {}

/// The early store assertion on the `State<S>` a handler names: fails with
/// "`Idempotency: FromRef<S>` is not satisfied" when the state cannot provide the store.
pub fn assert_state_provides_store<S>()
where
    Idempotency: FromRef<S>,
{
}
