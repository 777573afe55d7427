//! The command line: every clap argument type of `hvprobe` (and nothing else, so that the
//! modules that act on them depend on this one and never on each other for their flags),
//! and how each becomes the options of `hvprobe-session`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use hvprobe_functions::layout::ErrorReport;
use hvprobe_functions::stats::LatencyUnit;
use hvprobe_session::machine::Machine;
use hvprobe_session::options::{FunctionTracerKind, FunctionTracerOptions, OutputFormat};
use hvprobe_session::shares::{RootfsHide, RwDir, Sandbox};
use hvprobe_session::snapshot::SnapshotOptions;
use hvprobe_session::symbol_sources::SourceKind;

#[derive(Parser)]
#[command(
    name = "hvprobe",
    version,
    propagate_version = true,
    about = "Linux kernel probes run from outside the guest"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Subcommand)]
pub enum Commands {
    /// Boot a guest (the bundled one by default) and run it to the end.
    Run(Box<RunArgs>),
    /// Build the bundled guest (if its cache entry is missing) and print its directory.
    BuildGuest,
    /// Resolve kernel symbols offline, at link-time addresses (no KASLR slide).
    Symbols(SymbolsArgs),
    /// List what a kernel offers to trace, offline, from its vmlinux.
    List {
        #[command(subcommand)]
        command: ListCommand,
    },
    /// Show a function's source lines, numbered where a probe can go (perf probe's `-L`).
    ///
    /// Lines are numbered from the function's declaration (line 0), as a `FUNC:N` probe
    /// target counts them; a line without a number has no code of its own. Reads the
    /// kernel's DWARF (the bundled guest's by default), and its source text when the files
    /// the DWARF names exist (or under --source).
    Lines(LinesArgs),
    /// List the variables a probe can read at a source target, with their C types and
    /// where each is (perf probe's `-V`).
    ///
    /// TARGET is a spec line's source target: `FUNC:N`, `FUNC@FILE[:N]`, `FILE:LINE` or
    /// `FUNC` (its entry). A variable that cannot be read there says why.
    Vars(VarsArgs),
    /// Save a booted guest waiting for a workload, to restore it with `run --snapshot`.
    Snapshot {
        #[command(subcommand)]
        command: SnapshotCommand,
    },
    /// Add, remove, enable, disable or list probes of a running `hvprobe run` (through
    /// its control socket).
    Probe {
        #[command(subcommand)]
        command: ProbeCommand,
    },
    /// Stream the hit events of a running `hvprobe run` to this terminal until it ends.
    Trace(TraceArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Print a shell completion script for hvprobe.
    ///
    /// bash: `hvprobe completions bash > ~/.local/share/bash-completion/completions/hvprobe`;
    /// zsh: into a directory of `$fpath` as `_hvprobe`; fish: into
    /// `~/.config/fish/completions/hvprobe.fish`.
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print hvprobe's manual page (roff), made from these help texts.
    ///
    /// `hvprobe man > hvprobe.1 && man ./hvprobe.1`; `hvprobe man --out-dir DIR` writes a
    /// page per command (`hvprobe.1`, `hvprobe-run.1`, `hvprobe-probe-add.1`, …) to install
    /// under a `man1` directory of `manpath`.
    Man {
        /// Write every command's page into this directory instead of the main page to stdout.
        #[arg(long, value_name = "DIR", conflicts_with = "markdown")]
        out_dir: Option<PathBuf>,
        /// Print the command-line reference in Markdown instead (every command and flag
        /// with its help text; the project keeps it as `docs/cli.md`).
        #[arg(long)]
        markdown: bool,
    },
}

/// The guest machine a command boots: `run` and `snapshot create` share these flags (and
/// the devices a guest gets go here too).
#[derive(Args)]
#[command(group(clap::ArgGroup::new("shares").args(["rootfs", "rwdirs"]).multiple(true)))]
pub struct MachineArgs {
    /// Kernel to boot: an ELF vmlinux with a PVH note, or a bzImage [default: the bundled
    /// guest's vmlinux].
    #[arg(long, value_name = "FILE")]
    pub kernel: Option<PathBuf>,
    /// Initrd (a cpio archive) [default: the bundled guest's initramfs].
    ///
    /// A `--workload` or a snapshot needs the bundled init's protocol in it: the bundled
    /// initramfs, or one built from guest/init.
    #[arg(long, value_name = "FILE")]
    pub initrd: Option<PathBuf>,
    /// Extra kernel command-line options, appended to the ones hvprobe sets.
    #[arg(long, value_name = "OPTIONS", default_value = "")]
    pub cmdline: String,
    /// Number of vCPUs, 1 to 32 (a snapshot is restored with the number it was made with).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, value_name = "MIB", default_value_t = Machine::DEFAULT_MEM_MIB)]
    pub mem: u64,
    /// A raw disk image for the guest, as a virtio-blk disk (repeatable: /dev/vda,
    /// /dev/vdb, … in order); `,ro` attaches it read-only.
    ///
    /// The image must be a regular file (or a block device) of whole 512-byte sectors.
    /// hvprobe locks it while it runs: exclusively, or shared with other read-only users
    /// for `,ro`. A guest flush is an fsync of the image. A read-only disk fails the
    /// guest's writes with an I/O error and is never written.
    #[arg(long = "disk", value_name = "FILE[,ro]", value_parser = parse_disk)]
    pub disks: Vec<hvprobe_vmm::DiskConfig>,
    /// Run the workload (or the shell) with this disk's filesystem as `/`: /dev/vda for
    /// the first --disk.
    ///
    /// The bundled init stays PID 1 and mounts it (ext4 and the other filesystems the
    /// bundled kernel has; read-only when the disk is), with /proc, /sys, /dev, /tmp, /run
    /// and tracefs inside; the workload is the disk's own `/bin/sh -c`. Needs the bundled
    /// guest's init (the bundled initramfs, or one built from guest/init).
    #[arg(long, value_name = "/dev/vdX", requires = "disks", conflicts_with = "rootfs")]
    pub root: Option<String>,
    /// Run the workload (or the shell) with this host directory as `/`, shared by
    /// virtio-fs (virtiofsd) and never changed.
    ///
    /// virtiofsd shares it read-only, and the bundled init mounts it under an overlay
    /// whose upper layer is a tmpfs: the guest may write anywhere, its changes live in
    /// guest memory and are gone at the end; the host's files stay as they are. The
    /// directory needs a `/bin/sh`. Needs the bundled guest's init.
    #[arg(long, value_name = "DIR")]
    pub rootfs: Option<PathBuf>,
    /// A host directory the guest reads and writes, at GUESTPATH (by default the host's
    /// own path), shared by virtio-fs (repeatable).
    ///
    /// Each is its own virtiofsd and device, tagged hvprobe-rw0, hvprobe-rw1, … in order;
    /// the bundled init mounts each at GUESTPATH (inside --rootfs or --root when given),
    /// another init or a workload with `mount -t virtiofs hvprobe-rw0 DIR`. The guest's
    /// writes are the host's files, as they happen. GUESTPATH must be absolute, without
    /// spaces, commas, colons or quotes (it goes on the kernel command line).
    #[arg(long = "rwdir", value_name = "[GUESTPATH=]HOSTDIR", value_parser = parse_rwdir)]
    pub rwdirs: Vec<RwDir>,
    /// The --kernel's module tree, for the drivers --disk, --rootfs and --rwdir need when
    /// that kernel has them as modules [default: /lib/modules/RELEASE, RELEASE named by
    /// the --kernel image, when it exists].
    ///
    /// A directory as `make modules_install` or a distribution's package leaves it
    /// (modules.dep, modules.builtin and the modules): /lib/modules/RELEASE, or
    /// INSTALL_MOD_PATH/lib/modules/RELEASE of a build. hvprobe puts the drivers that are
    /// modules (virtio_mmio, virtio_blk, virtiofs, overlay and what they depend on) into
    /// the initrd, and the bundled init loads them first; a driver the kernel has neither
    /// built in nor as a module is an error before the boot. The bundled kernel needs none.
    #[arg(long, value_name = "DIR", requires = "kernel")]
    pub modules: Option<PathBuf>,
    /// The virtiofsd that serves --rootfs and --rwdir [default: $HVPROBE_VIRTIOFSD, else
    /// /usr/libexec/virtiofsd or /usr/lib/qemu/virtiofsd, else one built once into
    /// hvprobe's cache (guest/build-virtiofsd.sh, from crates.io)].
    #[arg(long, value_name = "PATH", requires = "shares")]
    pub virtiofsd: Option<PathBuf>,
    /// What of --rootfs DIR the guest does not see (repeatable): a path as the guest names
    /// it (`/` being DIR), `default` for the default list, or `none` alone to hide nothing
    /// [default: default].
    ///
    /// Each path that exists is covered, on the host side where the guest cannot undo it,
    /// by an empty directory (or an empty file): the guest, even its root mounting the
    /// share by hand, reads nothing of it. The default list is the usual secrets of a
    /// host's root (DIR may be `/`, and virtiofsd reads as hvprobe's user):
    /// /etc/shadow, /etc/shadow-, /etc/gshadow, /etc/gshadow-, /etc/security/opasswd,
    /// /etc/ssh, /etc/ssl/private, /etc/krb5.keytab, /root, /home, /var/backups, /var/mail,
    /// /var/spool, /tmp, /var/tmp, /run, and the host's /sys and /dev (the guest mounts its
    /// own). It is not every secret a host can hold: name others with `--rootfs-hide
    /// default --rootfs-hide PATH`. The host's /proc is hidden with any list but none.
    #[arg(long = "rootfs-hide", value_name = "PATH|default|none", value_parser = parse_rootfs_hide, requires = "rootfs")]
    pub rootfs_hide: Vec<RootfsHide>,
    /// How virtiofsd is isolated from the host [default: namespace].
    ///
    /// namespace: in new mount, PID and network namespaces with the shared directory as
    /// its root, and its seccomp filter; where the host does not let hvprobe make those
    /// namespaces the run is refused before the boot. none: virtiofsd runs in the host's
    /// namespaces and sees every file its user can; only its own path checks keep the
    /// guest inside the shared directory, so a bug in them, or a guest that takes the
    /// daemon over, reaches all of those files. hvprobe's own limits on the daemon (no
    /// device nodes, setuid or setgid bits, the --rootfs-hide list) hold with either.
    #[arg(long, value_enum, value_name = "HOW", requires = "shares")]
    pub share_sandbox: Option<ShareSandbox>,
}

/// How virtiofsd is isolated (`--share-sandbox`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ShareSandbox {
    /// New mount, PID and network namespaces, the shared directory as the daemon's root.
    Namespace,
    /// None: the daemon sees every host file its user can.
    None,
}

