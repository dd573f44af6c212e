//! The simulator's HTTP server: channel prefixes, the control API, faults.

use crate::behavior::ChannelStats;
use crate::responses;
use axum::body::Body;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use spillway_policy::sim::{Behavior, ErrorFlavor, Fault, Scenario};
use spillway_wire::{Api, Format};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// How long a `hang` without `ms` holds a call: longer than any gateway timeout, bounded
/// so a forgotten simulator does not hold sockets forever.
const HANG_FOREVER: Duration = Duration::from_secs(600);

const RECORDED_HEADERS: &[&str] = &[
    "traceparent",
    "tracestate",
    "authorization",
    "x-api-key",
    "x-goog-api-key",
    "anthropic-version",
    "anthropic-beta",
];

#[derive(Default)]
struct ChannelState {
    behavior: Behavior,
    /// Calls already served by `behavior.script[0]`.
    used_of_step: u32,
    stats: ChannelStats,
    /// Responses API answers this channel (this provider account) stores, by id: only it
    /// can find them again.
    stored: std::collections::HashMap<String, Value>,
}

/// Stored responses kept per channel; the oldest half goes when it is full.
const STORED_MAX: usize = 10_000;

impl ChannelState {
    fn store(&mut self, id: String, response: Value) {
        if self.stored.len() >= STORED_MAX {
            let drop: Vec<String> = self.stored.keys().take(STORED_MAX / 2).cloned().collect();
            for k in drop {
                self.stored.remove(&k);
            }
        }
        self.stored.insert(id, response);
    }

    fn next_fault(&mut self) -> Fault {
        if let Some(step) = self.behavior.script.first().cloned() {
            self.used_of_step += 1;
            if self.used_of_step >= step.times {
                self.behavior.script.remove(0);
                self.used_of_step = 0;
            }
            return step.fault;
        }
        if !self.behavior.random_faults.is_empty() {
            // One draw per call; the faults' shares stack, the rest of the range is `fault`.
            let mut draw: f64 = rand::random();
            for r in &self.behavior.random_faults {
                if draw < r.probability {
                    return r.fault.clone();
                }
                draw -= r.probability;
            }
        }
        self.behavior.fault.clone().unwrap_or(Fault::Ok)
    }
}

#[derive(Default)]
struct SimState {
    channels: Mutex<BTreeMap<String, ChannelState>>,
}

impl SimState {
    fn with<R>(&self, name: &str, f: impl FnOnce(&mut ChannelState) -> R) -> R {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        f(map.entry(name.to_owned()).or_default())
    }
}

/// A running simulator.
pub struct SimHandle {
    pub addr: SocketAddr,
    state: Arc<SimState>,
    task: JoinHandle<()>,
}

impl SimHandle {
    /// Base URL of the server (the `default` channel).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Base URL of one channel: configure it as a gateway channel's `base_url`.
    pub fn channel_url(&self, channel: &str) -> String {
        format!("http://{}/{channel}", self.addr)
    }

    pub fn set_behavior(&self, channel: &str, behavior: Behavior) {
        self.state.with(channel, |c| {
            c.behavior = behavior;
            c.used_of_step = 0;
        });
    }

    pub fn stats(&self, channel: &str) -> ChannelStats {
        self.state.with(channel, |c| c.stats.clone())
    }

