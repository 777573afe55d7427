//! Source targets and variables by name: what `perf probe` adds to `kprobe_events`.
//!
//! A spec line whose target is a place in the source (`vfs_read:12`, `vfs_read@fs/read_write.c`,
//! `fs/read_write.c:470`) is turned, with the kernel's DWARF, into the plain probes Linux
//! would be given — `SYM+OFF` sites and fetch-args of registers, stack slots and memory —
//! the way perf probe writes `kprobe_events` for the kernel. `SYM+OFF` follows a KASLR
//! slide, as every symbol target does. Variables are read where DWARF says they are at the
//! site's address; one that is nowhere there (optimized out, only its entry value
//! described, split in pieces, computed) is refused with the reason, as perf probe refuses
//! it.
//!
//! Where the rules are perf probe's, and where they differ:
//! - `FUNC:RLN` counts lines from the function's declaration (line 0), in the file it is
//!   declared in; a line is probed where the line table starts a statement of it, at the
//!   first address of each run of its code: a line whose code the compiler split (a loop's
//!   condition, code moved by scheduling) has several sites. Each site is its own event,
//!   `EVENT`, `EVENT_1`, … — perf probe's naming for several probe points of one line.
//! - A line with no statement of its own is refused, naming the nearest lines that have
//!   one (perf probe: "Probe point … not found"; `hvprobe lines` shows which lines do).
//! - `$params` and `$vars` skip the variables that cannot be read at the site, with a
//!   note, as perf probe does; a variable named alone is refused.

use std::fmt;

use hvprobe_arch::Gva;
use hvprobe_introspection::dwarf::{
    DebugInfo, DwarfError, DwarfRegister, Function, Location, TypeShape, Unavailable, MAX_LINE_SITES,
};
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_introspection::unwind::OrcTable;

use super::{ArgType, BtfBase, BtfField, BtfRef, FetchArg, FetchExpr, ProbeSpec, Register, SourcePoint, Target};

/// Where hvprobe looks up source targets: the kernel's DWARF, its link-time symbols (to
/// name each site `SYM+OFF`) and its ORC table (the canonical frame address of a stack
/// variable).
pub struct KernelSource {
    pub debug: DebugInfo,
    pub symbols: SymbolTable,
    pub orc: Option<OrcTable>,
    /// Each function's inlined instances, once searched (a search reads every unit: a run
    /// resolves its spec before the boot and again when its session starts).
    inlined: std::sync::Mutex<std::collections::HashMap<String, Vec<Function>>>,
    /// The module this is the source of (its `.ko`'s DWARF and symbols): sites become
    /// `MOD:SYM+OFF` probes.
    module: Option<String>,
}

/// A source target's problem, in perf probe's terms where it has one.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("no function `{0}` in the kernel's DWARF")]
    NoFunction(String),
    #[error("the file given for module {0} is not a module (a relocatable .ko) but a linked image")]
    NotAModule(String),
    #[error(
        "{place}: `{name}` is a global or static variable of module {module}, which a probe cannot read by \
         name yet (its address is known only once the module is loaded)"
    )]
    ModuleGlobal {
        place: String,
        name: String,
        module: String,
    },
    #[error("no function `{function}` in a file ending `{file}`")]
    NoFunctionInFile { function: String, file: String },
    #[error("`{function}` is defined in several files ({}): name one with {function}@FILE", files.join(", "))]
    AmbiguousFunction { function: String, files: Vec<String> },
    #[error("{place}: line {line} of {file} has no code of its own{}", nearby_text(.nearby))]
    NoCode {
        place: String,
        file: String,
        line: u64,
        nearby: Vec<String>,
    },
    #[error("{place}: no line {line} with code in a file ending `{file}`")]
    NoFileLine { place: String, file: String, line: u32 },
    #[error("{place}: stands for more than {MAX_LINE_SITES} sites")]
    TooManySites { place: String },
    #[error("{place}: its code at {address:#x} is in no function the symbol table names")]
    NoSymbol { place: String, address: u64 },
    #[error("{place}: its function `{symbol}` shares its name with other symbols, so a probe cannot name it")]
    AmbiguousSymbol { place: String, symbol: String },
    #[error("{place}: no variable `{name}` is visible at {site}{}", visible_text(.visible))]
    UnknownVariable {
        place: String,
        name: String,
        site: String,
        visible: Vec<String>,
    },
    #[error("{place}: `{name}` at {site} cannot be read: {reason}")]
    Unavailable {
        place: String,
        name: String,
        site: String,
        reason: Unavailable,
    },
    #[error("{place}: `{path}`: {problem}")]
    Field {
        place: String,
        path: String,
        problem: String,
    },
    #[error("{place}: `{arg}`: $argN and $arg* need the function's entry; at a line, name the variable")]
    ArgNotAtEntry { place: String, arg: String },
    #[error(transparent)]
    Dwarf(#[from] DwarfError),
}

