//! Provider wire formats, pure: the three request shapes the gateway accepts, the error
//! bodies it answers with (A3), SSE framing (H1), usage blocks (M2), the input-token
//! estimate (M3) and the normalised signal an upstream outcome becomes (E1). No I/O happens
//! here, so every function can be table-tested and fed arbitrary bytes without a server.

pub mod error_body;
pub mod format;
pub mod json;
pub mod request;
pub mod signal;
pub mod sse;
pub mod time;
pub mod tokens;
pub mod usage;

pub use error_body::{ErrorKind, error_body, stream_error_event};
pub use format::Format;
pub use request::{Api, ParsedRequest, RequestError, parse_request};
pub use signal::{
    ErrorClass, RateLimitState, Signal, Visibility, answer_json, classify_parsed, classify_stream_error,
    parse_retry_after, rate_limit_state,
};
pub use sse::{MAX_EVENT_BYTES, SseEvent, SseParser};
pub use time::UnixMs;
pub use tokens::estimate_input_tokens;
pub use usage::Usage;
