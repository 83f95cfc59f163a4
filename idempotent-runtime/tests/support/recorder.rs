//! The outbox tests' publisher (`outbox_postgres.rs`, `outbox_mysql.rs`, included by path): it
//! records every publish and checks the relay's promises as they happen.

// Each including test uses part of this.
#![allow(dead_code)]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::outbox::{Delivery, PublishError, Publisher};

pub type Verdict = Box<dyn Fn(&Delivery) -> Option<PublishError> + Send + Sync>;

/// Records every publish and checks the relay's promises as they happen.
pub struct Recorder {
    /// Publishes running now, by message id and by ordering key.
    pub running: Mutex<(HashMap<String, usize>, HashMap<String, usize>)>,
    /// Times a publish started while another of the same message or key was running.
    pub overlaps: AtomicUsize,
    /// Every publish started: (id, attempt).
    pub started: Mutex<Vec<(String, u32)>>,
    /// Successful publishes in the order they finished: (id, ordering key).
    pub delivered: Mutex<Vec<(String, Option<String>)>>,
    /// The longest a publish sleeps, in milliseconds.
    pub max_delay_ms: u64,
    /// Whether (and how) a publish fails.
    pub verdict: Verdict,
    /// If set, publishes wait here (in flight) until [`Recorder::open`].
    pub gate: Option<tokio::sync::Semaphore>,
}

impl Recorder {
    pub fn new(max_delay_ms: u64, verdict: Verdict) -> Arc<Self> {
        Arc::new(Self {
            running: Mutex::default(),
            overlaps: AtomicUsize::new(0),
            started: Mutex::default(),
            delivered: Mutex::default(),
            max_delay_ms,
            verdict,
            gate: None,
        })
    }

    pub fn ok() -> Arc<Self> {
        Self::new(0, Box::new(|_| None))
    }

    /// Succeeds, but each publish stays in flight until [`open`](Self::open).
    pub fn gated() -> Arc<Self> {
        Arc::new(Self {
            running: Mutex::default(),
            overlaps: AtomicUsize::new(0),
            started: Mutex::default(),
            delivered: Mutex::default(),
            max_delay_ms: 0,
            verdict: Box::new(|_| None),
            gate: Some(tokio::sync::Semaphore::new(0)),
        })
    }

    /// Lets held and later publishes finish.
    pub fn open(&self) {
        if let Some(gate) = &self.gate {
            gate.add_permits(1);
        }
    }

    pub fn started_ids(&self) -> Vec<String> {
        let started = self.started.lock().unwrap();
        started.iter().map(|(id, _)| id.clone()).collect()
    }

    /// Delivered ids in the order they were delivered.
    pub fn delivered_in_order(&self) -> Vec<String> {
        let delivered = self.delivered.lock().unwrap();
        delivered.iter().map(|(id, _)| id.clone()).collect()
    }

    /// Delivered ids, sorted.
    pub fn delivered_ids(&self) -> Vec<String> {
        let mut ids = self.delivered_in_order();
        ids.sort();
        ids
    }

    pub fn starts(&self) -> usize {
        self.started.lock().unwrap().len()
    }
}

pub fn random_below(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
        % n
}

impl Publisher for Recorder {
    async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
        let key = d.ordering_key().map(str::to_owned);
        {
            let mut running = self.running.lock().unwrap();
            let by_id = running.0.entry(d.id().to_owned()).or_default();
            *by_id += 1;
            let mut overlap = *by_id > 1;
            if let Some(key) = &key {
                let by_key = running.1.entry(key.clone()).or_default();
                *by_key += 1;
                overlap |= *by_key > 1;
            }
            if overlap {
                self.overlaps.fetch_add(1, Ordering::SeqCst);
            }
            self.started
                .lock()
                .unwrap()
                .push((d.id().to_owned(), d.attempt()));
        }
        /// Leaves the running sets when the publish ends, also when the relay drops it.
        struct Leave<'a>(&'a Recorder, String, Option<String>);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                let mut running = self.0.running.lock().unwrap();
                *running.0.get_mut(&self.1).unwrap() -= 1;
                if let Some(key) = &self.2 {
                    *running.1.get_mut(key).unwrap() -= 1;
                }
            }
        }
        let _leave = Leave(self, d.id().to_owned(), key.clone());
        if let Some(gate) = &self.gate {
            // Once open, every waiter passes the one permit on.
            drop(gate.acquire().await.unwrap());
        }
        let delay = random_below(self.max_delay_ms + 1);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if let Some(e) = (self.verdict)(d) {
            return Err(e);
        }
        self.delivered
            .lock()
            .unwrap()
            .push((d.id().to_owned(), key));
        Ok(())
    }
}
