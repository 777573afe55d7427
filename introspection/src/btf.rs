//! BTF (BPF Type Format): the kernel's own compact description of its C types.
//!
//! A kernel built with `CONFIG_DEBUG_INFO_BTF=y` carries a `.BTF` section (made by pahole
//! from the DWARF at link time) that is loaded with the rest of the image between the
//! symbols `__start_BTF` and `__stop_BTF`, and is exported as `/sys/kernel/btf/vmlinux`.
//! The host reads it to learn struct layouts (`task_struct.comm`, `pid`, ...) of exactly the
//! kernel that runs, without DWARF and without guessing per version.
//!
//! Format: `include/uapi/linux/btf.h` and `Documentation/bpf/btf.rst` of the kernel. A
//! header, then a type section (records of 12 bytes plus per-kind trailing data; type
//! ids start at 1, 0 is `void`) and a string section. Only base BTF is handled (vmlinux),
//! not split BTF (modules), whose type ids continue those of a base.
//!
//! Nothing here trusts the input: every offset, length and count is checked, and malformed
//! data gives a [`BtfError`], never a panic.

use std::collections::HashSet;

use hvprobe_arch::Gva;

use crate::memory::{GuestVirtRead, MemoryError};

/// The BTF magic number, as read little-endian.
pub const BTF_MAGIC: u16 = 0xeb9f;
/// The only BTF version there is.
pub const BTF_VERSION: u8 = 1;
/// Size of the version-1 header; `hdr_len` may be larger (later fields are ignored).
pub const BTF_HEADER_LEN: usize = 24;
/// The kernel's limit on the number of types (`BTF_MAX_TYPE`).
pub const BTF_MAX_TYPE: u32 = 0x000f_ffff;
/// The largest BTF blob [`Btf::from_guest`] reads: a full distro kernel's is ~6 MB, so
/// anything much larger means the bounds it was given are wrong.
pub const MAX_GUEST_BTF_LEN: u64 = 64 << 20;
/// How many typedefs/modifiers/nested anonymous members are followed before the data is
/// declared cyclic (the kernel itself allows 32 levels).
const MAX_RESOLVE_DEPTH: usize = 32;
/// BTF does not record the pointer size; every guest hvprobe reads is x86-64 (LP64).
const POINTER_SIZE: u64 = 8;

/// A BTF type id: 0 is `void`, real types are numbered from 1 in section order.
pub type TypeId = u32;

/// Why BTF could not be parsed or a question about it not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtfError {
    #[error("BTF data is {len} bytes, shorter than the {need}-byte header")]
    TruncatedHeader { len: usize, need: usize },
    #[error("bad BTF magic {0:#06x} (expected 0xeb9f; big-endian BTF is not supported)")]
    BadMagic(u16),
    #[error("unsupported BTF version {0} (only version 1 exists)")]
    UnsupportedVersion(u8),
    #[error("BTF header length {hdr_len} is invalid for {len} bytes of data")]
    BadHeaderLength { hdr_len: u32, len: usize },
    #[error("BTF {section} section (offset {off}, length {len}) lies outside the {avail} bytes after the header")]
    SectionOutOfBounds {
        section: &'static str,
        off: u32,
        len: u32,
        avail: usize,
    },
    #[error("BTF string section is empty or does not start and end with a NUL byte")]
    BadStringSection,
    #[error("BTF type {id} at byte {pos} of the type section needs {need} bytes, only {avail} remain")]
    TruncatedType {
        id: TypeId,
        pos: usize,
        need: u64,
        avail: usize,
    },
    #[error("BTF type {id} has unknown kind {kind}")]
    UnknownKind { id: TypeId, kind: u8 },
    #[error("BTF type {id} ({kind:?}) has vlen {vlen}, impossible for that kind")]
    BadVlen { id: TypeId, kind: Kind, vlen: u16 },
    #[error("BTF type {id} refers to string offset {off}, outside the {len}-byte string section")]
    BadNameOffset { id: TypeId, off: u32, len: usize },
    #[error("BTF has more than {BTF_MAX_TYPE} types")]
    TooManyTypes,
    #[error("BTF string at offset {0} is not UTF-8")]
    NonUtf8String(u32),
    #[error("BTF type id {0} does not exist")]
    NoSuchType(TypeId),
    #[error("no struct named `{0}` in the BTF")]
    StructNotFound(String),
    #[error("`{container}` has no member `{member}`")]
    MemberNotFound { container: String, member: String },
    #[error("`{container}` member `{member}` is not a struct or union, so it has no member `{next}`")]
    NotAggregate {
        container: String,
        member: String,
        next: String,
    },
    #[error("BTF type {id} ({kind}) has no size")]
    Unsized { id: TypeId, kind: &'static str },
    #[error("BTF type chain starting at type {0} is deeper than {MAX_RESOLVE_DEPTH} (cyclic?)")]
    TooDeep(TypeId),
    #[error("size of BTF type {0} overflows 64 bits")]
    SizeOverflow(TypeId),
    #[error("BTF bounds in guest memory are reversed: start {start}, stop {stop}")]
    BadGuestRange { start: Gva, stop: Gva },
    #[error("BTF in guest memory would be {0} bytes, more than the {MAX_GUEST_BTF_LEN} accepted (wrong bounds?)")]
    GuestTooLarge(u64),
    #[error("reading BTF from guest memory: {0}")]
    Memory(#[from] MemoryError),
}

/// The kind of a BTF type (`BTF_KIND_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Int,
    Ptr,
    Array,
    Struct,
    Union,
    Enum,
    Fwd,
    Typedef,
    Volatile,
    Const,
    Restrict,
    Func,
    FuncProto,
    Var,
    Datasec,
    Float,
    DeclTag,
    TypeTag,
    Enum64,
}

