//! A [`Tracer`] on a running VM: for a booted guest kernel, with the facts probes are
//! checked against read from guest memory, or for a code blob.

use std::sync::Arc;

use hvprobe_arch::paging::PagingMode;
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::facts::{ExceptionTable, FactsError, KprobeBlacklist};
use hvprobe_introspection::memory::PagedGuestMemory;
use hvprobe_introspection::stacks::StacksLayout;
use hvprobe_introspection::symbols::{SymbolError, SymbolTable};
use hvprobe_probes::detour::event::GuestKernelFacts;
use hvprobe_probes::engine::{EventSink, KernelView, OutOfLineArea, PatchSites, PatchSitesError, Tracer};
use hvprobe_vmm::layout::{OOL_AREA_SIZE, OOL_AREA_START};
use hvprobe_vmm::{VcpuControl, VcpuState};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap, GuestMemoryRegion};

use crate::clock::guest_clock;
use crate::machine::VmMachine;
use crate::memory::{GuestPhys, HostArea, KernelPageTables, KernelTablesError, KernelText, LiveKernel};
use crate::ool::{guest_has_nx, map_out_of_line_area, out_of_line_area_at, OutOfLineError};

/// Why a tracer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    #[error("cannot reach the kernel's memory: {0}")]
    KernelTables(#[from] KernelTablesError),
    #[error("reading the guest's kprobe blacklist: {0}")]
    Blacklist(#[source] FactsError),
    #[error("reading the guest's exception table: {0}")]
    ExceptionTable(#[source] FactsError),
    #[error("reading the guest's text patch sites: {0}")]
    PatchSites(#[source] PatchSitesError),
    #[error(transparent)]
    OutOfLine(#[from] OutOfLineError),
    #[error("reading the code blob's vCPU state: {0}")]
    VcpuState(#[source] hvprobe_vmm::Error),
    #[error("mapping the code blob's out-of-line area: {0}")]
    CodeBlobMapping(#[source] GuestMemoryError),
    #[error("the code blob's symbols: {0}")]
    CodeBlobSymbols(#[source] SymbolError),
}

/// A [`Tracer`] for a guest whose kernel is up: reads the facts probes are checked against
/// (the live kprobe blacklist, the exception table, jump-label and static-call sites)
/// through the kernel's own page tables and maps the out-of-line area into them, and gives
/// the tracer the guest's trace clock (hits are stamped with it unless
/// [`TraceClock::Host`](hvprobe_probes::clock::TraceClock) is chosen; without it, with the
/// reason logged, with host time). `state` is vCPU 0's (paused, or not yet running): the
/// clock starts from its kvm-clock page and TSC, the other vCPUs' are taken at the engine's
/// first pause.
pub fn build_tracer(
    control: Arc<VcpuControl>,
    mem: &GuestMemoryMmap,
    state: &VcpuState,
    symbols: &SymbolTable,
    sink: Option<Arc<dyn EventSink>>,
) -> Result<Arc<Tracer>, TracerError> {
    let tables = KernelPageTables::find(mem, state, symbols)?;
    let memory = tables.memory(mem);
    let blacklist = KprobeBlacklist::read_live(&memory, symbols).map_err(TracerError::Blacklist)?;
    let ex_table = ExceptionTable::read(&memory, symbols).map_err(TracerError::ExceptionTable)?;
    let patch_sites = PatchSites::read(&memory, symbols).map_err(TracerError::PatchSites)?;
    let ool = map_out_of_line_area(&GuestPhys(mem.clone()), tables, symbols, guest_has_nx(state))?;
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
    let cpus = control.vcpu_count() as u32;
    // The stack walk is bounded by what the host knows of the VM, not by the guest's
    // nr_cpu_ids or its lists: the vCPUs that can run, and the memory stacks can live in.
    let memory_bytes: u64 = mem.iter().map(|r| r.len()).sum();
    let stacks = StacksLayout::from_guest(&memory, symbols).map(|l| l.bounded_by_vm(cpus, memory_bytes));
    if let Err(e) = &stacks {
        tracing::info!("jump optimization unavailable: the guest's kernel stacks cannot be found: {e}");
    }
    let task = crate::task::TaskContext::read(&memory, symbols).ok();
    let facts = GuestKernelFacts::from_symbols(symbols, task.as_ref().map(|t| &t.layout)).map(|f| GuestKernelFacts {
        rethooks: stacks.as_ref().ok().and_then(|l| l.rethooks),
        ..f
    });
    let clock = guest_clock(mem, &memory, symbols, cpus as usize, &[(0, *state)])
        .map_err(|e| tracing::warn!("the guest's trace clock cannot be computed: {e}; hits are stamped with host time"))
        .ok();
    let memory = memory.with_host_area(host_area(&ool));
    let memory = match kernel_text(&memory, symbols) {
        Some(text) => memory.with_kernel_text(text),
        None => memory,
    };
    let panics = hvprobe_vmm::PanicStop::new(Arc::clone(&control));
    let machine = Arc::new(
        VmMachine::new(control, memory, hvprobe_vmm::Backend::detect())
            .with_stacks(stacks)
            .with_event_memory(GuestPhys(mem.clone()))
            .with_guest_clock(clock.clone()),
    );
    let tracer = Arc::new(Tracer::new(machine, view, Some(ool), sink));
    if let Some(clock) = clock {
        if let Err(e) = tracer.attach_guest_clock(clock) {
            tracing::warn!("the guest's trace clock cannot stamp hits: {e}; hits are stamped with host time");
        }
    }
    match facts {
        Ok(facts) => enable_event_detours(&tracer, cpus, facts, ool, panics),
        Err(e) => tracing::info!("no event detours: {e}"),
    }
    Ok(tracer)
}

/// The out-of-line area (code and rings) as memory the host keeps for itself.
fn host_area(ool: &OutOfLineArea) -> HostArea {
    HostArea {
        gva: ool.start,
        gpa: OOL_AREA_START,
        size: OOL_AREA_SIZE,
    }
}

/// The kernel's text and where its image mapping puts it, as the kernel's tables say now
/// (the probe engine's writes to text must land there later too). `None`, logged, without
/// `_stext`/`_etext` or a translation.
fn kernel_text(memory: &LiveKernel, symbols: &SymbolTable) -> Option<KernelText> {
    let (start, end) = (symbols.lookup("_stext")?.addr, symbols.lookup("_etext")?.addr);
    match memory.memory.translate(start) {
        Ok(t) => Some(KernelText {
            range: start..end,
            phys_offset: t.gpa.0.wrapping_sub(start.0),
        }),
        Err(e) => {
            tracing::warn!("the kernel's text at {start} does not translate: {e}; text writes are not pinned to it");
            None
        }
    }
}

/// Sets up event detours' rings (a probe that only records then needs no exit when it is
/// optimized) and the thread that drains them; without them, such probes get sync detours.
/// The drain parses what the guest wrote: if it panics, the run ends with the reason
/// (`panics`) rather than go on with every event hit silently lost.
fn enable_event_detours(
    tracer: &Arc<Tracer>,
    cpus: u32,
    facts: GuestKernelFacts,
    ool: OutOfLineArea,
    panics: hvprobe_vmm::PanicStop,
) {
    let gpa_of = |gva: Gva| Gpa(OOL_AREA_START.0 + (gva.0 - ool.start.0));
    if let Err(e) = tracer.enable_event_detours(cpus, facts, &gpa_of) {
        tracing::info!("no event detours: {e}");
        return;
    }
    let capacity = tracer.event_rings().map_or(0, |r| r.geometry().capacity());
    let weak = Arc::downgrade(tracer);
    let drain = panics.spawn("event-drain", move || {
        while let Some(tracer) = weak.upgrade() {
            let taken = tracer.drain_events();
            drop(tracer);
            std::thread::sleep(drain_pause(taken, capacity));
        }
    });
    if let Err(e) = drain {
        tracing::warn!("no thread to drain the event rings ({e}): optimized probes' events would be lost");
    }
}

/// How long the drain thread waits after a drain that took `taken` records from rings of
/// `capacity` records per CPU: [`EVENT_DRAIN_PERIOD`], short enough for a live trace and
/// long enough to take many records per drain; [`EVENT_DRAIN_PERIOD_BUSY`] after a drain
/// that found a quarter of a ring's worth or more, so that a guest hitting faster than the
/// rings hold per period (hardware KVM runs a hit in well under a microsecond) finds room.
fn drain_pause(taken: usize, capacity: u32) -> std::time::Duration {
    if taken as u64 >= u64::from(capacity / 4).max(1) {
        EVENT_DRAIN_PERIOD_BUSY
    } else {
        EVENT_DRAIN_PERIOD
    }
}

/// How often the rings of event detours are drained.
const EVENT_DRAIN_PERIOD: std::time::Duration = std::time::Duration::from_millis(2);
/// How soon they are drained again after a busy drain.
const EVENT_DRAIN_PERIOD_BUSY: std::time::Duration = std::time::Duration::from_micros(100);

/// Where [`code_blob_tracer`] maps the out-of-line area: a code blob's page tables
/// identity-map the first 4 GiB, and the area's own address (3.25 GiB) is beyond a rel32's
/// reach from the blob at 1 MiB.
pub const CODE_BLOB_OOL_VA: u64 = 1 << 30;

/// A tracer for a code-blob VM ([`hvprobe_vmm::Vm::new_code_blob`]): the blob is the text
/// symbol `blob` (`len` bytes), and the out-of-line area is mapped again at
/// [`CODE_BLOB_OOL_VA`] with 2 MiB pages, as the VMM maps it next to a kernel.
pub fn code_blob_tracer(vm: &hvprobe_vmm::Vm, len: u64) -> Result<Arc<Tracer>, TracerError> {
    let state = vm.vcpu_state(0).map_err(TracerError::VcpuState)?;
    let mem = vm.memory();
    // The blob's one set of page tables is its "kernel's": the second page directory
    // covers 1..2 GiB.
    let second_page_directory = hvprobe_vmm::layout::PDE_START + 0x1000;
    for (i, offset) in (0..OOL_AREA_SIZE).step_by(2 << 20).enumerate() {
        let large_page = (OOL_AREA_START.0 + offset) | 0x83;
        mem.write_obj(large_page, GuestAddress(second_page_directory + 8 * i as u64))
            .map_err(TracerError::CodeBlobMapping)?;
    }
    let ool = out_of_line_area_at(CODE_BLOB_OOL_VA);
    let kernel = LiveKernel::new(PagedGuestMemory::new(
        GuestPhys(mem.clone()),
        state.sregs.cr3,
        PagingMode::from_cr4(state.sregs.cr4),
    ))
    .with_host_area(host_area(&ool));
    let start = hvprobe_vmm::CODE_BLOB_START;
    // The blob is the "kernel's" text (`_stext`..`_etext`): the engine writes text only
    // inside it.
    let end = start + len;
    let symbols = SymbolTable::parse_system_map(&format!(
        "{start:016x} T _stext\n{start:016x} T blob\n{end:016x} T blob_end\n{end:016x} T _etext\n"
    ))
    .map_err(TracerError::CodeBlobSymbols)?;
    let view = KernelView {
        symbols: Arc::new(symbols),
        blacklist: KprobeBlacklist::default(),
        ex_table: ExceptionTable::default(),
        patch_sites: PatchSites::default(),
    };
    // Its parts as next to a kernel (writable and executable 2 MiB pages here: a code blob
    // has no W+X check).
    Ok(Arc::new(Tracer::new(
        Arc::new(VmMachine::new(vm.control(), kernel, vm.backend()).without_kernel_stacks()),
        view,
        Some(ool),
        None,
    )))
}
