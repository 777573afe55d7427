use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::*;

#[test]
fn the_config_space_is_the_padded_tag_and_one_request_queue() {
    let config = config_space("hvprobe-rw0").unwrap();
    assert_eq!(&config[..11], b"hvprobe-rw0");
    assert!(config[11..TAG_LEN].iter().all(|&b| b == 0));
    assert_eq!(config[TAG_LEN..], 1u32.to_le_bytes());
    // A tag of the whole field has no NUL.
    let full = "t".repeat(TAG_LEN);
    assert_eq!(&config_space(&full).unwrap()[..TAG_LEN], full.as_bytes());
    // As the driver reads it: any offset and width, nothing past the end.
    let mut num_request_queues = [0xffu8; 4];
    super::super::read_config_bytes(&config, TAG_LEN as u64, &mut num_request_queues);
    assert_eq!(u32::from_le_bytes(num_request_queues), 1);
    let mut past = [0xffu8; 4];
    super::super::read_config_bytes(&config, TAG_LEN as u64 + 2, &mut past);
    assert_eq!(past, [0; 4]);
    super::super::read_config_bytes(&config, u64::MAX, &mut past);
    assert_eq!(past, [0; 4]);
    for bad in [String::new(), "t".repeat(TAG_LEN + 1)] {
        assert!(matches!(config_space(&bad), Err(FsError::TagLength { .. })), "{bad:?}");
    }
}

// vhost-user requests (the protocol's numbers), as the fake backend logs them.
const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const GET_QUEUE_NUM: u32 = 17;
const SET_VRING_ENABLE: u32 = 18;
const RESET_DEVICE: u32 = 34;
const NEED_REPLY: u32 = 0x8;

/// What virtiofsd 1.14 offers.
const VIRTIOFSD_FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_RING_F_INDIRECT_DESC)
    | (1 << VIRTIO_RING_F_EVENT_IDX)
    | (1 << 30)
    | (1 << 26);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Serve,
    /// Closes the connection at this request (counted from 1), unanswered.
    HangUpAt(usize),
    /// Closes the connection once it has answered this many requests.
    HangUpAfter(usize),
    /// Takes requests and never answers.
    Silent,
    /// Offers no VIRTIO_F_VERSION_1.
    Legacy,
}

/// A vhost-user backend that speaks just enough of the protocol, logging each request
/// (and its payload's first word) and handing over the call eventfds it gets.
struct FakeBackend {
    socket: PathBuf,
    log: Arc<Mutex<Vec<(u32, u64)>>>,
    calls: Receiver<File>,
    _dir: tempfile::TempDir,
}

fn fake_backend(behaviour: Behaviour) -> FakeBackend {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fs.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (calls_tx, calls) = channel();
    let backend_log = Arc::clone(&log);
    std::thread::spawn(move || serve(&listener, behaviour, &backend_log, &calls_tx));
    FakeBackend {
        socket,
        log,
        calls,
        _dir: dir,
    }
}

