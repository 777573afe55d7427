//! The DWARF reader against a program gcc compiles here, whose facts C and the x86-64
//! calling convention fix independently of the reader: where each line is, which
//! parameter is in which register at the entry, the inlined calls, struct layouts.

use std::path::PathBuf;
use std::process::Command;

use hvprobe_introspection::dwarf::{DebugInfo, DwarfError, DwarfRegister, Location, TypeShape};
use hvprobe_introspection::symbols::SymbolTable;

const SOURCE: &str = "\
struct point { long x; struct { int y; unsigned flag:3; }; };
long counter;
static inline __attribute__((always_inline)) long twice(long v)
{
\treturn v * 2 + counter;
}
__attribute__((noinline)) long step(struct point *p, long n)
{
\tlong a = twice(p->x);
\tlong b = twice(n);
\tcounter += a;
\treturn a + b + p->y;
}
int main(void)
{
\tstruct point p = { 1, { 2, 1 } };
\treturn (int)step(&p, 3);
}
";

/// `SOURCE` compiled by gcc with `flags`, as an executable (the DWARF of an executable is
/// relocated; an object file's is not).
fn compiled(name: &str, flags: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvprobe-dwarf-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("t.c");
    std::fs::write(&source, SOURCE).unwrap();
    let out = dir.join("t");
    let status = Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .status()
        .expect("gcc (the tests compile a C program to read its DWARF)");
    assert!(status.success(), "gcc {flags:?} failed");
    out
}

#[test]
fn lines_parameters_inlined_calls_and_members_are_where_c_and_the_abi_put_them() {
    let path = compiled("o2", &["-g", "-O2"]);
    let debug = DebugInfo::open(&path).unwrap();
    let step = debug.functions_named("step", None).unwrap();
    assert_eq!(step.len(), 1);
    let step = &step[0];
    assert_eq!(step.decl_line, 7);
    assert!(
        step.decl_file.as_deref().unwrap().ends_with("/t.c"),
        "{:?}",
        step.decl_file
    );
    assert!(!step.inlined);

    // Lines 8..=12 are its body (`{` and four statements); each has code in it.
    let lines = debug.lines(step).unwrap();
    let numbers: Vec<u64> = lines.iter().map(|l| l.line).collect();
    for n in [9, 10, 11, 12] {
        assert!(numbers.contains(&n), "line {n} in {numbers:?}");
    }
    assert!(numbers.iter().all(|&n| (7..=13).contains(&n)), "{numbers:?}");
    assert!(lines.iter().all(|l| l.addresses.iter().all(|&a| step.contains(a))));

    // At the entry, the System V ABI puts the first two integer arguments in %rdi, %rsi.
    let at_entry = debug.variables_at(step, step.entry()).unwrap();
    let location = |name: &str| at_entry.iter().find(|v| v.name == name).unwrap().location.clone();
    assert_eq!(location("p"), Ok(Location::Register(DwarfRegister::Di)));
    assert_eq!(location("n"), Ok(Location::Register(DwarfRegister::Si)));
    assert!(
        at_entry.iter().all(|v| v.name != "v"),
        "twice's parameter is not step's"
    );

    // `twice` is called twice and always inlined: two instances inside step, no code of
    // its own.
    assert!(debug.functions_named("twice", None).unwrap().is_empty());
    let instances = debug.inlined_instances("twice").unwrap();
    assert_eq!(instances.len(), 2, "{instances:?}");
    assert!(instances
        .iter()
        .all(|i| i.inlined && step.contains(i.entry()) && i.decl_line == 3));

    // struct point: x at 0, the anonymous struct's y at 8 and its 3-bit flag after it.
    let p = at_entry.iter().find(|v| v.name == "p").unwrap();
    assert_eq!(debug.type_name(p.ty), "struct point*");
    let TypeShape::Pointer { pointee } = debug.shape(p.ty) else {
        panic!("p is a pointer")
    };
    assert_eq!(debug.member(pointee, "x").unwrap().offset, 0);
    assert_eq!(debug.member(pointee, "y").unwrap().offset, 8);
    let flag = debug.member(pointee, "flag").unwrap();
    assert_eq!((flag.offset, flag.bits.map(|(_, w)| w)), (12, Some(3)));
    assert!(debug.member(pointee, "nosuch").is_none());
    assert_eq!(
        debug.shape(debug.member(pointee, "y").unwrap().ty),
        TypeShape::Integer { size: 4, signed: true }
    );

    // `counter`, the file's global, is where the symbol table puts it.
    let globals = debug.unit_variables(step).unwrap();
    let counter = globals.iter().find(|v| v.name == "counter").expect("counter");
    assert!(counter.global);
    let symbols = SymbolTable::from_elf_file(&path).unwrap();
    assert_eq!(
        counter.location,
        Ok(Location::Memory(symbols.lookup("counter").unwrap().addr.0))
    );

    // `t.c:11` (`counter += a;`) is in step, and the file must match at a path component.
    let sites = debug.file_line("t.c", 11).unwrap();
    assert!(
        !sites.is_empty() && sites.iter().all(|&a| step.contains(a)),
        "{sites:?}"
    );
    assert!(debug.file_line("xt.c", 11).unwrap().is_empty());
}

