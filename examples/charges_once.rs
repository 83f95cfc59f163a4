//! A NATS core consumer that charges once per message id on the Redis store: no database, no
//! inbox table, just `Once::new` (DESIGN.md §6, "Plain functions").
//!
//! NATS core delivers at most once per subscriber, but producers retry a request whose reply
//! they did not see, and two copies may reach two consumers of one queue group at the same
//! time. Each message names its charge id; the charge runs once per id, whichever consumer
//! gets it and however often, and every copy is answered with the first one's receipt. The
//! same id with another customer or amount is refused.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/0 NATS_URL=127.0.0.1:4222 \
//!     cargo run --all-features --example charges_once
//! ```
//!
//! Without `REDIS_URL` it runs on the memory store (one process). The broker test
//! (tests/examples/charges_once.rs) runs this code with two consumers sharing one Redis.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use idempotent_runtime::Idempotency;
use idempotent_runtime::once::{Once, OnceError};
use idempotent_runtime::scope::{ClientId, Identity, Scope};
use serde::{Deserialize, Serialize};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The message: charge `amount` to `customer`, once per `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    /// The producer's id for this charge: the key.
    pub id: String,
    /// Who pays.
    pub customer: String,
    /// How much, in cents.
    pub amount: u64,
}

/// What the provider answered for a charge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    /// The provider's receipt number.
    pub receipt: String,
    /// The amount charged.
    pub amount: u64,
}

/// The consumer's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Reply {
    /// Charged (now, or by an earlier copy of this message).
    Charged(Receipt),
    /// Another copy is still being charged: ask again later.
    InProgress {
        /// Seconds to wait.
        retry_after_secs: u64,
    },
    /// Not a charge, or this id was used for another charge.
    Rejected {
        /// Why.
        reason: String,
    },
}

/// The payment provider, standing in for a real one: it keeps every charge it really made.
#[derive(Debug, Default, Clone)]
pub struct Provider(Arc<Mutex<Vec<Charge>>>);

impl Provider {
    /// Charges, after the provider's latency.
    pub async fn charge(&self, charge: &Charge) -> Result<Receipt, std::io::Error> {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut made = self.0.lock().unwrap_or_else(|p| p.into_inner());
        made.push(charge.clone());
        Ok(Receipt {
            receipt: format!("rc_{}", made.len()),
            amount: charge.amount,
        })
    }

    /// Every charge really made.
    pub fn made(&self) -> Vec<Charge> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The consumer's own identity: its charge ids never meet another caller's keys.
pub fn scope() -> Scope {
    let consumer = Identity::client(ClientId::OAuth("charges-consumer".to_owned()));
    Scope::from_identity(&consumer, None).expect("a client id is a scope")
}

/// Handles one message: the charge runs once per id, whoever delivers it and however often.
pub async fn handle(idempotency: &Idempotency, provider: &Provider, payload: &[u8]) -> Reply {
    let charge: Charge = match serde_json::from_slice(payload) {
        Ok(charge) => charge,
        Err(error) => {
            return Reply::Rejected {
                reason: format!("not a charge: {error}"),
            };
        }
    };
    // What makes two copies the same charge: the customer and the amount.
    let input = (&charge.customer, charge.amount);
    let charged = Once::new(idempotency, &scope(), &charge.id)
        .name("charge")
        .wait(Duration::from_secs(5))
        .run(&input, || provider.charge(&charge))
        .await;
    match charged {
        Ok(receipt) => Reply::Charged(receipt),
        Err(OnceError::InProgress { retry_after }) => Reply::InProgress {
            retry_after_secs: retry_after.as_secs(),
        },
        Err(OnceError::InputChanged) => Reply::Rejected {
            reason: "this charge id was used for another charge".to_owned(),
        },
        Err(other) => Reply::Rejected {
            reason: other.to_string(),
        },
    }
}

/// Serves `subject` in the queue group `chargers` until the subscription ends, answering each
/// request with its [`Reply`].
pub async fn serve(
    client: async_nats::Client,
    subject: String,
    idempotency: Idempotency,
    provider: Provider,
) -> Result<(), Error> {
    let mut messages = client
        .queue_subscribe(subject, "chargers".to_owned())
        .await?;
    while let Some(message) = messages.next().await {
        let (client, idempotency, provider) =
            (client.clone(), idempotency.clone(), provider.clone());
        tokio::spawn(async move {
            let reply = handle(&idempotency, &provider, &message.payload).await;
            let Some(to) = message.reply else { return };
            match serde_json::to_vec(&reply) {
                Ok(body) => {
                    if let Err(error) = client.publish(to, body.into()).await {
                        tracing::warn!(%error, "reply not sent");
                    }
                }
                Err(error) => tracing::warn!(%error, "reply not encoded"),
            }
        });
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&nats_url).await?;
    let idempotency = match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = idempotent_runtime::store::redis::RedisStore::connect(&url).await?;
            Idempotency::builder(store).build()
        }
        Err(_) => {
            eprintln!("REDIS_URL is not set: the memory store protects this process only");
            Idempotency::memory()
        }
    };
    let provider = Provider::default();
    let subject = "idempotent.charges.example".to_owned();
    let consumer = tokio::spawn(serve(
        client.clone(),
        subject.clone(),
        idempotency.clone(),
        provider.clone(),
    ));
    client.flush().await?;

    // A producer that retries: the same charge five times, all at once.
    let nonce = idempotent_runtime::store::FencingToken::mint().0;
    let charge = Charge {
        id: format!("charge-{nonce:016x}"),
        customer: "acme".to_owned(),
        amount: 1200,
    };
    let body = serde_json::to_vec(&charge)?;
    let requests = (0..5).map(|_| client.request(subject.clone(), body.clone().into()));
    for reply in futures_util::future::join_all(requests).await {
        println!("{}", String::from_utf8_lossy(&reply?.payload));
    }
    println!("charges really made: {}", provider.made().len());
    consumer.abort();
    Ok(())
}
