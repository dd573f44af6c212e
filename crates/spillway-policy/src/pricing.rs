//! The pricing catalog (M1): USD per million tokens per model, each price with the date it
//! was checked and where. Parsed with unknown fields refused and validated with
//! file:line:field errors like the config; versioned by the hash of its text. The shipped
//! catalog (`policies/pricing.yaml`) is built in; a config's `pricing:` path replaces it.
//!
//! Costs are computed here from the tokens a provider reported, so that the arithmetic
//! lives in one pure place, with the breakdown that explains each figure.

use crate::config::Ctx;
use crate::error::{ConfigErrors, Result};
use serde::Deserialize;
use serde_saphyr::Spanned;
use sha2::{Digest, Sha256};
use spillway_wire::Format;
use spillway_wire::usage::Billable;
use std::collections::HashMap;

type S<T> = Spanned<T>;

/// The catalog built into the binary.
pub const BUILTIN: &str = include_str!("../../../policies/pricing.yaml");

/// M1: a price checked longer ago than this is stale evidence.
pub const STALE_AFTER_DAYS: i64 = 30;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCatalog {
    models: S<Vec<S<RawModel>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    model: S<String>,
    provider: S<String>,
    #[serde(default)]
    aliases: Vec<S<String>>,
    input: S<f64>,
    #[serde(default)]
    cached_input: Option<S<f64>>,
    #[serde(default)]
    cache_write: Option<S<f64>>,
    output: S<f64>,
    #[serde(default)]
    long_context: Option<S<RawTier>>,
    checked: S<String>,
    source: S<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTier {
    above_input_tokens: S<u64>,
    input: S<f64>,
    #[serde(default)]
    cached_input: Option<S<f64>>,
    #[serde(default)]
    cache_write: Option<S<f64>>,
    output: S<f64>,
}

/// USD per million tokens, for one band of prompt sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct Rates {
    pub input: f64,
    /// Prompt-cache reads; without a discount they cost `input`.
    pub cached_input: Option<f64>,
    /// Prompt-cache writes (Anthropic); without a price of their own they cost `input`.
    pub cache_write: Option<f64>,
    pub output: f64,
}

/// One model's prices.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPrice {
    pub model: String,
    pub provider: Format,
    pub aliases: Vec<String>,
    pub rates: Rates,
    /// Rates for prompts above `.0` input tokens (e.g. Gemini 2.5 Pro above 200k).
    pub long_context: Option<(u64, Rates)>,
    /// When the price was read: days since 1970-01-01, and as written.
    pub checked_day: i64,
    pub checked: String,
    pub source: String,
}

/// A validated catalog.
#[derive(Clone, Debug)]
pub struct Pricing {
    /// The first 12 hex digits of the SHA-256 of its text.
    pub version: String,
    /// Where it came from: `built-in` or the file's path.
    pub origin: String,
    pub models: Vec<ModelPrice>,
    by_name: HashMap<String, usize>,
}

/// A cost and how it was computed.
#[derive(Clone, Debug, PartialEq)]
pub struct Cost {
    pub usd: f64,
    /// E.g. `120 input × $0.15/M + 30 cached × $0.075/M + 12 output × $0.60/M`.
    pub breakdown: String,
}

fn day_number(date: &str) -> Option<i64> {
    let d = chrono::NaiveDate::parse_from_str(date, "%Y-%m-%d").ok()?;
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1)?;
    Some((d - epoch).num_days())
}

impl Rates {
    fn usd(&self, t: &Billable) -> f64 {
        let per = |n: u64, rate: f64| n as f64 * rate / 1_000_000.0;
        per(t.input, self.input)
            + per(t.cached_input, self.cached_input.unwrap_or(self.input))
            + per(t.cache_write, self.cache_write.unwrap_or(self.input))
            + per(t.output, self.output)
    }

    fn cost(&self, t: &Billable) -> Cost {
        let cached = self.cached_input.unwrap_or(self.input);
        let write = self.cache_write.unwrap_or(self.input);
        let usd = self.usd(t);
        let mut parts = vec![format!("{} input × ${}/M", t.input, self.input)];
        if t.cached_input > 0 {
            parts.push(format!("{} cached × ${cached}/M", t.cached_input));
        }
        if t.cache_write > 0 {
            parts.push(format!("{} cache write × ${write}/M", t.cache_write));
        }
        parts.push(format!("{} output × ${}/M", t.output, self.output));
        Cost {
            usd,
            breakdown: parts.join(" + "),
        }
    }
}

