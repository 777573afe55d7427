//! Every kernel stack of a Linux guest, and a scan of them for saved code addresses.
//!
//! Before a 5-byte jump replaces instructions of the guest's kernel text (or a detour buffer
//! is torn down), no execution may be waiting to resume in the middle of those bytes: a task
//! preempted or interrupted between two of the region's instructions has the address it
//! stopped at saved on a stack, and returning there after the jump is written executes the
//! middle of the jump. Linux waits with `synchronize_rcu_tasks()` until every task has passed
//! a voluntary context switch. The host, with every vCPU paused, looks instead: it lists
//! every kernel stack of the guest ([`KernelStacks::read`]) and looks for any 8-byte word in
//! the region ([`KernelStacks::saved_addresses_in`]). The scan is conservative: it does not
//! unwind, so a stale word or a data word that happens to point there is a hit too. A false
//! hit only delays an optimization (retry later); a missed one would break the guest, so
//! every choice below errs towards scanning more. The vCPUs' own RIPs are the caller's to
//! check.
//!
//! The stacks, as Linux 6.1 on x86-64 has them (layouts from the guest's BTF, addresses from
//! its symbols; later layouts are accepted where they differ only in where a per-CPU
//! variable lives):
//! - **task stacks**: `task_struct.stack`, `THREAD_SIZE` bytes (the extent of the boot
//!   task's stack, `__start_init_task..__end_init_task`) aligned to their size. Tasks are
//!   found as the kernel's `for_each_process_thread` finds them: processes on the ring
//!   `init_task.tasks`, threads of each on `signal->thread_head` linked by `thread_node`
//!   (or, without those, the older `thread_group` ring). Idle tasks are on neither list
//!   (they have pid 0): each CPU's is `runqueues.idle` (CPU 0's is `init_task`). Each CPU's
//!   `current_task`, and every task on a CPU's CFS run queue (`runqueues.cfs_tasks`, linked
//!   by `se.group_node`) are added too: an exiting task leaves the lists before its last
//!   context switch, and on a preemptible kernel can be preempted in between.
//! - **IRQ stacks**: per-CPU `hardirq_stack_ptr` (or `pcpu_hot.hardirq_stack_ptr`) points 8
//!   bytes below the top of the CPU's `struct irq_stack`. Softirqs run on it too.
//! - **exception stacks**: per-CPU `cea_exception_stacks` points to the CPU's
//!   `struct cea_exception_stacks` in the CPU entry area; its `*_stack` members (`DF`,
//!   `NMI`, `DB`, `MCE`, `VC`, `VC2`) are the IST stacks. Pages that are not mapped (the `VC`
//!   stacks of a kernel without SEV support) cannot hold anything and are skipped.
//! - **entry stacks** (when the kernel names them): per-CPU `entry_stack_storage`, the
//!   `SYSCALL`/interrupt-from-user trampoline stack. It only ever holds user-mode frames and
//!   the entry code's own return addresses; it is scanned because it costs one page.
//!
//! What part of each stack is scanned ([`Extent`]):
//! - a task that is not on a CPU is scanned from its saved stack pointer (`thread.sp`) to the
//!   top. `__switch_to_asm` saves the stack pointer after pushing the callee-saved registers
//!   and before the switch; everything the task will return to or resume at (its call
//!   chain, and the `pt_regs` of an interrupt or exception that preempted it) lies above
//!   that, and the words below it are dead (they will be overwritten before they are read).
//!   "On a CPU" is `task_struct.on_cpu` (set for the next task before the switch, cleared
//!   for the previous one only after it, so a vCPU paused half-way through a switch has
//!   both marked) or being some CPU's `current_task`; such tasks are scanned whole, since
//!   the CPU may be running below any saved value. Without `on_cpu` in the BTF (a kernel
//!   without SMP) every task is scanned whole. A saved stack pointer outside the task's stack
//!   or misaligned also means the whole stack.
//! - an IRQ stack is skipped while the CPU's `hardirq_stack_inuse` is false: the kernel sets
//!   it before switching to the stack and clears it after switching back, with interrupts
//!   off, so nothing on the stack can be resumed while it is clear. Otherwise (or without
//!   the variable) the whole stack is scanned.
//! - exception and entry stacks are scanned whole.
//!
//! With the paused vCPUs' registers ([`KernelStacks::narrow_to_vcpu`]) a CPU's current task
//! is scanned from the vCPU's stack pointer instead (not at all in user mode), and its
//! exception stacks not at all when the vCPU is provably in no exception handler: stale
//! words there would otherwise refuse a region for as long as they stay.
//!
//! Not covered:
//! - the vCPUs' own RIPs (the caller's: a vCPU paused inside the region);
//! - return addresses the guest keeps off its stacks: the function-graph tracer's
//!   `task_struct.ret_stack` and the instances of the guest's own return probes (kretprobe,
//!   rethook). A return address points after a `call` and no region holds one, but a detour
//!   buffer that calls out would be missed while a guest return probe hooks the callee;
//! - an exiting task that has left the lists, was preempted (a preemptible kernel only) and
//!   waits on a real-time or deadline run queue: only CFS run queues are walked;
//! - kernels without SMP (no `__per_cpu_offset`: an error, not a guess).
//!
//! Nothing here trusts guest memory: every pointer is checked to be a kernel address before
//! it is followed, lists are walked forward only (as an RCU reader does, so a vCPU paused in
//! the middle of an update of the task lists, which are RCU lists, leaves them consistent;
//! a run queue's list is not, and one caught half-updated gives an error or extra tasks),
//! each list detects a repeated node, and all lists together are bounded by
//! [`StacksLayout::max_list_steps`]. An error proves nothing: retry in a later pause.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use hvprobe_arch::Gva;

use crate::btf::{Btf, BtfError, Kind, TypeData};
use crate::memory::{GuestVirtRead, MemoryError};
use crate::symbols::SymbolTable;
use crate::task::{task_info, TaskError, TaskLayout};

/// x86-64's `THREAD_SIZE` without KASAN, used only when the kernel's symbols do not give the
/// extent of the boot task's stack.
pub const DEFAULT_THREAD_SIZE: u64 = 16 << 10;
/// The most CPUs accepted (x86-64's `NR_CPUS` limit).
pub const MAX_CPUS: u32 = 8192;
/// Default bound on the nodes visited on all lists of one [`KernelStacks::read`]: two per
/// task (process and thread lists) for Linux's largest pid space (`PID_MAX_LIMIT`, 4 Mi),
/// with room for the run queues.
pub const DEFAULT_MAX_LIST_STEPS: usize = 10 << 20;
/// The largest stack accepted: a larger size means the layout is not what we think.
const MAX_STACK_SIZE: u64 = 1 << 20;
/// The most IST stacks per CPU accepted from the BTF's `struct cea_exception_stacks`:
/// x86-64 has six (DF, NMI, DB, MCE, VC, VC2); more than twice that is not that struct.
pub const MAX_EXCEPTION_STACKS: usize = 16;
/// Default bound on the bytes of all stacks one [`KernelStacks::read`] lists (each is
/// scanned whole at worst), when the host has not bounded the layout by the guest's memory
/// ([`StacksLayout::bounded_by_vm`]): 4 GiB, 256 Ki tasks' 16 KiB stacks.
pub const DEFAULT_MAX_STACK_BYTES: u64 = 4 << 30;
/// The most saved words one scan reports: a jump about to be written over a few bytes finds
/// a handful of return addresses into them on a real kernel (one per task blocked there),
/// so 64 Ki is far beyond any; past it, a guest filling its stacks with such words would
/// make the host collect (and name) every one.
pub const MAX_STACK_HITS: usize = 1 << 16;
const PAGE_SIZE: u64 = 4096;

