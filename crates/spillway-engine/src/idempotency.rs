//! I2: `Idempotency-Key`. A request that carries one either runs (and claims the key, so a
//! concurrent repeat finds it in progress), or is answered from the ledger: the stored
//! copy of the completed response, byte for byte, or a refusal naming why nothing is sent
//! again (another body, still running, unknown outcome). Keys are scoped by gateway key
//! and expire after the configured window.
//!
//! The claim lives in memory while its request runs and until the request's final record
//! (and its response copy) is committed; from then on the ledger answers. A process owns
//! its SQLite ledger (one writer), so memory plus ledger is the whole truth there. On a
//! fleet's shared ledger (R1) the claim is also taken in the ledger, under its unique key,
//! before the ledger is asked about the key: two instances never both start one key.

use crate::clock;
use crate::error::GatewayError;
use crate::state::AppState;
use http::HeaderMap;
use spillway_ledger::{KeyedRequest, RequestRecord, RequestState};
use spillway_wire::UnixMs;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

pub const HEADER: &str = "idempotency-key";
/// Longest key accepted (Stripe's and the IETF draft's practice is well under this).
const MAX_KEY: usize = 255;

/// The client's `Idempotency-Key`, checked: 1-255 printable ASCII characters.
pub fn key_of(headers: &HeaderMap) -> Result<Option<String>, GatewayError> {
    let Some(v) = headers.get(HEADER) else { return Ok(None) };
    let ok = |s: &str| !s.is_empty() && s.len() <= MAX_KEY && s.bytes().all(|b| (0x20..0x7f).contains(&b));
    match v.to_str().map(str::trim) {
        Ok(s) if ok(s) => Ok(Some(s.to_owned())),
        _ => Err(GatewayError::InvalidIdempotencyKey),
    }
}

type ClaimKey = (String, String);

/// What a request is, for telling a repeat from another request under the same key.
#[derive(Clone, PartialEq, Eq)]
struct Fingerprint {
    body_sha256: Option<String>,
    model: Option<String>,
    endpoint: String,
}

impl Fingerprint {
    fn of(r: &RequestRecord) -> Fingerprint {
        Fingerprint {
            body_sha256: r.body_sha256.clone(),
            model: r.requested_model.clone(),
            endpoint: r.endpoint.clone(),
        }
    }
}

/// Where a claimed key's request is.
enum Holder {
    /// Running: a repeat is refused as in progress (another body under the key, 422).
    Running { request_id: String, print: Fingerprint },
    /// Closed, its final record queued but maybe not committed yet: a repeat waits for
    /// the commit and then reads the ledger.
    Closing { request_id: String },
}

#[derive(Default)]
struct Inner {
    held: HashMap<ClaimKey, Holder>,
    /// Keys closing, in the order their final records were queued, each with the
    /// writer's word that they are committed. Commits come in queue order, so the front
    /// is the first to let go.
    closing: VecDeque<(ClaimKey, String, oneshot::Receiver<spillway_ledger::Result<()>>)>,
}

impl Inner {
    /// Lets go of the keys whose final records are committed. No task per request: the
    /// next key to come along does it, in order.
    fn purge(&mut self) {
        while let Some((_, _, rx)) = self.closing.front_mut() {
            // Once committed, or the writer failed or stopped, the ledger answers (a record
            // still in the spool reads as in progress there, never as new).
            if let Err(oneshot::error::TryRecvError::Empty) = rx.try_recv() {
                return;
            }
            let Some((key, id, _)) = self.closing.pop_front() else {
                return;
            };
            if matches!(self.held.get(&key), Some(Holder::Closing { request_id }) if *request_id == id) {
                self.held.remove(&key);
            }
        }
    }
}

/// Keys whose requests are running or closing in this process.
#[derive(Default)]
pub struct Claims(Mutex<Inner>);

