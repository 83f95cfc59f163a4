//! What the handler's own tokens say about it, before any type checking: the route attributes
//! beside `#[idempotent]` (below it, in the item; above it, in the source text), and which
//! framework its types belong to, for the short path when both frameworks are on.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::{Attribute, ItemFn, Meta, ReturnType};

use crate::args::Framework;

/// actix-web's route attributes (`actix_web::post`, …): one method each, `route` and `routes`
/// with the methods they list.
const ACTIX_ROUTES: [&str; 11] = [
    "get", "post", "put", "delete", "patch", "head", "options", "trace", "connect", "route",
    "routes",
];

/// Whether `name` is one of actix-web's route attributes.
pub(crate) fn is_actix_route(name: &str) -> bool {
    ACTIX_ROUTES.contains(&name)
}

/// Methods idempotent by HTTP semantics, which the attribute never applies to (DESIGN.md §8).
const SAFE_METHODS: [&str; 4] = ["GET", "HEAD", "OPTIONS", "TRACE"];

/// The attributes beside `#[idempotent]`: the item's own (those below it) and those above it,
/// which the compiler has not handed to this macro, read back from the source file.
pub(crate) struct Beside {
    /// The attributes written directly above `#[idempotent]`, nearest last.
    pub above: Vec<Attribute>,
}

impl Beside {
    /// Nothing above (tests, and call sites whose source cannot be read).
    pub fn none() -> Self {
        Self { above: Vec::new() }
    }

    /// The attributes above the attribute being expanded, from its source file. An attribute
    /// above `#[idempotent]` expands first and hands this macro the item without itself (an
    /// actix `#[post]` above re-emits the function inside its factory), so its tokens are
    /// gone; its text is not. Where the source cannot be read (an IDE, a macro-generated
    /// call) nothing is found, and the checks that use it do not apply.
    pub fn at_call_site() -> Self {
        let span = proc_macro::Span::call_site();
        let own = span.source_text().unwrap_or_default();
        if !own.starts_with("#[") {
            return Self::none();
        }
        let Some(file) = span.local_file() else {
            return Self::none();
        };
        let Ok(text) = std::fs::read_to_string(file) else {
            return Self::none();
        };
        let Some(offset) = byte_offset(&text, span.line(), span.column()) else {
            return Self::none();
        };
        let above = attributes_before(&text[..offset])
            .into_iter()
            .filter_map(|attr| syn::parse_str::<AttrText>(attr).ok().map(|a| a.0))
            .collect();
        Self { above }
    }

    /// Every attribute beside the handler: above `#[idempotent]`, then below it.
    fn all<'a>(&'a self, item: &'a ItemFn) -> impl Iterator<Item = &'a Attribute> {
        self.above.iter().chain(&item.attrs)
    }
}

struct AttrText(Attribute);

impl syn::parse::Parse for AttrText {
    fn parse(input: syn::parse::ParseStream<'_>) -> syn::Result<Self> {
        let mut attrs = Attribute::parse_outer(input)?;
        match (attrs.pop(), attrs.is_empty() && input.is_empty()) {
            (Some(attr), true) => Ok(Self(attr)),
            _ => Err(input.error("one attribute")),
        }
    }
}

/// The byte offset of a one-based line and column (in characters).
fn byte_offset(text: &str, line: usize, column: usize) -> Option<usize> {
    let start: usize = text
        .split_inclusive('\n')
        .take(line.checked_sub(1)?)
        .map(str::len)
        .sum();
    let rest = text.get(start..)?;
    let within = rest
        .char_indices()
        .nth(column.checked_sub(1)?)
        .map_or(rest.len(), |(i, _)| i);
    Some(start + within)
}

