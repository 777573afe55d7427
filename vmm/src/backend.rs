//! Which KVM implementation is behind `/dev/kvm`.
//!
//! Hardware KVM (VMX/SVM) runs guest kernel code natively; kvm_pvm runs it in KVM's
//! instruction emulator, reports a guest int3 at CPL0 as an emulation failure and cannot
//! execute some instructions the guest would pick by CPUID. Everything that differs
//! between the two is decided by this value, in one place each.

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

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
    /// segment register). kvm_intel reports TR as the VMCS holds it.
    pub fn reports_tr_busy(self) -> bool {
        static KVM_AMD: OnceLock<bool> = OnceLock::new();
        self == Backend::Hardware && *KVM_AMD.get_or_init(|| Path::new("/sys/module/kvm_amd").exists())
    }

    /// Whether a guest int3 at CPL0 reaches us as an emulation failure (and not as a
    /// debug exit), with RIP pointing at the int3.
    pub fn int3_is_emulation_failure(self) -> bool {
        self == Backend::Pvm
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Hardware => write!(f, "hardware KVM (VMX/SVM)"),
            Backend::Pvm => write!(f, "kvm_pvm (guest kernel code is emulated)"),
        }
    }
}
