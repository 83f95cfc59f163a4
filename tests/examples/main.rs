//! The examples do what they claim: the README's quick start followed literally, the orders
//! service's envelope and metrics, the payments service, the NATS consumer end to end, the
//! NATS charges consumer that runs a plain function once per message id, and the outbox end to
//! end through crashes on NATS JetStream and (feature `rabbitmq`) RabbitMQ.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test examples [quickstart::|orders_axum::|payments::|consumer_nats::|charges_once::|outbox_orders::]
//! ```

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "redis")]
mod charges_once;
#[cfg(feature = "postgres")]
mod consumer_nats;
#[cfg(all(feature = "axum", feature = "postgres"))]
mod orders_axum;
#[cfg(all(feature = "axum", feature = "postgres", feature = "nats"))]
mod outbox_orders;
#[cfg(all(feature = "axum", feature = "postgres"))]
mod payments;
mod quickstart;
