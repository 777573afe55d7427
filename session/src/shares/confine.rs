//! What hvprobe puts around each virtiofsd between the fork and the exec, where the daemon
//! (and a guest that took it over) cannot undo it:
//!
//! - a seccomp filter that refuses device nodes, setuid and setgid bits, file capabilities
//!   and opening files by handle, whatever virtiofsd asks for ([`filter`]): a guest root
//!   leaves nothing in a shared directory that gives a local user more rights;
//! - for `--rootfs`, the hidden paths ([`Hiding`]): in a mount namespace of its own, the
//!   root is bound at a view where an empty directory or file is bound over each, and
//!   virtiofsd shares the view (its sandbox clones it and makes it its root). The guest
//!   cannot look under them: the covered files are not in the daemon's view at all.
//!
//! [`Confinement::apply`] runs in the forked child, so it makes system calls only: no
//! allocation, no locks (another thread of hvprobe may have held one at the fork).

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The audit architecture of the system calls the filter lets through (x86-64's); another
/// ABI (i386's `int 0x80`, x32) gets ENOSYS for every call, so that its numbers cannot
/// slip past the checks.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
/// x32's system calls are x86-64's numbers with this bit.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// setxattrat(2) (Linux 6.13); libc does not name it yet.
const SYS_SETXATTRAT: u32 = 463;
/// open(2)'s flags that create a file, whose mode then counts: O_CREAT and O_TMPFILE's
/// own bit (O_TMPFILE is it with O_DIRECTORY).
const CREATING: u32 = libc::O_CREAT as u32 | (libc::O_TMPFILE & !libc::O_DIRECTORY) as u32;
/// The mode bits that run a program with its file's owner or group.
const SET_ID: u32 = libc::S_ISUID | libc::S_ISGID;

/// Offsets in `struct seccomp_data`: the call's number, its ABI, its arguments (the low 32
/// bits of each, the ones a mode or flags argument has).
const NR: u32 = 0;
const ARCH: u32 = 4;
const fn arg(i: u32) -> u32 {
    16 + 8 * i
}

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

fn load(offset: u32) -> libc::sock_filter {
    stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, offset)
}

fn ret(value: u32) -> libc::sock_filter {
    stmt(libc::BPF_RET | libc::BPF_K, value)
}

const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
const fn errno(e: i32) -> u32 {
    libc::SECCOMP_RET_ERRNO | e as u32
}

/// Refused when argument `i` has any of `bits`.
fn refuse_bits(i: u32, bits: u32) -> Vec<libc::sock_filter> {
    vec![
        load(arg(i)),
        jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, bits, 0, 1),
        ret(errno(libc::EPERM)),
        ret(ALLOW),
    ]
}

/// mknod's mode in argument `i`: no block or character device (not even a whiteout, char
/// 0:0, which needs no CAP_MKNOD), no setuid or setgid bit.
fn mknod(i: u32) -> Vec<libc::sock_filter> {
    vec![
        load(arg(i)),
        stmt(libc::BPF_ALU | libc::BPF_AND | libc::BPF_K, libc::S_IFMT),
        jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, libc::S_IFCHR, 4, 0),
        jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, libc::S_IFBLK, 3, 0),
        load(arg(i)),
        jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, SET_ID, 1, 0),
        ret(ALLOW),
        ret(errno(libc::EPERM)),
    ]
}

/// An open whose flags (argument `flags`) create a file: its mode (argument `mode`) may
/// not have the setuid or setgid bit.
fn open(flags: u32, mode: u32) -> Vec<libc::sock_filter> {
    vec![
        load(arg(flags)),
        jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, CREATING, 0, 3),
        load(arg(mode)),
        jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, SET_ID, 0, 1),
        ret(errno(libc::EPERM)),
        ret(ALLOW),
    ]
}

