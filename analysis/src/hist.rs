//! Hist triggers in ftrace's syntax, aggregated on the host, printed in the `hist` file's
//! layout (Linux 6.1, `kernel/trace/trace_events_hist.c` and `tracing_map.c`).
//!
//! ```text
//! hist:keys=KEY[,KEY...][:vals=VAL[,VAL...]][:sort=FIELD[.descending|.ascending][,FIELD...]][:size=N] [if FILTER]
//! ```
//!
//! - Up to 3 keys (`key=` and `keys=` are the same); a key is a field, optionally with
//!   one modifier: `.hex`, `.sym` (`[addr] symbol`), `.sym-offset` (`[addr]
//!   symbol+off/size`), `.execname` (on `common_pid`: the task's name beside the pid),
//!   `.log2` (the bucket `order_base_2(value)`, printed `~ 2^N`), `.buckets=N` (the value
//!   rounded down to a multiple of N). `common_cpu` (or `cpu`) keys on the CPU. `comm` is
//!   accepted as a string key too (6.1 refuses it; use `common_pid.execname` there).
//!   `stacktrace` keys on the event's kernel stack (its first 16 frames, which the probe
//!   engine unwinds at each hit), printed a frame per line as the kernel prints it; it
//!   sorts as equal to every other stack (`tracing_map_cmp_none`).
//! - Up to 2 values (`val=`, `vals=`, `values=`) besides `hitcount`, which is always
//!   there; a value is a numeric field, summed, optionally `.hex`.
//! - Up to 2 sort keys, each `hitcount` or a key's or a value's field name; default
//!   `hitcount`, ascending. Ties are ordered as the kernel orders them (entries are first
//!   sorted by their key bytes, then by the kernel's heapsort).
//! - `size=N`: at most N entries (rounded up to a power of 2, 128..131072; default 2048).
//!   A hit whose key is new when the table is full is dropped and counted (`Dropped:`);
//!   `Hits:` counts the hits that were aggregated.
//! - `if FILTER`: only hits that pass the filter (see [`crate::filter`]) are aggregated.
//!   A trigger sees every hit of its event, also those the event's own filter discards,
//!   as in the kernel (triggers run before the event filter).
//! - Not supported (refused with the reason): variables, expressions, actions (`onmatch`,
//!   `onmax`, `onchange`), `name=`, `clock=`, `pause`/`cont`/`clear`, `common_timestamp`,
//!   `.syscall`, `.usecs`, `.percent`, `.graph`.
//!
//! A faulted fetch counts as 0 (numbers) or the empty string in a key or a value.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt::Write as _;

use hvprobe_arch::Gva;
use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::output::HitRecord;

use crate::fields::{EventFields, Field, FieldError, FieldSource, FieldType, FieldValue};
use crate::filter::{Filter, FilterError, FilterExpr};

/// `size=` when none is given: 2^11 entries (`TRACING_MAP_BITS_DEFAULT`).
pub const DEFAULT_SIZE_BITS: u32 = 11;
const MIN_SIZE_BITS: u32 = 7;
const MAX_SIZE_BITS: u32 = 17;
/// `TRACING_MAP_KEYS_MAX`.
pub const MAX_KEYS: usize = 3;
/// `TRACING_MAP_VALS_MAX`, hitcount included.
pub const MAX_VALS: usize = 3;
/// `TRACING_MAP_SORT_KEYS_MAX`.
pub const MAX_SORT_KEYS: usize = 2;
/// Bytes of a string key (`MAX_FILTER_STR_VAL`), NUL included.
const STRING_KEY_SIZE: usize = 256;
/// Bytes of a `comm` key (`TASK_COMM_LEN`).
const COMM_KEY_SIZE: usize = 16;
/// Frames of a `stacktrace` key (`HIST_STACKTRACE_DEPTH`).
const STACK_KEY_FRAMES: usize = 16;
/// Bytes of a `stacktrace` key: its frames' addresses, zero after the last.
const STACK_KEY_SIZE: usize = STACK_KEY_FRAMES * 8;
/// Most bytes all keys of a trigger may take (`HIST_KEY_SIZE_MAX`: a string and a stack).
const MAX_KEY_SIZE: usize = STRING_KEY_SIZE + STACK_KEY_SIZE;
/// The key that is the event's kernel stack.
const STACKTRACE: &str = "stacktrace";

/// A key's modifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyModifier {
    Hex,
    Sym,
    SymOffset,
    Execname,
    Log2,
    Buckets(u64),
}

impl KeyModifier {
    /// As the trigger info prints it, after the field name.
    fn suffix(self) -> String {
        match self {
            KeyModifier::Hex => ".hex".into(),
            KeyModifier::Sym => ".sym".into(),
            KeyModifier::SymOffset => ".sym-offset".into(),
            KeyModifier::Execname => ".execname".into(),
            KeyModifier::Log2 => ".log2".into(),
            KeyModifier::Buckets(n) => format!(".buckets={n}"),
        }
    }
}

