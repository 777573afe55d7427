use hvprobe_introspection::memory::SparseMemory;
use hvprobe_introspection::symbols::SymbolTable;

use super::*;
use crate::{parse_line, ProbeSpec};
use hvprobe_arch::pt_regs::Regs;

const STACK: u64 = 0xffff_c900_0001_3f00;
const DATA: u64 = 0xffff_8880_0400_0000;
const USER: u64 = 0x0000_7fff_ffff_e000;
const UNMAPPED: u64 = 0xffff_8880_dead_0000;

fn symbols() -> SymbolTable {
    SymbolTable::parse_system_map(
        "ffffffff81000000 T _text\n\
         ffffffff81234560 T do_sys_open\n\
         ffffffff81234636 T do_sys_openat2\n\
         ffffffff81234700 T _etext\n\
         ffffffff82000000 D jiffies\n\
         ffffffff82000010 D some_table\n\
         ffffffff82000100 D _end\n",
    )
    .expect("System.map parses")
}

struct World {
    regs: Regs,
    kernel: SparseMemory,
    user: SparseMemory,
    symbols: SymbolTable,
}

impl World {
    fn new() -> Self {
        let regs = Regs {
            rdi: 1,
            rsi: 2,
            rdx: 3,
            rcx: 4,
            r8: 5,
            r9: 6,
            rax: 0xffff_ffff_ffff_fff2,
            rsp: STACK,
            rip: 0xffff_ffff_8123_4561,
            ..Regs::default()
        };
        let mut kernel = SparseMemory::default();
        // The stack at a function entry: return address, then arguments 7 and 8.
        kernel.put_u64(STACK, 0xffff_ffff_8123_4600);
        kernel.put_u64(STACK + 8, 77);
        kernel.put_u64(STACK + 16, 88);
        kernel.put_u64(0xffff_ffff_8200_0000, 0x1_0000_2a00); // jiffies
        World {
            regs,
            kernel,
            user: SparseMemory::default(),
            symbols: symbols(),
        }
    }

    fn ctx(&self) -> FetchContext<'_> {
        FetchContext {
            regs: &self.regs,
            kernel: &self.kernel,
            user: Some(&self.user),
            symbols: &self.symbols,
            comm: Some("bash"),
            retval: None,
            entry: None,
        }
    }

    /// Evaluates the one fetch-arg `arg` of a kprobe (or, with `$retval`, a kretprobe).
    fn eval(&self, arg: &str) -> ArgValue {
        self.eval_with(arg, &self.ctx())
    }

    fn eval_with(&self, arg: &str, ctx: &FetchContext) -> ArgValue {
        evaluate(&parse_arg(arg), ctx)
    }

    fn show(&self, arg: &str) -> String {
        self.eval(arg).to_string()
    }
}

fn parse_arg(arg: &str) -> FetchArg {
    let kind = if arg.contains("$retval") { "r" } else { "p" };
    let line = format!("{kind}:g/e do_sys_open a={arg}");
    match parse_line(&line).expect("spec parses").expect("a probe") {
        ProbeSpec::Kprobe { mut args, .. }
        | ProbeSpec::Kretprobe { mut args, .. }
        | ProbeSpec::Watch { mut args, .. } => args.remove(0),
        ProbeSpec::Remove { .. } => unreachable!(),
    }
}

#[test]
fn unsigned_types_truncate_and_print_decimal() {
    let mut w = World::new();
    w.regs.rdi = 0xffff_ffff_ffff_ffff;
    assert_eq!(w.show("%di:u8"), "255");
    assert_eq!(w.show("%di:u16"), "65535");
    assert_eq!(w.show("%di:u32"), "4294967295");
    assert_eq!(w.show("%di:u64"), "18446744073709551615");
    w.regs.rdi = 0x1_0000_0102;
    assert_eq!(w.show("%di:u8"), "2");
    assert_eq!(w.show("%di:u16"), "258");
    assert_eq!(w.show("%di:u32"), "258");
    assert_eq!(w.eval("%di:u64"), ArgValue::Unsigned(0x1_0000_0102));
}

