//! One HTTP load server per variant, all serving the same handler on `POST /orders`:
//!
//! ```text
//! bench_server <variant> [--addr 127.0.0.1:0] [--database-url URL] [--sqlite PATH]
//!              [--redis-url URL] [--mysql-url URL] [--workers N] [--pg-connections N]
//! ```
//!
//! Variants: `axum-bare`, `axum-memory`, `axum-memory-steady` (a 2 s retention, sweeper on, so
//! the store stops growing), `axum-memory-nosweep` (the same retention, sweeper off),
//! `axum-postgres`, `axum-postgres-cached` (the same store behind `CachedStore`), `axum-sqlite`,
//! `axum-redis`, `axum-mysql` (MySQL/MariaDB, its pool the PostgreSQL variants' size), `actix-bare`, `actix-memory` (ours), `peer-cratestack` (cratestack-axum +
//! cratestack-sqlx on PostgreSQL, its pool set like ours), `peer-cratestack-default-pool` (the
//! same on sqlx's default pool), `peer-axum-idempotent` (axum-idempotent on a moka memory
//! store). It prints `listening on ADDR` once bound and serves until killed
//! (`bench_server print-body` prints the 1 KiB request body instead). Both frameworks run
//! `--workers` workers (default two, one a core); both PostgreSQL stores, ours and the peer's,
//! get a pool of `--pg-connections` (default 10).

use std::net::SocketAddr;

use idempotent_benchmarks as bench;

const WORKERS: usize = 2;
/// The pool size of both PostgreSQL variants (ours and the peer's).
const PG_CONNECTIONS: u32 = 10;
/// The retention of the steady-state memory variants: short enough that, at tens of thousands
/// of requests a second, the sweeper frees records as fast as they arrive.
const STEADY_RETENTION: std::time::Duration = std::time::Duration::from_secs(2);

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
    let mut mysql_url = "mysql://root@127.0.0.1:3306/idempotent_bench".to_owned();
    let mut workers = WORKERS;
    let mut pg_connections = PG_CONNECTIONS;
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage("a flag needs a value"));
        match flag.as_str() {
            "--addr" => addr = value.parse().unwrap_or_else(|_| usage("bad --addr")),
            "--database-url" => database_url = value,
            "--sqlite" => sqlite = value,
            "--redis-url" => redis_url = value,
            "--mysql-url" => mysql_url = value,
            "--workers" => {
                workers = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| usage("bad --workers"))
            }
            "--pg-connections" => {
                pg_connections = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| usage("bad --pg-connections"))
            }
            _ => usage("unknown flag"),
        }
    }
    if variant.starts_with("actix-") {
        return actix(&variant, addr, workers);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let router = match variant.as_str() {
            "axum-bare" => bench::bare_router(),
            "axum-memory" => bench::idempotent_router(bench::unbounded_memory_store()),
            "axum-memory-steady" => {
                bench::idempotent_router(bench::steady_memory_store(STEADY_RETENTION, true))
            }
            "axum-memory-nosweep" => {
                bench::idempotent_router(bench::steady_memory_store(STEADY_RETENTION, false))
            }
            "axum-postgres" => bench::idempotent_router(
                bench::postgres_store(&database_url, pg_connections, false).await,
            ),
            "axum-postgres-cached" => bench::idempotent_router(
                bench::postgres_store(&database_url, pg_connections, true).await,
            ),
            "axum-sqlite" => bench::idempotent_router(bench::sqlite_store(&sqlite).await),
            "axum-redis" => bench::idempotent_router(bench::redis_store(&redis_url).await),
            "axum-mysql" => {
                bench::idempotent_router(bench::mysql_store(&mysql_url, pg_connections).await)
            }
            "peer-cratestack" => {
                bench::cratestack_router(&database_url, pg_connections, false).await
            }
            "peer-cratestack-default-pool" => {
                bench::cratestack_router(&database_url, pg_connections, true).await
            }
            "peer-axum-idempotent" => bench::axum_idempotent_router(),
            _ => usage("unknown variant"),
        };
        bench::serve_axum(router, addr).await;
    });
}

fn actix(variant: &str, addr: SocketAddr, workers: usize) {
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
        .workers(workers)
        .bind(addr)
        .expect("bind");
        println!("listening on {}", server.addrs()[0]);
        server.run().await.expect("serve");
    });
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "{problem}\nusage: bench_server <axum-bare|axum-memory|axum-memory-steady|\
         axum-memory-nosweep|axum-postgres|axum-postgres-cached|axum-sqlite|axum-redis|\
         actix-bare|actix-memory|peer-cratestack|peer-cratestack-default-pool|\
         peer-axum-idempotent> [--addr A] [--database-url URL] [--sqlite PATH] \
         [--redis-url URL] [--workers N] [--pg-connections N]"
    );
    std::process::exit(2)
}
