//! Static guard against the verifier's call-chain stack limit.
//!
//! The verifier rejects a program whose deepest BPF-to-BPF call chain needs
//! more than `MAX_BPF_STACK` (512) bytes of stack (kernel/bpf/verifier.c,
//! `check_max_stack_depth`): each frame on the chain counts its depth
//! rounded up to a multiple of 32, and an empty frame still counts 32
//! (`round_up(max(depth, 1), 32)`). Newer kernels may accept what older ones
//! reject (6.18 on the build host loaded programs that 5.10 and 6.1 refused
//! with "combined stack size of 3 calls is 544. Too large"), so loading on
//! the host proves nothing about the kernels we support; this test checks
//! the object itself, on every host, without root or BPF syscalls.
//!
//! The bound is conservative: the verifier counts only the stack it sees
//! used on the paths it explores, while a function's LLVM frame (the deepest
//! offset below r10 that any of its instructions touches) is an upper bound
//! of that. A chain that fits here fits every kernel's rule.
//!
//! Calls into compiler_builtins' `memset`/`memmove`/`memcpy`, which
//! bpf-linker leaves as `.text` functions, are frames like any other; the
//! second test keeps them out of the datapath programs.

use std::collections::{BTreeSet, HashMap};

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SectionKind, SymbolKind};
use proxy_agent::datapath::object::EBPF_OBJECT;

/// kernel: include/linux/filter.h `MAX_BPF_STACK`.
const MAX_BPF_STACK: u32 = 512;
/// kernel/bpf/verifier.c rounds each frame to this in `check_max_stack_depth`.
const FRAME_ALIGN: u32 = 32;
/// Size of one BPF instruction slot.
const INSN: usize = 8;

// Instruction encoding (include/uapi/linux/bpf.h, bpf_common.h).
const CLASS_LD: u8 = 0x00;
const CLASS_LDX: u8 = 0x01;
const CLASS_ST: u8 = 0x02;
const CLASS_STX: u8 = 0x03;
const CLASS_ALU: u8 = 0x04;
const CLASS_ALU64: u8 = 0x07;
const MODE_ATOMIC: u8 = 0xc0;
const OP_ADD: u8 = 0x00;
const OP_SUB: u8 = 0x10;
const OP_MOV: u8 = 0xb0;
const SRC_X: u8 = 0x08;
/// `BPF_LD | BPF_IMM | BPF_DW`: the 16-byte load of a 64-bit immediate.
const LD_IMM64: u8 = 0x18;
/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;
/// `src_reg` of a call to another BPF function (`BPF_PSEUDO_CALL`); helper
/// calls have 0 and kfunc calls 2, neither opens a BPF frame.
const PSEUDO_CALL: u8 = 1;
/// The read-only frame pointer.
const R10: u8 = 10;

/// compiler_builtins' functions that bpf-linker keeps as `.text` functions.
const MEM_FUNCTIONS: [&str; 3] = ["memset", "memmove", "memcpy"];

/// The datapath's entry programs that must not reach [`MEM_FUNCTIONS`].
const NO_MEM_CALLS: &[&str] = &[
    "np_ingress",
    "np_ingress_compat",
    "np_egress",
    "np_egress_compat",
    "connect4",
    "connect4_compat",
    "connect6",
    "connect6_compat",
    "sendmsg4",
    "sendmsg4_compat",
    "sendmsg6",
    "sendmsg6_compat",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
    "xdp_nodeport",
    "xdp_nodeport_compat",
];

#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    dst: u8,
    src: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    fn decode(b: &[u8]) -> Self {
        Self {
            code: b[0],
            dst: b[1] & 0x0f,
            src: b[1] >> 4,
            off: i16::from_le_bytes([b[2], b[3]]),
            imm: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }
}

/// What one linear pass over a function's instructions finds.
#[derive(Debug, PartialEq, Eq)]
struct Scan {
    /// Deepest byte below r10 touched by a load/store or pointed at by an
    /// r10-derived pointer: LLVM's frame size.
    frame: u32,
    /// `(byte offset of the call in the function, imm)` of each BPF-to-BPF call.
    calls: Vec<(usize, i32)>,
}

