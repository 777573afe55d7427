//! Host directories shared with the guest (`--rootfs DIR`, `--rwdir [GUESTPATH=]HOSTDIR`):
//! each is a virtio-fs device served by its own virtiofsd, which this module finds, starts,
//! watches and stops.
//!
//! It lives here, in the run session, and not in the VMM: which virtiofsd to run (the
//! user's, the distribution's, or one built into hvprobe's cache by
//! `guest/build-virtiofsd.sh`), how it is sandboxed and what a dead one means for the run
//! are the session's business. The VMM only gets each share's tag and socket
//! ([`hvprobe_vmm::FsConfig`]) and speaks vhost-user on it.
//!
//! A daemon's life:
//! - it is started before the VM, with its socket in a private directory (mode 0700), in a
//!   process group of its own (a Ctrl-C on the terminal is hvprobe's to handle, not the
//!   daemon's to die of) and with PR_SET_PDEATHSIG, so that it dies with hvprobe even when
//!   hvprobe is killed outright;
//! - hvprobe waits for its socket with a deadline; a daemon that exits first is reported
//!   with its exit status and the end of its stderr, before the boot;
//! - while the guest runs, a thread per daemon waits for its exit: a daemon that dies then
//!   is reported the same way (its device answers the guest's requests with EIO from then
//!   on, `hvprobe_vmm::virtio::fs::orphan`), and the run fails at its end;
//! - when the run ends, however it ends (the guest's exit, an error, SIGTERM), dropping
//!   [`Daemons`] stops each daemon (SIGTERM, then SIGKILL) and reaps it.
//!
//! What the guest can do through a daemon, which runs as hvprobe's user (root, often):
//! - sandbox: `--sandbox namespace` (virtiofsd in new mount, PID and network namespaces,
//!   its root the shared directory). hvprobe tries the same `unshare(2)` virtiofsd would
//!   make; where the host refuses, the run is refused before the boot, unless the user
//!   gave the sandbox up with `--share-sandbox none` (virtiofsd then sees every host file
//!   its user can, and relies on its own path checks to stay in the shared directory);
//! - ownership: every file the guest creates, or chowns, belongs to hvprobe's user and
//!   group, and the guest's root sees that user's files as its own
//!   (`--translate-uid`/`--translate-gid`): a guest cannot hand a file to another host user;
//! - privileges: no device node, no setuid or setgid bit, no file capability, no open by
//!   file handle (virtiofsd's `--modcaps`, `--inode-file-handles=never`, and hvprobe's own
//!   seccomp filter under virtiofsd's, [`confine`]);
//! - `--rootfs`: read-only, and the `--rootfs-hide` paths covered by empty ones in the
//!   daemon's mount namespace, set up by hvprobe before the daemon starts ([`confine`]).

use std::collections::VecDeque;
use std::io::{BufRead, Read};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hvprobe_vmm::FsConfig;

mod confine;
pub use confine::HideError;

/// The bundled init's option for the root share (`--rootfs`), and its tag.
pub const ROOTFS_OPTION: &str = "hvprobe.rootfs";
pub const ROOTFS_TAG: &str = "hvprobe-rootfs";
/// The bundled init's option for each read-write share (`--rwdir`): `TAG:GUESTPATH`.
pub const RWDIR_OPTION: &str = "hvprobe.rwdir";
/// How long a virtiofsd may take to create its socket.
pub const SOCKET_DEADLINE: Duration = Duration::from_secs(10);
/// The version `guest/build-virtiofsd.sh` builds (and the cache directory it builds into).
pub const VIRTIOFSD_VERSION: &str = "1.14.0";
/// Where distributions install virtiofsd (Debian's and Fedora's package, QEMU's older one).
const SYSTEM_VIRTIOFSD: [&str; 2] = ["/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd"];
/// What `--rootfs-hide default` hides of a `--rootfs` (each path that exists): the usual
/// secrets of a host's root, and its kernel's file systems.
pub const DEFAULT_HIDDEN: [&str; 18] = [
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/security/opasswd",
    // Host keys (and the rest of the host's ssh configuration).
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/krb5.keytab",
    "/root",
    "/home",
    // Debian keeps copies of the shadow files here.
    "/var/backups",
    "/var/mail",
    "/var/spool",
    // Other users' files, ticket caches, runtime secrets; the guest's init mounts its own
    // /tmp and /run.
    "/tmp",
    "/var/tmp",
    "/run",
    // The host's sysfs (and what is mounted in it: debugfs, efivarfs, ...) and its devtmpfs
    // (/dev/shm, /dev/mqueue hold other processes' files); the guest's init mounts its own.
    // (/proc is hidden whatever the list: see `confine::Hiding`.)
    "/sys",
    "/dev",
];
/// What of a `--rootfs` the guest does not see: one `--rootfs-hide` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootfsHide {
    /// `default`: the default list ([`DEFAULT_HIDDEN`]).
    Default,
    /// `none`: hide nothing.
    Nothing,
    /// A path as the guest names it.
    Path(PathBuf),
}

