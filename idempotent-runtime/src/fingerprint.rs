//! The request fingerprint of [the contract](crate::design) §4.
//!
//! SHA-256 over a version tag and a length-prefixed sequence of nine segments. No serializer is
//! involved, so two replicas (and two releases) agree byte for byte; golden vectors in the tests
//! pin the encoding. Each segment is framed so that an absent segment differs from an empty one:
//!
//! | frame | bytes |
//! |---|---|
//! | absent | `0x00` |
//! | bytes | `0x01`, length as u64 big-endian, the bytes |
//! | list | `0x02`, count as u64 big-endian, each element framed |
//!
//! A query pair is a list of one element (`a`) or two (`a=` → name and empty value).
//!
//! Version 2 covers a list of JSON Pointers into the body instead of the
//! whole body; its canonical form is in [`BodySubset`]'s docs.

use std::borrow::Cow;

use sha2::{Digest, Sha256};

use crate::digest::Encoder;
use crate::scope::Scope;

// Version 2: the fingerprint over JSON Pointers into the body (issue 31).
mod subset;
pub use subset::BodySubset;
#[cfg(test)]
// Read by the plain-function tests, which tell its version apart from a request's.
#[cfg_attr(not(all(test, feature = "serde")), allow(unused_imports))]
pub(crate) use subset::SUBSET_VERSION;
pub(crate) use subset::{SubsetError, compute_subset, compute_version_subset};

/// The encoding version new fingerprints are computed with.
pub(crate) const CURRENT_VERSION: u16 = 1;

const TAG_V1: &[u8] = b"idempotent-fingerprint/v1\n";

/// A computed fingerprint and the version of the encoding that produced it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// Encoding version (1 for new fingerprints over the whole body, 2 over a [`BodySubset`]).
    pub version: u16,
    /// SHA-256 digest.
    pub digest: [u8; 32],
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint(v{}:", self.version)?;
        for b in &self.digest[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}

/// What the fingerprint is computed from; the framework integrations fill it in.
#[derive(Debug, Clone, Copy)]
pub struct FingerprintInput<'a> {
    /// Request method, e.g. `POST`.
    pub method: &'a str,
    /// Matched route pattern including any nest/scope prefix; `None` when no route matched.
    pub route: Option<&'a str>,
    /// Path parameter values as decoded by the framework, in pattern order.
    pub path_params: &'a [&'a str],
    /// Raw query string (after `?`, not percent-decoded); `None` when the URI has no `?`.
    pub query: Option<&'a str>,
    /// The caller's scope (segments 5–7).
    pub scope: &'a Scope,
    /// The `Content-Type` field value as received.
    pub content_type: Option<&'a [u8]>,
    /// The request body after transfer decoding.
    pub body: &'a [u8],
}

/// The segments a [`FingerprintContributor`] may replace. Tenant, subject and client id
/// (segments 5–7) are deliberately missing: they are the scope and must never be changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Segment {
    /// 1: method.
    Method,
    /// 2: matched route pattern.
    Route,
    /// 3: path parameter values.
    PathParams,
    /// 4: query pairs.
    Query,
    /// 8: `Content-Type`.
    ContentType,
    /// 9: SHA-256 of the body.
    Body,
}

impl Segment {
    fn slot(self) -> usize {
        match self {
            Self::Method => 0,
            Self::Route => 1,
            Self::PathParams => 2,
            Self::Query => 3,
            Self::ContentType => 4,
            Self::Body => 5,
        }
    }
}

/// Changes a contributor makes to the standard segments: replacements and appended segments.
#[derive(Debug, Default, Clone)]
pub struct Contribution {
    replaced: [Option<Option<Vec<u8>>>; 6],
    appended: Vec<Option<Vec<u8>>>,
}

impl Contribution {
    /// Replaces a standard segment with `value` (`None` encodes as absent).
    pub fn replace(&mut self, segment: Segment, value: Option<Vec<u8>>) {
        self.replaced[segment.slot()] = Some(value);
    }

    /// Appends a segment after the nine standard ones.
    pub fn append(&mut self, value: Option<Vec<u8>>) {
        self.appended.push(value);
    }

    fn replacement(&self, segment: Segment) -> Option<&Option<Vec<u8>>> {
        self.replaced[segment.slot()].as_ref()
    }
}

/// A hook that adjusts what a request's fingerprint covers, e.g. to ignore a volatile JSON field
/// (replace [`Segment::Body`] with the hash of a canonical form) or to add a header that matters.
///
/// It may replace standard segments or append new ones; it can neither insert in the middle nor
/// touch the scope segments. Changing a contributor changes fingerprints: in-flight retries would
/// see 422, so deploy such a change like a schema change.
pub trait FingerprintContributor: Send + Sync + 'static {
    /// Records replacements and additions for this request into `contribution`.
    fn contribute(&self, input: &FingerprintInput<'_>, contribution: &mut Contribution);
}

