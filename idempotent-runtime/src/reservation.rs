//! A held key while its handler runs ([the contract](crate::design) §3): the lease renewed every third of it, and
//! the fenced completion or release that settles it. Also the count of claimed handlers that
//! graceful shutdown waits for.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Notify;

use crate::config::Recording;
use crate::key::IdempotencyKey;
use crate::observe::{self, Event, KeyDisplay};
use crate::scope::ScopeHash;
use crate::store::{FencingToken, RecordedResponse, Store};

/// A held key: run the handler through [`Reservation::run`], then [`complete`](Self::complete)
/// or [`release`](Self::release) it. Dropped unsettled (a panic, a cancelled task), it releases
/// the key in the background.
#[derive(Debug)]
pub struct Reservation {
    guard: Option<Guard>,
    lease: Duration,
    retention: Duration,
    max_response: usize,
    recording: Recording,
    route: Arc<str>,
    _running: RunningGuard,
}

#[derive(Debug)]
struct Guard {
    store: Arc<dyn Store>,
    scope: ScopeHash,
    key: IdempotencyKey,
    token: FencingToken,
    armed: bool,
}

impl Guard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, scope, key, token) = (
            Arc::clone(&self.store),
            self.scope,
            self.key.clone(),
            self.token,
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.release(&scope, key.as_str(), token).await;
            });
        }
    }
}

/// How a claimed handler ended.
pub enum Outcome<T> {
    /// It returned.
    Returned(T),
    /// It panicked; the key has been released.
    Panicked,
}

impl Reservation {
    /// A reservation held in `store` by `token`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn held(
        store: Arc<dyn Store>,
        scope: ScopeHash,
        key: IdempotencyKey,
        token: FencingToken,
        lease: Duration,
        retention: Duration,
        max_response: usize,
        route: &str,
        running: RunningGuard,
    ) -> Self {
        Self {
            guard: Some(Guard {
                store,
                scope,
                key,
                token,
                armed: true,
            }),
            lease,
            retention,
            max_response,
            recording: Recording::default(),
            route: route.into(),
            _running: running,
        }
    }

    /// The endpoint's own rules for what is recorded.
    pub(crate) fn with_recording(mut self, recording: Recording) -> Self {
        self.recording = recording;
        self
    }

    /// The endpoint's rules for what is recorded.
    pub fn recording(&self) -> &Recording {
        &self.recording
    }

    /// A handler running unprotected (failing open while the store is down): nothing is held,
    /// recorded or released.
    pub(crate) fn unguarded(route: &str, running: RunningGuard) -> Self {
        Self {
            guard: None,
            lease: Duration::ZERO,
            retention: Duration::ZERO,
            max_response: 0,
            recording: Recording::default(),
            route: route.into(),
            _running: running,
        }
    }

    /// The recorded-response cap in force (0 when running unprotected: nothing is recorded).
    pub fn max_response(&self) -> usize {
        if self.guard.is_some() {
            self.max_response
        } else {
            0
        }
    }

    /// Whether a store backs this reservation (false when failing open).
    pub fn is_guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// Runs the claimed handler to its end while renewing the lease every third of it. A panic
    /// is caught and the key released before this returns.
    pub async fn run<F: Future>(&mut self, handler: F) -> Outcome<F::Output> {
        let Some(guard) = &self.guard else {
            return match AssertUnwindSafe(handler).catch_unwind().await {
                Ok(v) => Outcome::Returned(v),
                Err(_) => Outcome::Panicked,
            };
        };
        let handler = AssertUnwindSafe(handler).catch_unwind();
        let renew = renew_forever(guard, self.lease, &self.route);
        let result = tokio::select! {
            biased;
            result = handler => result,
            never = renew => match never {},
        };
        match result {
            Ok(v) => Outcome::Returned(v),
            Err(_) => {
                self.release_now().await;
                Outcome::Panicked
            }
        }
    }

    /// Records the response for replay. A failed or fenced write is logged and counted; the
    /// response is still sent and the reservation lapses with its lease.
    pub async fn complete(mut self, response: &RecordedResponse) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let complete = guard.store.complete(
            &guard.scope,
            guard.key.as_str(),
            guard.token,
            response,
            self.retention,
        );
        let result = observe::timed("complete", guard.store.kind(), complete).await;
        match result {
            Ok(true) => {}
            Ok(false) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::LeaseLost, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    "response not recorded: the lease was lost to another request"
                );
            }
            Err(error) => {
                observe::count(Event::NotRecorded, &self.route);
                observe::count(Event::StoreError, &self.route);
                tracing::warn!(
                    route = %self.route,
                    key_hash = %KeyDisplay(guard.key.as_str()),
                    %error,
                    "response not recorded: the reservation stands until its lease lapses"
                );
            }
        }
        // Settled: the guard must not release what was just completed.
        guard.disarm();
    }

    /// Frees the key without recording (5xx, non-replayable, too large).
    pub async fn release(mut self) {
        observe::count(Event::NotRecorded, &self.route);
        self.release_now().await;
    }

    async fn release_now(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let release = guard
            .store
            .release(&guard.scope, guard.key.as_str(), guard.token);
        if let Err(error) = observe::timed("release", guard.store.kind(), release).await {
            tracing::warn!(
                route = %self.route,
                key_hash = %KeyDisplay(guard.key.as_str()),
                %error,
                "could not release the key; it frees itself when its lease lapses"
            );
        }
        guard.disarm();
    }
}

async fn renew_forever(guard: &Guard, lease: Duration, route: &str) -> std::convert::Infallible {
    let period = lease / 3;
    let mut last_kept = tokio::time::Instant::now();
    let mut lost = false;
    loop {
        tokio::time::sleep(period).await;
        if lost {
            continue;
        }
        let renew = guard
            .store
            .renew(&guard.scope, guard.key.as_str(), guard.token, lease);
        match observe::timed("renew", guard.store.kind(), renew).await {
            Ok(true) => last_kept = tokio::time::Instant::now(),
            Ok(false) => lost = true,
            Err(error) => {
                tracing::warn!(route, %error, "lease renewal failed; retrying next tick");
                lost = last_kept.elapsed() >= lease;
            }
        }
        if lost {
            observe::count(Event::LeaseLost, route);
            tracing::error!(
                route,
                key_hash = %KeyDisplay(guard.key.as_str()),
                "lease lost while the handler runs: a duplicate may run concurrently"
            );
        }
    }
}

/// Counts claimed handlers so shutdown can wait for them.
#[derive(Default)]
pub(crate) struct Running {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Running {
    pub(crate) fn enter(&self) -> RunningGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        RunningGuard {
            count: Arc::clone(&self.count),
            idle: Arc::clone(&self.idle),
        }
    }

    /// Claimed handlers running now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[derive(Debug)]
pub(crate) struct RunningGuard {
    count: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }
}
