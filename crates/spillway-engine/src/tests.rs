//! The request path driven directly: the attempt loop and the stream observer on tokio's
//! paused clock with scripted upstream outcomes (so every delay is exact), and the whole
//! server on loopback for what only a real socket shows (panics, a ledger that refuses
//! writes, shutdown).

use crate::clock;
use crate::control::{Admit, Outcome};
use crate::failover::{self, Attempt, Caller, Ctx};
use crate::life::{End, Life};
use crate::routing::{self, Admitted};
use crate::state::{AppState, Severity};
use crate::stream::{ByteStream, Primed, StreamBody};
use crate::trace::TraceContext;
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode};
use spillway_ledger::{
    AttemptRecord, Decision, FailureClass, GatewayClass, Ledger, LedgerBackend, Page, RequestRecord, RequestState,
    Search, StopReason,
};
use spillway_policy::Config;
use spillway_wire::{ErrorClass, Format, ParsedRequest, Signal, UnixMs, Usage};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const KEY: &str = "sk-engine-test-0123456789";

/// A config with `channels` (name, max concurrency) serving model `m` in the OpenAI
/// format, tried in the order given (each a priority tier of its own).
fn config(extra: &str, channels: &[(&str, u32)]) -> Config {
    config_tiers(extra, channels, true)
}

/// The same with every channel in one tier, so that weights and health decide (D4).
fn config_even(extra: &str, channels: &[(&str, u32)]) -> Config {
    config_tiers(extra, channels, false)
}

