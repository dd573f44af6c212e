//! The single writer task and the [`Ledger`] handle the engine holds.

use crate::{AttemptRecord, Error, LedgerBackend, Page, RequestRecord, Result, Search, SqliteBackend};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Most operations folded into one commit. Bigger batches amortise more but make the
/// durable waiters of the batch wait longer.
const MAX_BATCH: usize = 2048;
/// Queued operations before senders wait: backpressure rather than unbounded memory.
const QUEUE_DEPTH: usize = 65_536;
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// How long fire-and-forget writes wait for a durable write to share a commit with.
const LINGER: Duration = Duration::from_millis(20);

enum Op {
    Request(Box<RequestRecord>, Option<oneshot::Sender<Result<()>>>),
    Attempt(Box<AttemptRecord>),
    Flush(oneshot::Sender<Result<()>>),
}

impl Op {
    fn is_waited_on(&self) -> bool {
        matches!(self, Op::Request(_, Some(_)) | Op::Flush(_))
    }
}

/// The engine's handle on the ledger. Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Op>,
    backend: Arc<dyn LedgerBackend>,
    tasks: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
}

impl Ledger {
    /// Opens a SQLite ledger at `path`, turns requests a crash left in `calling_api` into
    /// `unknown` (I4), and starts the writer.
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

    /// Starts the writer over any backend.
    pub fn start(backend: Arc<dyn LedgerBackend>) -> Ledger {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let writer = tokio::spawn(write_loop(backend.clone(), rx));
        let b = backend.clone();
        let checkpoints = tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = b.maintain().await {
                    tracing::warn!(error = %e, "ledger checkpoint failed");
                }
            }
        });
        Ledger {
            tx,
            backend,
            tasks: Arc::new(std::sync::Mutex::new(vec![writer, checkpoints])),
        }
    }

    /// Records `rec` and returns once it is committed. Used before an upstream call (I3).
    pub async fn put_request_durable(&self, rec: RequestRecord) -> Result<()> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Op::Request(Box::new(rec), Some(ack)))
            .await
            .map_err(|_| Error::WriterStopped)?;
        done.await.map_err(|_| Error::WriterStopped)?
    }

    /// Records `rec` with the next commit.
    pub async fn put_request(&self, rec: RequestRecord) -> Result<()> {
        self.tx
            .send(Op::Request(Box::new(rec), None))
            .await
            .map_err(|_| Error::WriterStopped)
    }

    /// Records `rec` with the next commit, from code that cannot wait (a stream's end runs
    /// in `poll`/`drop`). Queued in order at once, so a flush that follows sees it; only a
    /// full queue defers it to a task.
    pub fn enqueue_request(&self, rec: RequestRecord) {
        self.enqueue(Op::Request(Box::new(rec), None));
    }

    pub fn enqueue_attempt(&self, rec: AttemptRecord) {
        self.enqueue(Op::Attempt(Box::new(rec)));
    }

    fn enqueue(&self, op: Op) {
        match self.tx.try_send(op) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(op)) => {
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(op).await;
                });
            }
            Err(mpsc::error::TrySendError::Closed(_)) => tracing::error!("ledger writer stopped; a record was lost"),
        }
    }

    pub async fn put_attempt(&self, rec: AttemptRecord) -> Result<()> {
        self.tx
            .send(Op::Attempt(Box::new(rec)))
            .await
            .map_err(|_| Error::WriterStopped)
    }

    /// Waits until everything queued so far is committed.
    pub async fn flush(&self) -> Result<()> {
        let (ack, done) = oneshot::channel();
        self.tx.send(Op::Flush(ack)).await.map_err(|_| Error::WriterStopped)?;
        done.await.map_err(|_| Error::WriterStopped)?
    }

    /// Flushes, then stops the background tasks. Clones of this handle stop working.
    pub async fn close(&self) -> Result<()> {
        let r = self.flush().await;
        let _ = self.backend.maintain().await;
        for t in self
            .tasks
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default()
        {
            t.abort();
        }
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
}