#[test]
fn signed_types_sign_extend_from_their_width() {
    let mut w = World::new();
    w.regs.rdi = 0x80;
    assert_eq!(w.show("%di:s8"), "-128");
    assert_eq!(w.show("%di:s16"), "128");
    w.regs.rdi = 0x7f;
    assert_eq!(w.show("%di:s8"), "127");
    w.regs.rdi = 0xffff;
    assert_eq!(w.show("%di:s16"), "-1");
    assert_eq!(w.show("%di:s32"), "65535");
    w.regs.rdi = 0x8000_0000;
    assert_eq!(w.show("%di:s32"), "-2147483648");
    w.regs.rdi = 0x8000_0000_0000_0000;
    assert_eq!(w.show("%di:s64"), "-9223372036854775808");
    assert_eq!(w.eval("%ax:s64"), ArgValue::Signed(-14));
}

#[test]
fn hex_types_are_0x_lowercase_without_zero_padding() {
    let mut w = World::new();
    w.regs.rdi = 0x12;
    assert_eq!(w.show("%di:x8"), "0x12");
    assert_eq!(w.show("%di:x16"), "0x12", "the kernel prints 0x%x: no padding");
    assert_eq!(w.show("%di:x32"), "0x12");
    assert_eq!(w.show("%di"), "0x12", "x64 is the default");
    w.regs.rdi = 0;
    assert_eq!(w.show("%di:x16"), "0x0");
    w.regs.rdi = 0xdead_beef_cafe_f00d;
    assert_eq!(w.show("%di:x8"), "0xd");
    assert_eq!(w.show("%di:x16"), "0xf00d");
    assert_eq!(w.show("%di:x32"), "0xcafef00d");
    assert_eq!(w.show("%di:x64"), "0xdeadbeefcafef00d");
}

#[test]
fn bitfields_extract_from_the_container_and_print_unsigned() {
    let mut w = World::new();
    w.regs.rdi = 0xb4; // 1011_0100
    assert_eq!(w.show("%di:b3@2/8"), "5");
    assert_eq!(w.show("%di:b1@7/8"), "1");
    assert_eq!(w.show("%di:b8@0/8"), "180");
    w.regs.rdi = 0xffff_ffff_ffff_ffff;
    assert_eq!(w.show("%di:b64@0/64"), "18446744073709551615");
    assert_eq!(w.show("%di:b1@63/64"), "1");
    // The container is read from memory with its own width.
    w.kernel.write(DATA, &[0x00, 0xf0, 0x0f, 0x00, 0xff]);
    w.regs.rsi = DATA;
    assert_eq!(w.show("+0(%si):b8@12/32"), "255");
    assert_eq!(w.show("+0(%si):b4@4/16"), "0");
    assert_eq!(w.show("+1(%si):b4@4/8"), "15");
}

#[test]
fn args_come_from_registers_then_the_stack() {
    let w = World::new();
    let shown: Vec<String> = (1..=8).map(|n| w.show(&format!("$arg{n}:u64"))).collect();
    assert_eq!(shown, ["1", "2", "3", "4", "5", "6", "77", "88"]);
    // Beyond what is mapped: a fault.
    let mut w = World::new();
    w.regs.rsp = UNMAPPED;
    assert_eq!(w.eval("$arg7"), ArgValue::Fault);
    assert_eq!(w.show("$arg6:u8"), "6");
}

#[test]
fn stack_retval_comm_and_immediates() {
    let w = World::new();
    assert_eq!(w.show("$stack"), format!("{STACK:#x}"));
    assert_eq!(w.show("$stack0"), "0xffffffff81234600");
    assert_eq!(w.show("$stack1:u32"), "77");
    assert_eq!(w.show("$stack2:s8"), "88");
    assert_eq!(w.show("$stack100"), "(fault)");
    // $retval: rax, unless the context has a return value.
    assert_eq!(w.show("$retval:s32"), "-14");
    let ctx = FetchContext {
        retval: Some(3),
        ..w.ctx()
    };
    assert_eq!(w.eval_with("$retval:u8", &ctx), ArgValue::Unsigned(3));
    assert_eq!(w.show("$comm"), "\"bash\"");
    let ctx = FetchContext { comm: None, ..w.ctx() };
    assert_eq!(w.eval_with("$comm", &ctx), ArgValue::Fault);
    assert_eq!(w.show("\\-1:s16"), "-1");
    assert_eq!(w.show("\\0x1234:u8"), "52");
    assert_eq!(w.show("\\42"), "0x2a");
    assert_eq!(w.show("%ip:x64"), "0xffffffff81234561");
}

