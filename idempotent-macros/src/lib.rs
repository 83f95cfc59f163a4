//! Implementation detail of `idempotent-runtime`: the `#[idempotent]` attribute.
//!
//! Depend on `idempotent-runtime` and use `idempotent_runtime::idempotent` (or the
//! framework-specific `idempotent_runtime::axum::idempotent`); this crate's API is not stable on
//! its own, and the expansions name the runtime through its hidden `__private` module.

use proc_macro::TokenStream;

mod args;
mod checks;
mod expand_actix;
mod expand_axum;
mod signature;
mod types;

/// Makes an axum 0.8 handler idempotent: requests with the same `Idempotency-Key` from the same
/// caller run it once, and every repeat gets the recorded response with
/// `Idempotency-Replayed: true`.
///
/// ```text
/// #[idempotent]                                  key optional; requests without one pass through
/// #[idempotent(require_key)]                     a request without a key is refused (400 or 428)
/// #[idempotent(require_key, lease = "30s", retention = "24h", max_body = "64KiB",
///              max_response = "1MiB")]          per-endpoint overrides, checked at compile time
/// #[idempotent(require_key, oversized = "record_without_body")]
///                                                an answer over max_response is replayed as its
///                                                status and headers with an empty body
/// #[idempotent(crate = my_runtime)]              for a renamed idempotent-runtime dependency
/// #[idempotent(require_key, enlisted)]           PostgreSQL: the response commits with the
///                                                handler's writes (take `tx: &mut EnlistedTx`)
/// ```
///
/// Durations take `ms`, `s`, `m`, `h` or `d`; sizes take `B`, `KiB`, `MiB`, `GiB`, `KB`, `MB`,
/// `GB` (or none, for bytes). The handler's last parameter is wrapped in the runtime's
/// extractor, which buffers the body, claims the key and answers replays and refusals before
/// the handler runs; the store comes from the application state (`Idempotency:
/// FromRef<AppState>`), or from the request extensions when the handler takes an
/// `Extension<Idempotency>` parameter. Parameters of type `IdempotencyContext` (with
/// `require_key`) or `Option<IdempotencyContext>` receive the claimed request's context.
///
/// With `enlisted` (the `postgres` feature), the key is claimed inside a transaction the
/// handler writes through, and the response is recorded in it and committed before it is sent:
/// see `idempotent_runtime::enlisted`.
///
/// Put it above `#[axum::debug_handler]`, never below.
#[proc_macro_attribute]
pub fn idempotent_axum(attr: TokenStream, item: TokenStream) -> TokenStream {
    match args::parse(attr.into(), item.into()) {
        Ok((args, function)) => expand_axum::expand(&args, &function).into(),
        Err(tokens) => tokens.into(),
    }
}

/// Makes an actix-web 4 handler idempotent: requests with the same `Idempotency-Key` from the
/// same caller run it once, and every repeat gets the recorded response with
/// `Idempotency-Replayed: true`.
///
/// ```text
/// #[idempotent]                                  key optional; requests without one pass through
/// #[idempotent(require_key)]                     a request without a key is refused (400 or 428)
/// #[idempotent(require_key, lease = "30s", retention = "24h", max_body = "64KiB",
///              max_response = "1MiB")]          per-endpoint overrides, checked at compile time
/// #[idempotent(require_key, oversized = "record_without_body")]
///                                                an answer over max_response is replayed as its
///                                                status and headers with an empty body
/// #[idempotent(crate = my_runtime)]              for a renamed idempotent-runtime dependency
/// #[idempotent(require_key, enlisted)]           PostgreSQL: the response commits with the
///                                                handler's writes (take `tx: &mut EnlistedTx`)
/// ```
///
/// With `enlisted` (the `postgres` feature), the key is claimed inside a transaction the
/// handler writes through, and the response is recorded in it and committed before it is sent:
/// see `idempotent_runtime::enlisted`.
///
/// The handler is rewritten to take the request and its raw payload: the runtime buffers the
/// body and runs the handler's own extractors on it, then claims the key and answers replays
/// and refusals, or runs the handler in a task of its own. The store comes from the
/// application data (`web::Data<Idempotency>`). Works above or below `#[post("/…")]` and
/// with `.route("/…", web::post().to(handler))`. `web::Payload` and `Multipart` parameters are
/// compile errors: a streamed body cannot be fingerprinted.
#[proc_macro_attribute]
pub fn idempotent_actix(attr: TokenStream, item: TokenStream) -> TokenStream {
    match args::parse(attr.into(), item.into()) {
        Ok((args, function)) => expand_actix::expand(&args, &function).into(),
        Err(tokens) => tokens.into(),
    }
}

/// `#[idempotent]` for whichever framework `framework = axum|actix` names: the short
/// `idempotent_runtime::idempotent` when both the `axum` and the `actix` features are on, where
/// guessing would let cargo feature unification change what a handler means.
#[proc_macro_attribute]
pub fn idempotent_select(attr: TokenStream, item: TokenStream) -> TokenStream {
    let (args, function) = match args::parse(attr.into(), item.into()) {
        Ok(parsed) => parsed,
        Err(tokens) => return tokens.into(),
    };
    match args.framework {
        Some((args::Framework::Axum, _)) => expand_axum::expand(&args, &function).into(),
        Some((args::Framework::Actix, _)) => expand_actix::expand(&args, &function).into(),
        None => args::error_with_item(
            proc_macro2::Span::call_site(),
            "both the `axum` and `actix` features of idempotent-runtime are on, so \
             `idempotent_runtime::idempotent` cannot tell which framework this handler is for: \
             write `#[idempotent(framework = axum)]` or `#[idempotent(framework = actix)]`, or use \
             `idempotent_runtime::axum::idempotent` / `idempotent_runtime::actix::idempotent`",
            &function,
        )
        .into(),
    }
}
