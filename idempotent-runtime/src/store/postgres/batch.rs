//! Group commit ([the contract](crate::design) §5): claims and completions that arrive while a
//! statement is in flight wait for the next one and go out together, as one statement (a round),
//! one transaction, one WAL flush.
//!
//! A [`Batcher`] keeps at most `in_flight` statements out at once. A request that finds fewer out
//! sends at once, so an idle pool adds no wait; a request that finds them all out queues, and the
//! next statement to go carries every queued row (up to `rows`), in the order [`Job::order`]
//! gives, the order that keeps two statements from waiting on each other in a cycle. Each row is
//! answered on its own. A batch of one goes out as the single-row statement. A failure
//! PostgreSQL reports for the whole statement (a lock timeout on one row, a deadlock, a
//! constraint) is retried row by row, so one bad row never fails its neighbours; a failure of the
//! connection itself, or a statement cancelled by `statement_timeout`, is answered to every row,
//! since each alone would meet it too.
//!
//! Every statement runs in a task of its own, never in the future of the request waiting for it:
//! a request whose future is dropped (its client gone, the server shutting down) stops waiting,
//! but its statement runs on and commits, and only this side hears what it did. An answer that
//! finds nobody waiting goes to [`Job::unheard`], which undoes what no request is left to own (a
//! claim that acquired is released under its own token). A release from the request's side
//! could not do that: sent while the statement is in flight, it runs beside it and cannot see the
//! row it is about to commit.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;
use tokio::sync::oneshot;

use super::super::StoreError;
use super::{Core, connection_dropped, unavailable};

/// SQLSTATE `query_canceled`: `statement_timeout` elapsed (or the statement was cancelled).
const QUERY_CANCELED: &str = "57014";

/// How rows are sent alone and together.
pub(super) trait Job: Send + Sync + 'static {
    /// One request's row, owned: it waits in the queue beyond the request's borrow.
    type Row: Send + Sync + 'static;
    /// One row's answer.
    type Out: Send + 'static;

    /// The order rows go out in (claims, then completions, each by `(scope, key)`).
    fn order(a: &Self::Row, b: &Self::Row) -> std::cmp::Ordering;

    /// Sends `rows` (at least two, sorted) as one statement; one answer per row, in order.
    #[allow(clippy::type_complexity)]
    fn many(
        core: &Core,
        rows: &[Self::Row],
    ) -> impl Future<Output = Result<Vec<Result<Self::Out, StoreError>>, sqlx::Error>> + Send;

    /// Sends one row alone, with its own error handling: a batch of one, or each row of a
    /// batch whose statement PostgreSQL refused as a whole.
    fn one(
        core: &Core,
        row: &Self::Row,
    ) -> impl Future<Output = Result<Self::Out, StoreError>> + Send;

    /// What undoes `row`'s effect when its answer `out` found nobody waiting (the request's
    /// future was dropped while the row was in flight), or `None` when nothing needs undoing.
    fn unheard(
        core: Arc<Core>,
        row: Self::Row,
        out: Result<Self::Out, StoreError>,
    ) -> Option<impl Future<Output = ()> + Send + 'static>;
}

/// Answers one row, or hands its outcome to [`Job::unheard`] when its request is gone.
fn deliver<J: Job>(
    core: &Arc<Core>,
    row: J::Row,
    answer: oneshot::Sender<Result<J::Out, StoreError>>,
    out: Result<J::Out, StoreError>,
) {
    if let Err(out) = answer.send(out)
        && let Some(undo) = J::unheard(Arc::clone(core), row, out)
    {
        tokio::spawn(undo);
    }
}

/// A row's answer from the task sending it, which may have ended without one (a panic).
fn answered<O>(
    answer: Result<Result<O, StoreError>, oneshot::error::RecvError>,
) -> Result<O, StoreError> {
    answer.unwrap_or_else(|_| {
        Err(StoreError::unavailable(
            "the task sending the statement ended",
        ))
    })
}

/// Sends one row alone from a task of its own (see the module docs) and waits for its answer.
async fn alone<J: Job>(core: &Arc<Core>, row: J::Row) -> Result<J::Out, StoreError> {
    let (answer, answer_rx) = oneshot::channel();
    let core = Arc::clone(core);
    tokio::spawn(async move {
        let out = J::one(&core, &row).await;
        deliver::<J>(&core, row, answer, out);
    });
    answered(answer_rx.await)
}

/// How large and how many batches may be out at once.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Rows per statement (1: every request alone, no batching).
    pub(super) rows: usize,
    /// Statements in flight at once.
    pub(super) in_flight: usize,
}

struct Waiter<J: Job> {
    row: J::Row,
    answer: oneshot::Sender<Result<J::Out, StoreError>>,
}

struct Queue<J: Job> {
    waiting: Vec<Waiter<J>>,
    in_flight: usize,
    /// When a statement last started or came back.
    progress: Instant,
}

/// How long statements may be out without one coming back before another may start beside
/// them: a statement waiting on a lock (another transaction's uncommitted row, up to
/// `lock_timeout`) must not hold every other request in the queue.
const STALL: Duration = Duration::from_millis(20);

/// Statements started beside stalled ones, at most, on top of [`Limits::in_flight`].
const STALLED_EXTRA: usize = 3;

