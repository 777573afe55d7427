//! The task a vCPU is running: `$comm`, pid and tgid read from the guest's `task_struct`.
//!
//! On x86-64 Linux 6.1 the running task is the per-CPU variable `current_task`
//! (`arch/x86/include/asm/current.h`; from 6.2 on it moved into `pcpu_hot`, which this code
//! does not handle). Per-CPU symbols are linked zero-based, so `current_task` in System.map
//! is an offset into a CPU's per-CPU area, whose base is in the GS base register while that
//! CPU runs kernel code (`%gs:current_task`). In user mode the kernel's GS base is parked
//! in `MSR_KERNEL_GS_BASE` (swapgs swaps the two on each kernel entry and exit), and the
//! base of CPU n is also `__per_cpu_offset[n]`.
//!
//! The offsets of `comm`, `pid` and `tgid` inside `task_struct` depend on the kernel's
//! configuration, so they come from the guest kernel's BTF ([`crate::btf`]); without it
//! `$comm` is unavailable ([`TaskError::CommUnavailable`]) rather than guessed.

use hvprobe_arch::Gva;

use crate::btf::{Btf, BtfError, Kind, TypeData};
use crate::memory::{GuestVirtRead, MemoryError};

/// Longest `comm` accepted from BTF: the kernel's is `TASK_COMM_LEN` = 16; a much larger
/// array means the BTF is not describing the field we think.
const MAX_COMM_LEN: u64 = 64;

/// Why the current task or its fields could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    #[error(
        "$comm is unavailable: the guest kernel has no BTF (__start_BTF/__stop_BTF not found); \
         build it with CONFIG_DEBUG_INFO_BTF=y to let the host read task_struct"
    )]
    CommUnavailable,
    #[error("reading the guest kernel's BTF: {0}")]
    Btf(#[from] BtfError),
    #[error("task_struct.{member} in the guest's BTF is {size} bytes; expected {expected}")]
    UnexpectedLayout {
        member: &'static str,
        size: u64,
        expected: &'static str,
    },
    #[error("task_struct.{member} in the guest's BTF is a {kind}, not a char array")]
    CommNotArray { member: &'static str, kind: &'static str },
    #[error("neither GS base ({gs_base:#x}) nor kernel GS base ({kernel_gs_base:#x}) is a kernel address")]
    NoKernelGsBase { gs_base: u64, kernel_gs_base: u64 },
    #[error("per-CPU base {base:#x} + offset {offset:#x} overflows")]
    AddressOverflow { base: u64, offset: u64 },
    #[error("current_task at {at} is NULL (per-CPU area not set up yet?)")]
    NoCurrentTask { at: Gva },
    #[error("current_task at {at} holds {value:#x}, which is not a kernel address")]
    BadTaskPointer { at: Gva, value: u64 },
    #[error("reading {what} at {at}: {source}")]
    Memory {
        what: &'static str,
        at: Gva,
        source: MemoryError,
    },
}

/// Where `comm`, `pid` and `tgid` are in the guest kernel's `task_struct`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLayout {
    pub comm_offset: u64,
    /// `TASK_COMM_LEN` of the guest (16).
    pub comm_len: u64,
    pub pid_offset: u64,
    pub tgid_offset: u64,
    /// `sizeof(struct task_struct)`.
    pub task_struct_size: u64,
}

/// What [`task_info`] reads from a `task_struct`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    /// Where its `task_struct` is (what the guest's `current` holds while it runs).
    pub address: Gva,
    /// The executable name (up to the first NUL; invalid UTF-8 replaced).
    pub comm: String,
    /// The thread id (`task_struct.pid`).
    pub pid: i32,
    /// The process id (`task_struct.tgid`).
    pub tgid: i32,
}

