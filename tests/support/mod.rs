//! What every integration-test group of the root package shares, included by each
//! `tests/<group>/main.rs` as `#[path = "../support/mod.rs"] mod support;`:
//!
//! - the services a test may use ([`database_url`], [`redis_url`], CI's [`required`] switches
//!   under which a missing service fails the test instead of skipping it), a PostgreSQL
//!   [`Schema`] of the test's own, a database of its own behind PgBouncer ([`PooledDatabase`],
//!   [`pgbouncer_url`]), and the example binaries the tests start ([`example_binary`]);
//! - the conformance servers ([`SERVERS`]) started as processes ([`start_server`]), driven with an
//!   HTTP client ([`harness`]) or over raw HTTP/1.1 where a client library would sanitize what a
//!   test sends ([`raw`]);
//! - what both clients check of an answer ([`assert_problem`], [`is_replay`]), and free ports.
//!
//! (A module rather than a crate: every group is in this one package, and the runtime's own
//! tests, in another package, need only the two service URLs.)

// Each group uses part of this.
#![allow(dead_code, unused_imports)]

pub mod harness;
pub mod raw;
mod services;
mod urls;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

#[cfg(feature = "mysql")]
pub use services::MysqlDatabase;
pub use services::{PooledDatabase, Schema, example_binary};
#[cfg(feature = "mysql")]
pub use urls::mysql_url;
pub use urls::{database_url, pgbouncer_url, redis_url, required};

/// The conformance servers the suites run against; each is an example of the root package.
#[cfg(not(feature = "actix"))]
pub const SERVERS: &[&str] = &["conformance_axum"];
/// The conformance servers the suites run against; each is an example of the root package.
#[cfg(feature = "actix")]
pub const SERVERS: &[&str] = &["conformance_axum", "conformance_actix"];

/// A server process, killed on drop (and the file its stderr went to, if any, removed).
pub struct Process {
    child: Child,
    stderr: Option<PathBuf>,
}

impl Process {
    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// How it exited, or `None` while it runs.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Everything it wrote to stderr so far (empty unless started with `log_stderr`).
    pub fn log(&self) -> String {
        self.stderr
            .as_ref()
            .map(|path| String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into())
            .unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(path) = &self.stderr {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Starts example `name` with `--addr ADDR`, `options` and `env` (and without the caller's
/// `IDEMPOTENT_LOG`), and waits for its `listening on http://HOST:PORT` line. Its stderr goes to
/// a file of its own when `log_stderr` (see [`Process::log`]), else nowhere. The address it
/// listens on comes back with an unspecified IP (`0.0.0.0`) as 127.0.0.1.
pub fn start_server<I>(
    name: &str,
    addr: &str,
    options: I,
    env: &[(&str, &str)],
    log_stderr: bool,
) -> (Process, SocketAddr)
where
    I: IntoIterator,
    I::Item: AsRef<OsStr>,
{
    start_server_via(&[], name, addr, options, env, log_stderr)
}

/// [`start_server`] with the example's command line after `wrapper` (e.g. `ip netns exec NS`,
/// to run it in a network namespace of the test's own).
pub fn start_server_via<I>(
    wrapper: &[&str],
    name: &str,
    addr: &str,
    options: I,
    env: &[(&str, &str)],
    log_stderr: bool,
) -> (Process, SocketAddr)
where
    I: IntoIterator,
    I::Item: AsRef<OsStr>,
{
    let stderr = log_stderr.then(|| {
        std::env::temp_dir().join(format!(
            "idempotent-{name}-{}-{:016x}.stderr",
            std::process::id(),
            idempotent_runtime::store::FencingToken::mint().0
        ))
    });
    let binary = example_binary(name);
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(&binary);
            c
        }
        None => Command::new(&binary),
    };
    let mut child = command
        .args(["--addr", addr])
        .args(options)
        .env_remove("IDEMPOTENT_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(match &stderr {
            Some(path) => std::fs::File::create(path).expect("stderr file").into(),
            None => Stdio::null(),
        })
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let process = Process { child, stderr };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{name} printed no `listening on` line"));
    let mut addr: SocketAddr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("{name} printed {line:?}, not `listening on http://…`"))
        .parse()
        .expect("HOST:PORT");
    if addr.ip().is_unspecified() {
        addr.set_ip([127, 0, 0, 1].into());
    }
    (process, addr)
}

/// A loopback port nothing listened on a moment ago (for a server of a test's own, such as a
/// `redis-server`, that must be told its port).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Whether an answer whose `Idempotency-Replayed` header is `header` is a replay: absent is
/// not, `true` is, any other value fails the test.
pub fn is_replay(header: Option<&str>) -> bool {
    match header {
        None => false,
        Some("true") => true,
        Some(other) => panic!("Idempotency-Replayed: {other}"),
    }
}

/// Asserts a refusal: `status`, `application/problem+json`, the RFC 9457 members and `code`,
/// and no `Idempotency-Replayed: true`; the answer is its status, two headers and its body.
#[track_caller]
pub fn assert_problem(answer: (u16, Option<&str>, Option<&str>, &[u8]), status: u16, code: &str) {
    let (got, content_type, replayed, body) = answer;
    assert_eq!(
        got,
        status,
        "expected {status} {code}, body: {:?}",
        String::from_utf8_lossy(body)
    );
    assert_eq!(content_type, Some("application/problem+json"));
    let doc: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{e}: status {got} body {:?}", String::from_utf8_lossy(body)));
    assert_eq!(doc["code"], code, "{doc}");
    assert_eq!(doc["status"], status, "{doc}");
    for member in ["type", "title", "detail"] {
        assert!(doc[member].is_string(), "problem without {member}: {doc}");
    }
    assert!(!is_replay(replayed), "a refusal is never marked replayed");
}