fn nearby_text(nearby: &[String]) -> String {
    match nearby {
        [] => String::new(),
        lines => format!(" (nearest lines with code: {})", lines.join(", ")),
    }
}

fn visible_text(visible: &[String]) -> String {
    match visible {
        [] => String::new(),
        names => format!(" (visible there: {})", names.join(", ")),
    }
}

/// One place a source target stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// The symbol whose code holds it, and the offset there: how a probe names it.
    pub symbol: String,
    pub offset: u64,
    /// Its link-time address.
    pub address: u64,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{:#x}", self.symbol, self.offset)
    }
}

/// A source target's sites, each with the function whose variables are in scope there.
pub struct Located {
    pub sites: Vec<(Site, Function)>,
}

/// A variable at a site, and the fetch-arg that reads it there or why none can.
pub type VariableFetch = (hvprobe_introspection::dwarf::Variable, Result<FetchArg, SourceError>);

/// What resolving a spec line noticed but did not refuse (a `$vars` variable skipped).
pub type Notes = Vec<String>;

impl KernelSource {
    pub fn new(debug: DebugInfo, symbols: SymbolTable, orc: Option<OrcTable>) -> KernelSource {
        KernelSource {
            debug,
            symbols,
            orc,
            inlined: Default::default(),
            module: None,
        }
    }

    /// The source of module `module`, from its `.ko`'s DWARF (a relocatable object: its
    /// own symbols name the places; its ORC data is not read, so a variable on the stack
    /// frame is refused).
    pub fn for_module(module: &str, debug: DebugInfo) -> Result<KernelSource, SourceError> {
        let symbols = debug
            .object_symbols()
            .cloned()
            .ok_or_else(|| SourceError::NotAModule(module.to_owned()))?;
        Ok(KernelSource {
            module: Some(module.to_owned()),
            ..KernelSource::new(debug, symbols, None)
        })
    }

    /// The inlined instances of `function` (see [`DebugInfo::inlined_instances`]).
    fn inlined_instances(&self, function: &str) -> Result<Vec<Function>, SourceError> {
        let mut cache = self.inlined.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = cache.get(function) {
            return Ok(found.clone());
        }
        let found = self.debug.inlined_instances(function)?;
        cache.insert(function.to_owned(), found.clone());
        Ok(found)
    }

    /// The function a target names: the one definition of `function` (in `file`, when
    /// given).
    pub fn function(&self, function: &str, file: Option<&str>) -> Result<Function, SourceError> {
        // The symbol table narrows the search to the units holding the function's code.
        let mut found = Vec::new();
        let mut addresses: Vec<u64> = self
            .symbols
            .lookup_all(function)
            .filter(|s| s.is_text())
            .map(|s| s.addr.0)
            .collect();
        addresses.sort_unstable();
        addresses.dedup();
        for a in &addresses {
            found.extend(self.debug.functions_named(function, Some(*a))?);
        }
        if found.is_empty() {
            found = self.debug.functions_named(function, None)?;
        }
        found.sort_by_key(|f| f.low_pc());
        found.dedup_by_key(|f| f.low_pc());
        if let Some(file) = file {
            found.retain(|f| {
                f.decl_file
                    .as_deref()
                    .is_some_and(|d| hvprobe_introspection::dwarf::path_ends_with(d, file))
            });
            if found.is_empty() {
                return Err(SourceError::NoFunctionInFile {
                    function: function.to_owned(),
                    file: file.to_owned(),
                });
            }
        }
        match found.len() {
            0 => Err(SourceError::NoFunction(function.to_owned())),
            1 => Ok(found.remove(0)),
            _ => Err(SourceError::AmbiguousFunction {
                function: function.to_owned(),
                files: found.iter().filter_map(|f| f.decl_file.clone()).collect(),
            }),
        }
    }

