//! One start-up path for the binary and the desktop shell (see the crate docs).

use rand::Rng;
use spillway_engine::admin::AdminToken;
use spillway_engine::{Console, Options, Running};
use spillway_policy::{Config, GeneratedSecret, LedgerLocation, SecretUrl};
use spillway_sim::SimHandle;
use spillway_sim::traffic::Target;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// The embedded default: simulated providers (real ones for any provider key set), a demo
/// key made at each start. The file `make run` loads, compiled in.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../policies/demo.yaml");

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot read config {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("invalid config:\n{0}")]
    Config(#[from] spillway_policy::ConfigErrors),
    #[error(transparent)]
    Engine(#[from] spillway_engine::Error),
    #[error(transparent)]
    Sim(#[from] spillway_sim::Error),
    /// `OTEL_EXPORTER_OTLP_*` is set but unusable (a bad endpoint, gRPC).
    #[error("{0} (check OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL)")]
    Otel(#[from] spillway_engine::otel::OtelError),
    #[error("{0}")]
    Flag(String),
}

/// The console's built files (`ui/dist`), compiled in.
#[derive(rust_embed::Embed)]
#[folder = "$CARGO_MANIFEST_DIR/../../ui/dist"]
#[allow_missing = true]
struct ConsoleFiles;

/// The console this binary carries, if it was built with one.
pub fn embedded_console() -> Console {
    if ConsoleFiles::get("index.html").is_none() {
        return Console::None;
    }
    Console::Embedded(Arc::new(|path: &str| ConsoleFiles::get(path).map(|f| f.data)))
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn new_demo_secret() -> String {
    format!("sk-spillway-demo-{:032x}", rand::rng().random::<u128>())
}

/// Reads and validates the config at `path`, or the embedded default without one.
pub fn load(path: Option<&Path>) -> Result<Config, LaunchError> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| LaunchError::Read {
                path: p.display().to_string(),
                source,
            })?;
            Ok(Config::parse(p, &text, &env, &new_demo_secret)?)
        }
        None => {
            let mut c = Config::parse(
                Path::new("<embedded default: policies/demo.yaml>"),
                EMBEDDED_DEFAULT,
                &env,
                &new_demo_secret,
            )?;
            // Its policy directory sits beside the file in a source tree; an installed
            // binary runs the same policies built in (read-only).
            c.workflows = None;
            Ok(c)
        }
    }
}

/// What to start.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// The config file; the embedded default without one.
    pub config: Option<PathBuf>,
    /// Overrides the config's `listen`.
    pub listen: Option<SocketAddr>,
    /// Overrides the config's ledger.
    pub ledger: Option<PathBuf>,
    /// A built console on disk instead of the compiled-in one (development).
    pub ui_dir: Option<PathBuf>,
    /// Demo traffic to the simulated channels, requests per second.
    pub demo_traffic: Option<f64>,
    /// R1: this instance's name in a fleet; overrides the config's `fleet.instance`.
    pub instance: Option<String>,
    /// R2: the fleet's Redis; overrides the config's `redis`.
    pub redis: Option<String>,
}

/// A started gateway and everything started with it.
pub struct Launched {
    pub running: Running,
    pub url: String,
    pub token: AdminToken,
    pub ledger_path: PathBuf,
    /// The ledger as logs may name it: the file, or the PostgreSQL URL without its password.
    pub ledger_shown: String,
    /// Key secrets made at this start, to show once.
    pub generated: Vec<GeneratedSecret>,
    /// The simulated providers, when the config asks for any.
    pub sim: Option<SimHandle>,
    /// Whether `/` serves a console.
    pub has_console: bool,
    /// Set when the config says the listener is reachable from other machines.
    pub listen_warning: Option<String>,
    traffic: Option<JoinHandle<()>>,
}

