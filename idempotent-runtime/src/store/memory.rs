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
    Claim, ClaimRequest, FencingToken, RecordedResponse, Standing, StandingState, Store, StoreError,
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
    /// Most bytes one scope may hold, the headroom of its claimed requests included (default
    /// 64 MiB; IPv6 peers counted per /64): one caller flooding large answers is refused alone.
    pub max_bytes_per_scope: usize,
    /// Bytes set aside when a request is claimed for the answer it will record (default 1 MiB,
    /// the default `max_response`; set it to the largest `max_response` in use). Room is
    /// checked when claiming, so a claimed request's answer up to this size is never refused
    /// for room, least of all because of another scope. Each request in flight holds this
    /// much of `max_bytes` and of its scope's `max_bytes_per_scope` until it completes.
    pub response_headroom: usize,
}

impl Default for MemoryLimits {
    fn default() -> Self {
        Self {
            max_records: 1_000_000,
            max_bytes: 256 << 20,
            max_records_per_scope: 10_000,
            max_bytes_per_scope: 64 << 20,
            response_headroom: 1 << 20,
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

/// What one quota bucket holds.
#[derive(Debug, Default, Clone, Copy)]
struct Share {
    records: usize,
    bytes: usize,
}

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
    quotas: Box<[Mutex<HashMap<u64, Share>>]>,
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

    fn quota_shard(&self, bucket: u64) -> &Mutex<HashMap<u64, Share>> {
        &self.quotas[bucket as usize & (self.quotas.len() - 1)]
    }

    fn charge(&self, weight: usize, bucket: u64) -> Result<(), StoreError> {
        if self.records.fetch_add(1, Ordering::AcqRel) >= self.limits.max_records {
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Full);
        }
        let mut quotas = lock(self.quota_shard(bucket));
        let share = quotas.entry(bucket).or_default();
        if share.records >= self.limits.max_records_per_scope
            || share.bytes.saturating_add(weight) > self.limits.max_bytes_per_scope
        {
            if share.records == 0 {
                quotas.remove(&bucket);
            }
            drop(quotas);
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::QuotaExceeded);
        }
        if self.bytes.fetch_add(weight, Ordering::AcqRel) + weight > self.limits.max_bytes {
            self.bytes.fetch_sub(weight, Ordering::AcqRel);
            if share.records == 0 {
                quotas.remove(&bucket);
            }
            drop(quotas);
            self.records.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Full);
        }
        share.records += 1;
        share.bytes += weight;
        Ok(())
    }

    fn discharge(&self, weight: usize, bucket: u64) {
        self.bytes.fetch_sub(weight, Ordering::AcqRel);
        self.records.fetch_sub(1, Ordering::AcqRel);
        let mut quotas = lock(self.quota_shard(bucket));
        if let Some(share) = quotas.get_mut(&bucket) {
            share.records -= 1;
            share.bytes -= weight;
            if share.records == 0 {
                quotas.remove(&bucket);
            }
        }
    }

    /// Adjusts the byte charge of an entry that stays (its response recorded, a takeover), in
    /// the store and in its scope's share. Shrinking always succeeds; growing fails (and
    /// changes nothing) past either bound.
    fn recharge(&self, bucket: u64, from: usize, to: usize) -> Result<(), StoreError> {
        let mut quotas = lock(self.quota_shard(bucket));
        let share = quotas.entry(bucket).or_default();
        if to <= from {
            self.bytes.fetch_sub(from - to, Ordering::AcqRel);
            share.bytes -= from - to;
            return Ok(());
        }
        let extra = to - from;
        if share.bytes.saturating_add(extra) > self.limits.max_bytes_per_scope {
            return Err(StoreError::QuotaExceeded);
        }
        if self.bytes.fetch_add(extra, Ordering::AcqRel) + extra > self.limits.max_bytes {
            self.bytes.fetch_sub(extra, Ordering::AcqRel);
            return Err(StoreError::Full);
        }
        share.bytes += extra;
        Ok(())
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
            // The answer's room is set aside now, so completing never needs more.
            weight: ENTRY_OVERHEAD + req.key.len() + self.limits.response_headroom,
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
    fn take_over(
        &self,
        entry: &mut Entry,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Claim, StoreError> {
        // Same slot, same scope, so the same quota bucket: only the byte charge changes (a
        // reservation with its headroom may outweigh the small record it replaces).
        let fresh = self.reservation(req, now);
        self.recharge(entry.quota_bucket, entry.weight, fresh.weight)?;
        *entry = fresh;
        Ok(Claim::Acquired)
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
        let now = self.clock.monotonic_millis();
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, req.scope, req.key)) {
            Some(Slot { record: r, .. }) if now >= r.entry.expires_at => {
                self.take_over(&mut r.entry, req, now)
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
        let now = self.clock.monotonic_millis();
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, req.scope, req.key)) {
            Some(Slot { record: r, .. })
                if now >= r.entry.expires_at
                    || (r.entry.token == stale && r.entry.takeable(now)) =>
            {
                self.take_over(&mut r.entry, req, now)
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
        let now = self.clock.monotonic_millis();
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let Some(Slot { record, .. }) = shard.find_mut(hash, matches(hash, scope, key)) else {
            return Ok(false);
        };
        let entry = &mut record.entry;
        if entry.token != token {
            return Ok(false);
        }
        if let EntryState::Completed(recorded) = &entry.state {
            // A resent completion that finds its own record: it is done.
            return Ok(**recorded == *response);
        }
        let weight = ENTRY_OVERHEAD + key.len() + response.weight();
        // Within the headroom set aside at the claim this only shrinks; an answer larger than
        // the headroom may be refused here, and the runtime then releases the key.
        self.recharge(entry.quota_bucket, entry.weight, weight)?;
        entry.weight = weight;
        entry.state = EntryState::Completed(Arc::new(response.clone()));
        entry.expires_at = now.saturating_add(millis(retention));
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
        let now = self.clock.monotonic_millis();
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
        let now = self.clock.monotonic_millis();
        let mut deleted = 0;
        for shard in self.shards.iter() {
            if deleted >= batch {
                break;
            }
            deleted += self.evict_expired(&mut lock(shard), now, batch - deleted);
        }
        Ok(deleted)
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
        let store = Arc::new(
            MemoryStore::builder()
                .clock(clock.clone())
                .limits(MemoryLimits {
                    // Many claims of one scope in flight at once.
                    response_headroom: 4 << 10,
                    ..MemoryLimits::default()
                })
                .build(),
        );
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
                max_bytes: 10 * (ENTRY_OVERHEAD + 4),
                response_headroom: 0,
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
        assert!(store.bytes() <= 10 * (ENTRY_OVERHEAD + 4));
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
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .limits(MemoryLimits {
                // Many claims of one scope in flight at once.
                response_headroom: 4 << 10,
                ..MemoryLimits::default()
            })
            .build();
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

    fn answer(bytes: usize) -> RecordedResponse {
        RecordedResponse {
            status: 200,
            headers: vec![],
            body: bytes::Bytes::from(vec![b'a'; bytes]),
        }
    }

    #[tokio::test]
    async fn a_scope_over_its_byte_quota_is_refused_at_the_claim_alone() {
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_bytes_per_scope: 10_000,
                response_headroom: 2_000,
                ..MemoryLimits::default()
            })
            .build();
        let (flood, other) = ([8; 32], [9; 32]);
        let mut recorded = 0;
        for i in 0..20 {
            let key = format!("big{i}");
            let req = claim_req(&flood, &key, 8);
            match store.claim(&req).await {
                Ok(Claim::Acquired) => {}
                Err(StoreError::QuotaExceeded) => break,
                other => panic!("{other:?}"),
            }
            // Every claimed answer within the headroom is recorded: the room was set aside.
            let done = store
                .complete(
                    &flood,
                    &key,
                    req.token,
                    &answer(1_500),
                    Duration::from_secs(60),
                )
                .await;
            assert!(done.unwrap(), "claimed answer {i} refused");
            recorded += 1;
        }
        assert!((4..20).contains(&recorded), "{recorded}");
        // The other scope is untouched by the flood.
        let req = claim_req(&other, "small", 9);
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        let done = store
            .complete(
                &other,
                "small",
                req.token,
                &answer(1_500),
                Duration::from_secs(60),
            )
            .await;
        assert!(done.unwrap());
    }

    #[tokio::test]
    async fn a_claimed_answer_is_recorded_though_the_store_filled_after_its_claim() {
        let headroom = 5_000;
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_bytes: 4 * (ENTRY_OVERHEAD + 2 + headroom),
                response_headroom: headroom,
                ..MemoryLimits::default()
            })
            .build();
        let honest = [10; 32];
        let mine = claim_req(&honest, "me", 10);
        assert_eq!(store.claim(&mine).await.unwrap(), Claim::Acquired);
        // Others fill the rest of the store with large answers, up to refusals.
        let mut others = 0;
        for i in 0..10u8 {
            let scope = [20 + i; 32];
            let req = claim_req(&scope, "kk", 20 + u64::from(i));
            match store.claim(&req).await {
                Ok(Claim::Acquired) => {
                    let done = store
                        .complete(
                            &scope,
                            "kk",
                            req.token,
                            &answer(headroom),
                            Duration::from_secs(60),
                        )
                        .await;
                    assert!(done.unwrap());
                    others += 1;
                }
                Err(StoreError::Full) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(others, 3, "the store filled");
        let done = store
            .complete(
                &honest,
                "me",
                mine.token,
                &answer(headroom),
                Duration::from_secs(60),
            )
            .await;
        assert!(done.unwrap(), "a claimed answer was refused for room");
        assert!(store.bytes() <= 4 * (ENTRY_OVERHEAD + 2 + headroom));
    }

    #[tokio::test]
    async fn an_answer_over_the_headroom_that_does_not_fit_is_refused_not_lost() {
        let store = MemoryStore::builder()
            .limits(MemoryLimits {
                max_bytes_per_scope: 4_000,
                response_headroom: 1_000,
                ..MemoryLimits::default()
            })
            .build();
        let scope = [11; 32];
        let req = claim_req(&scope, "k", 11);
        store.claim(&req).await.unwrap();
        let refused = store
            .complete(
                &scope,
                "k",
                req.token,
                &answer(10_000),
                Duration::from_secs(60),
            )
            .await;
        assert!(matches!(refused, Err(StoreError::QuotaExceeded)));
        // The reservation still stands, its charge unchanged: the runtime releases it.
        assert!(store.release(&scope, "k", req.token).await.unwrap());
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }

    #[tokio::test]
    async fn leases_ignore_a_wall_clock_step() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let scope = [12; 32];
        let first = claim_req(&scope, "k", 12);
        assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
        // NTP steps the wall clock two hours ahead while the handler runs.
        clock.step_wall(Duration::from_secs(7_200), true);
        let again = claim_req(&scope, "k", 12);
        match store.claim(&again).await.unwrap() {
            Claim::Standing(Standing {
                state: StandingState::Running { lease_left },
                ..
            }) => assert_eq!(lease_left, Duration::from_secs(60)),
            other => panic!("a wall-clock step made a live lease look abandoned: {other:?}"),
        }
        assert!(
            !store
                .reclaim(&again, first.token)
                .await
                .unwrap()
                .eq(&Claim::Acquired)
        );
        // And back: the lease does not stretch either.
        clock.step_wall(Duration::from_secs(7_200 + 3_600), false);
        clock.advance(Duration::from_secs(61));
        match store.claim(&again).await.unwrap() {
            Claim::Standing(Standing {
                state: StandingState::Abandoned,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_resent_completion_that_finds_its_own_record_succeeds() {
        let store = MemoryStore::default();
        let scope = [13; 32];
        let req = claim_req(&scope, "k", 13);
        store.claim(&req).await.unwrap();
        let retention = Duration::from_secs(60);
        assert!(
            store
                .complete(&scope, "k", req.token, &answer(10), retention)
                .await
                .unwrap()
        );
        assert!(
            store
                .complete(&scope, "k", req.token, &answer(10), retention)
                .await
                .unwrap()
        );
        let other = FencingToken::mint();
        assert!(
            !store
                .complete(&scope, "k", other, &answer(10), retention)
                .await
                .unwrap()
        );
    }
}

#[cfg(test)]
mod model_tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::{MemoryLimits, MemoryStore};
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
            let store = Arc::new(MemoryStore::builder()
            .clock(clock.clone())
            .limits(MemoryLimits {
                // Many claims of one scope in flight at once.
                response_headroom: 4 << 10,
                ..MemoryLimits::default()
            })
            .build());
            rt.block_on(check_model(store, move |d| clock.advance(d), &ops));
        }
    }
}
