//! `hvprobe bench io`: what a virtio-blk disk gives the guest, beside what the host
//! itself gets from the same image file in the same run.
//!
//! The guest (the bundled one, one disk) runs `hvprobe-io` (guest/workloads) with
//! O_DIRECT, so its page cache is out of the way: sequential 1 MiB reads and writes
//! (then fdatasync) and 4 KiB reads at pseudo-random offsets, each timed in the guest.
//! The host then does the same to the same file the way the device does (buffered
//! `pread`/`pwrite` through its page cache, `fdatasync` at the end): the device's limit.
//! Before each phase the guest writes a marker to the event port, so the VM exits that
//! reached hvprobe are counted per phase (queue kicks go through an ioeventfd and
//! completions through an irqfd, so a request should cost none).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hvprobe_arch::Gva;
use hvprobe_session::machine::{initrd_with_workload, Machine, MachineFiles};
use hvprobe_vmm::{
    BreakpointDisposition, ConsoleOutput, DebugHandler, DiskConfig, GuestEvent, StopReason, VcpuControl, Vm, VmConfig,
};
use kvm_ioctls::VcpuFd;

use crate::cli::IoBenchArgs;
use crate::cmd::CliResult;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
/// The event-port bytes the workload writes before each phase and at the end.
const FIRST_MARK: u8 = 10;
const PHASES: [&str; 3] = ["read", "write", "randread"];

#[derive(Debug, thiserror::Error)]
pub enum IoBenchError {
    #[error("--size-mib must be at least 1 and --randreads at least 1")]
    Arguments,
    #[error("the bench image {path}: {source}")]
    Image { path: PathBuf, source: std::io::Error },
    #[error("the guest did not finish the benchmark ({reason}); console tail:\n{tail}")]
    Guest { reason: StopReason, tail: String },
    #[error("the guest printed no result for {phase}; console tail:\n{tail}")]
    NoResult { phase: &'static str, tail: String },
    #[error("cannot run QEMU {path}: {source}")]
    QemuSpawn { path: PathBuf, source: std::io::Error },
    #[error("QEMU did not finish the benchmark within {seconds} s; its console's tail:\n{tail}")]
    QemuTimeout { seconds: u64, tail: String },
    #[error("QEMU printed no result for {phase} ({status}); its output's tail:\n{tail}")]
    QemuNoResult {
        phase: &'static str,
        status: std::process::ExitStatus,
        tail: String,
    },
}

/// One phase's numbers: bytes, requests, microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Measured {
    bytes: u64,
    requests: u64,
    micros: u64,
}

impl Measured {
    fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / self.micros.max(1) as f64
    }

    fn iops(&self) -> f64 {
        self.requests as f64 * 1e6 / self.micros.max(1) as f64
    }
}

/// `hvprobe-io MODE BYTES bytes REQUESTS requests MICROS us` of `phase` in the console.
fn guest_result(console: &str, phase: &str) -> Option<Measured> {
    console.lines().find_map(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["hvprobe-io", mode, bytes, "bytes", requests, "requests", micros, "us"] if *mode == phase => {
                Some(Measured {
                    bytes: bytes.parse().ok()?,
                    requests: requests.parse().ok()?,
                    micros: micros.parse().ok()?,
                })
            }
            _ => None,
        }
    })
}

/// The userspace exit count at each phase marker.
struct PhaseMarks {
    control: Arc<VcpuControl>,
    exits_at: Mutex<Vec<(u8, u64)>>,
}

impl DebugHandler for PhaseMarks {
    fn on_breakpoint(&self, _cpu: usize, _vcpu: &mut VcpuFd, _at: Gva) -> BreakpointDisposition {
        BreakpointDisposition::GuestOwned
    }

    fn on_guest_event(&self, _cpu: usize, event: GuestEvent) {
        if let GuestEvent::Other(mark) = event {
            let exits = self.control.counters.exits.load(Ordering::Relaxed);
            self.exits_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((mark, exits));
        }
    }

    fn wants_breakpoints(&self) -> bool {
        false
    }
}

/// The guest's workload: a marker, then a phase, for each phase.
fn workload(size_mib: u64, randreads: u64) -> String {
    let mark = |n: u8| {
        format!(
            "printf '\\{:03o}' | dd of=/dev/port bs=1 seek={} 2>/dev/null",
            n,
            hvprobe_vmm::GUEST_EVENT_PORT
        )
    };
    let phases = [
        format!("hvprobe-io read /dev/vda {size_mib}"),
        format!("hvprobe-io write /dev/vda {size_mib}"),
        format!("hvprobe-io randread /dev/vda {randreads}"),
    ];
    let mut script = String::new();
    for (i, phase) in phases.iter().enumerate() {
        script.push_str(&format!("{}; {phase} || exit 1; ", mark(FIRST_MARK + i as u8)));
    }
    script.push_str(&mark(FIRST_MARK + phases.len() as u8));
    script
}

