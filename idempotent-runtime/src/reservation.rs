//! A held key while its handler runs ([the contract](crate::design) §3): the lease renewed every third of it, and
//! the fenced completion or release that settles it. Also the count of claimed handlers that
//! graceful shutdown waits for.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Notify;

use crate::config::Recording;
use crate::key::IdempotencyKey;
use crate::observe::{self, Event, KeyDisplay};
use crate::scope::ScopeHash;
use crate::store::{Backend, Compact, FencingToken, RecordedResponse, StoreError};

/// A held key: run the handler through [`Reservation::run`], then [`complete`](Self::complete)
/// or [`release`](Self::release) it. Dropped unsettled (a panic, a cancelled task), it releases
/// the key in the background.
#[derive(Debug)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct Reservation {
    guard: Option<ReleaseOnDrop>,
    lease: Duration,
    retention: Duration,
    max_response: usize,
    recording: Recording,
    route: Arc<str>,
    renewal: Renewal,
    _running: RunningGuard,
}

/// What the renewal loop knows of the lease, kept across the handler's run and the reading of
/// its response, so a lease lost in one is not counted again in the other.
#[derive(Debug)]
struct Renewal {
    last_kept: tokio::time::Instant,
    lost: bool,
    overdue: bool,
}

impl Renewal {
    fn new() -> Self {
        Self {
            last_kept: tokio::time::Instant::now(),
            lost: false,
            overdue: false,
        }
    }
}

/// A claim's record identity that releases the key if dropped armed: the reservation's own (a
/// reservation dropped unsettled frees its key), and a claim whose store call is in flight (the
/// request's future dropped mid-call, the client gone: whatever the call may have written under
/// the request's own token is released, so the key does not stand at 409 for a whole lease).
/// The release is spawned on the current runtime; the token is the request's own, so it can
/// free nothing but its claim.
#[derive(Debug)]
pub(crate) struct ReleaseOnDrop {
    store: Backend,
    scope: ScopeHash,
    key: IdempotencyKey,
    token: FencingToken,
    armed: bool,
}

impl ReleaseOnDrop {
    pub(crate) fn new(
        store: Backend,
        scope: ScopeHash,
        key: IdempotencyKey,
        token: FencingToken,
    ) -> Self {
        Self {
            store,
            scope,
            key,
            token,
            armed: true,
        }
    }

    /// Settled: nothing to release.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, scope, key, token) =
            (self.store.clone(), self.scope, self.key.clone(), self.token);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.release(&scope, key.as_str(), token).await;
            });
        }
    }
}

/// How a claimed handler ended.
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub enum Ran<T> {
    /// It returned.
    Returned(T),
    /// It panicked; the key has been released.
    Panicked,
}