/// A read-write share (`--rwdir [GUESTPATH=]HOSTDIR`), as the user wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RwDir {
    /// The argument itself, for messages.
    pub arg: String,
    /// Where the guest mounts it; the host's own path when `None`.
    pub guest_path: Option<String>,
    pub host_dir: PathBuf,
}

/// Lines of a daemon's stderr kept for a report, and the bytes kept of each.
const TAIL_LINES: usize = 20;
const TAIL_LINE_BYTES: usize = 400;

#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("{option} {dir}: {source}")]
    Directory {
        option: &'static str,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{option} {dir}: not a directory")]
    NotADirectory { option: &'static str, dir: PathBuf },
    #[error("--rwdir {arg}: the guest path {path:?} must be absolute")]
    GuestPathRelative { arg: String, path: String },
    #[error(
        "--rwdir {arg}: the guest path {path:?} holds {what}, which the kernel command line cannot carry \
         (pick GUESTPATH= without spaces, commas, colons or quotes)"
    )]
    GuestPathUnfit {
        arg: String,
        path: String,
        what: &'static str,
    },
    #[error("--rwdir {arg}: the guest's / is --rootfs DIR's to share")]
    GuestPathRoot { arg: String },
    #[error("--rwdir: the guest path {path} is given twice")]
    GuestPathTwice { path: String },
    #[error("{count} virtio devices (disks and shared directories): at most {max} are supported")]
    TooManyDevices { count: usize, max: usize },
    #[error("--rootfs-hide none hides nothing, so it goes alone (not with {other})")]
    HideNoneWithOthers { other: String },
    #[error(transparent)]
    Hide(#[from] HideError),
    #[error(
        "virtiofsd's namespace sandbox cannot be made here: {reason}; pass --share-sandbox none to \
         run virtiofsd without it (it then sees every host file its user can, and only its own path \
         checks keep the guest in the shared directory)"
    )]
    NoSandbox { reason: NamespacesRefused },
    #[error(
        "--rootfs-hide: hiding paths of --rootfs needs a mount namespace, which this host refuses: \
         {reason}; pass --rootfs-hide none to share all of {dir}"
    )]
    HideNeedsNamespaces { dir: PathBuf, reason: NamespacesRefused },
    #[error("virtiofsd {path} (from {from}): {problem}")]
    Virtiofsd {
        path: PathBuf,
        from: &'static str,
        problem: String,
    },
    #[error("cannot build virtiofsd with {script}: {source}")]
    BuildSpawn {
        script: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "building virtiofsd failed ({status}); its messages are above (it needs cargo and the \
         libcap-ng and libseccomp headers: guest/install-deps.sh installs them), or pass --virtiofsd PATH"
    )]
    BuildFailed { status: std::process::ExitStatus },
    #[error("no cache directory for virtiofsd: set HVPROBE_CACHE or HOME, or pass --virtiofsd PATH")]
    NoCache,
    #[error("cannot make a private directory for virtiofsd's sockets under {parent}: {source}")]
    SocketDir {
        parent: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start virtiofsd {path} for {share}: {source}")]
    Spawn {
        path: PathBuf,
        share: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "virtiofsd for {share} did not create its socket within {} s; its last messages:\n{tail}",
        SOCKET_DEADLINE.as_secs()
    )]
    NoSocket { share: String, tail: String },
    #[error(transparent)]
    Died(#[from] DaemonDied),
}

