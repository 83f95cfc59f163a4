//! Idle connections that announce large bodies hold no buffer budget (DESIGN.md §5, "Buffers in
//! flight": a `Content-Length` reserves nothing). 300 connections each send only the headers
//! of a keyed `POST /orders` announcing 1 MiB and then stay silent; meanwhile another caller
//! (another peer address, so another scope) sends keyed orders with real bodies, and each
//! must run (201) and replay (`Idempotency-Replayed: true`) as if the idle ones were not there.
//!
//! ```text
//! cargo test --all-features --test hostile idle_bodies:: -- --nocapture
//! ```

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::raw::{self, Conn, Server, key, post};

/// Idle connections held open while the other caller's orders are sent.
const IDLE: usize = 300;
/// What each idle connection announces: the default `max_body`, so none is refused as too large.
const ANNOUNCED: usize = 1 << 20;
/// Orders the other caller sends while they idle.
const ORDERS: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_announcing_large_bodies_do_not_starve_other_callers() {
    let mut failures = Vec::new();
    for name in support::SERVERS {
        eprintln!("idle_bodies against {name}");
        if let Err(why) = run(name).await {
            eprintln!("{name}: FAILED: {why}");
            failures.push(format!("{name}: {why}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One server: `Err` says what the other caller saw instead of its 201 and replay.
async fn run(name: &'static str) -> Result<(), String> {
    // Listening on every address, so that 127.0.0.2 (the other caller) reaches it.
    let mut s = Server::start_on(name, "0.0.0.0:0", &[]);
    let idle_from: IpAddr = [127, 0, 0, 1].into();
    let caller: IpAddr = [127, 0, 0, 2].into();

    let started = Instant::now();
    let mut idle: Vec<Conn> = Vec::with_capacity(IDLE);
    for i in 0..IDLE {
        let mut conn = s.connect_from(Some(idle_from)).await;
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Idempotency-Key: idle-{i}\r\nContent-Length: {ANNOUNCED}\r\n\r\n"
        );
        conn.write(head.as_bytes()).await;
        idle.push(conn);
    }
    // Let the server read every head and start waiting for the bodies.
    tokio::time::sleep(Duration::from_millis(500)).await;
    eprintln!(
        "{name}: {IDLE} idle connections announcing {ANNOUNCED} bytes each, opened in {:?}",
        started.elapsed()
    );

    let mut outcome = Ok(());
    for n in 0..ORDERS {
        let body = format!(r#"{{"sku":"busy-{n}","quantity":1}}"#);
        let key_line = key(format!("busy-{n}").as_bytes());
        let request = post("/orders", &[&key_line], body.as_bytes());
        let mut conn = s.connect_from(Some(caller)).await;
        conn.write(&request).await;
        let first = conn.answer_within(Duration::from_secs(10)).await;
        conn.write(&request).await;
        let again = conn.answer_within(Duration::from_secs(10)).await;
        let text = |a: &raw::Answer| String::from_utf8_lossy(&a.body).into_owned();
        if first.status != 201 || first.replayed() {
            outcome = Err(format!(
                "order {n}: the first request answered {} (replayed: {}) {}, not a fresh 201",
                first.status,
                first.replayed(),
                text(&first)
            ));
            break;
        }
        if again.status != 201 || !again.replayed() || again.body != first.body {
            outcome = Err(format!(
                "order {n}: the repeat answered {} (replayed: {}) {}, not the replay of {}",
                again.status,
                again.replayed(),
                text(&again),
                text(&first)
            ));
            break;
        }
    }
    // The idle connections are still open (the server has not given up on them) and hold no
    // handler run: none of their bodies ever arrived.
    let runs = s.runs("/orders").await;
    if outcome.is_ok() && runs != ORDERS as u64 {
        outcome = Err(format!(
            "/orders ran {runs} times, not once per order ({ORDERS})"
        ));
    }
    s.assert_alive_without_panic();
    drop(idle);
    outcome
}
