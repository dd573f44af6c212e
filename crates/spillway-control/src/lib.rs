//! The gateway's control plane as small state machines: a breaker per route (G1–G4), a
//! retry budget and the amplification figures per route (F4, F5), and each channel's
//! ejection and health weight (D4, D5); a guided recovery run (O1–O4). Every function takes the time it runs at; nothing
//! here sleeps, spawns or does I/O, so every branch is tested on tokio's paused clock and
//! the engine decides what to persist, audit and alert.

pub mod breaker;
pub mod budget;
pub mod outlier;
pub mod recovery;

pub use breaker::{Admission, Breaker, BreakerConfig, BreakerSnapshot, BreakerState, BreakerView, Transition, Trigger};
pub use budget::{Amplification, AmplificationView, RetryBudget, WindowFigures};
pub use outlier::{Outlier, OutlierConfig, OutlierSnapshot, OutlierTransition};
pub use recovery::{
    Approval, ApprovalRole, Change, CloseChecks, Gate, ProbeResult, Recovery, RecoveryConfig, RecoveryError,
    RecoveryStep,
};

/// What one upstream attempt came to, as the control plane reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An answer (or a stream's first output): the upstream works.
    Success,
    /// A 429 pacing or quota answer.
    RateLimited,
    /// A 5xx (503 and 529 overload included), a timeout, an unreachable channel or a
    /// stream that broke before any output: the provider failed.
    ProviderFailure,
    /// Anything else (the client's own 4xx, an unreadable answer): says nothing about the
    /// upstream's health.
    Neutral,
}

#[cfg(test)]
mod tests;
