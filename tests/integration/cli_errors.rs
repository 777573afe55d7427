//! Bad input to `hvprobe run` gives a clear error and a non-zero exit, never a panic.

use crate::common;

use std::time::Duration;

use common::{hvprobe, Run};

const QUICK: Duration = Duration::from_secs(60);

fn assert_clean_error(args: &[&str], expected: &str) {
    let run = hvprobe(args, QUICK);
    assert_eq!(run.code, Some(1), "{args:?}\n{}", run.tail());
    assert!(
        run.stderr.contains("hvprobe: error:"),
        "{args:?}: no error line\n{}",
        run.tail()
    );
    assert!(
        run.stderr.contains(expected),
        "{args:?}: error does not say {expected:?}\n{}",
        run.tail()
    );
    assert!(!run.stderr.contains("panicked"), "{args:?} panicked\n{}", run.tail());
}

#[test]
fn missing_kernel_file_is_named() {
    assert_clean_error(
        &["run", "--kernel", "/nonexistent/vmlinux"],
        "cannot read kernel /nonexistent/vmlinux",
    );
}

#[test]
fn a_file_that_is_not_a_kernel_is_refused_with_the_reason() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    assert_clean_error(&["run", "--kernel", manifest], "neither an ELF vmlinux nor a bzImage");
}

