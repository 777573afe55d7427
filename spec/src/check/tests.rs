use hvprobe_introspection::memory::MemoryError;
use hvprobe_introspection::symbols::SymbolSource;

use super::*;
use crate::conformance::caret;
use crate::{parse_line, LinuxError, Register};

/// Builds a BTF blob by hand: the introspection crate's builder, and the shapes these
/// tests use.
struct Builder(hvprobe_introspection::btf::builder::Builder);

impl std::ops::Deref for Builder {
    type Target = hvprobe_introspection::btf::builder::Builder;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Builder {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Builder {
    fn new() -> Builder {
        Builder(hvprobe_introspection::btf::builder::Builder::new())
    }

    fn ptr(&mut self, to: TypeId) -> TypeId {
        self.raw("", 2, false, 0, to, &[])
    }

    fn typedef(&mut self, name: &str, to: TypeId) -> TypeId {
        self.raw(name, 8, false, 0, to, &[])
    }

    /// A struct with kind_flag set: (name, type, bit offset, bitfield width) members.
    fn strukt(&mut self, name: &str, size: u32, members: &[(&str, TypeId, u32, u32)]) -> TypeId {
        self.aggregate(4, name, size, true, members)
    }

    fn func(&mut self, name: &str, returns: TypeId, params: &[(&str, TypeId)]) -> TypeId {
        let mut tail = Vec::new();
        for &(n, t) in params {
            tail.extend([self.str(n), t]);
        }
        let proto = self.raw("", 13, false, params.len() as u32, returns, &tail);
        self.raw(name, 12, false, 1, proto, &[])
    }

    fn btf(&self) -> Btf {
        Btf::parse(&self.blob()).expect("the test BTF parses")
    }
}

/// A kernel of a few functions, as Linux's selftest expects: `vfs_read(struct file *file,
/// char *buf, size_t count, loff_t *pos)` returning `ssize_t`, and `kfree(const void *)`.
fn kernel_btf() -> Btf {
    let mut b = Builder::new();
    let int = b.int("int", 4, 32, true);
    let long = b.int("long", 8, 64, true);
    let ulong = b.int("unsigned long", 8, 64, false);
    let uint = b.int("unsigned int", 4, 32, false);
    let ch = b.int("char", 1, 8, false);
    let size_t = b.typedef("size_t", ulong);
    let ssize_t = b.typedef("ssize_t", long);
    let loff_t = b.typedef("loff_t", long);
    let inode = b.strukt("inode", 16, &[("i_ino", ulong, 0, 0), ("i_mode", uint, 64, 0)]);
    let inode_ptr = b.ptr(inode);
    let name_arr = b.raw("", 3, false, 0, 0, &[ch, int, 16]);
    let path = b.strukt("path", 24, &[("dummy", int, 0, 0), ("name", name_arr, 32, 0)]);
    let file = b.strukt(
        "file",
        96,
        &[
            ("f_flags", uint, 0, 0),
            ("f_mode", uint, 32, 3),
            ("f_wide", uint, 36, 0),
            ("f_path", path, 64, 0),
            ("f_pos", loff_t, 256 + 64, 0),
            ("f_inode", inode_ptr, 448, 0),
            ("f_count", int, 512, 0),
        ],
    );
    let file_ptr = b.ptr(file);
    let char_ptr = b.ptr(ch);
    let loff_ptr = b.ptr(loff_t);
    b.func(
        "vfs_read",
        ssize_t,
        &[
            ("file", file_ptr),
            ("buf", char_ptr),
            ("count", size_t),
            ("pos", loff_ptr),
        ],
    );
    let void_ptr = b.ptr(0);
    b.func("kfree", 0, &[("objp", void_ptr)]);
    b.func("noparams", int, &[]);
    // A parameter whose type is no type of this BTF.
    b.func("broken", int, &[("x", 999)]);
    b.btf()
}

fn symbol(name: &str, addr: u64, kind: char, size: u64) -> Symbol {
    Symbol {
        name: name.to_owned(),
        addr: Gva(addr),
        kind,
        size: Some(size),
    }
}

const VFS_READ: u64 = 0xffff_ffff_8100_0000;

fn kernel_symbols() -> SymbolTable {
    SymbolTable::from_symbols(
        SymbolSource::SystemMap,
        vec![
            symbol("vfs_read", VFS_READ, 'T', 0x40),
            symbol("kfree", VFS_READ + 0x40, 'T', 0x20),
            symbol("noparams", VFS_READ + 0x60, 'T', 0x20),
            symbol("broken", VFS_READ + 0xa0, 'T', 0x20),
            symbol("dup", VFS_READ + 0x80, 't', 0x10),
            symbol("dup", VFS_READ + 0x90, 't', 0x10),
            symbol("_sdata", 0xffff_ffff_8200_0000, 'D', 0),
            symbol("jiffies", 0xffff_ffff_8200_0040, 'D', 8),
        ],
    )
}

/// vfs_read's first instructions: endbr64, call __fentry__, push rbp, mov rbp,rsp.
struct Text;

const VFS_READ_CODE: [u8; 13] = [
    0xf3, 0x0f, 0x1e, 0xfa, 0xe8, 0x00, 0x00, 0x00, 0x00, 0x55, 0x48, 0x89, 0xe5,
];

impl GuestVirtRead for Text {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        if gva != Gva(VFS_READ) {
            return Err(MemoryError::Unmapped(gva));
        }
        buf.fill(0x90);
        let n = buf.len().min(VFS_READ_CODE.len());
        buf[..n].copy_from_slice(&VFS_READ_CODE[..n]);
        Ok(())
    }
}

fn check(line: &str, btf: BtfKnowledge) -> Result<ProbeSpec, SpecError> {
    let symbols = kernel_symbols();
    let spec = parse_line(line).expect("parses").expect("a probe");
    let kernel = Kernel {
        symbols: &symbols,
        text: Some(&Text),
        btf,
    };
    check_spec(line, 1, None, &spec, &kernel)
}

fn with_btf(line: &str) -> Result<ProbeSpec, SpecError> {
    let btf = kernel_btf();
    check(line, BtfKnowledge::Known(&btf))
}

fn args_of(spec: ProbeSpec) -> Vec<FetchArg> {
    match spec {
        ProbeSpec::Kprobe { args, .. } | ProbeSpec::Kretprobe { args, .. } | ProbeSpec::Watch { args, .. } => args,
        ProbeSpec::Remove { .. } => Vec::new(),
    }
}

/// What a case's kernel knows of BTF.
#[derive(Clone, Copy)]
enum Btfs {
    Known,
    Absent,
    Unknown,
}

/// The refused lines of Linux's selftest that need the kernel, and hvprobe's own for the
/// codes it has none for: code and caret column.
const KERNEL_REFUSED: &[(&str, Btfs, LinuxError)] = &[
    ("p ^non_exist_func", Btfs::Known, LinuxError::BAD_PROBE_ADDR),
    ("p ^vfs_read+3", Btfs::Known, LinuxError::BAD_INSN_BNDRY),
    ("p vfs_read ^hoge", Btfs::Known, LinuxError::NO_BTFARG),
    ("p kfree ^$arg10", Btfs::Known, LinuxError::NO_BTFARG),
    ("r kfree ^$retval", Btfs::Known, LinuxError::NO_RETVAL),
    ("p vfs_read ^$arg*", Btfs::Absent, LinuxError::NOSUP_BTFARG),
    // hvprobe's own: what Linux refuses when it registers the probe.
    ("p:b/x vfs_read ^@nosuchsymbol", Btfs::Unknown, LinuxError::BAD_MEM_ADDR),
    ("p:b/y vfs_read ^@_sdata*10", Btfs::Unknown, LinuxError::BAD_MEM_ADDR),
    (
        "p:b/y vfs_read +8(^@nosuch+8):u32",
        Btfs::Unknown,
        LinuxError::BAD_MEM_ADDR,
    ),
    ("p ^dup", Btfs::Unknown, LinuxError::NON_UNIQ_SYMBOL),
    ("p ^vfs_read+0x40", Btfs::Unknown, LinuxError::BAD_PROBE_ADDR),
    ("p vfs_read file->^f_nope", Btfs::Known, LinuxError::NO_BTF_FIELD),
    ("p vfs_read count->^x", Btfs::Known, LinuxError::NO_PTR_STRCT),
    ("p vfs_read ^count:string", Btfs::Known, LinuxError::BAD_TYPE4STR),
    ("p noparams ^$arg*", Btfs::Known, LinuxError::NO_BTF_ENTRY),
    ("p vfs_read count ^$arg*", Btfs::Known, LinuxError::USED_ARG_NAME),
    ("r kfree ^$retval->x", Btfs::Known, LinuxError::NO_RETVAL),
    ("p broken ^x", Btfs::Known, LinuxError::BAD_BTF_TID),
];

#[test]
fn the_refusals_that_need_the_kernel() {
    let btf = kernel_btf();
    for (marked, btfs, code) in KERNEL_REFUSED {
        let (line, column) = caret(marked);
        let knowledge = match btfs {
            Btfs::Known => BtfKnowledge::Known(&btf),
            Btfs::Absent => BtfKnowledge::Absent,
            Btfs::Unknown => BtfKnowledge::Unknown,
        };
        match check(&line, knowledge) {
            Err(e) => {
                assert_eq!(e.kind.linux_error(), Some(*code), "{marked:?}: {e}");
                assert_eq!(e.column, column, "{marked:?}: {e}");
            }
            Ok(spec) => panic!("{marked:?} accepted: {spec}"),
        }
    }
}

/// Every code of Linux's a kprobe_events line can hit has a line refused with it, checked
/// with its column (here, in the conformance tables, or for the two limits there).
#[test]
fn every_linux_code_has_a_refused_line() {
    use crate::conformance::{MORE_REFUSED, REFUSED};
    let limits = [LinuxError::TOO_MANY_ARGS, LinuxError::EVENT_TOO_BIG];
    for code in LinuxError::ALL {
        let tested = REFUSED.iter().chain(MORE_REFUSED).any(|(_, c)| *c == code)
            || KERNEL_REFUSED.iter().any(|(_, _, c)| *c == code)
            || limits.contains(&code);
        assert!(tested, "no refused line for {code:?}");
    }
}

#[test]
fn a_split_instruction_is_named_with_its_neighbours() {
    let e = with_btf("p vfs_read+3").unwrap_err();
    assert_eq!(
        e.to_string(),
        "1:3: vfs_read+0x3 is not an instruction boundary in vfs_read (instructions start at vfs_read+0x0 and \
         vfs_read+0x4)"
    );
}

#[test]
fn field_errors_point_at_the_field() {
    // `file->f_nope`: the column of `f_nope`.
    let e = with_btf("p vfs_read file->f_nope").unwrap_err();
    assert_eq!(e.kind.linux_error(), Some(LinuxError::NO_BTF_FIELD), "{e}");
    assert_eq!(e.column, 18, "{e}");
    let e = with_btf("p vfs_read x=file->f_inode->i_nope").unwrap_err();
    assert_eq!(e.column, 29, "{e}");
    let e = with_btf("p vfs_read count->x").unwrap_err();
    assert_eq!(e.column, 19, "{e}");
}

#[test]
fn what_the_kernel_has_is_accepted() {
    for line in [
        "p vfs_read+4 @jiffies @_sdata+8",
        "p vfs_read+9 %ax",
        "p vfs_read $arg1 $arg4",
        "r vfs_read $retval",
        "p 0x1000 %ax",
        "p:g/ vfs_* %ax",
    ] {
        let btf = kernel_btf();
        check(line, BtfKnowledge::Known(&btf)).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    }
    // Without the text, an offset's boundary waits for the running kernel.
    let symbols = kernel_symbols();
    let spec = parse_line("p vfs_read+3").unwrap().unwrap();
    let kernel = Kernel {
        symbols: &symbols,
        text: None,
        btf: BtfKnowledge::Unknown,
    };
    check_spec("p vfs_read+3", 1, None, &spec, &kernel).unwrap();
}

#[test]
fn all_args_become_the_parameters_by_name_typed_from_btf() {
    let args = args_of(with_btf("p vfs_read $arg*").unwrap());
    let shown: Vec<(String, FetchExpr, ArgType)> = args.into_iter().map(|a| (a.name, a.expr, a.ty)).collect();
    assert_eq!(
        shown,
        vec![
            ("file".into(), FetchExpr::Arg(1), ArgType::X64),
            ("buf".into(), FetchExpr::Arg(2), ArgType::X64),
            ("count".into(), FetchExpr::Arg(3), ArgType::U64),
            ("pos".into(), FetchExpr::Arg(4), ArgType::X64),
        ]
    );
    // Unresolved before the BTF is known: still `$arg*`.
    let spec = check("p vfs_read $arg*", BtfKnowledge::Unknown).unwrap();
    assert_eq!(spec.to_string(), "p:kprobes/p_vfs_read_0 vfs_read $arg*");
}

fn deref(offset: i64, base: FetchExpr) -> FetchExpr {
    FetchExpr::Deref {
        offset,
        user: false,
        base: Box::new(base),
    }
}

#[test]
fn fields_become_dereferences_at_their_offsets() {
    let args = args_of(
        with_btf("p vfs_read file->f_pos pos=file->f_inode->i_mode c=file->f_count:x32 $arg1->f_flags").unwrap(),
    );
    assert_eq!(
        (args[0].name.as_str(), &args[0].expr, args[0].ty),
        ("arg1", &deref(40, FetchExpr::Arg(1)), ArgType::S64)
    );
    assert_eq!(args[1].name, "pos");
    assert_eq!(args[1].expr, deref(8, deref(56, FetchExpr::Arg(1))));
    assert_eq!(args[1].ty, ArgType::U32);
    assert_eq!(
        (&args[2].expr, args[2].ty),
        (&deref(64, FetchExpr::Arg(1)), ArgType::X32)
    );
    assert_eq!(
        (&args[3].expr, args[3].ty),
        (&deref(0, FetchExpr::Arg(1)), ArgType::U32)
    );
}

#[test]
fn bitfields_and_dotted_members() {
    let args = args_of(with_btf("p vfs_read m=file->f_mode w=file->f_wide n=file->f_path.name:string").unwrap());
    // A 3-bit field at bit 32: read from byte 4, bits 0..3.
    assert_eq!(args[0].expr, deref(4, FetchExpr::Arg(1)));
    assert_eq!(
        args[0].ty,
        ArgType::Bitfield {
            width: 3,
            offset: 0,
            container_bits: 64
        }
    );
    // A whole u32 at bit 36: byte 4, from bit 4.
    assert_eq!(
        args[1].ty,
        ArgType::Bitfield {
            width: 32,
            offset: 4,
            container_bits: 64
        }
    );
    // A char array member is the string, in place.
    assert_eq!(
        (&args[2].expr, args[2].ty),
        (&deref(12, FetchExpr::Arg(1)), ArgType::String)
    );
}

#[test]
fn strings_through_char_pointers_only_when_asked() {
    let args = args_of(with_btf("p vfs_read buf buf2=buf:string buf3=buf:ustring").unwrap());
    assert_eq!((&args[0].expr, args[0].ty), (&FetchExpr::Arg(2), ArgType::X64));
    assert_eq!(
        (&args[1].expr, args[1].ty),
        (&deref(0, FetchExpr::Arg(2)), ArgType::String)
    );
    assert_eq!(
        (&args[2].expr, args[2].ty),
        (
            &FetchExpr::Deref {
                offset: 0,
                user: true,
                base: Box::new(FetchExpr::Arg(2))
            },
            ArgType::UString
        )
    );
}

#[test]
fn retval_fields_on_return_probes() {
    // ssize_t is no pointer: Linux's NO_PTR_STRCT.
    let e = with_btf("r vfs_read $retval->x").unwrap_err();
    assert_eq!(e.kind.linux_error(), Some(LinuxError::NO_PTR_STRCT), "{e}");
}

#[test]
fn resolved_specs_keep_their_other_args() {
    let args = args_of(with_btf("p vfs_read %di count @jiffies").unwrap());
    assert_eq!(args[0].expr, FetchExpr::Register(Register::Di));
    assert_eq!(args[1].expr, FetchExpr::Arg(3));
    assert_eq!(args[1].name, "count");
    assert!(!has_btf_args(&args));
}

#[test]
fn a_fetch_arg_symbol_is_found_through_dereferences() {
    let symbols = kernel_symbols();
    let args = args_of(parse_line("p f %ax @jiffies +0(+8(@nosuch-8)):u8").unwrap().unwrap());
    assert_eq!(unknown_fetch_symbol(&args, &symbols), Some((2, "nosuch")));
    assert_eq!(unknown_fetch_symbol(&args[..2], &symbols), None);
}

#[test]
fn an_unnamed_arg_n_is_the_parameter_when_btf_knows_it() {
    let args = args_of(with_btf("p vfs_read $arg3 $arg2:string a=$arg1").unwrap());
    assert_eq!(
        (args[0].name.as_str(), &args[0].expr, args[0].ty),
        ("count", &FetchExpr::Arg(3), ArgType::U64)
    );
    assert_eq!(
        (args[1].name.as_str(), &args[1].expr, args[1].ty),
        ("buf", &deref(0, FetchExpr::Arg(2)), ArgType::String)
    );
    // Named, it stays the register, untyped, as Linux keeps it.
    assert_eq!(
        (args[2].name.as_str(), &args[2].expr, args[2].ty),
        ("a", &FetchExpr::Arg(1), ArgType::X64)
    );
    // Without BTF, or without parameters in it: the register or stack slot, as before.
    let plain = args_of(check("p vfs_read $arg3", BtfKnowledge::Absent).unwrap());
    assert_eq!(
        (plain[0].name.as_str(), &plain[0].expr, plain[0].ty),
        ("arg1", &FetchExpr::Arg(3), ArgType::X64)
    );
    let btf = kernel_btf();
    let none = args_of(check("p noparams $arg7:u32", BtfKnowledge::Known(&btf)).unwrap());
    assert_eq!((&none[0].expr, none[0].ty), (&FetchExpr::Arg(7), ArgType::U32));
    // Then a string needs memory, as Linux says without BTF.
    let e = check("p vfs_read $arg2:string", BtfKnowledge::Absent).unwrap_err();
    assert_eq!(e.kind.linux_error(), Some(LinuxError::BAD_STRING), "{e}");
    assert_eq!(e.column, 18, "at the type: {e}");
}
