//! The Internet checksum (RFC 1071) for the IPv4, TCP and UDP headers of
//! frames that tests and the benchmark hand to BPF_PROG_TEST_RUN: the
//! NodePort program checks and rewrites checksums, so frames must carry
//! valid ones.

/// One's-complement sum of `data` as big-endian 16-bit words (an odd last
/// byte padded with zero), folded onto `sum`, complemented.
pub(crate) fn csum(data: &[u8], mut sum: u32) -> u16 {
    for c in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
