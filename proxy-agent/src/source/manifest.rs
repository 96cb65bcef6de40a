//! Reading Kubernetes manifests: which files make up a manifest set
//! ([`files`]), and the objects each file holds, handed to a [`Sink`] one
//! at a time so that no file is ever held whole: JSON (`kubectl get -o
//! json`: one object, or a `List`) item by item (`manifest_json`), YAML
//! streams document by document (`manifest_yaml`). Objects of a kind
//! ending in `List` are flattened, nested ones too.
//!
//! A file parses or it does not. A syntax error anywhere in it, or a read
//! error, is the file's [`ManifestError`], and whoever collects its
//! objects drops what it handed over (`manifest_set` keeps the objects of
//! the file's last good read). A problem confined to one document (not an
//! object, `items` not a list) goes to [`Sink::problem`] and the rest of
//! the file is read.

use std::fs;
use std::io::{BufRead, BufReader, Seek};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::source::{manifest_json, manifest_yaml};

/// A file, document or object that could not be read. The location names
/// the file, and the document (`file.yaml#2`) and list item
/// (`file.json#1[41]`) where there is one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {reason}")]
pub struct ManifestError {
    /// The file, document and list item (`file.yaml#2`, `file.json#1[41]`).
    pub location: String,
    /// What is wrong.
    pub reason: String,
}

/// One object of a manifest file, not yet converted into the model.
#[derive(Debug)]
pub enum Object<'a> {
    /// The JSON text of one object (a `List` item, or a JSON file's
    /// object): converted straight into the wire shapes, never through a
    /// generic value. `kind` and `api_version` were read ahead.
    Json {
        /// The object's JSON text.
        text: &'a str,
        /// Its `kind`, when it has one.
        kind: Option<String>,
        /// Its `apiVersion`, when it has one.
        api_version: Option<String>,
    },
    /// One YAML document, or one item of a `List` in one, parsed.
    Value(Value),
}

impl Object<'_> {
    /// The object's `kind`, when it is a string.
    pub fn kind(&self) -> Option<&str> {
        match self {
            Object::Json { kind, .. } => kind.as_deref(),
            Object::Value(v) => v.get("kind").and_then(Value::as_str),
        }
    }

    /// The object's `apiVersion`, when it is a string.
    pub fn api_version(&self) -> Option<&str> {
        match self {
            Object::Json { api_version, .. } => api_version.as_deref(),
            Object::Value(v) => v.get("apiVersion").and_then(Value::as_str),
        }
    }

    /// The object as a JSON value (tests and tools; the agent converts
    /// without one).
    pub fn into_value(self) -> Result<Value, String> {
        match self {
            Object::Json { text, .. } => serde_json::from_str(text).map_err(|e| e.to_string()),
            Object::Value(v) => Ok(v),
        }
    }
}

