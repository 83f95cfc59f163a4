use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use futures_util::stream::{self, Stream};
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn events() -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    Sse::new(stream::empty())
}

fn main() {}
