//! In-process behaviour of the actix integration: what the black-box conformance suite cannot
//! set up (no peer address, no store, nested middlewares, settings per endpoint).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use actix_web::body::to_bytes;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::Method;
use actix_web::{App, HttpMessage, HttpResponse, test, web};
use bytes::Bytes;
use serde_json::{Value, json};

use super::{IdempotencyMiddleware, idempotent};
use crate::scope::Identity;
use crate::{Idempotency, IdempotencyContext};

#[derive(Default)]
struct Runs(AtomicUsize);

impl Runs {
    fn next(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A memory-store handle with strict mode on or off (its default follows the build).
fn strict(on: bool) -> Idempotency {
    let config = crate::config::Config::builder().strict(on).build();
    Idempotency::builder(crate::store::memory::MemoryStore::default())
        .config(config)
        .build()
}

fn peer() -> SocketAddr {
    ([127, 0, 0, 1], 40_000).into()
}

fn post(uri: &str, key: Option<&str>) -> test::TestRequest {
    let req = test::TestRequest::post().uri(uri).peer_addr(peer());
    match key {
        Some(key) => req.insert_header(("idempotency-key", key)),
        None => req,
    }
}

async fn parts<B: actix_web::body::MessageBody>(res: ServiceResponse<B>) -> (u16, bool, Bytes) {
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotency-replayed").is_some();
    let body = to_bytes(res.into_body()).await.unwrap_or_default();
    (status, replayed, body)
}

fn code(body: &Bytes) -> String {
    let doc: Value = serde_json::from_slice(body).unwrap_or_default();
    doc["code"].as_str().unwrap_or_default().to_owned()
}

async fn counted(runs: web::Data<Runs>) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Created().json(json!({ "execution": n }))
}

#[idempotent(crate = crate, require_key)]
async fn attributed(runs: web::Data<Runs>) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Created().json(json!({ "execution": n }))
}

#[actix_web::test]
async fn middleware_passes_other_methods_and_unmatched_routes_through() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .service(
                web::scope("/api")
                    .wrap(
                        IdempotencyMiddleware::new()
                            .endpoint(crate::config::EndpointConfig::REQUIRED),
                    )
                    .route("/x", web::post().to(counted))
                    .route("/x", web::get().to(counted))
                    .default_service(web::to(HttpResponse::NotFound)),
            ),
    )
    .await;
    let get = test::TestRequest::get().uri("/api/x").peer_addr(peer());
    assert_eq!(
        parts(test::call_service(&app, get.to_request()).await)
            .await
            .0,
        201
    );
    let unmatched = post("/api/nowhere", None).to_request();
    assert_eq!(
        parts(test::call_service(&app, unmatched).await).await.0,
        404
    );
    let keyless = post("/api/x", None).to_request();
    let (status, _, body) = parts(test::call_service(&app, keyless).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    assert_eq!(runs.get(), 1, "only the GET ran");
}

#[actix_web::test]
async fn middleware_applies_to_the_methods_it_is_given() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .service(
                web::resource("/x")
                    .wrap(IdempotencyMiddleware::new().endpoint(
                        crate::config::EndpointConfig::new().methods(crate::config::Methods::PUT),
                    ))
                    .route(web::put().to(counted))
                    .route(web::post().to(counted)),
            ),
    )
    .await;
    for method in [Method::PUT, Method::PUT, Method::POST, Method::POST] {
        let req = post("/x", Some("k")).method(method).to_request();
        test::call_service(&app, req).await;
    }
    assert_eq!(runs.get(), 3, "PUT replayed once; POST is not handled");
}