/// Why the stacks could not be listed or scanned. Any of these means that nothing is proven:
/// the caller must not write the jump (retry later, or keep the probe unoptimized).
#[derive(Debug, thiserror::Error)]
pub enum StacksError {
    #[error("the guest kernel has no BTF (__start_BTF/__stop_BTF not found), so its task_struct cannot be read")]
    NoBtf,
    #[error("the kernel's symbols have no {0}")]
    MissingSymbol(&'static str),
    #[error("the kernel's BTF: {0}")]
    Btf(#[from] BtfError),
    #[error("task_struct: {0}")]
    Task(#[from] TaskError),
    #[error("unexpected kernel layout: {0}")]
    Layout(String),
    #[error("reading {what} at {at}: {source}")]
    Memory {
        what: &'static str,
        at: Gva,
        #[source]
        source: MemoryError,
    },
    #[error("{what} at {at} holds {value:#x}, which is not a kernel address")]
    BadPointer { what: &'static str, at: Gva, value: u64 },
    #[error("{what}: {base:#x} + {offset:#x} overflows")]
    Overflow { what: &'static str, base: u64, offset: u64 },
    #[error("the guest has {0} CPUs (nr_cpu_ids), more than the {MAX_CPUS} accepted")]
    TooManyCpus(u32),
    #[error("the {list} list loops: {node} was reached twice without coming back to the head")]
    ListCycle { list: &'static str, node: Gva },
    #[error("more than {max} list nodes visited (a corrupt task list?)")]
    TooManyNodes { max: usize },
    #[error("task {task} has its stack at {stack}, which is not aligned to its {size:#x}-byte size")]
    MisalignedStack { task: Gva, stack: Gva, size: u64 },
    /// A hostile or corrupt guest made the stack walk bigger than any real kernel's: the
    /// caller proves nothing (jump optimization is not done in this pause).
    #[error("{structure} is over its limit of {limit} {unit} (hostile or corrupt guest memory?)")]
    OverBudget {
        structure: &'static str,
        limit: u64,
        unit: &'static str,
    },
}

/// How the threads of a process are linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadLinks {
    /// `task_struct.signal->thread_head`, threads linked by `task_struct.thread_node`
    /// (Linux 3.14 on): offsets of `signal`, `signal_struct.thread_head`, `thread_node`.
    SignalThreadHead {
        signal: u64,
        thread_head: u64,
        thread_node: u64,
    },
    /// `task_struct.thread_group`, a ring through every thread of a group with no separate
    /// head (before Linux 6.7).
    ThreadGroup { thread_group: u64 },
}

/// Where a CPU's IRQ stack is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IrqStackLayout {
    /// Per-CPU offset of `hardirq_stack_ptr` (top of the stack - 8).
    pub ptr: u64,
    /// Per-CPU offset of the `bool hardirq_stack_inuse`, when the kernel has it.
    pub inuse: Option<u64>,
    /// `sizeof(struct irq_stack)` (`IRQ_STACK_SIZE`).
    pub size: u64,
}

/// One IST stack inside `struct cea_exception_stacks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExceptionStackSlot {
    /// `DF`, `NMI`, `DB`, `MCE`, `VC`, `VC2`: the member's name without `_stack`.
    pub name: String,
    pub offset: u64,
    pub size: u64,
}

/// Where a CPU's exception stacks are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExceptionStacksLayout {
    /// Per-CPU offset of the `cea_exception_stacks` pointer.
    pub ptr: u64,
    pub stacks: Vec<ExceptionStackSlot>,
}

/// How many CPUs the guest may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuCount {
    /// Read `unsigned int nr_cpu_ids` at this address.
    Variable(Gva),
    /// A fixed upper bound (`NR_CPUS`, from the size of `struct cpumask`).
    Fixed(u32),
}

/// Everything [`KernelStacks::read`] needs to know about the guest kernel: offsets from its
/// BTF and addresses from its symbols (KASLR-adjusted; per-CPU variables as the offsets
/// into a CPU's per-CPU area that their symbols are). Built once per kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StacksLayout {
    /// `comm`, `pid`, `tgid` of `task_struct`.
    pub task: TaskLayout,
    /// `task_struct.stack`.
    pub task_stack: u64,
    /// `task_struct.tasks`.
    pub task_tasks: u64,
    pub threads: ThreadLinks,
    /// `task_struct.thread.sp`.
    pub task_thread_sp: u64,
    /// `task_struct.on_cpu` (an `int`; SMP kernels only).
    pub task_on_cpu: Option<u64>,
    /// `task_struct.se.group_node`, for the CFS run queues.
    pub task_se_group_node: Option<u64>,
    /// `THREAD_SIZE`.
    pub thread_size: u64,
    /// `&init_task`.
    pub init_task: Gva,
    /// `&__per_cpu_offset[0]`.
    pub per_cpu_offset: Gva,
    pub cpu_count: CpuCount,
    /// `&__cpu_possible_mask`, when the kernel has it: impossible CPUs are skipped.
    pub possible_mask: Option<Gva>,
    /// Per-CPU offset of `current_task` (or `pcpu_hot.current_task`).
    pub current_task: u64,
    /// Per-CPU offset of `runqueues.idle`.
    pub rq_idle: u64,
    /// Per-CPU offset of `runqueues.cfs_tasks`.
    pub rq_cfs_tasks: Option<u64>,
    pub irq: IrqStackLayout,
    pub exception: ExceptionStacksLayout,
    /// Per-CPU offset and size of `entry_stack_storage`.
    pub entry_stack: Option<(u64, u64)>,
    /// Bound on the nodes visited on all lists together.
    pub max_list_steps: usize,
    /// The most CPUs whose per-CPU stacks are listed: the VM's vCPU count when the host
    /// set it ([`StacksLayout::bounded_by_vm`]); a guest's `nr_cpu_ids` beyond it names
    /// CPUs that cannot run, whose stacks hold nothing live.
    pub max_cpus: u32,
    /// Bound on the bytes of all stacks listed together (the guest's memory size when the
    /// host set it: distinct stacks fit in it, only aliased ones could exceed it).
    pub max_stack_bytes: u64,
    /// Where a task keeps the return addresses its kretprobes swapped out (a kernel with
    /// `CONFIG_RETHOOK`).
    pub rethooks: Option<RethookLayout>,
}

