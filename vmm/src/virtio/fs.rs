//! A virtio-fs device (virtio 1.2, 5.11) whose requests a vhost-user backend serves: the
//! real virtiofsd, reached through its socket with rust-vmm's `vhost` frontend. hvprobe
//! keeps the device's identity (config space: tag and one request queue), the transport
//! and the interrupts; virtiofsd reads the queues in guest RAM and does the file I/O.
//!
//! What the backend gets:
//! - guest RAM, as the memfd regions of [`crate::vm`] (SET_MEM_TABLE). The out-of-line
//!   area is no part of the device's memory, so virtiofsd can neither read nor write probe
//!   code, and a descriptor that points there fails in virtiofsd like any bad address;
//! - per queue, its size, ring addresses and start index, the ioeventfd KVM signals on the
//!   driver's notify write (the kick goes from the guest to virtiofsd with no exit to us),
//!   and a call eventfd.
//!
//! Interrupts: virtio-mmio's driver reads InterruptStatus on every interrupt and takes
//! the queues' used buffers only when the VRING bit is set (Linux's `vm_interrupt`), so
//! the backend's call eventfd cannot be the irqfd itself: a relay thread waits on the call
//! eventfds, sets the bit on the device's [`Interrupt`] and raises the line. It also
//! watches the socket: when the backend goes away the relay takes the queues over and
//! answers every request in them, those the backend left unanswered and every later one,
//! with EIO ([`orphan`]): the guest's operations on the share fail instead of waiting for
//! ever, and every later request to the backend fails at once on the closed socket.
//!
//! A backend that stops answering cannot hold a vCPU thread (activation and reset run on
//! one): every exchange with it has a deadline, past which its connection is closed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::VhostUserHeaderFlag;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_FS;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateError, Activation, Interrupt, StopSignal, VirtioDevice};

pub mod orphan;

/// The tag field of the config space: UTF-8, NUL-padded, not NUL-terminated when full.
pub const TAG_LEN: usize = 36;
/// Request queues the device has (virtiofsd serves one); with the high-priority queue,
/// two queues.
const REQUEST_QUEUES: u32 = 1;
const NUM_QUEUES: usize = 1 + REQUEST_QUEUES as usize;
/// Entries per queue (virtiofsd takes up to 32768; 1024 is what cloud-hypervisor offers).
const QUEUE_SIZE: u16 = 1024;
/// The longest a backend may take to take or answer one message.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// The feature bits the guest may have of those the backend offers: the device has no
/// feature of its own (no notification queue, no DAX window).
const GUEST_FEATURES: u64 =
    (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_INDIRECT_DESC) | (1 << VIRTIO_RING_F_EVENT_IDX);
/// The vhost-user protocol features used: acknowledged requests (a failure is seen where
/// it happens), the queue count, and a device reset the backend understands.
const PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::REPLY_ACK
    .union(VhostUserProtocolFeatures::MQ)
    .union(VhostUserProtocolFeatures::RESET_DEVICE);

/// A shared directory's device: its tag and the backend's socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsConfig {
    pub tag: String,
    pub socket: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("virtio-fs tag {tag:?}: a tag is 1 to {TAG_LEN} bytes")]
    TagLength { tag: String },
    #[error("virtio-fs {tag}: cannot connect to the vhost-user socket {socket}: {source}")]
    Connect {
        tag: String,
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("virtio-fs {tag}: the vhost-user backend failed {step}: {source}")]
    Backend {
        tag: String,
        step: &'static str,
        #[source]
        source: vhost::Error,
    },
    #[error("virtio-fs {tag}: the vhost-user backend does not offer {what}")]
    Lacks { tag: String, what: &'static str },
    #[error("virtio-fs {tag}: the vhost-user backend has {queues} queues; the device needs {NUM_QUEUES}")]
    TooFewQueues { tag: String, queues: u64 },
}

/// The config space (5.11.4): the tag, then the number of request queues.
pub fn config_space(tag: &str) -> Result<[u8; TAG_LEN + 4], FsError> {
    if tag.is_empty() || tag.len() > TAG_LEN {
        return Err(FsError::TagLength { tag: tag.to_owned() });
    }
    let mut config = [0u8; TAG_LEN + 4];
    config[..tag.len()].copy_from_slice(tag.as_bytes());
    config[TAG_LEN..].copy_from_slice(&REQUEST_QUEUES.to_le_bytes());
    Ok(config)
}

