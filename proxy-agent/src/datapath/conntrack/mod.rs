//! The TC datapath's connection tracking, seen from the agent: the GC of
//! expired flows and of the flows of departed backends (`conntrack_gc`).

pub mod conntrack_gc;
