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
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{hvprobe, require_kvm, BOOT_TIMEOUT, QUICK};

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    common::scratch("shares", name)
}

/// The PIDs of the virtiofsd processes serving `dir` (from /proc, as a user would find them).
fn virtiofsd_pids(dir: &Path) -> Vec<i32> {
    let wanted = format!("--shared-dir\0{}\0", dir.display());
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            comm.trim() == "virtiofsd" && cmdline.contains(&wanted)
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
