//! A whole VM: KVM objects, guest memory, devices, the loaded kernel and its vCPU threads.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_arch::Gpa;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_READONLY, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vm_superio::Serial;
use vmm_sys_util::eventfd::EventFd;

use crate::backend::Backend;
use crate::boot::{self, KernelFormat};
use crate::console::{ConsoleLog, ConsoleOutput, ConsoleWriter};
use crate::devices::{IrqLine, PortDevices, SERIAL_IRQ};
use crate::layout::{ram_ranges, OOL_AREA_SIZE, OOL_AREA_START, OOL_CODE_SIZE};
use crate::vcpu::{DebugHandler, StopReason, VcpuControl, VcpuRunner};
use crate::virtio::block::{Block, DiskConfig, DiskImage};
use crate::virtio::fs::{Fs, FsConfig};
use crate::virtio::{MmioDevices, VirtioDevice};
use crate::{acpi, cpuid, kvm_err, mptable, regs, Error};

/// Smallest guest the VMM accepts: the kernel, its initrd and early allocations need room.
pub const MIN_MEM_MIB: u64 = 32;
/// Largest guest memory accepted.
pub const MAX_MEM_MIB: u64 = 64 * 1024;

/// Guest memory of a code-blob VM.
const CODE_BLOB_MEM: u64 = 4 << 20;
/// Where a code blob is loaded; its offsets are relative to this.
pub const CODE_BLOB_START: u64 = 0x10_0000;
/// Interrupt descriptor table of a code-blob VM.
const CODE_BLOB_IDT: u64 = 0x1000;
/// Top of vCPU 0's stack in a code-blob VM; vCPU n's is 4 KiB * n lower.
const CODE_BLOB_STACKS: u64 = 0x8_0000;

/// Raw 64-bit code to run in place of a kernel (see [`Vm::new_code_blob`]).
#[derive(Clone, Debug)]
pub struct CodeBlob {
    pub code: Vec<u8>,
    pub cpus: u8,
    /// The guest's own interrupt and exception handlers: (vector, offset in `code`), each
    /// a 64-bit interrupt gate (interrupts off in the handler).
    pub handlers: Vec<(u8, u64)>,
}

/// What to boot and how.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub kernel: PathBuf,
    /// The initrd as bytes (several cpio archives may be concatenated).
    pub initrd: Vec<u8>,
    pub cmdline: String,
    pub cpus: u8,
    pub mem_mib: u64,
    pub console_output: ConsoleOutput,
    /// Feed the host's stdin to the guest console (raw mode on a terminal; Ctrl-A x quits).
    pub console_input: bool,
    /// Disk images, as virtio-blk devices in this order (`/dev/vda`, `/dev/vdb`, …).
    pub disks: Vec<DiskConfig>,
    /// Shared directories, as virtio-fs devices (after the disks) whose vhost-user
    /// backends already listen on their sockets.
    pub shares: Vec<FsConfig>,
}

impl VmConfig {
    /// Checks the values that do not need KVM.
    pub fn validate(&self) -> Result<(), Error> {
        Self::validate_machine(self.cpus, self.mem_mib)?;
        boot::kernel_format(&self.kernel)?;
        Ok(())
    }

    /// Checks a vCPU count and memory size.
    pub fn validate_machine(cpus: u8, mem_mib: u64) -> Result<(), Error> {
        if cpus == 0 || cpus > mptable::MAX_CPUS {
            return Err(Error::CpuCount {
                cpus,
                max: mptable::MAX_CPUS,
            });
        }
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mem_mib) {
            return Err(Error::MemorySize {
                mib: mem_mib,
                min: MIN_MEM_MIB,
                max: MAX_MEM_MIB,
            });
        }
        Ok(())
    }
}

