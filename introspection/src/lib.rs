//! Reading a running Linux guest from the host: page walks, kernel symbols (System.map,
//! vmlinux, kallsyms in guest memory), the KASLR slide, and kernel facts (text bounds,
//! exception table, the guest's kprobe blacklist, the current task).
//!
//! Not built yet: this crate is the introspection issue's. Nothing here works so far.