/// The simulated models demo traffic may go to: real providers cost money.
fn simulated_targets(config: &Config) -> Vec<Target> {
    let mut targets: Vec<Target> = config
        .channels
        .iter()
        .filter(|c| c.simulated.is_some())
        .flat_map(|c| {
            // The demo's `*-batch-sim` channels take background jobs only: the OpenAI one
            // under the built-in default workflow, the others under support_summary.
            let background = c.simulated.as_deref().filter(|n| n.contains("-batch")).map(|_| {
                if c.format == spillway_wire::Format::OpenAi {
                    "default".to_owned()
                } else {
                    "support_summary".to_owned()
                }
            });
            c.models.iter().filter(|m| *m != "*").map(move |m| Target {
                format: c.format,
                model: m.clone(),
                background: background.clone(),
            })
        })
        .collect();
    targets.sort_by(|a, b| (a.format, &a.model).cmp(&(b.format, &b.model)));
    targets.dedup_by(|a, b| a.format == b.format && a.model == b.model);
    targets
}

/// The ledger file: `--ledger`, else the config's, else `ledger.db` in the data directory
/// (also when the ledger is PostgreSQL's: nothing opens it then).
pub fn ledger_path(flag: Option<&Path>, config: &Config) -> Result<PathBuf, LaunchError> {
    Ok(match (flag, &config.ledger) {
        (Some(p), _) if pg_url(p).is_none() => p.to_owned(),
        (None, Some(LedgerLocation::Sqlite(p))) => p.clone(),
        _ => spillway_engine::data_dir()?.join("ledger.db"),
    })
}

/// `--ledger postgres://...`: a PostgreSQL URL given where a file may be.
fn pg_url(p: &Path) -> Option<SecretUrl> {
    p.to_str()
        .filter(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"))
        .map(|s| SecretUrl(s.to_owned()))
}

/// Starts everything `l` asks for.
pub async fn launch(l: Launch) -> Result<Launched, LaunchError> {
    let mut config = load(l.config.as_deref())?;
    let listen_warning = match l.listen {
        Some(a) if !a.ip().is_loopback() => Some(format!(
            "--listen {a} is not a loopback address; the gateway is reachable from other machines"
        )),
        Some(_) => None,
        None => config.listen_warning.clone(),
    };
    let sim = match &config.simulator {
        Some(scenario) if config.channels.iter().any(|c| c.simulated.is_some()) => {
            let sim = spillway_sim::start(([127, 0, 0, 1], 0).into(), scenario.clone()).await?;
            config.resolve_simulator(&|name| sim.channel_url(name));
            Some(sim)
        }
        _ => None,
    };
    // R1, R2: the fleet's flags override the config's fields.
    if let Some(url) = l.ledger.as_deref().and_then(pg_url) {
        config.ledger = Some(LedgerLocation::Postgres(url));
    } else if let Some(p) = &l.ledger {
        config.ledger = Some(LedgerLocation::Sqlite(p.clone()));
    }
    if let Some(r) = &l.redis {
        if !r.starts_with("redis://") {
            return Err(LaunchError::Flag(format!(
                "--redis `{}` is not a Redis URL; expected redis://host:port/db",
                SecretUrl(r.clone()).redacted()
            )));
        }
        config.redis = Some(SecretUrl(r.clone()));
    }
    if let Some(i) = &l.instance {
        config.fleet.instance = Some(i.clone());
    }
    let ledger_path = ledger_path(l.ledger.as_deref(), &config)?;
    let ledger_shown = match &config.ledger {
        Some(LedgerLocation::Postgres(u)) => u.redacted(),
        _ => ledger_path.display().to_string(),
    };
    let token = spillway_engine::admin_token()?;
    let console = match l
        .ui_dir
        .clone()
        .or_else(|| env("SPILLWAY_UI_DIR").filter(|d| !d.is_empty()).map(PathBuf::from))
    {
        Some(dir) => Console::Dir(dir),
        None => embedded_console(),
    };
    let has_console = !matches!(console, Console::None);
    let generated = std::mem::take(&mut config.generated);
    let targets = simulated_targets(&config);
    let demo_key = generated.first().map(|g| g.secret.clone());
    let running = spillway_engine::start(
        config,
        Options {
            ledger_path: ledger_path.clone(),
            listen: l.listen,
            admin_token: Some(token.clone()),
            console,
            otel: spillway_engine::otel::Otel::from_env()?.map(Arc::new),
            ..Options::default()
        },
    )
    .await?;
    let url = format!("http://{}", running.addr);
    let traffic = match (l.demo_traffic, demo_key) {
        (Some(rps), Some(key)) if !targets.is_empty() => {
            Some(spillway_sim::traffic::spawn(url.clone(), key, targets, rps))
        }
        (Some(_), _) => {
            tracing::warn!(
                "demo traffic needs simulated channels and a generated key (the embedded default); none sent"
            );
            None
        }
        _ => None,
    };
    Ok(Launched {
        running,
        url,
        token,
        ledger_path,
        ledger_shown,
        generated,
        sim,
        has_console,
        listen_warning,
        traffic,
    })
}

impl Launched {
    fn stop_traffic(&self) {
        if let Some(t) = &self.traffic {
            t.abort();
        }
    }

    /// Graceful: drain within the config's deadline, cut what is left, flush the ledger.
    pub async fn shutdown(&self) -> Result<(), LaunchError> {
        self.stop_traffic();
        self.running.shutdown().await?;
        Ok(())
    }

    /// At once: cut everything, record it, flush the ledger.
    pub async fn abort(&self) -> Result<(), LaunchError> {
        self.stop_traffic();
        self.running.abort().await?;
        Ok(())
    }
}

/// The runtime's worker threads for the gateway: `asked`, or else one per core, but one
/// fewer with a SQLite ledger. SQLite's commits run on a thread of their own, which is
/// busy whenever requests are; a worker per core as well put one more thread than cores
/// on the run queue, and the workers spent their time waking and stealing from each
/// other (`make bench` on 2 cores, one worker against two: CPU per request 400 against
/// 467 µs at 500 req/s, 277 against 343 µs at 2,000, closed-loop throughput the same).
/// A PostgreSQL ledger has no such thread here.
pub fn request_threads(asked: Option<u16>, sqlite: bool) -> usize {
    asked.map(usize::from).unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if sqlite { cores.saturating_sub(1).max(1) } else { cores }
    })
}