/// A daemon that exited when it should not have: which one, how, and what it said last.
#[derive(Clone, Debug, thiserror::Error)]
#[error("virtiofsd {pid} for {share} {when}: {status}; its last messages:\n{tail}")]
pub struct DaemonDied {
    pub share: String,
    pub pid: u32,
    pub when: &'static str,
    pub status: String,
    pub tail: String,
}

/// One shared directory, checked: where it is on the host, what the guest calls it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    /// The host directory, canonical.
    pub host_dir: PathBuf,
    /// The virtio-fs tag the guest mounts (`mount -t virtiofs TAG DIR`).
    pub tag: String,
    /// `None` for the root share.
    pub guest_path: Option<String>,
    /// virtiofsd refuses every write (`--readonly`).
    pub read_only: bool,
    /// Paths the guest does not see (`--rootfs-hide`, guest paths: `/` is `host_dir`).
    pub hidden: Vec<PathBuf>,
}

impl Share {
    /// How the user named it, for messages: `--rootfs DIR`, `--rwdir DIR` or `--rwdir
    /// GUEST=DIR`, and its tag.
    pub fn describe(&self) -> String {
        let host = self.host_dir.display();
        match &self.guest_path {
            None => format!("--rootfs {host} (tag {})", self.tag),
            Some(guest) if Path::new(guest) == self.host_dir => format!("--rwdir {host} (tag {})", self.tag),
            Some(guest) => format!("--rwdir {guest}={host} (tag {})", self.tag),
        }
    }

    /// Its option on the kernel command line, for the bundled init.
    pub fn cmdline_option(&self) -> String {
        match &self.guest_path {
            None => format!("{ROOTFS_OPTION}={}", self.tag),
            Some(guest) => format!("{RWDIR_OPTION}={}:{guest}", self.tag),
        }
    }
}

/// The host directory of `option`, canonical, checked to be a directory.
fn host_directory(option: &'static str, dir: &Path) -> Result<PathBuf, ShareError> {
    let canonical = std::fs::canonicalize(dir).map_err(|source| ShareError::Directory {
        option,
        dir: dir.into(),
        source,
    })?;
    if !canonical.is_dir() {
        return Err(ShareError::NotADirectory {
            option,
            dir: dir.into(),
        });
    }
    Ok(canonical)
}

/// What in `path` the kernel command line cannot carry: it splits options at white
/// space, quotes are its own, and the init's `TAG:GUESTPATH` lists split at `,` and `:`.
fn unfit_for_cmdline(path: &str) -> Option<&'static str> {
    if path.chars().any(char::is_whitespace) {
        Some("white space")
    } else if path.contains(',') {
        Some("a comma")
    } else if path.contains(':') {
        Some("a colon")
    } else if path.contains('"') {
        Some("a quote")
    } else if path.chars().any(char::is_control) {
        Some("a control character")
    } else {
        None
    }
}

/// The paths `--rootfs-hide` names: the default list unless told otherwise, `default`
/// standing for it among others, `none` alone for nothing.
pub fn hidden_paths(hide: &[RootfsHide]) -> Result<Vec<PathBuf>, ShareError> {
    let defaults = || DEFAULT_HIDDEN.iter().map(PathBuf::from);
    if hide.is_empty() {
        return Ok(defaults().collect());
    }
    let mut paths: Vec<PathBuf> = Vec::new();
    for value in hide {
        match value {
            RootfsHide::Nothing if hide.len() == 1 => return Ok(Vec::new()),
            RootfsHide::Nothing => {
                let other = hide
                    .iter()
                    .find_map(|h| match h {
                        RootfsHide::Default => Some("default".to_owned()),
                        RootfsHide::Path(p) => Some(p.display().to_string()),
                        RootfsHide::Nothing => None,
                    })
                    .unwrap_or_else(|| "none".into());
                return Err(ShareError::HideNoneWithOthers { other });
            }
            RootfsHide::Default => paths.extend(defaults()),
            RootfsHide::Path(p) => paths.push(p.clone()),
        }
    }
    paths.dedup();
    Ok(paths)
}

