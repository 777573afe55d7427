//! A virtio-blk device (virtio 1.2, 5.2) on a raw disk image: reads, writes, flushes
//! (an fsync of the image) and the device ID; one request queue served by a worker
//! thread. A read-only disk offers VIRTIO_BLK_F_RO and fails writes with IOERR.
//!
//! Every request is checked against the image before any I/O: its sectors must lie in
//! the image, its data must be whole sectors, its buffers must be guest RAM and writable
//! where the device writes. A request that fails a check gets IOERR (or UNSUPP for an
//! unknown type); a chain the device cannot even answer (no status byte) is returned
//! with nothing written. The device allocates nothing a request asks for: data moves
//! between the image and guest memory directly.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateError, Activation, DeviceSave, Interrupt, SaveError, SavedDevice, StopSignal, VirtioDevice};
use crate::vcpu::PanicStop;

pub const SECTOR_SIZE: u64 = 512;
/// Entries in the request queue: what Linux's driver uses when the device allows it.
const QUEUE_SIZE: u16 = 256;
const REQUEST_HEADER_LEN: usize = 16;
/// EBRs of an MBR's extended partitions a snapshot's check follows, in all; Linux's msdos
/// parser stops at fewer logical partitions than this.
const MAX_EBRS: usize = 256;
/// The most GPT partition-entry bytes a snapshot's check reads (Linux's parser takes up
/// to 128 entries of 128 bytes in practice; a header may ask for more, which is hashed
/// up to this much).
const MAX_GPT_ENTRY_BYTES: u64 = 1 << 20;

/// How a disk is attached: `--disk FILE[,ro]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk image {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("disk image {path} is a directory, not a disk image")]
    Directory { path: PathBuf },
    #[error("disk image {path} is neither a regular file nor a block device")]
    NotAFile { path: PathBuf },
    #[error("disk image {path} is empty")]
    Empty { path: PathBuf },
    #[error("disk image {path} is {size} bytes, not a whole number of {SECTOR_SIZE}-byte sectors")]
    NotSectors { path: PathBuf, size: u64 },
    #[error("disk image {path} is in use by another program (another hvprobe?): it holds a lock on it")]
    Locked { path: PathBuf },
    #[error("disk image {path} is given twice")]
    Twice { path: PathBuf },
}

/// A disk as a snapshot saw it: what its image must still be at restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedDisk {
    /// Where the image was (absolute): a restore without `--disk` opens it there.
    pub path: PathBuf,
    pub size: u64,
    pub read_only: bool,
    /// SHA-256 of its partition table ([`DiskImage::partition_table_digest`]).
    pub partition_table: [u8; 32],
}

/// Why an image is not the one a snapshot saw.
#[derive(Debug, thiserror::Error)]
pub enum DiskMismatch {
    #[error("disk image {path} is {size} bytes; the snapshot's disk was {saved} bytes")]
    Size { path: PathBuf, size: u64, saved: u64 },
    #[error(
        "disk image {path} is attached {given}; the snapshot's disk was {saved} (give the disk as the snapshot \
         had it: `,ro` or not)"
    )]
    ReadOnly {
        path: PathBuf,
        given: &'static str,
        saved: &'static str,
    },
    #[error(
        "disk image {path} is not the one the snapshot saw: its partition table differs from the one the \
         snapshotted guest read at boot and holds in its memory"
    )]
    PartitionTable { path: PathBuf },
    #[error("cannot read disk image {path} for its content check: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Entry `i` of an MBR or EBR: its type, start sector and size in sectors.
fn mbr_entry(sector: &[u8; SECTOR_SIZE as usize], i: usize) -> (u8, u64, u64) {
    let e = &sector[446 + 16 * i..446 + 16 * (i + 1)];
    let word = |at: usize| u64::from(u32::from_le_bytes(e[at..at + 4].try_into().expect("4 bytes")));
    (e[4], word(8), word(12))
}

/// An MBR partition type Linux's msdos parser follows as an extended partition.
fn is_extended(kind: u8) -> bool {
    matches!(kind, 0x05 | 0x0f | 0x85)
}

fn attachment(read_only: bool) -> &'static str {
    match read_only {
        true => "read-only",
        false => "read-write",
    }
}

