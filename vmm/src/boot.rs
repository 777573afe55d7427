//! Loading a kernel, its command line and initrd, and the boot information the kernel
//! reads at entry (PVH start_info for an ELF vmlinux, the zero page for a bzImage).

use std::fs::File;
use std::io::Read;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::*;
use crate::regs::EntryMode;
use crate::Error;

/// The kernel image formats we boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFormat {
    /// An uncompressed ELF vmlinux with a PVH entry note, entered in 32-bit mode. Fast on
    /// kvm_pvm (no decompressor), never KASLR-randomized.
    ElfPvh,
    /// A bzImage, entered through the 64-bit boot protocol. Its decompressor applies KASLR.
    BzImage,
}

impl std::fmt::Display for KernelFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelFormat::ElfPvh => write!(f, "ELF vmlinux via PVH"),
            KernelFormat::BzImage => write!(f, "bzImage via the 64-bit boot protocol"),
        }
    }
}

/// What the boot vCPU needs to enter the loaded kernel.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    pub format: KernelFormat,
    pub entry: EntryMode,
    /// Guest-physical address of start_info (PVH) or the zero page (bzImage).
    pub boot_info: u64,
}

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const BZIMAGE_HEADER_MAGIC: &[u8; 4] = b"HdrS";
const XLF_KERNEL_64: u16 = 1;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const BOOT_PROTOCOL_MIN: u16 = 0x0206;
/// The boot protocol that has `acpi_rsdp_addr` (2.14); older kernels scan for the RSDP.
const BOOT_PROTOCOL_ACPI_RSDP: u16 = 0x020e;

/// Tells the format of a kernel file from its first bytes, with a reason when it is none
/// we can boot.
pub fn kernel_format(path: &Path) -> Result<KernelFormat, Error> {
    let mut head = vec![0u8; 0x400];
    let mut file = File::open(path).map_err(|source| Error::KernelFile {
        path: path.into(),
        source,
    })?;
    let n = read_up_to(&mut file, &mut head).map_err(|source| Error::KernelFile {
        path: path.into(),
        source,
    })?;
    head.truncate(n);
    if head.starts_with(b"\x7fELF") {
        return Ok(KernelFormat::ElfPvh);
    }
    if head.len() >= 0x206 && &head[0x202..0x206] == BZIMAGE_HEADER_MAGIC {
        return Ok(KernelFormat::BzImage);
    }
    let reason = if n == 0 {
        "the file is empty".to_string()
    } else {
        "neither an ELF vmlinux nor a bzImage (no \"HdrS\" boot header at offset 0x202)".to_string()
    };
    Err(Error::NotAKernel {
        path: path.into(),
        reason,
    })
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// Loads kernel, command line and initrd into guest memory and writes the boot information.
pub fn load(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel_path: &Path,
    cmdline: &str,
    initrd: &[u8],
    rsdp: u64,
) -> Result<LoadedKernel, Error> {
    let format = kernel_format(kernel_path)?;
    let mut file = File::open(kernel_path).map_err(|source| Error::KernelFile {
        path: kernel_path.into(),
        source,
    })?;
    let load_err = |source| Error::KernelLoad {
        path: kernel_path.into(),
        source,
    };

    let mut kernel_cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(Error::Cmdline)?;
    kernel_cmdline.insert_str(cmdline).map_err(|_| Error::CmdlineTooLong {
        len: cmdline.len() + 1,
        max: CMDLINE_MAX_SIZE,
    })?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), &kernel_cmdline).map_err(Error::CmdlineWrite)?;

    match format {
        KernelFormat::ElfPvh => {
            let loaded = Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
            let entry = match loaded.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => addr.0,
                _ => {
                    return Err(Error::NotAKernel {
                        path: kernel_path.into(),
                        reason: "ELF kernel without a PVH entry note (needs CONFIG_PVH=y); boot its bzImage instead"
                            .into(),
                    })
                }
            };
            let initrd_at = place_initrd(mem, mem_bytes, loaded.kernel_end, u64::from(u32::MAX), initrd)?;
            write_pvh_start_info(mem, mem_bytes, initrd_at.map(|a| (a, initrd.len() as u64)), rsdp)?;
            Ok(LoadedKernel {
                format,
                entry: EntryMode::Pvh { entry },
                boot_info: PVH_INFO_START,
            })
        }
        KernelFormat::BzImage => {
            let loaded = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
            let hdr = loaded.setup_header.ok_or_else(|| Error::NotAKernel {
                path: kernel_path.into(),
                reason: "bzImage without a setup header".into(),
            })?;
            let (version, xloadflags) = (hdr.version, hdr.xloadflags);
            if version < BOOT_PROTOCOL_MIN || xloadflags & XLF_KERNEL_64 == 0 {
                return Err(Error::NotAKernel {
                    path: kernel_path.into(),
                    reason: format!(
                        "bzImage boot protocol {}.{:02} without a 64-bit entry point (needs 2.06+ and XLF_KERNEL_64)",
                        version >> 8,
                        version & 0xff
                    ),
                });
            }
            let initrd_at = place_initrd(
                mem,
                mem_bytes,
                loaded.kernel_end,
                u64::from(hdr.initrd_addr_max),
                initrd,
            )?;
            let mut params = boot_params {
                hdr,
                ..Default::default()
            };
            params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
            params.hdr.cmd_line_ptr = CMDLINE_START as u32;
            params.hdr.cmdline_size = (cmdline.len() + 1) as u32;
            if version >= BOOT_PROTOCOL_ACPI_RSDP {
                params.acpi_rsdp_addr = rsdp;
            }
            if let Some(at) = initrd_at {
                params.hdr.ramdisk_image = at as u32;
                params.hdr.ramdisk_size = initrd.len() as u32;
            }
            let map = memory_map(mem_bytes);
            for (i, (start, len, kind)) in map.iter().enumerate() {
                params.e820_table[i] = boot_e820_entry {
                    addr: start.0,
                    size: *len,
                    r#type: *kind as u32,
                };
            }
            params.e820_entries = map.len() as u8;
            LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
                &BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START)),
                mem,
            )
            .map_err(Error::BootParams)?;
            Ok(LoadedKernel {
                format,
                entry: EntryMode::Linux64 {
                    entry: loaded.kernel_load.0 + 0x200,
                },
                boot_info: ZERO_PAGE_START,
            })
        }
    }
}

