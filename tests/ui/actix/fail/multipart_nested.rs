use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

// Stands in for `actix_multipart::Multipart`, which the check recognises by name anywhere in the
// parameter's type.
mod actix_multipart {
    pub struct Multipart;
}

#[idempotent(require_key)]
async fn upload(form: Option<actix_multipart::Multipart>) -> HttpResponse {
    drop(form);
    HttpResponse::Ok().finish()
}

fn main() {}
