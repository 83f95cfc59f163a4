//! Questions about the handler's types that the signature model and the checks both ask.

use syn::{GenericArgument, PathArguments, Type};

/// The last path segment of a type (`axum::Json<T>` → `Json<T>`), if it is a path.
pub(crate) fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_segment(&g.elem),
        Type::Paren(p) => last_segment(&p.elem),
        _ => None,
    }
}

/// `Outer<Inner>` → `Inner` when the last segment is named `outer`.
pub(crate) fn single_generic<'a>(ty: &'a Type, outer: &str) -> Option<&'a Type> {
    let segment = last_segment(ty)?;
    if segment.ident != outer {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
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
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_empty())
}
