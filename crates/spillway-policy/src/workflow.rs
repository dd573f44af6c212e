//! Workflow policies (J8, K1): one YAML file per product workflow, in the queueing playbook's
//! `ai_api_queueing_strategy` shape, saying how long its work may wait, how often it is
//! retried, which lane takes it when that is spent, and which fallback routes it approves.
//! Parsed with unknown fields refused and validated with file:line:field errors like the
//! config; versioned by the hash of its text, so every job can record the policy it ran under.
//! The JSON Schema editors check the files against is generated from the same raw types.
//!
//! Every field a file leaves out takes the built-in `default` workflow's value
//! ([`BUILTIN_DEFAULT`]), so a gateway without workflow files still serves interactive and
//! background work.

use crate::config::{Ctx, yaml_error};
use crate::error::{ConfigErrors, Result};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_saphyr::Spanned;
use sha2::{Digest, Sha256};
use spillway_wire::Format;
use std::ops::RangeInclusive;

type S<T> = Spanned<T>;

/// The built-in workflow `default`: what a request runs under when neither its
/// `x-spillway-workflow` header nor its key names a workflow. A field a policy file leaves out
/// takes the value written here (the `Default` impls below agree with it; a test checks).
pub const BUILTIN_DEFAULT: &str = r#"# Built into the gateway: the workflow of requests that name none.
workflow: default
description: "Built-in: interactive requests and background jobs without a workflow of their own"
ai_api_queueing_strategy:
  classify:
    fields: [http_status, provider_error_type, retry_after_ms, limit_dimension, route_key, visibility_state]
  lanes:
    interactive_admission:
      max_wait_ms: 10000
      max_attempts: 3
      # Sheds nothing: without a workflow of its own, no request is less important than another.
      shed_priority_below: low
      max_length: 1024
    stream_recovery:
      max_length: 256
    background_retry:
      max_queue_age_ms: 600000
      max_attempts: 3
      require_idempotency_key: false
      max_length: 10000
      max_backoff_ms: 30000
      attempt_timeout_ms: 60000
      priority: normal
    owner_review:
      enter_when:
        - quota_or_spend_exhausted
        - permission_denied
        - data_boundary_mismatch
        - fallback_contract_unknown
        - unknown_signal
      max_length: 1000
    dead_letter:
      enter_when: [max_attempts_exhausted, max_queue_age_exceeded, partial_output_committed, outcome_unknown]
      max_length: 10000
  backpressure:
    concurrency_key: [owner_key, provider, requested_model, endpoint_type]
    release_order: [ready_at, priority, created_at]
    max_concurrency: 4
  fallback:
    allowed_before_first_token: true
    require_equivalent_tools: true
    require_schema_match: true
    require_cost_cap: true
    require_data_boundary_match: true
    # No route is approved, so nothing falls back to another model unless a policy says so.
    approved_quality_classes: []
    routes: []
  fail_closed_when:
    - retry_after_exceeds_deadline
    - partial_output_committed
    - quota_or_spend_exhausted
    - fallback_contract_mismatch
"#;

/// The section every queueing setting sits under, as in the playbook's template.
const STRATEGY: &str = "ai_api_queueing_strategy";
const MAX_DESCRIPTION_CHARS: usize = 500;
const ATTEMPTS: RangeInclusive<u32> = 1..=20;
const LANE_LENGTH: RangeInclusive<u32> = 1..=1_000_000;
/// J4: the only release order Spillway has.
const RELEASE_ORDER: [ReleaseField; 3] = [ReleaseField::ReadyAt, ReleaseField::Priority, ReleaseField::CreatedAt];

// The raw file shape. Optional fields carry no `#[serde(default)]`: serde reads a missing
// `Option` as `None` anyway, and the attribute would put `"default": null` into the schema.
// `Spanned` has no schema of its own, so each field names the type it stands for.

/// A workflow policy: how the gateway queues, retries, sheds and falls back for one product
/// workflow. Every setting under `ai_api_queueing_strategy` is optional and defaults to the
/// built-in `default` workflow's.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "WorkflowPolicy")]
struct RawWorkflowFile {
    /// The workflow's name, as the `x-spillway-workflow` header and a key's `workflow:` give it:
    /// 1-64 lower-case letters, digits, '_' or '-'.
    #[schemars(with = "String", pattern(r"^[a-z0-9_-]{1,64}$"))]
    workflow: S<String>,
    /// What the workflow is for, shown in the console (at most 500 characters).
    #[schemars(with = "Option<String>", length(max = 500))]
    description: Option<S<String>>,
    /// The queueing playbook's strategy: classification, lanes, backpressure, fallback contract,
    /// fail-closed conditions and targets.
    #[schemars(with = "Option<RawStrategy>")]
    ai_api_queueing_strategy: Option<S<RawStrategy>>,
}

/// How the workflow's work waits, is retried, is held back and may fall back.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "QueueingStrategy")]
struct RawStrategy {
    /// Which fields of the normalised provider signal the queue decides on (E1).
    #[schemars(with = "Option<RawClassify>")]
    classify: Option<S<RawClassify>>,
    /// The five lanes work can be in (J1), each with its limits.
    #[schemars(with = "Option<RawLanes>")]
    lanes: Option<S<RawLanes>>,
    /// How queued work is held back before anything falls back (J4, J5).
    #[schemars(with = "Option<RawBackpressure>")]
    backpressure: Option<S<RawBackpressure>>,
    /// The fallback contract (K1): whether, when and where work may move to another route.
    #[schemars(with = "Option<RawFallback>")]
    fallback: Option<S<RawFallback>>,
    /// Conditions on which work fails at once with a clear error instead of waiting, being
    /// retried or falling back. Each at most once.
    #[schemars(with = "Option<Vec<FailClosed>>", extend("uniqueItems" = true))]
    fail_closed_when: Option<S<Vec<S<FailClosed>>>>,
    /// Targets the console and the route breakers measure the workflow against (G1).
    #[schemars(with = "Option<RawSlo>")]
    slo: Option<S<RawSlo>>,
}

/// The normalised signal fields the queue decides on. The gateway records all six whatever
/// this lists; the list documents which ones the workflow's decisions rest on.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Classify")]
struct RawClassify {
    /// Fields of the normalised provider signal, each at most once.
    #[schemars(with = "Option<Vec<ClassifyField>>", extend("uniqueItems" = true))]
    fields: Option<S<Vec<S<ClassifyField>>>>,
}

/// The lanes (J1). Each has a maximum length: when it is full, new work gets 429 with an
/// estimated restart time (J7).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Lanes")]
struct RawLanes {
    /// Requests whose caller is waiting and has seen no output yet.
    #[schemars(with = "Option<RawInteractive>")]
    interactive_admission: Option<S<RawInteractive>>,
    /// Streams cut off before their first token, waiting to be sent again.
    #[schemars(with = "Option<RawStreamRecovery>")]
    stream_recovery: Option<S<RawStreamRecovery>>,
    /// Background jobs (`Prefer: respond-async` or the job API) waiting for their next attempt.
    #[schemars(with = "Option<RawBackground>")]
    background_retry: Option<S<RawBackground>>,
    /// Work held for a person: spend, quota, permission, data boundary or an unknown fallback
    /// contract (J6, K3).
    #[schemars(with = "Option<RawReview>")]
    owner_review: Option<S<RawReview>>,
    /// Work whose safe retries are spent, kept for a replay that names an owner and a reason
    /// (J6, L1).
    #[schemars(with = "Option<RawDeadLetter>")]
    dead_letter: Option<S<RawDeadLetter>>,
}

/// Requests a caller is waiting on, before any output.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "InteractiveAdmissionLane")]
struct RawInteractive {
    /// How long a request may wait for capacity and retries before it gets a controlled error,
    /// in milliseconds (1-600000).
    #[schemars(with = "Option<u64>", range(min = 1, max = 600_000))]
    max_wait_ms: Option<S<u64>>,
    /// Upstream attempts per request, the first one included (1-20).
    #[schemars(with = "Option<u32>", range(min = 1, max = 20))]
    max_attempts: Option<S<u32>>,
    /// J5: while interactive requests wait for channel capacity, this workflow's background
    /// jobs of a lower priority than this are held back (not released); `low` holds
    /// nothing back.
    #[schemars(with = "Option<Priority>")]
    shed_priority_below: Option<S<Priority>>,
    /// Requests the lane holds at once (1-1000000).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1_000_000))]
    max_length: Option<S<u32>>,
}

