//! JSON manifests, streamed: what `kubectl get -o json` writes is one
//! object, or a `List` whose `items` hold every object of the cluster (tens
//! of megabytes at 10k Services). The file is read through a buffer by a
//! scanner that only finds where each value ends (strings, escapes and
//! nesting); each `List` item is parsed by serde_json from its own bytes,
//! handed over, and dropped before the next is read. So a file costs one
//! item of memory whatever its size, nothing is ever built as a generic
//! JSON value, and serde_json parses from memory, which is several times
//! faster than its byte-at-a-time reader.
//!
//! kubectl prints unstructured objects with their keys sorted, so a
//! `List`'s `items` comes before its `kind`: an `items` array is streamed
//! whenever the `kind` read so far does not say otherwise. The other
//! fields of a document are kept as text; a document that turns out not
//! to be a `List` is handed over as an object made of them.
//!
//! Every piece the scanner cuts is checked by serde_json, so the file is
//! valid JSON exactly when serde_json would say so of the whole, and a
//! syntax error is reported at its line and column in the file.
//!
//! Parsing and converting the items is most of the work (a 140 MB `List`
//! of 100k EndpointSlices took two thirds of a second on one core), and
//! the items do not depend on one another: [`parse_in_parts`] cuts them
//! here and has worker threads convert batches of them into parts of the
//! sink, which are joined in file order, so the sink ends up with what
//! [`parse`] gives it, and the first error in the file is the one reported.

use std::collections::BTreeMap;
use std::fmt;
use std::io::BufRead;
use std::sync::mpsc;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::source::manifest::{ManifestError, Object, PartSink, Sink};

/// Why a JSON parse stopped.
pub(crate) enum Failure {
    /// The text is not JSON (a syntax error): it may be YAML in flow style.
    NotJson(ManifestError),
    /// JSON that ends early or could not be read: the file does not parse.
    Fatal(ManifestError),
}

/// `List`s nested deeper than this are reported, not flattened.
const MAX_LIST_DEPTH: usize = 8;

/// Parses a stream of JSON documents (usually one) from `reader`, which is
/// `offset` bytes into the text. `locate`
/// turns a byte offset into a line and column, for error messages (the
/// caller reads the text again up to there; nothing is counted while all
/// is well).
pub(crate) fn parse(
    source: &str,
    reader: impl BufRead,
    offset: u64,
    locate: &dyn Fn(u64) -> Position,
    sink: &mut impl Sink,
) -> Result<(), Failure> {
    parse_into(source, reader, offset, locate, &mut Out { sink, pool: None })
}

/// [`parse`], with `List` items converted on `workers` threads (the
/// caller's thread only cuts them): the sink receives the same objects
/// and problems in the same order, and the same error.
pub(crate) fn parse_in_parts<S: PartSink>(
    source: &str,
    reader: impl BufRead,
    offset: u64,
    locate: &dyn Fn(u64) -> Position,
    sink: &mut S,
    workers: usize,
) -> Result<(), Failure> {
    if workers < 2 {
        return parse(source, reader, offset, locate, sink);
    }
    std::thread::scope(|scope| {
        let (done_tx, done) = mpsc::channel();
        let jobs = (0..workers)
            .map(|_| {
                let (tx, rx) = mpsc::sync_channel::<Batch>(QUEUED_BATCHES);
                let done_tx = done_tx.clone();
                scope.spawn(move || convert_batches::<S>(&rx, &done_tx));
                tx
            })
            .collect();
        let mut pool =
            Workers { jobs, done, sent: 0, merged: 0, arrived: BTreeMap::new(), batch: Batch::default(), spare: Vec::new(), failed: false };
        parse_into(source, reader, offset, locate, &mut Out { sink, pool: Some(&mut pool) })
        // Dropping `pool` closes the queues: the workers end, and the
        // scope waits for them.
    })
}

fn parse_into<S: Sink>(
    source: &str,
    reader: impl BufRead,
    offset: u64,
    locate: &dyn Fn(u64) -> Position,
    out: &mut Out<'_, S>,
) -> Result<(), Failure> {
    let mut scanner = Scanner::new(reader, offset);
    let mut n = 0;
    // Documents follow one another (JSON Lines, or objects simply written
    // one after the other).
    while scanner.peek().map_err(|e| e.failure(source, locate))?.is_some() {
        n += 1;
        let location = format!("{source}#{n}");
        // Every item of a document is in the sink before the next one is
        // read, so an error found while cutting is later than any item's.
        document(&mut scanner, &location, out, 0)
            .and_then(|()| out.sink().map(drop))
            .map_err(|e| out.settle(e).failure(&location, locate))?;
    }
    Ok(())
}