#[actix_web::test]
async fn attribute_steps_aside_under_the_middleware() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(strict(false)))
            .app_data(runs.clone())
            .service(
                web::resource("/x")
                    .wrap(IdempotencyMiddleware::new())
                    .route(web::post().to(attributed)),
            ),
    )
    .await;
    // The middleware's key is optional and it decides, but the attribute still refuses a
    // request without a key rather than pass it silently.
    let keyless = parts(test::call_service(&app, post("/x", None).to_request()).await).await;
    assert_eq!(
        (keyless.0, code(&keyless.2).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    let first = parts(test::call_service(&app, post("/x", Some("k")).to_request()).await).await;
    let again = parts(test::call_service(&app, post("/x", Some("k")).to_request()).await).await;
    assert_eq!((first.0, first.1), (201, false));
    assert_eq!((again.0, again.1), (201, true));
    assert_eq!(again.2, first.2);
    assert_eq!(
        runs.get(),
        1,
        "the keyless request never ran; the keyed one ran once"
    );
}

#[actix_web::test]
async fn nested_middlewares_let_the_outer_one_decide() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .wrap(IdempotencyMiddleware::new())
            .service(
                web::scope("/api")
                    .wrap(
                        IdempotencyMiddleware::new()
                            .endpoint(crate::config::EndpointConfig::REQUIRED),
                    )
                    .route("/x", web::post().to(counted)),
            ),
    )
    .await;
    let keyless = parts(test::call_service(&app, post("/api/x", None).to_request()).await).await;
    assert_eq!(keyless.0, 201);
    for _ in 0..2 {
        test::call_service(&app, post("/api/x", Some("k")).to_request()).await;
    }
    assert_eq!(
        runs.get(),
        2,
        "one keyless run, one keyed run and its replay"
    );
}

#[actix_web::test]
async fn missing_store_is_a_500_that_runs_nothing() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(runs.clone())
            .route("/x", web::post().to(attributed)),
    )
    .await;
    let res = test::call_service(&app, post("/x", Some("k")).to_request()).await;
    assert_eq!(res.status().as_u16(), 500);
    assert_eq!(runs.get(), 0);
}

#[actix_web::test]
async fn anonymous_request_without_peer_address_is_scope_unresolved() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .route("/x", web::post().to(attributed)),
    )
    .await;
    let req = test::TestRequest::post()
        .uri("/x")
        .insert_header(("idempotency-key", "k"))
        .to_request();
    let (status, _, body) = parts(test::call_service(&app, req).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (500, "IDEMPOTENCY_SCOPE_UNRESOLVED")
    );
    let with_auth = post("/x", Some("k"))
        .insert_header(("authorization", "Bearer t:u"))
        .to_request();
    let (status, _, body) = parts(test::call_service(&app, with_auth).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (500, "IDEMPOTENCY_SCOPE_UNRESOLVED")
    );
    assert_eq!(runs.get(), 0);
}

#[idempotent(crate = crate, require_key)]
async fn with_context(context: IdempotencyContext, runs: web::Data<Runs>) -> HttpResponse {
    runs.next();
    HttpResponse::Ok().body(context.derived_key("charge"))
}

#[idempotent(crate = crate)]
async fn with_optional_context(context: Option<IdempotencyContext>) -> HttpResponse {
    HttpResponse::Ok().body(if context.is_some() {
        "keyed"
    } else {
        "keyless"
    })
}

#[actix_web::test]
async fn context_carries_a_derived_key_scoped_to_the_caller() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .wrap_fn(|req, srv| {
                let subject = req
                    .headers()
                    .get("x-user")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                if let Some(subject) = subject {
                    req.extensions_mut()
                        .insert(Identity::subject("acme", subject));
                }
                srv.call(req)
            })
            .route("/pay", web::post().to(with_context))
            .route("/note", web::post().to(with_optional_context)),
    )
    .await;
    let as_user =
        |user: &str| post("/pay", Some("same-key")).insert_header(("x-user", user.to_owned()));
    let alice = parts(test::call_service(&app, as_user("alice").to_request()).await).await;
    let bob = parts(test::call_service(&app, as_user("bob").to_request()).await).await;
    let alice_again = parts(test::call_service(&app, as_user("alice").to_request()).await).await;
    assert_eq!(alice.2.len(), 64);
    assert_ne!(alice.2, bob.2, "two callers' derived keys must differ");
    assert!(alice_again.1);
    assert_eq!(alice_again.2, alice.2);
    assert_eq!(runs.get(), 2, "one run per caller");

    let keyless = parts(test::call_service(&app, post("/note", None).to_request()).await).await;
    let keyed = parts(test::call_service(&app, post("/note", Some("n")).to_request()).await).await;
    assert_eq!(
        (&keyless.2[..], &keyed.2[..]),
        (&b"keyless"[..], &b"keyed"[..])
    );
}