/// Streams cut off before their first token (H2, H4).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "StreamRecoveryLane")]
struct RawStreamRecovery {
    /// Streams the lane holds at once (1-1000000).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1_000_000))]
    max_length: Option<S<u32>>,
}

/// Background jobs between attempts.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "BackgroundRetryLane")]
struct RawBackground {
    /// A job not finished this long after it was submitted goes to dead letter, in milliseconds
    /// (1000 to 604800000, seven days).
    #[schemars(with = "Option<u64>", range(min = 1_000, max = 604_800_000))]
    max_queue_age_ms: Option<S<u64>>,
    /// Upstream attempts per job, the first one included (1-20).
    #[schemars(with = "Option<u32>", range(min = 1, max = 20))]
    max_attempts: Option<S<u32>>,
    /// Refuse jobs without an `Idempotency-Key`, so that no job is ever run twice.
    #[schemars(with = "Option<bool>")]
    require_idempotency_key: Option<S<bool>>,
    /// Jobs the lane holds at once (1-1000000).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1_000_000))]
    max_length: Option<S<u32>>,
    /// Longest wait between two attempts when the provider gives no wait hint, in milliseconds
    /// (100-3600000).
    #[schemars(with = "Option<u64>", range(min = 100, max = 3_600_000))]
    max_backoff_ms: Option<S<u64>>,
    /// How long one attempt may take, in milliseconds (1000-600000).
    #[schemars(with = "Option<u64>", range(min = 1_000, max = 600_000))]
    attempt_timeout_ms: Option<S<u64>>,
    /// The priority of the workflow's jobs: among jobs ready at once the higher goes first (J4),
    /// and the lower is shed first (J5).
    #[schemars(with = "Option<Priority>")]
    priority: Option<S<Priority>>,
}

/// Work waiting for an owner's decision (K3).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "OwnerReviewLane")]
struct RawReview {
    /// Signals that send work to owner review instead of retrying it, each at most once.
    #[schemars(with = "Option<Vec<ReviewTrigger>>", extend("uniqueItems" = true))]
    enter_when: Option<S<Vec<S<ReviewTrigger>>>>,
    /// Items the lane holds at once (1-1000000).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1_000_000))]
    max_length: Option<S<u32>>,
}

/// Work whose safe retries are spent (L1).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "DeadLetterLane")]
struct RawDeadLetter {
    /// Conditions that move work to dead letter, each at most once.
    #[schemars(with = "Option<Vec<DeadLetterTrigger>>", extend("uniqueItems" = true))]
    enter_when: Option<S<Vec<S<DeadLetterTrigger>>>>,
    /// Items the lane holds at once (1-1000000).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1_000_000))]
    max_length: Option<S<u32>>,
}

/// Holding work back comes before falling back (J5).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Backpressure")]
struct RawBackpressure {
    /// What running work is counted per (J4): at least one of owner_key, provider,
    /// requested_model and endpoint_type, each at most once.
    #[schemars(
        with = "Option<Vec<ConcurrencyField>>",
        length(min = 1),
        extend("uniqueItems" = true)
    )]
    concurrency_key: Option<S<Vec<S<ConcurrencyField>>>>,
    /// The order queued work is released in. Spillway releases by ready_at, then priority,
    /// then created_at (J4); only that order is accepted.
    #[schemars(with = "Option<Vec<ReleaseField>>")]
    release_order: Option<S<Vec<S<ReleaseField>>>>,
    /// The workflow's work running at once per concurrency key (1-1024).
    #[schemars(with = "Option<u32>", range(min = 1, max = 1024))]
    max_concurrency: Option<S<u32>>,
}

/// The fallback contract (K1). A request falls back only to a route listed here, only before
/// its first token, and only while every required part of the contract holds; when one is
/// unknown, background work goes to owner review and interactive work fails closed.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Fallback")]
struct RawFallback {
    /// Whether a request may fall back before its first token is sent; never after it (H2).
    #[schemars(with = "Option<bool>")]
    allowed_before_first_token: Option<S<bool>>,
    /// Use only routes marked `equivalent_tools: true`.
    #[schemars(with = "Option<bool>")]
    require_equivalent_tools: Option<S<bool>>,
    /// Use only routes marked `schema_match: true`.
    #[schemars(with = "Option<bool>")]
    require_schema_match: Option<S<bool>>,
    /// Every route must state a `max_cost_usd`.
    #[schemars(with = "Option<bool>")]
    require_cost_cap: Option<S<bool>>,
    /// Use only routes inside `data_boundary`.
    #[schemars(with = "Option<bool>")]
    require_data_boundary_match: Option<S<bool>>,
    /// Quality classes approved for this workflow; each route's `quality_class` must be one.
    #[schemars(
        with = "Option<Vec<String>>",
        extend("uniqueItems" = true),
        inner(pattern(r"^[a-z0-9_-]{1,64}$"))
    )]
    approved_quality_classes: Option<S<Vec<S<String>>>>,
    /// The providers and regions the workflow's work must stay within.
    #[schemars(with = "Option<RawDataBoundary>")]
    data_boundary: Option<S<RawDataBoundary>>,
    /// The approved fallback routes, in the order they are tried. None: the workflow never
    /// falls back.
    #[schemars(with = "Option<Vec<RawRoute>>")]
    routes: Option<S<Vec<S<RawRoute>>>>,
}

/// Where the workflow's work may be sent; a dimension left out is not constrained.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "DataBoundary")]
struct RawDataBoundary {
    /// Provider formats the work may be sent to, each at most once.
    #[schemars(with = "Option<Vec<Provider>>", extend("uniqueItems" = true))]
    providers: Option<S<Vec<S<Provider>>>>,
    /// Regions the work may be processed in (1-32 lower-case letters, digits or '-', e.g. eu).
    #[schemars(
        with = "Option<Vec<String>>",
        extend("uniqueItems" = true),
        inner(pattern(r"^[a-z0-9-]{1,32}$"))
    )]
    regions: Option<S<Vec<S<String>>>>,
}

/// One approved fallback route.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "FallbackRoute")]
struct RawRoute {
    /// The route a request asked for, `format/model` (e.g. openai/gpt-4.1).
    #[schemars(with = "String", pattern(r"^(openai|anthropic|gemini)/.+$"))]
    from: S<String>,
    /// The route it may fall back to, in the same format (e.g. openai/gpt-4o-mini).
    #[schemars(with = "String", pattern(r"^(openai|anthropic|gemini)/.+$"))]
    to: S<String>,
    /// The quality class of `to`; it must be one of `approved_quality_classes`.
    #[schemars(with = "String", pattern(r"^[a-z0-9_-]{1,64}$"))]
    quality_class: S<String>,
    /// `to` was checked to handle the workflow's tools the same way. Unset: not known (false).
    #[schemars(with = "Option<bool>")]
    equivalent_tools: Option<S<bool>>,
    /// `to` was checked to keep the workflow's output schema. Unset: not known (false).
    #[schemars(with = "Option<bool>")]
    schema_match: Option<S<bool>>,
    /// The most a request may cost on `to`, in USD (greater than 0).
    #[schemars(with = "Option<f64>", extend("exclusiveMinimum" = 0))]
    max_cost_usd: Option<S<f64>>,
}

/// The workflow's targets.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Slo")]
struct RawSlo {
    /// Target P95 wait before the first upstream attempt, in milliseconds. Recorded with the
    /// policy; the route breakers' wait trigger (G1) takes its SLO from the gateway config's
    /// `control.route_wait_slo_ms`, per route.
    #[schemars(with = "Option<u64>", range(min = 1))]
    wait_p95_ms: Option<S<u64>>,
    /// Target P95 time from receipt to a finished result, in milliseconds.
    #[schemars(with = "Option<u64>", range(min = 1))]
    completion_p95_ms: Option<S<u64>>,
}

/// How urgent work is: low, normal, high, urgent. Among jobs ready at once the higher goes first
/// (J4); when a lane fills, the lower is shed first (J5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
    Urgent,
}

