//! Progress of the bundled guest's kernel build, read from its build log while
//! `guest/build.sh` runs: every [`PROGRESS_INTERVAL`] a line on stderr such as
//! `hvprobe-guest: building kernel: 412/837 files compiled (49 %), 2m10s`.
//!
//! This lives on the host side, not in `guest/build.sh`, on purpose: the script's own hash
//! is part of the guest cache key (its `key_material`), so any change to it rebuilds the
//! kernel on every machine, while the progress changes nothing in what is built. The
//! script already writes make's output to `<cache>/guest/build.log` (`run` prefixes each
//! command with a `+ ` line); this module follows that file.
//!
//! What is counted: in the output of the kernel's `make ... vmlinux bzImage`, the kbuild
//! lines that compile or link one file (`CC`, `AS`, `LD`, `HOSTCC`, `HOSTLD`). The total is
//! only given when it is known honestly: the count of the last *full* build (one in an
//! object directory that had nothing built yet: the configuration steps before it compiled
//! `scripts/basic/fixdep`, the first thing kbuild builds in a new tree), kept in
//! `<cache>/guest/kernel-build-files`, and only for another full build. A build that reuses
//! an object directory recompiles an unknown part of it: only the count is shown.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How often a progress line is printed while the kernel builds.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(20);
/// How often the log is read.
const POLL: Duration = Duration::from_millis(500);
/// The file (in `<cache>/guest`) that keeps the files a full build compiled.
const TOTAL_FILE: &str = "kernel-build-files";
/// The kbuild tags of a line that compiles or links one file.
const COMPILE_TAGS: [&str; 5] = ["CC", "AS", "LD", "HOSTCC", "HOSTLD"];

/// Where the kernel's make is, as the log shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not started (extraction, configuration).
    Before,
    /// `make ... vmlinux bzImage` is running.
    Kernel,
    /// The next command of the script has started: the kernel is built.
    After,
}

/// The build log, read line by line.
#[derive(Clone, Debug)]
pub struct KbuildProgress {
    phase: Phase,
    cold_tree: bool,
    compiled: u64,
    /// The end of the log that is not a whole line yet.
    partial: Vec<u8>,
}

impl Default for KbuildProgress {
    fn default() -> Self {
        KbuildProgress {
            phase: Phase::Before,
            cold_tree: false,
            compiled: 0,
            partial: Vec::new(),
        }
    }
}

