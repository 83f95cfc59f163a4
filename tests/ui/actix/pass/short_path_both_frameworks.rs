//! With both features on (cargo feature unification in a workspace), the short path tells each
//! handler's framework from its own tokens: no `framework = …` needed.

use actix_web::{HttpResponse, Responder, post, web};
use axum::extract::{Path, State};
use axum::response::IntoResponse;
use axum::routing::post as axum_post;
use axum::{Json, Router};
use idempotent_runtime::{Idempotency, idempotent};

// axum: `State` is axum's.
#[idempotent(require_key)]
async fn axum_state(State(_store): State<Idempotency>, Json(v): Json<serde_json::Value>) -> Json<serde_json::Value> {
    Json(v)
}

// axum: `impl IntoResponse` is axum's (`Path` and `String` are in both).
#[idempotent]
async fn axum_impl(Path(id): Path<u32>, body: String) -> impl IntoResponse {
    format!("{id} {body}")
}

// actix-web: `web::Json` is actix-web's (an unqualified `Json` would say nothing).
#[idempotent(require_key)]
async fn actix_json(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Created().json(body.into_inner())
}

// actix-web: the route attribute below says so.
#[idempotent]
#[post("/below")]
async fn actix_route_below(body: String) -> String {
    body
}

// actix-web: the route attribute above says so, read from the source.
#[post("/above")]
#[idempotent(require_key)]
async fn actix_route_above(body: String) -> impl Responder {
    body
}

fn main() {
    let _axum: Router = Router::new()
        .route("/state", axum_post(axum_state))
        .route("/impl/{id}", axum_post(axum_impl))
        .with_state(Idempotency::memory());
    let _actix = actix_web::App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .route("/json", web::post().to(actix_json))
        .service(actix_route_below)
        .service(actix_route_above);
}