/// `PATH|default|none`: PATH absolute (the guest's), not `/` itself.
fn parse_rootfs_hide(text: &str) -> Result<RootfsHide, String> {
    match text {
        "default" => Ok(RootfsHide::Default),
        "none" => Ok(RootfsHide::Nothing),
        _ if !text.starts_with('/') => Err(format!(
            "{text:?} is not an absolute path (a path as the guest names it, / being --rootfs DIR), \
             nor default or none"
        )),
        _ if text.trim_end_matches('/').is_empty() => {
            Err("hiding / would hide all of --rootfs DIR: run without --rootfs instead".into())
        }
        _ => Ok(RootfsHide::Path(PathBuf::from(text))),
    }
}

/// `[GUESTPATH=]HOSTDIR`: the first `=` ends GUESTPATH (a host path with an `=` in it
/// needs a GUESTPATH= before it). The paths are checked later, with the other devices.
fn parse_rwdir(text: &str) -> Result<RwDir, String> {
    let (guest_path, host_dir) = match text.split_once('=') {
        Some((guest, host)) => (Some(guest.to_owned()), host),
        None => (None, text),
    };
    if host_dir.is_empty() {
        return Err("no host directory (the form is [GUESTPATH=]HOSTDIR)".into());
    }
    if guest_path.as_deref() == Some("") {
        return Err("no guest path before the = (the form is [GUESTPATH=]HOSTDIR)".into());
    }
    Ok(RwDir {
        arg: text.to_owned(),
        guest_path,
        host_dir: PathBuf::from(host_dir),
    })
}

