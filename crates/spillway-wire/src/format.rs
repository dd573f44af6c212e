//! The three provider wire formats.

use serde::{Deserialize, Serialize};

/// A provider wire format. A request keeps its caller's format from ingress to the error
/// body it may end with (A3), and is only routed to channels of the same format (A4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "lowercase")]
pub enum Format {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::OpenAi, Format::Anthropic, Format::Gemini];

    pub fn as_str(self) -> &'static str {
        match self {
            Format::OpenAi => "openai",
            Format::Anthropic => "anthropic",
            Format::Gemini => "gemini",
        }
    }

    /// The response header that carries the provider's own request id, recorded in the
    /// ledger so a gateway request can be tied to the provider's (N3).
    pub fn upstream_request_id_header(self) -> &'static str {
        match self {
            Format::OpenAi => "x-request-id",
            Format::Anthropic => "request-id",
            Format::Gemini => "x-goog-request-id",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "openai" => Ok(Format::OpenAi),
            "anthropic" => Ok(Format::Anthropic),
            "gemini" => Ok(Format::Gemini),
            other => Err(format!(
                "unknown format `{other}`; expected one of openai, anthropic, gemini"
            )),
        }
    }
}