/// The shares of a run, checked: the directories exist, the guest paths fit on the
/// kernel command line and differ. Tags: `hvprobe-rootfs`, then `hvprobe-rw0`, … in order.
pub fn shares(rootfs: Option<&Path>, hide: &[RootfsHide], rwdirs: &[RwDir]) -> Result<Vec<Share>, ShareError> {
    let mut shares = Vec::new();
    if let Some(dir) = rootfs {
        shares.push(Share {
            host_dir: host_directory("--rootfs", dir)?,
            tag: ROOTFS_TAG.into(),
            guest_path: None,
            // The guest puts an overlay with a tmpfs upper over it; read-only here too, so
            // that not even a guest that skips the overlay can change the host's files.
            read_only: true,
            hidden: hidden_paths(hide)?,
        });
    }
    let mut guest_paths: Vec<String> = Vec::new();
    for (index, rw) in rwdirs.iter().enumerate() {
        let host_dir = host_directory("--rwdir", &rw.host_dir)?;
        let guest_path = match &rw.guest_path {
            Some(path) => path.clone(),
            None => host_dir.to_string_lossy().into_owned(),
        };
        if !guest_path.starts_with('/') {
            return Err(ShareError::GuestPathRelative {
                arg: rw.arg.clone(),
                path: guest_path,
            });
        }
        if let Some(what) = unfit_for_cmdline(&guest_path) {
            return Err(ShareError::GuestPathUnfit {
                arg: rw.arg.clone(),
                path: guest_path,
                what,
            });
        }
        let trimmed = guest_path.trim_end_matches('/');
        if trimmed.is_empty() {
            return Err(ShareError::GuestPathRoot { arg: rw.arg.clone() });
        }
        if guest_paths.iter().any(|p| p == trimmed) {
            return Err(ShareError::GuestPathTwice { path: trimmed.into() });
        }
        guest_paths.push(trimmed.into());
        shares.push(Share {
            host_dir,
            tag: format!("hvprobe-rw{index}"),
            guest_path: Some(trimmed.into()),
            read_only: false,
            hidden: Vec::new(),
        });
    }
    Ok(shares)
}

/// Checks, before the boot, that `share`'s hidden paths can be hidden (each resolved in its
/// directory as the guest would name it).
pub fn check_hidden(share: &Share) -> Result<(), ShareError> {
    if !share.hidden.is_empty() {
        confine::check(&share.host_dir, &share.hidden)?;
    }
    Ok(())
}

/// The virtiofsd to run and where it came from: `--virtiofsd PATH`, `$HVPROBE_VIRTIOFSD`,
/// the distribution's, else the one `guest/build-virtiofsd.sh` builds into hvprobe's
/// cache (built now if it is not there).
pub fn find_virtiofsd(flag: Option<&Path>) -> Result<(PathBuf, &'static str), ShareError> {
    if let Some(path) = flag {
        return Ok((path.into(), "--virtiofsd"));
    }
    if let Some(path) = std::env::var_os("HVPROBE_VIRTIOFSD").filter(|v| !v.is_empty()) {
        return Ok((path.into(), "$HVPROBE_VIRTIOFSD"));
    }
    if let Some(path) = SYSTEM_VIRTIOFSD.iter().map(Path::new).find(|p| p.is_file()) {
        return Ok((path.into(), "the system's"));
    }
    let cache = crate::cache::cache_dir().ok_or(ShareError::NoCache)?;
    let cached = cache.join(format!("virtiofsd-{VIRTIOFSD_VERSION}/bin/virtiofsd"));
    if cached.is_file() {
        return Ok((cached, "hvprobe's cache"));
    }
    let inputs = crate::cache::inputs::ensure_written(&cache).map_err(|e| ShareError::BuildSpawn {
        script: cache.join("guest-inputs"),
        source: std::io::Error::other(e.to_string()),
    })?;
    let script = inputs.join("build-virtiofsd.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| ShareError::BuildSpawn {
            script: script.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(ShareError::BuildFailed { status: out.status });
    }
    let built = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok((built, "hvprobe's cache (just built)"))
}

/// How virtiofsd is sandboxed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sandbox {
    /// Its namespace sandbox.
    Namespace,
    /// None, as the user asked (`--share-sandbox none`).
    None,
}