/// `FILE[,ro]`: a `,ro` at the end makes the disk read-only; anything else is the path.
fn parse_disk(text: &str) -> Result<hvprobe_vmm::DiskConfig, String> {
    let (path, read_only) = match text.strip_suffix(",ro") {
        Some(path) => (path, true),
        None => (text, false),
    };
    if path.is_empty() {
        return Err("no image path before ,ro".into());
    }
    Ok(hvprobe_vmm::DiskConfig {
        path: PathBuf::from(path),
        read_only,
    })
}

impl From<ShareSandbox> for Sandbox {
    fn from(arg: ShareSandbox) -> Self {
        match arg {
            ShareSandbox::Namespace => Sandbox::Namespace,
            ShareSandbox::None => Sandbox::None,
        }
    }
}

impl From<&MachineArgs> for Machine {
    fn from(args: &MachineArgs) -> Self {
        Machine {
            kernel: args.kernel.clone(),
            initrd: args.initrd.clone(),
            cmdline: args.cmdline.clone(),
            cpus: args.cpus,
            mem: args.mem,
            disks: args.disks.clone(),
            root: args.root.clone(),
            rootfs: args.rootfs.clone(),
            rwdirs: args.rwdirs.clone(),
            modules: args.modules.clone(),
            virtiofsd: args.virtiofsd.clone(),
            rootfs_hide: args.rootfs_hide.clone(),
            share_sandbox: args.share_sandbox.map(Sandbox::from),
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Shell command the guest runs instead of an interactive shell; hvprobe exits with its status.
    #[arg(long)]
    pub workload: Option<String>,
    /// Boot the bundled guest's bzImage with KASLR on (a PVH boot is never randomized).
    #[arg(long)]
    pub kaslr: bool,
    /// Print `SYM = 0xADDRESS (source)` for SYM[+OFFSET] once the guest kernel is up (repeatable).
    #[arg(long, value_name = "SYM")]
    pub resolve: Vec<String>,
    /// Where kernel symbols come from (repeatable: --resolve then prints each source's answer)
    /// [default: System.map if there is one, else the vmlinux, else the guest's kallsyms; with
    /// --snapshot, the restored kernel's kallsyms].
    #[arg(long = "symbols", value_enum, value_name = "SOURCE")]
    pub symbol_sources: Vec<SourceArg>,
    /// System.map of the kernel [default: the bundled guest's]. With --snapshot it must be
    /// the restored kernel's, and is then the default source of its symbols.
    #[arg(long)]
    pub system_map: Option<PathBuf>,
    /// The kernel's vmlinux ELF, for symbols and, with its DWARF, for probes on source lines
    /// [default: the bundled guest's, or --kernel if it is an ELF].
    ///
    /// With --snapshot it serves the source lines (and symbols with --symbols vmlinux), and
    /// must be the restored kernel's [default: the bundled guest's].
    #[arg(long, value_name = "FILE")]
    pub vmlinux: Option<PathBuf>,
    /// A module's .ko with its DWARF, for probes on its source lines (`MOD:FUNC:N`,
    /// `MOD:FUNC@FILE`, `MOD:FILE:LINE`: perf probe's `-m`), refused when built for another
    /// kernel; repeatable [the bundled guest's test module is always known].
    #[arg(long, value_name = "FILE.ko")]
    pub module_debuginfo: Vec<PathBuf>,
    /// Sample every vCPU's instruction pointer this often (ms) and print the hottest guest
    /// functions at exit.
    #[arg(long, value_name = "MS")]
    pub sample_ms: Option<u64>,
    /// Probes to arm, in the kernel's kprobe_events syntax (one per line: `p[:[GRP/]EVENT]
    /// SYM[+OFFS]|MOD:SYM[+OFFS]|ADDR [FETCHARGS]`, `-:[GRP/]EVENT`, `#` comments; a module's
    /// probe waits for the module to load), and watches on the
    /// debug registers (`w[:[GRP/]EVENT] SYM[+OFFS]|ADDR[/LEN][:w|rw|x] [FETCHARGS]`, at most
    /// four; data watches need hardware KVM). A booted guest gets
    /// them when it reaches /init; a restored one before it runs. Hits are printed on stdout,
    /// the listing (debugfs `list` layout, plus hits and nmissed) on stderr at exit and on SIGUSR1.
    #[arg(long, value_name = "FILE")]
    pub probes: Option<PathBuf>,
    #[command(flatten)]
    pub functions: FunctionTracerArgs,
    #[command(flatten)]
    pub output: HitOutputs,
    /// The clock hits are stamped with, as ftrace's trace_clock file chooses one: `local`
    /// (alias `guest`) is the guest's own trace clock (its `sched_clock()`, computed on the
    /// host from its kvm-clock), so that hits merge by time with the guest's trace file;
    /// `global` (alias `dmesg`) its `local_clock()`, which its dmesg prints; `host` is host
    /// time since the probe engine started. Text output prints it as SECS.USECS, JSON as
    /// `timestamp_ns`.
    #[arg(long, value_enum, default_value_t = ClockArg::Local)]
    pub clock: ClockArg,
    /// An event filter of --probes FILE's events, in ftrace's filter syntax (what one
    /// writes to events/GRP/EVENT/filter): `GRP/EVENT:EXPR`, e.g. `io/read:count > 4096 &&
    /// comm ~ "sh*"`. Hits it discards are counted (`filtered=` in the listing).
    #[arg(long, value_name = "GRP/EVENT:FILTER")]
    pub filter: Vec<String>,
    /// A trigger on one of --probes FILE's events, in ftrace's syntax (what one writes to
    /// events/GRP/EVENT/trigger), repeatable: `GRP/EVENT:hist:keys=KEY[.MOD],...[:vals=...]
    /// [:sort=...][:size=N] [if FILTER]`. The histograms are printed at the end and on
    /// SIGUSR1, in the hist file's layout.
    #[arg(long, value_name = "GRP/EVENT:TRIGGER")]
    pub trigger: Vec<String>,
    /// Print the frames of kernel stacks (the `stacktrace` trigger) as `func+0xoff/0xsize`
    /// (ftrace's `sym-offset` trace option), not by name alone.
    #[arg(long)]
    pub sym_offset: bool,
    /// Where to put the control socket through which `hvprobe probe` and `hvprobe trace`
    /// steer the run from other terminals [default: $XDG_RUNTIME_DIR/hvprobe/PID.sock, or
    /// /tmp/hvprobe-UID/PID.sock]. Only the user who started the run can connect.
    #[arg(long, value_name = "PATH", conflicts_with = "no_control")]
    pub control: Option<PathBuf>,
    /// Run without a control socket.
    #[arg(long)]
    pub no_control: bool,
    /// Jump-optimize probes: on, off (every probe stays on its int3), or auto.
    ///
    /// On puts a 5-byte jump to a detour on every probe that can take one (Linux's
    /// optimized kprobes; an event detour records a hit in the guest with no exit, a sync
    /// detour costs one exit whatever the instruction). Auto is the backend's default: on
    /// for hardware KVM, off for kvm_pvm, where the detour's instructions are emulated too.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = OptimizeMode::Auto)]
    pub optimize: OptimizeMode,
    /// Feed stdin to the guest's serial console also with --workload (a workload reads it
    /// from /dev/ttyS0); on a terminal this puts it in raw mode.
    #[arg(long)]
    pub console_input: bool,
    /// Do not print the guest's console on stdout (probe hits still are): for a guest
    /// that floods it. Its last lines still appear in error messages.
    #[arg(long, conflicts_with = "console_input")]
    pub no_console: bool,
    /// At exit (after every probe is removed), print the SHA-256 of the guest kernel's text.
    #[arg(long)]
    pub text_hash: bool,
    /// Restore the guest from a snapshot directory (`hvprobe snapshot create`) instead of
    /// booting.
    ///
    /// Needs --workload, and --cpus equal to the snapshot's. The snapshot fixes the
    /// machine and the kernel, so the flags that choose them are refused with it. Its
    /// symbols come from the restored kernel's kallsyms unless --symbols names other
    /// sources (a file-based one is the bundled guest's file unless --system-map or
    /// --vmlinux gives it, and must match the restored kernel). A snapshot with disks takes its
    /// images again: every --disk in its order, or none for the paths it saved; each must
    /// be the image the snapshot saw (its size, `,ro`, and its partition table).
    #[arg(long, value_name = "DIR", conflicts_with_all = [
        "kernel", "initrd", "cmdline", "mem", "kaslr", "root", "rootfs", "rwdirs", "virtiofsd",
    ])]
    pub snapshot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceArg {
    SystemMap,
    Vmlinux,
    Kallsyms,
}

