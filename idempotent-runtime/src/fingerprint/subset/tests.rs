use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::fingerprint::compute;
use crate::key::json::JsonErrorReason;
use crate::scope::{Identity, Scope};

const PAYMENT_FIELDS: &[JsonPointer] = &[
    JsonPointer::from_static("/amount"),
    JsonPointer::from_static("/currency"),
    JsonPointer::from_static("/customer"),
];
const PAYMENT: BodySubset = BodySubset::from_static(PAYMENT_FIELDS);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn selection_digest(subset: &BodySubset, body: &str) -> String {
    hex(&Sha256::digest(subset.canonical(body.as_bytes()).unwrap()))
}

fn scope() -> Scope {
    Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap()
}

fn input<'a>(scope: &'a Scope, body: &'a str) -> FingerprintInput<'a> {
    FingerprintInput {
        method: "POST",
        route: Some("/payments"),
        path_params: &[],
        query: None,
        scope,
        content_type: Some(b"application/json"),
        body: body.as_bytes(),
    }
}

const KEY_ORDER: &str = r#"{"currency":"EUR","amount":100,"customer":{"name":"Ada","id":"c_1"}}"#;
const ABSENT: &str = r#"{"amount":100,"currency":"EUR"}"#;

/// Every digest here was also computed by an independent JavaScript rendition of the module
/// docs (RFC 8785 from `JSON.stringify` and the default UTF-16 sort, the frames by hand, node's
/// `crypto` SHA-256). A change here breaks every stored version 2 record and needs a version 3.
#[test]
fn golden_vectors_pin_the_selection_encoding() {
    let same = "f8853e33ec190abeb0f94e5091067e74a586db8709239d9dd83fa2fbfcdbec6a";
    for (what, body) in [
        ("key order", KEY_ORDER),
        (
            "whitespace",
            " {\n  \"amount\" : 100 ,\r\n\t\"customer\": { \"id\" : \"c_1\", \"name\":\"Ada\" },\"currency\":\"EUR\"\n} ",
        ),
        (
            "number forms",
            r#"{"amount":1e2,"currency":"EUR","customer":{"id":"c_1","name":"Ada"}}"#,
        ),
        (
            "unicode escapes",
            r#"{"amount":100,"currency":"\u0045\u0055\u0052","customer":{"id":"c\u005f1","name":"\u0041da"}}"#,
        ),
        (
            "an unselected volatile field",
            r#"{"amount":100,"currency":"EUR","customer":{"id":"c_1","name":"Ada"},"sent_at":"2026-12-01T23:00:00Z","nonce":"x7"}"#,
        ),
    ] {
        assert_eq!(selection_digest(&PAYMENT, body), same, "{what}");
    }
    for (what, body, digest) in [
        (
            "another amount",
            r#"{"amount":101,"currency":"EUR","customer":{"id":"c_1","name":"Ada"}}"#,
            "ba7889246d9dcac39af8a7b4a348d93d08d55d0b5ce0d2ed3aec2f5cc23054bc",
        ),
        (
            "nested objects, arrays, non-ASCII names sorted by UTF-16",
            r#"{"amount":0.1,"currency":"€","customer":{"b":{"d":1,"c":[1,{"z":0,"a":null}]},"\ud83d\ude00":"x","\ufb33":"y"}}"#,
            "c9378a9e9929c4f4159bfe6fda6e420cafd93358e95ffe59c8ab25c8de84d3ba",
        ),
        (
            "absent",
            ABSENT,
            "87861912e8f8b35d73af6a44c7e597fb787061eb7bdf00a7df5dd9264f5c5a53",
        ),
        (
            "null is not absent",
            r#"{"amount":100,"currency":"EUR","customer":null}"#,
            "b516298378a59c06b03ecdde2c16ce6d988e7b039091cbf2a004c65cac7dfc12",
        ),
    ] {
        assert_eq!(selection_digest(&PAYMENT, body), digest, "{what}");
    }
}

