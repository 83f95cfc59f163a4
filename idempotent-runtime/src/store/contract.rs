//! The contract every [`Store`] implementation must meet, written once and run against each
//! backend (feature `testing`).
//!
//! ```no_run
//! # async fn example() {
//! use std::sync::Arc;
//! use idempotent_runtime::clock::ManualClock;
//! use idempotent_runtime::store::{contract, memory::MemoryStore};
//!
//! let clock = ManualClock::new();
//! let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
//! contract::run(store, move |d| clock.advance(d)).await;
//! # }
//! ```
//!
//! `advance` must move the clock the store judges time by (for SQL stores, a test offset added
//! to the database's clock). Each case uses its own scope, so the suite can share a store with
//! other data, but it must run alone on that clock.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordState, RecordedResponse, StandingState,
    Store, header_bytes,
};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

// A user's own wrapper as a test double, public only through `test_helpers`.
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub(crate) mod forwarding;

const SECOND: Duration = Duration::from_secs(1);

/// Runs every case; panics with the case's name on the first broken promise.
pub async fn run<S: Store + ?Sized>(store: Arc<S>, advance: impl Fn(Duration) + Send + Sync) {
    run_shared_cases(Arc::clone(&store), &advance).await;
    sweeper_frees_expired_records_in_batches(&*store, &advance).await;
}

/// [`run`] for a store that expires records by itself (Redis's key TTLs) and whose
/// [`Store::sweep`] deletes nothing: instead of the batched sweep, it checks that a sweep deletes
/// nothing and that expired records are free to claim all the same.
pub async fn run_self_expiring<S: Store + ?Sized>(
    store: Arc<S>,
    advance: impl Fn(Duration) + Send + Sync,
) {
    run_shared_cases(Arc::clone(&store), &advance).await;
    expired_records_are_free_without_a_sweep(&*store, &advance).await;
}

async fn run_shared_cases<S: Store + ?Sized>(
    store: Arc<S>,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let s = &*store;
    first_claim_acquires_and_a_second_sees_it_running(s).await;
    completed_record_is_reported_with_its_response(s).await;
    a_record_without_body_keeps_its_headers_and_an_empty_body(s).await;
    trailers_replay_exactly_and_an_answer_without_them_replays_none(s).await;
    a_resent_completion_that_finds_its_own_record_succeeds(s).await;
    wrong_token_can_neither_complete_release_nor_renew(s).await;
    release_frees_the_key(s).await;
    concurrent_claims_acquire_exactly_once(Arc::clone(&store)).await;
    lapsed_lease_is_reclaimed_with_a_new_token_and_fences_the_old(s, advance).await;
    reclaim_with_a_stale_token_that_no_longer_holds_fails(s, advance).await;
    renewal_keeps_a_live_holder(s, advance).await;
    completed_record_expires_after_retention(s, advance).await;
    reservation_expires_lease_plus_retention_after_claim(s, advance).await;
    sweeper_never_frees_a_live_record(s, advance).await;
    inspect_reports_state_times_and_sizes_and_the_body_only_when_asked(s, advance).await;
    forget_deletes_any_record_and_fences_its_holder(s).await;
}

/// A fresh scope per case, so cases never see each other's records.
pub(crate) fn fresh_scope() -> ScopeHash {
    let mut scope = [0u8; 32];
    for chunk in scope.chunks_mut(8) {
        chunk.copy_from_slice(&FencingToken::mint().0.to_be_bytes());
    }
    scope
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint {
        version: 1,
        digest: [n; 32],
    }
}

fn req<'a>(
    scope: &'a ScopeHash,
    key: &'a str,
    fingerprint: u8,
    lease: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        quota_bucket: u64::from_be_bytes(scope[..8].try_into().expect("8 bytes")),
        fingerprint: fp(fingerprint),
        token: FencingToken::mint(),
        lease,
        retention: 10 * SECOND,
        route: "/test",
        response_room: 1 << 10,
    }
}

fn response(body: &'static str) -> RecordedResponse {
    RecordedResponse::new(
        201,
        vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("location".into(), Bytes::from_static(b"/orders/1")),
        ],
        Bytes::from_static(body.as_bytes()),
    )
}

async fn claim<S: Store + ?Sized>(s: &S, r: &ClaimRequest<'_>) -> Claim {
    s.claim(r).await.expect("claim")
}

async fn first_claim_acquires_and_a_second_sees_it_running<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(
        claim(s, &first).await,
        Claim::Acquired,
        "first claim acquires"
    );
    let second = req(&scope, "k", 1, 30 * SECOND);
    match claim(s, &second).await {
        Claim::Standing(st) => {
            assert_eq!(
                st.token, first.token,
                "standing record carries the holder's token"
            );
            assert_eq!(st.fingerprint, fp(1));
            match st.state {
                StandingState::Running { lease_left } => {
                    assert!(
                        lease_left <= 30 * SECOND && lease_left > 25 * SECOND,
                        "{lease_left:?}"
                    );
                }
                other => panic!("expected running, got {other:?}"),
            }
        }
        Claim::Acquired => panic!("a second claim on a held key acquired it"),
    }
    let other_scope = fresh_scope();
    assert_eq!(
        claim(s, &req(&other_scope, "k", 1, 30 * SECOND)).await,
        Claim::Acquired,
        "the same key in another scope is another record"
    );
}