impl From<SourceArg> for SourceKind {
    fn from(arg: SourceArg) -> Self {
        match arg {
            SourceArg::SystemMap => SourceKind::SystemMap,
            SourceArg::Vmlinux => SourceKind::Vmlinux,
            SourceArg::Kallsyms => SourceKind::Kallsyms,
        }
    }
}

#[derive(Args)]
pub struct SymbolsArgs {
    /// The kernel's vmlinux ELF.
    #[arg(long, value_name = "FILE")]
    pub vmlinux: PathBuf,
    /// Use this System.map instead of the vmlinux's symbol table.
    #[arg(long)]
    pub system_map: Option<PathBuf>,
    /// SYM, SYM+OFFSET, or a hex address (0x...) to describe as SYM+OFF/SIZE.
    #[arg(required = true)]
    pub names: Vec<String>,
}

/// Where `lines` and `vars` read the kernel's DWARF.
#[derive(Args)]
pub struct DwarfArgs {
    /// The kernel's vmlinux ELF (symbols, ORC) [default: the bundled guest's].
    #[arg(long, value_name = "FILE")]
    pub vmlinux: Option<PathBuf>,
    /// The file with its DWARF [default: the vmlinux itself; for the bundled guest its
    /// vmlinux.debug].
    #[arg(long, value_name = "FILE")]
    pub debuginfo: Option<PathBuf>,
    /// A module's .ko with its DWARF, for `MOD:FUNC…` (perf probe's `-m`); repeatable
    /// [the bundled guest's test module is always known].
    #[arg(long, value_name = "FILE.ko")]
    pub module_debuginfo: Vec<PathBuf>,
}

