//! [`Forwarding`]: a store wrapper that forwards everything and counts the calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::scope::ScopeHash;
use crate::store::{
    Claim, ClaimRequest, Enlisting, FencingToken, ProcessLocal, RecordInfo, RecordedResponse,
    Store, StoreError, StoreGauges,
};

/// A wrapper that forwards every method and every capability to the store it wraps, and
/// counts the calls: a user's own wrapper (metrics, retries) as the [`Store`] docs write it,
/// for tests that a wrapper keeps what its store can do (replays, enlisting, gauges, being
/// process-local) and for tests that count what reaches a store.
///
/// ```
/// use idempotent_runtime::store::{Store, memory::MemoryStore};
/// use idempotent_runtime::test_helpers::store::Forwarding;
///
/// let store = Forwarding::new(MemoryStore::default());
/// let calls = store.calls(); // shared: still readable once the store is in a handle
/// assert_eq!(store.kind(), "memory");
/// assert!(store.process_local().is_some());
/// assert_eq!(calls.request_path(), 0);
/// ```
pub struct Forwarding<S> {
    inner: S,
    calls: Arc<Calls>,
}

/// What a [`Forwarding`] store was asked, method by method.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Calls {
    /// [`Store::claim`] and [`Store::claim_timed`].
    pub claim: AtomicUsize,
    /// [`Store::reclaim`].
    pub reclaim: AtomicUsize,
    /// [`Store::complete`].
    pub complete: AtomicUsize,
    /// [`Store::release`].
    pub release: AtomicUsize,
    /// [`Store::renew`].
    pub renew: AtomicUsize,
    /// [`Store::sweep`].
    pub sweep: AtomicUsize,
    /// [`Store::inspect`].
    pub inspect: AtomicUsize,
    /// [`Store::forget`].
    pub forget: AtomicUsize,
    /// [`Store::enlisting`]: asked by each enlisted request.
    pub enlisting: AtomicUsize,
}

impl Calls {
    /// Calls of the methods a detached (not enlisted) request goes through: claim, reclaim,
    /// complete, release, renew. (Read by the tests that reach it through `test_helpers`.)
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub fn request_path(&self) -> usize {
        [
            &self.claim,
            &self.reclaim,
            &self.complete,
            &self.release,
            &self.renew,
        ]
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .sum()
    }
}

impl<S> Forwarding<S> {
    /// `inner`, wrapped, with every count at 0.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            calls: Arc::default(),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The counts, shared with the wrapper (they go on counting).
    pub fn calls(&self) -> Arc<Calls> {
        Arc::clone(&self.calls)
    }

    fn count(&self, n: &AtomicUsize) {
        n.fetch_add(1, Ordering::Relaxed);
    }
}

impl<S: Store> Store for Forwarding<S> {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.count(&self.calls.claim);
        self.inner.claim(req).await
    }
    async fn claim_timed(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.count(&self.calls.claim);
        self.inner.claim_timed(req).await
    }
    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.count(&self.calls.reclaim);
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
        self.count(&self.calls.complete);
        self.inner
            .complete(scope, key, token, response, retention)
            .await
    }
    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.count(&self.calls.release);
        self.inner.release(scope, key, token).await
    }
    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.count(&self.calls.renew);
        self.inner.renew(scope, key, token, lease).await
    }
    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        self.count(&self.calls.sweep);
        self.inner.sweep(batch).await
    }
    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.count(&self.calls.inspect);
        self.inner.inspect(scope, key, with_response).await
    }
    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        self.count(&self.calls.forget);
        self.inner.forget(scope, key).await
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn expires_by_itself(&self) -> bool {
        self.inner.expires_by_itself()
    }
    fn enlisting(&self) -> Option<Enlisting<'_>> {
        self.count(&self.calls.enlisting);
        self.inner.enlisting()
    }
    fn gauges(&self) -> Option<StoreGauges> {
        self.inner.gauges()
    }
    fn process_local(&self) -> Option<ProcessLocal> {
        self.inner.process_local()
    }
}
