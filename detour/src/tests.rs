//! Crafted functions, hand-assembled with the offsets in comments, against every check and
//! the relocation. No KVM and no guest memory.

use hvprobe_introspection::memory::BytesAt;
use hvprobe_introspection::symbols::{Symbol, SymbolSource};
use proptest::prelude::*;

use super::relocate::verify;
use super::*;
use crate::sites::PatchSite;

const FUNC: u64 = 0xffff_ffff_8100_0000;
/// Data a RIP-relative operand reads.
const DATA: u64 = 0xffff_ffff_8180_0040;
/// The detour, 1 GiB above the function (the out-of-line area is within ±2 GiB of text).
const OOL: u64 = 0xffff_ffff_c100_0000;
/// An address no rel32 from the function's neighbourhood reaches.
const FAR: u64 = 0xffff_c900_0000_0000;
/// `__x86_indirect_thunk_rax`.
const THUNK: u64 = 0xffff_ffff_8200_0000;
/// `__x86_return_thunk`.
const RETURN_THUNK: u64 = 0xffff_ffff_8200_0100;
/// A compiler-split part of the function (`func.cold`).
const COLD: u64 = 0xffff_ffff_8100_1000;
/// Where an exception-table entry's fixup of another function goes.
const ELSEWHERE: u64 = 0xffff_ffff_8100_2000;

fn g(offset: u64) -> Gva {
    Gva(FUNC + offset)
}

/// A tiny assembler: raw bytes, and the rel8/rel32 forms computed from absolute targets.
struct Asm {
    start: u64,
    bytes: Vec<u8>,
}

impl Asm {
    fn new() -> Self {
        Self::at(FUNC)
    }

    fn at(start: u64) -> Self {
        Asm {
            start,
            bytes: Vec::new(),
        }
    }

    fn here(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    fn b(mut self, bytes: &[u8]) -> Self {
        self.bytes.extend_from_slice(bytes);
        self
    }

    /// `opcode` followed by a rel32 (or RIP-relative disp32, the last field) reaching `target`.
    fn rel32(mut self, opcode: &[u8], target: u64) -> Self {
        let next = self.here() + opcode.len() as u64 + 4;
        let rel = i32::try_from(target.wrapping_sub(next) as i64).expect("rel32 reach");
        self.bytes.extend_from_slice(opcode);
        self.bytes.extend_from_slice(&rel.to_le_bytes());
        self
    }

    /// `opcode` followed by a rel8 reaching `target`.
    fn rel8(mut self, opcode: u8, target: u64) -> Self {
        let next = self.here() + 2;
        let rel = i8::try_from(target.wrapping_sub(next) as i64).expect("rel8 reach");
        self.bytes.push(opcode);
        self.bytes.push(rel as u8);
        self
    }

    /// int3 padding up to `offset` from the start, as the linker leaves between functions.
    fn pad_to(mut self, offset: u64) -> Self {
        assert!(self.bytes.len() as u64 <= offset, "code runs past {offset:#x}");
        self.bytes.resize(offset as usize, INT3);
        self
    }

    fn done(self) -> Vec<u8> {
        self.bytes
    }
}

/// push %rbp; mov %rsp,%rbp; push %rbx; sub $0x10,%rsp; mov DATA(%rip),%rax; mov %rax,%rbx;
/// add $0x10,%rsp; pop %rbx; pop %rbp; ret; int3 padding.
fn prologue() -> Vec<u8> {
    Asm::new()
        .b(&[0x55]) // +0x0 push %rbp
        .b(&[0x48, 0x89, 0xe5]) // +0x1 mov %rsp,%rbp
        .b(&[0x53]) // +0x4 push %rbx
        .b(&[0x48, 0x83, 0xec, 0x10]) // +0x5 sub $0x10,%rsp
        .rel32(&[0x48, 0x8b, 0x05], DATA) // +0x9 mov DATA(%rip),%rax
        .b(&[0x48, 0x89, 0xc3]) // +0x10 mov %rax,%rbx
        .b(&[0x48, 0x83, 0xc4, 0x10]) // +0x13 add $0x10,%rsp
        .b(&[0x5b]) // +0x17 pop %rbx
        .b(&[0x5d]) // +0x18 pop %rbp
        .b(&[0xc3]) // +0x19 ret
        .pad_to(0x20)
        .done()
}

/// The prologue's first 5 bytes (push %rbp; mov %rsp,%rbp; push %rbx), then `rest`.
fn prologue_then(rest: impl FnOnce(Asm) -> Asm) -> Vec<u8> {
    rest(Asm::new().b(&[0x55, 0x48, 0x89, 0xe5, 0x53])).done()
}

/// test %edi,%edi; je +0x20; mov DATA(%rip),%rax; mov %rax,%rdi; ret; ...;
/// +0x20: xor %eax,%eax; ret.
fn rip_and_jcc() -> Vec<u8> {
    Asm::new()
        .b(&[0x85, 0xff]) // +0x0 test %edi,%edi
        .rel8(0x74, FUNC + 0x20) // +0x2 je +0x20
        .rel32(&[0x48, 0x8b, 0x05], DATA) // +0x4 mov DATA(%rip),%rax
        .b(&[0x48, 0x89, 0xc7]) // +0xb mov %rax,%rdi
        .b(&[0xc3]) // +0xe ret
        .pad_to(0x20)
        .b(&[0x31, 0xc0]) // +0x20 xor %eax,%eax
        .b(&[0xc3]) // +0x22 ret
        .pad_to(0x28)
        .done()
}

/// An exception table with `(instruction, fixup)` entries, read as the guest lays it out.
fn ex_table(entries: &[(u64, u64)]) -> ExceptionTable {
    let base = 0xffff_ffff_8280_0000u64;
    let mut bytes = Vec::new();
    for (i, &(insn, fixup)) in entries.iter().enumerate() {
        let at = base + 12 * i as u64;
        bytes.extend_from_slice(&(insn.wrapping_sub(at) as i32).to_le_bytes());
        bytes.extend_from_slice(&(fixup.wrapping_sub(at + 4) as i32).to_le_bytes());
        bytes.extend_from_slice(&0i32.to_le_bytes());
    }
    let marker = |name: &str, addr: u64| Symbol {
        name: name.into(),
        addr: Gva(addr),
        kind: 'D',
        size: None,
    };
    let symbols = SymbolTable::from_symbols(
        SymbolSource::SystemMap,
        vec![
            marker("__start___ex_table", base),
            marker("__stop___ex_table", base + bytes.len() as u64),
        ],
    );
    ExceptionTable::read(&BytesAt { base, bytes }, &symbols).unwrap()
}

/// The guest facts of a test.
struct Facts {
    ex_table: ExceptionTable,
    patch_sites: PatchSites,
    thunks: IndirectThunks,
}

impl Facts {
    fn none() -> Self {
        Facts {
            ex_table: ExceptionTable::default(),
            patch_sites: PatchSites::default(),
            thunks: IndirectThunks::from_ranges(vec![Gva(THUNK)..Gva(THUNK + 0x20)]),
        }
    }

