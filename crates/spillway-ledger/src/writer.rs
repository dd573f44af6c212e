//! The single writer task and the [`Ledger`] handle the engine holds.
//!
//! Every write goes through one FIFO queue to one writer task, so a request's states reach
//! the store in the order they happened, whatever the load: a full queue makes the writers
//! that can wait wait (backpressure), and nothing is ever handed to a spawned task that
//! might overtake an earlier write. The writer merges what it takes into a pending batch
//! (the latest state per request, never an earlier one) and group-commits it. When a
//! commit fails (disk full, read-only file, a lock held elsewhere) the batch stays pending
//! — the spool — and is retried until the store takes it; meanwhile the ledger reports
//! itself unhealthy, durable writes are refused at once (so the gateway answers 503
//! instead of calling a provider it cannot account for) and the spool is bounded.

use crate::{
    AttemptRecord, Error, KeyedRequest, LedgerBackend, LedgerFigures, Page, Payload, PgBackend, PruneReport, Reconcile,
    RequestRecord, Result, Search, SideEffect, SqliteBackend,
};
use serde::Serialize;
use spillway_wire::UnixMs;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinHandle;
use ts_rs::TS;

/// Most operations folded into one commit. Bigger batches amortise more but make the
/// durable waiters of the batch wait longer.
const MAX_BATCH: usize = 2048;
/// Queued operations before writers that can wait do wait.
const QUEUE_DEPTH: usize = 65_536;
/// Rows held for a store that refuses writes; past this the writer stops taking from the
/// queue, which then fills and holds its writers back.
const SPOOL_MAX: usize = 100_000;
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// How long fire-and-forget writes wait for a durable write to share a commit with: at
/// most twice this, plus a commit in progress (see `write_loop`), while the store takes
/// commits; a store that refuses them holds everything in the spool until it takes them.
const LINGER: Duration = Duration::from_millis(20);
/// Between two tries of a store that refused a commit.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// Durable commits further apart than this (smoothed) leave fire-and-forget rows to a
/// commit of their own, unsynced, where the store can make one (see `write_loop`).
const QUIET_GAP: Duration = Duration::from_millis(1);

/// How far apart durable commits come, smoothed over the last few: whether the gateway
/// is busy enough that fire-and-forget rows had better ride along with the next one.
/// Riding along costs the request whose commit carries them: its sync writes their
/// pages as well as its own (at 500 req/s, four WAL pages a commit instead of one or two,
/// and 30 to 40 µs on the gateway's added p50). A commit of their own costs CPU: one
/// more commit and thread hand-off, 35 µs more a request at 2,000 req/s when every
/// request had one. While the gateway is busy the next durable commit is close and CPU
/// is what is short, so they ride; while it is not, latency is worth the CPU.
#[derive(Clone, Copy, Debug)]
struct Pace {
    gap: Duration,
    last: Option<tokio::time::Instant>,
}

impl Pace {
    fn new() -> Pace {
        // Idle at first: the first requests get the short commits.
        Pace {
            gap: QUIET_GAP * 4,
            last: None,
        }
    }

    /// A durable commit at `now`.
    fn durable(&mut self, now: tokio::time::Instant) {
        if let Some(last) = self.last {
            // Capped, so that after an idle hour a busy spell is seen for what it is
            // within a few dozen commits.
            let gap = now.saturating_duration_since(last).min(QUIET_GAP * 8);
            self.gap = (self.gap * 7 + gap) / 8;
        }
        self.last = Some(now);
    }

    /// Whether durable commits are far apart now: none for a while, or a slow pace.
    fn sparse(&self, now: tokio::time::Instant) -> bool {
        self.gap >= QUIET_GAP
            || self
                .last
                .is_none_or(|l| now.saturating_duration_since(l) >= QUIET_GAP * 8)
    }
}

enum Op {
    Request(Box<RequestRecord>, Option<oneshot::Sender<Result<()>>>),
    Attempt(Box<AttemptRecord>),
    Payload(Box<Payload>),
    Flush(oneshot::Sender<Result<()>>),
    /// Hears when everything queued before it is committed, without hurrying the commit.
    Notify(oneshot::Sender<Result<()>>),
}

impl Op {
    fn is_waited_on(&self) -> bool {
        matches!(self, Op::Request(_, Some(_)) | Op::Flush(_))
    }
}

/// Whether the ledger is taking writes, as the console and the alerts show it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct LedgerHealth {
    /// Commits are succeeding.
    pub ok: bool,
    /// Since when commits have been failing.
    pub failing_since: Option<UnixMs>,
    /// The store's last refusal (e.g. `database or disk is full`).
    pub error: Option<String>,
    /// Records waiting to be written (the spool), while commits fail.
    pub waiting: u64,
}

impl LedgerHealth {
    fn healthy() -> LedgerHealth {
        LedgerHealth {
            ok: true,
            ..LedgerHealth::default()
        }
    }
}

struct QueueState {
    ops: VecDeque<Op>,
    /// Operations in `ops` that someone waits on (durable writes, flushes).
    waited: usize,
    /// The writer has its linger deadline set and will come back for fire-and-forget
    /// operations by then: queuing one need not wake it.
    lingering: bool,
    /// Queued operations at which the writer is woken, lingering or not: a full batch, or
    /// a queue about to hold its writers back.
    wake_at: usize,
    closed: bool,
}

impl QueueState {
    /// Whether the writer has something to do now.
    fn has_work(&self) -> bool {
        self.closed || self.waited > 0 || self.ops.len() >= self.wake_at || (!self.lingering && !self.ops.is_empty())
    }
}

/// Upper bounds (seconds) of the commit-time histogram's buckets; the last is +Inf.
pub const COMMIT_BUCKETS_S: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// How long the store took for each commit since the ledger opened: what every durable
/// write (and so every request before its upstream call) waits for. A disk whose syncs
/// stall shows here first, before it shows as a slow request.
#[derive(Default)]
struct CommitTimes {
    /// Commits per bucket of [`COMMIT_BUCKETS_S`] (not cumulative), the last one +Inf.
    buckets: [std::sync::atomic::AtomicU64; COMMIT_BUCKETS_S.len() + 1],
    sum_us: std::sync::atomic::AtomicU64,
}

impl CommitTimes {
    fn record(&self, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let s = took.as_secs_f64();
        let i = COMMIT_BUCKETS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(COMMIT_BUCKETS_S.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(took.as_micros() as u64, Relaxed);
    }
}

/// The commit-time histogram as Prometheus wants it: cumulative counts per upper bound.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommitHistogram {
    /// (upper bound in seconds, commits that took at most that), in order; +Inf last.
    pub cumulative: Vec<(f64, u64)>,
    pub sum_seconds: f64,
    pub count: u64,
}

/// The FIFO between the request path and the writer.
struct Queue {
    state: Mutex<QueueState>,
    /// Queued operations before writers that can wait do wait.
    depth: usize,
    /// How often a writer had to wait for room (backpressure at work).
    held_back: std::sync::atomic::AtomicU64,
    /// The writer waits here for work.
    work: Notify,
    /// Writers held back by a full queue wait here.
    space: Notify,
    /// How long commits took.
    commits: CommitTimes,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `op` if there is room; gives it back when the queue is full.
    fn try_push(&self, op: Op) -> Result<Option<Op>> {
        let q = self.lock();
        if q.closed {
            return Err(Error::WriterStopped);
        }
        if q.ops.len() >= self.depth {
            return Ok(Some(op));
        }
        self.enqueue(q, op);
        Ok(None)
    }

    /// Queues `op` under the held lock, and wakes the writer only if it has work now. A
    /// fire-and-forget write rides along with the next durable one, or goes at the linger
    /// deadline: waking the writer for each (a wake-up of another thread, most of the
    /// time) cost more than the write itself.
    fn enqueue(&self, mut q: std::sync::MutexGuard<'_, QueueState>, op: Op) {
        q.waited += usize::from(op.is_waited_on());
        q.ops.push_back(op);
        let wake = q.has_work();
        drop(q);
        if wake {
            self.work.notify_one();
        }
    }

    /// Queues `op`, waiting while the queue is full.
    async fn push(&self, op: Op) -> Result<()> {
        // The common case takes the lock once and registers no waiter.
        let Some(mut op) = self.try_push(op)? else {
            return Ok(());
        };
        loop {
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            op = match self.try_push(op)? {
                None => return Ok(()),
                Some(op) => op,
            };
            self.held_back.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            space.await;
        }
    }

    /// Queues `op` at once, full or not. For code that cannot wait (a stream's end runs
    /// in `poll` or `drop`); such writes are bounded by the streams in flight.
    fn push_now(&self, op: Op) -> Result<()> {
        let q = self.lock();
        if q.closed {
            return Err(Error::WriterStopped);
        }
        self.enqueue(q, op);
        Ok(())
    }

    /// Up to `max` queued operations, oldest first; `None` once closed and empty.
    fn take(&self, max: usize, into: &mut Vec<Op>) -> Option<usize> {
        let mut q = self.lock();
        if q.ops.is_empty() && q.closed {
            return None;
        }
        let n = q.ops.len().min(max);
        let from = into.len();
        into.extend(q.ops.drain(..n));
        q.waited -= into[from..].iter().filter(|o| o.is_waited_on()).count();
        drop(q);
        if n > 0 {
            self.space.notify_waiters();
        }
        Some(n)
    }

    /// Waits until the writer has something to do now: a durable write or a flush, a
    /// full batch, the queue closing, or — unless it is `lingering` (its deadline set) —
    /// anything queued at all.
    async fn ready(&self, lingering: bool) {
        loop {
            let work = self.work.notified();
            tokio::pin!(work);
            work.as_mut().enable();
            {
                let mut q = self.lock();
                q.lingering = lingering;
                if q.has_work() {
                    return;
                }
            }
            work.await;
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.work.notify_one();
        self.space.notify_waiters();
    }
}

/// What the writer holds between taking operations and a successful commit.
#[derive(Default)]
struct Pending {
    requests: Vec<RequestRecord>,
    index: HashMap<String, usize>,
    attempts: Vec<AttemptRecord>,
    payloads: Vec<Payload>,
    acks: Vec<oneshot::Sender<Result<()>>>,
    /// Told at the next commit, whenever it comes.
    lazy: Vec<oneshot::Sender<Result<()>>>,
}

impl Pending {
    fn rows(&self) -> usize {
        self.requests.len() + self.attempts.len() + self.payloads.len()
    }

    fn is_empty(&self) -> bool {
        self.rows() == 0 && self.acks.is_empty() && self.lazy.is_empty()
    }

    fn add(&mut self, op: Op) {
        match op {
            Op::Request(rec, ack) => {
                let mut rec = *rec;
                rec.cap_fields();
                // Rows carry their full latest state, so one per id is written; a state
                // behind the one already pending (a write that lost a race) is dropped.
                match self.index.get(&rec.id) {
                    Some(&i) if rec.state.rank() >= self.requests[i].state.rank() => self.requests[i] = rec,
                    Some(_) => {}
                    None => {
                        self.index.insert(rec.id.clone(), self.requests.len());
                        self.requests.push(rec);
                    }
                }
                if let Some(a) = ack {
                    self.acks.push(a);
                }
            }
            Op::Attempt(a) => {
                let mut a = *a;
                a.cap_fields();
                self.attempts.push(a);
            }
            Op::Payload(p) => self.payloads.push(*p),
            Op::Flush(a) => self.acks.push(a),
            Op::Notify(a) => self.lazy.push(a),
        }
    }

    fn answer(&mut self, result: std::result::Result<(), &str>) {
        for a in self.acks.drain(..).chain(self.lazy.drain(..)) {
            let _ = a.send(result.map_err(|e| Error::Unavailable(e.to_owned())));
        }
    }