/// An open, locked disk image of a whole number of sectors.
#[derive(Debug)]
pub struct DiskImage {
    file: File,
    path: PathBuf,
    size: u64,
    read_only: bool,
    /// Device and inode: the device ID the guest sees (`/dev/disk/by-id`).
    identity: (u64, u64),
}

impl DiskImage {
    /// Opens `config.path` (read-only when asked) and locks it, shared for a read-only
    /// disk and exclusive otherwise, as QEMU does: a disk written by one hvprobe is
    /// refused to every other, a read-only one may be shared by readers.
    pub fn open(config: &DiskConfig) -> Result<DiskImage, DiskError> {
        let path = config.path.clone();
        let open_err = |source| DiskError::Open {
            path: path.clone(),
            source,
        };
        let meta = std::fs::metadata(&path).map_err(open_err)?;
        if meta.is_dir() {
            return Err(DiskError::Directory { path });
        }
        if !meta.is_file() && !meta.file_type().is_block_device() {
            return Err(DiskError::NotAFile { path });
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(!config.read_only)
            .open(&path)
            .map_err(open_err)?;
        let lock = if config.read_only { libc::LOCK_SH } else { libc::LOCK_EX };
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), lock | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EWOULDBLOCK) => DiskError::Locked { path },
                _ => open_err(e),
            });
        }
        // A block device's size is where its end is.
        let size = file.seek(SeekFrom::End(0)).map_err(open_err)?;
        if size == 0 {
            return Err(DiskError::Empty { path });
        }
        if !size.is_multiple_of(SECTOR_SIZE) {
            return Err(DiskError::NotSectors { path, size });
        }
        Ok(DiskImage {
            file,
            path,
            size,
            read_only: config.read_only,
            identity: (meta.dev(), meta.ino()),
        })
    }

    /// Opens every disk of `configs`, refusing one named twice (it would lock itself out).
    pub fn open_all(configs: &[DiskConfig]) -> Result<Vec<DiskImage>, DiskError> {
        let mut images: Vec<DiskImage> = Vec::new();
        for config in configs {
            let image = DiskImage::open(config);
            // The second open of the same file fails on the first one's lock: name it.
            if let Err(DiskError::Locked { path }) = &image {
                if let Ok(meta) = std::fs::metadata(path) {
                    if images.iter().any(|i| i.identity == (meta.dev(), meta.ino())) {
                        return Err(DiskError::Twice { path: path.clone() });
                    }
                }
            }
            let image = image?;
            if images.iter().any(|i| i.identity == image.identity) {
                return Err(DiskError::Twice { path: image.path });
            }
            images.push(image);
        }
        Ok(images)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// SHA-256 of what a guest kernel parses of the image's partition table when it finds
    /// the disk, and keeps in memory from then on: the MBR's partition entries and
    /// signature (bytes 440..512 of sector 0) and, through an extended partition, each
    /// EBR's; sector 1 (a GPT header, or nothing); a GPT's partition entries and its
    /// backup header in the last sector. Nothing a filesystem writes on a disk without
    /// a partition table is in it (ext4's superblock starts at byte 1024), so a disk
    /// snapshotted unmounted can be written by each restore and restored again.
    pub fn partition_table_digest(&self) -> std::io::Result<[u8; 32]> {
        let mut hasher = Sha256::new();
        let mut sector = [0u8; SECTOR_SIZE as usize];
        self.read_sector(0, &mut sector)?;
        hasher.update(&sector[440..]);
        if sector[510..] == [0x55, 0xaa] {
            // Logical partitions, as Linux's msdos parser finds them: every extended
            // primary entry starts a chain of EBRs, each linking to the next (its first
            // extended entry with a size) relative to the chain's start.
            let mbr = sector;
            let mut budget = MAX_EBRS;
            for (kind, base, size) in (0..4).map(|i| mbr_entry(&mbr, i)) {
                if !is_extended(kind) || size == 0 {
                    continue;
                }
                let mut next = Some(base);
                let mut seen = Vec::new();
                while let Some(lba) = next.filter(|lba| !seen.contains(lba)) {
                    if budget == 0 || !self.read_sector(lba, &mut sector)? {
                        break;
                    }
                    budget -= 1;
                    seen.push(lba);
                    hasher.update(lba.to_le_bytes());
                    hasher.update(&sector[440..]);
                    next = (0..4)
                        .map(|i| mbr_entry(&sector, i))
                        .find(|&(kind, _, size)| is_extended(kind) && size != 0)
                        .and_then(|(_, link, _)| base.checked_add(link));
                }
            }
        }
        // A GPT: its primary header (or what is in sector 1) and entries, and the backup
        // header at the end with its entries (Linux reads those when the primary is bad).
        let last = self.size / SECTOR_SIZE - 1;
        for lba in [1, last] {
            if !self.read_sector(lba, &mut sector)? {
                continue;
            }
            let gpt = sector[..8] == *b"EFI PART";
            if lba == 1 || gpt {
                hasher.update(lba.to_le_bytes());
                hasher.update(sector);
            }
            if gpt {
                self.hash_gpt_entries(&sector, &mut hasher)?;
            }
        }
        Ok(hasher.finalize().into())
    }

    /// Reads sector `lba` into `sector`; false when the image has no such sector.
    fn read_sector(&self, lba: u64, sector: &mut [u8; SECTOR_SIZE as usize]) -> std::io::Result<bool> {
        use std::os::unix::fs::FileExt;
        let at = lba
            .checked_mul(SECTOR_SIZE)
            .filter(|at| at.checked_add(SECTOR_SIZE).is_some_and(|end| end <= self.size));
        match at {
            Some(at) => self.file.read_exact_at(sector, at).map(|()| true),
            None => Ok(false),
        }
    }

    /// Hashes the partition-entry array a GPT header names (bounded by
    /// [`MAX_GPT_ENTRY_BYTES`]; nothing when it lies outside the image).
    fn hash_gpt_entries(&self, header: &[u8; SECTOR_SIZE as usize], hasher: &mut Sha256) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let entries_lba = u64::from_le_bytes(header[72..80].try_into().expect("8 bytes"));
        let count = u64::from(u32::from_le_bytes(header[80..84].try_into().expect("4 bytes")));
        let entry_size = u64::from(u32::from_le_bytes(header[84..88].try_into().expect("4 bytes")));
        let bytes = count.saturating_mul(entry_size).min(MAX_GPT_ENTRY_BYTES);
        let at = entries_lba
            .checked_mul(SECTOR_SIZE)
            .filter(|at| at.checked_add(bytes).is_some_and(|end| end <= self.size));
        if let Some(at) = at {
            let mut entries = vec![0u8; bytes as usize];
            self.file.read_exact_at(&mut entries, at)?;
            hasher.update(&entries);
        }
        Ok(())
    }

    /// This disk as a snapshot saves it.
    pub fn saved(&self) -> std::io::Result<SavedDisk> {
        Ok(SavedDisk {
            path: std::path::absolute(&self.path)?,
            size: self.size,
            read_only: self.read_only,
            partition_table: self.partition_table_digest()?,
        })
    }

    /// Whether this image is the one `saved` describes: the same size and attachment, and
    /// the same partition table (what the guest parsed at boot and keeps in memory).
    pub fn check_saved(&self, saved: &SavedDisk) -> Result<(), DiskMismatch> {
        let path = self.path.clone();
        if self.size != saved.size {
            return Err(DiskMismatch::Size {
                path,
                size: self.size,
                saved: saved.size,
            });
        }
        if self.read_only != saved.read_only {
            return Err(DiskMismatch::ReadOnly {
                path,
                given: attachment(self.read_only),
                saved: attachment(saved.read_only),
            });
        }
        let digest = self.partition_table_digest().map_err(|source| DiskMismatch::Read {
            path: path.clone(),
            source,
        })?;
        if digest != saved.partition_table {
            return Err(DiskMismatch::PartitionTable { path });
        }
        Ok(())
    }

    /// The 20-byte device ID: the image's device and inode in hex, zero-padded.
    fn device_id(&self) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let text = format!("hvp{:x}:{:x}", self.identity.0, self.identity.1);
        let n = text.len().min(id.len());
        id[..n].copy_from_slice(&text.as_bytes()[..n]);
        id
    }
}

