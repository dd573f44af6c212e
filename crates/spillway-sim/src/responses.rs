//! Provider-shaped answers: whole bodies, stream events and error bodies, per format.

use serde_json::{Value, json};
use spillway_policy::sim::{ErrorFlavor, RateLimitHeaders};
use spillway_wire::{Api, Format};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WORDS: &[&str] = &[
    "Queues", "absorb", "bursts", "while", "breakers", "keep", "a", "failing", "route", "from", "dragging", "the",
    "rest", "down;", "retries", "stay", "inside", "their", "budget.",
];

pub fn token(i: u32) -> String {
    let w = WORDS[i as usize % WORDS.len()];
    if i == 0 { w.to_owned() } else { format!(" {w}") }
}

pub fn text(n: u32) -> String {
    (0..n).map(token).collect()
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

/// The whole non-streaming answer.
pub fn body(format: Format, model: &str, prompt_tokens: u64, n: u32) -> Value {
    let t = text(n);
    let n = u64::from(n);
    match format {
        Format::OpenAi => json!({
            "id": id("chatcmpl-"), "object": "chat.completion", "created": now_s(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": t, "refusal": null},
                         "logprobs": null, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                      "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                      "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                          "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
            "service_tier": "default", "system_fingerprint": "fp_spillway_sim"
        }),
        Format::Anthropic => json!({
            "id": id("msg_"), "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": t}], "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": n,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        }),
        Format::Gemini => json!({
            "candidates": [{"content": {"parts": [{"text": t}], "role": "model"}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": prompt_tokens, "candidatesTokenCount": n, "totalTokenCount": prompt_tokens + n},
            "modelVersion": model, "responseId": id("")
        }),
    }
}

/// A stream answer, as its events (already SSE-framed), split into the part before the
/// first token, one part per token, and the tail.
pub struct StreamPlan {
    pub head: Vec<String>,
    pub tokens: Vec<String>,
    pub tail: Vec<String>,
}

fn data(v: Value) -> String {
    format!("data: {v}\n\n")
}

fn event(name: &str, v: Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

pub fn stream(format: Format, model: &str, prompt_tokens: u64, n: u32, include_usage: bool) -> StreamPlan {
    let n64 = u64::from(n);
    match format {
        Format::OpenAi => {
            let cid = id("chatcmpl-");
            let created = now_s();
            let chunk = |delta: Value, finish: Value, usage: Option<Value>| {
                let mut v = json!({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": "fp_spillway_sim",
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
                if include_usage {
                    v["usage"] = Value::Null;
                }
                if let Some(u) = usage {
                    v["choices"] = json!([]);
                    v["usage"] = u;
                }
                data(v)
            };
            let head = vec![chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                Value::Null,
                None,
            )];
            let tokens = (0..n)
                .map(|i| chunk(json!({"content": token(i)}), Value::Null, None))
                .collect();
            let mut tail = vec![chunk(json!({}), json!("stop"), None)];
            if include_usage {
                tail.push(chunk(
                    json!({}),
                    Value::Null,
                    Some(json!({
                    "prompt_tokens": prompt_tokens, "completion_tokens": n64, "total_tokens": prompt_tokens + n64,
                    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                        "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}})),
                ));
            }
            tail.push("data: [DONE]\n\n".into());
            StreamPlan { head, tokens, tail }
        }
        Format::Anthropic => {
            let head = vec![
                event(
                    "message_start",
                    json!({"type": "message_start", "message": {
                    "id": id("msg_"), "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 1,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
                ),
                event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
                ),
                event("ping", json!({"type": "ping"})),
            ];
            let tokens = (0..n)
                .map(|i| {
                    event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": token(i)}}),
                    )
                })
                .collect();
            let tail = vec![
                event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                event(
                    "message_delta",
                    json!({"type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": n64}}),
                ),
                event("message_stop", json!({"type": "message_stop"})),
            ];
            StreamPlan { head, tokens, tail }
        }
        Format::Gemini => {
            let rid = id("");
            let tokens = (0..n)
                .map(|i| {
                    let mut v = json!({"candidates": [{"content": {"parts": [{"text": token(i)}], "role": "model"}, "index": 0}],
                        "usageMetadata": {"promptTokenCount": prompt_tokens, "totalTokenCount": prompt_tokens},
                        "modelVersion": model, "responseId": rid});
                    if i + 1 == n {
                        v["candidates"][0]["finishReason"] = json!("STOP");
                        v["usageMetadata"] = json!({"promptTokenCount": prompt_tokens, "candidatesTokenCount": n64,
                            "totalTokenCount": prompt_tokens + n64});
                    }
                    data(v)
                })
                .collect();
            StreamPlan {
                head: vec![],
                tokens,
                tail: vec![],
            }
        }
    }
}

/// A small deterministic vector for the `i`th input (the simulator's "embedding").
fn vector(i: usize) -> Vec<f64> {
    (0..8).map(|d| (((i * 31 + d * 7) % 17) as f64 - 8.0) / 8.0).collect()
}

/// The answer of an endpoint that never streams (embeddings, token counting).
pub fn plain(format: Format, api: Api, model: &str, prompt_tokens: u64, request: &Value) -> Value {
    match (format, api) {
        (Format::OpenAi, Api::Embeddings) => {
            let inputs = request.get("input").and_then(Value::as_array).map_or(1, Vec::len);
            json!({"object": "list", "model": model,
                "data": (0..inputs).map(|i| json!({"object": "embedding", "index": i, "embedding": vector(i)})).collect::<Vec<_>>(),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
        }
        (Format::Gemini, Api::Embeddings) => match request.get("requests").and_then(Value::as_array) {
            Some(reqs) => {
                json!({"embeddings": (0..reqs.len()).map(|i| json!({"values": vector(i)})).collect::<Vec<_>>()})
            }
            None => json!({"embedding": {"values": vector(0)}}),
        },
        (Format::Gemini, _) => json!({"totalTokens": prompt_tokens}),
        _ => json!({"input_tokens": prompt_tokens}),
    }
}

fn response_object(rid: &str, model: &str, status: &str, output: Value, usage: Value) -> Value {
    json!({"id": rid, "object": "response", "created_at": now_s(), "status": status, "model": model,
        "output": output, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}}, "usage": usage, "error": null, "incomplete_details": null})
}

fn message_item(mid: &str, status: &str, text: &str) -> Value {
    json!({"type": "message", "id": mid, "status": status, "role": "assistant",
        "content": if text.is_empty() && status == "in_progress" { json!([]) } else {
            json!([{"type": "output_text", "text": text, "annotations": []}]) }})
}

fn responses_usage(prompt_tokens: u64, n: u64) -> Value {
    json!({"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + n})
}

/// OpenAI's Responses API, whole.
pub fn responses_body(model: &str, prompt_tokens: u64, n: u32, rid: &str) -> Value {
    let output = json!([message_item(&id("msg_"), "completed", &text(n))]);
    response_object(
        rid,
        model,
        "completed",
        output,
        responses_usage(prompt_tokens, u64::from(n)),
    )
}

/// OpenAI's Responses API, as its typed event stream.
pub fn responses_stream(model: &str, prompt_tokens: u64, n: u32, rid: &str) -> StreamPlan {
    let mid = id("msg_");
    let seq = std::cell::Cell::new(0u64);
    let ev = |name: &str, mut v: Value| {
        v["type"] = json!(name);
        v["sequence_number"] = json!(seq.get());
        seq.set(seq.get() + 1);
        event(name, v)
    };
    let pending = response_object(rid, model, "in_progress", json!([]), Value::Null);
    let head = vec![
        ev("response.created", json!({"response": pending})),
        ev("response.in_progress", json!({"response": pending})),
        ev(
            "response.output_item.added",
            json!({"output_index": 0, "item": message_item(&mid, "in_progress", "")}),
        ),
        ev(
            "response.content_part.added",
            json!({"item_id": mid, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
    ];
    let tokens = (0..n)
        .map(|i| {
            ev(
                "response.output_text.delta",
                json!({"item_id": mid, "output_index": 0, "content_index": 0,
            "delta": token(i), "logprobs": []}),
            )
        })
        .collect();
    let t = text(n);
    let done = message_item(&mid, "completed", &t);
    let tail = vec![
        ev(
            "response.output_text.done",
            json!({"item_id": mid, "output_index": 0, "content_index": 0, "text": t, "logprobs": []}),
        ),
        ev(
            "response.content_part.done",
            json!({"item_id": mid, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": t, "annotations": []}}),
        ),
        ev("response.output_item.done", json!({"output_index": 0, "item": done})),
        ev(
            "response.completed",
            json!({"response": response_object(rid, model, "completed", json!([done]),
            responses_usage(prompt_tokens, u64::from(n)))}),
        ),
    ];
    StreamPlan { head, tokens, tail }
}

/// Status and JSON body of an error in `format`'s shape.
pub fn error(format: Format, status: u16, flavor: ErrorFlavor, message: &str, retry_delay: Option<&str>) -> Value {
    match format {
        Format::OpenAi => {
            let (ty, code) = match flavor {
                ErrorFlavor::RateLimit => ("requests", Some("rate_limit_exceeded")),
                ErrorFlavor::Quota => ("insufficient_quota", Some("insufficient_quota")),
                ErrorFlavor::Overloaded | ErrorFlavor::Server => ("server_error", None),
                ErrorFlavor::Auth => ("invalid_request_error", Some("invalid_api_key")),
                ErrorFlavor::Invalid => ("invalid_request_error", None),
            };
            json!({"error": {"message": message, "type": ty, "param": null, "code": code}})
        }
        Format::Anthropic => {
            let ty = match flavor {
                ErrorFlavor::RateLimit => "rate_limit_error",
                ErrorFlavor::Overloaded => "overloaded_error",
                ErrorFlavor::Quota => "billing_error",
                ErrorFlavor::Server => "api_error",
                ErrorFlavor::Auth => "authentication_error",
                ErrorFlavor::Invalid => "invalid_request_error",
            };
            json!({"type": "error", "error": {"type": ty, "message": message}})
        }
        Format::Gemini => {
            let st = match flavor {
                ErrorFlavor::RateLimit | ErrorFlavor::Quota => "RESOURCE_EXHAUSTED",
                ErrorFlavor::Overloaded => "UNAVAILABLE",
                ErrorFlavor::Server => "INTERNAL",
                ErrorFlavor::Auth if status == 400 => "INVALID_ARGUMENT",
                ErrorFlavor::Auth => "UNAUTHENTICATED",
                ErrorFlavor::Invalid => "INVALID_ARGUMENT",
            };
            let mut details = Vec::new();
            match flavor {
                ErrorFlavor::RateLimit => details.push(json!({"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                                    "quotaId": "GenerateRequestsPerMinutePerProjectPerModel"}]})),
                ErrorFlavor::Quota => details.push(json!({"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                                    "quotaId": "GenerateRequestsPerDayPerProjectPerModel-FreeTier"}]})),
                // A bad key comes as 400 INVALID_ARGUMENT with this reason (not 401).
                ErrorFlavor::Auth => details.push(json!({"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID", "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"}})),
                _ => {}
            }
            if let Some(d) = retry_delay {
                details.push(json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": d}));
            }
            let mut v = json!({"error": {"code": status, "message": message, "status": st}});
            if !details.is_empty() {
                v["error"]["details"] = Value::Array(details);
            }
            v
        }
    }
}

/// Rate-limit headers in the provider's naming; Gemini sends none.
pub fn ratelimit_headers(format: Format, r: &RateLimitHeaders) -> Vec<(String, String)> {
    let go = |s: f64| format!("{}ms", (s * 1000.0).round() as u64);
    let rfc = |s: f64| rfc3339(SystemTime::now() + Duration::from_secs_f64(s.max(0.0)));
    match format {
        Format::OpenAi => vec![
            ("x-ratelimit-limit-requests".into(), r.limit_requests.to_string()),
            (
                "x-ratelimit-remaining-requests".into(),
                r.remaining_requests.to_string(),
            ),
            ("x-ratelimit-reset-requests".into(), go(r.reset_requests_s)),
            ("x-ratelimit-limit-tokens".into(), r.limit_tokens.to_string()),
            ("x-ratelimit-remaining-tokens".into(), r.remaining_tokens.to_string()),
            ("x-ratelimit-reset-tokens".into(), go(r.reset_tokens_s)),
        ],
        Format::Anthropic => vec![
            (
                "anthropic-ratelimit-requests-limit".into(),
                r.limit_requests.to_string(),
            ),
            (
                "anthropic-ratelimit-requests-remaining".into(),
                r.remaining_requests.to_string(),
            ),
            ("anthropic-ratelimit-requests-reset".into(), rfc(r.reset_requests_s)),
            ("anthropic-ratelimit-tokens-limit".into(), r.limit_tokens.to_string()),
            (
                "anthropic-ratelimit-tokens-remaining".into(),
                r.remaining_tokens.to_string(),
            ),
            ("anthropic-ratelimit-tokens-reset".into(), rfc(r.reset_tokens_s)),
        ],
        Format::Gemini => vec![],
    }
}

fn rfc3339(t: SystemTime) -> String {
    spillway_wire::UnixMs::from_system(t).to_rfc3339()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips_through_the_wire_parser() {
        let t = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
        let s = rfc3339(t);
        assert_eq!(s, "2026-05-28T20:26:40.000Z");
        assert_eq!(
            spillway_wire::UnixMs::parse_rfc3339(&s),
            Some(spillway_wire::UnixMs::from_system(t))
        );
    }

    #[test]
    fn streams_carry_usage_the_gateway_can_read() {
        for f in Format::ALL {
            let plan = stream(f, "m", 10, 3, true);
            let all: String = plan
                .head
                .iter()
                .chain(&plan.tokens)
                .chain(&plan.tail)
                .cloned()
                .collect();
            let mut usage = spillway_wire::Usage::default();
            for ev in spillway_wire::SseParser::new().push(all.as_bytes()) {
                if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                    usage.merge(spillway_wire::Usage::from_json(f, &v));
                }
            }
            assert_eq!((usage.input_tokens, usage.output_tokens), (Some(10), Some(3)), "{f}");
        }
    }
}
