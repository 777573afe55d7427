//! Fuzzes how a virtio-fs device whose virtiofsd died answers its queues
//! (`hvprobe_vmm::virtio::fs::orphan::answer_eio` through `virtio::serve_available`): the
//! descriptor table, the available ring and every FUSE request header are the guest
//! driver's.
//!
//! The memory and queue are `common/driver_queue.rs`'s. Checked: no panic, no hang (libFuzzer's -timeout), a
//! queue served without error has used exactly the requests the driver made available,
//! and every answer is a whole FUSE reply header or nothing.
#![no_main]

use hvprobe_vmm::virtio::fs::orphan::answer_eio;
use hvprobe_vmm::virtio::serve_available;
use libfuzzer_sys::fuzz_target;

#[path = "common/driver_queue.rs"]
mod driver_queue;
use driver_queue::driver_queue;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

fuzz_target!(|data: &[u8]| {
    let Some((mem, mut queue, avail_at)) = driver_queue(data) else { return };
    let mut lengths = Vec::new();
    let served = serve_available(&mem, &mut queue, &std::sync::atomic::AtomicBool::new(false), |chain| {
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
