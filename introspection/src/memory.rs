//! Reading guest-virtual memory.
//!
//! Two readers implement [`GuestVirtRead`]: [`PagedGuestMemory`] walks the guest's own page
//! tables over guest-physical memory (a running guest), and [`ElfImage`] maps a vmlinux
//! file's loadable segments at their virtual addresses (the same kernel, offline), which is
//! how the code that reads kernel data structures is tested without booting anything.

use std::ops::Range;
use std::path::Path;

use goblin::elf::program_header::PT_LOAD;
use goblin::elf::Elf;
use hvprobe_arch::paging::{PageWalker, PagingMode, PhysAccessError, PhysRead, PhysWrite, Translation, WalkError};
use hvprobe_arch::{Gpa, Gva};

/// Why a guest-virtual read failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    #[error("guest virtual address {0} is not mapped")]
    Unmapped(Gva),
    #[error("guest physical address {0:#x} (for virtual {1}) is outside guest memory")]
    OutsideMemory(u64, Gva),
    #[error("page walk failed: {0}")]
    Walk(#[from] WalkError),
    #[error("accessing guest physical {gpa} (for virtual {gva}) failed: {source}")]
    PhysAccess {
        gpa: Gpa,
        gva: Gva,
        #[source]
        source: PhysAccessError,
    },
    #[error("a {len}-byte access at {gva} wraps around the end of the address space")]
    Wraps { gva: Gva, len: usize },
    #[error(
        "the guest's page tables map {gva} to guest physical {gpa}, inside memory the host reserves for itself: \
         the host does not write there through the guest's tables"
    )]
    ReservedTarget { gva: Gva, gpa: Gpa },
    #[error(
        "the guest's page tables map kernel text at {gva} to guest physical {gpa}, not to {text} where the \
         kernel's text is: the host writes text only there"
    )]
    TextMoved { gva: Gva, gpa: Gpa, text: Gpa },
    #[error("a {len}-byte access at {gva} runs past the end of the host's out-of-line area")]
    PastHostArea { gva: Gva, len: usize },
    #[error(
        "a {len}-byte text write at {gva} reaches into memory the host keeps for itself (the out-of-line area): \
         the host writes its own code there, never the guest's text"
    )]
    TextIntoHostArea { gva: Gva, len: usize },
}

/// Something that reads guest-virtual memory (a live guest through its page tables, or a
/// vmlinux file's loaded sections in tests). Reads may cross page boundaries.
pub trait GuestVirtRead {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError>;