/// The seccomp filter of every virtiofsd hvprobe starts (classic BPF, x86-64).
///
/// Refused with EPERM:
/// - mknod, mknodat of a block or character device, or with S_ISUID or S_ISGID;
/// - chmod, fchmod, fchmodat, fchmodat2 with S_ISUID or S_ISGID (also on directories,
///   where S_ISGID would only be inherited: a guest cannot set it on one, a host's stays);
/// - open, openat, creat that create a file (O_CREAT, O_TMPFILE) with S_ISUID or S_ISGID;
/// - renameat2 with RENAME_WHITEOUT (which leaves a char 0:0 device node);
/// - setxattr and its kin: `security.capability` is a setuid bit by another name (hvprobe
///   never gives virtiofsd `--xattr`, so it makes none of these calls anyway);
/// - open_by_handle_at: a daemon the guest took over could open any file of the shared
///   directory's filesystem by a guessed handle, outside its sandbox's root (hvprobe runs it
///   with `--inode-file-handles=never`, so it does not need it).
///
/// ENOSYS: openat2, whose mode is in a structure a filter cannot read (virtiofsd probes
/// for it and falls back to openat), and io_uring_setup, whose operations no filter sees.
pub fn filter() -> Vec<libc::sock_filter> {
    let rules: Vec<(i64, Vec<libc::sock_filter>)> = vec![
        (libc::SYS_mknod, mknod(1)),
        (libc::SYS_mknodat, mknod(2)),
        (libc::SYS_chmod, refuse_bits(1, SET_ID)),
        (libc::SYS_fchmod, refuse_bits(1, SET_ID)),
        (libc::SYS_fchmodat, refuse_bits(2, SET_ID)),
        (libc::SYS_fchmodat2, refuse_bits(2, SET_ID)),
        (libc::SYS_open, open(1, 2)),
        (libc::SYS_openat, open(2, 3)),
        // creat(2) always creates.
        (libc::SYS_creat, refuse_bits(1, SET_ID)),
        (libc::SYS_renameat2, refuse_bits(4, libc::RENAME_WHITEOUT)),
        (libc::SYS_setxattr, vec![ret(errno(libc::EPERM))]),
        (libc::SYS_lsetxattr, vec![ret(errno(libc::EPERM))]),
        (libc::SYS_fsetxattr, vec![ret(errno(libc::EPERM))]),
        (SYS_SETXATTRAT as i64, vec![ret(errno(libc::EPERM))]),
        (libc::SYS_open_by_handle_at, vec![ret(errno(libc::EPERM))]),
        (libc::SYS_openat2, vec![ret(errno(libc::ENOSYS))]),
        (libc::SYS_io_uring_setup, vec![ret(errno(libc::ENOSYS))]),
    ];
    let mut program = vec![
        load(ARCH),
        jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, AUDIT_ARCH, 1, 0),
        ret(errno(libc::ENOSYS)),
        load(NR),
        jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_SYSCALL_BIT, 0, 1),
        ret(errno(libc::ENOSYS)),
    ];
    // Each rule: the number compared, then its body, which ends in returns; another number
    // jumps over it (the accumulator still holds the number: only a body changes it).
    for (nr, body) in rules {
        let skip = u8::try_from(body.len()).expect("a rule's body is short");
        program.push(jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, nr as u32, 0, skip));
        program.extend(body);
    }
    program.push(ret(ALLOW));
    program
}

/// The paths of a `--rootfs` to hide, ready for the forked child.
///
/// They are hidden in a view of the root, not in the root itself: in the child's mount
/// namespace the root is bound (with its submounts) at [`Hiding::view`], a directory in
/// hvprobe's private one, the paths are covered there, and virtiofsd shares the view. The
/// rest of the daemon's namespace stays the host's: the daemon's own program and
/// libraries, and /proc, are where it finds them even when the root is `/` and `/root`
/// is hidden.
///
/// The view's `/proc` is always covered, whatever the list ([`ALWAYS_HIDDEN`]).
pub struct Hiding {
    /// The root (host directory).
    root: CString,
    /// Where the root is bound and the paths covered, in the daemon's namespace only.
    view: PathBuf,
    view_c: CString,
    /// Each path to hide, relative to the root (as the guest names it, without its `/`).
    paths: Vec<CString>,
    /// What is bound over a directory and over anything else: an empty directory and an
    /// empty file of hvprobe's (in its private directory).
    empty_dir: CString,
    empty_file: CString,
    /// hvprobe's user and group when it is not root: the mount namespace then needs a user
    /// namespace of its own, where they map to themselves (as virtiofsd's own does).
    user: Option<(u32, u32)>,
}

/// Why a path to hide cannot be hidden (found before the daemon starts).
#[derive(Debug, thiserror::Error)]
pub enum HideError {
    #[error("--rootfs-hide {path}: {source}")]
    Path {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot make the view of --rootfs and what covers the hidden paths in {dir}: {source}")]
    Places {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "--rootfs-hide: this kernel lacks openat2(2) (Linux 5.6 has it), which resolves the paths \
         to hide as the guest does; pass --rootfs-hide none to share all of --rootfs"
    )]
    NoOpenat2,
}

