//! The axum expansion.
//!
//! ```text
//! #[idempotent(require_key)]
//! async fn create(State(db): State<Db>, Json(req): Json<New>) -> R { body }
//! ```
//! becomes
//! ```text
//! async fn create(
//!     __idempotent_arg0: State<Db>,
//!     __idempotent_last: rt::__private::axum::Idempotent<Json<New>, FromState, true, 0, 0, 0, 0>,
//! ) -> rt::__private::axum::Response {
//!     async fn __idempotent_inner(State(db): State<Db>, Json(req): Json<New>) -> R { body }
//!     __idempotent_last.run(move |v, ctx| async move { into_response(__idempotent_inner(__idempotent_arg0, v).await) }).await
//! }
//! ```
//! The last parameter's extractor does the whole pipeline before the body runs: replays and
//! refusals are its rejection, so the handler never runs for them.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Error, FnArg, ItemFn, ReturnType, Type};

use crate::args::{Args, Framework};
use crate::checks;

/// Expands `#[idempotent]` for axum; on error, the error and the untouched function.
pub(crate) fn expand(args: Args, item: ItemFn) -> TokenStream {
    match try_expand(&args, &item) {
        Ok(tokens) => tokens,
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#e #item)
        }
    }
}

enum Param<'a> {
    /// An ordinary extractor, passed through.
    Plain(&'a Type),
    /// `IdempotencyContext`, supplied by the runtime after the claim.
    Context,
    /// `Option<IdempotencyContext>`.
    OptionalContext,
    /// `&mut EnlistedTx`, the enlisted request's transaction.
    Tx,
}

fn try_expand(args: &Args, item: &ItemFn) -> syn::Result<TokenStream> {
    let rt = args.runtime();
    let sig = &item.sig;
    if let Some((Framework::Actix, span)) = args.framework {
        return Err(Error::new(
            span,
            "this is axum's #[idempotent]; use `idempotent_runtime::actix::idempotent` for an \
             actix-web handler",
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
    checks::streaming_response(&sig.output)?;

    let mut params = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pat_type) = input else {
            return Err(Error::new(
                input.span(),
                "#[idempotent] handlers are free functions: remove `self`",
            ));
        };
        let ty = &*pat_type.ty;
        checks::streaming_request(ty)?;
        let param = if checks::enlisted_tx(ty, args.enlisted.is_some())? {
            Param::Tx
        } else if checks::is_named(ty, "IdempotencyContext") {
            if !args.require_key {
                return Err(Error::new(
                    ty.span(),
                    "`IdempotencyContext` exists only when the request has a key: add `require_key` \
                     to #[idempotent], or take `Option<IdempotencyContext>`",
                ));
            }
            Param::Context
        } else if checks::single_generic(ty, "Option")
            .is_some_and(|t| checks::is_named(t, "IdempotencyContext"))
        {
            Param::OptionalContext
        } else {
            Param::Plain(ty)
        };
        params.push(param);
    }

    checks::enlisted_params(
        args.enlisted,
        params.iter().filter(|p| matches!(p, Param::Tx)).count(),
        sig,
    )?;
    let enlisted = args.enlisted.is_some();

    let from_extension = params.iter().any(|p| match p {
        Param::Plain(ty) => checks::single_generic(ty, "Extension")
            .is_some_and(|t| checks::is_named(t, "Idempotency")),
        _ => false,
    });
    let source = if from_extension {
        quote!(#rt::__private::axum::FromExtension)
    } else {
        quote!(#rt::__private::axum::FromState)
    };

    let wrapped = params.iter().rposition(|p| matches!(p, Param::Plain(_)));
    let unit: Type = syn::parse_quote!(());
    let wrapped_ty = match wrapped {
        Some(i) => match &params[i] {
            Param::Plain(ty) => *ty,
            _ => unreachable!("rposition found a plain parameter"),
        },
        None => &unit,
    };

    let mut emitted_checks = Vec::new();
    emitted_checks.push(checks::buffered_body_probe(&rt, wrapped_ty));
    if !from_extension {
        for p in &params {
            if let Param::Plain(ty) = p
                && let Some(state) = checks::single_generic(ty, "State")
            {
                emitted_checks.push(checks::state_provides_store(&rt, state));
            }
        }
    }

    let endpoint = {
        let require = args.require_key;
        let [lease, retention, max_body, max_response] = [
            args.lease_ms,
            args.retention_ms,
            args.max_body,
            args.max_response,
        ]
        .map(|v| v.unwrap_or(0));
        quote!(#require, #lease, #retention, #max_body, #max_response)
    };

    let wrapper = if enlisted {
        quote!(#rt::__private::axum::EnlistedIdempotent)
    } else {
        quote!(#rt::__private::axum::Idempotent)
    };
    let tx = format_ident!("__idempotent_tx");
    let last = format_ident!("__idempotent_last");
    let value = format_ident!("__idempotent_value");
    let context = format_ident!("__idempotent_context");
    let mut outer_inputs = Vec::new();
    let mut call_args = Vec::new();
    let mut needs_context = false;
    for (i, p) in params.iter().enumerate() {
        match p {
            Param::Plain(ty) if Some(i) == wrapped => {
                outer_inputs.push(quote!(
                    #last: #wrapper<#ty, #source, #endpoint>
                ));
                call_args.push(quote!(#value));
            }
            Param::Plain(ty) => {
                let arg = format_ident!("__idempotent_arg{}", i);
                outer_inputs.push(quote!(#arg: #ty));
                call_args.push(quote!(#arg));
            }
            Param::Context => {
                needs_context = true;
                call_args.push(quote!(::core::clone::Clone::clone(&#context)));
            }
            Param::OptionalContext => {
                call_args.push(quote!(::core::clone::Clone::clone(&#context)));
            }
            Param::Tx => call_args.push(quote!(&mut #tx)),
        }
    }
    if wrapped.is_none() {
        outer_inputs.push(quote!(
            #last: #wrapper<(), #source, #endpoint>
        ));
    }
    let missing = if enlisted {
        quote!((#tx, #rt::__private::axum::context_missing()))
    } else {
        quote!(#rt::__private::axum::context_missing())
    };
    let unwrap_context = needs_context.then(|| {
        quote! {
            let #context = match #context {
                ::core::option::Option::Some(c) => c,
                ::core::option::Option::None => return #missing,
            };
        }
    });

    let attrs = &item.attrs;
    let vis = &item.vis;
    let name = &sig.ident;
    let inner_ident = format_ident!("__idempotent_inner");
    let mut inner_sig = sig.clone();
    inner_sig.ident = inner_ident.clone();
    let block = &item.block;
    let output_span = match &sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => Span::call_site(),
    };
    let into_response = quote_spanned!(output_span=> #rt::__private::axum::into_response);
    let response = quote!(#rt::__private::axum::Response);

    let run = if enlisted {
        // The transaction travels into the handler's task and back out with the response,
        // so the runtime can record in it and commit.
        quote! {
            #last.run(move |mut #tx, #value, #context| async move {
                #unwrap_context
                let __idempotent_response = #into_response(#inner_ident(#(#call_args),*).await);
                (#tx, __idempotent_response)
            })
        }
    } else {
        quote! {
            #last.run(move |#value, #context| async move {
                #unwrap_context
                #into_response(#inner_ident(#(#call_args),*).await)
            })
        }
    };

    Ok(quote! {
        #(#attrs)*
        #vis async fn #name(#(#outer_inputs),*) -> #response {
            #(#emitted_checks)*
            #[allow(clippy::too_many_arguments, clippy::unused_async)]
            #inner_sig #block
            #run
            .await
        }
    })
}
