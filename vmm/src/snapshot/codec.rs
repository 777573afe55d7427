//! The state file's byte codec: KVM's UAPI structures as their bytes ([`Pod`]), and the
//! little-endian writer and the bounds-checked reader the format is made of. A reader
//! error names the field and the file.

use std::path::Path;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};

use super::SnapshotError;

/// KVM UAPI structures saved as their bytes.
///
/// # Safety
/// Implementors are `repr(C)` structures of integers (or arrays and unions of them) with
/// every padding byte an explicit field, so all their bytes are initialised and every bit
/// pattern is a valid value. kvm-bindings proves the former for all of them but `kvm_fpu`
/// by deriving `zerocopy::IntoBytes` under its `serde` feature; `kvm_fpu` names its padding
/// (`pad1`, `pad2`) and its fields are naturally aligned.
pub(super) unsafe trait Pod: Sized {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_regs {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_sregs {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_fpu {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_xsave {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_xcrs {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_lapic_state {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_vcpu_events {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_mp_state {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_debugregs {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_irqchip {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_pit_state2 {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_clock_data {}
// SAFETY: see the trait.
unsafe impl Pod for kvm_cpuid_entry2 {}

pub(super) fn pod_bytes<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: `T: Pod` has no uninitialised bytes; the slice covers exactly `*v`, which
    // outlives it.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// The state file being written.
#[derive(Default)]
pub(super) struct StateWriter(pub(super) Vec<u8>);

impl StateWriter {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(super) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    pub(super) fn pod<T: Pod>(&mut self, v: &T) {
        self.bytes(pod_bytes(v));
    }
    pub(super) fn opt_pod<T: Pod>(&mut self, v: Option<&T>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.pod(v);
            }
            None => self.u8(0),
        }
    }
}

/// The state file's payload being parsed (its checksum has been verified).
pub(super) struct StateReader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
    pub(super) path: &'a Path,
}

impl<'a> StateReader<'a> {
    pub(super) fn malformed(&self, detail: String) -> SnapshotError {
        SnapshotError::Malformed {
            path: self.path.into(),
            detail,
        }
    }
    pub(super) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], SnapshotError> {
        if self.buf.len() - self.pos < n {
            return Err(self.malformed(format!("{what} runs past the end of the state")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(super) fn u8(&mut self, what: &str) -> Result<u8, SnapshotError> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u16(&mut self, what: &str) -> Result<u16, SnapshotError> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    pub(super) fn bool(&mut self, what: &str) -> Result<bool, SnapshotError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.malformed(format!("{what}: {v} is not a boolean"))),
        }
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    pub(super) fn bytes(&mut self, what: &str) -> Result<&'a [u8], SnapshotError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub(super) fn pod<T: Pod>(&mut self, what: &str) -> Result<Box<T>, SnapshotError> {
        let b = self.bytes(what)?;
        let size = std::mem::size_of::<T>();
        if b.len() != size {
            return Err(self.malformed(format!("{what} is {} bytes, this build's structure is {size}", b.len())));
        }
        // SAFETY: `b` holds exactly size_of::<T>() bytes and every bit pattern is a valid
        // `T` (`T: Pod`); the read is unaligned because `b` is not aligned for `T`. Boxed:
        // some of these structures are 4 KiB.
        Ok(Box::new(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) }))
    }
    pub(super) fn opt_pod<T: Pod>(&mut self, what: &str) -> Result<Option<Box<T>>, SnapshotError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => self.pod(what).map(Some),
            v => Err(self.malformed(format!("{what}: presence byte {v}"))),
        }
    }
}
