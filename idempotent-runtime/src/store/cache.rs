//! A cache of completed records in front of a shared store ([the contract](crate::design) §5).
//!
//! A completed record never changes until it expires, so a process may keep the records it
//! replayed and answer a claim that meets one with the replay, without a round trip to the
//! store. The cache is bounded in bytes, never answers past a record's `expires_at`, and never
//! holds a reservation: a claim that finds nothing here (or a reservation, or an expired copy)
//! goes to the store, and every conditional write (complete, release, renew, reclaim) always
//! does. The fingerprint is kept with the response, so a different request under a cached key
//! is still refused (422).
//!
//! A record is kept from its first replay through this process (that replay costs the store's
//! one read), not at its completion: a first request pays the cache one lookup that misses and
//! nothing else (no copy, no allocation, no write to a shard), and most records are never
//! replayed, so the bytes go to those that are. What the cache knows of a record's expiry is
//! this process's clock just before it asked the store, plus what the store reported was left:
//! the store's own `expires_at` is that or later, as long as the two clocks agree. A copy is
//! also re-checked with the store once it is [`max_age`](CachedStore::max_age) old (default
//! 60 s), which bounds how long a record deleted elsewhere (by another process's admin
//! `forget`) may still be replayed here.
//!
//! # What it answers, and when it asks the store
//!
//! A completed record never changes until it expires, so this process keeps the records it replayed
//! (response, token and fingerprint) and answers a later replay of one without a round trip; a
//! different request under a cached key is still 422. A record is kept from its first replay here
//! on, whichever replica completed it (that replay costs the store's one read, which reports how
//! long the record has left), so a first request pays the cache only a lookup that misses. It never
//! holds a reservation (a key in progress always asks the store), never answers past the record's
//! `expires_at` (judged by this process's clock from the moment it asked the store, so the host's
//! clock must agree with the database's), and re-checks a copy with the store once it is `max_age`
//! old (default 60 s). A `forget` through this process (the admin API) drops its copy for good:
//! once the forget returns, this process never replays the record, even if replays raced it. **It
//! is off by default**: a record deleted through another process (a `forget` on replica A, a manual
//! `DELETE`) may still be replayed by a replica B that holds a copy until B's copy is `max_age` old
//! — at most 60 s by default — a trade a deployment should choose, not inherit. Replays answered
//! from the cache are counted as `store="cache"` in `idempotent_store_operation_seconds`, never as
//! the shared store's claims. Enlisted endpoints see the `PostgresStore` behind the cache. The
//! conformance servers take `--local-cache` to run with it.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::HashTable;

use super::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordedResponse, Standing, StandingState,
    Store, StoreError,
};
use crate::clock::{Clock, Millis, SystemClock, millis};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;

/// Bytes charged per cached record beyond its key and response weight.
const ENTRY_OVERHEAD: usize = 160;

const SHARDS: usize = 16;

struct Cached {
    hash: u64,
    scope: ScopeHash,
    key: Box<str>,
    token: FencingToken,
    fingerprint: Fingerprint,
    response: Arc<RecordedResponse>,
    /// This process's clock just before the store was asked, plus what the store reported left.
    expires_at: Millis,
    /// When to check with the store again that the record still stands.
    fresh_until: Millis,
    weight: usize,
    /// Insertion number, naming this entry in the shard's eviction order.
    seq: u64,
}

#[derive(Default)]
struct Shard {
    records: HashTable<Cached>,
    /// `(hash, seq)` in insertion order: the oldest is evicted first. Pairs of entries already
    /// gone are skipped, and dropped when they outnumber the entries.
    order: VecDeque<(u64, u64)>,
    bytes: usize,
    next_seq: u64,
    /// Moves at each forget of a key of this shard, before and after the store's delete. A copy
    /// read from the store (a replay that missed) is kept only if no forget moved it since before
    /// the store was asked: the copy may be of a record the forget deleted.
    forgets: u64,
}

