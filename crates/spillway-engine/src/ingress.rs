//! Ingress: the provider-shaped routes (A1), client auth per format (A2), and the checks
//! that refuse a request cheaply, cheapest first: the Host it names (P1), its key, its
//! content type and declared size, its key's limits — all before a byte of its body is
//! read — then the body itself (deadline, size, one valid UTF-8 JSON value of the
//! endpoint's shape, A5), the model's channels, and a place in the capacity queue (C2).
//! Every refusal answers in the caller's format; a request with a valid key gets its
//! ledger row, one without is only counted.

use crate::clock;
use crate::control::{Admit, Outcome};
use crate::error::GatewayError;
use crate::failover::{self, Caller, Ctx};
use crate::life::{End, Life};
use crate::limits::KEY_WAIT;
use crate::metrics::{RejectReason, Rejection};
use crate::routing;
use crate::server::ConnState;
use crate::state::AppState;
use crate::trace::{TraceContext, request_id};
use crate::upstream::HttpCaller;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::FutureExt;
use http_body_util::{BodyExt, Limited};
use sha2::{Digest, Sha256};
use spillway_ledger::RequestRecord;
use spillway_wire::{Api, Format, ParsedRequest, RequestError, parse_request, request::valid_model_name};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

/// D4: a client may name its conversation; later turns with the same value stay on the
/// channel that served the first.
pub const CONVERSATION_HEADER: &str = "x-spillway-conversation-id";

/// The gateway's id for this request, set by [`GateLayer`] before any handler runs.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// N4: Prometheus text. Open to loopback clients unless `metrics_token` is set; a
/// listener on another address answers other peers only with the token.
async fn metrics_endpoint(State(st): State<Arc<AppState>>, req: Request) -> Response {
    use subtle::ConstantTimeEq;
    let presented = header_str(req.headers(), "authorization").and_then(|v| v.strip_prefix("Bearer "));
    let allowed = match (&st.config.metrics_token, presented) {
        (Some(t), Some(p)) => bool::from(spillway_policy::hash_secret(p.trim()).0.ct_eq(&t.0)),
        (Some(_), None) => false,
        (None, _) => req
            .extensions()
            .get::<Arc<ConnState>>()
            .is_some_and(|c| c.peer.ip().is_loopback()),
    };
    if !allowed {
        let msg = if st.config.metrics_token.is_some() {
            "/metrics needs `Authorization: Bearer <metrics_token>`."
        } else {
            "/metrics answers loopback clients only; set `metrics_token` in the config to let others scrape it."
        };
        return (http::StatusCode::UNAUTHORIZED, msg).into_response();
    }
    let mut r = st.prom.render(&st).into_response();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// The routes, with the real upstream.
pub fn router(state: Arc<AppState>) -> Router {
    router_with(state, Arc::new(HttpCaller))
}

/// The routes, with `caller` making the upstream calls (tests script it).
pub fn router_with<C: Caller>(state: Arc<AppState>, caller: Arc<C>) -> Router {
    // One handler per (format, API) of a fixed path; Gemini names both in its path.
    let fixed = |format: Format, api: Api| {
        let c = caller.clone();
        post(move |State(st): State<Arc<AppState>>, req: Request| {
            let c = c.clone();
            async move { handle(st, c, format, api, None, false, req).await }
        })
    };
    let c = caller.clone();
    let gemini = move |State(st): State<Arc<AppState>>, Path(model_action): Path<String>, req: Request| {
        let c = c.clone();
        async move { gemini_action(st, c, model_action, req).await }
    };
    Router::new()
        .route("/v1/chat/completions", fixed(Format::OpenAi, Api::Generate))
        .route("/v1/responses", fixed(Format::OpenAi, Api::Responses))
        .route("/v1/embeddings", fixed(Format::OpenAi, Api::Embeddings))
        .route(
            "/v1/responses/{id}",
            get(crate::followup::follow_up).delete(crate::followup::follow_up),
        )
        .route("/v1/responses/{id}/input_items", get(crate::followup::follow_up))
        .route("/v1/responses/{id}/cancel", post(crate::followup::follow_up))
        .route("/v1/messages", fixed(Format::Anthropic, Api::Generate))
        .route("/v1/messages/count_tokens", fixed(Format::Anthropic, Api::CountTokens))
        .route(
            "/v1beta/models/{model_action}",
            post(gemini.clone()).get(crate::models::gemini_model),
        )
        .route("/v1/models/{model_action}", post(gemini).get(crate::models::model))
        .route("/v1/models", get(crate::models::list))
        .route("/v1beta/models", get(crate::models::list_gemini))
        .route(
            "/spillway/v1/requests/{id}/side-effect",
            post(crate::idempotency::side_effect_endpoint),
        )
        .route("/spillway/v1/requests/{id}", get(crate::idempotency::status_endpoint))
        .route("/spillway/v1/jobs/{id}", get(crate::jobs::status_endpoint))
        .route("/spillway/v1/jobs/{id}/result", get(crate::jobs::result_endpoint))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics_endpoint))
        .merge(crate::admin::router(state.clone()))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(GateLayer(state.clone()))
        .with_state(state)
}