/// Where a document's objects go: into the sink, or for the items of a
/// `List`, through the worker threads of [`parse_in_parts`].
struct Out<'a, S> {
    sink: &'a mut S,
    pool: Option<&'a mut dyn Pool<S>>,
}

impl<S: Sink> Out<'_, S> {
    /// The sink, once every item cut before is in it.
    fn sink(&mut self) -> Result<&mut S, ScanError> {
        if let Some(pool) = &mut self.pool {
            pool.drain(self.sink)?;
        }
        Ok(self.sink)
    }

    /// Item `index` of the `List` at `list` (a location), converted now
    /// or queued.
    fn item(&mut self, list: &str, index: usize, bytes: &[u8], at: u64, depth: usize) -> Result<(), ScanError> {
        match &mut self.pool {
            Some(pool) => pool.queue(self.sink, list, index, bytes, at, depth),
            None => item(&format!("{list}[{index}]"), bytes, at, self.sink, depth),
        }
    }

    /// The error to report for `e`, found while cutting: the first error
    /// of an item cut before it, if one has one, else `e`.
    fn settle(&mut self, e: ScanError) -> ScanError {
        match &mut self.pool {
            Some(pool) => pool.settle(self.sink, e),
            None => e,
        }
    }
}

/// Items converted elsewhere and handed to the sink in order.
trait Pool<S> {
    /// Queues an item; an error is that of an item queued before.
    fn queue(&mut self, sink: &mut S, list: &str, index: usize, bytes: &[u8], at: u64, depth: usize) -> Result<(), ScanError>;
    /// Waits for every queued item and hands what they held to `sink`.
    fn drain(&mut self, sink: &mut S) -> Result<(), ScanError>;
    /// [`Out::settle`].
    fn settle(&mut self, sink: &mut S, e: ScanError) -> ScanError;
}

/// Items go to a worker when they reach this many bytes, or this many
/// items: enough to make a hand-over cheap beside the parsing, small enough
/// that both workers get work from a file of a few megabytes.
const BATCH_BYTES: usize = 256 * 1024;
const BATCH_ITEMS: usize = 512;
/// A batch's buffer: room for one item more than [`BATCH_BYTES`] (of
/// usual size). Buffers go back and forth between the threads rather than
/// being mapped and unmapped for each batch (they are above the agent's
/// mmap threshold, `cmd::run`).
const BATCH_BUFFER: usize = BATCH_BYTES + 64 * 1024;
/// Batches waiting per worker: the bytes cut ahead stay a few megabytes.
const QUEUED_BATCHES: usize = 2;

/// Consecutive items of one `List`, their bytes end to end.
#[derive(Default)]
struct Batch {
    seq: u64,
    bytes: Vec<u8>,
    /// The `List`'s location, and its depth in the document.
    list: String,
    depth: usize,
    /// Each item's index in the `List`, the end of its bytes, and its
    /// offset in the text.
    items: Vec<(usize, usize, u64)>,
}

/// What converting a batch gave: the part of the sink it made and the
/// first error of its items (the items after it are not converted, as
/// [`parse`] stops at it), or the panic of a bug, passed on to the caller's
/// thread as if it had converted the batch itself.
enum Converted<S> {
    /// With the batch's buffer, for the next batch.
    Part(S, Result<(), ScanError>, Vec<u8>),
    Panicked(Box<dyn std::any::Any + Send>),
}

fn convert_batches<S: PartSink>(jobs: &mpsc::Receiver<Batch>, done: &mpsc::Sender<(u64, Converted<S>)>) {
    for mut batch in jobs {
        let converted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut part = S::with_room(batch.items.len());
            let mut start = 0;
            for (index, end, at) in &batch.items {
                let location = format!("{}[{index}]", batch.list);
                if let Err(e) = item(&location, &batch.bytes[start..*end], *at, &mut part, batch.depth) {
                    return (part, Err(e));
                }
                start = *end;
            }
            (part, Ok(()))
        }));
        let converted = match converted {
            Ok((part, result)) => {
                batch.bytes.clear();
                Converted::Part(part, result, batch.bytes)
            }
            Err(panic) => Converted::Panicked(panic),
        };
        if done.send((batch.seq, converted)).is_err() {
            return;
        }
    }
}

