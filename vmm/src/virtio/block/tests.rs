use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::GuestMemoryMmap;

use super::*;

const HEADER: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;
/// The test image: 8 sectors, sector N filled with byte N.
const SECTORS: u64 = 8;

fn memory() -> GuestMemoryMmap {
    // Two blocks with a hole between them, as a guest above 3 GiB has.
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20), (GuestAddress(8 << 20), 1 << 20)]).unwrap()
}

fn image_file() -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for sector in 0..SECTORS {
        f.write_all(&[sector as u8; SECTOR_SIZE as usize]).unwrap();
    }
    f.flush().unwrap();
    f
}

fn open(file: &tempfile::NamedTempFile, read_only: bool) -> DiskImage {
    DiskImage::open(&DiskConfig {
        path: file.path().to_owned(),
        read_only,
    })
    .unwrap()
}

fn header(mem: &GuestMemoryMmap, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HEADER)).unwrap();
}

fn readable(addr: u64, len: u32) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, 0, 0))
}

fn writable(addr: u64, len: u32) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, VRING_DESC_F_WRITE as u16, 0))
}

/// Serves the chain `descs`; returns the bytes reported written and the status byte.
fn serve(image: &DiskImage, mem: &GuestMemoryMmap, descs: &[RawDescriptor]) -> (u32, u8) {
    mem.write_obj(0xeeu8, GuestAddress(STATUS)).unwrap();
    let queue = MockSplitQueue::new(mem, 16);
    let chain = queue.build_desc_chain(descs).unwrap();
    let written = handle_request(image, mem, chain);
    (written, mem.read_obj(GuestAddress(STATUS)).unwrap())
}

/// Header, one data descriptor, status.
fn request(data: RawDescriptor) -> [RawDescriptor; 3] {
    [readable(HEADER, 16), data, writable(STATUS, 1)]
}

/// A read of one sector into DATA as a chain of three linked descriptors from index
/// `first` (header, data, status), for the mock queue the worker serves.
fn linked_read(first: u16) -> [RawDescriptor; 3] {
    let linked = |d: RawDescriptor, next: u16| {
        let d = Descriptor::from(d);
        RawDescriptor::from(Descriptor::new(
            d.addr().0,
            d.len(),
            d.flags() | VRING_DESC_F_NEXT as u16,
            next,
        ))
    };
    [
        linked(readable(HEADER, 16), first + 1),
        linked(writable(DATA, 512), first + 2),
        writable(STATUS, 1),
    ]
}

/// Waits (10 s at most) until the worker has used `n` requests of `queue`.
fn wait_used(queue: &MockSplitQueue<'_, GuestMemoryMmap>, n: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while queue.used().idx().load() != n {
        assert!(Instant::now() < deadline, "the worker never answered request {n}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;

#[test]
fn a_read_copies_the_sectors_into_the_buffers() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_IN, 2);
    let (written, status) = serve(&image, &mem, &request(writable(DATA, 1024)));
    assert_eq!((written, status), (1025, OK));
    let mut data = [0u8; 1024];
    mem.read_slice(&mut data, GuestAddress(DATA)).unwrap();
    assert!(data[..512].iter().all(|&b| b == 2) && data[512..].iter().all(|&b| b == 3));
}

#[test]
fn a_write_reaches_the_image_and_a_flush_succeeds() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    mem.write_slice(&[0xab; 512], GuestAddress(DATA)).unwrap();
    header(&mem, VIRTIO_BLK_T_OUT, 7);
    let (written, status) = serve(&image, &mem, &request(readable(DATA, 512)));
    assert_eq!((written, status), (1, OK));
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(
        serve(&image, &mem, &[readable(HEADER, 16), writable(STATUS, 1)]),
        (1, OK)
    );
    let bytes = std::fs::read(file.path()).unwrap();
    assert!(bytes[7 * 512..].iter().all(|&b| b == 0xab));
    assert!(bytes[6 * 512..7 * 512].iter().all(|&b| b == 6));
}

