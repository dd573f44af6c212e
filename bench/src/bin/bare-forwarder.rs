//! The yardstick `make bench` holds the gateway to: the least a forwarding proxy can do.
//! Every request goes to the upstream named on the command line, path and headers as they
//! came, and the answer streams back as it comes: no parsing, no ledger, no limits. What
//! the gateway spends beyond this is the price of what it does.
//!
//! With `--ledger PATH` it is the least a forwarder that keeps the gateway's promise I3
//! can do: before its upstream call, each request waits for a row of its own to be
//! committed and synced to a SQLite file, through sqlx, as the gateway's ledger does (WAL,
//! `synchronous=FULL`, one statement per commit in autocommit, the requests that wait
//! together sharing a commit). It parses nothing else and keeps nothing else, so what it
//! spends beyond the bare forwarder is the floor I3 and sqlx put under the gateway on this
//! machine, measured rather than estimated.
//!
//! `bare-forwarder --upstream http://127.0.0.1:PORT [--ledger PATH]` prints
//! `bare-forwarder listening on http://ADDR` once it accepts connections.

use std::str::FromStr;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
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

/// A request's wait for its synced commit: the answer comes back on the oneshot.
type Durable = mpsc::UnboundedSender<oneshot::Sender<Result<(), String>>>;

/// Most rows in one commit's statement (the gateway's largest statement is as wide).
const MOST_ROWS: usize = 128;

async fn forward(
    client: Upstream,
    base: Uri,
    durable: Option<Durable>,
    mut req: Request<Incoming>,
) -> Result<Response<Incoming>, String> {
    if let Some(d) = durable {
        let (tx, rx) = oneshot::channel();
        d.send(tx).map_err(|_| "the ledger has stopped".to_string())?;
        rx.await.map_err(|_| "the ledger has stopped".to_string())??;
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
    client.request(req).await.map_err(|e| e.to_string())
}

/// Commits whatever requests are waiting, one statement and one sync for all of them,
/// then answers each.
async fn commit_loop(
    mut conn: SqliteConnection,
    mut waiting: mpsc::UnboundedReceiver<oneshot::Sender<Result<(), String>>>,
) {
    let statements: Vec<String> = (1..=MOST_ROWS)
        .map(|n| format!("INSERT INTO requests (at) VALUES {}", vec!["(?)"; n].join(",")))
        .collect();
    let mut batch = Vec::with_capacity(MOST_ROWS);
    while waiting.recv_many(&mut batch, MOST_ROWS).await > 0 {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let mut q = sqlx::query(AssertSqlSafe(statements[batch.len() - 1].as_str()));
        for _ in 0..batch.len() {
            q = q.bind(at);
        }
        let done = q.execute(&mut conn).await.map(drop).map_err(|e| e.to_string());
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
            .statement_cache_capacity(MOST_ROWS + 8),
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
