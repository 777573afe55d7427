use super::*;
use crate::virtio::{DeviceSlot, MAX_DEVICES};

fn checksum_ok(bytes: &[u8]) -> bool {
    bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The table at `addr`, by its header's length.
fn table_at(tables: &[(u64, Vec<u8>)], addr: u64) -> &[u8] {
    let (_, bytes) = tables
        .iter()
        .find(|(at, _)| *at == addr)
        .unwrap_or_else(|| panic!("no table at {addr:#x}"));
    assert_eq!(u32_at(bytes, 4) as usize, bytes.len(), "length field");
    bytes
}

fn slots(n: usize) -> Vec<DeviceSlot> {
    (0..n).map(|i| DeviceSlot::of(i).unwrap()).collect()
}

#[test]
fn the_rsdp_leads_through_the_xsdt_to_a_hardware_reduced_fadt_its_dsdt_and_the_madt() {
    let tables = acpi_tables(2, &slots(2));
    let (rsdp_at, rsdp) = &tables[0];
    assert_eq!(*rsdp_at, ACPI_START);
    assert_eq!(rsdp_at % 16, 0, "Linux scans 16-byte boundaries");
    assert_eq!(&rsdp[..8], b"RSD PTR ");
    assert!(checksum_ok(&rsdp[..20]) && checksum_ok(rsdp), "RSDP checksums");
    assert_eq!(rsdp[15], 2, "revision 2: an XSDT");
    let xsdt = table_at(&tables, u64_at(rsdp, 24));
    assert_eq!(&xsdt[..4], b"XSDT");
    let entries: Vec<u64> = (36..xsdt.len()).step_by(8).map(|at| u64_at(xsdt, at)).collect();
    let signatures: Vec<&[u8]> = entries.iter().map(|&a| &table_at(&tables, a)[..4]).collect();
    assert_eq!(signatures, [&b"FACP"[..], b"APIC"]);
    let fadt = table_at(&tables, entries[0]);
    // Flags at 112: HW_REDUCED_ACPI (bit 20); X_DSDT at 140.
    assert_ne!(u32_at(fadt, 112) & (1 << 20), 0, "hardware-reduced");
    let dsdt = table_at(&tables, u64_at(fadt, 140));
    assert_eq!(&dsdt[..4], b"DSDT");
    for (at, bytes) in &tables {
        assert!(
            *at >= ACPI_START && at + bytes.len() as u64 <= ACPI_END,
            "{at:#x}+{}",
            bytes.len()
        );
        if *at != ACPI_START {
            assert!(checksum_ok(bytes), "checksum of {:?}", std::str::from_utf8(&bytes[..4]));
        }
    }
}

#[test]
fn the_madt_has_every_cpu_and_the_mp_tables_ioapic() {
    for cpus in [1u8, 2, 32] {
        let tables = acpi_tables(cpus, &[]);
        let madt = tables.iter().map(|(_, b)| b).find(|b| &b[..4] == b"APIC").unwrap();
        assert_eq!(u32_at(madt, 36), LAPIC_START as u32);
        let mut at = 44;
        let (mut lapics, mut ioapics) = (Vec::new(), Vec::new());
        while at < madt.len() {
            let (kind, len) = (madt[at], madt[at + 1] as usize);
            match kind {
                0 => {
                    assert_eq!(u32_at(madt, at + 4), 1, "enabled");
                    lapics.push(madt[at + 3]);
                }
                1 => ioapics.push((madt[at + 2], u32_at(madt, at + 4), u32_at(madt, at + 8))),
                other => panic!("unexpected MADT structure {other}"),
            }
            at += len;
        }
        assert_eq!(lapics, (0..cpus).collect::<Vec<_>>());
        assert_eq!(ioapics, [(cpus, IOAPIC_START as u32, 0)]);
    }
}

#[test]
fn the_dsdt_names_each_virtio_window_and_line_as_an_lnro0005_device() {
    let tables = acpi_tables(1, &slots(MAX_DEVICES));
    let dsdt = tables.iter().map(|(_, b)| b).find(|b| &b[..4] == b"DSDT").unwrap();
    let text = dsdt.as_slice();
    let count = |needle: &[u8]| text.windows(needle.len()).filter(|w| *w == needle).count();
    assert_eq!(count(b"LNRO0005\0"), MAX_DEVICES);
    for (index, slot) in slots(MAX_DEVICES).iter().enumerate() {
        assert_eq!(count(format!("V{index:03X}").as_bytes()), 1);
        // Memory32Fixed: tag 0x86, length 9, read-write, base, length.
        let mut memory = vec![0x86, 9, 0, 1];
        memory.extend_from_slice(&(slot.base as u32).to_le_bytes());
        memory.extend_from_slice(&(VIRTIO_MMIO_WINDOW as u32).to_le_bytes());
        assert_eq!(count(&memory), 1, "device {index}'s window");
        // Extended interrupt: tag 0x89, length 6, consumer + edge, one line.
        let mut line = vec![0x89, 6, 0, 0b11, 1];
        line.extend_from_slice(&slot.irq.to_le_bytes());
        assert_eq!(count(&line), 1, "device {index}'s line");
    }
    // No devices: the serial port alone, still a valid table.
    let tables = acpi_tables(1, &[]);
    let dsdt = tables.iter().map(|(_, b)| b).find(|b| &b[..4] == b"DSDT").unwrap();
    assert!(checksum_ok(dsdt));
    assert!(!dsdt.windows(8).any(|w| w == b"LNRO0005"));
}

/// ACPICA's disassembler (`iasl`, Debian's acpica-tools, which guest/install-deps.sh
/// installs) reads the DSDT as the devices meant and the FADT as hardware-reduced.
#[test]
fn acpicas_disassembler_reads_the_tables_as_meant() {
    let dir = std::env::temp_dir().join(format!("hvprobe-acpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tables = acpi_tables(2, &slots(2));
    let disassemble = |signature: &[u8]| -> String {
        let bytes = tables.iter().map(|(_, b)| b).find(|b| &b[..4] == signature).unwrap();
        let name = String::from_utf8_lossy(signature).to_lowercase();
        std::fs::write(dir.join(format!("{name}.dat")), bytes).unwrap();
        let out = std::process::Command::new("iasl")
            .current_dir(&dir)
            .args(["-d", &format!("{name}.dat")])
            .output()
            .unwrap_or_else(|e| panic!("cannot run iasl (install acpica-tools: guest/install-deps.sh): {e}"));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let dsl = std::fs::read_to_string(dir.join(format!("{name}.dsl"))).unwrap();
        assert!(!dsl.contains("Invalid") && !dsl.contains("Incorrect"), "{dsl}");
        dsl.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    let dsdt = disassemble(b"DSDT");
    for (index, slot) in slots(2).iter().enumerate() {
        assert!(dsdt.contains(&format!("Device (V{index:03X})")), "{dsdt}");
        assert!(
            dsdt.contains(&format!(
                "Memory32Fixed (ReadWrite, 0x{:08X}, // Address Base 0x00001000,",
                slot.base
            )),
            "{dsdt}"
        );
        assert!(
            dsdt.contains(&format!(
                "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) {{ 0x{:08X}, }}",
                slot.irq
            )),
            "{dsdt}"
        );
    }
    assert_eq!(dsdt.matches("Name (_HID, \"LNRO0005\")").count(), 2, "{dsdt}");
    // The console's port, so that a hardware-reduced kernel gives it its interrupt.
    assert!(
        dsdt.contains("Device (COM1) { Name (_HID, EisaId (\"PNP0501\")"),
        "{dsdt}"
    );
    assert!(
        dsdt.contains(
            "IO (Decode16, 0x03F8, // Range Minimum 0x03F8, // Range Maximum 0x01, // Alignment 0x08, // Length )"
        ),
        "{dsdt}"
    );
    assert!(
        dsdt.contains("Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) { 0x00000004, }"),
        "{dsdt}"
    );
    assert!(
        dsdt.contains("Device (RTC) { Name (_HID, EisaId (\"PNP0B00\")"),
        "{dsdt}"
    );
    assert!(
        dsdt.contains(
            "IO (Decode16, 0x0070, // Range Minimum 0x0070, // Range Maximum 0x01, // Alignment 0x02, // Length )"
        ),
        "{dsdt}"
    );
    let fadt = disassemble(b"FACP");
    assert!(fadt.contains("Hardware Reduced (V5) : 1"), "{fadt}");
    let madt = disassemble(b"APIC");
    assert_eq!(
        madt.matches("Subtable Type : 00 [Processor Local APIC]").count(),
        2,
        "{madt}"
    );
    assert_eq!(madt.matches("Subtable Type : 01 [I/O APIC]").count(), 1, "{madt}");
    let _ = std::fs::remove_dir_all(&dir);
}
