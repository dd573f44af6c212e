//! Ingress: the provider-shaped routes (A1), client auth per format (A2), size and shape
//! checks (A5), and the request record that follows the request to the ledger.

use crate::error::GatewayError;
use crate::failover::{self, Job};
use crate::limits::KEY_WAIT;
use crate::routing;
use crate::state::AppState;
use crate::trace::{TraceContext, request_id};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::json;
use sha2::{Digest, Sha256};
use spillway_ledger::RequestRecord;
use spillway_wire::{ErrorKind, Format, parse_request};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The gateway's id for this request, set by [`request_id_layer`] before any handler runs.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai_chat))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1beta/models/{model_action}", post(gemini_generate))
        .route("/v1/models/{model_action}", post(gemini_generate))
        .route("/v1/models", get(list_models))
        .route("/v1beta/models", get(list_models_gemini))
        .route("/healthz", get(|| async { "ok" }))
        .merge(crate::admin::router(state.clone()))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(request_id_layer))
        .with_state(state)
}

/// A6: every response, errors and unknown paths included, carries `x-request-id`.
async fn request_id_layer(mut req: Request, next: Next) -> Response {
    let id = request_id();
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

fn format_for_path(path: &str) -> Format {
    if path.starts_with("/v1beta") {
        Format::Gemini
    } else if path == "/v1/messages" {
        Format::Anthropic
    } else {
        Format::OpenAi
    }
}

/// API paths get a 404 in their format; anything else is the console, when it is served.
async fn fallback(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let p = uri.path();
    let api = p.starts_with("/v1") || p.starts_with("/admin") || p.starts_with("/healthz");
    match (&st.ui_dir, api, method == Method::GET) {
        (Some(dir), false, true) => crate::admin::console(dir.clone(), p).await,
        _ => not_found(method, uri).await,
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    GatewayError::NotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
    .into_response(format_for_path(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    GatewayError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
    .into_response(format_for_path(uri.path()))
}

async fn openai_chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, Format::OpenAi, None, false, req).await
}

async fn anthropic_messages(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, Format::Anthropic, None, false, req).await
}

async fn gemini_generate(State(st): State<Arc<AppState>>, Path(model_action): Path<String>, req: Request) -> Response {
    let parsed = model_action.rsplit_once(':').and_then(|(model, action)| match action {
        "generateContent" => Some((model.to_owned(), false)),
        "streamGenerateContent" => Some((model.to_owned(), true)),
        _ => None,
    });
    match parsed {
        Some((model, stream)) => handle(st, Format::Gemini, Some(model), stream, req).await,
        None => GatewayError::NotFound {
            method: "POST".into(),
            path: req.uri().path().to_owned(),
        }
        .into_response(Format::Gemini),
    }
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// A2: the key where each format's SDK puts it; `Authorization: Bearer` on every format.
fn presented_key<'a>(format: Format, headers: &'a HeaderMap, uri: &'a Uri) -> Option<&'a str> {
    let bearer = header_str(headers, "authorization").and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    match format {
        Format::OpenAi => bearer,
        Format::Anthropic => header_str(headers, "x-api-key").or(bearer),
        Format::Gemini => header_str(headers, "x-goog-api-key")
            .or_else(|| {
                uri.query()?
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("key="))
                    .filter(|k| !k.is_empty())
            })
            .or(bearer),
    }
}

fn authenticate(
    st: &AppState,
    format: Format,
    headers: &HeaderMap,
    uri: &Uri,
) -> Result<Arc<crate::state::KeyRt>, GatewayError> {
    let Some(presented) = presented_key(format, headers, uri) else {
        return Err(GatewayError::MissingKey(match format {
            Format::OpenAi => "`Authorization: Bearer <key>`",
            Format::Anthropic => "the `x-api-key` header",
            Format::Gemini => "the `x-goog-api-key` header",
        }));
    };
    let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    st.keys.get(&digest).cloned().ok_or(GatewayError::InvalidKey)
}

/// A client-chosen id worth recording: bounded and printable, so it cannot bloat the ledger.
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    header_str(headers, "x-client-request-id")
        .filter(|v| v.len() <= 256 && v.bytes().all(|b| (0x21..0x7f).contains(&b)))
        .map(str::to_owned)
}