/// What is wrong with a trigger.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HistErrorKind {
    #[error("`{0}` triggers are not supported: only `hist:...` and `stacktrace`")]
    UnsupportedTrigger(String),
    #[error("`stacktrace` is a key, not a value")]
    Stacktrace,
    #[error("the `stacktrace` key takes no modifier")]
    StacktraceModifier,
    #[error("bad count `{0}`: expected a number above 0")]
    BadCount(String),
    #[error("a hist trigger needs `keys=`")]
    MissingKeys,
    #[error("`{0}` has no value")]
    EmptyAssignment(String),
    #[error("{0} are not supported")]
    NotSupported(&'static str),
    #[error("`{0}` is not a hist trigger attribute (keys=, vals=, sort=, size=; variables are not supported)")]
    UnknownAttribute(String),
    #[error("unknown modifier `.{0}` (keys take .hex, .sym, .sym-offset, .execname, .log2, .buckets=N)")]
    UnknownModifier(String),
    #[error("values take only the .hex modifier, not `.{0}`")]
    ValueModifier(String),
    #[error("more than {MAX_KEYS} keys")]
    TooManyKeys,
    #[error("more than {} values besides hitcount", MAX_VALS - 1)]
    TooManyValues,
    #[error("more than {MAX_SORT_KEYS} sort keys")]
    TooManySortKeys,
    #[error("empty field name")]
    EmptyField,
    #[error("bad sort modifier `.{0}` (.descending or .ascending)")]
    SortModifier(String),
    #[error("bad size `{0}`: expected 128 to 131072 (rounded up to a power of 2)")]
    BadSize(String),
    #[error("bad bucket size `{0}`: expected a number above 0")]
    BadBuckets(String),
    #[error("expected `if FILTER` after the trigger")]
    ExpectedIf,
    #[error("in the filter: {0}")]
    Filter(FilterErrorKindBox),
    #[error(transparent)]
    Field(#[from] FieldError),
    #[error("`.execname` is only for common_pid, not `{0}`")]
    ExecnameNotPid(String),
    #[error("`{modifier}` does not apply to string key `{field}`")]
    ModifierOnString { field: String, modifier: String },
    #[error("value `{0}` is a string: values are summed numbers")]
    StringValue(String),
    #[error("sort key `{0}` is neither hitcount, a key nor a value")]
    SortField(String),
    #[error("the keys take more than {MAX_KEY_SIZE} bytes (a string key takes {STRING_KEY_SIZE})")]
    KeysTooLarge,
}

/// A filter error inside a trigger (boxed: the kinds nest).
pub type FilterErrorKindBox = Box<crate::filter::FilterErrorKind>;

/// A trigger error, at a byte offset into the trigger text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct HistError {
    pub offset: usize,
    pub kind: HistErrorKind,
}

impl HistError {
    pub(crate) fn at(offset: usize, kind: HistErrorKind) -> HistError {
        HistError { offset, kind }
    }

    pub(crate) fn from_filter(base: usize, e: FilterError) -> HistError {
        HistError {
            offset: base + e.offset,
            kind: HistErrorKind::Filter(Box::new(e.kind)),
        }
    }
}

/// A key as written: field name, modifier, where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KeySpec {
    name: String,
    modifier: Option<KeyModifier>,
    at: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ValueSpec {
    name: String,
    hex: bool,
    at: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SortSpec {
    name: String,
    descending: bool,
    at: usize,
}

/// A hist trigger as parsed, before its fields are looked up in an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistSpec {
    keys: Vec<KeySpec>,
    values: Vec<ValueSpec>,
    sort: Vec<SortSpec>,
    size_bits: u32,
    /// The filter after `if`, and where its text starts.
    filter: Option<(FilterExpr, usize)>,
}

/// `s` split at `sep`, each piece with its byte offset in `s`.
fn split_at(s: &str, sep: char) -> impl Iterator<Item = (usize, &str)> {
    let mut offset = 0;
    s.split(sep).map(move |piece| {
        let at = offset;
        offset += piece.len() + sep.len_utf8();
        (at, piece)
    })
}

