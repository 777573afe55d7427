//! Specs written back as `kprobe_events` lines: the canonical form, names always spelled out.

use super::*;

impl fmt::Display for ProbeSpec {
    /// The canonical `kprobe_events` line: group, event and argument names always spelled
    /// out, as the kernel lists them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let args = match self {
            ProbeSpec::Kprobe {
                group,
                event,
                target,
                args,
            } => {
                write!(f, "p:{group}/{event} {target}")?;
                args
            }
            ProbeSpec::Kretprobe {
                group,
                event,
                target,
                maxactive,
                args,
            } => {
                f.write_str("r")?;
                if let Some(n) = maxactive {
                    write!(f, "{n}")?;
                }
                write!(f, ":{group}/{event} {target}")?;
                args
            }
            ProbeSpec::Watch {
                group,
                event,
                target,
                access,
                len,
                args,
            } => {
                write!(f, "w:{group}/{event} {target}/{len}:{access}")?;
                args
            }
            ProbeSpec::Remove { group, event } => {
                f.write_str("-:")?;
                if let Some(group) = group {
                    write!(f, "{group}/")?;
                }
                return f.write_str(event);
            }
        };
        for arg in args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Symbol { name, offset: 0 } => f.write_str(name),
            Target::Symbol { name, offset } => write!(f, "{name}+{}", Number(*offset)),
            Target::Address(address) => write!(f, "{}", Number(address.raw())),
            Target::ModuleSymbol {
                module,
                name,
                offset: 0,
            } => write!(f, "{module}:{name}"),
            Target::ModuleSymbol { module, name, offset } => write!(f, "{module}:{name}+{}", Number(*offset)),
            Target::Source(point) => write!(f, "{point}"),
        }
    }
}

impl fmt::Display for SourcePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(module) = &self.module {
            write!(f, "{module}:")?;
        }
        match (&self.function, &self.file) {
            (Some(function), Some(file)) => write!(f, "{function}@{file}")?,
            (Some(function), None) => f.write_str(function)?,
            (None, Some(file)) => f.write_str(file)?,
            (None, None) => {}
        }
        match self.line {
            Some(line) => write!(f, ":{line}"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for BtfRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.base {
            BtfBase::Param(name) => f.write_str(name)?,
            BtfBase::Arg(n) => write!(f, "$arg{n}")?,
            BtfBase::Retval => f.write_str("$retval")?,
        }
        for field in &self.fields {
            let sep = if field.arrow { "->" } else { "." };
            write!(f, "{sep}{}", field.name)?;
        }
        Ok(())
    }
}

impl fmt::Display for FetchArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.expr {
            FetchExpr::AllArgs => return f.write_str("$arg*"),
            FetchExpr::Params => return f.write_str("$params"),
            FetchExpr::Vars => return f.write_str("$vars"),
            // Unnamed, as it was written: a name would make it the plain register.
            FetchExpr::Btf(BtfRef {
                base: BtfBase::Arg(_),
                fields,
            }) if fields.is_empty() => write!(f, "{}", self.expr)?,
            // Only a name taken from a BTF parameter can be this long, and written as
            // `NAME=` it would be refused: unnamed, the parameter names it again.
            _ if self.name.len() > MAX_ARG_NAME_LEN => write!(f, "{}", self.expr)?,
            _ => write!(f, "{}={}", self.name, self.expr)?,
        }
        // The default type is left out so that the text never outgrows the kernel's
        // 63-character limit when the input fit in it.
        let default_type = match self.expr {
            FetchExpr::Comm | FetchExpr::ImmString(_) => ArgType::String,
            FetchExpr::Duration => ArgType::U64,
            _ => ArgType::X64,
        };
        let btf = matches!(self.expr, FetchExpr::Btf(_));
        if (btf && self.typed) || (!btf && self.ty != default_type) || self.array_len.is_some() {
            write!(f, ":{}", self.ty)?;
        }
        if let Some(n) = self.array_len {
            write!(f, "[{n}]")?;
        }
        Ok(())
    }
}

impl fmt::Display for FetchExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchExpr::Register(r) => write!(f, "%{r}"),
            FetchExpr::Memory(address) => write!(f, "@{}", Number(address.raw())),
            FetchExpr::SymbolMemory { name, offset: 0 } => write!(f, "@{name}"),
            FetchExpr::SymbolMemory { name, offset } => write!(f, "@{name}{}", SignedNumber(*offset)),
            FetchExpr::StackEntry(n) => write!(f, "$stack{n}"),
            FetchExpr::StackPointer => f.write_str("$stack"),
            FetchExpr::Arg(n) => write!(f, "$arg{n}"),
            FetchExpr::Retval => f.write_str("$retval"),
            FetchExpr::Duration => f.write_str("$duration"),
            FetchExpr::Comm => f.write_str("$comm"),
            // Shown signed, as it was most likely written (`\\-1`), and shorter that way.
            FetchExpr::Immediate(value) => match *value as i64 {
                v if v < 0 => write!(f, "\\{}", SignedNumber(v)),
                _ => write!(f, "\\{}", Number(*value)),
            },
            FetchExpr::Deref { offset, user, base } => {
                let sign = if *offset < 0 { '-' } else { '+' };
                let user = if *user { "u" } else { "" };
                write!(f, "{sign}{user}{}({base})", Number(offset.unsigned_abs()))
            }
            FetchExpr::ImmString(text) => write!(f, "\\\"{text}\""),
            FetchExpr::Btf(r) => write!(f, "{r}"),
            FetchExpr::AllArgs => f.write_str("$arg*"),
            FetchExpr::Params => f.write_str("$params"),
            FetchExpr::Vars => f.write_str("$vars"),
        }
    }
}

/// A number in its shorter spelling, decimal or `0x` hex: never longer than any spelling
/// the parser accepts, so displayed fetch-args stay within the kernel's length limit.
pub(crate) struct Number(u64);

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let decimal = self.0.to_string();
        let hex = format!("{:#x}", self.0);
        f.write_str(if hex.len() < decimal.len() { &hex } else { &decimal })
    }
}

/// A signed [`Number`], always with its sign (`+8`, `-0x10`).
pub(crate) struct SignedNumber(i64);

impl fmt::Display for SignedNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { '-' } else { '+' };
        write!(f, "{sign}{}", Number(self.0.unsigned_abs()))
    }
}

impl fmt::Display for ArgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ArgType::U8 => "u8",
            ArgType::U16 => "u16",
            ArgType::U32 => "u32",
            ArgType::U64 => "u64",
            ArgType::S8 => "s8",
            ArgType::S16 => "s16",
            ArgType::S32 => "s32",
            ArgType::S64 => "s64",
            ArgType::X8 => "x8",
            ArgType::X16 => "x16",
            ArgType::X32 => "x32",
            ArgType::X64 => "x64",
            ArgType::String => "string",
            ArgType::UString => "ustring",
            ArgType::Symbol => "symbol",
            ArgType::SymStr => "symstr",
            ArgType::Char => "char",
            ArgType::Bitfield {
                width,
                offset,
                container_bits,
            } => {
                return write!(f, "b{width}@{offset}/{container_bits}");
            }
        };
        f.write_str(name)
    }
}