impl Shard {
    fn remove(&mut self, hash: u64, matches: impl Fn(&Cached) -> bool) -> bool {
        match self
            .records
            .find_entry(hash, |c| c.hash == hash && matches(c))
        {
            Ok(found) => {
                let (gone, _) = found.remove();
                self.bytes -= gone.weight;
                true
            }
            Err(_) => false,
        }
    }

    fn insert(&mut self, mut entry: Cached, max_bytes: usize) {
        let (hash, scope, key) = (entry.hash, entry.scope, entry.key.clone());
        self.remove(hash, |c| c.scope == scope && c.key == key);
        entry.seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += entry.weight;
        self.order.push_back((hash, entry.seq));
        self.records.insert_unique(hash, entry, |c| c.hash);
        while self.bytes > max_bytes {
            let Some((hash, seq)) = self.order.pop_front() else {
                break;
            };
            self.remove(hash, |c| c.seq == seq);
        }
        if self.order.len() > 2 * self.records.len() + 64 {
            let records = &self.records;
            self.order
                .retain(|&(hash, seq)| records.find(hash, |c| c.seq == seq).is_some());
        }
    }
}

/// A [`Store`] that answers replays of records it has replayed before from memory, and sends
/// everything else to `inner`.
///
/// ```
/// use idempotent_runtime::store::cache::CachedStore;
/// use idempotent_runtime::store::memory::MemoryStore;
///
/// // In production `inner` is a shared store (PostgreSQL, Redis); any store works.
/// let store = CachedStore::new(MemoryStore::default()).max_bytes(16 << 20);
/// assert_eq!(store.cached_bytes(), 0);
/// ```
pub struct CachedStore<S> {
    inner: S,
    shards: Box<[Mutex<Shard>]>,
    hasher: hashbrown::DefaultHashBuilder,
    max_bytes: usize,
    max_age: Millis,
    clock: Arc<dyn Clock>,
    hits: AtomicUsize,
}

