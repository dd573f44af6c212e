//! Incremental Server-Sent Events framing (H1). The gateway forwards stream bytes as they
//! arrive and feeds a copy through [`SseParser`] to notice the first token, the usage
//! block and in-stream errors; the parser holds at most one unfinished event, of at most
//! [`MAX_EVENT_BYTES`].

/// One dispatched event: its `event:` name (absent for OpenAI and Gemini) and its data
/// lines joined with `\n`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

/// The most one event may make the parser hold: its name, its data so far and the line
/// being read (a buffer's spare capacity aside, at most as much again). Events are watched,
/// not kept (the bytes reach the client whatever the parser makes of them), so past this a
/// line is dropped as it comes, and an event whose data or name it was is skipped up to the
/// blank line that ends it: an upstream that is broken, hostile or not an SSE server at all
/// could otherwise send gigabytes without a line end. The largest real events are the
/// Responses API's `response.completed`, which repeats the whole answer, images as base64
/// included.
pub const MAX_EVENT_BYTES: usize = 32 * 1024 * 1024;

/// Splits a byte stream into SSE events per the WHATWG rules: LF, CRLF or CR line ends,
/// `data:` lines accumulate, a blank line dispatches, `:` lines are comments.
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    /// A CR ended the last line; a following LF belongs to it.
    after_cr: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    /// The event being read went past the limit: its lines are skipped up to its blank line.
    oversized: bool,
    /// The line being read went past the limit: its bytes are dropped as they come.
    skipping_line: bool,
    /// Events skipped for their size so far.
    skipped: u64,
    limit: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::with_limit(MAX_EVENT_BYTES)
    }
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// A parser that skips events over `limit` bytes (see [`MAX_EVENT_BYTES`]).
    pub fn with_limit(limit: usize) -> Self {
        SseParser {
            line: Vec::new(),
            after_cr: false,
            event: None,
            data: String::new(),
            has_data: false,
            oversized: false,
            skipping_line: false,
            skipped: 0,
            limit,
        }
    }

    /// Events skipped so far because they were over the limit.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Whether an event has gone past the limit: skipped, or being skipped now (an
    /// upstream that never ends its line never ends its event either).
    pub fn over_limit(&self) -> bool {
        self.skipped > 0 || self.oversized
    }

    /// What the event being read holds, for the limit.
    fn held(&self) -> usize {
        self.data.len() + self.event.as_ref().map_or(0, String::len)
    }

    /// Feeds `chunk`, returning the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut rest = chunk;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if rest[0] == b'\n' {
                rest = &rest[1..];
            }
        }
        // Whole lines are read from the chunk in place; only a line cut by the chunk's end
        // is copied, into `line`, which keeps its capacity between lines.
        while let Some(i) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            if self.skipping_line {
                // The end of a line already dropped: whatever it was, it was not blank.
                self.skipping_line = false;
            } else if self.line.is_empty() {
                self.end_line(&rest[..i], &mut out);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&rest[..i]);
                self.end_line(&line, &mut out);
                // A line the limit dropped gives its memory back with it.
                if !self.oversized {
                    line.clear();
                    self.line = line;
                }
            }
            let cr = rest[i] == b'\r';
            rest = &rest[i + 1..];
            if cr {
                match rest.first() {
                    None => self.after_cr = true,
                    Some(b'\n') => rest = &rest[1..],
                    Some(_) => {}
                }
            }
        }
        if rest.is_empty() || self.skipping_line {
            return out;
        }
        // The same measure as `end_line`'s, so that where the chunks are cut never
        // changes what is skipped: a line past it is dropped, and its event with it when
        // the line is one the event keeps (its data or its name).
        if self.oversized {
            self.skipping_line = true;
        } else if self.held() + self.line.len() + rest.len() > self.limit {
            if kept_field(&self.line, rest) {
                self.oversize();
            } else {
                self.line = Vec::new();
            }
            self.skipping_line = true;
        } else {
            self.line.extend_from_slice(rest);
        }
        out
    }

    /// The event being read is over the limit: what it holds goes, memory and all.
    fn oversize(&mut self) {
        self.oversized = true;
        self.line = Vec::new();
        self.data = String::new();
        self.event = None;
        self.has_data = false;
    }

    fn end_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if self.oversized {
                self.oversized = false;
                self.skipped += 1;
            } else if self.has_data || self.event.is_some() {
                out.push(SseEvent {
                    event: self.event.take(),
                    data: std::mem::take(&mut self.data),
                });
            }
            self.has_data = false;
            return;
        }
        if self.oversized || (kept_field(line, &[]) && self.held() + line.len() > self.limit) {
            self.oversize();
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (name, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        // What is kept, counted again: invalid UTF-8 grows as it is replaced.
        if matches!(name, b"data" | b"event") && self.held() + value.len() + 1 > self.limit {
            self.oversize();
            return;
        }
        match name {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => self.event = Some(value.into_owned()),
            _ => {}
        }
    }
}

