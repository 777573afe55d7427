use super::synthetic::{self, FUNCTIONS, MODULES_HEAD, MODULE_BASE, MODULE_STRIDE, STRUCT_MODULE, TEXT_SIZE};
use super::*;
use crate::btf::Btf;

fn layout() -> ModuleLayout {
    ModuleLayout::from_btf(&Btf::parse(&synthetic::btf()).unwrap()).unwrap()
}

fn budget() -> ModuleBudget {
    ModuleBudget::for_memory(1 << 30)
}

#[test]
fn reads_every_module_with_its_symbols_orc_and_blacklist() {
    let mem = synthetic::memory(&["alpha", "beta"]);
    let modules = read_modules(&mem, &layout(), Gva(MODULES_HEAD), &budget()).unwrap();
    assert_eq!(
        modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
        ["alpha", "beta"]
    );
    let beta = &modules[1];
    let base = MODULE_BASE + MODULE_STRIDE;
    assert_eq!(beta.address, Gva(base + STRUCT_MODULE));
    assert_eq!(beta.state, ModuleState::Live);
    assert_eq!(beta.core_text, Gva(base)..Gva(base + TEXT_SIZE));
    assert_eq!(beta.init_text, None);
    for (name, kind, off, size) in FUNCTIONS {
        let s = beta.symbols.lookup(name).unwrap();
        assert_eq!(
            (s.addr, s.kind, s.size),
            (Gva(base + off), char::from(*kind), Some(*size))
        );
    }
    let d = beta.symbols.describe(Gva(base + 0x45)).unwrap();
    assert_eq!((d.symbol.name.as_str(), d.offset), ("mod_fn_b", 5));
    assert!(beta.is_text(Gva(base + 0x45)));
    assert!(!beta.is_text(Gva(base + TEXT_SIZE)));
    let orc = beta.orc.as_ref().unwrap();
    assert_eq!(orc.len(), 2);
    assert_eq!(orc.find(Gva(base + 0x45)).unwrap().sp_offset, 8);
    // The blacklisted address is inside mod_fn_a: the whole function is off limits.
    assert_eq!(
        beta.blacklisted(Gva(base + 0x10)),
        Some(ModuleBlacklistReason::Nokprobe)
    );
    assert_eq!(
        beta.blacklisted(Gva(base + 0x2f)),
        Some(ModuleBlacklistReason::Nokprobe)
    );
    assert_eq!(beta.blacklisted(Gva(base + 0x40)), None);
    // Its jump table: one 16-byte entry.
    let jump = beta.jump_table.clone().unwrap();
    assert_eq!(jump.end.0 - jump.start.0, 16);
    assert_eq!(beta.static_call_table, None);
}

#[test]
fn an_empty_list_is_no_modules() {
    let mem = synthetic::memory(&[]);
    assert!(read_modules(&mem, &layout(), Gva(MODULES_HEAD), &budget())
        .unwrap()
        .is_empty());
}

#[test]
fn a_looping_list_is_refused_at_the_budget() {
    let mut mem = synthetic::memory(&["alpha", "beta"]);
    // beta's next points back at alpha: the walk never reaches the head.
    let alpha_node = MODULE_BASE + STRUCT_MODULE + 8;
    mem.put_u64(MODULE_BASE + MODULE_STRIDE + STRUCT_MODULE + 8, alpha_node);
    let err = read_modules(&mem, &layout(), Gva(MODULES_HEAD), &budget()).unwrap_err();
    assert!(matches!(err, ModuleError::TooManyModules { limit: 4096 }), "{err}");
}

#[test]
fn hostile_counts_are_refused_before_anything_is_allocated() {
    let m = MODULE_BASE + STRUCT_MODULE;
    // A symbol count of 4 billion.
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u32(MODULE_BASE + 0x2100 + 8, u32::MAX);
    let err = read_module(&mem, &layout(), Gva(m), &budget()).unwrap_err();
    assert!(
        matches!(
            err,
            ModuleError::OverBudget {
                what: "its symbol count",
                ..
            }
        ),
        "{err}"
    );
    // An ORC count of 4 billion.
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u32(m + 128, u32::MAX);
    let err = read_module(&mem, &layout(), Gva(m), &budget()).unwrap_err();
    assert!(
        matches!(
            err,
            ModuleError::OverBudget {
                what: "its ORC entry count",
                ..
            }
        ),
        "{err}"
    );
    // A blacklist of 4 billion.
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u32(m + 184, u32::MAX);
    let err = read_module(&mem, &layout(), Gva(m), &budget()).unwrap_err();
    assert!(
        matches!(
            err,
            ModuleError::OverBudget {
                what: "its kprobe blacklist",
                ..
            }
        ),
        "{err}"
    );
    // A core layout that wraps the address space.
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u64(m + 80, u64::MAX - 4);
    let err = read_module(&mem, &layout(), Gva(m), &budget()).unwrap_err();
    assert!(matches!(err, ModuleError::Wraps { .. }), "{err}");
    // Everything together over the VM's memory.
    let mem = synthetic::memory(&["alpha", "beta"]);
    let small = ModuleBudget {
        max_total_bytes: 200,
        ..budget()
    };
    let err = read_modules(&mem, &layout(), Gva(MODULES_HEAD), &small).unwrap_err();
    assert!(matches!(err, ModuleError::TotalOverBudget { limit: 200 }), "{err}");
}

