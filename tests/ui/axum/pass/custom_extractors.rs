use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::{Idempotency, scope::Identity};

/// An auth extractor that runs before the last parameter and publishes the caller's identity.
struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let user = parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .ok_or(StatusCode::UNAUTHORIZED)?
            .to_owned();
        parts
            .extensions
            .insert(Identity::subject("tenant", user.clone()));
        Ok(User(user))
    }
}

/// A body extractor of the application's own.
struct Upper(String);

impl<S: Send + Sync> FromRequest<S> for Upper {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &S) -> Result<Self, StatusCode> {
        let text = String::from_request(req, state)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Upper(text.to_uppercase()))
    }
}

#[idempotent(require_key)]
async fn shout(State(_s): State<Idempotency>, User(user): User, Upper(text): Upper) -> String {
    format!("{user}: {text}")
}

#[idempotent(require_key)]
async fn whoami(State(_s): State<Idempotency>, User(user): User) -> String {
    user
}

fn main() {
    let _app: Router = Router::new()
        .route("/shout", post(shout))
        .route("/whoami", post(whoami))
        .with_state(Idempotency::memory());
}
