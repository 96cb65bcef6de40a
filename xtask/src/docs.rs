//! `cargo xtask docs`: the book in `docs/` (mdBook), built and checked.
//!
//! `cargo xtask docs` first rewrites the pages generated from the agent
//! (the command line's usage, outputs marked `<!-- checked-output -->`) by
//! running `proxy-agent/tests/docs.rs` with `TOPOPROXY_DOCS_BLESS=1`, then
//! builds the book into `target/book/` and checks it. `--check` (the docs
//! step of `cargo xtask test`) builds and checks, and writes nothing into
//! `docs/`. `--dashboard` first redraws the guide's picture of the chart's
//! Grafana dashboard from a run of the demo's nodes (see
//! [`draw_dashboard`]).
//!
//! The checks here need no build of the project: mdBook must build without
//! an error or a warning; every relative link and `#anchor` of the book and
//! of the README resolves (anchors against the heading ids of the built
//! HTML, so exactly as mdBook renders them); every page is in `SUMMARY.md`;
//! every fenced block names its language (so `mdbook test` would compile
//! none: the book shows commands, not Rust); every `cargo xtask X` shown
//! names an xtask command, and every `proxy-agent X --flag` a subcommand
//! and a flag of the generated usage pages; the maps page lists exactly
//! the maps of `proxy-common` and of the eBPF programs; the Helm values
//! page documents every top-level key of the chart's schema and no key it
//! does not have. What needs the agent itself (usage equal to `--help`, the
//! metrics page against the registry, checked outputs) is
//! `proxy-agent/tests/docs.rs`, in the cargo test step.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::CommandFactory;

use crate::{setup, util};

/// The book's sources, from the workspace root.
const SRC: &str = "docs/src";
/// The generated usage of each subcommand, from [`SRC`].
const CLI_HELP: &str = "reference/cli/help";
const MAPS_PAGE: &str = "reference/maps.md";
const HELM_PAGE: &str = "reference/helm-values.md";
const HELM_SCHEMA: &str = "charts/topoproxy/values.schema.json";
/// What makes the agent's docs test write instead of compare.
const BLESS_ENV: &str = "TOPOPROXY_DOCS_BLESS";

/// The dashboard's picture in the book, from [`SRC`].
const DASHBOARD_PNG: &str = "images/dashboard.png";

/// `cargo xtask docs [--check | --dashboard]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let (check_only, dashboard) = match args {
        [] => (false, false),
        [a] if a == "--check" => (true, false),
        [a] if a == "--dashboard" => (false, true),
        _ => bail!("usage: cargo xtask docs [--check | --dashboard]"),
    };
    setup::ensure()?;
    if dashboard {
        draw_dashboard()?;
    }
    if !check_only {
        generate()?;
    }
    check()?;
    println!("book: {}", book_dir().join("index.html").display());
    Ok(())
}

/// Rewrites the pages generated from the agent: the docs test in bless mode.
fn generate() -> Result<()> {
    let mut c = util::cargo();
    c.args(["test", "-p", "proxy-agent", "--test", "docs"]).env(BLESS_ENV, "1");
    println!("generating: {}", util::describe(&c));
    util::run(&mut c)
}

/// The guide's picture of the Grafana dashboard, drawn from real counts:
/// `proxy-agent/tests/service_connections.rs` runs the demo's three nodes,
/// makes connections from each, scrapes their /metrics and draws the
/// dashboard's panels from the scrapes with `docs/scripts/render_dashboard.py`
/// (a step of that test in every `cargo xtask test`); this copies its
/// picture into the book. Needs root, as the test does.
fn draw_dashboard() -> Result<()> {
    if !util::is_root() {
        bail!("--dashboard runs the demo's nodes (eBPF programs, cgroups, namespaces): run it as root");
    }
    let mut c = util::cargo();
    c.args(["test", "-p", "proxy-agent", "--test", "service_connections", "each_services_tier_counts"]);
    println!("drawing the dashboard from real counts: {}", util::describe(&c));
    util::run(&mut c)?;
    let drawn = util::target_dir().join("tmp/dashboard/dashboard.png");
    let dest = util::workspace_root().join(SRC).join(DASHBOARD_PNG);
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::copy(&drawn, &dest).with_context(|| format!("copying {} to {}", drawn.display(), dest.display()))?;
    println!("wrote {}", dest.display());
    Ok(())
}