/// `task_struct.rethooks`, the list of `struct rethook_node`s of the calls the task's
/// kretprobes follow, latest first: each node's `ret_addr` is the return address its
/// entry swapped for `arch_rethook_trampoline`, at the stack slot `frame`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RethookLayout {
    pub task_rethooks: u64,
    pub node_llist: u64,
    pub node_ret_addr: u64,
    pub node_frame: u64,
    /// `arch_rethook_trampoline`.
    pub trampoline: Gva,
}

/// The most rethook nodes read for one task (its kretprobes' calls in flight): far more
/// than any task nests, so a longer list is corrupt.
pub const MAX_RETHOOK_NODES: usize = 4096;

/// One call a guest kretprobe follows: its return address was at `frame`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwappedReturn {
    pub frame: Gva,
    pub ret_addr: Gva,
}

/// The calls `task`'s kretprobes follow, latest first (the task's `rethooks` list).
pub fn rethook_returns(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &RethookLayout,
    task: Gva,
) -> Result<Vec<SwappedReturn>, StacksError> {
    let r = Reader { mem };
    let mut out = Vec::new();
    let mut node = r.nullable_ptr(
        "task_struct.rethooks",
        add("task_struct.rethooks", task, layout.task_rethooks)?,
    )?;
    let mut seen = HashSet::new();
    while let Some(at) = node {
        if !seen.insert(at) {
            return Err(StacksError::ListCycle {
                list: "rethooks",
                node: at,
            });
        }
        if out.len() == MAX_RETHOOK_NODES {
            return Err(StacksError::TooManyNodes { max: MAX_RETHOOK_NODES });
        }
        let rh = sub("rethook_node.llist", at, layout.node_llist)?;
        out.push(SwappedReturn {
            frame: Gva(r.u64("rethook_node.frame", add("rethook_node.frame", rh, layout.node_frame)?)?),
            ret_addr: Gva(r.u64(
                "rethook_node.ret_addr",
                add("rethook_node.ret_addr", rh, layout.node_ret_addr)?,
            )?),
        });
        // llist_node.next is its first member.
        node = r.nullable_ptr("llist_node.next", at)?;
    }
    Ok(out)
}

fn symbol(symbols: &SymbolTable, name: &'static str) -> Result<Gva, StacksError> {
    symbols
        .lookup(name)
        .map(|s| s.addr)
        .ok_or(StacksError::MissingSymbol(name))
}

/// The per-CPU offset of a variable that is either a per-CPU symbol of its own or (Linux 6.2
/// to 6.14) a member of `struct pcpu_hot`.
fn per_cpu_var(symbols: &SymbolTable, btf: &Btf, name: &'static str) -> Result<u64, StacksError> {
    if let Some(s) = symbols.lookup(name) {
        return Ok(s.addr.0);
    }
    if let (Some(hot), Ok(m)) = (symbols.lookup("pcpu_hot"), btf.member_offset("pcpu_hot", name)) {
        return hot.addr.0.checked_add(m.offset).ok_or(StacksError::Overflow {
            what: "pcpu_hot member",
            base: hot.addr.0,
            offset: m.offset,
        });
    }
    Err(StacksError::MissingSymbol(name))
}

fn checked_size(what: &str, size: u64) -> Result<u64, StacksError> {
    if size == 0 || size > MAX_STACK_SIZE || size & 7 != 0 {
        return Err(StacksError::Layout(format!(
            "{what} is {size:#x} bytes (expected a multiple of 8 up to {MAX_STACK_SIZE:#x})"
        )));
    }
    Ok(size)
}

impl StacksLayout {
    /// The layout of the kernel whose BTF is `btf` and symbols `symbols` (relocated to match
    /// the memory that will be read).
    pub fn from_btf(btf: &Btf, symbols: &SymbolTable) -> Result<StacksLayout, StacksError> {
        let task = TaskLayout::from_btf(btf)?;
        let member = |s: &str, m: &str| btf.member_offset(s, m).map(|i| i.offset);
        let threads = match (
            member("task_struct", "signal"),
            member("signal_struct", "thread_head"),
            member("task_struct", "thread_node"),
        ) {
            (Ok(signal), Ok(thread_head), Ok(thread_node)) => ThreadLinks::SignalThreadHead {
                signal,
                thread_head,
                thread_node,
            },
            _ => ThreadLinks::ThreadGroup {
                thread_group: member("task_struct", "thread_group")?,
            },
        };

        let thread_size = match (
            symbols
                .lookup("__start_init_task")
                .or_else(|| symbols.lookup("init_stack")),
            symbols.lookup("__end_init_task"),
        ) {
            (Some(start), Some(end)) => end.addr.0.saturating_sub(start.addr.0),
            _ => DEFAULT_THREAD_SIZE,
        };
        let thread_size = checked_size("THREAD_SIZE (__end_init_task - __start_init_task)", thread_size)?;
        if !thread_size.is_power_of_two() || thread_size < PAGE_SIZE {
            return Err(StacksError::Layout(format!(
                "THREAD_SIZE {thread_size:#x} is not a power of two of at least a page"
            )));
        }

        let cpu_count = match symbols.lookup("nr_cpu_ids") {
            Some(s) => CpuCount::Variable(s.addr),
            None => {
                let bits = btf.type_size(btf.find_struct("cpumask")?)?.saturating_mul(8);
                CpuCount::Fixed(u32::try_from(bits).unwrap_or(u32::MAX).min(MAX_CPUS))
            }
        };

        let runqueues = per_cpu_var(symbols, btf, "runqueues")?;
        let per_cpu_member = |base: u64, what: &'static str, offset: u64| {
            base.checked_add(offset)
                .ok_or(StacksError::Overflow { what, base, offset })
        };

        let irq_size = btf.type_size(btf.find_struct("irq_stack")?)?;
        let irq = IrqStackLayout {
            ptr: per_cpu_var(symbols, btf, "hardirq_stack_ptr")?,
            inuse: per_cpu_var(symbols, btf, "hardirq_stack_inuse").ok(),
            size: checked_size("struct irq_stack", irq_size)?,
        };

        let cea = btf.find_struct("cea_exception_stacks")?;
        let TypeData::Members(members) = &btf.type_by_id(cea)?.data else {
            return Err(StacksError::Layout("cea_exception_stacks has no members".into()));
        };
        let mut stacks = Vec::new();
        for m in members {
            let name = btf.string(m.name_off)?;
            let Some(short) = name.strip_suffix("_stack") else {
                continue;
            };
            let size = btf.type_size(m.type_id)?;
            if size == 0 {
                continue;
            }
            stacks.push(ExceptionStackSlot {
                name: short.to_string(),
                offset: u64::from(m.bit_offset / 8),
                size: checked_size(name, size)?,
            });
        }
        if stacks.is_empty() {
            return Err(StacksError::Layout("cea_exception_stacks has no *_stack member".into()));
        }
        if stacks.len() > MAX_EXCEPTION_STACKS {
            return Err(StacksError::OverBudget {
                structure: "struct cea_exception_stacks (its *_stack members)",
                limit: MAX_EXCEPTION_STACKS as u64,
                unit: "stacks",
            });
        }
        let exception = ExceptionStacksLayout {
            ptr: per_cpu_var(symbols, btf, "cea_exception_stacks")?,
            stacks,
        };