/// The config space's fields the features offered use: capacity (u64, sectors),
/// size_max (u32, unused: SIZE_MAX is not offered), seg_max (u32).
const CONFIG_LEN: usize = 16;
/// Data segments a request may have: the queue less the header and status descriptors
/// (QEMU's choice), reachable through an indirect table.
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;

fn config_space(capacity: u64) -> [u8; CONFIG_LEN] {
    let mut config = [0u8; CONFIG_LEN];
    config[0..8].copy_from_slice(&capacity.to_le_bytes());
    config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
    config
}

/// The device: its image, and the worker thread while the driver has it running.
pub struct Block {
    image: Option<DiskImage>,
    config: [u8; CONFIG_LEN],
    features: u64,
    worker: Option<Worker>,
    /// The worker's server and kick while a save holds it stopped (until `resume`).
    held: Option<(RequestServer, EventFd)>,
}

struct Worker {
    stop: StopSignal,
    /// Gives back the server (image and queue) and its kick when it stops; `None` if it
    /// panicked (and ended the run).
    thread: JoinHandle<Option<(RequestServer, EventFd)>>,
}

impl Worker {
    fn start(mut server: RequestServer, kick: EventFd) -> Result<Worker, ActivateError> {
        let stop = StopSignal::new().map_err(ActivateError::EventFd)?;
        let stop_worker = stop.clone();
        let panics = server.panics.clone();
        let thread = panics
            .spawn("virtio-blk", move || {
                server.run(&kick, &stop_worker);
                (server, kick)
            })
            .map_err(ActivateError::Thread)?;
        Ok(Worker { stop, thread })
    }