fn book_dir() -> PathBuf {
    util::target_dir().join("book")
}

/// Builds the book and runs every check of this file; the docs step of
/// `cargo xtask test`. Fails naming every problem found.
pub(crate) fn check() -> Result<()> {
    let root = util::workspace_root();
    let book = book_dir();
    let mut c = util::cmd(setup::mdbook_bin());
    c.arg("build").arg(root.join("docs")).arg("--dest-dir").arg(&book);
    let out = c.output().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let mut problems: Vec<String> = Vec::new();
    if !out.status.success() {
        problems.push(format!("{} failed ({}):\n{log}", util::describe(&c), out.status));
    }
    // mdBook logs a missing {{#include}} file as an error and still exits 0.
    let alarming =
        |l: &&str| matches!(l.split_whitespace().next(), Some("ERROR" | "WARN")) || l.contains(" ERROR ") || l.contains(" WARN ");
    problems.extend(log.lines().filter(alarming).map(|l| format!("mdbook: {}", l.trim())));
    problems.extend(source_problems(&root, Some(&book))?);
    if !problems.is_empty() {
        bail!("the book has {} problem(s):\n  {}", problems.len(), problems.join("\n  "));
    }
    println!("ok: the book builds and its links, commands, maps and Helm values check out");
    Ok(())
}

/// Every check that reads only the sources (and, when `html` is given, the
/// built book for the anchors).
fn source_problems(root: &Path, html: Option<&Path>) -> Result<Vec<String>> {
    let src = root.join(SRC);
    let pages = markdown_files(&src)?;
    let mut problems = Vec::new();
    let summary = read(&src.join("SUMMARY.md"))?;
    problems.extend(summary_problems(&summary, &pages));
    let help = cli_help(&src.join(CLI_HELP))?;
    let xtask_commands: BTreeSet<String> = crate::Cli::command().get_subcommands().map(|c| c.get_name().to_string()).collect();
    let mut documents: Vec<(String, String)> = Vec::new();
    for page in &pages {
        documents.push((format!("{SRC}/{page}"), read(&src.join(page))?));
    }
    documents.push(("README.md".to_string(), read(&root.join("README.md"))?));
    for (name, text) in &documents {
        problems.extend(block_problems(text).into_iter().map(|p| format!("{name}: {p}")));
        problems.extend(command_problems(text, &xtask_commands, &help).into_iter().map(|p| format!("{name}: {p}")));
        problems.extend(link_problems(root, Path::new(name), text, html).into_iter().map(|p| format!("{name}: {p}")));
    }
    let maps = source_maps(root)?;
    problems.extend(maps_problems(&read(&src.join(MAPS_PAGE))?, &maps).into_iter().map(|p| format!("{SRC}/{MAPS_PAGE}: {p}")));
    let schema: serde_json::Value =
        serde_json::from_str(&read(&root.join(HELM_SCHEMA))?).with_context(|| format!("{HELM_SCHEMA} is not JSON"))?;
    problems.extend(helm_problems(&read(&src.join(HELM_PAGE))?, &schema).into_iter().map(|p| format!("{SRC}/{HELM_PAGE}: {p}")));
    Ok(problems)
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The `.md` files under `dir`, as paths relative to it with `/`, sorted.
fn markdown_files(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                let rel = path.strip_prefix(dir).unwrap_or(&path);
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Each subcommand's generated usage (`help/<sub>.txt`), by subcommand.
fn cli_help(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if let (Some(stem), Some("txt")) = (path.file_stem(), path.extension().and_then(|e| e.to_str())) {
            out.insert(stem.to_string_lossy().into_owned(), read(&path)?);
        }
    }
    Ok(out)
}

/// Pages missing from `SUMMARY.md` (mdBook would not render them, so links
/// to them break in the HTML).
fn summary_problems(summary: &str, pages: &[String]) -> Vec<String> {
    let listed: BTreeSet<String> = markdown_links(summary).into_iter().map(|(target, _)| target).collect();
    pages.iter().filter(|p| *p != "SUMMARY.md" && !listed.contains(*p)).map(|p| format!("{SRC}/{p} is not in SUMMARY.md")).collect()
}

/// A document split into its fenced code blocks (info string, body) and
/// the text outside them.
struct Parsed {
    blocks: Vec<(String, String)>,
    prose: String,
}

fn parse(text: &str) -> Parsed {
    let mut blocks = Vec::new();
    let mut prose = String::new();
    let mut open: Option<(String, String, String)> = None; // fence, info, body
    for line in text.lines() {
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                if let Some(rest) = trimmed.strip_prefix("```") {
                    let fence = "```".to_string() + &rest.chars().take_while(|c| *c == '`').collect::<String>();
                    open = Some((fence.clone(), trimmed[fence.len()..].trim().to_string(), String::new()));
                    // Blank lines for the block keep the prose's line numbers
                    // the document's.
                    prose.push('\n');
                } else {
                    prose.push_str(line);
                    prose.push('\n');
                }
            }
            Some((fence, info, body)) => {
                if trimmed.starts_with(fence.as_str()) && trimmed.trim_end().chars().all(|c| c == '`') {
                    blocks.push((std::mem::take(info), std::mem::take(body)));
                    open = None;
                    prose.push('\n');
                } else {
                    body.push_str(line);
                    body.push('\n');
                    prose.push('\n');
                }
            }
        }
    }
    if let Some((_, info, body)) = open {
        blocks.push((info, body));
    }
    Parsed { blocks, prose }
}

