//! `make bench`: what the gateway adds on top of calling the simulator directly.
//!
//! Starts the real `spillway sim` and `spillway serve` (release build, SQLite ledger on)
//! as processes on loopback, then measures with an open-loop load generator: requests
//! leave on a fixed schedule whether or not earlier ones have answered, so a slow server
//! cannot slow the offered load down. Latency is taken from the moment each request is
//! handed to the client (tokio's 1 ms timer would otherwise add up to 1 ms of send jitter
//! to every sample). Reported: p50/p90/p99 at fixed rates, direct vs through the gateway, for
//! non-streaming requests and for streams (time to first token); and the maximum
//! throughput of each with a fixed number of concurrent clients.

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The spillway binary to measure.
    #[arg(long, default_value = "target/release/spillway")]
    spillway: PathBuf,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Seconds measured per rate (after one second of warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Fixed request rates, requests per second.
    #[arg(long, value_delimiter = ',', default_value = "500,1000,2000")]
    rates: Vec<u64>,
    /// Concurrent clients for the maximum-throughput run.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Rows in the ledger-search benchmark (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    ledger_rows: u64,
    /// Only run the ledger-search benchmark.
    #[arg(long)]
    ledger_only: bool,
    /// Share of upstream attempts that fail with 503 in the failover scenario (0 skips it).
    #[arg(long, default_value_t = 0.10)]
    failover_share: f64,
    /// Request rate of the failover scenario.
    #[arg(long, default_value_t = 1000)]
    failover_rate: u64,
}

#[derive(Serialize)]
struct SearchTiming {
    query: &'static str,
    results: usize,
    ms: f64,
}

/// The console's ledger searches against a ledger of `rows` requests: each must stay
/// interactive however large the ledger grows.
async fn ledger_search(rows: u64) -> Result<Vec<SearchTiming>> {
    use spillway_ledger::{LedgerBackend, RequestRecord, RequestState, Search, SqliteBackend};
    use spillway_wire::{Format, UnixMs};
    let dir = work_dir()?;
    let backend = SqliteBackend::open(&dir.path().join("ledger.db")).await?;
    let t0: u64 = 1_790_000_000_000;
    let id = |n: u64| {
        let ms = t0 + n * 10; // 100 requests/s of history
        format!("{:08x}-{:04x}-7000-8000-{:012x}", ms >> 16, ms & 0xffff, n)
    };
    let routes = [
        "openai/gpt-4o-mini",
        "anthropic/claude-haiku-4-5",
        "gemini/gemini-2.5-flash",
    ];
    eprintln!("filling a ledger with {rows} requests ...");
    let started = Instant::now();
    let mut batch = Vec::with_capacity(2000);
    for n in 0..rows {
        let rid = id(n);
        let mut r = RequestRecord::received(
            rid.clone(),
            rid.replace('-', ""),
            Format::OpenAi,
            "/v1/chat/completions",
            UnixMs((t0 + n * 10) as i64),
        );
        r.route = Some(routes[(n % 3) as usize].into());
        r.state = if n % 50 == 0 {
            RequestState::Failed
        } else {
            RequestState::Done
        };
        if n % 100 == 7 {
            r.client_request_id = Some(format!("client-{n}"));
        }
        batch.push(r);
        if batch.len() == 2000 {
            backend.write_batch(&batch, &[]).await?;
            batch.clear();
        }
    }
    backend.write_batch(&batch, &[]).await?;
    eprintln!("filled in {:.1} s", started.elapsed().as_secs_f64());
    let last = rows.saturating_sub(1);
    let mut out = Vec::new();
    let time = |query: &'static str, s: Search| {
        let backend = &backend;
        async move {
            let t = Instant::now();
            let page = backend.search(&s).await?;
            Ok::<_, anyhow::Error>(SearchTiming {
                query,
                results: page.items.len(),
                ms: t.elapsed().as_secs_f64() * 1000.0,
            })
        }
    };
    let queries: Vec<(&'static str, Search)> = vec![
        ("newest page (50)", Search::default()),
        (
            "page deep in history (cursor)",
            Search {
                before: Some(id(rows / 2)),
                ..Search::default()
            },
        ),
        (
            "by request id",
            Search {
                q: Some(id(last / 3)),
                ..Search::default()
            },
        ),
        (
            "by trace id",
            Search {
                q: Some(id(last / 4).replace('-', "")),
                ..Search::default()
            },
        ),
        (
            "by client request id",
            Search {
                q: Some(format!("client-{}", (last / 200) * 100 + 7)),
                ..Search::default()
            },
        ),
        (
            "route + state filter",
            Search {
                route: Some(routes[1].into()),
                state: Some(RequestState::Failed),
                ..Search::default()
            },
        ),
        (
            "last 15 minutes",
            Search {
                from_ms: Some(UnixMs((t0 + last * 10) as i64 - 900_000)),
                ..Search::default()
            },
        ),
    ];
    for (query, s) in queries {
        out.push(time(query, s).await?);
    }
    Ok(out)
}