    /// The code a source target's function stands for, as perf probe probes it: its one
    /// out-of-line definition (in `file`, when given) and every instance of it inlined into
    /// other functions (of the declaration in `file`, when there is no out-of-line code).
    pub fn functions(&self, function: &str, file: Option<&str>) -> Result<Vec<Function>, SourceError> {
        let definition = match self.function(function, file) {
            Ok(f) => Some(f),
            Err(SourceError::NoFunction(_) | SourceError::NoFunctionInFile { .. }) => None,
            Err(e) => return Err(e),
        };
        let mut instances = self.inlined_instances(function)?;
        instances.retain(|i| {
            let declared = i.decl_file.as_deref();
            match (&definition, file) {
                (Some(d), _) => declared == d.decl_file.as_deref() && i.decl_line == d.decl_line,
                (None, Some(f)) => declared.is_some_and(|d| hvprobe_introspection::dwarf::path_ends_with(d, f)),
                (None, None) => true,
            }
        });
        instances.sort_by_key(Function::entry);
        instances.dedup_by_key(|i| i.entry());
        if definition.is_none() {
            // Inlined instances of two static functions of one name are two functions.
            let mut declared: Vec<(Option<String>, u64)> =
                instances.iter().map(|i| (i.decl_file.clone(), i.decl_line)).collect();
            declared.sort();
            declared.dedup();
            if declared.len() > 1 {
                return Err(SourceError::AmbiguousFunction {
                    function: function.to_owned(),
                    files: declared.into_iter().filter_map(|(f, _)| f).collect(),
                });
            }
        }
        let all: Vec<Function> = definition.into_iter().chain(instances).collect();
        if all.is_empty() {
            return Err(match file {
                Some(file) => SourceError::NoFunctionInFile {
                    function: function.to_owned(),
                    file: file.to_owned(),
                },
                None => SourceError::NoFunction(function.to_owned()),
            });
        }
        Ok(all)
    }

    /// The sites of line `line` (from the declaration) of `f`, or of its entry. An inlined
    /// instance may have lost the line (folded into its caller's code): unless `must`, it
    /// then has none.
    fn function_sites(
        &self,
        place: &str,
        name: &str,
        f: &Function,
        line: Option<u32>,
        must: bool,
        sites: &mut Vec<(Site, Function)>,
    ) -> Result<(), SourceError> {
        let addresses = match line {
            None => vec![f.entry()],
            Some(rln) => {
                let wanted = f.decl_line.saturating_add(u64::from(rln));
                let lines = self.debug.lines(f)?;
                match lines.iter().find(|l| l.line == wanted) {
                    Some(l) => l.addresses.clone(),
                    None if f.inlined && !must => Vec::new(),
                    None => {
                        let mut near: Vec<(u64, u64)> =
                            lines.iter().map(|l| (l.line.abs_diff(wanted), l.line)).collect();
                        near.sort_unstable();
                        let mut nearby: Vec<u64> = near.iter().take(2).map(|&(_, l)| l).collect();
                        nearby.sort_unstable();
                        return Err(SourceError::NoCode {
                            place: place.to_owned(),
                            file: f.decl_file.clone().unwrap_or_default(),
                            line: wanted,
                            nearby: nearby
                                .iter()
                                .map(|l| format!("{name}:{}", l.saturating_sub(f.decl_line)))
                                .collect(),
                        });
                    }
                }
            }
        };
        for a in addresses {
            if !sites.iter().any(|(s, _)| s.address == a) {
                sites.push((self.site(place, a)?, f.clone()));
            }
        }
        Ok(())
    }

