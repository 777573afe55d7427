//! What the code-blob tests share (each test file is a binary of its own and includes
//! this module).

use hvprobe_vmm::{CodeBlob, Vm};

/// A code-blob VM running `code` on `cpus` vCPUs, with the guest's own interrupt and
/// exception handlers at `handlers` ((vector, offset in `code`)).
pub fn blob_vm(code: &[u8], cpus: u8, handlers: &[(u8, u64)]) -> Vm {
    Vm::new_code_blob(&CodeBlob {
        code: code.to_vec(),
        cpus,
        handlers: handlers.to_vec(),
    })
    .unwrap_or_else(|e| panic!("this test needs a usable /dev/kvm: {e}"))
}