/// Puts the initrd at the top of low RAM (below `addr_max`), above the kernel.
fn place_initrd(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel_end: u64,
    addr_max: u64,
    initrd: &[u8],
) -> Result<Option<u64>, Error> {
    if initrd.is_empty() {
        return Ok(None);
    }
    let top = low_ram_end(mem_bytes).min(addr_max.saturating_add(1));
    let size = initrd.len() as u64;
    let at = top.checked_sub(size).map(|a| a & !0xfff).filter(|a| *a >= kernel_end);
    let at = at.ok_or(Error::InitrdTooBig {
        size: initrd.len(),
        limit: top,
    })?;
    mem.write_slice(initrd, GuestAddress(at))
        .map_err(crate::error::mem_err("writing the initrd"))?;
    Ok(Some(at))
}

fn write_pvh_start_info(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    initrd: Option<(u64, u64)>,
    rsdp: u64,
) -> Result<(), Error> {
    let memmap: Vec<hvm_memmap_table_entry> = memory_map(mem_bytes)
        .into_iter()
        .map(|(start, len, kind)| hvm_memmap_table_entry {
            addr: start.0,
            size: len,
            type_: kind as u32,
            reserved: 0,
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        rsdp_paddr: rsdp,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        nr_modules: u32::from(initrd.is_some()),
        modlist_paddr: if initrd.is_some() { PVH_MODLIST_START } else { 0 },
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    if let Some((paddr, size)) = initrd {
        params.set_modules(
            &[hvm_modlist_entry {
                paddr,
                size,
                cmdline_paddr: 0,
                reserved: 0,
            }],
            GuestAddress(PVH_MODLIST_START),
        );
    }
    PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem).map_err(Error::BootParams)
}
