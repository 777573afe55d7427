//! The port-I/O devices: a 16550 UART for the console, enough of the i8042 to reset the
//! machine, a CMOS clock, and the hvprobe signal ports the bundled guest's init writes.
//! Interrupt controllers and the PIT live in KVM.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::console::ConsoleWriter;

pub const SERIAL_PORT_BASE: u16 = 0x3f8;
pub const SERIAL_IRQ: u32 = 4;
pub const SERIAL_PORT_COUNT: u16 = 8;
const I8042_DATA: u16 = 0x60;
const I8042_COMMAND: u16 = 0x64;
const I8042_CMD_RESET: u8 = 0xfe;
pub const CMOS_INDEX: u16 = 0x70;
const CMOS_DATA: u16 = 0x71;

/// Port the bundled guest's init writes events to (one byte, see [`GuestEvent`]).
pub const GUEST_EVENT_PORT: u16 = 0x0ef0;
/// Port the bundled guest's init writes the workload's exit status to; ends the VM.
pub const GUEST_EXIT_PORT: u16 = 0x0ef1;

/// An event the guest signalled on [`GUEST_EVENT_PORT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestEvent {
    /// `/init` started: the end of the kernel's boot.
    InitReached,
    /// The workload started.
    WorkloadStarted,
    /// Wait mode (`hvprobe.wait`): init is ready to read a workload from the console.
    ReadyForWorkload,
    Other(u8),
}

impl From<u8> for GuestEvent {
    fn from(v: u8) -> Self {
        match v {
            1 => GuestEvent::InitReached,
            2 => GuestEvent::WorkloadStarted,
            3 => GuestEvent::ReadyForWorkload,
            v => GuestEvent::Other(v),
        }
    }
}

/// What a port access asks of the VM.
#[derive(Debug, PartialEq, Eq)]
pub enum IoAction {
    Continue,
    Event(GuestEvent),
    /// The guest reported an exit status and is done.
    GuestExit(u8),
    /// The guest reset the machine (i8042 reset line): reboot, `reboot=k` panic reboot.
    Reset,
}

/// Raises an interrupt through an irqfd.
pub struct IrqLine(pub EventFd);

impl Trigger for IrqLine {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub type ConsoleSerial = Serial<IrqLine, vm_superio::serial::NoEvents, ConsoleWriter>;

const UART_IER: u8 = 1;
const UART_IIR: u8 = 2;
const UART_LCR: u8 = 3;
const UART_LSR: u8 = 5;
const UART_IER_RDI: u8 = 0x01;
const UART_LSR_DR: u8 = 0x01;
const UART_LCR_DLAB: u8 = 0x80;

/// vm-superio drops the "received data" identification on every read of the data register
/// and on every IIR read, even with bytes left in the FIFO. A real 16550 keeps reporting
/// them, and Linux's 8250 driver relies on it: it stops after 256 bytes per interrupt and
/// only reads more when IIR says so, so a long burst of input (more than the driver takes
/// in one go while the host refills the FIFO) stalled for good. Rewriting IER with its own
/// value is vm-superio's public way to re-raise the pending condition.
fn reassert_pending_rx(serial: &mut ConsoleSerial) {
    let fifo_has_data = serial.read(UART_LSR) & UART_LSR_DR != 0;
    if !fifo_has_data || serial.read(UART_LCR) & UART_LCR_DLAB != 0 {
        return;
    }
    let ier = serial.read(UART_IER);
    if ier & UART_IER_RDI != 0 {
        if let Err(e) = serial.write(UART_IER, ier) {
            tracing::warn!("serial console interrupt failed: {e}");
        }
    }
}

pub struct PortDevices {
    pub serial: Mutex<ConsoleSerial>,
    cmos_index: Mutex<u8>,
}

impl PortDevices {
    /// Devices whose CMOS index register holds `cmos_index` (a restored snapshot's).
    pub fn with_cmos_index(serial: ConsoleSerial, cmos_index: u8) -> Self {
        PortDevices {
            serial: Mutex::new(serial),
            cmos_index: Mutex::new(cmos_index),
        }
    }

    /// The CMOS index register (the only CMOS state: the clock itself is the host's).
    pub fn cmos_index(&self) -> u8 {
        *self.cmos_index.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn read(&self, port: u16, data: &mut [u8]) {
        data.fill(0xff);
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + SERIAL_PORT_COUNT).contains(&p) => {
                let offset = (p - SERIAL_PORT_BASE) as u8;
                let mut serial = self.serial.lock().unwrap_or_else(|e| e.into_inner());
                if offset == UART_IIR {
                    reassert_pending_rx(&mut serial);
                }
                data[0] = serial.read(offset);
            }
            // Status: output buffer empty, input buffer empty: the reset command goes through.
            I8042_COMMAND => data[0] = 0,
            I8042_DATA => data[0] = 0,
            CMOS_DATA => {
                let index = *self.cmos_index.lock().unwrap_or_else(|e| e.into_inner());
                data[0] = cmos_register(index & 0x7f, SystemTime::now());
            }
            _ => {}
        }
    }

