//! The command line: every clap argument type of `hvprobe` (and nothing else, so that the
//! modules that act on them depend on this one and never on each other for their flags).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

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
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct RunArgs {
    /// Kernel to boot: an ELF vmlinux with a PVH note, or a bzImage [default: the bundled guest's vmlinux].
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initrd (cpio) [default: the bundled guest's initramfs].
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Extra kernel command-line options, appended to the ones hvprobe sets.
    #[arg(long, default_value = "")]
    pub cmdline: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    pub mem: u64,
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
    /// [default: System.map if there is one, else the vmlinux, else the guest's kallsyms].
    #[arg(long = "symbols", value_enum, value_name = "SOURCE")]
    pub symbol_sources: Vec<SourceArg>,
    /// System.map of the kernel [default: the bundled guest's].
    #[arg(long)]
    pub system_map: Option<PathBuf>,
    /// The kernel's vmlinux ELF, for symbols [default: the bundled guest's, or --kernel if it is an ELF].
    #[arg(long)]
    pub vmlinux: Option<PathBuf>,
    /// Sample every vCPU's instruction pointer this often (ms) and print the hottest guest
    /// functions at exit.
    #[arg(long, value_name = "MS")]
    pub sample_ms: Option<u64>,
    /// Probes to arm, in the kernel's kprobe_events syntax (one per line: `p[:[GRP/]EVENT]
    /// SYM[+OFFS]|ADDR [FETCHARGS]`, `-:[GRP/]EVENT`, `#` comments). A booted guest gets
    /// them when it reaches /init; a restored one before it runs. Hits are printed on stdout,
    /// the listing (debugfs `list` layout, plus hits and nmissed) on stderr at exit and on SIGUSR1.
    #[arg(long, value_name = "FILE")]
    pub probes: Option<PathBuf>,
    /// `--output FORMAT [FILE]`, repeatable (see [`HitOutputs`]).
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
    /// Jump-optimize every probe that can be (the seed's optimized kprobes: a 5-byte jump
    /// to a detour; one exit per hit whatever the instruction) [default: per backend, see
    /// the README].
    #[arg(long, conflicts_with = "no_optimize")]
    pub optimize: bool,
    /// Keep every probe on its int3.
    #[arg(long)]
    pub no_optimize: bool,
    /// Feed stdin to the guest's serial console also with --workload (a workload reads it
    /// from /dev/ttyS0); on a terminal this puts it in raw mode.
    #[arg(long)]
    pub console_input: bool,
    /// At exit (after every probe is removed), print the SHA-256 of the guest kernel's text.
    #[arg(long)]
    pub text_hash: bool,
    /// Restore the guest from a snapshot directory (`hvprobe snapshot create`) instead of
    /// booting; needs --workload, and --cpus equal to the snapshot's.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kernel", "initrd", "kaslr", "resolve", "sample_ms", "symbol_sources"])]
    pub snapshot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceArg {
    SystemMap,
    Vmlinux,
    Kallsyms,
}

#[derive(Args)]
pub struct SymbolsArgs {
    /// The kernel's vmlinux ELF.
    #[arg(long)]
    pub kernel: PathBuf,
    /// Use this System.map instead of the vmlinux's symbol table.
    #[arg(long)]
    pub system_map: Option<PathBuf>,
    /// SYM, SYM+OFFSET, or a hex address (0x...) to describe as SYM+OFF/SIZE.
    #[arg(required = true)]
    pub names: Vec<String>,
}

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Boot the guest until its init waits for a workload, then save it to a directory.
    Create(CreateArgs),
}

#[derive(Args)]
pub struct CreateArgs {
    /// Directory to write the snapshot to (created if needed; `state` and `memory` in it).
    #[arg(long)]
    pub out: PathBuf,
    /// Kernel to boot: an ELF vmlinux with a PVH note, or a bzImage [default: the bundled guest's vmlinux].
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initrd (cpio) whose /init has the bundled init's wait mode [default: the bundled guest's initramfs].
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Extra kernel command-line options, appended to the ones hvprobe sets.
    #[arg(long, default_value = "")]
    pub cmdline: String,
    /// Number of vCPUs (a restore must ask for the same number).
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    pub mem: u64,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cold boot of the bundled guest against restores of its snapshot.
    Snapshot(SnapshotBenchArgs),
    /// What a probe hit costs: the int3 floor, emulated and stepped hits, against the
    /// guest's own kprobe event.
    Probes(ProbeBenchArgs),
    /// How long arming and disarming N probes takes on a running guest.
    Arm(ArmBenchArgs),
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
    /// boots the guest once to make one.
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
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
    /// benchmark boots the guest once to make one.
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
}