fn config_tiers(extra: &str, channels: &[(&str, u32)], ordered: bool) -> Config {
    let mut y = format!("listen: 127.0.0.1:0\n{extra}\nchannels:\n");
    for (i, (name, cap)) in channels.iter().enumerate() {
        y += &format!(
            "  - {{name: {name}, format: openai, base_url: 'http://127.0.0.1:9/{name}', models: [m], max_concurrency: {cap}, priority: {}}}\n",
            if ordered { channels.len() - i } else { 0 }
        );
    }
    y += "keys:\n  - {name: app, owner: team, secret_env: KEY, max_concurrency: 1}\nowners:\n  - {name: team}\n";
    Config::parse(
        Path::new("test.yaml"),
        &y,
        &|k| (k == "KEY").then(|| KEY.into()),
        &|| unreachable!(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A store in memory that keeps every write, in order: the loop's records can be read
/// back without real I/O, which would let the paused clock jump while it waits.
#[derive(Default)]
struct Memory {
    writes: Mutex<Vec<RequestRecord>>,
    attempts: Mutex<Vec<AttemptRecord>>,
    refuse: AtomicBool,
    control: Mutex<Vec<spillway_ledger::ControlState>>,
    audit: Mutex<Vec<spillway_ledger::AuditEntry>>,
    jobs: Mutex<Vec<spillway_ledger::JobRecord>>,
}

#[async_trait]
impl LedgerBackend for Memory {
    async fn write_batch(
        &self,
        r: &[RequestRecord],
        a: &[AttemptRecord],
        _: &[spillway_ledger::Payload],
    ) -> spillway_ledger::Result<()> {
        if self.refuse.load(Ordering::SeqCst) {
            return Err(spillway_ledger::Error::Unavailable("database or disk is full".into()));
        }
        self.writes.lock().unwrap().extend_from_slice(r);
        self.attempts.lock().unwrap().extend_from_slice(a);
        Ok(())
    }
    async fn get_request(&self, id: &str) -> spillway_ledger::Result<Option<RequestRecord>> {
        Ok(self.writes.lock().unwrap().iter().rev().find(|r| r.id == id).cloned())
    }
    async fn attempts(&self, id: &str) -> spillway_ledger::Result<Vec<AttemptRecord>> {
        let mut v: Vec<AttemptRecord> = Vec::new();
        for a in self.attempts.lock().unwrap().iter().filter(|a| a.request_id == id) {
            v.retain(|x| x.attempt_no != a.attempt_no);
            v.push(a.clone());
        }
        v.sort_by_key(|a| a.attempt_no);
        Ok(v)
    }
    async fn search(&self, _: &Search) -> spillway_ledger::Result<Page> {
        Ok(Page {
            items: vec![],
            next: None,
        })
    }
    async fn mark_interrupted_unknown(&self) -> spillway_ledger::Result<u64> {
        Ok(0)
    }
    // The idempotency ledger's behaviour is tested over the real SQLite store; this one
    // only keeps the request path's writes.
    async fn by_response_id(&self, _: &str, _: &str) -> spillway_ledger::Result<Option<RequestRecord>> {
        Ok(None)
    }
    async fn keyed(
        &self,
        _: &str,
        _: &str,
        _: UnixMs,
        _: UnixMs,
    ) -> spillway_ledger::Result<Option<spillway_ledger::KeyedRequest>> {
        Ok(None)
    }
    async fn reconcile(
        &self,
        _: &str,
        _: &spillway_ledger::Reconcile,
        _: UnixMs,
    ) -> spillway_ledger::Result<RequestRecord> {
        Err(spillway_ledger::Error::NotFound)
    }
    async fn side_effect(
        &self,
        _: &str,
        _: &spillway_ledger::SideEffect,
        _: UnixMs,
    ) -> spillway_ledger::Result<RequestRecord> {
        Err(spillway_ledger::Error::NotFound)
    }
    async fn unknowns(&self, _: u32) -> spillway_ledger::Result<Vec<RequestRecord>> {
        Ok(vec![])
    }
    async fn figures(&self, _: UnixMs) -> spillway_ledger::Result<spillway_ledger::LedgerFigures> {
        Ok(Default::default())
    }
    async fn prune(
        &self,
        _: UnixMs,
        _: Option<UnixMs>,
        _: UnixMs,
        _: bool,
    ) -> spillway_ledger::Result<spillway_ledger::PruneReport> {
        Ok(Default::default())
    }
    async fn maintain(&self) -> spillway_ledger::Result<u64> {
        Ok(0)
    }
    async fn save_jobs(
        &self,
        j: &[spillway_ledger::JobRecord],
        a: &[spillway_ledger::AuditEntry],
    ) -> spillway_ledger::Result<()> {
        let mut jobs = self.jobs.lock().unwrap();
        for j in j {
            jobs.retain(|x| x.id != j.id);
            jobs.push(j.clone());
        }
        self.audit.lock().unwrap().extend(a.iter().cloned());
        Ok(())
    }
    async fn job(&self, id: &str) -> spillway_ledger::Result<Option<spillway_ledger::JobRecord>> {
        Ok(self.jobs.lock().unwrap().iter().find(|j| j.id == id).cloned())
    }
    async fn job_by_key(&self, k: &str, i: &str) -> spillway_ledger::Result<Option<spillway_ledger::JobRecord>> {
        let jobs = self.jobs.lock().unwrap();
        Ok(jobs
            .iter()
            .rev()
            .find(|j| j.key_name == k && j.idempotency_key == i)
            .cloned())
    }
    async fn open_jobs(&self) -> spillway_ledger::Result<Vec<spillway_ledger::JobRecord>> {
        let open = ["queued", "running", "owner_review", "dead_letter"];
        Ok(self
            .jobs
            .lock()
            .unwrap()
            .iter()
            .filter(|j| open.contains(&j.state.as_str()))
            .cloned()
            .collect())
    }
    async fn recent_jobs(&self, _: u32) -> spillway_ledger::Result<Vec<spillway_ledger::JobRecord>> {
        Ok(self.jobs.lock().unwrap().clone())
    }
    async fn job_requests(&self, id: &str) -> spillway_ledger::Result<Vec<RequestRecord>> {
        let w = self.writes.lock().unwrap();
        Ok(w.iter().filter(|r| r.job_id.as_deref() == Some(id)).cloned().collect())
    }
    async fn save_policy_version(&self, _: &spillway_ledger::PolicyVersion) -> spillway_ledger::Result<bool> {
        Ok(true)
    }
    async fn policy_versions(&self, _: Option<&str>) -> spillway_ledger::Result<Vec<spillway_ledger::PolicyVersion>> {
        Ok(Vec::new())
    }
    async fn accounts(&self) -> spillway_ledger::Result<spillway_ledger::Accounts> {
        Ok(Default::default())
    }
    async fn seed_owners(&self, _: &[(String, f64)], _: UnixMs) -> spillway_ledger::Result<Vec<String>> {
        Ok(Vec::new())
    }
    async fn credit(
        &self,
        _: &spillway_ledger::BalanceEntry,
        _: &spillway_ledger::AuditEntry,
    ) -> spillway_ledger::Result<()> {
        Ok(())
    }
    async fn create_key(
        &self,
        _: &spillway_ledger::StoredKey,
        _: Option<f64>,
        _: &spillway_ledger::AuditEntry,
    ) -> spillway_ledger::Result<()> {
        Ok(())
    }
    async fn revoke_key(
        &self,
        _: &str,
        _: UnixMs,
        _: &str,
        _: &spillway_ledger::AuditEntry,
    ) -> spillway_ledger::Result<()> {
        Ok(())
    }
    async fn set_spend_limit(
        &self,
        _: &str,
        _: Option<f64>,
        _: UnixMs,
        _: &str,
        _: &spillway_ledger::AuditEntry,
    ) -> spillway_ledger::Result<()> {
        Ok(())
    }
    async fn spend_since(&self, _: UnixMs) -> spillway_ledger::Result<Vec<spillway_ledger::SpendRow>> {
        Ok(Vec::new())
    }
    async fn cost_report(&self, _: UnixMs, _: i64) -> spillway_ledger::Result<Vec<spillway_ledger::CostCell>> {
        Ok(Vec::new())
    }
    async fn record_transition(
        &self,
        s: Option<&spillway_ledger::ControlState>,
        a: &spillway_ledger::AuditEntry,
    ) -> spillway_ledger::Result<()> {
        if let Some(s) = s {
            let mut c = self.control.lock().unwrap();
            c.retain(|x| (&x.kind, &x.subject) != (&s.kind, &s.subject));
            c.push(s.clone());
        }
        let mut audit = self.audit.lock().unwrap();
        let id = audit.len() as i64 + 1;
        audit.push(spillway_ledger::AuditEntry { id, ..a.clone() });
        Ok(())
    }
    async fn control_states(&self) -> spillway_ledger::Result<Vec<spillway_ledger::ControlState>> {
        Ok(self.control.lock().unwrap().clone())
    }
    async fn audit(
        &self,
        kind: Option<&str>,
        subject: Option<&str>,
        limit: u32,
    ) -> spillway_ledger::Result<Vec<spillway_ledger::AuditEntry>> {
        let a = self.audit.lock().unwrap();
        Ok(a.iter()
            .rev()
            .filter(|e| kind.is_none_or(|k| e.kind == k) && subject.is_none_or(|s| e.subject == s))
            .take(limit as usize)
            .cloned()
            .collect())
    }
}

impl Memory {
    fn states(&self, id: &str) -> Vec<RequestState> {
        self.writes
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.id == id)
            .map(|r| r.state)
            .collect()
    }
}

fn state_with(cfg: Config) -> (Arc<AppState>, Arc<Memory>) {
    let mem = Arc::new(Memory::default());
    let ledger = Ledger::start(mem.clone());
    (Arc::new(AppState::new(cfg, ledger).unwrap()), mem)
}

/// One scripted upstream outcome.
#[derive(Clone)]
enum Step {
    Fail {
        status: u16,
        class: ErrorClass,
        hint_ms: Option<u64>,
    },
    Answer,
    /// Answers, reporting this usage.
    AnswerWith(Usage),
    /// Answers after this long.
    AnswerAfter(Duration),
    /// Never answers (until the request is cut).
    Hang,
    Panic,
}

fn fail(status: u16, class: ErrorClass, hint_ms: Option<u64>) -> Step {
    Step::Fail { status, class, hint_ms }
}

/// Upstream outcomes per channel, in order; an unscripted call answers.
#[derive(Default)]
struct Scripted {
    steps: Mutex<HashMap<String, VecDeque<Step>>>,
    calls: Mutex<Vec<String>>,
}

impl Scripted {
    fn with(script: &[(&str, Step)]) -> Scripted {
        let s = Scripted::default();
        for (ch, step) in script {
            s.steps
                .lock()
                .unwrap()
                .entry(ch.to_string())
                .or_default()
                .push_back(step.clone());
        }
        s
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

impl Caller for Scripted {
    async fn call(&self, _st: &AppState, _ctx: &Ctx, mut att: AttemptRecord, admitted: Admitted) -> Attempt {
        let name = admitted.channel.cfg.name.clone();
        self.calls.lock().unwrap().push(name.clone());
        let step = self
            .steps
            .lock()
            .unwrap()
            .get_mut(&name)
            .and_then(VecDeque::pop_front)
            .unwrap_or(Step::Answer);
        match step {
            Step::Fail { status, class, hint_ms } => {
                let mut s = Signal::transport(class, format!("HTTP {status}"));
                s.http_status = Some(status);
                s.retry_after_ms = hint_ms;
                crate::upstream::apply_signal(&mut att, &s);
                att.finished_at = Some(clock::now());
                Attempt::Failed { att, signal: s }
            }
            Step::AnswerAfter(d) => {
                tokio::time::sleep(d).await;
                att.http_status = Some(200);
                att.error_class = ErrorClass::Success;
                Attempt::Answer(crate::life::Answer {
                    status: StatusCode::OK,
                    content_type: HeaderValue::from_static("application/json"),
                    body: Bytes::from(format!("{{\"ok\":true,\"n\":{}}}", self.calls.lock().unwrap().len())),
                    usage: Usage::default(),
                    response_id: None,
                    att,
                })
            }
            Step::AnswerWith(usage) => {
                att.http_status = Some(200);
                att.error_class = ErrorClass::Success;
                Attempt::Answer(crate::life::Answer {
                    status: StatusCode::OK,
                    content_type: HeaderValue::from_static("application/json"),
                    body: Bytes::from_static(b"{\"ok\":true}"),
                    usage,
                    response_id: None,
                    att,
                })
            }
            Step::Answer => {
                att.http_status = Some(200);
                att.error_class = ErrorClass::Success;
                Attempt::Answer(crate::life::Answer {
                    status: StatusCode::OK,
                    content_type: HeaderValue::from_static("application/json"),
                    body: Bytes::from_static(b"{\"ok\":true}"),
                    usage: Usage::default(),
                    response_id: None,
                    att,
                })
            }
            Step::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Step::Panic => panic!("a scripted attempt panicked"),
        }
    }
}

fn parsed(model: &str) -> ParsedRequest {
    ParsedRequest {
        model: model.into(),
        stream: false,
        include_usage: false,
        max_output_tokens: None,
        estimated_input_tokens: 1,
        conversation: 7,
        continuation: false,
        previous_response_id: None,
        acts_upstream: false,
    }
}

/// A request for model `m`, admitted and ready for the loop.
async fn request(st: &Arc<AppState>) -> (Life, Ctx, Admitted) {
    let id = crate::trace::request_id();
    let mut rec = RequestRecord::received(
        id.clone(),
        id.replace('-', ""),
        Format::OpenAi,
        "/v1/chat/completions",
        clock::now(),
    );
    rec.requested_model = Some("m".into());
    rec.owner = Some("team".into());
    rec.route = Some("openai/m".into());
    let mut life = Life::new(st.clone(), rec, None);
    life.set_route();
    let candidates = routing::candidates(st, Format::OpenAi, "m", None);
    let route = st.control.route(st, Format::OpenAi, "m");
    let probe = match route.admit(st) {
        Admit::Send(_) => None,
        Admit::Probe(p, _) => Some(p),
        Admit::Refuse { reason, .. } => panic!("refused by the breaker: {reason}"),
        Admit::Held(h) => panic!("held by a recovery run: {}", h.reason),
    };
    life.set_control(route.clone());
    let admitted = routing::admit(&candidates, 1, &[], Duration::from_secs(10), life.wait_guard())
        .await
        .unwrap();
    let ctx = Ctx {
        api: spillway_wire::Api::Generate,
        format: Format::OpenAi,
        uri: "/v1/chat/completions".parse().unwrap(),
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"{}"),
        parsed: parsed("m"),
        trace: TraceContext::from_header(None, &id),
        candidates,
        tokens: 1,
        deadline: Instant::now() + Duration::from_millis(st.config.total_deadline_ms),
        capacity_wait_left: Duration::from_millis(st.config.capacity_wait_ms),
        client_gone: tokio_util::sync::CancellationToken::new(),
        route,
        probe,
        gate: None,
        recovery_probe: false,
        conversation: 7,
        strip_usage: false,
        max_attempts: st.config.max_attempts,
        workflow: st.workflows.default_workflow(),
        attempt_timeout: None,
    };
    (life, ctx, admitted)
}

/// Runs one request through the loop and closes it: its response, how long it took on
/// the paused clock, its id.
async fn drive(st: &Arc<AppState>, caller: &Scripted) -> (http::Response<axum::body::Body>, Duration, String) {
    let (mut life, mut ctx, admitted) = request(st).await;
    let id = life.rec.id.clone();
    let t0 = Instant::now();
    let end = failover::run(&mut ctx, &mut life, caller, admitted).await;
    let resp = life.close(end).await;
    let took = t0.elapsed();
    st.ledger.flush().await.unwrap();
    (resp, took, id)
}

async fn rows(st: &Arc<AppState>, id: &str) -> (RequestRecord, Vec<AttemptRecord>) {
    st.ledger.flush().await.unwrap();
    (
        st.ledger.get_request(id).await.unwrap().unwrap(),
        st.ledger.attempts(id).await.unwrap(),
    )
}

fn decisions(atts: &[AttemptRecord]) -> Vec<(String, ErrorClass, Option<Decision>, Option<u64>)> {
    atts.iter()
        .map(|a| (a.channel.clone(), a.error_class, a.decision, a.delay_ms))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn d1_d2_failover_goes_to_an_untried_channel_at_once() {
    // spec: D1, D2, F2
    let (st, mem) = state_with(config("", &[("a", 4), ("b", 4)]));
    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, None))]);
    let (resp, took, id) = drive(&st, &caller).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-spillway-attempts"], "2");
    assert_eq!(resp.headers()["x-spillway-channel"], "b");
    assert_eq!(took, Duration::ZERO, "no back-off before a ready, untried channel");
    assert_eq!(caller.calls(), ["a", "b"]);
    let (rec, atts) = rows(&st, &id).await;
    assert_eq!((rec.state, rec.attempts), (RequestState::Done, 2));
    assert_eq!(
        decisions(&atts),
        [
            ("a".into(), ErrorClass::Overload, Some(Decision::Failover), Some(0)),
            ("b".into(), ErrorClass::Success, Some(Decision::Done), None),
        ]
    );
    // I3: durable calling_api first (alone in its commit), then forward only.
    let states = mem.states(&id);
    assert_eq!(
        (states.first(), states.last()),
        (Some(&RequestState::CallingApi), Some(&RequestState::Done))
    );
    assert!(states.windows(2).all(|w| w[0].rank() <= w[1].rank()), "{states:?}");
    // Both channel slots are back, and the figures closed.
    assert!(st.channels.iter().all(|c| c.in_flight() == 0));
    assert_eq!(st.metrics.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn f2_a_short_hint_retries_the_same_channel_after_exactly_the_hint() {
    // spec: F2, D6, F1
    let (st, _) = state_with(config("", &[("a", 4)]));
    let caller = Scripted::with(&[("a", fail(429, ErrorClass::RateLimit, Some(1_500)))]);
    let (resp, took, id) = drive(&st, &caller).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(took, Duration::from_millis(1_500));
    let (_, atts) = rows(&st, &id).await;
    assert_eq!(atts[0].decision, Some(Decision::Retry));
    assert_eq!(atts[0].delay_ms, Some(1_500));
    assert_eq!(atts[0].ready_at.unwrap().since(atts[0].finished_at.unwrap()), 1_500);
}

#[tokio::test(start_paused = true)]
async fn f2_i5_a_long_hint_waits_with_a_durable_ready_at() {
    // spec: F2, F1, I5
    let (st, mem) = state_with(config("", &[("a", 4)]));
    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, Some(5_000)))]);
    let (resp, took, id) = drive(&st, &caller).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(took, Duration::from_secs(5));
    let (rec, atts) = rows(&st, &id).await;
    assert_eq!(atts[0].decision, Some(Decision::Wait));
    assert_eq!(atts[0].decision_reason, None);
    // The wait was on record, with its ready_at, before it started; the end clears it.
    let waits: Vec<Option<UnixMs>> = mem
        .writes
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.id == id)
        .map(|r| r.next_ready_at)
        .collect();
    assert_eq!(waits[1], atts[0].ready_at);
    assert_eq!(rec.next_ready_at, None);
}

