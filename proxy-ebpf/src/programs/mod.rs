//! The logic of each program family; `main.rs` holds their entry points.

pub(crate) mod baseline;
pub(crate) mod icmp;
pub(crate) mod nodeport;
pub(crate) mod sock;
pub(crate) mod sock_iter;
pub(crate) mod tc_fast;
pub(crate) mod xdp;
