//! Snapshots: a VM stopped at a ready point written to a directory, and a VM restored from
//! one in milliseconds, its memory mapped copy-on-write from the snapshot's file.
//!
//! A snapshot directory holds two files:
//!
//! * `memory`: guest memory as a plain file, the regions of [`crate::Vm::memory`] in
//!   address order, each at the file offset the state file records. Pages of zeroes are
//!   holes (the file is sparse). A restore maps it `MAP_PRIVATE`: the guest's writes go to
//!   private copies, the file never changes, and any number of restores share it.
//! * `state`: everything else, little-endian:
//!
//! ```text
//! header   magic "HVPSNAP\0" | format version u32 | reserved u32 | payload length u64 | payload FNV-1a u64
//! payload  backend u8 | host CPUID hash u64 | vCPU count u32 | memory bytes u64
//!          regions: count u32, (guest address u64, length u64, file offset u64)*
//!          memory file length u64
//!          VM: PIC master, PIC slave, IOAPIC (kvm_irqchip), PIT (kvm_pit_state2), kvmclock (kvm_clock_data)
//!          devices: serial (9 registers u8, receive FIFO bytes), CMOS index u8
//!          virtio devices: count u32, per device: type u32, status u32, driver features u64,
//!                    queue select u32, feature selects u32 u32, interrupt status u32,
//!                    needs-reset u8, queues, serving? queues, kind u8 then its record
//!                    (1, a disk: path bytes, size u64, read-only u8, partition table
//!                    SHA-256 bytes)
//!                    where queues = count u32, (max size u16, next avail u16, next used
//!                    u16, event idx u8, size u16, ready u8, desc u64, avail u64, used u64)*
//!          per vCPU: CPUID entries, MSRs (count u32, (index u32, value u64)*), regs, sregs, fpu,
//!                    xsave?, xcrs?, lapic, vcpu events, mp_state, debug regs
//! ```
//!
//! A KVM structure is a record: its length u32, then its bytes as KVM gave them; a record
//! whose length is not the structure's size in this build is refused. `x?` is a presence
//! byte then the record. The host CPUID hash is FNV-1a over `KVM_GET_SUPPORTED_CPUID`:
//! a snapshot taken where KVM offers other CPU features is refused, since the guest kernel
//! chose its code paths by those features at boot.
//!
//! Every check of the file (version, length, checksum, CPUID hash, vCPU count, memory file
//! size, and each disk image against what the snapshot saw of it) is made before the
//! first KVM object is created; the devices' saved state (their kinds, queues and rings)
//! is checked as it is put back, before any vCPU runs. A bad snapshot runs nothing.
//!
//! A snapshot is trusted input, as a kernel and an initrd are: it defines the guest, and
//! it names the disk images a restore without `--disk` opens.
//!
//! A disk is saved as what a restore must find again: its image's size, attachment and
//! partition table (which the guest parsed when it found the disk and keeps in memory;
//! the bundled init mounts a disk only after a restore, so the guest holds no
//! filesystem state of it). The image itself is not copied: a restore is given it again
//! (`--disk`, or the path saved), and the guest's writes after a restore go to it as
//! they would have without the snapshot.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};
use vm_superio::serial::SerialState;

use crate::backend::Backend;
use crate::console::{ConsoleLog, ConsoleOutput};
use crate::vcpu::StopReason;
use crate::virtio::block::{Block, DiskConfig, DiskError, DiskImage, DiskMismatch, SavedDisk};
use crate::virtio::mmio::TransportSave;
use crate::virtio::{DeviceSave, MmioDevices, RestoreError, SaveError, SavedDevice, VirtioDevice};
use crate::vm::{create_devices, create_machine, memory_ranges, register_guest_memory};
use crate::{kvm_err, Error, Vm};

mod codec;
mod memory_file;

use codec::{StateReader, StateWriter};
use memory_file::write_memory;

/// Version of the snapshot format this build writes and reads (3: virtio devices are
/// saved; 2: the out-of-line area became 4 MiB, so guest memory is laid out differently).
pub const SNAPSHOT_FORMAT_VERSION: u32 = 3;

/// The directory name under which tools and tests cache a snapshot of the guest built
/// with key `guest_key`: one per vCPU count, format and backend (a snapshot restores only
/// on the backend that took it).
pub fn snapshot_cache_name(guest_key: &str, cpus: u8, backend: Backend) -> String {
    format!(
        "{guest_key}-{cpus}cpu-v{SNAPSHOT_FORMAT_VERSION}-{}",
        backend.short_name()
    )
}
/// The state file in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The guest memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// Byte offset of the format version in the state file (for tools and tests).
pub const VERSION_OFFSET: usize = 8;

const MAGIC: [u8; 8] = *b"HVPSNAP\0";
const HEADER_LEN: usize = 32;
const PAGE: usize = 4096;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// MSRs read per KVM_GET_MSRS (the kvm-bindings wrapper holds at most 256).
const MSR_CHUNK: usize = 200;

