//! The probe engine's view of a running VM: the [`Machine`] whose kernel text it changes
//! (with every vCPU parked when it must be) and the [`Vcpu`] at a hit.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use hvprobe_arch::debugreg::DebugRegisters;
use hvprobe_arch::Gva;
use hvprobe_introspection::stacks::{cpu_stacks, rethook_returns, KernelStacks, StacksError, StacksLayout};
use hvprobe_introspection::unwind::{CpuStackView, GuestRethooks, StackBounds};

use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_introspection::task::TaskInfo;
use hvprobe_probes::machine::{
    DebugRegistersError, HardwareBreakpointSupport, InterruptTable, KernelMemory, Machine, PauseFailed, PausedView,
    SegmentSelectors, StackScanError, Vcpu, VcpuError,
};
use hvprobe_probes::regs::Regs;
use hvprobe_vmm::{exit_regs, segments_as_held, set_guest_debug, Backend, VcpuControl, VcpuState};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;

use crate::memory::{live_memory, GuestPhys, LiveKernel};
use crate::stacks::narrow_to_vcpus;
use crate::task::TaskContext;
use hvprobe_probes::clock::GuestClock;
use hvprobe_probes::detour::ring::RingMemory;

/// A VM as the probe engine changes it.
pub struct VmMachine {
    control: Arc<VcpuControl>,
    /// What the debug registers fire for depends on it.
    backend: Backend,
    kernel: LiveKernel,
    stacks: GuestStacks,
    /// Guest-physical memory, for the event rings.
    phys: Option<GuestPhys>,
    /// The guest's trace clock, told at every pause where each vCPU's kvm-clock page is and
    /// how its TSC relates to the host's.
    clock: Option<Arc<GuestClock>>,
}

/// What the engine can know of the guest's kernel stacks.
enum GuestStacks {
    /// Where they are (from the guest's BTF), or why that is not known: then no region
    /// can be proven free of interrupted tasks.
    Kernel(Result<Arc<StacksLayout>, Arc<StacksError>>),
    /// A code blob: no tasks, and interrupts are never enabled, so nothing is ever saved
    /// on a stack but by the blob's own calls.
    None,
}

impl VmMachine {
    pub fn new(control: Arc<VcpuControl>, kernel: LiveKernel, backend: Backend) -> Self {
        VmMachine {
            control,
            backend,
            kernel,
            stacks: GuestStacks::Kernel(Err(Arc::new(StacksError::NoBtf))),
            phys: None,
            clock: None,
        }
    }

    /// With the guest's trace clock, refreshed from the parked vCPUs at every pause.
    pub fn with_guest_clock(mut self, clock: Option<Arc<GuestClock>>) -> Self {
        self.clock = clock;
        self
    }

    /// With guest-physical memory, where event detours' rings are read.
    pub fn with_event_memory(mut self, phys: GuestPhys) -> Self {
        self.phys = Some(phys);
        self
    }

    /// With the guest's stack layout, so that the engine can search its kernel stacks.
    pub fn with_stacks(mut self, stacks: Result<StacksLayout, StacksError>) -> Self {
        self.stacks = GuestStacks::Kernel(stacks.map(Arc::new).map_err(Arc::new));
        self
    }

    /// For a code blob, which has no kernel stacks (no tasks, interrupts off).
    pub fn without_kernel_stacks(mut self) -> Self {
        self.stacks = GuestStacks::None;
        self
    }
}

impl Machine for VmMachine {
    fn kernel(&self) -> &dyn KernelMemory {
        &self.kernel
    }

    fn memory_size(&self) -> u64 {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        self.kernel.memory.phys().0.iter().map(|r| r.len()).sum()
    }

    fn stopped_rips(&self) -> Vec<(usize, u64)> {
        self.control.stopped_rips()
    }

    fn event_memory(&self) -> Option<&dyn RingMemory> {
        self.phys.as_ref().map(|p| p as &dyn RingMemory)
    }

    fn hardware_breakpoints(&self) -> HardwareBreakpointSupport {
        HardwareBreakpointSupport {
            execute: Ok(()),
            data: self.backend.data_breakpoints(),
        }
    }

    fn set_debug_registers(&self, registers: DebugRegisters) -> Result<(), DebugRegistersError> {
        // The engine calls this with the vCPUs paused: each loads them before it runs on.
        self.control.set_debug_registers(registers);
        Ok(())
    }