impl Priority {
    pub const ALL: [Priority; 4] = [Priority::Low, Priority::Normal, Priority::High, Priority::Urgent];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
            Priority::Urgent => "urgent",
        }
    }

    /// The priority [`Priority::as_str`] spells `s`.
    pub fn parse(s: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// A field of the normalised provider signal (E1): http_status, provider_error_type,
/// retry_after_ms, limit_dimension, route_key, visibility_state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClassifyField {
    HttpStatus,
    ProviderErrorType,
    RetryAfterMs,
    LimitDimension,
    RouteKey,
    VisibilityState,
}

impl ClassifyField {
    pub const ALL: [ClassifyField; 6] = [
        ClassifyField::HttpStatus,
        ClassifyField::ProviderErrorType,
        ClassifyField::RetryAfterMs,
        ClassifyField::LimitDimension,
        ClassifyField::RouteKey,
        ClassifyField::VisibilityState,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ClassifyField::HttpStatus => "http_status",
            ClassifyField::ProviderErrorType => "provider_error_type",
            ClassifyField::RetryAfterMs => "retry_after_ms",
            ClassifyField::LimitDimension => "limit_dimension",
            ClassifyField::RouteKey => "route_key",
            ClassifyField::VisibilityState => "visibility_state",
        }
    }
}

/// A signal that sends work to owner review (J6): quota or spend exhausted, permission denied,
/// data boundary mismatch, fallback contract unknown, or a provider answer the gateway cannot
/// classify (unknown_signal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReviewTrigger {
    QuotaOrSpendExhausted,
    PermissionDenied,
    DataBoundaryMismatch,
    FallbackContractUnknown,
    UnknownSignal,
}

impl ReviewTrigger {
    pub const ALL: [ReviewTrigger; 5] = [
        ReviewTrigger::QuotaOrSpendExhausted,
        ReviewTrigger::PermissionDenied,
        ReviewTrigger::DataBoundaryMismatch,
        ReviewTrigger::FallbackContractUnknown,
        ReviewTrigger::UnknownSignal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReviewTrigger::QuotaOrSpendExhausted => "quota_or_spend_exhausted",
            ReviewTrigger::PermissionDenied => "permission_denied",
            ReviewTrigger::DataBoundaryMismatch => "data_boundary_mismatch",
            ReviewTrigger::FallbackContractUnknown => "fallback_contract_unknown",
            ReviewTrigger::UnknownSignal => "unknown_signal",
        }
    }
}

/// A condition that moves work to dead letter (J6): attempts spent, too old, partial output
/// already committed, or an outcome nobody knows (a restart during the call, I4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterTrigger {
    MaxAttemptsExhausted,
    MaxQueueAgeExceeded,
    PartialOutputCommitted,
    OutcomeUnknown,
}

impl DeadLetterTrigger {
    pub const ALL: [DeadLetterTrigger; 4] = [
        DeadLetterTrigger::MaxAttemptsExhausted,
        DeadLetterTrigger::MaxQueueAgeExceeded,
        DeadLetterTrigger::PartialOutputCommitted,
        DeadLetterTrigger::OutcomeUnknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterTrigger::MaxAttemptsExhausted => "max_attempts_exhausted",
            DeadLetterTrigger::MaxQueueAgeExceeded => "max_queue_age_exceeded",
            DeadLetterTrigger::PartialOutputCommitted => "partial_output_committed",
            DeadLetterTrigger::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// A part of the key running work is counted per (J4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyField {
    OwnerKey,
    Provider,
    RequestedModel,
    EndpointType,
}

impl ConcurrencyField {
    pub const ALL: [ConcurrencyField; 4] = [
        ConcurrencyField::OwnerKey,
        ConcurrencyField::Provider,
        ConcurrencyField::RequestedModel,
        ConcurrencyField::EndpointType,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConcurrencyField::OwnerKey => "owner_key",
            ConcurrencyField::Provider => "provider",
            ConcurrencyField::RequestedModel => "requested_model",
            ConcurrencyField::EndpointType => "endpoint_type",
        }
    }
}

/// A condition on which work fails at once instead of waiting, being retried or falling back:
/// the provider's wait outlasts the deadline (F2), output was already shown (H2), quota or
/// spend is exhausted (E2), or the fallback contract does not hold (K1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailClosed {
    RetryAfterExceedsDeadline,
    PartialOutputCommitted,
    QuotaOrSpendExhausted,
    FallbackContractMismatch,
}

impl FailClosed {
    pub const ALL: [FailClosed; 4] = [
        FailClosed::RetryAfterExceedsDeadline,
        FailClosed::PartialOutputCommitted,
        FailClosed::QuotaOrSpendExhausted,
        FailClosed::FallbackContractMismatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailClosed::RetryAfterExceedsDeadline => "retry_after_exceeds_deadline",
            FailClosed::PartialOutputCommitted => "partial_output_committed",
            FailClosed::QuotaOrSpendExhausted => "quota_or_spend_exhausted",
            FailClosed::FallbackContractMismatch => "fallback_contract_mismatch",
        }
    }
}

/// A key of the release order (J4). Only read so that files in the playbook's shape validate;
/// the order itself is fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
enum ReleaseField {
    ReadyAt,
    Priority,
    CreatedAt,
}

/// A provider wire format a data boundary may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum Provider {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Provider {
    fn as_str(self) -> &'static str {
        self.format().as_str()
    }

    fn format(self) -> Format {
        match self {
            Provider::OpenAi => Format::OpenAi,
            Provider::Anthropic => Format::Anthropic,
            Provider::Gemini => Format::Gemini,
        }
    }
}

/// A validated workflow policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Workflow {
    pub name: String,
    pub description: Option<String>,
    /// The first 16 hex digits of the SHA-256 of the file's text (of [`BUILTIN_DEFAULT`] for
    /// the built-in one): a job records it, so any edit shows as a new version (J8).
    pub version: String,
    /// Where it came from: the file path as given, or `built-in`.
    pub source: String,
    /// The signal fields the workflow's decisions rest on (E1).
    pub classify_fields: Vec<ClassifyField>,
    pub interactive: InteractiveLane,
    pub stream_recovery: StreamRecoveryLane,
    pub background: BackgroundLane,
    pub owner_review: ReviewLane,
    pub dead_letter: DeadLetterLane,
    pub backpressure: Backpressure,
    pub fallback: FallbackPolicy,
    pub fail_closed_when: Vec<FailClosed>,
    pub slo: Slo,
}

/// `interactive_admission`: requests a caller is waiting on, before any output.
#[derive(Clone, Debug, PartialEq)]
pub struct InteractiveLane {
    /// Waiting for capacity and retries included; past it the caller gets a controlled error.
    pub max_wait_ms: u64,
    /// Upstream attempts, the first one included.
    pub max_attempts: u32,
    /// J5: while interactive requests wait for capacity, the workflow's jobs below this
    /// priority are held back.
    pub shed_priority_below: Priority,
    pub max_length: u32,
}

impl Default for InteractiveLane {
    fn default() -> Self {
        InteractiveLane {
            max_wait_ms: 10_000,
            max_attempts: 3,
            shed_priority_below: Priority::Low,
            max_length: 1024,
        }
    }
}

/// `stream_recovery`: streams cut off before their first token.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamRecoveryLane {
    pub max_length: u32,
}

impl Default for StreamRecoveryLane {
    fn default() -> Self {
        StreamRecoveryLane { max_length: 256 }
    }
}

/// `background_retry`: background jobs between attempts.
#[derive(Clone, Debug, PartialEq)]
pub struct BackgroundLane {
    /// From submission; an older unfinished job goes to dead letter.
    pub max_queue_age_ms: u64,
    pub max_attempts: u32,
    /// Jobs without an `Idempotency-Key` are refused.
    pub require_idempotency_key: bool,
    pub max_length: u32,
    /// The cap of the jittered backoff when the provider gives no wait hint.
    pub max_backoff_ms: u64,
    pub attempt_timeout_ms: u64,
    pub priority: Priority,
}

impl Default for BackgroundLane {
    fn default() -> Self {
        BackgroundLane {
            max_queue_age_ms: 600_000,
            max_attempts: 3,
            require_idempotency_key: false,
            max_length: 10_000,
            max_backoff_ms: 30_000,
            attempt_timeout_ms: 60_000,
            priority: Priority::Normal,
        }
    }
}