#[idempotent(crate = crate, require_key, max_body = "8B", max_response = "16B")]
async fn small(runs: web::Data<Runs>, body: web::Bytes) -> HttpResponse {
    runs.next();
    let len = body.len() * 10;
    let chunks = (0..len).map(|_| Ok::<_, std::convert::Infallible>(Bytes::from_static(b"a")));
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

#[actix_web::test]
async fn endpoint_caps_apply_to_request_and_response() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .route("/small", web::post().to(small)),
    )
    .await;
    let big = post("/small", Some("k1"))
        .set_payload("123456789")
        .to_request();
    let (status, _, body) = parts(test::call_service(&app, big).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE")
    );
    assert_eq!(runs.get(), 0);

    // 1 byte in, 10 out: recorded. 2 bytes in, 20 out: past the cap, sent whole, not recorded.
    for _ in 0..2 {
        let req = post("/small", Some("k2")).set_payload("1").to_request();
        assert_eq!(parts(test::call_service(&app, req).await).await.2.len(), 10);
    }
    assert_eq!(runs.get(), 1);
    for _ in 0..2 {
        let req = post("/small", Some("k3")).set_payload("12").to_request();
        let (status, replayed, body) = parts(test::call_service(&app, req).await).await;
        assert_eq!((status, replayed, body.len()), (200, false, 20));
    }
    assert_eq!(runs.get(), 3);
}

#[actix_web::test]
async fn running_handlers_are_tracked_for_shutdown() {
    let store = Idempotency::memory();
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let app = {
        let (started, release) = (Arc::clone(&started), Arc::clone(&release));
        test::init_service(
            App::new().app_data(web::Data::new(store.clone())).service(
                web::resource("/wait")
                    .wrap(IdempotencyMiddleware::new())
                    .route(web::post().to(move || {
                        let (started, release) = (Arc::clone(&started), Arc::clone(&release));
                        async move {
                            started.notify_one();
                            release.notified().await;
                            HttpResponse::Ok().finish()
                        }
                    })),
            ),
        )
        .await
    };
    let call = app.call(post("/wait", Some("k")).to_request());
    let observe = async {
        started.notified().await;
        let running = store.running();
        release.notify_one();
        running
    };
    let (res, running_meanwhile) = tokio::join!(call, observe);
    assert_eq!(running_meanwhile, 1);
    assert_eq!(res.expect("response").status().as_u16(), 200);
    assert_eq!(store.running(), 0);
}

/// An authentication extractor: publishes the caller's identity, or rejects.
struct User;

impl actix_web::FromRequest for User {
    type Error = actix_web::Error;
    type Future = std::future::Ready<Result<Self, Self::Error>>;

    fn from_request(req: &actix_web::HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let user = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
            .map(str::to_owned);
        std::future::ready(match user {
            Some(user) => {
                req.extensions_mut().insert(Identity::subject("acme", user));
                Ok(User)
            }
            None => Err(actix_web::error::ErrorUnauthorized("who are you?")),
        })
    }
}

#[idempotent(crate = crate, require_key)]
async fn as_user(_user: User, runs: web::Data<Runs>, body: String) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Created().json(json!({ "execution": n, "body": body }))
}

#[actix_web::test]
async fn extractors_run_before_the_claim_and_on_replays() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .route("/pay", web::post().to(as_user)),
    )
    .await;
    let call = |user: Option<&str>| {
        let req = post("/pay", Some("k")).set_payload("x");
        match user {
            Some(user) => req.insert_header(("authorization", format!("Bearer {user}"))),
            None => req,
        }
        .to_request()
    };
    let alice = parts(test::call_service(&app, call(Some("alice"))).await).await;
    assert_eq!((alice.0, alice.1), (201, false));
    let again = parts(test::call_service(&app, call(Some("alice"))).await).await;
    assert_eq!((again.0, again.1), (201, true));
    assert_eq!(again.2, alice.2);
    let anonymous = parts(test::call_service(&app, call(None)).await).await;
    assert_eq!(
        (anonymous.0, anonymous.1),
        (401, false),
        "no replay without the extractor"
    );
    let bob = parts(test::call_service(&app, call(Some("bob"))).await).await;
    assert_eq!((bob.0, bob.1), (201, false));
    assert_eq!(runs.get(), 2);
}

