//! `cargo xtask test`: every test of the workspace, the privileged datapath
//! tests included.
//!
//! cargo test's own output is passed through unchanged. Because a workspace
//! run ends with the (empty) doc-test result of its last crate, a total over
//! all test binaries is printed last, as a plain `N passed, N failed` line.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use anyhow::{Context, Result, bail};

use crate::{setup, util};

#[derive(Default, Debug, PartialEq, Eq)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
    binaries: u64,
}

impl Totals {
    /// Adds a libtest line such as
    /// `test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s`.
    fn add(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
        let number_before = |word: &str| -> Option<u64> {
            rest.split(';').find_map(|part| {
                let mut it = part.split_whitespace().rev();
                let (w, n) = (it.next()?, it.next()?);
                (w == word).then(|| n.parse().ok()).flatten()
            })
        };
        self.passed += number_before("passed").unwrap_or(0);
        self.failed += number_before("failed").unwrap_or(0);
        self.ignored += number_before("ignored").unwrap_or(0);
        self.binaries += 1;
    }
}

pub fn run(args: &[String]) -> Result<()> {
    if !util::is_root() {
        bail!(
            "the datapath tests load eBPF programs, attach them to cgroups and create network namespaces, \
             so they need root; run `cargo xtask test` as root"
        );
    }
    setup::ensure()?;
    let mut c = util::cargo();
    c.arg("test");
    // `-p NAME` narrows the run; otherwise the whole workspace is tested.
    let cargo_args: Vec<&String> = args.iter().take_while(|a| *a != "--").collect();
    let selects =
        cargo_args.iter().any(|a| *a == "-p" || a.starts_with("--package") || (a.starts_with("-p") && a.len() > 2));
    if !selects {
        c.arg("--workspace");
    }
    // Run every test binary even when an earlier one fails, so that one run
    // shows every failure.
    if !cargo_args.iter().any(|a| *a == "--no-fail-fast") {
        c.arg("--no-fail-fast");
    }
    c.args(args);
    eprintln!("running: {}", util::describe(&c));
    c.stdout(Stdio::piped());
    let mut child = c.spawn().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    let mut totals = Totals::default();
    let stdout = child.stdout.take().context("no stdout")?;
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        totals.add(&line);
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    let status = child.wait()?;
    if totals.binaries > 0 {
        writeln!(out)?;
        writeln!(out, "summary: {} passed, {} failed, {} skipped", totals.passed, totals.failed, totals.ignored)?;
    }
    if !status.success() {
        bail!("tests failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_libtest_result_lines() {
        let mut t = Totals::default();
        t.add("test result: ok. 19 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.01s");
        t.add("test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.75s");
        t.add("running 4 tests");
        t.add("test sandbox::works ... ok");
        assert_eq!(t, Totals { passed: 22, failed: 1, ignored: 2, binaries: 2 });
    }
}