    fn with_ex_table(entries: &[(u64, u64)]) -> Self {
        Facts {
            ex_table: ex_table(entries),
            ..Self::none()
        }
    }

    fn with_sites(sites: Vec<PatchSite>) -> Self {
        Facts {
            patch_sites: PatchSites::from_sites(sites),
            ..Self::none()
        }
    }

    fn view(&self) -> DetourFacts<'_> {
        DetourFacts {
            ex_table: &self.ex_table,
            patch_sites: &self.patch_sites,
            thunks: &self.thunks,
        }
    }
}

fn function(bytes: &[u8]) -> FunctionText<'_> {
    FunctionText {
        body: Code {
            start: Gva(FUNC),
            bytes,
        },
        ftrace_site: None,
        split_parts: &[],
    }
}

/// Plans at `FUNC + offset` with no guest facts and no other probes.
fn plan(bytes: &[u8], offset: u64) -> Result<DetourRegion, NotOptimizable> {
    plan_region(g(offset), &function(bytes), &Facts::none().view(), &[])
}

fn addrs(region: &DetourRegion) -> Vec<Gva> {
    region.instructions().iter().map(|i| i.addr).collect()
}

/// Decodes relocated code at `ip` into its instructions.
fn decode_at(bytes: &[u8], ip: u64) -> Vec<Instruction> {
    let decoded: Vec<Instruction> = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE)
        .into_iter()
        .collect();
    assert!(decoded.iter().all(|i| !i.is_invalid()), "undecodable: {bytes:02x?}");
    decoded
}

// --- planning: positive cases ---

#[test]
fn a_plain_prologue_is_planned_as_whole_instructions_covering_five_bytes() {
    let code = prologue();
    let region = plan(&code, 0).unwrap();
    assert_eq!(region.start(), g(0));
    assert_eq!(region.size(), 5);
    assert_eq!(region.end(), g(5));
    assert_eq!(addrs(&region), [g(0), g(1), g(4)]);
    assert_eq!(region.original_bytes(), &code[..5]);
    assert_eq!(
        region.to_string(),
        "0xffffffff81000000..0xffffffff81000005 (push rbp; mov rbp,rsp; push rbx)"
    );

    // From the mov: 3 + 1 + 4 bytes, the sub being the instruction that crosses the 5th byte.
    let region = plan(&code, 1).unwrap();
    assert_eq!((region.size(), region.end()), (8, g(9)));
    assert_eq!(addrs(&region), [g(1), g(4), g(5)]);

    // One instruction longer than the jump is a region of its own.
    let region = plan(&code, 9).unwrap();
    assert_eq!((region.size(), addrs(&region)), (7, vec![g(9)]));
}

#[test]
fn a_region_may_end_with_a_ret_or_a_jmp() {
    // add $0x10,%rsp; ret
    let code = Asm::new().b(&[0x48, 0x83, 0xc4, 0x10, 0xc3]).pad_to(0x10).done();
    assert_eq!(plan(&code, 0).unwrap().size(), 5);
    // mov %rdi,%rax; jmp other (a tail call)
    let code = Asm::new()
        .b(&[0x48, 0x89, 0xf8])
        .rel32(&[0xe9], ELSEWHERE)
        .pad_to(0x10)
        .done();
    assert_eq!(plan(&code, 0).unwrap().size(), 8);
}

#[test]
fn branches_to_the_first_byte_or_past_the_end_of_the_region_are_fine() {
    let code = Asm::new()
        .b(&[0x83, 0xef, 0x01]) // +0x0 sub $1,%edi
        .rel8(0x75, FUNC) // +0x3 jne +0x0: the region's first byte
        .rel8(0x74, FUNC + 5) // +0x5 je +0x5: the region's end
        .rel32(&[0xe8], FUNC) // +0x7 call +0x0
        .b(&[0xc3]) // +0xc ret
        .pad_to(0x10)
        .done();
    let region = plan(&code, 0).unwrap();
    assert_eq!((region.start(), region.end()), (g(0), g(5)));
}

#[test]
fn indirect_calls_and_the_return_thunk_are_not_indirect_jumps() {
    let code = prologue_then(|a| {
        a.b(&[0xff, 0xd0]) // +0x5 call *%rax
            .rel32(&[0xe8], THUNK) // +0x7 call __x86_indirect_thunk_rax
            .b(&[0x5b, 0x5d]) // +0xc pop %rbx; pop %rbp
            .rel32(&[0xe9], RETURN_THUNK) // +0xe jmp __x86_return_thunk (a ret)
            .pad_to(0x20)
    });
    assert_eq!(plan(&code, 0).unwrap().end(), g(5));
}

