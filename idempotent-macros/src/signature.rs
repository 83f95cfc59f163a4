//! One model of the handler's signature, built once for both frameworks: each parameter with its
//! role, the body-bearing last extractor, the return type. Building it runs every syntactic check
//! of `checks.rs`, so `expand_axum.rs` and `expand_actix.rs` only emit.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{Ident, ItemFn, ReturnType, Type};

use crate::args::{Args, Framework};
use crate::checks;
use crate::detect::{self, Beside};
use crate::types::{is_named, single_generic};

/// What a handler parameter is to the expansion.
pub(crate) enum Role<'a> {
    /// An extractor of the framework's: passed through (axum) or run on the buffered body
    /// (actix).
    Extractor,
    /// `State<S>`, an extractor whose state must hold the handle when it is the store's source.
    State(&'a Type),
    /// `Extension<Idempotency>`, an extractor that makes the request extensions the store's
    /// source (axum).
    ExtensionStore,
    /// `IdempotencyContext` (only with `require_key`), supplied by the runtime after the claim.
    Context,
    /// `Option<IdempotencyContext>`, supplied by the runtime after the claim.
    OptionalContext,
    /// `&mut EnlistedTx`, the enlisted request's transaction.
    Tx,
}

/// One parameter of the handler.
pub(crate) struct Param<'a> {
    /// Its type, as the user wrote it.
    pub ty: &'a Type,
    /// What it is.
    pub role: Role<'a>,
}

impl Param<'_> {
    /// Whether the framework extracts it from the request (every role but the runtime's own).
    pub fn is_extractor(&self) -> bool {
        matches!(
            self.role,
            Role::Extractor | Role::State(_) | Role::ExtensionStore
        )
    }
}

/// The handler, checked: what both emitters start from.
pub(crate) struct Handler<'a> {
    /// The function as written.
    pub item: &'a ItemFn,
    /// Its parameters, in order.
    pub params: Vec<Param<'a>>,
    /// The index of the last extractor, the one that may take the body.
    pub body: Option<usize>,
    /// `enlisted`: the handler runs in the transaction that holds its reservation.
    pub enlisted: bool,
    /// The type behind the enlisted transaction's `&mut` (`EnlistedTx`, `EnlistedTx<MySql>`):
    /// the database of the transaction the handler gets.
    pub tx_type: Option<&'a Type>,
    /// The attributes that stay on the generated wrapper.
    pub outer_attrs: Vec<&'a syn::Attribute>,
    /// The attributes that stay on the user's function, kept inside the wrapper.
    pub inner_attrs: Vec<&'a syn::Attribute>,
}

/// The generated names both expansions use.
pub(crate) struct Names {
    /// The enlisted transaction.
    pub tx: Ident,
    /// The runtime's `Option<IdempotencyContext>`.
    pub context: Ident,
}

impl Names {
    pub fn new() -> Self {
        Self {
            tx: format_ident!("__idempotent_tx"),
            context: format_ident!("__idempotent_context"),
        }
    }

    /// The extracted value of parameter `index`.
    pub fn arg(index: usize) -> Ident {
        format_ident!("__idempotent_arg{}", index)
    }
}

/// Expands with `emit`; on error, the error and the untouched function.
pub(crate) fn expand(
    args: &Args,
    item: &ItemFn,
    beside: &Beside,
    framework: Framework,
    emit: fn(&Args, &Handler<'_>) -> TokenStream,
) -> TokenStream {
    match Handler::new(args, item, beside, framework) {
        Ok(handler) => emit(args, &handler),
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#e #item)
        }
    }
}

