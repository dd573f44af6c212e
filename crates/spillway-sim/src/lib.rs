//! Simulated OpenAI, Anthropic and Gemini providers with fault injection, and a traffic
//! generator. Every gateway test and the demo run against this instead of the real APIs.
//!
//! One server serves any number of *channels*, each under its own path prefix
//! (`http://HOST:PORT/<channel>/v1/chat/completions`); a request without a prefix belongs
//! to the `default` channel. Each channel's [`Behavior`] comes from a scenario file and can
//! be changed at run time through the control API under `/_control/`, which also reports
//! how many calls each channel received, so tests can assert exact upstream call counts.
//! Like the gateway, it answers only loopback Host names, so a web page cannot reach its
//! unauthenticated control API through DNS rebinding.

mod behavior;
mod responses;
mod server;
pub mod traffic;

pub use behavior::ChannelStats;
pub use server::{SimHandle, start};
pub use spillway_policy::sim::{Behavior, ErrorFlavor, Fault, RandomFault, RateLimitHeaders, Scenario, Step};

/// Reads a scenario file.
pub fn load_scenario(path: &std::path::Path) -> Result<Scenario> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: p.clone(),
        source,
    })?;
    Scenario::parse(&p, &text).map_err(|message| Error::Scenario { path: p, message })
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read scenario {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Scenario { path: String, message: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;