#[test]
fn memory_at_addresses_and_symbols() {
    let w = World::new();
    assert_eq!(w.show("@0xffffffff82000000:u32"), "10752");
    assert_eq!(w.show("@0xffffffff82000000:u64"), "4294978048");
    assert_eq!(w.show("@jiffies:x64"), "0x100002a00");
    assert_eq!(w.show("@jiffies+4:u32"), "1");
    assert_eq!(w.show("@some_table-0xc:u8"), "1");
    assert_eq!(w.eval("@no_such_symbol"), ArgValue::Fault);
    assert_eq!(w.eval("@0xffff888000000000"), ArgValue::Fault);
}

#[test]
fn dereference_chains() {
    let mut w = World::new();
    // rdi -> struct { u64 pad; struct inner *p; }, inner at DATA + 0x100: { u32 a = 7; u32 b = -2 }
    w.regs.rdi = DATA;
    w.kernel.put_u64(DATA + 8, DATA + 0x100);
    w.kernel.write(DATA + 0x100, &7u32.to_le_bytes());
    w.kernel.write(DATA + 0x104, &(-2i32).to_le_bytes());
    assert_eq!(w.show("+8(%di)"), format!("{:#x}", DATA + 0x100));
    assert_eq!(w.show("+0(+8(%di)):u32"), "7");
    assert_eq!(w.show("+4(+8(%di)):s32"), "-2");
    // The final read is only as wide as the type: a u8 just before unmapped memory works.
    w.kernel.write(DATA + 0xfff, &[0x5a]);
    assert_eq!(w.show("+0xfff(%di):u8"), "90");
    assert_eq!(w.show("+0xfff(%di):u16"), "(fault)");
    // Negative offsets (container_of-style).
    w.regs.rsi = DATA + 0x108;
    assert_eq!(w.show("-8(%si):u32"), "7");
    // A fault in the middle of the chain faults the argument.
    w.kernel.put_u64(DATA + 16, UNMAPPED);
    assert_eq!(w.eval("+0(+0(+16(%di))):u32"), ArgValue::Fault);
    // Three levels through the stack.
    w.kernel.put_u64(STACK + 24, DATA);
    assert_eq!(w.show("+0(+8(+24($stack))):u32"), "7");
    // $argN as a base.
    w.regs.rdx = DATA + 0x100;
    assert_eq!(w.show("+4($arg3):s32"), "-2");
}

#[test]
fn user_and_kernel_address_spaces_are_kept_apart() {
    let mut w = World::new();
    w.user.write(USER, &0x1234_5678u32.to_le_bytes());
    w.kernel.write(USER, &0xaaaa_aaaau32.to_le_bytes()); // would be wrong to read
    w.regs.rsi = USER;
    assert_eq!(w.show("+u0(%si):x32"), "0x12345678");
    assert_eq!(w.show("+0(%si):x32"), "(fault)", "kernel reads of user addresses fault");
    w.regs.rsi = DATA;
    w.user.write(DATA, &[1]);
    assert_eq!(w.show("+u0(%si):u8"), "(fault)", "user reads of kernel addresses fault");
    w.regs.rsi = USER;
    let ctx = FetchContext { user: None, ..w.ctx() };
    assert_eq!(w.eval_with("+u0(%si):u32", &ctx), ArgValue::Fault);
}

#[test]
fn strings_are_read_up_to_the_nul() {
    let mut w = World::new();
    w.kernel.write(DATA, b"hello\0world\0");
    w.regs.rdi = DATA;
    assert_eq!(w.eval("+0(%di):string"), ArgValue::String(b"hello".to_vec()));
    assert_eq!(w.show("+0(%di):string"), "\"hello\"");
    assert_eq!(w.show("+6(%di):string"), "\"world\"");
    assert_eq!(w.show("+5(%di):string"), "\"\"");
    assert_eq!(w.show("@0xffff888004000000:string"), "\"hello\"");
    assert_eq!(w.show("\\0xffff888004000006:string"), "\"world\"");
    // The string type reads at the location, it does not dereference it once more.
    w.kernel.put_u64(DATA + 0x200, DATA);
    w.regs.rsi = DATA + 0x200;
    assert_eq!(w.show("+0(+0(%si)):string"), "\"hello\"");
}

