//! Shared pieces of the workspace's examples (not published); what the integration tests share is
//! tests/support.

pub mod admin;
pub mod conformance;
#[cfg(feature = "tonic")]
pub mod grpc;
