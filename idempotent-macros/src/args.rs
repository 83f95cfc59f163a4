//! The attribute's arguments: `require_key`, `lease = "30s"`, `retention = "24h"`,
//! `max_body = "64KiB"`, `max_response = "1MiB"`, `oversized = "run_again"|"record_without_body"`,
//! `reuse_status = 422|409`, `failure_mode = "closed"|"open"`, `non_replayable = [401, …]`,
//! `recorded_headers = ["content-type", …]`, `methods = ["POST", "PUT"]`, `crate = path`,
//! `key = header("webhook-id")|body("/id")`, `fingerprint = ["/amount", …]`,
//! `wait_in_progress = "5s"`,
//! `framework = axum|actix` and `enlisted`. Their shape and the choices are checked here, with
//! errors on the offending token; durations, sizes, statuses and header names are checked by the
//! runtime's own `const fn`s, which the expansion evaluates in a `const` spanned at the literal
//! (one grammar for the attribute and the file form: this crate has none of its own).

use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::{Error, LitInt, LitStr, Path, Token};

mod kw {
    syn::custom_keyword!(require_key);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(retention);
    syn::custom_keyword!(max_body);
    syn::custom_keyword!(max_response);
    syn::custom_keyword!(oversized);
    syn::custom_keyword!(reuse_status);
    syn::custom_keyword!(failure_mode);
    syn::custom_keyword!(non_replayable);
    syn::custom_keyword!(recorded_headers);
    syn::custom_keyword!(methods);
    syn::custom_keyword!(key);
    syn::custom_keyword!(wait_in_progress);
    syn::custom_keyword!(fingerprint);
    syn::custom_keyword!(header);
    syn::custom_keyword!(body);
    syn::custom_keyword!(framework);
    syn::custom_keyword!(enlisted);
    syn::custom_keyword!(axum);
    syn::custom_keyword!(actix);
}

/// Which framework an expansion targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framework {
    Axum,
    Actix,
}

/// `oversized = "…"`: what an answer over `max_response` leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Oversized {
    RunAgain,
    RecordWithoutBody,
}

impl Oversized {
    /// The runtime's variant of the same name.
    pub(crate) fn variant(self) -> proc_macro2::Ident {
        let name = match self {
            Self::RunAgain => "RunAgain",
            Self::RecordWithoutBody => "RecordWithoutBody",
        };
        proc_macro2::Ident::new(name, Span::call_site())
    }
}

/// `key = header("…")` or `key = body("/…")`: where the endpoint reads its key.
pub(crate) enum KeyArg {
    /// A header name, as written (the expansion lowercases it).
    Header(LitStr),
    /// A JSON Pointer into the body.
    Body(LitStr),
}

/// `reuse_status = 422 | 409`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReuseStatus {
    UnprocessableContent,
    Conflict,
}

/// `failure_mode = "closed" | "open"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureMode {
    Closed,
    Open,
}

/// The parsed arguments of `#[idempotent(...)]`.
#[derive(Default)]
pub(crate) struct Args {
    /// `require_key`: refuse requests without a key.
    pub require_key: bool,
    /// `lease = "…"`, as written (the runtime's grammar reads it in the expansion's `const`).
    pub lease: Option<LitStr>,
    /// `retention = "…"`, as written.
    pub retention: Option<LitStr>,
    /// `max_body = "…"`, as written.
    pub max_body: Option<LitStr>,
    /// `max_response = "…"`, as written.
    pub max_response: Option<LitStr>,
    /// `oversized = "run_again" | "record_without_body"`.
    pub oversized: Option<Oversized>,
    /// `reuse_status = 422 | 409`.
    pub reuse_status: Option<ReuseStatus>,
    /// `failure_mode = "closed" | "open"`.
    pub failure_mode: Option<FailureMode>,
    /// `non_replayable = [401, 403, …]`, each status with its token's span.
    pub non_replayable: Option<Vec<(u16, Span)>>,
    /// `recorded_headers = ["content-type", …]`, as written.
    pub recorded_headers: Option<Vec<LitStr>>,
    /// `methods = ["POST", …]`, as the runtime's `Methods` bits (POST 1, PUT 2, PATCH 4,
    /// DELETE 8).
    pub methods: Option<u8>,
    /// `wait_in_progress = "…"`, as written.
    pub wait_in_progress: Option<LitStr>,
    /// `key = header("…") | body("/…")`.
    pub key: Option<KeyArg>,
    /// `fingerprint = ["/amount", …]`: the JSON Pointers the fingerprint covers.
    pub fingerprint: Option<Vec<LitStr>>,
    /// `crate = path`: where the runtime is, for renamed dependencies.
    pub krate: Option<Path>,
    /// `framework = axum|actix`, with the span of the value.
    pub framework: Option<(Framework, Span)>,
    /// `enlisted`, with its span.
    pub enlisted: Option<Span>,
}

