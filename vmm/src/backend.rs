//! Which KVM implementation is behind `/dev/kvm`.
//!
//! Hardware KVM (VMX/SVM) runs guest kernel code natively; kvm_pvm runs it in KVM's
//! instruction emulator, reports a guest int3 at CPL0 as an emulation failure and cannot
//! execute some instructions the guest would pick by CPUID. Everything that differs
//! between the two is decided by this value, in one place each.

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use kvm_bindings::kvm_sregs;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// VMX or SVM.
    Hardware,
    /// Pagetable-based VM (`kvm_pvm` module): kernel-mode guest code is emulated.
    Pvm,
}

impl Backend {
    /// Detects the backend from the host's loaded modules and CPU flags.
    pub fn detect() -> Backend {
        let pvm_loaded = Path::new("/sys/module/kvm_pvm").exists();
        let hw_virt = std::fs::read_to_string("/proc/cpuinfo")
            .map(|c| {
                c.lines()
                    .filter(|l| l.starts_with("flags"))
                    .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
            })
            .unwrap_or(false);
        let hw_module = Path::new("/sys/module/kvm_intel").exists() || Path::new("/sys/module/kvm_amd").exists();
        if pvm_loaded && !(hw_virt && hw_module) {
            Backend::Pvm
        } else {
            Backend::Hardware
        }
    }

    /// A one-word name, for file names: `hardware` or `pvm`.
    pub fn short_name(self) -> &'static str {
        match self {
            Backend::Hardware => "hardware",
            Backend::Pvm => "pvm",
        }
    }

    /// Kernel command-line options a Linux guest needs on this backend.
    ///
    /// On kvm_pvm the guest's CPUID instruction does not return what KVM_SET_CPUID2 set for
    /// the basic feature leaves (measured: leaf 1 ECX shows the host's xsave, popcnt, cx16
    /// although we cleared them; the KVM leaves 0x4000_0000+ do follow our table). So the
    /// features whose instructions the emulator cannot execute at CPL0 are also switched
    /// off in the kernel by name. Names, not bit numbers: the numbering changes between
    /// kernel versions.
    pub fn kernel_cmdline_fixups(self) -> &'static str {
        match self {
            Backend::Hardware => "",
            Backend::Pvm => {
                "noxsave clearcpuid=xsave,avx,avx2,avx512f,popcnt,cx16,rdrand,rdseed,pcid,invpcid,fsgsbase,smap,erms,fsrm,pku,rdpid"
            }
        }
    }

    /// Whether a guest-owned #BP goes back to the guest as a *pending* exception (with
    /// `KVM_CAP_EXCEPTION_PAYLOAD` on the VM) rather than as an injected one. On hardware
    /// KVM the re-injected #BP is a software exception, and KVM moves RIP past the int3
    /// when it delivers it: without next-RIP saving (SVM without nrips, as under nested
    /// virtualization) through its emulator, which drops an *injected* exception, so an
    /// interrupt pending at that entry took its place and the int3 was lost (the guest's
    /// boot-time int3 self-test died with `invalid opcode`). A pending exception is
    /// delivered by KVM's own event logic, which injects nothing else in that entry.
    pub fn reinjects_breakpoints_as_pending(self) -> bool {
        self == Backend::Hardware
    }

    /// Whether data breakpoints (debug registers watching writes or reads) fire in guest
    /// kernel code, or why not. kvm_pvm emulates that code, and KVM's emulator checks only
    /// instruction breakpoints (measured: a write watchpoint never fired there; on
    /// hardware KVM it fires after the write).
    pub fn data_breakpoints(self) -> Result<(), &'static str> {
        match self {
            Backend::Hardware => Ok(()),
            Backend::Pvm => Err(
                "kvm_pvm emulates guest kernel code, and its emulator checks only execution breakpoints: a data \
                 watch would never fire there (hardware KVM has them)",
            ),
        }
    }

    /// [`Backend::data_breakpoints`] as a yes or no.
    pub fn data_breakpoints_fire(self) -> bool {
        self.data_breakpoints().is_ok()
    }

    /// Whether RF in the guest's RFLAGS lets an instruction with an execution breakpoint
    /// on it run once. Measured: on hardware KVM it does (the CPU honours it at entry);
    /// kvm_pvm's emulator checks the breakpoint again, so the VMM steps over it instead.
    pub fn honours_resume_flag(self) -> bool {
        self == Backend::Hardware
    }

    /// Whether KVM_GET_SREGS says the task register is busy whatever the vCPU holds, so
    /// that segment registers read and written back with KVM_SET_SREGS change TR's type.
    /// kvm_amd does: the VMCB keeps TR's type as the CPU loaded it (LTR loads an available
    /// TSS), `svm_get_segment` sets the busy bit in what it reports ("the busy flag in the
    /// tr selector isn't exposed"), and `svm_set_segment` stores the type it is given.
    /// QEMU's TCG (the nested-SVM lane's L0) then takes TR for no TSS at all in
    /// `helper_check_io` and refuses user-mode port I/O through the I/O bitmap: Debian's
    /// stock kernel's init, whose ports come from ioperm(), died of a #GP at its next `out`
    /// after one out-of-line step (whose step guard sets the IDTR, and with it every
    /// segment register), and after a snapshot's restore. kvm_intel reports TR as the VMCS
    /// holds it.
    pub fn reports_tr_busy(self) -> bool {
        static KVM_AMD: OnceLock<bool> = OnceLock::new();
        self == Backend::Hardware && *KVM_AMD.get_or_init(|| Path::new("/sys/module/kvm_amd").exists())
    }

    /// The segment registers KVM_GET_SREGS reported, fit to write back with
    /// KVM_SET_SREGS (a step guard's IDTR, a snapshot's restore): see
    /// [`segments_as_held`].
    pub fn segments_as_held(self, sregs: kvm_sregs) -> kvm_sregs {
        segments_as_held(sregs, self.reports_tr_busy())
    }

    /// Whether the host's single-step (`KVM_GUESTDBG_SINGLESTEP`) misses its trap after
    /// some instructions, so that the vCPU runs the next one too before it exits. Measured
    /// (`vmm/tests/single_step.rs`): kvm_pvm's emulator does after `mfence`, `lfence`,
    /// `sfence`, `serialize`, `swapgs` and `out`; hardware KVM never does. The probe
    /// engine's out-of-line copies are followed by int3s for this.
    pub fn loses_step_trap_after_some_instructions(self) -> bool {
        self == Backend::Pvm
    }

    /// Whether a guest int3 at CPL0 reaches us as an emulation failure (and not as a
    /// debug exit), with RIP pointing at the int3.
    pub fn int3_is_emulation_failure(self) -> bool {
        self == Backend::Pvm
    }
}

