//! The embedded default store: one process, sharded, expiring, bounded ([the contract](crate::design) §5).
//!
//! Every operation takes one shard's mutex for a few hash-table operations and never across an
//! `.await`. The store is bounded in records, in bytes and per scope; when a bound is reached,
//! new claims are refused (503 `IDEMPOTENCY_STORE_FULL`) rather than evicting a live record,
//! since evicting one would let its retry run the handler again.
//!
//! # Segments
//!
//! Completed answers live in append-only segments grouped by retention, so each group is in
//! expiry order (the Segcache design): a shard's index maps `(scope, key)` to an 8-byte slot (32
//! bits of the record's hash and where the record is), a completed record is one run of bytes in
//! a segment (its token and times in its header), and expiring walks a group's oldest segment
//! from its front, dropping index slots, until it meets a record that is not due; a segment
//! walked entirely is reused. What many records share (a scope, its quota bucket, a route) is kept
//! once a shard, in an owner entry the records name by id and that is reused once its last
//! record is gone. No completed record is allocated or freed on its own, so records that live for
//! the retention do not mix with a request's short-lived allocations in the allocator. A forget
//! or a takeover leaves a hole, still charged against `max_bytes` (it is memory the store holds)
//! but no longer against its scope, until the walk passes it. A reservation (a request in flight)
//! is an entry in its shard's slab, reused once it completes or is released, so a claim allocates
//! nothing either. What the store holds beyond its charge: the spare segments kept for reuse (at
//! most two a shard and a quarter of those in use), the slab's free entries (as many as the most
//! requests a shard held in flight at once, each of which was charged its headroom while it ran)
//! and the owner table's free entries (as many as the most owners a shard held at once, each of
//! which was charged while it was used).
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
//! raise `max_bytes` or lower `max_response` and the headroom for more. A shard holds at most
//! 32,768 segments (2 GiB of answers) and refuses claims at that bound too. A live record is never
//! evicted, since evicting one would let its retry run twice. Leases are measured on a monotonic
//! clock, so a wall-clock step never makes a live handler look abandoned. A background sweeper
//! frees expired records; expiry itself is enforced at claim time.
//! A sweep visits only what expires (never the whole shard), no batch holds a shard's lock for
//! more than its 500 records, and the sweeper yields to the runtime between batches.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordState, RecordedResponse, Standing,
    StandingState, Store, StoreError, time_from_millis,
};
use crate::clock::{Clock, Millis, SystemClock, millis};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

mod segment;

use segment::{Loc, MAX_HEADER_BYTES, MAX_SEGMENTS, Parts, Record, Segments};

/// Bytes charged per completed record beside its bytes in a segment: its index slot (8 bytes
/// and a control byte) with the table's slack (a table grows when 7/8 full, so its slots run
/// between 44 % and 88 % full: at most 21 B a record), and its share of the segments' unused
/// tails. Measured with `cargo run --release -p idempotent-runtime --example memory_footprint`
/// (1,000,000 completed records of 200-byte bodies: 359 B resident each, of which 333 B in
/// segments, about 19 B the index and 2 B the owner entries), so that the byte bound tracks
/// resident memory.
const SLOT_OVERHEAD: usize = 24;

/// Bytes charged per owner entry beside its route: the entry, its index slot (4 bytes and a
/// control byte, with the table's slack: at most 12 B) and the route buffer's allocation (16 B
/// beyond its bytes). Charged to the scope and the store while a record names it.
const OWNER_OVERHEAD: usize = std::mem::size_of::<Owner>() + 12 + 16;

/// Bytes charged per reservation beyond its key, route and headroom: its slot, its slab entry
/// and the expiry queue's pairs. At least a completed record's slot, its largest header and a new
/// owner entry, so that an answer within the headroom always weighs less completed than it did
/// reserved.
const ENTRY_OVERHEAD: usize = 256;

const _: () = assert!(SLOT_OVERHEAD + MAX_HEADER_BYTES + OWNER_OVERHEAD <= ENTRY_OVERHEAD);

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

/// An index slot: 8 bytes whatever the record holds. It keeps 32 bits of the record's hash,
/// all the table hashes on ([`table_hash`]), so growing the table reads no record, and a lookup
/// reads only records whose 32 bits match.
#[derive(Debug, Clone, Copy)]
struct Slot {
    check: u32,
    /// [`RESERVED`] and a reservation's entry, or a completed record's segment (15 bits) and
    /// offset (16 bits).
    place: u32,
}

/// The bit of [`Slot::place`] that marks a reservation.
const RESERVED: u32 = 1 << 31;

const _: () = assert!(MAX_SEGMENTS <= 1 << 15 && segment::SEGMENT_BYTES <= 1 << 16);

impl Slot {
    fn reserved(check: u32, idx: u32) -> Self {
        debug_assert!(idx < RESERVED);
        Self {
            check,
            place: RESERVED | idx,
        }
    }

    fn completed(check: u32, loc: Loc) -> Self {
        // An answer larger than a segment has one of its own, at offset 0.
        debug_assert!((loc.seg as usize) < MAX_SEGMENTS && loc.off < 1 << 16);
        Self {
            check,
            place: (loc.seg << 16) | loc.off,
        }
    }

    fn place(self) -> Place {
        if self.place & RESERVED != 0 {
            Place::Reserved(self.place & !RESERVED)
        } else {
            Place::Completed(Loc {
                seg: self.place >> 16,
                off: self.place & 0xffff,
            })
        }
    }
}

/// The hash the index table is keyed on: the 32 bits a slot keeps, in both halves, so that the
/// table's bucket (low bits) and control byte (top seven) both come from them.
fn table_hash(check: u32) -> u64 {
    (u64::from(check) << 32) | u64::from(check)
}

enum Place {
    /// A request in flight: its entry in the shard's [`Reservations`].
    Reserved(u32),
    /// A completed record, in a segment.
    Completed(Loc),
}

/// What a reservation keeps until it completes or is released.
struct Reserved {
    scope: ScopeHash,
    /// The key, then the route it was claimed on (for [`Store::inspect`]).
    key_route: String,
    key_len: usize,
    fingerprint: Fingerprint,
    token: FencingToken,
    quota_bucket: u64,
    lease_until: Millis,
    retention: Millis,
    expires_at: Millis,
    created_at: Millis,
    weight: usize,
}

impl Reserved {
    /// Makes this entry the reservation of `req`, reusing its key buffer; returns its expiry.
    fn fill(&mut self, req: &ClaimRequest<'_>, now: Millis, weight: usize) -> Millis {
        self.lease_until = now.saturating_add(millis(req.lease));
        self.retention = millis(req.retention);
        self.key_route.clear();
        self.key_route.push_str(req.key);
        self.key_route.push_str(req.route);
        self.key_len = req.key.len();
        self.scope = *req.scope;
        self.fingerprint = req.fingerprint;
        self.token = req.token;
        self.quota_bucket = req.quota_bucket;
        self.created_at = now;
        self.weight = weight;
        self.expires_at = self.lease_until.saturating_add(self.retention);
        self.expires_at
    }

    fn key(&self) -> &str {
        &self.key_route[..self.key_len]
    }

    fn route(&self) -> &str {
        &self.key_route[self.key_len..]
    }
}

/// A shard's reservations: a slab whose entries, key buffers included, are reused, so that a
/// claim allocates nothing once the shard has held as many requests in flight at once.
#[derive(Default)]
struct Reservations {
    slab: Vec<Reserved>,
    free: Vec<u32>,
}

impl Reservations {
    fn len(&self) -> usize {
        self.slab.len() - self.free.len()
    }

