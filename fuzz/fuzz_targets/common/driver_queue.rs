//! The guest memory and queue a guest driver's input makes, shared by the virtio targets:
//! two 64 KiB blocks of memory with a hole between them (0 and 1 MiB), filled from the
//! input; descriptors at 0x3000, available ring at 0x1000 or, with bit 6 of `input[0]`,
//! at 0; used ring at 0x2000; size `1 << (input[0] % 9)`, bit 7 turns on event indexes.

use hvprobe_vmm::virtio::test_support;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const BLOCK: usize = 64 << 10;
const SECOND_BLOCK: u64 = 1 << 20;

/// The memory, a queue a driver set up validly in it, and its available ring's address;
/// `None` for an input that makes no valid queue.
pub fn driver_queue(data: &[u8]) -> Option<(GuestMemoryMmap, Queue, u64)> {
    let (&size_bits, rest) = data.split_first()?;
    let mem: GuestMemoryMmap =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), BLOCK), (GuestAddress(SECOND_BLOCK), BLOCK)]).unwrap();
    let (first, second) = rest.split_at(rest.len().min(BLOCK));
    mem.write_slice(first, GuestAddress(0)).unwrap();
    mem.write_slice(&second[..second.len().min(BLOCK)], GuestAddress(SECOND_BLOCK)).unwrap();

    let size = 1u16 << (size_bits % 9);
    let avail_at: u64 = if size_bits & 0x40 != 0 { 0 } else { 0x1000 };
    let mut queue = test_support::driver_queue(256, size, 0x3000, avail_at as u32, 0x2000);
    queue.set_event_idx(size_bits & 0x80 != 0);
    queue.is_valid(&mem).then_some((mem, queue, avail_at))
}
