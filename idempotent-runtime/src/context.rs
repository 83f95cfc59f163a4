//! What a handler may learn about its idempotent request.

use sha2::{Digest, Sha256};

use crate::key::IdempotencyKey;
use crate::scope::ScopeHash;

/// The idempotency facts of a claimed request, for handlers that pass idempotency downstream.
///
/// Pass [`derived_key`](Self::derived_key) to a payment provider or another service, never the
/// raw key: the raw key is the client's, and two tenants may well send the same one.
///
/// ```
/// use idempotent_runtime::IdempotencyContext;
/// use idempotent_runtime::key::IdempotencyKey;
///
/// let a = IdempotencyContext::new(IdempotencyKey::new("k1").unwrap(), [1; 32]);
/// let b = IdempotencyContext::new(IdempotencyKey::new("k1").unwrap(), [2; 32]);
/// assert_ne!(a.derived_key("charge"), b.derived_key("charge"));
/// assert_ne!(a.derived_key("charge"), a.derived_key("refund"));
/// assert_eq!(a.derived_key("charge").len(), 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyContext {
    key: IdempotencyKey,
    scope: ScopeHash,
}

impl IdempotencyContext {
    /// The context of a request with `key` in `scope`.
    pub fn new(key: IdempotencyKey, scope: ScopeHash) -> Self {
        Self { key, scope }
    }

    /// The client's key. Do not send it downstream; see [`derived_key`](Self::derived_key).
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The caller's scope hash.
    pub fn scope_hash(&self) -> &ScopeHash {
        &self.scope
    }

    /// SHA-256 of scope, key and `purpose`, as 64 lowercase hex characters: a key for one
    /// downstream call that is stable across retries and distinct across tenants and purposes.
    pub fn derived_key(&self, purpose: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"idempotent-derived/v1\n");
        let mut enc = crate::digest::Encoder(&mut h);
        enc.bytes(&self.scope);
        enc.bytes(self.key.as_str().as_bytes());
        enc.bytes(purpose.as_bytes());
        let digest: [u8; 32] = h.finalize().into();
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}
