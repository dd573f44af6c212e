//! SQLite in WAL mode: one writer connection owned by the writer task's batches, a small
//! read pool, and checkpoints on their own connection so commits stay short.
//!
//! Durability is SQLite's `synchronous=FULL`: a commit returns once its WAL frames are
//! synced, so a `calling_api` that was acknowledged survives a power loss, not just a
//! killed process. The sync happens on sqlx's worker thread, inside the one command a
//! batch is (see `write_batch`): syncing from a thread of our own afterwards cost two
//! more thread hand-offs per commit than it saved by overlapping the next commit. The
//! build syncs with `fdatasync` (`LIBSQLITE3_FLAGS` in `.cargo/config.toml`), and the
//! WAL restarts while small, so most commits overwrite frames in place and the sync
//! writes no file-size change.
//!
//! Rows no caller waits on (a request's end, its attempts) are committed apart, by the
//! writer connection with its sync lowered to `synchronous=NORMAL` for that commit (see
//! `write_batch_unsynced`): riding along with the next `calling_api` made that request's
//! synced commit write and sync three or four WAL pages instead of one. Unsynced, they
//! survive a killed process at once, and the next synced commit makes them durable with
//! its own frames, the WAL being one file.

use crate::jobs::JOB_COLUMNS;
use crate::{
    Accounts, AttemptRecord, AuditEntry, BalanceEntry, ControlState, CostCell, DayFigures, Decision, Error, ErrorCount,
    FailureClass, InstanceRow, JobRecord, KeySpend, KeyedRequest, LedgerBackend, LedgerFigures, LedgerLock, Page,
    Payload, PolicyVersion, PruneReport, Reconcile, Reconciliation, RecoveryRow, RequestRecord, RequestState, Result,
    RouteCount, ScoreRow, Search, SideEffect, SpendRow, StopReason, StoredKey, StoredResponse, TakeOver,
};
use async_trait::async_trait;
use futures_util::TryStreamExt;
use spillway_wire::{ErrorClass, Format, UnixMs, Visibility};
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{
    Arguments, AssertSqlSafe, ColumnIndex, Connection, Decode, QueryBuilder, Row, Sqlite, SqliteConnection, SqlitePool,
    Type,
};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;
use tokio::sync::Mutex;

/// Past this size the checkpoint makes the WAL restart (see `maintain`). Each restart
/// holds the writer for one short checkpoint (a few ms, mostly fsync), so it should not
/// be frequent: at 1,000 requests/s (a few KB of WAL each) this is one every few seconds.
/// But a WAL that has restarted is rewritten in place, and a commit that does not grow
/// the file syncs its frames without the file's size: a small WAL makes most commits
/// cheaper to sync.
const WAL_RESTART_BYTES: u64 = 16 * 1024 * 1024;

/// The WAL file is truncated back to this many bytes after it restarts. Four times the
/// restart size, because the restart comes at the next checkpoint after the WAL passes
/// that size (up to a second later, plus the checkpoint's own time), and the frames
/// committed meanwhile go past it: at 2,000 requests/s the WAL reached up to 58 MB before
/// it restarted. With a limit equal to the restart size, every cycle grew the file
/// again and cut it back, and each commit that grew it synced the file's size as well as
/// its frames (a slower `fdatasync`). With room for the overshoot, a WAL that has filled
/// once is rewritten in place.
const WAL_SIZE_LIMIT: u64 = 4 * WAL_RESTART_BYTES;

/// Rows per batch statement, its largest size class: `ROWS_PER_STATEMENT` rows bind
/// well under SQLite's 32766 parameters (see the assertion in the writer's tests). A
/// larger batch, which only heavy load gathers, is several statements in one transaction.
pub(crate) const ROWS_PER_STATEMENT: usize = 128;

/// The row counts a batch statement is padded to (with rows of no kind, which the view's
/// trigger skips): a statement's text depends only on its size class, so every batch
/// reuses one of these few prepared statements instead of compiling its own (the trigger
/// makes compiling a batch cost about as much as running it). Padding costs a batch at
/// most a third of its rows, and only as unbound parameters, which SQLite reads as NULL.
#[rustfmt::skip]
const SIZE_CLASSES: [usize; 22] = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32, 48, 64, 96, ROWS_PER_STATEMENT,
];

/// The index in [`SIZE_CLASSES`] of the smallest class that holds `rows` (1..=ROWS_PER_STATEMENT).
fn size_class(rows: usize) -> usize {
    SIZE_CLASSES.partition_point(|&c| c < rows.max(1))
}

/// `INSERT INTO ledger_batch VALUES (?, …), …` for each size class, built once: a batch
/// only binds its values.
fn batch_sql(class: usize) -> &'static str {
    static TEXTS: [OnceLock<String>; SIZE_CLASSES.len()] = [const { OnceLock::new() }; SIZE_CLASSES.len()];
    TEXTS[class].get_or_init(|| {
        let row = format!("({})", vec!["?"; ROW_WIDTH].join(", "));
        format!(
            "INSERT INTO ledger_batch VALUES {}",
            vec![row; SIZE_CLASSES[class]].join(", ")
        )
    })
}

pub(crate) const REQUEST_COLUMNS: &str = "id, trace_id, client_request_id, upstream_request_id, key_name, owner, workflow, \
    format, endpoint, route, channel, requested_model, served_model, stream, state, http_status, error_class, \
    error_message, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, cost_usd, received_at, \
    admitted_at, first_token_at, finished_at, queued_ms, attempts, body_sha256, partial_output_committed, next_ready_at, \
    idempotency_key, replay_of, response_id, cache_write_tokens, estimated_input_tokens, estimated_cost_usd, \
    failed_cost_usd, pricing_version, policy_version, job_id";

/// Columns the request path never writes (the side-effect step and reconciliation set
/// them through their own statements); read with the rest.
pub(crate) const REQUEST_READ_COLUMNS: &str = "id, trace_id, client_request_id, upstream_request_id, key_name, owner, workflow, \
    format, endpoint, route, channel, requested_model, served_model, stream, state, http_status, error_class, \
    error_message, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, cost_usd, received_at, \
    admitted_at, first_token_at, finished_at, queued_ms, attempts, body_sha256, partial_output_committed, next_ready_at, \
    idempotency_key, replay_of, response_id, cache_write_tokens, estimated_input_tokens, estimated_cost_usd, \
    failed_cost_usd, pricing_version, policy_version, job_id, result_id, side_effect_at, reconciliation, reconciled_by, reconciled_reason, reconciled_at";

/// Columns fixed when a request is first written. Leaving them out of the upsert's SET
/// spares SQLite rewriting their index entries (trace id, client id, time) on every
/// state change.
const IMMUTABLE_REQUEST_COLUMNS: &[&str] = &[
    "id",
    "trace_id",
    "client_request_id",
    "received_at",
    "format",
    "endpoint",
    "idempotency_key",
    "replay_of",
];

/// A state's place on the I3 path, in SQL (see [`RequestState::rank`]).
pub(crate) fn rank_sql(column: &str) -> String {
    let arms: String = RequestState::ALL
        .iter()
        .map(|s| format!(" WHEN '{}' THEN {}", s.as_str(), s.rank()))
        .collect();
    format!("(CASE {column}{arms} ELSE 0 END)")
}

pub(crate) static REQUEST_UPSERT: LazyLock<String> = LazyLock::new(|| {
    let sets: Vec<String> = REQUEST_COLUMNS
        .split(',')
        .map(str::trim)
        .filter(|c| !IMMUTABLE_REQUEST_COLUMNS.contains(c))
        .map(|c| format!("{c} = excluded.{c}"))
        .collect();
    // The store itself refuses to move a request backwards: a finished row (or one whose
    // side effect a client marked, which only its own statement changes) never changes
    // through the write path, and an earlier state never overwrites a later one.
    format!(
        " ON CONFLICT(id) DO UPDATE SET {} WHERE {old} < 3 AND {new} >= {old}",
        sets.join(", "),
        old = rank_sql("requests.state"),
        new = rank_sql("excluded.state"),
    )
});

pub(crate) const ATTEMPT_COLUMNS: &str = "request_id, attempt_no, channel, upstream_request_id, http_status, error_class, \
    provider_error_type, retry_after_ms, message, started_at, first_byte_at, finished_at, input_tokens, output_tokens, \
    decision, decision_reason, delay_ms, ready_at, visibility, cost_usd";

/// How far an acknowledged commit survives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// A power loss: every commit syncs the WAL (`synchronous=FULL`). The gateway's.
    Full,
    /// A crashed process only (`synchronous=NORMAL`, no sync). For measuring, never for
    /// serving.
    ProcessCrashOnly,
}

pub struct SqliteBackend {
    /// Held as long as the backend lives: one writing process per ledger.
    _lock: LedgerLock,
    /// The writer connection, and whether it is in doubt: a transaction may have been left
    /// open on it (a batch of several statements failed and its ROLLBACK did not go
    /// through), or its sync level left lowered (a quiet commit's restore was not
    /// confirmed). A commit would then not commit, or not sync: every write through it
    /// first puts both right (`settle`), and is refused while it cannot.
    writer: Mutex<(SqliteConnection, bool)>,
    readers: SqlitePool,
    /// Checkpoints need a writable connection that is not the writer's.
    maintenance: Mutex<SqliteConnection>,
    /// The WAL, opened on the first `sync`: syncing it is what a synced commit does last.
    wal: std::sync::Mutex<Option<Arc<std::fs::File>>>,
    /// WAL size past which a checkpoint makes the WAL restart (see `maintain`).
    pub(crate) wal_restart_bytes: u64,
    /// The database file, for its size.
    path: PathBuf,
    /// The writer's own sync level, which a quiet commit lowers for itself.
    durability: Durability,
}

pub(crate) fn i(v: Option<u64>) -> Option<i64> {
    v.map(|v| v.min(i64::MAX as u64) as i64)
}

fn u(v: Option<i64>) -> Option<u64> {
    v.map(|v| v.max(0) as u64)
}

impl SqliteBackend {
    /// Takes the ledger's lock, opens (creating if needed) the ledger file at `path` and
    /// applies migrations.
    pub async fn open(path: &Path) -> Result<SqliteBackend> {
        Self::open_with(path, Durability::Full).await
    }

    /// [`SqliteBackend::open`] with the commit durability chosen: the gateway always uses
    /// [`Durability::Full`]; the other exists so `make bench` can say what it costs.
    pub async fn open_with(path: &Path, durability: Durability) -> Result<SqliteBackend> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|source| Error::Directory {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let lock = LedgerLock::acquire(path)?;
        let base = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let mut writer = SqliteConnection::connect_with(
            &base
                .clone()
                .create_if_missing(true)
                .synchronous(match durability {
                    Durability::Full => SqliteSynchronous::Full,
                    Durability::ProcessCrashOnly => SqliteSynchronous::Normal,
                })
                // The batches of a few rows each keep their prepared statements (see
                // `write_batch`).
                .statement_cache_capacity(256)
                .pragma("wal_autocheckpoint", "0")
                // After a WAL restart the file is cut back to this size, so one burst
                // does not keep its disk space for good.
                .pragma("journal_size_limit", WAL_SIZE_LIMIT.to_string()),
        )
        .await?;
        sqlx::migrate!("./migrations").run(&mut writer).await?;
        sqlx::raw_sql(AssertSqlSafe(BATCH_VIEW.as_str()))
            .execute(&mut writer)
            .await?;
        // No automatic checkpoints here either: `maintain` runs them.
        let maintenance = SqliteConnection::connect_with(&base.clone().pragma("wal_autocheckpoint", "0")).await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(base.read_only(true))
            .await?;
        Ok(SqliteBackend {
            _lock: lock,
            writer: Mutex::new((writer, false)),
            readers,
            maintenance: Mutex::new(maintenance),
            wal: std::sync::Mutex::new(None),
            wal_restart_bytes: WAL_RESTART_BYTES,
            path: path.to_owned(),
            durability,
        })
    }
}