    fn cpu_stacks(&self, cpu: usize) -> Result<CpuStackView, StackScanError> {
        let guest = |e: Arc<StacksError>| StackScanError::Guest(Box::new(SharedStacksError(e)));
        let layout = match &self.stacks {
            GuestStacks::Kernel(layout) => layout.as_ref().map_err(|e| guest(Arc::clone(e)))?,
            GuestStacks::None => return Ok(CpuStackView::default()),
        };
        let found = cpu_stacks(&self.kernel, layout, cpu as u32).map_err(|e| guest(Arc::new(e)))?;
        let rethooks = match &layout.rethooks {
            Some(r) => Some(GuestRethooks {
                trampoline: r.trampoline,
                returns: rethook_returns(&self.kernel, r, found.current).map_err(|e| guest(Arc::new(e)))?,
            }),
            None => None,
        };
        Ok(CpuStackView {
            stacks: found
                .stacks
                .into_iter()
                .map(|s| StackBounds {
                    name: s.owner.to_string(),
                    range: s.bounds,
                })
                .collect(),
            rethooks,
        })
    }

    fn with_vcpus_paused(&self, edit: &mut dyn FnMut(&dyn PausedView)) -> Result<(), PauseFailed> {
        let paused = self.control.pause_all().map_err(|e| PauseFailed(Box::new(e)))?;
        if let Some(clock) = &self.clock {
            for cpu in 0..self.control.vcpu_count() {
                if let Some(state) = paused.state(cpu) {
                    crate::clock::observe(clock, cpu, &state);
                }
            }
        }
        edit(&PausedMachine {
            kernel: &self.kernel,
            paused: &paused,
            vcpus: self.control.vcpu_count(),
            layout: &self.stacks,
            stacks: OnceLock::new(),
        });
        Ok(())
    }
}

/// The machine while every (other) vCPU is parked.
struct PausedMachine<'a> {
    kernel: &'a LiveKernel,
    paused: &'a hvprobe_vmm::PausedVcpus,
    vcpus: usize,
    layout: &'a GuestStacks,
    /// The guest's kernel stacks in this pause, listed on first use.
    stacks: OnceLock<Result<KernelStacks, Arc<StacksError>>>,
}

impl PausedMachine<'_> {
    /// Every kernel stack, narrowed with the parked vCPUs' registers (a vCPU whose state
    /// is not at hand — the caller's own — is left whole, which only scans more).
    fn kernel_stacks(&self) -> Result<&KernelStacks, Arc<StacksError>> {
        self.stacks
            .get_or_init(|| {
                let GuestStacks::Kernel(layout) = self.layout else {
                    return Err(Arc::new(StacksError::NoBtf));
                };
                let layout = layout.as_ref().map_err(Arc::clone)?;
                let mut stacks = KernelStacks::read(self.kernel, layout).map_err(Arc::new)?;
                let states: Vec<VcpuState> = (0..self.vcpus).filter_map(|cpu| self.paused.state(cpu)).collect();
                narrow_to_vcpus(&mut stacks, self.kernel, &states).map_err(Arc::new)?;
                Ok(stacks)
            })
            .as_ref()
            .map_err(Arc::clone)
    }
}

impl PausedView for PausedMachine<'_> {
    fn text(&self) -> &dyn KernelMemory {
        self.kernel
    }

    fn parked_rips(&self) -> Vec<(usize, u64)> {
        (0..self.vcpus)
            .filter_map(|cpu| Some((cpu, self.paused.regs(cpu)?.rip)))
            .collect()
    }

    fn saved_on_stacks(&self, range: Range<Gva>) -> Result<Vec<Gva>, StackScanError> {
        if let GuestStacks::None = self.layout {
            return Ok(Vec::new());
        }
        let guest = |e: Arc<StacksError>| StackScanError::Guest(Box::new(SharedStacksError(e)));
        let stacks = self.kernel_stacks().map_err(guest)?;
        let hits = stacks
            .saved_addresses_in(self.kernel, range)
            .map_err(|e| guest(Arc::new(e)))?;
        Ok(hits.into_iter().map(|h| h.value).collect())
    }
}

