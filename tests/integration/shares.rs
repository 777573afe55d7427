//! Host directories shared with the guest (`--rwdir`, `--rootfs`) under real KVM, served by
//! the real virtiofsd: what the guest writes the host sees, a daemon killed mid-run ends
//! the run with its name, hvprobe's SIGTERM leaves no daemon behind, and every bad share
//! is refused before a boot.
//!
//! The bundled init mounts each `--rwdir` at its guest path (`hvprobe.rwdir=TAG:PATH`) and
//! runs the workload in an overlay of `--rootfs` (`hvprobe.rootfs=TAG`); a workload can
//! also mount a share by hand (`mount -t virtiofs TAG DIR`, busybox's mount).

use crate::common;

use std::io::BufRead;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{hvprobe, require_kvm, BOOT_TIMEOUT, QUICK};

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    common::scratch("shares", name)
}

/// The PIDs of the virtiofsd processes serving `dir` (from /proc, as a user would find them:
/// `--shared-dir DIR`, or the view of a --rootfs with hidden paths, `…/TAG-viewDIR`).
fn virtiofsd_pids(dir: &Path) -> Vec<i32> {
    let (exact, view) = (dir.display().to_string(), format!("-view{}", dir.display()));
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            let args: Vec<&str> = cmdline.split('\0').collect();
            let shared = args.windows(2).find(|w| w[0] == "--shared-dir").map(|w| w[1]);
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            comm.trim() == "virtiofsd" && shared.is_some_and(|s| s == exact || s.ends_with(&view))
        })
        .collect();
    pids.sort();
    pids
}

/// `hvprobe run --rwdir ARG --workload WORKLOAD` in the background, with a channel that
/// gets each line of its stdout (the guest console).
struct Background {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

fn run_in_background(rwdir: &str, workload: &str) -> Background {
    let mut child = Command::new(common::hvprobe_bin())
        .args(["run", "--rwdir", rwdir, "--workload", workload])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    Background { child, lines, stderr }
}

impl Background {
    /// Waits for a console line equal to `line`.
    fn wait_for(&self, line: &str) -> bool {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.trim_end() == line => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// Waits (at most `limit`) for hvprobe to end; its exit status, and its stderr after
    /// the console lines not waited for.
    fn finish(mut self, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut output = String::new();
        let until = Instant::now() + Duration::from_secs(5);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => output.push_str(&format!("{line}\n")),
                Err(_) => break,
            }
        }
        output.push_str(&self.stderr.join().unwrap());
        (status, output)
    }
}

