//! The orders service of `orders_axum`, on actix-web: switching framework is a cargo feature
//! (`features = ["actix"]`) and an import.
//!
//! ```text
//! cargo run --example orders_actix
//! ```
//!
//! In memory by default, on PostgreSQL when `DATABASE_URL` is set. It prints where it listens
//! and a `curl` to paste twice: `201 Created`, then the same answer with
//! `Idempotency-Replayed: true`. `ORDERS_ADDR` (default `127.0.0.1:3000`) sets the address.

use std::io::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{self, Next};
use actix_web::{App, HttpMessage, HttpResponse, HttpServer, Responder, get, post, web};
use idempotent_runtime::actix::idempotent;
use idempotent_runtime::{Idempotency, scope::Identity};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct Orders {
    list: Mutex<Vec<Order>>,
    next_id: AtomicU64,
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: u32,
}

#[derive(Clone, Serialize)]
struct Order {
    id: u64,
    sku: String,
    quantity: u32,
}

/// Runs once per `Idempotency-Key`; retries get the recorded answer.
#[idempotent(require_key)]
#[post("/orders")]
async fn create_order(orders: web::Data<Orders>, new: web::Json<NewOrder>) -> HttpResponse {
    if new.quantity == 0 {
        return HttpResponse::UnprocessableEntity().body("quantity must be positive");
    }
    let order = Order {
        id: orders.next_id.fetch_add(1, Ordering::Relaxed) + 1,
        sku: new.sku.clone(),
        quantity: new.quantity,
    };
    orders.list.lock().expect("orders lock").push(order.clone());
    HttpResponse::Created()
        .insert_header(("location", format!("/orders/{}", order.id)))
        .json(order)
}

#[get("/orders")]
async fn list_orders(orders: web::Data<Orders>) -> impl Responder {
    web::Json(orders.list.lock().expect("orders lock").clone())
}

/// A stand-in for real authentication: `Authorization: Bearer <user>` is user `<user>` of tenant
/// `demo`; anonymous callers are scoped by their IP address.
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let bearer = request
        .headers()
        .get("authorization")
        .map(|v| v.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")));
    match bearer {
        None => {}
        Some(Some(user)) if !user.is_empty() => {
            let identity = Identity::subject("demo", user);
            request.extensions_mut().insert(identity);
        }
        Some(_) => {
            return Err(actix_web::error::ErrorUnauthorized(
                "expected: Bearer <user>",
            ));
        }
    }
    next.call(request).await
}

async fn idempotency_store() -> Result<Idempotency, Box<dyn std::error::Error>> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres") => {
            let store = idempotent_runtime::store::postgres::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            eprintln!("idempotency store: PostgreSQL");
            Ok(Idempotency::new(store))
        }
        _ => {
            eprintln!(
                "idempotency store: in memory (set DATABASE_URL=postgres://… for PostgreSQL)"
            );
            Ok(Idempotency::memory())
        }
    }
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let idempotency = web::Data::new(idempotency_store().await?);
    let orders = web::Data::new(Orders::default());
    let app_store = idempotency.clone();
    let server = HttpServer::new(move || {
        App::new()
            .app_data(app_store.clone())
            .app_data(orders.clone())
            .wrap(middleware::from_fn(authenticate))
            .service(create_order)
            .service(list_orders)
    })
    .bind(&addr)
    .map_err(|e| format!("cannot listen on {addr}: {e} (set ORDERS_ADDR=127.0.0.1:0)"))?;
    let url = format!("http://{}", server.addrs()[0]);
    println!("listening on {url}");
    println!("send this twice; the second answer is the replay (Idempotency-Replayed: true):");
    println!(
        "curl -si -X POST {url}/orders -H 'Idempotency-Key: order-1' \
         -H 'Content-Type: application/json' -d '{{\"sku\":\"A1\",\"quantity\":2}}'"
    );
    println!("then list the orders (one, not two): curl -s {url}/orders");
    std::io::stdout().flush()?;
    server.run().await?;
    // Claimed handlers run to completion even after the server stops accepting.
    idempotency.shutdown().await;
    Ok(())
}
