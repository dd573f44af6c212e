//! The gateway. A request flows one way through these modules:
//! [`ingress`] (wire format, auth, size and shape checks) → [`routing`] (channels that
//! speak the format and serve the model, capacity) → [`upstream`] (the attempt, its
//! classification, streaming pass-through) → the ledger, written at each state change.
//! [`error`] is the one place where a gateway error becomes a status and a body in the
//! caller's format; [`embedded`] builds the zero-config default (simulated or real
//! providers) that `spillway serve` and the desktop shell start with.

pub mod admin;
pub mod embedded;
pub mod error;
pub mod failover;
pub mod health;
pub mod ingress;
pub mod limits;
pub mod metrics;
pub mod retry;
pub mod routing;
pub mod state;
pub mod trace;
pub mod upstream;

pub use error::GatewayError;
pub use state::AppState;

use spillway_ledger::Ledger;
use spillway_policy::Config;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ledger(#[from] spillway_ledger::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(String),
    #[error(transparent)]
    Sim(#[from] spillway_sim::Error),
    #[error("no data directory: set SPILLWAY_DATA_DIR or HOME")]
    NoDataDir,
    #[error("cannot read or create the admin token in {dir}: {source}")]
    AdminToken { dir: String, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;

/// The directory for the default ledger, the admin token and other local state:
/// `$SPILLWAY_DATA_DIR`, else the platform's user data directory + `spillway`.
pub fn data_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("SPILLWAY_DATA_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    dirs::data_dir().map(|d| d.join("spillway")).ok_or(Error::NoDataDir)
}

/// The built console to serve: `flag`, then `$SPILLWAY_UI_DIR`, then `ui/dist` of the source
/// tree the running binary was built in (`target/<profile>/<binary>`).
pub fn console_dir(flag: Option<PathBuf>) -> Option<PathBuf> {
    flag.or_else(|| {
        std::env::var_os("SPILLWAY_UI_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
    .or_else(|| {
        let exe = std::env::current_exe().ok()?;
        let dist = exe.parent()?.parent()?.parent()?.join("ui").join("dist");
        dist.join("index.html").is_file().then_some(dist)
    })
}

/// The admin token in the data directory, created on first use.
pub fn admin_token() -> Result<admin::AdminToken> {
    let dir = data_dir()?;
    admin::AdminToken::load_or_create(&dir).map_err(|source| Error::AdminToken {
        dir: dir.display().to_string(),
        source,
    })
}

/// A gateway that is accepting connections.
pub struct Running {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests (streams included) finish, then flushes
    /// the ledger.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.server).await;
        self.state.ledger.close().await?;
        Ok(())
    }
}

/// How the gateway is started, beyond its config.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub ledger_path: PathBuf,
    /// Overrides the config's `listen`.
    pub listen: Option<SocketAddr>,
    /// Without a token the admin API refuses everything.
    pub admin_token: Option<admin::AdminToken>,
    /// The built console (`ui/dist`), served at `/`.
    pub ui_dir: Option<PathBuf>,
}

/// Opens the ledger and starts serving `config`.
pub async fn start(config: Config, opts: Options) -> Result<Running> {
    let ledger = Ledger::open_sqlite(&opts.ledger_path).await?;
    let addr = opts.listen.unwrap_or(config.listen);
    let mut state = AppState::new(config, ledger)?;
    state.admin_token = opts.admin_token;
    state.ui_dir = opts.ui_dir;
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })?;
    let addr = listener.local_addr().map_err(|source| Error::Listen { addr, source })?;
    let app = ingress::router(state.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    use axum::serve::ListenerExt;
    // Without TCP_NODELAY small keep-alive responses wait ~40 ms on the client's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
    });
    Ok(Running {
        addr,
        state,
        stop: Some(stop),
        server,
    })
}