impl Claims {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A key held by the request that runs under it. Dropped without [`Claim::release`]
/// (the request never reached its final record), the key is simply let go.
pub struct Claim {
    st: Arc<AppState>,
    key: Option<(ClaimKey, String)>,
}

impl Claim {
    /// The request's final record is queued: the key goes back once it is committed, so
    /// a repeat never finds neither the claim nor the record. The commit is not hurried
    /// (the record rides with the next durable write); a repeat that comes meanwhile
    /// hurries it itself.
    pub fn release(mut self) {
        let Some((key, id)) = self.key.take() else { return };
        if self.st.fleet.shared_ledger {
            release_shared(&self.st, &key, &id, Some(self.st.ledger.when_committed()));
        }
        let committed = self.st.ledger.when_committed();
        let mut c = self.st.idempotency.lock();
        if let Some(h) = c.held.get_mut(&key) {
            *h = Holder::Closing { request_id: id.clone() };
        }
        c.closing.push_back((key, id, committed));
        c.purge();
    }
}

/// Drops the fleet's claim of `key` held by request `id`, in the background, once
/// `after` (its record's commit) has come, or at once (it never reached a record). One
/// that cannot be dropped is taken over by the next request once this one's row is final
/// or its instance is gone.
fn release_shared(
    st: &Arc<AppState>,
    key: &ClaimKey,
    id: &str,
    after: Option<oneshot::Receiver<spillway_ledger::Result<()>>>,
) {
    let (st, key, id) = (st.clone(), key.clone(), id.to_owned());
    tokio::spawn(async move {
        if let Some(after) = after {
            let _ = after.await;
        }
        if let Err(e) = st.ledger.store().release_key(&key.0, &key.1, &id).await {
            tracing::warn!(error = %e, "could not release an idempotency key's claim in the shared ledger");
        }
    });
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some((k, id)) = self.key.take() {
            if self.st.fleet.shared_ledger {
                release_shared(&self.st, &k, &id, None);
            }
            let mut c = self.st.idempotency.lock();
            if matches!(c.held.get(&k), Some(Holder::Running { request_id, .. }) if *request_id == id) {
                c.held.remove(&k);
            }
        }
    }
}

/// What to do with a request that carries an `Idempotency-Key`.
pub enum Verdict {
    /// Run it; the claim is held until its final record is committed.
    Run(Claim),
    /// Answer it with the stored response of the request that completed.
    Replay(Box<KeyedRequest>),
    /// Refuse it: nothing is sent upstream.
    Refuse(GatewayError),
}

/// Decides, for `rec` (its body hash, model and endpoint known) under `key`.
pub async fn check(st: &Arc<AppState>, key: String, rec: &RequestRecord) -> Verdict {
    let Some(key_name) = rec.key_name.clone() else {
        return Verdict::Refuse(GatewayError::Internal);
    };
    let ck: ClaimKey = (key_name, key);
    let print = Fingerprint::of(rec);
    // R1: on a fleet's ledger the fleet's claim comes first (a refusal names the request
    // that runs, wherever it does), then this instance's, then the ledger's record: a
    // request that finished elsewhere let go of the key only once its record was
    // committed, so it is found below.
    if st.fleet.shared_ledger {
        let mut flushed = false;
        loop {
            match st.ledger.store().claim_key(&ck.0, &ck.1, &rec.id, clock::now()).await {
                Ok(None) => break,
                Ok(Some(original)) => {
                    // Held by a request of this instance whose final record is queued: once
                    // committed it lets go, and this one is answered from the ledger.
                    let closing_here = {
                        let mut c = st.idempotency.lock();
                        c.purge();
                        matches!(c.held.get(&ck), Some(Holder::Closing { request_id }) if *request_id == original)
                    };
                    if closing_here && !flushed && st.ledger.flush().await.is_ok() {
                        flushed = true;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    return Verdict::Refuse(GatewayError::IdempotencyInProgress {
                        original,
                        state: "running",
                    });
                }
                Err(e) => {
                    tracing::error!(error = %e, "the shared ledger could not claim an idempotency key; refusing the request");
                    return Verdict::Refuse(GatewayError::LedgerUnavailable);
                }
            }
        }
    }
    let refuse = |e: GatewayError| {
        if st.fleet.shared_ledger {
            release_shared(st, &ck, &rec.id, None);
        }
        Verdict::Refuse(e)
    };
    // A key still closing in this process is waited for (one commit); after that its
    // final record is in the ledger, and this request takes the key over.
    let mut flushed = false;
    loop {
        {
            let mut c = st.idempotency.lock();
            c.purge();
            match c.held.get(&ck) {
                Some(Holder::Running { request_id, print: p }) if *p != print => {
                    return refuse(GatewayError::IdempotencyKeyReused {
                        original: request_id.clone(),
                    });
                }
                Some(Holder::Running { request_id, .. }) => {
                    return refuse(GatewayError::IdempotencyInProgress {
                        original: request_id.clone(),
                        state: "running",
                    });
                }
                Some(Holder::Closing { .. }) if !flushed => {}
                _ => {
                    c.held.insert(
                        ck.clone(),
                        Holder::Running {
                            request_id: rec.id.clone(),
                            print: print.clone(),
                        },
                    );
                    break;
                }
            }
        }
        if let Err(e) = st.ledger.flush().await {
            tracing::error!(error = %e, "ledger flush failed while an idempotency key was closing");
            return refuse(GatewayError::LedgerUnavailable);
        }
        flushed = true;
    }
    let claim = Claim {
        st: st.clone(),
        key: Some((ck.clone(), rec.id.clone())),
    };
    let now = clock::now();
    let since = UnixMs(now.0.saturating_sub(st.config.idempotency.window_ms as i64));
    let found = match st.ledger.keyed(&ck.0, &ck.1, since, now).await {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(error = %e, "ledger lookup of an idempotency key failed; refusing the request");
            return Verdict::Refuse(GatewayError::LedgerUnavailable);
        }
    };
    let Some(found) = found else { return Verdict::Run(claim) };
    let o = &found.request;
    // A request refused before it reached a provider (an unknown model, an open breaker)
    // binds nothing: the client may fix it and send again under the same key.
    if o.state == RequestState::Failed && o.attempts == 0 {
        return Verdict::Run(claim);
    }
    if Fingerprint::of(o) != print {
        return Verdict::Refuse(GatewayError::IdempotencyKeyReused { original: o.id.clone() });
    }
    match o.state {
        RequestState::Received | RequestState::CallingApi => Verdict::Refuse(GatewayError::IdempotencyInProgress {
            original: o.id.clone(),
            state: o.state.as_str(),
        }),
        RequestState::Unknown => Verdict::Refuse(GatewayError::IdempotencyUnknown { original: o.id.clone() }),
        // The provider did not complete it (or an owner confirmed it never ran): the key
        // runs again, as a newer request.
        RequestState::Failed => Verdict::Run(claim),
        RequestState::ApiCompleted | RequestState::SideEffectPending | RequestState::Done => {
            if found.response.is_some() {
                Verdict::Replay(Box::new(found))
            } else {
                Verdict::Refuse(GatewayError::IdempotencyNotKept {
                    original: o.id.clone(),
                    result_id: o.result_id().map(str::to_owned),
                })
            }
        }
    }
}

