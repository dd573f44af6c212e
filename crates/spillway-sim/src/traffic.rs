//! A traffic generator: a realistic mix of the three formats, streaming and not, sent to
//! a gateway at a steady rate so the console has something to show. Used by the demo
//! (`spillway serve --demo-traffic`) and by `spillway sim traffic`.

use rand::Rng;
use serde_json::json;
use spillway_wire::Format;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Target {
    pub format: Format,
    pub model: String,
    /// J2: sent as background jobs (`Prefer: respond-async`) under this workflow, not as
    /// interactive requests.
    pub background: Option<String>,
}

impl Target {
    /// An embedding model (by the providers' naming): it gets embedding requests.
    pub fn embeds(&self) -> bool {
        self.model.contains("embedding")
    }
}

/// The request a client SDK would send for `target`.
pub fn request(
    client: &reqwest::Client,
    gateway: &str,
    key: &str,
    target: &Target,
    stream: bool,
    prompt: &str,
) -> reqwest::RequestBuilder {
    if target.embeds() {
        return match target.format {
            Format::Gemini => client
                .post(format!("{gateway}/v1beta/models/{}:embedContent", target.model))
                .header("x-goog-api-key", key)
                .json(&json!({"content": {"parts": [{"text": prompt}]}})),
            _ => client
                .post(format!("{gateway}/v1/embeddings"))
                .bearer_auth(key)
                .json(&json!({"model": target.model, "input": prompt})),
        };
    }
    match target.format {
        Format::OpenAi => client
            .post(format!("{gateway}/v1/chat/completions"))
            .bearer_auth(key)
            .json(&json!({"model": target.model, "stream": stream,
                "stream_options": if stream { json!({"include_usage": true}) } else { serde_json::Value::Null },
                "messages": [{"role": "user", "content": prompt}]})),
        Format::Anthropic => client
            .post(format!("{gateway}/v1/messages"))
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
            .json(&json!({"model": target.model, "max_tokens": 256, "stream": stream,
                "messages": [{"role": "user", "content": prompt}]})),
        Format::Gemini => {
            let action = if stream {
                "streamGenerateContent?alt=sse"
            } else {
                "generateContent"
            };
            client
                .post(format!("{gateway}/v1beta/models/{}:{action}", target.model))
                .header("x-goog-api-key", key)
                .json(&json!({"contents": [{"role": "user", "parts": [{"text": prompt}]}]}))
        }
    }
}

const PROMPTS: &[&str] = &[
    "Summarise this support ticket in two sentences.",
    "Classify the sentiment of: the checkout page keeps timing out.",
    "Draft a polite reply to a customer asking about a refund.",
    "Extract the invoice number and total from the attached text.",
];

/// One background job for `target` (J2): its request with `Prefer: respond-async`.
pub fn job(
    client: &reqwest::Client,
    gateway: &str,
    key: &str,
    target: &Target,
    prompt: &str,
) -> reqwest::RequestBuilder {
    let req = request(client, gateway, key, target, false, prompt).header("prefer", "respond-async");
    match &target.background {
        Some(w) => req.header("x-spillway-workflow", w),
        None => req,
    }
}

/// Sends about `rps` requests per second to `gateway` until the returned task is aborted;
/// three in ten are background jobs when some targets take them.
pub fn spawn(gateway: String, key: String, targets: Vec<Target>, rps: f64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if targets.is_empty() || rps.is_nan() || rps <= 0.0 {
            return;
        }
        let client = reqwest::Client::builder().tcp_nodelay(true).build().unwrap_or_default();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rps));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let (target, stream, prompt) = {
                let mut rng = rand::rng();
                let background = rng.random_bool(0.3);
                let pool: Vec<&Target> = targets
                    .iter()
                    .filter(|t| t.background.is_some() == background)
                    .collect();
                let pool = if pool.is_empty() {
                    targets.iter().collect()
                } else {
                    pool
                };
                (
                    pool[rng.random_range(0..pool.len())].clone(),
                    rng.random_bool(0.4),
                    PROMPTS[rng.random_range(0..PROMPTS.len())],
                )
            };
            let req = if target.background.is_some() {
                job(&client, &gateway, &key, &target, prompt)
            } else {
                request(&client, &gateway, &key, &target, stream, prompt)
            };
            tokio::spawn(async move {
                if let Ok(resp) = req.send().await {
                    let _ = resp.bytes().await;
                }
            });
        }
    })
}
