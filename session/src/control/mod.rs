//! The control socket of a running VM: a Unix socket through which other terminals add,
//! remove, enable, disable and list probes and stream hit events while the guest runs
//! (`hvprobe probe ...`, `hvprobe trace`).
//!
//! The protocol is one JSON object per line. A client sends a [`Request`]; the server
//! answers each with one [`Response`]. After a successful [`Request::Trace`] the
//! connection carries hit lines (the run's own text or JSON layout) until the run ends or
//! the client goes away, then one [`StreamEnd`] line.
//!
//! Only the user who started the VM can connect: the socket is created mode 0600 in a
//! directory of that user's that nobody else can enter, and the server also checks each
//! peer's uid (`SO_PEERCRED`).

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub mod client;
pub mod record;
pub mod server;

/// One request of a client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// kprobe_events lines (`p:`, `r:`, `-:`), as a spec file holds them; `source` names
    /// them in error messages.
    Add { text: String, source: String },
    /// Remove the probes of these events (`GRP/EVENT`, `EVENT`, `GRP/`; globs allowed).
    Remove { events: Vec<String> },
    /// Enable these events; none: the global switch.
    Enable { events: Vec<String> },
    /// Disable these events; none: the global switch.
    Disable { events: Vec<String> },
    /// The optimization switch (Linux's `debug.kprobes_optimization`); `None`: the
    /// backend's default.
    Optimize { on: Option<bool> },
    /// The listing.
    List,
    /// Stream hit events in `format` (`text` or `json`), holding up to `queue` for a slow
    /// reader before dropping (and counting) the rest.
    Trace { format: StreamFormat, queue: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamFormat {
    /// ftrace's `trace` layout.
    Text,
    /// One JSON object per line.
    Json,
    /// One [`record::WireRecord`] per line: every field of the hit, typed, for a client
    /// that writes the hits itself (`hvprobe trace --perfetto FILE`).
    Record,
}

/// The answer to one request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    /// Lines for the user's stdout (the listing, what was added or removed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<String>,
    /// What went wrong, one problem per line (the same messages as for a spec file).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

impl Response {
    pub fn ok(lines: Vec<String>) -> Self {
        Response {
            ok: true,
            lines,
            errors: Vec::new(),
        }
    }

    pub fn error(message: impl ToString) -> Self {
        Response {
            ok: false,
            lines: Vec::new(),
            errors: message.to_string().lines().map(str::to_owned).collect(),
        }
    }
}

/// The last line of an event stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEnd {
    /// Why the stream ended.
    pub reason: String,
    /// Events not sent to this client because it read too slowly.
    pub dropped: u64,
    /// Events sent.
    pub sent: u64,
}

/// The longest request line the server reads (a spec file's text goes in one `add`).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// The key that starts a [`StreamEnd`] line, so that a client tells it from events.
pub const STREAM_END_KEY: &str = "stream_end";

/// Where a run's control socket goes by default: `$XDG_RUNTIME_DIR/hvprobe`, or
/// `/tmp/hvprobe-UID`.
pub fn default_socket_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("hvprobe"),
        // SAFETY: geteuid has no preconditions and cannot fail.
        _ => PathBuf::from(format!("/tmp/hvprobe-{}", unsafe { libc::geteuid() })),
    }
}