// `test` here is actix-web's module; this test needs no runtime.
#[::core::prelude::v1::test]
fn middleware_can_be_built_outside_the_server_factory() {
    // HttpServer::new needs a Send factory: a middleware built once outside it moves in.
    fn send_sync_clone<T: Send + Sync + Clone + 'static>(_: &T) {}
    send_sync_clone(
        &IdempotencyMiddleware::new().endpoint(crate::config::EndpointConfig::REQUIRED),
    );
}

// Setups that would silently turn protection off are said once, with their fix (#19).

#[actix_web::test]
async fn a_store_built_per_worker_is_said_and_a_shared_store_replays_across_workers() {
    // Two App instances stand for two workers: a store built inside the factory is one each.
    let worker = |store: Idempotency, path: &'static str| {
        test::init_service(
            App::new()
                .app_data(web::Data::new(store))
                .app_data(web::Data::new(Runs::default()))
                .route(path, web::post().to(attributed)),
        )
    };
    let (logs, guard) = crate::testlog::Logs::capture();
    let split = "/misuse-workers";
    let a = worker(strict(false), split).await;
    let b = worker(strict(false), split).await;
    let first = test::call_service(&a, post(split, Some("k")).to_request()).await;
    assert_eq!(first.status(), 201);
    let second = test::call_service(&b, post(split, Some("k")).to_request()).await;
    assert!(
        !parts(second).await.1,
        "the other worker's store ran it again"
    );
    let errors = logs.errors();
    let fix = "outside the HttpServer::new factory";
    assert!(errors.iter().any(|e| e.contains(fix)), "{errors:?}");
    drop(guard);

    let (logs, _guard) = crate::testlog::Logs::capture();
    let shared = Idempotency::memory();
    let path = "/misuse-workers-shared";
    let (a, b) = (
        worker(shared.clone(), path).await,
        worker(shared, path).await,
    );
    let first = test::call_service(&a, post(path, Some("k")).to_request()).await;
    assert_eq!(first.status(), 201);
    let (_, replayed, _) =
        parts(test::call_service(&b, post(path, Some("k")).to_request()).await).await;
    assert!(replayed, "the shared store replays on the other worker");
    assert!(logs.errors().is_empty(), "{:?}", logs.errors());
}

#[actix_web::test]
async fn a_required_key_under_an_optional_middleware_is_still_required() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(strict(false)))
            .app_data(runs.clone())
            .service(
                web::scope("/opt")
                    .wrap(IdempotencyMiddleware::new())
                    .route("/x", web::post().to(attributed)),
            ),
    )
    .await;
    let (status, _, body) =
        parts(test::call_service(&app, post("/opt/x", None).to_request()).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    assert_eq!(runs.get(), 0);
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("make the layer require the key")),
        "{errors:?}"
    );
}

/// Strict mode: two App instances (two workers) with different memory stores on one route of
/// one server: the second store's first request on the route is refused, nothing claimed.
#[actix_web::test]
async fn strict_a_store_built_per_worker_is_refused_on_its_first_request() {
    let runs = web::Data::new(Runs::default());
    let worker = |store: Idempotency| {
        test::init_service(
            App::new()
                .app_data(web::Data::new(store))
                .app_data(runs.clone())
                .route("/strict-workers", web::post().to(attributed)),
        )
    };
    let (logs, _guard) = crate::testlog::Logs::capture();
    let a = worker(strict(true)).await;
    let b = worker(strict(true)).await;
    let first = post("/strict-workers", Some("k")).to_request();
    let (status, replayed, _) = parts(test::call_service(&a, first).await).await;
    assert_eq!((status, replayed), (201, false));
    for key in ["k", "other"] {
        let req = post("/strict-workers", Some(key)).to_request();
        let res = test::call_service(&b, req).await;
        assert_eq!(
            res.headers().get("content-type").unwrap(),
            "application/problem+json"
        );
        let (status, replayed, body) = parts(res).await;
        assert_eq!(
            (status, replayed, code(&body).as_str()),
            (500, false, "IDEMPOTENCY_MISCONFIGURED")
        );
    }
    assert_eq!(runs.get(), 1, "only the first store's request ran");
    let again = post("/strict-workers", Some("k")).to_request();
    let (status, replayed, _) = parts(test::call_service(&a, again).await).await;
    assert_eq!(
        (status, replayed),
        (201, true),
        "the first store still serves"
    );
    let errors = logs.errors();
    let fix = "outside the HttpServer::new factory";
    assert!(errors.iter().any(|e| e.contains(fix)), "{errors:?}");
}

