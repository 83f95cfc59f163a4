//! The embedded default store: one process, sharded, expiring, bounded ([the contract](crate::design) §5).
//!
//! Every operation takes one shard's mutex for a few hash-map operations and never across an
//! `.await`. The store is bounded in records, in bytes and per scope; when a bound is reached,
//! new claims are refused (503 `IDEMPOTENCY_STORE_FULL`) rather than evicting a live record,
//! since evicting one would let its retry run the handler again.
//!
//! # Limits, headroom and sweeping
//!
//! Sharded, expiring, bounded by records (1,000,000), bytes (256 MiB) and per scope
//! (10,000 records and 64 MiB; IPv6 peers counted per /64), all in `MemoryLimits`. Room for the
//! answer is set aside when a request is claimed (`response_headroom`, 1 MiB: set it to your
//! largest `max_response`) and charged when it completes, so a claimed request's recordable answer
//! is never refused for room, whatever other scopes do; a scope over its quota, or a full store, is
//! refused with 503 `IDEMPOTENCY_STORE_FULL` and `Retry-After` before its handler runs. Each request
//! in flight holds its headroom: the defaults carry 256 requests in flight at once (64 per scope);
//! raise `max_bytes` or lower `max_response` and the headroom for more. A live record is never
//! evicted, since evicting one would let its retry run twice. Leases are measured on a monotonic
//! clock, so a wall-clock step never makes a live handler look abandoned. A background sweeper
//! frees expired records; expiry itself is enforced at claim time.
//! Each shard keeps its records' expiry times in order, so a sweep visits only what expires (never
//! the whole shard), no batch holds a shard's lock for more than its 500 records, and the sweeper
//! yields to the runtime between batches.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use hashbrown::{HashMap, HashTable};

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordState, RecordedResponse, Standing,
    StandingState, Store, StoreError, header_bytes, time_from_millis,
};
use crate::clock::{Clock, Millis, SystemClock, millis};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

/// Bytes charged per record beyond its key and response weight: the record, its table slot and
/// the table's slack, the allocator's headers, the expiry queue's pairs. Measured with
/// `cargo run --release -p idempotent-runtime --example memory_footprint` (1,000,000 completed
/// records of 200-byte bodies: 596 B resident each, of which 285 B are key, route and response
/// weight; 605 B charged), so that the byte bound tracks resident memory.
const ENTRY_OVERHEAD: usize = 320;

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
    /// The key, then the route it was claimed on (for [`Store::inspect`]), in one allocation.
    key_route: Box<str>,
    key_len: usize,
    entry: Entry,
}

impl Record {
    fn key(&self) -> &str {
        &self.key_route[..self.key_len]
    }

    fn route(&self) -> &str {
        &self.key_route[self.key_len..]
    }

    /// Gives a record taken over by the claim `req` (same key) that claim's route.
    fn rename(&mut self, req: &ClaimRequest<'_>) {
        if self.route() != req.route {
            (self.key_route, self.key_len) = key_route(req);
        }
    }
}

fn key_route(req: &ClaimRequest<'_>) -> (Box<str>, usize) {
    let mut both = String::with_capacity(req.key.len() + req.route.len());
    both.push_str(req.key);
    both.push_str(req.route);
    (both.into_boxed_str(), req.key.len())
}

struct Entry {
    token: FencingToken,
    fingerprint: Fingerprint,
    quota_bucket: u64,
    state: EntryState,
    expires_at: Millis,
    retention: Millis,
    weight: usize,
    /// For [`Store::inspect`]: when it was claimed, and when it completed.
    created_at: Millis,
    completed_at: Millis,
}

enum EntryState {
    Reserved { lease_until: Millis },
    Completed(Packed),
}