/// What every request passes before its route, as one layer rather than a `from_fn` layer
/// each (four boxed futures and four clones of the route per request, a few per cent of
/// the request path's CPU):
/// - A6: every response, errors and unknown paths included, carries `x-request-id`;
/// - P1: only Host names that are loopback or listed in `allowed_hosts` are answered, so a
///   web page cannot reach the gateway (or its console) through a DNS name that happens to
///   resolve to this machine;
/// - a body left unread says `Connection: close` ([`Watched`]);
/// - a panic in a handler is a bug: the client gets a 500 in its format and the server
///   goes on (the request's record was closed as the panic unwound through its owner).
#[derive(Clone)]
struct GateLayer(Arc<AppState>);

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gate<S>;

    fn layer(&self, inner: S) -> Gate<S> {
        Gate {
            inner,
            st: self.0.clone(),
        }
    }
}

/// [`GateLayer`]'s service.
#[derive(Clone)]
struct Gate<S> {
    inner: S,
    st: Arc<AppState>,
}

type GateFuture = std::pin::Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>;

impl<S> tower::Service<Request> for Gate<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = GateFuture;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> GateFuture {
        let id = request_id();
        let id_header = HeaderValue::from_str(&id).ok();
        req.extensions_mut().insert(RequestId(id));
        let format = format_for_path(req.uri().path());
        if !host_allowed(&self.st, &req) {
            let conn = req.extensions().get::<Arc<ConnState>>();
            let resp = refuse_without_row(&self.st, format, conn, GatewayError::ForbiddenHost);
            return Box::pin(std::future::ready(Ok(with_request_id(resp, id_header))));
        }
        let read = watch_body(&mut req);
        // The service polled ready is the one called; a clone waits for the next request.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(async move {
            let mut resp = match AssertUnwindSafe(async move { inner.call(req).await })
                .catch_unwind()
                .await
            {
                Ok(Ok(r)) => r,
                Ok(Err(never)) => match never {},
                Err(_) => {
                    tracing::error!("a request handler panicked; answered 500");
                    GatewayError::Internal.into_response(format)
                }
            };
            if read.is_some_and(|r| !r.load(std::sync::atomic::Ordering::Acquire)) {
                resp.headers_mut()
                    .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(with_request_id(resp, id_header))
        })
    }
}