async fn read_body(body: Body, limit: u64, headers: &HeaderMap) -> Result<Bytes, GatewayError> {
    if let Some(len) = header_str(headers, "content-length").and_then(|v| v.parse::<u64>().ok())
        && len > limit
    {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit as usize).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(GatewayError::BodyRead(e.to_string())),
    }
}

/// A request that ends before any upstream call: recorded as failed (so rejected traffic
/// is visible to operators), answered in the caller's format.
async fn reject(st: &AppState, mut rec: RequestRecord, format: Format, err: GatewayError) -> Response {
    let now = now_ms();
    rec.fail(Some(err.kind().status()), err.class(), err.to_string(), now);
    // C3: nothing went upstream, so nothing is billed.
    rec.cost_usd = Some(0.0);
    st.metrics.finished(&rec, false, now);
    if let Err(e) = st.ledger.put_request(rec).await {
        tracing::error!(error = %e, "could not record a rejected request");
    }
    err.into_response(format)
}

async fn handle(
    st: Arc<AppState>,
    format: Format,
    path_model: Option<String>,
    path_stream: bool,
    req: Request,
) -> Response {
    let received_at = now_ms();
    let (parts, body) = req.into_parts();
    let id = parts
        .extensions
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_else(request_id);
    let trace = TraceContext::from_header(header_str(&parts.headers, "traceparent"), &id);
    let mut rec = RequestRecord::received(
        id,
        trace.trace_id.clone(),
        format.as_str(),
        parts.uri.path(),
        received_at,
    );
    rec.client_request_id = client_request_id(&parts.headers);
    rec.requested_model = path_model.clone();
    rec.stream = path_stream;

    let key = match authenticate(&st, format, &parts.headers, &parts.uri) {
        Ok(k) => k,
        Err(e) => return reject(&st, rec, format, e).await,
    };
    rec.key_name = Some(key.key.name.clone());
    rec.owner = Some(key.key.owner.clone());

    let bytes = match read_body(body, st.config.max_body_bytes, &parts.headers).await {
        Ok(b) => b,
        Err(e) => return reject(&st, rec, format, e).await,
    };
    // I6: the prompt itself is not stored, only its hash.
    rec.body_sha256 = Some(hex::encode(Sha256::digest(&bytes)));
    let parsed = match parse_request(format, path_model.as_deref(), path_stream, &bytes) {
        Ok(p) => p,
        Err(e) => return reject(&st, rec, format, e.into()).await,
    };
    rec.requested_model = Some(parsed.model.clone());
    rec.stream = parsed.stream;
    rec.route = Some(format!("{format}/{}", parsed.model));

    let candidates = routing::candidates(&st, format, &parsed.model);
    if candidates.is_empty() {
        let e = GatewayError::NoChannel {
            model: parsed.model.clone(),
            format,
        };
        return reject(&st, rec, format, e).await;
    }

    // From here the request may wait (key room, capacity); a client that hangs up while
    // it waits leaves the queue with nothing sent upstream (C4), and the ledger says so.
    let abandon = Abandoned(Some((&st, &rec)));
    let deadline = tokio::time::Instant::now() + Duration::from_millis(st.config.total_deadline_ms);
    let key_slot = match key.limits.acquire(KEY_WAIT).await {
        Ok(slot) => slot,
        Err(over) => {
            abandon.disarm();
            let e = GatewayError::KeyLimited {
                retry_after_s: over.retry_after_s,
            };
            return reject(&st, rec, format, e).await;
        }
    };
    let tokens = parsed.estimated_input_tokens + parsed.max_output_tokens.unwrap_or(0);
    let capacity_wait = Duration::from_millis(st.config.capacity_wait_ms)
        .min(deadline.saturating_duration_since(tokio::time::Instant::now()));
    let on_wait = || routing::WaitGuard::queued(&st, &rec);
    let admitted = match routing::admit(&candidates, &parsed.model, tokens, &[], capacity_wait, on_wait).await {
        Ok(a) => a,
        Err(e) => {
            abandon.disarm();
            return reject(&st, rec, format, e).await;
        }
    };
    abandon.disarm();
    let client_gone = Arc::new(AtomicBool::new(false));
    let job = Job {
        st: st.clone(),
        format,
        parts,
        body: bytes,
        capacity_wait_left: capacity_wait.saturating_sub(admitted.waited.unwrap_or_default()),
        parsed,
        trace,
        candidates,
        tokens,
        deadline,
        key_slot: Some(key_slot),
        client_gone: client_gone.clone(),
    };
    // Dropped when the client hangs up (or when the answer is sent, when it no longer matters).
    let _hang_up = HangUp(client_gone);

    // The attempts run in their own task so that a client hanging up mid-call cannot cut
    // the request short halfway: the provider's answer is still read, metered and
    // recorded. (A stream's end is recorded by the stream itself, however it ends.)
    let request_id = rec.id.clone();
    match tokio::spawn(failover::run(job, rec, admitted)).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::error!(error = %e, request_id, "upstream task failed");
            GatewayError::Upstream {
                kind: ErrorKind::Upstream,
                message: "The gateway failed while calling the provider.".into(),
                retry_after_ms: None,
                futile: false,
            }
            .into_response(format)
        }
    }
}

