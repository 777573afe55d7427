//! Running the `hvprobe` binary from integration tests.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What one `hvprobe` invocation did.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// The end of both streams, for assertion messages.
    pub fn tail(&self) -> String {
        self.tail_of(("stdout (guest console)", 40), ("stderr", 20))
    }

    /// The exit code and the last lines of each stream, each under its name: `(name,
    /// lines)` for stdout, then for stderr.
    pub fn tail_of(&self, stdout: (&str, usize), stderr: (&str, usize)) -> String {
        let last = |s: &str, n: usize| {
            let lines: Vec<&str> = s.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        // hvprobe's own lines (its errors, why the guest stopped, the summary) wherever
        // they are: a failure's console tail can push them out of the last lines.
        let own: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| l.starts_with("hvprobe: ") && !l.starts_with("hvprobe: control socket"))
            .take(20)
            .collect();
        format!(
            "exit code {:?}\n--- {}, last {} lines ---\n{}\n--- {}, last {} lines ---\n{}\n--- hvprobe's own lines ---\n{}",
            self.code,
            stdout.0,
            stdout.1,
            last(&self.stdout, stdout.1),
            stderr.0,
            stderr.1,
            last(&self.stderr, stderr.1),
            own.join("\n")
        )
    }

    /// Whether the guest console shows a line equal to `line`.
    pub fn console_has_line(&self, line: &str) -> bool {
        self.stdout.lines().any(|l| l.trim_end_matches('\r') == line)
    }
}

/// The `hvprobe` binary the tests run: this build's, or `$HVPROBE_TEST_BIN` when it is set
/// (the nested-SVM lane runs its jobs with the release build, where TCG emulates hvprobe's
/// own code too: tests/hardware_lane.rs).
pub fn hvprobe_bin() -> PathBuf {
    match std::env::var_os("HVPROBE_TEST_BIN") {
        Some(bin) if !bin.is_empty() => PathBuf::from(bin),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_hvprobe")),
    }
}

/// How long a run stopped at its deadline by SIGTERM has to stop cleanly (and say where
/// its vCPUs were) before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(20);

