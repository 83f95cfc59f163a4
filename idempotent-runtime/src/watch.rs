//! Setups that would silently turn protection off, detected on the request that shows them and
//! said once, loudly, with the fix: a `tracing` error and the `misconfigured` counter. In strict
//! mode ([`Config::strict`](crate::Config::strict)) the first four are also refused, on every
//! request that shows them, with 500 `IDEMPOTENCY_MISCONFIGURED` before anything is claimed:
//!
//! - two different memory stores serving one route in one process (actix builds app data per
//!   worker: a store made inside `HttpServer::new`'s factory is one store per worker);
//! - a router-level layer that sees requests but never a matched route (applied outside the
//!   router, so it passes everything through);
//! - a `require_key` attribute under a layer whose key is optional (the attribute enforces its
//!   own requirement: the request is refused, not passed);
//! - a keyed request with an unsafe method (PUT, DELETE, …) that an `#[idempotent]` handler is
//!   routed for but does not list in its `methods` (it would run unprotected);
//! - one peer address sending many distinct forwarded addresses while no proxy is trusted (every
//!   client behind that proxy would share its address as scope).
//!
//! The watch is what one handle has seen: the handle owns one ([`Watch`]), each router-level
//! layer its own ([`LayerWatch`]). It only says; the pipeline decides the answer.

// Asked by the framework integrations only.
#![cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::observe::{self, Event};

/// Each trap is said once per process (or once per layer), however often it shows.
fn once(flag: &AtomicBool) -> bool {
    !flag.swap(true, Ordering::Relaxed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A route of a server ([`server`]): `None` where the runtime cannot tell the server.
type ServedRoute = (Option<usize>, Box<str>);

/// Live watches of handles that hold a memory store, in this process. While there is one, no
/// other memory store can serve any route: its keyed requests skip the lookups below, and a
/// second store's arrival is seen from the first request of either after it (whichever
/// registers a route second is the one said, and refused in strict mode).
static MEMORY_WATCHES: AtomicUsize = AtomicUsize::new(0);

/// Which memory store serves which route of which server in this process: store ids.
fn memory_routes() -> &'static Mutex<HashMap<ServedRoute, usize>> {
    static ROUTES: OnceLock<Mutex<HashMap<ServedRoute, usize>>> = OnceLock::new();
    ROUTES.get_or_init(Default::default)
}

/// The server this request is served by, where the runtime can tell: the actix `System` its
/// workers share (or, for actix-server workers started without one, all of them). Two memory
/// stores serving one route of one server are certainly the per-worker mistake; two apps in one
/// process elsewhere (a test suite builds one per test) may be meant, so they are only said.
///
/// Asked on every keyed request, so each answer is read cheaply where it can be: whether a
/// `System` is registered before cloning it for its id (a clone and a drop of its channels),
/// and the thread's name once per thread (a thread's name never changes).
fn server() -> Option<usize> {
    #[cfg(feature = "actix")]
    if actix_web::rt::System::is_registered()
        && let Some(system) = actix_web::rt::System::try_current()
    {
        return Some(system.id());
    }
    thread_local! {
        static ACTIX_WORKER: bool = std::thread::current()
            .name()
            .is_some_and(|name| name.starts_with("actix-server worker "));
    }
    ACTIX_WORKER.with(|worker| worker.then_some(usize::MAX))
}

/// What one handle has seen: the routes it registered for its memory store, and the forwarded
/// addresses each peer sent while no proxy is trusted.
#[derive(Debug)]
pub(crate) struct Watch {
    /// The memory store's identity, when the handle holds one.
    memory: Option<usize>,
    /// Asked on every keyed request: hashbrown's default hasher, not std's SipHash, which
    /// cost more than the lookup. The value: another memory store serves this route of this
    /// server.
    routes: Mutex<hashbrown::HashMap<ServedRoute, bool>>,
    forwarded: Mutex<HashMap<IpAddr, HashSet<u64>>>,
    split_said: AtomicBool,
    proxy_said: AtomicBool,
    keyless_said: AtomicBool,
    unlisted_said: AtomicBool,
}

/// A `(server, route)` key looked up without allocating one: hashed as the tuple it stands for.
struct At<'a>(Option<usize>, &'a str);

impl std::hash::Hash for At<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.0, self.1).hash(state);
    }
}

impl hashbrown::Equivalent<ServedRoute> for At<'_> {
    fn equivalent(&self, key: &ServedRoute) -> bool {
        self.0 == key.0 && self.1 == &*key.1
    }
}

