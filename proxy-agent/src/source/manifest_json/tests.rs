//! The streaming JSON reader's tests, with serde_json as the reference: a
//! file is valid exactly when serde_json says so, errors are placed at
//! their line and column, a `List`'s items are streamed before its `kind`
//! and documents read one after another, nesting too deep is reported,
//! and `parse_in_parts` hands the sink the items in file order.

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

impl PartSink for Collect {
    fn append(&mut self, later: Self) {
        self.objects.extend(later.objects);
        self.problems.extend(later.problems);
    }
}

fn show(f: Failure) -> String {
    match f {
        Failure::NotJson(e) => format!("syntax: {e}"),
        Failure::Fatal(e) => format!("fatal: {e}"),
    }
}

/// Items converted on worker threads reach the sink as they do when
/// converted in order, with the same first error, wherever it is.
#[test]
fn items_in_parts_are_the_items_in_order() {
    let item = |i: usize| match i {
        900 => "[1]".to_string(),
        1300 => r#"{"kind":"List","items":[{"kind":"Node","metadata":{"name":"n"}},7]}"#.to_string(),
        _ => format!(r#"{{"kind":"Service","metadata":{{"name":"s{i}"}},"pad":"{}"}}"#, "x".repeat(i % 700)),
    };
    let list = |n: usize, broken: Option<usize>| {
        let items: Vec<String> =
            (0..n).map(|i| if Some(i) == broken { r#"{"kind":"Service","a":tru}"#.to_string() } else { item(i) }).collect();
        format!("{{\"apiVersion\":\"v1\",\"items\":[\n{}\n],\"kind\":\"List\"}}\n{{\"kind\":\"Node\"}}", items.join(",\n"))
    };
    let texts = [
        list(3000, None),
        list(3000, Some(1700)),
        list(3000, Some(2)),
        list(3000, Some(2999)),
        // Cut inside an item, after many: the scanner's error.
        list(3000, None)[..200_000].to_string(),
        // An item error, then the scanner's later on: the item's first.
        list(3000, Some(1000))[..600_000].to_string(),
        "{\"kind\":\"List\",\"items\":[]}".to_string(),
    ];
    let expect = ["ok", "syntax", "syntax", "syntax", "fatal", "syntax", "ok"];
    for (text, expect) in texts.iter().zip(expect) {
        let locate = |at| position(text.as_bytes(), at);
        let mut serial = Collect::default();
        let want = parse("t.json", text.as_bytes(), 0, &locate, &mut serial).map_err(show);
        assert_eq!(want.as_ref().map_or_else(|e| e.split(':').next().unwrap_or_default(), |()| "ok"), expect, "{want:?}");
        for workers in [2, 3] {
            let mut parts = Collect::default();
            let got = parse_in_parts("t.json", text.as_bytes(), 0, &locate, &mut parts, workers).map_err(show);
            assert_eq!(got, want, "{workers} workers");
            assert_eq!(parts.objects, serial.objects, "{workers} workers: {want:?}");
            assert_eq!(parts.problems, serial.problems, "{workers} workers: {want:?}");
        }
    }
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