    fn read_u64(&self, gva: Gva) -> Result<u64, MemoryError> {
        let mut b = [0u8; 8];
        self.read_virt(gva, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_u32(&self, gva: Gva) -> Result<u32, MemoryError> {
        let mut b = [0u8; 4];
        self.read_virt(gva, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
}

impl<T: GuestVirtRead + ?Sized> GuestVirtRead for &T {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        (**self).read_virt(gva, buf)
    }
}

/// Checks that `len` bytes from `gva` do not run past 2^64 and returns the end.
fn access_end(gva: Gva, len: usize) -> Result<u64, MemoryError> {
    gva.0.checked_add(len as u64).ok_or(MemoryError::Wraps { gva, len })
}

/// Guest-virtual memory of a running guest: every page is translated through the page
/// tables rooted at `cr3`, separately, because virtually contiguous pages are in general
/// not physically contiguous.
pub struct PagedGuestMemory<M> {
    phys: M,
    cr3: u64,
    walker: PageWalker,
}

impl<M: PhysRead> PagedGuestMemory<M> {
    pub fn new(phys: M, cr3: u64, mode: PagingMode) -> Self {
        PagedGuestMemory {
            phys,
            cr3,
            walker: PageWalker::new(mode),
        }
    }

    /// Walks with a walker configured by the caller (e.g. a MAXPHYADDR of its own: the
    /// `guest_pagewalk` fuzz target).
    pub fn with_walker(phys: M, cr3: u64, walker: PageWalker) -> Self {
        PagedGuestMemory { phys, cr3, walker }
    }

    pub fn cr3(&self) -> u64 {
        self.cr3
    }

    pub fn mode(&self) -> PagingMode {
        self.walker.mode()
    }

    pub fn phys(&self) -> &M {
        &self.phys
    }

    /// The translation of one address, with the walk's permissions.
    pub fn translate(&self, gva: Gva) -> Result<Translation, MemoryError> {
        Ok(self.walker.translate(&self.phys, self.cr3, gva)?)
    }

    /// Splits `[gva, gva+len)` into physically contiguous pieces: (gpa, offset in the
    /// buffer, length). Translating everything before touching memory means a write never
    /// stops half-way because a later page is unmapped.
    fn pieces(&self, gva: Gva, len: usize) -> Result<Vec<(Gpa, Gva, Range<usize>)>, MemoryError> {
        access_end(gva, len)?;
        let mut pieces = Vec::new();
        let mut done = 0usize;
        while done < len {
            let at = Gva(gva.0 + done as u64);
            let t = self.translate(at)?;
            let n = usize::try_from(t.bytes_to_page_end())
                .unwrap_or(usize::MAX)
                .min(len - done);
            pieces.push((t.gpa, at, done..done + n));
            done += n;
        }
        Ok(pieces)
    }
}

impl<M: PhysRead> GuestVirtRead for PagedGuestMemory<M> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        for (gpa, at, range) in self.pieces(gva, buf.len())? {
            self.phys
                .read_phys(gpa, &mut buf[range])
                .map_err(|source| MemoryError::PhysAccess { gpa, gva: at, source })?;
        }
        Ok(())
    }
}

impl<M: PhysRead + PhysWrite> PagedGuestMemory<M> {
    /// Writes `data` at `gva`, ignoring the guest's write protection (kernel text is
    /// read-only to the guest; the host patches it through guest-physical memory). All
    /// pages are translated first, so an unmapped page fails the write before any byte
    /// changes.
    pub fn write_virt(&self, gva: Gva, data: &[u8]) -> Result<(), MemoryError> {
        self.write_virt_checked(gva, data, &|_, _, _| Ok(()))
    }

    /// [`write_virt`](Self::write_virt) where `check` sees every physically contiguous
    /// piece (its virtual address, the guest physical address the guest's tables give it,
    /// its length) before any byte is written: a refusal there changes nothing. A guest
    /// controls its tables, so this is where the host refuses to be steered (into memory
    /// it keeps for itself, say).
    pub fn write_virt_checked(
        &self,
        gva: Gva,
        data: &[u8],
        check: &dyn Fn(Gva, Gpa, usize) -> Result<(), MemoryError>,
    ) -> Result<(), MemoryError> {
        let pieces = self.pieces(gva, data.len())?;
        for (gpa, at, range) in &pieces {
            check(*at, *gpa, range.len())?;
        }
        for (gpa, at, range) in pieces {
            self.phys
                .write_phys(gpa, &data[range])
                .map_err(|source| MemoryError::PhysAccess { gpa, gva: at, source })?;
        }
        Ok(())
    }
}

/// Why a vmlinux file could not be used as a memory image.
#[derive(Debug, thiserror::Error)]
pub enum ElfImageError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a usable ELF file: {0}")]
    Parse(String),
    #[error(
        "PT_LOAD segment {index} (file offset {offset:#x}, {filesz:#x} bytes) lies outside the {file_len:#x}-byte file"
    )]
    SegmentOutsideFile {
        index: usize,
        offset: u64,
        filesz: u64,
        file_len: usize,
    },
    #[error("PT_LOAD segment {index} has a file size {filesz:#x} larger than its memory size {memsz:#x}")]
    FileLargerThanMemory { index: usize, filesz: u64, memsz: u64 },
    #[error("PT_LOAD segment {index} at {vaddr:#x} ({memsz:#x} bytes) wraps around the address space")]
    SegmentWraps { index: usize, vaddr: u64, memsz: u64 },
    #[error("the ELF file has no PT_LOAD segment")]
    NoSegments,
}