/// Strict mode: a `require_key` attribute under a middleware whose key is optional is refused
/// on the first request, keyed or not.
#[actix_web::test]
async fn strict_a_required_key_under_an_optional_middleware_is_refused() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(strict(true)))
            .app_data(runs.clone())
            .service(
                web::scope("/strict-opt")
                    .wrap(IdempotencyMiddleware::new())
                    .route("/x", web::post().to(attributed)),
            ),
    )
    .await;
    for key in [Some("k"), None] {
        let req = post("/strict-opt/x", key).to_request();
        let (status, replayed, body) = parts(test::call_service(&app, req).await).await;
        assert_eq!(
            (status, replayed, code(&body).as_str()),
            (500, false, "IDEMPOTENCY_MISCONFIGURED"),
            "{key:?}"
        );
    }
    assert_eq!(runs.get(), 0);
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("make the layer require the key")),
        "{errors:?}"
    );
}

#[idempotent(crate = crate, require_key)]
async fn read(runs: web::Data<Runs>, body: String) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Ok().body(format!("run {n} {body}"))
}

/// GET, HEAD and OPTIONS are idempotent by HTTP semantics (DESIGN.md §8): a handler under
/// `#[idempotent(require_key)]` routed for them runs every time, keyed or not, and is never
/// replayed; POST to the same handler is still claimed.
#[actix_web::test]
async fn the_attribute_passes_get_head_and_options_through() {
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(Idempotency::memory()))
            .app_data(runs.clone())
            .route("/read", web::route().to(read)),
    )
    .await;
    let keyed = |method: Method, body: &'static str| {
        post("/read", Some("k"))
            .method(method)
            .set_payload(body)
            .to_request()
    };
    for (n, body) in [(1, "a"), (2, "a"), (3, "b")] {
        let res = test::call_service(&app, keyed(Method::GET, body)).await;
        let (status, replayed, text) = parts(res).await;
        assert_eq!((status, replayed), (200, false), "{text:?}");
        assert_eq!(text, format!("run {n} {body}"));
    }
    let (status, replayed, text) =
        parts(test::call_service(&app, keyed(Method::HEAD, "c")).await).await;
    assert_eq!((status, replayed), (200, false), "{text:?}");
    assert_eq!(text, "run 4 c");
    let (status, replayed, text) =
        parts(test::call_service(&app, keyed(Method::OPTIONS, "d")).await).await;
    assert_eq!((status, replayed), (200, false), "{text:?}");
    assert_eq!(text, "run 5 d");
    let keyless = test::TestRequest::get().uri("/read").peer_addr(peer());
    let (status, replayed, text) =
        parts(test::call_service(&app, keyless.to_request()).await).await;
    assert_eq!((status, replayed, &text[..]), (200, false, &b"run 6 "[..]));
    assert_eq!(runs.get(), 6);

    let (s1, r1, first) = parts(test::call_service(&app, keyed(Method::POST, "p")).await).await;
    let (s2, r2, again) = parts(test::call_service(&app, keyed(Method::POST, "p")).await).await;
    assert_eq!((s1, r1, s2, r2), (200, false, 200, true));
    assert_eq!((&first[..], &again[..]), (&b"run 7 p"[..], &b"run 7 p"[..]));
    let (status, _, body) =
        parts(test::call_service(&app, post("/read", None).to_request()).await).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    assert_eq!(runs.get(), 7);
}

#[idempotent(crate = crate)]
async fn by_default(runs: web::Data<Runs>, body: String) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Ok().body(format!("run {n} {body}"))
}

