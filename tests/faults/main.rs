//! Faults a deployment has and a loopback does not: a replica cut off from its store by the
//! network while another still reaches it ([`partition`]).
//!
//! The partition runs two conformance servers (replicas A and B), each inside a network
//! namespace of the test's own joined to the host by two `veth` pairs (one to its store, one to
//! its clients), with subnets that never collide, and partitions A alone by a `blackhole`
//! queueing discipline (`tc`) on both ends of A's store pair. It needs root (or
//! `CAP_NET_ADMIN`) and `ip`/`tc` from iproute2; without them it says so and passes, unless
//! `IDEMPOTENT_REQUIRE_NETNS=1` (CI), when it fails.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \
//!     MYSQL_URL=mysql://root@127.0.0.1:3306/test \
//!     cargo test --all-features --test faults
//! ```

#[path = "../support/mod.rs"]
mod support;

mod netns;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod partition;
