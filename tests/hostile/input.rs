//! Hostile input over real HTTP against every conformance server (DESIGN.md §2, §5): keys with
//! bytes outside visible ASCII, keys of 255 / 256 / 10,000 characters, the header twice or
//! empty, quoted keys with bad escapes, bodies at the cap and one byte over, an endless chunked
//! body, a body slower than the server's patience, and a client sending more distinct keys than
//! its scope's quota. Each case asserts the documented status and problem `code`, that the
//! handler did not run, that the server neither panicked nor died, and bounds every read.
//!
//! ```text
//! cargo test --all-features --test hostile input::
//! ```

use std::time::Duration;

use crate::support;
use crate::support::raw::{self, Answer, Server, key, post};

against_every_server! {
    every_store: [
        keys_with_bytes_outside_visible_ascii_never_run,
        keys_of_255_256_and_10000_characters,
        header_twice_or_empty_is_400,
        quoted_keys_with_bad_escapes_are_400,
        bodies_at_the_cap_run_and_one_byte_over_is_413,
        endless_chunked_body_is_cut_off_at_the_cap,
        body_slower_than_body_timeout_is_408,
        keys_never_appear_in_any_log_line,
    ],
    // The memory store's per-scope quota (a SQL store has none).
    memory_only: [distinct_keys_past_the_scope_quota_are_503_store_full],
}

const ORDER: &[u8] = br#"{"sku":"book","quantity":1}"#;

async fn order(s: &Server, key_line: &[u8]) -> Answer {
    s.send(&post("/orders", &[key_line], ORDER)).await
}

#[track_caller]
fn assert_not_echoed(a: &Answer, secret: &str) {
    let body = String::from_utf8_lossy(&a.body);
    assert!(!body.contains(secret), "the key was echoed back: {body}");
    for (name, value) in &a.headers {
        assert!(
            !value.contains(secret),
            "the key was echoed in {name}: {value}"
        );
    }
}

mod cases {
    use super::*;

    /// Every decision, logged at TRACE by the server (the conformance servers' subscriber,
    /// `IDEMPOTENT_LOG=trace`), and no log line carries a raw key (DESIGN §7): a first run, a
    /// replay, a 409 while running, a 422 reuse, invalid keys, a panic, a 5xx, the layer's
    /// routes, another tenant. The log must hold the runtime's own events, so a server that
    /// logs nothing cannot pass.
    pub async fn keys_never_appear_in_any_log_line(name: &'static str) {
        let mut s = Server::start_traced(name, &[]);
        const MARK: &str = "Zq7xKeyMark";
        let k = |n: u32| format!("{MARK}-{n}");
        let with = |path: &str, key_value: &str, extra: &[&[u8]]| {
            let key_line = key(key_value.as_bytes());
            let mut headers: Vec<&[u8]> = vec![&key_line];
            headers.extend_from_slice(extra);
            post(path, &headers, ORDER)
        };
        let first = s.send(&with("/orders", &k(1), &[])).await;
        assert_eq!(first.status, 201);
        assert!(s.send(&with("/orders", &k(1), &[])).await.replayed());
        let other = br#"{"sku":"other","quantity":1}"#;
        let reused = s
            .send(&post("/orders", &[&key(k(1).as_bytes())], other))
            .await;
        reused.assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
        assert_eq!(
            s.send(&with(
                "/orders",
                &k(1),
                &[b"Authorization: Bearer acme:alice"]
            ))
            .await
            .status,
            201,
            "another tenant runs"
        );
        // 409 while a slow handler runs.
        let mut slow = s.connect().await;
        slow.write(&with("/slow?ms=700", &k(2), &[])).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.send(&with("/slow?ms=700", &k(2), &[]))
            .await
            .assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(slow.answer().await.status, 201);
        // Invalid keys: a list, a bad quote, too long.
        for bad in [
            format!("{}, {}", k(3), k(4)),
            format!("\"{}", k(5)),
            format!("{}{}", k(6), "x".repeat(300)),
        ] {
            s.send(&with("/orders", &bad, &[]))
                .await
                .assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
        }
        s.send(&with("/panic", &k(7), &[]))
            .await
            .assert_problem(500, "IDEMPOTENCY_HANDLER_PANICKED");
        assert_eq!(
            s.send(&with("/status?code=503", &k(8), &[])).await.status,
            503
        );
        assert_eq!(s.send(&with("/search?q=1", &k(9), &[])).await.status, 200);
        assert_eq!(s.send(&with("/notes", &k(10), &[])).await.status, 201);
        assert_eq!(
            s.send(&with("/shops/7/orders", &k(11), &[])).await.status,
            201
        );
        tokio::time::sleep(Duration::from_millis(200)).await;

        let log = s.log();
        let runtime_lines = log
            .lines()
            .filter(|l| l.contains("idempotent_runtime"))
            .count();
        // Today the runtime logs refusals, replays and panics (no per-request span yet), so a
        // few lines are all a working subscriber is sure to show.
        assert!(
            runtime_lines >= 5,
            "{name} logged {runtime_lines} lines of the runtime's at TRACE: is its subscriber on? \
             {log}"
        );
        let leaks: Vec<&str> = log.lines().filter(|l| l.contains(MARK)).collect();
        assert!(
            leaks.is_empty(),
            "{name} logged a raw key in {} of {} lines, e.g.:\n{}",
            leaks.len(),
            log.lines().count(),
            leaks.iter().take(5).copied().collect::<Vec<_>>().join("\n")
        );
        // The panic is logged on purpose; nothing else may panic.
        let _ = &mut s;
    }

