//! No response is ever replayed to another scope (DESIGN.md §4), over real HTTP against every
//! conformance server: randomised tenants, subjects, API keys and anonymous peers on different
//! loopback source addresses (127.0.0.2, 127.0.0.3, …) share a small pool of keys. The same key
//! under another scope always runs; under the same scope it replays the first answer (or is
//! 422 when sent to another route). Scopes run concurrently with each other; each scope's own
//! requests go in order, so every answer is predictable.
//!
//! ```text
//! CROSS_SCOPE_SEED=42 cargo test --all-features --test conformance cross_scope::
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::support;
use crate::support::raw::{Server, key, post};

/// Requests per server.
const REQUESTS: usize = 400;
/// Concurrent workers; a scope always goes to the same one.
const WORKERS: usize = 4;

/// splitmix64: small, seedable, good enough to pick test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn pick<'a, T>(&mut self, from: &'a [T]) -> &'a T {
        &from[(self.next() % from.len() as u64) as usize]
    }
}

/// Who a request claims to be. Identity strings deliberately look like each other's prefixes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Caller {
    bearer: Option<(String, String)>,
    api_key: Option<String>,
}

/// The scope the contract says a request falls in: its identity, or its peer address when it
/// has neither a subject nor a client id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum ScopeId {
    Identity(Caller),
    Peer(IpAddr),
}

#[derive(Debug, Clone)]
struct Request {
    caller: Caller,
    source: IpAddr,
    key: String,
    route: &'static str,
}

impl Request {
    /// The key as compared: unquoted.
    fn key(&self) -> String {
        self.key.trim_matches('"').to_owned()
    }

    fn scope(&self) -> ScopeId {
        if self.caller.bearer.is_none() && self.caller.api_key.is_none() {
            ScopeId::Peer(self.source)
        } else {
            ScopeId::Identity(self.caller.clone())
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut headers = vec![key(self.key.as_bytes())];
        if let Some((tenant, subject)) = &self.caller.bearer {
            headers.push(format!("Authorization: Bearer {tenant}:{subject}").into_bytes());
        }
        if let Some(id) = &self.caller.api_key {
            headers.push(format!("X-Api-Key: {id}").into_bytes());
        }
        let headers: Vec<&[u8]> = headers.iter().map(Vec::as_slice).collect();
        post(self.route, &headers, br#"{"sku":"book","quantity":1}"#)
    }
}

fn seed() -> u64 {
    match std::env::var("CROSS_SCOPE_SEED") {
        Ok(s) => s.parse().expect("CROSS_SCOPE_SEED is a u64"),
        Err(_) => {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(std::time::SystemTime::now())
        }
    }
}

fn requests(rng: &mut Rng) -> Vec<Request> {
    let tenants = ["acme", "globex", "acme2", "peer"];
    let subjects = ["alice", "bob", "peer:127.0.0.2", "api-key:k1", "acme"];
    let api_keys = ["k1", "k2", "127.0.0.2", "alice", "peer:127.0.0.3"];
    let sources: Vec<IpAddr> = (2..=9).map(|i| IpAddr::from([127, 0, 0, i])).collect();
    // `"shared"` and `shared` are the same key (DESIGN.md §2).
    let keys = ["order-1", "order-2", "order-3", "shared", "\"shared\"", "k"];
    let mut callers: Vec<Caller> = Vec::new();
    while callers.len() < 14 {
        let bearer = (!rng.next().is_multiple_of(3)).then(|| {
            (
                rng.pick(&tenants).to_string(),
                rng.pick(&subjects).to_string(),
            )
        });
        let api_key = rng
            .next()
            .is_multiple_of(2)
            .then(|| rng.pick(&api_keys).to_string());
        callers.push(Caller { bearer, api_key });
    }
    // Anonymous callers, scoped by their source address.
    callers.push(Caller {
        bearer: None,
        api_key: None,
    });
    callers.push(Caller {
        bearer: None,
        api_key: None,
    });
    (0..REQUESTS)
        .map(|_| Request {
            caller: rng.pick(&callers).clone(),
            source: *rng.pick(&sources),
            key: rng.pick(&keys).to_string(),
            route: if rng.next().is_multiple_of(5) {
                "/shops/s1/orders"
            } else {
                "/orders"
            },
        })
        .collect()
}

/// What a worker saw: per (scope, key), the first answer's route and body.
type Firsts = HashMap<(ScopeId, String), (&'static str, Vec<u8>)>;

async fn run_worker(s: &Server, requests: Vec<Request>) -> Firsts {
    let mut firsts: Firsts = HashMap::new();
    for r in requests {
        let mut conn = s.connect_from(Some(r.source)).await;
        conn.write(&r.bytes()).await;
        let a = conn.answer().await;
        let ctx = format!("{} {r:?}", s.name);
        match firsts.get(&(r.scope(), r.key())) {
            None => {
                assert_eq!(
                    a.status,
                    201,
                    "{ctx}: {:?}",
                    String::from_utf8_lossy(&a.body)
                );
                assert!(
                    !a.replayed(),
                    "{ctx}: a key new to this scope was answered with a replay"
                );
                firsts.insert((r.scope(), r.key()), (r.route, a.body));
            }
            Some((route, body)) if *route == r.route => {
                assert_eq!(a.status, 201, "{ctx}");
                assert!(a.replayed(), "{ctx}: the same scope and key ran again");
                assert_eq!(&a.body, body, "{ctx}: replayed another answer");
            }
            Some(_) => a.assert_problem(422, "IDEMPOTENCY_KEY_REUSED"),
        }
    }
    firsts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_response_is_replayed_to_another_scope() {
    let seed = seed();
    eprintln!("CROSS_SCOPE_SEED={seed}");
    for name in support::SERVERS {
        let mut rng = Rng(seed);
        let requests = requests(&mut rng);
        let mut s = Server::start(name, &[]);
        let mut partitions: Vec<Vec<Request>> = vec![Vec::new(); WORKERS];
        for r in requests {
            let worker = {
                use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
                BuildHasherDefault::<DefaultHasher>::default().hash_one(r.scope()) as usize
                    % WORKERS
            };
            partitions[worker].push(r);
        }
        let server = &s;
        let all = futures_util::future::join_all(
            partitions
                .into_iter()
                .map(|part| async move { run_worker(server, part).await }),
        )
        .await;

        let mut firsts: Firsts = HashMap::new();
        for part in all {
            firsts.extend(part);
        }
        let mut executions = BTreeSet::new();
        for ((scope, key), (route, body)) in &firsts {
            let doc: serde_json::Value = serde_json::from_slice(body).expect("JSON");
            let n = doc["execution"].as_u64().expect("execution");
            assert!(
                executions.insert((*route, n)),
                "{name}: execution {n} of {route} answered two scopes (one is {scope:?} {key})"
            );
        }
        let runs = s.runs("/orders").await + s.runs("/shops/{shop}/orders").await;
        assert_eq!(
            runs,
            firsts.len() as u64,
            "{name}: the handlers ran once per (scope, key)"
        );
        let per_kind: BTreeMap<&str, usize> =
            firsts.keys().fold(BTreeMap::new(), |mut m, (scope, _)| {
                let kind = match scope {
                    ScopeId::Peer(_) => "anonymous",
                    ScopeId::Identity(c) if c.api_key.is_some() => "api key",
                    ScopeId::Identity(_) => "subject",
                };
                *m.entry(kind).or_default() += 1;
                m
            });
        eprintln!(
            "  {name}: {REQUESTS} requests, {} (scope, key) pairs {per_kind:?}",
            firsts.len()
        );
        s.assert_alive_without_panic();
    }
}