impl Kind {
    fn from_raw(raw: u8) -> Option<Kind> {
        Some(match raw {
            1 => Kind::Int,
            2 => Kind::Ptr,
            3 => Kind::Array,
            4 => Kind::Struct,
            5 => Kind::Union,
            6 => Kind::Enum,
            7 => Kind::Fwd,
            8 => Kind::Typedef,
            9 => Kind::Volatile,
            10 => Kind::Const,
            11 => Kind::Restrict,
            12 => Kind::Func,
            13 => Kind::FuncProto,
            14 => Kind::Var,
            15 => Kind::Datasec,
            16 => Kind::Float,
            17 => Kind::DeclTag,
            18 => Kind::TypeTag,
            19 => Kind::Enum64,
            _ => return None,
        })
    }

    /// The lower-case C-ish name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Int => "int",
            Kind::Ptr => "ptr",
            Kind::Array => "array",
            Kind::Struct => "struct",
            Kind::Union => "union",
            Kind::Enum => "enum",
            Kind::Fwd => "fwd",
            Kind::Typedef => "typedef",
            Kind::Volatile => "volatile",
            Kind::Const => "const",
            Kind::Restrict => "restrict",
            Kind::Func => "func",
            Kind::FuncProto => "func_proto",
            Kind::Var => "var",
            Kind::Datasec => "datasec",
            Kind::Float => "float",
            Kind::DeclTag => "decl_tag",
            Kind::TypeTag => "type_tag",
            Kind::Enum64 => "enum64",
        }
    }

    /// Kinds that only qualify or rename another type (no layout of their own).
    fn is_alias(self) -> bool {
        matches!(
            self,
            Kind::Typedef | Kind::Volatile | Kind::Const | Kind::Restrict | Kind::TypeTag
        )
    }
}

/// A struct or union member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Offset of the name in the string section (0: anonymous).
    pub name_off: u32,
    pub type_id: TypeId,
    /// Offset from the start of the containing struct/union, in bits.
    pub bit_offset: u32,
    /// Width of a bitfield in bits; 0 when the member is not a bitfield (or when the
    /// container's kind_flag is clear, where the width lives in the INT type instead).
    pub bitfield_size: u8,
}

/// An enumerator of an ENUM or ENUM64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enumerator {
    pub name_off: u32,
    /// The value: ENUM values are sign- or zero-extended as the kind_flag says; ENUM64
    /// values are the 64 stored bits (reinterpreted as signed).
    pub value: i64,
}

/// A parameter of a FUNC_PROTO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub name_off: u32,
    pub type_id: TypeId,
}

/// A variable of a DATASEC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VarSecinfo {
    pub type_id: TypeId,
    pub offset: u32,
    pub size: u32,
}

/// The kind-specific data following a type record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeData {
    /// PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG.
    None,
    Int {
        /// `BTF_INT_SIGNED` (1), `BTF_INT_CHAR` (2), `BTF_INT_BOOL` (4).
        encoding: u8,
        bit_offset: u8,
        bits: u8,
    },
    Array {
        elem_type: TypeId,
        index_type: TypeId,
        nelems: u32,
    },
    /// STRUCT, UNION.
    Members(Vec<Member>),
    /// ENUM, ENUM64.
    Enumerators(Vec<Enumerator>),
    /// FUNC_PROTO.
    Params(Vec<Param>),
    Var {
        linkage: u32,
    },
    Datasec(Vec<VarSecinfo>),
    DeclTag {
        component_idx: i32,
    },
}

/// One BTF type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BtfType {
    pub name_off: u32,
    pub kind: Kind,
    pub kind_flag: bool,
    pub vlen: u16,
    /// `size` for INT, ENUM, STRUCT, UNION, DATASEC, FLOAT, ENUM64; `type` (a [`TypeId`])
    /// for the others.
    pub size_or_type: u32,
    pub data: TypeData,
}

/// Where a struct member lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberInfo {
    /// Byte offset from the start of the outermost struct (rounded down for bitfields).
    pub offset: u64,
    /// Size in bytes of the member's type, typedefs and qualifiers resolved.
    pub size: u64,
    /// The member's type as declared.
    pub type_id: TypeId,
    /// Offset in bits from the start of the outermost struct.
    pub bit_offset: u64,
    /// Bitfield width in bits, 0 if the member is not a bitfield.
    pub bitfield_size: u8,
}

