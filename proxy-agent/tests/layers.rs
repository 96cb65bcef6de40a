//! The library's folders are its data flow, and imports follow the flow:
//! a folder uses only folders below it (`proxy-agent/src/lib.rs` draws the
//! order), the datapath's own folders likewise (`datapath/mod.rs`), and no
//! module imports one that imports it back. xtask's modules have no cycles
//! either. Test code (the `#[cfg(test)] mod tests` at the
//! end of a file) may reach further and is not counted.
//!
//! Pure text analysis of the source tree: no root, no kernel.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Folders of proxy-agent's library from the bottom up. Two folders of the
/// same rank may not use each other.
const RANKS: [(&str, u8); 10] = [
    ("util", 0),
    ("model", 1),
    ("migrate", 1),
    // Metrics and HTTP: above the model, whose `PortLabel` names the
    // per-Service counts, below every folder that reports to it.
    ("observe", 2),
    ("source", 3),
    ("decide", 3),
    ("datapath", 4),
    ("external", 5),
    ("sync", 6),
    // The fuzz targets' entry points: above everything they drive.
    ("fuzzing", 7),
];

/// The datapath's folders from the bottom up (`datapath/mod.rs`), by
/// module path prefix, the longest that matches. `loader/` spans three
/// ranks: what the kernel offers, its mounts and the pin directory's layout
/// (`pins`, which every folder that opens a pin uses) are below everything, the
/// eBPF object is below what loads programs from it (the socket
/// iterators), and the attach loaders are above the sockets they sweep at
/// install. `maps/` spans two: the map writer fills the Maglev tables, so it
/// sits above `maglev/` while the rest of the folder is below everything but
/// what the kernel offers. Two groups of the same rank may not use each
/// other.
const DATAPATH_RANKS: [(&str, u8); 12] = [
    ("datapath::loader::kernel_features", 0),
    ("datapath::loader::kernel_btf", 0),
    ("datapath::loader::mounts", 0),
    ("datapath::loader::pins", 0),
    ("datapath::maps", 1),
    ("datapath::loader::object", 2),
    ("datapath::conntrack", 3),
    ("datapath::maglev", 3),
    ("datapath::sockets", 4),
    ("datapath::maps::map_writer", 4),
    ("datapath::loader", 5),
    ("datapath::dump", 6),
];

/// Modules at the top of `datapath/` that no folder holds: the folder
/// module itself. It is not ranked; a new file there must be placed.
const DATAPATH_UNPLACED: [&str; 1] = ["datapath"];