/// The headers a replay carries besides the original's gateway headers.
pub fn replay_headers(h: &mut HeaderMap, original: &RequestRecord) {
    let mut set = |name: &'static str, v: &str| {
        if let Ok(v) = http::HeaderValue::from_str(v) {
            h.insert(name, v);
        }
    };
    set("x-spillway-idempotent-replay", "true");
    set("x-spillway-replay-of", &original.id);
    match (original.state, original.result_id()) {
        (_, Some(r)) => {
            set("x-spillway-side-effect", "done");
            set("x-spillway-result-id", r);
        }
        (RequestState::SideEffectPending, None) => set("x-spillway-side-effect", "pending"),
        _ => {}
    }
}

/// A request's state as its client sees it (`GET /spillway/v1/requests/{id}`).
#[derive(serde::Serialize)]
struct RequestStatus<'a> {
    request_id: &'a str,
    state: RequestState,
    http_status: Option<u16>,
    idempotency_key: Option<&'a str>,
    replay_of: Option<&'a str>,
    result_id: Option<&'a str>,
    side_effect_at: Option<UnixMs>,
}

fn status_json(rec: &RequestRecord) -> axum::response::Response {
    use axum::response::IntoResponse;
    axum::Json(RequestStatus {
        request_id: &rec.id,
        state: rec.state,
        http_status: rec.http_status,
        idempotency_key: rec.idempotency_key.as_deref(),
        replay_of: rec.replay_of.as_deref(),
        result_id: rec.result_id(),
        side_effect_at: rec.resolution.as_ref().and_then(|r| r.side_effect_at),
    })
    .into_response()
}

/// An error of the gateway's own client API, in the OpenAI error shape.
fn api_error(kind: spillway_wire::ErrorKind, message: &str, param: Option<&str>) -> axum::response::Response {
    api_error_retry(kind, message, param, kind.retryable())
}

fn api_error_retry(
    kind: spillway_wire::ErrorKind,
    message: &str,
    param: Option<&str>,
    retry: bool,
) -> axum::response::Response {
    let mut r = axum::response::Response::new(axum::body::Body::from(spillway_wire::error_body(
        spillway_wire::Format::OpenAi,
        kind,
        message,
        param,
    )));
    *r.status_mut() = http::StatusCode::from_u16(kind.status()).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if !retry {
        r.headers_mut()
            .insert("x-should-retry", http::HeaderValue::from_static("false"));
    }
    r
}