/// What is not there has nothing to hide.
fn absent(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR))
}

/// Checks that each of `paths` (guest paths: absolute, `/` being `root`) can be resolved in
/// `root` as the forked child will, so that one that cannot be hidden is an error with its
/// name before the boot (a missing one has nothing to hide).
pub fn check(root: &Path, paths: &[PathBuf]) -> Result<(), HideError> {
    let root_c = c_path(root);
    for path in paths {
        let err = |source: io::Error| match source.raw_os_error() {
            Some(libc::ENOSYS) => HideError::NoOpenat2,
            _ => HideError::Path {
                path: path.display().to_string(),
                source,
            },
        };
        let root_fd = open_dir(&root_c).map_err(err)?;
        let resolved = resolve_in(root_fd, &c_path(relative(path)));
        close(root_fd);
        match resolved {
            Ok(fd) => close(fd),
            Err(e) if absent(&e) => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(())
}

fn c_path(path: &Path) -> CString {
    // A path from the command line or the file system holds no NUL.
    CString::new(path.as_os_str().as_bytes()).expect("a path holds no NUL")
}

/// A guest path relative to the root.
fn relative(path: &Path) -> &Path {
    path.strip_prefix("/").unwrap_or(path)
}

/// What a view always hides: bound before virtiofsd's sandbox mounts its own /proc (and
/// replaces the root's with it), the view of a `--rootfs /` would carry the host's procfs,
/// with every host process's files; shared directly, without a view, it would not.
pub const ALWAYS_HIDDEN: &str = "/proc";

impl Hiding {
    /// The hiding of `paths` (see [`check`], done again here) in `root`, its view and the
    /// empty directory and file made in `private` (hvprobe's own directory, mode 0700) for
    /// the share tagged `tag`. The view's path ends with the root's, so that a process
    /// listing shows which directory a daemon serves.
    pub fn new(root: &Path, paths: &[PathBuf], private: &Path, tag: &str) -> Result<Hiding, HideError> {
        check(root, paths)?;
        let place = |source| HideError::Places {
            dir: private.to_path_buf(),
            source,
        };
        let view = private.join(format!("{tag}-view")).join(relative(root));
        std::fs::create_dir_all(&view).map_err(place)?;
        let (empty_dir, empty_file) = (private.join("hidden-dir"), private.join("hidden-file"));
        match std::fs::DirBuilder::new().mode(0o700).create(&empty_dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(place(e)),
            _ => {}
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&empty_file)
            .map_err(place)?;
        // SAFETY: geteuid and getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(Hiding {
            root: c_path(root),
            view_c: c_path(&view),
            view,
            paths: paths
                .iter()
                .map(PathBuf::as_path)
                .chain([Path::new(ALWAYS_HIDDEN)])
                .map(|p| c_path(relative(p)))
                .collect(),
            empty_dir: c_path(&empty_dir),
            empty_file: c_path(&empty_file),
            user: (uid != 0).then_some((uid, gid)),
        })
    }

    /// The directory virtiofsd shares: the root, the paths hidden.
    pub fn view(&self) -> &Path {
        &self.view
    }

    /// In the forked child: a mount namespace of its own (and a user namespace when not
    /// root), the root bound at the view, and an empty directory or file bound over each
    /// path that exists there.
    ///
    /// # Safety
    /// Only in a child between fork and exec.
    unsafe fn apply(&self) -> io::Result<()> {
        let flags = libc::CLONE_NEWNS | if self.user.is_some() { libc::CLONE_NEWUSER } else { 0 };
        os(libc::unshare(flags))?;
        if let Some((uid, gid)) = self.user {
            let mut line = [0u8; 32];
            write_file(c"/proc/self/setgroups", b"deny")?;
            write_file(c"/proc/self/uid_map", id_map(&mut line, uid))?;
            write_file(c"/proc/self/gid_map", id_map(&mut line, gid))?;
        }
        // Nothing mounted here may reach the host's namespace.
        os(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ))?;
        os(libc::mount(
            self.root.as_ptr(),
            self.view_c.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ))?;
        let empty_dir = os(libc::open(self.empty_dir.as_ptr(), libc::O_PATH | libc::O_CLOEXEC))?;
        let empty_file = os(libc::open(self.empty_file.as_ptr(), libc::O_PATH | libc::O_CLOEXEC))?;
        let view = os(libc::open(
            self.view_c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        ))?;
        for path in &self.paths {
            let target = match resolve_in(view, path) {
                Ok(fd) => fd,
                Err(e) if absent(&e) => continue,
                Err(e) => return Err(e),
            };
            let mut st: libc::stat = std::mem::zeroed();
            os(libc::fstat(target, &mut st))?;
            let source = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                empty_dir
            } else {
                empty_file
            };
            let (mut from, mut to) = ([0u8; 32], [0u8; 32]);
            os(libc::mount(
                fd_path(&mut from, source).as_ptr(),
                fd_path(&mut to, target).as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ))?;
            close(target);
        }
        // (The descriptors are close-on-exec.)
        Ok(())
    }
}

