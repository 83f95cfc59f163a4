use actix_web::{App, HttpResponse, post, web};
use idempotent_runtime::actix::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::{IdempotencyContext, Idempotency};

#[idempotent(require_key, enlisted)]
#[post("/orders")]
async fn create_order(
    tx: &mut EnlistedTx,
    context: IdempotencyContext,
    order: web::Json<serde_json::Value>,
) -> HttpResponse {
    let inserted = sqlx::query("INSERT INTO orders (body, request) VALUES ($1, $2)")
        .bind(order.to_string())
        .bind(context.derived_key("order"))
        .execute(tx.conn())
        .await;
    match inserted {
        Ok(_) => HttpResponse::Created().json(&*order),
        Err(_) => HttpResponse::InternalServerError().finish(),
    }
}

#[idempotent(enlisted)]
async fn optional(body: String, tx: &mut EnlistedTx) -> HttpResponse {
    let _ = (body, &mut **tx);
    HttpResponse::NoContent().finish()
}

fn main() {
    let _app = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(create_order)
        .route("/optional", web::post().to(optional));
}