#[test]
fn names_are_escaped_and_unterminated_ones_cut() {
    let m = MODULE_BASE + STRUCT_MODULE;
    let mut mem = synthetic::memory(&["alpha"]);
    mem.write(m + 24, b"ev\x1b[2Jil\n\0");
    let module = read_module(&mem, &layout(), Gva(m), &budget()).unwrap();
    assert_eq!(module.name, "ev\\x1b[2Jil\\x0a");
    mem.write(m + 24, &[b'a'; 56]);
    assert_eq!(
        read_module(&mem, &layout(), Gva(m), &budget()).unwrap().name,
        "a".repeat(56)
    );
    // A symbol name with no NUL within KSYM_NAME_LEN is skipped.
    mem.write(MODULE_BASE + 0x2300 + 1, &[b'x'; 600]);
    let module = read_module(&mem, &layout(), Gva(m), &budget()).unwrap();
    assert!(module.symbols.lookup("mod_fn_a").is_none());
    assert!(module.symbols.lookup("mod_fn_b").is_some() || module.symbols.len() <= 1);
}

#[test]
fn a_module_without_orc_or_kallsyms_reads_with_neither() {
    let m = MODULE_BASE + STRUCT_MODULE;
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u32(m + 128, 0);
    mem.put_u64(m + 152, 0);
    let module = read_module(&mem, &layout(), Gva(m), &budget()).unwrap();
    assert!(module.orc.is_none());
    assert!(module.symbols.is_empty());
}

#[test]
fn unreadable_memory_names_the_module_and_what() {
    let m = MODULE_BASE + STRUCT_MODULE;
    let mut mem = synthetic::memory(&["alpha"]);
    mem.put_u64(MODULE_BASE + 0x2100, 0xffff_ffff_d000_0000); // symtab nowhere
    let err = read_module(&mem, &layout(), Gva(m), &budget()).unwrap_err();
    assert!(
        matches!(&err, ModuleError::Memory { module, what: "symbol table", .. } if module == "alpha"),
        "{err}"
    );
}

/// The budget counted the bytes read, not what they decode to. A
/// module with 2^18 symbols all naming one 511-byte string of unprintable bytes is 6.5 MiB
/// of guest memory; escaped (`\xNN`, 4 bytes a byte) and kept twice (the symbol and the
/// table's by-name key) it was ~1 GiB of host memory, for one module, and modules can
/// share one table. What the names decode to is charged before they are made.
#[test]
fn symbols_naming_one_long_unprintable_string_are_refused_by_what_they_decode_to() {
    const COUNT: u64 = 1 << 18;
    let symtab = MODULE_BASE + 0x100_0000;
    let typetab = symtab + COUNT * 24;
    let strtab = typetab + COUNT;
    let mut mem = synthetic::memory(&["alpha"]);
    let ks = MODULE_BASE + 0x2100;
    mem.put_u64(ks, symtab);
    mem.put_u32(ks + 8, COUNT as u32);
    mem.put_u64(ks + 16, strtab);
    mem.put_u64(ks + 24, typetab);
    let mut syms = vec![0u8; (COUNT * 24) as usize];
    for (i, sym) in syms.chunks_exact_mut(24).enumerate() {
        // Every name at strtab+1; distinct addresses, as a symbol table has.
        sym[0..4].copy_from_slice(&1u32.to_le_bytes());
        sym[8..16].copy_from_slice(&(MODULE_BASE + i as u64).to_le_bytes());
    }
    mem.write(symtab, &syms);
    mem.write(typetab, &vec![b't'; COUNT as usize]);
    let mut name = vec![0u8; 513];
    name[1..512].fill(0x01);
    mem.write(strtab, &name);
    let read = read_module(&mem, &layout(), Gva(MODULE_BASE + STRUCT_MODULE), &budget());
    let kept: usize = read
        .as_ref()
        .map_or(0, |m| m.symbols.symbols().iter().map(|s| s.name.len()).sum());
    assert_eq!(kept, 0, "{kept} bytes of names kept");
    let err = read.unwrap_err();
    assert!(
        matches!(&err, ModuleError::DecodedOverBudget { module, limit: 0x400_0000 } if module == "alpha"),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("module alpha: its decoded tables would take more than"),
        "{err}"
    );

    // Modules that share one table, each within its own budget: the read of the list as a
    // whole is over its own.
    let mut mem = synthetic::memory(&["alpha", "beta", "gamma"]);
    let one = read_module(&mem, &layout(), Gva(MODULE_BASE + STRUCT_MODULE), &budget())
        .unwrap()
        .decoded_bytes;
    for i in 1..3 {
        mem.put_u64(
            MODULE_BASE + i * MODULE_STRIDE + STRUCT_MODULE + 152,
            MODULE_BASE + 0x2100,
        );
    }
    let shared = ModuleBudget {
        max_decoded: one,
        max_total_decoded: 2 * one + one / 2,
        ..budget()
    };
    let err = read_modules(&mem, &layout(), Gva(MODULES_HEAD), &shared).unwrap_err();
    assert!(matches!(err, ModuleError::TotalDecodedOverBudget { .. }), "{err}");
    // What the budget is for a VM: a quarter of its memory, 256 MiB at most, 64 MiB a module.
    let small = ModuleBudget::for_memory(128 << 20);
    assert_eq!((small.max_decoded, small.max_total_decoded), (32 << 20, 32 << 20));
    let large = ModuleBudget::for_memory(16 << 30);
    assert_eq!((large.max_decoded, large.max_total_decoded), (64 << 20, 256 << 20));
}