/// What can go wrong with the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket directory {dir}: {source}")]
    Dir { dir: PathBuf, source: std::io::Error },
    #[error(
        "control socket directory {dir} is not private (owner uid {owner}, mode {mode:o}): \
         it must belong to you and be closed to others"
    )]
    DirNotPrivate { dir: PathBuf, owner: u32, mode: u32 },
    #[error("control socket {path}: {source}")]
    Socket { path: PathBuf, source: std::io::Error },
    #[error("control socket {path} is in use by a running hvprobe")]
    InUse { path: PathBuf },
    #[error(
        "control socket {path}: {what} is there, not a socket (hvprobe replaces only a socket \
         left by a run that died; pick another path)"
    )]
    NotASocket { path: PathBuf, what: &'static str },
    #[error("control socket {path}: the socket there belongs to uid {owner}, not to you; pick another path")]
    NotOurs { path: PathBuf, owner: u32 },
    #[error(
        "the request to {path} is {bytes} bytes, more than the {max} a control socket reads in one line \
         (add the probes in several parts)"
    )]
    RequestTooLong { path: PathBuf, bytes: usize, max: usize },
    #[error("no running hvprobe found (no control socket in {dir}): start one with `hvprobe run`, or pass --control")]
    NoneRunning { dir: PathBuf },
    #[error("several hvprobe runs are running; pass --control with one of:\n{}", list(.sockets))]
    SeveralRunning { sockets: Vec<PathBuf> },
    #[error("talking to {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} sent a malformed response: {source}")]
    Protocol { path: PathBuf, source: serde_json::Error },
    #[error("{path} closed the connection without an answer (the VM ended?)")]
    Closed { path: PathBuf },
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| format!("  {}", p.display()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What is at a control socket's path before hvprobe binds it.
#[derive(Debug, PartialEq, Eq)]
pub enum SocketPath {
    /// Nothing.
    Free,
    /// A socket of this user's that nobody answers on: left by a run that died, and taken over.
    Stale,
}

/// Checks what is at `path`, where a run is to bind its control socket (`--control PATH`,
/// checked before the boot and again at the bind): nothing, or a socket of this user's
/// that nobody answers on. Anything else is refused, never removed: a file of the user's,
/// or another user's socket. The path itself is looked at (lstat), not what a symlink
/// there points to.
pub fn check_socket_path(path: &Path) -> Result<SocketPath, ControlError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SocketPath::Free),
        Err(source) => {
            return Err(ControlError::Socket {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let kind = meta.file_type();
    let what = if kind.is_socket() {
        None
    } else if kind.is_file() {
        Some("a regular file")
    } else if kind.is_dir() {
        Some("a directory")
    } else if kind.is_symlink() {
        Some("a symbolic link")
    } else if kind.is_fifo() {
        Some("a FIFO")
    } else {
        Some("a device node")
    };
    if let Some(what) = what {
        return Err(ControlError::NotASocket {
            path: path.to_path_buf(),
            what,
        });
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(ControlError::NotOurs {
            path: path.to_path_buf(),
            owner: meta.uid(),
        });
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ControlError::InUse {
            path: path.to_path_buf(),
        });
    }
    Ok(SocketPath::Stale)
}

/// Creates `dir` (mode 0700) if it is missing, and checks that it belongs to us and is
/// closed to everyone else: a directory someone else made could let them swap sockets.
pub fn private_dir(dir: &Path) -> Result<(), ControlError> {
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(source) => {
            return Err(ControlError::Dir {
                dir: dir.to_path_buf(),
                source,
            })
        }
    }
    let meta = std::fs::metadata(dir).map_err(|source| ControlError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.permissions().mode() & 0o077 != 0 {
        return Err(ControlError::DirNotPrivate {
            dir: dir.to_path_buf(),
            owner: meta.uid(),
            mode: meta.permissions().mode() & 0o7777,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_one_json_object_tagged_by_op() {
        let add = Request::Add {
            text: "p:a/b vfs_read".into(),
            source: "<args>".into(),
        };
        let json = serde_json::to_string(&add).unwrap();
        assert_eq!(json, r#"{"op":"add","text":"p:a/b vfs_read","source":"<args>"}"#);
        assert_eq!(serde_json::from_str::<Request>(&json).unwrap(), add);
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"list"}"#).unwrap(),
            Request::List
        );
        let trace: Request = serde_json::from_str(r#"{"op":"trace","format":"json","queue":8}"#).unwrap();
        assert_eq!(
            trace,
            Request::Trace {
                format: StreamFormat::Json,
                queue: 8
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
    }

    #[test]
    fn an_error_response_has_one_problem_per_line() {
        let r = Response::error("2 problems in x:\nx:1: a\nx:2: b");
        assert!(!r.ok);
        assert_eq!(r.errors, ["2 problems in x:", "x:1: a", "x:2: b"]);
        assert_eq!(serde_json::to_string(&Response::ok(vec![])).unwrap(), r#"{"ok":true}"#);
    }

    #[test]
    fn a_socket_directory_others_can_enter_is_refused() {
        let base = std::env::temp_dir().join(format!("hvprobe-private-dir-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dir = base.join("sock");
        private_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(private_dir(&dir), Err(ControlError::DirNotPrivate { .. })));
        std::fs::remove_dir_all(&base).unwrap();
    }
}