    /// Stops the thread after the request in hand; `None` if it panicked (the image is
    /// then gone with it).
    fn stop(self) -> Option<(RequestServer, EventFd)> {
        self.stop.request();
        self.thread.join().ok().flatten()
    }
}

impl Block {
    pub fn new(image: DiskImage) -> Block {
        // SEG_MAX and indirect descriptors: without them Linux puts one segment (a page,
        // for O_DIRECT) in each request, and every request costs the guest's driver and
        // an interrupt.
        let mut features = (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC);
        if image.read_only {
            features |= 1 << VIRTIO_BLK_F_RO;
        }
        Block {
            config: config_space(image.size / SECTOR_SIZE),
            image: Some(image),
            features,
            worker: None,
            held: None,
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        self.features
    }

    /// The config space: capacity in sectors and seg_max (see [`config_space`]).
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config, offset, data);
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        let Activation {
            mem,
            mut queues,
            mut notify,
            interrupt,
            panics,
            ..
        } = activation;
        if queues.len() != 1 || notify.len() != 1 {
            return Err(ActivateError::QueueCount {
                got: queues.len(),
                want: 1,
            });
        }
        let Some(image) = self.image.take() else {
            // Held by a worker that did not come back (see reset): the device is broken.
            return Err(ActivateError::ImageLost);
        };
        let server = RequestServer {
            image,
            mem,
            queue: queues.remove(0),
            interrupt,
            broken: false,
            panics,
        };
        let kick = notify.remove(0);
        self.worker = Some(Worker::start(server, kick)?);
        Ok(())
    }

    fn reset(&mut self) {
        if let Some((server, _)) = self.held.take() {
            self.image = Some(server.image);
        }
        if let Some(worker) = self.worker.take() {
            match worker.stop() {
                Some((server, _)) => self.image = Some(server.image),
                None => tracing::error!("virtio-blk: the worker thread panicked; the disk is gone"),
            }
        }
    }

    fn save(&mut self) -> Result<DeviceSave, SaveError> {
        if let Some(worker) = self.worker.take() {
            // Held stopped until `resume`: nothing it serves may land in guest memory or
            // the interrupt controllers after this state and before theirs is saved.
            self.held = Some(worker.stop().ok_or(SaveError::ImageLost)?);
        }
        match &self.held {
            Some((server, _)) => Ok(DeviceSave {
                device: SavedDevice::Block(saved_disk(&server.image)?),
                serving: Some(vec![server.queue.state()]),
            }),
            None => Ok(DeviceSave {
                device: SavedDevice::Block(saved_disk(self.image.as_ref().ok_or(SaveError::ImageLost)?)?),
                serving: None,
            }),
        }
    }

    fn resume(&mut self) -> Result<(), SaveError> {
        // A kick that came while the worker was held is still pending on `kick`.
        if let Some((server, kick)) = self.held.take() {
            self.worker = Some(Worker::start(server, kick).map_err(SaveError::Restart)?);
        }
        Ok(())
    }
}