#[test]
fn a_program_without_dwarf_is_refused_by_name() {
    let path = compiled("nodebug", &["-O2"]);
    let e = DebugInfo::open(&path).unwrap_err();
    assert!(matches!(e, DwarfError::NoDwarf { .. }), "{e}");
    assert!(e.to_string().contains("has no DWARF"), "{e}");
    let e = DebugInfo::open(path.with_file_name("missing")).unwrap_err();
    assert!(matches!(e, DwarfError::Io { .. }), "{e}");
}

/// A relocatable object (what a module's `.ko` is): its DWARF's addresses are relocations
/// against its sections, which the reader lays out; the object's own symbols name the
/// same places, so a line is `FUNC+OFF` of a symbol the loaded module has too.
#[test]
fn an_objects_dwarf_is_relocated_onto_its_own_symbols() {
    // Each function in a section of its own, as the kernel's modules have some (.init.text).
    let path = compiled("object", &["-g", "-O2", "-c", "-ffunction-sections"]);
    let debug = DebugInfo::open(&path).unwrap();
    let symbols = debug.object_symbols().expect("an object's symbols");
    for name in ["step", "main"] {
        let f = debug.functions_named(name, None).unwrap();
        assert_eq!(f.len(), 1, "{name}");
        assert_eq!(
            f[0].entry(),
            symbols.lookup(name).unwrap().addr.0,
            "{name}'s DWARF entry is its symbol"
        );
        assert!(symbols.lookup(name).unwrap().is_text());
    }
    let step = &debug.functions_named("step", None).unwrap()[0];
    let main = &debug.functions_named("main", None).unwrap()[0];
    assert!(
        !step.contains(main.entry()) && !main.contains(step.entry()),
        "two sections, apart"
    );
    let lines = debug.lines(step).unwrap();
    assert!(lines.iter().any(|l| l.line == 11), "{lines:?}");
    assert!(lines.iter().all(|l| l.addresses.iter().all(|&a| step.contains(a))));
    let sites = debug.file_line("t.c", 11).unwrap();
    assert!(
        !sites.is_empty() && sites.iter().all(|&a| step.contains(a)),
        "{sites:?}"
    );
    // The global's DW_OP_addr is relocated too.
    let globals = debug.unit_variables(step).unwrap();
    let counter = globals.iter().find(|v| v.name == "counter").expect("counter");
    assert_eq!(
        counter.location,
        Ok(Location::Memory(symbols.lookup("counter").unwrap().addr.0))
    );
    // A linked program has no object symbols: its own table has the addresses.
    let linked = DebugInfo::open(compiled("linked", &["-g", "-O2"])).unwrap();
    assert!(linked.object_symbols().is_none());
}
