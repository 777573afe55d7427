//! The glue between the probe engine (`hvprobe-probes`) and the VMM: the engine's view of a
//! live guest (memory, pausing, the vCPU at a hit) and the VMM's debug handler that hands
//! int3 and single-step exits to the engine.

use std::sync::{Arc, Mutex, OnceLock};

use hvprobe_arch::paging::{translate, PagingMode, WalkError};
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::facts::{ExceptionTable, KprobeBlacklist};
use hvprobe_introspection::memory::{GuestVirtRead, MemoryError, PagedGuestMemory};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::task::TaskInfo;
use hvprobe_probes::engine::{
    BreakpointOutcome, EventSink, KernelView, OutOfLineArea, PatchSites, StepOutcome, Tracer,
};
use hvprobe_probes::machine::{KernelMemory, Machine, Vcpu};
use hvprobe_probes::regs::Regs;
use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START};
use hvprobe_vmm::{set_guest_debug, Backend, BreakpointDisposition, DebugHandler, GuestEvent, VcpuControl, VcpuState};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;

use crate::introspect::{live_memory, GuestPhys, TaskContext};

/// Guest kernel memory through one set of page tables (the kernel half is the same in
/// all of them).
pub struct LiveKernel(pub PagedGuestMemory<GuestPhys>);

impl GuestVirtRead for LiveKernel {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.0.read_virt(gva, buf)
    }
}

impl KernelMemory for LiveKernel {
    fn write_virt(&self, gva: Gva, bytes: &[u8]) -> Result<(), MemoryError> {
        self.0.write_virt(gva, bytes)
    }
}

/// A VM as the probe engine changes it.
pub struct VmMachine {
    control: Arc<VcpuControl>,
    kernel: LiveKernel,
}

impl VmMachine {
    pub fn new(control: Arc<VcpuControl>, kernel: LiveKernel) -> Self {
        VmMachine { control, kernel }
    }
}

/// Guest kernel memory through the kernel's own top-level page table (`init_top_pgt`),
/// found through `state`'s (any vCPU's, with the kernel's paging set up). Unlike the page
/// tables of the process a vCPU happened to run, the kernel's live as long as the kernel.
pub fn kernel_memory(mem: &GuestMemoryMmap, state: &VcpuState, symbols: &SymbolTable) -> LiveKernel {
    let current = live_memory(mem, state);
    let mode = PagingMode::from_cr4(state.sregs.cr4);
    let own = symbols
        .lookup("init_top_pgt")
        .and_then(|s| current.translate(s.addr).ok())
        .map(|t| PagedGuestMemory::new(GuestPhys(mem.clone()), t.gpa.0, mode));
    LiveKernel(own.unwrap_or(current))
}

impl Machine for VmMachine {
    fn kernel(&self) -> &dyn KernelMemory {
        &self.kernel
    }

    fn with_vcpus_paused(&self, edit: &mut dyn FnMut(&dyn KernelMemory)) {
        let _paused = self.control.pause_all();
        edit(&self.kernel);
    }
}

/// The kernel image mapping: `level2_kernel_pgt` covers 1 GiB from `__START_KERNEL_map`;
/// the module area starts at its end when KASLR is configured.
const KERNEL_IMAGE_MAP_START: u64 = 0xffff_ffff_8000_0000;
const KERNEL_IMAGE_MAP_END: u64 = 0xffff_ffff_c000_0000;
/// Where modules start without `CONFIG_RANDOMIZE_BASE` (a 512 MiB kernel image).
const MODULES_START_WITHOUT_KASLR: u64 = 0xffff_ffff_a000_0000;
const TWO_MIB: u64 = 2 << 20;
/// A 2 MiB kernel page: present, writable, accessed, dirty, large, global; executable and
/// supervisor-only.
const OOL_PMD_FLAGS: u64 = 0x1 | 0x2 | 0x20 | 0x40 | 0x80 | 0x100;