impl KbuildProgress {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes of the log (any cut: a line split between two calls is read
    /// whole).
    pub fn feed(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let whole: Vec<u8> = self.partial.drain(..=end).collect();
        for line in whole.split(|&b| b == b'\n') {
            self.line(&String::from_utf8_lossy(line));
        }
    }

    fn line(&mut self, line: &str) {
        let mut words = line.split_whitespace();
        let first = words.next();
        if line.starts_with("+ ") {
            // A command of the script: the kernel's make, or what comes before or after it.
            let is_kernel_make = line.contains(" make ") && line.ends_with(" vmlinux bzImage");
            self.phase = match (self.phase, is_kernel_make) {
                (Phase::Before, true) => Phase::Kernel,
                (Phase::Before, false) => Phase::Before,
                (Phase::Kernel | Phase::After, _) => Phase::After,
            };
            return;
        }
        match self.phase {
            Phase::Before => {
                if first == Some("HOSTCC") && words.next() == Some("scripts/basic/fixdep") {
                    self.cold_tree = true;
                }
            }
            Phase::Kernel => {
                if first.is_some_and(|tag| COMPILE_TAGS.contains(&tag)) && words.next().is_some() {
                    self.compiled += 1;
                }
            }
            Phase::After => {}
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Files compiled or linked by the kernel's make so far.
    pub fn compiled(&self) -> u64 {
        self.compiled
    }

    /// Whether the object directory had nothing built when this build began (so that the
    /// count of a full build is its total).
    pub fn cold_tree(&self) -> bool {
        self.cold_tree
    }

    /// The total to show against: `last_full` (the count of the last full build) when this
    /// build is a full one too.
    pub fn total(&self, last_full: Option<u64>) -> Option<u64> {
        last_full.filter(|_| self.cold_tree)
    }
}

/// `hvprobe-guest: building kernel: 412/837 files compiled (49 %), 2m10s`; without a total
/// (or past it) only the count.
pub fn progress_line(compiled: u64, total: Option<u64>, elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    let time = if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{secs}s")
    };
    match total {
        Some(total) if total > 0 && compiled <= total => format!(
            "hvprobe-guest: building kernel: {compiled}/{total} files compiled ({} %), {time}",
            compiled * 100 / total
        ),
        Some(total) => format!(
            "hvprobe-guest: building kernel: {compiled} files compiled (the last full build compiled {total}), {time}"
        ),
        None => format!("hvprobe-guest: building kernel: {compiled} files compiled, {time}"),
    }
}

/// The guest cache `guest/build.sh` uses: `${HVPROBE_CACHE:-$HOME/.cache/hvprobe}/guest`.
pub fn guest_cache_dir() -> Option<PathBuf> {
    Some(crate::cache::cache_dir()?.join("guest"))
}

/// Follows a growing log file from its start; a file that shrank (the script empties it
/// when its build begins) is read again from the start.
#[derive(Debug)]
pub struct LogFollower {
    path: PathBuf,
    offset: u64,
    pub progress: KbuildProgress,
}

impl LogFollower {
    pub fn new(path: PathBuf) -> Self {
        LogFollower {
            path,
            offset: 0,
            progress: KbuildProgress::new(),
        }
    }

    /// Reads what was added since the last call. A missing file is no progress yet.
    pub fn poll(&mut self) {
        let Ok(mut file) = File::open(&self.path) else { return };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            return;
        };
        if len < self.offset {
            self.offset = 0;
            self.progress = KbuildProgress::new();
        }
        if len == self.offset || file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut bytes = Vec::new();
        if let Ok(n) = file.take(len - self.offset).read_to_end(&mut bytes) {
            self.offset += n as u64;
            self.progress.feed(&bytes);
        }
    }
}

/// Follows the build log in `guest_cache` until `stop` says the script ended, giving
/// `print` a progress line every `interval` while the kernel builds. Returns what it read
/// last.
pub fn follow(
    guest_cache: &Path,
    stop: &Receiver<()>,
    interval: Duration,
    print: &mut dyn FnMut(String),
) -> KbuildProgress {
    let mut log = LogFollower::new(guest_cache.join("build.log"));
    let last_full = read_total(guest_cache);
    let mut kernel_started: Option<Instant> = None;
    let mut next_line = None;
    loop {
        let done = match stop.recv_timeout(POLL) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => true,
            Err(RecvTimeoutError::Timeout) => false,
        };
        log.poll();
        let progress = &log.progress;
        if done {
            return log.progress;
        }
        match progress.phase() {
            Phase::Kernel => {
                let started = *kernel_started.get_or_insert_with(Instant::now);
                let next = next_line.get_or_insert(started + interval);
                if Instant::now() >= *next {
                    print(progress_line(
                        progress.compiled(),
                        progress.total(last_full),
                        started.elapsed(),
                    ));
                    *next += interval;
                }
            }
            Phase::Before => {
                kernel_started = None;
                next_line = None;
            }
            Phase::After => {}
        }
    }
}

/// The count of the last full build, if one was kept.
pub fn read_total(guest_cache: &Path) -> Option<u64> {
    std::fs::read_to_string(guest_cache.join(TOTAL_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|n| *n > 0)
}

/// Keeps the count of a build that ended well, when it was a full one (whole: written
/// under another name, then renamed over the old count).
pub fn keep_total(guest_cache: &Path, progress: &KbuildProgress) {
    if !(progress.cold_tree() && progress.phase() == Phase::After && progress.compiled() > 0) {
        return;
    }
    let tmp = guest_cache.join(format!(".{TOTAL_FILE}.{}", std::process::id()));
    let written = std::fs::write(&tmp, format!("{}\n", progress.compiled()))
        .and_then(|()| std::fs::rename(&tmp, guest_cache.join(TOTAL_FILE)));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::debug!(
            "cannot keep the kernel build's file count in {}: {e}",
            guest_cache.display()
        );
    }
}

#[cfg(test)]
mod tests;
