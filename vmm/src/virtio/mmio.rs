//! The virtio-mmio register window of one device (virtio 1.2, 4.2.2; version 2, no legacy
//! registers): feature negotiation, queue set-up and the device status state machine.
//!
//! The driver may write anything in any order; what the spec does not allow is ignored
//! (and logged once at debug level), never a panic: a status that skips a step is not
//! taken, features the device did not offer fail FEATURES_OK, queues that are not valid
//! at DRIVER_OK (sizes, alignment, rings outside RAM) set DEVICE_NEEDS_RESET.

use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::vcpu::PanicStop;

use super::{Activation, DeviceSave, Interrupt, RestoreError, SaveError, VirtioDevice};

/// "virt", little-endian.
const MAGIC: u32 = 0x7472_6976;
/// The modern (virtio 1.x) register layout.
const MMIO_VERSION: u32 = 2;
/// Reported as the vendor ID: "hvpr".
const VENDOR_ID: u32 = 0x7270_7668;

/// A transport and its device as a snapshot saves them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportSave {
    pub device_type: u32,
    pub status: u32,
    pub driver_features: u64,
    pub queue_select: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub interrupt_status: u32,
    pub needs_reset: bool,
    /// The queues as the driver set them up (the transport's copies).
    pub queues: Vec<QueueState>,
    pub device: DeviceSave,
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    /// Handed to the device at each activation, for its threads.
    panics: PanicStop,
    notify: Vec<EventFd>,
    queues: Vec<Queue>,
    /// Per queue: the driver wrote a size or ring address virtio-queue refused (not a
    /// power of two, misaligned); the queue then may not start.
    queue_refused: Vec<bool>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    active: bool,
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        notify: Vec<EventFd>,
        panics: PanicStop,
    ) -> Result<MmioTransport, virtio_queue::Error> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            notify,
            panics,
            queue_refused: vec![false; queues.len()],
            queues,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            active: false,
        })
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// A guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device.read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        // Registers are 32 bits wide and read whole (4.2.2.2: the driver MUST use 32-bit
        // accesses); anything else reads as all-ones, as an absent register would.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0xff);
            return;
        }
        let value = match offset as u32 {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_select {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            // A device thread cannot take the transport's lock: it says so through the
            // interrupt, and the status shows it from then on.
            VIRTIO_MMIO_STATUS if self.interrupt.needs_reset() => self.status | VIRTIO_CONFIG_S_NEEDS_RESET,
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => 0,
            // No device has a shared memory region; "none" is a length (and base) of -1
            // (4.2.2), never 0, which Linux would take for a region at 0.
            VIRTIO_MMIO_SHM_LEN_LOW
            | VIRTIO_MMIO_SHM_LEN_HIGH
            | VIRTIO_MMIO_SHM_BASE_LOW
            | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// A guest write of `data` at `offset` in the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            // No device here has a writable config field.
            tracing::debug!("virtio-mmio: config write at {offset:#x} ignored");
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::debug!("virtio-mmio: {}-byte register write at {offset:#x} ignored", data.len());
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        let value = u32::from_le_bytes(bytes);
        // Queue and feature set-up is only taken before DRIVER_OK (4.2.3.2 and 3.1.1).
        let setting_up = self.status & (VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_FAILED) == 0;
        let negotiating = setting_up && self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0;
        match offset as u32 {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_select = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_select = value,
            VIRTIO_MMIO_DRIVER_FEATURES if negotiating => match self.driver_features_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value),
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32),
                _ => {}
            },
            VIRTIO_MMIO_QUEUE_SEL => self.queue_select = value,
            VIRTIO_MMIO_QUEUE_NUM if setting_up => self.set_up_queue(|q| {
                q.set_size(value as u16);
                q.size() == value as u16 && u32::from(q.size()) == value
            }),
            VIRTIO_MMIO_QUEUE_READY if setting_up => self.set_up_queue(|q| {
                q.set_ready(value == 1);
                true
            }),
            VIRTIO_MMIO_QUEUE_DESC_LOW if setting_up => self.set_up_queue(|q| {
                let want = with_low(q.desc_table(), value);
                q.set_desc_table_address(Some(value), None);
                q.desc_table() == want
            }),
            VIRTIO_MMIO_QUEUE_DESC_HIGH if setting_up => self.set_up_queue(|q| {
                let want = with_high(q.desc_table(), value);
                q.set_desc_table_address(None, Some(value));
                q.desc_table() == want
            }),
            VIRTIO_MMIO_QUEUE_AVAIL_LOW if setting_up => self.set_up_queue(|q| {
                let want = with_low(q.avail_ring(), value);
                q.set_avail_ring_address(Some(value), None);
                q.avail_ring() == want
            }),
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH if setting_up => self.set_up_queue(|q| {
                let want = with_high(q.avail_ring(), value);
                q.set_avail_ring_address(None, Some(value));
                q.avail_ring() == want
            }),
            VIRTIO_MMIO_QUEUE_USED_LOW if setting_up => self.set_up_queue(|q| {
                let want = with_low(q.used_ring(), value);
                q.set_used_ring_address(Some(value), None);
                q.used_ring() == want
            }),
            VIRTIO_MMIO_QUEUE_USED_HIGH if setting_up => self.set_up_queue(|q| {
                let want = with_high(q.used_ring(), value);
                q.set_used_ring_address(None, Some(value));
                q.used_ring() == want
            }),
            // Reached only when KVM did not take the write through the ioeventfd.
            VIRTIO_MMIO_QUEUE_NOTIFY => {
                if let Some(evt) = self.notify.get(value as usize) {
                    let _ = evt.write(1);
                }
            }
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.acknowledge(value),
            VIRTIO_MMIO_STATUS => self.set_status(value),
            other => tracing::debug!("virtio-mmio: write {value:#x} to register {other:#x} ignored"),
        }
    }

    /// Applies a set-up write to the selected queue; `set` says whether virtio-queue
    /// took the value (it keeps the old one, and logs, when it does not).
    fn set_up_queue(&mut self, set: impl FnOnce(&mut Queue) -> bool) {
        let index = self.queue_select as usize;
        if let Some(q) = self.queues.get_mut(index) {
            if !set(q) {
                self.queue_refused[index] = true;
            }
        }
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        if value & VIRTIO_CONFIG_S_FAILED != 0 {
            self.status |= VIRTIO_CONFIG_S_FAILED;
            return;
        }
        // Each write keeps the bits already set and adds the next one (3.1.1).
        let added = value & !self.status;
        if value & self.status != self.status || added.count_ones() != 1 {
            tracing::debug!("virtio-mmio: status {value:#x} after {:#x} ignored", self.status);
            return;
        }
        let before = self.status;
        let step_ok = match added {
            VIRTIO_CONFIG_S_ACKNOWLEDGE => before == 0,
            VIRTIO_CONFIG_S_DRIVER => before == VIRTIO_CONFIG_S_ACKNOWLEDGE,
            VIRTIO_CONFIG_S_FEATURES_OK => before == VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
            VIRTIO_CONFIG_S_DRIVER_OK => {
                before == VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK
            }
            _ => false,
        };
        if !step_ok {
            tracing::debug!("virtio-mmio: status {value:#x} after {before:#x} is out of order, ignored");
            return;
        }
        match added {
            // The driver reads FEATURES_OK back: it stays clear when the driver took
            // features the device does not offer, or not VERSION_1 (no legacy devices).
            VIRTIO_CONFIG_S_FEATURES_OK => {
                let offered = self.device.features();
                if self.driver_features & !offered != 0 || self.driver_features & (1 << VIRTIO_F_VERSION_1) == 0 {
                    return;
                }
            }
            VIRTIO_CONFIG_S_DRIVER_OK => {
                self.status = value;
                self.activate();
                return;
            }
            _ => {}
        }
        self.status = value;
    }

    fn activate(&mut self) {
        let event_idx = self.driver_features & (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::new();
        for (index, q) in self.queues.iter_mut().enumerate() {
            if self.queue_refused[index] || !q.is_valid(&self.mem) {
                crate::warn_limited!(
                    "virtio-mmio: the driver set up queue {index} invalidly; the device needs a reset"
                );
                self.needs_reset();
                return;
            }
            q.set_event_idx(event_idx);
            // The device gets its own copy; the transport keeps the set-up for a reset.
            match Queue::try_from(q.state()) {
                Ok(copy) => queues.push(copy),
                Err(e) => {
                    crate::warn_limited!("virtio-mmio: queue {index}: {e}; the device needs a reset");
                    self.needs_reset();
                    return;
                }
            }
        }
        let notify = match self
            .notify
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(n) => n,
            Err(e) => {
                crate::warn_limited!("virtio-mmio: cannot activate the device: {e}");
                self.needs_reset();
                return;
            }
        };
        let activation = Activation {
            mem: self.mem.clone(),
            queues,
            notify,
            interrupt: Arc::clone(&self.interrupt),
            acked_features: self.driver_features,
            panics: self.panics.clone(),
        };
        match self.device.activate(activation) {
            Ok(()) => self.active = true,
            Err(e) => {
                crate::warn_limited!("virtio-mmio: cannot activate the device: {e}");
                self.needs_reset();
            }
        }
    }

    fn needs_reset(&mut self) {
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        self.interrupt.signal_config_change();
    }

    fn reset(&mut self) {
        if self.active {
            self.device.reset();
            self.active = false;
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.queue_refused.fill(false);
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.interrupt.clear();
        // A kick the old queues left pending must not wake the next activation.
        for evt in &self.notify {
            let _ = evt.read();
        }
    }

    /// The register state, the queues' set-up and the device's own state (the vCPUs are
    /// stopped, so no register access comes in meanwhile).
    pub fn save(&mut self) -> Result<TransportSave, SaveError> {
        // The device first: its last completion's interrupt is in the status read below.
        let device = self.device.save()?;
        Ok(TransportSave {
            device_type: self.device.device_type(),
            status: self.status,
            driver_features: self.driver_features,
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            interrupt_status: self.interrupt.status(),
            needs_reset: self.interrupt.needs_reset(),
            queues: self.queues.iter().map(|q| q.state()).collect(),
            device,
        })
    }

    /// The device goes on after [`MmioTransport::save`].
    pub fn resume(&mut self) -> Result<(), SaveError> {
        self.device.resume()
    }

    /// Puts a saved state back (a fresh transport of the same device, before any vCPU
    /// runs); a device that was serving its queues serves them again from where it was.
    /// Everything in `saved` comes from a file: queues are rebuilt through virtio-queue's
    /// checks, and a device of another kind or shape is refused.
    pub fn restore(&mut self, index: usize, saved: &TransportSave) -> Result<(), RestoreError> {
        let found = self.device.device_type();
        if saved.device_type != found {
            return Err(RestoreError::DeviceType {
                index,
                saved: saved.device_type,
                found,
            });
        }
        let rebuild = |states: &[QueueState]| -> Result<Vec<Queue>, RestoreError> {
            let max_sizes = self.device.queue_max_sizes();
            if states.len() != max_sizes.len() {
                return Err(RestoreError::QueueCount {
                    index,
                    saved: states.len(),
                    found: max_sizes.len(),
                });
            }
            states
                .iter()
                .zip(max_sizes)
                .enumerate()
                .map(|(queue, (state, &max))| {
                    // The device's maximum is this build's, not the file's.
                    Queue::try_from(QueueState {
                        max_size: max,
                        ..*state
                    })
                    .map_err(|source| RestoreError::Queue { index, queue, source })
                })
                .collect()
        };
        let queues = rebuild(&saved.queues)?;
        let serving = saved.device.serving.as_deref().map(rebuild).transpose()?;
        // A device serves only queues whose rings are guest RAM, as at activation.
        if let Some(queue) = serving.iter().flatten().position(|q| !q.is_valid(&self.mem)) {
            return Err(RestoreError::RingsOutsideMemory { index, queue });
        }
        self.queues = queues;
        self.queue_refused = vec![false; self.queues.len()];
        self.status = saved.status;
        self.driver_features = saved.driver_features;
        self.queue_select = saved.queue_select;
        self.device_features_select = saved.device_features_select;
        self.driver_features_select = saved.driver_features_select;
        self.interrupt.restore(saved.interrupt_status, saved.needs_reset);
        if let Some(queues) = serving {
            let notify = self
                .notify
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| RestoreError::Activate {
                    index,
                    source: super::ActivateError::EventFd(e),
                })?;
            self.device
                .activate(Activation {
                    mem: self.mem.clone(),
                    queues,
                    notify,
                    interrupt: Arc::clone(&self.interrupt),
                    acked_features: self.driver_features,
                    panics: self.panics.clone(),
                })
                .map_err(|source| RestoreError::Activate { index, source })?;
            self.active = true;
        }
        Ok(())
    }

    /// Stops the device for good (the machine is going away).
    pub fn shut_down(&mut self) {
        if self.active {
            self.device.reset();
            self.active = false;
        }
    }
}

