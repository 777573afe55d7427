//! A test fixture (the `test-support` feature): a few bytes of guest memory at one
//! address.

use super::{GuestVirtRead, MemoryError};
use hvprobe_arch::Gva;

/// Guest memory holding `bytes` at `base`; a read of anything else fails. For the tests of
/// readers of one small table or structure (a task, an exception table), where a read past
/// the structure must fail rather than find zeros.
#[derive(Clone, Debug, Default)]
pub struct BytesAt {
    pub base: u64,
    pub bytes: Vec<u8>,
}

impl GuestVirtRead for BytesAt {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        let off = gva.0.checked_sub(self.base).ok_or(MemoryError::Unmapped(gva))? as usize;
        let src = self.bytes.get(off..off + buf.len()).ok_or(MemoryError::Unmapped(gva))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}
