//! M3's input-token estimate before the call: how many input tokens a request will be
//! billed for, counted from its body before it is sent, so that what a request may cost is
//! known while it can still be refused or routed, not only once the provider reports usage
//! (M2).
//!
//! OpenAI requests are counted exactly with o200k_base, the tokenizer of GPT-4o, GPT-4.1,
//! GPT-5 and the o-series. Anthropic and Gemini publish no local tokenizer: their text is
//! counted with o200k and scaled by a per-format factor. Images, audio and documents, whose
//! tokens depend on pixels, seconds and pages this crate does not decode, are fixed
//! estimates. Only what the provider tokenizes is counted: text, tool calls, tool
//! definitions, and the framing each message adds; never ids, model names or settings.
//!
//! The vocabulary is built into the binary (build.rs) and indexed on first use by a
//! background thread, so that no request waits for it and an idle gateway never holds it;
//! until it is ready the estimate counts the same text's bytes instead.

use crate::json::Json;
use crate::{Api, Format};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Once, OnceLock};

/// o200k_base's ordinary tokens, written by build.rs: for each rank in order, one length
/// byte and then the token's bytes.
static O200K_BIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/o200k.bin"));

/// The alternatives of o200k_base's pre-tokenizer before its two whitespace-only ones.
macro_rules! o200k_words {
    () => {
        concat!(
            r#"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"#,
            "|",
            r#"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"#,
            "|",
            r#"\p{N}{1,3}"#,
            "|",
            r#" ?[^\s\p{L}\p{N}]+[\r\n/]*"#,
            "|",
            r#"\s*[\r\n]+"#,
            "|",
        )
    };
}

/// o200k_base's pre-tokenizer, exactly as tiktoken has it (`O200K_BASE_PAT_STR`): text is
/// split by it first, and byte-pair merges never cross a split. Its one look-ahead
/// (`\s+(?!\S)`) needs a backtracking engine; [`O200K_SPLIT`] is the same split without it.
#[cfg(test)]
const O200K_PAT: &str = concat!(o200k_words!(), r#"\s+(?!\S)|\s+"#);

/// [`O200K_PAT`] without `\s+(?!\S)`, for an automaton: one pass per piece, where the
/// backtracking engine tried the alternatives one by one (most of an estimate's time, and
/// about 2 % of the gateway's CPU per request in the closed-loop profile). [`pieces`]
/// gives back what the look-ahead did.
const O200K_SPLIT: &str = concat!(o200k_words!(), r#"\s+"#);

/// The pieces o200k's pre-tokenizer splits `text` into, by [`O200K_SPLIT`].
///
/// Where the full pattern would take `\s+(?!\S)`, this one takes `\s+`, the whole run:
/// at a run with no line break (one with a line break is `\s*[\r\n]+`'s, tried first in
/// both), followed by more text, the look-ahead keeps all of the run but its last
/// character, which then begins the next piece (` word`); a lone space before text fails
/// the look-ahead and is `\s+`'s in both; at the end of the text both take the run. No
/// other alternative matches whitespace alone, and none matches nothing, so every step
/// moves on.
fn pieces<'t>(re: &'t regex_automata::meta::Regex, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
    let mut at = 0;
    std::iter::from_fn(move || {
        let input = regex_automata::Input::new(text).range(at..);
        // Every character begins some piece, so the next one starts here: an anchored
        // search needs no backward pass to find where it starts.
        let m = re
            .search(&input.clone().anchored(regex_automata::Anchored::Yes))
            .or_else(|| re.search(&input))?;
        let (start, mut end) = (m.start(), m.end());
        let piece = &text[start..end];
        if end < text.len() && !piece.ends_with(['\r', '\n']) && piece.chars().all(char::is_whitespace) {
            let last = piece.char_indices().next_back().map_or(0, |(i, _)| i);
            if last > 0 {
                end = start + last;
            }
        }
        at = end;
        Some(&text[start..end])
    })
}

/// A byte-pair encoder that only counts, over a compact table: ~2 MiB where tiktoken's
/// encoder holds ~46 MiB (each token's bytes three times, in hash maps).
pub struct Bpe {
    /// The built-in vocabulary itself (length-prefixed records), read in place rather than
    /// copied: the pages it touches are the binary's own.
    bytes: &'static [u8],
    /// `n + 1` offsets: token `r` is the record at `starts[r]` (its length byte, then its
    /// bytes), which ends where record `r + 1` starts.
    starts: Vec<u32>,
    /// Open addressing with linear probing, a power of two at least 1.25 × `n` long
    /// (three quarters full: 1 MiB, where twice `n` would take 2 MiB for probes a few
    /// compares shorter): `rank + 1` of the token hashed there, 0 for empty.
    table: Vec<u32>,
    re: regex_automata::meta::Regex,
}

/// FNV-1a 64, with its high half folded in: a multiply only carries bits upwards, so the
/// low bits the table mask keeps are the weakest on their own.
fn slot(bytes: &[u8]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h ^ (h >> 32)) as usize
}

impl Bpe {
    /// Indexes a vocabulary in build.rs's format. A truncated record ends it (the build
    /// checks the file, so this only keeps a damaged one from panicking).
    fn load(blob: &'static [u8]) -> Bpe {
        let mut starts = Vec::with_capacity(200_001);
        let mut at = 0usize;
        while let Some(&len) = blob.get(at) {
            let end = at + 1 + usize::from(len);
            if len == 0 || end > blob.len() {
                break;
            }
            starts.push(at as u32);
            at = end;
        }
        starts.push(at as u32);
        let n = starts.len() - 1;
        let mut bpe = Bpe {
            bytes: blob,
            starts,
            table: Vec::new(),
            re: regex_automata::meta::Regex::new(O200K_SPLIT).expect("the o200k pattern compiles"),
        };
        let mut table = vec![0u32; (n + n / 4).max(2).next_power_of_two()];
        let mask = table.len() - 1;
        for rank in 0..n as u32 {
            let mut i = slot(bpe.token(rank)) & mask;
            while table[i] != 0 {
                i = (i + 1) & mask;
            }
            table[i] = rank + 1;
        }
        bpe.table = table;
        bpe
    }