fn with_request_id(mut resp: Response, id: Option<HeaderValue>) -> Response {
    if let Some(v) = id {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// P1 for one request. HTTP/1.0 without a Host passes: no browser sends that.
fn host_allowed(st: &AppState, req: &Request) -> bool {
    match req.uri().authority() {
        Some(a) => st.config.host_allowed(a.as_str()),
        None => header_str(req.headers(), "host").is_none_or(|h| st.config.host_allowed(h)),
    }
}

/// A request body that reports its end, so the connection knows whether it can carry
/// another request.
struct Watched {
    inner: Body,
    read: Arc<std::sync::atomic::AtomicBool>,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, std::task::Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, std::sync::atomic::Ordering::Release);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A refusal answered before the body was read (a bad key, a key over its rate, a body
/// too large) leaves the body's bytes on an HTTP/1 connection, which then cannot carry
/// another request: the server drops it after the answer. Saying so (`Connection:
/// close`) keeps a keep-alive client from sending its next request, a retry most likely,
/// into a connection that is being closed. Returns the flag the body sets once read;
/// `None` when there is nothing to watch (no body, or not HTTP/1).
fn watch_body(req: &mut Request) -> Option<Arc<std::sync::atomic::AtomicBool>> {
    let h1 = matches!(req.version(), http::Version::HTTP_11 | http::Version::HTTP_10);
    if !h1 || http_body::Body::is_end_stream(req.body()) {
        return None;
    }
    let read = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = read.clone();
    let body = std::mem::take(req.body_mut());
    *req.body_mut() = Body::new(Watched {
        inner: body,
        read: flag,
    });
    Some(read)
}

fn format_for_path(path: &str) -> Format {
    if path.starts_with("/v1beta") || (path.starts_with("/v1/models/") && path.contains(':')) {
        Format::Gemini
    } else if path.starts_with("/v1/messages") {
        Format::Anthropic
    } else {
        Format::OpenAi
    }
}

/// API paths get a 404 in their format, naming what was asked for; anything else is the
/// console.
async fn fallback(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let p = uri.path();
    let api =
        p.starts_with("/v1") || p.starts_with("/admin") || p.starts_with("/healthz") || p.starts_with("/spillway");
    if !api && (method == Method::GET || method == Method::HEAD) {
        return st.console.serve(p).await;
    }
    GatewayError::NotFound {
        method: method.to_string(),
        path: p.to_owned(),
    }
    .into_response(format_for_path(p))
}

async fn method_not_allowed(uri: Uri) -> Response {
    GatewayError::MethodNotAllowed.into_response(format_for_path(uri.path()))
}

async fn gemini_action<C: Caller>(st: Arc<AppState>, caller: Arc<C>, model_action: String, req: Request) -> Response {
    let parsed = model_action.rsplit_once(':').and_then(|(model, action)| {
        let (api, stream) = spillway_wire::request::gemini_action(action)?;
        Some((model.to_owned(), api, stream))
    });
    match parsed {
        Some((model, api, stream)) => handle(st, caller, Format::Gemini, api, Some(model), stream, req).await,
        None => GatewayError::NotFound {
            method: req.method().to_string(),
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

pub(crate) fn authenticate(
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
    st.accounts.key(&digest).ok_or(GatewayError::InvalidKey)
}

/// Refused without a ledger row (no valid key, a foreign Host, a ledger refusing writes):
/// counted and listed, answered in the caller's format.
pub(crate) fn refuse_without_row(
    st: &AppState,
    format: Format,
    conn: Option<&Arc<ConnState>>,
    err: GatewayError,
) -> Response {
    let reason = match err {
        GatewayError::MissingKey(_) => RejectReason::MissingKey,
        GatewayError::ForbiddenHost => RejectReason::ForbiddenHost,
        GatewayError::LedgerUnavailable => RejectReason::LedgerUnavailable,
        _ => RejectReason::InvalidKey,
    };
    st.metrics.rejected(Rejection {
        at: clock::now(),
        reason,
        format,
        peer: conn.map(|c| c.peer.ip().to_string()),
    });
    err.into_response(format)
}

/// A client-chosen id worth recording: bounded and printable, so it cannot bloat the ledger.
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    header_str(headers, "x-client-request-id")
        .filter(|v| v.len() <= 256 && v.bytes().all(|b| (0x21..0x7f).contains(&b)))
        .map(str::to_owned)
}

/// The endpoint as the ledger records it: the route, with the Gemini model as a
/// placeholder (the model is its own column), never the client's raw path.
fn endpoint(format: Format, api: Api, path: &str, stream: bool) -> &'static str {
    match (format, api) {
        (Format::OpenAi, Api::Responses) => "/v1/responses",
        (Format::OpenAi, Api::Embeddings) => "/v1/embeddings",
        (Format::OpenAi, _) => "/v1/chat/completions",
        (Format::Anthropic, Api::CountTokens) => "/v1/messages/count_tokens",
        (Format::Anthropic, _) => "/v1/messages",
        (Format::Gemini, _) => {
            // Gemini's path names the action: the recorded endpoint is that path with the
            // model replaced, found in the table (which lists every one).
            let prefix = if path.starts_with("/v1beta/") {
                "/v1beta/models/{model}:"
            } else {
                "/v1/models/{model}:"
            };
            let action = match (api, stream) {
                (Api::Embeddings, _) if path.ends_with(":batchEmbedContents") => "batchEmbedContents",
                (Api::Embeddings, _) => "embedContent",
                (Api::CountTokens, _) => "countTokens",
                (_, true) => "streamGenerateContent",
                (_, false) => "generateContent",
            };
            spillway_wire::request::ENDPOINTS
                .iter()
                .map(|(e, _)| *e)
                .find(|e| e.strip_prefix(prefix) == Some(action))
                .unwrap_or("/v1beta/models/{model}:generateContent")
        }
    }
}

/// Only `application/json` (parameters such as a charset allowed).
fn is_json(headers: &HeaderMap) -> bool {
    header_str(headers, "content-type").is_some_and(|v| {
        let essence = v.split(';').next().unwrap_or_default().trim();
        essence.eq_ignore_ascii_case("application/json")
    })
}

/// Bodies up to this size are hashed and parsed on the request thread; larger ones on the
/// blocking pool (a 16 MiB body takes tens of milliseconds).
const PARSE_INLINE_BYTES: usize = 256 * 1024;

/// Large bodies hashed and parsed at once: one per core. A client sending many large
/// bodies together would otherwise have the blocking pool build hundreds of parse trees
/// side by side; past this they wait their turn, as they did on the request threads.
static LARGE_PARSES: std::sync::LazyLock<tokio::sync::Semaphore> = std::sync::LazyLock::new(|| {
    tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
});

/// The body's SHA-256 (hex) and its parse.
fn hash_and_parse(
    format: Format,
    api: Api,
    model: Option<&str>,
    path_stream: bool,
    bytes: &[u8],
) -> (String, Result<ParsedRequest, RequestError>) {
    (
        hex::encode(Sha256::digest(bytes)),
        parse_request(format, api, model, path_stream, bytes),
    )
}

pub(crate) async fn read_body(body: Body, limit: u64, deadline: Duration) -> Result<Bytes, GatewayError> {
    match tokio::time::timeout(deadline, Limited::new(body, limit as usize).collect()).await {
        Err(_) => Err(GatewayError::BodyTimeout {
            ms: clock::ms(deadline),
        }),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Ok(Err(_)) => Err(GatewayError::BodyRead),
    }
}

pub(crate) async fn handle<C: Caller>(
    st: Arc<AppState>,
    caller: Arc<C>,
    format: Format,
    api: Api,
    path_model: Option<String>,
    path_stream: bool,
    req: Request,
) -> Response {
    let received_at = clock::now();
    let (parts, body) = req.into_parts();
    let conn = parts.extensions.get::<Arc<ConnState>>().cloned();
    if st.shutdown.draining.is_cancelled() {
        return GatewayError::ShuttingDown.into_response(format);
    }
    // J2: a run of a background job runs as its job's key (known by name; no secret is
    // kept), set by the runner in the request's extensions, which no client can reach.
    let job_run = parts.extensions.get::<crate::jobs::JobRun>().cloned();
    // O1: a recovery run's confirm probe (or a drill's load), sent by the gateway as the
    // key an operator named.
    let recovery_probe = parts.extensions.get::<crate::recovery::ProbeRun>().cloned();
    let bypass = recovery_probe.as_ref().is_some_and(|p| p.bypass);
    let key = match (&job_run, &recovery_probe) {
        (Some(j), _) => j.key.clone(),
        (None, Some(p)) => p.key.clone(),
        (None, None) => match authenticate(&st, format, &parts.headers, &parts.uri) {
            Ok(k) => k,
            Err(e) => return refuse_without_row(&st, format, conn.as_ref(), e),
        },
    };
    // A ledger that refuses writes: 503 before anything else, counted, not recorded (its
    // spool is for the requests that were already running).
    if !st.ledger.is_healthy() {
        return refuse_without_row(&st, format, conn.as_ref(), GatewayError::LedgerUnavailable);
    }
    let id = parts
        .extensions
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_else(request_id);
    let trace = TraceContext::from_header(header_str(&parts.headers, "traceparent"), &id);
    let mut rec = RequestRecord::received(
        id,
        trace.trace_id.clone(),
        format,
        endpoint(format, api, parts.uri.path(), path_stream),
        received_at,
    );
    rec.client_request_id = client_request_id(&parts.headers);
    rec.requested_model = path_model.filter(|m| valid_model_name(m));
    rec.stream = path_stream;
    rec.key_name = Some(key.key.name.clone());
    rec.owner = Some(key.key.owner.clone());
    // J8: the request's workflow: named, else its key's default, else `default`.
    let workflow = st.workflows.select(
        header_str(&parts.headers, crate::workflows::HEADER),
        key.key.workflow.as_deref(),
    );
    if let Ok(w) = &workflow {
        rec.workflow = Some(w.name.clone());
        rec.policy_version = Some(w.version.clone());
    }
    rec.job_id = job_run.as_ref().map(|j| j.job_id.clone());
    let mut life = Life::new(st.clone(), rec, conn);
    if let Some(j) = &job_run {
        life.set_job_sink(j.sink.clone());
    }
    life.api = api;
    life.set_trace(&trace);
    // B3: an owner without balance, a key past its spend limit: refused before anything
    // else is read, and nothing goes upstream.
    if let Err(e) = st.accounts.admit(&key, received_at) {
        return life.close(End::refused(e)).await;
    }
    life.set_key(key.clone());
    let workflow = match workflow {
        Ok(w) => w,
        Err(e) => return life.close(End::refused(e)).await,
    };
    // J2: `Prefer: respond-async` asks for a job (a job's own runs never do).
    let async_job = job_run.is_none() && crate::jobs::prefers_async(&parts.headers);
    // J8: a named workflow's interactive lane sets the attempts and the capacity wait; the
    // built-in default leaves the config's.
    let own_lane = !(workflow.name == "default" && workflow.source == "built-in");

    // Cheap refusals first: nothing of the body has been read yet.
    if !is_json(&parts.headers) {
        return life.close(End::refused(GatewayError::UnsupportedMediaType)).await;
    }
    let idempotency_key = match crate::idempotency::key_of(&parts.headers) {
        Ok(k) => k,
        Err(e) => return life.close(End::refused(e)).await,
    };
    let limit = st.config.max_body_bytes;
    if header_str(&parts.headers, "content-length")
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > limit)
    {
        return life.close(End::refused(GatewayError::PayloadTooLarge { limit })).await;
    }
    // From here the request may wait (key room, capacity); a client that hangs up while
    // it waits leaves with nothing sent upstream (C4), and its record says so.
    let total = job_run
        .as_ref()
        .map_or(Duration::from_millis(st.config.total_deadline_ms), |j| j.deadline);
    let deadline = tokio::time::Instant::now() + total;
    // Token counting is free at the providers: it takes from the key's rate only when
    // the key says so. A job takes from it once, when submitted (B2 holds for background
    // work too); its runs hold only a concurrency slot.
    let rated =
        (api != Api::CountTokens || key.key.rpm_counts_token_counting) && job_run.is_none() && recovery_probe.is_none();
    match key.limits.acquire(st.shared.as_ref(), KEY_WAIT, rated).await {
        Ok(slot) => life.hold_key(slot),
        Err(over) => {
            let e = GatewayError::KeyLimited {
                retry_after_s: over.retry_after_s,
            };
            return life.close(End::refused(e)).await;
        }
    }

    let body_deadline = Duration::from_millis(st.config.server.body_read_timeout_ms);
    let bytes = match read_body(body, limit, body_deadline).await {
        Ok(b) => b,
        Err(e) => return life.close(End::refused(e)).await,
    };
    // I6: the prompt itself is not stored, only its hash.
    let (sha, parsed) = if bytes.len() <= PARSE_INLINE_BYTES {
        hash_and_parse(format, api, life.rec.requested_model.as_deref(), path_stream, &bytes)
    } else {
        // Milliseconds of CPU for a large body: off the request threads (there may be
        // only one), so one big prompt does not hold every other request up.
        let (b, model) = (bytes.clone(), life.rec.requested_model.clone());
        // The semaphore is never closed.
        let _turn = LARGE_PARSES.acquire().await.ok();
        match tokio::task::spawn_blocking(move || hash_and_parse(format, api, model.as_deref(), path_stream, &b)).await
        {
            Ok(done) => done,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    };
    life.rec.body_sha256 = Some(sha);
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => return life.close(End::refused(e.into())).await,
    };
    #[cfg(test)]
    if parsed.model == "spillway-test-panic-in-handler" {
        panic!("a test asked the handler to panic");
    }
    life.rec.requested_model = Some(parsed.model.clone());
    life.rec.stream = parsed.stream;
    life.rec.endpoint = endpoint(format, api, parts.uri.path(), parsed.stream).to_owned();
    if api == Api::CountTokens {
        // Providers do not charge for counting: it is never billed (M1).
        life.rec.cost_usd = Some(0.0);
    }
    life.rec.route = Some(format!("{format}/{}", parsed.model));
    life.set_route();
    // M3: what the call is expected to cost, before it is made.
    life.estimate(&parsed);
    if st.config.store_prompts {
        life.keep_prompt(bytes.clone());
    }
    if async_job {
        let sub = crate::jobs::Submission {
            key: key.clone(),
            workflow,
            format,
            api,
            path_and_query: crate::jobs::stored_path(&parts.uri),
            headers: &parts.headers,
            body: bytes,
            model: parsed.model.clone(),
            idempotency_key,
        };
        // Boxed: inline, its state (larger than the rest of this handler's) would be
        // reserved in every request's, though few requests become jobs.
        return Box::pin(crate::jobs::submit(&st, life, sub)).await;
    }
    // I2: a repeat of an `Idempotency-Key` is answered from the ledger and sends nothing
    // upstream; a new key is claimed by this request.
    if let Some(k) = idempotency_key {
        use crate::idempotency::Verdict;
        match crate::idempotency::check(&st, k.clone(), &life.rec).await {
            Verdict::Run(claim) => life.run_idempotent(k, claim),
            Verdict::Replay(found) => return life.close(End::Replay(found)).await,
            Verdict::Refuse(e) => return life.close(End::refused(e)).await,
        }
    }

    // D4: a conversation stays on its channel; the client may name it, else its opening
    // messages do. A first turn is a new conversation, spread by weight and health (many
    // identical one-shot prompts must not all land on one channel); later turns follow it.
    let named = header_str(&parts.headers, CONVERSATION_HEADER);
    let conversation = named.map_or(parsed.conversation, |c| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        c.hash(&mut h);
        h.finish()
    });
    let pinned = (named.is_some() || parsed.continuation)
        .then(|| st.control.pinned(conversation))
        .flatten();
    let mut candidates = routing::candidates(&st, format, &parsed.model, pinned.as_deref());
    // A Responses turn after a stored response goes where that response is stored: no
    // other channel (another account) can find it. Only a response this key created may
    // be continued: channels are accounts shared by every key, so an id learnt elsewhere
    // must not open another key's conversation. A holder gone from the group is routed
    // as any request, and the provider says whether it can continue.
    if let Some(prev) = &parsed.previous_response_id {
        match crate::followup::holder(&st, &key.key.name, prev).await {
            Ok(Some(held)) => {
                if candidates.iter().any(|c| *c.cfg.name == *held) {
                    candidates.retain(|c| *c.cfg.name == *held);
                }
            }
            Ok(None) => return life.close(End::refused(GatewayError::UnknownResponse)).await,
            Err(e) => {
                tracing::error!(error = %e, "could not look up a stored response");
                return life.close(End::refused(GatewayError::LedgerUnavailable)).await;
            }
        }
    }
    if candidates.is_empty() {
        return life.close(End::refused(GatewayError::NoChannel { format })).await;
    }
    let route = st.control.route(&st, format, &parsed.model);
    // O1: a recovery run holding the route lets through only its own probes and, while
    // resuming, its share of the route's concurrency. G2: an open breaker sends nothing;
    // on probation, one probe at a time.
    let admission = if bypass { Admit::Send(None) } else { route.admit(&st) };
    let (probe, gate_slot) = match admission {
        Admit::Send(slot) => (None, slot),
        Admit::Probe(p, slot) => (Some(p), slot),
        Admit::Held(held) => {
            let e = GatewayError::RecoveryHold {
                route: route.name.clone(),
                run: held.run,
                reason: held.reason,
                // Isolation lasts minutes; a full share frees within seconds.
                retry_after_s: if held.paused { 30 } else { 2 },
            };
            return life.close(End::refused(e)).await;
        }
        Admit::Refuse { retry_after, reason } => {
            let e = GatewayError::BreakerOpen {
                route: route.name.clone(),
                reason,
                retry_after_s: crate::error::retry_after_secs(retry_after),
            };
            return life.close(End::refused(e)).await;
        }
    };
    life.set_control(route.clone());
    let tokens = parsed.estimated_input_tokens + parsed.max_output_tokens.unwrap_or(0);
    let mut capacity_wait = Duration::from_millis(st.config.capacity_wait_ms);
    if own_lane {
        capacity_wait = capacity_wait.min(Duration::from_millis(workflow.interactive.max_wait_ms));
    }
    let capacity_wait = capacity_wait.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
    // F3: a job's run is one upstream attempt (the job counts and paces its attempts); an
    // interactive request gets its workflow's attempts, or the config's.
    let max_attempts = if job_run.is_some() || bypass {
        1
    } else if own_lane {
        workflow.interactive.max_attempts
    } else {
        st.config.max_attempts
    };
    let admitted = match routing::admit(&candidates, tokens, &[], capacity_wait, life.wait_guard()).await {
        Ok(a) => {
            route.on_wait(&st, a.waited.unwrap_or_default());
            a
        }
        Err(e) => {
            // G1: a request refused for capacity (after waiting, or at once because the
            // queue was full or no slot could free in time) would have waited at least its
            // whole allowance: that is its sample, so a full queue raises the P95.
            if matches!(
                e,
                GatewayError::CapacityBusy { .. } | GatewayError::CapacityQueueFull { .. }
            ) {
                route.on_wait(&st, capacity_wait);
            }
            // G1: every channel cooling down after failures is the route failing, though no
            // attempt was made: it counts as one (a probe finding no channel is given back,
            // to try again when one returns).
            if matches!(e, GatewayError::ChannelsCoolingDown { .. }) {
                let mut probe = probe;
                let outcome = if probe.is_some() {
                    Outcome::Neutral
                } else {
                    Outcome::ProviderFailure
                };
                route.on_attempt(&st, outcome, Duration::ZERO, probe.as_mut());
            }
            return life.close(End::refused(e)).await;
        }
    };
    // G2: the breaker may have opened while this request waited for capacity.
    if probe.is_none()
        && !bypass
        && let Some(retry_after) = route.retry_after()
    {
        let e = GatewayError::BreakerOpen {
            route: route.name.clone(),
            reason: "it opened while this request waited for capacity".into(),
            retry_after_s: crate::error::retry_after_secs(retry_after),
        };
        return life.close(End::refused(e)).await;
    }
    // M2: an OpenAI chat stream reports usage only when asked: the gateway asks, and
    // takes the extra chunk out again, so the client sees the stream it asked for.
    let mut body = bytes;
    let mut strip_usage = false;
    if format == Format::OpenAi
        && api == Api::Generate
        && parsed.stream
        && !parsed.include_usage
        && let Some(b) = spillway_wire::request::with_stream_usage(&body)
    {
        body = Bytes::from(b);
        strip_usage = true;
    }
    let client_gone = tokio_util::sync::CancellationToken::new();
    let mut ctx = Ctx {
        format,
        api,
        uri: parts.uri,
        headers: parts.headers,
        body,
        strip_usage,
        capacity_wait_left: capacity_wait.saturating_sub(admitted.waited.unwrap_or_default()),
        parsed,
        trace,
        candidates,
        tokens,
        deadline,
        client_gone: client_gone.clone(),
        route,
        probe,
        gate: gate_slot,
        recovery_probe: bypass,
        conversation,
        max_attempts,
        workflow,
        attempt_timeout: job_run.as_ref().map(|j| j.deadline),
    };
    // Dropped when the client hangs up (or when the answer is sent, when it no longer matters).
    let _hang_up = HangUp(client_gone);

    // A client hanging up mid-call must not cut the request short halfway: the provider's
    // answer is still read, metered and recorded. So the attempts run detached from the
    // client's connection (see `Detach`). A shutdown past its drain deadline cuts them,
    // and the record says how.
    Detach::new(async move {
        let cancel = life.st().shutdown.cancel.clone();
        let end = tokio::select! {
            biased;
            _ = cancel.cancelled() => End::Cancelled,
            end = failover::run(&mut ctx, &mut life, &*caller, admitted) => end,
        };
        life.close(end).await
    })
    .await
}

/// Runs a future in place, in the request's own task; if that task is dropped before the
/// future is done (the client hung up, and its connection's task went with it), what is
/// left of the future moves to a task of its own and runs to its end.
///
/// The common path spawns nothing. A task spawned per request (what this replaced) woke
/// the runtime's other worker thread for every request, and the hand-back woke this one:
/// about a third of the gateway's context switches at 500 req/s.
struct Detach<T: Send + 'static>(Option<std::pin::Pin<Box<dyn Future<Output = T> + Send>>>);

impl<T: Send + 'static> Detach<T> {
    fn new(fut: impl Future<Output = T> + Send + 'static) -> Detach<T> {
        Detach(Some(Box::pin(fut)))
    }
}

impl<T: Send + 'static> Future for Detach<T> {
    type Output = T;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        // Out of `self` while it runs: a future that panics mid-poll is dropped as the
        // panic unwinds, and never handed on to be polled again.
        let Some(mut fut) = self.0.take() else {
            panic!("Detach polled after it completed");
        };
        let poll = fut.as_mut().poll(cx);
        if poll.is_pending() {
            self.0 = Some(fut);
        }
        poll
    }
}