    pub fn write(&self, port: u16, data: &[u8]) -> IoAction {
        let Some(&value) = data.first() else {
            return IoAction::Continue;
        };
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + SERIAL_PORT_COUNT).contains(&p) => {
                let mut serial = self.serial.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = serial.write((p - SERIAL_PORT_BASE) as u8, value) {
                    tracing::warn!("serial console write failed: {e}");
                }
            }
            I8042_COMMAND if value == I8042_CMD_RESET => return IoAction::Reset,
            CMOS_INDEX => *self.cmos_index.lock().unwrap_or_else(|e| e.into_inner()) = value,
            GUEST_EVENT_PORT => return IoAction::Event(GuestEvent::from(value)),
            GUEST_EXIT_PORT => return IoAction::GuestExit(value),
            _ => {}
        }
        IoAction::Continue
    }
}

fn bcd(v: u64) -> u8 {
    (((v / 10) << 4) | (v % 10)) as u8
}

/// A read-only MC146818 CMOS clock showing the host's UTC time, in BCD, 24-hour mode,
/// never "update in progress".
fn cmos_register(index: u8, now: SystemTime) -> u8 {
    let secs = now.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = secs / 86400;
    let (year, month, day) = civil_from_days(days as i64);
    match index {
        0x00 => bcd(secs % 60),
        0x02 => bcd(secs / 60 % 60),
        0x04 => bcd(secs / 3600 % 24),
        0x06 => bcd((days + 4) % 7 + 1),
        0x07 => bcd(day),
        0x08 => bcd(month),
        0x09 => bcd(year % 100),
        0x32 => bcd(year / 100),
        0x0a => 0x26,
        0x0b => 0x02,
        0x0d => 0x80,
        _ => 0,
    }
}

/// (year, month, day) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (u64, u64, u64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y as u64, m as u64, d as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cmos_shows_the_time_in_bcd() {
        // 2026-11-21 22:11:36 UTC, a Saturday.
        let t = UNIX_EPOCH + Duration::from_secs(1_795_299_096);
        assert_eq!(cmos_register(0x00, t), 0x36);
        assert_eq!(cmos_register(0x02, t), 0x11);
        assert_eq!(cmos_register(0x04, t), 0x22);
        assert_eq!(cmos_register(0x07, t), 0x21);
        assert_eq!(cmos_register(0x08, t), 0x11);
        assert_eq!(cmos_register(0x09, t), 0x26);
        assert_eq!(cmos_register(0x32, t), 0x20);
        assert_eq!(cmos_register(0x06, t), 7);
        assert_eq!(cmos_register(0x0a, t) & 0x80, 0);
    }

    #[test]
    fn serial_keeps_reporting_received_data_until_the_fifo_is_drained() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let serial = Serial::new(
            IrqLine(irq.try_clone().unwrap()),
            ConsoleWriter::new(Default::default(), crate::console::ConsoleOutput::Discard),
        );
        let dev = PortDevices::with_cmos_index(serial, 0);
        let base = SERIAL_PORT_BASE;
        dev.write(base + u16::from(UART_IER), &[UART_IER_RDI]);
        dev.serial.lock().unwrap().enqueue_raw_bytes(b"abc").unwrap();
        let mut b = [0u8];
        let iir = |dev: &PortDevices| {
            let mut b = [0u8];
            dev.read(base + u16::from(UART_IIR), &mut b);
            b[0] & 0x0f
        };
        const IIR_RDA: u8 = 0x04;
        const IIR_NONE: u8 = 0x01;
        assert_eq!(iir(&dev), IIR_RDA);
        dev.read(base, &mut b);
        assert_eq!(b[0], b'a');
        // Two bytes remain: the driver's next look at IIR must still find them.
        assert_eq!(iir(&dev), IIR_RDA);
        assert_eq!(iir(&dev), IIR_RDA);
        dev.read(base, &mut b);
        dev.read(base, &mut b);
        assert_eq!(b[0], b'c');
        assert_eq!(iir(&dev), IIR_NONE);
        assert!(irq.read().unwrap() > 0, "the pending data raised the interrupt again");
    }

    #[test]
    fn guest_ports_map_to_actions() {
        let serial = Serial::new(
            IrqLine(EventFd::new(0).unwrap()),
            ConsoleWriter::new(Default::default(), crate::console::ConsoleOutput::Discard),
        );
        let dev = PortDevices::with_cmos_index(serial, 0);
        assert_eq!(
            dev.write(GUEST_EVENT_PORT, &[1]),
            IoAction::Event(GuestEvent::InitReached)
        );
        assert_eq!(
            dev.write(GUEST_EVENT_PORT, &[3]),
            IoAction::Event(GuestEvent::ReadyForWorkload)
        );
        assert_eq!(dev.write(GUEST_EXIT_PORT, &[3]), IoAction::GuestExit(3));
        dev.write(CMOS_INDEX, &[0x8b]);
        assert_eq!(dev.cmos_index(), 0x8b);
        assert_eq!(dev.write(I8042_COMMAND, &[0xfe]), IoAction::Reset);
        assert_eq!(dev.write(I8042_COMMAND, &[0xaa]), IoAction::Continue);
        let mut b = [0u8];
        dev.read(0x1234, &mut b);
        assert_eq!(b[0], 0xff);
    }
}