fn serve(listener: &UnixListener, behaviour: Behaviour, log: &Mutex<Vec<(u32, u64)>>, calls: &Sender<File>) {
    let Ok((mut stream, _)) = listener.accept() else { return };
    let features = match behaviour {
        Behaviour::Legacy => VIRTIOFSD_FEATURES & !(1 << VIRTIO_F_VERSION_1),
        _ => VIRTIOFSD_FEATURES,
    };
    loop {
        let mut header = [0u8; 12];
        let Ok((n, file)) = stream.recv_with_fd(&mut header) else {
            return;
        };
        if n == 0 || (n < 12 && stream.read_exact(&mut header[n..]).is_err()) {
            return;
        }
        let word = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap());
        let (request, flags, size) = (word(0), word(4), word(8) as usize);
        let mut body = vec![0u8; size];
        if stream.read_exact(&mut body).is_err() {
            return;
        }
        // The payload's first word (a ring's index) and its first 8 bytes (a feature set).
        let first = body.get(..4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()));
        let first_u64 = body
            .get(..8)
            .map_or(u64::from(first), |b| u64::from_le_bytes(b.try_into().unwrap()));
        let count = {
            let mut log = log.lock().unwrap();
            log.push((request, first_u64));
            log.len()
        };
        if let (SET_VRING_CALL, Some(file)) = (request, file) {
            let _ = calls.send(file);
        }
        match behaviour {
            Behaviour::Silent => continue,
            Behaviour::HangUpAt(n) if count >= n => return,
            _ => {}
        }
        let reply: Option<Vec<u8>> = match request {
            GET_FEATURES => Some(features.to_le_bytes().to_vec()),
            GET_PROTOCOL_FEATURES => Some(
                PROTOCOL_FEATURES
                    .union(VhostUserProtocolFeatures::CONFIG)
                    .bits()
                    .to_le_bytes()
                    .to_vec(),
            ),
            GET_QUEUE_NUM => Some(2u64.to_le_bytes().to_vec()),
            // The ring's index and where it stopped.
            GET_VRING_BASE => Some([first.to_le_bytes(), 0u32.to_le_bytes()].concat()),
            _ if flags & NEED_REPLY != 0 => Some(0u64.to_le_bytes().to_vec()),
            _ => None,
        };
        if let Some(body) = reply {
            let mut message = Vec::new();
            message.extend_from_slice(&request.to_le_bytes());
            message.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
            message.extend_from_slice(&(body.len() as u32).to_le_bytes());
            message.extend_from_slice(&body);
            if stream.write_all(&message).is_err() {
                return;
            }
        }
        if matches!(behaviour, Behaviour::HangUpAfter(n) if count >= n) {
            return;
        }
    }
}

fn config(backend: &FakeBackend) -> FsConfig {
    FsConfig {
        tag: "hvprobe-rw0".into(),
        socket: backend.socket.clone(),
    }
}

/// What the transport hands over at DRIVER_OK: both queues set up in guest RAM.
fn activation(interrupt: &Arc<Interrupt>) -> (Activation, Vec<EventFd>) {
    let mem = crate::vm::shareable_guest_memory(64 << 20).unwrap();
    let ram = super::super::device_memory(&mem).unwrap();
    let mut queues = Vec::new();
    let mut notify = Vec::new();
    for index in 0..NUM_QUEUES as u32 {
        let base = 0x10_0000 + index * 0x1_0000;
        let q = crate::virtio::test_support::driver_queue(QUEUE_SIZE, 16, base, base + 0x1000, base + 0x2000);
        assert!(q.is_valid(&ram));
        queues.push(q);
        notify.push(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    }
    let kept = notify.iter().map(|e| e.try_clone().unwrap()).collect();
    let activation = Activation {
        panics: crate::vcpu::PanicStop::new(crate::vcpu::VcpuControl::new(1).unwrap()),
        mem: ram,
        queues,
        notify,
        interrupt: Arc::clone(interrupt),
        acked_features: (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX),
    };
    (activation, kept)
}

fn interrupt() -> (Arc<Interrupt>, EventFd) {
    let irqfd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let line = irqfd.try_clone().unwrap();
    (Arc::new(Interrupt::new(irqfd)), line)
}

/// Polls `done` for at most five seconds.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn the_device_hands_its_queues_to_the_backend_relays_its_interrupts_and_stops_the_rings_at_reset() {
    let backend = fake_backend(Behaviour::Serve);
    let mut fs = Fs::connect(&config(&backend)).unwrap();
    // The guest is offered what the backend serves of what the device knows, and never
    // vhost-user's own bits (PROTOCOL_FEATURES, LOG_ALL).
    assert_eq!(
        fs.features(),
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_INDIRECT_DESC) | (1 << VIRTIO_RING_F_EVENT_IDX)
    );
    assert_eq!(fs.device_type(), VIRTIO_ID_FS);
    assert_eq!(fs.queue_max_sizes(), [QUEUE_SIZE; 2]);
    let (interrupt, line) = interrupt();
    let (activation, _notify) = activation(&interrupt);
    fs.activate(activation).unwrap();

    // virtiofsd signals queue 1's call eventfd: the driver sees the VRING bit, then the line.
    let calls: Vec<File> = (0..NUM_QUEUES)
        .map(|_| backend.calls.recv_timeout(Duration::from_secs(5)).unwrap())
        .collect();
    (&calls[1]).write_all(&1u64.to_le_bytes()).unwrap();
    assert!(eventually(|| line.read().is_ok()), "the line was not raised");
    assert_eq!(interrupt.status(), VIRTIO_MMIO_INT_VRING);

    fs.reset();
    let log: Vec<(u32, u64)> = backend.log.lock().unwrap().clone();
    let requests: Vec<u32> = log.iter().map(|&(r, _)| r).collect();
    let per_queue = [
        SET_VRING_NUM,
        SET_VRING_BASE,
        SET_VRING_ADDR,
        SET_VRING_CALL,
        SET_VRING_KICK,
    ];
    let mut expected = vec![
        SET_OWNER,
        GET_FEATURES,
        GET_PROTOCOL_FEATURES,
        SET_PROTOCOL_FEATURES,
        GET_QUEUE_NUM,
        SET_FEATURES,
        SET_MEM_TABLE,
    ];
    expected.extend(per_queue);
    expected.extend(per_queue);
    expected.extend([SET_VRING_ENABLE, SET_VRING_ENABLE]);
    expected.extend([
        SET_VRING_ENABLE,
        GET_VRING_BASE,
        SET_VRING_ENABLE,
        GET_VRING_BASE,
        RESET_DEVICE,
    ]);
    assert_eq!(requests, expected);
    // SET_FEATURES: what the driver took, with vhost-user's PROTOCOL_FEATURES bit.
    let set_features = log.iter().find(|&&(r, _)| r == SET_FEATURES).unwrap().1;
    assert_eq!(
        set_features,
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << 30)
    );
    // The protocol features asked for: REPLY_ACK, MQ and RESET_DEVICE, not CONFIG (the
    // device's config space is hvprobe's).
    let protocol = log.iter().find(|&&(r, _)| r == SET_PROTOCOL_FEATURES).unwrap().1;
    assert_eq!(protocol, PROTOCOL_FEATURES.bits());
}