    pub fn shutdown(&self) {
        self.task.abort();
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a simulator on `listen` (port 0 picks a free port) with `scenario`.
pub async fn start(listen: SocketAddr, scenario: Scenario) -> crate::Result<SimHandle> {
    let listener = TcpListener::bind(listen).await.map_err(|source| crate::Error::Listen {
        addr: listen.to_string(),
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| crate::Error::Listen {
        addr: listen.to_string(),
        source,
    })?;
    let state = Arc::new(SimState::default());
    for (name, b) in scenario.channels {
        state.with(&name, |c| c.behavior = b);
    }
    let st = state.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            let st = st.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(SimHandle { addr, state, task })
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(v.to_string()))
        .unwrap_or_default()
}

/// Keeps `in_flight` honest however the call ends, including a client that goes away
/// mid-stream.
struct InFlight {
    state: Arc<SimState>,
    channel: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.with(&self.channel, |c| {
            c.stats.in_flight = c.stats.in_flight.saturating_sub(1)
        });
    }
}

enum Endpoint {
    Generate {
        format: Format,
        api: Api,
        model: Option<String>,
        stream_from_path: bool,
        gemini_sse: bool,
    },
    ListModels,
    /// A follow-up to a stored Responses answer: `GET`/`DELETE /v1/responses/{id}`,
    /// `GET .../input_items`, `POST .../cancel`.
    Stored {
        id: String,
        action: Option<String>,
    },
}

fn endpoint(method: &Method, rest: &str, query: &str) -> Option<Endpoint> {
    if method == Method::GET && rest == "/v1/models" {
        return Some(Endpoint::ListModels);
    }
    if let Some(tail) = rest.strip_prefix("/v1/responses/") {
        let (id, action) = match tail.split_once('/') {
            Some((id, a)) => (id, Some(a.to_owned())),
            None => (tail, None),
        };
        let allowed = match action.as_deref() {
            None => method == Method::GET || method == Method::DELETE,
            Some("input_items") => method == Method::GET,
            Some("cancel") => method == Method::POST,
            Some(_) => false,
        };
        return allowed.then(|| Endpoint::Stored {
            id: id.to_owned(),
            action,
        });
    }
    if method != Method::POST {
        return None;
    }
    let fixed = |format, api| {
        Some(Endpoint::Generate {
            format,
            api,
            model: None,
            stream_from_path: false,
            gemini_sse: false,
        })
    };
    match rest {
        "/v1/chat/completions" => fixed(Format::OpenAi, Api::Generate),
        "/v1/responses" => fixed(Format::OpenAi, Api::Responses),
        "/v1/embeddings" => fixed(Format::OpenAi, Api::Embeddings),
        "/v1/messages" => fixed(Format::Anthropic, Api::Generate),
        "/v1/messages/count_tokens" => fixed(Format::Anthropic, Api::CountTokens),
        _ => {
            let tail = rest
                .strip_prefix("/v1beta/models/")
                .or_else(|| rest.strip_prefix("/v1/models/"))?;
            let (model, action) = tail.rsplit_once(':')?;
            let (api, stream) = spillway_wire::request::gemini_action(action)?;
            Some(Endpoint::Generate {
                format: Format::Gemini,
                api,
                model: Some(model.to_owned()),
                stream_from_path: stream,
                gemini_sse: query.split('&').any(|kv| kv == "alt=sse"),
            })
        }
    }
}

/// A follow-up to a stored response: found only on the channel that stored it.
fn stored(state: &SimState, channel: &str, method: &Method, id: &str, action: Option<&str>) -> Response<Body> {
    let found = state.with(channel, |c| {
        if *method == Method::DELETE {
            c.stored.remove(id)
        } else {
            c.stored.get(id).cloned()
        }
    });
    let Some(response) = found else {
        return json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": {"message": format!("Response with id '{id}' not found."),
                "type": "invalid_request_error", "param": null, "code": null}}),
        );
    };
    let body = match (method.as_str(), action) {
        ("DELETE", _) => json!({"id": id, "object": "response", "deleted": true}),
        (_, Some("input_items")) => {
            json!({"object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false})
        }
        (_, Some(_)) => {
            let mut r = response;
            r["status"] = json!("cancelled");
            r
        }
        _ => response,
    };
    json_response(StatusCode::OK, &body)
}

/// The Host a request names (HTTP/2 authority or the Host header), if any.
fn host_of(req: &Request<Incoming>) -> Option<&str> {
    req.uri()
        .authority()
        .map(|a| a.as_str())
        .or_else(|| req.headers().get(header::HOST).and_then(|h| h.to_str().ok()))
}

async fn handle(state: Arc<SimState>, req: Request<Incoming>) -> Result<Response<Body>, std::io::Error> {
    if let Some(host) = host_of(&req)
        && !spillway_policy::is_loopback_host(&spillway_policy::host_name(host))
    {
        return Ok(json_response(
            StatusCode::FORBIDDEN,
            &json!({"error": {"message": "the simulator answers loopback host names only"}}),
        ));
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or_default().to_owned();
    if let Some(ctl) = path.strip_prefix("/_control") {
        return Ok(control(&state, req.method().clone(), ctl.to_owned(), req.into_body()).await);
    }
    let (channel, rest) = {
        let trimmed = path.trim_start_matches('/');
        let first = trimmed.split('/').next().unwrap_or_default();
        if first == "v1" || first == "v1beta" {
            ("default".to_owned(), path.clone())
        } else {
            (
                first.to_owned(),
                format!("/{}", trimmed.split_once('/').map(|(_, r)| r).unwrap_or_default()),
            )
        }
    };
    let seen_path = if query.is_empty() {
        rest.clone()
    } else {
        format!("{rest}?{query}")
    };
    let seen_headers: BTreeMap<String, String> = RECORDED_HEADERS
        .iter()
        .filter_map(|h| Some((h.to_string(), req.headers().get(*h)?.to_str().ok()?.to_owned())))
        .collect();
    let method = req.method().clone();
    let Some(ep) = endpoint(req.method(), &rest, &query) else {
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": {"message": format!("simulator has no endpoint {} {rest}", req.method())}}),
        ));
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Err(std::io::Error::other(e)),
    };
    let (behavior, fault) = state.with(&channel, |c| {
        c.stats.calls += 1;
        c.stats.last_path = Some(seen_path);
        c.stats.last_headers = seen_headers;
        c.stats.in_flight += 1;
        c.stats.max_in_flight = c.stats.max_in_flight.max(c.stats.in_flight);
        let f = c.next_fault();
        if f != Fault::Ok {
            c.stats.faults += 1;
        }
        (c.behavior.clone(), f)
    });
    let guard = InFlight {
        state: state.clone(),
        channel: channel.clone(),
    };

    if let Endpoint::Stored { id, action } = &ep {
        drop(guard);
        return Ok(stored(&state, &channel, &method, id, action.as_deref()));
    }
    let Endpoint::Generate {
        format,
        api,
        model,
        stream_from_path,
        gemini_sse,
    } = ep
    else {
        drop(guard);
        return Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": []})));
    };

    if fault == Fault::Refuse {
        // Returning an error makes hyper drop the connection without a response.
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "simulated refusal",
        ));
    }
    if behavior.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(behavior.latency_ms)).await;
    }
    if fault == Fault::DropAfterCompletion {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "simulated drop after completion",
        ));
    }
    if let Fault::Hang { ms } = fault {
        tokio::time::sleep(ms.map(Duration::from_millis).unwrap_or(HANG_FOREVER)).await;
    }

    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let model = model
        .or_else(|| parsed.get("model").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_default();
    let stream = stream_from_path || parsed.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = format != Format::OpenAi
        || parsed
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    // What the provider counts: OpenAI's tokenizer (o200k) is public, so the simulated
    // OpenAI counts as OpenAI does; Anthropic's and Google's are not, and their stand-ins
    // count by characters of the text they would tokenize, at those providers' published
    // rules of thumb (about 3.5 characters a token for Claude, 4 for Gemini), plus a few
    // tokens of framing per message: a different method from the gateway's estimate, so
    // its error shows.
    let prompt_tokens = match format {
        Format::OpenAi => openai_count(api, &body),
        Format::Anthropic => stand_in_count(&parsed, 3.5),
        Format::Gemini => stand_in_count(&parsed, 4.0),
    }
    .max(1);

    let mut builder = Response::builder().header(format.upstream_request_id_header(), responses::id("req_"));
    if let Some(r) = &behavior.ratelimit {
        for (k, v) in responses::ratelimit_headers(format, r) {
            builder = builder.header(k, v);
        }
    }

    match fault {
        Fault::Status {
            status,
            error,
            retry_after_s,
            retry_after_date_s,
            retry_delay,
            message,
        } => {
            let flavor = error.unwrap_or_else(|| ErrorFlavor::for_status(status));
            let msg = message.unwrap_or_else(|| format!("simulated {status} from channel {channel}"));
            let v = responses::error(format, status, flavor, &msg, retry_delay.as_deref());
            if let Some(s) = retry_after_s {
                builder = builder.header(header::RETRY_AFTER, s.to_string());
            }
            if let Some(s) = retry_after_date_s {
                builder = builder.header(
                    header::RETRY_AFTER,
                    httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(s)),
                );
            }
            drop(guard);
            return Ok(builder
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(v.to_string()))
                .unwrap_or_default());
        }
        Fault::Redirect { location, status } => {
            drop(guard);
            return Ok(builder
                .status(StatusCode::from_u16(status.unwrap_or(307)).unwrap_or(StatusCode::TEMPORARY_REDIRECT))
                .header(header::LOCATION, location)
                .body(Body::empty())
                .unwrap_or_default());
        }
        Fault::MalformedBody => {
            drop(guard);
            return Ok(builder
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from("{\"id\": \"chatcmpl-trunc"))
                .unwrap_or_default());
        }
        _ => {}
    }

    let n = behavior.output_tokens;
    let rid = responses::id("resp_");
    if !matches!(api, Api::Generate | Api::Responses) {
        drop(guard);
        let v = responses::plain(format, api, &model, prompt_tokens, &parsed);
        return Ok(builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(v.to_string()))
            .unwrap_or_default());
    }
    if !stream {
        drop(guard);
        let v = if api == Api::Responses {
            let v = responses::responses_body(&model, prompt_tokens, n, &rid);
            state.with(&channel, |c| c.store(rid.clone(), v.clone()));
            v
        } else {
            responses::body(format, &model, prompt_tokens, n)
        };
        return Ok(builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(v.to_string()))
            .unwrap_or_default());
    }

    let plan = if api == Api::Responses {
        if !matches!(fault, Fault::CutBeforeFirstToken | Fault::CutAfterFirstToken { .. }) {
            let whole = responses::responses_body(&model, prompt_tokens, n, &rid);
            state.with(&channel, |c| c.store(rid.clone(), whole));
        }
        responses::responses_stream(&model, prompt_tokens, n, &rid)
    } else {
        responses::stream(format, &model, prompt_tokens, n, include_usage)
    };
    if format == Format::Gemini && !gemini_sse {
        // Without alt=sse Gemini streams one JSON array.
        drop(guard);
        let items: Vec<Value> = plan
            .tokens
            .iter()
            .filter_map(|e| serde_json::from_str(e.trim().trim_start_matches("data: ")).ok())
            .collect();
        return Ok(builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(Value::Array(items).to_string()))
            .unwrap_or_default());
    }
    let gap = behavior
        .tokens_per_second
        .filter(|t| *t > 0.0)
        .map(|t| Duration::from_secs_f64(1.0 / t));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let _guard = guard;
        let cut = match fault {
            Fault::CutBeforeFirstToken => Some(0),
            Fault::CutAfterFirstToken { after_tokens } => Some(after_tokens.max(1) as usize),
            _ => None,
        };
        for e in plan.head {
            if tx.send(Ok(Bytes::from(e))).await.is_err() {
                return;
            }
        }
        for (i, e) in plan.tokens.into_iter().enumerate() {
            if cut == Some(i) {
                return cut_stream(&tx).await;
            }
            if let Some(g) = gap {
                tokio::time::sleep(g).await;
            }
            if tx.send(Ok(Bytes::from(e))).await.is_err() {
                return;
            }
        }
        if cut.is_some() {
            return cut_stream(&tx).await;
        }
        for e in plan.tail {
            if tx.send(Ok(Bytes::from(e))).await.is_err() {
                return;
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok(builder
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_default())
}

/// Breaks the stream off mid-body, as a dropped connection would.
async fn cut_stream(tx: &tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) {
    // Let hyper flush what was sent: an error in the same poll would abort the connection
    // with the earlier chunks still in its write buffer.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let _ = tx
        .send(Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "simulated cut",
        )))
        .await;
}

