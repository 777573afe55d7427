//! Where the engine writes the guest's text. Invariant: every int3, jump and original
//! byte the engine writes as text lies wholly in the kernel's text (`_stext`..`_etext`,
//! as the engine started with them) or wholly in the module area, and never in the
//! out-of-line area — and a module's probes go only on text the module claims inside the
//! module area, away from the kernel's text.
//!
//! The addresses come from the guest: its symbols in kallsyms mode, its modules' symbols
//! and layouts always. Without the check a forged `do_init_module` (or a lying kallsyms)
//! could name a "function" in hvprobe's own code — its instruction copies, trampolines,
//! detours, the step guard's IDT — and arming, optimizing and disarming would write
//! int3s, jumps and stale "original" bytes there; or name live kernel text as a module's,
//! which the load hook writes without pausing the vCPUs. Every text write goes through
//! [`write_text`]; placement checks the same ([`TextBounds::check`]) first, so that such a
//! probe is refused with the reason instead of failing later.

use std::ops::Range;

use hvprobe_arch::Gva;
use hvprobe_introspection::memory::MemoryError;
use hvprobe_introspection::modules::LoadedModule;
use hvprobe_introspection::symbols::SymbolTable;

use super::OutOfLineArea;
use crate::machine::KernelMemory;

/// Where Linux x86-64 maps module code: `MODULES_VADDR`..`MODULES_END`, with the lowest
/// `MODULES_VADDR` (`__START_KERNEL_map` + a 512 MiB image; 1 GiB with KASLR) so that it
/// holds for any kernel. A KASLR kernel's image mapping, and so the out-of-line area,
/// may lie in its lower half.
pub(super) const MODULE_AREA: Range<u64> = 0xffff_ffff_a000_0000..0xffff_ffff_ff00_0000;

/// Why the engine will not write text somewhere.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TextBoundsError {
    #[error("{len:#x} bytes at {at} run past the end of the address space")]
    Wraps { at: Gva, len: u64 },
    #[error(
        "{start}..{end} is in hvprobe's out-of-line area ({area_start}..{area_end}), where only the host's own \
         code goes"
    )]
    OutOfLineArea {
        start: Gva,
        end: Gva,
        area_start: Gva,
        area_end: Gva,
    },
    #[error(
        "{start}..{end} is neither in the kernel's text ({}) nor in the module area ({:#x}..{:#x})",
        shown(text), MODULE_AREA.start, MODULE_AREA.end
    )]
    NotText {
        start: Gva,
        end: Gva,
        text: Option<Range<Gva>>,
    },
    #[error(
        "module {module} claims its {what} at {start}..{end}, outside the module area ({:#x}..{:#x})",
        MODULE_AREA.start, MODULE_AREA.end
    )]
    ModuleOutsideArea {
        module: String,
        what: &'static str,
        start: Gva,
        end: Gva,
    },
    #[error(
        "module {module} claims its {what} at {start}..{end}, over the kernel's text ({}..{}): a module's probes \
         are armed without a pause, which only a module's own text allows",
        text.start, text.end
    )]
    ModuleOverKernelText {
        module: String,
        what: &'static str,
        start: Gva,
        end: Gva,
        text: Range<Gva>,
    },
}

fn shown(text: &Option<Range<Gva>>) -> String {
    match text {
        Some(t) => format!("{}..{}", t.start, t.end),
        None => "unknown: the symbols have no _stext/_etext".into(),
    }
}