/// `hvprobe bench io`.
pub fn bench(args: IoBenchArgs) -> CliResult {
    if args.size_mib == 0 || args.randreads == 0 {
        return Err(IoBenchError::Arguments.into());
    }
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => hvprobe_session::cache::cache_dir()
            .ok_or(hvprobe_session::guest::GuestError::NoCache)?
            .join("bench-io"),
    };
    std::fs::create_dir_all(&dir).map_err(|source| IoBenchError::Image {
        path: dir.clone(),
        source,
    })?;
    let image = dir.join(format!("bench-{}.img", std::process::id()));
    let result = bench_on(&image, &args);
    let _ = std::fs::remove_file(&image);
    result
}

fn bench_on(image: &Path, args: &IoBenchArgs) -> CliResult {
    let image_err = |source| IoBenchError::Image {
        path: image.to_path_buf(),
        source,
    };
    // Pseudo-random contents: nothing below the device (a sparse file, a compressing
    // filesystem) can answer reads without reading.
    {
        let mut file = File::create(image).map_err(image_err)?;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut chunk = vec![0u8; MIB as usize];
        for _ in 0..args.size_mib {
            for word in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                word.copy_from_slice(&x.to_le_bytes());
            }
            file.write_all(&chunk).map_err(image_err)?;
        }
        file.sync_all().map_err(image_err)?;
    }
    let mut machine = Machine::bundled_guest(args.cpus);
    machine.disks = vec![DiskConfig {
        path: image.to_path_buf(),
        read_only: false,
    }];
    let files = MachineFiles::of(&machine, false)?;
    let initrd = initrd_with_workload(&files, Some(&workload(args.size_mib, args.randreads)))?;
    let config = VmConfig {
        kernel: files.kernel.clone(),
        initrd: initrd.clone(),
        cmdline: files.cmdline.clone(),
        cpus: args.cpus,
        mem_mib: machine.mem,
        console_output: ConsoleOutput::Discard,
        console_input: false,
        disks: machine.disks.clone(),
        shares: Vec::new(),
    };
    eprintln!(
        "hvprobe: booting the bundled guest with a {} MiB disk at {}",
        args.size_mib,
        image.display()
    );
    let vm = Vm::new(&config)?;
    let console = vm.console_log();
    let marks = Arc::new(PhaseMarks {
        control: vm.control(),
        exits_at: Mutex::new(Vec::new()),
    });
    let outcome = vm.run(Arc::clone(&marks) as Arc<dyn DebugHandler>)?;
    if outcome.reason != StopReason::GuestExit(0) {
        return Err(IoBenchError::Guest {
            reason: outcome.reason,
            tail: console.tail(30),
        }
        .into());
    }
    let text = console.contents();
    let mut guest = Vec::new();
    for phase in PHASES {
        guest.push(guest_result(&text, phase).ok_or_else(|| IoBenchError::NoResult {
            phase,
            tail: console.tail(30),
        })?);
    }
    let exits_at = marks.exits_at.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let exits_in = |phase: usize| -> Option<u64> {
        let at = |mark: u8| exits_at.iter().find(|(m, _)| *m == mark).map(|(_, e)| *e);
        let start = at(FIRST_MARK + phase as u8)?;
        let end = at(FIRST_MARK + phase as u8 + 1)?;
        end.checked_sub(start)
    };
    let qemu = match &args.qemu {
        Some(path) => {
            eprintln!("hvprobe: the same guest in QEMU ({})", path.display());
            let qemu_run = QemuRun {
                qemu: path,
                kernel: &files.kernel,
                initrd: &initrd,
                cmdline: &files.cmdline,
                cpus: args.cpus,
                mem_mib: machine.mem,
                image,
            };
            Some(qemu_run.phases()?)
        }
        None => None,
    };
    eprintln!("hvprobe: the same on the host, on the same file");
    let host = host_phases(image, args.size_mib, args.randreads).map_err(image_err)?;

    println!(
        "io benchmark: bundled guest, {} vCPU(s), virtio-blk on a {} MiB raw image in {}",
        args.cpus,
        args.size_mib,
        image
            .parent()
            .map(Path::display)
            .map(|d| d.to_string())
            .unwrap_or_default()
    );
    println!("guest: O_DIRECT in the guest (hvprobe-io); host: buffered pread/pwrite of the image, as the device does");
    if qemu.is_some() {
        println!(
            "qemu: the same guest in QEMU's microvm with KVM, the image as virtio-blk (cache=writeback: buffered)"
        );
    }
    let value = |m: Measured, phase: &str| if phase == "randread" { m.iops() } else { m.mb_per_s() };
    let ratio = |a: f64, b: f64| a / b.max(f64::MIN_POSITIVE);
    print!("{:<10} {:>14} {:>14} {:>8}", "phase", "guest", "host", "ratio");
    if qemu.is_some() {
        print!(" {:>14} {:>8}", "qemu", "vs qemu");
    }
    println!(" {:>15}", "exits/request");
    for (i, phase) in PHASES.iter().enumerate() {
        let unit = if *phase == "randread" { "IOPS" } else { "MB/s" };
        let (gv, hv) = (value(guest[i], phase), value(host[i], phase));
        let per_request = exits_in(i)
            .map(|e| format!("{:.2}", e as f64 / guest[i].requests.max(1) as f64))
            .unwrap_or_else(|| "?".into());
        print!(
            "{:<10} {:>9.1} {unit} {:>9.1} {unit} {:>7.3}x",
            phase,
            gv,
            hv,
            ratio(gv, hv)
        );
        if let Some(q) = &qemu {
            let qv = value(q[i], phase);
            print!(" {:>9.1} {unit} {:>7.3}x", qv, ratio(gv, qv));
        }
        println!(" {:>15}", per_request);
    }
    println!(
        "run: {} exits reached hvprobe, {} guest instructions emulated (boot included), boot to /init {:.1} s",
        outcome.exits,
        outcome.instructions_emulated,
        outcome.boot_to_init.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN)
    );
    Ok(std::process::ExitCode::SUCCESS)
}

