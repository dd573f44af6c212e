//! The yardstick `make bench` holds the gateway to: the least a forwarding proxy can do.
//! Every request goes to the upstream named on the command line, path and headers as they
//! came, and the answer streams back as it comes: no parsing, no limits, and (without
//! `--ledger`) no ledger. What the gateway spends beyond this is the price of what it does.
//!
//! With `--ledger PATH` it is the least a forwarder that keeps the gateway's promise I3
//! can do: before its upstream call, each request waits for a row of its own to be
//! committed and synced to a SQLite file, through sqlx, as the gateway's ledger does it
//! (WAL, `synchronous=FULL`, one statement per commit in autocommit, the requests that
//! wait together sharing a commit, larger groups as several statements in one
//! transaction). It parses nothing else and keeps nothing else, so what it spends beyond
//! the bare forwarder is the floor I3 and sqlx put under the gateway on this machine,
//! measured rather than estimated. SQLite checkpoints the WAL itself every 1,000 pages,
//! inside the commit that crosses the mark, where the gateway checkpoints from a
//! connection of its own once a second: the same work, and one commit in a thousand
//! waits for it.
//!
//! `bare-forwarder --upstream http://127.0.0.1:PORT [--ledger PATH]` prints
//! `bare-forwarder listening on http://ADDR` once it accepts connections.

use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Connection, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

/// The gateway's allocator, so that an allocation costs both the same (the gateway's
/// idle-time `mi_collect` and transparent-huge-page switch are left out: this process
/// keeps nothing between requests but its pool).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Upstream = Client<HttpConnector, Incoming>;
type Answer = Response<Either<Incoming, Full<Bytes>>>;

/// A request's wait for its synced commit: the answer comes back on the oneshot.
type Durable = mpsc::UnboundedSender<oneshot::Sender<Result<(), String>>>;

/// Rows in one statement at most (the gateway's largest statement is as wide).
const ROWS_PER_STATEMENT: usize = 128;
/// Requests in one commit at most (the gateway's batch is as large).
const MOST_WAITING: usize = 2048;

async fn forward(
    client: Upstream,
    base: Uri,
    durable: Option<Durable>,
    mut req: Request<Incoming>,
) -> Result<Answer, String> {
    if let Some(d) = durable {
        let (tx, rx) = oneshot::channel();
        let committed = match d.send(tx) {
            Ok(()) => rx.await.unwrap_or_else(|_| Err("the ledger has stopped".into())),
            Err(_) => Err("the ledger has stopped".into()),
        };
        // As the gateway answers when its ledger refuses the durable write: nothing went
        // upstream.
        if let Err(e) = committed {
            let mut r = Response::new(Either::Right(Full::new(Bytes::from(format!("ledger: {e}\n")))));
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            return Ok(r);
        }
    }
    let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let uri = Uri::builder()
        .scheme(base.scheme_str().unwrap_or("http"))
        .authority(base.authority().map(|a| a.as_str()).unwrap_or_default())
        .path_and_query(path)
        .build()
        .map_err(|e| e.to_string())?;
    *req.uri_mut() = uri;
    req.headers_mut().remove(hyper::header::HOST);
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.map(Either::Left))
}

/// One commit of `n` rows: one statement in autocommit, or several in one transaction.
async fn commit(conn: &mut SqliteConnection, statements: &[String], n: usize) -> Result<(), sqlx::Error> {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let insert = async |conn: &mut SqliteConnection, rows: usize| {
        let mut q = sqlx::query(AssertSqlSafe(statements[rows - 1].as_str()));
        for _ in 0..rows {
            q = q.bind(at);
        }
        q.execute(conn).await.map(drop)
    };
    if n <= ROWS_PER_STATEMENT {
        return insert(conn, n).await;
    }
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
    let mut left = n;
    let mut done = Ok(());
    while left > 0 && done.is_ok() {
        let rows = left.min(ROWS_PER_STATEMENT);
        done = insert(conn, rows).await;
        left -= rows;
    }
    if done.is_ok() {
        done = sqlx::query("COMMIT").execute(&mut *conn).await.map(drop);
    }
    if done.is_err() {
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
    }
    done
}

/// Commits whatever requests are waiting, one sync for all of them, then answers each.
async fn commit_loop(
    mut conn: SqliteConnection,
    mut waiting: mpsc::UnboundedReceiver<oneshot::Sender<Result<(), String>>>,
) {
    let statements: Vec<String> = (1..=ROWS_PER_STATEMENT)
        .map(|n| format!("INSERT INTO requests (at) VALUES {}", vec!["(?)"; n].join(",")))
        .collect();
    let mut batch = Vec::with_capacity(MOST_WAITING);
    while waiting.recv_many(&mut batch, MOST_WAITING).await > 0 {
        let done = commit(&mut conn, &statements, batch.len())
            .await
            .map_err(|e| e.to_string());
        for w in batch.drain(..) {
            let _ = w.send(done.clone());
        }
    }
}

async fn open_ledger(path: &str) -> Result<Durable, sqlx::Error> {
    let mut conn = SqliteConnection::connect_with(
        &SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .statement_cache_capacity(ROWS_PER_STATEMENT + 8),
    )
    .await?;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS requests (id INTEGER PRIMARY KEY, at INTEGER NOT NULL)")
        .execute(&mut conn)
        .await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(commit_loop(conn, rx));
    Ok(tx)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bare-forwarder --upstream http://HOST:PORT [--ledger PATH]";
    let (base, ledger): (Uri, Option<String>) = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["--upstream", u] => (u.parse()?, None),
        ["--upstream", u, "--ledger", l] => (u.parse()?, Some(l.to_owned())),
        _ => return Err(usage.into()),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    // With a ledger, sqlx's SQLite thread is busy whenever requests are, so the request
    // threads leave it a core, as the gateway's do (`--workers`).
    if ledger.is_some() {
        rt.worker_threads(cores.saturating_sub(1).max(1));
    }
    rt.build()?.block_on(serve(base, ledger))
}

async fn serve(base: Uri, ledger: Option<String>) -> Result<(), Box<dyn std::error::Error>> {
    let durable = match ledger {
        Some(path) => Some(open_ledger(&path).await?),
        None => None,
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("bare-forwarder listening on http://{}", listener.local_addr()?);
    let shared = Arc::new((client, base, durable));
    loop {
        let (sock, _) = listener.accept().await?;
        let _ = sock.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let (client, base, durable) = &*shared;
                forward(client.clone(), base.clone(), durable.clone(), req)
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}
