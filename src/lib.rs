//! Shared pieces of the workspace's examples and integration tests (not published).

pub mod conformance;
pub mod testkit;