#[derive(Args)]
pub struct LinesArgs {
    /// FUNC or FUNC@FILE.
    pub function: String,
    /// The kernel's source tree, where the DWARF's file names are not found as they are.
    #[arg(long, value_name = "DIR")]
    pub source: Option<PathBuf>,
    #[command(flatten)]
    pub dwarf: DwarfArgs,
}

#[derive(Args)]
pub struct VarsArgs {
    /// FUNC, FUNC:N, FUNC@FILE[:N] or FILE:LINE.
    pub target: String,
    #[command(flatten)]
    pub dwarf: DwarfArgs,
}

#[derive(Subcommand)]
pub enum ListCommand {
    /// The kernel's traceable functions, as its ftrace `available_filter_functions` file
    /// lists them: the same names, in the same order, as many.
    ///
    /// Read from the vmlinux's `__mcount_loc` table less what the kernel drops at boot (init
    /// code); a replaced weak function's record is listed as the kernel lists it,
    /// `__ftrace_invalid_address___OFFSET`, and is never traced. These are the functions
    /// `run --tracer` can trace. Module functions are not listed.
    Functions(ListFunctionsArgs),
}

#[derive(Args)]
pub struct ListFunctionsArgs {
    /// Only the functions whose name matches this glob (`*`, `?`, `{a,b}`, as
    /// --ftrace-filter takes them).
    pub glob: Option<String>,
    /// The kernel's vmlinux ELF [default: the bundled guest's].
    #[arg(long, value_name = "FILE")]
    pub vmlinux: Option<PathBuf>,
    /// Print `ADDRESS NAME` (the link-time address of each function's ftrace call site),
    /// as `available_filter_functions_addrs` does.
    #[arg(long)]
    pub addresses: bool,
}

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Boot the guest until its init waits for a workload, then save it to a directory.
    Create(CreateArgs),
}

#[derive(Args)]
pub struct CreateArgs {
    /// Directory to write the snapshot to (created if needed; `state` and `memory` in it).
    #[arg(long, value_name = "DIR", required_unless_present = "cached")]
    pub out: Option<PathBuf>,
    /// Keep the snapshot in hvprobe's cache and print its directory: the snapshot of the
    /// bundled guest with --cpus vCPUs (and --kaslr), for this backend, made by the first
    /// call (one at a time; the others wait) and reused by the next ones without a boot.
    /// Only of the bundled guest as it boots by default.
    #[arg(long, conflicts_with_all = [
        "out", "kernel", "initrd", "cmdline", "mem", "disks", "root", "rootfs", "rwdirs",
    ])]
    pub cached: bool,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Boot the bundled guest's bzImage with KASLR on: every restore of the snapshot has the
    /// kernel where this boot put it (restores name its symbols from its kallsyms). A boot
    /// that KASLR leaves at the kernel's link address (about 1 in 500) is made again, at
    /// most three times: the snapshot's kernel has moved.
    #[arg(long)]
    pub kaslr: bool,
}

impl From<&CreateArgs> for SnapshotOptions {
    fn from(args: &CreateArgs) -> Self {
        SnapshotOptions {
            machine: Machine::from(&args.machine),
            kaslr: args.kaslr,
        }
    }
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cold boot of the bundled guest against restores of its snapshot.
    Snapshot(SnapshotBenchArgs),
    /// Disk throughput and IOPS in the guest (virtio-blk) beside the host's own on the
    /// same image file.
    Io(IoBenchArgs),
    /// What a probe hit costs: the int3 floor, emulated and stepped hits, against the
    /// guest's own kprobe event.
    Probes(ProbeBenchArgs),
    /// How long arming and disarming N probes takes on a running guest.
    Arm(ArmBenchArgs),
    /// The function tracers: arming and removing N functions' probes (up to every
    /// function) on a running guest, and what a traced call costs the guest (exits and
    /// emulated instructions per call, entry only and entry + return) beside the guest's
    /// own function_graph tracer on the same calls.
    Functions(FunctionsBenchArgs),
    /// How fast the host drains the event rings, with a producer filling them as fast as
    /// it can.
    Drain(DrainBenchArgs),
    /// What event filters and hist triggers cost the host per hit (no guest).
    Filter(FilterBenchArgs),
}

