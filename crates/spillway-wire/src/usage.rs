//! Token usage as each provider reports it (M2), from whole bodies and from stream events.

use crate::Format;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Normalised token counts. `None` means the provider did not say, which is not zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// Input tokens served from the provider's prompt cache (priced lower).
    pub cached_input_tokens: Option<u64>,
    /// Anthropic: tokens written to the prompt cache (priced higher).
    pub cache_creation_tokens: Option<u64>,
    /// OpenAI reasoning / Gemini thoughts tokens, included in output.
    pub reasoning_tokens: Option<u64>,
}

/// Tokens as they are priced: each input token in exactly one of the three input
/// buckets (the providers disagree on whether their input count includes cache reads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Billable {
    /// Input read neither from nor into the prompt cache.
    pub input: u64,
    pub cached_input: u64,
    pub cache_write: u64,
    /// Output, reasoning and thoughts included.
    pub output: u64,
}

impl Billable {
    /// The whole prompt, in every bucket.
    pub fn total_input(&self) -> u64 {
        self.input + self.cached_input + self.cache_write
    }
}

fn u(v: &Value, path: &[&str]) -> Option<u64> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_u64()
}

impl Usage {
    pub fn is_empty(&self) -> bool {
        *self == Usage::default()
    }

    /// Later reports win field by field: Anthropic sends input in `message_start` and
    /// output in `message_delta`; Gemini repeats a growing total on each chunk.
    pub fn merge(&mut self, other: Usage) {
        fn m(a: &mut Option<u64>, b: Option<u64>) {
            if b.is_some() {
                *a = b;
            }
        }
        m(&mut self.input_tokens, other.input_tokens);
        m(&mut self.output_tokens, other.output_tokens);
        m(&mut self.cached_input_tokens, other.cached_input_tokens);
        m(&mut self.cache_creation_tokens, other.cache_creation_tokens);
        m(&mut self.reasoning_tokens, other.reasoning_tokens);
    }

    /// The tokens to price, or None when the provider reported no counts at all (an
    /// unknown cost, never zero). OpenAI's and Gemini's input counts include cache reads;
    /// Anthropic's counts only the uncached part, with reads and writes beside it.
    pub fn billable(&self, format: Format) -> Option<Billable> {
        if self.input_tokens.is_none() && self.output_tokens.is_none() {
            return None;
        }
        let output = self.output_tokens.unwrap_or(0);
        Some(match format {
            Format::Anthropic => Billable {
                input: self.input_tokens.unwrap_or(0),
                cached_input: self.cached_input_tokens.unwrap_or(0),
                cache_write: self.cache_creation_tokens.unwrap_or(0),
                output,
            },
            Format::OpenAi | Format::Gemini => {
                let total = self.input_tokens.unwrap_or(0);
                let cached = self.cached_input_tokens.unwrap_or(0).min(total);
                Billable {
                    input: total - cached,
                    cached_input: cached,
                    cache_write: 0,
                    output,
                }
            }
        })
    }

