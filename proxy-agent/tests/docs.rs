//! The book's pages that describe the agent itself, checked against it so
//! that they cannot drift (`docs/src`, built by `cargo xtask docs`; the
//! checks that need no agent are in `xtask/src/docs.rs`):
//!
//! - each subcommand's usage (`reference/cli/help/<sub>.txt`) is what
//!   `proxy-agent <sub> --help` prints, every subcommand `proxy-agent
//!   --help` lists has one, and its page includes it;
//! - the metrics page names every metric family the agent's registry
//!   exports, every reason its kernel counters report and every reason of
//!   `topoproxy_errors_total`, and every `topoproxy_*`/`kubeproxy_*` name
//!   anywhere in the book or the README is one the registry exports;
//! - an output marked `<!-- checked-output -->` (a `sh` block with one
//!   `proxy-agent` command, then a `text` block) is what the command prints.
//!
//! With `TOPOPROXY_DOCS_BLESS=1` (what `cargo xtask docs` sets) the usage
//! files and the checked outputs are written instead of compared, and a
//! missing subcommand page gets a stub. No root, no kernel.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::{Duration, SystemTime};

use proxy_agent::observe::metrics::{CounterReader, GcFigures, Metrics, SyncFigures};

const BLESS_ENV: &str = "TOPOPROXY_DOCS_BLESS";

