//! The `spillway` binary: `serve` the gateway, `check` a config, run the simulator (`sim`).

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use spillway_policy::{Config, LedgerLocation};
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;

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
    /// Run the gateway. Without --config: simulated providers (or real ones for any
    /// OPENAI_API_KEY / ANTHROPIC_API_KEY / GEMINI_API_KEY set) and a one-time demo key.
    Serve(ServeArgs),
    /// Print the admin token the console needs (created on first use, mode 0600).
    AdminToken,
    /// Validate a config file without serving.
    Check {
        #[arg(long)]
        config: PathBuf,
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

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn load(path: &PathBuf) -> Result<Config> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
    match Config::parse(path, &text, &env) {
        Ok(c) => Ok(c),
        Err(e) => bail!("invalid config:\n{e}"),
    }
}

/// The one line scripts and tests read; stdout is flushed so a pipe sees it at once.
fn announce(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Gateway config (YAML).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on; overrides the config. Port 0 picks a free port.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Ledger file; overrides the config. Default: ledger.db in the data directory.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Send demo traffic to the simulated providers, at this many requests per second.
    #[arg(long, num_args = 0..=1, default_missing_value = "4", value_name = "RPS")]
    demo_traffic: Option<f64>,
    /// The built console to serve at `/` (default: $SPILLWAY_UI_DIR, else ui/dist beside
    /// the source tree the binary was built in).
    #[arg(long)]
    ui_dir: Option<PathBuf>,
    /// Print a console link carrying the admin token on stdout (for `make run`).
    #[arg(long)]
    show_admin_token: bool,
}

async fn serve(args: ServeArgs) -> Result<()> {
    let ServeArgs {
        config,
        listen,
        ledger,
        demo_traffic,
        ui_dir: ui_flag,
        show_admin_token,
    } = args;
    let (cfg, demo) = match &config {
        Some(path) => (load(path)?, None),
        None => {
            let e = spillway_engine::embedded::build(&env).await?;
            (e.config.clone(), Some(e))
        }
    };
    if let Some(w) = &cfg.listen_warning {
        tracing::warn!("{w}");
    }
    if let Some(l) = listen
        && !l.ip().is_loopback()
    {
        tracing::warn!("--listen {l} is not a loopback address; the gateway is reachable from other machines");
    }
    let ledger_path = match (ledger, &cfg.ledger) {
        (Some(p), _) => p,
        (None, Some(LedgerLocation::Sqlite(p))) => p.clone(),
        (None, None) => spillway_engine::data_dir()?.join("ledger.db"),
    };
    let token = spillway_engine::admin_token()?;
    let ui = spillway_engine::console_dir(ui_flag);
    let opts = spillway_engine::Options {
        ledger_path: ledger_path.clone(),
        listen,
        admin_token: Some(token.clone()),
        ui_dir: ui.clone(),
    };
    let running = spillway_engine::start(cfg, opts).await?;
    let url = format!("http://{}", running.addr);
    announce(&format!("spillway listening on {url}"));
    match (&ui, show_admin_token) {
        // The token rides in the fragment, which browsers never send to a server.
        (Some(_), true) => announce(&format!("console: {url}/#token={}", token.secret())),
        (Some(_), false) => announce(&format!("console: {url}/ (admin token: `spillway admin-token`)")),
        (None, _) => tracing::warn!("console not built (ui/dist missing): the admin API is up, the web console is not"),
    }
    tracing::info!(ledger = %ledger_path.display(), "ledger open");

    let mut traffic = None;
    if let Some(e) = &demo {
        announce(&format!("demo key (shown once): {}", e.demo_key));
        if let Some(sim) = &e.sim {
            announce(&format!(
                "simulated providers: {} (inject faults: PUT {}/_control/channels/<channel>)",
                sim.url(),
                sim.url()
            ));
        }
        for c in &e.config.channels {
            tracing::info!(channel = %c.name, format = %c.format, upstream = if c.api_key.is_some() { "real provider" } else { "simulator" }, "channel ready");
        }
        if let Some(rps) = demo_traffic {
            traffic = Some(spillway_engine::embedded::demo_traffic(url.clone(), e, rps));
            tracing::info!(rps, "demo traffic started");
        }
    } else if demo_traffic.is_some() {
        tracing::warn!("--demo-traffic needs the embedded default (no --config); ignored");
    }

    shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight requests");
    if let Some(t) = traffic {
        t.abort();
    }
    running.shutdown().await?;
    tracing::info!("ledger flushed; bye");
    Ok(())
}

async fn sim(scenario: Option<PathBuf>, listen: SocketAddr) -> Result<()> {
    let scenario = match scenario {
        Some(p) => spillway_sim::Scenario::load(&p)?,
        None => spillway_sim::Scenario::default(),
    };
    let handle = spillway_sim::start(listen, scenario).await?;
    announce(&format!("spillway-sim listening on {}", handle.url()));
    shutdown_signal().await;
    handle.shutdown();
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPILLWAY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::AdminToken => {
                let token = spillway_engine::admin_token()?;
                println!("{}", token.secret());
                Ok(())
            }
            Command::Check { config } => {
                let c = load(&config)?;
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
                Ok(())
            }
            Command::Sim { scenario, listen } => sim(scenario, listen).await,
        }
    })
}