    /// A new reservation for `req`: its entry and its expiry.
    fn add(&mut self, req: &ClaimRequest<'_>, now: Millis, weight: usize) -> (u32, Millis) {
        let idx = match self.free.pop() {
            Some(idx) => idx,
            None => {
                self.slab.push(Reserved {
                    scope: [0; 32],
                    key_route: String::new(),
                    key_len: 0,
                    fingerprint: req.fingerprint,
                    token: req.token,
                    quota_bucket: 0,
                    lease_until: 0,
                    retention: 0,
                    expires_at: 0,
                    created_at: 0,
                    weight: 0,
                });
                u32::try_from(self.slab.len() - 1)
                    .ok()
                    .filter(|&idx| idx < RESERVED)
                    .expect("fewer than 2^31 requests in flight")
            }
        };
        (idx, self.slab[idx as usize].fill(req, now, weight))
    }

    /// Frees entry `idx`; returns its charge and quota bucket.
    fn remove(&mut self, idx: u32) -> (usize, u64) {
        let r = &self.slab[idx as usize];
        self.free.push(idx);
        (r.weight, r.quota_bucket)
    }
}

impl std::ops::Index<u32> for Reservations {
    type Output = Reserved;
    fn index(&self, idx: u32) -> &Reserved {
        &self.slab[idx as usize]
    }
}

impl std::ops::IndexMut<u32> for Reservations {
    fn index_mut(&mut self, idx: u32) -> &mut Reserved {
        &mut self.slab[idx as usize]
    }
}

/// What completed records share: a scope (a 32-byte hash shared by all of one caller's records),
/// its quota bucket and a route (one of a few). A record names its owner by id; the scope is
/// still compared on every lookup, so two scopes whose keys' hashes meet stay apart.
struct Owner {
    scope: ScopeHash,
    bucket: u64,
    route: String,
    /// Completed records that name it; at 0 the entry is free for reuse.
    records: u32,
}

/// A shard's owner entries: a slab whose entries, route buffers included, are reused, and an
/// index by `(scope, bucket, route)`.
#[derive(Default)]
struct Owners {
    slab: Vec<Owner>,
    free: Vec<u32>,
    index: HashTable<u32>,
}

impl Owners {
    /// The id of the owner `(scope, bucket, route)` for one more record: `found` is
    /// [`Owners::find`]'s answer, and when it is `None` a new entry is made (its charge due).
    fn hold(
        &mut self,
        hasher: &DefaultHashBuilder,
        found: Option<u32>,
        (scope, bucket, route): (&ScopeHash, u64, &str),
    ) -> u32 {
        if let Some(id) = found {
            self.slab[id as usize].records += 1;
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                let owner = &mut self.slab[id as usize];
                owner.scope = *scope;
                owner.bucket = bucket;
                owner.route.clear();
                owner.route.push_str(route);
                owner.records = 1;
                id
            }
            None => {
                self.slab.push(Owner {
                    scope: *scope,
                    bucket,
                    route: route.to_owned(),
                    records: 1,
                });
                u32::try_from(self.slab.len() - 1).expect("fewer than 2^32 owners")
            }
        };
        let slab = &self.slab;
        self.index
            .insert_unique(owner_hash(hasher, scope, bucket, route), id, |&id| {
                slab[id as usize].hash(hasher)
            });
        id
    }

    /// The id of the owner `(scope, bucket, route)`, if a record names it.
    fn find(
        &self,
        hasher: &DefaultHashBuilder,
        scope: &ScopeHash,
        bucket: u64,
        route: &str,
    ) -> Option<u32> {
        let found = self
            .index
            .find(owner_hash(hasher, scope, bucket, route), |&id| {
                let o = &self.slab[id as usize];
                o.scope == *scope && o.bucket == bucket && o.route == route
            });
        found.copied()
    }

    /// What releasing owner `id` would free: its charge if this is its last record.
    fn freed_by_release(&self, id: u32) -> usize {
        let owner = &self.slab[id as usize];
        if owner.records == 1 {
            owner_charge(&owner.route)
        } else {
            0
        }
    }

    /// One record fewer names owner `id`; at none the entry is freed. Returns its quota bucket
    /// and the charge this freed ([`Owners::freed_by_release`]).
    fn release(&mut self, hasher: &DefaultHashBuilder, id: u32) -> (u64, usize) {
        let freed = self.freed_by_release(id);
        let owner = &mut self.slab[id as usize];
        let bucket = owner.bucket;
        owner.records -= 1;
        if owner.records == 0 {
            let hash = owner.hash(hasher);
            self.index
                .find_entry(hash, |&i| i == id)
                .expect("an indexed owner")
                .remove();
            self.free.push(id);
        }
        (bucket, freed)
    }
}

impl std::ops::Index<u32> for Owners {
    type Output = Owner;
    fn index(&self, id: u32) -> &Owner {
        &self.slab[id as usize]
    }
}

impl Owner {
    fn hash(&self, hasher: &DefaultHashBuilder) -> u64 {
        owner_hash(hasher, &self.scope, self.bucket, &self.route)
    }
}

fn owner_hash(hasher: &DefaultHashBuilder, scope: &ScopeHash, bucket: u64, route: &str) -> u64 {
    hasher.hash_one((scope, bucket, route))
}

/// What an owner entry is charged while a record names it.
fn owner_charge(route: &str) -> usize {
    OWNER_OVERHEAD + route.len()
}

/// A shard: its index, its segments, its reservations and owners, and a queue of when its
/// reservations expire.
///
/// The queue holds `(expires_at, check)` for every reservation's current expiry (pushed on every
/// change of it) and stale pairs left by earlier changes, completions and removals; a popped
/// pair evicts only reservations that are expired now, so a stale pair is harmless. When stale
/// pairs outnumber reservations the queue keeps only its current pairs (a lookup each), so it
/// stays within twice the reservations plus a constant, and each filtering is paid for by the
/// pushes since the last one. Completed records need no queue: their segments are in expiry order.
#[derive(Default)]
struct Shard {
    table: HashTable<Slot>,
    reserved_expiry: BinaryHeap<Reverse<(Millis, u32)>>,
    reserved: Reservations,
    segments: Segments,
    owners: Owners,
    /// Bytes of segments that hold no record any more (forgotten, taken over), until the sweep
    /// passes them.
    hole_bytes: usize,
    /// The records a walk has read and will pass (see [`MemoryStore::evict_expired`]): kept
    /// between walks, so that a walk neither allocates nor fills a buffer it may not use.
    ahead: Vec<Ahead>,
}

impl Shard {
    /// Records that the reservation whose slot keeps `check` now expires at `expires_at`.
    fn queue(&mut self, check: u32, expires_at: Millis) {
        self.reserved_expiry.push(Reverse((expires_at, check)));
        if self.reserved_expiry.len() > 2 * self.reserved.len() + 64 {
            // Filtered in the queue's own buffer: no allocation with the shard locked.
            let mut pairs = std::mem::take(&mut self.reserved_expiry).into_vec();
            let (table, reserved) = (&self.table, &self.reserved);
            pairs.retain(|&Reverse((due, check))| {
                table
                    .find(table_hash(check), |s| {
                        s.check == check
                            && matches!(s.place(), Place::Reserved(r) if reserved[r].expires_at == due)
                    })
                    .is_some()
            });
            pairs.dedup();
            self.reserved_expiry = BinaryHeap::from(pairs);
        }
    }

    /// Whether a claim may add one more reservation: each may open a segment when it completes.
    fn has_room_for_a_segment(&self) -> bool {
        self.segments.in_use() + self.reserved.len() < MAX_SEGMENTS
    }
}

/// A shard's records, read: what a slot's place names.
#[derive(Clone, Copy)]
struct Records<'a> {
    segments: &'a Segments,
    reserved: &'a Reservations,
    owners: &'a Owners,
}

/// What [`Records::matching`] found: a reservation, or a completed record read in its segment.
#[derive(Clone, Copy)]
enum Found<'a> {
    Reserved,
    Completed(Record<'a>),
}

