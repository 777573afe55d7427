//! Where each vCPU was when a run was stopped from outside (a signal, a deadline, a
//! control stop) or ended on a vCPU's error: a guest that hangs says where it hung, as the
//! kernel's own `%pS` would name the place, whether its page tables map it, the bytes
//! there, and the exception KVM was delivering. On hardware KVM this names an L2 that
//! loops on an exception its L1's KVM keeps injecting (docs/known-issues.md).
//!
//! The guest's memory is read by [`hvprobe_introspection::place`]: one walk and 16 bytes
//! per vCPU. A vCPU in hvprobe's own code (a detour, an out-of-line copy) is named by the
//! probe engine, asked before the run's probes are removed ([`HvprobeCode`]).

use hvprobe_arch::Gva;
use hvprobe_introspection::place::{place, Code};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_live::live_memory;
use hvprobe_probes::output::escape_guest_text;
use hvprobe_vmm::{StopReason, VcpuAtStop};
use std::collections::BTreeMap;
use vm_memory::GuestMemoryMmap;

/// Whether a run that ended for `reason` gets the report: when the guest did not end it
/// itself, its vCPUs' places are the only account of what it was doing.
pub fn wanted(reason: &StopReason) -> bool {
    matches!(
        reason,
        StopReason::Signal(_)
            | StopReason::Stopped
            | StopReason::VcpuError { .. }
            | StopReason::HandlerPanicked { .. }
            | StopReason::ThreadPanicked { .. }
    )
}

/// What of hvprobe's own code in the guest each stopped vCPU's RIP is in, by RIP: taken
/// while the probe engine still knows it (before the run's probes are removed).
#[derive(Debug, Default)]
pub struct HvprobeCode(BTreeMap<u64, String>);

impl HvprobeCode {
    /// `name(RIP)` for each vCPU's RIP: the engine's name of what it keeps there, if anything.
    pub fn of(vcpus: &[VcpuAtStop], name: impl Fn(Gva) -> Option<String>) -> HvprobeCode {
        HvprobeCode(
            vcpus
                .iter()
                .filter_map(|v| Some((v.state.regs.rip, name(Gva(v.state.regs.rip))?)))
                .collect(),
        )
    }
}

/// One line per vCPU, each starting `hvprobe: vCPU N stopped`.
pub fn report(
    vcpus: &[VcpuAtStop],
    mem: &GuestMemoryMmap,
    symbols: Option<&SymbolTable>,
    ours: &HvprobeCode,
) -> String {
    vcpus
        .iter()
        .map(|v| format!("hvprobe: {}\n", describe(v, mem, symbols, ours)))
        .collect()
}

