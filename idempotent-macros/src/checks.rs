//! Compile-time checks emitted into the expansion: targeted syntactic checks that fail the macro
//! with an error on the user's tokens, and trait-bound probes that the type checker evaluates,
//! spanned at the user's type so the caret covers it.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote_spanned};
use syn::spanned::Spanned;
use syn::{Error, GenericArgument, PathArguments, ReturnType, Type};

/// The last path segment's identifier of a type (`axum::Json<T>` → `Json`), if it is a path.
pub(crate) fn last_ident(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_ident(&g.elem),
        Type::Paren(p) => last_ident(&p.elem),
        _ => None,
    }
}

/// `Outer<Inner>` → `Inner` when the last segment is named `outer`.
pub(crate) fn single_generic<'a>(ty: &'a Type, outer: &str) -> Option<&'a Type> {
    let seg = last_ident(ty)?;
    if seg.ident != outer {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let first = types.next()?;
    types.next().is_none().then_some(first)
}

/// Whether the type is the bare path segment `name` (no generics).
pub(crate) fn is_named(ty: &Type, name: &str) -> bool {
    last_ident(ty).is_some_and(|s| s.ident == name && s.arguments.is_empty())
}

/// Finds a path segment named `name` anywhere in a type (inside generics, tuples, `impl Trait`).
fn mentions(ty: &Type, name: &str) -> Option<Span> {
    struct Finder<'a> {
        name: &'a str,
        found: Option<Span>,
    }
    impl<'ast> syn::visit::Visit<'ast> for Finder<'_> {
        fn visit_path_segment(&mut self, seg: &'ast syn::PathSegment) {
            if self.found.is_none() && seg.ident == self.name {
                self.found = Some(seg.span());
            }
            syn::visit::visit_path_segment(self, seg);
        }
    }
    let mut f = Finder { name, found: None };
    syn::visit::Visit::visit_type(&mut f, ty);
    f.found
}

/// A request body that is a stream by its name, caught before type checking (axum's `Multipart`
/// lives behind a feature of the application's axum, so no trait of ours can name it).
pub(crate) fn streaming_request(ty: &Type) -> syn::Result<()> {
    for name in ["Multipart"] {
        if let Some(span) = mentions(ty, name) {
            return Err(Error::new(
                span,
                format!(
                    "#[idempotent] cannot wrap a handler that takes `{name}`: it streams the request \
                     body, which must be buffered to fingerprint and replay the request; take \
                     `Bytes` or `Json<T>` instead, or leave this handler without #[idempotent]"
                ),
            ));
        }
    }
    Ok(())
}

/// A streaming response by its name (`Sse`): it never ends, so it can be neither recorded nor
/// replayed.
pub(crate) fn streaming_response(output: &ReturnType) -> syn::Result<()> {
    let ReturnType::Type(_, ty) = output else {
        return Ok(());
    };
    for name in ["Sse"] {
        if let Some(span) = mentions(ty, name) {
            return Err(Error::new(
                span,
                format!(
                    "#[idempotent] cannot wrap a handler that returns `{name}`: a stream of events \
                     can be neither recorded nor replayed; return a complete response instead"
                ),
            ));
        }
    }
    Ok(())
}

/// The trait probe on the wrapped parameter: if `T` is a known streaming body (`Body`,
/// `BodyDataStream`), require `T: BufferedBody`, whose `on_unimplemented` message explains why.
pub(crate) fn buffered_body_probe(rt: &TokenStream, ty: &Type) -> TokenStream {
    let (first, last) = first_last_span(ty);
    // The argument's tokens start at the type's first token and end at its last, so the caret
    // of an error on it covers the whole type.
    let open = quote_spanned!(first=> (&&#rt::__private::axum::BodyProbe::<#ty>::new()));
    let argument = quote_spanned!(last=> #open.__idempotent_body_kind());
    let call = quote_spanned!(last=> #rt::__private::axum::require_buffered_body);
    quote::quote! {
        {
            #[allow(unused_imports)]
            use #rt::__private::axum::{CheckOther as _, CheckStreaming as _};
            #call(#argument);
        }
    }
}

/// The early store assertion: the first error then names the missing
/// `Idempotency: FromRef<AppState>` instead of a vague `Handler` error at `.route()`.
pub(crate) fn state_provides_store(rt: &TokenStream, state: &Type) -> TokenStream {
    let (first, last) = first_last_span(state);
    let path = quote_spanned!(first=> #rt::__private::axum::assert_state_provides_store::<#state>);
    quote_spanned!(last=> #path();)
}

fn first_last_span(ty: &Type) -> (Span, Span) {
    let tokens = ty.to_token_stream();
    let mut iter = tokens.into_iter();
    let first = iter.next().map_or_else(Span::call_site, |t| t.span());
    let last = iter.last().map_or(first, |t| t.span());
    (first, last)
}

/// Whether a parameter is the enlisted transaction, `&mut EnlistedTx`. Taking it any other way,
/// or without `enlisted`, is an error on the parameter's type.
pub(crate) fn enlisted_tx(ty: &Type, enlisted: bool) -> syn::Result<bool> {
    let (inner, mutable) = match ty {
        Type::Reference(r) => (&*r.elem, r.mutability.is_some()),
        other => (other, false),
    };
    if !is_named(inner, "EnlistedTx") {
        return Ok(false);
    }
    if !enlisted {
        return Err(Error::new_spanned(
            ty,
            "`EnlistedTx` is the transaction of an enlisted handler: write \
             `#[idempotent(enlisted)]` (PostgreSQL store), or remove this parameter",
        ));
    }
    if !mutable || !matches!(ty, Type::Reference(_)) {
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
    sig: &syn::Signature,
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
