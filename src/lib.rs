//! Shared pieces of the workspace's examples and integration tests (not published).

pub mod admin;
pub mod conformance;
pub mod testkit;
