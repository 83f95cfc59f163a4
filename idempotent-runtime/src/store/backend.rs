//! The store behind a handle: the in-memory store by its type, any other erased.
//!
//! [`Store`]'s futures are `impl Future`, so a handle over any store must hold it erased
//! ([`DynStore`]), which boxes every call's future: an allocation per claim, completion, release
//! and renewal of every request. The in-memory store is known when the handle is built
//! ([`Store::into_backend`], which it overrides): the handle holds it as itself, and a call is a
//! match into its `async fn`s, compiled into the caller's state machine, with no allocation (its
//! claim, which never suspends, is ready at its first poll).
//!
//! The other stores stay erased, the crate's own included. A box is nothing beside their
//! round trip, and it keeps their futures out of the caller's type: theirs nest so deep (sqlx's,
//! redis-rs's) that inlined into the pipelines' they overflow rustc's query depth
//! (`recursion_limit`, 128) computing the layouts of the axum extractor's and layer's futures
//! (the PostgreSQL store's alone does), here and in an application whose handlers hold them.
//! A wrapper ([`CachedStore`](super::cache::CachedStore), a user's) stays erased too: what it
//! wraps could be anyone's.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::erased::DynStore;
use super::memory::MemoryStore;
use super::{
    Claim, ClaimRequest, Enlisting, FencingToken, ProcessLocal, RecordInfo, RecordedResponse,
    Store, StoreError, StoreGauges,
};
use crate::scope::ScopeHash;

/// The store a handle holds ([module docs](self)). Public in name only, so that
/// [`Store::into_backend`] can return it: nothing outside the crate can name or build one.
#[derive(Clone)]
#[allow(
    unreachable_pub,
    reason = "named by Store::into_backend, a hidden method no one outside the crate can override"
)]
pub struct Backend(Held);

#[derive(Clone)]
enum Held {
    /// The in-memory store.
    Memory(Arc<MemoryStore>),
    /// Any other store, every call's future boxed.
    Other(Arc<dyn DynStore>),
}

impl Backend {
    /// The in-memory store, held as itself.
    pub(crate) fn memory(store: Arc<MemoryStore>) -> Self {
        Self(Held::Memory(store))
    }

    /// Any store, erased.
    pub(crate) fn erased(store: Arc<dyn DynStore>) -> Self {
        Self(Held::Other(store))
    }

    /// Whether every call answers at its first poll, never suspending: the in-memory store's
    /// do (each is a lock and a lookup, no I/O).
    pub(crate) fn answers_at_once(&self) -> bool {
        matches!(self.0, Held::Memory(_))
    }
}

/// A step that calls the store, as the futures around it hold it: its output already, when
/// the step was run to its end at once (on the memory store it never suspends), else the step
/// in a box of its own. Either way the caller's future carries a few words where it would carry
/// the step's state machine (a release's: hundreds of bytes, nested), and does not copy them
/// from await to await. It keeps the step's output until polled, so it suits a step whose output
/// is small: the claim, whose output holds a reservation, is decided in place without one
/// (`ClaimMode::begin_at_once`), and the settling keeps its own state (`pipeline::settle`).
pub(crate) enum Compact<F: Future> {
    /// Run at once; taken when polled.
    Done(Option<F::Output>),
    /// To be awaited.
    Boxed(Pin<Box<F>>),
}

impl<F: Future> Compact<F> {
    /// `step`, run to its end here when `at_once` (a store that never suspends), else boxed.
    pub(crate) fn new(at_once: bool, step: F) -> Self {
        if at_once {
            Self::Done(Some(self::at_once(std::pin::pin!(step))))
        } else {
            Self::Boxed(Box::pin(step))
        }
    }
}

/// `step`'s output, from its first poll: for a step whose only awaits are calls to a store that
/// [answers at once](Backend::answers_at_once). Pinned by the caller, so that it is made where
/// it is polled (`at_once(pin!(step()))`), not made and then moved there.
pub(crate) fn at_once<F: Future>(step: Pin<&mut F>) -> F::Output {
    match step.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        // Only the memory store answers at once, and none of its calls awaits anything.
        Poll::Pending => unreachable!("a store that answers at once suspended"),
    }
}

// The output is moved out whole, never pinned in place; the step is pinned in its box.
impl<F: Future> Unpin for Compact<F> {}

impl<F: Future> Future for Compact<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.get_mut() {
            Self::Done(output) => Poll::Ready(output.take().expect("polled after it answered")),
            Self::Boxed(step) => step.as_mut().poll(cx),
        }
    }
}