/// How hits are printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// ftrace's `trace` layout.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
    /// Not at all (hits still count, and stream to `hvprobe trace`).
    None,
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

/// Where a run's hits go: `--output`, once or twice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HitOutputs {
    /// On stdout (and the histograms' format).
    pub stdout: OutputFormat,
    /// `perfetto FILE`: a Perfetto trace written to FILE.
    pub perfetto: Option<PathBuf>,
}

/// An `--output` that is not one of its forms.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum OutputArgError {
    #[error("--output {0:?}: expected text, json, none or perfetto FILE")]
    Unknown(String),
    #[error("--output perfetto needs the trace file: --output perfetto FILE")]
    PerfettoWithoutFile,
    #[error("--output {format} takes no file (only `--output perfetto FILE` does)")]
    FileWithoutPerfetto { format: String },
    #[error("--output {first} and --output {second}: hits go to stdout in one format")]
    TwoStdoutFormats { first: String, second: String },
    #[error("--output perfetto is given twice: one trace file per run")]
    TwoPerfettoFiles,
}

/// `--output`'s help.
const OUTPUT_HELP: &str = "Where hits go: `text` (ftrace's trace layout) or `json` on stdout, `none` (not \
printed; a run still streams them to `hvprobe trace`), or `perfetto FILE`, a Perfetto trace written to FILE (hits then \
stay off stdout). Repeat it for both: `--output text --output perfetto t.pftrace`. For `run`, the stdout format is also \
that of the histograms of --trigger (`json`: one JSON line each, else the hist file) [default: text]";