/// Puts a FUSE request of `opcode` with `unique` in queue `index` (as laid out by
/// [`activation`]) at avail position `position`, using descriptors from `first`: a
/// 40-byte `fuse_in_header`, then, when `reply` is set, a 16-byte reply header and 64
/// bytes for the reply's body, device-writable. Returns the reply header's address.
fn put_request(
    mem: &GuestMemoryMmap,
    index: u64,
    position: u16,
    first: u16,
    opcode: u32,
    unique: u64,
    reply: bool,
) -> u64 {
    use vm_memory::Bytes;
    let base = 0x10_0000 + index * 0x1_0000;
    let buffers = 0x30_0000 + index * 0x1_0000 + u64::from(first) * 0x100;
    let mut header = [0u8; 40];
    header[..4].copy_from_slice(&40u32.to_le_bytes());
    header[4..8].copy_from_slice(&opcode.to_le_bytes());
    header[8..16].copy_from_slice(&unique.to_le_bytes());
    mem.write_slice(&header, GuestAddress(buffers)).unwrap();
    // Reply buffers full of a pattern the answer must overwrite where it writes.
    mem.write_slice(&[0xaa; 80], GuestAddress(buffers + 0x40)).unwrap();
    let descriptor = |at: u16, addr: u64, len: u32, flags: u16, next: u16| {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&d, GuestAddress(base + u64::from(at) * 16)).unwrap();
    };
    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    if reply {
        descriptor(first, buffers, 40, NEXT, first + 1);
        descriptor(first + 1, buffers + 0x40, 16, NEXT | WRITE, first + 2);
        descriptor(first + 2, buffers + 0x50, 64, WRITE, 0);
    } else {
        descriptor(first, buffers, 40, 0, 0);
    }
    let avail = base + 0x1000;
    mem.write_obj(first, GuestAddress(avail + 4 + 2 * u64::from(position % 16)))
        .unwrap();
    mem.write_obj(position.wrapping_add(1), GuestAddress(avail + 2))
        .unwrap();
    buffers + 0x40
}