/// The device: the backend's connection, and the relay while the driver has it running.
pub struct Fs {
    tag: String,
    config: [u8; TAG_LEN + 4],
    link: Link,
    backend_features: u64,
    protocol: VhostUserProtocolFeatures,
    relay: Option<Relay>,
}

struct Relay {
    stop: StopSignal,
    thread: JoinHandle<Option<()>>,
}

/// The connection to the backend, each exchange on it bounded in time. vhost's frontend
/// retries a socket timeout for ever (EAGAIN is a retry to it), so a socket timeout
/// bounds nothing: a watchdog shuts the socket down when an exchange takes longer than
/// `timeout`, the exchange then fails on the closed socket, and so does every later one.
struct Link {
    frontend: Frontend,
    timeout: Duration,
    tag: String,
}

impl Link {
    fn call<T>(&mut self, exchange: impl FnOnce(&mut Frontend) -> vhost::Result<T>) -> vhost::Result<T> {
        let _watchdog = Watchdog::arm(&self.frontend, self.timeout, &self.tag).map_err(vhost::Error::IOError)?;
        exchange(&mut self.frontend)
    }
}

/// Shuts a socket down unless dropped within its time.
struct Watchdog {
    _disarm: std::sync::mpsc::Sender<()>,
}

impl Watchdog {
    fn arm(socket: &impl AsRawFd, timeout: Duration, tag: &str) -> std::io::Result<Watchdog> {
        // The watchdog's own descriptor of the socket: shutdown(2) acts on the socket, and
        // this one stays open (and the number ours) for as long as the thread may use it.
        // SAFETY: dup of a descriptor the caller keeps open; the result is checked.
        let fd = unsafe { libc::dup(socket.as_raw_fd()) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that only this OwnedFd owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (disarm, disarmed) = std::sync::mpsc::channel::<()>();
        let tag = tag.to_owned();
        std::thread::Builder::new()
            .name("vhost-user-watchdog".into())
            .spawn(move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = disarmed.recv_timeout(timeout) {
                    tracing::warn!(
                        "virtio-fs {tag}: the vhost-user backend did not answer within {timeout:?}; its connection is closed"
                    );
                    // SAFETY: shutdown(2) on the descriptor this thread owns; no memory
                    // is involved.
                    unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
                }
            })?;
        Ok(Watchdog { _disarm: disarm })
    }
}

/// Connects to a backend's socket at `path`. Its file appears when the backend binds it,
/// a moment before the backend listens on it: a connection refused then (a loaded host
/// stretches that moment) is tried again until `deadline` has passed.
pub fn connect_listening(path: &Path, deadline: Duration) -> std::io::Result<UnixStream> {
    let started = Instant::now();
    loop {
        match UnixStream::connect(path) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && started.elapsed() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            result => return result,
        }
    }
}

impl Fs {
    /// Connects to the backend listening on `config.socket` and makes the vhost-user
    /// handshake (SET_OWNER, features, protocol features, queue count): a backend that
    /// cannot serve the device is refused here, before the guest boots.
    pub fn connect(config: &FsConfig) -> Result<Fs, FsError> {
        Fs::connect_with_timeout(config, REPLY_TIMEOUT)
    }