// By hand rather than derived: clap's derive cannot keep the values of each occurrence of a
// flag together (`--output text --output perfetto FILE`), which `ArgMatches` can.
impl clap::Args for HitOutputs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        cmd.arg(
            clap::Arg::new("output")
                .long("output")
                .num_args(1..=2)
                .value_names(["FORMAT", "FILE"])
                .action(clap::ArgAction::Append)
                .help(OUTPUT_HELP),
        )
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for HitOutputs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let occurrences: Vec<Vec<String>> = matches
            .get_occurrences::<String>("output")
            .map(|o| o.map(|values| values.cloned().collect()).collect())
            .unwrap_or_default();
        HitOutputs::from_args(&occurrences).map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, e))
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl HitOutputs {
    /// The outputs the `--output` occurrences name: at most one stdout format (text when
    /// none is named and there is no trace file; none when there is one) and at most one
    /// Perfetto file.
    pub fn from_args(occurrences: &[Vec<String>]) -> Result<HitOutputs, OutputArgError> {
        let mut stdout: Option<(String, OutputFormat)> = None;
        let mut perfetto = None;
        for values in occurrences {
            let (format, file) = match values.as_slice() {
                [format] => (format.as_str(), None),
                [format, file] => (format.as_str(), Some(file)),
                _ => unreachable!("clap takes one or two values per --output"),
            };
            let chosen = match (format, file) {
                ("perfetto", Some(file)) => {
                    if perfetto.replace(PathBuf::from(file)).is_some() {
                        return Err(OutputArgError::TwoPerfettoFiles);
                    }
                    continue;
                }
                ("perfetto", None) => return Err(OutputArgError::PerfettoWithoutFile),
                ("text", None) => OutputFormat::Text,
                ("json", None) => OutputFormat::Json,
                ("none", None) => OutputFormat::None,
                ("text" | "json" | "none", Some(_)) => {
                    return Err(OutputArgError::FileWithoutPerfetto { format: format.into() })
                }
                (other, _) => return Err(OutputArgError::Unknown(other.into())),
            };
            if let Some((first, _)) = &stdout {
                return Err(OutputArgError::TwoStdoutFormats {
                    first: first.clone(),
                    second: format.into(),
                });
            }
            stdout = Some((format.into(), chosen));
        }
        let stdout = match (stdout, &perfetto) {
            (Some((_, format)), _) => format,
            (None, Some(_)) => OutputFormat::None,
            (None, None) => OutputFormat::Text,
        };
        Ok(HitOutputs { stdout, perfetto })
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
    /// Enable events (as the seed's per-probe enable); with none, turn the global switch on.
    Enable(OptionalEventsArgs),
    /// Disable events; with none, turn the global switch off (every probe disarmed, each
    /// keeping its own state, like debugfs `kprobes/enabled`).
    Disable(OptionalEventsArgs),
    /// The probes: the debugfs `kprobes/list` layout, plus hits, nmissed and the event.
    List(ControlArg),
    /// Turn jump optimization on or off (the seed's `debug.kprobes_optimization`): off puts
    /// every optimized probe back on its int3, on optimizes every probe that can be.
    Optimize(OptimizeArgs),
}

#[derive(Args)]
pub struct OptimizeArgs {
    #[command(flatten)]
    pub control: ControlArg,
    #[arg(value_enum)]
    pub switch: Switch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
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
pub struct OptionalEventsArgs {
    #[command(flatten)]
    pub control: ControlArg,
    #[arg(value_name = "EVENT")]
    pub events: Vec<String>,
}

#[derive(Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub control: ControlArg,
    /// `--output FORMAT [FILE]`, repeatable (see [`HitOutputs`]).
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

    fn outputs(args: &[&str]) -> Result<HitOutputs, String> {
        let mut argv = vec!["hvprobe", "run"];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        match cli.command {
            Commands::Run(run) => Ok(run.output),
            _ => unreachable!(),
        }
    }

    #[test]
    fn output_takes_a_format_or_perfetto_and_a_file() {
        let text = HitOutputs::default();
        assert_eq!(outputs(&[]), Ok(text.clone()));
        assert_eq!(outputs(&["--output", "text"]), Ok(text));
        assert_eq!(
            outputs(&["--output", "json", "--cpus", "2"]).map(|o| o.stdout),
            Ok(OutputFormat::Json)
        );
        assert_eq!(
            outputs(&["--output", "perfetto", "t.pftrace", "--cpus", "2"]),
            Ok(HitOutputs {
                stdout: OutputFormat::None,
                perfetto: Some("t.pftrace".into())
            })
        );
        assert_eq!(
            outputs(&["--output", "perfetto", "t.pftrace", "--output", "text"]),
            Ok(HitOutputs {
                stdout: OutputFormat::Text,
                perfetto: Some("t.pftrace".into())
            })
        );
    }

    #[test]
    fn a_bad_output_says_which_forms_there_are() {
        for (args, error) in [
            (&["--output", "perfetto"][..], OutputArgError::PerfettoWithoutFile),
            (&["--output", "xml"], OutputArgError::Unknown("xml".into())),
            (
                &["--output", "text", "t.txt"],
                OutputArgError::FileWithoutPerfetto { format: "text".into() },
            ),
            (
                &["--output", "text", "--output", "json"],
                OutputArgError::TwoStdoutFormats {
                    first: "text".into(),
                    second: "json".into(),
                },
            ),
            (
                &["--output", "perfetto", "a", "--output", "perfetto", "b"],
                OutputArgError::TwoPerfettoFiles,
            ),
        ] {
            let got = outputs(args).expect_err("a bad --output");
            assert!(got.starts_with(&format!("error: {error}\n")), "{args:?}: {got}");
        }
    }
}
