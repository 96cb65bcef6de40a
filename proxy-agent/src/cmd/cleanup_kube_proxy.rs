//! `proxy-agent cleanup-kube-proxy`: removes what kube-proxy leaves on a
//! node once its DaemonSet is gone, the set `kube-proxy --cleanup` removes,
//! and prints each thing it removed (or, with `--dry-run`, would remove) and
//! each `KUBE-*` thing it leaves alone, with the reason.
//!
//! It shells out to the same tools kube-proxy uses (`iptables-save` and
//! `iptables-restore` of both backends and families, `nft`, `ipset`,
//! `ipvsadm`, `ip`); a tool that is not installed skips its part with a
//! note, since nothing can have been made with it on this node. With
//! `--host-root DIR` the tools are the node's own, mounted at DIR: each runs
//! chrooted there (the agent's image has none of them, and the node's match
//! the kernel and the iptables backend kube-proxy used). What is
//! kube-proxy's is decided by `proxy_agent::migrate` from the tools'
//! output; nothing else is touched. Running it again finds nothing more to
//! do.
//!
//! Exit status: 0 when every part ran (including "nothing to remove"), 1
//! when a tool failed or printed something that could not be understood;
//! the other parts still run.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::Write as _;
use std::ops::RangeInclusive;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use clap::Args;
use proxy_agent::migrate::{self, ipvs};

#[derive(Args)]
pub(crate) struct CleanupArgs {
    /// Print what would be removed and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// The cluster's NodePort range (kube-apiserver's
    /// --service-node-port-range): IPVS virtual servers on the node's own
    /// addresses with a port in it are kube-proxy's NodePorts.
    #[arg(long, default_value = "30000-32767", value_parser = parse_range)]
    node_port_range: RangeInclusive<u16>,
    /// Run the node's own tools, from its root filesystem mounted at this
    /// directory (each tool runs chrooted there), e.g. /host in a pod.
    #[arg(long)]
    host_root: Option<PathBuf>,
}

fn parse_range(s: &str) -> Result<RangeInclusive<u16>, String> {
    let (a, b) = s.split_once('-').ok_or("expected MIN-MAX")?;
    let (a, b): (u16, u16) = (a.trim().parse().map_err(|e| format!("{a}: {e}"))?, b.trim().parse().map_err(|e| format!("{b}: {e}"))?);
    if a > b {
        return Err(format!("{a} is above {b}"));
    }
    Ok(a..=b)
}

/// The iptables binaries per backend and family, as Debian, Ubuntu and
/// RHEL ship them (xtables-legacy-multi / xtables-nft-multi).
const IPTABLES: [(&str, &str, &str); 4] = [
    ("iptables-legacy", "iptables-legacy-save", "iptables-legacy-restore"),
    ("ip6tables-legacy", "ip6tables-legacy-save", "ip6tables-legacy-restore"),
    ("iptables-nft", "iptables-nft-save", "iptables-nft-restore"),
    ("ip6tables-nft", "ip6tables-nft-save", "ip6tables-nft-restore"),
];

/// iptables from before the two backends had names of their own (< 1.8):
/// used only when neither named binary of the family exists.
const IPTABLES_UNNAMED: [(&str, &str, &str, &str); 2] =
    [("iptables", "iptables-save", "iptables-restore", "iptables-"), ("ip6tables", "ip6tables-save", "ip6tables-restore", "ip6tables-")];