fn saved_disk(image: &DiskImage) -> Result<SavedDisk, SaveError> {
    image.saved().map_err(|source| SaveError::ReadImage {
        path: image.path.clone(),
        source,
    })
}

impl Drop for Block {
    fn drop(&mut self) {
        self.reset();
    }
}

/// The worker's side: one queue, one image.
struct RequestServer {
    image: DiskImage,
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: std::sync::Arc<Interrupt>,
    /// The driver broke the queue itself (an avail index past the ring): nothing more is
    /// served until it resets the device.
    broken: bool,
    /// What the worker serving it runs under (kept here for a restart at `resume`).
    panics: PanicStop,
}

const KICK: u64 = 1;
const STOP: u64 = 2;

impl RequestServer {
    fn run(&mut self, kick: &EventFd, stop: &StopSignal) {
        let epoll = match Epoll::new() {
            Ok(e) => e,
            Err(e) => {
                tracing::error!("virtio-blk: epoll: {e}");
                return;
            }
        };
        for (fd, data) in [(kick.as_raw_fd(), KICK), (stop.wake_fd(), STOP)] {
            if let Err(e) = epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, data)) {
                tracing::error!("virtio-blk: epoll_ctl: {e}");
                return;
            }
        }
        // A kick may have come before the thread was waiting.
        self.serve(stop.requested());
        let mut events = [EpollEvent::default(); 2];
        loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("virtio-blk: epoll_wait: {e}");
                    return;
                }
            };
            for event in &events[..n] {
                match event.data() {
                    STOP => return,
                    _ => {
                        let _ = kick.read();
                        self.serve(stop.requested());
                    }
                }
            }
        }
    }

    /// Serves every available request (until `stopping`), then interrupts the driver if it
    /// wants to be.
    fn serve(&mut self, stopping: &AtomicBool) {
        if self.broken {
            return;
        }
        let result = serve_queue(&self.image, &self.mem, &mut self.queue, stopping).and_then(|used_any| {
            // Nothing used, nothing to say (a kick for requests served already).
            if used_any && self.queue.needs_notification(&self.mem)? {
                self.interrupt.signal_used_queue();
            }
            Ok(())
        });
        if let Err(e) = result {
            crate::warn_limited!(
                "virtio-blk {}: the driver's queue is broken ({e}); the device needs a reset",
                self.image.path.display()
            );
            self.broken = true;
            self.interrupt.signal_needs_reset();
        }
    }
}

/// Serves every request available in `queue` from `image` (see [`super::serve_available`]);
/// says whether it used any.
pub fn serve_queue<M: GuestMemory>(
    image: &DiskImage,
    mem: &M,
    queue: &mut Queue,
    stopping: &AtomicBool,
) -> Result<bool, virtio_queue::Error> {
    super::serve_available(mem, queue, stopping, |chain| handle_request(image, mem, chain))
}

/// What a request asks, checked against the image.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Read { offset: u64 },
    Write { offset: u64 },
    Flush,
    GetId,
    Unsupported(u32),
}

/// Serves one request chain; returns the number of bytes written into its buffers.
fn handle_request<M: GuestMemory>(image: &DiskImage, mem: &M, chain: DescriptorChain<&M>) -> u32 {
    // The chain ends at a loop, a bad index or the queue's size (virtio-queue's iterator
    // stops there): its descriptors number at most QUEUE_SIZE.
    let descriptors: Vec<Descriptor> = chain.collect();
    let Some(status_at) = status_byte(&descriptors) else {
        tracing::debug!("virtio-blk: a request without a status byte, returned unanswered");
        return 0;
    };
    let (status, data_written) = match parse(mem, &descriptors) {
        Ok((request, segments)) => execute(image, mem, request, &segments),
        Err(status) => (status, 0),
    };
    if mem.write_obj(status as u8, status_at).is_err() {
        return 0;
    }
    data_written.saturating_add(1)
}

