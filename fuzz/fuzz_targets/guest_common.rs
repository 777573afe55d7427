//! Shared by the `guest_*` targets and `insn` (included with `#[path]`, not a target
//! itself): the input as a reader of numbers, and patches over a synthetic guest memory.
//!
//! Each target first builds a *valid* guest structure in a [`SparseMemory`] (kallsyms
//! tables, a task list with stacks, ORC tables, page tables...), as a well-behaved guest
//! kernel would lay it out, and then lets the input overwrite it: the fuzzer starts deep in
//! the parser (every check passes) and mutates from there, as a hostile guest kernel can.
//! Patch records: `[region: u8] [offset: u16 LE] [len: u8] [len bytes]`, the region
//! picking one of the target's base addresses (modulo their number).

#![allow(dead_code)]

use hvprobe_introspection::memory::SparseMemory;

/// The input, read front to back; past its end every number is 0.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        head
    }

    fn fixed<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.fixed::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.fixed())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.fixed())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.fixed())
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Applies the rest of the input as patch records over `mem`, at `bases`.
    pub fn patch(&mut self, mem: &mut SparseMemory, bases: &[u64]) {
        while !self.is_empty() {
            let region = usize::from(self.u8()) % bases.len();
            let offset = u64::from(self.u16());
            let len = usize::from(self.u8());
            let bytes = self.bytes(len);
            mem.write(bases[region].wrapping_add(offset), bytes);
        }
    }
}
