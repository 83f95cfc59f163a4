//! Implementation detail of `idempotent-runtime`: the `#[idempotent]` attribute.
//!
//! Depend on `idempotent-runtime` and use `idempotent_runtime::idempotent` (or the
//! framework-specific `idempotent_runtime::axum::idempotent`); this crate's API is not stable on
//! its own, and the expansions name the runtime through its hidden `__private` module.
#![forbid(unsafe_code)]

use proc_macro::TokenStream;

use crate::detect::Beside;

mod args;
mod checks;
mod detect;
mod endpoint;
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
/// #[idempotent(methods = ["POST", "PUT"])]       the methods it applies to (default POST, PATCH)
/// #[idempotent(require_key, key = header("webhook-id"))]
///                                                the key from another header (a provider's id)
/// #[idempotent(require_key, key = body("/id"), fingerprint = ["/type", "/data"])]
///                                                the key from the JSON body; retries compared by
///                                                these fields only (RFC 8785)
/// #[idempotent(wait_in_progress = "5s")]         a duplicate waits for the first answer, not 409
/// #[idempotent(reuse_status = 409, failure_mode = "open",
///              non_replayable = [401, 403, 404], recorded_headers = ["content-type", "x-id"])]
///                                                the rest of the per-route settings
/// #[idempotent(crate = my_runtime)]              for a renamed idempotent-runtime dependency
/// #[idempotent(require_key, enlisted)]           PostgreSQL: the response commits with the
///                                                handler's writes (take `tx: &mut EnlistedTx`)
/// ```
///
/// Durations take `ms`, `s`, `m`, `h` or `d`; sizes take `B`, `KiB`, `MiB`, `GiB`, `KB`, `MB`,
/// `GB` (or none, for bytes); a fraction is allowed where the value stays whole (`"1.5m"`,
/// `"1.5MiB"`) and units are case-sensitive. That is the runtime's grammar
/// (`idempotent_runtime::config::grammar`, which the file form reads through too): the
/// expansion evaluates it in a `const`, so a bad value is a compile error at its literal, as
/// is a status outside 200-499 in `non_replayable` or a header name that is not a lowercase
/// token in `recorded_headers`. The handler's last parameter is wrapped in the runtime's
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
/// A handler that takes no `State` finds the handle in whatever state the router has: the
/// rewritten handler is generic over that state, bounded on `ProvidesIdempotency`. A router
/// whose state cannot give the handle (no `.with_state(idempotency)`, or an `AppState` without
/// `impl FromRef<AppState> for Idempotency`) is refused at `post(handler)` with that trait's
/// message and the fix. Under `#[axum::debug_handler]`, which refuses generic functions, the
/// handler is not made generic: name the state there (`#[axum::debug_handler(state = …)]`).
///
/// In axum only the last extractor may take the body: `Bytes`, `String`, `Json`, `Form`,
/// `RawForm` or `Request` before the last parameter is a compile error at that type.
///
/// Attributes the macro does not own (`#[tracing::instrument]`, lints, `#[must_use]`, …) stay on
/// the handler as written, which the wrapper keeps under its own name, in either order: a
/// `#[tracing::instrument(fields(shop = %shop))]` below `#[idempotent]` names the parameters
/// and its span is named after the handler. On the generated wrapper: doc comments, `#[cfg]`,
/// `#[deprecated]` (they describe the item callers name), `#[axum::debug_handler]` (it checks
/// the handler axum sees), `#[utoipa::path]` (it registers the operation under the item's name,
/// at module level; above `#[idempotent]` it sees the signature as written) and actix-web's
/// route attributes; lint levels go on both. `#[cfg_attr(…)]` follows what it wraps.
///
/// Put it above `#[axum::debug_handler]`, never below.
#[proc_macro_attribute]
pub fn idempotent_axum(attr: TokenStream, item: TokenStream) -> TokenStream {
    match args::parse(attr.into(), item.into()) {
        Ok((args, function)) => expand_axum::expand(&args, &function, &Beside::none()).into(),
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
/// #[idempotent(methods = ["POST", "PUT"])]       the methods it applies to (default POST, PATCH)
/// #[idempotent(require_key, key = header("webhook-id"))]
///                                                the key from another header (a provider's id)
/// #[idempotent(require_key, key = body("/id"), fingerprint = ["/type", "/data"])]
///                                                the key from the JSON body; retries compared by
///                                                these fields only (RFC 8785)
/// #[idempotent(wait_in_progress = "5s")]         a duplicate waits for the first answer, not 409
/// #[idempotent(reuse_status = 409, failure_mode = "open",
///              non_replayable = [401, 403, 404], recorded_headers = ["content-type", "x-id"])]
///                                                the rest of the per-route settings
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
///
/// The attribute applies to POST and PATCH unless `methods = [...]` lists others (PUT, DELETE);
/// every other request passes through untouched (on axum too), and GET, HEAD, OPTIONS and TRACE
/// cannot be listed: they are idempotent by HTTP semantics. A handler routed for those only by
/// a route attribute beside the attribute (`#[get]`, `#[head]`, `#[route(…, method = "GET")]`,
/// above or below it) is a compile error, and so is one routed only for methods the attribute
/// does not apply to (`#[put]` without `methods = ["PUT"]`); an attribute above is read back from the source file, so it is seen
/// wherever the compiler can give that file's text (not inside other macros' output).
/// Attributes the macro does not own stay on the handler, as for axum.
#[proc_macro_attribute]
pub fn idempotent_actix(attr: TokenStream, item: TokenStream) -> TokenStream {
    match args::parse(attr.into(), item.into()) {
        Ok((args, function)) => {
            expand_actix::expand(&args, &function, &Beside::at_call_site()).into()
        }
        Err(tokens) => tokens.into(),
    }
}

/// `#[idempotent]` for either framework: the short `idempotent_runtime::idempotent` when both
/// the `axum` and the `actix` features are on (cargo unifies features across a workspace, so
/// an axum service and an actix-web service in one workspace both see this one).
///
/// `framework = axum` or `framework = actix` decides. Without it, the handler's own tokens do,
/// where only one framework has them:
///
/// - actix-web: a route attribute beside `#[idempotent]`, above or below it (`#[post("/x")]`,
///   `#[route(…)]`, …, bare or as `actix_web::…`); a path through `actix_web` or its `web`
///   module anywhere in the signature (`web::Json<T>`, `web::Data<T>`, `web::Path<T>`,
///   `web::Bytes`, …); `HttpRequest`, `HttpResponse`, `HttpResponseBuilder` or `Responder`
///   (`impl Responder`) anywhere in it.
/// - axum: `#[axum::debug_handler]` below it; a path through `axum` or `axum_extra` anywhere in
///   the signature (`axum::Json<T>`); `State`, `Extension`, `ConnectInfo`, `MatchedPath`,
///   `OriginalUri`, `RawPathParams`, `IntoResponse` (`impl IntoResponse`),
///   `IntoResponseParts` or `Response` anywhere in it.
///
/// Names both frameworks have say nothing: `Json<T>` unqualified (but `web::Json<T>` is
/// actix-web's), `Path`, `Query`, `Form`, `Bytes`, `String`, `Html`, `Redirect`, `StatusCode`,
/// `HeaderMap`, tuples. The names are read, not resolved: a type of the application's called
/// `State` counts as axum's. A handler with tokens of only one framework is that framework's;
/// one with tokens of both, or of neither, is a compile error naming its tokens and asking for
/// `framework = …`. The choice depends on the handler alone, so turning on the other feature
/// never changes what an expansion means. Libraries name `idempotent_runtime::axum::idempotent`
/// or `idempotent_runtime::actix::idempotent`, which read no tokens.
#[proc_macro_attribute]
pub fn idempotent_select(attr: TokenStream, item: TokenStream) -> TokenStream {
    let (args, function) = match args::parse(attr.into(), item.into()) {
        Ok(parsed) => parsed,
        Err(tokens) => return tokens.into(),
    };
    let beside = Beside::at_call_site();
    let framework = match args.framework {
        Some((framework, _)) => framework,
        None => match detect::framework(&beside, &function) {
            detect::Verdict::Is(framework) => framework,
            detect::Verdict::Both(axum, actix) => {
                let message = format!(
                    "`{}` has tokens of both frameworks: `{}` is axum's and `{}` is \
                     actix-web's, and both the `axum` and `actix` features of idempotent-runtime \
                     are on; write `#[idempotent(framework = axum)]` or \
                     `#[idempotent(framework = actix)]`",
                    function.sig.ident,
                    detect::shown(&axum),
                    detect::shown(&actix),
                );
                return args::error_with_item(function.sig.ident.span(), &message, &function)
                    .into();
            }
            detect::Verdict::Unknown => {
                let message = format!(
                    "cannot tell whether `{}` is an axum or an actix-web handler: both the `axum` \
                     and `actix` features of idempotent-runtime are on, and nothing in `{}` \
                     belongs to only one of them (`Json`, `Path`, `Bytes`, `String` are in \
                     both); write `#[idempotent(framework = axum)]` or \
                     `#[idempotent(framework = actix)]`, or use \
                     `idempotent_runtime::axum::idempotent` / `idempotent_runtime::actix::idempotent`",
                    function.sig.ident,
                    detect::shown_signature(&function.sig),
                );
                return args::error_with_item(function.sig.ident.span(), &message, &function)
                    .into();
            }
        },
    };
    match framework {
        args::Framework::Axum => expand_axum::expand(&args, &function, &beside).into(),
        args::Framework::Actix => expand_actix::expand(&args, &function, &beside).into(),
    }
}