/// Scans one function. Control flow is ignored: a copy of r10 is tracked
/// from `rX = r10` through `rX += imm` / `rX -= imm` until any other write
/// to rX, which is how LLVM forms stack pointers for helper arguments.
fn scan(code: &[u8]) -> Scan {
    // Per register: Some(offset from r10) while it holds r10 + offset.
    let mut alias: [Option<i64>; 11] = [None; 11];
    let mut deepest: i64 = 0;
    let mut calls = Vec::new();
    let mut at = 0;
    let mut reach = |offset: i64| deepest = deepest.max(-offset);
    while at + INSN <= code.len() {
        let i = Insn::decode(&code[at..at + INSN]);
        let (dst, src) = (usize::from(i.dst).min(10), usize::from(i.src).min(10));
        let base = |reg: u8, alias: &[Option<i64>; 11]| if reg == R10 { Some(0) } else { alias[usize::from(reg).min(10)] };
        let mut width = INSN;
        match i.code & 0x07 {
            CLASS_LD if i.code == LD_IMM64 => {
                alias[dst] = None;
                width = 2 * INSN;
            }
            // Legacy packet loads clobber r0-r5 like a call.
            CLASS_LD => alias[..=5].fill(None),
            CLASS_LDX => {
                if let Some(b) = base(i.src, &alias) {
                    reach(b + i64::from(i.off));
                }
                alias[dst] = None;
            }
            CLASS_ST | CLASS_STX => {
                if let Some(b) = base(i.dst, &alias) {
                    reach(b + i64::from(i.off));
                }
                // Atomic fetch writes back into src, cmpxchg into r0.
                if i.code & 0xe0 == MODE_ATOMIC && i.code & 0x07 == CLASS_STX {
                    alias[src] = None;
                    alias[0] = None;
                }
            }
            CLASS_ALU64 => {
                let op = i.code & 0xf0;
                let next = match (op, i.code & SRC_X) {
                    // `off` non-zero is movsx: a sign-extended narrow copy, no pointer.
                    (OP_MOV, SRC_X) if i.off == 0 => base(i.src, &alias),
                    (OP_ADD, 0) => alias[dst].map(|b| b + i64::from(i.imm)),
                    (OP_SUB, 0) => alias[dst].map(|b| b - i64::from(i.imm)),
                    _ => None,
                };
                if let Some(b) = next {
                    reach(b);
                }
                alias[dst] = next;
            }
            CLASS_ALU => alias[dst] = None,
            // JMP and JMP32: only a call writes registers (r0 result, r1-r5 scratch).
            _ if i.code == CALL => {
                if i.src == PSEUDO_CALL {
                    calls.push((at, i.imm));
                }
                alias[..=5].fill(None);
            }
            _ => {}
        }
        at += width;
    }
    Scan { frame: u32::try_from(deepest).unwrap_or(u32::MAX), calls }
}

/// What the verifier charges for a frame of `raw` bytes.
fn rounded(raw: u32) -> u32 {
    raw.max(1).div_ceil(FRAME_ALIGN) * FRAME_ALIGN
}

struct Function {
    symbol: String,
    section: SectionIndex,
    section_name: String,
    start: u64,
    size: u64,
    frame: u32,
    callees: BTreeSet<usize>,
}

impl Function {
    fn name(&self) -> String {
        readable(&self.symbol)
    }
    fn is_program(&self) -> bool {
        self.section_name != ".text"
    }
}