impl<T: Send + 'static> Drop for Detach<T> {
    fn drop(&mut self) {
        if let (Some(fut), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(fut);
        }
    }
}

/// Tells the attempt loop that nobody is waiting for the answer any more.
struct HangUp(tokio_util::sync::CancellationToken);

impl Drop for HangUp {
    fn drop(&mut self) {
        self.0.cancel();
    }
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

    #[test]
    fn every_recorded_endpoint_is_in_the_table_with_its_api() {
        // spec: I1
        let cases = [
            (Format::OpenAi, Api::Generate, "/v1/chat/completions", false),
            (Format::OpenAi, Api::Responses, "/v1/responses", true),
            (Format::OpenAi, Api::Embeddings, "/v1/embeddings", false),
            (Format::Anthropic, Api::Generate, "/v1/messages", true),
            (Format::Anthropic, Api::CountTokens, "/v1/messages/count_tokens", false),
            (Format::Gemini, Api::Generate, "/v1beta/models/m:generateContent", false),
            (
                Format::Gemini,
                Api::Generate,
                "/v1/models/m:streamGenerateContent",
                true,
            ),
            (Format::Gemini, Api::Embeddings, "/v1beta/models/m:embedContent", false),
            (
                Format::Gemini,
                Api::Embeddings,
                "/v1/models/m:batchEmbedContents",
                false,
            ),
            (Format::Gemini, Api::CountTokens, "/v1/models/m:countTokens", false),
        ];
        for (format, api, path, stream) in cases {
            let e = endpoint(format, api, path, stream);
            let listed = spillway_wire::request::ENDPOINTS.iter().find(|(x, _)| *x == e);
            assert_eq!(listed.map(|(_, a)| *a), Some(api), "{e}");
            assert_eq!(e.starts_with("/v1beta/"), path.starts_with("/v1beta/"), "{path} -> {e}");
            if format == Format::Gemini {
                assert!(e.ends_with(path.rsplit_once(':').unwrap().1), "{path} -> {e}");
            }
        }
    }