impl<'a> Records<'a> {
    fn of(shard: &'a Shard) -> Self {
        Self {
            segments: &shard.segments,
            reserved: &shard.reserved,
            owners: &shard.owners,
        }
    }

    /// Whether `slot` is the record of `(scope, key)`.
    fn is(self, slot: &Slot, check: u32, scope: &ScopeHash, key: &str) -> bool {
        self.matching(slot, check, scope, key).is_some()
    }

    /// [`is`](Self::is), keeping what it read: a completed record's segment entry, so that a
    /// claim that finds it reads it once.
    fn matching(self, slot: &Slot, check: u32, scope: &ScopeHash, key: &str) -> Option<Found<'a>> {
        if slot.check != check {
            return None;
        }
        match slot.place() {
            Place::Reserved(r) => (self.reserved[r].scope == *scope
                && self.reserved[r].key() == key)
                .then_some(Found::Reserved),
            Place::Completed(loc) => {
                let rec = self.segments.get(loc);
                (rec.key() == key.as_bytes()
                    && rec
                        .owner()
                        .is_some_and(|id| self.owners[id].scope == *scope))
                .then_some(Found::Completed(rec))
            }
        }
    }

    fn token(self, slot: &Slot) -> FencingToken {
        match slot.place() {
            Place::Reserved(r) => self.reserved[r].token,
            Place::Completed(loc) => self.segments.get(loc).token(),
        }
    }

    fn expires_at(self, slot: &Slot) -> Millis {
        match slot.place() {
            Place::Reserved(r) => self.reserved[r].expires_at,
            Place::Completed(loc) => self.segments.get(loc).expires_at(),
        }
    }

    /// What stands in `slot` by `now`. A completed record is read from its segment once.
    fn standing(self, slot: &Slot, now: Millis) -> Standing {
        let found = match slot.place() {
            Place::Reserved(_) => Found::Reserved,
            Place::Completed(loc) => Found::Completed(self.segments.get(loc)),
        };
        self.standing_of(slot, found, now)
    }

    /// [`standing`](Self::standing) of what [`matching`](Self::matching) found in `slot`.
    fn standing_of(self, slot: &Slot, found: Found<'a>, now: Millis) -> Standing {
        let (token, fingerprint, expires_at, state) = match (slot.place(), found) {
            (Place::Reserved(r), _) => {
                let r = &self.reserved[r];
                let state = if now >= r.expires_at {
                    StandingState::Expired
                } else if now < r.lease_until {
                    StandingState::Running {
                        lease_left: Duration::from_millis(r.lease_until - now),
                    }
                } else {
                    StandingState::Abandoned
                };
                (r.token, r.fingerprint, r.expires_at, state)
            }
            (Place::Completed(loc), found) => {
                let rec = match found {
                    Found::Completed(rec) => rec,
                    Found::Reserved => self.segments.get(loc),
                };
                let expires_at = rec.expires_at();
                let state = if now >= expires_at {
                    StandingState::Expired
                } else {
                    StandingState::Completed(Arc::new(rec.response()))
                };
                (rec.token(), rec.fingerprint(), expires_at, state)
            }
        };
        let expires_in = matches!(state, StandingState::Completed(_))
            .then(|| Duration::from_millis(expires_at - now));
        Standing {
            token,
            fingerprint,
            state,
            expires_in,
        }
    }

    /// Whether a reclaim may take `slot` over by `now`: expired, or a reservation whose lease
    /// lapsed.
    fn takeable(self, slot: &Slot, now: Millis) -> bool {
        now >= self.expires_at(slot)
            || matches!(slot.place(), Place::Reserved(r) if now >= self.reserved[r].lease_until)
    }
}

