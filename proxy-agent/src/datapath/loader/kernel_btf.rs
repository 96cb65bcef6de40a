//! Reading the running kernel's BTF (`/sys/kernel/btf/vmlinux`) for what
//! aya 0.14 does not expose: the type id of a kernel function (a kfunc to
//! call) and the byte offsets of a struct's members (to check a layout the
//! programs rely on). Only the type section is walked; the format is
//! include/uapi/linux/btf.h.

use std::collections::BTreeMap;

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_ENUM64: u32 = 19;
/// Kinds whose third word is the type they name: typedef, volatile,
/// const, restrict, type tag.
const KINDS_REFERRING: [u32; 5] = [8, 9, 10, 11, 18];

/// One type of the type section, as far as this reader needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Type {
    name: String,
    kind: u32,
    /// `size_or_type`: the type a typedef or qualifier names.
    refers_to: u32,
    /// Struct and union members: (name, type id, offset in bits).
    members: Vec<(String, u32, u32)>,
}

/// The kernel's BTF could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    /// The file could not be read (no BTF: `CONFIG_DEBUG_INFO_BTF` is off).
    #[error("reading /sys/kernel/btf/vmlinux: {0}")]
    Read(#[from] std::io::Error),
    /// The file is not BTF as this parser knows it.
    #[error("kernel BTF: {0}")]
    Malformed(&'static str),
}

/// The kernel's BTF types, by id (id 0 is `void`).
#[derive(Debug)]
pub struct KernelBtf {
    types: Vec<Type>,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl KernelBtf {
    /// Reads and parses the running kernel's BTF.
    pub fn from_sys_fs() -> Result<KernelBtf, BtfError> {
        Self::parse(&std::fs::read("/sys/kernel/btf/vmlinux")?)
    }

    /// Parses a BTF blob (the header, the string section and the types this crate looks up).
    pub fn parse(data: &[u8]) -> Result<KernelBtf, BtfError> {
        let bad = BtfError::Malformed;
        if data.len() < 24 || u16::from_ne_bytes([data[0], data[1]]) != BTF_MAGIC {
            return Err(bad("no BTF header (or another byte order)"));
        }
        let hdr_len = u32_at(data, 4).ok_or_else(|| bad("header"))? as usize;
        let field = |at: usize| u32_at(data, at).map(|v| v as usize).ok_or_else(|| bad("header"));
        let (type_off, type_len, str_off, str_len) = (field(8)?, field(12)?, field(16)?, field(20)?);
        let types = data.get(hdr_len + type_off..hdr_len + type_off + type_len).ok_or_else(|| bad("type section out of bounds"))?;
        let strings = data.get(hdr_len + str_off..hdr_len + str_off + str_len).ok_or_else(|| bad("string section out of bounds"))?;
        let name = |off: u32| -> String {
            let s = strings.get(off as usize..).unwrap_or_default();
            String::from_utf8_lossy(&s[..s.iter().position(|b| *b == 0).unwrap_or(s.len())]).into_owned()
        };
        let mut out = vec![Type { name: String::new(), kind: 0, refers_to: 0, members: Vec::new() }];
        let mut at = 0;
        while at + 12 <= types.len() {
            let (name_off, info, refers_to) =
                (u32_at(types, at).unwrap_or(0), u32_at(types, at + 4).unwrap_or(0), u32_at(types, at + 8).unwrap_or(0));
            let (kind, vlen, kind_flag) = ((info >> 24) & 0x1f, (info & 0xffff) as usize, info >> 31 == 1);
            at += 12;
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
                _ => 0,
            };
            let body = types.get(at..at + extra).ok_or_else(|| bad("type runs past its section"))?;
            let mut members = Vec::new();
            if kind == KIND_STRUCT || kind == KIND_UNION {
                for m in body.chunks_exact(12) {
                    let (m_name, m_type, m_off) = (u32_at(m, 0).unwrap_or(0), u32_at(m, 4).unwrap_or(0), u32_at(m, 8).unwrap_or(0));
                    // With kind_flag, the offset's top byte is a bitfield size.
                    let bits = if kind_flag { m_off & 0x00ff_ffff } else { m_off };
                    members.push((name(m_name), m_type, bits));
                }
            }
            out.push(Type { name: name(name_off), kind, refers_to, members });
            at += extra;
        }
        Ok(KernelBtf { types: out })
    }

    /// The type id of the kernel function `name`.
    pub fn func_id(&self, name: &str) -> Option<u32> {
        self.types.iter().position(|t| t.kind == KIND_FUNC && t.name == name).and_then(|i| u32::try_from(i).ok())
    }

    /// The byte offset of every named member of struct `name`, members of
    /// its anonymous structs and unions included (as C reaches them).
    pub fn member_offsets(&self, name: &str) -> Option<BTreeMap<String, usize>> {
        let id = self.types.iter().position(|t| t.kind == KIND_STRUCT && t.name == name)?;
        let mut out = BTreeMap::new();
        self.walk(id, 0, &mut out, 0);
        Some(out)
    }

    fn walk(&self, id: usize, base_bits: u32, out: &mut BTreeMap<String, usize>, depth: u32) {
        let Some(t) = self.types.get(id).filter(|_| depth < 8) else { return };
        for (m_name, m_type, bits) in &t.members {
            if m_name.is_empty() {
                // An anonymous struct or union, possibly behind modifiers.
                let inner = self.resolve(*m_type);
                self.walk(inner, base_bits + bits, out, depth + 1);
            } else {
                out.entry(m_name.clone()).or_insert(((base_bits + bits) / 8) as usize);
            }
        }
    }

    /// Skips typedefs and qualifiers to the struct or union underneath.
    fn resolve(&self, mut id: u32) -> usize {
        for _ in 0..8 {
            match self.types.get(id as usize) {
                Some(t) if KINDS_REFERRING.contains(&t.kind) => id = t.refers_to,
                _ => break,
            }
        }
        id as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little BTF: struct s { int a; union { int b; short c; }; int d; }
    /// and a function f.
    fn sample() -> Vec<u8> {
        let mut strings = b"\0int\0s\0a\0b\0c\0d\0f\0".to_vec();
        let off = |s: &str| {
            let pat = format!("\0{s}\0");
            (strings.windows(pat.len()).position(|w| w == pat.as_bytes()).unwrap() + 1) as u32
        };
        let mut types: Vec<u8> = Vec::new();
        let mut push = |v: &[u32]| v.iter().for_each(|w| types.extend_from_slice(&w.to_ne_bytes()));
        // [1] int: 4 bytes.
        push(&[off("int"), KIND_INT << 24, 4, 32]);
        // [2] anonymous union { int b; short c (as int) }.
        push(&[0, (KIND_UNION << 24) | 2, 4, off("b"), 1, 0, off("c"), 1, 0]);
        // [3] struct s { a @0, <union> @32 bits, d @64 bits }.
        push(&[off("s"), (KIND_STRUCT << 24) | 3, 12, off("a"), 1, 0, 0, 2, 32, off("d"), 1, 64]);
        // [4] func f.
        push(&[off("f"), KIND_FUNC << 24, 0]);
        let mut out = Vec::new();
        out.extend_from_slice(&BTF_MAGIC.to_ne_bytes());
        out.extend_from_slice(&[1, 0]);
        let type_len = types.len() as u32;
        for w in [24u32, 0, type_len, type_len, strings.len() as u32] {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        out.extend_from_slice(&types);
        out.append(&mut strings);
        out
    }

    #[test]
    fn finds_functions_and_member_offsets_through_anonymous_unions() {
        let btf = KernelBtf::parse(&sample()).expect("parses");
        assert_eq!(btf.func_id("f"), Some(4));
        assert_eq!(btf.func_id("s"), None, "a struct is not a function");
        let m = btf.member_offsets("s").expect("struct s");
        assert_eq!(m.get("a"), Some(&0));
        assert_eq!(m.get("b"), Some(&4));
        assert_eq!(m.get("c"), Some(&4));
        assert_eq!(m.get("d"), Some(&8));
        assert!(KernelBtf::parse(b"not btf at all, not at all").is_err());
    }

    #[test]
    fn the_running_kernel_lays_out_sock_common_as_the_iterators_read_it() {
        let Ok(btf) = KernelBtf::from_sys_fs() else { return };
        let m = btf.member_offsets("sock_common").expect("struct sock_common");
        for (field, want) in [
            ("skc_daddr", proxy_common::SKC_DADDR_OFF),
            ("skc_dport", proxy_common::SKC_DPORT_OFF),
            ("skc_family", proxy_common::SKC_FAMILY_OFF),
            ("skc_state", proxy_common::SKC_STATE_OFF),
            ("skc_v6_daddr", proxy_common::SKC_V6_DADDR_OFF),
        ] {
            assert_eq!(m.get(field), Some(&want), "{field}");
        }
    }
}
