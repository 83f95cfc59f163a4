//! The gRPC conformance server on tonic (../shared/CONFORMANCE.md, "The gRPC conformance
//! server"): the `conformance.v1.Conformance` service of `examples/proto/conformance.proto`,
//! its unary methods behind `idempotent_runtime::tonic::IdempotencyLayer`, the streaming
//! `Watch` left out, for black-box checkers.
//!
//! ```text
//! cargo run --release --example conformance_grpc -- --addr 127.0.0.1:0
//! ```
//!
//! It takes the HTTP conformance servers' options (`--store`, `--database-url`, `--lease`, …)
//! and prints `listening on http://HOST:PORT` (HTTP/2 without TLS) once it serves.

use std::io::Write as _;

use idempotent_examples::conformance::{Options, RunLog, init_logging, shutdown_signal};
use idempotent_examples::grpc::{AuthLayer, Conformance};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_logging();
    let options = match Options::from_env() {
        Ok(options) => options,
        Err(usage) => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let idempotency = options.idempotency().await?;
    let service = Conformance::new(RunLog::from_env());
    let listener = tokio::net::TcpListener::bind(options.addr).await?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    drop(stdout);
    // Without TCP_NODELAY a small answer waits for the client's delayed ACK (~40 ms).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    Server::builder()
        // Outside the idempotency layer, so the identity it publishes is there for the scope.
        .layer(AuthLayer)
        .layer(Conformance::idempotency_layer(idempotency.clone()))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown_signal())
        .await?;
    idempotency.shutdown().await;
    Ok(())
}