/// Errors of snapshot creation and restore. Each names the file or the mismatch.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not an hvprobe snapshot state file (no HVPSNAP magic)")]
    NotASnapshot { path: PathBuf },
    #[error("{path} has snapshot format version {found}; this hvprobe reads version {expected} only (create the snapshot again)")]
    Version { path: PathBuf, found: u32, expected: u32 },
    #[error("{path} is truncated: {detail}")]
    Truncated { path: PathBuf, detail: String },
    #[error("{path} is corrupt: its checksum does not match its contents")]
    Corrupt { path: PathBuf },
    #[error("{path} is malformed: {detail}")]
    Malformed { path: PathBuf, detail: String },
    #[error(
        "the snapshot was taken on a host whose KVM offers other CPU features (CPUID hash {snapshot:#018x}, \
         this host {host:#018x}); the guest kernel chose its code by those features, so it cannot run here"
    )]
    CpuFeatures { snapshot: u64, host: u64 },
    #[error("the snapshot was taken on {snapshot}; this host runs {host}")]
    Backend { snapshot: String, host: String },
    #[error("the snapshot has {snapshot} vCPU(s) but {requested} were requested; --cpus must match the snapshot")]
    CpuCount { snapshot: u32, requested: u8 },
    #[error("cannot save a snapshot: the VM is not stopped at the guest's ready point ({0})")]
    NotAtReadyPoint(String),
    #[error("cannot save a snapshot: a vCPU's state was lost")]
    VcpuStateLost,
    #[error("cannot save a snapshot: {0}")]
    SaveDevice(#[from] SaveError),
    #[error(
        "the snapshot has {saved} disk(s) and {given} were given: give none (the snapshot's own images) or \
         every disk in the snapshot's order"
    )]
    DiskCount { saved: usize, given: usize },
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    DiskMismatch(#[from] DiskMismatch),
    #[error(transparent)]
    RestoreDevice(#[from] RestoreError),
    #[error(transparent)]
    Vm(#[from] Error),
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SnapshotError + 'a {
    move |source| SnapshotError::Io {
        action,
        path: path.into(),
        source,
    }
}

/// FNV-1a, 64 bit: stable across builds and Rust versions (std's hashers are not).
fn fnv1a(bytes: &[u8], mut hash: u64) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A hash of the CPU features this host's KVM supports (`KVM_GET_SUPPORTED_CPUID`).
pub fn host_cpuid_hash(kvm: &Kvm) -> Result<u64, Error> {
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let mut hash = FNV_OFFSET;
    for e in cpuid.as_slice() {
        // KVM fills these from the `cpuid` of the host CPU the ioctl ran on: they name
        // that CPU (APIC ids, core and node ids, hybrid core type), not a feature.
        let (mut eax, mut ebx, mut ecx, mut edx) = (e.eax, e.ebx, e.ecx, e.edx);
        match e.function {
            1 => ebx &= 0x00ff_ffff,
            0xb | 0x1f => edx = 0,
            0x1a | 0x8000_001e => (eax, ebx, ecx, edx) = (0, 0, 0, 0),
            _ => {}
        }
        for v in [e.function, e.index, e.flags, eax, ebx, ecx, edx] {
            hash = fnv1a(&v.to_le_bytes(), hash);
        }
    }
    Ok(hash)
}

/// One guest memory region in the memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegionRecord {
    guest_addr: u64,
    len: u64,
    file_offset: u64,
}

/// The state of one vCPU.
struct VcpuRecord {
    cpuid: Vec<kvm_cpuid_entry2>,
    msrs: Vec<(u32, u64)>,
    regs: Box<kvm_regs>,
    sregs: Box<kvm_sregs>,
    fpu: Box<kvm_fpu>,
    xsave: Option<Box<kvm_xsave>>,
    xcrs: Option<Box<kvm_xcrs>>,
    lapic: Box<kvm_lapic_state>,
    events: Box<kvm_vcpu_events>,
    mp_state: Box<kvm_mp_state>,
    debugregs: Box<kvm_debugregs>,
}

/// A parsed state file.
struct State {
    backend: Backend,
    cpuid_hash: u64,
    vcpu_count: u32,
    mem_bytes: u64,
    regions: Vec<RegionRecord>,
    memory_file_len: u64,
    pic_master: Box<kvm_irqchip>,
    pic_slave: Box<kvm_irqchip>,
    ioapic: Box<kvm_irqchip>,
    pit: Box<kvm_pit_state2>,
    clock: Box<kvm_clock_data>,
    serial: SerialState,
    cmos_index: u8,
    vcpus: Vec<VcpuRecord>,
    virtio: Vec<TransportSave>,
}

/// Queues a saved device may have (virtio-fs has the most here: 2).
const MAX_SAVED_QUEUES: u32 = 16;

fn encode_queues(p: &mut StateWriter, queues: &[virtio_queue::QueueState]) {
    p.u32(queues.len() as u32);
    for q in queues {
        p.u16(q.max_size);
        p.u16(q.next_avail);
        p.u16(q.next_used);
        p.u8(u8::from(q.event_idx_enabled));
        p.u16(q.size);
        p.u8(u8::from(q.ready));
        p.u64(q.desc_table);
        p.u64(q.avail_ring);
        p.u64(q.used_ring);
    }
}

fn decode_queues(r: &mut StateReader<'_>) -> Result<Vec<virtio_queue::QueueState>, SnapshotError> {
    let n = r.u32("virtio queue count")?;
    if n > MAX_SAVED_QUEUES {
        return Err(r.malformed(format!("{n} virtio queues")));
    }
    (0..n)
        .map(|_| {
            Ok(virtio_queue::QueueState {
                max_size: r.u16("virtio queue")?,
                next_avail: r.u16("virtio queue")?,
                next_used: r.u16("virtio queue")?,
                event_idx_enabled: r.bool("virtio queue")?,
                size: r.u16("virtio queue")?,
                ready: r.bool("virtio queue")?,
                desc_table: r.u64("virtio queue")?,
                avail_ring: r.u64("virtio queue")?,
                used_ring: r.u64("virtio queue")?,
            })
        })
        .collect()
}

const DEVICE_BLOCK: u8 = 1;

fn encode_device(p: &mut StateWriter, t: &TransportSave) {
    p.u32(t.device_type);
    p.u32(t.status);
    p.u64(t.driver_features);
    p.u32(t.queue_select);
    p.u32(t.device_features_select);
    p.u32(t.driver_features_select);
    p.u32(t.interrupt_status);
    p.u8(u8::from(t.needs_reset));
    encode_queues(p, &t.queues);
    match &t.device.serving {
        Some(queues) => {
            p.u8(1);
            encode_queues(p, queues);
        }
        None => p.u8(0),
    }
    match &t.device.device {
        SavedDevice::Block(disk) => {
            p.u8(DEVICE_BLOCK);
            p.bytes(std::os::unix::ffi::OsStrExt::as_bytes(disk.path.as_os_str()));
            p.u64(disk.size);
            p.u8(u8::from(disk.read_only));
            p.bytes(&disk.partition_table);
        }
    }
}

fn decode_device(r: &mut StateReader<'_>) -> Result<TransportSave, SnapshotError> {
    let device_type = r.u32("virtio device type")?;
    let status = r.u32("virtio status")?;
    let driver_features = r.u64("virtio driver features")?;
    let queue_select = r.u32("virtio queue select")?;
    let device_features_select = r.u32("virtio feature select")?;
    let driver_features_select = r.u32("virtio feature select")?;
    let interrupt_status = r.u32("virtio interrupt status")?;
    let needs_reset = r.bool("virtio needs-reset")?;
    let queues = decode_queues(r)?;
    let serving = match r.bool("virtio serving")? {
        true => Some(decode_queues(r)?),
        false => None,
    };
    let device = match r.u8("virtio device kind")? {
        DEVICE_BLOCK => {
            use std::os::unix::ffi::OsStrExt;
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(r.bytes("disk path")?));
            let size = r.u64("disk size")?;
            let read_only = r.bool("disk read-only")?;
            let digest = r.bytes("disk partition table digest")?;
            let partition_table = <[u8; 32]>::try_from(digest)
                .map_err(|_| r.malformed(format!("a {}-byte partition table digest", digest.len())))?;
            SavedDevice::Block(SavedDisk {
                path,
                size,
                read_only,
                partition_table,
            })
        }
        kind => return Err(r.malformed(format!("virtio device kind {kind}"))),
    };
    Ok(TransportSave {
        device_type,
        status,
        driver_features,
        queue_select,
        device_features_select,
        driver_features_select,
        interrupt_status,
        needs_reset,
        queues,
        device: DeviceSave { device, serving },
    })
}

