//! Enlisted mode ([the contract](crate::design) §5): the recorded response commits with the handler's own writes.
//!
//! In the default, detached mode the reservation commits before the handler runs, so a crash
//! between the handler's writes and the record leaves the writes without the record (and the
//! retry runs the handler again). With `#[idempotent(enlisted)]` the runtime claims the key
//! *inside* a database transaction and hands the handler that transaction as an
//! [`EnlistedTx`]; the handler writes through it and never commits. The runtime then records
//! the response in the same transaction and commits, and sends the response only once the
//! commit succeeded (503 `IDEMPOTENCY_STORE_UNAVAILABLE` otherwise):
//!
//! - a recordable final status ([the contract](crate::design) §3) → the response is recorded and everything commits;
//! - anything else (5xx, a non-replayable status), a handler that panics, a response that cannot
//!   be recorded (over `max_response`, a `content-encoding` that is not allowlisted) → the
//!   transaction rolls back: neither the business rows nor the record remain, and the retry
//!   runs. A response that cannot be recorded is answered 500 (its changes are gone, so its
//!   2xx would be a lie);
//! - a crash (process or connection killed) → the database rolls the transaction back: neither
//!   remains.
//!
//! A duplicate that arrives while the first request's transaction is open cannot see its
//! uncommitted reservation. It meets a try-lock on the key instead, and is answered 409
//! `IDEMPOTENCY_IN_PROGRESS` at once, whatever its body; it never waits on the first request's
//! row lock. Once the first request committed, its record replays as usual (and a different
//! body is 422).
//!
//! The database is the transaction type's parameter, [`Enlistable`]: `&mut EnlistedTx` is a
//! PostgreSQL transaction, `&mut EnlistedTx<sqlx::MySql>` a MySQL/MariaDB one,
//! `&mut EnlistedTx<sqlx::Sqlite>` a SQLite one. The store behind the
//! [`Idempotency`](crate::Idempotency) must enlist in that database
//! ([`Store::enlisting`](crate::store::Store::enlisting)): the
//! [`PostgresStore`](crate::store::postgres::PostgresStore) (a transaction-scoped advisory
//! try-lock), the [`MySqlStore`](crate::store::mysql::MySqlStore) (`GET_LOCK(…, 0)`, released as
//! the transaction's connection returns to its pool) or the
//! [`SqliteStore`](crate::store::sqlite::SqliteStore) (its single writer; enlisted requests run
//! one at a time), or a wrapper around one that forwards `enlisting`. With another store they
//! answer 500 and log how to fix it. The handler's statements run on one of the store's
//! connections, under its lock timeouts. A request without a key (where the key is optional)
//! runs in a transaction too, committed or rolled back by the same rule, with nothing recorded.
//! Enlisted mode always fails closed: without the store there is no transaction to run in.
//! There is no lease to renew: the reservation is invisible until it is complete, and the
//! try-lock lasts exactly as long as the transaction.
//!
//! Behind a connection pooler in transaction mode (a PostgreSQL store built with
//! [`transaction_pooler(true)`](crate::store::postgres::PostgresStoreBuilder::transaction_pooler)),
//! the handler's statements must be unnamed, `.persistent(false)` on each sqlx query: a named
//! one stays on the server connection after the transaction, and the next client lent that
//! connection fails with `prepared statement "sqlx_s_1" already exists`.
//!
//! ```no_run
//! # #[cfg(feature = "axum")] mod app {
//! use axum::{Json, http::StatusCode};
//! use idempotent_runtime::axum::idempotent;
//! use idempotent_runtime::enlisted::EnlistedTx;
//!
//! #[idempotent(require_key, enlisted)]
//! async fn create_order(
//!     tx: &mut EnlistedTx,
//!     Json(order): Json<serde_json::Value>,
//! ) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!         .bind(order.to_string())
//!         .execute(tx.conn())
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?; // 5xx: rolled back
//!     Ok(StatusCode::CREATED) // recorded and committed with the order
//! }
//! # }
//! ```

// The pipeline half is driven by the framework integrations only.
#![cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(feature = "postgres")]
use sqlx::Postgres;
use sqlx::{Database, Transaction};
use tokio::sync::oneshot;