/// Whether a line that begins with `a` and goes on with `b` is a field the event keeps
/// (`data:` or `event:`); a line without a colon is a field with no value, too short to
/// matter.
fn kept_field(a: &[u8], b: &[u8]) -> bool {
    let mut head = [0u8; 6];
    let mut n = 0;
    for &c in a.iter().chain(b).take(head.len()) {
        head[n] = c;
        n += 1;
    }
    head[..n].starts_with(b"data:") || head[..n].starts_with(b"event:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h1_events_split_across_chunks() {
        // spec: H1
        let stream = b"event: message_start\ndata: {\"a\":1}\n\ndata: x\ndata: y\n\n: ping\n\ndata: [DONE]\n\n";
        let whole = SseParser::new().push(stream);
        assert_eq!(whole.len(), 3);
        assert_eq!(whole[0].event.as_deref(), Some("message_start"));
        assert_eq!(whole[1].data, "x\ny");
        assert_eq!(whole[2].data, "[DONE]");
        // Every split point gives the same events.
        for cut in 0..stream.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&stream[..cut]);
            got.extend(p.push(&stream[cut..]));
            assert_eq!(got, whole, "cut at {cut}");
        }
    }

    #[test]
    fn any_three_way_split_gives_the_same_events() {
        // Lines are read in place when whole and buffered when cut: a line cut twice, and
        // a CR at a chunk's end, must read as in one piece.
        let stream = b"event: a\r\ndata: 12345\r\rdata: x\n\n: c\ndata: y\r\n\r\n";
        let whole = SseParser::new().push(stream);
        assert_eq!(whole.len(), 3);
        for i in 0..stream.len() {
            for j in i..stream.len() {
                let mut p = SseParser::new();
                let mut got = p.push(&stream[..i]);
                got.extend(p.push(&stream[i..j]));
                got.extend(p.push(&stream[j..]));
                assert_eq!(got, whole, "cuts at {i} and {j}");
            }
        }
    }

    #[test]
    fn crlf_and_cr_line_ends() {
        let a = SseParser::new().push(b"data: 1\r\n\r\ndata: 2\r\rdata: 3\n\n");
        let data: Vec<_> = a.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["1", "2", "3"]);
        // CRLF split between chunks.
        let mut p = SseParser::new();
        let mut got = p.push(b"data: 1\r");
        got.extend(p.push(b"\n\r\n"));
        assert_eq!(got.len(), 1);
    }

    /// An event that goes past the limit however it comes: one endless line, or many
    /// small data lines.
    const HUGE_LINE: &[u8] = b"data: 0123456789012345678901234567890123456789\n\ndata: after\n\n";
    const MANY_LINES: &[u8] = b"event: big\ndata: 0123456789\ndata: 0123456789\ndata: 0123456789\n\ndata: after\n\n";

    #[test]
    fn an_event_over_the_limit_is_skipped_to_its_end_and_the_next_one_read() {
        for stream in [HUGE_LINE, MANY_LINES] {
            let mut p = SseParser::with_limit(32);
            let got = p.push(stream);
            assert_eq!(got.len(), 1, "{}", String::from_utf8_lossy(stream));
            assert_eq!(got[0].data, "after");
            assert_eq!(
                got[0].event, None,
                "the skipped event's name must not leak into the next"
            );
            assert_eq!(p.skipped(), 1);
            // Wherever the chunks are cut, the same: the limit counts the same bytes
            // whether a line comes whole or in pieces, and the end of a dropped line is
            // never taken for a blank one.
            for cut in 0..stream.len() {
                let mut p = SseParser::with_limit(32);
                let mut got = p.push(&stream[..cut]);
                got.extend(p.push(&stream[cut..]));
                assert_eq!(
                    got,
                    [SseEvent {
                        event: None,
                        data: "after".into()
                    }],
                    "cut at {cut}"
                );
                assert_eq!(p.skipped(), 1, "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_line_without_an_end_holds_no_more_than_the_limit() {
        // An upstream that sends megabytes without a line end, in a data line or in bytes
        // that are no SSE at all: the parser drops them as they come, and only the data
        // line's event counts as one skipped.
        for (start, skipped) in [(&b"data: "[..], 1), (&b""[..], 0)] {
            let mut p = SseParser::with_limit(1024);
            assert!(p.push(start).is_empty());
            let chunk = [b'x'; 4096];
            for _ in 0..1000 {
                assert!(p.push(&chunk).is_empty());
                assert!(p.line.capacity() <= 1024 && p.data.capacity() <= 1024);
            }
            assert_eq!(p.over_limit(), skipped > 0);
            assert!(
                p.push(b"\n\ndata: then\n\n")
                    .iter()
                    .map(|e| e.data.as_str())
                    .eq(["then"])
            );
            assert_eq!(p.skipped(), skipped);
        }
    }

    #[test]
    fn a_long_line_the_event_does_not_keep_is_dropped_alone() {
        // A comment or an unknown field holds nothing once read: past the limit it goes,
        // and the event it is in is read as ever.
        for stream in [
            &b": 0123456789012345678901234567890123456789\ndata: x\n\n"[..],
            &b"id: 0123456789012345678901234567890123456789\ndata: x\n\n"[..],
        ] {
            for cut in 0..stream.len() {
                let mut p = SseParser::with_limit(32);
                let mut got = p.push(&stream[..cut]);
                got.extend(p.push(&stream[cut..]));
                assert!(got.iter().map(|e| e.data.as_str()).eq(["x"]), "cut at {cut}: {got:?}");
                assert!(!p.over_limit(), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_line_completed_over_the_limit_gives_its_memory_back() {
        let mut p = SseParser::with_limit(32);
        assert!(p.push(b"data: 0123456789").is_empty());
        assert!(p.push(b"0123456789012345678901234567890\n").is_empty());
        assert!(p.over_limit(), "an event being skipped counts before its end");
        assert_eq!(p.line.capacity(), 0);
        assert_eq!(p.data.capacity(), 0);
        assert!(p.push(b"\ndata: next\n\n").iter().map(|e| e.data.as_str()).eq(["next"]));
        assert_eq!(p.skipped(), 1);
    }

    #[test]
    fn invalid_utf8_is_counted_as_it_is_kept() {
        // 20 bytes that are not UTF-8 are 60 once replaced: over a 32-byte limit.
        let mut stream = b"data: ".to_vec();
        stream.extend([0xFF; 20]);
        stream.extend(b"\n\ndata: ok\n\n");
        let mut p = SseParser::with_limit(32);
        assert!(p.push(&stream).iter().map(|e| e.data.as_str()).eq(["ok"]));
        assert_eq!(p.skipped(), 1);
    }

    #[test]
    fn an_event_at_the_limit_is_read() {
        // 32 bytes held at most: `data: ` and 26 of data.
        let line = format!("data: {}\n\n", "y".repeat(26));
        let got = SseParser::with_limit(32).push(line.as_bytes());
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].data.len(), 26);
        let over = format!("data: {}\n\n", "y".repeat(27));
        assert!(SseParser::with_limit(32).push(over.as_bytes()).is_empty());
    }

    #[test]
    fn incomplete_event_is_held() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"partial\"").is_empty());
        assert_eq!(p.push(b"}\n\n")[0].data, "{\"partial\"}");
    }
}
