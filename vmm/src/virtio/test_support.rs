//! A test fixture (the `test-support` feature): what the virtio devices' unit tests and
//! their fuzz targets (`fuzz/fuzz_targets/virtio_*.rs`) share; nothing else uses it.

use virtio_queue::{Queue, QueueT};

/// A split queue as a driver sets one up: `size` entries (of the device's `max_size`),
/// the descriptor table, available ring and used ring at the guest-physical addresses
/// `desc`, `avail` and `used` (below 4 GiB), and ready. Whether it is valid in a given
/// memory is the caller's to check (`Queue::is_valid`).
pub fn driver_queue(max_size: u16, size: u16, desc: u32, avail: u32, used: u32) -> Queue {
    let mut q = Queue::new(max_size).expect("a queue's maximum size is a power of two up to 32768");
    q.set_size(size);
    q.set_desc_table_address(Some(desc), Some(0));
    q.set_avail_ring_address(Some(avail), Some(0));
    q.set_used_ring_address(Some(used), Some(0));
    q.set_ready(true);
    q
}