fn describe(v: &VcpuAtStop, mem: &GuestMemoryMmap, symbols: Option<&SymbolTable>, ours: &HvprobeCode) -> String {
    let rip = v.state.regs.rip;
    let kernel = v.state.in_kernel_mode();
    let mut line = format!(
        "vCPU {} stopped in {} mode at RIP {rip:#x}",
        v.cpu,
        if kernel { "kernel" } else { "user" }
    );
    // The vCPU's own page tables: what it ran through.
    let at = place(&live_memory(mem, &v.state), symbols, Gva(rip), kernel);
    match (ours.0.get(&rip), &at.symbol, kernel && symbols.is_some()) {
        (Some(code), _, _) => line.push_str(&format!(" in {code}")),
        (None, Some(name), _) => line.push_str(&format!(" {}", escape_guest_text(name))),
        (None, None, true) => line.push_str(" (no kernel symbol)"),
        (None, None, false) => {}
    }
    match at.code {
        Code::Mapped { executable, bytes } => {
            if !executable {
                line.push_str(", mapped not executable");
            }
            match bytes {
                Ok(bytes) => {
                    line.push_str(", bytes");
                    for b in bytes {
                        line.push_str(&format!(" {b:02x}"));
                    }
                }
                Err(e) => line.push_str(&format!(", bytes unreadable: {e}")),
            }
        }
        Code::Unmapped(e) => line.push_str(&format!(", not mapped by its page tables: {e}")),
    }
    if let Some(e) = v.exception {
        line.push_str(&format!("; KVM was delivering {e}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprobe_vmm::{PendingException, VcpuState};
    use vm_memory::{Bytes, GuestAddress};

    const TEXT: u64 = 0xffff_ffff_8100_0000;

    /// 1 MiB of guest memory whose tables (PML4 at 0x1000) map one 4 KiB page at `TEXT`
    /// to 0x10000, holding a `nop; hlt` and then zeros.
    fn memory() -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let entry = |at: u64, index: u64, value: u64| mem.write_obj(value, GuestAddress(at + 8 * index)).unwrap();
        entry(0x1000, (TEXT >> 39) & 511, 0x2000 | 3);
        entry(0x2000, (TEXT >> 30) & 511, 0x3000 | 3);
        entry(0x3000, (TEXT >> 21) & 511, 0x4000 | 3);
        entry(0x4000, (TEXT >> 12) & 511, 0x10000 | 1);
        mem.write_slice(&[0x90, 0xf4], GuestAddress(0x10000)).unwrap();
        mem
    }

    fn at(rip: u64, kernel: bool, exception: Option<PendingException>) -> VcpuAtStop {
        let mut state = VcpuState::default();
        state.regs.rip = rip;
        state.sregs.cs.selector = if kernel { 0x10 } else { 0x33 };
        state.sregs.cr3 = 0x1000;
        state.sregs.cr4 = 0x20; // PAE: 4-level paging
        VcpuAtStop {
            cpu: 1,
            state,
            exception,
        }
    }

    #[test]
    fn each_vcpu_is_named_with_its_symbol_mapping_bytes_and_exception() {
        let mem = memory();
        let symbols =
            SymbolTable::parse_system_map("ffffffff81000000 T default_idle\nffffffff81000100 T next\n").unwrap();
        let said = report(
            &[at(TEXT + 1, true, None)],
            &mem,
            Some(&symbols),
            &HvprobeCode::default(),
        );
        assert_eq!(
            said,
            "hvprobe: vCPU 1 stopped in kernel mode at RIP 0xffffffff81000001 default_idle+0x1/0x100, bytes f4 00 00 00 00 \
             00 00 00 00 00 00 00 00 00 00 00\n"
        );
        // Unmapped, in the module area, with KVM injecting a fetch fault there (the lane's
        // L2 that stopped): no symbol, the walk's reason, the exception.
        let fault = PendingException {
            vector: 14,
            error_code: Some(0x10),
        };
        let said = report(
            &[at(0xffff_ffff_c041_edcc, true, Some(fault))],
            &mem,
            Some(&symbols),
            &HvprobeCode::default(),
        );
        assert!(said.starts_with("hvprobe: vCPU 1 stopped in kernel mode at RIP 0xffffffffc041edcc (no kernel symbol), not mapped by its page tables: "), "{said}");
        assert!(said.ends_with("; KVM was delivering #PF (error code 0x10)\n"), "{said}");
        // User mode: no kernel symbol is looked for; without symbols none is promised.
        let said = report(&[at(0x40_1000, false, None)], &mem, None, &HvprobeCode::default());
        assert!(
            said.starts_with("hvprobe: vCPU 1 stopped in user mode at RIP 0x401000, not mapped"),
            "{said}"
        );
    }

    /// hvprobe's own code is named as the engine names it, before any kernel symbol (the
    /// lane's SIGTERM test stopped a vCPU in an event detour: "no kernel symbol" before).
    #[test]
    fn a_vcpu_in_hvprobes_code_is_named_by_the_engine() {
        let mem = memory();
        let symbols = SymbolTable::parse_system_map("ffffffff81000000 T default_idle\n").unwrap();
        let vcpus = [at(TEXT + 1, true, None)];
        let ours = HvprobeCode::of(&vcpus, |rip| {
            (rip == Gva(TEXT + 1)).then(|| "hvprobe's event detour for vfs_read+0x0/0x1c0 (t/vfs_read)".to_string())
        });
        let said = report(&vcpus, &mem, Some(&symbols), &ours);
        assert!(
            said.starts_with(
                "hvprobe: vCPU 1 stopped in kernel mode at RIP 0xffffffff81000001 in hvprobe's event detour for \
                 vfs_read+0x0/0x1c0 (t/vfs_read), bytes f4"
            ),
            "{said}"
        );
    }

    #[test]
    fn the_bytes_stop_at_the_end_of_a_mapped_page() {
        let mem = memory();
        let said = report(&[at(TEXT + 0xffe, true, None)], &mem, None, &HvprobeCode::default());
        assert!(said.ends_with(", bytes 00 00\n"), "{said}");
    }

    #[test]
    fn only_a_run_the_guest_did_not_end_gets_the_report() {
        assert!(wanted(&StopReason::Signal(15)));
        assert!(wanted(&StopReason::Stopped));
        assert!(!wanted(&StopReason::GuestExit(0)));
        assert!(!wanted(&StopReason::Reset));
    }
}
