//! Setups that would silently turn protection off, detected on the request that shows them and
//! said once, loudly, with the fix: a `tracing` error and the `misconfigured` counter.
//!
//! - two different memory stores serving one route in one process (actix builds app data per
//!   worker: a store made inside `HttpServer::new`'s factory is one store per worker);
//! - a router-level layer that sees requests but never a matched route (applied outside the
//!   router, so it passes everything through);
//! - a `require_key` attribute under a layer whose key is optional (the attribute enforces its
//!   own requirement: the request is refused, not passed);
//! - one peer address sending many distinct forwarded addresses while no proxy is trusted (every
//!   client behind that proxy would share its address as scope).

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use super::Reply;
use crate::handle::Idempotency;
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemCode, RenderedRefusal};

/// Each trap is said once per process (or once per layer), however often it shows.
fn once(flag: &AtomicBool) -> bool {
    !flag.swap(true, Ordering::Relaxed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Which memory store serves which route in this process: `(route, store id)` pairs.
fn memory_routes() -> &'static Mutex<HashMap<Box<str>, usize>> {
    static ROUTES: OnceLock<Mutex<HashMap<Box<str>, usize>>> = OnceLock::new();
    ROUTES.get_or_init(Default::default)
}

/// What one handle has seen: the routes it registered for its memory store, and the forwarded
/// addresses each peer sent while no proxy is trusted.
#[derive(Debug)]
pub(crate) struct Watch {
    /// The memory store's identity, when the handle holds one.
    memory: Option<usize>,
    /// Asked on every claimed request: hashbrown's default hasher, not std's SipHash, which
    /// cost more than the lookup.
    routes: Mutex<hashbrown::HashSet<Box<str>>>,
    forwarded: Mutex<HashMap<IpAddr, HashSet<u64>>>,
    split_said: AtomicBool,
    proxy_said: AtomicBool,
    keyless_said: AtomicBool,
}

/// Peers and distinct forwarded values kept per peer: enough to see the pattern, bounded.
const PEERS: usize = 64;
const FORWARDED_SEEN: usize = 8;

impl Watch {
    pub(crate) fn new(memory: Option<usize>) -> Self {
        Self {
            memory,
            routes: Mutex::default(),
            forwarded: Mutex::default(),
            split_said: AtomicBool::new(false),
            proxy_said: AtomicBool::new(false),
            keyless_said: AtomicBool::new(false),
        }
    }

    /// On a claimed route: is another memory store serving it in this process?
    pub(crate) fn served(&self, route: &str) {
        let Some(store) = self.memory else { return };
        if route.is_empty() || lock(&self.routes).contains(route) {
            return;
        }
        lock(&self.routes).insert(route.into());
        let other = {
            let mut routes = lock(memory_routes());
            let standing = *routes.entry(route.into()).or_insert(store);
            standing != store
        };
        if other && once(&self.split_said) {
            observe::count(Event::Misconfigured, route);
            tracing::error!(
                route,
                "two different in-memory idempotency stores serve this route in one process, so a \
                 duplicate that reaches the other one runs again: build the Idempotency handle \
                 once and clone it (actix: outside the HttpServer::new factory, \
                 `let idempotency = web::Data::new(Idempotency::memory());` then \
                 `.app_data(idempotency.clone())`)"
            );
        }
    }

    /// A request from `peer` carried `X-Forwarded-For` although no proxy is trusted.
    pub(crate) fn forwarded_untrusted(&self, peer: IpAddr, value: &[u8], route: &str) {
        if self.proxy_said.load(Ordering::Relaxed) {
            return;
        }
        let hash = {
            use std::hash::{BuildHasher, Hasher};
            let mut h =
                std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default().build_hasher();
            h.write(value);
            h.finish()
        };
        let distinct = {
            let mut peers = lock(&self.forwarded);
            if peers.len() >= PEERS && !peers.contains_key(&peer) {
                return;
            }
            let seen = peers.entry(peer).or_default();
            if seen.len() < FORWARDED_SEEN {
                seen.insert(hash);
            }
            seen.len()
        };
        if distinct >= FORWARDED_SEEN && once(&self.proxy_said) {
            observe::count(Event::Misconfigured, route);
            tracing::error!(
                route,
                %peer,
                "one peer sends many different X-Forwarded-For addresses and no proxy is trusted: \
                 it is a proxy, and every anonymous client behind it shares its address as scope \
                 (one quota, each other's replays and 422s); list it in Config::trusted_proxies"
            );
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(store) = self.memory else { return };
        let mine = std::mem::take(&mut *lock(&self.routes));
        lock(memory_routes()).retain(|route, id| !(*id == store && mine.contains(route)));
    }
}

/// A router-level layer's view: requests it could apply to, and whether any had a matched route.
#[derive(Debug, Default)]
pub(crate) struct LayerWatch {
    matched: AtomicBool,
    unmatched: AtomicU32,
    said: AtomicBool,
}

/// Applicable requests without a matched route before the layer says it is misplaced (a few
/// can be fallbacks).
const UNMATCHED_BEFORE_ERROR: u32 = 16;

impl LayerWatch {
    /// Notes one request the layer would apply to by its method.
    pub(crate) fn saw(&self, matched: bool, path: &str) {
        if matched {
            self.matched.store(true, Ordering::Relaxed);
            return;
        }
        if self.matched.load(Ordering::Relaxed) {
            return;
        }
        let n = self.unmatched.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= UNMATCHED_BEFORE_ERROR && once(&self.said) {
            observe::count(Event::Misconfigured, path);
            tracing::error!(
                path,
                "the idempotency layer has seen {n} requests and never a matched route, so it \
                 protects nothing: add it with Router::layer or Router::route_layer (inside the \
                 router), not around the finished Router"
            );
        }
    }
}

/// An attribute with `require_key` under an outer layer whose key is optional: the outer one
/// let a keyless request through. Said once; the attribute refuses the request itself, as it
/// would alone, rather than passing it.
pub(crate) fn required_under_optional<R: Reply>(handle: Option<&Idempotency>, route: &str) -> R {
    static WITHOUT_HANDLE: AtomicBool = AtomicBool::new(false);
    let said = handle.map_or(&WITHOUT_HANDLE, |h| &h.watch().keyless_said);
    if once(said) {
        observe::count(Event::Misconfigured, route);
        tracing::error!(
            route,
            "#[idempotent(require_key)] sits under an idempotency layer whose key is optional; the \
             outer one decides, but a request without a key is still refused here: make the layer \
             require the key (IdempotencyLayer::require_key / IdempotencyMiddleware::require_key) \
             or remove it from this route"
        );
    }
    let problem = match handle {
        Some(handle) => handle.key_missing(route),
        None => Problem::new(
            400,
            ProblemCode::KeyRequired,
            "an Idempotency-Key header is required",
        ),
    };
    match handle {
        Some(handle) => super::refuse(handle, &problem),
        None => R::problem(&problem, RenderedRefusal::problem_json(&problem)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_memory_store_on_a_route_is_seen_and_the_first_leaving_frees_it() {
        let a = Watch::new(Some(1));
        let b = Watch::new(Some(2));
        a.served("/misuse-test");
        assert!(!a.split_said.load(Ordering::Relaxed));
        b.served("/misuse-test");
        assert!(
            b.split_said.load(Ordering::Relaxed),
            "the second store is the one that shows it"
        );
        drop(a);
        let c = Watch::new(Some(3));
        c.served("/misuse-test-2");
        assert!(
            !c.split_said.load(Ordering::Relaxed),
            "another route is free"
        );
    }

    #[test]
    fn one_store_on_many_routes_is_fine() {
        let a = Watch::new(Some(10));
        for route in ["/x1", "/x2", "/x1"] {
            a.served(route);
        }
        assert!(!a.split_said.load(Ordering::Relaxed));
    }

    #[test]
    fn many_forwarded_addresses_from_one_peer_are_a_proxy() {
        let w = Watch::new(None);
        let proxy: IpAddr = [10, 0, 0, 1].into();
        for i in 0..FORWARDED_SEEN - 1 {
            w.forwarded_untrusted(proxy, format!("192.0.2.{i}").as_bytes(), "/r");
        }
        assert!(
            !w.proxy_said.load(Ordering::Relaxed),
            "a few are a client's own header"
        );
        w.forwarded_untrusted(proxy, b"192.0.2.200", "/r");
        assert!(w.proxy_said.load(Ordering::Relaxed));
    }

    #[test]
    fn a_layer_that_never_sees_a_matched_route_speaks_after_a_few() {
        let l = LayerWatch::default();
        for _ in 0..UNMATCHED_BEFORE_ERROR - 1 {
            l.saw(false, "/x");
        }
        assert!(!l.said.load(Ordering::Relaxed));
        l.saw(false, "/x");
        assert!(l.said.load(Ordering::Relaxed));
        let fine = LayerWatch::default();
        fine.saw(true, "/a");
        for _ in 0..100 {
            fine.saw(false, "/fallback");
        }
        assert!(
            !fine.said.load(Ordering::Relaxed),
            "fallbacks beside matched routes are fine"
        );
    }
}