/// How a run ended.
#[derive(Debug)]
pub struct VmOutcome {
    pub reason: StopReason,
    /// From vCPU start to the guest's `/init` signal, when it came.
    pub boot_to_init: Option<Duration>,
    /// From vCPU start to the end.
    pub run_time: Duration,
    pub exits: u64,
    pub breakpoints_reinjected: u64,
    /// int3 exits, the guest's and ours.
    pub breakpoints: u64,
    /// Single-step exits a debug handler took.
    pub single_steps: u64,
    /// Hardware-breakpoint exits a debug handler took (watches).
    pub hardware_breakpoints: u64,
    /// Loads of the host's debug registers into a vCPU whose guest had its own enabled.
    pub guest_debug_registers_hidden: u64,
    /// Guest instructions KVM emulated (on kvm_pvm: all guest kernel instructions).
    pub instructions_emulated: u64,
    /// VM exits as KVM counts them, in-kernel ones included (its `exits` statistic; 0 when
    /// KVM has no statistics).
    pub kvm_exits: u64,
    /// Guest writes into the out-of-line area's code, refused (read-only memory slot).
    pub ool_writes_refused: u64,
    /// `None` for a code blob.
    pub kernel_format: Option<KernelFormat>,
    /// Each vCPU as the run left it (one whose thread was lost, or whose state KVM would
    /// not give, is missing).
    pub vcpus_at_stop: Vec<crate::VcpuAtStop>,
}

pub struct Vm {
    pub(crate) kvm: Kvm,
    pub(crate) vm_fd: VmFd,
    pub(crate) backend: Backend,
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) vcpus: Vec<VcpuFd>,
    pub(crate) devices: Arc<PortDevices>,
    /// The virtio devices (none for a code blob or a restored snapshot).
    pub(crate) virtio: Arc<MmioDevices>,
    pub(crate) control: Arc<VcpuControl>,
    pub(crate) console_log: ConsoleLog,
    pub(crate) kernel_format: Option<KernelFormat>,
    pub(crate) console_input: bool,
    /// Bytes to put on the console's input when the vCPUs start (see [`Vm::send_console_input`]).
    pub(crate) console_feed: Option<Vec<u8>>,
}

impl Vm {
    /// Creates the VM, loads the kernel and prepares every vCPU; nothing runs yet.
    pub fn new(config: &VmConfig) -> Result<Vm, Error> {
        config.validate()?;
        // Opened and locked before KVM is touched: a bad or busy image is the first error.
        let disks = DiskImage::open_all(&config.disks)?;
        // And the shares' backends reached: one that cannot serve fails before the boot.
        let shares = config.shares.iter().map(Fs::connect).collect::<Result<Vec<_>, _>>()?;
        let mem_bytes = config.mem_mib << 20;
        let mut vm = Vm::create(config.cpus, mem_bytes, config.console_output, config.console_input)?;
        let devices: Vec<Box<dyn VirtioDevice>> = disks
            .into_iter()
            .map(|image| Box::new(Block::new(image)) as Box<dyn VirtioDevice>)
            .chain(shares.into_iter().map(|fs| Box::new(fs) as Box<dyn VirtioDevice>))
            .collect();
        let panics = crate::vcpu::PanicStop::new(Arc::clone(&vm.control));
        vm.virtio = Arc::new(MmioDevices::attach(&vm.vm_fd, &vm.mem, devices, &panics)?);
        let cmdline = match vm.virtio.cmdline() {
            announcements if announcements.is_empty() => config.cmdline.clone(),
            // Before the user's options, so that theirs come last.
            announcements => format!("{announcements} {}", config.cmdline),
        };
        let cmdline = match vm.backend.kernel_cmdline_fixups() {
            "" => cmdline,
            fixups => {
                // User mode runs natively with the host's CPUID and XCR0 there, so guest
                // programs can use AVX that a `noxsave` kernel does not context-switch.
                tracing::info!(
                    "kvm_pvm: the guest kernel runs with `noxsave`; it saves only the x87/SSE \
                     registers of its tasks, so guest programs that use AVX registers share \
                     their upper halves (the bundled guest's init keeps glibc off AVX)"
                );
                format!("{cmdline} {fixups}")
            }
        };
        // The platform twice, for kernels with and without ACPI.
        mptable::write_mptable(&vm.mem, config.cpus)?;
        let rsdp = acpi::write_acpi_tables(&vm.mem, config.cpus, &vm.virtio.slots())?;
        let kernel = boot::load(&vm.mem, mem_bytes, &config.kernel, &cmdline, &config.initrd, rsdp)?;
        tracing::info!("kernel {} loaded as {}", config.kernel.display(), kernel.format);
        regs::setup_boot_vcpu(&vm.vcpus[0], &vm.mem, kernel.entry, kernel.boot_info)?;
        vm.kernel_format = Some(kernel.format);
        Ok(vm)
    }

