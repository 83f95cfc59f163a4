//! Fair capacity and a trustworthy identity under hostile callers (DESIGN.md §4, §5; #14), over
//! real HTTP against every conformance server: one scope flooding large answers is refused
//! alone and before its handler runs, while another scope's answers are recorded and replayed
//! and no key answers 409 after its answer was sent; clients behind a trusted proxy are scoped
//! by the address it forwards (ports, brackets, RFC 7239 `Forwarded`), a proxy that forwards
//! none is 500, and an untrusted peer's header is ignored; the runtime's resolver and configured
//! credential headers; a custom key header. Peers are loopback source addresses 127.0.0.2–9.
//!
//! ```text
//! cargo test --all-features --test hostile fair_scope::
//! ```

use std::net::IpAddr;

use crate::support;
use crate::support::raw::{Answer, Server, key, post};

against_every_server! {
    every_store: [
        clients_behind_a_trusted_proxy_are_scoped_by_the_forwarded_address,
        a_client_behind_a_trusted_proxy_cannot_pick_its_own_scope,
        the_resolver_and_credential_headers_decide_who_the_caller_is,
        the_key_header_is_a_setting,
    ],
    // Refused by the memory store's per-scope quota (a SQL store has none).
    memory_only: [a_flooding_scope_is_refused_alone_before_its_handler_runs],
}