/// A completion sent again (its first answer was lost with the connection) finds the record it
/// wrote: that is success, not a lost lease. Another token still cannot complete it.
async fn a_resent_completion_that_finds_its_own_record_succeeds<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    let resp = response(r#"{"id":7}"#);
    for attempt in 0..2 {
        let done = s
            .complete(&scope, "k", first.token, &resp, 10 * SECOND)
            .await;
        assert!(done.unwrap(), "completion {attempt} refused");
    }
    let other = FencingToken::mint();
    let stolen = s
        .complete(&scope, "k", other, &response("{}"), 10 * SECOND)
        .await;
    assert!(!stolen.unwrap(), "another token completed the record");
    match claim(s, &req(&scope, "k", 1, 30 * SECOND)).await {
        Claim::Standing(st) => assert_eq!(st.state, StandingState::Completed(Arc::new(resp))),
        Claim::Acquired => panic!("a completed key was acquired again"),
    }
}

async fn completed_record_is_reported_with_its_response<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    let resp = response(r#"{"id":1}"#);
    assert!(
        s.complete(&scope, "k", first.token, &resp, 10 * SECOND)
            .await
            .unwrap()
    );
    // The first replay and the one after it (a cache answers that one from its copy).
    for fingerprint in [2, 1] {
        match claim(s, &req(&scope, "k", fingerprint, 30 * SECOND)).await {
            Claim::Standing(st) => {
                assert_eq!(
                    st.fingerprint,
                    fp(1),
                    "the stored fingerprint is the claimer's"
                );
                assert_eq!(st.state, StandingState::Completed(Arc::new(resp.clone())));
                // Optional, but never past the record's expiry: a cache keeps a copy that long.
                if let Some(left) = st.expires_in {
                    assert!(left <= 10 * SECOND, "{left:?} left of a 10 s retention");
                }
            }
            Claim::Acquired => panic!("a completed key was acquired again"),
        }
    }
    assert!(
        !s.renew(&scope, "k", first.token, 30 * SECOND)
            .await
            .unwrap(),
        "a completed record cannot be renewed"
    );
    assert!(
        !s.release(&scope, "k", first.token).await.unwrap(),
        "a completed record cannot be released"
    );
    assert!(
        !s.complete(&scope, "k", first.token, &response("again"), SECOND)
            .await
            .unwrap(),
        "a completed record cannot be completed twice"
    );
}

/// A record kept without its body (`oversized = "record_without_body"`) is its status, its
/// headers (the runtime's `idempotency-replay: body-omitted` among them) and an empty body, and
/// comes back exactly so: the replay's marker is a header like any other.
async fn a_record_without_body_keeps_its_headers_and_an_empty_body<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k-bodiless", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    let recorded = crate::record::without_body(201, response("").headers);
    assert!(
        s.complete(&scope, "k-bodiless", first.token, &recorded, 10 * SECOND)
            .await
            .unwrap()
    );
    match claim(s, &req(&scope, "k-bodiless", 1, 30 * SECOND)).await {
        Claim::Standing(st) => {
            assert_eq!(st.state, StandingState::Completed(Arc::new(recorded)));
        }
        Claim::Acquired => panic!("a completed key was acquired again"),
    }
}

/// An answer's trailers (HTTP trailers, gRPC's status) come back exactly: every name and value
/// in the order sent, repeated names, empty and non-UTF-8 values included; an answer without
/// trailers comes back with none. A resent completion with the same trailers succeeds, and one
/// whose trailers differ is another answer, refused like any other.
async fn trailers_replay_exactly_and_an_answer_without_them_replays_none<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let with = response(r#"{"id":3}"#).with_trailers(vec![
        ("grpc-status".into(), Bytes::from_static(b"0")),
        ("x-checksum".into(), Bytes::from_static(b"\x00\xffsha")),
        ("grpc-message".into(), Bytes::new()),
        ("x-checksum".into(), Bytes::from_static(b"second")),
    ]);
    let without = response(r#"{"id":4}"#);
    for (key, recorded) in [("k-trailers", &with), ("k-no-trailers", &without)] {
        let first = req(&scope, key, 1, 30 * SECOND);
        assert_eq!(claim(s, &first).await, Claim::Acquired);
        for attempt in 0..2 {
            let done = s
                .complete(&scope, key, first.token, recorded, 10 * SECOND)
                .await;
            assert!(done.unwrap(), "{key}: completion {attempt} refused");
        }
        let mut other = recorded.clone();
        other.trailers = vec![("grpc-status".into(), Bytes::from_static(b"13"))];
        assert!(
            !s.complete(&scope, key, first.token, &other, 10 * SECOND)
                .await
                .unwrap(),
            "{key}: a completion with other trailers found the record its own"
        );
        match claim(s, &req(&scope, key, 1, 30 * SECOND)).await {
            Claim::Standing(st) => match &st.state {
                StandingState::Completed(replayed) => {
                    assert_eq!(replayed.trailers, recorded.trailers, "{key}: trailers");
                    assert_eq!(**replayed, *recorded, "{key}: the whole answer");
                }
                other => panic!("{key}: a completed record stands as {other:?}"),
            },
            Claim::Acquired => panic!("{key}: a completed key was acquired again"),
        }
        let info = inspect(s, &scope, key, true).await.expect("a record");
        assert_eq!(
            info.response.as_deref(),
            Some(recorded),
            "{key}: inspect's response"
        );
    }
}