impl<S> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("cached_bytes", &self.cached_bytes())
            .field("max_bytes", &self.max_bytes)
            .field("max_age_ms", &self.max_age)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every mutation of a shard completes before anything that could panic runs.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S> CachedStore<S> {
    /// A cache of at most 64 MiB, re-checking copies older than 60 s, in front of `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: Default::default(),
            max_bytes: 64 << 20,
            max_age: 60_000,
            clock: Arc::new(SystemClock),
            hits: AtomicUsize::new(0),
        }
    }

    /// Most bytes of records kept (responses, keys and bookkeeping), across all shards.
    #[must_use]
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// How long a copy is answered from before the store is asked again whether the record
    /// still stands: the longest a record deleted by another process is replayed here.
    #[must_use]
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = millis(age);
        self
    }

    /// The clock copies are judged by (tests inject a [`ManualClock`](crate::clock::ManualClock)
    /// that moves with the store's).
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Bytes of records held.
    pub fn cached_bytes(&self) -> usize {
        self.shards.iter().map(|s| lock(s).bytes).sum()
    }

    /// Claims answered from the cache so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::Relaxed)
    }

    /// Drops the copy of `(scope, key)`, e.g. after the record was deleted through this process.
    /// A copy read from the store before this call is not put back by the replay that read it.
    pub fn evict(&self, scope: &ScopeHash, key: &str) {
        let (hash, shard) = self.locate(scope, key);
        let mut shard = lock(shard);
        shard.forgets = shard.forgets.wrapping_add(1);
        shard.remove(hash, |c| c.scope == *scope && *c.key == *key);
    }

    fn locate(&self, scope: &ScopeHash, key: &str) -> (u64, &Mutex<Shard>) {
        let hash = self.hasher.hash_one((scope, key));
        (hash, &self.shards[(hash >> 48) as usize % SHARDS])
    }

    fn shard_budget(&self) -> usize {
        self.max_bytes / SHARDS
    }

    /// The cached copy, if it may be answered from at `now`; otherwise the shard's forget count
    /// (for [`keep`](Self::keep)) and the token of a copy held but due for a re-check with the
    /// store.
    fn lookup(
        &self,
        req: &ClaimRequest<'_>,
        now: Millis,
    ) -> Result<Standing, (u64, Option<FencingToken>)> {
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        let forgets = shard.forgets;
        let same = |c: &Cached| c.hash == hash && c.scope == *req.scope && *c.key == *req.key;
        let Some(c) = shard.records.find(hash, same) else {
            return Err((forgets, None));
        };
        if now >= c.expires_at {
            shard.remove(hash, same);
            return Err((forgets, None));
        }
        if now >= c.fresh_until {
            return Err((forgets, Some(c.token)));
        }
        Ok(Standing {
            token: c.token,
            fingerprint: c.fingerprint,
            state: StandingState::Completed(Arc::clone(&c.response)),
            expires_in: Some(Duration::from_millis(c.expires_at - now)),
        })
    }

    /// Keeps a copy of `standing` when it is a completed record whose expiry is known: from
    /// `since` (this process's clock, read before the store was asked, so the copy never
    /// outlives the store's record) for `expires_in`; and unless a forget ran in the shard since
    /// `forgets` was read, before the store was asked.
    fn keep(&self, scope: &ScopeHash, key: &str, standing: &Standing, since: Millis, forgets: u64) {
        let (StandingState::Completed(response), Some(expires_in)) =
            (&standing.state, standing.expires_in)
        else {
            return;
        };
        let weight = ENTRY_OVERHEAD + key.len() + response.weight();
        if weight > self.shard_budget() {
            return;
        }
        let expires_at = since.saturating_add(millis(expires_in));
        let (hash, shard) = self.locate(scope, key);
        let entry = Cached {
            hash,
            scope: *scope,
            key: key.into(),
            token: standing.token,
            fingerprint: standing.fingerprint,
            response: Arc::clone(response),
            expires_at,
            fresh_until: since.saturating_add(self.max_age).min(expires_at),
            weight,
            seq: 0,
        };
        let mut shard = lock(shard);
        if shard.forgets == forgets {
            shard.insert(entry, self.shard_budget());
        }
    }

    /// After the store answered a claim that found a copy due for a re-check: keep the copy
    /// fresh for another `max_age` if the same record (same token) still stands completed, drop
    /// it otherwise.
    fn recheck(&self, req: &ClaimRequest<'_>, held: FencingToken, claim: &Claim, now: Millis) {
        let (hash, shard) = self.locate(req.scope, req.key);
        let mut shard = lock(shard);
        let same = |c: &Cached| c.hash == hash && c.scope == *req.scope && *c.key == *req.key;
        let still = matches!(claim, Claim::Standing(s)
            if s.token == held && matches!(s.state, StandingState::Completed(_)));
        if still {
            if let Some(c) = shard.records.find_mut(hash, |c| same(c) && c.token == held) {
                c.fresh_until = now.saturating_add(self.max_age).min(c.expires_at);
            }
        } else {
            shard.remove(hash, |c| same(c) && c.token == held);
        }
    }
}

/// The `store` label of the claims the cache answers itself.
const KIND: &str = "cache";

impl<S: Store> CachedStore<S> {
    /// [`Store::claim`], and with `timed` [`Store::claim_timed`]: a claim answered here is timed
    /// as the cache's, one that goes on to the store as the store's (by its `claim_timed`).
    async fn claim_through(
        &self,
        req: &ClaimRequest<'_>,
        timed: bool,
    ) -> Result<Claim, StoreError> {
        let started = crate::observe::Started::now();
        let now = self.clock.now_millis();
        let (forgets, held) = match self.lookup(req, now) {
            Ok(standing) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                if timed {
                    crate::observe::took("claim", KIND, started);
                }
                return Ok(Claim::Standing(standing));
            }
            Err(missed) => missed,
        };
        let claim = if timed {
            self.inner.claim_timed(req).await?
        } else {
            self.inner.claim(req).await?
        };
        match (&claim, held) {
            // A first request: nothing was looked up but the miss.
            (Claim::Acquired, None) => {}
            (_, Some(held)) => self.recheck(req, held, &claim, now),
            // A record's first replay through this process (whichever completed it): replayed
            // from here on, until its expiry as the store reported it.
            (Claim::Standing(standing), None) => {
                self.keep(req.scope, req.key, standing, now, forgets);
            }
        }
        Ok(claim)
    }
}

