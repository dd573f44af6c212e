//! Request validation at ingress (A5): just enough of each provider's request shape to
//! route it and to refuse what the provider would refuse anyway, naming the field. The
//! body itself is forwarded byte for byte; nothing here re-serialises it.

use crate::Format;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

/// What a request asks of the provider. Each format serves several: the gateway admits,
/// routes, retries and records them all alike, and only what differs is told apart here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// A model's answer: OpenAI chat completions, Anthropic messages, Gemini
    /// `generateContent` and `streamGenerateContent`.
    Generate,
    /// OpenAI's Responses API (`POST /v1/responses`).
    Responses,
    /// Vectors for text: OpenAI `/v1/embeddings`, Gemini `embedContent` and
    /// `batchEmbedContents`.
    Embeddings,
    /// Anthropic `/v1/messages/count_tokens`, Gemini `countTokens`: free, never billed.
    CountTokens,
}

/// Every endpoint the gateway records, as the ledger names it (Gemini's model as a
/// placeholder), with what it asks of the provider.
pub const ENDPOINTS: &[(&str, Api)] = &[
    ("/v1/chat/completions", Api::Generate),
    ("/v1/responses", Api::Responses),
    ("/v1/embeddings", Api::Embeddings),
    ("/v1/messages", Api::Generate),
    ("/v1/messages/count_tokens", Api::CountTokens),
    ("/v1beta/models/{model}:generateContent", Api::Generate),
    ("/v1beta/models/{model}:streamGenerateContent", Api::Generate),
    ("/v1beta/models/{model}:embedContent", Api::Embeddings),
    ("/v1beta/models/{model}:batchEmbedContents", Api::Embeddings),
    ("/v1beta/models/{model}:countTokens", Api::CountTokens),
    ("/v1/models/{model}:generateContent", Api::Generate),
    ("/v1/models/{model}:streamGenerateContent", Api::Generate),
    ("/v1/models/{model}:embedContent", Api::Embeddings),
    ("/v1/models/{model}:batchEmbedContents", Api::Embeddings),
    ("/v1/models/{model}:countTokens", Api::CountTokens),
];

/// What a Gemini path's `:action` asks, and whether it streams.
pub fn gemini_action(action: &str) -> Option<(Api, bool)> {
    Some(match action {
        "generateContent" => (Api::Generate, false),
        "streamGenerateContent" => (Api::Generate, true),
        "embedContent" | "batchEmbedContents" => (Api::Embeddings, false),
        "countTokens" => (Api::CountTokens, false),
        _ => return None,
    })
}

impl Api {
    /// The recorded endpoints that serve this API.
    pub fn endpoints(self) -> impl Iterator<Item = &'static str> {
        ENDPOINTS.iter().filter(move |(_, a)| *a == self).map(|(e, _)| *e)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Generate => "generate",
            Api::Responses => "responses",
            Api::Embeddings => "embeddings",
            Api::CountTokens => "count_tokens",
        }
    }
}

/// What the gateway needs to know about a valid request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedRequest {
    pub model: String,
    pub stream: bool,
    /// OpenAI only: `stream_options.include_usage`, without which a stream carries no usage.
    pub include_usage: bool,
    /// Output cap the client asked for, if any (M3 estimates cost from it).
    pub max_output_tokens: Option<u64>,
    /// M3: the input tokens counted before the call (see [`crate::tokens`]).
    pub estimated_input_tokens: u64,
    /// D4: a hash of the conversation's opening (its messages up to and including the
    /// first user turn), the same on every later turn of the conversation; routing keeps
    /// a conversation on its channel by it.
    pub conversation: u64,
    /// The request carries turns after its opening (an answer and a further question):
    /// it continues a conversation rather than starting one.
    pub continuation: bool,
    /// OpenAI Responses: the stored response this turn follows, which only the channel
    /// that stored it can find.
    pub previous_response_id: Option<String>,
    /// The provider may act on its own while it answers (OpenAI Responses with a hosted
    /// tool that reaches out or runs code, or `background: true`): an attempt that reached
    /// it may have done so, and running it again could do it twice.
    pub acts_upstream: bool,
}