#[test]
fn golden_canonical_bytes_of_a_nested_selection() {
    let body = r#"{"amount":0.1,"currency":"€","customer":{"b":{"d":1,"c":[1,{"z":0,"a":null}]},"\ud83d\ude00":"x","\ufb33":"y"}}"#;
    assert_eq!(
        hex(&PAYMENT.canonical(body.as_bytes()).unwrap()),
        "0200000000000000030200000000000000020100000000000000072f616d6f756e74010000000000000003302e310200000000000000020100000000000000092f63757272656e637901000000000000000522e282ac220200000000000000020100000000000000092f637573746f6d657201000000000000003b7b2262223a7b2263223a5b312c7b2261223a6e756c6c2c227a223a307d5d2c2264223a317d2c22f09f9880223a2278222c22efacb3223a2279227d"
    );
}

#[test]
fn golden_vectors_pin_the_v2_fingerprint() {
    let s = scope();
    let fp = compute_subset(&input(&s, KEY_ORDER), &PAYMENT, None).unwrap();
    assert_eq!(fp.version, 2);
    assert_eq!(
        hex(&fp.digest),
        "d7c2ea7d6f678bc24e310f3f7fdd5f1043741cd873bfb5ac0d7461fecb680b67"
    );
    let fp = compute_subset(&input(&s, ABSENT), &PAYMENT, None).unwrap();
    assert_eq!(
        hex(&fp.digest),
        "89edc08fee65a5b054c2403abe8c3d03df42045b4781b59d0ac3c2dfaf0501b7"
    );
}

#[test]
fn pointer_order_and_repeats_do_not_matter() {
    let reordered = BodySubset::new(
        ["/customer", "/amount", "/currency", "/amount"].map(|p| JsonPointer::parse(p).unwrap()),
    );
    assert_eq!(
        PAYMENT.canonical(KEY_ORDER.as_bytes()),
        reordered.canonical(KEY_ORDER.as_bytes())
    );
}

#[test]
fn a_pointer_and_its_value_are_framed_together() {
    let outer = BodySubset::new([JsonPointer::parse("/a").unwrap()]);
    let inner = BodySubset::new([JsonPointer::parse("/a/b").unwrap()]);
    let body = br#"{"a":{"b":1}}"#;
    assert_ne!(outer.canonical(body), inner.canonical(body));
    // An empty list covers nothing of the body, but still asks for JSON.
    let none = BodySubset::new([]);
    assert_eq!(none.canonical(b"{}"), none.canonical(b"[1]"));
    assert!(none.canonical(b"not json").is_err());
}