async fn control(state: &SimState, method: Method, path: String, body: Incoming) -> Response<Body> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    let view = |c: &ChannelState| json!({"behavior": c.behavior, "stats": c.stats});
    match (method.clone(), parts.as_slice()) {
        (Method::GET, ["channels"]) => {
            let map = state.channels.lock().unwrap_or_else(|p| p.into_inner());
            let all: serde_json::Map<String, Value> = map.iter().map(|(k, c)| (k.clone(), view(c))).collect();
            json_response(StatusCode::OK, &Value::Object(all))
        }
        (Method::GET, ["channels", name]) => json_response(StatusCode::OK, &state.with(name, |c| view(c))),
        (Method::PUT, ["channels", name]) => {
            let bytes = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return json_response(StatusCode::BAD_REQUEST, &json!({"error": e.to_string()})),
            };
            match serde_json::from_slice::<Behavior>(&bytes) {
                Ok(b) => json_response(
                    StatusCode::OK,
                    &state.with(name, |c| {
                        c.behavior = b;
                        c.used_of_step = 0;
                        view(c)
                    }),
                ),
                Err(e) => json_response(
                    StatusCode::BAD_REQUEST,
                    &json!({"error": format!("invalid behavior: {e}")}),
                ),
            }
        }
        (Method::POST, ["channels", name, "reset-stats"]) => json_response(
            StatusCode::OK,
            &state.with(name, |c| {
                c.stats = ChannelStats {
                    in_flight: c.stats.in_flight,
                    ..Default::default()
                };
                view(c)
            }),
        ),
        (Method::DELETE, ["channels", name]) => {
            state.channels.lock().unwrap_or_else(|p| p.into_inner()).remove(*name);
            json_response(StatusCode::OK, &json!({"deleted": name}))
        }
        _ => json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": format!("no control endpoint {method} /_control{path}")}),
        ),
    }
}