/// The queue of rows waiting to go out (see the module docs).
pub(super) struct Batcher<J: Job> {
    core: Arc<Core>,
    limits: Limits,
    queue: Mutex<Queue<J>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<J: Job> Batcher<J> {
    pub(super) fn new(core: Arc<Core>, limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            core,
            limits: Limits {
                rows: limits.rows.max(1),
                in_flight: limits.in_flight.max(1),
            },
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                in_flight: 0,
                progress: Instant::now(),
            }),
        })
    }

    /// Sends `row`, alone or with others, and answers it.
    pub(super) async fn submit(self: &Arc<Self>, row: J::Row) -> Result<J::Out, StoreError> {
        if self.limits.rows == 1 {
            return alone::<J>(&self.core, row).await;
        }
        let (answer, mut answer_rx) = oneshot::channel();
        {
            let mut queue = lock(&self.queue);
            queue.waiting.push(Waiter { row, answer });
            self.start_if_due(&mut queue);
        }
        loop {
            match tokio::time::timeout(STALL, &mut answer_rx).await {
                Ok(answer) => return answered(answer),
                // Still queued: the statements out may be stalled.
                Err(_) => self.start_if_due(&mut lock(&self.queue)),
            }
        }
    }

    /// Starts another statement when rows wait and fewer than `in_flight` are out, or when
    /// those out have all been stalled for [`STALL`].
    fn start_if_due(self: &Arc<Self>, queue: &mut Queue<J>) {
        let due = !queue.waiting.is_empty()
            && (queue.in_flight < self.limits.in_flight
                || (queue.in_flight < self.limits.in_flight + STALLED_EXTRA
                    && queue.progress.elapsed() >= STALL));
        if due {
            queue.in_flight += 1;
            queue.progress = Instant::now();
            // Its own task: a request that gives up waiting (a client gone) must not take the
            // statement that carries its neighbours' rows with it.
            tokio::spawn(Arc::clone(self).drain());
        }
    }

    /// Sends queued rows, a batch at a time, until none is left.
    async fn drain(self: Arc<Self>) {
        loop {
            // Requests woken together (by the answer to one claim batch, say) reach their next
            // statement one after another; the first one's would otherwise go out alone, with
            // the rest queued behind it for a whole round trip. Yielding once lets those already
            // runnable join the batch; with nothing else to run it returns at once, so an idle
            // pool still adds no wait.
            tokio::task::yield_now().await;
            let batch = {
                let mut queue = lock(&self.queue);
                // Rows whose request is gone are not sent: nobody would release what they
                // claimed.
                queue.waiting.retain(|w| !w.answer.is_closed());
                if queue.waiting.is_empty() {
                    queue.in_flight -= 1;
                    return;
                }
                let n = queue.waiting.len().min(self.limits.rows);
                queue.waiting.drain(..n).collect::<Vec<_>>()
            };
            // A panic while sending drops this batch's answers (its requests fail as the store
            // being unavailable would) but never the queue's capacity: the loop goes on.
            if AssertUnwindSafe(self.send(batch))
                .catch_unwind()
                .await
                .is_err()
            {
                tracing::error!("a batch statement panicked; its requests were answered 503");
            }
            lock(&self.queue).progress = Instant::now();
        }
    }

    async fn send(&self, mut batch: Vec<Waiter<J>>) {
        let core = &self.core;
        if batch.len() == 1 {
            let Waiter { row, answer } = batch.pop().expect("one row");
            let out = J::one(core, &row).await;
            deliver::<J>(core, row, answer, out);
            return;
        }
        batch.sort_by(|a, b| J::order(&a.row, &b.row));
        let (rows, answers): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|w| (w.row, w.answer)).unzip();
        match self.many(&rows).await {
            Ok(outs) if outs.len() == rows.len() => {
                for ((row, answer), out) in rows.into_iter().zip(answers).zip(outs) {
                    deliver::<J>(core, row, answer, out);
                }
            }
            Ok(outs) => {
                let e = StoreError::unavailable(format!(
                    "a batch of {} rows was answered with {}",
                    rows.len(),
                    outs.len()
                ));
                tracing::error!(error = %e, "batch statement");
                self.one_by_one(rows, answers);
            }
            // A statement cancelled for its time (`statement_timeout`) changed nothing; each row
            // alone would wait as long again.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() != Some(QUERY_CANCELED) => {
                tracing::debug!(error = %e, rows = rows.len(), "batch refused; sending each row alone");
                self.one_by_one(rows, answers);
            }
            Err(e) => {
                let message = e.to_string();
                let mut error = Some(unavailable(e));
                for (row, answer) in rows.into_iter().zip(answers) {
                    let e = error
                        .take()
                        .unwrap_or_else(|| StoreError::unavailable(message.clone()));
                    deliver::<J>(core, row, answer, Err(e));
                }
            }
        }
    }

    /// The batch statement, sent again when the connection it went out on was already dead (a
    /// restart or `pg_terminate_backend` leaves such connections in the pool). Every statement
    /// batched here is safe to send twice: claims read back their own token, completions are
    /// conditional on it.
    #[allow(clippy::type_complexity)]
    async fn many(&self, rows: &[J::Row]) -> Result<Vec<Result<J::Out, StoreError>>, sqlx::Error> {
        let mut attempts_left = self.core.pool.options().get_max_connections();
        loop {
            self.core.count();
            match J::many(&self.core, rows).await {
                Err(e) if attempts_left > 0 && connection_dropped(&e) => attempts_left -= 1,
                done => return done,
            }
        }
    }

    /// Sends each row of a refused batch alone, each in its own task, so that a row waiting on
    /// a lock holds neither its neighbours nor the queue.
    fn one_by_one(
        &self,
        rows: Vec<J::Row>,
        answers: Vec<oneshot::Sender<Result<J::Out, StoreError>>>,
    ) {
        for (row, answer) in rows.into_iter().zip(answers) {
            let core = Arc::clone(&self.core);
            tokio::spawn(async move {
                // A request already gone when its row's turn came sends nothing.
                if !answer.is_closed() {
                    let out = J::one(&core, &row).await;
                    deliver::<J>(&core, row, answer, out);
                }
            });
        }
    }
}
