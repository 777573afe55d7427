//! The memory file: guest memory written as a sparse file, region by region, only the
//! pages that hold data (found with SEEK_DATA/SEEK_HOLE where the file system can say).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::{io_err, RegionRecord, SnapshotError, PAGE};

/// Writes guest memory to `path` as a sparse file laid out as `regions` says.
pub(super) fn write_memory(mem: &GuestMemoryMmap, regions: &[RegionRecord], path: &Path) -> Result<u64, SnapshotError> {
    let file = File::create(path).map_err(io_err("create", path))?;
    let total = regions.iter().map(|r| r.file_offset + r.len).max().unwrap_or(0);
    file.set_len(total).map_err(io_err("size", path))?;
    const CHUNK: usize = 2 << 20;
    let mut buf = vec![0u8; CHUNK];
    let mut written = 0;
    for r in regions {
        // RAM is a memfd: what the guest never touched is a hole in it, and reading a hole
        // through a shared mapping would allocate it. Only its data is read.
        let extents = match mem
            .find_region(GuestAddress(r.guest_addr))
            .and_then(|g| g.file_offset())
        {
            Some(backing) => data_extents(backing.file(), backing.start(), r.len),
            None => vec![(0, r.len)],
        };
        for (extent_start, extent_len) in extents {
            let mut done = extent_start;
            let end = extent_start + extent_len;
            while done < end {
                let n = (end - done).min(CHUNK as u64) as usize;
                mem.read_slice(&mut buf[..n], GuestAddress(r.guest_addr + done))
                    .map_err(crate::error::mem_err("reading it for the snapshot"))?;
                // Runs of non-zero pages are written; zero pages stay holes.
                let mut page = 0;
                while page < n {
                    if buf[page..page + PAGE].iter().all(|&b| b == 0) {
                        page += PAGE;
                        continue;
                    }
                    let start = page;
                    while page < n && buf[page..page + PAGE].iter().any(|&b| b != 0) {
                        page += PAGE;
                    }
                    file.write_all_at(&buf[start..page], r.file_offset + done + start as u64)
                        .map_err(io_err("write", path))?;
                    written += (page - start) as u64;
                }
                done += n as u64;
            }
        }
    }
    file.sync_all().map_err(io_err("sync", path))?;
    Ok(written)
}

/// The stretches (start, length), relative to `offset`, of the `len` bytes at `offset` in
/// `file` that may hold data: whole pages, found with SEEK_DATA and SEEK_HOLE; the whole
/// range when the file system cannot say.
pub(super) fn data_extents(file: &File, offset: u64, len: u64) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let seek = |from: u64, whence: libc::c_int| -> Option<u64> {
        let from = libc::off_t::try_from(from).ok()?;
        // SAFETY: lseek on a descriptor `file` keeps open; no memory is involved. The file
        // position it moves is not used by anything else (reads go through the mapping).
        let at = unsafe { libc::lseek(file.as_raw_fd(), from, whence) };
        u64::try_from(at).ok()
    };
    let end = offset.saturating_add(len);
    let mut extents = Vec::new();
    let mut at = offset;
    while at < end {
        let Some(data) = seek(at, libc::SEEK_DATA) else {
            // ENXIO: no data after `at`; any other failure: the file system cannot say.
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                return vec![(0, len)];
            }
            break;
        };
        if data >= end {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE).unwrap_or(end).min(end);
        let start = (data - offset) / PAGE as u64 * PAGE as u64;
        let stop = (hole - offset).next_multiple_of(PAGE as u64).min(len);
        if stop <= start {
            break;
        }
        extents.push((start, stop - start));
        at = offset + stop;
    }
    extents
}