impl HistSpec {
    /// Parses a trigger (what one writes to `events/GRP/EVENT/trigger`). Only `hist`
    /// triggers are supported.
    pub fn parse(text: &str) -> Result<HistSpec, HistError> {
        let lead = text.len() - text.trim_start().len();
        let trimmed = text.trim();
        let (command, params) = match trimmed.split_once(':') {
            Some((c, p)) => (c, Some(p)),
            None => (trimmed.split_whitespace().next().unwrap_or(""), None),
        };
        match command {
            "hist" => {}
            other => return Err(HistError::at(lead, HistErrorKind::UnsupportedTrigger(other.to_owned()))),
        }
        let params_at = lead + command.len() + 1;
        let params = params.ok_or(HistError::at(params_at - 1, HistErrorKind::MissingKeys))?;
        // The attributes end at the first blank; what follows must be `if FILTER`.
        let (attrs, rest) = match params.find([' ', '\t']) {
            Some(at) => (&params[..at], Some(at)),
            None => (params, None),
        };
        let filter = match rest {
            None => None,
            Some(at) => {
                let after = &params[at..];
                let if_at = at + (after.len() - after.trim_start().len());
                let tail = &params[if_at..];
                let body = tail
                    .strip_prefix("if")
                    .filter(|b| b.starts_with([' ', '\t']))
                    .ok_or(HistError::at(params_at + if_at, HistErrorKind::ExpectedIf))?;
                let body_at = params_at + if_at + 2;
                let expr = FilterExpr::parse(body).map_err(|e| HistError::from_filter(body_at, e))?;
                Some((expr, body_at))
            }
        };
        let mut spec = HistSpec {
            keys: Vec::new(),
            values: Vec::new(),
            sort: Vec::new(),
            size_bits: DEFAULT_SIZE_BITS,
            filter,
        };
        let mut have_keys = false;
        for (offset, attr) in split_at(attrs, ':') {
            let at = params_at + offset;
            match attr.split_once('=') {
                Some((name, value)) => {
                    if value.is_empty() {
                        return Err(HistError::at(at, HistErrorKind::EmptyAssignment(attr.to_owned())));
                    }
                    let value_at = at + name.len() + 1;
                    match name {
                        "key" | "keys" => {
                            spec.keys = parse_keys(value, value_at)?;
                            have_keys = true;
                        }
                        "val" | "vals" | "values" => spec.values = parse_values(value, value_at)?,
                        "sort" => spec.sort = parse_sort(value, value_at)?,
                        "size" => spec.size_bits = parse_size(value, value_at)?,
                        "name" => {
                            return Err(HistError::at(
                                at,
                                HistErrorKind::NotSupported("named histograms (name=)"),
                            ))
                        }
                        "clock" => {
                            return Err(HistError::at(
                                at,
                                HistErrorKind::NotSupported("clocks (clock=, for common_timestamp)"),
                            ))
                        }
                        _ => return Err(HistError::at(at, HistErrorKind::UnknownAttribute(attr.to_owned()))),
                    }
                }
                None => match attr {
                    "pause" | "cont" | "continue" | "clear" => {
                        return Err(HistError::at(at, HistErrorKind::NotSupported("pause, cont and clear")))
                    }
                    a if a.starts_with("onmatch(") || a.starts_with("onmax(") || a.starts_with("onchange(") => {
                        return Err(HistError::at(
                            at,
                            HistErrorKind::NotSupported("actions (onmatch, onmax, onchange)"),
                        ))
                    }
                    other => return Err(HistError::at(at, HistErrorKind::UnknownAttribute(other.to_owned()))),
                },
            }
        }
        if !have_keys {
            return Err(HistError::at(params_at, HistErrorKind::MissingKeys));
        }
        Ok(spec)
    }

    /// The trigger for an event with these fields.
    pub fn bind(&self, fields: &EventFields) -> Result<HistTrigger, HistError> {
        let mut keys = Vec::new();
        let mut key_size = 0;
        for k in &self.keys {
            let key = bind_key(k, fields, key_size)?;
            key_size += key.size;
            if key_size > MAX_KEY_SIZE {
                return Err(HistError::at(k.at, HistErrorKind::KeysTooLarge));
            }
            keys.push(key);
        }
        let mut values = Vec::new();
        for v in &self.values {
            let field = lookup(fields, &v.name, v.at)?;
            if field.ty == FieldType::String {
                return Err(HistError::at(v.at, HistErrorKind::StringValue(v.name.clone())));
            }
            values.push(ValueField { field, hex: v.hex });
        }
        let mut sort = Vec::new();
        for s in &self.sort {
            let target = if s.name == "hitcount" {
                SortTarget::Sum(0)
            } else if let Some(i) = values.iter().position(|v| v.field.name == s.name) {
                SortTarget::Sum(i + 1)
            } else if let Some(i) = keys.iter().position(|k| k.field.name == s.name) {
                SortTarget::Key(i)
            } else {
                return Err(HistError::at(s.at, HistErrorKind::SortField(s.name.clone())));
            };
            sort.push(SortKey {
                target,
                descending: s.descending,
            });
        }
        if sort.is_empty() {
            sort.push(SortKey {
                target: SortTarget::Sum(0),
                descending: false,
            });
        }
        let filter = match &self.filter {
            Some((expr, at)) => Some(expr.bind(fields).map_err(|e| HistError::from_filter(*at, e))?),
            None => None,
        };
        Ok(HistTrigger {
            keys,
            values,
            sort,
            size_bits: self.size_bits,
            key_size,
            filter,
        })
    }
}