/// Peers and distinct forwarded values kept per peer: enough to see the pattern, bounded.
const PEERS: usize = 64;
const FORWARDED_SEEN: usize = 8;

impl Watch {
    pub(crate) fn new(memory: Option<usize>) -> Self {
        if memory.is_some() {
            MEMORY_WATCHES.fetch_add(1, Ordering::AcqRel);
        }
        Self {
            memory,
            routes: Mutex::default(),
            forwarded: Mutex::default(),
            split_said: AtomicBool::new(false),
            proxy_said: AtomicBool::new(false),
            keyless_said: AtomicBool::new(false),
            unlisted_said: AtomicBool::new(false),
        }
    }

    /// On a keyed request, before its claim: is another memory store serving this route? `true`
    /// when it certainly is a mistake (both serve one server, see [`server`]): strict mode then
    /// refuses the request.
    pub(crate) fn served(&self, route: &str) -> bool {
        let Some(store) = self.memory else {
            return false;
        };
        if route.is_empty() || MEMORY_WATCHES.load(Ordering::Acquire) == 1 {
            return false;
        }
        let server = server();
        if let Some(split) = lock(&self.routes).get(&At(server, route)) {
            return *split && server.is_some();
        }
        let at = (server, Box::<str>::from(route));
        let other = {
            let mut routes = lock(memory_routes());
            let standing = *routes.entry(at.clone()).or_insert(store);
            standing != store
        };
        lock(&self.routes).insert(at.clone(), other);
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
        other && server.is_some()
    }

    /// A keyed request with an unsafe method the endpoint does not list reached an
    /// `#[idempotent]` handler (routed with `put(…)` or `delete(…)` under the default POST and
    /// PATCH, say): it would pass through unprotected. Said once.
    pub(crate) fn unlisted_method(&self, route: &str, method: &str) {
        if once(&self.unlisted_said) {
            observe::count(Event::Misconfigured, route);
            tracing::error!(
                route,
                method,
                "a keyed {method} request reached an #[idempotent] handler that does not apply to \
                 {method} (by default POST and PATCH), so it runs unprotected: add \
                 `methods = [\"{method}\"]` to #[idempotent] (beside any other method it serves)"
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
        MEMORY_WATCHES.fetch_sub(1, Ordering::AcqRel);
        let mine = std::mem::take(&mut *lock(&self.routes));
        lock(memory_routes()).retain(|at, id| !(*id == store && mine.contains_key(at)));
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

const OUTSIDE_FIX: &str = "add it with Router::layer or Router::route_layer (inside the \
                           router), not around the finished Router";

impl LayerWatch {
    /// Whether the service a layer was put around is a finished router (axum's `Router`, or a
    /// service stack around one): a request without a matched route then certainly shows the
    /// layer misplaced, as that router sets the matched route only for its own handlers. (Put
    /// behind another router's route, with `route_service`, its requests arrive matched.)
    pub(crate) fn wraps_router(inner: &str) -> bool {
        // The type's name is the only sign the layer gets; a name that ever stopped matching
        // leaves the request count of `saw` to speak.
        inner.contains("axum::routing::Router")
    }

    /// An applicable request without a matched route reached a layer around a finished
    /// router: said once, on the first.
    pub(crate) fn outside_router(&self, path: &str) {
        if once(&self.said) {
            observe::count(Event::Misconfigured, path);
            tracing::error!(
                path,
                "the idempotency layer was put around a finished Router, so it never sees a \
                 matched route and protects nothing: {OUTSIDE_FIX}"
            );
        }
    }

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
                 protects nothing: {OUTSIDE_FIX}"
            );
        }
    }
}

/// An attribute with `require_key` under an outer layer whose key is optional: said once
/// per handle (or once per process without one). The pipeline decides the answer.
pub(crate) fn required_under_optional(watch: Option<&Watch>, route: &str) {
    static WITHOUT_HANDLE: AtomicBool = AtomicBool::new(false);
    let said = watch.map_or(&WITHOUT_HANDLE, |w| &w.keyless_said);
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
    fn a_store_that_served_alone_is_seen_once_a_second_one_serves_its_route() {
        // The count is process-wide and other tests' watches come and go meanwhile: what is
        // asserted holds whether `a` served alone (unregistered) or not.
        let a = Watch::new(Some(20));
        a.served("/alone-then-not");
        let b = Watch::new(Some(21));
        b.served("/alone-then-not");
        a.served("/alone-then-not");
        let said = |w: &Watch| w.split_said.load(Ordering::Relaxed);
        assert!(said(&a) ^ said(&b), "exactly one of the two says it");
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