/// What one durable commit of a request row costs (the `calling_api` write every request
/// waits for), with the gateway's durability and with the weaker one it does not use.
#[derive(Serialize)]
struct CommitCost {
    durability: &'static str,
    p50_us: u64,
    p99_us: u64,
}

async fn commit_cost(commits: u64) -> Result<Vec<CommitCost>> {
    use spillway_ledger::{Durability, LedgerBackend, RequestRecord, RequestState, SqliteBackend};
    use spillway_wire::{Format, UnixMs};
    let mut out = Vec::new();
    for (name, d) in [
        ("survives a power loss (WAL synced; the gateway's)", Durability::Full),
        ("survives a process crash only (no sync)", Durability::ProcessCrashOnly),
    ] {
        let dir = work_dir()?;
        let backend = SqliteBackend::open_with(&dir.path().join("ledger.db"), d).await?;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        for n in 0..commits {
            let id = format!("{n:036}");
            let mut r = RequestRecord::received(id.clone(), id, Format::OpenAi, "/v1/chat/completions", UnixMs(1));
            r.state = RequestState::CallingApi;
            let t = Instant::now();
            backend.write_batch(&[r], &[]).await?;
            // What the writer does before it acknowledges a durable write.
            backend.sync().await?;
            hist.record(t.elapsed().as_micros().max(1) as u64)?;
        }
        out.push(CommitCost {
            durability: name,
            p50_us: hist.value_at_quantile(0.5),
            p99_us: hist.value_at_quantile(0.99),
        });
    }
    Ok(out)
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A scratch directory on the project's disk (under `target/`), not in /tmp, which is often
/// a tmpfs where a sync costs nothing and the ledger's durability would look free.
fn work_dir() -> Result<tempfile::TempDir> {
    std::fs::create_dir_all("target")?;
    Ok(tempfile::tempdir_in("target")?)
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(bin: &PathBuf, args: &[&str], env: &[(&str, &str)], prefix: &str) -> Result<(Proc, String)> {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .env("SPILLWAY_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot start {}", bin.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let proc = Proc(child);
    for line in lines.by_ref() {
        let line = line?;
        if let Some(url) = line.strip_prefix(prefix) {
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return Ok((proc, url.trim().to_owned()));
        }
    }
    bail!("{} exited before printing {prefix:?}", bin.display())
}

/// A simulator control call: PUT `body` when given, else GET.
async fn sim_control(client: &HttpClient, url: &str, body: Option<&serde_json::Value>) -> Result<serde_json::Value> {
    let req = match body {
        Some(b) => hyper::Request::put(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(b.to_string())))?,
        None => hyper::Request::get(url).body(Full::new(Bytes::new()))?,
    };
    let resp = client.request(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("simulator control {url}: HTTP {status}");
    }
    Ok(serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Whole,
    /// Measure time to the first token of a stream.
    FirstToken,
}

fn body(stream: bool) -> Bytes {
    body_for("gpt-4o-mini", stream)
}

fn body_for(model: &str, stream: bool) -> Bytes {
    let v = serde_json::json!({"model": model, "stream": stream,
        "messages": [{"role": "user", "content": "Summarise this support ticket in two sentences, please."}]});
    Bytes::from(v.to_string())
}

/// One request; returns its latency from the moment it is handed to the client and the
/// upstream attempts the gateway reports (`x-spillway-attempts`, 1 when absent), or, on
/// failure, how long it took to fail.
async fn one(
    client: &HttpClient,
    url: &str,
    key: &str,
    payload: Bytes,
    mode: Mode,
) -> Result<(Duration, u64), Duration> {
    let from = Instant::now();
    let Ok(req) = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(payload))
    else {
        return Err(from.elapsed());
    };
    let from = Instant::now();
    let resp = client.request(req).await.map_err(|_| from.elapsed())?;
    if !resp.status().is_success() {
        let _ = resp.into_body().collect().await;
        return Err(from.elapsed());
    }
    let attempts = resp
        .headers()
        .get("x-spillway-attempts")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut body = resp.into_body();
    let mut at = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| from.elapsed())?;
        if mode == Mode::FirstToken
            && at.is_none()
            && let Some(d) = frame.data_ref()
            // The simulator's first token is "Queues"; the role chunk before it has empty content.
            && d.windows(12).any(|w| w == b"\"content\":\"Q")
        {
            at = Some(from.elapsed());
        }
    }
    Ok((at.unwrap_or_else(|| from.elapsed()), attempts))
}