#[derive(Args)]
pub struct DrainBenchArgs {
    /// Rings (guest CPUs).
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Records per ring (a power of two).
    #[arg(long, default_value_t = 4096)]
    pub capacity: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Runs per variant (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: u32,
}

#[derive(Args)]
pub struct FilterBenchArgs {
    /// Hits per run.
    #[arg(long, default_value_t = 1_000_000)]
    pub hits: u32,
    /// Runs per variant (the median is reported, with the range).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
}

#[derive(Args)]
pub struct FunctionsBenchArgs {
    /// Function counts to arm, comma-separated (`all`: every function the tracer takes).
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,all")]
    pub counts: Vec<String>,
    /// Rounds per count (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: u32,
    /// Number of vCPUs (the snapshot's).
    #[arg(long, default_value_t = 2)]
    pub cpus: u8,
    /// A snapshot of the bundled guest with that many vCPUs [default: the cached one].
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
    /// getppid() calls per run of the per-call part (each configuration runs with N and
    /// 2N calls: the difference, over N, is one call's cost without the fixed costs).
    #[arg(long, value_name = "N", default_value_t = 2000)]
    pub calls: u32,
    /// Skip the per-call part (it restores the guest eight times; the guest's own tracer
    /// takes about a minute a run on kvm_pvm).
    #[arg(long)]
    pub no_per_call: bool,
}

#[derive(Args)]
pub struct ArmBenchArgs {
    /// Probe counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    pub counts: Vec<usize>,
    /// Rounds per count (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: u32,
    /// Number of vCPUs (the snapshot's).
    #[arg(long, default_value_t = 2)]
    pub cpus: u8,
    /// A snapshot of the bundled guest with that many vCPUs; without it the benchmark
    /// restores the cached one (`snapshot create --cached`), made by one boot if missing.
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
    /// Keep the guest allocating meanwhile: a loop that fills a shell variable of MIB
    /// over and over (page faults and allocations while probes come and go) beside the
    /// read loops. On kvm_pvm one 32 MiB fill takes minutes: the loop is busy throughout.
    #[arg(long, value_name = "MIB")]
    pub memory_pressure: Option<u32>,
}

#[derive(Args)]
pub struct IoBenchArgs {
    /// Size of the disk image and of the sequential reads and writes, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub size_mib: u64,
    /// Number of 4 KiB reads at random offsets.
    #[arg(long, value_name = "N", default_value_t = 2000)]
    pub randreads: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
    /// Directory for the (temporary) image: on the filesystem to measure [default: the
    /// cache directory's bench-io].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Also run the same guest kernel, initrd, workload, vCPUs and memory in QEMU (this
    /// binary, with KVM: its microvm machine, the image as a virtio-blk device over
    /// virtio-mmio, buffered as hvprobe's device is) and print hvprobe beside it.
    #[arg(long, value_name = "PATH")]
    pub qemu: Option<PathBuf>,
}

#[derive(Args)]
pub struct SnapshotBenchArgs {
    /// Number of restores.
    #[arg(long, default_value_t = 10)]
    pub runs: u32,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
}

#[derive(Args)]
pub struct ProbeBenchArgs {
    /// Loop iterations of the code-blob part.
    #[arg(long, default_value_t = 20_000)]
    pub iterations: u32,
    /// getppid() calls per guest run.
    #[arg(long, default_value_t = 1000)]
    pub calls: u32,
    /// Runs per variant (the median is reported, with the range for the guest part).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// A snapshot of the bundled guest (`hvprobe snapshot create`); without it the
    /// benchmark restores the cached one (`snapshot create --cached`), made by one boot if
    /// missing.
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
}

/// How hits are printed (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    /// ftrace's `trace` layout.
    Text,
    /// One JSON object per line.
    Json,
    /// Not at all (hits still count, and stream to `hvprobe trace`).
    None,
}

impl From<FormatArg> for OutputFormat {
    fn from(arg: FormatArg) -> Self {
        match arg {
            FormatArg::Text => OutputFormat::Text,
            FormatArg::Json => OutputFormat::Json,
            FormatArg::None => OutputFormat::None,
        }
    }
}

/// Which clock stamps hits (`--clock`), named as ftrace's `trace_clock` names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ClockArg {
    /// The guest's `local` trace clock (`sched_clock()`), what its trace file prints.
    #[default]
    #[value(alias = "guest")]
    Local,
    /// The guest's `global` trace clock (`local_clock()`), what its dmesg prints.
    #[value(alias = "dmesg")]
    Global,
    /// Host time since the probe engine started.
    Host,
}

impl From<ClockArg> for hvprobe_probes::clock::TraceClock {
    fn from(arg: ClockArg) -> Self {
        match arg {
            ClockArg::Local => Self::Local,
            ClockArg::Global => Self::Global,
            ClockArg::Host => Self::Host,
        }
    }
}

/// Where a run's hits go: a format on stdout (`--format`), a Perfetto trace file
/// (`--perfetto`), or both.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct HitOutputs {
    /// How hits are printed on stdout: text (ftrace's trace layout), json (one object per
    /// line) or none [default: text; none with --perfetto].
    ///
    /// none still counts hits and streams them to `hvprobe trace`. For `run` it is also
    /// the format of --trigger's histograms (json: one JSON line each, else the hist file).
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: Option<FormatArg>,
    /// Also write the hits as a Perfetto trace to FILE (a track per vCPU, return probes as
    /// slices, stacks as callstacks).
    #[arg(long, value_name = "FILE")]
    pub perfetto: Option<PathBuf>,
}

impl From<&HitOutputs> for hvprobe_session::options::HitOutputs {
    fn from(args: &HitOutputs) -> Self {
        hvprobe_session::options::HitOutputs {
            format: args.format.map(OutputFormat::from),
            perfetto: args.perfetto.clone(),
        }
    }
}