    /// Token `rank`'s bytes; `rank` must be below the vocabulary size.
    fn token(&self, rank: u32) -> &[u8] {
        let r = rank as usize;
        &self.bytes[self.starts[r] as usize + 1..self.starts[r + 1] as usize]
    }

    /// The rank of the token whose bytes are exactly `piece`, if there is one.
    fn rank(&self, piece: &[u8]) -> Option<u32> {
        let mask = self.table.len() - 1;
        let mut i = slot(piece) & mask;
        loop {
            // The table is at most half full, so an empty slot always ends the probe.
            let entry = self.table[i];
            if entry == 0 {
                return None;
            }
            if self.token(entry - 1) == piece {
                return Some(entry - 1);
            }
            i = (i + 1) & mask;
        }
    }

    /// How many tokens `text` encodes to: exactly tiktoken's `encode_ordinary(text).len()`
    /// (text such as `<|endoftext|>` is ordinary text here, never a special token).
    pub fn count(&self, text: &str) -> usize {
        pieces(&self.re, text)
            .map(|piece| {
                let piece = piece.as_bytes();
                if self.rank(piece).is_some() {
                    1
                } else {
                    self.piece_count(piece)
                }
            })
            .sum()
    }

    /// One piece's tokens: exact up to [`MAX_EXACT_PIECE`] bytes; past it (a long run
    /// without a split, which only a crafted body sends) a byte estimate, so no piece costs
    /// more than a bounded merge.
    fn piece_count(&self, piece: &[u8]) -> usize {
        if piece.len() > MAX_EXACT_PIECE {
            piece.len().div_ceil(4)
        } else {
            self.merge_count(piece)
        }
    }

    /// tiktoken's `byte_pair_encode`, counting: the pieces left once the lowest-ranked
    /// adjacent pair has been merged until no adjacent pair is a token. Long pieces take
    /// tiktoken's heap version, as tiktoken does from 100 bytes, so a long unbroken word
    /// costs O(n log n) rather than O(n²).
    fn merge_count(&self, piece: &[u8]) -> usize {
        if piece.len() < 2 {
            return piece.len();
        }
        if piece.len() >= 100 {
            return self.merge_count_large(piece);
        }
        // (start, rank of the pair starting here), as tiktoken's `_byte_pair_merge`.
        let mut parts: Vec<(usize, u32)> = Vec::with_capacity(piece.len() + 1);
        let mut min_rank = (u32::MAX, usize::MAX);
        for i in 0..piece.len() - 1 {
            let rank = self.rank(&piece[i..i + 2]).unwrap_or(u32::MAX);
            if rank < min_rank.0 {
                min_rank = (rank, i);
            }
            parts.push((i, rank));
        }
        parts.push((piece.len() - 1, u32::MAX));
        parts.push((piece.len(), u32::MAX));
        // The rank of parts[i] merged with parts[i + 1] once parts[i + 1] has absorbed
        // parts[i + 2] (which is still in the list when this is asked, hence `i + 3`).
        let get_rank = |parts: &[(usize, u32)], i: usize| -> u32 {
            if i + 3 < parts.len() {
                self.rank(&piece[parts[i].0..parts[i + 3].0]).unwrap_or(u32::MAX)
            } else {
                u32::MAX
            }
        };
        while min_rank.0 != u32::MAX {
            let i = min_rank.1;
            if i > 0 {
                parts[i - 1].1 = get_rank(&parts, i - 1);
            }
            parts[i].1 = get_rank(&parts, i);
            parts.remove(i + 1);
            min_rank = (u32::MAX, usize::MAX);
            for (i, &(_, rank)) in parts[..parts.len() - 1].iter().enumerate() {
                if rank < min_rank.0 {
                    min_rank = (rank, i);
                }
            }
        }
        parts.len() - 1
    }

    /// tiktoken's `_byte_pair_merge_large`, counting: the same merges in the same order
    /// (lowest rank first, then leftmost), kept in a heap with stale entries skipped.
    fn merge_count_large(&self, piece: &[u8]) -> usize {
        struct State {
            prev: usize,
            end: usize,
            next_end: usize,
            next_rank: u32,
        }
        let n = piece.len();
        let mut state: Vec<State> = Vec::with_capacity(n);
        state.push(State {
            prev: usize::MAX,
            end: 1,
            next_end: 2,
            next_rank: u32::MAX,
        });
        let mut heap: BinaryHeap<Reverse<(u32, usize)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(rank) = self.rank(&piece[i..i + 2]) {
                heap.push(Reverse((rank, i)));
                state[i].next_rank = rank;
            }
            state.push(State {
                prev: i,
                end: i + 2,
                next_end: i + 3,
                next_rank: u32::MAX,
            });
        }
        let potential_merge =
            |state: &mut Vec<State>, heap: &mut BinaryHeap<Reverse<(u32, usize)>>, start: usize, next_end: usize| {
                state[start].next_end = next_end;
                state[start].next_rank = u32::MAX;
                if next_end <= n
                    && let Some(rank) = self.rank(&piece[start..next_end])
                {
                    heap.push(Reverse((rank, start)));
                    state[start].next_rank = rank;
                }
            };
        while let Some(Reverse((rank, left_start))) = heap.pop() {
            if rank != state[left_start].next_rank {
                continue; // invalidated by an earlier merge
            }
            let right_start = state[left_start].end;
            let right_end = state[left_start].next_end;
            let right_next_end = state[right_start].next_end;
            state[left_start].end = right_end;
            potential_merge(&mut state, &mut heap, left_start, right_next_end);
            if right_end < state.len() {
                state[right_end].prev = left_start;
            }
            if left_start > 0 {
                let prev_start = state[left_start].prev;
                potential_merge(&mut state, &mut heap, prev_start, right_end);
            }
            state[right_start].next_rank = u32::MAX;
        }
        let mut tokens = 0;
        let mut i = 0;
        while i < state.len() {
            tokens += 1;
            i = state[i].end;
        }
        tokens
    }
}