/// The outer attributes that end `text`, in source order: `#[…]` groups separated by
/// whitespace and line comments (`///` doc comments among them). Brackets inside string
/// literals are skipped; anything else ends the search.
fn attributes_before(text: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut end = text.len();
    loop {
        let before = text[..end].trim_end();
        // A line comment (or doc comment) that ends the text: skip its line.
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        if before[line_start..].trim_start().starts_with("//") {
            end = line_start;
            continue;
        }
        if !before.ends_with(']') {
            break;
        }
        let Some(open) = matching_open(before) else {
            break;
        };
        if !before[..open].ends_with('#') {
            break;
        }
        found.push(&before[open - 1..]);
        end = open - 1;
    }
    found.reverse();
    found
}

/// The index of the `[` that the final `]` of `text` closes.
fn matching_open(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let (mut depth, mut in_string) = (0usize, false);
    for i in (0..bytes.len()).rev() {
        let escaped = i > 0 && bytes[i - 1] == b'\\';
        match bytes[i] {
            b'"' if !escaped => in_string = !in_string,
            b']' if !in_string => depth += 1,
            b'[' if !in_string => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// An actix-web route attribute (`#[post("/x")]`, `#[actix_web::get("/x")]`, `#[route("/x",
/// method = "GET")]`) and the methods it routes for (`routes` lists none of its own).
pub(crate) struct Route<'a> {
    /// The attribute, for the caret.
    pub attr: &'a Attribute,
    /// Its methods, upper case.
    pub methods: Vec<String>,
}

/// The actix-web route attributes beside the handler, above or below `#[idempotent]`.
pub(crate) fn actix_routes<'a>(beside: &'a Beside, item: &'a ItemFn) -> Vec<Route<'a>> {
    beside
        .all(item)
        .filter_map(|attr| {
            let path = attr.path();
            let name = path.segments.last()?.ident.to_string();
            let actix = path.segments.len() == 1
                || (path.segments.len() == 2 && path.segments[0].ident == "actix_web");
            if !actix || !ACTIX_ROUTES.contains(&name.as_str()) {
                return None;
            }
            let methods = match name.as_str() {
                "route" => route_methods(attr),
                "routes" => Vec::new(),
                method => vec![method.to_ascii_uppercase()],
            };
            Some(Route { attr, methods })
        })
        .collect()
}

/// The `method = "…"` arguments of `#[route("/x", method = "GET", …)]`.
fn route_methods(attr: &Attribute) -> Vec<String> {
    let Meta::List(list) = &attr.meta else {
        return Vec::new();
    };
    let parser = syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated;
    let Ok(args) = list.parse_args_with(parser) else {
        return Vec::new();
    };
    args.iter()
        .filter_map(|arg| match arg {
            syn::Expr::Assign(assign) => {
                let is_method =
                    matches!(&*assign.left, syn::Expr::Path(p) if p.path.is_ident("method"));
                match &*assign.right {
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    }) if is_method => Some(s.value().to_ascii_uppercase()),
                    _ => None,
                }
            }
            _ => None,
        })
        .collect()
}

/// The handler's route attributes when every method they name is GET, HEAD, OPTIONS or TRACE:
/// routed for those only, the attribute would never apply.
pub(crate) fn only_safe_methods<'a>(routes: &'a [Route<'a>]) -> Option<&'a Route<'a>> {
    let methods: Vec<&str> = routes
        .iter()
        .flat_map(|r| r.methods.iter().map(String::as_str))
        .collect();
    let all_safe = !methods.is_empty() && methods.iter().all(|m| SAFE_METHODS.contains(m));
    all_safe
        .then(|| routes.iter().find(|r| !r.methods.is_empty()))
        .flatten()
}

/// What the handler's tokens say its framework is.
pub(crate) enum Verdict {
    /// Only this framework's tokens.
    Is(Framework),
    /// Tokens of both: one of each (axum's, actix-web's).
    Both(TokenStream, TokenStream),
    /// Nothing that only one of them has.
    Unknown,
}