#[test]
fn int3_after_a_ret_or_jmp_and_trailing_int3_padding_are_the_compilers() {
    let code = prologue_then(|a| {
        a.b(&[0x74, 0x02]) // +0x5 je +0x9
            .b(&[0xc3, 0xcc]) // +0x7 ret; int3 (straight-line speculation)
            .b(&[0x5b, 0x5d]) // +0x9 pop %rbx; pop %rbp
            .rel32(&[0xe9], ELSEWHERE) // +0xb jmp elsewhere
            .b(&[0xcc]) // +0x10 int3 (SLS)
            .rel32(&[0xe8], ELSEWHERE) // +0x11 call a noreturn function
            .pad_to(0x20) // int3 padding to the end
    });
    assert!(plan(&code, 0).is_ok());
}

// --- planning: refusals ---

#[test]
fn a_region_crossing_the_functions_end_is_refused() {
    // push %rbp; mov %rsp,%rbp: four bytes, then the function ends.
    let code = [0x55, 0x48, 0x89, 0xe5];
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::CrossesFunctionEnd {
            start: g(0),
            needed_end: g(5),
            function_end: g(4),
        })
    );
    // At +1 of a 5-byte function: the mov and the push leave 4 bytes.
    let code = [0x55, 0x48, 0x89, 0xe5, 0x53];
    assert_eq!(
        plan(&code, 1),
        Err(NotOptimizable::CrossesFunctionEnd {
            start: g(1),
            needed_end: g(6),
            function_end: g(5),
        })
    );
}

#[test]
fn a_region_past_a_ret_or_jmp_is_refused() {
    let code = prologue();
    // pop %rbx; pop %rbp; ret; then padding: the ret is the third instruction.
    assert_eq!(
        plan(&code, 0x17),
        Err(NotOptimizable::PastUnconditionalTransfer {
            transfer: g(0x19),
            next: g(0x1a),
        })
    );
    // jmp +0x7 at the start: what follows it is reached only by jumps.
    let code = Asm::new()
        .rel8(0xeb, FUNC + 7) // +0x0 jmp +0x7
        .b(&[0x5b, 0x5d, 0xc3]) // +0x2 pop %rbx; pop %rbp; ret
        .b(&[0x31, 0xc0, 0xc3]) // +0x5... xor %eax,%eax; ret (never mind the target)
        .pad_to(0x10)
        .done();
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::PastUnconditionalTransfer {
            transfer: g(0),
            next: g(2),
        })
    );
}

