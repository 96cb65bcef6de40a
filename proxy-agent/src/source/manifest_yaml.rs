//! YAML manifests, streamed document by document: the file is read line
//! by line and cut into blocks of whole documents, each parsed on its own
//! and dropped once its objects are handed over, so a stream of 20k
//! documents costs a block at a time, not the file. Large files are
//! parsed on a few threads, a bounded number of blocks ahead of the
//! calling thread, which hands the documents over in file order.
//!
//! Blocks end only before a line that starts a document: a `---` marker
//! at column 0, or a directive (`%YAML`, `%TAG`), which belongs to the
//! document after it. libyaml ends whatever it is scanning at such a line
//! (a document indicator at column 0 ends block and plain scalars, and is
//! an error inside quoted scalars and flow collections;
//! yaml_parser_fetch_next_token), so the documents of a valid stream are
//! the documents of its blocks, in order; and a stream with an error has
//! it in the same document.

use std::io::BufRead;
use std::sync::{Mutex, mpsc};

use serde::Deserialize;
use serde_json::Value;

use crate::source::manifest::{ManifestError, Object, Sink};

/// Files smaller than this are parsed on the calling thread.
const PARALLEL_MIN_BYTES: u64 = 256 * 1024;
/// Text handed to a parser at a time (a block holds at least this much,
/// or the rest of the file).
const BLOCK_BYTES: usize = 64 * 1024;
const MAX_THREADS: usize = 4;
/// Blocks read ahead of the one being handed over, which bounds the
/// memory held in text and parsed documents.
const LOOKAHEAD: usize = 8;

/// Whole documents of the stream, from line `first_line` (1-based) on.
struct Block {
    text: String,
    first_line: usize,
}

/// What a parser made of a block: its documents, up to the first that did
/// not parse, and that one's error.
type Parsed = (Vec<Value>, Option<serde_yaml::Error>);

fn parse_block(text: &str) -> Parsed {
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(text) {
        match Value::deserialize(de) {
            Ok(v) => docs.push(v),
            Err(e) => return (docs, Some(e)),
        }
    }
    (docs, None)
}

/// Parses the YAML stream `reader` (`size` bytes, if known) into `sink`.
pub(crate) fn parse(source: &str, reader: impl BufRead, size: u64, sink: &mut impl Sink) -> Result<(), ManifestError> {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(MAX_THREADS);
    let threads = if size < PARALLEL_MIN_BYTES { 1 } else { threads };
    parse_blocks(source, Blocks::new(reader, BLOCK_BYTES), threads, sink)
}

fn parse_blocks(source: &str, mut blocks: Blocks<impl BufRead>, threads: usize, sink: &mut impl Sink) -> Result<(), ManifestError> {
    let mut delivery = Delivery { source, sink, documents: 0 };
    if threads < 2 {
        while let Some(block) = blocks.next(source)? {
            let parsed = parse_block(&block.text);
            delivery.deliver(&block, parsed)?;
        }
        return Ok(());
    }
    let (job_tx, job_rx) = mpsc::channel::<(usize, Block)>();
    let job_rx = Mutex::new(job_rx);
    std::thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel::<(usize, Block, Parsed)>();
        for _ in 0..threads {
            let done_tx = done_tx.clone();
            let job_rx = &job_rx;
            scope.spawn(move || {
                loop {
                    let job = job_rx.lock().map(|rx| rx.recv());
                    let Ok(Ok((i, block))) = job else { return };
                    let parsed = parse_block(&block.text);
                    if done_tx.send((i, block, parsed)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(done_tx);
        let lost = || ManifestError { location: source.to_string(), reason: "a YAML parser thread failed".into() };
        // Blocks parsed and waiting for an earlier one, by index.
        let mut waiting = std::collections::BTreeMap::new();
        let (mut sent, mut next, mut read_all) = (0, 0, false);
        let result = 'stream: loop {
            // Hand over whatever is next in file order.
            while let Some((block, parsed)) = waiting.remove(&next) {
                if let Err(e) = delivery.deliver(&block, parsed) {
                    break 'stream Err(e);
                }
                next += 1;
            }
            if read_all && next == sent {
                break Ok(());
            }
            if read_all || sent - next >= LOOKAHEAD {
                match done_rx.recv() {
                    Ok((i, block, parsed)) => {
                        waiting.insert(i, (block, parsed));
                        continue;
                    }
                    Err(_) => break Err(lost()),
                }
            }
            match blocks.next(source) {
                Ok(Some(block)) => {
                    if job_tx.send((sent, block)).is_err() {
                        break Err(lost());
                    }
                    sent += 1;
                }
                Ok(None) => read_all = true,
                Err(e) => break Err(e),
            }
        };
        // Stops the parser threads.
        drop(job_tx);
        result
    })
}

/// Hands a stream's documents over in order, numbering them.
struct Delivery<'a, S> {
    source: &'a str,
    sink: &'a mut S,
    documents: usize,
}

impl<S: Sink> Delivery<'_, S> {
    fn deliver(&mut self, block: &Block, (docs, error): Parsed) -> Result<(), ManifestError> {
        for value in docs {
            self.documents += 1;
            push_object(&format!("{}#{}", self.source, self.documents), value, self.sink);
        }
        match error {
            None => Ok(()),
            Some(e) => Err(ManifestError {
                location: format!("{}#{}", self.source, self.documents + 1),
                reason: format!("not valid YAML/JSON: {}", shift_lines(&e.to_string(), block.first_line - 1)),
            }),
        }
    }
}