#[test]
fn a_header_split_over_descriptors_and_data_after_it_in_the_same_one_are_understood() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_OUT, 1);
    // The header's last 8 bytes and the data share one descriptor.
    let data_after = HEADER + 8;
    mem.write_slice(&[0x5a; 512], GuestAddress(HEADER + 16)).unwrap();
    let descs = [readable(HEADER, 8), readable(data_after, 8 + 512), writable(STATUS, 1)];
    assert_eq!(serve(&image, &mem, &descs), (1, OK));
    assert!(std::fs::read(file.path()).unwrap()[512..1024]
        .iter()
        .all(|&b| b == 0x5a));
}

#[test]
fn a_read_only_disk_refuses_writes_and_keeps_its_bytes() {
    let (mem, file) = (memory(), image_file());
    let before = std::fs::read(file.path()).unwrap();
    let image = open(&file, true);
    header(&mem, VIRTIO_BLK_T_OUT, 0);
    assert_eq!(serve(&image, &mem, &request(readable(DATA, 512))), (1, IOERR));
    header(&mem, VIRTIO_BLK_T_IN, 0);
    assert_eq!(serve(&image, &mem, &request(writable(DATA, 512))), (513, OK));
    assert_eq!(std::fs::read(file.path()).unwrap(), before);
    assert_ne!(Block::new(image).features() & (1 << VIRTIO_BLK_F_RO), 0);
}

#[test]
fn requests_outside_the_image_or_of_part_sectors_fail_with_ioerr() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    let cases = [
        (SECTORS, 512),                // just past the end
        (SECTORS - 1, 1024),           // runs over the end
        (u64::MAX, 512),               // the offset overflows
        (u64::MAX / SECTOR_SIZE, 512), // the end overflows
        (0, 100),                      // part of a sector
        (0, 1 << 31),                  // a length the guest has no memory for
    ];
    for (sector, len) in cases {
        header(&mem, VIRTIO_BLK_T_IN, sector);
        assert_eq!(
            serve(&image, &mem, &request(writable(DATA, len))),
            (1, IOERR),
            "{sector} {len}"
        );
    }
}

#[test]
fn buffers_outside_guest_ram_fail_the_request_not_the_host() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    // In the hole between the two blocks, then straddling the first block's end.
    for addr in [5 << 20, (4 << 20) - 256] {
        assert_eq!(
            serve(&image, &mem, &request(writable(addr, 512))),
            (1, IOERR),
            "{addr:#x}"
        );
    }
    // A header outside RAM.
    let descs = [readable(6 << 20, 16), writable(DATA, 512), writable(STATUS, 1)];
    assert_eq!(serve(&image, &mem, &descs), (1, IOERR));
}

#[test]
fn malformed_chains_are_answered_or_returned_without_a_status() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    // No status byte: the last descriptor is device-readable, or empty.
    assert_eq!(
        serve(&image, &mem, &[readable(HEADER, 16), readable(DATA, 512)]),
        (0, 0xee)
    );
    assert_eq!(
        serve(&image, &mem, &[readable(HEADER, 16), writable(STATUS, 0)]),
        (0, 0xee)
    );
    // A chain of more than 4 GiB: virtio-queue's iterator ends it early (2.7.5.2).
    let huge = [readable(HEADER, 16), writable(DATA, u32::MAX - 1), writable(STATUS, 1)];
    assert_eq!(serve(&image, &mem, &huge), (0, 0xee));
    // A short header; readable after writable; a read with readable data.
    assert_eq!(
        serve(&image, &mem, &[readable(HEADER, 8), writable(STATUS, 1)]),
        (1, IOERR)
    );
    let mixed = [
        readable(HEADER, 16),
        writable(DATA, 512),
        readable(DATA, 512),
        writable(STATUS, 1),
    ];
    assert_eq!(serve(&image, &mem, &mixed), (1, IOERR));
    let read_with_data = [readable(HEADER, 16), readable(DATA, 512), writable(STATUS, 1)];
    assert_eq!(serve(&image, &mem, &read_with_data), (1, IOERR));
    // Unknown request types are unsupported, not errors.
    header(&mem, 99, 0);
    assert_eq!(
        serve(&image, &mem, &[readable(HEADER, 16), writable(STATUS, 1)]),
        (1, VIRTIO_BLK_S_UNSUPP as u8)
    );
}

