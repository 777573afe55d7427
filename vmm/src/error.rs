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
    #[error("invalid VM configuration: {0}")]
    Config(String),
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
    #[error("cannot set up guest memory: {0}")]
    GuestMemory(String),
    #[error("cannot write boot parameters: {0}")]
    BootParams(String),
    #[error("cannot start vCPU thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("signal set-up failed: {0}")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("console: {0}")]
    Console(#[source] std::io::Error),
}

/// Adapter for `map_err` on KVM ioctls: names the ioctl in the error.
pub(crate) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}