/// Hands over one document, flattening `List`s.
fn push_object(location: &str, value: Value, sink: &mut impl Sink) {
    match value {
        Value::Null => {} // an empty document between separators
        Value::Object(mut map) => {
            let kind = map.get("kind").and_then(Value::as_str).unwrap_or_default().to_string();
            if kind.ends_with("List") && map.contains_key("items") {
                match map.remove("items") {
                    Some(Value::Array(items)) => {
                        for (j, item) in items.into_iter().enumerate() {
                            push_object(&format!("{location}[{j}]"), item, sink);
                        }
                    }
                    Some(Value::Null) => {}
                    _ => sink.problem(ManifestError { location: location.into(), reason: format!("{kind}.items is not a list") }),
                }
            } else {
                sink.object(location, Object::Value(Value::Object(map)));
            }
        }
        other => sink.problem(ManifestError {
            location: location.into(),
            reason: format!("expected a Kubernetes object, found {}", json_type(&other)),
        }),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// libyaml's positions ("line 3 column 7") in a block, as positions in
/// the file: `by` lines further.
fn shift_lines(message: &str, by: usize) -> String {
    if by == 0 {
        return message.to_string();
    }
    let mut out = String::with_capacity(message.len() + 8);
    let mut rest = message;
    while let Some(at) = rest.find("line ") {
        let (before, after) = rest.split_at(at + "line ".len());
        out.push_str(before);
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        match after[..digits].parse::<usize>() {
            Ok(n) if after[digits..].starts_with(" column") => out.push_str(&(n + by).to_string()),
            _ => out.push_str(&after[..digits]),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// Cuts a stream into blocks of whole documents.
struct Blocks<R> {
    reader: R,
    /// A block ends at the first document start after this many bytes.
    min_bytes: usize,
    /// A line read that starts the next block.
    carried: Option<Vec<u8>>,
    /// Lines read so far.
    lines: usize,
    done: bool,
}

/// What a line means for cutting.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Line {
    /// `---` at column 0, alone or followed by white space.
    Marker,
    /// `%YAML`, `%TAG`, ...
    Directive,
    /// Blank or a comment.
    Nothing,
    Content,
}

fn classify(line: &[u8]) -> Line {
    if line.starts_with(b"---") && matches!(line.get(3), None | Some(b' ' | b'\t' | b'\r' | b'\n')) {
        return Line::Marker;
    }
    if line.first() == Some(&b'%') {
        return Line::Directive;
    }
    match line.iter().find(|b| !b.is_ascii_whitespace()) {
        None | Some(b'#') => Line::Nothing,
        Some(_) => Line::Content,
    }
}

impl<R: BufRead> Blocks<R> {
    fn new(reader: R, min_bytes: usize) -> Self {
        Blocks { reader, min_bytes, carried: None, lines: 0, done: false }
    }

    /// The next block, or `None` at the end of the stream.
    fn next(&mut self, source: &str) -> Result<Option<Block>, ManifestError> {
        let cannot = |reason: String| ManifestError { location: source.to_string(), reason };
        if self.done {
            return Ok(None);
        }
        let first_line = self.lines + 1 - usize::from(self.carried.is_some());
        let mut text = Vec::with_capacity(self.min_bytes.min(BLOCK_BYTES) + 4096);
        // Whether the document being read has begun (a marker or content):
        // before that, comments and directives belong to it and no marker
        // ends it.
        let mut begun = false;
        if let Some(line) = self.carried.take() {
            begun = classify(&line) == Line::Marker;
            text.extend_from_slice(&line);
        }
        loop {
            let mut line = Vec::new();
            let n = self.reader.read_until(b'\n', &mut line).map_err(|e| cannot(format!("cannot read: {e}")))?;
            if n == 0 {
                self.done = true;
                break;
            }
            self.lines += 1;
            let what = classify(&line);
            let starts_document = matches!(what, Line::Marker | Line::Directive) && begun;
            if starts_document && text.len() >= self.min_bytes {
                self.carried = Some(line);
                break;
            }
            if starts_document {
                begun = false;
            }
            begun |= matches!(what, Line::Marker | Line::Content);
            text.extend_from_slice(&line);
        }
        if text.is_empty() && self.done && first_line > 1 {
            return Ok(None);
        }
        let text = String::from_utf8(text).map_err(|_| cannot("cannot read: stream did not contain valid UTF-8".into()))?;
        Ok(Some(Block { text, first_line }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect {
        docs: Vec<String>,
        problems: Vec<ManifestError>,
    }

    impl Sink for Collect {
        fn object(&mut self, location: &str, object: Object<'_>) {
            self.docs.push(format!("{location} {}", object.into_value().unwrap_or_default()));
        }
        fn problem(&mut self, error: ManifestError) {
            self.problems.push(error);
        }
        fn restart(&mut self) {
            self.docs.clear();
        }
    }

    /// The stream parsed whole, by serde_yaml alone: the reference.
    fn whole(text: &str) -> (Vec<String>, Vec<ManifestError>, Option<String>) {
        let mut c = Collect::default();
        for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
            match Value::deserialize(de) {
                Ok(v) => push_object(&format!("t.yaml#{}", i + 1), v, &mut c),
                Err(_) => return (c.docs, c.problems, Some(format!("t.yaml#{}", i + 1))),
            }
        }
        (c.docs, c.problems, None)
    }

    /// Blocks of at least `min_bytes`, parsed on `threads`.
    fn blocks(text: &str, min_bytes: usize, threads: usize) -> (Vec<String>, Vec<ManifestError>, Option<String>) {
        let mut c = Collect::default();
        let r = parse_blocks("t.yaml", Blocks::new(text.as_bytes(), min_bytes), threads, &mut c);
        (c.docs, c.problems, r.err().map(|e| e.location))
    }

    #[test]
    fn blocks_hold_the_documents_of_the_whole_stream() {
        let mut big = String::new();
        for i in 0..3000 {
            big.push_str(&format!("---\nkind: Service\nmetadata: {{name: s{i}}}\nspec: {{ports: [{{port: 80}}]}}\n"));
        }
        let texts = [
            "---\nkind: Service\nmetadata: {name: a}\n---\n---\nkind: Node\nmetadata: {name: n}\n",
            "kind: A\n---\nkind: B\n...\n--- {kind: C}\n---\r\nkind: D\r\n",
            "# leading comment\n\n---\nkind: A\ndata: |\n  ---\n  not a marker\n---\n- 1\n---\nkind: B\n",
            "kind: Service\n---\n- 1\n- 2\n---\nkind: [unclosed\n---\nkind: After\n",
            "kind: A\n---\nkey: \"open quote\n---\nkind: B\n",
            "%YAML 1.2\n---\nkind: A\n...\n%YAML 1.2\n---\nkind: B\n",
            "----\nkind: A\n---x\n",
            "# only a comment\n",
            "",
            &big,
            &format!("{big}---\nkind: [broken\n{big}"),
            &format!("{big}---\n- 1\n{big}"),
        ];
        for text in texts {
            let reference = whole(text);
            // A block per document and the usual blocks, sequential and
            // on threads.
            for (min_bytes, threads) in [(1, 1), (1, 3), (BLOCK_BYTES, 1), (BLOCK_BYTES, 3)] {
                let got = blocks(text, min_bytes, threads);
                assert_eq!(got.0, reference.0, "{text:.80?}");
                assert_eq!(got.1, reference.1, "{text:.80?}");
                assert_eq!(got.2, reference.2, "{text:.80?}");
            }
        }
        assert_eq!(blocks(&big, BLOCK_BYTES, 3).0.len(), 3000);
    }

    #[test]
    fn errors_name_the_line_in_the_file() {
        let mut text = String::new();
        for i in 0..2000 {
            text.push_str(&format!("---\nkind: Service\nmetadata: {{name: s{i}}}\n"));
        }
        let broken_line = text.lines().count() + 2;
        text.push_str("---\nkind: [broken\n");
        let mut c = Collect::default();
        let e = parse_blocks("t.yaml", Blocks::new(text.as_bytes(), 1000), 2, &mut c).expect_err("broken");
        assert_eq!(e.location, "t.yaml#2001");
        assert!(e.reason.contains(&format!("line {}", broken_line + 1)), "{e}: the error is reported after the line it is on");
        assert_eq!(c.docs.len(), 2000);
        assert_eq!(
            shift_lines("did not find expected ',' at line 2 column 1, while parsing a flow sequence at line 1 column 7", 10),
            "did not find expected ',' at line 12 column 1, while parsing a flow sequence at line 11 column 7"
        );
    }
}