/// A recorded answer as the store keeps it: its headers (in
/// [`RecordedResponse::encode_headers`]' form), its body and its trailers (in the same form) in
/// one buffer of exactly their size.
///
/// The runtime hands an answer over as up to nine allocations: the body's buffer with whatever
/// slack its serializer grew (a 1.1 KiB JSON body sits in 2 KiB), the buffer's shared count, each
/// header's name and value, their list. A record holds its answer for the whole retention, so it
/// keeps one allocation of the exact size, and its key and route one more: 596 B resident a
/// record in `examples/memory_footprint`, against 780 B kept as handed over (one machine, one
/// sitting). A replay unpacks it: the headers and trailers are copied, the body is shared.
///
/// The buffer never leaves the process, so its layout needs no version: a record is always
/// read by the code that wrote it.
struct Packed {
    status: u16,
    /// Bytes of the encoded trailers, at the end of the buffer (in the padding beside
    /// `status`, so a record is no larger for them). An answer whose trailers take 4 GiB or
    /// more is refused at completion.
    tail: u32,
    head: usize,
    bytes: Bytes,
}

impl Packed {
    /// `None` when the trailers' encoding does not fit `tail`.
    fn new(response: &RecordedResponse) -> Option<Self> {
        let head = header_bytes(&response.headers);
        let tail = header_bytes(&response.trailers);
        let mut buf = Vec::with_capacity(head + response.body.len() + tail);
        response.encode_headers_into(&mut buf);
        debug_assert_eq!(buf.len(), head);
        buf.extend_from_slice(&response.body);
        super::encode_fields_into(&response.trailers, &mut buf);
        Some(Self {
            status: response.status,
            tail: u32::try_from(tail).ok()?,
            head,
            bytes: Bytes::from(buf),
        })
    }

    fn body_end(&self) -> usize {
        self.bytes.len() - self.tail as usize
    }

    fn unpack(&self) -> RecordedResponse {
        let fields = |raw: &[u8]| {
            RecordedResponse::decode_headers(raw).expect("fields the store encoded itself")
        };
        RecordedResponse::new(
            self.status,
            fields(&self.bytes[..self.head]),
            self.bytes.slice(self.head..self.body_end()),
        )
        .with_trailers(fields(&self.bytes[self.body_end()..]))
    }

    /// Whether `response` is the answer packed here.
    fn holds(&self, response: &RecordedResponse) -> bool {
        let fields = |raw: &[u8]| RecordedResponse::decode_headers(raw);
        self.status == response.status
            && self.bytes[self.head..self.body_end()] == response.body[..]
            && header_bytes(&response.headers) == self.head
            && header_bytes(&response.trailers) == self.tail as usize
            && fields(&self.bytes[..self.head]).as_ref() == Some(&response.headers)
            && fields(&self.bytes[self.body_end()..]).as_ref() == Some(&response.trailers)
    }
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
                EntryState::Completed(p) => StandingState::Completed(Arc::new(p.unpack())),
            }
        };
        let expires_in = matches!(state, StandingState::Completed(_))
            .then(|| Duration::from_millis(self.expires_at - now));
        Standing {
            token: self.token,
            fingerprint: self.fingerprint,
            state,
            expires_in,
        }
    }

    fn takeable(&self, now: Millis) -> bool {
        now >= self.expires_at
            || matches!(self.state, EntryState::Reserved { lease_until } if now >= lease_until)
    }
}

/// A shard: its records, and a queue of when they expire so the sweeper finds expired records
/// without visiting live ones.
///
/// The queue holds `(expires_at, hash)` for every record's current expiry (pushed on every change
/// of it) and stale pairs left by earlier changes and removals; a popped pair evicts only records
/// that are expired now, so a stale pair is harmless. The queue is rebuilt from the table when
/// stale pairs outnumber records, so it stays within twice the table plus a constant and each
/// rebuild's cost is paid for by the pushes since the last one. The shard derefs to its table,
/// where every lookup happens.
#[derive(Default)]
struct Shard {
    table: HashTable<Slot>,
    expiry: BinaryHeap<Reverse<(Millis, u64)>>,
}

impl std::ops::Deref for Shard {
    type Target = HashTable<Slot>;
    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

impl std::ops::DerefMut for Shard {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.table
    }
}

impl Shard {
    /// Records that the record at `hash` now expires at `expires_at`.
    fn queue(&mut self, hash: u64, expires_at: Millis) {
        self.expiry.push(Reverse((expires_at, hash)));
        if self.expiry.len() > 2 * self.table.len() + 64 {
            // Rebuilt in the queue's own buffer (it holds more pairs than the table has records,
            // so nothing is allocated), which keeps its peak size as the table does. A fresh
            // buffer is an allocation above glibc's small sizes, and glibc serves one by first
            // merging every small chunk freed since the last: after a sweep, those of every
            // record it freed. That took 30–60 ms, in a claim, with this shard locked
            // (`examples/sweep_pause.rs`).
            let mut pairs = std::mem::take(&mut self.expiry).into_vec();
            pairs.clear();
            pairs.extend(
                self.table
                    .iter()
                    .map(|s| Reverse((s.record.entry.expires_at, s.hash))),
            );
            self.expiry = BinaryHeap::from(pairs);
        }
    }
}

