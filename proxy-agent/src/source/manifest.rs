//! Reading Kubernetes manifests from files and directories: YAML or JSON,
//! several documents per file, `List` objects flattened. The result is raw
//! JSON values; `objects.rs` turns them into the model.

use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// One Kubernetes object and where it came from ("file.yaml#2").
#[derive(Clone, Debug)]
pub struct Document {
    pub location: String,
    pub value: Value,
}

/// A file or document that could not be read. Reading goes on with the rest.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {reason}")]
pub struct ManifestError {
    pub location: String,
    pub reason: String,
}

const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// The manifest files under `paths`, sorted, directories walked
/// recursively. A path that is a file is taken whatever its extension.
pub fn files(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<ManifestError>) {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for p in paths {
        walk(p, true, &mut out, &mut errors);
    }
    out.sort();
    out.dedup();
    (out, errors)
}

fn walk(p: &Path, explicit: bool, out: &mut Vec<PathBuf>, errors: &mut Vec<ManifestError>) {
    let err = |reason: String| ManifestError { location: p.display().to_string(), reason };
    match fs::metadata(p) {
        Ok(m) if m.is_dir() => match fs::read_dir(p) {
            Ok(rd) => {
                let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
                entries.sort();
                for e in entries {
                    walk(&e, false, out, errors);
                }
            }
            Err(e) => errors.push(err(format!("cannot list directory: {e}"))),
        },
        Ok(_) => {
            let wanted = p.extension().and_then(|e| e.to_str()).is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
            // Editors leave hidden swap files next to manifests; skip them in
            // directories.
            let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
            if explicit || (wanted && !hidden) {
                out.push(p.to_path_buf());
            }
        }
        Err(e) => errors.push(err(format!("cannot read: {e}"))),
    }
}

/// Reads every object from `paths`.
pub fn load(paths: &[PathBuf]) -> (Vec<Document>, Vec<ManifestError>) {
    let mut docs = Vec::new();
    let errors = for_each(paths, |d| docs.push(d));
    (docs, errors)
}

/// Hands every object from `paths` to `f` as soon as it is parsed, one
/// document at a time, so the caller need not hold them all (the agent
/// converts each into its model and drops it).
pub fn for_each(paths: &[PathBuf], mut f: impl FnMut(Document)) -> Vec<ManifestError> {
    let (files, mut errors) = files(paths);
    for file in files {
        match fs::read_to_string(&file) {
            Ok(text) => parse_each(&file.display().to_string(), &text, &mut f, &mut errors),
            Err(e) => errors.push(ManifestError { location: file.display().to_string(), reason: format!("cannot read: {e}") }),
        }
    }
    errors
}

/// A cheap fingerprint of the manifest set (names, sizes and contents) so
/// the agent re-programs only when something changed.
pub fn fingerprint(paths: &[PathBuf]) -> u64 {
    let (files, errors) = files(paths);
    let mut h = DefaultHasher::new();
    for f in files {
        f.hash(&mut h);
        match fs::read(&f) {
            Ok(bytes) => bytes.hash(&mut h),
            Err(e) => e.kind().hash(&mut h),
        }
    }
    errors.len().hash(&mut h);
    h.finish()
}

/// Parses one file's text. YAML is a superset of JSON, so one parser serves
/// both; every `---` document is an object or a `List` of objects.
pub fn parse_into(source: &str, text: &str, docs: &mut Vec<Document>, errors: &mut Vec<ManifestError>) {
    parse_each(source, text, &mut |d| docs.push(d), errors);
}

/// [`parse_into`], handing each object to `f`.
fn parse_each(source: &str, text: &str, f: &mut impl FnMut(Document), errors: &mut Vec<ManifestError>) {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(MAX_THREADS);
    let skip = if text.len() >= PARALLEL_MIN_BYTES && threads > 1 {
        match parse_parallel(source, text, threads, BLOCK_BYTES, f, errors) {
            Parallel::Done => return,
            Parallel::Stopped { delivered } => delivered,
        }
    } else {
        0
    };
    parse_sequential(source, text, skip, f, errors);
}

/// Files smaller than this are parsed on the calling thread.
const PARALLEL_MIN_BYTES: usize = 256 * 1024;
/// Text handed to a parser thread at a time.
const BLOCK_BYTES: usize = 64 * 1024;
const MAX_THREADS: usize = 4;
/// Blocks parsed ahead of the one being converted, which bounds the
/// memory held in parsed documents.
const LOOKAHEAD: usize = 8;

