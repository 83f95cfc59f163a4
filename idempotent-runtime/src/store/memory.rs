//! The embedded default store: one process, sharded, expiring, bounded ([the contract](crate::design) §5).
//!
//! Every operation takes one shard's mutex for a few hash-map operations and never across an
//! `.await`. The store is bounded in records, in bytes and per scope; when a bound is reached,
//! new claims are refused (503 `IDEMPOTENCY_STORE_FULL`) rather than evicting a live record,
//! since evicting one would let its retry run the handler again.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::{HashMap, HashTable};

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordState, RecordedResponse, Standing,
    StandingState, Store, StoreError, header_bytes, time_from_millis,
};
use crate::clock::{Clock, Millis, SystemClock, millis};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

/// Bytes charged per record beyond its key and response weight: the record, its table slot and
/// the table's slack, the allocations behind the response. Measured with
/// `cargo run --release -p idempotent-runtime --example memory_footprint` (1,000,000 completed
/// records of 200-byte bodies: 682 B resident each, of which 280 B are key and response weight),
/// so that the byte bound tracks resident memory.
const ENTRY_OVERHEAD: usize = 400;

/// Bounds of a [`MemoryStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Most records held at once (default 1,000,000).
    pub max_records: usize,
    /// Most bytes held at once, keys and responses included (default 256 MiB).
    pub max_bytes: usize,
    /// Most records one scope may hold (default 10,000; IPv6 peers counted per /64).
    pub max_records_per_scope: usize,
}

impl Default for MemoryLimits {
    fn default() -> Self {
        Self {
            max_records: 1_000_000,
            max_bytes: 256 << 20,
            max_records_per_scope: 10_000,
        }
    }
}

/// A table slot: the record's hash beside a pointer to it. Probing rejects other keys by hash
/// without touching their allocation, growing the table never rehashes, and the table's slack
/// (hash tables run at most 7/8 full, often half) costs 16 bytes a slot rather than a record.
struct Slot {
    hash: u64,
    record: Box<Record>,
}

struct Record {
    scope: ScopeHash,
    key: Box<str>,
    entry: Entry,
}

struct Entry {
    token: FencingToken,
    fingerprint: Fingerprint,
    quota_bucket: u64,
    state: EntryState,
    expires_at: Millis,
    retention: Millis,
    weight: usize,
    /// For [`Store::inspect`]: the route it was claimed on, when, and when it completed.
    route: Box<str>,
    created_at: Millis,
    completed_at: Millis,
}

enum EntryState {
    Reserved { lease_until: Millis },
    Completed(Arc<RecordedResponse>),
}

impl Entry {
    fn standing(&self, now: Millis) -> Standing {
        let state = if now >= self.expires_at {
            StandingState::Expired
        } else {
            match &self.state {
                EntryState::Reserved { lease_until } if now < *lease_until => {
                    StandingState::Running {
                        lease_left: Duration::from_millis(lease_until - now),
                    }
                }
                EntryState::Reserved { .. } => StandingState::Abandoned,
                EntryState::Completed(r) => StandingState::Completed(Arc::clone(r)),
            }
        };
        Standing {
            token: self.token,
            fingerprint: self.fingerprint,
            state,
        }
    }

    fn takeable(&self, now: Millis) -> bool {
        now >= self.expires_at
            || matches!(self.state, EntryState::Reserved { lease_until } if now >= lease_until)
    }
}

type Shard = HashTable<Slot>;

/// The in-memory store. Cheap to share behind an `Arc`; see [`MemoryStore::builder`].
///
/// ```
/// use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
///
/// let store = MemoryStore::builder()
///     .limits(MemoryLimits { max_records_per_scope: 1_000, ..MemoryLimits::default() })
///     .build();
/// assert_eq!(store.len(), 0);
/// ```
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    quotas: Box<[Mutex<HashMap<u64, usize>>]>,
    hasher: hashbrown::DefaultHashBuilder,
    records: AtomicUsize,
    bytes: AtomicUsize,
    limits: MemoryLimits,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("bytes", &self.bytes())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Builds a [`MemoryStore`].