impl Args {
    /// The path generated code names the runtime by.
    pub fn runtime(&self) -> proc_macro2::TokenStream {
        match &self.krate {
            Some(path) => quote::quote!(#path),
            None => quote::quote!(::idempotent_runtime),
        }
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut seen: Vec<&'static str> = Vec::new();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            let name_span = input.span();
            let mut once = |name: &'static str| {
                if seen.contains(&name) {
                    return Err(Error::new(
                        name_span,
                        format!("`{name}` is given twice in #[idempotent]; keep one"),
                    ));
                }
                seen.push(name);
                Ok(())
            };
            if lookahead.peek(kw::require_key) {
                input.parse::<kw::require_key>()?;
                no_value(input, "require_key")?;
                once("require_key")?;
                args.require_key = true;
            } else if lookahead.peek(kw::enlisted) {
                input.parse::<kw::enlisted>()?;
                no_value(input, "enlisted")?;
                once("enlisted")?;
                args.enlisted = Some(name_span);
            } else if lookahead.peek(kw::lease) {
                input.parse::<kw::lease>()?;
                once("lease")?;
                args.lease = Some(string_value(input, "lease", "30s")?);
            } else if lookahead.peek(kw::retention) {
                input.parse::<kw::retention>()?;
                once("retention")?;
                args.retention = Some(string_value(input, "retention", "24h")?);
            } else if lookahead.peek(kw::max_body) {
                input.parse::<kw::max_body>()?;
                once("max_body")?;
                args.max_body = Some(string_value(input, "max_body", "64KiB")?);
            } else if lookahead.peek(kw::max_response) {
                input.parse::<kw::max_response>()?;
                once("max_response")?;
                args.max_response = Some(string_value(input, "max_response", "1MiB")?);
            } else if lookahead.peek(kw::reuse_status) {
                input.parse::<kw::reuse_status>()?;
                once("reuse_status")?;
                input.parse::<Token![=]>()?;
                let expected = "`reuse_status` is 422 (Unprocessable Content, the default) or 409 \
                                (Conflict), e.g. `reuse_status = 409`";
                if !input.peek(LitInt) {
                    return Err(Error::new(input.span(), expected));
                }
                let lit: LitInt = input.parse()?;
                args.reuse_status = Some(match lit.base10_digits() {
                    "422" => ReuseStatus::UnprocessableContent,
                    "409" => ReuseStatus::Conflict,
                    _ => return Err(Error::new(lit.span(), expected)),
                });
            } else if lookahead.peek(kw::failure_mode) {
                input.parse::<kw::failure_mode>()?;
                once("failure_mode")?;
                let lit = string_value(input, "failure_mode", "open")?;
                args.failure_mode = Some(match lit.value().as_str() {
                    "closed" => FailureMode::Closed,
                    "open" => FailureMode::Open,
                    other => {
                        return Err(Error::new(
                            lit.span(),
                            format!(
                                "invalid `failure_mode` {other:?}: expected \"closed\" (refuse with \
                                 503 while the store is unreachable, the default) or \"open\" \
                                 (run the handler unprotected)"
                            ),
                        ));
                    }
                });
            } else if lookahead.peek(kw::non_replayable) {
                input.parse::<kw::non_replayable>()?;
                once("non_replayable")?;
                args.non_replayable = Some(statuses_value(input)?);
            } else if lookahead.peek(kw::recorded_headers) {
                input.parse::<kw::recorded_headers>()?;
                once("recorded_headers")?;
                args.recorded_headers = Some(list_value(
                    input,
                    "recorded_headers",
                    "[\"content-type\", \"location\"]",
                    |i| i.parse::<LitStr>(),
                )?);
            } else if lookahead.peek(kw::oversized) {
                input.parse::<kw::oversized>()?;
                once("oversized")?;
                let lit = string_value(input, "oversized", "record_without_body")?;
                args.oversized = Some(match lit.value().as_str() {
                    "run_again" => Oversized::RunAgain,
                    "record_without_body" => Oversized::RecordWithoutBody,
                    other => {
                        return Err(Error::new(
                            lit.span(),
                            format!(
                                "invalid `oversized` {other:?}: expected \"run_again\" (release \
                                 the key; a retry runs the handler again) or \
                                 \"record_without_body\" (record the status and headers; a \
                                 retry replays them with an empty body)"
                            ),
                        ));
                    }
                });
            } else if lookahead.peek(kw::methods) {
                input.parse::<kw::methods>()?;
                once("methods")?;
                args.methods = Some(methods_value(input)?);
            } else if lookahead.peek(kw::wait_in_progress) {
                input.parse::<kw::wait_in_progress>()?;
                once("wait_in_progress")?;
                args.wait_in_progress = Some(string_value(input, "wait_in_progress", "5s")?);
            } else if lookahead.peek(kw::key) {
                input.parse::<kw::key>()?;
                once("key")?;
                args.key = Some(key_value(input)?);
            } else if lookahead.peek(kw::fingerprint) {
                input.parse::<kw::fingerprint>()?;
                once("fingerprint")?;
                let pointers = list_value(
                    input,
                    "fingerprint",
                    "[\"/amount\", \"/currency\"]",
                    |i| {
                        if i.peek(LitStr) {
                            i.parse::<LitStr>()
                        } else {
                            Err(Error::new(
                                i.span(),
                                "`fingerprint` lists JSON Pointers as strings, e.g. `[\"/amount\", \"/currency\"]`",
                            ))
                        }
                    },
                )?;
                if pointers.is_empty() {
                    return Err(Error::new(
                        name_span,
                        "`fingerprint = []` would compare no part of the body; list the fields \
                         that make two requests the same, or leave `fingerprint` out for the \
                         whole body",
                    ));
                }
                args.fingerprint = Some(pointers);
            } else if lookahead.peek(Token![crate]) {
                input.parse::<Token![crate]>()?;
                once("crate")?;
                input.parse::<Token![=]>()?;
                args.krate = Some(if input.peek(LitStr) {
                    let lit: LitStr = input.parse()?;
                    lit.parse().map_err(|_| {
                        Error::new(lit.span(), "`crate` must name a path, e.g. `crate = my_rt`")
                    })?
                } else {
                    Path::parse_mod_style(input)?
                });
            } else if lookahead.peek(kw::framework) {
                input.parse::<kw::framework>()?;
                once("framework")?;
                input.parse::<Token![=]>()?;
                let value = input.lookahead1();
                let span = input.span();
                let framework = if value.peek(kw::axum) {
                    input.parse::<kw::axum>()?;
                    Framework::Axum
                } else if value.peek(kw::actix) {
                    input.parse::<kw::actix>()?;
                    Framework::Actix
                } else {
                    return Err(Error::new(
                        span,
                        "expected `framework = axum` or `framework = actix`",
                    ));
                };
                args.framework = Some((framework, span));
            } else if input.peek(syn::Ident::peek_any) {
                let ident = input.call(proc_macro2::Ident::parse_any)?;
                return Err(Error::new(
                    ident.span(),
                    format!(
                        "unknown argument `{ident}` in #[idempotent]; expected one of: require_key, \
                         lease = \"30s\", retention = \"24h\", max_body = \"64KiB\", \
                         max_response = \"1MiB\", oversized = \"record_without_body\", \
                         reuse_status = 409, failure_mode = \"open\", non_replayable = [401, …], \
                         recorded_headers = [\"content-type\", …], methods = [\"POST\", \"PUT\"], \
                         key = header(\"webhook-id\") | body(\"/id\"), \
                         fingerprint = [\"/amount\", …], wait_in_progress = \"5s\", crate = path, framework = axum|actix, enlisted"
                    ),
                ));
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

/// A flag (`require_key`, `enlisted`) is on by being written: `= true` is refused, naming the
/// bare form, instead of syn's "expected `,`".
fn no_value(input: ParseStream<'_>, name: &str) -> syn::Result<()> {
    if !input.peek(Token![=]) {
        return Ok(());
    }
    let eq = input.parse::<Token![=]>()?;
    let value: proc_macro2::TokenTree = input.parse()?;
    Err(Error::new_spanned(
        quote::quote!(#eq #value),
        format!(
            "`{name}` takes no value: write `#[idempotent({name})]`, or leave `{name}` out \
             for the default"
        ),
    ))
}

fn string_value(input: ParseStream<'_>, name: &str, example: &str) -> syn::Result<LitStr> {
    input.parse::<Token![=]>()?;
    if !input.peek(LitStr) {
        return Err(Error::new(
            input.span(),
            format!("`{name}` takes a string, e.g. `{name} = \"{example}\"`"),
        ));
    }
    input.parse()
}

/// `[a, b, …]` of items `item` parses (a trailing comma allowed, empty allowed).
fn list_value<T>(
    input: ParseStream<'_>,
    name: &str,
    example: &str,
    item: fn(ParseStream<'_>) -> syn::Result<T>,
) -> syn::Result<Vec<T>> {
    input.parse::<Token![=]>()?;
    if !input.peek(syn::token::Bracket) {
        return Err(Error::new(
            input.span(),
            format!("`{name}` takes a list, e.g. `{name} = {example}`"),
        ));
    }
    let list;
    syn::bracketed!(list in input);
    Ok(list
        .parse_terminated(item, Token![,])?
        .into_iter()
        .collect())
}

/// `= header("name")` or `= body("/pointer")`. The name and the pointer are checked by the
/// runtime's `const fn`s in the expansion, at the literal.
fn key_value(input: ParseStream<'_>) -> syn::Result<KeyArg> {
    input.parse::<Token![=]>()?;
    let expected = "`key` is `header(\"name\")` (a request header, e.g. `header(\"webhook-id\")`) \
                    or `body(\"/pointer\")` (a JSON Pointer into the body, e.g. `body(\"/id\")`)";
    let lookahead = input.lookahead1();
    let header = if lookahead.peek(kw::header) {
        input.parse::<kw::header>()?;
        true
    } else if lookahead.peek(kw::body) {
        input.parse::<kw::body>()?;
        false
    } else {
        return Err(Error::new(input.span(), expected));
    };
    if !input.peek(syn::token::Paren) {
        return Err(Error::new(input.span(), expected));
    }
    let inner;
    syn::parenthesized!(inner in input);
    if !inner.peek(LitStr) {
        return Err(Error::new(inner.span(), expected));
    }
    let lit: LitStr = inner.parse()?;
    if !inner.is_empty() {
        return Err(Error::new(inner.span(), expected));
    }
    Ok(if header {
        KeyArg::Header(lit)
    } else {
        KeyArg::Body(lit)
    })
}

/// `[401, 403]`: integers that are `u16`s; which statuses may be listed is the runtime's check.
fn statuses_value(input: ParseStream<'_>) -> syn::Result<Vec<(u16, Span)>> {
    let lits = list_value(input, "non_replayable", "[401, 403, 404]", |i| {
        if i.peek(LitInt) {
            i.parse::<LitInt>()
        } else {
            Err(Error::new(
                i.span(),
                "`non_replayable` lists status codes as numbers, e.g. `[401, 403, 404]`",
            ))
        }
    })?;
    lits.iter()
        .map(|lit| match lit.base10_parse::<u16>() {
            Ok(status) if lit.suffix().is_empty() => Ok((status, lit.span())),
            _ => Err(Error::new(
                lit.span(),
                "not a status code: write it as a plain number, e.g. 404",
            )),
        })
        .collect()
}

/// `["POST", "PUT"]` → the runtime's `Methods` bits; each name is checked at its token.
fn methods_value(input: ParseStream<'_>) -> syn::Result<u8> {
    input.parse::<Token![=]>()?;
    if !input.peek(syn::token::Bracket) {
        return Err(Error::new(
            input.span(),
            "`methods` takes a list of method names, e.g. `methods = [\"POST\", \"PUT\"]`",
        ));
    }
    let list;
    let brackets = syn::bracketed!(list in input);
    let names = list.parse_terminated(|i| i.parse::<LitStr>(), Token![,])?;
    if names.is_empty() {
        return Err(Error::new(
            brackets.span.join(),
            "`methods` needs at least one method; leave it out for POST and PATCH",
        ));
    }
    let mut bits = 0;
    for name in &names {
        let bit = method_bit(&name.value()).map_err(|why| Error::new(name.span(), why))?;
        if bits & bit != 0 {
            return Err(Error::new(
                name.span(),
                format!("{:?} is listed twice in `methods`; keep one", name.value()),
            ));
        }
        bits |= bit;
    }
    Ok(bits)
}

/// One method name → its bit (the runtime's `Methods::parse`, which the macro cannot call).
pub(crate) fn method_bit(name: &str) -> Result<u8, String> {
    match name {
        "POST" => Ok(1),
        "PUT" => Ok(2),
        "PATCH" => Ok(4),
        "DELETE" => Ok(8),
        "GET" | "HEAD" | "OPTIONS" | "TRACE" => Err(format!(
            "`{name}` cannot be listed in `methods`: GET, HEAD, OPTIONS and TRACE are safe \
             methods (repeating them changes nothing), so they always pass through untouched"
        )),
        "CONNECT" => Err(
            "`CONNECT` cannot be listed in `methods`: it opens a tunnel, there is \
                          no response to record and replay"
                .to_owned(),
        ),
        other
            if ["POST", "PUT", "PATCH", "DELETE"]
                .contains(&other.to_ascii_uppercase().as_str()) =>
        {
            Err(format!(
                "method names are upper case, as HTTP spells them: write {:?}",
                other.to_ascii_uppercase()
            ))
        }
        other => Err(format!(
            "unknown method {other:?} in `methods`: expected POST, PUT, PATCH or DELETE"
        )),
    }
}

/// `enlisted` needs one of the runtime's SQL store features, `postgres`, `mysql` or `sqlite`
/// (forwarded to this crate, so the error names the cause instead of a missing path in the
/// expansion).
pub(crate) fn check_enlisted(args: &Args, sql_store: bool) -> syn::Result<()> {
    match args.enlisted {
        Some(span) if !sql_store => Err(Error::new(
            span,
            "`enlisted` runs the handler in a database transaction and needs a SQL store feature \
             of idempotent-runtime (`postgres`, `mysql` or `sqlite`): enable it \
             (`idempotent-runtime = { version = \"…\", features = [\"postgres\"] }`), or remove \
             `enlisted` to run in detached mode",
        )),
        _ => Ok(()),
    }
}

/// Parses the attribute's arguments and the function it sits on. On failure, the error comes
/// with the untouched item so the rest of the crate (and the IDE) still see the function.
pub(crate) fn parse(
    attr: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> Result<(Args, syn::ItemFn), proc_macro2::TokenStream> {
    let fail = |e: Error, item: &proc_macro2::TokenStream| {
        let e = e.to_compile_error();
        quote::quote!(#e #item)
    };
    let function: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            return Err(fail(
                Error::new(e.span(), "#[idempotent] goes on an `async fn` handler"),
                &item,
            ));
        }
    };
    let args: Args = syn::parse2(attr).map_err(|e| fail(e, &item))?;
    let sql_store = cfg!(any(
        feature = "postgres",
        feature = "mysql",
        feature = "sqlite"
    ));
    check_enlisted(&args, sql_store).map_err(|e| fail(e, &item))?;
    Ok((args, function))
}

/// A compile error at `span`, followed by the untouched function.
pub(crate) fn error_with_item(
    span: Span,
    message: &str,
    item: &syn::ItemFn,
) -> proc_macro2::TokenStream {
    let e = Error::new(span, message).to_compile_error();
    quote::quote!(#e #item)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments() {
        let args: Args = syn::parse_str(
            "require_key, lease = \"30s\", max_body = \"64KiB\", crate = my::rt, framework = axum",
        )
        .unwrap();
        assert!(args.require_key);
        assert_eq!(args.lease.map(|l| l.value()).as_deref(), Some("30s"));
        assert_eq!(args.max_body.map(|l| l.value()).as_deref(), Some("64KiB"));
        assert!(args.krate.is_some());
        assert_eq!(args.framework.map(|f| f.0), Some(Framework::Axum));
        assert!(syn::parse_str::<Args>("require_key, require_key").is_err());
        assert!(syn::parse_str::<Args>("bogus").is_err());
        assert!(syn::parse_str::<Args>("lease = 30").is_err());
        let flag = syn::parse_str::<Args>("require_key = true").err().unwrap();
        assert!(flag.to_string().contains("takes no value"), "{flag}");
        let bodiless: Args = syn::parse_str("oversized = \"record_without_body\"").unwrap();
        assert_eq!(bodiless.oversized, Some(Oversized::RecordWithoutBody));
        let again: Args = syn::parse_str("oversized = \"run_again\"").unwrap();
        assert_eq!(again.oversized, Some(Oversized::RunAgain));
        assert!(syn::parse_str::<Args>("oversized = \"truncate\"").is_err());
        assert!(syn::parse_str::<Args>("oversized = record_without_body").is_err());
    }

    #[test]
    fn every_per_route_setting() {
        let args: Args = syn::parse_str(
            r#"reuse_status = 409, failure_mode = "open", non_replayable = [401, 404,],
               recorded_headers = ["content-type", "x-trace"]"#,
        )
        .unwrap();
        assert_eq!(args.reuse_status, Some(ReuseStatus::Conflict));
        assert_eq!(args.failure_mode, Some(FailureMode::Open));
        let statuses = args.non_replayable.unwrap();
        assert_eq!(statuses.iter().map(|s| s.0).collect::<Vec<_>>(), [401, 404]);
        let headers = args.recorded_headers.unwrap();
        assert_eq!(
            headers.iter().map(LitStr::value).collect::<Vec<_>>(),
            ["content-type", "x-trace"]
        );
        let empty: Args = syn::parse_str("non_replayable = [], recorded_headers = []").unwrap();
        assert_eq!(empty.non_replayable.map(|l| l.len()), Some(0));
        for (bad, why) in [
            ("reuse_status = 418", "422"),
            ("reuse_status = \"409\"", "422"),
            ("failure_mode = \"maybe\"", "closed"),
            ("failure_mode = open", "takes a string"),
            ("non_replayable = 404", "a list"),
            ("non_replayable = [\"404\"]", "numbers"),
            ("non_replayable = [70000]", "not a status"),
            ("non_replayable = [404u8]", "not a status"),
            ("recorded_headers = \"etag\"", "a list"),
            ("recorded_headers = [etag]", "expected string literal"),
            ("reuse_status = 409, reuse_status = 422", "twice"),
        ] {
            let error = syn::parse_str::<Args>(bad).err().expect(bad).to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn methods() {
        let args: Args = syn::parse_str(r#"methods = ["POST", "PUT"]"#).unwrap();
        assert_eq!(args.methods, Some(1 | 2));
        let args: Args = syn::parse_str(r#"methods = ["DELETE",]"#).unwrap();
        assert_eq!(args.methods, Some(8));
        for (bad, why) in [
            (r#"methods = ["GET"]"#, "safe methods"),
            (r#"methods = ["POST", "HEAD"]"#, "safe methods"),
            (r#"methods = ["CONNECT"]"#, "tunnel"),
            (r#"methods = ["put"]"#, "upper case"),
            (r#"methods = ["BREW"]"#, "unknown method"),
            (r#"methods = []"#, "at least one"),
            (r#"methods = ["PUT", "PUT"]"#, "twice"),
            (r#"methods = "POST""#, "a list"),
        ] {
            let error = syn::parse_str::<Args>(bad).err().expect(bad).to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn enlisted_needs_a_sql_store_feature() {
        let args: Args = syn::parse_str("require_key, enlisted").unwrap();
        assert!(args.enlisted.is_some());
        let error = check_enlisted(&args, false).unwrap_err().to_string();
        assert!(error.contains("SQL store feature"), "{error}");
        assert!(check_enlisted(&args, true).is_ok());
        let detached: Args = syn::parse_str("require_key").unwrap();
        assert!(check_enlisted(&detached, false).is_ok());
    }
}
