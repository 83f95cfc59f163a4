//! Follows the README's quick start literally, so it cannot rot: runs the README's first
//! command, pastes the `curl` the example prints twice, and checks the first answer is the
//! original and the second its replay, with one order created.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The commands of the README's quick-start block, comments stripped.
fn quickstart_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let start = readme
        .find("## Quick start")
        .expect("a '## Quick start' section");
    let block = readme[start..]
        .split("```")
        .nth(1)
        .expect("a code block in the quick start");
    block
        .lines()
        .skip(1) // the fence's info string
        .map(|l| l.split('#').next().unwrap_or("").trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

fn sh(command: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", command])
        .output()
        .expect("run sh");
    assert!(out.status.success(), "`{command}` failed: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[test]
fn readme_quick_start_shows_a_replay() {
    let commands = quickstart_commands();
    assert_eq!(
        commands.len(),
        2,
        "two commands: run the example, run the tests: {commands:?}"
    );
    let run = &commands[0];
    assert!(run.starts_with("cargo run --example "), "{run}");
    assert!(commands[1].contains("test"), "{}", commands[1]);
    shows_a_replay(run);
}

/// The actix twin of the main example behaves the same.
#[test]
fn orders_actix_shows_a_replay() {
    shows_a_replay("cargo run --example orders_actix");
}

/// Runs `run` (a `cargo run --example …` line), pastes the `curl` it prints twice, and checks
/// the original, the replay, and that one order exists.
fn shows_a_replay(run: &str) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let run = run.replacen("cargo", &cargo, 1);
    let mut child = Command::new("sh")
        .args(["-c", &format!("exec {run} --quiet")])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("ORDERS_ADDR", "127.0.0.1:0")
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the example");
    let stdout = child.stdout.take().expect("stdout");
    let server = Running(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    while lines.len() < 4 {
        // Generous: the first run may compile the example.
        match rx.recv_timeout(Duration::from_secs(600)) {
            Ok(line) => lines.push(line),
            Err(e) => panic!("the example printed {lines:?} and then {e}"),
        }
    }
    assert!(
        lines[0].starts_with("listening on http://127.0.0.1:"),
        "{lines:?}"
    );
    let curl = lines
        .iter()
        .find(|l| l.starts_with("curl -si -X POST"))
        .unwrap_or_else(|| panic!("a curl to paste: {lines:?}"));
    let list = lines
        .iter()
        .find_map(|l| l.split_once(": curl ").map(|(_, c)| format!("curl {c}")))
        .unwrap_or_else(|| panic!("a curl listing the orders: {lines:?}"));

    let first = sh(curl);
    let second = sh(curl);
    let (head1, body1) = first.split_once("\r\n\r\n").expect("headers and body");
    let (head2, body2) = second.split_once("\r\n\r\n").expect("headers and body");
    assert!(head1.starts_with("HTTP/1.1 201"), "{first}");
    assert!(
        !head1.to_ascii_lowercase().contains("idempotency-replayed"),
        "{first}"
    );
    assert!(head2.starts_with("HTTP/1.1 201"), "{second}");
    assert!(
        head2
            .to_ascii_lowercase()
            .contains("idempotency-replayed: true"),
        "{second}"
    );
    assert_eq!(body1, body2, "the replay carries the original body");
    let orders: serde_json::Value = serde_json::from_str(&sh(&list)).expect("JSON list");
    assert_eq!(
        orders.as_array().map(Vec::len),
        Some(1),
        "one order: {orders}"
    );
    drop(server);
}