#[must_use]
pub struct MemoryStoreBuilder {
    limits: MemoryLimits,
    clock: Arc<dyn Clock>,
    shards: usize,
}

impl MemoryStoreBuilder {
    /// Record, byte and per-scope bounds.
    pub fn limits(mut self, limits: MemoryLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The clock that judges leases and expiry (tests inject a
    /// [`ManualClock`](crate::clock::ManualClock)).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Number of shards (rounded up to a power of two; default 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1).next_power_of_two();
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        let shards = (0..self.shards).map(|_| Mutex::default()).collect();
        let quotas = (0..self.shards).map(|_| Mutex::default()).collect();
        MemoryStore {
            shards,
            quotas,
            hasher: Default::default(),
            records: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            limits: self.limits,
            clock: self.clock,
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::builder().build()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard cannot leave an entry half-written (every mutation is a
    // single map operation), so a poisoned shard is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryStore {
    /// A builder with default limits, the system clock and 64 shards.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            limits: MemoryLimits::default(),
            clock: Arc::new(SystemClock),
            shards: 64,
        }
    }

    /// Records currently held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.records.load(Ordering::Relaxed)
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes currently charged against [`MemoryLimits::max_bytes`].
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The record's hash and its shard. Bits 40.. pick the shard, so the table inside keeps
    /// the low bits (bucket) and the top seven (control byte) at full entropy.
    fn locate(&self, scope: &ScopeHash, key: &str) -> (u64, &Mutex<Shard>) {
        let hash = self.hasher.hash_one((scope, key));
        let shard = (hash >> 40) as usize & (self.shards.len() - 1);
        (hash, &self.shards[shard])
    }

    fn quota_shard(&self, bucket: u64) -> &Mutex<HashMap<u64, usize>> {
        &self.quotas[bucket as usize & (self.quotas.len() - 1)]
    }

    fn charge(&self, weight: usize, bucket: u64) -> Result<(), StoreError> {
        if self.records.fetch_add(1, Ordering::AcqRel) >= self.limits.max_records {
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Full);
        }
        if self.bytes.fetch_add(weight, Ordering::AcqRel) + weight > self.limits.max_bytes {
            self.bytes.fetch_sub(weight, Ordering::AcqRel);
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Full);
        }
        let mut quotas = lock(self.quota_shard(bucket));
        let used = quotas.entry(bucket).or_insert(0);
        if *used >= self.limits.max_records_per_scope {
            drop(quotas);
            self.bytes.fetch_sub(weight, Ordering::AcqRel);
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::QuotaExceeded);
        }
        *used += 1;
        Ok(())
    }

    fn discharge(&self, weight: usize, bucket: u64) {
        self.bytes.fetch_sub(weight, Ordering::AcqRel);
        self.records.fetch_sub(1, Ordering::AcqRel);
        let mut quotas = lock(self.quota_shard(bucket));
        if let Some(used) = quotas.get_mut(&bucket) {
            *used -= 1;
            if *used == 0 {
                quotas.remove(&bucket);
            }
        }
    }

    /// Adjusts the byte charge of an entry that stays, e.g. when its response is recorded.
    fn recharge(&self, from: usize, to: usize) -> bool {
        if to <= from {
            self.bytes.fetch_sub(from - to, Ordering::AcqRel);
            return true;
        }
        let extra = to - from;
        if self.bytes.fetch_add(extra, Ordering::AcqRel) + extra > self.limits.max_bytes {
            self.bytes.fetch_sub(extra, Ordering::AcqRel);
            return false;
        }
        true
    }

    fn reservation(&self, req: &ClaimRequest<'_>, now: Millis) -> Entry {
        let lease_until = now.saturating_add(millis(req.lease));
        let retention = millis(req.retention);
        Entry {
            token: req.token,
            fingerprint: req.fingerprint,
            quota_bucket: req.quota_bucket,
            state: EntryState::Reserved { lease_until },
            expires_at: lease_until.saturating_add(retention),
            retention,
            weight: ENTRY_OVERHEAD + req.key.len() + req.route.len(),
            route: req.route.into(),
            created_at: now,
            completed_at: 0,
        }
    }

    /// Inserts a fresh reservation into an empty slot, charging the bounds. When a bound is hit,
    /// frees this shard's expired entries once and tries again.
    fn insert_new(
        &self,
        shard: &mut Shard,
        hash: u64,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Claim, StoreError> {
        let entry = self.reservation(req, now);
        if let Err(full) = self.charge(entry.weight, entry.quota_bucket) {
            if self.evict_expired(shard, now, usize::MAX) == 0 {
                return Err(full);
            }
            self.charge(entry.weight, entry.quota_bucket)?;
        }
        let record = Box::new(Record {
            scope: *req.scope,
            key: req.key.into(),
            entry,
        });
        shard.insert_unique(hash, Slot { hash, record }, |s| s.hash);
        Ok(Claim::Acquired)
    }

    /// Replaces a takeable entry in place with a fresh reservation.
    fn take_over(&self, entry: &mut Entry, req: &ClaimRequest<'_>, now: Millis) -> Claim {
        // Same slot, same scope, so the same quota bucket: only the byte charge changes, and it
        // can only shrink (a reservation weighs less than any record it replaces), unless the
        // new claim's route name is longer than the old one's: those few bytes are charged
        // whatever the bound, so the accounting stays exact.
        let fresh = self.reservation(req, now);
        if !self.recharge(entry.weight, fresh.weight) {
            self.bytes
                .fetch_add(fresh.weight - entry.weight, Ordering::AcqRel);
        }
        *entry = fresh;
        Claim::Acquired
    }

    fn evict_expired(&self, shard: &mut Shard, now: Millis, limit: usize) -> usize {
        let mut freed = Vec::new();
        shard.retain(|Slot { record, .. }| {
            let e = &record.entry;
            if freed.len() < limit && now >= e.expires_at {
                freed.push((e.weight, e.quota_bucket));
                false
            } else {
                true
            }
        });
        for (weight, bucket) in &freed {
            self.discharge(*weight, *bucket);
        }
        freed.len()
    }
}

