//! Entry state of the boot vCPU for the two boot protocols, and the set-up every vCPU
//! needs (MSRs, FPU, LAPIC local interrupts).

use hvprobe_arch::regs::{cr0, cr4, efer};
use hvprobe_arch::tsc::{host_tsc, TscSample};
use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::*;
use crate::{kvm_err, Error};

/// How the boot vCPU enters the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// PVH: 32-bit protected mode, paging off, EBX = start_info.
    Pvh { entry: u64 },
    /// Linux 64-bit boot protocol: long mode with identity page tables, RSI = zero page.
    Linux64 { entry: u64 },
}

/// A GDT entry from its parts (the packed format of the SDM, vol. 3, 3.4.5).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

fn segment_from_gdt(entry: u64, table_index: u16) -> kvm_segment {
    let get = |shift: u32, bits: u32| ((entry >> shift) & ((1 << bits) - 1)) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: {
            let raw = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
            if get(55, 1) == 1 {
                (raw << 12) | 0xfff
            } else {
                raw
            }
        },
        selector: table_index * 8,
        type_: get(40, 4),
        present: get(47, 1),
        dpl: get(45, 2),
        db: get(54, 1),
        s: get(44, 1),
        l: get(53, 1),
        g: get(55, 1),
        avl: get(52, 1),
        unusable: if get(47, 1) == 0 { 1 } else { 0 },
        padding: 0,
    }
}

/// Sets registers, segments, control registers (and for 64-bit entry the identity page
/// tables) of the boot vCPU.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, mem: &GuestMemoryMmap, mode: EntryMode, boot_info: u64) -> Result<(), Error> {
    let (code, gdt) = match mode {
        EntryMode::Pvh { .. } => (
            1,
            [
                gdt_entry(0, 0, 0),
                gdt_entry(0xc09b, 0, 0xfffff), // 32-bit code
                gdt_entry(0xc093, 0, 0xfffff), // data
                gdt_entry(0x008b, 0, 0x67),    // TSS
            ],
        ),
        EntryMode::Linux64 { .. } => (
            1,
            [
                gdt_entry(0, 0, 0),
                gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code
                gdt_entry(0xc093, 0, 0xfffff), // data
                gdt_entry(0x008b, 0, 0x67),    // TSS
            ],
        ),
    };
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_START + i as u64 * 8))
            .map_err(crate::error::mem_err("writing the GDT"))?;
    }
    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = segment_from_gdt(gdt[code], code as u16);
    let data = segment_from_gdt(gdt[2], 2);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(gdt[3], 3);

    let mut regs = kvm_regs {
        rflags: 0x2,
        ..Default::default()
    };
    match mode {
        EntryMode::Pvh { entry } => {
            sregs.cr0 = cr0::PE | cr0::ET;
            sregs.cr4 = 0;
            sregs.efer = 0;
            regs.rip = entry;
            regs.rbx = boot_info;
        }
        EntryMode::Linux64 { entry } => {
            write_identity_page_tables(mem)?;
            sregs.cr3 = PML4_START;
            sregs.cr4 = cr4::PAE;
            sregs.cr0 = cr0::PE | cr0::ET | cr0::PG;
            sregs.efer = efer::LME | efer::LMA;
            regs.rip = entry;
            regs.rsi = boot_info;
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
        }
    }
    vcpu.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
    vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
    Ok(())
}

/// Identity-maps the first 4 GiB with 2 MiB pages.
fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<(), Error> {
    let w = |v: u64, at: u64| {
        mem.write_obj(v, GuestAddress(at))
            .map_err(crate::error::mem_err("writing the boot page tables"))
    };
    w(PDPTE_START | 0x3, PML4_START)?;
    for gib in 0..4u64 {
        let pd = PDE_START + gib * 0x1000;
        w(pd | 0x3, PDPTE_START + gib * 8)?;
        for i in 0..512u64 {
            // present | writable | page size (2 MiB)
            w(((gib << 30) + (i << 21)) | 0x83, pd + i * 8)?;
        }
    }
    Ok(())
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

/// The architectural LSTAR MSR (syscall entry point): the KASLR slide is read from it.
pub const MSR_LSTAR_INDEX: u32 = MSR_LSTAR;
/// The GS base swapped in by `swapgs`.
pub const MSR_KERNEL_GS_BASE_INDEX: u32 = MSR_KERNEL_GS_BASE;

/// MSRs every vCPU starts with: cleared syscall MSRs, TSC 0 (so all vCPUs' TSCs agree),
/// fast strings, MTRRs enabled with write-back default.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), Error> {
    let entry = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let entries = [
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, 1),
        entry(MSR_MTRR_DEF_TYPE, (1 << 11) | 6),
    ];
    let msrs = Msrs::from_entries(&entries).map_err(crate::error::list_err("MSRs"))?;
    let written = vcpu.set_msrs(&msrs).map_err(kvm_err("KVM_SET_MSRS"))?;
    if written != entries.len() {
        tracing::debug!(
            "KVM accepted {written} of {} boot MSRs; first refused: {:#x}",
            entries.len(),
            entries[written].index
        );
    }
    Ok(())
}