async fn wrong_token_can_neither_complete_release_nor_renew<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    let wrong = FencingToken::mint();
    assert!(
        !s.complete(&scope, "k", wrong, &response("x"), SECOND)
            .await
            .unwrap()
    );
    assert!(!s.release(&scope, "k", wrong).await.unwrap());
    assert!(!s.renew(&scope, "k", wrong, SECOND).await.unwrap());
    assert!(
        matches!(claim(s, &req(&scope, "k", 1, SECOND)).await, Claim::Standing(st) if st.token == first.token),
        "the holder is untouched"
    );
    assert!(!s.release(&scope, "missing", wrong).await.unwrap());
    assert!(
        !s.complete(&scope, "missing", wrong, &response("x"), SECOND)
            .await
            .unwrap()
    );
}

async fn release_frees_the_key<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    assert!(s.release(&scope, "k", first.token).await.unwrap());
    assert_eq!(
        claim(s, &req(&scope, "k", 2, 30 * SECOND)).await,
        Claim::Acquired,
        "a released key runs again, with any request"
    );
}

async fn concurrent_claims_acquire_exactly_once<S: Store + ?Sized>(store: Arc<S>) {
    let scope = fresh_scope();
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let store = Arc::clone(&store);
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                let r = req(&scope, "contended", 1, 30 * SECOND);
                (r.token, store.claim(&r).await.expect("claim"))
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("claim task"));
    }
    let winners: Vec<_> = results
        .iter()
        .filter(|(_, c)| *c == Claim::Acquired)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(
        winners.len(),
        1,
        "exactly one of 64 concurrent claims acquires"
    );
    for (_, c) in &results {
        if let Claim::Standing(st) = c {
            assert_eq!(st.token, winners[0], "losers see the winner's record");
        }
    }
}

async fn lapsed_lease_is_reclaimed_with_a_new_token_and_fences_the_old<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let old = req(&scope, "k", 1, SECOND);
    assert_eq!(claim(s, &old).await, Claim::Acquired);
    advance(2 * SECOND);
    let retry = req(&scope, "k", 1, 30 * SECOND);
    let standing = match claim(s, &retry).await {
        Claim::Standing(st) => st,
        Claim::Acquired => panic!("an abandoned record must be reported, then reclaimed"),
    };
    assert_eq!(standing.state, StandingState::Abandoned);
    assert_eq!(
        s.reclaim(&retry, standing.token).await.unwrap(),
        Claim::Acquired
    );
    assert_ne!(retry.token, old.token);
    assert!(
        !s.complete(&scope, "k", old.token, &response("old"), SECOND)
            .await
            .unwrap(),
        "old token completes"
    );
    assert!(
        !s.release(&scope, "k", old.token).await.unwrap(),
        "old token releases"
    );
    assert!(
        !s.renew(&scope, "k", old.token, SECOND).await.unwrap(),
        "old token renews"
    );
    assert!(
        s.complete(&scope, "k", retry.token, &response("new"), 10 * SECOND)
            .await
            .unwrap()
    );
    match claim(s, &req(&scope, "k", 1, SECOND)).await {
        Claim::Standing(st) => {
            assert_eq!(
                st.state,
                StandingState::Completed(Arc::new(response("new")))
            );
        }
        Claim::Acquired => panic!("completed record lost"),
    }
}

async fn reclaim_with_a_stale_token_that_no_longer_holds_fails<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    advance(2 * SECOND);
    let a = req(&scope, "k", 1, 30 * SECOND);
    let b = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(s.reclaim(&a, first.token).await.unwrap(), Claim::Acquired);
    match s.reclaim(&b, first.token).await.unwrap() {
        Claim::Standing(st) => {
            assert_eq!(
                st.token, a.token,
                "the second takeover sees the first one's record"
            );
            assert!(matches!(st.state, StandingState::Running { .. }));
        }
        Claim::Acquired => panic!("two takeovers of one abandoned record both acquired"),
    }
    // A live record is not takeable even with its own token.
    match s.reclaim(&b, a.token).await.unwrap() {
        Claim::Standing(st) => assert_eq!(st.token, a.token),
        Claim::Acquired => panic!("a live reservation was taken over"),
    }
}

async fn renewal_keeps_a_live_holder<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let holder = req(&scope, "k", 1, 3 * SECOND);
    assert_eq!(claim(s, &holder).await, Claim::Acquired);
    for _ in 0..3 {
        advance(2 * SECOND);
        assert!(
            s.renew(&scope, "k", holder.token, 3 * SECOND)
                .await
                .unwrap(),
            "renew"
        );
    }
    advance(2 * SECOND);
    match claim(s, &req(&scope, "k", 1, SECOND)).await {
        Claim::Standing(st) => assert!(
            matches!(st.state, StandingState::Running { .. }),
            "a renewed lease is still running after 8 s of a 3 s lease: {:?}",
            st.state
        ),
        Claim::Acquired => panic!("renewed reservation was lost"),
    }
}