/// The inline code spans of prose (single backticks; a span may cross a
/// line break, which becomes a space).
fn inline_code(prose: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = prose;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
        let after = &rest[start + ticks..];
        let closing = "`".repeat(ticks);
        let Some(end) = after.find(&closing) else { break };
        out.push(after[..end].replace('\n', " ").trim().to_string());
        rest = &after[end + ticks..];
    }
    out
}

/// Fenced blocks without a language: `mdbook test` would compile them as
/// Rust. Rust blocks must say they do not run.
fn block_problems(text: &str) -> Vec<String> {
    parse(text)
        .blocks
        .iter()
        .filter_map(|(info, body)| {
            let first = body.lines().next().unwrap_or("").trim();
            if info.is_empty() {
                Some(format!("a fenced block has no language (```text, ```sh, ...): it starts {first:?}"))
            } else if info.starts_with("rust") && !info.contains("ignore") && !info.contains("no_run") {
                Some(format!("a ```{info} block would run under mdbook test: mark it ignore or no_run ({first:?})"))
            } else {
                None
            }
        })
        .collect()
}

/// The shell commands a document shows: the lines of its `sh`/`bash`/
/// `console` blocks (continuations joined) and its inline code spans.
fn shown_commands(text: &str) -> Vec<String> {
    let parsed = parse(text);
    let mut out = Vec::new();
    for (info, body) in &parsed.blocks {
        let lang = info.split([',', ' ']).next().unwrap_or("");
        if !matches!(lang, "sh" | "bash" | "shell" | "console") {
            continue;
        }
        let mut line = String::new();
        for l in body.lines() {
            if let Some(head) = l.trim_end().strip_suffix('\\') {
                line.push_str(head);
                line.push(' ');
            } else {
                line.push_str(l);
                out.push(std::mem::take(&mut line));
            }
        }
    }
    out.extend(inline_code(&parsed.prose));
    out
}