#[tokio::test(start_paused = true)]
async fn d7_only_pacing_answers_429_any_provider_failure_502() {
    // spec: D7, A8
    for (faults, status) in [
        (vec![fail(429, ErrorClass::RateLimit, None); 3], 429),
        (
            vec![
                fail(529, ErrorClass::Overload, None),
                fail(429, ErrorClass::RateLimit, None),
                fail(429, ErrorClass::RateLimit, None),
            ],
            502,
        ),
        (vec![fail(503, ErrorClass::Overload, None); 3], 502),
        (vec![fail(408, ErrorClass::Timeout, None); 3], 502),
    ] {
        let (st, _) = state_with(config("", &[("a", 4), ("b", 4), ("c", 4)]));
        let script: Vec<(&str, Step)> = ["a", "b", "c"].into_iter().zip(faults).collect();
        let caller = Scripted::with(&script);
        let (resp, _, id) = drive(&st, &caller).await;
        assert_eq!(resp.status().as_u16(), status, "{:?}", caller.calls());
        assert!(resp.headers().contains_key("retry-after"));
        let (rec, atts) = rows(&st, &id).await;
        assert_eq!(rec.http_status, Some(status));
        assert_eq!(atts.len(), 3);
        assert_eq!(atts[2].decision_reason, Some(StopReason::AttemptBudgetExhausted));
    }
}

#[tokio::test(start_paused = true)]
async fn d7_capacity_after_a_provider_failure_is_still_502() {
    // spec: D7, C2
    // One channel of one slot: the 503's retry cannot get the slot back (another request
    // holds it), so the loop stops on capacity; the provider failed first, so: 502.
    let (st, _) = state_with(config("capacity_wait_ms: 1000", &[("a", 1)]));
    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, Some(100)))]);
    let (mut life, mut ctx, admitted) = request(&st).await;
    let id = life.rec.id.clone();
    let slot = st.channels[0].permits.clone();
    let hog = tokio::spawn(async move {
        // Takes the slot the moment the first attempt gives it back, for longer than the wait.
        let p = slot.acquire_owned().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(p);
    });
    let end = failover::run(&mut ctx, &mut life, &caller, admitted).await;
    let resp = life.close(end).await;
    assert_eq!(resp.status(), 502);
    assert!(resp.headers().contains_key("retry-after"));
    let (rec, _) = rows(&st, &id).await;
    assert_eq!(rec.error_class, Some(FailureClass::Upstream(ErrorClass::Overload)));
    hog.abort();
}

#[tokio::test(start_paused = true)]
async fn an_absurd_wait_hint_is_held_to_the_longest_believed() {
    // spec: F2, D6
    let (st, _) = state_with(config("upstream: {max_wait_hint_ms: 60000}", &[("a", 4)]));
    let caller = Scripted::with(&[("a", fail(429, ErrorClass::RateLimit, Some(999_999_999_000)))]);
    let (resp, took, id) = drive(&st, &caller).await;
    // 60 s is past the 20 s deadline: fail closed at once, saying when to come back.
    assert_eq!((resp.status().as_u16(), took), (429, Duration::ZERO));
    assert_eq!(resp.headers()["retry-after"], "60");
    let (_, atts) = rows(&st, &id).await;
    assert_eq!(atts[0].retry_after_ms, Some(60_000));
    assert_eq!(atts[0].decision_reason, Some(StopReason::RetryAfterExceedsDeadline));
    let view = st.channels[0].health.view(Instant::now());
    assert_eq!(
        view.back_in_ms,
        Some(60_000),
        "the channel is paced for the clamped wait"
    );
}

#[tokio::test(start_paused = true)]
async fn c4_a_client_gone_while_waiting_to_retry_stops_the_request() {
    // spec: C4
    let (st, _) = state_with(config("", &[("a", 4)]));
    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, Some(1_000)))]);
    let (mut life, mut ctx, admitted) = request(&st).await;
    let id = life.rec.id.clone();
    let gone = ctx.client_gone.clone();
    let end = {
        let run = failover::run(&mut ctx, &mut life, &caller, admitted);
        tokio::pin!(run);
        // The client hangs up half-way through the wait.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                gone.cancel();
                let t = Instant::now();
                let end = run.await;
                assert_eq!(t.elapsed(), Duration::ZERO, "the wait ends the moment the client leaves");
                end
            }
            end = &mut run => end,
        }
    };
    let _ = life.close(end).await;
    assert_eq!(caller.calls(), ["a"], "nothing more went upstream");
    let (rec, _) = rows(&st, &id).await;
    assert_eq!(
        (rec.state, rec.error_class),
        (
            RequestState::Failed,
            Some(FailureClass::Gateway(GatewayClass::ClientDisconnected))
        )
    );
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_that_cuts_a_call_leaves_its_outcome_unknown() {
    // spec: I4
    let (st, _) = state_with(config("", &[("a", 4)]));
    let caller = Scripted::with(&[("a", Step::Hang)]);
    let (mut life, mut ctx, admitted) = request(&st).await;
    let id = life.rec.id.clone();
    let cancel = st.shutdown.cancel.clone();
    let end = tokio::select! {
        biased;
        _ = cancel.cancelled() => End::Cancelled,
        end = failover::run(&mut ctx, &mut life, &caller, admitted) => end,
        _ = async { tokio::time::sleep(Duration::from_secs(1)).await; st.shutdown.cancel.cancel(); std::future::pending::<()>().await } => unreachable!(),
    };
    let resp = life.close(end).await;
    assert_eq!(resp.status(), 503);
    // The client hears that the outcome is unknown, and is not invited to retry blindly.
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert!(resp.headers().get("retry-after").is_none());
    let (rec, atts) = rows(&st, &id).await;
    assert_eq!(rec.state, RequestState::Unknown);
    assert_eq!(rec.error_class, Some(FailureClass::Gateway(GatewayClass::Interrupted)));
    assert_eq!(
        (atts[0].decision, atts[0].decision_reason),
        (Some(Decision::FailClosed), Some(StopReason::Interrupted))
    );
    assert_eq!(st.shutdown.open_requests(), 0);
    assert!(st.channels[0].in_flight() == 0);
}

// --- the stream observer ---------------------------------------------------------------