/// Why a text write did not happen.
#[derive(Debug, thiserror::Error)]
pub(super) enum TextWriteError {
    #[error(transparent)]
    Refused(#[from] TextBoundsError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// What the engine knows, at its start, of where text may be written.
#[derive(Clone, Debug)]
pub(super) struct TextBounds {
    /// `_stext`..`_etext`, when the symbols have both in order.
    kernel_text: Option<Range<Gva>>,
    /// The out-of-line area's parts (code, rings).
    out_of_line: Vec<Range<Gva>>,
}

fn overlaps(a: &Range<Gva>, b: &Range<Gva>) -> bool {
    a.start < b.end && b.start < a.end
}

fn inside(inner: &Range<Gva>, outer: &Range<Gva>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

impl TextBounds {
    pub fn new(symbols: &SymbolTable, ool: Option<OutOfLineArea>) -> TextBounds {
        let part = |start: Gva, size: u64| start..Gva(start.0.saturating_add(size));
        TextBounds {
            kernel_text: super::text_range(symbols).filter(|t| t.start < t.end),
            out_of_line: ool
                .map(|a| vec![part(a.start, a.size), part(a.rings, a.rings_size)])
                .unwrap_or_default(),
        }
    }

    fn kernel_text(&self) -> Option<&Range<Gva>> {
        self.kernel_text.as_ref()
    }

    fn not_out_of_line(&self, range: &Range<Gva>) -> Result<(), TextBoundsError> {
        match self.out_of_line.iter().find(|area| overlaps(area, range)) {
            Some(area) => Err(TextBoundsError::OutOfLineArea {
                start: range.start,
                end: range.end,
                area_start: area.start,
                area_end: area.end,
            }),
            None => Ok(()),
        }
    }

    /// Whether `len` (at least 1) bytes at `at` may be written as text: wholly in the
    /// kernel's text or wholly in the module area, and nowhere in the out-of-line area.
    pub fn check(&self, at: Gva, len: u64) -> Result<(), TextBoundsError> {
        let end = at.checked_add(len.max(1)).ok_or(TextBoundsError::Wraps { at, len })?;
        let range = at..end;
        self.not_out_of_line(&range)?;
        let modules = Gva(MODULE_AREA.start)..Gva(MODULE_AREA.end);
        if self.kernel_text().is_some_and(|t| inside(&range, t)) || inside(&range, &modules) {
            return Ok(());
        }
        Err(TextBoundsError::NotText {
            start: at,
            end,
            text: self.kernel_text.clone(),
        })
    }

    /// Whether `module`'s probes may go on its text: its core and init text each inside
    /// the module area, off the kernel's text and the out-of-line area.
    pub fn check_module(&self, module: &LoadedModule) -> Result<(), TextBoundsError> {
        let texts = [
            ("core text", Some(&module.core_text)),
            ("init text", module.init_text.as_ref()),
        ];
        for (what, text) in texts {
            let Some(text) = text.filter(|t| t.start < t.end) else {
                continue;
            };
            if !(MODULE_AREA.start <= text.start.0 && text.end.0 <= MODULE_AREA.end) {
                return Err(TextBoundsError::ModuleOutsideArea {
                    module: module.name.clone(),
                    what,
                    start: text.start,
                    end: text.end,
                });
            }
            if let Some(kernel) = self.kernel_text().filter(|k| overlaps(k, text)) {
                return Err(TextBoundsError::ModuleOverKernelText {
                    module: module.name.clone(),
                    what,
                    start: text.start,
                    end: text.end,
                    text: kernel.clone(),
                });
            }
            self.not_out_of_line(text)?;
        }
        Ok(())
    }
}

/// Writes `bytes` of the guest's text at `at` (an int3, a jump, the original bytes back):
/// every text write of the engine comes here, and is refused whole outside `bounds`. The
/// machine's own text path ([`KernelMemory::write_text`]) refuses the out-of-line area
/// again.
pub(super) fn write_text(
    text: &dyn KernelMemory,
    bounds: &TextBounds,
    at: Gva,
    bytes: &[u8],
) -> Result<(), TextWriteError> {
    bounds.check(at, bytes.len() as u64)?;
    text.write_text(at, bytes)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const ETEXT: u64 = 0xffff_ffff_8200_0000;
    /// A KASLR kernel's out-of-line area, in the module area's lower half.
    const OOL: u64 = 0xffff_ffff_bfc0_0000;

    fn bounds() -> TextBounds {
        let symbols = SymbolTable::parse_system_map(&format!("{TEXT:016x} T _stext\n{ETEXT:016x} T _etext\n")).unwrap();
        let ool = OutOfLineArea {
            start: Gva(OOL),
            size: 2 << 20,
            rings: Gva(OOL + (2 << 20)),
            rings_size: 2 << 20,
        };
        TextBounds::new(&symbols, Some(ool))
    }

    /// A write is all in one place or refused: not one byte past the text's end or into
    /// either part of the out-of-line area, and never past 2^64.
    #[test]
    fn text_writes_stay_inside_text_or_the_module_area_and_out_of_the_out_of_line_area() {
        let b = bounds();
        assert_eq!(b.check(Gva(TEXT), 5), Ok(()));
        assert_eq!(b.check(Gva(ETEXT - 5), 5), Ok(()));
        assert!(matches!(
            b.check(Gva(ETEXT - 4), 5),
            Err(TextBoundsError::NotText { .. })
        ));
        assert!(matches!(
            b.check(Gva(TEXT - 1), 1),
            Err(TextBoundsError::NotText { .. })
        ));
        assert_eq!(b.check(Gva(MODULE_AREA.start), 1), Ok(()));
        assert_eq!(b.check(Gva(OOL - 5), 5), Ok(()));
        for (at, len) in [(OOL - 4, 5), (OOL, 1), (OOL + (3 << 20), 1), (OOL + (4 << 20) - 1, 5)] {
            assert!(
                matches!(b.check(Gva(at), len), Err(TextBoundsError::OutOfLineArea { .. })),
                "{at:#x}+{len}"
            );
        }
        assert_eq!(b.check(Gva(OOL + (4 << 20)), 5), Ok(()));
        assert!(matches!(
            b.check(Gva(MODULE_AREA.end - 2), 5),
            Err(TextBoundsError::NotText { .. })
        ));
        assert!(matches!(
            b.check(Gva(u64::MAX - 1), 5),
            Err(TextBoundsError::Wraps { .. })
        ));
    }
}