fn backend_code(b: Backend) -> u8 {
    match b {
        Backend::Hardware => 0,
        Backend::Pvm => 1,
    }
}

impl State {
    fn encode(&self) -> Vec<u8> {
        let mut p = StateWriter::default();
        p.u8(backend_code(self.backend));
        p.u64(self.cpuid_hash);
        p.u32(self.vcpu_count);
        p.u64(self.mem_bytes);
        p.u32(self.regions.len() as u32);
        for r in &self.regions {
            p.u64(r.guest_addr);
            p.u64(r.len);
            p.u64(r.file_offset);
        }
        p.u64(self.memory_file_len);
        p.pod(&*self.pic_master);
        p.pod(&*self.pic_slave);
        p.pod(&*self.ioapic);
        p.pod(&*self.pit);
        p.pod(&*self.clock);
        let s = &self.serial;
        for v in [
            s.baud_divisor_low,
            s.baud_divisor_high,
            s.interrupt_enable,
            s.interrupt_identification,
            s.line_control,
            s.line_status,
            s.modem_control,
            s.modem_status,
            s.scratch,
        ] {
            p.u8(v);
        }
        p.bytes(&s.in_buffer);
        p.u8(self.cmos_index);
        p.u32(self.virtio.len() as u32);
        for device in &self.virtio {
            encode_device(&mut p, device);
        }
        for v in &self.vcpus {
            p.u32(v.cpuid.len() as u32);
            for e in &v.cpuid {
                p.pod(e);
            }
            p.u32(v.msrs.len() as u32);
            for &(index, data) in &v.msrs {
                p.u32(index);
                p.u64(data);
            }
            p.pod(&*v.regs);
            p.pod(&*v.sregs);
            p.pod(&*v.fpu);
            p.opt_pod(v.xsave.as_deref());
            p.opt_pod(v.xcrs.as_deref());
            p.pod(&*v.lapic);
            p.pod(&*v.events);
            p.pod(&*v.mp_state);
            p.pod(&*v.debugregs);
        }
        let payload = p.0;
        let mut file = Vec::with_capacity(HEADER_LEN + payload.len());
        file.extend_from_slice(&MAGIC);
        file.extend_from_slice(&SNAPSHOT_FORMAT_VERSION.to_le_bytes());
        file.extend_from_slice(&0u32.to_le_bytes());
        file.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        file.extend_from_slice(&fnv1a(&payload, FNV_OFFSET).to_le_bytes());
        file.extend_from_slice(&payload);
        file
    }

