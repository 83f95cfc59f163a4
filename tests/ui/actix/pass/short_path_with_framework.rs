//! With both features on, the short path works once the framework is named.

use actix_web::{App, HttpResponse, web};

#[idempotent_runtime::idempotent(framework = actix, require_key)]
async fn create(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Created().json(body.into_inner())
}

fn main() {
    let _ = App::new().route("/x", web::post().to(create));
}
