//! libtest's `test result:` lines, summed over test binaries. Both the
//! host run (`cargo xtask test`) and the guests' consoles (`vmtest`) print
//! them; each counts them here and reports one total.

#[derive(Default, Debug, PartialEq, Eq)]
pub(crate) struct Totals {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    pub binaries: u64,
}

impl Totals {
    /// Adds a libtest line such as
    /// `test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s`.
    pub(crate) fn add(&mut self, line: &str) {
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

    /// Prints the total as the run's last, plain line, after an empty one:
    /// a workspace run ends with the (empty) doc-test result of its last
    /// crate, so libtest's own last line is no total.
    pub(crate) fn print_summary(&self) {
        println!();
        println!("summary: {} passed, {} failed, {} skipped", self.passed, self.failed, self.ignored);
    }
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
