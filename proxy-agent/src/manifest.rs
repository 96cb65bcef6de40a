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
            let wanted = p
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
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
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let src = format!("{source}#{}", i + 1);
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
        other => errors.push(ManifestError {
            location: src.into(),
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

    #[test]
    fn garbage_is_reported_not_fatal() {
        let (d, e) = parse("kind: Service\n---\n- 1\n- 2\n---\nkind: [unclosed\n");
        assert_eq!(d.len(), 1);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].reason.contains("found a list"));
        assert!(e[1].reason.contains("not valid YAML"));
    }
}