#[test]
fn a_descriptor_loop_ends_at_the_queue_size() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    let queue = MockSplitQueue::new(&mem, 16);
    let next = VRING_DESC_F_NEXT as u16;
    let table = queue.desc_table();
    table
        .store(0, RawDescriptor::from(Descriptor::new(HEADER, 16, next, 1)))
        .unwrap();
    table
        .store(
            1,
            RawDescriptor::from(Descriptor::new(STATUS, 1, next | VRING_DESC_F_WRITE as u16, 0)),
        )
        .unwrap();
    queue.avail().ring().ref_at(0).unwrap().store(0);
    queue.avail().idx().store(1);
    let mut q: Queue = queue.create_queue().unwrap();
    let chain = q.pop_descriptor_chain(&mem).unwrap();
    // Header, status, header, … : readable after writable, answered with IOERR.
    assert_eq!(handle_request(&image, &mem, chain), 1);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), IOERR);
}

#[test]
fn get_id_names_the_image() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_GET_ID, 0);
    let (written, status) = serve(&image, &mem, &request(writable(DATA, 20)));
    assert_eq!((written, status), (21, OK));
    let mut id = [0u8; 20];
    mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert!(id.starts_with(b"hvp"), "{id:?}");
}

#[test]
fn the_config_space_is_the_capacity_in_sectors() {
    let file = image_file();
    let block = Block::new(open(&file, false));
    let mut capacity = [0u8; 8];
    block.read_config(0, &mut capacity);
    assert_eq!(u64::from_le_bytes(capacity), SECTORS);
    let mut past = [0xffu8; 4];
    block.read_config(8, &mut past);
    assert_eq!(past, [0; 4], "size_max, not offered");
    block.read_config(16, &mut past);
    assert_eq!(past, [0; 4]);
    block.read_config(u64::MAX, &mut past);
    assert_eq!(past, [0; 4]);
}

#[test]
fn the_worker_serves_a_kick_and_interrupts_the_driver() {
    let (mem, file) = (memory(), image_file());
    let mut block = Block::new(open(&file, false));
    header(&mem, VIRTIO_BLK_T_IN, 5);
    let queue = MockSplitQueue::new(&mem, 16);
    queue.add_desc_chains(&linked_read(0), 0).unwrap();
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    block
        .activate(Activation {
            panics: crate::vcpu::PanicStop::new(crate::vcpu::VcpuControl::new(1).unwrap()),
            mem: mem.clone(),
            queues: vec![queue.create_queue().unwrap()],
            notify: vec![kick.try_clone().unwrap()],
            interrupt: Arc::clone(&interrupt),
            acked_features: 1 << VIRTIO_F_VERSION_1,
        })
        .unwrap();
    kick.write(1).unwrap();
    wait_used(&queue, 1);
    block.reset();
    assert_eq!(irq.read().unwrap(), 1);
    assert_eq!(interrupt.status(), virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING);
    let mut data = [0u8; 512];
    mem.read_slice(&mut data, GuestAddress(DATA)).unwrap();
    assert!(data.iter().all(|&b| b == 5));
    // The image came back from the worker: the device can be activated again.
    assert!(block.image.is_some());
}

