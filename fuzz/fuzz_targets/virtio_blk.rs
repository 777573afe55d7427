//! Fuzzes the virtio-blk device's request path (`hvprobe_vmm::virtio::block::serve_queue`):
//! the descriptor table, the available ring and every request header, data and status
//! descriptor are the guest driver's.
//!
//! Guest memory is two 64 KiB blocks with a hole between them (0 and 1 MiB), filled from
//! the input; the queue's rings sit in the first block (descriptors at 0x3000, available
//! ring at 0x1000 or, with bit 6 of `input[0]`, at 0; used ring at 0x2000), its size is
//! `1 << (input[0] % 9)`, bit 7 turns on event indexes. The disk is a 64-sector image in
//! the temporary directory. Checked: no panic, no hang (libFuzzer's -timeout), and a
//! queue served without error has used exactly the requests the driver made available.
#![no_main]

use std::sync::OnceLock;

use hvprobe_vmm::virtio::block::{serve_queue, DiskConfig, DiskImage};
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const BLOCK: usize = 64 << 10;
const SECOND_BLOCK: u64 = 1 << 20;

fn image() -> &'static DiskImage {
    static IMAGE: OnceLock<DiskImage> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("hvprobe-fuzz-virtio-blk-{}.img", std::process::id()));
        std::fs::write(&path, vec![0x5au8; 64 * 512]).expect("the fuzz image");
        let image = DiskImage::open(&DiskConfig { path: path.clone(), read_only: false }).expect("open");
        // The open file stays; the name can go.
        let _ = std::fs::remove_file(&path);
        image
    })
}

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
    if let Ok(used_any) = serve_queue(image(), &mem, &mut queue) {
        // The device's counts start at 0: it used one entry per available one, all of them.
        let avail: u16 = mem.read_obj(GuestAddress(avail_at + 2)).unwrap();
        assert_eq!(queue.next_used(), avail, "used entries against the available index");
        assert_eq!(queue.next_avail(), avail);
        assert_eq!(used_any, avail != 0);
    }
});