        let entry_stack = match (
            symbols.lookup("entry_stack_storage"),
            btf.find_type("entry_stack_page", Kind::Struct),
        ) {
            (Some(s), Some(t)) => Some((s.addr.0, checked_size("struct entry_stack_page", btf.type_size(t)?)?)),
            _ => None,
        };

        Ok(StacksLayout {
            task,
            task_stack: member("task_struct", "stack")?,
            task_tasks: member("task_struct", "tasks")?,
            threads,
            task_thread_sp: member("task_struct", "thread.sp")?,
            task_on_cpu: member("task_struct", "on_cpu").ok(),
            task_se_group_node: member("task_struct", "se.group_node").ok(),
            thread_size,
            init_task: symbol(symbols, "init_task")?,
            per_cpu_offset: symbol(symbols, "__per_cpu_offset")?,
            cpu_count,
            possible_mask: symbols.lookup("__cpu_possible_mask").map(|s| s.addr),
            current_task: per_cpu_var(symbols, btf, "current_task")?,
            rq_idle: per_cpu_member(runqueues, "runqueues.idle", member("rq", "idle")?)?,
            rq_cfs_tasks: match member("rq", "cfs_tasks") {
                Ok(off) => Some(per_cpu_member(runqueues, "runqueues.cfs_tasks", off)?),
                Err(_) => None,
            },
            irq,
            exception,
            entry_stack,
            max_list_steps: DEFAULT_MAX_LIST_STEPS,
            max_cpus: MAX_CPUS,
            max_stack_bytes: DEFAULT_MAX_STACK_BYTES,
            rethooks: match (
                member("task_struct", "rethooks"),
                member("rethook_node", "llist"),
                member("rethook_node", "ret_addr"),
                member("rethook_node", "frame"),
                symbols.lookup("arch_rethook_trampoline"),
            ) {
                (Ok(task_rethooks), Ok(node_llist), Ok(node_ret_addr), Ok(node_frame), Some(t)) => {
                    Some(RethookLayout {
                        task_rethooks,
                        node_llist,
                        node_ret_addr,
                        node_frame,
                        trampoline: t.addr,
                    })
                }
                _ => None,
            },
        })
    }

    /// Checks the sizes a hand-made layout could get wrong (one from
    /// [`StacksLayout::from_btf`] is checked already).
    fn validate(&self) -> Result<(), StacksError> {
        let thread_size = checked_size("THREAD_SIZE", self.thread_size)?;
        if !thread_size.is_power_of_two() {
            return Err(StacksError::Layout(format!(
                "THREAD_SIZE {thread_size:#x} is not a power of two"
            )));
        }
        checked_size("the IRQ stack", self.irq.size)?;
        if self.exception.stacks.len() > MAX_EXCEPTION_STACKS {
            return Err(StacksError::OverBudget {
                structure: "exception stacks per CPU",
                limit: MAX_EXCEPTION_STACKS as u64,
                unit: "stacks",
            });
        }
        for slot in &self.exception.stacks {
            checked_size(&slot.name, slot.size)?;
        }
        if let Some((_, size)) = self.entry_stack {
            checked_size("the entry stack", size)?;
        }
        Ok(())
    }

    /// Bounds the walk by what the host knows of the VM rather than by what the guest
    /// says: its `vcpus` (per-CPU stacks of CPUs beyond them are not listed, whatever
    /// `nr_cpu_ids` holds) and its `memory_bytes` (the stacks listed may not add up to
    /// more: distinct stacks live in the guest's memory, so only aliased or made-up ones
    /// could).
    pub fn bounded_by_vm(mut self, vcpus: u32, memory_bytes: u64) -> StacksLayout {
        self.max_cpus = vcpus.clamp(1, MAX_CPUS);
        self.max_stack_bytes = memory_bytes;
        self
    }

    /// Reads the guest kernel's BTF from its memory (`__start_BTF`..`__stop_BTF`) and takes
    /// the layout from it.
    pub fn from_guest(mem: &(impl GuestVirtRead + ?Sized), symbols: &SymbolTable) -> Result<StacksLayout, StacksError> {
        let (Some(start), Some(stop)) = (symbols.lookup("__start_BTF"), symbols.lookup("__stop_BTF")) else {
            return Err(StacksError::NoBtf);
        };
        let btf = Btf::from_guest(&mem, start.addr, stop.addr)?;
        StacksLayout::from_btf(&btf, symbols)
    }
}

/// Whose stack it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StackOwner {
    /// A task's kernel stack. `pid` is the thread id, `tgid` the process id; idle tasks
    /// have pid 0.
    Task {
        task: Gva,
        pid: i32,
        tgid: i32,
        comm: String,
    },
    /// A CPU's hard and soft IRQ stack.
    Irq { cpu: u32 },
    /// One of a CPU's IST exception stacks (`NMI`, `DB`, `DF`, `MCE`, `VC`, `VC2`).
    Exception { cpu: u32, name: String },
    /// A CPU's entry trampoline stack.
    Entry { cpu: u32 },
}

impl fmt::Display for StackOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StackOwner::Task { task, pid, tgid, comm } => {
                write!(f, "task {pid}")?;
                if tgid != pid {
                    write!(f, " (process {tgid})")?;
                }
                write!(f, " `{comm}` (task_struct {task})")
            }
            StackOwner::Irq { cpu } => write!(f, "CPU {cpu}'s IRQ stack"),
            StackOwner::Exception { cpu, name } => write!(f, "CPU {cpu}'s {name} exception stack"),
            StackOwner::Entry { cpu } => write!(f, "CPU {cpu}'s entry stack"),
        }
    }
}

/// Which part of a stack is scanned, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// All of it: a task on a CPU, an IRQ stack in use, an exception or entry stack.
    Whole,
    /// From the task's saved stack pointer to the top: a task that is switched out.
    FromSavedSp,
    /// All of it, because the task is switched out but its saved stack pointer is not
    /// inside its stack (or not aligned).
    WholeSavedSpOutside,
    /// None of it: an IRQ stack not in use, or (after [`KernelStacks::narrow_to_vcpu`])
    /// the exception stacks of a CPU that is in no exception handler.
    Unused,
    /// From a paused vCPU's stack pointer (or, for a task interrupted onto the IRQ stack,
    /// from the stack pointer saved at the IRQ stack's top) to the top: see
    /// [`KernelStacks::narrow_to_vcpu`].
    FromVcpuSp,
    /// None of it: the task runs in user mode, so its kernel stack holds nothing.
    UserMode,
}