impl SqliteBackend {
    /// The writer connection, for a durable transaction outside the batches, settled
    /// first (see `settle`).
    async fn writable(&self) -> Result<tokio::sync::MutexGuard<'_, (SqliteConnection, bool)>> {
        let mut w = self.writer.lock().await;
        self.settle(&mut w).await?;
        Ok(w)
    }

    /// Puts an in-doubt writer right before anything is written through it: rolls back
    /// what a failed batch may have left open, and restores the sync level a quiet commit
    /// may have left lowered. Until both have gone through, it refuses the write.
    async fn settle(&self, w: &mut (SqliteConnection, bool)) -> Result<()> {
        let (conn, in_doubt) = w;
        if !*in_doubt {
            return Ok(());
        }
        match sqlx::query("ROLLBACK").execute(&mut *conn).await {
            Ok(_) => {}
            // Nothing was open after all.
            Err(e) if e.to_string().contains("no transaction is active") => {}
            Err(e) => return Err(e.into()),
        }
        if self.durability == Durability::Full {
            restore_sync(conn).await?;
        }
        *in_doubt = false;
        Ok(())
    }

    /// Runs `sql` (a DELETE of at most a chunk, taking `?1`) until it deletes nothing, one
    /// transaction per chunk. Returns the rows deleted.
    async fn delete_in_chunks(&self, sql: &'static str, arg: i64) -> Result<u64> {
        let mut total = 0;
        loop {
            let mut w = self.writer.lock().await;
            self.settle(&mut w).await?;
            let n = sqlx::query(sql).bind(arg).execute(&mut w.0).await?.rows_affected();
            drop(w);
            total += n;
            if n == 0 {
                return Ok(total);
            }
            tokio::task::yield_now().await;
        }
    }

    /// The database's write-ahead log file.
    fn wal_path(&self) -> PathBuf {
        let mut wal = self.path.clone().into_os_string();
        wal.push("-wal");
        PathBuf::from(wal)
    }

    /// The WAL, kept open once opened. SQLite deletes the file only when its last
    /// connection closes, and the writer's stays open as long as this backend, so the
    /// handle never outlives the file it names. (Closing a descriptor drops the process's
    /// POSIX locks on that file, but SQLite locks the database and `-shm` files, never
    /// the WAL.)
    fn wal_file(&self) -> Result<Arc<std::fs::File>> {
        let mut wal = self.wal.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = &*wal {
            return Ok(f.clone());
        }
        let path = self.wal_path();
        let f = std::fs::File::open(&path)
            .map(Arc::new)
            .map_err(|e| Error::Unavailable(format!("cannot open the ledger's WAL {}: {e}", path.display())))?;
        *wal = Some(f.clone());
        Ok(f)
    }

    /// The database and its write-ahead log, in bytes.
    fn file_bytes(&self) -> u64 {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        size(&self.path) + size(&self.wal_path())
    }
}

pub(crate) fn ms(v: Option<i64>) -> Option<UnixMs> {
    v.map(UnixMs)
}

/// A request row of either store: both decode to the same Rust types (integers `i64`,
/// flags `bool`, reals `f64`), so one decoder serves SQLite and PostgreSQL.
pub(crate) fn request_from_row<'r, R>(r: &'r R) -> Result<RequestRecord>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    f64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    let state: String = r.try_get("state")?;
    let format: String = r.try_get("format")?;
    Ok(RequestRecord {
        id: r.try_get("id")?,
        trace_id: r.try_get("trace_id")?,
        client_request_id: r.try_get("client_request_id")?,
        upstream_request_id: r.try_get("upstream_request_id")?,
        key_name: r.try_get("key_name")?,
        owner: r.try_get("owner")?,
        workflow: r.try_get("workflow")?,
        format: format
            .parse::<Format>()
            .map_err(|_| Error::Corrupt(format!("unknown format `{format}`")))?,
        endpoint: r.try_get("endpoint")?,
        route: r.try_get("route")?,
        channel: r.try_get("channel")?,
        requested_model: r.try_get("requested_model")?,
        served_model: r.try_get("served_model")?,
        stream: r.try_get("stream")?,
        state: RequestState::parse(&state).ok_or_else(|| Error::Corrupt(format!("unknown state `{state}`")))?,
        http_status: r.try_get::<Option<i64>, _>("http_status")?.map(|v| v as u16),
        error_class: r
            .try_get::<Option<String>, _>("error_class")?
            .map(|c| FailureClass::parse(&c)),
        error_message: r.try_get("error_message")?,
        input_tokens: u(r.try_get("input_tokens")?),
        output_tokens: u(r.try_get("output_tokens")?),
        cached_input_tokens: u(r.try_get("cached_input_tokens")?),
        reasoning_tokens: u(r.try_get("reasoning_tokens")?),
        cache_write_tokens: u(r.try_get("cache_write_tokens")?),
        cost_usd: r.try_get("cost_usd")?,
        estimated_input_tokens: u(r.try_get("estimated_input_tokens")?),
        estimated_cost_usd: r.try_get("estimated_cost_usd")?,
        failed_cost_usd: r.try_get("failed_cost_usd")?,
        pricing_version: r.try_get("pricing_version")?,
        policy_version: r.try_get("policy_version")?,
        job_id: r.try_get("job_id")?,
        received_at: UnixMs(r.try_get("received_at")?),
        admitted_at: ms(r.try_get("admitted_at")?),
        first_token_at: ms(r.try_get("first_token_at")?),
        finished_at: ms(r.try_get("finished_at")?),
        queued_ms: u(r.try_get("queued_ms")?),
        attempts: r.try_get::<i64, _>("attempts")? as u32,
        body_sha256: r.try_get("body_sha256")?,
        partial_output_committed: r.try_get("partial_output_committed")?,
        next_ready_at: ms(r.try_get("next_ready_at")?),
        idempotency_key: r.try_get("idempotency_key")?,
        replay_of: r.try_get("replay_of")?,
        response_id: r.try_get("response_id")?,
        resolution: {
            let res = crate::Resolution {
                result_id: r.try_get("result_id")?,
                side_effect_at: ms(r.try_get("side_effect_at")?),
                reconciliation: r
                    .try_get::<Option<String>, _>("reconciliation")?
                    .and_then(|v| Reconciliation::parse(&v)),
                reconciled_by: r.try_get("reconciled_by")?,
                reconciled_reason: r.try_get("reconciled_reason")?,
                reconciled_at: ms(r.try_get("reconciled_at")?),
            };
            (res != crate::Resolution::default()).then(|| Box::new(res))
        },
    })
}

pub(crate) fn attempt_from_row<'r, R>(r: &'r R) -> Result<AttemptRecord>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    f64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(AttemptRecord {
        request_id: r.try_get("request_id")?,
        attempt_no: r.try_get::<i64, _>("attempt_no")? as u32,
        channel: r.try_get("channel")?,
        upstream_request_id: r.try_get("upstream_request_id")?,
        http_status: r.try_get::<Option<i64>, _>("http_status")?.map(|v| v as u16),
        error_class: ErrorClass::parse(&r.try_get::<String, _>("error_class")?).unwrap_or(ErrorClass::Unknown),
        provider_error_type: r.try_get("provider_error_type")?,
        retry_after_ms: u(r.try_get("retry_after_ms")?),
        message: r.try_get("message")?,
        started_at: UnixMs(r.try_get("started_at")?),
        first_byte_at: ms(r.try_get("first_byte_at")?),
        finished_at: ms(r.try_get("finished_at")?),
        input_tokens: u(r.try_get("input_tokens")?),
        output_tokens: u(r.try_get("output_tokens")?),
        cost_usd: r.try_get("cost_usd")?,
        decision: r
            .try_get::<Option<String>, _>("decision")?
            .and_then(|d| Decision::parse(&d)),
        decision_reason: r
            .try_get::<Option<String>, _>("decision_reason")?
            .and_then(|d| StopReason::parse(&d)),
        delay_ms: u(r.try_get("delay_ms")?),
        ready_at: ms(r.try_get("ready_at")?),
        visibility: r
            .try_get::<Option<String>, _>("visibility")?
            .and_then(|v| Visibility::parse(&v)),
    })
}

