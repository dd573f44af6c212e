//! The `spillway` binary: `serve` the gateway, `check` a config, run the simulator (`sim`).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use spillway_cli::launch::{self, Launch};
use spillway_cli::signals::Signals;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// mimalloc rather than glibc's malloc: a request allocates and frees many small objects,
/// some on another thread than made them (records handed to the ledger's), and glibc
/// spent a tenth of the gateway's CPU on that at 2,000 req/s (see the commit).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "spillway",
    version,
    about = "A local AI API gateway and ledger for OpenAI, Anthropic and Gemini clients"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway. Without --config: the embedded default (policies/demo.yaml):
    /// simulated providers, or real ones for any OPENAI_API_KEY / ANTHROPIC_API_KEY /
    /// GEMINI_API_KEY set, and a demo key made at each start.
    Serve(ServeArgs),
    /// Print the admin token the console needs (created on first use, mode 0600).
    AdminToken,
    /// Validate a config file without serving.
    Check {
        #[arg(long)]
        config: PathBuf,
    },
    /// Look after the ledger of a gateway that is not running.
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
    },
    /// Make, list and revoke gateway keys on a running gateway (through its admin API).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
        /// The gateway's address.
        #[arg(long, global = true, default_value = "http://127.0.0.1:8787")]
        gateway: String,
    },
    /// Run the simulated providers.
    Sim {
        /// Scenario file (YAML): behaviour per channel.
        #[arg(long)]
        scenario: Option<PathBuf>,
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Make a key (B5): its secret is printed once; the gateway keeps only its hash.
    Create {
        #[arg(long)]
        name: String,
        /// An owner listed in the gateway's config; the key draws on its balance.
        #[arg(long)]
        owner: String,
        #[arg(long)]
        rpm: Option<u32>,
        #[arg(long)]
        max_concurrency: Option<u32>,
        #[arg(long)]
        spend_limit_usd: Option<f64>,
        /// Who makes it, for the audit log. Default: $USER.
        #[arg(long)]
        actor: Option<String>,
        /// Why, for the audit log.
        #[arg(long)]
        reason: String,
    },
    /// List the keys with their spend and limits.
    List,
    /// Revoke a key made with `keys create` or in the console.
    Revoke {
        name: String,
        #[arg(long)]
        actor: Option<String>,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum LedgerCommand {
    /// Remove expired response copies (I6) and, with --older-than-days, finished requests
    /// older than that (unknown and in-flight ones are always kept), then give the space
    /// back to the file system. A running gateway holds its ledger: prune it from the
    /// console (Ledger size → Prune) or POST /admin/v1/ledger/prune instead.
    Prune {
        /// Gateway config whose ledger to prune. Default: the embedded default's.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Ledger file; overrides the config.
        #[arg(long)]
        ledger: Option<PathBuf>,
        /// Also remove finished requests received more than this many days ago.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        older_than_days: Option<u32>,
    },
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

async fn prune(config: Option<PathBuf>, ledger: Option<PathBuf>, older_than_days: Option<u32>) -> Result<()> {
    let c = launch::load(config.as_deref())?;
    let on_postgres = ledger.as_deref().and_then(|p| p.to_str()).map_or(
        matches!(c.ledger, Some(spillway_policy::LedgerLocation::Postgres(_))),
        |p| p.starts_with("postgres://") || p.starts_with("postgresql://"),
    );
    if on_postgres {
        anyhow::bail!(
            "this ledger is a fleet's PostgreSQL database, not a file: prune it from any running instance (the console's Overview → Ledger → Prune, or POST /admin/v1/ledger/prune)"
        );
    }
    let path = launch::ledger_path(ledger.as_deref(), &c)?;
    if !path.exists() {
        anyhow::bail!("no ledger at {}: nothing to prune", path.display());
    }
    let backend = spillway_ledger::SqliteBackend::open(&path).await.map_err(|e| match e {
        spillway_ledger::Error::Locked { .. } => anyhow::anyhow!(
            "{e}\nA running gateway can prune its own ledger: use the console (Overview → Ledger → Prune) or POST /admin/v1/ledger/prune."
        ),
        e => e.into(),
    })?;
    use spillway_ledger::LedgerBackend;
    let now = spillway_wire::UnixMs::from_system(std::time::SystemTime::now());
    let before = older_than_days.map(|d| spillway_wire::UnixMs(now.0 - i64::from(d) * 86_400_000));
    let keys_since = spillway_wire::UnixMs(now.0 - c.idempotency.window_ms as i64);
    let r = backend.prune(now, before, keys_since, true).await?;
    // On the record like a prune from the console, with who ran it.
    let actor = std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "cli".into());
    backend
        .record_transition(
            None,
            &r.audit_entry(now, actor, "spillway ledger prune".into(), older_than_days),
        )
        .await?;
    println!(
        "{}: removed {} expired response copies, {} finished requests and {} attempts; {} -> {}",
        path.display(),
        r.payloads,
        r.requests,
        r.attempts,
        mib(r.bytes_before),
        mib(r.bytes_after)
    );
    Ok(())
}

/// `spillway keys ...`: the admin API of the gateway at `gateway`, with this machine's
/// admin token.
async fn keys(command: KeysCommand, gateway: &str) -> Result<()> {
    let base = gateway.trim_end_matches('/');
    // The admin token goes in the request: never in clear text across a network.
    let host = base
        .split("://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_default();
    if !base.starts_with("https://") && !spillway_policy::is_loopback_host(&spillway_policy::host_name(host)) {
        anyhow::bail!(
            "--gateway {base}: the admin token would cross the network in clear text; use https:// or a loopback address"
        );
    }
    let token = spillway_engine::admin_token()?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let actor = |a: Option<String>| {
        a.or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "cli".to_owned())
    };
    let send = |req: reqwest::RequestBuilder| async {
        let resp = req
            .bearer_auth(token.secret())
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {base}; is `spillway serve` running there?"))?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        if !status.is_success() {
            let msg = body.get("error").and_then(|e| e.as_str()).unwrap_or("no message");
            anyhow::bail!("the gateway refused ({status}): {msg}");
        }
        Ok(body)
    };
    match command {
        KeysCommand::Create {
            name,
            owner,
            rpm,
            max_concurrency,
            spend_limit_usd,
            actor: a,
            reason,
        } => {
            let body = serde_json::json!({"name": name, "owner": owner, "rpm": rpm,
                "max_concurrency": max_concurrency, "spend_limit_usd": spend_limit_usd,
                "actor": actor(a), "reason": reason});
            let made = send(client.post(format!("{base}/admin/v1/keys")).json(&body)).await?;
            let secret = made.get("secret").and_then(|s| s.as_str()).unwrap_or_default();
            announce(&format!(
                "key {name} for owner {owner} (shown once, store it now): {secret}"
            ));
        }
        KeysCommand::List => {
            let list = send(client.get(format!("{base}/admin/v1/keys"))).await?;
            println!(
                "{:<24} {:<16} {:<8} {:>12} {:>12}  status",
                "name", "owner", "origin", "spent USD", "limit USD"
            );
            for k in list.as_array().into_iter().flatten() {
                let s = |f: &str| k.get(f).and_then(|v| v.as_str()).unwrap_or("").to_owned();
                let limit = k
                    .get("spend_limit_usd")
                    .and_then(|v| v.as_f64())
                    .map_or("none".to_owned(), |l| format!("{l:.2}"));
                let status = if k.get("revoked_at").is_some_and(|v| !v.is_null()) {
                    "revoked"
                } else {
                    "active"
                };
                println!(
                    "{:<24} {:<16} {:<8} {:>12.4} {:>12}  {status}",
                    s("name"),
                    s("owner"),
                    s("origin"),
                    k.get("spent_usd").and_then(|v| v.as_f64()).unwrap_or(0.0),
                    limit
                );
            }
        }
        KeysCommand::Revoke { name, actor: a, reason } => {
            let body = serde_json::json!({"actor": actor(a), "reason": reason});
            let path = format!("{base}/admin/v1/keys/{}/revoke", name.replace('/', "%2F"));
            send(client.post(path).json(&body)).await?;
            announce(&format!("key {name} revoked: requests with it get 401 from now on"));
        }
    }
    Ok(())
}

/// The one line scripts and tests read; stdout is flushed so a pipe sees it at once.
fn announce(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Gateway config (YAML). Default: the embedded default (policies/demo.yaml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on; overrides the config. Port 0 picks a free port.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Ledger file, or a PostgreSQL URL (postgres://user@host:port/db) for a fleet;
    /// overrides the config. Default: ledger.db in the data directory. A URL with a
    /// password belongs in the environment, not on a command line others can list.
    #[arg(long, env = "SPILLWAY_LEDGER", hide_env_values = true)]
    ledger: Option<PathBuf>,
    /// This instance's name in a fleet (default: host:port); overrides fleet.instance.
    #[arg(long, env = "SPILLWAY_INSTANCE")]
    instance: Option<String>,
    /// The fleet's Redis (redis://host:port/db); overrides the config's `redis`.
    #[arg(long, env = "SPILLWAY_REDIS", hide_env_values = true)]
    redis: Option<String>,
    /// Send demo traffic to the simulated providers, at this many requests per second.
    #[arg(long, num_args = 0..=1, default_missing_value = "4", value_name = "RPS")]
    demo_traffic: Option<f64>,
    /// Serve the console from this built directory instead of the one compiled in
    /// (development).
    #[arg(long)]
    ui_dir: Option<PathBuf>,
    /// Print a console link carrying the admin token on stdout (for `make run`).
    #[arg(long)]
    show_admin_token: bool,
    /// Threads serving requests. Default: one per core, but one fewer with a SQLite
    /// ledger, whose writer thread gets that core (at least one).
    #[arg(long, env = "SPILLWAY_WORKERS", value_parser = launch::parse_workers)]
    workers: Option<u16>,
}

async fn serve(args: ServeArgs) -> Result<()> {
    // Listen for signals before anything starts: a Ctrl-C during start-up is not lost.
    let mut signals = Signals::new().context("cannot listen for signals")?;
    let launched = launch::launch(Launch {
        config: args.config,
        listen: args.listen,
        ledger: args.ledger,
        ui_dir: args.ui_dir,
        demo_traffic: args.demo_traffic,
        instance: args.instance,
        redis: args.redis,
    })
    .await?;
    if let Some(w) = &launched.listen_warning {
        tracing::warn!("{w}");
    }
    let url = &launched.url;
    announce(&format!("spillway listening on {url}"));
    match (launched.has_console, args.show_admin_token) {
        // The token rides in the fragment, which browsers never send to a server.
        (true, true) => announce(&format!("console: {url}/#token={}", launched.token.secret())),
        (true, false) => announce(&format!("console: {url}/ (admin token: `spillway admin-token`)")),
        (false, _) => {
            tracing::warn!("this binary was built without its console: the admin API is up, the web console is not")
        }
    }
    tracing::info!(ledger = %launched.ledger_shown, "ledger open");
    for g in &launched.generated {
        if g.key == "demo" {
            announce(&format!("demo key (shown once): {}", g.secret));
        } else {
            announce(&format!("key {} (shown once): {}", g.key, g.secret));
        }
    }
    if let Some(sim) = &launched.sim {
        announce(&format!(
            "simulated providers: {} (inject faults: PUT {}/_control/channels/<channel>)",
            sim.url(),
            sim.url()
        ));
    }
    for c in &launched.running.state.config.channels {
        tracing::info!(channel = %c.name, format = %c.format,
            upstream = if c.simulated.is_some() { "simulator" } else if c.api_key.is_some() { "provider" } else { "keyless endpoint" },
            "channel ready");
    }

    signals.next().await;
    let drain = launched.running.state.config.server.drain_timeout_ms;
    tracing::info!(
        "shutting down: finishing in-flight requests (at most {} s; a second Ctrl-C stops at once)",
        drain.div_ceil(1000)
    );
    let r = tokio::select! {
        r = launched.shutdown() => r,
        _ = signals.next() => {
            tracing::warn!("second signal: stopping now; what is still running is cut and recorded");
            launched.abort().await
        }
    };
    r?;
    tracing::info!("ledger flushed; bye");
    Ok(())
}

async fn sim(scenario: Option<PathBuf>, listen: SocketAddr) -> Result<()> {
    let mut signals = Signals::new().context("cannot listen for signals")?;
    let scenario = match scenario {
        Some(p) => spillway_sim::load_scenario(&p)?,
        None => spillway_sim::Scenario::default(),
    };
    let handle = spillway_sim::start(listen, scenario).await?;
    announce(&format!("spillway-sim listening on {}", handle.url()));
    signals.next().await;
    handle.shutdown();
    Ok(())
}

/// An error as an operator reads it: the message, then each cause its wrapper does not
/// already quote, and no backtrace. Returning the error from `main` would print its `Debug` form,
/// which repeats a quoted cause under "Caused by" and, with `RUST_BACKTRACE` set in a
/// developer's shell, buries the one line that matters under a symbolised stack (and
/// takes ~100 MiB to symbolise it).
fn report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    let mut wrapper = out.clone();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !wrapper.contains(&cause) {
            out.push_str(": ");
            out.push_str(&cause);
        }
        wrapper = cause;
    }
    out
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    spillway_cli::memory::no_huge_pages();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPILLWAY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    // `serve` sizes its request threads; the other commands (the simulator among them)
    // keep tokio's default, a thread per core.
    let workers = match &cli.command {
        Command::Serve(args) => {
            let sqlite = launch::sqlite_ledger(args.config.as_deref(), args.ledger.as_deref());
            let workers = launch::request_threads(args.workers, sqlite);
            tracing::info!(workers, "request threads");
            workers
        }
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let rt = spillway_cli::memory::runtime(workers)?;
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::AdminToken => {
                let token = spillway_engine::admin_token()?;
                println!("{}", token.secret());
                Ok(())
            }
            Command::Check { config } => {
                let c = launch::load(Some(&config))?;
                if let Some(w) = &c.listen_warning {
                    eprintln!("warning: {w}");
                }
                println!(
                    "{}: ok ({} channels, {} keys, {} owners)",
                    config.display(),
                    c.channels.len(),
                    c.keys.len(),
                    c.owners.len()
                );
                // The budgets' time zone comes from the system's tz database.
                spillway_engine::accounts::Accounts::new(&c, None)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", config.display()))?;
                let workflows = spillway_engine::workflows::Workflows::load(c.workflows.as_deref())
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let all = workflows.all();
                println!(
                    "{}: ok ({} workflow policies: {})",
                    c.workflows
                        .as_ref()
                        .map_or("built-in workflow policies".to_owned(), |d| d.display().to_string()),
                    all.len(),
                    all.iter()
                        .map(|w| format!("{}@{}", w.name, w.version))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                for k in &c.keys {
                    if let Some(w) = &k.workflow
                        && workflows.get(w).is_none()
                    {
                        anyhow::bail!(
                            "{}: key `{}`: workflow `{w}` is not a workflow policy in force",
                            config.display(),
                            k.name
                        );
                    }
                }
                if let Some(p) = &c.pricing {
                    let pricing = spillway_engine::read_pricing(p)?;
                    println!(
                        "{}: ok (pricing catalog {}, {} models)",
                        p.display(),
                        pricing.version,
                        pricing.models.len()
                    );
                }
                Ok(())
            }
            Command::Sim { scenario, listen } => sim(scenario, listen).await,
            Command::Keys { command, gateway } => keys(command, &gateway).await,
            Command::Ledger {
                command:
                    LedgerCommand::Prune {
                        config,
                        ledger,
                        older_than_days,
                    },
            } => prune(config, ledger, older_than_days).await,
        }
    });
    // Everything that mattered is flushed; whatever task is left is not waited for.
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}