/// A message list: how many there are, and a hash of the opening ones.
struct Messages {
    len: usize,
    opening: u64,
    /// Messages after the opening.
    more: bool,
}

/// Just a message's role, read from its raw JSON.
#[derive(Deserialize)]
struct Role<'a> {
    #[serde(default, borrow)]
    role: Option<std::borrow::Cow<'a, str>>,
}

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Messages;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                let mut len = 0;
                let mut open = true;
                // The opening: messages up to the first user turn (a system prompt alone
                // is shared by every conversation of an application, so it is not enough).
                while open {
                    let Some(m) = seq.next_element::<&'de serde_json::value::RawValue>()? else {
                        break;
                    };
                    len += 1;
                    m.get().hash(&mut h);
                    let role = serde_json::from_str::<Role>(m.get()).ok().and_then(|r| r.role);
                    open = len < 4 && !matches!(role.as_deref(), Some("user") | None);
                }
                let opened = len;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    len += 1;
                }
                Ok(Messages {
                    len,
                    opening: h.finish(),
                    more: len > opened,
                })
            }
        }
        d.deserialize_seq(V)
    }
}

/// A request the gateway refuses with 400. `field` is the JSON path of the culprit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render())]
pub struct RequestError {
    pub field: Option<String>,
    pub message: String,
}

