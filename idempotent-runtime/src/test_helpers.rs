//! Internals the crate's benches (`benches/core.rs`), fuzz targets and integration tests drive
//! directly: the one door past the public API. Hidden and behind the `testing` feature: nothing
//! here is public API or covered by semver; users reach the same behaviour through
//! [`Idempotency`](crate::Idempotency) and the framework modules.

/// The record's claim loop over a store, and what it decides (the store tests check the SQL
/// stores' round trips through it).
pub mod record {
    pub use crate::record::{Verdict, claim};
}

/// The framework-free start of a request (the core bench measures a first request and a
/// replay through it).
pub mod pipeline {
    pub use crate::config::effective::{Effective, Recording};
    pub use crate::pipeline::claim::{Begin, BeginRequest, begin};

    /// An endpoint's settings merged with the runtime's, as a request sees them.
    pub fn effective(
        endpoint: &crate::config::EndpointConfig,
        config: &crate::config::Config,
    ) -> Effective {
        endpoint.resolve(config)
    }
}

/// The fingerprint encoders (the golden vectors, the fuzz target, the benches).
pub mod fingerprint {
    use crate::fingerprint::{Fingerprint, FingerprintContributor, FingerprintInput};

    /// The fingerprint with the current encoding.
    pub fn compute(
        input: &FingerprintInput<'_>,
        contributor: Option<&dyn FingerprintContributor>,
    ) -> Fingerprint {
        crate::fingerprint::compute(input, contributor)
    }

    /// The fingerprint with the encoding of `version`; `None` for an unknown one.
    pub fn compute_version(
        version: u16,
        input: &FingerprintInput<'_>,
        contributor: Option<&dyn FingerprintContributor>,
    ) -> Option<Fingerprint> {
        crate::fingerprint::compute_version(version, input, contributor)
    }
}

/// The `Idempotency-Key` parser (the fuzz target).
pub mod key {
    use crate::key::{IdempotencyKey, KeyError};

    /// The longest key accepted, in bytes.
    pub const MAX_KEY_LEN: usize = crate::key::MAX_KEY_LEN;

    /// A request's key header lines, as the sequence reads them.
    pub fn parse_header_values<'a, I>(values: I) -> Result<Option<IdempotencyKey>, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        crate::key::parse_header_values(values)
    }

    /// One key header value.
    pub fn parse_value(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
        crate::key::parse_value(raw)
    }
}

/// The client address behind trusted proxies (the fuzz target).
pub mod scope {
    use std::net::IpAddr;

    use ipnet::IpNet;

    use crate::scope::ScopeError;

    /// The caller's address: the peer, or the hop the trusted proxies appended.
    pub fn client_ip<'a>(
        peer: IpAddr,
        x_forwarded_for: impl IntoIterator<Item = &'a [u8]>,
        forwarded: impl IntoIterator<Item = &'a [u8]>,
        trusted_proxies: &[IpNet],
    ) -> Result<IpAddr, ScopeError> {
        crate::scope::client_ip(peer, x_forwarded_for, forwarded, trusted_proxies)
    }
}

/// Store internals a store's own tests and tools check.
pub mod store {
    pub use crate::store::contract::forwarding::{Calls, Forwarding};

    /// A fresh scope per case, so cases never see each other's records.
    pub fn fresh_scope() -> crate::scope::ScopeHash {
        crate::store::contract::fresh_scope()
    }

    /// The sweeper the handle runs for its store (the sweep-pause tool).
    pub fn spawn_sweeper<S: crate::store::Store>(
        store: std::sync::Weak<S>,
        retention: std::time::Duration,
        batch: usize,
    ) -> tokio::task::JoinHandle<()> {
        crate::store::spawn_sweeper(store, retention, batch)
    }

    /// The length of a Redis record's fixed header.
    #[cfg(feature = "redis")]
    pub const REDIS_RECORD_HEADER_LEN: usize = crate::store::redis::RECORD_HEADER_LEN;
}

/// The `google.rpc` details of a gRPC refusal, decoded (the gRPC tests; a client reads them with
/// `tonic-types`).
#[cfg(feature = "tonic")]
pub mod tonic {
    pub use crate::tonic::details::{ErrorInfo, RetryInfo, RpcStatus};
}
