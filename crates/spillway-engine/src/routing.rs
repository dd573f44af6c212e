//! Choosing a channel (A4) and taking a slot of its capacity (C1, C2).

use crate::error::GatewayError;
use crate::state::{AppState, ChannelRt};
use rand::Rng;
use spillway_wire::Format;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedSemaphorePermit;

/// C2: the longest a request waits for capacity.
pub const MAX_CAPACITY_WAIT: Duration = Duration::from_secs(10);

/// Channels that speak `format` and serve `model`, in a weighted random order (A4).
pub fn candidates(state: &AppState, format: Format, model: &str) -> Vec<Arc<ChannelRt>> {
    let mut rng = rand::rng();
    let mut c: Vec<(f64, &Arc<ChannelRt>)> = state
        .channels
        .iter()
        .filter(|c| c.cfg.format == format && c.cfg.serves(model))
        // Efraimidis–Spirakis: sorting by u^(1/w) draws a weighted order without replacement.
        .map(|c| (rng.random::<f64>().powf(1.0 / f64::from(c.cfg.weight.max(1))), c))
        .collect();
    c.sort_by(|a, b| b.0.total_cmp(&a.0));
    c.into_iter().map(|(_, c)| c.clone()).collect()
}

/// Held while a request waits for capacity; its drop ends the wait, however it ends
/// (admitted, timed out, or the client went away).
pub struct WaitGuard(pub Option<Box<dyn FnOnce() + Send>>);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A slot on a channel, held until the upstream call (and its stream) ends.
pub struct Admitted {
    pub channel: Arc<ChannelRt>,
    pub permit: OwnedSemaphorePermit,
    /// Set when the request waited for capacity.
    pub queued_ms: Option<u64>,
}

/// Takes a free slot on the first candidate that has one; if all are full, waits (at most
/// [`MAX_CAPACITY_WAIT`]) for whichever candidate frees first.
pub async fn admit(
    candidates: &[Arc<ChannelRt>],
    on_wait: impl FnOnce() -> WaitGuard,
) -> Result<Admitted, GatewayError> {
    for c in candidates {
        if let Ok(permit) = c.permits.clone().try_acquire_owned() {
            return Ok(Admitted {
                channel: c.clone(),
                permit,
                queued_ms: None,
            });
        }
    }
    if candidates.is_empty() {
        return Err(GatewayError::CapacityBusy { retry_after_s: 1 });
    }
    let _waiting = on_wait();
    let started = Instant::now();
    let waits = candidates.iter().map(|c| {
        let c = c.clone();
        Box::pin(async move { c.permits.clone().acquire_owned().await.map(|p| (c, p)) })
    });
    match tokio::time::timeout(MAX_CAPACITY_WAIT, futures_util::future::select_ok(waits)).await {
        Ok(Ok(((channel, permit), _))) => Ok(Admitted {
            channel,
            permit,
            queued_ms: Some(started.elapsed().as_millis() as u64),
        }),
        _ => Err(GatewayError::CapacityBusy { retry_after_s: 1 }),
    }
}
