//! Virtio devices over the virtio-mmio transport (virtio 1.2, section 4.2), firecracker's
//! choice: no PCI bus, each device a 4 KiB register window and an interrupt line,
//! announced to the guest on its command line (`virtio_mmio.device=4K@BASE:IRQ`).
//!
//! Queues are rust-vmm's `virtio-queue`; the transport ([`mmio`]) is the register state
//! machine and runs on the vCPU threads; a device's requests are served off them
//! ([`block`]'s worker thread), woken by an ioeventfd on the queue-notify register and
//! answering through an irqfd, so that a vCPU never waits on the host's disk.
//!
//! Devices see guest RAM only: the out-of-line area (probe code the guest may not write)
//! is not in their memory, so a descriptor pointing there fails like any bad address.

pub mod block;
pub mod fs;
pub mod mmio;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;

use std::num::Wrapping;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING, VIRTIO_MMIO_QUEUE_NOTIFY};
use virtio_queue::{DescriptorChain, Queue, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::layout::{OOL_AREA_SIZE, OOL_AREA_START, VIRTIO_MMIO_START, VIRTIO_MMIO_WINDOW};
use crate::vcpu::PanicStop;
use crate::Error;

/// Interrupt lines for virtio devices, in device order: IOAPIC pins the MP table routes
/// (ISA 0-15) that no device of this machine uses (4 is the console).
pub const DEVICE_IRQS: [u32; 8] = [5, 6, 7, 9, 10, 11, 12, 14];
/// The most virtio devices one machine has.
pub const MAX_DEVICES: usize = DEVICE_IRQS.len();

/// A device behind the transport: its identity, features and config space, and the work
/// it does once the driver has set it up.
pub trait VirtioDevice: Send {
    /// The virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;
    /// The most entries each of its queues may have.
    fn queue_max_sizes(&self) -> &[u16];
    /// The feature bits it offers (the transport adds none of its own).
    fn features(&self) -> u64;
    /// Reads its config space at `offset`; bytes past its end read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Starts serving `queues` (all ready and valid) in `mem` with the features the driver
    /// took; `notify[i]` is signalled when the driver kicks queue `i`.
    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError>;
    /// Stops serving (the driver reset the device); the transport then forgets the queues.
    fn reset(&mut self);
    /// The device's part of a snapshot (the vCPUs are stopped): what a restore must find
    /// again, and, while it serves its queues, their state as it has them. It finishes
    /// the request in hand and then holds still — nothing more reaches guest memory or
    /// the interrupt line — until [`VirtioDevice::resume`]. A device whose state cannot
    /// be saved says why.
    fn save(&mut self) -> Result<DeviceSave, SaveError>;
    /// Goes on serving after a [`VirtioDevice::save`] (a no-op when it was not serving).
    fn resume(&mut self) -> Result<(), SaveError> {
        Ok(())
    }
}

/// A device's part of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSave {
    pub device: SavedDevice,
    /// The queues as the device serves them (their next available and used indices), or
    /// `None` while it is not serving.
    pub serving: Option<Vec<QueueState>>,
}

/// What a restored device must be, by kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SavedDevice {
    /// A disk: the image a restore must be given again (see
    /// [`block::DiskImage::check_saved`]).
    Block(block::SavedDisk),
}

