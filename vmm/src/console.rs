//! The serial console's two ends on the host: where guest output goes (a terminal or
//! nowhere, and always a tail buffer for error messages) and where input comes from.

use std::collections::VecDeque;
use std::io::{self, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How much console output is kept for [`ConsoleLog::tail`].
const TAIL_CAPACITY: usize = 256 * 1024;

/// The longest partial line held back from a stdout that is not a terminal: a guest that
/// writes more without a newline has it printed (the guest chooses what it writes).
const PARTIAL_LINE_LIMIT: usize = 64 * 1024;

/// The last bytes the guest wrote to its console, shareable across threads.
#[derive(Clone, Default)]
pub struct ConsoleLog {
    bytes: Arc<Mutex<VecDeque<u8>>>,
    /// Bytes written since the start (the tail forgets; this does not).
    written: Arc<AtomicU64>,
    /// Whether stdout gets whole lines only ([`WholeLines`]), and then whether what it
    /// shows ends inside a line all the same (a partial line over the limit, or the end).
    stdout_whole_lines: Arc<AtomicBool>,
    stdout_mid_line: Arc<AtomicBool>,
}

impl ConsoleLog {
    fn push(&self, data: &[u8]) {
        let mut bytes = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        bytes.extend(data);
        self.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        let excess = bytes.len().saturating_sub(TAIL_CAPACITY);
        bytes.drain(..excess);
    }

    /// Whether the console's output on stdout ends with a whole line (or there is none):
    /// what stdout shows while its lock is held (the writer logs and prints under that
    /// lock), so that another printer knows whether it would split a guest line. Without
    /// stdout, whether the output so far does.
    pub fn at_line_start(&self) -> bool {
        if self.stdout_whole_lines.load(Ordering::Relaxed) {
            return !self.stdout_mid_line.load(Ordering::Relaxed);
        }
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

    /// The last `lines` lines of output, control bytes escaped ([`TerminalEscaper`]): the
    /// tail goes into error messages on the user's terminal.
    pub fn tail(&self, lines: usize) -> String {
        let all = self.contents();
        let parts: Vec<&str> = all.split_inclusive('\n').collect();
        let tail = parts[parts.len().saturating_sub(lines)..].concat();
        let mut out = Vec::with_capacity(tail.len());
        let mut escaper = TerminalEscaper::default();
        escaper.push(tail.as_bytes(), &mut out);
        escaper.finish(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Makes guest console bytes safe for the user's terminal when nobody is typing into the
/// guest (`--workload`, error messages): a guest could otherwise clear the screen, move the
/// cursor, retitle the window or rewrite earlier lines (ESC sequences, a lone carriage
/// return, 8-bit C1 controls) or forge hvprobe's own lines. Control bytes become `\xNN`;
/// newline, tab and the `\r\n` a serial tty ends its lines with stay. C1 controls
/// (U+0080..U+009F, bytes `c2 80`..`c2 9f` in UTF-8) are escaped too; other UTF-8 text
/// passes. Stateful, because the guest's UART hands its bytes over one by one.
#[derive(Default, Debug)]
pub struct TerminalEscaper {
    /// A `\r` (kept if a `\n` follows) or a `0xc2` (escaped if a C1 control follows).
    held: Option<u8>,
}

impl TerminalEscaper {
    /// Appends `bytes`, made safe, to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        for &b in bytes {
            match self.held.take() {
                Some(b'\r') if b == b'\n' => {
                    out.extend_from_slice(b"\r\n");
                    continue;
                }
                Some(0xc2) if (0x80..=0x9f).contains(&b) => {
                    escape_byte(0xc2, out);
                    escape_byte(b, out);
                    continue;
                }
                Some(held) => self.plain(held, out),
                None => {}
            }
            match b {
                b'\r' | 0xc2 => self.held = Some(b),
                _ => self.plain(b, out),
            }
        }
    }

    /// Ends the stream: a byte still held is written (escaped if it is the `\r`).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if let Some(held) = self.held.take() {
            self.plain(held, out);
        }
    }

    fn plain(&self, b: u8, out: &mut Vec<u8>) {
        match b {
            b'\n' | b'\t' => out.push(b),
            0..=0x1f | 0x7f => escape_byte(b, out),
            _ => out.push(b),
        }
    }
}

fn escape_byte(b: u8, out: &mut Vec<u8>) {
    out.extend_from_slice(format!("\\x{b:02x}").as_bytes());
}

/// Where the guest's console output goes besides the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsoleOutput {
    /// To stdout as the guest wrote it: for an interactive console, where the guest's
    /// shell and programs draw on the user's terminal on purpose.
    Stdout,
    /// To stdout with control bytes escaped ([`TerminalEscaper`]): for a `--workload`
    /// run nobody types into, so that a guest program cannot drive the terminal or forge
    /// hvprobe's lines.
    StdoutEscaped,
    Discard,
}