#[idempotent(crate = crate, methods = ["PUT"])]
async fn put_only(runs: web::Data<Runs>, body: String) -> HttpResponse {
    let n = runs.next();
    HttpResponse::Ok().body(format!("run {n} {body}"))
}

/// The attribute applies to POST and PATCH by default, like the middleware: a PUT with a key
/// runs every time (outside strict mode, see below). With `methods = ["PUT"]` the PUT is claimed
/// and replayed, and POST passes.
#[actix_web::test]
async fn the_attribute_applies_to_its_methods_post_and_patch_by_default() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(strict(false)))
            .app_data(runs.clone())
            .route("/default", web::route().to(by_default))
            .route("/put-only", web::route().to(put_only)),
    )
    .await;
    let mut seen = Vec::new();
    for (method, path, key) in [
        (Method::PUT, "/default", "k1"),
        (Method::PUT, "/default", "k1"),
        (Method::PATCH, "/default", "k2"),
        (Method::PATCH, "/default", "k2"),
        (Method::PUT, "/put-only", "k3"),
        (Method::PUT, "/put-only", "k3"),
        (Method::POST, "/put-only", "k4"),
        (Method::POST, "/put-only", "k4"),
    ] {
        let req = post(path, Some(key)).method(method).set_payload("b");
        let (status, replayed, text) =
            parts(test::call_service(&app, req.to_request()).await).await;
        assert_eq!(status, 200, "{path}: {text:?}");
        seen.push((String::from_utf8_lossy(&text).into_owned(), replayed));
    }
    let expect = |n: usize, replayed: bool| (format!("run {n} b"), replayed);
    assert_eq!(
        seen,
        [
            expect(1, false),
            expect(2, false),
            expect(3, false),
            expect(3, true),
            expect(4, false),
            expect(4, true),
            expect(5, false),
            expect(6, false),
        ],
        "default PUT runs twice, PATCH replays; methods = [\"PUT\"]: PUT replays, POST runs twice"
    );
    assert_eq!(runs.get(), 6);
    let errors = logs.errors();
    assert_eq!(errors.len(), 1, "said once per handle: {errors:?}");
    assert!(errors[0].contains("/default"), "{errors:?}");
}

/// A keyed unsafe request outside the attribute's methods (`web::put()`, `web::delete()` to a
/// plain `#[idempotent]` handler) is a setup mistake: said once with the fix, and refused 500
/// in strict mode. Safe methods and keyless requests still pass untouched.
#[actix_web::test]
async fn strict_a_keyed_put_or_delete_outside_the_methods_is_refused_and_said() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = web::Data::new(Runs::default());
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(strict(true)))
            .app_data(runs.clone())
            .route("/unlisted", web::route().to(by_default)),
    )
    .await;
    let request = |method: Method, key: Option<&str>| {
        post("/unlisted", key)
            .method(method)
            .set_payload("b")
            .to_request()
    };
    for method in [Method::PUT, Method::DELETE, Method::PUT] {
        let res = test::call_service(&app, request(method.clone(), Some("k"))).await;
        let (status, _, body) = parts(res).await;
        assert_eq!(status, 500, "{method}: {body:?}");
        assert_eq!(code(&body), "IDEMPOTENCY_MISCONFIGURED");
    }
    assert_eq!(runs.get(), 0, "nothing ran unprotected");
    let errors = logs.errors();
    assert_eq!(errors.len(), 1, "said once: {errors:?}");
    for part in ["/unlisted", "PUT", r#"methods = ["PUT"]"#] {
        assert!(errors[0].contains(part), "{part}: {errors:?}");
    }
    let res = test::call_service(&app, request(Method::PUT, None)).await;
    assert_eq!(parts(res).await, (200, false, Bytes::from("run 1 b")));
    let res = test::call_service(&app, request(Method::GET, Some("g"))).await;
    assert_eq!(parts(res).await, (200, false, Bytes::from("run 2 b")));
    let (s1, r1, _) = parts(test::call_service(&app, request(Method::POST, Some("p"))).await).await;
    let (s2, r2, _) = parts(test::call_service(&app, request(Method::POST, Some("p"))).await).await;
    assert_eq!((s1, r1, s2, r2), (200, false, 200, true));
    assert_eq!(logs.errors().len(), 1);
}
