//! A store written outside the crate implements only the methods the request path needs; every
//! other `Store` method has a default, and the defaults answer as documented.

use std::time::Duration;

use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, Store, StoreError,
};

/// Implements exactly the required methods, as a store written against 0.1.0 would.
struct MinimalStore;

impl Store for MinimalStore {
    async fn claim(&self, _req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        Ok(Claim::Acquired)
    }

    async fn reclaim(
        &self,
        _req: &ClaimRequest<'_>,
        _stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        Ok(Claim::Acquired)
    }

    async fn complete(
        &self,
        _scope: &ScopeHash,
        _key: &str,
        _token: FencingToken,
        _response: &RecordedResponse,
        _retention: Duration,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn release(
        &self,
        _scope: &ScopeHash,
        _key: &str,
        _token: FencingToken,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn renew(
        &self,
        _scope: &ScopeHash,
        _key: &str,
        _token: FencingToken,
        _lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn sweep(&self, _batch: usize) -> Result<usize, StoreError> {
        Ok(0)
    }
}

#[tokio::test]
async fn a_store_with_only_the_required_methods_gets_documented_defaults() {
    let store = &MinimalStore;
    let scope: ScopeHash = [1; 32];

    assert_eq!(store.kind(), "custom");
    assert!(!store.expires_by_itself());

    let inspected = store.inspect(&scope, "order-1", true).await;
    let Err(
        error @ StoreError::Unsupported {
            operation: "inspect",
        },
    ) = inspected
    else {
        panic!("inspect's default is not Unsupported: {inspected:?}");
    };
    assert_eq!(
        error.to_string(),
        "this idempotency store does not support `inspect`"
    );

    let forgotten = store.forget(&scope, "order-1").await;
    let Err(
        error @ StoreError::Unsupported {
            operation: "forget",
        },
    ) = forgotten
    else {
        panic!("forget's default is not Unsupported: {forgotten:?}");
    };
    assert_eq!(
        error.to_string(),
        "this idempotency store does not support `forget`"
    );
}