/// `owner_review`: work held for a person's decision.
#[derive(Clone, Debug, PartialEq)]
pub struct ReviewLane {
    pub enter_when: Vec<ReviewTrigger>,
    pub max_length: u32,
}

impl Default for ReviewLane {
    fn default() -> Self {
        ReviewLane {
            enter_when: ReviewTrigger::ALL.to_vec(),
            max_length: 1000,
        }
    }
}

/// `dead_letter`: work whose safe retries are spent.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterLane {
    pub enter_when: Vec<DeadLetterTrigger>,
    pub max_length: u32,
}

impl Default for DeadLetterLane {
    fn default() -> Self {
        DeadLetterLane {
            enter_when: DeadLetterTrigger::ALL.to_vec(),
            max_length: 10_000,
        }
    }
}

/// How running work is counted and capped (J4). Release order is always ready_at, then
/// priority, then created_at.
#[derive(Clone, Debug, PartialEq)]
pub struct Backpressure {
    pub concurrency_key: Vec<ConcurrencyField>,
    /// Per concurrency key.
    pub max_concurrency: u32,
}

impl Default for Backpressure {
    fn default() -> Self {
        Backpressure {
            concurrency_key: ConcurrencyField::ALL.to_vec(),
            max_concurrency: 4,
        }
    }
}

/// The fallback contract (K1).
#[derive(Clone, Debug, PartialEq)]
pub struct FallbackPolicy {
    pub allowed_before_first_token: bool,
    pub require_equivalent_tools: bool,
    pub require_schema_match: bool,
    pub require_cost_cap: bool,
    pub require_data_boundary_match: bool,
    pub approved_quality_classes: Vec<String>,
    pub data_boundary: Option<DataBoundary>,
    /// In file order, the order they are tried in.
    pub routes: Vec<FallbackRoute>,
}

impl Default for FallbackPolicy {
    fn default() -> Self {
        FallbackPolicy {
            allowed_before_first_token: true,
            require_equivalent_tools: true,
            require_schema_match: true,
            require_cost_cap: true,
            require_data_boundary_match: true,
            approved_quality_classes: Vec::new(),
            data_boundary: None,
            routes: Vec::new(),
        }
    }
}

/// Where the workflow's work may go; an empty list does not constrain its dimension.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DataBoundary {
    pub providers: Vec<Format>,
    pub regions: Vec<String>,
}

/// One approved fallback route; `from` and `to` are route keys `format/model` of one format.
#[derive(Clone, Debug, PartialEq)]
pub struct FallbackRoute {
    pub from: String,
    pub to: String,
    pub quality_class: String,
    /// Checked to handle the workflow's tools the same way (false when the file does not say).
    pub equivalent_tools: bool,
    /// Checked to keep the workflow's output schema (false when the file does not say).
    pub schema_match: bool,
    /// USD per request on `to`.
    pub max_cost_usd: Option<f64>,
}

/// The workflow's targets; `None` measures nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slo {
    pub wait_p95_ms: Option<u64>,
    pub completion_p95_ms: Option<u64>,
}

impl Workflow {
    /// Parses and validates one policy file's text. `file` names it in errors
    /// (`file:line:column: field: message`, every error at once) and becomes `source`.
    pub fn parse(file: &str, text: &str) -> Result<Workflow> {
        let raw: RawWorkflowFile = serde_saphyr::from_str(text).map_err(|e| yaml_error(file, text, &e))?;
        let mut cx = Ctx {
            file,
            errors: Vec::new(),
        };
        let workflow = raw.validate(&mut cx, text);
        if cx.errors.is_empty() {
            Ok(workflow)
        } else {
            Err(ConfigErrors(cx.errors))
        }
    }

    /// The built-in workflow `default` (source `built-in`).
    pub fn builtin_default() -> Workflow {
        Workflow::parse("built-in", BUILTIN_DEFAULT)
            .expect("the built-in default workflow is valid (a unit test parses it)")
    }

    /// The JSON Schema (draft 2020-12) of a policy file, pretty-printed, for editors
    /// (`policies/workflow.schema.json`).
    pub fn json_schema() -> String {
        let schema = schemars::schema_for!(RawWorkflowFile);
        let mut text = serde_json::to_string_pretty(&schema).expect("a schema is plain JSON, which always serializes");
        text.push('\n');
        text
    }

    /// The approved fallback route from route key `from` (`openai/gpt-4.1`) to `to`, if the
    /// policy lists it.
    pub fn fallback_route(&self, from: &str, to: &str) -> Option<&FallbackRoute> {
        self.fallback.routes.iter().find(|r| r.from == from && r.to == to)
    }

    /// Every approved fallback route leaving `from`, in file order (the order to try them in).
    pub fn fallbacks_from(&self, from: &str) -> Vec<&FallbackRoute> {
        self.fallback.routes.iter().filter(|r| r.from == from).collect()
    }
}

impl RawWorkflowFile {
    /// The validated policy; every problem goes into `cx` (the values standing in for bad ones
    /// only let validation go on).
    fn validate(&self, cx: &mut Ctx, text: &str) -> Workflow {
        if !valid_name(&self.workflow.value) {
            cx.err(
                &self.workflow,
                "workflow",
                "must be 1-64 lower-case letters, digits, '_' or '-'",
            );
        }
        if let Some(d) = &self.description
            && d.value.chars().count() > MAX_DESCRIPTION_CHARS
        {
            cx.err(
                d,
                "description",
                format!("must be at most {MAX_DESCRIPTION_CHARS} characters"),
            );
        }
        let strategy = section(&self.ai_api_queueing_strategy);
        let lanes = strategy.and_then(|s| section(&s.lanes));
        let digest = Sha256::digest(text.as_bytes());
        Workflow {
            name: self.workflow.value.clone(),
            description: self.description.as_ref().map(|d| d.value.clone()),
            version: hex::encode(&digest[..8]),
            source: cx.file.to_owned(),
            classify_fields: classify_fields(cx, strategy.and_then(|s| section(&s.classify))),
            interactive: interactive(cx, lanes.and_then(|l| section(&l.interactive_admission))),
            stream_recovery: stream_recovery(cx, lanes.and_then(|l| section(&l.stream_recovery))),
            background: background(cx, lanes.and_then(|l| section(&l.background_retry))),
            owner_review: owner_review(cx, lanes.and_then(|l| section(&l.owner_review))),
            dead_letter: dead_letter(cx, lanes.and_then(|l| section(&l.dead_letter))),
            backpressure: backpressure(cx, strategy.and_then(|s| section(&s.backpressure))),
            fallback: fallback(cx, strategy.and_then(|s| section(&s.fallback))),
            fail_closed_when: fail_closed_when(cx, strategy),
            slo: slo(cx, strategy.and_then(|s| section(&s.slo))),
        }
    }
}

/// An optional section's value, without its location.
fn section<T>(s: &Option<S<T>>) -> Option<&T> {
    s.as_ref().map(|s| &s.value)
}

fn value_or<T: Copy>(v: &Option<S<T>>, default: T) -> T {
    v.as_ref().map_or(default, |v| v.value)
}

/// A list of enum values, each at most once; `default` when the field is absent.
fn listed<T: Copy + PartialEq>(
    cx: &mut Ctx,
    list: &Option<S<Vec<S<T>>>>,
    field: &str,
    default: &[T],
    name: fn(T) -> &'static str,
) -> Vec<T> {
    let Some(list) = list else {
        return default.to_vec();
    };
    let mut values = Vec::new();
    for (i, item) in list.value.iter().enumerate() {
        if values.contains(&item.value) {
            cx.err(
                item,
                format!("{field}[{i}]"),
                format!("`{}` is listed twice", name(item.value)),
            );
        } else {
            values.push(item.value);
        }
    }
    values
}