/// Tells the attempt loop that nobody is waiting for the answer any more.
struct HangUp(Arc<AtomicBool>);

impl Drop for HangUp {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A request still waiting at ingress. Dropped armed — the client went away — it records
/// the request as failed with nothing sent upstream (C4). It borrows the record, so only
/// an abandoned request pays for a copy of it.
struct Abandoned<'a>(Option<(&'a AppState, &'a RequestRecord)>);

impl Abandoned<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some((st, rec)) = self.0.take() {
            let mut rec = rec.clone();
            let now = now_ms();
            rec.fail(
                None,
                GatewayError::ClientGone.class(),
                GatewayError::ClientGone.to_string(),
                now,
            );
            rec.cost_usd = Some(0.0);
            st.metrics.finished(&rec, false, now);
            st.ledger.enqueue_request(rec);
        }
    }
}

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

/// `GET /v1/models`: OpenAI's list shape, or Anthropic's when the caller is the Anthropic
/// SDK (it sends `anthropic-version`).
async fn list_models(State(st): State<Arc<AppState>>, headers: HeaderMap, uri: Uri) -> Response {
    let format = if headers.contains_key("anthropic-version") || headers.contains_key("x-api-key") {
        Format::Anthropic
    } else {
        Format::OpenAi
    };
    if let Err(e) = authenticate(&st, format, &headers, &uri) {
        return e.into_response(format);
    }
    let models = models_for(&st, format);
    let body = match format {
        Format::Anthropic => json!({
            "data": models.iter().map(|m| json!({"type": "model", "id": m, "display_name": m, "created_at": "2025-01-01T00:00:00Z"})).collect::<Vec<_>>(),
            "has_more": false, "first_id": models.first(), "last_id": models.last()
        }),
        _ => {
            json!({"object": "list", "data": models.iter().map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "spillway"})).collect::<Vec<_>>()})
        }
    };
    axum::Json(body).into_response()
}

async fn list_models_gemini(State(st): State<Arc<AppState>>, headers: HeaderMap, uri: Uri) -> Response {
    if let Err(e) = authenticate(&st, Format::Gemini, &headers, &uri) {
        return e.into_response(Format::Gemini);
    }
    let models = models_for(&st, Format::Gemini);
    axum::Json(
        json!({"models": models.iter().map(|m| json!({"name": format!("models/{m}"), "displayName": m,
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]})).collect::<Vec<_>>()}),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a2_key_locations_per_format() {
        // spec: A2
        let uri: Uri = "/v1beta/models/m:generateContent?alt=sse&key=sk-q".parse().unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(Format::Gemini, &h, &uri), Some("sk-q"));
        assert_eq!(presented_key(Format::OpenAi, &h, &uri), None);
        h.insert("authorization", "Bearer sk-b".parse().unwrap());
        assert_eq!(presented_key(Format::OpenAi, &h, &uri), Some("sk-b"));
        assert_eq!(presented_key(Format::Anthropic, &h, &uri), Some("sk-b"));
        h.insert("x-api-key", "sk-a".parse().unwrap());
        h.insert("x-goog-api-key", "sk-g".parse().unwrap());
        assert_eq!(presented_key(Format::Anthropic, &h, &uri), Some("sk-a"));
        assert_eq!(presented_key(Format::Gemini, &h, &uri), Some("sk-g"));
        // The OpenAI format only reads Bearer, as the OpenAI API does.
        assert_eq!(presented_key(Format::OpenAi, &h, &uri), Some("sk-b"));
    }
}
