//! ACPI tables (hardware-reduced, ACPI 6.5): how a guest kernel built with ACPI learns of
//! its CPUs, its IOAPIC and the virtio-mmio devices, as firecracker and QEMU's microvm
//! tell theirs. The devices are also announced on the command line
//! (`virtio_mmio.device=`), which needs `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`: distribution
//! kernels are often built without it (Debian's are) and find the devices here instead, in
//! the DSDT, as `LNRO0005` devices that Linux's virtio_mmio driver matches. A kernel
//! without ACPI (the bundled guest's) reads the MP table and the command line and never
//! looks here.
//!
//! The tables sit in the BIOS area below 1 MiB, which the memory map reserves; the RSDP
//! is where a kernel scans for it (16-byte aligned in 0xe0000..0x100000) and is also given
//! in the boot protocol (`acpi_rsdp_addr`, PVH's `rsdp_paddr`). Hardware-reduced: no SCI,
//! no PM timer, no legacy PIC in the kernel's eyes (Linux then routes every interrupt
//! through the IOAPIC, as the MP table's guests do).

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml, AmlSink};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::devices::{CMOS_INDEX, SERIAL_IRQ, SERIAL_PORT_BASE, SERIAL_PORT_COUNT};
use crate::layout::{ACPI_END, ACPI_START, IOAPIC_START, LAPIC_START, VIRTIO_MMIO_WINDOW};
use crate::virtio::DeviceSlot;
use crate::Error;

const OEM_ID: [u8; 6] = *b"HVPRBE";
const OEM_TABLE_ID: [u8; 8] = *b"HVPROBE ";
const OEM_REVISION: u32 = 1;
/// FADT IA-PC boot architecture flags: no VGA, no MSI (there is no PCI), no ASPM
/// control; no 8042 and no legacy devices are said by leaving their bits clear.
const IAPC_BOOT_ARCH: u16 = (1 << 2) | (1 << 3) | (1 << 4);
/// The DSDT's revision: 2 and up means 64-bit integers in AML.
const DSDT_REVISION: u8 = 6;

/// The tables for `cpus` vCPUs and the virtio devices in `slots`, each at its
/// guest-physical address, the RSDP first at [`ACPI_START`].
pub fn acpi_tables(cpus: u8, slots: &[DeviceSlot]) -> Vec<(u64, Vec<u8>)> {
    let mut next = ACPI_START;
    let mut place = |bytes: Vec<u8>| {
        let at = next;
        next = (next + bytes.len() as u64).next_multiple_of(16);
        (at, bytes)
    };
    let rsdp_at = place(vec![0; core::mem::size_of::<Rsdp>()]).0;

    let dsdt = place(dsdt(slots));
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .dsdt_64(dsdt.0);
    fadt.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    let fadt = place(bytes_of(&fadt.finalize()));

    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(LAPIC_START as u32),
    );
    for cpu in 0..cpus {
        madt.add_structure(ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled));
    }
    // The MP table's IOAPIC: its id follows the CPUs', its pins are GSIs 0..24.
    madt.add_structure(IoApic::new(cpus, IOAPIC_START as u32, 0));
    let madt = place(bytes_of(&madt));

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt.0);
    xsdt.add_entry(madt.0);
    let xsdt = place(bytes_of(&xsdt));

    let rsdp = (rsdp_at, bytes_of(&Rsdp::new(OEM_ID, xsdt.0)));
    vec![rsdp, xsdt, fadt, madt, dsdt]
}

/// The DSDT: the serial port, the CMOS clock, and one `LNRO0005` device per virtio-mmio window, its
/// registers and its edge interrupt (the line's irqfd) as its resources.
///
/// The serial port must be here: a hardware-reduced kernel has no legacy interrupts, so
/// the 8250 driver's built-in COM1 gets its IRQ 4 only when ACPI names the port (a
/// `PNP0501`); without it the console takes the kernel's polled messages but no process's
/// output (measured on Debian's 6.1: nothing of the workload reached the console).
fn dsdt(slots: &[DeviceSlot]) -> Vec<u8> {
    let mut devices = Vec::new();
    {
        let ports = aml::IO::new(SERIAL_PORT_BASE, SERIAL_PORT_BASE, 1, SERIAL_PORT_COUNT as u8);
        let line = aml::Interrupt::new(true, true, false, false, SERIAL_IRQ);
        let resources = aml::ResourceTemplate::new(vec![&ports, &line]);
        let mut device = Vec::new();
        aml::Device::new(
            "COM1".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
                &aml::Name::new("_UID".into(), &aml::ZERO),
                &aml::Name::new("_CRS".into(), &resources),
            ],
        )
        .to_aml_bytes(&mut device);
        devices.push(Encoded(device));
    }
    {
        // The CMOS clock: its two ports, no interrupt (it raises none).
        let ports = aml::IO::new(CMOS_INDEX, CMOS_INDEX, 1, 2);
        let resources = aml::ResourceTemplate::new(vec![&ports]);
        let mut device = Vec::new();
        aml::Device::new(
            "RTC_".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0B00")),
                &aml::Name::new("_CRS".into(), &resources),
            ],
        )
        .to_aml_bytes(&mut device);
        devices.push(Encoded(device));
    }
    for (index, slot) in slots.iter().enumerate() {
        let registers = aml::Memory32Fixed::new(true, slot.base as u32, VIRTIO_MMIO_WINDOW as u32);
        // Consumer, edge-triggered, active high, exclusive: the line's irqfd.
        let line = aml::Interrupt::new(true, true, false, false, slot.irq);
        let resources = aml::ResourceTemplate::new(vec![&registers, &line]);
        let mut device = Vec::new();
        aml::Device::new(
            format!("V{index:03X}").as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &"LNRO0005"),
                &aml::Name::new("_UID".into(), &(index as u32)),
                &aml::Name::new("_CRS".into(), &resources),
            ],
        )
        .to_aml_bytes(&mut device);
        devices.push(Encoded(device));
    }
    let mut body = Vec::new();
    let children: Vec<&dyn Aml> = devices.iter().map(|d| d as &dyn Aml).collect();
    aml::Scope::new("\\_SB_".into(), children).to_aml_bytes(&mut body);
    let mut table = Sdt::new(*b"DSDT", 36, DSDT_REVISION, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    table.append_slice(&body);
    table.as_slice().to_vec()
}

/// AML already encoded, as a child of another object.
struct Encoded(Vec<u8>);

impl Aml for Encoded {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(&self.0);
    }
}

fn bytes_of(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

/// Writes the tables of [`acpi_tables`] into guest memory; the RSDP's address.
pub fn write_acpi_tables(mem: &GuestMemoryMmap, cpus: u8, slots: &[DeviceSlot]) -> Result<u64, Error> {
    let tables = acpi_tables(cpus, slots);
    for (at, bytes) in &tables {
        debug_assert!(at + bytes.len() as u64 <= ACPI_END);
        mem.write_slice(bytes, GuestAddress(*at))
            .map_err(crate::error::mem_err("writing the ACPI tables"))?;
    }
    Ok(ACPI_START)
}

#[cfg(test)]
mod tests;
