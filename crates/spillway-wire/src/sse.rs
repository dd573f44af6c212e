//! Incremental Server-Sent Events framing (H1). The gateway forwards stream bytes as they
//! arrive and feeds a copy through [`SseParser`] to notice the first token, the usage
//! block and in-stream errors; the parser never holds more than one unfinished line.

/// One dispatched event: its `event:` name (absent for OpenAI and Gemini) and its data
/// lines joined with `\n`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

/// Splits a byte stream into SSE events per the WHATWG rules: LF, CRLF or CR line ends,
/// `data:` lines accumulate, a blank line dispatches, `:` lines are comments.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// A CR ended the last line; a following LF belongs to it.
    after_cr: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
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
            if self.line.is_empty() {
                self.end_line(&rest[..i], &mut out);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&rest[..i]);
                self.end_line(&line, &mut out);
                line.clear();
                self.line = line;
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
        self.line.extend_from_slice(rest);
        out
    }

    fn end_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if self.has_data || self.event.is_some() {
                out.push(SseEvent {
                    event: self.event.take(),
                    data: std::mem::take(&mut self.data),
                });
            }
            self.has_data = false;
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

    #[test]
    fn incomplete_event_is_held() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"partial\"").is_empty());
        assert_eq!(p.push(b"}\n\n")[0].data, "{\"partial\"}");
    }
}