/// Parsed BTF: the types (index `id - 1`) and the string section.
#[derive(Debug, Clone)]
pub struct Btf {
    types: Vec<BtfType>,
    strings: Vec<u8>,
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `len` bytes at `off` of `data`, or the section error.
fn section<'a>(data: &'a [u8], name: &'static str, off: u32, len: u32) -> Result<&'a [u8], BtfError> {
    let end = off as u64 + len as u64;
    if end > data.len() as u64 {
        return Err(BtfError::SectionOutOfBounds {
            section: name,
            off,
            len,
            avail: data.len(),
        });
    }
    Ok(&data[off as usize..end as usize])
}

impl Btf {
    /// Parses a complete BTF blob (the `.BTF` section, `/sys/kernel/btf/vmlinux`, or the
    /// bytes between `__start_BTF` and `__stop_BTF`).
    pub fn parse(blob: &[u8]) -> Result<Btf, BtfError> {
        if blob.len() < BTF_HEADER_LEN {
            return Err(BtfError::TruncatedHeader {
                len: blob.len(),
                need: BTF_HEADER_LEN,
            });
        }
        let magic = le_u16(blob, 0);
        if magic != BTF_MAGIC {
            return Err(BtfError::BadMagic(magic));
        }
        if blob[2] != BTF_VERSION {
            return Err(BtfError::UnsupportedVersion(blob[2]));
        }
        let hdr_len = le_u32(blob, 4);
        if (hdr_len as usize) < BTF_HEADER_LEN || hdr_len as u64 > blob.len() as u64 {
            return Err(BtfError::BadHeaderLength {
                hdr_len,
                len: blob.len(),
            });
        }
        let (type_off, type_len) = (le_u32(blob, 8), le_u32(blob, 12));
        let (str_off, str_len) = (le_u32(blob, 16), le_u32(blob, 20));
        // Section offsets count from the end of the header.
        let data = &blob[hdr_len as usize..];
        let type_sec = section(data, "type", type_off, type_len)?;
        let strings = section(data, "string", str_off, str_len)?;
        // Name offset 0 must be the empty name, and a final NUL means that every in-bounds
        // offset starts a terminated string.
        if strings.first() != Some(&0) || strings.last() != Some(&0) {
            return Err(BtfError::BadStringSection);
        }
        let types = parse_types(type_sec, strings.len())?;
        Ok(Btf {
            types,
            strings: strings.to_vec(),
        })
    }

    /// Reads the BTF blob the guest kernel loaded between `start` (`__start_BTF`) and
    /// `stop` (`__stop_BTF`) and parses it.
    pub fn from_guest(reader: &impl GuestVirtRead, start: Gva, stop: Gva) -> Result<Btf, BtfError> {
        let len = stop
            .0
            .checked_sub(start.0)
            .ok_or(BtfError::BadGuestRange { start, stop })?;
        if len > MAX_GUEST_BTF_LEN {
            return Err(BtfError::GuestTooLarge(len));
        }
        let mut blob = vec![0u8; len as usize];
        reader.read_virt(start, &mut blob)?;
        Btf::parse(&blob)
    }

    /// Number of types (the largest valid id).
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// Whether there are no types at all.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    /// Every type with its id.
    pub fn types(&self) -> impl Iterator<Item = (TypeId, &BtfType)> {
        self.types.iter().enumerate().map(|(i, t)| (i as TypeId + 1, t))
    }

    /// The type with id `id` (`void`, id 0, is not a stored type).
    pub fn type_by_id(&self, id: TypeId) -> Result<&BtfType, BtfError> {
        id.checked_sub(1)
            .and_then(|i| self.types.get(i as usize))
            .ok_or(BtfError::NoSuchType(id))
    }

    /// The string at `off` of the string section ("" for 0).
    pub fn string(&self, off: u32) -> Result<&str, BtfError> {
        let tail = self.strings.get(off as usize..).ok_or(BtfError::BadNameOffset {
            id: 0,
            off,
            len: self.strings.len(),
        })?;
        // The section ends with NUL (checked by parse), so a terminator exists.
        let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
        std::str::from_utf8(&tail[..end]).map_err(|_| BtfError::NonUtf8String(off))
    }

    /// The name of type `id` ("" for anonymous types and for `void`).
    pub fn type_name(&self, id: TypeId) -> Result<&str, BtfError> {
        if id == 0 {
            return Ok("");
        }
        self.string(self.type_by_id(id)?.name_off)
    }

    /// The first type of kind `kind` named `name`.
    pub fn find_type(&self, name: &str, kind: Kind) -> Option<TypeId> {
        // pahole deduplicates, so a name normally appears once per kind; when two
        // incompatible definitions survive, the first is as good a guess as any.
        self.types()
            .find(|(_, t)| t.kind == kind && self.string(t.name_off).is_ok_and(|n| n == name))
            .map(|(id, _)| id)
    }

    /// The struct named `name` (a full definition, not a forward declaration).
    pub fn find_struct(&self, name: &str) -> Result<TypeId, BtfError> {
        self.find_type(name, Kind::Struct)
            .ok_or_else(|| BtfError::StructNotFound(name.to_string()))
    }

    /// Follows typedefs and qualifiers (const, volatile, restrict, type tags) from `id` to
    /// the underlying type.
    pub fn resolve(&self, id: TypeId) -> Result<TypeId, BtfError> {
        let mut cur = id;
        for _ in 0..MAX_RESOLVE_DEPTH {
            if cur == 0 {
                return Ok(0);
            }
            let t = self.type_by_id(cur)?;
            if !t.kind.is_alias() {
                return Ok(cur);
            }
            cur = t.size_or_type;
        }
        Err(BtfError::TooDeep(id))
    }

