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
//!     async fn create(db: web::Data<Db>, web::Json(req): web::Json<New>) -> R { body }
//!     enum IdempotentCreate {}
//!     impl rt::__private::Endpoint for IdempotentCreate {
//!         const CONFIG: &'static EndpointConfig = &EndpointConfig::new().require_key(true);
//!     }
//!     rt::__private::actix::handle(__idempotent_req, __idempotent_payload,
//!         <IdempotentCreate as rt::__private::Endpoint>::CONFIG,
//!         |req, mut payload| async move {
//!             let __idempotent_arg0 = match <web::Data<Db> as FromRequest>::from_request(&req, &mut payload).await { … };
//!             let __idempotent_arg1 = …;
//!             respond(create(__idempotent_arg0, __idempotent_arg1).await, &req)
//!         }).await
//! }
//! ```
//! The runtime buffers the payload and claims the key first; the original extractors then run,
//! in order, on the buffered body, inside the task that runs the handler.

use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;

use crate::args::{Args, Framework};
use crate::checks;
use crate::detect::Beside;
use crate::signature::{self, Handler, Names};

/// Expands `#[idempotent]` for actix-web; on error, the error and the untouched function.
pub(crate) fn expand(args: &Args, item: &syn::ItemFn, beside: &Beside) -> TokenStream {
    signature::expand(args, item, beside, Framework::Actix, emit)
}

fn emit(args: &Args, handler: &Handler<'_>) -> TokenStream {
    let rt = args.runtime();
    let private = quote!(#rt::__private::actix);
    let req = format_ident!("__idempotent_req");
    let payload = format_ident!("__idempotent_payload");

    let probes = handler
        .extractors()
        .map(|(_, p)| checks::body_probe(&private, Framework::Actix, p.ty));
    let mut extract = Vec::new();
    let mut extracted = Vec::new();
    let mut extracted_types = Vec::new();
    for (i, p) in handler.extractors() {
        let (arg, ty) = (Names::arg(i), p.ty);
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
        extracted.push(arg);
        extracted_types.push(ty);
    }
    let call_args = handler.call_args(None);
    let Names { tx, context } = Names::new();
    let inner = handler.inner_name();
    let unwrap_context = handler.unwrap_context(&private);
    let respond = handler.at_output(&quote!(#private::HandlerResponse), "respond");
    let returned = Ident::new("__idempotent_returned", handler.output_span());
    let (handle, tx_param, answer) = if handler.enlisted {
        (
            quote!(#private::handle_enlisted),
            {
                let tx_type = handler.tx_type;
                quote!(, mut #tx: #tx_type)
            },
            quote!((#tx, #respond(#returned, &#req))),
        )
    } else {
        (
            quote!(#private::handle),
            quote!(),
            quote!(#respond(#returned, &#req)),
        )
    };

    let item = handler.item;
    let attrs = &handler.outer_attrs;
    let inner_fn = handler.inner_fn();
    let vis = &item.vis;
    let name = &item.sig.ident;
    let endpoint = crate::endpoint::type_name(&item.sig.ident);
    let endpoint_item = crate::endpoint::item(args, &endpoint, &syn::Visibility::Inherited, &[]);
    quote! {
        #(#attrs)*
        #vis async fn #name(
            #req: #private::Request,
            #payload: #private::Payload,
        ) -> #private::Response {
            #(#probes)*
            #inner_fn
            #endpoint_item
            #handle(
                #req,
                #payload,
                <#endpoint as #rt::__private::Endpoint>::CONFIG,
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
    }
}
