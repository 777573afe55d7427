#!/usr/bin/env python3
"""Writes the hand-made seed inputs under corpus/ (run from fuzz/)."""
import os
import struct

REGS = [0x1111_1111_0000_00A0, 0xFFFF_FFFF_FFFF_FFFF, 0x8000_0000_0000_0000, 0x7FFF_FFFF_FFFF_FFFF,
        0xFFFF_C900_0001_3F58, 0xFFFF_C900_0001_3F90, 0x0000_0000_0000_0051, 0x0000_0000_FFFF_FFFF,
        8, 0, 0x10, 0xF, 0x12, 0x13, 0x14, 0x80]
ADDR = 0xFFFF_FFFF_8123_4560
SLOT = 0xFFFF_FFFF_8200_1000

# (name, code bytes, flags byte: bit0 CF, 1 PF, 2 AF, 3 ZF, 4 SF, 5 OF)
INSNS = [
    ("push_rbp", "55", 0), ("pop_rbx", "5b", 0), ("mov_rbp_rsp", "48 89 e5", 0),
    ("mov_eax_ecx", "89 c8", 0), ("sub_rsp_imm8", "48 83 ec 20", 0), ("add_rax_imm32", "48 05 ff ff ff 7f", 0),
    ("sub_r12_imm32", "49 81 ec 00 00 00 80", 0x3f), ("xor_eax_eax", "31 c0", 0x11), ("xor_r9_r9", "4d 31 c9", 0),
    ("lea_rip", "48 8d 05 10 00 00 00", 0), ("lea_sib", "48 8d 44 cb 10", 0), ("nopl", "0f 1f 44 00 00", 0),
    ("endbr64", "f3 0f 1e fa", 0), ("xchg_ax_ax", "66 90", 0), ("jz_rel8", "74 10", 0x08),
    ("jle_rel32", "0f 8e 00 01 00 00", 0x20), ("jmp_rel8", "eb fe", 0), ("call_rel32", "e8 00 10 00 00", 0),
    ("ret", "c3", 0), ("ret_imm16", "c2 08 00", 0), ("loop", "e2 fe", 0), ("jrcxz", "e3 05", 0),
    ("cli", "fa", 0), ("mov_rip_rel", "48 8b 05 00 00 00 10", 0), ("rep_movsb", "f3 a4", 0),
    ("call_rax", "ff d0", 0), ("pushf", "9c", 0), ("int3", "cc", 0), ("ud2", "0f 0b", 0),
    ("invalid", "ce", 0), ("truncated", "48 8b", 0),
    ("prologue", "f3 0f 1e fa 55 48 89 e5 41 57 41 56 53 48 83 ec 18 31 c0 48 8b 1d 00 10 00 00 e8 00 00 00 00"
                 " 85 c0 74 05 48 83 c4 18 5b 41 5e 41 5f 5d c3", 0),
]

def insn_seed(code, flags):
    code = bytes.fromhex(code)
    out = bytes([len(code)]) + code + struct.pack("<QQBB", ADDR, SLOT, flags, 0x80)
    out += b"".join(struct.pack("<Q", r) for r in REGS)
    out += bytes(range(1, 33))
    return out

SPEC = [
    "p:mygrp/myevent do_sys_open+16 dfd=%ax filename=%dx flags=%cx mode=+4($stack)",
    "r:myretprobe do_sys_open $retval",
    "r8:g/e f+0 $retval:symstr +0($retval):string",
    "p:e f%return $retval:u8",
    "p do_sys_open $arg1 $arg2:s32 +0($arg2):string",
    "p 0xffffffff81000000 %ip %sp %flags %orig_ax",
    "p:g-1/e f+0x20 a=@jiffies b=@init_task+0x10:symbol c=@0x1000:x32[4]",
    "p:e f +0(+8(+16(%di))):b3@5/16 -u8(%si):ustring $comm $stack $stack12",
    "p:e f \\0x10 \\-5:s64 +0(\\123):x8",
    "-:g/e",
    "-:e",
    "# a comment\n\np:a/b vfs_read count=%dx:u64 # trailing\nr4096:a/c vfs_read $retval:x32\n-:a/b\n",
    "p:e f %rax",
    "p:e f x=+0(%di):string[3]",
    "p:e f\u00e9 %ax",
]

os.makedirs("corpus/insn", exist_ok=True)
os.makedirs("corpus/spec_parser", exist_ok=True)
for name, code, flags in INSNS:
    with open(f"corpus/insn/seed-{name}", "wb") as f:
        f.write(insn_seed(code, flags))
for i, line in enumerate(SPEC):
    with open(f"corpus/spec_parser/seed-{i:02}", "wb") as f:
        f.write(line.encode())

# guest_modules: patch records `[region u8] [offset u16 LE] [len u8] [bytes]` over the
# synthetic guest's three modules (regions: 0 the list head, 1/3/5 each module's core
# layout, 2/4/6 its struct module). They forge what reaches the decoded budget: many
# symbols all naming one long string of unprintable bytes (escaped four to one on the
# host), in one module (`seed-decoded-one`) or in a table the three share
# (`seed-decoded-shared`).
KALLSYMS, SYMTAB, STRTAB, TYPETAB = 0x2100, 0x3000, 0x3800, 0x3C00
M_KALLSYMS = 152


def patch(region, offset, data):
    out = b""
    for i in range(0, len(data), 255):
        chunk = data[i:i + 255]
        out += struct.pack("<BHB", region, offset + i, len(chunk)) + chunk
    return out


def decoded_seed(count, shared):
    base = 0xFFFF_FFFF_C000_0000  # synthetic::MODULE_BASE (alpha's core layout)
    out = patch(1, SYMTAB, b"".join(struct.pack("<IIQQ", 0, 0, base + 0x10 + i, 0) for i in range(count)))
    out += patch(1, STRTAB, b"\x01" * 250 + b"\x00")
    out += patch(1, TYPETAB, b"t" * count)
    out += patch(1, KALLSYMS, struct.pack("<QI4xQQ", base + SYMTAB, count, base + STRTAB, base + TYPETAB))
    if shared:
        for region in (4, 6):
            out += patch(region, M_KALLSYMS, struct.pack("<Q", base + KALLSYMS))
    return out


os.makedirs("corpus/guest_modules", exist_ok=True)
with open("corpus/guest_modules/seed-decoded-one", "wb") as f:
    f.write(decoded_seed(40, False))
with open("corpus/guest_modules/seed-decoded-shared", "wb") as f:
    f.write(decoded_seed(14, True))