impl<'a> Handler<'a> {
    /// Models `item` and runs every syntactic check on it.
    pub fn new(
        args: &Args,
        item: &'a ItemFn,
        beside: &Beside,
        framework: Framework,
    ) -> syn::Result<Self> {
        let sig = &item.sig;
        checks::framework(args, framework)?;
        if framework == Framework::Actix {
            let routes = detect::actix_routes(beside, item);
            checks::routed_for_safe_methods(&routes)?;
            checks::routed_outside_methods(&routes, args.methods)?;
        }
        checks::shape(sig)?;
        checks::streaming_response(&sig.output)?;
        let enlisted = args.enlisted.is_some();
        let mut params = Vec::new();
        for input in &sig.inputs {
            let ty = checks::typed(input)?;
            let role = if checks::enlisted_tx(ty, enlisted)? {
                Role::Tx
            } else if is_named(ty, "IdempotencyContext") {
                checks::context_needs_key(ty, args.require_key)?;
                Role::Context
            } else if single_generic(ty, "Option")
                .is_some_and(|t| is_named(t, "IdempotencyContext"))
            {
                Role::OptionalContext
            } else {
                checks::extractor(ty, framework)?;
                if let Some(state) = single_generic(ty, "State") {
                    Role::State(state)
                } else if single_generic(ty, "Extension")
                    .is_some_and(|t| is_named(t, "Idempotency"))
                {
                    Role::ExtensionStore
                } else {
                    Role::Extractor
                }
            };
            params.push(Param { ty, role });
        }
        let transactions = params.iter().filter(|p| matches!(p.role, Role::Tx)).count();
        let tx_type = params
            .iter()
            .find(|p| matches!(p.role, Role::Tx))
            .map(|p| match p.ty {
                Type::Reference(r) => &*r.elem,
                other => other,
            });
        checks::enlisted_params(args.enlisted, transactions, sig)?;
        let body = params.iter().rposition(Param::is_extractor);
        if framework == Framework::Axum {
            for (i, p) in params.iter().enumerate() {
                if matches!(p.role, Role::Extractor) && Some(i) != body {
                    checks::body_not_last(p.ty)?;
                }
            }
        }
        let (mut outer_attrs, mut inner_attrs) = (Vec::new(), Vec::new());
        for attr in &item.attrs {
            match place(attr) {
                Place::Outer => outer_attrs.push(attr),
                Place::Both => {
                    outer_attrs.push(attr);
                    inner_attrs.push(attr);
                }
                Place::Inner => inner_attrs.push(attr),
            }
        }
        Ok(Self {
            item,
            params,
            body,
            enlisted,
            tx_type,
            outer_attrs,
            inner_attrs,
        })
    }

