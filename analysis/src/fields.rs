//! The fields of a kprobe event as filters and hist triggers name them, and their values
//! in a hit.
//!
//! Names are looked up as the kernel's `trace_find_event_field` does: the event's own
//! fields (its fetch-args) first, then the generic fields `cpu`/`CPU` and `comm`/`COMM`,
//! then the common field `common_pid`. The other common fields (`common_type`,
//! `common_flags`, `common_preempt_count`) describe the guest's state at the hit, which the
//! host does not have, and are refused.
//!
//! Types follow the kernel's field definitions for kprobe events: `u*`, `x*` and bitfields
//! are unsigned of their size (a bitfield of its container's size), `s*` signed, `symbol`
//! an unsigned 8-byte address, `string`/`ustring`/`symstr`/`$comm` strings; `common_pid`
//! is a signed 4-byte `int`, `cpu` a signed `int`. Arrays can be neither filtered nor
//! keyed (the kernel has no predicate for them either).

use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::HitRecord;
use hvprobe_probes::spec::{ArgType, FetchArg};

/// How a field's value is compared and aggregated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldType {
    /// A number of `size` bytes (1, 2, 4 or 8), signed or not.
    Number { size: u8, signed: bool },
    /// A NUL-terminated string.
    String,
}

impl FieldType {
    /// The type of a (non-array) fetch-arg's field.
    pub fn of_arg_type(ty: ArgType) -> FieldType {
        match ty {
            ArgType::String | ArgType::UString | ArgType::SymStr => FieldType::String,
            ArgType::S8 | ArgType::S16 | ArgType::S32 | ArgType::S64 => FieldType::Number {
                size: ty.record_size() as u8,
                signed: true,
            },
            other => FieldType::Number {
                size: other.record_size() as u8,
                signed: false,
            },
        }
    }

    /// `value` cut to this type's size and, for a signed type, sign-extended: what the
    /// kernel's `(type)value` gives, as the 64 bits it compares.
    pub fn normalize(self, value: u64) -> u64 {
        match self {
            FieldType::Number { size, signed } if size < 8 => {
                let shift = 64 - 8 * u32::from(size);
                if signed {
                    (((value << shift) as i64) >> shift) as u64
                } else {
                    (value << shift) >> shift
                }
            }
            _ => value,
        }
    }

    pub fn is_signed(self) -> bool {
        matches!(self, FieldType::Number { signed: true, .. })
    }
}

/// Where a field's value comes from in a hit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldSource {
    /// The fetch-arg at this index of the event's args.
    Arg(usize),
    /// `common_pid`: the task's pid.
    CommonPid,
    /// `comm`/`COMM`: the task's name.
    Comm,
    /// `cpu`/`CPU`: the (v)CPU that hit.
    Cpu,
    /// The `stacktrace` hist key: the kernel stack the probe engine unwound at the hit
    /// (only a hist key names it; it is no field of filters).
    Stacktrace,
}

/// One field of an event, resolved by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// The name as it was looked up (`cpu` and `CPU` are the same field).
    pub name: String,
    pub source: FieldSource,
    pub ty: FieldType,
}

/// A field's value in one hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldValue<'a> {
    /// A number as 64 bits: unsigned values zero-extended, signed ones sign-extended.
    Number(u64),
    /// A string's bytes, without the NUL.
    Str(&'a [u8]),
    /// The fetch faulted, or the hit has no such value.
    Missing,
}

/// Why a field name cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    #[error("no field `{name}` (this event has {})", known_fields(.known))]
    Unknown { name: String, known: Vec<String> },
    #[error("field `{0}` is an array: arrays can not be filtered or aggregated")]
    Array(String),
    #[error("field `{0}` is the guest's state at the hit, which the host does not have")]
    NotOnHost(String),
}

fn known_fields(known: &[String]) -> String {
    let mut all: Vec<&str> = known.iter().map(String::as_str).collect();
    all.extend(["common_pid", "comm", "cpu"]);
    all.join(", ")
}

/// The fields of one event: its fetch-args and the common and generic fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventFields {
    /// Per fetch-arg: its name and its type (`None` for an array).
    args: Vec<(String, Option<FieldType>)>,
}

impl EventFields {
    /// The fields of an event with these fetch-args.
    pub fn new(args: &[FetchArg]) -> EventFields {
        EventFields {
            args: args
                .iter()
                .map(|a| {
                    let ty = a.array_len.is_none().then(|| FieldType::of_arg_type(a.ty));
                    (a.name.clone(), ty)
                })
                .collect(),
        }
    }

    /// The field called `name`.
    pub fn lookup(&self, name: &str) -> Result<Field, FieldError> {
        if let Some(index) = self.args.iter().position(|(n, _)| n == name) {
            return match self.args[index].1 {
                Some(ty) => Ok(Field {
                    name: name.to_owned(),
                    source: FieldSource::Arg(index),
                    ty,
                }),
                None => Err(FieldError::Array(name.to_owned())),
            };
        }
        let (source, ty) = match name {
            "cpu" | "CPU" => (FieldSource::Cpu, FieldType::Number { size: 4, signed: true }),
            "comm" | "COMM" => (FieldSource::Comm, FieldType::String),
            "common_pid" => (FieldSource::CommonPid, FieldType::Number { size: 4, signed: true }),
            "common_type" | "common_flags" | "common_preempt_count" => {
                return Err(FieldError::NotOnHost(name.to_owned()))
            }
            _ => {
                return Err(FieldError::Unknown {
                    name: name.to_owned(),
                    known: self.args.iter().map(|(n, _)| n.clone()).collect(),
                })
            }
        };
        Ok(Field {
            name: name.to_owned(),
            source,
            ty,
        })
    }
}

impl Field {
    /// This field's value in `hit`. A fetch-arg is found at its index, or by its name when
    /// the hit's args are laid out otherwise (an event redefined with other args).
    pub fn value<'a>(&self, hit: &'a HitRecord) -> FieldValue<'a> {
        match &self.source {
            FieldSource::Arg(index) => {
                let arg = match hit.args.get(*index) {
                    Some((name, value)) if *name == self.name => Some(value),
                    _ => hit.args.iter().find(|(n, _)| *n == self.name).map(|(_, v)| v),
                };
                match (arg, self.ty) {
                    (Some(ArgValue::String(bytes)), FieldType::String) => FieldValue::Str(bytes),
                    (Some(ArgValue::Unsigned(v) | ArgValue::Hex(v)), FieldType::Number { .. }) => {
                        FieldValue::Number(*v)
                    }
                    (Some(ArgValue::Signed(v)), FieldType::Number { .. }) => FieldValue::Number(*v as u64),
                    (Some(ArgValue::Char(c)), FieldType::Number { .. }) => FieldValue::Number(u64::from(*c)),
                    (Some(ArgValue::Symbol { address, .. }), FieldType::Number { .. }) => FieldValue::Number(*address),
                    _ => FieldValue::Missing,
                }
            }
            FieldSource::CommonPid => FieldValue::Number(i64::from(hit.pid) as u64),
            FieldSource::Comm => FieldValue::Str(hit.comm.as_bytes()),
            FieldSource::Cpu => FieldValue::Number(hit.cpu as u64),
            FieldSource::Stacktrace => FieldValue::Missing,
        }
    }
}

#[cfg(test)]
mod tests;