/// One boot shows the path: init mounts the --rwdir share at its guest path, the guest
/// reads the host's file and writes files that the host finds with their content; the
/// same share mounts by hand too; the daemon is gone afterwards.
#[test]
fn the_guest_reads_and_writes_a_host_directory() {
    require_kvm();
    let dir = scratch("rw");
    std::fs::write(dir.join("from-host.txt"), "written on the host\n").unwrap();
    let workload = "cat /data/from-host.txt && \
        echo 'written in the guest' > /data/from-guest.txt && mkdir /data/sub && echo deep > /data/sub/f && \
        mkdir -p /mnt && mount -t virtiofs hvprobe-rw0 /mnt && cat /mnt/sub/f && \
        sync && grep -o 'hvprobe.rwdir=[^ ]*' /proc/cmdline";
    let rwdir = format!("/data={}", dir.display());
    let run = hvprobe(&["run", "--rwdir", &rwdir, "--workload", workload], BOOT_TIMEOUT);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &["virtio-fs", "virtiofs"]);
    assert!(run.console_has_line("written on the host"), "{}", run.tail());
    assert!(run.console_has_line("deep"), "{}", run.tail());
    // The init's option names the tag and the guest path.
    assert!(
        run.console_has_line("hvprobe.rwdir=hvprobe-rw0:/data"),
        "{}",
        run.tail()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("from-guest.txt")).unwrap(),
        "written in the guest\n"
    );
    assert_eq!(std::fs::read_to_string(dir.join("sub/f")).unwrap(), "deep\n");
    assert!(virtiofsd_pids(&dir).is_empty(), "a virtiofsd outlived the run");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--rootfs DIR` runs the workload in DIR (its own busybox), which the guest may write
/// but whose host files never change; an `--rwdir` inside it takes the results out.
#[test]
fn a_rootfs_runs_the_workload_and_the_hosts_files_never_change() {
    require_kvm();
    let dir = scratch("rootfs");
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "this test puts the host's static busybox in its root: install busybox-static (guest/install-deps.sh does)"
    );
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "echo", "touch", "ls"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("keep.txt"), "the host's file\n").unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let snapshot = || {
        let mut names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        (names, std::fs::read_to_string(root.join("keep.txt")).unwrap())
    };
    let before = snapshot();
    let workload = "cat /keep.txt; echo changed > /keep.txt; cat /keep.txt; touch /new && echo NEW-MADE; \
        ls /bin/busybox && echo 'the result' > /results/result.txt";
    let rwdir = format!("/results={}", out.display());
    let run = hvprobe(
        &[
            "run",
            "--rootfs",
            root.to_str().unwrap(),
            "--rwdir",
            &rwdir,
            "--workload",
            workload,
        ],
        BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &["virtio-fs", "virtiofs"]);
    // The workload saw the host's file and could change it (in its overlay)…
    assert!(run.console_has_line("the host's file"), "{}", run.tail());
    assert!(run.console_has_line("changed"), "{}", run.tail());
    assert!(run.console_has_line("NEW-MADE"), "{}", run.tail());
    assert!(run.console_has_line("/bin/busybox"), "{}", run.tail());
    // …which the host never saw; the result came out through --rwdir.
    assert_eq!(snapshot(), before, "the host's --rootfs directory changed");
    assert_eq!(std::fs::read_to_string(out.join("result.txt")).unwrap(), "the result\n");
    assert!(virtiofsd_pids(&root).is_empty() && virtiofsd_pids(&out).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A virtiofsd killed while the guest uses its share: the guest's reads of it fail with
/// EIO, the workload goes on to its end, and hvprobe names the daemon, its exit and its
/// last messages, exits with a failure, and leaves no process.
#[test]
fn a_virtiofsd_killed_mid_run_fails_the_guests_requests_with_eio_and_the_run_with_its_name() {
    require_kvm();
    let dir = scratch("kill");
    std::fs::write(dir.join("f"), "x\n").unwrap();
    let run = run_in_background(
        &format!("/data={}", dir.display()),
        "cat /data/f >/dev/null && echo MOUNTED; \
         while cat /data/f >/dev/null; do sleep 1; done; \
         echo \"READ-FAILED: $(cat /data/f 2>&1)\"; echo WROTE >/data/g || echo WRITE-FAILED",
    );
    let mounted = run.wait_for("MOUNTED");
    let pids = virtiofsd_pids(&dir);
    // The daemon that serves: the newest (its namespace sandbox forks the server).
    if let Some(&pid) = pids.last() {
        // SAFETY: kill(2) on a virtiofsd this test's hvprobe started; no memory involved.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let started = Instant::now();
    let (status, stderr) = run.finish(Duration::from_secs(120));
    assert!(mounted, "the guest never mounted its share\n{stderr}");
    assert!(!pids.is_empty(), "no virtiofsd serves {}", dir.display());
    let status = status.unwrap_or_else(|| panic!("hvprobe hung after its virtiofsd died\n{stderr}"));
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "it took {:?}",
        started.elapsed()
    );
    // The guest saw I/O errors and its workload ended on its own (not stopped by the host).
    assert!(
        stderr.contains("READ-FAILED: cat: can't open '/data/f': Input/output error"),
        "{stderr}"
    );
    assert!(
        stderr.contains("can't create /data/g: Input/output error\nWRITE-FAILED"),
        "{stderr}"
    );
    assert!(stderr.contains("guest exited with status 0"), "{stderr}");
    assert!(
        !dir.join("g").exists(),
        "a write after the daemon died reached the host"
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    // Named as the user gave it, with its tag and the PID a user would look for.
    let died = format!(
        "for --rwdir /data={} (tag hvprobe-rw0) died while the guest ran: ",
        dir.display()
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("hvprobe: error: virtiofsd ") && l.contains(&died)),
        "{stderr}"
    );
    assert!(
        stderr.contains("the guest's requests to its share fail with EIO from now on"),
        "{stderr}"
    );
    assert!(stderr.contains("its last messages:"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(virtiofsd_pids(&dir).is_empty(), "a virtiofsd outlived the run");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// hvprobe stopped with SIGTERM while the guest uses its share stops and reaps its daemon.
#[test]
fn a_sigterm_of_hvprobe_leaves_no_virtiofsd_behind() {
    require_kvm();
    let dir = scratch("sigterm");
    let run = run_in_background(
        &format!("/data={}", dir.display()),
        "echo kept > /data/kept && sync && echo MOUNTED; sleep 600",
    );
    let mounted = run.wait_for("MOUNTED");
    let pids = virtiofsd_pids(&dir);
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(run.child.id() as i32, libc::SIGTERM) };
    let (status, stderr) = run.finish(Duration::from_secs(60));
    assert!(mounted, "the guest never mounted its share\n{stderr}");
    assert!(!pids.is_empty(), "no virtiofsd served {}", dir.display());
    assert_eq!(status.and_then(|s| s.code()), Some(143), "{stderr}");
    assert!(!stderr.contains("died while the guest ran"), "{stderr}");
    assert!(virtiofsd_pids(&dir).is_empty(), "a virtiofsd outlived hvprobe");
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "virtiofsd {pid} is still there"
        );
    }
    assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "kept\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every bad share is refused with its reason, before a boot.
#[test]
fn bad_shares_are_refused_before_boot_with_their_reason() {
    let dir = scratch("bad");
    let file = dir.join("file");
    std::fs::write(&file, b"").unwrap();
    let missing = dir.join("missing");
    let (d, f, m) = (dir.to_str().unwrap(), file.to_str().unwrap(), missing.to_str().unwrap());
    let snapshot_dir = dir.join("snap");
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec!["--rwdir".into(), m.into()],
            format!("--rwdir {m}: No such file or directory"),
        ),
        (
            vec!["--rwdir".into(), f.into()],
            format!("--rwdir {f}: not a directory"),
        ),
        (
            vec!["--rootfs".into(), f.into()],
            format!("--rootfs {f}: not a directory"),
        ),
        (
            vec!["--rootfs".into(), m.into()],
            format!("--rootfs {m}: No such file or directory"),
        ),
        (
            vec!["--rwdir".into(), format!("/my data={d}")],
            "the guest path \"/my data\" holds white space, which the kernel command line cannot carry".into(),
        ),
        (vec!["--rwdir".into(), format!("/a,b={d}")], "holds a comma".into()),
        (vec!["--rwdir".into(), format!("/a:b={d}")], "holds a colon".into()),
        (
            vec!["--rwdir".into(), format!("data={d}")],
            "the guest path \"data\" must be absolute".into(),
        ),
        (vec!["--rwdir".into(), "/data=".into()], "no host directory".into()),
        (
            vec!["--rwdir".into(), format!("/x={d}"), "--rwdir".into(), format!("/x={d}")],
            "the guest path /x is given twice".into(),
        ),
        (
            vec![
                "--rootfs".into(),
                d.into(),
                "--disk".into(),
                f.into(),
                "--root".into(),
                "/dev/vda".into(),
            ],
            "the argument '--rootfs <DIR>' cannot be used with '--root </dev/vdX>'".into(),
        ),
        (
            vec!["--rwdir".into(), d.into(), "--virtiofsd".into(), m.into()],
            format!("virtiofsd {m} (from --virtiofsd): cannot be run: No such file or directory"),
        ),
        (
            vec![
                "--snapshot".into(),
                snapshot_dir.display().to_string(),
                "--rwdir".into(),
                d.into(),
            ],
            "cannot be used with".into(),
        ),
    ];
    // One device per share, after the disks: at most eight in all.
    let mut nine = Vec::new();
    for i in 0..9 {
        nine.extend(["--rwdir".to_owned(), format!("/s{i}={d}")]);
    }
    let mut cases = cases;
    cases.push((
        nine,
        "9 virtio devices (disks and shared directories): at most 8 are supported".into(),
    ));
    for (args, message) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::assert_refused_before_boot(&args, &message);
    }

    // Snapshots do not take shares, and say why.
    let run = hvprobe(
        &[
            "snapshot",
            "create",
            "--out",
            snapshot_dir.to_str().unwrap(),
            "--rwdir",
            d,
        ],
        QUICK,
    );
    assert!(
        run.stderr
            .contains("snapshots of a guest with shared directories are not supported"),
        "{}",
        run.tail()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A virtiofsd that fails to start is reported with its exit status and last messages
/// before the guest boots.
#[test]
fn a_virtiofsd_that_fails_to_start_is_reported_before_boot() {
    let dir = scratch("nostart");
    let fake = dir.join("virtiofsd");
    std::fs::write(
        &fake,
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'virtiofsd 1.14.0'; exit 0; }\n\
         echo 'Error creating the passthrough file system: Permission denied' >&2; exit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = hvprobe(
        &[
            "run",
            "--workload",
            "true",
            "--rwdir",
            dir.to_str().unwrap(),
            "--virtiofsd",
            fake.to_str().unwrap(),
        ],
        BOOT_TIMEOUT,
    );
    assert_ne!(run.code, Some(0));
    assert!(
        run.stderr.contains(&format!(
            "for --rwdir {} (tag hvprobe-rw0) died before the guest booted: exited with status 1",
            dir.display()
        )) && run
            .stderr
            .contains("Error creating the passthrough file system: Permission denied"),
        "{}",
        run.tail()
    );
    assert!(!run.stderr.contains("boot to /init"), "it booted\n{}", run.tail());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The host's own root as `/` (`--rootfs /`, as virtme-ng boots): the host's python3
/// creates and queries a sqlite database in an --rwdir. Our probe on `do_sys_openat2` (its
/// path string) sees the database's files opened exactly as the guest's own kprobe event
/// on it does over the same run; the database is on the host afterwards with what the
/// program wrote; a file the workload wrote outside --rwdir is not.
#[test]
fn the_hosts_own_python_and_sqlite_run_on_its_root_under_probes() {
    require_kvm();
    assert!(
        Command::new("python3")
            .args(["-c", "import sqlite3"])
            .status()
            .is_ok_and(|s| s.success()),
        "this test runs the host's python3 with sqlite3 (Debian's python3; guest/install-deps.sh installs it)"
    );
    let dir = scratch("sqlite");
    let probes = dir.join("open.probes");
    std::fs::write(&probes, "p:host/open do_sys_openat2 path=+0(%si):ustring\n").unwrap();
    let outside = format!("/hvprobe-outside-{}.txt", std::process::id());
    let workload = format!(
        "T=/sys/kernel/tracing; echo 'p:gopen do_sys_openat2 path=+0(%si):ustring' > $T/kprobe_events && \
         echo 1 > $T/events/kprobes/gopen/enable && \
         python3 -c \"import sqlite3; c = sqlite3.connect('/results/hvprobe.db'); \
c.execute('create table t (x integer)'); c.executemany('insert into t values (?)', [(i,) for i in range(10)]); \
c.commit(); print('SUM', c.execute('select sum(x) from t').fetchone()[0])\"; \
         echo 0 > $T/events/kprobes/gopen/enable; echo outside > {outside}; \
         grep hvprobe.db $T/trace | sed 's/^/GUEST /'"
    );
    let rwdir = format!("/results={}", dir.display());
    let run = hvprobe(
        &[
            "run",
            "--rootfs",
            "/",
            "--rwdir",
            &rwdir,
            "--probes",
            probes.to_str().unwrap(),
            "--workload",
            &workload,
        ],
        BOOT_TIMEOUT * 3,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &["virtio-fs", "virtiofs"]);
    assert!(run.console_has_line("SUM 45"), "{}", run.tail());
    // The same opens of the database's files, by path, seen by both.
    let paths = |lines: Vec<&str>| {
        let mut paths: Vec<String> = lines
            .iter()
            .filter_map(|l| l.split("path=\"").nth(1))
            .filter_map(|p| p.split('"').next())
            .filter(|p| p.contains("hvprobe.db"))
            .map(str::to_owned)
            .collect();
        paths.sort();
        paths
    };
    let guest = paths(run.stdout.lines().filter(|l| l.starts_with("GUEST ")).collect());
    let ours = paths(
        run.stdout
            .lines()
            .filter(|l| !l.starts_with("GUEST ") && l.contains(" open: ("))
            .collect(),
    );
    assert!(
        !guest.is_empty(),
        "the guest's event saw no open of the database\n{}",
        run.tail()
    );
    assert_eq!(ours, guest, "{}", run.tail());
    // The database is the host's now; the file written outside --rwdir is not.
    let query = Command::new("python3")
        .args([
            "-c",
            &format!(
                "import sqlite3; print(sqlite3.connect('{}').execute('select sum(x) from t').fetchone()[0])",
                dir.join("hvprobe.db").display()
            ),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&query.stdout).trim(), "45");
    assert!(!Path::new(&outside).exists(), "{outside} reached the host's root");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What in `dir` (recursively, symlinks not followed) a local user could use to gain the
/// rights of another: device nodes and files with S_ISUID or S_ISGID; each with its mode.
fn privileged_leftovers(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let kind = meta.file_type();
            if kind.is_block_device() || kind.is_char_device() {
                found.push(format!("{}: a device node ({:o})", path.display(), meta.mode()));
            } else if meta.mode() & 0o6000 != 0 {
                found.push(format!("{}: mode {:o}", path.display(), meta.mode()));
            }
            if kind.is_dir() {
                todo.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Guest root tries every way busybox has to leave a device node or a setuid or setgid
/// file in its --rwdir: mknod of a block and a char device, chmod 4755 and 2755, a copy
/// that keeps a setuid bit, chown to another uid then chmod u+s and g+s. The host's
/// directory holds none of them afterwards, and every file the guest made, even the one
/// it gave to uid 1234, belongs to the user who ran hvprobe.
#[test]
fn guest_root_leaves_no_device_node_and_no_setuid_or_setgid_file_on_the_host() {
    require_kvm();
    let dir = scratch("setuid");
    let workload = "cd /data || exit 1; \
        mknod blk b 8 0; mknod chr c 1 1; mknod mem c 1 1; \
        echo '#!/bin/sh' > suid; chmod 4755 suid; \
        echo x > sgid; chmod 2755 sgid; \
        echo x > both; chmod 6777 both; \
        cp /bin/busybox /tmp/setuid-busybox && chmod 4755 /tmp/setuid-busybox && ls -l /tmp/setuid-busybox; \
        cp -p /tmp/setuid-busybox copied-p; cp /tmp/setuid-busybox copied; \
        echo x > given; chown 1234:1234 given; chmod u+s given; chmod g+s given; \
        sync; ls -ln /data; echo WORKLOAD-DONE";
    let rwdir = format!("/data={}", dir.display());
    let run = hvprobe(&["run", "--rwdir", &rwdir, "--workload", workload], BOOT_TIMEOUT);
    assert!(run.console_has_line("WORKLOAD-DONE"), "{}", run.tail());
    // The guest could set the bits in its own tmpfs: the copies had a setuid source.
    assert!(
        run.stdout
            .lines()
            .any(|l| l.starts_with("-rwsr-xr-x") && l.ends_with("/tmp/setuid-busybox")),
        "{}",
        run.tail()
    );
    let leftovers = privileged_leftovers(&dir);
    assert!(leftovers.is_empty(), "left on the host: {leftovers:#?}\n{}", run.tail());
    // SAFETY: geteuid has no preconditions; hvprobe runs as this process's user.
    let me = unsafe { libc::geteuid() };
    for name in ["suid", "sgid", "both", "given"] {
        let meta = std::fs::metadata(dir.join(name)).unwrap_or_else(|e| {
            panic!(
                "the guest could not make {name} ({e}): the share did not work\n{}",
                run.tail()
            )
        });
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&meta),
            me,
            "{name} does not belong to hvprobe's user\n{}",
            run.tail()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A --rootfs root with the host's usual secrets (a shadow file, root's and the users'
/// homes, ssh host keys): the default hide list keeps each one from the guest, even from a
/// guest root that mounts the root's share again by hand to look under the init's
/// overlay. The files beside them are read, so the share works.
#[test]
fn a_rootfs_hides_the_hosts_secrets_even_from_guest_root() {
    require_kvm();
    let dir = scratch("hide");
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "this test puts the host's static busybox in its root: install busybox-static (guest/install-deps.sh does)"
    );
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "ls", "mount", "mkdir", "echo"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let secrets = [
        "etc/shadow",
        "etc/gshadow",
        "etc/ssh/ssh_host_ed25519_key",
        "root/.bash_history",
        "home/alice/.ssh/id_ed25519",
    ];
    for secret in secrets {
        let path = root.join(secret);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("SECRET {secret}\n")).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    let reads: String = secrets.iter().map(|s| format!("cat /{s}; cat /mnt/{s}; ")).collect();
    let workload = format!(
        "cat /etc/passwd; mkdir -p /mnt && mount -t virtiofs hvprobe-rootfs /mnt && cat /mnt/etc/passwd; \
         {reads} ls -la /root /home /etc/ssh /mnt/home; echo WORKLOAD-DONE"
    );
    let run = hvprobe(
        &["run", "--rootfs", root.to_str().unwrap(), "--workload", &workload],
        BOOT_TIMEOUT,
    );
    assert!(run.console_has_line("WORKLOAD-DONE"), "{}", run.tail());
    // The files beside the secrets are there, through the init's overlay and by hand.
    let passwd = run
        .stdout
        .lines()
        .filter(|l| *l == "root:x:0:0:root:/root:/bin/sh")
        .count();
    assert_eq!(passwd, 2, "{}", run.tail());
    let all = format!("{}\n{}", run.stdout, run.stderr);
    assert!(!all.contains("SECRET"), "the guest read a hidden file\n{}", run.tail());
    // Nor are their names listed (the cat errors above name them, as the workload did).
    for name in ["alice", "ssh_host_ed25519_key", ".bash_history"] {
        assert!(
            !run.stdout.lines().any(|l| l.ends_with(&format!(" {name}"))),
            "{name} is listed\n{}",
            run.tail()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--rootfs /`, the host's own root: its shadow file reads empty to the guest, through
