//! The SQLite side of enlisted mode ([the contract](crate::design) §5): the reservation is
//! written in the transaction the handler then writes through, and completed in it before the
//! commit.
//!
//! SQLite has one writer, and the store one writer connection: an enlisted transaction is that
//! connection's, from `BEGIN IMMEDIATE` (the write lock taken at once, so no statement of the
//! handler can meet `SQLITE_BUSY` halfway) to its commit or rollback. So enlisted requests run
//! one at a time, and every other write of the store (claims of detached endpoints, the
//! sweeper) waits for the running one, up to the store's acquire timeout. The key's try-lock
//! is the handle's own set of held keys, checked before the transaction begins: a duplicate in
//! this process is 409 at once and never waits for the writer. (The store is one process's, as
//! SQLite's file lock makes it; a second process would wait on that lock for `busy_timeout`.)
//! A replay is one read on the readers before any transaction, while the writer is busy too.
//!
//! A statement SQLite answers with an error that ends the transaction (a full disk, say)
//! leaves the handler outside it: a keyed request then finds its reservation gone at the
//! completion, and any request's COMMIT fails; both are answered 503, nothing recorded.

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::sqlite::{Sqlite, SqliteConnection};
use sqlx::{Executor as _, Transaction};

use super::{MAX_RERUNS, SqliteStore, still_running, unavailable};
use crate::scope::ScopeHash;
use crate::store::{
    Claim, ClaimRequest, Enlist, FencingToken, Glanced, RecordedResponse, StandingState, StoreError,
};

impl SqliteStore {
    /// [`Store::claim`](crate::store::Store::claim) inside the transaction on `conn`.
    async fn enlisted_claim(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        for _ in 0..MAX_RERUNS {
            if let Some(standing) = self.read(&mut *conn, req.scope, req.key).await? {
                return Ok(Claim::Standing(standing));
            }
            if self.insert(&mut *conn, req).await? {
                return Ok(Claim::Acquired);
            }
        }
        Ok(still_running(req))
    }

    /// [`Store::reclaim`](crate::store::Store::reclaim) inside the transaction on `conn`.
    async fn enlisted_reclaim(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        if self.takeover(&mut *conn, req, stale).await? {
            return Ok(Claim::Acquired);
        }
        match self.read(&mut *conn, req.scope, req.key).await? {
            Some(standing) => Ok(Claim::Standing(standing)),
            // Released or swept in between: claim it afresh.
            None => self.enlisted_claim(conn, req).await,
        }
    }
}

/// The SQLite store's part in enlisted requests.
impl Enlist<Sqlite> for SqliteStore {
    /// The completed record, read on the readers; SQLite has no other process's transaction to
    /// find (the handle's held keys answer for this one's).
    fn glance<'a>(
        &'a self,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Glanced, StoreError>> {
        Box::pin(async move {
            let standing = self.read(&self.readers, req.scope, req.key).await?;
            Ok(match standing {
                Some(standing) => match standing.state {
                    StandingState::Completed(response) => Glanced::Completed {
                        fingerprint: standing.fingerprint,
                        response,
                    },
                    _ => Glanced::Open,
                },
                None => Glanced::Open,
            })
        })
    }

    fn begin(&self) -> BoxFuture<'_, Result<Transaction<'static, Sqlite>, StoreError>> {
        Box::pin(async move {
            self.count();
            self.writer
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(unavailable)
        })
    }

    /// The writer's transaction is the only one: holding it is holding every key.
    fn lock<'a>(
        &'a self,
        _conn: &'a mut SqliteConnection,
        _req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async { Ok(true) })
    }

    fn claim<'a>(
        &'a self,
        conn: &'a mut SqliteConnection,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.enlisted_claim(conn, req))
    }

    fn reclaim<'a>(
        &'a self,
        conn: &'a mut SqliteConnection,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.enlisted_reclaim(conn, req, stale))
    }

    fn complete<'a>(
        &'a self,
        conn: &'a mut SqliteConnection,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.complete_on(conn, scope, key, token, response, retention))
    }

    fn probe<'a>(
        &'a self,
        conn: &'a mut SqliteConnection,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.count();
            conn.execute("SELECT 1").await.map_err(unavailable)?;
            Ok(())
        })
    }

    fn rollback<'a>(
        &'a self,
        tx: Transaction<'static, Sqlite>,
        route: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.count();
            if let Err(error) = tx.rollback().await {
                tracing::debug!(route, %error, "enlisted rollback before answering failed");
            }
        })
    }

    /// SQLite has no aborted-transaction state to find before the commit (see the module's
    /// docs for what ends a transaction early).
    fn is_aborted(&self, _error: &StoreError) -> bool {
        false
    }
}