    /// The extractors, with their index among all parameters.
    pub fn extractors(&self) -> impl Iterator<Item = (usize, &Param<'a>)> {
        self.params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_extractor())
    }

    /// Whether the store comes from the request extensions instead of the state.
    pub fn store_from_extension(&self) -> bool {
        self.params
            .iter()
            .any(|p| matches!(p.role, Role::ExtensionStore))
    }

    /// The arguments the original function is called with: the runtime's context and
    /// transaction where it takes them, each extractor's value ([`Names::arg`]), or `body`
    /// for the body-bearing one when it is given.
    pub fn call_args(&self, body: Option<&Ident>) -> Vec<TokenStream> {
        let Names { tx, context, .. } = Names::new();
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| match p.role {
                Role::Context | Role::OptionalContext => {
                    quote!(::core::clone::Clone::clone(&#context))
                }
                Role::Tx => quote!(&mut #tx),
                _ => match body {
                    Some(body) if Some(i) == self.body => quote!(#body),
                    _ => {
                        let arg = Names::arg(i);
                        quote!(#arg)
                    }
                },
            })
            .collect()
    }

    /// With an `IdempotencyContext` parameter, the statement that unwraps the runtime's
    /// `Option` of it, or returns the framework's `context_missing()` answer (with the
    /// transaction, when enlisted). `private` is the framework's `__private` module.
    pub fn unwrap_context(&self, private: &TokenStream) -> Option<TokenStream> {
        let Names { tx, context, .. } = Names::new();
        let missing = if self.enlisted {
            quote!((#tx, #private::context_missing()))
        } else {
            quote!(#private::context_missing())
        };
        let needed = self.params.iter().any(|p| matches!(p.role, Role::Context));
        needed.then(|| {
            quote! {
                let #context = match #context {
                    ::core::option::Option::Some(context) => context,
                    ::core::option::Option::None => return #missing,
                };
            }
        })
    }

    /// The user's function, verbatim with its own attributes, to be defined inside the
    /// wrapper. It keeps its name (inside the wrapper's body it shadows the wrapper), so a
    /// `#[tracing::instrument]` span is named after the handler.
    pub fn inner_fn(&self) -> TokenStream {
        let attrs = &self.inner_attrs;
        let sig = &self.item.sig;
        let block = &self.item.block;
        quote! {
            #(#attrs)*
            #[allow(clippy::too_many_arguments, clippy::unused_async)]
            #sig #block
        }
    }

    /// The name the wrapper calls the user's function by: its own.
    pub fn inner_name(&self) -> &Ident {
        &self.item.sig.ident
    }

    /// Where errors about the returned value point: the return type, or the call site.
    pub fn output_span(&self) -> Span {
        match &self.item.sig.output {
            ReturnType::Type(_, ty) => ty.span(),
            ReturnType::Default => Span::call_site(),
        }
    }

    /// `private::function`, with the function's name spanned at the return type, so an error
    /// about the returned value points there.
    pub fn at_output(&self, private: &TokenStream, function: &str) -> TokenStream {
        let function = Ident::new(function, self.output_span());
        quote!(#private::#function)
    }
}

/// Where an attribute of the handler goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// On the wrapper the framework routes to: what describes the item from outside.
    Outer,
    /// On both: lint levels, so the wrapper's own lints answer to them too.
    Both,
    /// On the user's function, which the wrapper keeps verbatim: everything the macro does not
    /// know, `#[tracing::instrument]` among them (its fields name the parameters).
    Inner,
}

/// Which attributes stay outside: doc comments, `#[cfg]`, `#[deprecated]` (they describe the
/// item users name), actix-web's route attributes (they register the wrapper),
/// `#[debug_handler]` (it checks the handler axum sees) and `#[utoipa::path]` (it registers
/// the path under the item's name, at module level). `#[cfg_attr(…)]` follows what it wraps.
pub(crate) fn place(attr: &syn::Attribute) -> Place {
    let path = attr.path();
    if path.is_ident("cfg_attr") {
        return cfg_attr_place(attr);
    }
    place_of_path(path)
}

fn place_of_path(path: &syn::Path) -> Place {
    let names: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    match names.as_slice() {
        ["doc" | "cfg" | "deprecated"] => Place::Outer,
        ["allow" | "warn" | "deny" | "forbid"] => Place::Both,
        [.., "debug_handler"] | ["utoipa", "path"] => Place::Outer,
        [route] | ["actix_web", route] if detect::is_actix_route(route) => Place::Outer,
        _ => Place::Inner,
    }
}

/// `#[cfg_attr(predicate, a, b)]` goes where `a` and `b` go; split between places, on the
/// user's function.
fn cfg_attr_place(attr: &syn::Attribute) -> Place {
    let parser = syn::punctuated::Punctuated::<syn::Meta, syn::Token![,]>::parse_terminated;
    let Ok(metas) = attr.parse_args_with(parser) else {
        return Place::Inner;
    };
    let places: Vec<Place> = metas
        .iter()
        .skip(1)
        .map(|meta| place_of_path(meta.path()))
        .collect();
    match places.first() {
        Some(&first) if places.iter().all(|&p| p == first) => first,
        _ => Place::Inner,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(args: &str, item: &str, framework: Framework) -> syn::Result<Vec<&'static str>> {
        let args: Args = syn::parse_str(args).unwrap();
        let item: &'static ItemFn = Box::leak(Box::new(syn::parse_str(item).unwrap()));
        let handler = Handler::new(&args, item, &Beside::none(), framework)?;
        Ok(handler
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| match p.role {
                _ if Some(i) == handler.body => "body",
                Role::Extractor => "extractor",
                Role::State(_) => "state",
                Role::ExtensionStore => "extension store",
                Role::Context => "context",
                Role::OptionalContext => "optional context",
                Role::Tx => "tx",
            })
            .collect())
    }

    #[test]
    fn roles() {
        for framework in [Framework::Axum, Framework::Actix] {
            let roles = model(
                "require_key",
                "async fn f(s: State<S>, e: Extension<Idempotency>, c: IdempotencyContext, \
                 o: Option<IdempotencyContext>, b: Json<T>) {}",
                framework,
            )
            .unwrap();
            assert_eq!(
                roles,
                [
                    "state",
                    "extension store",
                    "context",
                    "optional context",
                    "body"
                ]
            );
            let roles = model(
                "enlisted",
                "async fn f(tx: &mut EnlistedTx, b: String, c: Option<IdempotencyContext>) {}",
                framework,
            )
            .unwrap();
            assert_eq!(roles, ["tx", "body", "optional context"]);
        }
    }

    #[test]
    fn the_same_checks_for_both_frameworks() {
        for item in [
            "fn f() {}",
            "async fn f<T>(t: T) {}",
            "async fn f(self) {}",
            "async fn f(x: impl Sized) {}",
            "async fn f(m: Multipart) {}",
            "async fn f(m: actix_multipart::Multipart) {}",
            "async fn f(m: Option<axum::extract::Multipart>) {}",
            "async fn f() -> Sse<S> {}",
            "async fn f(c: IdempotencyContext) {}",
            "async fn f(tx: &mut EnlistedTx) {}",
        ] {
            for framework in [Framework::Axum, Framework::Actix] {
                assert!(
                    model("", item, framework).is_err(),
                    "{item} for {framework:?}"
                );
            }
        }
    }

    #[test]
    fn payload_is_refused_for_actix_only_where_it_is_actix_s() {
        assert!(model("", "async fn f(p: web::Payload) {}", Framework::Actix).is_err());
        assert!(
            model(
                "",
                "async fn f(p: Option<dev::Payload>) {}",
                Framework::Actix
            )
            .is_err()
        );
        // A type of the application's that happens to be called `Payload`.
        assert!(model("", "async fn f(p: web::Json<Payload>) {}", Framework::Actix).is_ok());
        assert!(model("", "async fn f(p: Json<Payload>) {}", Framework::Axum).is_ok());
    }
}
