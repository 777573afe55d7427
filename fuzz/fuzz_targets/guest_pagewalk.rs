//! Fuzzes page walks through the guest's own page tables
//! (`hvprobe_arch::paging`, `hvprobe_introspection::memory::PagedGuestMemory`): every
//! entry, CR3 and the addresses asked for are the guest's.
//!
//! Valid 4-level tables are built in a sparse guest-physical memory: the kernel image
//! mapped by 2 MiB pages, a direct-map 1 GiB page, a vmalloc'd stack by 4 KiB pages, a
//! 5-level root above the 4-level one. Input: `[mode/MAXPHYADDR: u8] [CR3 low bits: u16]
//! [4 addresses: u64 each] [read lengths: 4 x u16]`, then patches into the tables' and
//! data frames (see `guest_common.rs`). Checked: no panic; a translation lands in the page
//! it names and a read of a translated range returns the bytes of its frames; a vCPU's
//! place there (`hvprobe_introspection::place`) is mapped exactly when the walk translates.
#![no_main]

#[path = "guest_common.rs"]
mod guest_common;

use guest_common::Input;
use hvprobe_arch::paging::{PageWalker, PagingMode, PhysRead};
use hvprobe_arch::{Gpa, Gva};
use hvprobe_introspection::memory::{GuestVirtRead, PagedGuestMemory, SparseMemory};
use hvprobe_introspection::place::{place, Code, BYTES_AT_RIP};
use libfuzzer_sys::fuzz_target;

/// Guest-physical memory: a sparse memory addressed by GPA.
struct Phys(SparseMemory);

impl PhysRead for Phys {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
        self.0.read_virt(Gva(gpa.0), buf).map_err(|e| hvprobe_arch::paging::PhysAccessError::backend(e))
    }
}

const PML5: u64 = 0x0000;
const PML4: u64 = 0x1000;
const PDPT_KERNEL: u64 = 0x2000;
const PDPT_DIRECT: u64 = 0x3000;
const PD_KERNEL: u64 = 0x4000;
const PDPT_VMALLOC: u64 = 0x5000;
const PD_VMALLOC: u64 = 0x6000;
const PT_VMALLOC: u64 = 0x7000;
const DATA: u64 = 0x20_0000;
const P: u64 = 1; // present
const W: u64 = 2;
const PS: u64 = 0x80;
const NX: u64 = 1 << 63;

const KERNEL_VA: u64 = 0xffff_ffff_8100_0000;
const DIRECT_VA: u64 = 0xffff_8880_0000_0000;
const STACK_VA: u64 = 0xffff_c900_0001_0000;

fn index(va: u64, level: u32) -> u64 {
    (va >> (12 + 9 * (level - 1))) & 0x1ff
}

fn build(mem: &mut SparseMemory) {
    mem.put_u64(PML5 + 8 * index(KERNEL_VA, 5), PML4 | P | W);
    mem.put_u64(PML4 + 8 * index(KERNEL_VA, 4), PDPT_KERNEL | P | W);
    mem.put_u64(PDPT_KERNEL + 8 * index(KERNEL_VA, 3), PD_KERNEL | P | W);
    for i in 0..4 {
        mem.put_u64(PD_KERNEL + 8 * (index(KERNEL_VA, 2) + i), (DATA + (i << 21)) | P | PS);
    }
    mem.put_u64(PML4 + 8 * index(DIRECT_VA, 4), PDPT_DIRECT | P | W | NX);
    mem.put_u64(PDPT_DIRECT + 8 * index(DIRECT_VA, 3), P | W | PS | NX);
    mem.put_u64(PML4 + 8 * index(STACK_VA, 4), PDPT_VMALLOC | P | W);
    mem.put_u64(PDPT_VMALLOC + 8 * index(STACK_VA, 3), PD_VMALLOC | P | W);
    mem.put_u64(PD_VMALLOC + 8 * index(STACK_VA, 2), PT_VMALLOC | P | W);
    for i in 0..4 {
        mem.put_u64(
            PT_VMALLOC + 8 * (index(STACK_VA, 1) + i),
            (DATA + 0x1000 * (7 + 2 * i)) | P | W | NX,
        );
    }
    for page in 0..16u64 {
        mem.write(DATA + 0x1000 * page, &[page as u8; 0x1000]);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut mem = SparseMemory::new();
    build(&mut mem);
    let mut input = Input::new(data);
    let mode_byte = input.u8();
    let level5 = mode_byte & 1 != 0;
    let cr3_low = u64::from(input.u16()) & 0xfff;
    let mut addrs = [
        KERNEL_VA + 0x123,
        DIRECT_VA + DATA + 0x20,
        STACK_VA + 0xff8,
        KERNEL_VA + (2 << 20) - 4,
    ];
    for a in &mut addrs {
        *a ^= input.u64();
    }
    let mut lens = [0usize; 4];
    for l in &mut lens {
        *l = usize::from(input.u16());
    }
    input.patch(
        &mut mem,
        &[
            PML5,
            PML4,
            PDPT_KERNEL,
            PDPT_DIRECT,
            PD_KERNEL,
            PDPT_VMALLOC,
            PD_VMALLOC,
            PT_VMALLOC,
            DATA,
        ],
    );
    let mode = if level5 { PagingMode::Level5 } else { PagingMode::Level4 };
    let walker = PageWalker::new(mode).with_max_phys_bits(mode_byte >> 1);
    let cr3 = if level5 { PML5 } else { PML4 } | cr3_low;
    let snapshot = mem.clone();
    let guest = PagedGuestMemory::with_walker(Phys(mem), cr3, walker);
    for (addr, len) in addrs.into_iter().zip(lens) {
        if let Ok(t) = guest.translate(Gva(addr)) {
            // The frame it names holds the byte read through the walk.
            let mut through = [0u8; 1];
            let mut direct = [0u8; 1];
            if guest.read_virt(Gva(addr), &mut through).is_ok() && snapshot.read_virt(Gva(t.gpa.0), &mut direct).is_ok()
            {
                assert_eq!(through, direct, "{addr:#x} -> {}", t.gpa);
            }
        }
        let mut buf = vec![0u8; len];
        let _ = guest.read_virt(Gva(addr), &mut buf);
        // A vCPU's place at the address (a run stopped from outside reports it): mapped
        // exactly when the walk translates, never more than its bytes.
        match place(&guest, None, Gva(addr), true).code {
            Code::Mapped { bytes, .. } => {
                assert!(guest.translate(Gva(addr)).is_ok());
                assert!(bytes.map_or(0, |b| b.len()) <= BYTES_AT_RIP);
            }
            Code::Unmapped(_) => assert!(guest.translate(Gva(addr)).is_err()),
        }
    }
});