impl RequestError {
    fn render(&self) -> String {
        match &self.field {
            Some(f) => format!("Invalid request: `{f}`: {}", self.message),
            None => format!("Invalid request: {}", self.message),
        }
    }
    fn new(field: Option<&str>, message: impl Into<String>) -> Self {
        RequestError {
            field: field.map(str::to_owned),
            message: message.into(),
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct OpenAiChat {
    model: String,
    messages: Messages,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct AnthropicMessages {
    model: String,
    messages: Messages,
    max_tokens: u64,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct OpenAiResponses<'a> {
    model: String,
    /// A string or a list of input items (absent with a stored prompt template). Read
    /// raw and told apart by hand: an untagged enum would buffer the list, and a message
    /// list reads its items raw, which a buffered copy cannot give.
    #[serde(default, borrow)]
    input: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    tools: Vec<ResponsesTool>,
}

/// Just a Responses tool's type.
#[derive(Deserialize)]
struct ResponsesTool {
    #[serde(default, rename = "type")]
    kind: String,
}

impl ResponsesTool {
    /// Tools whose work is done by the client (functions) or only reads (search): the
    /// provider acts on nothing. Every other hosted tool (MCP servers, code interpreter,
    /// computer use, image generation, ones newer than this list) may.
    fn runs_elsewhere(&self) -> bool {
        matches!(
            self.kind.as_str(),
            "function" | "custom" | "file_search" | "web_search" | "web_search_preview" | "local_shell"
        )
    }
}

#[derive(Deserialize)]
struct OpenAiEmbeddings {
    model: String,
    input: EmbeddingInput,
}

/// Embeddings `input`: a string, a list of strings, or token arrays; never empty.
#[derive(Deserialize)]
#[serde(untagged)]
enum EmbeddingInput {
    Text(String),
    Many(Vec<serde::de::IgnoredAny>),
}

#[derive(Deserialize)]
struct AnthropicCountTokens {
    model: String,
    messages: Messages,
}

/// `embedContent` sends one `content`, `batchEmbedContents` a list of `requests`.
#[derive(Deserialize)]
struct GeminiEmbed {
    #[serde(default)]
    content: Option<IgnoredAny>,
    #[serde(default)]
    requests: Option<Vec<IgnoredAny>>,
}

#[derive(Deserialize)]
struct GenerationConfig {
    #[serde(default, rename = "maxOutputTokens")]
    max_output_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct GeminiGenerate {
    contents: Messages,
    #[serde(default, rename = "generationConfig")]
    generation_config: Option<GenerationConfig>,
}

/// What serde says went wrong, in our words: the expectation (which comes from our own
/// types) and the kind of value found, never the value itself (A5: an error names the
/// field and what was expected, and never echoes the client's text back).
fn describe(msg: &str) -> String {
    let expected = msg
        .split_once(", expected ")
        .map(|(_, e)| e.split(" at line ").next().unwrap_or(e).trim());
    let found = |rest: &str| -> &'static str {
        let word = rest.split([' ', '`']).next().unwrap_or_default();
        match word {
            "string" => "a string",
            "integer" => "an integer",
            "floating" => "a number with a fraction",
            "boolean" => "a boolean",
            "null" => "null",
            "map" => "an object",
            "sequence" => "an array",
            _ => "another kind of value",
        }
    };
    if let Some(rest) = msg.strip_prefix("invalid type: ") {
        return match expected {
            Some(e) => format!("expected {e}, got {}", found(rest)),
            None => format!("has the wrong type ({})", found(rest)),
        };
    }
    if msg.starts_with("invalid value: ") || msg.starts_with("invalid length ") {
        return match expected {
            Some(e) => format!("expected {e}"),
            None => "has an invalid value".to_owned(),
        };
    }
    if msg.starts_with("duplicate field") {
        return "appears more than once".to_owned();
    }
    if msg.starts_with("number out of range") {
        return "is a number out of range".to_owned();
    }
    "has an invalid value".to_owned()
}

/// serde_json's syntax errors are a fixed vocabulary ("expected `,` or `}`", "EOF while
/// parsing a string", "trailing characters"): safe to show, with the position.
fn syntax(e: &serde_json::Error) -> RequestError {
    let what = e.to_string();
    let what = what.split(" at line ").next().unwrap_or(&what).to_owned();
    let msg = if what == "trailing characters" {
        format!(
            "body must be exactly one JSON value; more follows it at line {} column {}",
            e.line(),
            e.column()
        )
    } else {
        format!(
            "body is not valid JSON ({what} at line {} column {})",
            e.line(),
            e.column()
        )
    };
    RequestError::new(None, msg)
}

fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RequestError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return syntax(&inner);
        }
        let msg = inner.to_string();
        // serde reports a missing field at its parent's path; name the field itself.
        if let Some(rest) = msg.strip_prefix("missing field `") {
            let name = rest.split('`').next().unwrap_or_default();
            let field = if path == "." {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            };
            return RequestError::new(Some(&field), "is required");
        }
        let field = if path == "." { None } else { Some(path.as_str()) };
        RequestError::new(field, describe(&msg))
    })?;
    // One JSON value and nothing after it: bytes a strict provider would refuse must not
    // reach it, and nothing the gateway did not read may ride along.
    de.end().map_err(|e| syntax(&e))?;
    Ok(value)
}

fn require_object(body: &[u8]) -> Result<(), RequestError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(RequestError::new(
            None,
            format!("body is not valid UTF-8 (invalid byte at offset {})", e.valid_up_to()),
        ));
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        Some(b'{') => Ok(()),
        None => Err(RequestError::new(None, "body is empty; expected a JSON object")),
        Some(_) => Err(RequestError::new(None, "body must be a JSON object")),
    }
}

fn non_empty(field: &str, len: usize) -> Result<(), RequestError> {
    if len == 0 {
        Err(RequestError::new(Some(field), "must contain at least one item"))
    } else {
        Ok(())
    }
}