    /// The size in bytes of type `id`, through typedefs, qualifiers and arrays.
    pub fn type_size(&self, id: TypeId) -> Result<u64, BtfError> {
        self.type_size_at(id, 0)
    }

    fn type_size_at(&self, id: TypeId, depth: usize) -> Result<u64, BtfError> {
        if depth > MAX_RESOLVE_DEPTH {
            return Err(BtfError::TooDeep(id));
        }
        let rid = self.resolve(id)?;
        if rid == 0 {
            return Err(BtfError::Unsized { id, kind: "void" });
        }
        let t = self.type_by_id(rid)?;
        match (&t.kind, &t.data) {
            (Kind::Int | Kind::Enum | Kind::Enum64 | Kind::Struct | Kind::Union | Kind::Float | Kind::Datasec, _) => {
                Ok(t.size_or_type as u64)
            }
            (Kind::Ptr, _) => Ok(POINTER_SIZE),
            (Kind::Array, TypeData::Array { elem_type, nelems, .. }) => {
                let elem = self.type_size_at(*elem_type, depth + 1)?;
                elem.checked_mul(*nelems as u64).ok_or(BtfError::SizeOverflow(rid))
            }
            (kind, _) => Err(BtfError::Unsized {
                id: rid,
                kind: kind.name(),
            }),
        }
    }

    /// Where `member` lives in the struct named `struct_name`. Members of nested anonymous
    /// structs and unions are found as in C (`task_struct.pid` wherever it is nested), and
    /// a dotted path (`"thread.sp"`) descends into embedded (not pointed-to) structs.
    pub fn member_offset(&self, struct_name: &str, member: &str) -> Result<MemberInfo, BtfError> {
        let id = self.find_struct(struct_name)?;
        self.member_path(id, struct_name, member)
    }

    /// Like [`Btf::member_offset`] for a struct or union given by id.
    pub fn member_path(&self, container: TypeId, container_name: &str, path: &str) -> Result<MemberInfo, BtfError> {
        let mut cur = container;
        let mut cur_name = container_name.to_string();
        let mut base_bits = 0u64;
        let mut found: Option<MemberInfo> = None;
        for part in path.split('.') {
            if let Some(prev) = found {
                // Descend into the previous component, which must be an embedded aggregate.
                let rid = self.resolve(prev.type_id)?;
                let agg = rid != 0 && matches!(self.type_by_id(rid)?.kind, Kind::Struct | Kind::Union);
                if !agg {
                    return Err(BtfError::NotAggregate {
                        container: container_name.to_string(),
                        member: cur_name,
                        next: part.to_string(),
                    });
                }
                cur = rid;
                base_bits = prev.bit_offset;
            }
            let (type_id, bits, bitfield_size) =
                self.find_member(cur, part, 0, &mut HashSet::new())?
                    .ok_or_else(|| BtfError::MemberNotFound {
                        container: cur_name.clone(),
                        member: part.to_string(),
                    })?;
            let bit_offset = base_bits + bits;
            found = Some(MemberInfo {
                offset: bit_offset / 8,
                size: self.type_size(type_id)?,
                type_id,
                bit_offset,
                bitfield_size,
            });
            cur_name = part.to_string();
        }
        // `split` yields at least one part, so `found` is set (or we returned an error).
        found.ok_or_else(|| BtfError::MemberNotFound {
            container: container_name.to_string(),
            member: path.to_string(),
        })
    }