/// Why a saved device cannot be restored onto the device given.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the snapshot has {saved} virtio device(s), the machine {given}")]
    DeviceCount { saved: usize, given: usize },
    #[error("virtio device {index} was of type {saved} in the snapshot, it is of type {found} now")]
    DeviceType { index: usize, saved: u32, found: u32 },
    #[error("virtio device {index} had {saved} queue(s) in the snapshot, it has {found} now")]
    QueueCount { index: usize, saved: usize, found: usize },
    #[error("virtio device {index}'s queue {queue} cannot be restored: {source}")]
    Queue {
        index: usize,
        queue: usize,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("virtio device {index}'s queue {queue} has rings outside guest RAM")]
    RingsOutsideMemory { index: usize, queue: usize },
    #[error("virtio device {index} cannot start serving again: {source}")]
    Activate {
        index: usize,
        #[source]
        source: ActivateError,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(
        "a virtio-fs device cannot be saved: its virtiofsd holds the guest's open files and \
         the state of its FUSE session, which cannot be saved with the guest"
    )]
    SharedDirectory,
    #[error("the disk image was lost with a worker thread that panicked")]
    ImageLost,
    #[error("cannot read disk image {path} for its content check: {source}")]
    ReadImage {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot restart the disk's worker thread after saving it: {0}")]
    Restart(#[source] ActivateError),
}

/// What a device gets when the driver sets DRIVER_OK.
pub struct Activation {
    pub mem: GuestMemoryMmap,
    pub queues: Vec<Queue>,
    pub notify: Vec<EventFd>,
    pub interrupt: Arc<Interrupt>,
    pub acked_features: u64,
    /// What the device's threads run under: a panic ends the run with the reason.
    pub panics: PanicStop,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("cannot start the device's worker thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot duplicate an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("the device has {got} queues ready, it needs {want}")]
    QueueCount { got: usize, want: usize },
    #[error("the disk image was lost with a worker thread that panicked")]
    ImageLost,
    #[error("the vhost-user backend failed {step}: {source}")]
    VhostUser {
        step: &'static str,
        #[source]
        source: vhost::Error,
    },
    #[error("queue {queue}'s rings are not in guest RAM")]
    RingOutsideMemory { queue: usize },
    #[error("queue {queue}: {source}")]
    Queue {
        queue: usize,
        #[source]
        source: virtio_queue::Error,
    },
}

/// A device's interrupt: the transport's InterruptStatus bits and the irqfd that raises
/// the line (edge-triggered; the driver reads the status and acknowledges it), and
/// whether the device, from one of its own threads, found itself broken.
pub struct Interrupt {
    status: AtomicU32,
    irqfd: EventFd,
    needs_reset: AtomicBool,
}

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Interrupt {
        Interrupt {
            status: AtomicU32::new(0),
            irqfd,
            needs_reset: AtomicBool::new(false),
        }
    }

    /// The device cannot go on until the driver resets it (its backend is gone, its queue
    /// is unreadable): the transport shows DEVICE_NEEDS_RESET and the driver gets a
    /// config interrupt.
    pub fn signal_needs_reset(&self) {
        self.needs_reset.store(true, Ordering::SeqCst);
        self.signal_config_change();
    }

    pub(crate) fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }

    /// The driver has new used buffers.
    pub fn signal_used_queue(&self) {
        self.raise(VIRTIO_MMIO_INT_VRING);
    }

    /// The device's config or status changed (it needs a reset, say).
    pub fn signal_config_change(&self) {
        self.raise(VIRTIO_MMIO_INT_CONFIG);
    }

    fn raise(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("virtio interrupt lost: {e}");
        }
    }

    pub(crate) fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    pub(crate) fn acknowledge(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Puts back a saved InterruptStatus and broken flag (a restore; the line's own state
    /// is the interrupt controller's, restored with it).
    pub(crate) fn restore(&self, status: u32, needs_reset: bool) {
        self.status.store(status, Ordering::SeqCst);
        self.needs_reset.store(needs_reset, Ordering::SeqCst);
    }

    pub(crate) fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
        self.needs_reset.store(false, Ordering::SeqCst);
    }
}

/// Reads `data.len()` bytes at `offset` of a device's config space `config`; bytes past
/// its end read as 0 (the driver chooses the offset and the width).
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|at| config.get(usize::try_from(at).ok()?))
            .copied()
            .unwrap_or(0);
    }
}

/// Where device `index` lives: its register window and interrupt line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSlot {
    pub base: u64,
    pub irq: u32,
}