impl TaskLayout {
    /// The layout as the guest kernel's BTF describes it.
    pub fn from_btf(btf: &Btf) -> Result<TaskLayout, TaskError> {
        let task = btf.find_struct("task_struct")?;
        let comm = btf.member_offset("task_struct", "comm")?;
        let comm_type = btf.type_by_id(btf.resolve(comm.type_id)?)?;
        if comm_type.kind != Kind::Array || !matches!(comm_type.data, TypeData::Array { .. }) {
            return Err(TaskError::CommNotArray {
                member: "comm",
                kind: comm_type.kind.name(),
            });
        }
        if comm.size == 0 || comm.size > MAX_COMM_LEN {
            return Err(TaskError::UnexpectedLayout {
                member: "comm",
                size: comm.size,
                expected: "1..=64 (TASK_COMM_LEN is 16)",
            });
        }
        let int_member = |name: &'static str| -> Result<u64, TaskError> {
            let m = btf.member_offset("task_struct", name)?;
            if m.size != 4 || m.bitfield_size != 0 {
                return Err(TaskError::UnexpectedLayout {
                    member: name,
                    size: m.size,
                    expected: "4 (pid_t is int)",
                });
            }
            Ok(m.offset)
        };
        Ok(TaskLayout {
            comm_offset: comm.offset,
            comm_len: comm.size,
            pid_offset: int_member("pid")?,
            tgid_offset: int_member("tgid")?,
            task_struct_size: btf.type_size(task)?,
        })
    }

    /// Reads the guest kernel's BTF from its memory and takes the layout from it.
    /// `btf_bounds` are the addresses of `__start_BTF` and `__stop_BTF` (KASLR-adjusted);
    /// `None`, when the kernel has no such symbols, means it was built without BTF.
    pub fn from_guest(reader: &impl GuestVirtRead, btf_bounds: Option<(Gva, Gva)>) -> Result<TaskLayout, TaskError> {
        let (start, stop) = btf_bounds.ok_or(TaskError::CommUnavailable)?;
        TaskLayout::from_btf(&Btf::from_guest(reader, start, stop)?)
    }
}

/// Whether `addr` is in the upper (kernel) half of the x86-64 address space, for 4- and
/// 5-level paging alike.
fn is_kernel_address(addr: u64) -> bool {
    addr >> 63 == 1
}

/// The per-CPU base of the CPU a vCPU runs, from its segment state: GS base while it runs
/// kernel code (`cpl == 0`), the parked `MSR_KERNEL_GS_BASE` while it runs user code. The
/// kernel's value is recognised by being a kernel address, which also covers the few kernel
/// instructions between an entry and its `swapgs` (still the user's GS there).
pub fn select_per_cpu_base(cpl: u8, gs_base: u64, kernel_gs_base: u64) -> Result<u64, TaskError> {
    let (first, second) = if cpl == 0 {
        (gs_base, kernel_gs_base)
    } else {
        (kernel_gs_base, gs_base)
    };
    [first, second]
        .into_iter()
        .find(|&b| is_kernel_address(b))
        .ok_or(TaskError::NoKernelGsBase {
            gs_base,
            kernel_gs_base,
        })
}

/// The per-CPU base of Linux CPU `cpu`: `__per_cpu_offset[cpu]` (`per_cpu_offset_array` is
/// the KASLR-adjusted address of `__per_cpu_offset`). Independent of the GS registers.
pub fn per_cpu_base_of(reader: &impl GuestVirtRead, per_cpu_offset_array: Gva, cpu: u32) -> Result<u64, TaskError> {
    let at = per_cpu_offset_array
        .checked_add(cpu as u64 * 8)
        .ok_or(TaskError::AddressOverflow {
            base: per_cpu_offset_array.0,
            offset: cpu as u64 * 8,
        })?;
    reader.read_u64(at).map_err(|source| TaskError::Memory {
        what: "__per_cpu_offset",
        at,
        source,
    })
}