impl ModelPrice {
    /// The cost of `t`, at the long-context rates when the prompt is above their threshold.
    pub fn cost(&self, t: &Billable) -> Cost {
        match &self.long_context {
            Some((above, rates)) if t.total_input() > *above => {
                let mut c = rates.cost(t);
                c.breakdown = format!("{} (prompt above {above} tokens)", c.breakdown);
                c
            }
            _ => self.rates.cost(t),
        }
    }

    /// [`ModelPrice::cost`]'s figure alone: the request path prices every request up to
    /// three times and never shows the breakdown, whose number formatting costs more than
    /// the sum.
    pub fn usd(&self, t: &Billable) -> f64 {
        match &self.long_context {
            Some((above, rates)) if t.total_input() > *above => rates.usd(t),
            _ => self.rates.usd(t),
        }
    }

    /// Whether the price was checked more than [`STALE_AFTER_DAYS`] before `today` (days
    /// since the epoch).
    pub fn is_stale(&self, today: i64) -> bool {
        today - self.checked_day > STALE_AFTER_DAYS
    }
}

impl Pricing {
    /// The catalog built into the binary. It is validated by a test, so this cannot fail
    /// in a released build.
    pub fn builtin() -> Pricing {
        Pricing::parse("built-in pricing.yaml", BUILTIN)
            .unwrap_or_else(|e| panic!("the built-in pricing catalog is invalid: {e}"))
    }

    /// Parses and validates catalog `text`, read from `file` (named in errors).
    pub fn parse(file: &str, text: &str) -> Result<Pricing> {
        let raw: RawCatalog = serde_saphyr::from_str(text).map_err(|e| crate::config::yaml_error(file, text, &e))?;
        let mut cx = Ctx {
            file,
            errors: Vec::new(),
        };
        let mut models = Vec::new();
        let mut by_name = HashMap::new();
        if raw.models.value.is_empty() {
            cx.err(&raw.models, "models", "must list at least one model");
        }
        for (i, m) in raw.models.value.iter().enumerate() {
            let m = &m.value;
            let f = |s: &str| format!("models[{i}].{s}");
            let price = |cx: &mut Ctx, v: &S<f64>, field: &str| {
                if !v.value.is_finite() || v.value < 0.0 {
                    cx.err(v, f(field), "must be a non-negative number (USD per million tokens)");
                }
                v.value
            };
            let provider = match m.provider.value.as_str() {
                "openai" => Format::OpenAi,
                "anthropic" => Format::Anthropic,
                "gemini" => Format::Gemini,
                other => {
                    cx.err(
                        &m.provider,
                        f("provider"),
                        format!("`{other}` is not one of openai, anthropic, gemini"),
                    );
                    Format::OpenAi
                }
            };
            let rates = Rates {
                input: price(&mut cx, &m.input, "input"),
                cached_input: m.cached_input.as_ref().map(|v| price(&mut cx, v, "cached_input")),
                cache_write: m.cache_write.as_ref().map(|v| price(&mut cx, v, "cache_write")),
                output: price(&mut cx, &m.output, "output"),
            };
            let long_context = m.long_context.as_ref().map(|t| {
                let t = &t.value;
                let tier = Rates {
                    input: price(&mut cx, &t.input, "long_context.input"),
                    cached_input: t
                        .cached_input
                        .as_ref()
                        .map(|v| price(&mut cx, v, "long_context.cached_input")),
                    cache_write: t
                        .cache_write
                        .as_ref()
                        .map(|v| price(&mut cx, v, "long_context.cache_write")),
                    output: price(&mut cx, &t.output, "long_context.output"),
                };
                if t.above_input_tokens.value == 0 {
                    cx.err(
                        &t.above_input_tokens,
                        f("long_context.above_input_tokens"),
                        "must be greater than 0",
                    );
                }
                (t.above_input_tokens.value, tier)
            });
            let checked_day = match day_number(m.checked.value.trim()) {
                Some(d) => d,
                None => {
                    cx.err(
                        &m.checked,
                        f("checked"),
                        format!("`{}` is not a date YYYY-MM-DD", m.checked.value),
                    );
                    0
                }
            };
            let source = m.source.value.trim();
            if !(source.starts_with("https://") || source.starts_with("http://")) {
                cx.err(
                    &m.source,
                    f("source"),
                    "must be the URL the price was read from (http:// or https://)",
                );
            }
            for (j, name) in std::iter::once(&m.model).chain(m.aliases.iter()).enumerate() {
                let field = if j == 0 {
                    f("model")
                } else {
                    f(&format!("aliases[{}]", j - 1))
                };
                if name.value.trim().is_empty() {
                    cx.err(name, field, "must not be empty");
                } else if by_name.insert(name.value.clone(), models.len()).is_some() {
                    cx.err(name, field, format!("`{}` is priced twice", name.value));
                }
            }
            models.push(ModelPrice {
                model: m.model.value.clone(),
                provider,
                aliases: m.aliases.iter().map(|a| a.value.clone()).collect(),
                rates,
                long_context,
                checked_day,
                checked: m.checked.value.trim().to_owned(),
                source: source.to_owned(),
            });
        }
        if !cx.errors.is_empty() {
            return Err(ConfigErrors(cx.errors));
        }
        let digest = Sha256::digest(text.as_bytes());
        Ok(Pricing {
            version: hex::encode(&digest[..6]),
            origin: file.to_owned(),
            models,
            by_name,
        })
    }