#[derive(Clone, Debug)]
struct Segment {
    vaddr: u64,
    memsz: u64,
    file_offset: usize,
    filesz: usize,
}

/// A vmlinux file's loadable segments at the virtual addresses the running kernel has them
/// at (before any KASLR slide). Bytes past a segment's file size (`.bss`, `.brk`) read as
/// zeros; addresses outside every segment are unmapped.
pub struct ElfImage {
    data: Vec<u8>,
    segments: Vec<Segment>,
}

impl ElfImage {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ElfImageError> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|source| ElfImageError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(data)
    }

    pub fn from_bytes(data: Vec<u8>) -> Result<Self, ElfImageError> {
        let elf = Elf::parse_header(&data).map_err(|e| ElfImageError::Parse(e.to_string()))?;
        let container = elf.container().map_err(|e| ElfImageError::Parse(e.to_string()))?;
        let endian = elf.endianness().map_err(|e| ElfImageError::Parse(e.to_string()))?;
        let phoff = usize::try_from(elf.e_phoff).map_err(|e| ElfImageError::Parse(e.to_string()))?;
        let phdrs = goblin::elf::ProgramHeader::parse(
            &data,
            phoff,
            usize::from(elf.e_phnum),
            goblin::container::Ctx::new(container, endian),
        )
        .map_err(|e| ElfImageError::Parse(format!("program headers: {e}")))?;

        let loads: Vec<_> = phdrs.iter().filter(|p| p.p_type == PT_LOAD).collect();
        // The per-CPU template (`.data..percpu`) is linked at virtual address 0 so that
        // per-CPU symbols are offsets, but it is loaded right after `.data`, where the
        // running kernel has it (`__per_cpu_load`). Such a segment is mapped at its
        // physical load address translated by the offset of the kernel-half segments.
        let kernel_delta = loads
            .iter()
            .find(|p| p.p_vaddr >= 1 << 63)
            .map(|p| p.p_vaddr.wrapping_sub(p.p_paddr));

        let mut segments = Vec::new();
        for (index, p) in loads.iter().enumerate() {
            if p.p_filesz > p.p_memsz {
                return Err(ElfImageError::FileLargerThanMemory {
                    index,
                    filesz: p.p_filesz,
                    memsz: p.p_memsz,
                });
            }
            let in_file = p
                .p_offset
                .checked_add(p.p_filesz)
                .is_some_and(|end| end <= data.len() as u64);
            if !in_file {
                return Err(ElfImageError::SegmentOutsideFile {
                    index,
                    offset: p.p_offset,
                    filesz: p.p_filesz,
                    file_len: data.len(),
                });
            }
            let vaddr = match kernel_delta {
                Some(delta) if p.p_vaddr < 1 << 63 => p.p_paddr.wrapping_add(delta),
                _ => p.p_vaddr,
            };
            if vaddr.checked_add(p.p_memsz).is_none() {
                return Err(ElfImageError::SegmentWraps {
                    index,
                    vaddr,
                    memsz: p.p_memsz,
                });
            }
            segments.push(Segment {
                vaddr,
                memsz: p.p_memsz,
                // Both fit: checked against the file length above.
                file_offset: p.p_offset as usize,
                filesz: p.p_filesz as usize,
            });
        }
        if segments.is_empty() {
            return Err(ElfImageError::NoSegments);
        }
        segments.sort_by_key(|s| s.vaddr);
        Ok(ElfImage { data, segments })
    }

    /// The virtual ranges that read successfully, in address order.
    pub fn mapped_ranges(&self) -> Vec<Range<Gva>> {
        self.segments
            .iter()
            .map(|s| Gva(s.vaddr)..Gva(s.vaddr + s.memsz))
            .collect()
    }

    /// The whole file (for parsing symbols from the same bytes).
    pub fn file_bytes(&self) -> &[u8] {
        &self.data
    }

    fn segment_at(&self, addr: u64) -> Option<&Segment> {
        let i = self.segments.partition_point(|s| s.vaddr <= addr);
        let s = self.segments.get(i.checked_sub(1)?)?;
        (addr - s.vaddr < s.memsz).then_some(s)
    }
}