/// Where a file's objects go as they are parsed.
pub trait Sink {
    /// One object, at `location`.
    fn object(&mut self, location: &str, object: Object<'_>);
    /// A document that is not an object, a `List` whose `items` is not a
    /// list: reported, and the rest of the file is read.
    fn problem(&mut self, error: ManifestError);
    /// Forget what this file handed over so far: it is parsed again from
    /// the start (text that began like JSON and turned out to be YAML).
    fn restart(&mut self);
}

/// A [`Sink`] that can be filled in parts on several threads and the
/// parts joined in order: the items of a large JSON `List` are converted
/// in parallel ([`read_file_in_parts`]).
pub(crate) trait PartSink: Sink + Default + Send {
    /// Takes what `later` holds after what `self` holds.
    fn append(&mut self, later: Self);
    /// An empty part for about `objects` objects.
    fn with_room(objects: usize) -> Self {
        let _ = objects;
        Self::default()
    }
}

const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// The manifest files under `paths`, sorted, directories walked
/// recursively. A path that is a file is taken whatever its extension.
/// Inside directories, names starting with a dot are skipped: editors'
/// swap files, and the `..data` and `..2024_...` directories through
/// which the kubelet swaps a ConfigMap volume's files (their files are
/// also reachable by the volume's own symlinks, so they would be read
/// twice).
pub fn files(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<ManifestError>) {
    let listing = list(paths);
    (listing.files.into_iter().map(|(p, _)| p).collect(), listing.errors)
}

/// What [`files`] found, with each file's metadata (symlinks followed).
pub(crate) struct Listing {
    pub files: Vec<(PathBuf, fs::Metadata)>,
    pub errors: Vec<ManifestError>,
    /// Paths that could not be looked into (permissions, I/O errors) and
    /// paths given to [`list`] that are missing: the files under them are
    /// unknown, not gone.
    pub unlisted: Vec<PathBuf>,
}

pub(crate) fn list(paths: &[PathBuf]) -> Listing {
    let mut listing = Listing { files: Vec::new(), errors: Vec::new(), unlisted: Vec::new() };
    for p in paths {
        walk(p, true, &mut listing);
    }
    listing.files.sort_by(|a, b| a.0.cmp(&b.0));
    listing.files.dedup_by(|a, b| a.0 == b.0);
    listing
}

fn walk(p: &Path, explicit: bool, listing: &mut Listing) {
    let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
    if hidden && !explicit {
        return;
    }
    let mut fail = |reason: String, e: &std::io::Error| {
        // A path given to the agent that is missing is unavailable, like
        // an API server that cannot be reached, rather than emptied.
        if e.kind() != std::io::ErrorKind::NotFound || explicit {
            listing.unlisted.push(p.to_path_buf());
        }
        listing.errors.push(ManifestError { location: p.display().to_string(), reason });
    };
    match fs::metadata(p) {
        Ok(m) if m.is_dir() => match fs::read_dir(p) {
            Ok(rd) => {
                let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
                entries.sort();
                for e in entries {
                    walk(&e, false, listing);
                }
            }
            Err(e) => fail(format!("cannot list directory: {e}"), &e),
        },
        Ok(m) => {
            let wanted = p.extension().and_then(|e| e.to_str()).is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
            if explicit || wanted {
                listing.files.push((p.to_path_buf(), m));
            }
        }
        // A dangling symlink in a directory (a ConfigMap volume between
        // two swaps) is no file; one given by name is reported.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {}
        Err(e) => fail(format!("cannot read: {e}"), &e),
    }
}

/// Reads one file into `sink`. `Err`: the file could not be read or does
/// not parse; what it handed to `sink` before is not the file's content.
pub fn read_file(path: &Path, sink: &mut impl Sink) -> Result<(), ManifestError> {
    read_file_with(path, sink, |source, reader, offset, locate, sink, _| manifest_json::parse(source, reader, offset, locate, sink))
}

/// JSON files from this size up have their `List` items converted on
/// several threads: below it, starting them costs more than it saves.
const PARTS_FROM: u64 = 4 << 20;

/// [`read_file`], converting the items of a large JSON file's `List`s on
/// as many threads as the agent may run on (at most four), which gives the
/// sink the same objects in the same order.
pub(crate) fn read_file_in_parts<S: PartSink>(path: &Path, sink: &mut S) -> Result<(), ManifestError> {
    read_file_with(path, sink, |source, reader, offset, locate, sink, size| {
        let workers = if size >= PARTS_FROM { std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(4) } else { 1 };
        manifest_json::parse_in_parts(source, reader, offset, locate, sink, workers)
    })
}

/// [`read_file`] with `json` parsing a file that starts like JSON:
/// `(source, reader, offset, locate, sink, file size)`.
fn read_file_with<S: Sink>(
    path: &Path,
    sink: &mut S,
    json: impl FnOnce(
        &str,
        &mut BufReader<fs::File>,
        u64,
        &dyn Fn(u64) -> manifest_json::Position,
        &mut S,
        u64,
    ) -> Result<(), manifest_json::Failure>,
) -> Result<(), ManifestError> {
    let source = path.display().to_string();
    let cannot = |e: std::io::Error| ManifestError { location: source.clone(), reason: format!("cannot read: {e}") };
    let file = fs::File::open(path).map_err(cannot)?;
    let size = file.metadata().map_or(0, |m| m.len());
    let mut reader = BufReader::with_capacity(READ_BUFFER, file);
    if let Some(offset) = starts_like_json(&mut reader).map_err(cannot)? {
        let is_json = is_json_name(path);
        // Only for an error message: where in the file a byte offset is.
        let locate = |at: u64| {
            let mut head = Vec::new();
            let _ = fs::File::open(path).and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, at), &mut head));
            manifest_json::position(&head, at)
        };
        match json(&source, &mut reader, offset, &locate, sink, size) {
            Ok(()) => return Ok(()),
            // A `.json` file is JSON: YAML, a superset, would take some
            // broken JSON (`nul`, a missing quote) for strings.
            Err(manifest_json::Failure::Fatal(e) | manifest_json::Failure::NotJson(e)) if is_json => return Err(e),
            Err(manifest_json::Failure::Fatal(e)) => return Err(e),
            // Flow-style YAML (`{kind: Service, ...}`) starts like JSON.
            Err(manifest_json::Failure::NotJson(_)) => {
                sink.restart();
                reader.rewind().map_err(cannot)?;
                return manifest_yaml::parse(&source, reader, size, sink);
            }
        }
    }
    // From the start: the white space looked past counts in line numbers.
    reader.rewind().map_err(cannot)?;
    manifest_yaml::parse(&source, reader, size, sink)
}