struct Workers<S> {
    /// Each worker's queue; batch `seq` goes to worker `seq % len`.
    jobs: Vec<mpsc::SyncSender<Batch>>,
    done: mpsc::Receiver<(u64, Converted<S>)>,
    /// Batches sent, and merged into the sink (in order).
    sent: u64,
    merged: u64,
    /// Converted out of order, waiting for the ones before.
    arrived: BTreeMap<u64, Converted<S>>,
    /// The batch being filled.
    batch: Batch,
    /// Buffers of converted batches, for the next ones.
    spare: Vec<Vec<u8>>,
    /// An item failed: its error was returned, nothing after it counts.
    failed: bool,
}

impl<S: PartSink> Workers<S> {
    fn send(&mut self) -> Result<(), ScanError> {
        if self.batch.items.is_empty() {
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.batch);
        batch.seq = self.sent;
        let worker = &self.jobs[(self.sent % self.jobs.len() as u64) as usize];
        self.sent += 1;
        worker.send(batch).map_err(|_| stopped())
    }

    /// Merges the converted batches that are next in order; waits for
    /// them until `upto` are merged.
    fn merge(&mut self, sink: &mut S, upto: u64) -> Result<(), ScanError> {
        loop {
            while let Some(converted) = self.arrived.remove(&self.merged) {
                self.merged += 1;
                match converted {
                    Converted::Part(part, result, buffer) => {
                        self.spare.push(buffer);
                        sink.append(part);
                        if let Err(e) = result {
                            self.failed = true;
                            return Err(e);
                        }
                    }
                    Converted::Panicked(panic) => std::panic::resume_unwind(panic),
                }
            }
            let next = if self.merged < upto { self.done.recv().ok() } else { self.done.try_recv().ok() };
            match next {
                Some((seq, converted)) => {
                    self.arrived.insert(seq, converted);
                }
                None if self.merged < upto => return Err(stopped()),
                None => return Ok(()),
            }
        }
    }
}

/// A worker is gone (it cannot be: a panic is caught and passed on).
fn stopped() -> ScanError {
    ScanError::Io(std::io::Error::other("a worker converting List items stopped"))
}

impl<S: PartSink> Pool<S> for Workers<S> {
    fn queue(&mut self, sink: &mut S, list: &str, index: usize, bytes: &[u8], at: u64, depth: usize) -> Result<(), ScanError> {
        if !self.batch.items.is_empty() && (self.batch.depth != depth || self.batch.list != list) {
            self.send()?;
        }
        if self.batch.items.is_empty() {
            self.batch.depth = depth;
            list.clone_into(&mut self.batch.list);
            if self.batch.bytes.capacity() == 0 {
                self.batch.bytes = self.spare.pop().unwrap_or_else(|| Vec::with_capacity(BATCH_BUFFER));
            }
        }
        self.batch.bytes.extend_from_slice(bytes);
        self.batch.items.push((index, self.batch.bytes.len(), at));
        if self.batch.bytes.len() >= BATCH_BYTES || self.batch.items.len() >= BATCH_ITEMS {
            self.send()?;
            // Whatever is converted meanwhile goes into the sink now.
            self.merge(sink, 0)?;
        }
        Ok(())
    }

    fn drain(&mut self, sink: &mut S) -> Result<(), ScanError> {
        self.send()?;
        self.merge(sink, self.sent)
    }

    fn settle(&mut self, sink: &mut S, e: ScanError) -> ScanError {
        if self.failed {
            // `e` is that item's error: later items do not count.
            return e;
        }
        // The items cut before `e` come first, whatever they hold.
        if self.send().is_err() {
            return e;
        }
        match self.merge(sink, self.sent) {
            Err(earlier) if self.failed => earlier,
            _ => e,
        }
    }
}

/// A place in a text, 1-based as editors show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Position {
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {} column {}", self.line, self.column)
    }
}

/// Where byte `offset` of `text` is (columns count characters).
pub(crate) fn position(text: &[u8], offset: u64) -> Position {
    let upto = &text[..(offset as usize).min(text.len())];
    let line_start = memchr::memrchr(b'\n', upto).map_or(0, |i| i + 1);
    let line = 1 + memchr::memchr_iter(b'\n', upto).count();
    let column = 1 + upto[line_start..].iter().filter(|b| **b & 0xC0 != 0x80).count();
    Position { line, column }
}

