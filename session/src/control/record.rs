//! A hit as the control socket streams it to a client that writes it itself
//! ([`StreamFormat::Record`](super::StreamFormat::Record): `hvprobe trace --perfetto
//! FILE`): every field of [`HitRecord`], each fetch-arg with its type, so that the client
//! holds the same record the run's own printer does (`--format json` prints values as text
//! and leaves out the entry time and the stack).

use hvprobe_arch::Gva;
use hvprobe_probes::fetch::ArgValue;
use hvprobe_probes::output::{HitRecord, StackFrame};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRecord {
    pub comm: String,
    pub pid: i32,
    pub cpu: usize,
    pub timestamp_ns: u64,
    pub group: String,
    pub event: String,
    pub location: String,
    pub retprobe_caller: Option<String>,
    pub args: Vec<(String, WireArg)>,
    pub entry_timestamp_ns: Option<u64>,
    /// `(address, symbol)` per frame, innermost first.
    pub stack: Option<Vec<(u64, Option<String>)>>,
}

/// [`ArgValue`], one to one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireArg {
    Unsigned(u64),
    Signed(i64),
    Hex(u64),
    Char(u8),
    Symbol { address: u64, description: Option<String> },
    String(Vec<u8>),
    Fault,
    Array(Vec<WireArg>),
}

impl From<&ArgValue> for WireArg {
    fn from(value: &ArgValue) -> Self {
        match value {
            ArgValue::Unsigned(v) => WireArg::Unsigned(*v),
            ArgValue::Signed(v) => WireArg::Signed(*v),
            ArgValue::Hex(v) => WireArg::Hex(*v),
            ArgValue::Char(c) => WireArg::Char(*c),
            ArgValue::Symbol { address, description } => WireArg::Symbol {
                address: *address,
                description: description.clone(),
            },
            ArgValue::String(bytes) => WireArg::String(bytes.clone()),
            ArgValue::Fault => WireArg::Fault,
            ArgValue::Array(items) => WireArg::Array(items.iter().map(WireArg::from).collect()),
        }
    }
}

impl From<WireArg> for ArgValue {
    fn from(value: WireArg) -> Self {
        match value {
            WireArg::Unsigned(v) => ArgValue::Unsigned(v),
            WireArg::Signed(v) => ArgValue::Signed(v),
            WireArg::Hex(v) => ArgValue::Hex(v),
            WireArg::Char(c) => ArgValue::Char(c),
            WireArg::Symbol { address, description } => ArgValue::Symbol { address, description },
            WireArg::String(bytes) => ArgValue::String(bytes),
            WireArg::Fault => ArgValue::Fault,
            WireArg::Array(items) => ArgValue::Array(items.into_iter().map(ArgValue::from).collect()),
        }
    }
}

impl From<&HitRecord> for WireRecord {
    fn from(hit: &HitRecord) -> Self {
        WireRecord {
            comm: hit.comm.clone(),
            pid: hit.pid,
            cpu: hit.cpu,
            timestamp_ns: hit.timestamp_ns,
            group: hit.group.clone(),
            event: hit.event.clone(),
            location: hit.location.clone(),
            retprobe_caller: hit.retprobe_caller.clone(),
            args: hit.args.iter().map(|(n, v)| (n.clone(), WireArg::from(v))).collect(),
            entry_timestamp_ns: hit.entry_timestamp_ns,
            stack: hit
                .stack
                .as_ref()
                .map(|frames| frames.iter().map(|f| (f.address.0, f.symbol.clone())).collect()),
        }
    }
}

impl From<WireRecord> for HitRecord {
    fn from(wire: WireRecord) -> Self {
        HitRecord {
            comm: wire.comm,
            pid: wire.pid,
            cpu: wire.cpu,
            timestamp_ns: wire.timestamp_ns,
            group: wire.group,
            event: wire.event,
            location: wire.location,
            retprobe_caller: wire.retprobe_caller,
            args: wire.args.into_iter().map(|(n, v)| (n, ArgValue::from(v))).collect(),
            entry_timestamp_ns: wire.entry_timestamp_ns,
            stack: wire.stack.map(|frames| {
                frames
                    .into_iter()
                    .map(|(address, symbol)| StackFrame {
                        address: Gva(address),
                        symbol,
                    })
                    .collect()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_crosses_the_socket_unchanged() {
        let hit = HitRecord {
            comm: "sh".into(),
            pid: 22,
            cpu: 1,
            timestamp_ns: 123_456_789,
            group: "io".into(),
            event: "read_ret".into(),
            location: "vfs_read+0x0/0x140".into(),
            retprobe_caller: Some("ksys_read+0x6b/0x9c".into()),
            args: vec![
                ("u".into(), ArgValue::Unsigned(u64::MAX)),
                ("s".into(), ArgValue::Signed(-5)),
                ("x".into(), ArgValue::Hex(0xff)),
                (
                    "sym".into(),
                    ArgValue::Symbol {
                        address: 0xffff_ffff_8100_0000,
                        description: None,
                    },
                ),
                ("str".into(), ArgValue::String(vec![b'a', 0xff, b'\n'])),
                ("f".into(), ArgValue::Fault),
                (
                    "arr".into(),
                    ArgValue::Array(vec![ArgValue::Unsigned(1), ArgValue::Fault]),
                ),
            ],
            entry_timestamp_ns: Some(100),
            stack: Some(vec![StackFrame {
                address: Gva(0xffff_ffff_8115_707b),
                symbol: Some("vfs_read+0x0/0x140".into()),
            }]),
        };
        let line = serde_json::to_string(&WireRecord::from(&hit)).unwrap();
        let back: WireRecord = serde_json::from_str(&line).unwrap();
        assert_eq!(HitRecord::from(back), hit);
    }
}