    /// [`Fs::connect`] with `timeout` for each message to and from the backend.
    fn connect_with_timeout(config: &FsConfig, timeout: Duration) -> Result<Fs, FsError> {
        let tag = config.tag.clone();
        let config_bytes = config_space(&tag)?;
        let connect_err = |source| FsError::Connect {
            tag: tag.clone(),
            socket: config.socket.clone(),
            source,
        };
        let stream = connect_listening(&config.socket, timeout).map_err(connect_err)?;
        let mut link = Link {
            frontend: Frontend::from_stream(stream, NUM_QUEUES as u64),
            timeout,
            tag: tag.clone(),
        };
        let failed = |step| {
            let tag = tag.clone();
            move |source| FsError::Backend { tag, step, source }
        };
        link.call(|f| f.set_owner()).map_err(failed("SET_OWNER"))?;
        let backend_features = link.call(|f| f.get_features()).map_err(failed("GET_FEATURES"))?;
        if backend_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(FsError::Lacks {
                tag,
                what: "VIRTIO_F_VERSION_1",
            });
        }
        let mut protocol = VhostUserProtocolFeatures::empty();
        if backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let offered = link
                .call(|f| f.get_protocol_features())
                .map_err(failed("GET_PROTOCOL_FEATURES"))?;
            protocol = offered & PROTOCOL_FEATURES;
            link.call(|f| f.set_protocol_features(protocol))
                .map_err(failed("SET_PROTOCOL_FEATURES"))?;
            if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                link.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if protocol.contains(VhostUserProtocolFeatures::MQ) {
                let queues = link.call(|f| f.get_queue_num()).map_err(failed("GET_QUEUE_NUM"))?;
                if queues < NUM_QUEUES as u64 {
                    return Err(FsError::TooFewQueues { tag, queues });
                }
            }
        }
        tracing::info!(
            "virtio-fs {tag}: backend features {backend_features:#x}, protocol features {:#x}",
            protocol.bits()
        );
        Ok(Fs {
            tag,
            config: config_bytes,
            link,
            backend_features,
            protocol,
            relay: None,
        })
    }

    pub fn tag(&self) -> &str {
        &self.tag
    }

    fn protocol_features_acked(&self) -> bool {
        self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Hands the queues to the backend and starts the relay; on an error the caller
    /// resets what was set up.
    fn start(&mut self, activation: Activation, kit: OrphanKit) -> Result<(), ActivateError> {
        let Activation {
            mem,
            queues,
            notify,
            interrupt,
            acked_features,
            ..
        } = activation;
        if queues.len() != NUM_QUEUES || notify.len() != NUM_QUEUES {
            return Err(ActivateError::QueueCount {
                got: queues.len(),
                want: NUM_QUEUES,
            });
        }
        let failed = |step| move |source| ActivateError::VhostUser { step, source };
        let protocol_bit = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        self.link
            .call(|f| f.set_features((acked_features & GUEST_FEATURES) | protocol_bit))
            .map_err(failed("SET_FEATURES"))?;
        // Guest RAM only: `mem` is the device's memory, without the out-of-line area.
        let regions = mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<Result<Vec<_>, _>>()
            .map_err(failed("describing guest RAM (is it file-backed?)"))?;
        self.link
            .call(|f| f.set_mem_table(&regions))
            .map_err(failed("SET_MEM_TABLE"))?;
        let mut calls = Vec::new();
        for (index, (queue, kick)) in queues.iter().zip(&notify).enumerate() {
            let host = |gpa: u64| {
                mem.get_host_address(GuestAddress(gpa))
                    .map(|p| p as u64)
                    .map_err(|_| ActivateError::RingOutsideMemory { queue: index })
            };
            let rings = VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: queue.size(),
                flags: 0,
                desc_table_addr: host(queue.desc_table())?,
                used_ring_addr: host(queue.used_ring())?,
                avail_ring_addr: host(queue.avail_ring())?,
                log_addr: None,
            };
            self.link
                .call(|f| f.set_vring_num(index, queue.size()))
                .map_err(failed("SET_VRING_NUM"))?;
            self.link
                .call(|f| f.set_vring_base(index, queue.next_avail()))
                .map_err(failed("SET_VRING_BASE"))?;
            self.link
                .call(|f| f.set_vring_addr(index, &rings))
                .map_err(failed("SET_VRING_ADDR"))?;
            let call = EventFd::new(libc::EFD_NONBLOCK).map_err(ActivateError::EventFd)?;
            self.link
                .call(|f| f.set_vring_call(index, &call))
                .map_err(failed("SET_VRING_CALL"))?;
            calls.push(call);
            // The ioeventfd KVM signals: the driver's kick reaches virtiofsd directly.
            self.link
                .call(|f| f.set_vring_kick(index, kick))
                .map_err(failed("SET_VRING_KICK"))?;
        }
        if self.protocol_features_acked() {
            for index in 0..NUM_QUEUES {
                self.link
                    .call(|f| f.set_vring_enable(index, true))
                    .map_err(failed("SET_VRING_ENABLE"))?;
            }
        }
        // The relay's own descriptor of the socket, to watch for the backend going away.
        // SAFETY: dup of a descriptor the frontend keeps open; the result is checked.
        let socket = unsafe { libc::dup(self.link.frontend.as_raw_fd()) };
        if socket < 0 {
            return Err(ActivateError::EventFd(std::io::Error::last_os_error()));
        }
        // SAFETY: `socket` is a fresh descriptor that only this OwnedFd owns.
        let socket = unsafe { OwnedFd::from_raw_fd(socket) };
        self.spawn_relay(calls, Some(socket), interrupt, kit)
    }

    /// The relay, answering the queues with EIO from the start (no backend).
    fn start_orphaned(&mut self, kit: OrphanKit, interrupt: Arc<Interrupt>) -> Result<(), ActivateError> {
        self.spawn_relay(Vec::new(), None, interrupt, kit)
    }

    /// Starts the relay thread (see [`relay`]) and keeps what stops it.
    fn spawn_relay(
        &mut self,
        calls: Vec<EventFd>,
        socket: Option<OwnedFd>,
        interrupt: Arc<Interrupt>,
        kit: OrphanKit,
    ) -> Result<(), ActivateError> {
        let stop = StopSignal::new().map_err(ActivateError::EventFd)?;
        let stop_relay = stop.clone();
        let tag = self.tag.clone();
        let panics = kit.panics.clone();
        let thread = panics
            .spawn(&format!("virtio-fs-{}", self.tag), move || {
                relay(&tag, &calls, socket.as_ref(), &stop_relay, &interrupt, kit)
            })
            .map_err(ActivateError::Thread)?;
        self.relay = Some(Relay { stop, thread });
        Ok(())
    }

    /// Stops the rings (GET_VRING_BASE, as the vhost-user protocol says a reset does) and
    /// resets the backend's device state. A backend that is gone fails each step at once;
    /// that is logged, and the device is reset all the same.
    fn stop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.stop.request();
            if !matches!(relay.thread.join(), Ok(Some(()))) {
                tracing::error!("virtio-fs {}: the interrupt relay panicked", self.tag);
            }
        }
        let mut failures = Vec::new();
        for index in 0..NUM_QUEUES {
            if self.protocol_features_acked() {
                if let Err(e) = self.link.call(|f| f.set_vring_enable(index, false)) {
                    failures.push(format!("SET_VRING_ENABLE {index}: {e}"));
                }
            }
            if let Err(e) = self.link.call(|f| f.get_vring_base(index)) {
                failures.push(format!("GET_VRING_BASE {index}: {e}"));
            }
        }
        if self.protocol.contains(VhostUserProtocolFeatures::RESET_DEVICE) {
            if let Err(e) = self.link.call(|f| f.reset_device()) {
                failures.push(format!("RESET_DEVICE: {e}"));
            }
        }
        if !failures.is_empty() {
            tracing::debug!("virtio-fs {}: resetting the backend: {}", self.tag, failures.join("; "));
        }
    }
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; NUM_QUEUES]
    }

    fn features(&self) -> u64 {
        self.backend_features & GUEST_FEATURES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config, offset, data);
    }

    /// Hands the queues to the backend; when the backend fails that (it is gone, or
    /// refuses), the device answers the queues itself with EIO, as when it goes later:
    /// a device that asked for a reset would leave the guest's requests waiting for ever
    /// (Linux's virtio-fs does not reset a device).
    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        let interrupt = Arc::clone(&activation.interrupt);
        let kit = OrphanKit::of(&activation)?;
        let fallback = OrphanKit::of(&activation)?;
        match self.start(activation, kit) {
            Ok(()) => Ok(()),
            Err(e @ ActivateError::VhostUser { .. }) => {
                // Whatever was handed over is taken back, so the next activation starts clean.
                self.stop();
                crate::warn_limited!(
                    "virtio-fs {}: {e}; the guest's requests to it are answered with EIO",
                    self.tag
                );
                self.start_orphaned(fallback, interrupt)
            }
            Err(e) => {
                self.stop();
                Err(e)
            }
        }
    }

    fn reset(&mut self) {
        self.stop();
    }

    fn save(&mut self) -> Result<super::DeviceSave, super::SaveError> {
        Err(super::SaveError::SharedDirectory)
    }
}