use crate::config::Recording;
use crate::key::IdempotencyKey;
use crate::observe::{self, Event, KeyDisplay};
use crate::problem::{Problem, ProblemCode};
use crate::record::{self, ClaimOps, Verdict};
use crate::reservation::RunningGuard;
use crate::scope::ScopeHash;
use crate::store::{
    Backend, Claim, ClaimRequest, Enlist, FencingToken, Joinable, RecordedResponse, StoreError,
};

macro_rules! enlisted_tx {
    ($($default:tt)*) => {
        /// The transaction an enlisted handler writes through: take it as `tx: &mut EnlistedTx` on
        /// PostgreSQL (the default), `&mut EnlistedTx<MySql>` on MySQL/MariaDB, `&mut EnlistedTx<Sqlite>`
        /// on SQLite (`sqlx::{MySql, Sqlite}`), the database of the store behind the handle.
        ///
        /// It holds the request's reservation, and the runtime commits it (or rolls it back) after
        /// the handler returned, so nothing in its API commits: it gives the handler the connection
        /// ([`conn`](Self::conn), or `&mut **tx` through `DerefMut`), on which sqlx's own
        /// `Connection::begin` opens a savepoint, never a second transaction. (Sending a literal
        /// `COMMIT` statement through it would end the transaction early and break the guarantee;
        /// do not.)
        ///
        /// ```no_run
        /// use idempotent_runtime::enlisted::EnlistedTx;
        /// use sqlx::Connection as _;
        ///
        /// /// Called from an enlisted handler with its `tx`.
        /// async fn reserve_stock(tx: &mut EnlistedTx, sku: &str) -> Result<u64, sqlx::Error> {
        ///     // A savepoint inside the request's transaction: its rollback undoes this part only.
        ///     let mut savepoint = tx.conn().begin().await?;
        ///     let done = sqlx::query("UPDATE stock SET held = held + 1 WHERE sku = $1 AND held < total")
        ///         .bind(sku)
        ///         .execute(&mut *savepoint)
        ///         .await?;
        ///     savepoint.commit().await?; // releases the savepoint; the request commits later
        ///     Ok(done.rows_affected())
        /// }
        /// ```
        pub struct EnlistedTx<DB: Database $($default)*> {
            /// `None` only once the runtime took the transaction back, never while a handler
            /// has it.
            tx: Option<Transaction<'static, DB>>,
            /// Where a handler that panics (dropping this with its future) hands the
            /// transaction back, so the runtime rolls it back before it answers: the key's
            /// try-lock must be gone by the time the client can retry.
            back: Option<oneshot::Sender<Transaction<'static, DB>>>,
        }
    };
}

#[cfg(feature = "postgres")]
enlisted_tx!(= Postgres);
#[cfg(not(feature = "postgres"))]
enlisted_tx!();

const TAKEN: &str = "the enlisted transaction is held until the handler returns";

impl<DB: Database> EnlistedTx<DB> {
    pub(crate) fn new(tx: Transaction<'static, DB>) -> Self {
        Self {
            tx: Some(tx),
            back: None,
        }
    }

    /// The connection the transaction runs on, for sqlx's `execute`/`fetch_*`.
    pub fn conn(&mut self) -> &mut DB::Connection {
        self.tx.as_deref_mut().expect(TAKEN)
    }

    fn take(mut self) -> Transaction<'static, DB> {
        self.tx.take().expect(TAKEN)
    }
}

impl<DB: Database> Deref for EnlistedTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.tx.as_deref().expect(TAKEN)
    }
}

impl<DB: Database> DerefMut for EnlistedTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn()
    }
}

impl<DB: Database> Drop for EnlistedTx<DB> {
    fn drop(&mut self) {
        if let (Some(tx), Some(back)) = (self.tx.take(), self.back.take()) {
            // Nobody waiting: the transaction drops here, and sqlx rolls it back.
            let _ = back.send(tx);
        }
    }
}

impl<DB: Database> fmt::Debug for EnlistedTx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnlistedTx").finish_non_exhaustive()
    }
}