/// The offset serde_json's 1-based `(line, column)` in `text` stands for.
fn offset_of(text: &[u8], line: usize, column: usize) -> usize {
    let mut start = 0;
    for _ in 1..line {
        match memchr::memchr(b'\n', &text[start..]) {
            Some(i) => start += i + 1,
            None => return text.len(),
        }
    }
    (start + column.saturating_sub(1)).min(text.len())
}

/// What stopped the scanner; offsets are from the start of the stream.
enum ScanError {
    Io(std::io::Error),
    /// The text ends inside a value.
    Eof(&'static str, u64),
    Syntax(String, u64),
}

impl ScanError {
    fn failure(self, location: &str, locate: &dyn Fn(u64) -> Position) -> Failure {
        let error = |reason: String| ManifestError { location: location.to_string(), reason };
        match self {
            ScanError::Io(e) => Failure::Fatal(error(format!("cannot read: {e}"))),
            ScanError::Eof(what, at) => Failure::Fatal(error(format!("not valid JSON: EOF while parsing {what} at {}", locate(at)))),
            ScanError::Syntax(what, at) => Failure::NotJson(error(format!("not valid JSON: {what} at {}", locate(at)))),
        }
    }

    /// serde_json's error about `piece`, which starts at offset `at`.
    fn from_serde(e: &serde_json::Error, piece: &[u8], at: u64) -> ScanError {
        let message = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let message = message.strip_suffix(&suffix).unwrap_or(&message).to_string();
        // Even an "EOF" here is a syntax error: the scanner cut the piece
        // where its brackets closed, and the text goes on after it.
        ScanError::Syntax(message, at + offset_of(piece, e.line(), e.column()) as u64)
    }
}

/// Reads values' bytes from a buffered reader, counting the offset.
struct Scanner<R> {
    reader: R,
    offset: u64,
}

impl<R: BufRead> Scanner<R> {
    fn new(reader: R, offset: u64) -> Self {
        Scanner { reader, offset }
    }

    fn consume(&mut self, n: usize) {
        self.reader.consume(n);
        self.offset += n as u64;
    }

    /// The next byte after white space (and a byte order mark at the start),
    /// not consumed; `None` at the end.
    fn peek(&mut self) -> Result<Option<u8>, ScanError> {
        loop {
            let at_start = self.offset == 0;
            let buf = self.reader.fill_buf().map_err(ScanError::Io)?;
            if buf.is_empty() {
                return Ok(None);
            }
            let skip = if at_start && buf.starts_with(b"\xEF\xBB\xBF") {
                3
            } else {
                buf.iter().take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')).count()
            };
            if skip == 0 {
                return Ok(Some(buf[0]));
            }
            self.consume(skip);
        }
    }

    /// Consumes `want`, the next byte after white space.
    fn expect(&mut self, want: u8, what: &str) -> Result<(), ScanError> {
        match self.peek()? {
            Some(b) if b == want => {
                self.consume(1);
                Ok(())
            }
            Some(_) => Err(ScanError::Syntax(format!("expected {what}"), self.offset)),
            None => Err(ScanError::Eof("an object", self.offset)),
        }
    }