#[test]
fn strings_with_non_printable_and_invalid_bytes_are_escaped() {
    let mut w = World::new();
    w.kernel.write(DATA, b"a\x01b\tc\n\x7f\xff\xc3\xa9z\0");
    w.regs.rdi = DATA;
    let value = w.eval("+0(%di):string");
    assert_eq!(value, ArgValue::String(b"a\x01b\tc\n\x7f\xff\xc3\xa9z".to_vec()));
    assert_eq!(value.to_string(), "\"a\\x01b\\x09c\\x0a\\x7f\\xff\u{e9}z\"");
    assert_eq!(value.to_json(), serde_json::json!("a\u{1}b\tc\n\u{7f}\\xff\u{e9}z"));
}

#[test]
fn strings_without_nul_are_cut_or_fault() {
    let mut w = World::new();
    // 5000 bytes without a NUL: the kernel keeps MAX_STRING_SIZE - 1 of them.
    w.kernel.write(DATA, &[b'x'; 5000]);
    w.regs.rdi = DATA;
    let ArgValue::String(s) = w.eval("+0(%di):string") else {
        panic!("a string");
    };
    assert_eq!(s.len(), MAX_STRING_SIZE - 1);
    // Running into an unmapped page before the NUL: the whole string faults.
    let end_of_mapping = DATA + 0x2000 - 3;
    w.kernel.write(end_of_mapping, b"abc");
    w.regs.rdi = end_of_mapping;
    assert_eq!(w.eval("+0(%di):string"), ArgValue::Fault);
    assert_eq!(w.show("+0(%di):string"), "(fault)");
    // Across two mapped pages it is fine.
    w.kernel.write(DATA + 0xffe, b"page\0");
    w.regs.rdi = DATA + 0xffe;
    assert_eq!(w.show("+0(%di):string"), "\"page\"");
    // Unmapped from the start.
    w.regs.rdi = UNMAPPED;
    assert_eq!(w.show("+0(%di):string"), "(fault)");
}

#[test]
fn ustring_and_user_deref_strings_read_user_memory() {
    let mut w = World::new();
    w.user.write(USER + 0x10, b"/etc/passwd\0");
    w.regs.rsi = USER + 0x10;
    assert_eq!(w.show("+0(%si):ustring"), "\"/etc/passwd\"");
    assert_eq!(w.show("+u0(%si):string"), "\"/etc/passwd\"");
    assert_eq!(w.show("+0(%si):string"), "(fault)");
    let ctx = FetchContext { user: None, ..w.ctx() };
    assert_eq!(w.eval_with("+0(%si):ustring", &ctx), ArgValue::Fault);
}

#[test]
fn numeric_arrays_fault_per_element() {
    let mut w = World::new();
    w.kernel.write(DATA, &[1, 0, 2, 0, 0xff, 0xff]);
    w.regs.rdi = DATA;
    assert_eq!(w.show("+0(%di):x16[3]"), "{0x1,0x2,0xffff}");
    assert_eq!(w.show("+0(%di):s16[3]"), "{1,2,-1}");
    assert_eq!(w.show("+0(%di):u8[1]"), "{1}");
    let edge = DATA + 0x1ffd;
    w.kernel.write(edge, &[7, 8, 9]);
    w.regs.rdi = edge;
    assert_eq!(w.show("+0(%di):u8[4]"), "{7,8,9,(fault)}");
    assert_eq!(w.show("+0(%di):u16[2]"), "{2055,(fault)}");
    // The base itself faults: every element does.
    w.regs.rdi = UNMAPPED;
    assert_eq!(w.show("+0(+0(%di)):u32[2]"), "{(fault),(fault)}");
    let value = w.eval("+0(+0(%di)):u32[2]");
    assert!(value.is_fault());
    assert_eq!(value.to_json(), serde_json::json!([null, null]));
}

