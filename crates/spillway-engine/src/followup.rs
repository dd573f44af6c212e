//! Follow-ups to a response the provider stores (OpenAI's Responses API):
//! `GET`/`DELETE /v1/responses/{id}`, `GET .../input_items`, `POST .../cancel`. Only the
//! channel (the provider account) that stored a response can find it, so each goes to the
//! channel the ledger recorded for it, for the gateway key that created it and no other.
//! They are metadata calls: passed through as they are (within the key's limits), not
//! retried, metered or billed.

use crate::error::GatewayError;
use crate::ingress::{authenticate, read_body, refuse_without_row};
use crate::limits::KEY_WAIT;
use crate::server::ConnState;
use crate::state::AppState;
use crate::upstream::{FORWARDED_HEADERS, request_to};
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use futures_util::{StreamExt, TryStreamExt};
use http::header;
use spillway_wire::Format;
use std::sync::Arc;
use std::time::Duration;

/// The pin of a stored response, scoped by the gateway key that created it.
fn pin_of(key_name: &str, response_id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("stored-response", key_name, response_id).hash(&mut h);
    h.finish()
}

/// A Responses answer was stored by the channel that served `rec`: follow-ups go there.
/// Held in memory at once (the next turn may come before the final record's commit),
/// and in the ledger for good.
pub(crate) fn remember(st: &AppState, rec: &spillway_ledger::RequestRecord) {
    if let (Some(id), Some(key), Some(held)) = (&rec.response_id, &rec.key_name, &rec.channel)
        && let Some(ch) = st.channels.iter().find(|c| c.cfg.name == *held)
    {
        st.control.pin(pin_of(key, id), ch);
    }
}

/// The channel that stored `response_id` for `key_name`, if it was made here.
pub(crate) async fn holder(
    st: &AppState,
    key_name: &str,
    response_id: &str,
) -> spillway_ledger::Result<Option<String>> {
    if let Some(c) = st.control.pinned(pin_of(key_name, response_id)) {
        return Ok(Some(c.to_string()));
    }
    Ok(st
        .ledger
        .by_response_id(key_name, response_id)
        .await?
        .and_then(|r| r.channel))
}

/// `/v1/responses/{id}` and `/v1/responses/{id}/{action}`.
pub async fn follow_up(
    State(st): State<Arc<AppState>>,
    Path(params): Path<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let format = Format::OpenAi;
    if st.shutdown.draining.is_cancelled() {
        return GatewayError::ShuttingDown.into_response(format);
    }
    let conn = req.extensions().get::<Arc<ConnState>>().cloned();
    let key = match authenticate(&st, format, req.headers(), req.uri()) {
        Ok(k) => k,
        Err(e) => return refuse_without_row(&st, format, conn.as_ref(), e),
    };
    // Each is a call to the provider: it takes room on the key like any other, before
    // anything else is done for it (a client probing ids pays its rate too). The slot is
    // held until the answer has been passed on, streamed or not.
    let slot = match key.limits.acquire(st.shared.as_ref(), KEY_WAIT, true).await {
        Ok(slot) => slot,
        Err(over) => {
            return GatewayError::KeyLimited {
                retry_after_s: over.retry_after_s,
            }
            .into_response(format);
        }
    };
    let id = params
        .into_iter()
        .find(|(k, _)| k == "id")
        .map(|(_, v)| v)
        .unwrap_or_default();
    let not_found = || GatewayError::UnknownResponse.into_response(format);
    let held = match holder(&st, &key.key.name, &id).await {
        Ok(Some(c)) => c,
        Ok(None) => return not_found(),
        Err(e) => {
            tracing::error!(error = %e, "could not look up a stored response");
            return GatewayError::LedgerUnavailable.into_response(format);
        }
    };
    let Some(channel) = st.channels.iter().find(|c| c.cfg.name == held) else {
        return not_found();
    };
    let ch = &channel.cfg;
    let (parts, body) = req.into_parts();
    let deadline = Duration::from_millis(st.config.server.body_read_timeout_ms);
    let body = match read_body(body, st.config.max_body_bytes, deadline).await {
        Ok(b) => b,
        Err(e) => return e.into_response(format),
    };
    let has_body = !body.is_empty();
    let mut rb = match request_to(parts.method.clone(), channel, format, &parts.uri, body) {
        Ok(r) => r,
        Err(why) => {
            return GatewayError::Upstream {
                kind: spillway_wire::ErrorKind::Upstream,
                message: format!("the channel that stored this response cannot be called: {why}"),
                retry_after_ms: None,
                futile: true,
            }
            .into_response(format);
        }
    };
    let h = rb.headers_mut();
    if has_body {
        h.insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    }
    for name in &FORWARDED_HEADERS {
        if let Some(v) = parts.headers.get(name) {
            h.insert(name, v.clone());
        }
    }
    // The answer's headers within the attempt timeout; a resumed stream
    // (`?stream=true`) then runs as long as the provider sends.
    let wait = Duration::from_millis(ch.timeout_ms.unwrap_or(st.config.attempt_timeout_ms));
    let failed = |why: String| {
        GatewayError::Upstream {
            kind: spillway_wire::ErrorKind::Upstream,
            message: spillway_ledger::truncate(
                format!("the channel that stored this response did not answer: {why}"),
                512,
            ),
            retry_after_ms: None,
            futile: false,
        }
        .into_response(format)
    };
    let up = match tokio::time::timeout(wait, st.upstream.send(rb)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return failed(crate::client::describe(&e)),
        Err(_) => return failed(format!("no response headers within {} ms", wait.as_millis())),
    };
    // P3: the provider's answer to the channel's credentials may quote part of its key.
    if matches!(up.status().as_u16(), 401 | 403) {
        return failed(format!(
            "the provider refused the channel's credentials ({})",
            up.status().as_u16()
        ));
    }
    let mut out = Response::builder().status(up.status().as_u16());
    for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
        if let Some(v) = up.headers().get(&name) {
            out = out.header(name, v.clone());
        }
    }
    out = out.header("x-spillway-channel", ch.name.as_str());
    let stream = http_body_util::BodyDataStream::new(up.into_body())
        .map_err(|e| std::io::Error::other(crate::client::describe(&e)))
        .map(move |chunk| {
            let _held = &slot;
            chunk
        });
    out.body(Body::from_stream(stream))
        .unwrap_or_else(|_| GatewayError::Internal.into_response(format))
}