/// The framework a handler's tokens name, for the short path with both frameworks on.
///
/// actix-web: a route attribute beside it (`#[post]`, `#[route]`, …, above or below), a path
/// through `actix_web` or its `web` module (`web::Json`, `web::Data`, `web::Path`, …), or
/// `HttpRequest`, `HttpResponse`, `HttpResponseBuilder`, `Responder` anywhere in the signature.
/// axum: `#[debug_handler]` beside it, a path through `axum` or `axum_extra`, or `State`,
/// `Extension`, `ConnectInfo`, `MatchedPath`, `OriginalUri`, `RawPathParams`, `IntoResponse`,
/// `IntoResponseParts`, `Response` anywhere in the signature. Everything else (`Json`, `Path`,
/// `Query`, `Form`, `Bytes`, `String`, `Html`, `Redirect`, `StatusCode`, …) exists in both and
/// says nothing.
pub(crate) fn framework(beside: &Beside, item: &ItemFn) -> Verdict {
    let mut axum = None;
    let mut actix = actix_routes(beside, item)
        .first()
        .map(|r| r.attr.path().to_token_stream());
    if let Some(attr) = beside.all(item).find(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "debug_handler")
    }) {
        axum = Some(attr.path().to_token_stream());
    }
    let mut visit = Votes {
        axum: &mut axum,
        actix: &mut actix,
    };
    for input in &item.sig.inputs {
        if let syn::FnArg::Typed(pat) = input {
            syn::visit::Visit::visit_type(&mut visit, &pat.ty);
        }
    }
    if let ReturnType::Type(_, ty) = &item.sig.output {
        syn::visit::Visit::visit_type(&mut visit, ty);
    }
    match (axum, actix) {
        (Some(axum), Some(actix)) => Verdict::Both(axum, actix),
        (Some(_), None) => Verdict::Is(Framework::Axum),
        (None, Some(_)) => Verdict::Is(Framework::Actix),
        (None, None) => Verdict::Unknown,
    }
}

struct Votes<'v> {
    axum: &'v mut Option<TokenStream>,
    actix: &'v mut Option<TokenStream>,
}

const AXUM_NAMES: [&str; 9] = [
    "State",
    "Extension",
    "ConnectInfo",
    "MatchedPath",
    "OriginalUri",
    "RawPathParams",
    "IntoResponse",
    "IntoResponseParts",
    "Response",
];
const ACTIX_NAMES: [&str; 4] = [
    "HttpRequest",
    "HttpResponse",
    "HttpResponseBuilder",
    "Responder",
];

impl<'ast> syn::visit::Visit<'ast> for Votes<'_> {
    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        let shown = || {
            let mut tokens = path.leading_colon.to_token_stream();
            for pair in path.segments.pairs() {
                pair.value().ident.to_tokens(&mut tokens);
                if let Some(colons) = pair.punct() {
                    colons.to_tokens(&mut tokens);
                }
            }
            tokens
        };
        let first = segments.first().map(String::as_str);
        let last = segments.last().map(String::as_str).unwrap_or_default();
        let actix = matches!(first, Some("actix_web"))
            || segments[..segments.len().saturating_sub(1)]
                .iter()
                .any(|s| s == "web")
            || ACTIX_NAMES.contains(&last);
        let axum = matches!(first, Some("axum" | "axum_extra")) || AXUM_NAMES.contains(&last);
        if actix && self.actix.is_none() {
            *self.actix = Some(shown());
        } else if axum && !actix && self.axum.is_none() {
            *self.axum = Some(shown());
        }
        syn::visit::visit_path(self, path);
    }
}

/// Tokens as a user writes them: `web::Json<T>`, not `web :: Json < T >`.
pub(crate) fn shown(tokens: &TokenStream) -> String {
    let mut text = tokens.to_string();
    for (spaced, tight) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" < ", "<"),
        ("< ", "<"),
        (" >", ">"),
        (" ,", ","),
        ("& ", "&"),
        (" (", "("),
        ("( ", "("),
        (" )", ")"),
        (" : ", ": "),
    ] {
        text = text.replace(spaced, tight);
    }
    text
}