#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
impl Reservation {
    /// A reservation held in `store` by `token`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn held(
        store: Backend,
        scope: ScopeHash,
        key: IdempotencyKey,
        token: FencingToken,
        lease: Duration,
        retention: Duration,
        max_response: usize,
        route: &str,
        running: RunningGuard,
    ) -> Self {
        Self {
            guard: Some(ReleaseOnDrop {
                store,
                scope,
                key,
                token,
                armed: true,
            }),
            lease,
            retention,
            max_response,
            recording: Recording::default(),
            route: route.into(),
            renewal: Renewal::new(),
            _running: running,
        }
    }

    /// The endpoint's own rules for what is recorded.
    pub(crate) fn with_recording(mut self, recording: Recording) -> Self {
        self.recording = recording;
        self
    }

    /// The endpoint's rules for what is recorded.
    pub fn recording(&self) -> &Recording {
        &self.recording
    }

    /// A handler running unprotected (failing open while the store is down): nothing is held,
    /// recorded or released.
    pub(crate) fn unguarded(route: &str, running: RunningGuard) -> Self {
        Self {
            guard: None,
            lease: Duration::ZERO,
            retention: Duration::ZERO,
            max_response: 0,
            recording: Recording::default(),
            route: route.into(),
            renewal: Renewal::new(),
            _running: running,
        }
    }

    /// The recorded-response cap in force (0 when running unprotected: nothing is recorded).
    pub fn max_response(&self) -> usize {
        if self.guard.is_some() {
            self.max_response
        } else {
            0
        }
    }

    /// The route the request was claimed on.
    pub(crate) fn route(&self) -> &str {
        &self.route
    }

    /// The route, shared.
    pub(crate) fn shared_route(&self) -> Arc<str> {
        Arc::clone(&self.route)
    }

    /// Whether a store backs this reservation (false when failing open).
    pub fn is_guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// Runs the claimed handler to its end while renewing the lease every third of it. A panic
    /// is caught and the key released before this returns. The handler is polled where it is
    /// pinned: this future holds a pointer to it, not a copy.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice (the argument and its rebinding)"
    )]
    pub fn run<'a, F: Future>(
        &'a mut self,
        handler: Pin<&'a mut F>,
    ) -> impl Future<Output = Ran<F::Output>> + 'a {
        // A block, not an `async fn`: its captures are kept once (an `async fn` keeps its
        // arguments and the copies it rebinds them to), and this future is part of every
        // claimed request's boxed work.
        async move {
            let handler = AssertUnwindSafe(handler).catch_unwind();
            let result = match &self.guard {
                Some(guard) => {
                    renewed(guard, self.lease, &self.route, &mut self.renewal, handler).await
                }
                None => handler.await,
            };
            match result {
                Ok(v) => Ran::Returned(v),
                Err(_) => {
                    // Boxed: a panic is rare, and every request's run would carry its bytes.
                    Box::pin(self.release_now()).await;
                    Ran::Panicked
                }
            }
        }
    }

    /// Runs `work` (reading the handler's response to record it) while the lease is still
    /// renewed, as it is while the handler runs: a response that streams for longer than the
    /// lease is never taken over by a duplicate before it is recorded or released.
    pub(crate) async fn renewing<F: Future + Unpin>(&mut self, work: F) -> F::Output {
        let Some(guard) = &self.guard else {
            return work.await;
        };
        renewed(guard, self.lease, &self.route, &mut self.renewal, work).await
    }

    /// Records the response for replay. A failed or fenced write is logged and counted; the
    /// response is still sent and the reservation lapses with its lease. Settled, the
    /// reservation holds nothing (it is borrowed, so the future that settles it need not carry
    /// a copy of it).
    pub async fn complete(&mut self, response: &RecordedResponse) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let complete = guard.store.complete(
            &guard.scope,
            guard.key.as_str(),
            guard.token,
            response,
            self.retention,
        );
        let result = observe::timed("complete", guard.store.kind(), complete).await;
        match result {
            Ok(true) => {}
            Ok(false) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::LeaseLost, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    "response not recorded: the lease was lost to another request"
                );
            }
            Err(error @ (StoreError::Full | StoreError::QuotaExceeded)) => {
                // Refused, not lost: nothing stands for the retry to replay, so the key is
                // freed now rather than answering 409 for a whole lease after this answer.
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::StoreFull, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    %error,
                    "response not recorded: the store refused it; the key is released"
                );
                self.guard = Some(guard);
                self.release_now().await;
                return;
            }
            Err(error @ StoreError::NotReplicated { .. }) => {
                // Recorded on the primary, so replayed while it serves; only a failover before
                // the replicas catch up loses it. The answer goes out: the handler ran.
                observe::count(Event::StoreError, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    %error,
                    "response recorded but not replicated in time: check the store's replicas"
                );
            }
            Err(error) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::StoreError, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    %error,
                    "response not recorded: the reservation stands until its lease lapses"
                );
            }
        }
        // Settled: the guard must not release what was just completed.
        guard.disarm();
    }

    /// Whether settling this reservation never suspends: unguarded, or held in a store that
    /// answers at once (the memory store).
    pub(crate) fn settles_at_once(&self) -> bool {
        self.guard
            .as_ref()
            .is_none_or(|guard| guard.store.answers_at_once())
    }

    /// [`release`](Self::release) as the work's future holds it: done before this returns when
    /// it [settles at once](Self::settles_at_once), else boxed ([`Compact`]).
    pub(crate) fn releasing(&mut self) -> Compact<impl Future<Output = ()> + Send + '_> {
        let at_once = self.settles_at_once();
        Compact::new(at_once, self.release())
    }

    /// Frees the key without recording (5xx, non-replayable, too large), as
    /// [`complete`](Self::complete) settles it.
    pub async fn release(&mut self) {
        observe::count(Event::NotRecorded, &self.route);
        self.release_now().await;
    }

    async fn release_now(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let release = guard
            .store
            .release(&guard.scope, guard.key.as_str(), guard.token);
        if let Err(error) = observe::timed("release", guard.store.kind(), release).await {
            tracing::warn!(
                route = %self.route,
                key_hash = %KeyDisplay(guard.key.as_str()),
                %error,
                "could not release the key; it frees itself when its lease lapses"
            );
        }
        guard.disarm();
    }
}