/// Latency of every request sent after the warm-up, failures included: a failure that
/// came fast must not make the percentiles look better, nor a slow one vanish from them.
#[derive(Serialize, Clone)]
struct Percentiles {
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    max_us: u64,
    ok: u64,
    failed: u64,
    achieved_rps: f64,
    /// Upstream attempts per successful logical request (retry amplification, F5).
    attempts_per_request: f64,
}

async fn fixed_rate(client: &HttpClient, url: &str, key: &str, stream: bool, rate: u64, secs: u64) -> Percentiles {
    fixed_rate_with(client, url, key, body(stream), stream, rate, secs).await
}

async fn fixed_rate_with(
    client: &HttpClient,
    url: &str,
    key: &str,
    payload: Bytes,
    stream: bool,
    rate: u64,
    secs: u64,
) -> Percentiles {
    let mode = if stream { Mode::FirstToken } else { Mode::Whole };
    let hist = Arc::new(std::sync::Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
    ));
    let failed = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let warmup = rate; // one second
    let total = rate * (secs + 1);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let scheduled = start + Duration::from_nanos(i * 1_000_000_000 / rate);
        tokio::time::sleep_until(scheduled.into()).await;
        let (client, url, key, payload, hist, failed, attempts) = (
            client.clone(),
            url.to_owned(),
            key.to_owned(),
            payload.clone(),
            hist.clone(),
            failed.clone(),
            attempts.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let result = one(&client, &url, &key, payload, mode).await;
            // The warm-up second counts for nothing, failures included.
            if i < warmup {
                return;
            }
            let d = match result {
                Ok((d, n)) => {
                    attempts.fetch_add(n, Ordering::Relaxed);
                    d
                }
                Err(d) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    d
                }
            };
            let _ = hist.lock().map(|mut h| h.record(d.as_micros().max(1) as u64));
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let h = hist
        .lock()
        .map(|h| h.clone())
        .unwrap_or_else(|_| Histogram::new(3).expect("hist"));
    Percentiles {
        p50_us: h.value_at_quantile(0.50),
        p90_us: h.value_at_quantile(0.90),
        p99_us: h.value_at_quantile(0.99),
        max_us: h.max(),
        ok: h.len() - failed.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        achieved_rps: (h.len() - failed.load(Ordering::Relaxed)) as f64 / secs as f64,
        attempts_per_request: attempts.load(Ordering::Relaxed) as f64
            / (h.len() - failed.load(Ordering::Relaxed)).max(1) as f64,
    }
}

async fn max_throughput(client: &HttpClient, url: &str, key: &str, concurrency: usize, secs: u64) -> f64 {
    let payload = body(false);
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, key, payload, done) = (
            client.clone(),
            url.to_owned(),
            key.to_owned(),
            payload.clone(),
            done.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                if one(&client, &url, &key, payload.clone(), Mode::Whole).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / secs as f64
}

#[derive(Serialize)]
struct Row {
    kind: &'static str,
    rate_rps: u64,
    direct: Percentiles,
    gateway: Percentiles,
    added_p50_us: i64,
    added_p90_us: i64,
    added_p99_us: i64,
}

#[derive(Serialize)]
struct Report {
    when_unix: u64,
    machine: String,
    seconds_per_rate: u64,
    rows: Vec<Row>,
    max_throughput_direct_rps: f64,
    max_throughput_gateway_rps: f64,
    concurrency: usize,
    ledger_rows: u64,
    ledger_search: Vec<SearchTiming>,
    failover: Option<FailoverRun>,
    commit_cost: Vec<CommitCost>,
}

