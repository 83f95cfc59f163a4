//! Starting a conformance server as a subprocess and talking to it over real HTTP.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;

pub use super::SERVERS;
use super::{Process, Schema, start_server};

tokio::task_local! {
    /// Store options every server a case starts is given, unless the case picks a store itself
    /// (see [`on_redis`]).
    static REDIS: String;
}

#[cfg(feature = "mysql")]
tokio::task_local! {
    /// The MySQL/MariaDB server every server a case starts is given a database of its own on,
    /// unless the case picks a store itself (see [`on_mysql`]).
    static MYSQL: String;
}

/// Runs `case` with every server it starts on the MySQL/MariaDB at `url` (`MYSQL_URL`), each in
/// a database of its own, dropped with the server.
#[cfg(feature = "mysql")]
pub async fn on_mysql<F: std::future::Future>(url: String, case: F) -> F::Output {
    MYSQL.scope(url, case).await
}

tokio::task_local! {
    /// Set while every server a case starts is given a PostgreSQL database of its own behind
    /// PgBouncer in transaction mode, unless the case picks a store itself (see
    /// [`on_pgbouncer`]).
    static PGBOUNCER: ();
}

/// Runs `case` with every server it starts on the PostgreSQL store behind PgBouncer
/// (`PGBOUNCER_URL`) with `--transaction-pooler`, each in a database of its own, dropped with
/// the server.
pub async fn on_pgbouncer<F: std::future::Future>(case: F) -> F::Output {
    PGBOUNCER.scope((), case).await
}

/// Runs `case` with every server it starts on the Redis at `url`, each under a key prefix of its
/// own (so the two frameworks' runs of one case never meet each other's records).
pub async fn on_redis<F: std::future::Future>(url: String, case: F) -> F::Output {
    REDIS.scope(url, case).await
}

/// The store options for a server started now: none (memory), Redis under a fresh prefix, or
/// MySQL or PostgreSQL behind PgBouncer in a fresh database (kept alive by the returned guard).
/// Servers of both kinds ([`Server`] here and [`raw::Server`](super::raw::Server)) take them.
pub(super) fn store_options(
    options: &[&str],
) -> (Vec<String>, Option<Box<dyn std::any::Any + Send + Sync>>) {
    if options.contains(&"--store") {
        return (Vec::new(), None);
    }
    if PGBOUNCER.try_with(|()| ()).is_ok() {
        let db = super::PooledDatabase::new("conformance")
            .expect("a case on PgBouncer runs only with PGBOUNCER_URL and DATABASE_URL");
        let options = [
            "--store",
            "postgres",
            "--database-url",
            &db.url(),
            "--transaction-pooler",
        ]
        .map(String::from)
        .to_vec();
        return (options, Some(Box::new(db)));
    }
    #[cfg(feature = "mysql")]
    if let Ok(db) = MYSQL.try_with(|url| super::MysqlDatabase::new(url, "conformance")) {
        let options = ["--store", "mysql", "--database-url", &db.url()]
            .map(String::from)
            .to_vec();
        return (options, Some(Box::new(db)));
    }
    let options = REDIS
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
        .unwrap_or_default();
    (options, None)
}

/// Starts `name` on the PostgreSQL `schema` (first on the URL's `search_path`) with extra
/// options.
pub fn on_postgres(name: &'static str, schema: &Schema, extra: &[&str]) -> Server {
    let url = schema.url();
    let mut options = vec!["--store", "postgres", "--database-url", &url];
    options.extend_from_slice(extra);
    Server::start(name, &options)
}

/// The value of the sample of `name` whose labels contain every one of `labels`, in a
/// `GET /metrics` answer.
pub fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            metric == name && labels.iter().all(|label| rest.contains(label))
        })
        .map(|(_, value)| value.parse().expect("a number"))
}

/// A running server, killed on drop.
pub struct Server {
    pub name: &'static str,
    pub addr: SocketAddr,
    process: Process,
    client: reqwest::Client,
    /// What the server's store needs while it runs (a database of its own), dropped after it.
    _store: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Server {
    /// Starts `name` on a free port with extra options and waits for its `listening on` line.
    pub fn start(name: &'static str, options: &[&str]) -> Self {
        let (store, guard) = store_options(options);
        let options = options.iter().map(|o| o.to_string()).chain(store);
        let (process, addr) = start_server(name, "127.0.0.1:0", options, &[], false);
        Self {
            name,
            addr,
            process,
            client: reqwest::Client::new(),
            _store: guard,
        }
    }

    /// Starts `name` with `wrapper` before its command line (`ip netns exec NS`), listening on
    /// `addr`, its stderr kept (see [`log`](Self::log)) at `IDEMPOTENT_LOG=log_filter`; the
    /// store options are the caller's.
    pub fn start_via(
        wrapper: &[&str],
        name: &'static str,
        addr: &str,
        options: &[&str],
        log_filter: &str,
    ) -> Self {
        let (process, addr) = super::start_server_via(
            wrapper,
            name,
            addr,
            options,
            &[("IDEMPOTENT_LOG", log_filter)],
            true,
        );
        Self {
            name,
            addr,
            process,
            client: reqwest::Client::new(),
            _store: None,
        }
    }

    /// What the server wrote to stderr (only when started with [`start_via`](Self::start_via)).
    pub fn log(&self) -> String {
        self.process.log()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A POST to `path`.
    pub fn post(&self, path: &str) -> Call {
        Call(self.client.post(self.url(path)))
    }

    /// A GET of `path`, to add headers to (the operators' endpoints; the other suites need none).
    #[allow(dead_code)]
    pub fn get_call(&self, path: &str) -> Call {
        Call(self.client.get(self.url(path)))
    }

    /// A DELETE of `path` (the operators' endpoints).
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