/// `work` to its end, the lease renewed while it runs. The renewal is made only when `work` is
/// not done at its first poll, and then in a box of its own: a handler that answers at once
/// (most do on the memory store) never builds it, and the futures around this one neither hold
/// nor move its bytes. `work` is polled first on every wake-up, as before the renewal.
fn renewed<'a, F: Future + Unpin + 'a>(
    guard: &'a ReleaseOnDrop,
    lease: Duration,
    route: &'a str,
    state: &'a mut Renewal,
    mut work: F,
) -> impl Future<Output = F::Output> + 'a {
    let mut state = Some(state);
    let mut renew = None;
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(output) = Pin::new(&mut work).poll(cx) {
            return Poll::Ready(output);
        }
        let renew = renew.get_or_insert_with(|| {
            let state = state.take().expect("the renewal is made once");
            Box::pin(renew_forever(guard, lease, route, state))
        });
        match renew.as_mut().poll(cx) {
            Poll::Ready(never) => match never {},
            Poll::Pending => Poll::Pending,
        }
    })
}

/// Renews the lease every third of it until the future it races ends (the handler, then the
/// reading of its response). A renewal that fails because the store is down is tried again on
/// the next tick, however long the outage: if the token still holds when the store comes back,
/// the lease is kept. Only a renewal the store refuses (the token no longer holds the key)
/// stops it.
async fn renew_forever(
    guard: &ReleaseOnDrop,
    lease: Duration,
    route: &str,
    state: &mut Renewal,
) -> std::convert::Infallible {
    let period = lease / 3;
    let Renewal {
        last_kept,
        lost,
        overdue,
    } = state;
    loop {
        tokio::time::sleep(period).await;
        if *lost {
            continue;
        }
        let renew = guard
            .store
            .renew(&guard.scope, guard.key.as_str(), guard.token, lease);
        match observe::timed("renew", guard.store.kind(), renew).await {
            Ok(true) => {
                if *overdue {
                    tracing::warn!(
                        route,
                        key_hash = %KeyDisplay(guard.key.as_str()),
                        "lease renewed again after the store came back; the token still holds"
                    );
                }
                *last_kept = tokio::time::Instant::now();
                *overdue = false;
            }
            Ok(false) => {
                *lost = true;
                observe::count(Event::LeaseLost, route);
                tracing::error!(
                    route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    "lease lost while the handler runs or its answer is read: a duplicate may run \
                     concurrently"
                );
            }
            Err(error) => {
                tracing::warn!(route, %error, "lease renewal failed; retrying next tick");
                if !*overdue && last_kept.elapsed() >= lease {
                    *overdue = true;
                    observe::count(Event::LeaseLost, route);
                    tracing::error!(
                        route,
                        key_hash = %KeyDisplay(guard.key.as_str()),
                        "lease lapsed while the store is unreachable: a duplicate may run \
                         concurrently; renewal goes on while the token may still hold"
                    );
                }
            }
        }
    }
}

