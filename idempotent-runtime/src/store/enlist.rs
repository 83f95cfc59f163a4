//! The enlisting capability ([`Store::enlisting`](super::Store::enlisting)): what a store offers
//! an enlisted request, per database it can join.
//!
//! The enlisted pipeline ([`crate::enlisted`]) asks the store for the [`Enlist`] of the database
//! its transaction runs on (`Joinable::enlister`) and drives the request through it: the read
//! before any transaction, the transaction's start, the key's try-lock, the claim loop's writes
//! (the loop itself is [`crate::record::claim`]'s), the completion and the checks before the
//! commit. Another SQL store enlists by implementing [`Enlist`] for its database, with a field
//! and a constructor here and a [`Joinable`] impl; the pipeline does not change.

use std::fmt;
use std::marker::PhantomData;

/// What a store can join: the database transactions it can claim and record in, for enlisted
/// endpoints ([the contract](crate::design) §5). A store that can enlist answers one from
/// [`Store::enlisting`](super::Store::enlisting); a wrapper passes on the one of the store it
/// wraps. Only the crate's SQL stores make one today (PostgreSQL, MySQL/MariaDB and SQLite,
/// features `postgres`, `mysql`, `sqlite`).
#[derive(Clone, Copy)]
pub struct Enlisting<'a> {
    #[cfg(feature = "postgres")]
    postgres: Option<&'a dyn Enlist<sqlx::Postgres>>,
    #[cfg(feature = "mysql")]
    mysql: Option<&'a dyn Enlist<sqlx::MySql>>,
    #[cfg(feature = "sqlite")]
    sqlite: Option<&'a dyn Enlist<sqlx::Sqlite>>,
    _store: PhantomData<&'a ()>,
}