/// Queue `index`'s used index and its entry at `position` (head, length).
fn used(mem: &GuestMemoryMmap, index: u64, position: u16) -> (u16, (u32, u32)) {
    use vm_memory::Bytes;
    let ring = 0x10_0000 + index * 0x1_0000 + 0x2000;
    let idx: u16 = mem.read_obj(GuestAddress(ring + 2)).unwrap();
    let at = ring + 4 + 8 * u64::from(position % 16);
    (
        idx,
        (
            mem.read_obj(GuestAddress(at)).unwrap(),
            mem.read_obj(GuestAddress(at + 4)).unwrap(),
        ),
    )
}

/// The reply header `answer_eio` writes for `unique`, and the pattern byte after it.
fn eio_reply(unique: u64) -> [u8; 20] {
    let mut want = [0u8; 20];
    want[..4].copy_from_slice(&16u32.to_le_bytes());
    want[4..8].copy_from_slice(&(-5i32).to_le_bytes());
    want[8..16].copy_from_slice(&unique.to_le_bytes());
    want[16..].copy_from_slice(&[0xaa; 4]);
    want
}

fn reply_at(mem: &GuestMemoryMmap, at: u64) -> [u8; 20] {
    use vm_memory::Bytes;
    let mut h = [0u8; 20];
    mem.read_slice(&mut h, GuestAddress(at)).unwrap();
    h
}

#[test]
fn a_backend_that_hangs_up_leaves_its_requests_answered_with_eio_and_a_reset_that_does_not_wait() {
    use vm_memory::Bytes;
    // Five requests connect, fourteen activate; then the backend goes away, having
    // answered the first request of queue 1 (a LOOKUP; used index 1) but not the second
    // (a READ), and with a FORGET on the high-priority queue.
    let backend = fake_backend(Behaviour::HangUpAfter(19));
    let mut fs = Fs::connect(&config(&backend)).unwrap();
    let (interrupt, _line) = interrupt();
    let (activation, notify) = activation(&interrupt);
    let mem = activation.mem.clone();
    let answered = put_request(&mem, 1, 0, 0, 1, 0x1111, true);
    let pending = put_request(&mem, 1, 1, 3, 15, 0x1111_2222_3333_4444, true);
    let used_ring = 0x10_0000 + 0x1_0000 + 0x2000;
    mem.write_obj(0u32, GuestAddress(used_ring + 4)).unwrap();
    mem.write_obj(16u32, GuestAddress(used_ring + 8)).unwrap();
    mem.write_obj(1u16, GuestAddress(used_ring + 2)).unwrap();
    put_request(&mem, 0, 0, 0, 2, 7, false);
    fs.activate(activation).unwrap();
    assert!(
        eventually(|| used(&mem, 1, 0).0 == 2),
        "the pending request was not answered"
    );
    // Only the request the backend left: the one it answered is not answered again.
    assert_eq!(used(&mem, 1, 1).1, (3, 16));
    assert_eq!(reply_at(&mem, pending), eio_reply(0x1111_2222_3333_4444));
    assert_eq!(
        reply_at(&mem, answered),
        [0xaa; 20],
        "an answered request was answered again"
    );
    // The FORGET is returned with no reply written, as a backend does.
    assert!(eventually(|| used(&mem, 0, 0).0 == 1));
    assert_eq!(used(&mem, 0, 0).1, (0, 0));
    assert_ne!(interrupt.status() & VIRTIO_MMIO_INT_VRING, 0);
    // A request after the backend went, with its kick: answered the same way.
    let read = put_request(&mem, 1, 2, 6, 15, 99, true);
    notify[1].write(1).unwrap();
    assert!(eventually(|| used(&mem, 1, 2).0 == 3), "a new request was not answered");
    assert_eq!(used(&mem, 1, 2).1, (6, 16));
    assert_eq!(reply_at(&mem, read), eio_reply(99));
    // Answering is not being broken: the driver is not asked for a reset.
    assert!(!interrupt.needs_reset());
    let started = Instant::now();
    fs.reset();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "reset took {:?}",
        started.elapsed()
    );
}