    fn decode(file: &[u8], path: &Path) -> Result<State, SnapshotError> {
        let truncated = |detail: String| SnapshotError::Truncated {
            path: path.into(),
            detail,
        };
        if file.len() < MAGIC.len() || file[..MAGIC.len()] != MAGIC {
            return Err(SnapshotError::NotASnapshot { path: path.into() });
        }
        if file.len() < HEADER_LEN {
            return Err(truncated(format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                file.len()
            )));
        }
        let word = |at: usize| u32::from_le_bytes(file[at..at + 4].try_into().unwrap());
        let quad = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap());
        let version = word(VERSION_OFFSET);
        if version != SNAPSHOT_FORMAT_VERSION {
            return Err(SnapshotError::Version {
                path: path.into(),
                found: version,
                expected: SNAPSHOT_FORMAT_VERSION,
            });
        }
        let payload_len = quad(16);
        let actual = (file.len() - HEADER_LEN) as u64;
        if actual < payload_len {
            return Err(truncated(format!(
                "the header announces {payload_len} bytes of state, the file has {actual}"
            )));
        }
        if actual > payload_len {
            return Err(SnapshotError::Malformed {
                path: path.into(),
                detail: format!("{} bytes after the state", actual - payload_len),
            });
        }
        let payload = &file[HEADER_LEN..];
        if fnv1a(payload, FNV_OFFSET) != quad(24) {
            return Err(SnapshotError::Corrupt { path: path.into() });
        }
        let mut r = StateReader {
            buf: payload,
            pos: 0,
            path,
        };
        let backend = match r.u8("backend")? {
            0 => Backend::Hardware,
            1 => Backend::Pvm,
            v => return Err(r.malformed(format!("unknown backend {v}"))),
        };
        let cpuid_hash = r.u64("CPUID hash")?;
        let vcpu_count = r.u32("vCPU count")?;
        if vcpu_count == 0 || vcpu_count > u32::from(crate::MAX_CPUS) {
            return Err(r.malformed(format!("{vcpu_count} vCPUs")));
        }
        let mem_bytes = r.u64("memory size")?;
        let region_count = r.u32("region count")?;
        let mut regions = Vec::new();
        for _ in 0..region_count.min(64) {
            regions.push(RegionRecord {
                guest_addr: r.u64("region")?,
                len: r.u64("region")?,
                file_offset: r.u64("region")?,
            });
        }
        if regions.len() as u32 != region_count {
            return Err(r.malformed(format!("{region_count} memory regions")));
        }
        let memory_file_len = r.u64("memory file length")?;
        for reg in &regions {
            let fits = reg
                .file_offset
                .checked_add(reg.len)
                .is_some_and(|end| end <= memory_file_len);
            if !fits || reg.len == 0 || reg.file_offset % PAGE as u64 != 0 || reg.len % PAGE as u64 != 0 {
                return Err(r.malformed(format!("memory region {reg:x?}")));
            }
        }
        let pic_master = r.pod("PIC master")?;
        let pic_slave = r.pod("PIC slave")?;
        let ioapic = r.pod("IOAPIC")?;
        let pit = r.pod("PIT")?;
        let clock = r.pod("kvmclock")?;
        let mut regs = [0u8; 9];
        for v in regs.iter_mut() {
            *v = r.u8("serial registers")?;
        }
        let serial = SerialState {
            baud_divisor_low: regs[0],
            baud_divisor_high: regs[1],
            interrupt_enable: regs[2],
            interrupt_identification: regs[3],
            line_control: regs[4],
            line_status: regs[5],
            modem_control: regs[6],
            modem_status: regs[7],
            scratch: regs[8],
            in_buffer: r.bytes("serial FIFO")?.to_vec(),
        };
        let cmos_index = r.u8("CMOS index")?;
        let device_count = r.u32("virtio device count")?;
        if device_count as usize > crate::virtio::MAX_DEVICES {
            return Err(r.malformed(format!("{device_count} virtio devices")));
        }
        let virtio = (0..device_count)
            .map(|_| decode_device(&mut r))
            .collect::<Result<Vec<_>, _>>()?;
        let mut vcpus = Vec::new();
        for _ in 0..vcpu_count {
            let n = r.u32("CPUID entry count")?;
            if n as usize > KVM_MAX_CPUID_ENTRIES {
                return Err(r.malformed(format!("{n} CPUID entries")));
            }
            let cpuid = (0..n)
                .map(|_| r.pod::<kvm_cpuid_entry2>("CPUID entry").map(|b| *b))
                .collect::<Result<_, _>>()?;
            let n = r.u32("MSR count")?;
            let msrs = (0..n)
                .map(|_| Ok((r.u32("MSR")?, r.u64("MSR")?)))
                .collect::<Result<_, SnapshotError>>()?;
            vcpus.push(VcpuRecord {
                cpuid,
                msrs,
                regs: r.pod("regs")?,
                sregs: r.pod("sregs")?,
                fpu: r.pod("FPU")?,
                xsave: r.opt_pod("xsave")?,
                xcrs: r.opt_pod("xcrs")?,
                lapic: r.pod("LAPIC")?,
                events: r.pod("vCPU events")?,
                mp_state: r.pod("mp_state")?,
                debugregs: r.pod("debug registers")?,
            });
        }
        if r.pos != payload.len() {
            return Err(r.malformed(format!("{} unparsed bytes at the end", payload.len() - r.pos)));
        }
        Ok(State {
            backend,
            cpuid_hash,
            vcpu_count,
            mem_bytes,
            regions,
            memory_file_len,
            pic_master,
            pic_slave,
            ioapic,
            pit,
            clock,
            serial,
            cmos_index,
            vcpus,
            virtio,
        })
    }

    /// The disks the snapshot saw, in device order.
    fn disks(&self) -> Vec<&SavedDisk> {
        self.virtio
            .iter()
            .map(|t| match &t.device.device {
                SavedDevice::Block(disk) => disk,
            })
            .collect()
    }
}

/// The disks a snapshot in `dir` saw, in device order: what a restore without `--disk`
/// opens.
pub fn snapshot_disks(dir: &Path) -> Result<Vec<DiskConfig>, SnapshotError> {
    let state_path = dir.join(STATE_FILE);
    let raw = std::fs::read(&state_path).map_err(io_err("read snapshot state", &state_path))?;
    let state = State::decode(&raw, &state_path)?;
    Ok(state
        .disks()
        .into_iter()
        .map(|d| DiskConfig {
            path: d.path.clone(),
            read_only: d.read_only,
        })
        .collect())
}

