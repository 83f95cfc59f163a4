//! The endpoint's settings as the runtime's `EndpointConfig`, built in a `const` through its
//! `const fn` setters:
//!
//! ```text
//! enum IdempotentCreate {}
//! impl rt::__private::Endpoint for IdempotentCreate {
//!     const CONFIG: &'static rt::__private::EndpointConfig = &rt::__private::EndpointConfig::new()
//!         .require_key(true)
//!         .lease(rt::__private::lease("30s"))
//!         .max_body(rt::__private::size("64KiB"))
//!         .non_replayable(&[rt::__private::status(404)]);
//! }
//! ```
//!
//! Each value goes through the runtime's parser or check (the grammar the file form reads
//! too), spanned at the literal it came from: a bad value panics in the `const`, and the
//! compiler reports that at the user's token. A free `const _` naming the impl's constant makes
//! the compiler evaluate it whether or not the handler is routed, `cargo check` included.

use proc_macro2::{Group, Literal, Span, TokenStream, TokenTree};
use quote::quote;

use crate::args::{Args, FailureMode, KeyArg, ReuseStatus};

/// `tokens` with every span set to `span`, so that an expression built from them is reported
/// at `span` as a whole.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tree| {
            if let TokenTree::Group(group) = &tree {
                let mut inner = Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                tree = TokenTree::Group(inner);
            } else {
                tree.set_span(span);
            }
            tree
        })
        .collect()
}

/// The `EndpointConfig` expression (a `&'static` reference, as `Endpoint::CONFIG` holds it).
fn config(args: &Args, private: &TokenStream, name: &proc_macro2::Ident) -> TokenStream {
    let mut chain = quote!(#private::EndpointConfig::new());
    let mut set = |setter: &str, value: TokenStream| {
        let setter = proc_macro2::Ident::new(setter, Span::call_site());
        chain = quote!(#chain.#setter(#value));
    };
    if args.require_key {
        set("require_key", quote!(true));
    }
    let parsed = |parser: &str, lit: &syn::LitStr| {
        let parser = proc_macro2::Ident::new(parser, Span::call_site());
        respan(quote!(#private::#parser(#lit)), lit.span())
    };
    if let Some(lit) = &args.lease {
        set("lease", parsed("lease", lit));
    }
    if let Some(lit) = &args.retention {
        set("retention", parsed("duration", lit));
    }
    if let Some(lit) = &args.wait_in_progress {
        set("wait_in_progress", parsed("duration", lit));
    }
    if let Some(lit) = &args.max_body {
        set("max_body", parsed("size", lit));
    }
    if let Some(lit) = &args.max_response {
        set("max_response", parsed("size", lit));
    }
    if let Some(status) = args.reuse_status {
        let variant = match status {
            ReuseStatus::UnprocessableContent => quote!(UnprocessableContent),
            ReuseStatus::Conflict => quote!(Conflict),
        };
        set("reuse_status", quote!(#private::ReuseStatus::#variant));
    }
    if let Some(mode) = args.failure_mode {
        let variant = match mode {
            FailureMode::Closed => quote!(Closed),
            FailureMode::Open => quote!(Open),
        };
        set("failure_mode", quote!(#private::FailureMode::#variant));
    }
    if let Some(oversized) = args.oversized {
        let variant = oversized.variant();
        set("oversized", quote!(#private::Oversized::#variant));
    }
    if let Some(bits) = args.methods {
        let bits = Literal::u8_unsuffixed(bits);
        set("methods", quote!(#private::Methods::from_bits(#bits)));
    }
    if let Some(statuses) = &args.non_replayable {
        let statuses = statuses.iter().map(|&(status, span)| {
            let status = Literal::u16_unsuffixed(status);
            respan(quote!(#private::status(#status)), span)
        });
        set("non_replayable", quote!(&[#(#statuses),*]));
    }
    if let Some(names) = &args.recorded_headers {
        let names = names
            .iter()
            .map(|lit| respan(quote!(#private::header(#lit)), lit.span()));
        set("recorded_headers", quote!(&[#(#names),*]));
    }
    match &args.key {
        Some(KeyArg::Header(lit)) => {
            // Header names are case-insensitive; the runtime keeps them in lowercase.
            let lower = syn::LitStr::new(&lit.value().to_ascii_lowercase(), lit.span());
            set(
                "key",
                respan(quote!(#private::key_header(#lower)), lit.span()),
            );
        }
        Some(KeyArg::Body(lit)) => set("key", respan(quote!(#private::key_body(#lit)), lit.span())),
        None => {}
    }
    if args.fingerprint.is_some() {
        // The pointers are a constant of their own (see `item`): a `const fn`'s argument is not
        // given a `'static` lifetime, a constant's value is.
        set(
            "fingerprint",
            quote!(#private::BodySubset::from_static(#name::FINGERPRINT)),
        );
    }
    quote!(&#chain)
}

/// The name of the type that holds handler `handler`'s settings: `IdempotentCreateOrder` for
/// `create_order`. It is what the compiler names when a value in the attribute is refused
/// ("evaluation of `<IdempotentCreateOrder as …::Endpoint>::CONFIG` failed here"), so it reads
/// as the handler's, where a `__`-prefixed name would read as machinery; it is not the
/// handler's own name, which a module or type of the user's beside it may already have.
pub(crate) fn type_name(handler: &syn::Ident) -> syn::Ident {
    let name = handler.to_string();
    let name = name.strip_prefix("r#").unwrap_or(&name);
    let camel: String = name
        .split('_')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect();
    quote::format_ident!("Idempotent{}", camel, span = handler.span())
}

/// An uninhabited type named `name` that implements the runtime's `Endpoint` with these
/// settings, under `attrs` (the handler's `#[cfg]`s, so it exists where the handler does).
pub(crate) fn item(
    args: &Args,
    name: &proc_macro2::Ident,
    vis: &syn::Visibility,
    attrs: &[&syn::Attribute],
) -> TokenStream {
    let rt = args.runtime();
    let private = quote!(#rt::__private);
    let config = config(args, &private, name);
    let pointers = args.fingerprint.as_ref().map(|pointers| {
        let pointers = pointers
            .iter()
            .map(|lit| respan(quote!(#private::pointer(#lit)), lit.span()));
        quote! {
            #(#attrs)*
            impl #name {
                const FINGERPRINT: &'static [#private::JsonPointer] = &[#(#pointers),*];
            }
        }
    });
    quote! {
        #(#attrs)*
        #[doc(hidden)]
        #[allow(non_camel_case_types, dead_code)]
        #vis enum #name {}
        #(#attrs)*
        impl #private::Endpoint for #name {
            const CONFIG: &'static #private::EndpointConfig = #config;
        }
        #pointers
        // A free constant is evaluated whether or not anything uses it; the impl's constant
        // only where the extractor is instantiated (a routed handler), which `cargo check`
        // never does.
        #(#attrs)*
        const _: &'static #private::EndpointConfig = <#name as #private::Endpoint>::CONFIG;
    }
}

#[cfg(test)]
mod tests {
    use super::type_name;

    #[test]
    fn the_settings_type_is_named_after_the_handler_in_camel_case() {
        let name = |handler: &str| {
            let ident: syn::Ident = syn::parse_str(handler).expect("an identifier");
            type_name(&ident).to_string()
        };
        assert_eq!(name("create"), "IdempotentCreate");
        assert_eq!(name("create_order"), "IdempotentCreateOrder");
        assert_eq!(name("_retry__payment_2"), "IdempotentRetryPayment2");
        assert_eq!(name("r#type"), "IdempotentType");
    }
}