/// A backend gone before the driver starts the device (the connection closes when the
/// first ring's CALL eventfd is given): the activation goes on with the device answering
/// EIO itself, as when it goes later — a device asking for a reset would leave the
/// guest's FUSE_INIT unanswered for ever.
#[test]
fn a_backend_gone_at_activation_leaves_the_device_answering_eio() {
    let backend = fake_backend(Behaviour::HangUpAt(11));
    let mut fs = Fs::connect(&config(&backend)).unwrap();
    let (interrupt, _line) = interrupt();
    let (activation, notify) = activation(&interrupt);
    let mem = activation.mem.clone();
    let init = put_request(&mem, 1, 0, 0, 26, 1, true);
    fs.activate(activation).unwrap();
    assert!(eventually(|| used(&mem, 1, 0).0 == 1), "FUSE_INIT was not answered");
    assert_eq!(reply_at(&mem, init), eio_reply(1));
    let later = put_request(&mem, 1, 1, 3, 1, 2, true);
    notify[1].write(1).unwrap();
    assert!(eventually(|| used(&mem, 1, 1).0 == 2));
    assert_eq!(reply_at(&mem, later), eio_reply(2));
    assert!(!interrupt.needs_reset());
    fs.reset();
}

#[test]
fn a_backend_that_never_answers_is_refused_within_the_timeout() {
    let backend = fake_backend(Behaviour::Silent);
    let started = Instant::now();
    let err = Fs::connect_with_timeout(&config(&backend), Duration::from_millis(200))
        .err()
        .expect("refused");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            err,
            FsError::Backend {
                step: "GET_FEATURES",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_legacy_backend_or_no_backend_is_refused_with_the_reason() {
    let backend = fake_backend(Behaviour::Legacy);
    let err = Fs::connect(&config(&backend)).err().expect("refused").to_string();
    assert_eq!(
        err,
        "virtio-fs hvprobe-rw0: the vhost-user backend does not offer VIRTIO_F_VERSION_1"
    );
    let nowhere = FsConfig {
        tag: "hvprobe-rw0".into(),
        socket: "/nonexistent/fs.sock".into(),
    };
    let err = Fs::connect(&nowhere).err().expect("refused").to_string();
    assert!(
        err.starts_with("virtio-fs hvprobe-rw0: cannot connect to the vhost-user socket /nonexistent/fs.sock"),
        "{err}"
    );
}

/// A socket bound and not yet listening, at a fresh path: what a backend's socket is
/// between its `bind` and its `listen`. `listen` turns it into a listener.
struct BoundSocket {
    fd: OwnedFd,
    path: PathBuf,
}

impl BoundSocket {
    fn new(name: &str) -> BoundSocket {
        let path = std::env::temp_dir().join(format!("hvprobe-fs-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        address.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_os_str().as_encoded_bytes();
        assert!(bytes.len() < address.sun_path.len());
        for (to, from) in address.sun_path.iter_mut().zip(bytes) {
            *to = *from as libc::c_char;
        }
        // SAFETY: `address` is a valid sockaddr_un of the size given; `fd` is a socket.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&address as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
        BoundSocket { fd, path }
    }

    fn listen(self) -> UnixListener {
        // SAFETY: listen(2) on a bound socket this value owns.
        assert_eq!(unsafe { libc::listen(self.fd.as_raw_fd(), 1) }, 0);
        UnixListener::from(self.fd)
    }
}

#[test]
fn a_backend_socket_bound_before_it_listens_is_connected_once_it_listens() {
    let socket = BoundSocket::new("late-listen");
    let path = socket.path.clone();
    let listener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let listener = socket.listen();
        listener.accept().map(|_| ())
    });
    let stream = connect_listening(&path, Duration::from_secs(10));
    assert!(stream.is_ok(), "{stream:?}");
    listener.join().unwrap().unwrap();
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_socket_that_never_listens_is_refused_at_the_deadline() {
    let socket = BoundSocket::new("never-listens");
    let started = Instant::now();
    let err = connect_listening(&socket.path, Duration::from_millis(100)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(started.elapsed() >= Duration::from_millis(100));
    let _ = std::fs::remove_file(&socket.path);
}