/// Maps the VMM's out-of-line area into the guest kernel's page tables, in a free 2 MiB
/// slot of the kernel image mapping outside the kernel (within ±2 GiB of all kernel text,
/// below the module area). Returns the area's guest-virtual address. Idempotent: an
/// area already mapped (a restored snapshot of a traced guest) is found again.
pub fn map_out_of_line_area(
    phys: &GuestPhys,
    cr3: u64,
    mode: PagingMode,
    symbols: &SymbolTable,
) -> Result<OutOfLineArea, String> {
    let bound = |name: &str| {
        symbols
            .lookup(name)
            .map(|s| s.addr.0)
            .ok_or_else(|| format!("the kernel has no {name} symbol: cannot place the out-of-line area"))
    };
    let (text, end) = (bound("_text")?, bound("_end")?);
    let limit = if end < MODULES_START_WITHOUT_KASLR {
        MODULES_START_WITHOUT_KASLR
    } else {
        KERNEL_IMAGE_MAP_END
    };
    // One free 2 MiB page between the kernel and us, so that nothing the kernel maps just
    // past its end (or before its start) is mistaken for free. Above the kernel first; a
    // randomized kernel near the top of its 1 GiB leaves room only below it.
    let above = (end.div_ceil(TWO_MIB) + 1) * TWO_MIB;
    let below = (text / TWO_MIB).saturating_sub(2) * TWO_MIB;
    let candidates = (above..limit.saturating_sub(TWO_MIB - 1))
        .step_by(TWO_MIB as usize)
        .chain((KERNEL_IMAGE_MAP_START..=below).rev().step_by(TWO_MIB as usize));
    for va in candidates {
        match translate(phys, cr3, mode, Gva(va)) {
            Ok(t) if t.gpa == OOL_AREA_START => {
                return Ok(OutOfLineArea {
                    start: Gva(va),
                    size: OOL_AREA_SIZE,
                })
            }
            Ok(_) => {}
            Err(WalkError::NotPresent {
                level: 2, entry_gpa, ..
            }) => {
                let entry = OOL_AREA_START.0 | OOL_PMD_FLAGS;
                hvprobe_arch::paging::PhysWrite::write_phys(phys, entry_gpa, &entry.to_le_bytes())?;
                return Ok(OutOfLineArea {
                    start: Gva(va),
                    size: OOL_AREA_SIZE,
                });
            }
            Err(_) => {}
        }
    }
    Err(format!(
        "no free 2 MiB slot in the kernel image mapping ({KERNEL_IMAGE_MAP_START:#x}..{limit:#x}) outside the \
         kernel ({text:#x}..{end:#x})"
    ))
}

/// The out-of-line area's guest-physical start (for tests and diagnostics).
pub const fn out_of_line_gpa() -> Gpa {
    OOL_AREA_START
}

/// The vCPU at a hit.
struct HitVcpu<'a> {
    vcpu: &'a mut VcpuFd,
    backend: Backend,
    mem: &'a GuestMemoryMmap,
    tasks: Option<&'a TaskContext>,
    /// Control registers and MSRs, read once per exit when `$comm`, the pid or a user
    /// address needs them (four ioctls).
    state: Option<VcpuState>,
}

impl HitVcpu<'_> {
    fn state(&mut self) -> Option<VcpuState> {
        if self.state.is_none() {
            self.state = VcpuState::read(self.vcpu).ok();
        }
        self.state
    }
}

