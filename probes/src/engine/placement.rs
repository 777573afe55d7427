//! Where a probe goes: only on an instruction boundary of one function, off the
//! blacklist and the guest's own patch sites. A probe on a function's ftrace NOP moves to
//! the next instruction (the NOP does nothing, and the guest rewrites those bytes), unless
//! that instruction is also reached by a jump inside the function: then the moved probe
//! would fire on every such jump, so it is refused.

use hvprobe_arch::Gva;
use hvprobe_introspection::symbols::{Symbol, SymbolTable};

use super::placed::Placement;
use super::registry::Registry;
use super::{ProbeError, ProbePoint, Tracer, ENDBR64, FTRACE_NOP, MAX_FUNCTION_BYTES};
use crate::insn;

/// The one text symbol `name` names, with `offset` inside it: what can be checked of a
/// `SYM+OFFS` probe point from the symbols alone (also before the guest boots).
pub fn resolve_symbol<'s>(symbols: &'s SymbolTable, name: &str, offset: u64) -> Result<&'s Symbol, ProbeError> {
    let symbol = unique_symbol(symbols, name, Symbol::is_text)?;
    let size = symbols.size_of(symbol).unwrap_or(0);
    if offset >= size.max(1) {
        return Err(ProbeError::OffsetBeyondFunction {
            what: format!("{name}+{offset:#x}"),
            function: name.to_owned(),
            size,
        });
    }
    Ok(symbol)
}

/// `symbol`'s address plus `offset`. Both are the guest's in kallsyms mode and for every
/// module symbol, and its size (which bounds the offset) too: the sum may not wrap.
fn symbol_address(symbol: &Symbol, offset: u64, what: &str) -> Result<Gva, ProbeError> {
    symbol.addr.checked_add(offset).ok_or_else(|| ProbeError::AddressWraps {
        what: what.to_owned(),
        symbol: symbol.name.clone(),
        addr: symbol.addr,
        offset,
    })
}

/// The one symbol called `name` that `kind` accepts.
pub(super) fn unique_symbol<'s>(
    symbols: &'s SymbolTable,
    name: &str,
    kind: impl Fn(&Symbol) -> bool,
) -> Result<&'s Symbol, ProbeError> {
    let matches: Vec<_> = symbols.lookup_all(name).filter(|s| kind(s)).collect();
    match matches.as_slice() {
        [] => Err(ProbeError::UnknownSymbol(name.to_owned())),
        [one] => Ok(*one),
        many => Err(ProbeError::AmbiguousSymbol {
            name: name.to_owned(),
            count: many.len(),
        }),
    }
}

/// Puts the original bytes back into `code` (text read from `start`) wherever it holds an
/// int3 or a jump of ours: the compiler's bytes, to decode.
pub(super) fn compiler_bytes(reg: &Registry, start: Gva, code: &mut [u8]) {
    let end = Gva(start.0 + code.len() as u64);
    for (addr, site) in reg.sites.range(start..end) {
        let offset = (addr.0 - start.0) as usize;
        if let Some(detour) = &site.detour {
            let original = detour.region.original_bytes();
            let n = original.len().min(code.len() - offset);
            code[offset..offset + n].copy_from_slice(&original[..n]);
        } else if site.armed {
            code[offset] = site.original;
        }
    }
}

