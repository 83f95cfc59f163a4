#![cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]

//! Captures what the runtime logs while a test runs on this thread.

use std::io::Write;
use std::sync::{Arc, Mutex};

use tracing::Dispatch;
use tracing::dispatcher::DefaultGuard;

/// Everything logged at TRACE and above on this thread while the guard lives.
#[derive(Clone, Default)]
pub(crate) struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    pub(crate) fn capture() -> (Self, ThreadDefault) {
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, ThreadDefault::set(subscriber))
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("logs")).into_owned()
    }

    /// Error lines only.
    pub(crate) fn errors(&self) -> Vec<String> {
        let text = self.text();
        text.lines()
            .filter(|l| l.contains("ERROR"))
            .map(str::to_owned)
            .collect()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A subscriber set as this thread's default while the value lives, for a test among others
/// running on other threads of the same process.
///
/// Beside it lives a second dispatcher that listens to nothing. tracing-core decides whether a
/// callsite is of interest to anyone over every live dispatcher, except when only one is live:
/// then it asks the default of whichever thread registers the callsite first. A callsite first
/// reached by another test's thread, which has no subscriber, would be cached as of interest to
/// no one, and this thread's subscriber would never see it (a span test found zero spans). With
/// two live, the decision is always made over both.
pub(crate) struct ThreadDefault {
    _default: DefaultGuard,
    _second: Dispatch,
}

impl ThreadDefault {
    pub(crate) fn set(subscriber: impl Into<Dispatch>) -> Self {
        let second = Dispatch::new(tracing::subscriber::NoSubscriber::default());
        Self {
            _default: tracing::dispatcher::set_default(&subscriber.into()),
            _second: second,
        }
    }
}
