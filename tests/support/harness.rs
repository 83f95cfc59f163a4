//! Starting a conformance server as a subprocess and talking to it over real HTTP.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;

/// The servers the suite runs against; each is an example of the root package.
#[cfg(not(feature = "actix"))]
pub const SERVERS: &[&str] = &["conformance_axum"];
/// The servers the suite runs against; each is an example of the root package.
#[cfg(feature = "actix")]
pub const SERVERS: &[&str] = &["conformance_axum", "conformance_actix"];

tokio::task_local! {
    /// Store options every server a case starts is given, unless the case picks a store itself
    /// (see [`on_redis`]).
    static REDIS: String;
}

/// Runs `case` with every server it starts on the Redis at `url`, each under a key prefix of its
/// own (so the two frameworks' runs of one case never meet each other's records).
pub async fn on_redis<F: std::future::Future>(url: String, case: F) -> F::Output {
    REDIS.scope(url, case).await
}

/// The store options for a server started now: none (memory), or Redis under a fresh prefix.
fn store_options(options: &[&str]) -> Vec<String> {
    if options.contains(&"--store") {
        return Vec::new();
    }
    REDIS
        .try_with(|url| {
            let prefix = format!(
                "conformance-{:016x}",
                idempotent_runtime::store::FencingToken::mint().0
            );
            [
                "--store",
                "redis",
                "--database-url",
                url,
                "--redis-prefix",
                &prefix,
            ]
            .map(String::from)
            .to_vec()
        })
        .unwrap_or_default()
}

/// A running server, killed on drop.
pub struct Server {
    pub name: &'static str,
    pub addr: SocketAddr,
    child: Child,
    client: reqwest::Client,
}

impl Server {
    /// Starts `name` on a free port with extra options and waits for its `listening on` line.
    pub fn start(name: &'static str, options: &[&str]) -> Self {
        let mut child = Command::new(idempotent_examples::testkit::example_binary(name))
            .args(["--addr", "127.0.0.1:0"])
            .args(options)
            .args(store_options(options))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{name} printed no `listening on` line"));
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("{name} printed {line:?}, not `listening on http://…`"))
            .parse()
            .expect("HOST:PORT");
        Self {
            name,
            addr,
            child,
            client: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A POST to `path`.
    pub fn post(&self, path: &str) -> Call {
        Call(self.client.post(self.url(path)))
    }

    /// A GET of `path`, to add headers to (tests/operators.rs; the other suites need none).
    #[allow(dead_code)]
    pub fn get_call(&self, path: &str) -> Call {
        Call(self.client.get(self.url(path)))
    }

    /// A DELETE of `path` (tests/operators.rs).
    #[allow(dead_code)]
    pub fn delete(&self, path: &str) -> Call {
        Call(self.client.delete(self.url(path)))
    }

    /// A GET of `path`.
    pub async fn get(&self, path: &str) -> Resp {
        Call(self.client.get(self.url(path))).send().await
    }

    /// `GET /executions`.
    pub async fn executions(&self) -> Value {
        self.get("/executions").await.json()
    }

    /// How many times the handler of `route` really ran.
    pub async fn runs(&self, route: &str) -> u64 {
        let all = self.executions().await;
        all[route]
            .as_u64()
            .unwrap_or_else(|| panic!("{}: /executions has no {route}: {all}", self.name))
    }

    /// Waits until `route` has run `n` times (a background request reached its handler).
    pub async fn wait_runs(&self, route: &str, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.runs(route).await < n {
            assert!(Instant::now() < deadline, "{route} never ran {n} times");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends raw bytes on a fresh connection and reads the whole answer (the request should say
    /// `Connection: close`).
    pub fn raw(&self, request: &[u8]) -> RawResp {
        let mut stream = TcpStream::connect(self.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        stream.write_all(request).expect("write");
        read_raw(&mut stream)
    }

    /// A raw connection, for requests sent in pieces.
    pub fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        stream
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads a whole HTTP/1.1 answer until the server closes the connection.
pub fn read_raw(stream: &mut TcpStream) -> RawResp {
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    let text = String::from_utf8_lossy(&all).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    RawResp { status, text }
}

/// An answer read off a raw connection.
pub struct RawResp {
    pub status: u16,
    pub text: String,
}

impl RawResp {
    /// The body, as JSON.
    pub fn json(&self) -> Value {
        let body = self.text.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {:?}", self.text))
    }
}

/// A request being built.
pub struct Call(reqwest::RequestBuilder);

impl Call {
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    pub fn header(self, name: &str, value: &str) -> Self {
        Self(self.0.header(name, value))
    }

    pub fn bearer(self, tenant_subject: &str) -> Self {
        self.header("authorization", &format!("Bearer {tenant_subject}"))
    }

    pub fn json(self, body: &Value) -> Self {
        self.raw_json(&body.to_string())
    }

    pub fn raw_json(self, body: &str) -> Self {
        Self(
            self.0
                .header("content-type", "application/json")
                .body(body.to_owned()),
        )
    }

    pub async fn send(self) -> Resp {
        self.try_send().await.expect("request failed")
    }

    pub async fn try_send(self) -> reqwest::Result<Resp> {
        let response = self.0.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Resp {
            status,
            headers,
            body,
        })
    }
}

/// A complete answer.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: status {} body {:?}", self.status, self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }

    /// Whether it carries `Idempotency-Replayed: true`.
    pub fn replayed(&self) -> bool {
        match self.header("idempotency-replayed") {
            None => false,
            Some("true") => true,
            Some(other) => panic!("Idempotency-Replayed: {other}"),
        }
    }

    /// Asserts a refusal: status, `application/problem+json`, the RFC 9457 members and `code`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let doc = self.json();
        assert_eq!(doc["code"], code, "{doc}");
        assert_eq!(doc["status"], status, "{doc}");
        for member in ["type", "title", "detail"] {
            assert!(doc[member].is_string(), "problem without {member}: {doc}");
        }
        assert!(!self.replayed(), "a refusal is never marked replayed");
    }
}