/// A scripted upstream stream: chunks pushed by the test.
fn scripted_stream() -> (tokio::sync::mpsc::Sender<std::io::Result<Bytes>>, ByteStream) {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    (tx, Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

fn chunk(content: &str) -> std::io::Result<Bytes> {
    Ok(Bytes::from(format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{content}\"}}}}]}}\n\n"
    )))
}

/// A primed stream over a scripted upstream, already holding its first token, and the
/// response body that passes it on.
async fn primed_stream(
    st: &Arc<AppState>,
    key_slot: Option<crate::limits::KeySlot>,
) -> (tokio::sync::mpsc::Sender<std::io::Result<Bytes>>, StreamBody, String) {
    let (mut life, _ctx, admitted) = request(st).await;
    if let Some(k) = key_slot {
        life.hold_key(k);
    }
    life.calling_api("a", None).await.unwrap();
    let att = life.begin_attempt("a");
    life.attempt_returned();
    let id = life.rec.id.clone();
    let (tx, inner) = scripted_stream();
    let mut p = Primed::new(
        inner,
        Format::OpenAi,
        att,
        Some(admitted.permit),
        Duration::from_secs(5),
        HeaderValue::from_static("text/event-stream"),
    );
    tx.send(chunk("")).await.unwrap();
    tx.send(chunk("Hi")).await.unwrap();
    let t0 = Instant::now();
    assert!(
        p.prime(Instant::now() + Duration::from_secs(8), Duration::from_secs(8), 1 << 20)
            .await
            .is_none()
    );
    assert_eq!(t0.elapsed(), Duration::ZERO);
    (tx, StreamBody::new(p, life), id)
}

#[tokio::test(start_paused = true)]
async fn h2_a_stream_that_goes_quiet_after_output_ends_with_an_error_event() {
    // spec: H2, H4
    let (st, _) = state_with(config("", &[("a", 4)]));
    let (tx, mut body, id) = primed_stream(&st, None).await;
    assert_eq!(st.channels[0].in_flight(), 1);
    // The held prefix comes first, then what arrives.
    assert!(body.next().await.unwrap().unwrap().starts_with(b"data: "));
    assert!(body.next().await.unwrap().unwrap().ends_with(b"\n\n"));
    tx.send(chunk(" there")).await.unwrap();
    assert!(String::from_utf8_lossy(&body.next().await.unwrap().unwrap()).contains("there"));
    // Then nothing for the idle timeout (5 s): an error event naming the request.
    let t0 = Instant::now();
    let ev = body.next().await.unwrap().unwrap();
    assert_eq!(t0.elapsed(), Duration::from_secs(5));
    let ev = String::from_utf8_lossy(&ev).into_owned();
    assert!(ev.contains("\"error\"") && ev.contains(&id), "{ev}");
    assert!(body.next().await.is_none());
    assert_eq!(st.channels[0].in_flight(), 0, "the channel slot came back");
    let (rec, atts) = rows(&st, &id).await;
    assert_eq!((rec.state, rec.partial_output_committed), (RequestState::Failed, true));
    assert_eq!(rec.error_class, Some(FailureClass::Upstream(ErrorClass::Timeout)));
    assert_eq!(atts[0].decision_reason, Some(StopReason::PartialOutputCommitted));
}

#[tokio::test(start_paused = true)]
async fn h1_an_event_over_the_parsers_limit_reaches_the_client_and_the_next_one_is_read() {
    // spec: H1
    let (st, _) = state_with(config("", &[("a", 4)]));
    let (tx, mut body, id) = primed_stream(&st, None).await;
    assert!(body.next().await.is_some());
    assert!(body.next().await.is_some());
    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n";
    // An upstream that sends more than the parser holds in one line, in pieces.
    let piece = Bytes::from(vec![b'x'; 1 << 20]);
    let pieces = spillway_wire::MAX_EVENT_BYTES / piece.len() + 2;
    let sender = tokio::spawn(async move {
        tx.send(Ok(Bytes::from_static(b"data: "))).await.unwrap();
        for _ in 0..pieces {
            tx.send(Ok(piece.clone())).await.unwrap();
        }
        tx.send(Ok(Bytes::from_static(b"\n\n"))).await.unwrap();
        tx.send(Ok(Bytes::from_static(USAGE.as_bytes()))).await.unwrap();
        tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await.unwrap();
    });
    let mut passed = 0usize;
    let mut tail = Vec::new();
    while let Some(c) = body.next().await {
        let c = c.unwrap();
        passed += c.len();
        tail = c.to_vec();
    }
    sender.await.unwrap();
    // Every byte went through, the skipped event's as well.
    assert_eq!(passed, 6 + pieces * (1 << 20) + 2 + USAGE.len() + 14);
    assert_eq!(tail, b"data: [DONE]\n\n");
    // The event after it was read: its usage is the request's.
    let (rec, _) = rows(&st, &id).await;
    assert_eq!(rec.state, RequestState::Done);
    assert_eq!((rec.input_tokens, rec.output_tokens), (Some(5), Some(7)));
}

#[tokio::test(start_paused = true)]
async fn a_client_that_hangs_up_right_after_the_end_marker_got_its_whole_answer() {
    // spec: I3, H1
    let (st, _) = state_with(config("", &[("a", 4)]));
    let (tx, mut body, id) = primed_stream(&st, None).await;
    assert!(body.next().await.is_some());
    assert!(body.next().await.is_some());
    // The provider's end marker reaches the client; the upstream's own end has not yet
    // reached the gateway when the SDK, done, closes the connection.
    tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await.unwrap();
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"data: [DONE]\n\n");
    drop(body);
    let (rec, _) = rows(&st, &id).await;
    assert_eq!((rec.state, rec.error_class), (RequestState::Done, None));
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn b1_a_client_that_goes_away_mid_stream_frees_its_slots() {
    // spec: B1, C1
    let (st, _) = state_with(config("", &[("a", 4)]));
    let key = st.accounts.all_keys()[0].clone();
    let (_tx, mut body, id) =
        primed_stream(&st, Some(key.limits.acquire(None, Duration::ZERO, true).await.unwrap())).await;
    assert!(body.next().await.is_some());
    assert!(
        key.limits.acquire(None, Duration::ZERO, true).await.is_err(),
        "the stream holds the key's only slot"
    );
    drop(body);
    assert_eq!(st.channels[0].in_flight(), 0);
    assert!(
        key.limits.acquire(None, Duration::ZERO, true).await.is_ok(),
        "and gives it back with the client"
    );
    let (rec, _) = rows(&st, &id).await;
    assert_eq!(
        rec.error_class,
        Some(FailureClass::Gateway(GatewayClass::ClientDisconnected))
    );
    assert_eq!(st.shutdown.open_requests(), 0);
}

#[tokio::test(start_paused = true)]
async fn b1_a_client_that_stops_reading_a_stream_frees_its_slots_at_the_write_deadline() {
    // spec: B1, C1
    // Whatever the transport (a full socket, an HTTP/2 window never opened): a chunk handed
    // over and not followed by a request for the next within the write deadline.
    let (st, _) = state_with(config("server: {write_timeout_ms: 2000}", &[("a", 4)]));
    let key = st.accounts.all_keys()[0].clone();
    let (tx, mut body, id) =
        primed_stream(&st, Some(key.limits.acquire(None, Duration::ZERO, true).await.unwrap())).await;
    assert!(body.next().await.is_some());
    tx.send(chunk(" more")).await.unwrap();
    // The client takes chunks slowly but takes them: no stall.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(body.next().await.is_some());
    assert_eq!(st.channels[0].in_flight(), 1);
    // Then it stops asking.
    let t0 = Instant::now();
    while st.channels[0].in_flight() == 1 {
        assert!(t0.elapsed() < Duration::from_secs(10), "never freed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(1900) && t0.elapsed() <= Duration::from_millis(2100),
        "{:?}",
        t0.elapsed()
    );
    assert!(
        key.limits.acquire(None, Duration::ZERO, true).await.is_ok(),
        "the key's slot is free"
    );
    let (rec, atts) = rows(&st, &id).await;
    assert_eq!(
        rec.error_class,
        Some(FailureClass::Gateway(GatewayClass::ClientStalled))
    );
    assert_eq!(atts[0].decision_reason, Some(StopReason::PartialOutputCommitted));
    assert_eq!(st.shutdown.open_requests(), 0);
    // The body, polled again, just ends.
    assert!(body.next().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_mid_stream_ends_it_and_leaves_the_outcome_unknown() {
    // spec: H2, I4
    let (st, _) = state_with(config("", &[("a", 4)]));
    let (_tx, mut body, id) = primed_stream(&st, None).await;
    assert!(body.next().await.is_some());
    assert!(body.next().await.is_some());
    st.shutdown.cancel.cancel();
    let ev = String::from_utf8_lossy(&body.next().await.unwrap().unwrap()).into_owned();
    assert!(ev.contains("shutting down"), "{ev}");
    assert!(body.next().await.is_none());
    let (rec, _) = rows(&st, &id).await;
    assert_eq!((rec.state, rec.partial_output_committed), (RequestState::Unknown, true));
}

#[tokio::test(start_paused = true)]
async fn h2_priming_holds_no_more_than_its_cap_and_no_longer_than_the_attempt() {
    // spec: H2, H4
    let att = AttemptRecord::started("r", 1, "a", UnixMs(0));
    let (tx, inner) = scripted_stream();
    let mut p = Primed::new(
        inner,
        Format::OpenAi,
        att.clone(),
        None,
        Duration::from_secs(5),
        HeaderValue::from_static("x"),
    );
    // Role chunks without content, over and over: never visible output.
    for _ in 0..40 {
        tx.send(chunk("")).await.unwrap();
    }
    let s = p
        .prime(Instant::now() + Duration::from_secs(8), Duration::from_secs(8), 1024)
        .await
        .unwrap();
    assert_eq!(s.class, ErrorClass::MalformedResponse);
    let (_tx, inner) = scripted_stream();
    let mut p = Primed::new(
        inner,
        Format::OpenAi,
        att,
        None,
        Duration::from_secs(5),
        HeaderValue::from_static("x"),
    );
    let t0 = Instant::now();
    let s = p
        .prime(t0 + Duration::from_secs(8), Duration::from_secs(8), 1024)
        .await
        .unwrap();
    assert_eq!((s.class, t0.elapsed()), (ErrorClass::Timeout, Duration::from_secs(8)));
    assert_eq!(s.message.as_deref(), Some("no visible output within 8000 ms"));
}

// --- the control plane in the loop ---------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn f4_over_budget_a_failure_is_not_retried_and_first_attempts_go_on() {
    // spec: F4, D7
    let (st, _) = state_with(config(
        "control: {retry_budget_percent: 20, retry_budget_min: 0}",
        &[("a", 64), ("b", 64)],
    ));
    // Ten good requests earn two retries.
    for _ in 0..10 {
        let (resp, _, _) = drive(&st, &Scripted::default()).await;
        assert_eq!(resp.status(), 200);
    }
    let failing = || {
        Scripted::with(&[
            ("a", fail(500, ErrorClass::ServerError, None)),
            ("b", fail(500, ErrorClass::ServerError, None)),
            ("a", fail(500, ErrorClass::ServerError, None)),
        ])
    };
    let mut stops = Vec::new();
    for _ in 0..3 {
        let (resp, _, id) = drive(&st, &failing()).await;
        assert_eq!(resp.status(), 502);
        assert!(resp.headers().contains_key("retry-after"));
        let (_, atts) = rows(&st, &id).await;
        stops.push((atts.len(), atts.last().unwrap().decision_reason));
    }
    // The first failing request retries twice on budget (and runs out of attempts); the
    // budget's two retries spent, the next ones stop after their first attempt.
    assert_eq!(
        stops,
        [
            (3, Some(StopReason::AttemptBudgetExhausted)),
            (1, Some(StopReason::RetryBudgetExhausted)),
            (1, Some(StopReason::RetryBudgetExhausted)),
        ]
    );
    let v = st.control.get("openai/m").unwrap().view("");
    assert_eq!((v.budget_requests, v.budget_retries, v.budget_allowed), (13, 2, 2));
    // F5: 13 requests, 15 attempts, one retried request, not rescued.
    let a = v.amplification.last_1m;
    assert_eq!((a.requests, a.attempts, a.retried), (13, 15, 1));
    assert_eq!(a.post_retry_success, Some(0.0));
    // First attempts are never starved: a new request still goes out and succeeds.
    let (resp, _, _) = drive(&st, &Scripted::default()).await;
    assert_eq!(resp.status(), 200);
}

#[tokio::test(start_paused = true)]
async fn d5_a_dead_single_channel_is_ejected_and_stops_receiving_attempts() {
    // spec: D5, D7
    let (st, mem) = state_with(config("", &[("a", 64)]));
    let dead = Scripted::with(&vec![("a", fail(500, ErrorClass::ServerError, None)); 100]);
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let (resp, _, _) = drive(&st, &dead).await;
        statuses.push(resp.status().as_u16());
    }
    assert_eq!(statuses, [502, 502]);
    // Five failures in a row ejected it: the second request stopped on its fifth attempt.
    assert_eq!(dead.calls().len(), 5);
    let v = st.channels[0].health.view(Instant::now());
    assert_eq!(v.state, crate::health::RotationState::Cooling);
    assert_eq!((v.back_in_ms, v.ejections), (Some(30_000), 1));
    // Now requests are refused before any attempt, fast, with the cool-down as retry-after.
    let route = st.control.route(&st, Format::OpenAi, "m");
    assert!(matches!(route.admit(&st), Admit::Send(None)));
    let c = routing::candidates(&st, Format::OpenAi, "m", None);
    match routing::admit(&c, 1, &[], Duration::from_secs(10), || Ok(routing::WaitGuard(None))).await {
        Err(e @ crate::error::GatewayError::ChannelsCoolingDown { .. }) => {
            let r = e.into_response(Format::OpenAi);
            assert_eq!(
                (r.status().as_u16(), &r.headers()["retry-after"]),
                (503, &HeaderValue::from_static("30"))
            );
        }
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("admitted to a cooling channel"),
    }
    assert_eq!(dead.calls().len(), 5, "nothing more reached the dead channel");
    // The ejection is on the record (persisted in order by the control's writer task).
    tokio::time::sleep(Duration::from_millis(10)).await;
    let audit = mem.audit.lock().unwrap().clone();
    assert!(
        audit
            .iter()
            .any(|e| e.kind == "channel" && e.action == "ejected" && e.subject == "a"),
        "{audit:?}"
    );
    // After the cool-down it comes back, on the record, and one failure sends it out for 60 s.
    tokio::time::advance(Duration::from_secs(30)).await;
    assert!(
        st.channels[0]
            .health
            .advance(Instant::now())
            .is_some_and(|t| !t.ejected)
    );
    let (resp, _, _) = drive(&st, &dead).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(dead.calls().len(), 6);
    assert_eq!(st.channels[0].health.view(Instant::now()).back_in_ms, Some(60_000));
}

#[tokio::test(start_paused = true)]
async fn g1_g2_g3_a_failing_route_opens_fails_fast_and_closes_after_probation() {
    // spec: G1, G2, G3, G4
    // Many channels, so that ejections alone do not stop the traffic: the breaker must.
    let names: Vec<String> = (0..30).map(|i| format!("c{i}")).collect();
    let chans: Vec<(&str, u32)> = names.iter().map(|n| (n.as_str(), 64)).collect();
    let (st, mem) = state_with(config_even("control: {retry_budget_min: 1000}", &chans));
    let mut alerts = st.alerts.subscribe();
    // Every channel fails as often as the whole trigger asks (25): routing picks channels
    // at random, and one picked more often than its script would answer 200.
    let failing: Vec<(&str, Step)> = names
        .iter()
        .flat_map(|n| std::iter::repeat_n((n.as_str(), fail(503, ErrorClass::Overload, None)), 25))
        .collect();
    let caller = Scripted::with(&failing);
    let route = st.control.route(&st, Format::OpenAi, "m");
    let mut n = 0;
    while route.state() == spillway_control::BreakerState::Closed {
        let (resp, _, _) = drive(&st, &caller).await;
        assert_eq!(resp.status(), 502);
        n += 1;
        assert!(n < 20);
    }
    // Exactly at 25 failed attempts, even though the last request had attempts left.
    assert_eq!(caller.calls().len(), 25);
    // A channel the random pick chose five times left rotation on the way (a warning of
    // its own); the breaker's alert is there whatever the picks were.
    let raised: Vec<_> = std::iter::from_fn(|| alerts.try_recv().ok()).collect();
    assert!(
        raised
            .iter()
            .any(|a| (a.severity, a.title.as_str()) == (Severity::Critical, "Breaker open on openai/m")),
        "{raised:?}"
    );
    assert!(
        raised
            .iter()
            .all(|a| a.title == "Breaker open on openai/m" || a.title.ends_with("left rotation")),
        "{raised:?}"
    );
    // Open: refused at once, naming the breaker, with the time of the first probe.
    match route.admit(&st) {
        Admit::Refuse { retry_after, reason } => {
            assert_eq!(retry_after, Duration::from_secs(30));
            assert!(reason.contains("25 of the last 25 attempts failed"), "{reason}");
        }
        _ => panic!("an open breaker let a request through"),
    }
    // Probation after the cool-down: probes one at a time; five successes close it.
    tokio::time::advance(Duration::from_secs(30)).await;
    let ok = Scripted::default();
    for i in 0..5 {
        let (mut life, mut ctx, admitted) = request(&st).await;
        assert!(ctx.probe.is_some(), "probe {i}");
        assert!(matches!(route.admit(&st), Admit::Refuse { .. }), "one probe at a time");
        let end = failover::run(&mut ctx, &mut life, &ok, admitted).await;
        assert_eq!(life.close(end).await.status(), 200);
    }
    assert_eq!(route.state(), spillway_control::BreakerState::Closed);
    assert!(matches!(route.admit(&st), Admit::Send(None)));
    // Every transition is on the record, with its figures.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let actions: Vec<String> = mem
        .audit
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == "breaker")
        .map(|e| e.action.clone())
        .collect();
    assert_eq!(actions, ["closed->open", "open->probation", "probation->closed"]);
    let first = mem
        .audit
        .lock()
        .unwrap()
        .iter()
        .find(|e| e.kind == "breaker")
        .cloned()
        .unwrap();
    assert_eq!(first.trigger.as_deref(), Some("server_errors"));
    assert!(first.figures.unwrap().contains("\"failed_attempts\""));
}

#[tokio::test(start_paused = true)]
async fn g3_a_failed_probe_reopens_and_its_request_makes_one_attempt() {
    // spec: G3, G2
    let (st, _) = state_with(config("", &[("a", 64), ("b", 64)]));
    let route = st.control.route(&st, Format::OpenAi, "m");
    st.control.force(&st, &route, true, "ops", "drill").await.unwrap();
    st.control.force(&st, &route, false, "ops", "drill over").await.unwrap();
    // Open it by its trigger, then let probation start.
    for _ in 0..25 {
        route.on_attempt(&st, Outcome::ProviderFailure, Duration::ZERO, None);
    }
    tokio::time::advance(Duration::from_secs(30)).await;
    let caller = Scripted::with(&[
        ("a", fail(500, ErrorClass::ServerError, None)),
        ("b", fail(500, ErrorClass::ServerError, None)),
    ]);
    let (resp, _, id) = drive(&st, &caller).await;
    assert_eq!(resp.status(), 502);
    let (_, atts) = rows(&st, &id).await;
    assert_eq!(atts.len(), 1, "a probe is one attempt");
    assert_eq!(atts[0].decision_reason, Some(StopReason::BreakerOpen));
    assert_eq!(route.state(), spillway_control::BreakerState::Open);
    assert_eq!(
        route.retry_after(),
        Some(Duration::from_secs(60)),
        "the cool-down doubled"
    );
}

#[tokio::test(start_paused = true)]
async fn g2_a_breaker_that_opens_while_a_request_waits_to_retry_stops_it() {
    // spec: G2
    let (st, _) = state_with(config("", &[("a", 4)]));
    let caller = Arc::new(Scripted::with(&[("a", fail(503, ErrorClass::Overload, Some(1_500)))]));
    let task = {
        let (st, caller) = (st.clone(), caller.clone());
        tokio::spawn(async move { drive(&st, &caller).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let route = st.control.get("openai/m").unwrap();
    st.control.force(&st, &route, true, "ops", "incident").await.unwrap();
    let (resp, _, id) = task.await.unwrap();
    assert_eq!(resp.status(), 502);
    assert!(resp.headers().contains_key("retry-after"));
    assert_eq!(
        caller.calls(),
        ["a"],
        "nothing more went upstream once the breaker opened"
    );
    let (rec, _) = rows(&st, &id).await;
    assert!(rec.error_message.unwrap().contains("circuit breaker"));
}

#[tokio::test(start_paused = true)]
async fn client_named_models_cannot_take_the_breaker_table_for_good() {
    // spec: G1
    let (st, _) = state_with(config("", &[("a", 4)]));
    for i in 0..300 {
        let r = st.control.route(&st, Format::OpenAi, &format!("made-up-{i}"));
        assert!(matches!(r.admit(&st), Admit::Send(None)));
    }
    // The table is full: newcomers share one breaker, and an operator cannot force it.
    assert_eq!(
        st.control.route(&st, Format::OpenAi, "late").name,
        "openai/(other models)"
    );
    assert!(!st.control.has_own_route(Format::OpenAi, "late"));
    // Ten idle minutes later, the idle closed routes make room; an open one stays.
    let open = st.control.get("openai/made-up-7").unwrap();
    st.control.force(&st, &open, true, "ops", "keep").await.unwrap();
    tokio::time::advance(Duration::from_secs(601)).await;
    assert_eq!(st.control.route(&st, Format::OpenAi, "late").name, "openai/late");
    assert_eq!(
        st.control.get("openai/made-up-7").unwrap().state(),
        spillway_control::BreakerState::Open
    );
    assert!(st.control.get("openai/made-up-8").is_none());
}

#[tokio::test(start_paused = true)]
async fn g4_breaker_and_ejection_survive_a_restart() {
    // spec: G4, D5
    let mem = Arc::new(Memory::default());
    let cfg = config("", &[("a", 4)]);
    {
        let st = AppState::new(cfg.clone(), Ledger::start(mem.clone())).unwrap();
        let route = st.control.route(&st, Format::OpenAi, "m");
        assert!(
            st.control
                .force(&st, &route, true, "ops", "provider incident")
                .await
                .unwrap()
        );
        for _ in 0..5 {
            if let Some(t) =
                st.channels[0]
                    .health
                    .observe_outcome(Outcome::ProviderFailure, Duration::ZERO, Instant::now(), true)
            {
                st.control.channel_moved(&st, &st.channels[0], t, "gateway");
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = AppState::new(cfg, Ledger::start(mem.clone())).unwrap();
    assert_eq!(st.control.restore(&st).await.unwrap(), 2);
    let route = st.control.get("openai/m").expect("restored");
    assert_eq!(route.state(), spillway_control::BreakerState::Open);
    match route.admit(&st) {
        // Clients hear that an operator opened it; the operator's words stay in the console.
        Admit::Refuse { reason, .. } => assert_eq!(reason, "opened by an operator"),
        _ => panic!("a restart closed the breaker"),
    }
    let view = route.view("").breaker;
    assert!(view.reason.unwrap().contains("provider incident"));
    let v = st.channels[0].health.view(Instant::now());
    assert_eq!(v.state, crate::health::RotationState::Cooling);
    let audit = mem.audit.lock().unwrap().clone();
    assert_eq!(audit[0].actor, "ops");
}

#[tokio::test(start_paused = true)]
async fn d4_a_channel_at_twice_its_normal_latency_gets_fewer_new_conversations() {
    // spec: D4
    let (st, _) = state_with(config_even("", &[("a", 4), ("b", 4)]));
    for _ in 0..300 {
        for c in &st.channels {
            c.health
                .observe_outcome(Outcome::Success, Duration::from_millis(100), Instant::now(), true);
        }
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let first = |st: &AppState| {
        let mut a = 0;
        for _ in 0..10_000 {
            a += usize::from(&*routing::candidates(st, Format::OpenAi, "m", None)[0].cfg.name == "a");
        }
        a
    };
    let even = first(&st);
    assert!((4_500..5_500).contains(&even), "equal channels share evenly: {even}");
    // `a` now answers in twice its normal time.
    for _ in 0..3 {
        st.channels[0]
            .health
            .observe_outcome(Outcome::Success, Duration::from_millis(200), Instant::now(), true);
        tokio::time::advance(Duration::from_millis(50)).await;
    }
    let share = st.channels[0].health.view(Instant::now()).share;
    assert!((0.2..0.3).contains(&share), "share {share}");
    let slow = first(&st);
    // Expected share of first picks: 0.25 / 1.25 = 20 %.
    assert!(
        (1_500..2_600).contains(&slow),
        "the slow channel got {slow} of 10000 new conversations"
    );
}

#[tokio::test(start_paused = true)]
async fn d4_d5_a_conversation_sticks_to_its_channel_until_it_leaves_rotation() {
    // spec: D4, D5
    let (st, _) = state_with(config_even("", &[("a", 4), ("b", 4), ("c", 4)]));
    let (resp, _, _) = drive(&st, &Scripted::default()).await;
    let home = resp.headers()["x-spillway-channel"].to_str().unwrap().to_owned();
    assert_eq!(st.control.pinned(7).as_deref(), Some(home.as_str()));
    for _ in 0..50 {
        let c = routing::candidates(&st, Format::OpenAi, "m", st.control.pinned(7).as_deref());
        assert_eq!(*c[0].cfg.name, home, "later turns stay on their channel");
    }
    // Its channel is ejected: the next turn moves, and stays where it moved.
    let ch = st.channels.iter().find(|c| c.cfg.name == home).unwrap();
    for _ in 0..5 {
        ch.health
            .observe_outcome(Outcome::ProviderFailure, Duration::ZERO, Instant::now(), true);
    }
    let (resp, _, _) = drive(&st, &Scripted::default()).await;
    let moved = resp.headers()["x-spillway-channel"].to_str().unwrap().to_owned();
    assert_ne!(moved, home);
    assert_eq!(st.control.pinned(7).as_deref(), Some(moved.as_str()));
}

// --- the whole server on loopback ------------------------------------------------------

/// A gateway on an OS-chosen loopback port with `caller` as its upstream.
async fn serve(cfg: Config, ledger: Ledger, caller: Scripted) -> crate::Running {
    crate::start_with(
        cfg,
        crate::Options {
            ledger: Some(ledger),
            listen: Some(([127, 0, 0, 1], 0).into()),
            ..crate::Options::default()
        },
        Arc::new(caller),
    )
    .await
    .unwrap()
}

fn chat(url: &str, model: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
}

#[tokio::test]
async fn n4_metrics_are_prometheus_text_with_bounded_labels() {
    // spec: N4, N1, F5, G4
    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, None))]);
    let gw = serve(
        config("", &[("a", 4), ("b", 4)]),
        Ledger::start(Arc::new(Memory::default())),
        caller,
    )
    .await;
    let url = format!("http://{}", gw.addr);
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    let r = reqwest::get(format!("{url}/metrics")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = r.text().await.unwrap();
    let value = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(
        value(r#"spillway_requests_total{route="openai/m",owner="team",api="generate"}"#),
        2.0
    );
    assert_eq!(
        value(r#"spillway_attempts_total{route="openai/m",owner="team",api="generate"}"#),
        3.0
    );
    assert_eq!(
        value(r#"spillway_attempt_failures_total{route="openai/m",owner="team",api="generate",class="overload"}"#),
        1.0
    );
    assert_eq!(value(r#"spillway_breaker_state{route="openai/m",state="closed"}"#), 1.0);
    assert_eq!(
        value(r#"spillway_retry_amplification{route="openai/m",window="1m"}"#),
        1.5
    );
    assert_eq!(
        value(r#"spillway_post_retry_success_ratio{route="openai/m",window="5m"}"#),
        1.0
    );
    assert_eq!(value(r#"spillway_channel_state{channel="a",state="ready"}"#), 1.0);
    assert_eq!(
        value(r#"spillway_request_duration_seconds_count{route="openai/m"}"#),
        2.0
    );
    assert!(
        text.contains(r#"spillway_queue_wait_seconds_bucket{route="openai/m",le="0.001"} 2"#),
        "{text}"
    );
    // The ledger's commits: each request waited for at least its durable `calling_api`.
    let commits = value("spillway_ledger_commit_seconds_count");
    assert!(commits >= 2.0, "{text}");
    assert_eq!(value(r#"spillway_ledger_commit_seconds_bucket{le="+Inf"}"#), commits);
    assert!(
        text.contains("# TYPE spillway_ledger_commit_seconds histogram"),
        "{text}"
    );
    // The threads serving requests: this test's runtime has one.
    assert_eq!(value("spillway_runtime_workers"), 1.0);
    // Every line is a comment or `name{labels} value`.
    for l in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (_, v) = l.rsplit_once(' ').unwrap();
        assert!(v.parse::<f64>().is_ok() || v == "+Inf", "{l}");
    }
    gw.shutdown().await.unwrap();
}

/// A server on a loopback port that keeps the JSON body of every POST to `route`: its
/// base URL and what it received.
async fn receiver(route: &str) -> (String, Arc<Mutex<Vec<serde_json::Value>>>) {
    let got: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let keep = got.clone();
    let app = axum::Router::new().route(
        route,
        axum::routing::post(move |body: Bytes| {
            let keep = keep.clone();
            async move {
                keep.lock()
                    .unwrap()
                    .push(serde_json::from_slice(&body).unwrap_or_default());
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (base, got)
}

#[tokio::test]
async fn g4_a_breaker_opening_is_posted_to_the_alert_webhook() {
    // spec: G4
    let (base, got) = receiver("/hook/{token}").await;
    let hook = format!("{base}/hook/t0ken");
    let gw = serve(
        config(&format!("alert_webhook_url: {hook}"), &[("a", 4)]),
        Ledger::start(Arc::new(Memory::default())),
        Scripted::default(),
    )
    .await;
    let st = gw.state.clone();
    let route = st.control.route(&st, Format::OpenAi, "m");
    st.control.force(&st, &route, true, "ops", "drill").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.lock().unwrap().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let alerts = got.lock().unwrap().clone();
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0]["title"], "Breaker open on openai/m");
    assert_eq!(alerts[0]["severity"], "critical");
    assert_eq!(alerts[0]["subject"], "openai/m");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn n4_a_metrics_token_is_required_when_configured() {
    // spec: N4
    let gw = serve(
        config("metrics_token: scrape-me-0123456789", &[("a", 4)]),
        Ledger::start(Arc::new(Memory::default())),
        Scripted::default(),
    )
    .await;
    let url = format!("http://{}/metrics", gw.addr);
    let c = reqwest::Client::new();
    assert_eq!(c.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(
        c.get(&url)
            .bearer_auth("wrong-token-0123456789")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        c.get(&url)
            .bearer_auth("scrape-me-0123456789")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    gw.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n1_each_request_is_a_trace_span_with_a_child_per_attempt() {
    // spec: N1, A6
    // A collector on loopback that keeps every OTLP/JSON export it receives.
    let (collector, got) = receiver("/v1/traces").await;

    let caller = Scripted::with(&[("a", fail(503, ErrorClass::Overload, None))]);
    let gw = crate::start_with(
        config("", &[("a", 4), ("b", 4)]),
        crate::Options {
            ledger: Some(Ledger::start(Arc::new(Memory::default()))),
            listen: Some(([127, 0, 0, 1], 0).into()),
            otel: Some(Arc::new(crate::otel::Otel::json_to(&collector).unwrap())),
            ..crate::Options::default()
        },
        Arc::new(caller),
    )
    .await
    .unwrap();
    let url = format!("http://{}", gw.addr);
    let r = chat(&url, "m")
        .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    gw.shutdown().await.unwrap();
    let spans: Vec<serde_json::Value> = got
        .lock()
        .unwrap()
        .iter()
        .flat_map(|e| e["resourceSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|r| r["scopeSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|s| s["spans"].as_array().cloned().unwrap_or_default())
        .collect();
    let attr = |span: &serde_json::Value, key: &str| {
        span["attributes"]
            .as_array()
            .and_then(|a| a.iter().find(|kv| kv["key"] == key))
            .map(|kv| kv["value"].clone())
    };
    let request = spans
        .iter()
        .find(|s| {
            attr(s, "spillway.request_id").and_then(|v| v["stringValue"].as_str().map(str::to_owned))
                == Some(id.clone())
        })
        .unwrap_or_else(|| panic!("no span for the request in {spans:?}"));
    // The caller's trace continues, under the caller's span.
    assert_eq!(request["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(request["parentSpanId"], "00f067aa0ba902b7");
    let children: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| s["parentSpanId"] == request["spanId"])
        .collect();
    let mut names: Vec<&str> = children.iter().map(|s| s["name"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["attempt 1 on a", "attempt 2 on b"]);
    let first = children.iter().find(|s| s["name"] == "attempt 1 on a").unwrap();
    assert_eq!(attr(first, "spillway.decision").unwrap()["stringValue"], "failover");
    assert_eq!(attr(first, "http.response.status_code").unwrap()["intValue"], "503");
}

#[tokio::test]
async fn a_panic_is_answered_500_recorded_and_the_server_goes_on() {
    let mem = Arc::new(Memory::default());
    let caller = Scripted::with(&[("a", Step::Panic)]);
    let gw = serve(config("", &[("a", 4)]), Ledger::start(mem.clone()), caller).await;
    let url = format!("http://{}", gw.addr);
    // In the attempt task (an upstream call in flight: its outcome is unknown).
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 500);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "api_error", "in the caller's format");
    gw.state.ledger.flush().await.unwrap();
    let rec = gw.state.ledger.get_request(&id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.error_class),
        (
            RequestState::Unknown,
            Some(FailureClass::Gateway(GatewayClass::InternalError))
        )
    );
    // In the handler itself.
    let r = chat(&url, "spillway-test-panic-in-handler").send().await.unwrap();
    assert_eq!(r.status(), 500);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    gw.state.ledger.flush().await.unwrap();
    let rec = gw.state.ledger.get_request(&id).await.unwrap().unwrap();
    assert_eq!(
        rec.error_class,
        Some(FailureClass::Gateway(GatewayClass::InternalError))
    );
    // The server goes on, the key's slot (max 1) and the figures were given back.
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert_eq!(gw.state.metrics.in_flight(), 0);
    assert_eq!(gw.state.shutdown.open_requests(), 0);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_ledger_that_refuses_writes_gives_503_an_alert_and_keeps_the_records() {
    let mem = Arc::new(Memory::default());
    let gw = serve(config("", &[("a", 4)]), Ledger::start(mem.clone()), Scripted::default()).await;
    let url = format!("http://{}", gw.addr);
    let mut alerts = gw.state.alerts.subscribe();
    mem.refuse.store(true, Ordering::SeqCst);
    // The first request meets the refusal at its durable write: not sent upstream.
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let refused = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let a = tokio::time::timeout(Duration::from_secs(5), alerts.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.severity, Severity::Critical);
    assert!(a.body.contains("disk is full"), "{}", a.body);
    // While it refuses, new requests are answered 503 at once.
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 503);
    assert!(!gw.state.ledger.health().ok);
    // It recovers: what waited is written, and requests are admitted again.
    mem.refuse.store(false, Ordering::SeqCst);
    let a = tokio::time::timeout(Duration::from_secs(5), alerts.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.severity, Severity::Resolved);
    gw.state.ledger.flush().await.unwrap();
    let rec = gw.state.ledger.get_request(&refused).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.error_class),
        (
            RequestState::Failed,
            Some(FailureClass::Gateway(GatewayClass::LedgerUnavailable))
        )
    );
    // spec: I3 (nothing went upstream, and the record says nothing did)
    assert_eq!(
        (
            rec.admitted_at,
            rec.channel.as_deref(),
            rec.attempts,
            rec.served_model.as_deref()
        ),
        (None, None, 0, None)
    );
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_drains_then_cuts_and_records_what_is_left() {
    let mem = Arc::new(Memory::default());
    let caller = Scripted::with(&[("a", Step::Hang)]);
    let gw = serve(
        config("server: {drain_timeout_ms: 300}", &[("a", 4)]),
        Ledger::start(mem.clone()),
        caller,
    )
    .await;
    let url = format!("http://{}", gw.addr);
    let hung = tokio::spawn(chat(&url, "m").send());
    // The request is in its upstream call once its durable `calling_api` is written.
    let t = std::time::Instant::now();
    while !mem
        .writes
        .lock()
        .unwrap()
        .iter()
        .any(|r| r.state == RequestState::CallingApi)
    {
        assert!(t.elapsed() < Duration::from_secs(5), "the request never started");
        tokio::task::yield_now().await;
    }
    let id = mem.writes.lock().unwrap()[0].id.clone();
    let t = std::time::Instant::now();
    gw.shutdown().await.unwrap();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let r = hung.await.unwrap().unwrap();
    assert_eq!(r.status(), 503);
    let rec = mem
        .writes
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r.id == id)
        .cloned()
        .unwrap();
    assert_eq!(
        rec.state,
        RequestState::Unknown,
        "an upstream call cut mid-flight is unknown"
    );
    // New connections are refused once it has stopped.
    assert!(reqwest::get(format!("{url}/healthz")).await.is_err());
}

// --- I2-I4: the idempotency ledger over the real SQLite store ---------------------------

const KEY2: &str = "sk-engine-test-other-0123456789";
const ADMIN: &str = "swa_engine_test_admin_token";

/// One channel `a` serving `m`; two gateway keys with room for concurrent requests.
fn idem_config(extra: &str) -> Config {
    let y = format!(
        "listen: 127.0.0.1:0\n{extra}\nchannels:\n  - {{name: a, format: openai, base_url: 'http://127.0.0.1:9/a', models: [m], max_concurrency: 16}}\n\
         keys:\n  - {{name: app, owner: team, secret_env: KEY}}\n  - {{name: other, owner: team, secret_env: KEY2}}\nowners:\n  - {{name: team}}\n"
    );
    Config::parse(
        Path::new("test.yaml"),
        &y,
        &|k| match k {
            "KEY" => Some(KEY.into()),
            "KEY2" => Some(KEY2.into()),
            _ => None,
        },
        &|| unreachable!(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn serve_sqlite(dir: &Path, caller: Scripted) -> (crate::Running, String, Arc<Scripted>) {
    let caller = Arc::new(caller);
    let gw = crate::start_with(
        idem_config(""),
        crate::Options {
            ledger: Some(Ledger::open_sqlite(&dir.join("ledger.db")).await.unwrap()),
            listen: Some(([127, 0, 0, 1], 0).into()),
            admin_token: Some(crate::admin::AdminToken::new(ADMIN.into())),
            ..crate::Options::default()
        },
        caller.clone(),
    )
    .await
    .unwrap();
    let url = format!("http://{}", gw.addr);
    (gw, url, caller)
}

fn keyed(url: &str, key: &str, idem: &str, content: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .header("idempotency-key", idem)
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]}))
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_owned())
}

#[tokio::test]
async fn i2_a_repeated_key_gets_the_stored_answer_without_a_second_call() {
    // spec: I2, A6
    let dir = tempfile::tempdir().unwrap();
    let (gw, url, caller) = serve_sqlite(dir.path(), Scripted::with(&[("a", Step::AnswerAfter(Duration::ZERO))])).await;
    let first = keyed(&url, KEY, "order-1", "hi").send().await.unwrap();
    assert_eq!(first.status(), 200);
    let first_id = header(&first, "x-request-id").unwrap();
    assert!(header(&first, "x-spillway-idempotent-replay").is_none());
    let first_body = first.bytes().await.unwrap();
    for _ in 0..2 {
        let again = keyed(&url, KEY, "order-1", "hi").send().await.unwrap();
        assert_eq!(again.status(), 200);
        assert_eq!(header(&again, "x-spillway-idempotent-replay").as_deref(), Some("true"));
        assert_eq!(header(&again, "x-spillway-replay-of"), Some(first_id.clone()));
        assert_ne!(
            header(&again, "x-request-id"),
            Some(first_id.clone()),
            "a replay is a request of its own"
        );
        assert_eq!(header(&again, "x-spillway-channel").as_deref(), Some("a"));
        assert_eq!(again.bytes().await.unwrap(), first_body, "byte for byte");
    }
    assert_eq!(caller.calls().len(), 1, "one upstream call for three requests");

    // Another body under the same key: 422, and the SDKs are told not to retry.
    let other = keyed(&url, KEY, "order-1", "something else").send().await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(header(&other, "x-should-retry").as_deref(), Some("false"));
    let e: serde_json::Value = other.json().await.unwrap();
    assert_eq!(e["error"]["type"], "idempotency_error");
    assert_eq!(e["error"]["param"], "Idempotency-Key");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("`Idempotency-Key` conflict") && msg.contains(&first_id),
        "{msg}"
    );
    assert!(!msg.contains("something else"), "never the client's text");
    // The same key under another gateway key is another key.
    assert_eq!(keyed(&url, KEY2, "order-1", "hi").send().await.unwrap().status(), 200);
    assert_eq!(caller.calls().len(), 2);
    // A malformed key is refused before anything is read or sent.
    let bad = keyed(&url, KEY, &"x".repeat(300), "hi").send().await.unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("Idempotency-Key"));
    assert_eq!(caller.calls().len(), 2);

    // A request refused before it reached a provider binds nothing: fixed, it runs.
    let wrong = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(KEY)
        .header("idempotency-key", "fix-1")
        .json(&serde_json::json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 404);
    assert_eq!(keyed(&url, KEY, "fix-1", "hi").send().await.unwrap().status(), 200);
    assert_eq!(caller.calls().len(), 3);

    // The ledger knows the replays for what they are.
    gw.state.ledger.flush().await.unwrap();
    let orig = gw.state.ledger.get_request(&first_id).await.unwrap().unwrap();
    assert_eq!(orig.idempotency_key.as_deref(), Some("order-1"));
    gw.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_concurrent_repeats_make_exactly_one_upstream_call() {
    // spec: I2
    let dir = tempfile::tempdir().unwrap();
    let (gw, url, caller) = serve_sqlite(
        dir.path(),
        Scripted::with(&[("a", Step::AnswerAfter(Duration::from_millis(300)))]),
    )
    .await;
    let sends: Vec<_> = (0..12)
        .map(|_| tokio::spawn(keyed(&url, KEY, "pay-7", "charge").send()))
        .collect();
    // Another body while the first runs: a conflict, not a retryable 409.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let other = keyed(&url, KEY, "pay-7", "refund").send().await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(header(&other, "x-should-retry").as_deref(), Some("false"));
    let mut statuses = Vec::new();
    let mut bodies = std::collections::HashSet::new();
    for s in sends {
        let r = s.await.unwrap().unwrap();
        let st = r.status().as_u16();
        if st == 409 {
            assert!(header(&r, "retry-after").is_some());
            assert!(
                header(&r, "x-should-retry").is_none(),
                "in progress: the SDK may retry later"
            );
            let t = r.text().await.unwrap();
            assert!(t.contains("still in progress"), "{t}");
        } else {
            bodies.insert(r.bytes().await.unwrap());
        }
        statuses.push(st);
    }
    assert_eq!(caller.calls().len(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 409), "{statuses:?}");
    assert!(statuses.contains(&409), "{statuses:?}");
    assert_eq!(bodies.len(), 1, "every answer is the one answer");
    // Once it completed, a repeat gets that answer.
    let r = keyed(&url, KEY, "pay-7", "charge").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(bodies.contains(&r.bytes().await.unwrap()));
    assert_eq!(caller.calls().len(), 1);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn i3_a_client_marks_its_side_effect_and_replays_say_so() {
    // spec: I3, I2
    let dir = tempfile::tempdir().unwrap();
    let (gw, url, caller) = serve_sqlite(dir.path(), Scripted::default()).await;
    let first = keyed(&url, KEY, "mail-1", "write the email").send().await.unwrap();
    let id = header(&first, "x-request-id").unwrap();
    let c = reqwest::Client::new();
    let mark = |key: &'static str, body: serde_json::Value| {
        c.post(format!("{url}/spillway/v1/requests/{id}/side-effect"))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    // Another key's request does not exist for this key.
    assert_eq!(
        mark(KEY2, serde_json::json!({"state": "pending"}))
            .await
            .unwrap()
            .status(),
        404
    );
    let bad = mark(KEY, serde_json::json!({"state": "sent"})).await.unwrap();
    assert_eq!(bad.status(), 400);
    let r = mark(KEY, serde_json::json!({"state": "pending"})).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["state"], "side_effect_pending");
    let replay = keyed(&url, KEY, "mail-1", "write the email").send().await.unwrap();
    assert_eq!(header(&replay, "x-spillway-side-effect").as_deref(), Some("pending"));
    // The replay's own id leads to the same request.
    let replay_id = header(&replay, "x-request-id").unwrap();
    let r = c
        .post(format!("{url}/spillway/v1/requests/{replay_id}/side-effect"))
        .bearer_auth(KEY)
        .json(&serde_json::json!({"state": "done", "result_id": "smtp-250-abc"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (v["state"].as_str(), v["result_id"].as_str()),
        (Some("done"), Some("smtp-250-abc"))
    );
    let replay = keyed(&url, KEY, "mail-1", "write the email").send().await.unwrap();
    assert_eq!(header(&replay, "x-spillway-side-effect").as_deref(), Some("done"));
    assert_eq!(header(&replay, "x-spillway-result-id").as_deref(), Some("smtp-250-abc"));
    // Never recorded twice with another result.
    let twice = mark(KEY, serde_json::json!({"state": "done", "result_id": "smtp-250-xyz"}))
        .await
        .unwrap();
    assert_eq!(twice.status(), 409);
    assert!(twice.text().await.unwrap().contains("smtp-250-abc"));
    let st: serde_json::Value = c
        .get(format!("{url}/spillway/v1/requests/{id}"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st["idempotency_key"], "mail-1");
    assert_eq!(caller.calls().len(), 1);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn i4_l3_an_unknown_key_is_never_sent_again_until_an_owner_reconciles_it() {
    // spec: I4, L3, I2
    let dir = tempfile::tempdir().unwrap();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "refund"}]});
    let hash = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(serde_json::to_vec(&body).unwrap()))
    };
    // Two requests a crash left calling the provider.
    let ids = [
        "0190a000-0000-7000-8000-000000000001",
        "0190a000-0000-7000-8000-000000000002",
    ];
    {
        let ledger = Ledger::open_sqlite(&dir.path().join("ledger.db")).await.unwrap();
        for (id, key) in ids.iter().zip(["refund-1", "refund-2"]) {
            let mut r = RequestRecord::received(
                (*id).into(),
                id.replace('-', ""),
                Format::OpenAi,
                "/v1/chat/completions",
                clock::now(),
            );
            r.key_name = Some("app".into());
            r.owner = Some("team".into());
            r.requested_model = Some("m".into());
            r.route = Some("openai/m".into());
            r.body_sha256 = Some(hash.clone());
            r.idempotency_key = Some(key.into());
            r.state = RequestState::CallingApi;
            ledger.put_request_durable(r).await.unwrap();
        }
        ledger.close(Duration::from_secs(1)).await.unwrap();
    }
    let (gw, url, caller) = serve_sqlite(dir.path(), Scripted::default()).await;
    let send = |k: &'static str| {
        reqwest::Client::new()
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .header("idempotency-key", k)
            .json(&body)
            .send()
    };
    for _ in 0..2 {
        let r = send("refund-1").await.unwrap();
        assert_eq!(r.status(), 409);
        assert_eq!(header(&r, "x-should-retry").as_deref(), Some("false"));
        let t = r.text().await.unwrap();
        assert!(t.contains("`unknown`") && t.contains(ids[0]), "{t}");
    }
    assert!(caller.calls().is_empty(), "never a second upstream call");

    let admin = reqwest::Client::new();
    let inbox: serde_json::Value = admin
        .get(format!("{url}/admin/v1/unknowns"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(inbox.as_array().unwrap().len(), 2);
    let reconcile = |id: &str, body: serde_json::Value| {
        admin
            .post(format!("{url}/admin/v1/requests/{id}/reconcile"))
            .bearer_auth(ADMIN)
            .json(&body)
            .send()
    };
    // Name, reason and (for done) the result are required.
    let r = reconcile(
        ids[0],
        serde_json::json!({"outcome": "confirmed_done", "actor": "ana", "reason": "seen"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 422);
    assert!(r.text().await.unwrap().contains("result_id"));
    let r = reconcile(
        ids[0],
        serde_json::json!({"outcome": "confirmed_not_executed", "actor": "", "reason": "x"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 422);
    // Not executed: the key may run again, once.
    let r = reconcile(
        ids[0],
        serde_json::json!({"outcome": "confirmed_not_executed", "actor": "ana", "reason": "no trace at the provider"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(send("refund-1").await.unwrap().status(), 200);
    assert_eq!(caller.calls().len(), 1);
    assert_eq!(send("refund-1").await.unwrap().status(), 200, "then replayed");
    assert_eq!(caller.calls().len(), 1);
    // Done: never sent again; the repeat names the result the owner attached.
    let r = reconcile(
        ids[1],
        serde_json::json!({"outcome": "confirmed_done", "result_id": "chatcmpl-9", "actor": "ken", "reason": "in the provider's logs"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let again = reconcile(
        ids[1],
        serde_json::json!({"outcome": "confirmed_done", "result_id": "chatcmpl-9", "actor": "ken", "reason": "again"}),
    )
    .await
    .unwrap();
    assert_eq!(again.status(), 409);
    let r = send("refund-2").await.unwrap();
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("chatcmpl-9"));
    assert_eq!(caller.calls().len(), 1);
    let audit: serde_json::Value = admin
        .get(format!("{url}/admin/v1/audit?kind=request"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(audit.as_array().unwrap().len(), 2);
    assert_eq!(audit[0]["actor"], "ken");
    gw.shutdown().await.unwrap();
}

// --- cost: balances, settlement and the cost trigger -----------------------------------

/// A catalog pricing model `m` at $1,000 per million output tokens (input free): 125
/// output tokens cost exactly $0.125.
fn priced_config(dir: &Path, extra: &str) -> Config {
    let pricing = dir.join("pricing.yaml");
    std::fs::write(
        &pricing,
        "models:\n  - {model: m, provider: openai, input: 0, output: 1000, checked: 2026-11-30, source: https://example.com/p}\n",
    )
    .unwrap();
    config(&format!("pricing: {}\n{extra}", pricing.display()), &[("a", 8)])
}

fn answers(n: usize, output: u64) -> Scripted {
    let usage = Usage {
        input_tokens: Some(10),
        output_tokens: Some(output),
        ..Default::default()
    };
    Scripted::with(&vec![("a", Step::AnswerWith(usage)); n])
}

#[tokio::test]
async fn b3_b4_a_request_admitted_with_balance_completes_below_zero_then_402_until_a_top_up() {
    // spec: B3, B4, M1
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = priced_config(dir.path(), "");
    cfg.owners[0].balance_usd = Some(0.2);
    let gw = serve(cfg, Ledger::start(Arc::new(Memory::default())), answers(8, 125)).await;
    let url = format!("http://{}", gw.addr);
    let balance = || gw.state.accounts.owners(clock::now())[0].balance_usd;
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert!((balance() - 0.075).abs() < 1e-9, "{}", balance());
    // B4: admitted with $0.075 left, it costs $0.125 and completes all the same.
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert!((balance() + 0.05).abs() < 1e-9, "{}", balance());
    // B3: at or below zero, refused before anything goes upstream.
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 402);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["message"],
        "Insufficient balance. Top up at the dashboard."
    );
    assert_eq!(body["error"]["type"], "insufficient_quota");
    let calls = |gw: &crate::Running| gw.state.accounts.keys()[0].spent_usd;
    assert!((calls(&gw) - 0.25).abs() < 1e-9);
    // The deficit is taken from the next top-up: $0.10 leaves $0.05, enough for one more.
    gw.state.accounts.credit("team", 0.1);
    assert!((balance() - 0.05).abs() < 1e-9, "{}", balance());
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 402);
}

#[tokio::test]
async fn b3_a_key_at_its_spend_limit_gets_402() {
    // spec: B3
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = priced_config(dir.path(), "");
    cfg.keys[0].spend_limit_usd = Some(0.25);
    let gw = serve(cfg, Ledger::start(Arc::new(Memory::default())), answers(8, 125)).await;
    let url = format!("http://{}", gw.addr);
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 402);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["message"], "This API key has reached its spend limit.");
    // An operator lifts the limit: the key works again.
    assert!(gw.state.accounts.set_spend_limit("app", None));
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn g1_the_last_hours_cost_above_a_quarter_of_the_daily_budget_opens_the_breaker() {
    // spec: G1, M3
    let dir = tempfile::tempdir().unwrap();
    let cfg = priced_config(dir.path(), "budgets: {routes: {openai/m: 1.0}}\n");
    let caller = answers(8, 125);
    let gw = serve(cfg, Ledger::start(Arc::new(Memory::default())), caller).await;
    let url = format!("http://{}", gw.addr);
    let route = || gw.state.control.get("openai/m").unwrap();
    // $0.125 and $0.25: at the threshold (25 % of $1.00), not above it.
    for _ in 0..2 {
        assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    }
    assert_eq!(route().state(), spillway_control::BreakerState::Closed);
    // $0.375: above. The request that crossed it completed; the next fails fast.
    assert_eq!(chat(&url, "m").send().await.unwrap().status(), 200);
    assert_eq!(route().state(), spillway_control::BreakerState::Open);
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 503);
    let view = route().view("");
    assert_eq!(view.breaker.trigger.map(|t| format!("{t:?}")), Some("Cost".to_owned()));
    let budgets = gw.state.accounts.routes(clock::now());
    let b = budgets.iter().find(|b| b.route == "openai/m").unwrap();
    assert!((b.last_hour_usd - 0.375).abs() < 1e-9 && (b.spent_today_usd - 0.375).abs() < 1e-9);
}

#[tokio::test]
async fn m1_an_unpriced_models_cost_is_unknown_never_zero() {
    // spec: M1, M3
    let mem = Arc::new(Memory::default());
    let gw = serve(config("", &[("a", 4)]), Ledger::start(mem.clone()), answers(1, 125)).await;
    let url = format!("http://{}", gw.addr);
    let r = chat(&url, "m").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    gw.state.ledger.flush().await.unwrap();
    let last = mem
        .writes
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r.id == id)
        .cloned()
        .unwrap();
    assert_eq!(last.state, RequestState::Done);
    assert_eq!(
        (last.output_tokens, last.cost_usd, last.estimated_cost_usd),
        (Some(125), None, None)
    );
    // The input was still counted before the call (a real tokenizer, or its stand-in
    // while the table loads): the message "hi" and its framing.
    assert!(
        last.estimated_input_tokens.is_some_and(|n| (3..=20).contains(&n)),
        "{last:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn o1_the_gate_pauses_caps_and_frees_only_its_own_places() {
    // spec: O1, O2
    let (st, _) = state_with(config("", &[("a", 64)]));
    let route = st.control.route(&st, Format::OpenAi, "m");
    let enter = || match route.admit(&st) {
        Admit::Send(slot) => Ok(slot),
        Admit::Held(h) => Err(h),
        _ => panic!("the breaker is closed: only the gate decides here"),
    };
    assert!(enter().unwrap().is_none(), "no run: no gate");
    // Isolated: refused, retries and jobs held.
    route.set_gate(Some(("run-a", 0, 1, true)));
    let held = enter().err().unwrap();
    assert!(held.paused && held.run == "run-a");
    assert!(route.retries_held() && route.jobs_held());
    // Resuming with one place: the second request waits for the first.
    route.set_gate(Some(("run-a", 25, 1, true)));
    let first = enter().ok().flatten().unwrap();
    let full = enter().err().unwrap();
    assert!(
        !full.paused && full.reason.contains("1 of 1 in flight"),
        "{}",
        full.reason
    );
    // Its outcomes are the stage's; after the share changes they are not the next one's.
    first.outcome(Outcome::ProviderFailure);
    first.outcome(Outcome::Neutral);
    assert_eq!(route.take_outcomes().len(), 1);
    route.set_gate(Some(("run-a", 50, 1, true)));
    first.outcome(Outcome::ProviderFailure);
    assert!(route.take_outcomes().is_empty());
    // Another run's gate: the first run's place, freed late, frees nothing of it.
    route.set_gate(None);
    route.set_gate(Some(("run-b", 25, 1, true)));
    let second = enter().unwrap().unwrap();
    drop(first);
    assert!(enter().is_err(), "an old run's slot freed a place of the new run");
    drop(second);
    assert!(enter().unwrap().is_some());
    route.set_gate(None);
    assert!(!route.retries_held() && !route.jobs_held());
}

#[tokio::test]
async fn a_request_in_flight_holds_a_few_kib_of_state() {
    // Every request in flight holds its handler's state, sized for the largest thing
    // it may await; a thousand streams waiting for their first token hold a thousand.
    // Closing and job submission, each larger than the rest, are boxed so that they
    // reserve nothing until they run. (`handle` is `pub(crate)` for this test.)
    let (st, _) = state_with(config("", &[("a", 4)]));
    let req = http::Request::post("/v1/chat/completions")
        .body(axum::body::Body::empty())
        .unwrap();
    let handler = crate::ingress::handle(
        st.clone(),
        Arc::new(crate::upstream::HttpCaller),
        Format::OpenAi,
        spillway_wire::Api::Generate,
        None,
        false,
        req,
    );
    let size = std::mem::size_of_val(&handler);
    println!("request handler state: {size} bytes");
    assert!(size < 8 * 1024, "the request handler's state is {size} bytes");
}
