//! Every compile-time check, the same for both frameworks: syntactic checks that fail the macro
//! with an error on the user's tokens (run while `signature.rs` builds its model), and the probes
//! the type checker evaluates, spanned at the user's type so the caret covers it.

use proc_macro2::{Delimiter, Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Error, FnArg, ReturnType, Signature, Type};

use crate::args::{Args, Framework};
use crate::detect::{self, Route};
use crate::types::{is_named, last_segment};

/// `framework = …` names the framework of the path the attribute was called by.
pub(crate) fn framework(args: &Args, framework: Framework) -> syn::Result<()> {
    match args.framework {
        Some((named, span)) if named != framework => Err(Error::new(
            span,
            match framework {
                Framework::Axum => {
                    "this is axum's #[idempotent]; use `idempotent_runtime::actix::idempotent` \
                     for an actix-web handler"
                }
                Framework::Actix => {
                    "this is actix-web's #[idempotent]; use `idempotent_runtime::axum::idempotent` \
                     for an axum handler"
                }
            },
        )),
        _ => Ok(()),
    }
}

/// A handler routed only for GET, HEAD, OPTIONS or TRACE (an actix-web `#[get]`/`#[head]`
/// beside the attribute, above or below it): those methods are idempotent by HTTP semantics,
/// so the runtime passes them through and the attribute would never apply.
pub(crate) fn routed_for_safe_methods(routes: &[Route<'_>]) -> syn::Result<()> {
    let Some(route) = detect::only_safe_methods(routes) else {
        return Ok(());
    };
    let methods = routes
        .iter()
        .flat_map(|r| r.methods.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("/");
    let name = route
        .attr
        .path()
        .to_token_stream()
        .to_string()
        .replace(" :: ", "::");
    Err(Error::new_spanned(
        route.attr,
        format!(
            "#[idempotent] does not apply to a handler routed for {methods} (`#[{name}]`): GET, \
             HEAD, OPTIONS and TRACE are idempotent by HTTP semantics, so a repeat is already \
             safe and the runtime passes them through untouched; remove #[idempotent] here, or \
             route the handler for POST or PATCH"
        ),
    ))
}

/// A handler routed (by an actix-web route attribute beside it) only for methods the attribute
/// does not apply to, `#[put]` under the default POST and PATCH say: every request would pass
/// through unprotected, so the fix (`methods = [...]`) is asked for here.
pub(crate) fn routed_outside_methods(routes: &[Route<'_>], methods: Option<u8>) -> syn::Result<()> {
    let applies = methods.unwrap_or(1 | 4);
    let named: Vec<&str> = routes
        .iter()
        .flat_map(|r| r.methods.iter().map(String::as_str))
        .collect();
    let covered = |m: &&str| crate::args::method_bit(m).is_ok_and(|bit| applies & bit != 0);
    let Some(route) = routes.iter().find(|r| !r.methods.is_empty()) else {
        return Ok(());
    };
    if named.iter().any(covered) {
        return Ok(());
    }
    let listed = named
        .iter()
        .map(|m| format!("{m:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let name = route
        .attr
        .path()
        .to_token_stream()
        .to_string()
        .replace(" :: ", "::");
    let default = if methods.is_none() {
        " (by default POST and PATCH)"
    } else {
        ""
    };
    Err(Error::new_spanned(
        route.attr,
        format!(
            "`#[{name}]` routes this handler for {}, which #[idempotent] does not apply to{default}: \
             every request would pass through unprotected; add `methods = [{listed}]` to \
             #[idempotent]",
            named.join("/")
        ),
    ))
}

/// In axum only the last extractor may take the request body: one that takes it before the
/// last is refused at its type, naming the fix, instead of axum's `Handler` error at
/// `.route()`. actix-web's extractors all run on the buffered body, so only axum needs it.
pub(crate) fn body_not_last(ty: &Type) -> syn::Result<()> {
    const TAKE_BODY: [&str; 6] = ["Bytes", "String", "Json", "Form", "RawForm", "Request"];
    let inner = ["Option", "Result"]
        .iter()
        .find_map(|outer| crate::types::single_generic(ty, outer))
        .unwrap_or(ty);
    let Some(name) = TAKE_BODY
        .iter()
        .find(|name| is_named(inner, name) || crate::types::single_generic(inner, name).is_some())
    else {
        return Ok(());
    };
    Err(Error::new_spanned(
        ty,
        format!(
            "`{name}` takes the request body; only the last parameter may: axum gives the body \
             to the last extractor, and the ones before it read only the request head (`State`, \
             `Path`, `Query`, `HeaderMap`, `Extension`, …); move `{name}` last, or keep one \
             body extractor"
        ),
    ))
}

/// A handler is a concrete, non-variadic `async fn`.
pub(crate) fn shape(sig: &Signature) -> syn::Result<()> {
    if sig.asyncness.is_none() {
        return Err(Error::new(
            sig.fn_token.span,
            "#[idempotent] handlers must be `async fn`: add `async`",
        ));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        return Err(Error::new(
            sig.generics.span(),
            "#[idempotent] cannot wrap a generic handler: the extractor types must be known; \
             write a concrete handler (it may call a generic function)",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        return Err(Error::new(
            variadic.span(),
            "#[idempotent] handlers cannot be variadic",
        ));
    }
    Ok(())
}

/// A parameter's type; `self` is an error.
pub(crate) fn typed(input: &FnArg) -> syn::Result<&Type> {
    match input {
        FnArg::Typed(pat_type) => Ok(&pat_type.ty),
        FnArg::Receiver(_) => Err(Error::new(
            input.span(),
            "#[idempotent] handlers are free functions: remove `self`",
        )),
    }
}

/// `IdempotencyContext` exists only with `require_key`.
pub(crate) fn context_needs_key(ty: &Type, require_key: bool) -> syn::Result<()> {
    if require_key {
        return Ok(());
    }
    Err(Error::new(
        ty.span(),
        "`IdempotencyContext` exists only when the request has a key: add `require_key` to \
         #[idempotent], or take `Option<IdempotencyContext>`",
    ))
}

/// An extractor parameter names its type and does not stream the request body.
pub(crate) fn extractor(ty: &Type, framework: Framework) -> syn::Result<()> {
    if let Type::ImplTrait(_) = ty {
        return Err(Error::new(
            ty.span(),
            "#[idempotent] cannot wrap a handler with an `impl Trait` parameter: name the \
             extractor type",
        ));
    }
    streaming_request(ty, framework)
}

/// A request body that streams, found by its name before type checking, anywhere in the type
/// (`Multipart`, `actix_multipart::Multipart`, `Option<axum::extract::Multipart>`): multipart
/// extractors live behind features or crates of the application's, so no trait of ours can
/// name them. actix-web's own `Payload` is refused where it is spelled as its (`web::Payload`,
/// `dev::Payload`, anywhere) or is the whole type (`Payload`); behind an alias, the probe
/// catches it.
fn streaming_request(ty: &Type, framework: Framework) -> syn::Result<()> {
    let multipart = find_path(ty, |path, i| path.segments[i].ident == "Multipart");
    let payload = match framework {
        Framework::Axum => None,
        Framework::Actix if is_named(ty, "Payload") => Some(ty.to_token_stream()),
        Framework::Actix => find_path(ty, |path, i| {
            i > 0
                && path.segments[i].ident == "Payload"
                && ["web", "dev"]
                    .iter()
                    .any(|module| path.segments[i - 1].ident == module)
        }),
    };
    let (name, tokens) = match (multipart, payload) {
        (Some(tokens), _) => ("Multipart", tokens),
        (None, Some(tokens)) => ("Payload", tokens),
        (None, None) => return Ok(()),
    };
    let instead = match framework {
        Framework::Axum => "`Bytes` or `Json<T>`",
        Framework::Actix => "`web::Bytes`, `String` or `web::Json<T>`",
    };
    Err(Error::new_spanned(
        tokens,
        format!(
            "#[idempotent] cannot wrap a handler that takes `{name}`: it streams the request \
             body, which must be buffered to fingerprint and replay the request; take {instead} \
             instead, or leave this handler without #[idempotent]"
        ),
    ))
}

/// A streaming response by its name, anywhere in the return type (`Sse`, axum's or
/// actix-web-lab's): it never ends, so it can be neither recorded nor replayed.
pub(crate) fn streaming_response(output: &ReturnType) -> syn::Result<()> {
    let ReturnType::Type(_, ty) = output else {
        return Ok(());
    };
    match find_path(ty, |path, i| path.segments[i].ident == "Sse") {
        Some(tokens) => Err(Error::new_spanned(
            tokens,
            "#[idempotent] cannot wrap a handler that returns `Sse`: a stream of events can be \
             neither recorded nor replayed; return a complete response instead",
        )),
        None => Ok(()),
    }
}

/// The first path anywhere in a type (inside generics, tuples, references, `impl Trait`) with a
/// segment `is(path, index)` accepts: its tokens up to that segment's name, for the caret.
fn find_path(ty: &Type, is: impl Fn(&syn::Path, usize) -> bool) -> Option<TokenStream> {
    struct Finder<F> {
        is: F,
        found: Option<TokenStream>,
    }
    impl<'ast, F: Fn(&syn::Path, usize) -> bool> syn::visit::Visit<'ast> for Finder<F> {
        fn visit_path(&mut self, path: &'ast syn::Path) {
            if self.found.is_some() {
                return;
            }
            if let Some(i) = (0..path.segments.len()).find(|&i| (self.is)(path, i)) {
                let mut tokens = path.leading_colon.to_token_stream();
                for pair in path.segments.pairs().take(i) {
                    pair.to_tokens(&mut tokens);
                }
                path.segments[i].ident.to_tokens(&mut tokens);
                self.found = Some(tokens);
                return;
            }
            syn::visit::visit_path(self, path);
        }
    }
    let mut finder = Finder { is, found: None };
    syn::visit::Visit::visit_type(&mut finder, ty);
    finder.found
}

/// Whether a parameter is the enlisted transaction, `&mut EnlistedTx`. Taking it any other way,
/// or without `enlisted`, is an error on the parameter's type.
pub(crate) fn enlisted_tx(ty: &Type, enlisted: bool) -> syn::Result<bool> {
    let (inner, mutable) = match ty {
        Type::Reference(r) => (&*r.elem, r.mutability.is_some()),
        other => (other, false),
    };
    // `EnlistedTx` (PostgreSQL) or `EnlistedTx<MySql>`: the argument names the database.
    if last_segment(inner).is_none_or(|s| s.ident != "EnlistedTx") {
        return Ok(false);
    }
    if !enlisted {
        return Err(Error::new_spanned(
            ty,
            "`EnlistedTx` is the transaction of an enlisted handler: write \
             `#[idempotent(enlisted)]` (a PostgreSQL, MySQL or SQLite store), or remove this \
             parameter",
        ));
    }
    if !mutable {
        return Err(Error::new_spanned(
            ty,
            "take the enlisted transaction as `&mut EnlistedTx`: the runtime keeps it, to record \
             the response in it and commit after the handler returned",
        ));
    }
    Ok(true)
}

/// An enlisted handler takes exactly one `&mut EnlistedTx`.
pub(crate) fn enlisted_params(
    enlisted: Option<Span>,
    transactions: usize,
    sig: &Signature,
) -> syn::Result<()> {
    match (enlisted, transactions) {
        (Some(span), 0) => Err(Error::new(
            span,
            format!(
                "`enlisted` hands the handler the transaction that holds its reservation, but \
                 `{}` takes none: add a parameter `tx: &mut EnlistedTx` \
                 (`idempotent_runtime::enlisted::EnlistedTx`) and write through it, or remove \
                 `enlisted`",
                sig.ident
            ),
        )),
        (Some(_), n) if n > 1 => Err(Error::new(
            sig.inputs.span(),
            "an enlisted handler takes one `&mut EnlistedTx`, not several",
        )),
        _ => Ok(()),
    }
}

/// The probe on an extractor, for a streaming body behind a name the syntactic check cannot
/// see (`axum::body::Body`, `BodyDataStream`, `web::Payload` behind an alias): a constant that
/// fails to evaluate, with the message on the user's type. `private` is the framework's
/// `__private` module, whose `BodyProbe::<T>::STREAMS` is `true` for streaming bodies only.
pub(crate) fn body_probe(private: &TokenStream, framework: Framework, ty: &Type) -> TokenStream {
    // One probe for both frameworks (`__private::BodyProbe`).
    let (probe, fallback) = (quote!(BodyProbe), quote!(NotStreaming));
    let instead = match framework {
        Framework::Axum => "`Bytes`, `String`, `Json<T>` or `Form<T>`",
        Framework::Actix => "`web::Bytes`, `String`, `web::Json<T>` or `web::Form<T>`",
    };
    let shown = ty.to_token_stream().to_string().replace(" :: ", "::");
    // `assert!` reads its message as a format string.
    let message = format!(
        "#[idempotent] cannot wrap a handler whose extractor `{shown}` streams the request body: \
         the body is buffered (up to `max_body`) to fingerprint the request and replay the \
         response; take {instead} instead, or leave this handler without #[idempotent]"
    )
    .replace('{', "{{")
    .replace('}', "}}");
    let (first, last) = first_last_span(ty);
    // `assert!(…)` spans from its name to its closing parenthesis: from the type's first token
    // to its last, so the caret covers the type.
    let mut arguments = Group::new(
        Delimiter::Parenthesis,
        quote!(!#private::#probe::<#ty>::STREAMS, #message),
    );
    arguments.set_span(last);
    let assert = quote_spanned!(first=> ::core::assert!);
    let arguments = TokenTree::Group(arguments);
    quote! {
        const _: () = {
            #[allow(unused_imports)]
            use #private::#fallback as _;
            #assert #arguments;
        };
    }
}

/// The early store assertion on a `State<S>` (axum, when the store comes from the state): the
/// first error then names the missing `Idempotency: FromRef<AppState>` instead of a vague
/// `Handler` error at `.route()`.
pub(crate) fn state_provides_store(private: &TokenStream, state: &Type) -> TokenStream {
    let (first, last) = first_last_span(state);
    let path = quote_spanned!(first=> <#state as #private::ProvidesIdempotency>);
    quote_spanned!(last=> #path::provides_idempotency();)
}

fn first_last_span(ty: &Type) -> (Span, Span) {
    let tokens = ty.to_token_stream();
    let mut iter = tokens.into_iter();
    let first = iter.next().map_or_else(Span::call_site, |t| t.span());
    let last = iter.last().map_or(first, |t| t.span());
    (first, last)
}