/// Whether `c` can stand right before a program name in a command line.
fn starts_word(before: Option<char>) -> bool {
    before.is_none_or(|c| c.is_whitespace() || matches!(c, '(' | '`' | '$' | ';' | '|' | '&'))
}

/// `cargo xtask X` that names no xtask command; `proxy-agent X` that names
/// no subcommand of the generated usage pages, and its `--flags` that the
/// subcommand does not have.
fn command_problems(text: &str, xtask: &BTreeSet<String>, help: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    for command in shown_commands(text) {
        // A comment ends what the shell runs.
        let command = command.split(" #").next().unwrap_or("");
        for (i, _) in command.match_indices("cargo xtask ") {
            if !starts_word(command[..i].chars().next_back()) {
                continue;
            }
            let word: String = command[i + "cargo xtask ".len()..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            if !word.is_empty() && !xtask.contains(&word) {
                problems.push(format!("`cargo xtask {word}` is no xtask command (in `{}`)", command.trim()));
            }
        }
        for (i, _) in command.match_indices("proxy-agent ") {
            if !starts_word(command[..i].chars().next_back()) {
                continue;
            }
            let rest = &command[i + "proxy-agent ".len()..];
            let mut words = rest.split_whitespace();
            let Some(sub) = words.next() else { continue };
            if sub.starts_with('-') || !sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                continue;
            }
            let Some(usage) = help.get(sub) else {
                problems
                    .push(format!("`proxy-agent {sub}` is no subcommand with a usage page in {SRC}/{CLI_HELP} (in `{}`)", command.trim()));
                continue;
            };
            for word in words {
                if matches!(word, "|" | "||" | "&&" | ";" | ">" | ">>") || word.starts_with('#') {
                    break;
                }
                let word = word.trim_matches(|c| matches!(c, '[' | ']' | '(' | ')' | '`' | ','));
                let Some(flag) = word.strip_prefix("--") else { continue };
                let flag = flag.split('=').next().unwrap_or("");
                if flag.is_empty() || flag == "help" {
                    continue;
                }
                let has = usage
                    .match_indices(&format!("--{flag}"))
                    .any(|(j, m)| usage[j + m.len()..].chars().next().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '-')));
                if !has {
                    problems.push(format!("`proxy-agent {sub}` has no flag --{flag} (in `{}`)", command.trim()));
                }
            }
        }
    }
    problems
}

/// The inline links `[text](target)` of prose (outside code), with the
/// line each is on.
fn markdown_links(text: &str) -> Vec<(String, usize)> {
    let parsed = parse(text);
    // Code spans are not links: blank them out first.
    let mut prose = String::with_capacity(parsed.prose.len());
    let mut in_code = false;
    for c in parsed.prose.chars() {
        if c == '`' {
            in_code = !in_code;
        }
        prose.push(if in_code && c != '\n' { ' ' } else { c });
    }
    let mut out = Vec::new();
    for (n, line) in prose.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("").to_string();
            out.push((target, n + 1));
            rest = &after[end + 1..];
        }
    }
    out
}