/// A field name and its modifier, `name[.modifier]`.
fn split_modifier(field: &str) -> (&str, Option<&str>) {
    match field.split_once('.') {
        Some((name, modifier)) => (name, Some(modifier)),
        None => (field, None),
    }
}

/// A field name that is not a plain field: refused with what it is.
fn check_plain(name: &str, at: usize) -> Result<(), HistError> {
    if name.is_empty() {
        return Err(HistError::at(at, HistErrorKind::EmptyField));
    }
    if name == "stacktrace" {
        return Err(HistError::at(at, HistErrorKind::Stacktrace));
    }
    if name == "common_timestamp" {
        return Err(HistError::at(
            at,
            HistErrorKind::NotSupported("common_timestamp fields"),
        ));
    }
    if name.starts_with('$') || !name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') {
        return Err(HistError::at(
            at,
            HistErrorKind::NotSupported("expressions and variable references in keys and values"),
        ));
    }
    Ok(())
}

fn parse_keys(list: &str, list_at: usize) -> Result<Vec<KeySpec>, HistError> {
    let mut keys = Vec::new();
    for (offset, text) in split_at(list, ',') {
        let at = list_at + offset;
        if keys.len() == MAX_KEYS {
            return Err(HistError::at(at, HistErrorKind::TooManyKeys));
        }
        let (name, modifier) = split_modifier(text);
        if name == STACKTRACE {
            if modifier.is_some() {
                return Err(HistError::at(at + name.len(), HistErrorKind::StacktraceModifier));
            }
            keys.push(KeySpec {
                name: name.to_owned(),
                modifier: None,
                at,
            });
            continue;
        }
        check_plain(name, at)?;
        let modifier = match modifier {
            None => None,
            Some(m) => {
                let m_at = at + name.len() + 1;
                Some(match m {
                    "hex" => KeyModifier::Hex,
                    "sym" => KeyModifier::Sym,
                    "sym-offset" => KeyModifier::SymOffset,
                    "execname" => KeyModifier::Execname,
                    "log2" => KeyModifier::Log2,
                    "syscall" => {
                        return Err(HistError::at(
                            m_at,
                            HistErrorKind::NotSupported("syscall names (.syscall)"),
                        ))
                    }
                    "usecs" | "percent" | "graph" => {
                        return Err(HistError::at(
                            m_at,
                            HistErrorKind::NotSupported(".usecs, .percent and .graph"),
                        ))
                    }
                    m => match m.strip_prefix("buckets=").or_else(|| m.strip_prefix("bucket=")) {
                        Some(n) => KeyModifier::Buckets(
                            crate::filter::parse_unsigned(n)
                                .filter(|&n| n > 0)
                                .ok_or(HistError::at(m_at, HistErrorKind::BadBuckets(n.to_owned())))?,
                        ),
                        None => return Err(HistError::at(m_at, HistErrorKind::UnknownModifier(m.to_owned()))),
                    },
                })
            }
        };
        keys.push(KeySpec {
            name: name.to_owned(),
            modifier,
            at,
        });
    }
    Ok(keys)
}

fn parse_values(list: &str, list_at: usize) -> Result<Vec<ValueSpec>, HistError> {
    let mut values = Vec::new();
    for (offset, text) in split_at(list, ',') {
        let at = list_at + offset;
        if text == "hitcount" {
            continue;
        }
        if values.len() == MAX_VALS - 1 {
            return Err(HistError::at(at, HistErrorKind::TooManyValues));
        }
        let (name, modifier) = split_modifier(text);
        check_plain(name, at)?;
        let hex = match modifier {
            None => false,
            Some("hex") => true,
            Some(m) => {
                return Err(HistError::at(
                    at + name.len() + 1,
                    HistErrorKind::ValueModifier(m.to_owned()),
                ))
            }
        };
        values.push(ValueSpec {
            name: name.to_owned(),
            hex,
            at,
        });
    }
    Ok(values)
}

fn parse_sort(list: &str, list_at: usize) -> Result<Vec<SortSpec>, HistError> {
    let mut sort = Vec::new();
    for (offset, text) in split_at(list, ',') {
        let at = list_at + offset;
        if sort.len() == MAX_SORT_KEYS {
            return Err(HistError::at(at, HistErrorKind::TooManySortKeys));
        }
        let (name, modifier) = split_modifier(text);
        if name.is_empty() {
            return Err(HistError::at(at, HistErrorKind::EmptyField));
        }
        let descending = match modifier {
            None | Some("ascending") => false,
            Some("descending") => true,
            Some(m) => {
                return Err(HistError::at(
                    at + name.len() + 1,
                    HistErrorKind::SortModifier(m.to_owned()),
                ))
            }
        };
        sort.push(SortSpec {
            name: name.to_owned(),
            descending,
            at,
        });
    }
    Ok(sort)
}