async fn completed_record_expires_after_retention<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    assert!(
        s.complete(&scope, "k", first.token, &response("x"), 5 * SECOND)
            .await
            .unwrap()
    );
    // A replay at once: a cache keeps its copy from here, and must not outlive the record.
    assert!(matches!(
        claim(s, &req(&scope, "k", 1, SECOND)).await,
        Claim::Standing(st) if matches!(st.state, StandingState::Completed(_))
    ));
    advance(4 * SECOND);
    assert!(
        matches!(
            claim(s, &req(&scope, "k", 1, SECOND)).await,
            Claim::Standing(st) if matches!(st.state, StandingState::Completed(_))
        ),
        "within retention the record replays"
    );
    advance(2 * SECOND);
    // Expiry is enforced when claiming, sweeper or not: the key runs again, any request.
    let again = req(&scope, "k", 2, SECOND);
    match claim(s, &again).await {
        Claim::Acquired => {}
        Claim::Standing(st) => {
            assert_eq!(st.state, StandingState::Expired);
            assert_eq!(s.reclaim(&again, st.token).await.unwrap(), Claim::Acquired);
        }
    }
}

async fn reservation_expires_lease_plus_retention_after_claim<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let mut first = req(&scope, "k", 1, 2 * SECOND);
    first.retention = 3 * SECOND;
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    advance(4 * SECOND);
    match claim(s, &req(&scope, "k", 2, SECOND)).await {
        Claim::Standing(st) => {
            assert_eq!(st.state, StandingState::Abandoned, "lapsed, not expired")
        }
        Claim::Acquired => panic!("a reservation expired before lease + retention"),
    }
    advance(2 * SECOND);
    let again = req(&scope, "k", 2, SECOND);
    match claim(s, &again).await {
        Claim::Acquired => {}
        Claim::Standing(st) => {
            assert_eq!(st.state, StandingState::Expired);
            assert_eq!(s.reclaim(&again, st.token).await.unwrap(), Claim::Acquired);
        }
    }
}

async fn sweeper_never_frees_a_live_record<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let mut running = req(&scope, "running", 1, 20 * SECOND);
    running.retention = SECOND;
    assert_eq!(claim(s, &running).await, Claim::Acquired);
    let done = req(&scope, "done", 1, 20 * SECOND);
    assert_eq!(claim(s, &done).await, Claim::Acquired);
    assert!(
        s.complete(&scope, "done", done.token, &response("d"), 20 * SECOND)
            .await
            .unwrap()
    );
    advance(10 * SECOND);
    while s.sweep(500).await.unwrap() >= 500 {}
    assert!(
        s.renew(&scope, "running", running.token, 20 * SECOND)
            .await
            .unwrap(),
        "the sweeper freed a reservation inside its lease"
    );
    assert!(
        matches!(
            claim(s, &req(&scope, "done", 1, SECOND)).await,
            Claim::Standing(st) if matches!(st.state, StandingState::Completed(_))
        ),
        "the sweeper freed a completed record inside its retention"
    );
}

async fn sweeper_frees_expired_records_in_batches<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    // Whatever earlier cases left behind expires too; sweep it first so counts are ours.
    advance(3600 * SECOND);
    while s.sweep(500).await.unwrap() > 0 {}
    let scope = fresh_scope();
    let keys: Vec<String> = (0..1_100).map(|i| format!("k{i}")).collect();
    for key in &keys {
        let mut r = req(&scope, key, 1, SECOND);
        r.retention = SECOND;
        assert_eq!(claim(s, &r).await, Claim::Acquired);
    }
    let live = req(&scope, "live", 1, 3600 * SECOND);
    assert_eq!(claim(s, &live).await, Claim::Acquired);
    advance(3 * SECOND);
    let mut swept = Vec::new();
    loop {
        let n = s.sweep(500).await.unwrap();
        assert!(n <= 500, "a sweep deleted more than its batch: {n}");
        swept.push(n);
        if n < 500 {
            break;
        }
    }
    assert_eq!(swept.iter().sum::<usize>(), 1_100, "batches: {swept:?}");
    assert!(
        s.renew(&scope, "live", live.token, SECOND).await.unwrap(),
        "live record survived"
    );
    // Swept keys are free.
    assert_eq!(
        claim(s, &req(&scope, "k7", 2, SECOND)).await,
        Claim::Acquired
    );
}