/// the init's overlay and to a guest root that mounts the share by hand, and that share
/// shows none of the host's processes (/proc) or root's files; its /etc is there.
#[test]
fn the_hosts_own_root_as_rootfs_hides_its_shadow_file_and_processes() {
    require_kvm();
    let shadow = std::fs::metadata("/etc/shadow");
    assert!(
        shadow.as_ref().is_ok_and(|m| m.len() > 0),
        "this test needs the host's /etc/shadow, not empty, to hide: {shadow:?}"
    );
    // The host's own shell and tools run it.
    let workload = "echo \"shadow:$(cat /etc/shadow | wc -c)\"; \
        mkdir -p /mnt && mount -t virtiofs hvprobe-rootfs /mnt && \
        echo \"raw-shadow:$(cat /mnt/etc/shadow | wc -c)\" && echo \"raw-proc:$(ls -A /mnt/proc | wc -l)\" && \
        echo \"raw-root:$(ls -A /mnt/root | wc -l)\" && echo \"raw-passwd:$(grep -c '^root:' /mnt/etc/passwd)\"";
    let run = hvprobe(&["run", "--rootfs", "/", "--workload", workload], BOOT_TIMEOUT);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    for line in ["shadow:0", "raw-shadow:0", "raw-proc:0", "raw-root:0", "raw-passwd:1"] {
        assert!(run.console_has_line(line), "wanted {line}\n{}", run.tail());
    }
}

