//! Fuzzes the virtio-blk device's request path (`hvprobe_vmm::virtio::block::serve_queue`):
//! the descriptor table, the available ring and every request header, data and status
//! descriptor are the guest driver's.
//!
//! The memory and queue are `common/driver_queue.rs`'s. The disk is a 64-sector image in
//! the temporary directory. Checked: no panic, no hang (libFuzzer's -timeout), and a
//! queue served without error has used exactly the requests the driver made available.
#![no_main]

use std::sync::OnceLock;

use hvprobe_vmm::virtio::block::{serve_queue, DiskConfig, DiskImage};
use libfuzzer_sys::fuzz_target;

#[path = "common/driver_queue.rs"]
mod driver_queue;
use driver_queue::driver_queue;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

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
    let Some((mem, mut queue, avail_at)) = driver_queue(data) else { return };
    if let Ok(used_any) = serve_queue(image(), &mem, &mut queue, &std::sync::atomic::AtomicBool::new(false)) {
        // The device's counts start at 0: it used one entry per available one, all of them.
        let avail: u16 = mem.read_obj(GuestAddress(avail_at + 2)).unwrap();
        assert_eq!(queue.next_used(), avail, "used entries against the available index");
        assert_eq!(queue.next_avail(), avail);
        assert_eq!(used_any, avail != 0);
    }
});