/// Counts claimed handlers so shutdown can wait for them.
#[derive(Default)]
pub(crate) struct Running {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Running {
    pub(crate) fn enter(&self) -> RunningGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        RunningGuard {
            count: Arc::clone(&self.count),
            idle: Arc::clone(&self.idle),
        }
    }

    /// Claimed handlers running now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[derive(Debug)]
pub(crate) struct RunningGuard {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, ClaimRequest, Standing, StandingState, Store};

    /// The memory store behind switches: `down` fails every call as an unreachable database
    /// would, `hang_claims` writes a claim and then never answers (the connection stalls with
    /// the statement applied), `full` refuses completions for room, `unreplicated` writes a
    /// completion and reports that no replica acknowledged it.
    #[derive(Default)]
    pub(crate) struct Outage {
        pub(crate) inner: MemoryStore,
        pub(crate) down: AtomicBool,
        pub(crate) hang_claims: AtomicBool,
        pub(crate) full: AtomicBool,
        pub(crate) unreplicated: AtomicBool,
        pub(crate) renewals: AtomicUsize,
    }

    fn unreachable_store() -> StoreError {
        StoreError::unavailable("connection refused")
    }

    impl Outage {
        fn check(&self) -> Result<(), StoreError> {
            if self.down.load(Ordering::SeqCst) {
                return Err(unreachable_store());
            }
            Ok(())
        }
    }