    /// A VM that runs raw 64-bit code at CPL0 instead of a kernel: long mode, the first
    /// 4 GiB identity-mapped, every vCPU starting at the blob's entry with RDI = its index.
    /// For tests and benchmarks of the exit loop itself.
    pub fn new_code_blob(blob: &CodeBlob) -> Result<Vm, Error> {
        let vm = Vm::create(blob.cpus, CODE_BLOB_MEM, ConsoleOutput::Discard, false)?;
        let write = |bytes: &[u8], at: u64| {
            vm.mem
                .write_slice(bytes, GuestAddress(at))
                .map_err(crate::error::mem_err("writing the code blob"))
        };
        write(&blob.code, CODE_BLOB_START)?;
        for &(vector, handler) in &blob.handlers {
            // A 64-bit interrupt gate, DPL 0, code selector 8.
            let target = CODE_BLOB_START + handler;
            let mut gate = [0u8; 16];
            gate[0..2].copy_from_slice(&(target as u16).to_le_bytes());
            gate[2..4].copy_from_slice(&8u16.to_le_bytes());
            gate[5] = 0x8e;
            gate[6..8].copy_from_slice(&((target >> 16) as u16).to_le_bytes());
            gate[8..12].copy_from_slice(&((target >> 32) as u32).to_le_bytes());
            write(&gate, CODE_BLOB_IDT + u64::from(vector) * 16)?;
        }
        for (cpu, vcpu) in vm.vcpus.iter().enumerate() {
            let entry = regs::EntryMode::Linux64 { entry: CODE_BLOB_START };
            regs::setup_boot_vcpu(vcpu, &vm.mem, entry, 0)?;
            let mut sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
            sregs.idt.base = CODE_BLOB_IDT;
            sregs.idt.limit = 256 * 16 - 1;
            vcpu.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
            let mut r = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
            r.rdi = cpu as u64;
            r.rsp = CODE_BLOB_STACKS - cpu as u64 * 0x1000;
            vcpu.set_regs(&r).map_err(kvm_err("KVM_SET_REGS"))?;
            if cpu > 0 {
                let runnable = kvm_bindings::kvm_mp_state {
                    mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
                };
                vcpu.set_mp_state(runnable).map_err(kvm_err("KVM_SET_MP_STATE"))?;
            }
        }
        Ok(vm)
    }

    /// KVM objects, memory, devices and vCPUs with CPUID, MSRs, FPU and LAPIC set.
    fn create(cpus: u8, mem_bytes: u64, console_output: ConsoleOutput, console_input: bool) -> Result<Vm, Error> {
        let (kvm, vm_fd, backend) = create_machine(None)?;
        let mem = create_guest_memory(&vm_fd, mem_bytes)?;
        let console_log = ConsoleLog::default();
        let devices = create_devices(&vm_fd, &console_log, console_output, None, 0)?;

        let mut vcpus = Vec::new();
        for i in 0..cpus {
            let vcpu = vm_fd.create_vcpu(u64::from(i)).map_err(kvm_err("KVM_CREATE_VCPU"))?;
            let cpuid = cpuid::guest_cpuid(&kvm, backend, i, cpus)?;
            vcpu.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
            regs::setup_msrs(&vcpu)?;
            regs::setup_fpu(&vcpu)?;
            regs::setup_lapic_lint(&vcpu)?;
            vcpus.push(vcpu);
        }
        Vm::from_parts(kvm, vm_fd, backend, mem, vcpus, devices, console_log, console_input)
    }