impl<S: Store> Store for CachedStore<S> {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.claim_through(req, false).await
    }

    /// A replay answered here is timed as `store="cache"`; a claim that goes on to the store
    /// is timed by the store's own `claim_timed`, as the store's, and only that call.
    async fn claim_timed(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.claim_through(req, true).await
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        let claim = self.inner.reclaim(req, stale).await?;
        if claim == Claim::Acquired {
            // Whatever copy was held is of a record that is gone now.
            self.evict(req.scope, req.key);
        }
        Ok(claim)
    }

    /// The store's: the record is kept here from its first replay, not now (a first request
    /// pays the cache nothing beyond its claim's lookup).
    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.inner
            .complete(scope, key, token, response, retention)
            .await
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.inner.release(scope, key, token).await
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(scope, key, token, lease).await
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        self.inner.sweep(batch).await
    }

    /// The shared store is asked: it is the truth, and the cache never holds reservations.
    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.inspect(scope, key, with_response).await
    }

    /// Drops this process's copy, then the record, then any copy a replay put back meanwhile; a
    /// replay that read the store before the delete keeps no copy after it
    /// ([`evict`](Self::evict)). So once this returns, this process never answers the record
    /// again. Other processes may replay theirs until it is older than `max_age` (the README
    /// says so).
    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        self.evict(scope, key);
        let forgotten = self.inner.forget(scope, key).await;
        self.evict(scope, key);
        forgotten
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn expires_by_itself(&self) -> bool {
        self.inner.expires_by_itself()
    }

    /// The store's own: an enlisted request claims and completes in its transaction, past the
    /// cache (whose copies are only of records completed through it).
    fn enlisting(&self) -> Option<super::Enlisting<'_>> {
        self.inner.enlisting()
    }

    fn gauges(&self) -> Option<super::StoreGauges> {
        self.inner.gauges()
    }

    fn process_local(&self) -> Option<super::ProcessLocal> {
        self.inner.process_local()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::contract::{self, forwarding::Forwarding};
    use crate::store::memory::MemoryStore;

    fn cached(clock: &ManualClock) -> CachedStore<MemoryStore> {
        let inner = MemoryStore::builder()
            .clock(clock.clone())
            .limits(crate::store::memory::MemoryLimits {
                // Many claims of one scope in flight at once, as in the memory store's own run.
                response_headroom: 4 << 10,
                ..Default::default()
            })
            .build();
        CachedStore::new(inner).clock(clock.clone())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cache_over_memory_meets_the_store_contract() {
        let clock = ManualClock::new();
        let store = Arc::new(cached(&clock));
        contract::run(Arc::clone(&store), move |d| clock.advance(d)).await;
        assert!(
            store.hits() > 0,
            "the contract's replays never met the cache"
        );
    }

    fn req<'a>(scope: &'a ScopeHash, key: &'a str, fp: u8) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: 1,
            fingerprint: Fingerprint {
                version: 1,
                digest: [fp; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(10),
            route: "/test",
            response_room: 0,
        }
    }

    fn response(body: &'static [u8]) -> RecordedResponse {
        RecordedResponse::new(201, vec![], bytes::Bytes::from_static(body))
    }

    /// A cache in front of a store that counts the claims reaching it.
    fn counting(clock: &ManualClock) -> CachedStore<Forwarding<MemoryStore>> {
        let inner = Forwarding::new(MemoryStore::builder().clock(clock.clone()).build());
        CachedStore::new(inner).clock(clock.clone())
    }

    async fn completed<S: Store>(
        store: &CachedStore<S>,
        scope: &ScopeHash,
        key: &str,
    ) -> FencingToken {
        completed_with(store, scope, key, &response(b"{}")).await
    }

    /// Claims `key` (fingerprint 1) through the cache, completes it with `answer`, and replays
    /// it once: that replay reads the store and keeps the copy here.
    async fn completed_with<S: Store>(
        store: &CachedStore<S>,
        scope: &ScopeHash,
        key: &str,
        answer: &RecordedResponse,
    ) -> FencingToken {
        let first = req(scope, key, 1);
        assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
        assert!(
            store
                .complete(scope, key, first.token, answer, first.retention)
                .await
                .unwrap()
        );
        let hits = store.hits();
        assert!(matches!(
            store.claim(&req(scope, key, 1)).await.unwrap(),
            Claim::Standing(Standing {
                state: StandingState::Completed(_),
                ..
            })
        ));
        assert_eq!(
            store.hits(),
            hits,
            "a first replay was answered from the cache"
        );
        first.token
    }

    fn standing(c: Claim) -> Standing {
        match c {
            Claim::Standing(s) => s,
            Claim::Acquired => panic!("acquired a completed key"),
        }
    }

    /// A first request costs the cache one lookup that misses: its completion keeps nothing
    /// here (no copy of the answer); its first replay reads the store and keeps the copy.
    #[tokio::test]
    async fn a_first_request_keeps_nothing_and_its_first_replay_keeps_the_copy() {
        let clock = ManualClock::new();
        let store = counting(&clock);
        let scope = [8; 32];
        let first = req(&scope, "k", 1);
        assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
        let answer = response(b"first");
        assert!(
            store
                .complete(&scope, "k", first.token, &answer, first.retention)
                .await
                .unwrap()
        );
        assert_eq!(store.cached_bytes(), 0, "a completion kept a copy");
        let claims = || store.inner().calls().claim.load(Ordering::Relaxed);
        for (replay, reached) in [(1, 2), (2, 2)] {
            let standing = standing(store.claim(&req(&scope, "k", 1)).await.unwrap());
            assert_eq!(standing.token, first.token);
            assert_eq!(
                standing.state,
                StandingState::Completed(Arc::new(answer.clone()))
            );
            assert_eq!(
                claims(),
                reached,
                "replay {replay}: claims that reached the store"
            );
        }
        assert_eq!(store.hits(), 1);
        assert!(store.cached_bytes() > 0);
    }

    #[tokio::test]
    async fn a_cached_replay_makes_no_round_trip_and_keeps_the_fingerprint() {
        let clock = ManualClock::new();
        let store = counting(&clock);
        let scope = [1; 32];
        let token = completed(&store, &scope, "k").await;
        let before = store.inner().calls().claim.load(Ordering::Relaxed);
        let replay = standing(store.claim(&req(&scope, "k", 1)).await.unwrap());
        assert_eq!(replay.token, token);
        assert_eq!(
            replay.state,
            StandingState::Completed(Arc::new(response(b"{}")))
        );
        let reused = standing(store.claim(&req(&scope, "k", 2)).await.unwrap());
        assert_eq!(
            reused.fingerprint.digest, [1; 32],
            "the cached fingerprint is the first request's, so a different request is 422"
        );
        assert_eq!(
            store.inner().calls().claim.load(Ordering::Relaxed),
            before,
            "a cached replay reached the store"
        );
        assert_eq!(store.hits(), 2);
    }

    /// The byte bound counts a body's length: a copy that kept the handler's whole buffer alive
    /// (here 64 KiB behind a 2-byte answer) would hold far more than it counts.
    #[tokio::test]
    async fn a_kept_copy_owns_its_body_not_the_buffer_it_was_cut_from() {
        let clock = ManualClock::new();
        let store = counting(&clock);
        let scope = [3; 32];
        let buffer = Bytes::from(vec![b'{'; 64 << 10]);
        let answer = RecordedResponse {
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: buffer.slice(..2),
            ..response(b"")
        };
        completed_with(&store, &scope, "k", &answer).await;
        let StandingState::Completed(kept) =
            standing(store.claim(&req(&scope, "k", 1)).await.unwrap()).state
        else {
            panic!("not a replay");
        };
        assert_eq!(*kept, answer);
        assert_eq!(store.hits(), 1, "the replay came from the cache");
        let within = buffer.as_ptr_range();
        assert!(
            !within.contains(&kept.body.as_ptr()),
            "the cached copy still points into the handler's 64 KiB buffer"
        );
    }

    #[tokio::test]
    async fn a_record_completed_elsewhere_is_cached_at_its_first_replay_until_its_expiry() {
        let clock = ManualClock::new();
        let store = counting(&clock);
        let scope = [4; 32];
        // Another process claims and completes, straight in the shared store.
        let shared = store.inner().inner();
        let first = req(&scope, "k", 1);
        assert_eq!(shared.claim(&first).await.unwrap(), Claim::Acquired);
        let answer = response(b"elsewhere");
        assert!(
            shared
                .complete(&scope, "k", first.token, &answer, first.retention)
                .await
                .unwrap()
        );
        clock.advance(Duration::from_secs(4));
        let claims = || store.inner().calls().claim.load(Ordering::Relaxed);
        let replay = standing(store.claim(&req(&scope, "k", 1)).await.unwrap());
        assert_eq!(replay.state, StandingState::Completed(Arc::new(answer)));
        assert_eq!(claims(), 1, "the first replay asks the store");
        let again = standing(store.claim(&req(&scope, "k", 1)).await.unwrap());
        assert_eq!(again.token, first.token);
        assert_eq!(claims(), 1, "the second is answered here");
        assert_eq!(store.hits(), 1);
        // 6 s of the 10 s retention were left at the first replay: past them, the store decides.
        clock.advance(Duration::from_secs(6));
        assert_eq!(
            store.claim(&req(&scope, "k", 1)).await.unwrap(),
            Claim::Acquired,
            "a copy outlived the store's record"
        );
        assert_eq!(claims(), 2);
    }

    #[tokio::test]
    async fn never_answers_past_expiry_and_never_caches_a_reservation() {
        let clock = ManualClock::new();
        let store = cached(&clock);
        let scope = [2; 32];
        let running = req(&scope, "running", 1);
        assert_eq!(store.claim(&running).await.unwrap(), Claim::Acquired);
        assert!(matches!(
            store.claim(&req(&scope, "running", 1)).await.unwrap(),
            Claim::Standing(Standing {
                state: StandingState::Running { .. },
                ..
            })
        ));
        assert_eq!(store.hits(), 0, "a reservation was answered from the cache");

        completed(&store, &scope, "done").await;
        clock.advance(Duration::from_secs(11));
        assert_eq!(
            store.claim(&req(&scope, "done", 1)).await.unwrap(),
            Claim::Acquired,
            "past its retention the key runs again"
        );
        assert_eq!(store.hits(), 0);
    }

    #[tokio::test]
    async fn a_copy_older_than_max_age_is_checked_with_the_store() {
        let clock = ManualClock::new();
        let inner = MemoryStore::builder().clock(clock.clone()).build();
        let store = CachedStore::new(inner)
            .clock(clock.clone())
            .max_age(Duration::from_secs(2));
        let scope = [3; 32];
        let first = req(&scope, "k", 1);
        store.claim(&first).await.unwrap();
        store
            .complete(&scope, "k", first.token, &response(b"1"), first.retention)
            .await
            .unwrap();
        // The first replay keeps the copy, the second is answered from it.
        store.claim(&req(&scope, "k", 1)).await.unwrap();
        store.claim(&req(&scope, "k", 1)).await.unwrap();
        assert_eq!(store.hits(), 1);
        clock.advance(Duration::from_secs(3));
        // Re-checked with the store (still there, same token): answered, and fresh again.
        assert!(matches!(
            store.claim(&req(&scope, "k", 1)).await.unwrap(),
            Claim::Standing(s) if s.token == first.token
        ));
        assert_eq!(
            store.hits(),
            1,
            "a stale copy was answered without asking the store"
        );
        store.claim(&req(&scope, "k", 1)).await.unwrap();
        assert_eq!(store.hits(), 2, "the re-checked copy is answered again");
    }

    #[tokio::test]
    async fn stays_within_its_byte_bound() {
        let clock = ManualClock::new();
        let inner = MemoryStore::builder()
            .clock(clock.clone())
            .limits(crate::store::memory::MemoryLimits {
                max_records_per_scope: usize::MAX,
                ..Default::default()
            })
            .build();
        let store = CachedStore::new(inner)
            .clock(clock.clone())
            .max_bytes(SHARDS * 4 * (ENTRY_OVERHEAD + 1_100));
        let scope = [4; 32];
        static BODY: [u8; 1024] = [b'x'; 1024];
        for i in 0..2_000 {
            let key = format!("k{i}");
            let r = req(&scope, &key, 1);
            store.claim(&r).await.unwrap();
            store
                .complete(&scope, &key, r.token, &response(&BODY), r.retention)
                .await
                .unwrap();
            store.claim(&req(&scope, &key, 1)).await.unwrap();
        }
        assert!(store.cached_bytes() <= SHARDS * 4 * (ENTRY_OVERHEAD + 1_100));
        assert!(store.cached_bytes() > 0);
    }

    /// A store that can hold a claim's read, or a completion, between the store's answer and
    /// the cache's use of it (until the test says go), and can take a round trip's time inside
    /// claims and forgets, so that a forget lands in the middle of a replay.
    #[derive(Default)]
    struct Interleaved {
        inner: MemoryStore,
        hold_claim: std::sync::atomic::AtomicBool,
        hold_complete: std::sync::atomic::AtomicBool,
        /// How long a claim takes after reading the record, and a forget before deleting it:
        /// a round trip to a shared store.
        round_trip: Duration,
        held: tokio::sync::Notify,
        go: tokio::sync::Notify,
    }

    impl Interleaved {
        async fn hold_if(&self, armed: &std::sync::atomic::AtomicBool) {
            if armed.swap(false, Ordering::SeqCst) {
                self.held.notify_one();
                self.go.notified().await;
            }
        }
    }

    impl Store for Interleaved {
        async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            let read = self.inner.claim(req).await;
            if !self.round_trip.is_zero() {
                tokio::time::sleep(self.round_trip).await;
            }
            self.hold_if(&self.hold_claim).await;
            read
        }
        async fn reclaim(
            &self,
            req: &ClaimRequest<'_>,
            stale: FencingToken,
        ) -> Result<Claim, StoreError> {
            self.inner.reclaim(req, stale).await
        }
        async fn complete(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            response: &RecordedResponse,
            retention: Duration,
        ) -> Result<bool, StoreError> {
            let done = self
                .inner
                .complete(scope, key, token, response, retention)
                .await;
            self.hold_if(&self.hold_complete).await;
            done
        }
        async fn release(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
        ) -> Result<bool, StoreError> {
            self.inner.release(scope, key, token).await
        }
        async fn renew(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            lease: Duration,
        ) -> Result<bool, StoreError> {
            self.inner.renew(scope, key, token, lease).await
        }
        async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
            self.inner.sweep(batch).await
        }
        async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
            if !self.round_trip.is_zero() {
                tokio::time::sleep(self.round_trip).await;
            }
            self.inner.forget(scope, key).await
        }
    }

    /// A replay that missed the cache read the record just before a forget deleted it: its
    /// copy never goes into the cache after the forget (DESIGN.md §5: a forget drops the record
    /// from this process for good).
    #[tokio::test]
    async fn a_replay_reading_the_record_before_a_forget_never_puts_it_back() {
        let store = Arc::new(CachedStore::new(Interleaved::default()));
        let scope = [5; 32];
        // Completed elsewhere: the first replay here misses and reads the store.
        let shared = &store.inner().inner;
        let first = req(&scope, "k", 1);
        shared.claim(&first).await.unwrap();
        shared
            .complete(&scope, "k", first.token, &response(b"1"), first.retention)
            .await
            .unwrap();
        store.inner().hold_claim.store(true, Ordering::SeqCst);
        let replay = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.claim(&req(&scope, "k", 1)).await })
        };
        store.inner().held.notified().await;
        // The replay has read the record; the forget runs before it goes on.
        assert!(store.forget(&scope, "k").await.unwrap());
        store.inner().go.notify_one();
        assert!(matches!(
            replay.await.unwrap().unwrap(),
            Claim::Standing(Standing {
                state: StandingState::Completed(_),
                ..
            })
        ));
        assert_eq!(
            store.claim(&req(&scope, "k", 1)).await.unwrap(),
            Claim::Acquired,
            "the forgotten record was replayed from the cache"
        );
        assert_eq!(store.hits(), 0);
    }

    /// The same for a completion the store took just before a forget deleted it.
    #[tokio::test]
    async fn a_completion_racing_a_forget_never_puts_its_copy_back() {
        let store = Arc::new(CachedStore::new(Interleaved::default()));
        let scope = [6; 32];
        let first = req(&scope, "k", 1);
        assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
        store.inner().hold_complete.store(true, Ordering::SeqCst);
        let token = first.token;
        let completion = {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .complete(&scope, "k", token, &response(b"1"), Duration::from_secs(10))
                    .await
            })
        };
        store.inner().held.notified().await;
        assert!(store.forget(&scope, "k").await.unwrap());
        store.inner().go.notify_one();
        assert!(completion.await.unwrap().unwrap());
        assert_eq!(
            store.claim(&req(&scope, "k", 1)).await.unwrap(),
            Claim::Acquired,
            "the forgotten record was replayed from the cache"
        );
        assert_eq!(store.hits(), 0);
    }

    /// Eight tasks replay a key while it is forgotten, 25 times: once the forget has returned,
    /// no replay is answered with the record (the store has none, so such an answer could only
    /// come from the cache).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replays_racing_a_forget_never_answer_it_once_it_returned() {
        let store = Arc::new(CachedStore::new(Interleaved {
            round_trip: Duration::from_millis(1),
            ..Default::default()
        }));
        let scope = [7; 32];
        let (mut answered_after_forget, mut trials_answered) = (0, 0);
        for trial in 0..25 {
            let key: Arc<str> = format!("k{trial}").into();
            completed(&store, &scope, &key).await;
            let forgotten = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let started = Arc::new(AtomicUsize::new(0));
            let replayers: Vec<_> = (0..8)
                .map(|_| {
                    let (store, key, forgotten, started) = (
                        Arc::clone(&store),
                        Arc::clone(&key),
                        Arc::clone(&forgotten),
                        Arc::clone(&started),
                    );
                    tokio::spawn(async move {
                        started.fetch_add(1, Ordering::SeqCst);
                        let mut after = 0;
                        let mut bad = 0;
                        while after < 20 {
                            let gone = forgotten.load(Ordering::SeqCst);
                            let r = req(&scope, &key, 1);
                            match store.claim(&r).await.unwrap() {
                                Claim::Standing(Standing {
                                    state: StandingState::Completed(_),
                                    ..
                                }) if gone => bad += 1,
                                Claim::Acquired => {
                                    store.release(&scope, &key, r.token).await.unwrap();
                                }
                                _ => {}
                            }
                            after += usize::from(gone);
                            tokio::task::yield_now().await;
                        }
                        bad
                    })
                })
                .collect();
            while started.load(Ordering::SeqCst) < 8 {
                tokio::task::yield_now().await;
            }
            assert!(store.forget(&scope, &key).await.unwrap());
            forgotten.store(true, Ordering::SeqCst);
            let mut answered = 0;
            for r in replayers {
                answered += r.await.unwrap();
            }
            answered_after_forget += answered;
            trials_answered += usize::from(answered > 0);
        }
        assert_eq!(
            (answered_after_forget, trials_answered),
            (0, 0),
            "replays answered a forgotten record after its forget returned (answers, trials of 25)"
        );
    }
}
