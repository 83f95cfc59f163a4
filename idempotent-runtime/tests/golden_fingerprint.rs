//! The golden fingerprint vectors of `fingerprint.rs`, re-derived here by hand from the frame
//! table in the module docs and DESIGN.md §4 with `sha2` directly, so that the vectors are not
//! only what the code under test once produced: a change to the encoder that the table does not
//! describe fails here as well as there.
//!
//! | frame | bytes |
//! |---|---|
//! | absent | `0x00` |
//! | bytes | `0x01`, length as u64 big-endian, the bytes |
//! | list | `0x02`, count as u64 big-endian, each element framed |

use idempotent_runtime::fingerprint::FingerprintInput;
use idempotent_runtime::scope::{Identity, Scope};
use idempotent_runtime::test_helpers::fingerprint::compute;
use sha2::{Digest, Sha256};

const TAG: &[u8] = b"idempotent-fingerprint/v1\n";

fn absent(out: &mut Vec<u8>) {
    out.push(0x00);
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.push(0x01);
    out.extend_from_slice(&(b.len() as u64).to_be_bytes());
    out.extend_from_slice(b);
}

fn list(out: &mut Vec<u8>, count: u64) {
    out.push(0x02);
    out.extend_from_slice(&count.to_be_bytes());
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// `POST /shops/{shop}/orders` for shop 7, query `b=2&a=1`, tenant `acme`, subject `alice`,
/// JSON body.
#[test]
fn the_first_golden_vector_follows_the_frame_table() {
    let body = br#"{"sku":"A1","quantity":1}"#;
    let mut m = TAG.to_vec();
    bytes(&mut m, b"POST"); // 1 method
    bytes(&mut m, b"/shops/{shop}/orders"); // 2 route pattern
    list(&mut m, 1); // 3 path parameter values
    bytes(&mut m, b"7");
    list(&mut m, 2); // 4 query pairs, raw, sorted by name: a=1, b=2
    list(&mut m, 2);
    bytes(&mut m, b"a");
    bytes(&mut m, b"1");
    list(&mut m, 2);
    bytes(&mut m, b"b");
    bytes(&mut m, b"2");
    bytes(&mut m, b"acme"); // 5 tenant
    bytes(&mut m, b"alice"); // 6 subject
    absent(&mut m); // 7 client id: none, and a subject is known so no peer
    bytes(&mut m, b"application/json"); // 8 content type
    bytes(&mut m, &Sha256::digest(body)); // 9 SHA-256 of the body
    let by_hand = hex(&Sha256::digest(&m));
    assert_eq!(
        by_hand, "a0c65f2ea52cbd3ed6bb4a76565ffe710c112dc96f99f00e5692bcd5245bf80b",
        "the hand encoding disagrees with the golden vector"
    );

    let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap();
    let input = FingerprintInput {
        method: "POST",
        route: Some("/shops/{shop}/orders"),
        path_params: &["7"],
        query: Some("b=2&a=1"),
        scope: &scope,
        content_type: Some(b"application/json"),
        body,
    };
    assert_eq!(hex(&compute(&input, None).digest), by_hand);
}

/// An anonymous `POST` from 192.0.2.1 with no route, no query, no content type, empty body.
#[test]
fn the_second_golden_vector_follows_the_frame_table() {
    let mut m = TAG.to_vec();
    bytes(&mut m, b"POST"); // 1
    absent(&mut m); // 2 no route matched
    list(&mut m, 0); // 3 no path parameters
    absent(&mut m); // 4 no `?`
    absent(&mut m); // 5 no tenant
    absent(&mut m); // 6 no subject
    bytes(&mut m, b"peer:192.0.2.1"); // 7 neither subject nor client id: the peer
    absent(&mut m); // 8 no content type
    bytes(&mut m, &Sha256::digest(b"")); // 9 the empty body hashes as the empty string
    let by_hand = hex(&Sha256::digest(&m));
    assert_eq!(
        by_hand, "81b62ccd701e34b24d0673ad8f82792379ee3b68a0ea694dff1b974de58c03be",
        "the hand encoding disagrees with the golden vector"
    );

    let scope =
        Scope::from_identity(&Identity::default(), Some("192.0.2.1".parse().unwrap())).unwrap();
    let input = FingerprintInput {
        method: "POST",
        route: None,
        path_params: &[],
        query: None,
        scope: &scope,
        content_type: None,
        body: b"",
    };
    assert_eq!(hex(&compute(&input, None).digest), by_hand);
}