    /// A machine from its parts, with its vCPU control; nothing runs yet.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        kvm: Kvm,
        vm_fd: VmFd,
        backend: Backend,
        mem: GuestMemoryMmap,
        vcpus: Vec<VcpuFd>,
        devices: Arc<PortDevices>,
        console_log: ConsoleLog,
        console_input: bool,
    ) -> Result<Vm, Error> {
        let control = VcpuControl::new(vcpus.len())?;
        Ok(Vm {
            kvm,
            vm_fd,
            backend,
            mem,
            vcpus,
            devices,
            virtio: Arc::new(MmioDevices::default()),
            control,
            console_log,
            kernel_format: None,
            console_input,
            console_feed: None,
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Guest memory (RAM and the out-of-line area).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    pub fn vm_fd(&self) -> &VmFd {
        &self.vm_fd
    }

    /// Pause, resume and stop all vCPUs, from any thread.
    pub fn control(&self) -> Arc<VcpuControl> {
        Arc::clone(&self.control)
    }

    /// The registers, control registers and introspection MSRs of a vCPU that is not
    /// running (before [`run`](Self::run), e.g. after a restore), and its TSC against the
    /// host's.
    pub fn vcpu_state(&self, cpu: usize) -> Result<crate::VcpuState, Error> {
        let vcpu = self.vcpus.get(cpu).ok_or(Error::NoSuchVcpu(cpu))?;
        crate::VcpuState::read_with_tsc(vcpu)
    }

    /// A handle that types on the guest's serial console while the VM runs (a host tool
    /// driving an interactive guest, a test telling a waiting workload to go on).
    pub fn console_input(&self) -> ConsoleInput {
        ConsoleInput {
            devices: Arc::clone(&self.devices),
            control: Arc::clone(&self.control),
        }
    }

    pub fn console_log(&self) -> ConsoleLog {
        self.console_log.clone()
    }

    /// Feeds the host's stdin to the guest console while the VM runs (as
    /// [`VmConfig::console_input`] does; for a restored VM).
    pub fn feed_stdin_to_console(&mut self) {
        self.console_input = true;
    }

    /// Puts `bytes` on the serial console's input once the vCPUs start (as much as the
    /// UART's FIFO holds before the first guest instruction, the rest as the guest reads).
    pub fn send_console_input(&mut self, bytes: Vec<u8>) {
        self.console_feed = Some(bytes);
    }

    /// Runs every vCPU in its own thread until the VM stops.
    pub fn run(mut self, debug: Arc<dyn DebugHandler>) -> Result<VmOutcome, Error> {
        self.run_vcpus(debug)
    }

    /// [`Vm::run`], stopping the VM (`StopReason::Stopped`) if it still runs after `limit`:
    /// a guest that hangs ends the run instead of holding its caller.
    pub fn run_for(self, debug: Arc<dyn DebugHandler>, limit: Duration) -> Result<VmOutcome, Error> {
        let control = self.control();
        let (finished, wait) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::Builder::new()
            .name("vm-watchdog".into())
            .spawn(move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                    tracing::warn!("the guest still ran after {limit:?}: stopping it");
                    control.stop(StopReason::Stopped);
                }
            })
            .map_err(Error::Thread)?;
        let outcome = self.run(debug);
        drop(finished);
        let _ = watchdog.join();
        outcome
    }

    /// Runs the VM until the guest's init is ready for a workload (event 3 of the wait
    /// mode), then stops it with every vCPU out of KVM_RUN and no exit half-done. The VM
    /// keeps its vCPUs, so its state can be saved.
    pub fn run_until_ready(&mut self) -> Result<VmOutcome, Error> {
        self.control.stop_when_ready();
        let outcome = self.run_vcpus(Arc::new(crate::vcpu::NoProbes))?;
        if outcome.reason == StopReason::GuestReady {
            if self.vcpus.len() != self.control.vcpu_count() {
                return Err(Error::VcpuStateLost);
            }
            for (cpu, vcpu) in self.vcpus.iter_mut().enumerate() {
                complete_pending_exit(cpu, vcpu, &self.devices)?;
            }
        }
        Ok(outcome)
    }

    /// Runs the vCPU threads until the VM stops; the vCPUs come back into `self.vcpus`.
    fn run_vcpus(&mut self, debug: Arc<dyn DebugHandler>) -> Result<VmOutcome, Error> {
        let control = Arc::clone(&self.control);
        let _terminal = if self.console_input {
            Some(spawn_console_input(&self.devices, &control)?)
        } else {
            None
        };
        if let Some(bytes) = self.console_feed.take() {
            feed_console(&self.devices, &control, bytes)?;
        }
        control.mark_started();
        let started = Instant::now();
        let mut threads = Vec::new();
        let sync_regs = crate::vcpu::exit_regs::supported(&self.kvm);
        // Only on kvm_pvm: on hardware KVM (the nested-SVM lane) Debian's stock kernel
        // triple-faulted in 3 of 3 runs with the segment registers in the area, and passed
        // without; not diagnosed.
        let sync_sregs =
            sync_regs && self.backend == crate::Backend::Pvm && crate::vcpu::exit_regs::sregs_supported(&self.kvm);
        for (cpu, vcpu) in std::mem::take(&mut self.vcpus).into_iter().enumerate() {
            let runner = VcpuRunner {
                cpu,
                vcpu,
                backend: self.backend,
                control: Arc::clone(&control),
                devices: Arc::clone(&self.devices),
                virtio: Arc::clone(&self.virtio),
                debug: Arc::clone(&debug),
                mem: self.mem.clone(),
                sync_regs,
                sync_sregs,
                loaded_debug_registers: 0,
                stepping_over_breakpoint: false,
            };
            let thread = std::thread::Builder::new()
                .name(format!("vcpu{cpu}"))
                .spawn(move || runner.run());
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    control.stop(StopReason::Stopped);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(Error::Thread(e));
                }
            }
        }
        let mut vcpus_at_stop = Vec::new();
        for (cpu, t) in threads.into_iter().enumerate() {
            match t.join() {
                Ok(vcpu) => {
                    match crate::VcpuAtStop::read(cpu, &vcpu) {
                        Ok(at_stop) => vcpus_at_stop.push(at_stop),
                        Err(e) => tracing::warn!("vCPU {cpu}'s state at the stop: {e}"),
                    }
                    self.vcpus.push(vcpu)
                }
                // A panic outside the exit loop (which catches its own); the thread's
                // registration already stopped the VM, and its vCPU is lost.
                Err(_) => control.stop(StopReason::VcpuError {
                    cpu,
                    message: "vCPU thread panicked".into(),
                }),
            }
        }
        let counters = &control.counters;
        Ok(VmOutcome {
            reason: control.stop_reason().unwrap_or(StopReason::Stopped),
            boot_to_init: control.boot_to_init(),
            run_time: started.elapsed(),
            exits: counters.exits.load(std::sync::atomic::Ordering::Relaxed),
            breakpoints_reinjected: counters
                .breakpoints_reinjected
                .load(std::sync::atomic::Ordering::Relaxed),
            breakpoints: counters.breakpoints.load(std::sync::atomic::Ordering::Relaxed),
            single_steps: counters.single_steps.load(std::sync::atomic::Ordering::Relaxed),
            hardware_breakpoints: counters.hardware_breakpoints.load(std::sync::atomic::Ordering::Relaxed),
            guest_debug_registers_hidden: counters
                .guest_debug_registers_hidden
                .load(std::sync::atomic::Ordering::Relaxed),
            instructions_emulated: counters
                .instructions_emulated
                .load(std::sync::atomic::Ordering::Relaxed),
            kvm_exits: counters.kvm_exits.load(std::sync::atomic::Ordering::Relaxed),
            ool_writes_refused: counters.ool_writes_refused.load(std::sync::atomic::Ordering::Relaxed),
            kernel_format: self.kernel_format,
            vcpus_at_stop,
        })
    }
}