    fn clear(&mut self) {
        self.requests.clear();
        self.index.clear();
        self.attempts.clear();
        self.payloads.clear();
    }
}

/// The engine's handle on the ledger. Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    queue: Arc<Queue>,
    backend: Arc<dyn LedgerBackend>,
    health: watch::Receiver<LedgerHealth>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Ledger {
    /// Opens a SQLite ledger at `path` — taking its lock first, so a second instance is
    /// refused before it touches a row — turns requests a crash left in `calling_api`
    /// into `unknown` (I4), and starts the writer.
    pub async fn open_sqlite(path: &Path) -> Result<Ledger> {
        let backend = SqliteBackend::open(path).await?;
        let unknown = backend.mark_interrupted_unknown().await?;
        if unknown > 0 {
            tracing::warn!(
                count = unknown,
                "requests were calling a provider when the gateway last stopped; marked unknown for an owner to reconcile"
            );
        }
        Ok(Ledger::start(Arc::new(backend)))
    }

    /// A PostgreSQL ledger shared by a fleet; `instance` names this gateway instance.
    /// Requests this instance left in `calling_api` when it last stopped become `unknown`
    /// (I4); other instances' in-flight requests are theirs (a survivor takes a dead
    /// instance's over, see [`LedgerBackend::take_over`]).
    ///
    /// A live instance (heartbeat within `stale_after_ms`) of the same name is refused
    /// before anything is touched: its in-flight rows are its own, not this one's to mark.
    pub async fn open_postgres(url: &str, instance: &str, stale_after_ms: i64) -> Result<Ledger> {
        let backend = PgBackend::open(url, instance).await?;
        let now = wall_now();
        if let Some(other) = backend
            .instances()
            .await?
            .into_iter()
            .find(|r| r.id == instance && r.stopped_at.is_none() && now.0 - r.heartbeat_at.0 < stale_after_ms)
        {
            // A restart right after a crash finds its own last heartbeat fresh: if nothing
            // answers where that incarnation listened, it is gone, and the name is this
            // one's (a service manager restarting a crashed gateway must not be refused).
            let answering = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(other.listen.as_str()),
            )
            .await
            .is_ok_and(|c| c.is_ok());
            if answering {
                return Err(Error::InstanceInUse {
                    name: instance.to_owned(),
                    listen: other.listen,
                    age_ms: now.0 - other.heartbeat_at.0,
                });
            }
            tracing::warn!(
                instance,
                listen = %other.listen,
                "this instance's last heartbeat is fresh but nothing answers where it listened: taking the name over"
            );
        }
        let unknown = backend.mark_interrupted_unknown().await?;
        if unknown > 0 {
            tracing::warn!(
                count = unknown,
                instance,
                "requests were calling a provider when this instance last stopped; marked unknown for an owner to reconcile"
            );
        }
        Ok(Ledger::start(Arc::new(backend)))
    }

    /// Starts the writer over any backend.
    pub fn start(backend: Arc<dyn LedgerBackend>) -> Ledger {
        Ledger::start_with_depth(backend, QUEUE_DEPTH)
    }

    fn start_with_depth(backend: Arc<dyn LedgerBackend>, depth: usize) -> Ledger {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState {
                ops: VecDeque::new(),
                waited: 0,
                lingering: false,
                wake_at: MAX_BATCH.min(depth),
                closed: false,
            }),
            depth,
            held_back: Default::default(),
            work: Notify::new(),
            space: Notify::new(),
            commits: CommitTimes::default(),
        });
        let (health_tx, health) = watch::channel(LedgerHealth::healthy());
        let writer = tokio::spawn(write_loop(backend.clone(), queue.clone(), health_tx));
        let b = backend.clone();
        let checkpoints = tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = b.maintain().await {
                    tracing::debug!(error = %e, "ledger checkpoint failed");
                }
            }
        });
        Ledger {
            queue,
            backend,
            health,
            tasks: Arc::new(Mutex::new(vec![writer, checkpoints])),
        }
    }

    /// How long the store's commits have taken since the ledger opened (Prometheus's
    /// `spillway_ledger_commit_seconds`).
    pub fn commit_histogram(&self) -> CommitHistogram {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.queue.commits;
        let mut total = 0;
        let mut cumulative = Vec::with_capacity(COMMIT_BUCKETS_S.len() + 1);
        for (i, b) in c.buckets.iter().enumerate() {
            total += b.load(Relaxed);
            cumulative.push((COMMIT_BUCKETS_S.get(i).copied().unwrap_or(f64::INFINITY), total));
        }
        CommitHistogram {
            cumulative,
            sum_seconds: c.sum_us.load(Relaxed) as f64 / 1e6,
            count: total,
        }
    }

    /// Whether commits are succeeding right now (the request path's check: no copy).
    pub fn is_healthy(&self) -> bool {
        self.health.borrow().ok
    }

    /// The ledger's health, for the console.
    pub fn health(&self) -> LedgerHealth {
        self.health.borrow().clone()
    }

    /// Health changes as they happen (the engine raises alerts from them).
    pub fn watch_health(&self) -> watch::Receiver<LedgerHealth> {
        self.health.clone()
    }

    /// Records `rec` and returns once it is committed. Used before an upstream call (I3).
    /// Refused at once while the store refuses commits: a state that is not durable is
    /// never acknowledged.
    pub async fn put_request_durable(&self, rec: RequestRecord) -> Result<()> {
        let refusing = {
            let h = self.health.borrow();
            (!h.ok).then(|| h.error.clone().unwrap_or_default())
        };
        if let Some(why) = refusing {
            return Err(Error::Unavailable(why));
        }
        let (ack, done) = oneshot::channel();
        self.queue.push(Op::Request(Box::new(rec), Some(ack))).await?;
        done.await.map_err(|_| Error::WriterStopped)?
    }

    /// Records `rec` with the next commit, waiting while the queue is full.
    pub async fn put_request(&self, rec: RequestRecord) -> Result<()> {
        self.queue.push(Op::Request(Box::new(rec), None)).await
    }

    pub async fn put_attempt(&self, rec: AttemptRecord) -> Result<()> {
        self.queue.push(Op::Attempt(Box::new(rec))).await
    }

    /// Records `rec` with the next commit, from code that cannot wait (a stream's end runs
    /// in `poll`/`drop`). Queued in order at once, so a flush that follows sees it.
    pub fn enqueue_request(&self, rec: RequestRecord) {
        if self.queue.push_now(Op::Request(Box::new(rec), None)).is_err() {
            tracing::error!("ledger writer stopped; a request record was lost");
        }
    }

    pub fn enqueue_attempt(&self, rec: AttemptRecord) {
        if self.queue.push_now(Op::Attempt(Box::new(rec))).is_err() {
            tracing::error!("ledger writer stopped; an attempt record was lost");
        }
    }

    /// Records `p` (a request's body copies) with the next commit, from code that cannot
    /// wait; queue it before the request's final record so both share a commit.
    pub fn enqueue_payload(&self, p: Payload) {
        if self.queue.push_now(Op::Payload(Box::new(p))).is_err() {
            tracing::error!("ledger writer stopped; a stored response was lost");
        }
    }

    /// Hears when everything queued so far is committed (readable, not necessarily
    /// synced), without making the writer commit sooner (a flush would): the answer comes
    /// with the next commit, which for a store without unsynced commits is the next
    /// durable write or the linger deadline. Never blocks; a stopped writer answers at once.
    pub fn when_committed(&self) -> oneshot::Receiver<Result<()>> {
        let (tx, rx) = oneshot::channel();
        // Refused by a stopped writer: the sender is dropped, and the receiver hears that.
        let _ = self.queue.push_now(Op::Notify(tx));
        rx
    }

    /// Waits until everything queued so far is committed.
    pub async fn flush(&self) -> Result<()> {
        let (ack, done) = oneshot::channel();
        self.queue.push(Op::Flush(ack)).await?;
        done.await.map_err(|_| Error::WriterStopped)?
    }

    /// Flushes (giving a store that refuses commits `patience` to recover), then stops the
    /// background tasks. Clones of this handle stop working. Closing twice is harmless: the
    /// second close finds the queue closed and returns.
    pub async fn close(&self, patience: Duration) -> Result<()> {
        if self.queue.lock().closed {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + patience;
        let r = loop {
            match tokio::time::timeout_at(deadline, self.flush()).await {
                Ok(Ok(())) => break Ok(()),
                Ok(Err(e)) if tokio::time::Instant::now() < deadline => {
                    tracing::warn!(error = %e, "ledger flush failed at shutdown; retrying");
                    tokio::time::sleep(RETRY_EVERY).await;
                }
                Ok(Err(e)) => break Err(e),
                Err(_) => {
                    break Err(Error::Unavailable(
                        "the ledger did not accept the final flush in time".into(),
                    ));
                }
            }
        };
        if let Err(e) = &r {
            tracing::error!(error = %e, waiting = self.health().waiting, "ledger closed with records unwritten");
        }
        self.queue.close();
        let tasks = self
            .tasks
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        let mut tasks = tasks.into_iter();
        let writer = tasks.next();
        for t in tasks {
            t.abort();
        }
        if let Some(w) = writer {
            // The writer drains what is left and returns once the queue is closed and empty.
            if tokio::time::timeout(Duration::from_secs(2), w).await.is_err() {
                tracing::error!("ledger writer did not stop in time");
            }
        }
        let _ = self.backend.maintain().await;
        r
    }

    pub async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>> {
        self.backend.get_request(id).await
    }

    pub async fn attempts(&self, request_id: &str) -> Result<Vec<AttemptRecord>> {
        self.backend.attempts(request_id).await
    }

    pub async fn search(&self, search: &Search) -> Result<Page> {
        self.backend.search(search).await
    }

    /// G4: a control-plane transition, durable before this returns.
    pub async fn record_transition(
        &self,
        state: Option<&crate::ControlState>,
        audit: &crate::AuditEntry,
    ) -> Result<()> {
        self.backend.record_transition(state, audit).await
    }

    /// The request of gateway key `key_name` whose provider stored `response_id`.
    pub async fn by_response_id(&self, key_name: &str, response_id: &str) -> Result<Option<RequestRecord>> {
        self.backend.by_response_id(key_name, response_id).await
    }

    /// I2: the newest request under `idempotency_key` for `key_name` since `since`.
    pub async fn keyed(
        &self,
        key_name: &str,
        idempotency_key: &str,
        since: UnixMs,
        now: UnixMs,
    ) -> Result<Option<KeyedRequest>> {
        self.backend.keyed(key_name, idempotency_key, since, now).await
    }

    /// I4: an owner reconciles an unknown request. Whatever is queued is committed first,
    /// so the verdict applies to the request's latest state.
    pub async fn reconcile(&self, id: &str, r: &Reconcile, at: UnixMs) -> Result<RequestRecord> {
        self.flush().await?;
        self.backend.reconcile(id, r, at).await
    }

    /// I3: the side-effect step, after whatever is queued (the request's own final
    /// record, maybe) is committed.
    pub async fn side_effect(&self, id: &str, step: &SideEffect, at: UnixMs) -> Result<RequestRecord> {
        self.flush().await?;
        self.backend.side_effect(id, step, at).await
    }

    pub async fn unknowns(&self, limit: u32) -> Result<Vec<RequestRecord>> {
        self.backend.unknowns(limit).await
    }

    pub async fn figures(&self, since: UnixMs) -> Result<LedgerFigures> {
        self.backend.figures(since).await
    }

    pub async fn prune(
        &self,
        now: UnixMs,
        finished_before: Option<UnixMs>,
        keys_since: UnixMs,
        vacuum: bool,
    ) -> Result<PruneReport> {
        self.flush().await?;
        self.backend.prune(now, finished_before, keys_since, vacuum).await
    }

    /// The store itself, for what the request path never touches (accounts, reports).
    pub fn store(&self) -> &dyn LedgerBackend {
        &*self.backend
    }

    pub async fn control_states(&self) -> Result<Vec<crate::ControlState>> {
        self.backend.control_states().await
    }

    pub async fn audit(&self, kind: Option<&str>, subject: Option<&str>, limit: u32) -> Result<Vec<crate::AuditEntry>> {
        self.backend.audit(kind, subject, limit).await
    }
}

fn wall_now() -> UnixMs {
    UnixMs::from_system(SystemTime::now())
}