/// Most queue pairs one call pops per eviction it may make: bounds how long a shard lock is held
/// when the front of the queue is stale pairs.
const POPS_PER_EVICTION: usize = 4;

/// Most records a claim that found the store full frees from its own shard before retrying.
const EVICT_WHEN_FULL: usize = 64;

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
    /// Slots the expiry code has looked at, so a test can tell a sweep that visits only what
    /// expires from one that scans the shard.
    #[cfg(test)]
    slot_visits: AtomicUsize,
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
            #[cfg(test)]
            slot_visits: AtomicUsize::new(0),
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
            weight: ENTRY_OVERHEAD
                + req.key.len()
                + req.route.len()
                + self.limits.response_headroom,
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
            if self.evict_expired(shard, now, EVICT_WHEN_FULL) == 0 {
                return Err(full);
            }
            self.charge(entry.weight, entry.quota_bucket)?;
        }
        shard.queue(hash, entry.expires_at);
        let (key_route, key_len) = key_route(req);
        let record = Box::new(Record {
            scope: *req.scope,
            key_route,
            key_len,
            entry,
        });
        shard.insert_unique(hash, Slot { hash, record }, |s| s.hash);
        Ok(Claim::Acquired)
    }

    /// Replaces a takeable record's entry in place with a fresh reservation; returns its new
    /// expiry, for the shard's queue.
    fn take_over(
        &self,
        record: &mut Record,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Millis, StoreError> {
        // Same slot, same scope, so the same quota bucket: only the byte charge changes (a
        // reservation with its headroom may outweigh the small record it replaces).
        let fresh = self.reservation(req, now);
        self.recharge(record.entry.quota_bucket, record.entry.weight, fresh.weight)?;
        record.entry = fresh;
        record.rename(req);
        Ok(record.entry.expires_at)
    }

    /// Frees up to `limit` records expired at `now`, in expiry order, visiting only queue pairs
    /// that are due (at most [`POPS_PER_EVICTION`] per record it may free) and the slots they
    /// name: the work is proportional to what expires, not to what the shard holds.
    fn evict_expired(&self, shard: &mut Shard, now: Millis, limit: usize) -> usize {
        let mut freed = 0;
        let mut pops = limit.saturating_mul(POPS_PER_EVICTION);
        while freed < limit && pops > 0 {
            let Some(&Reverse((due, hash))) = shard.expiry.peek() else {
                break;
            };
            if due > now {
                break;
            }
            shard.expiry.pop();
            pops -= 1;
            // Another record may share the hash; each is judged by its own expiry.
            while freed < limit {
                #[cfg(test)]
                self.slot_visits.fetch_add(1, Ordering::Relaxed);
                let Ok(found) = shard
                    .table
                    .find_entry(hash, |s| s.hash == hash && now >= s.record.entry.expires_at)
                else {
                    break;
                };
                let (Slot { record, .. }, _) = found.remove();
                self.discharge(record.entry.weight, record.entry.quota_bucket);
                freed += 1;
            }
        }
        freed
    }
}

/// Records evicted between two yields of a sweep: about 100 µs of work.
const SWEEP_SLICE: usize = 64;

/// Makes the allocator take in, now, the small allocations a sweep batch just freed (a record's
/// key, route and response). glibc keeps freed small chunks aside and merges all of them at the
/// next allocation above its small sizes, whoever makes it: after a sweep of 100,000 records
/// with none in between, that was one pause of 30–60 ms in a request
/// (`examples/sweep_pause.rs` with small answers). One such allocation per batch merges a
/// batch's worth (a fraction of a millisecond) in the sweeper, outside every shard lock; for
/// other allocators it is a 4 KiB allocation and free per batch.
fn settle_freed_memory() {
    drop(std::hint::black_box(Vec::<u8>::with_capacity(4 << 10)));
}