/// The benchmark's guest in QEMU: the same kernel, initrd (workload included), command
/// line, vCPUs, memory and image, on QEMU's microvm machine with KVM; its serial console
/// is QEMU's stdout and the init's exit port an `isa-debug-exit` device.
struct QemuRun<'a> {
    qemu: &'a Path,
    kernel: &'a Path,
    initrd: &'a [u8],
    cmdline: &'a str,
    cpus: u8,
    mem_mib: u64,
    image: &'a Path,
}

/// The longest QEMU's run may take.
const QEMU_LIMIT: std::time::Duration = std::time::Duration::from_secs(900);

impl QemuRun<'_> {
    /// The arguments: microvm without ACPI, so QEMU announces its virtio-mmio devices on
    /// the command line as hvprobe does; no default devices, no firmware menu.
    fn args(&self, initrd: &Path) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        let mut push = |a: &str| args.push(a.into());
        for a in [
            "-machine",
            "microvm,acpi=off,rtc=on,isa-serial=on,pic=on,pit=on",
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
            "-device",
            "isa-debug-exit,iobase=0xef1,iosize=1",
            "-device",
            "virtio-blk-device,drive=d0",
        ] {
            push(a);
        }
        push("-smp");
        push(&self.cpus.to_string());
        push("-m");
        push(&format!("{}M", self.mem_mib));
        push("-append");
        push(self.cmdline);
        args.push("-kernel".into());
        args.push(self.kernel.into());
        args.push("-initrd".into());
        args.push(initrd.into());
        // QEMU's option syntax: a comma in a value is written twice.
        let mut drive = std::ffi::OsString::from("id=d0,if=none,format=raw,cache=writeback,file=");
        drive.push(self.image.to_string_lossy().replace(',', ",,"));
        args.push("-drive".into());
        args.push(drive);
        args
    }

    fn phases(&self) -> Result<[Measured; 3], IoBenchError> {
        let initrd = self.image.with_extension("qemu-initrd");
        std::fs::write(&initrd, self.initrd).map_err(|source| IoBenchError::Image {
            path: initrd.clone(),
            source,
        })?;
        let result = self.run(&initrd);
        let _ = std::fs::remove_file(&initrd);
        result
    }

    fn run(&self, initrd: &Path) -> Result<[Measured; 3], IoBenchError> {
        let spawn_err = |source| IoBenchError::QemuSpawn {
            path: self.qemu.to_path_buf(),
            source,
        };
        let mut child = std::process::Command::new(self.qemu)
            .args(self.args(initrd))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = Vec::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_end(&mut text);
                }
                String::from_utf8_lossy(&text).into_owned()
            })
        };
        let stdout = read(
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        );
        let stderr = read(
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        );
        let deadline = Instant::now() + QEMU_LIMIT;
        let status = loop {
            match child.try_wait().map_err(spawn_err)? {
                Some(status) => break Some(status),
                None if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                None => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
        };
        let output = format!(
            "{}{}",
            stdout.join().unwrap_or_default(),
            stderr.join().unwrap_or_default()
        );
        let tail = || {
            let lines: Vec<&str> = output.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        let Some(status) = status else {
            return Err(IoBenchError::QemuTimeout {
                seconds: QEMU_LIMIT.as_secs(),
                tail: tail(),
            });
        };
        let mut phases = Vec::new();
        for phase in PHASES {
            phases.push(guest_result(&output, phase).ok_or_else(|| IoBenchError::QemuNoResult {
                phase,
                status,
                tail: tail(),
            })?);
        }
        Ok([phases[0], phases[1], phases[2]])
    }
}