async fn expired_records_are_free_without_a_sweep<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    let keys: Vec<String> = (0..50).map(|i| format!("k{i}")).collect();
    for key in &keys {
        let mut r = req(&scope, key, 1, SECOND);
        r.retention = SECOND;
        assert_eq!(claim(s, &r).await, Claim::Acquired);
    }
    let done = req(&scope, "done", 1, SECOND);
    assert_eq!(claim(s, &done).await, Claim::Acquired);
    assert!(
        s.complete(&scope, "done", done.token, &response("d"), SECOND)
            .await
            .unwrap()
    );
    let live = req(&scope, "live", 1, 3600 * SECOND);
    assert_eq!(claim(s, &live).await, Claim::Acquired);
    advance(3 * SECOND);
    assert_eq!(
        s.sweep(500).await.unwrap(),
        0,
        "a self-expiring store sweeps nothing"
    );
    for key in keys.iter().map(String::as_str).chain(["done"]) {
        let again = req(&scope, key, 2, SECOND);
        match claim(s, &again).await {
            Claim::Acquired => {}
            Claim::Standing(st) => {
                assert_eq!(st.state, StandingState::Expired, "{key}");
                assert_eq!(s.reclaim(&again, st.token).await.unwrap(), Claim::Acquired);
            }
        }
    }
    assert!(
        s.renew(&scope, "live", live.token, SECOND).await.unwrap(),
        "a live record survived"
    );
}

/// Model-based checking: random sequences of operations run against a store and against a
/// simple reference model, comparing every answer. Generate [`Op`](model::Op) sequences with any
/// property-testing tool and call [`check_model`](model::check_model) for each.
pub mod model {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;

