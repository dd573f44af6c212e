//! The zero-config default: a gateway that works the moment it starts. For each provider
//! whose key is in the environment (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`,
//! `GEMINI_API_KEY`) a real channel; for the others, channels on an in-process simulator.
//! A fresh demo gateway key is made for each start and shown once.

use crate::Result;
use rand::Rng;
use spillway_policy::{
    Channel, Config, DEFAULT_ATTEMPT_TIMEOUT_MS, DEFAULT_LISTEN, DEFAULT_MAX_BODY_BYTES, Key, Owner, hash_secret,
};
use spillway_sim::traffic::Target;
use spillway_sim::{Behavior, Fault, RandomFault, Scenario, SimHandle};
use spillway_wire::Format;
use std::collections::BTreeMap;

pub struct Embedded {
    pub config: Config,
    /// The demo key's secret: print it once, keep it nowhere.
    pub demo_key: String,
    /// The in-process simulator, when any format is simulated.
    pub sim: Option<SimHandle>,
    /// Simulated models, for demo traffic (never sent to real providers: that costs money).
    pub simulated: Vec<Target>,
}

struct Provider {
    format: Format,
    env: &'static str,
    base_url: &'static str,
    sim_models: &'static [&'static str],
}

const PROVIDERS: &[Provider] = &[
    Provider {
        format: Format::OpenAi,
        env: "OPENAI_API_KEY",
        base_url: "https://api.openai.com",
        sim_models: &["gpt-4o-mini", "gpt-4.1"],
    },
    Provider {
        format: Format::Anthropic,
        env: "ANTHROPIC_API_KEY",
        base_url: "https://api.anthropic.com",
        sim_models: &["claude-haiku-4-5", "claude-sonnet-4-5"],
    },
    Provider {
        format: Format::Gemini,
        env: "GEMINI_API_KEY",
        base_url: "https://generativelanguage.googleapis.com",
        sim_models: &["gemini-2.5-flash", "gemini-2.5-pro"],
    },
];

/// What the demo's primary channels inject: 3 % overload, 1 % pacing with a 2 s hint.
pub fn demo_faults() -> Vec<RandomFault> {
    let status = |status: u16, retry_after_s: Option<u64>| Fault::Status {
        status,
        error: None,
        retry_after_s,
        retry_after_date_s: None,
        retry_delay: None,
        message: None,
    };
    vec![
        RandomFault {
            fault: status(503, None),
            probability: 0.03,
        },
        RandomFault {
            fault: status(429, Some(2)),
            probability: 0.01,
        },
    ]
}

/// Starts demo traffic against the gateway at `url`, to the simulated models only.
pub fn demo_traffic(url: String, e: &Embedded, rps: f64) -> tokio::task::JoinHandle<()> {
    spillway_sim::traffic::spawn(url, e.demo_key.clone(), e.simulated.clone(), rps)
}