/// What the child does to a virtiofsd before its exec.
pub struct Confinement {
    filter: Vec<libc::sock_filter>,
    hiding: Option<Hiding>,
}

impl Confinement {
    pub fn new(hiding: Option<Hiding>) -> Confinement {
        Confinement {
            filter: filter(),
            hiding,
        }
    }

    /// The directory the daemon shares instead of its share's, when paths are hidden.
    pub fn shared_dir(&self) -> Option<&Path> {
        self.hiding.as_ref().map(Hiding::view)
    }

    /// The hiding, then the filter (last: it is the daemon's, not the set-up's).
    ///
    /// # Safety
    /// Only in a child between fork and exec.
    pub unsafe fn apply(&self) -> io::Result<()> {
        if let Some(hiding) = &self.hiding {
            hiding.apply()?;
        }
        install(&self.filter)
    }
}

/// Installs `filter` on the calling thread (and what it execs). No new privileges first: an
/// unprivileged process may install a filter only so, and virtiofsd runs nothing that
/// would gain any.
///
/// # Safety
/// Async-signal-safe; fine in a child between fork and exec.
pub unsafe fn install(filter: &[libc::sock_filter]) -> io::Result<()> {
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    os(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
    os(libc::prctl(
        libc::PR_SET_SECCOMP,
        libc::SECCOMP_MODE_FILTER,
        &program as *const libc::sock_fprog,
    ))?;
    Ok(())
}

fn os(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn close(fd: libc::c_int) {
    // SAFETY: closing a descriptor this module opened.
    unsafe { libc::close(fd) };
}

fn open_dir(path: &CStr) -> io::Result<libc::c_int> {
    // SAFETY: `path` is NUL-terminated.
    os(unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) })
}

/// `path` resolved in `root` as the guest resolves it (`..` and symlinks stay inside),
/// opened O_PATH: what a bind over it covers.
fn resolve_in(root: libc::c_int, path: &CStr) -> io::Result<libc::c_int> {
    // SAFETY: an all-zero open_how is valid (and what openat2 wants in fields not set).
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: `path` is NUL-terminated and `how` outlives the call, its size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root,
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    os(fd as libc::c_int)
}

/// Writes `bytes` to `path` in one write (a `/proc/self` map file takes exactly one).
///
/// # Safety
/// Async-signal-safe.
unsafe fn write_file(path: &CStr, bytes: &[u8]) -> io::Result<()> {
    let fd = os(libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC))?;
    let written = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
    let result = if written == bytes.len() as isize {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    };
    libc::close(fd);
    result
}

/// Writes the decimal `n` at `buf[at..]`; the index after it.
fn put_decimal(buf: &mut [u8], mut at: usize, n: u32) -> usize {
    let mut digits = [0u8; 10];
    let mut count = 0;
    let mut n = n;
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for digit in digits[..count].iter().rev() {
        buf[at] = *digit;
        at += 1;
    }
    at
}

/// `ID ID 1`: a one-line map of `id` to itself.
fn id_map(buf: &mut [u8; 32], id: u32) -> &[u8] {
    let at = put_decimal(buf, 0, id);
    buf[at] = b' ';
    let at = put_decimal(buf, at + 1, id);
    buf[at..at + 2].copy_from_slice(b" 1");
    &buf[..at + 2]
}