/// The failover scenario: two channels serving one model, each failing a share of its
/// calls with 503 (D2), at a fixed rate.
#[derive(Serialize)]
struct FailoverRun {
    rate_rps: u64,
    fault_share: f64,
    /// The same rate on healthy channels, for comparison.
    healthy: Percentiles,
    faulty: Percentiles,
    /// Calls the two faulty channels received ÷ requests sent (warm-up included).
    upstream_calls_per_request: f64,
}

fn us(v: u64) -> String {
    if v >= 10_000 {
        format!("{:.1} ms", v as f64 / 1000.0)
    } else {
        format!("{v} µs")
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.ledger_only {
        for t in ledger_search(args.ledger_rows).await? {
            println!("| {:<32} | {:>6} | {:>9.2} ms |", t.query, t.results, t.ms);
        }
        return Ok(());
    }
    let dir = work_dir()?;
    let (_sim, sim_url) = spawn(
        &args.spillway,
        &["sim", "--listen", "127.0.0.1:0"],
        &[],
        "spillway-sim listening on ",
    )?;
    let key = "sk-bench-0123456789abcdef0123";
    let config = dir.path().join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nledger: sqlite://{}\nserver: {{max_connections: 8192}}\nchannels:\n  - name: bench\n    format: openai\n    base_url: {sim_url}/bench\n    models: [gpt-4o-mini]\n    max_concurrency: 4096\n  - name: fo-a\n    format: openai\n    base_url: {sim_url}/fo-a\n    models: [bench-failover]\n    max_concurrency: 4096\n  - name: fo-b\n    format: openai\n    base_url: {sim_url}/fo-b\n    models: [bench-failover]\n    max_concurrency: 4096\nkeys:\n  - name: bench\n    owner: bench\n    secret_env: BENCH_KEY\nowners:\n  - name: bench\n    balance_usd: 1000000\n",
            dir.path().join("ledger.db").display()
        ),
    )?;
    let (_gw, gw_url) = spawn(
        &args.spillway,
        &["serve", "--config", config.to_str().context("path")?],
        &[("BENCH_KEY", key)],
        "spillway listening on ",
    )?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let direct = format!("{sim_url}/bench/v1/chat/completions");
    let via = format!("{gw_url}/v1/chat/completions");

    let mut rows = Vec::new();
    for (kind, stream) in [("non-streaming", false), ("streaming TTFT", true)] {
        for &rate in &args.rates {
            eprintln!("measuring {kind} at {rate} req/s ...");
            let d = fixed_rate(&client, &direct, key, stream, rate, args.seconds).await;
            let g = fixed_rate(&client, &via, key, stream, rate, args.seconds).await;
            rows.push(Row {
                kind,
                rate_rps: rate,
                added_p50_us: g.p50_us as i64 - d.p50_us as i64,
                added_p90_us: g.p90_us as i64 - d.p90_us as i64,
                added_p99_us: g.p99_us as i64 - d.p99_us as i64,
                direct: d,
                gateway: g,
            });
        }
    }
    eprintln!(
        "measuring maximum throughput with {} concurrent clients ...",
        args.concurrency
    );
    let max_d = max_throughput(&client, &direct, key, args.concurrency, args.seconds).await;
    let max_g = max_throughput(&client, &via, key, args.concurrency, args.seconds).await;

    let failover = if args.failover_share > 0.0 {
        let rate = args.failover_rate;
        eprintln!(
            "measuring failover at {rate} req/s with {:.0} % of attempts failing with 503 ...",
            args.failover_share * 100.0
        );
        let payload = body_for("bench-failover", false);
        let healthy = fixed_rate_with(&client, &via, key, payload.clone(), false, rate, args.seconds).await;
        let fault = serde_json::json!({"random_faults": [
            {"fault": {"kind": "status", "status": 503}, "probability": args.failover_share}]});
        let calls = async |client: &HttpClient| -> Result<u64> {
            let mut n = 0;
            for ch in ["fo-a", "fo-b"] {
                let v = sim_control(client, &format!("{sim_url}/_control/channels/{ch}"), None).await?;
                n += v["stats"]["calls"].as_u64().unwrap_or(0);
            }
            Ok(n)
        };
        for ch in ["fo-a", "fo-b"] {
            sim_control(&client, &format!("{sim_url}/_control/channels/{ch}"), Some(&fault)).await?;
        }
        let before = calls(&client).await?;
        let faulty = fixed_rate_with(&client, &via, key, payload, false, rate, args.seconds).await;
        let calls = calls(&client).await? - before;
        let sent = rate * (args.seconds + 1);
        Some(FailoverRun {
            rate_rps: rate,
            fault_share: args.failover_share,
            upstream_calls_per_request: calls as f64 / sent as f64,
            healthy,
            faulty,
        })
    } else {
        None
    };

    println!("\nSpillway gateway overhead (ledger on; direct = the simulator alone)\n");
    println!(
        "| {:<15} | {:>5} | {:>9} | {:>9} | {:>9} | {:>11} | {:>11} | {:>11} | {:>7} |",
        "kind", "req/s", "direct p50", "p90", "p99", "gateway p50", "p90", "p99", "failed"
    );
    println!("|{}|", ["---"; 9].join("|"));
    for r in &rows {
        println!(
            "| {:<15} | {:>5} | {:>10} | {:>9} | {:>9} | {:>11} | {:>11} | {:>11} | {:>7} |",
            r.kind,
            r.rate_rps,
            us(r.direct.p50_us),
            us(r.direct.p90_us),
            us(r.direct.p99_us),
            us(r.gateway.p50_us),
            us(r.gateway.p90_us),
            us(r.gateway.p99_us),
            r.gateway.failed + r.direct.failed
        );
    }
    println!(
        "\n| {:<15} | {:>5} | {:>12} | {:>12} | {:>12} |",
        "kind", "req/s", "added p50", "added p90", "added p99"
    );
    println!("|{}|", ["---"; 5].join("|"));
    for r in &rows {
        let f = |v: i64| {
            if v < 0 {
                format!("-{}", us(v.unsigned_abs()))
            } else {
                us(v as u64)
            }
        };
        println!(
            "| {:<15} | {:>5} | {:>12} | {:>12} | {:>12} |",
            r.kind,
            r.rate_rps,
            f(r.added_p50_us),
            f(r.added_p90_us),
            f(r.added_p99_us)
        );
    }
    println!(
        "\nmaximum throughput ({} concurrent clients, non-streaming): direct {max_d:.0} req/s, through the gateway {max_g:.0} req/s",
        args.concurrency
    );

    if let Some(f) = &failover {
        println!(
            "\nfailover: {} req/s, {:.0} % of attempts fail with 503 on both channels of the model\n",
            f.rate_rps,
            f.fault_share * 100.0
        );
        println!("| channels | p50 | p90 | p99 | failed | attempts per request |");
        println!("|---|---|---|---|---|---|");
        for (name, p) in [("healthy", &f.healthy), ("10 % 503", &f.faulty)] {
            println!(
                "| {name} | {} | {} | {} | {} | {:.3} |",
                us(p.p50_us),
                us(p.p90_us),
                us(p.p99_us),
                p.failed,
                p.attempts_per_request
            );
        }
        println!(
            "upstream calls per logical request (simulator's count): {:.3}",
            f.upstream_calls_per_request
        );
    }

    eprintln!("measuring what a durable commit costs ...");
    let commits = commit_cost(2000).await?;
    println!("\ndurable commit of one request row (what every request waits for before its upstream call)\n");
    println!("| durability | p50 | p99 |");
    println!("|---|---|---|");
    for c in &commits {
        println!("| {} | {} | {} |", c.durability, us(c.p50_us), us(c.p99_us));
    }

    let searches = if args.ledger_rows > 0 {
        ledger_search(args.ledger_rows).await?
    } else {
        Vec::new()
    };
    if !searches.is_empty() {
        println!("\nledger search with {} requests in the ledger\n", args.ledger_rows);
        println!("| {:<32} | {:>7} | {:>12} |", "query", "results", "time");
        println!("|---|---|---|");
        for t in &searches {
            println!("| {:<32} | {:>7} | {:>9.2} ms |", t.query, t.results, t.ms);
        }
    }

    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let report = Report {
        when_unix: when,
        machine: format!(
            "{} cores",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        ),
        seconds_per_rate: args.seconds,
        rows,
        max_throughput_direct_rps: max_d,
        max_throughput_gateway_rps: max_g,
        concurrency: args.concurrency,
        ledger_rows: args.ledger_rows,
        ledger_search: searches,
        failover,
        commit_cost: commits,
    };
    std::fs::create_dir_all(&args.out)?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(args.out.join(format!("bench-{when}.json")), &json)?;
    std::fs::write(args.out.join("latest.json"), &json)?;
    println!("results: {}", args.out.join("latest.json").display());
    Ok(())
}