/// [`read_file`] for text already in memory (tests, fuzzing); `source`
/// names it in locations.
pub fn parse_text(source: &str, text: &str, sink: &mut impl Sink) -> Result<(), ManifestError> {
    let mut bytes = text.as_bytes();
    if let Ok(Some(offset)) = starts_like_json(&mut bytes) {
        match manifest_json::parse(source, bytes, offset, &|at| manifest_json::position(text.as_bytes(), at), sink) {
            Ok(()) => return Ok(()),
            Err(manifest_json::Failure::Fatal(e) | manifest_json::Failure::NotJson(e)) if is_json_name(Path::new(source)) => return Err(e),
            Err(manifest_json::Failure::Fatal(e)) => return Err(e),
            Err(manifest_json::Failure::NotJson(_)) => sink.restart(),
        }
    }
    manifest_yaml::parse(source, text.as_bytes(), text.len() as u64, sink)
}

const READ_BUFFER: usize = 256 * 1024;

fn is_json_name(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// Whether the first thing in `r` after white space (and a UTF-8 byte
/// order mark, which JSON parsers refuse) opens a JSON object or array:
/// if so, how many bytes of white space (and mark) were consumed.
fn starts_like_json(r: &mut impl BufRead) -> std::io::Result<Option<u64>> {
    let mut consumed = 0u64;
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok(None);
        }
        let bom = if consumed == 0 && buf.starts_with(b"\xEF\xBB\xBF") { 3 } else { 0 };
        let skip = bom + buf[bom..].iter().take_while(|b| b.is_ascii_whitespace()).count();
        if skip < buf.len() {
            let opens = matches!(buf[skip], b'{' | b'[');
            r.consume(skip);
            return Ok(opens.then_some(consumed + skip as u64));
        }
        let n = buf.len();
        r.consume(n);
        consumed += n as u64;
    }
}

/// One Kubernetes object as a JSON value and where it came from
/// ("file.yaml#2"): for tests and tools that want the objects themselves.
#[derive(Clone, Debug)]
pub struct Document {
    /// Where it came from.
    pub location: String,
    /// The object.
    pub value: Value,
}

/// Collects [`Document`]s. A file that does not parse keeps the documents
/// before the error, and the error is reported with the rest.
struct Documents<'a, F: FnMut(Document)> {
    f: F,
    errors: &'a mut Vec<ManifestError>,
    held: Vec<Document>,
}

impl<F: FnMut(Document)> Sink for Documents<'_, F> {
    fn object(&mut self, location: &str, object: Object<'_>) {
        match object.into_value() {
            Ok(value) => self.held.push(Document { location: location.to_string(), value }),
            Err(reason) => self.errors.push(ManifestError { location: location.to_string(), reason }),
        }
    }
    fn problem(&mut self, error: ManifestError) {
        self.errors.push(error);
    }
    fn restart(&mut self) {
        self.held.clear();
    }
}

