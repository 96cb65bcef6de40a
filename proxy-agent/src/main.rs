//! `proxy-agent`: the per-node daemon and its debugging commands.

mod cmd;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(name = "proxy-agent", version, about = "Topology-aware eBPF load balancer for Kubernetes Services")]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `proxy_agent=debug`.
    #[arg(long, env = "LOG_LEVEL", default_value = "info", global = true)]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent: program the socket load balancer and keep it in sync.
    Run(cmd::run::RunArgs),
    /// Remove everything the agent installed (programs, links, maps).
    Reset(cmd::reset::ResetArgs),
    /// Show, for every Service port, which backends this node would use and why.
    Explain(cmd::explain::ExplainArgs),
    /// Connect to an address the way an application would and report what it saw.
    Probe(cmd::probe::ProbeArgs),
    /// Print what the pinned maps hold (frontends, slots, backends, counters) and check their consistency.
    Dump(cmd::dump::DumpArgs),
    /// Remove what kube-proxy left on this node (its iptables chains, nftables tables, IPVS state); `--dry-run` only prints it.
    CleanupKubeProxy(cmd::cleanup_kube_proxy::CleanupArgs),
    /// Answer every TCP connection and UDP datagram with a name (a test backend).
    #[command(hide = true)]
    ServeHostname(cmd::serve_hostname::ServeArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = EnvFilter::try_new(&cli.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only on a terminal: container logs and test captures want plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Reset(a) => cmd::reset::reset(a),
        Command::Explain(a) => cmd::explain::explain(a),
        Command::Probe(a) => cmd::probe::probe(a),
        Command::Dump(a) => cmd::dump::dump(a),
        Command::CleanupKubeProxy(a) => cmd::cleanup_kube_proxy::cleanup(a),
        Command::ServeHostname(a) => cmd::serve_hostname::serve(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