/// `$builtin` with `$store` bound to the in-memory store (an `&Arc<MemoryStore>`), or
/// `$erased` with `$other` bound to the erased one.
macro_rules! each {
    ($backend:expr, $store:ident => $builtin:expr, $other:ident => $erased:expr) => {
        match &$backend.0 {
            Held::Memory($store) => $builtin,
            Held::Other($other) => $erased,
        }
    };
}

// `Store` and `DynStore` are called by their paths: every store is both (the blanket impl), so
// a method call would be ambiguous.
impl Backend {
    /// What the runtime claims with: [`Store::claim_timed`] with the `metrics` feature,
    /// [`Store::claim`] without.
    pub(crate) async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        #[cfg(feature = "metrics")]
        return each!(self,
            s => Store::claim_timed(&**s, req).await,
            o => DynStore::claim(&**o, req).await);
        #[cfg(not(feature = "metrics"))]
        each!(self,
            s => Store::claim(&**s, req).await,
            o => DynStore::claim(&**o, req).await)
    }

    pub(crate) async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        each!(self,
            s => Store::reclaim(&**s, req, stale).await,
            o => DynStore::reclaim(&**o, req, stale).await)
    }

    pub(crate) async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        each!(self,
            s => Store::complete(&**s, scope, key, token, response, retention).await,
            o => DynStore::complete(&**o, scope, key, token, response, retention).await)
    }

    pub(crate) async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        each!(self,
            s => Store::release(&**s, scope, key, token).await,
            o => DynStore::release(&**o, scope, key, token).await)
    }

    pub(crate) async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        each!(self,
            s => Store::renew(&**s, scope, key, token, lease).await,
            o => DynStore::renew(&**o, scope, key, token, lease).await)
    }

    pub(crate) async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        each!(self,
            s => Store::inspect(&**s, scope, key, with_response).await,
            o => DynStore::inspect(&**o, scope, key, with_response).await)
    }

    pub(crate) async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        each!(self,
            s => Store::forget(&**s, scope, key).await,
            o => DynStore::forget(&**o, scope, key).await)
    }

    pub(crate) fn kind(&self) -> &'static str {
        each!(self, s => Store::kind(&**s), o => DynStore::kind(&**o))
    }

    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn enlisting(&self) -> Option<Enlisting<'_>> {
        each!(self, s => Store::enlisting(&**s), o => DynStore::enlisting(&**o))
    }

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn gauges(&self) -> Option<StoreGauges> {
        each!(self, s => Store::gauges(&**s), o => DynStore::gauges(&**o))
    }

    pub(crate) fn process_local(&self) -> Option<ProcessLocal> {
        each!(self, s => Store::process_local(&**s), o => DynStore::process_local(&**o))
    }

    /// The store, erased, held weakly: for the sweeper, which ends when the store is dropped
    /// and may box its calls.
    pub(crate) fn downgrade(&self) -> Weak<dyn DynStore> {
        let erased: Arc<dyn DynStore> = each!(self, s => Arc::clone(s) as _, o => Arc::clone(o));
        Arc::downgrade(&erased)
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} store", self.kind())
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::*;
    use crate::fingerprint::Fingerprint;

    #[test]
    fn the_memory_store_is_held_as_itself_and_a_wrapper_of_it_erased() {
        let memory = Arc::new(MemoryStore::default()).into_backend();
        assert!(matches!(memory.0, Held::Memory(_)), "{memory:?}");
        let cached = Arc::new(crate::store::cache::CachedStore::new(MemoryStore::default()));
        assert!(matches!(cached.into_backend().0, Held::Other(_)));
    }

    /// Without a box in between, a claim on the memory store is one poll that never suspends.
    #[test]
    fn a_claim_on_the_memory_store_is_ready_at_its_first_poll() {
        let backend = Arc::new(MemoryStore::default()).into_backend();
        let scope = [1u8; 32];
        let req = ClaimRequest {
            scope: &scope,
            key: "k",
            quota_bucket: 1,
            fingerprint: Fingerprint {
                version: 1,
                digest: [0; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(60),
            route: "/orders",
            response_room: 0,
        };
        let mut cx = Context::from_waker(Waker::noop());
        let claimed = pin!(backend.claim(&req)).poll(&mut cx);
        assert!(
            matches!(claimed, Poll::Ready(Ok(Claim::Acquired))),
            "{claimed:?}"
        );
        let again = pin!(backend.claim(&req)).poll(&mut cx);
        assert!(
            matches!(again, Poll::Ready(Ok(Claim::Standing(_)))),
            "{again:?}"
        );
    }
}