/// Where documents start: at every line that is a `---` marker. libyaml
/// ends whatever it is scanning at such a line (a document indicator at
/// column 0 ends block and plain scalars and is an error inside quoted
/// scalars and flow collections; yaml_parser_fetch_next_token), so in a
/// valid stream each piece is one or more whole documents. `None` when the
/// text has directives (`%YAML`, `%TAG`), which belong to the document
/// after them. Cutting is only an optimisation: the pieces hold the same
/// documents in the same order, and any parse error sends the caller back
/// to parsing the whole text.
fn document_starts(text: &str) -> Option<Vec<usize>> {
    let bytes = text.as_bytes();
    let mut starts = vec![0];
    let mut at = 0;
    while at < bytes.len() {
        let line = &bytes[at..];
        if line.first() == Some(&b'%') {
            return None;
        }
        if line.starts_with(b"---") && matches!(line.get(3), None | Some(b' ' | b'\t' | b'\r' | b'\n')) && at > 0 {
            starts.push(at);
        }
        at = match line.iter().position(|&c| c == b'\n') {
            Some(nl) => at + nl + 1,
            None => bytes.len(),
        };
    }
    Some(starts)
}

enum Parallel {
    Done,
    /// A piece failed to parse; `delivered` documents were handed over.
    Stopped {
        delivered: usize,
    },
}

/// What a parser thread made of one block of pieces: its documents in
/// order, or `None` when one of them did not parse.
type Block = Option<Vec<Value>>;

/// Parses the documents of a large file on several threads and hands them
/// to `f` in file order on the calling thread, as [`parse_sequential`]
/// would. The text is cut into pieces at `---` lines (see
/// [`document_starts`]) and the pieces into blocks of about `block_bytes`.
fn parse_parallel(
    source: &str,
    text: &str,
    threads: usize,
    block_bytes: usize,
    f: &mut impl FnMut(Document),
    errors: &mut Vec<ManifestError>,
) -> Parallel {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Mutex, mpsc};

    let Some(starts) = document_starts(text) else { return Parallel::Stopped { delivered: 0 } };
    // Blocks: ranges of text made of whole pieces. The first takes the
    // text before the first marker with it: on its own, a prefix of only
    // comments would parse as an empty document the whole stream does not
    // have. Every later block starts with a marker.
    let mut blocks: Vec<(usize, usize)> = Vec::new();
    let mut from = 0;
    for &s in starts.iter().skip(2) {
        if s - from >= block_bytes {
            blocks.push((from, s));
            from = s;
        }
    }
    blocks.push((from, text.len()));

    let next = AtomicUsize::new(0);
    let abort = AtomicBool::new(false);
    // Tokens bound how far the parser threads run ahead of the conversion.
    let (token_tx, token_rx) = mpsc::sync_channel::<()>(LOOKAHEAD);
    for _ in 0..LOOKAHEAD {
        let _ = token_tx.send(());
    }
    let token_rx = Mutex::new(token_rx);
    let (senders, receivers): (Vec<mpsc::SyncSender<Block>>, Vec<mpsc::Receiver<Block>>) =
        blocks.iter().map(|_| mpsc::sync_channel(1)).unzip();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let token = token_rx.lock().map(|rx| rx.recv());
                    if !matches!(token, Ok(Ok(()))) || abort.load(Ordering::Relaxed) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(a, b)) = blocks.get(i) else { return };
                    let _ = senders[i].send(parse_block(&text[a..b]));
                }
            });
        }
        let mut delivered = 0;
        let mut complete = true;
        for rx in &receivers {
            let block = rx.recv().ok().flatten();
            let _ = token_tx.try_send(());
            let Some(docs) = block else {
                complete = false;
                break;
            };
            for value in docs {
                delivered += 1;
                push_object(&format!("{source}#{delivered}"), value, f, errors);
            }
        }
        abort.store(true, Ordering::Relaxed);
        // Wakes the threads waiting for a token.
        drop(token_tx);
        if complete { Parallel::Done } else { Parallel::Stopped { delivered } }
    })
}

/// Parses whole pieces; `None` as soon as one document fails.
fn parse_block(text: &str) -> Block {
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(text) {
        docs.push(Value::deserialize(de).ok()?);
    }
    Some(docs)
}

/// Parses `text` document by document, handing over every document from
/// the `skip`-th on (the ones before were handed over already).
fn parse_sequential(source: &str, text: &str, skip: usize, f: &mut impl FnMut(Document), errors: &mut Vec<ManifestError>) {
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let src = format!("{source}#{}", i + 1);
        if i < skip {
            // Parsed again only to reach the document after them.
            if let Err(e) = serde::de::IgnoredAny::deserialize(de) {
                errors.push(ManifestError { location: src, reason: format!("not valid YAML/JSON: {e}") });
                break;
            }
            continue;
        }
        let value = match Value::deserialize(de) {
            Ok(v) => v,
            Err(e) => {
                errors.push(ManifestError { location: src, reason: format!("not valid YAML/JSON: {e}") });
                // After a syntax error the YAML stream cannot be resumed.
                break;
            }
        };
        push_object(&src, value, f, errors);
    }
}

