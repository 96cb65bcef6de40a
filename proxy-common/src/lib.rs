//! Map keys and values shared by the eBPF programs and the agent.
//!
//! Every type here is `#[repr(C)]` with explicit padding so that the kernel
//! and userspace agree on the byte layout without relying on compiler
//! choices. There is no `bool`, enum or `Option`: the kernel sees raw bytes,
//! and every bit pattern of these structs must be a valid value. Fields that
//! hold network-order data say so with a `_be` suffix.
//!
//! The datapath's view of a Service is split over three hash maps, in the
//! style of Cilium's `lb4_services`/`lb4_backends` and Katran's reals:
//!
//! * [`SERVICES_MAP`]: frontend (address, port, protocol) to
//!   [`ServiceValue`], which names the service id, the number of backend
//!   slots and the *generation* those slots belong to.
//! * [`SLOTS_MAP`]: (service id, generation, slot index) to a backend id.
//! * [`BACKENDS_MAP`]: backend id to backend address and port.
//!
//! The agent writes a new backend set under a fresh generation and only then
//! replaces the service entry. A BPF hash map update replaces the element as
//! a whole (the kernel links a new element in and unlinks the old one under
//! RCU, `kernel/bpf/hashtab.c:htab_map_update_elem`), so a reader sees either
//! the old (count, generation) pair or the new one, never a mix.
//!
//! One module per map family, each re-exported here, so every item is
//! `proxy_common::X`. Above each map's name constant a comment gives its
//! kernel map type, key and value, who writes it and who reads it; the
//! `*_MAP` constants are the names in the object file and under the pin
//! directory.
//!
//! With the `user` feature every type implements `aya::Pod`, which lets
//! aya copy it to and from the byte buffers of the map syscalls. That is
//! sound for a type whose bytes are all initialised (no implicit padding)
//! and for which every bit pattern is a valid value: each is `#[repr(C)]`
//! and holds only integers and integer arrays (padding is spelled out as
//! `_pad` fields), and the sizes of its fields add up to the size asserted
//! next to it, so the compiler inserted no padding of its own.

#![no_std]
#![deny(missing_docs)]

mod affinity;
mod backend;
mod config;
mod conntrack;
mod counters;
mod fast_path;
mod maglev;
mod nodeport;
mod ports;
mod service;
mod sock_records;
mod sock_terminate;
mod source_ranges;
mod svc_conn;

pub use affinity::*;
pub use backend::*;
pub use config::*;
pub use conntrack::*;
pub use counters::*;
pub use fast_path::*;
pub use maglev::*;
pub use nodeport::*;
pub use ports::*;
pub use service::*;
pub use sock_records::*;
pub use sock_terminate::*;
pub use source_ranges::*;
pub use svc_conn::*;

/// `AF_INET` as the kernel reports it in `bpf_sock_addr.user_family`.
pub const FAMILY_V4: u8 = 2;
/// `AF_INET6` as the kernel reports it in `bpf_sock_addr.user_family`.
pub const FAMILY_V6: u8 = 10;

/// `IPPROTO_TCP`.
pub const PROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
pub const PROTO_UDP: u8 = 17;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_field_offsets() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(ServiceKey, port_be), 16);
        assert_eq!(offset_of!(ServiceKey, proto), 18);
        assert_eq!(offset_of!(ServiceKey, family), 19);
        assert_eq!(offset_of!(SockRevNatKey, ip_be), 8);
        assert_eq!(offset_of!(SockRevNatKey, family), 26);
        assert_eq!(offset_of!(BackendValue, port_be), 16);
        assert_eq!(offset_of!(SourceRangeKey, addr_be), 12);
        assert_eq!(offset_of!(AffinityValue, backend_id), 8);
    }
}
