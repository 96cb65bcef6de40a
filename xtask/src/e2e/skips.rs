//! The skip list of `cargo xtask e2e`: `tools/k8s-node/e2e-skips.txt`,
//! one skipped test a line, `PATTERN :: REASON`, where PATTERN is a Go
//! regular expression matched against the test's full name (what
//! `--ginkgo.skip` takes) and REASON says why it cannot run here. `#`
//! starts a comment line.

use anyhow::{Result, bail};

/// One line of the list.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Skip {
    pub(crate) pattern: String,
    pub(crate) reason: String,
}

/// Reads the list; a line without a reason is an error.
pub(crate) fn parse(text: &str) -> Result<Vec<Skip>> {
    let mut skips = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((pattern, reason)) = line.split_once(" :: ") else {
            bail!("e2e-skips.txt line {}: `PATTERN :: REASON` expected, got {line:?}", n + 1);
        };
        let (pattern, reason) = (pattern.trim(), reason.trim());
        if pattern.is_empty() || reason.is_empty() {
            bail!("e2e-skips.txt line {}: both a pattern and a reason are needed: {line:?}", n + 1);
        }
        skips.push(Skip { pattern: pattern.to_string(), reason: reason.to_string() });
    }
    Ok(skips)
}

/// The `--ginkgo.skip` expression: every pattern, as alternatives.
pub(crate) fn ginkgo_skip(skips: &[Skip]) -> String {
    skips.iter().map(|s| format!("({})", s.pattern)).collect::<Vec<_>>().join("|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_need_a_reason_and_become_one_expression() {
        let skips = parse("# comment\n\n\\[Disruptive\\] :: restarts things\nLoadBalancer :: no cloud\n").unwrap();
        assert_eq!(skips.len(), 2);
        assert_eq!(skips[1], Skip { pattern: "LoadBalancer".into(), reason: "no cloud".into() });
        assert_eq!(ginkgo_skip(&skips), "(\\[Disruptive\\])|(LoadBalancer)");
        assert!(parse("LoadBalancer\n").is_err());
        assert!(parse("LoadBalancer :: \n").is_err());
    }

    #[test]
    fn the_repository_list_parses() {
        let text = std::fs::read_to_string(crate::util::workspace_root().join("tools/k8s-node/e2e-skips.txt")).unwrap();
        assert!(!parse(&text).unwrap().is_empty());
    }
}