fn matches<'a>(hash: u64, scope: &'a ScopeHash, key: &'a str) -> impl Fn(&Slot) -> bool + 'a {
    move |s| s.hash == hash && s.record.scope == *scope && *s.record.key == *key
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = self.clock.now_millis();
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, req.scope, req.key)) {
            Some(Slot { record: r, .. }) if now >= r.entry.expires_at => {
                Ok(self.take_over(&mut r.entry, req, now))
            }
            Some(Slot { record: r, .. }) => Ok(Claim::Standing(r.entry.standing(now))),
            None => self.insert_new(&mut shard, hash, req, now),
        }
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        let now = self.clock.now_millis();
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, req.scope, req.key)) {
            Some(Slot { record: r, .. })
                if now >= r.entry.expires_at
                    || (r.entry.token == stale && r.entry.takeable(now)) =>
            {
                Ok(self.take_over(&mut r.entry, req, now))
            }
            Some(Slot { record: r, .. }) => Ok(Claim::Standing(r.entry.standing(now))),
            None => self.insert_new(&mut shard, hash, req, now),
        }
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now_millis();
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let Some(Slot { record, .. }) = shard.find_mut(hash, matches(hash, scope, key)) else {
            return Ok(false);
        };
        let entry = &mut record.entry;
        if entry.token != token || !matches!(entry.state, EntryState::Reserved { .. }) {
            return Ok(false);
        }
        let weight = ENTRY_OVERHEAD + key.len() + entry.route.len() + response.weight();
        if !self.recharge(entry.weight, weight) {
            return Err(StoreError::Full);
        }
        entry.weight = weight;
        entry.state = EntryState::Completed(Arc::new(response.clone()));
        entry.expires_at = now.saturating_add(millis(retention));
        entry.completed_at = now;
        Ok(true)
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        match shard.find_entry(hash, matches(hash, scope, key)) {
            Ok(found)
                if found.get().record.entry.token == token
                    && matches!(found.get().record.entry.state, EntryState::Reserved { .. }) =>
            {
                let (Slot { record, .. }, _) = found.remove();
                self.discharge(record.entry.weight, record.entry.quota_bucket);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now_millis();
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, scope, key)) {
            Some(Slot { record, .. }) if record.entry.token == token => {
                let e = &mut record.entry;
                match &mut e.state {
                    EntryState::Reserved { lease_until } => {
                        *lease_until = now.saturating_add(millis(lease));
                        e.expires_at = lease_until.saturating_add(e.retention);
                        Ok(true)
                    }
                    EntryState::Completed(_) => Ok(false),
                }
            }
            _ => Ok(false),
        }
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        let now = self.clock.now_millis();
        let mut deleted = 0;
        for shard in self.shards.iter() {
            if deleted >= batch {
                break;
            }
            deleted += self.evict_expired(&mut lock(shard), now, batch - deleted);
        }
        Ok(deleted)
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let now = self.clock.now_millis();
        let (hash, shard) = self.locate(scope, key);
        let shard = lock(shard);
        let Some(Slot { record, .. }) = shard.find(hash, matches(hash, scope, key)) else {
            return Ok(None);
        };
        let e = &record.entry;
        let (lease_until, response) = match &e.state {
            EntryState::Reserved { lease_until } => (Some(*lease_until), None),
            EntryState::Completed(r) => (None, Some(r)),
        };
        let state = RecordState::judge(
            response.is_some(),
            time_from_millis(now as i64),
            time_from_millis(lease_until.unwrap_or(0) as i64),
            time_from_millis(e.expires_at as i64),
        );
        Ok(Some(RecordInfo {
            state,
            status: response.map(|r| r.status),
            route: Some(e.route.to_string()),
            created_at: Some(time_from_millis(e.created_at as i64)),
            completed_at: response.map(|_| time_from_millis(e.completed_at as i64)),
            lease_until: lease_until.map(|t| time_from_millis(t as i64)),
            expires_at: time_from_millis(e.expires_at as i64),
            body_bytes: response.map_or(0, |r| r.body.len()),
            header_bytes: response.map_or(0, |r| header_bytes(&r.headers)),
            response: response.filter(|_| with_response).map(Arc::clone),
        }))
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        match shard.find_entry(hash, matches(hash, scope, key)) {
            Ok(found) => {
                let (Slot { record, .. }, _) = found.remove();
                self.discharge(record.entry.weight, record.entry.quota_bucket);
                Ok(true)
            }
            Err(_) => Ok(false),
        }
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::contract;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn memory_store_meets_the_store_contract() {
        let clock = ManualClock::new();
        let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
        contract::run(store, move |d| clock.advance(d)).await;
    }

    fn claim_req<'a>(scope: &'a ScopeHash, key: &'a str, bucket: u64) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: bucket,
            fingerprint: Fingerprint {
                version: 1,
                digest: [0; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(60),
            route: "/test",
        }
    }

    #[tokio::test]
    async fn full_store_refuses_new_claims_and_keeps_live_records() {
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_records: 3,
                ..MemoryLimits::default()
            })
            .build();
        let scope = [1; 32];
        let keys = ["a", "b", "c"];
        for k in keys {
            assert_eq!(
                store.claim(&claim_req(&scope, k, 1)).await.unwrap(),
                Claim::Acquired
            );
        }
        assert!(matches!(
            store.claim(&claim_req(&scope, "d", 1)).await,
            Err(StoreError::Full)
        ));
        for k in keys {
            assert!(
                matches!(
                    store.claim(&claim_req(&scope, k, 1)).await.unwrap(),
                    Claim::Standing(_)
                ),
                "{k} evicted"
            );
        }
        assert_eq!(store.len(), 3);
    }

    #[tokio::test]
    async fn byte_bound_refuses_rather_than_grows() {
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_bytes: 10 * (ENTRY_OVERHEAD + 4 + "/test".len()),
                ..MemoryLimits::default()
            })
            .build();
        let scope = [2; 32];
        let mut refused = 0;
        for i in 0..100 {
            let key = format!("k{i:03}");
            match store.claim(&claim_req(&scope, &key, 2)).await {
                Ok(Claim::Acquired) => {}
                Err(StoreError::Full) => refused += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(refused, 90);
        assert!(store.bytes() <= 10 * (ENTRY_OVERHEAD + 4 + "/test".len()));
    }

    #[tokio::test]
    async fn scope_quota_refuses_one_scope_alone() {
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_records_per_scope: 2,
                ..MemoryLimits::default()
            })
            .build();
        let (greedy, other) = ([3; 32], [4; 32]);
        for k in ["a", "b"] {
            assert_eq!(
                store.claim(&claim_req(&greedy, k, 3)).await.unwrap(),
                Claim::Acquired
            );
        }
        assert!(matches!(
            store.claim(&claim_req(&greedy, "c", 3)).await,
            Err(StoreError::QuotaExceeded)
        ));
        assert_eq!(
            store.claim(&claim_req(&other, "c", 4)).await.unwrap(),
            Claim::Acquired
        );
    }

    #[tokio::test]
    async fn a_full_store_frees_expired_records_to_make_room() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .limits(MemoryLimits {
                max_records: 1,
                ..MemoryLimits::default()
            })
            .build();
        let scope = [5; 32];
        let mut old = claim_req(&scope, "old", 5);
        old.lease = Duration::from_secs(1);
        old.retention = Duration::from_secs(1);
        assert_eq!(store.claim(&old).await.unwrap(), Claim::Acquired);
        clock.advance(Duration::from_secs(3));
        assert_eq!(
            store.claim(&claim_req(&scope, "new", 5)).await.unwrap(),
            Claim::Acquired
        );
        assert_eq!(store.len(), 1);
    }

    #[tokio::test]
    async fn accounting_returns_to_zero_after_release_and_sweep() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let scope = [6; 32];
        let a = claim_req(&scope, "a", 6);
        let b = claim_req(&scope, "b", 6);
        store.claim(&a).await.unwrap();
        store.claim(&b).await.unwrap();
        let resp = RecordedResponse {
            status: 200,
            headers: vec![],
            body: bytes::Bytes::from(vec![b'x'; 1000]),
        };
        assert!(
            store
                .complete(&scope, "a", a.token, &resp, Duration::from_secs(1))
                .await
                .unwrap()
        );
        assert!(store.release(&scope, "b", b.token).await.unwrap());
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.sweep(500).await.unwrap(), 1);
        assert_eq!((store.len(), store.bytes()), (0, 0));
        assert!(store.quotas.iter().all(|q| lock(q).is_empty()));
    }
}

#[cfg(test)]
mod model_tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::MemoryStore;
    use crate::clock::ManualClock;
    use crate::store::contract::model::{Op, check_model};

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (any::<u8>(), any::<u8>(), 1u8..5).prop_map(|(key, fp, lease_s)| Op::Claim { key, fp, lease_s }),
            2 => (any::<u8>(), any::<bool>(), 1u8..5).prop_map(|(key, stale, retention_s)| Op::Complete { key, stale, retention_s }),
            1 => (any::<u8>(), any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
            1 => (any::<u8>(), any::<bool>(), 1u8..5).prop_map(|(key, stale, lease_s)| Op::Renew { key, stale, lease_s }),
            2 => (0u8..4).prop_map(|secs| Op::Advance { secs }),
            1 => Just(Op::Sweep),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn memory_store_agrees_with_the_reference_model(ops in proptest::collection::vec(op(), 1..60)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let clock = ManualClock::new();
            let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
            rt.block_on(check_model(store, move |d| clock.advance(d), &ops));
        }
    }
}