/// The console's output for a stdout that is not a terminal (a pipe, a file: a program
/// reads it): whole lines only, a partial line held back until its newline, the end of
/// the run or [`PARTIAL_LINE_LIMIT`]. Probe hits printed meanwhile then never split a
/// guest line, however long the guest takes to finish it (a line of a slow guest console
/// is one exit per byte).
#[derive(Debug, Default)]
pub struct WholeLines {
    pending: Vec<u8>,
}

impl WholeLines {
    /// What to print of `buf` now: every line it completes, or everything held when the
    /// partial line has grown past the limit.
    pub fn take(&mut self, buf: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(buf);
        if self.pending.len() > PARTIAL_LINE_LIMIT {
            return std::mem::take(&mut self.pending);
        }
        match self.pending.iter().rposition(|&b| b == b'\n') {
            Some(end) => self.pending.drain(..=end).collect(),
            None => Vec::new(),
        }
    }

    /// The partial line held back (at the end of the run).
    pub fn rest(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// What reaches stdout of the guest's console bytes: escaped ([`TerminalEscaper`]) for
/// [`ConsoleOutput::StdoutEscaped`], whole lines only ([`WholeLines`]) when stdout is not a
/// terminal. Both hold bytes back between writes (a `\r`, a partial line), and only the
/// end of the run ([`ConsoleFilter::finish`]) lets them go: the serial device flushes its
/// writer after every byte.
#[derive(Debug, Default)]
pub struct ConsoleFilter {
    escaper: Option<TerminalEscaper>,
    whole_lines: Option<WholeLines>,
}

impl ConsoleFilter {
    pub fn new(escape: bool, whole_lines: bool) -> Self {
        ConsoleFilter {
            escaper: escape.then(TerminalEscaper::default),
            whole_lines: whole_lines.then(WholeLines::default),
        }
    }

    /// What to print now of `buf`, the guest's next bytes.
    pub fn take(&mut self, buf: &[u8]) -> Vec<u8> {
        let printed = match &mut self.escaper {
            Some(escaper) => {
                let mut escaped = Vec::with_capacity(buf.len());
                escaper.push(buf, &mut escaped);
                escaped
            }
            None => buf.to_vec(),
        };
        match &mut self.whole_lines {
            Some(lines) => lines.take(&printed),
            None => printed,
        }
    }

    /// What is still held, at the end of the run.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut rest = Vec::new();
        if let Some(escaper) = &mut self.escaper {
            escaper.finish(&mut rest);
        }
        match &mut self.whole_lines {
            Some(lines) => {
                let mut held = lines.take(&rest);
                held.extend(lines.rest());
                held
            }
            None => rest,
        }
    }
}

/// The serial device's writer.
pub struct ConsoleWriter {
    log: ConsoleLog,
    output: ConsoleOutput,
    filter: ConsoleFilter,
}

impl ConsoleWriter {
    pub fn new(log: ConsoleLog, output: ConsoleOutput) -> Self {
        let whole_lines = output != ConsoleOutput::Discard && !io::stdout().is_terminal();
        log.stdout_whole_lines.store(whole_lines, Ordering::Relaxed);
        ConsoleWriter {
            log,
            output,
            filter: ConsoleFilter::new(output == ConsoleOutput::StdoutEscaped, whole_lines),
        }
    }

    /// Prints `bytes` under stdout's lock `out`, noting whether stdout now ends mid-line.
    fn print(&self, out: &mut io::StdoutLock<'_>, bytes: &[u8]) -> io::Result<()> {
        if let Some(&last) = bytes.last() {
            out.write_all(bytes)?;
            out.flush()?;
            self.log.stdout_mid_line.store(last != b'\n', Ordering::Relaxed);
        }
        Ok(())
    }
}

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.output == ConsoleOutput::Discard {
            self.log.push(buf);
            return Ok(buf.len());
        }
        // Log and print under stdout's lock, so that whoever else prints there (probe
        // hits) can tell from the log whether stdout is in the middle of a line.
        let mut out = io::stdout().lock();
        self.log.push(buf);
        let now = self.filter.take(buf);
        self.print(&mut out, &now).map(|()| buf.len())
    }

    /// Flushes stdout only: the serial device calls this after every byte, and what the
    /// filter holds must wait for the bytes that follow.
    fn flush(&mut self) -> io::Result<()> {
        if self.output != ConsoleOutput::Discard {
            io::stdout().flush()?;
        }
        Ok(())
    }
}