/// Relative links whose file does not exist, or whose `#anchor` is no
/// heading id of the target: for a page of the book, an `id` of its built
/// HTML (when `html`, the built book, is given); for other Markdown
/// (the README), GitHub's heading slugs.
fn link_problems(root: &Path, doc: &Path, text: &str, html: Option<&Path>) -> Vec<String> {
    let src = root.join(SRC);
    let here = root.join(doc).parent().map_or_else(|| root.to_path_buf(), Path::to_path_buf);
    let mut problems = Vec::new();
    for (target, line) in markdown_links(text) {
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let file = if path.is_empty() { root.join(doc) } else { normalize(&here.join(path)) };
        if !file.exists() {
            problems.push(format!("line {line}: link to {target}: {} does not exist", file.display()));
            continue;
        }
        let in_book = file.starts_with(&src);
        if root.join(doc).starts_with(&src) && !in_book {
            problems.push(format!("line {line}: link to {target} leaves {SRC}: the built book would not have it"));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if in_book && file.extension().is_some_and(|e| e == "md") {
            let Some(html) = html else { continue };
            let rel = file.strip_prefix(&src).unwrap_or(&file).with_extension("html");
            let page = std::fs::read_to_string(html.join(&rel)).unwrap_or_default();
            if !page.contains(&format!("id=\"{anchor}\"")) {
                problems.push(format!("line {line}: link to {target}: {} has no heading with id {anchor:?}", rel.display()));
            }
        } else if file.extension().is_some_and(|e| e == "md") {
            let headings = std::fs::read_to_string(&file).map(|t| github_slugs(&t)).unwrap_or_default();
            if !headings.contains(anchor) {
                problems.push(format!("line {line}: link to {target}: {} has no heading {anchor:?}", file.display()));
            }
        }
    }
    problems
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The anchors GitHub gives a Markdown file's headings: lower case,
/// punctuation other than `-` and `_` dropped, spaces as `-`; repeats get
/// `-1`, `-2`, ...
fn github_slugs(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in parse(text).prose.lines() {
        let Some(title) = line.strip_prefix('#').map(|t| t.trim_start_matches('#')) else { continue };
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .chars()
            .filter_map(|c| match c {
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
                ' ' => Some('-'),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 { slug.clone() } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// Every map name the code defines: `proxy-common`'s `*_MAP` constants and
/// the eBPF programs' `#[map(name = ...)]` / `#[btf_map(name = ...)]`.
fn source_maps(root: &Path) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for (dir, find) in [("proxy-common/src", map_constants as fn(&str) -> Vec<String>), ("proxy-ebpf/src", map_attributes)] {
        let dir = root.join(dir);
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
                let path = entry?.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    out.extend(find(&read(&path)?));
                }
            }
        }
    }
    if out.is_empty() {
        bail!("found no map in proxy-common or proxy-ebpf: has the way maps are declared changed?");
    }
    Ok(out)
}

/// `pub const SERVICES_MAP: &str = "SERVICES";` gives `SERVICES`.
fn map_constants(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("pub const ")?;
            let (name, value) = rest.split_once(':')?;
            if !name.trim().ends_with("_MAP") {
                return None;
            }
            quoted(value.split_once('=')?.1)
        })
        .collect()
}

/// `#[map(name = "NP_CT")]` and `#[btf_map(name = "SERVICES")]` give their
/// names.
fn map_attributes(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("#[map(").or_else(|| l.strip_prefix("#[btf_map("))?;
            quoted(rest.trim_start().strip_prefix("name")?.trim_start().strip_prefix('=')?)
        })
        .collect()
}

/// The first `"..."` of `s`.
fn quoted(s: &str) -> Option<String> {
    let start = s.find('"')? + 1;
    let end = s[start..].find('"')? + start;
    Some(s[start..end].to_string())
}

/// The backticked names in the first cell of each table row of `page`.
fn first_cells(page: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in parse(page).prose.lines() {
        let Some(row) = line.trim().strip_prefix('|') else { continue };
        let cell = row.split('|').next().unwrap_or("");
        out.extend(inline_code(cell));
    }
    out
}

fn maps_problems(page: &str, maps: &BTreeSet<String>) -> Vec<String> {
    let listed: BTreeSet<String> =
        first_cells(page).into_iter().filter(|n| n.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).collect();
    let mut problems: Vec<String> = maps.difference(&listed).map(|m| format!("map {m} is in the code but has no row here")).collect();
    problems.extend(listed.difference(maps).map(|m| format!("map {m} has a row here but is not in proxy-common or proxy-ebpf")));
    problems
}