impl Sandbox {
    fn arg(&self) -> &'static str {
        match self {
            Sandbox::Namespace => "--sandbox=namespace",
            Sandbox::None => "--sandbox=none",
        }
    }
}

/// Why virtiofsd's namespaces cannot be made here (hvprobe's trial of them).
#[derive(Debug, thiserror::Error)]
pub enum NamespacesRefused {
    #[error("virtiofsd --version in new namespaces ended with {0}")]
    Exited(std::process::ExitStatus),
    #[error("this host refuses to create the namespaces virtiofsd's sandbox needs{} ({source})", if *.root { "" } else { " as a user other than root" })]
    Unshare {
        root: bool,
        #[source]
        source: std::io::Error,
    },
}

/// Checks that `virtiofsd` runs (`--version`) and whether this host lets it make its
/// namespace sandbox: the same `unshare(2)` virtiofsd makes, tried; `Some` says why not.
pub fn check_virtiofsd(path: &Path, from: &'static str) -> Result<Option<NamespacesRefused>, ShareError> {
    let problem = |problem: String| ShareError::Virtiofsd {
        path: path.into(),
        from,
        problem,
    };
    let out = Command::new(path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| problem(format!("cannot be run: {e}")))?;
    let version = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !version.starts_with("virtiofsd") {
        return Err(problem(format!(
            "`--version` said {:?} ({}); is it virtiofsd?",
            version.trim(),
            out.status
        )));
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    // The namespaces virtiofsd's namespace sandbox creates (sandbox.rs in virtiofsd 1.x).
    let flags =
        libc::CLONE_NEWPID | libc::CLONE_NEWNS | libc::CLONE_NEWNET | if root { 0 } else { libc::CLONE_NEWUSER };
    let mut probe = Command::new(path);
    probe.arg("--version").stdin(Stdio::null()).stdout(Stdio::null());
    // SAFETY: the closure runs in the forked child before exec and only makes the
    // unshare system call, which is async-signal-safe.
    unsafe {
        probe.pre_exec(move || {
            if libc::unshare(flags) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(match probe.status() {
        Ok(status) if status.success() => None,
        Ok(status) => Some(NamespacesRefused::Exited(status)),
        Err(source) => Some(NamespacesRefused::Unshare { root, source }),
    })
}

/// The sandbox of the run's daemons: the one asked for (`--share-sandbox`, namespace by
/// default) if this host can make it (`refused` says why not), and hidden paths only where
/// hvprobe can make a mount namespace for them.
pub fn choose_sandbox(
    asked: Option<Sandbox>,
    refused: Option<NamespacesRefused>,
    shares: &[Share],
) -> Result<Sandbox, ShareError> {
    let sandbox = asked.unwrap_or(Sandbox::Namespace);
    match (sandbox, refused) {
        (_, None) => Ok(sandbox),
        (Sandbox::Namespace, Some(reason)) => Err(ShareError::NoSandbox { reason }),
        (Sandbox::None, Some(reason)) => match shares.iter().find(|s| !s.hidden.is_empty()) {
            Some(share) => Err(ShareError::HideNeedsNamespaces {
                dir: share.host_dir.clone(),
                reason,
            }),
            None => Ok(sandbox),
        },
    }
}

/// Whose files the guest's are: the user and group hvprobe runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// hvprobe's effective user and group.
    pub fn current() -> Owner {
        // SAFETY: geteuid and getegid have no preconditions.
        unsafe {
            Owner {
                uid: libc::geteuid(),
                gid: libc::getegid(),
            }
        }
    }
}

/// The arguments virtiofsd gets for `share` (the directory it shares: `shared`, the share's
/// own or a view of it with paths hidden), its socket at `socket`, its files `owner`'s.
pub fn virtiofsd_args(
    share: &Share,
    shared: &Path,
    socket: &Path,
    sandbox: &Sandbox,
    owner: Owner,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "--socket-path".into(),
        socket.into(),
        "--shared-dir".into(),
        shared.into(),
        sandbox.arg().into(),
        // The guest's page cache keeps what it read while the file is unchanged on the host.
        "--cache=auto".into(),
        // Its info lines say nothing a report needs; warnings and errors are kept for one.
        "--log-level=warn".into(),
        // One thread per queue answering in order (virtiofsd's default, said here for a
        // packaged one): when it dies, the device knows which requests it left unanswered
        // (`virtio::fs::orphan`).
        "--thread-pool-size=0".into(),
        // As root, virtiofsd keeps CAP_MKNOD, CAP_SETFCAP and CAP_FSETID by default: device
        // nodes, file capabilities, and set-group-ID bits kept where the kernel would clear
        // them. hvprobe's seccomp filter refuses those too (confine.rs); this is the
        // daemon's own half. (A daemon not running as root has none of these.)
        "--modcaps=-mknod:-setfcap:-fsetid".into(),
        // File handles need CAP_DAC_READ_SEARCH, with which a daemon the guest took over
        // could open any file of the filesystem by handle, past its sandbox's root: an
        // O_PATH descriptor per inode the guest knows instead (the open-file limit, which
        // virtiofsd raises to the hard limit, bounds what a guest keeps looked up).
        "--inode-file-handles=never".into(),
    ];
    // Every guest uid and gid is hvprobe's user's and group's on the host, and the host's
    // files of that user are the guest root's: a guest that chowns a file to another uid
    // leaves it hvprobe's user's. ([0, 2^32 - 1): -1 is chown's "unchanged".)
    for (flag, id) in [("--translate-uid", owner.uid), ("--translate-gid", owner.gid)] {
        args.push(format!("{flag}=map:0:{id}:1").into());
        args.push(format!("{flag}=squash-guest:1:{id}:4294967294").into());
    }
    if share.read_only {
        args.push("--readonly".into());
    }
    if share.tag == ROOTFS_TAG {
        // The root goes under an overlay, which refuses a lower layer's submount (an
        // automount point to the guest: EREMOTE, "Object is remote"); unannounced, a host
        // mount point (/proc, /home, ...) is a directory of the share like any other, its
        // content the mounted filesystem's. (--rwdir shares keep them: no overlay there.)
        args.push("--no-announce-submounts".into());
    }
    args
}

/// The end of a daemon's stderr, escaped (it can name files the guest created).
#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    closed: bool,
}

impl Tail {
    fn text(&self) -> String {
        if self.lines.is_empty() {
            return "  (nothing)".into();
        }
        let lines: Vec<String> = self.lines.iter().map(|l| format!("  {l}")).collect();
        lines.join("\n")
    }
}

fn escape(line: &str) -> String {
    let mut out = String::new();
    for c in line.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        if out.len() >= TAIL_LINE_BYTES {
            out.push('…');
            break;
        }
    }
    out
}