/// A host that will not let hvprobe make virtiofsd's namespaces (here a stand-in
/// virtiofsd that fails in new ones, as on a host that refuses them) refuses the run
/// before the boot, naming the flag that gives the sandbox up.
#[test]
fn a_share_without_its_namespace_sandbox_is_refused_unless_asked_for() {
    let dir = scratch("nosandbox");
    let fake = dir.join("virtiofsd");
    let args = dir.join("args");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\n\
             [ \"$(readlink /proc/self/ns/net)\" = \"$(readlink /proc/$PPID/ns/net)\" ] || exit 1\n\
             [ \"$1\" = --version ] && {{ echo 'virtiofsd 1.14.0'; exit 0; }}\n\
             echo \"$@\" > {}\n\
             echo 'stand-in virtiofsd: stopping here' >&2; exit 1\n",
            args.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let share = dir.join("share");
    std::fs::create_dir_all(&share).unwrap();
    let (fake, share) = (fake.to_str().unwrap(), share.to_str().unwrap());
    common::assert_refused_before_boot(
        &["--rwdir", share, "--virtiofsd", fake],
        "virtiofsd's namespace sandbox cannot be made here",
    );
    assert!(
        !args.exists(),
        "virtiofsd was started without its sandbox: {:?}",
        std::fs::read_to_string(&args)
    );
    // Asked for, it runs without (and the stand-in stops there, before a boot).
    let run = hvprobe(
        &[
            "run",
            "--workload",
            "true",
            "--rwdir",
            share,
            "--virtiofsd",
            fake,
            "--share-sandbox",
            "none",
        ],
        QUICK,
    );
    assert!(
        run.stderr.contains("stand-in virtiofsd: stopping here"),
        "{}",
        run.tail()
    );
    let given = std::fs::read_to_string(&args).unwrap();
    assert!(given.contains("--sandbox=none"), "{given}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// hvprobe run by a user other than root: every file the guest makes in its --rwdir, as
/// its root or as another uid, and even one it chowns, belongs to that user on the host
/// (and the guest's root sees them as its own); and --rootfs hides its secrets there too
/// (hvprobe's mount namespace for them then lives in a user namespace). Run by root, the
/// test runs hvprobe as uid 65534 in a private mount namespace that gives it /dev/kvm and
/// the bundled guest's cache (the host's own stay as they are); run by another user, as
/// that user.
#[test]
fn an_unprivileged_hvprobe_owns_what_the_guest_writes_and_hides_the_roots_secrets() {
    require_kvm();
    // The bundled guest, built (as this user) before a user who cannot write the cache runs.
    common::bundled_guest_dir();
    let dir = scratch("unprivileged");
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let root = uid == 0;
    let owner = if root { (65534, 65534) } else { (uid, gid) };
    let (share, rootfs) = (dir.join("share"), dir.join("root"));
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::create_dir_all(rootfs.join("etc")).unwrap();
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "this test puts the host's static busybox in its root: install busybox-static (guest/install-deps.sh does)"
    );
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "echo", "su", "chown", "stat"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0::/:/bin/sh\nu:x:1000:1000::/:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(rootfs.join("etc/group"), "root:x:0:\nu:x:1000:\n").unwrap();
    std::fs::write(rootfs.join("etc/shadow"), "SECRET\n").unwrap();
    std::fs::set_permissions(rootfs.join("etc/shadow"), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(rootfs.join("visible.txt"), "VISIBLE\n").unwrap();
    std::fs::create_dir_all(&share).unwrap();
    // (The guest's kernel checks its own permissions: uid 1000 writes in a directory open
    // to all.)
    let workload = "echo root > /out/by-root && mkdir /out/pub && chmod 777 /out/pub && \
        su u -c 'echo u > /out/pub/by-1000' && echo x > /out/given && chown 1234:1234 /out/given && \
        stat -c 'GUEST %n %u %g' /out/by-root /out/pub/by-1000 /out/given; \
        cat /visible.txt /etc/shadow; echo WORKLOAD-DONE";
    let rwdir = format!("/out={}", share.display());
    let args = [
        "run",
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--rwdir",
        &rwdir,
        "--workload",
        workload,
    ];
    let run = if root {
        let cache = dir.join("cache");
        std::fs::create_dir_all(&cache).unwrap();
        // Where 65534 can read it (a build tree may be in a home only its user enters).
        let bin = dir.join("hvprobe");
        std::fs::copy(common::hvprobe_bin(), &bin).unwrap();
        std::os::unix::fs::chown(&share, Some(65534), Some(65534)).unwrap();
        // The test's own /dev/kvm node, open to all, bound over the host's in its own
        // mount namespace (in a directory only root enters: no one else reaches it by its
        // own path, even if the test fails before removing it); the cache bound where
        // 65534 can reach it.
        let node_dir = dir.join("kvm");
        std::fs::DirBuilder::new().mode(0o700).create(&node_dir).unwrap();
        let script = format!(
            "set -e; mknod {n}/kvm c 10 232; chmod 666 {n}/kvm; mount --bind {n}/kvm /dev/kvm; \
             mount --bind {cache} {d}/cache; \
             exec setpriv --reuid=65534 --regid=65534 --clear-groups \
             env -i PATH=/usr/bin:/bin HOME={d} HVPROBE_CACHE={d}/cache \"$@\"",
            d = dir.display(),
            n = node_dir.display(),
            cache = common::cache_dir().display(),
        );
        let mut all = vec![
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "sh",
            bin.to_str().unwrap(),
        ];
        all.extend(args);
        let out = Command::new("unshare")
            .args(&all)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        common::Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    } else {
        hvprobe(&args, BOOT_TIMEOUT)
    };
    assert!(run.console_has_line("WORKLOAD-DONE"), "{}", run.tail());
    // The guest's root sees every file as its own...
    for name in ["by-root", "pub/by-1000", "given"] {
        assert!(
            run.console_has_line(&format!("GUEST /out/{name} 0 0")),
            "{name}\n{}",
            run.tail()
        );
    }
    // ...which on the host are hvprobe's user's and group's.
    use std::os::unix::fs::MetadataExt;
    for name in ["by-root", "pub", "pub/by-1000", "given"] {
        let meta = std::fs::metadata(share.join(name)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), owner, "{name}");
    }
    assert!(run.console_has_line("VISIBLE"), "{}", run.tail());
    assert!(!run.stdout.contains("SECRET"), "{}", run.tail());
    std::fs::remove_dir_all(&dir).unwrap();
}
