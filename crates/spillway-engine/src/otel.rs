//! OpenTelemetry traces (N1): when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-only
//! variable) is set, each request becomes a span with one child per upstream attempt,
//! exported over OTLP/HTTP (protobuf, or JSON with `OTEL_EXPORTER_OTLP_PROTOCOL=http/json`)
//! by the OpenTelemetry SDK's batch processor on its own thread. The request span carries
//! the gateway's trace id and the span id it sent upstream in `traceparent`, so the
//! provider's spans (if it traces) and the caller's nest around it. Spans are built when a
//! request closes, from its ledger record and attempts, so the request path pays nothing
//! while tracing is off and one batch hand-off when it is on.

use crate::trace::TraceContext;
use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};
use spillway_ledger::{AttemptRecord, RequestRecord, RequestState};
use spillway_wire::UnixMs;
use std::cell::Cell;
use std::time::{Duration, SystemTime};

thread_local! {
    /// The ids the next span started on this thread must take (the gateway's own, minted
    /// before the SDK saw the request); random when unset.
    static NEXT_IDS: Cell<(Option<TraceId>, Option<SpanId>)> = const { Cell::new((None, None)) };
}

/// Hands the SDK the ids the gateway already minted.
#[derive(Debug, Default)]
struct GatewayIds(RandomIdGenerator);

impl IdGenerator for GatewayIds {
    fn new_trace_id(&self) -> TraceId {
        let (t, s) = NEXT_IDS.get();
        NEXT_IDS.set((None, s));
        t.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let (t, s) = NEXT_IDS.get();
        NEXT_IDS.set((t, None));
        s.unwrap_or_else(|| self.0.new_span_id())
    }
}

/// The exporter and its tracer.
pub struct Otel {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

#[derive(Debug, thiserror::Error)]
#[error("OpenTelemetry export cannot start: {0}")]
pub struct OtelError(String);

fn at(ms: UnixMs) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms.0.max(0) as u64)
}

impl Otel {
    /// From the standard `OTEL_EXPORTER_OTLP_*` variables; None when no endpoint is set.
    pub fn from_env() -> Result<Option<Otel>, OtelError> {
        let set = |v: &str| std::env::var(v).is_ok_and(|v| !v.trim().is_empty());
        if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            return Ok(None);
        }
        Self::build(opentelemetry_otlp::SpanExporter::builder().with_http()).map(Some)
    }

    /// To the collector at `base` (`http://host:4318`), in OTLP/JSON.
    pub fn json_to(base: &str) -> Result<Otel, OtelError> {
        let b = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{}/v1/traces", base.trim_end_matches('/')));
        Self::build(b)
    }

    fn build(
        b: opentelemetry_otlp::SpanExporterBuilder<opentelemetry_otlp::HttpExporterBuilderSet>,
    ) -> Result<Otel, OtelError> {
        let exporter = b.build().map_err(|e| OtelError(e.to_string()))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_id_generator(GatewayIds::default())
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name("spillway")
                    .build(),
            )
            .build();
        let tracer = provider.tracer("spillway");
        Ok(Otel { provider, tracer })
    }

    /// A closed request: its span and one child per attempt.
    pub fn record(&self, trace: &TraceContext, rec: &RequestRecord, attempts: &[AttemptRecord]) {
        let (Ok(trace_id), Ok(span_id)) = (TraceId::from_hex(&trace.trace_id), SpanId::from_hex(&trace.span_id)) else {
            return;
        };
        let parent = match trace.parent_span_id.as_deref().map(SpanId::from_hex) {
            Some(Ok(p)) => Context::new().with_remote_span_context(SpanContext::new(
                trace_id,
                p,
                // The caller's sampling decision stands.
                TraceFlags::new(u8::from_str_radix(&trace.flags, 16).unwrap_or(1)),
                true,
                TraceState::default(),
            )),
            _ => Context::new(),
        };
        let mut attrs = vec![
            KeyValue::new("spillway.request_id", rec.id.clone()),
            KeyValue::new("gen_ai.system", rec.format.as_str()),
            KeyValue::new("spillway.endpoint", rec.endpoint.clone()),
            KeyValue::new("spillway.state", rec.state.as_str()),
            KeyValue::new("spillway.attempts", i64::from(rec.attempts)),
        ];
        let opt = |k: &'static str, v: &Option<String>| v.clone().map(|v| KeyValue::new(k, v));
        attrs.extend(
            [
                opt("gen_ai.request.model", &rec.requested_model),
                opt("spillway.route", &rec.route),
                opt("spillway.channel", &rec.channel),
                opt("spillway.owner", &rec.owner),
                opt("spillway.client_request_id", &rec.client_request_id),
                opt("gen_ai.response.id", &rec.upstream_request_id),
                rec.error_class.map(|c| KeyValue::new("error.type", c.as_str())),
                rec.http_status
                    .map(|s| KeyValue::new("http.response.status_code", i64::from(s))),
            ]
            .into_iter()
            .flatten(),
        );
        NEXT_IDS.set((Some(trace_id), Some(span_id)));
        let mut span = self
            .tracer
            .span_builder(format!("{} {}", rec.format.as_str(), rec.endpoint))
            .with_kind(SpanKind::Server)
            .with_start_time(at(rec.received_at))
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &parent);
        NEXT_IDS.set((None, None));
        if rec.state != RequestState::Done {
            span.set_status(Status::error(rec.error_message.clone().unwrap_or_default()));
        }
        let cx = Context::new().with_remote_span_context(span.span_context().clone());
        for a in attempts {
            let mut attrs = vec![
                KeyValue::new("spillway.attempt", i64::from(a.attempt_no)),
                KeyValue::new("spillway.channel", a.channel.clone()),
                KeyValue::new("spillway.error_class", a.error_class.as_str()),
            ];
            attrs.extend(
                [
                    a.http_status
                        .map(|s| KeyValue::new("http.response.status_code", i64::from(s))),
                    a.decision.map(|d| KeyValue::new("spillway.decision", d.as_str())),
                    a.decision_reason
                        .map(|r| KeyValue::new("spillway.stop_reason", r.as_str())),
                    a.upstream_request_id
                        .clone()
                        .map(|v| KeyValue::new("gen_ai.response.id", v)),
                ]
                .into_iter()
                .flatten(),
            );
            let mut child = self
                .tracer
                .span_builder(format!("attempt {} on {}", a.attempt_no, a.channel))
                .with_kind(SpanKind::Client)
                .with_start_time(at(a.started_at))
                .with_attributes(attrs)
                .start_with_context(&self.tracer, &cx);
            if a.error_class != spillway_wire::ErrorClass::Success {
                child.set_status(Status::error(a.error_class.as_str()));
            }
            child.end_with_timestamp(at(a.finished_at.unwrap_or(rec.finished_at.unwrap_or(a.started_at))));
        }
        span.end_with_timestamp(at(rec.finished_at.unwrap_or(rec.received_at)));
    }

    /// Exports what is left; blocks up to a few seconds (call off the runtime's workers).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "OpenTelemetry export did not finish");
        }
    }
}