    pub async fn keys_with_bytes_outside_visible_ascii_never_run(name: &'static str) {
        let mut s = Server::start(name, &[]);
        for byte in
            (0u8..=0xff).filter(|b| !(0x21..=0x7e).contains(b) && *b != b'\r' && *b != b'\n')
        {
            let mut value = b"secret".to_vec();
            value.push(byte);
            value.extend_from_slice(b"tail");
            for route in ["/orders", "/notes"] {
                let a = s.send(&post(route, &[&key(&value)], ORDER)).await;
                // Obs-text (0x80-0xFF), SP and HTAB are valid field content, so the request
                // reaches the runtime, which must refuse it. Other control bytes are not field
                // content: the HTTP parser may refuse them first, but only with a 400.
                let reaches_runtime = byte >= 0x80 || byte == b' ' || byte == b'\t';
                if reaches_runtime || a.header("content-type") == Some("application/problem+json") {
                    a.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                } else {
                    assert_eq!(a.status, 400, "byte {byte:#04x} on {route}");
                }
                assert_not_echoed(&a, "secret");
            }
        }
        // Whole keys that are not ASCII at all: invalid UTF-8, and valid UTF-8 beyond ASCII.
        for value in [
            &[0xff, 0xfe, 0xfd][..],
            "ключ-заказа".as_bytes(),
            &[0xc3, 0x28],
        ] {
            order(&s, &key(value))
                .await
                .assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
        }
        assert_eq!(s.runs("/orders").await, 0);
        assert_eq!(s.runs("/notes").await, 0);
        s.assert_alive_without_panic();
    }

    pub async fn keys_of_255_256_and_10000_characters(name: &'static str) {
        let mut s = Server::start(name, &[]);
        let k255 = "k".repeat(255);
        let first = order(&s, &key(k255.as_bytes())).await;
        assert_eq!(first.status, 201, "a 255-character key is valid");
        assert!(!first.replayed());
        let again = order(&s, &key(k255.as_bytes())).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "a 255-character key replays");
        assert_eq!(again.body, first.body);
        // 255 characters once unquoted: the quotes do not count.
        let quoted = format!("\"{k255}\"");
        assert!(order(&s, &key(quoted.as_bytes())).await.replayed());