fn peer(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// One request from `from` on a fresh connection.
async fn send_from(s: &Server, from: IpAddr, request: &[u8]) -> Answer {
    let mut conn = s.connect_from(Some(from)).await;
    conn.write(request).await;
    conn.answer().await
}

async fn note(s: &Server, from: IpAddr, key_value: &str, extra: &[&[u8]]) -> Answer {
    let key_line = key(key_value.as_bytes());
    let mut headers: Vec<&[u8]> = vec![&key_line];
    headers.extend_from_slice(extra);
    send_from(s, from, &post("/notes", &headers, b"{}")).await
}

fn execution(a: &Answer) -> u64 {
    a.json()["execution"].as_u64().expect("execution")
}

mod cases {
    use super::*;

    /// Answers of 4 MB against a per-scope quota of 64 MiB with 4 MiB set aside per claim:
    /// three flooding scopes, each refused after about fifteen records, leave room for an
    /// honest scope (the store holds 256 MiB).
    pub async fn a_flooding_scope_is_refused_alone_before_its_handler_runs(name: &'static str) {
        const ANSWER: usize = 4_000_000;
        const PER_FLOODER: usize = 24;
        let mut s = Server::start_on(name, "0.0.0.0:0", &["--max-response", "4194304"]);
        let big = format!("/big?bytes={ANSWER}");
        let flooders = [peer(2), peer(3), peer(4)];
        let honest = peer(5);

        let flood = flooders.map(|from| {
            let s = &s;
            let big = big.clone();
            async move {
                let mut answered = Vec::new();
                let mut refused = Vec::new();
                for i in 0..PER_FLOODER {
                    let k = format!("flood-{from}-{i}");
                    let a = send_from(s, from, &post(&big, &[&key(k.as_bytes())], b"")).await;
                    match a.status {
                        200 => {
                            assert_eq!(a.body.len(), ANSWER);
                            answered.push(k);
                        }
                        503 => {
                            a.assert_problem(503, "IDEMPOTENCY_STORE_FULL");
                            assert!(a.header("retry-after").is_some(), "503 without Retry-After");
                            refused.push(k);
                        }
                        other => panic!("flooder {from}: {other} {:?}", a.header("content-type")),
                    }
                }
                (from, answered, refused)
            }
        });
        let honest_run = async {
            let mut first = Vec::new();
            for i in 0..30 {
                let k = format!("honest-{i}");
                let body = br#"{"sku":"book","quantity":1}"#;
                let a = send_from(&s, honest, &post("/orders", &[&key(k.as_bytes())], body)).await;
                assert_eq!(
                    a.status,
                    201,
                    "an honest caller was refused: {:?}",
                    a.json()
                );
                first.push((k, a.body));
            }
            first
        };
        let (floods, first) = tokio::join!(futures_util::future::join_all(flood), honest_run);

        let mut ran = 0;
        for (from, answered, refused) in &floods {
            assert!(
                !refused.is_empty(),
                "flooder {from} was never refused: its quota holds more than {PER_FLOODER} answers"
            );
            assert!(
                answered.len() >= 10,
                "flooder {from} was refused early: {}",
                answered.len()
            );
            ran += answered.len();
            // No key answers 409 after its answer was sent: each replays.
            for k in answered {
                let a = send_from(&s, *from, &post(&big, &[&key(k.as_bytes())], b"")).await;
                assert_eq!(
                    a.status,
                    200,
                    "{k} after its 200: {:?}",
                    String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
                );
                assert!(a.replayed(), "{k} ran again");
            }
            for k in refused {
                let a = send_from(&s, *from, &post(&big, &[&key(k.as_bytes())], b"")).await;
                a.assert_problem(503, "IDEMPOTENCY_STORE_FULL");
            }
        }
        assert_eq!(
            s.runs("/big").await,
            ran as u64,
            "a refused request's handler ran"
        );
        // The honest scope's answers were recorded: each replays byte for byte.
        for (k, body) in &first {
            let order = br#"{"sku":"book","quantity":1}"#;
            let a = send_from(&s, honest, &post("/orders", &[&key(k.as_bytes())], order)).await;
            assert_eq!(a.status, 201);
            assert!(a.replayed(), "{k} was not recorded");
            assert_eq!(&a.body, body);
        }
        assert_eq!(s.runs("/orders").await, 30);
        s.assert_alive_without_panic();
    }

    pub async fn clients_behind_a_trusted_proxy_are_scoped_by_the_forwarded_address(
        name: &'static str,
    ) {
        let mut s = Server::start_on(name, "0.0.0.0:0", &["--trusted-proxy", "127.0.0.2/32"]);
        let proxy = peer(2);
        let first = note(&s, proxy, "k", &[b"X-Forwarded-For: 203.0.113.9:4711"]).await;
        assert_eq!(first.status, 201);
        assert!(!first.replayed());
        // The same client, however the hop is written, is the same scope.
        for hop in [
            &b"X-Forwarded-For: 203.0.113.9"[..],
            b"X-Forwarded-For: ::ffff:203.0.113.9, 127.0.0.2",
            b"Forwarded: for=\"203.0.113.9:80\";proto=https",
            b"Forwarded: for=203.0.113.9",
        ] {
            let a = note(&s, proxy, "k", &[hop]).await;
            assert!(a.replayed(), "{}", String::from_utf8_lossy(hop));
            assert_eq!(a.body, first.body);
        }
        // IPv6 clients, bracketed and with a port, are one scope, another than the first.
        let v6 = note(&s, proxy, "k", &[b"X-Forwarded-For: [2001:db8::1]:443"]).await;
        assert_eq!(v6.status, 201);
        assert!(
            !v6.replayed(),
            "two clients behind one proxy shared a scope"
        );
        let v6_again = note(&s, proxy, "k", &[b"Forwarded: for=\"[2001:db8::1]\""]).await;
        assert!(v6_again.replayed());
        assert_eq!(v6_again.body, v6.body);
        // A trusted proxy that gives no usable address is refused; its own address never scopes.
        for nothing in [
            &[][..],
            &[&b"X-Forwarded-For: unknown"[..]],
            &[b"Forwarded: for=_hidden"],
        ] {
            note(&s, proxy, "k", nothing)
                .await
                .assert_problem(500, "IDEMPOTENCY_SCOPE_UNRESOLVED");
        }
        // An untrusted peer's header is ignored: it is its own scope and runs.
        let spoofed = note(&s, peer(3), "k", &[b"X-Forwarded-For: 203.0.113.9"]).await;
        assert_eq!(spoofed.status, 201);
        assert!(!spoofed.replayed(), "an untrusted peer chose its scope");
        assert_eq!(s.runs("/notes").await, 3);
        s.assert_alive_without_panic();
    }

    /// The attack of #27: nginx's `$proxy_add_x_forwarded_for` appends the real address to
    /// whatever the client wrote, so a client that puts a non-UTF-8 byte in its own
    /// `X-Forwarded-For` and a victim's address in its own `Forwarded` must still be scoped by
    /// the hop the proxy appended, never handed the victim's answer.
    pub async fn a_client_behind_a_trusted_proxy_cannot_pick_its_own_scope(name: &'static str) {
        let mut s = Server::start_on(name, "0.0.0.0:0", &["--trusted-proxy", "127.0.0.2/32"]);
        let proxy = peer(2);
        let victim = note(&s, proxy, "k-victim", &[b"X-Forwarded-For: 192.0.2.7"]).await;
        assert_eq!(victim.status, 201);
        assert!(!victim.replayed());
        assert_eq!(execution(&victim), 1);

        let attacker = note(
            &s,
            proxy,
            "k-victim",
            &[
                b"X-Forwarded-For: 6.6.6.6\xff, 198.51.100.9",
                b"Forwarded: for=192.0.2.7",
            ],
        )
        .await;
        assert!(
            !attacker.replayed(),
            "the attacker was handed the victim's answer: {:?}",
            String::from_utf8_lossy(&attacker.body)
        );
        assert_eq!(
            attacker.status,
            201,
            "{:?}",
            String::from_utf8_lossy(&attacker.body)
        );
        assert_eq!(execution(&attacker), 2, "the handler ran for the attacker");
        // The attacker is scoped by the hop the proxy appended, whatever it wrote before it.
        let attacker_again = note(&s, proxy, "k-victim", &[b"X-Forwarded-For: 198.51.100.9"]).await;
        assert!(attacker_again.replayed());
        assert_eq!(attacker_again.body, attacker.body);
        // The victim still gets its own answer.
        let victim_again = note(&s, proxy, "k-victim", &[b"X-Forwarded-For: 192.0.2.7"]).await;
        assert!(victim_again.replayed());
        assert_eq!(victim_again.body, victim.body);

        // An X-Forwarded-For line that yields no hop never makes the client's own Forwarded
        // count: refused, and nothing runs.
        for unreadable in [
            &b"X-Forwarded-For: \xff"[..],
            b"X-Forwarded-For: ,",
            b"X-Forwarded-For:",
        ] {
            note(
                &s,
                proxy,
                "k-victim",
                &[unreadable, b"Forwarded: for=192.0.2.7"],
            )
            .await
            .assert_problem(500, "IDEMPOTENCY_SCOPE_UNRESOLVED");
        }
        // A proxy's hop that is not an address is refused, whatever the client wrote before it.
        note(
            &s,
            proxy,
            "k-victim",
            &[b"X-Forwarded-For: 192.0.2.7, unknown"],
        )
        .await
        .assert_problem(500, "IDEMPOTENCY_SCOPE_UNRESOLVED");
        assert_eq!(s.runs("/notes").await, 2);
        s.assert_alive_without_panic();
    }

    pub async fn the_resolver_and_credential_headers_decide_who_the_caller_is(name: &'static str) {
        // Without the setting, a session header is no credential: the caller is anonymous.
        let mut plain = Server::start(name, &[]);
        let a = note(&plain, peer(1), "s", &[b"X-Session: abc"]).await;
        assert_eq!(a.status, 201);
        plain.assert_alive_without_panic();
        drop(plain);

        let mut s = Server::start(name, &["--credential-header", "X-Session"]);
        let refused = note(&s, peer(1), "s", &[b"X-Session: abc"]).await;
        refused.assert_problem(500, "IDEMPOTENCY_SCOPE_UNRESOLVED");
        // Authorization stays a credential beside the configured one.
        let bearer = note(&s, peer(1), "s", &[b"Authorization: Bearer acme:alice"]).await;
        assert_eq!(bearer.status, 201);
        assert_eq!(s.runs("/notes").await, 1, "a refused request ran");

        // X-Api-Key alone is resolved by the runtime's resolver: each key is a scope.
        let a1 = note(&s, peer(1), "r", &[b"X-Api-Key: a"]).await;
        let b1 = note(&s, peer(1), "r", &[b"X-Api-Key: b"]).await;
        let a2 = note(&s, peer(1), "r", &[b"X-Api-Key: a"]).await;
        assert!(
            !a1.replayed() && !b1.replayed(),
            "two API keys shared a scope"
        );
        assert_ne!(execution(&a1), execution(&b1));
        assert!(a2.replayed());
        assert_eq!(a2.body, a1.body);
        // The same API key from another address is the same caller.
        let moved = note(&s, peer(4), "r", &[b"X-Api-Key: a"]).await;
        assert!(
            moved.replayed(),
            "the resolver's identity was scoped by the peer"
        );
        // A session header with an identity from the resolver is no longer anonymous.
        let both = note(&s, peer(1), "r", &[b"X-Api-Key: a", b"X-Session: abc"]).await;
        assert!(both.replayed());
        // The resolver's refusal is answered before anything runs.
        let empty = note(&s, peer(1), "e", &[b"X-Api-Key: "]).await;
        assert_eq!(empty.status, 401);
        assert_eq!(s.runs("/notes").await, 3);
        s.assert_alive_without_panic();
    }

    pub async fn the_key_header_is_a_setting(name: &'static str) {
        let mut s = Server::start(name, &["--key-header", "X-Idempotency-Key"]);
        let order = br#"{"sku":"book","quantity":1}"#;
        let custom = post("/orders", &[b"X-Idempotency-Key: order-1"], order);
        let first = s.send(&custom).await;
        assert_eq!(first.status, 201);
        assert!(!first.replayed());
        let again = s.send(&custom).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        // The default name is an ordinary header now: the required key is missing.
        s.send(&post("/orders", &[&key(b"order-1")], order))
            .await
            .assert_problem(400, "IDEMPOTENCY_KEY_REQUIRED");
        s.send(&post("/orders", &[b"X-Idempotency-Key: a, b"], order))
            .await
            .assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
        assert_eq!(s.runs("/orders").await, 1);
        s.assert_alive_without_panic();
    }
}
