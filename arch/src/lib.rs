//! x86-64 facts with no KVM in them.
//!
//! The typed addresses that every other crate uses, so that a guest virtual address can
//! never be passed where a guest physical one is expected, and the page-table formats and
//! walk ([`paging`]), IDT gates ([`idt`]), registers' bits ([`regs`]), the `struct pt_regs`
//! frame a probe hit sees ([`pt_regs`]) and the TSC ([`tsc`]). Instruction decoding is
//! `hvprobe-insn`.

use std::fmt;

pub mod debugreg;
pub mod idt;
pub mod paging;
pub mod pt_regs;
pub mod regs;
pub mod tsc;

/// A guest physical address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Gpa(pub u64);

/// A guest virtual address (as seen by the guest kernel through its page tables).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Gva(pub u64);

macro_rules! address_ops {
    ($t:ident) => {
        impl $t {
            /// The raw value.
            pub const fn raw(self) -> u64 {
                self.0
            }

            /// The address `offset` bytes further, or `None` on overflow.
            pub fn checked_add(self, offset: u64) -> Option<Self> {
                self.0.checked_add(offset).map($t)
            }

            /// The offset of this address inside a page of `page_size` bytes (a power of two).
            pub const fn page_offset(self, page_size: u64) -> u64 {
                self.0 & (page_size - 1)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }

        impl fmt::LowerHex for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

address_ops!(Gpa);
address_ops!(Gva);

/// The size of a small page.
pub const PAGE_SIZE: u64 = 0x1000;

/// The `int3` opcode.
pub const INT3: u8 = 0xcc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_print_as_hex_and_do_not_overflow() {
        assert_eq!(Gva(0xffff_ffff_8100_0000).to_string(), "0xffffffff81000000");
        assert_eq!(Gpa(0x1000).to_string(), "0x1000");
        assert_eq!(Gva(u64::MAX).checked_add(1), None);
        assert_eq!(Gpa(0x1234).page_offset(PAGE_SIZE), 0x234);
    }
}