    use super::{fp, fresh_scope};
    use crate::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store};

    /// Keys a sequence works on.
    pub(crate) const KEYS: u8 = 3;

    /// One operation. Durations are whole seconds so that a store judging time by the database
    /// clock (which moves a little on its own while the test runs) never lands on a boundary.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Op {
        /// Claim `key % KEYS` with fingerprint `fp % 2` and a lease of `lease_s` (1–4) seconds;
        /// an abandoned or expired record found is taken over, as the engine does.
        Claim {
            /// Key index.
            key: u8,
            /// Fingerprint index.
            fp: u8,
            /// Lease in seconds.
            lease_s: u8,
        },
        /// Complete with the current holder's token (`stale == false`) or an older one.
        Complete {
            /// Key index.
            key: u8,
            /// Use a stale token.
            stale: bool,
            /// Retention in seconds (1–4).
            retention_s: u8,
        },
        /// Release with the current or a stale token.
        Release {
            /// Key index.
            key: u8,
            /// Use a stale token.
            stale: bool,
        },
        /// Renew with the current or a stale token for `lease_s` seconds.
        Renew {
            /// Key index.
            key: u8,
            /// Use a stale token.
            stale: bool,
            /// Lease in seconds.
            lease_s: u8,
        },
        /// Move the clock forward by whole seconds (0–3).
        Advance {
            /// Seconds.
            secs: u8,
        },
        /// Run one sweep.
        Sweep,
        /// Claim `key % KEYS` from `copies` (2–8) requests at once, as concurrent retries do,
        /// each taking over what the engine would: exactly one acquires (or takes over) when the
        /// model says the key is free, and every other copy sees a running record (the winner's,
        /// or the store's "in progress, holder unknown" answer with token 0).
        ClaimConcurrently {
            /// Key index.
            key: u8,
            /// Fingerprint index.
            fp: u8,
            /// Lease in seconds.
            lease_s: u8,
            /// How many copies (clamped to 2–8).
            copies: u8,
        },
    }

    #[derive(Debug, Clone)]
    struct Rec {
        token: FencingToken,
        fp: u8,
        lease_until: u64,
        completed: Option<u8>,
        expires_at: u64,
        retention: u64,
    }

    /// The reference: a map and a clock in whole seconds.
    #[derive(Debug, Default)]
    struct Model {
        now: u64,
        records: HashMap<u8, Rec>,
        stale: HashMap<u8, FencingToken>,
    }

    impl Model {
        fn live(&self, key: u8) -> Option<&Rec> {
            self.records.get(&key).filter(|r| self.now < r.expires_at)
        }

        /// What a token-conditional write (complete, release, renew) by `token` must answer:
        /// `Some(true)` when `token` holds a live reservation, `Some(false)` when it holds
        /// nothing, and `None` when its reservation is past expiry: gone either way for the
        /// next claim, so a store may accept or refuse the write.
        fn holds(&self, key: u8, token: FencingToken) -> Option<bool> {
            match self.records.get(&key) {
                Some(r) if r.token == token && r.completed.is_none() => {
                    (self.now < r.expires_at).then_some(true)
                }
                _ => Some(false),
            }
        }
    }

    const RETENTION_S: u64 = 2;

    /// An answer told apart by `id`; odd ones carry trailers, so replays of both kinds are
    /// checked against the model.
    fn response(id: u8) -> RecordedResponse {
        let trailers = if id % 2 == 1 {
            vec![("grpc-status".into(), Bytes::from(vec![b'0' + id % 10]))]
        } else {
            Vec::new()
        };
        RecordedResponse::new(
            200,
            vec![("etag".into(), Bytes::from(vec![id]))],
            Bytes::from(vec![id; 3]),
        )
        .with_trailers(trailers)
    }

    /// Runs `ops` against `store` and the model; panics at the first disagreement.
    pub async fn check_model<S: Store + ?Sized>(
        store: Arc<S>,
        advance: impl Fn(Duration),
        ops: &[Op],
    ) {
        let scope = fresh_scope();
        let keys: Vec<String> = (0..KEYS).map(|k| format!("model-{k}")).collect();
        let mut m = Model::default();
        let mut completions = 0u8;
        for (step, op) in ops.iter().enumerate() {
            let ctx = format!("step {step}: {op:?}");
            match *op {
                Op::Claim {
                    key,
                    fp: f,
                    lease_s,
                } => {
                    let k = key % KEYS;
                    let f = f % 2;
                    let lease = u64::from(lease_s.clamp(1, 4));
                    let req = ClaimRequest {
                        scope: &scope,
                        key: &keys[k as usize],
                        quota_bucket: 0,
                        fingerprint: fp(f),
                        token: FencingToken::mint(),
                        lease: Duration::from_secs(lease),
                        retention: Duration::from_secs(RETENTION_S),
                        route: "/test",
                        response_room: 1 << 10,
                    };
                    let mut got = store.claim(&req).await.expect("claim");
                    // Take over what the engine would: expired, or abandoned by the same request.
                    if let Claim::Standing(st) = &got {
                        let takeover = st.state == StandingState::Expired
                            || (st.state == StandingState::Abandoned && st.fingerprint == fp(f));
                        if takeover {
                            got = store.reclaim(&req, st.token).await.expect("reclaim");
                        }
                    }
                    let expected = match m.live(k) {
                        None => None,
                        Some(r) if r.completed.is_none() && m.now >= r.lease_until && r.fp == f => {
                            None
                        }
                        Some(r) => Some(r.clone()),
                    };
                    match (expected, got) {
                        (None, Claim::Acquired) => {
                            if let Some(old) = m.records.get(&k) {
                                m.stale.insert(k, old.token);
                            }
                            m.records.insert(
                                k,
                                Rec {
                                    token: req.token,
                                    fp: f,
                                    lease_until: m.now + lease,
                                    completed: None,
                                    expires_at: m.now + lease + RETENTION_S,
                                    retention: RETENTION_S,
                                },
                            );
                        }
                        (Some(r), Claim::Standing(st)) => {
                            assert_eq!(st.token, r.token, "{ctx}");
                            assert_eq!(st.fingerprint, fp(r.fp), "{ctx}");
                            match (r.completed, st.state) {
                                (Some(id), StandingState::Completed(resp)) => {
                                    assert_eq!(*resp, response(id), "{ctx}")
                                }
                                (None, StandingState::Running { .. }) => {
                                    assert!(m.now < r.lease_until, "{ctx}")
                                }
                                (None, StandingState::Abandoned) => {
                                    assert!(m.now >= r.lease_until, "{ctx}")
                                }
                                (c, s) => panic!("{ctx}: model {c:?}, store {s:?}"),
                            }
                        }
                        (e, g) => panic!("{ctx}: model expected {e:?}, store answered {g:?}"),
                    }
                }
                Op::Complete {
                    key,
                    stale,
                    retention_s,
                } => {
                    let k = key % KEYS;
                    let retention = u64::from(retention_s.clamp(1, 4));
                    let token = pick(&m, k, stale);
                    completions = completions.wrapping_add(1);
                    let ok = store
                        .complete(
                            &scope,
                            &keys[k as usize],
                            token,
                            &response(completions),
                            Duration::from_secs(retention),
                        )
                        .await
                        .expect("complete");
                    if let Some(expect) = m.holds(k, token) {
                        assert_eq!(ok, expect, "{ctx}");
                    }
                    if ok {
                        let now = m.now;
                        let r = m.records.get_mut(&k).expect("completed a record");
                        r.completed = Some(completions);
                        r.expires_at = now + retention;
                    }
                }
                Op::Release { key, stale } => {
                    let k = key % KEYS;
                    let token = pick(&m, k, stale);
                    let ok = store
                        .release(&scope, &keys[k as usize], token)
                        .await
                        .expect("release");
                    if let Some(expect) = m.holds(k, token) {
                        assert_eq!(ok, expect, "{ctx}");
                    }
                    if ok {
                        let old = m.records.remove(&k).expect("released a record");
                        m.stale.insert(k, old.token);
                    }
                }
                Op::Renew {
                    key,
                    stale,
                    lease_s,
                } => {
                    let k = key % KEYS;
                    let lease = u64::from(lease_s.clamp(1, 4));
                    let token = pick(&m, k, stale);
                    let ok = store
                        .renew(&scope, &keys[k as usize], token, Duration::from_secs(lease))
                        .await
                        .expect("renew");
                    if let Some(expect) = m.holds(k, token) {
                        assert_eq!(ok, expect, "{ctx}");
                    }
                    if ok {
                        let now = m.now;
                        let r = m.records.get_mut(&k).expect("renewed a record");
                        r.lease_until = now + lease;
                        r.expires_at = r.lease_until + r.retention;
                    }
                }
                Op::ClaimConcurrently {
                    key,
                    fp: f,
                    lease_s,
                    copies,
                } => {
                    let k = key % KEYS;
                    let f = f % 2;
                    let lease = u64::from(lease_s.clamp(1, 4));
                    let reqs: Vec<ClaimRequest<'_>> = (0..copies.clamp(2, 8))
                        .map(|_| ClaimRequest {
                            scope: &scope,
                            key: &keys[k as usize],
                            quota_bucket: 0,
                            fingerprint: fp(f),
                            token: FencingToken::mint(),
                            lease: Duration::from_secs(lease),
                            retention: Duration::from_secs(RETENTION_S),
                            route: "/test",
                            response_room: 1 << 10,
                        })
                        .collect();
                    let store = &store;
                    let got = futures_util::future::join_all(reqs.iter().map(|req| async move {
                        let mut got = store.claim(req).await.expect("claim");
                        if let Claim::Standing(st) = &got {
                            let takeover = st.state == StandingState::Expired
                                || (st.state == StandingState::Abandoned
                                    && st.fingerprint == fp(f));
                            if takeover {
                                got = store.reclaim(req, st.token).await.expect("reclaim");
                            }
                        }
                        got
                    }))
                    .await;
                    let expected = match m.live(k) {
                        None => None,
                        Some(r) if r.completed.is_none() && m.now >= r.lease_until && r.fp == f => {
                            None
                        }
                        Some(r) => Some(r.clone()),
                    };
                    match expected {
                        None => {
                            let winners: Vec<_> = got
                                .iter()
                                .zip(&reqs)
                                .filter(|(g, _)| **g == Claim::Acquired)
                                .map(|(_, r)| r.token)
                                .collect();
                            assert_eq!(winners.len(), 1, "{ctx}: winners {winners:?}");
                            let winner = winners[0];
                            for g in &got {
                                if let Claim::Standing(st) = g {
                                    assert!(
                                        st.token == winner || st.token == FencingToken(0),
                                        "{ctx}: a loser saw {st:?}, not the winner's record"
                                    );
                                    assert_eq!(st.fingerprint, fp(f), "{ctx}");
                                    assert!(
                                        matches!(st.state, StandingState::Running { .. }),
                                        "{ctx}: a loser saw {st:?}"
                                    );
                                }
                            }
                            if let Some(old) = m.records.get(&k) {
                                m.stale.insert(k, old.token);
                            }
                            m.records.insert(
                                k,
                                Rec {
                                    token: winner,
                                    fp: f,
                                    lease_until: m.now + lease,
                                    completed: None,
                                    expires_at: m.now + lease + RETENTION_S,
                                    retention: RETENTION_S,
                                },
                            );
                        }
                        Some(r) => {
                            for g in got {
                                let Claim::Standing(st) = g else {
                                    panic!("{ctx}: acquired a key the model holds: {r:?}");
                                };
                                assert_eq!(st.token, r.token, "{ctx}");
                                assert_eq!(st.fingerprint, fp(r.fp), "{ctx}");
                                match (r.completed, st.state) {
                                    (Some(id), StandingState::Completed(resp)) => {
                                        assert_eq!(*resp, response(id), "{ctx}")
                                    }
                                    (None, StandingState::Running { .. }) => {
                                        assert!(m.now < r.lease_until, "{ctx}")
                                    }
                                    (None, StandingState::Abandoned) => {
                                        assert!(m.now >= r.lease_until, "{ctx}")
                                    }
                                    (c, s) => panic!("{ctx}: model {c:?}, store {s:?}"),
                                }
                            }
                        }
                    }
                }
                Op::Advance { secs } => {
                    let secs = u64::from(secs % 4);
                    advance(Duration::from_secs(secs));
                    m.now += secs;
                }
                Op::Sweep => {
                    let swept = store.sweep(500).await.expect("sweep");
                    let now = m.now;
                    // The sequence's scope is the only one with records in the store (the
                    // harness sweeps everything before each sequence), so the sweep deletes
                    // exactly the model's expired records: no fewer (a sweep that frees
                    // nothing), and no more (a live record freed, caught by later claims too).
                    let expired = m.records.values().filter(|r| now >= r.expires_at).count();
                    // A store whose records expire by themselves has nothing left to sweep.
                    let expected = if store.expires_by_itself() {
                        0
                    } else {
                        expired
                    };
                    assert_eq!(swept, expected, "{ctx}: the sweep's count");
                    m.records.retain(|_, r| now < r.expires_at);
                }
            }
        }
    }

    fn pick(m: &Model, key: u8, stale: bool) -> FencingToken {
        let current = m.records.get(&key).map(|r| r.token);
        match (stale, current) {
            (false, Some(t)) => t,
            _ => m
                .stale
                .get(&key)
                .copied()
                .unwrap_or(FencingToken(0xdead_beef)),
        }
    }
}