/// One row of a batch: a request's latest state, an attempt, or a request's body copies.
enum BatchRow<'a> {
    Request(&'a RequestRecord),
    Attempt(&'a AttemptRecord),
    Payload(&'a Payload),
}

pub(crate) const PAYLOAD_COLUMNS: &str =
    "request_id, expires_at, request_body, response_status, response_content_type, response_body";

pub(crate) fn columns(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim)
}

/// Columns in a comma-separated list, counted when compiling: the batch builders need
/// them per row.
pub(crate) const fn width(list: &str) -> usize {
    let (bytes, mut i, mut n) = (list.as_bytes(), 0, 1);
    while i < bytes.len() {
        if bytes[i] == b',' {
            n += 1;
        }
        i += 1;
    }
    n
}

pub(crate) const REQUEST_WIDTH: usize = width(REQUEST_COLUMNS);
pub(crate) const ATTEMPT_WIDTH: usize = width(ATTEMPT_COLUMNS);
pub(crate) const PAYLOAD_WIDTH: usize = width(PAYLOAD_COLUMNS);
const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// Values a batch row binds: its kind, then its own columns in the view's shared value
/// columns, the rest NULL. The three kinds share the columns rather than each having its
/// own: a row bound 69 values, two in three of them NULL, and binding, clearing and the
/// trigger's copy of the new row all cost per value (in a closed-loop profile, binding
/// and clearing took an eighth of the SQLite thread's time and a seventeenth of the
/// request thread's).
pub(crate) const ROW_WIDTH: usize = 1 + max(REQUEST_WIDTH, max(ATTEMPT_WIDTH, PAYLOAD_WIDTH));

/// The writer connection's own view that a whole batch is inserted into, as one
/// statement: its trigger upserts each request row and inserts each attempt row. A
/// batch of several statements (requests, attempts, BEGIN and COMMIT) cost a wake-up of
/// the writer task per statement, each from sqlx's worker thread; one statement costs
/// one. It commits (and syncs) in autocommit, all rows or none.
static BATCH_VIEW: LazyLock<String> = LazyLock::new(|| {
    let names: Vec<String> = std::iter::once("kind".to_owned())
        .chain((1..ROW_WIDTH).map(|i| format!("v{i}")))
        .collect();
    let nulls = vec!["NULL"; names.len()].join(", ");
    let new = |list: &str| {
        (1..=columns(list).count())
            .map(|i| format!("NEW.v{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "CREATE TEMP VIEW ledger_batch ({names}) AS SELECT {nulls} WHERE 0;\n\
         CREATE TEMP TRIGGER ledger_batch_row INSTEAD OF INSERT ON ledger_batch BEGIN\n\
         INSERT INTO requests ({REQUEST_COLUMNS}) SELECT {r} WHERE NEW.kind = 'r'{upsert};\n\
         INSERT OR REPLACE INTO attempts ({ATTEMPT_COLUMNS}) SELECT {a} WHERE NEW.kind = 'a';\n\
         INSERT OR REPLACE INTO payloads ({PAYLOAD_COLUMNS}) SELECT {p} WHERE NEW.kind = 'p';\n\
         END;",
        names = names.join(", "),
        r = new(REQUEST_COLUMNS),
        a = new(ATTEMPT_COLUMNS),
        p = new(PAYLOAD_COLUMNS),
        upsert = &*REQUEST_UPSERT,
    )
});

/// Adds one value to a batch's arguments. Every type bound here encodes infallibly.
fn put<'q, T: sqlx::Encode<'q, Sqlite> + Type<Sqlite>>(args: &mut SqliteArguments, v: T) {
    let _ = args.add(v);
}

fn nulls(args: &mut SqliteArguments, n: usize) {
    for _ in 0..n {
        put(args, None::<i64>);
    }
}

/// The rows that `write_batch` and `write_batch_unsynced` both write, in one order.
fn batch_rows<'a>(
    requests: &'a [RequestRecord],
    attempts: &'a [AttemptRecord],
    payloads: &'a [Payload],
) -> Vec<BatchRow<'a>> {
    requests
        .iter()
        .map(BatchRow::Request)
        .chain(attempts.iter().map(BatchRow::Attempt))
        .chain(payloads.iter().map(BatchRow::Payload))
        .collect()
}

/// The arguments of one batch statement for `rows`, in the view's column order. The
/// padding rows of its size class are left unbound (NULL, so of no kind).
fn batch_args(rows: &[BatchRow<'_>]) -> SqliteArguments {
    let mut args = SqliteArguments::default();
    args.reserve(rows.len() * ROW_WIDTH, 0);
    for row in rows {
        match row {
            BatchRow::Request(r) => {
                put(&mut args, fixed("r"));
                bind_request(&mut args, r);
                nulls(&mut args, ROW_WIDTH - 1 - REQUEST_WIDTH);
            }
            BatchRow::Attempt(a) => {
                put(&mut args, fixed("a"));
                bind_attempt(&mut args, a);
                nulls(&mut args, ROW_WIDTH - 1 - ATTEMPT_WIDTH);
            }
            BatchRow::Payload(p) => {
                put(&mut args, fixed("p"));
                let r = p.response.as_ref();
                put(&mut args, text(p.request_id.as_str()));
                put(&mut args, p.expires_at.0);
                put(&mut args, p.request_body.as_deref());
                put(&mut args, r.map(|r| i64::from(r.status)));
                put(&mut args, r.map(|r| text(r.content_type.as_str())));
                put(&mut args, r.map(|r| r.body.as_slice()));
                nulls(&mut args, ROW_WIDTH - 1 - PAYLOAD_WIDTH);
            }
        }
    }
    // Every value above encodes infallibly; one that did not would shift the rest of its
    // row into the wrong columns.
    debug_assert_eq!(args.len(), rows.len() * ROW_WIDTH);
    args
}

/// One statement of a batch: `rows` (at most [`ROWS_PER_STATEMENT`]) through the view,
/// as its size class's prepared statement.
async fn insert_chunk(conn: &mut SqliteConnection, rows: &[BatchRow<'_>]) -> Result<()> {
    debug_assert!(rows.len() <= ROWS_PER_STATEMENT, "a chunk of {} rows", rows.len());
    let statement = sqlx::query_with(batch_sql(size_class(rows.len())), batch_args(rows)).persistent(true);
    // The statement's own result is its end (in autocommit, after its commit and sync; in
    // a large batch's transaction, COMMIT is a command of its own): nothing can fail after
    // it. `execute` would wait on past it for the end of sqlx's result stream, which comes
    // when the worker thread drops its sender a moment later, and that often costs this
    // task one more wake-up per commit.
    let mut results = sqlx::Executor::fetch_many(conn, statement);
    while let Some(result) = results.try_next().await? {
        if result.is_left() {
            return Ok(());
        }
    }
    Ok(())
}

/// The writer's sync level back to `FULL` after a quiet commit lowered it.
async fn restore_sync(conn: &mut SqliteConnection) -> Result<()> {
    sqlx::query("PRAGMA synchronous = FULL")
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Text to bind, in one allocation: sqlx's own `&str` encoding makes an `Arc<String>`
/// (two allocations and a copy), and each is freed again on sqlx's thread after the
/// statement. SQLite copies the text in any case when it is bound.
fn text(s: &str) -> Arc<str> {
    Arc::from(s)
}

/// A fixed name (a state, a class, a decision) to bind: shared, so binding one costs no
/// allocation. The writer runs on few threads and the names are few, so each thread keeps
/// its own, keyed by the name's address.
fn fixed(s: &'static str) -> Arc<str> {
    thread_local! {
        static NAMES: std::cell::RefCell<Vec<(usize, Arc<str>)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    NAMES.with_borrow_mut(|names| {
        let at = s.as_ptr() as usize;
        if let Some((_, name)) = names.iter().find(|(p, n)| *p == at && n.len() == s.len()) {
            return name.clone();
        }
        let name: Arc<str> = Arc::from(s);
        names.push((at, name.clone()));
        name
    })
}

fn bind_request(b: &mut SqliteArguments, r: &RequestRecord) {
    put(b, text(r.id.as_str()));
    put(b, text(r.trace_id.as_str()));
    put(b, r.client_request_id.as_deref().map(text));
    put(b, r.upstream_request_id.as_deref().map(text));
    put(b, r.key_name.as_deref().map(text));
    put(b, r.owner.as_deref().map(text));
    put(b, r.workflow.as_deref().map(text));
    put(b, fixed(r.format.as_str()));
    put(b, text(r.endpoint.as_str()));
    put(b, r.route.as_deref().map(text));
    put(b, r.channel.as_deref().map(text));
    put(b, r.requested_model.as_deref().map(text));
    put(b, r.served_model.as_deref().map(text));
    put(b, r.stream);
    put(b, fixed(r.state.as_str()));
    put(b, r.http_status.map(i64::from));
    put(b, r.error_class.map(FailureClass::as_str).map(fixed));
    put(b, r.error_message.as_deref().map(text));
    put(b, i(r.input_tokens));
    put(b, i(r.output_tokens));
    put(b, i(r.cached_input_tokens));
    put(b, i(r.reasoning_tokens));
    put(b, r.cost_usd);
    put(b, r.received_at.0);
    put(b, r.admitted_at.map(|t| t.0));
    put(b, r.first_token_at.map(|t| t.0));
    put(b, r.finished_at.map(|t| t.0));
    put(b, i(r.queued_ms));
    put(b, i64::from(r.attempts));
    put(b, r.body_sha256.as_deref().map(text));
    put(b, r.partial_output_committed);
    put(b, r.next_ready_at.map(|t| t.0));
    put(b, r.idempotency_key.as_deref().map(text));
    put(b, r.replay_of.as_deref().map(text));
    put(b, r.response_id.as_deref().map(text));
    put(b, i(r.cache_write_tokens));
    put(b, i(r.estimated_input_tokens));
    put(b, r.estimated_cost_usd);
    put(b, r.failed_cost_usd);
    put(b, r.pricing_version.as_deref().map(text));
    put(b, r.policy_version.as_deref().map(text));
    put(b, r.job_id.as_deref().map(text));
}

fn bind_attempt(b: &mut SqliteArguments, a: &AttemptRecord) {
    put(b, text(a.request_id.as_str()));
    put(b, i64::from(a.attempt_no));
    put(b, text(a.channel.as_str()));
    put(b, a.upstream_request_id.as_deref().map(text));
    put(b, a.http_status.map(i64::from));
    put(b, fixed(a.error_class.as_str()));
    put(b, a.provider_error_type.as_deref().map(text));
    put(b, i(a.retry_after_ms));
    put(b, a.message.as_deref().map(text));
    put(b, a.started_at.0);
    put(b, a.first_byte_at.map(|t| t.0));
    put(b, a.finished_at.map(|t| t.0));
    put(b, i(a.input_tokens));
    put(b, i(a.output_tokens));
    put(b, a.decision.map(Decision::as_str).map(fixed));
    put(b, a.decision_reason.map(StopReason::as_str).map(fixed));
    put(b, i(a.delay_ms));
    put(b, a.ready_at.map(|t| t.0));
    put(b, a.visibility.map(Visibility::as_str).map(fixed));
    put(b, a.cost_usd);
}

/// The smallest UUIDv7 string of millisecond `ms`: ids compare as strings in time order.
pub(crate) fn uuid_floor(at: UnixMs) -> String {
    let ms = at.0.clamp(0, (1 << 48) - 1) as u64;
    format!("{:08x}-{:04x}-0000-0000-000000000000", ms >> 16, ms & 0xffff)
}

/// 32 hex digits (a trace id) in UUID form, to look a gateway-made trace id up by key.
pub(crate) fn hex_to_uuid(s: &str) -> Option<String> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let s = s.to_ascii_lowercase();
    Some(format!(
        "{}-{}-{}-{}-{}",
        &s[0..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..32]
    ))
}

/// B3: an operator's spend limit on a key (None lifts it), inside a transaction.
async fn upsert_spend_limit(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    key_name: &str,
    limit: Option<f64>,
    at: UnixMs,
    by: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO key_spend (key_name, limit_set, spend_limit_usd, set_at, set_by) VALUES (?, 1, ?, ?, ?) \
         ON CONFLICT (key_name) DO UPDATE SET limit_set = 1, spend_limit_usd = excluded.spend_limit_usd, \
         set_at = excluded.set_at, set_by = excluded.set_by",
    )
    .bind(key_name)
    .bind(limit)
    .bind(at.0)
    .bind(by)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Appends an audit entry inside a transaction.
async fn insert_audit(tx: &mut sqlx::Transaction<'_, Sqlite>, audit: &AuditEntry) -> Result<()> {
    sqlx::query(
        "INSERT INTO audit (at, kind, subject, actor, action, trigger, reason, figures) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(audit.at.0)
    .bind(&audit.kind)
    .bind(&audit.subject)
    .bind(&audit.actor)
    .bind(&audit.action)
    .bind(&audit.trigger)
    .bind(&audit.reason)
    .bind(&audit.figures)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The job columns for listings: the body and result stay on disk.
pub(crate) static JOB_LIST_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    columns(JOB_COLUMNS)
        .map(|c| {
            if c == "body" || c == "result" {
                format!("NULL AS {c}")
            } else {
                c.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
});

/// The conflict clause of a job save, the same text in SQLite and PostgreSQL. A save
/// without a body or result keeps the stored one. R1: a copy older than the stored row
/// (another instance saved the job since) changes nothing, and a save that takes the job
/// out of `running` releases its lease.
pub(crate) static JOB_UPSERT: LazyLock<String> = LazyLock::new(|| {
    let keep = ["body", "result"];
    let set = columns(JOB_COLUMNS)
        .filter(|c| *c != "id")
        .map(|c| {
            if keep.contains(&c) {
                format!("{c} = COALESCE(excluded.{c}, jobs.{c})")
            } else {
                format!("{c} = excluded.{c}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        " ON CONFLICT (id) DO UPDATE SET {set}, \
         lease_owner = CASE WHEN excluded.state = 'running' THEN jobs.lease_owner ELSE NULL END, \
         lease_until = CASE WHEN excluded.state = 'running' THEN jobs.lease_until ELSE NULL END \
         WHERE jobs.updated_at <= excluded.updated_at"
    )
});

/// A job's row, inserted or replaced (see [`JOB_UPSERT`]).
async fn upsert_job(tx: &mut sqlx::Transaction<'_, Sqlite>, j: &JobRecord) -> Result<()> {
    let request_ids = serde_json::to_string(&j.request_ids).map_err(|e| Error::Corrupt(e.to_string()))?;
    let n = columns(JOB_COLUMNS).count();
    let marks = vec!["?"; n].join(", ");
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO jobs ({JOB_COLUMNS}) VALUES ({marks}){upsert}",
        upsert = *JOB_UPSERT
    )))
    .bind(&j.id)
    .bind(&j.key_name)
    .bind(&j.owner)
    .bind(&j.idempotency_key)
    .bind(&j.workflow)
    .bind(&j.policy_version)
    .bind(&j.format)
    .bind(&j.api)
    .bind(&j.path)
    .bind(&j.endpoint)
    .bind(&j.headers)
    .bind(j.body.as_deref())
    .bind(&j.body_sha256)
    .bind(&j.route)
    .bind(&j.requested_model)
    .bind(&j.served_model)
    .bind(&j.route_override)
    .bind(&j.priority)
    .bind(&j.lane)
    .bind(&j.state)
    .bind(i64::from(j.attempt))
    .bind(i64::from(j.max_attempts))
    .bind(j.created_at.0)
    .bind(j.ready_at.0)
    .bind(j.expires_at.0)
    .bind(j.updated_at.0)
    .bind(i(j.retry_after_ms))
    .bind(j.partial_output_committed)
    .bind(&j.last_error_type)
    .bind(&j.last_error)
    .bind(j.last_status.map(i64::from))
    .bind(j.estimated_cost_usd)
    .bind(i(j.estimated_input_tokens))
    .bind(i(j.estimated_output_tokens))
    .bind(j.cost_usd)
    .bind(i(j.usage_units))
    .bind(&j.fallback_policy)
    .bind(request_ids)
    .bind(&j.reason)
    .bind(j.result_status.map(i64::from))
    .bind(&j.result_content_type)
    .bind(j.result.as_deref())
    .bind(&j.review)
    .bind(&j.replay_of)
    .bind(&j.replayed_by)
    .bind(&j.replay)
    .bind(&j.batch_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub(crate) fn job_from_row<'r, R>(r: &'r R, with_blobs: bool) -> Result<JobRecord>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    f64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let ids: String = r.try_get("request_ids")?;
    let blob = |c: &'r str| -> Result<Option<Vec<u8>>> { if with_blobs { Ok(r.try_get(c)?) } else { Ok(None) } };
    Ok(JobRecord {
        id: r.try_get("id")?,
        key_name: r.try_get("key_name")?,
        owner: r.try_get("owner")?,
        idempotency_key: r.try_get("idempotency_key")?,
        workflow: r.try_get("workflow")?,
        policy_version: r.try_get("policy_version")?,
        format: r.try_get("format")?,
        api: r.try_get("api")?,
        path: r.try_get("path")?,
        endpoint: r.try_get("endpoint")?,
        headers: r.try_get("headers")?,
        body: blob("body")?,
        body_sha256: r.try_get("body_sha256")?,
        route: r.try_get("route")?,
        requested_model: r.try_get("requested_model")?,
        served_model: r.try_get("served_model")?,
        route_override: r.try_get("route_override")?,
        priority: r.try_get("priority")?,
        lane: r.try_get("lane")?,
        state: r.try_get("state")?,
        attempt: r.try_get::<i64, _>("attempt")?.max(0) as u32,
        max_attempts: r.try_get::<i64, _>("max_attempts")?.max(0) as u32,
        created_at: UnixMs(r.try_get("created_at")?),
        ready_at: UnixMs(r.try_get("ready_at")?),
        expires_at: UnixMs(r.try_get("expires_at")?),
        updated_at: UnixMs(r.try_get("updated_at")?),
        retry_after_ms: u(r.try_get("retry_after_ms")?),
        partial_output_committed: r.try_get("partial_output_committed")?,
        last_error_type: r.try_get("last_error_type")?,
        last_error: r.try_get("last_error")?,
        last_status: r.try_get::<Option<i64>, _>("last_status")?.map(|v| v as u16),
        estimated_cost_usd: r.try_get("estimated_cost_usd")?,
        estimated_input_tokens: u(r.try_get("estimated_input_tokens")?),
        estimated_output_tokens: u(r.try_get("estimated_output_tokens")?),
        cost_usd: r.try_get("cost_usd")?,
        usage_units: u(r.try_get("usage_units")?),
        fallback_policy: r.try_get("fallback_policy")?,
        request_ids: serde_json::from_str(&ids).map_err(|e| Error::Corrupt(format!("job request ids: {e}")))?,
        reason: r.try_get("reason")?,
        result_status: r.try_get::<Option<i64>, _>("result_status")?.map(|v| v as u16),
        result_content_type: r.try_get("result_content_type")?,
        result: blob("result")?,
        review: r.try_get("review")?,
        replay_of: r.try_get("replay_of")?,
        replayed_by: r.try_get("replayed_by")?,
        replay: r.try_get("replay")?,
        batch_id: r.try_get("batch_id")?,
    })
}

/// R1: an instance's row, as `instances()` reads it.
pub(crate) const INSTANCE_COLUMNS: &str =
    "id, boot, listen, version, started_at, heartbeat_at, stopped_at, taken_over_by, unknowns, load";

/// R1: why a taken-over instance's in-flight request is `unknown`.
pub(crate) fn taken_over_message(instance: &str) -> String {
    format!("the gateway instance {instance} stopped while this request was calling the provider")
}

pub(crate) fn instance_from_row<'r, R>(r: &'r R) -> Result<InstanceRow>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(InstanceRow {
        id: r.try_get("id")?,
        boot: r.try_get("boot")?,
        listen: r.try_get("listen")?,
        version: r.try_get("version")?,
        started_at: UnixMs(r.try_get("started_at")?),
        heartbeat_at: UnixMs(r.try_get("heartbeat_at")?),
        stopped_at: ms(r.try_get("stopped_at")?),
        taken_over_by: r.try_get("taken_over_by")?,
        unknowns: r.try_get::<i64, _>("unknowns")?.max(0) as u64,
        load: r.try_get("load")?,
    })
}

/// SQLite's default page size, which the ledger keeps.
const PAGE_BYTES: u64 = 4096;

/// A PASSIVE checkpoint: (frames in the WAL, frames now in the database).
async fn checkpoint(conn: &mut SqliteConnection) -> Result<(u64, u64)> {
    // fetch_all, not fetch_one: a statement left un-stepped keeps a read snapshot open,
    // and a reader on the WAL stops the writer from ever restarting it.
    let rows = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").fetch_all(conn).await?;
    let Some(row) = rows.first() else { return Ok((0, 0)) };
    // (busy, frames in the WAL, frames checkpointed); -1 when not in WAL mode.
    let (wal, done): (i64, i64) = (row.try_get(1)?, row.try_get(2)?);
    Ok((wal.max(0) as u64, done.max(0) as u64))
}

#[async_trait]
impl LedgerBackend for SqliteBackend {
    async fn write_batch(
        &self,
        requests: &[RequestRecord],
        attempts: &[AttemptRecord],
        payloads: &[Payload],
    ) -> Result<()> {
        if requests.is_empty() && attempts.is_empty() && payloads.is_empty() {
            return Ok(());
        }
        let mut guard = self.writer.lock().await;
        self.settle(&mut guard).await?;
        let (conn, in_doubt) = &mut *guard;
        // Every command to sqlx's SQLite connection is a hand-off to its worker thread and
        // back, and every statement's result one more wake-up of this task: a batch is one
        // statement (see `BATCH_VIEW`), committed in autocommit. Only a batch too large
        // for one statement is several, in one transaction.
        let rows = batch_rows(requests, attempts, payloads);
        if rows.len() <= ROWS_PER_STATEMENT {
            return insert_chunk(conn, &rows).await;
        }
        // In doubt while the transaction is open, so that a panic or a dropped future
        // inside it leaves the writer to be settled.
        *in_doubt = true;
        sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
        let mut written = Ok(());
        for chunk in rows.chunks(ROWS_PER_STATEMENT) {
            written = insert_chunk(conn, chunk).await;
            if written.is_err() {
                break;
            }
        }
        if written.is_ok() {
            written = sqlx::query("COMMIT")
                .execute(&mut *conn)
                .await
                .map(drop)
                .map_err(Error::from);
        }
        *in_doubt = written.is_err() && {
            // A statement that failed, or a commit that did, left the transaction open.
            sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err()
        };
        written
    }

    async fn write_batch_unsynced(
        &self,
        requests: &[RequestRecord],
        attempts: &[AttemptRecord],
        payloads: &[Payload],
    ) -> Result<bool> {
        let n = requests.len() + attempts.len() + payloads.len();
        if n == 0 {
            return Ok(true);
        }
        // One statement, in autocommit: a quiet commit never holds a transaction open, so
        // a failed one leaves nothing to roll back.
        if n > ROWS_PER_STATEMENT {
            return Ok(false);
        }
        let mut guard = self.writer.lock().await;
        let (conn, in_doubt) = &mut *guard;
        if *in_doubt {
            return Ok(false);
        }
        let rows = batch_rows(requests, attempts, payloads);
        if self.durability == Durability::ProcessCrashOnly {
            insert_chunk(conn, &rows).await?;
            return Ok(true);
        }
        // The writer's own connection, its sync lowered for this one commit, rather than
        // a second connection: two connections writing in turn each find the WAL changed
        // by the other at their next commit and drop their whole page cache, so every
        // commit reads its b-tree pages back (a synced commit took 30 µs longer so).
        //
        // SQLite applies `PRAGMA synchronous` when it compiles the statement, so it is
        // never a cached statement. The lowering is sent without waiting for its answer:
        // the worker thread runs commands in the order sent, and one that somehow did not
        // go out only makes this commit sync. Then the insert, and the sync level back up
        // before the lock is let go.
        //
        // In doubt from the lowering on, and until the restore is confirmed: a panic, or a
        // caller that drops this future in between, leaves the writer to be settled rather
        // than syncing nothing. A restore that fails answers `Ok(false)`, so the caller
        // keeps the rows for a synced commit (writing them twice is harmless: a request's
        // row is its latest state, the others are replaced); an insert that failed as
        // well answers its own error.
        *in_doubt = true;
        {
            use futures_util::{FutureExt, StreamExt};
            let mut lower =
                sqlx::Executor::fetch_many(&mut *conn, sqlx::query("PRAGMA synchronous = NORMAL").persistent(false));
            let _ = lower.next().now_or_never();
        }
        let written = insert_chunk(conn, &rows).await;
        if restore_sync(conn).await.is_err() {
            return written.map(|()| false);
        }
        *in_doubt = false;
        written.map(|()| true)
    }

    async fn sync(&self) -> Result<()> {
        // What a synced commit ends with: the WAL's data on disk. Any descriptor of the
        // file will do, as the kernel syncs the file, not the descriptor.
        let wal = self.wal_file()?;
        tokio::task::spawn_blocking(move || wal.sync_data())
            .await
            .map_err(|e| Error::Unavailable(format!("the ledger's WAL sync did not finish: {e}")))?
            .map_err(|e| Error::Unavailable(format!("cannot sync the ledger's WAL: {e}")))
    }

    async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE id = ?"
        )))
        .bind(id)
        .fetch_optional(&self.readers)
        .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn attempts(&self, request_id: &str) -> Result<Vec<AttemptRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE request_id = ? ORDER BY attempt_no"
        )))
        .bind(request_id)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(attempt_from_row).collect()
    }

    async fn search(&self, s: &Search) -> Result<Page> {
        let limit = s.limit.unwrap_or(50).clamp(1, 500);
        let mut q: QueryBuilder<Sqlite> =
            QueryBuilder::new(format!("SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE 1 = 1"));
        if let Some(before) = &s.before {
            q.push(" AND id < ").push_bind(before.clone());
        }
        // The key is a UUIDv7, which starts with its millisecond timestamp: a time range is
        // a key range, so it needs no index of its own.
        if let Some(from) = s.from_ms {
            q.push(" AND id >= ").push_bind(uuid_floor(from));
        }
        if let Some(to) = s.to_ms {
            q.push(" AND id < ").push_bind(uuid_floor(to));
        }
        if let Some(route) = &s.route {
            q.push(" AND route = ").push_bind(route.clone());
        }
        if let Some(state) = s.state {
            q.push(" AND state = ").push_bind(state.as_str());
        }
        if let Some(api) = s.api {
            let mut list = q.separated(", ");
            list.push_unseparated(" AND endpoint IN (");
            for e in api.endpoints() {
                list.push_bind(e);
            }
            list.push_unseparated(")");
        }
        if let Some(needle) = s.q.as_deref().map(str::trim).filter(|n| !n.is_empty()) {
            // One indexed lookup per kind of id; a trace id the gateway made is its request id.
            q.push(" AND id IN (SELECT id FROM requests WHERE id = ")
                .push_bind(needle.to_owned());
            if let Some(as_id) = hex_to_uuid(needle) {
                q.push(" UNION SELECT id FROM requests WHERE id = ").push_bind(as_id);
            }
            q.push(" UNION SELECT id FROM requests WHERE client_request_id = ")
                .push_bind(needle.to_owned());
            q.push(" UNION SELECT id FROM requests WHERE trace_id = ")
                .push_bind(needle.to_owned())
                .push(" AND trace_id <> replace(id, '-', ''))");
        }
        q.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(limit) + 1);
        let rows = q.build().fetch_all(&self.readers).await?;
        let mut items = rows.iter().map(request_from_row).collect::<Result<Vec<_>>>()?;
        let next = if items.len() > limit as usize {
            items.truncate(limit as usize);
            items.last().map(|r| r.id.clone())
        } else {
            None
        };
        Ok(Page { items, next })
    }

    async fn mark_interrupted_unknown(&self) -> Result<u64> {
        let mut writer = self.writer.lock().await;
        self.settle(&mut writer).await?;
        let conn = &mut writer.0;
        let r = sqlx::query(
            "UPDATE requests SET state = 'unknown', error_class = 'interrupted', \
             error_message = 'the gateway stopped while this request was calling the provider' \
             WHERE state = 'calling_api'",
        )
        .execute(conn)
        .await?;
        Ok(r.rows_affected())
    }

    async fn record_transition(&self, state: Option<&ControlState>, audit: &AuditEntry) -> Result<()> {
        let mut writer = self.writer.lock().await;
        self.settle(&mut writer).await?;
        let mut tx = writer.0.begin().await?;
        if let Some(c) = state {
            sqlx::query(
                "INSERT INTO control_state (kind, subject, state, updated_at) VALUES (?, ?, ?, ?) \
                 ON CONFLICT (kind, subject) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            )
            .bind(&c.kind)
            .bind(&c.subject)
            .bind(&c.state)
            .bind(c.updated_at.0)
            .execute(&mut *tx)
            .await?;
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn control_states(&self) -> Result<Vec<ControlState>> {
        let rows = sqlx::query("SELECT kind, subject, state, updated_at FROM control_state ORDER BY kind, subject")
            .fetch_all(&self.readers)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ControlState {
                    kind: r.try_get("kind")?,
                    subject: r.try_get("subject")?,
                    state: r.try_get("state")?,
                    updated_at: UnixMs(r.try_get("updated_at")?),
                })
            })
            .collect()
    }

    async fn audit(&self, kind: Option<&str>, subject: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>> {
        let rows = sqlx::query(
            "SELECT id, at, kind, subject, actor, action, trigger, reason, figures FROM audit \
             WHERE (?1 IS NULL OR kind = ?1) AND (?2 IS NULL OR subject = ?2) ORDER BY id DESC LIMIT ?3",
        )
        .bind(kind)
        .bind(subject)
        .bind(i64::from(limit.min(1000)))
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditEntry {
                    id: r.try_get("id")?,
                    at: UnixMs(r.try_get("at")?),
                    kind: r.try_get("kind")?,
                    subject: r.try_get("subject")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    trigger: r.try_get("trigger")?,
                    reason: r.try_get("reason")?,
                    figures: r.try_get("figures")?,
                })
            })
            .collect()
    }

    async fn by_response_id(&self, key_name: &str, response_id: &str) -> Result<Option<RequestRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE response_id = ? AND response_id IS NOT NULL \
             AND key_name = ? ORDER BY id DESC LIMIT 1"
        )))
        .bind(response_id)
        .bind(key_name)
        .fetch_optional(&self.readers)
        .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn keyed(
        &self,
        key_name: &str,
        idempotency_key: &str,
        since: UnixMs,
        now: UnixMs,
    ) -> Result<Option<KeyedRequest>> {
        // The partial index finds the key's rows; the newest is the one that counts (a
        // key whose request failed may run again, as a newer row).
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE key_name = ? AND idempotency_key = ? \
             AND idempotency_key IS NOT NULL \
             AND (received_at >= ? OR state IN ('received', 'calling_api', 'unknown')) ORDER BY id DESC LIMIT 1"
        )))
        .bind(key_name)
        .bind(idempotency_key)
        .bind(since.0)
        .fetch_optional(&self.readers)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let request = request_from_row(&row)?;
        let stored = sqlx::query(
            "SELECT response_status, response_content_type, response_body FROM payloads \
             WHERE request_id = ? AND expires_at > ? AND response_body IS NOT NULL",
        )
        .bind(&request.id)
        .bind(now.0)
        .fetch_optional(&self.readers)
        .await?;
        let response = match stored {
            Some(r) => Some(StoredResponse {
                status: r.try_get::<i64, _>("response_status")? as u16,
                content_type: r.try_get("response_content_type")?,
                body: r.try_get("response_body")?,
            }),
            None => None,
        };
        Ok(Some(KeyedRequest { request, response }))
    }

    async fn reconcile(&self, id: &str, r: &Reconcile, at: UnixMs) -> Result<RequestRecord> {
        let state = match r.outcome {
            Reconciliation::ConfirmedDone => RequestState::Done,
            Reconciliation::ConfirmedNotExecuted => RequestState::Failed,
        };
        {
            let mut writer = self.writer.lock().await;
            self.settle(&mut writer).await?;
            let mut tx = writer.0.begin().await?;
            let changed = sqlx::query(
                "UPDATE requests SET state = ?, reconciliation = ?, reconciled_by = ?, reconciled_reason = ?, \
                 reconciled_at = ?, result_id = COALESCE(?, result_id), finished_at = COALESCE(finished_at, ?) \
                 WHERE id = ? AND state = 'unknown'",
            )
            .bind(state.as_str())
            .bind(r.outcome.as_str())
            .bind(&r.actor)
            .bind(&r.reason)
            .bind(at.0)
            .bind(&r.result_id)
            .bind(at.0)
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if changed == 0 {
                tx.rollback().await?;
                drop(writer);
                return Err(match self.get_request(id).await? {
                    None => Error::NotFound,
                    Some(cur) => Error::Conflict(format!(
                        "request {id} is `{}`, not unknown: there is nothing to reconcile{}",
                        cur.state.as_str(),
                        cur.reconciled_by()
                            .map(|b| format!(" ({b} reconciled it already)"))
                            .unwrap_or_default()
                    )),
                });
            }
            sqlx::query(
                "INSERT INTO audit (at, kind, subject, actor, action, trigger, reason, figures) \
                 VALUES (?, 'request', ?, ?, ?, ?, ?, NULL)",
            )
            .bind(at.0)
            .bind(id)
            .bind(&r.actor)
            .bind(format!("unknown->{}", r.outcome.as_str()))
            .bind(r.result_id.as_ref().map(|v| format!("result id {v}")))
            .bind(&r.reason)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        self.get_request(id).await?.ok_or(Error::NotFound)
    }

    async fn side_effect(&self, id: &str, step: &SideEffect, at: UnixMs) -> Result<RequestRecord> {
        let (sql, result_id) = match step {
            SideEffect::Pending => (
                "UPDATE requests SET state = 'side_effect_pending', side_effect_at = ? \
                 WHERE id = ? AND state IN ('api_completed', 'done') AND result_id IS NULL",
                None,
            ),
            SideEffect::Done { result_id } => (
                "UPDATE requests SET state = 'done', side_effect_at = ?, result_id = ? \
                 WHERE id = ? AND state IN ('api_completed', 'done', 'side_effect_pending') AND result_id IS NULL",
                Some(result_id),
            ),
        };
        let changed = {
            let mut writer = self.writer.lock().await;
            self.settle(&mut writer).await?;
            let mut q = sqlx::query(sql).bind(at.0);
            if let Some(r) = result_id {
                q = q.bind(r);
            }
            q.bind(id).execute(&mut writer.0).await?.rows_affected()
        };
        let cur = self.get_request(id).await?.ok_or(Error::NotFound)?;
        if changed > 0 {
            return Ok(cur);
        }
        // Marking again what is already marked is fine (a client retrying its call).
        let same = match step {
            SideEffect::Pending => cur.state == RequestState::SideEffectPending,
            SideEffect::Done { result_id } => cur.result_id() == Some(result_id.as_str()),
        };
        if same {
            return Ok(cur);
        }
        Err(Error::Conflict(match (cur.result_id(), cur.state) {
            (Some(r), _) => format!("request {id} already has its side effect recorded as done (result id {r})"),
            (None, s) => format!(
                "request {id} is `{}`: a side effect is recorded only for a request whose answer arrived",
                s.as_str()
            ),
        }))
    }

    async fn unknowns(&self, limit: u32) -> Result<Vec<RequestRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE state = 'unknown' ORDER BY id DESC LIMIT ?"
        )))
        .bind(i64::from(limit.clamp(1, 1000)))
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(request_from_row).collect()
    }

    async fn figures(&self, since: UnixMs) -> Result<LedgerFigures> {
        let counts = |rows: Vec<SqliteRow>| -> Result<Vec<RouteCount>> {
            rows.iter()
                .map(|r| {
                    Ok(RouteCount {
                        route: r
                            .try_get::<Option<String>, _>(0)?
                            .unwrap_or_else(|| "(no route)".into()),
                        count: r.try_get::<i64, _>(1)?.max(0) as u64,
                    })
                })
                .collect()
        };
        let unknown_by_route = counts(
            sqlx::query("SELECT route, COUNT(*) FROM requests WHERE state = 'unknown' GROUP BY route ORDER BY 2 DESC")
                .fetch_all(&self.readers)
                .await?,
        )?;
        // A key that completed upstream twice: the thing the idempotency ledger exists to
        // prevent, checked from the rows themselves.
        let duplicates_by_route = counts(
            sqlx::query(
                "SELECT route, COUNT(*) FROM (SELECT MAX(route) AS route FROM requests \
                 WHERE idempotency_key IS NOT NULL AND id >= ? AND received_at >= ? \
                 AND state IN ('api_completed', 'side_effect_pending', 'done') \
                 GROUP BY key_name, idempotency_key HAVING COUNT(*) > 1) GROUP BY route ORDER BY 2 DESC",
            )
            .bind(uuid_floor(since))
            .bind(since.0)
            .fetch_all(&self.readers)
            .await?,
        )?;
        let p = sqlx::query(
            "SELECT COUNT(*), COALESCE(SUM(COALESCE(length(request_body), 0) + COALESCE(length(response_body), 0)), 0) \
             FROM payloads",
        )
        .fetch_one(&self.readers)
        .await?;
        Ok(LedgerFigures {
            unknown: unknown_by_route.iter().map(|c| c.count).sum(),
            unknown_by_route,
            duplicates: duplicates_by_route.iter().map(|c| c.count).sum(),
            duplicates_by_route,
            bytes: self.file_bytes(),
            payloads: p.try_get::<i64, _>(0)?.max(0) as u64,
            payload_bytes: p.try_get::<i64, _>(1)?.max(0) as u64,
        })
    }

    async fn prune(
        &self,
        now: UnixMs,
        finished_before: Option<UnixMs>,
        keys_since: UnixMs,
        vacuum: bool,
    ) -> Result<PruneReport> {
        let mut report = PruneReport {
            bytes_before: self.file_bytes(),
            ..PruneReport::default()
        };
        // In chunks, the writer's lock let go between them: a prune never holds the
        // request path's commits for longer than one chunk.
        report.payloads = self
            .delete_in_chunks(
                "DELETE FROM payloads WHERE rowid IN (SELECT rowid FROM payloads WHERE expires_at <= ?1 LIMIT 1000)",
                now.0,
            )
            .await?;
        if let Some(before) = finished_before {
            // The key range of ids before the cut-off (UUIDv7 ids start with their time).
            // Unknown and unfinished requests stay whatever their age, and so does every
            // request whose `Idempotency-Key` is still inside its window: pruning it would
            // let a repeat run again.
            let floor = uuid_floor(before);
            let pick = "SELECT id FROM requests WHERE id < ?1 AND state IN ('done', 'failed') \
                        AND (idempotency_key IS NULL OR received_at < ?2) ORDER BY id LIMIT 1000";
            let mut writer_rows = (0u64, 0u64);
            loop {
                let mut w = self.writer.lock().await;
                self.settle(&mut w).await?;
                let mut tx = w.0.begin().await?;
                let run = |sql: String| sqlx::query(AssertSqlSafe(sql)).bind(floor.clone()).bind(keys_since.0);
                // B4: a balance is credits minus the requests' costs, so the costs of the
                // requests pruned now are folded into a credit (and a key's spend) first.
                run(format!(
                    "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
                     SELECT owner, {at}, 'pruned_charges', -SUM(cost_usd), 'gateway', 'costs of pruned requests' \
                     FROM requests WHERE id IN ({pick}) AND owner IS NOT NULL AND cost_usd IS NOT NULL \
                     GROUP BY owner HAVING SUM(cost_usd) <> 0",
                    at = now.0
                ))
                .execute(&mut *tx)
                .await?;
                run(format!(
                    "INSERT INTO key_spend (key_name, folded_usd) \
                     SELECT key_name, SUM(cost_usd) FROM requests WHERE id IN ({pick}) \
                     AND key_name IS NOT NULL AND cost_usd IS NOT NULL GROUP BY key_name HAVING SUM(cost_usd) <> 0 \
                     ON CONFLICT (key_name) DO UPDATE SET folded_usd = folded_usd + excluded.folded_usd"
                ))
                .execute(&mut *tx)
                .await?;
                writer_rows.1 += run(format!("DELETE FROM attempts WHERE request_id IN ({pick})"))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                run(format!("DELETE FROM payloads WHERE request_id IN ({pick})"))
                    .execute(&mut *tx)
                    .await?;
                let n = run(format!("DELETE FROM requests WHERE id IN ({pick})"))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                tx.commit().await?;
                drop(w);
                writer_rows.0 += n;
                if n == 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            (report.requests, report.attempts) = writer_rows;
        }
        if vacuum {
            let mut w = self.writer.lock().await;
            self.settle(&mut w).await?;
            sqlx::query("VACUUM").execute(&mut w.0).await?;
            drop(w);
            let mut conn = self.maintenance.lock().await;
            sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_all(&mut *conn)
                .await?;
        }
        report.bytes_after = self.file_bytes();
        Ok(report)
    }

    async fn accounts(&self) -> Result<Accounts> {
        let credits = sqlx::query("SELECT owner, TOTAL(amount_usd) FROM balance_entries GROUP BY owner")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<f64, _>(1)?)))
            .collect::<Result<Vec<_>>>()?;
        let prepaid = sqlx::query("SELECT DISTINCT owner FROM balance_entries WHERE kind IN ('seed', 'top_up')")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(|r| Ok(r.try_get::<String, _>(0)?))
            .collect::<Result<Vec<_>>>()?;
        // Every request ever: the smallest id floor.
        let spend = self.spend_since(UnixMs(0)).await?;
        let keys = sqlx::query(
            "SELECT name, owner, secret_sha256, hint, rpm, max_concurrency, created_at, created_by, revoked_at, \
             revoked_by FROM api_keys ORDER BY created_at",
        )
        .fetch_all(&self.readers)
        .await?
        .iter()
        .map(|r| {
            Ok(StoredKey {
                name: r.try_get("name")?,
                owner: r.try_get("owner")?,
                secret_sha256: r.try_get("secret_sha256")?,
                hint: r.try_get("hint")?,
                rpm: r.try_get::<Option<i64>, _>("rpm")?.map(|v| v as u32),
                max_concurrency: r.try_get::<Option<i64>, _>("max_concurrency")?.map(|v| v as u32),
                created_at: UnixMs(r.try_get("created_at")?),
                created_by: r.try_get("created_by")?,
                revoked_at: ms(r.try_get("revoked_at")?),
                revoked_by: r.try_get("revoked_by")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
        let key_spend = sqlx::query("SELECT key_name, limit_set, spend_limit_usd, folded_usd FROM key_spend")
            .fetch_all(&self.readers)
            .await?
            .iter()
            .map(|r| {
                Ok(KeySpend {
                    key_name: r.try_get(0)?,
                    limit_set: r.try_get(1)?,
                    spend_limit_usd: r.try_get(2)?,
                    folded_usd: r.try_get(3)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Accounts {
            credits,
            prepaid,
            spend,
            keys,
            key_spend,
        })
    }

    async fn seed_owners(&self, seeds: &[(String, f64)], at: UnixMs) -> Result<Vec<String>> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        let mut seeded = Vec::new();
        for (owner, amount) in seeds {
            // The balance starts at the seed whatever the owner spent before it was
            // prepaid (while metered, or in requests pruned since): the credit makes up
            // the difference.
            let n = sqlx::query(
                "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
                 SELECT ?1, ?2, 'seed', ?3 - (SELECT TOTAL(amount_usd) FROM balance_entries WHERE owner = ?1) \
                     + (SELECT TOTAL(cost_usd) FROM requests WHERE owner = ?1 AND cost_usd IS NOT NULL), \
                     'config', 'balance_usd in the config' \
                 WHERE NOT EXISTS (SELECT 1 FROM balance_entries WHERE owner = ?1 AND kind IN ('seed', 'top_up'))",
            )
            .bind(owner)
            .bind(at.0)
            .bind(amount)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n > 0 {
                seeded.push(owner.clone());
            }
        }
        tx.commit().await?;
        Ok(seeded)
    }

    async fn credit(&self, e: &BalanceEntry, audit: &AuditEntry) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        // The first money a metered owner gets makes it prepaid: its balance starts at
        // the amount, not at the amount less everything it spent while metered.
        sqlx::query(
            "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
             SELECT ?1, ?2, 'opening', \
                 (SELECT TOTAL(cost_usd) FROM requests WHERE owner = ?1 AND cost_usd IS NOT NULL) \
                 - (SELECT TOTAL(amount_usd) FROM balance_entries WHERE owner = ?1), \
                 'gateway', 'the owner becomes prepaid: its metered spend is not taken from its first credit' \
             WHERE NOT EXISTS (SELECT 1 FROM balance_entries WHERE owner = ?1 AND kind IN ('seed', 'top_up'))",
        )
        .bind(&e.owner)
        .bind(e.at.0)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(&e.owner)
        .bind(e.at.0)
        .bind(&e.kind)
        .bind(e.amount_usd)
        .bind(&e.actor)
        .bind(&e.reason)
        .execute(&mut *tx)
        .await?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn create_key(&self, k: &StoredKey, spend_limit: Option<f64>, audit: &AuditEntry) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        let taken = sqlx::query("SELECT 1 FROM api_keys WHERE name = ? OR secret_sha256 = ?")
            .bind(&k.name)
            .bind(&k.secret_sha256)
            .fetch_optional(&mut *tx)
            .await?;
        if taken.is_some() {
            return Err(Error::Conflict(format!("a key named `{}` exists already", k.name)));
        }
        sqlx::query(
            "INSERT INTO api_keys (name, owner, secret_sha256, hint, rpm, max_concurrency, created_at, created_by) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&k.name)
        .bind(&k.owner)
        .bind(&k.secret_sha256)
        .bind(&k.hint)
        .bind(k.rpm.map(i64::from))
        .bind(k.max_concurrency.map(i64::from))
        .bind(k.created_at.0)
        .bind(&k.created_by)
        .execute(&mut *tx)
        .await?;
        if spend_limit.is_some() {
            upsert_spend_limit(&mut tx, &k.name, spend_limit, k.created_at, &k.created_by).await?;
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn revoke_key(&self, name: &str, at: UnixMs, by: &str, audit: &AuditEntry) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        let n = sqlx::query("UPDATE api_keys SET revoked_at = ?, revoked_by = ? WHERE name = ? AND revoked_at IS NULL")
            .bind(at.0)
            .bind(by)
            .bind(name)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            return Err(Error::NotFound);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn set_spend_limit(
        &self,
        key_name: &str,
        limit: Option<f64>,
        at: UnixMs,
        by: &str,
        audit: &AuditEntry,
    ) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        upsert_spend_limit(&mut tx, key_name, limit, at, by).await?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn spend_since(&self, since: UnixMs) -> Result<Vec<SpendRow>> {
        sqlx::query(
            "SELECT owner, key_name, route, TOTAL(cost_usd), COUNT(*) FROM requests \
             WHERE id >= ? AND cost_usd IS NOT NULL GROUP BY owner, key_name, route",
        )
        .bind(uuid_floor(since))
        .fetch_all(&self.readers)
        .await?
        .iter()
        .map(|r| {
            Ok(SpendRow {
                owner: r.try_get(0)?,
                key_name: r.try_get(1)?,
                route: r.try_get(2)?,
                cost_usd: r.try_get(3)?,
                requests: r.try_get::<i64, _>(4)?.max(0) as u64,
            })
        })
        .collect()
    }

    async fn cost_report(&self, since: UnixMs, bucket_ms: i64) -> Result<Vec<CostCell>> {
        let bucket = bucket_ms.max(1000);
        sqlx::query(
            "SELECT (received_at / ?2) * ?2 AS b, owner, key_name, route, COALESCE(served_model, requested_model), \
             COUNT(*), SUM(CASE WHEN cost_usd IS NULL THEN 1 ELSE 0 END), COALESCE(SUM(cost_usd), 0.0), \
             COALESCE(SUM(failed_cost_usd), 0.0), COALESCE(SUM(MAX(attempts - 1, 0)), 0), \
             COALESCE(SUM(CASE WHEN cost_usd IS NOT NULL AND attempts > 0 THEN estimated_cost_usd END), 0.0), \
             COALESCE(SUM(CASE WHEN estimated_cost_usd IS NOT NULL AND attempts > 0 THEN cost_usd END), 0.0), \
             COALESCE(SUM(CASE WHEN input_tokens IS NOT NULL THEN estimated_input_tokens END), 0), \
             COALESCE(SUM(CASE WHEN estimated_input_tokens IS NOT NULL THEN \
                 input_tokens + COALESCE(CASE WHEN format = 'anthropic' THEN COALESCE(cached_input_tokens, 0) \
                 + COALESCE(cache_write_tokens, 0) END, 0) END), 0) \
             FROM requests WHERE id >= ?1 AND state NOT IN ('received', 'calling_api') \
             GROUP BY b, owner, key_name, route, COALESCE(served_model, requested_model) ORDER BY b",
        )
        .bind(uuid_floor(since))
        .bind(bucket)
        .fetch_all(&self.readers)
        .await?
        .iter()
        .map(|r| {
            let n = |i: usize| -> Result<u64> { Ok(r.try_get::<i64, _>(i)?.max(0) as u64) };
            Ok(CostCell {
                at: UnixMs(r.try_get(0)?),
                owner: r.try_get(1)?,
                key_name: r.try_get(2)?,
                route: r.try_get(3)?,
                model: r.try_get(4)?,
                requests: n(5)?,
                unknown_cost: n(6)?,
                cost_usd: r.try_get(7)?,
                failed_cost_usd: r.try_get(8)?,
                retries: n(9)?,
                estimated_usd: r.try_get(10)?,
                estimated_actual_usd: r.try_get(11)?,
                estimated_input_tokens: n(12)?,
                actual_input_tokens: n(13)?,
            })
        })
        .collect()
    }

    async fn save_jobs(&self, jobs: &[JobRecord], audit: &[AuditEntry]) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        for j in jobs {
            upsert_job(&mut tx, j).await?;
        }
        for a in audit {
            insert_audit(&mut tx, a).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn job(&self, id: &str) -> Result<Option<JobRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?")))
            .bind(id)
            .fetch_optional(&self.readers)
            .await?;
        row.as_ref().map(|r| job_from_row(r, true)).transpose()
    }

    async fn job_by_key(&self, key_name: &str, idempotency_key: &str) -> Result<Option<JobRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE key_name = ? AND idempotency_key = ? \
             ORDER BY created_at DESC, rowid DESC LIMIT 1",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(key_name)
        .bind(idempotency_key)
        .fetch_optional(&self.readers)
        .await?;
        row.as_ref().map(|r| job_from_row(r, false)).transpose()
    }

    async fn open_jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE state IN ('queued', 'running', 'owner_review', 'dead_letter') \
             ORDER BY created_at",
            list = *JOB_LIST_COLUMNS
        )))
        // Read once, at start-up, on the writer's connection: the start-up's other reads
        // hold a reader, and a second one would open (with its own page cache) only for this.
        .fetch_all(&mut self.writable().await?.0)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn recent_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(i64::from(limit.min(1000)))
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn job_requests(&self, job_id: &str) -> Result<Vec<RequestRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE job_id = ? ORDER BY received_at, id"
        )))
        .bind(job_id)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(request_from_row).collect()
    }

    async fn save_recovery(&self, run: &RecoveryRow, audit: &[AuditEntry]) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        sqlx::query(
            "INSERT INTO recovery_runs (id, route, drill, step, opened_at, closed_at, body) VALUES (?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (id) DO UPDATE SET step = excluded.step, closed_at = excluded.closed_at, body = excluded.body",
        )
        .bind(&run.id)
        .bind(&run.route)
        .bind(&run.drill)
        .bind(&run.step)
        .bind(run.opened_at.0)
        .bind(run.closed_at.map(|c| c.0))
        .bind(&run.body)
        .execute(&mut *tx)
        .await?;
        for a in audit {
            insert_audit(&mut tx, a).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn recoveries(&self, limit: u32) -> Result<Vec<RecoveryRow>> {
        let rows = sqlx::query(
            "SELECT id, route, drill, step, opened_at, closed_at, body FROM recovery_runs \
             ORDER BY closed_at IS NOT NULL, opened_at DESC LIMIT ?",
        )
        .bind(i64::from(limit.clamp(1, 10_000)))
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(RecoveryRow {
                    id: r.try_get("id")?,
                    route: r.try_get("route")?,
                    drill: r.try_get("drill")?,
                    step: r.try_get("step")?,
                    opened_at: UnixMs(r.try_get("opened_at")?),
                    closed_at: r.try_get::<Option<i64>, _>("closed_at")?.map(UnixMs),
                    body: r.try_get("body")?,
                })
            })
            .collect()
    }

    async fn save_evidence(&self, run_id: &str, bytes: &[u8]) -> Result<()> {
        let mut w = self.writable().await?;
        sqlx::query("INSERT OR REPLACE INTO recovery_evidence (run_id, bytes) VALUES (?, ?)")
            .bind(run_id)
            .bind(bytes)
            .execute(&mut w.0)
            .await?;
        Ok(())
    }

    async fn evidence(&self, run_id: &str) -> Result<Option<Vec<u8>>> {
        Ok(
            sqlx::query_scalar("SELECT bytes FROM recovery_evidence WHERE run_id = ?")
                .bind(run_id)
                .fetch_optional(&self.readers)
                .await?,
        )
    }

    async fn route_unknowns(&self, route: &str) -> Result<u64> {
        // The partial index on unknown rows: rare by nature, cheap to count.
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM requests WHERE state = 'unknown' AND route = ?")
            .bind(route)
            .fetch_one(&self.readers)
            .await?;
        Ok(n.max(0) as u64)
    }

    async fn first_failure(
        &self,
        route: &str,
        from: UnixMs,
        to: UnixMs,
        after_last_success: bool,
    ) -> Result<Option<String>> {
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        Ok(sqlx::query_scalar(
            "SELECT MIN(id) FROM requests WHERE id >= ?1 AND id < ?2 AND route = ?3 \
             AND state IN ('failed', 'unknown') AND attempts > 0 \
             AND (?4 = 0 OR id > COALESCE((SELECT MAX(id) FROM requests WHERE id >= ?1 AND id < ?2 AND route = ?3 \
             AND state = 'done'), ''))",
        )
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .bind(after_last_success)
        .fetch_one(&self.readers)
        .await?)
    }

    async fn normal_latency(&self, route: &str, from: UnixMs, to: UnixMs) -> Result<Option<f64>> {
        let row = sqlx::query(
            "SELECT v FROM (SELECT finished_at - received_at AS v, ROW_NUMBER() OVER (ORDER BY finished_at - received_at) AS rn, \
             COUNT(*) OVER () AS n FROM requests WHERE id >= ? AND id < ? AND route = ? AND state = 'done' \
             AND stream = 0 AND finished_at IS NOT NULL) WHERE rn = MAX(1, (n * 95 + 99) / 100)",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .bind(route)
        .fetch_optional(&self.readers)
        .await?;
        Ok(match row {
            Some(r) => Some(r.try_get::<i64, _>(0)? as f64),
            None => None,
        })
    }

    async fn scorecard(&self, from: UnixMs, to: UnixMs, route: Option<&str>) -> Result<Vec<ScoreRow>> {
        // Rows by their key: a UUIDv7 id starts with its millisecond (`received_at`).
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        let window = "id >= ?1 AND id < ?2 AND route IS NOT NULL AND (?3 IS NULL OR route = ?3)";
        let mut rows: Vec<ScoreRow> = Vec::new();
        let agg = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COUNT(*), COALESCE(SUM(attempts), 0), COALESCE(SUM(attempts > 0), 0), \
             COALESCE(SUM(state = 'done'), 0), COALESCE(SUM(attempts > 1), 0), \
             COALESCE(SUM(state = 'failed'), 0), COALESCE(SUM(state = 'unknown'), 0), \
             COALESCE(SUM(cost_usd), 0.0), COALESCE(SUM(cost_usd IS NULL AND attempts > 0), 0), \
             COALESCE(SUM(attempts > 1 AND state = 'done'), 0), COALESCE(SUM(MAX(attempts - 1, 0)), 0) \
             FROM requests WHERE {window} GROUP BY route ORDER BY route"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        let n = |r: &SqliteRow, i: usize| -> Result<u64> { Ok(r.try_get::<i64, _>(i)?.max(0) as u64) };
        let mut overall = ScoreRow {
            route: "overall".into(),
            ..ScoreRow::default()
        };
        let (mut attempted_all, mut retried_all, mut retried_ok_all) = (0u64, 0u64, 0u64);
        for r in &agg {
            let (requests, attempts, attempted, succeeded) = (n(r, 1)?, n(r, 2)?, n(r, 3)?, n(r, 4)?);
            let (retried, retried_ok) = (n(r, 5)?, n(r, 10)?);
            let row = ScoreRow {
                route: r.try_get(0)?,
                requests,
                attempts,
                retries: n(r, 11)?,
                amplification: (attempted > 0).then(|| attempts as f64 / attempted as f64),
                success_rate: (requests > 0).then(|| succeeded as f64 / requests as f64),
                post_retry_success_rate: (retried > 0).then(|| retried_ok as f64 / retried as f64),
                succeeded,
                failed: n(r, 6)?,
                unknowns: n(r, 7)?,
                cost_usd: r.try_get(8)?,
                unpriced: n(r, 9)?,
                ..ScoreRow::default()
            };
            overall.requests += row.requests;
            overall.attempts += row.attempts;
            overall.retries += row.retries;
            overall.succeeded += row.succeeded;
            overall.failed += row.failed;
            overall.unknowns += row.unknowns;
            overall.cost_usd += row.cost_usd;
            overall.unpriced += row.unpriced;
            attempted_all += attempted;
            retried_all += retried;
            retried_ok_all += retried_ok;
            rows.push(row);
        }
        overall.amplification = (attempted_all > 0).then(|| overall.attempts as f64 / attempted_all as f64);
        overall.success_rate = (overall.requests > 0).then(|| overall.succeeded as f64 / overall.requests as f64);
        overall.post_retry_success_rate = (retried_all > 0).then(|| retried_ok_all as f64 / retried_all as f64);
        let idx = |rows: &[ScoreRow], route: &str| rows.iter().position(|r| r.route == route);

        let mix = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COALESCE(error_class, 'unclassified'), COUNT(*) FROM requests \
             WHERE {window} AND state = 'failed' GROUP BY 1, 2 ORDER BY 3 DESC, 2"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        for r in &mix {
            let (route, class, count): (String, String, u64) = (r.try_get(0)?, r.try_get(1)?, n(r, 2)?);
            if let Some(i) = idx(&rows, &route) {
                rows[i].error_mix.push(ErrorCount {
                    class: class.clone(),
                    count,
                });
            }
            match overall.error_mix.iter_mut().find(|e| e.class == class) {
                Some(e) => e.count += count,
                None => overall.error_mix.push(ErrorCount { class, count }),
            }
        }
        overall
            .error_mix
            .sort_by(|a, b| b.count.cmp(&a.count).then(a.class.cmp(&b.class)));

        // A key that completed in the window and, counting every completion the ledger
        // holds (before the window too), more than once: the duplicate a retry after an
        // incident makes shows the moment it happens.
        let dups = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COUNT(*) FROM (SELECT MAX(w.route) AS route, w.key_name AS k, w.idempotency_key AS i \
             FROM requests w WHERE {window} AND w.idempotency_key IS NOT NULL \
             AND w.state IN ('api_completed', 'side_effect_pending', 'done') GROUP BY w.key_name, w.idempotency_key) d \
             WHERE (SELECT COUNT(*) FROM requests x WHERE x.key_name = d.k AND x.idempotency_key = d.i \
             AND x.state IN ('api_completed', 'side_effect_pending', 'done')) > 1 GROUP BY route"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        for r in &dups {
            let (route, count): (String, u64) = (r.try_get(0)?, n(r, 1)?);
            if let Some(i) = idx(&rows, &route) {
                rows[i].duplicates = count;
            }
            overall.duplicates += count;
        }

        // P50 and P95 by nearest rank, one sort per figure: each route's ranks, then the
        // whole window's.
        for (expr, is_wait) in [("finished_at - received_at", false), ("queued_ms", true)] {
            for partition in ["route", "'overall'"] {
                let q = format!(
                    "SELECT g, v, rn, n FROM (SELECT g, v, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v) AS rn, \
                     COUNT(*) OVER (PARTITION BY g) AS n FROM (SELECT {partition} AS g, {expr} AS v FROM requests \
                     WHERE {window} AND finished_at IS NOT NULL AND {expr} IS NOT NULL)) \
                     WHERE rn = MAX(1, (n * 50 + 99) / 100) OR rn = MAX(1, (n * 95 + 99) / 100)"
                );
                let got = sqlx::query(AssertSqlSafe(q))
                    .bind(&lo)
                    .bind(&hi)
                    .bind(route)
                    .fetch_all(&self.readers)
                    .await?;
                for r in &got {
                    let (g, v, rn, count): (String, i64, u64, u64) = (r.try_get(0)?, r.try_get(1)?, n(r, 2)?, n(r, 3)?);
                    let row = if g == "overall" && partition != "route" {
                        &mut overall
                    } else if let Some(i) = idx(&rows, &g) {
                        &mut rows[i]
                    } else {
                        continue;
                    };
                    let v = Some(v as f64);
                    if rn == crate::rank(0.5, count) {
                        if is_wait {
                            row.wait_p50_ms = v;
                        } else {
                            row.p50_ms = v;
                        }
                    }
                    if rn == crate::rank(0.95, count) {
                        if is_wait {
                            row.wait_p95_ms = v;
                        } else {
                            row.p95_ms = v;
                        }
                    }
                }
            }
        }
        rows.push(overall);
        Ok(rows)
    }

    async fn daily(&self, from: UnixMs, to: UnixMs) -> Result<Vec<DayFigures>> {
        let rows = sqlx::query(
            "SELECT route, received_at / 86400000 * 86400000 AS day, COUNT(*), COALESCE(SUM(attempts > 0), 0), \
             COALESCE(SUM(attempts), 0), COALESCE(SUM(cost_usd), 0.0), COALESCE(SUM(cost_usd IS NOT NULL AND attempts > 0), 0), \
             COALESCE(SUM(state = 'failed' AND http_status = 429), 0), \
             COALESCE(SUM(state = 'done' AND attempts > 0 AND upstream_request_id IS NULL AND endpoint NOT LIKE '%count_tokens%' \
                 AND endpoint NOT LIKE '%countTokens%'), 0) \
             FROM requests WHERE id >= ? AND id < ? AND route IS NOT NULL GROUP BY 1, 2 ORDER BY 2, 1",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .fetch_all(&self.readers)
        .await?;
        let n = |r: &SqliteRow, i: usize| -> Result<u64> { Ok(r.try_get::<i64, _>(i)?.max(0) as u64) };
        rows.iter()
            .map(|r| {
                Ok(DayFigures {
                    route: r.try_get(0)?,
                    day: UnixMs(r.try_get(1)?),
                    requests: n(r, 2)?,
                    attempted: n(r, 3)?,
                    attempts: n(r, 4)?,
                    cost_usd: r.try_get(5)?,
                    priced: n(r, 6)?,
                    rate_limited: n(r, 7)?,
                    untied: n(r, 8)?,
                })
            })
            .collect()
    }

    async fn last_good_versions(&self, route: &str, from: UnixMs, to: UnixMs) -> Result<Vec<(String, String)>> {
        // SQLite gives the bare columns of the row holding MAX(id): each workflow's newest.
        let rows = sqlx::query(
            "SELECT workflow, policy_version, MAX(id) FROM requests WHERE id >= ? AND id < ? AND route = ? \
             AND state = 'done' AND workflow IS NOT NULL AND policy_version IS NOT NULL GROUP BY workflow ORDER BY workflow",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }

    async fn route_requests(
        &self,
        route: &str,
        from: UnixMs,
        to: UnixMs,
        limit: u32,
    ) -> Result<Vec<(RequestRecord, Vec<AttemptRecord>)>> {
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        let reqs = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE id >= ? AND id < ? AND route = ? ORDER BY id LIMIT ?"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .bind(i64::from(limit))
        .fetch_all(&self.readers)
        .await?;
        let mut out: Vec<(RequestRecord, Vec<AttemptRecord>)> = Vec::with_capacity(reqs.len());
        for r in &reqs {
            out.push((request_from_row(r)?, Vec::new()));
        }
        let Some(last) = out.last().map(|(r, _)| r.id.clone()) else {
            return Ok(out);
        };
        // The attempts of the same rows, in one pass over the same key range.
        let atts = sqlx::query(AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE request_id >= ? AND request_id <= ? \
             AND request_id IN (SELECT id FROM requests WHERE id >= ? AND id <= ? AND route = ?) \
             ORDER BY request_id, attempt_no"
        )))
        .bind(&lo)
        .bind(&last)
        .bind(&lo)
        .bind(&last)
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        let mut i = 0;
        for a in &atts {
            let a = attempt_from_row(a)?;
            while i < out.len() && out[i].0.id < a.request_id {
                i += 1;
            }
            if i < out.len() && out[i].0.id == a.request_id {
                out[i].1.push(a);
            }
        }
        Ok(out)
    }

    async fn overruns(&self, route: Option<&str>, from: UnixMs, to: UnixMs) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE expires_at >= ?1 AND expires_at < ?2 \
             AND (?3 IS NULL OR COALESCE(route_override, route) = ?3) \
             AND ((state = 'dead_letter' AND updated_at >= expires_at) OR (state = 'succeeded' AND updated_at > expires_at)) \
             ORDER BY expires_at LIMIT 1000",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(from.0)
        .bind(to.0)
        .bind(route)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn save_policy_version(&self, v: &PolicyVersion) -> Result<bool> {
        let mut w = self.writable().await?;
        let n = sqlx::query(
            "INSERT INTO policy_versions (workflow, version, source, text, loaded_at) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (workflow, version) DO NOTHING",
        )
        .bind(&v.workflow)
        .bind(&v.version)
        .bind(&v.source)
        .bind(&v.text)
        .bind(v.loaded_at.0)
        .execute(&mut w.0)
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    async fn policy_versions(&self, workflow: Option<&str>) -> Result<Vec<PolicyVersion>> {
        let rows = sqlx::query(
            "SELECT workflow, version, source, text, loaded_at FROM policy_versions \
             WHERE (?1 IS NULL OR workflow = ?1) ORDER BY workflow, loaded_at DESC, version",
        )
        .bind(workflow)
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(PolicyVersion {
                    workflow: r.try_get("workflow")?,
                    version: r.try_get("version")?,
                    source: r.try_get("source")?,
                    text: r.try_get("text")?,
                    loaded_at: UnixMs(r.try_get("loaded_at")?),
                })
            })
            .collect()
    }

    async fn heartbeat(&self, row: &InstanceRow, lease_until: UnixMs) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        // A heartbeat means the instance is alive: a restarted one that was marked stopped
        // (or taken over) is live again.
        sqlx::query(
            "INSERT INTO instances (id, boot, listen, version, started_at, heartbeat_at, stopped_at, taken_over_by, \
             unknowns, load) VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, 0, ?) \
             ON CONFLICT (id) DO UPDATE SET boot = excluded.boot, listen = excluded.listen, \
             version = excluded.version, started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, \
             load = excluded.load, stopped_at = NULL, taken_over_by = NULL, unknowns = 0",
        )
        .bind(&row.id)
        .bind(&row.boot)
        .bind(&row.listen)
        .bind(&row.version)
        .bind(row.started_at.0)
        .bind(row.heartbeat_at.0)
        .bind(&row.load)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE jobs SET lease_until = ? WHERE lease_owner = ?")
            .bind(lease_until.0)
            .bind(&row.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn instances(&self) -> Result<Vec<InstanceRow>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {INSTANCE_COLUMNS} FROM instances ORDER BY (stopped_at IS NULL) DESC, id"
        )))
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(instance_from_row).collect()
    }

    async fn take_over(&self, by: &str, stale_before: UnixMs, at: UnixMs) -> Result<Vec<TakeOver>> {
        let candidates: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM instances WHERE stopped_at IS NULL AND heartbeat_at < ? AND id <> ? ORDER BY id",
        )
        .bind(stale_before.0)
        .bind(by)
        .fetch_all(&self.readers)
        .await?;
        let mut taken = Vec::new();
        for id in candidates {
            let mut w = self.writable().await?;
            let mut tx = w.0.begin().await?;
            // Checked again under the write lock: the instance may have heartbeated since.
            let claimed = sqlx::query(
                "UPDATE instances SET stopped_at = ?, taken_over_by = ? \
                 WHERE id = ? AND stopped_at IS NULL AND heartbeat_at < ?",
            )
            .bind(at.0)
            .bind(by)
            .bind(&id)
            .bind(stale_before.0)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if claimed == 0 {
                tx.rollback().await?;
                continue;
            }
            let unknowns = sqlx::query(
                "UPDATE requests SET state = 'unknown', error_class = 'interrupted', error_message = ? \
                 WHERE state = 'calling_api' AND instance = ?",
            )
            .bind(taken_over_message(&id))
            .bind(&id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            sqlx::query("UPDATE instances SET unknowns = ? WHERE id = ?")
                .bind(i(Some(unknowns)))
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            let jobs: Vec<String> = sqlx::query_scalar("SELECT id FROM jobs WHERE lease_owner = ? ORDER BY id")
                .bind(&id)
                .fetch_all(&mut *tx)
                .await?;
            sqlx::query("UPDATE jobs SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?")
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            taken.push(TakeOver {
                instance: id,
                unknowns,
                jobs,
            });
        }
        Ok(taken)
    }

    async fn instance_stopped(&self, id: &str, at: UnixMs) -> Result<()> {
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        sqlx::query("UPDATE instances SET stopped_at = ? WHERE id = ?")
            .bind(at.0)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE jobs SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn lease_job(&self, id: &str, instance: &str, now: UnixMs, until: UnixMs) -> Result<Option<JobRecord>> {
        // One writer: the conditional UPDATE is the lease, the SELECT in the same
        // transaction reads the row it leased.
        let mut w = self.writable().await?;
        let mut tx = w.0.begin().await?;
        let leased = sqlx::query(
            "UPDATE jobs SET lease_owner = ?1, lease_until = ?2 WHERE id = ?3 AND state = 'queued' AND ready_at <= ?4 \
             AND (lease_owner IS NULL OR lease_owner = ?1 OR lease_until < ?4)",
        )
        .bind(instance)
        .bind(until.0)
        .bind(id)
        .bind(now.0)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if leased == 0 {
            tx.rollback().await?;
            return Ok(None);
        }
        let row = sqlx::query(AssertSqlSafe(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?")))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let job = row.as_ref().map(|r| job_from_row(r, true)).transpose()?;
        tx.commit().await?;
        Ok(job)
    }

    async fn jobs_changed_since(&self, since: UnixMs) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE updated_at >= ? ORDER BY updated_at, id",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(since.0)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn maintain(&self) -> Result<u64> {
        // Checkpoints run beside the writer so its commits do not pay for them. But the
        // WAL only restarts (goes back to its start instead of growing) when the writer
        // begins a transaction at a moment the WAL is fully checkpointed, and a writer
        // that commits back to back never meets that moment. So once the WAL is large,
        // the writer is held for a second, short checkpoint of just the frames committed
        // during the first; its next commit then restarts the WAL.
        let mut conn = self.maintenance.lock().await;
        let (wal, done) = checkpoint(&mut conn).await?;
        if wal * PAGE_BYTES < self.wal_restart_bytes {
            return Ok(done);
        }
        let _writer = self.writer.lock().await;
        let (_, tail) = checkpoint(&mut conn).await?;
        Ok(done.max(tail))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> RequestRecord {
        crate::testdb::rec(id, RequestState::Done)
    }

    #[test]
    fn every_size_class_holds_its_rows_and_the_largest_holds_a_statement() {
        for rows in 1..=ROWS_PER_STATEMENT {
            let class = SIZE_CLASSES[size_class(rows)];
            assert!(
                class >= rows && class <= rows + rows.div_ceil(2),
                "{rows} rows -> {class}"
            );
        }
        assert_eq!(SIZE_CLASSES[size_class(ROWS_PER_STATEMENT)], ROWS_PER_STATEMENT);
        assert_eq!(batch_sql(size_class(3)).matches('?').count(), 3 * ROW_WIDTH);
        for (list, w) in [
            (REQUEST_COLUMNS, REQUEST_WIDTH),
            (ATTEMPT_COLUMNS, ATTEMPT_WIDTH),
            (PAYLOAD_COLUMNS, PAYLOAD_WIDTH),
        ] {
            assert_eq!(columns(list).count(), w);
        }
    }

    /// The writer connection's sync level: 2 is `FULL`, 1 `NORMAL`.
    async fn sync_level(db: &SqliteBackend) -> i64 {
        let mut w = db.writer.lock().await;
        sqlx::query_scalar("PRAGMA synchronous")
            .persistent(false)
            .fetch_one(&mut w.0)
            .await
            .unwrap()
    }

    // spec: I3
    #[tokio::test]
    async fn unsynced_batches_commit_on_the_writer_and_leave_it_syncing() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteBackend::open(&dir.path().join("ledger.db")).await.unwrap();
        assert_eq!(sync_level(&db).await, 2);
        let mut att = AttemptRecord::started("a", 1, "ch", UnixMs(5));
        att.error_class = ErrorClass::Success;
        assert!(db.write_batch_unsynced(&[rec("a")], &[att.clone()], &[]).await.unwrap());
        // Committed: the readers (other connections) see it, and the next synced commit
        // syncs again.
        assert_eq!(db.get_request("a").await.unwrap().unwrap().state, RequestState::Done);
        assert_eq!(db.attempts("a").await.unwrap(), vec![att]);
        assert_eq!(sync_level(&db).await, 2);
        // A checkpoint running does not hold a quiet commit up.
        let held = db.maintenance.lock().await;
        assert!(db.write_batch_unsynced(&[rec("b")], &[], &[]).await.unwrap());
        drop(held);
        // More rows than one statement holds: not unsynced.
        let many: Vec<RequestRecord> = (0..=ROWS_PER_STATEMENT).map(|n| rec(&format!("m{n}"))).collect();
        assert!(!db.write_batch_unsynced(&many, &[], &[]).await.unwrap());
        assert!(db.get_request("m0").await.unwrap().is_none());
        db.write_batch(&many, &[], &[]).await.unwrap();
        assert!(db.write_batch_unsynced(&[rec("c")], &[], &[]).await.unwrap());
        db.sync().await.unwrap();
        db.maintain().await.unwrap();
        for id in ["b", "c", "m0"] {
            assert!(db.get_request(id).await.unwrap().is_some(), "{id}");
        }
        assert_eq!(sync_level(&db).await, 2);
    }

    async fn set_max_pages(db: &SqliteBackend, pages: i64) {
        let mut w = db.writer.lock().await;
        sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA max_page_count = {pages}")))
            .execute(&mut w.0)
            .await
            .unwrap();
    }

    // spec: I3
    #[tokio::test]
    async fn a_failed_unsynced_batch_leaves_the_writer_syncing() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteBackend::open(&dir.path().join("ledger.db")).await.unwrap();
        db.write_batch(&[rec("a")], &[], &[]).await.unwrap();
        // A full disk, as SQLite sees one: no page past those the file has.
        let pages: i64 = {
            let mut w = db.writer.lock().await;
            sqlx::query_scalar("PRAGMA page_count")
                .fetch_one(&mut w.0)
                .await
                .unwrap()
        };
        set_max_pages(&db, pages).await;
        let many: Vec<RequestRecord> = (0..ROWS_PER_STATEMENT).map(|n| rec(&format!("m{n}"))).collect();
        let e = db.write_batch_unsynced(&many, &[], &[]).await.unwrap_err();
        assert!(e.to_string().contains("full"), "{e}");
        assert!(!db.writer.lock().await.1, "the writer is not left in doubt");
        assert_eq!(sync_level(&db).await, 2);
        set_max_pages(&db, 1_073_741_823).await;
        db.write_batch(&many, &[], &[]).await.unwrap();
        assert!(db.get_request("m0").await.unwrap().is_some());
        // A restore that did not go through: the writer is in doubt, refuses quiet
        // commits, and the next synced batch puts the level back before it commits.
        {
            let mut w = db.writer.lock().await;
            sqlx::raw_sql("PRAGMA synchronous = NORMAL")
                .execute(&mut w.0)
                .await
                .unwrap();
            w.1 = true;
        }
        assert!(!db.write_batch_unsynced(&[rec("q")], &[], &[]).await.unwrap());
        db.write_batch(&[rec("d")], &[], &[]).await.unwrap();
        assert!(!db.writer.lock().await.1);
        assert_eq!(sync_level(&db).await, 2);
        // The writers outside the batches settle it too: the level back, and what a
        // failed batch left open rolled back.
        {
            let mut w = db.writer.lock().await;
            sqlx::raw_sql("PRAGMA synchronous = NORMAL")
                .execute(&mut w.0)
                .await
                .unwrap();
            sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut w.0).await.unwrap();
            insert_chunk(&mut w.0, &[BatchRow::Request(&rec("t"))]).await.unwrap();
            w.1 = true;
        }
        assert!(!db.writable().await.unwrap().1);
        assert_eq!(sync_level(&db).await, 2);
        assert!(db.get_request("t").await.unwrap().is_none());
    }

    // spec: I3
    #[tokio::test]
    async fn a_quiet_commit_dropped_halfway_leaves_the_writer_to_be_settled() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteBackend::open(&dir.path().join("ledger.db")).await.unwrap();
        // One poll: the lowering and the insert are sent, their answers not yet in.
        let rows = [rec("a")];
        let quiet = db.write_batch_unsynced(&rows, &[], &[]);
        if quiet.now_or_never().is_none() {
            assert!(
                db.writer.lock().await.1,
                "a dropped quiet commit leaves the writer in doubt"
            );
        }
        db.write_batch(&[rec("b")], &[], &[]).await.unwrap();
        assert!(!db.writer.lock().await.1);
        assert_eq!(sync_level(&db).await, 2);
    }

    #[tokio::test]
    async fn sqlite_is_built_without_global_locks_on_its_allocations() {
        // `.cargo/config.toml`'s LIBSQLITE3_FLAGS: with memory statistics or a soft heap
        // limit, every SQLite allocation and page-cache lookup takes a process-wide mutex.
        // A LIBSQLITE3_FLAGS set in the environment replaces the file's; this says so.
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteBackend::open(&dir.path().join("ledger.db")).await.unwrap();
        let options: Vec<String> = sqlx::query_scalar("PRAGMA compile_options")
            .fetch_all(&db.readers)
            .await
            .unwrap();
        assert!(options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"), "{options:?}");
        assert!(!options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"), "{options:?}");
    }

    #[tokio::test]
    async fn a_batch_of_several_statements_is_written_whole_or_not_at_all() {
        // spec: I3
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteBackend::open(&dir.path().join("ledger.db")).await.unwrap();
        // A row in the batch's last statement fails: the rows of its first statements,
        // already executed, must not stay behind.
        {
            let mut w = db.writer.lock().await;
            sqlx::raw_sql(
                "CREATE TEMP TRIGGER refuse_boom BEFORE INSERT ON main.requests \
                 WHEN NEW.id = 'boom' BEGIN SELECT RAISE(ABORT, 'refused'); END",
            )
            .execute(&mut w.0)
            .await
            .unwrap();
        }
        let mut reqs: Vec<_> = (0..300).map(|i| rec(&format!("many-{i:03}"))).collect();
        reqs.push(rec("boom"));
        let err = db.write_batch(&reqs, &[], &[]).await.unwrap_err();
        assert!(err.to_string().contains("refused"), "{err}");
        assert!(db.get_request("many-000").await.unwrap().is_none());
        assert!(db.get_request("many-299").await.unwrap().is_none());
        // The connection is out of the transaction: the next batch commits on its own.
        reqs.pop();
        db.write_batch(&reqs, &[], &[]).await.unwrap();
        assert!(db.get_request("many-000").await.unwrap().is_some());
        assert!(db.get_request("many-299").await.unwrap().is_some());
    }
}
