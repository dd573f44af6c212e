//! The model catalogue each format's SDK asks for: `GET /v1/models` and
//! `GET /v1/models/{id}` (OpenAI's shape, or Anthropic's when the Anthropic SDK asks), and
//! `GET /v1beta/models` and `GET /v1beta/models/{id}` (Gemini's). The models are those the
//! channels of the caller's format serve.

use crate::error::GatewayError;
use crate::ingress::{authenticate, refuse_without_row};
use crate::server::ConnState;
use crate::state::AppState;
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use spillway_wire::Format;
use std::sync::Arc;

fn models_for(st: &AppState, format: Format) -> Vec<String> {
    let mut m: Vec<String> = st
        .channels
        .iter()
        .filter(|c| c.cfg.format == format)
        .flat_map(|c| c.cfg.models.iter().filter(|m| *m != "*").cloned())
        .collect();
    m.sort();
    m.dedup();
    m
}

/// Whose SDK asks, from where it puts its key: the Anthropic SDK sends
/// `anthropic-version` (and `x-api-key`), Google's `x-goog-api-key` (or `?key=`);
/// everything else on `/v1/models` is OpenAI.
fn format_of(headers: &HeaderMap, uri: &axum::http::Uri) -> Format {
    if headers.contains_key("anthropic-version") || headers.contains_key("x-api-key") {
        Format::Anthropic
    } else if headers.contains_key("x-goog-api-key")
        || uri
            .query()
            .is_some_and(|q| q.split('&').any(|kv| kv.starts_with("key=")))
    {
        Format::Gemini
    } else {
        Format::OpenAi
    }
}

fn describe(format: Format, m: &str) -> Value {
    match format {
        Format::Anthropic => json!({"type": "model", "id": m, "display_name": m, "created_at": "2025-01-01T00:00:00Z"}),
        Format::OpenAi => json!({"id": m, "object": "model", "created": 0, "owned_by": "spillway"}),
        Format::Gemini => json!({"name": format!("models/{m}"), "displayName": m,
            "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens", "embedContent"]}),
    }
}

/// The refusal of a catalogue request in `format` without a valid key, if it is one.
fn refusal(st: &AppState, format: Format, req: &Request) -> Option<Response> {
    let conn = req.extensions().get::<Arc<ConnState>>();
    authenticate(st, format, req.headers(), req.uri())
        .err()
        .map(|e| refuse_without_row(st, format, conn, e))
}

/// `GET /v1/models`.
pub async fn list(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let format = match format_of(req.headers(), req.uri()) {
        // Gemini lists its models under `/v1beta/models` (and `/v1/models` on `v1`).
        Format::Gemini => return list_gemini(State(st), req).await,
        f => f,
    };
    if let Some(r) = refusal(&st, format, &req) {
        return r;
    }
    let models = models_for(&st, format);
    let data: Vec<Value> = models.iter().map(|m| describe(format, m)).collect();
    let body = match format {
        Format::Anthropic => {
            json!({"data": data, "has_more": false, "first_id": models.first(), "last_id": models.last()})
        }
        _ => json!({"object": "list", "data": data}),
    };
    axum::Json(body).into_response()
}

/// `GET /v1beta/models`.
pub async fn list_gemini(State(st): State<Arc<AppState>>, req: Request) -> Response {
    if let Some(r) = refusal(&st, Format::Gemini, &req) {
        return r;
    }
    let models: Vec<Value> = models_for(&st, Format::Gemini)
        .iter()
        .map(|m| describe(Format::Gemini, m))
        .collect();
    axum::Json(json!({"models": models})).into_response()
}

/// One model in `format`'s shape, or a 404 in that format.
fn one(st: &AppState, format: Format, req: &Request, id: &str) -> Response {
    if let Some(r) = refusal(st, format, req) {
        return r;
    }
    // Served by name, or by a channel that serves any model (`*`) of the format.
    if st.channels.iter().any(|c| c.cfg.format == format && c.cfg.serves(id)) {
        return axum::Json(describe(format, id)).into_response();
    }
    GatewayError::UnknownModel { format }.into_response(format)
}

/// `GET /v1/models/{id}`, in the shape of the SDK that asks (a Gemini SDK on `v1` too).
pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>, req: Request) -> Response {
    let format = format_of(req.headers(), req.uri());
    one(&st, format, &req, &id)
}

/// `GET /v1beta/models/{id}`.
pub async fn gemini_model(State(st): State<Arc<AppState>>, Path(id): Path<String>, req: Request) -> Response {
    one(&st, Format::Gemini, &req, &id)
}
