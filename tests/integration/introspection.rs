//! Introspection of a live guest from the host: symbols from every source against the
//! guest's own /proc/kallsyms under KASLR, the current task, and bad symbol input.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{bundled_guest_dir, hvprobe, require_kvm, Run};

const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// A dozen symbols of different kinds: entry text, plain functions, init code, rodata,
/// data and bss.
const SYMBOLS: [&str; 12] = [
    "entry_SYSCALL_64",
    "vfs_read",
    "vfs_write",
    "do_sys_open",
    "schedule",
    "kernel_clone",
    "__x64_sys_getppid",
    "start_kernel",
    "linux_banner",
    "init_task",
    "jiffies_64",
    "saved_command_line",
];

/// `SYM = 0xADDR (source)` lines hvprobe printed, by source.
fn resolved(run: &Run) -> HashMap<String, HashMap<String, u64>> {
    let mut by_source: HashMap<String, HashMap<String, u64>> = HashMap::new();
    for line in run.stderr.lines() {
        let Some((sym, rest)) = line.split_once(" = 0x") else {
            continue;
        };
        let Some((addr, source)) = rest.split_once(" (") else {
            continue;
        };
        let addr = u64::from_str_radix(addr, 16).expect("hex address");
        by_source
            .entry(source.trim_end_matches(')').to_string())
            .or_default()
            .insert(sym.to_string(), addr);
    }
    by_source
}

/// On a restore of the KASLR snapshot (the probes' and stacks' tests restore it too), so
/// no boot: each source is loaded from the restored memory, the files checked against it.
#[test]
fn under_kaslr_every_symbol_source_agrees_with_the_guests_own_kallsyms() {
    require_kvm();
    let dir = common::kaslr_snapshot(1);
    let mut args = vec![
        "--symbols",
        "system-map",
        "--symbols",
        "vmlinux",
        "--symbols",
        "kallsyms",
    ];
    for s in SYMBOLS {
        args.extend(["--resolve", s]);
    }
    let pattern = format!("grep -wE '{}' /proc/kallsyms", SYMBOLS.join("|"));
    let run = common::restore_with(&dir, 1, &pattern, &args, BOOT_TIMEOUT);
    assert_eq!(run.code, Some(0), "{}", run.tail());

    let mut guest: HashMap<String, u64> = HashMap::new();
    for line in run.stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [addr, _kind, name] = f[..] {
            if let Ok(addr) = u64::from_str_radix(addr, 16) {
                guest.entry(name.to_string()).or_insert(addr);
            }
        }
    }
    for s in SYMBOLS {
        assert!(
            guest.contains_key(s),
            "the guest's /proc/kallsyms has no {s}\n{}",
            run.tail()
        );
    }
    let by_source = resolved(&run);
    for source in ["system-map", "vmlinux", "kallsyms"] {
        let ours = by_source
            .get(source)
            .unwrap_or_else(|| panic!("no answers from {source}\n{}", run.tail()));
        for s in SYMBOLS {
            assert_eq!(
                ours.get(s),
                guest.get(s),
                "{s} from {source} differs from the guest's /proc/kallsyms\n{}",
                run.tail()
            );
        }
    }
    // KASLR really moved the kernel, and every source saw the same slide.
    let slides: Vec<&str> = run.stderr.lines().filter(|l| l.contains("KASLR slide")).collect();
    assert_eq!(slides.len(), 3, "{}", run.tail());
    let values: Vec<&str> = slides.iter().map(|l| l.rsplit(' ').next().unwrap()).collect();
    assert!(values.iter().all(|v| *v == values[0]), "slides differ: {slides:?}");
    common::assert_randomized(&run);
}

/// A restored guest sampled from the host (a boot's sampling: the boot suite's one-vCPU
/// test).
#[test]
fn the_current_task_read_from_guest_memory_is_the_spinning_workload() {
    require_kvm();
    let dir = common::snapshot(1);
    let run = common::restore_with(&dir, 1, "hvprobe-spin 8", &["--sample-ms", "100"], BOOT_TIMEOUT);
    assert_eq!(run.code, Some(0), "{}", run.tail());
    let pid = run
        .stdout
        .lines()
        .find_map(|l| l.trim_end_matches('\r').strip_prefix("hvprobe-spin pid="))
        .unwrap_or_else(|| panic!("the workload did not report its pid\n{}", run.tail()));
    let tasks = run
        .stderr
        .split("user-mode samples; tasks:")
        .nth(1)
        .unwrap_or_else(|| panic!("no task report\n{}", run.tail()));
    let top = tasks.lines().nth(1).unwrap_or_default();
    assert!(
        top.ends_with(&format!("hvprobe-spin (pid {pid})")),
        "top user task is {top:?}, not hvprobe-spin pid {pid}\n{}",
        run.tail()
    );
}

