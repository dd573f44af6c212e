//! Request ids and W3C trace context (A6).

use rand::Rng;

/// A fresh gateway request id: UUIDv7, so ids sort by time and the ledger's primary key
/// stays append-only.
pub fn request_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// The trace id for a request that arrives without one: its own request id in trace-id
/// form. Time-ordered like the request id (cheap to index), unique, 74 random bits, and an
/// operator can go from one to the other.
fn trace_id_for(request_id: &str) -> Option<String> {
    let id = uuid::Uuid::parse_str(request_id).ok()?;
    (!id.is_nil()).then(|| id.simple().to_string())
}

/// The trace this request belongs to, and the `traceparent` to send upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: String,
    /// Our span, the parent of the upstream call.
    pub span_id: String,
    pub flags: String,
    /// The caller's span, when it sent a valid `traceparent`.
    pub parent_span_id: Option<String>,
}

impl TraceContext {
    /// Continues the caller's trace when `traceparent` is valid, else starts a new one
    /// named after `request_id`.
    pub fn from_header(traceparent: Option<&str>, request_id: &str) -> TraceContext {
        let mut rng = rand::rng();
        let span_id = format!("{:016x}", rng.random::<u64>().max(1));
        if let Some((trace_id, parent, flags)) = traceparent.and_then(parse_traceparent) {
            return TraceContext {
                trace_id,
                span_id,
                flags,
                parent_span_id: Some(parent),
            };
        }
        let trace_id = trace_id_for(request_id).unwrap_or_else(|| format!("{:032x}", rng.random::<u128>().max(1)));
        TraceContext {
            trace_id,
            span_id,
            flags: "01".into(),
            parent_span_id: None,
        }
    }

    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-{}", self.trace_id, self.span_id, self.flags)
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `version-traceid-parentid-flags`; all-zero ids are invalid per the W3C spec.
fn parse_traceparent(v: &str) -> Option<(String, String, String)> {
    let mut it = v.trim().split('-');
    let (ver, trace, parent, flags) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if !is_hex(ver, 2) || ver == "ff" || !is_hex(trace, 32) || !is_hex(parent, 16) || !is_hex(flags, 2) {
        return None;
    }
    if ver == "00" && it.next().is_some() {
        return None;
    }
    if trace.bytes().all(|b| b == b'0') || parent.bytes().all(|b| b == b'0') {
        return None;
    }
    Some((trace.to_owned(), parent.to_owned(), flags.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a6_traceparent_is_continued() {
        // spec: A6
        let t = TraceContext::from_header(
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            &request_id(),
        );
        assert_eq!(t.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_span_id.as_deref(), Some("00f067aa0ba902b7"));
        assert_ne!(
            t.span_id, "00f067aa0ba902b7",
            "the upstream call gets our own span as parent"
        );
        assert!(t.traceparent().starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(t.traceparent().ends_with("-01"));
    }

    #[test]
    fn invalid_traceparent_starts_a_new_trace() {
        for bad in [
            "",
            "00-xyz",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let id = request_id();
            let t = TraceContext::from_header(Some(bad), &id);
            assert_eq!(
                t.trace_id,
                id.replace('-', ""),
                "a new trace is named after the request"
            );
        }
        assert_ne!(request_id(), request_id());
    }
}