static O200K: OnceLock<Bpe> = OnceLock::new();
static O200K_SPAWN: Once = Once::new();

/// The o200k table if it is loaded. The first call starts loading it on a background
/// thread and, like every call until that is done, returns `None`: loading takes tens of
/// milliseconds that no request should wait for, and a gateway that never estimates never
/// holds the table.
pub fn o200k() -> Option<&'static Bpe> {
    if let Some(bpe) = O200K.get() {
        return Some(bpe);
    }
    O200K_SPAWN.call_once(|| {
        // If no thread can be started, estimates keep counting bytes; nothing else waits.
        let _ = std::thread::Builder::new()
            .name("spillway-tokenizer".to_owned())
            .spawn(|| {
                o200k_blocking();
            });
    });
    O200K.get()
}

/// The o200k table, loading it here (or waiting for the background load) if need be: for
/// tests, and callers that can wait.
pub fn o200k_blocking() -> &'static Bpe {
    O200K.get_or_init(|| Bpe::load(O200K_BIN))
}

/// OpenAI chat framing, from OpenAI's cookbook ("How to count tokens with tiktoken",
/// `num_tokens_from_messages`): every message costs 3 tokens beyond its role and content,
/// a `name` 1 more, and every reply is primed with 3 (`<|start|>assistant<|message|>`).
/// The Responses API frames its items the same way.
const OPENAI_PER_MESSAGE: u64 = 3;
const OPENAI_PER_NAME: u64 = 1;
const OPENAI_REPLY_PRIMING: u64 = 3;
/// A message the request implies rather than lists (Responses `instructions`, a string
/// `input`): its framing and its role, one token.
const OPENAI_IMPLIED_MESSAGE: u64 = OPENAI_PER_MESSAGE + 1;
/// OpenAI's vision pricing: a `low`-detail image is 85 tokens; a high-detail one is 85 plus
/// 170 per 512 px tile, 765 for a 1024×1024 image, taken for `high` and `auto`. An
/// estimate: the image's size is not decoded.
const OPENAI_IMAGE_LOW: u64 = 85;
const OPENAI_IMAGE: u64 = 765;
/// OpenAI's audio models bill input audio at 1 token per 100 ms; a clip's length is not
/// decoded, so this is an estimate for about 20 s.
const OPENAI_AUDIO: u64 = 200;

/// Anthropic documents no message framing; a few tokens per message for its role markers,
/// in Anthropic's tokens (not scaled). An estimate.
const ANTHROPIC_PER_MESSAGE: u64 = 3;
/// Anthropic's vision docs: an image costs about width × height / 750 tokens, about 1,600
/// at the ~1.15 megapixel size larger images are scaled down to. An estimate: the image's
/// size is not decoded.
const ANTHROPIC_IMAGE: u64 = 1_600;
/// Anthropic's PDF docs: 1,500 to 3,000 tokens of text per page, plus each page as an
/// image. An estimate of one page: the page count is not decoded.
const ANTHROPIC_DOCUMENT: u64 = 3_000;
/// Anthropic's tool-use docs: a request with tools gets a tool-use system prompt of 346
/// tokens on Claude 4 models (`tool_choice` auto or none; 313 for any or tool).
const ANTHROPIC_TOOL_PROMPT: u64 = 346;

/// Gemini's token docs: an image up to 384 px on both sides is 258 tokens, a larger one 258
/// per 768×768 tile; video is 263 and audio 32 tokens per second. An estimate of one
/// small image for any inline or file part: its size and kind are not decoded.
const GEMINI_MEDIA: u64 = 258;

/// Provider tokens per o200k token, for the formats without a public local tokenizer.
/// Starting calibrations: the gateway records each request's estimate error against the
/// provider's reported count, so the factors can be checked on real traffic.
const ANTHROPIC_PER_O200K: f64 = 1.2;
const GEMINI_PER_O200K: f64 = 1.0;

/// Nesting the walk follows at most (tool results inside tool results, Gemini requests
/// inside requests). serde_json already refuses bodies nested past 128 levels; this keeps
/// the walk's own recursion bounded whatever the parser allows.
const MAX_DEPTH: u32 = 64;

/// What a request's counted fields add up to.
/// Text counted exactly per request; past it, the rest is counted at the rate measured
/// on what was counted, so a 16 MiB body costs a request a bounded, small time on the
/// request path (about a millisecond) and no more memory than its pieces.
const MAX_EXACT_TEXT: usize = 64 * 1024;
/// A piece (a run the pre-tokenizer does not split) merged exactly; longer ones are
/// estimated by their bytes.
const MAX_EXACT_PIECE: usize = 4096;

struct Tally {
    /// `None` until the table has loaded: text is then counted in bytes.
    bpe: Option<&'static Bpe>,
    /// Bytes of text counted exactly so far, and past the cap (estimated at the end).
    exact_bytes: usize,
    rest_bytes: usize,
    /// Counted text: o200k tokens, or bytes without the table. Scaled per format.
    text: u64,
    /// Tokens already in the provider's own units (framing, media, token ids): not scaled.
    tokens: u64,
}

impl Tally {
    fn new(bpe: Option<&'static Bpe>) -> Tally {
        Tally {
            bpe,
            exact_bytes: 0,
            rest_bytes: 0,
            text: 0,
            tokens: 0,
        }
    }

    fn text(&mut self, s: &str) {
        let n = match self.bpe {
            Some(bpe) => {
                let left = MAX_EXACT_TEXT.saturating_sub(self.exact_bytes);
                let mut cut = s.len().min(left);
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                self.exact_bytes += cut;
                self.rest_bytes += s.len() - cut;
                bpe.count(&s[..cut])
            }
            None => s.len(),
        };
        self.text = self.text.saturating_add(n as u64);
    }

    /// `v` if it is a string; anything else is not what the provider reads there.
    fn text_of(&mut self, v: Option<&Json<'_>>) {
        if let Some(s) = v.and_then(Json::as_str) {
            self.text(s);
        }
    }