    #[test]
    fn a5_only_json_bodies() {
        // spec: A5
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        for (v, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/x-www-form-urlencoded", false),
            ("text/plain", false),
            ("application/jsonp", false),
        ] {
            h.insert("content-type", v.parse().unwrap());
            assert_eq!(is_json(&h), ok, "{v}");
        }
    }

    #[tokio::test]
    async fn detach_runs_in_place_and_finishes_what_a_hang_up_leaves() {
        use std::sync::atomic::{AtomicU32, Ordering};
        // The common path: the future runs to its end in the caller's task.
        assert_eq!(Detach::new(async { 7 }).await, 7);
        // The caller's task goes away mid-way (a client hanging up): the rest still runs.
        let done = std::sync::Arc::new(AtomicU32::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let d = done.clone();
        let caller = tokio::spawn(Detach::new(async move {
            let _ = rx.await;
            d.store(1, Ordering::SeqCst);
        }));
        tokio::task::yield_now().await;
        caller.abort();
        let _ = caller.await;
        assert_eq!(done.load(Ordering::SeqCst), 0);
        tx.send(()).unwrap();
        for _ in 0..100 {
            if done.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(done.load(Ordering::SeqCst), 1, "finished in a task of its own");
        // A future that panicked is dropped, not polled again in a new task.
        let polls = std::sync::Arc::new(AtomicU32::new(0));
        let p = polls.clone();
        let panicky = tokio::spawn(Detach::new(std::future::poll_fn(move |_| -> std::task::Poll<()> {
            p.fetch_add(1, Ordering::SeqCst);
            panic!("a test asked the future to panic")
        })));
        assert!(panicky.await.unwrap_err().is_panic());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(polls.load(Ordering::SeqCst), 1);
    }
}
