//! Moving a node from kube-proxy to this agent: recognising what kube-proxy
//! leaves behind on a node and planning its removal, the set `kube-proxy
//! --cleanup` removes (pkg/proxy/iptables/cleanup.go, nftables/proxier.go
//! and ipvs/proxier.go `CleanupLeftovers`).
//!
//! Pure: each module reads the text a tool prints (`iptables-save`, `nft
//! -j list tables`, `ipvsadm-save`, `ip -j addr`, `ipset list -n`) and
//! returns what is kube-proxy's, what is left alone and why, and the input
//! for the tool that removes it. `proxy-agent cleanup-kube-proxy`
//! (`src/cmd/cleanup_kube_proxy.rs`) runs the tools, as kube-proxy itself
//! does. Whatever a module does not recognise as kube-proxy's is never
//! removed.
//!
//! - [`iptables`]: the `KUBE-*` chains of the nat, filter and mangle tables
//!   and the jumps to them from the built-in chains, for either iptables
//!   backend (legacy or nf_tables) and family;
//! - [`nftables`]: the `ip kube-proxy` and `ip6 kube-proxy` tables;
//! - [`ipvs`]: IPVS virtual servers, the `kube-ipvs0` dummy device and the
//!   `KUBE-*` ipsets of IPVS mode.

pub mod iptables;
pub mod ipvs;
pub mod nftables;

/// Output of a tool that could not be understood; cleanup skips that part
/// and says so.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {reason}: {text:?}")]
pub struct ParseError {
    /// 1-based line of the tool's output (0: the output as a whole).
    pub line: usize,
    /// What is wrong with the line.
    pub reason: String,
    /// The line as the tool printed it.
    pub text: String,
}

impl ParseError {
    pub(crate) fn new(line: usize, reason: impl Into<String>, text: impl Into<String>) -> ParseError {
        ParseError { line, reason: reason.into(), text: text.into() }
    }
}