#[test]
fn bad_images_are_refused_with_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str, bytes: Option<usize>| {
        let path = dir.path().join(name);
        if let Some(n) = bytes {
            std::fs::write(&path, vec![0u8; n]).unwrap();
        }
        DiskConfig { path, read_only: false }
    };
    let err = |c: &DiskConfig| DiskImage::open(c).unwrap_err().to_string();
    assert!(
        err(&at("missing", None)).contains("No such file"),
        "{}",
        err(&at("missing", None))
    );
    assert!(err(&DiskConfig {
        path: dir.path().into(),
        read_only: false
    })
    .contains("is a directory"));
    assert!(err(&at("empty", Some(0))).contains("is empty"));
    assert!(err(&at("odd", Some(1000))).contains("1000 bytes, not a whole number of 512-byte sectors"));
    let good = at("good", Some(4096));
    let held = DiskImage::open(&good).unwrap();
    assert!(err(&good).contains("in use by another program"));
    drop(held);
    let twice = DiskImage::open_all(&[good.clone(), good.clone()])
        .unwrap_err()
        .to_string();
    assert!(twice.contains("given twice"), "{twice}");
}

#[test]
fn read_only_users_share_a_disk_and_a_writer_is_kept_out() {
    let file = image_file();
    let ro = |read_only| {
        DiskImage::open(&DiskConfig {
            path: file.path().to_owned(),
            read_only,
        })
    };
    let a = ro(true).unwrap();
    let b = ro(true).unwrap();
    assert!(matches!(ro(false), Err(DiskError::Locked { .. })));
    drop((a, b));
    assert!(ro(false).is_ok());
}

#[test]
fn an_avail_index_past_the_ring_breaks_the_queue_instead_of_spinning() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    let queue = MockSplitQueue::new(&mem, 16);
    // 100 requests announced in a ring of 16: the driver is broken or hostile.
    queue.avail().idx().store(100);
    let mut q: Queue = queue.create_queue().unwrap();
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(serve_queue(&image, &mem, &mut q, &AtomicBool::new(false)).map_err(|e| e.to_string()));
    });
    let result = answer
        .recv_timeout(Duration::from_secs(10))
        .expect("serve_queue never returned");
    assert!(result.unwrap_err().contains("available ring index"));
}

#[test]
fn an_available_ring_the_queue_cannot_read_breaks_the_queue_instead_of_spinning() {
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    // virtio-queue refuses to iterate an available ring at guest-physical 0 (as not set
    // up) while its index there says one request is waiting.
    let mut q = crate::virtio::test_support::driver_queue(16, 16, 0x4000, 0, 0x8000);
    mem.write_obj(1u16, GuestAddress(2)).unwrap();
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(serve_queue(&image, &mem, &mut q, &AtomicBool::new(false)).map_err(|e| e.to_string()));
    });
    let result = answer
        .recv_timeout(Duration::from_secs(10))
        .expect("serve_queue never returned");
    assert!(result.is_err(), "{result:?}");
}

