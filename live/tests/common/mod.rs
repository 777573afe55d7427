//! What the code-blob tests of event detours and return detours share: the KVM check,
//! the out-of-line area mapped into a blob VM, and the region a jump displaces at a blob's
//! function.
#![allow(dead_code)]

use hvprobe_arch::Gva;
use hvprobe_introspection::facts::ExceptionTable;
use hvprobe_probes::detour::{plan_region, Code, DetourFacts, DetourRegion, FunctionText, IndirectThunks};
use hvprobe_probes::engine::PatchSites;
use hvprobe_vmm::layout::{OOL_AREA_START, OOL_CODE_SIZE, PDE_START};
use hvprobe_vmm::{CodeBlob, Vm, CODE_BLOB_START};
use vm_memory::{Bytes, GuestAddress};

pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        panic!("this test runs code blobs and needs /dev/kvm, which cannot be opened: {e}");
    }
}

/// A code-blob VM running `code` on `cpus` vCPUs, with the out-of-line area mapped at
/// [`hvprobe_live::CODE_BLOB_OOL_VA`]: the second page directory covers 1..2 GiB, its first
/// two 2 MiB pages are the area's code half (read-only to the guest: its own memory slot)
/// and its writable half.
pub fn blob_vm(code: Vec<u8>, cpus: u8) -> Vm {
    require_kvm();
    let vm = Vm::new_code_blob(&CodeBlob {
        code,
        cpus,
        handlers: Vec::new(),
    })
    .unwrap_or_else(|e| panic!("this test needs a usable /dev/kvm: {e}"));
    for (i, half) in [0, OOL_CODE_SIZE].into_iter().enumerate() {
        vm.memory()
            .write_obj(
                (OOL_AREA_START.0 + half) | 0x83,
                GuestAddress(PDE_START + 0x1000 + 8 * i as u64),
            )
            .unwrap();
    }
    vm
}

/// The region a jump at `func` displaces, planned on the blob `code`'s bytes there
/// (`lea` and a RIP-relative `mov`, 11 bytes, in both tests' functions).
pub fn blob_region(code: &[u8], func: u64) -> DetourRegion {
    let at = (func - CODE_BLOB_START) as usize;
    let (ex, sites, thunks) = (
        ExceptionTable::default(),
        PatchSites::default(),
        IndirectThunks::default(),
    );
    let function = FunctionText {
        body: Code {
            start: Gva(func),
            bytes: &code[at..at + 0x100],
        },
        ftrace_site: None,
        split_parts: &[],
    };
    let facts = DetourFacts {
        ex_table: &ex,
        patch_sites: &sites,
        thunks: &thunks,
    };
    let region = plan_region(Gva(func), &function, &facts, &[]).unwrap();
    assert_eq!(region.size(), 11, "lea + RIP-relative mov");
    region
}
