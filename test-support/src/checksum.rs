//! The Internet checksum (RFC 1071) for the IPv4, TCP and UDP headers of
//! frames that tests and the benchmark hand to BPF_PROG_TEST_RUN: the
//! NodePort program checks and rewrites checksums, so frames must carry
//! valid ones.

/// One's-complement sum of `data` as big-endian 16-bit words (an odd last
/// byte padded with zero), folded onto `sum`, complemented.
pub fn csum(data: &[u8], mut sum: u32) -> u16 {
    for c in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::csum;

    #[test]
    fn matches_rfc_1071s_worked_example() {
        // RFC 1071 section 3: these words sum to 0xddf2, so the checksum is
        // its complement; a buffer that carries its checksum sums to zero.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(csum(&data, 0), !0xddf2);
        let mut with = data.to_vec();
        with.extend_from_slice(&(!0xddf2u16).to_be_bytes());
        assert_eq!(csum(&with, 0), 0);
        // An odd last byte counts as the high byte of a zero-padded word.
        assert_eq!(csum(&[0x12], 0), !0x1200);
    }
}