/// A signature's parameters and return type, as written, for an error message.
pub(crate) fn shown_signature(sig: &syn::Signature) -> String {
    let params = shown(&sig.inputs.to_token_stream());
    match &sig.output {
        ReturnType::Default => format!("({params})"),
        ReturnType::Type(_, ty) => format!("({params}) -> {}", shown(&ty.to_token_stream())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(item: &str) -> &'static str {
        let item: ItemFn = syn::parse_str(item).unwrap();
        match framework(&Beside::none(), &item) {
            Verdict::Is(Framework::Axum) => "axum",
            Verdict::Is(Framework::Actix) => "actix",
            Verdict::Both(..) => "both",
            Verdict::Unknown => "unknown",
        }
    }

    #[test]
    fn the_framework_is_told_by_tokens_only_one_of_them_has() {
        for (item, expected) in [
            ("async fn f(s: State<S>, b: Json<T>) -> String {}", "axum"),
            ("async fn f(b: axum::Json<T>) {}", "axum"),
            ("async fn f(b: Json<T>) -> impl IntoResponse {}", "axum"),
            ("async fn f(b: Bytes) -> Response {}", "axum"),
            ("async fn f(e: Extension<Idempotency>) {}", "axum"),
            ("async fn f(b: web::Json<T>) -> String {}", "actix"),
            ("async fn f(d: web::Data<Db>) {}", "actix"),
            ("async fn f(b: Json<T>) -> HttpResponse {}", "actix"),
            ("async fn f(r: HttpRequest) {}", "actix"),
            ("async fn f(b: String) -> impl Responder {}", "actix"),
            ("async fn f(b: actix_web::web::Bytes) {}", "actix"),
            (
                "#[post(\"/x\")] async fn f(b: String) -> String {}",
                "actix",
            ),
            (
                "#[actix_web::route(\"/x\", method = \"PUT\")] async fn f() {}",
                "actix",
            ),
            ("#[axum::debug_handler] async fn f() {}", "axum"),
            ("async fn f(s: State<S>) -> HttpResponse {}", "both"),
            ("async fn f(b: Json<T>) -> Json<T> {}", "unknown"),
            (
                "async fn f(b: String, p: Path<u32>, q: Query<Q>) -> String {}",
                "unknown",
            ),
            (
                "async fn f(c: IdempotencyContext) -> (StatusCode, Bytes) {}",
                "unknown",
            ),
        ] {
            assert_eq!(verdict(item), expected, "{item}");
        }
    }

    #[test]
    fn attributes_are_read_back_from_the_text_above() {
        let text = "use x;\n\n/// Docs [with brackets].\n#[post(\"/a]\")]\n  // note\n#[allow(\n  dead_code,\n)]\n";
        assert_eq!(
            attributes_before(text),
            ["#[post(\"/a]\")]", "#[allow(\n  dead_code,\n)]"]
        );
        assert!(attributes_before("fn g() {}\n").is_empty());
        assert!(attributes_before("let v = a[0]").is_empty());
        let offset = byte_offset("ab\ncd\n", 2, 2).unwrap();
        assert_eq!(offset, 4);
    }

    #[test]
    fn only_safe_methods_are_found_across_route_attributes() {
        let check = |attrs: &str| {
            let item: ItemFn = syn::parse_str(&format!("{attrs} async fn f() {{}}")).unwrap();
            let beside = Beside::none();
            let routes = actix_routes(&beside, &item);
            only_safe_methods(&routes).map(|r| r.attr.path().to_token_stream().to_string())
        };
        assert_eq!(check("#[get(\"/x\")]").as_deref(), Some("get"));
        assert_eq!(
            check("#[actix_web::head(\"/x\")]").as_deref(),
            Some("actix_web :: head")
        );
        assert_eq!(
            check("#[route(\"/x\", method = \"GET\", method = \"HEAD\")]").as_deref(),
            Some("route")
        );
        assert_eq!(
            check("#[route(\"/x\", method = \"GET\", method = \"POST\")]"),
            None
        );
        assert_eq!(check("#[routes] #[get(\"/x\")] #[post(\"/y\")]"), None);
        assert_eq!(check("#[post(\"/x\")]"), None);
        assert_eq!(check("#[tracing::instrument]"), None);
    }
}