/// Builds the embedded config; starts the simulator if any provider has no key.
pub async fn build(env: &dyn Fn(&str) -> Option<String>) -> Result<Embedded> {
    let simulated_formats: Vec<&Provider> = PROVIDERS
        .iter()
        .filter(|p| env(p.env).is_none_or(|v| v.is_empty()))
        .collect();
    let sim = if simulated_formats.is_empty() {
        None
    } else {
        let mut channels = BTreeMap::new();
        for p in &simulated_formats {
            // Latency and token pace of a quick real model, so charts look like real traffic.
            let healthy = Behavior {
                latency_ms: 120,
                tokens_per_second: Some(80.0),
                output_tokens: 24,
                ..Behavior::default()
            };
            // The primary has a bad day now and then: a few 503s and an occasional 429 with
            // a wait hint, which the gateway absorbs by failing over (D2, D6).
            let flaky = Behavior {
                random_faults: demo_faults(),
                ..healthy.clone()
            };
            channels.insert(format!("{}-sim", p.format), flaky);
            channels.insert(format!("{}-sim-b", p.format), healthy);
        }
        let addr = "127.0.0.1:0".parse().map_err(|_| crate::Error::NoDataDir)?;
        Some(spillway_sim::start(addr, Scenario { channels }).await?)
    };

    let mut channels = Vec::new();
    let mut simulated = Vec::new();
    for p in PROVIDERS {
        match env(p.env).filter(|v| !v.is_empty()) {
            Some(key) => channels.push(Channel {
                name: p.format.to_string(),
                format: p.format,
                base_url: p.base_url.to_owned(),
                api_key: Some(key),
                models: vec!["*".to_owned()],
                max_concurrency: 16,
                weight: 1,
                priority: 0,
                timeout_ms: None,
            }),
            None => {
                // A primary and a backup in one tier (weights 3:1), so demo traffic shows
                // spreading and failover; both start healthy (faults are the scenario's).
                for (suffix, weight) in [("sim", 3), ("sim-b", 1)] {
                    let name = format!("{}-{suffix}", p.format);
                    let base_url = sim.as_ref().map(|s| s.channel_url(&name)).unwrap_or_default();
                    channels.push(Channel {
                        name,
                        format: p.format,
                        base_url,
                        api_key: None,
                        models: p.sim_models.iter().map(|m| m.to_string()).collect(),
                        max_concurrency: 64,
                        weight,
                        priority: 0,
                        timeout_ms: None,
                    });
                }
                simulated.extend(p.sim_models.iter().map(|m| Target {
                    format: p.format,
                    model: m.to_string(),
                }));
            }
        }
    }

    let demo_key = format!("sk-spillway-demo-{:032x}", rand::rng().random::<u128>());
    let config = Config {
        listen: DEFAULT_LISTEN.parse().map_err(|_| crate::Error::NoDataDir)?,
        listen_warning: None,
        ledger: None,
        max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        attempt_timeout_ms: DEFAULT_ATTEMPT_TIMEOUT_MS,
        max_attempts: spillway_policy::DEFAULT_MAX_ATTEMPTS,
        total_deadline_ms: spillway_policy::DEFAULT_TOTAL_DEADLINE_MS,
        capacity_wait_ms: spillway_policy::MAX_CAPACITY_WAIT_MS,
        channels,
        keys: vec![Key {
            name: "demo".into(),
            owner: "demo".into(),
            secret: hash_secret(&demo_key),
            rpm: None,
            max_concurrency: None,
            spend_limit_usd: None,
        }],
        owners: vec![Owner {
            name: "demo".into(),
            balance_usd: 100.0,
        }],
    };
    Ok(Embedded {
        config,
        demo_key,
        sim,
        simulated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn simulated_unless_a_provider_key_is_set() {
        let e = build(&|_| None).await.unwrap();
        // A primary and a backup per simulated provider.
        assert_eq!(e.config.channels.len(), 6);
        assert!(e.config.channels.iter().any(|c| c.name == "openai-sim-b"));
        assert!(e.sim.is_some());
        assert!(
            e.config
                .channels
                .iter()
                .all(|c| c.base_url.starts_with("http://127.0.0.1:"))
        );
        assert_eq!(e.config.keys[0].secret, hash_secret(&e.demo_key));

        let e = build(&|k| (k == "ANTHROPIC_API_KEY").then(|| "sk-ant-test".to_owned()))
            .await
            .unwrap();
        let real: Vec<_> = e.config.channels.iter().filter(|c| c.api_key.is_some()).collect();
        assert_eq!(real.len(), 1);
        assert_eq!(e.config.channels.len(), 5);
        assert_eq!(real[0].base_url, "https://api.anthropic.com");
        assert!(real[0].serves("claude-opus-4-1"));
        assert!(
            e.simulated.iter().all(|t| t.format != Format::Anthropic),
            "no demo traffic to a paid provider"
        );
    }
}