fn bless() -> bool {
    std::env::var_os(BLESS_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("proxy-agent lives in the workspace").to_path_buf()
}

fn book() -> PathBuf {
    workspace().join("docs/src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every `.md` file of the book, and the README.
fn documents() -> Vec<PathBuf> {
    let mut out = vec![workspace().join("README.md")];
    let mut stack = vec![book()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The agent binary, run as a user would see it: no environment, so that
/// no `LOG_LEVEL` or `NODE_NAME` of the caller shows in the `[env: ...]`
/// of the usage, from the workspace root (paths in the book are relative
/// to it).
fn agent(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .args(args)
        .env_clear()
        .current_dir(workspace())
        .output()
        .unwrap_or_else(|e| panic!("running proxy-agent {args:?}: {e}"));
    assert!(out.status.success(), "proxy-agent {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The subcommands `proxy-agent --help` lists (hidden ones are not), less
/// `help`.
fn subcommands() -> Vec<String> {
    let help = agent(&["--help"]);
    let list = help.split("Commands:\n").nth(1).expect("`proxy-agent --help` lists its commands");
    list.lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn each_subcommand_has_a_page_with_the_usage_the_binary_prints() {
    let cli = book().join("reference/cli");
    let help_dir = cli.join("help");
    let subs = subcommands();
    assert!(subs.iter().any(|s| s == "run"), "{subs:?}");
    let mut problems = Vec::new();
    for sub in &subs {
        let usage = agent(&[sub, "--help"]);
        let file = help_dir.join(format!("{sub}.txt"));
        if bless() {
            std::fs::create_dir_all(&help_dir).expect("creating the usage directory");
            std::fs::write(&file, &usage).expect("writing a usage file");
        } else if std::fs::read_to_string(&file).ok().as_deref() != Some(usage.as_str()) {
            problems.push(format!("{} differs from `proxy-agent {sub} --help` (run `cargo xtask docs`)", file.display()));
        }
        let page = cli.join(format!("{sub}.md"));
        let include = format!("{{{{#include help/{sub}.txt}}}}");
        if bless() && !page.exists() {
            let stub = format!("# proxy-agent {sub}\n\n## Usage\n\n```text\n{include}\n```\n");
            std::fs::write(&page, stub).expect("writing a stub page");
            eprintln!("wrote a stub {}: describe the command and add it to SUMMARY.md", page.display());
        }
        if !std::fs::read_to_string(&page).unwrap_or_default().contains(&include) {
            problems.push(format!("{} does not exist or does not include help/{sub}.txt", page.display()));
        }
    }
    // A usage file of a subcommand that is gone.
    for entry in std::fs::read_dir(&help_dir).expect("reading the usage directory") {
        let path = entry.expect("a directory entry").path();
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        if !subs.contains(&stem) {
            if bless() {
                std::fs::remove_file(&path).expect("removing a stale usage file");
            } else {
                problems.push(format!("{} belongs to no subcommand (run `cargo xtask docs`)", path.display()));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What the agent's registry exports, run: every family name as it
/// appears in the exposition (counters with `_total`), and the `reason`
/// values per family. A family has no lines before its first series, so
/// every recorder of [`Metrics`] is called once; the kernel counters get
/// a reader that reports every index.
fn registry() -> (BTreeSet<String>, BTreeMap<String, BTreeSet<String>>) {
    let m = Metrics::new();
    let all = || -> CounterReader { Box::new(|| Ok(vec![1; 256])) };
    m.export_nodeport_counters(all());
    m.export_tc_fast_counters(all());
    m.export_socket_counters(all());
    m.record_conntrack_gc(&GcFigures { entries: 1, capacity: 2, deleted: &[("expired", 1, 2)] });
    m.record_port_bits(1, 1);
    m.set_termination_mechanism("iterators", &["iterators", "netlink", "none"]);
    m.sockets_terminated("udp", "deleted", 1);
    m.termination_batch(1);
    m.conntrack_flushed("udp", "deleted", 1, 2);
    m.error("watch");
    m.watch_event("Service");
    m.event_posted();
    m.set_api_versions(&[("discovery.k8s.io", "v1")]);
    m.set_kernel_features(&[("tcx", true)]);
    m.set_xdp_devices(&["eth0".to_string()], &[]);
    m.set_objects("Service", 1);
    m.programmed("EndpointSlice", SystemTime::now());
    m.endpoints_programmed(SystemTime::now());
    m.object_changes(1, 1);
    m.proxy_healthz(200);
    m.proxy_livez(200);
    m.set_maglev_tables("tc", 1, 1, 0);
    m.set_maglev_budget(1);
    m.record_sync(&SyncFigures { took: Duration::from_millis(1), occupancy: &[("SERVICES", 1, 2)], ..SyncFigures::default() });
    let text = m.encode();
    let mut families = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else { continue };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
        if kind == "counter" && !name.ends_with("_total") {
            families.insert(format!("{name}_total"));
        } else {
            families.insert(name.to_string());
        }
    }
    let mut reasons: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, labels)) = line.split_once('{') else { continue };
        let Some(value) = labels.split("reason=\"").nth(1).and_then(|v| v.split('"').next()) else { continue };
        reasons.entry(name.to_string()).or_default().insert(value.to_string());
    }
    (families, reasons)
}

/// The metric names the agent's source registers, without prefix or
/// suffix: the first string of every `register(`, `register_with_unit(`,
/// `encode_descriptor(` and `KernelCounters::new(` in `observe/` outside
/// its tests. This finds a metric that [`registry`] cannot show (one that
/// needs a recorder it does not call, or state it cannot make), so that a
/// new metric must be on the page however it is exported.
fn registered_stems() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let dir = workspace().join("proxy-agent/src/observe");
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let source = read(&path);
        let code = source.split("#[cfg(test)]").next().unwrap_or_default();
        for call in ["register(", "register_with_unit(", "encode_descriptor(", "KernelCounters::new("] {
            for (i, _) in code.match_indices(call) {
                let args = code[i + call.len()..].trim_start();
                if let Some(name) = args.strip_prefix('"').and_then(|a| a.split('"').next()) {
                    out.insert(name.to_string());
                }
            }
        }
    }
    assert!(out.len() > 20, "read only {out:?} from {}", dir.display());
    out
}

/// The names a metric of `stem` can have in the exposition.
fn candidates(stem: &str) -> Vec<String> {
    let mut out = Vec::new();
    for prefix in ["topoproxy_", "kubeproxy_"] {
        for suffix in ["", "_total", "_seconds", "_bytes"] {
            out.push(format!("{prefix}{stem}{suffix}"));
        }
    }
    out
}

/// The reasons of `topoproxy_errors_total`: the constants of
/// `observe/metrics.rs`'s `reason` module, read from the source (the
/// counter family has series only for reasons that happened).
fn error_reasons() -> BTreeSet<String> {
    let source = read(&workspace().join("proxy-agent/src/observe/metrics.rs"));
    let module = source.split("pub mod reason {").nth(1).expect("metrics.rs has `pub mod reason`");
    let module = module.split("\n}").next().unwrap_or_default();
    let reasons: BTreeSet<String> =
        module.lines().filter_map(|l| l.trim().strip_prefix("pub const ")?.split('"').nth(1).map(str::to_string)).collect();
    assert!(reasons.len() > 5, "read only {reasons:?} from metrics.rs");
    reasons
}

/// The `topoproxy_*` and `kubeproxy_*` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for prefix in ["topoproxy_", "kubeproxy_"] {
        for (i, _) in text.match_indices(prefix) {
            if text[..i].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '/' || c == '.') {
                continue;
            }
            let name: String = text[i..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
            out.insert(name);
        }
    }
    out
}

/// Whether `name` from the book is something the agent exports: one of
/// `families`, one of a histogram's series, or a prefix written `name_*`.
fn exported(name: &str, families: &BTreeSet<String>) -> bool {
    if name.ends_with('_') {
        return families.iter().any(|f| f.starts_with(name));
    }
    families.contains(name)
        || ["_bucket", "_count", "_sum", "_created"].iter().any(|s| name.strip_suffix(s).is_some_and(|base| families.contains(base)))
}

#[test]
fn the_metrics_page_lists_what_the_registry_exports() {
    let (families, reasons) = registry();
    let stems = registered_stems();
    let page_path = book().join("reference/metrics.md");
    let page = read(&page_path);
    let on_page = metric_names(&page);
    let mut problems = Vec::new();
    // Exact names for what the registry showed; for a stem it did not
    // show, any name it can have.
    let mut known = families.clone();
    for stem in &stems {
        let names = candidates(stem);
        if !names.iter().any(|n| families.contains(n)) {
            if !names.iter().any(|n| on_page.contains(n)) {
                problems.push(format!("a metric registered as {stem:?} (proxy-agent/src/observe) is not on {}", page_path.display()));
            }
            known.extend(names);
        }
    }
    for f in &families {
        if !on_page.contains(f) {
            problems.push(format!("metric {f} is exported but not on {}", page_path.display()));
        }
    }
    for (family, values) in &reasons {
        for r in values {
            if !page.contains(&format!("`{r}`")) {
                problems.push(format!("{family}{{reason=\"{r}\"}} is exported but `{r}` is not on {}", page_path.display()));
            }
        }
    }
    for r in error_reasons() {
        if !page.contains(&format!("`{r}`")) {
            problems.push(format!("topoproxy_errors_total reason `{r}` (observe/metrics.rs) is not on {}", page_path.display()));
        }
    }
    for doc in documents() {
        for name in metric_names(&read(&doc)) {
            if !exported(&name, &known) {
                problems.push(format!("{} names {name}, which the agent does not export", doc.display()));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The outputs marked `<!-- checked-output -->` in `text`: the command
/// line of the `sh` block after the marker, and the byte range of the body
/// of the `text` block after that.
fn checked_outputs(text: &str) -> Vec<(String, std::ops::Range<usize>)> {
    const MARKER: &str = "\n<!-- checked-output -->\n";
    let mut out = Vec::new();
    for (at, _) in text.match_indices(MARKER) {
        let rest = &text[at + MARKER.len()..];
        let sh = rest.trim_start().strip_prefix("```sh\n").unwrap_or_else(|| panic!("{MARKER} must precede a ```sh block"));
        let (command, after) = sh.split_once("\n```\n").expect("the ```sh block ends");
        assert_eq!(command.lines().count(), 1, "a checked output's ```sh block holds one command: {command:?}");
        let block = after
            .trim_start()
            .strip_prefix("```text\n")
            .unwrap_or_else(|| panic!("the output of {command:?} must follow as a ```text block"));
        let start = text.len() - block.len();
        let len = block.find("```\n").or_else(|| block.find("```")).expect("the ```text block ends");
        out.push((command.trim().to_string(), start..start + len));
    }
    out
}

#[test]
fn checked_outputs_are_what_the_commands_print() {
    let mut problems = Vec::new();
    let mut seen = 0;
    for doc in documents() {
        let mut text = read(&doc);
        let mut changed = false;
        // From the last one, so that rewriting keeps the earlier ranges.
        for (command, range) in checked_outputs(&text).into_iter().rev() {
            seen += 1;
            let args: Vec<&str> = command.split_whitespace().collect();
            assert_eq!(args.first(), Some(&"proxy-agent"), "a checked output runs proxy-agent: {command:?}");
            let printed = agent(&args[1..]);
            if text[range.clone()] != printed {
                if bless() {
                    text.replace_range(range, &printed);
                    changed = true;
                } else {
                    problems.push(format!(
                        "{}: the output shown for `{command}` is not what it prints (run `cargo xtask docs`):\n{printed}",
                        doc.display()
                    ));
                }
            }
        }
        if changed {
            std::fs::write(&doc, text).expect("writing a checked output");
        }
    }
    assert!(seen > 0, "no <!-- checked-output --> in the book");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn metric_names_are_read_with_their_boundaries() {
    let names =
        metric_names("`topoproxy_errors_total{reason}`, kubeproxy_proxy_livez_total and `topoproxy_conntrack_gc_*`; /x/topoproxy_no");
    let want: BTreeSet<String> =
        ["topoproxy_errors_total", "kubeproxy_proxy_livez_total", "topoproxy_conntrack_gc_"].iter().map(ToString::to_string).collect();
    assert_eq!(names, want);
    let families: BTreeSet<String> =
        ["topoproxy_conntrack_gc_runs_total", "topoproxy_sync_duration_seconds"].iter().map(ToString::to_string).collect();
    assert!(exported("topoproxy_conntrack_gc_", &families));
    assert!(exported("topoproxy_sync_duration_seconds_count", &families));
    assert!(!exported("topoproxy_sync_duration", &families));
}

/// The Grafana dashboard the chart ships (`charts/topoproxy/dashboards/`,
/// rendered into a ConfigMap by `metrics.grafanaDashboard`) is valid JSON,
/// and every query in it names only metrics the agent exports and, where
/// it selects reasons, only reasons those metrics report: a renamed metric
/// or reason must not leave an empty panel behind.
#[test]
fn the_grafana_dashboard_queries_only_what_the_agent_exports() {
    let path = workspace().join("charts/topoproxy/dashboards/topoproxy.json");
    let dash: serde_json::Value = serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let (families, mut reasons) = registry();
    reasons.entry("topoproxy_errors_total".to_string()).or_default().extend(error_reasons());
    let mut known = families.clone();
    for stem in registered_stems() {
        let names = candidates(&stem);
        if !names.iter().any(|n| families.contains(n)) {
            known.extend(names);
        }
    }
    let mut queries: Vec<(String, String)> = Vec::new();
    for panel in dash["panels"].as_array().expect("the dashboard has panels") {
        let title = panel["title"].as_str().unwrap_or("?").to_string();
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        for t in targets.unwrap_or_else(|| panic!("panel {title:?} has no query")) {
            queries.push((title.clone(), t["expr"].as_str().unwrap_or_default().to_string()));
        }
    }
    for var in dash["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = var["definition"].as_str() {
            queries.push((format!("variable {}", var["name"]), q.to_string()));
        }
    }
    assert!(queries.len() >= 6, "read only {queries:?}");
    let mut problems = Vec::new();
    for (title, expr) in &queries {
        let names = metric_names(expr);
        if names.is_empty() && !title.starts_with("variable") {
            problems.push(format!("{title}: {expr:?} names no topoproxy metric"));
        }
        for name in &names {
            if !exported(name, &known) {
                problems.push(format!("{title}: {name} is not a metric the agent exports"));
            }
        }
        // `metric{..., reason=~"a|b"}` or `reason="a"`: each reason must be
        // one the metric reports.
        for (at, _) in expr.match_indices("reason") {
            let rest = &expr[at + "reason".len()..];
            let Some(values) = rest.strip_prefix("=~\"").or_else(|| rest.strip_prefix("=\"")).and_then(|r| r.split('"').next()) else {
                continue;
            };
            // The selector belongs to the metric named last before it.
            let before = &expr[..at];
            let Some((_, metric)) = names.iter().filter_map(|n| before.rfind(n.as_str()).map(|i| (i, n))).max() else {
                continue;
            };
            let Some(have) = reasons.get(metric) else {
                problems.push(format!("{title}: {metric} reports no reasons, yet the query selects {values:?}"));
                continue;
            };
            for v in values.split('|') {
                if !have.contains(v) {
                    problems.push(format!("{title}: {metric} has no reason {v:?} (it has {have:?})"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}:\n{}", path.display(), problems.join("\n"));
}