/// Every function of the object, with its frame and its resolved callees.
fn functions(elf: &[u8]) -> Vec<Function> {
    let file = object::File::parse(elf).expect("the embedded eBPF object is an ELF file");
    let mut funcs: Vec<Function> = Vec::new();
    for sym in file.symbols() {
        let Some(section) = sym.section_index() else { continue };
        let Ok(sec) = file.section_by_index(section) else { continue };
        if sym.kind() != SymbolKind::Text || sec.kind() != SectionKind::Text {
            continue;
        }
        funcs.push(Function {
            symbol: sym.name().expect("symbol name").to_owned(),
            section,
            section_name: sec.name().expect("section name").to_owned(),
            start: sym.address(),
            size: sym.size(),
            frame: 0,
            callees: BTreeSet::new(),
        });
    }
    let containing = |funcs: &[Function], section: SectionIndex, offset: u64| {
        funcs.iter().position(|f| f.section == section && f.start <= offset && (offset < f.start + f.size || offset == f.start))
    };
    // Call relocations by (section, offset of the call).
    let mut relocs = HashMap::new();
    for sec in file.sections().filter(|s| s.kind() == SectionKind::Text) {
        for (offset, rel) in sec.relocations() {
            if let RelocationTarget::Symbol(sym) = rel.target() {
                relocs.insert((sec.index(), offset), sym);
            }
        }
    }
    for idx in 0..funcs.len() {
        let f = &funcs[idx];
        let sec = file.section_by_index(f.section).expect("function section");
        let data = sec.data().expect("function section data");
        let end = usize::try_from(f.start + f.size).expect("offset fits usize").min(data.len());
        let start = usize::try_from(f.start).expect("offset fits usize");
        let found = scan(&data[start..end]);
        let mut callees = BTreeSet::new();
        for (at, imm) in found.calls {
            let call_offset = f.start + at as u64;
            // The target slot is `imm + 1` past a base: past the call itself
            // when no relocation names one (pc-relative, within a section),
            // past the relocation's symbol otherwise (libbpf's rule; a call
            // to a function symbol carries imm -1, to a section symbol the
            // slot index minus one).
            let (section, base_slot) = match relocs.get(&(f.section, call_offset)) {
                Some(&sym_idx) => {
                    let sym = file.symbol_by_index(sym_idx).expect("relocation symbol");
                    let Some(section) = sym.section_index() else {
                        panic!("{}: call at {call_offset:#x} to undefined symbol {:?}", f.name(), sym.name());
                    };
                    (section, (sym.address() / INSN as u64) as i64)
                }
                None => (f.section, (call_offset / INSN as u64) as i64),
            };
            let target = base_slot + i64::from(imm) + 1;
            let callee = u64::try_from(target)
                .ok()
                .and_then(|slot| containing(&funcs, section, slot * INSN as u64))
                .unwrap_or_else(|| panic!("{}: call at {call_offset:#x} to slot {target} is in no function", f.name()));
            callees.insert(callee);
        }
        funcs[idx].frame = found.frame;
        funcs[idx].callees = callees;
    }
    funcs
}

/// The chain from one function down that costs the most stack.
#[derive(Clone)]
struct Chain {
    total: u32,
    frames: Vec<usize>,
}

fn worst_chain(funcs: &[Function], at: usize, memo: &mut HashMap<usize, Chain>, path: &mut Vec<usize>) -> Result<Chain, String> {
    if let Some(c) = memo.get(&at) {
        return Ok(c.clone());
    }
    if let Some(pos) = path.iter().position(|&p| p == at) {
        // The verifier rejects recursion ("recursive call"); name the loop.
        let names: Vec<String> = path[pos..].iter().chain([&at]).map(|&i| funcs[i].name()).collect();
        return Err(format!("call cycle: {}", names.join(" -> ")));
    }
    path.push(at);
    let mut deepest = Chain { total: 0, frames: Vec::new() };
    for &callee in &funcs[at].callees {
        let c = worst_chain(funcs, callee, memo, path)?;
        if c.total > deepest.total {
            deepest = c;
        }
    }
    path.pop();
    deepest.total += rounded(funcs[at].frame);
    deepest.frames.insert(0, at);
    memo.insert(at, deepest.clone());
    Ok(deepest)
}

/// Every function reachable from `at`, itself included.
fn reachable(funcs: &[Function], at: usize) -> BTreeSet<usize> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![at];
    while let Some(f) = todo.pop() {
        if seen.insert(f) {
            todo.extend(funcs[f].callees.iter().copied());
        }
    }
    seen
}

/// Each of [`MEM_FUNCTIONS`] that program `name` reaches, with its callers.
fn mem_calls(funcs: &[Function], name: &str) -> Result<Vec<String>, String> {
    let p =
        funcs.iter().position(|f| f.is_program() && f.symbol == name).ok_or_else(|| format!("{name}: no such program in the object"))?;
    let reached = reachable(funcs, p);
    Ok(reached
        .iter()
        .filter(|&&f| MEM_FUNCTIONS.contains(&funcs[f].symbol.as_str()))
        .map(|&f| {
            let callers: Vec<String> = reached.iter().filter(|&&c| funcs[c].callees.contains(&f)).map(|&c| funcs[c].name()).collect();
            format!("{} (called from {})", funcs[f].symbol, callers.join(", "))
        })
        .collect())
}

