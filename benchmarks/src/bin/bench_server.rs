//! One HTTP load server per variant, all serving the same handler on `POST /orders`:
//!
//! ```text
//! bench_server <variant> [--addr 127.0.0.1:0] [--database-url URL] [--sqlite PATH]
//! ```
//!
//! Variants: `axum-bare`, `axum-memory`, `axum-postgres`, `axum-sqlite`, `axum-redis`, `actix-bare`,
//! `actix-memory` (ours), `peer-cratestack` (cratestack-axum + cratestack-sqlx on PostgreSQL,
//! its pool set like ours), `peer-cratestack-default-pool` (the same on sqlx's default pool),
//! `peer-axum-idempotent` (axum-idempotent on a moka memory store). It prints
//! `listening on ADDR` once bound and serves until killed (`bench_server print-body` prints the
//! 1 KiB request body instead). Both frameworks run two workers,
//! one a core.

use std::net::SocketAddr;

use idempotent_benchmarks as bench;

const WORKERS: usize = 2;
/// The pool size of both PostgreSQL variants (ours and the peer's).
const PG_CONNECTIONS: u32 = 10;

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| usage("no variant"));
    if variant == "print-body" {
        use std::io::Write as _;
        std::io::stdout()
            .write_all(&bench::order_body())
            .expect("stdout");
        return;
    }
    let mut addr: SocketAddr = "127.0.0.1:0".parse().expect("address");
    let mut database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/idempotent_bench".into());
    let mut sqlite = "target/bench-sqlite.db".to_owned();
    let mut redis_url = "redis://127.0.0.1:6379/0".to_owned();
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage("a flag needs a value"));
        match flag.as_str() {
            "--addr" => addr = value.parse().unwrap_or_else(|_| usage("bad --addr")),
            "--database-url" => database_url = value,
            "--sqlite" => sqlite = value,
            "--redis-url" => redis_url = value,
            _ => usage("unknown flag"),
        }
    }
    if variant.starts_with("actix-") {
        return actix(&variant, addr);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let router = match variant.as_str() {
            "axum-bare" => bench::bare_router(),
            "axum-memory" => bench::idempotent_router(bench::unbounded_memory_store()),
            "axum-postgres" => {
                bench::idempotent_router(bench::postgres_store(&database_url, PG_CONNECTIONS).await)
            }
            "axum-sqlite" => bench::idempotent_router(bench::sqlite_store(&sqlite).await),
            "axum-redis" => bench::idempotent_router(bench::redis_store(&redis_url).await),
            "peer-cratestack" => {
                bench::cratestack_router(&database_url, PG_CONNECTIONS, false).await
            }
            "peer-cratestack-default-pool" => {
                bench::cratestack_router(&database_url, PG_CONNECTIONS, true).await
            }
            "peer-axum-idempotent" => bench::axum_idempotent_router(),
            _ => usage("unknown variant"),
        };
        bench::serve_axum(router, addr).await;
    });
}

fn actix(variant: &str, addr: SocketAddr) {
    use actix_web::{App, HttpServer, web};
    let memory = variant == "actix-memory";
    if !memory && variant != "actix-bare" {
        usage("unknown variant");
    }
    actix_web::rt::System::new().block_on(async move {
        let store = web::Data::new(bench::unbounded_memory_store());
        let server = HttpServer::new(move || {
            let app = App::new().app_data(store.clone());
            if memory {
                app.route(
                    bench::ROUTE,
                    web::post().to(bench::actix_create_order_idempotent),
                )
            } else {
                app.route(bench::ROUTE, web::post().to(bench::actix_create_order))
            }
        })
        .workers(WORKERS)
        .bind(addr)
        .expect("bind");
        println!("listening on {}", server.addrs()[0]);
        server.run().await.expect("serve");
    });
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "{problem}\nusage: bench_server <axum-bare|axum-memory|axum-postgres|axum-sqlite|axum-redis|\
         actix-bare|actix-memory|peer-cratestack|peer-cratestack-default-pool|\
         peer-axum-idempotent> [--addr A] \
         [--database-url URL] [--sqlite PATH] [--redis-url URL]"
    );
    std::process::exit(2)
}
