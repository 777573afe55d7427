//! The CPUID the guest sees.
//!
//! Starts from what KVM supports and adjusts: the topology per vCPU, and on kvm_pvm the
//! features whose instructions KVM's emulator cannot execute at CPL0 (the guest kernel
//! would pick them by CPUID and die with an emulation failure), plus the KVM
//! paravirtual features whose hypercalls never complete there. On kvm_pvm the guest does
//! not see our basic leaves (see [`crate::Backend::kernel_cmdline_fixups`], which covers
//! them); it does see the KVM leaves.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use crate::backend::Backend;
use crate::{kvm_err, Error};

/// One feature bit: (leaf, subleaf, register, bit, name).
#[derive(Clone, Copy, Debug)]
pub struct FeatureBit {
    pub leaf: u32,
    pub subleaf: u32,
    pub reg: Reg,
    pub bit: u32,
    pub name: &'static str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reg {
    Ebx,
    Ecx,
    Edx,
    Eax,
}

const fn bit(leaf: u32, subleaf: u32, reg: Reg, bit: u32, name: &'static str) -> FeatureBit {
    FeatureBit {
        leaf,
        subleaf,
        reg,
        bit,
        name,
    }
}

/// Features hidden from a guest on kvm_pvm, each because an instruction it enables fails in
/// (or is absent from) KVM's emulator when the guest kernel executes it.
pub const PVM_HIDDEN_FEATURES: &[FeatureBit] = &[
    bit(1, 0, Reg::Ecx, 13, "cx16 (cmpxchg16b)"),
    bit(1, 0, Reg::Ecx, 23, "popcnt"),
    bit(1, 0, Reg::Ecx, 26, "xsave"),
    bit(1, 0, Reg::Ecx, 27, "osxsave"),
    bit(1, 0, Reg::Ecx, 28, "avx (needs xsave)"),
    bit(1, 0, Reg::Ecx, 30, "rdrand"),
    bit(1, 0, Reg::Ecx, 3, "monitor/mwait"),
    bit(7, 0, Reg::Ebx, 0, "fsgsbase"),
    bit(7, 0, Reg::Ebx, 5, "avx2"),
    bit(7, 0, Reg::Ebx, 9, "erms"),
    bit(7, 0, Reg::Ebx, 10, "invpcid"),
    bit(7, 0, Reg::Ebx, 16, "avx512f"),
    bit(7, 0, Reg::Ebx, 18, "rdseed"),
    bit(7, 0, Reg::Ebx, 20, "smap (clac/stac)"),
    bit(7, 0, Reg::Ecx, 3, "pku"),
    bit(7, 0, Reg::Ecx, 4, "ospke"),
    bit(7, 0, Reg::Ecx, 16, "la57 (5-level paging)"),
    bit(7, 0, Reg::Ecx, 22, "rdpid"),
    bit(7, 0, Reg::Edx, 4, "fsrm"),
    bit(0x8000_0001, 0, Reg::Ecx, 5, "abm (lzcnt)"),
    bit(1, 0, Reg::Ecx, 17, "pcid"),
];

/// KVM paravirtual features (leaf 0x4000_0001 EAX) the guest may use on kvm_pvm. The others
/// are hidden: PV IPIs, sched-yield and TLB flush use a `vmcall` that never completes
/// there (a second vCPU hangs in it), PV unhalt needs the same, async page faults and
/// steal time add work for nothing.
const PVM_KVM_FEATURES_KEPT: u32 = (1 << 0) // clocksource
    | (1 << 1) // nop io delay
    | (1 << 3) // clocksource2
    | (1 << 24); // clocksource stable bit

const KVM_CPUID_FEATURES: u32 = 0x4000_0001;

/// Builds the CPUID for vCPU `cpu_index` of `cpu_count`.
pub fn guest_cpuid(kvm: &Kvm, backend: Backend, cpu_index: u8, cpu_count: u8) -> Result<CpuId, Error> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            1 => {
                // Initial APIC id, logical processor count, HTT.
                entry.ebx = (entry.ebx & 0x0000_ffff) | (u32::from(cpu_index) << 24) | (u32::from(cpu_count) << 16);
                if cpu_count > 1 {
                    entry.edx |= 1 << 28;
                }
                // The guest runs under a hypervisor.
                entry.ecx |= 1 << 31;
            }
            0xb | 0x1f => {
                // Extended topology: one thread per core, `cpu_count` cores per package.
                entry.edx = u32::from(cpu_index);
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    1 => {
                        entry.eax = u32::from(cpu_count).next_power_of_two().trailing_zeros();
                        entry.ebx = u32::from(cpu_count);
                        entry.ecx = (2 << 8) | 1;
                    }
                    n => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = n;
                    }
                }
            }
            _ => {}
        }
        if backend == Backend::Pvm {
            for hidden in PVM_HIDDEN_FEATURES {
                if entry.function == hidden.leaf && entry.index == hidden.subleaf {
                    let reg = match hidden.reg {
                        Reg::Eax => &mut entry.eax,
                        Reg::Ebx => &mut entry.ebx,
                        Reg::Ecx => &mut entry.ecx,
                        Reg::Edx => &mut entry.edx,
                    };
                    *reg &= !(1 << hidden.bit);
                }
            }
            if entry.function == 0xd {
                // No xsave: no xsave state components either.
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            if entry.function == KVM_CPUID_FEATURES {
                entry.eax &= PVM_KVM_FEATURES_KEPT;
            }
        }
    }
    Ok(cpuid)
}