    /// Finds a member named `name` in struct/union `id`, looking inside anonymous members.
    /// Returns (type, bit offset from the start of `id`, bitfield width).
    ///
    /// `searched` holds the aggregates already searched for `name` without a match: the
    /// answer does not depend on where an aggregate is reached from, so each is searched
    /// once. Without it, BTF from a hostile guest where every level holds three anonymous
    /// members of the next costs 3^depth visits (30 levels in 1.5 KB take months, issue
    /// 24); with it the search is linear in the number of members.
    fn find_member(
        &self,
        id: TypeId,
        name: &str,
        depth: usize,
        searched: &mut HashSet<TypeId>,
    ) -> Result<Option<(TypeId, u64, u8)>, BtfError> {
        if depth > MAX_RESOLVE_DEPTH {
            return Err(BtfError::TooDeep(id));
        }
        if searched.contains(&id) {
            return Ok(None);
        }
        let t = self.type_by_id(id)?;
        let TypeData::Members(members) = &t.data else {
            return Ok(None);
        };
        for m in members {
            let mname = self.string(m.name_off)?;
            if mname == name {
                return Ok(Some((m.type_id, m.bit_offset as u64, m.bitfield_size)));
            }
            if mname.is_empty() {
                let rid = self.resolve(m.type_id)?;
                if rid != 0 && matches!(self.type_by_id(rid)?.kind, Kind::Struct | Kind::Union) {
                    if let Some((tid, bits, bf)) = self.find_member(rid, name, depth + 1, searched)? {
                        return Ok(Some((tid, m.bit_offset as u64 + bits, bf)));
                    }
                }
            }
        }
        searched.insert(id);
        Ok(None)
    }
}

/// Bytes of trailing data of a type of kind `kind` with `vlen` entries, or the vlen error.
fn trailing_len(id: TypeId, kind: Kind, vlen: u16) -> Result<u64, BtfError> {
    let per_entry: u64 = match kind {
        Kind::Struct | Kind::Union | Kind::Datasec | Kind::Enum64 => 12,
        Kind::Enum | Kind::FuncProto => 8,
        // FUNC's vlen is its linkage: static, global or extern.
        Kind::Func if vlen <= 2 => return Ok(0),
        _ if vlen != 0 => return Err(BtfError::BadVlen { id, kind, vlen }),
        Kind::Int | Kind::Var | Kind::DeclTag => return Ok(4),
        Kind::Array => return Ok(12),
        _ => return Ok(0),
    };
    Ok(per_entry * vlen as u64)
}

fn parse_types(sec: &[u8], str_len: usize) -> Result<Vec<BtfType>, BtfError> {
    let mut types = Vec::new();
    let mut pos = 0usize;
    while pos < sec.len() {
        if types.len() >= BTF_MAX_TYPE as usize {
            return Err(BtfError::TooManyTypes);
        }
        let id = types.len() as TypeId + 1;
        let avail = sec.len() - pos;
        if avail < 12 {
            return Err(BtfError::TruncatedType {
                id,
                pos,
                need: 12,
                avail,
            });
        }
        let name_off = le_u32(sec, pos);
        let info = le_u32(sec, pos + 4);
        let size_or_type = le_u32(sec, pos + 8);
        let raw_kind = ((info >> 24) & 0x1f) as u8;
        let kind = Kind::from_raw(raw_kind).ok_or(BtfError::UnknownKind { id, kind: raw_kind })?;
        let vlen = (info & 0xffff) as u16;
        let kind_flag = info >> 31 != 0;
        let extra = trailing_len(id, kind, vlen)?;
        if 12 + extra > avail as u64 {
            return Err(BtfError::TruncatedType {
                id,
                pos,
                need: 12 + extra,
                avail,
            });
        }
        let check_name = |off: u32| {
            if (off as usize) < str_len {
                Ok(off)
            } else {
                Err(BtfError::BadNameOffset { id, off, len: str_len })
            }
        };
        check_name(name_off)?;
        let body = &sec[pos + 12..pos + 12 + extra as usize];
        let entries = |size: usize| body.chunks_exact(size);
        let data = match kind {
            Kind::Int => {
                let v = le_u32(body, 0);
                TypeData::Int {
                    encoding: ((v >> 24) & 0x0f) as u8,
                    bit_offset: ((v >> 16) & 0xff) as u8,
                    bits: (v & 0xff) as u8,
                }
            }
            Kind::Array => TypeData::Array {
                elem_type: le_u32(body, 0),
                index_type: le_u32(body, 4),
                nelems: le_u32(body, 8),
            },
            Kind::Struct | Kind::Union => TypeData::Members(
                entries(12)
                    .map(|e| {
                        let raw = le_u32(e, 8);
                        // With kind_flag set, the top 8 bits of the offset are the bitfield
                        // width; without it, the whole word is the bit offset.
                        let (bit_offset, bitfield_size) = if kind_flag {
                            (raw & 0x00ff_ffff, (raw >> 24) as u8)
                        } else {
                            (raw, 0)
                        };
                        Ok(Member {
                            name_off: check_name(le_u32(e, 0))?,
                            type_id: le_u32(e, 4),
                            bit_offset,
                            bitfield_size,
                        })
                    })
                    .collect::<Result<_, BtfError>>()?,
            ),
            Kind::Enum => TypeData::Enumerators(
                entries(8)
                    .map(|e| {
                        let raw = le_u32(e, 4);
                        // kind_flag: signed enum (since 6.0); older BTF leaves it clear and
                        // stores values as s32, which zero-extension keeps for ≥ 0 values.
                        let value = if kind_flag { raw as i32 as i64 } else { raw as i64 };
                        Ok(Enumerator {
                            name_off: check_name(le_u32(e, 0))?,
                            value,
                        })
                    })
                    .collect::<Result<_, BtfError>>()?,
            ),
            Kind::Enum64 => TypeData::Enumerators(
                entries(12)
                    .map(|e| {
                        let value = (((le_u32(e, 8) as u64) << 32) | le_u32(e, 4) as u64) as i64;
                        Ok(Enumerator {
                            name_off: check_name(le_u32(e, 0))?,
                            value,
                        })
                    })
                    .collect::<Result<_, BtfError>>()?,
            ),
            Kind::FuncProto => TypeData::Params(
                entries(8)
                    .map(|e| {
                        Ok(Param {
                            name_off: check_name(le_u32(e, 0))?,
                            type_id: le_u32(e, 4),
                        })
                    })
                    .collect::<Result<_, BtfError>>()?,
            ),
            Kind::Var => TypeData::Var {
                linkage: le_u32(body, 0),
            },
            Kind::Datasec => TypeData::Datasec(
                entries(12)
                    .map(|e| VarSecinfo {
                        type_id: le_u32(e, 0),
                        offset: le_u32(e, 4),
                        size: le_u32(e, 8),
                    })
                    .collect(),
            ),
            Kind::DeclTag => TypeData::DeclTag {
                component_idx: le_u32(body, 0) as i32,
            },
            Kind::Ptr
            | Kind::Fwd
            | Kind::Typedef
            | Kind::Volatile
            | Kind::Const
            | Kind::Restrict
            | Kind::Func
            | Kind::Float
            | Kind::TypeTag => TypeData::None,
        };
        types.push(BtfType {
            name_off,
            kind,
            kind_flag,
            vlen,
            size_or_type,
            data,
        });
        pos += 12 + extra as usize;
    }
    Ok(types)
}

#[cfg(any(test, feature = "test-support"))]
pub mod builder;

#[cfg(test)]
mod tests {
    use super::*;

