//! `--conntrack-*` flags: how often the agent sweeps the TC datapath's
//! connection tracking (`NP_CT`) and how long idle flows live
//! (`proxy_agent::datapath::conntrack_gc`).

use std::time::Duration;

use clap::Args;
use proxy_agent::datapath::conntrack_gc::{GcConfig, Timeouts};
use proxy_common as pc;

#[derive(Args, Clone, Debug)]
pub(crate) struct ConntrackArgs {
    /// Seconds between two sweeps of NP_CT that delete idle flows; 0 turns
    /// the sweeps off (entries then leave only by LRU eviction when the map
    /// is full).
    #[arg(long, default_value_t = 15)]
    pub conntrack_gc_interval_secs: u64,
    /// Idle time after which an established TCP flow is deleted.
    #[arg(long, default_value_t = pc::CT_TIMEOUT_TCP_S)]
    pub conntrack_tcp_timeout_secs: u32,
    /// Idle time after which a closing TCP flow (RST, or FIN from both
    /// sides) is deleted.
    #[arg(long, default_value_t = pc::CT_TIMEOUT_TCP_CLOSING_S)]
    pub conntrack_tcp_closing_timeout_secs: u32,
    /// Idle time after which a TCP flow the backend never answered (a SYN
    /// without SYN-ACK) is deleted.
    #[arg(long, default_value_t = pc::CT_TIMEOUT_TCP_SYN_S)]
    pub conntrack_tcp_syn_timeout_secs: u32,
    /// Idle time after which any other flow (UDP) is deleted.
    #[arg(long, default_value_t = pc::CT_TIMEOUT_OTHER_S)]
    pub conntrack_other_timeout_secs: u32,
}

impl ConntrackArgs {
    pub(crate) fn gc_config(&self) -> GcConfig {
        GcConfig {
            interval: Duration::from_secs(self.conntrack_gc_interval_secs),
            timeouts: Timeouts {
                tcp_s: self.conntrack_tcp_timeout_secs,
                tcp_closing_s: self.conntrack_tcp_closing_timeout_secs,
                tcp_syn_s: self.conntrack_tcp_syn_timeout_secs,
                other_s: self.conntrack_other_timeout_secs,
            },
        }
    }
}