const SOCKET: u64 = u64::MAX - 1;
const STOP: u64 = u64::MAX;
/// A queue's kick, once the relay answers the queues itself: `KICK | index`.
const KICK: u64 = 1 << 32;

/// What the relay takes over when the backend goes: guest RAM, the queues as the driver
/// set them up, and their kicks.
struct OrphanKit {
    mem: vm_memory::GuestMemoryMmap,
    queues: Vec<Queue>,
    kicks: Vec<EventFd>,
    /// What the relay runs under: it parses the guest's queues once orphaned.
    panics: crate::vcpu::PanicStop,
}

impl OrphanKit {
    /// Copies of what `activation` hands the device.
    fn of(activation: &Activation) -> Result<OrphanKit, ActivateError> {
        let kicks = activation
            .notify
            .iter()
            .map(|kick| kick.try_clone().map_err(ActivateError::EventFd))
            .collect::<Result<Vec<_>, _>>()?;
        let queues = activation
            .queues
            .iter()
            .enumerate()
            .map(|(queue, q)| Queue::try_from(q.state()).map_err(|source| ActivateError::Queue { queue, source }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(OrphanKit {
            mem: activation.mem.clone(),
            queues,
            kicks,
            panics: activation.panics.clone(),
        })
    }
}

/// Relays the backend's used-buffer notifications to the driver until `stop`; when the
/// backend's socket closes (or with no `socket`: a backend already gone at activation),
/// answers the queues' requests itself ([`orphan`]).
fn relay(
    tag: &str,
    calls: &[EventFd],
    socket: Option<&OwnedFd>,
    stop: &StopSignal,
    interrupt: &Interrupt,
    kit: OrphanKit,
) {
    let epoll = match Epoll::new() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("virtio-fs {tag}: epoll: {e}; the device needs a reset");
            interrupt.signal_needs_reset();
            return;
        }
    };
    let watch = |fd: i32, events: EventSet, data: u64| {
        epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, data))
            .map_err(|e| {
                tracing::error!("virtio-fs {tag}: epoll_ctl: {e}; the device needs a reset");
                interrupt.signal_needs_reset();
            })
    };
    let mut watched = vec![(stop.wake_fd(), EventSet::IN, STOP)];
    if let Some(socket) = socket {
        // Only the peer's hang-up: the socket's messages are the vCPU thread's to read.
        watched.push((socket.as_raw_fd(), EventSet::READ_HANG_UP, SOCKET));
    }
    for (index, call) in calls.iter().enumerate() {
        watched.push((call.as_raw_fd(), EventSet::IN, index as u64));
    }
    for (fd, events, data) in watched {
        if watch(fd, events, data).is_err() {
            return;
        }
    }
    let OrphanKit { mem, queues, kicks, .. } = kit;
    let mut kit = Some((mem, queues));
    let mut orphaned: Option<orphan::Orphaned> = None;
    // Takes the queues over: from now on the kicks are the relay's to serve, and what the
    // backend left unanswered is served at once (no kick may come for it).
    let mut take_over = |to_serve: &mut Vec<usize>, orphaned: &mut Option<orphan::Orphaned>| -> Result<(), ()> {
        let Some((mem, queues)) = kit.take() else { return Ok(()) };
        let taken = orphan::Orphaned::take_over(mem, queues);
        for (index, kick) in kicks.iter().enumerate() {
            watch(kick.as_raw_fd(), EventSet::IN, KICK | index as u64)?;
        }
        to_serve.extend(0..taken.queue_count());
        *orphaned = Some(taken);
        // The backend may have used a buffer and died before it signalled it: one
        // interrupt more, which costs the driver a look at the rings.
        interrupt.signal_used_queue();
        Ok(())
    };
    let mut to_serve = Vec::new();
    if socket.is_none() && take_over(&mut to_serve, &mut orphaned).is_err() {
        return;
    }
    let mut broken = vec![false; kicks.len()];
    let mut events = vec![EpollEvent::default(); calls.len() + kicks.len() + 2];
    loop {
        if let Some(queues) = orphaned.as_mut() {
            for index in to_serve.drain(..) {
                if broken.get(index).copied().unwrap_or(true) {
                    continue;
                }
                match queues.serve(index, stop.requested()) {
                    Ok(true) => interrupt.signal_used_queue(),
                    Ok(false) => {}
                    Err(e) => {
                        crate::warn_limited!(
                            "virtio-fs {tag}: the driver's queue {index} is broken ({e}); the device needs a reset"
                        );
                        broken[index] = true;
                        interrupt.signal_needs_reset();
                    }
                }
            }
        }
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("virtio-fs {tag}: epoll_wait: {e}; the device needs a reset");
                interrupt.signal_needs_reset();
                return;
            }
        };
        for event in &events[..n] {
            match event.data() {
                STOP => return,
                SOCKET => {
                    tracing::warn!(
                        "virtio-fs {tag}: the vhost-user backend closed its socket; the guest's requests to it are answered with EIO from now on"
                    );
                    if let Some(socket) = socket {
                        let _ = epoll.ctl(ControlOperation::Delete, socket.as_raw_fd(), EpollEvent::default());
                    }
                    if take_over(&mut to_serve, &mut orphaned).is_err() {
                        return;
                    }
                }
                data if data & KICK != 0 => {
                    let index = (data & !KICK) as usize;
                    if let Some(kick) = kicks.get(index) {
                        let _ = kick.read();
                        to_serve.push(index);
                    }
                }
                index => {
                    if let Some(call) = calls.get(index as usize) {
                        let _ = call.read();
                        interrupt.signal_used_queue();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