async fn inspect<S: Store + ?Sized>(
    s: &S,
    scope: &ScopeHash,
    key: &str,
    body: bool,
) -> Option<RecordInfo> {
    s.inspect(scope, key, body).await.expect("inspect")
}

/// `b - a`, which must not be negative.
fn between(a: std::time::SystemTime, b: std::time::SystemTime) -> Duration {
    b.duration_since(a).expect("times out of order")
}

fn near(d: Duration, want: Duration, what: &str) {
    let slack = Duration::from_millis(1500);
    assert!(
        d + slack >= want && d <= want + slack,
        "{what}: {d:?}, want about {want:?}"
    );
}

async fn inspect_reports_state_times_and_sizes_and_the_body_only_when_asked<S: Store + ?Sized>(
    s: &S,
    advance: &(impl Fn(Duration) + Send + Sync),
) {
    let scope = fresh_scope();
    assert_eq!(
        inspect(s, &scope, "k", true).await,
        None,
        "no record, nothing to inspect"
    );
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);

    let running = inspect(s, &scope, "k", true)
        .await
        .expect("a reservation is inspected");
    assert_eq!(running.state, RecordState::Running);
    assert_eq!(
        running.route.as_deref(),
        Some("/test"),
        "the claim's route is kept"
    );
    assert_eq!((running.status, running.response.as_ref()), (None, None));
    assert_eq!((running.body_bytes, running.header_bytes), (0, 0));
    assert_eq!(running.completed_at, None);
    let created = running
        .created_at
        .expect("a new record knows when it was claimed");
    let lease_until = running.lease_until.expect("a reservation has a lease");
    near(between(created, lease_until), 30 * SECOND, "lease");
    near(
        between(created, running.expires_at),
        40 * SECOND,
        "reservation expiry",
    );
    assert!(
        s.claim(&req(&scope, "k", 1, 30 * SECOND)).await.is_ok(),
        "inspecting changed nothing"
    );
    assert_eq!(
        inspect(s, &scope, "k", false)
            .await
            .expect("still there")
            .state,
        RecordState::Running
    );

    advance(31 * SECOND);
    assert_eq!(
        inspect(s, &scope, "k", false)
            .await
            .expect("still there")
            .state,
        RecordState::Abandoned,
        "a lapsed lease reads as abandoned"
    );

    let scope = fresh_scope();
    let first = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &first).await, Claim::Acquired);
    let resp = response(r#"{"id":1}"#);
    assert!(
        s.complete(&scope, "k", first.token, &resp, 10 * SECOND)
            .await
            .unwrap()
    );
    let done = inspect(s, &scope, "k", false)
        .await
        .expect("a completed record is inspected");
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(done.status, Some(201));
    assert_eq!(done.route.as_deref(), Some("/test"));
    assert_eq!(done.body_bytes, resp.body.len());
    assert_eq!(done.header_bytes, header_bytes(&resp.headers));
    assert_eq!(done.response, None, "the body is read only when asked for");
    assert_eq!(done.lease_until, None);
    let completed = done.completed_at.expect("a completed record knows when");
    assert!(
        completed >= done.created_at.expect("created"),
        "completed before it was claimed"
    );
    near(
        between(completed, done.expires_at),
        10 * SECOND,
        "retention",
    );
    let with_body = inspect(s, &scope, "k", true).await.expect("still there");
    assert_eq!(
        with_body.response,
        Some(Arc::new(resp)),
        "asked for, the response is whole"
    );
    assert_eq!(
        RecordInfo {
            response: None,
            ..with_body
        },
        done
    );

    advance(11 * SECOND);
    assert_eq!(
        inspect(s, &scope, "k", false).await.map(|i| i.state),
        Some(RecordState::Expired),
        "an expired record not yet swept reads as expired"
    );
    let other = fresh_scope();
    assert_eq!(
        inspect(s, &other, "k", true).await,
        None,
        "another scope sees nothing"
    );
}