/// A workflow or quality class name.
fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn valid_region(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The format of route key `key` (`format/model`), or an error naming `field`.
fn route_format(cx: &mut Ctx, key: &S<String>, field: &str) -> Option<Format> {
    let format = key.value.split_once('/').and_then(|(format, model)| {
        let format = format.parse::<Format>().ok()?;
        spillway_wire::request::valid_model_name(model).then_some(format)
    });
    if format.is_none() {
        cx.err(
            key,
            field,
            format!(
                "`{}` is not a route key format/model: openai, anthropic or gemini, then the model (e.g. openai/gpt-4.1)",
                key.value
            ),
        );
    }
    format
}

fn classify_fields(cx: &mut Ctx, raw: Option<&RawClassify>) -> Vec<ClassifyField> {
    match raw {
        Some(r) => listed(
            cx,
            &r.fields,
            &format!("{STRATEGY}.classify.fields"),
            &ClassifyField::ALL,
            ClassifyField::as_str,
        ),
        None => ClassifyField::ALL.to_vec(),
    }
}

fn interactive(cx: &mut Ctx, raw: Option<&RawInteractive>) -> InteractiveLane {
    let d = InteractiveLane::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.lanes.interactive_admission.{s}");
    InteractiveLane {
        max_wait_ms: cx.bounded(&r.max_wait_ms, &f("max_wait_ms"), 1..=600_000, d.max_wait_ms),
        max_attempts: cx.bounded(&r.max_attempts, &f("max_attempts"), ATTEMPTS, d.max_attempts),
        shed_priority_below: value_or(&r.shed_priority_below, d.shed_priority_below),
        max_length: cx.bounded(&r.max_length, &f("max_length"), LANE_LENGTH, d.max_length),
    }
}

fn stream_recovery(cx: &mut Ctx, raw: Option<&RawStreamRecovery>) -> StreamRecoveryLane {
    let d = StreamRecoveryLane::default();
    let Some(r) = raw else { return d };
    StreamRecoveryLane {
        max_length: cx.bounded(
            &r.max_length,
            &format!("{STRATEGY}.lanes.stream_recovery.max_length"),
            LANE_LENGTH,
            d.max_length,
        ),
    }
}

fn background(cx: &mut Ctx, raw: Option<&RawBackground>) -> BackgroundLane {
    let d = BackgroundLane::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.lanes.background_retry.{s}");
    BackgroundLane {
        max_queue_age_ms: cx.bounded(
            &r.max_queue_age_ms,
            &f("max_queue_age_ms"),
            1_000..=7 * 24 * 3_600_000,
            d.max_queue_age_ms,
        ),
        max_attempts: cx.bounded(&r.max_attempts, &f("max_attempts"), ATTEMPTS, d.max_attempts),
        require_idempotency_key: value_or(&r.require_idempotency_key, d.require_idempotency_key),
        max_length: cx.bounded(&r.max_length, &f("max_length"), LANE_LENGTH, d.max_length),
        max_backoff_ms: cx.bounded(
            &r.max_backoff_ms,
            &f("max_backoff_ms"),
            100..=3_600_000,
            d.max_backoff_ms,
        ),
        attempt_timeout_ms: cx.bounded(
            &r.attempt_timeout_ms,
            &f("attempt_timeout_ms"),
            1_000..=600_000,
            d.attempt_timeout_ms,
        ),
        priority: value_or(&r.priority, d.priority),
    }
}

fn owner_review(cx: &mut Ctx, raw: Option<&RawReview>) -> ReviewLane {
    let d = ReviewLane::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.lanes.owner_review.{s}");
    ReviewLane {
        enter_when: listed(
            cx,
            &r.enter_when,
            &f("enter_when"),
            &d.enter_when,
            ReviewTrigger::as_str,
        ),
        max_length: cx.bounded(&r.max_length, &f("max_length"), LANE_LENGTH, d.max_length),
    }
}

fn dead_letter(cx: &mut Ctx, raw: Option<&RawDeadLetter>) -> DeadLetterLane {
    let d = DeadLetterLane::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.lanes.dead_letter.{s}");
    DeadLetterLane {
        enter_when: listed(
            cx,
            &r.enter_when,
            &f("enter_when"),
            &d.enter_when,
            DeadLetterTrigger::as_str,
        ),
        max_length: cx.bounded(&r.max_length, &f("max_length"), LANE_LENGTH, d.max_length),
    }
}

fn backpressure(cx: &mut Ctx, raw: Option<&RawBackpressure>) -> Backpressure {
    let d = Backpressure::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.backpressure.{s}");
    if let Some(key) = &r.concurrency_key
        && key.value.is_empty()
    {
        cx.err(
            key,
            f("concurrency_key"),
            "list at least one of owner_key, provider, requested_model, endpoint_type",
        );
    }
    if let Some(order) = &r.release_order
        && order.value.iter().map(|o| o.value).ne(RELEASE_ORDER)
    {
        cx.err(
            order,
            f("release_order"),
            "Spillway releases by ready_at, then priority, then created_at (J4); other orders are not supported",
        );
    }
    Backpressure {
        concurrency_key: listed(
            cx,
            &r.concurrency_key,
            &f("concurrency_key"),
            &d.concurrency_key,
            ConcurrencyField::as_str,
        ),
        max_concurrency: cx.bounded(&r.max_concurrency, &f("max_concurrency"), 1..=1024, d.max_concurrency),
    }
}

fn fallback(cx: &mut Ctx, raw: Option<&RawFallback>) -> FallbackPolicy {
    let d = FallbackPolicy::default();
    let Some(r) = raw else { return d };
    let f = |s: &str| format!("{STRATEGY}.fallback.{s}");
    let mut approved: Vec<String> = Vec::new();
    for (i, class) in r
        .approved_quality_classes
        .iter()
        .flat_map(|l| l.value.iter())
        .enumerate()
    {
        let field = f(&format!("approved_quality_classes[{i}]"));
        if !valid_name(&class.value) {
            cx.err(class, field, "must be 1-64 lower-case letters, digits, '_' or '-'");
        } else if approved.contains(&class.value) {
            cx.err(class, field, format!("`{}` is listed twice", class.value));
        } else {
            approved.push(class.value.clone());
        }
    }
    let data_boundary = r.data_boundary.as_ref().map(|b| boundary(cx, b));
    let require_cost_cap = value_or(&r.require_cost_cap, d.require_cost_cap);
    let require_data_boundary_match = value_or(&r.require_data_boundary_match, d.require_data_boundary_match);
    let mut routes: Vec<FallbackRoute> = Vec::new();
    for (i, at) in r.routes.iter().flat_map(|l| l.value.iter()).enumerate() {
        let route = &at.value;
        let rf = |s: &str| f(&format!("routes[{i}].{s}"));
        let from = route_format(cx, &route.from, &rf("from"));
        let to = route_format(cx, &route.to, &rf("to"));
        if let (Some(from_format), Some(to_format)) = (from, to) {
            if route.from.value == route.to.value {
                cx.err(&route.to, rf("to"), "a route cannot fall back to itself");
            } else if from_format != to_format {
                // A request is only ever sent in its caller's format (A4).
                cx.err(
                    &route.to,
                    rf("to"),
                    format!(
                        "cross-format fallback ({from_format} → {to_format}) needs a tested request translation, which Spillway does not have; fall back within one provider's format"
                    ),
                );
            } else if routes
                .iter()
                .any(|seen| seen.from == route.from.value && seen.to == route.to.value)
            {
                cx.err(
                    &route.to,
                    rf("to"),
                    format!("the route {} → {} is listed twice", route.from.value, route.to.value),
                );
            }
            if let Some(b) = &data_boundary
                && require_data_boundary_match
                && !b.providers.is_empty()
                && !b.providers.contains(&to_format)
            {
                let allowed: Vec<&str> = b.providers.iter().map(|p| p.as_str()).collect();
                cx.err(
                    &route.to,
                    rf("to"),
                    format!(
                        "`{}` leaves the data boundary: fallback.data_boundary.providers allows {}",
                        route.to.value,
                        allowed.join(", ")
                    ),
                );
            }
        }
        if !approved.contains(&route.quality_class.value) {
            let approved_now = if approved.is_empty() {
                "none".to_owned()
            } else {
                approved.join(", ")
            };
            cx.err(
                &route.quality_class,
                rf("quality_class"),
                format!(
                    "quality class `{}` is not approved for this workflow (fallback.approved_quality_classes: {approved_now})",
                    route.quality_class.value
                ),
            );
        }
        let max_cost_usd = route.max_cost_usd.as_ref().map(|c| {
            if !c.value.is_finite() || c.value <= 0.0 {
                cx.err(
                    c,
                    rf("max_cost_usd"),
                    "must be a number greater than 0 (USD per request)",
                );
            }
            c.value
        });
        if require_cost_cap && max_cost_usd.is_none() {
            cx.err(
                at,
                rf("max_cost_usd"),
                "fallback.require_cost_cap is on, so every route needs a max_cost_usd (USD per request)",
            );
        }
        routes.push(FallbackRoute {
            from: route.from.value.clone(),
            to: route.to.value.clone(),
            quality_class: route.quality_class.value.clone(),
            equivalent_tools: value_or(&route.equivalent_tools, false),
            schema_match: value_or(&route.schema_match, false),
            max_cost_usd,
        });
    }
    FallbackPolicy {
        allowed_before_first_token: value_or(&r.allowed_before_first_token, d.allowed_before_first_token),
        require_equivalent_tools: value_or(&r.require_equivalent_tools, d.require_equivalent_tools),
        require_schema_match: value_or(&r.require_schema_match, d.require_schema_match),
        require_cost_cap,
        require_data_boundary_match,
        approved_quality_classes: approved,
        data_boundary,
        routes,
    }
}

fn boundary(cx: &mut Ctx, at: &S<RawDataBoundary>) -> DataBoundary {
    let r = &at.value;
    let f = |s: &str| format!("{STRATEGY}.fallback.data_boundary.{s}");
    if r.providers.as_ref().is_none_or(|l| l.value.is_empty()) && r.regions.as_ref().is_none_or(|l| l.value.is_empty())
    {
        cx.err(
            at,
            format!("{STRATEGY}.fallback.data_boundary"),
            "name the providers, the regions or both that the work must stay within, or leave data_boundary out",
        );
    }
    let providers = listed(cx, &r.providers, &f("providers"), &[], Provider::as_str);
    let mut regions: Vec<String> = Vec::new();
    for (i, region) in r.regions.iter().flat_map(|l| l.value.iter()).enumerate() {
        let field = f(&format!("regions[{i}]"));
        if !valid_region(&region.value) {
            cx.err(
                region,
                field,
                format!(
                    "`{}` is not a region: 1-32 lower-case letters, digits or '-' (e.g. eu, us-east)",
                    region.value
                ),
            );
        } else if regions.contains(&region.value) {
            cx.err(region, field, format!("`{}` is listed twice", region.value));
        } else {
            regions.push(region.value.clone());
        }
    }
    DataBoundary {
        providers: providers.into_iter().map(Provider::format).collect(),
        regions,
    }
}

fn fail_closed_when(cx: &mut Ctx, strategy: Option<&RawStrategy>) -> Vec<FailClosed> {
    match strategy {
        Some(s) => listed(
            cx,
            &s.fail_closed_when,
            &format!("{STRATEGY}.fail_closed_when"),
            &FailClosed::ALL,
            FailClosed::as_str,
        ),
        None => FailClosed::ALL.to_vec(),
    }
}

fn slo(cx: &mut Ctx, raw: Option<&RawSlo>) -> Slo {
    let Some(r) = raw else { return Slo::default() };
    Slo {
        wait_p95_ms: positive(cx, &r.wait_p95_ms, &format!("{STRATEGY}.slo.wait_p95_ms")),
        completion_p95_ms: positive(cx, &r.completion_p95_ms, &format!("{STRATEGY}.slo.completion_p95_ms")),
    }
}

/// An optional number that must be greater than 0.
fn positive(cx: &mut Ctx, v: &Option<S<u64>>, field: &str) -> Option<u64> {
    if let Some(n) = v
        && n.value == 0
    {
        cx.err(n, field, "must be greater than 0");
    }
    v.as_ref().map(|n| n.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "workflow: test_flow
ai_api_queueing_strategy:
  lanes:
    interactive_admission:
      max_wait_ms: 4000
      max_attempts: 2
    background_retry:
      max_attempts: 5
      priority: low
  fallback:
    approved_quality_classes: [standard]
    routes:
      - {from: openai/gpt-4.1, to: openai/gpt-4o-mini, quality_class: standard, max_cost_usd: 0.05}
      - {from: openai/gpt-4.1, to: openai/gpt-4.1-mini, quality_class: standard, max_cost_usd: 0.02}
      - {from: anthropic/claude-sonnet-4-5, to: anthropic/claude-haiku-4-5, quality_class: standard, max_cost_usd: 0.05}
";

    const SHIPPED: [(&str, &str); 5] = [
        (
            "customer_chat.yaml",
            include_str!("../../../policies/workflows/customer_chat.yaml"),
        ),
        (
            "support_summary.yaml",
            include_str!("../../../policies/workflows/support_summary.yaml"),
        ),
        (
            "evaluation.yaml",
            include_str!("../../../policies/workflows/evaluation.yaml"),
        ),
        (
            "image_generation.yaml",
            include_str!("../../../policies/workflows/image_generation.yaml"),
        ),
        (
            "finance_legal_review.yaml",
            include_str!("../../../policies/workflows/finance_legal_review.yaml"),
        ),
    ];

    const ROUTES: &str = "ai_api_queueing_strategy.fallback.routes";

    fn parse(text: &str) -> Result<Workflow> {
        Workflow::parse("t.yaml", text)
    }

    fn shipped(file: &str) -> Workflow {
        let (_, text) = SHIPPED.iter().find(|(f, _)| *f == file).unwrap();
        Workflow::parse(file, text).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Whether `e` holds an error at `line` about `field` whose message contains `needle`.
    fn has(e: &ConfigErrors, line: u32, field: &str, needle: &str) -> bool {
        e.0.iter()
            .any(|e| e.line == line && e.field == field && e.message.contains(needle))
    }

    #[test]
    fn j8_shipped_policies_parse_and_validate() {
        // spec: J8
        for (file, text) in SHIPPED {
            let w = Workflow::parse(file, text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(format!("{}.yaml", w.name), file);
            assert_eq!(w.source, file);
            assert!(
                text.starts_with("# yaml-language-server: $schema=../workflow.schema.json\n"),
                "{file}: editors find the schema through the first line"
            );
        }
        let chat = shipped("customer_chat.yaml");
        assert_eq!(
            (
                chat.interactive.max_wait_ms,
                chat.interactive.max_attempts,
                chat.interactive.shed_priority_below
            ),
            (4000, 2, Priority::Normal)
        );
        assert_eq!(
            (chat.background.max_queue_age_ms, chat.background.max_attempts),
            (120_000, 2)
        );
        assert_eq!(chat.fallback.approved_quality_classes, ["standard"]);
        assert_eq!(chat.fallback.data_boundary, None);
        assert_eq!(chat.slo.wait_p95_ms, Some(4000));
        let mini = chat.fallback_route("openai/gpt-4.1", "openai/gpt-4o-mini").unwrap();
        assert!(mini.equivalent_tools && mini.schema_match && mini.max_cost_usd == Some(0.05));
        assert!(
            chat.fallback_route("anthropic/claude-sonnet-4-5", "anthropic/claude-haiku-4-5")
                .is_some()
        );

        let summary = shipped("support_summary.yaml");
        assert_eq!(
            (
                summary.background.max_queue_age_ms,
                summary.background.max_attempts,
                summary.background.require_idempotency_key,
                summary.backpressure.max_concurrency
            ),
            (900_000, 5, false, 4)
        );
        assert_eq!(summary.fallback.routes.len(), 2);
        assert!(summary.fallback.routes.iter().all(|r| r.max_cost_usd == Some(0.10)));
        assert_eq!(summary.slo.completion_p95_ms, Some(300_000));

        let eval = shipped("evaluation.yaml");
        assert_eq!(
            (
                eval.background.max_attempts,
                eval.background.max_queue_age_ms,
                eval.backpressure.max_concurrency,
                eval.background.priority
            ),
            (8, 3_600_000, 2, Priority::Low)
        );
        assert!(eval.fallback.routes.is_empty(), "results must stay comparable");

        let image = shipped("image_generation.yaml");
        assert!(image.background.require_idempotency_key);
        assert_eq!(
            (image.background.max_attempts, image.backpressure.max_concurrency),
            (2, 1)
        );
        assert!(image.fallback.routes.is_empty());
        assert!(
            image
                .owner_review
                .enter_when
                .contains(&ReviewTrigger::FallbackContractUnknown)
        );

        let finance = shipped("finance_legal_review.yaml");
        assert_eq!(
            (
                finance.background.max_attempts,
                finance.background.require_idempotency_key,
                finance.background.priority
            ),
            (1, true, Priority::High)
        );
        assert_eq!(
            finance.fallback.data_boundary,
            Some(DataBoundary {
                providers: vec![Format::OpenAi],
                regions: vec!["eu".to_owned()],
            })
        );
        assert_eq!(finance.owner_review.enter_when, ReviewTrigger::ALL);
        assert_eq!(finance.fail_closed_when, FailClosed::ALL);
        let premium = finance.fallback_route("openai/gpt-4.1", "openai/gpt-4o").unwrap();
        assert_eq!(
            (premium.quality_class.as_str(), premium.max_cost_usd),
            ("premium", Some(0.50))
        );
    }

    #[test]
    fn j8_the_builtin_default_serves_interactive_and_background_work() {
        // spec: J8
        let d = Workflow::builtin_default();
        assert_eq!(
            (d.name.as_str(), d.source.as_str(), d.version.len()),
            ("default", "built-in", 16)
        );
        assert_eq!(d.classify_fields, ClassifyField::ALL);
        assert_eq!(
            d.interactive,
            InteractiveLane {
                max_wait_ms: 10_000,
                max_attempts: 3,
                shed_priority_below: Priority::Low,
                max_length: 1024,
            }
        );
        assert_eq!(d.stream_recovery.max_length, 256);
        assert_eq!(
            d.background,
            BackgroundLane {
                max_queue_age_ms: 600_000,
                max_attempts: 3,
                require_idempotency_key: false,
                max_length: 10_000,
                max_backoff_ms: 30_000,
                attempt_timeout_ms: 60_000,
                priority: Priority::Normal,
            }
        );
        assert_eq!(
            (d.owner_review.enter_when.as_slice(), d.owner_review.max_length),
            (&ReviewTrigger::ALL[..], 1000)
        );
        assert_eq!(
            (d.dead_letter.enter_when.as_slice(), d.dead_letter.max_length),
            (&DeadLetterTrigger::ALL[..], 10_000)
        );
        assert_eq!(
            (
                d.backpressure.concurrency_key.as_slice(),
                d.backpressure.max_concurrency
            ),
            (&ConcurrencyField::ALL[..], 4)
        );
        let f = &d.fallback;
        assert!(
            f.allowed_before_first_token
                && f.require_equivalent_tools
                && f.require_schema_match
                && f.require_cost_cap
                && f.require_data_boundary_match
        );
        assert!(f.approved_quality_classes.is_empty() && f.data_boundary.is_none() && f.routes.is_empty());
        assert_eq!(d.fail_closed_when, FailClosed::ALL);
        assert_eq!(d.slo, Slo::default());
        // What a file leaves out is what the built-in text says: the two never drift apart.
        let minimal = parse("workflow: minimal\n").unwrap();
        assert_eq!(
            Workflow {
                name: d.name.clone(),
                description: d.description.clone(),
                version: d.version.clone(),
                source: d.source.clone(),
                ..minimal
            },
            d
        );
        assert_eq!(Priority::default(), Priority::Normal);
        assert!(Priority::Low < Priority::Normal && Priority::High < Priority::Urgent);
    }

    #[test]
    fn j8_enum_names_are_their_yaml_spelling() {
        // spec: J8
        fn check<T: Copy + Serialize>(all: &[T], name: fn(T) -> &'static str) {
            for &v in all {
                assert_eq!(serde_json::to_value(v).unwrap(), name(v));
            }
        }
        check(&Priority::ALL, Priority::as_str);
        check(&ClassifyField::ALL, ClassifyField::as_str);
        check(&ReviewTrigger::ALL, ReviewTrigger::as_str);
        check(&DeadLetterTrigger::ALL, DeadLetterTrigger::as_str);
        check(&ConcurrencyField::ALL, ConcurrencyField::as_str);
        check(&FailClosed::ALL, FailClosed::as_str);
        for p in Priority::ALL {
            assert_eq!(Priority::parse(p.as_str()), Some(p));
        }
        assert_eq!(Priority::parse("medium"), None);
    }

    #[test]
    fn j8_a_bad_value_names_file_line_and_field() {
        // spec: J8
        let e = parse(&GOOD.replace("max_attempts: 5", "max_attempts: 0")).unwrap_err();
        assert!(
            has(
                &e,
                8,
                "ai_api_queueing_strategy.lanes.background_retry.max_attempts",
                "must be between 1 and 20"
            ),
            "{e}"
        );
        assert!(e.to_string().starts_with("t.yaml:8:"), "{e}");
        let lanes = "ai_api_queueing_strategy.lanes";
        for (from, to, line, field) in [
            (
                "max_wait_ms: 4000",
                "max_wait_ms: 600001",
                5,
                "interactive_admission.max_wait_ms",
            ),
            (
                "max_attempts: 2",
                "max_attempts: 21",
                6,
                "interactive_admission.max_attempts",
            ),
            (
                "max_attempts: 2",
                "max_attempts: 2\n      max_length: 0",
                7,
                "interactive_admission.max_length",
            ),
            (
                "priority: low",
                "priority: low\n      max_queue_age_ms: 999",
                10,
                "background_retry.max_queue_age_ms",
            ),
            (
                "priority: low",
                "priority: low\n      max_backoff_ms: 99",
                10,
                "background_retry.max_backoff_ms",
            ),
            (
                "priority: low",
                "priority: low\n      attempt_timeout_ms: 600001",
                10,
                "background_retry.attempt_timeout_ms",
            ),
        ] {
            let e = parse(&GOOD.replace(from, to)).unwrap_err();
            let field = format!("{lanes}.{field}");
            assert!(e.0.iter().any(|e| e.line == line && e.field == field), "{to}: {e}");
        }
        for (insert, line, field) in [
            (
                "  backpressure:\n    max_concurrency: 0\n",
                11,
                "ai_api_queueing_strategy.backpressure.max_concurrency",
            ),
            (
                "  slo: {wait_p95_ms: 0}\n",
                10,
                "ai_api_queueing_strategy.slo.wait_p95_ms",
            ),
        ] {
            let e = parse(&GOOD.replace("  fallback:\n", &format!("{insert}  fallback:\n"))).unwrap_err();
            assert!(e.0.iter().any(|e| e.line == line && e.field == field), "{insert}: {e}");
        }
        let e = parse(&GOOD.replace("workflow: test_flow", "workflow: Test")).unwrap_err();
        assert!(has(&e, 1, "workflow", "lower-case"), "{e}");
        let e = parse(&format!("description: {}\n{GOOD}", "x".repeat(501))).unwrap_err();
        assert!(has(&e, 1, "description", "at most 500"), "{e}");
    }

    #[test]
    fn j8_unknown_fields_and_values_are_refused_with_their_line() {
        // spec: J8
        let e = parse(&GOOD.replace(
            "      max_wait_ms: 4000\n",
            "      max_wait_ms: 4000\n      max_wait: 3\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("t.yaml:6:") && e.contains("max_wait"), "{e}");
        let e = parse(&GOOD.replace("ai_api_queueing_strategy:", "ai_api_queueing_stratgy:"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("t.yaml:2:") && e.contains("ai_api_queueing_stratgy"),
            "{e}"
        );
        let e = parse(&GOOD.replace("priority: low", "priority: lowest")).unwrap_err();
        assert!(e.0[0].line == 9 && e.0[0].message.contains("lowest"), "{e}");
        let e = parse(&format!("{GOOD}  fail_closed_when: [partial_output_commited]\n")).unwrap_err();
        assert!(
            e.0[0].line == 16 && e.0[0].message.contains("partial_output_commited"),
            "{e}"
        );
        assert!(parse("").is_err());
        assert!(parse("description: no name\n").is_err());
    }

    #[test]
    fn j8_lists_hold_each_value_once_and_release_order_is_fixed() {
        // spec: J8
        let e = parse(&format!(
            "{GOOD}  fail_closed_when: [partial_output_committed, partial_output_committed]\n"
        ))
        .unwrap_err();
        assert!(
            has(&e, 16, "ai_api_queueing_strategy.fail_closed_when[1]", "listed twice"),
            "{e}"
        );
        let e = parse(&format!(
            "{GOOD}  classify:\n    fields: [http_status, route_key, http_status]\n"
        ))
        .unwrap_err();
        assert!(
            has(&e, 17, "ai_api_queueing_strategy.classify.fields[2]", "http_status"),
            "{e}"
        );
        let e = parse(&format!(
            "{GOOD}  backpressure:\n    concurrency_key: []\n    release_order: [created_at, ready_at, priority]\n"
        ))
        .unwrap_err();
        assert!(
            has(
                &e,
                17,
                "ai_api_queueing_strategy.backpressure.concurrency_key",
                "at least one"
            ),
            "{e}"
        );
        assert!(
            has(
                &e,
                18,
                "ai_api_queueing_strategy.backpressure.release_order",
                "ready_at, then priority, then created_at (J4)"
            ),
            "{e}"
        );
        let w = parse(&format!(
            "{GOOD}  backpressure:\n    concurrency_key: [owner_key, provider]\n    release_order: [ready_at, priority, created_at]\n"
        ))
        .unwrap();
        assert_eq!(
            w.backpressure.concurrency_key,
            [ConcurrencyField::OwnerKey, ConcurrencyField::Provider]
        );
    }

    #[test]
    fn k1_cross_format_and_malformed_routes_are_refused() {
        // spec: K1
        let e = parse(&GOOD.replace("to: openai/gpt-4o-mini", "to: anthropic/claude-haiku-4-5")).unwrap_err();
        assert!(
            has(
                &e,
                13,
                &format!("{ROUTES}[0].to"),
                "cross-format fallback (openai → anthropic)"
            ),
            "{e}"
        );
        assert_eq!(e.0.len(), 1, "{e}");
        for to in [
            "to: gpt-4o-mini",
            "to: azure/gpt-4o-mini",
            "to: 'openai/'",
            "to: openai/gpt-4.1",
            "to: openai/gpt-4.1-mini",
        ] {
            let bad = GOOD.replacen("to: openai/gpt-4o-mini", to, 1);
            let e = parse(&bad).unwrap_err();
            assert!(e.0.iter().any(|e| e.field.ends_with("].to")), "{to}: {e}");
        }
        let e = parse(&GOOD.replace("from: anthropic/claude-sonnet-4-5", "from: claude-sonnet-4-5")).unwrap_err();
        assert!(has(&e, 15, &format!("{ROUTES}[2].from"), "route key"), "{e}");
    }

    #[test]
    fn k1_a_route_needs_an_approved_quality_class() {
        // spec: K1
        let e = parse(&GOOD.replacen("quality_class: standard", "quality_class: premium", 1)).unwrap_err();
        assert!(
            has(
                &e,
                13,
                &format!("{ROUTES}[0].quality_class"),
                "`premium` is not approved"
            ),
            "{e}"
        );
        assert_eq!(e.0.len(), 1, "{e}");
        let e =
            parse(&GOOD.replace("approved_quality_classes: [standard]", "approved_quality_classes: []")).unwrap_err();
        assert_eq!(e.0.len(), 3, "every route's class is unapproved: {e}");
    }

    #[test]
    fn k1_a_cost_cap_is_required_when_the_policy_says_so() {
        // spec: K1
        let uncapped = GOOD.replace(", max_cost_usd: 0.02", "");
        let e = parse(&uncapped).unwrap_err();
        assert!(
            has(&e, 14, &format!("{ROUTES}[1].max_cost_usd"), "require_cost_cap"),
            "{e}"
        );
        let w = parse(&uncapped.replace("    routes:\n", "    require_cost_cap: false\n    routes:\n")).unwrap();
        assert_eq!(w.fallback.routes[1].max_cost_usd, None);
        let e = parse(&GOOD.replace("max_cost_usd: 0.02", "max_cost_usd: 0")).unwrap_err();
        assert!(
            has(&e, 14, &format!("{ROUTES}[1].max_cost_usd"), "greater than 0"),
            "{e}"
        );
    }

    #[test]
    fn k1_routes_stay_inside_the_data_boundary() {
        // spec: K1
        let with_boundary = |b: &str| GOOD.replace("    routes:\n", &format!("    data_boundary: {b}\n    routes:\n"));
        let e = parse(&with_boundary("{providers: [anthropic], regions: [eu]}")).unwrap_err();
        assert!(has(&e, 14, &format!("{ROUTES}[0].to"), "data boundary"), "{e}");
        assert!(has(&e, 15, &format!("{ROUTES}[1].to"), "data boundary"), "{e}");
        assert_eq!(e.0.len(), 2, "{e}");
        let w = parse(&with_boundary(
            "{providers: [openai, anthropic], regions: [eu, us-east]}",
        ))
        .unwrap();
        assert_eq!(
            w.fallback.data_boundary.unwrap(),
            DataBoundary {
                providers: vec![Format::OpenAi, Format::Anthropic],
                regions: vec!["eu".to_owned(), "us-east".to_owned()],
            }
        );
        let e = parse(&with_boundary("{regions: ['EU West']}")).unwrap_err();
        assert!(
            has(
                &e,
                12,
                "ai_api_queueing_strategy.fallback.data_boundary.regions[0]",
                "EU West"
            ),
            "{e}"
        );
        let e = parse(&with_boundary("{}")).unwrap_err();
        assert!(
            has(&e, 12, "ai_api_queueing_strategy.fallback.data_boundary", "regions"),
            "{e}"
        );
        assert!(parse(&with_boundary("{providers: [azure]}")).is_err());
    }

    #[test]
    fn j8_every_error_in_a_file_is_reported() {
        // spec: J8
        let bad = GOOD
            .replace("workflow: test_flow", "workflow: Test Flow")
            .replace("max_wait_ms: 4000", "max_wait_ms: 0")
            .replacen("quality_class: standard", "quality_class: premium", 1);
        let e = parse(&bad).unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
        let lines: Vec<u32> = e.0.iter().map(|e| e.line).collect();
        assert_eq!(lines, [1, 5, 13], "{e}");
    }

    #[test]
    fn j8_the_version_follows_the_text() {
        // spec: J8
        let a = parse(GOOD).unwrap().version;
        assert_eq!(a, parse(GOOD).unwrap().version);
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, parse(&format!("{GOOD}# a comment\n")).unwrap().version);
        assert_ne!(a, parse(&GOOD.replace("0.05", "0.06")).unwrap().version);
        assert_eq!(Workflow::builtin_default().version, Workflow::builtin_default().version);
    }

    #[test]
    fn k1_fallback_routes_are_found() {
        // spec: K1
        let w = parse(GOOD).unwrap();
        let r = w.fallback_route("openai/gpt-4.1", "openai/gpt-4o-mini").unwrap();
        assert_eq!(
            (
                r.quality_class.as_str(),
                r.max_cost_usd,
                r.equivalent_tools,
                r.schema_match
            ),
            ("standard", Some(0.05), false, false),
            "not stated: not known to be equivalent"
        );
        assert!(w.fallback_route("openai/gpt-4o-mini", "openai/gpt-4.1").is_none());
        let to: Vec<&str> = w
            .fallbacks_from("openai/gpt-4.1")
            .into_iter()
            .map(|r| r.to.as_str())
            .collect();
        assert_eq!(to, ["openai/gpt-4o-mini", "openai/gpt-4.1-mini"], "file order");
        assert!(w.fallbacks_from("gemini/gemini-2.5-pro").is_empty());
        assert!(Workflow::builtin_default().fallbacks_from("openai/gpt-4.1").is_empty());
    }

    #[test]
    fn schema_file_is_current() {
        // spec: J8
        let schema = Workflow::json_schema();
        if std::env::var("UPDATE_SCHEMA").is_ok_and(|v| v == "1") {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies/workflow.schema.json");
            std::fs::write(path, schema.as_bytes()).unwrap();
            return;
        }
        assert!(
            schema == include_str!("../../../policies/workflow.schema.json"),
            "policies/workflow.schema.json is not what the types generate; rerun this test with UPDATE_SCHEMA=1"
        );
        assert!(schema.contains("\"additionalProperties\": false"));
    }
}