fn describe(funcs: &[Function], chain: &Chain) -> String {
    chain
        .frames
        .iter()
        .map(|&i| format!("{}({}->{})", funcs[i].name(), funcs[i].frame, rounded(funcs[i].frame)))
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// A readable form of a Rust v0 symbol (`_R...`): its path without the
/// crate, const generic arguments in `<>` (`nodeport::new_flow_pick<0>`).
/// Other symbols are shown as they are.
fn readable(symbol: &str) -> String {
    let Some(rest) = symbol.strip_prefix("_R") else { return symbol.to_owned() };
    let b = rest.as_bytes();
    let mut idents: Vec<&str> = Vec::new();
    let mut consts: Vec<&str> = Vec::new();
    let mut i = 0;
    let skip_past_underscore = |i: usize| b[i..].iter().position(|&c| c == b'_').map_or(b.len(), |p| i + p + 1);
    while i < b.len() {
        match b[i] {
            b'0'..=b'9' => {
                let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
                let Ok(len) = rest[i..i + digits].parse::<usize>() else { return symbol.to_owned() };
                i += digits;
                // v0 separates an identifier that starts with a digit or `_`.
                if b.get(i) == Some(&b'_') {
                    i += 1;
                }
                let Some(ident) = rest.get(i..i + len) else { return symbol.to_owned() };
                idents.push(ident);
                i += len;
            }
            // Namespace tag after N; crate disambiguator (s…_); back-reference (B…_).
            b'N' => i += 2,
            b's' | b'B' => i = skip_past_underscore(i),
            // Const argument: K, its type letter, hex digits, `_`.
            b'K' => {
                let from = (i + 2).min(b.len());
                i = skip_past_underscore(from);
                let hex = rest.get(from..i.saturating_sub(1)).unwrap_or("");
                consts.push(if hex.is_empty() { "0" } else { hex });
            }
            _ => i += 1,
        }
    }
    if idents.is_empty() {
        return symbol.to_owned();
    }
    let path = idents[1..].join("::");
    if consts.is_empty() { path } else { format!("{path}<{}>", consts.join(",")) }
}

#[test]
fn every_program_fits_the_verifier_call_chain_stack_limit() {
    let funcs = functions(EBPF_OBJECT);
    let mut programs: Vec<usize> = (0..funcs.len()).filter(|&i| funcs[i].is_program()).collect();
    programs.sort_by(|&a, &b| funcs[a].symbol.cmp(&funcs[b].symbol));
    assert!(programs.iter().any(|&p| funcs[p].symbol == "np_ingress"), "no np_ingress program in the object");

    let mut memo = HashMap::new();
    let mut failures = Vec::new();
    // One write, so tests running in parallel do not cut into the table.
    let mut table = format!("{:<32} {:>5} {:>6}  worst call chain: frame(raw->rounded)\n", "program", "stack", "margin");
    for &p in &programs {
        match worst_chain(&funcs, p, &mut memo, &mut Vec::new()) {
            Ok(chain) => {
                let margin = i64::from(MAX_BPF_STACK) - i64::from(chain.total);
                table += &format!("{:<32} {:>5} {:>6}  {}\n", funcs[p].symbol, chain.total, margin, describe(&funcs, &chain));
                if chain.total > MAX_BPF_STACK {
                    let raw: Vec<&str> = chain.frames.iter().map(|&i| funcs[i].symbol.as_str()).collect();
                    failures.push(format!(
                        "{} ({}): combined stack {} > {MAX_BPF_STACK}: {}\n    symbols: {}",
                        funcs[p].symbol,
                        funcs[p].section_name,
                        chain.total,
                        describe(&funcs, &chain),
                        raw.join(" -> ")
                    ));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", funcs[p].symbol)),
        }
    }
    eprint!("{table}");
    assert!(
        failures.is_empty(),
        "programs whose worst call chain may exceed MAX_BPF_STACK, which kernels such as 5.10 and 6.1 reject\n(kernel/bpf/verifier.c check_max_stack_depth):\n{}",
        failures.join("\n")
    );
}

#[test]
fn datapath_programs_call_no_compiler_builtins_mem_functions() {
    let funcs = functions(EBPF_OBJECT);
    let mut failures = Vec::new();
    for &name in NO_MEM_CALLS {
        match mem_calls(&funcs, name) {
            Ok(calls) if calls.is_empty() => {}
            Ok(calls) => failures.push(format!("{name}: reaches {}", calls.join("; "))),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "datapath programs that call compiler_builtins' mem functions:\n{}", failures.join("\n"));
}

#[test]
fn scan_finds_frames_and_calls() {
    // (dst, src) nibble pair as the second byte.
    fn ins(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
        let [o0, o1] = off.to_le_bytes();
        let [i0, i1, i2, i3] = imm.to_le_bytes();
        [code, (src << 4) | dst, o0, o1, i0, i1, i2, i3]
    }
    let stxdw = 0x7b; // *(u64 *)(dst + off) = src
    let ldxdw = 0x79; // dst = *(u64 *)(src + off)
    let stdw = 0x7a; // *(u64 *)(dst + off) = imm
    let mov64x = 0xbf;
    let add64k = 0x07;
    let mov64k = 0xb7;
    let cases: [(&str, Vec<[u8; 8]>, Scan); 7] = [
        ("no stack", vec![ins(mov64k, 0, 0, 0, 0)], Scan { frame: 0, calls: vec![] }),
        ("store below r10", vec![ins(stxdw, 10, 1, -24, 0)], Scan { frame: 24, calls: vec![] }),
        ("load below r10", vec![ins(ldxdw, 1, 10, -40, 0)], Scan { frame: 40, calls: vec![] }),
        ("immediate store", vec![ins(stdw, 10, 0, -8, 7)], Scan { frame: 8, calls: vec![] }),
        (
            "pointer from a copy of r10",
            vec![ins(mov64x, 2, 10, 0, 0), ins(add64k, 2, 0, 0, -64), ins(stxdw, 2, 1, 8, 0)],
            Scan { frame: 64, calls: vec![] },
        ),
        (
            "alias cleared by another write",
            vec![ins(mov64x, 2, 10, 0, 0), ins(mov64k, 2, 0, 0, 5), ins(add64k, 2, 0, 0, -300)],
            Scan { frame: 0, calls: vec![] },
        ),
        (
            "pseudo call found, helper call and lddw skipped, call clobbers r1-r5",
            vec![
                ins(LD_IMM64, 1, 0, 0, 0),
                ins(0, 0, 0, 0, 0),
                ins(mov64x, 3, 10, 0, 0),
                ins(CALL, 0, 0, 0, 1),
                ins(add64k, 3, 0, 0, -100),
                ins(CALL, 0, PSEUDO_CALL, 0, 9),
            ],
            Scan { frame: 0, calls: vec![(40, 9)] },
        ),
    ];
    for (name, code, want) in cases {
        assert_eq!(scan(&code.concat()), want, "{name}");
    }
    for (raw, want) in [(0, 32), (1, 32), (32, 32), (33, 64), (232, 256), (248, 256)] {
        assert_eq!(rounded(raw), want, "rounded({raw})");
    }
    assert_eq!(readable("_RNvNtCsbHwfj6cyDL9_10proxy_ebpf8nodeport12mark_closing"), "nodeport::mark_closing");
    assert_eq!(readable("_RINvNtCsbHwfj6cyDL9_10proxy_ebpf8nodeport13new_flow_pickKh1_EB4_"), "nodeport::new_flow_pick<1>");
    assert_eq!(readable("memset"), "memset");
}

#[test]
fn worst_chain_sums_rounded_frames_and_rejects_cycles() {
    fn graph(nodes: &[(&str, u32, &[usize])]) -> Vec<Function> {
        nodes
            .iter()
            .map(|&(symbol, frame, callees)| Function {
                symbol: symbol.to_owned(),
                section: SectionIndex(0),
                section_name: ".text".to_owned(),
                start: 0,
                size: 0,
                frame,
                callees: callees.iter().copied().collect(),
            })
            .collect()
    }
    // A chain like the one 5.10 and 6.1 rejected ("combined stack size of
    // 3 calls is 544"): 232 + 8 + 248 rounds to 256 + 32 + 256.
    let rejected = graph(&[("np_ingress", 232, &[1, 3]), ("helper", 8, &[2]), ("new_flow", 248, &[]), ("rewrite", 64, &[])]);
    let chain = worst_chain(&rejected, 0, &mut HashMap::new(), &mut Vec::new()).expect("no cycle");
    assert_eq!(chain.total, 544);
    assert_eq!(describe(&rejected, &chain), "np_ingress(232->256) -> helper(8->32) -> new_flow(248->256)");

    let empty_frames = graph(&[("a", 0, &[1]), ("b", 0, &[])]);
    assert_eq!(worst_chain(&empty_frames, 0, &mut HashMap::new(), &mut Vec::new()).expect("no cycle").total, 64);

    let cycle = graph(&[("a", 8, &[1]), ("b", 8, &[0])]);
    let err = worst_chain(&cycle, 0, &mut HashMap::new(), &mut Vec::new()).err().expect("a cycle");
    assert_eq!(err, "call cycle: a -> b -> a");
}