/// A provider's prompt count without its tokenizer: the characters of every string the
/// provider would read (not model names, roles or types) at `chars_per_token`, plus 3
/// tokens for each message or content entry.
fn stand_in_count(v: &Value, chars_per_token: f64) -> u64 {
    fn walk(v: &Value, key: &str, depth: u32, chars: &mut usize, entries: &mut u64) {
        if depth > 64 {
            return;
        }
        match v {
            Value::String(s) if !matches!(key, "model" | "role" | "type" | "mime_type" | "mimeType") => {
                *chars += s.chars().count();
            }
            Value::Array(items) => {
                if matches!(key, "messages" | "contents") {
                    *entries += items.len() as u64;
                }
                for i in items {
                    walk(i, key, depth + 1, chars, entries);
                }
            }
            Value::Object(m) => {
                for (k, v) in m {
                    walk(v, k, depth + 1, chars, entries);
                }
            }
            _ => {}
        }
    }
    let (mut chars, mut entries) = (0usize, 0u64);
    walk(v, "", 0, &mut chars, &mut entries);
    (chars as f64 / chars_per_token).ceil() as u64 + 3 * entries
}

/// OpenAI's count of a prompt, remembered for the bodies seen last: the simulator shares
/// the machine with the gateway it stands in front of, and load tests send one body
/// thousands of times a second.
fn openai_count(api: Api, body: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    static SEEN: std::sync::Mutex<Option<std::collections::HashMap<u64, u64>>> = std::sync::Mutex::new(None);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (api.as_str(), body).hash(&mut h);
    let key = h.finish();
    if let Some(n) = SEEN
        .lock()
        .ok()
        .and_then(|m| m.as_ref().and_then(|m| m.get(&key).copied()))
    {
        return n;
    }
    spillway_wire::tokens::o200k_blocking();
    let n = spillway_wire::tokens::estimate_input_tokens(Format::OpenAi, api, body);
    if let Ok(mut m) = SEEN.lock() {
        let m = m.get_or_insert_with(Default::default);
        if m.len() >= 1024 {
            m.clear();
        }
        m.insert(key, n);
    }
    n
}