pub(crate) fn cleanup(args: CleanupArgs) -> anyhow::Result<ExitCode> {
    let t = Tools::new(args.host_root.as_deref())?;
    let mut r = Report::new(args.dry_run);
    let mut sets_in_use = BTreeSet::new();
    for (label, save, restore) in IPTABLES {
        iptables(&t, &mut r, label, save, restore, &mut sets_in_use);
    }
    for (label, save, restore, prefix) in IPTABLES_UNNAMED {
        let named = IPTABLES.iter().any(|(l, s, _)| l.starts_with(prefix) && t.find(s).is_some());
        if !named && t.find(save).is_some() {
            iptables(&t, &mut r, label, save, restore, &mut sets_in_use);
        }
    }
    nftables(&t, &mut r);
    let addrs = addresses(&t, &mut r);
    ipvs_servers(&t, &mut r, addrs.as_deref(), &args.node_port_range);
    ipsets(&t, &mut r, &sets_in_use);
    dummy_device(&t, &mut r, addrs.as_deref());
    r.summary();
    Ok(if r.errors == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// What was (or would be) done, printed as it happens.
struct Report {
    dry_run: bool,
    removed: usize,
    kept: usize,
    errors: usize,
}

impl Report {
    fn new(dry_run: bool) -> Report {
        Report { dry_run, removed: 0, kept: 0, errors: 0 }
    }

    fn removed(&mut self, scope: &str, what: &str) {
        self.removed += 1;
        say(scope, &format!("{} {what}", if self.dry_run { "would remove" } else { "removed" }));
    }

    fn kept(&mut self, scope: &str, what: &str, why: &str) {
        self.kept += 1;
        say(scope, &format!("left alone {what}: {why}"));
    }

    fn error(&mut self, scope: &str, text: &str) {
        self.errors += 1;
        tracing::error!(part = scope, "{text}");
        say(scope, &format!("error: {text}"));
    }

    fn summary(&self) {
        let text = if self.dry_run {
            format!("dry run, nothing changed: would remove {}, left alone {}, errors {}", self.removed, self.kept, self.errors)
        } else {
            format!("removed {}, left alone {}, errors {}", self.removed, self.kept, self.errors)
        };
        say("summary", &text);
    }
}

/// One line of the report.
fn say(scope: &str, text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{scope}: {text}");
}

/// Where the tools come from: this system's PATH, or a node's root
/// filesystem mounted somewhere.
struct Tools {
    /// The root the tools run in (`chroot`), as a C string for the child.
    root: Option<(PathBuf, CString)>,
}

/// PATH inside a node's root filesystem: where distributions install the
/// tools.
const HOST_PATH: [&str; 6] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

impl Tools {
    fn new(root: Option<&Path>) -> anyhow::Result<Tools> {
        let root = match root {
            None => None,
            Some(r) => {
                anyhow::ensure!(r.is_dir(), "--host-root {}: not a directory", r.display());
                Some((r.to_path_buf(), CString::new(r.as_os_str().as_bytes())?))
            }
        };
        Ok(Tools { root })
    }

    /// `name` as the tool runs it: found in PATH, or in the host root's
    /// usual directories (the path is then the one inside that root).
    fn find(&self, name: &str) -> Option<PathBuf> {
        match &self.root {
            None => {
                let path = std::env::var_os("PATH")?;
                std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
            }
            Some((root, _)) => {
                HOST_PATH.iter().map(|d| Path::new(d).join(name)).find(|p| root.join(p.strip_prefix("/").unwrap_or(p)).is_file())
            }
        }
    }
}

/// Runs `tool ARGS` with `input` on stdin; its stdout, or what went wrong
/// (exit status and stderr).
fn run(t: &Tools, tool: &Path, args: &[&str], input: Option<&str>) -> Result<String, String> {
    let mut cmd = Command::new(tool);
    cmd.args(args).stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some((_, root)) = &t.root {
        let root = root.clone();
        // SAFETY: between fork and exec the closure makes two system calls
        // (chroot, chdir) on memory prepared before the fork: nothing that
        // allocates or takes a lock.
        unsafe {
            cmd.pre_exec(move || {
                if libc::chroot(root.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // The tool's own environment, not the agent image's.
        cmd.env("PATH", HOST_PATH.join(":"));
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        // The tool reads everything before it exits; a write error shows up
        // as its exit status.
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| format!("{}: {e}", tool.display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(format!("`{} {}` failed ({}): {}", tool.display(), args.join(" "), out.status, stderr.trim()))
    }
}

fn iptables(t: &Tools, r: &mut Report, label: &str, save: &str, restore: &str, sets_in_use: &mut BTreeSet<String>) {
    let Some(save_bin) = t.find(save) else {
        say(label, &format!("not installed (no {save} in PATH), nothing to look at"));
        return;
    };
    let dump = match run(t, &save_bin, &[], None) {
        Ok(d) => d,
        Err(e) => return r.error(label, &e),
    };
    let tables = match migrate::iptables::parse_save(&dump) {
        Ok(t) => t,
        Err(e) => return r.error(label, &format!("cannot read the output of {save}: {e}")),
    };
    let plan = migrate::iptables::plan(&tables);
    sets_in_use.extend(plan.sets_in_use.iter().cloned());
    if plan.is_empty() && plan.tables.iter().all(|t| t.kept.is_empty()) {
        say(label, "nothing of kube-proxy's");
        return;
    }
    let restore_bin = t.find(restore);
    for plan_t in &plan.tables {
        let scope = format!("{label} {}", plan_t.table);
        for (chain, why) in &plan_t.kept {
            r.kept(&scope, &format!("chain {chain}"), why);
        }
        if plan_t.is_empty() {
            continue;
        }
        if !r.dry_run {
            let Some(bin) = &restore_bin else {
                r.error(&scope, &format!("{restore} is not installed, so kube-proxy's rules cannot be removed"));
                continue;
            };
            // --noflush: change only what the script names; -w: wait for
            // the xtables lock other iptables users (kubelet, a CNI) hold.
            if let Err(e) = run(t, bin, &["--noflush", "-w", "5"], Some(&plan_t.restore_script())) {
                r.error(&scope, &e);
                continue;
            }
        }
        for rule in &plan_t.delete_rules {
            r.removed(&scope, &format!("rule {rule}"));
        }
        for (chain, rules) in &plan_t.remove_chains {
            r.removed(&scope, &format!("chain {chain} ({rules} rule{})", if *rules == 1 { "" } else { "s" }));
        }
    }
}

fn nftables(t: &Tools, r: &mut Report) {
    let scope = "nftables";
    let Some(nft) = t.find("nft") else {
        say(scope, "not installed (no nft in PATH), nothing to look at");
        return;
    };
    let listed = match run(t, &nft, &["-j", "list", "tables"], None) {
        Ok(l) => l,
        Err(e) => return r.error(scope, &e),
    };
    let plan = match migrate::nftables::parse_tables(&listed) {
        Ok(t) => migrate::nftables::plan(&t),
        Err(e) => return r.error(scope, &format!("cannot read the output of `nft -j list tables`: {e}")),
    };
    for (t, why) in &plan.kept {
        r.kept(scope, &t.to_string(), why);
    }
    if plan.remove.is_empty() {
        if plan.kept.is_empty() {
            say(scope, "no kube-proxy table");
        }
        return;
    }
    nat_hooks_note(t, &nft, &plan);
    if !r.dry_run
        && let Err(e) = run(t, &nft, &["-f", "-"], Some(&plan.script()))
    {
        return r.error(scope, &e);
    }
    for t in &plan.remove {
        r.removed(scope, &t.to_string());
    }
}

/// Says so when kube-proxy's tables hold the only NAT chains at some hook:
/// the connections kube-proxy translated that are still open lose their
/// translation with them. iptables' nat table keeps its built-in chains
/// (and so the hooks) when kube-proxy's chains go, nftables mode's table
/// does not.
fn nat_hooks_note(t: &Tools, nft: &Path, plan: &migrate::nftables::Plan) {
    let chains = match run(t, nft, &["-j", "list", "chains"], None) {
        Ok(j) => migrate::nftables::parse_nat_chains(&j).unwrap_or_default(),
        Err(_) => return,
    };
    let legacy_nat = |file: &str| std::fs::read_to_string(file).is_ok_and(|t| t.lines().any(|l| l.trim() == "nat"));
    let mut legacy = Vec::new();
    if legacy_nat("/proc/net/ip_tables_names") {
        legacy.push("ip");
    }
    if legacy_nat("/proc/net/ip6_tables_names") {
        legacy.push("ip6");
    }
    let lost = migrate::nftables::nat_hooks_lost(plan, &chains, &legacy);
    if !lost.is_empty() {
        say(
            "nftables",
            &format!(
                "note: kube-proxy's tables hold the only NAT chains at {}: connections kube-proxy translated that are still open lose their translation with them (netfilter applies a connection's NAT only while a NAT chain is hooked in)",
                lost.join(", ")
            ),
        );
    }
}

/// Every address of the node with its device and the device's kind; `None`
/// (with a note) when `ip` is missing or failed.
fn addresses(t: &Tools, r: &mut Report) -> Option<Vec<(String, String, Option<std::net::IpAddr>)>> {
    let Some(ip) = t.find("ip") else {
        say("links", "not installed (no ip in PATH): kube-ipvs0 and IPVS virtual servers not looked at");
        return None;
    };
    match run(t, &ip, &["-d", "-j", "addr", "show"], None).and_then(|j| ipvs::parse_addresses(&j).map_err(|e| e.to_string())) {
        Ok(a) => Some(a),
        Err(e) => {
            r.error("links", &format!("cannot list the node's addresses: {e}"));
            None
        }
    }
}

fn ipvs_servers(t: &Tools, r: &mut Report, addrs: Option<&[(String, String, Option<std::net::IpAddr>)]>, node_ports: &RangeInclusive<u16>) {
    let scope = "IPVS";
    // /proc/net/ip_vs is per network namespace and exists while IPVS is in
    // the kernel (built in or loaded); without it no virtual server exists.
    if !Path::new("/proc/net/ip_vs").exists() {
        say(scope, "not in this kernel (no /proc/net/ip_vs), so no virtual servers to remove");
        return;
    }
    let Some(addrs) = addrs else { return };
    let Some(ipvsadm) = t.find("ipvsadm") else {
        r.error(scope, "IPVS is in the kernel but ipvsadm is not installed, so its virtual servers cannot be checked");
        return;
    };
    let saved = match run(t, &ipvsadm, &["-S", "-n"], None) {
        Ok(s) => s,
        Err(e) => return r.error(scope, &e),
    };
    let servers = match ipvs::parse_ipvsadm_save(&saved) {
        Ok(s) => s,
        Err(e) => return r.error(scope, &format!("cannot read the output of `ipvsadm -S -n`: {e}")),
    };
    let plan = ipvs::plan_virtual_servers(&servers, addrs, node_ports);
    for (v, why) in &plan.kept {
        r.kept(scope, &format!("virtual server {}", v.spec), why);
    }
    if plan.remove.is_empty() {
        if plan.kept.is_empty() {
            say(scope, "no virtual servers");
        }
        return;
    }
    if !r.dry_run
        && let Err(e) = run(t, &ipvsadm, &["-R"], Some(&plan.script()))
    {
        return r.error(scope, &e);
    }
    for v in &plan.remove {
        r.removed(scope, &format!("virtual server {}", v.spec));
    }
}

/// ipsets go after the iptables rules: the kernel refuses to destroy a set a
/// rule still matches on. A set left behind matches nothing by itself, so
/// a node without ipset support (or without the tool) only gets a note.
fn ipsets(t: &Tools, r: &mut Report, in_use: &BTreeSet<String>) {
    let scope = "ipset";
    let Some(ipset) = t.find("ipset") else {
        say(scope, "not installed (no ipset in PATH), nothing to look at");
        return;
    };
    let names: Vec<String> = match run(t, &ipset, &["list", "-n"], None) {
        Ok(l) => l.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect(),
        Err(e) => {
            say(scope, &format!("cannot list sets, skipped: {e}"));
            return;
        }
    };
    let (remove, kept) = ipvs::plan_ipsets(&names, in_use);
    for (n, why) in &kept {
        r.kept(scope, &format!("set {n}"), why);
    }
    if remove.is_empty() && kept.is_empty() {
        say(scope, "no kube-proxy sets");
    }
    for n in &remove {
        if !r.dry_run
            && let Err(e) = run(t, &ipset, &["destroy", n], None)
        {
            r.error(scope, &e);
            continue;
        }
        r.removed(scope, &format!("set {n}"));
    }
}

fn dummy_device(t: &Tools, r: &mut Report, addrs: Option<&[(String, String, Option<std::net::IpAddr>)]>) {
    let scope = ipvs::DUMMY_DEVICE;
    let Some(addrs) = addrs else { return };
    match ipvs::dummy_device(addrs) {
        ipvs::Device::Absent => say(scope, "no such device"),
        ipvs::Device::Keep(why) => r.kept(scope, "the device", &why),
        ipvs::Device::Remove => {
            if !r.dry_run {
                let Some(ip) = t.find("ip") else { return };
                if let Err(e) = run(t, &ip, &["link", "del", "dev", scope], None) {
                    return r.error(scope, &e);
                }
            }
            r.removed(scope, "the dummy device and the service addresses bound to it");
        }
    }
}