/// The busy bit of a TSS's type: 11 is a busy 64-bit TSS, 9 an available one (3 and 1 for
/// a 16-bit TSS).
const TSS_BUSY: u8 = 0x2;

/// The segment registers KVM reported, as the vCPU holds them: where KVM reports TR busy
/// whatever the vCPU holds (`reports_tr_busy`, [`Backend::reports_tr_busy`]: kvm_amd),
/// TR's busy bit is cleared, as a vCPU that ran LTR holds it; written back as reported, it
/// would be marked busy. Everything else is as reported.
pub fn segments_as_held(mut sregs: kvm_sregs, reports_tr_busy: bool) -> kvm_sregs {
    if reports_tr_busy && sregs.tr.s == 0 && matches!(sregs.tr.type_, 3 | 11) {
        sregs.tr.type_ &= !TSS_BUSY;
    }
    sregs
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Hardware => write!(f, "hardware KVM (VMX/SVM)"),
            Backend::Pvm => write!(f, "kvm_pvm (guest kernel code is emulated)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvm_bindings::kvm_segment;

    use super::*;

    /// TR as kvm_amd reports it for a 64-bit Linux guest (Debian's 6.1 kernel, CPU 0,
    /// measured in the nested-SVM lane): busy, though the guest's LTR loaded it available.
    fn reported_by_kvm_amd() -> kvm_sregs {
        kvm_sregs {
            tr: kvm_segment {
                base: 0xffff_fe00_0000_3000,
                limit: 0x4087,
                selector: 0x40,
                type_: 11,
                present: 1,
                ..Default::default()
            },
            cr0: 0x8005_0033,
            efer: 0xd01,
            ..Default::default()
        }
    }

    #[test]
    fn on_kvm_amd_tr_goes_back_available_and_nothing_else_changes() {
        let read = reported_by_kvm_amd();
        let held = segments_as_held(read, true);
        // Marked busy in the VMCB, it makes QEMU's TCG refuse the guest's ioperm() ports.
        assert_eq!(held.tr.type_, 9, "an available 64-bit TSS, as LTR loaded it");
        assert_eq!(
            held,
            kvm_sregs {
                tr: kvm_segment { type_: 9, ..read.tr },
                ..read
            }
        );
    }

    #[test]
    fn where_kvm_reports_tr_as_it_holds_it_tr_goes_back_unchanged() {
        // kvm_intel: VMX wants a busy TSS in TR, and the VMCS has it so.
        let read = reported_by_kvm_amd();
        assert_eq!(segments_as_held(read, false), read);
    }

    #[test]
    fn only_a_tss_loses_its_busy_bit() {
        let mut read = reported_by_kvm_amd();
        read.tr.type_ = 3; // a busy 16-bit TSS: KVM's TR at reset
        assert_eq!(segments_as_held(read, true).tr.type_, 1);
        read.tr.type_ = 2; // an LDT (KVM's report of a TR of type 0): not a TSS
        assert_eq!(segments_as_held(read, true).tr.type_, 2);
        // A code segment's type 11 is not a TSS's: only system segments are TSSes.
        read.tr = kvm_segment {
            s: 1,
            type_: 11,
            ..read.tr
        };
        assert_eq!(segments_as_held(read, true).tr.type_, 11);
    }
}
