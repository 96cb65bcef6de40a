//! How frontends, backends and addresses are encoded in the maps' keys and
//! values, both ways: the map writer encodes, `dump`, the NodePort writer
//! and the writer's read-back decode.
//!
//! The maps hold addresses as the kernel does: network byte order in
//! 32-bit words, IPv4 in the first word and the other three zero, with the
//! address family beside them (proxy-common's `ServiceKey`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::maps::lpm_trie::Key;
use proxy_common as pc;
use proxy_common::{AddrKey, BackendValue, ServiceKey, SourceRangeKey};

use crate::model::{Backend, Cidr, Frontend, Protocol};

/// Encodes a frontend as the datapath's key.
pub fn service_key(fe: &Frontend) -> ServiceKey {
    let (ip_be, family) = ip_words(&fe.ip);
    ServiceKey {
        ip_be,
        port_be: fe.port.to_be(),
        proto: match fe.protocol {
            Protocol::Tcp => pc::PROTO_TCP,
            Protocol::Udp => pc::PROTO_UDP,
        },
        family,
    }
}

/// Decodes a datapath key; `None` for a key this agent would never write.
pub fn frontend_of(key: &ServiceKey) -> Option<Frontend> {
    let protocol = match key.proto {
        pc::PROTO_TCP => Protocol::Tcp,
        pc::PROTO_UDP => Protocol::Udp,
        _ => return None,
    };
    Some(Frontend { ip: ip_of(key.ip_be, key.family)?, port: u16::from_be(key.port_be), protocol })
}

/// Encodes a backend's address (tier `other`, for the address alone).
pub fn backend_value(b: &Backend) -> BackendValue {
    tiered_backend_value(b, proxy_common::tier::OTHER)
}

/// Encodes a backend with its topology tier (a `proxy_common::tier` code,
/// `decide::topology::tier`), as the map writer stores it.
pub fn tiered_backend_value(b: &Backend, tier: u8) -> BackendValue {
    let (ip_be, family) = ip_words(&b.ip);
    BackendValue { ip_be, port_be: b.port.to_be(), family, tier }
}

/// Decodes a backend; `None` for an address family this agent never writes.
pub fn backend_of(v: &BackendValue) -> Option<Backend> {
    Some(Backend { ip: ip_of(v.ip_be, v.family)?, port: u16::from_be(v.port_be) })
}

/// An address as `NP_LOCAL` keys it.
pub fn addr_key(ip: &IpAddr) -> AddrKey {
    let (ip_be, family) = ip_words(ip);
    AddrKey::new(ip_be, family)
}

/// A source range of frontend `service_id` at `generation`, as the LPM trie
/// keys it: the fixed part matched in full, then the range's prefix.
pub fn source_range_key(service_id: u32, generation: u32, c: &Cidr) -> Key<SourceRangeKey> {
    let (addr_be, family) = ip_words(&c.addr);
    Key::new(pc::SOURCE_RANGE_FIXED_BITS + u32::from(c.prefix_len), SourceRangeKey::new(service_id, generation, family, addr_be))
}

/// Decodes a source range key; `None` for one this agent would never write.
pub fn cidr_of(k: &Key<SourceRangeKey>) -> Option<Cidr> {
    let data = k.data();
    let prefix_len = u8::try_from(k.prefix_len().checked_sub(pc::SOURCE_RANGE_FIXED_BITS)?).ok()?;
    let max = if data.family == pc::FAMILY_V4 { 32 } else { 128 };
    (prefix_len <= max).then_some(())?;
    Some(Cidr { addr: ip_of(data.addr_be, data.family)?, prefix_len })
}

/// The address in `words` of family `family`; `None` for a family this
/// agent never writes.
pub fn ip_of(words: [u32; 4], family: u8) -> Option<IpAddr> {
    match family {
        pc::FAMILY_V4 => Some(IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))),
        pc::FAMILY_V6 => {
            let mut o = [0u8; 16];
            for (i, w) in words.iter().enumerate() {
                o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            Some(IpAddr::V6(Ipv6Addr::from(o)))
        }
        _ => None,
    }
}

fn ip_words(ip: &IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], pc::FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], pc::FAMILY_V6)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_in_network_order() {
        let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Udp };
        let k = service_key(&fe);
        // 10.96.0.10 in memory is 0a 60 00 0a; port 80 is 00 50.
        assert_eq!(k.ip_be[0].to_ne_bytes(), [10, 96, 0, 10]);
        assert_eq!(k.port_be.to_ne_bytes(), [0, 80]);
        assert_eq!(k.proto, pc::PROTO_UDP);
        assert_eq!(k.family, pc::FAMILY_V4);
        assert_eq!(frontend_of(&k), Some(fe));
        let fe6 = Frontend { ip: "fd00:96::a".parse().unwrap(), port: 443, protocol: Protocol::Tcp };
        let k6 = service_key(&fe6);
        assert_eq!(k6.ip_be[0].to_ne_bytes(), [0xfd, 0, 0, 0x96]);
        assert_eq!(frontend_of(&k6), Some(fe6));
        let b = Backend { ip: "fd00::1".parse().unwrap(), port: 8080 };
        assert_eq!(backend_of(&backend_value(&b)), Some(b));
        assert_eq!(backend_of(&tiered_backend_value(&b, pc::tier::ZONE)), Some(b));
        assert_eq!(tiered_backend_value(&b, pc::tier::ZONE).tier, pc::tier::ZONE);
        assert_eq!(frontend_of(&ServiceKey { proto: 1, ..k }), None);
    }

    #[test]
    fn address_keys_use_the_service_key_encoding() {
        for ip in ["10.244.1.2", "fd00::3"] {
            let ip: IpAddr = ip.parse().unwrap();
            let k = addr_key(&ip);
            let sk = service_key(&Frontend { ip, port: 0, protocol: Protocol::Tcp });
            assert_eq!((k.ip_be, k.family), (sk.ip_be, sk.family));
            assert_eq!(ip_of(k.ip_be, k.family), Some(ip));
        }
        assert_eq!(ip_of([1, 0, 0, 0], 7), None);
    }

    #[test]
    fn source_range_keys_put_the_address_in_network_order_behind_the_fixed_part() {
        for text in ["10.0.0.0/8", "192.0.2.7/32", "0.0.0.0/0", "fd00::/64"] {
            let c = Cidr::parse(text).unwrap();
            let k = source_range_key(7, 3, &c);
            assert_eq!(k.prefix_len(), 96 + u32::from(c.prefix_len), "{text}");
            let d = k.data();
            assert_eq!((d.service_id, d.generation), (7, 3));
            assert_eq!(cidr_of(&k), Some(c), "{text}");
        }
        let k = source_range_key(1, 1, &Cidr::parse("10.1.0.0/16").unwrap());
        // The trie compares bytes from the first: 10 must come first.
        assert_eq!(k.data().addr_be[0].to_ne_bytes(), [10, 1, 0, 0]);
        assert_eq!(cidr_of(&Key::new(40, k.data())), None, "a prefix shorter than the fixed part");
        assert_eq!(cidr_of(&Key::new(96 + 33, k.data())), None, "longer than an IPv4 address");
    }
}