    /// The price of `model`: by its name or an alias, else by the name without a dated
    /// snapshot suffix (`claude-sonnet-4-5-20250929`, `gpt-4o-2024-08-06`), else by the
    /// name without a provider's resource prefix (`models/gemini-2.5-flash`).
    pub fn price(&self, model: &str) -> Option<&ModelPrice> {
        let model = model.strip_prefix("models/").unwrap_or(model);
        if let Some(&i) = self.by_name.get(model) {
            return self.models.get(i);
        }
        let undated = strip_date(model)?;
        self.by_name.get(undated).and_then(|&i| self.models.get(i))
    }

    /// Models whose price is older than [`STALE_AFTER_DAYS`] on `today`.
    pub fn stale(&self, today: i64) -> impl Iterator<Item = &ModelPrice> {
        self.models.iter().filter(move |m| m.is_stale(today))
    }
}

/// `name-YYYY-MM-DD` or `name-YYYYMMDD` without its date.
fn strip_date(model: &str) -> Option<&str> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some((head, tail)) = model.rsplit_once('-')
        && tail.len() == 8
        && digits(tail)
    {
        return Some(head);
    }
    let mut it = model.rsplitn(4, '-');
    let (d, m, y, head) = (it.next()?, it.next()?, it.next()?, it.next()?);
    (d.len() == 2 && m.len() == 2 && y.len() == 4 && digits(d) && digits(m) && digits(y)).then_some(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "models:
  - model: m-cheap
    provider: openai
    aliases: [m-cheap-latest]
    input: 0.15
    cached_input: 0.075
    output: 0.6
    checked: 2026-11-20
    source: https://example.com/pricing
  - model: claude-x
    provider: anthropic
    input: 3
    cached_input: 0.3
    cache_write: 3.75
    output: 15
    long_context: {above_input_tokens: 200000, input: 6, cached_input: 0.6, cache_write: 7.5, output: 22.5}
    checked: 2026-10-01
    source: https://example.com/claude
";

    fn b(input: u64, cached: u64, write: u64, output: u64) -> Billable {
        Billable {
            input,
            cached_input: cached,
            cache_write: write,
            output,
        }
    }

    #[test]
    fn m1_the_shipped_catalog_is_valid_and_dated() {
        // spec: M1
        let p = Pricing::builtin();
        assert!(p.models.len() >= 20, "{} models", p.models.len());
        for m in &p.models {
            assert!(m.source.starts_with("https://"), "{}", m.model);
            assert!(m.checked_day > day_number("2025-01-01").unwrap(), "{}", m.model);
        }
        for (model, provider) in [
            ("gpt-4o-mini", Format::OpenAi),
            ("claude-sonnet-4-5", Format::Anthropic),
            ("gemini-2.5-flash", Format::Gemini),
            ("text-embedding-3-small", Format::OpenAi),
        ] {
            assert_eq!(p.price(model).map(|m| m.provider), Some(provider), "{model}");
        }
        assert_eq!(p.version.len(), 12);
    }

    #[test]
    fn m1_cache_discounts_against_hand_computed_figures() {
        // spec: M1
        let p = Pricing::parse("p.yaml", ONE).unwrap();
        // 1,000 uncached × 0.15 + 4,000 cached × 0.075 + 500 output × 0.6, per million:
        // 0.00015 + 0.0003 + 0.0003 = 0.00075.
        let c = p.price("m-cheap").unwrap().cost(&b(1_000, 4_000, 0, 500));
        assert!((c.usd - 0.00075).abs() < 1e-12, "{}", c.usd);
        assert_eq!(
            c.breakdown,
            "1000 input × $0.15/M + 4000 cached × $0.075/M + 500 output × $0.6/M"
        );
        // Anthropic: 100 × 3 + 10,000 read × 0.3 + 2,000 written × 3.75 + 300 × 15, per
        // million: 0.0003 + 0.003 + 0.0075 + 0.0045 = 0.0153.
        let c = p.price("claude-x").unwrap().cost(&b(100, 10_000, 2_000, 300));
        assert!((c.usd - 0.0153).abs() < 1e-12, "{}", c.usd);
        // Above 200k prompt tokens the long-context rates apply to the whole request.
        let c = p.price("claude-x").unwrap().cost(&b(150_000, 60_000, 0, 1_000));
        let want = (150_000.0 * 6.0 + 60_000.0 * 0.6 + 1_000.0 * 22.5) / 1e6;
        assert!((c.usd - want).abs() < 1e-12, "{} vs {want}", c.usd);
        assert!(c.breakdown.ends_with("(prompt above 200000 tokens)"), "{}", c.breakdown);
        // The request path's figure without the breakdown is the same figure.
        for (model, t) in [
            ("m-cheap", b(1_000, 4_000, 0, 500)),
            ("claude-x", b(100, 10_000, 2_000, 300)),
            ("claude-x", b(150_000, 60_000, 0, 1_000)),
        ] {
            let m = p.price(model).unwrap();
            assert_eq!(m.usd(&t).to_bits(), m.cost(&t).usd.to_bits(), "{model}");
        }
    }

    #[test]
    fn m1_names_aliases_and_dated_snapshots() {
        // spec: M1
        let p = Pricing::parse("p.yaml", ONE).unwrap();
        for name in ["m-cheap", "m-cheap-latest", "m-cheap-2024-07-18", "models/m-cheap"] {
            assert_eq!(p.price(name).map(|m| m.model.as_str()), Some("m-cheap"), "{name}");
        }
        assert_eq!(p.price("claude-x-20250929").map(|m| m.model.as_str()), Some("claude-x"));
        assert!(p.price("m-unpriced").is_none());
        assert!(p.price("m-cheap-extra").is_none());
    }

    #[test]
    fn m1_stale_prices_are_found() {
        // spec: M1
        let p = Pricing::parse("p.yaml", ONE).unwrap();
        let today = day_number("2026-12-01").unwrap();
        let stale: Vec<_> = p.stale(today).map(|m| m.model.as_str()).collect();
        assert_eq!(stale, ["claude-x"]);
    }

    #[test]
    fn m1_bad_catalogs_name_file_line_and_field() {
        // spec: M1
        let bad = ONE
            .replace("output: 0.6", "output: -1")
            .replace("checked: 2026-10-01", "checked: last week")
            .replace("provider: anthropic", "provider: azure");
        let e = Pricing::parse("pricing.yaml", &bad).unwrap_err().to_string();
        assert!(e.contains("pricing.yaml:7:") && e.contains("models[0].output"), "{e}");
        assert!(e.contains("models[1].checked") && e.contains("last week"), "{e}");
        assert!(e.contains("models[1].provider") && e.contains("azure"), "{e}");
        let dup = ONE.replace("model: claude-x", "model: m-cheap-latest");
        let e = Pricing::parse("pricing.yaml", &dup).unwrap_err().to_string();
        assert!(e.contains("models[1].model") && e.contains("priced twice"), "{e}");
        let unknown = ONE.replace("    output: 15\n", "    output: 15\n    outptu: 3\n");
        let e = Pricing::parse("pricing.yaml", &unknown).unwrap_err().to_string();
        assert!(e.contains("pricing.yaml:") && e.contains("outptu"), "{e}");
        // The version follows the content.
        let a = Pricing::parse("p.yaml", ONE).unwrap().version;
        let b = Pricing::parse("p.yaml", &ONE.replace("0.15", "0.16")).unwrap().version;
        assert_ne!(a, b);
    }
}