/// A database whose transactions an enlisted handler can run in: `sqlx::Postgres` (feature
/// `postgres`), `sqlx::MySql` (`mysql`), `sqlx::Sqlite` (`sqlite`). It is the parameter of
/// [`EnlistedTx`] and of the [adapter API](crate::adapter)'s enlisted entry points. Sealed: a
/// database is joined by its store, through [`Store::enlisting`](crate::store::Store::enlisting).
pub trait Enlistable: Joinable {}

impl<DB: Joinable> Enlistable for DB {}

/// The database of an enlisted handler's transaction type, for the attribute's expansion.
#[doc(hidden)]
pub trait TxDatabase {
    type Database: Enlistable;
}

impl<DB: Enlistable> TxDatabase for EnlistedTx<DB> {
    type Database = DB;
}

/// An open transaction (holding the key's reservation, when the request has a key) and what
/// settles it.
pub(crate) struct Held<DB: Database> {
    pub(crate) tx: EnlistedTx<DB>,
    pub(crate) settle: Settle<DB>,
}

/// Settles an enlisted request's transaction once the handler answered. Built by the
/// pipeline's enlisted claim (`pipeline::enlisted`), which decides what it holds.
pub(crate) struct Settle<DB: Database> {
    pub(crate) store: Backend,
    pub(crate) reserved: Option<Reserved>,
    pub(crate) retention: Duration,
    pub(crate) max_response: usize,
    pub(crate) recording: Recording,
    pub(crate) store_retry_after: Duration,
    pub(crate) route: Arc<str>,
    pub(crate) back: Back<DB>,
    pub(crate) _running: RunningGuard,
    /// Keeps the key in [`HeldKeys`] until the transaction ended (dropped after it, with this).
    pub(crate) _in_flight: Option<HeldKey>,
}

/// The receiving end of [`EnlistedTx`]'s hand-back, set when the transaction goes to the
/// handler.
pub(crate) type Back<DB> = Option<oneshot::Receiver<Transaction<'static, DB>>>;

/// The reservation a keyed enlisted request holds in its transaction.
pub(crate) struct Reserved {
    pub(crate) scope: ScopeHash,
    pub(crate) key: IdempotencyKey,
    pub(crate) token: FencingToken,
}

impl<DB: Database> fmt::Debug for Held<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("route", &self.settle.route)
            .finish_non_exhaustive()
    }
}

/// What the store behind a handle offers enlisted requests on database `DB`, if it can join
/// them ([`Store::enlisting`](crate::store::Store::enlisting): that database's store, or any
/// wrapper that forwards it).
pub(crate) fn enlister<DB: Joinable>(store: &Backend) -> Option<&dyn Enlist<DB>> {
    store.enlisting().and_then(|e| DB::enlister(&e))
}

/// The claim loop's writes, sent on an enlisted request's open transaction.
struct InTransaction<'a, DB: Database> {
    enlist: &'a dyn Enlist<DB>,
    conn: &'a mut DB::Connection,
}

impl<DB: Database> ClaimOps for InTransaction<'_, DB> {
    fn claim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        self.enlist.claim(self.conn, req)
    }

    fn reclaim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        self.enlist.reclaim(self.conn, req, stale)
    }
}

/// Claims `req` inside the open transaction on `conn`: the key's try-lock, then the record's
/// claim loop through the transaction. `None` when the try-lock is held by another transaction
/// (the key is in progress; this transaction holds nothing).
pub(crate) async fn claim_in<DB: Database>(
    enlist: &dyn Enlist<DB>,
    conn: &mut DB::Connection,
    req: &ClaimRequest<'_>,
    same_request: impl Fn(&crate::fingerprint::Fingerprint) -> bool,
) -> Result<Option<Verdict>, StoreError> {
    if !enlist.lock(conn, req).await? {
        // Another request's transaction holds this key: its reservation is not visible yet,
        // so the only honest answer is "in progress", whatever this request's body.
        return Ok(None);
    }
    record::claim(InTransaction { enlist, conn }, req, same_request)
        .await
        .map(Some)
}

