use idempotent_runtime::actix::idempotent;

// Stands in for `actix_web_lab::sse::Sse`, which the check recognises by name.
mod actix_web_lab {
    pub mod sse {
        pub struct Sse<S>(pub S);
    }
}

#[idempotent(require_key)]
async fn events() -> actix_web_lab::sse::Sse<()> {
    actix_web_lab::sse::Sse(())
}

fn main() {}
