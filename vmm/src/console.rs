//! The serial console's two ends on the host: where guest output goes (a terminal or
//! nowhere, and always a tail buffer for error messages) and where input comes from.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How much console output is kept for [`ConsoleLog::tail`].
const TAIL_CAPACITY: usize = 256 * 1024;

/// The last bytes the guest wrote to its console, shareable across threads.
#[derive(Clone, Default)]
pub struct ConsoleLog {
    bytes: Arc<Mutex<VecDeque<u8>>>,
    /// Bytes written since the start (the tail forgets; this does not).
    written: Arc<AtomicU64>,
}

impl ConsoleLog {
    fn push(&self, data: &[u8]) {
        let mut bytes = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        bytes.extend(data);
        self.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        let excess = bytes.len().saturating_sub(TAIL_CAPACITY);
        bytes.drain(..excess);
    }

    /// Whether the output so far ends with a whole line (or there is none). With
    /// [`ConsoleOutput::Stdout`], this is what stdout shows while its lock is held: the
    /// writer logs and prints under that lock.
    pub fn at_line_start(&self) -> bool {
        let bytes = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        bytes.back().is_none_or(|&b| b == b'\n')
    }

    /// How many bytes the guest has written so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// All retained output, lossily decoded.
    pub fn contents(&self) -> String {
        let bytes = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = bytes.as_slices();
        let mut v = a.to_vec();
        v.extend_from_slice(b);
        String::from_utf8_lossy(&v).into_owned()
    }

    /// The last `lines` lines of output.
    pub fn tail(&self, lines: usize) -> String {
        let all = self.contents();
        let parts: Vec<&str> = all.split_inclusive('\n').collect();
        parts[parts.len().saturating_sub(lines)..].concat()
    }
}

/// Where the guest's console output goes besides the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsoleOutput {
    Stdout,
    Discard,
}

/// The serial device's writer.
pub struct ConsoleWriter {
    log: ConsoleLog,
    output: ConsoleOutput,
}

impl ConsoleWriter {
    pub fn new(log: ConsoleLog, output: ConsoleOutput) -> Self {
        ConsoleWriter { log, output }
    }
}

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.output == ConsoleOutput::Stdout {
            // Log and print under stdout's lock, so that whoever else prints there (probe
            // hits) can tell from the log whether stdout is in the middle of a line.
            let mut out = io::stdout().lock();
            self.log.push(buf);
            out.write_all(buf)?;
            out.flush()?;
        } else {
            self.log.push(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.output == ConsoleOutput::Stdout {
            io::stdout().flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_returns_the_last_lines_and_log_is_bounded() {
        let log = ConsoleLog::default();
        let mut w = ConsoleWriter::new(log.clone(), ConsoleOutput::Discard);
        w.write_all(b"one\ntwo\nthree\nfour").unwrap();
        assert_eq!(log.tail(1), "four");
        assert_eq!(log.tail(2), "three\nfour");
        assert_eq!(log.tail(10), "one\ntwo\nthree\nfour");
        w.write_all(&vec![b'x'; TAIL_CAPACITY + 10]).unwrap();
        assert_eq!(log.contents().len(), TAIL_CAPACITY);
    }

    #[test]
    fn the_log_knows_whether_a_line_is_open_and_counts_every_byte() {
        let log = ConsoleLog::default();
        assert!(log.at_line_start());
        let mut w = ConsoleWriter::new(log.clone(), ConsoleOutput::Discard);
        w.write_all(b"# ").unwrap();
        assert!(!log.at_line_start());
        w.write_all(b"ls\n").unwrap();
        assert!(log.at_line_start());
        w.write_all(&vec![b'x'; TAIL_CAPACITY]).unwrap();
        assert_eq!(log.written(), 5 + TAIL_CAPACITY as u64);
    }
}