    use builder::Builder;

    /// A miniature task_struct using every kind, with the layout quirks the real one has:
    /// members inside anonymous structs/unions, bitfields, typedef'd and const types.
    fn sample() -> (Vec<u8>, TypeId) {
        let mut b = Builder::new();
        let int = b.int("int", 4, 32, true); // 1
        let ch = b.int("char", 1, 8, true); // 2
        let u32t = b.int("unsigned int", 4, 32, false); // 3
        let pid_t = b.raw("pid_t", 8, false, 0, int, &[]); // 4 typedef
        let cpid = b.raw("", 10, false, 0, pid_t, &[]); // 5 const pid_t
        let vol = b.raw("", 9, false, 0, cpid, &[]); // 6 volatile const pid_t
        let comm = b.raw("", 3, false, 0, 0, &[ch, int, 16]); // 7 char[16]
        let ptr = b.raw("", 2, false, 0, 0, &[]); // 8 void *
        let inner = b.aggregate(4, "", 8, true, &[("flags", u32t, 0, 3), ("pid", vol, 32, 0)]); // 9
        let anon_union = b.aggregate(5, "", 8, false, &[("", inner, 0, 0), ("raw", ptr, 0, 0)]); // 10
        let running = b.str("RUNNING");
        let en = b.raw("state", 6, true, 2, 4, &[running, u32::MAX, 0, 0]); // 11 enum
        let fwd = b.raw("mm_struct", 7, false, 0, 0, &[]); // 12
        let arg = b.str("arg");
        let proto = b.raw("", 13, false, 2, int, &[0, int, arg, ptr]); // 13
        let func = b.raw("do_thing", 12, false, 1, proto, &[]); // 14
        let var = b.raw("current_task", 14, false, 0, ptr, &[1]); // 15
        let sec = b.raw(".data..percpu", 15, false, 1, 8, &[var, 0, 8]); // 16
        let float = b.raw("double", 16, false, 0, 8, &[]); // 17
        let tag = b.raw("user", 17, false, 0, func, &[u32::MAX]); // 18 decl_tag
        let ttag = b.raw("rcu", 18, false, 0, ptr, &[]); // 19 type_tag
        let e64 = b.raw("big", 19, false, 1, 8, &[0, 0xdead_beef, 0x1]); // 20 enum64
        let rst = b.raw("", 11, false, 0, ttag, &[]); // 21 restrict
        let task = b.aggregate(
            4,
            "task_struct",
            48,
            false,
            &[
                ("state", en, 0, 0),
                ("", anon_union, 64, 0),
                ("tgid", pid_t, 128, 0),
                ("comm", comm, 160, 0),
                ("mm", fwd, 288, 0),
                ("f", float, 320, 0),
                ("p", rst, 320, 0),
            ],
        ); // 22
        let outer = b.aggregate(4, "outer", 56, false, &[("x", int, 0, 0), ("task", task, 64, 0)]); // 23
        let _ = (sec, tag, e64, outer);
        (b.blob(), task)
    }

    #[test]
    fn parses_every_kind_and_finds_nested_members() {
        let (blob, task) = sample();
        let btf = Btf::parse(&blob).unwrap();
        assert_eq!(btf.len(), 23);
        assert_eq!(btf.find_struct("task_struct").unwrap(), task);
        let kinds: Vec<Kind> = btf.types().map(|(_, t)| t.kind).collect();
        for k in [
            Kind::Int,
            Kind::Ptr,
            Kind::Array,
            Kind::Struct,
            Kind::Union,
            Kind::Enum,
            Kind::Fwd,
            Kind::Typedef,
            Kind::Volatile,
            Kind::Const,
            Kind::Restrict,
            Kind::Func,
            Kind::FuncProto,
            Kind::Var,
            Kind::Datasec,
            Kind::Float,
            Kind::DeclTag,
            Kind::TypeTag,
            Kind::Enum64,
        ] {
            assert!(kinds.contains(&k), "{k:?} missing");
        }

        let comm = btf.member_offset("task_struct", "comm").unwrap();
        assert_eq!((comm.offset, comm.size, comm.bitfield_size), (20, 16, 0));
        // pid: through an anonymous union, then an anonymous struct, volatile/const/typedef.
        let pid = btf.member_offset("task_struct", "pid").unwrap();
        assert_eq!((pid.offset, pid.size, pid.bit_offset), (12, 4, 96));
        let flags = btf.member_offset("task_struct", "flags").unwrap();
        assert_eq!((flags.offset, flags.size, flags.bitfield_size), (8, 4, 3));
        assert_eq!(btf.member_offset("task_struct", "tgid").unwrap().offset, 16);
        assert_eq!(btf.member_offset("task_struct", "p").unwrap().size, 8);
        assert_eq!(btf.member_offset("task_struct", "state").unwrap().size, 4);
        assert_eq!(btf.member_offset("outer", "task.comm").unwrap().offset, 8 + 20);
        assert_eq!(btf.member_offset("outer", "task.pid").unwrap().offset, 8 + 12);

        assert!(matches!(
            btf.member_offset("task_struct", "nope"),
            Err(BtfError::MemberNotFound { .. })
        ));
        assert!(matches!(
            btf.member_offset("outer", "x.y"),
            Err(BtfError::NotAggregate { .. })
        ));
        assert!(matches!(
            btf.member_offset("nope", "x"),
            Err(BtfError::StructNotFound(_))
        ));
        // A forward declaration has no size.
        assert!(matches!(
            btf.member_offset("task_struct", "mm"),
            Err(BtfError::Unsized { kind: "fwd", .. })
        ));

        let (_, en) = btf.types().find(|(_, t)| t.kind == Kind::Enum).unwrap();
        let TypeData::Enumerators(vals) = &en.data else {
            panic!("enum data")
        };
        assert_eq!(btf.string(vals[0].name_off).unwrap(), "RUNNING");
        assert_eq!(vals[0].value, -1, "kind_flag enum is signed");
        let (_, e64) = btf.types().find(|(_, t)| t.kind == Kind::Enum64).unwrap();
        let TypeData::Enumerators(vals) = &e64.data else {
            panic!("enum64 data")
        };
        assert_eq!(vals[0].value, 0x1_dead_beef);
        let (_, proto) = btf.types().find(|(_, t)| t.kind == Kind::FuncProto).unwrap();
        let TypeData::Params(params) = &proto.data else {
            panic!("params")
        };
        assert_eq!(btf.string(params[1].name_off).unwrap(), "arg");
    }