#[test]
fn a_body_that_is_not_json_is_refused_400_body_invalid() {
    let s = scope();
    for (body, reason) in [
        ("amount=100", JsonErrorReason::Syntax),
        ("", JsonErrorReason::Syntax),
        (r#"{"amount":1,"amount":2}"#, JsonErrorReason::DuplicateName),
        (r#"{"amount":1e999}"#, JsonErrorReason::NumberOutOfRange),
    ] {
        let err = compute_subset(&input(&s, body), &PAYMENT, None).unwrap_err();
        assert_eq!(err.json_error().reason(), reason, "{body:?}");
        if reason == JsonErrorReason::NumberOutOfRange {
            assert_eq!(err.json_error().offset(), 10, "where the number starts");
        }
        let problem = err.problem();
        assert_eq!(
            (problem.status(), problem.code()),
            (400, ProblemCode::BodyInvalid)
        );
        assert!(!problem.detail().contains("amount"), "{}", problem.detail());
    }
    // A number out of range where no pointer looks is not canonicalised, so not refused.
    assert!(compute_subset(&input(&s, r#"{"amount":1,"x":1e999}"#), &PAYMENT, None).is_ok());
}

#[test]
fn stored_records_are_recomputed_with_their_own_version() {
    let s = scope();
    let req = input(&s, KEY_ORDER);
    // A version 1 record (before the endpoint had a subset) still matches this request.
    let v1 = compute(&req, None);
    assert_eq!(
        compute_version_subset(1, &req, Some(&PAYMENT), None),
        Some(Ok(v1))
    );
    let v2 = compute_subset(&req, &PAYMENT, None).unwrap();
    assert_ne!(v1.digest, v2.digest);
    assert_eq!(
        compute_version_subset(2, &req, Some(&PAYMENT), None),
        Some(Ok(v2))
    );
    // Version 2 without a subset, or an unknown version: not this request.
    assert_eq!(compute_version_subset(2, &req, None, None), None);
    assert_eq!(compute_version_subset(3, &req, Some(&PAYMENT), None), None);
    // Parsed once or from bytes: the same fingerprint.
    let doc = json::parse(req.body).unwrap();
    assert_eq!(compute_subset_document(&req, &PAYMENT, &doc, None), Ok(v2));
}

#[test]
fn the_other_segments_still_count() {
    let s = scope();
    let other = Scope::from_identity(&Identity::subject("globex", "alice"), None).unwrap();
    let a = compute_subset(&input(&s, KEY_ORDER), &PAYMENT, None).unwrap();
    assert_ne!(
        a,
        compute_subset(&input(&other, KEY_ORDER), &PAYMENT, None).unwrap()
    );
    let mut b = input(&s, KEY_ORDER);
    b.route = Some("/refunds");
    assert_ne!(a, compute_subset(&b, &PAYMENT, None).unwrap());
    let mut c = input(&s, KEY_ORDER);
    c.content_type = Some(b"application/json; charset=utf-8");
    assert_ne!(a, compute_subset(&c, &PAYMENT, None).unwrap());
}

struct TagTenantPlan;
impl FingerprintContributor for TagTenantPlan {
    fn contribute(&self, _: &FingerprintInput<'_>, c: &mut Contribution) {
        c.append(Some(b"plan:gold".to_vec()));
    }
}

#[test]
fn contributors_still_append_and_replace() {
    let s = scope();
    let req = input(&s, KEY_ORDER);
    let plain = compute_subset(&req, &PAYMENT, None).unwrap();
    assert_ne!(
        plain,
        compute_subset(&req, &PAYMENT, Some(&TagTenantPlan)).unwrap()
    );
}

// ---- properties -------------------------------------------------------------------------------

/// A JSON value whose equality is JSON equality: integers are exact doubles, objects have
/// unique names.
#[derive(Debug, Clone, PartialEq)]
enum Gen {
    Null,
    Bool(bool),
    Int(i32),
    Str(String),
    Arr(Vec<Gen>),
    Obj(BTreeMap<String, Gen>),
}

fn gen_value() -> impl Strategy<Value = Gen> {
    let leaf = prop_oneof![
        Just(Gen::Null),
        any::<bool>().prop_map(Gen::Bool),
        any::<i32>().prop_map(Gen::Int),
        "(?s).{0,6}".prop_map(Gen::Str),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Gen::Arr),
            proptest::collection::btree_map("(?s).{0,4}", inner, 0..5).prop_map(Gen::Obj),
        ]
    })
}

/// Writes `g` as JSON in a style chosen by `seed`: member order, whitespace, string escapes and
/// number forms all vary, the value does not.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn ws(n: u64, out: &mut String) {
    out.push_str(["", " ", "\n\t", "\r\n  "][(n % 4) as usize]);
}

fn render(g: &Gen, seed: &mut u64, out: &mut String) {
    match g {
        Gen::Null => out.push_str("null"),
        Gen::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Gen::Int(i) => match next(seed) % 4 {
            0 => out.push_str(&i.to_string()),
            1 => out.push_str(&format!("{i}.0")),
            2 => out.push_str(&format!("{i}e0")),
            _ => out.push_str(&format!("{i}.000E+0")),
        },
        Gen::Str(s) => render_string(s, next(seed), out),
        Gen::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(next(seed), out);
                render(item, seed, out);
                ws(next(seed), out);
            }
            out.push(']');
        }
        Gen::Obj(members) => {
            let mut members: Vec<_> = members.iter().collect();
            let n = members.len().max(1);
            members.rotate_left((next(seed) as usize) % n);
            if next(seed).is_multiple_of(2) {
                members.reverse();
            }
            out.push('{');
            for (i, (name, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(next(seed), out);
                render_string(name, next(seed), out);
                ws(next(seed), out);
                out.push(':');
                ws(next(seed), out);
                render(value, seed, out);
            }
            out.push('}');
        }
    }
}