    /// Appends the bytes of the next value to `out`; returns the offset it
    /// starts at. Only its end is found here (serde_json checks the rest).
    fn value(&mut self, out: &mut Vec<u8>) -> Result<u64, ScanError> {
        let first = self.peek()?.ok_or(ScanError::Eof("a value", self.offset))?;
        let start = self.offset;
        let what = match first {
            b'{' => "an object",
            b'[' => "a list",
            b'"' => "a string",
            _ => return self.scalar(out).map(|()| start),
        };
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        loop {
            let buf = self.reader.fill_buf().map_err(ScanError::Io)?;
            if buf.is_empty() {
                return Err(ScanError::Eof(what, self.offset));
            }
            let mut end = None;
            let mut i = 0;
            while i < buf.len() {
                if in_string {
                    if escaped {
                        escaped = false;
                        i += 1;
                        continue;
                    }
                    // Strings are most of the bytes: skip to their end.
                    match memchr::memchr2(b'"', b'\\', &buf[i..]) {
                        None => i = buf.len(),
                        Some(j) => {
                            i += j;
                            if buf[i] == b'\\' {
                                escaped = true;
                            } else {
                                in_string = false;
                                if depth == 0 {
                                    end = Some(i + 1);
                                    break;
                                }
                            }
                            i += 1;
                        }
                    }
                    continue;
                }
                match buf[i] {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            end = Some(i + 1);
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            let n = end.unwrap_or(buf.len());
            out.extend_from_slice(&buf[..n]);
            self.consume(n);
            if end.is_some() {
                return Ok(start);
            }
        }
    }

    /// A number, `true`, `false` or `null` (or garbage): up to the next
    /// delimiter.
    fn scalar(&mut self, out: &mut Vec<u8>) -> Result<(), ScanError> {
        loop {
            let buf = self.reader.fill_buf().map_err(ScanError::Io)?;
            if buf.is_empty() {
                return Ok(());
            }
            let n = buf.iter().take_while(|b| !matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')).count();
            out.extend_from_slice(&buf[..n]);
            let done = n < buf.len();
            self.consume(n);
            if done || n == 0 {
                return Ok(());
            }
        }
    }
}

fn is_list(kind: &str) -> bool {
    kind.ends_with("List")
}

/// What a document's or item's first byte says it is, when not an object.
fn json_type(first: Option<&u8>) -> &'static str {
    match first {
        Some(b'[') => "a list",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// One document, or one `List` item that is itself a `List`.
fn document<R: BufRead, S: Sink>(sc: &mut Scanner<R>, location: &str, out: &mut Out<'_, S>, depth: usize) -> Result<(), ScanError> {
    let problem = |sink: &mut S, reason: String| sink.problem(ManifestError { location: location.to_string(), reason });
    let mut buf = Vec::new();
    if sc.peek()? != Some(b'{') {
        let at = sc.value(&mut buf)?;
        serde_json::from_slice::<IgnoredAny>(&buf).map_err(|e| ScanError::from_serde(&e, &buf, at))?;
        match json_type(buf.first()) {
            // `null`, like an empty YAML document, is nothing.
            "null" => {}
            what => problem(out.sink()?, format!("expected a Kubernetes object, found {what}")),
        }
        return Ok(());
    }
    sc.consume(1);
    let mut fields: Vec<(String, Box<RawValue>)> = Vec::new();
    let (mut kind, mut api_version): (Option<String>, Option<String>) = (None, None);
    // Whether `items` was streamed, and what it turned out to be.
    let mut items: Option<Items> = None;
    let mut first = true;
    loop {
        match sc.peek()? {
            Some(b'}') if first => {
                sc.consume(1);
                break;
            }
            Some(b'"') => {}
            Some(_) => return Err(ScanError::Syntax("expected a key".into(), sc.offset)),
            None => return Err(ScanError::Eof("an object", sc.offset)),
        }
        first = false;
        buf.clear();
        let at = sc.value(&mut buf)?;
        let key: String = serde_json::from_slice(&buf).map_err(|e| ScanError::from_serde(&e, &buf, at))?;
        sc.expect(b':', "`:`")?;
        let streams = key == "items" && kind.as_deref().is_none_or(is_list) && depth < MAX_LIST_DEPTH;
        if streams && sc.peek()? == Some(b'[') {
            sc.consume(1);
            let mut j = 0;
            loop {
                if j == 0 && sc.peek()? == Some(b']') {
                    sc.consume(1);
                    break;
                }
                buf.clear();
                let at = sc.value(&mut buf)?;
                out.item(location, j, &buf, at, depth)?;
                j += 1;
                match sc.peek()? {
                    Some(b',') => sc.consume(1),
                    Some(b']') => {
                        sc.consume(1);
                        break;
                    }
                    Some(_) => return Err(ScanError::Syntax("expected `,` or `]`".into(), sc.offset)),
                    None => return Err(ScanError::Eof("a list", sc.offset)),
                }
            }
            items = Some(Items::List);
        } else {
            buf.clear();
            let at = sc.value(&mut buf)?;
            let raw: Box<RawValue> = serde_json::from_slice(&buf).map_err(|e| ScanError::from_serde(&e, &buf, at))?;
            if streams {
                items = Some(if raw.get() == "null" { Items::Null } else { Items::NotAList });
            } else {
                match key.as_str() {
                    "kind" => kind = serde_json::from_str(raw.get()).ok(),
                    "apiVersion" => api_version = serde_json::from_str(raw.get()).ok(),
                    _ => {}
                }
                // A key written twice: the last one counts, as in a JSON value.
                fields.retain(|(k, _)| *k != key);
                fields.push((key, raw));
            }
        }
        match sc.peek()? {
            Some(b',') => sc.consume(1),
            Some(b'}') => {
                sc.consume(1);
                break;
            }
            Some(_) => return Err(ScanError::Syntax("expected `,` or `}`".into(), sc.offset)),
            None => return Err(ScanError::Eof("an object", sc.offset)),
        }
    }
    match items {
        Some(items) if kind.as_deref().is_some_and(is_list) => {
            if items == Items::NotAList {
                problem(out.sink()?, format!("{}.items is not a list", kind.unwrap_or_default()));
            }
        }
        Some(Items::NotAList | Items::Null) | None => {
            let mut text = String::with_capacity(fields.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum::<usize>() + 2);
            text.push('{');
            for (i, (k, v)) in fields.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&serde_json::to_string(k).unwrap_or_default());
                text.push(':');
                text.push_str(v.get());
            }
            text.push('}');
            out.sink()?.object(location, Object::Json { text: &text, kind, api_version });
        }
        Some(Items::List) => {
            let what = kind.map_or_else(|| "has no kind".to_string(), |k| format!("is a {k}, not a List"));
            problem(out.sink()?, format!("has `items` but {what}; its items were read as objects"));
        }
    }
    Ok(())
}

/// What a `List`'s `items` was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Items {
    List,
    Null,
    NotAList,
}

/// One `List` item (its bytes, starting at offset `at`): handed over with its
/// kind read ahead, or flattened when it is a `List` itself.
fn item(location: &str, bytes: &[u8], at: u64, sink: &mut impl Sink, depth: usize) -> Result<(), ScanError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ScanError::Syntax("invalid UTF-8".into(), at + e.valid_up_to() as u64))?;
    let problem = |sink: &mut dyn FnMut(ManifestError), reason: String| sink(ManifestError { location: location.to_string(), reason });
    // Reading it whole also checks its syntax: an item of a kind nobody
    // converts must be valid JSON too.
    match serde_json::from_str::<Peek>(text).map_err(|e| ScanError::from_serde(&e, bytes, at))? {
        Peek::Object { kind, api_version, has_items } => {
            if has_items && kind.as_deref().is_some_and(is_list) {
                if depth + 1 >= MAX_LIST_DEPTH {
                    problem(&mut |e| sink.problem(e), format!("Lists nested more than {MAX_LIST_DEPTH} deep are not read"));
                    return Ok(());
                }
                return document(&mut Scanner::new(bytes, at), location, &mut Out { sink, pool: None }, depth + 1);
            }
            sink.object(location, Object::Json { text, kind, api_version });
        }
        // A null item, like an empty YAML document, is nothing.
        Peek::Other("null") => {}
        Peek::Other(what) => problem(&mut |e| sink.problem(e), format!("expected a Kubernetes object, found {what}")),
    }
    Ok(())
}