/// The last byte of the last descriptor, when that one is device-writable.
fn status_byte(descriptors: &[Descriptor]) -> Option<GuestAddress> {
    let last = descriptors.last()?;
    if !last.is_write_only() || last.len() == 0 {
        return None;
    }
    last.addr().0.checked_add(u64::from(last.len()) - 1).map(GuestAddress)
}

/// A stretch of guest memory the request's data lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    addr: GuestAddress,
    len: u32,
}

/// The request in a chain (header, data, status byte), or the status it fails with.
fn parse<M: GuestMemory>(mem: &M, descriptors: &[Descriptor]) -> Result<(Request, Vec<Segment>), u32> {
    let ioerr = VIRTIO_BLK_S_IOERR;
    // Device-readable ones first, then device-writable ones (2.7.4.2).
    let readable = descriptors.iter().take_while(|d| !d.is_write_only()).count();
    if descriptors[readable..].iter().any(|d| !d.is_write_only()) {
        return Err(ioerr);
    }
    // The header is the first 16 readable bytes, in as many descriptors as the driver used.
    let mut header = [0u8; REQUEST_HEADER_LEN];
    let mut filled = 0;
    let mut data = Vec::new();
    for d in &descriptors[..readable] {
        let take = (REQUEST_HEADER_LEN - filled).min(d.len() as usize);
        if take > 0 {
            mem.read_slice(&mut header[filled..filled + take], d.addr())
                .map_err(|_| ioerr)?;
            filled += take;
        }
        if (d.len() as usize) > take {
            let addr = d.addr().0.checked_add(take as u64).map(GuestAddress).ok_or(ioerr)?;
            data.push(Segment {
                addr,
                len: d.len() - take as u32,
            });
        }
    }
    if filled < REQUEST_HEADER_LEN {
        return Err(ioerr);
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    // The writable part, less the status byte.
    let mut writable: Vec<Segment> = descriptors[readable..]
        .iter()
        .map(|d| Segment {
            addr: d.addr(),
            len: d.len(),
        })
        .collect();
    if let Some(last) = writable.last_mut() {
        last.len -= 1;
    }
    writable.retain(|s| s.len > 0);
    let offset = sector.checked_mul(SECTOR_SIZE).ok_or(ioerr);
    match kind {
        VIRTIO_BLK_T_IN if data.is_empty() => Ok((Request::Read { offset: offset? }, writable)),
        VIRTIO_BLK_T_OUT if writable.is_empty() => Ok((Request::Write { offset: offset? }, data)),
        VIRTIO_BLK_T_FLUSH => Ok((Request::Flush, Vec::new())),
        VIRTIO_BLK_T_GET_ID if data.is_empty() => Ok((Request::GetId, writable)),
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_GET_ID => Err(ioerr),
        other => Ok((Request::Unsupported(other), Vec::new())),
    }
}

/// Does `request`; returns its status and the bytes it wrote into guest memory.
fn execute<M: GuestMemory>(image: &DiskImage, mem: &M, request: Request, segments: &[Segment]) -> (u32, u32) {
    let ioerr = (VIRTIO_BLK_S_IOERR, 0);
    let total = segments
        .iter()
        .try_fold(0u64, |sum, s| sum.checked_add(u64::from(s.len)));
    let Some(total) = total else { return ioerr };
    match request {
        Request::Read { offset } | Request::Write { offset } => {
            // Whole sectors inside the image (5.2.6.1: data is a multiple of 512 bytes).
            let in_image = offset.checked_add(total).is_some_and(|end| end <= image.size);
            if !total.is_multiple_of(SECTOR_SIZE) || !in_image {
                return ioerr;
            }
            let write = matches!(request, Request::Write { .. });
            if write && image.read_only {
                return ioerr;
            }
            match transfer(image, mem, offset, segments, write) {
                Ok(()) if write => (VIRTIO_BLK_S_OK, 0),
                Ok(()) => (VIRTIO_BLK_S_OK, u32::try_from(total).unwrap_or(u32::MAX)),
                Err(e) => {
                    crate::warn_limited!("virtio-blk {}: {e}", image.path.display());
                    ioerr
                }
            }
        }
        Request::Flush if image.read_only => (VIRTIO_BLK_S_OK, 0),
        Request::Flush => match image.file.sync_all() {
            Ok(()) => (VIRTIO_BLK_S_OK, 0),
            Err(e) => {
                crate::warn_limited!("virtio-blk {}: fsync: {e}", image.path.display());
                ioerr
            }
        },
        Request::GetId => {
            let id = image.device_id();
            let mut written = 0u32;
            for s in segments {
                let n = (id.len() - written as usize).min(s.len as usize);
                if mem
                    .write_slice(&id[written as usize..written as usize + n], s.addr)
                    .is_err()
                {
                    return ioerr;
                }
                written += n as u32;
                if written as usize == id.len() {
                    break;
                }
            }
            (VIRTIO_BLK_S_OK, written)
        }
        Request::Unsupported(kind) => {
            tracing::debug!("virtio-blk: request type {kind} unsupported");
            (VIRTIO_BLK_S_UNSUPP, 0)
        }
    }
}

/// Moves the data of a read or write between the image at `offset` and the segments,
/// with one `preadv`/`pwritev` for the whole request: a 1 MiB O_DIRECT read is 256
/// segments of a page, 256 system calls one at a time.
fn transfer<M: GuestMemory>(
    image: &DiskImage,
    mem: &M,
    offset: u64,
    segments: &[Segment],
    write: bool,
) -> Result<(), TransferError> {
    // The device reads guest memory for a write to the image, and writes it for a read.
    let access = if write { Permissions::Read } else { Permissions::Write };
    let mut slices = Vec::with_capacity(segments.len());
    for s in segments {
        let memory_err = |source| TransferError::Memory {
            addr: s.addr.0,
            len: s.len,
            source,
        };
        // A segment across two regions of guest memory is two slices.
        for slice in mem.get_slices(s.addr, s.len as usize, access).map_err(memory_err)? {
            slices.push(slice.map_err(memory_err)?);
        }
    }
    let mut iovecs: Vec<libc::iovec> = slices
        .iter()
        .map(|slice| libc::iovec {
            iov_base: slice.ptr_guard_mut().as_ptr().cast(),
            iov_len: slice.len(),
        })
        .collect();
    let mut at = offset;
    let mut next = 0;
    while next < iovecs.len() {
        let count = (iovecs.len() - next).min(IOV_MAX);
        // In the image (checked by the caller), so within the file's off_t.
        let position = libc::off_t::try_from(at).map_err(|_| TransferError::Offset(at))?;
        // SAFETY: each iovec points at `iov_len` bytes of guest RAM inside a mapping that
        // `mem` keeps alive for this call (the slices above borrow it); the kernel reads
        // or writes only those bytes. The guest may change them meanwhile: that is its
        // own data race, harmless to the host.
        let moved = unsafe {
            if write {
                libc::pwritev(image.file.as_raw_fd(), iovecs[next..].as_ptr(), count as i32, position)
            } else {
                libc::preadv(image.file.as_raw_fd(), iovecs[next..].as_ptr(), count as i32, position)
            }
        };
        if moved < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(TransferError::Io(err));
        }
        if moved == 0 {
            let kind = if write {
                std::io::ErrorKind::WriteZero
            } else {
                std::io::ErrorKind::UnexpectedEof
            };
            return Err(TransferError::Io(kind.into()));
        }
        at += moved as u64;
        // Past the iovecs done, into the one the call stopped in.
        let mut left = moved as usize;
        while left > 0 && next < iovecs.len() {
            let iov = &mut iovecs[next];
            if left >= iov.iov_len {
                left -= iov.iov_len;
                next += 1;
            } else {
                // SAFETY: `left` < the iovec's length: the pointer stays inside its slice.
                iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(left).cast() };
                iov.iov_len -= left;
                left = 0;
            }
        }
        while next < iovecs.len() && iovecs[next].iov_len == 0 {
            next += 1;
        }
    }
    Ok(())
}

/// The most iovecs one `preadv`/`pwritev` takes (Linux's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("reading or writing the image: {0}")]
    Io(std::io::Error),
    #[error("offset {0} is past what the host's file offsets hold")]
    Offset(u64),
    #[error("{len} bytes at guest-physical {addr:#x}: {source}")]
    Memory {
        addr: u64,
        len: u32,
        source: vm_memory::GuestMemoryError,
    },
}

#[cfg(test)]
mod tests;