fn push_object(src: &str, value: Value, f: &mut impl FnMut(Document), errors: &mut Vec<ManifestError>) {
    match value {
        Value::Null => {} // empty document between separators
        Value::Object(mut map) => {
            let kind = map.get("kind").and_then(Value::as_str).unwrap_or_default().to_string();
            if kind.ends_with("List") && map.contains_key("items") {
                match map.remove("items") {
                    Some(Value::Array(items)) => {
                        for (j, item) in items.into_iter().enumerate() {
                            push_object(&format!("{src}[{j}]"), item, f, errors);
                        }
                    }
                    Some(Value::Null) => {}
                    _ => errors.push(ManifestError { location: src.into(), reason: format!("{kind}.items is not a list") }),
                }
            } else {
                f(Document { location: src.into(), value: Value::Object(map) });
            }
        }
        other => errors
            .push(ManifestError { location: src.into(), reason: format!("expected a Kubernetes object, found {}", json_type(&other)) }),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> (Vec<Document>, Vec<ManifestError>) {
        let mut d = Vec::new();
        let mut e = Vec::new();
        parse_into("t.yaml", text, &mut d, &mut e);
        (d, e)
    }

    #[test]
    fn multi_document_yaml_with_empty_documents() {
        let (d, e) = parse("---\nkind: Service\nmetadata: {name: a}\n---\n---\nkind: Node\nmetadata: {name: n}\n");
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].location, "t.yaml#1");
        assert_eq!(d[1].location, "t.yaml#3", "empty documents still count, so locations match what editors show");
    }

    #[test]
    fn json_and_lists_are_flattened() {
        let (d, e) = parse(r#"{"kind":"List","items":[{"kind":"Service"},{"kind":"ServiceList","items":[{"kind":"Service"}]}]}"#);
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].location, "t.yaml#1[1][0]");
    }

    /// The parallel parser with tiny blocks (a block per piece), falling
    /// back as `parse_each` does.
    fn parse_cut(text: &str) -> (Vec<Document>, Vec<ManifestError>) {
        let mut d = Vec::new();
        let mut e = Vec::new();
        if let Parallel::Stopped { delivered } = parse_parallel("t.yaml", text, 3, 1, &mut |doc| d.push(doc), &mut e) {
            parse_sequential("t.yaml", text, delivered, &mut |doc| d.push(doc), &mut e);
        }
        (d, e)
    }

    #[test]
    fn cutting_at_document_markers_changes_nothing() {
        let mut big = String::new();
        for i in 0..300 {
            big.push_str(&format!("---\nkind: Service\nmetadata: {{name: s{i}}}\nspec: {{ports: [{{port: 80}}]}}\n"));
        }
        let texts = [
            "---\nkind: Service\nmetadata: {name: a}\n---\n---\nkind: Node\nmetadata: {name: n}\n",
            "kind: A\n---\nkind: B\n...\n--- {kind: C}\n---\r\nkind: D\r\n",
            "# leading comment\n\n---\nkind: A\ndata: |\n  ---\n  not a marker\n---\n- 1\n---\nkind: B\n",
            "kind: Service\n---\n- 1\n- 2\n---\nkind: [unclosed\n---\nkind: After\n",
            "kind: A\n---\nkey: \"open quote\n---\nkind: B\n",
            "%YAML 1.2\n---\nkind: A\n---\nkind: B\n",
            "----\nkind: A\n---x\n",
            "",
            &big,
            &format!("{big}---\nkind: [broken\n{big}"),
        ];
        for text in texts {
            let (d1, e1) = parse(text);
            let (d2, e2) = parse_cut(text);
            let show = |d: &[Document]| d.iter().map(|d| format!("{} {}", d.location, d.value)).collect::<Vec<_>>();
            assert_eq!(show(&d1), show(&d2), "{text:?}");
            assert_eq!(e1, e2, "{text:?}");
        }
        assert_eq!(parse(&big).0.len(), 300);
    }

    #[test]
    fn garbage_is_reported_not_fatal() {
        let (d, e) = parse("kind: Service\n---\n- 1\n- 2\n---\nkind: [unclosed\n");
        assert_eq!(d.len(), 1);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].reason.contains("found a list"));
        assert!(e[1].reason.contains("not valid YAML"));
    }
}