/// The host's own read, write and random-read of `image`, as the device does them.
fn host_phases(image: &Path, size_mib: u64, randreads: u64) -> std::io::Result<[Measured; 3]> {
    let file = OpenOptions::new().read(true).write(true).open(image)?;
    let mut buffer = vec![0u8; MIB as usize];
    let timed = |f: &mut dyn FnMut() -> std::io::Result<()>| -> std::io::Result<u64> {
        let start = Instant::now();
        f()?;
        Ok(start.elapsed().as_micros() as u64)
    };
    let read = timed(&mut || {
        for i in 0..size_mib {
            file.read_exact_at(&mut buffer, i * MIB)?;
        }
        Ok(())
    })?;
    let pattern = vec![0xa5u8; MIB as usize];
    let write = timed(&mut || {
        for i in 0..size_mib {
            file.write_all_at(&pattern, i * MIB)?;
        }
        file.sync_data()
    })?;
    let blocks = size_mib * MIB / BLOCK;
    let mut x: u64 = 88_172_645_463_325_252;
    let mut block = vec![0u8; BLOCK as usize];
    let randread = timed(&mut || {
        for _ in 0..randreads {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            file.read_exact_at(&mut block, (x % blocks) * BLOCK)?;
        }
        Ok(())
    })?;
    let bytes = size_mib * MIB;
    Ok([
        Measured {
            bytes,
            requests: size_mib,
            micros: read,
        },
        Measured {
            bytes,
            requests: size_mib,
            micros: write,
        },
        Measured {
            bytes: randreads * BLOCK,
            requests: randreads,
            micros: randread,
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guests_result_lines_are_read_by_phase() {
        let console = "noise\nhvprobe-io read 4194304 bytes 4 requests 105 us\r\nhvprobe-io randread 409600 bytes 100 requests 2843 us\n";
        assert_eq!(
            guest_result(console, "read"),
            Some(Measured {
                bytes: 4 << 20,
                requests: 4,
                micros: 105
            })
        );
        assert_eq!(guest_result(console, "randread").unwrap().requests, 100);
        assert_eq!(guest_result(console, "write"), None);
        assert_eq!(guest_result("hvprobe-io error open -2\n", "read"), None);
    }

    #[test]
    fn qemu_runs_the_same_guest_on_microvm_with_kvm_and_the_image_buffered() {
        let run = QemuRun {
            qemu: Path::new("/q/qemu-system-x86_64"),
            kernel: Path::new("/g/vmlinux"),
            initrd: b"",
            cmdline: "console=ttyS0 pci=off",
            cpus: 2,
            mem_mib: 128,
            image: Path::new("/b/bench,1.img"),
        };
        let args: Vec<String> = run
            .args(Path::new("/b/bench.qemu-initrd"))
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let after = |flag: &str| {
            let at = args
                .iter()
                .position(|a| a == flag)
                .unwrap_or_else(|| panic!("no {flag}: {args:?}"));
            args[at + 1].clone()
        };
        assert!(after("-machine").starts_with("microvm,acpi=off"), "{args:?}");
        assert_eq!(after("-accel"), "kvm");
        assert_eq!(after("-smp"), "2");
        assert_eq!(after("-m"), "128M");
        assert_eq!(after("-append"), "console=ttyS0 pci=off");
        assert_eq!(after("-kernel"), "/g/vmlinux");
        assert_eq!(after("-initrd"), "/b/bench.qemu-initrd");
        assert_eq!(
            after("-drive"),
            "id=d0,if=none,format=raw,cache=writeback,file=/b/bench,,1.img"
        );
        assert!(args.contains(&"isa-debug-exit,iobase=0xef1,iosize=1".to_string()));
        assert!(args.contains(&"virtio-blk-device,drive=d0".to_string()));
    }

    #[test]
    fn the_workload_marks_each_phase_on_the_event_port() {
        let w = workload(8, 100);
        assert!(w.contains("printf '\\012' | dd of=/dev/port bs=1 seek=3824"), "{w}");
        assert!(w.contains("hvprobe-io read /dev/vda 8 || exit 1; ") && w.contains("hvprobe-io randread /dev/vda 100"));
        assert!(
            w.ends_with("printf '\\015' | dd of=/dev/port bs=1 seek=3824 2>/dev/null"),
            "{w}"
        );
    }
}
