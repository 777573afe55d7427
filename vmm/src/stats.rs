//! KVM's binary statistics of a vCPU (`KVM_GET_STATS_FD`, not wrapped by kvm-ioctls).
//!
//! On kvm_pvm `insn_emulation` counts the guest kernel instructions KVM emulated, which
//! makes "guest instructions per boot / per probe hit" a deterministic measure where
//! wall-clock time is not.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use kvm_ioctls::VcpuFd;

/// `_IO(KVMIO, 0xce)`.
const KVM_GET_STATS_FD: libc::c_ulong = 0xaece;
const HEADER_SIZE: usize = 24;
const DESC_FIXED_SIZE: usize = 16;

/// The statistics file of one vCPU.
pub struct VcpuStats {
    file: File,
    data_offset: u64,
    /// name -> (offset in the data block, number of u64 values)
    fields: HashMap<String, (u32, u16)>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

impl VcpuStats {
    pub fn open(vcpu: &VcpuFd) -> std::io::Result<VcpuStats> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new file descriptor
        // (or -1), which we own from here on.
        let fd = unsafe { libc::ioctl(vcpu.as_raw_fd(), KVM_GET_STATS_FD as _) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let mut header = [0u8; HEADER_SIZE];
        file.read_exact_at(&mut header, 0)?;
        let name_size = u32_at(&header, 4) as usize;
        let num_desc = u32_at(&header, 8) as usize;
        let desc_offset = u64::from(u32_at(&header, 16));
        let data_offset = u64::from(u32_at(&header, 20));
        let desc_size = DESC_FIXED_SIZE + name_size;
        let mut descs = vec![0u8; desc_size * num_desc];
        file.read_exact_at(&mut descs, desc_offset)?;
        let mut fields = HashMap::new();
        for d in descs.chunks_exact(desc_size) {
            let size = u16::from_le_bytes([d[6], d[7]]);
            let offset = u32_at(d, 8);
            let name = &d[DESC_FIXED_SIZE..];
            let name = String::from_utf8_lossy(&name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())]);
            fields.insert(name.into_owned(), (offset, size));
        }
        Ok(VcpuStats {
            file,
            data_offset,
            fields,
        })
    }

    /// The current value of a single-valued statistic.
    pub fn get(&self, name: &str) -> Option<u64> {
        let &(offset, _) = self.fields.get(name)?;
        let mut v = [0u8; 8];
        self.file
            .read_exact_at(&mut v, self.data_offset + u64::from(offset))
            .ok()?;
        Some(u64::from_le_bytes(v))
    }
}