impl Tracer {
    /// Resolves a probe point to where its int3 goes, with every check that needs no
    /// paused vCPU.
    pub(super) fn place(&self, point: &ProbePoint) -> Result<Placement, ProbeError> {
        let (address, what, named, module) = match point {
            ProbePoint::Symbol { name, offset } => {
                let symbol = resolve_symbol(&self.view.symbols, name, *offset)?;
                let what = format!("{name}+{offset:#x}");
                let address = symbol_address(symbol, *offset, &what)?;
                (address, what.clone(), Some(what), None)
            }
            ProbePoint::Address(a) => {
                if let Some(m) = self.module_containing(*a) {
                    // A raw address would stay where the module was after it unloads.
                    let named = m.symbols.describe(*a).map_or_else(
                        || format!("{}:SYM+OFF", m.name),
                        |d| format!("{}:{}+{:#x}", m.name, d.symbol.name, d.offset),
                    );
                    return Err(ProbeError::Unprobeable {
                        what: format!("{a}"),
                        reason: format!(
                            "it is in module {}'s memory: give it as {named}, which follows the module's loads \
                             and unloads",
                            m.name
                        ),
                    });
                }
                (*a, format!("{a}"), None, None)
            }
            ProbePoint::Module { module, name, offset } => {
                let what = format!("{module}:{name}+{offset:#x}");
                let loaded = self.loaded_module(module, &what)?;
                // The load hook arms without a pause: only on text the module claims where
                // modules are, away from the kernel's and the host's.
                self.text_bounds
                    .check_module(&loaded)
                    .map_err(|source| ProbeError::OutsideText {
                        what: what.clone(),
                        source,
                    })?;
                let symbol = match resolve_symbol(&loaded.symbols, name, *offset) {
                    Err(ProbeError::UnknownSymbol(_)) => {
                        return Err(ProbeError::UnknownModuleSymbol {
                            what,
                            module: module.clone(),
                            name: name.clone(),
                        })
                    }
                    other => other?,
                };
                let address = symbol_address(symbol, *offset, &what)?;
                (address, what, Some(format!("{name}+{offset:#x}")), Some(loaded))
            }
        };
        let symbols = module.as_ref().map_or(&*self.view.symbols, |m| &m.symbols);
        let description = symbols
            .describe(address)
            .filter(|d| d.symbol.is_text())
            .filter(|_| module.as_ref().is_none_or(|m| m.is_text(address)))
            .ok_or(ProbeError::NotInFunction(address))?;
        let function = description.symbol.name.clone();
        let func_start = Gva(address.0 - description.offset);
        let func_size = description.size.min(MAX_FUNCTION_BYTES);
        let location = named.unwrap_or_else(|| format!("{function}+{:#x}", description.offset));
        let what = if matches!(point, ProbePoint::Address(_)) {
            format!("{what} ({location})")
        } else {
            what
        };
        if let Some(reason) = self.view.blacklist.is_blacklisted(address) {
            return Err(ProbeError::Blacklisted { what, reason });
        }
        if let Some(reason) = module.as_ref().and_then(|m| m.blacklisted(address)) {
            return Err(ProbeError::ModuleBlacklisted { what, reason });
        }
        let code = self.function_code(func_start, func_size, &what)?;
        let starts =
            insn::instruction_starts_through(&code, func_start, address).map_err(|source| ProbeError::Decode {
                what: what.clone(),
                source,
            })?;
        let function_name = function.clone();
        let show = move |a: Gva| format!("{function_name}+{:#x}", a.0 - func_start.0);
        if starts.binary_search(&address).is_err() {
            let i = starts.partition_point(|a| *a < address);
            let before = i
                .checked_sub(1)
                .and_then(|j| starts.get(j))
                .map_or_else(|| "the start".to_string(), |a| show(*a));
            let after = starts.get(i).map_or_else(|| "the end".to_string(), |a| show(*a));
            return Err(ProbeError::NotInstructionBoundary {
                what,
                function,
                before,
                after,
            });
        }
        // A probe on the ftrace NOP goes on the next instruction: the NOP does nothing,
        // and the guest rewrites those five bytes whenever it traces the function.
        let site = match self.ftrace_site(&code, func_start) {
            Some(f) if f == address => {
                let next = Gva(f.0 + FTRACE_NOP.len() as u64);
                let branches = insn::internal_branches(&code, func_start).map_err(|source| ProbeError::Decode {
                    what: what.clone(),
                    source,
                })?;
                if let Some(b) = branches.iter().find(|b| b.target == next) {
                    return Err(ProbeError::MovedOntoBranchTarget {
                        what,
                        function,
                        from: show(b.from),
                    });
                }
                next
            }
            _ => address,
        };
        if let Some(p) = self.view.patch_sites.containing(site) {
            return Err(ProbeError::PatchSite {
                what,
                kind: p.kind,
                site: p.range.start,
            });
        }
        if let Some(m) = &module {
            // The module's own jump labels and static calls, read from its tables now.
            let sites = super::PatchSites::read_tables(
                self.machine.kernel(),
                m.jump_table.clone(),
                m.static_call_table.clone(),
            )
            .map_err(|e| ProbeError::Unprobeable {
                what: what.clone(),
                reason: format!("module {}'s patch sites cannot be read: {e}", m.name),
            })?;
            if let Some(p) = sites.containing(site) {
                return Err(ProbeError::PatchSite {
                    what,
                    kind: p.kind,
                    site: p.range.start,
                });
            }
        }
        let offset_in_code = (site.0 - func_start.0) as usize;
        if offset_in_code >= code.len() {
            return Err(ProbeError::Unprobeable {
                what,
                reason: "the function ends with its ftrace NOP".into(),
            });
        }
        let bytes = &code[offset_in_code..(offset_in_code + 15).min(code.len())];
        // What arming, optimizing and disarming will write starts at the site, within the
        // instruction there (a jump's region is inside its function and checked as written).
        self.text_bounds
            .check(site, bytes.len() as u64)
            .map_err(|source| ProbeError::OutsideText {
                what: what.clone(),
                source,
            })?;
        let ex_table = module.as_ref().map_or(&self.view.ex_table, |m| &m.extable);
        Ok(Placement {
            address,
            location,
            site,
            at_function_entry: address == func_start,
            // `%pS` names a module symbol's module: `func+0x0/0x20 [mod]`.
            trace_location: match &module {
                Some(m) => format!("{description} [{}]", m.name),
                None => description.to_string(),
            },
            what,
            bytes: bytes.to_vec(),
            may_fault: ex_table.lookup(site).is_some(),
            module: module.as_ref().map(|m| {
                let layout = match &m.init {
                    Some(init) if init.contains(&site) => init.start,
                    _ => m.core.start,
                };
                (m.name.clone(), layout)
            }),
        })
    }