impl<F: FnMut(Document)> Documents<'_, F> {
    fn flush(&mut self) {
        for d in self.held.drain(..) {
            (self.f)(d);
        }
    }
}

/// Reads every object under `paths` as a JSON value.
pub fn load(paths: &[PathBuf]) -> (Vec<Document>, Vec<ManifestError>) {
    let mut docs = Vec::new();
    let errors = for_each(paths, |d| docs.push(d));
    (docs, errors)
}

/// Hands every object under `paths` to `f` as a JSON value, file by file.
pub fn for_each(paths: &[PathBuf], f: impl FnMut(Document)) -> Vec<ManifestError> {
    let (files, mut errors) = files(paths);
    let mut sink = Documents { f, errors: &mut errors, held: Vec::new() };
    for file in files {
        if let Err(e) = read_file(&file, &mut sink) {
            sink.errors.push(e);
        }
        sink.flush();
    }
    errors
}

/// Parses one file's text into JSON values (tests, fuzzing).
pub fn parse_into(source: &str, text: &str, docs: &mut Vec<Document>, errors: &mut Vec<ManifestError>) {
    let mut sink = Documents { f: |d| docs.push(d), errors, held: Vec::new() };
    if let Err(e) = parse_text(source, text, &mut sink) {
        sink.errors.push(e);
    }
    sink.flush();
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

    fn show(d: &[Document]) -> Vec<String> {
        d.iter().map(|d| format!("{} {}", d.location, d.value)).collect()
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

    #[test]
    fn json_and_yaml_give_the_same_objects() {
        let cases = [
            // kubectl's order: `items` before `kind`, and an item's
            // `kind` after its other fields.
            (
                r#"{"apiVersion":"v1","items":[{"addressType":"IPv4","endpoints":[],"kind":"EndpointSlice"},{"kind":"Service","spec":{"ports":[{"port":80}]}}],"kind":"List","metadata":{}}"#,
                "apiVersion: v1\nitems:\n- {addressType: IPv4, endpoints: [], kind: EndpointSlice}\n- kind: Service\n  spec: {ports: [{port: 80}]}\nkind: List\nmetadata: {}\n",
            ),
            (r#"{"kind":"Service","metadata":{"name":"a"}}"#, "kind: Service\nmetadata: {name: a}\n"),
            (r#"{"kind":"ServiceList","items":null}"#, "kind: ServiceList\nitems: null\n"),
            (
                r#"{"kind":"List","items":[{"kind":"NodeList","items":[{"kind":"Node"}]},{"kind":"Node"}]}"#,
                "kind: List\nitems: [{kind: NodeList, items: [{kind: Node}]}, {kind: Node}]\n",
            ),
            ("{\"kind\":\"Service\"}\n{\"kind\":\"Node\"}\n", "kind: Service\n---\nkind: Node\n"),
        ];
        for (json, yaml) in cases {
            let (dj, ej) = parse(json);
            let (dy, ey) = parse(yaml);
            assert!(ej.is_empty() && ey.is_empty(), "{json}: {ej:?} {ey:?}");
            let values = |d: &[Document]| d.iter().map(|d| d.value.clone()).collect::<Vec<_>>();
            assert_eq!(values(&dj), values(&dy), "{json}");
            let items = |d: &[Document]| d.iter().map(|d| d.location.split_once('#').map(|x| x.1.to_string())).collect::<Vec<_>>();
            if !json.contains('\n') {
                assert_eq!(items(&dj), items(&dy), "{json}");
            }
        }
    }

    #[test]
    fn flow_style_yaml_that_starts_like_json_is_yaml() {
        let (d, e) = parse("{kind: Service, metadata: {name: a}}\n---\n{kind: Node}\n");
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(show(&d), ["t.yaml#1 {\"kind\":\"Service\",\"metadata\":{\"name\":\"a\"}}", "t.yaml#2 {\"kind\":\"Node\"}"]);
        let (d, e) = parse("{\"kind\": \"Service\"}\n---\n{\"kind\": \"Node\"}\n");
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(d.len(), 2, "JSON documents between YAML markers");
    }

    #[test]
    fn truncated_json_is_an_error_of_the_file() {
        let (d, e) = parse(r#"{"apiVersion":"v1","items":[{"kind":"Service","metadata":{"name":"a"}},{"kind":"Serv"#);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].reason.starts_with("not valid JSON: EOF while parsing"), "{e:?}");
        assert_eq!(e[0].location, "t.yaml#1");
        assert_eq!(d.len(), 1, "the documents before the error are handed over; the agent's sink drops them");
    }

    #[test]
    fn document_problems_leave_the_rest() {
        let (d, e) = parse(r#"{"kind":"List","items":{"kind":"Service"}} [1, 2] "text" {"kind":"Node"}"#);
        assert_eq!(show(&d), ["t.yaml#4 {\"kind\":\"Node\"}"]);
        let reasons: Vec<&str> = e.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["List.items is not a list", "expected a Kubernetes object, found a list", "expected a Kubernetes object, found a string"]
        );
        let (_, e) = parse(r#"{"kind":"List","items":[1, {"kind":"Node"}]}"#);
        assert_eq!(e, [ManifestError { location: "t.yaml#1[0]".into(), reason: "expected a Kubernetes object, found a number".into() }]);
    }

    #[test]
    fn garbage_is_reported_not_fatal() {
        let (d, e) = parse("kind: Service\n---\n- 1\n- 2\n---\nkind: [unclosed\n");
        assert_eq!(d.len(), 1);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].reason.contains("found a list"));
        assert!(e[1].reason.contains("not valid YAML"));
        assert_eq!(e[1].location, "t.yaml#3");
    }

    #[test]
    fn file_errors_name_the_line_and_column() {
        #[derive(Default)]
        struct Count(usize);
        impl Sink for Count {
            fn object(&mut self, _: &str, _: Object<'_>) {
                self.0 += 1;
            }
            fn problem(&mut self, _: ManifestError) {}
            fn restart(&mut self) {
                self.0 = 0;
            }
        }
        let dir = std::env::temp_dir().join(format!("tp-manifest-lines-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("mkdir");
        let json = dir.join("a.json");
        fs::write(
            &json,
            "\u{feff}\n\n{\"kind\": \"List\", \"items\": [\n  {\"kind\": \"Service\"},\n  {\"kind\": \"Node\", \"x\": nul}\n]}\n",
        )
        .expect("write");
        let e = read_file(&json, &mut Count::default()).expect_err("broken");
        assert_eq!(e.to_string(), format!("{}#1: not valid JSON: expected ident at line 5 column 28", json.display()));
        let yaml = dir.join("b.yaml");
        fs::write(&yaml, "\n\nkind: Service\n---\nkind: [broken\n").expect("write");
        let e = read_file(&yaml, &mut Count::default()).expect_err("broken");
        assert!(e.location.ends_with("b.yaml#2") && e.reason.contains("line 6 column 1"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn files_skip_hidden_entries_inside_directories() {
        let dir = std::env::temp_dir().join(format!("tp-manifest-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for f in ["a.yaml", "b.json", "c.txt", ".a.yaml.swp", ".hidden.yaml", "..data/x.yaml", "sub/d.yml"] {
            let p = dir.join(f);
            fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            fs::write(&p, "").expect("write");
        }
        let (files, errors) = files(&[dir.clone(), dir.join("c.txt"), dir.join("missing.yaml")]);
        let names: Vec<String> = files.iter().map(|f| f.strip_prefix(&dir).expect("under dir").display().to_string()).collect();
        assert_eq!(names, ["a.yaml", "b.json", "c.txt", "sub/d.yml"]);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].location.ends_with("missing.yaml") && errors[0].reason.starts_with("cannot read"), "{errors:?}");
        let _ = fs::remove_dir_all(&dir);
    }
}