    /// The sites a source target stands for.
    pub fn locate(&self, point: &SourcePoint) -> Result<Located, SourceError> {
        let place = point.to_string();
        let mut sites = Vec::new();
        match (&point.function, &point.file, point.line) {
            (Some(function), file, line) => {
                let functions = self.functions(function, file.as_deref())?;
                for f in &functions {
                    self.function_sites(&place, function, f, line, false, &mut sites)?;
                }
                if sites.is_empty() {
                    // No instance has the line: the first one says which lines have code.
                    self.function_sites(&place, function, &functions[0], line, true, &mut sites)?;
                }
            }
            (None, Some(file), Some(line)) => {
                let found = self.debug.file_line(file, u64::from(line))?;
                if found.is_empty() {
                    return Err(SourceError::NoFileLine {
                        place,
                        file: file.clone(),
                        line,
                    });
                }
                for a in found {
                    let Some((innermost, _)) = self.debug.scope_at(a)? else {
                        return Err(SourceError::NoSymbol { place, address: a });
                    };
                    sites.push((self.site(&place, a)?, innermost));
                }
            }
            _ => return Err(SourceError::NoFunction(place)),
        }
        if sites.len() > MAX_LINE_SITES {
            return Err(SourceError::TooManySites { place });
        }
        Ok(Located { sites })
    }

    /// An address as `SYM+OFF`, by a name that is the symbol's alone.
    fn site(&self, place: &str, address: u64) -> Result<Site, SourceError> {
        let d = self
            .symbols
            .describe(Gva(address))
            .filter(|d| d.symbol.is_text())
            .ok_or_else(|| SourceError::NoSymbol {
                place: place.to_owned(),
                address,
            })?;
        let start = d.symbol.addr.0;
        let unique = |name: &str| self.symbols.lookup_all(name).count() == 1;
        let name = if unique(&d.symbol.name) {
            d.symbol.name.clone()
        } else {
            // An alias at the same address whose name is its own.
            self.symbols
                .symbols()
                .iter()
                .find(|s| s.addr.0 == start && s.is_text() && unique(&s.name))
                .map(|s| s.name.clone())
                .ok_or_else(|| SourceError::AmbiguousSymbol {
                    place: place.to_owned(),
                    symbol: d.symbol.name.clone(),
                })?
        };
        Ok(Site {
            symbol: name,
            offset: d.offset,
            address,
        })
    }

    /// Resolves a spec line with a source target into plain probes, one per site: its
    /// variables as fetches of registers, stack and memory. Any other line comes back
    /// as it is.
    pub fn resolve(&self, spec: &ProbeSpec) -> Result<(Vec<ProbeSpec>, Notes), SourceError> {
        let (target, args) = match spec {
            ProbeSpec::Kprobe { target, args, .. } | ProbeSpec::Kretprobe { target, args, .. } => (target, args),
            _ => return Ok((vec![spec.clone()], Vec::new())),
        };
        let Target::Source(point) = target else {
            return Ok((vec![spec.clone()], Vec::new()));
        };
        let place = point.to_string();
        let located = self.locate(point)?;
        let mut notes = Vec::new();
        let mut out = Vec::new();
        for (site, scope) in &located.sites {
            let resolved = self.resolve_args(&place, point.is_function_entry(), site, scope, args, &mut notes)?;
            let mut spec = spec.clone();
            match &mut spec {
                ProbeSpec::Kprobe { target, args, .. } | ProbeSpec::Kretprobe { target, args, .. } => {
                    *target = match &self.module {
                        Some(module) => Target::ModuleSymbol {
                            module: module.clone(),
                            name: site.symbol.clone(),
                            offset: site.offset,
                        },
                        None => Target::Symbol {
                            name: site.symbol.clone(),
                            offset: site.offset,
                        },
                    };
                    *args = resolved;
                }
                _ => unreachable!("matched above"),
            }
            out.push(spec);
        }
        Ok((out, notes))
    }