/// One kernel stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelStack {
    pub owner: StackOwner,
    /// The whole stack.
    pub bounds: Range<Gva>,
    /// What is scanned (empty for [`Extent::Unused`]); 8-byte aligned.
    pub scan: Range<Gva>,
    pub extent: Extent,
}

impl KernelStack {
    /// Whether pages of this stack may be unmapped and are then skipped (exception stacks
    /// only: see the module documentation).
    fn may_be_unmapped(&self) -> bool {
        matches!(self.owner, StackOwner::Exception { .. })
    }

    pub fn scan_len(&self) -> u64 {
        self.scan.end.0 - self.scan.start.0
    }

    /// The stack's size (its bounds, scanned or not).
    pub fn size(&self) -> u64 {
        self.bounds.end.0.saturating_sub(self.bounds.start.0)
    }
}

/// A CPU as the stacks were read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuInfo {
    pub cpu: u32,
    /// `__per_cpu_offset[cpu]`.
    pub per_cpu_base: u64,
    /// Its `current_task`.
    pub current: Gva,
    /// Its idle task (`runqueues.idle`), once it has one.
    pub idle: Option<Gva>,
}

/// How the tasks were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskCounts {
    /// Tasks on the process and thread lists, `init_task` not counted (so this is the
    /// kernel's `nr_threads` for a consistent list).
    pub listed: usize,
    /// Idle tasks (`init_task` and every other CPU's `runqueues.idle`).
    pub idle: usize,
    /// Tasks found only as a CPU's `current_task` or on a run queue (exiting tasks).
    pub unlisted: usize,
    /// Tasks on a CPU (`on_cpu`, or some CPU's `current_task`; every task when the kernel
    /// has no `on_cpu`), scanned whole.
    pub on_cpu: usize,
    /// Tasks with no stack (`task_struct.stack` NULL: dead tasks not yet reaped).
    pub without_stack: usize,
}

/// A word on a kernel stack that lies in a scanned range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackHit {
    /// Index into [`KernelStacks::stacks`].
    pub stack: usize,
    pub owner: StackOwner,
    /// Where the word is.
    pub at: Gva,
    /// The word: an address in the range.
    pub value: Gva,
}

impl fmt::Display for StackHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} saved at {} on {}", self.value, self.at, self.owner)
    }
}

/// Every kernel stack of the guest at one moment (all vCPUs paused).
#[derive(Clone, Debug)]
pub struct KernelStacks {
    stacks: Vec<KernelStack>,
    cpus: Vec<CpuInfo>,
    tasks: TaskCounts,
}

fn is_kernel_address(v: u64) -> bool {
    v >> 63 == 1
}

/// Reads guest memory for the walk, with the reason on failure.
struct Reader<'a, M: ?Sized> {
    mem: &'a M,
}

impl<M: GuestVirtRead + ?Sized> Reader<'_, M> {
    fn u64(&self, what: &'static str, at: Gva) -> Result<u64, StacksError> {
        self.mem
            .read_u64(at)
            .map_err(|source| StacksError::Memory { what, at, source })
    }

    fn u32(&self, what: &'static str, at: Gva) -> Result<u32, StacksError> {
        self.mem
            .read_u32(at)
            .map_err(|source| StacksError::Memory { what, at, source })
    }

    /// A pointer that must be a kernel address.
    fn ptr(&self, what: &'static str, at: Gva) -> Result<Gva, StacksError> {
        match self.u64(what, at)? {
            v if is_kernel_address(v) => Ok(Gva(v)),
            value => Err(StacksError::BadPointer { what, at, value }),
        }
    }

    /// A pointer that must be a kernel address or NULL.
    fn nullable_ptr(&self, what: &'static str, at: Gva) -> Result<Option<Gva>, StacksError> {
        match self.u64(what, at)? {
            0 => Ok(None),
            _ => self.ptr(what, at).map(Some),
        }
    }
}

fn add(what: &'static str, base: Gva, offset: u64) -> Result<Gva, StacksError> {
    base.checked_add(offset).ok_or(StacksError::Overflow {
        what,
        base: base.0,
        offset,
    })
}

fn sub(what: &'static str, base: Gva, offset: u64) -> Result<Gva, StacksError> {
    base.0.checked_sub(offset).map(Gva).ok_or(StacksError::Overflow {
        what,
        base: base.0,
        offset: offset.wrapping_neg(),
    })
}

/// Visits the elements of the list whose head is at `head`: each `next` from the head on,
/// turned into its container by subtracting `link`, until the head comes back. Counts every
/// node against `budget` and fails on a node seen twice.
fn walk_list<M: GuestVirtRead + ?Sized>(
    r: &Reader<'_, M>,
    list: &'static str,
    head: Gva,
    link: u64,
    budget: &mut usize,
    max: usize,
    mut visit: impl FnMut(Gva) -> Result<(), StacksError>,
) -> Result<(), StacksError> {
    let mut seen = HashSet::new();
    let mut node = r.ptr(list, head)?;
    while node != head {
        if !seen.insert(node) {
            return Err(StacksError::ListCycle { list, node });
        }
        *budget = budget.checked_sub(1).ok_or(StacksError::TooManyNodes { max })?;
        visit(sub(list, node, link)?)?;
        node = r.ptr(list, node)?;
    }
    Ok(())
}