impl fmt::Debug for Enlisting<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut joins = f.debug_list();
        #[cfg(feature = "postgres")]
        if self.postgres.is_some() {
            joins.entry(&"postgres");
        }
        #[cfg(feature = "mysql")]
        if self.mysql.is_some() {
            joins.entry(&"mysql");
        }
        #[cfg(feature = "sqlite")]
        if self.sqlite.is_some() {
            joins.entry(&"sqlite");
        }
        joins.finish()
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<'a> Enlisting<'a> {
    /// Joins no database; the constructors below set the one a store joins.
    fn none() -> Self {
        Self {
            #[cfg(feature = "postgres")]
            postgres: None,
            #[cfg(feature = "mysql")]
            mysql: None,
            #[cfg(feature = "sqlite")]
            sqlite: None,
            _store: PhantomData,
        }
    }

    /// Joins PostgreSQL transactions.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(enlist: &'a dyn Enlist<sqlx::Postgres>) -> Self {
        Self {
            postgres: Some(enlist),
            ..Self::none()
        }
    }

    /// Joins MySQL / MariaDB transactions.
    #[cfg(feature = "mysql")]
    pub(crate) fn mysql(enlist: &'a dyn Enlist<sqlx::MySql>) -> Self {
        Self {
            mysql: Some(enlist),
            ..Self::none()
        }
    }

    /// Joins SQLite transactions.
    #[cfg(feature = "sqlite")]
    pub(crate) fn sqlite(enlist: &'a dyn Enlist<sqlx::Sqlite>) -> Self {
        Self {
            sqlite: Some(enlist),
            ..Self::none()
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use joins::{Enlist, Joinable};

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod joins {
    use std::time::Duration;

    use futures_util::future::BoxFuture;
    use sqlx::{Database, Transaction};

    use super::Enlisting;
    use crate::scope::ScopeHash;
    use crate::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, StoreError};

    /// What the read before an enlisted request's transaction found.
    #[derive(Debug)]
    pub enum Glanced {
        /// A completed, unexpired record: replay it (or refuse a different request).
        Completed {
            fingerprint: crate::fingerprint::Fingerprint,
            response: std::sync::Arc<RecordedResponse>,
        },
        /// Another transaction (on any replica) holds the key's try-lock: it is in progress.
        Held,
        /// Neither: begin the transaction and claim.
        Open,
    }

    /// A store's part in enlisted requests on database `DB`: each step the enlisted pipeline
    /// takes with the store, on the request's own transaction where it has one. Boxed futures:
    /// the pipeline holds it as `&dyn Enlist<DB>`, and a database round trip dwarfs the box.
    pub trait Enlist<DB: Database>: Send + Sync {
        /// One read before any transaction: a completed record of `req`'s key, or whether
        /// another transaction holds the key. It writes nothing.
        fn glance<'a>(
            &'a self,
            req: &'a ClaimRequest<'_>,
        ) -> BoxFuture<'a, Result<Glanced, StoreError>>;

        /// Opens the transaction an enlisted request runs in.
        fn begin(&self) -> BoxFuture<'_, Result<Transaction<'static, DB>, StoreError>>;

        /// Takes the key's transaction-scoped try-lock; `false` when another transaction holds
        /// it (the key is in progress).
        fn lock<'a>(
            &'a self,
            conn: &'a mut DB::Connection,
            req: &'a ClaimRequest<'_>,
        ) -> BoxFuture<'a, Result<bool, StoreError>>;

        /// [`Store::claim`](crate::store::Store::claim), inside the transaction on `conn`.
        fn claim<'a>(
            &'a self,
            conn: &'a mut DB::Connection,
            req: &'a ClaimRequest<'_>,
        ) -> BoxFuture<'a, Result<Claim, StoreError>>;

        /// [`Store::reclaim`](crate::store::Store::reclaim), inside the transaction on `conn`.
        fn reclaim<'a>(
            &'a self,
            conn: &'a mut DB::Connection,
            req: &'a ClaimRequest<'_>,
            stale: FencingToken,
        ) -> BoxFuture<'a, Result<Claim, StoreError>>;

        /// [`Store::complete`](crate::store::Store::complete), inside the transaction on `conn`.
        fn complete<'a>(
            &'a self,
            conn: &'a mut DB::Connection,
            scope: &'a ScopeHash,
            key: &'a str,
            token: FencingToken,
            response: &'a RecordedResponse,
            retention: Duration,
        ) -> BoxFuture<'a, Result<bool, StoreError>>;

        /// One statement on the open transaction, to learn whether it is still alive before
        /// the commit.
        fn probe<'a>(
            &'a self,
            conn: &'a mut DB::Connection,
        ) -> BoxFuture<'a, Result<(), StoreError>>;

        /// Ends a transaction that decided not to run (a replay, a refusal).
        fn rollback<'a>(
            &'a self,
            tx: Transaction<'static, DB>,
            route: &'a str,
        ) -> BoxFuture<'a, ()>;

        /// Whether a statement failed because its transaction was already aborted by an
        /// earlier error the handler swallowed.
        fn is_aborted(&self, error: &StoreError) -> bool;
    }

    /// A database enlisted requests can run on: where its [`Enlist`] sits in an [`Enlisting`].
    pub trait Joinable: Database {
        /// The database's name, for log lines and refusals.
        const LABEL: &'static str;
        /// The path of the crate's store that joins it, below `idempotent_runtime::`.
        const STORE: &'static str;

        fn enlister<'a>(enlisting: &Enlisting<'a>) -> Option<&'a dyn Enlist<Self>>;
    }

    #[cfg(feature = "postgres")]
    impl Joinable for sqlx::Postgres {
        const LABEL: &'static str = "PostgreSQL";
        const STORE: &'static str = "store::postgres::PostgresStore";

        fn enlister<'a>(enlisting: &Enlisting<'a>) -> Option<&'a dyn Enlist<Self>> {
            enlisting.postgres
        }
    }

    #[cfg(feature = "mysql")]
    impl Joinable for sqlx::MySql {
        const LABEL: &'static str = "MySQL/MariaDB";
        const STORE: &'static str = "store::mysql::MySqlStore";

        fn enlister<'a>(enlisting: &Enlisting<'a>) -> Option<&'a dyn Enlist<Self>> {
            enlisting.mysql
        }
    }

    #[cfg(feature = "sqlite")]
    impl Joinable for sqlx::Sqlite {
        const LABEL: &'static str = "SQLite";
        const STORE: &'static str = "store::sqlite::SqliteStore";

        fn enlister<'a>(enlisting: &Enlisting<'a>) -> Option<&'a dyn Enlist<Self>> {
            enlisting.sqlite
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use joins::Glanced;
