//! The actix-web expansion.
//!
//! ```text
//! #[idempotent(require_key)]
//! #[post("/orders")]
//! async fn create(db: web::Data<Db>, web::Json(req): web::Json<New>) -> R { body }
//! ```
//! becomes
//! ```text
//! #[post("/orders")]
//! async fn create(__idempotent_req: HttpRequest, __idempotent_payload: web::Payload) -> HttpResponse {
//!     async fn __idempotent_inner(db: web::Data<Db>, web::Json(req): web::Json<New>) -> R { body }
//!     const __IDEMPOTENT_ENDPOINT: EndpointConfig = EndpointConfig { require_key: true, … };
//!     rt::__private::actix::handle(__idempotent_req, __idempotent_payload, &__IDEMPOTENT_ENDPOINT,
//!         |req, mut payload| async move {
//!             let __idempotent_arg0 = match <web::Data<Db> as FromRequest>::from_request(&req, &mut payload).await { … };
//!             let __idempotent_arg1 = …;
//!             respond(__idempotent_inner(__idempotent_arg0, __idempotent_arg1).await, &req)
//!         }).await
//! }
//! ```
//! The runtime buffers the payload and claims the key first; the original extractors then run,
//! in order, on the buffered body, inside the task that runs the handler.

use proc_macro2::{Literal, Span, TokenStream};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Error, FnArg, ItemFn, ReturnType, Type};

use crate::args::{Args, Framework};
use crate::checks;

/// Expands `#[idempotent]` for actix-web; on error, the error and the untouched function.
pub(crate) fn expand(args: Args, item: ItemFn) -> TokenStream {
    match try_expand(&args, &item) {
        Ok(tokens) => tokens,
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#e #item)
        }
    }
}