/// Most queue pairs or holes one call passes per eviction it may make: bounds how long a shard
/// lock is held when the front of a queue is stale pairs or holes.
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
    /// The shard a sweep's next slice starts at: where the last one stopped, so that slices do
    /// not walk again the shards that earlier slices have already emptied.
    sweep_from: AtomicUsize,
    /// Slots and records the expiry code has looked at, so a test can tell a sweep that visits
    /// only what expires from one that scans the shard.
    #[cfg(test)]
    slot_visits: AtomicUsize,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (mut holes, mut own) = (0, 0);
        for shard in self.shards.iter() {
            let shard = lock(shard);
            holes += shard.hole_bytes;
            own += shard.segments.own_allocations;
        }
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("bytes", &self.bytes())
            .field("hole_bytes", &holes)
            .field("own_segments", &own)
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
        let shards = (0..self.shards)
            .map(|_| {
                Mutex::new(Shard {
                    ahead: Vec::with_capacity(READ_AHEAD),
                    ..Shard::default()
                })
            })
            .collect();
        let quotas = (0..self.shards).map(|_| Mutex::default()).collect();
        MemoryStore {
            shards,
            quotas,
            hasher: Default::default(),
            records: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            limits: self.limits,
            clock: self.clock,
            sweep_from: AtomicUsize::new(0),
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
    // A panic while holding a shard cannot leave an entry half-written (every mutation of the
    // index is a single table operation, made after the segment write it points at), so a
    // poisoned shard is still consistent.
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

    /// The 32 bits of the record's hash its slot keeps (and its record's header, so the sweep
    /// finds the slot without hashing again), and its shard. Bits 40.. pick the shard, so the
    /// table inside has the low 32 at full entropy.
    fn locate(&self, scope: &ScopeHash, key: &str) -> (u32, &Mutex<Shard>) {
        let hash = self.hasher.hash_one((scope, key));
        let shard = (hash >> 40) as usize & (self.shards.len() - 1);
        (hash as u32, &self.shards[shard])
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

    /// Frees a record's charge: all of it from its scope, all but `kept` from the store (the
    /// bytes of a hole it leaves in a segment, freed when the sweep passes it).
    fn discharge(&self, weight: usize, bucket: u64, kept: usize) {
        self.bytes.fetch_sub(weight - kept, Ordering::AcqRel);
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

    /// Frees the charges of what a walk passed: `records` records and `bytes` bytes (holes'
    /// included) from the store, and each record's weight from its scope's share, taking a
    /// quota shard's lock once for a run of records whose buckets it holds.
    fn discharge_swept(&self, records: usize, bytes: usize, passed: &[Ahead]) {
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.records.fetch_sub(records, Ordering::AcqRel);
        let quota_shard = |a: &Ahead| a.bucket as usize & (self.quotas.len() - 1);
        let mut removed = passed.iter().filter(|a| a.owner.is_some()).peekable();
        while let Some(first) = removed.next() {
            let mut quotas = lock(self.quota_shard(first.bucket));
            let mut next = Some(first);
            while let Some(a) = next {
                if let Some(share) = quotas.get_mut(&a.bucket) {
                    share.records -= 1;
                    share.bytes -= a.weight;
                    if share.records == 0 {
                        quotas.remove(&a.bucket);
                    }
                }
                next = removed.next_if(|b| quota_shard(b) == quota_shard(first));
            }
        }
    }

    /// Adjusts the byte charge of a record that stays (its response recorded, a takeover): its
    /// scope's share from `from` to `to`, the store's from `from - kept` to `to` (`kept`: the
    /// bytes of a hole the old record leaves in a segment, still held). Shrinking always
    /// succeeds; growing fails (and changes nothing) past either bound.
    fn recharge(&self, bucket: u64, from: usize, to: usize, kept: usize) -> Result<(), StoreError> {
        let mut quotas = lock(self.quota_shard(bucket));
        let share = quotas.entry(bucket).or_default();
        if to > from && share.bytes.saturating_add(to - from) > self.limits.max_bytes_per_scope {
            return Err(StoreError::QuotaExceeded);
        }
        let released = from - kept;
        if to > released {
            let extra = to - released;
            if self.bytes.fetch_add(extra, Ordering::AcqRel) + extra > self.limits.max_bytes {
                self.bytes.fetch_sub(extra, Ordering::AcqRel);
                return Err(StoreError::Full);
            }
        } else {
            self.bytes.fetch_sub(released - to, Ordering::AcqRel);
        }
        share.bytes = share.bytes - from + to;
        Ok(())
    }

    fn reservation_weight(&self, req: &ClaimRequest<'_>) -> usize {
        // The answer's room is set aside now, so completing never needs more.
        ENTRY_OVERHEAD + req.key.len() + req.route.len() + self.limits.response_headroom
    }

    /// Inserts a fresh reservation into an empty slot, charging the bounds. When a bound is hit,
    /// frees this shard's expired records once and tries again.
    fn insert_new(
        &self,
        shard: &mut Shard,
        check: u32,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Claim, StoreError> {
        if !shard.has_room_for_a_segment() {
            return Err(StoreError::Full);
        }
        let weight = self.reservation_weight(req);
        if let Err(full) = self.charge(weight, req.quota_bucket) {
            if self.evict_expired(shard, now, EVICT_WHEN_FULL).freed == 0 {
                return Err(full);
            }
            self.charge(weight, req.quota_bucket)?;
        }
        let (idx, expires_at) = shard.reserved.add(req, now, weight);
        shard
            .table
            .insert_unique(table_hash(check), Slot::reserved(check, idx), |s| {
                table_hash(s.check)
            });
        // After the slot is in the table: queueing may filter the queue by the table, and a
        // pair whose slot is not there yet would be dropped as stale, the reservation never
        // swept.
        shard.queue(check, expires_at);
        Ok(Claim::Acquired)
    }

    /// Replaces the takeable record of `req` (its slot keeps `check`) with a fresh reservation.
    fn take_over(
        &self,
        shard: &mut Shard,
        check: u32,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Claim, StoreError> {
        let weight = self.reservation_weight(req);
        let room = shard.has_room_for_a_segment();
        let Shard {
            table,
            segments,
            reserved,
            owners,
            hole_bytes,
            ..
        } = shard;
        let records = Records {
            segments,
            reserved,
            owners,
        };
        let slot = table
            .find_mut(table_hash(check), |s| {
                records.is(s, check, req.scope, req.key)
            })
            .expect("the record to take over");
        // Same key, same scope, so the same quota bucket: only the byte charge changes (a
        // reservation with its headroom may outweigh the small record it replaces).
        let expires_at = match slot.place() {
            Place::Reserved(idx) => {
                let old = &mut reserved[idx];
                self.recharge(old.quota_bucket, old.weight, weight, 0)?;
                old.fill(req, now, weight)
            }
            Place::Completed(loc) => {
                if !room {
                    return Err(StoreError::Full);
                }
                let rec = segments.get(loc);
                let hole = rec.len();
                let id = rec.owner().expect("a record in the index is no hole");
                let freed = SLOT_OVERHEAD + hole + owners.freed_by_release(id);
                self.recharge(owners[id].bucket, freed, weight, hole)?;
                owners.release(&self.hasher, id);
                segments.make_hole(loc);
                *hole_bytes += hole;
                let (idx, expires_at) = reserved.add(req, now, weight);
                *slot = Slot::reserved(check, idx);
                expires_at
            }
        };
        shard.queue(check, expires_at);
        Ok(Claim::Acquired)
    }

    /// Frees up to `limit` records expired at `now`: reservations in expiry order from the
    /// shard's queue, completed records from the front of each segment group. Visits only queue
    /// pairs and records that are due or holes (at most [`POPS_PER_EVICTION`] per record it may
    /// free) and the slots they name: the work is proportional to what expires, not to what the
    /// shard holds. When that bound stops it first, more may be due: [`Evicted::cut_short`].
    fn evict_expired(&self, shard: &mut Shard, now: Millis, limit: usize) -> Evicted {
        let mut freed = 0;
        let mut pops = limit.saturating_mul(POPS_PER_EVICTION);
        while freed < limit && pops > 0 {
            let Some(&Reverse((due, check))) = shard.reserved_expiry.peek() else {
                break;
            };
            if due > now {
                break;
            }
            shard.reserved_expiry.pop();
            pops -= 1;
            // Another record may share the 32 bits; each is judged by its own expiry.
            while freed < limit {
                #[cfg(test)]
                self.slot_visits.fetch_add(1, Ordering::Relaxed);
                let reserved = &shard.reserved;
                let Ok(found) = shard.table.find_entry(table_hash(check), |s| {
                    s.check == check
                        && matches!(s.place(), Place::Reserved(r) if now >= reserved[r].expires_at)
                }) else {
                    break;
                };
                let (slot, _) = found.remove();
                let Place::Reserved(idx) = slot.place() else {
                    unreachable!("found as a reservation")
                };
                let (weight, bucket) = shard.reserved.remove(idx);
                self.discharge(weight, bucket, 0);
                freed += 1;
            }
        }
        let mut q = 0;
        while q < shard.segments.queues() && freed < limit && pops > 0 {
            let Shard {
                table,
                segments,
                owners,
                hole_bytes,
                ahead,
                ..
            } = &mut *shard;
            let Some(first) = segments.front(q) else {
                q += 1;
                continue;
            };
            // The records are read first, as far as this segment, the limits and the first
            // record not due allow; their slots are looked up afterwards, back to back, so the
            // lookups' cache misses (the index is far larger than the caches) overlap instead of
            // each waiting behind the previous record's charge updates.
            ahead.clear();
            let (mut next, mut not_due) = (Some(first), false);
            while let Some(loc) = next {
                #[cfg(test)]
                self.slot_visits.fetch_add(1, Ordering::Relaxed);
                let rec = segments.get(loc);
                let (len, owner) = (rec.len(), rec.owner());
                match owner {
                    None => pops -= 1,
                    // Not due: neither is anything behind it in this group.
                    Some(_) if now < rec.expires_at() => {
                        not_due = true;
                        break;
                    }
                    Some(_) => freed += 1,
                }
                ahead.push(Ahead {
                    loc,
                    len,
                    check: rec.check(),
                    owner,
                    bucket: 0,
                    weight: 0,
                });
                if ahead.len() == READ_AHEAD || freed >= limit || pops == 0 {
                    break;
                }
                next = segments.after(loc, len);
            }
            for a in ahead.iter().filter(|a| a.owner.is_some()) {
                table
                    .find_entry(
                        table_hash(a.check),
                        |s| matches!(s.place(), Place::Completed(l) if l == a.loc),
                    )
                    .expect("a completed record's slot")
                    .remove();
            }
            let (mut passed, mut bytes, mut records) = (0, 0, 0);
            for a in ahead.iter_mut() {
                passed += a.len;
                match a.owner {
                    None => {
                        *hole_bytes -= a.len;
                        bytes += a.len;
                    }
                    Some(id) => {
                        let (bucket, owner_freed) = owners.release(&self.hasher, id);
                        a.bucket = bucket;
                        a.weight = SLOT_OVERHEAD + a.len + owner_freed;
                        bytes += a.weight;
                        records += 1;
                    }
                }
            }
            // Only now that their slots are gone: a segment passed entirely is reused, and no
            // slot may name a record in it.
            if passed > 0 {
                segments.pass(first, passed);
            }
            self.discharge_swept(records, bytes, ahead);
            if not_due {
                q += 1;
            }
        }
        // A group the walk emptied gives its segment back now, not at its next record.
        for q in 0..shard.segments.queues() {
            let _ = shard.segments.front(q);
        }
        shard.segments.drop_empty_queues();
        Evicted {
            freed,
            cut_short: freed < limit && pops == 0,
        }
    }
}

/// Records a walk reads ahead of dropping their slots: a segment of small answers holds a few
/// hundred, and a sweep's slice is 64.
const READ_AHEAD: usize = 64;

/// A record a walk has read and will pass.
struct Ahead {
    loc: Loc,
    len: usize,
    check: u32,
    /// `None` for a hole.
    owner: Option<u32>,
    /// Its quota bucket and the charge its removal frees, once its owner is released.
    bucket: u64,
    weight: usize,
}

/// What one [`MemoryStore::evict_expired`] walk did.
struct Evicted {
    freed: usize,
    /// The walk spent its visits on stale queue pairs and holes before freeing its limit:
    /// expired records may remain, and a sweep must not take the shortfall for "nothing due".
    cut_short: bool,
}

/// Records evicted between two yields of a sweep: about 100 µs of work.
const SWEEP_SLICE: usize = 64;

impl Store for MemoryStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = self.clock.monotonic_millis();
        let (check, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        let records = Records::of(&shard);
        let mut read = None;
        let found = shard
            .table
            .find(table_hash(check), |s| {
                read = records.matching(s, check, req.scope, req.key);
                read.is_some()
            })
            .copied();
        let Some(slot) = found else {
            return self.insert_new(&mut shard, check, req, now);
        };
        let read = read.expect("the match that found the slot kept what it read");
        // One read of a completed record's segment: the match's, for what stands, expired or
        // not.
        let standing = records.standing_of(&slot, read, now);
        if matches!(standing.state, StandingState::Expired) {
            self.take_over(&mut shard, check, req, now)
        } else {
            Ok(Claim::Standing(standing))
        }
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        let now = self.clock.monotonic_millis();
        let (check, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        let records = Records::of(&shard);
        let found = shard
            .table
            .find(table_hash(check), |s| {
                records.is(s, check, req.scope, req.key)
            })
            .copied();
        match found {
            Some(slot)
                if now >= records.expires_at(&slot)
                    || (records.token(&slot) == stale && records.takeable(&slot, now)) =>
            {
                self.take_over(&mut shard, check, req, now)
            }
            Some(slot) => Ok(Claim::Standing(records.standing(&slot, now))),
            None => self.insert_new(&mut shard, check, req, now),
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
        let (check, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let Shard {
            table,
            segments,
            reserved,
            owners,
            ..
        } = &mut *shard;
        let records = Records {
            segments,
            reserved,
            owners,
        };
        let Some(slot) = table.find_mut(table_hash(check), |s| records.is(s, check, scope, key))
        else {
            return Ok(false);
        };
        let idx = match slot.place() {
            // A resent completion that finds its own record: it is done.
            Place::Completed(loc) => {
                let rec = segments.get(loc);
                return Ok(rec.token() == token && rec.holds(response));
            }
            Place::Reserved(idx) if reserved[idx].token == token => idx,
            Place::Reserved(_) => return Ok(false),
        };
        let r = &reserved[idx];
        let parts = Parts {
            token,
            check,
            created_at: r.created_at,
            completed_at: now,
            fingerprint: r.fingerprint,
            key,
            response,
        };
        let (lens, total) = parts.lengths().ok_or(StoreError::Full)?;
        let owner = owners.find(&self.hasher, scope, r.quota_bucket, r.route());
        let weight = SLOT_OVERHEAD + total + owner.map_or(owner_charge(r.route()), |_| 0);
        // Within the headroom set aside at the claim this only shrinks; an answer larger than
        // the headroom may be refused here, and the runtime then releases the key.
        self.recharge(r.quota_bucket, r.weight, weight, 0)?;
        let owner = owners.hold(&self.hasher, owner, (scope, r.quota_bucket, r.route()));
        let loc = segments.append(millis(retention), &parts, owner, lens, total);
        *slot = Slot::completed(check, loc);
        reserved.remove(idx);
        Ok(true)
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let (check, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let Shard {
            table,
            segments,
            reserved,
            owners,
            ..
        } = &mut *shard;
        let records = Records {
            segments,
            reserved,
            owners,
        };
        match table.find_entry(table_hash(check), |s| records.is(s, check, scope, key)) {
            Ok(found) if matches!(found.get().place(), Place::Reserved(r) if reserved[r].token == token) =>
            {
                let (slot, _) = found.remove();
                let Place::Reserved(idx) = slot.place() else {
                    unreachable!("checked above")
                };
                let (weight, bucket) = reserved.remove(idx);
                self.discharge(weight, bucket, 0);
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
        let (check, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let records = Records::of(&shard);
        let Some(slot) = shard
            .table
            .find(table_hash(check), |s| records.is(s, check, scope, key))
            .copied()
        else {
            return Ok(false);
        };
        let Place::Reserved(idx) = slot.place() else {
            return Ok(false);
        };
        let r = &mut shard.reserved[idx];
        if r.token != token {
            return Ok(false);
        }
        r.lease_until = now.saturating_add(millis(lease));
        r.expires_at = r.lease_until.saturating_add(r.retention);
        let expires_at = r.expires_at;
        shard.queue(check, expires_at);
        Ok(true)
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        let now = self.clock.monotonic_millis();
        let mut deleted = 0;
        // A slice at a time, yielding between slices, so that a batch of 500 never holds the
        // worker for long and a sweep of many batches does not show in a one-worker server's p99.
        while deleted < batch {
            let slice = (batch - deleted).min(SWEEP_SLICE);
            let mut freed = 0;
            let mut cut_short = false;
            let from = self.sweep_from.load(Ordering::Relaxed);
            for i in 0..self.shards.len() {
                let at = (from + i) & (self.shards.len() - 1);
                let evicted = self.evict_expired(&mut lock(&self.shards[at]), now, slice - freed);
                freed += evicted.freed;
                cut_short |= evicted.cut_short;
                if freed >= slice {
                    // This shard may hold more that is due: the next slice starts here.
                    self.sweep_from.store(at, Ordering::Relaxed);
                    break;
                }
            }
            deleted += freed;
            // Each walk cut short has dropped the stale pairs and holes it visited, so going
            // on makes progress; only a slice short of its limit with nothing cut short means
            // nothing more is due.
            if freed < slice && !cut_short {
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
        let (check, shard) = self.locate(scope, key);
        let shard = lock(shard);
        let records = Records::of(&shard);
        let Some(slot) = shard
            .table
            .find(table_hash(check), |s| records.is(s, check, scope, key))
        else {
            return Ok(None);
        };
        let expires_at = records.expires_at(slot);
        let mut info = match slot.place() {
            Place::Reserved(idx) => {
                let r = &shard.reserved[idx];
                let mut info = RecordInfo::new(
                    RecordState::judge(false, wall(now), wall(r.lease_until), wall(expires_at)),
                    wall(expires_at),
                );
                info.route = Some(r.route().to_owned());
                info.created_at = Some(wall(r.created_at));
                info.lease_until = Some(wall(r.lease_until));
                info
            }
            Place::Completed(loc) => {
                let rec = shard.segments.get(loc);
                let owner = rec.owner().expect("a record in the index is no hole");
                let mut info = RecordInfo::new(
                    RecordState::judge(true, wall(now), wall(0), wall(expires_at)),
                    wall(expires_at),
                );
                info.status = Some(rec.status());
                info.route = Some(shard.owners[owner].route.clone());
                info.created_at = Some(wall(rec.created_at()));
                info.completed_at = Some(wall(rec.completed_at()));
                info.body_bytes = rec.body().len();
                info.header_bytes = rec.headers().len();
                info.response = with_response.then(|| Arc::new(rec.response()));
                info
            }
        };
        info.expires_at = wall(expires_at);
        Ok(Some(info))
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        let (check, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        let Shard {
            table,
            segments,
            reserved,
            owners,
            hole_bytes,
            ..
        } = &mut *shard;
        let records = Records {
            segments,
            reserved,
            owners,
        };
        let Ok(found) = table.find_entry(table_hash(check), |s| records.is(s, check, scope, key))
        else {
            return Ok(false);
        };
        let (slot, _) = found.remove();
        match slot.place() {
            Place::Reserved(idx) => {
                let (weight, bucket) = reserved.remove(idx);
                self.discharge(weight, bucket, 0);
            }
            Place::Completed(loc) => {
                let rec = segments.get(loc);
                let len = rec.len();
                let id = rec.owner().expect("a record in the index is no hole");
                let (bucket, owner_freed) = owners.release(&self.hasher, id);
                segments.make_hole(loc);
                *hole_bytes += len;
                self.discharge(SLOT_OVERHEAD + len + owner_freed, bucket, len);
            }
        }
        Ok(true)
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

    fn into_backend(self: Arc<Self>) -> super::Backend {
        super::Backend::memory(self)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::{contract, header_bytes};

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
    fn an_index_slot_is_small_and_fixed_whatever_the_record_holds() {
        // 32 bits of the hash and a reservation's entry or a segment's place: 8 bytes, so the
        // table's slack costs little beside a record's bytes in its segment.
        assert_eq!(std::mem::size_of::<Slot>(), 8);
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

/// Sweeps in batches of 500 until a batch frees fewer: everything due. The records freed.
#[cfg(test)]
async fn sweep_all(store: &MemoryStore) -> usize {
    let mut n = 0;
    loop {
        let swept = store.sweep(500).await.unwrap();
        n += swept;
        if swept < 500 {
            return n;
        }
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

    /// A store of `shards` without per-scope bounds or headroom.
    fn unbounded(clock: &ManualClock, shards: usize) -> MemoryStore {
        MemoryStore::builder()
            .clock(clock.clone())
            .shards(shards)
            .limits(MemoryLimits {
                max_records_per_scope: usize::MAX,
                max_bytes_per_scope: usize::MAX,
                response_headroom: 0,
                ..MemoryLimits::default()
            })
            .build()
    }

    /// Claims `key` of scope `[9; 32]` for `secs` and, when `complete`, completes it with the
    /// same retention (which moves its expiry, leaving a stale pair in the queue).
    async fn claimed(store: &MemoryStore, key: &str, secs: u64, complete: bool) {
        let scope = [9; 32];
        let req = claim_req(&scope, key, secs);
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        if complete {
            let resp = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"{}"));
            let retention = Duration::from_secs(secs);
            assert!(
                store
                    .complete(&scope, key, req.token, &resp, retention)
                    .await
                    .unwrap()
            );
        }
    }

    /// `expiring` records that expire in 2 s beside `live` ones that outlive the test.
    async fn store_with(clock: &ManualClock, expiring: usize, live: usize) -> MemoryStore {
        let store = unbounded(clock, 4);
        for i in 0..expiring + live {
            let secs = if i < expiring { 1 } else { 3600 };
            claimed(&store, &format!("k{i}"), secs, i % 2 == 0).await;
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
        assert_eq!(sweep_all(&store).await, 1_000);
        assert_eq!(store.len(), 50_000, "every live record stays");
        let visits = store.slot_visits.load(Ordering::Relaxed);
        // A scan per batch would visit every slot of every shard each time: 51,000 at least.
        assert!(
            visits <= 3 * 1_000,
            "{visits} slot visits to free 1,000 records among 51,000"
        );
    }

    #[tokio::test]
    async fn a_sweep_does_not_walk_again_the_shards_its_slices_emptied() {
        let clock = ManualClock::new();
        let store = unbounded(&clock, 64);
        for i in 0..12_800 {
            claimed(&store, &format!("k{i}"), 1, true).await;
        }
        // Enough to make each shard's reservation queue drop the expiring records' stale
        // pairs, which would be visits of their own.
        for i in 0..6_400 {
            claimed(&store, &format!("live{i}"), 3600, true).await;
        }
        clock.advance(Duration::from_secs(3));
        assert_eq!(sweep_all(&store).await, 12_800);
        assert_eq!(store.len(), 6_400, "every live record stays");
        // Beyond the records freed, a visit reads a shard's live front to learn that nothing
        // more is due there. Slices that each started at the first shard would read again every
        // shard the earlier ones emptied: about 6,400 visits more here.
        let visits = store.slot_visits.load(Ordering::Relaxed);
        assert!(
            visits <= 12_800 + 640,
            "{visits} slot visits to free 12,800 records from 64 shards"
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

    #[tokio::test]
    async fn a_sweep_is_not_cut_short_by_stale_queue_pairs() {
        // Live reservations let the reservation queue keep many stale pairs: here 250, all
        // due, ahead of the 250 completed records the sweep must free.
        let clock = ManualClock::new();
        let store = unbounded(&clock, 1);
        for i in 0..100 {
            claimed(&store, &format!("live{i}"), 3600, false).await;
        }
        for i in 0..250 {
            claimed(&store, &format!("k{i}"), 1, true).await;
        }
        clock.advance(Duration::from_secs(3));
        // A batch that frees fewer than asked tells the sweeper nothing more is due: each
        // batch of 10 frees 10 until the 250 are gone.
        for _ in 0..25 {
            assert_eq!(store.sweep(10).await.unwrap(), 10);
        }
        assert_eq!(store.sweep(10).await.unwrap(), 0);
        assert_eq!(store.len(), 100);
    }

    #[tokio::test]
    async fn a_reservation_whose_claim_filtered_the_queue_is_still_swept() {
        // One shard: 66 completed records leave 66 stale pairs, and the 67th claim's pair
        // makes the queue filter itself by the table as it is pushed.
        let clock = ManualClock::new();
        let store = unbounded(&clock, 1);
        for i in 0..66 {
            claimed(&store, &format!("k{i}"), 1, true).await;
        }
        claimed(&store, "left", 1, false).await;
        clock.advance(Duration::from_secs(3));
        assert_eq!(store.sweep(500).await.unwrap(), 67);
        assert_eq!(store.len(), 0, "an expired reservation was never swept");
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
        // Paused time never advances while this task yields: a sweeper that stopped early
        // and waits for its next tick would never come back, so the turns are bounded.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100_000 {
            if store.len() <= 10 {
                break;
            }
            seen.insert(store.len());
            tokio::task::yield_now().await;
        }
        assert_eq!(
            store.len(),
            10,
            "the sweeper stopped with expired records left"
        );
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

#[cfg(test)]
mod segment_tests {
    use bytes::Bytes;

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::header_bytes;

    fn claim_req<'a>(scope: &'a ScopeHash, key: &'a str) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: 1,
            fingerprint: Fingerprint {
                version: 1,
                digest: [3; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(60),
            route: "/test",
            response_room: 0,
        }
    }

    /// One shard, so a test sees every record's segment.
    fn store(clock: &ManualClock, headroom: usize) -> MemoryStore {
        MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .limits(MemoryLimits {
                max_records_per_scope: usize::MAX,
                max_bytes_per_scope: usize::MAX,
                max_bytes: usize::MAX,
                response_headroom: headroom,
                ..MemoryLimits::default()
            })
            .build()
    }

    fn answer(body: usize) -> RecordedResponse {
        RecordedResponse::new(
            201,
            vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            Bytes::from(vec![b'o'; body]),
        )
    }

    async fn record(store: &MemoryStore, scope: &ScopeHash, key: &str, body: usize, secs: u64) {
        let req = claim_req(scope, key);
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired, "{key}");
        let done = store
            .complete(
                scope,
                key,
                req.token,
                &answer(body),
                Duration::from_secs(secs),
            )
            .await;
        assert!(done.unwrap(), "{key}");
    }

    fn counts(store: &MemoryStore) -> (usize, usize) {
        lock(&store.shards[0]).segments.counts()
    }

    fn holes(store: &MemoryStore) -> usize {
        lock(&store.shards[0]).hole_bytes
    }

    /// A completed record's charge is its bytes in its segment and its slot, nothing guessed:
    /// the fixed header, six variable-length integers (the fingerprint's version, no time
    /// between claim and completion, then the lengths), the key, the headers and the body.
    fn charge(key: &str, body: usize) -> usize {
        let headers = header_bytes(&answer(body).headers);
        let varints = [1, 0, key.len(), headers, body, 0]
            .map(|v| segment::varint_len(v as u64))
            .iter()
            .sum::<usize>();
        SLOT_OVERHEAD + segment::FIXED_HEADER + varints + key.len() + headers + body
    }

    /// What the owner entry of these tests' records (one scope, one route) is charged while a
    /// record names it.
    fn owner() -> usize {
        OWNER_OVERHEAD + "/test".len()
    }

    #[tokio::test]
    async fn a_claim_reuses_the_entry_of_a_finished_reservation() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [6; 32];
        for i in 0..100 {
            let key = format!("key-{i}");
            if i % 2 == 0 {
                record(&store, &scope, &key, 10, 60).await;
            } else {
                let req = claim_req(&scope, &key);
                assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
                assert!(store.release(&scope, &key, req.token).await.unwrap());
            }
        }
        let shard = lock(&store.shards[0]);
        assert_eq!(
            shard.reserved.slab.len(),
            1,
            "one request in flight at a time"
        );
        assert_eq!(shard.reserved.len(), 0);
    }

    /// The steady state of a long-running service: records arrive at a constant rate, and the
    /// sweeper (once a retention) frees those that expired. Once the first records have expired
    /// and been swept, the shard never allocates a segment again: each sweep keeps what it
    /// retires for the appends until the next one.
    #[tokio::test]
    async fn a_steady_shard_reuses_its_segments_and_allocates_none_once_settled() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [1; 32];
        let (retention, tick) = (2, Duration::from_millis(100));
        let mut fresh_when_settled = None;
        for step in 0..400u32 {
            for i in 0..50 {
                record(&store, &scope, &format!("k{step}-{i}"), 1_024, retention).await;
            }
            clock.advance(tick);
            if step % 20 == 19 {
                sweep_all(&store).await;
            }
            if step == 99 {
                fresh_when_settled = Some(lock(&store.shards[0]).segments.fresh);
            }
        }
        let settled = fresh_when_settled.expect("settled");
        let fresh = lock(&store.shards[0]).segments.fresh;
        assert!(settled > 0);
        assert_eq!(
            fresh,
            settled,
            "{} segments allocated after the churn settled",
            fresh - settled
        );
    }

    #[tokio::test]
    async fn expired_segments_are_reused_not_allocated_again() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [1; 32];
        for i in 0..500 {
            record(&store, &scope, &format!("k{i:03}"), 1_024, 1).await;
        }
        let (in_use, spare) = counts(&store);
        assert!(in_use >= 8, "500 answers of 1 KiB take {in_use} segments");
        assert_eq!(spare, 0);
        assert_eq!(store.bytes(), 500 * charge("k000", 1_024) + owner());
        clock.advance(Duration::from_secs(2));
        assert_eq!(sweep_all(&store).await, 500);
        assert_eq!((store.len(), store.bytes()), (0, 0));
        let (in_use, spare) = counts(&store);
        assert_eq!(in_use, 0, "every segment was walked through");
        assert!(spare > 0, "no segment kept for reuse");
        // The next records go into a kept segment.
        record(&store, &scope, "again", 1_024, 1).await;
        assert_eq!(counts(&store), (1, spare - 1));
    }

    #[tokio::test]
    async fn a_forgotten_record_leaves_a_counted_hole_until_its_segment_expires() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [2; 32];
        record(&store, &scope, "a", 300, 10).await;
        record(&store, &scope, "b", 300, 10).await;
        let (a, b) = (charge("a", 300), charge("b", 300));
        assert_eq!(store.bytes(), a + b + owner());
        assert!(store.forget(&scope, "a").await.unwrap());
        assert_eq!(store.len(), 1);
        // The scope is charged for what it holds; the store for the memory it holds.
        let share = lock(store.quota_shard(1)).get(&1).copied().unwrap();
        assert_eq!((share.records, share.bytes), (1, b + owner()));
        assert_eq!(holes(&store), a - SLOT_OVERHEAD);
        assert_eq!(store.bytes(), b + owner() + a - SLOT_OVERHEAD);
        assert!(store.inspect(&scope, "a", false).await.unwrap().is_none());
        clock.advance(Duration::from_secs(11));
        assert_eq!(sweep_all(&store).await, 1, "a hole is not a record");
        assert_eq!((store.len(), store.bytes(), holes(&store)), (0, 0, 0));
        assert!(store.quotas.iter().all(|q| lock(q).is_empty()));
    }

    #[tokio::test]
    async fn a_takeover_of_an_expired_answer_leaves_a_hole_reclaimed_with_its_segment() {
        let clock = ManualClock::new();
        let store = store(&clock, 0);
        let scope = [3; 32];
        record(&store, &scope, "k", 300, 1).await;
        clock.advance(Duration::from_secs(2));
        let again = claim_req(&scope, "k");
        assert_eq!(store.claim(&again).await.unwrap(), Claim::Acquired);
        let hole = charge("k", 300) - SLOT_OVERHEAD;
        assert_eq!(holes(&store), hole);
        assert_eq!(
            store.bytes(),
            hole + ENTRY_OVERHEAD + "k".len() + "/test".len()
        );
        assert_eq!(sweep_all(&store).await, 0, "the new reservation is live");
        assert_eq!(holes(&store), 0);
        assert_eq!(store.bytes(), ENTRY_OVERHEAD + "k".len() + "/test".len());
        assert!(store.release(&scope, "k", again.token).await.unwrap());
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }

    #[tokio::test]
    async fn an_answer_larger_than_a_segment_gets_its_own_allocation() {
        let clock = ManualClock::new();
        let store = store(&clock, 256 << 10);
        let scope = [4; 32];
        let big = segment::SEGMENT_BYTES + 1;
        record(&store, &scope, "big", big, 1).await;
        record(&store, &scope, "small", 10, 1).await;
        assert_eq!(lock(&store.shards[0]).segments.own_allocations, 1);
        assert!(
            format!("{store:?}").contains("own_segments: 1"),
            "{store:?}"
        );
        assert_eq!(counts(&store), (2, 0));
        match store.claim(&claim_req(&scope, "big")).await.unwrap() {
            Claim::Standing(Standing {
                state: StandingState::Completed(replayed),
                ..
            }) => assert_eq!(*replayed, answer(big)),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            store.bytes(),
            charge("big", big) + charge("small", 10) + owner()
        );
        clock.advance(Duration::from_secs(2));
        assert_eq!(sweep_all(&store).await, 2);
        assert_eq!((store.len(), store.bytes()), (0, 0));
        // The large one is freed; only the segment of the usual size is kept.
        assert_eq!(counts(&store), (0, 1));
    }

    /// A record's completion time is a 32-bit offset from its segment's first, and the time
    /// from its claim a variable-length integer: a record completed a month after its segment
    /// opened, by a handler that ran a month, goes into a segment of its own and keeps its
    /// times to the millisecond.
    #[tokio::test]
    async fn a_record_completed_a_month_after_its_segment_opened_keeps_its_times() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [7; 32];
        let month = Duration::from_secs(30 * 86_400);
        let retention = 3 * month;
        let early = claim_req(&scope, "early");
        assert_eq!(store.claim(&early).await.unwrap(), Claim::Acquired);
        let ten = answer(10);
        let done = store.complete(&scope, "early", early.token, &ten, retention);
        assert!(done.await.unwrap());
        clock.advance(month);
        let late = ClaimRequest {
            lease: 2 * month,
            ..claim_req(&scope, "late")
        };
        assert_eq!(store.claim(&late).await.unwrap(), Claim::Acquired);
        clock.advance(month + Duration::from_millis(7));
        let ten = answer(10);
        let done = store.complete(&scope, "late", late.token, &ten, retention);
        assert!(done.await.unwrap());
        assert_eq!(
            counts(&store).0,
            2,
            "an offset past 32 bits opens a segment"
        );
        let (e, l) = (
            store
                .inspect(&scope, "early", false)
                .await
                .unwrap()
                .unwrap(),
            store.inspect(&scope, "late", false).await.unwrap().unwrap(),
        );
        let since = |a: Option<std::time::SystemTime>, b: Option<std::time::SystemTime>| {
            a.unwrap().duration_since(b.unwrap()).unwrap()
        };
        assert_eq!(since(e.completed_at, e.created_at), Duration::ZERO);
        assert_eq!(since(l.created_at, e.completed_at), month);
        assert_eq!(
            since(l.completed_at, l.created_at),
            month + Duration::from_millis(7)
        );
        assert_eq!(since(l.expires_at.into(), l.completed_at), retention);
        for key in ["early", "late"] {
            match store.claim(&claim_req(&scope, key)).await.unwrap() {
                Claim::Standing(Standing {
                    state: StandingState::Completed(replayed),
                    token,
                    ..
                }) => {
                    assert_eq!(*replayed, answer(10), "{key}");
                    let claimed = if key == "early" {
                        early.token
                    } else {
                        late.token
                    };
                    assert_eq!(token, claimed, "{key}");
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        clock.advance(retention + 2 * month);
        assert_eq!(sweep_all(&store).await, 2);
        assert_eq!((store.len(), store.bytes()), (0, 0));
        assert_eq!(counts(&store).0, 0);
    }

    #[tokio::test]
    async fn each_retention_expires_on_its_own_whatever_was_appended_before() {
        let clock = ManualClock::new();
        let store = store(&clock, 4 << 10);
        let scope = [5; 32];
        record(&store, &scope, "long", 100, 3_600).await;
        record(&store, &scope, "short", 100, 1).await;
        record(&store, &scope, "long-2", 100, 3_600).await;
        clock.advance(Duration::from_secs(2));
        assert_eq!(sweep_all(&store).await, 1);
        assert_eq!(store.len(), 2);
        for key in ["long", "long-2"] {
            match store.claim(&claim_req(&scope, key)).await.unwrap() {
                Claim::Standing(Standing {
                    state: StandingState::Completed(replayed),
                    ..
                }) => assert_eq!(*replayed, answer(100), "{key}"),
                other => panic!("{key}: {other:?}"),
            }
        }
        assert_eq!(
            store.claim(&claim_req(&scope, "short")).await.unwrap(),
            Claim::Acquired
        );
        assert_eq!(
            counts(&store).0,
            1,
            "the short retention's segment went back"
        );
    }
}

#[cfg(test)]
mod accounting_tests {
    use std::collections::HashMap as Map;

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::clock::ManualClock;

    #[derive(Debug, Clone)]
    enum Op {
        Claim { key: u8, secs: u8 },
        Complete { key: u8, body: u16, secs: u8 },
        Release { key: u8 },
        Forget { key: u8 },
        Advance { secs: u8 },
        Sweep,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..12, 1u8..4).prop_map(|(key, secs)| Op::Claim { key, secs }),
            3 => (0u8..12, 0u16..3_000, 1u8..4)
                .prop_map(|(key, body, secs)| Op::Complete { key, body, secs }),
            1 => (0u8..12).prop_map(|key| Op::Release { key }),
            1 => (0u8..12).prop_map(|key| Op::Forget { key }),
            2 => (0u8..3).prop_map(|secs| Op::Advance { secs }),
            1 => Just(Op::Sweep),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Whatever happens to records (completed into segments of several retentions, some
        /// larger than a segment, released, forgotten into holes, taken over), once everything
        /// has expired and been swept the store holds nothing and charges nothing: no record,
        /// no byte, no hole, no scope's share, no segment in use.
        #[test]
        fn every_charge_and_segment_comes_back_once_all_has_expired(
            ops in proptest::collection::vec(op(), 1..80)
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let clock = ManualClock::new();
            let store = MemoryStore::builder()
                .clock(clock.clone())
                .shards(2)
                .limits(MemoryLimits {
                    response_headroom: 80 << 10,
                    max_bytes_per_scope: usize::MAX,
                    ..MemoryLimits::default()
                })
                .build();
            rt.block_on(async {
                let scope = [9; 32];
                let keys: Vec<String> = (0..12).map(|k| format!("key-{k}")).collect();
                let mut tokens: Map<u8, FencingToken> = Map::new();
                for op in &ops {
                    match *op {
                        Op::Claim { key, secs } => {
                            let req = ClaimRequest {
                                scope: &scope,
                                key: &keys[key as usize],
                                quota_bucket: 3,
                                fingerprint: Fingerprint { version: 1, digest: [1; 32] },
                                token: FencingToken::mint(),
                                lease: Duration::from_secs(u64::from(secs)),
                                retention: Duration::from_secs(u64::from(secs)),
                                route: "/r",
                                response_room: 0,
                            };
                            let mut got = store.claim(&req).await.unwrap();
                            if let Claim::Standing(st) = &got
                                && matches!(st.state, StandingState::Abandoned)
                            {
                                got = store.reclaim(&req, st.token).await.unwrap();
                            }
                            if got == Claim::Acquired {
                                tokens.insert(key, req.token);
                            }
                        }
                        Op::Complete { key, body, secs } => {
                            if let Some(&token) = tokens.get(&key) {
                                // Every fourth answer is larger than a segment.
                                let body = if body % 4 == 0 {
                                    segment::SEGMENT_BYTES + usize::from(body)
                                } else {
                                    usize::from(body)
                                };
                                let answer = RecordedResponse::new(
                                    200,
                                    vec![("etag".into(), Bytes::from_static(b"x"))],
                                    Bytes::from(vec![7; body]),
                                );
                                let retention = Duration::from_secs(u64::from(secs));
                                let _ = store
                                    .complete(&scope, &keys[key as usize], token, &answer, retention)
                                    .await;
                            }
                        }
                        Op::Release { key } => {
                            if let Some(&token) = tokens.get(&key) {
                                let _ = store.release(&scope, &keys[key as usize], token).await;
                            }
                        }
                        Op::Forget { key } => {
                            store.forget(&scope, &keys[key as usize]).await.unwrap();
                        }
                        Op::Advance { secs } => clock.advance(Duration::from_secs(u64::from(secs))),
                        Op::Sweep => {
                            store.sweep(500).await.unwrap();
                        }
                    }
                    let holes: usize = store.shards.iter().map(|s| lock(s).hole_bytes).sum();
                    let share = lock(store.quota_shard(3)).get(&3).copied().unwrap_or_default();
                    // The store's charge is its scope's share and its holes, at every step.
                    assert_eq!(store.bytes(), share.bytes + holes, "after {op:?}");
                    assert_eq!(store.len(), share.records, "after {op:?}");
                }
                clock.advance(Duration::from_secs(60));
                while store.sweep(500).await.unwrap() > 0 {}
                assert_eq!((store.len(), store.bytes()), (0, 0));
                for shard in store.shards.iter() {
                    let shard = lock(shard);
                    assert_eq!(shard.hole_bytes, 0);
                    assert_eq!(shard.reserved.len(), 0);
                    assert_eq!(shard.segments.counts().0, 0, "a segment still in use");
                    assert!(shard.table.is_empty());
                }
                assert!(store.quotas.iter().all(|q| lock(q).is_empty()));
            });
        }
    }
}