#[test]
fn the_device_takes_many_segments_per_request_through_indirect_descriptors() {
    // Without SEG_MAX Linux sends one segment per request: a 1 MiB O_DIRECT read became
    // 256 requests of a page (hvprobe bench io: 0.7 MB/s on kvm_pvm).
    let file = image_file();
    let block = Block::new(open(&file, false));
    assert_ne!(block.features() & (1 << VIRTIO_BLK_F_SEG_MAX), 0);
    assert_ne!(
        block.features() & (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC),
        0
    );
    let mut seg_max = [0u8; 4];
    block.read_config(12, &mut seg_max);
    assert_eq!(u32::from_le_bytes(seg_max), u32::from(QUEUE_SIZE) - 2);

    // One ring descriptor pointing at a table: header, 8 one-sector segments, status.
    let (mem, file) = (memory(), image_file());
    let image = open(&file, false);
    header(&mem, VIRTIO_BLK_T_IN, 0);
    const TABLE: u64 = 0x28_0000;
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    let mut entries = vec![Descriptor::new(HEADER, 16, next, 1)];
    for i in 0..8u16 {
        entries.push(Descriptor::new(DATA + u64::from(i) * 0x1000, 512, next | write, i + 2));
    }
    entries.push(Descriptor::new(STATUS, 1, write, 0));
    for (i, d) in entries.iter().enumerate() {
        mem.write_obj(*d, GuestAddress(TABLE + i as u64 * 16)).unwrap();
    }
    let queue = MockSplitQueue::new(&mem, 16);
    let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    queue
        .desc_table()
        .store(
            0,
            RawDescriptor::from(Descriptor::new(TABLE, 16 * entries.len() as u32, indirect, 0)),
        )
        .unwrap();
    queue.avail().ring().ref_at(0).unwrap().store(0);
    queue.avail().idx().store(1);
    let mut q: Queue = queue.create_queue().unwrap();
    let chain = q.pop_descriptor_chain(&mem).unwrap();
    assert_eq!(handle_request(&image, &mem, chain), 8 * 512 + 1);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), OK);
    for i in 0..8u64 {
        let mut sector = [0u8; 512];
        mem.read_slice(&mut sector, GuestAddress(DATA + i * 0x1000)).unwrap();
        assert!(sector.iter().all(|&b| u64::from(b) == i), "sector {i}");
    }
}

/// A 1 MiB image with an MBR: a primary partition and an extended one holding two
/// logical partitions (EBRs at sectors 100 and 200).
fn partitioned_image() -> tempfile::NamedTempFile {
    use std::os::unix::fs::FileExt;
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(1 << 20).unwrap();
    let entry = |kind: u8, lba: u32, sectors: u32| {
        let mut e = [0u8; 16];
        e[4] = kind;
        e[8..12].copy_from_slice(&lba.to_le_bytes());
        e[12..16].copy_from_slice(&sectors.to_le_bytes());
        e
    };
    let sector = |entries: &[[u8; 16]]| {
        let mut s = [0u8; 512];
        for (i, e) in entries.iter().enumerate() {
            s[446 + 16 * i..462 + 16 * i].copy_from_slice(e);
        }
        s[510..].copy_from_slice(&[0x55, 0xaa]);
        s
    };
    let file = f.as_file();
    file.write_all_at(&sector(&[entry(0x83, 2048, 100), entry(0x05, 100, 1000)]), 0)
        .unwrap();
    // Logical partitions: each EBR's second entry links to the next, relative to sector 100.
    file.write_all_at(&sector(&[entry(0x83, 10, 50), entry(0x05, 100, 200)]), 100 * 512)
        .unwrap();
    file.write_all_at(&sector(&[entry(0x83, 10, 50)]), 200 * 512).unwrap();
    f
}

#[test]
fn a_saved_disk_is_refused_at_restore_when_its_partition_table_changed() {
    use std::os::unix::fs::FileExt;
    let file = partitioned_image();
    let saved = open(&file, false).saved().unwrap();
    assert_eq!((saved.size, saved.read_only), (1 << 20, false));
    assert!(saved.path.is_absolute());
    let check = |read_only: bool| open(&file, read_only).check_saved(&saved).map_err(|e| e.to_string());
    assert_eq!(check(false), Ok(()));
    // What a filesystem writes may change: the boot code, a superblock at byte 1024, data.
    for at in [0, 1024, 4096, 150 * 512] {
        file.as_file().write_all_at(&[0xff], at).unwrap();
    }
    assert_eq!(check(false), Ok(()));
    assert!(check(true)
        .unwrap_err()
        .contains("is attached read-only; the snapshot's disk was read-write"));
    // A partition the guest knows may not: a primary one, or a logical one down the chain.
    for at in [446 + 12, 200 * 512 + 446 + 12] {
        let mut byte = [0u8];
        file.as_file().read_exact_at(&mut byte, at).unwrap();
        file.as_file().write_all_at(&[byte[0] ^ 1], at).unwrap();
        let e = check(false).unwrap_err();
        assert!(
            e.contains("its partition table differs from the one the snapshotted guest read"),
            "{e}"
        );
        file.as_file().write_all_at(&byte, at).unwrap();
        assert_eq!(check(false), Ok(()));
    }
    file.as_file().set_len(2 << 20).unwrap();
    let e = check(false).unwrap_err();
    assert!(
        e.contains(&format!(
            "is {} bytes; the snapshot's disk was {} bytes",
            2 << 20,
            1 << 20
        )),
        "{e}"
    );
}

