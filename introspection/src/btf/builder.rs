//! BTF blobs built by hand: for the parser's tests and the synthetic guests of other
//! readers' tests and fuzz targets.

use super::{TypeId, BTF_MAGIC, BTF_VERSION};

/// Builds BTF blobs by hand, for tests and synthetic guests.
pub struct Builder {
    types: Vec<u8>,
    strings: Vec<u8>,
    next_id: TypeId,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder::new()
    }
}

impl Builder {
    pub fn new() -> Builder {
        Builder {
            types: Vec::new(),
            strings: vec![0],
            next_id: 1,
        }
    }

    /// The offset of `s` in the string section (added), 0 for the empty name.
    pub fn str(&mut self, s: &str) -> u32 {
        if s.is_empty() {
            return 0;
        }
        let off = self.strings.len() as u32;
        self.strings.extend_from_slice(s.as_bytes());
        self.strings.push(0);
        off
    }

    /// A type of `kind` with its info word, size or type, and the kind's trailing words.
    pub fn raw(&mut self, name: &str, kind: u32, kflag: bool, vlen: u32, size_or_type: u32, tail: &[u32]) -> TypeId {
        let name_off = self.str(name);
        let info = (kind << 24) | vlen | if kflag { 1 << 31 } else { 0 };
        for w in [name_off, info, size_or_type].iter().chain(tail) {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
        self.next_id += 1;
        self.next_id - 1
    }

    pub fn int(&mut self, name: &str, size: u32, bits: u32, signed: bool) -> TypeId {
        self.raw(name, 1, false, 0, size, &[(if signed { 1 << 24 } else { 0 }) | bits])
    }

    /// A struct (or union, kind 5) with (name, type, bit offset, bitfield size) members.
    pub fn aggregate(
        &mut self,
        kind: u32,
        name: &str,
        size: u32,
        kflag: bool,
        members: &[(&str, TypeId, u32, u32)],
    ) -> TypeId {
        let mut tail = Vec::new();
        for &(n, t, off, bf) in members {
            tail.extend([self.str(n), t, if kflag { (bf << 24) | off } else { off }]);
        }
        self.raw(name, kind, kflag, members.len() as u32, size, &tail)
    }

    /// Bytes appended to the type section as they are (a record cut short, say).
    pub fn type_bytes(&mut self, bytes: &[u8]) {
        self.types.extend_from_slice(bytes);
    }

    /// The whole blob: header, types, strings.
    pub fn blob(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        b.extend_from_slice(&[BTF_VERSION, 0]);
        for w in [
            24u32,
            0,
            self.types.len() as u32,
            self.types.len() as u32,
            self.strings.len() as u32,
        ] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&self.types);
        b.extend_from_slice(&self.strings);
        b
    }
}