/// Which run's control socket a client talks to.
#[derive(Args, Clone, Debug)]
pub struct ControlArg {
    /// The run's control socket (`hvprobe run` prints it) [default: $HVPROBE_CONTROL, else
    /// the only running hvprobe of this user].
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum ProbeCommand {
    /// Add probes: kprobe_events lines (`p:GRP/EVENT SYM[+OFFS] ARGS`, `r:...`, wildcards
    /// `p:GRP/ vfs_*` and lists `p:GRP/ {vfs_read,vfs_write}`, `-:GRP/EVENT` removes).
    /// All of them go in at once, or none (every problem is reported).
    Add(ProbeAddArgs),
    /// Remove the probes of events: GRP/EVENT, EVENT (any group), GRP/ (the whole group);
    /// globs allowed.
    Remove(EventsArgs),
    /// Enable events, or with --all turn the global switch on.
    ///
    /// Per event as Linux's per-probe enable; --all as writing 1 to debugfs
    /// `kprobes/enabled` (every probe armed again in the state it had).
    Enable(SwitchEventsArgs),
    /// Disable events, or with --all turn the global switch off.
    ///
    /// Per event as Linux's per-probe disable; --all as writing 0 to debugfs
    /// `kprobes/enabled` (every probe disarmed, each keeping its own state).
    Disable(SwitchEventsArgs),
    /// The probes: the debugfs `kprobes/list` layout, plus hits, nmissed and the event.
    List(ControlArg),
    /// Turn jump optimization on, off or back to the backend's default (auto).
    ///
    /// As Linux's `debug.kprobes_optimization` sysctl: off puts every optimized probe back
    /// on its int3, on optimizes every probe that can be.
    Optimize(OptimizeArgs),
}

#[derive(Args)]
pub struct OptimizeArgs {
    #[command(flatten)]
    pub control: ControlArg,
    #[arg(value_enum, value_name = "WHEN")]
    pub mode: OptimizeMode,
}

/// ftrace's function tracers, run from the host (trace-cmd's and perf ftrace's flags).
#[derive(Args, Clone, Debug)]
pub struct FunctionTracerArgs {
    /// Trace kernel functions as ftrace's tracer of that name does (trace-cmd's `-p`):
    /// `function` prints a line per call (`comm-pid [cpu] stamp: func <-parent`),
    /// `function_graph` calls and returns nested with their durations; `funccount` and
    /// `funclatency` print bcc's tools' table and histogram at the end.
    ///
    /// An entry probe (function_graph: and a return probe) goes on each chosen function of
    /// `hvprobe list functions`, all in the pause that arms --probes; a function that
    /// cannot be probed is left out and counted with the reason, never failing the others.
    /// Other probes' hits are printed among the calls (function_graph: as `/* … */`
    /// comments). Needs the kernel's vmlinux. Tracing thousands of functions on kvm_pvm
    /// slows the guest by orders of magnitude: narrow it with --ftrace-filter.
    #[arg(long, value_enum, value_name = "TRACER")]
    pub tracer: Option<TracerArg>,
    /// Trace only these functions (`set_ftrace_filter`, trace-cmd's `-l`): a glob (`*`,
    /// `?`, `{a,b}`); `!GLOB` takes out what the globs before it chose; repeatable
    /// [default: every function].
    #[arg(long, value_name = "GLOB", requires = "tracer", allow_hyphen_values = true)]
    pub ftrace_filter: Vec<String>,
    /// Never trace these functions (`set_ftrace_notrace`, trace-cmd's `-n`); repeatable.
    #[arg(long, value_name = "GLOB", requires = "tracer")]
    pub ftrace_notrace: Vec<String>,
    /// function_graph: show only calls made inside these functions' calls, these included
    /// (`set_graph_function`, trace-cmd's `-g`); repeatable.
    #[arg(long, value_name = "GLOB", requires = "tracer")]
    pub graph_function: Vec<String>,
    /// function_graph: do not show these functions' calls, nor anything inside them
    /// (`set_graph_notrace`); repeatable.
    #[arg(long, value_name = "GLOB", requires = "tracer")]
    pub graph_notrace: Vec<String>,
    /// function_graph: do not show calls this deep or deeper (`max_graph_depth`; 0: no
    /// limit).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "tracer")]
    pub max_graph_depth: usize,
    /// function_graph's `funcgraph-*` options, comma-separated (trace-cmd's `-O`): `proc`,
    /// `abstime`, `tail`, `overhead`, `duration`, `cpu`, `retval` (Linux 6.5's: each
    /// return's value, an error code in decimal); `no` before one turns it off
    /// (`nooverhead`). Default as ftrace's: cpu, duration and overhead on.
    #[arg(long, value_name = "OPTS", requires = "tracer")]
    pub funcgraph_opts: Vec<String>,
    /// Show only these tasks' calls (`set_ftrace_pid`, trace-cmd's `-P`); repeatable.
    #[arg(long, value_name = "PID", requires = "tracer")]
    pub ftrace_pid: Vec<i32>,
    /// function_graph: show a call of a graph function (--graph-function; without one,
    /// each task's outermost traced call) only when it returned an error: its whole call
    /// tree with every return's value and the first failure in it marked (retsnoop's
    /// default). An error is a value in -4095..-1, as a long or an int.
    #[arg(long, requires = "tracer", conflicts_with = "graph_errors_only")]
    pub graph_errors: bool,
    /// function_graph: as --graph-errors, but only the returns that failed, nested as they
    /// were (retsnoop's chain of errors).
    #[arg(long, requires = "tracer")]
    pub graph_errors_only: bool,
    /// funclatency: the histogram's unit (bcc's `-u`, `-m`).
    #[arg(long, value_enum, value_name = "UNIT", default_value_t = LatencyUnitArg::Nsecs, requires = "tracer")]
    pub funclatency_unit: LatencyUnitArg,
}

/// `--funclatency-unit`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LatencyUnitArg {
    Nsecs,
    Usecs,
    Msecs,
}

/// `--tracer`'s values, ftrace's tracer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TracerArg {
    #[value(name = "function")]
    Function,
    #[value(name = "function_graph")]
    FunctionGraph,
    /// bcc's funccount: calls per function, a table at the end.
    #[value(name = "funccount")]
    FuncCount,
    /// bcc's funclatency: a log2 histogram of the calls' durations at the end.
    #[value(name = "funclatency")]
    FuncLatency,
}

