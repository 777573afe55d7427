//! Reading a running Linux guest from the host: guest-virtual memory through page walks,
//! kernel symbols (System.map, vmlinux ELF, kallsyms decoded from guest memory), the
//! KASLR slide, kernel facts (text bounds, exception table, the guest's kprobe
//! blacklist), the current task (BTF-described `task_struct`), every kernel stack, and a
//! kernel stack unwound with the guest's own ORC data.

#[cfg(test)]
mod alloc_cap;
pub mod btf;
pub mod dwarf;
pub mod facts;
pub mod memory;
pub mod modules;
pub mod place;
pub mod stacks;
pub mod symbols;
pub mod task;
pub mod unwind;
