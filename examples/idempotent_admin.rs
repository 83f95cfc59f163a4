//! The operators' tool (DESIGN.md §5 "Admin"): inspect or forget one idempotency record in a
//! PostgreSQL or SQLite store, given the identity the application publishes for the caller and
//! the key — "did key K run for tenant T?", "clear a stuck key".
//!
//! ```text
//! cargo run --example idempotent_admin -- --store postgres --database-url postgres://app@db/app \
//!     --tenant acme --subject alice --key order-17 inspect [--body]
//! cargo run --example idempotent_admin -- --store sqlite --database-url idempotency.db \
//!     --api-key key-9 --key order-17 forget
//! ```
//!
//! The caller is `--tenant`/`--subject`, `--api-key ID`, `--client ID` (OAuth), `--peer IP`
//! (anonymous callers), or a raw `--scope-hash HEX`; `--route PATTERN` narrows to one route.
//! `--schema` and `--table` name the store's table as the application configured it.
//! `inspect` prints the record as JSON. Exit status: 0 found (or forgotten), 1 no such record,
//! 2 a usage error, 3 the store failed.

use std::net::IpAddr;
use std::process::ExitCode;

use idempotent_examples::admin;
use idempotent_runtime::Idempotency;
use idempotent_runtime::scope::{ClientId, Identity, Scope, ScopeHash};
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::store::sqlite::SqliteStore;

const USAGE: &str = "usage: idempotent_admin --store postgres|sqlite --database-url URL \
[--schema S] [--table T] (--tenant T --subject S | --api-key ID | --client ID | --peer IP | \
--scope-hash HEX) [--tenant T] [--route PATTERN] --key KEY (inspect [--body] | forget)";

#[derive(Default)]
struct Args {
    store: String,
    url: Option<String>,
    schema: Option<String>,
    table: Option<String>,
    identity: Identity,
    peer: Option<IpAddr>,
    scope_hash: Option<ScopeHash>,
    route: Option<String>,
    key: Option<String>,
    command: Option<String>,
    body: bool,
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args::default();
    while let Some(arg) = argv.next() {
        let mut value = || argv.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--store" => a.store = value()?,
            "--database-url" => a.url = Some(value()?),
            "--schema" => a.schema = Some(value()?),
            "--table" => a.table = Some(value()?),
            "--tenant" => a.identity.tenant = Some(value()?),
            "--subject" => a.identity.subject = Some(value()?),
            "--api-key" => a.identity.client = Some(ClientId::ApiKey(value()?)),
            "--client" => a.identity.client = Some(ClientId::OAuth(value()?)),
            "--peer" => a.peer = Some(value()?.parse().map_err(|_| "--peer: not an IP")?),
            "--scope-hash" => {
                a.scope_hash =
                    Some(admin::parse_scope_hash(&value()?).ok_or("--scope-hash: 64 hex digits")?)
            }
            "--route" => a.route = Some(value()?),
            "--key" => a.key = Some(value()?),
            "--body" => a.body = true,
            "inspect" | "forget" => a.command = Some(arg),
            _ => return Err(format!("unknown argument {arg}")),
        }
    }
    Ok(a)
}

async fn open(a: &Args) -> Result<Idempotency, String> {
    let url = a.url.clone().or_else(|| std::env::var("DATABASE_URL").ok());
    let url = url.ok_or("--database-url (or DATABASE_URL) is required")?;
    let fail = |e: idempotent_runtime::store::ConnectError| format!("cannot open the store: {e}");
    // No sweeper: this tool only reads or deletes one record.
    let handle = match a.store.as_str() {
        "postgres" => {
            let mut builder = PostgresStore::builder().application_name("idempotent_admin");
            if let Some(schema) = &a.schema {
                builder = builder.schema(schema);
            }
            if let Some(table) = &a.table {
                builder = builder.table(table);
            }
            Idempotency::builder(builder.connect(&url).await.map_err(fail)?)
        }
        "sqlite" => {
            let mut builder = SqliteStore::builder();
            if let Some(table) = &a.table {
                builder = builder.table(table);
            }
            let path = url
                .strip_prefix("sqlite://")
                .or_else(|| url.strip_prefix("sqlite:"));
            let path = path.unwrap_or(&url).split('?').next().unwrap_or_default();
            Idempotency::builder(builder.open(path).await.map_err(fail)?)
        }
        other => return Err(format!("--store {other:?}: postgres or sqlite")),
    };
    Ok(handle.sweeper(false).build())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let (Some(key), Some(command)) = (args.key.clone(), args.command.clone()) else {
        eprintln!("--key and a command are required\n{USAGE}");
        return ExitCode::from(2);
    };
    let scope = match args.scope_hash {
        Some(hash) => hash,
        // The library's own derivation, as the pipeline scopes a caller with this identity.
        None => match Scope::from_identity(&args.identity, args.peer) {
            Ok(scope) => *scope.hash(),
            Err(_) => {
                eprintln!(
                    "no caller: give --subject, --api-key, --client, --peer or --scope-hash\n{USAGE}"
                );
                return ExitCode::from(2);
            }
        },
    };
    let idempotency = match open(&args).await {
        Ok(handle) => handle,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(if e.starts_with("cannot") { 3 } else { 2 });
        }
    };
    let route = args.route.as_deref();
    let result = match command.as_str() {
        "inspect" => idempotency
            .inspect(&scope, route, &key, args.body)
            .await
            .map(|info| {
                info.map(|info| println!("{}", admin::record_json(&info)))
                    .is_some()
            }),
        _ => idempotency
            .forget(&scope, route, &key)
            .await
            .inspect(|&forgotten| {
                if forgotten {
                    println!("forgotten");
                }
            }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("no record of that key for that caller");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
    }
}