    fn resolve_args(
        &self,
        place: &str,
        at_entry: bool,
        site: &Site,
        scope: &Function,
        args: &[FetchArg],
        notes: &mut Notes,
    ) -> Result<Vec<FetchArg>, SourceError> {
        let mut variables = self.debug.variables_at(scope, site.address)?;
        let locals = variables.len();
        // Names the function's scope lacks are looked up among its file's globals.
        let globals: Vec<_> = self
            .debug
            .unit_variables(scope)?
            .into_iter()
            .filter(|g| !variables.iter().any(|v| v.name == g.name))
            .collect();
        variables.extend(globals);
        let mut out = Vec::new();
        for (index, arg) in args.iter().enumerate() {
            match &arg.expr {
                FetchExpr::Params | FetchExpr::Vars => {
                    let params_only = arg.expr == FetchExpr::Params;
                    for v in variables[..locals].iter().filter(|v| v.is_parameter || !params_only) {
                        match self.whole_variable(place, site, &variables, &v.name) {
                            Ok(fetch) => out.push(fetch),
                            Err(e) => notes.push(format!("{arg} skips `{}`: {e}", v.name)),
                        }
                    }
                }
                FetchExpr::AllArgs if !at_entry => {
                    return Err(SourceError::ArgNotAtEntry {
                        place: place.to_owned(),
                        arg: arg.to_string(),
                    })
                }
                _ => {
                    let (expr, ty) = self.expr(place, at_entry, site, &variables, &arg.expr)?;
                    // An unnamed `file->f_pos` is named `f_pos`, as perf probe names it
                    // (unless another argument has that name).
                    let name = match &arg.expr {
                        FetchExpr::Btf(BtfRef { fields, .. }) if arg.name == format!("arg{}", index + 1) => fields
                            .last()
                            .map(|f| f.name.clone())
                            .filter(|n| !args.iter().any(|a| &a.name == n))
                            .unwrap_or_else(|| arg.name.clone()),
                        _ => arg.name.clone(),
                    };
                    out.push(FetchArg {
                        name,
                        expr,
                        ty: match ty {
                            Some(t) if !arg.typed => t,
                            _ => arg.ty,
                        },
                        ..arg.clone()
                    });
                }
            }
        }
        Ok(out)
    }

    /// A fetch-arg's expression with its DWARF variables resolved, and the type of the
    /// variable when it was one.
    fn expr(
        &self,
        place: &str,
        at_entry: bool,
        site: &Site,
        variables: &[hvprobe_introspection::dwarf::Variable],
        expr: &FetchExpr,
    ) -> Result<(FetchExpr, Option<ArgType>), SourceError> {
        Ok(match expr {
            FetchExpr::Btf(
                r @ BtfRef {
                    base: BtfBase::Param(_),
                    ..
                },
            ) => {
                let (e, t) = self.variable(place, site, variables, r)?;
                (e, Some(t))
            }
            FetchExpr::Btf(_) | FetchExpr::Arg(_) if !at_entry => {
                return Err(SourceError::ArgNotAtEntry {
                    place: place.to_owned(),
                    arg: expr.to_string(),
                })
            }
            FetchExpr::Deref { offset, user, base } => (
                FetchExpr::Deref {
                    offset: *offset,
                    user: *user,
                    base: Box::new(self.expr(place, at_entry, site, variables, base)?.0),
                },
                None,
            ),
            other => (other.clone(), None),
        })
    }

    /// The variables in `scope` at a site, each with the fetch-arg that reads it there
    /// (or why none can), for listings (`hvprobe vars`, perf probe's `-V`).
    pub fn variables(&self, site: &Site, scope: &Function) -> Result<Vec<VariableFetch>, SourceError> {
        let variables = self.debug.variables_at(scope, site.address)?;
        let place = site.to_string();
        Ok(variables
            .iter()
            .map(|v| (v.clone(), self.whole_variable(&place, site, &variables, &v.name)))
            .collect())
    }

    /// The fetch-arg that reads the variable `name` whole, named after it and typed from
    /// DWARF (what `$vars` and `hvprobe vars` give for each variable).
    fn whole_variable(
        &self,
        place: &str,
        site: &Site,
        variables: &[hvprobe_introspection::dwarf::Variable],
        name: &str,
    ) -> Result<FetchArg, SourceError> {
        let r = BtfRef {
            base: BtfBase::Param(name.to_owned()),
            fields: Vec::new(),
        };
        let (expr, ty) = self.variable(place, site, variables, &r)?;
        Ok(FetchArg {
            name: name.to_owned(),
            expr,
            ty,
            array_len: None,
            typed: false,
        })
    }