/// On a restore (a boot checks its files with the same code, once its kernel is up).
#[test]
fn a_system_map_of_another_kernel_is_detected_and_refused() {
    require_kvm();
    let dir = common::snapshot(1);
    let guest = bundled_guest_dir();
    let map = std::fs::read_to_string(guest.join("System.map")).unwrap();
    // Another build of "the same" kernel: its syscall entry is where ours is, the data
    // behind it is laid out differently.
    let other: String = map
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match (f.first().map(|a| u64::from_str_radix(a, 16)), f.get(1), f.get(2)) {
                (Some(Ok(addr)), Some(kind), Some(name))
                    if kind.eq_ignore_ascii_case("d") || kind.eq_ignore_ascii_case("r") =>
                {
                    format!("{:016x} {kind} {name}\n", addr + 0x2040)
                }
                _ => format!("{l}\n"),
            }
        })
        .collect();
    let path = std::env::temp_dir().join(format!("hvprobe-other-{}.map", std::process::id()));
    std::fs::write(&path, other).unwrap();
    let map = path.to_str().unwrap();
    // Named as a source, and given alone (the default source then, as on a boot).
    for args in [
        &["--symbols", "system-map", "--system-map", map, "--resolve", "vfs_read"][..],
        &["--system-map", map, "--resolve", "vfs_read"][..],
    ] {
        let run = common::restore_with(&dir, 1, "true", args, BOOT_TIMEOUT);
        assert_eq!(run.code, Some(1), "{args:?}\n{}", run.tail());
        assert!(
            run.stderr.contains("does not match the running kernel"),
            "{args:?}\n{}",
            run.tail()
        );
        assert!(
            !run.stderr.contains("vfs_read = 0x"),
            "a mismatched map was used\n{}",
            run.tail()
        );
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn offline_symbols_resolve_describe_and_reject_bad_names() {
    let guest = bundled_guest_dir();
    let vmlinux = guest.join("vmlinux");
    let map = std::fs::read_to_string(guest.join("System.map")).unwrap();
    let vfs_read = map
        .lines()
        .find(|l| l.ends_with(" vfs_read"))
        .expect("vfs_read in System.map");
    let addr = u64::from_str_radix(vfs_read.split(' ').next().unwrap(), 16).unwrap();

    let run = hvprobe(
        &[
            "symbols",
            "--vmlinux",
            vmlinux.to_str().unwrap(),
            "vfs_read",
            "vfs_read+0x10",
            &format!("{:#x}", addr + 3),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.tail());
    assert!(run.stdout.contains(&format!("vfs_read = {addr:#x}")), "{}", run.tail());
    assert!(
        run.stdout.contains(&format!("vfs_read+0x10 = {:#x}", addr + 0x10)),
        "{}",
        run.tail()
    );
    assert!(run.stdout.contains("= vfs_read+0x3/"), "{}", run.tail());

    let unknown = hvprobe(
        &["symbols", "--vmlinux", vmlinux.to_str().unwrap(), "no_such_symbol_here"],
        Duration::from_secs(60),
    );
    assert_eq!(unknown.code, Some(1), "{}", unknown.tail());
    assert!(unknown.stderr.contains("no_such_symbol_here"), "{}", unknown.tail());

    for bad in ["vfs_read+zz", "vfs_read+", "+0x10", "vfs read"] {
        let run = hvprobe(
            &["symbols", "--vmlinux", vmlinux.to_str().unwrap(), bad],
            Duration::from_secs(60),
        );
        assert_eq!(run.code, Some(1), "{bad:?}\n{}", run.tail());
        assert!(run.stderr.contains("hvprobe: error:"), "{bad:?}\n{}", run.tail());
        assert!(!run.stderr.contains("panicked"), "{bad:?}\n{}", run.tail());
    }
    // A malformed --resolve is refused before anything boots.
    let run = hvprobe(
        &["run", "--resolve", "vfs_read+zz", "--workload", "true"],
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("vfs_read+zz"), "{}", run.tail());
    assert!(!run.stderr.contains("KVM backend"), "it booted anyway\n{}", run.tail());
    let run = hvprobe(
        &[
            "run",
            "--snapshot",
            "/nonexistent",
            "--resolve",
            "vfs_read+zz",
            "--workload",
            "true",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(1), "{}", run.tail());
    assert!(run.stderr.contains("vfs_read+zz"), "a restore's too\n{}", run.tail());
}