/// Finishes the exit a stopped vCPU was in (an `out` to the event port, typically) the
/// way firecracker does before a snapshot: KVM_RUN with `immediate_exit` set completes the
/// pending I/O in the kernel (RIP moves past the instruction) and returns at once with
/// EINTR, without running guest code. Saved registers then need no exit to be replayed.
fn complete_pending_exit(cpu: usize, vcpu: &mut VcpuFd, devices: &PortDevices) -> Result<(), Error> {
    // A string I/O instruction may need more than one round; it cannot need many.
    for _ in 0..64 {
        vcpu.set_kvm_immediate_exit(1);
        let result = match vcpu.run() {
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Ok(true),
            Err(e) => Err(Error::Kvm {
                op: "KVM_RUN (completing a pending exit)",
                source: e,
            }),
            Ok(kvm_ioctls::VcpuExit::IoOut(port, data)) => {
                devices.write(port, data);
                Ok(false)
            }
            Ok(kvm_ioctls::VcpuExit::IoIn(port, data)) => {
                devices.read(port, data);
                Ok(false)
            }
            Ok(other) => Err(Error::PendingExit {
                cpu,
                exit: format!("{other:?}"),
            }),
        };
        vcpu.set_kvm_immediate_exit(0);
        if result? {
            return Ok(());
        }
    }
    Err(Error::PendingExitLoop(cpu))
}