impl KernelStacks {
    /// Lists every kernel stack of the guest whose kernel `layout` describes. `mem` must map
    /// all of the kernel (its own page tables), and every vCPU must be paused for the result
    /// to mean anything.
    pub fn read(mem: &(impl GuestVirtRead + ?Sized), layout: &StacksLayout) -> Result<KernelStacks, StacksError> {
        layout.validate()?;
        let r = Reader { mem };
        let mut budget = layout.max_list_steps;
        let max = layout.max_list_steps;

        // --- CPUs ---
        let ncpus = match layout.cpu_count {
            CpuCount::Variable(at) => r.u32("nr_cpu_ids", at)?,
            CpuCount::Fixed(n) => n,
        };
        if ncpus > MAX_CPUS {
            return Err(StacksError::TooManyCpus(ncpus));
        }
        // CPUs beyond the VM's vCPUs never run: their per-CPU stacks hold nothing live, and
        // the guest's count of them is its own to make up.
        let ncpus = ncpus.min(layout.max_cpus);
        let possible = match layout.possible_mask {
            Some(at) => {
                let mut bits = vec![0u8; ncpus.div_ceil(64) as usize * 8];
                mem.read_virt(at, &mut bits).map_err(|source| StacksError::Memory {
                    what: "__cpu_possible_mask",
                    at,
                    source,
                })?;
                Some(bits)
            }
            None => None,
        };
        let mut cpus = Vec::new();
        for cpu in 0..ncpus {
            if let Some(bits) = &possible {
                if bits[cpu as usize / 8] & (1 << (cpu % 8)) == 0 {
                    continue;
                }
            }
            let base = per_cpu_base(&r, layout, cpu)?.0;
            let var = |what, off| add(what, Gva(base), off);
            let current = r.ptr("current_task", var("current_task", layout.current_task)?)?;
            // NULL until the CPU's idle task is forked (CPU 0's is init_task, scanned anyway).
            let idle = r.nullable_ptr("runqueues.idle", var("runqueues.idle", layout.rq_idle)?)?;
            cpus.push(CpuInfo {
                cpu,
                per_cpu_base: base,
                current,
                idle,
            });
        }

        // --- tasks, in the order: init_task, the lists, idle tasks, current tasks, run queues ---
        let mut order: Vec<Gva> = vec![layout.init_task];
        let mut known: HashSet<Gva> = HashSet::from([layout.init_task]);
        let mut add_task = |t: Gva, order: &mut Vec<Gva>| {
            if known.insert(t) {
                order.push(t);
                true
            } else {
                false
            }
        };
        let mut listed = 0usize;
        let mut processes = vec![layout.init_task];
        walk_list(
            &r,
            "task_struct.tasks",
            add("init_task.tasks", layout.init_task, layout.task_tasks)?,
            layout.task_tasks,
            &mut budget,
            max,
            |p| {
                processes.push(p);
                Ok(())
            },
        )?;
        for &p in &processes {
            if p != layout.init_task && add_task(p, &mut order) {
                listed += 1;
            }
            let mut threads = Vec::new();
            match layout.threads {
                ThreadLinks::SignalThreadHead {
                    signal,
                    thread_head,
                    thread_node,
                } => {
                    // Kept until the task is freed, so never NULL on the list.
                    let sig = r.ptr("task_struct.signal", add("task_struct.signal", p, signal)?)?;
                    let head = add("signal_struct.thread_head", sig, thread_head)?;
                    walk_list(&r, "thread_head", head, thread_node, &mut budget, max, |t| {
                        threads.push(t);
                        Ok(())
                    })?;
                }
                ThreadLinks::ThreadGroup { thread_group } => {
                    let head = add("task_struct.thread_group", p, thread_group)?;
                    walk_list(&r, "thread_group", head, thread_group, &mut budget, max, |t| {
                        threads.push(t);
                        Ok(())
                    })?;
                }
            }
            for t in threads {
                if t != layout.init_task && add_task(t, &mut order) {
                    listed += 1;
                }
            }
        }
        let mut idle = 1usize; // init_task
        for c in &cpus {
            if let Some(t) = c.idle {
                if add_task(t, &mut order) {
                    idle += 1;
                }
            }
        }
        let mut unlisted = 0usize;
        for c in &cpus {
            if add_task(c.current, &mut order) {
                unlisted += 1;
            }
        }
        if let (Some(cfs), Some(group_node)) = (layout.rq_cfs_tasks, layout.task_se_group_node) {
            for c in &cpus {
                let head = add("runqueues.cfs_tasks", Gva(c.per_cpu_base), cfs)?;
                let mut queued = Vec::new();
                walk_list(&r, "cfs_tasks", head, group_node, &mut budget, max, |t| {
                    queued.push(t);
                    Ok(())
                })?;
                for t in queued {
                    if add_task(t, &mut order) {
                        unlisted += 1;
                    }
                }
            }
        }

        // --- their stacks ---
        let currents: HashSet<Gva> = cpus.iter().map(|c| c.current).collect();
        let mut counts = TaskCounts {
            listed,
            idle,
            unlisted,
            ..TaskCounts::default()
        };
        let mut stacks = Vec::new();
        let mut stack_bytes = 0u64;
        for task in order {
            let info = task_info(&mem, &layout.task, task)?;
            let owner = StackOwner::Task {
                task,
                pid: info.pid,
                tgid: info.tgid,
                comm: info.comm,
            };
            let on_cpu = match layout.task_on_cpu {
                Some(off) => r.u32("task_struct.on_cpu", add("task_struct.on_cpu", task, off)?)? != 0,
                None => true, // no way to tell: scan whole
            };
            let on_cpu = on_cpu || currents.contains(&task);
            if on_cpu {
                counts.on_cpu += 1;
            }
            let Some(bounds) = task_stack(&r, layout, task)? else {
                counts.without_stack += 1;
                continue;
            };
            let (stack, top) = (bounds.start, bounds.end);
            let (scan, extent) = if on_cpu {
                (bounds.clone(), Extent::Whole)
            } else {
                let sp = r.u64(
                    "task_struct.thread.sp",
                    add("task_struct.thread.sp", task, layout.task_thread_sp)?,
                )?;
                if sp & 7 == 0 && stack.0 <= sp && sp < top.0 {
                    (Gva(sp)..top, Extent::FromSavedSp)
                } else {
                    (bounds.clone(), Extent::WholeSavedSpOutside)
                }
            };
            stacks.push(KernelStack {
                owner,
                bounds,
                scan,
                extent,
            });
            stack_bytes = stack_bytes.saturating_add(stacks.last().map_or(0, KernelStack::size));
            if stack_bytes > layout.max_stack_bytes {
                return Err(stack_bytes_over(layout));
            }
        }

        // --- per-CPU stacks ---
        for c in &cpus {
            let before = stacks.len();
            per_cpu_stacks(mem, layout, c.cpu, Gva(c.per_cpu_base), &mut stacks)?;
            stack_bytes = stacks[before..]
                .iter()
                .fold(stack_bytes, |t, s| t.saturating_add(s.size()));
            if stack_bytes > layout.max_stack_bytes {
                return Err(stack_bytes_over(layout));
            }
        }
        Ok(KernelStacks {
            stacks,
            cpus,
            tasks: counts,
        })
    }

    pub fn stacks(&self) -> &[KernelStack] {
        &self.stacks
    }

    pub fn cpus(&self) -> &[CpuInfo] {
        &self.cpus
    }

    pub fn task_counts(&self) -> TaskCounts {
        self.tasks
    }

    /// The stack of the task whose `task_struct` is at `task`, if it was found and has one.
    pub fn task_stack(&self, task: Gva) -> Option<&KernelStack> {
        self.stacks
            .iter()
            .find(|s| matches!(s.owner, StackOwner::Task { task: t, .. } if t == task))
    }