    /// A structured value the provider renders as text (tool schemas, call arguments):
    /// counted as its JSON.
    fn json(&mut self, v: &Json<'_>) {
        if let Ok(s) = serde_json::to_string(v) {
            self.text(&s);
        }
    }

    fn tokens(&mut self, n: u64) {
        self.tokens = self.tokens.saturating_add(n);
    }

    /// The estimate: counted text scaled to the provider's tokens, rounded up, plus the
    /// tokens already in its units.
    fn total(&self, per_o200k: f64) -> u64 {
        let text = match self.bpe {
            // The text past the cap at the rate of the text before it.
            Some(_) if self.rest_bytes > 0 => {
                let rate = self.text as f64 / self.exact_bytes.max(1) as f64;
                self.text.saturating_add((self.rest_bytes as f64 * rate).ceil() as u64)
            }
            Some(_) => self.text,
            None => self.text.div_ceil(4),
        };
        // In thousandths and integers: in floating point `ceil(5.0 * 1.2)` is 7.
        let milli = (per_o200k * 1000.0).round() as u64;
        text.saturating_mul(milli).div_ceil(1000).saturating_add(self.tokens)
    }
}

/// The array at `v`, or nothing if it is absent or not an array.
fn arr<'v, 'a>(v: Option<&'v Json<'a>>) -> &'v [Json<'a>] {
    v.and_then(Json::as_array).unwrap_or(&[])
}

/// A Gemini field under its JSON name or its proto name (Google's JSON parser takes both).
fn gemini_field<'v, 'a>(v: &'v Json<'a>, camel: &str, snake: &str) -> Option<&'v Json<'a>> {
    let present = |x: &&Json<'a>| !x.is_null();
    v.get(camel).filter(present).or_else(|| v.get(snake).filter(present))
}

/// The estimate of a request's input tokens, from its body as the client sent it. Never
/// panics: a body that is not JSON, or not an object, is estimated at a token per 4 bytes,
/// and fields of unexpected types are skipped.
pub fn estimate_input_tokens(format: Format, api: Api, body: &[u8]) -> u64 {
    let by_bytes = (body.len() as u64).div_ceil(4);
    let Ok(v) = Json::parse(body) else {
        return by_bytes;
    };
    if !v.is_object() {
        return by_bytes;
    }
    let mut t = Tally::new(o200k());
    let per_o200k = match format {
        Format::OpenAi => {
            match api {
                Api::Responses => openai_responses(&v, &mut t),
                Api::Embeddings => openai_embeddings(&v, &mut t),
                Api::Generate | Api::CountTokens => openai_chat(&v, &mut t),
            }
            1.0
        }
        Format::Anthropic => {
            anthropic(&v, &mut t);
            ANTHROPIC_PER_O200K
        }
        Format::Gemini => {
            gemini(&v, &mut t, 0);
            GEMINI_PER_O200K
        }
    };
    t.total(per_o200k)
}

/// OpenAI chat completions: every message's role, content, name and tool calls, with the
/// cookbook's framing; and the tools offered.
fn openai_chat(body: &Json<'_>, t: &mut Tally) {
    for m in arr(body.get("messages")) {
        t.tokens(OPENAI_PER_MESSAGE);
        t.text_of(m.get("role"));
        openai_content(m.get("content"), t);
        if let Some(name) = m.get("name").and_then(Json::as_str) {
            t.tokens(OPENAI_PER_NAME);
            t.text(name);
        }
        for call in arr(m.get("tool_calls")) {
            if let Some(f) = call.get("function") {
                t.text_of(f.get("name"));
                t.text_of(f.get("arguments"));
            }
        }
        // The deprecated single `function_call`, still accepted.
        if let Some(f) = m.get("function_call") {
            t.text_of(f.get("name"));
            t.text_of(f.get("arguments"));
        }
    }
    t.tokens(OPENAI_REPLY_PRIMING);
    for tool in arr(body.get("tools")).iter().chain(arr(body.get("functions"))) {
        tool_definition(tool, t);
    }
}

/// OpenAI content: a string, or a list of parts (chat's and the Responses API's alike).
fn openai_content(content: Option<&Json<'_>>, t: &mut Tally) {
    match content {
        Some(Json::String(s)) => t.text(s),
        Some(Json::Array(parts)) => {
            for part in parts {
                openai_part(part, t);
            }
        }
        _ => {}
    }
}

fn openai_part(part: &Json<'_>, t: &mut Tally) {
    match part.get("type").and_then(Json::as_str) {
        Some("text" | "input_text" | "output_text") => t.text_of(part.get("text")),
        Some("refusal") => t.text_of(part.get("refusal")),
        Some("image_url") => t.tokens(openai_image(part.get("image_url").and_then(|i| i.get("detail")))),
        Some("input_image") => t.tokens(openai_image(part.get("detail"))),
        Some("input_audio") => t.tokens(OPENAI_AUDIO),
        _ => {}
    }
}

fn openai_image(detail: Option<&Json<'_>>) -> u64 {
    match detail.and_then(Json::as_str) {
        Some("low") => OPENAI_IMAGE_LOW,
        _ => OPENAI_IMAGE,
    }
}

/// OpenAI Responses: `instructions`, then `input` (a string, or items: messages, function
/// calls and their outputs), and the tools offered.
fn openai_responses(body: &Json<'_>, t: &mut Tally) {
    if let Some(s) = body.get("instructions").and_then(Json::as_str) {
        t.tokens(OPENAI_IMPLIED_MESSAGE);
        t.text(s);
    }
    match body.get("input") {
        Some(Json::String(s)) => {
            t.tokens(OPENAI_IMPLIED_MESSAGE);
            t.text(s);
        }
        Some(Json::Array(items)) => {
            for item in items {
                t.tokens(OPENAI_PER_MESSAGE);
                match item.get("type").and_then(Json::as_str) {
                    None | Some("message") => {
                        t.text_of(item.get("role"));
                        openai_content(item.get("content"), t);
                    }
                    Some("function_call" | "custom_tool_call") => {
                        t.text_of(item.get("name"));
                        t.text_of(item.get("arguments"));
                        t.text_of(item.get("input"));
                    }
                    // A string, or (newer) a list of content parts.
                    Some("function_call_output" | "custom_tool_call_output") => openai_content(item.get("output"), t),
                    _ => {}
                }
            }
        }
        _ => {}
    }
    t.tokens(OPENAI_REPLY_PRIMING);
    for tool in arr(body.get("tools")) {
        tool_definition(tool, t);
    }
}

