//! The server side of the control socket: one thread accepts, one thread per client
//! answers its requests, and a client that asked for `trace` gets its own event queue, so
//! that a slow or gone client never stalls a vCPU or another client.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hvprobe_vmm::VcpuControl;

use hvprobe_probes::engine::HitEvent;

use super::record::WireRecord;
use super::{private_dir, ControlError, Request, Response, StreamEnd, StreamFormat, MAX_REQUEST_BYTES, STREAM_END_KEY};
use crate::options::OutputFormat;
use crate::trace::{event_line, Subscription, TraceSession};

/// How long the end of a run waits for the streams to send what they still hold, before
/// it cuts off the clients that do not read.
const STREAM_FLUSH: Duration = Duration::from_secs(5);

/// The most events one stream holds for its client.
const MAX_STREAM_QUEUE: usize = 1 << 20;

/// The streams of `trace` clients: each one's thread, and its socket (to cut it off).
type Streams = Arc<Mutex<Vec<(JoinHandle<()>, UnixStream)>>>;

/// A running control socket.
pub struct ControlServer {
    path: PathBuf,
    stopping: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    streams: Streams,
}

impl ControlServer {
    /// Binds the socket (at `path`, or `<default dir>/<pid>.sock`) and starts answering.
    pub fn start(
        path: Option<PathBuf>,
        session: Arc<TraceSession>,
        control: Arc<VcpuControl>,
    ) -> Result<ControlServer, ControlError> {
        let path = match path {
            Some(p) => p,
            None => {
                let dir = super::default_socket_dir();
                private_dir(&dir)?;
                dir.join(format!("{}.sock", std::process::id()))
            }
        };
        let listener = bind_socket(&path)?;
        let socket_err = |source| ControlError::Socket {
            path: path.clone(),
            source,
        };
        let stopping = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (stopping, streams) = (Arc::clone(&stopping), Arc::clone(&streams));
            std::thread::Builder::new()
                .name("control-accept".into())
                .spawn(move || accept_clients(listener, session, control, stopping, streams))
                .map_err(socket_err)?
        };
        Ok(ControlServer {
            path,
            stopping,
            accept: Some(accept),
            streams,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops taking clients and removes the socket (call when the VM has stopped, before
    /// the session finishes).
    pub fn stop_accepting(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the accept loop up with a connection of our own.
        let _ = UnixStream::connect(&self.path);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }

    /// After the session finished (its streams are closed): waits for every stream to
    /// send what it holds and its end line, and cuts off the clients that do not read.
    pub fn finish(mut self) {
        self.stop_accepting();
        let deadline = Instant::now() + STREAM_FLUSH;
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|e| e.into_inner()));
        for (thread, socket) in streams {
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !thread.is_finished() {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
            let _ = thread.join();
        }
    }
}

/// Binds the control socket at `path`, mode 0600, after [`super::check_socket_path`]: only a
/// socket of ours left by a run that died is removed first.
fn bind_socket(path: &Path) -> Result<UnixListener, ControlError> {
    let socket_err = |source| ControlError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if super::check_socket_path(path)? == super::SocketPath::Stale {
        // (Another user cannot swap it for something else in between: it is ours, and a
        // directory where others may replace our files lets them do anything anyway.)
        std::fs::remove_file(path).map_err(socket_err)?;
    }
    bind_private(path).map_err(socket_err)
}

/// A listening Unix socket at `path` whose file is mode 0600 from its creation. Linux
/// gives a socket's file the mode of the socket's own inode less the umask
/// (`unix_bind_bsd`), so the mode is set on the descriptor before the bind: a chmod of the
/// path after it would follow a symlink someone swapped in meanwhile.
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is a valid value (family set below).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a socket's path must be shorter than {} bytes and hold no NUL",
                addr.sun_path.len()
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (slot, byte) in addr.sun_path.iter_mut().zip(bytes) {
        *slot = *byte as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fchmod, bind and listen on the descriptor owned above; `addr` outlives the
    // bind and `len` is within it.
    unsafe {
        if libc::fchmod(fd.as_raw_fd(), 0o600) != 0
            || libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len as libc::socklen_t,
            ) != 0
            || libc::listen(fd.as_raw_fd(), 128) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(UnixListener::from(fd))
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop_accepting();
        }
    }
}