impl Drop for ConsoleWriter {
    /// The end of the run: what the filter held is printed too.
    fn drop(&mut self) {
        if self.output != ConsoleOutput::Discard {
            let mut out = io::stdout().lock();
            let rest = self.filter.finish();
            let _ = self.print(&mut out, &rest);
        }
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

    /// A guest line written slowly, with probe hits printed in the middle of it: stdout (a
    /// pipe) gets it whole. Before, the hit printer waited 100 ms for the line to grow and
    /// then split it (a lane run lost one of its 60 guest trace lines so).
    #[test]
    fn a_slow_guest_line_reaches_a_pipe_whole() {
        let mut lines = WholeLines::default();
        assert_eq!(lines.take(b"GUEST loop-29 [000] gk: (__do_sys_ge"), b"");
        assert_eq!(
            lines.take(b"tppid+0x0/0x24) di=0x1\nGUEST lo"),
            b"GUEST loop-29 [000] gk: (__do_sys_getppid+0x0/0x24) di=0x1\n"
        );
        assert_eq!(lines.take(b"op-30\n\n"), b"GUEST loop-30\n\n");
        assert_eq!(lines.take(b"~ # "), b"");
        assert_eq!(lines.rest(), b"~ # ");
        assert_eq!(lines.rest(), b"");
    }

    /// The serial device hands over one byte at a time and flushes after each: a `\r\n`
    /// split across writes stays a line end (it came out as `\x0d` when a flush ended the
    /// escaper's held `\r`), and a line is printed whole.
    #[test]
    fn bytes_one_at_a_time_are_escaped_and_printed_as_whole_lines() {
        let mut filter = ConsoleFilter::new(true, true);
        let mut printed = Vec::new();
        for b in b"hi\r\n\x1b[2Jx\r\npartial" {
            printed.extend(filter.take(&[*b]));
        }
        assert_eq!(printed, b"hi\r\n\\x1b[2Jx\r\n");
        assert_eq!(filter.finish(), b"partial");
        let mut plain = ConsoleFilter::new(false, false);
        assert_eq!(plain.take(b"a\r"), b"a\r");
        assert_eq!(plain.finish(), b"");
    }

    /// The guest chooses what it writes: a line without end is printed past the limit.
    #[test]
    fn a_partial_line_is_held_back_no_further_than_the_limit() {
        let mut lines = WholeLines::default();
        assert!(lines.take(&vec![b'x'; PARTIAL_LINE_LIMIT]).is_empty());
        assert_eq!(lines.take(b"y").len(), PARTIAL_LINE_LIMIT + 1);
        assert!(lines.rest().is_empty());
    }

    fn escaped(chunks: &[&[u8]]) -> String {
        let (mut e, mut out) = (TerminalEscaper::default(), Vec::new());
        for c in chunks {
            e.push(c, &mut out);
        }
        e.finish(&mut out);
        String::from_utf8(out).unwrap()
    }

    /// A guest program's ESC sequences, lone carriage returns and C1
    /// controls reach the terminal escaped, byte by byte as the UART delivers them; text,
    /// newlines and the tty's `\r\n` do not change.
    #[test]
    fn console_control_bytes_are_escaped_one_byte_at_a_time() {
        let raw: &[u8] = b"ok\r\n\x1b[2Jx\rforged\x07\tt\x7f \xc2\x9b1m \xc3\xa9\xc2\xa0\r";
        let want = "ok\r\n\\x1b[2Jx\\x0dforged\\x07\tt\\x7f \\xc2\\x9b1m \u{e9}\u{a0}\\x0d";
        assert_eq!(escaped(&[raw]), want);
        let bytes: Vec<&[u8]> = raw.chunks(1).collect();
        assert_eq!(escaped(&bytes), want);
    }

    #[test]
    fn the_tail_is_escaped() {
        let log = ConsoleLog::default();
        let mut w = ConsoleWriter::new(log.clone(), ConsoleOutput::Discard);
        w.write_all(b"one\r\n\x1b]0;title\x07two\n").unwrap();
        assert_eq!(log.tail(2), "one\r\n\\x1b]0;title\\x07two\n");
        assert!(log.contents().contains('\x1b'), "the log itself keeps the bytes");
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
