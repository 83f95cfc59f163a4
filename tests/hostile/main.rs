//! Hostile callers against every conformance server, over raw HTTP/1.1 with a deadline on every
//! read: hostile input (keys, headers, bodies, quotas), a scope that floods or lies about who it
//! is, and idle connections announcing large bodies. The cases that do not depend on the memory
//! store run again with every server on `--store mysql` (`on_mysql::`).
//!
//! ```text
//! cargo test --all-features --test hostile [input::|fair_scope::|idle_bodies::]
//! ```

#[path = "../support/mod.rs"]
mod support;

/// A test per case against every conformance server (`cases::$case(server)`, in the module that
/// invokes it): each `every_store` case on the memory store and again on MySQL (`on_mysql::`),
/// each `memory_only` case on the memory store alone.
macro_rules! against_every_server {
    (
        every_store: [$($case:ident),* $(,)?],
        memory_only: [$($memory_case:ident),* $(,)?] $(,)?
    ) => {
        $(against_every_server!(@memory $case);)*
        $(against_every_server!(@memory $memory_case);)*

        /// The cases that do not depend on the memory store, again with every server on
        /// `--store mysql` (`MYSQL_URL`, each server in a database of its own; skipped when it
        /// is unset, unless `IDEMPOTENT_REQUIRE_MYSQL=1`): who the caller is, and what input is
        /// refused, are decided the same on every store.
        #[cfg(feature = "mysql")]
        mod on_mysql {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(url) = support::mysql_url() else { return };
                    for server in support::SERVERS {
                        eprintln!("{} against {server} on MySQL", stringify!($case));
                        support::harness::on_mysql(url.clone(), cases::$case(server)).await;
                    }
                }
            )*
        }
    };
    (@memory $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            for server in support::SERVERS {
                eprintln!("{} against {server}", stringify!($case));
                cases::$case(server).await;
            }
        }
    };
}

mod fair_scope;
#[cfg(feature = "actix")]
mod idle_bodies;
mod input;