#[test]
fn the_partition_table_check_reads_a_bounded_amount_of_a_hostile_image() {
    use std::os::unix::fs::FileExt;
    // An EBR that links to itself, and a GPT header asking for 4 G entries of 4 GiB.
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(1 << 20).unwrap();
    let mut mbr = [0u8; 512];
    mbr[446 + 4] = 0x05;
    mbr[446 + 8..446 + 12].copy_from_slice(&8u32.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&100u32.to_le_bytes());
    mbr[510..].copy_from_slice(&[0x55, 0xaa]);
    f.as_file().write_all_at(&mbr, 0).unwrap();
    // Sector 8 links to 8 + 8, which links to itself.
    let mut ebr = mbr;
    ebr[446 + 16 + 4] = 0x05;
    ebr[446 + 16 + 8..446 + 16 + 12].copy_from_slice(&8u32.to_le_bytes());
    ebr[446 + 16 + 12..446 + 16 + 16].copy_from_slice(&100u32.to_le_bytes());
    f.as_file().write_all_at(&ebr, 8 * 512).unwrap();
    f.as_file().write_all_at(&ebr, 16 * 512).unwrap();
    let mut gpt = [0u8; 512];
    gpt[..8].copy_from_slice(b"EFI PART");
    gpt[72..80].copy_from_slice(&2u64.to_le_bytes());
    gpt[80..84].copy_from_slice(&u32::MAX.to_le_bytes());
    gpt[84..88].copy_from_slice(&u32::MAX.to_le_bytes());
    f.as_file().write_all_at(&gpt, 512).unwrap();
    let image = open(&f, true);
    let started = Instant::now();
    let first = image.partition_table_digest().unwrap();
    assert_eq!(image.partition_table_digest().unwrap(), first);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn saving_a_serving_disk_gives_its_queue_where_it_is_and_it_serves_on() {
    let (mem, file) = (memory(), image_file());
    let mut block = Block::new(open(&file, false));
    header(&mem, VIRTIO_BLK_T_IN, 3);
    let queue = MockSplitQueue::new(&mem, 16);
    queue.add_desc_chains(&linked_read(0), 0).unwrap();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    block
        .activate(Activation {
            panics: crate::vcpu::PanicStop::new(crate::vcpu::VcpuControl::new(1).unwrap()),
            mem: mem.clone(),
            queues: vec![queue.create_queue().unwrap()],
            notify: vec![kick.try_clone().unwrap()],
            interrupt,
            acked_features: 1 << VIRTIO_F_VERSION_1,
        })
        .unwrap();
    kick.write(1).unwrap();
    wait_used(&queue, 1);
    let saved = block.save().unwrap();
    let serving = saved.serving.expect("the disk was serving");
    assert_eq!((serving[0].next_avail, serving[0].next_used), (1, 1));
    let SavedDevice::Block(disk) = saved.device;
    assert_eq!(disk.size, SECTORS * SECTOR_SIZE);
    // Held still until it resumes: a request that comes meanwhile waits, then is served.
    queue.add_desc_chains(&linked_read(3), 1).unwrap();
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        queue.used().idx().load(),
        1,
        "a saved disk served a request before it resumed"
    );
    block.resume().unwrap();
    wait_used(&queue, 2);
    block.reset();
    let saved = block.save().unwrap();
    assert!(saved.serving.is_none(), "a reset disk serves nothing");
}