impl FunctionTracerArgs {
    /// The session's options, when a tracer is asked for.
    pub fn options(&self) -> Option<FunctionTracerOptions> {
        let kind = match self.tracer? {
            TracerArg::Function => FunctionTracerKind::Function,
            TracerArg::FunctionGraph => FunctionTracerKind::FunctionGraph,
            TracerArg::FuncCount => FunctionTracerKind::FuncCount,
            TracerArg::FuncLatency => FunctionTracerKind::FuncLatency(match self.funclatency_unit {
                LatencyUnitArg::Nsecs => LatencyUnit::Nsecs,
                LatencyUnitArg::Usecs => LatencyUnit::Usecs,
                LatencyUnitArg::Msecs => LatencyUnit::Msecs,
            }),
        };
        Some(FunctionTracerOptions {
            kind,
            filter: self.ftrace_filter.clone(),
            notrace: self.ftrace_notrace.clone(),
            graph_functions: self.graph_function.clone(),
            graph_notrace: self.graph_notrace.clone(),
            max_graph_depth: self.max_graph_depth,
            graph_options: self.funcgraph_opts.clone(),
            pids: self.ftrace_pid.clone(),
            errors: match (self.graph_errors, self.graph_errors_only) {
                (_, true) => ErrorReport::Chain,
                (true, false) => ErrorReport::Trees,
                (false, false) => ErrorReport::Off,
            },
        })
    }
}

/// Whether probes are jump-optimized (`run --optimize`, `probe optimize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizeMode {
    /// The backend's default: on for hardware KVM, off for kvm_pvm.
    Auto,
    On,
    Off,
}

impl OptimizeMode {
    /// On or off; `None` for auto (the backend decides).
    pub fn chosen(self) -> Option<bool> {
        match self {
            OptimizeMode::Auto => None,
            OptimizeMode::On => Some(true),
            OptimizeMode::Off => Some(false),
        }
    }
}

#[derive(Args)]
pub struct ProbeAddArgs {
    #[command(flatten)]
    pub control: ControlArg,
    /// Read the lines from FILE (`-`: stdin).
    #[arg(long, short = 'f', value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// kprobe_events lines, one per argument.
    #[arg(value_name = "LINE")]
    pub lines: Vec<String>,
}

#[derive(Args)]
pub struct EventsArgs {
    #[command(flatten)]
    pub control: ControlArg,
    #[arg(required = true, value_name = "EVENT")]
    pub events: Vec<String>,
}

#[derive(Args)]
pub struct SwitchEventsArgs {
    #[command(flatten)]
    pub control: ControlArg,
    /// The global switch: every probe, as debugfs `kprobes/enabled`.
    #[arg(long, conflicts_with = "events")]
    pub all: bool,
    /// GRP/EVENT, EVENT (any group) or GRP/ (the whole group); globs allowed.
    #[arg(value_name = "EVENT", required_unless_present = "all")]
    pub events: Vec<String>,
}

#[derive(Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub control: ControlArg,
    #[command(flatten)]
    pub output: HitOutputs,
    /// Events held for this client while it does not read; beyond them events are dropped
    /// for it (and counted), never slowing the guest.
    #[arg(long, default_value_t = 65536)]
    pub queue: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hit outputs of `hvprobe run ARGS`, as the run session gets them.
    fn outputs(args: &[&str]) -> Result<hvprobe_session::options::HitOutputs, String> {
        let mut argv = vec!["hvprobe", "run"];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        match cli.command {
            Commands::Run(run) => Ok((&run.output).into()),
            _ => unreachable!(),
        }
    }

    #[test]
    fn hits_go_to_stdout_in_one_format_and_to_a_perfetto_file() {
        let text = hvprobe_session::options::HitOutputs::default();
        assert_eq!(outputs(&[]).map(|o| o.stdout()), Ok(OutputFormat::Text));
        assert_eq!(
            outputs(&["--format", "text"]).map(|o| o.stdout()),
            Ok(OutputFormat::Text)
        );
        assert_eq!(outputs(&[]), Ok(text));
        assert_eq!(
            outputs(&["--format", "json", "--cpus", "2"]).map(|o| o.stdout()),
            Ok(OutputFormat::Json)
        );
        let trace_only = outputs(&["--perfetto", "t.pftrace", "--cpus", "2"]).unwrap();
        assert_eq!(trace_only.perfetto, Some("t.pftrace".into()));
        assert_eq!(trace_only.stdout(), OutputFormat::None);
        let both = outputs(&["--perfetto", "t.pftrace", "--format", "text"]).unwrap();
        assert_eq!(both.perfetto, Some("t.pftrace".into()));
        assert_eq!(both.stdout(), OutputFormat::Text);
    }

    #[test]
    fn a_bad_output_says_which_forms_there_are() {
        for (args, error) in [
            (&["--perfetto"][..], "a value is required for '--perfetto <FILE>'"),
            (&["--format", "xml"], "invalid value 'xml' for '--format <FORMAT>'"),
            (
                &["--format", "text", "--format", "json"],
                "cannot be used multiple times",
            ),
            (&["--perfetto", "a", "--perfetto", "b"], "cannot be used multiple times"),
            (&["--output", "json"], "unexpected argument '--output'"),
        ] {
            let got = outputs(args).expect_err("a bad output flag");
            assert!(got.contains(error), "{args:?}: {got}");
        }
    }
}