/// An item's `kind`, `apiVersion` and whether it has `items`, read without
/// keeping anything else (the rest is skipped, not allocated).
enum Peek {
    Object { kind: Option<String>, api_version: Option<String>, has_items: bool },
    Other(&'static str),
}

impl<'de> serde::Deserialize<'de> for Peek {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Peek, D::Error> {
        d.deserialize_any(PeekVisitor)
    }
}

struct PeekVisitor;

/// A string, or nothing for any other JSON value.
struct MaybeString(Option<String>);

impl<'de> serde::Deserialize<'de> for MaybeString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MaybeString, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(s.to_string())))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MaybeString, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MaybeString, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Visitor<'de> for PeekVisitor {
    type Value = Peek;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Peek, A::Error> {
        let (mut kind, mut api_version, mut has_items) = (None, None, false);
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match &*key {
                "kind" => kind = map.next_value::<MaybeString>()?.0,
                "apiVersion" => api_version = map.next_value::<MaybeString>()?.0,
                "items" => has_items = map.next_value::<Option<IgnoredAny>>()?.is_some(),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Peek::Object { kind, api_version, has_items })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Peek, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Peek::Other("a list"))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Peek, E> {
        Ok(Peek::Other("a string"))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Peek, E> {
        Ok(Peek::Other("a boolean"))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Peek, E> {
        Ok(Peek::Other("a number"))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Peek, E> {
        Ok(Peek::Other("a number"))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Peek, E> {
        Ok(Peek::Other("a number"))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Peek, E> {
        Ok(Peek::Other("null"))
    }
}

#[cfg(test)]
mod tests;