/// A stacks error shared by every question of one pause.
#[derive(Debug)]
struct SharedStacksError(Arc<StacksError>);

impl std::fmt::Display for SharedStacksError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedStacksError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A VMM error of `ioctl` as the engine's vCPU error (the errno when KVM gave one).
fn vmm_error(ioctl: &'static str, e: hvprobe_vmm::Error) -> VcpuError {
    match e {
        hvprobe_vmm::Error::Kvm { op, source } => VcpuError::new(op, source.errno()),
        other => VcpuError {
            ioctl,
            source: std::io::Error::other(other.to_string()),
        },
    }
}

/// The vCPU at a hit.
pub(crate) struct HitVcpu<'a> {
    vcpu: &'a mut VcpuFd,
    backend: Backend,
    mem: &'a GuestMemoryMmap,
    tasks: Option<&'a TaskContext>,
    /// Control registers and MSRs, read once per exit when `$comm`, the pid or a user
    /// address needs them (four ioctls).
    state: Option<VcpuState>,
    /// The segment registers of this exit, read once (a step's start asks for the IDT
    /// and then sets it) and kept current by what we set.
    sregs: Option<kvm_bindings::kvm_sregs>,
}

impl<'a> HitVcpu<'a> {
    pub(crate) fn new(
        vcpu: &'a mut VcpuFd,
        backend: Backend,
        mem: &'a GuestMemoryMmap,
        tasks: Option<&'a TaskContext>,
    ) -> Self {
        HitVcpu {
            vcpu,
            backend,
            mem,
            tasks,
            state: None,
            sregs: None,
        }
    }

    fn sregs(&mut self) -> Result<kvm_bindings::kvm_sregs, VcpuError> {
        if let Some(s) = self.sregs.or(self.state.map(|state| state.sregs)) {
            return Ok(s);
        }
        // From the sync area where KVM keeps them there: no ioctl.
        let s = exit_regs::read_sregs(self.vcpu).map_err(|e| vmm_error("KVM_GET_SREGS", e))?;
        self.sregs = Some(s);
        Ok(s)
    }

    fn state(&mut self) -> Option<VcpuState> {
        if self.state.is_none() {
            self.state = Some(VcpuState::at_exit(self.vcpu).ok()?);
        }
        self.state
    }
}

impl Vcpu for HitVcpu<'_> {
    fn regs(&mut self) -> Result<Regs, VcpuError> {
        let r = exit_regs::read(self.vcpu).map_err(|e| vmm_error("KVM_GET_REGS", e))?;
        Ok(Regs {
            r15: r.r15,
            r14: r.r14,
            r13: r.r13,
            r12: r.r12,
            rbp: r.rbp,
            rbx: r.rbx,
            r11: r.r11,
            r10: r.r10,
            r9: r.r9,
            r8: r.r8,
            rax: r.rax,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rip: r.rip,
            // Read only when a fetch-arg names them (`segment_selectors`): a second
            // ioctl per hit otherwise.
            cs: 0,
            rflags: r.rflags,
            rsp: r.rsp,
            ss: 0,
        })
    }

    fn set_regs(&mut self, regs: &Regs) -> Result<(), VcpuError> {
        let mut r = exit_regs::read(self.vcpu).map_err(|e| vmm_error("KVM_GET_REGS", e))?;
        r.r15 = regs.r15;
        r.r14 = regs.r14;
        r.r13 = regs.r13;
        r.r12 = regs.r12;
        r.rbp = regs.rbp;
        r.rbx = regs.rbx;
        r.r11 = regs.r11;
        r.r10 = regs.r10;
        r.r9 = regs.r9;
        r.r8 = regs.r8;
        r.rax = regs.rax;
        r.rcx = regs.rcx;
        r.rdx = regs.rdx;
        r.rsi = regs.rsi;
        r.rdi = regs.rdi;
        r.rip = regs.rip;
        r.rflags = regs.rflags;
        r.rsp = regs.rsp;
        exit_regs::write(self.vcpu, &r).map_err(|e| vmm_error("KVM_SET_REGS", e))?;
        if let Some(state) = &mut self.state {
            state.regs = r;
        }
        Ok(())
    }

    fn segment_selectors(&mut self) -> Result<SegmentSelectors, VcpuError> {
        let s = self.sregs()?;
        Ok(SegmentSelectors {
            cs: s.cs.selector,
            ss: s.ss.selector,
        })
    }

    fn set_single_step(&mut self, on: bool) -> Result<(), VcpuError> {
        // KVM_SET_GUEST_DEBUG notes the RIP a step starts from: the one just written.
        exit_regs::flush_regs(self.vcpu).map_err(|e| vmm_error("KVM_SET_REGS", e))?;
        set_guest_debug(self.vcpu, self.backend, on).map_err(|e| VcpuError {
            ioctl: "KVM_SET_GUEST_DEBUG",
            source: std::io::Error::other(e.to_string()),
        })
    }

    fn interrupt_table(&mut self) -> Result<InterruptTable, VcpuError> {
        let s = self.sregs()?;
        Ok(InterruptTable {
            base: Gva(s.idt.base),
            limit: s.idt.limit,
        })
    }

    fn set_interrupt_table(&mut self, table: InterruptTable) -> Result<(), VcpuError> {
        let s = with_interrupt_table(self.sregs()?, table, self.backend.reports_tr_busy());
        exit_regs::write_sregs(self.vcpu, &s).map_err(|e| vmm_error("KVM_SET_SREGS", e))?;
        self.sregs = Some(s);
        if let Some(state) = &mut self.state {
            state.sregs.idt = s.idt;
        }
        Ok(())
    }

    fn current_task(&mut self) -> Option<TaskInfo> {
        let tasks = self.tasks?;
        let state = self.state()?;
        tasks.current(&live_memory(self.mem, &state), &state).ok()
    }

    fn user_memory(&mut self) -> Option<Box<dyn GuestVirtRead + '_>> {
        let state = self.state()?;
        Some(Box::new(live_memory(self.mem, &state)))
    }
}