impl DeviceSlot {
    pub fn of(index: usize) -> Option<DeviceSlot> {
        let irq = *DEVICE_IRQS.get(index)?;
        Some(DeviceSlot {
            base: VIRTIO_MMIO_START + index as u64 * VIRTIO_MMIO_WINDOW,
            irq,
        })
    }

    /// The guest kernel's announcement of the device (`virtio_mmio.device=`).
    pub fn cmdline_option(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            VIRTIO_MMIO_WINDOW >> 10,
            self.base,
            self.irq
        )
    }
}

/// The machine's virtio devices, by register window: what the vCPU threads call on an
/// MMIO exit that is not RAM.
#[derive(Default)]
pub struct MmioDevices {
    devices: Vec<(DeviceSlot, Mutex<mmio::MmioTransport>)>,
}

impl MmioDevices {
    /// Attaches `devices` in order to the windows and lines of [`DeviceSlot::of`]: irqfds
    /// on the lines, an ioeventfd per queue on the notify register (the kick then wakes
    /// the device without a userspace exit). They see `mem` without its out-of-line area.
    /// Their threads run under `panics`.
    pub fn attach(
        vm_fd: &VmFd,
        mem: &GuestMemoryMmap,
        devices: Vec<Box<dyn VirtioDevice>>,
        panics: &PanicStop,
    ) -> Result<MmioDevices, Error> {
        if devices.len() > MAX_DEVICES {
            return Err(Error::TooManyDevices {
                count: devices.len(),
                max: MAX_DEVICES,
            });
        }
        let ram = device_memory(mem)?;
        let mut attached = Vec::new();
        for (index, device) in devices.into_iter().enumerate() {
            let slot = DeviceSlot::of(index).expect("counted above");
            let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
            vm_fd
                .register_irqfd(&irqfd, slot.irq)
                .map_err(crate::error::kvm_err("KVM_IRQFD"))?;
            let queues = device.queue_max_sizes().len();
            let mut notify = Vec::new();
            for queue in 0..queues {
                let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
                let addr = IoEventAddress::Mmio(slot.base + u64::from(VIRTIO_MMIO_QUEUE_NOTIFY));
                vm_fd
                    .register_ioevent(&evt, &addr, queue as u32)
                    .map_err(crate::error::kvm_err("KVM_IOEVENTFD"))?;
                notify.push(evt);
            }
            let transport = mmio::MmioTransport::new(
                device,
                ram.clone(),
                Arc::new(Interrupt::new(irqfd)),
                notify,
                panics.clone(),
            )
            .map_err(Error::VirtioQueue)?;
            attached.push((slot, Mutex::new(transport)));
        }
        Ok(MmioDevices { devices: attached })
    }