/// The `task_struct` the CPU with per-CPU base `per_cpu_base` is running:
/// `*(per_cpu_base + current_task_offset)`, where `current_task_offset` is the value of the
/// (zero-based, hence not KASLR-shifted) per-CPU symbol `current_task`.
pub fn current_task(
    reader: &impl GuestVirtRead,
    per_cpu_base: u64,
    current_task_offset: u64,
) -> Result<Gva, TaskError> {
    let at = per_cpu_base
        .checked_add(current_task_offset)
        .map(Gva)
        .ok_or(TaskError::AddressOverflow {
            base: per_cpu_base,
            offset: current_task_offset,
        })?;
    let value = reader.read_u64(at).map_err(|source| TaskError::Memory {
        what: "current_task",
        at,
        source,
    })?;
    if value == 0 {
        return Err(TaskError::NoCurrentTask { at });
    }
    if !is_kernel_address(value) {
        return Err(TaskError::BadTaskPointer { at, value });
    }
    Ok(Gva(value))
}

/// `comm`, `pid` and `tgid` of the `task_struct` at `task`.
pub fn task_info(reader: &impl GuestVirtRead, layout: &TaskLayout, task: Gva) -> Result<TaskInfo, TaskError> {
    let field = |what: &'static str, offset: u64| {
        task.checked_add(offset)
            .ok_or(TaskError::AddressOverflow { base: task.0, offset })
            .map(|at| (what, at))
    };
    let mem_err = |(what, at): (&'static str, Gva)| move |source| TaskError::Memory { what, at, source };

    let comm_at = field("task_struct.comm", layout.comm_offset)?;
    // comm_len was bounded by from_btf; a hand-made layout is capped the same way.
    let mut comm = vec![0u8; layout.comm_len.min(MAX_COMM_LEN) as usize];
    reader.read_virt(comm_at.1, &mut comm).map_err(mem_err(comm_at))?;
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());

    let pid_at = field("task_struct.pid", layout.pid_offset)?;
    let pid = reader.read_u32(pid_at.1).map_err(mem_err(pid_at))? as i32;
    let tgid_at = field("task_struct.tgid", layout.tgid_offset)?;
    let tgid = reader.read_u32(tgid_at.1).map_err(mem_err(tgid_at))? as i32;
    Ok(TaskInfo {
        address: task,
        comm: String::from_utf8_lossy(&comm[..end]).into_owned(),
        pid,
        tgid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::BytesAt;

    #[test]
    fn comm_pid_tgid_from_memory() {
        let layout = TaskLayout {
            comm_offset: 32,
            comm_len: 16,
            pid_offset: 8,
            tgid_offset: 12,
            task_struct_size: 64,
        };
        let mut bytes = vec![0u8; 64];
        bytes[8..12].copy_from_slice(&42i32.to_le_bytes());
        bytes[12..16].copy_from_slice(&(-7i32).to_le_bytes());
        bytes[32..48].copy_from_slice(b"hvprobe-loop\0xyz");
        let mem = BytesAt {
            base: 0xffff_8880_0000_0000,
            bytes,
        };
        let info = task_info(&mem, &layout, Gva(mem.base)).unwrap();
        assert_eq!((info.comm.as_str(), info.pid, info.tgid), ("hvprobe-loop", 42, -7));

        // A comm filling all 16 bytes has no NUL; invalid UTF-8 is replaced, not an error.
        let mut m = mem;
        m.bytes[32..48].copy_from_slice(b"0123456789abcd\xff\xfe");
        assert_eq!(
            task_info(&m, &layout, Gva(m.base)).unwrap().comm,
            "0123456789abcd\u{fffd}\u{fffd}"
        );

        // task_struct past the readable bytes.
        let err = task_info(&m, &layout, Gva(m.base + 40)).unwrap_err();
        assert!(
            matches!(
                err,
                TaskError::Memory {
                    what: "task_struct.comm",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn current_task_pointer_checks() {
        let base = 0xffff_8880_3fc0_0000u64;
        let mut bytes = vec![0u8; 32];
        bytes[8..16].copy_from_slice(&0xffff_8880_0123_4000u64.to_le_bytes());
        bytes[16..24].copy_from_slice(&0x0000_7fff_0000_1000u64.to_le_bytes());
        let mem = BytesAt { base, bytes };
        assert_eq!(current_task(&mem, base, 8).unwrap(), Gva(0xffff_8880_0123_4000));
        assert_eq!(
            current_task(&mem, base, 0).unwrap_err(),
            TaskError::NoCurrentTask { at: Gva(base) }
        );
        assert!(matches!(
            current_task(&mem, base, 16).unwrap_err(),
            TaskError::BadTaskPointer {
                value: 0x7fff_0000_1000,
                ..
            }
        ));
        assert!(matches!(
            current_task(&mem, base, 64).unwrap_err(),
            TaskError::Memory {
                what: "current_task",
                ..
            }
        ));
        assert!(matches!(
            current_task(&mem, u64::MAX, 8).unwrap_err(),
            TaskError::AddressOverflow { .. }
        ));
        // __per_cpu_offset[1] lives at array + 8.
        assert_eq!(per_cpu_base_of(&mem, Gva(base), 1).unwrap(), 0xffff_8880_0123_4000);
    }

    #[test]
    fn per_cpu_base_selection() {
        let kernel = 0xffff_8880_3fc0_0000;
        let user = 0x0000_7f00_1234_5000;
        // Kernel mode after swapgs, user mode, and kernel mode before swapgs.
        assert_eq!(select_per_cpu_base(0, kernel, user), Ok(kernel));
        assert_eq!(select_per_cpu_base(3, user, kernel), Ok(kernel));
        assert_eq!(select_per_cpu_base(0, user, kernel), Ok(kernel));
        assert_eq!(select_per_cpu_base(3, 0, kernel), Ok(kernel));
        assert_eq!(
            select_per_cpu_base(0, 0, user),
            Err(TaskError::NoKernelGsBase {
                gs_base: 0,
                kernel_gs_base: user
            })
        );
    }

    /// BTF with a `task_struct { long pid; long tgid; <comm> comm; }`, `comm` either
    /// `char[16]` or `void *`.
    fn odd_task_struct(comm_is_array: bool) -> Vec<u8> {
        let strings = b"\0task_struct\0pid\0tgid\0comm\0long\0char\0int\0";
        let name = |s: &str| {
            let needle = [s.as_bytes(), b"\0"].concat();
            strings.windows(needle.len()).position(|w| w == needle).unwrap() as u32
        };
        let comm_type = if comm_is_array { 5 } else { 2 };
        #[rustfmt::skip]
        let words: &[u32] = &[
            name("long"), 1 << 24, 8, (1 << 24) | 64, // 1: long
            0, 2 << 24, 0, // 2: void *
            name("char"), 1 << 24, 1, 8, // 3: char
            name("int"), 1 << 24, 4, (1 << 24) | 32, // 4: int
            0, 3 << 24, 0, 3, 4, 16, // 5: char[16]
            name("task_struct"), (4 << 24) | 3, 32, // 6
            name("pid"), 1, 0,
            name("tgid"), 1, 64,
            name("comm"), comm_type, 128,
        ];
        let types: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut blob = vec![0x9f, 0xeb, 1, 0];
        for w in [24u32, 0, types.len() as u32, types.len() as u32, strings.len() as u32] {
            blob.extend_from_slice(&w.to_le_bytes());
        }
        blob.extend_from_slice(&types);
        blob.extend_from_slice(strings);
        blob
    }

    #[test]
    fn layout_rejects_unexpected_types() {
        let btf = Btf::parse(&odd_task_struct(false)).unwrap();
        assert_eq!(
            TaskLayout::from_btf(&btf).unwrap_err(),
            TaskError::CommNotArray {
                member: "comm",
                kind: "ptr"
            }
        );
        let btf = Btf::parse(&odd_task_struct(true)).unwrap();
        assert_eq!(
            TaskLayout::from_btf(&btf).unwrap_err(),
            TaskError::UnexpectedLayout {
                member: "pid",
                size: 8,
                expected: "4 (pid_t is int)"
            }
        );
        // No task_struct at all.
        let mut b = odd_task_struct(true);
        let at = b.windows(12).position(|w| w == b"task_struct\0").unwrap();
        b[at] = b'x';
        let btf = Btf::parse(&b).unwrap();
        assert!(matches!(
            TaskLayout::from_btf(&btf),
            Err(TaskError::Btf(BtfError::StructNotFound(_)))
        ));
    }
}