/// Computes the fingerprint with the current encoding.
pub(crate) fn compute(
    input: &FingerprintInput<'_>,
    contributor: Option<&dyn FingerprintContributor>,
) -> Fingerprint {
    compute_version(CURRENT_VERSION, input, contributor)
        .expect("the current fingerprint version is always known")
}

/// Computes the fingerprint with the encoding of `version`, so that a record written by another
/// release is compared with its own encoder. `None` for a version this release does not know.
/// Version 2 also needs the endpoint's pointers: [`compute_version_subset`] answers every version.
pub(crate) fn compute_version(
    version: u16,
    input: &FingerprintInput<'_>,
    contributor: Option<&dyn FingerprintContributor>,
) -> Option<Fingerprint> {
    if version != 1 {
        return None;
    }
    let contribution = contributor.map(|c| {
        let mut contribution = Contribution::default();
        c.contribute(input, &mut contribution);
        contribution
    });
    let replaced = |segment| contribution.as_ref().and_then(|c| c.replacement(segment));

    let mut h = Sha256::new();
    h.update(TAG_V1);
    let mut enc = Encoder(&mut h);

    match replaced(Segment::Method) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.bytes(input.method.as_bytes()),
    }
    match replaced(Segment::Route) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.opt_bytes(input.route.map(str::as_bytes)),
    }
    match replaced(Segment::PathParams) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => {
            enc.list(input.path_params.len());
            for value in input.path_params {
                enc.bytes(value.as_bytes());
            }
        }
    }
    match replaced(Segment::Query) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => encode_query(&mut enc, input.query),
    }
    input.scope.encode_segments(&mut enc);
    match replaced(Segment::ContentType) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.opt_bytes(input.content_type),
    }
    match replaced(Segment::Body) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.bytes(&Sha256::digest(input.body)),
    }
    if let Some(contribution) = &contribution {
        for extra in &contribution.appended {
            enc.opt_bytes(extra.as_deref());
        }
    }
    Some(Fingerprint {
        version,
        digest: h.finalize().into(),
    })
}

/// Query pairs, raw, sorted stably by name and framed by their count.
fn encode_query(enc: &mut Encoder<'_>, query: Option<&str>) {
    let Some(query) = query else {
        return enc.absent();
    };
    let mut pairs: Vec<(&str, Option<&str>)> = if query.is_empty() {
        Vec::new()
    } else {
        query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, value)) => (name, Some(value)),
                None => (pair, None),
            })
            .collect()
    };
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    enc.list(pairs.len());
    for (name, value) in pairs {
        match value {
            Some(value) => {
                enc.list(2);
                enc.bytes(name.as_bytes());
                enc.bytes(value.as_bytes());
            }
            None => {
                enc.list(1);
                enc.bytes(name.as_bytes());
            }
        }
    }
}