/// Every `.rs` file under `dir`, as its module path ("datapath::maps::keys";
/// `mod.rs` is its folder's module, `lib.rs`/`main.rs` the root "").
fn modules(dir: &Path) -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, PathBuf>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().trim_end_matches(".rs").to_string();
            let full = if prefix.is_empty() { name.clone() } else { format!("{prefix}::{name}") };
            if path.is_dir() {
                walk(&path, &full, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let module = match name.as_str() {
                    "mod" | "lib" | "main" => prefix.to_string(),
                    _ => full,
                };
                out.insert(module, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, "", &mut out);
    out
}

/// The product part of a file: everything before its test module, without
/// comments.
fn product_code(text: &str) -> String {
    let end = text.find("#[cfg(test)]\nmod ").unwrap_or(text.len());
    text[..end].lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// The modules `module`'s code names through `crate::` or `super::` paths,
/// grouped imports (`crate::a::{b, c::D}`) included. A path names the
/// longest known module it starts with.
fn references(module: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent = match module.rsplit_once("::") {
        Some((p, _)) => p.to_string(),
        None => String::new(),
    };
    let mut out = BTreeSet::new();
    let mut resolve = |segments: &[&str]| {
        let mut best = None;
        for n in 1..=segments.len() {
            let candidate = segments[..n].join("::");
            if known.contains(&candidate) {
                best = Some(candidate);
            }
        }
        if let Some(m) = best
            && m != module
            && !m.is_empty()
        {
            out.insert(m);
        }
    };
    for (anchor, base) in [("crate::", String::new()), ("super::", parent)] {
        let mut rest = code;
        while let Some(i) = rest.find(anchor) {
            let before = rest[..i].chars().last();
            rest = &rest[i + anchor.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':' || *c == '{').collect();
            let head: Vec<&str> = path.trim_end_matches('{').split("::").filter(|s| !s.is_empty()).collect();
            let mut prefix: Vec<&str> = if base.is_empty() { Vec::new() } else { base.split("::").collect() };
            prefix.extend(head.iter().copied());
            resolve(&prefix);
            // `crate::a::{b, c}`: each name in the group, one level deep.
            if path.ends_with('{') {
                let group = rest[path.len()..].split('}').next().unwrap_or_default();
                for item in group.split(',') {
                    let item: Vec<&str> = item.trim().split("::").map(str::trim).collect();
                    let mut full = prefix.clone();
                    full.extend(item.iter().copied());
                    resolve(&full);
                }
            }
        }
    }
    out
}

fn graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = modules(dir);
    let known: BTreeSet<String> = files.keys().cloned().collect();
    files
        .iter()
        .map(|(m, path)| {
            let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            (m.clone(), references(m, &product_code(&text), &known))
        })
        .collect()
}

/// A cycle in `g`, as the modules along it, if there is one.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let start = stack.iter().position(|s| s == m).unwrap_or(0);
                    let mut cycle = stack[start..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if !state.contains_key(n.as_str())
            && let Some(c) = visit(n, g, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn rank(module: &str) -> Option<(&'static str, u8)> {
    let folder = module.split("::").next()?;
    RANKS.iter().find(|(f, _)| *f == folder).copied()
}

fn src(crate_dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(crate_dir).join("src")
}

#[test]
fn folders_import_only_folders_below_them() {
    let g = graph(&src("proxy-agent"));
    let mut wrong = Vec::new();
    for (m, refs) in &g {
        let Some((folder, r)) = rank(m) else { continue };
        for t in refs {
            let Some((to, tr)) = rank(t) else { continue };
            if to != folder && tr >= r {
                wrong.push(format!("{m} ({folder}) uses {t} ({to})"));
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the data flow:\n{}", wrong.join("\n"));
    // Every library folder is placed in the order.
    for m in g.keys().filter(|m| m.contains("::")) {
        assert!(rank(m).is_some() || m.starts_with("cmd::"), "{m} is in no ranked folder");
    }
}

/// The group of `DATAPATH_RANKS` a datapath module belongs to.
fn datapath_rank(module: &str) -> Option<(&'static str, u8)> {
    DATAPATH_RANKS
        .iter()
        .filter(|(prefix, _)| module == *prefix || module.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, _)| prefix.len())
        .copied()
}

#[test]
fn datapath_folders_import_only_folders_below_them() {
    let g = graph(&src("proxy-agent"));
    let mut wrong = Vec::new();
    for (m, refs) in g.iter().filter(|(m, _)| m.starts_with("datapath")) {
        let Some((group, r)) = datapath_rank(m) else {
            assert!(DATAPATH_UNPLACED.contains(&m.as_str()), "{m} is in no ranked datapath folder");
            continue;
        };
        for t in refs {
            let Some((to, tr)) = datapath_rank(t) else { continue };
            if to != group && tr >= r {
                wrong.push(format!("{m} ({group}) uses {t} ({to})"));
            }
        }
    }
    assert!(wrong.is_empty(), "datapath imports against the order:\n{}", wrong.join("\n"));
}

#[test]
fn util_imports_nothing_from_the_crate_and_observe_only_the_model() {
    let g = graph(&src("proxy-agent"));
    for (m, refs) in g.iter().filter(|(m, _)| m.starts_with("observe") || m.starts_with("util")) {
        let home = m.split("::").next();
        let allowed: &[&str] = if home == Some("observe") { &["observe", "model", "util"] } else { &["util"] };
        let outside: Vec<&String> = refs.iter().filter(|t| !t.split("::").next().is_some_and(|f| allowed.contains(&f))).collect();
        assert!(outside.is_empty(), "{m} imports {outside:?}");
    }
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    for dir in ["proxy-agent", "xtask"] {
        let g = graph(&src(dir));
        assert!(g.len() > 5, "{dir}: modules not found");
        if let Some(cycle) = find_cycle(&g) {
            panic!("{dir}: import cycle {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_checker_sees_cycles_and_grouped_imports() {
    let known: BTreeSet<String> = ["a", "a::b", "a::c", "d"].iter().map(ToString::to_string).collect();
    let refs = references("a::b", "use crate::a::{c, X};\nuse super::c::Y;\nfn f() { crate::d::g(); }", &known);
    assert_eq!(refs, ["a", "a::c", "d"].iter().map(ToString::to_string).collect());
    let g: BTreeMap<String, BTreeSet<String>> = [("x", vec!["y"]), ("y", vec!["z"]), ("z", vec!["x"])]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(ToString::to_string).collect()))
        .collect();
    assert_eq!(find_cycle(&g).map(|c| c.len()), Some(4));
}