        for len in [256, 10_000] {
            let long = "s".repeat(len);
            for route in ["/orders", "/notes"] {
                let a = s.send(&post(route, &[&key(long.as_bytes())], ORDER)).await;
                a.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                assert_not_echoed(&a, &"s".repeat(64));
            }
            let quoted = format!("\"{long}\"");
            order(&s, &key(quoted.as_bytes()))
                .await
                .assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
        }
        // Far past any sane key: the server may refuse the head itself (431), never run it.
        let huge = "s".repeat(200_000);
        let mut conn = s.connect().await;
        if conn
            .try_write(&post("/orders", &[&key(huge.as_bytes())], ORDER))
            .await
        {
            let status =
                match tokio::time::timeout(raw::ANSWER_DEADLINE, async { conn.answer().await })
                    .await
                {
                    Ok(a) => {
                        if a.header("content-type") == Some("application/problem+json") {
                            a.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                        }
                        Some(a.status)
                    }
                    Err(_) => panic!("no answer to a 200,000-character key"),
                };
            assert!(matches!(status, Some(400 | 431)), "{status:?}");
        }
        assert_eq!(s.runs("/orders").await, 1);
        assert_eq!(s.runs("/notes").await, 0);
        s.assert_alive_without_panic();
    }

    pub async fn header_twice_or_empty_is_400(name: &'static str) {
        let mut s = Server::start(name, &[]);
        let cases: [&[&[u8]]; 9] = [
            &[b"Idempotency-Key: secret-a", b"Idempotency-Key: secret-b"],
            &[b"Idempotency-Key: secret-a", b"Idempotency-Key: secret-a"],
            &[b"Idempotency-Key: secret-a", b"idempotency-key: secret-a"],
            &[b"Idempotency-Key: secret-a", b"Idempotency-Key:"],
            &[
                b"Idempotency-Key: secret-a",
                b"X-Other: 1",
                b"IDEMPOTENCY-KEY: secret-c",
            ],
            &[b"Idempotency-Key:"],
            &[b"Idempotency-Key:    "],
            &[b"Idempotency-Key: \"\""],
            &[b"Idempotency-Key: secret-a,secret-b"],
        ];
        for headers in cases {
            for route in ["/orders", "/notes"] {
                let a = s.send(&post(route, headers, ORDER)).await;
                a.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                assert_not_echoed(&a, "secret");
            }
        }
        assert_eq!(s.runs("/orders").await, 0);
        assert_eq!(s.runs("/notes").await, 0);
        // None of those claimed anything: the key runs once now, then replays.
        let first = order(&s, &key(b"secret-a")).await;
        assert_eq!((first.status, first.replayed()), (201, false));
        assert!(order(&s, &key(b"secret-a")).await.replayed());
        assert_eq!(s.runs("/orders").await, 1);
        s.assert_alive_without_panic();
    }

    pub async fn quoted_keys_with_bad_escapes_are_400(name: &'static str) {
        let mut s = Server::start(name, &[]);
        let bad: [&[u8]; 12] = [
            br#""secret\q""#,
            br#""secret\""#,
            br#""secret\"#,
            br#""secret\u0041""#,
            br#""secret"x""#,
            br#""secret" "b""#,
            br#""secret";p=1"#,
            br#""secret"#,
            b"\"secret\ttab\"",
            b"\"secret\xc3\xa9\"",
            br#""secret with space""#,
            br#""secret\\\""#,
        ];
        for value in bad {
            for route in ["/orders", "/notes"] {
                let a = s.send(&post(route, &[&key(value)], ORDER)).await;
                a.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                assert_not_echoed(&a, "secret");
            }
        }
        assert_eq!(s.runs("/orders").await, 0);
        assert_eq!(s.runs("/notes").await, 0);
        // Good escapes unquote to the bare key: one run, then replays in either form.
        let quoted = order(&s, &key(br#""a\"b\\c""#)).await;
        assert_eq!((quoted.status, quoted.replayed()), (201, false));
        let bare = order(&s, &key(br#"a"b\c"#)).await;
        assert_eq!(bare.status, 201);
        assert!(bare.replayed(), "the bare form is the same key");
        assert_eq!(bare.body, quoted.body);
        assert_eq!(s.runs("/orders").await, 1);
        s.assert_alive_without_panic();
    }

    /// A JSON order of exactly `len` bytes.
    fn order_of(len: usize) -> Vec<u8> {
        let frame = r#"{"sku":"","quantity":1}"#.len();
        format!(r#"{{"sku":"{}","quantity":1}}"#, "x".repeat(len - frame)).into_bytes()
    }

    fn chunked(path: &str, key_value: &str, body: &[u8], chunk: usize) -> Vec<u8> {
        let mut r = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Idempotency-Key: {key_value}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .into_bytes();
        for piece in body.chunks(chunk) {
            r.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            r.extend_from_slice(piece);
            r.extend_from_slice(b"\r\n");
        }
        r.extend_from_slice(b"0\r\n\r\n");
        r
    }

    pub async fn bodies_at_the_cap_run_and_one_byte_over_is_413(name: &'static str) {
        const CAP: usize = 1000;
        let mut s = Server::start(name, &["--max-body", &CAP.to_string()]);
        let at = order_of(CAP);
        let over = order_of(CAP + 1);
        assert_eq!((at.len(), over.len()), (CAP, CAP + 1));

        let a = s.send(&post("/orders", &[&key(b"k-at-cap")], &at)).await;
        assert_eq!(a.status, 201, "{:?}", String::from_utf8_lossy(&a.body));
        let a = s
            .send(&post("/orders", &[&key(b"k-over-cap")], &over))
            .await;
        a.assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");

        let a = s
            .send(&chunked("/orders", "k-chunked-at-cap", &at, 97))
            .await;
        assert_eq!(a.status, 201, "{:?}", String::from_utf8_lossy(&a.body));
        let a = s
            .send(&chunked("/orders", "k-chunked-over-cap", &over, 97))
            .await;
        a.assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");

        // A declared length far past the cap is refused without waiting for the body.
        let mut conn = s.connect().await;
        conn.write(
            b"POST /orders HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              Idempotency-Key: k-huge-length\r\nContent-Length: 1000000000000\r\n\r\n{\"sku\"",
        )
        .await;
        conn.answer()
            .await
            .assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");

        // The refused keys were never claimed: with a body that fits they run.
        let a = s.send(&post("/orders", &[&key(b"k-over-cap")], &at)).await;
        assert_eq!((a.status, a.replayed()), (201, false));
        assert_eq!(s.runs("/orders").await, 3);
        s.assert_alive_without_panic();
    }

    pub async fn endless_chunked_body_is_cut_off_at_the_cap(name: &'static str) {
        const CAP: usize = 4096;
        // A body timeout far beyond the test's own deadline: only the cap can end this.
        let mut s = Server::start(
            name,
            &["--max-body", &CAP.to_string(), "--body-timeout", "600"],
        );
        for route in ["/orders", "/notes"] {
            let mut conn = s.connect().await;
            conn.write(
                format!(
                    "POST {route} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                     Idempotency-Key: k-endless\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                .as_bytes(),
            )
            .await;
            // 64 KiB in 1 KiB chunks, then silence: no terminating chunk ever comes.
            let chunk = format!("400\r\n{}\r\n", "x".repeat(1024));
            for _ in 0..64 {
                if !conn.try_write(chunk.as_bytes()).await {
                    break;
                }
            }
            conn.answer()
                .await
                .assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");
        }
        assert_eq!(s.runs("/orders").await, 0);
        assert_eq!(s.runs("/notes").await, 0);
        s.assert_alive_without_panic();
    }

    pub async fn body_slower_than_body_timeout_is_408(name: &'static str) {
        let mut s = Server::start(name, &["--body-timeout", "1"]);
        let head = |k: &str, len: usize| {
            format!(
                "POST /orders HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                 Idempotency-Key: {k}\r\nContent-Length: {len}\r\n\r\n"
            )
        };

        // Stalls: half the body, then nothing.
        let mut conn = s.connect().await;
        conn.write(head("k-stall", ORDER.len()).as_bytes()).await;
        conn.write(&ORDER[..10]).await;
        conn.answer()
            .await
            .assert_problem(408, "IDEMPOTENCY_BODY_TIMEOUT");

        // Trickles: a byte every 200 ms, each one well inside the timeout, the whole body
        // (27 bytes, over 5 s) far outside it. The timeout bounds the body, not each read.
        let mut conn = s.connect().await;
        conn.write(head("k-trickle", ORDER.len()).as_bytes()).await;
        let mut sent_all = true;
        for byte in ORDER {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if !conn.try_write(&[*byte]).await {
                sent_all = false;
                break;
            }
        }
        let a = conn.answer().await;
        a.assert_problem(408, "IDEMPOTENCY_BODY_TIMEOUT");
        eprintln!("  trickle: whole body sent before the answer: {sent_all}");

        assert_eq!(s.runs("/orders").await, 0);
        // Neither key was claimed: with a prompt body each runs.
        for k in ["k-stall", "k-trickle"] {
            let a = order(&s, &key(k.as_bytes())).await;
            assert_eq!((a.status, a.replayed()), (201, false), "{k}");
        }
        assert_eq!(s.runs("/orders").await, 2);
        s.assert_alive_without_panic();
    }

    /// Sends `count` requests with distinct keys `<prefix>-<i>` over a few keep-alive
    /// connections from one client; returns how many got each status.
    async fn distinct_keys(
        s: &Server,
        prefix: &str,
        count: usize,
    ) -> std::collections::BTreeMap<u16, usize> {
        const CONNECTIONS: usize = 4;
        let mut tasks = Vec::new();
        for c in 0..CONNECTIONS {
            let mut conn = s.connect().await;
            let prefix = prefix.to_owned();
            tasks.push(tokio::spawn(async move {
                let mut seen = std::collections::BTreeMap::new();
                for i in (c..count).step_by(CONNECTIONS) {
                    let k = format!("{prefix}-{i}");
                    conn.write(&post("/notes", &[&key(k.as_bytes())], b"{}"))
                        .await;
                    let a = conn.answer().await;
                    match a.status {
                        201 => assert!(!a.replayed(), "{k} replayed"),
                        503 => {
                            a.assert_problem(503, "IDEMPOTENCY_STORE_FULL");
                            assert_eq!(a.header("retry-after"), Some("1"));
                        }
                        other => panic!("{k}: {other} {:?}", String::from_utf8_lossy(&a.body)),
                    }
                    *seen.entry(a.status).or_insert(0) += 1;
                }
                seen
            }));
        }
        let mut total = std::collections::BTreeMap::new();
        for t in tasks {
            for (status, n) in t.await.expect("sender") {
                *total.entry(status).or_insert(0) += n;
            }
        }
        total
    }

    pub async fn distinct_keys_past_the_scope_quota_are_503_store_full(name: &'static str) {
        /// The memory store's default per-scope quota (DESIGN.md §5).
        const QUOTA: usize = 10_000;
        let mut s = Server::start(name, &[]);
        // Warm the server up (allocator arenas, connection buffers) before the first reading.
        let mut conn = s.connect().await;
        for _ in 0..500 {
            conn.write(&raw::get("/orders/1")).await;
            assert_eq!(conn.answer().await.status, 404);
        }
        let rss_start = s.rss_kib();

        let stored = distinct_keys(&s, "k", QUOTA).await;
        assert_eq!(stored.get(&201), Some(&QUOTA), "{stored:?}");
        let rss_full = s.rss_kib();

        let refused = distinct_keys(&s, "over", QUOTA).await;
        assert_eq!(
            refused.get(&503),
            Some(&QUOTA),
            "past the quota every new key is 503 STORE_FULL: {refused:?}"
        );
        let rss_after = s.rss_kib();
        eprintln!(
            "  {name}: RSS {rss_start} KiB at start, {rss_full} KiB with {QUOTA} records, \
             {rss_after} KiB after {QUOTA} refusals"
        );
        // Refused keys hold nothing: the refusals grew the process by well under half of what
        // storing as many records did.
        let stored_cost = rss_full.saturating_sub(rss_start);
        assert!(
            rss_after.saturating_sub(rss_full) < (stored_cost / 2).max(2048),
            "RSS grew from {rss_full} KiB to {rss_after} KiB while refusing new keys \
             (storing {QUOTA} records cost {stored_cost} KiB)"
        );
        assert_eq!(s.runs("/notes").await, QUOTA as u64, "a refused key ran");

        // A full scope keeps what it has (replays) and refuses only itself.
        let again = s.send(&post("/notes", &[&key(b"k-7")], b"{}")).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "a full store evicted a live record");
        let still = s.send(&post("/notes", &[&key(b"over-7")], b"{}")).await;
        still.assert_problem(503, "IDEMPOTENCY_STORE_FULL");
        let other_scope = s
            .send(&post(
                "/notes",
                &[&key(b"over-7"), b"X-Api-Key: other-client"],
                b"{}",
            ))
            .await;
        assert_eq!(
            (other_scope.status, other_scope.replayed()),
            (201, false),
            "another scope is not affected by this one's quota"
        );
        // Without a key the optional endpoint needs no record and still runs.
        let keyless = s.send(&post("/notes", &[], b"{}")).await;
        assert_eq!(keyless.status, 201);
        assert_eq!(s.runs("/notes").await, QUOTA as u64 + 2);
        s.assert_alive_without_panic();
    }
}