fn helm_problems(page: &str, schema: &serde_json::Value) -> Vec<String> {
    let keys: Vec<String> = first_cells(page);
    let mut problems = Vec::new();
    for key in &keys {
        let mut node = schema;
        for part in key.split('.') {
            if let Some(n) = node.get("properties").and_then(|p| p.get(part)) {
                node = n;
            } else {
                problems.push(format!("value {key} is not in {HELM_SCHEMA}"));
                break;
            }
        }
    }
    if let Some(top) = schema.get("properties").and_then(|p| p.as_object()) {
        for name in top.keys() {
            if !keys.iter().any(|k| k == name || k.starts_with(&format!("{name}."))) {
                problems.push(format!("value {name} is in {HELM_SCHEMA} but not documented here"));
            }
        }
    } else {
        problems.push(format!("{HELM_SCHEMA} has no top-level properties"));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_book_passes_the_checks_that_need_no_build() {
        // Anchors into the book need its HTML (the docs step builds it);
        // everything else is checked here, so `cargo test -p xtask`
        // catches a broken page.
        let problems = source_problems(&util::workspace_root(), None).expect("the book's sources can be read");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn blocks_without_a_language_are_found() {
        let text = "x\n```\nproxy-agent run\n```\n```sh\nls\n```\n````text\n```\n````\n```rust\nfn main() {}\n```\n";
        let problems = block_problems(text);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("no language") && problems[1].contains("mdbook test"), "{problems:?}");
    }

    #[test]
    fn commands_are_checked_against_xtask_and_the_usage_pages() {
        let xtask: BTreeSet<String> = ["test", "demo"].iter().map(ToString::to_string).collect();
        let help: BTreeMap<String, String> =
            [("dump".to_string(), "      --bpffs <BPFFS>\n      --output <OUTPUT>\n".to_string())].into_iter().collect();
        let text = "Run `cargo xtask test` or `cargo xtask tset`.\n\n```sh\nkubectl exec POD -- proxy-agent dump \\\n  --bpffs /x --bogus # --also-not\n\
                    proxy-agent frob\n```\n\nSee `proxy-agent/tests/x.rs` and `proxy-agent dump --output=json`.\n";
        let problems = command_problems(text, &xtask, &help);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("cargo xtask tset")), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("no flag --bogus")), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("`proxy-agent frob`")), "{problems:?}");
    }

    #[test]
    fn links_in_code_are_not_links() {
        let text = "[a](x.md#y) `[b](z.md)`\n```text\n[c](w.md)\n```\n[d](https://e) [f](#g)\n";
        let links: Vec<String> = markdown_links(text).into_iter().map(|(t, _)| t).collect();
        assert_eq!(links, ["x.md#y", "https://e", "#g"]);
    }

    #[test]
    fn github_slugs_follow_githubs_rules() {
        let slugs = github_slugs("# A `b` (c, d)\n## Dup\n## Dup\n```sh\n# not a heading\n```\n");
        let want: BTreeSet<String> = ["a-b-c-d", "dup", "dup-1"].iter().map(ToString::to_string).collect();
        assert_eq!(slugs, want);
    }

    #[test]
    fn maps_are_read_from_constants_and_attributes() {
        assert_eq!(map_constants("pub const SERVICES_MAP: &str = \"SERVICES\";\npub const X: &str = \"Y\";"), ["SERVICES"]);
        assert_eq!(map_attributes("#[map(name = \"NP_CT\")]\n    #[btf_map(name = \"SLOTS\")]\n#[map]"), ["NP_CT", "SLOTS"]);
        let maps: BTreeSet<String> = ["NP_CT", "SLOTS"].iter().map(ToString::to_string).collect();
        let page = "| map | type |\n| --- | --- |\n| `NP_CT` | lru |\n| `GONE` | hash |\n";
        let problems = maps_problems(page, &maps);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("SLOTS") && problems[1].contains("GONE"), "{problems:?}");
    }

    #[test]
    fn helm_values_are_checked_both_ways() {
        let schema = serde_json::json!({"properties": {"a": {"properties": {"b": {}}}, "c": {}, "d": {}}});
        let page = "| value | meaning |\n| --- | --- |\n| `a.b`, `a.x` | . |\n| `c` | . |\n";
        let problems = helm_problems(page, &schema);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("a.x") && problems[1].contains("value d"), "{problems:?}");
    }
}