/// The request `id` as its own key sees it: another key's request does not exist for it.
/// A replay's id leads to the request it replayed (the one a side effect belongs to).
async fn owned_request(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    uri: &http::Uri,
    id: &str,
) -> Result<RequestRecord, axum::response::Response> {
    use spillway_wire::{ErrorKind, Format};
    let key = crate::ingress::authenticate(st, Format::Anthropic, headers, uri)
        .or_else(|_| crate::ingress::authenticate(st, Format::Gemini, headers, uri))
        .map_err(|e| e.into_response(Format::OpenAi))?;
    let not_found = || api_error(ErrorKind::NotFound, "No request with that id for this API key.", None);
    if id.len() > 64 {
        return Err(not_found());
    }
    let mut id = id.to_owned();
    for _ in 0..2 {
        let mut got = st.ledger.get_request(&id).await;
        // The request may have just ended, its record still queued: the client reads its
        // own writes (a commit is hurried only then, not for every status poll).
        if matches!(&got, Ok(None)) || matches!(&got, Ok(Some(r)) if !r.state.is_final()) {
            if let Err(e) = st.ledger.flush().await {
                tracing::error!(error = %e, "ledger flush failed");
                return Err(GatewayError::LedgerUnavailable.into_response(Format::OpenAi));
            }
            got = st.ledger.get_request(&id).await;
        }
        let rec = match got {
            Ok(Some(r)) if r.key_name.as_deref() == Some(key.key.name.as_str()) => r,
            Ok(_) => return Err(not_found()),
            Err(e) => {
                tracing::error!(error = %e, "ledger read failed");
                return Err(GatewayError::LedgerUnavailable.into_response(Format::OpenAi));
            }
        };
        match &rec.replay_of {
            Some(original) => id = original.clone(),
            None => return Ok(rec),
        }
    }
    Err(not_found())
}

/// `GET /spillway/v1/requests/{id}`: the request's state, its side-effect step and result.
pub async fn status_endpoint(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: axum::extract::Request,
) -> axum::response::Response {
    match owned_request(&st, req.headers(), req.uri(), &id).await {
        Ok(rec) => status_json(&rec),
        Err(r) => r,
    }
}

/// I3: `POST /spillway/v1/requests/{id}/side-effect` with `{"state": "pending"}` before a
/// downstream action (an email, a payment) and `{"state": "done", "result_id": ...}`
/// after it. A replay of the request's key then says the side effect happened, so the
/// client does not repeat it.
pub async fn side_effect_endpoint(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: axum::extract::Request,
) -> axum::response::Response {
    use spillway_wire::ErrorKind;
    let (parts, body) = req.into_parts();
    let rec = match owned_request(&st, &parts.headers, &parts.uri, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let Ok(body) = axum::body::to_bytes(body, 4096).await else {
        return api_error(ErrorKind::InvalidRequest, "The body is larger than 4 KiB.", None);
    };
    let step: spillway_ledger::SideEffect = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(_) => {
            return api_error(
                ErrorKind::InvalidRequest,
                "Expected {\"state\": \"pending\"} or {\"state\": \"done\", \"result_id\": \"...\"}.",
                Some("state"),
            );
        }
    };
    if let spillway_ledger::SideEffect::Done { result_id } = &step
        && (result_id.trim().is_empty() || result_id.len() > 256 || result_id.chars().any(char::is_control))
    {
        return api_error(
            ErrorKind::InvalidRequest,
            "`result_id`: 1-256 printable characters naming what the side effect produced.",
            Some("result_id"),
        );
    }
    match st.ledger.side_effect(&rec.id, &step, clock::now()).await {
        Ok(rec) => status_json(&rec),
        // Another try cannot change what is recorded.
        Err(spillway_ledger::Error::Conflict(m)) => api_error_retry(ErrorKind::Conflict, &m, Some("state"), false),
        Err(spillway_ledger::Error::NotFound) => {
            api_error(ErrorKind::NotFound, "No request with that id for this API key.", None)
        }
        Err(e) => {
            tracing::error!(error = %e, "the ledger could not record a side-effect step");
            GatewayError::LedgerUnavailable.into_response(spillway_wire::Format::OpenAi)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i2_keys_are_printable_and_bounded() {
        // spec: I2
        let mut h = HeaderMap::new();
        assert_eq!(key_of(&h).unwrap(), None);
        h.insert(HEADER, "order-42/attempt".parse().unwrap());
        assert_eq!(key_of(&h).unwrap().as_deref(), Some("order-42/attempt"));
        for bad in ["", "   ", &"k".repeat(256)] {
            h.insert(HEADER, bad.parse().unwrap());
            assert!(key_of(&h).is_err(), "{bad:?}");
        }
        h.insert(HEADER, http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap());
        let e = key_of(&h).unwrap_err().to_string();
        assert!(e.contains("Idempotency-Key"), "{e}");
    }
}