    fn expect_err(blob: &[u8]) -> BtfError {
        match Btf::parse(blob) {
            Ok(_) => panic!("malformed BTF parsed"),
            Err(e) => e,
        }
    }

    #[test]
    fn malformed_input_gives_errors() {
        let (blob, _) = sample();
        assert!(matches!(
            expect_err(&blob[..10]),
            BtfError::TruncatedHeader { len: 10, .. }
        ));
        assert!(matches!(expect_err(&[]), BtfError::TruncatedHeader { .. }));

        let mut bad = blob.clone();
        bad[0] = 0xeb;
        bad[1] = 0x9f; // big-endian magic
        assert_eq!(expect_err(&bad), BtfError::BadMagic(0xeb9f_u16.swap_bytes()));

        let mut bad = blob.clone();
        bad[2] = 2;
        assert_eq!(expect_err(&bad), BtfError::UnsupportedVersion(2));

        let mut bad = blob.clone();
        bad[4..8].copy_from_slice(&(blob.len() as u32 + 1).to_le_bytes());
        assert!(matches!(expect_err(&bad), BtfError::BadHeaderLength { .. }));

        // type_len past the end of the data.
        let mut bad = blob.clone();
        bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            expect_err(&bad),
            BtfError::SectionOutOfBounds { section: "type", .. }
        ));
        // type_off + type_len overflowing 32 bits must not wrap around.
        let mut bad = blob.clone();
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(expect_err(&bad), BtfError::SectionOutOfBounds { .. }));

        // Truncating the blob cuts the string section.
        assert!(matches!(
            expect_err(&blob[..blob.len() - 1]),
            BtfError::SectionOutOfBounds { section: "string", .. }
        ));

        // Kinds that take no vlen, with one.
        let mut b = Builder::new();
        b.raw("p", 2, false, 3, 0, &[]);
        assert!(matches!(
            expect_err(&b.blob()),
            BtfError::BadVlen {
                id: 1,
                kind: Kind::Ptr,
                vlen: 3
            }
        ));
        let mut b = Builder::new();
        b.raw("f", 12, false, 3, 0, &[]);
        assert!(matches!(
            expect_err(&b.blob()),
            BtfError::BadVlen { kind: Kind::Func, .. }
        ));
        // A struct claiming 0xffff members in a small section.
        let mut b = Builder::new();
        b.int("int", 4, 32, true);
        b.raw("s", 4, false, 0xffff, 4, &[0, 1, 0]);
        assert!(matches!(
            expect_err(&b.blob()),
            BtfError::TruncatedType {
                id: 2,
                need: 786_432,
                ..
            }
        ));
        // Unknown kinds (0 and 20..31) cannot be skipped.
        for kind in [0, 20, 31] {
            let mut b = Builder::new();
            b.raw("x", kind, false, 0, 0, &[]);
            assert!(matches!(expect_err(&b.blob()), BtfError::UnknownKind { id: 1, .. }));
        }
        // Names pointing past the strings, and strings without their NULs.
        let mut b = Builder::new();
        b.int("int", 4, 32, true);
        let mut bad = b.blob();
        bad[24..28].copy_from_slice(&1000u32.to_le_bytes());
        assert!(matches!(
            expect_err(&bad),
            BtfError::BadNameOffset { id: 1, off: 1000, .. }
        ));
        let mut bad = b.blob();
        *bad.last_mut().unwrap() = b'x';
        assert_eq!(expect_err(&bad), BtfError::BadStringSection);
        // A trailing partial record.
        let mut b = Builder::new();
        b.int("int", 4, 32, true);
        b.type_bytes(&[0; 5]);
        assert!(matches!(expect_err(&b.blob()), BtfError::TruncatedType { id: 2, .. }));
    }

    #[test]
    fn cycles_and_dangling_ids_are_errors() {
        let mut b = Builder::new();
        b.raw("a", 8, false, 0, 2, &[]); // 1: typedef a -> 2
        b.raw("b", 8, false, 0, 1, &[]); // 2: typedef b -> 1
        b.raw("", 3, false, 0, 0, &[4, 1, 2]); // 3: array of self-containing... 4
        b.raw("", 3, false, 0, 0, &[3, 1, 2]); // 4: array of 3
        b.raw("", 2, false, 0, 99, &[]); // 5: pointer to nothing (size is still 8)
        b.raw("", 8, false, 0, 99, &[]); // 6: typedef of nothing
        let s = b.aggregate(4, "s", 4, false, &[("", 7, 0, 0)]); // 7: anonymous member of itself
        let btf = Btf::parse(&b.blob()).unwrap();
        assert_eq!(btf.type_size(1), Err(BtfError::TooDeep(1)));
        assert!(matches!(btf.type_size(3), Err(BtfError::TooDeep(_))));
        assert_eq!(btf.type_size(5), Ok(8));
        assert_eq!(btf.type_size(6), Err(BtfError::NoSuchType(99)));
        assert_eq!(btf.type_size(0), Err(BtfError::Unsized { id: 0, kind: "void" }));
        assert!(matches!(btf.member_path(s, "s", "x"), Err(BtfError::TooDeep(_))));
        assert_eq!(btf.type_by_id(0).unwrap_err(), BtfError::NoSuchType(0));
        assert_eq!(btf.type_by_id(8).unwrap_err(), BtfError::NoSuchType(8));
    }

    #[test]
    fn array_size_overflow_is_an_error() {
        let mut b = Builder::new();
        let int = b.int("long", 8, 64, true);
        let a = b.raw("", 3, false, 0, 0, &[int, int, u32::MAX]);
        b.raw("", 3, false, 0, 0, &[a, int, u32::MAX]);
        let btf = Btf::parse(&b.blob()).unwrap();
        assert_eq!(btf.type_size(a), Ok(8 * u32::MAX as u64));
        assert_eq!(btf.type_size(a + 1), Err(BtfError::SizeOverflow(a + 1)));
    }

    /// Anonymous members nest 30 levels deep, each level holding three
    /// anonymous members of the next, and `comm` comes after them. An unmemoized search
    /// visits 3^30 structs (months); the search must visit each struct once. Run on a
    /// thread so that a regression fails the test on the deadline instead of hanging it.
    #[test]
    fn anonymous_member_breadth_blow_up_is_linear() {
        let mut b = Builder::new();
        let int = b.int("int", 4, 32, true);
        const LEVELS: u32 = 30;
        // Ids: int = 1, the innermost struct = 2, its container = 3, ... task_struct last.
        let mut inner = b.aggregate(4, "", 4, false, &[("x", int, 0, 0)]);
        for _ in 1..LEVELS {
            inner = b.aggregate(
                4,
                "",
                4,
                false,
                &[("", inner, 0, 0), ("", inner, 0, 0), ("", inner, 0, 0)],
            );
        }
        b.aggregate(
            4,
            "task_struct",
            8,
            false,
            &[
                ("", inner, 0, 0),
                ("", inner, 0, 0),
                ("", inner, 0, 0),
                ("comm", int, 32, 0),
            ],
        );
        let blob = b.blob();
        assert!(blob.len() < 2048, "the attack is small: {} bytes", blob.len());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let btf = Btf::parse(&blob).unwrap();
            let _ = tx.send((
                btf.member_offset("task_struct", "comm"),
                btf.member_offset("task_struct", "nope"),
            ));
        });
        let (comm, missing) = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the member search took more than 5 s on 1.5 KB of BTF");
        assert_eq!(comm.unwrap().offset, 4);
        assert!(matches!(missing, Err(BtfError::MemberNotFound { .. })));
    }

    /// xorshift64*: a small deterministic generator, so failures reproduce.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Runs every query on whatever parsed, to reach the lookup code with garbage too.
    fn exercise(blob: &[u8]) {
        if let Ok(btf) = Btf::parse(blob) {
            for (id, t) in btf.types() {
                let _ = btf.type_size(id);
                let _ = btf.type_name(id);
                if matches!(t.kind, Kind::Struct | Kind::Union) {
                    for m in ["comm", "pid", "task.comm", "x"] {
                        let _ = btf.member_path(id, "?", m);
                    }
                }
            }
            let _ = btf.member_offset("task_struct", "pid");
        }
    }

    #[test]
    fn fuzz_random_bytes_mutations_and_truncations_never_panic() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (valid, _) = sample();
        for _ in 0..3000 {
            // Random bytes behind a valid header, so that the type parser is reached.
            let len = rng.below(400);
            let mut blob: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if blob.len() >= 24 && rng.below(2) == 0 {
                blob[..24].copy_from_slice(&valid[..24]);
            }
            exercise(&blob);
            // A valid blob with a few bytes changed.
            let mut m = valid.clone();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(m.len());
                m[i] = match rng.below(3) {
                    0 => rng.next() as u8,
                    1 => 0xff,
                    _ => m[i] ^ (1 << rng.below(8)),
                };
            }
            exercise(&m);
            exercise(&valid[..rng.below(valid.len() + 1)]);
        }
    }
}