/// The KVM objects of a VM with the in-kernel irqchip and PIT, no memory and no vCPUs
/// (on `kvm`, an open /dev/kvm, when given).
pub(crate) fn create_machine(kvm: Option<Kvm>) -> Result<(Kvm, VmFd, Backend), Error> {
    let backend = Backend::detect();
    tracing::info!("KVM backend: {backend}");
    let kvm = match kvm {
        Some(kvm) => kvm,
        None => Kvm::new().map_err(Error::OpenKvm)?,
    };
    let vm_fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    if backend.reinjects_breakpoints_as_pending() {
        // See reinject_breakpoint: a #BP queued as pending keeps KVM from injecting an
        // interrupt over it in the same entry. Linux has had this capability since 4.20.
        let cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_EXCEPTION_PAYLOAD,
            args: [1, 0, 0, 0],
            ..Default::default()
        };
        vm_fd
            .enable_cap(&cap)
            .map_err(kvm_err("KVM_ENABLE_CAP(KVM_CAP_EXCEPTION_PAYLOAD)"))?;
    }
    if let Err(e) = vm_fd.set_tss_address(0xfffb_d000) {
        tracing::debug!("KVM_SET_TSS_ADDR: {e} (ignored)");
    }
    vm_fd.create_irq_chip().map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm_fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
    Ok((kvm, vm_fd, backend))
}

/// The port devices, with the serial console's interrupt wired to the in-kernel irqchip;
/// from a snapshot's serial state and CMOS index when given.
pub(crate) fn create_devices(
    vm_fd: &VmFd,
    console_log: &ConsoleLog,
    console_output: ConsoleOutput,
    serial_state: Option<&vm_superio::serial::SerialState>,
    cmos_index: u8,
) -> Result<Arc<PortDevices>, Error> {
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::Console)?;
    vm_fd
        .register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(kvm_err("KVM_IRQFD"))?;
    let writer = ConsoleWriter::new(console_log.clone(), console_output);
    let serial = match serial_state {
        None => Serial::new(IrqLine(serial_irq), writer),
        Some(state) => Serial::from_state(state, IrqLine(serial_irq), vm_superio::serial::NoEvents, writer)
            .map_err(Error::SerialState)?,
    };
    Ok(Arc::new(PortDevices::with_cmos_index(serial, cmos_index)))
}

/// Types on the guest's serial console (see [`Vm::console_input`]).
#[derive(Clone)]
pub struct ConsoleInput {
    devices: Arc<PortDevices>,
    control: Arc<VcpuControl>,
}

impl ConsoleInput {
    /// Queues `bytes` for the guest; returns at once (a thread refills the UART's FIFO as
    /// the guest drains it).
    pub fn send(&self, bytes: Vec<u8>) -> Result<(), Error> {
        feed_console(&self.devices, &self.control, bytes)
    }
}