/// `/proc/self/fd/FD`, NUL-terminated, in `buf`.
fn fd_path(buf: &mut [u8; 32], fd: libc::c_int) -> &CStr {
    let prefix = b"/proc/self/fd/";
    buf[..prefix.len()].copy_from_slice(prefix);
    let at = put_decimal(buf, prefix.len(), fd as u32);
    buf[at] = 0;
    CStr::from_bytes_with_nul(&buf[..=at]).expect("one NUL, at the end")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hvprobe-confine-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn maps_and_descriptor_paths_are_spelt_without_allocating() {
        let mut buf = [0u8; 32];
        assert_eq!(id_map(&mut buf, 1000), b"1000 1000 1");
        assert_eq!(id_map(&mut buf, 0), b"0 0 1");
        assert_eq!(id_map(&mut buf, u32::MAX), b"4294967295 4294967295 1");
        assert_eq!(fd_path(&mut buf, 7), c"/proc/self/fd/7");
        assert_eq!(fd_path(&mut buf, 123456), c"/proc/self/fd/123456");
    }

    /// Each call the filter judges, made by python3 under it (as virtiofsd makes them,
    /// and as a daemon the guest took over could): what it refuses and what it lets by.
    /// As root, everything refused would otherwise work.
    #[test]
    fn the_filter_refuses_device_nodes_set_id_bits_capabilities_and_handles() {
        let python = Command::new("python3").arg("--version").output();
        assert!(
            python.is_ok_and(|o| o.status.success()),
            "this test makes its system calls with python3 (guest/install-deps.sh installs it)"
        );
        let dir = scratch("filter");
        let script = r#"
import ctypes, errno, os, stat
libc = ctypes.CDLL(None, use_errno=True)
AT = -100
def t(name, f):
    try:
        r = f()
        if isinstance(r, int) and r < 0:
            print(name, errno.errorcode[ctypes.get_errno()])
        else:
            print(name, "ok")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
def sys(*a):
    return libc.syscall(*a)
t("mknod-chr", lambda: os.mknod("chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3)))
t("mknod-blk", lambda: os.mknod("blk", 0o600 | stat.S_IFBLK, os.makedev(8, 0)))
t("mknod-whiteout", lambda: os.mknod("wh", 0o600 | stat.S_IFCHR, 0))
t("mknod-suid", lambda: os.mknod("reg", 0o4755 | stat.S_IFREG))
t("mknod-fifo", lambda: os.mknod("fifo", 0o600 | stat.S_IFIFO))
t("raw-mknod-blk", lambda: sys(133, b"blk2", 0o600 | stat.S_IFBLK, os.makedev(8, 0)))
t("create-suid", lambda: os.close(os.open("c1", os.O_CREAT | os.O_WRONLY, 0o4755)))
t("create-sgid", lambda: os.close(os.open("c2", os.O_CREAT | os.O_WRONLY, 0o2755)))
t("raw-open-suid", lambda: sys(2, b"c3", os.O_CREAT | os.O_WRONLY, 0o4755))
t("raw-creat-suid", lambda: sys(85, b"c4", 0o4755))
t("tmpfile-suid", lambda: os.close(os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o4755)))
t("create", lambda: os.close(os.open("plain", os.O_CREAT | os.O_WRONLY, 0o755)))
t("open-existing", lambda: os.close(os.open("plain", os.O_WRONLY, 0o4755)))
t("chmod-suid", lambda: os.chmod("plain", 0o4755))
t("chmod-sgid", lambda: os.chmod("plain", 0o2755))
t("raw-chmod-suid", lambda: sys(90, b"plain", 0o4755))
t("fchmodat2-suid", lambda: sys(452, AT, b"plain", 0o4755, 0))
fd = os.open("plain", os.O_RDONLY)
t("fchmod-suid", lambda: os.fchmod(fd, 0o6755))
t("chmod", lambda: os.chmod("plain", 0o700))
t("setxattr", lambda: os.setxattr("plain", "user.hvprobe", b"1"))
t("rename-whiteout", lambda: sys(316, AT, b"plain", AT, b"moved", 4))
t("rename", lambda: sys(316, AT, b"plain", AT, b"moved", 0))
t("open_by_handle_at", lambda: sys(304, AT, None, 0))
how = (ctypes.c_uint64 * 3)(0, 0, 0)
t("openat2", lambda: sys(437, AT, b"moved", ctypes.byref(how), 24))
params = (ctypes.c_uint8 * 120)()
t("io_uring_setup", lambda: sys(425, 1, ctypes.byref(params)))
"#;
        let filter = filter();
        let mut command = Command::new("python3");
        command.args(["-c", script]).current_dir(&dir);
        // SAFETY: `install` makes system calls only, async-signal-safe.
        unsafe { command.pre_exec(move || install(&filter)) };
        let out = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let got: Vec<(&str, &str)> = stdout.lines().filter_map(|l| l.split_once(' ')).collect();
        let want = [
            ("mknod-chr", "EPERM"),
            ("mknod-blk", "EPERM"),
            ("mknod-whiteout", "EPERM"),
            ("mknod-suid", "EPERM"),
            ("mknod-fifo", "ok"),
            ("raw-mknod-blk", "EPERM"),
            ("create-suid", "EPERM"),
            ("create-sgid", "EPERM"),
            ("raw-open-suid", "EPERM"),
            ("raw-creat-suid", "EPERM"),
            ("tmpfile-suid", "EPERM"),
            ("create", "ok"),
            ("open-existing", "ok"),
            ("chmod-suid", "EPERM"),
            ("chmod-sgid", "EPERM"),
            ("raw-chmod-suid", "EPERM"),
            ("fchmodat2-suid", "EPERM"),
            ("fchmod-suid", "EPERM"),
            ("chmod", "ok"),
            ("setxattr", "EPERM"),
            ("rename-whiteout", "EPERM"),
            ("rename", "ok"),
            ("open_by_handle_at", "EPERM"),
            ("openat2", "ENOSYS"),
            ("io_uring_setup", "ENOSYS"),
        ];
        assert_eq!(got, want);
        // Nothing the filter refused is there.
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["fifo", "moved"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// In the namespace the hiding makes, each hidden path that exists reads empty in the
    /// view (a file, a directory, one reached through a symlink that stays inside the
    /// root, and /proc, not in the list), a missing one is no error, the rest reads as it
    /// is; the root itself, and the host's mounts, are as they were.
    #[test]
    fn hidden_paths_read_empty_in_the_daemons_namespace_and_stay_on_the_host() {
        let dir = scratch("hide");
        let root = dir.join("root");
        for (path, text) in [
            ("etc/shadow", "SECRET shadow\n"),
            ("home/alice/.ssh/id_ed25519", "SECRET key\n"),
            ("var/backups/shadow.bak", "SECRET backup\n"),
            ("visible.txt", "VISIBLE\n"),
            ("proc/1/environ", "SECRET environment\n"),
        ] {
            std::fs::create_dir_all(root.join(path).parent().unwrap()).unwrap();
            std::fs::write(root.join(path), text).unwrap();
        }
        // An absolute symlink: resolved in the root, as the guest resolves it.
        std::os::unix::fs::symlink("/var/backups", root.join("backups")).unwrap();
        let private = dir.join("private");
        std::fs::create_dir(&private).unwrap();
        let hidden: Vec<PathBuf> = ["/etc/shadow", "/home", "/backups", "/no/such/path"]
            .iter()
            .map(PathBuf::from)
            .collect();
        let hiding = Hiding::new(&root, &hidden, &private, "hvprobe-rootfs").unwrap();
        assert!(hiding.view().ends_with(root.strip_prefix("/").unwrap()));
        let (r, v) = (root.display(), hiding.view().display());
        // The view hides; the root itself, in the same namespace, does not.
        let mut command = Command::new("sh");
        command.arg("-c").arg(format!(
            "echo shadow:$(cat {v}/etc/shadow); echo home:$(ls -A {v}/home); \
             echo backups:$(ls -A {v}/var/backups); echo proc:$(ls -A {v}/proc); \
             echo visible:$(cat {v}/visible.txt); \
             echo root:$(cat {r}/etc/shadow)"
        ));
        // SAFETY: `apply` makes system calls only, async-signal-safe.
        unsafe { command.pre_exec(move || hiding.apply()) };
        let out = command
            .output()
            .unwrap_or_else(|e| panic!("hiding needs a mount namespace (root, or user namespaces for others): {e}"));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "shadow:\nhome:\nbackups:\nproc:\nvisible:VISIBLE\nroot:SECRET shadow\n",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read_to_string(root.join("etc/shadow")).unwrap(),
            "SECRET shadow\n"
        );
        assert!(root.join("home/alice/.ssh/id_ed25519").exists());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(&dir.display().to_string()), "{mounts}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_path_that_cannot_be_resolved_is_an_error_naming_it() {
        let dir = scratch("unresolvable");
        // A symlink loop: neither there nor missing.
        std::os::unix::fs::symlink("loop", dir.join("loop")).unwrap();
        let err = check(&dir, &[PathBuf::from("/loop")]).unwrap_err().to_string();
        assert!(err.starts_with("--rootfs-hide /loop: "), "{err}");
        check(&dir, &[PathBuf::from("/missing"), PathBuf::from("/missing/below")]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
