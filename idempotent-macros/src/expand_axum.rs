//! The axum expansion.
//!
//! ```text
//! #[idempotent(require_key)]
//! async fn create(State(db): State<Db>, Json(req): Json<New>) -> R { body }
//! ```
//! becomes
//! ```text
//! enum IdempotentCreate {}
//! impl rt::__private::Endpoint for IdempotentCreate {
//!     const CONFIG: &'static EndpointConfig = &EndpointConfig::new().require_key(true);
//! }
//! async fn create(
//!     __idempotent_arg0: State<Db>,
//!     __idempotent_last: rt::__private::axum::Idempotent<Json<New>, FromState, IdempotentCreate>,
//! ) -> rt::__private::axum::Response {
//!     async fn create(State(db): State<Db>, Json(req): Json<New>) -> R { body }
//!     __idempotent_last.run(move |v, ctx| async move { into_response(create(__idempotent_arg0, v).await) }).await
//! }
//! ```
//! The last extractor is wrapped in the runtime's, which does the whole pipeline before the body
//! runs: replays and refusals are its rejection, so the handler never runs for them. The
//! endpoint's settings are a type beside the handler (see [`crate::endpoint`]): the extractor's
//! type parameter, so the signature can name them.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use crate::args::{Args, Framework};
use crate::checks;
use crate::detect::Beside;
use crate::signature::{self, Handler, Names, Role};

/// Expands `#[idempotent]` for axum; on error, the error and the untouched function.
pub(crate) fn expand(args: &Args, item: &syn::ItemFn, beside: &Beside) -> TokenStream {
    signature::expand(args, item, beside, Framework::Axum, emit)
}

fn emit(args: &Args, handler: &Handler<'_>) -> TokenStream {
    let rt = args.runtime();
    let private = quote!(#rt::__private::axum);
    let from_extension = handler.store_from_extension();

    let mut probes: Vec<_> = handler
        .extractors()
        .map(|(_, p)| checks::body_probe(&private, Framework::Axum, p.ty))
        .collect();
    if !from_extension {
        probes.extend(handler.params.iter().filter_map(|p| match p.role {
            Role::State(state) => Some(checks::state_provides_store(&private, state)),
            _ => None,
        }));
    }

    // A handler that names no `State` takes the handle from whatever state the router has: the
    // wrapper is generic over that state, bounded on `ProvidesIdempotency` (whose self type is
    // the state, so rustc cannot guess it from the bound). A router without the handle in its
    // state then fails at `post(handler)` with that trait's message, instead of rustc inferring
    // the state to be the handle itself and reporting a `MethodRouter` type mismatch.
    // `#[axum::debug_handler]` refuses generic functions: under it, the state stays inferred.
    let debug_handler = handler.outer_attrs.iter().any(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "debug_handler")
    });
    let state_generic = !from_extension
        && !debug_handler
        && !handler
            .params
            .iter()
            .any(|p| matches!(p.role, Role::State(_)));
    let state_param = format_ident!("__IdempotentState");
    let source = if from_extension {
        quote!(#private::FromExtension)
    } else if state_generic {
        quote!(#private::FromStateOf<#state_param>)
    } else {
        quote!(#private::FromState)
    };
    let generics = state_generic.then(|| quote!(<#state_param: #private::ProvidesIdempotency>));
    let item = handler.item;
    let endpoint = crate::endpoint::type_name(&item.sig.ident);
    let cfgs: Vec<_> = handler
        .outer_attrs
        .iter()
        .copied()
        .filter(|a| a.path().is_ident("cfg"))
        .collect();
    let endpoint_item = crate::endpoint::item(args, &endpoint, &item.vis, &cfgs);
    let wrapper = if handler.enlisted {
        quote!(#private::EnlistedIdempotent)
    } else {
        quote!(#private::Idempotent)
    };

    let last = format_ident!("__idempotent_last");
    let value = format_ident!("__idempotent_value");
    // An enlisted wrapper names the database of the handler's transaction, read off the type
    // the handler wrote (`EnlistedTx` is PostgreSQL's, `EnlistedTx<MySql>` MySQL's).
    let database = handler
        .tx_type
        .map(|tx| quote!(, <#tx as #private::TxDatabase>::Database));
    let mut outer_inputs: Vec<_> = handler
        .extractors()
        .map(|(i, p)| {
            let ty = p.ty;
            if Some(i) == handler.body {
                quote!(#last: #wrapper<#ty, #source, #endpoint #database>)
            } else {
                let arg = Names::arg(i);
                quote!(#arg: #ty)
            }
        })
        .collect();
    if handler.body.is_none() {
        outer_inputs.push(quote!(#last: #wrapper<(), #source, #endpoint #database>));
    }
    let call_args = handler.call_args(Some(&value));
    let Names { tx, context } = Names::new();
    let inner = handler.inner_name();
    let unwrap_context = handler.unwrap_context(&private);
    let into_response = handler.at_output(&private, "into_response");
    let run = if handler.enlisted {
        // The transaction travels into the handler's task and back out with the response,
        // so the runtime can record in it and commit.
        quote! {
            #last.run(move |mut #tx, #value, #context| async move {
                #unwrap_context
                let __idempotent_response = #into_response(#inner(#(#call_args),*).await);
                (#tx, __idempotent_response)
            })
        }
    } else {
        quote! {
            #last.run(move |#value, #context| async move {
                #unwrap_context
                #into_response(#inner(#(#call_args),*).await)
            })
        }
    };

    let attrs = &handler.outer_attrs;
    let vis = &item.vis;
    let name = &item.sig.ident;
    let inner_fn = handler.inner_fn();
    quote! {
        #endpoint_item
        #(#attrs)*
        #vis async fn #name #generics(#(#outer_inputs),*) -> #private::Response {
            #(#probes)*
            #inner_fn
            #run
            .await
        }
    }
}