/// Feeds `bytes` to the serial console: what fits in the UART's FIFO now, before any vCPU
/// runs, the rest from a thread as the guest drains the FIFO.
fn feed_console(devices: &Arc<PortDevices>, control: &Arc<VcpuControl>, bytes: Vec<u8>) -> Result<(), Error> {
    let enqueue = |rest: &[u8]| -> usize {
        devices
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_raw_bytes(rest)
            .unwrap_or(0)
    };
    let sent = enqueue(&bytes);
    if sent == bytes.len() {
        return Ok(());
    }
    let devices = Arc::clone(devices);
    let control = Arc::clone(control);
    std::thread::Builder::new()
        .name("console-feed".into())
        .spawn(move || {
            let mut rest = &bytes[sent..];
            while !rest.is_empty() && control.stop_reason().is_none() {
                let n = devices
                    .serial
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .enqueue_raw_bytes(rest)
                    .unwrap_or(0);
                rest = &rest[n..];
                if n == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
        .map_err(Error::Thread)?;
    Ok(())
}

/// Guest memory ranges (start, length): RAM and the out-of-line area, in address order.
pub(crate) fn memory_ranges(mem_bytes: u64) -> Vec<(GuestAddress, usize)> {
    let mut ranges: Vec<(GuestAddress, usize)> = ram_ranges(mem_bytes)
        .into_iter()
        .map(|(Gpa(start), len)| (GuestAddress(start), len as usize))
        .collect();
    ranges.push((GuestAddress(OOL_AREA_START.0), OOL_AREA_SIZE as usize));
    ranges.sort_by_key(|r| r.0);
    ranges
}

fn create_guest_memory(vm_fd: &VmFd, mem_bytes: u64) -> Result<GuestMemoryMmap, Error> {
    let mem = shareable_guest_memory(mem_bytes)?;
    register_guest_memory(vm_fd, &mem)?;
    Ok(mem)
}

/// Guest memory whose RAM is a memfd mapped `MAP_SHARED`, so that a vhost-user backend
/// (virtiofsd) can map the same pages from the descriptor it is given: RAM region `i` is
/// the memfd at the offset where the RAM regions before it end. The out-of-line area is
/// anonymous memory of its own: a backend holding the memfd can map any offset of it, and
/// must never reach probe code. The memfd is sealed at its size: a backend that shrank
/// it would turn our next access to guest RAM into a SIGBUS.
pub(crate) fn shareable_guest_memory(mem_bytes: u64) -> Result<GuestMemoryMmap, Error> {
    let ram_bytes: u64 = ram_ranges(mem_bytes).iter().map(|&(_, len)| len).sum();
    let memfd = sealed_memfd(c"hvprobe-guest-ram", ram_bytes).map_err(Error::GuestMemoryFile)?;
    let mut offset = 0u64;
    let mut ranges = Vec::new();
    for (start, len) in memory_ranges(mem_bytes) {
        if start.0 == OOL_AREA_START.0 {
            ranges.push((start, len, None));
            continue;
        }
        let file = memfd.try_clone().map_err(Error::GuestMemoryFile)?;
        ranges.push((start, len, Some(FileOffset::new(file, offset))));
        offset += len as u64;
    }
    GuestMemoryMmap::from_ranges_with_files(&ranges).map_err(Error::GuestMemoryAlloc)
}

/// An anonymous memory file of `len` bytes that nobody can grow or shrink.
fn sealed_memfd(name: &std::ffi::CStr, len: u64) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: `name` is a NUL-terminated string that outlives the call; the result is
    // checked before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that only this File owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor this function owns; no memory is involved.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Gives KVM every region of `mem` as a memory slot. The out-of-line area's code half
/// (copies, trampolines, the step guard, detours) gets a slot of its own, read-only to the
/// guest where KVM can (`KVM_CAP_READONLY_MEM`): its page-table mapping is read-only too,
/// but that is a bit in the guest's own tables, and a guest kernel (or a root process
/// through `/dev/mem`, the area not being RAM) could otherwise rewrite our code. A guest
/// write there exits as MMIO and is dropped ([`crate::vcpu`] counts and reports it); the
/// host writes through its own mapping, which the flag does not affect. The rings half
/// stays guest-writable: event detours write their records there.
pub(crate) fn register_guest_memory(vm_fd: &VmFd, mem: &GuestMemoryMmap) -> Result<(), Error> {
    let readonly = vm_fd.check_extension(Cap::ReadonlyMem);
    if !readonly {
        tracing::warn!(
            "KVM has no read-only memory slots here: the out-of-line area's code stays writable by the guest kernel"
        );
    }
    let mut slot = 0u32;
    for region in mem.iter() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(crate::error::mem_err("the host address of a region"))?;
        let (start, len) = (region.start_addr().0, region.len());
        let pieces = if readonly && start == OOL_AREA_START.0 && len == OOL_AREA_SIZE {
            vec![
                (start, OOL_CODE_SIZE, KVM_MEM_READONLY),
                (start + OOL_CODE_SIZE, len - OOL_CODE_SIZE, 0),
            ]
        } else {
            vec![(start, len, 0)]
        };
        for (gpa, size, flags) in pieces {
            let region = kvm_userspace_memory_region {
                slot,
                flags,
                guest_phys_addr: gpa,
                memory_size: size,
                userspace_addr: host as u64 + (gpa - start),
            };
            // SAFETY: the piece lies inside a region mapped for the lifetime of `mem`,
            // which the VM keeps (the vCPU threads hold clones of it while they run).
            unsafe { vm_fd.set_user_memory_region(region) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
            slot += 1;
        }
    }
    Ok(())
}

/// Restores the terminal when the run ends, if it was put in raw mode.
struct TerminalGuard {
    raw: bool,
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        use vmm_sys_util::terminal::Terminal;
        if self.raw {
            let _ = std::io::stdin().lock().set_canon_mode();
        }
    }
}

/// Feeds stdin to the serial console. Ctrl-A x stops the VM (as in QEMU).
fn spawn_console_input(devices: &Arc<PortDevices>, control: &Arc<VcpuControl>) -> Result<TerminalGuard, Error> {
    use vmm_sys_util::terminal::Terminal;
    // SAFETY: isatty has no preconditions.
    let raw = unsafe { libc::isatty(libc::STDIN_FILENO) } == 1;
    if raw {
        std::io::stdin()
            .lock()
            .set_raw_mode()
            .map_err(|e| Error::Console(e.into()))?;
    }
    // The reader gets its own descriptor: reading through `std::io::stdin()` would hold the
    // process-wide stdin lock while blocked, and restoring the terminal needs that lock.
    // SAFETY: dup has no preconditions; the result is checked before use.
    let fd = unsafe { libc::dup(libc::STDIN_FILENO) };
    if fd < 0 {
        return Err(Error::Console(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor that only this File owns.
    let mut stdin = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let devices = Arc::clone(devices);
    let control = Arc::clone(control);
    std::thread::Builder::new()
        .name("console-input".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            let mut escape = false;
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let mut pending = Vec::with_capacity(n);
                for &b in &buf[..n] {
                    if escape {
                        escape = false;
                        if b == b'x' {
                            control.stop(StopReason::Stopped);
                            return;
                        }
                        pending.push(0x01);
                    } else if b == 0x01 {
                        escape = true;
                        continue;
                    }
                    pending.push(b);
                }
                let mut rest: &[u8] = &pending;
                while !rest.is_empty() {
                    let sent = devices
                        .serial
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .enqueue_raw_bytes(rest);
                    match sent {
                        Ok(k) => rest = &rest[k..],
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                    if control.stop_reason().is_some() {
                        return;
                    }
                }
            }
        })
        .map_err(Error::Thread)?;
    Ok(TerminalGuard { raw })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn ram_is_one_sealed_memfd_and_the_out_of_line_area_is_not_in_it() {
        // More than 3 GiB: RAM in two regions, below and above the hole. Nothing is touched,
        // so nothing is allocated.
        let mem_bytes = LOW_RAM_MAX_END_FOR_TEST + (64 << 20);
        let mem = shareable_guest_memory(mem_bytes).unwrap();
        let regions: Vec<_> = mem.iter().collect();
        assert_eq!(regions.len(), 3);
        let ool = mem.find_region(GuestAddress(OOL_AREA_START.0)).unwrap();
        assert!(ool.file_offset().is_none(), "probe code must not be in the shared file");
        let low = mem.find_region(GuestAddress(0)).unwrap().file_offset().unwrap();
        let high = mem
            .find_region(GuestAddress(crate::layout::HIGH_RAM_START))
            .unwrap()
            .file_offset()
            .unwrap();
        assert_eq!((low.start(), high.start()), (0, LOW_RAM_MAX_END_FOR_TEST));
        // One file: what the guest writes in its RAM is in it at the region's offset.
        mem.write_obj(0x1234_5678u32, GuestAddress(crate::layout::HIGH_RAM_START + 8))
            .unwrap();
        let mut word = [0u8; 4];
        low.file()
            .read_exact_at(&mut word, LOW_RAM_MAX_END_FOR_TEST + 8)
            .unwrap();
        assert_eq!(u32::from_le_bytes(word), 0x1234_5678);
        // A backend holding the descriptor can neither shrink nor grow it.
        assert!(low.file().set_len(4096).is_err());
        assert!(low.file().set_len(mem_bytes + 4096).is_err());
    }

    use crate::layout::LOW_RAM_MAX_END as LOW_RAM_MAX_END_FOR_TEST;
}
