//! A test fixture (the `test-support` feature): guest memory built page by page.

use super::{access_end, GuestVirtRead, MemoryError};
use hvprobe_arch::Gva;

/// Sparse guest-virtual memory: 4 KiB pages exist once written, every other address fails
/// to read. The hostile-guest tests and the fuzz targets (`fuzz/`) build the guest memory
/// a parser sees out of these, so that a crafted structure can sit at any address with
/// holes around it, as in a guest kernel.
#[derive(Default, Clone, Debug)]
pub struct SparseMemory {
    pages: std::collections::BTreeMap<u64, Box<[u8; 4096]>>,
}

impl SparseMemory {
    pub fn new() -> SparseMemory {
        SparseMemory::default()
    }

    /// Writes `bytes` at `at`, creating (zeroed) pages as needed; bytes past 2^64 are
    /// dropped.
    pub fn write(&mut self, at: u64, bytes: &[u8]) {
        let mut done = 0usize;
        while done < bytes.len() {
            let Some(a) = at.checked_add(done as u64) else {
                return;
            };
            let off = (a & 0xfff) as usize;
            let n = (0x1000 - off).min(bytes.len() - done);
            let page = self.pages.entry(a & !0xfff).or_insert_with(|| Box::new([0; 4096]));
            page[off..off + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
    }

    /// Creates the (zeroed) pages of `[start, start + len)` that do not exist yet; what is
    /// already written stays.
    pub fn map(&mut self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        let mut page = start & !0xfff;
        while page < end {
            self.pages.entry(page).or_insert_with(|| Box::new([0; 4096]));
            let Some(next) = page.checked_add(0x1000) else {
                return;
            };
            page = next;
        }
    }

    pub fn put_u64(&mut self, at: u64, v: u64) {
        self.write(at, &v.to_le_bytes());
    }

    pub fn put_u32(&mut self, at: u64, v: u32) {
        self.write(at, &v.to_le_bytes());
    }

    /// Number of pages present.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }
}

impl GuestVirtRead for SparseMemory {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        access_end(gva, buf.len())?;
        let mut done = 0usize;
        while done < buf.len() {
            let a = gva.0 + done as u64;
            let page = self.pages.get(&(a & !0xfff)).ok_or(MemoryError::Unmapped(Gva(a)))?;
            let off = (a & 0xfff) as usize;
            let n = (0x1000 - off).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&page[off..off + n]);
            done += n;
        }
        Ok(())
    }
}