/// Stops a run that outlived its deadline: SIGTERM first, on which hvprobe says where each
/// vCPU was (so the failure shows where the guest hung), then SIGKILL if it has not ended
/// [`STOP_GRACE`] later. Waits for it either way.
pub fn stop_at_deadline(child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: kill(2) on our own child's pid, not yet waited for (try_wait above saw it
    // running, and only this function waits for it now); no memory involved.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let grace = Instant::now() + STOP_GRACE;
    while Instant::now() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `hvprobe ARGS`; after `timeout` stops it with SIGTERM (it then says where each
/// vCPU was: the failure shows where the guest hung), and kills it [`STOP_GRACE`] later.
pub fn hvprobe(args: &[&str], timeout: Duration) -> Run {
    let mut child = Command::new(hvprobe_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvprobe");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for hvprobe") {
            break Some(status);
        }
        if Instant::now() > deadline {
            stop_at_deadline(&mut child);
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let run = Run {
        code: status.and_then(|s| s.code()),
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    };
    assert!(
        status.is_some(),
        "hvprobe {args:?} did not finish within {timeout:?}\n{}",
        run.tail()
    );
    run
}

/// Fails with a clear message when this machine has no usable KVM.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        panic!("this test boots a guest and needs /dev/kvm, which cannot be opened: {e}");
    }
}

/// A boot of the bundled guest with a workload, however loaded the host.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(600);
/// What fails before a boot (and before a guest build): a bad argument.
pub const QUICK: Duration = Duration::from_secs(120);

/// An empty scratch directory for test `name` of suite `suite`, this process's own.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvprobe-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A probe file holding `text` in the temporary directory, named after `name` and this
/// process (a name each test of the binary keeps to itself).
pub fn probe_file(name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("hvprobe-test-{}-{name}.probes", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

/// `hvprobe run --workload true ARGS` fails with `message` on stderr, and boots nothing.
pub fn assert_refused_before_boot(args: &[&str], message: &str) {
    let mut all = vec!["run", "--workload", "true"];
    all.extend(args);
    let run = hvprobe(&all, QUICK);
    assert_ne!(run.code, Some(0), "{args:?} was taken");
    assert!(
        run.stderr.contains(message),
        "{args:?}: wanted {message:?}\n{}",
        run.tail()
    );
    assert!(!run.stderr.contains("boot to /init"), "{args:?} booted");
}

/// Creating a snapshot boots the guest once (about a minute on kvm_pvm).
pub const SNAPSHOT_BOOT_TIMEOUT: Duration = Duration::from_secs(420);

/// The checkout's root (its scripts: `guest/`, `README.md`, `docs/`).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// hvprobe's cache, as the binary and `guest/build.sh` find it.
pub fn cache_dir() -> PathBuf {
    hvprobe::guest::cache_dir().expect("HVPROBE_CACHE or HOME is set")
}

/// The bundled guest's directory (`hvprobe build-guest`, which builds it if the cache
/// lacks it).
pub fn bundled_guest_dir() -> PathBuf {
    let built = hvprobe(&["build-guest"], Duration::from_secs(1800));
    assert_eq!(built.code, Some(0), "build-guest failed\n{}", built.tail());
    PathBuf::from(
        built
            .stdout
            .lines()
            .last()
            .expect("build-guest prints its directory")
            .trim(),
    )
}

/// A function of the bundled guest's kernel as linked: its address, its code and the
/// offset of each of its instructions (what a test must not write down, since it moves
/// with the compiler and the configuration).
pub struct GuestFunction {
    pub addr: u64,
    pub code: Vec<u8>,
    pub starts: Vec<usize>,
}

impl GuestFunction {
    /// `name` in the bundled guest's vmlinux (its ELF symbol's size), and the address of
    /// every symbol it names.
    pub fn bundled(name: &str) -> (GuestFunction, hvprobe_introspection::symbols::SymbolTable) {
        use hvprobe_arch::Gva;
        use hvprobe_introspection::memory::{ElfImage, GuestVirtRead};
        use hvprobe_introspection::symbols::SymbolTable;
        let vmlinux = bundled_guest_dir().join("vmlinux");
        let image = ElfImage::open(&vmlinux).expect("the bundled vmlinux");
        let symbols = SymbolTable::parse_elf(image.file_bytes()).expect("the bundled vmlinux's symbols");
        let symbol = symbols
            .lookup(name)
            .unwrap_or_else(|| panic!("no {name} in the bundled guest"));
        let size = symbol.size.unwrap_or_else(|| panic!("{name} has no size"));
        let mut code = vec![0u8; usize::try_from(size).unwrap()];
        image.read_virt(symbol.addr, &mut code).expect("the function's code");
        let starts = hvprobe_probes::insn::instruction_starts(&code, symbol.addr)
            .unwrap_or_else(|e| panic!("{name} does not decode: {e}"))
            .into_iter()
            .map(|start: Gva| (start.0 - symbol.addr.0) as usize)
            .collect();
        let function = GuestFunction {
            addr: symbol.addr.0,
            code,
            starts,
        };
        (function, symbols)
    }

    /// The offset of the first instruction whose bytes start with `opcode` and go on with a
    /// 32-bit displacement or relative target that leads to `target` (RIP-relative: from
    /// the instruction's end).
    pub fn find_rip_relative(&self, opcode: &[u8], target: u64) -> Option<usize> {
        self.starts.iter().copied().find(|&at| {
            let end = at + opcode.len() + 4;
            self.code.get(at..end).is_some_and(|b| {
                let rel = i32::from_le_bytes(b[opcode.len()..].try_into().unwrap());
                b.starts_with(opcode) && (self.addr + end as u64).wrapping_add(rel as i64 as u64) == target
            })
        })
    }
}

/// What a guest console must never show: a kernel oops, panic, BUG or WARNING splat, a
/// fault that killed a guest process, a complaint of the guest's own ftrace.
pub const SICK_GUEST: &[&str] = &[
    "Kernel panic",
    "Oops",
    "BUG:",
    "WARNING:",
    "general protection",
    "invalid opcode",
    "segfault at",
    "traps:",
    "ftrace bug",
    "ftrace faulted",
];

/// Fails when the guest's console (the run's stdout) shows any of [`SICK_GUEST`], or of
/// `also` (what a test knows to be wrong besides).
pub fn assert_guest_healthy(run: &Run, also: &[&str]) {
    for bad in SICK_GUEST.iter().chain(also) {
        assert!(!run.stdout.contains(bad), "the guest printed {bad:?}\n{}", run.tail());
    }
}

/// The snapshot of the bundled guest with `cpus` vCPUs, created if the cache lacks it.
pub fn snapshot(cpus: u8) -> PathBuf {
    cached_snapshot(cpus, false)
}

/// The snapshot of a KASLR boot of the bundled guest with `cpus` vCPUs (`snapshot create
/// --kaslr`, whose kernel has moved), created if the cache lacks it: the tests of probes
/// and stacks under KASLR restore it instead of booting the bzImage each (a KASLR boot is
/// ~70 s on kvm_pvm, where the decompressor is emulated too), as does the introspection
/// test that compares every symbol source under KASLR.
pub fn kaslr_snapshot(cpus: u8) -> PathBuf {
    cached_snapshot(cpus, true)
}

/// `hvprobe snapshot create --cached`: the cache's snapshot, made by the first test that
/// asks (the others wait for it), as the storm and the benchmarks find it.
fn cached_snapshot(cpus: u8, kaslr: bool) -> PathBuf {
    require_kvm();
    // Built first under its own (longer) deadline, as every test that boots it does.
    bundled_guest_dir();
    let cpus = cpus.to_string();
    let mut args = vec!["snapshot", "create", "--cached", "--cpus", &cpus];
    if kaslr {
        args.push("--kaslr");
    }
    let run = hvprobe(&args, SNAPSHOT_BOOT_TIMEOUT * 3);
    assert_eq!(run.code, Some(0), "snapshot create --cached failed\n{}", run.tail());
    let dir = PathBuf::from(
        run.stdout
            .lines()
            .last()
            .expect("snapshot create --cached prints its directory")
            .trim(),
    );
    assert!(
        dir.join("state").is_file(),
        "{} has no state\n{}",
        dir.display(),
        run.tail()
    );
    dir
}

/// `hvprobe run --snapshot DIR --cpus N --workload W EXTRA...`.
pub fn restore_with(dir: &Path, cpus: u8, workload: &str, extra: &[&str], timeout: Duration) -> Run {
    let cpus = cpus.to_string();
    let mut args = vec![
        "run",
        "--snapshot",
        dir.to_str().unwrap(),
        "--cpus",
        &cpus,
        "--workload",
        workload,
    ];
    args.extend_from_slice(extra);
    hvprobe(&args, timeout)
}

fn slide_of(run: &Run) -> Option<String> {
    run.stderr
        .lines()
        .find_map(|l| l.split("KASLR slide ").nth(1))
        .map(|s| s.trim().to_owned())
}

/// Fails unless the run's summary reports a KASLR slide other than 0: the kernel was
/// randomized.
pub fn assert_randomized(run: &Run) {
    let slide = slide_of(run).unwrap_or_else(|| panic!("no slide reported\n{}", run.tail()));
    assert_ne!(slide, "0x0", "the kernel was not randomized");
}

/// `name=value` pairs after the `(location)` of a trace line, and its task and event.
pub struct TraceLine {
    pub task: String,
    pub event: String,
    pub location: String,
    pub args: BTreeMap<String, String>,
}

/// A line of the guest's `trace` file (after a `GUEST ` prefix a workload put there) or of
/// hvprobe's text output: `TASK-PID [CPU] FLAGS TIMESTAMP: EVENT: (LOCATION) NAME=VALUE...`.
pub fn parse_trace_line(line: &str) -> Option<TraceLine> {
    let line = line.trim_start_matches("GUEST ").trim();
    let (task, rest) = line.split_once(' ')?;
    let (_, rest) = rest.split_once("]")?;
    let (_, rest) = rest.split_once(": ")?;
    let (event, rest) = rest.split_once(": (")?;
    let (location, args) = rest.split_once(')')?;
    let args = args
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Some(TraceLine {
        task: task.to_string(),
        event: event.to_string(),
        location: location.to_string(),
        args,
    })
}