    /// The devices' windows and lines, in order.
    pub fn slots(&self) -> Vec<DeviceSlot> {
        self.devices.iter().map(|(slot, _)| *slot).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Every device's transport and device state, in order (the vCPUs are stopped); the
    /// devices hold still until [`MmioDevices::resume`], which the caller calls whatever
    /// this returns.
    pub fn save(&self) -> Result<Vec<mmio::TransportSave>, SaveError> {
        self.devices
            .iter()
            .map(|(_, t)| t.lock().unwrap_or_else(|e| e.into_inner()).save())
            .collect()
    }

    /// The devices go on after [`MmioDevices::save`]; the first failure is returned, every
    /// device is tried.
    pub fn resume(&self) -> Result<(), SaveError> {
        let mut first = Ok(());
        for (_, t) in &self.devices {
            let resumed = t.lock().unwrap_or_else(|e| e.into_inner()).resume();
            if first.is_ok() {
                first = resumed;
            }
        }
        first
    }

    /// Puts `saved` (from [`MmioDevices::save`]) back onto these devices, which must be
    /// the same kinds in the same order; devices that were serving serve again.
    pub fn restore(&self, saved: &[mmio::TransportSave]) -> Result<(), RestoreError> {
        if saved.len() != self.devices.len() {
            return Err(RestoreError::DeviceCount {
                saved: saved.len(),
                given: self.devices.len(),
            });
        }
        for (index, ((_, transport), saved)) in self.devices.iter().zip(saved).enumerate() {
            transport
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .restore(index, saved)?;
        }
        Ok(())
    }

    /// The guest kernel's announcements of the devices, space-separated.
    pub fn cmdline(&self) -> String {
        let options: Vec<String> = self.devices.iter().map(|(slot, _)| slot.cmdline_option()).collect();
        options.join(" ")
    }

    fn find(&self, addr: u64) -> Option<(u64, &Mutex<mmio::MmioTransport>)> {
        self.devices.iter().find_map(|(slot, transport)| {
            let offset = addr.checked_sub(slot.base)?;
            (offset < VIRTIO_MMIO_WINDOW).then_some((offset, transport))
        })
    }

    /// A guest read at `addr`; false when no device is there.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((offset, transport)) => {
                transport.lock().unwrap_or_else(|e| e.into_inner()).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// A guest write at `addr`; false when no device is there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((offset, transport)) => {
                transport.lock().unwrap_or_else(|e| e.into_inner()).write(offset, data);
                true
            }
            None => false,
        }
    }
}

impl Drop for MmioDevices {
    fn drop(&mut self) {
        for (_, transport) in &self.devices {
            transport.lock().unwrap_or_else(|e| e.into_inner()).shut_down();
        }
    }
}

/// Serves every request available in `queue` with `handle`, which answers one chain and
/// returns the bytes it wrote into the chain's buffers (with notifications off meanwhile,
/// and until none comes in as they are turned back on); says whether it used any.
///
/// Returns early, the rest left available, once `stop` is set: a driver that keeps
/// submitting (another vCPU) would otherwise keep the server here for ever, and a device
/// reset or a pause that waits for the server with it. What is left is served when the
/// server next runs (the queue's state says where it stopped).
pub fn serve_available<M: GuestMemory>(
    mem: &M,
    queue: &mut Queue,
    stop: &AtomicBool,
    mut handle: impl FnMut(DescriptorChain<&M>) -> u32,
) -> Result<bool, virtio_queue::Error> {
    let mut used_any = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(used_any);
        }
        queue.disable_notification(mem)?;
        // Pop exactly what the available index announces. pop_descriptor_chain() returns
        // None quietly on a ring it cannot read (an index more than a ring ahead, a ring
        // at 0, an entry outside RAM), while enable_notification() keeps saying there is
        // more: a host thread spinning for the guest. Either is the queue broken.
        loop {
            let pending = queue.avail_idx(mem, Ordering::Acquire)? - Wrapping(queue.next_avail());
            if pending.0 > queue.size() {
                return Err(virtio_queue::Error::InvalidAvailRingIndex);
            }
            if pending.0 == 0 {
                break;
            }
            if stop.load(Ordering::Acquire) {
                return Ok(used_any);
            }
            let chain = queue
                .pop_descriptor_chain(mem)
                .ok_or(virtio_queue::Error::QueueNotReady)?;
            let head = chain.head_index();
            let written = handle(chain);
            queue.add_used(mem, head, written)?;
            used_any = true;
        }
        if !queue.enable_notification(mem)? {
            return Ok(used_any);
        }
    }
}

/// How a device's thread is asked to stop: a flag it checks between requests (see
/// [`serve_available`]) and an eventfd that wakes it from its epoll. One clone is the
/// thread's, one its device's.
#[derive(Clone)]
pub(crate) struct StopSignal {
    requested: Arc<AtomicBool>,
    wake: Arc<EventFd>,
}

impl StopSignal {
    pub(crate) fn new() -> std::io::Result<StopSignal> {
        Ok(StopSignal {
            requested: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
        })
    }

