use std::path::PathBuf;

/// Errors of the VMM. Each says what failed and on what.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open /dev/kvm: {0} (is KVM available and are you allowed to use it?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("{op} failed: {source}")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("{cpus} vCPUs requested: 1 to {max} are supported")]
    CpuCount { cpus: u8, max: u8 },
    #[error("{mib} MiB of guest memory requested: {min} to {max} MiB are supported")]
    MemorySize { mib: u64, min: u64, max: u64 },
    #[error("no vCPU {0} (or it is running)")]
    NoSuchVcpu(usize),
    #[error("a vCPU thread panicked; its state is lost")]
    VcpuStateLost,
    #[error("vCPU {cpu} exited with {exit} while its pending exit was completed")]
    PendingExit { cpu: usize, exit: String },
    #[error("vCPU {0} kept exiting while its pending exit was completed")]
    PendingExitLoop(usize),
    #[error("a list of {what} for KVM: {source}")]
    KvmList {
        what: &'static str,
        #[source]
        source: vmm_sys_util::fam::Error,
    },
    #[error("MSR {0:#x} is not readable")]
    MsrUnreadable(u32),
    #[error("the snapshot's serial port state is refused: {0}")]
    SerialState(#[source] vm_superio::serial::Error<std::io::Error>),
    #[error("cannot read kernel {path}: {source}")]
    KernelFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a kernel this VMM can boot: {reason}")]
    NotAKernel { path: PathBuf, reason: String },
    #[error("cannot load the kernel {path}: {source}")]
    KernelLoad {
        path: PathBuf,
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error("cannot read initrd {path}: {source}")]
    InitrdFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the initrd ({size} bytes) does not fit in guest memory below {limit:#x}")]
    InitrdTooBig { size: usize, limit: u64 },
    #[error("kernel command line too long: {len} bytes, the limit is {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("cannot allocate guest memory: {0}")]
    GuestMemoryAlloc(#[source] vm_memory::mmap::FromRangesError),
    #[error("cannot create the guest memory file (memfd): {0}")]
    GuestMemoryFile(#[source] std::io::Error),
    #[error("cannot lay out guest memory: {0}")]
    GuestMemoryLayout(#[source] vm_memory::GuestRegionCollectionError),
    #[error("cannot map guest memory from {path}: {source}")]
    GuestMemoryMap {
        path: PathBuf,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("a guest memory region at {0:#x} overflows the address space")]
    RegionOverflow(u64),
    #[error("guest memory, {what}: {source}")]
    GuestMemory {
        what: &'static str,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("the kernel command line: {0}")]
    Cmdline(#[source] linux_loader::cmdline::Error),
    #[error("cannot write the kernel command line: {0}")]
    CmdlineWrite(#[source] linux_loader::loader::Error),
    #[error("cannot write the boot parameters: {0}")]
    BootParams(#[source] linux_loader::configurator::Error),
    #[error("cannot start vCPU thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("signal set-up failed: {0}")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("console: {0}")]
    Console(#[source] std::io::Error),
    #[error(transparent)]
    Disk(#[from] crate::virtio::block::DiskError),
    #[error(transparent)]
    SharedDirectory(#[from] crate::virtio::fs::FsError),
    #[error("{count} virtio devices requested: at most {max} are supported")]
    TooManyDevices { count: usize, max: usize },
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("a virtio queue: {0}")]
    VirtioQueue(virtio_queue::Error),
}

/// Adapter for `map_err` on guest memory accesses: names what was read or written.
pub(crate) fn mem_err(what: &'static str) -> impl FnOnce(vm_memory::GuestMemoryError) -> Error {
    move |source| Error::GuestMemory { what, source }
}

/// Adapter for `map_err` on building a list for KVM (MSRs, CPUID entries).
pub(crate) fn list_err(what: &'static str) -> impl FnOnce(vmm_sys_util::fam::Error) -> Error {
    move |source| Error::KvmList { what, source }
}

/// Adapter for `map_err` on KVM ioctls: names the ioctl in the error.
pub(crate) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}
