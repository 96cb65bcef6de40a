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

use std::fmt;
use std::io::BufRead;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::source::manifest::{ManifestError, Object, Sink};

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
    let mut scanner = Scanner::new(reader, offset);
    let mut n = 0;
    // Documents follow one another (JSON Lines, or objects simply written
    // one after the other).
    while scanner.peek().map_err(|e| e.failure(source, locate))?.is_some() {
        n += 1;
        let location = format!("{source}#{n}");
        document(&mut scanner, &location, sink, 0).map_err(|e| e.failure(&location, locate))?;
    }
    Ok(())
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
fn document<R: BufRead>(sc: &mut Scanner<R>, location: &str, sink: &mut impl Sink, depth: usize) -> Result<(), ScanError> {
    let problem = |sink: &mut dyn FnMut(ManifestError), reason: String| sink(ManifestError { location: location.to_string(), reason });
    let mut buf = Vec::new();
    if sc.peek()? != Some(b'{') {
        let at = sc.value(&mut buf)?;
        serde_json::from_slice::<IgnoredAny>(&buf).map_err(|e| ScanError::from_serde(&e, &buf, at))?;
        match json_type(buf.first()) {
            // `null`, like an empty YAML document, is nothing.
            "null" => {}
            what => problem(&mut |e| sink.problem(e), format!("expected a Kubernetes object, found {what}")),
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
                item(&format!("{location}[{j}]"), &buf, at, sink, depth)?;
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
                problem(&mut |e| sink.problem(e), format!("{}.items is not a list", kind.unwrap_or_default()));
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
            sink.object(location, Object::Json { text: &text, kind, api_version });
        }
        Some(Items::List) => {
            let what = kind.map_or_else(|| "has no kind".to_string(), |k| format!("is a {k}, not a List"));
            problem(&mut |e| sink.problem(e), format!("has `items` but {what}; its items were read as objects"));
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
                return document(&mut Scanner::new(bytes, at), location, sink, depth + 1);
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
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect {
        objects: Vec<String>,
        problems: Vec<String>,
    }

    impl Sink for Collect {
        fn object(&mut self, location: &str, object: Object<'_>) {
            self.objects.push(format!("{location} {}", object.into_value().unwrap_or_default()));
        }
        fn problem(&mut self, error: ManifestError) {
            self.problems.push(error.to_string());
        }
        fn restart(&mut self) {}
    }

    fn run(text: &str) -> (Collect, Result<(), String>) {
        let mut c = Collect::default();
        let r = parse("t.json", text.as_bytes(), 0, &|at| position(text.as_bytes(), at), &mut c).map_err(|f| match f {
            Failure::NotJson(e) => format!("syntax: {e}"),
            Failure::Fatal(e) => format!("fatal: {e}"),
        });
        (c, r)
    }

    #[test]
    fn valid_exactly_when_serde_json_says_so() {
        let texts = [
            r#"{"kind":"List","items":[{"kind":"Service"},{"kind":"Node"}]}"#,
            r#"{"items":[],"kind":"List"}"#,
            r#" {"a":"str with } and ] and \" and \\","kind":"Service"} "#,
            r#"{"kind":"List","items":[{"kind":"Service"},]}"#,
            r#"{"kind":"List","items":[{"kind":"Service"} {"kind":"Node"}]}"#,
            r#"{"kind":"Service",}"#,
            r#"{"kind":"Service" "a":1}"#,
            r#"{"kind":"Service","a":tru}"#,
            r#"{"kind":"Service","a":[1,2}}"#,
            r#"{"kind":"Service","a":01}"#,
            r#"{kind:"Service"}"#,
            r#"{"kind":"List","items":[{"kind":"Service","x":"\u00e9"}],"metadata":{}}"#,
            "{\"kind\":\"Service\",\"x\":\"caf\u{e9}\"}",
            r#"{"kind":"List","items":[{"kind":"Service","x":[[[[1]]]]}]}"#,
        ];
        for text in texts {
            let whole = serde_json::from_str::<serde_json::Value>(text);
            let (c, r) = run(text);
            assert_eq!(r.is_ok(), whole.is_ok(), "{text}: {r:?} {:?} {:?}", c.objects, whole);
        }
    }

    #[test]
    fn errors_are_placed_in_the_file() {
        let text = "{\n    \"apiVersion\": \"v1\",\n    \"items\": [\n        {\"kind\": \"Service\", \"a\": tru},\n    ]\n}\n";
        let (c, r) = run(text);
        assert!(c.objects.is_empty());
        assert_eq!(r, Err("syntax: t.json#1: not valid JSON: expected ident at line 4 column 37".to_string()));
        let (c, r) = run("{\"kind\": \"List\", \"items\": [{\"kind\": \"Service\"},\n {\"kind\": \"Serv");
        assert_eq!(c.objects.len(), 1);
        assert_eq!(r, Err("fatal: t.json#1: not valid JSON: EOF while parsing an object at line 2 column 16".to_string()));
        let (_, r) = run("{\"kind\": \"List\", \"items\": [{\"kind\": \"Service\"}");
        assert_eq!(r, Err("fatal: t.json#1: not valid JSON: EOF while parsing a list at line 1 column 47".to_string()));
    }

    #[test]
    fn items_before_kind_and_documents_one_after_another() {
        let (c, r) = run(
            r#"{"apiVersion":"v1","items":[{"endpoints":[],"kind":"EndpointSlice"},null,{"kind":"ServiceList","items":[{"kind":"Service"}]}],"kind":"List"}
            {"kind":"Node"} [1] "x" null"#,
        );
        assert_eq!(r, Ok(()));
        assert_eq!(
            c.objects,
            [
                "t.json#1[0] {\"endpoints\":[],\"kind\":\"EndpointSlice\"}",
                "t.json#1[2][0] {\"kind\":\"Service\"}",
                "t.json#2 {\"kind\":\"Node\"}"
            ]
        );
        assert_eq!(
            c.problems,
            ["t.json#3: expected a Kubernetes object, found a list", "t.json#4: expected a Kubernetes object, found a string"]
        );
        let (c, _) = run(r#"{"items":[{"kind":"Service"}],"kind":"Service"}"#);
        assert_eq!(c.problems, ["t.json#1: has `items` but is a Service, not a List; its items were read as objects"]);
        let (c, _) = run(r#"{"kind":"Service","items":[{"kind":"Node"}],"metadata":{"name":"a"}}"#);
        assert_eq!(c.objects, ["t.json#1 {\"items\":[{\"kind\":\"Node\"}],\"kind\":\"Service\",\"metadata\":{\"name\":\"a\"}}"]);
    }

    #[test]
    fn lists_nested_too_deep_are_reported() {
        let mut text = String::from(r#"{"kind":"Service"}"#);
        for _ in 0..12 {
            text = format!(r#"{{"kind":"List","items":[{text}]}}"#);
        }
        let (c, r) = run(&text);
        assert_eq!(r, Ok(()));
        assert!(c.objects.is_empty());
        assert_eq!(c.problems.len(), 1);
        assert!(c.problems[0].contains("nested more than 8 deep"), "{:?}", c.problems);
    }
}