#[test]
fn an_empty_file_is_not_a_kernel() {
    let dir = std::env::temp_dir().join(format!("hvprobe-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("vmlinux");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_error(&["run", "--kernel", empty.to_str().unwrap()], "the file is empty");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// KASLR is the bundled bzImage's: for a kernel of one's own, its command line decides.
/// One error for a boot and for a snapshot's boot, before either starts.
#[test]
fn kaslr_with_a_kernel_of_ones_own_is_refused_for_run_and_snapshot_create() {
    // A kernel this VMM boots (a file that is none is refused for that first).
    let kernel = common::bundled_guest_dir().join("vmlinux");
    let kernel = kernel.to_str().unwrap();
    let out = std::env::temp_dir().join(format!("hvprobe-kaslr-refused-{}", std::process::id()));
    for args in [
        vec!["run", "--kaslr", "--kernel", kernel, "--workload", "true"],
        vec![
            "snapshot",
            "create",
            "--kaslr",
            "--kernel",
            kernel,
            "--out",
            out.to_str().unwrap(),
        ],
    ] {
        assert_clean_error(&args, "--kaslr boots the bundled guest's bzImage");
    }
    assert!(!out.exists(), "no snapshot directory was made");
}

#[test]
fn zero_vcpus_is_refused() {
    assert_clean_error(&["run", "--cpus", "0"], "0 vCPUs requested: 1 to 32 are supported");
}

#[test]
fn too_many_vcpus_is_refused() {
    assert_clean_error(&["run", "--cpus", "33"], "33 vCPUs requested");
}

#[test]
fn one_mib_of_memory_is_refused() {
    assert_clean_error(
        &["run", "--mem", "1"],
        "1 MiB of guest memory requested: 32 to 65536 MiB are supported",
    );
}

#[test]
fn missing_initrd_is_named() {
    assert_clean_error(
        &["run", "--initrd", "/nonexistent/initrd.cpio"],
        "cannot read initrd /nonexistent/initrd.cpio",
    );
}

#[test]
fn malformed_numbers_are_usage_errors() {
    let run = hvprobe(&["run", "--cpus", "two"], QUICK);
    assert_eq!(run.code, Some(2), "{}", run.tail());
    assert!(run.stderr.contains("invalid value 'two'"), "{}", run.tail());
}

/// `run --snapshot` of a directory that does not exist, with `flag value`: what is refused
/// before the restore is refused before the snapshot is read.
fn restore_of_no_snapshot_with(flag: &str, value: &str) -> Run {
    hvprobe(
        &[
            "run",
            "--snapshot",
            "/nonexistent/snapshot",
            "--workload",
            "true",
            flag,
            value,
        ],
        QUICK,
    )
}

/// A snapshot fixes the machine and the kernel: the flags that would choose them are
/// refused with `--snapshot` (they were silently ignored), before anything is restored.
/// (`--vmlinux` and `--system-map` are not among them: with a snapshot they name the
/// restored kernel's files, for source lines and `--symbols`.)
#[test]
fn flags_a_snapshot_fixes_are_refused_with_it() {
    for (flag, value) in [
        ("--mem", "256"),
        ("--cmdline", "quiet"),
        ("--kernel", "/boot/vmlinuz"),
        ("--rootfs", "/"),
    ] {
        let run = restore_of_no_snapshot_with(flag, value);
        assert_eq!(run.code, Some(2), "{flag}\n{}", run.tail());
        assert!(
            run.stderr
                .contains(&format!("'--snapshot <DIR>' cannot be used with '{flag} ")),
            "{flag}\n{}",
            run.tail()
        );
    }
}

/// The files a restore's symbols would come from are checked before anything is restored
/// (a `--system-map` alone was once taken and never read).
#[test]
fn a_restores_missing_symbol_file_is_refused_before_the_restore() {
    for flag in ["--system-map", "--vmlinux"] {
        let run = restore_of_no_snapshot_with(flag, "/nonexistent/symbols");
        assert_eq!(run.code, Some(1), "{flag}\n{}", run.tail());
        assert!(
            run.stderr.contains("cannot read /nonexistent/symbols"),
            "{flag}\n{}",
            run.tail()
        );
    }
}

#[test]
fn a_virtiofsd_without_a_share_to_serve_is_refused() {
    let run = hvprobe(&["run", "--virtiofsd", "/bin/true", "--workload", "true"], QUICK);
    assert_eq!(run.code, Some(2), "{}", run.tail());
    assert!(
        run.stderr.contains("--rootfs <DIR>") && run.stderr.contains("--rwdir"),
        "the error does not name the shares --virtiofsd would serve\n{}",
        run.tail()
    );
}

/// A `--modules` that is not a module tree, or a tree without a driver the devices need,
/// is refused before the boot, naming what is missing; `--modules` needs `--kernel`.
#[test]
fn a_module_tree_that_cannot_serve_the_devices_is_refused_before_the_boot() {
    let guest = common::bundled_guest_dir();
    let kernel = guest.join("bzImage");
    let kernel = kernel.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("hvprobe-modules-{}", std::process::id()));
    let tree = dir.join("lib/modules/6.1.0-test");
    std::fs::create_dir_all(&tree).unwrap();
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let disk = disk.to_str().unwrap();
    let tree_arg = tree.to_str().unwrap();
    assert_clean_error(
        &[
            "run",
            "--kernel",
            kernel,
            "--modules",
            tree_arg,
            "--disk",
            disk,
            "--workload",
            "true",
        ],
        &format!("--modules {tree_arg}: not a kernel's module tree (no modules.dep)"),
    );
    std::fs::write(tree.join("modules.dep"), "kernel/drivers/virtio/virtio.ko:\n").unwrap();
    std::fs::write(tree.join("modules.builtin"), "kernel/drivers/virtio/virtio_mmio.ko\n").unwrap();
    assert_clean_error(
        &["run", "--kernel", kernel, "--modules", tree_arg, "--disk", disk, "--workload", "true"],
        &format!(
            "the kernel's module tree {tree_arg} has no virtio_blk (neither built in nor a module): this kernel cannot serve --disk"
        ),
    );
    let run = hvprobe(&["run", "--modules", tree_arg, "--workload", "true"], QUICK);
    assert_eq!(run.code, Some(2), "{}", run.tail());
    assert!(run.stderr.contains("--kernel <FILE>"), "{}", run.tail());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `snapshot create --cached` is the bundled guest's snapshot as it boots by default: a
/// flag that would make another machine, or a directory of one's own, is refused with it
/// before anything boots; and one of `--out` or `--cached` is needed.
#[test]
fn flags_a_cached_snapshot_cannot_have_are_refused_with_it() {
    for (flag, value) in [
        ("--out", "/tmp/hvprobe-cached-refused"),
        ("--mem", "256"),
        ("--cmdline", "quiet"),
        ("--kernel", "/boot/vmlinuz"),
        ("--disk", "/nonexistent.img"),
    ] {
        let run = hvprobe(&["snapshot", "create", "--cached", flag, value], QUICK);
        assert_eq!(run.code, Some(2), "{flag}\n{}", run.tail());
        assert!(
            run.stderr.contains("'--cached' cannot be used with") && run.stderr.contains(flag),
            "{flag}\n{}",
            run.tail()
        );
    }
    let run = hvprobe(&["snapshot", "create"], QUICK);
    assert_eq!(run.code, Some(2), "{}", run.tail());
    assert!(run.stderr.contains("--out <DIR>"), "{}", run.tail());
}
