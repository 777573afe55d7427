//! Writing cpio archives in the "newc" format the kernel unpacks into its initramfs.
//!
//! The kernel accepts several archives one after the other, so a run's extra files (the
//! workload) are a small archive appended to the bundled guest's initramfs, which stays
//! as it was built.

/// A newc archive being written.
#[derive(Default)]
pub struct CpioWriter {
    out: Vec<u8>,
    next_inode: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;

impl CpioWriter {
    pub fn new() -> Self {
        CpioWriter {
            out: Vec::new(),
            next_inode: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        let ino = self.next_inode;
        self.next_inode += 1;
        let nlink = if mode & S_IFDIR != 0 { 2 } else { 1 };
        let fields = [
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            data.len() as u32,
            0,
            0,
            0,
            0,
            name.len() as u32 + 1,
            0,
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.out.len() % 4 != 0 {
            self.out.push(0);
        }
    }

    pub fn dir(&mut self, name: &str) {
        self.entry(name, S_IFDIR | 0o755, &[]);
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, S_IFREG | (mode & 0o7777), data);
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }
}

/// Appends `archive` to an initrd, padding so the next archive starts 4-byte aligned as
/// the kernel's unpacker requires.
pub fn append_archive(initrd: &mut Vec<u8>, archive: &[u8]) {
    while initrd.len() % 4 != 0 {
        initrd.push(0);
    }
    initrd.extend_from_slice(archive);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout_has_aligned_headers_and_a_trailer() {
        let mut w = CpioWriter::new();
        w.dir("hvprobe");
        w.file("hvprobe/workload", 0o755, b"echo hi\n");
        let a = w.finish();
        assert_eq!(&a[..6], b"070701");
        assert_eq!(a.len() % 4, 0);
        // Header of the second entry: 110 bytes of header, name "hvprobe\0" padded.
        let second = 110 + 8;
        let second = (second + 3) & !3;
        assert_eq!(&a[second..second + 6], b"070701");
        let mode = u32::from_str_radix(std::str::from_utf8(&a[second + 14..second + 22]).unwrap(), 16).unwrap();
        assert_eq!(mode, S_IFREG | 0o755);
        let size = u32::from_str_radix(std::str::from_utf8(&a[second + 54..second + 62]).unwrap(), 16).unwrap();
        assert_eq!(size, 8);
        let text = String::from_utf8_lossy(&a);
        assert!(text.contains("hvprobe/workload\0"));
        assert!(text.contains("echo hi\n"));
        assert!(text.contains("TRAILER!!!\0"));
    }

    #[test]
    fn appended_archive_starts_aligned() {
        let mut initrd = vec![1, 2, 3, 4, 5];
        append_archive(&mut initrd, b"070701");
        assert_eq!(&initrd[8..], b"070701");
        assert_eq!(&initrd[5..8], &[0, 0, 0]);
    }
}