/// The refusal when the store cannot enlist in `DB`'s transactions: a setup mistake, logged
/// with its fix.
pub(crate) fn not_enlistable<DB: Joinable>(route: &str) -> Problem {
    tracing::error!(
        route,
        database = DB::LABEL,
        "#[idempotent(enlisted)] needs a store that can enlist in a {} transaction (the handler's \
         `EnlistedTx` names that database): build the Idempotency over \
         idempotent_runtime::{} (a wrapper around it forwards Store::enlisting), or remove \
         `enlisted` to run this handler in detached mode",
        DB::LABEL,
        DB::STORE,
    );
    Problem::new(
        500,
        ProblemCode::StoreNotEnlistable,
        format!(
            "this endpoint needs a {} idempotency store, and none is configured",
            DB::LABEL
        ),
    )
}

/// The `(scope, key)`s held by this process's enlisted requests, from before their transaction
/// begins until it ended: a duplicate of one is in progress, known without the database (whose
/// pool the running requests may all hold).
#[derive(Debug, Default)]
pub(crate) struct HeldKeys(Arc<Mutex<HashSet<InFlightKey>>>);

type InFlightKey = (ScopeHash, Box<str>);

impl HeldKeys {
    pub(crate) fn contains(&self, scope: &ScopeHash, key: &str) -> bool {
        let set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        set.contains(&(*scope, Box::from(key)))
    }

    /// Marks the key held until the guard drops; `None` if it already is.
    pub(crate) fn enter(&self, scope: &ScopeHash, key: &str) -> Option<HeldKey> {
        let entry = Box::new((*scope, Box::from(key)));
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        set.insert((*entry).clone()).then(|| HeldKey {
            set: Arc::clone(&self.0),
            entry,
        })
    }
}

/// Holds a key in [`HeldKeys`]; dropped once the request's transaction ended.
pub(crate) struct HeldKey {
    set: Arc<Mutex<HashSet<InFlightKey>>>,
    // Boxed: it travels in every enlisted request's `Settle`, which stays small.
    entry: Box<InFlightKey>,
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        let mut set = self.set.lock().unwrap_or_else(|p| p.into_inner());
        set.remove(&*self.entry);
    }
}

impl<DB: Joinable> Settle<DB> {
    /// Whether the request holds a reservation (it had a key).
    pub(crate) fn is_keyed(&self) -> bool {
        self.reserved.is_some()
    }

    /// The endpoint's rules for what is recorded.
    pub(crate) fn recording(&self) -> Recording {
        self.recording.clone()
    }

    /// The matched route, for log lines.
    pub(crate) fn route(&self) -> &str {
        &self.route
    }

    /// The recorded-response cap in force.
    pub(crate) fn max_response(&self) -> usize {
        self.max_response
    }