    impl Store for Outage {
        async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.check()?;
            let claimed = self.inner.claim(req).await;
            if self.hang_claims.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            claimed
        }
        async fn reclaim(
            &self,
            req: &ClaimRequest<'_>,
            stale: FencingToken,
        ) -> Result<Claim, StoreError> {
            self.check()?;
            self.inner.reclaim(req, stale).await
        }
        async fn complete(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            response: &RecordedResponse,
            retention: Duration,
        ) -> Result<bool, StoreError> {
            self.check()?;
            if self.full.load(Ordering::SeqCst) {
                return Err(StoreError::Full);
            }
            let done = self
                .inner
                .complete(scope, key, token, response, retention)
                .await;
            if self.unreplicated.load(Ordering::SeqCst) && matches!(done, Ok(true)) {
                return Err(StoreError::NotReplicated {
                    acknowledged: 0,
                    wanted: 1,
                });
            }
            done
        }
        async fn release(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
        ) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.release(scope, key, token).await
        }
        async fn renew(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            lease: Duration,
        ) -> Result<bool, StoreError> {
            self.check()?;
            let renewed = self.inner.renew(scope, key, token, lease).await;
            if matches!(renewed, Ok(true)) {
                self.renewals.fetch_add(1, Ordering::SeqCst);
            }
            renewed
        }
        async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
            self.check()?;
            self.inner.sweep(batch).await
        }

        async fn inspect(
            &self,
            scope: &ScopeHash,
            key: &str,
            with_response: bool,
        ) -> Result<Option<crate::store::RecordInfo>, StoreError> {
            self.check()?;
            self.inner.inspect(scope, key, with_response).await
        }

        async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.forget(scope, key).await
        }
    }

    pub(crate) fn request<'a>(
        scope: &'a ScopeHash,
        key: &'a str,
        lease: Duration,
    ) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: 1,
            fingerprint: Fingerprint {
                version: 1,
                digest: [7; 32],
            },
            token: FencingToken::mint(),
            lease,
            retention: Duration::from_secs(60),
            route: "/test",
            response_room: 0,
        }
    }

    fn held(store: &Arc<Outage>, req: &ClaimRequest<'_>) -> Reservation {
        let running = Running::default();
        Reservation::held(
            Arc::clone(store).into_backend(),
            *req.scope,
            IdempotencyKey::new(req.key).unwrap(),
            req.token,
            req.lease,
            req.retention,
            1 << 20,
            "/orders",
            running.enter(),
        )
    }

    /// What a duplicate arriving now is told.
    async fn duplicate(store: &Outage, scope: &ScopeHash, key: &str) -> StandingState {
        let req = request(scope, key, Duration::from_secs(1));
        match store.inner.claim(&req).await.unwrap() {
            Claim::Standing(Standing { state, .. }) => state,
            Claim::Acquired => panic!("the key was free while its handler ran"),
        }
    }

    async fn held_through_an_outage_of(outage: Duration) {
        let lease = Duration::from_millis(300);
        let store = Arc::new(Outage::default());
        let scope = [1; 32];
        let req = request(&scope, "k", lease);
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        let mut reservation = held(&store, &req);
        let outcome = reservation
            .run(std::pin::pin!(async {
                store.down.store(true, Ordering::SeqCst);
                tokio::time::sleep(outage).await;
                store.down.store(false, Ordering::SeqCst);
                let before = store.renewals.load(Ordering::SeqCst);
                // Two ticks after the store came back.
                tokio::time::sleep(lease).await;
                let renewed = store.renewals.load(Ordering::SeqCst) > before;
                (renewed, duplicate(&store, &scope, "k").await)
            }))
            .await;
        let Ran::Returned((renewed, state)) = outcome else {
            panic!("the handler panicked");
        };
        assert!(renewed, "renewal gave up during the outage");
        assert!(
            matches!(state, StandingState::Running { .. }),
            "a duplicate after the outage saw {state:?}, not the live handler"
        );
        reservation.release().await;
    }

    #[tokio::test]
    async fn renewal_survives_an_outage_that_ends_before_the_lease() {
        held_through_an_outage_of(Duration::from_millis(200)).await;
    }

    #[tokio::test]
    async fn renewal_resumes_after_an_outage_longer_than_the_lease_while_the_token_holds() {
        held_through_an_outage_of(Duration::from_millis(800)).await;
    }

    #[tokio::test]
    async fn a_completion_refused_for_room_releases_the_key_at_once() {
        let store = Arc::new(Outage::default());
        let scope = [2; 32];
        let req = request(&scope, "k", Duration::from_secs(60));
        store.claim(&req).await.unwrap();
        store.full.store(true, Ordering::SeqCst);
        let answer = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"done"));
        held(&store, &req).complete(&answer).await;
        // Not a 409 for a whole lease after the answer was sent: the retry may run.
        let retry = request(&scope, "k", Duration::from_secs(60));
        assert_eq!(store.inner.claim(&retry).await.unwrap(), Claim::Acquired);
    }

    #[tokio::test]
    async fn a_completion_not_replicated_in_time_stands_and_is_replayed() {
        let store = Arc::new(Outage::default());
        let scope = [3; 32];
        let req = request(&scope, "k", Duration::from_secs(60));
        store.claim(&req).await.unwrap();
        store.unreplicated.store(true, Ordering::SeqCst);
        let answer = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"done"));
        held(&store, &req).complete(&answer).await;
        // Recorded on the primary: neither released (the retry would run again) nor left
        // reserved (409 for a whole lease); the retry replays it.
        let retry = request(&scope, "k", Duration::from_secs(60));
        let Claim::Standing(Standing { state, .. }) = store.inner.claim(&retry).await.unwrap()
        else {
            panic!("the key was released");
        };
        let StandingState::Completed(recorded) = state else {
            panic!("the retry saw {state:?}, not the recorded answer");
        };
        assert_eq!(recorded.body, bytes::Bytes::from_static(b"done"));
    }
}
