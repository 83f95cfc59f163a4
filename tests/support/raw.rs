//! A raw HTTP/1.1 client and a conformance-server process for the hostile-input and cross-scope
//! suites. Raw, because an HTTP client library sanitizes exactly what these suites send (bytes
//! outside visible ASCII, a header twice, an endless chunked body), and because the cross-scope
//! suite binds its client sockets to chosen loopback addresses. Every read has a deadline: a
//! server that hangs fails the test instead of stalling it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as AsyncBufReader};
use tokio::net::{TcpSocket, TcpStream};

pub use super::SERVERS;
use super::{Process, start_server};

/// How long any one answer may take before the test calls it a hang.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(30);

/// A running conformance server, killed on drop. Its stderr goes to a file, so a test can
/// check that nothing panicked.
pub struct Server {
    pub name: &'static str,
    pub addr: SocketAddr,
    process: Process,
    /// What the server's store needs while it runs (a database of its own), dropped after it.
    _store: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Server {
    /// Starts `name` on a free loopback port with extra options.
    pub fn start(name: &'static str, options: &[&str]) -> Self {
        Self::start_on(name, "127.0.0.1:0", options)
    }

    /// Starts `name` listening on `addr` (e.g. `0.0.0.0:0`, so other loopback addresses reach it).
    pub fn start_on(name: &'static str, addr: &str, options: &[&str]) -> Self {
        Self::start_with_env(name, addr, options, &[])
    }

    /// Starts `name` with every `tracing` event at TRACE level written to its stderr (see
    /// [`Server::log`]).
    pub fn start_traced(name: &'static str, options: &[&str]) -> Self {
        Self::start_with_env(name, "127.0.0.1:0", options, &[("IDEMPOTENT_LOG", "trace")])
    }

    /// Starts `name` listening on `addr` with extra environment variables, on the store the
    /// running case chose ([`harness::on_mysql`](super::harness::on_mysql) and the like) unless
    /// `options` pick one.
    pub fn start_with_env(
        name: &'static str,
        addr: &str,
        options: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let (store, guard) = super::harness::store_options(options);
        let options = options.iter().map(|o| o.to_string()).chain(store);
        let (process, addr) = start_server(name, addr, options, env, true);
        Self {
            name,
            addr,
            process,
            _store: guard,
        }
    }

    /// The server's resident set size in KiB (Linux `/proc`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.process.id()))
            .expect("read /proc/<pid>/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    /// Everything the process wrote to stderr so far (its log, when started traced).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Panics unless the process is still running and has logged no panic.
    #[track_caller]
    pub fn assert_alive_without_panic(&mut self) {
        let exited = self.process.exited();
        let log = self.process.log();
        assert!(exited.is_none(), "{} exited ({exited:?}): {log}", self.name);
        assert!(!log.contains("panicked"), "{} panicked: {log}", self.name);
    }

    /// Opens a connection, from `source` when given (any address of 127.0.0.0/8 works).
    pub async fn connect_from(&self, source: Option<IpAddr>) -> Conn {
        let socket = TcpSocket::new_v4().expect("socket");
        if let Some(ip) = source {
            socket.bind(SocketAddr::new(ip, 0)).expect("bind source");
        }
        let stream = tokio::time::timeout(ANSWER_DEADLINE, socket.connect(self.addr))
            .await
            .expect("connect timed out")
            .expect("connect");
        Conn(AsyncBufReader::new(stream))
    }

    /// A fresh connection from 127.0.0.1.
    pub async fn connect(&self) -> Conn {
        self.connect_from(None).await
    }

    /// One request on a fresh connection; the answer.
    pub async fn send(&self, request: &[u8]) -> Answer {
        let mut conn = self.connect().await;
        conn.write(request).await;
        conn.answer().await
    }

    /// How many times the handler of `route` really ran (`GET /executions`).
    pub async fn runs(&self, route: &str) -> u64 {
        let all = self.send(&get("/executions")).await.json();
        all[route]
            .as_u64()
            .unwrap_or_else(|| panic!("{}: /executions has no {route}: {all}", self.name))
    }
}

/// One client connection; keep-alive unless a request says `Connection: close`.
pub struct Conn(AsyncBufReader<TcpStream>);

impl Conn {
    /// Writes bytes (a request or part of one).
    pub async fn write(&mut self, bytes: &[u8]) {
        tokio::time::timeout(ANSWER_DEADLINE, self.0.get_mut().write_all(bytes))
            .await
            .expect("write timed out")
            .expect("write");
    }

    /// Writes bytes, reporting whether the server still accepted them (it may already have
    /// answered and closed).
    pub async fn try_write(&mut self, bytes: &[u8]) -> bool {
        matches!(
            tokio::time::timeout(ANSWER_DEADLINE, self.0.get_mut().write_all(bytes)).await,
            Ok(Ok(()))
        )
    }

    /// Reads one answer, failing the test if none arrives within [`ANSWER_DEADLINE`].
    pub async fn answer(&mut self) -> Answer {
        self.answer_within(ANSWER_DEADLINE).await
    }

    /// Reads one answer, failing the test if none arrives within `deadline`.
    pub async fn answer_within(&mut self, deadline: Duration) -> Answer {
        tokio::time::timeout(deadline, self.read_answer())
            .await
            .unwrap_or_else(|_| panic!("no answer within {deadline:?}"))
            .unwrap_or_else(|e| panic!("reading the answer: {e}"))
    }

    /// Whether the server closed the connection (EOF within `deadline`) without another answer.
    pub async fn closed_within(&mut self, deadline: Duration) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(deadline, self.0.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    async fn read_answer(&mut self) -> std::io::Result<Answer> {
        let r = &mut self.0;
        let mut status_line = String::new();
        if r.read_line(&mut status_line).await? == 0 {
            return Err(std::io::Error::other(
                "the server closed the connection without answering",
            ));
        }
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not HTTP: {status_line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let mut line = Vec::new();
            r.read_until(b'\n', &mut line).await?;
            let line = String::from_utf8_lossy(&line).trim_end().to_owned();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap_or((&line, ""));
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
        let header = |n: &str| headers.iter().find(|(h, _)| h == n).map(|(_, v)| v.clone());
        let mut body = Vec::new();
        if header("transfer-encoding").is_some_and(|te| te.eq_ignore_ascii_case("chunked")) {
            loop {
                let mut size = String::new();
                r.read_line(&mut size).await?;
                let size =
                    usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                        .map_err(|_| std::io::Error::other(format!("bad chunk size {size:?}")))?;
                if size == 0 {
                    let mut trailer = String::new();
                    while r.read_line(&mut trailer).await? > 2 {
                        trailer.clear();
                    }
                    break;
                }
                let start = body.len();
                body.resize(start + size, 0);
                r.read_exact(&mut body[start..]).await?;
                let mut crlf = [0u8; 2];
                r.read_exact(&mut crlf).await?;
            }
        } else if let Some(len) = header("content-length") {
            let len: usize = len
                .parse()
                .map_err(|_| std::io::Error::other("bad content-length"))?;
            body.resize(len, 0);
            r.read_exact(&mut body).await?;
        } else if status >= 200 && status != 204 && status != 304 {
            r.read_to_end(&mut body).await?;
        }
        Ok(Answer {
            status,
            headers,
            body,
        })
    }
}

/// A complete answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(h, _)| h == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{e}: status {} body {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn replayed(&self) -> bool {
        super::is_replay(self.header("idempotency-replayed"))
    }

    /// Asserts a refusal: status, `application/problem+json`, the RFC 9457 members and `code`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        let answer = (
            self.status,
            self.header("content-type"),
            self.header("idempotency-replayed"),
            &self.body[..],
        );
        super::assert_problem(answer, status, code);
    }
}

/// A keep-alive `POST` with a JSON body and the given extra header lines (raw bytes, each
/// without its CRLF).
pub fn post(path: &str, headers: &[&[u8]], body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n",
        body.len()
    )
    .into_bytes();
    for h in headers {
        r.extend_from_slice(h);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"\r\n");
    r.extend_from_slice(body);
    r
}

/// `Idempotency-Key: <value>` as a header line.
pub fn key(value: &[u8]) -> Vec<u8> {
    let mut h = b"Idempotency-Key: ".to_vec();
    h.extend_from_slice(value);
    h
}

/// A keep-alive `GET`.
pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").into_bytes()
}