fn accept_clients(
    listener: UnixListener,
    session: Arc<TraceSession>,
    control: Arc<VcpuControl>,
    stopping: Arc<AtomicBool>,
    streams: Streams,
) {
    for client in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        if let Err(reason) = check_peer(&client) {
            let _ = send(&mut &client, &Response::error(reason.to_string()));
            continue;
        }
        let (session, control, streams) = (Arc::clone(&session), Arc::clone(&control), Arc::clone(&streams));
        let _ = std::thread::Builder::new()
            .name("control-client".into())
            .spawn(move || serve_client(client, &session, &control, &streams));
    }
}

/// Why a client of the control socket was turned away.
#[derive(Debug, thiserror::Error)]
enum PeerRefused {
    #[error("cannot tell who connected: {0}")]
    Unknown(#[source] std::io::Error),
    #[error("uid {peer} may not control this VM (it belongs to uid {owner})")]
    OtherUser { peer: u32, owner: u32 },
}

/// Only the user who started the VM may steer it (the socket's mode says so too; this
/// holds even for a socket path the user put somewhere others can reach).
fn check_peer(client: &UnixStream) -> Result<(), PeerRefused> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given, and the descriptor
    // is an open socket that `client` owns for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            client.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(PeerRefused::Unknown(std::io::Error::last_os_error()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if cred.uid != me {
        return Err(PeerRefused::OtherUser {
            peer: cred.uid,
            owner: me,
        });
    }
    Ok(())
}

fn send(out: &mut impl Write, response: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_string(response).map_err(std::io::Error::other)?;
    line.push('\n');
    out.write_all(line.as_bytes())?;
    out.flush()
}

/// Answers one client's requests, one per line, until it goes away or asks to stream.
fn serve_client(
    client: UnixStream,
    session: &TraceSession,
    control: &Arc<VcpuControl>,
    streams: &Mutex<Vec<(JoinHandle<()>, UnixStream)>>,
) {
    let Ok(reader) = client.try_clone() else { return };
    let mut out = &client;
    serve_requests(BufReader::new(reader), &mut out, |request, out| {
        if let Request::Trace { format, queue } = request {
            let subscription = session.subscribe(queue.clamp(1, MAX_STREAM_QUEUE));
            if send(out, &Response::ok(Vec::new())).is_err() {
                return ControlFlow::Break(());
            }
            // The end of the run waits for this thread (see `ControlServer::finish`).
            let (Ok(socket), Ok(writer)) = (client.try_clone(), client.try_clone()) else {
                return ControlFlow::Break(());
            };
            let control = Arc::clone(control);
            let thread = std::thread::Builder::new()
                .name("control-stream".into())
                .spawn(move || stream_events(writer, subscription, format, &control));
            if let Ok(thread) = thread {
                streams.lock().unwrap_or_else(|e| e.into_inner()).push((thread, socket));
            }
            return ControlFlow::Break(());
        }
        if send(out, &answer(session, request)).is_err() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    });
}

