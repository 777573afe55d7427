//! Disk images as virtio-blk disks (`--disk FILE[,ro]`, `--root /dev/vdX`) under real KVM,
//! and the errors for bad images, which come before any boot.
//!
//! The guest's root disk is an ext4 image made here with `mkfs.ext4 -d` from a directory
//! holding the host's static busybox (no loop mount, no root needed).

use crate::common;

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{hvprobe, require_kvm, Run, BOOT_TIMEOUT, QUICK};

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    common::scratch("disks", name)
}

/// An ext4 image of `mib` MiB at `image` whose root holds busybox as /bin/sh (and as the
/// applets a test names), empty mount points, and `files` (path, contents).
fn ext4_image(image: &Path, mib: u64, applets: &[&str], files: &[(&str, &str)]) {
    let root = image.with_extension("root");
    let _ = std::fs::remove_dir_all(&root);
    for dir in ["bin", "proc", "sys", "dev", "tmp", "run"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "this test puts the host's static busybox on its disk: install busybox-static (guest/install-deps.sh does)"
    );
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in std::iter::once(&"sh").chain(applets) {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    for (path, contents) in files {
        std::fs::write(root.join(path), contents).unwrap();
    }
    // Under `timeout`: a tool that hangs fails the test with its name instead of holding
    // it (and the lane's L1) to the suite's deadline. Its "Creating regular file" line
    // goes to the test's stderr, not into libtest's verdict line on stdout.
    let out = Command::new("timeout")
        .args(["120", "mkfs.ext4", "-q", "-F", "-d"])
        .arg(&root)
        .arg(image)
        .arg(format!("{mib}M"))
        .output()
        .expect("mkfs.ext4 (e2fsprogs) runs");
    assert!(
        out.status.success(),
        "mkfs.ext4 failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// The contents of `path` in the ext4 image, read on the host with debugfs.
fn debugfs_cat(image: &Path, path: &str) -> String {
    let out = Command::new("timeout")
        .args(["120", "debugfs", "-R", &format!("cat {path}")])
        .arg(image)
        .output()
        .expect("debugfs (e2fsprogs) runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A copy of `image` as the guest kernel's next mount would find it: its journal replayed
/// (`e2fsck -p`, which also settles what a replay leaves to fsck, such as free counts),
/// then checked clean (`e2fsck -n`). A VM stopped while its guest synced leaves the
/// metadata whole in the journal and its home blocks partly written: debugfs, which reads
/// only the home blocks, then refuses the image ("Inode bitmap checksum does not match").
fn recovered(image: &Path) -> PathBuf {
    let copy = image.with_extension("recovered");
    std::fs::copy(image, &copy).unwrap();
    let fsck = |mode: &str| {
        Command::new("timeout")
            .args(["120", "e2fsck", "-f", mode])
            .arg(&copy)
            .output()
            .expect("e2fsck (e2fsprogs) runs")
    };
    let replay = fsck("-p");
    // 0: clean; 1: errors corrected (a journal replayed counts as one).
    assert!(
        matches!(replay.status.code(), Some(0 | 1)),
        "e2fsck -p {}: {}{}",
        replay.status,
        String::from_utf8_lossy(&replay.stdout),
        String::from_utf8_lossy(&replay.stderr)
    );
    let check = fsck("-n");
    assert!(
        check.status.success(),
        "the recovered image is not clean ({}): {}",
        check.status,
        String::from_utf8_lossy(&check.stdout)
    );
    copy
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split(' ')
        .next()
        .unwrap()
        .to_owned()
}

fn probe_file(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("disk.probes");
    std::fs::write(&path, text).unwrap();
    path
}

/// Host events of `event` in tasks named `comm` (trace lines `comm-PID [CPU] …: event:`).
fn host_hits(run: &Run, event: &str, comm: &str) -> usize {
    run.stdout
        .lines()
        .filter(|l| !l.starts_with("GUEST "))
        .filter(|l| l.trim_start().starts_with(&format!("{comm}-")))
        .filter(|l| l.contains(&format!(": {event}: (")))
        .count()
}

/// The guest's own trace lines of `event`.
fn guest_hits(run: &Run, event: &str) -> usize {
    run.stdout
        .lines()
        .filter(|l| l.starts_with("GUEST "))
        .filter(|l| l.contains(&format!(": {event}: (")))
        .count()
}

/// One boot shows the whole path: the guest runs from an ext4 root disk, reads a file the
/// host put there, writes and fsyncs one that the host then finds in the image, cannot
/// write its read-only second disk (whose bytes stay the same), and host probes on ext4
/// and the block layer count what the guest's own kprobe events count.
#[test]
fn a_root_disk_is_read_and_written_and_its_paths_are_probed_like_the_guests_own_events() {
    require_kvm();
    let dir = scratch("root");
    let root = dir.join("root.img");
    ext4_image(
        &root,
        32,
        &["dd", "cat", "sync"],
        &[("hello.txt", "hello from the host\n")],
    );
    let spare = dir.join("spare.img");
    std::fs::write(&spare, vec![0x42u8; 1 << 20]).unwrap();
    let spare_hash = sha256(&spare);
    // Jump-optimized where they can be (event detours record in the guest, no exit), and
    // the block layer's submissions unwound on the host.
    let probes = probe_file(
        &dir,
        "p:hw ext4_file_write_iter\np:hsub blk_mq_submit_bio\np:hvq virtio_queue_rq\n\
         filter hsub comm == \"dd\"\ntrigger hsub stacktrace\n",
    );
    // The guest's own events on the same functions, traced only for dd.
    let workload = "T=/sys/kernel/tracing; \
        echo 'p:gw ext4_file_write_iter' >> $T/kprobe_events; \
        echo 'p:gsub blk_mq_submit_bio' >> $T/kprobe_events; \
        for e in gw gsub; do echo 'comm == \"dd\"' > $T/events/kprobes/$e/filter; done; \
        cat /hello.txt; \
        echo 1 > $T/events/kprobes/enable; \
        dd if=/dev/zero of=/written bs=4096 count=8 conv=fsync 2>/dev/null; \
        echo 0 > $T/events/kprobes/enable; \
        echo 'the guest wrote this' > /note; sync; \
        if dd if=/dev/zero of=/dev/vdb bs=512 count=1 conv=fsync 2>/dev/null; then echo RO-WRITE-TOOK; else echo RO-WRITE-REFUSED; fi; \
        while read l; do case $l in *' g'*': ('*) echo \"GUEST $l\";; esac; done < $T/trace";
    let run = hvprobe(
        &[
            "run",
            "--disk",
            root.to_str().unwrap(),
            "--disk",
            &format!("{},ro", spare.display()),
            "--root",
            "/dev/vda",
            "--optimize",
            "on",
            "--probes",
            probes.to_str().unwrap(),
            "--workload",
            workload,
        ],
        BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    assert!(run.console_has_line("hello from the host"), "{}", run.tail());
    // ext4's write path is optimized like any function's.
    let listing = run
        .stderr
        .lines()
        .find(|l| l.contains("ext4_file_write_iter+0x0") && l.contains("hits="))
        .unwrap_or_else(|| panic!("no listing line of hw\n{}", run.tail()));
    assert!(listing.contains("[OPTIMIZED]"), "{listing}");
    // Each of dd's bio submissions unwound on the host through the block layer and ext4
    // (or its journal) into the system call.
    let stacks: Vec<&str> = run
        .stdout
        .split("<stack trace>")
        .skip(1)
        .filter(|s| s.lines().nth(1).is_some_and(|l| l.contains("blk_mq_submit_bio")))
        .collect();
    assert!(!stacks.is_empty(), "no stack of a bio submission\n{}", run.tail());
    for stack in &stacks {
        let frames: Vec<&str> = stack
            .lines()
            .take_while(|l| l.is_empty() || l.starts_with(" => "))
            .collect();
        let has = |f: &str| frames.iter().any(|l| l.contains(f));
        assert!(has("submit_bio"), "{frames:#?}");
        assert!(has("ext4_") || has("jbd2_"), "{frames:#?}");
        // Into the system call that caused it (dd's open creating the file, its writes,
        // its fsync).
        assert!(has("sys_") || has("fsync"), "{frames:#?}");
    }
    assert!(run.console_has_line("RO-WRITE-REFUSED"), "{}", run.tail());

    // The probes saw dd's writes as the guest's own events did.
    let (host_w, guest_w) = (host_hits(&run, "hw", "dd"), guest_hits(&run, "gw"));
    assert_eq!(host_w, 8, "one ext4 write per dd block\n{}", run.tail());
    assert_eq!(host_w, guest_w);
    let (host_sub, guest_sub) = (host_hits(&run, "hsub", "dd"), guest_hits(&run, "gsub"));
    assert!(host_sub > 0, "dd's fsync submitted no bio\n{}", run.tail());
    assert_eq!(host_sub, guest_sub);
    let virtio_requests = run.stdout.lines().filter(|l| l.contains(": hvq: (")).count();
    assert!(
        virtio_requests >= host_sub,
        "{virtio_requests} virtio requests for {host_sub} bios"
    );

    // What the guest wrote is in the image; the read-only disk is unchanged.
    assert_eq!(debugfs_cat(&root, "/note"), "the guest wrote this\n");
    assert_eq!(debugfs_cat(&root, "/written").len(), 8 * 4096);
    assert_eq!(sha256(&spare), spare_hash);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The Debian image of `guest/build-debian-image.sh` (built once, cached).
fn debian_image() -> PathBuf {
    let out = Command::new(common::repo().join("guest/build-debian-image.sh"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run guest/build-debian-image.sh");
    assert!(
        out.status.success(),
        "building the Debian image failed (its messages are above)"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A distribution's userland from a disk image runs its own programs under probes, and
/// what it writes is in the image afterwards. The cached image is never written: the
/// guest gets a copy.
#[test]
fn a_debian_userland_runs_its_own_programs_from_a_disk_image() {
    require_kvm();
    let dir = scratch("debian");
    let image = dir.join("debian.img");
    // A sparse copy: the cached image stays as built.
    let copied = Command::new("cp")
        .args(["--sparse=always"])
        .arg(debian_image())
        .arg(&image)
        .status()
        .unwrap();
    assert!(copied.success());
    let probes = probe_file(&dir, "p:execs __x64_sys_execve\n");
    let workload = "echo DPKG $(dpkg-query -W -f='${Package}\\n' | wc -l) packages; \
        dpkg -l dpkg | tail -n 1; \
        . /etc/os-release; echo \"OS $PRETTY_NAME\"; \
        echo 'written by the Debian guest' > /root/from-guest; sync";
    let run = hvprobe(
        &[
            "run",
            "--disk",
            image.to_str().unwrap(),
            "--root",
            "/dev/vda",
            "--probes",
            probes.to_str().unwrap(),
            "--workload",
            workload,
        ],
        BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    common::assert_guest_healthy(&run, &[]);
    assert!(
        run.console_has_line("OS Debian GNU/Linux 12 (bookworm)"),
        "{}",
        run.tail()
    );
    let packages: usize = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("DPKG ")?.strip_suffix(" packages")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no package count\n{}", run.tail()));
    assert!(packages > 50, "{packages} packages in a minbase system");
    assert!(
        run.stdout.lines().any(|l| l.starts_with("ii  dpkg ")),
        "dpkg -l did not list dpkg as installed\n{}",
        run.tail()
    );
    // The host saw the guest's programs start (dpkg-query, wc, dpkg, tail, …).
    let execs = run.stdout.lines().filter(|l| l.contains(": execs: (")).count();
    assert!(execs >= 4, "{execs} execs seen\n{}", run.tail());
    assert_eq!(debugfs_cat(&image, "/root/from-guest"), "written by the Debian guest\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Data the guest synced is in the image when hvprobe is stopped with SIGTERM while the
/// guest goes on syncing: every file the guest said it had synced is there, and the image
/// is clean, once its journal is replayed as the guest's next mount would.
#[test]
fn synced_data_survives_a_sigterm_of_hvprobe_while_the_guest_syncs() {
    require_kvm();
    let dir = scratch("sigterm");
    let root = dir.join("root.img");
    ext4_image(&root, 16, &["sync", "sleep"], &[]);
    let mut child = Command::new(common::hvprobe_bin())
        .args([
            "run",
            "--disk",
            root.to_str().unwrap(),
            "--root",
            "/dev/vda",
            "--workload",
        ])
        .arg("echo 'kept after SIGTERM' > /kept; i=0; while :; do echo $i > /n$i; sync; echo SYNCED $i; i=$((i+1)); done")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(n) = line
                .trim_end()
                .strip_prefix("SYNCED ")
                .and_then(|n| n.parse::<u32>().ok())
            {
                let _ = tx.send(n);
            }
        }
    });
    // A few syncs in, so that the guest is in the middle of one when the signal comes.
    let mut synced = None;
    let deadline = std::time::Instant::now() + BOOT_TIMEOUT;
    while synced.is_none_or(|n| n < 3) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(n) => synced = Some(n),
            Err(_) => break,
        }
    }
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    // A line that came after the signal was synced too.
    let synced = rx.try_iter().last().or(synced);
    let Some(last) = synced.filter(|n| *n >= 3) else {
        panic!("the guest said it had synced {synced:?}, not 3 files (hvprobe: {status})");
    };
    let image = recovered(&root);
    assert_eq!(debugfs_cat(&image, "/kept"), "kept after SIGTERM\n");
    for n in 0..=last {
        assert_eq!(
            debugfs_cat(&image, &format!("/n{n}")),
            format!("{n}\n"),
            "file {n} of {last}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The image a SIGTERM left in a cold run (2026-11-28; busybox's data blocks zeroed to keep
/// it small): the guest had synced /kept, its journal held that transaction whole, and the
/// home blocks were half written, so debugfs refused the image and the test above, which
/// then read the image as it was, found nothing. Read as the next mount finds it, /kept
/// is there.
#[test]
fn an_image_a_stop_left_mid_write_is_read_as_the_next_mount_finds_it() {
    let dir = scratch("torn");
    let image = dir.join("torn.img");
    let fixture = common::repo().join("tests/integration/data/ext4-torn-by-a-stop.img.xz");
    let out = Command::new("xz")
        .arg("-dc")
        .arg(&fixture)
        .output()
        .expect("xz (xz-utils) runs");
    assert!(out.status.success(), "xz -dc {}: {}", fixture.display(), out.status);
    std::fs::write(&image, &out.stdout).unwrap();
    assert_eq!(
        debugfs_cat(&image, "/kept"),
        "",
        "debugfs reads only the home blocks: it refuses the image"
    );
    assert_eq!(debugfs_cat(&recovered(&image), "/kept"), "kept after SIGTERM\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A guest with a root disk is saved once its init waits for a workload (the disk found,
/// not mounted); each restore mounts the image as it is then, reads what was there and
/// writes what the host finds afterwards, and a later restore sees the earlier one's
/// writes. A restore onto an image whose partition table changed, given read-only, or
/// with another number of disks is refused with the reason before the guest runs.
#[test]
fn a_guest_with_a_root_disk_is_snapshotted_and_restored_onto_its_image() {
    require_kvm();
    let dir = scratch("snapshot");
    let root = dir.join("root.img");
    ext4_image(
        &root,
        16,
        &["cat", "sync"],
        &[("hello.txt", "there before the snapshot\n")],
    );
    let snap = dir.join("snap");
    let run = hvprobe(
        &[
            "snapshot",
            "create",
            "--out",
            snap.to_str().unwrap(),
            "--disk",
            root.to_str().unwrap(),
            "--root",
            "/dev/vda",
        ],
        common::SNAPSHOT_BOOT_TIMEOUT,
    );
    assert_eq!(run.code, Some(0), "snapshot create with a disk\n{}", run.tail());

    // The snapshot's own image, at the path it saved.
    let first = common::restore_with(
        &snap,
        1,
        "cat /hello.txt; echo 'written after a restore' > /after; sync",
        &[],
        QUICK,
    );
    assert_eq!(first.code, Some(0), "{}", first.tail());
    common::assert_guest_healthy(&first, &[]);
    let opened = format!(
        "hvprobe: the snapshot's disk /dev/vda: {} (read-write)",
        std::path::absolute(&root).unwrap().display()
    );
    assert!(first.stderr.contains(&opened), "{opened:?}\n{}", first.tail());
    assert!(first.console_has_line("there before the snapshot"), "{}", first.tail());
    assert_eq!(debugfs_cat(&root, "/after"), "written after a restore\n");

    // Again from the same snapshot, the image given: the first restore's writes are there.
    let second = common::restore_with(&snap, 1, "cat /after", &["--disk", root.to_str().unwrap()], QUICK);
    assert_eq!(second.code, Some(0), "{}", second.tail());
    assert!(second.console_has_line("written after a restore"), "{}", second.tail());

    // Refused before the guest runs, each with its reason.
    let other = dir.join("other.img");
    std::fs::copy(&root, &other).unwrap();
    let mut mbr = std::fs::read(&other).unwrap();
    mbr[446 + 4] = 0x83;
    mbr[510..512].copy_from_slice(&[0x55, 0xaa]);
    std::fs::write(&other, &mbr).unwrap();
    let ro = format!("{},ro", root.display());
    let (root_s, other_s) = (root.to_str().unwrap(), other.to_str().unwrap());
    for (extra, message) in [
        (
            vec!["--disk", other_s],
            format!("disk image {other_s} is not the one the snapshot saw: its partition table differs"),
        ),
        (
            vec!["--disk", ro.as_str()],
            format!("disk image {root_s} is attached read-only; the snapshot's disk was read-write"),
        ),
        (
            vec!["--disk", root_s, "--disk", other_s],
            "the snapshot has 1 disk(s) and 2 were given".into(),
        ),
    ] {
        let run = common::restore_with(&snap, 1, "echo RAN", &extra, QUICK);
        assert_ne!(run.code, Some(0), "{extra:?} was restored\n{}", run.tail());
        assert!(
            run.stderr.contains(&message),
            "{extra:?}: expected {message:?}\n{}",
            run.tail()
        );
        assert!(!run.console_has_line("RAN"), "{}", run.tail());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every bad disk argument is refused with its reason, before a boot.
#[test]
fn bad_disks_are_refused_before_boot_with_their_reason() {
    let dir = scratch("bad");
    let empty = dir.join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let odd = dir.join("odd.img");
    std::fs::write(&odd, vec![0u8; 1000]).unwrap();
    let good = dir.join("good.img");
    std::fs::write(&good, vec![0u8; 4096]).unwrap();
    let missing = dir.join("missing.img");
    let (dir_s, empty_s, odd_s, good_s, missing_s) = (
        dir.to_str().unwrap(),
        empty.to_str().unwrap(),
        odd.to_str().unwrap(),
        good.to_str().unwrap(),
        missing.to_str().unwrap(),
    );
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--disk", missing_s],
            format!("disk image {missing_s}: No such file or directory"),
        ),
        (
            vec!["--disk", dir_s],
            format!("disk image {dir_s} is a directory, not a disk image"),
        ),
        (vec!["--disk", empty_s], format!("disk image {empty_s} is empty")),
        (
            vec!["--disk", odd_s],
            format!("disk image {odd_s} is 1000 bytes, not a whole number of 512-byte sectors"),
        ),
        (
            vec!["--disk", good_s, "--disk", good_s],
            format!("disk image {good_s} is given twice"),
        ),
        (
            vec!["--disk", good_s, "--root", "/dev/vdb"],
            "--root /dev/vdb: not a disk of this guest; the disks are /dev/vda".into(),
        ),
        (
            vec!["--root", "/dev/vda"],
            "the following required arguments were not provided".into(),
        ),
    ];
    for (args, message) in cases {
        common::assert_refused_before_boot(&args, &message);
    }

    // An image another program holds (another hvprobe would hold it the same way).
    let held = std::fs::File::open(&good).unwrap();
    // SAFETY: flock on a descriptor this test owns; released when `held` is closed.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX) }, 0);
    let run = hvprobe(&["run", "--workload", "true", "--disk", good_s], QUICK);
    assert!(
        run.stderr
            .contains(&format!("disk image {good_s} is in use by another program")),
        "{}",
        run.tail()
    );
    drop(held);

    // A snapshot's disks are checked before its boot like a run's.
    let out = dir.join("snap");
    let run = hvprobe(
        &["snapshot", "create", "--out", out.to_str().unwrap(), "--disk", odd_s],
        QUICK,
    );
    let message = format!("disk image {odd_s} is 1000 bytes, not a whole number of 512-byte sectors");
    assert!(run.code != Some(0) && run.stderr.contains(&message), "{}", run.tail());
    assert!(!out.join("state").exists(), "a snapshot was written");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A guest whose writes fail on the host (its image is a sparse 64 MiB file on a 1 MiB
/// tmpfs, so each `pwritev` past the first MiB fails with ENOSPC) gets IOERR for each, and
/// the host's warnings stay within the rate limit: ten per five seconds, then one line
/// saying how many were left out, not one per failed request (a guest filled
/// the terminal that way). The tmpfs is mounted in a mount namespace of hvprobe's own
/// (`unshare --mount --map-root-user`: no root needed, nothing left mounted).
#[test]
fn a_guests_failing_writes_do_not_flood_the_hosts_log() {
    require_kvm();
    let dir = scratch("flood");
    let workload = "dd if=/dev/zero of=/dev/vda bs=1M count=16 2>&1; sync; sleep 6; \
                    dd if=/dev/zero of=/dev/vda bs=4k count=1 seek=5000 conv=fsync 2>&1; echo FLOOD-DONE";
    let output = Command::new("unshare")
        .args(["--mount", "--map-root-user", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs \"$1\" && truncate -s 64M \"$1/flood.img\" && shift && exec \"$@\"")
        .arg("sh")
        .arg(&dir)
        .arg(common::hvprobe_bin())
        .args([
            "run",
            "--disk",
            &format!("{}/flood.img", dir.display()),
            "--workload",
            workload,
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("unshare (util-linux) runs hvprobe in a mount namespace of its own");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(stdout.contains("FLOOD-DONE"), "{stdout}\n{stderr}");
    let failed_requests = stdout.matches("I/O error").count();
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a log that is not a terminal:\n{stderr}"
    );
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("virtio-blk")).collect();
    assert!(
        !warnings.is_empty(),
        "the failed writes left no warning ({failed_requests} I/O errors in the guest):\n{stderr}"
    );
    // Each message is limited on its own: per message, at most ten in each five-second
    // window, and a window starts at the first line written after the last one ended, so
    // lines spanning S seconds fill at most S/5 + 1 windows. Whether any line is left out
    // (and counted in the next one) depends on how fast this host lets the guest fail
    // requests: a loaded host gave one every 3 s, under the limit. The counting itself is
    // vmm's `log_limit` unit test.
    let mut by_message: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for line in &warnings {
        let message = if line.contains("fsync") { "fsync" } else { "transfer" };
        by_message.entry(message).or_default().push(log_seconds(line));
    }
    for (message, stamps) in by_message {
        let span = stamps.last().unwrap() - stamps.first().unwrap();
        let windows = (span / 5.0).floor() as usize + 1;
        assert!(
            stamps.len() <= 10 * windows,
            "{} {message} warnings in {span:.1} s ({failed_requests} I/O errors in the guest):\n{stderr}",
            stamps.len()
        );
    }
}

/// The seconds of the day a log line was written (its RFC 3339 stamp, first on the line).
fn log_seconds(line: &str) -> f64 {
    let time = line
        .split_whitespace()
        .next()
        .and_then(|stamp| stamp.split('T').nth(1))
        .and_then(|t| t.strip_suffix('Z'))
        .unwrap_or_else(|| panic!("no time stamp on {line:?}"));
    time.split(':')
        .map(|part| {
            part.parse::<f64>()
                .unwrap_or_else(|_| panic!("a bad time stamp on {line:?}"))
        })
        .fold(0.0, |seconds, part| seconds * 60.0 + part)
}