async fn write_loop(backend: Arc<dyn LedgerBackend>, queue: Arc<Queue>, health: watch::Sender<LedgerHealth>) {
    use tokio::time::Instant;
    let mut pending = Pending::default();
    let mut ops = Vec::with_capacity(MAX_BATCH);
    let mut failing = false;
    // Fire-and-forget writes (a request's end, its attempts) wait for a durable write to
    // share its commit — commits, not rows, are what the disk pays for — but never past
    // the linger deadline. While durable writes are sparse (see `Pace`), they are
    // committed at once instead, without a sync of their own, where the store can
    // (SQLite): the next synced commit syncs them with its own frames, and a lone
    // request's synced commit writes only its own row. The linger deadline then bounds how
    // long an unsynced commit waits for a sync when no durable write comes. One timer
    // serves every request that comes meanwhile: arming one per batch made nearly every
    // request register a timer, and so wake the runtime's driver thread.
    let linger = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(linger);
    let mut armed = false;
    // Rows are held for a durable write (the store could not commit them unsynced).
    let mut holding = false;
    // The first commit made without a sync since the last synced one (or sync). The
    // deadline syncs only what has waited the whole linger: the timer was armed by an
    // earlier unsynced commit that a durable write may since have synced, and at 500
    // requests/s, each with a durable write and an unsynced end, a deadline that synced
    // whatever it found unsynced made one sync of every twenty requests a second
    // `fdatasync` of its own, racing the next durable commit's.
    let mut unsynced: Option<Instant> = None;
    let mut last_durable: Option<Instant> = None;
    let mut pace = Pace::new();
    loop {
        let mut deadline_passed = false;
        // A store that refused a commit is retried on its own schedule (below).
        if !failing || pending.is_empty() {
            tokio::select! {
                biased;
                () = queue.ready(holding) => {}
                () = &mut linger, if armed => {
                    armed = false;
                    deadline_passed = true;
                }
            }
        }
        // What was committed unsynced since the timer was set is younger than the linger:
        // its own deadline is later.
        let sync_due = deadline_passed && unsynced.is_some_and(|t| t.elapsed() >= LINGER);
        if deadline_passed
            && !sync_due
            && let Some(t) = unsynced
        {
            linger.as_mut().reset(t + LINGER);
            armed = true;
        }
        // Group commit: take whatever is queued (the spool permitting).
        let closed = pending.rows() < SPOOL_MAX && queue.take(MAX_BATCH, &mut ops).is_none();
        if closed && pending.is_empty() && unsynced.is_none() {
            return;
        }
        for op in ops.drain(..) {
            pending.add(op);
        }
        let waited_on = !pending.acks.is_empty();
        if pending.rows() == 0 && unsynced.is_some() && !failing && (waited_on || sync_due || closed) {
            // Nothing to commit, but earlier commits to make durable: for a flush, the
            // linger deadline, or the last thing before stopping.
            let r = backend.sync().await;
            if let Err(e) = &r {
                tracing::error!(error = %e, "ledger sync failed; the last unsynced commits may not survive a power loss");
            }
            unsynced = None;
            let why = r.as_ref().err().map(ToString::to_string);
            pending.answer(why.as_deref().map_or(Ok(()), Err));
            if closed {
                return;
            }
            continue;
        }
        if closed && pending.is_empty() {
            return;
        }
        if pending.is_empty() {
            continue;
        }
        let mut quiet = false;
        if !waited_on && !failing && !closed && pending.rows() < MAX_BATCH {
            // Only fire-and-forget rows.
            let unsynced = if pace.sparse(Instant::now()) {
                backend
                    .write_batch_unsynced(&pending.requests, &pending.attempts, &pending.payloads)
                    .await
            } else {
                Ok(false)
            };
            match unsynced {
                Ok(true) => quiet = true,
                Ok(false) => {
                    // They go at the deadline, unless a durable write was committed since
                    // the deadline was set: then one is likely close, and they wait for it,
                    // for one more period at the most.
                    let go = deadline_passed && last_durable.is_none_or(|t| t.elapsed() >= LINGER);
                    if !go {
                        holding = true;
                        if !armed {
                            linger.as_mut().reset(Instant::now() + LINGER);
                            armed = true;
                        }
                        continue;
                    }
                }
                Err(e) => {
                    fail(&mut pending, &mut failing, &health, e).await;
                    continue;
                }
            }
        }
        holding = false;
        if failing {
            // A store that refuses commits acknowledges nothing: durable waiters hear at
            // once, and the records wait in the spool for the next try.
            let why = health.borrow().error.clone().unwrap_or_default();
            pending.answer(Err(&why));
        }
        let result = if quiet || pending.rows() == 0 {
            Ok(())
        } else {
            let t = Instant::now();
            let r = backend
                .write_batch(&pending.requests, &pending.attempts, &pending.payloads)
                .await;
            if r.is_ok() {
                // Synced commits only: what the durable writes wait for.
                queue.commits.record(t.elapsed());
            }
            r
        };
        match result {
            Ok(()) => {
                let rows = pending.rows();
                pending.clear();
                if quiet {
                    let since = *unsynced.get_or_insert_with(Instant::now);
                    if !armed {
                        linger.as_mut().reset(since + LINGER);
                        armed = true;
                    }
                } else if rows > 0 {
                    // The commit is durable (the store syncs it before it returns), and
                    // so is every unsynced one before it: the waiters hear now.
                    unsynced = None;
                    if waited_on {
                        let now = Instant::now();
                        last_durable = Some(now);
                        pace.durable(now);
                    }
                }
                pending.answer(Ok(()));
                if failing {
                    failing = false;
                    tracing::warn!("ledger writes succeed again; the spool is written");
                    health.send_replace(LedgerHealth::healthy());
                }
            }
            Err(e) => fail(&mut pending, &mut failing, &health, e).await,
        }
    }
}

