//! A vCPU's general registers during an exit, through `kvm_run`'s sync area where KVM has
//! one (`KVM_CAP_SYNC_REGS` with `KVM_SYNC_X86_REGS`, on kvm_pvm and hardware KVM alike):
//! KVM copies the registers out at every exit and takes them back at the next entry when
//! they are marked dirty, so an exit that reads and writes them — a probe hit — makes no
//! `KVM_GET_REGS`/`KVM_SET_REGS` ioctl (`hvprobe bench probes` on kvm_pvm: an int3 exit
//! that moves RIP costs 7.1 µs through the area, 16.7 µs with the two ioctls).
//!
//! The invariant, for a vCPU whose exit loop turned the area on ([`enable`]): while its
//! thread is out of KVM_RUN, the area holds the registers the vCPU will run with. Every
//! read and write in the exit loop and its handlers goes through [`read`] and [`write`];
//! before anything else reads the registers by ioctl — a pause's parked state, a
//! re-injected #BP, the end of the run — [`flush`] hands a write KVM has not taken yet to
//! KVM. A vCPU without the area (or before its loop ran) uses the ioctls, unchanged.

use kvm_bindings::{kvm_regs, KVM_SYNC_X86_REGS};
use kvm_ioctls::{Cap, Kvm, SyncReg, VcpuFd};

use crate::{kvm_err, Error};

/// Whether KVM offers the sync area for general registers.
pub fn supported(kvm: &Kvm) -> bool {
    let mask = kvm.check_extension_int(Cap::SyncRegs);
    mask > 0 && (mask as u64) & u64::from(KVM_SYNC_X86_REGS) != 0
}

/// Turns the area on: seeded with the registers now (until the first KVM_RUN KVM has
/// written nothing there), then refreshed by KVM at every exit.
pub fn enable(vcpu: &mut VcpuFd) -> Result<(), Error> {
    let regs = vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    vcpu.sync_regs_mut().regs = regs;
    vcpu.set_sync_valid_reg(SyncReg::Register);
    Ok(())
}

fn on(vcpu: &mut VcpuFd) -> bool {
    vcpu.get_kvm_run().kvm_valid_regs & u64::from(KVM_SYNC_X86_REGS) != 0
}

fn dirty(vcpu: &mut VcpuFd) -> bool {
    vcpu.get_kvm_run().kvm_dirty_regs & u64::from(KVM_SYNC_X86_REGS) != 0
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

/// Hands a [`write`] KVM has not taken yet to KVM now, so that an ioctl read sees it.
pub fn flush(vcpu: &mut VcpuFd) -> Result<(), Error> {
    if on(vcpu) && dirty(vcpu) {
        let regs = vcpu.sync_regs().regs;
        vcpu.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        vcpu.clear_sync_dirty_reg(SyncReg::Register);
    }
    Ok(())
}

/// Turns the area off (after a [`flush`]): the vCPU leaves its exit loop, and whoever
/// has it next reads its registers by ioctl.
pub fn disable(vcpu: &mut VcpuFd) -> Result<(), Error> {
    flush(vcpu)?;
    vcpu.clear_sync_valid_reg(SyncReg::Register);
    Ok(())
}
