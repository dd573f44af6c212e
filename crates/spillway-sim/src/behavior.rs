//! What a simulated channel does: the scenario file and control API shapes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A scenario file: behaviour per channel name.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default)]
    pub channels: BTreeMap<String, Behavior>,
}

impl Scenario {
    pub fn load(path: &std::path::Path) -> crate::Result<Scenario> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| crate::Error::Read {
            path: p.clone(),
            source,
        })?;
        serde_saphyr::from_str(&text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("{}:{}: ", l.line(), l.column()))
                .unwrap_or_default();
            crate::Error::Scenario {
                path: p,
                message: format!("{at}{}", e.without_snippet()),
            }
        })
    }
}

/// How one channel answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Behavior {
    /// Delay before the response headers.
    pub latency_ms: u64,
    /// Streamed tokens per second; unset streams as fast as possible.
    pub tokens_per_second: Option<f64>,
    /// Output tokens per answer.
    pub output_tokens: u32,
    /// `x-ratelimit-*` (OpenAI) or `anthropic-ratelimit-*` headers on every answer.
    pub ratelimit: Option<RateLimitHeaders>,
    /// Applied to every call once `script` is used up (and no random fault was drawn).
    pub fault: Option<Fault>,
    /// Faults drawn at random once `script` is used up: each hits its share of calls.
    pub random_faults: Vec<RandomFault>,
    /// Faults for the next calls, in order: each step covers `times` calls.
    pub script: Vec<Step>,
}

impl Default for Behavior {
    fn default() -> Self {
        Behavior {
            latency_ms: 0,
            tokens_per_second: None,
            output_tokens: 12,
            ratelimit: None,
            fault: None,
            random_faults: Vec::new(),
            script: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub fault: Fault,
    #[serde(default = "one")]
    pub times: u32,
}

/// A fault that hits a share of calls, e.g. 10 % of calls get a 503.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFault {
    pub fault: Fault,
    /// 0–1.
    pub probability: f64,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitHeaders {
    pub limit_requests: u64,
    pub remaining_requests: u64,
    /// Seconds until the request window resets.
    pub reset_requests_s: f64,
    pub limit_tokens: u64,
    pub remaining_tokens: u64,
    pub reset_tokens_s: f64,
}

/// The provider error vocabulary a status fault speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFlavor {
    /// OpenAI `rate_limit_exceeded`, Anthropic `rate_limit_error`, Gemini RESOURCE_EXHAUSTED (per minute).
    RateLimit,
    /// Anthropic `overloaded_error` (529), 503 elsewhere.
    Overloaded,
    /// OpenAI `insufficient_quota`, Anthropic `billing_error`, Gemini RESOURCE_EXHAUSTED (per day).
    Quota,
    /// 500-class `server_error` / `api_error` / INTERNAL.
    Server,
    /// Bad credential.
    Auth,
    /// The request is wrong.
    Invalid,
}

impl ErrorFlavor {
    pub fn for_status(status: u16) -> ErrorFlavor {
        match status {
            429 => ErrorFlavor::RateLimit,
            503 | 529 => ErrorFlavor::Overloaded,
            402 => ErrorFlavor::Quota,
            401 | 403 => ErrorFlavor::Auth,
            500..=599 => ErrorFlavor::Server,
            _ => ErrorFlavor::Invalid,
        }
    }
}

/// One way for a call to go wrong.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Answer normally (a script step that lets one call through).
    Ok,
    /// An HTTP error in the channel's provider shape.
    Status {
        status: u16,
        #[serde(default)]
        error: Option<ErrorFlavor>,
        /// `Retry-After` in seconds.
        #[serde(default)]
        retry_after_s: Option<u64>,
        /// `Retry-After` as an HTTP date this many seconds from now.
        #[serde(default)]
        retry_after_date_s: Option<u64>,
        /// Gemini `RetryInfo.retryDelay`, e.g. `30s`.
        #[serde(default)]
        retry_delay: Option<String>,
        #[serde(default)]
        message: Option<String>,
    },
    /// Close the connection without answering.
    Refuse,
    /// Accept and never answer (until `ms` passes, if given, then answer normally).
    Hang {
        #[serde(default)]
        ms: Option<u64>,
    },
    /// Stream: send headers, then break the connection before any token.
    CutBeforeFirstToken,
    /// Stream: break the connection after `after_tokens` tokens.
    CutAfterFirstToken {
        #[serde(default = "one")]
        after_tokens: u32,
    },
    /// 200 with a body that is not JSON.
    MalformedBody,
}

/// Counters a test reads back through `/_control/channels/{name}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChannelStats {
    /// Provider calls received (control calls excluded).
    pub calls: u64,
    pub in_flight: u64,
    pub max_in_flight: u64,
    /// Calls that got a fault other than `ok`.
    pub faults: u64,
    /// Path and query of the last provider call, as received.
    pub last_path: Option<String>,
    /// A few headers of the last provider call (trace context, credentials, versions), so
    /// tests can check what the gateway forwards and what it keeps back.
    pub last_headers: std::collections::BTreeMap<String, String>,
}