fn try_expand(args: &Args, item: &ItemFn) -> syn::Result<TokenStream> {
    let rt = args.runtime();
    let sig = &item.sig;
    if let Some((Framework::Axum, span)) = args.framework {
        return Err(Error::new(
            span,
            "this is actix-web's #[idempotent]; use `idempotent_runtime::axum::idempotent` for an \
             axum handler",
        ));
    }
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

    let mut types = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pat_type) = input else {
            return Err(Error::new(
                input.span(),
                "#[idempotent] handlers are free functions: remove `self`",
            ));
        };
        let ty = &*pat_type.ty;
        if let Type::ImplTrait(_) = ty {
            return Err(Error::new(
                ty.span(),
                "#[idempotent] cannot wrap a handler with an `impl Trait` parameter: name the \
                 extractor type",
            ));
        }
        if checks::enlisted_tx(ty, args.enlisted.is_some())? {
            types.push(ty);
            continue;
        }
        streaming_request(ty)?;
        if is_named(ty, "IdempotencyContext") && !args.require_key {
            return Err(Error::new(
                ty.span(),
                "`IdempotencyContext` exists only when the request has a key: add `require_key` \
                 to #[idempotent], or take `Option<IdempotencyContext>`",
            ));
        }
        types.push(ty);
    }

    let transactions = types
        .iter()
        .filter(|ty| matches!(checks::enlisted_tx(ty, true), Ok(true)))
        .count();
    checks::enlisted_params(args.enlisted, transactions, sig)?;
    let enlisted = args.enlisted.is_some();
    let tx = format_ident!("__idempotent_tx");

    let private = quote!(#rt::__private::actix);
    let req = format_ident!("__idempotent_req");
    let payload = format_ident!("__idempotent_payload");
    let inner = format_ident!("__idempotent_inner");

    let probes = types
        .iter()
        .filter(|ty| !matches!(checks::enlisted_tx(ty, true), Ok(true)))
        .map(|ty| buffered_body_probe(&private, ty));
    let context = format_ident!("__idempotent_context");
    let mut extract = Vec::new();
    let mut extracted = Vec::new();
    let mut extracted_types = Vec::new();
    let mut call_args = Vec::new();
    let mut needs_context = false;
    for (i, ty) in types.iter().enumerate() {
        if enlisted && matches!(checks::enlisted_tx(ty, true), Ok(true)) {
            call_args.push(quote!(&mut #tx));
            continue;
        }
        if is_named(ty, "IdempotencyContext") {
            needs_context = true;
            call_args.push(quote!(::core::clone::Clone::clone(&#context)));
            continue;
        }
        if single_generic(ty, "Option").is_some_and(|t| is_named(t, "IdempotencyContext")) {
            call_args.push(quote!(::core::clone::Clone::clone(&#context)));
            continue;
        }
        let arg = format_ident!("__idempotent_arg{}", i);
        let from_request = quote_spanned!(ty.span()=>
            <#ty as #private::FromRequest>::from_request(&#req, &mut #payload)
        );
        extract.push(quote! {
            let #arg = match #from_request.await {
                ::core::result::Result::Ok(value) => value,
                ::core::result::Result::Err(error) => {
                    return ::core::result::Result::Err(#private::rejection(error));
                }
            };
        });
        extracted.push(arg.clone());
        extracted_types.push(*ty);
        call_args.push(quote!(#arg));
    }
    let missing = if enlisted {
        quote!((#tx, #private::context_missing()))
    } else {
        quote!(#private::context_missing())
    };
    let unwrap_context = needs_context.then(|| {
        quote! {
            let #context = match #context {
                ::core::option::Option::Some(context) => context,
                ::core::option::Option::None => return #missing,
            };
        }
    });

    let endpoint = endpoint(args, &private);
    let attrs = &item.attrs;
    let lints = attrs.iter().filter(|a| {
        ["allow", "warn", "deny", "expect"]
            .iter()
            .any(|lint| a.path().is_ident(lint))
    });
    let vis = &item.vis;
    let name = &sig.ident;
    let mut inner_sig = sig.clone();
    inner_sig.ident = inner.clone();
    let block = &item.block;
    let output_span = match &sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => Span::call_site(),
    };
    let respond = quote_spanned!(output_span=> #private::respond);
    let returned = proc_macro2::Ident::new("__idempotent_returned", output_span);
    let (handle, tx_param, answer) = if enlisted {
        (
            quote!(#private::handle_enlisted),
            quote!(, mut #tx: #private::EnlistedTx),
            quote!((#tx, #respond(#returned, &#req))),
        )
    } else {
        (
            quote!(#private::handle),
            quote!(),
            quote!(#respond(#returned, &#req)),
        )
    };

    Ok(quote! {
        #(#attrs)*
        #vis async fn #name(
            #req: #private::Request,
            #payload: #private::Payload,
        ) -> #private::Response {
            #(#probes)*
            #(#lints)*
            #[allow(clippy::too_many_arguments, clippy::unused_async)]
            #inner_sig #block
            const __IDEMPOTENT_ENDPOINT: #private::Endpoint = #endpoint;
            #handle(
                #req,
                #payload,
                &__IDEMPOTENT_ENDPOINT,
                |#req: #private::Request, mut #payload: #private::RawPayload| async move {
                    #(#extract)*
                    ::core::result::Result::Ok::<_, #private::Response>((#(#extracted,)*))
                },
                |(#(#extracted,)*): (#(#extracted_types,)*),
                 #context: ::core::option::Option<#private::Context>,
                 #req: #private::Request #tx_param| async move {
                    #unwrap_context
                    let #returned = #inner(#(#call_args),*).await;
                    #answer
                },
            )
            .await
        }
    })
}

fn endpoint(args: &Args, private: &TokenStream) -> TokenStream {
    let require_key = args.require_key;
    let some = |v: Option<TokenStream>| match v {
        Some(v) => quote!(::core::option::Option::Some(#v)),
        None => quote!(::core::option::Option::None),
    };
    let millis = |ms: Option<u64>| {
        some(ms.map(|ms| {
            let ms = Literal::u64_suffixed(ms);
            quote!(#private::Duration::from_millis(#ms))
        }))
    };
    let bytes = |n: Option<u64>| {
        some(n.map(|n| {
            let n = Literal::u64_unsuffixed(n);
            quote!(#n)
        }))
    };
    let (lease, retention) = (millis(args.lease_ms), millis(args.retention_ms));
    let (max_body, max_response) = (bytes(args.max_body), bytes(args.max_response));
    quote! {
        #private::Endpoint {
            require_key: #require_key,
            lease: #lease,
            retention: #retention,
            max_body: #max_body,
            max_response: #max_response,
            ..#private::Endpoint::OPTIONAL
        }
    }
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_segment(&g.elem),
        Type::Paren(p) => last_segment(&p.elem),
        _ => None,
    }
}

/// `Outer<Inner>` → `Inner` when the last segment is named `outer`.
fn single_generic<'a>(ty: &'a Type, outer: &str) -> Option<&'a Type> {
    let segment = last_segment(ty)?;
    if segment.ident != outer {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &segment.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        syn::GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let first = types.next()?;
    types.next().is_none().then_some(first)
}

fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_empty())
}

/// `web::Payload` and `Multipart` stream the request body; caught by name before type checking
/// (actix-multipart is not a dependency of the runtime, so no trait of ours can name it).
fn streaming_request(ty: &Type) -> syn::Result<()> {
    for name in ["Payload", "Multipart"] {
        if is_named(ty, name) {
            return Err(Error::new_spanned(
                ty,
                format!(
                    "#[idempotent] cannot wrap a handler that takes `{name}`: it streams the \
                     request body, which must be buffered to fingerprint and replay the request; \
                     take `web::Bytes`, `String` or `web::Json<T>` instead, or leave this handler \
                     without #[idempotent]"
                ),
            ));
        }
    }
    Ok(())
}

/// The trait probe for streaming bodies that hide behind another name (a type alias): if `T`
/// streams, require `T: BufferedBody`, whose `on_unimplemented` message explains why. The call
/// is spanned at the type's last token and the probe at its first, so the caret covers it.
fn buffered_body_probe(private: &TokenStream, ty: &Type) -> TokenStream {
    let tokens = ty.to_token_stream();
    let mut iter = tokens.into_iter();
    let first = iter.next().map_or_else(Span::call_site, |t| t.span());
    let last = iter.last().map_or(first, |t| t.span());
    // The receiver is a local named at the type's first token: the interpolated runtime path
    // carries the call site's span, which would otherwise pull the error onto the attribute.
    let probe = proc_macro2::Ident::new("__idempotent_probe", first);
    let check = quote_spanned!(last=> #probe.check());
    quote! {{
        #[allow(unused_imports)]
        use #private::NotStreaming as _;
        let #probe = #private::Probe::<#ty>::new();
        #check;
    }}
}