    /// Records `response` in the transaction (`None` for a request without a key) and commits
    /// it. `Err` is the 503 to answer instead of the response: the commit did not happen (or
    /// its outcome is unknown; a retry then replays or runs).
    pub(crate) async fn commit(
        self,
        tx: EnlistedTx<DB>,
        response: Option<&RecordedResponse>,
    ) -> Result<(), Problem> {
        let mut tx = tx.take();
        let route = Arc::clone(&self.route);
        let failed = |what: &str, error: &dyn fmt::Display, key: Option<&str>| {
            observe::count(Event::StoreError, &route);
            observe::count(Event::NotRecorded, &route);
            tracing::warn!(
                route = %route,
                key_hash = %KeyDisplay(key.unwrap_or("")),
                %error,
                "enlisted request not committed ({what}); the response is withheld and 503 sent"
            );
            Problem::new(
                503,
                ProblemCode::StoreUnavailable,
                "the request's changes could not be committed; retry with the same Idempotency-Key",
            )
            .with_retry_after(record::ceil_secs(self.store_retry_after).max(1))
        };
        debug_assert!(
            self.reserved.is_none() || response.is_some(),
            "a reservation commits only with its response"
        );
        let key = self.reserved.as_ref().map(|r| r.key.as_str());
        let db =
            enlister::<DB>(&self.store).expect("a held transaction comes from an enlisting store");
        // A handler that swallowed a database error leaves the transaction aborted, and its
        // COMMIT would silently roll back: every statement sent now fails with 25P02 instead,
        // so it is caught before the commit (the completion is that statement for a keyed
        // request; a keyless one sends a probe).
        let aborted = |tx: Transaction<'static, DB>| async {
            let _ = tx.rollback().await;
            Err(aborted_transaction(&route, key))
        };
        if self.reserved.is_none()
            && let Err(error) = db.probe(&mut tx).await
        {
            if db.is_aborted(&error) {
                return aborted(tx).await;
            }
            return Err(failed("the transaction could not be checked", &error, key));
        }
        if let (Some(reserved), Some(response)) = (&self.reserved, response) {
            let completed = db
                .complete(
                    &mut tx,
                    &reserved.scope,
                    reserved.key.as_str(),
                    reserved.token,
                    response,
                    self.retention,
                )
                .await;
            match completed {
                Ok(true) => {}
                Ok(false) => return Err(failed("the reservation was gone", &"fenced", key)),
                Err(error) if db.is_aborted(&error) => return aborted(tx).await,
                Err(error) => return Err(failed("recording failed", &error, key)),
            }
        }
        match tx.commit().await {
            Ok(()) => Ok(()),
            Err(error) => Err(failed("the commit failed", &error, key)),
        }
    }

    /// Rolls the transaction back: the handler's writes and the reservation are gone, and the
    /// key is free for the retry.
    pub(crate) async fn rollback(self, tx: EnlistedTx<DB>, why: &str) {
        if self.reserved.is_some() {
            observe::count(Event::NotRecorded, &self.route);
        }
        tracing::debug!(route = %self.route, why, "enlisted request rolled back");
        if let Err(error) = tx.take().rollback().await {
            // The connection is gone or broken: PostgreSQL rolls the transaction back itself.
            tracing::warn!(route = %self.route, %error, "enlisted rollback failed; the server discards the transaction");
        }
    }

    /// Hands the transaction to the handler: if the handler drops it (a panic unwinding its
    /// future), it comes back to [`panicked`](Self::panicked).
    pub(crate) fn hand_out(&mut self, mut tx: EnlistedTx<DB>) -> EnlistedTx<DB> {
        let (back, receive) = oneshot::channel();
        tx.back = Some(back);
        self.back = Some(receive);
        tx
    }

    /// After a panic, once the handler's future (and the transaction in it) was dropped: rolls
    /// the transaction back before the 500 is answered.
    pub(crate) async fn panicked(mut self) {
        if self.reserved.is_some() {
            observe::count(Event::NotRecorded, &self.route);
        }
        if let Some(receive) = self.back.take()
            && let Ok(tx) = receive.await
            && let Err(error) = tx.rollback().await
        {
            tracing::warn!(route = %self.route, %error, "enlisted rollback after a panic failed; the server discards the transaction");
        }
    }
}

/// The answer when the handler's transaction was aborted by a database error it swallowed:
/// nothing it wrote remains and nothing was recorded, so its own (2xx) answer would be a lie.
fn aborted_transaction(route: &str, key: Option<&str>) -> Problem {
    observe::count(Event::NotRecorded, route);
    tracing::error!(
        route,
        key_hash = %KeyDisplay(key.unwrap_or("")),
        "enlisted handler answered after a database error aborted its transaction (it swallowed \
         the error): the transaction rolled back, nothing was recorded, and 500 is sent; return \
         the error (a 5xx) instead of answering success"
    );
    Problem::new(
        500,
        ProblemCode::NotRecorded,
        "the request's changes were rolled back after a database error; it may be retried with \
         the same Idempotency-Key",
    )
}

/// The answer when an enlisted response cannot be recorded (too large, a `content-encoding`
/// that is not allowlisted): its changes were rolled back, so its own status would mislead.
pub(crate) fn not_recordable(route: &str) -> Problem {
    tracing::error!(
        route,
        "enlisted response could not be recorded (over max_response, a stream past it, or a \
         content-encoding that is not allowlisted): its changes were rolled back and 500 sent; \
         raise max_response or allowlist the header"
    );
    Problem::new(
        500,
        ProblemCode::NotRecorded,
        "the response could not be recorded, so the request's changes were rolled back; it may \
         be retried with the same Idempotency-Key",
    )
}