fn with_low(address: u64, low: u32) -> u64 {
    (address & !0xffff_ffff) | u64::from(low)
}

fn with_high(address: u64, high: u32) -> u64 {
    (address & 0xffff_ffff) | (u64::from(high) << 32)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use vm_memory::GuestAddress;

    use super::super::ActivateError;
    use super::*;

    const FEATURES: u64 = (1 << VIRTIO_F_VERSION_1) | 1 << 5;

    /// A device that records what the transport does to it.
    #[derive(Default)]
    struct Recorder {
        log: Arc<Mutex<Vec<String>>>,
        /// Its queues while it serves them.
        serving: Option<Vec<QueueState>>,
    }

    fn saved_disk() -> crate::virtio::SavedDevice {
        crate::virtio::SavedDevice::Block(crate::virtio::block::SavedDisk {
            path: "/img".into(),
            size: 1 << 20,
            read_only: false,
            partition_table: [7; 32],
        })
    }

    impl VirtioDevice for Recorder {
        fn device_type(&self) -> u32 {
            2
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn features(&self) -> u64 {
            FEATURES
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = offset as u8 + i as u8;
            }
        }
        fn activate(&mut self, a: Activation) -> Result<(), ActivateError> {
            self.log.lock().unwrap().push(format!(
                "activate {} queues, features {:#x}, queue size {}, next avail {}",
                a.queues.len(),
                a.acked_features,
                a.queues[0].size(),
                a.queues[0].next_avail()
            ));
            self.serving = Some(a.queues.iter().map(|q| q.state()).collect());
            Ok(())
        }
        fn reset(&mut self) {
            self.serving = None;
            self.log.lock().unwrap().push("reset".into());
        }
        fn save(&mut self) -> Result<DeviceSave, SaveError> {
            Ok(DeviceSave {
                device: saved_disk(),
                serving: self.serving.clone(),
            })
        }
    }

    fn transport() -> (MmioTransport, Arc<Mutex<Vec<String>>>) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let recorder = Recorder::default();
        let log = Arc::clone(&recorder.log);
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        let notify = vec![EventFd::new(libc::EFD_NONBLOCK).unwrap()];
        (
            MmioTransport::new(
                Box::new(recorder),
                mem,
                interrupt,
                notify,
                PanicStop::new(crate::vcpu::VcpuControl::new(1).unwrap()),
            )
            .unwrap(),
            log,
        )
    }

    fn read(t: &mut MmioTransport, reg: u32) -> u32 {
        let mut data = [0u8; 4];
        t.read(u64::from(reg), &mut data);
        u32::from_le_bytes(data)
    }

    fn write(t: &mut MmioTransport, reg: u32, value: u32) {
        t.write(u64::from(reg), &value.to_le_bytes());
    }

    /// What Linux's virtio_mmio driver does, up to FEATURES_OK.
    fn negotiate(t: &mut MmioTransport, features: u64) {
        write(t, VIRTIO_MMIO_STATUS, 0);
        write(t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        write(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        for sel in 0..2 {
            write(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
            write(t, VIRTIO_MMIO_DRIVER_FEATURES, (features >> (32 * sel)) as u32);
        }
        write(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
        );
    }

    fn set_up_queue(t: &mut MmioTransport, size: u32, desc: u32) {
        write(t, VIRTIO_MMIO_QUEUE_SEL, 0);
        write(t, VIRTIO_MMIO_QUEUE_NUM, size);
        write(t, VIRTIO_MMIO_QUEUE_DESC_LOW, desc);
        write(t, VIRTIO_MMIO_QUEUE_DESC_HIGH, 0);
        write(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, desc + 0x1000);
        write(t, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, 0);
        write(t, VIRTIO_MMIO_QUEUE_USED_LOW, desc + 0x2000);
        write(t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
        write(t, VIRTIO_MMIO_QUEUE_READY, 1);
    }

    const ALL_OK: u32 =
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK;

    #[test]
    fn identifies_itself_as_a_modern_virtio_mmio_device() {
        let (mut t, _) = transport();
        assert_eq!(read(&mut t, VIRTIO_MMIO_MAGIC_VALUE), MAGIC);
        assert_eq!(read(&mut t, VIRTIO_MMIO_VERSION), 2);
        assert_eq!(read(&mut t, VIRTIO_MMIO_DEVICE_ID), 2);
        write(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(read(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1);
        write(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        assert_eq!(read(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1 << 5);
        assert_eq!(read(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 16);
        let mut config = [0u8; 3];
        t.read(0x102, &mut config);
        assert_eq!(config, [2, 3, 4]);
    }

    /// No device has a shared memory region: a driver that selects one reads a length
    /// (and base) of all-ones, which is how Linux's virtio_mmio tells "no region"; a 0
    /// there made a distribution kernel's virtiofs (built with FUSE_DAX) try to reserve a
    /// DAX window at 0 and fail its probe with EBUSY.
    #[test]
    fn every_shared_memory_region_reads_as_absent() {
        let (mut t, _) = transport();
        for id in [0u32, 1, 0xff] {
            write(&mut t, VIRTIO_MMIO_SHM_SEL, id);
            for reg in [
                VIRTIO_MMIO_SHM_LEN_LOW,
                VIRTIO_MMIO_SHM_LEN_HIGH,
                VIRTIO_MMIO_SHM_BASE_LOW,
                VIRTIO_MMIO_SHM_BASE_HIGH,
            ] {
                assert_eq!(read(&mut t, reg), u32::MAX, "region {id}, register {reg:#x}");
            }
        }
    }

    #[test]
    fn a_saved_transport_restores_its_registers_and_serves_from_where_its_device_was() {
        let (mut t, _) = transport();
        negotiate(&mut t, FEATURES);
        set_up_queue(&mut t, 8, 0x10000);
        write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        t.interrupt.signal_used_queue();
        let mut saved = t.save().unwrap();
        // The device had served 5 requests when it was saved.
        saved.device.serving.as_mut().unwrap()[0].next_avail = 5;
        saved.device.serving.as_mut().unwrap()[0].next_used = 5;

        let (mut restored, log) = transport();
        restored.restore(0, &saved).unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["activate 1 queues, features 0x100000020, queue size 8, next avail 5"]
        );
        assert_eq!(read(&mut restored, VIRTIO_MMIO_STATUS), ALL_OK);
        assert_eq!(read(&mut restored, VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        assert_eq!(read(&mut restored, VIRTIO_MMIO_QUEUE_READY), 1);
        assert_eq!(restored.save().unwrap(), {
            let mut again = saved.clone();
            again.device.serving.as_mut().unwrap()[0].event_idx_enabled = false;
            again
        });
        // The driver's reset reaches the restored device.
        write(&mut restored, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(log.lock().unwrap().last().unwrap(), "reset");
    }

    #[test]
    fn a_saved_state_that_does_not_fit_the_device_is_refused() {
        let (mut t, _) = transport();
        negotiate(&mut t, FEATURES);
        set_up_queue(&mut t, 8, 0x10000);
        write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        let saved = t.save().unwrap();
        let refused = |saved: &TransportSave| {
            let (mut fresh, log) = transport();
            let e = fresh.restore(3, saved).unwrap_err().to_string();
            assert!(log.lock().unwrap().is_empty(), "{e}: the device was activated");
            e
        };
        let mut other = saved.clone();
        other.device_type = 26;
        assert_eq!(
            refused(&other),
            "virtio device 3 was of type 26 in the snapshot, it is of type 2 now"
        );
        let mut more = saved.clone();
        more.queues.push(more.queues[0]);
        assert!(refused(&more).contains("had 2 queue(s) in the snapshot, it has 1 now"));
        let mut odd = saved.clone();
        odd.device.serving.as_mut().unwrap()[0].size = 7;
        assert!(refused(&odd).starts_with("virtio device 3's queue 0 cannot be restored"));
        let mut misaligned = saved.clone();
        misaligned.queues[0].desc_table = 0x10001;
        assert!(refused(&misaligned).starts_with("virtio device 3's queue 0 cannot be restored"));
        let mut outside = saved;
        outside.device.serving.as_mut().unwrap()[0].used_ring = 1 << 40;
        assert_eq!(
            refused(&outside),
            "virtio device 3's queue 0 has rings outside guest RAM"
        );
    }

    #[test]
    fn a_driver_that_follows_the_spec_activates_the_device() {
        let (mut t, log) = transport();
        negotiate(&mut t, FEATURES);
        set_up_queue(&mut t, 8, 0x10000);
        write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        assert_eq!(read(&mut t, VIRTIO_MMIO_STATUS), ALL_OK);
        assert_eq!(
            *log.lock().unwrap(),
            ["activate 1 queues, features 0x100000020, queue size 8, next avail 0"]
        );
        write(&mut t, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(read(&mut t, VIRTIO_MMIO_STATUS), 0);
        assert_eq!(log.lock().unwrap().last().unwrap(), "reset");
    }

    #[test]
    fn features_the_device_did_not_offer_or_a_legacy_driver_fail_features_ok() {
        for features in [FEATURES | 1 << 7, 1 << 5] {
            let (mut t, log) = transport();
            negotiate(&mut t, features);
            assert_eq!(
                read(&mut t, VIRTIO_MMIO_STATUS),
                VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER
            );
            write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
            assert!(log.lock().unwrap().is_empty(), "{features:#x}");
        }
    }

    #[test]
    fn status_steps_out_of_order_are_ignored() {
        let (mut t, log) = transport();
        write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        assert_eq!(read(&mut t, VIRTIO_MMIO_STATUS), 0);
        write(&mut t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_DRIVER);
        assert_eq!(read(&mut t, VIRTIO_MMIO_STATUS), 0);
        assert!(log.lock().unwrap().is_empty());
    }

    #[test]
    fn an_invalid_queue_at_driver_ok_asks_for_a_reset_instead_of_activating() {
        // Not a power of two; then a ring outside memory.
        for (size, desc) in [(7, 0x10000), (8, 0x4000_0000), (8, 0x10001)] {
            let (mut t, log) = transport();
            negotiate(&mut t, FEATURES);
            set_up_queue(&mut t, size, desc);
            write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
            assert_ne!(read(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
            assert_eq!(read(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
            assert!(log.lock().unwrap().is_empty());
            write(&mut t, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
            assert_eq!(read(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        }
    }

    #[test]
    fn queue_set_up_after_driver_ok_is_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, FEATURES);
        set_up_queue(&mut t, 8, 0x10000);
        write(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        write(&mut t, VIRTIO_MMIO_QUEUE_NUM, 4);
        write(&mut t, VIRTIO_MMIO_QUEUE_DESC_LOW, 0x5000_0000);
        assert_eq!(t.queues[0].size(), 8);
        assert_eq!(t.queues[0].desc_table(), 0x10000);
    }

    #[test]
    fn odd_accesses_neither_panic_nor_change_anything() {
        let (mut t, _) = transport();
        let mut one = [0u8; 1];
        t.read(0x70, &mut one);
        assert_eq!(one, [0xff]);
        t.write(0x70, &[1]);
        t.write(0x71, &[1, 0, 0, 0]);
        write(&mut t, VIRTIO_MMIO_QUEUE_SEL, 9);
        assert_eq!(read(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        write(&mut t, VIRTIO_MMIO_QUEUE_NUM, 8);
        write(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, u32::MAX);
        t.read(0xfff, &mut one);
        assert_eq!(read(&mut t, VIRTIO_MMIO_STATUS), 0);
    }
}