    /// A variable (and its `->`/`.` fields) at a site: how to fetch it and its type.
    fn variable(
        &self,
        place: &str,
        site: &Site,
        variables: &[hvprobe_introspection::dwarf::Variable],
        r: &BtfRef,
    ) -> Result<(FetchExpr, ArgType), SourceError> {
        let BtfBase::Param(name) = &r.base else {
            unreachable!("only names are DWARF variables")
        };
        let Some(v) = variables.iter().find(|v| &v.name == name) else {
            return Err(SourceError::UnknownVariable {
                place: place.to_owned(),
                name: name.clone(),
                site: site.to_string(),
                visible: variables.iter().filter(|v| !v.global).map(|v| v.name.clone()).collect(),
            });
        };
        let location = match v.location.clone() {
            // An `extern` the unit declares: where the symbol table puts it.
            Err(Unavailable::Declaration) => match self.symbols.lookup(name) {
                Some(symbol) => Ok(Location::Memory(symbol.addr.0)),
                None => Err(Unavailable::Declaration),
            },
            other => other,
        }
        .map_err(|reason| SourceError::Unavailable {
            place: place.to_owned(),
            name: name.clone(),
            site: site.to_string(),
            reason,
        })?;
        let mut value = self.place_of(place, site, name, location)?;
        let mut ty = v.ty;
        let mut path = name.clone();
        let mut bits = None;
        let field_error = |path: &str, problem: String| SourceError::Field {
            place: place.to_owned(),
            path: path.to_owned(),
            problem,
        };
        for BtfField { name: field, arrow } in &r.fields {
            let shape = self.debug.shape(ty);
            let container = match (shape, arrow) {
                (TypeShape::Pointer { pointee }, true) => {
                    value = Value::Memory {
                        base: value.fetch(),
                        offset: 0,
                    };
                    pointee
                }
                (TypeShape::Struct { .. } | TypeShape::Union { .. }, false) => ty,
                (TypeShape::Pointer { .. }, false) => {
                    return Err(field_error(
                        &path,
                        format!("is a pointer ({}): use `->{field}`", self.debug.type_name(ty)),
                    ))
                }
                (_, true) => {
                    return Err(field_error(
                        &path,
                        format!(
                            "is not a pointer ({}): `->` reads through pointers",
                            self.debug.type_name(ty)
                        ),
                    ))
                }
                (_, false) => {
                    return Err(field_error(
                        &path,
                        format!("is not a struct or union ({})", self.debug.type_name(ty)),
                    ))
                }
            };
            let Some(member) = self.debug.member(container, field) else {
                return Err(field_error(
                    &path,
                    format!("{} has no member `{field}`", self.debug.type_name(container)),
                ));
            };
            // The same checked sum whether the struct is reached through a register or a symbol.
            let moved = |offset: i64| {
                i64::try_from(member.offset)
                    .ok()
                    .and_then(|m| offset.checked_add(m))
                    .ok_or_else(|| field_error(&path, "the member's offset overflows".into()))
            };
            value = match value {
                Value::Memory { base, offset } => Value::Memory {
                    base,
                    offset: moved(offset)?,
                },
                Value::Symbol { name, offset } => Value::Symbol {
                    name,
                    offset: moved(offset)?,
                },
                Value::Direct(_) => {
                    return Err(field_error(
                        &path,
                        "is a struct held in registers, whose members a fetch-arg cannot reach".into(),
                    ))
                }
            };
            path.push_str(if *arrow { "->" } else { "." });
            path.push_str(field);
            ty = member.ty;
            bits = member.bits;
        }
        let arg_type = match (self.debug.shape(ty), bits) {
            // A bitfield: read from the byte its first bit is in, in the smallest container
            // that holds it.
            (TypeShape::Integer { .. }, Some((bit, width))) => {
                let container_bits = [8u8, 16, 32, 64]
                    .into_iter()
                    .find(|&c| u16::from(bit) + u16::from(width) <= u16::from(c))
                    .unwrap_or(64);
                ArgType::Bitfield {
                    width,
                    offset: bit,
                    container_bits,
                }
            }
            (TypeShape::Integer { size, signed }, None) => integer_type(size, signed),
            (TypeShape::Pointer { .. }, _) => ArgType::X64,
            (other, _) => {
                let what = match other {
                    TypeShape::Struct { .. } => "a struct: name a member with `.` (or `->` through a pointer)",
                    TypeShape::Union { .. } => "a union: name a member with `.`",
                    TypeShape::Array { .. } => {
                        "an array: a fetch-arg reads scalars (name an element's place with +OFF(...))"
                    }
                    TypeShape::Float { .. } => "a floating-point value, which kprobe fetch-args do not read",
                    _ => "of no type a fetch-arg can read",
                };
                return Err(field_error(&path, format!("is {what} ({})", self.debug.type_name(ty))));
            }
        };
        Ok((value.fetch(), arg_type))
    }