    /// Narrows the scan of the stacks a paused vCPU is using, with what its registers prove:
    /// `per_cpu_base` names its CPU (`__per_cpu_offset[cpu]`, see
    /// [`crate::task::select_per_cpu_base`]), `cpl` and `rsp` are the vCPU's. Without this,
    /// the current task of every CPU is scanned whole, stale words below its stack pointer
    /// included. Only shrinks what is scanned (one contradiction excepted, below):
    /// - in user mode (`cpl == 3`) the CPU's current task has nothing on its kernel stack
    ///   (every entry from user mode starts at the top of it): not scanned;
    /// - in kernel mode with `rsp` on the current task's stack: from `rsp` up (the kernel is
    ///   built without a red zone, so nothing below the stack pointer is live);
    /// - in kernel mode with `rsp` on the CPU's IRQ stack: that stack from `rsp` up, and the
    ///   current task's stack from the stack pointer the switch saved at the IRQ stack's top
    ///   (when that lies on the task's stack);
    /// - in each of these three cases the CPU's exception stacks are not scanned: an IST
    ///   handler runs on its IST stack from the hardware's switch to its `iretq` (interrupts
    ///   stay off, it never sleeps), and one that leaves it (entry from user mode, `#VC`)
    ///   first copies its frame to the task's stack, so a CPU whose stack pointer is on a task
    ///   or IRQ stack, or in user mode, is inside no exception handler;
    /// - anywhere else (an exception stack; half-way through a context switch, on the next
    ///   task's stack while `current_task` still names the previous one): nothing changes.
    pub fn narrow_to_vcpu(
        &mut self,
        mem: &(impl GuestVirtRead + ?Sized),
        per_cpu_base: u64,
        cpl: u8,
        rsp: u64,
    ) -> Result<(), StacksError> {
        let cpu = self
            .cpus
            .iter()
            .find(|c| c.per_cpu_base == per_cpu_base)
            .ok_or_else(|| StacksError::Layout(format!("no CPU has the per-CPU base {per_cpu_base:#x}")))?;
        let (cpu, current) = (cpu.cpu, cpu.current);
        let task = self
            .stacks
            .iter()
            .position(|s| matches!(s.owner, StackOwner::Task { task, .. } if task == current));
        let irq = self.stacks.iter().position(|s| s.owner == StackOwner::Irq { cpu });
        let shrink = |s: &mut KernelStack, from: u64, extent: Extent| {
            let from = Gva(from & !7).max(s.scan.start).min(s.scan.end);
            if from > s.scan.start {
                s.scan.start = from;
                s.extent = extent;
            }
        };
        let sp = Gva(rsp);
        if cpl == 3 {
            if let Some(t) = task {
                let s = &mut self.stacks[t];
                s.scan = s.scan.end..s.scan.end;
                s.extent = Extent::UserMode;
            }
        } else if let Some(t) = task.filter(|&t| self.stacks[t].bounds.contains(&sp)) {
            shrink(&mut self.stacks[t], rsp, Extent::FromVcpuSp);
        } else if let Some(i) = irq.filter(|&i| self.stacks[i].bounds.contains(&sp)) {
            let s = &mut self.stacks[i];
            let end = s.bounds.end;
            if s.extent == Extent::Unused {
                // The vCPU is on an IRQ stack its CPU marks unused, which contradicts the
                // kernel's own bookkeeping: the one case that scans more, from rsp up.
                s.scan = Gva(rsp & !7).max(s.bounds.start)..end;
                s.extent = Extent::FromVcpuSp;
            } else {
                shrink(s, rsp, Extent::FromVcpuSp);
            }
            let at = sub("IRQ stack top", end, 8)?;
            let saved = Reader { mem }.u64("the stack pointer saved on the IRQ stack", at)?;
            if let Some(t) = task.filter(|&t| self.stacks[t].bounds.contains(&Gva(saved))) {
                shrink(&mut self.stacks[t], saved, Extent::FromVcpuSp);
            }
        } else {
            return Ok(());
        }
        for s in &mut self.stacks {
            if matches!(s.owner, StackOwner::Exception { cpu: c, .. } if c == cpu) {
                s.scan = s.scan.end..s.scan.end;
                s.extent = Extent::Unused;
            }
        }
        Ok(())
    }

    /// Bytes a scan reads.
    pub fn scan_bytes(&self) -> u64 {
        self.stacks.iter().map(KernelStack::scan_len).sum()
    }

    /// Bytes of all stacks, scanned or not.
    pub fn total_bytes(&self) -> u64 {
        self.stacks.iter().map(|s| s.bounds.end.0 - s.bounds.start.0).sum()
    }

    /// Every scanned word whose value lies in `range` (half-open). For a jump about to be
    /// written over a region, pass the region's interior (`start + 1 .. end`): a saved
    /// address equal to the region's first byte resumes at the jump, which is fine.
    pub fn saved_addresses_in(
        &self,
        mem: &(impl GuestVirtRead + ?Sized),
        range: Range<Gva>,
    ) -> Result<Vec<StackHit>, StacksError> {
        self.saved_addresses_in_any(mem, std::slice::from_ref(&range))
    }

    /// Every scanned word whose value lies in any of `ranges`, reading each stack once (for
    /// several regions optimized in one pause).
    pub fn saved_addresses_in_any(
        &self,
        mem: &(impl GuestVirtRead + ?Sized),
        ranges: &[Range<Gva>],
    ) -> Result<Vec<StackHit>, StacksError> {
        let ranges: Vec<Range<u64>> = ranges
            .iter()
            .filter(|r| r.start < r.end)
            .map(|r| r.start.0..r.end.0)
            .collect();
        let mut hits = Vec::new();
        if ranges.is_empty() {
            return Ok(hits);
        }
        let (lo, hi) = ranges
            .iter()
            .fold((u64::MAX, 0), |(lo, hi), r| (lo.min(r.start), hi.max(r.end)));
        let mut buf = Vec::new();
        for (index, stack) in self.stacks.iter().enumerate() {
            let len = stack.scan_len();
            if len == 0 {
                continue;
            }
            // Stack sizes are bounded by MAX_STACK_SIZE (layout) and THREAD_SIZE.
            buf.resize(len as usize, 0);
            read_stack(mem, stack, &mut buf)?;
            for (i, word) in buf.chunks_exact(8).enumerate() {
                let mut w = [0u8; 8];
                w.copy_from_slice(word);
                let v = u64::from_le_bytes(w);
                if v < lo || v >= hi || !ranges.iter().any(|r| r.contains(&v)) {
                    continue;
                }
                if hits.len() == MAX_STACK_HITS {
                    return Err(StacksError::OverBudget {
                        structure: "saved words found on the kernel stacks in one scan",
                        limit: MAX_STACK_HITS as u64,
                        unit: "words",
                    });
                }
                hits.push(StackHit {
                    stack: index,
                    owner: stack.owner.clone(),
                    at: Gva(stack.scan.start.0 + i as u64 * 8),
                    value: Gva(v),
                });
            }
        }
        Ok(hits)
    }
}

fn stack_bytes_over(layout: &StacksLayout) -> StacksError {
    StacksError::OverBudget {
        structure: "the kernel stacks listed (their bytes together)",
        limit: layout.max_stack_bytes,
        unit: "bytes",
    }
}