/// Reads requests from `reader`, one per line, answering the malformed ones itself and
/// handing the others to `on_request`, until the client goes away or `on_request` stops.
/// A line longer than [`MAX_REQUEST_BYTES`] is answered with the reason and ends the
/// connection: the server never holds more than that of a client's line.
fn serve_requests<W: Write>(
    mut reader: impl BufRead,
    out: &mut W,
    mut on_request: impl FnMut(Request, &mut W) -> ControlFlow<()>,
) {
    let mut line = Vec::new();
    loop {
        line.clear();
        // One byte over the limit tells a line at the limit from a longer one.
        match (&mut reader)
            .take(MAX_REQUEST_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = match line.strip_suffix(b"\n") {
            Some(text) => text,
            None if line.len() > MAX_REQUEST_BYTES => {
                let _ = send(
                    out,
                    &Response::error(format!(
                        "request longer than {MAX_REQUEST_BYTES} bytes: the connection is closed"
                    )),
                );
                return;
            }
            // The client's last line, without its newline.
            None => &line[..],
        };
        if text.trim_ascii().is_empty() {
            continue;
        }
        let request = match serde_json::from_slice::<Request>(text) {
            Ok(r) => r,
            Err(e) => {
                if send(out, &Response::error(format!("malformed request: {e}"))).is_err() {
                    return;
                }
                continue;
            }
        };
        if on_request(request, out).is_break() {
            return;
        }
    }
}

/// The answer to every request but `trace`.
fn answer(session: &TraceSession, request: Request) -> Response {
    match request {
        Request::Add { text, source } => match session.add(&text, &source) {
            Ok(report) => {
                let mut lines = report.wildcards;
                lines.extend(report.removed.iter().map(|e| format!("removed {e}")));
                lines.extend(report.added.iter().map(|e| format!("added {e}")));
                if !report.added.is_empty() {
                    lines.push(format!(
                        "armed {} probes in {} pause(s) of the vCPUs, {:.1} ms",
                        report.added.len(),
                        report.arm_pauses,
                        report.arm_time.as_secs_f64() * 1e3
                    ));
                }
                Response::ok(lines)
            }
            Err(e) => Response::error(e),
        },
        Request::Remove { events } if events.is_empty() => Response::error("name the events to remove"),
        Request::Remove { events } => match session.remove(&events) {
            Ok(removed) => Response::ok(removed.iter().map(|e| format!("removed {e}")).collect()),
            Err(e) => Response::error(e),
        },
        Request::Enable { events } => toggle(session, &events, true),
        Request::Disable { events } => toggle(session, &events, false),
        Request::Optimize { on } => {
            let on = on.unwrap_or_else(|| crate::options::optimize_by_default(hvprobe_vmm::Backend::detect()));
            match session.set_optimization(on) {
                Ok(()) => Response::ok(vec![format!("optimization {}", if on { "on" } else { "off" })]),
                Err(e) => Response::error(e),
            }
        }
        Request::List => {
            let mut lines: Vec<String> = session.listing().lines().map(str::to_owned).collect();
            if !session.is_armed() {
                lines.insert(0, "# every probe is disarmed (global switch off)".into());
            }
            if !session.optimization() {
                lines.insert(0, "# optimization off".into());
            }
            Response::ok(lines)
        }
        Request::Trace { .. } => Response::error("trace is answered by streaming"),
    }
}

fn toggle(session: &TraceSession, events: &[String], on: bool) -> Response {
    let verb = if on { "enabled" } else { "disabled" };
    match session.set_enabled(events, on) {
        Ok(_) if events.is_empty() => Response::ok(vec![format!("{verb} every probe (global switch)")]),
        Ok(names) => Response::ok(names.iter().map(|e| format!("{verb} {e}")).collect()),
        Err(e) => Response::error(e),
    }
}

/// Sends events to one client as they come, in batches; at the end of the run (or of the
/// client) one [`StreamEnd`] line.
fn stream_events(client: UnixStream, subscription: Subscription, format: StreamFormat, control: &VcpuControl) {
    let line_of = |event: &HitEvent| match format {
        StreamFormat::Text => event_line(event, OutputFormat::Text, subscription.sym_offset),
        StreamFormat::Json => event_line(event, OutputFormat::Json, subscription.sym_offset),
        StreamFormat::Record => serde_json::to_string(&WireRecord::from(&event.record))
            .expect("a record of strings and integers serializes"),
    };
    let mut out = BufWriter::with_capacity(1 << 16, &client);
    let mut sent = 0u64;
    let mut write_failed = false;
    'stream: while let Ok(first) = subscription.events.recv() {
        let mut next = Some(first);
        while let Some(event) = next {
            let mut line = line_of(&event);
            line.push('\n');
            if out.write_all(line.as_bytes()).is_err() {
                write_failed = true;
                break 'stream;
            }
            sent += 1;
            next = subscription.events.try_recv().ok();
        }
        if out.flush().is_err() {
            write_failed = true;
            break;
        }
    }
    if write_failed {
        return;
    }
    let end = StreamEnd {
        reason: match control.stop_reason() {
            Some(reason) => format!("the VM stopped: {reason}"),
            None => "the run ended".into(),
        },
        dropped: subscription.dropped.load(Ordering::Relaxed),
        sent,
    };
    let line = serde_json::json!({ STREAM_END_KEY: end });
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hvprobe-control-server-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A file given as the socket's path is the user's: refused, not deleted.
    #[test]
    fn a_path_that_is_not_a_socket_is_refused_and_left_alone() {
        let dir = scratch("not-a-socket");
        let file = dir.join("notes.txt");
        std::fs::write(&file, "keep me\n").unwrap();
        let refused = bind_socket(&file).map(drop).unwrap_err().to_string();
        assert!(refused.contains("a regular file is there, not a socket"), "{refused}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A socket left by a run that died is taken over; one that answers is refused.
    #[test]
    fn a_dead_runs_socket_is_taken_over_and_a_live_one_refused() {
        let dir = scratch("stale");
        let path = dir.join("run.sock");
        drop(UnixListener::bind(&path).unwrap());
        let listener = bind_socket(&path).unwrap();
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_socket());
        assert!(matches!(bind_socket(&path), Err(ControlError::InUse { .. })));
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The socket is 0600 from its creation: nothing changes its mode by its path after
    /// the bind (where a symlink swapped in would be followed). inotify reports every
    /// change of attributes in the directory, so none may come.
    #[test]
    fn the_socket_is_private_from_its_bind_and_never_changed_by_path() {
        let dir = scratch("mode");
        let path = dir.join("run.sock");
        let c_dir = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: plain system calls on a descriptor this test owns and closes.
        let inotify = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(inotify >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `c_dir` is a NUL-terminated path.
        let watch = unsafe { libc::inotify_add_watch(inotify, c_dir.as_ptr(), libc::IN_ATTRIB | libc::IN_CREATE) };
        assert!(watch >= 0, "{}", std::io::Error::last_os_error());
        let listener = bind_socket(&path).unwrap();
        let mut events = vec![0u8; 4096];
        // SAFETY: `events` is valid for writes of its length.
        let n = unsafe { libc::read(inotify, events.as_mut_ptr().cast(), events.len()) };
        // SAFETY: closing the descriptor opened above.
        unsafe { libc::close(inotify) };
        assert!(n > 0, "no inotify event for the socket's creation");
        let mut masks = Vec::new();
        let mut at = 0;
        while at + 16 <= n as usize {
            let mask = u32::from_ne_bytes(events[at + 4..at + 8].try_into().unwrap());
            let len = u32::from_ne_bytes(events[at + 12..at + 16].try_into().unwrap()) as usize;
            masks.push(mask);
            at += 16 + len;
        }
        assert!(
            masks.iter().all(|m| m & libc::IN_ATTRIB == 0),
            "attributes changed after the bind: {masks:x?}"
        );
        let mode = std::fs::symlink_metadata(&path).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A reader that counts what was read of it.
    struct Counted<R> {
        inner: R,
        read: usize,
    }

    impl<R: Read> Read for Counted<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read += n;
            Ok(n)
        }
    }

    /// A line past the limit gets one answer saying so and ends the connection: the
    /// requests after it are not read, and neither is the rest of an endless line.
    #[test]
    fn a_request_line_past_the_limit_is_answered_and_ends_the_connection() {
        let mut input = vec![b'x'; MAX_REQUEST_BYTES + 1];
        input.extend_from_slice(b"\n{\"op\":\"list\"}\n");
        let mut out = Vec::new();
        let mut handed = 0;
        serve_requests(BufReader::new(&input[..]), &mut out, |_, _| {
            handed += 1;
            ControlFlow::Continue(())
        });
        let out = String::from_utf8(out).unwrap();
        assert_eq!(handed, 0, "{out}");
        assert_eq!(out.lines().count(), 1, "{out}");
        let answer: Response = serde_json::from_str(out.trim()).unwrap();
        assert!(!answer.ok);
        assert_eq!(
            answer.errors,
            [format!(
                "request longer than {MAX_REQUEST_BYTES} bytes: the connection is closed"
            )]
        );

        let mut endless = Counted {
            inner: std::io::repeat(b'x').take(64 << 20),
            read: 0,
        };
        let mut out = Vec::new();
        serve_requests(BufReader::new(&mut endless), &mut out, |_, _| ControlFlow::Continue(()));
        assert!(
            endless.read <= MAX_REQUEST_BYTES + (64 << 10),
            "read {} bytes of an endless line",
            endless.read
        );
        assert!(String::from_utf8(out).unwrap().contains("request longer than"));
    }

    /// Requests within the limit are handed on in order; malformed ones answered.
    #[test]
    fn requests_are_handed_on_and_malformed_ones_answered() {
        let input = b"{\"op\":\"list\"}\n\nnot json\n{\"op\":\"enable\",\"events\":[]}\n";
        let mut out = Vec::new();
        let mut handed = Vec::new();
        serve_requests(BufReader::new(&input[..]), &mut out, |request, _| {
            handed.push(request);
            ControlFlow::Continue(())
        });
        assert_eq!(handed, [Request::List, Request::Enable { events: vec![] }]);
        assert!(String::from_utf8(out)
            .unwrap()
            .starts_with("{\"ok\":false,\"errors\":[\"malformed request"));
    }
}