    /// The flag first: a thread the eventfd wakes, or one between two requests, finds it.
    pub(crate) fn request(&self) {
        self.requested.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// What [`serve_available`] checks between requests.
    pub(crate) fn requested(&self) -> &AtomicBool {
        &self.requested
    }

    /// What the thread's epoll waits on.
    pub(crate) fn wake_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&*self.wake)
    }
}

/// `mem` without the out-of-line area: what devices may read and write.
pub fn device_memory(mem: &GuestMemoryMmap) -> Result<GuestMemoryMmap, Error> {
    match mem.remove_region(GuestAddress(OOL_AREA_START.0), OOL_AREA_SIZE) {
        Ok((ram, _)) => Ok(ram),
        // A machine without the area (none is built that way, but a device needs no more).
        Err(_) => Ok(mem.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver that gets its next request in before the device looks, every time (as
    /// another vCPU can): once `stop` is set, the server returns at the next request
    /// instead of serving for as long as the guest keeps submitting.
    #[test]
    fn serving_stops_between_requests_once_asked_whatever_the_driver_submits() {
        use vm_memory::Bytes;
        const SIZE: u16 = 16;
        let (desc, avail, used) = (GuestAddress(0), GuestAddress(0x1000), GuestAddress(0x2000));
        let avail_idx = GuestAddress(0x1002);
        let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        // Descriptor 0: 16 device-readable bytes at 0x8000; the ring's first entry, index 1.
        mem.write_obj(0x8000u64, desc).unwrap();
        mem.write_obj(16u32, GuestAddress(8)).unwrap();
        mem.write_obj(1u16, avail_idx).unwrap();
        let mut queue = test_support::driver_queue(SIZE, SIZE, desc.0 as u32, avail.0 as u32, used.0 as u32);
        assert!(queue.is_valid(&mem));
        let stop = AtomicBool::new(false);
        let mut served = 0u32;
        serve_available(&mem, &mut queue, &stop, |_chain| {
            served += 1;
            if served == 100 {
                stop.store(true, Ordering::Release);
            }
            // Bounded only so that the test ends without the fix.
            if served < 10_000 {
                let next: u16 = mem.read_obj(avail_idx).unwrap();
                mem.write_obj(0u16, GuestAddress(0x1004 + 2 * u64::from(next % SIZE)))
                    .unwrap();
                mem.write_obj(next.wrapping_add(1), avail_idx).unwrap();
            }
            0
        })
        .unwrap();
        assert_eq!(served, 100, "requests served after the stop");
    }

    #[test]
    fn slots_are_consecutive_windows_with_their_own_lines() {
        let first = DeviceSlot::of(0).unwrap();
        assert_eq!(first.base, VIRTIO_MMIO_START);
        assert_eq!(
            first.cmdline_option(),
            format!("virtio_mmio.device=4K@{VIRTIO_MMIO_START:#x}:5")
        );
        let second = DeviceSlot::of(1).unwrap();
        assert_eq!(second.base, VIRTIO_MMIO_START + 0x1000);
        assert_eq!(second.irq, 6);
        assert!(DeviceSlot::of(MAX_DEVICES).is_none());
        // No line is the console's, none is outside what the MP table routes.
        assert!(DEVICE_IRQS
            .iter()
            .all(|&irq| irq != crate::devices::SERIAL_IRQ && irq < 16));
    }

    #[test]
    fn devices_do_not_see_the_out_of_line_area() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&crate::vm::memory_ranges(64 << 20)).unwrap();
        let ram = device_memory(&mem).unwrap();
        use vm_memory::GuestMemoryBackend;
        assert!(ram.address_in_range(GuestAddress(0x1000)));
        assert!(!ram.address_in_range(GuestAddress(OOL_AREA_START.0)));
        assert!(mem.address_in_range(GuestAddress(OOL_AREA_START.0)));
    }
}