#[test]
fn string_arrays_are_arrays_of_pointers() {
    let mut w = World::new();
    w.kernel.write(DATA + 0x100, b"first\0second\0");
    w.kernel.put_u64(DATA, DATA + 0x100);
    w.kernel.put_u64(DATA + 8, DATA + 0x106);
    w.kernel.put_u64(DATA + 16, UNMAPPED);
    w.regs.rdi = DATA;
    assert_eq!(w.show("+0(%di):string[2]"), "{\"first\",\"second\"}");
    assert_eq!(w.show("+0(%di):string[3]"), "{\"first\",\"second\",(fault)}");
    assert_eq!(
        w.eval("+0(%di):string[3]").to_json(),
        serde_json::json!(["first", "second", null])
    );
}

#[test]
fn symbols_print_as_percent_ps() {
    let mut w = World::new();
    w.regs.rdi = 0xffff_ffff_8123_4570;
    assert_eq!(w.show("%di:symbol"), "do_sys_open+0x10/0xd6");
    w.regs.rdi = 0xffff_ffff_8123_4560;
    assert_eq!(w.show("%di:symbol"), "do_sys_open+0x0/0xd6");
    assert_eq!(w.show("%di:symstr"), "\"do_sys_open+0x0/0xd6\"");
    w.regs.rdi = 0x10;
    assert_eq!(w.show("%di:symbol"), "0x10");
    assert_eq!(w.show("%di:symstr"), "\"0x10\"");
    w.regs.rdi = 0;
    assert_eq!(w.show("%di:symbol"), "0x0");
    // From memory: the 8-byte word there.
    w.kernel.put_u64(DATA, 0xffff_ffff_8200_0014);
    w.regs.rsi = DATA;
    assert_eq!(w.show("+0(%si):symbol"), "some_table+0x4/0xf0");
    assert_eq!(w.show("+0(%si):symstr"), "\"some_table+0x4/0xf0\"");
    assert_eq!(w.show("$stack0:symbol"), "do_sys_open+0xa0/0xd6");
    assert_eq!(
        w.eval("%si:symbol"),
        ArgValue::Symbol {
            address: DATA,
            description: None
        }
    );
    w.regs.rsi = UNMAPPED;
    assert_eq!(w.show("+0(%si):symbol"), "(fault)");
}

#[test]
fn json_forms() {
    use serde_json::json;
    assert_eq!(ArgValue::Unsigned(u64::MAX).to_json(), json!(u64::MAX));
    assert_eq!(ArgValue::Signed(-128).to_json(), json!(-128));
    assert_eq!(ArgValue::Hex(0x12).to_json(), json!("0x12"));
    assert_eq!(
        ArgValue::Symbol {
            address: 1,
            description: Some("f+0x1/0x2".into())
        }
        .to_json(),
        json!("f+0x1/0x2")
    );
    assert_eq!(ArgValue::String(b"a\"b".to_vec()).to_json(), json!("a\"b"));
    assert_eq!(ArgValue::Fault.to_json(), json!(null));
    assert_eq!(
        ArgValue::Array(vec![ArgValue::Hex(1), ArgValue::Fault]).to_json(),
        json!(["0x1", null])
    );
    assert_eq!(ArgValue::Array(vec![]).to_string(), "{}");
    assert!(!ArgValue::Array(vec![]).is_fault());
}

/// `char` (Linux 6.6+) is one byte shown as Linux's `'%c'`; arrays of them as `{'a','b'}`.
#[test]
fn chars_are_one_byte_shown_in_quotes() {
    let mut w = World::new();
    w.regs.rdi = 0xffff_8880_0000_1000;
    w.kernel.write(0xffff_8880_0000_1000, b"hi\x07");
    assert_eq!(w.eval("+0(%di):char"), ArgValue::Char(b'h'));
    assert_eq!(w.show("+0(%di):char[3]"), "{'h','i','\\x07'}");
    assert_eq!(w.show("%di:char"), "'\\x00'");
    assert_eq!(ArgValue::Char(b'x').to_json(), serde_json::json!("x"));
}

/// `\"TEXT"` is the text itself, as a string (Linux's immediate string).
#[test]
fn immediate_strings_are_their_text() {
    let w = World::new();
    assert_eq!(w.show("\\\"hello\""), "\"hello\"");
    // Shown as Linux shows it: between quotes, its own quotes as they are.
    assert_eq!(w.show("\\\"a\"b\":string"), "\"a\"b\"");
}