/// A commit failed: its waiters hear why, the records stay for the next try (after a
/// pause), and the ledger's health says so.
async fn fail(pending: &mut Pending, failing: &mut bool, health: &watch::Sender<LedgerHealth>, e: Error) {
    let rows = pending.rows();
    let why = match e {
        Error::Unavailable(m) => m,
        e => e.to_string(),
    };
    pending.answer(Err(&why));
    if !*failing {
        tracing::error!(error = %why, rows, "ledger commit failed; holding the records and retrying");
    }
    *failing = true;
    let since = health.borrow().failing_since.unwrap_or_else(wall_now);
    health.send_replace(LedgerHealth {
        ok: false,
        failing_since: Some(since),
        error: Some(why),
        waiting: rows as u64,
    });
    tokio::time::sleep(RETRY_EVERY).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdb::{Kind, TestDb, both_backends, rec};
    use crate::{InstanceRow, JobRecord, RequestState, TakeOver};
    use async_trait::async_trait;
    use spillway_wire::ErrorClass;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    both_backends! {
        async fn i3_durable_calling_api_then_done(db) {
            // spec: I3
            let ledger = db.ledger().await;
            ledger
                .put_request_durable(rec("r1", RequestState::CallingApi))
                .await
                .unwrap();
            // Visible from another connection as soon as the durable put returns.
            let got = ledger.get_request("r1").await.unwrap().unwrap();
            assert_eq!(got.state, RequestState::CallingApi);
            let mut done = rec("r1", RequestState::Done);
            done.http_status = Some(200);
            done.output_tokens = Some(u64::from(u32::MAX) + 5);
            done.attempts = 1;
            ledger.put_request(done.clone()).await.unwrap();
            let mut att = AttemptRecord::started("r1", 1, "openai-a", UnixMs(2));
            att.upstream_request_id = Some("up-1".into());
            att.http_status = Some(200);
            att.error_class = ErrorClass::Success;
            att.first_byte_at = Some(UnixMs(3));
            att.finished_at = Some(UnixMs(4));
            att.decision = Some(crate::Decision::Done);
            att.ready_at = Some(UnixMs(1_780_000_000_000));
            ledger.put_attempt(att.clone()).await.unwrap();
            ledger.flush().await.unwrap();
            assert_eq!(ledger.get_request("r1").await.unwrap().unwrap(), done);
            assert_eq!(ledger.attempts("r1").await.unwrap(), vec![att]);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    // SQLite only: a SQLite ledger is a file, whose directory is made when missing.
    #[tokio::test]
    async fn a_missing_ledger_directory_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/ledger.db");
        let ledger = Ledger::open_sqlite(&path).await.unwrap();
        ledger
            .put_request_durable(rec("r1", RequestState::CallingApi))
            .await
            .unwrap();
        ledger.close(Duration::from_secs(1)).await.unwrap();
        assert!(path.is_file());
    }

    both_backends! {
        async fn i4_calling_api_becomes_unknown_on_restart(db) {
            // spec: I4
            let ledger = db.ledger().await;
            ledger
                .put_request_durable(rec("r1", RequestState::CallingApi))
                .await
                .unwrap();
            ledger.put_request_durable(rec("r2", RequestState::Done)).await.unwrap();
            ledger.close(Duration::from_secs(1)).await.unwrap();
            drop(ledger);
            // The same instance starting again (on PostgreSQL: the same instance name).
            let reopened = db.ledger().await;
            let r1 = reopened.get_request("r1").await.unwrap().unwrap();
            assert_eq!(r1.state, RequestState::Unknown);
            assert_eq!(
                r1.error_class,
                Some(crate::FailureClass::Gateway(crate::GatewayClass::Interrupted))
            );
            assert_eq!(
                reopened.get_request("r2").await.unwrap().unwrap().state,
                RequestState::Done
            );
        }
    }

    // SQLite only: the lock file beside the ledger file keeps a second instance out (on
    // PostgreSQL, instances share the ledger: R1).
    #[tokio::test]
    async fn a_second_instance_is_refused_before_it_touches_a_row() {
        let db = TestDb::sqlite().await;
        let path = db.path();
        let first = Ledger::open_sqlite(&path).await.unwrap();
        first
            .put_request_durable(rec("r1", RequestState::CallingApi))
            .await
            .unwrap();
        let e = match Ledger::open_sqlite(&path).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a second writer opened the ledger"),
        };
        assert!(
            e.contains("in use by another Spillway") && e.contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        // The running instance's in-flight row was not marked unknown by the refused one.
        assert_eq!(
            first.get_request("r1").await.unwrap().unwrap().state,
            RequestState::CallingApi
        );
        first.close(Duration::from_secs(1)).await.unwrap();
        drop(first);
        // Released with the first instance.
        let again = Ledger::open_sqlite(&path).await.unwrap();
        again.close(Duration::from_secs(1)).await.unwrap();
    }

    both_backends! {
        async fn the_store_refuses_to_move_a_request_backwards(db) {
            let ledger = db.ledger().await;
            let mut done = rec("r1", RequestState::Done);
            done.http_status = Some(200);
            ledger.put_request(done.clone()).await.unwrap();
            ledger.flush().await.unwrap();
            // A late `calling_api` (in its own batch, so only the store can refuse it).
            ledger
                .put_request_durable(rec("r1", RequestState::CallingApi))
                .await
                .unwrap();
            assert_eq!(ledger.get_request("r1").await.unwrap().unwrap(), done);
            // Within one batch too: the later state wins whatever order the writes take.
            ledger.put_request(rec("r2", RequestState::Failed)).await.unwrap();
            ledger.put_request(rec("r2", RequestState::CallingApi)).await.unwrap();
            ledger.flush().await.unwrap();
            assert_eq!(
                ledger.get_request("r2").await.unwrap().unwrap().state,
                RequestState::Failed
            );
        }
    }

    /// A UUIDv7-shaped id of millisecond `ms` (ids sort by time, as the gateway's do).
    fn id_at(ms: i64, n: u64) -> String {
        format!("{:08x}-{:04x}-7000-8000-{n:012x}", ms >> 16, ms & 0xffff)
    }

    fn keyed_rec(id: &str, state: RequestState, key: &str, at: i64) -> RequestRecord {
        let mut r = rec(id, state);
        r.idempotency_key = Some(key.into());
        r.received_at = UnixMs(at);
        r
    }

    fn stored(id: &str, body: &[u8], expires_at: i64) -> Payload {
        Payload {
            request_id: id.into(),
            expires_at: UnixMs(expires_at),
            request_body: None,
            response: Some(crate::StoredResponse {
                status: 200,
                content_type: "text/event-stream".into(),
                body: body.to_vec(),
            }),
        }
    }

    both_backends! {
        async fn i2_a_key_finds_its_newest_request_and_stored_response_until_they_expire(db) {
            // spec: I2, I6
            let ledger = db.ledger().await;
            let (a, b) = (id_at(1_000_000, 1), id_at(1_000_500, 2));
            // The first run failed (its key may run again); the second completed.
            let mut failed = keyed_rec(&a, RequestState::Failed, "k-1", 1_000_000);
            failed.http_status = Some(503);
            ledger.put_request(failed).await.unwrap();
            ledger
                .put_request(keyed_rec(&b, RequestState::Done, "k-1", 1_000_500))
                .await
                .unwrap();
            // Binary and event-stream bytes survive as they are.
            let body = b"data: {\"x\":1}\n\n\x00\xff data: [DONE]\n\n";
            ledger.enqueue_payload(stored(&b, body, 2_000_000));
            // Another gateway key's same Idempotency-Key is another key.
            let mut other = keyed_rec(&id_at(1_000_600, 3), RequestState::Done, "k-1", 1_000_600);
            other.key_name = Some("other-app".into());
            ledger.put_request(other).await.unwrap();
            ledger.flush().await.unwrap();

            let found = ledger
                .keyed("app", "k-1", UnixMs(0), UnixMs(1_500_000))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(found.request.id, b);
            let r = found.response.unwrap();
            assert_eq!(
                (r.status, r.content_type.as_str(), r.body.as_slice()),
                (200, "text/event-stream", &body[..])
            );
            // The stored copy expires on its own clock; the key on the window's.
            let later = ledger
                .keyed("app", "k-1", UnixMs(0), UnixMs(2_000_000))
                .await
                .unwrap()
                .unwrap();
            assert!(later.response.is_none());
            assert!(
                ledger
                    .keyed("app", "k-1", UnixMs(1_000_501), UnixMs(0))
                    .await
                    .unwrap()
                    .is_none(),
                "a key older than the window is forgotten"
            );
            assert!(
                ledger
                    .keyed("app", "k-2", UnixMs(0), UnixMs(0))
                    .await
                    .unwrap()
                    .is_none()
            );
            // An unknown outcome binds its key past the window: it waits for an owner (L3).
            let u = id_at(900_000, 4);
            ledger
                .put_request(keyed_rec(&u, RequestState::Unknown, "k-3", 900_000))
                .await
                .unwrap();
            ledger.flush().await.unwrap();
            let found = ledger.keyed("app", "k-3", UnixMs(5_000_000), UnixMs(0)).await.unwrap();
            assert_eq!(found.map(|f| f.request.id), Some(u));
            // Pruning removes what expired.
            let report = ledger.prune(UnixMs(2_000_000), None, UnixMs(0), false).await.unwrap();
            assert_eq!((report.payloads, report.requests), (1, 0));
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn i4_an_owner_reconciles_an_unknown_request_once_with_an_audit_entry(db) {
            // spec: I4, L3
            let (a, b) = (id_at(5_000, 1), id_at(5_001, 2));
            {
                let ledger = db.ledger().await;
                for id in [&a, &b] {
                    ledger
                        .put_request_durable(keyed_rec(id, RequestState::CallingApi, id, 5_000))
                        .await
                        .unwrap();
                }
                ledger.close(Duration::from_secs(1)).await.unwrap();
            }
            // A crash left both calling the provider: both are unknown, listed for an owner.
            let ledger = db.ledger().await;
            let listed: Vec<String> = ledger.unknowns(10).await.unwrap().into_iter().map(|r| r.id).collect();
            assert_eq!(listed, [b.clone(), a.clone()]);
            let fig = ledger.figures(UnixMs(0)).await.unwrap();
            assert_eq!(fig.unknown, 2);
            assert_eq!(
                fig.unknown_by_route,
                [crate::RouteCount {
                    route: "openai/gpt-4o-mini".into(),
                    count: 2
                }]
            );
            assert!(fig.bytes > 0);

            let done = Reconcile {
                outcome: crate::Reconciliation::ConfirmedDone,
                result_id: Some("msg-42".into()),
                actor: "kenji".into(),
                reason: "the provider's dashboard shows the completion".into(),
            };
            let r = ledger.reconcile(&a, &done, UnixMs(9_000)).await.unwrap();
            assert_eq!(r.state, RequestState::Done);
            assert_eq!(r.result_id(), Some("msg-42"));
            let res = r.resolution.as_deref().unwrap();
            assert_eq!(res.reconciliation, Some(crate::Reconciliation::ConfirmedDone));
            assert_eq!(
                (res.reconciled_by.as_deref(), res.reconciled_at),
                (Some("kenji"), Some(UnixMs(9_000)))
            );
            // Once only: a second verdict is refused and names who gave the first.
            let again = ledger
                .reconcile(&a, &done, UnixMs(9_001))
                .await
                .unwrap_err()
                .to_string();
            assert!(again.contains("not unknown") && again.contains("kenji"), "{again}");
            assert!(matches!(
                ledger.reconcile("nope", &done, UnixMs(1)).await,
                Err(Error::NotFound)
            ));
            let not_run = Reconcile {
                outcome: crate::Reconciliation::ConfirmedNotExecuted,
                result_id: None,
                actor: "ana".into(),
                reason: "no trace at the provider".into(),
            };
            let r = ledger.reconcile(&b, &not_run, UnixMs(9_500)).await.unwrap();
            assert_eq!(r.state, RequestState::Failed);
            let audit = ledger.audit(Some("request"), None, 10).await.unwrap();
            assert_eq!(
                audit
                    .iter()
                    .map(|e| (e.subject.as_str(), e.actor.as_str(), e.action.as_str()))
                    .collect::<Vec<_>>(),
                [
                    (b.as_str(), "ana", "unknown->confirmed_not_executed"),
                    (a.as_str(), "kenji", "unknown->confirmed_done")
                ]
            );
            assert!(ledger.unknowns(10).await.unwrap().is_empty());
            assert_eq!(ledger.figures(UnixMs(0)).await.unwrap().unknown, 0);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn i3_the_side_effect_step_is_marked_once(db) {
            // spec: I3
            let ledger = db.ledger().await;
            let id = id_at(7_000, 1);
            ledger
                .put_request(keyed_rec(&id, RequestState::CallingApi, "k", 7_000))
                .await
                .unwrap();
            // Not before the answer arrived.
            let early = ledger.side_effect(&id, &SideEffect::Pending, UnixMs(7_001)).await;
            assert!(matches!(early, Err(Error::Conflict(m)) if m.contains("calling_api")));
            ledger
                .put_request(keyed_rec(&id, RequestState::Done, "k", 7_000))
                .await
                .unwrap();
            let r = ledger
                .side_effect(&id, &SideEffect::Pending, UnixMs(7_002))
                .await
                .unwrap();
            let at = |r: &RequestRecord| r.resolution.as_ref().and_then(|x| x.side_effect_at);
            assert_eq!(
                (r.state, at(&r)),
                (RequestState::SideEffectPending, Some(UnixMs(7_002)))
            );
            // Again: accepted, unchanged.
            let r = ledger
                .side_effect(&id, &SideEffect::Pending, UnixMs(7_003))
                .await
                .unwrap();
            assert_eq!(at(&r), Some(UnixMs(7_002)));
            // A late write from the request path cannot take the pending step back.
            ledger
                .put_request(keyed_rec(&id, RequestState::Done, "k", 7_000))
                .await
                .unwrap();
            ledger.flush().await.unwrap();
            assert_eq!(
                ledger.get_request(&id).await.unwrap().unwrap().state,
                RequestState::SideEffectPending
            );
            let done = SideEffect::Done {
                result_id: "email-9".into(),
            };
            let r = ledger.side_effect(&id, &done, UnixMs(7_004)).await.unwrap();
            assert_eq!((r.state, r.result_id()), (RequestState::Done, Some("email-9")));
            let again = ledger.side_effect(&id, &done, UnixMs(7_005)).await.unwrap();
            assert_eq!(at(&again), Some(UnixMs(7_004)));
            // Never twice with another result, never back to pending.
            let other = SideEffect::Done {
                result_id: "email-10".into(),
            };
            assert!(
                matches!(ledger.side_effect(&id, &other, UnixMs(7_006)).await, Err(Error::Conflict(m)) if m.contains("email-9"))
            );
            assert!(
                ledger
                    .side_effect(&id, &SideEffect::Pending, UnixMs(7_007))
                    .await
                    .is_err()
            );
            // The request path cannot undo it either.
            ledger
                .put_request(keyed_rec(&id, RequestState::Done, "k", 7_000))
                .await
                .unwrap();
            ledger.flush().await.unwrap();
            assert_eq!(
                ledger.get_request(&id).await.unwrap().unwrap().result_id(),
                Some("email-9")
            );
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn i5_attempt_counts_first_attempt_and_ready_at_survive_a_restart(db) {
            // spec: I5
            let id = id_at(8_000, 1);
            {
                let ledger = db.ledger().await;
                let mut r = rec(&id, RequestState::CallingApi);
                r.attempts = 2;
                r.admitted_at = Some(UnixMs(8_001));
                r.next_ready_at = Some(UnixMs(12_000));
                ledger.put_request_durable(r).await.unwrap();
                // The row stays as a crash would leave it (the black-box crash test kills the
                // real process).
                ledger.close(Duration::from_secs(1)).await.unwrap();
            }
            let ledger = db.ledger().await;
            let r = ledger.unknowns(5).await.unwrap().pop().unwrap();
            assert_eq!(r.id, id);
            assert_eq!(
                (r.attempts, r.admitted_at, r.next_ready_at),
                (2, Some(UnixMs(8_001)), Some(UnixMs(12_000)))
            );
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    fn audit_entry(kind: &str, subject: &str, action: &str) -> crate::AuditEntry {
        crate::AuditEntry {
            id: 0,
            at: UnixMs(1),
            kind: kind.into(),
            subject: subject.into(),
            actor: "ops".into(),
            action: action.into(),
            trigger: None,
            reason: "test".into(),
            figures: None,
        }
    }

    both_backends! {
        async fn b4_a_balance_is_credits_minus_costs_seeded_once_and_kept_through_a_prune(db) {
            // spec: B4, B5
            let ledger = db.ledger().await;
            let store = ledger.store();
            let seeds = [("team".to_owned(), 10.0)];
            assert_eq!(store.seed_owners(&seeds, UnixMs(1)).await.unwrap(), ["team"]);
            // The config's seed applies once: a changed config does not reset the balance.
            assert!(
                store
                    .seed_owners(&[("team".to_owned(), 99.0)], UnixMs(2))
                    .await
                    .unwrap()
                    .is_empty()
            );
            for (n, cost, owner) in [
                (0u64, Some(1.5), "team"),
                (1, Some(2.0), "team"),
                (2, None, "team"),
                (3, Some(4.0), "metered"),
            ] {
                let mut r = rec(&id_at(10_000 + n as i64, n), RequestState::Done);
                r.owner = Some(owner.into());
                r.key_name = Some("app".into());
                r.cost_usd = cost;
                ledger.put_request(r).await.unwrap();
            }
            ledger.flush().await.unwrap();
            let balance = |a: &crate::Accounts| {
                let credit: f64 = a.credits.iter().filter(|(o, _)| o == "team").map(|(_, c)| c).sum();
                let spent: f64 = a
                    .spend
                    .iter()
                    .filter(|s| s.owner.as_deref() == Some("team"))
                    .map(|s| s.cost_usd)
                    .sum();
                let folded: f64 = a
                    .key_spend
                    .iter()
                    .filter(|k| k.key_name == "app")
                    .map(|k| k.folded_usd)
                    .sum();
                let key: f64 = a
                    .spend
                    .iter()
                    .filter(|s| s.key_name.as_deref() == Some("app") && s.owner.as_deref() == Some("team"))
                    .map(|s| s.cost_usd)
                    .sum();
                (credit - spent, key + folded)
            };
            assert_eq!(balance(&store.accounts().await.unwrap()), (6.5, 3.5));
            let top_up = crate::BalanceEntry {
                owner: "team".into(),
                at: UnixMs(3),
                kind: "top_up".into(),
                amount_usd: 1.0,
                actor: Some("ops".into()),
                reason: Some("test".into()),
            };
            store
                .credit(&top_up, &audit_entry("owner", "team", "top_up"))
                .await
                .unwrap();
            assert_eq!(balance(&store.accounts().await.unwrap()), (7.5, 3.5));
            // A prune removes the requests and folds their costs in: nothing moves.
            let report = ledger
                .prune(UnixMs(30_000), Some(UnixMs(20_000)), UnixMs(0), false)
                .await
                .unwrap();
            assert_eq!(report.requests, 4);
            let after = store.accounts().await.unwrap();
            assert!(after.spend.is_empty());
            // The key's folded spend includes the metered owner's request on the same key.
            assert_eq!(balance(&after), (7.5, 7.5));
            // Pruned charges do not make a metered owner prepaid; seeding it later starts its
            // balance at the seed, whatever it spent before.
            assert_eq!(after.prepaid, ["team"]);
            assert_eq!(
                store
                    .seed_owners(&[("metered".to_owned(), 5.0)], UnixMs(40_000))
                    .await
                    .unwrap(),
                ["metered"]
            );
            let a = store.accounts().await.unwrap();
            let metered: f64 = a.credits.iter().filter(|(o, _)| o == "metered").map(|(_, c)| c).sum();
            assert_eq!(metered, 5.0);
            assert_eq!(a.prepaid.len(), 2);
            // A metered owner's first top-up is its balance, whatever it spent before.
            let mut r = rec(&id_at(50_000, 9), RequestState::Done);
            r.owner = Some("walk-in".into());
            r.cost_usd = Some(40.0);
            ledger.put_request(r).await.unwrap();
            ledger.flush().await.unwrap();
            let first = crate::BalanceEntry {
                owner: "walk-in".into(),
                at: UnixMs(60_000),
                kind: "top_up".into(),
                amount_usd: 10.0,
                actor: Some("ops".into()),
                reason: Some("test".into()),
            };
            store
                .credit(&first, &audit_entry("owner", "walk-in", "top_up"))
                .await
                .unwrap();
            store
                .credit(&first, &audit_entry("owner", "walk-in", "top_up"))
                .await
                .unwrap();
            let a = store.accounts().await.unwrap();
            let credits: f64 = a.credits.iter().filter(|(o, _)| o == "walk-in").map(|(_, c)| c).sum();
            let spent: f64 = a
                .spend
                .iter()
                .filter(|s| s.owner.as_deref() == Some("walk-in"))
                .map(|s| s.cost_usd)
                .sum();
            assert_eq!(credits - spent, 20.0);
            assert_eq!(ledger.audit(Some("owner"), Some("team"), 5).await.unwrap().len(), 1);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn b5_made_keys_keep_a_hash_revoke_once_and_limits_are_recorded(db) {
            // spec: B5, B3
            let ledger = db.ledger().await;
            let store = ledger.store();
            let key = crate::StoredKey {
                name: "batch".into(),
                owner: "team".into(),
                secret_sha256: "ab".repeat(32),
                hint: "sk-sw-1234".into(),
                rpm: Some(60),
                max_concurrency: None,
                created_at: UnixMs(5),
                created_by: "ops".into(),
                revoked_at: None,
                revoked_by: None,
            };
            store
                .create_key(&key, None, &audit_entry("key", "batch", "created"))
                .await
                .unwrap();
            assert!(matches!(
                store
                    .create_key(&key, Some(1.0), &audit_entry("key", "batch", "created"))
                    .await,
                Err(crate::Error::Conflict(_))
            ));
            store
                .set_spend_limit(
                    "batch",
                    Some(2.5),
                    UnixMs(6),
                    "ops",
                    &audit_entry("key", "batch", "limit"),
                )
                .await
                .unwrap();
            store
                .revoke_key("batch", UnixMs(7), "ops", &audit_entry("key", "batch", "revoked"))
                .await
                .unwrap();
            assert!(matches!(
                store
                    .revoke_key("batch", UnixMs(8), "ops", &audit_entry("key", "batch", "revoked"))
                    .await,
                Err(crate::Error::NotFound)
            ));
            let a = store.accounts().await.unwrap();
            assert_eq!(a.keys.len(), 1);
            assert_eq!((a.keys[0].revoked_at, a.keys[0].rpm), (Some(UnixMs(7)), Some(60)));
            assert_eq!(a.key_spend[0].spend_limit_usd, Some(2.5));
            assert!(a.key_spend[0].limit_set);
            assert_eq!(ledger.audit(Some("key"), Some("batch"), 10).await.unwrap().len(), 3);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn n1_duplicates_count_keys_that_completed_twice_and_prune_keeps_unknowns(db) {
            // spec: N1, I6
            let ledger = db.ledger().await;
            // One key completed twice (what must never happen), one failed then completed.
            for (n, (key, state)) in [
                ("dup", RequestState::Done),
                ("dup", RequestState::Done),
                ("ok", RequestState::Failed),
                ("ok", RequestState::Done),
            ]
            .into_iter()
            .enumerate()
            {
                ledger
                    .put_request(keyed_rec(&id_at(10_000 + n as i64, n as u64), state, key, 10_000))
                    .await
                    .unwrap();
            }
            ledger
                .put_request(rec(&id_at(10_010, 9), RequestState::Unknown))
                .await
                .unwrap();
            ledger.flush().await.unwrap();
            let fig = ledger.figures(UnixMs(0)).await.unwrap();
            assert_eq!(fig.duplicates, 1);
            assert_eq!(fig.duplicates_by_route[0].route, "openai/gpt-4o-mini");
            assert_eq!(ledger.figures(UnixMs(20_000)).await.unwrap().duplicates, 0);
            // A key still inside its window keeps its requests (else a repeat would run again).
            let report = ledger
                .prune(UnixMs(0), Some(UnixMs(20_000)), UnixMs(10_000), false)
                .await
                .unwrap();
            assert_eq!(report.requests, 0);
            // Finished requests before the cut-off go; the unknown one stays for its owner.
            let report = ledger
                .prune(UnixMs(0), Some(UnixMs(20_000)), UnixMs(10_001), true)
                .await
                .unwrap();
            assert_eq!((report.requests, report.attempts), (4, 0));
            assert_eq!(ledger.unknowns(10).await.unwrap().len(), 1);
            assert!(report.bytes_after > 0);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn g4_control_state_and_audit_survive_a_reopen(db) {
            // spec: G4, D5
            let entry = |subject: &str, action: &str| crate::AuditEntry {
                id: 0,
                at: UnixMs(1_000),
                kind: "breaker".into(),
                subject: subject.into(),
                actor: "gateway".into(),
                action: action.into(),
                trigger: Some("server_errors".into()),
                reason: "25 of the last 50 attempts failed".into(),
                figures: Some(r#"[{"name":"failed_attempts","value":25.0}]"#.into()),
            };
            {
                let ledger = db.ledger().await;
                let state = |s: &str| crate::ControlState {
                    kind: "breaker".into(),
                    subject: "openai/m".into(),
                    state: s.into(),
                    updated_at: UnixMs(1_000),
                };
                ledger
                    .record_transition(Some(&state("{\"v\":1}")), &entry("openai/m", "closed->open"))
                    .await
                    .unwrap();
                ledger
                    .record_transition(Some(&state("{\"v\":2}")), &entry("openai/m", "open->probation"))
                    .await
                    .unwrap();
                ledger
                    .record_transition(None, &entry("openai/other", "closed->open"))
                    .await
                    .unwrap();
                ledger.close(Duration::from_secs(5)).await.unwrap();
            }
            let ledger = db.ledger().await;
            let states = ledger.control_states().await.unwrap();
            assert_eq!(states.len(), 1, "one row per subject, the latest");
            assert_eq!(states[0].state, "{\"v\":2}");
            let all = ledger.audit(None, None, 10).await.unwrap();
            assert_eq!(all.len(), 3);
            assert_eq!(all[0].subject, "openai/other", "newest first");
            let mine = ledger.audit(Some("breaker"), Some("openai/m"), 10).await.unwrap();
            assert_eq!(
                mine.iter().map(|e| e.action.as_str()).collect::<Vec<_>>(),
                ["open->probation", "closed->open"]
            );
            assert_eq!(
                mine[0].figures.as_deref(),
                Some(r#"[{"name":"failed_attempts","value":25.0}]"#)
            );
        }
    }

    /// A job of gateway key `app` in `state`, due at `ready_at`, last changed at `updated_at`.
    fn job(id: &str, state: &str, ready_at: i64, updated_at: i64) -> JobRecord {
        JobRecord {
            id: id.into(),
            key_name: "app".into(),
            owner: "team-a".into(),
            idempotency_key: format!("job:{id}"),
            workflow: "default".into(),
            policy_version: "v1".into(),
            format: "openai".into(),
            api: "chat".into(),
            path: "/v1/chat/completions".into(),
            endpoint: "/v1/chat/completions".into(),
            headers: "{}".into(),
            body: Some(JOB_BODY.to_vec()),
            body_sha256: "ab".into(),
            route: "openai/gpt-4o-mini".into(),
            requested_model: "gpt-4o-mini".into(),
            priority: "normal".into(),
            lane: Some("background_retry".into()),
            state: state.into(),
            max_attempts: 3,
            created_at: UnixMs(ready_at),
            ready_at: UnixMs(ready_at),
            expires_at: UnixMs(ready_at + 86_400_000),
            updated_at: UnixMs(updated_at),
            ..JobRecord::default()
        }
    }

    const JOB_BODY: &[u8] = br#"{"model":"gpt-4o-mini","messages":[]}"#;

    /// Job `id` leased to `instance` at `at` for 30 s, when it gets it.
    async fn lease(store: &dyn LedgerBackend, id: &str, instance: &str, at: i64) -> Option<JobRecord> {
        store
            .lease_job(id, instance, UnixMs(at), UnixMs(at + 30_000))
            .await
            .unwrap()
    }

    both_backends! {
        async fn j2_a_job_keeps_its_body_and_its_runs_and_policy_versions_are_kept_once(db) {
            // spec: J2, J8
            let ledger = db.ledger().await;
            let store = ledger.store();
            let run = id_at(2_000, 1);
            let mut queued = job("job-1", "queued", 1_000, 1_000);
            queued.request_ids = vec![run.clone()];
            store
                .save_jobs(&[queued.clone()], &[audit_entry("job", "job-1", "submitted")])
                .await
                .unwrap();
            assert_eq!(store.open_jobs().await.unwrap().len(), 1);
            // A save without the body keeps the stored one.
            let mut done = queued;
            done.body = None;
            done.lane = None;
            done.state = "succeeded".into();
            done.updated_at = UnixMs(3_000);
            done.result_status = Some(200);
            done.result_content_type = Some("application/json".into());
            done.result = Some(br#"{"ok":true}"#.to_vec());
            store.save_jobs(&[done], &[]).await.unwrap();
            let got = store.job("job-1").await.unwrap().unwrap();
            assert_eq!(got.body.as_deref(), Some(JOB_BODY));
            assert_eq!(
                (got.state.as_str(), got.result.as_deref(), got.request_ids.clone()),
                ("succeeded", Some(&br#"{"ok":true}"#[..]), vec![run.clone()])
            );
            let by_key = store.job_by_key("app", "job:job-1").await.unwrap().unwrap();
            assert_eq!(by_key.id, "job-1");
            assert!(store.open_jobs().await.unwrap().is_empty());
            let recent = store.recent_jobs(10).await.unwrap();
            assert_eq!(
                (recent.len(), recent[0].body.is_none()),
                (1, true),
                "listed without bodies"
            );
            assert_eq!(ledger.audit(Some("job"), Some("job-1"), 10).await.unwrap().len(), 1);
            // Its runs are its evidence.
            let mut r = rec(&run, RequestState::Done);
            r.job_id = Some("job-1".into());
            ledger.put_request(r).await.unwrap();
            ledger.flush().await.unwrap();
            let runs = store.job_requests("job-1").await.unwrap();
            assert_eq!(runs.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [run.as_str()]);
            // J8: each version recorded once, newest first.
            let version = |v: &str, at: i64| crate::PolicyVersion {
                workflow: "default".into(),
                version: v.into(),
                source: "built-in".into(),
                text: format!("version: {v}\n"),
                loaded_at: UnixMs(at),
            };
            assert!(store.save_policy_version(&version("v1", 1_000)).await.unwrap());
            assert!(
                !store.save_policy_version(&version("v1", 2_000)).await.unwrap(),
                "known"
            );
            assert!(store.save_policy_version(&version("v2", 3_000)).await.unwrap());
            assert_eq!(
                store.policy_versions(Some("default")).await.unwrap(),
                [version("v2", 3_000), version("v1", 1_000)]
            );
            assert!(store.policy_versions(Some("other")).await.unwrap().is_empty());
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn o1_a_recovery_run_and_its_evidence_are_kept(db) {
            // spec: O1
            let ledger = db.ledger().await;
            let store = ledger.store();
            let mut run = crate::RecoveryRow {
                id: "rec-1".into(),
                route: "openai/gpt-4o-mini".into(),
                drill: None,
                step: "detected".into(),
                opened_at: UnixMs(5_000),
                closed_at: None,
                body: "{}".into(),
            };
            store
                .save_recovery(&run, &[audit_entry("recovery", "rec-1", "opened")])
                .await
                .unwrap();
            assert_eq!(store.recoveries(10).await.unwrap(), [run.clone()]);
            run.step = "closed".into();
            run.closed_at = Some(UnixMs(6_000));
            run.body = r#"{"closed":true}"#.into();
            store.save_recovery(&run, &[]).await.unwrap();
            assert_eq!(store.recoveries(10).await.unwrap(), [run]);
            let bundle = b"PK\x03\x04\x00\xff evidence";
            store.save_evidence("rec-1", bundle).await.unwrap();
            assert_eq!(store.evidence("rec-1").await.unwrap().as_deref(), Some(&bundle[..]));
            assert!(store.evidence("rec-2").await.unwrap().is_none());
            assert_eq!(ledger.audit(Some("recovery"), None, 10).await.unwrap().len(), 1);
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        async fn r1_a_job_is_leased_to_one_instance_at_a_time(db) {
            // spec: R1
            let store = db.backend().await;
            let store = &*store;
            let now = 1_790_000_000_000i64;
            store
                .save_jobs(
                    &[
                        job("j1", "queued", now - 1_000, now - 1_000),
                        job("later", "queued", now + 60_000, now - 1_000),
                    ],
                    &[],
                )
                .await
                .unwrap();
            let got = lease(store, "j1", "a", now)
                .await
                .expect("a queued job that is due is leased");
            assert_eq!(got.body.as_deref(), Some(JOB_BODY), "with its body");
            assert!(lease(store, "j1", "b", now + 1).await.is_none(), "a holds it");
            assert!(
                lease(store, "j1", "a", now + 2).await.is_some(),
                "a renews its own lease"
            );
            assert!(
                lease(store, "j1", "b", now + 29_000).await.is_none(),
                "renewed until now + 30_002"
            );
            assert!(
                lease(store, "j1", "b", now + 31_000).await.is_some(),
                "a's lease expired: b takes it"
            );
            assert!(lease(store, "j1", "a", now + 31_001).await.is_none(), "b holds it now");
            assert!(lease(store, "later", "a", now).await.is_none(), "not due yet");
            // b's run ends: the save takes the job out of the queue and releases the lease.
            let mut done = job("j1", "succeeded", now - 1_000, now + 40_000);
            done.lane = None;
            store.save_jobs(&[done], &[]).await.unwrap();
            assert!(
                lease(store, "j1", "b", now + 41_000).await.is_none(),
                "no longer queued"
            );
            assert!(
                lease(store, "j1", "c", now + 100_000).await.is_none(),
                "no longer queued"
            );
            // A stale copy (an older state, saved late) does not overwrite the newer one.
            store
                .save_jobs(&[job("j1", "queued", now - 1_000, now + 10_000)], &[])
                .await
                .unwrap();
            let stored = store.job("j1").await.unwrap().unwrap();
            assert_eq!(
                (stored.state.as_str(), stored.updated_at),
                ("succeeded", UnixMs(now + 40_000))
            );
            assert!(
                lease(store, "j1", "c", now + 100_000).await.is_none(),
                "still not queued"
            );
        }
    }

    both_backends! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn r1_many_contenders_lease_a_job_once(db) {
            // spec: R1
            // Sixteen instances race for one due job, each through its own store (its own
            // pool of connections). A SQLite ledger belongs to one process (its lock file
            // refuses a second store), so there the contenders share the one store.
            let first = db.backend().await;
            let now = 1_790_000_000_000i64;
            first
                .save_jobs(&[job("j1", "queued", now - 1_000, now - 1_000)], &[])
                .await
                .unwrap();
            let mut stores = Vec::new();
            for _ in 0..16 {
                stores.push(match db.kind {
                    Kind::Sqlite => first.clone(),
                    Kind::Postgres => db.backend().await,
                });
            }
            let start = Arc::new(tokio::sync::Barrier::new(stores.len()));
            let mut racers = Vec::new();
            for (n, store) in stores.into_iter().enumerate() {
                let start = start.clone();
                racers.push(tokio::spawn(async move {
                    start.wait().await;
                    lease(&*store, "j1", &format!("i{n}"), now).await
                }));
            }
            let mut winners = Vec::new();
            for (n, racer) in racers.into_iter().enumerate() {
                if let Some(j) = racer.await.unwrap() {
                    assert_eq!(j.body.as_deref(), Some(JOB_BODY));
                    winners.push(n);
                }
            }
            assert_eq!(winners.len(), 1, "leased to {winners:?}");
        }
    }

    both_backends! {
        async fn r1_a_dead_instances_calling_api_rows_become_unknown_for_a_survivor(db) {
            // spec: R1, I4
            // Instance a writes requests and leases a job, then dies; b survives it. On
            // PostgreSQL each request row names the instance that wrote it. A SQLite ledger
            // has one instance and names none: there a take-over leaves requests alone (its
            // own restart marks them unknown, I4) but still stops the dead instance and
            // releases its leases.
            let t0 = 1_790_000_000_000i64;
            let instance = |id: &str, heartbeat_at: i64| InstanceRow {
                id: id.into(),
                boot: format!("boot-{id}"),
                listen: "127.0.0.1:8080".into(),
                version: "test".into(),
                started_at: UnixMs(t0 - 60_000),
                heartbeat_at: UnixMs(heartbeat_at),
                load: "{}".into(),
                ..InstanceRow::default()
            };
            let a = db.ledger_as("a").await;
            a.store()
                .heartbeat(&instance("a", t0), UnixMs(t0 + 30_000))
                .await
                .unwrap();
            let (calling, done) = (id_at(t0, 1), id_at(t0, 2));
            a.put_request_durable(rec(&calling, RequestState::CallingApi))
                .await
                .unwrap();
            a.put_request_durable(rec(&done, RequestState::Done)).await.unwrap();
            a.store()
                .save_jobs(&[job("j1", "queued", t0 - 1_000, t0 - 1_000)], &[])
                .await
                .unwrap();
            assert!(lease(a.store(), "j1", "a", t0).await.is_some());
            // a is never closed: it crashed. b opens the ledger beside it (on SQLite, one
            // process holds the ledger: b works through the same store).
            let b = match db.kind {
                Kind::Postgres => db.ledger_as("b").await,
                Kind::Sqlite => a.clone(),
            };
            // PostgreSQL stamps heartbeats with its own clock: a's must age for real.
            if let Kind::Postgres = db.kind {
                tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
            }
            b.store()
                .heartbeat(&instance("b", t0 + 20_000), UnixMs(t0 + 50_000))
                .await
                .unwrap();
            assert!(lease(b.store(), "j1", "b", t0 + 20_000).await.is_none(), "a holds it");
            let unknowns = match db.kind {
                Kind::Postgres => 1,
                Kind::Sqlite => 0,
            };
            // Stale: a heartbeat more than a second old.
            let took = b
                .store()
                .take_over("b", UnixMs(t0 + 19_000), UnixMs(t0 + 20_000))
                .await
                .unwrap();
            assert_eq!(
                took,
                [TakeOver {
                    instance: "a".into(),
                    unknowns,
                    jobs: vec!["j1".into()],
                }]
            );
            let calling_now = b.get_request(&calling).await.unwrap().unwrap().state;
            match db.kind {
                Kind::Postgres => assert_eq!(calling_now, RequestState::Unknown, "never re-run: for an owner"),
                Kind::Sqlite => assert_eq!(calling_now, RequestState::CallingApi),
            }
            assert_eq!(b.get_request(&done).await.unwrap().unwrap().state, RequestState::Done);
            // Its lease is released: b may run the job (the jobs runner decides whether it does).
            assert!(lease(b.store(), "j1", "b", t0 + 20_000).await.is_some());
            // Taken over once.
            assert!(
                b.store()
                    .take_over("b", UnixMs(t0 + 20_000), UnixMs(t0 + 21_000))
                    .await
                    .unwrap()
                    .is_empty()
            );
            let instances = b.store().instances().await.unwrap();
            let dead = instances.iter().find(|i| i.id == "a").expect("a is listed");
            assert!(dead.stopped_at.is_some());
            assert_eq!((dead.taken_over_by.as_deref(), dead.unknowns), (Some("b"), unknowns));
            let alive = instances.iter().find(|i| i.id == "b").expect("b is listed");
            assert_eq!((alive.stopped_at, alive.taken_over_by.as_deref()), (None, None));
            // SQLite keeps the instance's own time; PostgreSQL stamps its own clock's.
            if let Kind::Sqlite = db.kind {
                assert_eq!(alive.heartbeat_at, UnixMs(t0 + 20_000));
            }
            assert_eq!(instances[0].id, "b", "live ones first");
            b.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    /// A real store that can be made to refuse commits, as a full or read-only disk would,
    /// and that can be slowed down to saturate the queue.
    struct Faulty {
        inner: Arc<dyn LedgerBackend>,
        refuse: AtomicBool,
        /// Synced commits.
        commits: AtomicUsize,
        /// Commits without a sync, and syncs.
        quiet: AtomicUsize,
        syncs: AtomicUsize,
        slow: Option<Duration>,
        /// Whether it passes unsynced commits on to the store (or, like PostgreSQL's
        /// backend, never makes one).
        unsynced: bool,
    }

    #[async_trait]
    impl LedgerBackend for Faulty {
        async fn write_batch(&self, r: &[RequestRecord], a: &[AttemptRecord], p: &[Payload]) -> Result<()> {
            if let Some(d) = self.slow {
                tokio::time::sleep(d).await;
            }
            if self.refuse.load(Ordering::SeqCst) {
                return Err(Error::Unavailable("database or disk is full".into()));
            }
            self.commits.fetch_add(1, Ordering::SeqCst);
            self.inner.write_batch(r, a, p).await
        }
        async fn write_batch_unsynced(&self, r: &[RequestRecord], a: &[AttemptRecord], p: &[Payload]) -> Result<bool> {
            if !self.unsynced {
                return Ok(false);
            }
            if let Some(d) = self.slow {
                tokio::time::sleep(d).await;
            }
            if self.refuse.load(Ordering::SeqCst) {
                return Err(Error::Unavailable("database or disk is full".into()));
            }
            let done = self.inner.write_batch_unsynced(r, a, p).await?;
            if done {
                self.quiet.fetch_add(1, Ordering::SeqCst);
            }
            Ok(done)
        }
        async fn sync(&self) -> Result<()> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            self.inner.sync().await
        }
        async fn by_response_id(&self, k: &str, r: &str) -> Result<Option<RequestRecord>> {
            self.inner.by_response_id(k, r).await
        }
        async fn keyed(&self, k: &str, i: &str, since: UnixMs, now: UnixMs) -> Result<Option<KeyedRequest>> {
            self.inner.keyed(k, i, since, now).await
        }
        async fn reconcile(&self, id: &str, r: &Reconcile, at: UnixMs) -> Result<RequestRecord> {
            self.inner.reconcile(id, r, at).await
        }
        async fn side_effect(&self, id: &str, s: &SideEffect, at: UnixMs) -> Result<RequestRecord> {
            self.inner.side_effect(id, s, at).await
        }
        async fn unknowns(&self, limit: u32) -> Result<Vec<RequestRecord>> {
            self.inner.unknowns(limit).await
        }
        async fn figures(&self, since: UnixMs) -> Result<LedgerFigures> {
            self.inner.figures(since).await
        }
        async fn prune(&self, now: UnixMs, before: Option<UnixMs>, keys: UnixMs, vacuum: bool) -> Result<PruneReport> {
            self.inner.prune(now, before, keys, vacuum).await
        }
        async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>> {
            self.inner.get_request(id).await
        }
        async fn attempts(&self, id: &str) -> Result<Vec<AttemptRecord>> {
            self.inner.attempts(id).await
        }
        async fn search(&self, s: &Search) -> Result<Page> {
            self.inner.search(s).await
        }
        async fn mark_interrupted_unknown(&self) -> Result<u64> {
            self.inner.mark_interrupted_unknown().await
        }
        async fn record_transition(&self, s: Option<&crate::ControlState>, a: &crate::AuditEntry) -> Result<()> {
            self.inner.record_transition(s, a).await
        }
        async fn control_states(&self) -> Result<Vec<crate::ControlState>> {
            self.inner.control_states().await
        }
        async fn audit(&self, k: Option<&str>, s: Option<&str>, n: u32) -> Result<Vec<crate::AuditEntry>> {
            self.inner.audit(k, s, n).await
        }
        async fn accounts(&self) -> Result<crate::Accounts> {
            self.inner.accounts().await
        }
        async fn seed_owners(&self, seeds: &[(String, f64)], at: UnixMs) -> Result<Vec<String>> {
            self.inner.seed_owners(seeds, at).await
        }
        async fn credit(&self, e: &crate::BalanceEntry, a: &crate::AuditEntry) -> Result<()> {
            self.inner.credit(e, a).await
        }
        async fn create_key(&self, k: &crate::StoredKey, l: Option<f64>, a: &crate::AuditEntry) -> Result<()> {
            self.inner.create_key(k, l, a).await
        }
        async fn revoke_key(&self, n: &str, at: UnixMs, by: &str, a: &crate::AuditEntry) -> Result<()> {
            self.inner.revoke_key(n, at, by, a).await
        }
        async fn set_spend_limit(
            &self,
            n: &str,
            l: Option<f64>,
            at: UnixMs,
            by: &str,
            a: &crate::AuditEntry,
        ) -> Result<()> {
            self.inner.set_spend_limit(n, l, at, by, a).await
        }
        async fn spend_since(&self, since: UnixMs) -> Result<Vec<crate::SpendRow>> {
            self.inner.spend_since(since).await
        }
        async fn cost_report(&self, since: UnixMs, bucket: i64) -> Result<Vec<crate::CostCell>> {
            self.inner.cost_report(since, bucket).await
        }
        async fn maintain(&self) -> Result<u64> {
            self.inner.maintain().await
        }
        async fn save_jobs(&self, j: &[crate::JobRecord], a: &[crate::AuditEntry]) -> Result<()> {
            self.inner.save_jobs(j, a).await
        }
        async fn job(&self, id: &str) -> Result<Option<crate::JobRecord>> {
            self.inner.job(id).await
        }
        async fn job_by_key(&self, k: &str, i: &str) -> Result<Option<crate::JobRecord>> {
            self.inner.job_by_key(k, i).await
        }
        async fn open_jobs(&self) -> Result<Vec<crate::JobRecord>> {
            self.inner.open_jobs().await
        }
        async fn recent_jobs(&self, limit: u32) -> Result<Vec<crate::JobRecord>> {
            self.inner.recent_jobs(limit).await
        }
        async fn job_requests(&self, id: &str) -> Result<Vec<RequestRecord>> {
            self.inner.job_requests(id).await
        }
        async fn save_policy_version(&self, v: &crate::PolicyVersion) -> Result<bool> {
            self.inner.save_policy_version(v).await
        }
        async fn policy_versions(&self, w: Option<&str>) -> Result<Vec<crate::PolicyVersion>> {
            self.inner.policy_versions(w).await
        }
        async fn save_recovery(&self, run: &crate::RecoveryRow, audit: &[crate::AuditEntry]) -> Result<()> {
            self.inner.save_recovery(run, audit).await
        }
        async fn recoveries(&self, limit: u32) -> Result<Vec<crate::RecoveryRow>> {
            self.inner.recoveries(limit).await
        }
    }

    async fn faulty(db: &TestDb, slow: Option<Duration>, depth: usize) -> (Ledger, Arc<Faulty>) {
        faulty_with(db, slow, depth, true).await
    }

    async fn faulty_with(db: &TestDb, slow: Option<Duration>, depth: usize, unsynced: bool) -> (Ledger, Arc<Faulty>) {
        let backend = Arc::new(Faulty {
            inner: db.backend().await,
            refuse: AtomicBool::new(false),
            commits: AtomicUsize::new(0),
            quiet: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            slow,
            unsynced,
        });
        (Ledger::start_with_depth(backend.clone(), depth), backend)
    }

    both_backends! {
        async fn a_refusing_store_spools_reports_and_recovers(db) {
            let (ledger, store) = faulty(&db, None, QUEUE_DEPTH).await;
            let mut health = ledger.watch_health();
            assert!(ledger.health().ok);
            store.refuse.store(true, Ordering::SeqCst);
            // The first durable write meets the refusal and is not acknowledged.
            let e = ledger
                .put_request_durable(rec("r1", RequestState::CallingApi))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("disk is full"), "{e}");
            health.wait_for(|h| !h.ok).await.unwrap();
            let h = ledger.health();
            assert!(h.failing_since.is_some() && h.error.as_deref() == Some("database or disk is full"));
            // Later durable writes are refused at once, without waiting for a commit.
            assert!(
                tokio::time::timeout(
                    Duration::from_millis(100),
                    ledger.put_request_durable(rec("r2", RequestState::CallingApi))
                )
                .await
                .expect("refused at once")
                .is_err()
            );
            // Finished records wait in the spool...
            ledger.enqueue_request(rec("r1", RequestState::Failed));
            let mut att = AttemptRecord::started("r3", 1, "a", UnixMs(5));
            att.error_class = ErrorClass::Success;
            ledger.put_attempt(att).await.unwrap();
            ledger.put_request(rec("r3", RequestState::Done)).await.unwrap();
            health.wait_for(|h| h.waiting >= 3).await.unwrap();
            assert!(ledger.get_request("r3").await.unwrap().is_none());
            // ...and are written when the store takes commits again.
            store.refuse.store(false, Ordering::SeqCst);
            health.wait_for(|h| h.ok).await.unwrap();
            ledger.flush().await.unwrap();
            assert_eq!(
                ledger.get_request("r3").await.unwrap().unwrap().state,
                RequestState::Done
            );
            assert_eq!(
                ledger.get_request("r1").await.unwrap().unwrap().state,
                RequestState::Failed
            );
            assert_eq!(ledger.attempts("r3").await.unwrap().len(), 1);
            assert_eq!(ledger.health(), LedgerHealth::healthy());
        }
    }

    both_backends! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn n4_commit_times_are_counted_for_the_metrics(db) {
            // spec: N4
            // Commits take 30 ms here (a slow disk): the histogram says so.
            let (ledger, _) = faulty(&db, Some(Duration::from_millis(30)), QUEUE_DEPTH).await;
            assert_eq!(ledger.commit_histogram().count, 0);
            for n in 0..3 {
                ledger
                    .put_request_durable(rec(&format!("r{n}"), RequestState::CallingApi))
                    .await
                    .unwrap();
            }
            let h = ledger.commit_histogram();
            assert_eq!(h.count, 3, "{h:?}");
            assert_eq!(h.cumulative.last(), Some(&(f64::INFINITY, 3)));
            assert!(h.cumulative.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{h:?}");
            let under_25ms = h.cumulative.iter().find(|(le, _)| *le == 0.025).unwrap().1;
            assert_eq!(under_25ms, 0, "none took less than 30 ms: {h:?}");
            assert!(h.sum_seconds >= 0.09, "{h:?}");
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    both_backends! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn i3_a_durable_write_is_acknowledged_only_after_its_commit_and_shares_it(db) {
            // spec: I3
            // Commits take 50 ms (the store syncs inside its commit): a durable put waits for
            // the commit that holds it, and writes that come meanwhile share the next one.
            let (ledger, backend) = faulty(&db, Some(Duration::from_millis(50)), QUEUE_DEPTH).await;
            let t = std::time::Instant::now();
            ledger
                .put_request_durable(rec("first", RequestState::CallingApi))
                .await
                .unwrap();
            assert!(
                t.elapsed() >= Duration::from_millis(50),
                "acknowledged before its commit"
            );
            assert_eq!(backend.commits.load(Ordering::SeqCst), 1);
            assert_eq!(
                ledger.get_request("first").await.unwrap().unwrap().state,
                RequestState::CallingApi,
                "acknowledged, so readable"
            );
            let mut puts = Vec::new();
            for n in 0..200 {
                let l = ledger.clone();
                puts.push(tokio::spawn(async move {
                    l.put_request_durable(rec(&format!("r{n}"), RequestState::CallingApi))
                        .await
                }));
            }
            for p in puts {
                p.await.unwrap().unwrap();
            }
            let commits = backend.commits.load(Ordering::SeqCst);
            assert!(commits < 40, "200 durable writes shared their commits ({commits})");
            ledger.close(Duration::from_secs(1)).await.unwrap();
        }
    }

    // SQLite only: the paused clock would also run out a network store's own timers
    // (connecting, taking a pooled connection) while it waits on its socket.
    #[tokio::test]
    async fn fire_and_forget_writes_ride_with_a_durable_one_or_go_at_the_deadline() {
        // Where the store cannot commit without a sync (PostgreSQL's backend), a request's
        // end and its attempts do not pay for a commit of their own while durable writes
        // come, and are never held past twice the linger deadline.
        let db = TestDb::sqlite().await;
        let (ledger, backend) = faulty_with(&db, None, QUEUE_DEPTH, false).await;
        // The store's own connections keep real time; the writer's deadline is on the
        // paused clock from here.
        tokio::time::pause();
        let commits = || backend.commits.load(Ordering::SeqCst);
        ledger.put_request(rec("a", RequestState::Done)).await.unwrap();
        ledger
            .put_attempt(AttemptRecord::started("a", 1, "ch", UnixMs(5)))
            .await
            .unwrap();
        tokio::time::sleep(LINGER / 2).await;
        assert_eq!(commits(), 0, "held for a durable write");
        ledger
            .put_request_durable(rec("b", RequestState::CallingApi))
            .await
            .unwrap();
        assert_eq!(commits(), 1, "rode along with it");
        // With no durable write to ride with, the deadline writes them.
        ledger.put_request(rec("b", RequestState::Done)).await.unwrap();
        tokio::time::sleep(LINGER * 2 + Duration::from_millis(1)).await;
        assert_eq!(commits(), 2, "written by the deadline");
        // And an idle writer sets no deadline: nothing more is committed.
        tokio::time::sleep(LINGER * 10).await;
        assert_eq!(commits(), 2);
        tokio::time::resume();
        // The count rises as a commit starts: let the last one finish before reading.
        ledger.flush().await.unwrap();
        assert_eq!(
            ledger.get_request("a").await.unwrap().unwrap().state,
            RequestState::Done
        );
        assert_eq!(ledger.attempts("a").await.unwrap().len(), 1);
        assert_eq!(
            ledger.get_request("b").await.unwrap().unwrap().state,
            RequestState::Done
        );
        ledger.close(Duration::from_secs(1)).await.unwrap();
    }

    #[test]
    fn the_pace_says_sparse_when_durable_commits_are_far_apart_or_stop() {
        let t0 = tokio::time::Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        let mut pace = Pace::new();
        assert!(pace.sparse(t0), "idle at first");
        // 2,000 durable commits a second: busy within a few dozen.
        let mut us = 0;
        for _ in 0..40 {
            pace.durable(at(us));
            us += 500;
        }
        assert!(!pace.sparse(at(us)), "{pace:?}");
        // 500 a second: sparse again within a few.
        for _ in 0..12 {
            us += 2_000;
            pace.durable(at(us));
        }
        assert!(pace.sparse(at(us)), "{pace:?}");
        // Busy again, then nothing for a while: sparse without another commit.
        for _ in 0..40 {
            us += 200;
            pace.durable(at(us));
        }
        assert!(!pace.sparse(at(us + 100)));
        assert!(pace.sparse(at(us + 8_000)));
        // An idle hour does not hide a busy spell for long.
        us += 3_600_000_000;
        for _ in 0..40 {
            pace.durable(at(us));
            us += 300;
        }
        assert!(!pace.sparse(at(us)), "{pace:?}");
    }

    /// Polls `done` (a real store's own time) for up to five seconds.
    async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
        let t = std::time::Instant::now();
        while !done().await {
            assert!(t.elapsed() < Duration::from_secs(5), "still not: {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    // SQLite only: PostgreSQL's backend makes no unsynced commits (the test above is its).
    #[tokio::test]
    async fn fire_and_forget_rows_commit_at_once_unsynced_and_are_synced_soon() {
        // A lone request's end does not wait for a durable write: it is committed at
        // once without a sync, readable from the store's other connections, and made
        // durable by the next synced commit, the linger deadline or a flush.
        let db = TestDb::sqlite().await;
        let (ledger, store) = faulty(&db, None, QUEUE_DEPTH).await;
        let count = |c: &AtomicUsize| c.load(Ordering::SeqCst);
        ledger.put_request(rec("a", RequestState::Done)).await.unwrap();
        ledger
            .put_attempt(AttemptRecord::started("a", 1, "ch", UnixMs(5)))
            .await
            .unwrap();
        until("a's end and attempt readable", async || {
            store
                .get_request("a")
                .await
                .unwrap()
                .is_some_and(|r| r.state == RequestState::Done)
                && store.attempts("a").await.unwrap().len() == 1
        })
        .await;
        assert_eq!(count(&store.commits), 0, "no synced commit");
        assert!(count(&store.quiet) >= 1);
        // No more writes come: the deadline syncs them.
        until("synced by the deadline", async || count(&store.syncs) == 1).await;
        // A synced commit makes the unsynced ones before it durable: no sync follows.
        ledger.put_request(rec("b", RequestState::Done)).await.unwrap();
        until("b committed", async || store.get_request("b").await.unwrap().is_some()).await;
        ledger
            .put_request_durable(rec("c", RequestState::CallingApi))
            .await
            .unwrap();
        assert_eq!(count(&store.commits), 1);
        tokio::time::sleep(LINGER * 3).await;
        assert_eq!(count(&store.syncs), 1, "the durable commit synced b's");
        // A flush with nothing left to commit syncs what was committed unsynced (or
        // finds the deadline did).
        ledger.put_request(rec("d", RequestState::Done)).await.unwrap();
        until("d committed", async || store.get_request("d").await.unwrap().is_some()).await;
        ledger.flush().await.unwrap();
        assert_eq!(count(&store.syncs), 2);
        assert_eq!(count(&store.commits), 1);
        // Closing syncs the last of them too.
        ledger.put_request(rec("e", RequestState::Done)).await.unwrap();
        until("e committed", async || store.get_request("e").await.unwrap().is_some()).await;
        let before = count(&store.syncs);
        ledger.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(count(&store.syncs), before + 1);
        for id in ["a", "b", "d", "e"] {
            assert_eq!(
                store.get_request(id).await.unwrap().unwrap().state,
                RequestState::Done,
                "{id}"
            );
        }
    }

    // SQLite only, as above.
    #[tokio::test]
    async fn i3_the_deadline_syncs_only_what_no_durable_write_synced_in_time() {
        // spec: I3. A request every 5 ms, as at a steady low rate: its durable write, then
        // its end committed unsynced, which the next request's synced commit makes
        // durable. The linger deadline, armed by one end and firing while a younger one
        // waits, must not sync that one as well: an `fdatasync` that bought nothing.
        let db = TestDb::sqlite().await;
        let (ledger, store) = faulty(&db, None, QUEUE_DEPTH).await;
        let count = |c: &AtomicUsize| c.load(Ordering::SeqCst);
        // Ends that waited a whole linger for the next synced commit (a slow machine),
        // which the deadline may rightly sync.
        let mut waited_long = 0;
        let mut last_end: Option<std::time::Instant> = None;
        // The last request's end comes after the count.
        for i in 0..=60 {
            let id = format!("r{i}");
            ledger
                .put_request_durable(rec(&id, RequestState::CallingApi))
                .await
                .unwrap();
            if last_end.is_some_and(|t| t.elapsed() >= LINGER) {
                waited_long += 1;
            }
            if i == 60 {
                break;
            }
            last_end = Some(std::time::Instant::now());
            ledger.put_request(rec(&id, RequestState::Done)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            count(&store.quiet) >= 30,
            "the ends were committed unsynced: {}",
            count(&store.quiet)
        );
        assert!(
            count(&store.syncs) <= waited_long,
            "{} syncs of their own for {waited_long} ends that waited a whole linger",
            count(&store.syncs)
        );
        // The last end still gets its sync from the deadline.
        ledger.put_request(rec("r60", RequestState::Done)).await.unwrap();
        let before = count(&store.syncs);
        until("the last end synced by the deadline", async || {
            count(&store.syncs) == before + 1
        })
        .await;
        assert_eq!(
            store.get_request("r60").await.unwrap().unwrap().state,
            RequestState::Done
        );
    }

    both_backends! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_saturated_queue_keeps_every_request_in_order(db) {
            // A slow store (every commit 5 ms) and a short queue under thousands of requests
            // writing their states back to back, from code that waits and from code that
            // cannot: the queue fills, writers are held back, and every request still ends in
            // its last state.
            let (ledger, store) = faulty(&db, Some(Duration::from_millis(5)), 64).await;
            let mut handles = Vec::new();
            for n in 0..3000 {
                let l = ledger.clone();
                handles.push(tokio::spawn(async move {
                    let id = format!("r{n}");
                    l.put_request(rec(&id, RequestState::Received)).await.unwrap();
                    l.put_request_durable(rec(&id, RequestState::CallingApi)).await.unwrap();
                    let mut again = rec(&id, RequestState::CallingApi);
                    again.attempts = 2;
                    l.put_request(again).await.unwrap();
                    // The end as a stream records it: synchronously, from `drop`.
                    l.enqueue_request(rec(
                        &id,
                        if n % 3 == 0 {
                            RequestState::Failed
                        } else {
                            RequestState::Done
                        },
                    ));
                }));
            }
            for h in handles {
                h.await.unwrap();
            }
            ledger.flush().await.unwrap();
            for n in 0..3000 {
                let got = ledger.get_request(&format!("r{n}")).await.unwrap().unwrap();
                let want = if n % 3 == 0 {
                    RequestState::Failed
                } else {
                    RequestState::Done
                };
                assert_eq!(got.state, want, "r{n}");
            }
            assert!(
                store.commits.load(Ordering::SeqCst) < 3000,
                "writes were group-committed"
            );
            assert!(
                ledger.queue.held_back.load(Ordering::Relaxed) > 0,
                "the queue was full and held writers back"
            );
        }
    }

    both_backends! {
        async fn a_stored_response_is_found_by_its_id_for_its_own_key_after_a_reopen(db) {
            // spec: I1
            let ledger = db.ledger().await;
            let mut r = rec("r1", RequestState::Done);
            r.response_id = Some("resp_abc".into());
            r.channel = Some("openai-b".into());
            ledger.put_request_durable(r).await.unwrap();
            ledger.close(Duration::from_secs(1)).await.unwrap();
            drop(ledger);
            let ledger = db.ledger().await;
            let found = ledger.by_response_id("app", "resp_abc").await.unwrap().unwrap();
            assert_eq!((found.id.as_str(), found.channel.as_deref()), ("r1", Some("openai-b")));
            assert!(ledger.by_response_id("other-key", "resp_abc").await.unwrap().is_none());
            assert!(ledger.by_response_id("app", "resp_other").await.unwrap().is_none());
        }
    }

    both_backends! {
        async fn batches_of_any_size_write_every_row_and_nothing_else(db) {
            // SQLite pads batches to a size class with rows of no kind: those must write
            // nothing, and a batch over one statement's rows must still write all of its own.
            // PostgreSQL has its own limit on a statement's bound values: the same batches.
            if db.kind == Kind::Sqlite {
                let width = crate::sqlite::ROW_WIDTH;
                assert!(
                    crate::sqlite::ROWS_PER_STATEMENT * width <= 32766,
                    "a full statement of {width}-value rows binds more than SQLite allows"
                );
            }
            let backend = db.backend().await;
            let mut written = 0;
            for n in [1usize, 3, 16, 17, 30, 40, 100, 300, 700] {
                let reqs: Vec<_> = (0..n)
                    .map(|i| rec(&format!("b{n:04}-{i:04}"), RequestState::Done))
                    .collect();
                let atts: Vec<_> = reqs
                    .iter()
                    .map(|r| AttemptRecord::started(&r.id, 1, "openai-a", UnixMs(2)))
                    .collect();
                let pay = [stored(&reqs[0].id, b"{}", 9_000_000_000_000)];
                backend.write_batch(&reqs, &atts, &pay).await.unwrap();
                written += n;
                let last = &reqs[n - 1].id;
                assert_eq!(backend.get_request(last).await.unwrap().unwrap().id, *last);
                assert_eq!(backend.attempts(last).await.unwrap().len(), 1);
            }
            let (mut found, mut before) = (0, None);
            for _ in 0..10 {
                let page = backend
                    .search(&Search {
                        limit: Some(500),
                        before: before.take(),
                        ..Search::default()
                    })
                    .await
                    .unwrap();
                found += page.items.len();
                match page.next {
                    Some(n) => before = Some(n),
                    None => break,
                }
            }
            assert_eq!(found, written, "rows of no kind wrote something, or rows went missing");
            assert_eq!(backend.figures(UnixMs(0)).await.unwrap().payloads, 9);
        }
    }

    // SQLite only: the write-ahead log and its restarts are SQLite's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wal_restarts_under_a_writer_that_never_pauses() {
        let db = TestDb::sqlite().await;
        let path = db.path();
        let mut backend = SqliteBackend::open(&path).await.unwrap();
        backend.wal_restart_bytes = 1024 * 1024;
        let backend = Arc::new(backend);
        let wal = path.with_file_name("l.db-wal");
        // Commits back to back, as under saturation: a checkpoint beside this writer never
        // sees a fully checkpointed WAL at the start of a transaction on its own.
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (backend, stop) = (backend.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    backend
                        .write_batch(&[rec(&format!("r{n:08}"), RequestState::Done)], &[], &[])
                        .await
                        .unwrap();
                    n += 1;
                }
            })
        };
        let (mut peak, mut frames, mut rounds) = (0, 0, 0);
        // Bounded: checkpoints run back to back until 20,000 frames went through.
        while frames < 20_000 && rounds < 100_000 {
            tokio::task::yield_now().await;
            frames += backend.maintain().await.unwrap();
            peak = peak.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
            rounds += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writer.await.unwrap();
        assert!(frames >= 20_000, "only {frames} frames checkpointed");
        assert!(
            peak < 12 * 1024 * 1024,
            "the WAL restarted: it peaked at {peak} bytes after {frames} frames"
        );
    }
}

#[cfg(test)]
mod search_tests {
    use super::*;
    use crate::RequestState;
    use crate::testdb::both_backends;
    use spillway_wire::Format;

    fn rec(ms: u64, n: u16, route: &str, state: RequestState) -> RequestRecord {
        // UUIDv7-shaped ids: the millisecond timestamp leads.
        let id = format!("{:08x}-{:04x}-7000-8000-{:012x}", ms >> 16, ms & 0xffff, n);
        let mut r = RequestRecord::received(
            id.clone(),
            id.replace('-', ""),
            Format::OpenAi,
            "/v1/chat/completions",
            UnixMs(ms as i64),
        );
        r.route = Some(route.into());
        r.state = state;
        r
    }

    both_backends! {
        async fn search_pages_filters_and_finds_ids(db) {
            let ledger = db.ledger().await;
            let t0 = 1_790_000_000_000u64;
            for n in 0..120u16 {
                let state = if n % 10 == 0 {
                    RequestState::Failed
                } else {
                    RequestState::Done
                };
                let route = if n % 2 == 0 { "openai/a" } else { "openai/b" };
                let mut r = rec(t0 + u64::from(n) * 1000, n, route, state);
                if n == 7 {
                    r.client_request_id = Some("client-7".into());
                }
                if n == 8 {
                    r.trace_id = "4bf92f3577b34da6a3ce929d0e0e4736".into();
                }
                if n % 40 == 3 {
                    r.endpoint = "/v1/embeddings".into();
                }
                if n == 9 {
                    r.endpoint = "/v1beta/models/{model}:batchEmbedContents".into();
                }
                ledger.put_request(r).await.unwrap();
            }
            ledger.flush().await.unwrap();

            let p1 = ledger
                .search(&Search {
                    limit: Some(50),
                    ..Search::default()
                })
                .await
                .unwrap();
            assert_eq!(p1.items.len(), 50);
            assert!(p1.items.windows(2).all(|w| w[0].id > w[1].id), "newest first");
            let p2 = ledger
                .search(&Search {
                    limit: Some(50),
                    before: p1.next.clone(),
                    ..Search::default()
                })
                .await
                .unwrap();
            let p3 = ledger
                .search(&Search {
                    limit: Some(50),
                    before: p2.next.clone(),
                    ..Search::default()
                })
                .await
                .unwrap();
            assert_eq!((p2.items.len(), p3.items.len(), p3.next.clone()), (50, 20, None));

            let failed_a = Search {
                route: Some("openai/a".into()),
                state: Some(RequestState::Failed),
                ..Search::default()
            };
            assert_eq!(ledger.search(&failed_a).await.unwrap().items.len(), 12);

            let range = Search {
                from_ms: Some(UnixMs((t0 + 10_000) as i64)),
                to_ms: Some(UnixMs((t0 + 20_000) as i64)),
                ..Search::default()
            };
            assert_eq!(ledger.search(&range).await.unwrap().items.len(), 10);

            let by_api = |api| Search {
                api: Some(api),
                ..Search::default()
            };
            let embeddings = ledger
                .search(&by_api(spillway_wire::Api::Embeddings))
                .await
                .unwrap()
                .items;
            assert_eq!(embeddings.len(), 4, "3 OpenAI and 1 Gemini embedding requests");
            assert!(
                ledger
                    .search(&by_api(spillway_wire::Api::CountTokens))
                    .await
                    .unwrap()
                    .items
                    .is_empty()
            );

            let find = |q: &str| {
                let l = ledger.clone();
                let q = q.to_owned();
                async move {
                    l.search(&Search {
                        q: Some(q),
                        ..Search::default()
                    })
                    .await
                    .unwrap()
                    .items
                }
            };
            let five = rec(t0 + 5000, 5, "", RequestState::Done).id;
            assert_eq!(find(&five).await[0].id, five);
            assert_eq!(
                find(&five.replace('-', "")).await[0].id,
                five,
                "a gateway-made trace id is the request id"
            );
            assert_eq!(find("client-7").await.len(), 1);
            assert_eq!(
                find("4bf92f3577b34da6a3ce929d0e0e4736").await.len(),
                1,
                "client-sent trace ids are indexed"
            );
            assert!(find("nothing-like-this").await.is_empty());
        }
    }
}