/// OpenAI embeddings `input`: text is counted; token ids are tokens already, exactly.
fn openai_embeddings(body: &Json<'_>, t: &mut Tally) {
    match body.get("input") {
        Some(Json::String(s)) => t.text(s),
        Some(Json::Array(inputs)) => {
            for input in inputs {
                match input {
                    Json::String(s) => t.text(s),
                    Json::Number(_) => t.tokens(1),
                    Json::Array(ids) => t.tokens(ids.len() as u64),
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

/// A tool the model is offered: its name, description and parameter schema as JSON.
/// OpenAI chat nests them under `function`; the Responses API and Anthropic do not (and
/// Anthropic calls the schema `input_schema`). A tool with none of them (a hosted tool
/// such as `{"type":"web_search"}`) is counted as its own JSON.
fn tool_definition(tool: &Json<'_>, t: &mut Tally) {
    let f = tool.get("function").filter(|f| f.is_object()).unwrap_or(tool);
    let mut any = false;
    for key in ["name", "description"] {
        if let Some(s) = f.get(key).and_then(Json::as_str) {
            t.text(s);
            any = true;
        }
    }
    for key in ["parameters", "input_schema"] {
        if let Some(schema) = f.get(key) {
            t.json(schema);
            any = true;
        }
    }
    if !any && tool.is_object() {
        t.json(tool);
    }
}

/// Anthropic messages (and count_tokens): the system prompt, each message's content, and
/// the tools offered with the system prompt Anthropic adds for them.
fn anthropic(body: &Json<'_>, t: &mut Tally) {
    anthropic_content(body.get("system"), t, 0);
    for m in arr(body.get("messages")) {
        t.tokens(ANTHROPIC_PER_MESSAGE);
        anthropic_content(m.get("content"), t, 0);
    }
    let tools = arr(body.get("tools"));
    if !tools.is_empty() {
        t.tokens(ANTHROPIC_TOOL_PROMPT);
    }
    for tool in tools {
        tool_definition(tool, t);
    }
}

/// Anthropic content: a string, or a list of blocks.
fn anthropic_content(content: Option<&Json<'_>>, t: &mut Tally, depth: u32) {
    if depth > MAX_DEPTH {
        return;
    }
    match content {
        Some(Json::String(s)) => t.text(s),
        Some(Json::Array(blocks)) => {
            for block in blocks {
                anthropic_block(block, t, depth);
            }
        }
        _ => {}
    }
}

fn anthropic_block(block: &Json<'_>, t: &mut Tally, depth: u32) {
    match block.get("type").and_then(Json::as_str) {
        Some("text") => t.text_of(block.get("text")),
        Some("thinking") => t.text_of(block.get("thinking")),
        Some("tool_use" | "server_tool_use") => {
            t.text_of(block.get("name"));
            if let Some(input) = block.get("input") {
                t.json(input);
            }
        }
        Some("tool_result") => anthropic_content(block.get("content"), t, depth + 1),
        Some("image") => t.tokens(ANTHROPIC_IMAGE),
        Some("document") => {
            // Plain-text and content-block documents are text the model reads as such;
            // only a PDF (or a file by reference) needs the page estimate.
            let source = block.get("source");
            match source.and_then(|s| s.get("type")).and_then(Json::as_str) {
                Some("text") => t.text_of(source.and_then(|s| s.get("data"))),
                Some("content") => anthropic_content(source.and_then(|s| s.get("content")), t, depth + 1),
                _ => t.tokens(ANTHROPIC_DOCUMENT),
            }
        }
        Some("search_result") => {
            t.text_of(block.get("title"));
            anthropic_content(block.get("content"), t, depth + 1);
        }
        _ => {}
    }
}

/// Gemini generateContent, countTokens, embedContent and batchEmbedContents alike: the
/// system instruction, `contents` (a list, or one content), `content` (embedContent),
/// `requests` (batchEmbedContents), countTokens' `generateContentRequest`, and tools.
fn gemini(body: &Json<'_>, t: &mut Tally, depth: u32) {
    if depth > MAX_DEPTH {
        return;
    }
    if let Some(system) = gemini_field(body, "systemInstruction", "system_instruction") {
        gemini_content(system, t);
    }
    match body.get("contents") {
        Some(Json::Array(contents)) => {
            for content in contents {
                gemini_content(content, t);
            }
        }
        Some(content @ Json::Object(_)) => gemini_content(content, t),
        _ => {}
    }
    if let Some(content) = body.get("content") {
        gemini_content(content, t);
    }
    for request in arr(body.get("requests")) {
        gemini(request, t, depth + 1);
    }
    if let Some(request) = gemini_field(body, "generateContentRequest", "generate_content_request") {
        gemini(request, t, depth + 1);
    }
    for tool in arr(body.get("tools")) {
        t.json(tool);
    }
}

/// A Gemini content's parts.
fn gemini_content(content: &Json<'_>, t: &mut Tally) {
    for part in arr(content.get("parts")) {
        t.text_of(part.get("text"));
        if let Some(call) = gemini_field(part, "functionCall", "function_call") {
            t.text_of(call.get("name"));
            if let Some(args) = call.get("args") {
                t.json(args);
            }
        }
        if let Some(response) = gemini_field(part, "functionResponse", "function_response") {
            t.json(response);
        }
        if gemini_field(part, "inlineData", "inline_data").is_some()
            || gemini_field(part, "fileData", "file_data").is_some()
        {
            t.tokens(GEMINI_MEDIA);
        }
        if let Some(code) = gemini_field(part, "executableCode", "executable_code") {
            t.text_of(code.get("code"));
        }
        if let Some(result) = gemini_field(part, "codeExecutionResult", "code_execution_result") {
            t.text_of(result.get("output"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpe() -> &'static Bpe {
        o200k_blocking()
    }

    fn c(s: &str) -> u64 {
        bpe().count(s) as u64
    }

    fn est(format: Format, api: Api, body: &str) -> u64 {
        estimate_input_tokens(format, api, body.as_bytes())
    }

    /// A slow byte-pair encoding by the definition: start from single bytes, merge the
    /// adjacent pair whose joined bytes have the lowest rank (the leftmost on a tie) until
    /// no adjacent pair is a token.
    fn naive_count(bpe: &Bpe, text: &str) -> usize {
        let mut total = 0;
        for piece in tiktoken_pieces(text) {
            let piece = piece.as_bytes();
            if bpe.rank(piece).is_some() {
                total += 1;
                continue;
            }
            let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
            loop {
                let mut best: Option<(u32, usize)> = None;
                for i in 0..parts.len().saturating_sub(1) {
                    let mut joined = parts[i].clone();
                    joined.extend_from_slice(&parts[i + 1]);
                    if let Some(r) = bpe.rank(&joined)
                        && best.is_none_or(|(b, _)| r < b)
                    {
                        best = Some((r, i));
                    }
                }
                let Some((_, i)) = best else { break };
                let right = parts.remove(i + 1);
                parts[i].extend(right);
            }
            total += parts.len();
        }
        total
    }

    /// The pieces tiktoken splits `text` into: its pattern, look-ahead and all, on its
    /// backtracking engine.
    fn tiktoken_pieces(text: &str) -> Vec<&str> {
        static RE: OnceLock<fancy_regex::Regex> = OnceLock::new();
        let re = RE.get_or_init(|| fancy_regex::Regex::new(O200K_PAT).expect("tiktoken's pattern compiles"));
        re.find_iter(text)
            .map(|m| m.expect("within the backtracking limit").as_str())
            .collect()
    }

    fn our_pieces(text: &str) -> Vec<&str> {
        pieces(&bpe().re, text).collect()
    }

    #[test]
    fn m3_the_split_is_tiktoken_s_own() {
        // spec: M3
        let texts = [
            "",
            " ",
            "  ",
            "word",
            " word",
            "  word",
            "   word  ",
            "a  b   c    d",
            "tab\t\tand\u{3000}\u{3000}ideographic",
            "\u{a0}\u{a0}x \u{2003}\u{2003}\u{2003}y",
            "trailing   ",
            "\n",
            "  \n  x",
            "a \n\n  \r\n b",
            "x\r\n\r\n\ty",
            "   !!!  ?? ... // \n//",
            "it's   DON'T  they'LL ſ's",
            "12345 678  9",
            "ǅungla Ǆ x",
            "e\u{301}\u{301} \u{301}",
            "日本語  のテキスト",
            "emoji  🎉🚀  👍🏽",
            "\t",
            " \t \t",
            // Whitespace of every kind Rust and the regex both call whitespace, and the
            // characters either side of the look-ahead.
            "a\u{85}\u{85}b",
            "a\u{2028}\u{2028}b",
            "a \u{2028}\n b",
            "a\u{b}\u{c} b",
            "x \u{85}!",
            "\u{a0}!",
            "a  !",
            "a\t\t!",
            "a  1",
            "a  \u{301}",
            "\r\r  b",
            "A  'S",
            "x\u{180e}\u{180e}y",
            "x\u{200b}\u{200b} \u{feff}y",
        ];
        for text in texts {
            assert_eq!(our_pieces(text), tiktoken_pieces(text), "{text:?}");
            assert_eq!(
                our_pieces(text).concat(),
                text,
                "{text:?}: the pieces are the whole text"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn m3_any_text_splits_as_tiktoken_splits_it(
            // What the split turns on: spaces of several kinds and line breaks beside
            // letters of every case, marks, digits, apostrophes and symbols.
            text in "[ \t\n\r\u{a0}\u{3000}\u{2003}\u{85}\u{2028}\u{2029}\u{b}\u{c}\u{1680}\u{202f}\u{180e}\u{200b}\u{feff}aZǅſ'sStT\u{301}ʰーⅫ²rRevVmMlLdD09٣!?/.日🎉x]{0,40}"
        ) {
            // spec: M3
            proptest::prop_assert_eq!(our_pieces(&text), tiktoken_pieces(&text));
            proptest::prop_assert_eq!(our_pieces(&text).concat(), text);
        }
    }

    #[test]
    fn m3_the_table_holds_every_ordinary_o200k_token_and_finds_each() {
        // spec: M3
        let bpe = bpe();
        let n = bpe.starts.len() - 1;
        // o200k_base's ordinary ranks are 0..=199_997; the special tokens follow.
        assert_eq!(n, 199_998);
        assert!(bpe.table.len().is_power_of_two() && bpe.table.len() >= n + n / 4);
        for rank in 0..n as u32 {
            assert_eq!(bpe.rank(bpe.token(rank)), Some(rank), "rank {rank}");
        }
        // Every single byte is a token (byte-level BPE), so any text can be encoded.
        for b in 0..=255u8 {
            assert!(bpe.rank(&[b]).is_some(), "byte {b}");
        }
        assert_eq!(bpe.rank(b"<|endoftext|>"), None);
    }

    #[test]
    fn m3_loading_happens_once_and_is_shared() {
        // spec: M3
        let loaded = o200k_blocking();
        let seen = o200k().expect("loaded above");
        assert!(std::ptr::eq(loaded, seen));
    }

    #[test]
    fn m3_known_o200k_counts() {
        // spec: M3
        assert_eq!(bpe().count("hello world"), 2);
        assert_eq!(bpe().count(""), 0);
    }

    #[test]
    fn m3_count_equals_byte_pair_encoding_by_its_definition() {
        // spec: M3
        let bpe = bpe();
        let long_word = "pneumonoultramicroscopicsilicovolcanoconiosis".repeat(4);
        let a_run = "a".repeat(300);
        let cjk_run = "日本語".repeat(40);
        let base64 = "SGVsbG8gV29ybGQhIFRoaXMgaXMgYSBsb25nIGJhc2U2NCBibG9iIHdpdGhvdXQgc3BhY2Vz".repeat(3);
        let texts = [
            "hello world",
            "The quick brown fox jumps over the lazy dog.",
            "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
            "1234567890 3.14159 -42 1e10 0x7fff_ffff",
            "Ünïcödé façade naïve café ἀλφάβητο",
            "日本語のテキストと中文文本，还有한국어 텍스트",
            "emoji 🎉🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
            "   \n\n\t  spaces   and\r\n tabs  \n  ",
            "They'll say WE'RE sure it's DON'T can't",
            "مرحبا بالعالم नमस्ते दुनिया",
            "<|endoftext|> is just text here",
            long_word.as_str(),
            a_run.as_str(),
            cjk_run.as_str(),
            base64.as_str(),
        ];
        for text in texts {
            assert_eq!(bpe.count(text), naive_count(bpe, text), "{text:?}");
        }
    }

    #[test]
    fn m3_openai_chat_follows_the_cookbook() {
        // spec: M3
        bpe();
        // 3 framing + "user" (1) + "hello world" (2) + 3 priming the reply.
        assert_eq!(
            est(
                Format::OpenAi,
                Api::Generate,
                r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}]}"#
            ),
            9
        );
        let body = r#"{"model":"gpt-4o","messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","name":"ann","content":[{"type":"text","text":"hello world"},
                {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                "function":{"name":"get_time","arguments":"{\"tz\":\"UTC\"}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"12:00"}],
            "tools":[{"type":"function","function":{"name":"get_time","description":"Current time",
                "parameters":{"type":"object"}}}],
            "temperature":0.2}"#;
        let expected = (3 + c("system") + c("be brief"))
            + (3 + c("user") + 1 + c("ann") + c("hello world") + OPENAI_IMAGE_LOW)
            + (3 + c("assistant") + c("get_time") + c(r#"{"tz":"UTC"}"#))
            + (3 + c("tool") + c("12:00"))
            + 3
            + (c("get_time") + c("Current time") + c(r#"{"type":"object"}"#));
        assert_eq!(est(Format::OpenAi, Api::Generate, body), expected);
    }

    #[test]
    fn m3_openai_responses() {
        // spec: M3
        bpe();
        assert_eq!(
            est(
                Format::OpenAi,
                Api::Responses,
                r#"{"model":"m","instructions":"hello world","input":"hello world"}"#
            ),
            (3 + 1 + 2) * 2 + 3
        );
        let body = r#"{"model":"m","input":[
            {"role":"user","content":[{"type":"input_text","text":"hello world"},
                {"type":"input_image","image_url":"data:x","detail":"low"}]},
            {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
            {"type":"function_call_output","call_id":"c","output":"42"}],
            "tools":[{"type":"function","name":"f","parameters":{}}]}"#;
        let expected =
            (3 + c("user") + 2 + OPENAI_IMAGE_LOW) + (3 + c("f") + c("{}")) + (3 + c("42")) + 3 + (c("f") + c("{}"));
        assert_eq!(est(Format::OpenAi, Api::Responses, body), expected);
    }

    #[test]
    fn m3_embeddings_count_token_ids_exactly() {
        // spec: M3
        bpe();
        let e = |body: &str| est(Format::OpenAi, Api::Embeddings, body);
        assert_eq!(e(r#"{"model":"e","input":[[1,2,3],[4,5]]}"#), 5);
        assert_eq!(e(r#"{"model":"e","input":[1,2,3]}"#), 3);
        assert_eq!(e(r#"{"model":"e","input":"hello world"}"#), 2);
        assert_eq!(e(r#"{"model":"e","input":["hello world","hello world"]}"#), 4);
    }

    #[test]
    fn m3_anthropic_is_scaled_from_o200k() {
        // spec: M3
        bpe();
        let a = |body: &str| est(Format::Anthropic, Api::Generate, body);
        // "hello world" is 2 o200k tokens: 2 × 1.2 = 2.4, rounded up to 3, plus framing.
        assert_eq!(
            a(r#"{"model":"c","max_tokens":5,"messages":[{"role":"user","content":"hello world"}]}"#),
            3 + ANTHROPIC_PER_MESSAGE
        );
        let body = r#"{"model":"c","max_tokens":5,"system":[{"type":"text","text":"be brief"}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hello world"},
                {"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]},
              {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_time","input":{"tz":"UTC"}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",
                "content":[{"type":"text","text":"12:00"}]}]}],
            "tools":[{"name":"get_time","description":"Current time","input_schema":{"type":"object"}}]}"#;
        let text = c("be brief")
            + c("hello world")
            + c("get_time")
            + c(r#"{"tz":"UTC"}"#)
            + c("12:00")
            + c("get_time")
            + c("Current time")
            + c(r#"{"type":"object"}"#);
        let expected =
            (text * 1200).div_ceil(1000) + 3 * ANTHROPIC_PER_MESSAGE + ANTHROPIC_IMAGE + ANTHROPIC_TOOL_PROMPT;
        assert_eq!(a(body), expected);
        assert_eq!(est(Format::Anthropic, Api::CountTokens, body), expected);
    }

    #[test]
    fn m3_gemini_every_endpoint() {
        // spec: M3
        bpe();
        let g = |api, body: &str| est(Format::Gemini, api, body);
        assert_eq!(
            g(
                Api::Generate,
                r#"{"contents":[{"role":"user","parts":[{"text":"hello world"},
                    {"inlineData":{"mimeType":"image/png","data":"AAAA"}}]}],
                  "systemInstruction":{"parts":[{"text":"be brief"}]},
                  "generationConfig":{"maxOutputTokens":100}}"#
            ),
            2 + GEMINI_MEDIA + c("be brief")
        );
        assert_eq!(
            g(
                Api::Generate,
                r#"{"contents":[{"role":"model","parts":[{"functionCall":{"name":"f","args":{"a":1}}}]},
                    {"role":"user","parts":[{"functionResponse":{"name":"f","response":{"ok":true}}}]}]}"#
            ),
            c("f") + c(r#"{"a":1}"#) + c(r#"{"name":"f","response":{"ok":true}}"#)
        );
        assert_eq!(
            g(Api::Embeddings, r#"{"content":{"parts":[{"text":"hello world"}]}}"#),
            2
        );
        assert_eq!(
            g(
                Api::Embeddings,
                r#"{"requests":[{"model":"models/e","content":{"parts":[{"text":"hello world"}]}},
                    {"model":"models/e","content":{"parts":[{"text":"hello world"}]}}]}"#
            ),
            4
        );
        assert_eq!(
            g(
                Api::CountTokens,
                r#"{"generateContentRequest":{"model":"models/g","contents":[{"parts":[{"text":"hello world"}]}]}}"#
            ),
            2
        );
        assert_eq!(g(Api::CountTokens, r#"{"contents":[]}"#), 0);
    }

    #[test]
    fn m3_before_the_table_loads_the_counted_text_is_measured_in_bytes() {
        // spec: M3
        let body = r#"{"model":"gpt-4o-mini-2024-07-18","messages":[{"role":"user","content":"hello world"}]}"#;
        let body = Json::parse(body.as_bytes()).unwrap();
        let mut t = Tally::new(None);
        openai_chat(&body, &mut t);
        // "user" and "hello world" are 15 bytes, 4 tokens; the model name is not counted.
        assert_eq!(t.total(1.0), 15_u64.div_ceil(4) + 3 + 3);
    }

    #[test]
    fn m3_what_is_not_json_is_a_token_per_four_bytes() {
        // spec: M3
        bpe();
        for f in Format::ALL {
            assert_eq!(estimate_input_tokens(f, Api::Generate, b"not json at all"), 4);
            assert_eq!(estimate_input_tokens(f, Api::Generate, b"[1,2,3]"), 2);
            assert_eq!(estimate_input_tokens(f, Api::Generate, b""), 0);
        }
    }

    #[test]
    fn m3_deep_nesting_neither_overflows_nor_panics() {
        // spec: M3
        bpe();
        let deep = "[".repeat(100_000);
        assert_eq!(
            estimate_input_tokens(Format::Anthropic, Api::Generate, deep.as_bytes()),
            25_000
        );
        let deep_object = format!(r#"{{"messages":[{{"content":{}}}]}}"#, "{\"a\":".repeat(50_000));
        for f in Format::ALL {
            let _ = estimate_input_tokens(f, Api::Generate, deep_object.as_bytes());
        }
        // Tool results inside tool results, as deep as the parser takes.
        let mut content = String::from(r#""innermost""#);
        for _ in 0..60 {
            content = format!(r#"[{{"type":"tool_result","content":{content}}}]"#);
        }
        let body = format!(r#"{{"model":"c","max_tokens":5,"messages":[{{"role":"user","content":{content}}}]}}"#);
        assert_eq!(
            est(Format::Anthropic, Api::Generate, &body),
            (c("innermost") * 1200).div_ceil(1000) + ANTHROPIC_PER_MESSAGE
        );
    }

    #[test]
    fn m3_wrong_types_are_skipped_never_a_panic() {
        // spec: M3
        bpe();
        let bodies = [
            r#"{"messages":"x"}"#,
            r#"{"messages":[1,null,"s",{"content":5,"role":[],"name":{}},{"content":[1,{"type":7},
                {"type":"image_url","image_url":3},{"type":"text","text":[]}],"tool_calls":[1,{"function":"x"}]}]}"#,
            r#"{"input":{"a":1},"instructions":[]}"#,
            r#"{"input":[null,{"type":"function_call","arguments":5},[1,"a"],
                {"type":"function_call_output","output":{}}]}"#,
            r#"{"input":[[1,[2]],{"a":1},true,1.5]}"#,
            r#"{"contents":"x","content":[],"requests":{"a":1},"systemInstruction":7,"tools":"t"}"#,
            r#"{"contents":[{"parts":[{"text":1,"functionCall":"x","inlineData":null,"executableCode":[]}]},7]}"#,
            r#"{"system":{"x":1},"messages":[{"content":[{"type":"tool_result","content":{"a":1}},
                {"type":"document","source":"x"},{"type":"tool_use","input":null}]}],"tools":[1,"a",null]}"#,
            r#"{"tools":[{"function":5},{"type":"web_search"}],"functions":{}}"#,
            r#"{"requests":[{"requests":[{"content":{"parts":[{"text":"deep"}]}}]}]}"#,
            "null",
            "1",
            "\"s\"",
            "{}",
        ];
        for body in bodies {
            for f in Format::ALL {
                for api in [Api::Generate, Api::Responses, Api::Embeddings, Api::CountTokens] {
                    let _ = estimate_input_tokens(f, api, body.as_bytes());
                }
            }
        }
        // Every prefix of a real body: truncated JSON falls back, never panics.
        let valid = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        for i in 0..=valid.len() {
            for f in Format::ALL {
                let _ = estimate_input_tokens(f, Api::Generate, &valid[..i]);
            }
        }
    }
    #[test]
    fn m3_a_huge_body_is_counted_in_bounded_time_and_memory() {
        // spec: M3
        let bpe = o200k_blocking();
        // One 8 MiB run the pre-tokenizer cannot split, and 8 MiB of tiny pieces.
        for text in ["a".repeat(8 << 20), "a ".repeat(4 << 20)] {
            let body = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]});
            let body = serde_json::to_vec(&body).unwrap();
            let t = std::time::Instant::now();
            let n = estimate_input_tokens(Format::OpenAi, Api::Generate, &body);
            // Generous for a debug build on a busy machine; what matters is that it is not
            // seconds per megabyte.
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
            assert!(n > 1_000_000 && n < 9_000_000, "{n}");
        }
        // Below the caps nothing changes: exact.
        assert_eq!(bpe.count(&"a".repeat(300)), bpe.piece_count("a".repeat(300).as_bytes()));
    }
}