/// What a saved snapshot holds.
#[derive(Clone, Debug)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    pub vcpus: u32,
    pub mem_bytes: u64,
    /// Bytes of guest memory that are not zero (what the sparse memory file stores).
    pub memory_written: u64,
}

fn irqchip(vm_fd: &VmFd, chip_id: u32) -> Result<Box<kvm_irqchip>, Error> {
    let mut chip = Box::new(kvm_irqchip {
        chip_id,
        ..Default::default()
    });
    vm_fd.get_irqchip(&mut chip).map_err(kvm_err("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

/// The MSRs of `vcpu` among `indices`, skipping the ones KVM refuses to read (KVM_GET_MSRS
/// stops at the first it cannot read and says how many it read).
fn readable_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<(u32, u64)>, Error> {
    let mut out = Vec::new();
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSR_CHUNK)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(crate::error::list_err("MSRs"))?;
        let n = vcpu.get_msrs(&mut msrs).map_err(kvm_err("KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice()[..n].iter().map(|e| (e.index, e.data)));
        if n < chunk.len() {
            tracing::debug!("MSR {:#x} is not readable; not saved", chunk[n]);
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    Ok(out)
}

/// Writes `msrs` to `vcpu`, each one KVM refuses skipped with a warning.
fn write_msrs(cpu: usize, vcpu: &VcpuFd, msrs: &[(u32, u64)]) -> Result<(), Error> {
    let mut rest = msrs;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSR_CHUNK)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        let list = Msrs::from_entries(&entries).map_err(crate::error::list_err("MSRs"))?;
        let n = vcpu.set_msrs(&list).map_err(kvm_err("KVM_SET_MSRS"))?;
        if n < chunk.len() {
            tracing::warn!(
                "vCPU {cpu}: KVM refused to restore MSR {:#x} = {:#x}",
                chunk[n].0,
                chunk[n].1
            );
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    Ok(())
}

fn save_vcpu(kvm: &Kvm, vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuRecord, Error> {
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_CPUID2"))?
        .as_slice()
        .to_vec();
    // KVM_GET_XSAVE fails or returns nothing useful where the host has no xsave; the FPU
    // record covers the x87/SSE state then.
    let xsave = if kvm.check_extension(Cap::Xsave) {
        vcpu.get_xsave()
            .map_err(|e| tracing::debug!("KVM_GET_XSAVE: {e}; saving the FPU state only"))
            .ok()
            .map(Box::new)
    } else {
        None
    };
    let xcrs = if kvm.check_extension(Cap::Xcrs) {
        vcpu.get_xcrs()
            .map_err(|e| tracing::debug!("KVM_GET_XCRS: {e}; not saved"))
            .ok()
            .map(Box::new)
    } else {
        None
    };
    Ok(VcpuRecord {
        cpuid,
        msrs: readable_msrs(vcpu, msr_indices)?,
        regs: Box::new(vcpu.get_regs().map_err(kvm_err("KVM_GET_REGS"))?),
        sregs: Box::new(vcpu.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?),
        fpu: Box::new(vcpu.get_fpu().map_err(kvm_err("KVM_GET_FPU"))?),
        xsave,
        xcrs,
        lapic: Box::new(vcpu.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?),
        events: Box::new(vcpu.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?),
        mp_state: Box::new(vcpu.get_mp_state().map_err(kvm_err("KVM_GET_MP_STATE"))?),
        debugregs: Box::new(vcpu.get_debug_regs().map_err(kvm_err("KVM_GET_DEBUGREGS"))?),
    })
}

/// Restores one vCPU in the order firecracker uses: CPUID first (KVM checks MSRs and
/// sregs against it), MSRs, sregs (APIC base, paging) before regs, FPU and extended
/// state, then the LAPIC, and the TSC deadline again after it (KVM ignores that MSR while
/// the LAPIC timer is not in deadline mode), pending events, mp_state, debug registers.
///
/// The segment registers go back as the vCPU held them ([`Backend::segments_as_held`]):
/// kvm_amd recorded TR busy whatever the vCPU held, and restored so, the lane's QEMU TCG
/// refused a restored guest's ioperm() ports.
fn restore_vcpu(cpu: usize, vcpu: &VcpuFd, v: &VcpuRecord, backend: Backend) -> Result<(), Error> {
    let cpuid = CpuId::from_entries(&v.cpuid).map_err(crate::error::list_err("CPUID entries"))?;
    vcpu.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
    write_msrs(cpu, vcpu, &v.msrs)?;
    vcpu.set_sregs(&backend.segments_as_held(*v.sregs))
        .map_err(kvm_err("KVM_SET_SREGS"))?;
    vcpu.set_regs(&v.regs).map_err(kvm_err("KVM_SET_REGS"))?;
    vcpu.set_fpu(&v.fpu).map_err(kvm_err("KVM_SET_FPU"))?;
    if let Some(xsave) = &v.xsave {
        // SAFETY: the buffer is a whole `kvm_xsave` (the legacy 4 KiB KVM_GET_XSAVE
        // returned on a host with the same CPU features), so KVM reads inside it.
        unsafe { vcpu.set_xsave(xsave) }.map_err(kvm_err("KVM_SET_XSAVE"))?;
    }
    if let Some(xcrs) = &v.xcrs {
        vcpu.set_xcrs(xcrs).map_err(kvm_err("KVM_SET_XCRS"))?;
    }
    vcpu.set_lapic(&v.lapic).map_err(kvm_err("KVM_SET_LAPIC"))?;
    let deadline: Vec<(u32, u64)> = v
        .msrs
        .iter()
        .copied()
        .filter(|&(index, _)| index == MSR_IA32_TSC_DEADLINE)
        .collect();
    write_msrs(cpu, vcpu, &deadline)?;
    vcpu.set_vcpu_events(&v.events)
        .map_err(kvm_err("KVM_SET_VCPU_EVENTS"))?;
    vcpu.set_mp_state(*v.mp_state).map_err(kvm_err("KVM_SET_MP_STATE"))?;
    vcpu.set_debug_regs(&v.debugregs)
        .map_err(kvm_err("KVM_SET_DEBUGREGS"))?;
    Ok(())
}

impl Vm {
    /// Saves the VM into `dir` (created if needed): guest memory and the state of every
    /// vCPU and device. The VM must have stopped at its ready point
    /// ([`Vm::run_until_ready`]). The state file is written last, under a temporary name
    /// renamed into place, so a directory with a `state` file holds a whole snapshot.
    pub fn save_snapshot(&self, dir: &Path) -> Result<SnapshotInfo, SnapshotError> {
        match self.control.stop_reason() {
            Some(StopReason::GuestReady) => {}
            other => {
                return Err(SnapshotError::NotAtReadyPoint(
                    other.map(|r| r.to_string()).unwrap_or_else(|| "it has not run".into()),
                ))
            }
        }
        if self.vcpus.len() != self.control.vcpu_count() {
            return Err(SnapshotError::VcpuStateLost);
        }
        // The devices first, held still while the rest is saved: a disk's worker finishes
        // the request in hand, and nothing it does lands in guest memory or the interrupt
        // controllers after its state was taken. They go on afterwards whatever happened.
        let saved = self
            .virtio
            .save()
            .map_err(SnapshotError::from)
            .and_then(|virtio| self.save_with(dir, virtio));
        let resumed = self.virtio.resume();
        let info = saved?;
        resumed?;
        Ok(info)
    }

    /// The rest of [`Vm::save_snapshot`], the devices' state taken.
    fn save_with(&self, dir: &Path, virtio: Vec<TransportSave>) -> Result<SnapshotInfo, SnapshotError> {
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for region in self.mem.iter() {
            regions.push(RegionRecord {
                guest_addr: region.start_addr().0,
                len: region.len(),
                file_offset: offset,
            });
            offset += region.len().next_multiple_of(PAGE as u64);
        }
        let msr_indices = self
            .kvm
            .get_msr_index_list()
            .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))?
            .as_slice()
            .to_vec();
        let vcpus = self
            .vcpus
            .iter()
            .map(|v| save_vcpu(&self.kvm, v, &msr_indices))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(v) = vcpus.first() {
            tracing::info!(
                "saving {} of {} listed MSRs per vCPU, xsave {}, xcrs {}",
                v.msrs.len(),
                msr_indices.len(),
                if v.xsave.is_some() { "saved" } else { "not available" },
                if v.xcrs.is_some() { "saved" } else { "not available" },
            );
        }
        let mut clock = Box::new(self.vm_fd.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?);
        // Restore the clock as it was, not advanced by the host time between save and
        // restore: the guest continues where it stopped.
        clock.flags = 0;
        let state = State {
            backend: self.backend,
            cpuid_hash: host_cpuid_hash(&self.kvm)?,
            vcpu_count: self.vcpus.len() as u32,
            mem_bytes: regions.iter().map(|r| r.len).sum::<u64>() - crate::layout::OOL_AREA_SIZE,
            memory_file_len: offset,
            regions,
            pic_master: irqchip(&self.vm_fd, KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: irqchip(&self.vm_fd, KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: irqchip(&self.vm_fd, KVM_IRQCHIP_IOAPIC)?,
            pit: Box::new(self.vm_fd.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?),
            clock,
            serial: self.devices.serial.lock().unwrap_or_else(|e| e.into_inner()).state(),
            cmos_index: self.devices.cmos_index(),
            vcpus,
            virtio,
        };
        let memory_path = dir.join(MEMORY_FILE);
        let state_path = dir.join(STATE_FILE);
        // A previous snapshot's state goes first: until the new one is complete the
        // directory is not a snapshot.
        match std::fs::remove_file(&state_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err("remove", &state_path)(e)),
            _ => {}
        }
        let memory_written = write_memory(&self.mem, &state.regions, &memory_path)?;
        let tmp = dir.join(format!(".{STATE_FILE}.tmp-{}", std::process::id()));
        let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
        f.write_all(&state.encode()).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("sync", &tmp))?;
        std::fs::rename(&tmp, &state_path).map_err(io_err("rename into place", &state_path))?;
        Ok(SnapshotInfo {
            dir: dir.into(),
            vcpus: state.vcpu_count,
            mem_bytes: state.mem_bytes,
            memory_written,
        })
    }

    /// Restores the VM saved in `dir`. `cpus`, when given, must equal the snapshot's vCPU
    /// count. Guest memory is the snapshot's memory file mapped `MAP_PRIVATE`: pages are
    /// read from the page cache on first touch and copied on first write; the file is opened
    /// read-only and never changes. `disks` are the snapshot's disks, in its order (none:
    /// the images at the paths it saved), each checked against what the snapshot saw of it
    /// ([`DiskImage::check_saved`]). Everything is checked before KVM objects are created.
    pub fn restore(
        dir: &Path,
        cpus: Option<u8>,
        console_output: ConsoleOutput,
        disks: &[DiskConfig],
    ) -> Result<Vm, SnapshotError> {
        let state_path = dir.join(STATE_FILE);
        let memory_path = dir.join(MEMORY_FILE);
        let raw = std::fs::read(&state_path).map_err(io_err("read snapshot state", &state_path))?;
        let state = State::decode(&raw, &state_path)?;
        if let Some(requested) = cpus {
            if u32::from(requested) != state.vcpu_count {
                return Err(SnapshotError::CpuCount {
                    snapshot: state.vcpu_count,
                    requested,
                });
            }
        }
        let host_backend = Backend::detect();
        if host_backend != state.backend {
            return Err(SnapshotError::Backend {
                snapshot: state.backend.to_string(),
                host: host_backend.to_string(),
            });
        }
        let kvm = Kvm::new().map_err(Error::OpenKvm)?;
        let host_hash = host_cpuid_hash(&kvm)?;
        if host_hash != state.cpuid_hash {
            return Err(SnapshotError::CpuFeatures {
                snapshot: state.cpuid_hash,
                host: host_hash,
            });
        }
        let memory_file = File::open(&memory_path).map_err(io_err("open snapshot memory", &memory_path))?;
        let memory_len = memory_file
            .metadata()
            .map_err(io_err("stat snapshot memory", &memory_path))?
            .len();
        if memory_len != state.memory_file_len {
            return Err(SnapshotError::Truncated {
                path: memory_path,
                detail: format!(
                    "{memory_len} bytes, the snapshot's guest memory is {} bytes",
                    state.memory_file_len
                ),
            });
        }
        let expected: Vec<(u64, u64)> = memory_ranges(state.mem_bytes)
            .iter()
            .map(|&(a, l)| (a.0, l as u64))
            .collect();
        let recorded: Vec<(u64, u64)> = state.regions.iter().map(|r| (r.guest_addr, r.len)).collect();
        if expected != recorded {
            return Err(SnapshotError::Malformed {
                path: state_path,
                detail: format!("memory regions {recorded:x?} are not this VMM's layout {expected:x?}"),
            });
        }

        let saved_disks = state.disks();
        let configs: Vec<DiskConfig> = match disks {
            [] => saved_disks
                .iter()
                .map(|d| DiskConfig {
                    path: d.path.clone(),
                    read_only: d.read_only,
                })
                .collect(),
            given if given.len() == saved_disks.len() => given.to_vec(),
            given => {
                return Err(SnapshotError::DiskCount {
                    saved: saved_disks.len(),
                    given: given.len(),
                })
            }
        };
        let images = DiskImage::open_all(&configs)?;
        for (image, saved) in images.iter().zip(&saved_disks) {
            image.check_saved(saved)?;
        }

        let (kvm, vm_fd, backend) = create_machine(Some(kvm))?;
        let mut regions = Vec::new();
        for r in &state.regions {
            let file = memory_file.try_clone().map_err(io_err("duplicate", &memory_path))?;
            let mapping = MmapRegionBuilder::new(r.len as usize)
                .with_file_offset(FileOffset::new(file, r.file_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
                .build()
                .map_err(|source| Error::GuestMemoryMap {
                    path: memory_path.clone(),
                    source,
                })?;
            regions.push(
                GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr)).ok_or(Error::RegionOverflow(r.guest_addr))?,
            );
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(Error::GuestMemoryLayout)?;
        register_guest_memory(&vm_fd, &mem)?;

        // VM-wide state first, as firecracker does: the PIT, the clock, the interrupt
        // controllers; then the vCPUs, whose LAPICs the IOAPIC routes to.
        vm_fd.set_pit2(&state.pit).map_err(kvm_err("KVM_SET_PIT2"))?;
        vm_fd.set_clock(&state.clock).map_err(kvm_err("KVM_SET_CLOCK"))?;
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            vm_fd.set_irqchip(chip).map_err(kvm_err("KVM_SET_IRQCHIP"))?;
        }
        let console_log = ConsoleLog::default();
        let devices = create_devices(
            &vm_fd,
            &console_log,
            console_output,
            Some(&state.serial),
            state.cmos_index,
        )?;
        // Every vCPU is created before any is restored, as firecracker and QEMU do: KVM
        // takes a vCPU's creation (a TSC write of 0) for a TSC synchronization, which
        // after an earlier vCPU's restored TSC started a new TSC generation for the next,
        // and KVM's master clock stayed off (a restored 2-vCPU guest's kvm-clock was not
        // flagged stable where a fresh boot's is).
        let vcpus = (0..state.vcpus.len())
            .map(|cpu| vm_fd.create_vcpu(cpu as u64).map_err(kvm_err("KVM_CREATE_VCPU")))
            .collect::<Result<Vec<_>, _>>()?;
        for (cpu, (vcpu, record)) in vcpus.iter().zip(&state.vcpus).enumerate() {
            restore_vcpu(cpu, vcpu, record, backend)?;
        }
        let blocks: Vec<Box<dyn VirtioDevice>> = images
            .into_iter()
            .map(|image| Box::new(Block::new(image)) as Box<dyn VirtioDevice>)
            .collect();
        let mut vm = Vm::from_parts(kvm, vm_fd, backend, mem, vcpus, devices, console_log, false)?;
        let panics = crate::vcpu::PanicStop::new(vm.control());
        let virtio = MmioDevices::attach(&vm.vm_fd, &vm.mem, blocks, &panics)?;
        virtio.restore(&state.virtio)?;
        vm.virtio = std::sync::Arc::new(virtio);
        Ok(vm)
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::Bytes;

    use super::memory_file::data_extents;
    use super::*;

    fn sample_state() -> State {
        let serial = SerialState {
            in_buffer: vec![1, 2, 3],
            ..Default::default()
        };
        let vcpu = || VcpuRecord {
            cpuid: vec![kvm_cpuid_entry2 {
                function: 1,
                eax: 0x1234,
                ..Default::default()
            }],
            msrs: vec![(0x10, 99), (MSR_IA32_TSC_DEADLINE, 7)],
            regs: Box::new(kvm_regs {
                rip: 0xffff_ffff_8100_0000,
                ..Default::default()
            }),
            sregs: Box::default(),
            fpu: Box::default(),
            xsave: None,
            xcrs: Some(Box::default()),
            lapic: Box::new(kvm_lapic_state::default()),
            events: Box::default(),
            mp_state: Box::default(),
            debugregs: Box::default(),
        };
        State {
            backend: Backend::Pvm,
            cpuid_hash: 0xfeed,
            vcpu_count: 2,
            mem_bytes: 128 << 20,
            regions: vec![
                RegionRecord {
                    guest_addr: 0,
                    len: 128 << 20,
                    file_offset: 0,
                },
                RegionRecord {
                    guest_addr: 0xd000_0000,
                    len: 2 << 20,
                    file_offset: 128 << 20,
                },
            ],
            memory_file_len: 130 << 20,
            pic_master: Box::default(),
            pic_slave: Box::default(),
            ioapic: Box::default(),
            pit: Box::default(),
            clock: Box::new(kvm_clock_data {
                clock: 42,
                ..Default::default()
            }),
            serial,
            cmos_index: 0x0b,
            vcpus: vec![vcpu(), vcpu()],
            virtio: vec![TransportSave {
                device_type: 2,
                status: 0xf,
                driver_features: 1 << 32 | 1 << 9,
                queue_select: 0,
                device_features_select: 1,
                driver_features_select: 1,
                interrupt_status: 1,
                needs_reset: false,
                queues: vec![virtio_queue::QueueState {
                    max_size: 256,
                    size: 128,
                    ready: true,
                    desc_table: 0x10_0000,
                    avail_ring: 0x10_1000,
                    used_ring: 0x10_2000,
                    ..Default::default()
                }],
                device: DeviceSave {
                    device: SavedDevice::Block(SavedDisk {
                        path: "/images/disk.img".into(),
                        size: 3 << 20,
                        read_only: true,
                        partition_table: [0xab; 32],
                    }),
                    serving: Some(vec![virtio_queue::QueueState {
                        max_size: 256,
                        next_avail: 9,
                        next_used: 9,
                        event_idx_enabled: true,
                        size: 128,
                        ready: true,
                        desc_table: 0x10_0000,
                        avail_ring: 0x10_1000,
                        used_ring: 0x10_2000,
                    }]),
                },
            }],
        }
    }

    #[test]
    fn state_round_trips_through_its_encoding() {
        let bytes = sample_state().encode();
        let s = State::decode(&bytes, Path::new("state")).unwrap();
        assert_eq!(s.backend, Backend::Pvm);
        assert_eq!((s.cpuid_hash, s.vcpu_count, s.mem_bytes), (0xfeed, 2, 128 << 20));
        assert_eq!(s.regions, sample_state().regions);
        assert_eq!(s.clock.clock, 42);
        assert_eq!(s.serial.in_buffer, vec![1, 2, 3]);
        assert_eq!(s.cmos_index, 0x0b);
        assert_eq!(s.vcpus[1].regs.rip, 0xffff_ffff_8100_0000);
        assert_eq!(s.vcpus[1].msrs, vec![(0x10, 99), (MSR_IA32_TSC_DEADLINE, 7)]);
        assert_eq!(s.vcpus[0].cpuid[0].eax, 0x1234);
        assert!(s.vcpus[0].xsave.is_none() && s.vcpus[0].xcrs.is_some());
        assert_eq!(s.virtio, sample_state().virtio);
    }

    #[test]
    fn bad_state_files_are_refused_with_the_reason() {
        let good = sample_state().encode();
        let p = Path::new("state");
        let err = |b: &[u8]| State::decode(b, p).err().expect("must be refused").to_string();

        let mut v = good.clone();
        v[VERSION_OFFSET] += 1;
        let expected = format!(
            "format version {}; this hvprobe reads version {SNAPSHOT_FORMAT_VERSION}",
            SNAPSHOT_FORMAT_VERSION + 1
        );
        assert!(err(&v).contains(&expected), "{}", err(&v));
        assert!(err(&good[..good.len() - 10]).contains("truncated"));
        assert!(err(&good[..20]).contains("truncated"));
        assert!(err(b"hello").contains("no HVPSNAP magic"));
        let mut c = good.clone();
        let last = c.len() - 1;
        c[last] ^= 0xff;
        assert!(err(&c).contains("checksum"));
        let mut state = sample_state();
        state.virtio = vec![state.virtio[0].clone(); crate::virtio::MAX_DEVICES + 1];
        assert!(err(&state.encode()).contains("9 virtio devices"));
    }

    #[test]
    fn only_the_pages_a_guest_touched_are_read_from_its_memory_file() {
        let mem = crate::vm::shareable_guest_memory(64 << 20).unwrap();
        let ram = mem.find_region(GuestAddress(0)).unwrap().file_offset().unwrap();
        assert_eq!(data_extents(ram.file(), 0, 64 << 20), vec![]);
        mem.write_obj(1u8, GuestAddress(0x5001)).unwrap();
        mem.write_obj(1u8, GuestAddress(0x30_0000)).unwrap();
        mem.write_obj(1u8, GuestAddress(0x30_1000)).unwrap();
        assert_eq!(
            data_extents(ram.file(), 0, 64 << 20),
            vec![(0x5000, 0x1000), (0x30_0000, 0x2000)]
        );
        // Relative to the offset asked for, and cut at its length.
        assert_eq!(data_extents(ram.file(), 0x30_0000, 0x1000), vec![(0, 0x1000)]);
    }

    #[test]
    fn fnv_is_the_reference_fnv1a() {
        assert_eq!(fnv1a(b"", FNV_OFFSET), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a", FNV_OFFSET), 0xaf63_dc4c_8601_ec8c);
    }
}