    /// A variable's location at a site as a [`Value`].
    fn place_of(&self, place: &str, site: &Site, name: &str, location: Location) -> Result<Value, SourceError> {
        Ok(match location {
            Location::Register(r) => Value::Direct(FetchExpr::Register(register(r))),
            Location::RegisterMemory { register: r, offset } => Value::Memory {
                base: FetchExpr::Register(register(r)),
                offset,
            },
            Location::FrameMemory { offset } => {
                // The CFA is RSP plus ORC's offset at the site (RBP-based frames are not
                // built by the bundled kernel's compiler, and are refused).
                let entry = self.orc.as_ref().and_then(|o| o.find(Gva(site.address)));
                let unavailable = |why: &str| SourceError::Unavailable {
                    place: place.to_owned(),
                    name: name.to_owned(),
                    site: site.to_string(),
                    reason: Unavailable::Computed(why.to_owned()),
                };
                let Some(entry) = entry else {
                    return Err(unavailable("on the stack, but no ORC entry gives the frame there"));
                };
                if entry.sp_reg != hvprobe_introspection::unwind::ORC_REG_SP {
                    return Err(unavailable("on the stack of a frame ORC does not describe from %sp"));
                }
                Value::Memory {
                    base: FetchExpr::Register(Register::Sp),
                    offset: i64::from(entry.sp_offset) + offset,
                }
            }
            Location::Memory(_) if self.module.is_some() => {
                return Err(SourceError::ModuleGlobal {
                    place: place.to_owned(),
                    name: name.to_owned(),
                    module: self.module.clone().unwrap_or_default(),
                })
            }
            Location::Memory(address) => {
                let d = self
                    .symbols
                    .describe(Gva(address))
                    .ok_or_else(|| SourceError::NoSymbol {
                        place: place.to_owned(),
                        address,
                    })?;
                Value::Symbol {
                    name: d.symbol.name.clone(),
                    offset: d.offset as i64,
                }
            }
            Location::Constant(c) => Value::Direct(FetchExpr::Immediate(c)),
        })
    }
}

/// Where a value is, while its fields are followed.
enum Value {
    /// The fetch gives the value itself (a register, a constant).
    Direct(FetchExpr),
    /// In memory at what `base` fetches, plus `offset`.
    Memory { base: FetchExpr, offset: i64 },
    /// In memory at a symbol plus `offset` (a global: follows the KASLR slide).
    Symbol { name: String, offset: i64 },
}

impl Value {
    fn fetch(self) -> FetchExpr {
        match self {
            Value::Direct(e) => e,
            Value::Memory { base, offset } => FetchExpr::Deref {
                offset,
                user: false,
                base: Box::new(base),
            },
            Value::Symbol { name, offset } => FetchExpr::SymbolMemory { name, offset },
        }
    }
}

fn integer_type(size: u8, signed: bool) -> ArgType {
    match (size, signed) {
        (1, true) => ArgType::S8,
        (2, true) => ArgType::S16,
        (3..=4, true) => ArgType::S32,
        (_, true) => ArgType::S64,
        (1, false) => ArgType::U8,
        (2, false) => ArgType::U16,
        (3..=4, false) => ArgType::U32,
        (_, false) => ArgType::U64,
    }
}

fn register(r: DwarfRegister) -> Register {
    match r {
        DwarfRegister::Ax => Register::Ax,
        DwarfRegister::Dx => Register::Dx,
        DwarfRegister::Cx => Register::Cx,
        DwarfRegister::Bx => Register::Bx,
        DwarfRegister::Si => Register::Si,
        DwarfRegister::Di => Register::Di,
        DwarfRegister::Bp => Register::Bp,
        DwarfRegister::Sp => Register::Sp,
        DwarfRegister::R8 => Register::R8,
        DwarfRegister::R9 => Register::R9,
        DwarfRegister::R10 => Register::R10,
        DwarfRegister::R11 => Register::R11,
        DwarfRegister::R12 => Register::R12,
        DwarfRegister::R13 => Register::R13,
        DwarfRegister::R14 => Register::R14,
        DwarfRegister::R15 => Register::R15,
    }
}
