//! The object-safe face of [`Store`] behind the runtime's handle.
//!
//! [`Store`]'s methods return `impl Future`, so `dyn Store` cannot exist; the handle holds a
//! `dyn DynStore` instead (any store but the in-memory one, which it holds as itself:
//! [`Backend`](super::Backend)), which every store is through the blanket impl. It is not
//! imported into `store` itself: a type that is both would make every `store.claim(..)`
//! ambiguous.

use std::time::Duration;

use futures_util::future::BoxFuture;

use super::{
    Claim, ClaimRequest, Enlisting, FencingToken, ProcessLocal, RecordInfo, RecordedResponse,
    Store, StoreError, StoreGauges,
};
use crate::scope::ScopeHash;

/// The object-safe face of [`Store`] the runtime holds behind its handle: every method's future
/// boxed once, here, for every store (a blanket impl), so implementors write plain `async fn`s.
pub(crate) trait DynStore: Send + Sync {
    /// What the runtime claims with: [`Store::claim_timed`] with the `metrics` feature,
    /// [`Store::claim`] without; one box either way.
    fn claim<'a>(&'a self, req: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>>;
    fn reclaim<'a>(
        &'a self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;
    fn complete<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    fn release<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    fn renew<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<usize, StoreError>>;
    fn inspect<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        with_response: bool,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>>;
    fn forget<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    fn kind(&self) -> &'static str;
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    fn enlisting(&self) -> Option<Enlisting<'_>>;
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn gauges(&self) -> Option<StoreGauges>;
    fn process_local(&self) -> Option<ProcessLocal>;
}

impl<S: Store> DynStore for S {
    fn claim<'a>(&'a self, req: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        #[cfg(feature = "metrics")]
        return Box::pin(Store::claim_timed(self, req));
        #[cfg(not(feature = "metrics"))]
        Box::pin(Store::claim(self, req))
    }
    fn reclaim<'a>(
        &'a self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(Store::reclaim(self, req, stale))
    }
    fn complete<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::complete(
            self, scope, key, token, response, retention,
        ))
    }
    fn release<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::release(self, scope, key, token))
    }
    fn renew<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::renew(self, scope, key, token, lease))
    }
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(Store::sweep(self, batch))
    }
    fn inspect<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
        with_response: bool,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        Box::pin(Store::inspect(self, scope, key, with_response))
    }
    fn forget<'a>(
        &'a self,
        scope: &'a ScopeHash,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::forget(self, scope, key))
    }
    fn kind(&self) -> &'static str {
        Store::kind(self)
    }
    fn enlisting(&self) -> Option<Enlisting<'_>> {
        Store::enlisting(self)
    }
    fn gauges(&self) -> Option<StoreGauges> {
        Store::gauges(self)
    }
    fn process_local(&self) -> Option<ProcessLocal> {
        Store::process_local(self)
    }
}