/// `size=N` as `parse_map_size`: N rounded up to a power of 2, as its exponent.
fn parse_size(text: &str, at: usize) -> Result<u32, HistError> {
    let bad = || HistError::at(at, HistErrorKind::BadSize(text.to_owned()));
    let size = crate::filter::parse_unsigned(text).ok_or_else(bad)?;
    let bits = size.checked_next_power_of_two().ok_or_else(bad)?.trailing_zeros();
    if (MIN_SIZE_BITS..=MAX_SIZE_BITS).contains(&bits) {
        Ok(bits)
    } else {
        Err(bad())
    }
}

fn lookup(fields: &EventFields, name: &str, at: usize) -> Result<Field, HistError> {
    if name == "common_cpu" {
        return Ok(Field {
            name: name.to_owned(),
            source: FieldSource::Cpu,
            ty: FieldType::Number { size: 4, signed: true },
        });
    }
    fields.lookup(name).map_err(|e| HistError::at(at, e.into()))
}

fn bind_key(k: &KeySpec, fields: &EventFields, offset: usize) -> Result<KeyField, HistError> {
    if k.name == STACKTRACE {
        return Ok(KeyField {
            field: Field {
                name: STACKTRACE.to_owned(),
                source: FieldSource::Stacktrace,
                ty: FieldType::Number { size: 8, signed: false },
            },
            modifier: None,
            offset,
            size: STACK_KEY_SIZE,
            compare: KeyCompare::Stack,
        });
    }
    let field = lookup(fields, &k.name, k.at)?;
    if k.modifier == Some(KeyModifier::Execname) && field.source != FieldSource::CommonPid {
        return Err(HistError::at(k.at, HistErrorKind::ExecnameNotPid(k.name.clone())));
    }
    let (size, compare) = match (field.ty, &field.source) {
        (FieldType::String, source) => {
            if let Some(m) = k.modifier {
                return Err(HistError::at(
                    k.at,
                    HistErrorKind::ModifierOnString {
                        field: k.name.clone(),
                        modifier: m.suffix(),
                    },
                ));
            }
            let size = if *source == FieldSource::Comm {
                COMM_KEY_SIZE
            } else {
                STRING_KEY_SIZE
            };
            (size, KeyCompare::String)
        }
        // The CPU is compared as the key's 8 bytes; fields as their own type.
        (_, FieldSource::Cpu) => (8, KeyCompare::Number(FieldType::Number { size: 8, signed: false })),
        (ty, _) => (8, KeyCompare::Number(ty)),
    };
    Ok(KeyField {
        field,
        modifier: k.modifier,
        offset,
        size,
        compare,
    })
}

/// A hist trigger bound to one event's fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistTrigger {
    keys: Vec<KeyField>,
    values: Vec<ValueField>,
    sort: Vec<SortKey>,
    size_bits: u32,
    /// Bytes of an entry's key: every key's bytes, in order.
    key_size: usize,
    filter: Option<Filter>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyField {
    field: Field,
    modifier: Option<KeyModifier>,
    /// Where its bytes are in the entry's key, and how many.
    offset: usize,
    size: usize,
    compare: KeyCompare,
}