/// The segment registers to write to set the IDTR to `table`, from `sregs` as KVM reported
/// them at this exit: for the guest, only its IDTR changes (TR goes back as the vCPU holds
/// it, [`segments_as_held`]).
fn with_interrupt_table(
    sregs: kvm_bindings::kvm_sregs,
    table: InterruptTable,
    reports_tr_busy: bool,
) -> kvm_bindings::kvm_sregs {
    let mut sregs = segments_as_held(sregs, reports_tr_busy);
    sregs.idt.base = table.base.0;
    sregs.idt.limit = table.limit;
    sregs
}

#[cfg(test)]
mod tests {
    use kvm_bindings::{kvm_dtable, kvm_segment, kvm_sregs};

    use super::*;

    /// What kvm_amd reports at an exit of a 64-bit Linux guest (Debian's 6.1 kernel, CPU 0,
    /// measured in the nested-SVM lane): its TSS busy, though the guest's LTR loaded it
    /// available.
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
            idt: kvm_dtable {
                base: 0xffff_fe00_0000_0000,
                limit: 0xfff,
                ..Default::default()
            },
            cr0: 0x8005_0033,
            efer: 0xd01,
            ..Default::default()
        }
    }

    const GUARD: InterruptTable = InterruptTable {
        base: Gva(0xffff_ffff_9dbf_ef00),
        limit: 0xfff,
    };

    #[test]
    fn a_step_guards_idt_changes_only_the_idtr_and_hands_kvm_amd_tr_back_available() {
        let read = reported_by_kvm_amd();
        let written = with_interrupt_table(read, GUARD, true);
        assert_eq!((written.idt.base, written.idt.limit), (GUARD.base.0, GUARD.limit));
        // Marked busy in the VMCB, it makes QEMU's TCG refuse the guest's ioperm() ports.
        assert_eq!(written.tr.type_, 9, "an available 64-bit TSS, as LTR loaded it");
        let expected = kvm_sregs {
            idt: written.idt,
            tr: kvm_segment { type_: 9, ..read.tr },
            ..read
        };
        assert_eq!(written, expected, "nothing else changes");
    }

    #[test]
    fn where_kvm_reports_tr_as_it_holds_it_tr_goes_back_unchanged() {
        // kvm_intel: VMX wants a busy TSS in TR, and the VMCS has it so.
        let read = reported_by_kvm_amd();
        let written = with_interrupt_table(read, GUARD, false);
        assert_eq!(written.tr, read.tr);
        assert_eq!(written.idt.base, GUARD.base.0);
    }
}