    /// The function's bytes as the guest's compiler left them: our own int3s would decode
    /// as one-byte instructions, so their original bytes are put back in the copy.
    pub(super) fn function_code(&self, func_start: Gva, func_size: u64, what: &str) -> Result<Vec<u8>, ProbeError> {
        let mut code = vec![0u8; func_size as usize];
        self.machine
            .kernel()
            .read_virt(func_start, &mut code)
            .map_err(|source| ProbeError::Memory {
                what: what.to_string(),
                source,
            })?;
        compiler_bytes(&self.read_registry(), func_start, &mut code);
        Ok(code)
    }

    /// The address of a function's ftrace NOP (at its entry, after an `endbr64`), or of
    /// the call the guest patched in its place while it traces the function.
    pub(super) fn ftrace_site(&self, code: &[u8], func_start: Gva) -> Option<Gva> {
        let skip = if code.starts_with(&ENDBR64) { ENDBR64.len() } else { 0 };
        let entry = code.get(skip..skip + 5)?;
        let at = Gva(func_start.0 + skip as u64);
        if entry == FTRACE_NOP {
            return Some(at);
        }
        if entry[0] == 0xe8 {
            let rel = i32::from_le_bytes([entry[1], entry[2], entry[3], entry[4]]);
            let target = Gva((at.0 + 5).wrapping_add_signed(i64::from(rel)));
            // ftrace's own callers, or a trampoline the guest allocated for an ftrace_ops
            // or a BPF program (no kernel text symbol covers those).
            return match self.view.symbols.describe(target).filter(|d| d.symbol.is_text()) {
                Some(d) if d.symbol.name.starts_with("ftrace_") || d.symbol.name == "__fentry__" => Some(at),
                Some(_) => None,
                None => Some(at),
            };
        }
        None
    }
}