fn render_string(s: &str, style: u64, out: &mut String) {
    out.push('"');
    for (i, c) in s.chars().enumerate() {
        let escape = (style >> (i % 64)) & 1 == 1;
        match c {
            '"' => out.push_str(if escape { "\\u0022" } else { "\\\"" }),
            '\\' => out.push_str(if escape { "\\u005C" } else { "\\\\" }),
            '/' if escape => out.push_str("\\/"),
            c if (c as u32) < 0x20 || escape => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn doc(fields: &BTreeMap<String, Gen>) -> Gen {
    Gen::Obj(fields.clone())
}

fn text(g: &Gen, seed: u64) -> String {
    let mut seed = seed | 1;
    let mut out = String::new();
    render(g, &mut seed, &mut out);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn reformatting_and_reordering_never_change_the_fingerprint(
        g in gen_value(),
        a in any::<u64>(),
        b in any::<u64>(),
    ) {
        let whole = BodySubset::new([JsonPointer::ROOT]);
        let x = text(&g, a);
        let y = text(&g, b);
        prop_assert_eq!(whole.canonical(x.as_bytes()).unwrap(), whole.canonical(y.as_bytes()).unwrap(), "{} vs {}", x, y);
        let s = scope();
        prop_assert_eq!(
            compute_subset(&input(&s, &x), &whole, None).unwrap(),
            compute_subset(&input(&s, &y), &whole, None).unwrap()
        );
    }

    #[test]
    fn changing_a_selected_value_always_changes_the_fingerprint(
        rest in proptest::collection::btree_map("[a-z]{1,3}", gen_value(), 0..4),
        before in gen_value(),
        after in gen_value(),
        seed in any::<u64>(),
    ) {
        prop_assume!(before != after);
        let subset = BodySubset::new([JsonPointer::parse("/selected").unwrap()]);
        let mut one = rest.clone();
        one.insert("selected".into(), before);
        let mut two = rest;
        two.insert("selected".into(), after);
        let s = scope();
        let (x, y) = (text(&doc(&one), seed), text(&doc(&two), seed));
        prop_assert_ne!(
            compute_subset(&input(&s, &x), &subset, None).unwrap(),
            compute_subset(&input(&s, &y), &subset, None).unwrap()
        );
        // Removing it is a change too.
        one.remove("selected");
        let z = text(&doc(&one), seed);
        prop_assert_ne!(
            compute_subset(&input(&s, &z), &subset, None).unwrap(),
            compute_subset(&input(&s, &y), &subset, None).unwrap()
        );
    }

    #[test]
    fn changing_an_unselected_value_never_changes_the_fingerprint(
        selected in gen_value(),
        before in gen_value(),
        after in gen_value(),
        a in any::<u64>(),
        b in any::<u64>(),
    ) {
        let subset = BodySubset::new([JsonPointer::parse("/amount").unwrap()]);
        let one = BTreeMap::from([("amount".to_owned(), selected.clone()), ("sent_at".to_owned(), before)]);
        let two = BTreeMap::from([("amount".to_owned(), selected), ("sent_at".to_owned(), after)]);
        let s = scope();
        let (x, y) = (text(&doc(&one), a), text(&doc(&two), b));
        prop_assert_eq!(
            compute_subset(&input(&s, &x), &subset, None).unwrap(),
            compute_subset(&input(&s, &y), &subset, None).unwrap()
        );
    }

    #[test]
    fn arbitrary_bodies_and_pointers_never_panic(
        body in proptest::collection::vec(any::<u8>(), 0..200),
        pointers in proptest::collection::vec("(/[a-z0-9~01]{0,3}){0,3}", 0..4),
    ) {
        let pointers: Vec<JsonPointer> = pointers.iter().filter_map(|p| JsonPointer::parse(p).ok()).collect();
        let s = scope();
        let mut req = input(&s, "");
        req.body = &body;
        let _ = compute_subset(&req, &BodySubset::new(pointers), None);
    }
}

#[cfg(feature = "serde")]
#[test]
fn the_file_form_is_a_list_of_pointers() {
    let subset: BodySubset =
        serde_json::from_str(r#"["/customer", "/amount", "/currency"]"#).unwrap();
    assert_eq!(
        subset.canonical(KEY_ORDER.as_bytes()),
        PAYMENT.canonical(KEY_ORDER.as_bytes())
    );
    let err = serde_json::from_str::<BodySubset>(r#"["amount"]"#).unwrap_err();
    assert!(err.to_string().contains("starts with `/`"), "{err}");
}