async fn write_loop(backend: Arc<dyn LedgerBackend>, mut rx: mpsc::Receiver<Op>) {
    let mut ops = Vec::with_capacity(MAX_BATCH);
    loop {
        // Group commit: wait for one operation, then take whatever else is already queued.
        if rx.recv_many(&mut ops, MAX_BATCH).await == 0 {
            return;
        }
        // Nobody waits on a batch of only fire-and-forget writes (a request's end, its
        // attempts): hold it a moment so it rides along with the next durable write
        // instead of paying a commit of its own. Every commit rewrites whole pages in the
        // WAL, so commits, not rows, are what the disk pays for.
        if !ops.iter().any(Op::is_waited_on) {
            let until = tokio::time::Instant::now() + LINGER;
            while ops.len() < MAX_BATCH {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(op)) => {
                        let waited_on = op.is_waited_on();
                        ops.push(op);
                        if waited_on {
                            break;
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            while ops.len() < MAX_BATCH
                && let Ok(op) = rx.try_recv()
            {
                ops.push(op);
            }
        }
        let mut requests: Vec<RequestRecord> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut attempts = Vec::new();
        let mut acks = Vec::new();
        for op in ops.drain(..) {
            match op {
                Op::Request(rec, ack) => {
                    // Rows carry their full latest state, so only the last one per id is written.
                    match index.get(&rec.id) {
                        Some(&i) => requests[i] = *rec,
                        None => {
                            index.insert(rec.id.clone(), requests.len());
                            requests.push(*rec);
                        }
                    }
                    if let Some(a) = ack {
                        acks.push(a);
                    }
                }
                Op::Attempt(a) => attempts.push(*a),
                Op::Flush(a) => acks.push(a),
            }
        }
        let mut result = backend.write_batch(&requests, &attempts).await;
        if let Err(e) = &result {
            // One retry covers a transient lock; a second failure is reported to every
            // durable waiter so the gateway fails closed instead of calling blind.
            tracing::warn!(error = %e, rows = requests.len() + attempts.len(), "ledger batch failed; retrying once");
            tokio::time::sleep(Duration::from_millis(50)).await;
            result = backend.write_batch(&requests, &attempts).await;
            if let Err(e) = &result {
                tracing::error!(error = %e, rows = requests.len() + attempts.len(), "ledger batch lost");
            }
        }
        for a in acks {
            let _ = a.send(match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(Error::Corrupt(e.to_string())),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestState;

    fn rec(id: &str, state: RequestState) -> RequestRecord {
        let mut r = RequestRecord::received(
            id.into(),
            "0af7651916cd43dd8448eb211c80319c".into(),
            "openai",
            "/v1/chat/completions",
            1,
        );
        r.client_request_id = Some("client-1".into());
        r.key_name = Some("app".into());
        r.owner = Some("team-a".into());
        r.route = Some("openai/gpt-4o-mini".into());
        r.channel = Some("openai-a".into());
        r.requested_model = Some("gpt-4o-mini".into());
        r.served_model = Some("gpt-4o-mini".into());
        r.state = state;
        r.admitted_at = Some(2);
        r.body_sha256 = Some("ab".into());
        r
    }

    #[tokio::test]
    async fn i3_durable_calling_api_then_done() {
        // spec: I3
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/ledger.db");
        let ledger = Ledger::open_sqlite(&path).await.unwrap();
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
        ledger
            .put_attempt(AttemptRecord {
                request_id: "r1".into(),
                attempt_no: 1,
                channel: "openai-a".into(),
                upstream_request_id: Some("up-1".into()),
                http_status: Some(200),
                error_class: "success".into(),
                provider_error_type: None,
                retry_after_ms: None,
                message: None,
                started_at: 2,
                first_byte_at: Some(3),
                finished_at: Some(4),
                input_tokens: Some(5),
                output_tokens: Some(6),
                decision: Some("done".into()),
                decision_reason: None,
                delay_ms: None,
                ready_at: Some(1_780_000_000_000),
                visibility: None,
            })
            .await
            .unwrap();
        ledger.flush().await.unwrap();
        assert_eq!(ledger.get_request("r1").await.unwrap().unwrap(), done);
        assert_eq!(
            ledger.attempts("r1").await.unwrap()[0].upstream_request_id.as_deref(),
            Some("up-1")
        );
        ledger.close().await.unwrap();
    }

    #[tokio::test]
    async fn i4_calling_api_becomes_unknown_on_restart() {
        // spec: I4
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let ledger = Ledger::open_sqlite(&path).await.unwrap();
        ledger
            .put_request_durable(rec("r1", RequestState::CallingApi))
            .await
            .unwrap();
        ledger.put_request_durable(rec("r2", RequestState::Done)).await.unwrap();
        drop(ledger);
        let reopened = Ledger::open_sqlite(&path).await.unwrap();
        assert_eq!(
            reopened.get_request("r1").await.unwrap().unwrap().state,
            RequestState::Unknown
        );
        assert_eq!(
            reopened.get_request("r2").await.unwrap().unwrap().state,
            RequestState::Done
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wal_restarts_under_a_writer_that_never_pauses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let mut backend = SqliteBackend::open(&path).await.unwrap();
        backend.wal_restart_bytes = 1024 * 1024;
        let backend = Arc::new(backend);
        let wal = dir.path().join("l.db-wal");
        // Commits back to back, as under saturation: a checkpoint beside this writer never
        // sees a fully checkpointed WAL at the start of a transaction on its own.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (backend, stop) = (backend.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    backend
                        .write_batch(&[rec(&format!("r{n:08}"), RequestState::Done)], &[])
                        .await
                        .unwrap();
                    n += 1;
                }
            })
        };
        let (mut peak, mut frames) = (0, 0);
        while frames < 20_000 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            frames += backend.maintain().await.unwrap();
            peak = peak.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.await.unwrap();
        assert!(
            peak < 12 * 1024 * 1024,
            "the WAL restarted: it peaked at {peak} bytes after {frames} frames"
        );
    }

    #[tokio::test]
    async fn many_writes_group_commit_and_last_state_wins() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open_sqlite(&dir.path().join("l.db")).await.unwrap();
        let mut handles = Vec::new();
        for n in 0..2000 {
            let l = ledger.clone();
            handles.push(tokio::spawn(async move {
                let id = format!("r{n}");
                l.put_request_durable(rec(&id, RequestState::CallingApi)).await.unwrap();
                l.put_request(rec(&id, RequestState::Done)).await.unwrap();
            }));
        }
        for h in handles {
            h.await.unwrap();
        }
        ledger.flush().await.unwrap();
        for n in [0, 999, 1999] {
            assert_eq!(
                ledger.get_request(&format!("r{n}")).await.unwrap().unwrap().state,
                RequestState::Done
            );
        }
    }
}

#[cfg(test)]
mod search_tests {
    use super::*;
    use crate::RequestState;

    fn rec(ms: u64, n: u16, route: &str, state: RequestState) -> RequestRecord {
        // UUIDv7-shaped ids: the millisecond timestamp leads.
        let id = format!("{:08x}-{:04x}-7000-8000-{:012x}", ms >> 16, ms & 0xffff, n);
        let mut r = RequestRecord::received(
            id.clone(),
            id.replace('-', ""),
            "openai",
            "/v1/chat/completions",
            ms as i64,
        );
        r.route = Some(route.into());
        r.state = state;
        r
    }

    #[tokio::test]
    async fn search_pages_filters_and_finds_ids() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open_sqlite(&dir.path().join("l.db")).await.unwrap();
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
            from_ms: Some((t0 + 10_000) as i64),
            to_ms: Some((t0 + 20_000) as i64),
            ..Search::default()
        };
        assert_eq!(ledger.search(&range).await.unwrap().items.len(), 10);

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