/// M2: an OpenAI chat request body that streams with `stream_options.include_usage` set
/// (the client's other stream options kept), so that the stream reports its usage; None
/// when the body is not a JSON object. Everything else stays as the client wrote it, byte
/// for byte: a structured-output schema's property order is what the model follows, and
/// large integers must not pass through floating point.
pub fn with_stream_usage(body: &[u8]) -> Option<Vec<u8>> {
    use serde_json::value::RawValue;
    let text = std::str::from_utf8(body).ok()?;
    let top: std::collections::BTreeMap<String, Box<RawValue>> = serde_json::from_str(text).ok()?;
    let Some(opts) = top.get("stream_options") else {
        // The usual case: the field goes in first, the client's text follows untouched.
        let open = text.find('{')?;
        let rest = &text[open + 1..];
        let sep = if rest.trim_start().starts_with('}') { "" } else { "," };
        return Some(format!("{{\"stream_options\":{{\"include_usage\":true}}{sep}{rest}").into_bytes());
    };
    // The client sent stream options without usage: that one object is rewritten (its
    // members are flags), the rest of the body is carried as raw text.
    let mut o: serde_json::Map<String, serde_json::Value> = serde_json::from_str(opts.get()).unwrap_or_default();
    o.insert("include_usage".into(), serde_json::Value::Bool(true));
    let mut top = top;
    top.insert(
        "stream_options".into(),
        RawValue::from_string(serde_json::to_string(&o).ok()?).ok()?,
    );
    serde_json::to_vec(&top).ok()
}

/// Whether `model` is a plausible model name: what goes into an upstream URL path (Gemini)
/// must not smuggle path segments or queries.
pub fn valid_model_name(model: &str) -> bool {
    !model.is_empty()
        && model.len() <= 256
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._@:/".contains(&b))
        && !model.contains("..")
}

