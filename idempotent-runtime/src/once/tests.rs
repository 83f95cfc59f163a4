use super::*;
use crate::store::memory::MemoryStore;

#[test]
fn the_input_is_fingerprinted_canonically_and_apart_from_requests() {
    let a = fingerprint::<_, ()>("charge", &serde_json::json!({"b": 1, "a": [1.0, "x"]})).unwrap();
    let b = fingerprint::<_, ()>("charge", &serde_json::json!({"a": [1, "x"], "b": 1})).unwrap();
    assert_eq!(a, b, "member order and number form do not matter");
    assert_eq!(a.version, ONCE_VERSION);
    assert_ne!(a.version, crate::fingerprint::CURRENT_VERSION);
    assert_ne!(a.version, crate::fingerprint::SUBSET_VERSION);
    let other =
        fingerprint::<_, ()>("refund", &serde_json::json!({"b": 1, "a": [1, "x"]})).unwrap();
    assert_ne!(a, other, "the name is part of it");
}

#[test]
fn a_record_that_is_not_a_functions_output_is_refused() {
    let request = RecordedResponse::new(201, Vec::new(), Bytes::from_static(b"7"));
    assert!(matches!(
        decode::<u8, ()>(&request),
        Err(OnceError::Encoding(_))
    ));
    let headers = vec![(ENCODING_HEADER.to_owned(), Bytes::from_static(b"json/1"))];
    let output = RecordedResponse::new(200, headers, Bytes::from_static(b"7"));
    assert_eq!(decode::<u8, ()>(&output).unwrap(), 7);
}

#[tokio::test]
async fn a_requests_record_under_the_key_is_another_input() {
    use crate::scope::{ClientId, Identity};
    let handle = Idempotency::builder(MemoryStore::default())
        .sweeper(false)
        .build();
    let scope =
        Scope::from_identity(&Identity::client(ClientId::ApiKey("k".into())), None).unwrap();
    let claim = ClaimRequest {
        scope: scope.hash(),
        key: "shared",
        quota_bucket: scope.quota_bucket(),
        fingerprint: Fingerprint {
            version: 1,
            digest: [7; 32],
        },
        token: FencingToken::mint(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(60),
        route: "/orders",
        response_room: 0,
    };
    let store = handle.store();
    assert!(matches!(
        record::claim(store, &claim, |_| false).await,
        Ok(Verdict::Acquired { .. })
    ));
    let ran = Once::new(&handle, &scope, "shared")
        .run("x", || async { Ok::<_, ()>(1u8) })
        .await;
    assert!(matches!(ran, Err(OnceError::InputChanged)), "{ran:?}");
}
