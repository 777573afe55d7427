//! Fuzzes how a virtio-fs device whose virtiofsd died answers its queues
//! (`hvprobe_vmm::virtio::fs::orphan::answer_eio` through `virtio::serve_available`): the
//! descriptor table, the available ring and every FUSE request header are the guest
//! driver's.
//!
//! The layout is virtio_blk's: two 64 KiB blocks of guest memory with a hole between them
//! (0 and 1 MiB), filled from the input; descriptors at 0x3000, available ring at 0x1000
//! or, with bit 6 of `input[0]`, at 0; used ring at 0x2000; size `1 << (input[0] % 9)`,
//! bit 7 turns on event indexes. Checked: no panic, no hang (libFuzzer's -timeout), a
//! queue served without error has used exactly the requests the driver made available,
//! and every answer is a whole FUSE reply header or nothing.
#![no_main]

use hvprobe_vmm::virtio::fs::orphan::answer_eio;
use hvprobe_vmm::virtio::serve_available;
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const BLOCK: usize = 64 << 10;
const SECOND_BLOCK: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((&size_bits, rest)) = data.split_first() else { return };
    let mem: GuestMemoryMmap =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), BLOCK), (GuestAddress(SECOND_BLOCK), BLOCK)]).unwrap();
    let (first, second) = rest.split_at(rest.len().min(BLOCK));
    mem.write_slice(first, GuestAddress(0)).unwrap();
    mem.write_slice(&second[..second.len().min(BLOCK)], GuestAddress(SECOND_BLOCK)).unwrap();

    let size = 1u16 << (size_bits % 9);
    let mut queue = Queue::new(256).unwrap();
    queue.set_size(size);
    let avail_at: u64 = if size_bits & 0x40 != 0 { 0 } else { 0x1000 };
    queue.set_desc_table_address(Some(0x3000), Some(0));
    queue.set_avail_ring_address(Some(avail_at as u32), Some(0));
    queue.set_used_ring_address(Some(0x2000), Some(0));
    queue.set_event_idx(size_bits & 0x80 != 0);
    queue.set_ready(true);
    if !queue.is_valid(&mem) {
        return;
    }
    let mut lengths = Vec::new();
    let served = serve_available(&mem, &mut queue, |chain| {
        let written = answer_eio(&mem, chain);
        lengths.push(written);
        written
    });
    if let Ok(used_any) = served {
        // The device's counts start at 0: it used one entry per available one, all of them.
        let avail: u16 = mem.read_obj(GuestAddress(avail_at + 2)).unwrap();
        assert_eq!(queue.next_used(), avail, "used entries against the available index");
        assert_eq!(queue.next_avail(), avail);
        assert_eq!(used_any, avail != 0);
    }
    assert!(lengths.iter().all(|&l| l == 0 || l == 16), "{lengths:?}");
});
