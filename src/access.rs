//! Who may call which HTTP route, with a token file (`--auth-file`).
//!
//! One layer over the node's whole router, so that a route added later is
//! covered by default: everything needs the read scope except
//!
//! - `/healthz`, and the fleet UI's page and assets (`/`, `/ui/…`), which
//!   hold no data (the UI asks for a token when its first call gets a 401);
//! - `/api/v1/write` (remote write), which needs the write scope;
//! - `/api/v1/admin/…`, which needs the admin scope.
//!
//! A request without a usable token gets 401 with `WWW-Authenticate`; a
//! token without the scope gets 403. Both carry the Prometheus API's error
//! body and are counted in `gpulse_auth_refused_total{surface="http"}`.

use std::sync::Arc;

use auth::{Gate, Scope, Surface};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The scope a request for `path` needs; `None`: none.
pub(crate) fn needs(path: &str) -> Option<Scope> {
    if path == "/healthz" || path == "/" || path.starts_with("/ui/") {
        None
    } else if path == "/api/v1/write" {
        Some(Scope::Write)
    } else if path.starts_with("/api/v1/admin/") {
        Some(Scope::Admin)
    } else {
        Some(Scope::Read)
    }
}

/// The axum middleware: wrap the router with
/// `axum::middleware::from_fn_with_state(gate, access::check)`.
pub(crate) async fn check(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    let Some(need) = needs(request.uri().path()) else {
        return next.run(request).await;
    };
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match gate.check(Surface::Http, authorization, need) {
        Ok(()) => next.run(request).await,
        Err(denial) => {
            let (code, kind) = if denial.unauthenticated() {
                (StatusCode::UNAUTHORIZED, "unauthorized")
            } else {
                (StatusCode::FORBIDDEN, "forbidden")
            };
            let body = serde_json::json!({
                "status": "error",
                "errorType": kind,
                "error": denial.to_string(),
            });
            let mut response = (
                code,
                [(header::CONTENT_TYPE, "application/json")],
                body.to_string(),
            )
                .into_response();
            if denial.unauthenticated() {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer realm=\"gpulse\""),
                );
            }
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_needs_what_it_should() {
        for (path, need) in [
            ("/healthz", None),
            ("/", None),
            ("/ui/app.js", None),
            ("/api/v1/write", Some(Scope::Write)),
            ("/api/v1/admin/flush", Some(Scope::Admin)),
            ("/api/v1/query", Some(Scope::Read)),
            ("/api/v1/query_range", Some(Scope::Read)),
            ("/api/v1/sql", Some(Scope::Read)),
            ("/api/v1/read", Some(Scope::Read)),
            ("/api/v1/health", Some(Scope::Read)),
            ("/api/v1/fleet/frame", Some(Scope::Read)),
            ("/metrics", Some(Scope::Read)),
            // Not a route: still read, so nothing unknown is open.
            ("/api/v1//admin/flush", Some(Scope::Read)),
            ("/ui", Some(Scope::Read)),
            ("/uix/a", Some(Scope::Read)),
        ] {
            assert_eq!(needs(path), need, "{path}");
        }
    }
}