    /// Usage from a non-streaming response body, or from one stream event's JSON.
    pub fn from_json(format: Format, v: &Value) -> Usage {
        match format {
            // Chat completions and embeddings name their counts `prompt_`/`completion_`;
            // the Responses API `input_`/`output_`, and its stream nests the response
            // (`response.completed`).
            Format::OpenAi => match v
                .get("usage")
                .or_else(|| v.get("response").and_then(|r| r.get("usage")))
            {
                Some(us) if us.is_object() => Usage {
                    input_tokens: u(us, &["prompt_tokens"]).or_else(|| u(us, &["input_tokens"])),
                    output_tokens: u(us, &["completion_tokens"]).or_else(|| u(us, &["output_tokens"])),
                    cached_input_tokens: u(us, &["prompt_tokens_details", "cached_tokens"])
                        .or_else(|| u(us, &["input_tokens_details", "cached_tokens"])),
                    cache_creation_tokens: None,
                    reasoning_tokens: u(us, &["completion_tokens_details", "reasoning_tokens"])
                        .or_else(|| u(us, &["output_tokens_details", "reasoning_tokens"])),
                },
                _ => Usage::default(),
            },
            Format::Anthropic => {
                // `message_start` nests the message; `message_delta` and whole bodies don't.
                let us = v.get("message").and_then(|m| m.get("usage")).or_else(|| v.get("usage"));
                match us {
                    Some(us) if us.is_object() => Usage {
                        input_tokens: u(us, &["input_tokens"]),
                        output_tokens: u(us, &["output_tokens"]),
                        cached_input_tokens: u(us, &["cache_read_input_tokens"]),
                        cache_creation_tokens: u(us, &["cache_creation_input_tokens"]),
                        reasoning_tokens: None,
                    },
                    _ => Usage::default(),
                }
            }
            Format::Gemini => match v.get("usageMetadata") {
                Some(us) if us.is_object() => Usage {
                    input_tokens: u(us, &["promptTokenCount"]),
                    output_tokens: match (u(us, &["candidatesTokenCount"]), u(us, &["thoughtsTokenCount"])) {
                        (Some(c), t) => Some(c + t.unwrap_or(0)),
                        (None, t) => t,
                    },
                    cached_input_tokens: u(us, &["cachedContentTokenCount"]),
                    cache_creation_tokens: None,
                    reasoning_tokens: u(us, &["thoughtsTokenCount"]),
                },
                _ => Usage::default(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn m2_usage_of_the_responses_api_and_embeddings() {
        // spec: M2
        let whole = json!({"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":3},
            "output_tokens":7,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":19}});
        let streamed = json!({"type":"response.completed","response":whole});
        for v in [whole.clone(), streamed] {
            let u = Usage::from_json(Format::OpenAi, &v);
            assert_eq!(
                (
                    u.input_tokens,
                    u.output_tokens,
                    u.cached_input_tokens,
                    u.reasoning_tokens
                ),
                (Some(12), Some(7), Some(3), Some(2)),
                "{v}"
            );
        }
        let e = Usage::from_json(Format::OpenAi, &json!({"usage":{"prompt_tokens":8,"total_tokens":8}}));
        assert_eq!((e.input_tokens, e.output_tokens), (Some(8), None));
    }

    #[test]
    fn m2_usage_per_format() {
        // spec: M2
        let o = Usage::from_json(
            Format::OpenAi,
            &json!({"usage":{"prompt_tokens":10,"completion_tokens":5,
            "prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":2}}}),
        );
        assert_eq!(
            (
                o.input_tokens,
                o.output_tokens,
                o.cached_input_tokens,
                o.reasoning_tokens
            ),
            (Some(10), Some(5), Some(4), Some(2))
        );
        let a = Usage::from_json(
            Format::Anthropic,
            &json!({"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":3,"cache_creation_input_tokens":2}}}),
        );
        assert_eq!(
            (a.input_tokens, a.cached_input_tokens, a.cache_creation_tokens),
            (Some(7), Some(3), Some(2))
        );
        let mut total = a;
        total.merge(Usage::from_json(
            Format::Anthropic,
            &json!({"type":"message_delta","usage":{"output_tokens":9}}),
        ));
        assert_eq!((total.input_tokens, total.output_tokens), (Some(7), Some(9)));
        let g = Usage::from_json(
            Format::Gemini,
            &json!({"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":6,"thoughtsTokenCount":3,"cachedContentTokenCount":1}}),
        );
        assert_eq!(
            (
                g.input_tokens,
                g.output_tokens,
                g.reasoning_tokens,
                g.cached_input_tokens
            ),
            (Some(8), Some(9), Some(3), Some(1))
        );
        // OpenAI stream chunks without usage (usage: null) report nothing.
        assert!(Usage::from_json(Format::OpenAi, &json!({"usage":null})).is_empty());
    }

    #[test]
    fn m2_billable_tokens_put_each_input_token_in_one_bucket() {
        // spec: M2
        // OpenAI: 10 prompt tokens of which 4 cached; 5 completion of which 2 reasoning.
        let o = Usage::from_json(
            Format::OpenAi,
            &json!({"usage":{"prompt_tokens":10,"completion_tokens":5,
            "prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":2}}}),
        );
        assert_eq!(
            o.billable(Format::OpenAi),
            Some(Billable {
                input: 6,
                cached_input: 4,
                cache_write: 0,
                output: 5
            })
        );
        // Anthropic: input_tokens excludes cache reads and writes.
        let mut a = Usage::from_json(
            Format::Anthropic,
            &json!({"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":1,
            "cache_read_input_tokens":300,"cache_creation_input_tokens":20}}}),
        );
        a.merge(Usage::from_json(
            Format::Anthropic,
            &json!({"type":"message_delta","usage":{"output_tokens":9}}),
        ));
        let b = a.billable(Format::Anthropic).unwrap();
        assert_eq!(
            b,
            Billable {
                input: 7,
                cached_input: 300,
                cache_write: 20,
                output: 9
            }
        );
        assert_eq!(b.total_input(), 327);
        // Gemini: thoughts are billed as output; cached content is inside the prompt count.
        let g = Usage::from_json(
            Format::Gemini,
            &json!({"usageMetadata":{"promptTokenCount":80,"candidatesTokenCount":6,"thoughtsTokenCount":30,"cachedContentTokenCount":64}}),
        );
        assert_eq!(
            g.billable(Format::Gemini),
            Some(Billable {
                input: 16,
                cached_input: 64,
                cache_write: 0,
                output: 36
            })
        );
        assert_eq!(Usage::default().billable(Format::OpenAi), None);
    }
}