/// `MSR_KVM_SYSTEM_TIME_NEW`: the guest-physical address of a vCPU's kvm-clock page.
pub const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;

/// The MSRs a vCPU's published state carries (see [`crate::VcpuState`]).
#[derive(Clone, Copy, Debug)]
pub struct StateMsrs {
    pub lstar: u64,
    pub kernel_gs_base: u64,
    pub kvm_system_time: u64,
}

/// Reads LSTAR, the kernel GS base and the kvm-clock MSR in one `KVM_GET_MSRS` (a pause
/// reads them for every vCPU). KVM stops at the first MSR it refuses: the first two are
/// required, the kvm-clock one reads 0 when refused.
pub fn read_state_msrs(vcpu: &VcpuFd) -> Result<StateMsrs, Error> {
    let indices = [MSR_LSTAR, MSR_KERNEL_GS_BASE, MSR_KVM_SYSTEM_TIME_NEW];
    let entries = indices.map(|index| kvm_msr_entry {
        index,
        ..Default::default()
    });
    let mut msrs = Msrs::from_entries(&entries).map_err(crate::error::list_err("MSRs"))?;
    let n = vcpu.get_msrs(&mut msrs).map_err(kvm_err("KVM_GET_MSRS"))?;
    let values: Vec<u64> = msrs.as_slice()[..n.min(indices.len())].iter().map(|e| e.data).collect();
    if values.len() < 2 {
        return Err(Error::MsrUnreadable(indices[values.len()]));
    }
    Ok(StateMsrs {
        lstar: values[0],
        kernel_gs_base: values[1],
        kvm_system_time: values.get(2).copied().unwrap_or(0),
    })
}

/// Brackets taken per [`sample_tsc`]: the host thread can be preempted inside one. Measured
/// on kvm_pvm here (2,000 reads on a busy host): the ioctl takes 4.8–6.8 µs (10th–90th
/// percentile), 1 % of single brackets were more than twice the narrowest, no best of 3 was.
const TSC_SAMPLES: usize = 3;

/// The vCPU's TSC (`KVM_GET_MSRS` of `IA32_TSC` alone, which KVM computes from its own
/// `rdtsc`) between two host TSC reads: the narrowest of a few brackets. `None` when KVM
/// will not read it.
pub fn sample_tsc(vcpu: &VcpuFd) -> Option<TscSample> {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_IA32_TSC,
        ..Default::default()
    }])
    .ok()?;
    let mut best: Option<TscSample> = None;
    for _ in 0..TSC_SAMPLES {
        let host_before = host_tsc();
        let read = vcpu.get_msrs(&mut msrs);
        let host_after = host_tsc();
        if read.ok()? != 1 {
            return None;
        }
        let sample = TscSample {
            host_before,
            guest: msrs.as_slice()[0].data,
            host_after,
        };
        if sample.is_ordered() && best.is_none_or(|b| sample.width() < b.width()) {
            best = Some(sample);
        }
    }
    best
}

pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), Error> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm_err("KVM_SET_FPU"))
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// LINT0 delivers the PIC's interrupts (ExtINT), LINT1 NMIs, as a BIOS would set them.
pub fn setup_lapic_lint(vcpu: &VcpuFd) -> Result<(), Error> {
    let mut lapic = vcpu.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
    let regs = &mut lapic.regs;
    let get = |regs: &[std::os::raw::c_char], at: usize| {
        u32::from_le_bytes([
            regs[at] as u8,
            regs[at + 1] as u8,
            regs[at + 2] as u8,
            regs[at + 3] as u8,
        ])
    };
    let set = |regs: &mut [std::os::raw::c_char], at: usize, v: u32| {
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            regs[at + i] = *b as std::os::raw::c_char;
        }
    };
    let delivery = |reg: u32, mode: u32| (reg & !0x700) | (mode << 8);
    let lvt0 = get(regs, APIC_LVT0);
    set(regs, APIC_LVT0, delivery(lvt0, APIC_MODE_EXTINT));
    let lvt1 = get(regs, APIC_LVT1);
    set(regs, APIC_LVT1, delivery(lvt1, APIC_MODE_NMI));
    vcpu.set_lapic(&lapic).map_err(kvm_err("KVM_SET_LAPIC"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_the_segments_kvm_expects() {
        let code64 = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(
            (code64.l, code64.db, code64.type_, code64.present, code64.s),
            (1, 0, 0xb, 1, 1)
        );
        assert_eq!(code64.limit, 0xffff_ffff);
        assert_eq!(code64.selector, 8);
        let code32 = segment_from_gdt(gdt_entry(0xc09b, 0, 0xfffff), 1);
        assert_eq!((code32.l, code32.db, code32.g), (0, 1, 1));
        let tss = segment_from_gdt(gdt_entry(0x008b, 0, 0x67), 3);
        assert_eq!((tss.type_, tss.limit, tss.g, tss.selector), (0xb, 0x67, 0, 24));
    }
}