/// Reads a stack's scanned part into `buf`. Exception stacks may have unmapped pages, which
/// read as zeros (nothing can have been pushed there).
/// The stacks CPU `cpu` can be running on, as the guest's `get_stack_info` accepts them for
/// the running task: the current task's stack, then the CPU's IRQ, exception and entry
/// stacks (their [`KernelStack::bounds`]; what [`KernelStacks::read`] would scan is not
/// worked out), and the current task. A few reads: cheap enough per probe hit.
pub fn cpu_stacks(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &StacksLayout,
    cpu: u32,
) -> Result<CpuStacks, StacksError> {
    let r = Reader { mem };
    let base = per_cpu_base(&r, layout, cpu)?;
    let task = r.ptr("current_task", add("current_task", base, layout.current_task)?)?;
    let mut stacks = Vec::new();
    if let Some(bounds) = task_stack(&r, layout, task)? {
        let info = task_info(&mem, &layout.task, task)?;
        stacks.push(KernelStack {
            owner: StackOwner::Task {
                task,
                pid: info.pid,
                tgid: info.tgid,
                comm: info.comm,
            },
            scan: bounds.clone(),
            bounds,
            extent: Extent::Whole,
        });
    }
    per_cpu_stacks(mem, layout, cpu, base, &mut stacks)?;
    Ok(CpuStacks { current: task, stacks })
}

/// `task`'s kernel stack (`THREAD_SIZE` bytes at `task_struct.stack`, aligned to their
/// size); `None` for a task without one (dead, not yet reaped).
fn task_stack<M: GuestVirtRead + ?Sized>(
    r: &Reader<'_, M>,
    layout: &StacksLayout,
    task: Gva,
) -> Result<Option<Range<Gva>>, StacksError> {
    let Some(stack) = r.nullable_ptr("task_struct.stack", add("task_struct.stack", task, layout.task_stack)?)? else {
        return Ok(None);
    };
    if stack.0 & (layout.thread_size - 1) != 0 {
        return Err(StacksError::MisalignedStack {
            task,
            stack,
            size: layout.thread_size,
        });
    }
    Ok(Some(stack..add("task stack", stack, layout.thread_size)?))
}

/// `__per_cpu_offset[cpu]`: where CPU `cpu`'s per-CPU variables are (a kernel address).
fn per_cpu_base<M: GuestVirtRead + ?Sized>(
    r: &Reader<'_, M>,
    layout: &StacksLayout,
    cpu: u32,
) -> Result<Gva, StacksError> {
    r.ptr(
        "__per_cpu_offset",
        add("__per_cpu_offset", layout.per_cpu_offset, u64::from(cpu) * 8)?,
    )
}

/// What [`cpu_stacks`] found.
#[derive(Clone, Debug)]
pub struct CpuStacks {
    /// The CPU's `current_task`.
    pub current: Gva,
    pub stacks: Vec<KernelStack>,
}

/// Pushes CPU `cpu`'s IRQ, exception and entry stacks (its per-CPU area at `base`).
fn per_cpu_stacks(
    mem: &(impl GuestVirtRead + ?Sized),
    layout: &StacksLayout,
    cpu: u32,
    base: Gva,
    stacks: &mut Vec<KernelStack>,
) -> Result<(), StacksError> {
    let r = Reader { mem };
    // NULL until the CPU is first brought up.
    if let Some(ptr) = r.nullable_ptr("hardirq_stack_ptr", add("hardirq_stack_ptr", base, layout.irq.ptr)?)? {
        let end = add("hardirq_stack_ptr", ptr, 8)?;
        let start = sub("IRQ stack", end, layout.irq.size)?;
        if start.0 & 7 != 0 {
            return Err(StacksError::Layout(format!(
                "CPU {}'s hardirq_stack_ptr {ptr} is not 8-byte aligned",
                cpu
            )));
        }
        let in_use = match layout.irq.inuse {
            Some(off) => {
                let at = add("hardirq_stack_inuse", base, off)?;
                let mut b = [0u8; 1];
                mem.read_virt(at, &mut b).map_err(|source| StacksError::Memory {
                    what: "hardirq_stack_inuse",
                    at,
                    source,
                })?;
                b[0] != 0
            }
            None => true,
        };
        let (scan, extent) = match in_use {
            true => (start..end, Extent::Whole),
            false => (end..end, Extent::Unused),
        };
        stacks.push(KernelStack {
            owner: StackOwner::Irq { cpu },
            bounds: start..end,
            scan,
            extent,
        });
    }
    // NULL until the CPU entry area is set up.
    let estacks = r.nullable_ptr(
        "cea_exception_stacks",
        add("cea_exception_stacks", base, layout.exception.ptr)?,
    )?;
    if let Some(estacks) = estacks {
        for slot in &layout.exception.stacks {
            let start = add("exception stack", estacks, slot.offset)?;
            let end = add("exception stack", start, slot.size)?;
            if start.0 & 7 != 0 {
                return Err(StacksError::Layout(format!(
                    "CPU {}'s {} stack at {start} is not 8-byte aligned",
                    cpu, slot.name
                )));
            }
            stacks.push(KernelStack {
                owner: StackOwner::Exception {
                    cpu,
                    name: slot.name.clone(),
                },
                bounds: start..end,
                scan: start..end,
                extent: Extent::Whole,
            });
        }
    }
    if let Some((off, size)) = layout.entry_stack {
        let start = add("entry_stack_storage", base, off)?;
        let end = add("entry_stack_storage", start, size)?;
        if start.0 & 7 != 0 {
            return Err(StacksError::Layout(format!(
                "CPU {}'s entry stack at {start} is not 8-byte aligned",
                cpu
            )));
        }
        stacks.push(KernelStack {
            owner: StackOwner::Entry { cpu },
            bounds: start..end,
            scan: start..end,
            extent: Extent::Whole,
        });
    }
    Ok(())
}

fn read_stack(mem: &(impl GuestVirtRead + ?Sized), stack: &KernelStack, buf: &mut [u8]) -> Result<(), StacksError> {
    let start = stack.scan.start;
    let err = match mem.read_virt(start, buf) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let unmapped = |e: &MemoryError| matches!(e, MemoryError::Unmapped(_) | MemoryError::Walk(_));
    if !stack.may_be_unmapped() || !unmapped(&err) {
        return Err(StacksError::Memory {
            what: "a kernel stack",
            at: start,
            source: err,
        });
    }
    let mut done = 0usize;
    while done < buf.len() {
        let at = Gva(start.0 + done as u64);
        let n = ((PAGE_SIZE - at.0 % PAGE_SIZE) as usize).min(buf.len() - done);
        let piece = &mut buf[done..done + n];
        match mem.read_virt(at, piece) {
            Ok(()) => {}
            Err(e) if unmapped(&e) => piece.fill(0),
            Err(source) => {
                return Err(StacksError::Memory {
                    what: "a kernel stack",
                    at,
                    source,
                })
            }
        }
        done += n;
    }
    Ok(())
}

#[cfg(any(test, feature = "test-support"))]
pub mod synthetic;
#[cfg(test)]
mod tests;