/// What the watcher and `Daemons` share about one daemon.
#[derive(Default)]
struct DaemonState {
    /// How it ended, once it did (the process is a zombie until `Daemons` reaps it).
    exited: Option<String>,
    /// hvprobe is stopping it: its exit is no death.
    stopping: bool,
}

struct Daemon {
    share: Share,
    socket: PathBuf,
    child: Child,
    state: Arc<Mutex<DaemonState>>,
    tail: Arc<(Mutex<Tail>, std::sync::Condvar)>,
    watcher: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
}

/// Called when a daemon dies while hvprobe does not stop it; says whether that counts as
/// a death of the run (false once the VM is ending anyway).
pub type OnDeath = Box<dyn Fn(&DaemonDied) -> bool + Send + Sync>;

/// The running daemons of a run.
pub struct Daemons {
    dir: PathBuf,
    daemons: Vec<Daemon>,
    on_death: Arc<Mutex<Option<OnDeath>>>,
    death: Arc<Mutex<Option<DaemonDied>>>,
}

impl Daemons {
    /// Starts a virtiofsd (`binary`) per share, each with its socket in a fresh private
    /// directory under `runtime_dir`, and waits for every socket (at most `deadline`).
    pub fn start(
        binary: &Path,
        sandbox: &Sandbox,
        shares: &[Share],
        runtime_dir: &Path,
        deadline: Duration,
    ) -> Result<Daemons, ShareError> {
        if *sandbox == Sandbox::None {
            tracing::warn!("virtiofsd runs without its namespace sandbox, as --share-sandbox none asks");
        }
        let dir = private_dir(runtime_dir)?;
        let mut daemons = Daemons {
            dir,
            daemons: Vec::new(),
            on_death: Arc::new(Mutex::new(None)),
            death: Arc::new(Mutex::new(None)),
        };
        for share in shares {
            let socket = daemons.dir.join(format!("{}.sock", share.tag));
            let hiding = match share.hidden.is_empty() {
                true => None,
                false => Some(confine::Hiding::new(
                    &share.host_dir,
                    &share.hidden,
                    &daemons.dir,
                    &share.tag,
                )?),
            };
            let daemon = daemons.spawn(binary, sandbox, share, socket, confine::Confinement::new(hiding))?;
            daemons.daemons.push(daemon);
        }
        let started = Instant::now();
        for daemon in &daemons.daemons {
            loop {
                if let Some(death) = daemons.death() {
                    return Err(death.into());
                }
                if daemon.socket.exists() {
                    break;
                }
                if started.elapsed() > deadline {
                    return Err(ShareError::NoSocket {
                        share: daemon.share.describe(),
                        tail: daemon.tail.0.lock().unwrap_or_else(|e| e.into_inner()).text(),
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(daemons)
    }

    fn spawn(
        &self,
        binary: &Path,
        sandbox: &Sandbox,
        share: &Share,
        socket: PathBuf,
        confinement: confine::Confinement,
    ) -> Result<Daemon, ShareError> {
        let mut command = Command::new(binary);
        let shared = confinement.shared_dir().unwrap_or(&share.host_dir);
        command
            .args(virtiofsd_args(share, shared, &socket, sandbox, Owner::current()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and makes system calls
        // only (prctl, and `Confinement::apply`'s, which allocate nothing), all
        // async-signal-safe. The daemon gets SIGTERM when the thread that started it ends:
        // hvprobe starts daemons on the thread that runs the whole run (its main thread),
        // so that is when hvprobe ends, killed or not.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                confinement.apply()
            });
        }
        let mut child = command.spawn().map_err(|source| ShareError::Spawn {
            path: binary.into(),
            share: share.describe(),
            source,
        })?;
        let pid = child.id();
        let tail = Arc::new((Mutex::new(Tail::default()), std::sync::Condvar::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let reader = {
            let tail = Arc::clone(&tail);
            let tag = share.tag.clone();
            std::thread::Builder::new()
                .name(format!("virtiofsd-{}-log", share.tag))
                .spawn(move || read_stderr(stderr, &tag, &tail))
                .ok()
        };
        let state = Arc::new(Mutex::new(DaemonState::default()));
        let watcher = {
            let (state, tail) = (Arc::clone(&state), Arc::clone(&tail));
            let (on_death, death) = (Arc::clone(&self.on_death), Arc::clone(&self.death));
            let described = share.describe();
            std::thread::Builder::new()
                .name(format!("virtiofsd-{}-wait", share.tag))
                .spawn(move || watch(pid, &described, &state, &tail, &on_death, &death))
                .ok()
        };
        Ok(Daemon {
            share: share.clone(),
            socket,
            child,
            state,
            tail,
            watcher,
            reader,
        })
    }

    /// The devices' configuration: each share's tag and socket.
    pub fn fs_configs(&self) -> Vec<FsConfig> {
        self.daemons
            .iter()
            .map(|d| FsConfig {
                tag: d.share.tag.clone(),
                socket: d.socket.clone(),
            })
            .collect()
    }

    /// Calls `on_death` when a daemon dies from now on (at once if one died already).
    pub fn on_death(&self, on_death: OnDeath) {
        // The watchers take this lock before they record a death: none slips in between.
        let mut slot = self.on_death.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(died) = self.death() {
            on_death(&died);
        }
        *slot = Some(on_death);
    }

    /// The first daemon that died on its own, if one did.
    pub fn death(&self) -> Option<DaemonDied> {
        self.death.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The daemons' process IDs (for tests and messages).
    pub fn pids(&self) -> Vec<u32> {
        self.daemons.iter().map(|d| d.child.id()).collect()
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for daemon in &mut self.daemons {
            let exited = {
                let mut state = daemon.state.lock().unwrap_or_else(|e| e.into_inner());
                state.stopping = true;
                state.exited.is_some()
            };
            // Not reaped yet, so the PID is still this daemon's even if it has exited.
            if !exited {
                // SAFETY: kill(2) on our own child's process group (the daemon and the
                // process its namespace sandbox forks); no memory is involved.
                unsafe { libc::kill(-(daemon.child.id() as i32), libc::SIGTERM) };
            }
            let until = Instant::now() + Duration::from_secs(2);
            loop {
                match daemon.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                    Ok(None) => {
                        let _ = daemon.child.kill();
                        let _ = daemon.child.wait();
                        break;
                    }
                }
            }
            for thread in [daemon.watcher.take(), daemon.reader.take()].into_iter().flatten() {
                let _ = thread.join();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A new directory only this user can enter, for sockets no one else may connect to.
fn private_dir(parent: &Path) -> Result<PathBuf, ShareError> {
    let err = |source| ShareError::SocketDir {
        parent: parent.into(),
        source,
    };
    std::fs::create_dir_all(parent).map_err(err)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for attempt in 0..100u32 {
        let dir = parent.join(format!(
            "hvprobe-virtiofsd-{}-{:x}",
            std::process::id(),
            nanos.wrapping_add(attempt)
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(err(e)),
        }
    }
    Err(err(std::io::Error::from(std::io::ErrorKind::AlreadyExists)))
}

/// The runtime directory for the sockets: `$XDG_RUNTIME_DIR`, else the temp directory.
pub fn runtime_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

fn read_stderr(stderr: std::process::ChildStderr, tag: &str, tail: &(Mutex<Tail>, std::sync::Condvar)) {
    let mut reader = std::io::BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        line.clear();
        // Bounded: a line longer than this is cut (the rest is read as the next ones).
        match (&mut reader).take(64 * 1024).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let text = escape(String::from_utf8_lossy(&line).trim_end());
                tracing::debug!("virtiofsd {tag}: {text}");
                let mut t = tail.0.lock().unwrap_or_else(|e| e.into_inner());
                if t.lines.len() == TAIL_LINES {
                    t.lines.pop_front();
                }
                t.lines.push_back(text);
            }
        }
    }
    tail.0.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
    tail.1.notify_all();
}

/// Waits for daemon `pid` to exit (without reaping it: its PID stays ours until
/// [`Daemons`] reaps it), then records how, and reports it unless hvprobe stopped it.
fn watch(
    pid: u32,
    share: &str,
    state: &Mutex<DaemonState>,
    tail: &(Mutex<Tail>, std::sync::Condvar),
    on_death: &Mutex<Option<OnDeath>>,
    death: &Mutex<Option<DaemonDied>>,
) {
    // SAFETY: a zeroed siginfo_t is a valid value for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waitid on our own child, writing into `info`, which outlives the call.
        let r = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r == 0 {
            break;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // ECHILD: `Daemons` reaped it already; it is stopping it.
            return;
        }
    }
    // SAFETY: waitid succeeded for a child that exited, so the CLD_* fields are set.
    let status = unsafe { info.si_status() };
    let status = match info.si_code {
        libc::CLD_EXITED => format!("exited with status {status}"),
        libc::CLD_KILLED | libc::CLD_DUMPED => format!("was killed by signal {status}"),
        code => format!("ended (code {code}, status {status})"),
    };
    let stopping = {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.exited = Some(status.clone());
        s.stopping
    };
    if stopping {
        return;
    }
    // What it said last: its stderr closes when it (and its sandbox's process) is gone.
    let (lock, closed) = tail;
    let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    let (guard, _) = closed
        .wait_timeout_while(guard, Duration::from_secs(1), |t| !t.closed)
        .unwrap_or_else(|e| e.into_inner());
    let tail = guard.text();
    drop(guard);
    let callback = on_death.lock().unwrap_or_else(|e| e.into_inner());
    let died = DaemonDied {
        share: share.to_owned(),
        pid,
        when: if callback.is_some() {
            "died while the guest ran"
        } else {
            "died before the guest booted"
        },
        status,
        tail,
    };
    if !callback.as_ref().is_none_or(|f| f(&died)) {
        return;
    }
    let mut slot = death.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        *slot = Some(died);
    }
}

#[cfg(test)]
mod tests;