fn matches<'a>(hash: u64, scope: &'a ScopeHash, key: &'a str) -> impl Fn(&Slot) -> bool + 'a {
    move |s| s.hash == hash && s.record.scope == *scope && s.record.key() == key
}

impl Store for MemoryStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = self.clock.monotonic_millis();
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        match shard.find_mut(hash, matches(hash, req.scope, req.key)) {
            Some(Slot { record: r, .. }) if now >= r.entry.expires_at => {
                let expires_at = self.take_over(r, req, now)?;
                shard.queue(hash, expires_at);
                Ok(Claim::Acquired)
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
                let expires_at = self.take_over(r, req, now)?;
                shard.queue(hash, expires_at);
                Ok(Claim::Acquired)
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
        let weight = ENTRY_OVERHEAD + record.key_route.len() + response.weight();
        let entry = &mut record.entry;
        if entry.token != token {
            return Ok(false);
        }
        if let EntryState::Completed(packed) = &entry.state {
            // A resent completion that finds its own record: it is done.
            return Ok(packed.holds(response));
        }
        // Within the headroom set aside at the claim this only shrinks; an answer larger than
        // the headroom may be refused here, and the runtime then releases the key.
        let packed = Packed::new(response).ok_or(StoreError::Full)?;
        self.recharge(entry.quota_bucket, entry.weight, weight)?;
        entry.weight = weight;
        entry.state = EntryState::Completed(packed);
        entry.expires_at = now.saturating_add(millis(retention));
        entry.completed_at = now;
        let expires_at = entry.expires_at;
        shard.queue(hash, expires_at);
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
                        let expires_at = e.expires_at;
                        shard.queue(hash, expires_at);
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
        // A slice at a time, yielding between slices: an eviction frees a whole record (a
        // microsecond or two, its memory long out of the cache), so a batch of 500 in one go
        // held the worker for most of a millisecond, and a sweep of many batches showed in the
        // requests' p99 on a one-worker server.
        while deleted < batch {
            let slice = (batch - deleted).min(SWEEP_SLICE);
            let mut freed = 0;
            for shard in self.shards.iter() {
                if freed >= slice {
                    break;
                }
                freed += self.evict_expired(&mut lock(shard), now, slice - freed);
            }
            if freed > 0 {
                settle_freed_memory();
            }
            deleted += freed;
            if freed < slice {
                break;
            }
            if deleted < batch {
                tokio::task::yield_now().await;
            }
        }
        Ok(deleted)
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        // Records keep monotonic times (a wall-clock step never makes a live handler look
        // abandoned); an operator reads wall-clock times, as far from now as they are.
        let now = self.clock.monotonic_millis();
        let wall_now = self.clock.now_millis() as i64;
        let wall = |t: Millis| time_from_millis(wall_now - (now as i64 - t as i64));
        let (hash, shard) = self.locate(scope, key);
        let shard = lock(shard);
        let Some(Slot { record, .. }) = shard.find(hash, matches(hash, scope, key)) else {
            return Ok(None);
        };
        let e = &record.entry;
        let (lease_until, response) = match &e.state {
            EntryState::Reserved { lease_until } => (Some(*lease_until), None),
            EntryState::Completed(p) => (None, Some(p)),
        };
        let state = RecordState::judge(
            response.is_some(),
            wall(now),
            wall(lease_until.unwrap_or(0)),
            wall(e.expires_at),
        );
        Ok(Some(RecordInfo {
            state,
            status: response.map(|r| r.status),
            route: Some(record.route().to_owned()),
            created_at: Some(wall(e.created_at)),
            completed_at: response.map(|_| wall(e.completed_at)),
            lease_until: lease_until.map(wall),
            expires_at: wall(e.expires_at),
            body_bytes: response.map_or(0, |p| p.body_end() - p.head),
            header_bytes: response.map_or(0, |p| p.head),
            response: response
                .filter(|_| with_response)
                .map(|p| Arc::new(p.unpack())),
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

    fn gauges(&self) -> Option<super::StoreGauges> {
        Some(super::StoreGauges::new(self.len(), self.bytes()))
    }

    /// Its records live in this process: it protects only the handles that share it.
    fn process_local(&self) -> Option<super::ProcessLocal> {
        Some(super::ProcessLocal::of(self))
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
            route: "/test",
            response_room: 0,
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
        let resp = RecordedResponse::new(200, vec![], bytes::Bytes::from(vec![b'x'; 1000]));
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

    #[test]
    fn trailers_make_a_packed_answer_no_larger() {
        // `status` and `tail` share one word: a packed answer is a word, a length and its bytes,
        // as it was before trailers were kept.
        assert_eq!(
            std::mem::size_of::<Packed>(),
            2 * std::mem::size_of::<usize>() + std::mem::size_of::<Bytes>()
        );
    }

    fn answer(bytes: usize) -> RecordedResponse {
        RecordedResponse::new(200, vec![], bytes::Bytes::from(vec![b'a'; bytes]))
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
                max_bytes: 4 * (ENTRY_OVERHEAD + 2 + "/test".len() + headroom),
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
        assert!(store.bytes() <= 4 * (ENTRY_OVERHEAD + 2 + "/test".len() + headroom));
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

    /// The packed answer comes back as it was given (headers in order, empty values, a body
    /// with every byte value), inspection reports its sizes, and a record taken over after
    /// expiry is named after the route that took it.
    #[tokio::test]
    async fn a_packed_answer_replays_as_recorded_and_a_takeover_renames_the_route() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let scope = [14; 32];
        let first = ClaimRequest {
            route: "/orders/{id}",
            response_room: 0,
            ..claim_req(&scope, "key-1", 14)
        };
        assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
        let recorded = RecordedResponse::new(
            207,
            vec![
                ("location".into(), Bytes::from_static(b"/orders/9")),
                ("x-empty".into(), Bytes::new()),
                ("location".into(), Bytes::from_static(b"/orders/10")),
            ],
            (0..=255u8).collect::<Vec<u8>>().into(),
        );
        let retention = Duration::from_secs(60);
        assert!(
            store
                .complete(&scope, "key-1", first.token, &recorded, retention)
                .await
                .unwrap()
        );
        let again = claim_req(&scope, "key-1", 14);
        match store.claim(&again).await.unwrap() {
            Claim::Standing(Standing {
                state: StandingState::Completed(replayed),
                ..
            }) => assert_eq!(*replayed, recorded),
            other => panic!("{other:?}"),
        }
        let info = store.inspect(&scope, "key-1", true).await.unwrap().unwrap();
        assert_eq!(info.route.as_deref(), Some("/orders/{id}"));
        assert_eq!(info.body_bytes, 256);
        assert_eq!(info.header_bytes, header_bytes(&recorded.headers));
        assert_eq!(info.response.as_deref(), Some(&recorded));
        // Another answer is not the one recorded: a resent completion of it is refused.
        let other = RecordedResponse {
            headers: recorded.headers[..2].to_vec(),
            ..recorded.clone()
        };
        assert!(
            !store
                .complete(&scope, "key-1", first.token, &other, retention)
                .await
                .unwrap()
        );
        clock.advance(Duration::from_secs(61 + 60));
        let later = ClaimRequest {
            route: "/refunds",
            response_room: 0,
            ..claim_req(&scope, "key-1", 14)
        };
        assert_eq!(store.claim(&later).await.unwrap(), Claim::Acquired);
        let info = store
            .inspect(&scope, "key-1", false)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.route.as_deref(), Some("/refunds"));
        assert_eq!((info.body_bytes, info.header_bytes), (0, 0));
    }
}

#[cfg(test)]
mod sweep_tests {
    use super::*;
    use crate::clock::ManualClock;

    fn claim_req<'a>(scope: &'a ScopeHash, key: &'a str, secs: u64) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: 9,
            fingerprint: Fingerprint {
                version: 1,
                digest: [0; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(secs),
            retention: Duration::from_secs(secs),
            route: "/test",
            response_room: 0,
        }
    }

    /// `expiring` records that expire in 2 s beside `live` ones that outlive the test.
    async fn store_with(clock: &ManualClock, expiring: usize, live: usize) -> MemoryStore {
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(4)
            .limits(MemoryLimits {
                max_records_per_scope: usize::MAX,
                max_bytes_per_scope: usize::MAX,
                response_headroom: 0,
                ..MemoryLimits::default()
            })
            .build();
        let scope = [9; 32];
        let resp = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"{}"));
        for i in 0..expiring + live {
            let key = format!("k{i}");
            let secs = if i < expiring { 1 } else { 3600 };
            let req = claim_req(&scope, &key, secs);
            assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
            if i % 2 == 0 {
                // Completing moves the expiry, leaving a stale pair in the queue.
                let retention = Duration::from_secs(secs);
                assert!(
                    store
                        .complete(&scope, &key, req.token, &resp, retention)
                        .await
                        .unwrap()
                );
            }
        }
        store
    }

    #[tokio::test]
    async fn a_sweep_batch_lets_other_tasks_run_between_its_slices() {
        let clock = ManualClock::new();
        let store = store_with(&clock, 1_000, 10).await;
        clock.advance(Duration::from_secs(3));
        // On one thread, a task that counts its turns while a batch of 500 is swept.
        let turns = Arc::new(AtomicUsize::new(0));
        let sweeping = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let counter = tokio::spawn({
            let (turns, sweeping) = (Arc::clone(&turns), Arc::clone(&sweeping));
            async move {
                while sweeping.load(Ordering::Relaxed) {
                    turns.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            }
        });
        tokio::task::yield_now().await;
        let before = turns.load(Ordering::Relaxed);
        assert_eq!(store.sweep(500).await.unwrap(), 500);
        let during = turns.load(Ordering::Relaxed) - before;
        sweeping.store(false, Ordering::Relaxed);
        counter.await.unwrap();
        // No more than 100 evictions (~150 µs) without another task's turn.
        assert!(
            during >= 500 / 100,
            "another task ran {during} times during a batch of 500"
        );
    }

    #[tokio::test]
    async fn sweep_visits_what_expires_not_what_the_store_holds() {
        let clock = ManualClock::new();
        let store = store_with(&clock, 1_000, 50_000).await;
        clock.advance(Duration::from_secs(3));
        let mut deleted = 0;
        loop {
            let n = store.sweep(500).await.unwrap();
            deleted += n;
            if n < 500 {
                break;
            }
        }
        assert_eq!(deleted, 1_000);
        assert_eq!(store.len(), 50_000, "every live record stays");
        let visits = store.slot_visits.load(Ordering::Relaxed);
        // A scan per batch would visit every slot of every shard each time: 51,000 at least.
        assert!(
            visits <= 3 * 1_000,
            "{visits} slot visits to free 1,000 records among 51,000"
        );
    }

    #[tokio::test]
    async fn a_full_store_frees_room_without_scanning_its_shard() {
        let clock = ManualClock::new();
        let store = store_with(&clock, 10, 20_000).await;
        let full = MemoryLimits {
            max_records: store.len(),
            max_records_per_scope: usize::MAX,
            max_bytes_per_scope: usize::MAX,
            response_headroom: 0,
            ..MemoryLimits::default()
        };
        let store = MemoryStore {
            limits: full,
            ..store
        };
        clock.advance(Duration::from_secs(3));
        let scope = [9; 32];
        let mut acquired = 0;
        for i in 0..40 {
            let key = format!("new{i}");
            if let Ok(Claim::Acquired) = store.claim(&claim_req(&scope, &key, 3600)).await {
                acquired += 1;
            }
        }
        assert_eq!(acquired, 10, "each expired record makes room for one claim");
        let visits = store.slot_visits.load(Ordering::Relaxed);
        assert!(visits <= 200, "{visits} slot visits to free 10 records");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_sweeper_yields_between_batches() {
        let clock = ManualClock::new();
        let store = Arc::new(store_with(&clock, 5_000, 10).await);
        clock.advance(Duration::from_secs(3));
        let _sweeper =
            super::super::spawn_sweeper(Arc::downgrade(&store), Duration::from_secs(1), 500);
        // On one thread, this task runs only when the sweeper yields: it must see the store
        // part-swept, not only before and after.
        let mut seen = std::collections::BTreeSet::new();
        while store.len() > 10 {
            seen.insert(store.len());
            tokio::task::yield_now().await;
        }
        let part_swept = seen.iter().filter(|&&n| n > 10 && n < 5_010).count();
        assert!(
            part_swept >= 5,
            "the sweeper held the thread through its batches: saw only {seen:?}"
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