/// How two entries compare by a key (the map's `cmp_fn` for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyCompare {
    /// As the field's type: `(type)value`.
    Number(FieldType),
    /// `strcmp`.
    String,
    /// Not at all (`tracing_map_cmp_none`): a stack sorts as equal to every other.
    Stack,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ValueField {
    field: Field,
    hex: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SortKey {
    target: SortTarget,
    descending: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SortTarget {
    /// Sum `i`: 0 is hitcount, then the values.
    Sum(usize),
    /// Key `i`.
    Key(usize),
}

impl HistTrigger {
    /// Whether a key is the `stacktrace`: the event's probe must unwind at every hit.
    pub fn needs_stack(&self) -> bool {
        self.keys.iter().any(|k| k.compare == KeyCompare::Stack)
    }

    /// Most entries (`size=`).
    pub fn capacity(&self) -> usize {
        1 << self.size_bits
    }

    fn key_name(&self, key: &KeyField) -> String {
        let name = match key.field.source {
            FieldSource::Cpu => "common_cpu",
            _ => &key.field.name,
        };
        format!("{name}{}", key.modifier.map(KeyModifier::suffix).unwrap_or_default())
    }

    /// The trigger as the kernel prints it in `trigger` and in the hist file's `# trigger
    /// info:` line, without ` [active]`: `hist:keys=...:vals=hitcount,...:sort=...:size=N`
    /// and ` if FILTER`.
    pub fn info(&self) -> String {
        let keys: Vec<String> = self.keys.iter().map(|k| self.key_name(k)).collect();
        let mut out = format!("hist:keys={}:vals=hitcount", keys.join(","));
        for v in &self.values {
            let _ = write!(out, ",{}{}", v.field.name, if v.hex { ".hex" } else { "" });
        }
        out.push_str(":sort=");
        for (i, s) in self.sort.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            match s.target {
                SortTarget::Sum(0) => out.push_str("hitcount"),
                SortTarget::Sum(v) => {
                    let v = &self.values[v - 1];
                    let _ = write!(out, "{}{}", v.field.name, if v.hex { ".hex" } else { "" });
                }
                SortTarget::Key(k) => out.push_str(&self.key_name(&self.keys[k])),
            }
            if s.descending {
                out.push_str(".descending");
            }
        }
        let _ = write!(out, ":size={}", self.capacity());
        if let Some(f) = &self.filter {
            let _ = write!(out, " if {}", f.text());
        }
        out
    }
}

/// `order_base_2(value)`: the smallest `n` with `2^n >= value` (0 for 0 and 1).
pub fn order_base_2(value: u64) -> u64 {
    if value > 1 {
        u64::from(64 - (value - 1).leading_zeros())
    } else {
        0
    }
}

/// One entry's aggregates.
#[derive(Clone, Debug, PartialEq, Eq)]
struct EntryData {
    /// hitcount, then each value's sum.
    sums: [u64; MAX_VALS],
    /// For an `.execname` key: the task's name when the entry was made.
    comm: Option<String>,
}

/// A trigger's aggregation: its entries, and the hits it took and dropped.
#[derive(Clone, Debug)]
pub struct Histogram {
    trigger: HistTrigger,
    entries: HashMap<Box<[u8]>, EntryData>,
    hits: u64,
    dropped: u64,
    /// The key being built (no allocation per hit).
    scratch: Vec<u8>,
}

impl Histogram {
    pub fn new(trigger: HistTrigger) -> Histogram {
        Histogram {
            scratch: vec![0; trigger.key_size],
            entries: HashMap::new(),
            hits: 0,
            dropped: 0,
            trigger,
        }
    }

    pub fn trigger(&self) -> &HistTrigger {
        &self.trigger
    }

    /// Counts `hit` (if it passes the trigger's filter).
    pub fn record(&mut self, hit: &HitRecord) {
        let trigger = &self.trigger;
        if trigger.filter.as_ref().is_some_and(|f| !f.matches(hit)) {
            return;
        }
        self.scratch.fill(0);
        for key in &trigger.keys {
            let bytes = &mut self.scratch[key.offset..key.offset + key.size];
            if key.compare == KeyCompare::Stack {
                for (slot, frame) in bytes
                    .chunks_exact_mut(8)
                    .zip(hit.stack.iter().flatten().take(STACK_KEY_FRAMES))
                {
                    slot.copy_from_slice(&frame.address.0.to_le_bytes());
                }
                continue;
            }
            match key.field.value(hit) {
                FieldValue::Str(s) => {
                    let n = s.iter().position(|&c| c == 0).unwrap_or(s.len()).min(key.size - 1);
                    bytes[..n].copy_from_slice(&s[..n]);
                }
                value => {
                    let raw = match value {
                        FieldValue::Number(v) => key.field.ty.normalize(v),
                        _ => 0,
                    };
                    let v = match key.modifier {
                        Some(KeyModifier::Log2) => order_base_2(raw),
                        Some(KeyModifier::Buckets(n)) => raw / n * n,
                        _ => raw,
                    };
                    bytes.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        let entry = match self.entries.get_mut(self.scratch.as_slice()) {
            Some(entry) => entry,
            None => {
                if self.entries.len() >= trigger.capacity() {
                    self.dropped += 1;
                    return;
                }
                let comm = trigger
                    .keys
                    .iter()
                    .any(|k| k.modifier == Some(KeyModifier::Execname))
                    .then(|| execname(hit));
                self.entries
                    .entry(self.scratch.clone().into_boxed_slice())
                    .or_insert(EntryData {
                        sums: [0; MAX_VALS],
                        comm,
                    })
            }
        };
        self.hits += 1;
        entry.sums[0] += 1;
        for (i, v) in trigger.values.iter().enumerate() {
            if let FieldValue::Number(n) = v.field.value(hit) {
                entry.sums[i + 1] = entry.sums[i + 1].wrapping_add(v.field.ty.normalize(n));
            }
        }
    }

    /// Hits aggregated (`Hits:`).
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Hits dropped because the table was full (`Dropped:`).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Entries (`Entries:`).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in the order the hist file lists them (`tracing_map_sort_entries`).
    fn sorted(&self) -> Vec<(&[u8], &EntryData)> {
        let mut entries: Vec<(&[u8], &EntryData)> = self.entries.iter().map(|(k, d)| (&**k, d)).collect();
        if entries.len() < 2 {
            return entries;
        }
        // The kernel's duplicate check sorts them by their key bytes first (memcmp).
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let primary = self.trigger.sort[0];
        crate::kernel_sort::sort(&mut entries, |a, b| self.compare(primary, a, b));
        if let Some(&secondary) = self.trigger.sort.get(1) {
            self.sort_secondary(&mut entries, primary, secondary);
        }
        entries
    }

    fn compare(&self, by: SortKey, a: &(&[u8], &EntryData), b: &(&[u8], &EntryData)) -> Ordering {
        let order = match by.target {
            SortTarget::Sum(i) => a.1.sums[i].cmp(&b.1.sums[i]),
            SortTarget::Key(k) => {
                let key = &self.trigger.keys[k];
                let (x, y) = (key_bytes(a.0, key), key_bytes(b.0, key));
                match key.compare {
                    KeyCompare::Stack => Ordering::Equal,
                    KeyCompare::String => until_nul(x).cmp(until_nul(y)),
                    KeyCompare::Number(ty) => {
                        let (x, y) = (ty.normalize(number(x)), ty.normalize(number(y)));
                        if ty.is_signed() {
                            (x as i64).cmp(&(y as i64))
                        } else {
                            x.cmp(&y)
                        }
                    }
                }
            }
        };
        if by.descending {
            order.reverse()
        } else {
            order
        }
    }

    /// `sort_secondary`: each run of entries equal by the primary key sorted by the
    /// secondary one (its loop, ends included, as the kernel has it).
    fn sort_secondary(&self, entries: &mut [(&[u8], &EntryData)], primary: SortKey, secondary: SortKey) {
        let n = entries.len();
        let (mut start, mut n_sub) = (0, 1);
        for i in 0..n - 1 {
            if self.compare(primary, &entries[i], &entries[i + 1]).is_eq() {
                n_sub += 1;
                if i < n - 2 {
                    continue;
                }
            }
            if n_sub < 2 {
                start = i + 1;
                n_sub = 1;
                continue;
            }
            crate::kernel_sort::sort(&mut entries[start..start + n_sub], |a, b| self.compare(secondary, a, b));
            start = i + 1;
            n_sub = 1;
        }
    }

    /// The histogram as one trigger's part of the `hist` file (`hist_trigger_show`).
    pub fn render(&self, symbols: Option<&SymbolTable>) -> String {
        let mut out = format!(
            "# event histogram\n#\n# trigger info: {} [active]\n#\n\n",
            self.trigger.info()
        );
        let entries = self.sorted();
        for (key, data) in &entries {
            out.push_str("{ ");
            for (i, k) in self.trigger.keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                self.render_key(&mut out, k, key_bytes(key, k), data, symbols);
            }
            // A stack's lines end with their newline: no blank before the brace then.
            let multiline = self.trigger.keys.iter().any(|k| k.compare == KeyCompare::Stack);
            out.push_str(if multiline { "}" } else { " }" });
            let _ = write!(out, " hitcount: {:>10}", data.sums[0]);
            for (i, v) in self.trigger.values.iter().enumerate() {
                let sum = data.sums[i + 1];
                if v.hex {
                    let _ = write!(out, "  {}: {:>10x}", v.field.name, sum);
                } else {
                    let _ = write!(out, "  {}: {:>10}", v.field.name, sum);
                }
            }
            out.push('\n');
        }
        let _ = write!(
            out,
            "\nTotals:\n    Hits: {}\n    Entries: {}\n    Dropped: {}\n",
            self.hits,
            entries.len(),
            self.dropped
        );
        out
    }

    fn render_key(
        &self,
        out: &mut String,
        k: &KeyField,
        bytes: &[u8],
        data: &EntryData,
        symbols: Option<&SymbolTable>,
    ) {
        let label = &k.field.name;
        if k.compare == KeyCompare::Stack {
            // `hist_trigger_stacktrace_print`: a line per frame, `%pS` after 9 blanks.
            out.push_str("stacktrace:\n");
            for address in stack_frames(bytes) {
                let _ = writeln!(out, "{:9}{}", "", symbol_offset(symbols, address));
            }
            return;
        }
        if k.compare == KeyCompare::String {
            let _ = write!(out, "{label}: {:<50}", String::from_utf8_lossy(until_nul(bytes)));
            return;
        }
        let v = number(bytes);
        let _ = match k.modifier {
            Some(KeyModifier::Hex) => write!(out, "{label}: {v:x}"),
            Some(KeyModifier::Sym) => write!(out, "{label}: [{v:x}] {:<45}", symbol_name(symbols, v)),
            Some(KeyModifier::SymOffset) => write!(out, "{label}: [{v:x}] {:<55}", symbol_offset(symbols, v)),
            Some(KeyModifier::Execname) => {
                write!(out, "{label}: {:<16}[{v:>10}]", data.comm.as_deref().unwrap_or(""))
            }
            Some(KeyModifier::Log2) => write!(out, "{label}: ~ 2^{v:<2}"),
            Some(KeyModifier::Buckets(n)) => write!(out, "{label}: ~ {v}-{}", v.wrapping_add(n - 1)),
            None => write!(out, "{label}: {v:>10}"),
        };
    }

    /// The histogram as JSON: `event` is for the caller to add. Keys are named as in the
    /// trigger (`common_pid.execname`); numbers are numbers (signed fields signed),
    /// `.sym`/`.sym-offset` keys `{"address","symbol"}`, `.execname` `{"pid","comm"}`,
    /// `.log2` `{"log2"}` (the bucket's exponent), `.buckets` `{"from","to"}`.
    pub fn to_json(&self, symbols: Option<&SymbolTable>) -> serde_json::Value {
        use serde_json::{json, Map, Value};
        let entries: Vec<Value> = self
            .sorted()
            .into_iter()
            .map(|(key, data)| {
                let mut keys = Map::new();
                for k in &self.trigger.keys {
                    let bytes = key_bytes(key, k);
                    let value = if k.compare == KeyCompare::Stack {
                        Value::from(
                            stack_frames(bytes)
                                .map(|a| json!({"address": format!("{a:#x}"), "symbol": symbol_offset(symbols, a)}))
                                .collect::<Vec<_>>(),
                        )
                    } else if k.compare == KeyCompare::String {
                        Value::from(String::from_utf8_lossy(until_nul(bytes)).into_owned())
                    } else {
                        let v = number(bytes);
                        match k.modifier {
                            Some(KeyModifier::Sym) => {
                                json!({"address": format!("{v:#x}"), "symbol": symbol_name(symbols, v)})
                            }
                            Some(KeyModifier::SymOffset) => {
                                json!({"address": format!("{v:#x}"), "symbol": symbol_offset(symbols, v)})
                            }
                            Some(KeyModifier::Execname) => json!({"pid": v as i64, "comm": data.comm}),
                            Some(KeyModifier::Log2) => json!({ "log2": v }),
                            Some(KeyModifier::Buckets(n)) => json!({"from": v, "to": v.wrapping_add(n - 1)}),
                            _ if k.field.ty.is_signed() => Value::from(v as i64),
                            _ => Value::from(v),
                        }
                    };
                    keys.insert(self.trigger.key_name(k), value);
                }
                let mut entry = Map::new();
                entry.insert("keys".into(), Value::Object(keys));
                entry.insert("hitcount".into(), Value::from(data.sums[0]));
                for (i, v) in self.trigger.values.iter().enumerate() {
                    entry.insert(v.field.name.clone(), Value::from(data.sums[i + 1]));
                }
                Value::Object(entry)
            })
            .collect();
        json!({
            "trigger": self.trigger.info(),
            "entries": entries,
            "totals": {"hits": self.hits, "entries": self.entries.len(), "dropped": self.dropped},
        })
    }
}

fn key_bytes<'a>(key: &'a [u8], k: &KeyField) -> &'a [u8] {
    &key[k.offset..k.offset + k.size]
}

fn number(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

/// The frames of a `stacktrace` key, up to the first zero.
fn stack_frames(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .take_while(|&a| a != 0)
}

fn until_nul(bytes: &[u8]) -> &[u8] {
    &bytes[..bytes.iter().position(|&c| c == 0).unwrap_or(bytes.len())]
}

/// The task name `.execname` shows: `<idle>` for pid 0, as the kernel's `save_comm`.
fn execname(hit: &HitRecord) -> String {
    if hit.pid == 0 {
        "<idle>".into()
    } else {
        hit.comm.clone()
    }
}

/// `%ps`: the symbol's name, or `0x...`.
fn symbol_name(symbols: Option<&SymbolTable>, address: u64) -> String {
    symbols
        .and_then(|s| s.describe(Gva(address)))
        .map_or_else(|| format!("{address:#x}"), |d| d.symbol.name.clone())
}

/// `%pS`: `symbol+0xoff/0xsize`, or `0x...`.
fn symbol_offset(symbols: Option<&SymbolTable>, address: u64) -> String {
    symbols
        .and_then(|s| s.describe(Gva(address)))
        .map_or_else(|| format!("{address:#x}"), |d| d.to_string())
}

#[cfg(test)]
mod tests;