impl Vcpu for HitVcpu<'_> {
    fn regs(&mut self) -> Result<Regs, String> {
        let r = self.vcpu.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
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
            // A probe hit is in kernel mode: the kernel's flat segments (__KERNEL_CS,
            // __KERNEL_DS), without a second ioctl per hit for the segment registers.
            cs: 0x10,
            rflags: r.rflags,
            rsp: r.rsp,
            ss: 0x18,
        })
    }

    fn set_regs(&mut self, regs: &Regs) -> Result<(), String> {
        let mut r = self.vcpu.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
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
        self.vcpu.set_regs(&r).map_err(|e| format!("KVM_SET_REGS: {e}"))
    }

    fn set_single_step(&mut self, on: bool) -> Result<(), String> {
        set_guest_debug(self.vcpu, self.backend, on).map_err(|e| e.to_string())
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

/// Hands the VMM's debug exits to a [`Tracer`] once there is one (before, every int3 is
/// the guest's), and runs a hook when the guest reaches `/init`.
pub struct ProbeHandler {
    backend: Backend,
    mem: GuestMemoryMmap,
    tracer: OnceLock<Arc<Tracer>>,
    tasks: OnceLock<TaskContext>,
    on_init: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl ProbeHandler {
    pub fn new(backend: Backend, mem: GuestMemoryMmap) -> Arc<Self> {
        Arc::new(ProbeHandler {
            backend,
            mem,
            tracer: OnceLock::new(),
            tasks: OnceLock::new(),
            on_init: Mutex::new(None),
        })
    }

    /// Starts handing hits to `tracer` (once; later calls are ignored).
    pub fn attach(&self, tracer: Arc<Tracer>, tasks: Option<TaskContext>) {
        if let Some(t) = tasks {
            let _ = self.tasks.set(t);
        }
        let _ = self.tracer.set(tracer);
    }

    pub fn tracer(&self) -> Option<&Arc<Tracer>> {
        self.tracer.get()
    }

    /// Runs `hook` on the vCPU thread that reports `/init`, before the guest goes on.
    pub fn on_init(&self, hook: Box<dyn FnOnce() + Send>) {
        *self.on_init.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    fn hit_vcpu<'a>(&'a self, vcpu: &'a mut VcpuFd) -> HitVcpu<'a> {
        HitVcpu {
            vcpu,
            backend: self.backend,
            mem: &self.mem,
            tasks: self.tasks.get(),
            state: None,
        }
    }
}

impl DebugHandler for ProbeHandler {
    fn on_breakpoint(&self, cpu: usize, vcpu: &mut VcpuFd, at: Gva) -> BreakpointDisposition {
        let Some(tracer) = self.tracer.get() else {
            return BreakpointDisposition::GuestOwned;
        };
        match tracer.on_breakpoint(cpu, &mut self.hit_vcpu(vcpu), at) {
            BreakpointOutcome::Handled => BreakpointDisposition::Handled,
            BreakpointOutcome::NotOurs | BreakpointOutcome::HandledThenGuest => BreakpointDisposition::GuestOwned,
        }
    }

    fn on_single_step(&self, cpu: usize, vcpu: &mut VcpuFd) -> bool {
        let Some(tracer) = self.tracer.get() else {
            return false;
        };
        tracer.on_single_step(cpu, &mut self.hit_vcpu(vcpu)) == StepOutcome::Handled
    }

    fn on_guest_event(&self, _cpu: usize, event: GuestEvent) {
        if event == GuestEvent::InitReached {
            let hook = self.on_init.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(hook) = hook {
                hook();
            }
        }
    }
}

/// A [`Tracer`] for a guest whose kernel is up: reads the facts probes are checked against
/// (the live kprobe blacklist, the exception table, jump-label and static-call sites) and
/// maps the out-of-line area. `state` is any vCPU's (paused, or not yet running).
pub fn build_tracer(
    control: Arc<VcpuControl>,
    mem: &GuestMemoryMmap,
    state: &VcpuState,
    symbols: &SymbolTable,
    sink: Option<Arc<dyn EventSink>>,
) -> Result<Arc<Tracer>, String> {
    let memory = kernel_memory(mem, state, symbols);
    let blacklist = KprobeBlacklist::read_live(&memory, symbols).map_err(|e| e.to_string())?;
    let ex_table = ExceptionTable::read(&memory, symbols).map_err(|e| e.to_string())?;
    let patch_sites = PatchSites::read(&memory, symbols).map_err(|e| e.to_string())?;
    let ool = map_out_of_line_area(
        &GuestPhys(mem.clone()),
        state.sregs.cr3,
        PagingMode::from_cr4(state.sregs.cr4),
        symbols,
    )?;
    tracing::info!(
        "probe engine: {} blacklisted functions, {} exception-table entries, {} patch sites, out-of-line area at {}",
        blacklist.symbols().len(),
        ex_table.len(),
        patch_sites.len(),
        ool.start
    );
    let view = KernelView {
        symbols: Arc::new(symbols.clone()),
        blacklist,
        ex_table,
        patch_sites,
    };
    let machine = Arc::new(VmMachine::new(control, memory));
    Ok(Arc::new(Tracer::new(machine, view, Some(ool), sink)))
}

/// Where [`code_blob_tracer`] maps the out-of-line area: a code blob's page tables
/// identity-map the first 4 GiB, and the area's own address (3.25 GiB) is beyond a rel32's
/// reach from the blob at 1 MiB.
pub const CODE_BLOB_OOL_VA: u64 = 1 << 30;

/// A tracer for a code-blob VM ([`hvprobe_vmm::Vm::new_code_blob`]): the blob is the text
/// symbol `blob` (`len` bytes), and the out-of-line area is mapped again at
/// [`CODE_BLOB_OOL_VA`] with a 2 MiB page, as the VMM maps it next to a kernel.
pub fn code_blob_tracer(vm: &hvprobe_vmm::Vm, len: u64) -> Result<Arc<Tracer>, String> {
    use vm_memory::{Bytes, GuestAddress};
    let state = vm.vcpu_state(0).map_err(|e| e.to_string())?;
    let mem = vm.memory();
    let second_page_directory = hvprobe_vmm::layout::PDE_START + 0x1000;
    let large_page = OOL_AREA_START.0 | 0x83;
    mem.write_obj(large_page, GuestAddress(second_page_directory))
        .map_err(|e| e.to_string())?;
    let kernel = LiveKernel(PagedGuestMemory::new(
        GuestPhys(mem.clone()),
        state.sregs.cr3,
        PagingMode::from_cr4(state.sregs.cr4),
    ));
    let start = hvprobe_vmm::CODE_BLOB_START;
    let symbols = SymbolTable::parse_system_map(&format!("{start:016x} T blob\n{:016x} T blob_end\n", start + len))
        .map_err(|e| e.to_string())?;
    let view = KernelView {
        symbols: Arc::new(symbols),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites: PatchSites::default(),
    };
    let ool = OutOfLineArea {
        start: Gva(CODE_BLOB_OOL_VA),
        size: OOL_AREA_SIZE,
    };
    Ok(Arc::new(Tracer::new(
        Arc::new(VmMachine::new(vm.control(), kernel)),
        view,
        Some(ool),
        None,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    const PML4: u64 = 0x1000;
    const PDPT: u64 = 0x2000;
    const PD: u64 = 0x3000;

    /// Page tables for the top 1 GiB (`level2_kernel_pgt` at PD) with the kernel mapped by
    /// 2 MiB pages from `text` to `end`, as `cleanup_highmap` leaves them.
    fn kernel_tables(text: u64, end: u64) -> GuestPhys {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        mem.write_obj(PDPT | 3, GuestAddress(PML4 + 511 * 8)).unwrap();
        mem.write_obj(PD | 3, GuestAddress(PDPT + 510 * 8)).unwrap();
        let mut va = text;
        while va < end {
            let index = (va - KERNEL_IMAGE_MAP_START) / TWO_MIB;
            mem.write_obj((0x100_0000 + index * TWO_MIB) | 0x83, GuestAddress(PD + index * 8))
                .unwrap();
            va += TWO_MIB;
        }
        GuestPhys(mem)
    }

    fn symbols(text: u64, end: u64) -> SymbolTable {
        SymbolTable::parse_system_map(&format!("{text:016x} T _text\n{end:016x} B _end\n")).unwrap()
    }

    #[test]
    fn the_out_of_line_area_goes_after_the_kernel_and_is_found_again() {
        let (text, end) = (0xffff_ffff_8100_0000, 0xffff_ffff_8230_0000);
        let phys = kernel_tables(text, end);
        let area = map_out_of_line_area(&phys, PML4, PagingMode::Level4, &symbols(text, end)).unwrap();
        assert_eq!(
            area.start,
            Gva(0xffff_ffff_8260_0000),
            "after _end and one free 2 MiB page"
        );
        let t = translate(&phys, PML4, PagingMode::Level4, area.start).unwrap();
        assert_eq!(t.gpa, OOL_AREA_START);
        assert!(t.permissions.executable && t.permissions.writable && !t.permissions.user);
        let again = map_out_of_line_area(&phys, PML4, PagingMode::Level4, &symbols(text, end)).unwrap();
        assert_eq!(again.start, area.start);
    }

    #[test]
    fn a_kernel_randomized_to_the_top_gets_the_area_below_it() {
        let (text, end) = (0xffff_ffff_be00_0000, 0xffff_ffff_bfe1_c000);
        let phys = kernel_tables(text, end);
        let area = map_out_of_line_area(&phys, PML4, PagingMode::Level4, &symbols(text, end)).unwrap();
        assert_eq!(
            area.start,
            Gva(0xffff_ffff_bdc0_0000),
            "below _text and one free 2 MiB page"
        );
        // Everything is taken: a clear error, nothing written.
        let full = kernel_tables(KERNEL_IMAGE_MAP_START, KERNEL_IMAGE_MAP_END);
        let err = map_out_of_line_area(
            &full,
            PML4,
            PagingMode::Level4,
            &symbols(KERNEL_IMAGE_MAP_START + TWO_MIB, KERNEL_IMAGE_MAP_END - TWO_MIB),
        )
        .unwrap_err();
        assert!(err.contains("no free 2 MiB slot"), "{err}");
    }
}