#[cfg_attr(not(feature = "actix"), allow(dead_code))]
/// Percent-decodes a path segment lossily, as `Path` extractors do: for routers that keep raw
/// segments (actix), so segment 3 holds the decoded values in every framework.
pub(crate) fn percent_decode(segment: &str) -> Cow<'_, str> {
    if !segment.contains('%') {
        return Cow::Borrowed(segment);
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) if hex(*hi).is_some() && hex(*lo).is_some() => {
                let (hi, lo) = (hex(*hi).unwrap_or(0), hex(*lo).unwrap_or(0));
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::{ClientId, Identity, Scope};
    use proptest::prelude::*;

    fn scope() -> Scope {
        Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap()
    }

    fn input<'a>(
        scope: &'a Scope,
        query: Option<&'a str>,
        params: &'a [&'a str],
    ) -> FingerprintInput<'a> {
        FingerprintInput {
            method: "POST",
            route: Some("/shops/{shop}/orders"),
            path_params: params,
            query,
            scope,
            content_type: Some(b"application/json"),
            body: br#"{"sku":"A1","quantity":1}"#,
        }
    }

    fn hex(fp: Fingerprint) -> String {
        fp.digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    // Both digests were also produced by an independent Python rendition of the encoding in the
    // module docs; a change here breaks every stored record and needs a new version.
    fn golden_vectors_pin_the_v1_encoding() {
        let s = scope();
        let base = input(&s, Some("b=2&a=1"), &["7"]);
        assert_eq!(
            hex(compute(&base, None)),
            "a0c65f2ea52cbd3ed6bb4a76565ffe710c112dc96f99f00e5692bcd5245bf80b"
        );
        let anonymous =
            Scope::from_identity(&Identity::default(), Some("192.0.2.1".parse().unwrap())).unwrap();
        let empty = FingerprintInput {
            method: "POST",
            route: None,
            path_params: &[],
            query: None,
            scope: &anonymous,
            content_type: None,
            body: b"",
        };
        assert_eq!(
            hex(compute(&empty, None)),
            "81b62ccd701e34b24d0673ad8f82792379ee3b68a0ea694dff1b974de58c03be"
        );
    }

    #[test]
    fn query_order_does_not_matter_but_pairs_do() {
        let s = scope();
        let a = compute(&input(&s, Some("a=1&b=2"), &["1"]), None);
        assert_eq!(a, compute(&input(&s, Some("b=2&a=1"), &["1"]), None));
        assert_ne!(a, compute(&input(&s, Some("a=1&b=3"), &["1"]), None));
        // `a` and `a=` differ, and nothing is percent-decoded.
        assert_ne!(
            compute(&input(&s, Some("a"), &["1"]), None),
            compute(&input(&s, Some("a="), &["1"]), None)
        );
        assert_ne!(
            compute(&input(&s, Some("a=%41"), &["1"]), None),
            compute(&input(&s, Some("a=A"), &["1"]), None)
        );
    }

    #[test]
    fn repeated_query_names_keep_their_order() {
        let s = scope();
        assert_ne!(
            compute(&input(&s, Some("a=1&a=2"), &["1"]), None),
            compute(&input(&s, Some("a=2&a=1"), &["1"]), None)
        );
    }

    #[test]
    fn path_parameter_values_are_part_of_the_fingerprint() {
        let s = scope();
        assert_ne!(
            compute(&input(&s, None, &["1"]), None),
            compute(&input(&s, None, &["2"]), None)
        );
        // framed by count: ["ab"] is not ["a", "b"]
        assert_ne!(
            compute(&input(&s, None, &["ab"]), None),
            compute(&input(&s, None, &["a", "b"]), None)
        );
    }

    #[test]
    fn absent_differs_from_empty() {
        let s = scope();
        assert_ne!(
            compute(&input(&s, None, &[]), None),
            compute(&input(&s, Some(""), &[]), None)
        );
        let mut a = input(&s, None, &[]);
        let mut b = a;
        a.content_type = None;
        b.content_type = Some(b"");
        assert_ne!(compute(&a, None), compute(&b, None));
    }

    #[test]
    fn scope_segments_separate_callers() {
        let alice = scope();
        let other_tenant =
            Scope::from_identity(&Identity::subject("globex", "alice"), None).unwrap();
        let client = Scope::from_identity(
            &Identity {
                client: Some(ClientId::ApiKey("alice".into())),
                ..Identity::default()
            },
            None,
        )
        .unwrap();
        let a = compute(&input(&alice, None, &[]), None);
        assert_ne!(a, compute(&input(&other_tenant, None, &[]), None));
        assert_ne!(a, compute(&input(&client, None, &[]), None));
    }

    struct IgnoreBody;
    impl FingerprintContributor for IgnoreBody {
        fn contribute(&self, _: &FingerprintInput<'_>, c: &mut Contribution) {
            c.replace(Segment::Body, None);
        }
    }

    struct AddTag(&'static str);
    impl FingerprintContributor for AddTag {
        fn contribute(&self, _: &FingerprintInput<'_>, c: &mut Contribution) {
            c.append(Some(self.0.as_bytes().to_vec()));
        }
    }

    #[test]
    fn contributors_replace_and_append_segments() {
        let s = scope();
        let a = input(&s, None, &[]);
        let mut b = a;
        b.body = b"other";
        assert_ne!(compute(&a, None), compute(&b, None));
        assert_eq!(
            compute(&a, Some(&IgnoreBody)),
            compute(&b, Some(&IgnoreBody))
        );
        assert_ne!(
            compute(&a, Some(&AddTag("x"))),
            compute(&a, Some(&AddTag("y")))
        );
        assert_ne!(compute(&a, Some(&AddTag("x"))), compute(&a, None));
    }

    #[test]
    fn unknown_versions_are_not_computed() {
        let s = scope();
        assert!(compute_version(2, &input(&s, None, &[]), None).is_none());
    }

    proptest! {
        #[test]
        fn any_permutation_of_distinct_names_gives_one_fingerprint(
            pairs in proptest::collection::btree_map("[a-z]{1,5}", "[a-z0-9%=]{0,5}", 0..8),
            seed in any::<u64>(),
        ) {
            let s = scope();
            let mut list: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let sorted = list.join("&");
            let n = list.len().max(1);
            list.rotate_left((seed as usize) % n);
            list.reverse();
            let shuffled = list.join("&");
            prop_assert_eq!(
                compute(&input(&s, Some(&sorted), &[]), None),
                compute(&input(&s, Some(&shuffled), &[]), None)
            );
        }

        #[test]
        fn different_bodies_give_different_fingerprints(a in proptest::collection::vec(any::<u8>(), 0..64), b in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assume!(a != b);
            let s = scope();
            let mut x = input(&s, None, &[]);
            let mut y = x;
            x.body = &a;
            y.body = &b;
            prop_assert_ne!(compute(&x, None), compute(&y, None));
        }
    }

    #[test]
    fn path_segments_are_fully_decoded() {
        assert_eq!(percent_decode("a%2Fb%20c"), "a/b c");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
        assert_eq!(percent_decode("%C3%A9"), "é");
    }
}