/// Validates a request body of `format` for `api`. For Gemini the model and the
/// streaming flag come from the URL, so the caller passes them.
pub fn parse_request(
    format: Format,
    api: Api,
    path_model: Option<&str>,
    path_stream: bool,
    body: &[u8],
) -> Result<ParsedRequest, RequestError> {
    require_object(body)?;
    let estimated_input_tokens = crate::tokens::estimate_input_tokens(format, api, body);
    let plain = |model: String| ParsedRequest {
        model,
        stream: false,
        include_usage: true,
        max_output_tokens: None,
        estimated_input_tokens,
        conversation: 0,
        continuation: false,
        previous_response_id: None,
        acts_upstream: false,
    };
    let gemini_model = || path_model.unwrap_or_default().to_owned();
    let parsed = match (format, api) {
        (Format::OpenAi, Api::Generate) => {
            let r: OpenAiChat = decode(body)?;
            non_empty("messages", r.messages.len)?;
            ParsedRequest {
                model: r.model,
                stream: r.stream.unwrap_or(false),
                include_usage: r.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
                max_output_tokens: r.max_completion_tokens.or(r.max_tokens),
                estimated_input_tokens,
                conversation: r.messages.opening,
                continuation: r.messages.more,
                previous_response_id: None,
                acts_upstream: false,
            }
        }
        (Format::OpenAi, Api::Responses) => {
            let r: OpenAiResponses = decode(body)?;
            let (conversation, continuation) = match r.input.map(|raw| raw.get()) {
                Some(raw) if raw.starts_with('[') => {
                    let m: Messages = serde_json::from_str(raw)
                        .map_err(|_| RequestError::new(Some("input"), "expected a list of input items"))?;
                    non_empty("input", m.len)?;
                    (m.opening, m.more)
                }
                Some(raw) if raw.starts_with('"') => {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    raw.hash(&mut h);
                    (h.finish(), false)
                }
                Some(_) => {
                    return Err(RequestError::new(
                        Some("input"),
                        "expected a string or a list of input items",
                    ));
                }
                None => (0, false),
            };
            ParsedRequest {
                model: r.model,
                stream: r.stream.unwrap_or(false),
                // Responses streams always end with their usage (`response.completed`).
                include_usage: true,
                max_output_tokens: r.max_output_tokens,
                estimated_input_tokens,
                conversation,
                // A turn naming the response it follows is routed by that response (its
                // holder), not by a hash of this turn's text.
                continuation,
                previous_response_id: r.previous_response_id,
                acts_upstream: r.background.unwrap_or(false) || r.tools.iter().any(|t| !t.runs_elsewhere()),
            }
        }
        (Format::OpenAi, Api::Embeddings) => {
            let r: OpenAiEmbeddings = decode(body)?;
            match r.input {
                EmbeddingInput::Text(t) if t.is_empty() => {
                    return Err(RequestError::new(Some("input"), "must not be empty"));
                }
                EmbeddingInput::Many(v) => non_empty("input", v.len())?,
                EmbeddingInput::Text(_) => {}
            }
            plain(r.model)
        }
        (Format::Anthropic, Api::Generate) => {
            let r: AnthropicMessages = decode(body)?;
            non_empty("messages", r.messages.len)?;
            if r.max_tokens == 0 {
                return Err(RequestError::new(Some("max_tokens"), "must be at least 1"));
            }
            ParsedRequest {
                model: r.model,
                stream: r.stream.unwrap_or(false),
                include_usage: true,
                max_output_tokens: Some(r.max_tokens),
                estimated_input_tokens,
                conversation: r.messages.opening,
                continuation: r.messages.more,
                previous_response_id: None,
                acts_upstream: false,
            }
        }
        (Format::Anthropic, Api::CountTokens) => {
            let r: AnthropicCountTokens = decode(body)?;
            non_empty("messages", r.messages.len)?;
            plain(r.model)
        }
        (Format::Gemini, Api::Generate) => {
            let r: GeminiGenerate = decode(body)?;
            non_empty("contents", r.contents.len)?;
            ParsedRequest {
                model: gemini_model(),
                stream: path_stream,
                include_usage: true,
                max_output_tokens: r.generation_config.and_then(|g| g.max_output_tokens),
                estimated_input_tokens,
                conversation: r.contents.opening,
                continuation: r.contents.more,
                previous_response_id: None,
                acts_upstream: false,
            }
        }
        (Format::Gemini, Api::Embeddings) => {
            let r: GeminiEmbed = decode(body)?;
            match (r.content, r.requests) {
                (_, Some(reqs)) => non_empty("requests", reqs.len())?,
                (Some(_), None) => {}
                (None, None) => return Err(RequestError::new(Some("content"), "is required")),
            }
            plain(gemini_model())
        }
        (Format::Gemini, Api::CountTokens) => {
            let _: serde::de::IgnoredAny = decode(body)?;
            plain(gemini_model())
        }
        (format, api) => {
            return Err(RequestError::new(
                None,
                format!("the {format} format has no {} endpoint", api.as_str()),
            ));
        }
    };
    if !valid_model_name(&parsed.model) {
        return Err(RequestError::new(Some("model"), "must be a non-empty model name"));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a5_every_api_of_every_format_names_its_missing_or_empty_field() {
        // spec: A5
        let ok = |f, api, model: Option<&str>, body: &str| {
            parse_request(f, api, model, false, body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
        };
        let r = ok(
            Format::OpenAi,
            Api::Responses,
            None,
            r#"{"model":"gpt-4o-mini","input":"hi","stream":true}"#,
        );
        assert!(r.stream && r.include_usage && !r.continuation);
        let r = ok(
            Format::OpenAi,
            Api::Responses,
            None,
            r#"{"model":"gpt-4o-mini","input":"and then?","previous_response_id":"resp_1"}"#,
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert!(!r.acts_upstream);
        let acts = |body: &str| ok(Format::OpenAi, Api::Responses, None, body).acts_upstream;
        assert!(acts(
            r#"{"model":"m","input":"x","tools":[{"type":"mcp","server_url":"https://x"}]}"#
        ));
        assert!(acts(
            r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f"},{"type":"code_interpreter"}]}"#
        ));
        assert!(acts(r#"{"model":"m","input":"x","background":true}"#));
        assert!(!acts(
            r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f"},{"type":"web_search"}]}"#
        ));
        // The list form: messages, tool output, images, as the SDKs send multi-turn input.
        let items = r#"{"model":"m","input":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"input_text","text":"hi"}]},
            {"type":"function_call_output","call_id":"c1","output":"42"}]}"#;
        let r = ok(Format::OpenAi, Api::Responses, None, items);
        assert!(r.continuation, "items after the opening continue a conversation");
        let opening = ok(
            Format::OpenAi,
            Api::Responses,
            None,
            r#"{"model":"m","input":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"input_text","text":"hi"}]}]}"#,
        );
        assert_eq!((opening.conversation, opening.continuation), (r.conversation, false));
        assert_eq!(
            ok(
                Format::OpenAi,
                Api::Embeddings,
                None,
                r#"{"model":"e","input":["a","b"]}"#
            )
            .model,
            "e"
        );
        ok(
            Format::Anthropic,
            Api::CountTokens,
            None,
            r#"{"model":"c","messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(
            ok(
                Format::Gemini,
                Api::Embeddings,
                Some("g"),
                r#"{"content":{"parts":[]}}"#
            )
            .model,
            "g"
        );
        ok(
            Format::Gemini,
            Api::Embeddings,
            Some("g"),
            r#"{"requests":[{"content":{}}]}"#,
        );
        ok(Format::Gemini, Api::CountTokens, Some("g"), r#"{"contents":[]}"#);
        let bad = [
            (Format::OpenAi, Api::Responses, r#"{"input":"x"}"#, "model"),
            (Format::OpenAi, Api::Responses, r#"{"model":"m","input":[]}"#, "input"),
            (Format::OpenAi, Api::Responses, r#"{"model":"m","input":7}"#, "input"),
            (Format::OpenAi, Api::Embeddings, r#"{"model":"e","input":[]}"#, "input"),
            (Format::OpenAi, Api::Embeddings, r#"{"model":"e","input":""}"#, "input"),
            (Format::OpenAi, Api::Embeddings, r#"{"model":"e"}"#, "input"),
            (
                Format::Anthropic,
                Api::CountTokens,
                r#"{"model":"c","messages":[]}"#,
                "messages",
            ),
            (Format::Gemini, Api::Embeddings, r#"{}"#, "content"),
            (Format::Gemini, Api::Embeddings, r#"{"requests":[]}"#, "requests"),
        ];
        for (f, api, body, field) in bad {
            let e = parse_request(f, api, Some("g"), false, body.as_bytes()).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{body}: {e}");
        }
        let e = parse_request(Format::Anthropic, Api::Embeddings, None, false, b"{}").unwrap_err();
        assert!(e.to_string().contains("no embeddings endpoint"), "{e}");
    }

    #[test]
    fn d4_a_conversation_hashes_the_same_on_every_turn() {
        // spec: D4
        let conv = |f: Format, body: &str| {
            parse_request(f, Api::Generate, Some("g"), false, body.as_bytes())
                .unwrap()
                .conversation
        };
        let sys = r#"{"role":"system","content":"You are terse."}"#;
        let u1 = r#"{"role":"user","content":"Hello"}"#;
        let a1 = r#"{"role":"assistant","content":"Hi"}"#;
        let u2 = r#"{"role":"user","content":"More"}"#;
        let turn1 = format!(r#"{{"model":"m","messages":[{sys},{u1}]}}"#);
        let turn2 = format!(r#"{{"model":"m","messages":[{sys},{u1},{a1},{u2}]}}"#);
        assert_eq!(conv(Format::OpenAi, &turn1), conv(Format::OpenAi, &turn2));
        let cont = |body: &str| {
            parse_request(Format::OpenAi, Api::Generate, None, false, body.as_bytes())
                .unwrap()
                .continuation
        };
        assert!(
            !cont(&turn1) && cont(&turn2),
            "only a later turn continues a conversation"
        );
        // Another conversation of the same application (same system prompt) differs.
        let other = format!(r#"{{"model":"m","messages":[{sys},{u2}]}}"#);
        assert_ne!(conv(Format::OpenAi, &turn1), conv(Format::OpenAi, &other));
        let an1 = format!(r#"{{"model":"m","max_tokens":5,"messages":[{u1}]}}"#);
        let an2 = format!(r#"{{"model":"m","max_tokens":5,"messages":[{u1},{a1},{u2}]}}"#);
        assert_eq!(conv(Format::Anthropic, &an1), conv(Format::Anthropic, &an2));
        let g1 = r#"{"contents":[{"role":"user","parts":[{"text":"Hello"}]}]}"#;
        let g2 =
            r#"{"contents":[{"role":"user","parts":[{"text":"Hello"}]},{"role":"model","parts":[{"text":"Hi"}]}]}"#;
        assert_eq!(conv(Format::Gemini, g1), conv(Format::Gemini, g2));
    }

    fn err(format: Format, body: &str) -> RequestError {
        parse_request(format, Api::Generate, Some("gemini-2.5-flash"), false, body.as_bytes()).unwrap_err()
    }

    #[test]
    fn a5_valid_requests_parse() {
        // spec: A5
        let r = parse_request(Format::OpenAi, Api::Generate, None, false,
            br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5}"#).unwrap();
        assert_eq!(r.model, "gpt-4o-mini");
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_output_tokens, Some(5));
        let r = parse_request(
            Format::Anthropic,
            Api::Generate,
            None,
            false,
            br#"{"model":"claude-haiku-4-5","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert!(!r.stream);
        let r = parse_request(
            Format::Gemini,
            Api::Generate,
            Some("gemini-2.5-flash"),
            true,
            br#"{"contents":[{"parts":[{"text":"hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.model, "gemini-2.5-flash");
        assert!(r.stream);
    }

    #[test]
    fn a5_wrong_types_name_the_field() {
        // spec: A5
        let e = err(Format::OpenAi, r#"{"model":"m","messages":"hi"}"#);
        assert_eq!(e.field.as_deref(), Some("messages"));
        let e = err(Format::OpenAi, r#"{"model":5,"messages":[]}"#);
        assert_eq!(e.field.as_deref(), Some("model"));
        let e = err(Format::OpenAi, r#"{"model":"m","messages":[{}],"stream":"yes"}"#);
        assert_eq!(e.field.as_deref(), Some("stream"));
        let e = err(Format::Anthropic, r#"{"model":"m","messages":[{}]}"#);
        assert_eq!(e.field.as_deref(), Some("max_tokens"));
        assert_eq!(e.message, "is required");
        let e = err(Format::Gemini, r#"{"contents":{}}"#);
        assert_eq!(e.field.as_deref(), Some("contents"));
        let e = err(Format::OpenAi, r#"{"model":"m","messages":[]}"#);
        assert_eq!(e.field.as_deref(), Some("messages"));
        let e = err(
            Format::OpenAi,
            r#"{"model":"m","messages":[{}],"stream_options":{"include_usage":1}}"#,
        );
        assert_eq!(e.field.as_deref(), Some("stream_options.include_usage"));
    }

    #[test]
    fn a5_malformed_json_is_refused() {
        // spec: A5
        for body in ["", "{", "[1]", "null", "{\"model\":}", "\u{0}"] {
            let e = err(Format::OpenAi, body);
            assert!(e.field.is_none(), "{body}: {e:?}");
            assert!(e.to_string().starts_with("Invalid request"));
        }
    }

    #[test]
    fn a5_one_utf8_json_value_and_nothing_after_it() {
        // spec: A5
        let ok = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert!(parse_request(Format::OpenAi, Api::Generate, None, false, ok.as_bytes()).is_ok());
        assert!(
            parse_request(
                Format::OpenAi,
                Api::Generate,
                None,
                false,
                format!("{ok} \n\t").as_bytes()
            )
            .is_ok()
        );
        for trailing in [format!("{ok}{ok}"), format!("{ok} x"), format!("{ok}]")] {
            let e = parse_request(Format::OpenAi, Api::Generate, None, false, trailing.as_bytes()).unwrap_err();
            assert!(e.message.contains("exactly one JSON value"), "{e}");
        }
        // Invalid UTF-8, even inside a value the gateway never reads.
        let mut bad = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        bad.extend_from_slice(&[0xff, 0xfe]);
        bad.extend_from_slice(br#""}]}"#);
        let e = parse_request(Format::OpenAi, Api::Generate, None, false, &bad).unwrap_err();
        assert!(
            e.message.contains("not valid UTF-8") && e.message.contains("offset 51"),
            "{e}"
        );
    }

    #[test]
    fn a5_errors_never_echo_the_clients_text() {
        // spec: A5, P3
        let secret = "sk-live-4f9a8b7c6d5e";
        for (format, body, field) in [
            (
                Format::OpenAi,
                format!(r#"{{"model":"m","messages":"{secret}"}}"#),
                "messages",
            ),
            (
                Format::OpenAi,
                format!(r#"{{"model":["{secret}"],"messages":[{{}}]}}"#),
                "model",
            ),
            (
                Format::Anthropic,
                format!(r#"{{"model":"m","max_tokens":"{secret}","messages":[{{}}]}}"#),
                "max_tokens",
            ),
            (
                Format::Gemini,
                format!(r#"{{"contents":[{{}}],"generationConfig":{{"maxOutputTokens":"{secret}"}}}}"#),
                "generationConfig.maxOutputTokens",
            ),
            (
                Format::OpenAi,
                format!(r#"{{"model":"{secret} <x>","messages":[{{}}]}}"#),
                "model",
            ),
        ] {
            let e = parse_request(format, Api::Generate, Some("m"), false, body.as_bytes()).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{e}");
            assert!(!e.to_string().contains("sk-live"), "{e}");
            assert!(
                e.message.starts_with("expected") || e.message.starts_with("must"),
                "{e}"
            );
        }
        let e = err(Format::OpenAi, r#"{"model":"m","messages":"hi"}"#);
        assert_eq!(e.message, "expected an array, got a string");
        let e = err(Format::Anthropic, r#"{"model":"m","max_tokens":-1,"messages":[{}]}"#);
        assert_eq!(e.message, "expected u64");
    }

    #[test]
    fn model_names_cannot_smuggle_paths() {
        assert!(valid_model_name("gemini-2.5-flash"));
        assert!(valid_model_name("models/gemini-2.5-flash"));
        assert!(!valid_model_name("../admin"));
        assert!(!valid_model_name("a?b"));
        assert!(!valid_model_name(""));
    }

    #[test]
    fn no_input_panics() {
        // Cheap exhaustive-ish sweep: every prefix of valid bodies and some byte noise.
        let valid = br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
        for f in Format::ALL {
            for i in 0..=valid.len() {
                let _ = parse_request(f, Api::Generate, Some("m"), false, &valid[..i]);
            }
            for seed in 0u32..500 {
                let noise: Vec<u8> = (0..(seed % 40))
                    .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 97) >> 3) as u8)
                    .collect();
                let _ = parse_request(f, Api::Generate, Some("m"), false, &noise);
            }
        }
    }
    #[test]
    fn m2_asking_for_stream_usage_keeps_the_clients_json_as_written() {
        // spec: M2
        let body = br#"{"model":"gpt-4o","stream":true,"seed":18446744073709551615,"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object","properties":{"reasoning":{"type":"string"},"answer":{"type":"string"}}}}}}"#;
        let out = String::from_utf8(with_stream_usage(body).unwrap()).unwrap();
        assert!(
            out.starts_with(r#"{"stream_options":{"include_usage":true},"model":"gpt-4o""#),
            "{out}"
        );
        // The schema's property order and a u64 beyond f64 survive untouched.
        assert!(
            out.contains(r#""properties":{"reasoning":{"type":"string"},"answer":{"type":"string"}}"#),
            "{out}"
        );
        assert!(out.contains("18446744073709551615"), "{out}");
        // Stream options the client set are kept, with usage turned on.
        let body = br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"include_obfuscation":false},"messages":[{"role":"user","content":"hi"}]}"#;
        let v: serde_json::Value = serde_json::from_slice(&with_stream_usage(body).unwrap()).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true, "include_obfuscation": false})
        );
        assert_eq!(v["messages"][0]["content"], "hi");
        // Not an object stays refused; garbage in stream_options becomes just usage.
        assert!(with_stream_usage(b"[1]").is_none());
        let v: serde_json::Value =
            serde_json::from_slice(&with_stream_usage(br#"{"stream_options":7}"#).unwrap()).unwrap();
        assert_eq!(v["stream_options"], serde_json::json!({"include_usage": true}));
    }
}