/// A request-thread count as `--workers` or `SPILLWAY_WORKERS` gives it: 1 to 1024.
pub fn parse_workers(v: &str) -> Result<u16, String> {
    v.trim()
        .parse::<u16>()
        .ok()
        .filter(|n| (1..=1024).contains(n))
        .ok_or_else(|| format!("`{v}` is not a number of threads from 1 to 1024"))
}

/// Whether the gateway that `config` and a `--ledger` flag describe keeps a SQLite
/// ledger. A config that does not load counts as SQLite: serving it reports the error.
pub fn sqlite_ledger(config: Option<&Path>, ledger: Option<&Path>) -> bool {
    if let Some(p) = ledger {
        return pg_url(p).is_none();
    }
    // The embedded default is SQLite; only a config file names PostgreSQL.
    config.is_none_or(|c| !matches!(load(Some(c)).map(|c| c.ledger), Ok(Some(LedgerLocation::Postgres(_)))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_targets_only_simulated_models() {
        let c = Config::parse(Path::new("demo.yaml"), EMBEDDED_DEFAULT, &|_| None, &new_demo_secret).unwrap();
        let t = simulated_targets(&c);
        // Two chat models per format, and an embedding model each for OpenAI and Gemini;
        // and two models only background jobs go to (J2), one failing often (dead
        // letters), one whose quota runs out now and then (owner review).
        assert_eq!(t.len(), 10);
        assert_eq!(t.iter().filter(|t| t.embeds()).count(), 2);
        let jobs: Vec<(&str, Option<&str>)> = t
            .iter()
            .filter(|t| t.background.is_some())
            .map(|t| (t.model.as_str(), t.background.as_deref()))
            .collect();
        assert_eq!(
            jobs,
            [
                ("gpt-4.1-nano", Some("default")),
                ("claude-sonnet-4", Some("support_summary"))
            ]
        );
        assert_eq!(c.generated.len(), 1);
        assert!(c.generated[0].secret.starts_with("sk-spillway-demo-"));
    }
}