impl GuestVirtRead for ElfImage {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), MemoryError> {
        access_end(gva, buf.len())?;
        let mut done = 0usize;
        while done < buf.len() {
            let addr = gva.0 + done as u64;
            let seg = self.segment_at(addr).ok_or(MemoryError::Unmapped(Gva(addr)))?;
            let off = addr - seg.vaddr;
            let n = usize::try_from(seg.memsz - off)
                .unwrap_or(usize::MAX)
                .min(buf.len() - done);
            let out = &mut buf[done..done + n];
            // The file-backed part of this piece, then the zero-filled tail.
            let file_n = usize::try_from(off)
                .ok()
                .and_then(|o| seg.filesz.checked_sub(o))
                .unwrap_or(0)
                .min(n);
            if file_n > 0 {
                let start = seg.file_offset + off as usize;
                out[..file_n].copy_from_slice(&self.data[start..start + file_n]);
            }
            out[file_n..].fill(0);
            done += n;
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "test-support"))]
mod bytes_at;
#[cfg(any(test, feature = "test-support"))]
mod sparse;
#[cfg(any(test, feature = "test-support"))]
pub use bytes_at::BytesAt;
#[cfg(any(test, feature = "test-support"))]
pub use sparse::SparseMemory;

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Guest-physical memory as a map of 4 KiB frames; absent frames fail.
    #[derive(Default)]
    struct Frames(RefCell<HashMap<u64, Vec<u8>>>);

    impl Frames {
        fn frame(&self, gpa: u64) {
            self.0.borrow_mut().insert(gpa, vec![0; 0x1000]);
        }
        fn put_u64(&self, gpa: u64, v: u64) {
            let mut frames = self.0.borrow_mut();
            let f = frames.get_mut(&(gpa & !0xfff)).expect("frame exists");
            let o = (gpa & 0xfff) as usize;
            f[o..o + 8].copy_from_slice(&v.to_le_bytes());
        }
    }

    impl PhysRead for Frames {
        fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
            let frames = self.0.borrow();
            let not_memory = PhysAccessError::NotMemory { gpa, len: buf.len() };
            let f = frames.get(&(gpa.0 & !0xfff)).ok_or(not_memory.clone())?;
            let o = (gpa.0 & 0xfff) as usize;
            let src = f.get(o..o + buf.len()).ok_or(not_memory)?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    impl PhysWrite for Frames {
        fn write_phys(&self, gpa: Gpa, data: &[u8]) -> Result<(), hvprobe_arch::paging::PhysAccessError> {
            let mut frames = self.0.borrow_mut();
            let not_memory = PhysAccessError::NotMemory { gpa, len: data.len() };
            let f = frames.get_mut(&(gpa.0 & !0xfff)).ok_or(not_memory.clone())?;
            let o = (gpa.0 & 0xfff) as usize;
            let dst = f.get_mut(o..o + data.len()).ok_or(not_memory)?;
            dst.copy_from_slice(data);
            Ok(())
        }
    }

    const VA: u64 = 0xffff_ffff_8100_0000;

    /// Maps VA, VA+4K, VA+8K to frames 0x9000, 0x5000 (backwards, so that a reader that
    /// assumed physical contiguity would read the wrong bytes) and leaves VA+12K unmapped.
    fn two_pages() -> Frames {
        let m = Frames::default();
        for f in [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x9000] {
            m.frame(f);
        }
        let p = 0x3; // present | writable
        m.put_u64(0x1000 + ((VA >> 39) & 0x1ff) * 8, 0x2000 | p);
        m.put_u64(0x2000 + ((VA >> 30) & 0x1ff) * 8, 0x3000 | p);
        m.put_u64(0x3000 + ((VA >> 21) & 0x1ff) * 8, 0x4000 | p);
        m.put_u64(0x4000 + ((VA >> 12) & 0x1ff) * 8, 0x9000 | p);
        m.put_u64(0x4000 + (((VA >> 12) + 1) & 0x1ff) * 8, 0x5000 | p);
        m
    }

    #[test]
    fn reads_and_writes_cross_pages_through_separate_translations() {
        let mem = PagedGuestMemory::new(two_pages(), 0x1000, PagingMode::Level4);
        let data: Vec<u8> = (0..32u8).collect();
        mem.write_virt(Gva(VA + 0xff0), &data)
            .expect("write across the boundary");
        {
            let frames = mem.phys().0.borrow();
            assert_eq!(&frames[&0x9000][0xff0..], &data[..16]);
            assert_eq!(&frames[&0x5000][..16], &data[16..]);
        }
        let mut back = [0u8; 32];
        mem.read_virt(Gva(VA + 0xff0), &mut back)
            .expect("read across the boundary");
        assert_eq!(&back[..], &data[..]);
        assert_eq!(
            mem.read_u32(Gva(VA + 0xffe)).expect("u32"),
            u32::from_le_bytes([14, 15, 16, 17])
        );
        let t = mem.translate(Gva(VA + 0x1004)).expect("mapped");
        assert_eq!(t.gpa, Gpa(0x5004));
    }

    /// A write whose check refuses one of its pages (the guest's
    /// tables map it into memory the host keeps for itself) changes no byte, on any page.
    #[test]
    fn a_write_refused_for_one_page_changes_no_page() {
        let mem = PagedGuestMemory::new(two_pages(), 0x1000, PagingMode::Level4);
        let reserved = |at: Gva, gpa: Gpa, _len: usize| {
            if gpa.0 & !0xfff == 0x5000 {
                Err(MemoryError::ReservedTarget { gva: at, gpa })
            } else {
                Ok(())
            }
        };
        let err = mem
            .write_virt_checked(Gva(VA + 0xffe), &[0xcc; 4], &reserved)
            .unwrap_err();
        assert!(
            matches!(err, MemoryError::ReservedTarget { gva, gpa } if gva == Gva(VA + 0x1000) && gpa == Gpa(0x5000)),
            "{err:?}"
        );
        assert_eq!(&mem.phys().0.borrow()[&0x9000][0xffe..], &[0, 0]);
        assert_eq!(&mem.phys().0.borrow()[&0x5000][..2], &[0, 0]);
        mem.write_virt_checked(Gva(VA + 0xffe), &[0xcc; 4], &|_, _, _| Ok(()))
            .unwrap();
        assert_eq!(&mem.phys().0.borrow()[&0x5000][..2], &[0xcc, 0xcc]);
    }

    #[test]
    fn a_write_into_an_unmapped_page_changes_nothing() {
        let mem = PagedGuestMemory::new(two_pages(), 0x1000, PagingMode::Level4);
        let err = mem.write_virt(Gva(VA + 0x1ffe), &[0xcc; 4]).unwrap_err();
        assert!(
            matches!(err, MemoryError::Walk(WalkError::NotPresent { level: 1, .. })),
            "{err:?}"
        );
        assert_eq!(&mem.phys().0.borrow()[&0x5000][0xffe..], &[0, 0]);
        let mut b = [0u8; 2];
        assert!(mem.read_virt(Gva(VA + 0x2000), &mut b).is_err());
    }

    #[test]
    fn accesses_that_wrap_the_address_space_are_refused() {
        let mem = PagedGuestMemory::new(two_pages(), 0x1000, PagingMode::Level4);
        let mut b = [0u8; 4];
        assert_eq!(
            mem.read_virt(Gva(u64::MAX - 1), &mut b),
            Err(MemoryError::Wraps {
                gva: Gva(u64::MAX - 1),
                len: 4
            })
        );
    }

    #[test]
    fn elf_image_rejects_garbage() {
        assert!(matches!(
            ElfImage::from_bytes(vec![0u8; 64]),
            Err(ElfImageError::Parse(_))
        ));
        assert!(matches!(
            ElfImage::open("/nonexistent/vmlinux"),
            Err(ElfImageError::Io { path, .. }) if path == "/nonexistent/vmlinux"
        ));
    }
}
