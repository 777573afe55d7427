//! A vCPU's general registers (and, where KVM offers them there too, its segment and
//! control registers) during an exit, through `kvm_run`'s sync area where KVM has one
//! (`KVM_CAP_SYNC_REGS` with `KVM_SYNC_X86_REGS` and `KVM_SYNC_X86_SREGS`, on kvm_pvm and
//! hardware KVM alike):
//! KVM copies the registers out at every exit and takes them back at the next entry when
//! they are marked dirty, so an exit that reads and writes them — a probe hit — makes no
//! `KVM_GET_REGS`/`KVM_SET_REGS` ioctl (`hvprobe bench probes` on kvm_pvm: an int3 exit
//! that moves RIP costs 7.1 µs through the area, 16.7 µs with the two ioctls).
//!
//! The invariant, for a vCPU whose exit loop turned the area on ([`enable`]): while its
//! thread is out of KVM_RUN, the area holds the registers the vCPU will run with. Every
//! read and write in the exit loop and its handlers goes through [`read`] and [`write`]
//! ([`read_sregs`] and [`write_sregs`] for the segment and control registers: a stepped
//! hit points the IDTR at the step guard's and back, and a hit that names its task reads
//! CR3 and the GS base, with no ioctl);
//! before anything else reads the registers by ioctl — a pause's parked state, a
//! re-injected #BP, the end of the run — [`flush`] hands a write KVM has not taken yet to
//! KVM. A vCPU without the area (or before its loop ran) uses the ioctls, unchanged.

use kvm_bindings::{kvm_regs, kvm_sregs, KVM_SYNC_X86_REGS, KVM_SYNC_X86_SREGS};
use kvm_ioctls::{Cap, Kvm, SyncReg, VcpuFd};

use crate::{kvm_err, Error};

/// Whether KVM offers the sync area for general registers.
pub fn supported(kvm: &Kvm) -> bool {
    let mask = kvm.check_extension_int(Cap::SyncRegs);
    mask > 0 && (mask as u64) & u64::from(KVM_SYNC_X86_REGS) != 0
}

/// Whether KVM offers the segment and control registers there too.
pub fn sregs_supported(kvm: &Kvm) -> bool {
    let mask = kvm.check_extension_int(Cap::SyncRegs);
    mask > 0 && (mask as u64) & u64::from(KVM_SYNC_X86_SREGS) != 0
}

/// Turns the area on for the general registers, and with `sregs` for the segment and
/// control registers: seeded with them now (until the first KVM_RUN KVM has written
/// nothing there), then refreshed by KVM at every exit.
pub fn enable(vcpu: &mut VcpuFd, sregs: bool) -> Result<(), Error> {
    let regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    vcpu.sync_regs_mut().regs = regs;
    vcpu.set_sync_valid_reg(SyncReg::Register);
    if sregs {
        let s = vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        vcpu.sync_regs_mut().sregs = s;
        vcpu.set_sync_valid_reg(SyncReg::SystemRegister);
    }
    Ok(())
}

/// Whether KVM copies the registers of `part` (`KVM_SYNC_X86_*`) out at every exit.
fn valid(vcpu: &mut VcpuFd, part: u32) -> bool {
    vcpu.get_kvm_run().kvm_valid_regs & u64::from(part) != 0
}

/// Whether the area holds a write of `part` KVM has not taken yet.
fn dirty(vcpu: &mut VcpuFd, part: u32) -> bool {
    vcpu.get_kvm_run().kvm_dirty_regs & u64::from(part) != 0
}

fn on(vcpu: &mut VcpuFd) -> bool {
    valid(vcpu, KVM_SYNC_X86_REGS)
}

fn sregs_on(vcpu: &mut VcpuFd) -> bool {
    valid(vcpu, KVM_SYNC_X86_SREGS)
}

/// The segment and control registers the vCPU will run with.
pub fn read_sregs(vcpu: &mut VcpuFd) -> Result<kvm_sregs, Error> {
    match sregs_on(vcpu) {
        true => Ok(vcpu.sync_regs().sregs),
        false => vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS")),
    }
}

/// Sets the segment and control registers the vCPU will run with (taken by KVM at its
/// next entry).
pub fn write_sregs(vcpu: &mut VcpuFd, sregs: &kvm_sregs) -> Result<(), Error> {
    match sregs_on(vcpu) {
        true => {
            vcpu.sync_regs_mut().sregs = *sregs;
            vcpu.set_sync_dirty_reg(SyncReg::SystemRegister);
            Ok(())
        }
        false => vcpu.set_sregs(sregs).map_err(kvm_err("KVM_SET_SREGS")),
    }
}

/// [`flush`] of the general registers only: what `KVM_SET_GUEST_DEBUG` reads (it notes
/// the RIP and RFLAGS a step starts from), leaving a segment-register write to the entry.
pub fn flush_regs(vcpu: &mut VcpuFd) -> Result<(), Error> {
    if on(vcpu) && dirty(vcpu, KVM_SYNC_X86_REGS) {
        let regs = vcpu.sync_regs().regs;
        vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        vcpu.clear_sync_dirty_reg(SyncReg::Register);
    }
    Ok(())
}

/// The registers the vCPU will run with.
pub fn read(vcpu: &mut VcpuFd) -> Result<kvm_regs, Error> {
    match on(vcpu) {
        true => Ok(vcpu.sync_regs().regs),
        false => vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS")),
    }
}

/// Sets the registers the vCPU will run with (taken by KVM at its next entry).
pub fn write(vcpu: &mut VcpuFd, regs: &kvm_regs) -> Result<(), Error> {
    match on(vcpu) {
        true => {
            vcpu.sync_regs_mut().regs = *regs;
            vcpu.set_sync_dirty_reg(SyncReg::Register);
            Ok(())
        }
        false => vcpu.set_regs(regs).map_err(kvm_err("KVM_SET_REGS")),
    }
}

/// Hands a [`write`] or [`write_sregs`] KVM has not taken yet to KVM now, so that an
/// ioctl read sees it.
pub fn flush(vcpu: &mut VcpuFd) -> Result<(), Error> {
    flush_regs(vcpu)?;
    if sregs_on(vcpu) && dirty(vcpu, KVM_SYNC_X86_SREGS) {
        let sregs = vcpu.sync_regs().sregs;
        vcpu.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
        vcpu.clear_sync_dirty_reg(SyncReg::SystemRegister);
    }
    Ok(())
}

/// Turns the area off (after a [`flush`]): the vCPU leaves its exit loop, and whoever
/// has it next reads its registers by ioctl.
pub fn disable(vcpu: &mut VcpuFd) -> Result<(), Error> {
    flush(vcpu)?;
    vcpu.clear_sync_valid_reg(SyncReg::Register);
    vcpu.clear_sync_valid_reg(SyncReg::SystemRegister);
    Ok(())
}