async fn forget_deletes_any_record_and_fences_its_holder<S: Store + ?Sized>(s: &S) {
    let scope = fresh_scope();
    assert!(!s.forget(&scope, "k").await.unwrap(), "nothing to forget");

    let running = req(&scope, "k", 1, 30 * SECOND);
    assert_eq!(claim(s, &running).await, Claim::Acquired);
    let other = fresh_scope();
    assert!(
        !s.forget(&other, "k").await.unwrap(),
        "another scope forgets nothing"
    );
    assert!(
        inspect(s, &scope, "k", false).await.is_some(),
        "another scope's forget left it"
    );
    assert!(
        s.forget(&scope, "k").await.unwrap(),
        "a running reservation is forgotten"
    );
    assert_eq!(inspect(s, &scope, "k", false).await, None);
    assert!(
        !s.complete(&scope, "k", running.token, &response("late"), 10 * SECOND)
            .await
            .unwrap(),
        "the forgotten holder's completion is fenced"
    );
    assert!(
        !s.renew(&scope, "k", running.token, 30 * SECOND)
            .await
            .unwrap()
    );

    let again = req(&scope, "k", 2, 30 * SECOND);
    assert_eq!(
        claim(s, &again).await,
        Claim::Acquired,
        "a forgotten key is free"
    );
    assert!(
        s.complete(&scope, "k", again.token, &response("{}"), 10 * SECOND)
            .await
            .unwrap()
    );
    assert!(
        s.forget(&scope, "k").await.unwrap(),
        "a completed record is forgotten"
    );
    assert!(
        !s.forget(&scope, "k").await.unwrap(),
        "forgetting twice finds nothing"
    );
    assert_eq!(
        claim(s, &req(&scope, "k", 3, 30 * SECOND)).await,
        Claim::Acquired,
        "a forgotten completed key runs again, whatever the request"
    );
}