#[test]
fn an_indirect_jump_anywhere_in_the_function_is_refused() {
    let cases: [(&str, Vec<u8>, Gva); 3] = [
        (
            "jmp rax",
            prologue_then(|a| a.b(&[0x5b, 0x5d]).b(&[0xff, 0xe0]).pad_to(0x10)),
            g(7),
        ),
        (
            // a jump through a pointer: jmp *DATA(%rip)
            "jmp qword ptr [0FFFFFFFF81800040h]",
            prologue_then(|a| a.b(&[0x5b, 0x5d]).rel32(&[0xff, 0x25], DATA).pad_to(0x10)),
            g(7),
        ),
        (
            // a jump table: jmp *table(,%rax,8)
            "jmp qword ptr [rax*8-",
            prologue_then(|a| {
                a.b(&[0x5b, 0x5d])
                    .b(&[0xff, 0x24, 0xc5, 0x00, 0x10, 0x80, 0x81])
                    .pad_to(0x10)
            }),
            g(7),
        ),
    ];
    for (text, code, at) in cases {
        match plan(&code, 0) {
            Err(NotOptimizable::IndirectJump { at: found, insn }) => {
                assert_eq!(found, at, "{text}");
                assert!(insn.starts_with(text), "{insn} is not {text}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn a_jump_to_a_retpoline_thunk_counts_as_an_indirect_jump() {
    // jmp __x86_indirect_thunk_rax (a tail call through a function pointer)
    let code = prologue_then(|a| a.b(&[0x5b, 0x5d]).rel32(&[0xe9], THUNK).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::JumpToThunk {
            at: g(7),
            thunk: Gva(THUNK),
        })
    );
    // jne __x86_indirect_thunk_rax+0x10 (a conditional one), to a later thunk in the range
    let code = prologue_then(|a| a.rel32(&[0x0f, 0x85], THUNK + 0x10).b(&[0x5b, 0x5d, 0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::JumpToThunk {
            at: g(5),
            thunk: Gva(THUNK),
        })
    );
}

#[test]
fn a_branch_into_the_regions_interior_is_refused() {
    // jne +0x1 (onto the mov, inside push|mov|push)
    let code = prologue_then(|a| a.rel8(0x75, FUNC + 1).b(&[0x5b, 0x5d, 0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::BranchIntoRegion {
            from: g(5),
            target: g(1),
            start: g(0),
            end: g(5),
        })
    );
    // A call counts too, and so does a target that is not even an instruction start.
    let code = prologue_then(|a| a.rel32(&[0xe8], FUNC + 3).b(&[0x5b, 0x5d, 0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::BranchIntoRegion {
            from: g(5),
            target: g(3),
            start: g(0),
            end: g(5),
        })
    );
    // The region is longer than 5 bytes here (+0x1..+0x9): +0x5 is inside it, though past
    // the jump's own bytes.
    let code = prologue_then(|a| {
        a.b(&[0x48, 0x83, 0xec, 0x10]) // +0x5 sub $0x10,%rsp
            .rel8(0x75, FUNC + 5) // +0x9 jne +0x5
            .b(&[0xc3])
            .pad_to(0x10)
    });
    assert_eq!(
        plan(&code, 1),
        Err(NotOptimizable::BranchIntoRegion {
            from: g(9),
            target: g(5),
            start: g(1),
            end: g(9),
        })
    );
    // Into the middle of the sub at +0x5..+0x9, beyond the jump's own bytes (+0x1..+0x6):
    // the bytes after the jump stay as they were, but a jump there still lands in the
    // middle of an instruction that no longer runs there.
    let code = prologue_then(|a| {
        a.b(&[0x48, 0x83, 0xec, 0x10]) // +0x5 sub $0x10,%rsp
            .rel8(0x75, FUNC + 7) // +0x9 jne +0x7
            .b(&[0xc3])
            .pad_to(0x10)
    });
    assert_eq!(
        plan(&code, 1),
        Err(NotOptimizable::BranchIntoRegion {
            from: g(9),
            target: g(7),
            start: g(1),
            end: g(9),
        })
    );
}

#[test]
fn a_branch_back_from_a_split_part_is_seen() {
    let code = prologue();
    // func.cold: jmp func+0x4 (back into the middle of push|mov|push)
    let cold = Asm::at(COLD).rel32(&[0xe9], FUNC + 4).pad_to(0x8).done();
    let parts = [Code {
        start: Gva(COLD),
        bytes: &cold,
    }];
    let text = FunctionText {
        split_parts: &parts,
        ..function(&code)
    };
    assert_eq!(
        plan_region(g(0), &text, &Facts::none().view(), &[]),
        Err(NotOptimizable::BranchIntoRegion {
            from: Gva(COLD),
            target: g(4),
            start: g(0),
            end: g(5),
        })
    );
    // Without the part the same text is fine: the jump is invisible.
    assert!(plan(&code, 0).is_ok());
}

#[test]
fn an_address_inside_the_region_taken_as_a_value_is_refused() {
    // lea func+0x1(%rip),%rax
    let code = prologue_then(|a| a.rel32(&[0x48, 0x8d, 0x05], FUNC + 1).b(&[0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::AddressTaken {
            at: g(5),
            target: g(1),
            start: g(0),
            end: g(5),
        })
    );
    // push $func+0x4 (an imm32, sign-extended to the kernel address), as sync_core's iret did
    let imm = ((FUNC + 4) as u32).to_le_bytes();
    let code = prologue_then(|a| a.b(&[0x68]).b(&imm).b(&[0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::AddressTaken {
            at: g(5),
            target: g(4),
            start: g(0),
            end: g(5),
        })
    );
    // The function's own address (its first byte) is taken all the time: fine.
    let code = prologue_then(|a| a.rel32(&[0x48, 0x8d, 0x05], FUNC).b(&[0xc3]).pad_to(0x10));
    assert!(plan(&code, 0).is_ok());
}

#[test]
fn an_exception_table_entry_in_the_function_refuses_all_of_it() {
    let code = prologue();
    // The mov from DATA at +0x9 may fault; the probe at +0 is far from it.
    let facts = Facts::with_ex_table(&[(FUNC + 9, ELSEWHERE), (ELSEWHERE + 0x10, ELSEWHERE + 0x20)]);
    assert_eq!(
        plan_region(g(0), &function(&code), &facts.view(), &[]),
        Err(NotOptimizable::ExceptionTableEntry { insn: g(9) })
    );
    // An entry in a split part refuses the function too.
    let cold = Asm::at(COLD).b(&[0x8b, 0x07, 0xc3]).pad_to(0x8).done();
    let parts = [Code {
        start: Gva(COLD),
        bytes: &cold,
    }];
    let facts = Facts::with_ex_table(&[(COLD, ELSEWHERE)]);
    let text = FunctionText {
        split_parts: &parts,
        ..function(&code)
    };
    assert_eq!(
        plan_region(g(0), &text, &facts.view(), &[]),
        Err(NotOptimizable::ExceptionTableEntry { insn: Gva(COLD) })
    );
    // Entries of other functions are none of its business...
    let facts = Facts::with_ex_table(&[(ELSEWHERE, ELSEWHERE + 0x20)]);
    assert!(plan_region(g(0), &function(&code), &facts.view(), &[]).is_ok());
    // ...unless their fixup resumes inside the region.
    let facts = Facts::with_ex_table(&[(ELSEWHERE, FUNC + 1)]);
    assert_eq!(
        plan_region(g(0), &function(&code), &facts.view(), &[]),
        Err(NotOptimizable::FixupIntoRegion {
            insn: Gva(ELSEWHERE),
            fixup: g(1),
            start: g(0),
            end: g(5),
        })
    );
}

#[test]
fn a_call_in_the_region_is_refused() {
    // push %rbp; call elsewhere; ...
    let code = Asm::new()
        .b(&[0x55])
        .rel32(&[0xe8], ELSEWHERE)
        .b(&[0x5d, 0xc3])
        .pad_to(0x10)
        .done();
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::NotDisplaceable {
            at: g(1),
            insn: "call 0FFFFFFFF81002000h".into(),
            why: Undisplaceable::Call,
        })
    );
    // An indirect call is fine elsewhere in the function but not in the region.
    let code = prologue_then(|a| a.b(&[0xff, 0xd0, 0xc3]).pad_to(0x10));
    assert!(matches!(
        plan(&code, 1),
        Err(NotOptimizable::NotDisplaceable {
            why: Undisplaceable::Call,
            ..
        })
    ));
}

#[test]
fn int3_and_ud2_in_the_region_are_refused() {
    // push %rbp; int3; mov %rsp,%rbp; ...: a breakpoint inside the region
    let code = Asm::new()
        .b(&[0x55, 0xcc, 0x48, 0x89, 0xe5, 0x5d, 0xc3])
        .pad_to(0x10)
        .done();
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::NotDisplaceable {
            at: g(1),
            insn: "int3".into(),
            why: Undisplaceable::Trap,
        })
    );
    // push %rbp; ud2 (a BUG()); ...
    let code = Asm::new()
        .b(&[0x55, 0x0f, 0x0b, 0x48, 0x89, 0xe5, 0xc3])
        .pad_to(0x10)
        .done();
    assert_eq!(
        plan(&code, 0),
        Err(NotOptimizable::NotDisplaceable {
            at: g(1),
            insn: "ud2".into(),
            why: Undisplaceable::Trap,
        })
    );
}

#[test]
fn someone_elses_int3_elsewhere_in_the_function_is_refused() {
    // ...; pop %rbx; int3 (over the first byte of `mov %rbp,%rsp`'s 48 89 ec); ...
    let code = prologue_then(|a| a.b(&[0x5b, 0xcc, 0x89, 0xec, 0x5d, 0xc3]).pad_to(0x10));
    assert_eq!(plan(&code, 0), Err(NotOptimizable::ForeignBreakpoint { at: g(6) }));
    // At a function's entry, where calls arrive, too (planning a region further on).
    let code = Asm::new()
        .b(&[0xcc, 0x48, 0x89, 0xe5, 0x53, 0x5b, 0x5d, 0xc3])
        .pad_to(0x10)
        .done();
    assert_eq!(plan(&code, 1), Err(NotOptimizable::ForeignBreakpoint { at: g(0) }));
}

#[test]
fn a_region_overlapping_a_patch_site_is_refused() {
    let code = prologue();
    for kind in [PatchSiteKind::JumpLabel, PatchSiteKind::StaticCall] {
        let facts = Facts::with_sites(vec![PatchSite {
            range: g(4)..g(9),
            kind,
        }]);
        assert_eq!(
            plan_region(g(0), &function(&code), &facts.view(), &[]),
            Err(NotOptimizable::OverlapsPatchSite {
                start: g(0),
                end: g(5),
                site: g(4),
                kind,
            })
        );
        // The region +0x9..+0x10 is clear of it.
        assert!(plan_region(g(9), &function(&code), &facts.view(), &[]).is_ok());
    }
}

#[test]
fn the_ftrace_nop_is_never_displaced_and_a_probe_moved_past_it_is_planned() {
    // nopl 0x0(%rax,%rax,1) (the ftrace site), then the prologue.
    let code = Asm::new()
        .b(&FTRACE_NOP)
        .b(&[0x55, 0x48, 0x89, 0xe5, 0x53, 0x5b, 0x5d, 0xc3])
        .pad_to(0x10)
        .done();
    let text = FunctionText {
        ftrace_site: Some(g(0)),
        ..function(&code)
    };
    let facts = Facts::none();
    assert_eq!(
        plan_region(g(0), &text, &facts.view(), &[]),
        Err(NotOptimizable::OverlapsFtraceSite {
            start: g(0),
            end: g(5),
            site: g(0),
        })
    );
    // Where placement puts a probe aimed at +0: the next instruction.
    let region = plan_region(g(5), &text, &facts.view(), &[]).unwrap();
    assert_eq!((region.start(), region.end()), (g(5), g(10)));

    // With an endbr64 first, a region from +0 would take both: the endbr64 refuses it.
    let code = Asm::new()
        .b(&[0xf3, 0x0f, 0x1e, 0xfa])
        .b(&FTRACE_NOP)
        .b(&[0x55, 0x48, 0x89, 0xe5, 0x53, 0x5b, 0x5d, 0xc3])
        .pad_to(0x18)
        .done();
    let text = FunctionText {
        ftrace_site: Some(g(4)),
        ..function(&code)
    };
    assert!(matches!(
        plan_region(g(0), &text, &facts.view(), &[]),
        Err(NotOptimizable::NotDisplaceable {
            why: Undisplaceable::Endbr,
            ..
        })
    ));
    assert!(plan_region(g(9), &text, &facts.view(), &[]).is_ok());
}

const FTRACE_NOP: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

#[test]
fn another_probe_strictly_inside_the_region_blocks_it_for_now() {
    let code = prologue();
    let facts = Facts::none();
    let err = plan_region(g(0), &function(&code), &facts.view(), &[g(0x10), g(4)]).unwrap_err();
    assert_eq!(
        err,
        NotOptimizable::ProbeInsideRegion {
            probe: g(4),
            start: g(0),
            end: g(5),
        }
    );
    assert!(err.is_temporary());
    // At the probe's own address it shares the site; at the region's end it is outside.
    assert!(plan_region(g(0), &function(&code), &facts.view(), &[g(0), g(5)]).is_ok());
}

#[test]
fn text_that_does_not_decode_is_refused() {
    // push %rbp; mov %rsp,%rbp; push %rbx; ...; 06 (push %es, invalid in 64-bit mode)
    let code = prologue_then(|a| a.b(&[0x5b, 0x06, 0x5d, 0xc3]).pad_to(0x10));
    match plan(&code, 0) {
        Err(NotOptimizable::Undecodable(InsnError::Undecodable { addr, .. })) => assert_eq!(addr, g(6)),
        other => panic!("{other:?}"),
    }
    // A function whose last instruction is cut short by its size.
    let code = prologue_then(|a| a.b(&[0x5b, 0x5d, 0x48, 0x8b]));
    match plan(&code, 0) {
        Err(NotOptimizable::Undecodable(InsnError::Truncated { addr, available, .. })) => {
            assert_eq!((addr, available), (g(7), 2));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn addresses_outside_the_function_or_inside_an_instruction_are_refused() {
    let code = prologue();
    assert_eq!(
        plan(&code, 0x20),
        Err(NotOptimizable::NotInFunction {
            at: g(0x20),
            function: g(0)..g(0x20),
        })
    );
    assert_eq!(
        plan(&code, 2),
        Err(NotOptimizable::NotInstructionBoundary { at: g(2), insn: g(1) })
    );
}

/// Plans a region made of `insn` followed by NOPs and a ret.
fn plan_one(insn: &[u8]) -> Result<DetourRegion, NotOptimizable> {
    let code = Asm::new().b(insn).b(&[0x90; 5]).b(&[0xc3]).pad_to(0x20).done();
    plan(&code, 0)
}

#[test]
fn instructions_are_displaced_only_as_linuxs_can_boost_allows_and_relative_branches_too() {
    use Undisplaceable::*;
    let not_boostable = |opcode: &str| Some(NotBoostable { opcode: opcode.into() });
    let cases: Vec<(&str, Vec<u8>, Option<Undisplaceable>)> = vec![
        // allowed
        ("mov (%rdi),%eax", vec![0x8b, 0x07], None),
        ("lock cmpxchg %rdx,(%rdi)", vec![0xf0, 0x48, 0x0f, 0xb1, 0x17], None),
        ("rdtsc", vec![0x0f, 0x31], None),
        ("movzbl (%rdi),%eax", vec![0x0f, 0xb6, 0x07], None),
        ("cmove %rdx,%rax", vec![0x48, 0x0f, 0x44, 0xc2], None),
        (
            "nopw %cs:0x0(%rax,%rax,1)",
            vec![0x66, 0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0],
            None,
        ),
        (
            "mov %gs:0x28,%rax",
            vec![0x65, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0],
            None,
        ),
        ("pushf", vec![0x9c], None),
        ("cli", vec![0xfa], None),
        ("jne +0 (short)", vec![0x75, 0xfe], None),
        // refused
        ("call *%rax", vec![0xff, 0xd0], Some(Call)),
        ("int $3", vec![0xcd, 0x03], Some(Trap)),
        ("int1", vec![0xf1], Some(Trap)),
        ("jmp *%rax", vec![0xff, 0xe0], Some(IndirectJump)),
        ("syscall", vec![0x0f, 0x05], Some(FarOrPrivileged)),
        ("iretq", vec![0x48, 0xcf], Some(FarOrPrivileged)),
        ("lret", vec![0xcb], Some(FarOrPrivileged)),
        ("loop +0", vec![0xe2, 0xfe], Some(CountedBranch)),
        ("jrcxz +2", vec![0xe3, 0x00], Some(CountedBranch)),
        ("xbegin +6", vec![0xc7, 0xf8, 0, 0, 0, 0], Some(Transactional)),
        ("data16 jmp", vec![0x66, 0xe9, 0, 0, 0, 0], Some(BranchOperandSize)),
        (
            "addr32 mov (%edi),%eax",
            vec![0x67, 0x8b, 0x07],
            Some(AddressSizePrefix),
        ),
        ("cs mov (%rdi),%eax", vec![0x2e, 0x8b, 0x07], Some(CsPrefix)),
        ("endbr64", vec![0xf3, 0x0f, 0x1e, 0xfa], Some(Endbr)),
        ("sti", vec![0xfb], Some(InterruptShadow)),
        ("mov %eax,%ss", vec![0x8e, 0xd0], Some(InterruptShadow)),
        ("vzeroupper", vec![0xc5, 0xf8, 0x77], Some(VectorEncoding)),
        ("cpuid", vec![0x0f, 0xa2], not_boostable("0f a2")),
        ("clac", vec![0x0f, 0x01, 0xca], not_boostable("0f 01")),
        ("wrmsr", vec![0x0f, 0x30], not_boostable("0f 30")),
        ("lfence", vec![0x0f, 0xae, 0xe8], not_boostable("0f ae")),
        ("movups (%rdi),%xmm0", vec![0x0f, 0x10, 0x07], not_boostable("0f 10")),
        (
            "crc32q (%rdi),%rax",
            vec![0xf2, 0x48, 0x0f, 0x38, 0xf1, 0x07],
            not_boostable("0f 38 f1"),
        ),
        ("hlt", vec![0xf4], not_boostable("f4")),
        ("testb $1,(%rdi)", vec![0xf6, 0x07, 0x01], not_boostable("f6")),
        ("shl $3,%rax", vec![0x48, 0xc1, 0xe0, 0x03], not_boostable("c1")),
        ("fld1", vec![0xd9, 0xe8], not_boostable("d9")),
        ("incl (%rdi)", vec![0xff, 0x07], not_boostable("ff")),
        ("pushq (%rdi)", vec![0xff, 0x37], not_boostable("ff")),
    ];
    for (text, insn, expected) in cases {
        let result = plan_one(&insn);
        match expected {
            None => assert!(result.is_ok(), "{text}: {result:?}"),
            Some(why) => match result {
                Err(NotOptimizable::NotDisplaceable { at, why: found, .. }) => {
                    assert_eq!((at, found), (g(0), why), "{text}");
                }
                other => panic!("{text}: {other:?}"),
            },
        }
    }
}

// --- the probe's own conditions ---

#[test]
fn a_post_handler_or_a_disabled_probe_is_not_optimized_for_now() {
    let ok = ProbeConditions {
        has_post_handler: false,
        enabled: true,
    };
    assert_eq!(check_probe(ok), Ok(()));
    let post = check_probe(ProbeConditions {
        has_post_handler: true,
        ..ok
    })
    .unwrap_err();
    assert_eq!(post, NotOptimizable::HasPostHandler);
    let disabled = check_probe(ProbeConditions { enabled: false, ..ok }).unwrap_err();
    assert_eq!(disabled, NotOptimizable::Disabled);
    assert!(post.is_temporary() && disabled.is_temporary());
    assert!(!NotOptimizable::ExceptionTableEntry { insn: g(0) }.is_temporary());
}

#[test]
fn the_reasons_name_their_addresses() {
    let code = prologue_then(|a| a.rel8(0x75, FUNC + 1).b(&[0x5b, 0x5d, 0xc3]).pad_to(0x10));
    assert_eq!(
        plan(&code, 0).unwrap_err().to_string(),
        "the branch at 0xffffffff81000005 targets 0xffffffff81000001, inside the region \
         0xffffffff81000000..0xffffffff81000005 (only its first byte may be a branch target)"
    );
    let code = Asm::new()
        .b(&[0x55])
        .rel32(&[0xe8], ELSEWHERE)
        .b(&[0x5d, 0xc3])
        .pad_to(0x10)
        .done();
    assert_eq!(
        plan(&code, 0).unwrap_err().to_string(),
        "`call 0FFFFFFFF81002000h` at 0xffffffff81000001 cannot run displaced: a call: the callee would return \
         into the detour, which would then have to outlive every task sleeping below it"
    );
    let reason = NotOptimizable::JumpToThunk {
        at: g(7),
        thunk: Gva(THUNK),
    };
    assert!(reason.to_string().contains("0xffffffff81000007") && reason.to_string().contains("0xffffffff82000000"));
}

// --- thunks from the symbol table ---

#[test]
fn indirect_thunks_come_from_their_symbols_and_the_return_thunk_is_not_one() {
    let text = |name: &str, addr: u64| Symbol {
        name: name.into(),
        addr: Gva(addr),
        kind: 'T',
        size: None,
    };
    let symbols = SymbolTable::from_symbols(
        SymbolSource::SystemMap,
        vec![
            text("__x86_indirect_thunk_rax", THUNK),
            text("__x86_indirect_thunk_rbx", THUNK + 0x20),
            text("__x86_return_thunk", RETURN_THUNK),
            text("__x86_indirect_jump_thunk_rax", RETURN_THUNK + 0x40),
            text("after_the_thunks", RETURN_THUNK + 0x60),
        ],
    );
    let thunks = IndirectThunks::from_symbols(&symbols);
    // Without ELF sizes a thunk extends to the next symbol; adjacent thunks merge.
    assert_eq!(
        thunks.ranges(),
        [
            Gva(THUNK)..Gva(RETURN_THUNK),
            Gva(RETURN_THUNK + 0x40)..Gva(RETURN_THUNK + 0x60)
        ]
    );
    assert_eq!(thunks.containing(Gva(THUNK + 0x25)), Some(Gva(THUNK)));
    assert_eq!(thunks.containing(Gva(RETURN_THUNK)), None);
    assert_eq!(
        thunks.containing(Gva(RETURN_THUNK + 0x41)),
        Some(Gva(RETURN_THUNK + 0x40))
    );

    // The kernel's own markers around the thunk array count as one range.
    let symbols = SymbolTable::from_symbols(
        SymbolSource::SystemMap,
        vec![
            text("__indirect_thunk_start", THUNK),
            text("__indirect_thunk_end", THUNK + 0x200),
        ],
    );
    assert_eq!(
        IndirectThunks::from_symbols(&symbols).containing(Gva(THUNK + 0x1ff)),
        Some(Gva(THUNK))
    );
}

// --- relocation ---

#[test]
fn jump_bytes_encode_e9_rel32_within_reach_only() {
    let from = Gva(FUNC);
    let to = Gva(OOL);
    let bytes = jump_bytes(from, to).unwrap();
    assert_eq!(bytes[0], 0xe9);
    assert_eq!(
        i64::from(i32::from_le_bytes(bytes[1..].try_into().unwrap())),
        (OOL - FUNC - 5) as i64
    );
    // And back down.
    let back = jump_bytes(to, from).unwrap();
    let decoded = decode_at(&back, OOL);
    assert_eq!(decoded[0].near_branch_target(), FUNC);

    // The edges of reach, from low enough that the upper one does not wrap around.
    let from = Gva(0xffff_ffff_0000_0000);
    let next = from.0 + 5;
    assert!(jump_bytes(from, Gva(next + i32::MAX as u64)).is_some());
    assert_eq!(jump_bytes(from, Gva(next + i32::MAX as u64 + 1)), None);
    assert!(jump_bytes(from, Gva(next - (1 << 31))).is_some());
    assert_eq!(jump_bytes(from, Gva(next - (1 << 31) - 1)), None);
    assert_eq!(jump_bytes(from, Gva(FAR)), None);
}

#[test]
fn plain_instructions_are_copied_byte_for_byte_with_the_jump_back() {
    let code = prologue();
    let region = plan(&code, 0).unwrap();
    let out = relocate(&region, Gva(OOL), region.end()).unwrap();
    assert_eq!(&out[..5], &code[..5]);
    assert_eq!(out.len(), 10);
    assert_eq!(out[5..], jump_bytes(Gva(OOL + 5), g(5)).unwrap());
}

#[test]
fn a_rip_relative_mov_and_a_jcc_are_relocated_to_a_far_detour() {
    let code = rip_and_jcc();
    let region = plan(&code, 0).unwrap();
    assert_eq!(addrs(&region), [g(0), g(2), g(4)]);
    assert_eq!(region.end(), g(0xb));
    let out = relocate(&region, Gva(OOL), region.end()).unwrap();

    let decoded = decode_at(&out, OOL);
    let text: Vec<String> = decoded.iter().map(disassemble).collect();
    assert_eq!(decoded.len(), 4, "{text:?}");
    // test %edi,%edi: the same bytes.
    assert_eq!(&out[..2], &code[..2]);
    // je: now a near jcc, to the same absolute target.
    assert_eq!(decoded[1].mnemonic(), Mnemonic::Je);
    assert_eq!(decoded[1].len(), 6);
    assert_eq!(decoded[1].near_branch_target(), FUNC + 0x20);
    // mov DATA(%rip),%rax: the same data.
    assert!(decoded[2].is_ip_rel_memory_operand());
    assert_eq!(decoded[2].ip_rel_memory_address(), DATA);
    assert_eq!(&out[2 + 6..2 + 6 + 3], &code[4..7]);
    // The jump back, last.
    assert_eq!(decoded[3].mnemonic(), Mnemonic::Jmp);
    assert_eq!(decoded[3].len(), 5);
    assert_eq!(decoded[3].near_branch_target(), FUNC + 0xb);
    assert_eq!(decoded[3].next_ip(), OOL + out.len() as u64);
}

#[test]
fn a_branch_back_to_the_regions_start_goes_to_the_original_address() {
    // sub $1,%edi; jne +0: a loop whose head is the probe.
    let code = Asm::new()
        .b(&[0x83, 0xef, 0x01])
        .rel8(0x75, FUNC)
        .b(&[0x48, 0x89, 0xf8, 0xc3])
        .pad_to(0x10)
        .done();
    let region = plan(&code, 0).unwrap();
    let out = relocate(&region, Gva(OOL), region.end()).unwrap();
    let decoded = decode_at(&out, OOL);
    // Through the jump (and the probe) again, not to the copy at OOL.
    assert_eq!(decoded[1].near_branch_target(), FUNC);
    assert_eq!(decoded[2].near_branch_target(), FUNC + 5);
}

#[test]
fn a_jump_to_itself_at_the_probe_keeps_spinning_through_the_probe() {
    // jmp . (rel32): the whole region.
    let code = Asm::new().rel32(&[0xe9], FUNC).pad_to(0x8).done();
    let region = plan(&code, 0).unwrap();
    let out = relocate(&region, Gva(OOL), region.end()).unwrap();
    let decoded = decode_at(&out, OOL);
    assert_eq!(decoded[0].near_branch_target(), FUNC);
}

#[test]
fn a_relocated_instruction_that_does_not_match_its_original_is_caught() {
    let code = rip_and_jcc();
    let region = plan(&code, 0).unwrap();
    let [test, je, mov] = region.instructions() else {
        panic!("{region}")
    };
    let at = Gva(OOL);
    // Right: the same bytes; the same target from a near jcc; the same data.
    assert_eq!(verify(test, &[0x85, 0xff], at), Ok(()));
    let near_je = Asm::at(OOL).rel32(&[0x0f, 0x84], FUNC + 0x20).done();
    assert_eq!(verify(je, &near_je, at), Ok(()));
    let mov_data = Asm::at(OOL).rel32(&[0x48, 0x8b, 0x05], DATA).done();
    assert_eq!(verify(mov, &mov_data, at), Ok(()));
    // Wrong: other bytes, another target, other data, another instruction, trailing bytes.
    let wrong: [(&DisplacedInsn, Vec<u8>); 5] = [
        (test, vec![0x85, 0xf6]),
        (je, Asm::at(OOL).rel32(&[0x0f, 0x84], FUNC + 0x21).done()),
        (mov, Asm::at(OOL).rel32(&[0x48, 0x8b, 0x05], DATA + 8).done()),
        (je, Asm::at(OOL).rel32(&[0x0f, 0x85], FUNC + 0x20).done()),
        (test, vec![0x85, 0xff, 0x90]),
    ];
    for (insn, piece) in wrong {
        assert!(
            matches!(verify(insn, &piece, at), Err(NotOptimizable::RelocationMismatch { at: a, new_ip, .. }) if a == insn.addr && new_ip == at),
            "{piece:02x?}"
        );
    }
}

#[test]
fn targets_out_of_rel32_reach_of_the_detour_are_refused() {
    let code = rip_and_jcc();
    let region = plan(&code, 0).unwrap();
    // The je is the first relative instruction: test (2 bytes) is copied, the je at FAR+2 fails.
    assert_eq!(
        relocate(&region, Gva(FAR), region.end()),
        Err(NotOptimizable::BranchOutOfReach {
            at: g(2),
            target: g(0x20),
            new_ip: Gva(FAR + 2),
        })
    );
    let region = plan(&code, 4).unwrap();
    assert_eq!(
        relocate(&region, Gva(FAR), region.end()),
        Err(NotOptimizable::RipRelativeOutOfReach {
            at: g(4),
            target: Gva(DATA),
            new_ip: Gva(FAR),
        })
    );
    let code = prologue();
    let region = plan(&code, 0).unwrap();
    assert_eq!(
        relocate(&region, Gva(FAR), region.end()),
        Err(NotOptimizable::ReturnOutOfReach {
            from: Gva(FAR + 5),
            to: g(5),
        })
    );
}

proptest! {
    /// Wherever the detour is within reach, the relocated code decodes to the same
    /// instructions with the same absolute targets, then the jump back.
    #[test]
    fn relocation_keeps_every_absolute_target(delta in -(1i64 << 30)..(1i64 << 30)) {
        let code = rip_and_jcc();
        let region = plan(&code, 0).unwrap();
        let new_ip = OOL.wrapping_add_signed(delta);
        let out = relocate(&region, Gva(new_ip), region.end()).unwrap();
        let decoded = decode_at(&out, new_ip);
        prop_assert_eq!(decoded.len(), region.instructions().len() + 1);
        for (relocated, original) in decoded.iter().zip(region.instructions()) {
            prop_assert_eq!(relocated.mnemonic(), original.decoded.mnemonic());
            prop_assert_eq!(near_branch_target(relocated), near_branch_target(&original.decoded));
            if original.decoded.is_ip_rel_memory_operand() {
                prop_assert_eq!(relocated.ip_rel_memory_address(), original.decoded.ip_rel_memory_address());
            }
        }
        let back = decoded.last().unwrap();
        prop_assert_eq!((back.mnemonic(), back.near_branch_target()), (Mnemonic::Jmp, FUNC + 0xb));
        prop_assert_eq!(back.next_ip(), new_ip + out.len() as u64);
    }
}
