//! Rendering an error together with its sources. aya's and kube's top-level
//! messages ("`BPF_OBJ_PIN` failed", "watch failed") hide the errno or the
//! HTTP status that says what actually went wrong.

/// `error: source: source of source ...`; a source whose text the message
/// already contains (kube repeats its source in its own message) is not
/// repeated.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}
