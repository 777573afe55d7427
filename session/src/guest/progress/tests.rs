//! The build-log parser on an excerpt of a real full build's log (`guest/build.sh` on
//! Linux 6.1.192, cold object directory), the progress line, and following a log that
//! grows and is emptied.

use std::sync::mpsc;

use super::*;

const SRC: &str = "/root/.cache/hvprobe/src/linux-source-6.1_6.1.192-2_047ed95c7fa0";
const OBJ: &str = "/root/.cache/hvprobe/obj/linux-source-6.1_6.1.192-2_047ed95c7fa0";

/// The log of a full build, cut down: the configuration (which compiles fixdep), then the
/// kernel's make with 8 compile or link lines among others, then the script's next step.
fn full_build_log() -> String {
    format!(
        "+ tar -xf /usr/src/linux-source-6.1.tar.xz -C {SRC}.tmp --strip-components=1
+ patch -p1 --dry-run < /work/main/guest/kernel/patches/0001-x86-mm-fault.patch
checking file arch/x86/mm/fault.c
+ make -C {SRC} O={OBJ} ARCH=x86_64 -j2 tinyconfig
make: Entering directory '{SRC}'
make[1]: Entering directory '{OBJ}'
  GEN     Makefile
  HOSTCC  scripts/basic/fixdep
  HOSTCC  scripts/kconfig/conf.o
  HOSTLD  scripts/kconfig/conf
#
# configuration written to .config
#
+ {SRC}/scripts/kconfig/merge_config.sh -m -O {OBJ} {OBJ}/.config /work/main/guest/kernel/config.fragment
Merging /work/main/guest/kernel/config.fragment
+ make -C {SRC} O={OBJ} ARCH=x86_64 -j2 olddefconfig
.config:1261:warning: override: HZ_100 changes choice state
+ make -C {SRC} O={OBJ} ARCH=x86_64 -j2 vmlinux bzImage
make: Entering directory '{SRC}'
make[1]: Entering directory '{OBJ}'
  SYNC    include/config/auto.conf.cmd
  WRAP    arch/x86/include/generated/uapi/asm/errno.h
  HOSTCC  arch/x86/tools/relocs_32.o
  HOSTLD  arch/x86/tools/relocs
  CC      init/main.o
  AS      arch/x86/entry/entry_64.o
  AR      init/built-in.a
  LD      {OBJ}/tools/objtool/objtool-in.o
  CC      kernel/fork.o
  CC      mm/slub.o
  BTF     .btf.vmlinux.bin.o
  LD      vmlinux
  OBJCOPY arch/x86/boot/vmlinux.bin
  BUILD   arch/x86/boot/bzImage
Kernel: arch/x86/boot/bzImage is ready  (#1)
make[1]: Leaving directory '{OBJ}'
+ objcopy --strip-debug {OBJ}/vmlinux /root/.cache/hvprobe/guest/.tmp-3eaa3d6cfec8efe3.DoQ9r0/out/vmlinux
+ musl-gcc -static -Os -Wall -Wextra -o /tmp/bin/hvprobe-init /work/main/guest/init/hvprobe-init.c
  CC      not/the/kernel.o
"
    )
}

#[test]
fn a_full_build_counts_the_kernels_compile_and_link_lines_only() {
    let mut p = KbuildProgress::new();
    p.feed(full_build_log().as_bytes());
    assert_eq!(p.phase(), Phase::After);
    assert_eq!(
        p.compiled(),
        8,
        "HOSTCC HOSTLD CC AS LD CC CC LD, nothing after the make"
    );
    assert!(p.cold_tree(), "the configuration compiled fixdep");
    assert_eq!(p.total(Some(837)), Some(837));
}

#[test]
fn a_build_in_a_used_object_directory_has_no_total() {
    let log: String = full_build_log()
        .lines()
        .filter(|l| !l.contains("HOSTCC  scripts/") && !l.contains("HOSTLD  scripts/"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut p = KbuildProgress::new();
    p.feed(log.as_bytes());
    assert!(!p.cold_tree());
    assert_eq!(
        p.total(Some(837)),
        None,
        "an incremental build compiles an unknown part"
    );
    assert_eq!(p.compiled(), 8);
}

#[test]
fn lines_split_anywhere_are_read_whole() {
    let log = full_build_log();
    for cut in [1, 7, 64, 1000] {
        let mut p = KbuildProgress::new();
        for chunk in log.as_bytes().chunks(cut) {
            p.feed(chunk);
        }
        assert_eq!(
            (p.phase(), p.compiled(), p.cold_tree()),
            (Phase::After, 8, true),
            "chunks of {cut}"
        );
    }
    // Mid-make: the line being written is not counted until it ends.
    let mut p = KbuildProgress::new();
    let upto = log.find("  CC      kernel/fork.o").unwrap();
    p.feed(&log.as_bytes()[..upto + 5]);
    assert_eq!((p.phase(), p.compiled()), (Phase::Kernel, 5));
    p.feed(&log.as_bytes()[upto + 5..upto + 24]);
    assert_eq!(p.compiled(), 6);
}

#[test]
fn the_progress_line() {
    let t = Duration::from_secs(130);
    assert_eq!(
        progress_line(412, Some(837), t),
        "hvprobe-guest: building kernel: 412/837 files compiled (49 %), 2m10s"
    );
    assert_eq!(
        progress_line(412, None, Duration::from_secs(25)),
        "hvprobe-guest: building kernel: 412 files compiled, 25s"
    );
    assert_eq!(
        progress_line(900, Some(837), t),
        "hvprobe-guest: building kernel: 900 files compiled (the last full build compiled 837), 2m10s"
    );
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvprobe-progress-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_follower_reads_what_is_added_and_starts_over_when_the_log_is_emptied() {
    let dir = scratch_dir("follow");
    let path = dir.join("build.log");
    let mut f = LogFollower::new(path.clone());
    f.poll();
    assert_eq!(f.progress.phase(), Phase::Before, "no log yet");
    let log = full_build_log();
    let half = log.find("  CC      kernel/fork.o").unwrap();
    std::fs::write(&path, &log[..half]).unwrap();
    f.poll();
    assert_eq!((f.progress.phase(), f.progress.compiled()), (Phase::Kernel, 5));
    std::fs::write(&path, &log).unwrap();
    f.poll();
    assert_eq!((f.progress.phase(), f.progress.compiled()), (Phase::After, 8));
    // The next build empties it (`: >"$LOG"`) and starts again.
    std::fs::write(
        &path,
        "+ make -C x O=y ARCH=x86_64 -j2 vmlinux bzImage\n  CC      a.o\n",
    )
    .unwrap();
    f.poll();
    assert_eq!((f.progress.phase(), f.progress.compiled()), (Phase::Kernel, 1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn follow_prints_while_the_kernel_builds_and_a_full_builds_count_is_kept_for_the_next() {
    let dir = scratch_dir("keep");
    let log = full_build_log();
    let half = log.find("  CC      kernel/fork.o").unwrap();
    std::fs::write(dir.join("build.log"), &log[..half]).unwrap();
    std::fs::write(dir.join("kernel-build-files"), "10\n").unwrap();
    let (tx, rx) = mpsc::channel();
    let (lines_tx, lines_rx) = mpsc::channel();
    let follower = {
        let dir = dir.clone();
        std::thread::spawn(move || {
            follow(&dir, &rx, Duration::from_millis(10), &mut |line| {
                let _ = lines_tx.send(line);
            })
        })
    };
    let first = lines_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        first.starts_with("hvprobe-guest: building kernel: 5/10 files compiled (50 %), "),
        "{first}"
    );
    // The make ends: no more lines.
    std::fs::write(dir.join("build.log"), &log).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    while lines_rx.try_recv().is_ok() {}
    std::thread::sleep(Duration::from_millis(700));
    assert!(lines_rx.try_recv().is_err(), "a line after the kernel was built");
    tx.send(()).unwrap();
    let progress = follower.join().unwrap();
    assert_eq!((progress.phase(), progress.compiled()), (Phase::After, 8));
    keep_total(&dir, &progress);
    assert_eq!(read_total(&dir), Some(8));
    // An incremental build's count is not a total.
    let mut incremental = KbuildProgress::new();
    incremental.feed(b"+ make -C x O=y ARCH=x86_64 -j2 vmlinux bzImage\n  CC      a.o\n+ objcopy\n");
    keep_total(&dir, &incremental);
    assert_eq!(read_total(&dir), Some(8));
    std::fs::remove_dir_all(&dir).unwrap();
}
