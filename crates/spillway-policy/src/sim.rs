//! What a simulated provider channel does: the scenario shapes shared by the simulator's
//! scenario files, its control API and the `simulator:` section of a gateway config (the
//! embedded default, `policies/demo.yaml`, describes its simulated channels and their
//! fault rates this way). Pure data; the simulator itself lives in `spillway-sim`.

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
    /// Parses a scenario file's text; errors carry the file, line and column.
    pub fn parse(file: &str, text: &str) -> std::result::Result<Scenario, String> {
        serde_saphyr::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("{}:{}: ", l.line(), l.column()))
                .unwrap_or_default();
            format!("{file}:{at}{}", e.without_snippet())
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
    /// Do the work (the call's latency passes, as if the answer were made), then close the
    /// connection before answering: the provider acted and the caller cannot know it.
    DropAfterCompletion,
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
    /// A redirect (307 unless `status` says otherwise) to `location`: a gateway must not
    /// follow it, nor carry its credentials and the prompt to another host.
    Redirect {
        location: String,
        #[serde(default)]
        status: Option<u16>,
    },
}
